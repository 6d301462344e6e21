"""The surrogate owns its correction, in one process and on a rank of snlp.dist alike: `Surrogate.scan_step` (what
DistributedSNLP calls, with its cross-rank scan) over a run of chunks equals the single-process `step` of the same
iteration, for the whole run and for the plan's chunks split into two runs whose scans are composed the way the
ranks compose theirs (an exclusive scan of the first run's affine total). No processes are spawned here."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, mhc_model, tokens

from snlp.method.fusion import chunk_forward, chunk_weights
from snlp.method.plan import Plan
from snlp.method.scan import affine_scan
from snlp.method.surrogates import Iterate, shift

pytestmark = pytest.mark.usefixtures("one_thread")

PLANS = [("plain", "4xF1-h0-K2"), ("plain", "4xF1-h0-K2-elk:0.3-order:reversed"), ("plain", "4xF1-h0-K2-none"),
         ("plain", "4xF1-h0-K2-diag:fd-order:2.0.3.1"), ("plain", "4xF1-h0-K2-diag:jvp-subset:1.3"),
         ("mhc", "4xF1-h0-K2-hcn-order:reversed"), ("mhc", "4xF1-h0-K2-hcn")]


def _factors(plan: Plan, like: torch.Tensor, lo: int, hi: int):
    shape = (hi - lo, *[1] * (like.dim() - 1))
    return [torch.tensor(f[lo:hi], dtype=like.dtype).view(shape) for f in (plan.link_factors(), plan.lag_factors())]


@pytest.mark.parametrize("kind,plan", PLANS, ids=[p for _, p in PLANS])
def test_scan_step_over_runs_equals_the_single_process_step(kind, plan):
    model = mhc_model(seed=3) if kind == "mhc" else make_model(seed=3)
    plan = Plan.parse(plan).check_model(model.config)
    S, C, sur = plan.prefix_len(model.config.n_layer), plan.chunks, plan.surrogate
    idx = tokens(model, T=6)
    # DiagN fd divides the probe's difference by its step (1e-3 here): the round-off of chunk forwards batched over
    # another number of chunks (one run vs two) is amplified a thousandfold; the other surrogates add no division
    tol = 1e-9 if "diag:fd" in str(plan) else 1e-12
    with torch.no_grad():
        ctx = model.embed(idx)
        hS = model.run_layers(ctx.x0, ctx, 0, S)
        w = chunk_weights(model, S, C, 1)
        gen = torch.Generator().manual_seed(5)
        h = hS.expand(C, *hS.shape) + 0.1 * torch.randn((C, *hS.shape), generator=gen, dtype=hS.dtype)
        prev = 0.1 * torch.randn(h.shape, generator=gen, dtype=h.dtype)  # the previous sweep's update
        inputs = torch.cat([hS[None], h[:-1]], 0)
        tilde, mix = chunk_forward(w, inputs, ctx, mix=True) if sur.needs_mix else (chunk_forward(w, inputs, ctx), None)
        seed = lambda: torch.Generator().manual_seed(0) if sur.random else None  # noqa: E731  (as the solvers)
        lagged = plan.order is not None
        want_d, want_h = sur.step(Iterate(plan, w, ctx, inputs, tilde, h, mix, seed(), prev if lagged else None))
        # one run of all chunks (one rank)
        d, h1 = sur.scan_step(Iterate(plan, w, ctx, inputs, tilde, h, mix, seed()),
                              lambda a, b, m: affine_scan(a, b, m), *_factors(plan, h, 0, C),
                              shift(prev) if lagged else None)
        torch.testing.assert_close(d, want_d, rtol=tol, atol=tol)
        torch.testing.assert_close(h1, want_h, rtol=tol, atol=tol)
        # two runs (two ranks): chunks 0..1 and 2..3, the second's scan starting from the first's total
        runs, outs, total = [(0, 2), (2, 4)], [], None
        for lo, hi in runs:
            wr = chunk_weights(model, S + lo, hi - lo, 1)
            mr = None if mix is None else mix[lo:hi]

            def scan(a, b, m, total=total):
                d_loc = affine_scan(a, b, m)
                if total is None:
                    return d_loc
                return affine_scan(torch.cat([a[:1], a]), torch.cat([total[None], b]), m)[1:]

            dr, hr = sur.scan_step(Iterate(plan, wr, ctx, inputs[lo:hi], tilde[lo:hi], h[lo:hi], mr, seed(), chunk0=lo),
                                   scan, *_factors(plan, h, lo, hi), shift(prev)[lo:hi] if lagged else None)
            outs.append((dr, hr))
            total = dr[-1]
        torch.testing.assert_close(torch.cat([o[0] for o in outs]), want_d, rtol=tol, atol=tol)
        torch.testing.assert_close(torch.cat([o[1] for o in outs]), want_h, rtol=tol, atol=tol)


def test_exact_newton_has_no_scan_step():
    plan = Plan.parse("4xF1-h0-K2-newton")
    with pytest.raises(ValueError, match="not available distributed"):
        plan.surrogate.scan_step(None, None, None, None, None)

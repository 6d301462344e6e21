"""DiagN (Hutchinson FD/JVP/VJP + associative scan), exact Newton (DEER over depth) and adaptive
iterations (tol): exactness laws, estimator statistics, KV-cached decoding, training, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import make_model, tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from snlp import DiagN, Plan, bind, fused_forward, parallel_forward, solve
from snlp.method import jacobian as S
from snlp.model.cache import KVCache, RowPositions
from snlp.apps.cli import main
from snlp.method.fusion import chunk_forward, chunk_weights
from snlp.method.scan import affine_scan, sequential_scan, transfer_blocks, transfer_scan


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: threads only add contention


def test_python_api_plan_strings():
    model = make_model(seed=8, n_layer=9)
    idx = tokens(model)
    with torch.no_grad():
        ref = model(idx)
        for plan in ["8xF1-h0-K2-diag:vjp", "8xF1-h0-K2-diag:jvp-probes:2", "8xF1-fwd-K1-diag-subset:0.7",
                     "8xF1-h0-K3-newton", "8xF1-h0-K8-tol:1e-6"]:
            out = parallel_forward(model, idx, plan)
            assert out.shape == ref.shape and torch.isfinite(out).all(), plan
        torch.testing.assert_close(parallel_forward(model, idx, "8xF1-h0-K8-diag:vjp"), ref, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- associative scan
@settings(max_examples=60, deadline=None)
@given(C=st.integers(1, 19), matrix=st.booleans(), broadcast=st.booleans(), seed=st.integers(0, 999))
def test_affine_scan_equals_sequential_scan(C, matrix, broadcast, seed):
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(C, 2, 3, 4, 5, generator=g, dtype=torch.float64)  # (C, B, T, n, D)
    if matrix:
        a = torch.randn(C, 2, 3, 4, 4, generator=g, dtype=torch.float64) * 0.5  # acts on the n dim
    else:
        a = torch.randn(C, 1, 1, 1, 1, generator=g, dtype=torch.float64) if broadcast else torch.randn_like(b)
    torch.testing.assert_close(affine_scan(a, b, matrix=matrix), sequential_scan(a, b, matrix=matrix),
                               rtol=1e-10, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(C=st.integers(1, 19), n=st.integers(1, 4), seed=st.integers(0, 999))
def test_transfer_scan_equals_sequential_scan(C, n, seed):
    """Static mHC's HCN maps are constant over the tokens: transfer_blocks + one contraction solve the same
    recurrence as the naive loop over chunks (and as the log-depth scan)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(C, n, n, generator=g, dtype=torch.float64) * 0.7
    b = torch.randn(C, 2, 3, n, 5, generator=g, dtype=torch.float64)  # (C, B, T, n, D)
    want = sequential_scan(a[:, None, None].expand(C, 2, 3, n, n), b, matrix=True)
    torch.testing.assert_close(transfer_scan(transfer_blocks(a), b), want, rtol=1e-10, atol=1e-10)


def test_transfer_scan_row_never_depends_on_its_batch():
    """Review (rev-gpu N1): one (C n x C n) GEMM over every row's columns rounded a row differently in a batch of 3
    than alone (fp64, 1e-13 on MKL); a batched step's row must equal the row alone bit for bit, as the scan it
    replaced did. One GEMM per row keeps each row's arithmetic the same whatever rides along."""
    g = torch.Generator().manual_seed(0)
    P = transfer_blocks(torch.randn(8, 4, 4, generator=g, dtype=torch.float64) * 0.5)
    b = torch.randn(8, 3, 1, 4, 64, generator=g, dtype=torch.float64)  # (C, B, T, n, D): a one-token step of 3 rows
    full = transfer_scan(P, b)
    for r in range(3):
        assert torch.equal(full[:, r:r + 1], transfer_scan(P, b[:, r:r + 1].contiguous()))


# ---------------------------------------------------------------- estimator statistics on a known diagonal
def _linear(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, n, generator=g, dtype=torch.float64)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 5
    return W, x, (lambda xp: xp @ W.T)  # probe-stacked linear map: f(x) = W x, J = W


@pytest.mark.parametrize("estimator", ["fd", "jvp", "vjp"])
def test_estimators_are_unbiased_on_a_linear_map(estimator):
    """mean_p v_p o J v_p -> diag(W). Per coordinate one probe's product is W_ii + sum_{j != i}
    W_ij v_i v_j with variance sigma_i^2 = sum_{j != i} W_ij^2 (J^T: column sums for VJP), so the mean
    of P probes is within 5 sigma_i / sqrt(P) of diag(W) (fixed seed; a 5-sigma miss has p ~ 6e-7)."""
    W, x, f = _linear()
    P = 20000
    v = S.rademacher((P, x.numel()), x, torch.Generator().manual_seed(1))
    est = S.hutchinson_diag(f, x, v, estimator)
    off = W.pow(2) - torch.diag(W.diagonal().pow(2))
    sigma = (off.sum(0) if estimator == "vjp" else off.sum(1)).sqrt()
    z = (est - W.diagonal()) / (sigma / math.sqrt(P))
    assert z.abs().max() < 5, z
    assert (est - W.diagonal()).abs().max() < 0.15  # and the bound is not vacuous: sigma/sqrt(P) ~ 0.025


def test_per_probe_products_are_exact_for_jvp_vjp_and_fd_on_a_linear_map():
    """JVP: v o W v and VJP: v o W^T v exactly, per probe; FD is exact on a linear map up to rounding."""
    W, x, f = _linear(seed=3)
    v = S.rademacher((7, x.numel()), x, torch.Generator().manual_seed(2))
    torch.testing.assert_close(S.probe_products(f, x, v, "jvp"), v * (v @ W.T), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(S.probe_products(f, x, v, "vjp"), v * (v @ W), rtol=1e-13, atol=1e-13)
    for eps in (1e-3, 1e-1):
        torch.testing.assert_close(S.probe_products(f, x, v, "fd", eps), v * (v @ W.T), rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="unknown DiagN estimator"):
        S.probe_products(f, x, v, "adam")


def test_fd_step_is_relative_per_token_and_floored():
    """The unwritten step (None) is 1e-3 raised to the compute dtype's floor; a written one is taken as written or
    refused, never raised (eps:0.001 under bf16 ran as 0.088 under its own name). Autocast leaves fp64 in fp64."""
    x = torch.cat([torch.full((1, 4), 100.0), torch.full((1, 4), 0.01)]).double()  # two tokens
    s = S.fd_step(x, 1e-3, token_dims=1)
    assert s.shape == (2, 1) and s[0, 0] == pytest.approx(0.1) and s[1, 0] == pytest.approx(1e-3)
    assert torch.equal(S.fd_step(x, None, 1), s)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # low-precision compute: step raised to sqrt(machine eps)
        assert S.fd_step(x.float(), None, 1)[1, 0] == pytest.approx(torch.finfo(torch.bfloat16).eps ** 0.5)
        with pytest.raises(ValueError, match=r"eps:0.001 is below the smallest FD step of the compute dtype bfloat16"):
            S.fd_step(x.float(), 1e-3, 1)
        assert S.fd_step(x.float(), 0.1, 1)[1, 0] == pytest.approx(0.1)
        assert torch.equal(S.fd_step(x, 1e-3, 1), s)  # autocast casts no fp64 tensor: fp64's floor, 1.5e-8
        assert S.compute_dtype(torch.float64, "cpu") == torch.float64
        assert S.compute_dtype(torch.float32, "cpu") == torch.bfloat16



def test_an_fd_eps_below_the_dtype_floor_is_refused_not_raised_silently():
    """diag:fd takes at least sqrt(machine eps) of the compute dtype as its step: on an fp32 model eps:1e-5 and
    eps:1e-4 both ran with 3.45e-4 under their own names (one computation, two plans). A written eps below the floor
    is refused before the solve runs; at or above it, and the default (raised in bf16 by design), run as before."""
    m32 = make_model(seed=1, n_layer=4, dtype=torch.float32)
    idx = tokens(m32)
    floor = torch.finfo(torch.float32).eps ** 0.5
    with torch.no_grad():
        for eps in ("1e-5", "1e-4"):
            for run in (lambda p: solve(m32, idx, p), lambda p: bind(m32, p)):  # bind refuses before fusing weights
                with pytest.raises(ValueError, match=r"eps:(1e-05|0.0001) is below the smallest FD step of the "
                                                     r"compute dtype float32 .*write eps:0.000346 or more"):
                    run(f"3xF1-h0-K2-diag-eps:{eps}")
        at = solve(m32, idx, "3xF1-h0-K2-diag-eps:0.000346").hidden  # the suggested value runs
        assert torch.isfinite(at).all()
        solve(m32, idx, "3xF1-h0-K2-diag")  # the default, and the estimators that never read eps, run
        solve(m32, idx, "3xF1-h0-K2-diag:jvp")
        m64 = make_model(seed=1, n_layer=4)  # fp64's floor is 1.5e-8: eps:1e-5 is a step it takes
        small, big = (solve(m64, idx, f"3xF1-h0-K2-diag-eps:{e}").hidden for e in ("1e-5", "1e-3"))
        assert not torch.equal(small, big)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the compute dtype decides: bf16's floor is 0.088
            with pytest.raises(ValueError, match=r"compute dtype bfloat16"):
                solve(m32, idx, "3xF1-h0-K2-diag-eps:0.01")
    assert S.fd_floor(torch.float32) == pytest.approx(floor)


def test_a_written_fd_eps_equal_to_the_default_is_checked_as_written():
    """A written eps:0.001 is a step the plan asks for: on a bf16 model (floor 0.088) it was read as the unwritten
    default and raised to 0.088 without a word, while eps:0.01 was refused. Refused alike now (solve, bind, parse
    round trip keeps it written); the plan without eps still runs at the floor, and eps:0.1 runs as written."""
    m16 = make_model(seed=1, n_layer=4, dtype=torch.bfloat16)
    idx = tokens(m16)
    p = Plan.parse("3xF1-h0-K2-diag-eps:0.001")
    assert p.surrogate.eps == 1e-3 and Plan.parse(str(p)) == p and str(p).endswith("eps:0.001")
    assert Plan.parse("3xF1-h0-K2-diag").surrogate.eps is None and Plan.parse("3xF1-h0-K2-diag") != p
    with torch.no_grad():
        for run in (lambda q: solve(m16, idx, q), lambda q: bind(m16, q)):
            with pytest.raises(ValueError, match=r"eps:0.001 is below the smallest FD step of the compute dtype "
                                                 r"bfloat16 .*write eps:0.0885 or more"):
                run(p)
        solve(m16, idx, "3xF1-h0-K2-diag")
        solve(m16, idx, "3xF1-h0-K2-diag-eps:0.1")
        m64 = make_model(seed=1, n_layer=4)  # the written default on fp64 is the unwritten one's step
        assert torch.equal(solve(m64, idx, p).hidden, solve(m64, idx, "3xF1-h0-K2-diag").hidden)
    with pytest.raises(ValueError, match="drop eps"):  # the default's value written for an AD estimator, too
        DiagN("jvp", eps=1e-3)


def _chunk_setup(seed=2, C=3):
    model = make_model(seed=seed, n_layer=C + 1, n_embd=8, n_head=2, n_kv_head=1)
    idx = tokens(model, B=1, T=3)
    with torch.no_grad():
        ctx = model.embed(idx)
        h = [model.run_layers(ctx.x0, ctx, 0, 1)]
        for l in range(1, C):
            h.append(model.layer(l, h[-1], ctx))
        x = torch.stack(h)  # (C, B, T, D): chunk inputs at the sequential trace
        w = chunk_weights(model, 1, C, 1)
        tilde = chunk_forward(w, x, ctx)
    return model, ctx, w, x, tilde


def _true_jacobians(w, x, ctx):
    """Full Jacobian of each chunk map over all positions (n x n, n = B*T*D), by autograd."""
    out = []
    for c in range(x.shape[0]):
        J = torch.autograd.functional.jacobian(lambda z: chunk_forward(w.chunk(c), z[None], ctx)[0], x[c])
        out.append(J.reshape(x[c].numel(), x[c].numel()))
    return out


@pytest.mark.parametrize("estimator", ["fd", "jvp", "vjp"])
def test_chunk_diagonal_is_same_token_same_channel_entry_of_the_full_jacobian(estimator):
    """diag_jacobian averages to diag(J_c) of the whole chunk map (attention mixes tokens: the
    diagonal is dF[t, i] / dx[t, i]); chunks outside the subset get exactly 1."""
    model, ctx, w, x, tilde = _chunk_setup()
    Js = _true_jacobians(w, x, ctx)
    P = 1000
    with torch.no_grad():
        a = S.diag_jacobian(w, x, tilde, ctx, Plan(3, surrogate=DiagN(estimator, probes=P)),
                            torch.Generator().manual_seed(0))
        sub = S.diag_jacobian(w, x, tilde, ctx, Plan(3, surrogate=DiagN(estimator, probes=P, subset=(2, 0))),
                                torch.Generator().manual_seed(0))
    assert a.shape == x.shape and not a.requires_grad
    assert torch.equal(sub[1], torch.ones_like(sub[1]))
    for c, J in enumerate(Js):
        off = J.pow(2) - torch.diag(J.diagonal().pow(2))
        sigma = (off.sum(0) if estimator == "vjp" else off.sum(1)).sqrt().view_as(x[c]) / math.sqrt(P)
        slack = 1e-2 if estimator == "fd" else 0.0  # FD truncation error O(eps) on a nonlinear map
        for est in ((a[c], sub[c]) if c != 1 else (a[c],)):
            err = (est - J.diagonal().view_as(x[c])).abs()
            assert (err < 5 * sigma + slack).all(), (c, (err / sigma).max())


def test_probe_batching_equals_one_probe_at_a_time():
    """Probes ride in the batch dim of ONE chunk forward: identical to evaluating them one by one."""
    model, ctx, w, x, tilde = _chunk_setup(seed=5)
    v = S.rademacher((4, *x.shape), x, torch.Generator().manual_seed(3))
    with torch.no_grad():
        for est in ("fd", "jvp", "vjp"):
            batched = S.probe_products(S.chunk_probe_map(w, ctx, P=4), x, v, est, fx=tilde, token_dims=3)
            single = torch.cat([S.probe_products(S.chunk_probe_map(w, ctx), x, v[p:p + 1], est, fx=tilde,
                                                 token_dims=3) for p in range(4)])
            torch.testing.assert_close(batched, single, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("hc", [0, 2])
def test_selected_chunks_equal_rows_of_the_full_batched_forward(hc):
    model = make_model(seed=6, n_layer=6, **({"hc_streams": hc} if hc else {}))
    idx = tokens(model)
    with torch.no_grad():
        ctx = model.embed(idx)
        w = chunk_weights(model, 0, 3, 2)
        x = torch.randn(3, *ctx.x0.shape[:2], *([hc] if hc else []), ctx.x0.shape[-1], dtype=torch.float64)
        full = chunk_forward(w, x, ctx)
        for sel in ([2, 0], [1], [0, 1, 2]):
            torch.testing.assert_close(chunk_forward(S.select_chunks(w, sel), x[sel], ctx), full[sel],
                                       rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- exact Newton
def test_newton_delta_is_the_explicit_jacobian_recurrence():
    model, ctx, w, x, tilde = _chunk_setup(seed=7)
    b = torch.randn_like(x)
    Js = _true_jacobians(w, x, ctx)
    d = [b[0]]
    for c in range(1, 3):
        d.append((Js[c] @ d[-1].reshape(-1)).view_as(b[c]) + b[c])
    with torch.no_grad():
        got = S.newton_delta(w, x, b, ctx, Plan(3, surrogate="newton"))
        torch.testing.assert_close(got, torch.stack(d), rtol=1e-10, atol=1e-10)
        damped = S.newton_delta(w, x, b, ctx, Plan(3, surrogate="newton", elk=0.5, order=(1, 0, 2)))
        prev = torch.randn_like(x)
        lagged = S.newton_delta(w, x, b, ctx, Plan(3, surrogate="newton", elk=0.5, order=(1, 0, 2)), prev)
    # order 1,0,2: chunk 1 is visited before chunk 0, so in the first sweep (no previous update) it gets
    # no correction, later the previous sweep's update of chunk 0; chunk 2 gets half of this sweep's d_1
    torch.testing.assert_close(damped[1], b[1])
    torch.testing.assert_close(damped[2], 0.5 * (Js[2] @ b[1].reshape(-1)).view_as(b[2]) + b[2],
                               rtol=1e-10, atol=1e-10)
    want1 = 0.5 * (Js[1] @ prev[0].reshape(-1)).view_as(b[1]) + b[1]
    torch.testing.assert_close(lagged[1], want1, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lagged[2], 0.5 * (Js[2] @ want1.reshape(-1)).view_as(b[2]) + b[2],
                               rtol=1e-10, atol=1e-10)


def _iters_to(model, idx, surrogate, C, target=1e-5):
    """(first K whose final state is within `target` relative error of sequential, iterations a
    tol=target solve runs). states[k][-1] is the final state after k iterations."""
    with torch.no_grad():
        ref = model.hidden_states(idx)[-1]
        res = solve(model, idx, f"{C}xF1-h0-K{C}-{surrogate}", keep_states=True, check_finite=False)
        errs = [float((h[-1] - ref).norm() / ref.norm()) for h in res.states]
        first = next((k for k, e in enumerate(errs) if e < target), None)
        used = solve(model, idx, f"{C}xF1-h0-K{C}-{surrogate}-tol:{target}").iters
    return first, used


def test_exact_newton_converges_in_fewer_iterations_than_idn():
    """On a random smooth model (small weight perturbation) exact Newton converges quadratically
    (4 iterations here) while IDN needs the full staircase (K = C = 8)."""
    model = make_model(seed=0, scale=0.05, n_layer=8)
    idx = tokens(model, B=2, T=8)
    newton, newton_tol = _iters_to(model, idx, "newton", 8)
    idn, idn_tol = _iters_to(model, idx, "idn", 8)
    msg = f"iterations to 1e-5 relative error: newton {newton} (tol-stopped at {newton_tol}), idn {idn} (tol {idn_tol})"
    assert newton is not None and idn is not None and newton < idn, msg
    assert newton_tol < idn_tol, msg
    print(msg)


# ---------------------------------------------------------------- adaptive iterations (tol)
@pytest.mark.parametrize("surrogate,K", [("idn", 8), ("diag:jvp-probes:2", 8), ("newton", 8), ("none", 10)])
def test_tol_stops_early_and_equals_running_that_many_iterations(surrogate, K):
    """tol: every row stops at the first iteration whose final-state relative update is < tol (Jacobi: the
    update is 0 once the staircase reaches the end, iteration C + 1); the batch stops when all rows have."""
    model = make_model(seed=0, scale=0.05, n_layer=8)
    idx = tokens(model, B=2, T=8)
    with torch.no_grad():
        res = solve(model, idx, f"8xF1-h0-K{K}-{surrogate}-tol:2e-2", keep_states=True)
        assert res.iters < K and len(res.updates) == res.iters and len(res.states) == res.iters + 1
        assert res.updates[-1] < 2e-2 and all(u >= 2e-2 for u in res.updates[:-1]), res.updates
        assert res.iters == max(res.row_iters.tolist())
        for b, k in enumerate(res.row_iters.tolist()):  # each row stops on its own (tests/method/test_seams_solver.py)
            fixed = solve(model, idx, f"8xF1-h0-K{k}-{surrogate}")
            torch.testing.assert_close(res.hidden[b], fixed.hidden[b], rtol=0, atol=0)
        capped = solve(model, idx, f"8xF1-h0-K2-{surrogate}-tol:1e-30")  # K is the maximum
        assert capped.iters == 2 and len(capped.updates) == 2
        full = solve(model, idx, f"8xF1-h0-K3-{surrogate}")  # tol = 0: fixed K, no updates recorded
        assert full.iters == 3 and full.updates == []


# ---------------------------------------------------------------- autograd / inference modes, training
@pytest.mark.parametrize("plan", ["4xF1-h0-K2-diag:fd", "4xF1-h0-K2-diag:jvp-probes:2",
                                  "4xF1-h0-K2-diag:vjp-subset:1.2",
                                  "4xF1-h0-K2-newton"])
def test_inference_mode_and_no_grad_agree(plan):
    model = make_model(seed=3)
    idx = tokens(model)
    with torch.no_grad():
        a = parallel_forward(model, idx, plan)
    with torch.inference_mode():
        b = parallel_forward(model, idx, plan)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("estimator", ["fd", "jvp", "vjp"])
def test_diag_estimate_is_detached_and_gradients_reach_the_weights(estimator):
    model = make_model(seed=1).train()
    idx = tokens(model)
    parallel_forward(model, idx, f"4xF1-h0-K1-diag:{estimator}").logsumexp(-1).mean().backward()
    for l in (2, 5):
        g = model.blocks[l].mlp.c_fc.weight.grad
        assert g is not None and g.abs().sum() > 0 and torch.isfinite(g).all()
    with torch.enable_grad():
        ctx = model.embed(idx)
        w = chunk_weights(model, 2, 4, 1)
        x = ctx.x0.expand(4, *ctx.x0.shape)
        a = S.diag_jacobian(w, x, chunk_forward(w, x, ctx), ctx, Plan(4, surrogate=DiagN(estimator)))
    assert not a.requires_grad


def test_regulariser_with_diag_is_finite_and_differentiable():
    from snlp.train.regularizer import RegConfig, snlp_loss

    model = make_model(seed=2).train()
    idx = tokens(model)
    ctx = model.embed(idx)
    trace = [ctx.x0]
    model.run_layers(ctx.x0, ctx, 0, model.config.n_layer, trace)
    loss = snlp_loss(model, idx, trace, RegConfig(surrogate="diag", suffixes=(3,), stride=1))
    loss.backward()
    assert torch.isfinite(loss) and loss > 0
    assert model.blocks[4].mlp.c_fc.weight.grad.abs().sum() > 0


def test_train_with_reg_diag(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"line {i}: the quick brown fox {i % 7} jumps over {i % 13} lazy dogs." * 3
                                  for i in range(300)))
    tiny = ["--depth", "3", "--width", "32", "--head-dim", "16", "--vocab-size", "300", "--seq-len", "32",
            "--batch-size", "4", "--eval-every", "100", "--eval-batches", "1", "--no-progress", "--device", "cpu"]
    rc = main(["train", "--out", str(tmp_path / "run"), "--data", str(corpus), "--cache-dir", str(tmp_path / "cache"),
               *tiny, "--steps", "3", "--reg", "diag", "--reg-n", "2", "--log-every", "1"])
    assert rc == 0
    rows = [json.loads(l) for l in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    regs = [r["reg"] for r in rows if "reg" in r]
    assert regs and all(math.isfinite(r) and r > 0 for r in regs)
    assert any(k.startswith("gap") for r in rows for k in r), rows[0]


# ---------------------------------------------------------------- KV-cached decoding
def _decode_in_pieces(model, idx, plan, cuts, cache):
    out, start = [], 0
    for stop in list(cuts) + [idx.shape[1]]:
        out.append(parallel_forward(model, idx[:, start:stop], plan, cache=cache))
        start = stop
    return torch.cat(out, 1)


@pytest.mark.parametrize("plan", ["3xF1-h0-K3-diag:fd-probes:2", "3xF1-fwd-K3-diag:jvp",
                                  "3xF1-h0-K4-diag:vjp-subset:0.2",
                                  "2xF2-h0-K2-diag:fd-subset:1", "3xF2-h0-K3-newton", "6xF1-h0-K6-newton-tol:1e-12"])
def test_cached_decoding_with_K_ge_C_equals_the_sequential_model(plan):
    """Probe / JVP evaluations read the cache and never write it: prefill + multi-token + one-token
    cached steps reproduce the sequential (M = 1) or fused (M > 1) model."""
    model = make_model(n_head=4, n_kv_head=2)
    idx = tokens(model, B=2, T=9)
    with torch.no_grad():
        ref = model(idx) if Plan.parse(plan).fuse == 1 else fused_forward(model, idx, plan)
        cache = KVCache.for_model(model, batch=2, max_len=12)
        got = _decode_in_pieces(model, idx, plan, [3, 6, 7, 8], cache)
    assert (got - ref).abs().max() < 1e-10


@pytest.mark.parametrize("plan", ["3xF1-h0-K2-diag:jvp-probes:2", "3xF1-h0-K2-diag:vjp-subset:1",
                                  "3xF1-h0-K2-diag:fd", "2xF2-fwd-K1-newton"])
def test_probes_and_jvps_read_the_cache_at_a_positions_tensor(plan):
    """A decode step may place its tokens by a positions tensor (solve's pos=: (T,) for the static-shape step,
    RowPositions (B, T) for a ragged call). The probe / JVP passes read the cache through a stand-in that sliced
    [:start] with start an int, and a (T,) or (B, T) tensor failed with "only integer tensors of a single element
    can be converted to an index" after the prefix and the first forward had run. The outside reference: each row
    decoded alone, its cache prefilled with its own tokens, its step placed by the int cache length (seek)."""
    model = make_model(seed=4, n_layer=5, window_pattern="SL", short_window=2)
    idx = tokens(model, B=2, T=8)
    lens = (5, 4)  # row b's tokens before the step; the step decodes 2 more
    with torch.no_grad():
        want = []
        for b, n in enumerate(lens):  # every prefill is 5 tokens long (DiagN's probe draw depends on T)
            c = _prefilled(model, idx[b:b + 1, :5], plan)
            c.seek(n)
            want.append(solve(model, idx[b:b + 1, n:n + 2], plan, cache=c).hidden)
        step = torch.stack([idx[b, n:n + 2] for b, n in enumerate(lens)])  # (2, 2)
        for pos in (torch.tensor([[5, 6], [4, 5]]), "static"):
            cache = KVCache.for_model(model, batch=2, max_len=12)
            if pos == "static":  # (T,): both rows at positions 5, 6 (both prefilled with 5 tokens)
                solve(model, idx[:, :5], plan, cache=cache)
                got = solve(model, idx[:, 5:7], plan, cache=cache, pos=torch.tensor([5, 6])).hidden
                ref = solve(model, idx[1:2, 5:7], plan, cache=_prefilled(model, idx[1:2, :5], plan)).hidden
                torch.testing.assert_close(got, torch.cat([want[0], ref]), rtol=1e-9, atol=1e-9)
                continue
            solve(model, idx[:, :5], plan, cache=cache)  # row 1's position 4 is overwritten by its step
            got = solve(model, step, plan, cache=cache, pos=RowPositions(pos, span=7)).hidden
            torch.testing.assert_close(got, torch.cat(want), rtol=1e-9, atol=1e-9)


def _prefilled(model, ids, plan):
    c = KVCache.for_model(model, batch=1, max_len=12)
    solve(model, ids, plan, cache=c)
    return c


class _SpyCache(KVCache):
    writes: list

    def write(self, layers, k, v, start):
        self.writes.append((layers, tuple(k.shape)))
        return super().write(layers, k, v, start)


@pytest.mark.parametrize("plan", ["4xF1-h0-K2-diag:fd-probes:3", "4xF1-h0-K2-diag:jvp-probes:2-subset:1.3",
                                  "4xF1-h0-K2-diag:vjp", "4xF1-h0-K2-newton"])
def test_probes_leave_the_cache_holding_the_real_iterates_kv(plan):
    """With K < C the cache must end up with the K/V of the last iteration's real inputs (the same
    contents as a fresh cache written by one batched forward at those inputs), and the suffix slots
    see only K writes (one per iteration, batch B): probes and JVPs never write."""
    model = make_model(seed=2)
    idx = tokens(model, B=2, T=5)
    base = KVCache.for_model(model, batch=2, max_len=8)
    cache = _SpyCache(k=base.k.clone(), v=base.v.clone())
    cache.writes = []
    with torch.no_grad():
        res = solve(model, idx, plan, cache=cache, keep_states=True)
        suffix = [wr for wr in cache.writes if isinstance(wr[0], slice) and wr[0].start == 2]
        assert len(suffix) == 2 and all(shape[1] == 2 for _, shape in suffix)
        # reference: write the K/V of the last iteration's inputs into a fresh cache
        ref = KVCache.for_model(model, batch=2, max_len=8)
        ctx = model.embed(idx, ref)
        hS = model.run_layers(ctx.x0, ctx, 0, 2)
        chunk_forward(chunk_weights(model, 2, 4, 1), torch.cat([hS[None], res.states[-2][:-1]]), ctx, ref)
    torch.testing.assert_close(cache.k[:, :, :, :5], ref.k[:, :, :, :5], rtol=0, atol=0)
    torch.testing.assert_close(cache.v[:, :, :, :5], ref.v[:, :, :, :5], rtol=0, atol=0)


def test_snlp_generate_with_diag_and_newton_equals_sequential_greedy():
    from snlp.decode import sequential_generate, snlp_generate, speculative_generate

    model = make_model(seed=5, vocab_size=13)
    prompt = [1, 5, 7]
    ref = sequential_generate(model, prompt, max_new_tokens=6).tokens
    for plan in ("4xF1-h0-K4-diag:fd", "4xF1-h0-K4-diag:vjp-probes:2", "4xF1-h0-K4-newton"):
        assert snlp_generate(model, prompt, plan, max_new_tokens=6).tokens == ref, plan
    assert speculative_generate(model, prompt, "4xF1-h0-K1-diag:jvp", block=3, max_new_tokens=6).tokens == ref


# ---------------------------------------------------------------- CLI
TINY = ["--depth", "4", "--width", "32", "--head-dim", "16", "--vocab-size", "97", "--warmup", "1", "--runs", "2"]


def test_bench_ops_writes_the_four_ops(tmp_path, capsys):
    out = tmp_path / "ops.json"
    assert main(["bench", *TINY, "--ops", "--tokens", "1,4", "--layer", "1", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["tokens"] for r in records] == [1, 4]
    for r in records:
        assert r["layer"] == 1 and r["forward_ratio"] == 1.0
        for op in ("forward", "fd", "jvp", "vjp", "fd_extra"):
            assert r[f"{op}_ms"] > 0 and r[f"{op}_ratio"] > 0
    table = capsys.readouterr().out
    assert "JVP (ms)" in table and "VJP (ms)" in table
    assert main(["bench", *TINY, "--ops", "--layer", "4"]) == 2
    assert "--layer must lie in [0, 3]" in capsys.readouterr().err
    assert main(["bench", *TINY, "--tokens", "1,4", "--plans", "2xF1"]) == 2
    assert "comma list only with --ops" in capsys.readouterr().err


def test_bench_plans_with_diag_newton_and_tol_report_iterations(tmp_path, capsys):
    out = tmp_path / "b.json"
    plans = "4xF1-h0-K2-diag:vjp,2xF2-h0-K2-diag-probes:2-subset:1,4xF1-h0-K2-newton,4xF1-h0-K4-tol:1e-30"
    assert main(["bench", *TINY, "--tokens", "3", "--plans", plans, "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["iters"] for r in records] == [None, 2, 2, 2, 4]
    assert "iters" in capsys.readouterr().out


def test_generate_cli_with_a_diag_plan(tmp_path):
    from snlp.io.checkpoint import save_checkpoint
    from snlp.io.tokenizer import MIN_VOCAB, Tokenizer

    text = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. " * 20
    tok = Tokenizer.train([text], vocab_size=MIN_VOCAB + 40)
    model = make_model(seed=3, dtype=torch.float32, vocab_size=tok.vocab_size, n_layer=4, n_embd=32, scale=0.15,
                       sequence_len=64)
    ck = save_checkpoint(tmp_path / "ck", model, tokenizer=tok)
    outs = {}
    for mode, plan in (("sequential", []), ("snlp", ["--plan", "4xF1-h0-K4-diag:vjp"])):
        out = tmp_path / f"{mode}.json"
        assert main(["generate", str(ck), "--prompt", "First", "--max-new-tokens", "8", "--mode", mode, *plan,
                     "--quiet", "--json", str(out)]) == 0
        outs[mode] = json.loads(Path(out).read_text())
    assert len(outs["snlp"]["tokens"]) == 8 and outs["snlp"]["tokens"] == outs["sequential"]["tokens"]


def test_cached_factors_serve_inference_mode_and_autograd_alike():
    """The transfer matrices and link / lag factors are cached per plan and device: one made under inference_mode
    (an eval run) reached a later training step's autograd graph ("Inference tensors cannot be saved for backward")."""
    m = make_model(seed=0, n_layer=4, dtype=torch.float32)
    idx = torch.randint(0, m.config.vocab_size, (1, 6))
    for plan in ("4xF1-h0-K2-elk:0.3", "3xF1-h0-K3-order:reversed", "3xF1-h0-K2-none"):
        with torch.inference_mode():
            solve(m, idx, plan)
        solve(m, idx, plan).hidden.sum().backward()  # gradients through the same cached factors


def test_the_jvp_runs_with_inference_mode_off_and_is_exact_under_it():
    """torch 2.11's torch.func.jvp returns a zero tangent under inference_mode, silently (2.13's does not): Newton
    became Jacobi and DiagN's jvp estimate 0 there (test_inference_mode_and_no_grad_agree failed on 2.11). snlp's
    `jvp` therefore turns inference mode off for the pass, on every torch; the product is checked against the
    Jacobian of a known map, with inputs made under inference mode as an eval's Context is. (2.13's jvp turns
    inference mode off itself, so on the pinned torch this passes either way; under torch 2.11,
    `bash scripts/torch_compat.sh --tests`, it failed before the fix.)"""
    from snlp.method.jacobian import jvp
    W = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x, t = torch.randn(2, 6, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)
    want = (1 - torch.tanh(x @ W) ** 2) * (t @ W)  # d tanh(xW) = (1 - tanh^2) (t W)
    seen = []
    with torch.inference_mode():
        Wi, xi, ti = W * 1, x * 1, t * 1  # inference tensors

        def f(z):
            seen.append(torch.is_inference_mode_enabled())
            return torch.tanh(z @ Wi)
        got = jvp(f, xi, ti)
    assert seen and not any(seen)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_fd_step_check_takes_a_meta_model():
    """DistributedSNLP checks a diag:fd eps against the model's dtype before a rank's checkpoint fills its meta-device
    weights: torch has no autocast state for 'meta' (RuntimeError 'unknown device type for autocast'), so the check
    answers for the dtype alone, as for any model outside autocast."""
    plan = Plan.parse("3xF1-h0-K2-diag-eps:1e-5")
    with pytest.raises(ValueError, match="compute dtype float32"):
        S.check_fd_step(plan, torch.float32, "meta")
    S.check_fd_step(plan, torch.float64, "meta")  # fp64's floor 1.5e-8: the eps runs

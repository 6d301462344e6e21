"""SNLP's exact laws, one parametrised set over every surrogate family and both model kinds (plain residual
and mHC streams), on random fp64 models (paper Methods; App. Algorithm; the correction-propagation table):

  1. K >= C reproduces the fused model run sequentially (for M = 1: the original model, logits and h_L); with
     a non-forward correction order, K >= C + #chunks visited before their predecessor (`Plan.exact_iters`);
  2. staircase: after k iterations chunk c is exact once k >= t_c (`Plan.exact_after`: the first k chunks
     for forward order, k + 1 from the fwd init);
  3. propagation: perturb layer j; after k iterations without correction (Jacobi) exactly chunks
     j <= c < j + k have changed, with any correction every chunk c >= j has.

`SNLP_HYPOTHESIS=thorough` runs >= 1000 examples per law (conftest.examples)."""

from __future__ import annotations

import pytest
import torch
from conftest import batch_shapes, configs, examples, heads, make_model, mhc_model, tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from snlp import HCN, DiagN, Identity, Jacobi, Newton, Plan, fused_forward, fused_sequential, parallel_forward, solve

TOL = dict(rtol=1e-9, atol=1e-9)
FAMILIES = [("plain", "idn"), ("plain", "none"), ("plain", "diag"), ("plain", "newton"),
            ("mhc", "idn"), ("mhc", "none"), ("mhc", "hcn"), ("mhc", "diag"), ("mhc", "newton")]


@st.composite
def surrogates(draw, family: str, chunks: int):
    if family == "diag":
        subset = draw(st.one_of(st.none(), st.sets(st.integers(0, chunks - 1), min_size=1).map(tuple)))
        est = draw(st.sampled_from(["fd", "jvp", "vjp"]))  # eps is fd's step only
        return DiagN(est, probes=draw(st.integers(1, 3)), eps=draw(st.sampled_from([None, 1e-3, 1e-2])) if est == "fd" else None,
                     subset=subset)
    return {"idn": Identity(), "none": Jacobi(), "hcn": HCN(), "newton": Newton()}[family]


@st.composite
def cases(draw, kind: str, family: str, exact: bool, max_layers: int = 6, ordered: bool = True):
    """(model, plan, idx): a random model of `kind`, a plan with the family's surrogate (random chunking, init,
    ELK, correction order, K >= C when `exact`), and a random batch."""
    seed = draw(st.integers(0, 2 ** 16))
    if kind == "plain":
        cfg = draw(configs(max_layers=max_layers))
        model = make_model(seed=seed, **cfg)
    else:
        cfg = dict(n_layer=draw(st.integers(2, max_layers - 1)), **draw(heads(max_embd=64)),
                   value_embeds=draw(st.booleans()), window_pattern=draw(st.sampled_from(["L", "SL", "S"])),
                   short_window=draw(st.integers(1, 4)))
        model = mhc_model(seed=seed, n=draw(st.sampled_from([1, 2, 3])), dynamic=draw(st.booleans()), **cfg)
    L = cfg["n_layer"]
    fuse = draw(st.integers(1, min(3, L)))
    chunks = draw(st.integers(1, L // fuse))
    corrects = family != "none"  # Jacobi has no correction to damp or order
    order = tuple(draw(st.permutations(range(chunks)))) if ordered and corrects and draw(st.booleans()) else None
    plan = Plan(chunks=chunks, fuse=fuse, init=draw(st.sampled_from(["h0", "fwd"])), iters=0,
                surrogate=draw(surrogates(family, chunks)), elk=draw(st.sampled_from([0.0, 0.25])) if corrects else 0.0,
                order=order)
    K = plan.exact_iters()  # C for forward order
    plan = plan.with_(iters=draw(st.integers(K, K + 1)) if exact else draw(st.integers(0, K)))
    B, T = draw(batch_shapes(max_T=33 if kind == "plain" else 12))
    return model, plan, tokens(model, B=B, T=T, seed=seed)


@pytest.mark.parametrize("kind,family", FAMILIES)
def test_K_ge_C_reproduces_the_fused_model(kind, family):
    @settings(max_examples=examples(8), deadline=None)
    @given(cases(kind, family, exact=True))
    def law(case):
        model, plan, idx = case
        with torch.no_grad():
            res = solve(model, idx, plan)
            fused = fused_sequential(model, idx, plan)
            torch.testing.assert_close(res.hidden, fused.hidden, **TOL)
            if plan.fuse == 1:  # unfused: the original model itself
                torch.testing.assert_close(model.head(res.hidden), model(idx), **TOL)
                torch.testing.assert_close(res.hidden, model.hidden_states(idx)[-1], **TOL)
            else:
                torch.testing.assert_close(parallel_forward(model, idx, plan), fused_forward(model, idx, plan), **TOL)

    law()


@pytest.mark.parametrize("kind,family", FAMILIES)
def test_after_k_iterations_the_first_k_chunks_are_exact(kind, family):
    @settings(max_examples=examples(8), deadline=None)
    @given(cases(kind, family, exact=False))
    def law(case):
        model, plan, idx = case
        with torch.no_grad():
            res = solve(model, idx, plan, keep_states=True, check_finite=False)
            exact = fused_sequential(model, idx, plan).states[0]  # (C, B, T, [n,] D)
        assert len(res.states) == plan.iters + 1 and res.iters == plan.iters
        t = plan.exact_after()
        for k, h in enumerate(res.states):
            done = [c for c in range(plan.chunks) if t[c] <= k]
            if plan.order is None:  # forward order: the first k chunks (k + 1 from fwd, whose init holds F_0(h_S))
                assert done == list(range(min(k + (plan.init == "fwd"), plan.chunks)))
            torch.testing.assert_close(h[done].expand_as(exact[done]), exact[done], **TOL)

    law()


@pytest.mark.parametrize("kind,family", FAMILIES)
def test_a_perturbation_propagates_one_chunk_per_iteration_without_correction(kind, family):
    """Perturb the weights of layer j (M = 1, forward order): after k iterations chunk c has changed iff
    j <= c < j + k without correction (the Jacobi staircase), and iff c >= j with a correction (it reaches
    the end of the suffix in the same iteration)."""
    L, j = 6, 2
    make = (lambda: make_model(seed=11, n_layer=L)) if kind == "plain" else (lambda: mhc_model(seed=11, n=2, dynamic=True, n_layer=L))
    base, pert = make(), make()
    with torch.no_grad():
        pert.blocks[j].mlp.c_fc.weight.mul_(1.5)
    idx = tokens(base)
    sur = {"idn": Identity(), "none": Jacobi(), "hcn": HCN(), "diag": DiagN("fd"), "newton": Newton()}[family]
    for k in range(1, 4):
        plan = Plan(chunks=L, iters=k, surrogate=sur)
        with torch.no_grad():
            a = solve(base, idx, plan, keep_states=True).states[-1]
            b = solve(pert, idx, plan, keep_states=True).states[-1]
        changed = [not torch.equal(a[c], b[c]) for c in range(L)]
        expect = [(j <= c < j + k) if family == "none" else c >= j for c in range(L)]
        assert changed == expect, (k, changed)

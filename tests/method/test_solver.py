"""SNLP's exact laws (paper Methods, App. Algorithm, correction-propagation table) on random models."""

from __future__ import annotations

import pytest
import torch
from conftest import configs, make_model, tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from snlp import Jacobi, Plan, SNLPDivergenceError, bind, fused_forward, fused_sequential, parallel_forward, solve
from snlp.method.fusion import chunk_weights
from snlp.model.ops import norm

SURROGATES = ["idn", "none"]


@st.composite
def model_and_plan(draw, fuse_max: int = 3, exact: bool = True):
    cfg = draw(configs())
    L = cfg["n_layer"]
    fuse = draw(st.integers(1, min(fuse_max, L)))
    chunks = draw(st.integers(1, L // fuse))
    sur = draw(st.sampled_from(SURROGATES))
    order = None
    if sur != "none" and draw(st.booleans()):  # Jacobi has no correction to damp or order
        order = tuple(draw(st.permutations(range(chunks))))
    plan = Plan(chunks=chunks, fuse=fuse, init=draw(st.sampled_from(["h0", "fwd"])), surrogate=sur,
                elk=draw(st.sampled_from([0.0, 0.25])) if sur != "none" else 0.0, order=order)
    K = plan.exact_iters()  # C for forward order (and Jacobi), C + #lagged chunks otherwise
    plan = plan.with_(iters=draw(st.integers(K, K + 2)) if exact else draw(st.integers(0, K + 1)))
    return cfg, plan, draw(st.integers(0, 2 ** 16))


@pytest.mark.parametrize("x0,ve,windows,kv", [(True, True, "SL", 1), (False, False, "L", 2), (True, False, "SSL", 2)])
@pytest.mark.parametrize("init", ["h0", "fwd"])
@pytest.mark.parametrize("surrogate", SURROGATES)
def test_fp32_exactness_tolerance(x0, ve, windows, kv, init, surrogate):
    """Same law in fp32 with fp32 tolerance (the dtype users run)."""
    model = make_model(seed=3, dtype=torch.float32, n_layer=6, x0_residual=x0, value_embeds=ve,
                       window_pattern=windows, n_kv_head=kv)
    idx = tokens(model, T=11)
    with torch.no_grad():
        out = parallel_forward(model, idx, Plan(chunks=5, init=init, iters=5, surrogate=surrogate))
        torch.testing.assert_close(out, model(idx), rtol=1e-4, atol=1e-4)


def test_fused_model_with_M1_is_the_original_model():
    model = make_model(seed=5)
    idx = tokens(model)
    with torch.no_grad():
        torch.testing.assert_close(fused_forward(model, idx, "6xF1"), model(idx), rtol=1e-10, atol=1e-10)
        assert not torch.allclose(fused_forward(model, idx, "2xF3"), model(idx), atol=1e-3)  # fusion changes it


# ---------------------------------------------------------------- closed forms
def test_idn_one_step_is_prefix_state_plus_sum_of_branches():
    """IDN K=1 from h0 on a plain residual model: h_L = h_S + sum_l g_l(h_S) (App. variance derivation)."""
    model = make_model(seed=2, n_layer=7, x0_residual=False, value_embeds=False)
    idx = tokens(model)
    with torch.no_grad():
        res = solve(model, idx, "5xF1-h0-K1")
        ctx = model.embed(idx)
        hS = model.run_layers(ctx.x0, ctx, 0, 2)
        want = hS + sum(model.layer(l, hS, ctx) - hS for l in range(2, 7))
    torch.testing.assert_close(res.hidden, want, rtol=1e-10, atol=1e-10)


def test_K0_is_early_exit_and_fwd_init_is_one_batched_forward():
    model = make_model(seed=4)
    idx = tokens(model)
    with torch.no_grad():
        ctx = model.embed(idx)
        hS = model.run_layers(ctx.x0, ctx, 0, 2)
        torch.testing.assert_close(solve(model, idx, "4xF1-h0-K0").hidden, hS)  # suffix skipped (early exit)
        torch.testing.assert_close(solve(model, idx, "4xF1-fwd-K0").hidden, model.layer(5, hS, ctx))


# ---------------------------------------------------------------- batched/fused path == slow reference loop
def slow_chunk(model, layers, h, ctx):
    """Paper App. "Fused Cross-Layer Coupling", branch by branch with the model's own modules:
    u = x_C + sum_l gamma_l Attn_l(norm(x_C)); F = u + sum_l gamma_l MLP_l(norm(u))."""
    cfg = model.config
    alpha, beta, gammas = 1.0, 0.0, []
    for l in layers:  # compose the residual path and each branch's downstream resid scale
        if cfg.x0_residual:
            lr, l0 = model.resid_lambdas[l], model.x0_lambdas[l]
            alpha, beta = lr * alpha, lr * beta + l0
            gammas = [g * lr for g in gammas]
        gammas.append(1.0)
    x = alpha * h + beta * ctx.x0 if cfg.x0_residual else h
    xn = norm(x)
    ve = lambda l: ctx.ve[model.ve_slot[l]] if model.ve_slot[l] >= 0 else None  # noqa: E731
    u = x + sum(g * model.blocks[l].attn(xn, ve(l), ctx.cos, ctx.sin) for g, l in zip(gammas, layers))
    return u + sum(g * model.blocks[l].mlp(norm(u)) for g, l in zip(gammas, layers))


def slow_solve(model, idx, plan):
    """Algorithm "IDN Batched SNLP Inference" as an in-place sweep over chunks in correction order
    (paper App. "Correction Ordering"): the sweep visits chunks in order pi and corrects chunk c by
    its predecessor's most recent update: made earlier in this sweep if pi visited c-1 already,
    else made in the previous sweep (none before the first sweep)."""
    L, C, M = model.config.n_layer, plan.chunks, plan.fuse
    S = L - C * M
    ctx = model.embed(idx)
    hS = model.run_layers(ctx.x0, ctx, 0, S)
    chunk = lambda c, h: slow_chunk(model, range(S + c * M, S + (c + 1) * M), h, ctx)  # noqa: E731
    old = [chunk(c, hS) if plan.init == "fwd" else hS for c in range(C)]
    last_update = [torch.zeros_like(hS) for _ in range(C)]  # each chunk's most recent update
    states = [torch.stack(old)]
    for _ in range(plan.iters):
        inputs = [hS] + old[:-1]
        tilde = [chunk(c, inputs[c]) for c in range(C)]
        new = list(old)  # entries not yet visited in this sweep still hold h^(k)
        for c in (plan.order or range(C)):
            prev_delta = last_update[c - 1] if c > 0 else torch.zeros_like(hS)
            a = 0.0 if isinstance(plan.surrogate, Jacobi) else 1.0 - plan.elk
            new[c] = tilde[c] + a * prev_delta
            last_update[c] = new[c] - old[c]
        old = new
        states.append(torch.stack(old))
    return states


@settings(max_examples=40, deadline=None)
@given(model_and_plan(fuse_max=3, exact=False))
def test_batched_fused_solver_equals_slow_per_layer_reference(args):
    cfg, plan, seed = args
    model = make_model(seed=seed, **cfg)
    idx = tokens(model, B=2, T=6, seed=seed)
    with torch.no_grad():
        fast = solve(model, idx, plan, keep_states=True).states
        slow = slow_solve(model, idx, plan)
    assert len(fast) == len(slow)
    for f, s in zip(fast, slow):
        torch.testing.assert_close(f.expand_as(s), s, rtol=1e-9, atol=1e-9)


def test_reversed_order_equals_no_correction_at_K1_and_differs_from_K2_on():
    """The ordering table's rows: a reversed sweep sees no corrected predecessor in the first sweep
    (= Jacobi at K = 1), but the previous sweep's updates propagate from K = 2 on (paper: reversed
    41.7 vs no correction 19.7 at K = 4, N = 8)."""
    model = make_model(seed=9)
    idx = tokens(model)
    with torch.no_grad():
        rev = parallel_forward(model, idx, "5xF1-h0-K1-order:reversed")
        torch.testing.assert_close(rev, parallel_forward(model, idx, "5xF1-h0-K1-none"))
        assert not torch.allclose(rev, parallel_forward(model, idx, "5xF1-h0-K1"))
        for K in (2, 4):
            rev = parallel_forward(model, idx, f"5xF1-h0-K{K}-order:reversed")
            assert (rev - parallel_forward(model, idx, f"5xF1-h0-K{K}-none")).abs().max() > 1e-6, K
        # exact from K = C + #lagged = 2C - 1 on, not before
        exact = model(idx)
        torch.testing.assert_close(parallel_forward(model, idx, "5xF1-h0-K9-order:reversed"), exact)
        assert (parallel_forward(model, idx, "5xF1-h0-K8-order:reversed") - exact).abs().max() > 1e-8


@pytest.mark.parametrize("plan", ["5xF1-h0-K3", "2xF2-fwd-K2-elk:0.25", "4xF1-h0-K2-none"])
def test_forward_order_is_the_plain_recurrence_bit_for_bit(plan):
    """Forward order: every iteration is h <- tilde + cumsum-corrected (IDN) / tilde (Jacobi), exactly
    the pre-ordering-fix recurrence, to the last bit; `order:forward` parses to the same plan."""
    model = make_model(seed=13)
    idx = tokens(model)
    p = Plan.parse(plan)
    assert Plan.parse(plan + "-order:forward") == p and p.order is None
    with torch.no_grad():
        got = solve(model, idx, p, keep_states=True).states
        ctx = model.embed(idx)
        S = model.config.n_layer - p.n_suffix
        hS = model.run_layers(ctx.x0, ctx, 0, S)
        w = chunk_weights(model, S, p.chunks, p.fuse)
        from snlp.method.fusion import chunk_forward
        h = hS.expand(p.chunks, *hS.shape)
        if p.init == "fwd":
            h = chunk_forward(w, h, ctx)
        want = [h]
        for _ in range(p.iters):
            tilde = chunk_forward(w, torch.cat([hS[None], h[:-1]], 0), ctx)
            if isinstance(p.surrogate, Jacobi):
                h = tilde
            elif p.elk == 0:
                h = h + (tilde - h).cumsum(0)
            else:
                from snlp.method.surrogates import transfer_matrix
                h = h + torch.einsum("cj,j...->c...", transfer_matrix(tuple(p.link_factors())).to(h.dtype), tilde - h)
            want.append(h)
    assert len(got) == len(want)
    for g, w_ in zip(got, want):
        assert torch.equal(g, w_)


@pytest.mark.parametrize("order", ["reversed", "2.0.1.3", "1.0.3.2"])
def test_lagged_order_semantics_per_surrogate(order):
    """The ordering laws hold for every surrogate family (IDN transfer matrix, DiagN scan, Newton
    loop): exact at K = Plan.exact_iters(); reversed order equals Jacobi at K = 1."""
    model = make_model(seed=21, n_layer=6)
    idx = tokens(model, T=5)
    with torch.no_grad():
        ref = model(idx)
        for sur in ("idn", "diag:jvp", "newton"):
            p = Plan.parse(f"4xF1-h0-K1-{sur}-order:{order}")
            K = p.exact_iters()
            torch.testing.assert_close(parallel_forward(model, idx, p.with_(iters=K)), ref, rtol=1e-9, atol=1e-9)
            if order == "reversed":
                torch.testing.assert_close(parallel_forward(model, idx, p), parallel_forward(model, idx, "4xF1-h0-K1-none"))


@pytest.mark.parametrize("init", ["h0", "fwd"])
@pytest.mark.parametrize("sur,order", [(s, o) for s in ("idn", "newton") for o in ("forward", "reversed", "1.2.0.3", "2.0.3.1")]
                         + [("none", "forward")])  # Jacobi makes no correction: no order to give it
def test_exact_iters_is_the_first_exact_K(init, sur, order):
    """Plan.exact_iters() is the smallest K whose output equals the sequential model: K - 1 is not exact (so the
    command line's cap to it never drops a needed iteration) and K is. The fwd init starts from F_c(h_S), so chunk 0
    is exact before the first iteration and every chunk one iteration earlier than from h0 (K = C - 1 in forward
    order): claiming C there made `snlp eval --plans 4xF1-fwd-K4` run an iteration that changes nothing."""
    model = make_model(seed=23, n_layer=5)
    idx = tokens(model, T=6)
    plan = Plan.parse(f"4xF1-{init}-K0-{sur}-order:{order}")
    K = plan.exact_iters()
    with torch.no_grad():
        ref = model(idx)
        torch.testing.assert_close(parallel_forward(model, idx, plan.with_(iters=K)), ref, rtol=1e-9, atol=1e-9)
        assert float((parallel_forward(model, idx, plan.with_(iters=K - 1)) - ref).abs().max()) > 1e-6, (str(plan), K)


def test_the_divergence_message_suggests_only_what_the_plan_can_take():
    """A NaN/inf solve said "try ... ELK damping (-elk:0.1) or the h0 init" for every plan: a none plan refuses elk,
    an h0 plan has that init already, and at K >= exact_iters no solver setting changes the (fused) model's output."""
    model = make_model(seed=1, n_layer=5)
    with torch.no_grad():
        model.blocks[-1].mlp.c_proj.weight[0, 0] = float("nan")
    idx = tokens(model, T=4)

    def message(plan):
        with pytest.raises(SNLPDivergenceError) as e, torch.no_grad():
            solve(model, idx, plan)
        return str(e.value)

    jacobi = message("4xF1-h0-K1-none")
    assert "K >= 4 is exact" in jacobi and "elk" not in jacobi and "h0 init" not in jacobi, jacobi
    fwd = message("4xF1-fwd-K1")
    assert "K >= 3 is exact" in fwd and "(-elk:0.1)" in fwd and "the h0 init" in fwd, fwd
    exact = message("4xF1-h0-K4")
    assert "check its sequential forward" in exact and "more iterations" not in exact and "elk" not in exact, exact


def test_seq_perm_identity_is_sequential_and_permutations_change_it():
    from snlp.method.solver import permuted_sequential
    model = make_model(seed=17, n_layer=6)
    idx = tokens(model)
    with torch.no_grad():
        torch.testing.assert_close(model.head(permuted_sequential(model, idx, "4xF1").hidden), model(idx),
                                   rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(permuted_sequential(model, idx, "2xF2").hidden,
                                   fused_sequential(model, idx, "2xF2").hidden, rtol=0, atol=0)
        rev = permuted_sequential(model, idx, "4xF1-order:reversed")
        assert rev.states[0].shape[0] == 4
        assert (rev.hidden - permuted_sequential(model, idx, "4xF1", order=(0, 2, 1, 3)).hidden).abs().max() > 1e-6
        # reversed by hand: layers 5, 4, 3, 2 after the 2-layer prefix
        ctx = model.embed(idx)
        h = model.run_layers(ctx.x0, ctx, 0, 2)
        for l in (5, 4, 3, 2):
            h = model.layer(l, h, ctx)
        torch.testing.assert_close(rev.hidden, h, rtol=1e-10, atol=1e-10)
        with pytest.raises(ValueError, match="permutation"):
            permuted_sequential(model, idx, "4xF1", order=(0, 1, 1, 3))


def test_sliding_windows_are_kept_in_the_fused_batched_path():
    """A window shorter than T changes the result, and the solver agrees with the windowed model."""
    kw = dict(seed=6, n_layer=4, x0_residual=False, value_embeds=False, short_window=2)
    windowed, full = make_model(window_pattern="S", **kw), make_model(window_pattern="L", **kw)
    idx = tokens(windowed, T=10)
    with torch.no_grad():
        for plan in ["4xF1-h0-K4", "2xF2-h0-K2", "1xF4-h0-K1"]:
            w, f = fused_forward(windowed, idx, plan), fused_forward(full, idx, plan)
            assert not torch.allclose(w, f, atol=1e-6)
            torch.testing.assert_close(parallel_forward(windowed, idx, plan), w, rtol=1e-9, atol=1e-9)


# What an iteration re-runs (docs/records/gpu-prefill-gap-2026-11-26.md): ops that depend only on the
# tokens and the weights (attention masks, value-embedding gathers, static mHC maps and HCN transfer blocks) are made
# once per forward, so one more iteration adds none of them. Counts, not times.
SETUP_OPS = {"arange", "ge", "le", "lt", "bitwise_and", "bitwise_or", "logical_not", "where", "full", "masked_fill_",
             "index", "eye", "exp", "amax", "clamp_min", "div", "sigmoid_"}


@pytest.mark.parametrize("case", ["windows+ve", "static-mhc-hcn"])
def test_one_more_iteration_rebuilds_no_mask_gather_or_map(case):
    from conftest import count_aten, mhc_model

    if case == "windows+ve":
        model, plans = make_model(seed=2, n_layer=6, window_pattern="SSL", short_window=3), ("4xF1-h0-K3", "4xF1-h0-K4")
    else:
        model, plans = mhc_model(seed=2, n=3, dynamic=False, n_layer=6, window_pattern="SL", short_window=3), \
            ("4xF1-h0-K3-hcn", "4xF1-h0-K4-hcn")
    idx = tokens(model, T=9)
    runners = [bind(model, p, check_finite=False) for p in plans]
    ops = [count_aten(lambda r=r: r(idx)) for r in runners]
    extra = ops[1] - ops[0]
    assert sum(extra.values()) > 0 and not set(extra) & SETUP_OPS, extra
    if case == "static-mhc-hcn":  # the correction is one contraction, not log2(C) rounds of matmul + add + cat (the
        # log-depth scan): over the same iteration with IDN's correction, HCN adds no cat and at most two bmm (the
        # transfer contraction, one GEMM per row, and the map applied to the update)
        idn = [count_aten(lambda r=r: r(idx)) for r in (bind(model, p.replace("-hcn", ""), check_finite=False)
                                                        for p in plans)]
        more = extra - (idn[1] - idn[0])
        assert "cat" not in more and "mm" not in more and more["bmm"] <= 2, more
    with torch.no_grad():
        for plan, r in zip(plans, runners):  # and the plans still are what they compute (K >= C: the fused model)
            if Plan.parse(plan).iters >= 4:
                torch.testing.assert_close(r(idx), fused_forward(model, idx, plan), rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- weights cache, gradients, errors
def test_parallel_forward_always_reads_the_current_weights():
    """No implicit fused-weight cache: an in-place edit through `.data` (no version bump) used to leave
    `2xF1-h0-K2`, an exact plan, off by ~2 from the edited model."""
    model = make_model(seed=1)
    idx = tokens(model)
    with torch.no_grad():
        parallel_forward(model, idx, "2xF1-h0-K2")
        for p in model.blocks[5].parameters():
            p.data.mul_(0.5)  # bypasses autograd's version counter
        torch.testing.assert_close(parallel_forward(model, idx, "2xF1-h0-K2"), model(idx), rtol=1e-9, atol=1e-9)
        assert chunk_weights(model, 2, 2, 2) is not chunk_weights(model, 2, 2, 2)  # built fresh every call


def _update(model, how: str, idx) -> None:
    """Change every parameter of `model` the way `how` names (what a user does between runner calls)."""
    other = make_model(seed=9, dtype=model.wte.weight.dtype)
    if how == "optimizer step":
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        model(idx).square().mean().backward()
        opt.step()
        opt.zero_grad()
    elif how == "load_state_dict":
        model.load_state_dict(other.state_dict())
    elif how == "copy_ under no_grad":
        with torch.no_grad():
            for p, q in zip(model.parameters(), other.parameters()):
                p.copy_(q)
    elif how == "p.data = t":
        for p, q in zip(model.parameters(), other.parameters()):
            p.data = q.data.clone()
    elif how == "model.to(float32)":
        model.to(torch.float32)


@pytest.mark.parametrize("how", ["optimizer step", "load_state_dict", "copy_ under no_grad", "p.data = t",
                                 "model.to(float32)"])
@pytest.mark.parametrize("plan,share", [("4xF1-h0-K1", False), ("2xF2-h0-K1", False), ("4xF1-h0-K1", True)])
def test_runner_follows_weight_updates_without_refresh(plan, share, how):
    """After an update of the model's weights the runner's next call rebuilds its fused weights (Runner.current:
    version counters and addresses) and equals a fresh bind and the solver run on the current weights
    (parallel_forward, which fuses on every call), in fp64; it used to return the old weights' logits silently
    (a gap of 5 in the logits) or, after model.to, fail inside the fusion on mixed dtypes."""
    model = make_model(seed=1)
    idx = tokens(model)
    runner = bind(model, plan, share_weights=share)
    with torch.no_grad():
        runner(idx)
    _update(model, how, idx)
    with torch.no_grad():
        got = runner(idx)
        tol = 1e-5 if how == "model.to(float32)" else 1e-10
        torch.testing.assert_close(got, parallel_forward(model, idx, plan), rtol=tol, atol=tol)
        torch.testing.assert_close(got, bind(model, plan)(idx), rtol=tol, atol=tol)
        assert not runner.current()  # rebuilt once; the next call reads the same weights


def test_weights_rebuilt_under_inference_mode_still_serve_a_grad_mode_call():
    """The rebuild runs inside whatever mode the call is in (decode loops: inference_mode); its tensors are normal
    ones, so a later call under grad mode (the prefix parameters require grad) can still backpropagate."""
    model = make_model(seed=2)
    idx = tokens(model)
    runner = bind(model, "4xF1-h0-K1")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    with torch.inference_mode():
        runner(idx)  # rebuilt here
    assert not runner.weights.qkv.is_inference()
    runner(idx).square().mean().backward()
    assert model.wte.weight.grad is not None


@pytest.mark.parametrize("call, name", [
    (lambda m, x, v: bind(m, "2xF1-h0-K1", check_finite=v), "check_finite"),
    (lambda m, x, v: bind(m, "2xF1-h0-K1", share_weights=v), "share_weights"),
    (lambda m, x, v: solve(m, x, "2xF1-h0-K1", keep_states=v), "keep_states"),
    (lambda m, x, v: solve(m, x, "2xF1-h0-K1", check_finite=v), "check_finite"),
    (lambda m, x, v: parallel_forward(m, x, "2xF1-h0-K1", check_finite=v), "check_finite"),
    (lambda m, x, v: bind(m, "2xF1-h0-K1").solve(x, keep_states=v), "keep_states"),
])
def test_boolean_options_are_true_or_false(call, name):
    """`share_weights="False"` used to share (truthy), `check_finite=0` to skip the check; numpy's bool_ is taken."""
    import numpy as np

    model = make_model(seed=1)
    idx = tokens(model)
    for bad in ("False", "no", 1, None):
        with pytest.raises(ValueError, match=rf"^{name} must be True or False \(got {bad!r} of type "):
            call(model, idx, bad)
    call(model, idx, np.bool_(True))
    call(model, idx, False)


def test_bound_runner_holds_its_weights_until_refreshed():
    model = make_model(seed=1)
    idx = tokens(model)
    with torch.no_grad():
        runner = bind(model, "2xF2-h0-K2")
        torch.testing.assert_close(runner(idx), fused_forward(model, idx, "2xF2"), rtol=1e-9, atol=1e-9)
        w = runner.weights
        model.blocks[3].mlp.c_fc.weight.data.mul_(0.5)
        assert runner.weights is w  # an edit through .data moves no version counter (Runner docstring)
        stale = runner(idx)
        assert runner.refresh() is runner and runner.weights is not w
        fresh = runner(idx)
        assert not torch.allclose(stale, fresh)
        torch.testing.assert_close(fresh, fused_forward(model, idx, "2xF2"), rtol=1e-9, atol=1e-9)
        res = runner.solve(idx, keep_states=True)
        assert res.iters == 2 and len(res.states) == 3 and res.plan == Plan.parse("2xF2-h0-K2")
    with pytest.raises(ValueError, match="model has only L = 6"):
        bind(model, "4xF2")
    assert "2xF2-h0-K2" in repr(runner)


def test_torch_compile_of_a_bound_runner_equals_eager():
    model = make_model(seed=4, dtype=torch.float32)
    idx = tokens(model, T=5)
    runner = bind(model, "2xF2-h0-K1", check_finite=False)
    with torch.no_grad():
        compiled = torch.compile(runner, backend="aot_eager")  # fullgraph: no host sync in attend
        torch.testing.assert_close(compiled(idx), runner(idx), rtol=1e-5, atol=1e-5)


def test_prefix_state_with_a_kv_cache_is_refused():
    """solve(prefix=..., cache=...) would skip the prefix layers' K/V writes while the cache advances."""
    from snlp.model.cache import KVCache

    model = make_model(seed=1)
    idx = tokens(model, B=1)
    cache = KVCache.for_model(model, batch=1, max_len=16)
    hS = model.hidden_states(idx)[2]
    with pytest.raises(ValueError, match="prefix layers"):
        solve(model, idx, "4xF1-h0-K1", prefix=hS, cache=cache)
    assert cache.length == 0  # nothing advanced


def test_gradients_flow_through_the_solver_into_the_weights():
    model = make_model(seed=1).train()
    idx = tokens(model)
    parallel_forward(model, idx, "2xF2-h0-K1").logsumexp(-1).mean().backward()
    for l in (2, 5):
        assert model.blocks[l].mlp.c_fc.weight.grad is not None
        assert model.blocks[l].mlp.c_fc.weight.grad.abs().sum() > 0
    assert model.x0_lambdas.grad[4] != 0


def test_divergence_is_detected_and_reported():
    model = make_model(seed=1)
    with torch.no_grad():
        model.blocks[4].mlp.c_proj.weight.fill_(float("nan"))
    with pytest.raises(SNLPDivergenceError, match="4xF1-h0-K1 diverged"), torch.no_grad():
        parallel_forward(model, tokens(model), "4xF1-h0-K1")


@pytest.mark.parametrize("plan,msg", [("3xF3", "needs a suffix of N = 3x3 = 9 layers but the model has only L = 6"),
                                      ("7xF1", "use at most 6 chunks of 1"),
                                      ("2xF2-warm", "unknown part 'warm'")])
def test_plans_that_do_not_fit_raise(plan, msg):
    model = make_model()
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        parallel_forward(model, tokens(model), plan)


@pytest.mark.parametrize("idx,msg", [(torch.zeros(5, dtype=torch.long), "shape"),
                                     (torch.zeros(1, 0, dtype=torch.long), "shape"),
                                     (torch.zeros(1, 3), "integer"),
                                     (torch.full((1, 3), 61), r"\[0, 61\)"),
                                     ([[1, 2]], "torch.Tensor")])
def test_bad_inputs_raise_clear_errors(idx, msg):
    model = make_model()
    for fn in (model, lambda i: parallel_forward(model, i, "2xF1")):
        with pytest.raises(ValueError, match=msg):
            fn(idx)


def test_a_given_prefix_state_replaces_the_prefix_run():
    """solve(prefix=h_S) (the training trace's h_S) gives the same states as running the prefix."""
    model = make_model(seed=7)
    idx = tokens(model)
    with torch.no_grad():
        trace = model.hidden_states(idx)
        ran = solve(model, idx, "4xF1-h0-K2", keep_states=True)
        given = solve(model, idx, "4xF1-h0-K2", keep_states=True, prefix=trace[2])
    torch.testing.assert_close(given.prefix, ran.prefix, rtol=0, atol=0)
    for a, b in zip(given.states, ran.states):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

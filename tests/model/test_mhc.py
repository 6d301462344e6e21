"""mHC models (GPTConfig.hc_streams) and the HCN surrogate: Sinkhorn, the fused mHC chunk (M = 1 is the
sequential layer, M > 1 the documented definition), SNLP's exact laws with hcn and idn, HCN = IDN in the
degenerate cases, KV-cached decoding, gradients, training with --reg hcn and checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_model, mhc_model, tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from snlp import GPT, GPTConfig, Plan, fused_forward, parallel_forward, solve
from snlp.model.cache import KVCache
from snlp.io.checkpoint import load, save_checkpoint
from snlp.apps.cli import main
from snlp.method.fusion import chunk_forward, chunk_weights
from snlp.model.hc import hc_sublayer, sinkhorn
from snlp.model.ops import norm
from snlp.train.regularizer import RegConfig, snlp_loss

TOL = dict(rtol=1e-9, atol=1e-9)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: threads only add contention


@st.composite
def mhc_configs(draw, min_layers: int = 2, max_layers: int = 5):
    n_kv = draw(st.sampled_from([1, 2]))
    n_head = n_kv * draw(st.sampled_from([1, 2]))
    return dict(
        n=draw(st.sampled_from([1, 2, 3])), dynamic=draw(st.booleans()),
        n_layer=draw(st.integers(min_layers, max_layers)), n_head=n_head, n_kv_head=n_kv,
        n_embd=n_head * draw(st.sampled_from([4, 8])), value_embeds=draw(st.booleans()),
        window_pattern=draw(st.sampled_from(["L", "SL", "S"])), short_window=draw(st.integers(1, 4)))


@st.composite
def mhc_model_and_plan(draw, fuse_max: int = 3, exact: bool = True):
    cfg = draw(mhc_configs())
    L = cfg["n_layer"]
    fuse = draw(st.integers(1, min(fuse_max, L)))
    chunks = draw(st.integers(1, L // fuse))
    order = tuple(draw(st.permutations(range(chunks)))) if draw(st.booleans()) else None
    plan = Plan(chunks=chunks, fuse=fuse, init=draw(st.sampled_from(["h0", "fwd"])),
                surrogate=draw(st.sampled_from(["hcn", "idn"])), elk=draw(st.sampled_from([0.0, 0.25])), order=order)
    K = plan.exact_iters()  # C for forward order, C + #lagged chunks otherwise (snlp.solver)
    plan = plan.with_(iters=draw(st.integers(K, K + 1)) if exact else draw(st.integers(0, K + 1)))
    return cfg, plan, draw(st.integers(0, 2 ** 16))


# ---------------------------------------------------------------- Sinkhorn, config, init
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_sinkhorn_output_is_doubly_stochastic(n, dtype):
    gen = torch.Generator().manual_seed(n)
    logits = torch.randn(200, n, n, generator=gen).to(dtype)
    H = sinkhorn(logits)
    assert H.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)  # at least fp32
    assert bool((H >= 0).all())
    assert (H.sum(-2) - 1).abs().max() < 1e-6  # ends on a column normalisation: exact
    assert (H.sum(-1) - 1).abs().max() < 1e-2  # rows: up to the convergence error of 20 rounds (mHC's count)
    if dtype == torch.float64:  # and it converges to a doubly stochastic matrix
        assert (sinkhorn(logits[:50], iters=300).sum(-1) - 1).abs().max() < 1e-12
    big = sinkhorn((torch.randn(50, n, n, generator=gen) * 1000).to(dtype))  # no overflow, no all-zero row/column
    assert bool(torch.isfinite(big).all()) and (big.sum(-2) - 1).abs().max() < 1e-6


def test_mhc_config_x0_choice_and_round_trip():
    base = dict(vocab_size=61, n_layer=2, n_head=2, n_embd=16)
    assert GPTConfig(**base).x0_residual is True  # plain: on by default (unchanged)
    cfg = GPTConfig(**base, hc_streams=3)
    assert cfg.x0_residual is False and cfg.hc_dynamic  # mHC: off automatically
    assert GPTConfig(**cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="x0 residual cannot be combined with mHC"):
        GPTConfig(**base, hc_streams=2, x0_residual=True)
    with pytest.raises(ValueError, match="hc_streams must be an integer >= 0"):
        GPTConfig(**base, hc_streams=-1)
    assert GPTConfig.from_depth(2, head_dim=8, hc_streams=2).x0_residual is False


@pytest.mark.parametrize("n,dynamic", [(1, True), (2, False), (4, True)])
def test_mhc_at_init_computes_the_plain_model(n, dynamic):
    """Identical copied streams, H_res ~ I (rows sum to 1), H_post = 1: at init (any block weights) mHC
    computes the plain model with x0 off; its h_l are the plain h_l copied to every stream."""
    base = dict(vocab_size=61, n_layer=3, n_head=2, n_embd=16, x0_residual=False)
    plain = GPT(GPTConfig(**base)).double()
    plain.init_weights(seed=0)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # non-identity blocks
    mhc = GPT(GPTConfig(**base, hc_streams=n, hc_dynamic=dynamic)).double()
    mhc.init_weights(seed=0)
    assert not mhc.load_state_dict(plain.state_dict(), strict=False).unexpected_keys
    idx = tokens(plain)
    with torch.no_grad():
        torch.testing.assert_close(mhc(idx), plain(idx), rtol=1e-6, atol=1e-6)
        hs = mhc.hidden_states(idx)
        assert hs[-1].shape == (*idx.shape, n, 16)
        torch.testing.assert_close(hs[-1], plain.hidden_states(idx)[-1][..., None, :].expand_as(hs[-1]),
                                   rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- the fused mHC chunk
@pytest.mark.parametrize("n,dynamic", [(1, True), (2, True), (3, False), (2, False)])
def test_M1_fused_chunk_is_the_sequential_mhc_layer_and_mix_is_hres_product(n, dynamic):
    model = mhc_model(seed=n, n=n, dynamic=dynamic, n_layer=4)
    idx = tokens(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        ctx = model.embed(idx)
        for l in range(4):
            h = torch.randn(*idx.shape, n, 16, generator=gen, dtype=torch.float64)
            out, A = chunk_forward(chunk_weights(model, l, 1, 1), h[None], ctx, mix=True)
            torch.testing.assert_close(out[0], model.layer(l, h, ctx), rtol=1e-12, atol=1e-12)
            block = model.blocks[l]
            ve = ctx.ve[model.ve_slot[l]] if model.ve_slot[l] >= 0 else None
            u = hc_sublayer(block.hc_attn, h, lambda xn: block.attn(xn, ve, ctx.cos, ctx.sin))
            want = block.hc_mlp(u)[0] @ block.hc_attn(h)[0]  # paper Eq. hcn-A at the current iterate
            torch.testing.assert_close(A[0], want.expand_as(A[0]), rtol=1e-12, atol=1e-12)


def slow_mhc_chunk(model, layers, x, ctx):
    """fusion.py's definition, branch by branch with the model's own modules:
    u = P_A x + sum_l G_{a,l} p_{a,l} Attn_l(norm(q_{a,l} x)) with every H from x, then the MLP stage on u.
    Returns (F, P_M P_A)."""
    def stage(hcs, branches, z):
        coeffs = [hc(z) for hc in hcs]  # (R, q, p) of each sublayer at the stage input
        out, P = 0, None
        for j, (R, q, p) in enumerate(coeffs):
            G = torch.eye(z.shape[-2], dtype=z.dtype)
            for R2, _, _ in coeffs[j + 1:]:
                G = R2 @ G
            y = branches[j](norm((q.unsqueeze(-2) @ z).squeeze(-2)))
            out = out + (G @ p.unsqueeze(-1)) * y.unsqueeze(-2)
            P = R if P is None else R @ P
        return P @ z + out, P

    ve = lambda l: ctx.ve[model.ve_slot[l]] if model.ve_slot[l] >= 0 else None  # noqa: E731
    attn = [(lambda l: lambda xn: model.blocks[l].attn(xn, ve(l), ctx.cos, ctx.sin))(l) for l in layers]
    u, P_a = stage([model.blocks[l].hc_attn for l in layers], attn, x)
    F, P_m = stage([model.blocks[l].hc_mlp for l in layers], [model.blocks[l].mlp for l in layers], u)
    return F, P_m @ P_a


@settings(max_examples=20, deadline=None)
@given(mhc_configs(), st.integers(1, 3), st.integers(0, 2 ** 16))
def test_batched_fused_mhc_chunks_equal_the_branchwise_definition(cfg, fuse, seed):
    n, dynamic = cfg.pop("n"), cfg.pop("dynamic")
    model = mhc_model(seed=seed, n=n, dynamic=dynamic, **cfg)
    L = cfg["n_layer"]
    fuse = min(fuse, L)
    C = L // fuse
    S = L - C * fuse
    idx = tokens(model, B=2, T=5, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ctx = model.embed(idx)
        h = torch.randn(C, *idx.shape, n, cfg["n_embd"], generator=gen, dtype=torch.float64)
        out, A = chunk_forward(chunk_weights(model, S, C, fuse), h, ctx, mix=True)
        for c in range(C):
            F, P = slow_mhc_chunk(model, range(S + c * fuse, S + (c + 1) * fuse), h[c], ctx)
            torch.testing.assert_close(out[c], F, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(A[c], P.expand_as(A[c]), rtol=1e-10, atol=1e-10)


def slow_hcn_solve(model, idx, plan):
    """Algorithm "IDN/HCN Batched SNLP Inference" as an in-place sweep in correction order, with
    A_c = the chunk's stream matrix at its current input (HCN) applied to the streams."""
    L, C, M = model.config.n_layer, plan.chunks, plan.fuse
    S = L - C * M
    ctx = model.embed(idx)
    hS = model.run_layers(ctx.x0, ctx, 0, S)
    chunk = lambda c, h: slow_mhc_chunk(model, range(S + c * M, S + (c + 1) * M), h, ctx)  # noqa: E731
    old = [chunk(c, hS)[0] if plan.init == "fwd" else hS for c in range(C)]
    last_update = [torch.zeros_like(hS) for _ in range(C)]  # each chunk's most recent update (App. ordering)
    states = [torch.stack(old)]
    for _ in range(plan.iters):
        evals = [chunk(c, x) for c, x in enumerate([hS] + old[:-1])]
        new = list(old)
        for c in (plan.order or range(C)):
            prev = last_update[c - 1] if c > 0 else torch.zeros_like(hS)
            new[c] = evals[c][0] + (1.0 - plan.elk) * (evals[c][1] @ prev)
            last_update[c] = new[c] - old[c]
        old = new
        states.append(torch.stack(old))
    return states


@settings(max_examples=15, deadline=None)
@given(mhc_model_and_plan(fuse_max=2, exact=False))
def test_hcn_solver_equals_the_slow_sweep(args):
    cfg, plan, seed = args
    plan = plan.with_(surrogate="hcn")
    model = mhc_model(seed=seed, n=cfg.pop("n"), dynamic=cfg.pop("dynamic"), **cfg)
    idx = tokens(model, B=2, T=4, seed=seed)
    with torch.no_grad():
        fast = solve(model, idx, plan, keep_states=True).states
        slow = slow_hcn_solve(model, idx, plan)
    for f, s in zip(fast, slow):
        torch.testing.assert_close(f.expand_as(s), s, **TOL)


# ---------------------------------------------------------------- HCN vs IDN
@pytest.mark.parametrize("plan", ["5xF1-h0-K1", "5xF1-fwd-K2", "2xF2-h0-K1-elk:0.25", "4xF1-h0-K2-order:reversed"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_hcn_equals_idn_with_one_stream_or_identity_hres(plan, dynamic):
    one = mhc_model(seed=4, n=1, dynamic=dynamic)
    ident = mhc_model(seed=4, n=3, dynamic=dynamic)
    with torch.no_grad():  # H_res = Sinkhorn(exp(60 I + dynamic part)) = I to ~1e-24
        for block in ident.blocks:
            for hc in (block.hc_attn, block.hc_mlp):
                hc.bias[:9] = 60 * torch.eye(3, dtype=hc.bias.dtype).flatten()
    for model in (one, ident):
        idx = tokens(model)
        with torch.no_grad():
            hcn = solve(model, idx, f"{plan}-hcn", keep_states=True).states
            idn = solve(model, idx, plan, keep_states=True).states
        for a, b in zip(hcn, idn):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_hcn_differs_from_idn_and_keeps_the_final_stream_sum_at_K1():
    """With mixing H_res, HCN's chunk states differ from IDN's. Its h_L's stream sum (all the head
    reads) equals IDN's at K = 1: every A is column-stochastic, so 1^T A d = 1^T d along the scan."""
    model = mhc_model(seed=2, n=3)
    idx = tokens(model)
    with torch.no_grad():
        h1, i1 = solve(model, idx, "5xF1-h0-K1-hcn").hidden, solve(model, idx, "5xF1-h0-K1").hidden
        assert (h1 - i1).abs().max() > 1e-3
        torch.testing.assert_close(h1.sum(-2), i1.sum(-2), **TOL)
        k2 = parallel_forward(model, idx, "5xF1-h0-K2-hcn") - parallel_forward(model, idx, "5xF1-h0-K2")
        assert k2.abs().max() > 1e-4  # from K = 2 on the corrected chunk inputs differ, and so do the logits


def test_hcn_on_a_plain_model_raises_a_clear_error():
    model = make_model()
    with pytest.raises(ValueError, match="hcn surrogate needs an mHC model"):
        parallel_forward(model, tokens(model), "4xF1-h0-K1-hcn")
    with torch.no_grad(), pytest.raises(ValueError, match="plain residual stream"):
        ctx = model.embed(tokens(model))
        chunk_forward(chunk_weights(model, 2, 2, 2), ctx.x0.expand(2, *ctx.x0.shape), ctx, mix=True)


# ---------------------------------------------------------------- decoding, gradients, training, checkpoints
@pytest.mark.parametrize("plan", ["4xF1-h0-K4-hcn", "2xF2-h0-K2-hcn", "3xF1-fwd-K3", "2xF3-h0-K3-hcn-order:reversed"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_cached_mhc_decoding_equals_sequential(plan, dynamic):
    model = mhc_model(seed=5, n=2, dynamic=dynamic, n_head=4, n_kv_head=2)
    idx = tokens(model, B=2, T=9)
    with torch.no_grad():
        ref = fused_forward(model, idx, plan)  # = model(idx) for M = 1
        if Plan.parse(plan).fuse == 1:
            torch.testing.assert_close(ref, model(idx), **TOL)
        cache = KVCache.for_model(model, batch=2, max_len=12)
        got, start = [], 0
        for stop in (3, 6, 7, 9):  # prefill, multi-token, one-token steps
            got.append(parallel_forward(model, idx[:, start:stop], plan, cache=cache))
            start = stop
        seq_cache = KVCache.for_model(model, batch=2, max_len=12)
        seq = torch.cat([model(idx[:, :4], cache=seq_cache), model(idx[:, 4:], cache=seq_cache)], 1)
    torch.testing.assert_close(torch.cat(got, 1), ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(seq, model(idx), rtol=1e-10, atol=1e-10)


def test_streams_stay_fp32_under_autocast_and_fused_weights_follow_hc_updates():
    """Under bf16 autocast (training) the stream mixing runs in the streams' fp32, like the plain
    residual sum; in-place updates of the H parameters invalidate the cached fused weights."""
    model = mhc_model(seed=6, n=2, dtype=torch.float32)
    idx = tokens(model)
    with torch.no_grad():
        ref, ref_hcn = model.hidden_states(idx)[-1], solve(model, idx, "2xF2-h0-K1-hcn").hidden
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h, hcn = model.hidden_states(idx)[-1], solve(model, idx, "2xF2-h0-K1-hcn").hidden
        assert h.dtype == hcn.dtype == torch.float32
        assert (h - ref).norm() / ref.norm() < 0.03 and (hcn - ref_hcn).norm() / ref_hcn.norm() < 0.03  # bf16 branches
        before = parallel_forward(model, idx, "2xF2-h0-K1-hcn")
        model.blocks[4].hc_mlp.bias.add_(0.5)  # like an optimizer step
        assert not torch.allclose(parallel_forward(model, idx, "2xF2-h0-K1-hcn"), before)
        torch.testing.assert_close(parallel_forward(model, idx, "2xF2-h0-K2-hcn"), fused_forward(model, idx, "2xF2"),
                                   rtol=1e-4, atol=1e-4)


def test_hcn_regulariser_gradients_reach_the_mhc_parameters():
    model = mhc_model(seed=1, n=2).train()
    idx = tokens(model)
    trace = model.hidden_states(idx)
    loss = snlp_loss(model, idx, trace, RegConfig(surrogate="hcn", suffixes=(4,), detach=True))
    loss.backward()
    for name in ("hc_attn.bias", "hc_mlp.phi", "hc_attn.alpha", "mlp.c_fc.weight"):
        g = model.blocks[4].get_parameter(name).grad
        assert g is not None and g.abs().sum() > 0, name


def test_checkpoint_round_trip_keeps_mhc_logits_identical(tmp_path):
    for dynamic in (True, False):
        model = mhc_model(seed=3, n=2, dynamic=dynamic, dtype=torch.float32)
        save_checkpoint(tmp_path / f"m{dynamic}", model)
        again, _ = load(tmp_path / f"m{dynamic}")
        assert again.config == model.config and again.config.hc_streams == 2
        idx = tokens(model)
        with torch.no_grad():
            assert torch.equal(again(idx), model(idx))
            plan = "2xF2-h0-K1-hcn"
            assert torch.equal(parallel_forward(again, idx, plan), parallel_forward(model, idx, plan))


def test_mhc_parameters_go_to_adamw_not_muon():
    from argparse import Namespace

    from snlp.train.optim import build_optimizers
    model = GPT(GPTConfig(vocab_size=61, n_layer=2, n_head=2, n_embd=16, hc_streams=2))
    args = Namespace(embedding_lr=0.2, unembedding_lr=0.004, scalar_lr=0.5, hc_lr=0.005, optimizer="muon", compile=False,
                     matrix_lr=None, weight_decay=0.0)
    adamw, muon = build_optimizers(model, args)
    hc = {id(p) for name, p in model.named_parameters() if ".hc_" in name}
    assert len(hc) == 2 * 2 * 3  # 2 layers x (attn, mlp) x (bias, phi, alpha)
    assert not hc & {id(p) for g in muon.param_groups for p in g["params"]}
    assert hc <= {id(p) for g in adamw.param_groups for p in g["params"]}


TINY = ["--depth", "3", "--width", "32", "--head-dim", "16", "--vocab-size", "300", "--seq-len", "32",
        "--batch-size", "4", "--eval-every", "100", "--eval-batches", "1", "--no-progress", "--device", "cpu"]
TEXT = "\n\n".join(f"line {i}: the quick brown fox {i % 7} jumps over {i % 13} lazy dogs." * 3 for i in range(400))


def test_train_mhc_with_hcn_regulariser_learns_and_generates(tmp_path, capsys):
    (tmp_path / "c.txt").write_text(TEXT)
    out = tmp_path / "run"
    common = ["--data", str(tmp_path / "c.txt"), "--cache-dir", str(tmp_path / "cache"), *TINY]
    assert main(["train", "--out", str(tmp_path / "bad"), *common, "--steps", "1", "--reg", "hcn"]) == 2
    assert "--reg hcn needs an mHC model" in capsys.readouterr().err
    assert main(["train", "--out", str(out), *common, "--hc-streams", "2", "--reg", "hcn", "--reg-n", "2",
                 "--steps", "6", "--log-every", "1", "--warmup-steps", "2"]) == 0
    logs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in logs if "loss" in r]
    assert losses[-1] < losses[0] - 1.0, losses
    assert all(r["reg"] > 0 for r in logs if "reg" in r)
    model, tok = load(out)
    assert model.config.hc_streams == 2 and model.config.hc_dynamic and not model.config.x0_residual
    assert json.loads(Path(out / "config.json").read_text())["hc_streams"] == 2
    g = tmp_path / "g.json"
    assert main(["generate", str(out), "--prompt", "line 3:", "--max-new-tokens", "6", "--mode", "speculative",
                 "--plan", "2xF1-h0-K1-hcn", "--block", "2", "--json", str(g)]) == 0
    assert json.loads(g.read_text())["matches_sequential"]
    assert main(["bench", "--depth", "2", "--width", "32", "--head-dim", "16", "--vocab-size", "97", "--warmup", "1",
                 "--runs", "2", "--hc-streams", "2", "--hc-static", "--plans", "2xF1-h0-K1-hcn,1xF2-h0-K1"]) == 0
    assert "2xF1-h0-K1-hcn" in capsys.readouterr().out


# ------------------------------------------ static H once per forward (docs/records/2026-11-26-gpu-h100.md)
def test_static_mhc_forward_runs_one_sinkhorn_and_equals_the_per_sublayer_loop():
    """Static H depend on parameters only: the forward computes every sublayer's (H_res, H_pre, H_post) in ONE
    batched Sinkhorn (its op count no longer grows with depth: it was ~90 tiny ops per sublayer, 2L per forward),
    and the logits equal a loop over the layers in which each sublayer's HyperConn computes its own H."""
    from conftest import count_aten

    def divs(L):
        model = mhc_model(seed=L, n=3, dynamic=False, n_layer=L)
        return count_aten(lambda: model(tokens(model)))["div"]

    assert divs(2) == divs(5)

    model = mhc_model(seed=4, n=3, dynamic=False, n_layer=5)
    idx = tokens(model)
    with torch.no_grad():
        ctx = model.embed(idx)
        h = ctx.x0
        for l, block in enumerate(model.blocks):  # the reference: per-sublayer H from each block's HyperConn
            ve = ctx.ve[model.ve_slot[l]] if model.ve_slot[l] >= 0 else None
            h = hc_sublayer(block.hc_attn, h, lambda xn: block.attn(xn, ve, ctx.cos, ctx.sin))
            h = hc_sublayer(block.hc_mlp, h, block.mlp)
        torch.testing.assert_close(model(idx), model.head(h), rtol=1e-12, atol=1e-12)

"""Sliding windows that cost only the window: the banded kernel and the fused stacks' grouping by window compute the
same function as the masked reference (fp64, against a naive softmax loop and the masked path), and the scores they
skip show in the FLOP count on `meta`."""

from __future__ import annotations

import pytest
import torch
from conftest import examples, make_model, tokens
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from snlp import bind, fused_forward, parallel_forward
from snlp.method.fusion import chunk_weights
from snlp.method.jacobian import select_chunks
from snlp.model import ops


def naive_window_attention(q, k, v, w):
    """Softmax over the keys j with 0 <= i - j <= w, one query row at a time (GQA by repeating k/v)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    T = q.shape[2]
    out = torch.empty_like(q)
    for i in range(T):
        lo = max(0, i - w) if w >= 0 else 0
        s = q[:, :, i:i + 1] @ k[:, :, lo:i + 1].transpose(-1, -2) / q.shape[-1] ** 0.5
        out[:, :, i:i + 1] = torch.softmax(s, -1) @ v[:, :, lo:i + 1]
    return out


@settings(max_examples=examples(40), deadline=None)
@given(T=st.integers(2, 90), w=st.integers(0, 40), N=st.integers(1, 3), hkv=st.sampled_from([1, 2]),
       rep=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 16))
def test_banded_attention_is_the_naive_window_loop(T, w, N, hkv, rep, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(N, hkv * rep, T, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(N, hkv, T, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(ops.banded_attention(q, k, v, w, {}), naive_window_attention(q, k, v, w),
                               rtol=1e-12, atol=1e-12)


def test_set_window_kernel_refuses_unknown_kinds(kernel):
    with pytest.raises(ValueError, match="auto, banded, masked, flex"):
        kernel("flash")


@pytest.mark.parametrize("pattern", ["S", "SSSL", "SL"])
@pytest.mark.parametrize("plan", [None, "6xF1-h0-K2", "3xF2-h0-K3", "2xF3-h0-K1", "1xF6-h0-K1", "6xF1-fwd-K6"])
def test_windowed_forward_and_plans_equal_the_masked_reference(kernel, pattern, plan):
    """Sequential forward and plans (M = 1 and fused, mixed S/L stacks) under the banded kernel and the grouped
    stacks equal the masked reference (every branch through one T x T mask), fp64."""
    model = make_model(seed=11, n_layer=6, window_pattern=pattern, short_window=5, sequence_len=64)
    idx = tokens(model, T=48)
    run = (lambda: model(idx)) if plan is None else (lambda: bind(model, plan)(idx))
    with torch.no_grad():
        kernel("masked")
        ref = run()
        if plan is not None:  # the pre-grouping path: one masked SDPA over every branch
            r = bind(model, plan)
            for w in ([r.weights] if not isinstance(r.weights, list) else r.weights):
                object.__setattr__(w, "window_values", None)
            ref_all_masked = r(idx)
            torch.testing.assert_close(ref, ref_all_masked, rtol=1e-12, atol=1e-12)
        for k in ("banded", "auto"):
            kernel(k)
            torch.testing.assert_close(run(), ref, rtol=1e-10, atol=1e-10)


def test_grouped_stacks_keep_exactness_laws(kernel):
    """K >= C of an M = 1 plan equals the sequential model; a fused plan at K >= C equals its fused model, with the
    stacks grouped by window and banded short windows."""
    kernel("banded")
    model = make_model(seed=5, n_layer=8, window_pattern="SSSL", short_window=4, sequence_len=64)
    idx = tokens(model, T=40)
    with torch.no_grad():
        torch.testing.assert_close(parallel_forward(model, idx, "8xF1-h0-K8"), model(idx), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(parallel_forward(model, idx, "4xF2-h0-K4"), fused_forward(model, idx, "4xF2-h0-K4"),
                                   rtol=1e-9, atol=1e-9)


def test_select_chunks_rebuilds_the_window_groups():
    model = make_model(seed=2, n_layer=8, window_pattern="SSSL", short_window=4)
    w = chunk_weights(model, 0, 4, 2)
    part = select_chunks(w, [1, 3])  # layers 2, 3, 6, 7: S L S L
    assert part.window_values == (4, -1, 4, -1)
    assert part.windows.shape == (2, 2, 1)
    assert [g[0] for g in part.window_groups[:-1]] == [4, -1]
    assert select_chunks(w, [0]).window_values == (4, 4)


def _flops(model, idx, plan=None) -> int:
    with FlopCounterMode(display=False) as fc:
        if plan is None:
            model(idx)
        else:
            bind(model, plan, check_finite=False)(idx)
    return fc.get_total_flops()


@pytest.mark.parametrize("plan", [None, "8xF1-h0-K1", "4xF2-h0-K1", "6xF1-h0-K2"])
def test_windowed_layers_no_longer_compute_masked_out_scores(kernel, plan):
    """On `meta` (shapes only; SDPA runs its math decomposition, so every score it computes is counted) at
    T = 4096 with a 256-token window: the masked reference computes as many FLOPs as full attention, while the
    banded kernel saves exactly the scores outside each block's w + b keys, in every windowed layer evaluation of
    the sequential forward and of the fused stacks (the last layer is always full)."""
    from snlp import GPT, GPTConfig
    from snlp.method.plan import Plan

    L, T, w, H, hd = 8, 4096, 256, 2, 64

    def build(pattern):
        cfg = GPTConfig(vocab_size=256, n_layer=L, n_head=H, n_kv_head=H, n_embd=H * hd, sequence_len=T,
                        window_pattern=pattern, short_window=w)
        with torch.device("meta"):
            return GPT(cfg).eval()

    idx = torch.zeros(1, T, dtype=torch.long, device="meta")
    with torch.no_grad():
        full = _flops(build("L"), idx, plan)
        kernel("masked")
        masked = _flops(build("S"), idx, plan)
        kernel("banded")
        banded = _flops(build("S"), idx, plan)
    # evaluations of the L - 1 windowed layers: prefix layers once, suffix layers K times (h0 init)
    p = None if plan is None else Plan.parse(plan)
    S = L if p is None else L - p.n_suffix
    evals = min(S, L - 1) + (0 if p is None else (L - 1 - S) * p.iters)
    saved_per_eval = 4 * T * hd * H * (T - (w + ops.band_block(w)))  # QK^T and PV over the skipped keys
    assert masked == full
    assert full - banded == evals * saved_per_eval

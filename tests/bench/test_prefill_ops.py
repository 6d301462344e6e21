"""scripts/prefill_ops.py --bound: the FLOPs, weight bytes and attention pairs it counts against a hand count
(2 x tokens x matrix parameters, 4 x head_dim per (query, key) pair), a brute-force visibility grid and the block
lists snlp hands FlexAttention. Tiny, meta device."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from snlp.bench.suite import PAPER_SHAPES
from snlp.model.ops import FLEX_BLOCK, flex_block_mask

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import prefill_ops  # noqa: E402

T, WINDOW, VOCAB = 512, 64, 256


@pytest.fixture(scope="module")
def rows():
    """The sequential forward and 12xF2-h0-K1 / -K2 of the 0.5B-nox0ve shape at smoke size (depth 26, width 64,
    2 heads of 32), SSSL with a 64-token short window, T = 512 (4 tiles of 128), bf16."""
    shape = next(s for s in PAPER_SHAPES if s.key == "0.5B-nox0ve").quick()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "autocast", prefill_ops._Autocast)
        mp.setattr(prefill_ops, "build", lambda sh, tokens, dtype: _build(sh, tokens, dtype))
        out = prefill_ops.count_forwards(shape, T, 1, torch.bfloat16, ["12xF2-h0-K1", "12xF2-h0-K2"])
    return shape, {r["forward"]: r for r in out}


def _build(shape, tokens, dtype):
    from snlp.model.gpt import GPT
    with torch.device("meta"):
        model = GPT(shape.config(VOCAB, "SSSL", WINDOW, tokens))
    return model.to(dtype=dtype).eval()


def _pairs_brute(T: int, w: int, b: int) -> dict:
    p, j = np.arange(T)[:, None], np.arange(T)[None, :]
    vis = (j <= p) & ((w < 0) | (p - j <= w))
    n = -(-T // b)
    causal = flex = 0
    for i in range(n):
        for k in range(n):
            blk = vis[i * b:(i + 1) * b, k * b:(k + 1) * b]
            causal += blk.size if k <= i else 0
            flex += blk.size if blk.any() else 0
    return dict(all=T * T, causal=causal, flex=flex, exact=int(vis.sum()))


@pytest.mark.parametrize("T,w", [(256, -1), (256, 0), (256, 64), (512, 127), (512, 128), (1024, 300),
                                 (2048, 512), (2048, 4096), (384, 200)])
def test_attention_pair_models_equal_a_brute_force_grid_and_the_flex_block_lists(T, w):
    """Each kernel model's pair count equals a count over the (query, key) visibility grid; the flex count equals
    the key blocks snlp's own FlexAttention block mask lists (partial + full), times the block's pairs."""
    got = prefill_ops._attention_pairs(T, w)
    assert got == _pairs_brute(T, w, 128)
    bm = flex_block_mask(w, 1, T, "cpu", grad=False)
    listed = int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())
    assert got["flex"] == listed * FLEX_BLOCK ** 2


def test_sequential_flops_and_weight_bytes_equal_the_hand_count(rows):
    """GEMMs: 2 T x (12 D^2 per layer: q, k, v, o and a 4x MLP; D V for the head). Attention as the timed kernels
    compute it: every T x T score in a short-window (masked) layer, the causal tiles in a full one; all pairs
    together equal torch's flop counter. Weights read: every matrix once, in bf16."""
    shape, r = rows
    D, L = shape.width, shape.depth
    n_long = sum(1 for i in range(L) if "SSSL"[i % 4] == "L" or i == L - 1)  # nanochat: the last layer is full
    seq = r["sequential"]
    gemm = sum(d["gemm_gflop"] for d in seq["parts"].values()) * 1e9
    assert gemm == pytest.approx(2 * T * (L * 12 * D * D + D * VOCAB), rel=1e-12)
    attn = sum(d["attn_gflop_measured"] for d in seq["parts"].values()) * 1e9
    causal_tiles = 10 * 128 * 128  # T = 512: the 4 x 5 / 2 tiles on or below the diagonal
    assert attn == pytest.approx(4 * D * ((L - n_long) * T * T + n_long * causal_tiles), rel=1e-12)
    assert gemm + 4 * D * L * T * T == pytest.approx(seq["gflop"] * 1e9, rel=1e-12)
    weight = sum(d["weight_mb"] for d in seq["parts"].values()) * 2**20
    assert weight == 2 * (L * 12 * D * D + D * VOCAB)


def test_one_more_iteration_reads_the_suffix_weights_once_and_flex_skips_blocks(rows):
    """K1 -> K2 adds one evaluation of the 24 suffix layers: their GEMM FLOPs and bf16 matrices once. Its
    attention: masked (as timed) every score of 24 branches, paper-style every causal tile, flex the window's
    blocks of the short branches and the causal tiles of the full ones, exact the visible pairs."""
    shape, r = rows
    D = shape.width
    k1, k2 = (r[f"12xF2-h0-K{k}"]["parts"]["stack"] for k in (1, 2))
    assert k2["gemm_gflop"] - k1["gemm_gflop"] == pytest.approx(2 * T * 24 * 12 * D * D / 1e9, rel=1e-12)
    assert (k2["weight_mb"] - k1["weight_mb"]) * 2**20 == 2 * 24 * 12 * D * D
    windows = [WINDOW if "SSSL"[i % 4] == "S" else -1 for i in range(shape.depth - 24, shape.depth)]
    windows[-1] = -1
    per = lambda key: sum(4 * D * prefill_ops._attention_pairs(T, w)[key] for w in windows) / 1e9  # noqa: E731
    d = {sc: k2[f"attn_gflop_{sc}"] - k1[f"attn_gflop_{sc}"] for sc in ("measured", "flex", "paper", "exact")}
    assert d["measured"] == pytest.approx(24 * 4 * D * T * T / 1e9, rel=1e-12)
    assert d["paper"] == pytest.approx(24 * 4 * D * prefill_ops._attention_pairs(T, -1)["causal"] / 1e9, rel=1e-12)
    assert d["flex"] == pytest.approx(per("flex"), rel=1e-12)
    assert d["exact"] == pytest.approx(per("exact"), rel=1e-12)
    assert d["exact"] < d["flex"] < d["paper"] < d["measured"]


@pytest.mark.parametrize("argv", [["--times", "sequential=1"], ["--bound", "--times", "sequential=x"],
                                  ["--bound", "--times", "sequential=1", "--sweep", "12x"],
                                  ["--sweep", "256:1"], ["--batch", "0"]])
def test_bad_options_are_refused_before_any_work(argv, capsys):
    with pytest.raises(SystemExit) as e:
        prefill_ops.main(["--shapes", "0.5B-nox0ve"] + argv)
    assert e.value.code == 2
    assert "one eager prefill" not in capsys.readouterr().out


def test_sweep_refuses_a_calibration_its_latency_model_cannot_fit(rows):
    """A measured time at or under the latency the model charges alone would give a negative FLOP rate and
    nonsense predictions: refused with the reason, for the sequential forward and for a plan."""
    shape, by = rows
    calib = list(by.values())
    with pytest.raises(ValueError, match="sequential .* latency alone"):
        prefill_ops.sweep_report(calib, [], shape.depth, {"sequential": 1e-3}, 30.0, 30.0, 989.0, 4.8)
    with pytest.raises(ValueError, match="12xF2-h0-K1 .* latency and prefix alone"):
        prefill_ops.sweep_report(calib, [], shape.depth, {"sequential": 50.0, "12xF2-h0-K1": 1e-3}, 30.0, 30.0,
                                 989.0, 4.8)
    assert prefill_ops.sweep_report(calib, [], shape.depth, {"sequential": 50.0, "12xF2-h0-K1": 40.0}, 1.0, 1.0,
                                    989.0, 4.8)


def test_bound_table_gives_the_papers_rows_one_attention_figure(rows):
    """The paper's calls carry no window the counter reads, so its row shows what its kernels compute and no flex or
    visible-pairs figure (which would repeat the kernel count under another name)."""
    import copy

    _, by = rows
    paper = copy.deepcopy(by["sequential"])
    paper["side"] = "paper"
    line = next(x for x in prefill_ops.bound_report([paper], 989.0, 4.8, {}, 2.0) if "paper: sequential" in x)
    assert "(its kernels) / - / - / -" in line


def test_meta_items_answer_a_float_on_meta_only():
    """The paper's CxF1 plans read their lambdas with .item() while they build: on meta that raises, so the count
    answers a float there and nowhere else (a real tensor keeps its value; outside the mode meta still raises)."""
    m = torch.ones(3, device="meta")
    with pytest.raises(Exception):
        m[0].item()
    with prefill_ops.MetaItems():
        assert m[0].item() == 1.0
        assert torch.tensor([0.25])[0].item() == 0.25


def test_paper_cxf1_plans_count_on_meta_at_the_05b_shape():
    """The paper's CxF1 evaluator (its lambdas averaged into floats) is counted beside snlp's on a 0.5B-shaped model
    (x0 and resid lambdas on) at smoke size, with the same GEMM FLOPs at K = 1 as its sequential forward."""
    from test_vs_paper import PAPER

    if PAPER is None:
        pytest.skip("no checkout of the paper's code beside the repository (../shared/anchors/nanochat-snlp)")
    from snlp.bench.paper_peer import load_paper_code

    shape = next(s for s in PAPER_SHAPES if s.key == "0.5B").quick()
    code = load_paper_code(PAPER, torch.float32)  # the dtype test_vs_paper loads it with: one per process
    plan = f"{shape.depth // 2}xF1-h0-K1"
    rows = {r["forward"]: r for r in prefill_ops.count_paper(code, shape, 64, 1, [plan])}
    assert set(rows) == {"sequential", plan}
    def gemm(r):
        return sum(d["gemm_gflop"] for d in r["parts"].values())
    assert gemm(rows[plan]) == pytest.approx(gemm(rows["sequential"]), rel=1e-6) and gemm(rows[plan]) > 0

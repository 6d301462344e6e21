"""snlp.bench.breakdown: the forward taken apart (counts and consistency; timings are never asserted)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model, mhc_model

from snlp.bench.breakdown import count_ops, forward_breakdown

pytestmark = pytest.mark.usefixtures("one_thread")


def test_count_ops_counts_aten_ops_and_host_syncs():
    x = torch.randn(4, 8)
    ops = count_ops(lambda: (x + 1).relu().sum().item(), calls=3)
    assert ops["aten::add"] == 1 and ops["aten::relu"] == 1 and ops["aten::sum"] == 1
    assert ops["aten::_local_scalar_dense"] == 1  # .item(): one host read per call
    with pytest.raises(ValueError, match="calls must be an integer >= 1"):
        count_ops(lambda: None, calls=0)


def test_forward_breakdown_is_consistent_with_the_plan_and_the_model():
    model = make_model(n_layer=8, dtype=torch.float32)
    b = forward_breakdown(model, "3xF2-h0-K1", seq_len=2, runs=2, warmup=1)
    assert (b.prefix_layers, b.chunks, b.fuse, b.evals) == (2, 3, 2, 1)
    cfg = model.config
    D, hd = cfg.n_embd, cfg.head_dim
    per_layer = D * (cfg.n_head + 2 * cfg.n_kv_head) * hd + cfg.n_head * hd * D + 2 * D * cfg.hidden_dim
    ve = sum(b_.attn.ve_gate.weight.numel() for b_ in model.blocks[2:] if b_.attn.ve_gate is not None)
    gates = 0 if ve == 0 else 6 * model.blocks[-1].attn.ve_gate.weight.numel()  # a zero gate for every branch
    assert b.suffix_weight_bytes == 4 * (6 * per_layer + gates)  # 6 fused layers, fp32
    assert b.snlp_ops < b.seq_ops  # 2 + 1 layer-equivalents of ops vs 8 layers
    assert b.seq_syncs == b.snlp_syncs  # the token-range check, the same on both sides; the solve adds none
    d = b.to_dict()
    for k in ("measured_speedup", "structural_ideal", "suffix_ideal", "suffix_layers", "weight_gb_per_s",
              "fraction_of_structural_ideal"):
        assert math.isfinite(d[k]) and d[k] > 0, k
    assert b.structural_ideal == pytest.approx(b.seq_ms / (b.fixed_ms + 3 * b.layer_ms))


def test_forward_breakdown_rejects_bad_arguments():
    model = make_model(n_layer=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="runs must be an integer >= 1"):
        forward_breakdown(model, "2xF1-h0-K1", runs=0)
    with pytest.raises(ValueError, match="warmup must be an integer >= 0"):
        forward_breakdown(model, "2xF1-h0-K1", warmup=-1)
    with pytest.raises(ValueError, match="plain residual models"):
        forward_breakdown(mhc_model(n_layer=4), "2xF1-h0-K1", runs=1)

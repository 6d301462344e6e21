"""scripts/decode_ops.py (the kernel chain of a decode step, and the chain-proportional PREDICTED SSD speedup) and
scripts/carry_parts.sh (files over a device call's carry, in parts): counts against the layer structure, the
prediction against the paper's formula and a hand count, the parts round trip byte for byte. Tiny, meta device."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snlp.decode.speculative import ideal_ssd_speedup
from snlp.decode.steps import sequential_fn, snlp_fn
from snlp.method.plan import Plan
from snlp.method.solver import bind
from snlp.model.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import decode_ops  # noqa: E402


def tiny() -> GPT:
    cfg = GPTConfig(vocab_size=64, n_layer=6, n_head=2, n_kv_head=1, n_embd=32, sequence_len=64, mlp_act="swiglu",
                    ffn_dim=48, value_embeds=False, x0_residual=False, softcap=0.0, qk_norm="none", norm_weights=True,
                    tie_embeddings=True, embed_norm=False)
    with torch.device("meta"):
        return GPT(cfg).eval()


def test_the_chain_has_one_attention_per_layer_on_the_critical_path(monkeypatch):
    """The model's step attends once per layer; a drafter step once per prefix layer and once per iteration (its
    chunks are one batched call): S + K, which is what shortens its chain."""
    monkeypatch.setattr(torch, "autocast", decode_ops._Autocast)
    model = tiny()
    sdpa = lambda r: r["sdpa_causal"] + r["sdpa_masked"] + r["sdpa_plain"]
    seq = decode_ops.count_step(model, sequential_fn(model), 1, 8, 64)
    assert sdpa(seq) == 6
    for spec, chain in (("4xF1-h0-K1", 2 + 1), ("2xF2-h0-K2", 2 + 2)):
        r = decode_ops.count_step(model, snlp_fn(bind(model, Plan.parse(spec, 6), check_finite=False)), 1, 8, 64)
        assert sdpa(r) == chain
        assert r["heavy"] < seq["heavy"] and r["kernels"] < seq["kernels"]


def test_the_prediction_is_the_paper_formula_when_the_verifier_costs_a_step():
    for a in (0.0, 0.3, 0.7, 1.0):
        for b in (1, 4):
            r = decode_ops.predict(300, 100, 300, b, a)
            assert r["speedup"] == pytest.approx(ideal_ssd_speedup(a, b, 3.0), rel=1e-12)
    # hand count: a = 0.5, B = 2, chains 10 / 5 / 12, a fixed cost of 0.1 x 10 per wait: per step on both sides
    r = decode_ops.predict(10, 5, 12, 2, 0.5, overhead=0.1, reads="step")
    assert r["tokens_per_round"] == pytest.approx(1.75)
    assert r["speedup"] == pytest.approx(1.75 * 11 / (2 * 6 + 13))
    # ... and per round, and per 8 sequential tokens (today's one-prompt loops)
    r = decode_ops.predict(10, 5, 12, 2, 0.5, overhead=0.1)
    assert r["speedup"] == pytest.approx(1.75 * (10 + 1 / 8) / (2 * 5 + 12 + 1))


def test_weight_bytes_count_each_layer_once_per_evaluation():
    cfg = tiny().config
    layer = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 48  # q, o; GQA k, v (1 KV head of 16); SwiGLU gate, up, down
    head = 64 * 32
    assert decode_ops.weight_mb(cfg, None, "bfloat16") == pytest.approx((6 * layer + head) * 2 / 1e6)
    # 2xF2-h0-K2: prefix of 2 layers once, the 4 suffix layers once per iteration
    assert decode_ops.weight_mb(cfg, Plan.parse("2xF2-h0-K2", 6), "float32") == \
        pytest.approx((2 * layer + 2 * 4 * layer + head) * 4 / 1e6)


@pytest.mark.skipif(shutil.which("split") is None or shutil.which("sha256sum") is None, reason="coreutils")
def test_carry_parts_round_trip_and_a_missing_part_is_refused(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "carry_parts.sh", repo / "scripts")
    data = torch.randint(0, 256, (3 * 2**20 + 17,), dtype=torch.uint8).numpy().tobytes()
    (repo / "big.bin").write_bytes(data)
    (repo / "d").mkdir()
    (repo / "d" / "x.json").write_text("{}")
    run = lambda *a, cwd=repo: subprocess.run(["bash", "scripts/carry_parts.sh", *a], cwd=cwd, capture_output=True,
                                              text=True)
    out = run("split", "--mib", "1", "big.bin", "d")
    assert out.returncode == 0, out.stderr
    parts = sorted((repo / "runs" / "carry").glob("part-*"))
    assert len(parts) == 4  # 3 MiB + 17 bytes and the tar headers, in 1 MiB parts
    assert all(p.stat().st_size <= 2**20 for p in parts)
    there = tmp_path / "device"  # the device's copy: the script and the parts, nothing else
    (there / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "carry_parts.sh", there / "scripts")
    shutil.copytree(repo / "runs", there / "runs")
    assert run("join", cwd=there).returncode == 0
    assert (there / "big.bin").read_bytes() == data and (there / "d" / "x.json").read_text() == "{}"
    parts[1].unlink()
    shutil.rmtree(there / "runs")
    shutil.copytree(repo / "runs", there / "runs")
    out = run("join", cwd=there)
    assert out.returncode != 0 and "parts here" in out.stderr

"""scripts/profile_prefill.py's split of a plan's kernels into what one more iteration costs and what the plan pays
once, t(K) = once + K * iter per kernel name, fitted on two profiles of one plan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import profile_prefill  # noqa: E402


def test_split_recovers_once_and_per_iteration_costs_per_kernel():
    # a: a mask built once (3 ms) plus 1 ms per iteration; b: 2 ms per iteration only; c: once only (a weight copy)
    def at(K):
        return {"mask_kernel": (1 + K, 3.0 + 1.0 * K), "gemm": (5 * K, 2.0 * K), "Memcpy DtoD": (1, 0.7)}
    rows = {r["name"]: r for r in profile_prefill.split_once(at(1), at(3), 1, 3)}
    assert rows["mask_kernel"]["once_ms"] == pytest.approx(3.0) and rows["mask_kernel"]["iter_ms"] == pytest.approx(1.0)
    assert rows["gemm"]["once_ms"] == pytest.approx(0.0) and rows["gemm"]["iter_ms"] == pytest.approx(2.0)
    assert rows["Memcpy DtoD"]["once_ms"] == pytest.approx(0.7) and rows["Memcpy DtoD"]["iter_ms"] == pytest.approx(0)
    ordered = [r["name"] for r in profile_prefill.split_once(at(1), at(3), 1, 3)]
    assert ordered[0] == "mask_kernel"  # largest paid-once first


def test_generated_kernel_names_pool_across_graphs_and_only_those():
    # two compiles number their generated kernels differently; the split must compare like with like
    a = {"triton_poi_fused_add_3": (1, 1.0), "triton_poi_fused_add_9": (1, 1.0), "aten::mm_2x": (1, 5.0)}
    b = {"triton_poi_fused_add_4": (2, 3.0), "aten::mm_2x": (2, 9.0)}
    rows = {r["name"]: r for r in profile_prefill.split_once(a, b, 1, 2)}
    assert rows["triton_poi_fused_add"]["ms_a"] == pytest.approx(2.0)
    assert rows["triton_poi_fused_add"]["iter_ms"] == pytest.approx(1.0)
    assert "aten::mm_2x" in rows  # a non-generated name keeps its digits


def test_plan2_must_be_the_same_plan_at_a_larger_k():
    for plan2 in ("12xF2-h0-K1", "6xF2-h0-K2"):
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_prefill.py"), "--paper", "/nonexistent",
                              "--shape", "0.5B-nox0ve", "--plan", "12xF2-h0-K1", "--plan2", plan2],
                             capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        assert out.returncode == 2 and "--plan2 must be --plan at a larger K" in out.stderr, out.stderr[-500:]

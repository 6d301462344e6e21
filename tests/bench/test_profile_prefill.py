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
    assert rows["triton_poi_fused_add"]["kernels"] == 2 and rows["aten::mm_2x"]["kernels"] == 1
    assert "(2 kernels)" in profile_prefill.split_table(list(rows.values()), "K=1", "K=2")


def test_k0_separates_what_every_k_pays_from_what_the_stack_pays_once():
    # prefix GEMMs (4 ms at every K, K = 0 included), a stack init paid once when K >= 1 (0.9 ms), 2 ms per iteration
    def at(K):
        d = {"gemm_prefix": (8, 4.0)}
        if K:
            d["stack_init"] = (1, 0.9)
            d["stack_bmm"] = (5 * K, 2.0 * K)
        return d
    rows = {r["name"]: r for r in profile_prefill.split_once(at(1), at(2), 1, 2, zero=at(0))}
    assert rows["gemm_prefix"]["once_ms"] == pytest.approx(4.0) and rows["gemm_prefix"]["stack_once_ms"] == 0
    assert rows["stack_init"]["stack_once_ms"] == pytest.approx(0.9)
    assert rows["stack_bmm"]["stack_once_ms"] == pytest.approx(0.0) and rows["stack_bmm"]["iter_ms"] == 2.0
    assert profile_prefill.split_once(at(1), at(2), 1, 2, zero=at(0))[0]["name"] == "stack_init"
    assert "stack once ms" in profile_prefill.split_table(list(rows.values()), "K=1", "K=2")


@pytest.mark.parametrize("argv, why", [
    (["--plan", "12xF2-h0-K1", "--plan2", "12xF2-h0-K1"], "--plan2 must be --plan at a larger K"),
    (["--plan", "12xF2-h0-K1", "--plan2", "6xF2-h0-K2"], "--plan2 must be --plan at a larger K"),
    (["--plan", "12xF2-h0-K1-tol:0.001", "--plan2", "12xF2-h0-K2-tol:0.001"], "tol stop cannot be split"),
    (["--compiled", "graphs", "--device", "cpu"], "--compiled graphs needs CUDA"),
    (["--plan", "12xF2-h0-K1-tol1e-3"], "malformed plan"),
])
def test_options_it_cannot_honour_are_refused_before_any_work(argv, why):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_prefill.py"), "--paper", "/nonexistent",
                          "--shape", "0.5B-nox0ve", *argv],
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and why in out.stderr, out.stderr[-500:]


def test_runtime_launches_tell_a_captured_forward_from_one_launched_kernel_by_kernel():
    captured = [("cudaGraphLaunch", 3), ("cudaMemcpyAsync", 3), ("aten::copy_", 3)]
    uncaptured = [("cudaLaunchKernel", 300), ("cuLaunchKernel", 30), ("cudaLaunchKernelExC", 3), ("aten::mm", 90)]
    assert profile_prefill.runtime_launches(captured, 3) == {"graph_launches": 1, "kernel_launches": 0}
    assert profile_prefill.runtime_launches(uncaptured, 3) == {"graph_launches": 0, "kernel_launches": 111}


def test_a_cpu_profile_reports_no_device_figures_rather_than_zeros():
    """On a CPU there are no device kernels and no CUDA graphs: the summary said 0 kernels, 0.00 ms device, 0 graph
    replays and 0 single launches per call, figures that read as measured (a forward with no replay: not captured);
    they are None there ('-' in the campaign table), as the host gap already was. On CUDA the gap is wall minus
    the kernels' device time."""
    v = {"kernels": 0.0, "device_ms": 0.0, "wall_ms": 4.0, "graph_launches": 0.0, "kernel_launches": 0.0}
    assert profile_prefill.summary_row(v, cuda=False) == {
        "kernels": None, "device_ms": None, "wall_ms": 4.0, "host_gap_ms": None, "graph_launches": None,
        "kernel_launches": None}
    assert "0 graph replays" not in profile_prefill.headline("snlp x", v, cuda=False)
    g = {"kernels": 300.0, "device_ms": 2.5, "wall_ms": 3.5, "graph_launches": 1.0, "kernel_launches": 0.0}
    assert profile_prefill.summary_row(g, cuda=True) == {**g, "host_gap_ms": pytest.approx(1.0)}
    assert "1 graph replays and 0 single launches" in profile_prefill.headline("snlp x", g, cuda=True)


def test_wall_ms_is_the_median_of_an_even_number_of_runs(monkeypatch):
    """wall_ms says median: of 20 runs, numpy's (the mean of the middle two), not torch's lower middle value."""
    import numpy as np

    import snlp.runtime.timing as timing
    ts = [float(x) for x in range(1, 21)]
    monkeypatch.setattr(timing, "time_round_robin", lambda fns, warmup, runs, device: {"f": ts[:runs]})
    assert profile_prefill.wall_ms(lambda: None, "cpu", runs=20) == pytest.approx(np.median(ts)) == 10.5

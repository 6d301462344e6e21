"""snlp bench --suite train --quick end to end (library and CLI): every variant's row, the JSON and markdown, and
the ratios computed from the rows (never the timings' values)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from snlp.apps.cli import main
from snlp.bench.train import TrainBenchConfig, run_train_bench

pytestmark = pytest.mark.usefixtures("one_thread")


def test_quick_train_bench_runs_every_variant(tmp_path, capsys):
    assert main(["bench", "--suite", "train", "--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "train.json").read_text())
    rows = data["records"]
    assert [(r["treatment"], r["reg"]) for r in rows] == [("eager", "none"), ("compiled", "none"),
                                                          ("eager", "idn"), ("compiled", "idn")]
    for r in rows:
        assert r["error"] is None and r["n_layer"] == 2 and r["n_embd"] == 64 and r["tokens_per_step"] == 2 * 32
        assert r["reg_n"] == ([1] if r["reg"] == "idn" else [])  # --reg-n 24 clipped to depth - 1
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / (r["step_ms"] / 1e3))
        assert r["tflops"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / 1e12)
        assert r["mfu"] is None and math.isfinite(r["loss_first"]) and math.isfinite(r["loss_last"])
        assert (r["compile_s"] is not None) is (r["treatment"] == "compiled")
    by = {(r["treatment"], r["reg"]): r for r in rows}
    assert by["eager", "idn"]["flops_per_token"] > by["eager", "none"]["flops_per_token"]
    assert by["compiled", "none"]["flops_per_token"] == by["eager", "none"]["flops_per_token"]
    ratios = data["ratios"]
    assert ratios["compiled_speedup_none"] == pytest.approx(by["compiled", "none"]["tokens_per_s"]
                                                            / by["eager", "none"]["tokens_per_s"])
    assert ratios["reg_overhead_idn_compiled"] == pytest.approx(by["compiled", "idn"]["step_ms"]
                                                                / by["compiled", "none"]["step_ms"])
    assert data["meta"]["peak_tflops"] is None and data["meta"]["device_type"] == "cpu"
    md = (tmp_path / "train.md").read_text()
    assert "MFU n/a" in md and md in printed


def test_train_bench_refuses_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="unknown shape"):
        run_train_bench(TrainBenchConfig(shape="7B", quick=True))
    with pytest.raises(ValueError, match="diag does not compile"):
        run_train_bench(TrainBenchConfig(quick=True, regs=("diag",)))
    assert main(["bench", "--suite", "train", "--quick", "--shapes", "0.5B,3B", "--out", str(tmp_path)]) == 2
    assert not Path(tmp_path, "train.json").exists()

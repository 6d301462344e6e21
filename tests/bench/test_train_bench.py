"""snlp bench --suite train --quick end to end (library and CLI): every variant's row, the JSON and markdown, and
the ratios computed from the rows (never the timings' values)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from snlp.apps.cli import main
from snlp.bench.train import TrainBenchConfig, TrainBenchResult, TrainBenchRow, run_train_bench

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
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
    for name, sp in data["ratio_spreads"].items():  # each ratio with the range its rows' spreads allow
        assert sp["lo"] <= sp["ratio"] <= sp["hi"] and sp["ratio"] == pytest.approx(ratios[name])
        assert sp["tie"] is True  # 3 timed steps a row: too few for separated spreads to mean a difference
    for r in rows:
        assert len(r["step_ms_timed"]) == r["steps"] == 3
        t = r["step_ms_timed"]
        assert min(t) <= r["step_ms_p10"] <= r["step_ms"] <= r["step_ms_p90"] <= max(t)
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


def test_an_hcn_variant_on_a_plain_shape_is_refused_before_any_variant_runs(tmp_path, capsys):
    """--regs none,hcn on a shape without mHC ran the plain variants (minutes each at the 0.5B shape on a GPU) and wrote
    their rows, then stopped on the hcn one with snlp train's advice ("add --hc-streams N", a flag bench has not).
    Refused before any variant now, naming the mHC shape; on that shape the variant runs."""
    capsys.readouterr()
    assert main(["bench", "--suite", "train", "--quick", "--device", "cpu", "--regs", "none,hcn", "--treatments",
                 "eager", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "variant 'hcn' needs an mHC model" in err and "--shapes 0.5B-mhc" in err and "done at" not in err, err
    assert not Path(tmp_path, "train.json").exists()
    TrainBenchConfig(quick=True, device="cpu", regs=("none", "hcn"), shape="0.5B-mhc").resolved()


def test_train_bench_row_fraction_variant(tmp_path, capsys):
    """--regs idn:F: the regulariser on ceil(F x batch) rows of each step (snlp train --reg-rows F), its own row and
    ratio; its FLOPs per token are the plain step's plus the full regulariser's extra x rows / batch."""
    assert main(["bench", "--suite", "train", "--quick", "--device", "cpu", "--treatments", "eager", "--regs",
                 "none,idn,idn:0.5", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "train.json").read_text())
    by = {r["reg"]: r for r in data["records"]}
    assert list(by) == ["none", "idn", "idn:0.5"] and all(r["error"] is None for r in by.values())
    assert (by["none"]["reg_rows"], by["idn"]["reg_rows"], by["idn:0.5"]["reg_rows"]) == (None, 2, 1)
    extra = by["idn"]["flops_per_token"] - by["none"]["flops_per_token"]
    assert extra > 0 and by["idn:0.5"]["flops_per_token"] == pytest.approx(by["none"]["flops_per_token"] + extra / 2)
    assert set(data["ratios"]) == {"reg_overhead_idn_eager", "reg_overhead_idn:0.5_eager"}
    assert "idn:0.5 N=1 rows 1/2" in (tmp_path / "train.md").read_text()
    capsys.readouterr()
    for regs, msg in (("none:0.5", "needs a regulariser"), ("idn:1.5", r"must lie in \(0, 1\]"),
                      ("idn:x", "must be a number"), ("idn:1e-12", "no row")):
        with pytest.raises(ValueError, match=msg) as e:
            run_train_bench(TrainBenchConfig(quick=True, regs=("none", regs)))
        assert "--reg-rows" not in str(e.value).replace("snlp train --reg-rows", "")  # the bench has no such flag
        assert main(["bench", "--suite", "train", "--quick", "--regs", f"none,{regs}", "--out",
                     str(tmp_path / "no")]) == 2
    assert not (tmp_path / "no").exists()


def _row(treatment: str, reg: str, ms: list[float]) -> TrainBenchRow:
    """A timed row made by hand (the ratio arithmetic alone, no model)."""
    ms = sorted(ms)
    q = statistics.quantiles(ms, n=10, method="inclusive")
    return TrainBenchRow(shape="0.5B", treatment=treatment, reg=reg, reg_n=[], n_layer=1, n_embd=1, params=1,
                         batch=1, seq_len=100, tokens_per_step=100, steps=len(ms), warmup=0,
                         step_ms=statistics.median(ms), step_ms_p10=q[0], step_ms_p90=q[-1], step_ms_timed=ms,
                         tokens_per_s=100 / (statistics.median(ms) / 1e3))


def test_train_bench_ratios_inside_the_spreads_are_ties():
    """A ratio whose rows' p10-p90 spreads overlap is a tie, printed as one; separated spreads give a ratio whose
    range excludes 1. Hand-made rows: eager 200 ms +-5, compiled 100 ms +-5 (a 2x speedup, no overlap); the
    regulariser's rows overlap the plain ones (a 1.02x "overhead" inside the noise)."""
    cfg = TrainBenchConfig(device="cpu", regs=("none", "idn"), treatments=("eager", "compiled")).resolved()
    res = TrainBenchResult(config=cfg, meta={})
    res.rows = [_row("eager", "none", [195, 198, 200, 202, 205]), _row("compiled", "none", [95, 98, 100, 102, 105]),
                _row("eager", "idn", [199, 201, 204, 206, 210]), _row("compiled", "idn", [150, 151, 152, 153, 154])]
    sp = res.ratio_spreads()
    s = sp["compiled_speedup_none"]
    assert s["ratio"] == pytest.approx(2.0) and not s["tie"] and s["lo"] > 1.0
    assert s["lo"] == pytest.approx(res.rows[0].step_ms_p10 / res.rows[1].step_ms_p90)
    assert sp["reg_overhead_idn_eager"]["tie"] and sp["reg_overhead_idn_eager"]["ratio"] == pytest.approx(1.02)
    assert not sp["reg_overhead_idn_compiled"]["tie"]
    assert res.ratios()["compiled_speedup_none"] == pytest.approx(2.0)
    res.meta = {"device": "cpu", "dtype": "float32", "torch": "x", "date": "d", "peak_tflops": None}
    md = res.markdown
    assert "reg_overhead_idn_eager 1.02x (" in md and "tie, inside the spreads" in md
    assert "compiled_speedup_none 2.00x (" in md and md.count("tie, inside") == 1
    assert "200.0 (" in md  # the row's median with its p10-p90

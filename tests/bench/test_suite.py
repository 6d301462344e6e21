"""snlp bench --suite paper --quick end to end: the library function and the CLI, checking the JSON and
markdown contents (never the timings' values)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snlp.method.plan import Plan
from snlp.bench.suite import PAPER_DRAFTER_S, PAPER_PREFILL, PAPER_SHAPES, RANDOM_WEIGHTS, SuiteConfig, run_suite

ROOT = Path(__file__).resolve().parents[2]


def _check_records(records: list[dict], compiled_shapes: set[str]) -> None:
    for shape in PAPER_SHAPES:
        for treatment in ("eager", "compiled"):
            rows = [r for r in records if r["shape"] == shape.key and r["treatment"] == treatment]
            if treatment == "compiled" and shape.key not in compiled_shapes:
                assert rows == []
                continue
            prefill = [r for r in rows if r["kind"] == "prefill"]
            assert [r["plan"] for r in prefill] == ["sequential", *shape.plans]
            for r in prefill:
                assert r["compiled"] is (treatment == "compiled") and r["tokens"] == 16 and r["batch"] == 1
                for key in ("median_ms", "speedup", "structural_ideal", "of_structural", "fixed_ms", "layer_ms"):
                    assert math.isfinite(r[key]) and r[key] >= 0
                assert r["paper_speedup"] == PAPER_PREFILL.get((shape.key, r["plan"]))
                assert r["n_layer"] == max(Plan.parse(p).n_suffix for p in shape.plans) + 2  # shrunk: suffix + 2
                assert len(r["times_ms"]) == 3 and r["speedup_verdict"] == (None if r["plan"] == "sequential"
                                                                             else "tie")  # 3 rounds: never resolved
            decode = [r for r in rows if r["kind"] == "decode"]
            assert all(r["compiled"] is (treatment == "compiled") for r in decode)
            if treatment == "compiled":
                assert decode == []  # quick: compiled prefill only (compiled decode: tests/decode/test_steps.py)
            if decode:
                snlp_rows = [r for r in decode if r["decode_mode"] == "snlp"]
                assert [r["plan"] for r in snlp_rows] == list(shape.plans)
                for r in snlp_rows:
                    assert r["paper_drafter_s"] == PAPER_DRAFTER_S.get((shape.key, r["plan"]))
                    assert math.isfinite(r["ms_per_token"]) and r["new_tokens"] == 4
                seq = [r for r in decode if r["decode_mode"] == "sequential"]
                assert len(seq) == 1 and seq[0]["bandwidth_gb_s"] == pytest.approx(
                    seq[0]["model_bytes"] * seq[0]["tokens_per_s"] / 1e9)
                assert all(r["matches_sequential"] for r in decode if r["decode_mode"] == "speculative")


def test_quick_suite_library_writes_json_and_markdown(tmp_path):
    result = run_suite(SuiteConfig(quick=True, treatments=("eager",), out=str(tmp_path), command="test"))
    cfg = result.config
    assert cfg.device == "cpu" and cfg.dtype == "float32" and cfg.tokens == 16 and cfg.vocab_size == 256
    data = json.loads(Path(result.json_path).read_text())
    meta = data["meta"]
    assert meta["weights"] == RANDOM_WEIGHTS and meta["torch"] == torch.__version__ and "cuda" in meta
    assert meta["dtype"] == "float32" and meta["command"] == "test" and meta["date"] and meta["device"]
    assert data["config"]["quick"] is True
    _check_records(data["records"], compiled_shapes=set())
    md = Path(result.markdown_path).read_text()
    assert md == result.markdown and RANDOM_WEIGHTS in md and "NOT the paper's shapes" in md
    assert "| paper prefill (full shape) |" in md  # the paper's number is of its full shape, not the smoke row's
    for shape in PAPER_SHAPES:
        for plan in shape.plans:
            line = next(x for x in md.splitlines() if x.startswith(f"| {shape.key} (smoke) | `{plan}` |"))
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert cells[8] == (f"{PAPER_PREFILL[(shape.key, plan)]:.2f}x")  # the paper's number beside ours
            assert cells[6] == "-"  # compiled not run
            s = PAPER_DRAFTER_S.get((shape.key, plan))
            assert cells[11] == ("-" if s is None else f"{s:.2f}x")


def test_suite_config_rejects_bad_input_with_a_message():
    with pytest.raises(ValueError, match="unknown shape.*valid: 0.5B-nox0ve"):
        SuiteConfig(shapes=("7B",)).resolved()
    with pytest.raises(ValueError, match="treatments"):
        SuiteConfig(treatments=("jit",)).resolved()
    with pytest.raises(ValueError, match=">= 1"):
        SuiteConfig(quick=True, runs=0).resolved()


@pytest.mark.slow
def test_quick_suite_cli_end_to_end(tmp_path):
    out = tmp_path / "suite"
    res = subprocess.run([sys.executable, "-m", "snlp", "bench", "--suite", "paper", "--quick", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "suite.json").read_text())
    assert data["meta"]["command"] == f"snlp bench --suite paper --quick --out {out}"
    _check_records(data["records"], compiled_shapes={"3B"})
    md = (out / "suite.md").read_text()
    assert md in res.stdout and RANDOM_WEIGHTS in md
    line = next(x for x in md.splitlines() if x.startswith("| 3B (smoke) | `8xF1-h0-K1` |"))
    # compiled prefill speedup present for the compiled shape; 3 quick rounds never resolve one: a tie
    assert line.split("|")[7].strip().endswith("x (tie)")

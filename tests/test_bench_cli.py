from __future__ import annotations

import json
import subprocess
import sys

import pytest

from snlp.apps.cli import main

TINY = ["--depth", "4", "--width", "32", "--head-dim", "16", "--vocab-size", "97", "--warmup", "1", "--runs", "3"]


def test_bench_writes_records_for_sequential_and_each_plan(tmp_path, capsys):
    out = tmp_path / "sub" / "out.json"
    rc = main(["bench", *TINY, "--tokens", "3", "--window-pattern", "SL",
               "--plans", "1xF2-h0-K1,2xF1-fwd-K2-none", "--json", str(out)])
    assert rc == 0
    records = json.loads(out.read_text())
    assert [r["plan"] for r in records] == ["sequential", "1xF2-h0-K1", "2xF1-fwd-K2-none"]
    for r in records:
        assert {"plan", "median_ms", "speedup", "ideal_layer_speedup"} <= r.keys() and "ideal_speedup" not in r
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["runs"] == 3
        assert r["speedup"] == pytest.approx(records[0]["median_ms"] / r["median_ms"])  # sequential over plan
    assert records[1]["ideal_layer_speedup"] == 4 / 3 and records[2]["ideal_layer_speedup"] == 4 / 5  # L/(S+K+fwd)
    table = capsys.readouterr().out
    assert "1xF2-h0-K1" in table and "ideal" in table


def test_bench_rejects_bad_plans_with_a_message(capsys):
    assert main(["bench", *TINY, "--plans", "3xF2-h0-K1"]) == 2
    err = capsys.readouterr().err
    assert "snlp bench: error:" in err and "model has only L = 4" in err
    assert main(["bench", *TINY, "--plans", "2xF1-h9"]) == 2
    assert "unknown part 'h9'" in capsys.readouterr().err


def test_console_entry_point_runs_as_a_module():
    res = subprocess.run([sys.executable, "-m", "snlp", "bench", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--plans" in res.stdout and "--compile" in res.stdout

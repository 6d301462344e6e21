"""`snlp selfcheck` on the CPU: every law passes, the table is printed and the JSON holds the
device, the versions, every check and every timing. The compiled check is off here (auto on the CPU):
tests/decode/test_steps.py covers compiled == eager, and a cold inductor cache would cost minutes."""

from __future__ import annotations

import json

import pytest
import torch

from snlp.apps.cli import main
from snlp.bench.selfcheck import Check, SelfcheckResult, table


@pytest.mark.slow
def test_selfcheck_cli_on_cpu(tmp_path, capsys):
    assert main(["selfcheck", "--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rec = json.loads((tmp_path / "selfcheck.json").read_text())
    assert rec["passed"] and rec["device"] == "cpu" and rec["versions"]["torch"] == torch.__version__
    names = [c["name"] for c in rec["checks"]]
    assert names == ["cached decoding == argmax loop", "K >= C reproduces the fused model", "M = 1 equals sequential", "speculative greedy == sequential",
                     "batched rows == single rows", "compiled == eager", "transformers logits", "fingerprints",
                     "refusals"]
    assert all(c["passed"] for c in rec["checks"] if c["name"] != "compiled == eager")
    assert {r["plan"] for r in rec["forward"]} >= {"sequential"} and all(r["median_ms"] > 0 for r in rec["forward"])
    assert {r["mode"] for r in rec["decode"]} == {"sequential", "snlp", "speculative"}
    assert all(r["matches_sequential"] for r in rec["decode"])  # greedy decoding of every mode == sequential
    assert "ALL CHECKS THAT RAN PASSED (8 of 9; not run: compiled == eager)" in out and out.count("PASS ") == 8


def test_a_failed_check_fails_the_run():
    res = SelfcheckResult(device="cpu", device_name="x", versions={"torch": "t", "cuda": None}, config={},
                          checks=[Check("a", True, "", 0.0), Check("b", False, "off by 1", 0.0),
                                  Check("c", None, "skipped", 0.0)])
    assert not res.passed
    lines = table(res)
    assert any(line.startswith("FAIL  b") for line in lines) and lines[-1].startswith("SOME CHECKS FAILED")


def test_a_skipped_check_is_not_reported_as_passed():
    """With the compiled check off (the CPU default) the last line said "ALL CHECKS PASSED" of a run in which one
    check never ran; it now says how many ran and names the one that did not, and "ALL CHECKS PASSED" stays for a
    run in which every check ran and passed."""
    def last(checks):
        return table(SelfcheckResult(device="cpu", device_name="x", versions={"torch": "t", "cuda": None}, config={},
                                     checks=checks))[-1]

    line = last([Check("a", True, "", 0.0), Check("compiled == eager", None, "skipped (--compile off)", 0.0)])
    assert not line.startswith("ALL CHECKS PASSED"), line
    assert line.startswith("ALL CHECKS THAT RAN PASSED (1 of 2; not run: compiled == eager)"), line
    assert last([Check("a", True, "", 0.0), Check("b", True, "", 0.0)]).startswith("ALL CHECKS PASSED in ")


def test_the_speed_rows_say_how_many_runs_they_are_and_flag_a_speedup_above_its_ideal():
    """The quick suite's decode rows are one timed run each: a CPU run printed a speculative 7.21x (its ideal SSD
    3.29x) as a result. The table now says how many runs the rows are and that they check the timing paths, and a
    row above its ideal SSD speedup is flagged as noise."""
    base = dict(mode="speculative", plan="2xF1-h0-K1", block=3, ms_per_token=5.8, speedup=7.21, compiled=False,
                runs=1, ideal_ssd_speedup=3.29, speedup_rounds=[7.21])
    res = SelfcheckResult(device="cpu", device_name="x", versions={"torch": "t", "cuda": None}, config={},
                          checks=[Check("a", True, "", 0.0)],
                          forward=[dict(plan="sequential", median_ms=1.0, speedup=1.0, compiled=False, runs=3)],
                          decode=[dict(base, mode="sequential", plan="sequential", block=None, speedup=1.0,
                                       ideal_ssd_speedup=None), base])
    text = "\n".join(table(res))
    assert "not a measurement" in text
    # 3 prefill runs and 1 decode run: each count with its own kind (a merged "1/3 (prefill / decode)" swapped them)
    assert "speed rows: the median of 3 timed runs per prefill row, 1 timed run per decode row;" in text
    assert "7.21x (tie)  False  (above its ideal SSD 3.29x in 1 of 1 run: not resolved from it by the sign test, " \
        "noise)" in text


def test_a_speedup_above_its_ideal_is_called_noise_only_where_its_runs_do_not_resolve_it():
    """Every decode row above its ideal SSD speedup was labelled "noise", whatever its runs showed. The label now
    comes from the row's paired runs against the ideal (the sign test of the "(tie)" marks): runs on both sides of
    it, or too few, are noise; six of six above it are not (p = 2 / 2^6), and the note then sets the measured tokens
    per round beside those the ideal expects at the row's alpha, (1 - a^(B+1)) / (1 - a), written out here."""
    def above_ideal(row):  # the note the table prints after the row's compiled column
        res = SelfcheckResult(device="cpu", device_name="x", versions={"torch": "t", "cuda": None}, config={},
                              checks=[Check("a", True, "", 0.0)], decode=[row])
        line = next(ln for ln in table(res) if "B=3" in ln)
        return line[line.index("False") + len("False"):]

    row = dict(mode="speculative", plan="2xF1-h0-K1", ms_per_token=5.8, compiled=False, runs=6, speedup=3.6,
               ideal_ssd_speedup=3.29, alpha=0.8, block=3, tokens_per_round=3.9)
    expect = (1 - 0.8 ** 4) / (1 - 0.8)  # 2.952
    six = above_ideal(dict(row, speedup_rounds=[3.5, 3.6, 3.7, 3.6, 3.5, 3.4]))
    assert six == (f"  (above its ideal SSD 3.29x in 6 of 6 runs, sign test p = {2 / 2 ** 6:.3f}: not noise; 3.90 "
                   f"tokens per round measured, {expect:.2f} the ideal expects at alpha 0.80)"), six
    mixed = above_ideal(dict(row, speedup_rounds=[3.0, 3.7, 3.1, 3.8, 3.2, 3.9]))
    assert mixed == "  (above its ideal SSD 3.29x in 3 of 6 runs: not resolved from it by the sign test, noise)"
    five = above_ideal(dict(row, speedup_rounds=[3.5, 3.6, 3.7, 3.6, 3.5]))  # 5 of 5: p = 2 / 32 > 5 %
    assert five.endswith("in 5 of 5 runs: not resolved from it by the sign test, noise)"), five
    assert "not noise" not in mixed and "noise" not in above_ideal(dict(row, speedup=3.2, speedup_rounds=[4.0] * 6))
    assert above_ideal(dict(row, ideal_ssd_speedup=None, speedup_rounds=[4.0] * 6)) == ""


def test_a_wrapped_failure_names_its_cause():
    """The first GPU run's report said only "BackendCompilerFailed: backend='inductor' raised:": the reason sat on the
    lines after and in the exception's cause. The check's line now carries both, and the JSON the traceback."""
    from snlp.bench.selfcheck import failure

    try:
        try:
            raise TypeError("fake cause: unsupported dtype\nmore")
        except TypeError as inner:
            raise RuntimeError("backend='inductor' raised:\nTypeError: fake cause: unsupported dtype") from inner
    except RuntimeError as e:
        line = failure(e)
    assert "backend='inductor' raised:" in line and "fake cause: unsupported dtype" in line
    assert line.endswith("TypeError: fake cause: unsupported dtype | more")


def test_a_failing_speed_part_keeps_the_other_rows(monkeypatch):
    """A speed part that raises (the first H100 run: the compiled part) is its own failed check with a traceback;
    the rows the other parts measured stay in the report."""
    import snlp.bench.selfcheck as sc

    def broken(*a, **k):
        raise RuntimeError("decode broke")

    monkeypatch.setattr(sc, "decode_benchmark", broken)
    forward, decode, failed = sc.speed_suite(torch.device("cpu"), quick=True, compile=False)
    assert {r["plan"] for r in forward} >= {"sequential"} and decode == []
    assert [c.name for c in failed] == ["speed: eager decode runs"] and not failed[0].passed
    assert "decode broke" in failed[0].detail and "Traceback" in failed[0].traceback


@pytest.mark.parametrize("ok", [True, False])
def test_a_signal_after_a_passing_selfcheck_wrote_its_json_exits_0(ok, tmp_path, monkeypatch, capsys):
    """A SIGTERM after selfcheck.json was written (while the locks are released) ended the command with 143, so a
    requeue script ran the finished checks again. A passing run says it had finished and exits 0; a failing one keeps
    143 (0 would hide its own status 1). The checks are a stand-in result: what is tested is the ending."""
    import os
    import signal

    import snlp.apps.selfcheck as app
    import snlp.bench.selfcheck as sc

    res = SelfcheckResult(device="cpu", device_name="x", versions={"torch": "t", "cuda": None}, config={},
                          checks=[Check("a", ok, "", 0.0)])
    monkeypatch.setattr(sc, "selfcheck", lambda cfg: res)
    real = app.run
    monkeypatch.setattr(app, "run", lambda args: (real(args), os.kill(os.getpid(), signal.SIGTERM))[0])
    rc = main(["selfcheck", "--device", "cpu", "--out", str(tmp_path)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert json.loads((tmp_path / "selfcheck.json").read_text())["passed"] is ok
    if ok:
        assert rc == 0 and line == (f"snlp selfcheck: SIGTERM arrived after the run had finished: "
                                    f"{tmp_path / 'selfcheck.json'} holds its complete results; nothing to rerun")
    else:
        assert rc == 128 + signal.SIGTERM and line.startswith("snlp selfcheck: interrupted by SIGTERM"), line


def test_tie_stands_beside_the_speedup_it_qualifies():
    """"(tie)" was printed at the end of the line, after the compiled column and the above-its-ideal note, as if
    it qualified them. It now follows the speedup, the column widened so the rows still line up."""
    rounds = [1.1, 0.9, 1.2]  # 3 paired runs never resolve a lead: a tie
    res = SelfcheckResult(device="cpu", device_name="x", versions={"torch": "t", "cuda": None}, config={},
                          checks=[Check("a", True, "", 0.0)],
                          forward=[dict(plan="sequential", median_ms=1.0, speedup=1.0, compiled=False, runs=3),
                                   dict(plan="2xF1-h0-K1", median_ms=0.9, speedup=1.11, compiled=False, runs=3,
                                        speedup_rounds=rounds)],
                          decode=[dict(mode="speculative", plan="2xF1-h0-K1", block=3, ms_per_token=5.8, speedup=7.21,
                                       compiled=True, runs=3, ideal_ssd_speedup=3.29, speedup_rounds=[7.0, 7.2, 7.5])])
    lines = table(res)
    row = next(ln for ln in lines if "2xF1-h0-K1" in ln and "B=" not in ln)
    assert row.endswith("1.11x (tie)  False"), row
    spec = next(ln for ln in lines if "B=3" in ln)
    assert "7.21x (tie)  True  (above its ideal SSD 3.29x in 3 of 3 runs: not resolved" in spec, spec
    assert not spec.endswith("(tie)"), spec
    seq = next(ln for ln in lines if ln.startswith("  sequential"))
    head = next(ln for ln in lines if ln.startswith("prefill"))
    assert seq.index("False") == row.index("False") == head.index("compiled")  # still one column

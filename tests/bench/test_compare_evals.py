"""scripts/compare_evals.py: arms of `snlp eval --json` compared on the same validation windows; arms scored on other
windows or other plans are refused (the paired intervals would pair unrelated windows)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def arm(path: Path, seq_ce, plan_ce, windows=None):
    def row(plan, ce):
        ce = ce[:windows] if windows else ce
        return dict(plan=plan, ppl=math.exp(sum(ce) / len(ce)), delta_ppl=0.0, window_ce=ce, seq_len=64, tokens=512)
    rows = [row("sequential", seq_ce), row("4xF1-h0-K1", plan_ce)]
    seq = rows[0]["ppl"]
    rows[1]["delta_ppl"] = rows[1]["ppl"] / seq - 1
    path.write_text(json.dumps(rows))
    return str(path)


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_evals.py"), *args], capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_same_windows_compare_and_other_windows_are_refused(tmp_path):
    seq = [3.0, 3.1, 2.9, 3.2, 3.05, 2.95, 3.15, 3.0]
    a = arm(tmp_path / "a.json", seq, [x + 0.10 for x in seq])  # the plan 10 % worse in every window
    b = arm(tmp_path / "b.json", seq, [x + 0.01 + 0.001 * (i % 2) for i, x in enumerate(seq)])
    out = run(f"a={a}", f"b={b}")
    assert out.returncode == 0, out.stderr
    assert "Windows per row: [8]" in out.stdout and "| b | " in out.stdout
    short = arm(tmp_path / "s.json", seq, [x + 0.01 for x in seq], windows=4)
    out = run(f"a={a}", f"s={short}")
    assert out.returncode == 2 and "not scored on the same validation windows" in out.stderr
    (tmp_path / "m.json").write_text(json.dumps(json.loads(Path(a).read_text())[:1]))
    out = run(f"a={a}", f"m={tmp_path / 'm.json'}")
    assert out.returncode == 2 and "has no row for 4xF1-h0-K1" in out.stderr
    out = run(f"a={a}", f"b={b}", "--against", "c")
    assert out.returncode == 2 and "--against 'c' is not one of the arms" in out.stderr


def test_a_partial_eval_file_is_compared_and_said_to_be_partial(tmp_path):
    """`snlp eval` cut short after its teacher-forced phase leaves {"complete": false, "done", "records"} with every
    PPL column: compared like a finished file (it failed on the object), with a line saying it is partial."""
    seq = [3.0, 3.1, 2.9, 3.2, 3.05, 2.95, 3.15, 3.0]
    a = arm(tmp_path / "a.json", seq, [x + 0.10 for x in seq])
    rows = json.loads(Path(a).read_text())
    (tmp_path / "p.json").write_text(json.dumps({"complete": False, "done": "PPL, dPPL, Top-1 and LogitSim",
                                                 "records": rows}))
    out = run(f"a={a}", f"p={tmp_path / 'p.json'}")
    assert out.returncode == 0, out.stderr
    assert "arm p: " in out.stdout and "is PARTIAL" in out.stdout and "| p | " in out.stdout
    (tmp_path / "x.json").write_text(json.dumps({"rows": rows}))
    out = run(f"a={a}", f"x={tmp_path / 'x.json'}")
    assert out.returncode == 2 and "is not an `snlp eval --json` file" in out.stderr


def test_a_diverged_plan_is_compared_as_diverged_not_refused_as_other_windows(tmp_path):
    """A plan that diverged has PPL inf and no per-window losses (teacher_forced's Quality(inf, None, None,
    "diverged")); `snlp eval --json` writes it strict ("inf", null) with the run's `load` in every row. The arms were
    scored on the same windows: the file is compared, the diverged row said diverged (it was refused as 'not scored on
    the same validation windows', counting the diverged row's 0 windows)."""
    from snlp.eval.protocol import EvalRecord
    from snlp.runtime.device import json_text

    seq = [3.0, 3.1, 2.9, 3.2, 3.05, 2.95, 3.15, 3.0]
    a = arm(tmp_path / "a.json", seq, [x + 0.10 for x in seq])
    rows = json.loads(Path(a).read_text())
    rows[1] = EvalRecord(plan="4xF1-h0-K1", ppl=math.inf, note="diverged", delta_ppl=math.inf, seq_len=64,
                         tokens=512).to_dict()
    load = {"start": 0.1, "end": 0.2, "peak": 0.2, "cores": 2}
    (tmp_path / "d.json").write_text(json_text([{**r, "load": load} for r in rows]))
    for args in ([f"a={a}", f"d={tmp_path / 'd.json'}"], [f"d={tmp_path / 'd.json'}", f"a={a}"]):
        out = run(*args)
        assert out.returncode == 0, out.stderr
        assert "| d | 4xF1-h0-K1 | inf | diverged | - |" in out.stdout
        assert "| a | 4xF1-h0-K1 | " in out.stdout and "+10.52 %" in out.stdout
        assert "| diverged" in out.stdout.splitlines()[-1]  # the ratio against a diverged side is not a number


def test_a_nan_ppl_written_as_null_is_read_as_the_nan_it_was(tmp_path):
    """Strict JSON (snlp.runtime.device.json_text) writes a NaN PPL as null: the script reads it back as NaN, as it
    read the bare NaN files held before, and says the row diverged (it raised a TypeError formatting None)."""
    from snlp.runtime.device import json_text

    seq = [3.0, 3.1, 2.9, 3.2, 3.05, 2.95, 3.15, 3.0]
    a = arm(tmp_path / "a.json", seq, [x + 0.10 for x in seq])
    rows = json.loads(Path(a).read_text())
    rows[1] = {**rows[1], "ppl": math.nan, "delta_ppl": math.nan, "window_ce": None}
    (tmp_path / "n.json").write_text(json_text(rows))
    assert '"ppl": null' in (tmp_path / "n.json").read_text()
    out = run(f"a={a}", f"n={tmp_path / 'n.json'}")
    assert out.returncode == 0, out.stderr
    assert "| n | 4xF1-h0-K1 | nan | diverged | - |" in out.stdout


def test_a_harness_records_file_is_refused_in_one_line(tmp_path):
    """`snlp eval --harness --json` writes a list of records keyed by `method` (or its partial object of them): the
    script raised KeyError 'plan' with a traceback instead of saying the file is not an `snlp eval --json` file."""
    rec = {"method": "sequential", "results": {"t": {"acc,none": 0.5}}, "diverged": False, "harness": {}}
    (tmp_path / "h.json").write_text(json.dumps([rec]))
    (tmp_path / "p.json").write_text(json.dumps({"complete": False, "done": "1 of 2 methods", "records": [rec]}))
    for f in ("h.json", "p.json"):
        out = run(f"a={tmp_path / f}", f"b={tmp_path / f}")
        assert out.returncode == 2 and "is not an `snlp eval --json` file" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr

"""A long `snlp bench` run cut short keeps every part it finished: the suites (paper, train) and --vs-paper rewrite
their JSON and markdown atomically after each part, marked partial ("complete": false, a **PARTIAL** line) until the
last part is written, and Ctrl-C ends the command with status 130 and one line naming the files kept. The cut is a
KeyboardInterrupt raised where the next part would start (what Ctrl-C raises there)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from snlp.apps.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def interrupted_on_call(n: int, real):
    """`real`, except that its n-th call raises KeyboardInterrupt."""
    calls = []

    def fn(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*a, **k)

    return fn


def last_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_paper_suite_cut_short_keeps_its_finished_parts_marked_partial(tmp_path, monkeypatch, capsys):
    import snlp.bench.suite as suite

    monkeypatch.setattr(suite, "_decode", interrupted_on_call(1, suite._decode))  # after the first prefill part
    out = tmp_path / "s"
    rc = main(["bench", "--suite", "paper", "--quick", "--shapes", "0.5B", "--treatments", "eager", "--device", "cpu",
               "--out", str(out)])
    line = last_line(capsys)
    assert rc == 130
    assert line.startswith("snlp bench: interrupted; kept the parts that had finished in ") and str(out / "suite.json") \
        in line and str(out / "suite.md") in line, line
    data = json.loads((out / "suite.json").read_text())
    assert data["complete"] is False and [r["kind"] for r in data["records"]] == ["prefill"] * 4
    assert "**PARTIAL**" in (out / "suite.md").read_text()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_a_finished_paper_suite_says_complete(tmp_path):
    from snlp.bench.suite import SuiteConfig, run_suite

    result = run_suite(SuiteConfig(quick=True, shapes=("0.5B",), device="cpu", treatments=("eager",), decode=False,
                                   out=str(tmp_path)))
    assert json.loads((tmp_path / "suite.json").read_text())["complete"] is True
    assert "PARTIAL" not in (tmp_path / "suite.md").read_text() and result.complete


def test_train_suite_cut_short_keeps_its_finished_variants(tmp_path, monkeypatch, capsys):
    import snlp.bench.train as train

    monkeypatch.setattr(train, "run_variant", interrupted_on_call(2, train.run_variant))
    out = tmp_path / "t"
    rc = main(["bench", "--suite", "train", "--quick", "--treatments", "eager", "--regs", "none,idn", "--device",
               "cpu", "--out", str(out)])
    assert rc == 130 and str(out / "train.json") in last_line(capsys)
    data = json.loads((out / "train.json").read_text())
    assert data["complete"] is False and [r["reg"] for r in data["records"]] == ["none"]
    assert "**PARTIAL**" in (out / "train.md").read_text()


# the checkout tests/bench/test_vs_paper.py loads, in its order: a process imports the paper's `nanochat` from one
# root only (a second root is refused), and these tests share xdist workers
ROOT = Path(__file__).resolve().parents[2]
PAPER = next((Path(p) for p in (os.environ.get("SNLP_PAPER_CODE", ""), ROOT / ".paper" / "nanochat-snlp",
                                ROOT.parent / "shared" / "anchors" / "nanochat-snlp")
              if p and (Path(p) / "nanochat" / "gpt.py").is_file()), None)


@pytest.mark.skipif(PAPER is None, reason="no checkout of the paper's code beside the repository")
def test_vs_paper_cut_short_keeps_its_finished_shapes(tmp_path, monkeypatch, capsys):
    import snlp.bench.vs_paper as vs_paper

    def first_shape_then_cut(shape, cfg, code, dev, result):  # the first shape ends with no rows, the next is cut
        if shape.key != cfg.shapes[0]:
            raise KeyboardInterrupt

    monkeypatch.setattr(vs_paper, "_run_shape", first_shape_then_cut)
    out = tmp_path / "v"
    rc = main(["bench", "--vs-paper", str(PAPER), "--quick", "--shapes", "0.5B,3B", "--device", "cpu", "--out",
               str(out)])
    assert rc == 130 and str(out / "vs_paper.json") in last_line(capsys)
    assert json.loads((out / "vs_paper.json").read_text())["complete"] is False
    assert "**PARTIAL**" in (out / "vs_paper.md").read_text()


def test_ctrl_c_before_any_part_finished_says_nothing_was_written(tmp_path, monkeypatch, capsys):
    import snlp.bench.suite as suite

    def cut(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(suite, "benchmark", cut)
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "suite.json").write_text("{}")  # an earlier run's file: not this run's to claim
    assert main(["bench", "--suite", "paper", "--quick", "--shapes", "0.5B", "--treatments", "eager", "--device",
                 "cpu", "--out", str(tmp_path / "s")]) == 130
    assert last_line(capsys) == "snlp bench: interrupted; no part had finished: nothing written"


@pytest.mark.parametrize("argv, default", [
    (["bench", "--suite", "paper", "--quick", "--shapes", "0.5B", "--treatments", "eager"], "bench-suite"),
    (["bench", "--suite", "train", "--quick"], "bench-suite"),
    (["selfcheck", "--quick", "--device", "cpu"], "selfcheck"),
])
def test_a_default_out_that_cannot_be_written_is_refused_before_any_work(argv, default, tmp_path, monkeypatch,
                                                                         capsys):
    """The CLI checks the output paths typed; these commands write a default folder too, which failed (a traceback)
    after the first part had run. A file where the folder would go stands for any folder that cannot be written."""
    import snlp.bench.selfcheck as selfcheck
    import snlp.bench.suite as suite
    import snlp.bench.train as train

    def work(*a, **k):
        raise AssertionError("the work started")

    for mod, name in ((suite, "_run"), (train, "run_variant"), (selfcheck, "selfcheck")):
        monkeypatch.setattr(mod, name, work)
    monkeypatch.chdir(tmp_path)
    (tmp_path / default).write_text("not a folder")
    assert main(argv) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"snlp {argv[0]}: error: ") and f"{default} exists and is a file" in line, line


@pytest.mark.parametrize("argv, flag", [
    (["bench", "--depth", "2", "--json", "{p}"], "--json"),
    (["eval", "{ck}", "--plans", "1xF1-h0-K1", "--markdown", "{p}"], "--markdown"),
    (["tune", "{ck}", "--json", "{p}"], "--json"),
    (["bench", "--suite", "paper", "--quick", "--out", "{p}"], "--out"),
])
def test_a_second_run_writing_the_same_output_is_refused_at_once(argv, flag, tmp_path, capsys):
    """Two runs rewriting one file as they go interleaved their rows (eval, tune) or left one run's suite.json beside
    the other's suite.md: while a run holds an output path, a second is refused in one line, before any work."""
    from snlp.runtime.outputs import locked_output

    path = tmp_path / "result"
    with locked_output(path):  # the first run, in progress
        rc = main([a.replace("{p}", str(path)).replace("{ck}", str(tmp_path / "ck")) for a in argv])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and line.startswith(f"snlp {argv[0]}: error: {flag} {path} is in use by a run in progress"), line
    assert not path.exists()


def test_ctrl_c_in_a_one_round_robin_benchmark_says_nothing_was_written(tmp_path, monkeypatch, capsys):
    """The forward benchmark times every row in one round-robin: no row is finished before all are, so it writes
    once, at the end, and Ctrl-C says so instead of leaving the user to look for a file."""
    import snlp.bench.forward as forward

    def cut(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(forward, "benchmark", cut)
    assert main(["bench", "--depth", "2", "--width", "64", "--head-dim", "32", "--vocab-size", "256", "--plans",
                 "1xF1-h0-K1", "--json", str(tmp_path / "b.json")]) == 130
    assert last_line(capsys) == ("snlp bench: interrupted; this run writes its records once every round has run: "
                                 "nothing written")
    assert not (tmp_path / "b.json").exists()


def test_an_output_whose_folder_does_not_exist_yet_is_locked_too(tmp_path, monkeypatch, capsys):
    """`--json runs/new/b.json` with runs/new not there yet: the first run created the folder only when it wrote, so a
    second run started meanwhile took the lock and both wrote the file (the last to finish won). The second run is
    started here while the first is in its benchmark; the first, cut short, leaves no folder it made for the lock."""
    import snlp.bench.forward as forward

    path = tmp_path / "runs" / "new" / "b.json"
    argv = ["bench", "--depth", "2", "--width", "64", "--head-dim", "32", "--vocab-size", "256", "--plans",
            "1xF1-h0-K1", "--json", str(path)]
    second = []

    def first_run(*a, **k):  # the second run starts while the first is here
        if second:
            raise AssertionError("the second run was not refused: it started its benchmark")
        second.append(None)
        second.append(main(argv))
        second.append(capsys.readouterr().err.strip().splitlines()[-1])
        raise KeyboardInterrupt

    monkeypatch.setattr(forward, "benchmark", first_run)
    assert main(argv) == 130
    assert second[1] == 2 and second[2].startswith(f"snlp bench: error: --json {path} is in use by a run in progress "
                                                   f"(pid {os.getpid()})"), second
    assert not (tmp_path / "runs").exists()  # nothing was written: the folders made for the lock are gone


def test_a_run_refused_for_bad_input_leaves_no_folder_for_its_lock(tmp_path, capsys):
    path = tmp_path / "new" / "deeper" / "b.json"
    assert main(["bench", "--depth", "2", "--plans", "not-a-plan", "--json", str(path)]) == 2
    assert "error" in last_line(capsys) and not (tmp_path / "new").exists()


@pytest.mark.parametrize("argv, default, flag", [
    (["bench", "--suite", "paper", "--quick"], "bench-suite", "--out"),
    (["bench", "--suite", "train", "--quick", "--out", "bench-suite"], "bench-suite", "--out"),  # the default, typed
    (["bench", "--vs-paper", "paper-code", "--quick"], "bench-vs-paper", "--out"),
    (["selfcheck", "--quick"], "selfcheck", "--out"),
])
def test_a_second_run_writing_the_same_default_folder_is_refused_at_once(argv, default, flag, tmp_path, monkeypatch,
                                                                         capsys):
    """Two suites started in one folder (each writing bench-suite/, the default --out) rewrote one suite.json in
    turns; so did two selfchecks (tests/eval/test_harness.py: two harness runs of one checkpoint). The default folder
    a run writes is locked as a typed one is, once the run's input is checked."""
    from snlp.runtime.outputs import locked_output

    monkeypatch.chdir(tmp_path)
    with locked_output(default):  # the first run, in progress
        rc = main(argv)
    line = last_line(capsys)
    assert rc == 2 and line.startswith(f"snlp {argv[0]}: error: {flag} {default} is in use by a run in progress"), line
    assert not (tmp_path / default).exists()


def test_a_forward_benchmark_writes_no_default_folder_and_takes_no_lock_on_it(tmp_path, monkeypatch, capsys):
    import snlp.bench.forward as forward
    from snlp.runtime.outputs import locked_output

    def cut(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(forward, "benchmark", cut)
    monkeypatch.chdir(tmp_path)
    with locked_output("bench-suite"):  # a suite in progress in the same folder
        assert main(["bench", "--depth", "2", "--width", "64", "--head-dim", "32", "--vocab-size", "256", "--plans",
                     "1xF1-h0-K1"]) == 130


def test_sigterm_ends_a_suite_as_ctrl_c_does_and_restores_the_handler(tmp_path, monkeypatch, capsys):
    """A SIGTERM (Slurm's time limit, docker stop) in the middle of `snlp bench --suite paper`: the same end as
    Ctrl-C's (the finished parts kept, one line naming the signal and the files), exit 128 + 15, and the caller's
    own SIGTERM handler back afterwards. Before, the signal's default action killed the process without a word."""
    import signal

    import snlp.bench.suite as suite

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))  # the caller's handler (and a guard)
    try:
        real = suite._decode

        def decode_after_sigterm(*a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **k)

        monkeypatch.setattr(suite, "_decode", decode_after_sigterm)  # after the first prefill part
        out = tmp_path / "s"
        rc = main(["bench", "--suite", "paper", "--quick", "--shapes", "0.5B", "--treatments", "eager", "--device",
                   "cpu", "--out", str(out)])
        line = last_line(capsys)
        assert seen == [] and rc == 128 + signal.SIGTERM, (seen, rc)
        assert line.startswith("snlp bench: interrupted by SIGTERM; kept the parts that had finished in "), line
        assert json.loads((out / "suite.json").read_text())["complete"] is False
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL and seen == []
        os.kill(os.getpid(), signal.SIGTERM)  # the caller's handler is back
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def signal_after(module, name: str, monkeypatch, when=lambda *a, **k: True):
    """`module.name` sends this process a real SIGTERM right after a call of it that `when` picks returns."""
    import signal

    real = getattr(module, name)

    def fn(*a, **k):
        out = real(*a, **k)
        if when(*a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(module, name, fn)


def test_a_sigterm_after_a_suite_wrote_its_last_part_says_the_files_are_complete(tmp_path, monkeypatch, capsys):
    """A SIGTERM that lands after the suite's last write (while it prints its tables, or releases its locks): its line
    said the files were "marked partial ("complete": false)" while they said "complete": true and had no PARTIAL
    line, and it exited 128 + 15, so a requeue script ran the finished suite again. It says the run had finished and
    exits 0."""
    import snlp.bench.suite as suite

    signal_after(suite, "run_suite", monkeypatch)
    out = tmp_path / "s"
    rc = main(["bench", "--suite", "paper", "--quick", "--shapes", "0.5B", "--treatments", "eager", "--no-decode",
               "--device", "cpu", "--out", str(out)])
    line = last_line(capsys)
    assert rc == 0, line
    assert json.loads((out / "suite.json").read_text())["complete"] is True
    assert "PARTIAL" not in (out / "suite.md").read_text()
    assert line == (f"snlp bench: SIGTERM arrived after the run had finished: {out / 'suite.json'} and "
                    f"{out / 'suite.md'} hold its complete results; nothing to rerun"), line


def test_a_sigterm_after_a_forward_benchmark_wrote_its_json_does_not_say_nothing_was_written(tmp_path, monkeypatch,
                                                                                             capsys):
    """The forward benchmark writes its --json once, at the end: a signal after that write said "nothing written"
    beside the file it had just written (and exited 143: a requeue script ran it again). It says the run had finished
    and exits 0; with a --csv still to write, the status stays 143 and the line names the file written."""
    import signal

    import snlp.bench.records as records

    signal_after(records, "write_records", monkeypatch)
    path = tmp_path / "b.json"
    rc = main(["bench", "--depth", "2", "--width", "64", "--head-dim", "32", "--vocab-size", "256", "--plans",
               "1xF1-h0-K1", "--runs", "2", "--warmup", "1", "--json", str(path)])
    assert rc == 0
    assert last_line(capsys) == (f"snlp bench: SIGTERM arrived after the run had finished: {path} holds its complete "
                                 "results; nothing to rerun")
    assert len(json.loads(path.read_text())) == 2

    real = records.write_json  # the signal after the JSON, before the CSV
    monkeypatch.setattr(records, "write_json", lambda *a, **k: (real(*a, **k), os.kill(os.getpid(), signal.SIGTERM)))
    rc = main(["bench", "--depth", "2", "--width", "64", "--head-dim", "32", "--vocab-size", "256", "--plans",
               "1xF1-h0-K1", "--runs", "2", "--warmup", "1", "--json", str(path), "--csv", str(tmp_path / "b.csv")])
    assert rc == 128 + signal.SIGTERM and not (tmp_path / "b.csv").exists()
    assert last_line(capsys) == (f"snlp bench: interrupted by SIGTERM; the run had finished writing {path} only")


def test_a_repeated_sigterm_does_not_cut_a_measurements_cleanup_short():
    """Slurm signals every process of a job step and torchrun forwards its own SIGTERM: a second SIGTERM while the
    first one's Interrupted unwinds (files written, the line printed) raised again there, and could end the command
    before its line. The first raises; a repeat is ignored."""
    import signal
    import types

    from snlp.apps.cli import measurement_signals

    args = types.SimpleNamespace(module=types.SimpleNamespace(LOCK_OUTPUTS=True))
    before = signal.getsignal(signal.SIGTERM)
    with measurement_signals(args):
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the repeat: ignored, not raised
        os.kill(os.getpid(), signal.SIGUSR1)
    assert signal.getsignal(signal.SIGTERM) is before


def test_decode_suite_cut_short_keeps_its_csv_marked_partial(tmp_path, monkeypatch, capsys):
    """--suite decode rewrote its --json after every round but wrote --csv once, at the end: a run cut short kept the
    JSON and lost the CSV. The CSV is rewritten with it, under a '# PARTIAL' comment line (pandas.read_csv(comment=
    "#") skips it; unskipped it is the header, so no finished column is there to be mistaken for data)."""
    import pandas as pd

    import snlp.bench.decode_suite as decode_suite

    monkeypatch.setattr(decode_suite, "progress_line", interrupted_on_call(4, decode_suite.progress_line))
    j, c = tmp_path / "d.json", tmp_path / "d.csv"
    argv = ["bench", "--suite", "decode", "--quick", "--no-transformers", "--batch-sizes", "1", "--device", "cpu",
            "--suite-methods", "snlp", "--json", str(j), "--csv", str(c)]
    assert main(argv) == 130
    line = last_line(capsys)
    assert line.startswith("snlp bench: interrupted; kept the parts that had finished in ") and str(c) in line, line
    text = c.read_text()
    assert text.startswith("# PARTIAL: ") and json.loads(j.read_text())["complete"] is False
    rows = pd.read_csv(c, comment="#")
    assert list(rows["method"]) == [r["method"] for r in json.loads(j.read_text())["rows"]]
    monkeypatch.undo()
    assert main(argv) == 0
    assert not c.read_text().startswith("#") and json.loads(j.read_text())["complete"] is True


@pytest.mark.skipif(PAPER is None, reason="no checkout of the paper's code beside the repository")
@pytest.mark.parametrize("failed", [False, True])
def test_a_signal_after_vs_paper_finished_exits_0_unless_a_callable_failed(failed, tmp_path, monkeypatch, capsys):
    """--vs-paper ends with status 1 where a callable failed: a signal after its files were written complete exits 0
    (it had finished) only where the run's own status would have been 0; with failures it keeps 128 + signum."""
    import signal

    import snlp.bench.vs_paper as vs_paper

    def no_rows(shape, cfg, code, dev, result):  # a shape that ran nothing (or failed): its files are still complete
        if failed:
            result.failures.append({"shape": shape.key, "callable": "x", "error": "boom", "traceback": ""})

    monkeypatch.setattr(vs_paper, "_run_shape", no_rows)
    signal_after(vs_paper, "run_vs_paper", monkeypatch)
    out = tmp_path / "v"
    rc = main(["bench", "--vs-paper", str(PAPER), "--quick", "--shapes", "0.5B", "--device", "cpu", "--out", str(out)])
    assert json.loads((out / "vs_paper.json").read_text())["complete"] is True
    assert rc == (128 + signal.SIGTERM if failed else 0), last_line(capsys)


def test_an_earlier_runs_file_dated_after_the_start_does_not_make_a_signalled_run_finished(tmp_path, monkeypatch,
                                                                                           capsys):
    """Whether a file is this run's own was its mtime against the run's start; since a signal after every file was
    written ends with status 0, a complete --json of an earlier run whose mtime is not before the start (a file
    server's clock ahead of this host's; an mtime equal to the start) made a run signalled in its measurement exit
    0, "nothing to rerun", having written nothing. A file counts as written only where it changed since the start."""
    import signal
    import time

    import snlp.bench.forward as forward

    path = tmp_path / "b.json"
    argv = ["bench", "--depth", "2", "--width", "64", "--head-dim", "32", "--vocab-size", "256", "--plans",
            "1xF1-h0-K1", "--runs", "1", "--warmup", "0", "--json", str(path)]
    path.write_text(json.dumps([{"plan": "sequential"}]))  # the earlier run's finished records
    ahead = time.time() + 60
    os.utime(path, (ahead, ahead))

    def measure(*a, **k):  # the signal lands in the measurement, before anything is written
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal did not stop the run")

    monkeypatch.setattr(forward, "benchmark", measure)
    assert main(argv) == 128 + signal.SIGTERM
    assert last_line(capsys) == ("snlp bench: interrupted by SIGTERM; this run writes its records once every round has "
                                 "run: nothing written")


def test_a_signal_before_the_prediction_wrote_its_out_folder_is_not_a_finished_run(tmp_path, monkeypatch, capsys):
    """--suite decode --shapes writes --json, then --out's prediction.json and prediction.md, then --csv; finished
    looked at --json and --csv only, so a signal right after --json exited 0 ("nothing to rerun") with --out's files
    never written."""
    import signal

    import snlp.bench.records as records
    import snlp.bench.ssd_prediction as ssd

    monkeypatch.setattr(ssd, "paper_shape_prediction", lambda *a, **k: [{"shape": "0.5B", "alpha": 0.6}])
    monkeypatch.setattr(ssd, "prediction_markdown", lambda rows, quick: "| shape |")
    j, out = tmp_path / "p.json", tmp_path / "d"
    signal_after(records, "write_json", monkeypatch, when=lambda path, *a, **k: Path(path) == j)
    rc = main(["bench", "--suite", "decode", "--shapes", "0.5B", "--quick", "--device", "cpu", "--json", str(j),
               "--out", str(out)])
    assert (rc, j.is_file(), out.exists()) == (128 + signal.SIGTERM, True, False), last_line(capsys)
    assert last_line(capsys) == f"snlp bench: interrupted by SIGTERM; the run had finished writing {j} only"
    monkeypatch.undo()
    monkeypatch.setattr(ssd, "paper_shape_prediction", lambda *a, **k: [{"shape": "0.5B", "alpha": 0.6}])
    monkeypatch.setattr(ssd, "prediction_markdown", lambda rows, quick: "| shape |")
    import snlp.runtime.device as device  # after the run's last write (no --csv): prediction.md

    signal_after(device, "write_atomic", monkeypatch, when=lambda path, *a, **k: Path(path) == out / "prediction.md")
    rc = main(["bench", "--suite", "decode", "--shapes", "0.5B", "--quick", "--device", "cpu", "--json", str(j),
               "--out", str(out)])
    assert rc == 0, last_line(capsys)
    assert (out / "prediction.json").is_file() and (out / "prediction.md").read_text() == "| shape |\n"


def test_a_csv_cell_holding_a_hash_survives_the_reader_that_skips_the_partial_line(tmp_path):
    """pandas.read_csv(path, comment="#"), the documented reader of a partial CSV, cut a cell at its "#" (a skipped
    row's error text, a plan or a path): the cells of such a row are quoted now, which the reader keeps whole. Both
    writers (bench's records, eval's rows), partial and finished."""
    pd = pytest.importorskip("pandas")
    from snlp.bench.records import write_csv
    from snlp.eval.present import write_csv as eval_csv

    class Rec:
        def __init__(self, d):
            self.d = d

        def to_dict(self):
            return self.d
    text = "error: #include <cuda.h>, 2 failed"
    for partial in ("rows so far", None):
        write_csv(tmp_path / "b.csv", [Rec({"method": "a", "tps": 1.5, "skipped": None}),
                                       Rec({"method": "b", "tps": None, "skipped": text})],
                  announce=False, partial=partial)
        eval_csv([{"plan": "x#1", "ppl": 2.0}, {"plan": "y", "ppl": 3.0}], tmp_path / "e.csv", partial=partial,
                 announce=False)
        b, e = pd.read_csv(tmp_path / "b.csv", comment="#"), pd.read_csv(tmp_path / "e.csv", comment="#")
        assert list(b["skipped"].fillna("")) == ["", text] and list(b["tps"].isna()) == [False, True]
        assert list(e["plan"]) == ["x#1", "y"] and list(e["ppl"]) == [2.0, 3.0]
    assert (tmp_path / "b.csv").read_text().splitlines()[1] == "a,1.5,"  # a row with no "#": written as before


def test_json_results_are_strict_json_with_null_for_what_was_not_measured(tmp_path):
    """Python's json wrote NaN (an SSD row's alpha when nothing was drafted) and Infinity (a diverged PPL), which
    strict parsers refuse; bench's and the commands' writers (snlp.bench.records.write_json,
    snlp.runtime.device.write_json) now write null and "inf", and an evaluation record reads "inf" back as inf."""
    import json
    import math

    from snlp.bench.records import write_json as write_records
    from snlp.decode.speculative import SpeculativeReport
    from snlp.eval.protocol import EvalRecord
    from snlp.runtime.device import write_json

    def strict(path):
        def refuse(constant):
            raise AssertionError(f"{constant} in {path}")
        return json.loads(path.read_text(), parse_constant=refuse)

    nan = float("nan")
    rep = SpeculativeReport(plan="2xF1-h0-K1", block=3, alpha=nan, tokens_per_round=1.0, drafter_speedup_s=nan,
                            sequential_ms_per_step=1.0, drafter_ms_per_step=nan, sequential_ms_per_token=1.0,
                            speculative_ms_per_token=1.0, measured_speedup=1.0, ideal_ssd_speedup=nan)
    write_records(tmp_path / "b.json", {"records": [rep], "range": (1.0, math.inf)}, announce=False)
    got = strict(tmp_path / "b.json")
    assert got["records"][0]["alpha"] is None and got["records"][0]["ideal_ssd_speedup"] is None
    assert got["range"] == [1.0, "inf"] and got["records"][0]["block"] == 3
    write_json(tmp_path / "g.json", {"report": rep.to_dict(), "x": [-math.inf, 2]})
    got = strict(tmp_path / "g.json")
    assert got["report"]["drafter_speedup_s"] is None and got["x"] == ["-inf", 2]
    assert EvalRecord.from_dict({"ppl": "inf", "delta_ppl": "inf", "plan": "p"} | {
        k: v for k, v in _eval_fields().items() if k not in ("ppl", "delta_ppl", "plan")}).ppl == math.inf


def _eval_fields() -> dict:
    """The required fields of an EvalRecord, filled."""
    import dataclasses

    from snlp.eval.protocol import EvalRecord

    return {f.name: 0 for f in dataclasses.fields(EvalRecord)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}

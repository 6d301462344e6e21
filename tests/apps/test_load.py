"""The load around a command's timings (snlp.runtime.load): the contention sentence where the 1-min load average is
more than the cores and more than the command's own threads explain, the window in every timed command's JSON, the
line said before timing where the torch threads exceed the cores left free, and the four records that read the
load before (speedrun stages, the analysis report, the paper suite, the distributed bench rows) keeping their
fields' types. The load source is monkeypatched (os.getloadavg, the affinity, the cgroup quota): no real load."""

from __future__ import annotations

import csv
import json
import os

import pytest
from conftest import text_checkpoint

import snlp.runtime.load as load
from snlp.apps.cli import main
from snlp.runtime.load import LoadWindow, contention_note, oversubscription_note, usable_cores

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = ["--depth", "2", "--width", "32", "--head-dim", "16", "--vocab-size", "97", "--warmup", "0", "--runs", "2"]
TINY = [*SHAPE, "--tokens", "2", "--plans", "2xF1-h0-K1"]
KINDS = {"forward": TINY, "decode": [*SHAPE, "--plans", "2xF1-h0-K1", "--decode", "--new-tokens", "2",
                                     "--prompt-len", "3", "--blocks", "2"], "ops": [*SHAPE[:-1], "1", "--ops", "--tokens", "1"]}


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """set(loads, cores): os.getloadavg returns each of `loads` in turn (the last one from then on; None: the
    platform has none), and the process may use `cores` cores (no cgroup quota)."""
    monkeypatch.setattr(load, "CPU_MAX", str(tmp_path / "no-cpu.max"))
    monkeypatch.setattr(load, "CFS", (str(tmp_path / "no-quota"), str(tmp_path / "no-period")))

    def apply(loads, cores: int = 2):
        seq = list(loads) if isinstance(loads, (list, tuple)) else [loads]

        def getloadavg():
            x = seq.pop(0) if len(seq) > 1 else seq[0]
            if x is None:
                raise OSError("no load average")
            return (x, x, x)

        monkeypatch.setattr(os, "getloadavg", getloadavg)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)

    return apply


def test_the_note_appears_above_the_cores_and_not_below(machine):
    machine(5.0, cores=2)
    w = LoadWindow.begin().close()
    assert w == LoadWindow(start=5.0, end=5.0, peak=5.0, cores=2)
    note = contention_note(w, own=2)
    assert note and note.startswith("timings contended:") and "5.00 on 2 cores" in note and "\n" not in note
    machine(1.6, cores=2)
    assert contention_note(LoadWindow.begin().close(), own=1) is None  # below the cores
    machine(2.2, cores=2)  # above the cores, but the command's own 2 threads explain all but 0.2 of it
    assert contention_note(LoadWindow.begin().close(), own=2) is None
    machine(None)  # no load average on this platform: nothing recorded, nothing said
    w = LoadWindow.begin().close()
    assert (w.start, w.end, w.peak) == (None, None, None) and w.note(own=1) is None


def test_the_peak_is_the_highest_sample_of_the_window(machine):
    machine([0.5, 6.0, 0.7], cores=2)  # a burst between the start and the end
    w = LoadWindow.begin().sample().close()
    assert (w.start, w.end, w.peak) == (0.5, 0.7, 6.0) and w.note(own=1)


def test_cores_are_the_affinity_capped_by_the_cgroup_quota(machine, tmp_path, monkeypatch):
    machine(0.0, cores=4)
    assert usable_cores() == 4
    quota = tmp_path / "cpu.max"
    monkeypatch.setattr(load, "CPU_MAX", str(quota))
    quota.write_text("150000 100000\n")  # 1.5 cores: two threads run, throttled
    assert usable_cores() == 2
    quota.write_text("max 100000\n")
    assert usable_cores() == 4


def test_oversubscription_is_said_where_threads_exceed_the_free_cores(machine):
    machine(0.95, cores=2)  # the command's own minute of loading data on an idle box: no warning about itself
    assert oversubscription_note(2, LoadWindow.begin()) is None
    machine(2.2, cores=2)  # 2 - (2.2 - 1, the command's own thread) = 0.8: one core left free
    w = LoadWindow.begin()
    line = oversubscription_note(2, w)
    assert line and "2 torch threads on 1 free core " in line and "OpenMP threads will wait on each other" in line
    assert line.endswith("--threads 1 times with one")
    assert oversubscription_note(1, w) is None  # one thread waits on no other
    assert "--threads" not in oversubscription_note(2, w, remedy=None)
    machine(0.3, cores=2)
    assert oversubscription_note(2, LoadWindow.begin()) is None


def test_the_records_that_read_the_load_keep_their_types(machine):
    """speedrun stages: float, two decimals; the analysis report: the string /proc/loadavg writes; the paper suite:
    float; the distributed bench rows: the three averages as strings; and each its empty form without one."""
    from snlp.apps.speedrun import records, train
    from snlp.bench.suite import SuiteConfig, SuiteMeta
    from snlp.eval.analysis.report import environment

    machine(3.0)
    assert records.load_average() == 3.0 and train.load_average() == 3.0
    assert environment().loadavg_1min_start == "3.00"
    meta = SuiteMeta.now(SuiteConfig(quick=True).resolved())
    assert meta.loadavg_1min_start == 3.0 and meta.cores == 2
    assert [f"{x:.2f}" for x in load.load_averages()] == ["3.00", "3.00", "3.00"]
    machine(None)
    assert records.load_average() is None and environment().loadavg_1min_start == "n/a"
    assert SuiteMeta.now(SuiteConfig(quick=True).resolved()).loadavg_1min_start is None
    assert load.load_averages() is None


def test_the_paper_suite_markdown_says_a_contended_run(machine):
    from snlp.bench.suite import SuiteConfig, SuiteMeta, suite_load_note

    machine(6.0, cores=2)
    meta = SuiteMeta.now(SuiteConfig(quick=True).resolved())
    meta.loadavg_1min_end = 6.5
    assert "6.50 on 2 cores" in suite_load_note(meta)
    meta.loadavg_1min_start = meta.loadavg_1min_end = 0.4
    assert suite_load_note(meta) is None
    meta.cores = None  # a file written before the meta recorded its cores
    assert suite_load_note(meta) is None


@pytest.mark.parametrize("kind", KINDS)
def test_bench_says_a_contended_window_and_records_it(machine, tmp_path, capsys, kind):
    machine(5.0, cores=2)
    out, csv = tmp_path / "b.json", tmp_path / "b.csv"
    args = KINDS[kind]
    assert main(["bench", *args, "--threads", "1", "--json", str(out), "--csv", str(csv)]) == 0
    text = capsys.readouterr().out
    assert text.count("timings contended: the 1-min load average reached 5.00 on 2 cores") == 1
    rows = json.loads(out.read_text())
    assert rows and all(r["load"] == {"start": 5.0, "end": 5.0, "peak": 5.0, "cores": 2} for r in rows)
    assert "load" in csv.read_text().splitlines()[0].split(",")


def test_bench_says_once_before_timing_that_its_threads_oversubscribe(machine, tmp_path, capsys):
    machine(2.5, cores=2)  # round(2 - (2.5 - 1)) = 0 cores free (1: the command's own thread)
    assert main(["bench", *TINY, "--threads", "2"]) == 0
    err = capsys.readouterr().err
    assert err.count("OpenMP threads will wait on each other") == 1 and "--threads 1 times with one" in err
    out = tmp_path / "b.json"
    assert main(["bench", *TINY, "--threads", "1", "--json", str(out)]) == 0  # never for one thread
    cap = capsys.readouterr()
    assert "OpenMP" not in cap.err
    assert json.loads(out.read_text())[0]["load"]["peak"] == 2.5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return text_checkpoint(tmp_path_factory.mktemp("load"))


def test_tune_names_the_contended_stage_and_records_both(machine, ckpt, tmp_path, capsys, monkeypatch):
    """Stage 1 (the step costs) timed under other work, stage 2 (end to end) on an idle box: the line names stage 1
    alone, and the JSON keeps the run's window and each stage's."""
    import snlp.bench.tune as tune

    machine(6.0, cores=2)
    real = tune.measure_costs

    def measure_then_idle(*a, **k):  # stage 1's last timing: the other work ends with it
        costs = real(*a, **k)
        machine(0.3, cores=2)
        return costs

    monkeypatch.setattr(tune, "measure_costs", measure_then_idle)
    path, data, cache = ckpt
    out = tmp_path / "tune.json"
    assert main(["tune", str(path), "--data", str(data), "--cache-dir", str(cache), "--plans", "2xF1-h0-K1",
                 "--blocks", "2", "--threads", "1", "--calib-tokens", "64", "--seq-len", "32", "--prompts", "1",
                 "--prompt-len", "6", "--gen-tokens", "4", "--repeats", "1", "--step-runs", "2",
                 "--accept-tokens", "0", "--no-progress", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("timings contended") == 1 and "stage 1: timings contended" in text
    d = json.loads(out.read_text())
    assert d["load"]["peak"] == 6.0 and d["load"]["cores"] == 2 and set(d["load"]) == {"start", "end", "peak", "cores"}
    assert d["load_stages"]["stage1"]["start"] == 6.0 and d["load_stages"]["stage2"]["end"] == 0.3


def test_eval_says_a_contended_timing_and_records_it(machine, ckpt, tmp_path, capsys):
    from snlp.eval.protocol import EvalRecord

    machine(4.0, cores=2)
    path, data, cache = ckpt
    out = tmp_path / "eval.json"
    assert main(["eval", str(path), "--data", str(data), "--cache-dir", str(cache), "--plans", "2xF1-h0-K1",
                 "--seq-len", "16", "--max-tokens", "32", "--prompts", "1", "--prompt-len", "4", "--gen-tokens", "2",
                 "--warmup", "0", "--runs", "1", "--time-tokens", "2", "--no-emb", "--threads", "1", "--no-progress",
                 "--json", str(out), "--csv", str(tmp_path / "eval.csv")]) == 0
    assert "timings contended: the 1-min load average reached 4.00" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert all(r["load"]["peak"] == 4.0 for r in rows)
    # the CSV's nested cells are JSON, as bench's CSV writes them (the load cell was a dict's Python repr)
    cells = list(csv.DictReader((tmp_path / "eval.csv").open()))
    assert [json.loads(c["load"]) for c in cells] == [r["load"] for r in rows]
    assert [json.loads(c["window_ce"]) for c in cells] == [r["window_ce"] for r in rows]
    assert EvalRecord.from_dict(rows[1]).plan == "2xF1-h0-K1"  # the run's window is not a record field


def test_generate_baseline_says_its_threads_oversubscribe_and_records_its_window(machine, ckpt, tmp_path, capsys):
    machine(2.5, cores=2)  # no core free for a second thread
    path, _, _ = ckpt
    out = tmp_path / "gen.json"
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["generate", str(path), "--prompt", "First", "--mode", "speculative", "--plan", "2xF1-h0-K1",
                     "--max-new-tokens", "4", "--repeats", "1", "--quiet", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(n)
    cap = capsys.readouterr()
    assert "OpenMP threads will wait on each other" in cap.err and "--threads" not in cap.err  # generate has none
    assert cap.out.count("timings contended") == 1  # 2.5 on 2 cores, 0.5 past its own 2 threads
    assert json.loads(out.read_text())["load"] == {"start": 2.5, "end": 2.5, "peak": 2.5, "cores": 2}


def test_generate_baseline_says_a_contended_timing_once(machine, ckpt, capsys):
    path, _, _ = ckpt
    machine(3.5, cores=2)
    assert main(["generate", str(path), "--prompt", "First", "--mode", "speculative", "--plan", "2xF1-h0-K1",
                 "--max-new-tokens", "4", "--repeats", "1", "--quiet"]) == 0
    assert capsys.readouterr().out.count("timings contended: the 1-min load average reached 3.50 on 2 cores") == 1


def test_the_decode_suite_markdown_says_a_contended_run():
    from snlp.bench.decode_suite import DecodeSuiteConfig, DecodeSuiteMeta, DecodeSuiteResult, markdown

    def md(load):
        meta = DecodeSuiteMeta(device="cpu", device_type="cpu", torch="t", cuda=None, transformers="x",
                               dtype="float32", date="d", command=None, platform="p", threads=1, model="m", n_layer=6,
                               n_embd=64, prompts="random ids", prompt_len=16, new_tokens=8, load=load)
        return markdown(DecodeSuiteResult(config=DecodeSuiteConfig(quick=True, warmup=1, rounds=5), meta=meta, rows=[],
                                           complete=True))

    assert "timings contended: the 1-min load average reached 4.00 on 2 cores" in md(
        {"start": 1.0, "end": 2.0, "peak": 4.0, "cores": 2})
    assert "timings contended" not in md({"start": 0.5, "end": 1.2, "peak": 1.2, "cores": 2})
    assert "timings contended" not in md(None)  # a file written before the suite recorded its load

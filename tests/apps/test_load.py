"""The load around a command's timings (snlp.runtime.load): the contention sentence where the 1-min load average is
more than the cores and more than the command's own threads explain, the window in every timed command's JSON, the
line said before timing where the torch threads exceed the cores left free, and the four records that read the
load before (speedrun stages, the analysis report, the paper suite, the distributed bench rows) keeping their
fields' types. The load source is monkeypatched (os.getloadavg, the affinity, the cgroup quota): no real load."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

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
    """set(loads, cores, cpus): os.getloadavg returns each of `loads` in turn (the last one from then on; None: the
    platform has none), the process may use `cores` cores (no cgroup quota) of the machine's `cpus` (default: as
    many as the cores)."""
    monkeypatch.setattr(load, "CPU_MAX", str(tmp_path / "no-cpu.max"))
    monkeypatch.setattr(load, "CFS", (str(tmp_path / "no-quota"), str(tmp_path / "no-period")))

    def apply(loads, cores: int = 2, cpus: int | None = None):
        monkeypatch.setattr(load, "machine_cpus", lambda: cores if cpus is None else cpus)
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
    assert w == LoadWindow(start=5.0, end=5.0, peak=5.0, cores=2, machine_cpus=2)
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
    machine(2.2, cores=2)  # 2.2 - 1 (the command's own thread) = 1.2 of other work takes one core: one left free
    w = LoadWindow.begin()
    line = oversubscription_note(2, w)
    assert line and line.startswith("about to time with 2 torch threads: 1-min load average 2.20 on 2 cores, 1 free ")
    assert "OpenMP threads will wait on each other" in line
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
    assert rows and all(r["load"] == {"start": 5.0, "end": 5.0, "peak": 5.0, "cores": 2, "machine_cpus": 2}
                        for r in rows)
    assert "load" in csv.read_text().splitlines()[0].split(",")


def test_bench_says_once_before_timing_that_its_threads_oversubscribe(machine, tmp_path, capsys):
    machine(2.5, cores=2)  # 2.5 - 1 (the command's own thread) = 1.5 of other work takes both cores
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
    alone, and the JSON keeps the run's window and each stage's, each with the machine's CPUs (stage 1's window is
    built from the run's: it once dropped them, and its line the clause saying the average counts all 8)."""
    import snlp.bench.tune as tune

    machine(6.0, cores=2, cpus=8)
    real = tune.measure_costs

    def measure_then_idle(*a, **k):  # stage 1's last timing: the other work ends with it
        costs = real(*a, **k)
        machine(0.3, cores=2, cpus=8)
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
    assert "6.00 on 2 cores (the load average counts the whole machine's 8 CPUs)" in text
    d = json.loads(out.read_text())
    assert {w["machine_cpus"] for w in (d["load"], *d["load_stages"].values())} == {8}
    assert d["load"]["peak"] == 6.0 and d["load"]["cores"] == 2
    assert set(d["load"]) == {"start", "end", "peak", "cores", "machine_cpus"}
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
    assert json.loads(out.read_text())["load"] == {"start": 2.5, "end": 2.5, "peak": 2.5, "cores": 2,
                                                   "machine_cpus": 2}


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


@pytest.mark.parametrize("start, free", [(1.49, 4), (1.5, 3), (2.49, 3), (2.5, 2), (3.5, 1), (5.6, 0)])
def test_other_work_takes_whole_cores_from_half_a_core_on(machine, start, free):
    """On 4 cores, the load less the command's own thread (CALLER) is the other work; from SLACK = 0.5 of a core on
    it takes the core (rounded half up, never half to even: round(4 - 0.5) == 4 and round(4 - 1.5) == 2 had 0.5 of
    other work take no core and 1.5 take two)."""
    machine(start, cores=4)
    w = LoadWindow.begin()
    assert load.free_cores(w) == free
    line = oversubscription_note(4, w)
    assert (line is None) == (free >= 4)
    if line:  # what it read, so a reader can judge the rule
        assert f"4 torch threads: 1-min load average {start:.2f} on 4 cores, {free} free (other work: the load less 1 " \
               f"for this command's own thread, rounded half up to whole cores)" in line


def test_a_machine_larger_than_the_process_is_said_and_recorded(machine):
    """The load average counts every CPU of the machine; a process given 2 of its 64 says so in one clause and the
    window keeps the machine's count."""
    machine(5.0, cores=2, cpus=64)
    w = LoadWindow.begin().close()
    assert w.to_json() == {"start": 5.0, "end": 5.0, "peak": 5.0, "cores": 2, "machine_cpus": 64}
    clause = "(the load average counts the whole machine's 64 CPUs)"
    assert f"reached 5.00 on 2 cores {clause}, 3.0 more than" in w.note(own=2)
    assert f"on 2 cores {clause}, 0 free" in oversubscription_note(2, w)
    machine(5.0, cores=2)  # the whole machine is the process's: nothing to add
    w = LoadWindow.begin().close()
    assert "whole machine" not in w.note(own=2) and "whole machine" not in oversubscription_note(2, w)
    assert LoadWindow(start=1.0, cores=2) == LoadWindow(**{"start": 1.0, "cores": 2})  # a window read from an older
    # file (no machine_cpus) says no clause
    assert load.machine_clause(LoadWindow(start=1.0, cores=2)) == ""


def test_the_ranks_of_a_torchrun_job_on_this_machine_are_its_own_threads(machine):
    """Under torchrun the ranks time together: their threads on this host add up (ranks on another host load
    another machine), and the ranks' own loading is subtracted once per rank before timing."""
    assert load.ranks_threads([("a", 2), ("a", 2), ("b", 8)], "a") == (4, 2)
    assert load.ranks_threads([("a", 1)], "a") == (1, 1)
    machine(3.0, cores=4)  # 3.0 - 2 ranks' own threads = 1.0 of other work: one core taken, 3 free for 4 threads
    line = oversubscription_note(4, LoadWindow.begin(), ranks=2)
    assert line and line.startswith("about to time with 4 torch threads over 2 ranks: 1-min load average 3.00 on 4 "
                                    "cores, 3 free (other work: the load less 2 for this command's own ranks")
    machine(2.4, cores=4)  # 0.4 of other work: the 4 cores free
    assert oversubscription_note(4, LoadWindow.begin(), ranks=2) is None


def test_the_train_suite_says_a_contended_window_and_records_it(machine, tmp_path, capsys):
    machine(5.0, cores=2)
    out = tmp_path / "train"
    assert main(["bench", "--suite", "train", "--quick", "--treatments", "eager", "--regs", "none", "--threads", "1",
                 "--train-steps", "1", "--train-warmup", "0", "--train-batch", "1", "--train-seq-len", "8",
                 "--device", "cpu", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("timings contended: the 1-min load average reached 5.00 on 2 cores") == 1
    data = json.loads((out / "train.json").read_text())
    assert data["meta"]["load"] == {"start": 5.0, "end": 5.0, "peak": 5.0, "cores": 2, "machine_cpus": 2}
    assert "timings contended" in (out / "train.md").read_text()
    machine(0.3, cores=2)
    assert main(["bench", "--suite", "train", "--quick", "--treatments", "eager", "--regs", "none", "--threads", "1",
                 "--train-steps", "1", "--train-warmup", "0", "--train-batch", "1", "--train-seq-len", "8",
                 "--device", "cpu", "--out", str(out)]) == 0
    assert "timings contended" not in capsys.readouterr().out


def test_the_train_suite_says_before_timing_that_its_threads_oversubscribe(machine, tmp_path, capsys):
    machine(2.5, cores=2)
    assert main(["bench", "--suite", "train", "--quick", "--treatments", "eager", "--regs", "none", "--threads", "2",
                 "--train-steps", "1", "--train-warmup", "0", "--train-batch", "1", "--train-seq-len", "8",
                 "--device", "cpu", "--out", str(tmp_path / "t")]) == 0
    err = capsys.readouterr().err
    assert err.count("OpenMP threads will wait on each other") == 1 and "--threads 1 times with one" in err


def test_selfcheck_says_a_contended_speed_suite_and_records_its_window(machine, tmp_path, capsys, monkeypatch):
    """The window holds the speed suite alone (the laws before it are not timed): other work that starts during the
    timings is said once under the speed rows and kept in selfcheck.json."""
    import snlp.bench.selfcheck as sc

    machine([0.2, 6.0], cores=2)  # idle when the timings begin, other work by their end
    monkeypatch.setattr(sc, "law_checks", lambda *a, **k: [sc.Check("laws", True, "stubbed: not what is tested", 0.0)])
    monkeypatch.setattr(sc, "speed_suite", lambda *a, **k: ([], [], []))  # its timings: snlp bench's own tests
    torch_threads = __import__("torch").get_num_threads()
    assert main(["selfcheck", "--device", "cpu", "--quick", "--compile", "off", "--out", str(tmp_path / "sc")]) == 0
    text = capsys.readouterr().out
    assert text.count("timings contended: the 1-min load average reached 6.00 on 2 cores") == 1
    data = json.loads((tmp_path / "sc" / "selfcheck.json").read_text())
    assert data["load"] == {"start": 0.2, "end": 6.0, "peak": 6.0, "cores": 2, "machine_cpus": 2}
    assert data["threads"] == torch_threads


def test_train_time_reg_says_a_contended_window_and_records_it(machine, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text((Path(__file__).resolve().parents[1] / "data/tinyshakespeare-head.txt").read_text()[:20_000])
    machine(5.0, cores=2)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--data", str(corpus), "--cache-dir", str(tmp_path / "cache"),
                 "--depth", "2", "--width", "32", "--head-dim", "16", "--vocab-size", "300", "--seq-len", "16",
                 "--batch-size", "2", "--eval-every", "100", "--eval-batches", "1", "--no-progress", "--device", "cpu",
                 "--steps", "2", "--reg", "idn", "--reg-n", "1", "--time-reg", "2"]) == 0
    text = capsys.readouterr().out
    assert text.count("--time-reg: timings contended: the 1-min load average reached 5.00 on 2 cores") == 1
    speed = json.loads((out / "train_summary.json").read_text())["speed"]
    assert speed["load"] == {"start": 5.0, "end": 5.0, "peak": 5.0, "cores": 2, "machine_cpus": 2}
    assert speed["load_threads"] == __import__("torch").get_num_threads()  # one process: its own threads


def test_distributed_bench_says_a_contended_window_and_records_it(machine, tmp_path, capsys, monkeypatch):
    """`snlp bench --distributed` as one rank (torchrun's environment set by hand): its own line and `load`, beside
    the rows' loadavg strings it always carried."""
    from conftest import free_port

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    machine(5.0, cores=2)
    out = tmp_path / "d.json"
    assert main(["bench", "--distributed", *TINY, "--device", "cpu", "--threads", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("timings contended: the 1-min load average reached 5.00 on 2 cores") == 1
    rows = json.loads(out.read_text())
    assert rows and all(r["load"] == {"start": 5.0, "end": 5.0, "peak": 5.0, "cores": 2, "machine_cpus": 2}
                        and r["loadavg"] == ["5.00", "5.00", "5.00"] for r in rows)


def test_the_paper_suite_records_its_window_sampled_between_parts(machine, tmp_path, capsys, monkeypatch):
    """Other work during the prefill part only: the sample after it holds the peak that the start and the end both
    miss."""
    import snlp.bench.suite as suite

    machine(0.4, cores=2)
    real = suite.benchmark

    def prefill_under_other_work(*a, **k):
        rows = real(*a, **k)
        machine([6.0, 0.5], cores=2)  # read after the part, then at the end
        return rows

    monkeypatch.setattr(suite, "benchmark", prefill_under_other_work)
    out = tmp_path / "suite"
    assert main(["bench", "--suite", "paper", "--quick", "--shapes", "0.5B-nox0ve", "--treatments", "eager",
                 "--no-decode", "--suite-runs", "1", "--suite-warmup", "0", "--threads", "1", "--device", "cpu",
                 "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("timings contended: the 1-min load average reached 6.00 on 2 cores") == 1
    meta = json.loads((out / "suite.json").read_text())["meta"]
    assert meta["load"] == {"start": 0.4, "end": 0.5, "peak": 6.0, "cores": 2, "machine_cpus": 2}
    assert (meta["loadavg_1min_start"], meta["loadavg_1min_end"], meta["cores"]) == (0.4, 0.5, 2)


def test_distributed_bench_with_pin_counts_the_cores_before_pinning(machine, tmp_path, capsys, monkeypatch):
    """--pin narrows each rank to one core after the job's cores were read: the window keeps the job's count (an
    int), not the affinity list the pinning picked its core from (which made free_cores subtract from a list)."""
    from conftest import free_port

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    pinned = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: pinned.append(set(cpus)), raising=False)
    machine(5.0, cores=2)
    out = tmp_path / "d.json"
    assert main(["bench", "--distributed", "--pin", *TINY, "--device", "cpu", "--json", str(out)]) == 0
    assert pinned == [{0}]  # local rank 0 -> core 0
    assert capsys.readouterr().out.count("timings contended: the 1-min load average reached 5.00 on 2 cores") == 1
    rows = json.loads(out.read_text())
    assert rows and all(r["load"]["cores"] == 2 and r["pinned"] for r in rows)


def test_train_time_reg_does_not_warn_about_its_own_training(machine, tmp_path, capsys):
    """--time-reg times right after the training loop, whose threads fill the 1-min average (n threads for t s read
    n(1 - exp(-t/60)): 2 threads for 2 min on an idle 2-core box read 1.73): the load less those threads is the
    other work, not the load less one thread per rank, which left 'one free core' for 2 threads on an idle box."""
    import torch

    corpus = tmp_path / "c.txt"
    corpus.write_text((Path(__file__).resolve().parents[1] / "data/tinyshakespeare-head.txt").read_text()[:20_000])
    machine(2.0, cores=2)  # an idle 2-core box after minutes of 2-thread training
    torch.set_num_threads(2)  # the one_thread fixture restores the count
    assert main(["train", "--out", str(tmp_path / "run"), "--data", str(corpus), "--cache-dir", str(tmp_path / "cache"),
                 "--depth", "2", "--width", "32", "--head-dim", "16", "--vocab-size", "300", "--seq-len", "16",
                 "--batch-size", "2", "--eval-every", "100", "--eval-batches", "1", "--no-progress", "--device", "cpu",
                 "--steps", "2", "--reg", "idn", "--reg-n", "1", "--time-reg", "2"]) == 0
    cap = capsys.readouterr()
    assert "OpenMP threads will wait" not in cap.err and "timings contended" not in cap.out
    # one more core's worth of other work than the training's own threads: said, with what was subtracted
    machine(3.0, cores=2)
    line = oversubscription_note(2, LoadWindow.begin(), remedy=None, busy=2)
    assert line and "3.00 on 2 cores, 1 free (other work: the load less 2 for this command's own busy threads" in line
    assert load.free_cores(LoadWindow.begin(), busy=2) == 1 and load.free_cores(LoadWindow.begin()) == 0


def test_eval_drafter_quality_rows_alone_say_no_timing_sentence(machine, ckpt, tmp_path, capsys):
    """`snlp eval --drafter` without --chat-prompts times nothing (its rows are PPL / Top-1 / LogitSim only), yet on a
    loaded box it said its threads would make "the timings collapse" and that "these times are slower and noisier":
    neither is said now. With --chat-prompts (the SSD rows' tok/s are timed) both still are."""
    from snlp.io.checkpoint import load
    from snlp.io.drafter import save_drafter
    from snlp.method.drafter import make_drafter

    machine(4.0, cores=2)
    path, data, cache = ckpt
    model, _ = load(path)
    save_drafter(tmp_path / "d", make_drafter(model, "2xF1-h0-K1"))
    argv = ["eval", str(path), "--drafter", str(tmp_path / "d"), "--data", str(data), "--cache-dir", str(cache),
            "--seq-len", "16", "--max-tokens", "32", "--threads", "2", "--no-progress"]
    assert main(argv) == 0
    got = capsys.readouterr()
    assert "timings" not in got.out + got.err and "| post-hoc |" in got.out
    # nor that it decoded "0 chat prompts x 64 tokens" (--gen-tokens is refused without --chat-prompts)
    assert "chat prompts x" not in got.out and "no chat prompts (no SSD rows)" in got.out


def test_eval_drafter_ssd_rows_say_a_contended_timing(machine, ckpt, tmp_path, capsys):
    """The counterpart of the test above: --drafter's SSD rows are timed, so a loaded box is said (the sentence's
    gate is the prompts, not the mode)."""
    import json as _json

    from snlp.io.checkpoint import load
    from snlp.io.drafter import save_drafter
    from snlp.method.drafter import make_drafter

    machine(4.0, cores=2)
    path, data, cache = ckpt
    model, tok = load(path)
    save_drafter(tmp_path / "d", make_drafter(model, "2xF1-h0-K1"))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(_json.dumps({"messages": [{"role": "user", "content": f"First {i}"},
                                                       {"role": "assistant", "content": "All:"}]}) + "\n"
                             for i in range(40)))
    argv = ["eval", str(path), "--drafter", str(tmp_path / "d"), "--data", str(data), "--cache-dir", str(cache),
            "--seq-len", "16", "--max-tokens", "32", "--threads", "2", "--no-progress", "--chat-prompts",
            f"chat:{chats}", "--prompts", "1", "--gen-tokens", "2", "--blocks", "2", "--warmup", "0"]
    assert main(argv) == 0
    got = capsys.readouterr()
    assert "timings contended" in got.out and "timings collapse" in got.err

"""`snlp eval` cut short keeps the phases it finished: --json and --markdown are rewritten after the teacher-forced
phase and after AR Match / EmbSim, marked partial ({"complete": false, ...} and a PARTIAL line), and Ctrl-C ends it
with status 130 and one line naming what was kept and where. The finished file is the list of records, as before.
The cut is a KeyboardInterrupt raised where the timing phase starts (what Ctrl-C raises there)."""

from __future__ import annotations

import json

import pytest
from conftest import text_checkpoint

from snlp.apps.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return text_checkpoint(tmp_path_factory.mktemp("evalpartial"))


def _args(ckpt, tmp_path):
    path, data, cache = ckpt
    return ["eval", str(path), "--data", str(data), "--cache-dir", str(cache), "--plans", "2xF1-h0-K1,2xF1-h0-K2",
            "--seq-len", "32", "--max-tokens", "64", "--prompts", "2", "--prompt-len", "6", "--gen-tokens", "4",
            "--runs", "1", "--warmup", "0", "--time-tokens", "2", "--no-emb", "--no-progress", "--threads", "1",
            "--json", str(tmp_path / "e.json"), "--markdown", str(tmp_path / "e.md")]


def test_eval_cut_in_the_timing_keeps_the_quality_columns_marked_partial(ckpt, tmp_path, monkeypatch, capsys):
    import snlp.eval.protocol as protocol

    def cut(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(protocol, "time_plans", cut)
    assert main(_args(ckpt, tmp_path)) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    # --no-emb: the EmbSim column is empty, so the line does not claim it was kept
    assert line.startswith("snlp eval: interrupted; kept every row's PPL, dPPL, Top-1, LogitSim and AR Match "
                           f"in {tmp_path / 'e.json'} and {tmp_path / 'e.md'}"), line
    data = json.loads((tmp_path / "e.json").read_text())
    assert data["complete"] is False and [r["plan"] for r in data["records"]] == ["sequential", "2xF1-h0-K1",
                                                                                    "2xF1-h0-K2"]
    for r in data["records"]:
        assert r["ppl"] > 1 and r["ar_match"] is not None and r["speedup"] is None and r["latency_ms"] is None
    assert (tmp_path / "e.md").read_text().startswith("**PARTIAL**")


def test_a_finished_eval_writes_the_list_of_records_as_before(ckpt, tmp_path, monkeypatch):
    import snlp.eval.protocol as protocol

    phases = []
    real = protocol.evaluate

    def spy(*a, on_phase=None, **k):  # the partial files were written on the way
        def seen(records, done):
            phases.append((done, json.loads((tmp_path / "e.json").read_text()) if phases else None))
            on_phase(records, done)
        return real(*a, on_phase=seen, **k)

    monkeypatch.setattr(protocol, "evaluate", spy)
    assert main(_args(ckpt, tmp_path)) == 0
    records = json.loads((tmp_path / "e.json").read_text())
    assert isinstance(records, list) and all(r["speedup"] is not None for r in records)
    assert "PARTIAL" not in (tmp_path / "e.md").read_text()
    assert [d for d, _ in phases] == ["PPL, dPPL, Top-1 and LogitSim", "PPL, dPPL, Top-1, LogitSim and AR Match"]
    assert phases[1][1]["complete"] is False and all(r["ar_match"] is None for r in phases[1][1]["records"])


@pytest.mark.parametrize("scoring, predict", [("letter", "predict_letter"), ("harness", None)])
def test_eval_task_cut_short_keeps_the_methods_scored(scoring, predict, ckpt, tmp_path, monkeypatch, capsys):
    """--task scores each method alone: a run cut short (Ctrl-C as the second method starts) keeps the first's
    accuracy in --json and --markdown, marked partial; the finished JSON says "complete": true."""
    from pathlib import Path

    import snlp.eval.mc_eval as mc_eval
    import snlp.eval.mc_harness as mc_harness

    arc = Path(__file__).resolve().parents[1] / "data" / "arc" / "ARC-Easy-Test-head.jsonl"
    argv = ["eval", str(ckpt[0]), "--task", f"mc:{arc}", "--mc-limit", "3", "--mc-scoring", scoring, "--plans",
            "2xF1-h0-K1", "--threads", "1", "--json", str(tmp_path / "mc.json"), "--markdown", str(tmp_path / "mc.md")]
    assert main(argv) == 0
    assert json.loads((tmp_path / "mc.json").read_text())["complete"] is True
    mod, name = (mc_eval, predict) if predict else (mc_harness, "harness_record")
    real, calls = getattr(mod, name), []

    def cut_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(mod, name, cut_second)
    assert main(argv) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("snlp eval: interrupted; kept the accuracy of sequential in "), line
    data = json.loads((tmp_path / "mc.json").read_text())
    assert data["complete"] is False and [r["method"] for r in data["records"]] == ["sequential"]
    assert "**PARTIAL**" in (tmp_path / "mc.md").read_text()


def test_ctrl_c_while_the_plot_is_drawn_names_the_finished_files_as_finished(ckpt, tmp_path, monkeypatch, capsys):
    """--plot is drawn last, after the finished --json and --markdown (matplotlib takes seconds): a Ctrl-C there said
    the files were kept 'marked partial ("complete": false)' while they were the finished results."""
    import snlp.eval.present as present

    real = present.frontier_plot

    def cut(*a, announce=True, **k):  # the finished plot only (the partial ones are drawn as the phases end)
        if announce:
            raise KeyboardInterrupt
        return real(*a, announce=announce, **k)

    monkeypatch.setattr(present, "frontier_plot", cut)
    assert main(_args(ckpt, tmp_path) + ["--plot", str(tmp_path / "e.png")]) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (f"snlp eval: interrupted; kept the finished results in {tmp_path / 'e.json'} and "
                    f"{tmp_path / 'e.md'} ({tmp_path / 'e.png'} still marked partial)")
    assert isinstance(json.loads((tmp_path / "e.json").read_text()), list)
    assert "PARTIAL" not in (tmp_path / "e.md").read_text()


def test_eval_cut_in_the_timing_keeps_the_csv_and_the_plot_marked_partial(ckpt, tmp_path, monkeypatch, capsys):
    """--csv and --plot were written only at the end: a run cut in the timing kept the JSON and the markdown but lost
    them. They are rewritten with the others after each phase: the CSV under a '# PARTIAL' comment line that
    pandas.read_csv(comment="#") skips (a reader that does not skip it gets it as the header, so no column of the
    finished file's is there to be mistaken for data), the plot with PARTIAL in its title; the finished CSV has no
    such line."""
    import csv

    import pandas as pd

    import snlp.eval.present as present
    import snlp.eval.protocol as protocol

    titles = []
    real_plot, real_time = present.frontier_plot, protocol.time_plans

    def spy(groups, path, title="", **k):
        titles.append(title)
        return real_plot(groups, path, title=title, **k)

    def cut(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(present, "frontier_plot", spy)
    monkeypatch.setattr(protocol, "time_plans", cut)
    extra = ["--csv", str(tmp_path / "e.csv"), "--plot", str(tmp_path / "e.png")]
    assert main(_args(ckpt, tmp_path) + extra) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(tmp_path / "e.csv") in line and str(tmp_path / "e.png") in line and "marked partial" in line, line
    text = (tmp_path / "e.csv").read_text()
    assert text.startswith("# PARTIAL: ") and text.count("# PARTIAL") == 1
    rows = pd.read_csv(tmp_path / "e.csv", comment="#")
    assert list(rows["plan"]) == ["sequential", "2xF1-h0-K1", "2xF1-h0-K2"] and rows["speedup"].isna().all()
    assert "plan" not in next(csv.reader(text.splitlines()))  # unskipped, the comment is the header
    kept = json.loads((tmp_path / "e.json").read_text())["records"]
    assert list(rows["ppl"]) == pytest.approx([r["ppl"] for r in kept])
    assert (tmp_path / "e.png").read_bytes().startswith(b"\x89PNG")
    assert titles and all("PARTIAL" in t for t in titles), titles

    monkeypatch.setattr(protocol, "time_plans", real_time)
    titles.clear()
    assert main(_args(ckpt, tmp_path) + extra) == 0
    finished = pd.read_csv(tmp_path / "e.csv")  # no comment line: read as any CSV
    assert not (tmp_path / "e.csv").read_text().startswith("#") and finished["speedup"].notna().all()
    assert "PARTIAL" not in titles[-1] and all("PARTIAL" in t for t in titles[:-1])


def test_a_signal_after_every_file_was_written_ends_eval_with_status_0(ckpt, tmp_path, monkeypatch, capsys):
    """A SIGTERM after the last file was written (while the output locks are released) ended the command with 143,
    so a requeue script ran the finished evaluation again. It says the run had finished and exits 0; one before the
    last file was written keeps 143."""
    import os
    import signal

    import snlp.apps.eval as eval_app
    import snlp.eval.present as present

    real_run = eval_app.run

    def run_then_signal(args):
        rc = real_run(args)
        os.kill(os.getpid(), signal.SIGTERM)
        return rc

    monkeypatch.setattr(eval_app, "run", run_then_signal)
    files = [tmp_path / f for f in ("e.json", "e.csv", "e.md", "e.png")]
    assert main(_args(ckpt, tmp_path) + ["--csv", str(files[1]), "--plot", str(files[3])]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (f"snlp eval: SIGTERM arrived after the run had finished: {' and '.join(map(str, files))} hold its "
                    f"complete results; nothing to rerun")

    monkeypatch.setattr(eval_app, "run", real_run)
    real_md = present.markdown_table

    def timed_then_signal(records, **k):  # the finished table (its rows timed): after the JSON, before the markdown
        if records[-1].speedup is not None:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_md(records, **k)

    monkeypatch.setattr(present, "markdown_table", timed_then_signal)
    assert main(_args(ckpt, tmp_path)) == 128 + signal.SIGTERM
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (f"snlp eval: interrupted by SIGTERM; kept the finished results in {files[0]} ({files[2]} still "
                    f"marked partial)")


def test_a_partial_csv_written_alone_names_no_json(ckpt, tmp_path, monkeypatch):
    """The CSV's PARTIAL line said 'the JSON says "complete": false' on a run that wrote no JSON (--csv alone): it
    names the finished CSV instead, and snlp.bench.records.marked_partial tells the partial file from the finished."""
    import snlp.eval.protocol as protocol
    from snlp.bench.records import marked_partial

    def cut(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(protocol, "time_plans", cut)
    argv = [a for a in _args(ckpt, tmp_path)]
    argv = argv[:argv.index("--json")] + ["--csv", str(tmp_path / "e.csv")]
    assert main(argv) == 130
    first = (tmp_path / "e.csv").read_text().splitlines()[0]
    assert first == ("# PARTIAL: written while the run was going (or it was cut short there): PPL, dPPL, Top-1, LogitSim "
                     "and AR Match; the finished CSV has no such line")
    assert marked_partial(tmp_path / "e.csv")
    monkeypatch.undo()
    assert main(argv) == 0 and not marked_partial(tmp_path / "e.csv")

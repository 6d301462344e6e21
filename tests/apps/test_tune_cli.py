"""`snlp tune` on a real checkpoint (save_checkpoint + a tokenizer trained on a small corpus): the printed table
and pick, the JSON, and bad flags refused with exit status 2 before any work."""

from __future__ import annotations

import json

import pytest
from conftest import text_checkpoint

from snlp.apps.cli import main
from snlp.apps.tune import parse_budget

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return text_checkpoint(tmp_path_factory.mktemp("tune"))


def _args(ckpt, *extra):
    path, data, cache = ckpt
    return ["tune", str(path), "--data", str(data), "--cache-dir", str(cache), "--plans", "2xF1-h0-K1,2xF1-fwd-K1",
            "--blocks", "2,3", "--threads", "1", "--calib-tokens", "64", "--seq-len", "32", "--prompts", "2",
            "--prompt-len", "6", "--gen-tokens", "8", "--repeats", "1", "--step-runs", "3", "--accept-tokens", "12", "--no-progress", *extra]


def test_tune_prints_the_table_and_pick_and_writes_json(ckpt, tmp_path, capsys):
    out = tmp_path / "tune.json"
    assert main(_args(ckpt, "--max-dppl", "50%", "--top", "2", "--json", str(out))) == 0
    text = capsys.readouterr().out
    assert "ssd pick:" in text and "| > " in text and "pred x" in text and "meas x" in text
    d = json.loads(out.read_text())
    assert d["complete"] is True and d["config"]["max_dppl"] == 0.5 and d["config"]["threads"] == [1]
    assert {c["goal"] for c in d["candidates"]} == {"ssd", "snlp"}
    ssd = [c for c in d["candidates"] if c["goal"] == "ssd" and c["measured"]]
    assert ssd and all(c["matches_sequential"] for c in ssd)
    # one timed round: no noise estimate, so the shortlist ties; the best stage-1 prediction picks where it clears
    # the others by more than PREDICTION_TIE, else the highest measured median among those within it
    from snlp.bench.tune import PREDICTION_TIE

    tied = [c for c in ssd if c["shortlisted"]]
    top = max(c["predicted_tokens_per_s"] for c in tied)
    short = sorted((c for c in tied if c["predicted_tokens_per_s"] >= (1 - PREDICTION_TIE) * top),
                   key=lambda c: (-c["tokens_per_s"], c["plan"], c["block"]))
    assert d["picks"]["ssd"] == short[0] and "one timed round" in d["pick_rule"]["ssd"] and "tie: " in text
    # no --full-grid: the shortlist's validation did not run, and neither the JSON nor the text claims it did
    assert d["grid_best"] is None and d["pick_vs_best"] is None
    assert "full-grid validation: not run" in text and "pick / best" not in text


def test_tune_cut_in_stage_2_keeps_stage_1_marked_partial(ckpt, tmp_path, capsys, monkeypatch):
    """Ctrl-C (or a kill) in stage 2 lost the minutes of stage 1: --json now holds its predictions and shortlist,
    marked partial, with no pick (the pick is the best measured candidate), and the last line says so."""
    import snlp.bench.tune as tune

    def cut(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune, "measure_ssd", cut)
    out = tmp_path / "tune.json"
    assert main(_args(ckpt, "--json", str(out))) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("snlp tune: interrupted; kept stage 1 (") and str(out) in line, line
    d = json.loads(out.read_text())
    assert d["complete"] is False and "picks" not in d and d["quality"] and d["costs"]
    assert any(c["shortlisted"] for c in d["candidates"]) and not any(c["measured"] for c in d["candidates"])


@pytest.mark.parametrize("extra, msg", [
    (["--max-dppl", "1"], "ambiguous"), (["--max-dppl", "x%"], "percentage"), (["--max-dppl=-1%"], ">= 0"),
    (["--blocks", "0"], "blocks"), (["--blocks", "a"], "integers"), (["--threads", "0"], "threads"),
    (["--plans", "7xF1-h0-K1"], "7"), (["--no-ssd"], "nothing to tune"),
])
def test_bad_flags_exit_2_with_a_message(ckpt, capsys, extra, msg):
    args = _args(ckpt)
    if extra[0] == "--plans":
        args[args.index("--plans") + 1] = extra[1]
        extra = []
    assert main(args + extra) == 2
    assert msg in capsys.readouterr().err


def test_budget_parsing():
    assert parse_budget("1%") == pytest.approx(0.01) and parse_budget("0.01") == 0.01 and parse_budget(None) is None
    assert parse_budget("0%") == 0.0


def test_a_sigterm_after_tune_wrote_its_finished_json_does_not_say_partial(ckpt, tmp_path, capsys, monkeypatch):
    """A SIGTERM after the last --json write (the pick written, "complete": true) said the file kept stage 1 "marked
    partial", the line of a run cut in stage 2, and exited 143, so a requeue script tuned again. It says the run had
    finished and exits 0."""
    import os
    import signal

    import snlp.bench.records as records

    real = records.write_json

    def write_then_signal(path, payload, *a, **k):
        real(path, payload, *a, **k)
        if payload.get("complete") is True:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(records, "write_json", write_then_signal)
    out = tmp_path / "tune.json"
    assert main(_args(ckpt, "--json", str(out))) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert json.loads(out.read_text())["complete"] is True
    assert line == f"snlp tune: SIGTERM arrived after the run had finished: {out} holds its complete results; " \
                   "nothing to rerun", line


def test_tune_of_one_generated_token_prints_and_writes_no_nan(ckpt, tmp_path, capsys):
    """--gen-tokens 1: the prefill gives the only token, so stage 2's SSD runs draft nothing; their alpha and s were
    NaN, printed "nan" in the table and written as bare NaN in --json (not JSON). Now "–" and null."""
    out = tmp_path / "tune.json"
    args = _args(ckpt, "--json", str(out))
    args[args.index("--gen-tokens") + 1] = "1"
    assert main(args) == 0
    assert "nan" not in capsys.readouterr().out

    def refuse(c):
        raise ValueError(f"{c} in the JSON")
    d = json.loads(out.read_text(), parse_constant=refuse)
    ssd = [c for c in d["candidates"] if c["goal"] == "ssd" and c["measured"]]
    assert ssd and all(c["alpha"] is None and c["measured_s"] is None and c["tokens_per_round"] == 1.0 for c in ssd)
    # stage 1's acceptance decodes likewise: --accept-tokens 1 printed "calib alpha nan" and wrote accept_alpha NaN
    args = _args(ckpt, "--json", str(out))
    args[args.index("--accept-tokens") + 1] = "1"
    assert main(args) == 0
    assert "nan" not in capsys.readouterr().out
    d = json.loads(out.read_text(), parse_constant=refuse)
    assert all(a["alpha"] is None for a in d["acceptance"]) and all(c["accept_alpha"] is None for c in d["candidates"])


def test_an_empty_plan_list_is_refused_not_read_as_the_default_grid(ckpt, capsys):
    """`--plans ""` (an unset shell variable) tuned the default grid: `--plans ,` was refused but the empty string was
    read as "not given". It is refused in one line before the checkpoint is read."""
    args = _args(ckpt)
    args[args.index("--plans") + 1] = ""
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("snlp tune: error: no plans given"), err


@pytest.mark.parametrize("flags", [["--blocks", "2"], ["--accept-tokens", "12"], ["--blocks", "2", "--accept-tokens", "12"]])
def test_ssd_settings_under_no_ssd_are_refused_not_ignored(ckpt, capsys, flags):
    """--no-ssd skips the SSD goal, so the draft blocks and the acceptance profile typed beside it were read by
    nothing and the run went on as if they had been honoured; they are refused, naming the flags."""
    path, data, cache = ckpt
    base = ["tune", str(path), "--data", str(data), "--cache-dir", str(cache), "--plans", "2xF1-h0-K1", "--no-ssd",
            "--max-dppl", "50%", "--no-progress"]
    assert main(base + flags) == 2
    err = capsys.readouterr().err
    assert "--no-ssd skips" in err and all(f in err for f in flags if f.startswith("--")), err

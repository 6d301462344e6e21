"""`snlp speedrun --quick` as a newcomer meets it: bad input refused before any work, and the report's provenance and
time figures equal to what the run did."""

from snlp.apps.cli import main

TINY = ["--quick", "--depth", "4", "--steps", "12", "--max-chars", "300000", "--device", "cpu"]


def test_a_training_setting_out_of_range_is_refused_before_any_stage(tmp_path, capsys):
    """--seed -1 passed the speedrun's own checks, ran the tokenizer stage and the probe, then each training process
    refused it (TrainConfig.check) and the command ended in a RuntimeError traceback. Both models' TrainConfig is now
    checked with the flags, one line, nothing written."""
    out = tmp_path / "sr"
    assert main(["speedrun", "--out", str(out), *TINY, "--seed", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--seed must be an integer in [0, 2**63) (got -1)" in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_the_software_line_names_the_checkout_snlp_runs_from():
    """The report's Software line promises "snlp VERSION (git REV)" from a checkout, but the renderer looked for .git
    in the `snlp` package folder itself (its path one level short since it moved under snlp/apps), so every report
    printed the bare version and no run could be traced to its commit. Checked against git run here, in the folder
    that holds the package."""
    import shutil
    import subprocess
    from pathlib import Path

    import pytest

    import snlp
    from snlp.apps.report import environment

    root = Path(snlp.__file__).resolve().parents[1]
    if not (root / ".git").exists() or shutil.which("git") is None:
        pytest.skip("snlp is not imported from a git checkout here")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    assert rev and f"(git {rev}" in environment("cpu")["snlp"]


def test_the_reported_wall_time_counts_the_report_stage(tmp_path, monkeypatch):
    """The wall time report.md and summary.json give ("this invocation took", the budget's verdict) was read before
    the report's context was built, whose parameter count builds a model on the meta device: a reused --quick run
    printed 12 s where the process ran 18 s. The wall now counts everything up to the rendering."""
    import json
    import time

    import snlp.apps.speedrun.final as final

    seen = {}
    real = final.report_context

    def timed(sr, records, wall):
        ctx = real(sr, records, wall)
        seen.update(t_start=sr.t_start, built=time.perf_counter())
        return ctx

    monkeypatch.setattr(final, "report_context", timed)
    out = tmp_path / "sr"
    assert main(["speedrun", "--out", str(out), "--quick", "--depth", "4", "--steps", "2", "--max-chars", "300000",
                 "--device", "cpu"]) == 0
    wall = json.loads((out / "summary.json").read_text())["wall_seconds"]
    assert wall >= seen["built"] - seen["t_start"]
    assert f"this invocation took {final.fmt_s(wall)}" in (out / "report.md").read_text()


def test_an_off_the_shelf_stage_without_its_adaptation_says_so():
    """--off-the-shelf promises "a short drafter adaptation", which --quick gives no minutes: its report's
    off-the-shelf section ended after the table as if the flag held nothing more. It now says no adaptation ran
    and why; one that ran keeps its own paragraph."""
    from snlp.apps.report import adaptation_lines, off_the_shelf_section
    from snlp.eval.protocol import EvalRecord

    recs = [EvalRecord(plan=p, K=k, S=30 - n, C=n or None, M=1 if n else None, init="h0" if n else None, ppl=ppl,
                       top1=1.0, logit_sim=1.0, delta_ppl=ppl / 20.0 - 1, latency_ms=5.0, speedup=1.0 if not n else 1.2,
                       n_layer=30, tokens=256, seq_len=256, device="cpu", dtype="float32")
            for p, k, n, ppl in (("sequential", None, 0, 20.0), ("8xF1-h0-K1", 1, 8, 21.0))]
    text = "\n".join(off_the_shelf_section({"result": {"model": "m.gguf", "n_layer": 30, "params": 1.35e8,
                                                       "records": [r.to_dict() for r in recs]}}))
    assert "No drafter adaptation ran" in text and "--quick" in text
    ran = {"minutes": 1.0, "plan": "8xF1-h0-K1", "steps": 10, "tokens": 1000, "block": 4,
           "before": {"top1": 0.5, "top1_ssd": 0.4}, "after": {"top1": 0.6, "top1_ssd": 0.5},
           "ssd": {"post-hoc": {"alpha": 0.5, "measured_speedup": 1.0},
                   "adapted": {"alpha": 0.6, "measured_speedup": 1.1, "prompts": 2, "gen_tokens": 16, "repeats": 1,
                               "matches_sequential": True}}}
    assert "No drafter adaptation" not in "".join(adaptation_lines(ran))


def test_an_ssd_stage_whose_tune_picks_no_drafter_keeps_what_tune_found(monkeypatch, capsys):
    """When snlp tune picked no drafter (e.g. "no eligible measured candidate"), the ssd stage recorded only the proxy
    rule's scores: its report said the proxy rule "would have drafted with: IDN Reg.: `None`" where that rule had a
    plan, "Tune took IDN Reg. 0 s" after seconds of tuning, and left out tune's table and its verdict. The record
    now keeps them, and the report names the proxy's plan and tune's time."""
    import types

    import snlp.apps.speedrun.ssd as ssd
    import snlp.io.checkpoint
    from test_speedrun import _rec, _report_ctx

    from snlp.apps.report import render_report
    from snlp.apps.speedrun.preset import QUICK

    fake = types.SimpleNamespace(picks={"ssd": None}, pick_rule={"ssd": "no eligible measured candidate"},
                                 pick_tie={"ssd": False}, notes=["every candidate's output differed from sequential"],
                                 candidates=[], stage1_s=2.0, stage2_s=3.5, costs=[])
    monkeypatch.setattr(snlp.io.checkpoint, "load", lambda d, device=None: (object(), None))
    monkeypatch.setattr(ssd, "tune_drafter", lambda *a, **k: fake)
    recs = [_rec("sequential", 20.0, [1.0] * 3, 1.0, 1.0), _rec("12xF1-h0-K1", 21.0, [1.8, 1.9, 2.0], 0.5, 0.5)]
    res = ssd.stage_ssd("m", None, recs, QUICK, 0, "cpu")
    assert "no eligible measured candidate" in capsys.readouterr().out
    assert res["drafter"] is None and res["rows"] == []
    assert res["proxy_drafter"] == "12xF1-h0-K1" and res["tune_s"] == 5.5
    assert res["pick_rule"] == "no eligible measured candidate" and res["tune_notes"] == fake.notes
    ctx = _report_ctx()
    ctx["stages"]["ssd-idn"] = dict(ctx["stages"]["ssd-idn"], result=res)
    md = render_report(ctx)
    assert "IDN Reg.: `12xF1-h0-K1`" in md and "IDN Reg. 6 s" in md and "`None`" not in md
    assert "IDN Reg.: no eligible measured candidate." in md


def test_a_second_speedrun_into_an_out_in_use_is_refused(tmp_path, capsys):
    """Two `snlp speedrun --out X` at once (a second terminal) both ran: the second deleted or "resumed" the model
    folders the first was training into and rewrote its stage records and training logs. --out is now locked while a
    run goes, as the other long commands' outputs are: the second is refused in one line, and writes nothing."""
    import os

    from snlp.runtime.outputs import locked_output

    out = tmp_path / "sr"
    with locked_output(out):  # the run in progress (flock: a second open file description conflicts in-process too)
        rc = main(["speedrun", "--out", str(out), *TINY])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and f"--out {out} is in use by a run in progress (pid {os.getpid()})" in err, err
    assert len(err.splitlines()) == 1 and not out.exists()


def test_the_minutes_banner_never_estimates_zero_minutes():
    """`snlp speedrun --quick --minutes 1` announced "evaluation and SSD ~0 min" (the QUICK preset's 30 s rounded to
    whole minutes) for stages that took a minute on a loaded box; the estimate now prints m:ss."""
    import dataclasses
    import types

    from snlp.apps.speedrun.job import banner
    from snlp.apps.speedrun.preset import QUICK

    said = []
    sr = types.SimpleNamespace(preset=dataclasses.replace(QUICK, minutes=1.0, steps=None), out="o", plans=["p"],
                               cfg=types.SimpleNamespace(device="cpu"),
                               console=types.SimpleNamespace(print=lambda s, **k: said.append(s)))
    banner(sr)
    assert "~0 min" not in said[-1] and f"evaluation and SSD ~{QUICK.est_eval_s:.0f}s" in said[-1], said
    assert "~2:15 (training 1 min" in said[-1]  # 60 s + 30 s + 45 s of start-up and report


def test_the_default_grid_of_every_allowed_depth_parses():
    """--depth 2 and --depth 3 pass the speedrun's own check (>= 2) but their default grid named one plan twice (K = 2
    and 4 on a 1- or 2-layer suffix are the exact K = N plan), and the run was refused with "--plans lists
    1xF1-h0-K1 twice", a flag the user never typed; depth 4 warned on every run that K = 4 ran as K = 3. Every
    depth's default grid now parses as it is, without a warning."""
    import warnings

    from snlp.apps.speedrun.preset import default_plans, suffix_depth
    from snlp.method.plan import parse_plans

    for L in range(2, 33):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = [str(p) for p in parse_plans(",".join(default_plans(L)), L)]
        assert got == default_plans(L) and all(p.startswith(f"{suffix_depth(L)}xF1-") for p in got[:2 if L > 2 else 1])
    assert default_plans(16) == ["12xF1-h0-K1", "12xF1-h0-K2", "12xF1-h0-K4", "12xF1-fwd-K1", "6xF2-h0-K1",
                                 "6xF2-h0-K2", "1xF12-h0-K1"]  # the paper's grid at the default depth, unchanged


def test_a_diverged_training_reads_diverged_in_the_training_table():
    """A training whose validation loss is NaN (stored as null in strict JSON, read back as NaN) printed "nan (-)" in
    the training table, where every other table prints a non-finite PPL as "diverged", and the floor's verdict named
    its validation PPL "-". Both now say diverged."""
    from test_speedrun import _report_ctx

    from snlp.apps.report import render_report, weaker_training

    ctx = _report_ctx()
    rec = ctx["stages"]["train-idn"]
    ctx["stages"]["train-idn"] = dict(rec, result={**rec["result"], "val_loss": None})
    md = render_report(ctx)
    row = next(line for line in md.splitlines() if line.startswith("| IDN Reg. | "))
    assert "nan" not in row and "| diverged |" in row, row
    ctx["stages"]["train-idn"]["result"]["val_loss"] = float("nan")
    assert "IDN Reg. diverged" in weaker_training(ctx)

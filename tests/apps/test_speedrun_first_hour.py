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
    assert "--seed must be >= 0 (got -1)" in err and len(err.splitlines()) == 1, err
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

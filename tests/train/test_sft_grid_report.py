"""snlp sft-grid's report against what ran: each task one column (a task named twice refused before any training),
columns told apart, the table's caption naming the scoring protocol, the runs' records in grid.json the runs' own,
runs in --out checked before either trains, and no table left beside runs that changed since it was written."""


import json
import shutil

import pytest
import torch

from snlp.apps.cli import main
from tests.train.test_sft import write_task

FLAGS = ["--batch-size", "4", "--seq-len", "64", "--eval-every", "1000", "--eval-batches", "1", "--no-progress",
         "--device", "cpu"]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def grid(d, *extra, plan="1xF1-h0-K1", tasks=None, steps=2):
    tasks = tasks or [f"mc:{d / 'test.jsonl'}"]
    return ["sft-grid", str(d / "base"), "--data", str(d / "chats.jsonl"), "--plan", plan,
            *[a for t in tasks for a in ("--task", t)], "--out", str(d / "grid"), "--steps", str(steps), *FLAGS,
            *extra]


@pytest.mark.parametrize("second", ["same", "dot", "folder"])
def test_a_task_given_twice_is_refused_before_any_training(tmp_path, capsys, second):
    """`--task mc:T --task mc:T` (or T spelled from another folder, or T's folder) made two columns of the same
    questions, and Avg. (the mean of the columns) counted T once or twice depending on the spelling. Refused."""
    write_task(tmp_path, 40, 30, 20, 2, 32)
    (tmp_path / "q").mkdir()
    (tmp_path / "test.jsonl").rename(tmp_path / "q" / "test.jsonl")
    t = f"mc:{tmp_path / 'q' / 'test.jsonl'}"
    other = {"same": t, "dot": f"mc:{tmp_path / 'q' / '.' / 'test.jsonl'}", "folder": f"mc:{tmp_path / 'q'}"}[second]
    capsys.readouterr()
    assert main(grid(tmp_path, tasks=[t, other])) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "count twice in Avg." in err, err
    assert not (tmp_path / "grid").exists()


def test_files_of_one_name_in_two_folders_get_two_column_names(tmp_path):
    """Two tasks whose files share a name (a/test.jsonl, b/test.jsonl) were both labelled "test": the table could
    not say which column is which."""
    write_task(tmp_path, 40, 30, 20, 2, 32)
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "test.jsonl").write_text((tmp_path / "test.jsonl").read_text())
    tasks = [f"mc:{tmp_path / 'a' / 'test.jsonl'}", f"mc:{tmp_path / 'b' / 'test.jsonl'}"]
    assert main(grid(tmp_path, "--mc-limit", "2", tasks=tasks, steps=1)) == 0
    head = next(line for line in (tmp_path / "grid" / "grid.md").read_text().splitlines() if line.startswith("| SFT"))
    assert f"| {tmp_path / 'a' / 'test.jsonl'} (N=2) | {tmp_path / 'b' / 'test.jsonl'} (N=2) |" in head, head


@pytest.mark.parametrize("scoring", ["letter", "harness"])
def test_the_tables_caption_names_the_protocol_that_scored_it(tmp_path, scoring):
    """grid.md said only "harness scoring; accuracy %": not that the accuracy is the harness's acc (not acc_norm),
    nor whether lm-evaluation-harness or snlp's copy of its protocol scored (docs/harness.md: every table's caption
    says which one scored). The caption carries evaluate_mc's protocol line now, as `snlp eval`'s tables do."""
    from snlp.eval.mc import MCConfig
    from snlp.eval.mc_eval import evaluate_mc
    from snlp.io.checkpoint import load

    write_task(tmp_path, 40, 30, 20, 2, 32)
    task = f"mc:{tmp_path / 'test.jsonl'}"
    assert main(grid(tmp_path, "--mc-scoring", scoring, "--mc-limit", "2", steps=1)) == 0
    model, tok = load(tmp_path / "grid" / "sft-sequential")
    want = evaluate_mc(model, tok, MCConfig(task=task, plans=[], scoring=scoring, limit=2)).protocol
    md = (tmp_path / "grid" / "grid.md").read_text().splitlines()
    assert md[1] == want, md[:2]
    assert json.loads((tmp_path / "grid" / "grid.json").read_text())["protocol"] == want
    if scoring == "harness":
        assert "scored by" in want and "acc (summed log-prob) %" in md[0], md[:2]


def test_a_reused_runs_record_in_grid_json_is_its_own(tmp_path):
    """A rerun of a finished grid reuses both SFT runs (no step run), and grid.json's sft_runs took the TrainResult
    of that idle resume: train_loss, val_loss and validation null beside runs whose summaries hold them. The record
    is each run's train_summary.json now, the same on the first run and on a rerun."""
    write_task(tmp_path, 40, 30, 20, 2, 32)
    cmd = grid(tmp_path, "--mc-limit", "2")
    assert main(cmd) == 0
    first = json.loads((tmp_path / "grid" / "grid.json").read_text())["sft_runs"]
    assert main(cmd) == 0
    again = json.loads((tmp_path / "grid" / "grid.json").read_text())["sft_runs"]
    for forward, rec in again.items():
        own = json.loads((tmp_path / "grid" / f"sft-{forward}" / "train_summary.json").read_text())
        assert rec == own == first[forward]
        assert rec["val_loss"] is not None and rec["train_loss"] is not None and rec["steps"] == 2


@pytest.mark.parametrize("mine", [("grid.md", "my notes\n"), ("grid.json", "[1, 2]\n")])
def test_an_out_holding_a_grid_file_of_another_kind_is_refused_before_any_training(tmp_path, capsys, mine):
    """A --out holding the user's own grid.md (or a grid.json that is no grid's) lost it: the grid removes both
    once a run trains and writes its own. Refused in one line before any work; an earlier grid's files are replaced."""
    write_task(tmp_path, 40, 30, 20, 2, 32)
    name, text = mine
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / name).write_text(text)
    capsys.readouterr()
    assert main(grid(tmp_path, steps=1)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"holds {name} but no earlier grid" in err, err
    assert (tmp_path / "grid" / name).read_text() == text
    assert sorted(p.name for p in (tmp_path / "grid").iterdir()) == [name]
    (tmp_path / "grid" / name).unlink()
    assert main(grid(tmp_path, steps=1)) == 0
    assert main(grid(tmp_path, steps=2)) == 0  # an earlier grid's table: the rerun replaces it
    assert "| SFT | Inference |" in (tmp_path / "grid" / "grid.md").read_text()


def test_the_second_runs_folder_is_refused_before_the_first_run_trains(tmp_path, capsys):
    """OUT/sft-PLAN holding an SFT run of another forward (here `snlp sft --forward sequential`) was refused only
    when the grid reached it, after the whole sequential SFT run had trained into OUT/sft-sequential."""
    write_task(tmp_path, 40, 30, 20, 2, 32)
    plan = "1xF1-h0-K1"
    assert main(["sft", str(tmp_path / "base"), "--data", str(tmp_path / "chats.jsonl"), "--out",
                 str(tmp_path / "grid" / f"sft-{plan}"), "--steps", "1", *FLAGS]) == 0
    capsys.readouterr()
    assert main(grid(tmp_path, plan=plan)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--forward 'sequential'" in err, err
    assert not (tmp_path / "grid" / "sft-sequential").exists()


@pytest.mark.parametrize("change", [["--steps", "1"], ["--stop-after", "1"], ["--seed", "1"], ["--lr-scale", "0.5"]])
def test_a_rerun_over_runs_it_cannot_reuse_is_refused_in_the_grids_words(tmp_path, capsys, change):
    """A rerun with --steps or --stop-after below the saved runs' step reused them (rc 0): the table scored 2-step
    runs as the grid of 1 step. A rerun that changes a setting the runs were saved with was refused by snlp sft's
    resume check, whose advice, "leave these flags out (snlp train and snlp sft take the saved values)", does not
    hold for the grid (a flag left out is its default, refused again). Both are refused before any step, in one line
    naming the saved value; the table is kept."""
    write_task(tmp_path, 40, 30, 20, 2, 32)
    cmd = grid(tmp_path, "--mc-limit", "2")
    assert main(cmd) == 0
    table = (tmp_path / "grid" / "grid.json").read_text()
    capsys.readouterr()
    steps = [cmd.index("--steps"), cmd.index("--steps") + 1]
    again = [a for i, a in enumerate(cmd) if change[0] != "--steps" or i not in steps] + change
    assert main(again) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "leave these flags out" not in err, err
    want = {"--steps": "past --steps 1", "--stop-after": "past --stop-after 1", "--seed": "--seed 0 (given: 1)",
            "--lr-scale": "--lr-scale 0.1 (given: 0.5)"}[change[0]]
    assert want in err and "sft-sequential" in err, err
    assert (tmp_path / "grid" / "grid.json").read_text() == table


def test_a_rerun_stopped_before_its_table_leaves_no_stale_table(tmp_path, monkeypatch, capsys):
    """A finished 2-step grid rerun with --steps 3 trains both runs further; stopped before it writes its table
    (a --stop-file's text, a signal, an error), it left the 2-step grid.md / grid.json beside runs now at step 3.
    The old table goes once a run takes a step; a rerun that reuses both runs as they are keeps it."""
    from dataclasses import replace

    import snlp.apps.sft_grid as G

    write_task(tmp_path, 40, 30, 20, 2, 32)
    stop = tmp_path / "STOP"
    assert main(grid(tmp_path, "--mc-limit", "2")) == 0
    assert main(grid(tmp_path, "--mc-limit", "2")) == 0  # both reused: the table is rewritten, not dropped
    assert (tmp_path / "grid" / "grid.json").exists()
    hooks = G.file_hooks

    def writing(path):  # "stop" lands once the first run's step 3 is done, as another process would write it
        h = hooks(path)

        def should_stop(done):
            if done == 3 and not stop.exists():
                stop.write_text("stop\n")
            return h.should_stop(done)
        return replace(h, should_stop=should_stop)
    monkeypatch.setattr(G, "file_hooks", writing)
    capsys.readouterr()
    assert main(grid(tmp_path, "--mc-limit", "2", "--stop-file", str(stop), steps=3)) == 0
    assert "the grid stops there, unscored" in capsys.readouterr().err
    assert torch.load(tmp_path / "grid" / "sft-sequential" / "train_state.pt", weights_only=False)["step"] == 3
    assert not (tmp_path / "grid" / "grid.md").exists() and not (tmp_path / "grid" / "grid.json").exists()


def test_a_run_folder_without_its_weights_is_refused_without_snlp_sfts_resume_advice(tmp_path, capsys):
    """OUT/sft-PLAN holding train_state.pt but no model.safetensors was refused by fit with "drop --resume to start
    a new run", a flag sft-grid does not have (it resumes wherever train_state.pt is). Refused in the grid's words."""
    write_task(tmp_path, 40, 30, 20, 2, 32)
    plan = "1xF1-h0-K1"
    cmd = grid(tmp_path, "--mc-limit", "2", plan=plan)
    assert main(cmd) == 0
    (tmp_path / "grid" / f"sft-{plan}" / "model.safetensors").unlink()
    capsys.readouterr()
    assert main(cmd) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--resume" not in err and "no model.safetensors" in err, err


def test_the_cells_are_scored_on_the_device_the_runs_trained_on(tmp_path, monkeypatch):
    """The grid loaded each SFT checkpoint for scoring with load()'s default device, the CPU: `--device cuda` (or
    none, on a machine with a GPU) trained on the GPU and then scored every cell on the host. The runs and the
    scorer are stand-ins here (no GPU needed): the device each checkpoint is loaded on is what is checked."""
    import importlib

    E, C, S = (importlib.import_module(m) for m in ("snlp.eval.mc_eval", "snlp.io.checkpoint", "snlp.train.sft"))
    from snlp.apps.sft_grid import GridConfig, run_grid
    from snlp.apps.cli import build_parser

    class Loaded(Exception):
        pass

    write_task(tmp_path, 40, 30, 20, 2, 32)
    loaded = []

    def sft(scfg, hooks=None):
        out = tmp_path / "grid" / f"sft-{scfg.forward}"
        out.mkdir(parents=True)
        (out / "train_summary.json").write_text(json.dumps({"steps": 1}))
        return S.TrainResult(out=str(out), steps=1, tokens=0, train_loss=None, val_loss=None, wall_s=0.0,
                             elapsed_s=0.0)

    def load(path, device="cpu"):
        loaded.append(str(device))
        raise Loaded  # nothing to score: the device is what the test reads
    monkeypatch.setattr(S, "sft", sft)
    monkeypatch.setattr(C, "load", load)
    monkeypatch.setattr(E, "evaluate_mc", lambda *a, **k: pytest.fail("not reached"))
    for device, cuda in (("cuda", False), (None, True), (None, False)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        args = build_parser().parse_args(grid(tmp_path) + ([] if device is None else ["--device", device]))
        args.device = device
        with pytest.raises(Loaded):
            run_grid(GridConfig(ckpt=args.ckpt, data=args.data, plan=args.plan, tasks=args.task, out=args.out,
                                sft_args=args))
        shutil.rmtree(tmp_path / "grid")
    assert loaded == ["cuda", "cuda", "cpu"]


def test_the_table_says_how_many_steps_each_run_trained_and_a_stop_before_its_budget(tmp_path):
    """`--steps 4 --stop-after 2` scores the 2-step runs (by design: a stop file's step number does the same), and
    grid.md read as the table of the full runs: nothing in it said how long either SFT run trained. It names each
    run's steps (its train_summary.json's) and a stop before the budget now."""
    write_task(tmp_path, 40, 30, 20, 2, 32)
    plan = "1xF1-h0-K1"
    assert main(grid(tmp_path, "--mc-limit", "2", "--stop-after", "2", steps=4)) == 0
    md = (tmp_path / "grid" / "grid.md").read_text()
    want = (f"SFT runs: sequential 2 steps (stopped by --stop-after before its budget), {plan} 2 steps (stopped by "
            f"--stop-after before its budget)")
    assert want in md, md
    shutil.rmtree(tmp_path / "grid")
    assert main(grid(tmp_path, "--mc-limit", "2", steps=2)) == 0
    assert f"SFT runs: sequential 2 steps, {plan} 2 steps\n" in (tmp_path / "grid" / "grid.md").read_text()


def test_a_grid_cut_while_writing_its_table_leaves_an_out_its_rerun_takes(tmp_path, monkeypatch, capsys):
    """The grid wrote grid.md, then grid.json: a grid cut between the two (a kill, a full disk) left grid.md alone,
    which the rerun then refused as the user's own file ('holds grid.md but no earlier grid'). grid.json is written
    first and each file whole or not at all, so the cut leaves the grid's record; the rerun takes OUT and writes
    both."""
    from pathlib import Path

    write_task(tmp_path, 40, 30, 20, 2, 32)
    real = Path.write_text

    def cut_at_the_table(self, text, *a, **kw):
        if "grid.md" in self.name:  # the table is written whole, then the process is cut
            real(self, text, *a, **kw)
            raise KeyboardInterrupt
        return real(self, text, *a, **kw)

    monkeypatch.setattr(Path, "write_text", cut_at_the_table)
    assert main(grid(tmp_path, steps=1)) != 0  # the CLI's Ctrl-C: interrupted, the runs saved
    monkeypatch.setattr(Path, "write_text", real)
    capsys.readouterr()
    assert main(grid(tmp_path, steps=1)) == 0, capsys.readouterr().err
    assert "| SFT | Inference |" in (tmp_path / "grid" / "grid.md").read_text()
    assert json.loads((tmp_path / "grid" / "grid.json").read_text())["rows"]

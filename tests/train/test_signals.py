"""What a scheduler or a person sends a training run: SIGTERM (kill, docker stop, Slurm at a time limit or preemption,
then SIGKILL), SIGHUP, Slurm's --signal USR1 / USR2, Ctrl-C. Each stops the run after the step in progress and saves
a checkpoint that resumes to the weights of a run never stopped; the command says which signal and how to continue,
and exits 128 + the signal's number. Real processes get real signals; a test waits on the file a run writes after a
step (its log), never on a clock."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from snlp.apps.cli import main
from snlp.train.config import TrainConfig
from snlp.train.hooks import WAIT, TrainHooks
from snlp.train.trainer import fit

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]
SHAKESPEARE = ROOT / "tests/data/tinyshakespeare-head.txt"
# many steps: a run is signalled long before its budget ends (the schedule is the 400-step one in every leg)
TINY = ["--depth", "2", "--width", "32", "--head-dim", "16", "--vocab-size", "300", "--seq-len", "16", "--batch-size",
        "2", "--steps", "400", "--eval-every", "1000", "--eval-batches", "1", "--log-every", "1", "--no-progress",
        "--device", "cpu"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # the tests' own single thread: same sums
WAIT_S = 240  # the harness's bound on a child that never gets there (a hang fails, it does not block the suite)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "c.txt").write_text(SHAKESPEARE.read_text()[:30_000])
    return d / "c.txt"


def weights(out) -> dict:
    return load_file(str(Path(out) / "model.safetensors"))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def step_records(log: Path) -> list[dict]:
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return []
    recs = []
    for line in lines:
        try:
            recs.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return [r for r in recs if "loss" in r and "val_loss" not in r]


def wait_for_step(logs: list[Path], step: int, procs: list) -> None:
    """Poll until every log records `step` (or a later one); fail at once if a process ended first."""
    deadline = time.monotonic() + WAIT_S
    while not all(any(r["step"] >= step for r in step_records(log)) for log in logs):
        for p in procs:
            assert p.poll() is None, f"the run ended before step {step}: {p.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no step {step} in {logs} after {WAIT_S} s"
        time.sleep(0.05)


def start(args: list[str], cwd=ROOT, **kw) -> subprocess.Popen:
    return subprocess.Popen(["nice", "-n", "10", sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=cwd, **kw)


def signalled(args: list[str], log: Path, step: int = 2, sig=signal.SIGTERM, cwd=ROOT) -> tuple[int, str, str]:
    """Start `python ARGS`, send it `sig` once `log` records `step`, and return its status, stdout and stderr (a child
    that never gets there or never ends fails the test after WAIT_S, and is killed)."""
    p = start(args, cwd=cwd)
    try:
        wait_for_step([log], step, [p])
        p.send_signal(sig)
        out, err = p.communicate(timeout=WAIT_S)
    finally:
        p.kill()
    return p.returncode, out, err


def saved_step(out) -> int:
    return torch.load(Path(out) / "train_state.pt", weights_only=False)["step"]


# ----- snlp train, a real process and a real SIGTERM
def test_sigterm_saves_after_the_step_and_the_run_resumes_to_the_uninterrupted_weights(corpus, tmp_path):
    """`kill PID` (SIGTERM) of `snlp train` with the default --save-every 0 ended it with nothing saved. Now the run
    finishes its step, saves, writes its summary, says which signal and the command that continues it, and exits
    143; resumed, it reaches the weights of a run never stopped."""
    cache, out = tmp_path / "cache", tmp_path / "run"
    flags = ["--data", str(corpus), "--cache-dir", str(cache), *TINY]
    assert main(["train", "--out", str(tmp_path / "warm"), *flags, "--stop-after", "1"]) == 0  # the token cache
    rc, _, err = signalled(["-m", "snlp", "train", "--out", str(out), *flags], out / "log.jsonl")
    step = saved_step(out)
    assert rc == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"snlp train: interrupted by SIGTERM: saved {out} at step {step}; "
                                            f"continue with: snlp train --out {out} --device cpu --resume")
    # the stop is on the last step's record, or (a signal after that step's check) on a row of its own after it
    last = [r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "stop" in r][-1]
    assert step >= 2 and step_records(out / "log.jsonl")[-1]["step"] == step
    assert last["step"] == step and last["stop"] == "interrupt", last
    summary = json.loads((out / "train_summary.json").read_text())
    assert (summary["steps"], summary["stopped_by"], summary["signal"]) == (step, "interrupt", "SIGTERM")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no hidden copy left
    assert main(["train", "--out", str(out), "--resume", "--stop-after", str(step + 2)]) == 0
    assert main(["train", "--out", str(tmp_path / "ref"), *flags, "--stop-after", str(step + 2)]) == 0
    assert_same_weights(weights(out), weights(tmp_path / "ref"))


def test_ctrl_c_then_resume_is_the_uninterrupted_run_past_the_warmup(corpus, tmp_path):
    """A real SIGINT to `snlp train` after step 3, then `--resume` well past the step the stop saved (over the end of
    the 10-step LR warmup): the weights equal those of a run never stopped, bit for bit; the saved `rng` (torch,
    Python, numpy) equals that of a --stop-after save at the same step."""
    cache, out, ref, cut = tmp_path / "cache", tmp_path / "run", tmp_path / "ref", tmp_path / "cut"
    flags = ["--data", str(corpus), "--cache-dir", str(cache), *TINY]
    assert main(["train", "--out", str(tmp_path / "warm"), *flags, "--stop-after", "1"]) == 0  # the token cache
    rc, _, err = signalled(["-m", "snlp", "train", "--out", str(out), *flags], out / "log.jsonl", step=3,
                           sig=signal.SIGINT)
    step = saved_step(out)
    assert rc == 130 and step >= 3, err[-3000:]
    assert main(["train", "--out", str(cut), *flags, "--stop-after", str(step)]) == 0
    a, b = (torch.load(Path(d) / "train_state.pt", weights_only=False)["rng"] for d in (out, cut))
    assert torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"]
    assert all((x == y).all() if hasattr(x, "shape") else x == y for x, y in zip(a["numpy"], b["numpy"]))
    assert main(["train", "--out", str(out), "--resume", "--stop-after", str(step + 12)]) == 0
    assert main(["train", "--out", str(ref), *flags, "--stop-after", str(step + 12)]) == 0
    assert_same_weights(weights(out), weights(ref))


def test_two_runs_save_the_same_python_and_numpy_rng_states(corpus, tmp_path):
    """train_state.pt's `rng` holds Python's and numpy's global generators besides torch's; they were never seeded,
    so every process saved its own start-up state (two identical runs, a signal's and a --stop-after save at one
    step all differed there) and a resume restored a state no fresh run has. Both are seeded from --seed now."""
    import random

    import numpy as np

    cfg = TrainConfig(out=str(tmp_path / "r"), data=str(corpus), cache_dir=str(tmp_path / "c"), depth=2, width=32,
                      head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=4, eval_batches=1,
                      no_progress=True, device="cpu")
    states = []
    for k in (1, 2):  # the process's generators as two fresh processes would find them: not alike
        random.seed(k)
        np.random.seed(k)
        fit(replace(cfg, out=str(tmp_path / f"r{k}"), stop_after=2))
        states.append(torch.load(tmp_path / f"r{k}" / "train_state.pt", weights_only=False)["rng"])
    a, b = states
    assert a["python"] == b["python"]
    assert a["numpy"][0] == b["numpy"][0] and (a["numpy"][1] == b["numpy"][1]).all() and a["numpy"][2:] == b["numpy"][2:]


@pytest.fixture
def hangup_not_ignored():
    """SIGHUP at its default for the test: a suite started under nohup passes it ignored, and a run respects an
    ignored SIGHUP (snlp.train.hooks), so the hangup tests would test nohup instead."""
    old = signal.getsignal(signal.SIGHUP)
    if old is signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, old)


@pytest.mark.parametrize("sig", ["SIGHUP", "SIGUSR1", "SIGUSR2", "SIGINT"])
def test_every_stop_signal_saves_and_exits_128_plus_its_number(corpus, tmp_path, capsys, monkeypatch, sig,
                                                             hangup_not_ignored):
    """SIGHUP (the terminal closed), SIGUSR1 / SIGUSR2 (Slurm's --signal, ahead of the time limit) and Ctrl-C: each is
    a stop and a save like SIGTERM, named in the line, with its own status (a real signal to this process, sent by
    the run's own stop-file hook after step 2)."""
    import snlp.apps.train as T

    signum = getattr(signal, sig)
    monkeypatch.setattr(T, "file_hooks", lambda *a, **k: TrainHooks(
        should_stop=lambda s: os.kill(os.getpid(), signum) if s == 2 else None))
    out = tmp_path / "run"
    rc = main(["train", "--out", str(out), "--data", str(corpus), "--cache-dir", str(tmp_path / "c"), *TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 128 + signum and saved_step(out) == 2
    assert err[-1] == (f"snlp train: interrupted by {sig}: saved {out} at step 2; continue with: snlp train --out {out} "
                       f"--device cpu --resume")
    assert signal.getsignal(signum) is (signal.default_int_handler if sig == "SIGINT" else signal.SIG_DFL)


def test_the_resume_line_repeats_stop_after_and_device_which_a_resume_does_not_inherit(corpus, tmp_path, capsys,
                                                                                        monkeypatch):
    """A run of --stop-after 4 stopped by a signal at step 2 printed `snlp train --out OUT --resume`, and --resume does
    not take --stop-after (nor --device) from the saved run: the printed command trained to the full --steps. The
    line repeats both now, and running it as printed ends where the run was asked to, with the weights of a run
    never stopped."""
    import shlex

    import snlp.apps.train as T

    real = T.file_hooks
    monkeypatch.setattr(T, "file_hooks", lambda *a, **k: TrainHooks(
        should_stop=lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == 2 else None))
    out, flags = tmp_path / "run", ["--data", str(corpus), "--cache-dir", str(tmp_path / "c"), *TINY]
    assert main(["train", "--out", str(out), *flags, "--stop-after", "4", "--device", "cpu"]) == 143
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith(f"continue with: snlp train --out {out} --stop-after 4 --device cpu --resume"), line
    monkeypatch.setattr(T, "file_hooks", real)
    assert main(shlex.split(line.split("continue with: ")[1])[1:]) == 0
    assert saved_step(out) == 4
    assert main(["train", "--out", str(tmp_path / "ref"), *flags, "--stop-after", "4"]) == 0
    assert_same_weights(weights(out), weights(tmp_path / "ref"))


def test_the_resume_line_repeats_the_stop_file_which_no_saved_run_holds(corpus, tmp_path, capsys, monkeypatch):
    """--stop-file is a flag of the process (snlp.apps.train.file_hooks), never saved with the run: a run watching a
    stop file that a signal stopped printed a resume command without it, and that command trained past the step the
    file asked for, to the full --steps. The line repeats it, and run as printed it stops where the file says."""
    import shlex

    import snlp.apps.train as T

    real = T.file_hooks
    monkeypatch.setattr(T, "file_hooks", lambda *a, **k: TrainHooks(
        should_stop=lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == 2 else None))
    stop = tmp_path / "stop"
    stop.write_text("4")
    out, flags = tmp_path / "run", ["--data", str(corpus), "--cache-dir", str(tmp_path / "c"), *TINY]
    assert main(["train", "--out", str(out), *flags, "--stop-file", str(stop)]) == 143
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith(f"continue with: snlp train --out {out} --device cpu --stop-file {stop} --resume"), line
    monkeypatch.setattr(T, "file_hooks", real)
    assert main(shlex.split(line.split("continue with: ")[1])[1:]) == 0
    assert saved_step(out) == 4


def test_every_flag_a_resume_cannot_take_from_the_saved_run_is_repeated_by_the_resume_line():
    """The flags of snlp train / sft / adapt that are not a field of the config the run saves (and so never reach a
    `--resume` from it), or are one of its NOT_INHERITED fields, typed on the run, are repeated by the line a signal
    prints (snlp.apps.train.not_inherited): --stop-after and --device were, --stop-file (train, sft) and --json
    (adapt, the AdaptResult it writes at the end) were not."""
    import argparse
    import dataclasses

    import snlp.apps.adapt as A
    import snlp.apps.sft as S
    import snlp.apps.train as T
    from snlp.train import adapt as adapt_lib
    from snlp.train import config as train_lib
    from snlp.train.adapt import AdaptConfig
    from snlp.train.sft import SFTConfig

    # typed on the command line anyway: the run's place, the resume switch, the base / data the sft line names
    named = {"out", "resume", "ckpt", "data", "help"}
    # held by the saved run although not config fields: sft's LRs, which --lr-scale sets and a resume keeps
    kept = {"lr_scale"}
    for mod, cfgs, not_inh in ((T, [TrainConfig], train_lib.NOT_INHERITED),
                               (S, [TrainConfig, SFTConfig], train_lib.NOT_INHERITED),
                               (A, [AdaptConfig], adapt_lib.NOT_INHERITED)):
        p = argparse.ArgumentParser()
        mod.add_arguments(p)
        fields = {f.name for c in cfgs for f in dataclasses.fields(c)}
        for a in p._actions:
            d = a.dest
            if d in named or d in kept or (d in fields and d not in not_inh) or d == "init_from":
                continue  # init_from: a resumed run starts from its own checkpoint, not from the one it began at
            value = "7" if a.type is int else "x"
            args = argparse.Namespace(**{b.dest: b.default for b in p._actions if b.dest != "help"})
            setattr(args, d, int(value) if a.type is int else value)
            assert f"--{d.replace('_', '-')}" in T.not_inherited(args), (mod.__name__, d)


def test_a_repeated_sigterm_is_ignored_and_a_second_ctrl_c_aborts(corpus, tmp_path, capsys):
    """Slurm signals every process of a job step and torchrun forwards its own SIGTERM: a second SIGTERM (or
    SIGUSR1) while the run stops must not cost the save. A Ctrl-C after a signal is a person asking to abort: it
    raises at once, as a second Ctrl-C always did."""
    sent = []

    def twice(steps_done):
        if steps_done == 2 and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGUSR1)
        return None

    cfg = TrainConfig(out=str(tmp_path / "a"), data=str(corpus), cache_dir=str(tmp_path / "c"), depth=2, width=32,
                      head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=400, eval_every=1000,
                      eval_batches=1, no_progress=True, device="cpu")
    r = fit(cfg, hooks=TrainHooks(should_stop=twice))
    assert (r.steps, r.stopped_by, r.signal, saved_step(cfg.out)) == (2, "interrupt", "SIGTERM", 2)

    def then_ctrl_c(steps_done):
        if steps_done == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
        return None

    cfg = TrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "b")})
    with pytest.raises(KeyboardInterrupt):
        fit(cfg, hooks=TrainHooks(should_stop=then_ctrl_c))
    assert not (tmp_path / "b" / "model.safetensors").exists()  # aborted before any save, as asked


def test_a_signal_ends_a_wait_at_the_lockstep_gate(corpus, tmp_path):
    """A run held at snlp speedrun's lockstep gate asked its stop checks once, before the wait: a signal then left it
    waiting for a gate that its stopped peer would never open. The held loop now asks them on every poll: the run
    stops at the gate, saves the step it finished, and the process returns (the harness's timeout fails a hang)."""
    out, gate = tmp_path / "run", tmp_path / "gate"
    gate.write_text("2")  # steps 1 and 2 may run; step 3 never opens
    code = (f"import sys\nfrom snlp.apps.train import file_hooks\nfrom snlp.train.config import TrainConfig\n"
            f"from snlp.train.trainer import fit\n"
            f"r = fit(TrainConfig(out={str(out)!r}, data={str(corpus)!r}, cache_dir={str(tmp_path / 'c')!r}, depth=2, "
            f"width=32, head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=400, eval_every=1000, "
            f"eval_batches=1, log_every=1, no_progress=True, device='cpu'), hooks=file_hooks(None, {str(gate)!r}))\n"
            f"print(r.stopped_by, r.signal, r.steps)")
    rc, said, err = signalled(["-c", code], out / "log.jsonl")
    assert rc == 0 and said.strip().splitlines()[-1].split() == ["interrupt", "SIGTERM", "2"], err[-3000:]
    assert saved_step(out) == 2


def test_a_wait_hook_is_polled_with_the_signal_check_in_process(corpus, tmp_path):
    """The loop asks a held step's hook again every poll_s, and its own stop check first each time."""
    asks = []

    def before_step(steps_done):
        asks.append(steps_done)
        if steps_done < 1:
            return None
        if len(asks) == 4:  # the third ask of the held step 2
            os.kill(os.getpid(), signal.SIGTERM)
        return WAIT

    cfg = TrainConfig(out=str(tmp_path / "a"), data=str(corpus), cache_dir=str(tmp_path / "c"), depth=2, width=32,
                      head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=400, eval_every=1000,
                      eval_batches=1, no_progress=True, device="cpu")
    r = fit(cfg, hooks=TrainHooks(before_step=before_step, poll_s=0.0))
    assert (r.steps, r.stopped_by, r.signal, asks) == (1, "interrupt", "SIGTERM", [0, 1, 1, 1])
    assert saved_step(cfg.out) == 1


# ----- a save cut off: a second signal in the middle, SIGKILL
def test_a_second_ctrl_c_between_a_saves_renames_leaves_the_new_checkpoint_in_place(corpus, tmp_path, monkeypatch):
    """save_checkpoint writes the new checkpoint beside OUT, then swaps it in with two renames. A KeyboardInterrupt
    (a second Ctrl-C) raised after the first rename left OUT missing and the last checkpoint hidden; the swap now
    finishes: OUT is the new checkpoint, whole, with the training log carried over, and nothing hidden is left."""
    import snlp.io.checkpoint as C
    from snlp.io.checkpoint import load, save_checkpoint

    out = tmp_path / "run"
    fit(TrainConfig(out=str(out), data=str(corpus), cache_dir=str(tmp_path / "c"), depth=2, width=32, head_dim=16,
                    vocab_size=300, seq_len=16, batch_size=2, steps=2, eval_every=1000, eval_batches=1,
                    no_progress=True, device="cpu"))
    model, tok = load(out)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    log = (out / "log.jsonl").read_text()
    replace = os.replace

    def interrupted_after_moving_out_aside(src, dst):
        replace(src, dst)
        if Path(src) == out:  # the signal's KeyboardInterrupt, raised as the rename returns
            raise KeyboardInterrupt

    monkeypatch.setattr(C.os, "replace", interrupted_after_moving_out_aside)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(out, model, tok)
    monkeypatch.undo()
    assert torch.equal(weights(out)["lm_head.weight"], model.lm_head.weight.detach())
    assert (out / "log.jsonl").read_text() == log
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def dead_pid() -> int:
    """The id of a process that has ended (a short child, waited for)."""
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)


def test_copies_left_by_a_killed_save_are_removed_by_the_next_run_on_that_out(corpus, tmp_path, capsys):
    """SIGKILL during a save left a hidden full model copy (.OUT.tmp-PID; .OUT.old-PID after the swap) that nothing
    removed. The next run on OUT (resumed or new) removes those of processes no longer running and says so in one
    line; a live process's copy stays, and so does the only checkpoint (OUT gone: refused, cut_off_save)."""
    import shutil

    out = tmp_path / "run"
    flags = ["--data", str(corpus), "--cache-dir", str(tmp_path / "c"), *TINY]
    assert main(["train", "--out", str(out), *flags, "--stop-after", "2"]) == 0
    live = tmp_path / f".run.tmp-{os.getppid()}"  # (a process that is running: this one's parent)
    tmp, old = tmp_path / f".run.tmp-{dead_pid()}", tmp_path / f".run.old-{dead_pid()}"
    for d in (tmp, old, live):
        shutil.copytree(out, d)
    (out / "log.jsonl").rename(tmp / "log.jsonl")  # the kill came as the save carried the training log over
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--stop-after", "3"]) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if "hidden" in ln]
    assert len(err) == 1 and err[0].startswith(f"{out}: removed 2 hidden copies left by a save that was killed (")
    assert tmp.name in err[0] and old.name in err[0] and "MiB)" in err[0]
    assert not tmp.exists() and not old.exists() and live.is_dir()
    assert [r["step"] for r in step_records(out / "log.jsonl")] == [1, 2, 3]  # the log came back, then went on
    shutil.rmtree(live)
    # a new run beside a dead run's copy: removed as well
    (tmp_path / "new").mkdir()
    copy = tmp_path / f".new.tmp-{dead_pid()}"
    shutil.copytree(out, copy)
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "new"), *flags, "--stop-after", "1"]) == 0
    assert not copy.exists() and "removed 1 hidden copy" in capsys.readouterr().err


# ----- snlp adapt, snlp sft, snlp sft-grid
def test_adapt_sigterm_saves_resumes_exactly_and_a_finished_run_is_not_resumed(tmp_path, monkeypatch, capsys):
    """SIGTERM to `snlp adapt` ended it unsaved (and a Ctrl-C exited 0 as if it had finished). Now it saves OUT/run,
    names the signal and `snlp adapt --out OUT --resume`, exits 143, and the resumed drafter equals the uninterrupted
    one. `--resume` of a run with no step left, or of a finished drafter, is refused before any work: it rewrote the
    drafter's record with a leg that ran no step."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    from test_adapt import tiny_ckpt

    tiny_ckpt(tmp_path)
    monkeypatch.chdir(tmp_path)
    run = ["adapt", "base", "--plan", "2xF1-h0-K1", "--data", "text.txt", "--steps", "400", "--seq-len", "24",
           "--batch-size", "4", "--eval-every", "1000", "--eval-batches", "1", "--log-every", "1", "--no-progress"]
    rc, _, err = signalled(["-m", "snlp", *run, "--out", "d"], tmp_path / "d" / "run" / "log.jsonl", cwd=tmp_path)
    step = saved_step(tmp_path / "d" / "run")
    assert rc == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"snlp adapt: interrupted by SIGTERM: saved d at step {step}; continue "
                                            f"with: snlp adapt --out d --resume")
    assert main(["adapt", "--out", "d", "--resume", "--stop-after", str(step + 1)]) == 0
    assert main([*run, "--out", "ref", "--stop-after", str(step + 1)]) == 0
    assert_same_weights(*(load_file(f"{x}/drafter.safetensors") for x in ("d", "ref")))
    record = (tmp_path / "d" / "drafter.json").read_text()
    capsys.readouterr()
    assert main(["adapt", "--out", "d", "--resume", "--stop-after", str(step + 1)]) == 2
    assert f"is at step {step + 1} already: --stop-after {step + 1} leaves it no step" in capsys.readouterr().err
    assert main([*run, "--out", "done", "--steps", "1"]) == 0
    capsys.readouterr()
    for resume in (["adapt", "--out", "done", "--resume"], [*run, "--out", "done", "--resume"]):
        assert main(resume) == 2
        assert "--resume: done holds a finished drafter" in capsys.readouterr().err
    assert (tmp_path / "d" / "drafter.json").read_text() == record


def test_sft_and_sft_grid_stop_on_a_signal_and_say_how_to_continue(tmp_path, capsys, monkeypatch):
    """`snlp sft` names the signal and its whole resume command; `snlp sft-grid` stopped after the first run's step
    and went on to score it and train the second run (status 0). Now it stops there, with the signal's status."""
    import snlp.apps.sft as S
    import snlp.apps.sft_grid as G
    from snlp.io.checkpoint import save_checkpoint
    from snlp.io.tokenizer import Tokenizer
    from snlp.model.config import GPTConfig
    from snlp.model.gpt import GPT

    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"say {i}"},
                                                        {"role": "assistant", "content": f"{i} {i + 1}"}]})
                               for i in range(60)))
    tk = Tokenizer.train([f"say {i} {i} {i + 1}" for i in range(60)], 300)
    m = GPT(GPTConfig.from_depth(2, width=32, head_dim=16, vocab_size=tk.vocab_size, sequence_len=32))
    m.init_weights(seed=0)
    save_checkpoint(tmp_path / "base", m, tk)
    task = tmp_path / "task.jsonl"
    task.write_text(json.dumps({"question": "say 1", "choices": ["1", "2"], "answer": 0}) + "\n")
    def hooks(*a, **k):  # SIGTERM to this process after step 2
        return TrainHooks(should_stop=lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == 2 else None)

    monkeypatch.setattr(S, "file_hooks", hooks)
    monkeypatch.setattr(G, "file_hooks", hooks)
    flags = ["--steps", "400", "--batch-size", "2", "--seq-len", "32", "--eval-every", "1000", "--eval-batches", "1",
             "--no-progress", "--device", "cpu"]
    out = tmp_path / "sft"
    assert main(["sft", str(tmp_path / "base"), "--data", str(chats), "--out", str(out), *flags]) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"snlp sft: interrupted by SIGTERM: saved {out} at step 2; continue with: snlp sft {tmp_path / 'base'} "
        f"--data {chats} --out {out} --device cpu --resume")
    grid = tmp_path / "grid"
    assert main(["sft-grid", str(tmp_path / "base"), "--data", str(chats), "--plan", "1xF1-h0-K1", "--task",
                 f"mc:{task}", "--out", str(grid), *flags]) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "snlp sft-grid: interrupted by SIGTERM; run the same command again to continue: a finished SFT run is reused, "
        "a stopped one resumes from its save")
    assert saved_step(grid / "sft-sequential") == 2
    assert sorted(p.name for p in grid.iterdir()) == ["sft-sequential"]  # not scored, no second run, no table
    # resumed, the stopped SFT run ends with the weights of one never stopped
    monkeypatch.setattr(S, "file_hooks", lambda *a, **k: TrainHooks())
    assert main(["sft", str(tmp_path / "base"), "--data", str(chats), "--out", str(out), "--device", "cpu",
                 "--resume", "--stop-after", "8"]) == 0
    assert main(["sft", str(tmp_path / "base"), "--data", str(chats), "--out", str(tmp_path / "ref"), *flags,
                 "--stop-after", "8"]) == 0
    assert_same_weights(weights(out), weights(tmp_path / "ref"))


# ----- torchrun
@pytest.mark.slow  # three torchrun launches of two processes each (CI runs -m slow)
def test_sigterm_to_torchrun_stops_every_rank_at_one_step_saved_and_resumable(corpus, tmp_path):
    """torchrun forwards a SIGTERM (Slurm's, docker stop's) to its workers and kills them 30 s later. Every rank stops
    after the same step (any rank's signal is agreed on with the step's reductions), rank 0 saves, torchrun returns,
    and `torchrun ... --resume` continues to the weights of a run never stopped."""
    from conftest import free_port

    flags = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY]
    assert main(["train", "--out", str(tmp_path / "warm"), *flags, "--stop-after", "1"]) == 0  # the token cache

    def torchrun(*args) -> list[str]:
        return ["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "snlp",
                "train", *args]

    out = tmp_path / "run"
    _, _, err = signalled(torchrun("--out", str(out), *flags), out / "log.jsonl")
    step = saved_step(out)
    assert step_records(out / "log.jsonl")[-1]["step"] == step and step_records(out / "log.jsonl")[-1]["stop"] == \
        "interrupt", err[-3000:]
    assert (f"snlp train: interrupted by SIGTERM: saved {out} at step {step}; continue with: torchrun "
            f"--nproc_per_node=2 -m snlp train --out {out} --device cpu --resume") in err
    for args in (["--out", str(out), "--resume"], ["--out", str(tmp_path / "ref"), *flags]):
        r = subprocess.run(["nice", "-n", "10", sys.executable, *torchrun(*args, "--stop-after", str(step + 1))],
                           capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=WAIT_S)
        assert r.returncode == 0, r.stderr[-3000:]
    assert_same_weights(weights(out), weights(tmp_path / "ref"))


@pytest.mark.slow  # one torchrun launch of two processes
def test_a_late_signal_to_another_rank_only_is_said_by_rank_0_and_exits_0(corpus, tmp_path):
    """`kill` of one worker (rank 1) in the run's last validation, after the ranks' last step reduction: the run
    finished and saved, every rank exited 0, but only rank 0 prints the "nothing to resume" line and it had not heard
    of the signal, so no line said why. Rank 0 learns of it in the final save's all-reduce, says it and records it."""
    from conftest import free_port

    out = tmp_path / "run"
    script = tmp_path / "late.py"
    script.write_text(
        "import os, signal, sys\n"
        "import snlp.train.trainer as T\n"
        "real = T.validate_and_log\n"
        "def late(run, state):  # rank 1 alone, in the validation after the last step\n"
        "    if run.ctx.rank == 1 and state.step == 3:\n"
        "        os.kill(os.getpid(), signal.SIGUSR1)\n"
        "    return real(run, state)\n"
        "T.validate_and_log = late\n"
        "from snlp.apps.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    r = subprocess.run(["nice", "-n", "10", sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", str(script), "train", "--out", str(out), "--data", str(corpus),
                        "--cache-dir", str(tmp_path / "c"), *TINY, "--steps", "3"],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (f"snlp train: SIGUSR1 arrived after the last step: the run finished and is saved in {out} (step 3); "
            f"nothing to resume") in r.stderr, r.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert (summary["steps"], summary["stopped_by"], summary["late_signal"]) == (3, "budget", "SIGUSR1")


def test_a_lora_adapt_run_stopped_by_a_signal_says_it_cannot_resume(tmp_path, monkeypatch, capsys):
    """A LoRA adaptation keeps no resumable checkpoint (--resume is refused for it): stopped by a signal it writes the
    drafter it has, removes the run's model copy and says to run again, not to resume."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    import snlp.train.adapt as A
    from test_adapt import tiny_ckpt

    tiny_ckpt(tmp_path)
    monkeypatch.chdir(tmp_path)
    fit_ = A.fit
    monkeypatch.setattr(A, "fit", lambda cfg, job, hooks=None: fit_(cfg, job, TrainHooks(
        should_stop=lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == 2 else None)))
    rc = main(["adapt", "base", "--plan", "2xF1-h0-K1", "--data", "text.txt", "--steps", "400", "--seq-len", "24",
               "--batch-size", "4", "--eval-every", "1000", "--eval-batches", "1", "--lora-rank", "2", "--no-progress",
               "--out", "d"])
    assert rc == 143 and capsys.readouterr().err.strip().splitlines()[-1] == (
        "snlp adapt: interrupted by SIGTERM: the drafter at step 2 is written to d; a LoRA run cannot be resumed: run "
        "the command again in another --out for the whole budget")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["drafter.json", "drafter.safetensors", "log.jsonl"]


# ----- signals at awkward moments
def tiny_cfg(corpus, tmp_path, out: str, **kw) -> TrainConfig:
    return TrainConfig(out=str(tmp_path / out), data=str(corpus), cache_dir=str(tmp_path / "c"), depth=2, width=32,
                       head_dim=16, vocab_size=300, seq_len=16, batch_size=2, eval_every=1000, eval_batches=1,
                       no_progress=True, device="cpu", **{"steps": 400, **kw})


def test_a_signal_the_process_was_started_ignoring_stays_ignored(corpus, tmp_path):
    """`nohup snlp train ... &` starts the run with SIGHUP ignored so that closing the terminal leaves it training;
    fit put its own handler in its place and the hang-up stopped the run. An ignored signal stays ignored (the run
    reaches its budget) and is still ignored after fit returns."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        r = fit(tiny_cfg(corpus, tmp_path, "a", steps=4),
                hooks=TrainHooks(should_stop=lambda s: os.kill(os.getpid(), signal.SIGHUP) if s == 2 else None))
        assert (r.steps, r.stopped_by, r.signal) == (4, "budget", None)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_signal_during_a_periodic_save_stops_the_run_without_writing_that_step_twice(corpus, tmp_path,
                                                                                        monkeypatch):
    """A SIGTERM that lands while --save-every writes step 3 stops the run at step 3, which is saved already: the
    stop wrote the same checkpoint a second time (a whole model copy, inside the grace before SIGKILL)."""
    import snlp.train.trainer as TR

    saves, save_run = [], TR.save_run

    def counted(out, *a, **k):
        saves.append(a[-1]["step"])
        if len(saves) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return save_run(out, *a, **k)

    monkeypatch.setattr(TR, "save_run", counted)
    r = fit(tiny_cfg(corpus, tmp_path, "a", save_every=3))
    assert (r.steps, r.stopped_by, r.signal, saves, saved_step(tmp_path / "a")) == (3, "interrupt", "SIGTERM", [3], 3)


def test_hidden_copies_of_another_out_are_not_taken_for_this_outs(tmp_path):
    """The next run on OUT removes the hidden copies of OUT's killed saves, found by a pattern made of OUT's name: a
    name such as run[12] is a pattern that matches .run1.old-PID, run1's only checkpoint after a save cut off between
    its renames, and removed it."""
    from snlp.io.checkpoint import clear_stale_saves, cut_off_save

    (tmp_path / "run[12]").mkdir()
    other = tmp_path / f".run1.old-{dead_pid()}"
    other.mkdir()
    (other / "model.safetensors").write_text("x")
    assert clear_stale_saves(tmp_path / "run[12]") == []
    assert cut_off_save(tmp_path / "run1") == other
    mine = tmp_path / f".run[12].tmp-{dead_pid()}"
    mine.mkdir()
    assert [p for p, _ in clear_stale_saves(tmp_path / "run[12]")] == [mine]


def test_an_adapt_signal_in_its_last_step_still_writes_the_drafter(tmp_path, monkeypatch, capsys):
    """A signal in the last step of `snlp adapt` (or during its final validation) reached fit after its last stop
    check: fit saved the finished run and passed the signal on, which ended the command before it wrote the
    drafter; `--resume` of the finished run was refused, so the drafter could never be written. The drafter is now
    written before the signal takes effect, and a run killed between its last save and its drafter is resumed to
    write it."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    import snlp.train.adapt as A
    from test_adapt import tiny_ckpt

    tiny_ckpt(tmp_path)
    monkeypatch.chdir(tmp_path)
    run = ["adapt", "base", "--plan", "2xF1-h0-K1", "--data", "text.txt", "--steps", "3", "--seq-len", "24",
           "--batch-size", "4", "--eval-every", "1000", "--eval-batches", "1", "--no-progress"]
    fit_ = A.fit
    monkeypatch.setattr(A, "fit", lambda cfg, job, hooks=None: fit_(cfg, job, TrainHooks(
        should_stop=lambda s: os.kill(os.getpid(), signal.SIGINT) if s == 3 else None)))
    assert main([*run, "--out", "d"]) == 130
    assert json.loads((tmp_path / "d" / "drafter.json").read_text())["record"]["steps"] == 3
    monkeypatch.setattr(A, "fit", fit_)

    def killed(*a, **k):  # the process ends between fit's last save and the drafter
        raise KeyboardInterrupt

    save_drafter = A.save_drafter
    monkeypatch.setattr(A, "save_drafter", killed)
    assert main([*run, "--out", "e"]) == 130
    assert not (tmp_path / "e" / "drafter.json").exists() and saved_step(tmp_path / "e" / "run") == 3
    monkeypatch.setattr(A, "save_drafter", save_drafter)
    capsys.readouterr()
    assert main(["adapt", "--out", "e", "--resume"]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "e" / "drafter.json").read_text())["record"]["steps"] == 3
    assert_same_weights(*(load_file(f"{x}/drafter.safetensors") for x in ("d", "e")))


def test_a_run_whose_terminal_hangs_up_saves_writes_its_summary_and_exits_129(corpus, tmp_path):
    """SIGHUP comes when the terminal closes (an ssh session drops), and from then on every write to that terminal
    fails with EIO: the run saved, then its next print (the last validation's line) raised, so train_summary.json
    was never written and the command exited 1. The run now writes on to os.devnull and ends as documented."""
    termios = pytest.importorskip("termios")
    import fcntl

    out = tmp_path / "run"
    master, slave = os.openpty()

    def terminal():  # the run's own session, with the pty as its controlling terminal (the kernel's SIGHUP)
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a suite run under nohup passes SIGHUP ignored (respected)

    p = subprocess.Popen(["nice", "-n", "10", sys.executable, "-m", "snlp", "train", "--out", str(out), "--data",
                          str(corpus), "--cache-dir", str(tmp_path / "c"), *TINY], stdin=slave, stdout=slave,
                         stderr=slave, preexec_fn=terminal, env=ENV, cwd=ROOT)
    os.close(slave)
    try:
        deadline = time.monotonic() + WAIT_S
        while not any(r["step"] >= 2 for r in step_records(out / "log.jsonl")):
            assert p.poll() is None and time.monotonic() < deadline
            if select.select([master], [], [], 0.05)[0]:
                os.read(master, 1 << 16)  # the terminal reads what the run writes
        os.close(master)  # the terminal goes away
        assert p.wait(timeout=WAIT_S) == 129
    finally:
        p.kill()
    summary = json.loads((out / "train_summary.json").read_text())
    assert (summary["stopped_by"], summary["signal"], summary["steps"]) == ("interrupt", "SIGHUP", saved_step(out))


def test_the_resume_line_of_a_multi_node_run_counts_the_processes_per_node(monkeypatch, capsys):
    """torchrun's WORLD_SIZE counts the processes of every node: a 2-node x 8-process run was told to continue with
    `torchrun --nproc_per_node=16`, which starts 16 processes on each node (32 in all, refused as another world
    size, or more processes than the node has GPUs)."""
    from snlp.apps.train import interrupted

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert interrupted("train", "runs/x", 7, "SIGTERM", ["--out", "runs/x"]) == 143
    assert capsys.readouterr().err.strip() == ("snlp train: interrupted by SIGTERM: saved runs/x at step 7; continue "
                                               "with: torchrun --nnodes=2 --nproc_per_node=8 -m snlp train --out runs/x "
                                               "--resume")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    interrupted("train", "runs/x", 7, "SIGTERM", ["--out", "runs/x"])
    assert "continue with: torchrun --nproc_per_node=2 -m snlp train" in capsys.readouterr().err


def test_the_signal_handlers_line_never_raises_into_the_step(monkeypatch):
    """The handler prints its line from inside whatever the main thread was doing; blocked in a write to stderr (a
    full pipe) when the signal lands, that print is a reentrant write Python refuses with RuntimeError, which the
    handler raised into the step: the run ended unsaved. The stop is recorded all the same."""
    from snlp.train.hooks import InterruptStop

    class Busy:
        def write(self, s):
            raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

        def flush(self):
            raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

    monkeypatch.setattr(sys, "stderr", Busy())
    stop = InterruptStop()
    stop._handler(signal.SIGTERM, None)
    assert stop() == "interrupt" and stop.signum == signal.SIGTERM


def test_no_process_test_where_os_kill_0_is_not_one(tmp_path, monkeypatch):
    """On Windows os.kill(pid, 0) is no liveness test: signal 0 is CTRL_C_EVENT, sent to pid's process group (and a
    dead pid raises OSError, not ProcessLookupError). There a killed save's copies are kept, never removed on a guess
    (and no Ctrl-C is sent)."""
    import snlp.io.checkpoint as C

    (tmp_path / "run").mkdir()
    copy = tmp_path / f".run.tmp-{dead_pid()}"
    copy.mkdir()
    sent = []
    monkeypatch.setattr(C.sys, "platform", "win32")
    monkeypatch.setattr(C.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    assert C.stale_saves(tmp_path / "run") == [] and sent == []


def test_a_process_that_steers_others_prints_on_after_its_terminal_hung_up(tmp_path):
    """snlp speedrun's parent (and bench / eval / tune) turn SIGHUP into Interrupted and print as they unwind; on a
    terminal that hung up each print raised EIO in place of the Interrupted, so the command ended with a traceback
    and status 1, not 129. raise_interrupted points the dead terminal at os.devnull first, as fit's handler does."""
    pytest.importorskip("termios")
    code = ("import os, signal, sys\n"
            "from snlp.train.hooks import Interrupted, raise_interrupted\n"
            "master, slave = os.openpty()\n"
            "os.dup2(slave, 1); os.dup2(slave, 2)\n"
            "os.close(master)  # the terminal hangs up: every write to it fails with EIO\n"
            "try:\n"
            "    raise_interrupted(signal.SIGHUP, None)\n"
            "except Interrupted as e:\n"
            "    print('snlp speedrun: interrupted by', e, flush=True)\n"
            "    sys.exit(128 + e.signum)\n")
    r = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, timeout=WAIT_S)
    assert r.returncode == 129


def test_a_sigterm_in_the_last_step_finishes_train_with_status_0_and_a_library_caller_still_gets_it(corpus, tmp_path,
                                                                                                    capsys):
    """Slurm's time limit can land in the last step: fit finishes and saves the run, then passes the signal on. The
    command ended 143 with no line, so a requeue script resumed it, and `--resume` was refused (the run is finished).
    `snlp train` now says the run finished and exits 0; a library caller (TrainHooks' default) still gets the signal
    once fit's handlers are restored, so a program that goes on after fit stops there."""
    import snlp.apps.train as T

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))  # the caller's handler (and a guard)
    try:
        last = lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == 3 else None  # noqa: E731
        real = T.file_hooks
        T.file_hooks = lambda *a, **k: TrainHooks(should_stop=last)
        try:
            out = tmp_path / "run"
            rc = main(["train", "--out", str(out), "--data", str(corpus), "--cache-dir", str(tmp_path / "c"), *TINY,
                       "--steps", "3"])
        finally:
            T.file_hooks = real
        err = capsys.readouterr().err.strip().splitlines()
        assert (rc, seen, saved_step(out)) == (0, [], 3), err[-3:]
        assert err[-1] == (f"snlp train: SIGTERM arrived after the last step: the run finished and is saved in {out} "
                           f"(step 3); nothing to resume")
        summary = json.loads((out / "train_summary.json").read_text())
        assert (summary["stopped_by"], summary["late_signal"]) == ("budget", "SIGTERM")  # why rc 0 came with a line

        cfg = TrainConfig(out=str(tmp_path / "lib"), data=str(corpus), cache_dir=str(tmp_path / "c"), depth=2,
                          width=32, head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=3, eval_every=1000,
                          eval_batches=1, no_progress=True, device="cpu")
        r = fit(cfg, hooks=TrainHooks(should_stop=last))
        assert seen == [signal.SIGTERM] and r.late_signal == "SIGTERM" and saved_step(cfg.out) == 3
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_while_the_data_loads_saves_step_0_so_the_resume_its_status_asks_for_works(corpus, tmp_path,
                                                                                            capsys, monkeypatch):
    """A signal before the loop (the tokenizer training, the corpus tokenized, the model built: setup) took its
    default action: exit 143 with no line and nothing saved, and the `--resume` a requeue script runs on a status
    above 128 was refused (no checkpoint in OUT). fit now holds it from setup on: the loop stops before step 1,
    saves step 0 and says how to continue, and the resumed run trains to the weights of a run never stopped."""
    import snlp.train.trainer as trainer

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))  # a guard: the default would end pytest
    try:
        real = trainer.apply_freeze

        def freeze_then_signal(*a, **k):  # inside setup, after the data and the model are made
            os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **k)

        monkeypatch.setattr(trainer, "apply_freeze", freeze_then_signal)
        out = tmp_path / "run"
        flags = ["--data", str(corpus), "--cache-dir", str(tmp_path / "c"), *TINY]
        rc = main(["train", "--out", str(out), *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert (rc, seen) == (128 + signal.SIGTERM, []), err[-3:]
        assert saved_step(out) == 0
        assert err[-1] == (f"snlp train: interrupted by SIGTERM: saved {out} at step 0; continue with: snlp train "
                           f"--out {out} --device cpu --resume")
        # no step-0 validation after the stop: on a big model that pass could outlast the grace before SIGKILL
        log = out / "log.jsonl"
        assert [json.loads(line) for line in (log.read_text().splitlines() if log.exists() else [])] == []
        assert json.loads((out / "train_summary.json").read_text())["validation"] is None
        monkeypatch.setattr(trainer, "apply_freeze", real)
        assert main(["train", "--out", str(out), "--resume", "--stop-after", "2"]) == 0
        assert "val_loss" in json.loads((out / "log.jsonl").read_text().splitlines()[0])  # the resume validates it
        assert main(["train", "--out", str(tmp_path / "ref"), *flags, "--stop-after", "2"]) == 0
        assert_same_weights(weights(out), weights(tmp_path / "ref"))
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_in_the_setup_of_a_run_that_ends_at_step_0_still_validates_it(corpus, tmp_path, capsys,
                                                                                  monkeypatch):
    """A signal during setup skips step 0's validation and saves step 0; --stop-after 0 then ended the run by its own
    limit, so it exited 0 saying "the run finished ... nothing to resume" with step 0 never validated (no log row,
    "validation": null) where the same run unsignalled logs its val_loss: a requeue script took the missing
    validation for done (and its resume, --stop-after 0 at step 0, is refused). A run that ends at step 0 by its own
    limit validates it, as the unsignalled run does."""
    import snlp.train.trainer as trainer

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))  # a guard: the default would end pytest
    try:
        real = trainer.apply_freeze

        def freeze_then_signal(*a, **k):  # inside setup
            os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **k)

        flags = ["--data", str(corpus), "--cache-dir", str(tmp_path / "c"), *TINY, "--stop-after", "0"]
        assert main(["train", "--out", str(tmp_path / "ref"), *flags]) == 0
        monkeypatch.setattr(trainer, "apply_freeze", freeze_then_signal)
        out = tmp_path / "run"
        rc = main(["train", "--out", str(out), *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert (rc, seen, saved_step(out)) == (0, [], 0), err[-3:]
        logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        assert logged == [json.loads(line) for line in (tmp_path / "ref" / "log.jsonl").read_text().splitlines()]
        assert "val_loss" in logged[0]
        summary = json.loads((out / "train_summary.json").read_text())
        assert summary["validation"] == json.loads((tmp_path / "ref" / "train_summary.json").read_text())["validation"]
        assert (summary["stopped_by"], summary["late_signal"]) == ("stop_after", "SIGTERM")
        assert_same_weights(weights(out), weights(tmp_path / "ref"))
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_in_adapts_last_step_writes_the_drafter_says_so_and_exits_0(tmp_path, monkeypatch, capsys):
    """As for `snlp train` and `sft`: a signal in the last step of `snlp adapt` found the run finished, wrote the
    drafter, then ended the process with the signal (143, no line), so a requeue script ran `--resume`, refused (the
    drafter is finished). It now says the run finished and exits 0; adapt() for a library caller (TrainHooks'
    default) still passes the signal on once the drafter is written."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    import snlp.train.adapt as A
    from test_adapt import tiny_ckpt

    tiny_ckpt(tmp_path)
    monkeypatch.chdir(tmp_path)
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))  # a guard: the default would end pytest
    try:
        fit_ = A.fit
        last = lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == 3 else None  # noqa: E731
        monkeypatch.setattr(A, "fit", lambda cfg, job, hooks=None: fit_(cfg, job, replace(
            hooks or TrainHooks(), should_stop=last)))
        run = ["adapt", "base", "--plan", "2xF1-h0-K1", "--data", "text.txt", "--steps", "3", "--seq-len", "24",
               "--batch-size", "4", "--eval-every", "1000", "--eval-batches", "1", "--no-progress"]
        rc = main([*run, "--out", "d"])
        err = capsys.readouterr().err.strip().splitlines()
        assert (rc, seen) == (0, []), err[-3:]
        assert json.loads((tmp_path / "d" / "drafter.json").read_text())["record"]["steps"] == 3
        assert err[-1] == ("snlp adapt: SIGTERM arrived after the last step: the run finished and is saved in d "
                           "(step 3); nothing to resume")
    finally:
        signal.signal(signal.SIGTERM, previous)

"""A training run owns its output folder and loses nothing to bad input or an interrupt: a second run on the same
--out is refused while the first holds it; an output path that cannot be written is refused before any work;
Ctrl-C stops after the step in progress and saves; a resume never duplicates logged steps; the checkpoint records
where its token cache is; --reg none warns of no regulariser clipping."""

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from snlp.apps.cli import main
from snlp.eval.data import checkpoint_data, validation_tokens
from snlp.io.checkpoint import load
from snlp.train.config import TrainConfig
from snlp.train.hooks import TrainHooks
from snlp.train.trainer import fit

SHAKESPEARE = Path(__file__).resolve().parents[1] / "data/tinyshakespeare-head.txt"
TINY = ["--depth", "3", "--width", "32", "--head-dim", "16", "--vocab-size", "300", "--seq-len", "32",
        "--batch-size", "4", "--eval-every", "100", "--eval-batches", "1", "--no-progress", "--device", "cpu"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "c.txt").write_text(SHAKESPEARE.read_text()[:60_000])
    return d / "c.txt"


def cfg(out, corpus, cache, **kw) -> TrainConfig:
    return TrainConfig(**{**dict(out=str(out), data=str(corpus), cache_dir=str(cache), depth=3, width=32, head_dim=16,
                                 vocab_size=300, seq_len=32, batch_size=4, eval_every=100, eval_batches=1,
                                 no_progress=True, device="cpu"), **kw})


def log_steps(out) -> list[int]:
    """The step of every per-step record (validation records carry val_loss)."""
    recs = [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]
    return [r["step"] for r in recs if "loss" in r and "val_loss" not in r]


# ----- one run per output folder
def test_a_second_run_on_a_locked_out_is_refused_in_one_line(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen(  # another process: a run in progress holding --out
        [sys.executable, "-c", "import sys, time\nfrom snlp.runtime.outputs import locked_output\n"
         f"with locked_output({str(out)!r}):\n    print('held', flush=True)\n    time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        rc = main(["train", "--out", str(out), "--data", str(corpus), "--cache-dir", str(tmp_path / "c"), *TINY,
                   "--steps", "1"])
        err = capsys.readouterr().err
        assert rc == 2 and f"--out {out} is in use by a run in progress (pid {holder.pid})" in err
        assert len(err.strip().splitlines()) == 1
        assert not (out / "log.jsonl").exists() and not (out / "model.safetensors").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone (killed: the kernel released its lock): the folder is free again
    assert main(["train", "--out", str(out), "--data", str(corpus), "--cache-dir", str(tmp_path / "c"), *TINY,
                 "--steps", "1"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no lock file left


def test_the_lock_is_held_during_the_run(corpus, tmp_path):
    """Inside a run (a hook asked between steps), a second fit on the same folder is refused."""
    seen = []

    def probe(steps_done):
        if steps_done == 1 and not seen:
            with pytest.raises(ValueError, match="is in use by a run in progress"):
                fit(cfg(tmp_path / "run", corpus, tmp_path / "c", steps=1))
            seen.append(True)
        return None

    fit(cfg(tmp_path / "run", corpus, tmp_path / "c", steps=2), hooks=TrainHooks(should_stop=probe))
    assert seen


def test_snlp_adapt_locks_its_out_too(tmp_path, capsys):
    from snlp.runtime.outputs import locked_output

    out = tmp_path / "drafter"
    with locked_output(out):  # the run in progress (flock: a second open file description conflicts in-process too)
        rc = main(["adapt", str(tmp_path / "no-such-base"), "--plan", "2xF1-h0-K1", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and f"--out {out} is in use by a run in progress (pid {os.getpid()})" in err


# ----- output paths checked before any work
@pytest.mark.parametrize("argv,msg", [
    (["train", "--out", "{file}"], "--out {file} exists and is a file, not a folder"),
    (["train", "--out", "{file}/sub"], "--out {file}/sub: {file} is a file, not a folder"),
    (["eval", "{ckpt}", "--plans", "2xF1-h0-K1", "--json", "{file}/r.json"], "--json {file}/r.json: {file} is a file"),
    (["eval", "{ckpt}", "--plans", "2xF1-h0-K1", "--csv", "{dir}"], "--csv {dir} is a folder; name a file"),
    (["generate", "{ckpt}", "--json", "{file}/g.json"], "--json {file}/g.json: {file} is a file"),
    (["eval", "{ckpt}", "--plans", "2xF1-h0-K1", "--plot", "{dir}/f.xyz"], "--plot {dir}/f.xyz: name a file ending in"),
    (["calibrate", "{ckpt}", "--out", "{dir}"], "--out {dir} is a folder; name a file"),
])
def test_unwritable_outputs_are_refused_before_any_work(tmp_path, capsys, argv, msg):
    f = tmp_path / "a-file"
    f.write_text("x")
    subs = {"file": str(f), "dir": str(tmp_path), "ckpt": str(tmp_path / "no-such-ckpt")}
    # the checkpoint does not exist either: the output error (not the checkpoint one) shows the check came first
    rc = main([a.format(**subs) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and msg.format(**subs) in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv,msg", [
    (["eval", "{ckpt}", "--plans", "2xF1-h0-K1", "--json", "{tmp}/r.out", "--csv", "{tmp}/./r.out"],
     "--csv {tmp}/./r.out is the file --json writes too"),
    (["eval", "{ckpt}", "--plans", "2xF1-h0-K1", "--json", "{ckpt}/config.json"], "--json {ckpt}/config.json is a file "
     "of the checkpoint, drafter or run in {ckpt}"),
    (["bench", "--json", "{ckpt}/log.jsonl"], "is a file of the checkpoint, drafter or run in {ckpt}"),
    # the checkpoint's preheat calibration (snlp calibrate): a result over it left every preheat plan failing to load
    (["generate", "{ckpt}", "--json", "{ckpt}/preheat.pt"], "is a file of the checkpoint, drafter or run in {ckpt}"),
    (["eval", "{ckpt}", "--plans", "2xF1-preheat-K1", "--markdown", "{ckpt}/preheat.pt"],
     "is a file of the checkpoint, drafter or run in {ckpt}"),
    (["bench", "--json", "{drafter}/drafter.json"], "is a file of the checkpoint, drafter or run in {drafter}"),
    (["generate", "{ckpt}", "--prompts-file", "{tmp}/p.txt", "--json", "{tmp}/p.txt"],
     "--json {tmp}/p.txt is the file --prompts-file reads"),
    (["eval", "{ckpt}", "--plans", "2xF1-h0-K1", "--data", "{tmp}/a.txt,{tmp}/p.txt", "--markdown", "{tmp}/p.txt"],
     "--markdown {tmp}/p.txt is the file --data reads"),
    # a chat: / mc: data part, a glob, a --chat-prompts set: the file under the prefix or the pattern is read too
    (["adapt", "{ckpt}", "--plan", "2xF1-h0-K1", "--out", "{tmp}/new-d", "--data", "chat:{tmp}/p.txt", "--json",
      "{tmp}/p.txt"], "--json {tmp}/p.txt is the file --data reads"),
    (["eval", "{ckpt}", "--plans", "2xF1-h0-K1", "--data", "{tmp}/p*.txt", "--csv", "{tmp}/p.txt"],
     "--csv {tmp}/p.txt is the file --data reads"),
    (["eval", "{ckpt}", "--plans", "2xF1-h0-K1", "--drafter", "{drafter}", "--chat-prompts", "chat:{tmp}/p.txt",
      "--json", "{tmp}/p.txt"], "--json {tmp}/p.txt is the file --chat-prompts reads"),
    # the drafter folder adapt is about to write (empty now): its result went over the new drafter's drafter.json
    (["adapt", "{ckpt}", "--plan", "2xF1-h0-K1", "--out", "{tmp}/new-d", "--json", "{tmp}/new-d/drafter.json"],
     "--json {tmp}/new-d/drafter.json is a file of the checkpoint, drafter or run in {tmp}/new-d"),
    (["adapt", "{ckpt}", "--plan", "2xF1-h0-K1", "--out", "{tmp}/new-d", "--json", "{tmp}/new-d/log.jsonl"],
     "--json {tmp}/new-d/log.jsonl is a file of the checkpoint, drafter or run in {tmp}/new-d"),
])
def test_an_output_over_an_input_another_output_or_a_models_file_is_refused(tmp_path, capsys, argv, msg):
    """An output file that another output flag, an input flag or a checkpoint / drafter folder also names: the
    result replaced the other result, the prompts or data the run read, or the model's own file (the folder then loads
    as nothing). Refused in one line before any work, every file as it was."""
    ckpt, drafter = tmp_path / "ckpt", tmp_path / "drafter"
    for d, names in ((ckpt, ("model.safetensors", "config.json", "preheat.pt")), (drafter, ("drafter.json",))):
        d.mkdir()
        for n in names:
            (d / n).write_text("the model's own")
    (tmp_path / "p.txt").write_text("a prompt\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    subs = {"tmp": str(tmp_path), "ckpt": str(ckpt), "drafter": str(drafter)}
    rc = main([a.format(**subs) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and msg.format(**subs) in err and len(err.strip().splitlines()) == 1, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    # calibrate's own output file in a checkpoint, and a result written beside the model, stay allowed
    from snlp.apps.cli import build_parser, check_outputs

    for argv in (["calibrate", str(ckpt), "--out", str(ckpt / "preheat.pt")],
                 ["eval", str(ckpt), "--plans", "2xF1-h0-K1", "--json", str(ckpt / "eval.json")],
                 ["adapt", str(ckpt), "--plan", "2xF1-h0-K1", "--out", str(tmp_path / "d"), "--json",
                  str(tmp_path / "d" / "result.json")],
                 # a prompt is text, even one that reads like the output's path or a glob matching it
                 ["generate", str(ckpt), "--prompt", str(tmp_path / "p.txt"), "--json", str(tmp_path / "p.txt")],
                 ["generate", str(ckpt), "--prompt", str(tmp_path / "p*"), "--json", str(tmp_path / "p.txt")]):
        parser = build_parser(argv[0])
        args = parser.parse_args(argv)
        check_outputs(parser, args)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in read-only folders")
def test_read_only_out_is_refused(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert main(["train", "--out", str(ro / "run"), *TINY]) == 2
        assert "cannot write in" in capsys.readouterr().err
    finally:
        ro.chmod(0o700)


def test_a_read_only_folder_is_named(tmp_path, capsys, monkeypatch):
    """A folder the probe file cannot be created in (a read-only mount: simulated, root writes everywhere)."""
    import snlp.runtime.outputs as O

    def refuse(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(O.tempfile, "mkstemp", refuse)
    assert main(["eval", str(tmp_path / "ck"), "--plans", "2xF1-h0-K1", "--json", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert f"--json {tmp_path / 'r.json'}: cannot write in {tmp_path} (Read-only file system)" in err


def test_json_results_are_written_atomically(tmp_path, monkeypatch):
    """A write that fails half-way leaves the previous file whole, and no temporary beside it."""
    from snlp.runtime.device import write_json

    path = tmp_path / "r.json"
    write_json(path, {"a": 1})

    real = Path.write_text

    def broken(self, text, *a, **k):  # the disk fills up half-way through the write
        real(self, text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", broken)
    with pytest.raises(OSError):
        write_json(path, {"a": 2})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"a": 1} and list(tmp_path.iterdir()) == [path]


# ----- interrupts, resume, the log
def test_ctrl_c_stops_after_the_step_saves_and_resume_matches_an_uninterrupted_run(corpus, tmp_path):
    cache = tmp_path / "cache"
    full = fit(cfg(tmp_path / "full", corpus, cache, steps=6))
    assert full.steps == 6

    def ctrl_c_at(step):
        def hook(steps_done):
            if steps_done == step:
                os.kill(os.getpid(), signal.SIGINT)  # what a terminal's Ctrl-C sends
            return None
        return TrainHooks(should_stop=hook)

    part = fit(cfg(tmp_path / "part", corpus, cache, steps=6), hooks=ctrl_c_at(3))
    assert part.stopped_by == "interrupt" and part.steps == 3
    assert load_file(str(tmp_path / "part" / "model.safetensors"))  # saved
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    # a run killed later (after its last save) had logged steps 4 and 5: resume must not log them twice
    with open(tmp_path / "part" / "log.jsonl", "a") as f:
        for s in (4, 5):
            f.write(json.dumps({"step": s, "loss": 9.0, "reg": 0.0}) + "\n")
    fit(cfg(tmp_path / "part", corpus, cache, steps=6, resume=True))
    assert log_steps(tmp_path / "full") == [1, 6]  # step 1 and the end (log_every 10)
    # the killed run's 4 and 5 dropped, nothing twice; 3: the interrupted leg's last trained step, logged before its
    # stop row (a run ends with its last step's row, off --log-every as a stop is)
    assert log_steps(tmp_path / "part") == [1, 3, 6]
    recs = [json.loads(line) for line in (tmp_path / "part" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "val_loss" in r] == [0, 3, 6]  # validated at the interrupt, then the end
    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "model.safetensors"))
    for k in a:  # the outside reference: the same 6 steps run without an interrupt
        assert torch.equal(a[k], b[k]), k


def test_resume_with_only_out_continues_the_saved_run_bitwise(corpus, tmp_path):
    """`snlp train --out X --resume` (no other flag) continues X's run with its saved data, batch, schedule and
    regulariser: the same weights as the run never stopped (the reference: that uninterrupted run)."""
    flags = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "4", "--reg", "idn",
             "--reg-n", "2", "--reg-rows", "0.5", "--warmup-steps", "1", "--seed", "3", "--grad-accum", "2"]
    assert main(["train", "--out", str(tmp_path / "full"), *flags]) == 0
    assert main(["train", "--out", str(tmp_path / "part"), *flags, "--stop-after", "2"]) == 0
    assert main(["train", "--out", str(tmp_path / "part"), "--resume"]) == 0
    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    full, part = (torch.load(tmp_path / d / "train_state.pt", weights_only=False) for d in ("full", "part"))
    assert part["step"] == 4 and part["tokens"] == full["tokens"]
    skip = ("out", "stop_after", "resume", "device")  # the device is the machine's, never the saved run's
    assert {k: v for k, v in part["args"].items() if k not in skip} == \
        {k: v for k, v in full["args"].items() if k not in skip}


def test_resume_refuses_a_flag_that_would_change_the_run_and_touches_nothing(corpus, tmp_path, capsys):
    out = tmp_path / "part"
    assert main(["train", "--out", str(out), "--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY,
                 "--steps", "4", "--stop-after", "2"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    rc = main(["train", "--out", str(out), "--resume", "--seq-len", "64", "--reg", "idn", "--depth", "3"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "--seq-len 32 (given: 64)" in err and "--reg 'none' (given: 'idn')" in err
    assert "--depth" not in err  # typed, but the saved value: nothing changes
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing written
    # the budget, logging and the device may change: a longer run, validating every step
    assert main(["train", "--out", str(out), "--resume", "--steps", "3", "--eval-every", "1"]) == 0
    st = torch.load(out / "train_state.pt", weights_only=False)
    assert st["step"] == 3 and st["args"]["eval_every"] == 1 and st["args"]["seq_len"] == 32


SFT_FLAGS = ("--warmup-steps", "--grad-clip", "--reg-lambda")  # snlp sft's (its LRs: --lr-scale); adapt: the first two
BAD_SETTINGS = [
    ("--warmup-steps", "-1"),  # lr_multiplier -(step + 1): an ascent that grows every step
    ("--embedding-lr", "-0.1"), ("--unembedding-lr", "nan"), ("--scalar-lr", "-1"), ("--hc-lr", "inf"),
    ("--matrix-lr", "-0.02"), ("--weight-decay", "-1"), ("--grad-clip", "-1"), ("--max-chars", "-5"),
    ("--reg-lambda", "nan"), ("--reg-lambda", "inf"),
    ("--stop-after", "-1"),  # stopped at step 0 as --stop-after 0 does, status 0
    ("--seed", "-1"),  # numpy's "expected non-negative integer" at the first batch, after step 0's validation
]


@pytest.mark.parametrize("command, flag, value", [("train", f, v) for f, v in BAD_SETTINGS]
                         + [(c, f, v) for c in ("sft", "adapt") for f, v in BAD_SETTINGS if f in SFT_FLAGS[:2]]
                         + [("sft", f, v) for f, v in BAD_SETTINGS if f == "--reg-lambda"]
                         + [("adapt", "--max-chars", "-5")]  # adapt's own cap (its loop's settings take none)
                         + [("sft", "--lr-scale", v) for v in ("nan", "inf")])  # sft's LRs (was named --matrix-lr)
def test_a_setting_no_run_can_use_is_refused_before_any_work(command, flag, value, corpus, tmp_path, capsys):
    """A negative warm-up, learning rate, weight decay, clip norm or --max-chars, or a NaN / infinite --reg-lambda, is
    one line naming the flag before the data or the model is read (they trained before: ascent, a regulariser that
    a NaN turned off, a misleading "one document")."""
    out = tmp_path / "run"
    argv = {"train": ["train", "--out", str(out), "--data", str(corpus), *TINY, "--reg", "idn"],
            "sft": ["sft", str(tmp_path / "none"), "--data", str(tmp_path / "none.jsonl"), "--out", str(out), "--reg",
                    "idn"],
            "adapt": ["adapt", str(tmp_path / "none"), "--plan", "1xF1-h0-K1", "--out", str(out)]}[command]
    capsys.readouterr()
    assert main([*argv, flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"snlp {command}: error: {flag}") and "must be" in err, err
    assert not out.exists()


def test_a_zero_matrix_lr_is_honoured():
    """--matrix-lr 0 freezes the block matrices (it gave the default LR: 0 read as "not given")."""
    from snlp.model.gpt import GPT, GPTConfig
    from snlp.train.optim import build_optimizers

    model = GPT(GPTConfig.from_depth(2, width=32, head_dim=16, vocab_size=64, sequence_len=16))
    for optimizer in ("muon", "adamw"):
        opts = build_optimizers(model, TrainConfig(out="", optimizer=optimizer, matrix_lr=0.0))
        blocks = {id(p) for p in model.blocks.parameters() if p.ndim == 2}
        lrs = {g["lr"] for o in opts for g in o.param_groups if any(id(p) in blocks for p in g["params"])}
        assert lrs == {0.0}, (optimizer, lrs)


def test_a_stop_file_left_at_a_reached_step_is_refused_before_any_work(corpus, tmp_path, capsys):
    """An earlier run's --stop-file left in place (step 0 here, or a resumed run's saved step) stopped the run before
    its first step: a checkpoint of no training, status 0. Refused in one line; a later step stops there."""
    out, stop = tmp_path / "run", tmp_path / "stop"
    flags = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "4"]
    stop.write_text("0")
    capsys.readouterr()
    assert main(["train", "--out", str(out), *flags, "--stop-file", str(stop)]) == 2
    assert main(["sft", str(tmp_path / "base"), "--data", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "sft"),
                 "--stop-file", str(stop)]) == 2
    assert not out.exists() and not (tmp_path / "sft").exists()
    stop.write_text("2")
    assert main(["train", "--out", str(out), *flags, "--stop-file", str(stop)]) == 0
    assert main(["train", "--out", str(out), "--resume", "--stop-file", str(stop)]) == 2
    err = capsys.readouterr().err.splitlines()
    says = [e for e in err if "error:" in e]
    assert len(says) == 3 and all("stop at step 0 and the run starts at step 0" in e for e in says[:2]), err
    assert says[1].startswith("snlp sft: error: --stop-file") and "stop at step 2 and the run starts at step 2" in says[2]
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 2


def test_a_stop_file_left_holding_text_is_refused_before_any_work(corpus, tmp_path, capsys):
    """A stop file holding "stop" stops the run at once (snlp.apps.train.read_stop_file): left in place from an earlier
    run it would stop before the first step, so it is refused as a reached step is, in one line, nothing made."""
    out, stop = tmp_path / "run", tmp_path / "stop"
    stop.write_text("stop\n")
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY,
                 "--steps", "4", "--stop-file", str(stop)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"snlp train: error: --stop-file {stop} already holds 'stop', not a step number, which stops the "
                   f"run at once: it would stop before its first step; remove the file, or write the step to stop "
                   f"after in it"), err
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_a_save_cut_off_between_its_renames_is_named_not_started_over(corpus, tmp_path, capsys):
    """save_checkpoint moves the previous checkpoint to .NAME.old-PID, then the new one in: a kill in between left no
    --out, so --resume said "no checkpoint" and a new run started from nothing while the last checkpoint sat hidden.
    Both are refused in one line naming where it is; moved back, the run resumes."""
    out = tmp_path / "run"
    fit(cfg(out, corpus, tmp_path / "cache", steps=4, stop_after=2))
    hidden = tmp_path / ".run.old-12345"
    os.replace(out, hidden)  # the state a kill between the two renames leaves
    capsys.readouterr()
    flags = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "4"]
    assert main(["train", "--out", str(out), "--resume"]) == 2
    assert main(["train", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(f"its last checkpoint is in {hidden}" in e for e in err), err
    assert not out.exists()
    os.replace(hidden, out)
    assert main(["train", "--out", str(out), "--resume"]) == 0
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 4


def test_a_new_run_sets_aside_the_log_of_a_run_killed_before_its_first_save(corpus, tmp_path, capsys):
    """A run killed (SIGKILL, a second Ctrl-C) before its first save leaves --out with a log.jsonl and no checkpoint;
    the next run there appended its records to that log (two step 0s, the dead run's curve read as this one's). The
    old log is moved to log.unsaved.jsonl, whole, and said; the new log holds this run's records only."""
    out = tmp_path / "run"
    out.mkdir()
    dead = "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(1, 8))
    (out / "log.jsonl").write_text(dead)
    fit(cfg(out, corpus, tmp_path / "cache", steps=2))
    assert log_steps(out) == [1, 2]
    assert (out / "log.unsaved.jsonl").read_text() == dead
    assert "log.unsaved.jsonl" in capsys.readouterr().err


def test_a_second_dead_runs_log_does_not_replace_the_first(tmp_path):
    """Two runs killed before their first save, one after the other, in one --out: each log is set aside under its
    own name (the second replaced the first's log.unsaved.jsonl)."""
    from snlp.train.checkpointing import set_aside_unsaved_log

    logs = [f'{{"step": 1, "loss": {x}}}\n' for x in (9.0, 8.0, 7.0)]
    for text in logs:
        (tmp_path / "log.jsonl").write_text(text)
        set_aside_unsaved_log(tmp_path / "log.jsonl")
    assert not (tmp_path / "log.jsonl").exists()
    assert [(tmp_path / n).read_text() for n in ("log.unsaved.jsonl", "log.unsaved.2.jsonl", "log.unsaved.3.jsonl")] \
        == logs


def test_a_resume_with_no_step_left_is_refused_and_the_finished_run_kept(corpus, tmp_path, capsys):
    """`--resume` of a finished run without a larger budget, or with a --stop-after at or before its step, has no
    step to run: refused in one line, the checkpoint and train_summary.json (the run's validation and speed) as they
    were; a larger budget continues it."""
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY,
                 "--steps", "3"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert json.loads(before["train_summary.json"])["validation"] is not None
    capsys.readouterr()
    for extra, says in (([], "is done (step 3, --steps 3)"), (["--steps", "2"], "is done (step 3, --steps 2)"),
                        (["--minutes", "0.0001"], "is done (step 3, --minutes 0.0001"),
                        (["--steps", "5", "--stop-after", "3"], "at step 3 already: --stop-after 3")):
        assert main(["train", "--out", str(out), "--resume", *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    # the library (snlp speedrun and sft-grid reuse a finished run this way): no step, nothing rewritten
    saved = torch.load(out / "train_state.pt", weights_only=False)["args"]
    again = TrainConfig(**{**{k: saved[k] for k in saved if k in TrainConfig.__dataclass_fields__}, "resume": True,
                           "device": "cpu"})
    assert fit(again).steps == 3
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert main(["train", "--out", str(out), "--resume", "--steps", "4"]) == 0
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 4


def test_a_resume_stopped_before_its_first_step_says_why_not_that_its_budget_is_spent(corpus, tmp_path, capsys):
    """A resumed run with steps left that a Ctrl-C (or another hook) stops before its first step keeps its
    checkpoint as it was, and says it was stopped: it said its budget or --stop-after was reached, 45 steps short."""
    out = tmp_path / "run"
    fit(cfg(out, corpus, tmp_path / "cache", steps=3))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    res = fit(cfg(out, corpus, tmp_path / "cache", steps=48, resume=True),
              hooks=TrainHooks(should_stop=lambda steps_done: "interrupt"))
    said = capsys.readouterr().out
    assert res.steps == 3 and res.stopped_by == "interrupt"
    assert "stopped (interrupt) before its first step at step 3" in said and "budget" not in said, said
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_a_resumed_runs_speed_line_names_the_step_it_timed_first(corpus, tmp_path, capsys):
    """The speed line's and train_summary.json's first-step time is this process's first step: in a run resumed from
    step 2 that is step 3 (its log row's step_s), which the line called "step 1"."""
    out = tmp_path / "run"
    fit(cfg(out, corpus, tmp_path / "cache", steps=6, stop_after=2, log_every=1))
    capsys.readouterr()
    res = fit(cfg(out, corpus, tmp_path / "cache", steps=6, resume=True, log_every=1))
    said = capsys.readouterr().out
    rows = {r["step"]: r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r}
    summary = json.loads((out / "train_summary.json").read_text())["speed"]
    assert summary["first_step"] == res.speed.first_step == 3
    assert summary["first_step_s"] == rows[3]["step_s"]  # the timed step is the log's step 3
    assert f"step 3 took {rows[3]['step_s']:.1f}s" in said and "step 1 took" not in said, said
    fresh = fit(cfg(tmp_path / "fresh", corpus, tmp_path / "cache", steps=2, log_every=1))
    assert fresh.speed.first_step == 1


def test_the_library_refuses_resuming_with_other_settings_before_loading(corpus, tmp_path):
    cache = tmp_path / "cache"
    fit(cfg(tmp_path / "run", corpus, cache, steps=4, stop_after=2))
    with pytest.raises(ValueError, match=r"--batch-size 4 \(given: 8\)"):
        fit(cfg(tmp_path / "run", corpus, cache, steps=4, batch_size=8, resume=True))
    with pytest.raises(ValueError, match=r"--data .* \(given: 'stdlib'\)"):  # a config of defaults: refused
        fit(TrainConfig(out=str(tmp_path / "run"), resume=True))
    # a checkpoint from before a field existed held its default: resuming with the default passes
    st_path = tmp_path / "run" / "train_state.pt"
    st = torch.load(st_path, weights_only=False)
    del st["args"]["reg_rows"]
    torch.save(st, st_path)
    assert fit(cfg(tmp_path / "run", corpus, cache, steps=4, resume=True)).steps == 4


def test_resume_from_another_folder_reads_the_same_relative_data_and_keeps_the_process_count(
        corpus, tmp_path, monkeypatch, capsys):
    """A run started with a relative --data resumes from any folder (the checkpoint records the files absolute) into
    the uninterrupted run's weights; a resume with another number of processes is refused (each reads its own share
    of the batch)."""
    (tmp_path / "elsewhere").mkdir()
    flags = ["--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "4"]
    assert main(["train", "--out", str(tmp_path / "full"), "--data", str(corpus), *flags]) == 0
    monkeypatch.chdir(corpus.parent)
    assert main(["train", "--out", str(tmp_path / "part"), "--data", corpus.name, *flags, "--stop-after", "2"]) == 0
    st = torch.load(tmp_path / "part" / "train_state.pt", weights_only=False)
    assert st["args"]["data"] == str(corpus) and st["world"] == 1
    monkeypatch.chdir(tmp_path / "elsewhere")
    # the same file named absolute is the saved setting, not a change
    assert main(["train", "--out", str(tmp_path / "part"), "--resume", "--data", str(corpus), "--stop-after", "3"]) == 0
    assert main(["train", "--out", str(tmp_path / "part"), "--resume"]) == 0
    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    st = torch.load(tmp_path / "part" / "train_state.pt", weights_only=False)
    st["world"] = 2  # as torchrun --nproc_per_node=2 would have saved it
    torch.save(st, tmp_path / "part" / "train_state.pt")
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "part"), "--resume", "--steps", "5"]) == 2
    assert "saved by 2 process(es) and this one has 1" in capsys.readouterr().err


def test_a_moved_project_resumes_with_data_saying_where_its_files_are_now(corpus, tmp_path, monkeypatch, capsys):
    import shutil

    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    shutil.copy(corpus, proj / "data" / "c.txt")
    flags = ["--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "4"]
    assert main(["train", "--out", str(tmp_path / "full"), "--data", str(corpus), *flags]) == 0
    monkeypatch.chdir(proj)
    assert main(["train", "--out", "runs/x", "--data", "data/c.txt", *flags, "--stop-after", "2"]) == 0
    monkeypatch.chdir(tmp_path)
    shutil.move(proj, tmp_path / "proj2")
    monkeypatch.chdir(tmp_path / "proj2")
    capsys.readouterr()
    assert main(["train", "--out", "runs/x", "--resume"]) == 2
    assert "not there any more" in capsys.readouterr().err
    saved = torch.load(Path("runs/x/train_state.pt"), weights_only=False)["args"]
    with pytest.raises(ValueError, match="not there any more"):  # the library says it too, not a bare loader error
        fit(TrainConfig(**{**{k: v for k, v in saved.items() if k in TrainConfig.__dataclass_fields__},
                           "out": "runs/x", "resume": True, "stop_after": None}))
    (tmp_path / "proj2" / "other.txt").write_text(corpus.read_text()[:30_000])  # another text: refused
    assert main(["train", "--out", "runs/x", "--resume", "--data", "other.txt"]) == 2
    assert "names, sizes or order differ" in capsys.readouterr().err
    assert main(["train", "--out", "runs/x", "--resume", "--data", "data/c.txt"]) == 0
    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "proj2" / "runs" / "x" / "model.safetensors"))
    for k in a:  # the same text from its new place: the same run
        assert torch.equal(a[k], b[k]), k


def test_an_init_from_run_keeps_its_origin_through_resumes_and_refuses_shape_flags(corpus, tmp_path, capsys,
                                                                                     monkeypatch):
    """--init-from typed relative is recorded absolute (a resume from another folder names the same checkpoint);
    shape flags are refused beside it and on its resumes, naming the checkpoint, not the unused default shape."""
    cache = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache")]
    assert main(["train", "--out", str(tmp_path / "base"), *cache, *TINY, "--steps", "1"]) == 0
    tune = [*cache, "--seq-len", "32", "--batch-size", "4", "--eval-every", "100", "--eval-batches", "1",
            "--no-progress", "--device", "cpu", "--steps", "4"]
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "ft"), "--init-from", str(tmp_path / "base"), *tune,
                 "--depth", "3"]) == 2  # the shape is the checkpoint's: refused, not ignored
    assert "drop --depth" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "ft"), "--init-from", str(tmp_path / "base"), *tune,
                 "--depth", "8", "--window-pattern", "L"]) == 2  # typed at their defaults: refused all the same
    assert "drop --depth, --window-pattern" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--out", str(tmp_path / "ft"), "--init-from", "base", *tune, "--stop-after", "1"]) == 0
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    for stop in ("2", "4"):  # two resumes, from another folder: the record keeps where the run started
        assert main(["train", "--out", str(tmp_path / "ft"), "--resume", "--stop-after", stop]) == 0
        st = torch.load(tmp_path / "ft" / "train_state.pt", weights_only=False)
        assert st["args"]["init_from"] == str(tmp_path / "base") and st["step"] == int(stop)
    capsys.readouterr()
    for depth in ("3", "8"):  # the checkpoint's real depth (3) or the unused default (8): the model is base's
        assert main(["train", "--out", str(tmp_path / "ft"), "--resume", "--depth", depth, "--steps", "5"]) == 2
        err = capsys.readouterr().err
        assert f"the model is {tmp_path / 'base'}'s, as --init-from took it: shape flags do not apply" in err
        assert "drop --depth" in err and "--depth 8" not in err, err


def test_what_a_resume_takes_from_the_saved_run():
    """The budget is one setting (a typed --steps drops a saved --minutes and the other way round), the device is
    the machine's, and an --init-from run's shape flags are refused, saying why."""
    from snlp.train.config import check_resume_settings, resume_changes, resumed

    saved = {**vars(TrainConfig(out="x", minutes=3.0, device="cuda", seq_len=32)), "init_from": None}
    got = resumed(TrainConfig(out="x", resume=True, steps=4000), saved, {"out", "resume", "steps"})
    assert (got.steps, got.minutes, got.seq_len, got.device) == (4000, None, 32, None)
    got = resumed(TrainConfig(out="x", resume=True), saved, {"out", "resume"})
    assert (got.steps, got.minutes) == (None, 3.0)
    saved = {**vars(TrainConfig(out="x", steps=100)), "init_from": "base"}
    got = resumed(TrainConfig(out="x", resume=True, minutes=5.0), saved, {"out", "resume", "minutes"})
    assert (got.steps, got.minutes) == (None, 5.0)
    # an --init-from run's shape is its checkpoint's: shape flags are refused beside --init-from, and on its resume
    with pytest.raises(ValueError, match="takes the model .* drop --depth, --vocab-size"):
        TrainConfig(out="x", init_from="base", depth=3, vocab_size=300).check()
    with pytest.raises(ValueError, match="the model is base's, as --init-from took it: shape flags do not apply: "
                                         "drop --depth$") as e:
        check_resume_settings(TrainConfig(out="x", depth=3, steps=100), saved, "x")
    assert "--depth 8" not in str(e.value)  # the saved default: not the model's depth
    with pytest.raises(ValueError, match=r"saved with --seq-len 256 \(given: 64\);.*; the model is base's.*drop --depth$"):
        check_resume_settings(TrainConfig(out="x", depth=3, seq_len=64, steps=100), saved, "x")
    assert resume_changes(TrainConfig(out="x", seq_len=64, steps=100), saved) == [("seq_len", 256, 64)]
    # --reg-detach typed at the value the saved None meant (IDN: not detached, HCN: detached) is no change
    saved = vars(TrainConfig(out="x", reg="idn"))
    assert resume_changes(TrainConfig(out="x", reg="idn", reg_detach=False), saved) == []
    assert resume_changes(TrainConfig(out="x", reg="idn", reg_detach=True), saved) == [("reg_detach", None, True)]
    saved = vars(TrainConfig(out="x", reg="hcn", hc_streams=2))
    assert resume_changes(TrainConfig(out="x", reg="hcn", hc_streams=2, reg_detach=True), saved) == []


def test_snlp_train_says_how_to_continue_after_ctrl_c(corpus, tmp_path, capsys, monkeypatch):
    import snlp.apps.train as T

    monkeypatch.setattr(T, "file_hooks", lambda *a, **k: TrainHooks(
        should_stop=lambda s: os.kill(os.getpid(), signal.SIGINT) if s == 2 else None))
    rc = main(["train", "--out", str(tmp_path / "run"), "--data", str(corpus), "--cache-dir", str(tmp_path / "c"),
               *TINY, "--steps", "5"])
    err = capsys.readouterr().err
    assert rc == 130 and (f"interrupted by SIGINT: saved {tmp_path / 'run'} at step 2; continue with: snlp train --out "
                          f"{tmp_path / 'run'} --device cpu --resume") in err


# ----- the recorded cache path, the regulariser warning
def test_checkpoint_records_an_absolute_cache_path(corpus, tmp_path, monkeypatch):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(work)
    fit(cfg("run", corpus, "cache", steps=1))
    monkeypatch.chdir(elsewhere)
    data = checkpoint_data(work / "run")
    assert data["cache_dir"] == str(work / "cache")
    _, tok = load(work / "run")
    validation_tokens(tok, **data)
    assert list(elsewhere.iterdir()) == []  # read the run's cache; nothing re-tokenised here


def test_the_data_files_record_is_made_once_per_run_not_at_every_save(corpus, tmp_path, monkeypatch):
    """files_signature walks every file of --data (0.3-0.4 s on a 20,000-file folder): a run computes its record
    once, and every save (here one per step) writes that record, the one a resume from a moved project checks."""
    import snlp.io.data as D

    calls = []
    signature = D.files_signature
    monkeypatch.setattr(D, "files_signature", lambda spec: calls.append(spec) or signature(spec))
    fit(cfg(tmp_path / "run", corpus, tmp_path / "cache", steps=3, save_every=1))
    assert len(calls) == 1
    st = torch.load(tmp_path / "run" / "train_state.pt", weights_only=False)
    assert st["step"] == 3 and st["args"]["data_files"] == signature(str(corpus)) == [[["c.txt", 60_000]]]


def test_an_old_relative_cache_path_is_warned_of(corpus, tmp_path, monkeypatch):
    """A checkpoint saved before the path was recorded absolute: reading it elsewhere says so instead of silently
    re-tokenising into a new folder."""
    monkeypatch.chdir(tmp_path)
    fit(cfg("run", corpus, "cache", steps=1))
    st = torch.load(tmp_path / "run" / "train_state.pt", weights_only=False)
    st["args"]["cache_dir"] = "cache"  # as 3c0d6cc recorded it
    torch.save(st, tmp_path / "run" / "train_state.pt")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.warns(UserWarning, match=r"relative path cache .*pass --cache-dir"):
        checkpoint_data(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint_data(tmp_path / "run", cache_dir=str(tmp_path / "cache"))  # given: no warning


def test_reg_none_warns_of_no_clipping(corpus, tmp_path):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fit(cfg(tmp_path / "none", corpus, tmp_path / "c", steps=1, depth=2, reg="none", reg_n="4"))
    assert not [x for x in w if "clipped" in str(x.message)]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fit(cfg(tmp_path / "idn", corpus, tmp_path / "c", steps=1, depth=2, reg="idn", reg_n="4"))
    assert len([x for x in w if "clipped" in str(x.message)]) == 1  # said once, at the start


def test_a_resume_whose_data_was_rewritten_in_place_is_refused(corpus, tmp_path, capsys):
    """The same --data path holding other files (rewritten, shortened) than the run's record: continuing would
    re-tokenise and train the rest of the run, and validate it, on other text under the same name. Refused in one
    line before anything loads, every file of the run left as it was."""
    import shutil

    data = tmp_path / "c.txt"
    shutil.copy(corpus, data)
    run = tmp_path / "run"
    flags = ["--data", str(data), "--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "4"]
    assert main(["train", "--out", str(run), *flags, "--stop-after", "2"]) == 0
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    data.write_text(corpus.read_text()[:40_000][::-1])
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "other than those there now" in err and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    shutil.copy(corpus, data)  # the run's own text back: it continues
    assert main(["train", "--out", str(run), "--resume"]) == 0


def test_an_out_inside_its_data_folder_is_refused(corpus, tmp_path, capsys):
    """The data loader reads a --data folder's text files, so a run whose --out lay inside it trained and validated
    on its own log.jsonl from its first resume on (and a resume was refused once the log grew). Refused at the
    start, in one line, before anything is written."""
    import shutil

    proj = tmp_path / "proj"
    proj.mkdir()
    shutil.copy(corpus, proj / "c.txt")
    flags = ["--data", str(proj), "--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "2"]
    assert main(["train", "--out", str(proj / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert "lies inside the --data folder" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in proj.iterdir()) == ["c.txt"]
    assert main(["train", "--out", str(tmp_path / "run"), *flags]) == 0  # outside it: trains


def test_a_new_run_into_a_speedrun_folder_is_refused(corpus, tmp_path, capsys):
    """`snlp train --out` a finished speedrun's folder wrote a checkpoint beside its report and stages; the speedrun
    then took the folder for a checkpoint and could reuse none of its stages."""
    sr = tmp_path / "sr"
    (sr / "stages").mkdir(parents=True)  # a speedrun stopped in its first stage has stages/ alone
    flags = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "1"]
    assert main(["train", "--out", str(sr), *flags]) == 2
    assert "holds a speedrun" in capsys.readouterr().err
    assert sorted(p.name for p in sr.iterdir()) == ["stages"]


def test_a_new_run_into_a_folder_holding_files_a_save_writes_is_refused(corpus, tmp_path, capsys):
    """A folder with config.json and tokenizer.json but no model.safetensors (a sharded transformers model, the user's
    own files) was taken as free: the run's checkpoint replaced both, silently. (`snlp sft --out` opens its run the
    same way: snlp.train.checkpointing.open_run.)"""
    hf = tmp_path / "hf"
    hf.mkdir()
    mine = {"config.json": '{"model_type": "llama"}', "tokenizer.json": '{"version": "1.0"}',
            "model.safetensors.index.json": '{"weight_map": {}}'}
    for name, text in mine.items():
        (hf / name).write_text(text)
    flags = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "1"]
    assert main(["train", "--out", str(hf), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds config.json, tokenizer.json but no model.safetensors" in err and "\n" not in err, err
    assert {p.name: p.read_text() for p in hf.iterdir()} == mine


def test_a_same_size_edit_is_refused_by_the_tokens_and_a_capped_append_resumes(corpus, tmp_path, capsys):
    """Names and sizes cannot see an edit that keeps the byte count (a typo fixed): the resumed leg re-tokenised and
    trained, and validated, on the edited text. The tokens' digest, recorded by the run, refuses it once they are made
    (before any step, every file of the run left as it was). A file that grew past --max-chars gives the run the
    same text: it resumes (names and sizes refused it)."""
    import shutil

    data = tmp_path / "c.txt"
    shutil.copy(corpus, data)
    run = tmp_path / "run"
    flags = ["--data", str(data), "--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "4"]
    assert main(["train", "--out", str(run), *flags, "--stop-after", "2"]) == 0
    with open(run / "log.jsonl", "a") as f:  # a record past the checkpoint (a killed leg's): kept by a refusal
        f.write('{"step": 3, "loss": 1.0}\n')
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    text = corpus.read_text()
    i = text.index("the ") if "the " in text else len(text) // 2
    data.write_text(text[:i] + text[i:i + 4].upper() + text[i + 4:])  # the same size, other text
    assert data.stat().st_size == corpus.stat().st_size
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "other tokens" in err and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    shutil.copy(corpus, data)
    assert main(["train", "--out", str(run), "--resume"]) == 0

    capped = tmp_path / "capped"
    assert main(["train", "--out", str(capped), *flags, "--max-chars", "20000", "--stop-after", "2"]) == 0
    with open(data, "a") as f:
        f.write("more text at the end\n")
    assert main(["train", "--out", str(capped), "--resume"]) == 0


def test_the_out_inside_data_rule_follows_what_the_loader_reads(tmp_path, capsys):
    """A recursive glob reads --out's files as a folder part does (refused); a dot-folder there, a plain glob and a
    file part do not reach it (accepted); an SFT config, whose data is the base's text it never reads, is not
    checked; the speedrun refuses before any stage."""
    from snlp.train.config import check_out_outside_data

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "c.txt").write_text("some text\n" * 100)
    with pytest.raises(ValueError, match="inside the --data folder"):
        check_out_outside_data(str(proj / "run"), f"{proj}/**")
    for out, data in ((proj / ".run", str(proj)), (proj / "run", f"{proj}/*.txt"), (proj / "run", str(proj / "c.txt")),
                      (tmp_path / "run", str(proj)), ("~nosuchuser__/run", str(proj))):
        check_out_outside_data(str(out), data)
    TrainConfig(out=str(proj / "sft"), data=str(proj)).check()  # SFT's recorded base text: not the run's data
    assert main(["speedrun", "--out", str(proj / "sr"), "--data", str(proj), "--quick"]) == 2
    assert "inside the --data folder" in capsys.readouterr().err
    assert sorted(p.name for p in proj.iterdir()) == ["c.txt"]


def test_calibrate_refuses_an_out_that_names_a_checkpoint_file(tmp_path, capsys):
    """`snlp calibrate CKPT --out CKPT/model.safetensors` wrote the preheat over the model's weights (the checkpoint
    then failed to load: "corrupt or truncated weights file"). Refused before the model loads, the file kept; an
    existing .pt (an earlier calibration) may still be replaced."""
    from snlp.apps.cli import main
    from snlp.io.checkpoint import save_checkpoint

    from conftest import make_model

    ck = save_checkpoint(tmp_path / "ck", make_model(n_layer=2))
    (tmp_path / "notes.md").write_text("mine")
    before = (ck / "model.safetensors").read_bytes()
    for out, says in ((ck / "model.safetensors", "is a file of the checkpoint"), (ck / "config.json", "checkpoint"),
                      (tmp_path / "notes.md", "is an existing file")):
        assert main(["calibrate", str(ck), "--out", str(out), "--rank", "2"]) == 2
        assert says in capsys.readouterr().err
    assert (ck / "model.safetensors").read_bytes() == before and (tmp_path / "notes.md").read_text() == "mine"
    assert main(["calibrate", str(ck), "--out", str(tmp_path / "p.pt"), "--rank", "2", "--batch", "2",
                 "--seq-len", "8"]) == 0
    assert main(["calibrate", str(ck), "--out", str(tmp_path / "p.pt"), "--rank", "2", "--batch", "2",
                 "--seq-len", "8"]) == 0


def test_calibrate_says_when_the_rank_is_capped(tmp_path, capsys):
    """`--rank 1000` on a narrower model wrote "rank 128" without saying the asked rank was capped at the width."""
    from snlp.apps.cli import main
    from snlp.io.checkpoint import save_checkpoint

    from conftest import make_model

    model = make_model(n_layer=2)
    ck = save_checkpoint(tmp_path / "ck", model)
    W = model.config.n_embd
    # 4 x 8 tokens: a fit of rank W needs more than W (snlp.method.preheat.check_tokens)
    assert main(["calibrate", str(ck), "--rank", str(W + 100), "--batch", "4", "--seq-len", "8"]) == 0
    assert f"rank {W} (asked for {W + 100}: capped at the model width, {W})" in capsys.readouterr().out
    assert main(["calibrate", str(ck), "--rank", "2", "--batch", "2", "--seq-len", "8"]) == 0
    assert "capped" not in capsys.readouterr().out


def test_sft_grid_refuses_a_stop_file_left_at_a_reached_step_before_any_work(corpus, tmp_path, capsys):
    """snlp sft-grid trains through snlp sft's loop with its --stop-file: one an earlier grid left at step 0 stopped
    its first SFT run before its first step and the grid scored that untrained run, status 0. Refused in one line
    before the base's weights, the chats or the tasks are read."""
    base = tmp_path / "base"
    fit(cfg(base, corpus, tmp_path / "cache", steps=1))
    stop = tmp_path / "stop"
    stop.write_text("0")
    capsys.readouterr()
    rc = main(["sft-grid", str(base), "--data", str(tmp_path / "none.jsonl"), "--plan", "2xF1-h0-K1", "--task",
               f"mc:{tmp_path / 'none.jsonl'}", "--out", str(tmp_path / "grid"), "--stop-file", str(stop)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--stop-file" in err and "already says stop at step 0" in err, err
    assert not (tmp_path / "grid").exists()


def test_a_stop_file_no_one_can_write_is_refused_before_any_work(corpus, tmp_path, capsys):
    """`--stop-file FOLDER` was accepted and never read a step (the run went on to its end); a file in a folder that
    does not exist (a typo) was never read either. Both are refused in one line, the typo with the closest folder;
    a file in --out, which the run makes, is accepted and stops the run where it says."""
    out, stops = tmp_path / "run", tmp_path / "stops"
    stops.mkdir()
    flags = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "4"]
    capsys.readouterr()
    assert main(["train", "--out", str(out), *flags, "--stop-file", str(stops)]) == 2
    assert main(["sft", str(tmp_path / "base"), "--data", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "sft"),
                 "--stop-file", str(stops)]) == 2
    assert main(["train", "--out", str(out), *flags, "--stop-file", str(tmp_path / "stop" / "STOP")]) == 2
    says = [e for e in capsys.readouterr().err.splitlines() if "error:" in e]
    assert len(says) == 3 and all(f"--stop-file {stops} is a folder" in e for e in says[:2]), says
    assert f"its folder {tmp_path}/stop does not exist; did you mean {tmp_path}/stops?" in says[2], says
    assert not out.exists() and not (tmp_path / "sft").exists() and not (tmp_path / "stop").exists()
    stop = out / "STOP"  # in the --out the run makes: written there once the run is going
    assert main(["train", "--out", str(out), *flags, "--stop-after", "2", "--stop-file", str(stop)]) == 0
    stop.write_text("3")
    assert main(["train", "--out", str(out), *flags, "--resume", "--stop-file", str(stop)]) == 0
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 3


def test_time_reg_marks_its_paired_overhead_by_the_sign_test(corpus, tmp_path, capsys):
    """`snlp train --time-reg N` printed the regulariser's overhead as a bare ratio ("(1.31x)") though its N rounds
    are paired (round-robin), where every other paired ratio of the CLI says "(tie)" and the sign test's sentence.
    Now the line is marked the same way; the sign test is written out here (2 rounds can never resolve a lead: even
    2 of 2 has p = 2 / 4)."""
    from snlp.train.config import StepSpeed
    from snlp.train.trainer import speed_line

    flags = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "2", "--reg", "idn",
             "--reg-n", "1", "--time-reg", "2"]
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "run"), *flags]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if "| regulariser:" in l)
    assert "x (tie); a tie with the step without it: faster in " in line and "of 2 paired rounds; 2 paired rounds " \
        "cannot resolve a lead (the sign test needs 6 of 6 at the fewest))" in line, line
    sign = json.loads((tmp_path / "run" / "train_summary.json").read_text())["speed"]["reg_overhead_sign"]
    assert sign["verdict"] == "tie" and sign["wins"] + sign["losses"] <= 2 and sign["p"] >= 0.5

    base = dict(compiled=False, steps=2, warm=1, tok_s=1.0, step_s=1.0, first_step_s=1.0, flops_per_token=None,
                peak_flops=None, mfu=None, tflops=None, reg_step_s=0.013, plain_step_s=0.010)
    slower = speed_line(StepSpeed(**base, reg_round_ratios=[0.77] * 6))  # every round slower: p = 2 / 2**6
    assert slower.endswith("(1.30x; slower than the step without it in 6 of 6 paired rounds (two-sided sign test "
                           "p = 0.031))"), slower
    mixed = speed_line(StepSpeed(**base, reg_round_ratios=[0.77] * 5 + [1.1]))  # 5 of 6: p = 14 / 64 = 0.22
    assert mixed.endswith("(1.30x (tie); a tie with the step without it: faster in 1 of 6 paired rounds; the two-sided "
                          "sign test at 5% does not resolve it, p = 0.22)"), mixed


def test_time_reg_prints_the_median_of_an_even_number_of_rounds(corpus, tmp_path, capsys, monkeypatch):
    """--time-reg 2 with rounds of 10 and 20 ms (reg) and 10 and 10 ms (plain): the medians are 15 and 10 ms (numpy's
    and statistics', the mean of the middle two), overhead 1.50x; the upper middle value printed 20.0 vs 10.0 ms,
    2.00x. The rounds' timings are set (the clock is not what is tested)."""
    import numpy as np

    import snlp.train.trainer as trainer

    reg, plain = [10.0, 20.0], [10.0, 10.0]  # ms per round, as time_round_robin returns them
    monkeypatch.setattr(trainer, "time_round_robin", lambda fns, warmup, rounds, device: {"reg": reg, "plain": plain})
    flags = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "2", "--reg", "idn",
             "--reg-n", "1", "--time-reg", "2"]
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "run"), *flags]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if "| regulariser:" in l)
    want = f"regulariser: {np.median(reg):.1f} vs {np.median(plain):.1f} ms per micro-batch step (1.50x"
    assert want in line, line


def test_a_stop_file_in_out_spelled_through_a_symlink_is_accepted(corpus, tmp_path, capsys):
    """The --stop-file folder check compared the spellings of --out and the file's folder: `--out link/run` with a
    stop file in target/run (one folder, which the run makes) was refused as "does not exist". The places are
    compared now; a folder the OS cannot reach until something else makes it (`runs/b/../run` with no runs/b: the
    OS walks b before ..) is still refused, while --out names the same place by its own spelling."""
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    flags = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "1"]
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "link" / "run"), *flags,
                 "--stop-file", str(tmp_path / "target" / "run" / "STOP")]) == 0
    assert main(["train", "--out", str(tmp_path / "target" / "run2"), *flags,
                 "--stop-file", str(tmp_path / "link" / "run2" / "STOP")]) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "runs" / "a"), *flags,
                 "--stop-file", str(tmp_path / "runs" / "b" / ".." / "a" / "STOP")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sft_grid_accepts_a_stop_file_in_the_folder_of_its_second_run(tmp_path):
    """snlp sft-grid checked its --stop-file against each run's own folder (--out/sft-FORWARD), so a file in the
    other run's folder, which the grid makes too, was refused as "does not exist ... name a file in --out" though it
    is in --out. A folder no one makes is still refused."""
    from argparse import Namespace

    from snlp.apps.sft_grid import check_grid_stop_file

    grid = tmp_path / "grid"
    args = Namespace(out=str(grid), plan="2xF1-h0-K1", stop_file=str(grid / "sft-2xF1-h0-K1" / "STOP"))
    check_grid_stop_file(args)
    args.stop_file = str(grid / "sft-sequential" / "STOP")
    check_grid_stop_file(args)
    args.stop_file = str(tmp_path / "gird" / "STOP")
    with pytest.raises(ValueError, match="does not exist"):
        check_grid_stop_file(args)


def test_a_stop_file_name_over_the_os_limit_is_one_line(corpus, tmp_path, capsys):
    """The --stop-file folder check's is_dir raised OSError (ENAMETOOLONG) for a part over 255 bytes: a traceback
    where the run used to go on (and never stop: no one can write that file). One line now, before any work."""
    flags = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "1"]
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "run"), *flags, "--stop-file", str(tmp_path / ("a" * 300) / "STOP")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("snlp train: error: --stop-file ") and "too long" in err, err
    assert not (tmp_path / "run").exists()



def test_a_resume_can_turn_compile_off_as_well_as_on():
    """--compile is one of the settings a resume may change, and a resume keeps every flag not typed: a run saved with
    --compile could not be resumed eagerly (a store_true flag cannot be typed False), so a compiled CUDA run resumed on
    a CPU recompiled there. --no-compile now says it (snlp sft shares the flag); left out, the saved value stays."""
    from snlp.apps.cli import build_parser, given_flags
    from snlp.apps.train import config_from_args
    from snlp.train.config import resumed

    saved = vars(TrainConfig(out="x", compile=True))
    parser = build_parser("train")
    for typed, want in ((["--no-compile"], False), ([], True), (["--compile"], True)):
        argv = ["train", "--out", "x", "--resume", *typed]
        args = parser.parse_args(argv)
        assert resumed(config_from_args(args), saved, given_flags(parser, argv, args)).compile is want, typed
    assert build_parser("sft").parse_args(["sft", "b", "--data", "c.jsonl", "--out", "o", "--no-compile"]).compile is False


def test_a_run_resumed_at_step_0_logs_step_0_once(corpus, tmp_path):
    """A run that ended at step 0 (--stop-after 0, or a stop right after step 0's validation) had validated and logged
    step 0; its resume validated and logged step 0 again: two step-0 rows (two curves' starts) where the run never
    stopped has one. Its validation of step 0 now replaces the earlier leg's row, so the run keeps its step-0
    validation (the summary of a leg that ends at step 0 again too) and logs it once."""
    ref = fit(cfg(tmp_path / "ref", corpus, tmp_path / "cache", steps=2))
    fit(cfg(tmp_path / "run", corpus, tmp_path / "cache", steps=2, stop_after=0))
    again = fit(cfg(tmp_path / "run", corpus, tmp_path / "cache", steps=2, stop_after=0, resume=True))
    assert again.val_loss is not None
    assert json.loads((tmp_path / "run" / "train_summary.json").read_text())["validation"] is not None
    res = fit(cfg(tmp_path / "run", corpus, tmp_path / "cache", steps=2, resume=True))
    rows = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 2]
    assert res.val_loss == ref.val_loss and res.steps == 2


def test_an_own_bpe_resume_on_edited_text_names_the_special_token_reading_too(corpus, tmp_path, capsys):
    """The other-tokens refusal names, for a run on snlp's own BPE, both causes: an edit and a run from before that
    BPE read quoted special-token strings as text (a converted tokenizer's run hears of the edit only:
    tests/io/test_hf.py)."""
    import shutil

    data = tmp_path / "c.txt"
    shutil.copy(corpus, data)
    run = tmp_path / "run"
    flags = ["--data", str(data), "--cache-dir", str(tmp_path / "cache"), *TINY, "--steps", "4"]
    assert main(["train", "--out", str(run), *flags, "--stop-after", "2"]) == 0
    body = data.read_text()
    data.write_text(body[:10] + body[10:14].swapcase() + body[14:])  # the same size, other text
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "other tokens" in err and "text edited in place?" in err and "special-token strings" in err, err

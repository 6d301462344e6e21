"""`snlp train`: resume is bitwise exact, DDP matches one process, real runs learn, and the
SNLP-aware regulariser lowers the measured K=1 SNLP gap."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port
from safetensors.torch import load_file

from snlp.apps.cli import main

# the first ~150 KB of tinyshakespeare, vendored (tests/data/README.md): the tests need nothing beside the repo
SHAKESPEARE = Path(__file__).resolve().parents[1] / "data/tinyshakespeare-head.txt"
TINY = ["--depth", "3", "--width", "32", "--head-dim", "16", "--vocab-size", "300", "--seq-len", "32",
        "--batch-size", "4", "--eval-every", "100", "--eval-batches", "1", "--no-progress", "--device", "cpu"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "c.txt").write_text(SHAKESPEARE.read_text()[:120_000])
    return d / "c.txt"


def train(out, corpus, cache, *extra):
    rc = main(["train", "--out", str(out), "--data", str(corpus), "--cache-dir", str(cache), *TINY, *extra])
    assert rc == 0
    return load_file(str(Path(out) / "model.safetensors"))


def log(out):
    return [json.loads(l) for l in (Path(out) / "log.jsonl").read_text().splitlines()]


def test_resume_is_bitwise_identical(corpus, tmp_path):
    cache = tmp_path / "cache"
    args = ["--steps", "6", "--reg", "idn", "--reg-n", "2", "--reg-stride", "1", "--grad-accum", "2"]
    full = train(tmp_path / "full", corpus, cache, *args)
    train(tmp_path / "part", corpus, cache, *args, "--stop-after", "3")
    assert json.loads((tmp_path / "part" / "config.json").read_text())["n_layer"] == 3
    resumed = train(tmp_path / "part", corpus, cache, *args, "--resume")
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    steps = [r["step"] for r in log(tmp_path / "part") if "val_loss" in r]
    assert steps == [0, 3, 6]  # the log is carried over across saves
    assert main(["train", "--out", str(tmp_path / "full"), "--data", str(corpus), *TINY]) == 2  # exists, no --resume
    assert main(["train", "--out", str(tmp_path / "nothing"), "--resume", "--data", str(corpus), *TINY]) == 2


@pytest.mark.slow
def test_resume_with_diag_regulariser_is_bitwise_identical(corpus, tmp_path):
    """--reg diag draws a fresh DiagN probe each micro-batch from the global torch RNG, which the checkpoint saves: a run
    stopped and resumed draws the probes the uninterrupted run draws, so the weights agree bit for bit."""
    cache = tmp_path / "cache"
    args = ["--steps", "4", "--reg", "diag", "--reg-n", "2", "--reg-stride", "1", "--reg-lambda", "5",
            "--grad-accum", "2"]
    full = train(tmp_path / "full", corpus, cache, *args)
    train(tmp_path / "part", corpus, cache, *args, "--stop-after", "2")
    resumed = train(tmp_path / "part", corpus, cache, *args, "--resume")
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), k


def test_bad_data_gives_clear_error(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "x"), "--data", str(tmp_path / "missing.txt"), *TINY]) == 2
    assert "unknown data source" in capsys.readouterr().err


def test_ddp_matches_single_process(corpus, tmp_path):
    cache = tmp_path / "cache"
    args = ["--steps", "3", "--reg", "idn", "--reg-n", "2", "--warmup-steps", "1", "--log-every", "1"]
    single = train(tmp_path / "one", corpus, cache, *args)  # also fills the token cache
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "snlp",
           "train", "--out", str(tmp_path / "two"), "--data", str(corpus), "--cache-dir", str(cache), *TINY, *args]
    i = cmd.index("--batch-size")
    cmd[i + 1] = "2"  # 2 processes x 2 = the single process's global batch of 4
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("saved ") == 1  # rank 0 only
    # Same data and mean-reduced losses: the per-step train losses agree tightly. Weights agree only
    # up to the all-reduce order, which Adam (eps 1e-10) amplifies where a gradient is ~1e-9 noise
    # (e.g. the x0 scalars at init: RMSNorm makes the loss scale-invariant along x0), so later
    # values get a looser tolerance.
    one, two = log(tmp_path / "one"), log(tmp_path / "two")
    # step 0 validates the same initial weights: on the global batch's rows under DDP too, it is the same number
    # (validation on the per-process batch's rows logged another, e.g. 5.70301 against 5.70326)
    assert two[0]["step"] == one[0]["step"] == 0 and two[0]["val_loss"] == pytest.approx(one[0]["val_loss"], rel=1e-6)
    for a, b in zip(one, two):
        for k in ("loss", "val_loss", "gap_N2"):
            if k in a:
                assert b[k] == pytest.approx(a[k], rel={"loss": 1e-4, "val_loss": 2e-2}.get(k, 0.1), abs=1e-5), (a, b)
    ddp = load_file(str(tmp_path / "two" / "model.safetensors"))
    for k in single:
        if k.startswith("blocks.") or k == "lm_head.weight":
            torch.testing.assert_close(ddp[k], single[k], rtol=1e-2, atol=5e-3, msg=k)


def test_shakespeare_learns_and_regulariser_lowers_gap(tmp_path):
    cache = tmp_path / "cache"
    common = ["--data", str(SHAKESPEARE), "--cache-dir", str(cache), "--depth", "4", "--width", "64",
              "--head-dim", "32", "--vocab-size", "512", "--seq-len", "64", "--batch-size", "8", "--steps", "60",
              "--eval-every", "60", "--eval-batches", "4", "--no-progress", "--device", "cpu", "--reg-n", "3"]
    assert main(["train", "--out", str(tmp_path / "plain"), *common]) == 0
    assert main(["train", "--out", str(tmp_path / "reg"), *common, "--reg", "idn", "--reg-lambda", "1.0"]) == 0
    plain = [r for r in log(tmp_path / "plain") if "val_loss" in r]
    reg = [r for r in log(tmp_path / "reg") if "val_loss" in r]
    assert plain[-1]["val_loss"] < plain[0]["val_loss"] - 1.0  # learns
    assert reg[-1]["val_loss"] < reg[0]["val_loss"] - 1.0
    assert plain[-1]["gap_N3"] > 0.01  # training opens a K=1 gap ...
    assert reg[-1]["gap_N3"] < 0.8 * plain[-1]["gap_N3"]  # ... which the regulariser keeps smaller
    regs = [r["reg"] for r in log(tmp_path / "reg") if "reg" in r]
    assert all(v > 0 for v in regs[1:])  # logged separately from CE


def test_fit_library_entry_point(corpus, tmp_path):
    """snlp.fit(TrainConfig) -> TrainResult, no argparse; a stop file (a hook the caller gives) ends the run
    at its step."""
    from snlp.apps.train import file_hooks
    from snlp.train.config import TrainConfig
    from snlp.train.trainer import fit

    (tmp_path / "stop").write_text("2")
    cfg = TrainConfig(out=str(tmp_path / "lib"), data=str(corpus), cache_dir=str(tmp_path / "cache"), depth=2, width=32,
                      head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=5, eval_every=100, eval_batches=1,
                      no_progress=True, device="cpu", reg_n="1")
    r = fit(cfg, hooks=file_hooks(tmp_path / "stop"))
    assert (r.steps, r.tokens, r.stopped_by) == (2, 2 * 2 * 16, "stop_file")
    assert r.val_loss is not None and r.train_loss is not None and Path(r.out, "model.safetensors").is_file()
    with pytest.raises(ValueError, match="--seq-len must be >= 1"):
        fit(TrainConfig(out=str(tmp_path / "bad"), seq_len=0))


def test_hooks_steer_the_loop_and_the_last_step_is_validated(corpus, tmp_path):
    """A before_step hook (a lockstep peer's stop, seen while waiting) ends the run with its reason, and the
    run's last step is validated all the same; the validation is a typed record, logged with the old keys."""
    from snlp.train.config import TrainConfig
    from snlp.train.hooks import TrainHooks
    from snlp.train.trainer import fit

    asked = []

    def before_step(steps_done):
        asked.append(steps_done)
        return "peer" if steps_done >= 2 else None

    cfg = TrainConfig(out=str(tmp_path / "h"), data=str(corpus), cache_dir=str(tmp_path / "cache"), depth=2, width=32,
                      head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=5, eval_every=100, eval_batches=1,
                      no_progress=True, device="cpu", reg_n="1")
    r = fit(cfg, hooks=TrainHooks(before_step=before_step))
    assert (r.steps, r.stopped_by, asked) == (2, "peer", [0, 1, 2])
    assert r.validation is not None and r.val_loss == r.validation.loss and set(r.validation.gaps) == {1}
    evals = [e for e in log(tmp_path / "h") if "val_loss" in e]
    assert [e["step"] for e in evals] == [0, 2] and evals[-1] == {"step": 2, "elapsed": evals[-1]["elapsed"],
                                                                   **r.validation.record(), "mfu": None}
    assert set(evals[-1]) == {"step", "elapsed", "val_loss", "gap_N1", "mfu"}  # mfu: null on a CPU (no known peak)
    # the log says why the run ended: a stop decided between steps gets a row of its own (the last step's record
    # went out before it; a lockstep peer and the speedrun read stops from the log)
    from snlp.io.checkpoint import load_train_state

    stops = [e for e in log(tmp_path / "h") if "stop" in e]
    assert [(e["step"], e["stop"]) for e in stops] == [(2, "peer")] and "loss" not in stops[0]
    # at the run's clock of its step, as the validation after it and the checkpoint say it (not the decision's wall
    # time, which the hold before the step adds to)
    assert stops[0]["elapsed"] == evals[-1]["elapsed"] == load_train_state(Path(r.out))["elapsed"]
    from snlp.apps.speedrun.train import _log_state

    assert _log_state(Path(r.out) / "log.jsonl")["stop"] == "peer"


def test_file_hooks(tmp_path):
    """--stop-file and the lockstep gate as TrainHooks: the stop file is asked after a step and before the
    next; the gate holds a step (WAIT: the loop asks again, its own stop checks in between) until it opens, the stop
    file ending the wait. The other process is played by writing the files between asks."""
    from snlp.apps.train import file_hooks, read_step_file
    from snlp.train.hooks import WAIT

    stop, gate = tmp_path / "stop", tmp_path / "gate"
    assert file_hooks().should_stop is None and file_hooks().before_step is None
    h = file_hooks(stop)
    assert h.should_stop(5) is None and h.before_step(5) is None  # no file yet: go on
    stop.write_text("3")
    assert (h.should_stop(2), h.should_stop(3), h.before_step(4)) == (None, "stop_file", "stop_file")
    stop.unlink()
    gate.write_text("1")
    g = file_hooks(stop, gate, poll_s=0.001)
    assert g.poll_s == 0.001 and g.before_step(0) is None  # step 1 may start at once
    gate.write_text("")  # a gate file caught half-written reads as absent: keep waiting
    assert g.before_step(1) == WAIT
    gate.write_text("1")
    assert g.before_step(1) == WAIT  # step 2 is not open yet
    gate.write_text("2")
    assert g.before_step(1) is None
    assert g.before_step(2) == WAIT
    stop.write_text("2")
    assert g.before_step(2) == "stop_file"  # held at the gate, released by the stop file
    assert read_step_file(tmp_path / "missing") is None and read_step_file(None) is None


def test_a_stop_file_holding_text_stops_the_run_and_says_so_once(tmp_path, capsys):
    """A --stop-file holding no integer ("stop") was waited on silently: the run trained to its budget. Text that is
    no step number now stops the run after the step in progress, said once on stderr (the file, what it holds,
    what it expects); an empty or whitespace-only file is a number not yet written (`echo 5 > STOP` empties the
    file first) and the run goes on."""
    from snlp.apps.train import file_hooks, read_stop_file

    stop = tmp_path / "stop"
    h = file_hooks(stop)
    for pending in ("", "  \n"):
        stop.write_text(pending)
        assert h.should_stop(4) is None and h.before_step(4) is None and read_stop_file(stop) == (None, None)
    stop.write_text("stop\n")
    assert (h.should_stop(4), h.before_step(4)) == ("stop_file", "stop_file")
    err = capsys.readouterr().err.splitlines()
    assert err == [f"--stop-file {stop} holds 'stop', not a step number: stopping now, after step 4, saved (an "
                   f"integer N there stops the run after step N)"], err
    stop.write_text(" 7 ")
    assert read_stop_file(stop) == (7, None) and file_hooks(stop).should_stop(6) is None


def test_a_stop_file_with_a_byte_order_mark_is_read_as_its_number(tmp_path):
    """Windows editors save `500` as UTF-8 with a byte-order mark, PowerShell 5's `echo 500 > STOP` as UTF-16: read
    as UTF-8 text either held no step number, so the run stopped at once (and a file left at the start was refused)
    instead of after step 500. A UTF-16 file caught mid-write (an odd byte) is not read yet."""
    from snlp.apps.train import check_stop_file, file_hooks, read_stop_file

    stop = tmp_path / "STOP"
    for raw in (b"\xef\xbb\xbf500\r\n", "500\r\n".encode("utf-16"), "500".encode("utf-16-be").join([b"\xfe\xff", b""])):
        stop.write_bytes(raw)
        assert read_stop_file(stop) == (500, None), raw
        assert file_hooks(stop).should_stop(499) is None and file_hooks(stop).should_stop(500) == "stop_file"
        check_stop_file(stop, str(tmp_path / "run"), resume=False)  # not refused: step 500 is ahead
    for pending, read in ((b"\xef\xbb\xbf", None), (b"\xff\xfe", None), (b"\xff\xfe5", None),
                          ("50".encode("utf-16") + b"0", 50)):  # the mark alone, or half of the next digit
        stop.write_bytes(pending)
        assert read_stop_file(stop) == (read, None) and file_hooks(stop).should_stop(3) is None, pending


def test_tok_s_is_the_steps_own_pace_without_the_validation_save_and_flop_count_before_it(corpus, tmp_path, monkeypatch):
    """A log row's `tok_s` is the step's tokens over the time since the previous step ended, the hold of a before_step
    hook (a lockstep peer's gate) included; the validation, the save and the one-off FLOP count between two steps are
    no part of it (`step_s` leaves them out too). On a fake clock: every micro-batch takes 1 s, every hold 5 s, a
    validation 100 s, a save 50 s, the FLOP count 10 s, so every row reads 2 x 16 tokens / 6 s and step_s 1 s (the
    rows after a validation or a save read 32 / 106 or 32 / 56 when those were counted)."""
    import types

    import snlp.train.trainer as T
    from snlp.train.config import TrainConfig
    from snlp.train.hooks import TrainHooks
    from snlp.train.pretrain import pretrain_job

    clock = [0.0]

    def advance(s):
        clock[0] += s

    monkeypatch.setattr(T, "time", types.SimpleNamespace(perf_counter=lambda: clock[0], sleep=time_sleep_refused))

    def counted(fn, s):
        def wrapped(*a, **k):
            advance(s)
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(T, "save_run", counted(T.save_run, 50.0))
    monkeypatch.setattr(T, "step_flops", counted(T.step_flops, 10.0))

    def make_job(*a):
        job = pretrain_job(*a)
        job.batch, job.validate = counted(job.batch, 1.0), counted(job.validate, 100.0)
        return job

    cfg = TrainConfig(out=str(tmp_path / "pace"), data=str(corpus), cache_dir=str(tmp_path / "cache"), depth=2,
                      width=32, head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=6, eval_every=3,
                      save_every=2, log_every=1, eval_batches=1, no_progress=True, device="cpu", reg_n="1")
    fit_result = T.fit(cfg, make_job, hooks=TrainHooks(before_step=lambda steps_done: advance(5.0)))
    assert fit_result.steps == 6
    rows = [r for r in log(tmp_path / "pace") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["tok_s"] for r in rows] == [2 * 16 / 6.0] * 6
    assert [r["step_s"] for r in rows] == [1.0] * 6


def time_sleep_refused(s):
    raise AssertionError("the loop slept on the fake clock")


def test_a_resume_keeps_this_runs_adamw_kernel_not_the_checkpoints():
    """How AdamW computes (fused, foreach, capturable) is this process's choice (--compile on CUDA: fused), not the
    run's: loading the saved state put the saved run's flags back into the param groups, so a compiled CUDA run resumed
    without --compile, or on a CPU, kept the fused kernel and a run resumed with --compile never got it. The saved
    moments, step counts and hyperparameters load as before."""
    from snlp.train.optim import load_optimizer_states

    p = [torch.nn.Parameter(torch.randn(3, 3, generator=torch.Generator().manual_seed(0)))]
    saved = torch.optim.AdamW(p, fused=True, betas=(0.8, 0.95))
    p[0].grad = torch.ones(3, 3)
    saved.step()
    for fused in (None, True):
        now = torch.optim.AdamW(p, betas=(0.8, 0.95), **({"fused": True} if fused else {}))
        for g in now.param_groups:
            g["base_lr"] = g["lr"]
        state = saved.state_dict()
        state["param_groups"][0]["fused"] = not fused  # the other kernel than this run's
        load_optimizer_states([now], [state])
        g = now.param_groups[0]
        assert (g["fused"], g["foreach"], g["capturable"]) == (fused, None, False)
        assert torch.equal(now.state[p[0]]["exp_avg"], saved.state[p[0]]["exp_avg"]) and g["betas"] == (0.8, 0.95)
        now.step()  # its step count where its kernel wants it


def test_the_lr_schedule_is_the_documented_formula_across_a_resume(corpus, tmp_path):
    """docs/training.md: linear warm-up over --warmup-steps ((s + 1) / W at 0-based step s), linear warm-down to 0 over
    the last --warmdown fraction of the run ((1 - s / steps) / F), their product where they overlap; stateless, so a
    run stopped at step 2 and resumed logs the uninterrupted run's lr_scale, and the AdamW and Muon groups step at
    base LR x that scale (the checkpoint's groups hold the last step's LR)."""
    from snlp.train.config import TrainConfig
    from snlp.train.trainer import fit

    steps, W, F = 6, 4, 0.5

    def naive(s):
        warm = (s + 1) / W if s + 1 < W else 1.0
        down = min(1.0, (1 - s / steps) / F)
        return warm * down

    def run(out, **kw):
        return fit(TrainConfig(out=str(tmp_path / out), data=str(corpus), cache_dir=str(tmp_path / "cache"), depth=2,
                               width=32, head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=steps,
                               warmup_steps=W, warmdown=F, log_every=1, eval_every=100, eval_batches=1,
                               no_progress=True, device="cpu", reg_n="1", **kw))

    run("full")
    run("part", stop_after=2)
    run("part", resume=True)
    for out in ("full", "part"):
        rows = [r for r in log(tmp_path / out) if "loss" in r]
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
        assert [r["lr_scale"] for r in rows] == pytest.approx([naive(s) for s in range(steps)], rel=1e-12, abs=0)
        groups = [g for o in torch.load(tmp_path / out / "optimizer.pt", weights_only=False)["optimizer"]
                  for g in o["param_groups"]]
        assert len(groups) >= 3 and all(g["lr"] == pytest.approx(g["base_lr"] * naive(steps - 1)) for g in groups)


def test_steps_and_minutes_together_end_at_the_first_and_decay_by_the_further():
    """docs/training.md: given --steps and --minutes, the run ends at whichever comes first, and the warm-down follows
    the budget further along."""
    from snlp.train.optim import Progress

    p = Progress(100, 1.0)  # 100 steps or 60 s
    p.step, p.elapsed = 50, 45.0
    assert p.frac == 0.75 and not p.done()
    p.step, p.elapsed = 80, 30.0
    assert p.frac == 0.8 and not p.done()
    p.step, p.elapsed = 60, 60.0
    assert p.done()
    p.step, p.elapsed = 100, 1.0
    assert p.done()


def test_more_eval_batches_than_the_split_holds_are_named_at_the_start(corpus, tmp_path, capsys):
    """--eval-batches past what the validation split holds validated on fewer batches, silently."""
    from snlp.train.config import TrainConfig
    from snlp.train.trainer import fit

    cfg = TrainConfig(out=str(tmp_path / "ev"), data=str(corpus), cache_dir=str(tmp_path / "cache"), depth=2, width=32,
                      head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=1, eval_every=100,
                      eval_batches=100_000, no_progress=True, device="cpu", reg_n="1")
    fit(cfg)
    lines = [line for line in capsys.readouterr().out.splitlines() if "validating on" in line]
    assert len(lines) == 1 and "all the validation split holds (--eval-batches 100000)" in lines[0]
    n = int(lines[0].split("validating on ")[1].split()[0])
    assert 1 <= n < 100_000


def test_a_regularisers_fd_eps_the_step_dtype_cannot_take_is_refused_before_step_1(corpus, tmp_path):
    """A library RegConfig whose DiagN surrogate writes an eps below the FD step floor of the step's compute dtype
    reached no check until the regulariser's solve at step 1 (on CUDA: bf16 autocast, floor 0.088; no CLI flag writes
    an eps). The trainer refuses it when it builds the run, before any batch is drawn; the check takes a device it
    need not have: eps:0.01 passes for an fp32 step on the CPU and is refused for the same model's CUDA step."""
    from snlp import DiagN
    from snlp.train import trainer as T
    from snlp.train.config import TrainConfig
    from snlp.train.job import TrainStep
    from snlp.train.pretrain import pretrain_job
    from snlp.train.regularizer import RegConfig

    drawn = []

    def make_job(eps):
        def make(*a):
            job = pretrain_job(*a)
            job.loss = TrainStep(job.model, RegConfig(DiagN("fd", eps=eps), suffixes=(1,)))
            batch = job.batch
            job.batch = lambda *b: drawn.append(b) or batch(*b)
            return job
        return make

    cfg = TrainConfig(out=str(tmp_path / "run"), data=str(corpus), cache_dir=str(tmp_path / "cache"), depth=2,
                      width=32, head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=1, eval_every=100,
                      log_every=1, eval_batches=1, no_progress=True, device="cpu", reg_n="1")
    with pytest.raises(ValueError, match=r"eps:0.0001 is below the smallest FD step of the compute dtype float32"):
        T.fit(cfg, make_job(1e-4))
    assert drawn == [] and not (tmp_path / "run" / "model.safetensors").exists()
    step = TrainStep(make_job(1e-2)(cfg, None, None, 0, 1, torch.device("cpu")).model,
                     RegConfig(DiagN("fd", eps=1e-2), suffixes=(1,)))
    step.check_fd_step("cpu")
    with pytest.raises(ValueError, match=r"eps:0.01 is below the smallest FD step of the compute dtype bfloat16"):
        step.check_fd_step("cuda")
    RegConfig(DiagN("fd"), suffixes=(1,)).check_fd_step(2, torch.bfloat16, "cuda")  # the unwritten eps: raised

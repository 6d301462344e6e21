"""Stages `train-noreg`, `train-idn`: the two models side by side in lockstep, with training's share of the budget and
its floor."""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from snlp.apps.report import cpu_isa, fmt_s
from snlp.apps.speedrun.preset import REG_LAMBDA
from snlp.apps.speedrun.records import canon, keyed, read_json, write_json
from snlp.runtime.device import write_atomic
from snlp.runtime.load import load_average
from snlp.train.checkpointing import read_log  # a diverged step's null / "inf" loss read back as NaN / inf
from snlp.train.config import TrainConfig
from snlp.train.hooks import STOP_SIGNALS, Interrupted

if TYPE_CHECKING:
    from snlp.apps.speedrun.job import Speedrun


TRAIN_OVERHEAD_S = 20.0  # spawning both trainings, their final evaluation and save
# How long a stopped speedrun waits for its training processes to finish their step and save after it asked them to
# stop (SIGTERM, which fit turns into a stop and a save) before it kills them: a step, a save and the last validation
# take seconds at the speedrun's sizes; a process still running after this is stuck, and its last periodic save
# (every 100 steps) is what a re-run resumes from.
STOP_GRACE_S = 60.0
MIN_TRAIN_S = 60.0  # below this the budget is refused


# Training's floor: the run exists to compare the two trained models, so under a budget the other stages shrink
# toward their floors before training gets less than MIN_TRAIN_STEPS steps. 100: the fewest steps a recorded run
# trained and still showed the paper's effect (FLOOR_RECORD: K = 1 dPPL +0.2 % IDN-Reg vs +2.5 % No-Reg); fewer is
# untested. The floor's seconds are MIN_TRAIN_STEPS lockstep steps as the probe measures them on
# this box: both models' own training steps (loss, IDN regulariser, Muon + AdamW; training_step), the slower of the
# two when they train side by side (train_pace). Two processes on two cores also cost each other, which the probe
# does not see, so the report states what ran: the steps, and the pace the training itself kept. When even the
# stages' floors leave less, training gets what they leave.
MIN_TRAIN_STEPS = 100
FLOOR_RECORD = "docs/records/speedrun-2026-11-26.md, 105 steps"  # the run the floor rests on, as the report cites it


def train_config(cfg: dict, model_dir: Path, cache: Path, reg: bool, steps: int | None = None,
                 minutes: float | None = None) -> TrainConfig:
    """The TrainConfig of a speedrun model (both models: same data, shape, seed and budget; IDN-Reg adds
    the regulariser). Every step is logged (log_every 1): the side-by-side runner follows the logs (a
    lockstep run's step gate and stop file are its TrainJob's, given to `fit` as hooks)."""
    return TrainConfig(out=str(model_dir), data=cfg["data"], max_chars=cfg["max_chars"],
                       vocab_size=cfg["vocab_size"], cache_dir=str(cache), depth=cfg["depth"], width=cfg["width"],
                       head_dim=cfg["head_dim"], seq_len=cfg["seq_len"], batch_size=cfg["batch_size"],
                       seed=cfg["seed"], reg_n=str(cfg["reg_n"]), eval_every=100, save_every=100, log_every=1,
                       device=cfg["device"], reg="idn" if reg else "none", reg_lambda=REG_LAMBDA, steps=steps,
                       minutes=minutes, no_progress=True)


def training_step(tcfg: TrainConfig, mcfg, device: str):
    """A factory of one optimizer step of the model `tcfg` trains (snlp.train: its TrainStep loss with the
    regulariser at full lambda, its optimizers) on a fresh model of `mcfg` and one random batch: what the probe
    times to price training (the weights and the tokens do not change the cost)."""
    def make():
        from snlp.model.gpt import GPT
        from snlp.train.job import TrainStep, reg_config
        from snlp.train.optim import build_optimizers

        torch.manual_seed(tcfg.seed)
        model = GPT(mcfg)
        model.init_weights(seed=tcfg.seed)
        model.to(device).train()
        reg = reg_config(tcfg, mcfg)
        loss, opts, lam = TrainStep(model, reg), build_optimizers(model, tcfg), reg.weight(10 ** 9)
        g = torch.Generator().manual_seed(tcfg.seed)
        x = torch.randint(0, mcfg.vocab_size, (tcfg.batch_size, tcfg.seq_len + 1), generator=g).to(device)  # (B, T+1)

        def step():
            loss(x[:, :-1], x[:, 1:], lam)[0].backward()
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad(set_to_none=True)
        return step
    return make


def train_pace(pr) -> float:
    """Seconds per lockstep step of the two models on this box: the probe's step of both models' own training steps
    as training runs them (Probe.lockstep_s), else its one training step (a probe without them)."""
    return pr.lockstep_s or pr.train_step_s


@dataclasses.dataclass
class TrainJob:
    """One training run of the speedrun: its TrainConfig, the stage settings it is made with, the
    marker that says an unfinished run in its folder was started with those settings (so it may be
    resumed) and, for side-by-side runs in lockstep, the folder of the step gate and stop file that
    all of them poll (Lockstep)."""

    key: str
    cfg: TrainConfig
    settings: dict
    partial: Path
    lockstep: Path | None = None

    @property
    def gate_file(self) -> Path | None:
        return None if self.lockstep is None else self.lockstep / "train.gate"

    @property
    def stop_file(self) -> Path | None:
        return None if self.lockstep is None else self.lockstep / "train.stop"

    @property
    def model_dir(self) -> Path:
        return Path(self.cfg.out)

    @property
    def log(self) -> Path:
        return self.model_dir.parent / f"{self.model_dir.name}.train.log"


def _steady(log: list[dict]) -> list[dict]:
    """The train rows of steady steps: each leg's first trained step left out (`leg_start`: step 1, and the step after
    the checkpoint a resumed leg starts from, which builds the caches and, compiled, compiles again); step 1 also
    where an older log lacks the mark."""
    return [r for r in log if r["step"] >= 2 and not r.get("leg_start")]


def _warm_steps(log: list[dict]) -> list[int]:
    """The train rows' steps that _steady leaves out (the report names them)."""
    return sorted({r["step"] for r in log if "loss" in r and (r["step"] < 2 or r.get("leg_start"))})


def _median_tok_s(log: list[dict]) -> float | None:
    rates = [r["tok_s"] for r in _steady(log) if "tok_s" in r]
    return statistics.median(rates) if rates else None  # an even count: the mean of the middle two


def _stepping_tok_s(log: list[dict]) -> float | None:
    """Tokens over the summed wall time of the steps (each step's tokens / its `tok_s`), start-up and validation
    passes left out: the pace the run actually stepped at. The median of `tok_s` understates a heavy-tailed step
    time (a loaded box's slow steps), and a budget priced on it runs out."""
    rates = [r["tok_s"] for r in _steady(log) if r.get("tok_s")]
    return len(rates) / sum(1.0 / x for x in rates) if rates else None  # equal tokens per step: harmonic mean


def _mean_step_s(log: list[dict]) -> float | None:
    """The mean of the model's own step times (`step_s`), what the training log's summary prints."""
    secs = [r["step_s"] for r in _steady(log) if r.get("step_s")]
    return sum(secs) / len(secs) if secs else None


def _median_step_s(log: list[dict]) -> float | None:
    """The median of the model's own step times (`step_s`: a step's start to its statistics, without the lockstep
    wait for the other model that `tok_s` includes)."""
    secs = [r["step_s"] for r in _steady(log) if r.get("step_s")]
    return statistics.median(secs) if secs else None  # an even count: the mean of the middle two


def _log_state(path: Path, since: int = 0) -> dict:
    """The latest step, train loss, tokens/s, val loss and stop decision in a training log.jsonl (being written).
    `since`: the step this leg of the run resumed from; a stop logged at or before it is an earlier leg's (e.g. the
    signal that interrupted it), not this leg's decision."""
    st: dict = {}
    for r in read_log(path):
        st["step"] = max(st.get("step", 0), r.get("step", 0))
        for k in ("loss", "tok_s", "val_loss"):
            if k in r:
                st[k] = r[k]
        if "loss" in r and r.get("step", 0) > since:  # a step record: "stop" names why the run ends after it (a
            st["stop"] = r.get("stop")  # resumed run's earlier stop, e.g. stop_after, is superseded by its later steps)
        elif "stop" in r and r.get("step", 0) > since:  # a stop decided between steps, on a row of its own
            st["stop"] = r["stop"]
    return st


def _saved_step(model_dir: Path) -> int:
    """The step of the checkpoint in `model_dir` (0 where there is none)."""
    from snlp.io.checkpoint import load_train_state

    st = load_train_state(model_dir) if (model_dir / "train_state.pt").is_file() else None
    return int(st.get("step", 0)) if isinstance(st, dict) else 0


def stop_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """Send this process SIGTERM (fit stops after its step and saves, as on Ctrl-C) once its parent `parent` is gone:
    a speedrun killed with SIGKILL (kill -9, the OOM killer) runs no handler to stop its training processes
    (stop_children), and they trained on, orphaned, into OUT, where a re-run deleted or resumed the same model folder
    while they wrote to it (a lockstep run waits at its gate until its minutes are spent). A daemon thread polls
    os.getppid(): the orphan's parent becomes another process."""
    import signal
    import threading

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="snlp-parent-watch", daemon=True).start()


def _train_child(cfg: TrainConfig, threads: int, log: str, stop_file: Path | None, gate_file: Path | None,
                 parent: int | None = None) -> None:
    """A training process (spawned): its output goes to the job's log, then `fit(cfg)`, polling the lockstep
    files when given (hooks are built here: closures do not cross a spawn); it stops and saves when the speedrun
    process `parent` is gone (stop_with_parent)."""
    import traceback

    from snlp.apps.train import file_hooks
    from snlp.train.trainer import fit

    with open(log, "a", buffering=1) as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        sys.stdout = sys.stderr = f
        if threads:
            torch.set_num_threads(threads)
        if parent is not None:
            stop_with_parent(parent)
        try:
            res = fit(cfg, hooks=file_hooks(stop_file, gate_file))
        except BaseException:
            traceback.print_exc()
            f.flush()
            os._exit(1)
        if res.stopped_by == "interrupt":  # saved, not finished: the status says which signal (snlp.apps.train)
            from snlp.train.hooks import signal_number

            f.flush()
            os._exit(128 + signal_number(res.signal))


def resumable(model_dir: Path, partial: Path, settings: dict) -> bool:
    """Whether model_dir holds an interrupted training that a run of `settings` resumes (_launch): its weights and
    train state, and the marker that it was started with these settings."""
    return ((model_dir / "model.safetensors").is_file() and (model_dir / "train_state.pt").is_file()
            and read_json(partial) == canon(settings))


def rerun_training(sr: Speedrun) -> list[str] | None:
    """What a re-run of this invocation's command does with each training it has not finished, read from OUT after
    the stop (the training processes have saved or died by then): "<model> resumes from step N" where a resumable
    save of these settings is there, else "<model> trains again from step 0" (a signal before the first save: the
    re-run starts over). [] when no training is pending; None when the tokenizer stage has not run (the settings a
    re-run trains with are not known yet)."""
    from snlp.apps.report import MODELS
    from snlp.train.checkpointing import saved_state

    if sr.tokenizer is None:
        return None
    names, out = dict(MODELS), []
    for key, reg in TRAINED:
        if key in sr.trains:  # finished (this invocation or reused): the re-run reuses it
            continue
        settings = _train_settings(sr, key, reg, sr.tokenizer.id)[1]
        model_dir, partial = sr.out / key, sr.out / "stages" / f"train-{key}.partial.json"
        if resumable(model_dir, partial, settings):
            step = (saved_state(model_dir) or {}).get("step")
            out.append(f"{names[key]} resumes from step {step}" if isinstance(step, int) else
                       f"{names[key]} resumes from its last save")
        elif sr.retraining or partial.is_file():
            out.append(f"{names[key]} trains again from step 0 (nothing of it was saved)")
    return out


def _launch(job: TrainJob, threads: int, force: bool, console):
    """Start a training process for a job (resuming an interrupted run of the same settings)."""
    import multiprocessing

    resume = not force and resumable(job.model_dir, job.partial, job.settings)
    if resume:
        console.print(f"{job.key}: resuming the interrupted training in {job.model_dir}")
    else:
        shutil.rmtree(job.model_dir, ignore_errors=True)
        write_json(job.partial, canon(job.settings))
    job.log.parent.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(job.cfg, resume=resume)
    with open(job.log, "a" if resume else "w") as f:  # the config this leg runs (a resumed leg says resume=True)
        f.write(f"train {job.key}: {cfg}\n")
    proc = multiprocessing.get_context("spawn").Process(
        target=_train_child, args=(cfg, threads, str(job.log), job.stop_file, job.gate_file, os.getpid()),
        name=f"snlp-train-{job.key}")
    proc.start()
    return proc


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-n:])
    except OSError:
        return ""


class Lockstep:
    """Side-by-side runs kept at the same step through two files every run polls (TrainJob.gate_file and
    .stop_file, read by the training loop's hooks: snlp.apps.train.file_hooks): a run starts step s only once the gate reads >= s, and the gate moves to s + 1 only when every
    run has logged step s without deciding to stop there. With a wall-clock budget each run's LR schedule
    follows its own elapsed time (equal at equal steps in lockstep), and the first run to stop on the budget
    fixes the stop step N in the stop file: the others, held at the gate after step N, stop there too."""

    def __init__(self, gate: Path, stop: Path):
        self.gate_file, self.stop_file, self.gate, self.stopped = gate, stop, 0, False
        stop.unlink(missing_ok=True)
        self._open(1)

    def _open(self, step: int) -> None:
        if step != self.gate:
            write_atomic(self.gate_file, str(step))
            self.gate = step

    def update(self, states: dict[str, dict]) -> None:
        """states: each run's latest log state (`_log_state`: last step, and "stop" once it decided to stop)."""
        stops = [st.get("step", 0) for st in states.values() if st.get("stop")]
        if stops:
            if not self.stopped:
                write_atomic(self.stop_file, str(min(stops)))
                self.stopped = True
            return
        self._open(min(st.get("step", 0) for st in states.values()) + 1)


def train_models(jobs: list[TrainJob], console, parallel: bool = True, threads: int = 0, force: bool = False,
                 every: float = 30.0, ends: dict | None = None, resumed: dict | None = None) -> dict[str, float]:
    """Run the jobs' trainings, all at once (parallel) or one after another, with `threads` intra-op threads
    each (0 = torch's default); in lockstep when every job names a lockstep folder (see
    Lockstep: a wall-clock budget that ends every run at the same step); a status line every `every` seconds
    (a live bar on a terminal). Returns each job's wall time. A failed run stops the others. `ends`, when given,
    gets each job's (finish time, 1-minute load average) as it ended: side by side without lockstep one run ends
    well before the other, and its stage record is written only once both have. `resumed`, when given, gets the
    step each job resumed from where it resumed an earlier invocation's save."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    groups = [jobs] if parallel else [[j] for j in jobs]
    seconds: dict[str, float] = {}
    for group in groups:
        t0 = time.perf_counter()
        lock = Lockstep(group[0].gate_file, group[0].stop_file) if all(j.lockstep for j in group) else None
        procs = {j.key: _launch(j, threads, force, console) for j in group}
        # the step each resumed from (read before its first save): Lockstep ignores the stops of earlier legs
        since = {j.key: _saved_step(j.model_dir) for j in group}
        if resumed is not None:  # a leg that resumed an earlier invocation's save (its report says so)
            resumed.update({k: v for k, v in since.items() if v})
        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                       TimeElapsedColumn(), console=console, disable=not console.is_terminal)
        tasks = {j.key: bar.add_task(f"train {j.key}", total=j.cfg.steps, info="") for j in group}
        last = time.perf_counter()
        try:
            with bar:
                while procs:
                    time.sleep(0.05)
                    status, states = [], {}
                    for j in group:
                        st = states[j.key] = _log_state(j.model_dir / "log.jsonl", since[j.key])
                        info = " ".join(f"{k} {st[k]:,.{p}f}" for k, p in (("loss", 3), ("val_loss", 3), ("tok_s", 0))
                                        if k in st)
                        bar.update(tasks[j.key], completed=st.get("step", 0), info=info)
                        status.append(f"{j.key} step {st.get('step', 0)}/{j.cfg.steps or '?'} {info}")
                    for key, p in list(procs.items()):
                        if p.is_alive():
                            continue
                        p.join()
                        del procs[key]
                        seconds[key] = time.perf_counter() - t0
                        if ends is not None:
                            ends[key] = (datetime.now().astimezone().isoformat(timespec="seconds"), load_average())
                        job = next(j for j in group if j.key == key)
                        # a signal to the training process itself (Slurm signals every process of a job step): it
                        # saved; the speedrun stops too
                        if (signum := stopped_by_signal(p.exitcode)) is not None:
                            raise Interrupted(signum)
                        if p.exitcode != 0:
                            raise RuntimeError(f"training {key} failed (exit {p.exitcode}); the end of {job.log}:\n"
                                               f"{_tail(job.log)}")
                        console.print(f"{key}: {_tail(job.log, 1)}")
                    if lock is not None:
                        lock.update(states)
                    if not console.is_terminal and time.perf_counter() - last >= every and procs:
                        last = time.perf_counter()
                        console.print(f"[train {fmt_s(last - t0)}] " + " | ".join(status))
        finally:  # only our own children: a failure, Ctrl-C or a signal stops the others, each saving its run
            stop_children(list(procs.values()), STOP_GRACE_S)
    return seconds


def stopped_by_signal(exitcode: int | None) -> int | None:
    """The STOP_SIGNALS signal that ended a training process: its status 128 + N after `fit` stopped on it and saved
    (_train_child), or -N where it ended the process before the loop armed its handler (nothing saved yet)."""
    for s in STOP_SIGNALS:
        if exitcode in (128 + int(s), -int(s)):
            return int(s)
    return None


def stop_children(procs: list, grace_s: float) -> None:
    """Ask training processes to stop (SIGTERM: each finishes its step, or leaves the lockstep gate, and saves its
    checkpoint), wait up to `grace_s` seconds for all of them, then kill those still running. The kill also runs
    when the wait itself is cut short (a second Ctrl-C), so no child outlives the speedrun."""
    try:
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()


def train_summary(job: TrainJob, fingerprint: str, wall: float) -> dict:
    """Steps, tokens, time, throughput and the validation curve of a finished job."""
    from snlp.io.checkpoint import load_train_state
    from snlp.io.tokenizer import Tokenizer

    tok = Tokenizer.load(job.model_dir)
    if tok.fingerprint() != fingerprint:
        raise RuntimeError(f"{job.model_dir} was trained with another tokenizer than the tokenizer stage's")
    log = read_log(job.model_dir / "log.jsonl")
    evals = [r for r in log if "val_loss" in r]
    state = load_train_state(job.model_dir) or {}
    steps = int(state.get("step", max(r["step"] for r in log)))
    final = evals[-1]
    gap_key = next((k for k in final if k.startswith("gap_N")), None)
    job.partial.unlink(missing_ok=True)
    c = job.cfg
    return {"steps": steps, "tokens": steps * c.batch_size * c.seq_len * c.grad_accum,
            "train_seconds": float(state.get("elapsed", wall)), "wall_seconds": wall,
            "median_tok_s": _median_tok_s(log), "val_loss": final["val_loss"],  # each leg's first step: warm-up
            "median_step_s": _median_step_s(log),
            "stepping_tok_s": _stepping_tok_s(log), "mean_step_s": _mean_step_s(log),
            "warm_steps": _warm_steps(log),
            "gap_key": gap_key, "gap": final.get(gap_key), "gap_at_0": evals[0].get(gap_key),
            "val_curve": [[r["step"], r["val_loss"], r.get(gap_key)] for r in evals]}


def step_train(sr: Speedrun) -> None:
    """Both models, reusing a finished one. They train side by side in lockstep (same step at every
    moment): with a wall-clock budget the first run to reach it fixes the stop step for both (Lockstep), so
    the budget holds on a loaded machine and the comparison stays at equal steps and tokens."""
    jobs = _train_jobs(sr)
    if jobs:
        _train(sr, jobs)


def training_minutes(sr: Speedrun) -> float:
    """Training's share of --budget when it starts now (what the plan leaves), in minutes; the preset and
    config take it (a reused training keeps the minutes it was made with)."""
    plan = sr.plan()
    minutes = round(plan.train_share(sr.elapsed(), TRAIN_OVERHEAD_S) / 60, 2)
    sr.preset = dataclasses.replace(sr.preset, minutes=minutes)
    sr.cfg = dataclasses.replace(sr.cfg, minutes=minutes)
    pace = train_pace(plan.probe)  # seconds per lockstep step of the two models, as the probe measured them
    sr.console.print(f"budget {sr.preset.budget_minutes:g} min: training gets {minutes:g} min (~"
                     f"{minutes * 60 / pace:.0f} steps at the probe's {pace:.2f} s per step; floor {MIN_TRAIN_STEPS} steps, "
                     f"{fmt_s(plan.train_floor_s)}), the other stages "
                     f"{fmt_s(sum(p.share_s for p in plan.stages.values() if not p.reused))}")
    if plan.train_cut:
        sr.console.print(f"[yellow]training may get less than its floor[/yellow]: the other stages at their floors "
                         f"leave it {fmt_s(plan.train_s)} of the {fmt_s(plan.train_floor_s)} that {MIN_TRAIN_STEPS} "
                         f"steps take at the probe's pace (the report says how many steps ran)")
    return minutes


TRAINED = (("noreg", False), ("idn", True))  # (model key, IDN-regularised)


def _train_settings(sr: Speedrun, key: str, reg: bool, tokenizer_id: str) -> tuple[TrainConfig, dict]:
    """(TrainConfig, stage settings) of model `key` in this invocation, on the tokenizer stage `tokenizer_id`."""
    pre = sr.preset
    budgeted = pre.budget_minutes is not None
    # train_config reads the settings as a dict (the training-launch side keeps that interface); under a
    # budget the minutes are the plan's, known once training starts (_train), so the settings name the budget
    tcfg = train_config(dataclasses.asdict(sr.cfg), sr.out / key, sr.cache, reg, steps=pre.steps,
                        minutes=pre.minutes if not budgeted else 1.0)
    train = {k: v.replace(str(sr.out), "{out}") if isinstance(v, str) else v
             for k, v in dataclasses.asdict(tcfg).items()}
    if budgeted:
        train["minutes"] = f"budget {pre.budget_minutes:g}"
    # the CPU kernels torch picks (ATen's capability, ISA caps): other kernels are another measurement (and a
    # budgeted training another number of steps), never a stage to reuse under the report's new hardware line
    return tcfg, {"train": train, "tokenizer": tokenizer_id, "threads": sr.train_threads, "lockstep": sr.parallel,
                  "cpu_kernels": cpu_isa()}


def _changes(was, now, prefix: str = "") -> list[str]:
    """'name old -> new' for each setting that differs between two stage settings (nested dicts by dotted name)."""
    if isinstance(was, dict) and isinstance(now, dict):
        return [c for k in sorted(set(was) | set(now), key=str)
                for c in _changes(was.get(k), now.get(k), f"{prefix}{k}." if prefix or k != "train" else "")]
    if was == now:
        return []
    if prefix == "snlp_code.":  # records.keyed: the stage was made by another version of snlp's source
        return [f"it was made by another snlp source (code digest {was!r} -> {now!r})" if was is not None else
                "it was made by an snlp from before stage records named their source"]
    return [f"{prefix.rstrip('.') or 'settings'} {was!r} -> {now!r}"]


def check_replaces(sr: Speedrun) -> None:
    """Refuse, before any stage runs, a re-run into an OUT whose trained model (finished, or interrupted and
    resumable) this invocation would not reuse: other settings (--quick, --budget, --depth, --data, another
    CPU, ...) retrain from scratch into the same folder, which deletes the model the earlier run trained
    (minutes of work, and the report's evidence). --force is the way to replace them. An OUT that is itself a
    checkpoint or a drafter (snlp train / convert / adapt) is refused, --force or not: the run would fill it with
    a folder of its own."""
    from snlp.io.checkpoint import DRAFTER_META, WEIGHTS

    for own, what in ((WEIGHTS, "a checkpoint (snlp train / sft / convert)"), (DRAFTER_META, "a drafter (snlp adapt)")):
        if (sr.out / own).is_file():
            raise ValueError(f"--out {sr.out} is {what}; the speedrun writes a folder of its own: choose another --out")
    if sr.force:
        return
    spec = dataclasses.asdict(sr.cfg.data_spec)
    tok = sr.stages.peek("tokenizer", spec, outputs=[sr.cache])
    for key, reg in TRAINED:
        model = sr.out / key / "model.safetensors"
        if not model.is_file():
            continue
        name = f"train-{key}"
        if tok is not None:
            settings = canon(_train_settings(sr, key, reg, tok.id)[1])
            if sr.stages.peek(name, settings, outputs=[model]) is not None:
                continue  # reused
            partial = read_json(sr.out / "stages" / f"{name}.partial.json")
            if partial == settings and (sr.out / key / "train_state.pt").is_file():
                continue  # an interrupted training of these settings: resumed
            rec = read_json(sr.stages.path(name))
            was, now = (partial, settings) if partial is not None else ((rec or {}).get("settings"), keyed(settings))
            changes = (_changes(was, now) if isinstance(was, dict) else ["its stage record is missing"]) \
                or ["its resume state (train_state.pt) is missing"]
        else:
            was = (read_json(sr.stages.path("tokenizer")) or {}).get("settings")
            changes = (_changes(was, keyed(spec)) if isinstance(was, dict) else ["its tokenizer record is missing"]) \
                or [f"the token cache {sr.cache} it was trained from is gone"]
        raise ValueError(f"--out {sr.out} holds the model {sr.out / key}, which this run cannot reuse ("
                         + "; ".join(changes[:4]) + (", ..." if len(changes) > 4 else "")
                         + "): this run would train it anew in its place; choose another --out, or pass --force to "
                         "replace it (every stage is redone)")


def _train_jobs(sr: Speedrun) -> list[TrainJob]:
    """The training runs still to do (a model whose stage record matches is reused into sr.trains)."""
    pre = sr.preset
    budgeted = pre.budget_minutes is not None
    lockstep = sr.out / "stages" if (pre.minutes or budgeted) and sr.parallel else None
    jobs = []
    for key, reg in TRAINED:
        tcfg, settings = _train_settings(sr, key, reg, sr.tokenizer.id)
        rec = sr.stages.lookup(f"train-{key}", settings, outputs=[sr.out / key / "model.safetensors"])
        if rec is not None:
            sr.trains[key] = rec
            if budgeted and rec.result.get("minutes"):  # the share it trained (the report's training sentence)
                sr.cfg = dataclasses.replace(sr.cfg, minutes=rec.result["minutes"])
        else:
            jobs.append(TrainJob(key, tcfg, settings, sr.out / "stages" / f"train-{key}.partial.json", lockstep))
    return jobs


def _train(sr: Speedrun, jobs: list[TrainJob]) -> None:
    if sr.preset.budget_minutes is not None:
        minutes = training_minutes(sr)
        jobs = [dataclasses.replace(j, cfg=dataclasses.replace(j.cfg, minutes=minutes, steps=None)) for j in jobs]
    else:
        sr.plan()  # the predictions of the later stages (the report's Planned column)
    pre = sr.preset
    budget = f"{pre.minutes:g}-minute budget, lockstep" if pre.minutes else f"{pre.steps} steps"
    for j in jobs:
        sr.stages.begin(f"train-{j.key}", ("IDN-Reg model (--reg idn)" if j.key == "idn" else "No-Reg model")
                        + f": depth {pre.depth}, width {pre.width}, {budget}")
    sr.console.print(("side by side, " if sr.parallel and len(jobs) > 1 else "")
                     + (f"{sr.train_threads} intra-op thread(s) each; " if sr.train_threads else "")
                     + "logs: " + ", ".join(str(j.log) for j in jobs))
    sr.retraining = True
    for j in jobs:  # a record of the model this run replaces (--force, or a model file gone) must not outlive it:
        # an interrupted training leaves a model.safetensors that record's settings would match
        sr.stages.path(f"train-{j.key}").unlink(missing_ok=True)
    ends: dict[str, tuple] = {}
    resumed: dict[str, int] = {}
    walls = train_models(jobs, sr.console, sr.parallel, sr.train_threads, sr.force, ends=ends, resumed=resumed)
    fingerprint = sr.tokenizer.result["fingerprint"]
    for j in jobs:
        if pre.minutes:
            sr.stages.notes[f"train-{j.key}"] = {"planned": pre.minutes * 60 + TRAIN_OVERHEAD_S}
        result = {**train_summary(j, fingerprint, walls[j.key]), "minutes": pre.minutes,
                  "resumed_from_step": resumed.get(j.key)}
        sr.trains[j.key] = sr.stages.finish(f"train-{j.key}", j.settings, result, seconds=walls[j.key],
                                            ended=ends.get(j.key))

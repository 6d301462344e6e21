"""A run's checkpoint beyond the weights: where it stopped (step, data position, clock, tokens), the RNG
states and the optimizer states, so `--resume` continues bitwise exactly (on CPU)."""

from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import snlp.io.data as D
from snlp.io.checkpoint import (DRAFTER_META, OWN_FILES, TRAIN_STATE, WEIGHTS, clear_stale_saves, cut_off_save,
                                holds_speedrun, load, load_train_state, load_training, save_checkpoint)
from snlp.io.tokenizer import Tokenizer
from snlp.io.source import home_path
from snlp.model.gpt import GPT
from snlp.runtime.device import json_number
from snlp.train.config import TrainConfig, check_resume_settings
from snlp.train.optim import OptimizerBundle, Progress


@dataclass
class ResumePoint:
    """Where a saved run stopped (train_state.pt) and its optimizer states (optimizer.pt)."""

    step: int
    micro: int  # micro-batches consumed: the data position
    elapsed: float  # the run's training clock
    tokens: int
    rng: dict
    optimizer: list  # one state dict per optimizer (OptimizerBundle)
    init_from: str | None = None  # the checkpoint the run's first leg started from (--init-from), kept in every save
    data_digest: str | None = None  # the digest of the tokens it trained on (Job.data_digest), where recorded
    command: str = "snlp train"  # the command whose run it is (run_command): a resume continues it as that only
    skipped: int = 0  # steps skipped with nothing to learn from by then (Job.skip_empty)


@dataclass
class Start:
    """What a run starts from: a fresh start (all None) or the saved run in --out (model, tok, resume)."""

    model: GPT | None = None
    tokenizer: Tokenizer | None = None
    resume: ResumePoint | None = None


def open_run(out: Path, resume: bool, cfg: TrainConfig | None = None, world: int | None = None) -> Start:
    """The saved run in `out` when resuming (checked complete, and `cfg` and the number of processes `world` checked
    against what it was saved with: `check_resume_settings`); else check `out` holds no checkpoint yet."""
    has_ckpt = (out / "model.safetensors").is_file()
    hidden = cut_off_save(out)
    if hidden is not None:  # a new run would start from nothing, and a resume would find no checkpoint
        raise ValueError(f"--out {out} is gone but its last checkpoint is in {hidden} (a save was cut off between "
                         f"its two renames): move it back (mv {hidden} {out}) and --resume, or remove it to start "
                         f"afresh")
    if (out / DRAFTER_META).is_file():  # a run's log.jsonl and checkpoint would go in beside the drafter's own log
        raise ValueError(f"{out} holds a drafter (snlp adapt); choose another --out")
    if not resume:
        if has_ckpt and not (out / TRAIN_STATE).is_file():  # --resume would refuse it too: nothing to continue
            raise ValueError(f"{out} already holds a weights-only checkpoint (no {TRAIN_STATE}: e.g. `snlp convert`'s), "
                             f"which no run continues: choose another --out (a new run starts from its weights with "
                             f"snlp train --init-from {out} or snlp sft {out})")
        if has_ckpt:
            raise ValueError(f"{out} already holds a checkpoint; pass --resume to continue it or choose another --out")
        if holds_speedrun(out):
            raise ValueError(f"{out} holds a speedrun (stages/); choose another --out")
        # no checkpoint here, yet files by the names a save writes (a sharded transformers model's config.json and
        # tokenizer.json, the user's own): save_checkpoint would replace them with the new run's
        taken = [f for f in (*OWN_FILES, "train_summary.json") if (out / f).exists()]
        if taken:
            raise ValueError(f"--out {out} holds {', '.join(taken)} but no {WEIGHTS} (not an snlp checkpoint): the "
                             f"run's checkpoint would replace them; choose another --out")
        return Start()
    if not has_ckpt:
        raise FileNotFoundError(f"--resume: no checkpoint in {out}; drop --resume to start a new run")
    opt_state, st = load_training(out)
    if opt_state is None or st is None:
        raise ValueError(f"--resume: {out} lacks optimizer.pt/train_state.pt (a weights-only checkpoint): start a "
                         f"new run from its weights in another --out (snlp train --init-from {out}, snlp sft {out})")
    if cfg is not None:
        check_resume_settings(cfg, st.get("args"), out, reads_data="sft" not in st)
    saved_world = st.get("world")  # absent from checkpoints of an snlp that did not record it: not checked
    if world is not None and saved_world is not None and saved_world != world:
        raise ValueError(f"--resume: the run in {out} was saved by {saved_world} process(es) and this one has {world}: "
                         f"each process reads its own share of every step's batch, so another count would change the "
                         f"batch and the data position; resume it with {saved_world} (torchrun --nproc_per_node="
                         f"{saved_world}) or start a new run in another --out")
    model, tok = load(out, device="cpu")
    point = ResumePoint(step=st["step"], micro=st["micro"], elapsed=st.get("elapsed", 0.0),
                        tokens=int(st.get("tokens", 0)), rng=st["rng"], optimizer=opt_state["optimizer"],
                        init_from=(st.get("args") or {}).get("init_from"),
                        data_digest=(st.get("args") or {}).get("data_digest"), command=run_command(st),
                        skipped=int(st.get("skipped", 0)))
    return Start(model, tok, point)


def clear_killed_saves(out: Path) -> None:
    """Remove the hidden model copies that saves into `out` killed mid-way (SIGKILL, a crash) left beside it
    (snlp.io.checkpoint.stale_saves: their processes are gone), saying so in one line. Called by the run that holds
    `out`'s lock (rank 0), once `open_run` accepted it."""
    removed = clear_stale_saves(out)
    if removed:
        print(f"{out}: removed {len(removed)} hidden cop{'y' if len(removed) == 1 else 'ies'} left by a save that was "
              f"killed ({', '.join(p.name for p, _ in removed)}: {sum(n for _, n in removed) / 2**20:.1f} MiB)",
              file=sys.stderr, flush=True)


# The Job states (snlp.train.job.Job.state) that mark a run of another command than pretraining: snlp sft and snlp
# adapt save their own settings under these keys in train_state.pt; a pretraining run saves neither.
RUN_COMMANDS = {"sft": "snlp sft", "adapt": "snlp adapt"}


def run_command(state: dict) -> str:
    """The command whose run a saved train state (or a Job's `state`) belongs to: snlp sft, snlp adapt or snlp
    train (pretraining)."""
    return next((cmd for key, cmd in RUN_COMMANDS.items() if key in state), "snlp train")


def check_resume_command(out, command: str, saved: str | None = None) -> None:
    """Refuse `command --resume` of the run in `out` when another command saved it (`saved`: its run_command; None:
    read from out's train_state.pt, nothing to check where there is none): the loop would continue it as another
    kind of run (a pretraining run fine-tuned on chats, an SFT run pretrained on the base's text) and write the
    result over its checkpoint, the run itself lost."""
    if saved is None:
        st = saved_state(out)
        if st is None:
            return
        saved = run_command(st)
    if saved != command:
        raise ValueError(f"--resume: {out} holds a run of `{saved}`, not of `{command}`: continuing it here would "
                         f"make it another kind of run and overwrite its checkpoint; resume it with `{saved} --resume`, "
                         f"or start the new run in another --out")


def check_resume_left(cfg: TrainConfig) -> None:
    """Refuse `--resume` of the run in cfg.out (its settings already resolved: `resumed`) when the budget or
    --stop-after leaves it no step to run: the loop would only save the same weights again and write a
    train_summary.json without the run's validation and speed over the finished run's. Asked by the commands
    (snlp train, snlp sft), not by fit: snlp speedrun resumes a finished run to finish it."""
    st = saved_state(cfg.out)
    if st is None or not isinstance(st.get("step"), int):
        return
    step, elapsed = st["step"], float(st.get("elapsed", 0.0))
    if cfg.stop_after is not None and cfg.stop_after <= step:
        raise ValueError(f"--resume: the run in {cfg.out} is at step {step} already: --stop-after {cfg.stop_after} "
                         f"leaves it no step to run; give a later --stop-after")
    progress = Progress(cfg.total_steps, cfg.minutes)
    progress.step, progress.elapsed = step, elapsed
    if progress.done():
        budget = (f"--steps {cfg.total_steps}" if cfg.total_steps is not None and step >= cfg.total_steps
                  else f"--minutes {cfg.minutes:g}, {elapsed / 60:.3g} trained")
        raise ValueError(f"--resume: the run in {cfg.out} is done (step {step}, {budget}): nothing to continue, its "
                         f"checkpoint and summary are kept as they are; give a larger --steps or --minutes to train "
                         f"it further")


def save_run(out: Path, model: GPT, tok: Tokenizer, opts, state: dict) -> None:
    """The checkpoint (weights, tokenizer, optimizers) with `state` (step, micro, elapsed, tokens, args as
    `recorded_args` made them once for the run, ...) and this process's RNG states in train_state.pt."""
    save_checkpoint(out, model, tok, optimizer=OptimizerBundle(opts), train_state={**state, "rng": rng_state()})


def saved_state(out) -> dict | None:
    """The train state (train_state.pt: step, elapsed time, settings) of the run saved in `out`; None where `out`
    holds no saved run (no weights) or no train state."""
    if not (Path(out) / WEIGHTS).is_file():
        return None
    st = load_train_state(out)
    return st if isinstance(st, dict) else None


def saved_settings(out) -> dict | None:
    """The settings (`TrainConfig` fields, as `recorded_args` wrote them) of the run saved in `out`; None where
    `out` holds no resumable run (`open_run` then says why)."""
    st = saved_state(out)
    return st.get("args") if st is not None and isinstance(st.get("args"), dict) else None


def recorded_args(args: dict) -> dict:
    """A run's settings as its checkpoint records them: `cache_dir` (None: $SNLP_CACHE or the default at this
    moment) as an absolute path, so `snlp eval` of the checkpoint from another working directory, or under
    another $SNLP_CACHE, reads the token cache the run wrote instead of re-tokenising into a new one; and the
    relative parts of `data` absolute (`data.keyed_spec`: the form its token cache is keyed by), so that `--resume` from another folder reads the same
    files (the same documents in the same order: the same tokens and batches), with their names and sizes
    (`data_files`, data.files_signature), against which a moved project's new place is checked; `init_from`
    absolute, naming the checkpoint the first leg read from wherever a later leg runs."""
    out = dict(args)
    if out.get("init_from"):
        out["init_from"] = D.absolute_part(out["init_from"])
    if "cache_dir" in out:
        out["cache_dir"] = str(home_path(out["cache_dir"] or D.cache_dir()).absolute())
    if isinstance(out.get("data"), str):
        out["data"] = D.keyed_spec(out["data"])
        try:  # what the files are, wherever they move: a resume from a new place is checked against it
            out["data_files"] = D.files_signature(out["data"])
        except (ValueError, OSError):
            out["data_files"] = None
    return out


def trim_log(log: Path, step: int, micro: int | None = None) -> None:
    """Drop the records of steps after `step` from a run's log.jsonl (rewritten atomically): a run killed
    after its last save logged steps that `--resume` from that save runs, and logs, again. `micro`: the saved data
    position; the rows of skipped steps (`skipped_micro`, snlp.train.trainer.log_skip) at or past it go too, since
    they carry the step before them and the resumed run draws, skips and logs those micro-batches again."""
    def keep(ln: str) -> bool:
        n = _step(ln)
        if n is None:
            return True
        at = (log_record(ln) or {}).get("skipped_micro")
        return n <= step and not (micro is not None and isinstance(at, int) and at >= micro)
    _keep_lines(log, keep)


def drop_validations(log: Path, step: int) -> None:
    """Drop the validation records (val_loss) of `step` from a run's log.jsonl (rewritten atomically): a resumed run
    that validates its saved step again (step 0) logs it in their place."""
    _keep_lines(log, lambda ln: _step(ln) != step or "val_loss" not in (log_record(ln) or {}))


def _keep_lines(log: Path, keep_line) -> None:
    if not log.is_file():
        return
    lines = log.read_text().splitlines(keepends=True)
    keep = [ln for ln in lines if not ln.strip() or keep_line(ln)]
    if len(keep) != len(lines):
        tmp = log.with_name(log.name + f".tmp-{os.getpid()}")
        tmp.write_text("".join(keep))
        os.replace(tmp, log)


UNSAVED_LOG = "log.unsaved.jsonl"


def unsaved_log_path(folder: Path) -> Path:
    """Where to set a dead run's log aside in `folder`: UNSAVED_LOG, else log.unsaved.2.jsonl, ... (the first name
    not taken), so a second run killed before its first save does not replace the first one's log."""
    stem, k = UNSAVED_LOG.removesuffix(".jsonl"), 2
    path = folder / UNSAVED_LOG
    while path.exists():
        path, k = folder / f"{stem}.{k}.jsonl", k + 1
    return path


def set_aside_unsaved_log(log: Path) -> Path | None:
    """Move the log.jsonl a new run finds in its --out (no checkpoint there: a run killed before its first save) to
    a free log.unsaved[.N].jsonl beside it and return where; the new run's records would otherwise follow the dead
    run's in one log (two step 0s, two curves read as one). None where there is no such log."""
    if not log.is_file():
        return None
    aside = unsaved_log_path(log.parent)
    os.replace(log, aside)
    return aside


# the log.jsonl keys whose null is not a NaN the step measured: mfu null = no known peak; top1_ssd null = a drafter
# plan ssd_solve does not cover (snlp.train.adapt.validate_drafter), Top-1 itself is never NaN
LOG_NOT_FLOATS = ("step", "stop", "mfu", "top1_ssd")


def log_record(line: str) -> dict | None:
    """One log.jsonl line as the trainer logged it (snlp.train.trainer.write_log writes strict JSON): the measured
    floats' null and "inf" / "-inf" back to NaN and +-inf, so a diverged step read back is still diverged (a NaN loss,
    never 0 nor a None a formatter refuses). None for a line that is not a JSON object (one still being written)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict):
        return None
    return {k: json_number(v) if k not in LOG_NOT_FLOATS and (v is None or v in ("inf", "-inf")) else v
            for k, v in rec.items()}


def read_log(path) -> list[dict]:
    """The records of a training log.jsonl (log_record), skipping a line still being written; [] if absent."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    return [rec for line in lines if (rec := log_record(line)) is not None]


def _step(line: str) -> int | None:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    return rec.get("step") if isinstance(rec, dict) and isinstance(rec.get("step"), int) else None


def seed_all(seed: int) -> None:
    """Seed every generator train_state.pt's `rng` records (rng_state): torch's from `seed`, and Python's and numpy's
    global ones too. Those two were left seeded from the OS at start-up, so each run saved a different state for
    them: two identical runs, or a signal's save and a --stop-after save at one step, differed in `rng` although
    nothing of the run had drawn from them, and a resumed run restored a state no fresh run starts from."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed([seed % 2**32, seed >> 32])  # the legacy generator takes 32-bit words; a seed is up to 64 bits


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])

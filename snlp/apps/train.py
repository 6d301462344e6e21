"""Train a GPT from scratch, optionally with the SNLP-aware regulariser (--reg idn).

Works out of the box on CPU with no network: `snlp train --out runs/x --depth 8 --minutes 3`
trains a byte-level BPE on the standard library's Python sources and a small model on them.
Training defaults (aspect ratio 32, head dim 64, vocab 4096, seq len 256) are smaller than
`snlp bench`'s so a CPU run makes progress in minutes. Multi-process: `torchrun
--nproc_per_node=P -m snlp train ...` (DDP; NCCL on GPU, gloo on CPU; rank 0 logs and saves).

Library: `snlp.train.trainer.fit(TrainConfig(out=..., ...)) -> TrainResult`. The loop (optimisers, the
stateless LR multiplier written into every param group each step, checkpoints, exact resume, DDP) is
shared: a `Job` supplies the model, the batch source, the loss module and the validation, so
pretraining (`pretrain_job`) and chat SFT (snlp.train.sft) run the same machinery.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the library (and torch) loads in run(), after the flags are parsed: --help answers at once
    from snlp.train.config import TrainConfig
    from snlp.train.hooks import StopCheck, TrainHooks

SUMMARY = "Train a GPT from scratch, optionally with the SNLP-aware regulariser."
DESCRIPTION = """\
Trains a byte-level BPE tokenizer and a nanochat-style GPT on your text (--data; default: this Python's standard
library, offline) and writes a checkpoint every other command reads (weights, tokenizer, optimizer state, log.jsonl).
--reg idn, hcn or diag adds the paper's SNLP-aware regulariser; --resume continues a run exactly. The defaults are
small, so that a CPU run makes progress in minutes.

  snlp train --out runs/x --depth 8 --minutes 3             # CPU, no network
  snlp train --out runs/y --data my.txt --steps 2000 --reg idn --reg-lambda 0.5 --reg-n 8
  snlp train --out runs/x --resume --steps 4000             # continue with a new budget
  torchrun --nproc_per_node=4 -m snlp train --out runs/z    # DDP (NCCL on GPU, gloo on CPU)
"""
GUIDE = "docs/training.md"


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="checkpoint directory (created; with --resume, continued)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run saved in --out (weights, optimizer, data position, RNG): flags left out "
                   "keep the saved values; only the budget (--steps, --minutes, --stop-after), the intervals, "
                   "--device, --compile, --time-reg and --cache-dir may change (another value of any other flag is "
                   "refused)")
    p.add_argument("--init-from", default=None, metavar="CKPT",
                   help="start from this checkpoint's weights and tokenizer (e.g. `snlp convert` of a Hugging Face "
                   "model; paper App. 'Pretrained TinyLlama Fine-Tuning'): its shape and vocabulary are kept, so the "
                   "shape flags (--depth, --width, --vocab-size, ...) are refused beside it")
    p.add_argument("--freeze-prefix", type=int, nargs="?", const=-1, default=None, metavar="S",
                   help="train only layers S.. (and the final norm / untied lm_head); the embedding and the first S "
                   "layers stay frozen. Without a value S = depth - max(--reg-n), the SNLP suffix")
    d = p.add_argument_group("data")
    d.add_argument("--data", default="stdlib", help="stdlib | file/folder/glob (.txt, .py, .jsonl, .parquet) | "
                   "hf:NAME[:CONFIG][:SPLIT]; comma-separated to combine")
    d.add_argument("--text-field", default="text", help="text field of .jsonl/.parquet/hf rows")
    d.add_argument("--max-chars", type=int, default=0, help="use at most this many characters (0 = all; hf: 200M)")
    d.add_argument("--val-frac", type=float, default=0.05, help="fraction of documents held out for validation")
    d.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (specials included)")
    d.add_argument("--data-encoding", default="utf-8", help="text encoding of local data files (e.g. latin-1); "
                   "a byte that does not decode is an error naming the file and offset")
    d.add_argument("--cache-dir", default=None, help="token cache folder (default $SNLP_CACHE or ~/.cache/snlp)")
    m = p.add_argument_group("model (one dial: depth)")
    m.add_argument("--depth", type=int, default=8)
    m.add_argument("--width", type=int, default=None, help="model width; default depth * aspect ratio")
    m.add_argument("--aspect-ratio", type=int, default=32, help="width per layer of depth (bench: 64)")
    m.add_argument("--head-dim", type=int, default=64, help="attention head dim (bench: 128)")
    m.add_argument("--kv-heads", type=int, default=None)
    m.add_argument("--window-pattern", default="L")
    m.add_argument("--no-x0", action="store_true", help="disable the x0 residual")
    m.add_argument("--no-ve", action="store_true", help="disable value embeddings")
    m.add_argument("--hc-streams", type=int, default=0, help="mHC with this many residual streams (0 = plain "
                   "residual model); turns the x0 residual off")
    m.add_argument("--hc-static", action="store_true", help="static mHC (learned constant H) instead of dynamic")
    o = p.add_argument_group("optimisation")
    o.add_argument("--seq-len", type=int, default=256)
    o.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per process")
    o.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    o.add_argument("--steps", type=int, default=None, help="optimizer steps (default 1000 unless --minutes)")
    o.add_argument("--minutes", type=float, default=None, help="wall-clock budget; the LR schedule follows elapsed time")
    o.add_argument("--stop-after", type=int, default=None,
                   help="stop (and save) after this step; the LR schedule still follows the budget (--steps or --minutes)")
    o.add_argument("--stop-file", default=None, help="stop (and save) once the step number written in this file is done "
                   "(checked every step; e.g. to stop two side-by-side runs at the same step); other text, such as "
                   "'stop', stops it after the step in progress")
    o.add_argument("--optimizer", choices=["muon", "adamw"], default="muon", help="for the 2-D block matrices")
    o.add_argument("--matrix-lr", type=float, default=None, help="block-matrix LR (default 0.02 muon, 0.003 adamw)")
    o.add_argument("--embedding-lr", type=float, default=0.2, help="AdamW LR of wte and value embeddings")
    o.add_argument("--unembedding-lr", type=float, default=0.004, help="AdamW LR of lm_head")
    o.add_argument("--scalar-lr", type=float, default=0.5, help="AdamW LR of the x0 scalars (resid scalars: x0.01)")
    o.add_argument("--hc-lr", type=float, default=0.005, help="AdamW LR of the mHC coefficient parameters "
                   "(H biases, dynamic projections and gates)")
    o.add_argument("--weight-decay", type=float, default=0.0)
    o.add_argument("--warmup-steps", type=int, default=10, help="linear LR warm-up")
    o.add_argument("--warmdown", type=float, default=0.4, help="final fraction of the run with linear LR decay to 0")
    o.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm (0 = off)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--device", default=None, help="default: cuda if available (per local rank), else cpu")
    add_speed_arguments(o)
    r = p.add_argument_group("SNLP-aware regulariser (paper Eq. snlp-training-loss)")
    r.add_argument("--reg", choices=["idn", "hcn", "diag", "none"], default="none", help="surrogate of the regulariser's "
                   "K=1 solve (hcn: mHC models, --hc-streams; diag: DiagN, a fresh FD Hutchinson probe per "
                   "micro-batch and N from the seeded RNG, its diagonal estimate detached)")
    r.add_argument("--reg-lambda", type=float, default=0.5)
    r.add_argument("--reg-n", default="4", help="suffix lengths N, e.g. 8,16,24 (N >= depth is clipped to depth-1); also the N of the logged gap")
    r.add_argument("--reg-stride", type=int, default=0,
                   help="0 = final layer only; s > 0 adds S+s, S+2s, ... (counted from the suffix start S = depth - N, "
                   "as the paper's code; never S+1, whose K=1 state is exact: s = 1 adds S+2 .. L-1)")
    r.add_argument("--reg-detach", action=argparse.BooleanOptionalAction, default=None,
                   help="detach the sequential target (default: on for --reg hcn as in the paper's mHC run, "
                   "off otherwise)")
    r.add_argument("--reg-warmup", type=int, default=0, help="steps to ramp lambda from 0")
    add_reg_rows_argument(r)
    e = p.add_argument_group("logging")
    e.add_argument("--eval-every", type=int, default=50, help="validation every N steps (and at the end)")
    e.add_argument("--eval-batches", type=int, default=4)
    e.add_argument("--save-every", type=int, default=0, help="also save every N steps (0 = only at the end)")
    e.add_argument("--log-every", type=int, default=10)
    e.add_argument("--no-progress", action="store_true", help="no tqdm bar")


def add_reg_rows_argument(r) -> None:
    """--reg-rows (snlp train and snlp sft)."""
    r.add_argument("--reg-rows", type=float, default=None, metavar="F",
                   help="run the regulariser's K=1 solve on the first ceil(F x batch size) rows of each micro-batch "
                   "only (0 < F <= 1; rows are drawn at random, so the term keeps its expectation, with more variance; "
                   "logged as `reg_subset`); the CE still covers every row. Default: all rows, the paper's objective")


def add_speed_arguments(o) -> None:
    """--compile and --time-reg (snlp train and snlp sft)."""
    o.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="compile the step: model, loss and regulariser (or the SNLP-forward SFT solve) under "
                   "torch.compile (one graph, static shapes; bf16 autocast on CUDA, fp32 on CPU), Muon's Newton-Schulz "
                   "iterations and fused AdamW on CUDA; the first step compiles. --no-compile: a resume runs eager")
    o.add_argument("--time-reg", type=int, default=0, metavar="ROUNDS",
                   help="after training, time ROUNDS micro-batch steps with and without the regulariser (needs --reg) "
                   "and report the overhead in the summary")


def config_from_args(args) -> TrainConfig:
    """The TrainConfig of parsed `snlp train` flags (attributes named like the fields; others ignored)."""
    from snlp.train.config import TrainConfig

    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)})


def run(args) -> int:
    from snlp.train.checkpointing import check_resume_command, check_resume_left, saved_settings
    from snlp.train.config import (SHAPE, check_data_present, check_init_from_shape, check_out_outside_data,
                                   init_from_shape_refusal, resumed)
    from snlp.train.trainer import fit

    cfg = config_from_args(args)
    shape = [k for k in SHAPE if k in (getattr(args, "given", None) or ())]
    saved = None  # the resumed run's settings
    if cfg.init_from:  # typed at their defaults too (TrainConfig.check sees only values): the checkpoint decides
        check_init_from_shape(cfg.init_from, shape)
    if cfg.resume:  # the flags not typed keep the saved run's values; typed ones it may not change are refused
        check_resume_command(cfg.out, "snlp train")
        saved = saved_settings(cfg.out)
        if saved and saved.get("init_from") and shape:  # at any value, as beside --init-from
            raise ValueError(f"--resume: the run in {cfg.out}: {init_from_shape_refusal(saved['init_from'], shape)}")
        cfg = resumed(cfg, saved, getattr(args, "given", None))
        check_resume_left(cfg)
        if saved and cfg.data == saved.get("data"):  # before anything loads (pretrain_job checks it too)
            check_data_present(cfg)
    check_reg_flags(cfg.reg, getattr(args, "given", None))
    cfg.check()  # a value out of range is named as such before the checks of what the flags apply to
    check_hc_flags(cfg, (saved or {}).get("init_from"), getattr(args, "given", None))
    check_text_field(cfg.data, getattr(args, "given", None))
    check_out_outside_data(cfg.out, cfg.data)  # before the run's folder is made (pretrain_job checks it too)
    check_stop_file(args.stop_file, cfg.out, cfg.resume)
    res = fit(cfg, hooks=replace(file_hooks(args.stop_file), pass_late_signal=False))
    if res.stopped_by == "interrupt":
        return interrupted("train", res.out, res.steps, res.signal, ["--out", res.out, *not_inherited(args)])
    return finished_despite("train", res)


# the flags read by the SNLP-aware regulariser's loss only (train and sft; --reg-rows and --time-reg have their own
# refusals in TrainConfig.check). Not --reg-n: without --reg it still sets the suffixes whose gap_N the validation
# logs and --freeze-prefix's default S.
REG_FLAGS = ("reg_lambda", "reg_stride", "reg_detach", "reg_warmup")


def check_reg_flags(reg: str, given) -> None:
    """Refuse a regulariser flag typed for a run without the regulariser (`reg`, resolved: --resume keeps the saved
    run's), in one line before any work: `--reg-lambda 0.1` without --reg trained without it and said nothing. A
    library caller's TrainConfig keeps its defaults there (the speedrun's unregularised model sets reg_lambda)."""
    typed = [d for d in REG_FLAGS if d in (given or ())]
    if reg == "none" and typed:
        names = ", ".join("--" + d.replace("_", "-") for d in typed)
        raise ValueError(f"{names} {'sets' if len(typed) == 1 else 'set'} the SNLP-aware regulariser, and this run has "
                         f"none (--reg none): give --reg idn, hcn or diag, or drop {'it' if len(typed) == 1 else 'them'}")


def check_hc_flags(cfg, saved_init_from, given) -> None:
    """Refuse --hc-static or --hc-lr typed for a plain-residual model, in one line before any work: without
    --hc-streams the model has no H coefficients, so the run trained the plain model and said nothing. A model from a
    checkpoint (--init-from, or a resumed run that started from one) has the streams of that checkpoint, read from its
    config: an mHC model's takes --hc-lr for its H group, a plain one's is refused alike (--hc-static, a shape flag,
    is refused beside it already)."""
    typed = [d for d in ("hc_static", "hc_lr") if d in (given or ())]
    if not typed or cfg.hc_streams > 0:
        return
    names = " and ".join("--" + d.replace("_", "-") for d in typed)
    if src := cfg.init_from or saved_init_from:  # the checkpoint's own streams: its config says (snlp checkpoints;
        # another kind is left to the loader, which reads its config when the weights load)
        from snlp.io.checkpoint import checkpoint_dir, is_snlp_checkpoint, load_config

        try:  # the directory the loader reads: a file inside it (model.safetensors, config.json) or a ~ path names it
            src = checkpoint_dir(src)
        except (OSError, ValueError):  # no checkpoint there: the loader says so in its own words
            return
        if not is_snlp_checkpoint(src) or load_config(src).hc_streams > 0:
            return
        raise ValueError(f"{names} {'sets' if len(typed) == 1 else 'set'} the mHC residual streams' H coefficients, "
                         f"and the model of --init-from {src} has none (a plain-residual model): drop "
                         f"{'it' if len(typed) == 1 else 'them'}")
    raise ValueError(f"{names} {'sets' if len(typed) == 1 else 'set'} the mHC residual streams' H coefficients, and "
                     f"this model has none (--hc-streams 0): give --hc-streams N (N >= 1), or drop "
                     f"{'it' if len(typed) == 1 else 'them'}")


def check_text_field(data: str, given) -> None:
    """Refuse a typed --text-field where no part of --data has fields (a .jsonl / .parquet file, found in a folder or
    glob too, or hf:NAME), in one line before any work: plain text files are read whole, so the field was ignored
    and the run said nothing. A part that names nothing is left to the loader's own message."""
    from snlp.io.data import TABLE_SUFFIXES, parts, resolve_files

    if "text_field" not in (given or ()):
        return
    for part in parts(data):
        if part.startswith("hf:"):
            return
        try:
            if any(f.suffix.lower() in TABLE_SUFFIXES for f in resolve_files(part)):
                return
        except ValueError:
            return
    raise ValueError(f"--text-field names the text field of .jsonl / .parquet rows and hf: datasets, and --data "
                     f"{data!r} has none (text files are read whole): drop --text-field")


def finished_despite(command: str, res) -> int:
    """0 for a run that finished: where a signal came after its last stop check (TrainHooks.pass_late_signal False:
    the last step, the final validation, the save), one line says the run finished regardless, so the exit status (0,
    not 128 + signum) tells a requeue script there is nothing to resume (its --resume is refused as finished)."""
    if res.late_signal and int(os.environ.get("RANK", "0")) == 0:
        print(f"snlp {command}: {res.late_signal} arrived after the last step: the run finished and is saved in "
              f"{res.out} (step {res.steps}); nothing to resume", file=sys.stderr, flush=True)
    return 0


def interrupted(command: str, out: str, steps: int, signal_name: str | None, resume_args: list[str]) -> int:
    """A run a signal stopped (it saved its checkpoint): one line naming the signal and the command that continues it
    (`snlp COMMAND *resume_args --resume`, under torchrun with as many processes), and the exit status 128 + the
    signal's number, what a shell reports for a process that signal ended (130 where another DDP rank's signal
    stopped this one): a Slurm requeue script or a wrapper tells an interrupted run from a finished one (0) and from
    an error (1, 2) by it."""
    import shlex

    status = interrupt_status(signal_name)
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: rank 0 says it
        return status
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # processes per node: WORLD_SIZE counts every node's
    nodes = f"--nnodes={world // local} " if 0 < local < world else ""  # (+ that job's own rendezvous flags)
    launch = f"torchrun {nodes}--nproc_per_node={local} -m snlp" if world > 1 else "snlp"
    again = " ".join([launch, command, *map(shlex.quote, map(str, resume_args)), "--resume"])
    print(f"snlp {command}: interrupted by {signal_name or 'a signal'}: saved {out} at step {steps}; continue with: "
          f"{again}", file=sys.stderr, flush=True)
    return status


def not_inherited(args) -> list[str]:
    """The flags of this run that a `--resume` does not take from the saved run, which the resume command a signal
    prints repeats: snlp.train.config.NOT_INHERITED's --stop-after (a run stopped at step 3 of --stop-after 10
    resumed without it trained to the full --steps) and an explicit --device, and the flags of the process that no
    saved run holds: --stop-file (snlp train / sft: resumed without it, the run no longer watched the file and
    trained past its step) and --json (snlp adapt: the result it writes at the end)."""
    out = []
    if getattr(args, "stop_after", None) is not None:
        out += ["--stop-after", str(args.stop_after)]
    for flag in ("device", "stop_file", "json"):
        if getattr(args, flag, None):
            out += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    return out


def interrupt_status(signal_name: str | None) -> int:
    """128 + the number of the signal named (SIGINT's where none is: another DDP rank's signal stopped the run)."""
    from snlp.train.hooks import signal_number

    return 128 + signal_number(signal_name)


# ----- steering a run through files (--stop-file; snlp speedrun's lockstep) -----
def read_step_file(path: str | Path | None) -> int | None:
    """The step number written in a stop or gate file (None while it is absent or not yet an integer)."""
    if not path:
        return None
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def read_stop_file(path: str | Path | None) -> tuple[int | None, str | None]:
    """(the step a --stop-file says to stop after, the text it holds when that is not a step number). An integer N:
    after step N. Any other text ("stop", "now"): at once, after the step in progress (0: every step done is past
    it), since whoever wrote it meant the run to stop and a run stopped early is saved and resumable, while one
    that went on silently trained past what was asked. Absent, unreadable or only whitespace: (None, None), not
    yet (`echo 500 > STOP` empties the file before the number lands)."""
    if not path:
        return None, None
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return None, None
    # a byte-order mark is no text of the file's: Windows editors write `500` as UTF-8 with one, PowerShell 5's
    # `echo 500 > STOP` as UTF-16; read as UTF-8 text either stopped the run at once instead of after step 500
    utf16 = raw[:2] in (b"\xff\xfe", b"\xfe\xff")
    if utf16:  # an odd byte is half a character still being written (caught mid-write): not read yet
        raw = raw[:len(raw) // 2 * 2]
    text = raw.decode("utf-16" if utf16 else "utf-8-sig", errors="replace").strip()
    if not text:
        return None, None
    try:
        return int(text), None
    except ValueError:
        return 0, text


def shown_text(text: str) -> str:
    """A stop file's text as a message quotes it: its first line, at most 40 characters."""
    first = text.splitlines()[0]
    return repr(first[:40] + ("..." if len(first) > 40 or "\n" in text else ""))


def os_place(path: Path) -> Path:
    """`path` as the OS reaches it: the part that exists with its symlinks resolved (`--out link/run` and a stop file
    in target/run are one folder), the rest as written. Not Path.resolve, which drops `b/..` as text where b does not
    exist: the OS cannot open `runs/b/../a/STOP` until runs/b exists, so that file is not in --out runs/a."""
    from snlp.io.source import home_path

    path, rest = home_path(path).absolute(), []
    while not path.exists() and path != path.parent:
        rest.append(path.name)
        path = path.parent
    return path.resolve().joinpath(*reversed(rest))


def check_stop_file(path: str | Path | None, out: str, resume: bool, made: str | None = None) -> None:
    """Refuse a --stop-file that already holds a step the run has reached (an earlier run's file left in place): the
    run would stop before its first step and save a checkpoint of no training, with status 0 (snlp train and sft).
    Refuse too a --stop-file no one can write: a folder (read_step_file never reads a step from it, so the run went
    on to its end), or a file in a folder that does not exist (a typo: the file written where it was meant is never
    read) unless the run makes that folder (--out or a folder on its path) or it lies inside --out (the user can make
    it once the run has made --out); `made`: the folder the command makes where it is not `out`, snlp sft-grid's --out
    holding each run's."""
    if path:
        from snlp.io.source import did_you_mean, home_path

        given = home_path(path)
        try:  # a name the OS cannot look up (a part over its length limit) is no file anyone can write either
            is_dir, parent, run_out = given.is_dir(), os_place(given).parent, os_place(Path(made or out))
        except OSError as e:
            raise ValueError(f"--stop-file {path}: {e.strerror or e}") from None
        if is_dir:
            raise ValueError(f"--stop-file {path} is a folder: name a file in it (e.g. {Path(path) / 'STOP'}) and write "
                             f"the step to stop at there")
        made_by_run = parent == run_out or run_out in parent.parents or parent in run_out.parents
        if not parent.is_dir() and not made_by_run:
            raise ValueError(f"--stop-file {path}: its folder {given.parent} does not exist{did_you_mean(str(given.parent))}"
                             f" (make it, or name a file in a folder that exists or in --out)")
    stop_at, text = read_stop_file(path)
    if text is not None:
        raise ValueError(f"--stop-file {path} already holds {shown_text(text)}, not a step number, which stops the run at "
                         f"once: it would stop before its first step; remove the file, or write the step to stop "
                         f"after in it")
    if stop_at is None:
        return
    start = 0
    if resume:
        from snlp.train.checkpointing import saved_state

        st = saved_state(out)
        start = st["step"] if st is not None and isinstance(st.get("step"), int) else 0
    if stop_at <= start:
        raise ValueError(f"--stop-file {path} already says stop at step {stop_at} and the run starts at step {start}: "
                         f"it would stop before its first step; remove the file or write a later step in it")


def stop_file_check(path: str | Path) -> StopCheck:
    """A stop check saying "stop_file" once the step number written in `path` is done (the file is re-read at every ask, so
    another process may write or lower it while the run goes on); text that is no step number stops the run at once
    (read_stop_file), said once on stderr: which file, what it holds, what it expects."""
    said = []

    def check(steps_done: int) -> str | None:
        stop_at, text = read_stop_file(path)
        if stop_at is None or steps_done < stop_at:
            return None
        if text is not None and not said:  # asked again after the stop (before_step and should_stop): once
            said.append(text)
            print(f"--stop-file {path} holds {shown_text(text)}, not a step number: stopping now, after step "
                  f"{steps_done}, saved (an integer N there stops the run after step N)", file=sys.stderr, flush=True)
        return "stop_file"

    return check


def file_hooks(stop_file: str | Path | None = None, step_gate: str | Path | None = None,
               poll_s: float = 0.002) -> TrainHooks:
    """TrainHooks from files another process writes. `stop_file` (an integer N): stop, and save, once step N
    is done; asked after every step and again just before the next starts, so a stop written in between
    is not overrun. `step_gate` (an integer G; single-process runs): step s starts only once G >= s; until then
    the hook says WAIT and the loop asks again every `poll_s` seconds, asking the stop file and its own stop
    checks (a signal) each time (lockstep side-by-side runs, snlp speedrun)."""
    from snlp.train.hooks import WAIT, TrainHooks

    stop = stop_file_check(stop_file) if stop_file else (lambda steps_done: None)
    if not stop_file and not step_gate:
        return TrainHooks()

    def before_step(steps_done: int) -> str | None:
        reason = stop(steps_done)
        if reason is not None or not step_gate:
            return reason
        gate = read_step_file(step_gate)
        return None if gate is not None and gate > steps_done else WAIT

    return TrainHooks(should_stop=stop, before_step=before_step, poll_s=poll_s)

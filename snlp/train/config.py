"""What a training run is given (`TrainConfig`) and what it gives back (`TrainResult`)."""

from __future__ import annotations

import glob
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from snlp.io.chat import resolve_spec
from snlp.io.data import check_val_frac, files_signature, is_local, missing_parts, parts
from snlp.io.source import home_path
from snlp.runtime.checks import check_bools, count_error, number_error
from snlp.train.regularizer import check_rows
from snlp.train.validate import ValidationResult


# the integer settings (OPTIONAL ones also None: unset); `check` refuses a bool or any other type before their ranges:
# True is an int, so steps=True trained one step and batch_size=True one row, and a float count passed `< 1`
COUNTS = ("depth", "width", "aspect_ratio", "head_dim", "kv_heads", "vocab_size", "hc_streams", "seq_len", "batch_size",
          "grad_accum", "steps", "stop_after", "warmup_steps", "seed", "max_chars", "time_reg", "reg_stride",
          "reg_warmup", "eval_every", "eval_batches", "save_every", "log_every", "freeze_prefix")
OPTIONAL = ("width", "kv_heads", "steps", "stop_after", "freeze_prefix")
# the real-valued settings (None: unset, where OPTIONAL_NUMBERS): a bool is refused, as for the counts
NUMBERS = ("val_frac", "minutes", "matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "hc_lr", "weight_decay",
           "warmdown", "grad_clip", "reg_lambda", "reg_rows")
OPTIONAL_NUMBERS = ("minutes", "matrix_lr", "reg_rows")
FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: the optimizers' step takes the LR as a float32


@dataclass
class TrainConfig:
    """Everything a training run needs (the library side of `snlp train`'s flags); `fit` never modifies it.
    How a caller steers a running loop from outside (stop files, lockstep) is not configuration: it is
    given to `fit` as `TrainHooks`."""

    out: str
    resume: bool = False
    init_from: str | None = None  # start from this checkpoint's weights and tokenizer (no tokenizer training)
    freeze_prefix: int | None = None  # train only layers S..; -1 = S = depth - max(reg_n), the SNLP suffix
    # data
    data: str = "stdlib"
    text_field: str = "text"
    max_chars: int = 0
    val_frac: float = 0.05
    vocab_size: int = 4096
    cache_dir: str | None = None
    data_encoding: str = "utf-8"  # of local text/.jsonl files, decoded strictly
    # model (one dial: depth)
    depth: int = 8
    width: int | None = None
    aspect_ratio: int = 32
    head_dim: int = 64
    kv_heads: int | None = None
    window_pattern: str = "L"
    no_x0: bool = False
    no_ve: bool = False
    hc_streams: int = 0
    hc_static: bool = False
    # optimisation
    seq_len: int = 256
    batch_size: int = 8
    grad_accum: int = 1
    steps: int | None = None  # None and no minutes -> 1000
    minutes: float | None = None
    stop_after: int | None = None
    optimizer: str = "muon"
    matrix_lr: float | None = None
    embedding_lr: float = 0.2
    unembedding_lr: float = 0.004
    scalar_lr: float = 0.5
    hc_lr: float = 0.005
    weight_decay: float = 0.0
    warmup_steps: int = 10
    warmdown: float = 0.4
    grad_clip: float = 1.0
    seed: int = 0
    device: str | None = None
    compile: bool = False  # the loss module under torch.compile (snlp.train.compiled); on CUDA Muon's NS and fused AdamW
    time_reg: int = 0  # after training, time this many micro-batch steps with and without the regulariser
    # SNLP-aware regulariser
    reg: str = "none"
    reg_lambda: float = 0.5
    reg_n: str = "4"
    reg_stride: int = 0
    reg_detach: bool | None = None
    reg_warmup: int = 0
    reg_rows: float | None = None  # the solve on the first ceil(F * batch_size) rows (None: all, the paper's)
    # logging
    eval_every: int = 50
    eval_batches: int = 4
    save_every: int = 0
    log_every: int = 10
    no_progress: bool = False

    @property
    def total_steps(self) -> int | None:
        return 1000 if self.steps is None and self.minutes is None else self.steps

    def check(self) -> None:
        """Raise a ValueError naming the flag of the first setting of the wrong type or out of range."""
        for name in COUNTS:
            v = getattr(self, name)
            if not (v is None and name in OPTIONAL) and (err := count_error(f"--{name.replace('_', '-')}", v)):
                raise ValueError(err)
        for name in NUMBERS:
            v = getattr(self, name)
            if not (v is None and name in OPTIONAL_NUMBERS) and (err := number_error(f"--{name.replace('_', '-')}", v)):
                raise ValueError(err)
        check_bools(resume=self.resume, no_x0=self.no_x0, no_ve=self.no_ve, hc_static=self.hc_static,
                    compile=self.compile, no_progress=self.no_progress)
        if self.reg_detach is not None:
            check_bools(reg_detach=self.reg_detach)
        for name in ("seq_len", "batch_size", "grad_accum", "depth", "eval_every", "eval_batches", "log_every",
                     "aspect_ratio", "head_dim", "width", "kv_heads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if self.save_every < 0:  # the loop's step % N would save after every step
            raise ValueError(f"--save-every must be >= 0 (N > 0: also every N steps, 0: only at the end; got "
                             f"{self.save_every})")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1 (got {self.steps})")
        if self.seed < 0:  # the data's generator (data.batch_at: numpy's seed sequence) takes none
            raise ValueError(f"--seed must be >= 0 (got {self.seed})")
        if self.stop_after is not None and self.stop_after < 0:  # the loop's step >= N held at step 0: a silent 0
            raise ValueError(f"--stop-after must be >= 0 (got {self.stop_after})")
        if self.minutes is not None and not (math.isfinite(self.minutes) and self.minutes > 0):  # nan: `<= 0` False
            raise ValueError(f"--minutes must be a finite number > 0 (got {self.minutes})")  # inf: no LR schedule
        check_val_frac(self.val_frac)  # (NaN too) the split's own refusal came after the tokenizer and the data
        if not 0 <= self.warmdown <= 1:
            raise ValueError(f"--warmdown must lie in [0, 1] (got {self.warmdown})")
        if self.hc_streams < 0:
            raise ValueError(f"--hc-streams must be >= 0 (got {self.hc_streams})")
        if not self.reg_lambda >= 0 or self.reg_warmup < 0 or self.reg_stride < 0:  # NaN fails >= 0
            raise ValueError("--reg-lambda, --reg-warmup and --reg-stride must be >= 0")
        if not math.isfinite(self.reg_lambda):
            raise ValueError(f"--reg-lambda must be finite (got {self.reg_lambda})")
        # a negative warm-up makes lr_multiplier -(step + 1): every step an ascent, growing; a negative LR, weight
        # decay or clip norm is no setting either (torch refuses the first two only once the data is loaded)
        for name in ("warmup_steps", "max_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(self, name)})")
        for name in ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "hc_lr", "weight_decay", "grad_clip"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0 (got {v})")
            if name.endswith("_lr") and v is not None and v > FLOAT32_MAX:  # torch's float32 update step refused it
                raise ValueError(f"--{name.replace('_', '-')} {v:g} is past float32's largest number ({FLOAT32_MAX:.4g}), "
                                 f"which the parameters' update is computed in")
        if self.optimizer not in ("muon", "adamw"):
            raise ValueError(f"--optimizer must be muon or adamw (got {self.optimizer!r})")
        if self.reg not in ("idn", "hcn", "diag", "none"):
            raise ValueError(f"--reg must be one of idn, hcn, diag, none (got {self.reg!r})")
        if self.reg_rows is not None:
            if self.reg == "none" or self.reg_lambda == 0:
                raise ValueError("--reg-rows sets the regulariser's share of each micro-batch: it needs --reg "
                                 "(idn, hcn, diag) and --reg-lambda > 0")
            check_rows(self.reg_rows, self.batch_size)
        if self.compile and self.reg == "diag":
            raise ValueError("--compile with --reg diag: the DiagN regulariser's probe generator does not trace into "
                             "one graph; use --reg idn / hcn, or train without --compile")
        if self.time_reg < 0:
            raise ValueError(f"--time-reg must be >= 0 (got {self.time_reg})")
        if self.time_reg and (self.reg == "none" or self.reg_lambda == 0):  # lambda 0: the run trains without one
            raise ValueError("--time-reg times the step with and without the regulariser: it needs --reg (idn, hcn, "
                             "diag) and --reg-lambda > 0")
        if self.init_from and self.resume:
            raise ValueError("--init-from starts a new run from a checkpoint's weights; --resume continues --out: pick one")
        if self.init_from and not self.resume:
            default = TrainConfig(out="")
            check_init_from_shape(self.init_from, [k for k in SHAPE if getattr(self, k) != getattr(default, k)])
        if self.freeze_prefix is not None and self.freeze_prefix < -1:
            raise ValueError(f"--freeze-prefix must be >= 0 (got {self.freeze_prefix})")


def check_out_outside_data(out: str, data: str | None) -> None:
    """Refuse an --out inside a folder --data reads (a folder part, or a recursive `**` glob's folder): the data
    loader reads the folder's text files, so the run's own log.jsonl (and every later leg's) would become training
    and validation text. An --out under a dot-folder there is fine: the loader skips those. Called where data is read
    (pretraining, the speedrun), not for SFT, whose recorded data is the base's text."""
    if not out:
        return
    where = home_path(out).resolve()
    for part in parts(data):
        if not is_local(part):
            continue
        p = str(home_path(part))
        if glob.has_magic(p):  # only a recursive glob reaches into a subfolder such as --out
            if "**" not in p:
                continue
            p = p[:p.index("**")] or "."
        base = Path(p).resolve()
        if base.is_dir() and where.is_relative_to(base) \
                and not any(c.startswith(".") for c in where.relative_to(base).parts):
            raise ValueError(f"--out {out} lies inside the --data folder {part}: the run's own files (its log.jsonl) "
                             f"would be read as training text; put --out outside it")


# What a resumed run may set afresh: its budget, when it stops, logs, validates and saves, where it runs and whether
# the step is compiled. Every other field decides what the run trains on and how (data, model, optimiser, schedule
# shape, regulariser, seed, batch layout: the saved data position counts micro-batches of this layout), so
# `--resume` keeps the saved value and refuses another one (`resume_changes`).
RESUME_MAY_CHANGE = ("out", "resume", "init_from", "steps", "minutes", "stop_after", "device", "compile", "time_reg",
                     "eval_every", "eval_batches", "save_every", "log_every", "no_progress", "cache_dir")
# Settings of one process only, never taken from the saved run: where it writes, that it resumes, a one-off stop,
# the machine it runs on (None: the best device here, as for a new run).
NOT_INHERITED = ("out", "resume", "init_from", "stop_after", "device")
BUDGET = ("steps", "minutes")  # one budget: a new --steps replaces a saved --minutes and the other way round
# The model's shape flags (and its tokenizer's size): a run started --init-from CKPT takes all of them from CKPT, so
# they are refused beside it, and a resumed run's model is the saved one.
SHAPE = ("depth", "width", "aspect_ratio", "head_dim", "kv_heads", "window_pattern", "no_x0", "no_ve", "hc_streams",
         "hc_static", "vocab_size")


def check_init_from_shape(init_from: str, fields_set) -> None:
    """Refuse shape flags beside --init-from CKPT (`fields_set`: the SHAPE fields given): the model and its
    tokenizer are CKPT's, so they could only be ignored."""
    if fields_set:
        raise ValueError(f"--init-from takes the model (its shape and tokenizer) from {init_from}: drop "
                         f"{', '.join('--' + k.replace('_', '-') for k in fields_set)}")


def resume_changes(cfg: TrainConfig, saved: dict) -> list[tuple[str, object, object]]:
    """(field, saved value, cfg's value) of every setting a resume may not change where `cfg` differs from the
    run's saved settings (`saved`: the checkpoint's recorded `args`; a field it lacks, from an snlp older than the
    field, held its default then)."""
    default = TrainConfig(out="")
    out = []
    for f in fields(TrainConfig):
        if f.name in RESUME_MAY_CHANGE:
            continue
        was, now = saved.get(f.name, getattr(default, f.name)), getattr(cfg, f.name)
        if f.name == "data" and was != now and same_data(was, now, cfg.max_chars, saved):
            continue
        if f.name == "reg_detach" and effective_detach(was, saved.get("reg")) == effective_detach(now, cfg.reg):
            continue  # None is "the surrogate's default" (job.reg_config): an explicit equal value changes nothing
        if was != now:
            out.append((f.name, was, now))
    return out


def same_data(was: str, now: str, max_chars: int, saved: dict) -> bool:
    """Whether --data `now`, spelled otherwise than the recorded `was`, names the run's data: the same files named
    from another folder (the checkpoint records them absolute), or, the saved ones being gone (a moved project),
    files of the recorded names and sizes. Under --max-chars files may have grown past the cap, so there the
    tokens' digest decides (in trainer.setup) where the run recorded one."""
    if resolve_spec(was) == resolve_spec(now):
        return True
    if not missing_parts(was):
        return False
    return bool(max_chars and saved.get("data_digest")) or same_files(now, saved.get("data_files"))


def same_files(spec: str, signature: list | None) -> bool:
    """Whether `spec` reads files of the names and sizes a checkpoint recorded (data.files_signature); True where it
    recorded none (an snlp before the record: nothing to check against)."""
    if signature is None:
        return True
    try:
        return files_signature(spec) == signature
    except ValueError:  # a part that names nothing: not the same files (the run would refuse it anyway)
        return False


def check_data_present(cfg: TrainConfig) -> None:
    """Raise a ValueError naming the local parts of a resumed run's --data that are not there any more (a moved
    project), with what to do, instead of the loader's bare "unknown data source"."""
    gone = missing_parts(cfg.data)
    if gone:
        raise ValueError(f"--resume: the run in {cfg.out} reads {', '.join(gone)}, which is not there any more "
                         f"(moved?): give --data with where it is now (it must hold the same files: names and sizes "
                         f"are checked)")


def effective_detach(reg_detach: bool | None, reg: str | None) -> bool:
    """The regulariser's detach setting as a run uses it: the given one, else detached for HCN only (the paper's
    choice; snlp.train.job.reg_config)."""
    return reg_detach if reg_detach is not None else reg == "hcn"


def check_resume_settings(cfg: TrainConfig, saved: dict | None, where, reads_data: bool = True) -> None:
    """Raise a ValueError naming every setting `cfg` would change in the saved run at `where` (see
    `resume_changes`) before the run loads anything: continuing it on other data, another batch layout or another
    objective would silently make a different run under the same name. `reads_data` False (an SFT run, whose
    `data` is the base's pretraining text, recorded for evaluation and never read): its files are not compared."""
    if saved is None:
        return
    diff = resume_changes(cfg, saved)
    # an --init-from run's saved shape flags are the defaults it never used (the model is the checkpoint's): a
    # shape flag is refused as such, without naming them
    shape = [k for k, _, _ in diff if k in SHAPE] if saved.get("init_from") else []
    diff = [d for d in diff if d[0] not in shape]
    said = []
    if diff:
        said.append("was saved with "
                    + ", ".join(f"--{k.replace('_', '-')} {shown(k, was)} (given: {shown(k, now)})" for k, was, now in diff)
                    + (" (snlp sft and snlp adapt set the LRs from --lr-scale / --lr and --optimizer)"
                       if any(k.endswith("_lr") for k, _, _ in diff) else "")
                    + (" (the saved data is gone, and the given one holds other files than the record's: "
                       "names, sizes or order differ)" if any(k == "data" for k, _, _ in diff)
                       and missing_parts(saved.get("data")) else "")
                    + "; a resumed run keeps what it trains on and how: leave these flags out (snlp train and "
                      "snlp sft take the saved values) or start a new run in another --out")
    if reads_data and not cfg.max_chars and not any(k == "data" for k, _, _ in diff) \
            and not missing_parts(cfg.data) and not same_files(cfg.data, saved.get("data_files")):
        # the same --data, rewritten in place: the token cache (keyed by size and mtime) would be rebuilt and the
        # rest of the run, and its held-out split, would come from other text under the same name. Checked here,
        # before any loading, where every file is read whole (no --max-chars: files that grew past the cap can give
        # the same text); an edit of the same size, or under a cap, is caught by the tokens' digest once they are
        # made (trainer.setup: Job.data_digest)
        said.append(f"trained on files of {cfg.data} other than those there now (names, sizes or order differ from "
                    f"its record); a resumed run keeps what it trains on: put the run's files back, or start a new "
                    f"run from this one's weights (--init-from {where}) in another --out")
    if shape:
        said.append(init_from_shape_refusal(saved["init_from"], shape))
    if said:
        raise ValueError(f"--resume: the run in {where}" + (" " if diff else ": ") + "; ".join(said))


def shown(name: str, value) -> str:
    """A setting as the resume refusal names it: in the flag's terms, not the field's internal values (None is a flag
    left out; --freeze-prefix typed without S is stored as -1)."""
    if value is None:
        return "(not given)"
    if name == "freeze_prefix" and value == -1:
        return "(without S: depth - max(--reg-n))"
    return repr(value)


def init_from_shape_refusal(init_from: str, fields_set) -> str:
    """Why shape flags (`fields_set`) are refused on the resume of a run started --init-from `init_from`."""
    return (f"the model is {init_from}'s, as --init-from took it: shape flags do not apply: drop "
            f"{', '.join('--' + k.replace('_', '-') for k in fields_set)}")


def resumed(cfg, saved: dict | None, given, not_inherited=NOT_INHERITED):
    """`cfg` (a TrainConfig, or another run's config dataclass: snlp adapt's) with the saved run's value of every
    field not in `given` (the flags typed; fields of one process, `not_inherited`, excepted, and the saved budget
    where a new one is typed): `snlp train --out X --resume --steps 4000` continues X's run as it was, with a new
    budget. `given` None: every field counts as given (a library caller's config is taken whole)."""
    if saved is None or given is None:
        return cfg
    names = {f.name for f in fields(cfg)}
    skip = set(not_inherited) | (set(BUDGET) if set(BUDGET) & set(given) else set())
    return replace(cfg, **{k: v for k, v in saved.items() if k in names and k not in given and k not in skip})


@dataclass
class TrainResult:
    """What `fit` did: where the checkpoint is and how the run ended."""

    out: str
    steps: int
    tokens: int  # input tokens processed (all ranks)
    train_loss: float | None  # last step's training CE (all ranks' mean)
    val_loss: float | None
    wall_s: float  # this process's wall time, eval and saving included (the resumed part only)
    elapsed_s: float  # the run's training clock (carried across resumes)
    validation: ValidationResult | None = None  # the last validation of this process (None if it ran none)
    stopped_by: str = "budget"  # budget | stop_after | a TrainHooks reason (e.g. stop_file)
    speed: StepSpeed | None = None  # tokens/s and MFU of this process's steps (None if it ran none)
    signal: str | None = None  # stopped_by "interrupt": the signal's name (SIGINT, SIGTERM, SIGHUP, SIGUSR1, ...)
    late_signal: str | None = None  # a signal that came after the last stop check, held (TrainHooks.pass_late_signal)
    skipped_steps: int = 0  # steps skipped with nothing to learn from (Job.skip_empty): not in `steps` (whole run)


@dataclass
class StepSpeed:
    """How fast the steps ran (the run's summary; train_summary.json). Steady = the steps after the first `warm` of this
    process (their first calls compile, build caches and warm the allocator), timed from the step's start to its
    statistics on the host (validation and saving left out)."""

    compiled: bool
    steps: int  # steady steps timed
    warm: int  # first steps left out
    tok_s: float | None  # steady tokens/s (this run's all ranks)
    step_s: float | None  # steady mean seconds per optimizer step
    first_step_s: float | None  # the first step's seconds (compiled: includes tracing and compiling)
    flops_per_token: float | None  # model FLOPs per token of one forward + backward (snlp.train.flops)
    peak_flops: float | None  # the device's dense bf16 peak (snlp.runtime.peak; None on CPU or an unknown card)
    mfu: float | None  # model FLOPs utilisation at the steady tok/s; None without a known peak
    tflops: float | None  # achieved model TFLOP/s per process (what MFU divides by the peak; also on CPU)
    device: str = ""
    # the number of the step first_step_s timed: 1, or the step after the checkpoint a resumed run starts from (its
    # first step builds the caches and, compiled, compiles again; a speed line that called it step 1 misnamed it)
    first_step: int = 1
    reg_step_s: float | None = None  # --time-reg: median seconds per micro-batch step with the regulariser
    plain_step_s: float | None = None  # ... and without it (same batch, same compiled/eager treatment)
    # ... and per round, the step without it / with it (both timed in one round-robin round, so paired: > 1 where the
    # regulariser's step was faster), what the sign test reads (snlp.runtime.stats.paired_verdict)
    reg_round_ratios: list[float] | None = None
    # --time-reg: the load window its rounds ran in (snlp.runtime.load.LoadWindow.to_json) and the threads the run
    # kept busy on the machine meanwhile (every local rank's: all ranks time at once)
    load: dict | None = None
    load_threads: int | None = None

    @property
    def reg_overhead(self) -> float | None:
        return self.reg_step_s / self.plain_step_s if self.reg_step_s and self.plain_step_s else None

"""The training loop: `fit(TrainConfig) -> TrainResult`, for pretraining and chat SFT alike.

A `Job` (snlp.train.job) supplies the model, the batch source, the loss module and the validation, so
pretraining (`pretrain_job`, the default) and chat SFT (snlp.train.sft) run the same machinery: optimisers
(snlp.train.optim), the stateless LR multiplier written into every param group each step, checkpoints and
exact resume (snlp.train.checkpointing), DDP (snlp.train.distributed; torchrun: NCCL on GPU, gloo on CPU,
rank 0 logs and saves). A caller steers a running loop from outside through `TrainHooks` (snlp speedrun's
lockstep, `snlp train --stop-file`); the loop knows no files.

The loop is setup -> [before_step, train_step, stop check, log, validate, save]* -> save -> result, each a
function of the `Run` (what is trained, built once) and the `LoopState` (what changes every step).
"""

from __future__ import annotations

import functools
import math
import signal
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from snlp.train.checkpointing import (ResumePoint, check_resume_command, clear_killed_saves, drop_validations, open_run,
                                      recorded_args, save_run, seed_all, set_aside_unsaved_log, set_rng_state,
                                      trim_log)
from snlp.train.compiled import CompiledStep, check_compile, compile_optimizers
from snlp.train.config import StepSpeed, TrainConfig, TrainResult
from snlp.train.distributed import DistContext, agree_on_reason, busy_threads, setup_dist, teardown_dist
from snlp.train.flops import mfu, step_flops
from snlp.train.hooks import INTERRUPT, WAIT, InterruptStop, TrainHooks, signal_name, with_stop
from snlp.train.job import Job, TrainStep
from snlp.train.muon import Muon, default_ns_dtype, warn_if_emulated
from snlp.train.optim import Progress, build_optimizers, load_optimizer_states, lr_multiplier, set_lr
from snlp.train.precision import autocast_context, step_dtype
from snlp.train.pretrain import apply_freeze, pretrain_job
from snlp.train.regularizer import RegConfig, reg_rows
from snlp.train.validate import ValidationResult
from snlp.runtime.device import device_label, json_text, progress_bar, write_atomic
from snlp.runtime.load import LoadWindow, say_contention, warn_oversubscribed
from snlp.runtime.peak import peak_bf16_flops
from snlp.runtime.stats import paired_marks, tie_mark, verdict_text
from snlp.runtime.timing import time_round_robin
from snlp.runtime.outputs import locked_output, make_folders


@dataclass
class Run:
    """What the loop trains and with what, built once by `setup`."""

    cfg: TrainConfig
    ctx: DistContext
    job: Job
    opts: list
    stepper: nn.Module | CompiledStep  # job.loss, DDP-wrapped when world > 1, compiled with --compile
    progress: Progress
    autocast: Callable
    hooks: TrainHooks
    bar: object | None  # tqdm bar on rank 0 unless no_progress
    t_start: float  # perf_counter() at the run's training clock 0 (earlier when resumed)
    peak_flops: float | None = None  # the device's dense bf16 peak (None: CPU or an unknown card)
    flops_per_token: float | None = None  # model FLOPs per token of a forward + backward, counted at the first step
    args: dict | None = None  # the settings every checkpoint of this process records (recorded_args; rank 0's)
    interrupt: InterruptStop | None = None  # this process's signal catcher (under DDP any rank's signal stops all)

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    @functools.cached_property
    def share_dtype(self) -> torch.dtype:
        """The DDP token shares' dtype (token_shares): fp32, or the weights' when wider. An fp32 share of an fp64
        model rounded its loss weights (and so the gradients and the logged loss) to fp32 (~1e-8 relative)."""
        return functools.reduce(torch.promote_types, {p.dtype for p in self.job.model.parameters()}, torch.float32)


@dataclass
class LoopState:
    """What changes every step. step/micro/tokens (with the RNG and optimizer states) are saved and resumed."""

    step: int = 0
    micro: int = 0  # micro-batches consumed: the data position
    tokens: int = 0  # input tokens processed, all ranks
    skipped: int = 0  # steps skipped with nothing to learn from (Job.skip_empty): not in `step`, their micro in `micro`
    first_step: int = 0  # the step this process started at (> 0 when resumed)
    train_loss: float | None = None
    validation: ValidationResult | None = None
    validated_at: int | None = None  # the step of `validation`
    saved_at: int | None = None  # the step of this process's last save
    stopped_by: str | None = None
    # perf_counter() at the end of the previous step, moved on past the validation, save and FLOP count since: a step's
    # tok_s counts its own time and any hold before it (before_step: a lockstep gate), not those passes
    t_last: float = 0.0
    step_times: list = field(default_factory=list)  # (step, tokens, seconds) of each step of this process
    mfu: float | None = None  # the last step's MFU (logged on every row)
    peer_signal: int = 0  # the highest signal number any rank had taken by this process's last save (0: none)
    resumed: bool = False  # this process continues a saved run (--resume)
    # the last trained step's log.jsonl row and its MFU while it is not yet written (a step off --log-every): a run that
    # ends on a skipped step or between steps writes it before its stop row, so the log always holds its last step
    unlogged: tuple[dict, float | None] | None = None


@dataclass
class StepStats:
    """One optimizer step, reduced over ranks (the log's step record)."""

    loss: float
    reg: float
    lam: float
    lr_scale: float
    tokens: int
    tok_s: float
    grad_norm: float | None
    hook_reason: str | None  # rank 0's TrainHooks.should_stop answer after this step, agreed by all ranks
    step_s: float = 0.0  # the step's own seconds: its start to its statistics on the host
    mfu: float | None = None  # model FLOPs utilisation of this step (None without a known peak)
    skipped: bool = False  # nothing to learn from on any rank (Job.skip_empty): no update, not a step


def fit(cfg: TrainConfig, make_job: Callable[..., Job] = pretrain_job, hooks: TrainHooks | None = None) -> TrainResult:
    """Train as `cfg` says and save the checkpoint to cfg.out. `make_job(cfg, model, tok, rank, world,
    device) -> Job` supplies the model, data and loss (default: pretraining); model/tok are the
    checkpoint's when resuming, else None. `hooks` let the caller wait before steps or stop the run.
    Multi-process under torchrun (DDP)."""
    cfg.check()
    ctx = setup_dist(cfg.device)
    # Ctrl-C, SIGTERM (kill, Slurm, docker stop), SIGHUP, SIGUSR1/2 during the loop: stop after the step and save
    # (snlp.train.hooks.STOP_SIGNALS)
    interrupted = InterruptStop()
    try:
        with locked_output(cfg.out) if ctx.master else nullcontext():  # a second run on cfg.out is refused
            t_wall = time.perf_counter()
            # armed from setup on: a signal while the data loads (a tokenizer trains, a corpus is tokenized) ends the
            # loop before step 1 with step 0 saved, so the --resume that 128 + signum asks for finds a checkpoint (the
            # signal's default action ended the process with nothing saved)
            with interrupted.armed():
                run, state = setup(cfg, make_job, with_stop(hooks or TrainHooks(), interrupted), ctx)
                run.interrupt = interrupted
                train_loop(run, state)
                speed = step_speed(run, state)
                if speed is not None and cfg.time_reg:
                    t = time_regulariser(run, state, cfg.time_reg)
                    speed.reg_step_s, speed.plain_step_s, speed.reg_round_ratios = (t.reg_step_s, t.plain_step_s,
                                                                                    t.round_ratios)
                    speed.load, speed.load_threads = t.load, t.own_threads
                result = finish(run, state, t_wall, speed)
            if interrupted.hit and state.stopped_by != INTERRUPT:  # a signal after the loop's last stop check: the
                if run.hooks.pass_late_signal:  # run is saved; the handler restored gets it (default: the end)
                    signal.raise_signal(interrupted.signum)
                result.late_signal = signal_name(interrupted.signum)  # (finish recorded one that came before it)
            return result
    finally:
        teardown_dist(ctx)


def setup(cfg: TrainConfig, make_job, hooks: TrainHooks, ctx: DistContext) -> tuple[Run, LoopState]:
    """The Run and the LoopState to start from: a new run, or the one saved in cfg.out (--resume)."""
    seed_all(cfg.seed)  # a resumed run's saved states replace these (resume)
    start = open_run(Path(cfg.out), cfg.resume, cfg, ctx.world)
    if ctx.master:
        clear_killed_saves(Path(cfg.out))
    job = make_job(cfg, start.model, start.tokenizer, ctx.rank, ctx.world, ctx.device)
    if isinstance(job.loss, TrainStep):  # a diag:fd eps the step's dtype on this device cannot take: before step 1
        job.loss.check_fd_step(ctx.device)
    if start.resume is not None:  # before anything is written (the commands check it before loading, too)
        check_resume_command(cfg.out, job.name, start.resume.command)
    saved = start.resume.data_digest if start.resume else None
    if saved and job.data_digest and saved != job.data_digest:  # names and sizes alike (checked before loading)
        # snlp's own BPE changed its reading of documents once (special-token strings quoted in the text are text
        # now: Tokenizer.encode_documents); a converted tokenizer's reading did not change, so only the edit is named
        own_bpe = start.tokenizer is not None and not start.tokenizer.foreign
        why = ("text edited in place? or a run from before snlp read special-token strings quoted in the text, such "
               "as <|bos|>, as text" if own_bpe else "text edited in place?")
        raise ValueError(f"--resume: the run in {cfg.out} trained on other tokens than {cfg.data} gives now ({why}); "
                         f"a resumed run keeps what it trains on: put the run's text back, or start a new run from its "
                         f"weights (--init-from {cfg.out}) in another --out")
    if start.resume is not None and ctx.master:  # records of steps after the checkpoint were never saved
        trim_log(Path(cfg.out) / "log.jsonl", start.resume.step, start.resume.micro)
    elif ctx.master and (aside := set_aside_unsaved_log(Path(cfg.out) / "log.jsonl")) is not None:
        print(f"{cfg.out} held the log of a run that saved no checkpoint (killed before its first save): moved to "
              f"{aside}; this run logs afresh", file=sys.stderr, flush=True)
    apply_freeze(job.model, cfg)
    job.model.to(ctx.device)
    job.model.train()
    opts = build_optimizers(job.model, cfg)
    if ctx.master:  # the dtypes the step computes in: weights, CUDA autocast, Muon's Newton-Schulz iterations
        warn_if_emulated(ctx.device, {p.dtype for p in job.model.parameters()}
                         | {step_dtype(ctx.device, p.dtype) for p in job.model.parameters()}
                         | {o.ns_dtype or default_ns_dtype(ctx.device) for o in opts if isinstance(o, Muon)}, job.name)
    state = resume(start.resume, opts)
    progress = Progress(cfg.total_steps, cfg.minutes)
    progress.step, progress.elapsed = state.step, (start.resume.elapsed if start.resume else 0.0)
    stepper = job.loss
    if cfg.compile:
        if not isinstance(job.loss, TrainStep):
            raise ValueError(f"--compile compiles the pretraining / SFT step; {job.name} has its own step")
        check_compile(job.loss.reg, job.loss.plan)
    ddp = None
    if ctx.world > 1:
        ddp = lambda m: nn.parallel.DistributedDataParallel(  # noqa: E731
            m, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    if cfg.compile:
        stepper = CompiledStep(stepper, ctx.device, wrap=ddp)
        compile_optimizers(opts, ctx.device)
    elif ddp is not None:
        stepper = ddp(stepper)
    announce(cfg, job, ctx)
    bar = None
    if ctx.master and not cfg.no_progress:
        bar = progress_bar(progress.steps, "train", initial=state.step, unit="step", leave=True)  # lines off a tty
    # what every save of rank 0 records, made once (its record of the data's files walks every file); the
    # --init-from of the run's first leg is kept (a resumed run's cfg has none)
    init_from = cfg.init_from or (start.resume.init_from if start.resume else None)
    args = recorded_args({**asdict(cfg), "init_from": init_from, "data_digest": job.data_digest}) if ctx.master \
        else None
    run = Run(cfg, ctx, job, opts, stepper, progress, autocast_context(ctx.device), hooks, bar,
              t_start=time.perf_counter() - progress.elapsed, peak_flops=peak_bf16_flops(ctx.device), args=args)
    state.t_last = time.perf_counter()
    return run, state


def resume(point: ResumePoint | None, opts) -> LoopState:
    """The loop state of a saved run (its optimizer and RNG states restored), or a fresh one."""
    if point is None:
        return LoopState()
    load_optimizer_states(opts, point.optimizer)
    set_rng_state(point.rng)
    return LoopState(step=point.step, micro=point.micro, tokens=point.tokens, skipped=point.skipped,
                     first_step=point.step, resumed=True)


def announce(cfg: TrainConfig, job: Job, ctx: DistContext) -> None:
    """Create the output folder and print the start banner (rank 0)."""
    if not ctx.master:
        return
    make_folders(cfg.out)
    m = job.model
    mc = m.config
    print(f"{job.name}: {mc.n_layer} layers, width {mc.n_embd}, {mc.n_head} heads, vocab {mc.vocab_size}, "
          f"{m.num_params() / 1e6:.2f}M params | {job.describe} | {cfg.batch_size}x{cfg.grad_accum} "
          f"sequences/step/process on {ctx.world} x {ctx.device}", flush=True)
    n = len(job.val_batches)
    if n < cfg.eval_batches:  # the split's batches run out first: every validation reads all it holds, fewer than asked
        print(f"{job.name}: validating on {n} batch{'es' if n != 1 else ''}, all the validation split holds "
              f"(--eval-batches {cfg.eval_batches})", flush=True)


def train_loop(run: Run, state: LoopState) -> None:
    """Steps until a limit (budget, stop_after) or a hook ends the run; validates and saves on the way."""
    cfg = run.cfg
    # a signal during setup: straight to step 0's save, unless the run ends at step 0 by its own limit (--stop-after
    # 0): that run is its step-0 validation, which it would skip and end as finished (status 0, nothing to resume)
    if state.step == 0 and (stopped_in_setup(run) is None or limit_reason(run, state) is not None):
        validate_and_log(run, state)
    state.stopped_by = limit_reason(run, state) or agree_on_reason(run.ctx, ask(run, run.hooks.should_stop, state))
    while state.stopped_by is None:
        if run.ctx.world == 1:  # before_step may hold the step; under DDP a rank waiting alone would stall the others
            state.stopped_by = wait_for_step(run, state)
            if state.stopped_by is not None:  # a stop between steps (a signal after the last step's check, a stop
                # file): the last step's record went out without it, so the log says it on its own row, at the run's
                # clock of that step as every row, the checkpoint and the summary say it (not the wall time of the
                # decision: the hold before_step waited, a lockstep gate's, is no training time)
                log_last_step(run, state)
                write_log(run, {"step": state.step, "elapsed": run.progress.elapsed, "stop": state.stopped_by},
                          state.mfu)
                break
        stats = train_step(run, state)
        state.stopped_by = limit_reason(run, state) or stats.hook_reason  # decided before the step is logged:
        if stats.skipped:  # no update: nothing to log as a step, check, validate or save; the stop checks still ran
            log_skip(run, state)
            continue
        log_step(run, state, stats)  # a lockstep peer reads the step and the decision together
        # the optimizer has applied this step already: a non-finite gradient (an overflowing regulariser term while
        # the logged CE stays finite) has made the weights NaN, so the run stops before anything saves them
        bad = [(what, v) for what, v in (("loss", stats.loss), ("regulariser", stats.reg),
                                         ("gradient norm", stats.grad_norm)) if v is not None and not math.isfinite(v)]
        if bad:
            log_last_step(run, state)  # the diverged step's row (off --log-every too): the run ends on it
            what, v = bad[0]
            raise FloatingPointError(f"training {what} became {v} at step {state.step} (nothing of this step is "
                                     f"saved); lower the learning rates or the loss's weights (--reg-lambda)")
        if (state.step % cfg.eval_every == 0 or state.stopped_by is not None) and state.stopped_by != INTERRUPT:
            validate_and_log(run, state)
        if cfg.save_every and state.step % cfg.save_every == 0 and state.stopped_by is None:
            save(run, state)
    # a signal's stop saves before the last validation: SIGKILL follows SIGTERM after a grace period (Slurm's
    # KillWait, 30 s by default; docker stop, 10 s), and the checkpoint is what must be on disk by then
    # (one that came during a --save-every save stops the run at the step just saved: not written twice)
    saved = state.stopped_by == INTERRUPT and not idle_resume(state)
    if saved and state.saved_at != state.step:
        save(run, state)
    if state.step > state.first_step and state.validated_at != state.step:  # stopped by before_step or a signal:
        validate_and_log(run, state)  # the run's last step is validated all the same ("and at the end")
    if not saved and not idle_resume(state):  # a resumed run that ran no step has nothing new to save
        save(run, state)


def stopped_in_setup(run: Run) -> str | None:
    """INTERRUPT where a signal reached rank 0 during setup (broadcast: every rank skips or runs step 0's validation
    together, as they agree on the stop right after it), else None. The validation would run before the stop is asked
    (a full pass over the validation batches: on a big model more than Slurm's 30 s KillWait before SIGKILL), and
    skipping it changes nothing the resume reads: the resumed run starts at step 0 and validates it then."""
    hit = run.ctx.master and run.interrupt is not None and run.interrupt.hit
    return agree_on_reason(run.ctx, INTERRUPT if hit else None)


def wait_for_step(run: Run, state: LoopState) -> str | None:
    """before_step's answer (rank 0, one process): None to start the step or the reason to end the run, asked again
    every poll_s seconds while the hook holds the step (WAIT); each ask runs the run's own stop checks first."""
    while True:
        reason = ask(run, run.hooks.before_step, state)
        if reason != WAIT:
            return reason
        time.sleep(run.hooks.poll_s)


def idle_resume(state: LoopState) -> bool:
    """Whether this process resumed a run and ran no step (its budget or --stop-after was already reached, e.g. snlp
    speedrun or sft-grid reusing a finished run): its checkpoint and train_summary.json stay as the run left them."""
    return state.first_step > 0 and state.step == state.first_step


def ask(run: Run, hook, state: LoopState) -> str | None:
    """A hook's answer on rank 0 (None elsewhere and without the hook)."""
    return hook(state.step) if hook is not None and run.ctx.master else None


def limit_reason(run: Run, state: LoopState) -> str | None:
    """The run's own limits: its budget (steps/minutes), then --stop-after."""
    if run.progress.done():
        return "budget"
    if run.cfg.stop_after is not None and state.step >= run.cfg.stop_after:
        return "stop_after"
    return None


def train_step(run: Run, state: LoopState) -> StepStats:
    """One optimizer step: grad_accum micro-batches (DDP syncs the gradients on the last), clipping, the
    update at this step's LR; then the ranks agree on the clock, the hooks' stop and the statistics."""
    cfg, ctx = run.cfg, run.ctx
    t0 = time.perf_counter()
    pending = None  # the step's micro-batches, read ahead where an empty step is skipped before any forward
    if run.job.skip_empty is not None:
        pending = [unpack(run.job.batch(state.micro + a, ctx.rank, ctx.world)) for a in range(cfg.grad_accum)]
        if step_is_empty(run, pending):
            return skip_step(run, state)
    reg = getattr(run.job.loss, "reg", None)
    lam = reg.weight(state.step) if reg is not None else 0.0
    mult = lr_multiplier(state.step, run.progress.frac, cfg.warmup_steps, cfg.warmdown)
    set_lr(run.opts, mult)
    # sums in at least fp32, in the CE's own dtype when it is wider: an fp64 model's logged loss is then its fp64
    # mean (an in-place += into an fp32 zero rounded every micro-batch's CE to fp32)
    ce_sum = torch.zeros((), device=ctx.device)
    reg_sum = torch.zeros((), device=ctx.device)
    n_tok = 0
    for a in range(cfg.grad_accum):
        x, y, valid = pending[a] if pending is not None else unpack(run.job.batch(state.micro, ctx.rank, ctx.world))
        state.micro += 1
        # the tokens a step trains on: a padded batch's real positions (a host-side count, the mask is still on
        # the CPU), so tokens/s and MFU do not count padding (--compile pads every SFT batch to one length)
        n_tok += x.numel() if valid is None else int(valid.sum())
        counts = micro_counts(run.job, y, valid)
        if ctx.world == 1:
            check_has_targets(run.job, y, counts, state)
        share = token_shares(counts, ctx, run.share_dtype) if ctx.world > 1 else None
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        extra = () if valid is None else (valid.to(ctx.device, non_blocking=True),)
        if run.flops_per_token is None:  # once, on the real step's batch (the eager module: the same math);
            # per position computed, padding included: MFU = these FLOPs x real tokens/s counts useful work only
            t_count = time.perf_counter()
            run.flops_per_token = step_flops(run.job.loss, x, y, lam, run.autocast, *extra) / x.numel()
            spent = time.perf_counter() - t_count  # the count is neither the step's time nor in its tok_s
            t0 += spent
            state.t_last += spent
        sync = nullcontext() if (ctx.world == 1 or a == cfg.grad_accum - 1) else run.stepper.no_sync()
        with sync:
            with run.autocast():
                loss, ce, rg = run.stepper(x, y, lam, *extra, **({} if share is None else {"share": share}))
            (loss / cfg.grad_accum).backward()
        # weighted as the loss is (token_shares): the ranks' average below is then the global batch's token mean. A
        # rank whose micro-batch has no target (share 0) has a CE mean of 0/0 = NaN, and NaN x 0 is NaN: it weighs
        # nothing (its gradient is 0, as autograd gives it), so its mean is dropped on the device, no host read
        if share is not None:
            ce, rg = torch.where(share[0] > 0, ce, 0), torch.where(share[1] > 0, rg, 0)
        ce_sum = ce_sum + (ce if share is None else ce * share[0])  # out of place: promoted to the wider dtype
        reg_sum = reg_sum + (rg if share is None else rg * share[1])
    # the norm is measured without clipping too (--grad-clip 0, the paper script's setting): it is what shows a
    # non-finite gradient (a loss term that overflowed while the logged CE and term stayed finite), on which
    # train_loop stops the run before a save keeps the NaN weights the optimizer makes of it
    params = [p for p in run.job.model.parameters() if p.grad is not None]
    gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip > 0 else \
        torch.nn.utils.get_total_norm([p.grad for p in params])
    for o in run.opts:
        o.step()
    for o in run.opts:
        o.zero_grad(set_to_none=True)
    state.step += 1
    wide = torch.promote_types(ce_sum.dtype, reg_sum.dtype)
    stats = torch.stack([ce_sum.to(wide), reg_sum.to(wide)]) / cfg.grad_accum
    st = reduce_step(run, state, stats, n_tok, lam, mult, gnorm)
    st.step_s = time.perf_counter() - t0  # after reduce_step's host read: the device has finished the step
    state.step_times.append((state.step, st.tokens, st.step_s))
    # MFU per process: its own tokens over its own device's peak (DDP ranks run in lockstep)
    st.mfu = state.mfu = mfu(run.flops_per_token, n_tok / max(st.step_s, 1e-9), run.peak_flops)
    return st


def step_is_empty(run: Run, batches: list) -> bool:
    """Whether a step's micro-batches `batches` (this rank's) hold no position to learn from on any rank: the first
    of Job.counts summed over them, read on the host (the batches are still there), and under DDP summed over the
    ranks (one all_reduce and one read per step, before the forward: every rank then skips or steps together)."""
    n = sum(micro_counts(run.job, y, valid)[0] for _, y, valid in batches)
    if run.ctx.world > 1:
        box = torch.tensor([float(n)], dtype=torch.float64, device=run.ctx.device)
        dist.all_reduce(box)
        n = float(box.item())
    return n == 0


def skip_step(run: Run, state: LoopState) -> StepStats:
    """A step with nothing to learn from (`step_is_empty`): its micro-batches are consumed (the data cursor, saved,
    moves past them: a resumed run draws what an uninterrupted one draws), and nothing else moves. A loss whose empty
    mean is 0 gives a zero gradient, on which AdamW still steps: its momentum (beta1 = 0.8) moves the weights and the
    bias corrections of every later step change, and the LR schedule would count a step that trained nothing. The
    ranks still agree on the clock, the hooks' stop and any signal (reduce_step, with no tokens), so a time budget and
    a stop hold as after a trained step; the last step's train loss is kept."""
    state.micro += run.cfg.grad_accum
    state.skipped += 1
    loss = state.train_loss
    zero = torch.zeros(2, dtype=torch.float64, device=run.ctx.device)
    st = reduce_step(run, state, zero, 0, 0.0, 0.0, None)
    state.train_loss = loss
    st.skipped = True
    return st


def log_skip(run: Run, state: LoopState) -> None:
    """A skipped step's log.jsonl row: the trained steps so far (`step`), the micro-batch index of the skipped step's
    first micro-batch (`skipped_micro`: a resume trims the rows of the micro-batches it draws again, trim_log), the
    skips so far, the clock, and the run's stop when it ends here (after the last trained step's row)."""
    if state.stopped_by is not None:
        log_last_step(run, state)
    write_log(run, {"step": state.step, "skipped_micro": state.micro - run.cfg.grad_accum, "skipped": state.skipped,
                    "why": run.job.skip_empty, "elapsed": run.progress.elapsed,
                    **({"stop": state.stopped_by} if state.stopped_by is not None else {})}, state.mfu)


def micro_counts(job, y: torch.Tensor, valid: torch.Tensor | None) -> tuple[float, float] | None:
    """A micro-batch's (CE, regulariser) token counts (Job.counts; SFT's default: targets y != -1 and real positions
    `valid`), or None when its means need no weighting (no `valid` and no Job.counts: every position counts)."""
    if job.counts is not None:
        return job.counts(y, valid)
    return None if valid is None else (float((y != -1).sum()), float(valid.sum()))


def check_has_targets(job, y: torch.Tensor, counts: tuple[float, float] | None, state) -> None:
    """Refuse, in one process, a micro-batch with no target to train on, before its forward: its CE mean is 0/0, a
    NaN the step would apply and log (the run then stopped saying the loss diverged, lower the learning rates).
    The count is the job's (Job.counts, SFT's targets != -1), else y's entries != -1 where y is host memory (a
    device y would cost a sync per micro-batch). A job with its own counts and a loss that defines the empty mean
    (snlp adapt's reply-weighted KL: 0) is its own judge: with Job.skip_empty a step with nothing to learn from is
    skipped before this (`skip_step`). Under DDP the ranks' shares weigh a rank without targets at 0 (train_step)."""
    if job.counts is not None:
        return
    n = counts[0] if counts is not None else (int((y != -1).sum()) if y.device.type == "cpu" else None)
    if n == 0:
        raise ValueError(f"micro-batch {state.micro - 1} (step {state.step + 1}) has no target to train on: every "
                         f"target is -1 (ignored), so its mean loss is 0/0; give each micro-batch at least one")


def token_shares(counts: tuple[float, float] | None, ctx: DistContext,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """(2,) `dtype`, this rank's share of a micro-batch's CE tokens and regulariser positions (`micro_counts`, read on
    the host, where the batch still is), each as count x world / the count over all ranks (one all_reduce of two
    numbers); None when `counts` is. Every rank's mean weighted by its share and averaged over the ranks (DDP's
    gradient average) is the mean over the global batch's tokens; a global count of 0 gives every rank share 0."""
    if counts is None:
        return None
    mine = torch.tensor([float(c) for c in counts], dtype=torch.float64, device=ctx.device)
    total = mine.clone()
    dist.all_reduce(total)
    return (mine * ctx.world / total.clamp(min=1.0)).to(dtype)  # computed in fp64, rounded once


def unpack(b: tuple) -> tuple:
    """A job's micro-batch as (x, y, valid): valid None when the job gives none (every position real)."""
    return (b[0], b[1], b[2] if len(b) > 2 else None)


def reduce_step(run: Run, state: LoopState, stats, n_tok: int, lam: float, mult: float, gnorm) -> StepStats:
    """The step's statistics over all ranks. The time budget and the hooks' stop must be the same on every
    rank (or they deadlock), so rank 0's clock and hook answer decide, broadcast with the reductions."""
    ctx = run.ctx
    reason = ask(run, run.hooks.should_stop, state)
    # one process has nothing to broadcast: the host values stay on the host (a copy in from pageable memory waits
    # for the device like a read does). The last entry counts the ranks a signal reached: rank 0's own is in its
    # `reason`, but `kill` of one worker, or a signal torchrun forwards to some ranks first, stops them all too
    signalled = float(run.interrupt is not None and run.interrupt.hit)
    ctl = torch.tensor([time.perf_counter() - run.t_start, float(reason is not None), n_tok, signalled],
                       dtype=torch.float64, device=ctx.device if ctx.world > 1 else "cpu")
    if ctx.world > 1:
        dist.broadcast(ctl[:2], 0)
        dist.all_reduce(ctl[2:])
        dist.all_reduce(stats)
        stats /= ctx.world
        if ctl[1] > 0:  # only then: the reason string costs a second collective
            reason = agree_on_reason(ctx, reason)
        elif ctl[3] > 0:
            reason = INTERRUPT
    # ONE device-to-host read for everything the log needs: each float() of a device tensor is a sync that drains
    # the launch queue, and a step had five (docs/gpu-internals.md, host syncs)
    gn = gnorm.detach().double().reshape(1) if gnorm is not None else stats.new_zeros(1, dtype=torch.float64)
    read = [stats.detach().double().reshape(2), gn]
    if ctx.world > 1:
        clock, _, tok, _, loss, reg_v, gn_v = torch.cat([ctl, *read]).tolist()
    else:
        (clock, _, tok, _), (loss, reg_v, gn_v) = ctl.tolist(), torch.cat(read).tolist()
    run.progress.step, run.progress.elapsed = state.step, clock
    step_tokens = int(tok) if ctx.world > 1 else n_tok
    state.tokens += step_tokens
    state.train_loss = loss
    now = time.perf_counter()
    tps = step_tokens / max(now - state.t_last, 1e-9)
    state.t_last = now
    return StepStats(loss=loss, reg=reg_v, lam=lam, lr_scale=mult, tokens=step_tokens,
                     tok_s=tps, grad_norm=gn_v if gnorm is not None else None, hook_reason=reason)


def log_step(run: Run, state: LoopState, st: StepStats) -> None:
    """The progress bar, and the step's log.jsonl record every log_every steps, at step 1 and at the end."""
    # `reg`: the regulariser term over the whole micro-batch; when --reg-rows leaves out rows the term covers only the
    # first ceil(F * B), a different (noisier) number, so it is logged as `reg_subset`, never as `reg`
    rows = run.cfg.reg_rows
    reg_key = "reg" if rows is None or reg_rows(rows, run.cfg.batch_size) == run.cfg.batch_size else "reg_subset"
    # a job whose second term is not the regulariser (adapt's MSE) logs it under its own name, without a lambda
    own = run.job.second_term
    reg_key = own or reg_key
    if run.bar is not None:
        run.bar.update(1)
        run.bar.set_postfix(loss=f"{st.loss:.3f}", **{reg_key: f"{st.reg:.3f}"}, tok_s=f"{st.tok_s:,.0f}",
                            lr=f"{run.opts[0].param_groups[0]['lr']:.2e}", refresh=False)
    end = state.stopped_by is not None
    # `leg_start`: this process's first trained step (step 1, or the one after a resumed run's checkpoint): it builds
    # the caches and, compiled, compiles again, so a reader of `step_s` / `tok_s` leaves it out of a steady pace
    row = {"step": state.step, "loss": st.loss, reg_key: st.reg, **({} if own else {"lambda": st.lam}),
           "tok_s": st.tok_s, "elapsed": run.progress.elapsed, "lr_scale": st.lr_scale, "grad_norm": st.grad_norm,
           "step_s": st.step_s, **({"leg_start": True} if state.step == state.first_step + 1 else {})}
    if state.step % run.cfg.log_every == 0 or state.step == 1 or end:
        write_log(run, {**row, **({"stop": state.stopped_by} if end else {})}, st.mfu)
        state.unlogged = None
    else:
        state.unlogged = (row, st.mfu)


def log_last_step(run: Run, state: LoopState) -> None:
    """The last trained step's row where --log-every left it out and the run ends on a row of its own (a stop on a
    skipped step or between steps): log_step's "and at the end" holds for the last step that trained."""
    if state.unlogged is not None:
        write_log(run, *state.unlogged)
        state.unlogged = None


def validate_and_log(run: Run, state: LoopState) -> None:
    """The job's validation at the current step, logged (rank 0) and kept as the run's latest."""
    t = time.perf_counter()
    v = run.job.validate(run.job.model, run.job.val_batches)
    state.t_last += time.perf_counter() - t  # not the next step's time: its tok_s is the step's own pace
    state.validation, state.validated_at = v, state.step
    if state.step == 0:
        if state.resumed and run.ctx.master:  # a run saved at step 0 (--stop-after 0, a stop after this validation):
            drop_validations(run.out / "log.jsonl", 0)  # its leg's row of the same weights is replaced, not repeated
        write_log(run, {"step": 0, **v.record()}, state.mfu)
        say(run, f"step 0: {v}")
    else:
        write_log(run, {"step": state.step, "elapsed": run.progress.elapsed, **v.record()}, state.mfu)
        say(run, f"step {state.step}: {v} | train loss {state.train_loss:.4f}")


def save(run: Run, state: LoopState) -> None:
    """The checkpoint with everything `--resume` needs (rank 0; the others wait for it)."""
    t = time.perf_counter()
    if run.ctx.master:
        st = {"step": state.step, "micro": state.micro, "elapsed": run.progress.elapsed, "tokens": state.tokens,
              "skipped": state.skipped, "world": run.ctx.world, "args": run.args, **run.job.state}
        save_run(run.out, run.job.model, run.job.tokenizer, run.opts, st)
    state.peer_signal = signals_so_far(run)  # the others wait for rank 0's save in this all-reduce (a barrier)
    state.t_last += time.perf_counter() - t  # not the next step's time (validate_and_log)
    state.saved_at = state.step


def signals_so_far(run: Run) -> int:
    """The highest signal number any rank has taken (0: none), all-reduced where the ranks wait for rank 0's save: a
    signal after the last step that reached only another rank (a `kill` of one worker) comes after the ranks' last
    step reduction, and the final save is the one exchange left in which rank 0 can learn of it and say that the
    run had finished (late_signal)."""
    own = run.interrupt.signum if run.interrupt is not None and run.interrupt.signum is not None else 0
    if run.ctx.world == 1:
        return int(own)
    box = torch.tensor([int(own)], dtype=torch.int64, device=run.ctx.device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box.item())


WARM_STEPS = 2  # steps left out of the steady speed: compiling (step 1), allocator and cache warm-up


def step_speed(run: Run, state: LoopState) -> StepSpeed | None:
    """The steady speed of this process's steps (None if it ran none): the first WARM_STEPS are left out when
    enough steps ran (else only the first, or none of a single step)."""
    times = state.step_times
    if not times:
        return None
    warm = WARM_STEPS if len(times) > WARM_STEPS + 1 else min(1, len(times) - 1)
    steady = times[warm:]
    secs = sum(t for _, _, t in steady)
    tok_s = sum(n for _, n, _ in steady) / max(secs, 1e-9)
    per_proc = tok_s / run.ctx.world
    fpt = run.flops_per_token
    return StepSpeed(compiled=run.cfg.compile, steps=len(steady), warm=warm, tok_s=tok_s, step_s=secs / len(steady),
                     first_step_s=times[0][2], flops_per_token=fpt, peak_flops=run.peak_flops,
                     mfu=mfu(fpt, per_proc, run.peak_flops), tflops=fpt * per_proc / 1e12 if fpt else None,
                     device=device_label(run.ctx.device), first_step=times[0][0])


@dataclass
class RegTiming:
    """--time-reg's rounds (time_regulariser): the medians, the paired ratios, the load window they ran in
    (snlp.runtime.load.LoadWindow.to_json) and the threads the run kept busy on the machine (every local rank's)."""

    reg_step_s: float
    plain_step_s: float
    round_ratios: list[float]
    load: dict
    own_threads: int


def time_regulariser(run: Run, state: LoopState, rounds: int) -> RegTiming:
    """Median seconds of one micro-batch step (forward + backward) with the regulariser and without it, timed
    round-robin after a warm-up round on the next training batch, in the run's treatment (compiled or eager;
    this process alone, no gradient sync), and each round's time without it / with it (the paired ratios the sign
    test reads). Nothing the run saved changes: no optimizer step, gradients cleared."""
    loss, ctx = run.job.loss, run.ctx
    plain = TrainStep(loss.model, RegConfig(), loss.plan)
    with_reg = loss
    if run.cfg.compile:
        with_reg = run.stepper if ctx.world == 1 else CompiledStep(loss, ctx.device)
        plain = CompiledStep(plain, ctx.device)
    x, y, *valid = (t.to(ctx.device) for t in run.job.batch(state.micro, ctx.rank, ctx.world))
    lam = max(loss.reg.weight(state.step), 1e-12)

    def call(fn, lam_: float):
        def go():
            with run.autocast():
                out = fn(x, y, lam_, *valid)[0]
            out.backward()
        return go

    own, ranks = busy_threads(ctx)  # every rank times at once: all of this machine's ranks are the run's own load
    window = LoadWindow.begin()
    if ctx.master:  # snlp train has no --threads: no remedy to name; the training loop just kept `own` busy
        warn_oversubscribed([own], window, ctx.device, remedy=None, ranks=ranks, busy=own)
    times = time_round_robin({"reg": call(with_reg, lam), "plain": call(plain, 0.0)}, 1, rounds, ctx.device)
    window.close()
    run.job.model.zero_grad(set_to_none=True)
    # the median the docstring and the summary line say (an even number of rounds: the mean of the middle two, not
    # the upper one, which put 20 ms beside 10 ms for rounds of 10 and 20 ms)
    med = lambda v: statistics.median(v) / 1e3  # noqa: E731
    return RegTiming(med(times["reg"]), med(times["plain"]), [p / r for p, r in zip(times["plain"], times["reg"])],
                     window.to_json(), own)


def finish(run: Run, state: LoopState, t_wall: float, speed: StepSpeed | None = None) -> TrainResult:
    """Close the bar, print the summary lines and write train_summary.json (rank 0), and say what the run did."""
    if run.bar is not None:
        run.bar.close()
    total = time.perf_counter() - run.t_start
    v = state.validation
    if run.ctx.master and idle_resume(state):
        why = ("its budget or --stop-after is reached" if state.stopped_by in (None, "budget", "stop_after") else
               f"stopped ({state.stopped_by}) before its first step")  # a Ctrl-C or a hook: steps are left
        print(f"{run.out}: no step run ({why} at step {state.step}); the checkpoint is kept as it was", flush=True)
    elif run.ctx.master:
        keeps = run.job.keeps_checkpoint is None or run.job.keeps_checkpoint(state.stopped_by or "budget")
        print(f"{f'saved {run.out} after' if keeps else 'trained'} {state.step} steps, {state.tokens:,} tokens in "
              f"{total:.0f}s ({state.tokens / max(total, 1e-9):,.0f} tokens/s incl. eval)" + (f" | {v}" if v else ""),
              flush=True)
        if state.skipped:
            print(skipped_line(run, state), flush=True)
        if speed is not None:
            print(speed_line(speed), flush=True)
            if speed.load is not None:  # --time-reg's rounds: one line where other work shared the cores
                say_contention(LoadWindow(**speed.load), speed.load_threads, "--time-reg: ")
    result = TrainResult(out=str(run.out), steps=state.step, tokens=state.tokens, train_loss=state.train_loss,
                         val_loss=v.loss if v else None, wall_s=time.perf_counter() - t_wall,
                         elapsed_s=run.progress.elapsed, validation=v, stopped_by=state.stopped_by or "budget",
                         speed=speed, signal=interrupt_signal(run, state), late_signal=late_signal(run, state),
                         skipped_steps=state.skipped)
    if run.ctx.master and not (idle_resume(state) and (run.out / "train_summary.json").is_file()):
        summary = {k: val for k, val in asdict(result).items() if k not in ("validation", "speed")}
        summary["validation"] = v.record() if v else None
        summary["speed"] = ({**asdict(speed), "reg_overhead": speed.reg_overhead,
                             "reg_overhead_sign": paired_marks(speed.reg_round_ratios)} if speed else None)
        summary["mfu"] = speed.mfu if speed else None
        write_atomic(run.out / "train_summary.json", json_text(summary, indent=2) + "\n")  # strict: a NaN loss is null
    return result


def skipped_line(run: Run, state: LoopState) -> str:
    """The summary's line on the steps skipped with nothing to learn from (Job.skip_empty)."""
    n = state.skipped
    return (f"{n} step{'s' if n != 1 else ''} skipped ({run.job.skip_empty} in {'their' if n != 1 else 'its'} "
            f"micro-batches): no update, not counted in the {state.step} steps, their data passed over")


def late_signal(run: Run, state: LoopState) -> str | None:
    """The name of a signal this process took after the loop's last stop check (TrainResult.late_signal), so that
    train_summary.json says why a finished run got one; None where none came or one stopped the run."""
    if state.stopped_by == INTERRUPT:
        return None
    if run.interrupt is not None and run.interrupt.signum is not None:
        return signal_name(run.interrupt.signum)
    return signal_name(state.peer_signal) if state.peer_signal else None  # another rank's, learnt at the last save


def interrupt_signal(run: Run, state: LoopState) -> str | None:
    """The name of the signal that stopped the run (SIGINT, SIGTERM, ...): this process's, or "a signal" where another
    DDP rank's stopped it; None where none did."""
    if state.stopped_by != INTERRUPT:
        return None
    if run.interrupt is not None and run.interrupt.signum is not None:
        return signal_name(run.interrupt.signum)
    return "a signal to another rank" if run.ctx.world > 1 else None  # else a hook's own "interrupt"


def speed_line(sp: StepSpeed) -> str:
    """The summary's speed line: steady tokens/s, step time, MFU (or why there is none) and the regulariser's cost."""
    mfu_text = (f"MFU {sp.mfu:.1%} of {sp.peak_flops / 1e12:.0f} TFLOP/s bf16 peak" if sp.mfu is not None else
                "MFU n/a (no known peak for this device; the model TFLOP/s is the peak-free figure)")
    line = (f"{'compiled' if sp.compiled else 'eager'} steps: {sp.tok_s:,.0f} tokens/s, {sp.step_s * 1e3:.1f} ms/step "
            f"over {sp.steps} steady steps (first {sp.warm} left out; step {sp.first_step} took {sp.first_step_s:.1f}s) | "
            + (f"{sp.flops_per_token / 1e6:.2f} MFLOP/token, {sp.tflops:.3f} model TFLOP/s | " if sp.tflops else "")
            + mfu_text)
    if sp.reg_overhead is not None:  # its rounds are paired: marked by the sign test as every paired ratio printed
        ratios = sp.reg_round_ratios or []
        line += (f" | regulariser: {sp.reg_step_s * 1e3:.1f} vs {sp.plain_step_s * 1e3:.1f} ms per micro-batch step "
                 f"({sp.reg_overhead:.2f}x{tie_mark(ratios)}"
                 + (f"; {verdict_text(ratios, 'the step without it', 'rounds')})" if ratios else ")"))
    return line


def write_log(run: Run, rec: dict, step_mfu: float | None) -> None:
    """One log.jsonl row; every row carries `mfu`, the MFU of the latest step (null before the first step and
    without a known device peak, e.g. on CPU)."""
    if run.ctx.master:
        with open(run.out / "log.jsonl", "a") as f:
            f.write(json_text({**rec, "mfu": step_mfu}) + "\n")  # strict: a diverged step's NaN loss is null


def say(run: Run, msg: str) -> None:
    """A console line on rank 0, above the progress bar when there is one."""
    if not run.ctx.master:
        return
    if run.bar is not None:
        run.bar.write(msg)
    else:
        print(msg, flush=True)

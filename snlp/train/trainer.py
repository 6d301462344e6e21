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

import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from snlp.train.checkpointing import ResumePoint, open_run, save_run, set_rng_state, trim_log
from snlp.train.config import TrainConfig, TrainResult
from snlp.train.distributed import DistContext, agree_on_reason, barrier, setup_dist, teardown_dist
from snlp.train.hooks import InterruptStop, TrainHooks, with_stop
from snlp.train.job import Job
from snlp.train.muon import Muon, default_ns_dtype, warn_if_emulated
from snlp.train.optim import Progress, build_optimizers, load_optimizer_states, lr_multiplier, set_lr
from snlp.train.precision import autocast_context
from snlp.train.pretrain import apply_freeze, pretrain_job
from snlp.train.validate import ValidationResult
from snlp.runtime.device import progress_bar
from snlp.runtime.outputs import locked_output


@dataclass
class Run:
    """What the loop trains and with what, built once by `setup`."""

    cfg: TrainConfig
    ctx: DistContext
    job: Job
    opts: list
    stepper: nn.Module  # job.loss, DDP-wrapped when world > 1
    progress: Progress
    autocast: Callable
    hooks: TrainHooks
    bar: object | None  # tqdm bar on rank 0 unless no_progress
    t_start: float  # perf_counter() at the run's training clock 0 (earlier when resumed)

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)


@dataclass
class LoopState:
    """What changes every step. step/micro/tokens (with the RNG and optimizer states) are saved and resumed."""

    step: int = 0
    micro: int = 0  # micro-batches consumed: the data position
    tokens: int = 0  # input tokens processed, all ranks
    first_step: int = 0  # the step this process started at (> 0 when resumed)
    train_loss: float | None = None
    validation: ValidationResult | None = None
    validated_at: int | None = None  # the step of `validation`
    stopped_by: str | None = None
    t_last: float = 0.0  # perf_counter() at the end of the previous step (tokens/s)


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


def fit(cfg: TrainConfig, make_job: Callable[..., Job] = pretrain_job, hooks: TrainHooks | None = None) -> TrainResult:
    """Train as `cfg` says and save the checkpoint to cfg.out. `make_job(cfg, model, tok, rank, world,
    device) -> Job` supplies the model, data and loss (default: pretraining); model/tok are the
    checkpoint's when resuming, else None. `hooks` let the caller wait before steps or stop the run.
    Multi-process under torchrun (DDP)."""
    cfg.check()
    ctx = setup_dist(cfg.device)
    interrupted = InterruptStop()  # Ctrl-C during the loop: stop after the step, save (snlp.train.hooks)
    try:
        with locked_output(cfg.out) if ctx.master else nullcontext():  # a second run on cfg.out is refused
            t_wall = time.perf_counter()
            run, state = setup(cfg, make_job, with_stop(hooks or TrainHooks(), interrupted), ctx)
            with interrupted.armed():
                train_loop(run, state)
            return finish(run, state, t_wall)
    finally:
        teardown_dist(ctx)


def setup(cfg: TrainConfig, make_job, hooks: TrainHooks, ctx: DistContext) -> tuple[Run, LoopState]:
    """The Run and the LoopState to start from: a new run, or the one saved in cfg.out (--resume)."""
    torch.manual_seed(cfg.seed)
    start = open_run(Path(cfg.out), cfg.resume)
    if start.resume is not None and ctx.master:  # records of steps after the checkpoint were never saved
        trim_log(Path(cfg.out) / "log.jsonl", start.resume.step)
    job = make_job(cfg, start.model, start.tokenizer, ctx.rank, ctx.world, ctx.device)
    apply_freeze(job.model, cfg)
    job.model.to(ctx.device)
    job.model.train()
    opts = build_optimizers(job.model, cfg)
    if ctx.master:  # the dtypes the step computes in: weights, CUDA autocast, Muon's Newton-Schulz iterations
        warn_if_emulated(ctx.device, {p.dtype for p in job.model.parameters()}
                         | ({torch.bfloat16} if ctx.device.type == "cuda" else set())
                         | {o.ns_dtype or default_ns_dtype(ctx.device) for o in opts if isinstance(o, Muon)}, job.name)
    state = resume(start.resume, opts)
    progress = Progress(cfg.total_steps, cfg.minutes)
    progress.step, progress.elapsed = state.step, (start.resume.elapsed if start.resume else 0.0)
    stepper = job.loss
    if ctx.world > 1:
        stepper = nn.parallel.DistributedDataParallel(
            stepper, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    announce(cfg, job, ctx)
    bar = None
    if ctx.master and not cfg.no_progress:
        bar = progress_bar(progress.steps, "train", initial=state.step, unit="step", leave=True)  # lines off a tty
    run = Run(cfg, ctx, job, opts, stepper, progress, autocast_context(ctx.device), hooks, bar,
              t_start=time.perf_counter() - progress.elapsed)
    state.t_last = time.perf_counter()
    return run, state


def resume(point: ResumePoint | None, opts) -> LoopState:
    """The loop state of a saved run (its optimizer and RNG states restored), or a fresh one."""
    if point is None:
        return LoopState()
    load_optimizer_states(opts, point.optimizer)
    set_rng_state(point.rng)
    return LoopState(step=point.step, micro=point.micro, tokens=point.tokens, first_step=point.step)


def announce(cfg: TrainConfig, job: Job, ctx: DistContext) -> None:
    """Create the output folder and print the start banner (rank 0)."""
    if not ctx.master:
        return
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    m = job.model
    mc = m.config
    print(f"{job.name}: {mc.n_layer} layers, width {mc.n_embd}, {mc.n_head} heads, vocab {mc.vocab_size}, "
          f"{m.num_params() / 1e6:.2f}M params | {job.describe} | {cfg.batch_size}x{cfg.grad_accum} "
          f"sequences/step/process on {ctx.world} x {ctx.device}", flush=True)


def train_loop(run: Run, state: LoopState) -> None:
    """Steps until a limit (budget, stop_after) or a hook ends the run; validates and saves on the way."""
    cfg = run.cfg
    if state.step == 0:
        validate_and_log(run, state)
    state.stopped_by = limit_reason(run, state) or agree_on_reason(run.ctx, ask(run, run.hooks.should_stop, state))
    while state.stopped_by is None:
        if run.ctx.world == 1:  # before_step may block; under DDP a rank waiting alone would stall the others
            state.stopped_by = ask(run, run.hooks.before_step, state)
            if state.stopped_by is not None:
                break
        stats = train_step(run, state)
        state.stopped_by = limit_reason(run, state) or stats.hook_reason  # decided before the step is logged:
        log_step(run, state, stats)  # a lockstep peer reads the step and the decision together
        if not math.isfinite(stats.loss):
            raise FloatingPointError(f"training loss became {stats.loss} at step {state.step}; lower the learning "
                                     f"rates or --reg-lambda")
        if state.step % cfg.eval_every == 0 or state.stopped_by is not None:
            validate_and_log(run, state)
        if cfg.save_every and state.step % cfg.save_every == 0 and state.stopped_by is None:
            save(run, state)
    if state.step > state.first_step and state.validated_at != state.step:  # stopped by before_step:
        validate_and_log(run, state)  # the run's last step is validated all the same ("and at the end")
    save(run, state)


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
    reg = getattr(run.job.loss, "reg", None)
    lam = reg.weight(state.step) if reg is not None else 0.0
    mult = lr_multiplier(state.step, run.progress.frac, cfg.warmup_steps, cfg.warmdown)
    set_lr(run.opts, mult)
    ce_sum = torch.zeros((), device=ctx.device)
    reg_sum = torch.zeros((), device=ctx.device)
    n_tok = 0
    for a in range(cfg.grad_accum):
        x, y = run.job.batch(state.micro, ctx.rank, ctx.world)
        state.micro += 1
        n_tok += x.numel()
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        sync = nullcontext() if (ctx.world == 1 or a == cfg.grad_accum - 1) else run.stepper.no_sync()
        with sync:
            with run.autocast():
                loss, ce, rg = run.stepper(x, y, lam)
            (loss / cfg.grad_accum).backward()
        ce_sum += ce
        reg_sum += rg
    params = run.job.model.parameters()
    gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip > 0 else None
    for o in run.opts:
        o.step()
    for o in run.opts:
        o.zero_grad(set_to_none=True)
    state.step += 1
    stats = torch.stack([ce_sum.float(), reg_sum.float()]) / cfg.grad_accum
    return reduce_step(run, state, stats, n_tok, lam, mult, gnorm)


def reduce_step(run: Run, state: LoopState, stats, n_tok: int, lam: float, mult: float, gnorm) -> StepStats:
    """The step's statistics over all ranks. The time budget and the hooks' stop must be the same on every
    rank (or they deadlock), so rank 0's clock and hook answer decide, broadcast with the reductions."""
    ctx = run.ctx
    reason = ask(run, run.hooks.should_stop, state)
    ctl = torch.tensor([time.perf_counter() - run.t_start, float(reason is not None), n_tok],
                       dtype=torch.float64, device=ctx.device)
    if ctx.world > 1:
        dist.broadcast(ctl[:2], 0)
        dist.all_reduce(ctl[2:])
        dist.all_reduce(stats)
        stats /= ctx.world
        if ctl[1] > 0:  # only then: the reason string costs a second collective
            reason = agree_on_reason(ctx, reason)
    # ONE device-to-host read for everything the log needs: each float() of a device tensor is a sync that drains
    # the launch queue, and a step had five (docs/gpu.md, host syncs)
    gn = gnorm.detach().double().reshape(1) if gnorm is not None else ctl.new_zeros(1)
    clock, _, tok, loss, reg_v, gn_v = torch.cat([ctl, stats.detach().double().reshape(2), gn]).tolist()
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
    if run.bar is not None:
        run.bar.update(1)
        run.bar.set_postfix(loss=f"{st.loss:.3f}", reg=f"{st.reg:.3f}", tok_s=f"{st.tok_s:,.0f}",
                            lr=f"{run.opts[0].param_groups[0]['lr']:.2e}", refresh=False)
    end = state.stopped_by is not None
    if state.step % run.cfg.log_every == 0 or state.step == 1 or end:
        write_log(run, {"step": state.step, "loss": st.loss, "reg": st.reg, "lambda": st.lam, "tok_s": st.tok_s,
                        "elapsed": run.progress.elapsed, "lr_scale": st.lr_scale, "grad_norm": st.grad_norm,
                        **({"stop": state.stopped_by} if end else {})})


def validate_and_log(run: Run, state: LoopState) -> None:
    """The job's validation at the current step, logged (rank 0) and kept as the run's latest."""
    v = run.job.validate(run.job.model, run.job.val_batches)
    state.validation, state.validated_at = v, state.step
    if state.step == 0:
        write_log(run, {"step": 0, **v.record()})
        say(run, f"step 0: {v}")
    else:
        write_log(run, {"step": state.step, "elapsed": run.progress.elapsed, **v.record()})
        say(run, f"step {state.step}: {v} | train loss {state.train_loss:.4f}")


def save(run: Run, state: LoopState) -> None:
    """The checkpoint with everything `--resume` needs (rank 0; the others wait for it)."""
    if run.ctx.master:
        st = {"step": state.step, "micro": state.micro, "elapsed": run.progress.elapsed, "tokens": state.tokens,
              "args": asdict(run.cfg), **run.job.state}
        save_run(run.out, run.job.model, run.job.tokenizer, run.opts, st)
    barrier(run.ctx)


def finish(run: Run, state: LoopState, t_wall: float) -> TrainResult:
    """Close the bar, print the summary line (rank 0) and say what the run did."""
    if run.bar is not None:
        run.bar.close()
    total = time.perf_counter() - run.t_start
    v = state.validation
    if run.ctx.master:
        print(f"saved {run.out} after {state.step} steps, {state.tokens:,} tokens in {total:.0f}s "
              f"({state.tokens / max(total, 1e-9):,.0f} tokens/s incl. eval)" + (f" | {v}" if v else ""), flush=True)
    return TrainResult(out=str(run.out), steps=state.step, tokens=state.tokens, train_loss=state.train_loss,
                       val_loss=v.loss if v else None, wall_s=time.perf_counter() - t_wall,
                       elapsed_s=run.progress.elapsed, validation=v, stopped_by=state.stopped_by or "budget")


def write_log(run: Run, rec: dict) -> None:
    if run.ctx.master:
        with open(run.out / "log.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")


def say(run: Run, msg: str) -> None:
    """A console line on rank 0, above the progress bar when there is one."""
    if not run.ctx.master:
        return
    if run.bar is not None:
        run.bar.write(msg)
    else:
        print(msg, flush=True)

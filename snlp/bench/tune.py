"""`snlp tune`: choose the plan (and draft block, torch threads, compile) for one checkpoint on this machine by
MEASUREMENT, for two goals:

  ssd   exact self-speculative decoding (paper, "Self-speculative decoding"): maximise measured tokens/s; every
        measured candidate's greedy output is checked token for token against sequential decoding.
  snlp  SNLP decoding under a quality budget (`max_dppl`, e.g. 0.01): the fastest plan whose calibration PPL is
        within the budget of sequential's, by measured tokens/s.

Two stages:
  1 (cheap model, seconds)  agreement on calibration text: teacher-forced Top-1 and PPL of every plan (dPPL;
        the paper's alpha estimate) and the acceptance profile SSD really sees: one greedy speculative decode per
        plan at the largest B on calibration prompts (exact history: the verifier rewrites the cache), giving
        P(a round accepts >= i drafts) for i <= B, hence tokens/round at every B <= max (teacher-forced Top-1
        runs the suffix on approximate history everywhere and under-estimates aggressive drafters). Device costs
        of the steps decoding runs, timed round-robin after a warm-up, per (threads, compile) setting: the
        sequential model's cached single-token step, each plan's cached single-token drafter step and the
        verifier's forward over B+1 positions. Prediction per (plan, B): tokens/round over the round's cost
        B t_draft + t_verify(B+1) (the paper's ideal SSD speedup with the measured acceptance profile and the
        verifier's real cost instead of one sequential step; the paper's own number from Top-1 is kept in
        `ideal_ssd_speedup`). SNLP: 1 / t_draft.
  2 (end to end)  the shortlist (the `top` best plans per goal at their 2 best blocks, plus the best of every
        setting; `shortlist`) is decoded
        for real: SSD by snlp.decode.speculative.speculative_shootout (every shortlisted candidate of a setting in
        ONE round-robin after one sequential baseline, warm-up, medians of `repeats` rounds, output checked), SNLP
        by KV-cached snlp_generate vs sequential_generate round-robin. The pick is the best MEASURED shortlisted
        candidate where the shootout's paired rounds resolve its lead (`pick`: the main table's two-sided sign test;
        half the range of the per-round ratios where two were not timed in the same rounds); the candidates it
        does not resolve tie, and the tie goes to the highest stage-1
        prediction among them (an independent measurement: the acceptance profile and the step timings) where it
        is more than PREDICTION_TIE (2 %) clear of the others' (closer predictions tie too, and the highest measured
        median among them picks), then to the plan's name, and the result says so (`pick_rule`). Non-finite measurements are excluded with a note.
Measured tokens/s = the side-by-side speedup over sequential x the setting's median sequential tokens/s, so load
drift between the per-plan runs cancels (raw tokens/s are kept too). `full_grid` measures every candidate and
reports how far the pick is from the best of the grid (the validation of the shortlist); without it that
validation is not run and recorded as such (`grid_best` and `pick_vs_best` None, "not run" in the summary).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field, replace

import torch

from snlp.bench.records import markdown_table
from snlp.bench.stats import (SIGN_LEVEL, fewest_sign_rounds, paired_verdict, sign_test_p, sign_test_wins, tie_footnote,
                              tie_mark, verdict_text)
from snlp.decode.generate import sequential_generate, snlp_generate
from snlp.decode.speculative import ideal_ssd_speedup, speculative_generate, speculative_shootout
from snlp.decode.steps import check_compilable, sequential_step, snlp_step
from snlp.eval.data import as_tokens, sample_prompts, windows
from snlp.eval.protocol import EvalConfig, Quality, teacher_forced
from snlp.method.jacobian import check_fd_step
from snlp.method.plan import Plan
from snlp.method.preheat import Preheat
from snlp.method.solver import bind, preheat_for
from snlp.model.cache import KVCache
from snlp.model.gpt import GPT, eval_mode
from snlp.runtime.device import progress_bar
from snlp.runtime.fmt import DELTA_RATIO, fmt_delta_ppl, fmt_fraction
from snlp.runtime.timing import round_order, time_round_robin

GOALS = ("ssd", "snlp")
# stage-1 predictions closer than this (relative, predicted tokens/s) do not separate two candidates: each is a ratio
# of step-time medians whose CPU time moves by a few % run to run (measure_costs), so a 0.02 % difference (1.47026x
# vs 1.47000x, both printed 1.470x) is noise, and the measured median decides between them instead (`pick`)
PREDICTION_TIE = 0.02


def default_plans(n_layer: int, device=None) -> list[str]:
    """The default grid: suffixes of N = L/4, L/2 and 3L/4 layers, each as one layer per chunk at K = 1 and 2,
    with the one-shot `fwd` init, and as 2-layer fused chunks at K = 1 (12 plans at L = 16). On CUDA also the
    whole stack as the suffix (S = 0) at K = 2, 3 and 4: a batch-1 decode step there costs its chain of dependent
    kernels, S + K layer evaluations for a drafter, so these have the shortest chains that still accept well on
    a regularised model (the speedrun's IDN-Reg model: `16xF1-h0-K3` alpha 0.960 and `16xF1-h0-K4` 0.992 at
    chains 0.24 and 0.31 of the sequential step's, `12xF1-h0-K1` 0.971 at 0.36,
    docs/records/2026-11-27-lease-prep.md). On a CPU a step costs its FLOPs and weight bytes, K passes over every
    layer, so they are left out there."""
    out = []
    for N in sorted({max(1, n_layer // 4), max(1, n_layer // 2), max(1, 3 * n_layer // 4)}):
        out += [f"{N}xF1-h0-K1", f"{N}xF1-h0-K2", f"{N}xF1-fwd-K1"]
        if N % 2 == 0:
            out.append(f"{N // 2}xF2-h0-K1")
    if device is not None and torch.device(device).type == "cuda":
        out += [f"{n_layer}xF1-h0-K{k}" for k in (2, 3, 4) if k < n_layer]  # K >= L: the model itself
    return out


@dataclass
class TuneConfig:
    """What `tune` searches and how it measures (module docstring)."""

    plans: list[str] | None = None  # None: default_plans(n_layer, the model's device)
    blocks: tuple[int, ...] = (2, 3, 4, 6, 8)  # SSD draft block sizes B
    threads: tuple[int, ...] = ()  # torch CPU thread counts to measure; () = the current count
    compile: bool = False  # also measure compiled static-shape steps (snlp.decode.steps)
    ssd: bool = True  # goal (a): exact SSD
    max_dppl: float | None = None  # goal (b) when set: SNLP decoding with calibration dPPL <= this (0.01 = 1 %)
    top: int = 3  # stage-2 shortlist per goal: plans, each at its 2 best-predicted blocks (`shortlist`)
    full_grid: bool = False  # measure every candidate (validation of the shortlist)
    seq_len: int | None = None  # calibration window; None: min(256, the model's sequence_len) (`calibration_window`)
    calib_tokens: int = 8192  # teacher-forced calibration tokens (Top-1, PPL)
    prompts: int = 4  # stage-2 prompts (from the calibration tokens)
    prompt_len: int = 16
    gen_tokens: int = 64  # greedy tokens per prompt and run
    repeats: int = 6  # stage-2 timed rounds (medians): 6 is the fewest at which `pick`'s sign test can resolve a lead
    warmup: int = 1  # stage-2 untimed rounds
    step_runs: int = 30  # stage-1 timed steps per cost (medians)
    accept_tokens: int = 64  # stage-1 acceptance profile: greedy SSD tokens per prompt and plan (0: Top-1 model)
    seed: int = 0  # prompt sampling
    progress: bool = False

    def check(self) -> None:
        """Raise a ValueError naming every bad setting (nothing is run before)."""
        bad = []
        ints = lambda xs: all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in xs)  # noqa: E731
        if not self.blocks or not ints(self.blocks) or len(set(self.blocks)) != len(self.blocks):
            bad.append(f"blocks must be distinct integers >= 1 (got {self.blocks!r})")
        if not ints(self.threads) or len(set(self.threads)) != len(self.threads):
            bad.append(f"threads must be distinct integers >= 1 (got {self.threads!r})")
        if self.max_dppl is not None and not (isinstance(self.max_dppl, (int, float)) and 0 <= self.max_dppl < math.inf):
            bad.append(f"max_dppl must be a finite fraction >= 0, e.g. 0.01 for 1 % (got {self.max_dppl!r})")
        if not self.ssd and self.max_dppl is None:
            bad.append("nothing to tune: the SSD goal is off and no max_dppl budget was given")
        if self.seq_len is not None and not ints([self.seq_len]):
            bad.append(f"seq_len must be an integer >= 1 (got {self.seq_len!r})")
        for k in ("top", "calib_tokens", "prompts", "prompt_len", "gen_tokens", "repeats", "step_runs"):
            if not ints([getattr(self, k)]):
                bad.append(f"{k} must be an integer >= 1 (got {getattr(self, k)!r})")
        for k in ("warmup", "accept_tokens"):
            if not isinstance(getattr(self, k), int) or getattr(self, k) < 0:
                bad.append(f"{k} must be an integer >= 0 (got {getattr(self, k)!r})")
        if self.plans is not None and not self.plans:
            bad.append("plans is empty (None: the default grid)")
        if bad:
            raise ValueError("bad tune settings: " + "; ".join(bad))

    def settings(self) -> list[tuple[int, bool]]:
        """(threads, compiled) pairs measured: every thread count, eager, and compiled too with `compile`."""
        return [(t, c) for t in (self.threads or (torch.get_num_threads(),)) for c in ((False, True) if self.compile
                                                                                       else (False,))]

    def plan_list(self, n_layer: int, preheat: Preheat | None = None, device=None,
                  dtype: torch.dtype | None = None) -> list[Plan]:
        """The plans, parsed and checked against the model (duplicates dropped); a ValueError for an unknown
        plan, a preheat plan without calibration, a tol plan under `compile`, or (with the weights' `dtype`) a diag:fd
        eps below that dtype's FD step floor, which the first solve refused only after the calibration text was
        read. `device`: the model's, for the default grid (default_plans)."""
        plans = list(dict.fromkeys(Plan.parse(p, n_layer) for p in (self.plans or default_plans(n_layer, device))))
        for p in plans:
            if p.init == "preheat" and preheat is None:
                raise ValueError(f"plan {p} starts from the preheat init but no calibration was given")
            if self.compile:
                check_compilable(p)
            if dtype is not None:
                check_fd_step(p, dtype, torch.device(device or "cpu").type)
        return plans


@dataclass
class PlanQuality:
    """Calibration quality of one plan: teacher-forced Top-1 vs sequential (the greedy acceptance estimate) and
    PPL, dPPL relative to sequential (0.01 = +1 %); note "diverged" when its solve blew up."""

    plan: str
    top1: float | None
    ppl: float
    delta_ppl: float
    note: str = ""

    @classmethod
    def from_quality(cls, plan: str, q: Quality, sequential_ppl: float) -> "PlanQuality":
        """From the evaluation protocol's teacher-forced record of the plan and sequential's PPL."""
        return cls(plan, q.top1, q.ppl, q.ppl / sequential_ppl - 1.0, q.note)


@dataclass
class Acceptance:
    """Stage 1: the acceptance profile of one drafter in greedy SSD at `block` drafts per round, from the rounds
    that drafted the full block: reach[i - 1] = P(a round accepts >= i drafts). A B-draft round on the same history
    accepts min(n, B) of them (greedy drafts do not depend on B), so tokens/round at any B <= block follow."""

    plan: str
    block: int
    rounds: int
    reach: list[float]
    alpha: float | None  # accepted / examined: the i.i.d. per-draft alpha of the paper's formula (None: nothing
    # drafted, --accept-tokens 1: the prefill gives the only token)

    def tokens_per_round(self, B: int) -> float:
        """1 + E[min(n, B)] = 1 + sum_{i <= B} P(n >= i)."""
        return 1.0 + sum(self.reach[:B])


@dataclass
class StepCosts:
    """Stage 1: device costs of one (threads, compiled) setting, medians in ms."""

    threads: int
    compiled: bool
    clock: str  # "thread_cpu" (CPU, one thread) or "wall" (measure_costs says why)
    sequential_ms: float  # the sequential model's cached single-token step
    layer_ms: float  # sequential_ms / L (the per-layer cost, head and embedding included pro rata)
    verify_ms: dict[int, float]  # B -> the verifier's cached forward over B + 1 positions
    draft_ms: dict[str, float]  # plan -> its cached single-token SNLP step


@dataclass
class Candidate:
    """One row of the table: a goal, plan, draft block (SSD only), threads and compile, predicted and measured."""

    goal: str  # "ssd" or "snlp"
    plan: str
    block: int | None
    threads: int
    compiled: bool
    top1: float | None
    delta_ppl: float
    accept_alpha: float | None  # stage-1 SSD acceptance (i.i.d. fit of the profile; None: not measured)
    predicted_tokens_per_round: float | None  # SSD: from the acceptance profile (else the Top-1 i.i.d. model)
    s: float  # drafter speedup: sequential over drafter ms per cached single-token step (stage 1)
    predicted_speedup: float  # over sequential decoding (stage-1 model, module docstring)
    predicted_tokens_per_s: float
    ideal_ssd_speedup: float | None = None  # the paper's formula from (Top-1, B, s); SSD only
    within_budget: bool = True  # snlp: delta_ppl <= max_dppl
    shortlisted: bool = False
    measured: bool = False
    measured_speedup: float | None = None  # median of the per-round ratios, side by side with sequential
    round_speedups: list[float] | None = None  # the per-round paired ratios (sequential / this ms per token)
    noise: float | None = None  # half the range of round_speedups over their median (None: one round, unknown)
    tokens_per_s: float | None = None  # measured_speedup x the setting's median sequential tokens/s
    raw_tokens_per_s: float | None = None  # this run's own median
    sequential_tokens_per_s: float | None = None  # the sequential side of this candidate's runs
    alpha: float | None = None  # measured acceptance rate (SSD)
    measured_s: float | None = None  # SSD: the drafter speedup s of the end-to-end runs (per-step wall times)
    tokens_per_round: float | None = None
    matches_sequential: bool | None = None  # SSD: every output equalled sequential's, every round

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TuneResult:
    """Everything `tune` measured and picked; `to_dict` is the JSON."""

    config: TuneConfig
    n_layer: int
    device: str
    dtype: str
    quality: list[PlanQuality]
    acceptance: list[Acceptance]
    costs: list[StepCosts]
    candidates: list[Candidate]
    picks: dict[str, Candidate | None]  # goal -> the picked shortlisted candidate (`pick`; None: none qualifies)
    # the validation of the shortlist, only when it ran (config.full_grid); None when it did not: without the full
    # grid the pick comes from the measured shortlist by construction, which validates nothing
    grid_best: dict[str, Candidate | None] | None  # goal -> the best of every measured candidate
    pick_vs_best: dict[str, float | None] | None  # goal -> pick tokens/s over grid best's (1.0: the pick is the best)
    notes: list[str] = field(default_factory=list)
    stage1_s: float = 0.0
    stage2_s: float = 0.0
    pick_rule: dict[str, str] = field(default_factory=dict)  # goal -> how the pick was made (best measured / tie rule)
    # goal -> True where the paired rounds told the pick from none of the candidates the tie rule chose among (the
    # rule's text starts "tie:"), False where its lead is resolved; for readers of --json that do not parse the text
    pick_tie: dict[str, bool] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op CPU threads set to n inside, restored after."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def calibration_window(cfg: TuneConfig, model: GPT) -> int:
    """The calibration window: cfg.seq_len as given (past the model's sequence_len it runs, as RoPE extrapolation,
    with snlp eval's warning), by default min(256, the model's sequence_len)."""
    trained = model.config.sequence_len
    if cfg.seq_len is None:
        return min(256, trained)
    if cfg.seq_len > trained:
        warnings.warn(f"seq_len {cfg.seq_len} is past the model's sequence_len {trained} (the context it was trained "
                      f"for): the calibration windows measure extrapolation past it, not the model as trained",
                      stacklevel=3)
    return cfg.seq_len


def calibration_quality(model: GPT, val, plans: list[Plan], cfg: TuneConfig, preheat: Preheat | None = None
                        ) -> dict[str, PlanQuality]:
    """Teacher-forced Top-1 and PPL of every plan vs sequential on up to cfg.calib_tokens calibration tokens
    (snlp.eval.protocol.teacher_forced, the evaluation's own protocol)."""
    seq_len = calibration_window(cfg, model)
    wins = windows(as_tokens(val), seq_len, cfg.calib_tokens)  # (W, T + 1)
    ecfg = EvalConfig(seq_len=seq_len, max_tokens=cfg.calib_tokens, progress=cfg.progress)
    tf: dict[str, Quality] = teacher_forced(model, wins, plans, ecfg, preheat)  # row name -> its record
    return {str(p): PlanQuality.from_quality(str(p), tf[str(p)], tf["sequential"].ppl) for p in plans}


def quality_from_records(records) -> dict[str, PlanQuality]:
    """Stage-1 quality from evaluation records already measured (snlp.eval.protocol.EvalRecord: Top-1, PPL, dPPL),
    e.g. the speedrun's eval stage: no second teacher-forced pass."""
    return {r.plan: PlanQuality(r.plan, r.top1, r.ppl, r.delta_ppl if r.delta_ppl is not None else math.inf, r.note)
            for r in records if not r.is_sequential}


def measure_acceptance(model: GPT, prompts: list[list[int]], plans: list[Plan], cfg: TuneConfig,
                       preheat: Preheat | None = None) -> dict[str, Acceptance]:
    """Stage 1: each plan's acceptance profile (Acceptance) from greedy SSD at the largest block, cfg.accept_tokens
    tokens per prompt. Each round emits its accepted drafts plus one verifier token (on_tokens sees them), so a
    round's accepted count is what it emitted minus 1; only rounds that drafted the whole block count."""
    B = max(cfg.blocks)
    seq, out = sequential_step(model), {}
    # the longest part of stage 1 on a CPU (every plan decodes every prompt): minutes of silence without a bar
    with progress_bar(len(plans) * len(prompts), "SSD acceptance (stage 1)", cfg.progress, unit="decode") as bar:
        for plan in plans:
            draft = snlp_step(bind(model, plan, check_finite=False, preheat=preheat_for(plan, preheat)))
            counts, emitted = [], [0]

            def record(new, counts=counts, emitted=emitted):
                if cfg.accept_tokens - emitted[0] - 1 >= B:  # this round drafted B (it had room for B drafts + 1)
                    counts.append(len(new) - 1)
                emitted[0] += len(new)
            acc = exam = 0
            for p in prompts:
                emitted[0] = 0
                r = speculative_generate(model, p, plan, block=B, max_new_tokens=cfg.accept_tokens, draft=draft,
                                         verify=seq, on_tokens=record)
                acc, exam = acc + r.accepted, exam + r.examined
                bar.update()
            R = max(len(counts), 1)
            out[str(plan)] = Acceptance(str(plan), B, len(counts),
                                        [sum(n >= i for n in counts) / R for i in range(1, B + 1)],
                                        acc / exam if exam else None)
    return out


def measure_costs(model: GPT, plans: list[Plan], prompt: list[int], cfg: TuneConfig, threads: int, compiled: bool,
                  preheat: Preheat | None = None) -> StepCosts:
    """Stage 1 device costs at one setting: every step decoding runs, timed round-robin (cfg.step_runs timed calls
    each after 2 untimed; compiled steps compile in the untimed ones), each on its own cache prefilled with
    `prompt` and rolled back after every call, so every call runs at the same position. The clock: on a CPU at one
    thread the thread's CPU time (measured on the shared 2-core box: wall time per 5-10 ms step = CPU time + a
    near-constant ~4 ms wait for a core, which flattens the ratios between steps; CPU time stays within a few %
    run to run), else wall time (a GPU's queue, or intra-op worker threads a thread clock does not see)."""
    device = model.wte.weight.device
    clock = "thread_cpu" if device.type == "cpu" and threads == 1 else "wall"
    setting = f"{threads} thread{'s' if threads > 1 else ''}" + (", compiled" if compiled else "")
    with torch_threads(threads), torch.inference_mode(), \
            progress_bar(2 + cfg.step_runs, f"step timing (stage 1, {setting})", cfg.progress, unit="round") as bar:
        seq = sequential_step(model, compiled)
        drafts = {str(p): snlp_step(bind(model, p, check_finite=False, preheat=preheat_for(p, preheat)), compiled)
                  for p in plans}
        fns = {"seq": _timed_step(model, seq, prompt, 1, max(cfg.blocks) + 1)}
        fns.update({b: _timed_step(model, seq, prompt, b + 1, max(cfg.blocks) + 1) for b in cfg.blocks})
        fns.update({name: _timed_step(model, d, prompt, 1, max(cfg.blocks) + 1) for name, d in drafts.items()})
        if clock == "wall":
            times = time_round_robin(fns, 2, cfg.step_runs, device, on_round=bar.update)
        else:
            times = _cpu_round_robin(fns, 2, cfg.step_runs, on_round=bar.update)
        ms = {k: statistics.median(v) for k, v in times.items()}
    return StepCosts(threads=threads, compiled=compiled, clock=clock, sequential_ms=ms["seq"],
                     layer_ms=ms["seq"] / model.config.n_layer, verify_ms={b: ms[b] for b in cfg.blocks},
                     draft_ms={name: ms[name] for name in drafts})


def _cpu_round_robin(fns: dict, warmup: int, runs: int, on_round=lambda: None) -> dict:
    """snlp.runtime.timing.time_round_robin on this thread's CPU clock (ms per call), the order rotated round by
    round (`round_order`); `on_round()` after every round, outside the timed calls."""
    for r in range(warmup):
        for k in round_order(fns, r):
            fns[k]()
        on_round()
    out = {k: [] for k in fns}
    for r in range(runs):
        for k in round_order(fns, r):
            t0 = time.thread_time()
            fns[k]()
            out[k].append(1e3 * (time.thread_time() - t0))
        on_round()
    return out


def _timed_step(model: GPT, step, prompt: list[int], T: int, room: int):
    """A call of `step` on T tokens after `prompt` (cached once), the cache rolled back after it: (pad_to=T makes a
    compiled verifier run the padded shape speculative decoding runs)."""
    cache = KVCache.for_model(model, max_len=step.cache_len(len(prompt) + room + step.slack))
    step.warm_prefill(cache, len(prompt))
    step.prefill(torch.tensor([prompt], device=model.wte.weight.device), cache)
    P = cache.length
    x = torch.tensor([prompt[-1:] * T], device=model.wte.weight.device)  # (1, T)

    def run():
        step(x, cache, pad_to=T)
        cache.rollback(P)
    return run


def predict(quality: dict[str, PlanQuality], acceptance: dict[str, Acceptance], costs: list[StepCosts],
            cfg: TuneConfig) -> list[Candidate]:
    """Stage 1: one Candidate per (goal, plan, block, setting) with its predicted speedup and tokens/s
    (module docstring): SSD tokens/round from the plan's acceptance profile when measured, else the i.i.d.
    model with alpha = Top-1; diverged plans and plans without a Top-1 are left out."""
    out = []
    for c in costs:
        seq_tok_s = 1e3 / c.sequential_ms
        for name, q in quality.items():
            if q.note or q.top1 is None or name not in c.draft_ms:
                continue
            td = c.draft_ms[name]
            acc = acceptance.get(name)
            common = dict(plan=name, threads=c.threads, compiled=c.compiled, top1=q.top1, delta_ppl=q.delta_ppl,
                          s=c.sequential_ms / td, accept_alpha=acc.alpha if acc else None)
            if cfg.ssd:
                a = min(max(float(q.top1), 0.0), 1.0)
                for b in cfg.blocks:
                    iid = b + 1.0 if a >= 1.0 else (1.0 - a ** (b + 1)) / (1.0 - a)  # the paper's tokens/round
                    per_round = acc.tokens_per_round(b) if acc and acc.rounds else iid
                    tok_s = 1e3 * per_round / (b * td + c.verify_ms[b])  # B drafter steps + one verify per round
                    out.append(Candidate(goal="ssd", block=b, predicted_speedup=tok_s / seq_tok_s,
                                         predicted_tokens_per_s=tok_s, predicted_tokens_per_round=per_round,
                                         ideal_ssd_speedup=ideal_ssd_speedup(a, b, common["s"]), **common))
            if cfg.max_dppl is not None:
                out.append(Candidate(goal="snlp", block=None, predicted_speedup=common["s"],
                                     predicted_tokens_per_s=1e3 / td, predicted_tokens_per_round=None,
                                     within_budget=q.delta_ppl <= cfg.max_dppl, **common))
    return out


def shortlist(cands: list[Candidate], cfg: TuneConfig, blocks_per_plan: int = 2) -> None:
    """Mark the stage-2 shortlist, per goal: the cfg.top best (plan, setting) pairs by their best prediction
    among eligible candidates (SNLP: within the budget), plus the best pair of every (threads, compiled)
    setting, each at its `blocks_per_plan` best-predicted blocks. Distinct plans rather than the top rows: the
    model's errors are mostly per plan (its step cost s), its block-to-block differences small, and a plan's
    extra block costs one more decode per prompt in the stage-2 round-robin."""
    for goal in GOALS:
        ok = sorted((c for c in cands if c.goal == goal and c.within_budget), key=lambda c: -c.predicted_tokens_per_s)
        pairs = list(dict.fromkeys((c.plan, c.threads, c.compiled) for c in ok))  # best prediction first
        chosen = set(pairs[:cfg.top]) | {next(p for p in pairs if p[1:] == s) for s in {p[1:] for p in pairs}}
        for pair in chosen:
            for c in [c for c in ok if (c.plan, c.threads, c.compiled) == pair][:blocks_per_plan]:
                c.shortlisted = True


def measure_ssd(model: GPT, prompts: list[list[int]], cands: list[Candidate], cfg: TuneConfig,
                preheat: Preheat | None = None) -> None:
    """Stage 2, SSD: per (threads, compiled) setting, ONE side-by-side measurement of every candidate
    (snlp.decode.speculative.speculative_shootout: one sequential baseline, the candidates round-robin after it on
    every prompt, cfg.warmup untimed rounds, medians of cfg.repeats); fills the measured fields. One round-robin,
    not one benchmark per plan: the pick compares the candidates' speedups, and separate benchmarks, each against
    its own baseline taken minutes apart, let load drift between them decide it (a K = 2 drafter, s 1.27,
    was picked over K = 1, s 1.55, on one prompt and one round each)."""
    groups: dict[tuple, list[Candidate]] = {}
    for c in cands:
        groups.setdefault((c.threads, c.compiled), []).append(c)
    for (threads, compiled), cs in groups.items():
        with torch_threads(threads):
            rows, _ = speculative_shootout(model, prompts, [(c.plan, c.block) for c in cs], cfg.gen_tokens,
                                           repeats=cfg.repeats, warmup=cfg.warmup, compile=compiled, preheat=preheat,
                                           progress=cfg.progress)
        for c, r in zip(cs, rows):
            c.measured, c.measured_speedup, c.matches_sequential = True, r.measured_speedup, r.matches_sequential
            c.round_speedups, c.noise = list(r.round_speedups), round_noise(r.round_speedups)
            c.raw_tokens_per_s, c.sequential_tokens_per_s = 1e3 / r.speculative_ms_per_token, 1e3 / r.sequential_ms_per_token
            c.alpha, c.tokens_per_round, c.measured_s = r.alpha, r.tokens_per_round, r.drafter_speedup_s


def measure_snlp(model: GPT, prompts: list[list[int]], cands: list[Candidate], cfg: TuneConfig,
                 preheat: Preheat | None = None) -> None:
    """Stage 2, SNLP: per setting, KV-cached greedy snlp_generate of every candidate and sequential_generate,
    round-robin over the prompts (cfg.warmup untimed rounds, then cfg.repeats timed; steps built once)."""
    groups: dict[tuple, list[Candidate]] = {}
    for c in cands:
        groups.setdefault((c.threads, c.compiled), []).append(c)
    for (threads, compiled), cs in groups.items():
        with torch_threads(threads):
            seq = sequential_step(model, compiled)
            steps = {c.plan: snlp_step(bind(model, c.plan, check_finite=False,
                                            preheat=preheat_for(Plan.parse(c.plan), preheat)), compiled) for c in cs}
            run = {None: lambda p: sequential_generate(model, p, cfg.gen_tokens, step=seq)}
            run.update({k: (lambda k: lambda p: snlp_generate(model, p, k, cfg.gen_tokens, step=steps[k]))(k)
                        for k in steps})
            ms = {k: [] for k in run}  # per timed round: ms per token over all prompts
            for r in range(cfg.warmup + cfg.repeats):
                tot = {k: [0.0, 0] for k in run}
                for j, p in enumerate(prompts):
                    for k in round_order(run, r * len(prompts) + j):
                        res = run[k](p)
                        tot[k][0] += res.decode_s
                        tot[k][1] += len(res.tokens)
                if r >= cfg.warmup:
                    for k, (s, n) in tot.items():
                        ms[k].append(1e3 * s / max(n, 1))
        for c in cs:
            c.measured = True
            c.round_speedups = [a / b for a, b in zip(ms[None], ms[c.plan])]
            c.measured_speedup, c.noise = statistics.median(c.round_speedups), round_noise(c.round_speedups)
            c.raw_tokens_per_s = 1e3 / statistics.median(ms[c.plan])
            c.sequential_tokens_per_s = 1e3 / statistics.median(ms[None])


def _normalise(cands: list[Candidate]) -> None:
    """tokens_per_s = measured speedup x the median sequential tokens/s of the candidate's setting and goal."""
    ref: dict[tuple, list[float]] = {}
    for c in cands:
        if c.measured:
            ref.setdefault((c.goal, c.threads, c.compiled), []).append(c.sequential_tokens_per_s)
    for c in cands:
        if c.measured:
            c.tokens_per_s = c.measured_speedup * statistics.median(ref[(c.goal, c.threads, c.compiled)])


def round_noise(ratios) -> float | None:
    """The noise of a measured speedup from its own rounds: half the range of the per-round paired ratios over
    their median (a median of R rounds moves by about that much from one measurement to the next on a box whose
    load changes); None for one round (no estimate) or a non-finite ratio."""
    xs = list(ratios)
    if len(xs) < 2 or not all(math.isfinite(x) for x in xs):
        return None
    return (max(xs) - min(xs)) / (2 * statistics.median(xs))


def _finite(c: Candidate) -> bool:
    # every round too: statistics.median sorts a NaN round anywhere, so a finite median can hide it (and be wrong)
    return c.tokens_per_s is not None and math.isfinite(c.tokens_per_s) and math.isfinite(c.measured_speedup) \
        and all(math.isfinite(x) for x in c.round_speedups or [])


def _eligible(cands: list[Candidate]) -> list[Candidate]:
    return [c for c in cands if c.measured and c.within_budget and c.matches_sequential is not False and _finite(c)]


def _best(cands: list[Candidate]) -> Candidate | None:
    """The best measured candidate (exact, within budget, finite measurements)."""
    return max(_eligible(cands), key=lambda c: c.tokens_per_s, default=None)


def _name_of(c: Candidate, setting: bool = False) -> str:
    """The candidate's plan and block; its setting (threads, compiled) where asked or compiled."""
    return f"{c.plan}" + (f" B={c.block}" if c.block else "") + \
        (f" ({c.threads} thr{', compiled' if c.compiled else ''})" if setting or c.compiled else "")


def paired_rounds(a: Candidate, b: Candidate) -> list[float] | None:
    """a's speed over b's in every shootout round that timed both (one round-robin per (threads, compiled) setting
    and goal, each round's ratios over that round's sequential decode, so a round's load hits both alike); None
    where the two were not timed in the same rounds."""
    if (a.goal, a.threads, a.compiled) != (b.goal, b.threads, b.compiled) or not a.round_speedups \
            or not b.round_speedups or len(a.round_speedups) != len(b.round_speedups):
        return None
    return [x / y for x, y in zip(a.round_speedups, b.round_speedups) if y > 0]


def _leads(best: Candidate, c: Candidate) -> tuple[bool, str]:
    """(whether best's lead over c is resolved, how the rounds split). With paired rounds: the two-sided sign test
    at SIGN_LEVEL, the main table's rule for its Pareto front; without them: best's lead beyond the larger of the
    two noises (half the range of their per-round ratios; no estimate, one round: unresolved)."""
    ratios = paired_rounds(best, c)
    if ratios:
        wins, losses = sum(r > 1 for r in ratios), sum(r < 1 for r in ratios)
        return (wins > losses and sign_test_p(wins, losses) < SIGN_LEVEL,
                f"faster in {wins} of {len(ratios)} paired rounds")
    a, b = best.noise, c.noise
    if a is None or b is None:
        return False, "no noise estimate (one timed round)"
    lead = best.tokens_per_s / c.tokens_per_s - 1
    return lead > max(a, b), f"noise ±{max(a, b):.1%}"


def _rule(n: int) -> str:
    """The sign test's threshold at n paired rounds, in words."""
    if n == 1:
        return "one timed round: no sign test resolves a lead"
    k = sign_test_wins(n)
    test = f"a two-sided sign test at {SIGN_LEVEL:.0%} over the paired rounds"
    return (f"{test} resolves a lead from {k} of {n} rounds won" if k else
            f"under {test}, no split of {n} rounds resolves a lead")


def pick(cands: list[Candidate]) -> tuple[Candidate | None, str]:
    """(the pick among measured candidates, the rule that made it). The best measured wins where its lead over
    every other candidate is resolved by the rounds: the two-sided sign test at SIGN_LEVEL over the shootout's
    paired rounds (the main table's rule for its Pareto front), or, for candidates not timed in the same rounds,
    a lead beyond the larger noise of the two (half the range of their per-round ratios). The candidates it does
    not resolve tie with it, and among the tied the highest stage-1 prediction (predicted tokens/s: the acceptance
    profile and step timings, measured apart from the shootout) wins where it leads the others by more than
    PREDICTION_TIE; predictions within that tie too, and among them the highest measured median wins, then the
    plan's name, then the block. SNLP candidates: a tied one another tied one dominates by the table's medians
    (lower dPPL, as fast or faster: off its `P` front) is out of the tie first.
    Ineligible candidates (not exact, over the dPPL budget, non-finite measurements) never count."""
    ok = _eligible(cands)
    if not ok:
        return None, "no eligible measured candidate"
    # the best is the highest median among the candidates no other one resolves a lead over: a median of the
    # per-round ratios can be higher for the plan that lost most rounds that timed both (bimodal rounds: 5.0x in 11
    # of 20 rounds and 1.0x in 9 vs 6/4/2x, faster in 15 of 20), and the sign test then resolves the other one's
    # lead; taking the higher median there would print a lead the rounds resolve the other way and hand the tie to
    # it. Without such a candidate (leads that cycle) the highest median.
    top = sorted(ok, key=lambda c: -c.tokens_per_s)
    beaten = {id(c) for c in ok if any(_leads(d, c)[0] for d in ok if d is not c)}
    best = next((c for c in top if id(c) not in beaten), top[0])
    mixed = len({(c.threads, c.compiled) for c in ok}) > 1  # name the settings only where they differ

    def _name(c: Candidate) -> str:
        return _name_of(c, mixed)

    verdict = {id(c): _leads(best, c) for c in ok if c is not best}
    # a candidate another one beats is no tie with the best either (the tie goes to a prediction), unless every one is
    tied = [c for c in ok if c is best or not verdict[id(c)][0] and (id(c) not in beaten or id(best) in beaten)]
    ns = sorted({len(r) for c in ok if c is not best and (r := paired_rounds(best, c))})
    rule = "; ".join(_rule(n) for n in ns) or "no paired rounds: a lead must exceed the larger noise of the two"
    if len(tied) == 1:
        rest = sorted((c for c in ok if c is not best), key=lambda c: -c.tokens_per_s)
        if not rest:
            return best, f"the only measured candidate: {_name(best)} {best.measured_speedup:.3f}x"
        nxt = next((c for c in rest if verdict[id(c)][0]), rest[0])
        # the ones best does not beat itself are out because another candidate beats them: said, never a resolved lead
        others = [next(f"{_name(c)} (slower than {_name(d)}, {_leads(d, c)[1]})" for d in ok if d is not c
                       and _leads(d, c)[0]) for c in rest if not verdict[id(c)][0]]
        head = "best measured" if best is top[0] else f"best by the paired rounds (the higher median is {_name(top[0])}'s)"
        if not verdict[id(nxt)][0]:  # best resolves no lead itself: every other one is out because another beats it
            return best, (f"{head}: {_name(best)} {best.measured_speedup:.3f}x, the only candidate no other one beats "
                          f"in the paired rounds; it resolves no lead itself ({rule}), but every other is beaten by "
                          f"another: {', '.join(others)}")
        return best, (f"{head}: {_name(best)} {best.measured_speedup:.3f}x, "
                      f"{best.tokens_per_s / nxt.tokens_per_s - 1:+.1%} over the next ({_name(nxt)}), "
                      f"{verdict[id(nxt)][1]}, which the rounds resolve ({rule})"
                      + (f"; not told from it but beaten by another: {', '.join(others)}" if others else ""))
    # SNLP trades quality for speed: of candidates tied on speed, one another tied candidate beats on both axes by
    # the table's medians (lower dPPL, as fast or faster: off the `P` front the table prints) is out, so the pick is
    # never a plan the table shows dominated by one it could not tell apart in speed
    pool, out = tied, ""
    if all(c.goal == "snlp" for c in tied):
        front = _pareto(tied)
        if len(front) < len(tied):
            pool = [c for c in tied if id(c) in front]
            out = ("; off the tied candidates' Pareto front (another as fast by median with a lower dPPL), so out: "
                   + ", ".join(f"{_name(c)} (dPPL {dppl_cell(c.delta_ppl)})" for c in tied if id(c) not in front))
    # the highest prediction breaks the tie only where it is clear of the others by more than PREDICTION_TIE; the
    # predictions within it tie too, and the highest measured median among them (the table's order) picks
    top_pred = max(c.predicted_tokens_per_s for c in pool)
    close = sorted((c for c in pool if c.predicted_tokens_per_s >= (1 - PREDICTION_TIE) * top_pred),
                   key=lambda c: (-c.tokens_per_s, c.plan, c.block or 0))
    chosen = close[0]
    what = ", ".join(f"{_name(c)} {c.measured_speedup:.3f}x" + ("" if c.noise is None else f" ±{c.noise:.1%}")
                     for c in sorted(tied, key=lambda c: -c.tokens_per_s))
    # leads that cycle (every candidate beaten by another): best has the highest median only, and a tied candidate
    # may beat it in the paired rounds; that is said as resolved, never as best's unresolved lead
    rest = sorted((c for c in tied if c is not best), key=lambda c: -c.tokens_per_s)
    over = [c for c in rest if _leads(c, best)[0]]
    leads = ", ".join(f"{_name(c)} by {best.tokens_per_s / c.tokens_per_s - 1:+.1%} ({verdict[id(c)][1]})"
                      for c in rest if c not in over)
    cycle = ""
    if id(best) in beaten:
        cycle = ("the paired rounds cycle, every candidate beaten by another: " + ", ".join(
            next(f"{_name(d)} beats {_name(c)} ({_leads(d, c)[1]})" for d in ok if d is not c and _leads(d, c)[0])
            for c in top) + "; ")
    said = (f"the best measured ({_name(best)}) leads {leads}, which the rounds do not resolve" if leads else
            f"the highest median is {_name(best)}'s")
    said += "".join(f"; {_name(c)} beats it ({_leads(c, best)[1]}), which the rounds resolve" for c in over)
    rule += ")" + out  # the rule's parenthesis closes before the candidates the front leaves out
    if len(pool) == 1:
        return chosen, f"tie: {what}; {cycle}{said} ({rule}; the tie goes to the one left: {_name(chosen)}"
    if len(close) == 1:
        far = sorted((c for c in pool if c is not chosen), key=lambda c: -c.predicted_tokens_per_s)
        then = f"; the next, {_name(far[0])}, {far[0].predicted_speedup:.3f}x" if far else ""
        return chosen, (f"tie: {what}; {cycle}{said} ({rule}; the tie goes to the highest stage-1 prediction: "
                        f"{_name(chosen)} (predicted {chosen.predicted_speedup:.3f}x{then})")
    preds = ", ".join(f"{_name(c)} {c.predicted_speedup:.3f}x" for c in
                      sorted(close, key=lambda c: -c.predicted_tokens_per_s))
    return chosen, (f"tie: {what}; {cycle}{said} ({rule}; the tie goes to the highest stage-1 prediction, but the "
                    f"predictions tie too ({preds}: within {PREDICTION_TIE:.0%} of each other, inside the step "
                    f"timings' run-to-run noise), so to the highest measured median among them: {_name(chosen)}")


def tune(model: GPT, val_tokens, cfg: TuneConfig = TuneConfig(), quality: dict[str, PlanQuality] | None = None,
         preheat: Preheat | None = None, on_stage=None) -> TuneResult:
    """Choose the decoding plan for `model` on this machine by measurement (module docstring). `val_tokens`: the
    calibration token ids (1-D); `quality`: stage-1 agreement already measured (quality_from_records), else it is
    measured here; `preheat`: the calibration preheat plans read. `on_stage(stage1, done)`, if given, is called once
    stage 1 has run, with its results (config, n_layer, quality, acceptance, costs, every candidate predicted and
    shortlisted, stage1_s): what `snlp tune --json` keeps if stage 2 is cut short. No pick is made before stage 2:
    the pick is the best measured candidate."""
    cfg.check()
    # the window calibration really uses is the one the result records (a silent cap at the model's context kept the
    # flag's value in --json)
    if cfg.seq_len is None:
        cfg = replace(cfg, seq_len=min(256, model.config.sequence_len))
    L = model.config.n_layer
    w = next(model.parameters())
    plans = cfg.plan_list(L, preheat, w.device, w.dtype)
    with eval_mode(model):  # a caller's model leaves with every submodule in the mode it came in
        val = as_tokens(val_tokens)
        prompts = sample_prompts(val, cfg.prompts, cfg.prompt_len, cfg.seed)
        t0 = time.perf_counter()
        if quality is not None and any(str(p) not in quality for p in plans):
            raise ValueError(f"no calibration quality for plans {[str(p) for p in plans if str(p) not in quality]}")
        with torch_threads(cfg.settings()[0][0]):  # thread-independent, but never at an untried thread count
            quality = quality if quality is not None else calibration_quality(model, val, plans, cfg, preheat)
            quality = {str(p): quality[str(p)] for p in plans}
            usable = [p for p in plans if not quality[str(p)].note and quality[str(p)].top1 is not None]
            acceptance = measure_acceptance(model, sample_prompts(val, cfg.prompts, cfg.prompt_len, cfg.seed + 1),
                                            usable, cfg, preheat) if cfg.ssd and cfg.accept_tokens else {}
        costs = [measure_costs(model, usable, prompts[0], cfg, t, c, preheat) for t, c in cfg.settings()]
        cands = predict(quality, acceptance, costs, cfg)
        shortlist(cands, cfg)
        t1 = time.perf_counter()
        if on_stage is not None:
            on_stage({"config": cfg, "n_layer": L, "quality": list(quality.values()),
                      "acceptance": list(acceptance.values()), "costs": costs, "candidates": cands,
                      "stage1_s": t1 - t0},
                     "stage 1 (every candidate's prediction and the shortlist; stage 2, the measured table and the "
                     "pick, had not run)")
        todo = [c for c in cands if c.within_budget and (c.shortlisted or cfg.full_grid)]
        measure_ssd(model, prompts, [c for c in todo if c.goal == "ssd"], cfg, preheat)
        measure_snlp(model, prompts, [c for c in todo if c.goal == "snlp"], cfg, preheat)
        _normalise(cands)
        return _result(model, cfg, list(quality.values()), list(acceptance.values()), costs, cands, t1 - t0,
                       time.perf_counter() - t1)


def _result(model: GPT, cfg: TuneConfig, quality, acceptance, costs, cands, s1: float, s2: float) -> TuneResult:
    """Picks (`pick` over the shortlisted candidates of each goal, and its rule), grid bests and the notes a reader
    needs."""
    goals = [g for g in GOALS if (g == "ssd" and cfg.ssd) or (g == "snlp" and cfg.max_dppl is not None)]
    made = {g: pick([c for c in cands if c.goal == g and c.shortlisted]) for g in goals}
    picks, rules = {g: m[0] for g, m in made.items()}, {g: m[1] for g, m in made.items()}
    best = ratio = None  # the grid was not run: no validation to record
    if cfg.full_grid:
        best = {g: _best([c for c in cands if c.goal == g]) for g in goals}
        ratio = {g: picks[g].tokens_per_s / best[g].tokens_per_s if picks[g] and best[g] else None for g in goals}
    notes = [f"SSD candidate {c.plan} B={c.block} ({c.threads} thread{'s' if c.threads != 1 else ''}{', compiled' if c.compiled else ''}): output "
             f"differs from sequential (excluded)" for c in cands if c.goal == "ssd" and c.matches_sequential is False]
    notes += [f"{c.goal} candidate {_name_of(c, True)}: non-finite measurement (speedup {c.measured_speedup}, tokens/s "
              f"{c.tokens_per_s}, rounds {c.round_speedups}; excluded)" for c in cands if c.measured and not _finite(c)]
    # the sign test judges only candidates timed in the same rounds (one setting); across settings the noise rule
    # can resolve a lead from 2 rounds, so the note names the case the sign test alone decided
    paired = [g for g in goals if any(paired_rounds(a, b) for a, b in itertools.combinations(
        [c for c in cands if c.goal == g and c.measured], 2))]
    if cfg.repeats < fewest_sign_rounds() and paired:
        notes.append(f"stage 2 timed {cfg.repeats} round(s): the sign test over paired rounds resolves a lead from "
                     f"{fewest_sign_rounds()} rounds on, so {' and '.join(paired)} candidates timed in the same "
                     f"rounds tied, and the tie rule (pick_rule) picked among them")
    # options too short for what they measure: the rows would name a block their decodes never drafted
    empty = [a.plan for a in acceptance if not a.rounds]
    if empty:
        notes.append(f"stage 1: --accept-tokens {cfg.accept_tokens} leaves no round room for a full block of B = "
                     f"{max(cfg.blocks)} (it needs B + 1 tokens), so the acceptance profile of {', '.join(empty)} "
                     f"measured nothing and its SSD predictions use the Top-1 i.i.d. model instead")
    short = sorted({c.block for c in cands if c.goal == "ssd" and c.measured and c.block + 1 > cfg.gen_tokens})
    if short:
        notes.append(f"stage 2: --gen-tokens {cfg.gen_tokens} leaves no round room for a full block of B = "
                     f"{', '.join(map(str, short))} (a round drafts at most the tokens left - 1): those rows measured "
                     f"B = {max(cfg.gen_tokens - 1, 0)} at most")
    if "snlp" in goals and picks["snlp"] is None:
        notes.append(f"no plan within the budget dPPL <= {100 * cfg.max_dppl:.2f} %: decode sequentially")
    for g, p in picks.items():  # "slower than sequential" only where the pick's paired rounds resolve it
        if p is None or not p.measured or p.measured_speedup is None:
            continue
        verdict = paired_verdict(p.round_speedups or [])[0]
        if verdict == "slower":
            notes.append(f"{g}: the pick is slower than sequential decoding ({p.measured_speedup:.2f}x, "
                         f"{verdict_text(p.round_speedups, rounds='rounds')}): decode sequentially on this machine")
        elif verdict == "tie" and p.measured_speedup < 1.0:
            notes.append(f"{g}: the pick measured {p.measured_speedup:.2f}x sequential decoding, "
                         f"{verdict_text(p.round_speedups or [], rounds='rounds')}: this run shows no gain over "
                         f"decoding sequentially")
    p = next(model.parameters())
    return TuneResult(config=cfg, n_layer=model.config.n_layer, device=str(p.device),
                      dtype=str(p.dtype).replace("torch.", ""), quality=quality, acceptance=acceptance, costs=costs, candidates=cands,
                      picks=picks, grid_best=best, pick_vs_best=ratio, notes=notes, stage1_s=s1, stage2_s=s2,
                      pick_rule=rules, pick_tie={g: r.startswith("tie:") for g, r in rules.items()})


def _none(x) -> bool:
    """A value the table has not got: None, or NaN (what snlp.runtime.fmt also reads as missing)."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def _f(x, fmt: str) -> str:
    return "–" if _none(x) else format(x, fmt)


def _share(x) -> str:
    """A Top-1 or acceptance cell: fmt_fraction's digits, and the table's own "–" where there is none (an SNLP
    candidate has no acceptance; fmt_fraction's missing mark is the reports' "-")."""
    return "–" if _none(x) else fmt_fraction(x)


def table(result: TuneResult, goal: str, measured_only: bool = True) -> list[str]:
    """The markdown table of one goal, measured rows by measured tokens/s (best first), then (unless
    `measured_only`) the predicted-only rows: `>` marks the pick, `*` the shortlist, `P` the SNLP Pareto front
    over (dPPL, measured tokens/s); noise = half the range of the per-round ratios (round_noise). A `meas x` its
    paired rounds do not tell from 1.00x by the sign test is marked "(tie)", and the footnote under the table says
    the rule (the other tables' tie_mark / tie_footnote): a ratio inside the noise is never printed as a gain."""
    rows = [c for c in result.candidates if c.goal == goal and (c.measured or not measured_only)]
    rows.sort(key=lambda c: (not c.measured, -(c.tokens_per_s or 0.0), -c.predicted_tokens_per_s))
    front = _pareto([c for c in rows if c.measured]) if goal == "snlp" else set()
    pick = result.picks.get(goal)
    cols = ["", "plan", "B", "thr", "comp", "Top-1", "dPPL", "s", "paper ideal", "calib alpha", "pred tok/rnd",
            "pred x", "pred tok/s", "meas s", "meas x", "noise", "tok/s", "alpha", "meas tok/rnd", "= seq"]
    body = [[("> " if c is pick else "") + ("*" if c.shortlisted else "") + ("P" if id(c) in front else ""),
             f"`{c.plan}`", _f(c.block, "d"), str(c.threads), "yes" if c.compiled else "no", _share(c.top1),
             dppl_cell(c.delta_ppl), _f(c.s, ".2f"), _f(c.ideal_ssd_speedup, ".2f"), _share(c.accept_alpha),
             _f(c.predicted_tokens_per_round, ".2f"), _f(c.predicted_speedup, ".2f"),
             _f(c.predicted_tokens_per_s, ".0f"),
             _f(c.measured_s, ".2f"), _f(c.measured_speedup, ".2f") + tie_mark(c.round_speedups),
             "–" if _none(c.noise) else f"±{c.noise:.1%}",
             _f(c.tokens_per_s, ".0f"), _share(c.alpha),
             _f(c.tokens_per_round, ".2f"), {None: "–", True: "yes", False: "NO"}[c.matches_sequential]] for c in rows]
    lines = markdown_table(cols, body)
    if any(c.measured and c.round_speedups and paired_verdict(c.round_speedups)[0] == "tie" for c in rows):
        # meas x is the median of the paired ratios (measure_ssd / measure_snlp), not a ratio of two medians
        lines.append(tie_footnote(result.config.repeats, "meas x", "sequential ms/token over this candidate's in the "
                                  "same round, every prompt decoded by both", of_medians=False))
    return lines


def dppl_cell(d: float) -> str:
    """A dPPL cell: two decimals of a percent, where a budget such as 1 % is read, and above +1000 % or diverged
    the other tables' form (snlp.runtime.fmt.fmt_delta_ppl: '×1.3e7', 'diverged'), not '+1318860828.90%'; none
    (None, NaN): the table's own "–", not fmt_delta_ppl's "-"."""
    if _none(d):
        return "–"
    return f"{100 * d:+.2f}%" if math.isfinite(d) and d <= DELTA_RATIO else fmt_delta_ppl(d)


def _pareto(rows: list[Candidate]) -> set[int]:
    """ids of the rows no other row beats on both dPPL (lower) and measured tokens/s (higher)."""
    return {id(c) for c in rows if not any(o.delta_ppl <= c.delta_ppl and o.tokens_per_s >= c.tokens_per_s and
                                           (o.delta_ppl, o.tokens_per_s) != (c.delta_ppl, c.tokens_per_s) for o in rows)}


def summary(result: TuneResult) -> list[str]:
    """One line per goal: the pick, predicted vs measured, and how far from the grid's best (full grid; else the
    line says the validation was not run)."""
    out = []
    for g, p in result.picks.items():
        if p is None:
            out.append(f"{g}: no pick")
            continue
        what = (f"`{p.plan}`" + (f" B={p.block}" if p.block else "") + f", {p.threads} thread"
                + ("s" if p.threads != 1 else "") + (", compiled" if p.compiled else ""))
        # a ratio its paired rounds do not resolve says so where it is printed, not only in a note further down
        tie = bool(p.round_speedups) and paired_verdict(p.round_speedups)[0] == "tie"
        # tokens_per_s is not a rate any run had: the measured speedup times the setting's median sequential rate
        # (_normalise, so candidates whose rounds ran under other loads compare on one baseline); the sentence says
        # so, with the pick's own median beside it
        line = (f"{g} pick: {what}: measured {p.measured_speedup:.2f}x sequential"
                + (f" ({verdict_text(p.round_speedups, rounds='rounds')})" if tie else "")
                + f", i.e. {p.tokens_per_s:.0f} tok/s at its setting's median sequential "
                f"{p.tokens_per_s / p.measured_speedup:.0f} tok/s"
                + (f" (its own runs' median: {p.raw_tokens_per_s:.0f} tok/s)" if p.raw_tokens_per_s is not None else "")
                + f"; predicted {p.predicted_speedup:.2f}x; {result.pick_rule.get(g, '')}")
        if result.grid_best is None:
            line += "; full-grid validation: not run (--full-grid)"
        elif (b := result.grid_best[g]) is not None:
            line += f"; best of the measured grid (highest median): `{b.plan}`" + (f" B={b.block}" if b.block else "") \
                + f" {b.tokens_per_s:.0f} tok/s at its setting's median sequential; pick / best = " \
                f"{result.pick_vs_best[g]:.3f}"
            if b is not p:  # a ratio under 1 is a loss only where the rounds resolve the grid best's lead
                resolved, how = _leads(b, p)
                line += f" ({'resolved' if resolved else 'a tie'}: the grid best {how})"
        out.append(line)
    return out + result.notes

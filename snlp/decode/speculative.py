"""Self-speculative decoding (paper, "Self-speculative decoding"): the SNLP forward drafts B tokens, the
sequential model verifies the B+1 positions in ONE cached forward; greedy output is identical to sequential
decoding, sampling keeps the model's distribution. Also the ideal SSD speedup and the side-by-side benchmark
against sequential decoding (typed rows, `SSDRow`)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import Tensor

from snlp.decode.batch import BatchSession, check_batch_plan, check_decode_inputs, is_batch
from snlp.decode.penalty import RepetitionPenalty, check_repetition_penalty, pick_penalised
from snlp.decode.generate import sequential_generate
from snlp.decode.session import (NONFINITE, GenerateResult, Sampling, check_decode_args, check_picked,
                                 decode_plan, merge_results, sampling, sequential_forward, snlp_forward, step_slack)
from snlp.decode.steps import EagerStep, Step
from snlp.method.drafter import Drafter
from snlp.method.plan import Plan
from snlp.method.preheat import Preheat
from snlp.method.solver import preheat_for
from snlp.model.cache import RowPositions
from snlp.model.gpt import GPT
from snlp.runtime.checks import check_bools
from snlp.runtime.device import progress_bar
from snlp.runtime.timing import between, mark, round_order


def ideal_ssd_speedup(alpha: float, block: int, s: float) -> float:
    """The paper's ideal self-speculative speedup ((1 - a^(B+1)) / (1 - a)) / (B / s + 1): expected
    tokens per round over the cost of B drafter steps (each 1/s of a sequential step) plus one
    verifier step. alpha in [0, 1] (per-draft acceptance), block B >= 1, drafter speedup s > 0.
    Not the layer-step ideal of a plan (Plan.ideal_speedup, `ideal_layer_speedup` in records)."""
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"acceptance rate alpha must lie in [0, 1] (got {alpha!r})")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"draft block size B must be an integer >= 1 (got {block!r})")
    if not (isinstance(s, (int, float)) and 0.0 < s < float("inf")):
        raise ValueError(f"drafter speedup s must be a finite number > 0 (got {s!r})")
    per_round = block + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (block + 1)) / (1.0 - alpha)
    return per_round / (block / s + 1.0)


def max_tokens_per_round(tokens: int, block: int) -> float:
    """The most tokens per round a decode of `tokens` new tokens can average at draft block B (every draft
    accepted): a round keeps min(B + 1, tokens left) tokens (it drafts at most tokens left - 1), so the decode takes
    ceil(tokens / (B + 1)) rounds and its last one is cut short unless B + 1 divides `tokens` (16 tokens at B = 4:
    4 rounds, 4.0 per round, not 5)."""
    if tokens < 1 or block < 1:
        raise ValueError(f"tokens and block must be >= 1 (got {tokens}, {block})")
    return tokens / -(-tokens // (block + 1))


@dataclass
class SpeculativeReport:
    """Measured vs ideal speedup of one speculative run over one sequential run of the same model (ms are
    per decode step or per emitted token; `drafter_speedup_s` is the s of `ideal_ssd_speedup`)."""

    plan: str | None
    block: int
    alpha: float
    tokens_per_round: float
    drafter_speedup_s: float
    sequential_ms_per_step: float
    drafter_ms_per_step: float
    sequential_ms_per_token: float
    speculative_ms_per_token: float
    measured_speedup: float
    ideal_ssd_speedup: float

    def to_dict(self) -> dict:
        return asdict(self)


def speculative_report(spec: GenerateResult, seq: GenerateResult) -> SpeculativeReport:
    """Measured vs ideal speedup of a speculative run over a sequential run of the same model.

    s compares the sequential run's mean time per single-token decode step with the drafter's mean time per step,
    both cached single-token forwards with their next-token pick, per-token bookkeeping and streaming outside both,
    each as its loop runs it. On the CPU both are timed around each step. Off the CPU the sequential loop queues
    `read_every` steps per read (its step time: the host clock over the queued steps and their read); a greedy
    round's drafter steps are timed by CUDA events, with no wait between them, while a sampled round's or a
    `min_confidence` round's drafter steps each wait for their read, and s there prices those waits against the
    drafter. The measured speedup is end to end: sequential decode time per token over speculative
    decode time per token (prefill excluded from both)."""
    seq_ms = 1e3 * seq.decode_s / max(len(seq.tokens), 1)
    s = seq.ms_per_step / spec.draft_ms_per_step if spec.draft_steps and seq.steps else float("nan")
    a = spec.acceptance_rate
    return SpeculativeReport(
        plan=spec.plan, block=spec.block, alpha=a, tokens_per_round=spec.tokens_per_round, drafter_speedup_s=s,
        sequential_ms_per_step=seq.ms_per_step, drafter_ms_per_step=spec.draft_ms_per_step,
        sequential_ms_per_token=seq_ms, speculative_ms_per_token=1e3 * spec.decode_s / max(len(spec.tokens), 1),
        measured_speedup=spec.tokens_per_s / seq.tokens_per_s,
        ideal_ssd_speedup=ideal_ssd_speedup(a, spec.block, s) if a == a and s == s else float("nan"))


@dataclass
class SSDRow(SpeculativeReport):
    """One block size of `speculative_benchmark` (one case of `speculative_shootout`): the medians over the timed
    rounds of each report field, the ideal SSD speedup of the median alpha and s, and how the rounds were run.

    `measured_speedup` is the median over the rounds of each round's PAIRED ratio, sequential over speculative
    ms per token of that round (the two sides ran interleaved on the same prompts, so load drift between rounds
    cancels); the per-round ratios are `round_speedups`. `sequential_ms_per_token` / `speculative_ms_per_token`
    are the medians of each side over the rounds, taken separately: their ratio equals `measured_speedup` only
    when the load did not drift between rounds. Compile time (compiled steps, never inside a timing):
    `compile_s` is what this row's own calls compiled (its verifier shape at B + 1, and its drafter's graphs when
    it was the first row to run that drafter); `shared_compile_s` is the sequential baseline's, the same in every
    row of one measurement (count it once)."""

    # every speculative output equalled the sequential one, every round: the exactness check of greedy runs; None for
    # sampled runs (each side draws its own tokens, the same law but not the same draws: nothing to compare)
    matches_sequential: bool | None = True
    repeats: int = 0
    prompts: int = 0
    gen_tokens: int = 0
    compiled: bool = False
    compile_s: float = 0.0
    shared_compile_s: float = 0.0
    round_speedups: list[float] = field(default_factory=list)


_MEDIAN_FIELDS = ("alpha", "tokens_per_round", "drafter_speedup_s", "sequential_ms_per_step", "drafter_ms_per_step",
                  "sequential_ms_per_token", "speculative_ms_per_token", "measured_speedup")


def speculative_benchmark(model: GPT, prompts: list, plan: Plan | str, blocks=(4,), max_new_tokens: int = 64,
                          repeats: int = 3, warmup: int = 1, temperature: float = 0.0, seed: int | None = None,
                          eos_id: int | list[int] | None = None, progress: bool = False, compile: bool = False,
                          preheat: Preheat | None = None, share_weights: bool = False, min_confidence: float = 0.0,
                          adaptive: bool = False, drafter: Drafter | None = None, top_k: int = 0,
                          top_p: float = 1.0, repetition_penalty: float = 1.0
                          ) -> tuple[list[SSDRow], list[list[int]]]:
    """Self-speculative decoding with drafter `plan` at each block size B vs sequential decoding,
    measured side by side in this process: `warmup` untimed rounds (both sides, every B, first
    prompt), then `repeats` timed rounds, each decoding every prompt sequentially and at each B
    (interleaved, so load drift hits every row alike, in an order rotated prompt by prompt:
    snlp.runtime.timing.round_order). Per round the counters are summed over the
    prompts and `speculative_report` taken; each row (one per B) holds the medians over the rounds,
    the ideal SSD speedup of the median alpha and s, and `matches_sequential` (every speculative
    output equals the sequential one, every round). Returns (rows, sequential tokens per prompt).
    `compile`: both sides run compiled static-shape steps (snlp.decode.steps), built once here and shared by every
    run (compiled during the warm-up; rows carry `compile_s` and `shared_compile_s`, SSDRow). `speculative_shootout` measures several drafters
    in the same way, against one sequential baseline. `top_k` / `top_p`: both sides sample from the filtered
    distribution (snlp.decode.session.Sampling). `seed` (sampling only; None: 0, so a benchmark repeats its draws):
    both sides draw from it, a batch's row i from seed + i. `repetition_penalty`: both sides apply it
    (snlp.decode.penalty), so `matches_sequential` compares like with like."""
    plan = decode_plan(model, plan)
    check_repetition_penalty(repetition_penalty)
    check_bools(progress=progress, compile=compile, share_weights=share_weights, adaptive=adaptive)
    sampling(temperature, top_k, top_p, seed)  # refused before any step is built
    seed = 0 if seed is None and temperature > 0 else seed
    blocks = tuple(blocks)
    if not blocks:
        raise ValueError("speculative_benchmark needs at least one block size")
    draft_model = model if drafter is None else drafter_model_for(model, plan, drafter, share_weights, True)
    seq_step = sequential_forward(model, compile)
    draft_step = snlp_forward(draft_model, plan, compile, preheat=preheat, share_weights=share_weights)
    spec_kw = dict(min_confidence=min_confidence, adaptive=adaptive)
    return _side_by_side(model, prompts, [(plan, b, draft_step) for b in blocks], seq_step, max_new_tokens, repeats,
                         warmup, temperature, seed, eos_id, progress, compile, spec_kw, top_k, top_p,
                         repetition_penalty)


def speculative_shootout(model: GPT, prompts: list, cases, max_new_tokens: int = 64, repeats: int = 3,
                         warmup: int = 1, eos_id: int | list[int] | None = None, progress: bool = False,
                         compile: bool = False,
                         preheat: Preheat | None = None) -> tuple[list[SSDRow], list[list[int]]]:
    """Several greedy drafters, `cases` = [(plan, B), ...], measured against ONE sequential baseline in ONE
    round-robin (the protocol of `speculative_benchmark`): per timed round every prompt is decoded sequentially
    and by every case, the baseline and the cases in an order rotated prompt by prompt across the rounds
    (snlp.runtime.timing.round_order: over all the timed prompts the baseline and every case run at every
    position, first included, as often as any other, give or take one, whatever the number of cases, prompts and
    rounds);
    per round and case the counters are summed over the prompts; each row holds the medians over the rounds. So
    load drift hits every drafter alike and their measured speedups compare (`snlp tune` picks among them by
    it): one benchmark per drafter, one after another, compared each against its own baseline taken at another
    moment. Each plan's drafter step is built once (shared by its blocks); `preheat` goes to the plans that read
    it. Returns (rows in the order of `cases`, sequential tokens per prompt)."""
    check_bools(progress=progress, compile=compile)
    cases = [(decode_plan(model, p), b) for p, b in cases]
    if not cases:
        raise ValueError("speculative_shootout needs at least one (plan, block) case")
    seq_step = sequential_forward(model, compile)
    steps = {}
    for plan, _ in cases:
        if str(plan) not in steps:
            steps[str(plan)] = snlp_forward(model, plan, compile, preheat=preheat_for(plan, preheat))
    return _side_by_side(model, prompts, [(p, b, steps[str(p)]) for p, b in cases], seq_step, max_new_tokens,
                         repeats, warmup, 0.0, None, eos_id, progress, compile, {})


def _side_by_side(model: GPT, prompts: list, cases: list, seq_step, max_new_tokens: int, repeats: int, warmup: int,
                  temperature: float, seed: int | None, eos_id: int | list[int] | None, progress: bool, compile: bool,
                  spec_kw: dict, top_k: int = 0, top_p: float = 1.0,
                  repetition_penalty: float = 1.0) -> tuple[list[SSDRow], list[list[int]]]:
    """The measurement of speculative_benchmark / speculative_shootout: `cases` (plan, B, drafter step) against
    the sequential `seq_step`, warm-up, then round-robin timed rounds (their docstrings). Compile time is
    attributed call by call: what the steps compiled during a sequential call is shared, during a case's call
    that case's own."""
    if not prompts:
        raise ValueError("speculative_benchmark needs at least one prompt")
    for _, b, _ in cases:
        check_decode_args(max_new_tokens, temperature, b)
    if not isinstance(repeats, int) or repeats < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0 (got repeats={repeats!r}, warmup={warmup!r})")
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, eos_id=eos_id, top_k=top_k,
              top_p=top_p, repetition_penalty=repetition_penalty)
    seq_kw = dict(kw, step=seq_step)
    n = len(cases)
    steps = [seq_step] + list({id(st): st for _, _, st in cases}.values())
    shared, own = [0.0], [0.0] * n

    def compiled() -> float:
        return sum(st.compile_s for st in steps)

    def seq(p):
        c = compiled()
        res = sequential_generate(model, p, **seq_kw)
        shared[0] += compiled() - c
        return res

    def spec(i: int, p):
        plan, b, step = cases[i]
        c = compiled()
        res = speculative_generate(model, p, plan, block=b, draft=step, verify=seq_step, **kw, **spec_kw)
        own[i] += compiled() - c
        return res

    for _ in range(warmup):  # allocator, kernels, fused weights, compiled graphs: both sides
        seq(prompts[0])
        for i in range(n):
            spec(i, prompts[0])
    reports: list[list[SpeculativeReport]] = [[] for _ in cases]
    matches = [True] * n
    label = ", ".join(f"{p} B={b}" for p, b, _ in cases)
    with progress_bar(repeats * len(prompts), f"SSD {label}", progress) as bar:
        for r in range(repeats):
            seq_runs, spec_runs = [], [[] for _ in cases]
            for j, p in enumerate(prompts):
                for i in round_order(range(-1, n), r * len(prompts) + j):  # -1: the sequential baseline
                    if i < 0:
                        seq_runs.append(seq(p))
                    else:
                        spec_runs[i].append(spec(i, p))
                bar.update()
            seq_res = merge_results(seq_runs)
            for i in range(n):
                reports[i].append(speculative_report(merge_results(spec_runs[i]), seq_res))
                matches[i] &= all(x.tokens == y.tokens for x, y in zip(spec_runs[i], seq_runs))
    rows = []
    for i, (plan, b, step) in enumerate(cases):
        med = {k: statistics.median(getattr(x, k) for x in reports[i]) for k in _MEDIAN_FIELDS}
        for k in ("alpha", "drafter_speedup_s", "drafter_ms_per_step"):  # no draft in any round (one new token, the
            if med[k] != med[k]:  # prefill's; or EOS first): not measured, None (null in JSON), never NaN
                med[k] = None
        a, s = med["alpha"], med["drafter_speedup_s"]
        rows.append(SSDRow(plan=str(plan), block=b, **med,
                           ideal_ssd_speedup=None if a is None or s is None else ideal_ssd_speedup(a, b, s),
                           matches_sequential=matches[i] if temperature == 0 else None, repeats=repeats,
                           prompts=len(prompts),
                           gen_tokens=max_new_tokens, compiled=compile, compile_s=own[i], shared_compile_s=shared[0],
                           round_speedups=[x.measured_speedup for x in reports[i]]))
    return rows, [x.tokens for x in seq_runs]


def drafter_model_for(model: GPT, plan: Plan, drafter: Drafter, share_weights: bool, verify_weights: bool) -> GPT:
    """The module an adapted `drafter` drafts with, after checking it belongs to `model` and fits `plan`."""
    if not isinstance(drafter, Drafter):
        raise ValueError(f"drafter must be a snlp.method.drafter.Drafter (got {type(drafter).__name__} "
                         f"{str(drafter)[:80]!r}); a drafter folder written by `snlp adapt` loads with "
                         f"snlp.io.drafter.load_drafter(path, model)")
    if share_weights:
        raise ValueError("share_weights makes the drafter's stacks the verifier's own layers; an adapted drafter has "
                         "its own suffix weights: drop share_weights or the drafter")
    drafter.check(model, verify_weights)
    drafter.check_plan(plan)
    return drafter.model


def speculative_accept(p: Tensor, q: Tensor, drafts: Tensor,
                       gen: torch.Generator | list[torch.Generator] | None = None,
                       lengths: list[int] | None = None) -> tuple[Tensor, Tensor]:
    """Speculative rejection sampling (Leviathan et al. 2023), vectorised over a leading dim N.

    p (N, B+1, V) target probabilities at the B+1 verified positions, q (N, B, V) the drafter's,
    drafts (N, B) tokens sampled from q. Draft i is accepted with probability min(1, p_i(d)/q_i(d));
    at the first rejection n the next token is drawn from norm(max(0, p_n - q_n)), and if all B are
    accepted from p_B. Returns n (N,) accepted drafts and the next token (N,): the emitted tokens
    d_1..d_n, token are distributed exactly as sampling from p one token at a time. Nothing is read back.

    `gen`: one generator for every row, or a list of N, row r drawing its B_r uniforms and then its token from
    its own (so a row's draws do not depend on the rows beside it). `lengths`: row r drafted only its first
    B_r = lengths[r] tokens (default B); its later drafts and q are ignored and its bonus token comes from p_{B_r}."""
    N, B1, V = p.shape
    B = B1 - 1
    lengths = [B] * N if lengths is None else lengths
    if isinstance(gen, (list, tuple)):  # row r's own B_r uniforms, in the order a row-at-a-time call draws them
        u = torch.cat([torch.cat([torch.rand(1, b, generator=g, device=p.device, dtype=p.dtype),
                                  p.new_full((1, B - b), torch.inf)], 1) for g, b in zip(gen, lengths)])  # (N, B)
    else:
        u = torch.rand(N, B, generator=gen, device=p.device, dtype=p.dtype)
        if min(lengths, default=B) < B:
            u = torch.where(torch.arange(B, device=p.device) < torch.tensor(lengths, device=p.device)[:, None], u,
                            torch.inf)
    # u is inf past a row's drafts: never accepted there (inf * q is not < p), and q there is not the drafter's
    drafted = torch.isfinite(u)  # (N, B)
    pd = p[:, :B].gather(-1, drafts[..., None])[..., 0]  # (N, B)
    qd = q.gather(-1, drafts[..., None])[..., 0]
    ok = drafted & (u * qd < pd)  # u < p/q without dividing by a zero q
    n = ok.long().cumprod(-1).sum(-1)  # (N,) leading accepts
    q_pad = torch.cat([torch.where(drafted[..., None], q, 0.0), torch.zeros_like(p[:, :1])], 1)  # q_{B_r} = 0:
    rows = torch.arange(N, device=p.device)  # the bonus draws from p_{B_r}
    resid = (p[rows, n] - q_pad[rows, n]).clamp_min(0)  # (N, V)
    empty = resid.sum(-1, keepdim=True) <= 0  # p_n == q_n (cannot reject there), guard anyway
    resid = torch.where(empty, p[rows, n], resid)
    if not isinstance(gen, (list, tuple)):
        return n, torch.multinomial(resid, 1, generator=gen)[:, 0]
    return n, torch.cat([torch.multinomial(resid[r:r + 1], 1, generator=g)[:, 0] for r, g in enumerate(gen)])


def speculative_generate(model: GPT, prompt_ids, plan: Plan | str, block: int = 4, max_new_tokens: int = 64,
                         temperature: float = 0.0, eos_id: int | list[int] | None = None, seed: int | None = None,
                         max_len: int | None = None, on_tokens: Callable[[list[int]], bool | None] | None = None,
                         compile: bool = False, draft: Step | EagerStep | None = None,
                         verify: Step | EagerStep | None = None, preheat: Preheat | None = None,
                         share_weights: bool = False, min_confidence: float = 0.0, adaptive: bool = False,
                         drafter: Drafter | None = None, top_k: int = 0, top_p: float = 1.0,
                         repetition_penalty: float = 1.0) -> GenerateResult | list[GenerateResult]:
    """Self-speculative decoding: the SNLP forward of `plan` drafts `block` tokens autoregressively
    (cached), the sequential model scores the B+1 positions in one cached forward, the longest
    agreeing prefix plus one verifier token is kept and the cache is rolled back past the rejection.

    Drafter and verifier share ONE KV cache: the verifier rewrites every verified position with exact
    K/V, so the drafter always conditions on the exact history (snlp.model.cache). Greedy (temperature 0)
    output equals `sequential_generate`; with temperature > 0 rejection sampling keeps the model's
    distribution. Note: the verifier scores B+1 positions in one forward, so in low precision its
    logits may differ from one-token steps by rounding (near-ties can flip; float64 is exact).
    `compile`: drafter and verifier run as compiled static-shape steps (snlp.decode.steps; the verifier always
    scores B+1 positions, a short last round padded); `draft` / `verify` pass prebuilt ones (`verify` this model's
    sequential step, `draft` an SNLP step of `plan`; others are refused). `share_weights`
    (M = 1 plans): the drafter's stacked weights and the verifier's layers are one storage (snlp.method.sharing:
    the model's suffix parameters are moved into the drafter's stacks, values unchanged), so each weight byte
    is streamed once. `min_confidence` (adaptive drafting, SWIFT/Kangaroo-style): a round stops drafting after
    a draft whose drafter probability (its top-1 probability when greedy, the sampled token's when sampling)
    is below it, so drafts that are likely rejected cost no drafter steps; 0 drafts the whole block. Exact by
    construction: the verifier checks whatever was drafted (the first draft of a round is always made).
    `adaptive`: the block adapts to the running acceptance rate (`AdaptiveBlock`; `block` is then the largest
    draft length), exact by construction likewise.

    A list of prompts (or a (B, T) tensor, B > 1) is decoded as one ragged batch (snlp.decode.batch) and returns
    one GenerateResult per prompt: every row drafts, accepts and rolls back on its own; `on_tokens(i, new)` then
    streams prompt i's tokens; greedy rows equal their own single-prompt (= sequential) outputs.

    `drafter` (snlp.method.drafter, `snlp adapt`): an adapted drafter of `model` drafts instead of the model's own
    SNLP forward (its prefix is the model's, its suffix adapted; checked against the model's weights fingerprint
    unless a prebuilt `draft` step is passed); `model` still verifies, so the output is the model's own.

    `top_k` / `top_p` (sampling): the model's distribution filtered as in `sequential_generate`
    (snlp.decode.session.Sampling); the drafter's is filtered alike, and rejection sampling keeps the filtered law.

    `repetition_penalty` (as in `sequential_generate`): the verifier's distribution at draft position i is penalised
    by the prompt, the tokens kept so far and the drafts before i, so the output is still the model's own penalised
    decoding (greedy: `sequential_generate(repetition_penalty=p)`'s tokens); the drafter is penalised alike, which
    only serves acceptance."""
    check_bools(compile=compile, share_weights=share_weights, adaptive=adaptive)
    check_decode_args(max_new_tokens, temperature, block)
    how = sampling(temperature, top_k, top_p, seed)
    penalty = check_repetition_penalty(repetition_penalty)
    if not 0.0 <= min_confidence <= 1.0:
        raise ValueError(f"min_confidence must lie in [0, 1], a probability (got {min_confidence!r})")
    plan = decode_plan(model, plan)
    check_decode_inputs(model, prompt_ids, max_new_tokens, max_len, eos_id, plan, one_row_single=True,
                        on_tokens=on_tokens, seed=seed)
    draft_model = model if drafter is None else drafter_model_for(model, plan, drafter, share_weights, draft is None)
    # a prebuilt drafter may be any module's (exact either way), but of this plan (the result is labelled with it); the
    # verifier must be this model's own sequential forward: the output is its
    draft_fwd = snlp_forward(draft_model, plan, compile, draft, preheat, share_weights, name="draft", same_model=False)
    verify_fwd = sequential_forward(model, compile, verify, name="verify")
    if is_batch(prompt_ids):
        return _speculative_rows(model, prompt_ids, plan, draft_fwd, verify_fwd, block, max_new_tokens, how,
                                 eos_id, seed, max_len, on_tokens, min_confidence, adaptive, penalty)
    # one prompt: the same round as a batch, run as a batch of one (BatchSession.plain: the plain cached forwards
    # of the single-prompt path, no masks), so every fix to the round lands once
    stream = None if on_tokens is None else (lambda i, new: on_tokens(new))
    res = _speculative_rows(model, [prompt_ids], plan, draft_fwd, verify_fwd, block, max_new_tokens, how,
                            eos_id, seed, max_len, stream, min_confidence, adaptive, penalty)[0]
    res.extra.pop("batch", None)
    return res


class AdaptiveBlock:
    """Adaptive draft length: before each round, every row drafts the block 1..max_block that maximises
    its expected tokens per unit of time, ideal_ssd_speedup(alpha_i, B, s), at its running acceptance rate alpha_i
    and the measured cost ratio s = verifier forward / drafter step of THIS run (decayed means of the timed rounds;
    sampling: the plan's ideal ratio `cost_ratio`, so a seeded run does not depend on the clock). alpha_i = (acc +
    1) / (exam + 1) over decayed counts of its accepted / examined drafts (decay 0.9 per round: about the last 10
    rounds, so it follows changes in how predictable the text is); the prior is one accepted draft, optimistic like
    the first round, which drafts max_block. (A uniform prior, (acc + 1) / (exam + 2), with a shorter memory caps
    the estimate near 0.94 even when every draft is accepted and, measured on the speedrun model (alpha 0.96-1.0, s
    1.7), settled on B = 2-3 and lost to the fixed B = 4.) In a batch a greedy round drafts the largest of the live
    rows' blocks for every row (a batched drafter step costs the same whatever the rows want); a sampled round
    drafts each row's own block (its draws then do not depend on the batch). Exact by construction: only how many
    tokens are drafted changes; the verifier checks whatever was drafted."""

    def __init__(self, max_block: int, rows: int = 1, decay: float = 0.9, cost_ratio: float | None = None):
        self.max_block, self.decay, self.cost_ratio = max_block, decay, cost_ratio
        self.acc, self.exam = [0.0] * rows, [0.0] * rows
        self.t_draft = self.t_verify = 0.0  # decayed sums of seconds and of counts (steps / rounds)
        self.n_draft = self.n_verify = 0.0

    def block(self, i: int = 0) -> int:
        if self.cost_ratio is None and (not self.n_draft or not self.n_verify or not self.t_draft):
            return self.max_block
        alpha = (self.acc[i] + 1.0) / (self.exam[i] + 1.0)
        s = self.cost_ratio or (self.t_verify / self.n_verify) / (self.t_draft / self.n_draft)
        return max(range(1, self.max_block + 1), key=lambda b: (ideal_ssd_speedup(alpha, b, s), -b))

    def update(self, i: int, drafted: int, accepted: int) -> None:
        self.acc[i] = self.decay * self.acc[i] + accepted
        self.exam[i] = self.decay * self.exam[i] + accepted + (accepted < drafted)

    def timed(self, draft_s: float, steps: int, verify_s: float) -> None:
        d = self.decay
        if steps:
            self.t_draft, self.n_draft = d * self.t_draft + draft_s, d * self.n_draft + steps
        self.t_verify, self.n_verify = d * self.t_verify + verify_s, d * self.n_verify + 1

    def keep_rows(self, rows: list[int]) -> None:
        """Batch rows were compacted: keep these (old indices)."""
        self.acc, self.exam = [self.acc[j] for j in rows], [self.exam[j] for j in rows]


def draft_pick(logits: Tensor, how: Sampling, gens: list[torch.Generator] | None, draw: list[bool]
               ) -> tuple[Tensor, Tensor | None]:
    """The drafter's next token of every row from its logits (B, V), left on the device: the argmax, or a draw of
    `how`'s distribution (Sampling.probs) from the row's own generator gens[j] for the rows in `draw` (a row past
    its own block draws nothing, so its generator's stream, and its tokens, do not depend on its neighbours'
    blocks; its token is computed and dropped). Returns the tokens (B, 1) and, sampling, the drafter's
    probabilities q (B, V)."""
    if how.greedy:
        return logits.argmax(-1, keepdim=True), None
    probs = how.probs(logits)  # (B, V)
    # a NaN/inf drafter row drafts from the uniform stand-in q (multinomial refuses NaN): rejection sampling is exact
    # for any q, and the verifier's own logits are checked in the verdict
    probs = torch.where(torch.isfinite(probs).all(-1, keepdim=True), probs, 1.0 / probs.shape[-1])
    toks = [torch.multinomial(probs[j], 1, generator=gens[j]) if d else
            probs.new_zeros(1, dtype=torch.long) for j, d in enumerate(draw)]
    return torch.stack(toks), probs  # (B, 1), (B, V)


def penalised_draft_pick(dpen: RepetitionPenalty | None, logits: Tensor, how: Sampling,
                         gens: list[torch.Generator] | None, draw: list[bool]) -> tuple[Tensor, Tensor | None, Tensor]:
    """`draft_pick` of the drafter's logits (B, V) penalised by `dpen` (the round's fork of the penalty state, None
    at penalty 1), the drafts marked seen there (pick_penalised, the sequential loops' pick): the tokens (B, 1), q
    (sampling) and the penalised logits (min_confidence reads them). The single-process and the distributed rounds
    both draft here."""
    out = []

    def pick(x: Tensor) -> Tensor:
        out.append(x)
        tok, q = draft_pick(x, how, gens, draw)
        out.append(q)
        return tok

    tok = pick_penalised(dpen, logits, pick)
    return tok, out[1], out[0]


def speculative_verdict(ids: Tensor, logits: Tensor, drafted: list[int], wants: Tensor | None, qs: list,
                        how: Sampling, gens: list[torch.Generator] | None) -> tuple[Tensor, Tensor]:
    """How many of its drafts each row keeps and its next token, on the device: ids (B, m + 1) = [last, drafts...]
    (row j drafted drafted[j] <= m, also as `wants` (B, 1) on the device; None: every row drafted m), logits
    (B, m + 1, V) the verifier's there. Greedy: the leading drafts equal to the verifier's argmax and the argmax
    after them; sampling: speculative rejection sampling (`speculative_accept`, each row from its own generator).
    The verifier is the model's own forward: a position whose logits hold NaN/inf stops acceptance there and makes
    the row's next token NONFINITE, on which check_picked raises. `gens`: each row's generator (sampling), qs its
    drafter probabilities (B, V) per drafter step. The single-process and the distributed rounds both judge here."""
    B, m = ids.shape[0], ids.shape[1] - 1
    cols = torch.arange(m + 1, device=ids.device)  # (m + 1,)
    mine = cols[None] <= (m if wants is None else wants)  # (B or 1, m + 1): the row's own positions
    finite = torch.isfinite(logits).all(-1)  # (B, m + 1)
    if how.greedy:
        target = torch.where(finite, logits.argmax(-1), NONFINITE)  # (B, m + 1)
        ok = (ids[:, 1:] == target[:, :m]) & mine[:, 1:]  # (B, m): a NONFINITE target equals no draft
        n = ok.long().cumprod(-1).sum(-1)  # (B,)
        return n, target.gather(1, n[:, None])[:, 0]
    p = how.probs(logits)  # (B, m + 1, V)
    p = torch.where(finite[..., None], p, 1.0 / p.shape[-1])  # a stand-in for multinomial; its draw is dropped below
    q = torch.stack(qs, 1) if qs else p.new_zeros(B, 0, p.shape[-1])  # (B, m, V)
    n, t = speculative_accept(p, q, ids[:, 1:], gens, drafted)
    first_bad = torch.where(~finite & mine, cols, m + 1).amin(-1)  # (B,) m + 1: none
    t = torch.where(first_bad <= n, NONFINITE, t)  # a token drawn at or after a NaN/inf position is not emitted
    return torch.minimum(n, first_bad), t


def _round(ses: BatchSession, draft_fwd, verify_fwd, last: Tensor | None, want: list[int], pad_to: int | None,
           how: Sampling, min_confidence: float = 0.0):
    """One self-speculative round of every batch row, greedy or sampled, with a single host read: up to max(want)
    drafter steps, each fed the previous step's tokens as a device tensor, one verifier forward over
    [last, drafts...], the verdict on the device (`speculative_verdict`), and one read of the drafts, the accepted
    counts and the next tokens. A round that read every drafter step's tokens leaves a GPU idle while the host takes them and
    launches the next step: at batch 1 under CUDA graphs that wait is of the order of the step itself.
    `min_confidence` > 0 adds one read per drafter step, of the drafted tokens' probabilities: whether a row drafts
    on is a host decision (it stops after a draft below min_confidence; the round stops when no row drafts on).

    One row (`ses.plain`: one prompt, or an eager batch compacted to one) runs the plain cached forwards from `last`
    (1, 1) on the device (None: the row's last token from the host); a batch runs ragged forwards, every row's last
    token, length and block in one copy in (a row that drafts fewer tokens computes the rest, dropped, and the
    verifier sees its last real token there: masked attention still multiplies the K/V of positions it hides by 0,
    so a NaN / inf extra draft must not be fed).
    With a repetition penalty (`ses.penalty`) the drafter penalises each step by the row's seen ids and its drafts so
    far, and the verifier's position i by the seen ids and drafts 1..i (RepetitionPenalty.at_positions): the
    distribution one-token decoding of that prefix would penalise, so the verdict stays exact; the state then
    learns the kept tokens.
    Returns (drafts per row, accepted per row, next token per row, the next tokens (B, 1) on the device, drafter
    steps, marks)."""
    B = len(ses.rows)
    pen = ses.penalty
    if ses.plain:
        last = ses.ids([ses.last]) if last is None else last  # (1, 1)

        def draft(x: Tensor, k: int) -> Tensor:
            return ses.call_plain(draft_fwd, x, extra=k)

        def verify(ids: Tensor, wants: Tensor | None) -> Tensor:
            return ses.call_plain(verify_fwd, ids, pad_to=pad_to)  # the step pads with the last token itself
    else:
        rows = torch.tensor([[t, n, w] for t, n, w in zip(ses.last, ses.lens, want)], device=ses.device)  # (B, 3)
        last, start = rows[:, :1], rows[:, 1:2]  # (B, 1) each
        span = max(ses.lens) + 1 if ses.compact else None  # eager: attend positions 0..span-1 (positions())

        def draft(x: Tensor, k: int) -> Tensor:
            return draft_fwd.ragged(x, RowPositions(start + k, span=None if span is None else span + k), ses.cache)

        def verify(ids: Tensor, wants: Tensor) -> Tensor:
            m = ids.shape[1] - 1
            T = m + 1 if pad_to is None else max(m + 1, pad_to)
            ids = torch.cat([ids, ids[:, -1:].expand(B, T - m - 1)], 1)  # (B, T)
            cols = torch.arange(T, device=ses.device)[None]  # (1, T)
            ids = torch.where(cols <= wants, ids, ids.gather(1, wants))  # past its drafts: its last real token
            pos = RowPositions(start + cols, span=None if span is None else span + T - 1)
            return verify_fwd.ragged(ids, pos, ses.cache)
    if pen is not None:
        verify_raw = verify

        def verify(ids: Tensor, wants: Tensor | None) -> Tensor:  # (B, m + 1, V) penalised, as judged
            m = ids.shape[1] - 1
            return pen.at_positions(verify_raw(ids, wants)[:, :m + 1], ids[:, 1:])
    dpen = None if pen is None else pen.fork()  # the drafter's: the round's drafts marked as they come
    gens = None if how.greedy else [ses.gens[i] for i in ses.rows]  # each row's own, in batch order
    t0 = mark(ses.device)
    x, drafts, qs, confs = last, [], [], []
    drafted = list(want) if not min_confidence else [0] * B
    going = [w > 0 for w in want]
    for k in range(max(want)):
        if not any(going):
            break
        draw = [k < w for w in want] if not min_confidence else list(going)
        x, q, logits = penalised_draft_pick(dpen, draft(x, k)[:, -1], how, gens, draw)  # (B, 1), (B, V), (B, V)
        drafts.append(x)
        if q is not None:
            qs.append(q)
        if min_confidence:  # the drafted token's probability: the top-1 when greedy, the sampled one's when sampling
            probs = torch.softmax(logits.float(), -1) if q is None else q  # float32, as q (Sampling.probs)
            confs.append(probs.gather(-1, x)[:, 0].double())  # (B,); float64: compared as the host compares below
            conf = confs[-1].tolist()  # one read per drafter step
            for j in range(B):
                if going[j]:
                    drafted[j] += 1
                    going[j] = drafted[j] < want[j] and conf[j] >= min_confidence
    t1 = mark(ses.device)
    m = len(drafts)
    ids = torch.cat([last, *drafts], 1)  # (B, m + 1)
    if ses.plain:
        wants = None  # the one row drafted all m
    elif drafted == want:  # (B, 1): the blocks copied in with the round
        wants = rows[:, 2:3]
    else:  # min_confidence: a row drafts until its block or its first draft below min_confidence, as counted above,
        # counted again on the device from the same confidences (no copy in)
        lead = (torch.stack(confs, 1) >= min_confidence).long().cumprod(1).sum(1, keepdim=True)  # (B, 1)
        wants = torch.minimum(rows[:, 2:3], lead + 1)
    n, nxt = speculative_verdict(ids, verify(ids, wants)[:, :m + 1], drafted, wants, qs, how, gens)  # (B,) each
    t2 = mark(ses.device)
    got = torch.cat([ids[:, 1:], n[:, None], nxt[:, None]], 1).tolist()  # the round's one read
    ns, nxts = [g[m] for g in got], [g[m + 1] for g in got]
    # A NaN / inf next token of a row whose drafts were not all accepted may come from a draft whose own K/V are NaN /
    # inf (a NaN embedding row, an fp16 overflow): masked attention multiplies them by 0, and 0 x NaN = NaN poisons
    # every position of the verifier's forward, the earlier ones included. `_unpoison` judges such rows again on
    # clean logits (only on that error path); a NaN that remains is the model's own, and check_picked raises on it.
    bad = [j for j in range(B) if nxts[j] == NONFINITE and ns[j] < drafted[j]]
    if bad:
        nxt = _unpoison(ses, verify, ids, qs, drafted, how, bad, ns, nxts, nxt)
        n = torch.tensor(ns, device=ses.device)  # the verdicts judged again (an error path: one copy in)
    if pen is not None:  # on the device, after the round's read: no wait
        pen.accept(ids[:, 1:], n, nxt)
    return [g[:w] for g, w in zip(got, drafted)], ns, nxts, nxt[:, None], m, (t0, t1, t2)


def _unpoison(ses: BatchSession, verify, ids: Tensor, qs: list, drafted: list[int], how: Sampling, bad: list[int],
              ns: list[int], nxts: list, nxt: Tensor) -> Tensor:
    """Judge the rows `bad` of a round again without the draft that poisoned their verifier forward. Its origin is
    the first of the row's positions whose K/V are non-finite at the LOWEST layer that has any: below that layer
    every position's residual is finite (no attention read a non-finite value yet), so there a non-finite K/V is
    the position's own, not the spread of 0 x NaN. With the origin at position k >= 1 (draft d_k), the row is
    verified again with the inputs from position k on replaced by d_{k-1} (the same width, so every slot the poison
    wrote is rewritten). An earlier draft that poisons only at a deeper layer is hidden at that lowest layer by the
    later one's spread: then the logits before k are still non-finite, and the search runs again below k on the new
    K/V (each pass moves the origin left; at most m passes). The logits at positions 0..k-1 are then clean, and
    drafts d_1..d_k are judged on them (greedy or by rejection sampling, from the row's own generator; the other
    rows keep their verdicts and draws). A verdict that accepts all k has no next token: p_k needs d_k as input,
    whose forward is non-finite, so the row emits d_1..d_k and its next forward raises, as sequential decoding
    would after emitting d_k. Judging exactly the drafts up to the first poisoned one is a stopping rule on the
    drafts (as min_confidence's), so sampling keeps the model's law. Origin 0 (the round's last token) or no
    non-finite K/V: the NaN is the model's own.
    Updates ns / nxts in place (nxts[j] None: accepted all, no next token); returns the next tokens on the device."""
    B, m = ids.shape[0], ids.shape[1] - 1
    cols = torch.arange(m + 1, device=ses.device)
    pos = torch.tensor([ses.lens[j] for j in range(B)], device=ses.device)[:, None] + cols  # (B, m + 1) cache slots
    b = torch.arange(B, device=ses.device)[:, None]
    origin: dict[int, int] = {}
    search = {j: drafted[j] + 1 for j in bad}  # row -> the positions below which its origin is searched
    while search:
        nonfinite = (~torch.isfinite(ses.cache.k[:, b, :, pos]) | ~torch.isfinite(ses.cache.v[:, b, :, pos]))
        nonfinite = nonfinite.flatten(3).any(-1).tolist()  # (B, m + 1, L): the row's slots, by layer
        for j, bound in search.items():
            rows = [nonfinite[j][i] for i in range(bound)]  # (positions, L)
            layers = [l for l in range(len(rows[0])) if any(r[l] for r in rows)]
            k = next(i for i, r in enumerate(rows) if r[layers[0]]) if layers else 0
            if k >= 1:
                origin[j] = k
            # k = 0 on the first pass: the NaN is the model's own (no origin); on a later pass: no earlier poison
            # K/V, so the non-finite logits before the origin are the model's own and the verdict judges them
        if not origin:
            return nxt
        keep = torch.tensor([origin[j] - 1 if j in origin else drafted[j] for j in range(B)],
                            device=ses.device)[:, None]  # (B, 1)
        clean = torch.where(cols[None] <= keep, ids, ids.gather(1, keep))  # (B, m + 1)
        logits = verify(clean, keep)[:, :m + 1]  # the other rows: their first pass's inputs again, the same K/V
        finite = torch.isfinite(logits).all(-1).tolist()  # (B, m + 1)
        search = {j: origin[j] for j in search if j in origin and origin[j] < search[j]
                  and not all(finite[j][:origin[j]])}
    redo = sorted(origin)
    sel = torch.tensor(redo, device=ses.device)
    n, t = speculative_verdict(ids[sel], logits[sel], [origin[j] for j in redo], keep[sel] + 1,
                               [q[sel] for q in qs], how, None if how.greedy else [ses.gens[ses.rows[j]] for j in redo])
    for j, n_j, t_j in zip(redo, n.tolist(), t.tolist()):
        ns[j], nxts[j] = n_j, None if n_j == origin[j] else t_j
    # one prompt feeds the next round from the device: the next token, or the last accepted draft
    fed = torch.where(n == sel.new_tensor([origin[j] for j in redo]), ids[sel].gather(1, n[:, None])[:, 0], t)
    return nxt.index_copy(0, sel, fed)


def _speculative_rows(model: GPT, prompts, plan: Plan, draft_fwd, verify_fwd, block: int, max_new_tokens: int,
                      how: Sampling, eos_id, seed, max_len, on_tokens, min_confidence: float,
                      adaptive: bool, penalty: float = 1.0) -> list[GenerateResult]:
    """Self-speculative decoding of a ragged batch (snlp.decode.batch): per round, every live row drafts its own
    number of tokens, one batched verifier forward checks them, each row accepts its own prefix and moves its
    own length (its "rollback"). One prompt runs the same round as a batch of one (BatchSession.plain)."""
    if len(prompts) != 1:  # one row runs the plain single-prompt forwards, which every surrogate supports
        check_batch_plan(plan)
    c0 = draft_fwd.compile_s + verify_fwd.compile_s  # prebuilt steps' totals so far: report this call's only
    with torch.inference_mode():
        ses = BatchSession(model, prompts, max_new_tokens, eos_id, max_len, on_tokens, "speculative",
                           (verify_fwd, draft_fwd), step_slack(draft_fwd, verify_fwd) + block + 1, how, seed, penalty)
        # sampling: the block must not depend on the clock (a seeded run repeats its draws), so the cost ratio is
        # the plan's ideal one, L / (S + K * evals) layer steps, not the measured one
        ratio = None if how.greedy else plan.ideal_speedup(model.config.n_layer)
        ctl = AdaptiveBlock(block, len(ses.rows), cost_ratio=ratio) if adaptive else None
        for r in ses.results:
            r.plan, r.block = str(plan), block
        pad = block + 1 if verify_fwd.compiled else None  # one verifier graph: every round at B+1
        ses.warm(draft_fwd, 1)
        ses.warm(verify_fwd, block + 1)
        ses.prefill(verify_fwd)
        # the round keeps its tokens on the device and reads once (_round; min_confidence also once per drafter
        # step); one prompt also feeds the next round from the device
        last = ses.ids([ses.last]) if len(ses.prompts) == 1 else None  # (1, 1)
        while ses.active:
            live = set(ses.live())
            # adaptive, greedy: the batch drafts the LARGEST of its rows' blocks; a batched drafter step costs the same
            # for every row, so a row that drafted less would only lose tokens (its extra drafts cost verifier width).
            # Sampling: each row its own block, so its draws (and tokens) do not depend on its neighbours
            rows = range(len(ses.rows))
            if ctl is None:
                blocks = [block for _ in rows]
            elif how.greedy:
                blocks = [max(ctl.block(j) for j in live) for _ in rows]
            else:
                blocks = [ctl.block(j) if j in live else 0 for j in rows]
            want = [min(blocks[j], ses.remaining(j) - 1) if j in live else 0 for j in rows]
            drafts, ns, nxt, fed, steps, (t0, t1, t2) = _round(ses, draft_fwd, verify_fwd, last, want, pad,
                                                               how, min_confidence)
            if last is not None:  # one prompt: the next round starts from the verifier's token on the device
                last = fed
            draft_s, verify_s = between(t0, t1), between(t1, t2)  # events recorded before the round's read: passed
            # the verifier's NaN/inf logits: the model's own forward (plan None); None: no next token (_unpoison)
            for j in sorted(j for j in live if nxt[j] is not None):
                check_picked([nxt[j]], None, len(ses.results[ses.rows[j]].tokens) + ns[j],
                             [ses.rows[j]] if len(ses.results) > 1 else None, model=model,
                             context=lambda k, j=j: (ses.prompts[ses.rows[j]] + ses.results[ses.rows[j]].tokens
                                                     + drafts[j][: ns[j]]))
            if ctl is not None:
                ctl.timed(draft_s, steps, verify_s)
            for j in sorted(live):
                if ctl is not None:
                    ctl.update(j, len(drafts[j]), ns[j])
                # the row's own counts: its drafter steps (its share of the round's drafting time) and its verifier
                ses.results[ses.rows[j]].add_round(drafts[j], ns[j], ses.stops, steps=len(drafts[j]),
                                                   forwards=len(drafts[j]) + 1,
                                                   draft_s=draft_s * len(drafts[j]) / max(steps, 1), verify_s=verify_s)
                tail = [] if nxt[j] is None else [nxt[j]]  # None: _unpoison accepted all, no next token
                ses.emit(j, drafts[j][: ns[j]] + tail, ns[j] + len(tail))
            keep = ses.live()
            if ctl is not None and ses.compact and len(keep) < len(ses.rows):
                ctl.keep_rows(keep)
            ses.drop_finished()
        for r in ses.results:
            r.compile_s = draft_fwd.compile_s + verify_fwd.compile_s - c0
        return ses.finish()

"""Self-speculative decoding (paper, "Self-speculative decoding"): the SNLP forward drafts B tokens, the
sequential model verifies the B+1 positions in ONE cached forward; greedy output is identical to sequential
decoding, sampling keeps the model's distribution. Also the ideal SSD speedup and the side-by-side benchmark
against sequential decoding (typed rows, `SSDRow`)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import Tensor

from snlp.decode.generate import sequential_generate
from snlp.decode.session import (DecodeSession, GenerateResult, check_decode_args, decode_plan, make_generator,
                                 merge_results, sequential_forward, snlp_forward, step_slack)
from snlp.decode.steps import EagerStep, Step
from snlp.method.drafter import Drafter
from snlp.method.plan import Plan
from snlp.method.preheat import Preheat
from snlp.model.gpt import GPT
from snlp.runtime.device import progress_bar
from snlp.runtime.timing import now


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

    s compares like with like: the sequential run's mean time per single-token decode step over the
    drafter's mean time per step, BOTH per-step times of cached single-token forwards (forward +
    next-token pick, timed around each step, so per-token bookkeeping and streaming are outside
    both). The measured speedup is end to end: sequential decode time per token over speculative
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
    """One block size of `speculative_benchmark`: the medians over the timed rounds of each report field,
    the ideal SSD speedup of the median alpha and s, and how the rounds were run."""

    matches_sequential: bool = True  # every speculative output equalled the sequential one, every round
    repeats: int = 0
    prompts: int = 0
    gen_tokens: int = 0
    compiled: bool = False
    compile_s: float = 0.0


_MEDIAN_FIELDS = ("alpha", "tokens_per_round", "drafter_speedup_s", "sequential_ms_per_step", "drafter_ms_per_step",
                  "sequential_ms_per_token", "speculative_ms_per_token", "measured_speedup")


def speculative_benchmark(model: GPT, prompts: list, plan: Plan | str, blocks=(4,), max_new_tokens: int = 64,
                          repeats: int = 3, warmup: int = 1, temperature: float = 0.0, seed: int | None = 0,
                          eos_id: int | None = None, progress: bool = False, compile: bool = False,
                          preheat: Preheat | None = None, share_weights: bool = False, min_confidence: float = 0.0,
                          drafter: Drafter | None = None) -> tuple[list[SSDRow], list[list[int]]]:
    """Self-speculative decoding with drafter `plan` at each block size B vs sequential decoding,
    measured side by side in this process: `warmup` untimed rounds (both sides, every B, first
    prompt), then `repeats` timed rounds, each decoding every prompt sequentially and then at each B
    (interleaved, so load drift hits every row alike). Per round the counters are summed over the
    prompts and `speculative_report` taken; each row (one per B) holds the medians over the rounds,
    the ideal SSD speedup of the median alpha and s, and `matches_sequential` (every speculative
    output equals the sequential one, every round). Returns (rows, sequential tokens per prompt).
    `compile`: both sides run compiled static-shape steps (snlp.decode.steps), built once here and shared by every
    run (compiled during the warm-up; rows carry `compile_s`)."""
    plan = decode_plan(model, plan)
    blocks = tuple(blocks)
    if not prompts:
        raise ValueError("speculative_benchmark needs at least one prompt")
    for b in blocks:
        check_decode_args(max_new_tokens, temperature, b)
    if not blocks:
        raise ValueError("speculative_benchmark needs at least one block size")
    if not isinstance(repeats, int) or repeats < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0 (got repeats={repeats!r}, warmup={warmup!r})")
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, eos_id=eos_id)
    draft_model = model if drafter is None else drafter_model_for(model, plan, drafter, share_weights, True)
    seq_step = sequential_forward(model, compile)
    draft_step = snlp_forward(draft_model, plan, compile, preheat=preheat, share_weights=share_weights)
    seq_kw, spec_kw = dict(kw, step=seq_step), dict(kw, draft=draft_step, verify=seq_step, min_confidence=min_confidence)
    for _ in range(warmup):  # allocator, kernels, fused weights, compiled graphs: both sides
        sequential_generate(model, prompts[0], **seq_kw)
        for b in blocks:
            speculative_generate(model, prompts[0], plan, block=b, **spec_kw)
    reports: dict[int, list[SpeculativeReport]] = {b: [] for b in blocks}
    matches = dict.fromkeys(blocks, True)
    with progress_bar(repeats * len(prompts), f"SSD {plan} B={','.join(map(str, blocks))}", progress) as bar:
        for _ in range(repeats):
            seq_runs, spec_runs = [], {b: [] for b in blocks}
            for p in prompts:
                seq_runs.append(sequential_generate(model, p, **seq_kw))
                for b in blocks:
                    spec_runs[b].append(speculative_generate(model, p, plan, block=b, **spec_kw))
                bar.update()
            seq = merge_results(seq_runs)
            for b in blocks:
                reports[b].append(speculative_report(merge_results(spec_runs[b]), seq))
                matches[b] &= all(x.tokens == y.tokens for x, y in zip(spec_runs[b], seq_runs))
    rows = []
    for b in blocks:
        med = {k: statistics.median(getattr(r, k) for r in reports[b]) for k in _MEDIAN_FIELDS}
        a, s = med["alpha"], med["drafter_speedup_s"]
        rows.append(SSDRow(plan=str(plan), block=b, **med,
                           ideal_ssd_speedup=ideal_ssd_speedup(a, b, s) if a == a and s == s else float("nan"),
                           matches_sequential=matches[b], repeats=repeats, prompts=len(prompts),
                           gen_tokens=max_new_tokens, compiled=compile,
                           compile_s=seq_step.compile_s + draft_step.compile_s))
    return rows, [r.tokens for r in seq_runs]


def drafter_model_for(model: GPT, plan: Plan, drafter: Drafter, share_weights: bool, verify_weights: bool) -> GPT:
    """The module an adapted `drafter` drafts with, after checking it belongs to `model` and fits `plan`."""
    if share_weights:
        raise ValueError("share_weights makes the drafter's stacks the verifier's own layers; an adapted drafter has "
                         "its own suffix weights: drop share_weights or the drafter")
    drafter.check(model, verify_weights)
    drafter.check_plan(plan)
    return drafter.model


def speculative_accept(p: Tensor, q: Tensor, drafts: Tensor, gen: torch.Generator | None = None
                       ) -> tuple[Tensor, Tensor]:
    """Speculative rejection sampling (Leviathan et al. 2023), vectorised over a leading dim N.

    p (N, B+1, V) target probabilities at the B+1 verified positions, q (N, B, V) the drafter's,
    drafts (N, B) tokens sampled from q. Draft i is accepted with probability min(1, p_i(d)/q_i(d));
    at the first rejection n the next token is drawn from norm(max(0, p_n - q_n)), and if all B are
    accepted from p_B. Returns n (N,) accepted drafts and the next token (N,): the emitted tokens
    d_1..d_n, token are distributed exactly as sampling from p one token at a time."""
    N, B1, V = p.shape
    B = B1 - 1
    pd = p[:, :B].gather(-1, drafts[..., None])[..., 0]  # (N, B)
    qd = q.gather(-1, drafts[..., None])[..., 0]
    u = torch.rand(N, B, generator=gen, device=p.device, dtype=p.dtype)
    ok = u * qd < pd  # u < p/q without dividing by a zero q
    n = ok.long().cumprod(-1).sum(-1)  # (N,) leading accepts
    q_pad = torch.cat([q, torch.zeros_like(p[:, :1])], 1)  # q_B = 0: the bonus draws from p_B
    rows = torch.arange(N, device=p.device)
    resid = (p[rows, n] - q_pad[rows, n]).clamp_min(0)  # (N, V)
    empty = resid.sum(-1, keepdim=True) <= 0  # p_n == q_n (cannot reject there), guard anyway
    resid = torch.where(empty, p[rows, n], resid)
    return n, torch.multinomial(resid, 1, generator=gen)[:, 0]


def speculative_generate(model: GPT, prompt_ids, plan: Plan | str, block: int = 4, max_new_tokens: int = 64,
                         temperature: float = 0.0, eos_id: int | None = None, seed: int | None = None,
                         max_len: int | None = None, on_tokens: Callable[[list[int]], None] | None = None,
                         compile: bool = False, draft: Step | EagerStep | None = None,
                         verify: Step | EagerStep | None = None, preheat: Preheat | None = None,
                         share_weights: bool = False, min_confidence: float = 0.0, drafter: Drafter | None = None
                         ) -> GenerateResult:
    """Self-speculative decoding: the SNLP forward of `plan` drafts `block` tokens autoregressively
    (cached), the sequential model scores the B+1 positions in one cached forward, the longest
    agreeing prefix plus one verifier token is kept and the cache is rolled back past the rejection.

    Drafter and verifier share ONE KV cache: the verifier rewrites every verified position with exact
    K/V, so the drafter always conditions on the exact history (snlp.model.cache). Greedy (temperature 0)
    output equals `sequential_generate`; with temperature > 0 rejection sampling keeps the model's
    distribution. Note: the verifier scores B+1 positions in one forward, so in low precision its
    logits may differ from one-token steps by rounding (near-ties can flip; float64 is exact).
    `compile`: drafter and verifier run as compiled static-shape steps (snlp.decode.steps; the verifier always
    scores B+1 positions, a short last round padded); `draft` / `verify` pass prebuilt ones. `share_weights`
    (M = 1 plans): the drafter's stacked weights and the verifier's layers are one storage (snlp.method.sharing:
    the model's suffix parameters are moved into the drafter's stacks, values unchanged), so each weight byte
    is streamed once. `min_confidence` (adaptive drafting, SWIFT/Kangaroo-style): a round stops drafting after
    a draft whose drafter probability (its top-1 probability when greedy, the sampled token's when sampling)
    is below it, so drafts that are likely rejected cost no drafter steps; 0 drafts the whole block. Exact by
    construction: the verifier checks whatever was drafted (the first draft of a round is always made).
    `drafter` (snlp.method.drafter, `snlp adapt`): an adapted drafter of `model` drafts instead of the model's own
    SNLP forward (its prefix is the model's, its suffix adapted; checked against the model's weights fingerprint
    unless a prebuilt `draft` step is passed); `model` still verifies, so the output is the model's own."""
    check_decode_args(max_new_tokens, temperature, block)
    if not 0.0 <= min_confidence <= 1.0:
        raise ValueError(f"min_confidence must lie in [0, 1], a probability (got {min_confidence!r})")
    plan = decode_plan(model, plan)
    draft_model = model if drafter is None else drafter_model_for(model, plan, drafter, share_weights, draft is None)
    draft_fwd = snlp_forward(draft_model, plan, compile, draft, preheat, share_weights)
    verify_fwd = sequential_forward(model, compile, verify)
    greedy = temperature == 0
    with torch.inference_mode():
        ses = DecodeSession(model, prompt_ids, max_new_tokens, eos_id, max_len, on_tokens, "speculative", verify_fwd,
                       step_slack(draft_fwd, verify_fwd) + block)
        res, cache, dev = ses.result, ses.cache, ses.device
        res.plan, res.block = str(plan), block
        gen = None if greedy else make_generator(seed, dev)
        ses.warm(verify_fwd, [verify_fwd.prefill_len(len(ses.prompt) - 1), block + 1])
        ses.warm(draft_fwd, [1])
        ses.prefill(verify_fwd)
        while not ses.done:
            P, Bk = cache.length, min(block, ses.remaining - 1)  # no drafts past the budget
            t0 = now(dev)
            drafts, qs, x = [], [], ses.last
            for _ in range(Bk):  # the drafter: SNLP decode steps, cached
                logits = draft_fwd(ses.ids([x]), cache)[0, -1]
                if greedy:
                    x = int(logits.argmax())
                    conf = float(torch.softmax(logits.float(), -1)[x]) if min_confidence else 1.0
                else:
                    qs.append(torch.softmax(logits.float() / temperature, -1))
                    x = int(torch.multinomial(qs[-1], 1, generator=gen))
                    conf = float(qs[-1][x]) if min_confidence else 1.0
                drafts.append(x)
                if conf < min_confidence:  # likely rejected: verify what we have instead of drafting on
                    break
            Bk = len(drafts)
            t1 = now(dev)
            cache.rollback(P)  # verification rewrites positions P..P+Bk with exact K/V
            logits = verify_fwd(ses.ids([ses.last] + drafts), cache, pad_to=block + 1)[0]  # (Bk+1, V)
            if greedy:
                target = logits.argmax(-1).tolist()
                n = next((i for i, (d, t) in enumerate(zip(drafts, target)) if d != t), Bk)
                nxt = target[n]
            else:
                p = torch.softmax(logits.float() / temperature, -1)
                q = torch.stack(qs) if qs else p.new_zeros(0, p.shape[-1])
                n_t, nxt_t = speculative_accept(p[None], q[None], torch.tensor([drafts], device=dev).long(), gen)
                n, nxt = int(n_t), int(nxt_t)
            cache.rollback(P + n + 1)  # keep the exact K/V of `last` and the accepted drafts
            res.add_round(Bk, n, steps=Bk, forwards=Bk + 1, draft_s=t1 - t0, verify_s=now(dev) - t1)
            ses.emit(drafts[:n] + [nxt])
        return ses.finish()

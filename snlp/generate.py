"""Generate text from a checkpoint: sequential, SNLP, self-speculative or Jacobi decoding (KV-cached).

Modes (all share one static KV cache, snlp.cache.KVCache):
  sequential   the model's own cached decoding, one token per forward.
  snlp         every forward is an SNLP solve with the cache (approximate unless K >= chunks).
  speculative  self-speculative decoding (paper, "Self-speculative decoding"): the SNLP forward
               drafts B tokens, the sequential model verifies the B+1 positions in ONE cached
               forward; greedy output is identical to sequential, sampling keeps its distribution.
  jacobi       Jacobi decoding over a block of B future tokens, each iteration a fresh SNLP forward
               (the paper's naive composition, App. "Coupling SNLP with Jacobi Decoding"), then a
               sequential check of the block; greedy only, output identical to sequential.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from .cache import KVCache
from .model import GPT
from .plan import Plan
from .runtime import cli_device, progress_bar, write_json
from .solver import bind
from .steps import EagerStep, Step, sequential_step, snlp_step
from .timing import now as _now

MODES = ("sequential", "snlp", "speculative", "jacobi")


@dataclass
class GenerateResult:
    """Generated ids and decode statistics. Times exclude the prompt prefill (prefill_s)."""

    tokens: list[int]
    mode: str
    decode_s: float = 0.0
    prefill_s: float = 0.0
    plan: str | None = None
    block: int = 0
    stop: str = ""  # eos | max_new_tokens | max_len
    forwards: int = 0  # forwards on the critical path (each SNLP solve counts once)
    rounds: int = 0  # speculative/Jacobi rounds
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    examined: int = 0  # draft tokens compared: accepted ones + the first rejection of each round
    draft_steps: int = 0
    draft_s: float = 0.0  # time in the drafter's single-token steps (forward + next-token pick)
    steps: int = 0  # single-token decode steps of sequential / snlp decoding ...
    step_s: float = 0.0  # ... and the time in them (forward + next-token pick), timed like draft_s
    verify_s: float = 0.0
    jacobi_iters: int = 0
    compile_s: float = 0.0  # compiling the static-shape steps (--compile), done before any timing
    extra: dict = field(default_factory=dict)

    def add_round(self, drafted: int, accepted: int, steps: int, forwards: int, draft_s: float,
                  verify_s: float) -> None:
        """Count one speculative / Jacobi round: `drafted` guesses of which the leading `accepted` were kept
        (examined: those plus the first rejection, if any), `steps` drafter steps, `forwards` on the critical
        path, and the draft / verify time."""
        self.rounds += 1
        self.draft_steps += steps
        self.drafted += drafted
        self.accepted += accepted
        self.examined += accepted + (accepted < drafted)
        self.forwards += forwards
        self.draft_s += draft_s
        self.verify_s += verify_s

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """Per-draft acceptance alpha: P(draft token accepted | all earlier drafts of the round
        accepted), the maximum-likelihood alpha of the i.i.d. model behind the paper's formula."""
        return self.accepted / self.examined if self.examined else float("nan")

    @property
    def tokens_per_round(self) -> float:
        return len(self.tokens) / self.rounds if self.rounds else float("nan")

    @property
    def draft_ms_per_step(self) -> float:
        return 1e3 * self.draft_s / self.draft_steps if self.draft_steps else float("nan")

    @property
    def ms_per_step(self) -> float:
        """Mean ms of a single-token decode step (sequential / snlp modes; prefill excluded)."""
        return 1e3 * self.step_s / self.steps if self.steps else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tokens_per_s=self.tokens_per_s, ms_per_token=1e3 / self.tokens_per_s if self.tokens else None)
        if self.mode in ("speculative", "jacobi"):
            d.update(acceptance_rate=self.acceptance_rate, tokens_per_round=self.tokens_per_round,
                     accepted_fraction=self.accepted / self.drafted if self.drafted else None)
        return d


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


def speculative_report(spec: GenerateResult, seq: GenerateResult) -> dict:
    """Measured vs ideal speedup of a speculative run over a sequential run of the same model.

    s compares like with like: the sequential run's mean time per single-token decode step over the
    drafter's mean time per step, BOTH per-step times of cached single-token forwards (forward +
    next-token pick, timed around each step, so per-token bookkeeping and streaming are outside
    both). The measured speedup is end to end: sequential decode time per token over speculative
    decode time per token (prefill excluded from both)."""
    seq_ms = 1e3 * seq.decode_s / max(len(seq.tokens), 1)
    s = seq.ms_per_step / spec.draft_ms_per_step if spec.draft_steps and seq.steps else float("nan")
    a = spec.acceptance_rate
    return {"plan": spec.plan, "block": spec.block, "alpha": a, "tokens_per_round": spec.tokens_per_round,
            "drafter_speedup_s": s, "sequential_ms_per_step": seq.ms_per_step,
            "drafter_ms_per_step": spec.draft_ms_per_step, "sequential_ms_per_token": seq_ms,
            "speculative_ms_per_token": 1e3 * spec.decode_s / max(len(spec.tokens), 1),
            "measured_speedup": spec.tokens_per_s / seq.tokens_per_s,
            "ideal_ssd_speedup": ideal_ssd_speedup(a, spec.block, s) if a == a and s == s else float("nan")}


def merge_results(results: list[GenerateResult]) -> GenerateResult:
    """Sum the counters and times of several runs (e.g. one per prompt) into one result."""
    first = results[0]
    agg = GenerateResult(tokens=[t for r in results for t in r.tokens], mode=first.mode, plan=first.plan,
                         block=first.block)
    for f in ("decode_s", "prefill_s", "forwards", "rounds", "drafted", "accepted", "examined", "draft_steps",
              "draft_s", "verify_s", "steps", "step_s", "jacobi_iters"):
        setattr(agg, f, sum(getattr(r, f) for r in results))
    return agg


def speculative_benchmark(model: GPT, prompts: list, plan: Plan | str, blocks=(4,), max_new_tokens: int = 64,
                          repeats: int = 3, warmup: int = 1, temperature: float = 0.0, seed: int | None = 0,
                          eos_id: int | None = None, progress: bool = False, compile: bool = False
                          ) -> tuple[list[dict], list[list[int]]]:
    """Self-speculative decoding with drafter `plan` at each block size B vs sequential decoding,
    measured side by side in this process: `warmup` untimed rounds (both sides, every B, first
    prompt), then `repeats` timed rounds, each decoding every prompt sequentially and then at each B
    (interleaved, so load drift hits every row alike). Per round the counters are summed over the
    prompts and `speculative_report` taken; each row (one per B) holds the medians over the rounds,
    the ideal SSD speedup of the median alpha and s, and `matches_sequential` (every speculative
    output equals the sequential one, every round). Returns (rows, sequential tokens per prompt).
    `compile`: both sides run compiled static-shape steps (snlp.steps), built once here and shared by every
    run (compiled during the warm-up; rows carry `compile_s`)."""
    plan = _as_plan(model, plan)
    blocks = tuple(blocks)
    if not prompts:
        raise ValueError("speculative_benchmark needs at least one prompt")
    for b in blocks:
        _check_common(max_new_tokens, temperature, b)
    if not blocks:
        raise ValueError("speculative_benchmark needs at least one block size")
    if not isinstance(repeats, int) or repeats < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0 (got repeats={repeats!r}, warmup={warmup!r})")
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, eos_id=eos_id)
    seq_step, draft_step = _seq_forward(model, compile), _snlp_forward(model, plan, compile)
    seq_kw, spec_kw = dict(kw, step=seq_step), dict(kw, draft=draft_step, verify=seq_step)
    for _ in range(warmup):  # allocator, kernels, fused weights, compiled graphs: both sides
        sequential_generate(model, prompts[0], **seq_kw)
        for b in blocks:
            speculative_generate(model, prompts[0], plan, block=b, **spec_kw)
    reports: dict[int, list[dict]] = {b: [] for b in blocks}
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
        reps = reports[b]
        row = {"plan": str(plan), "block": b}
        for key in ("alpha", "tokens_per_round", "drafter_speedup_s", "sequential_ms_per_step", "drafter_ms_per_step",
                    "sequential_ms_per_token", "speculative_ms_per_token", "measured_speedup"):
            row[key] = statistics.median(r[key] for r in reps)
        a, s = row["alpha"], row["drafter_speedup_s"]
        row["ideal_ssd_speedup"] = ideal_ssd_speedup(a, b, s) if a == a and s == s else float("nan")
        row.update(matches_sequential=matches[b], repeats=repeats, prompts=len(prompts), gen_tokens=max_new_tokens,
                   compiled=compile, compile_s=seq_step.compile_s + draft_step.compile_s)
        rows.append(row)
    return rows, [r.tokens for r in seq_runs]


# ----- shared pieces -----
def _prompt_list(model: GPT, prompt_ids) -> list[int]:
    if isinstance(prompt_ids, Tensor):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt must be a list of ids or a (T,) / (1, T) tensor, got shape "
                             f"{tuple(prompt_ids.shape)} (batched decoding is not supported)")
        prompt_ids = prompt_ids.tolist()
    ids = [int(i) for i in prompt_ids]
    if not ids:
        raise ValueError("prompt must contain at least one token (e.g. the tokenizer's BOS id)")
    V = model.config.vocab_size
    if min(ids) < 0 or max(ids) >= V:
        raise ValueError(f"prompt token ids must lie in [0, {V}), got range [{min(ids)}, {max(ids)}]")
    return ids


def _check_common(max_new_tokens: int, temperature: float, block: int | None = None) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0 (got {max_new_tokens!r})")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, 0 = greedy (got {temperature})")
    if block is not None and (not isinstance(block, int) or block < 1):
        raise ValueError(f"draft block size B must be an integer >= 1 (got {block!r})")


def _as_plan(model: GPT, plan: Plan | str) -> Plan:
    if plan is None:
        raise ValueError("this decoding mode needs an SNLP plan (e.g. '4xF1-h0-K1')")
    plan = Plan.parse(plan) if isinstance(plan, str) else plan
    return plan.check(model.config.n_layer)


class _Session:
    """Prompt, cache and output bookkeeping shared by every mode. The cache always holds the exact
    K/V of all tokens but the last one (`last`), which the next forward feeds."""

    def __init__(self, model: GPT, prompt_ids, max_new_tokens: int, eos_id: int | None, max_len: int | None,
                 on_tokens: Callable[[list[int]], None] | None, mode: str, step: Step | EagerStep | None = None,
                 slack: int = 0):
        self.model, self.device = model, model.wte.weight.device
        self.prompt = _prompt_list(model, prompt_ids)
        max_len = len(self.prompt) + max_new_tokens if max_len is None else max_len
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be an integer >= 1 (got {max_len!r})")
        if len(self.prompt) > max_len:
            raise ValueError(f"prompt of {len(self.prompt)} tokens is longer than the KV cache (max_len {max_len})")
        # `slack` extra positions: scratch for the padding of static-shape steps, and a compiled step's cache is
        # allocated at its bucketed length (snlp.steps: the size is a graph shape); positions past max_len are
        # never valid, the budget below is what counts
        size = max_len + slack if step is None else step.cache_len(max_len + slack)
        self.cache = KVCache.for_model(model, batch=1, max_len=size)
        self.budget = min(max_new_tokens, max_len - len(self.prompt))
        self.eos_id, self.on_tokens = eos_id, on_tokens
        self.out: list[int] = []
        self.last = self.prompt[-1]
        self.result = GenerateResult(tokens=self.out, mode=mode)
        self.done = self.budget <= 0
        self.result.stop = "max_new_tokens" if max_new_tokens <= max_len - len(self.prompt) else "max_len"

    def ids(self, tokens: list[int]) -> Tensor:
        return torch.tensor([tokens], dtype=torch.long, device=self.device)

    def warm(self, step: Step | EagerStep, lengths: list[int]) -> None:
        """Compile `step` for these input lengths before anything is timed (a no-op for eager steps);
        the time goes to result.compile_s, never into the decode times."""
        self.result.compile_s += step.warm(self.cache, lengths)

    def prefill(self, step: Step | EagerStep) -> None:
        """Cache the prompt without its last token (that one starts the decode loop)."""
        t0 = _now(self.device)
        if len(self.prompt) > 1:
            step.prefill(self.ids(self.prompt[:-1]), self.cache)
        self.result.prefill_s = _now(self.device) - t0
        self.t0 = _now(self.device)

    @property
    def remaining(self) -> int:
        return self.budget - len(self.out)

    def emit(self, new: list[int]) -> None:
        """Append new tokens, cut at EOS / the budget, stream them."""
        new = new[: self.remaining]
        if self.eos_id is not None and self.eos_id in new:
            new = new[: new.index(self.eos_id) + 1]
            self.done, self.result.stop = True, "eos"
        self.out.extend(new)
        self.last = new[-1]
        if self.remaining <= 0:
            self.done = True
        if self.on_tokens is not None and new:
            self.on_tokens(new)

    def finish(self) -> GenerateResult:
        self.result.decode_s = _now(self.device) - self.t0 if self.out else 0.0
        return self.result


def _pick(logits: Tensor, temperature: float, gen: torch.Generator | None) -> int:
    """Next token from logits (V,): argmax at temperature 0, else a sample of softmax(logits / T)."""
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=gen))


def _generator(seed: int | None, device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed())
    return gen


def _seq_forward(model: GPT, compile: bool = False, step: Step | EagerStep | None = None) -> Step | EagerStep:
    return step if step is not None else sequential_step(model, compile)


def _snlp_forward(model: GPT, plan: Plan, compile: bool = False, step: Step | EagerStep | None = None
                  ) -> Step | EagerStep:
    # fused once per call; no NaN/inf check inside the step (a host sync per token)
    return step if step is not None else snlp_step(bind(model, plan, check_finite=False), compile)


def _slack(*steps) -> int:
    return max(s.slack for s in steps)


# ----- autoregressive: sequential and SNLP -----
def _autoregressive(model, prompt_ids, forward, mode, plan, max_new_tokens, temperature, eos_id, seed, max_len,
                    on_tokens) -> GenerateResult:
    _check_common(max_new_tokens, temperature)
    with torch.inference_mode():
        ses = _Session(model, prompt_ids, max_new_tokens, eos_id, max_len, on_tokens, mode, forward, _slack(forward))
        ses.result.plan = None if plan is None else str(plan)
        gen = _generator(seed, ses.device) if temperature > 0 else None
        ses.warm(forward, [forward.prefill_len(len(ses.prompt) - 1), 1])
        ses.prefill(forward)
        res = ses.result
        while not ses.done:
            t0 = _now(ses.device)
            x = ses.ids([ses.last])
            nxt = _pick(forward(x, ses.cache)[0, -1], temperature, gen)  # from logits (V,)
            res.step_s += _now(ses.device) - t0  # timed like the speculative drafter's steps
            res.steps += 1
            res.forwards += 1
            ses.emit([nxt])
        return ses.finish()


def sequential_generate(model: GPT, prompt_ids, max_new_tokens: int = 64, temperature: float = 0.0,
                        eos_id: int | None = None, seed: int | None = None, max_len: int | None = None,
                        on_tokens: Callable[[list[int]], None] | None = None, compile: bool = False,
                        step: Step | EagerStep | None = None) -> GenerateResult:
    """KV-cached sequential decoding (the reference). Greedy at temperature 0. `compile`: the prefill and
    the decode step run as compiled static-shape steps (snlp.steps; compiled before timing, compile_s);
    `step` passes a prebuilt one (snlp.steps.sequential_step) so repeated calls share its graphs."""
    return _autoregressive(model, prompt_ids, _seq_forward(model, compile, step), "sequential", None,
                           max_new_tokens, temperature, eos_id, seed, max_len, on_tokens)


def snlp_generate(model: GPT, prompt_ids, plan: Plan | str, max_new_tokens: int = 64, temperature: float = 0.0,
                  eos_id: int | None = None, seed: int | None = None, max_len: int | None = None,
                  on_tokens: Callable[[list[int]], None] | None = None, compile: bool = False,
                  step: Step | EagerStep | None = None) -> GenerateResult:
    """KV-cached decoding with every forward (prefill included) an SNLP solve. Suffix K/V in the
    cache are those of the last iteration's inputs; for K >= chunks this is exactly the fused
    model of `plan` decoded sequentially (the original model for M = 1). `compile` / `step`: as in
    `sequential_generate` (snlp.steps.snlp_step)."""
    plan = _as_plan(model, plan)
    return _autoregressive(model, prompt_ids, _snlp_forward(model, plan, compile, step), "snlp", plan,
                           max_new_tokens, temperature, eos_id, seed, max_len, on_tokens)


# ----- self-speculative decoding -----
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
                         verify: Step | EagerStep | None = None) -> GenerateResult:
    """Self-speculative decoding: the SNLP forward of `plan` drafts `block` tokens autoregressively
    (cached), the sequential model scores the B+1 positions in one cached forward, the longest
    agreeing prefix plus one verifier token is kept and the cache is rolled back past the rejection.

    Drafter and verifier share ONE KV cache: the verifier rewrites every verified position with exact
    K/V, so the drafter always conditions on the exact history (snlp.cache). Greedy (temperature 0)
    output equals `sequential_generate`; with temperature > 0 rejection sampling keeps the model's
    distribution. Note: the verifier scores B+1 positions in one forward, so in low precision its
    logits may differ from one-token steps by rounding (near-ties can flip; float64 is exact).
    `compile`: drafter and verifier run as compiled static-shape steps (snlp.steps; the verifier always
    scores B+1 positions, a short last round padded); `draft` / `verify` pass prebuilt ones."""
    _check_common(max_new_tokens, temperature, block)
    plan = _as_plan(model, plan)
    draft_fwd, verify_fwd = _snlp_forward(model, plan, compile, draft), _seq_forward(model, compile, verify)
    greedy = temperature == 0
    with torch.inference_mode():
        ses = _Session(model, prompt_ids, max_new_tokens, eos_id, max_len, on_tokens, "speculative", verify_fwd,
                       _slack(draft_fwd, verify_fwd) + block)
        res, cache, dev = ses.result, ses.cache, ses.device
        res.plan, res.block = str(plan), block
        gen = None if greedy else _generator(seed, dev)
        ses.warm(verify_fwd, [verify_fwd.prefill_len(len(ses.prompt) - 1), block + 1])
        ses.warm(draft_fwd, [1])
        ses.prefill(verify_fwd)
        while not ses.done:
            P, Bk = cache.length, min(block, ses.remaining - 1)  # no drafts past the budget
            t0 = _now(dev)
            drafts, qs, x = [], [], ses.last
            for _ in range(Bk):  # the drafter: SNLP decode steps, cached
                logits = draft_fwd(ses.ids([x]), cache)[0, -1]
                if greedy:
                    x = int(logits.argmax())
                else:
                    qs.append(torch.softmax(logits.float() / temperature, -1))
                    x = int(torch.multinomial(qs[-1], 1, generator=gen))
                drafts.append(x)
            t1 = _now(dev)
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
            res.add_round(Bk, n, steps=Bk, forwards=Bk + 1, draft_s=t1 - t0, verify_s=_now(dev) - t1)
            ses.emit(drafts[:n] + [nxt])
        return ses.finish()


# ----- Jacobi decoding -----
def jacobi_generate(model: GPT, prompt_ids, plan: Plan | str | None = None, block: int = 4,
                    max_new_tokens: int = 64, eos_id: int | None = None, max_iters: int | None = None,
                    max_len: int | None = None, on_tokens: Callable[[list[int]], None] | None = None,
                    verify: bool = True, warm_start: bool = False) -> GenerateResult:
    """Greedy Jacobi decoding (Santilli et al. 2023) of blocks of `block` future tokens (the
    lookahead window W). Each iteration feeds [last, g_1..g_B] in one cached forward and replaces
    the guesses by the argmax predictions, until a fixed point or `max_iters` (default B+1, enough
    for an exact forward).

    With `plan` every iteration is an SNLP forward. `verify` (the decoding mode): the final guesses
    are checked by one sequential forward (longest agreeing prefix + 1 token kept), so the output
    equals sequential greedy decoding. `verify=False` (the measurement mode of the paper's
    JD-coupling table, App. "Coupling SNLP with Jacobi Decoding"): the round keeps the longest
    prefix of the guesses that the LAST SNLP iteration reproduces, plus its next prediction, with no
    sequential forward, so the output may differ from sequential greedy decoding (compare with
    `metrics.ar_match`). `warm_start` (h0-JD, needs a plan): the first JD iteration of a round
    solves from the plan's init; later ones recompute the prefix state h_S of the new guesses but
    start the suffix chunk states from the previous JD iteration's final states (features of the old
    guesses); without it every iteration is a fresh SNLP solve (naive composition). Without a plan
    the Jacobi forwards are the sequential model itself and the last iteration is the check.
    Counters: jacobi_iters = JD iterations (forwards of the Jacobi model), forwards = jacobi_iters
    plus one sequential check per round when verifying; accepted + rounds = tokens kept before the
    budget/EOS cut."""
    _check_common(max_new_tokens, 0.0, block)
    plan = None if plan is None else _as_plan(model, plan)
    if max_iters is not None and (not isinstance(max_iters, int) or max_iters < 1):
        raise ValueError(f"max_iters must be an integer >= 1 (got {max_iters!r})")
    if warm_start and plan is None:
        raise ValueError("warm_start (h0-JD) warm-starts SNLP chunk states: it needs a plan")
    seq_fwd = _seq_forward(model)
    runner = None if plan is None else bind(model, plan, check_finite=False)
    jac_fwd = seq_fwd if plan is None else snlp_step(runner)
    if warm_start:
        def warm_fwd(idx, cache, init):  # -> logits, final chunk states (C, 1, T, D)
            res = runner.solve(idx, cache=cache, keep_states=True, init_states=init)
            return model.head(res.hidden), res.states[-1]
    with torch.inference_mode():
        ses = _Session(model, prompt_ids, max_new_tokens, eos_id, max_len, on_tokens, "jacobi")
        res, cache, dev = ses.result, ses.cache, ses.device
        res.plan, res.block = None if plan is None else str(plan), block
        res.extra.update(verify=verify, warm_start=warm_start)
        ses.prefill(seq_fwd)
        carry: list[int] = []  # guesses left over from the previous block
        while not ses.done:
            P, Bk = cache.length, min(block, ses.remaining - 1)
            g = (carry + [ses.last] * Bk)[:Bk]
            t0 = _now(dev)
            states = None
            for it in range(max_iters or Bk + 1):
                cache.rollback(P)
                if warm_start:
                    logits, states = warm_fwd(ses.ids([ses.last] + g), cache, states)
                else:
                    logits = jac_fwd(ses.ids([ses.last] + g), cache)
                pred = logits[0].argmax(-1).tolist()  # (Bk+1,)
                res.jacobi_iters += 1
                converged = pred[:Bk] == g
                if converged or it + 1 == (max_iters or Bk + 1):
                    break
                g = pred[:Bk]
            t1 = _now(dev)
            if plan is not None and verify:  # sequential check of the SNLP-Jacobi fixed point
                g = pred[:Bk]
                cache.rollback(P)
                pred = seq_fwd(ses.ids([ses.last] + g), cache)[0].argmax(-1).tolist()
                res.forwards += 1
            n = next((i for i, (d, t) in enumerate(zip(g, pred)) if d != t), Bk)
            cache.rollback(P + n + 1)
            carry = pred[n + 1:]
            res.add_round(Bk, n, steps=it + 1, forwards=it + 1, draft_s=t1 - t0, verify_s=_now(dev) - t1)
            ses.emit(g[:n] + [pred[n]])
        return ses.finish()


# ----- CLI -----
def add_arguments(p) -> None:
    p.add_argument("ckpt", help="checkpoint directory (snlp.checkpoint.save_checkpoint)")
    p.add_argument("--prompt", default="", help="prompt text (the tokenizer's BOS is prepended)")
    p.add_argument("--chat", action="store_true", help="instruct models: wrap --prompt as a user turn with the "
                   "tokenizer's chat template (no extra BOS) and stop at its EOS unless --eos-id is given")
    p.add_argument("--mode", default="sequential", help=f"one of {', '.join(MODES)}")
    p.add_argument("--plan", default=None, help="SNLP plan for snlp/speculative/jacobi, e.g. 4xF1-h0-K1")
    p.add_argument("--block", type=int, default=4, help="draft block size B (speculative, jacobi)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--eos-id", type=int, default=None, help="stop after this token id (default: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-baseline", action="store_true",
                   help="speculative mode: skip the timed comparison with sequential decoding (no measured "
                        "speedup / s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="speculative mode: timed rounds of sequential and speculative decoding after one warm-up "
                        "round of each; the speedups reported are medians")
    p.add_argument("--compile", action="store_true",
                   help="run prefill and decode steps compiled (torch.compile fullgraph static-shape steps, CUDA graphs on "
                        "CUDA; sequential, snlp and speculative modes); compile time is reported, not timed")
    p.add_argument("--quiet", action="store_true", help="do not stream the text")
    p.add_argument("--json", default=None, help="write tokens, text and statistics to this JSON file")
    p.add_argument("--distributed", action="store_true",
                   help="layer-parallel over torchrun ranks (snlp.distributed): `torchrun --nproc_per_node=P -m snlp "
                        "generate CKPT --distributed --plan ... --mode snlp|speculative|sequential`")
    p.add_argument("--dist-timeout", type=float, default=120.0,
                   help="--distributed: seconds before a dead or silent peer rank makes the others fail")


def run(args) -> int:
    if getattr(args, "distributed", False):
        from .distcli import run_generate

        return run_generate(args)
    if args.mode not in MODES:
        raise ValueError(f"unknown mode {args.mode!r}: valid modes are {', '.join(MODES)}")
    if args.mode != "sequential" and args.plan is None and args.mode != "jacobi":
        raise ValueError(f"--mode {args.mode} needs --plan (e.g. --plan 4xF1-h0-K1)")
    if args.mode == "jacobi" and args.temperature != 0:
        raise ValueError("--mode jacobi is greedy only: use --temperature 0")
    if args.mode == "jacobi" and getattr(args, "compile", False):
        raise ValueError("--compile supports the sequential, snlp and speculative modes (Jacobi rounds change shape "
                         "every iteration); drop --compile for --mode jacobi")
    _check_common(args.max_new_tokens, args.temperature, args.block)
    if args.mode == "speculative" and not args.no_baseline and args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1 (got {args.repeats})")
    device = cli_device(args.device)
    if not Path(args.ckpt).exists():
        raise FileNotFoundError(f"checkpoint {args.ckpt} does not exist")
    from .checkpoint import load  # the checkpoint format belongs to the training module

    model, tok = load(args.ckpt, device="cpu")
    model = model.to(device).eval()
    if tok is None:
        raise ValueError(f"checkpoint {args.ckpt} has no tokenizer; save it with one to use `snlp generate`")
    eos_id = args.eos_id
    if args.chat:
        prompt = list(tok.encode(tok.apply_chat_template([{"role": "user", "content": args.prompt}])))
        eos_id = tok.eos_id if eos_id is None else eos_id
    else:
        prompt = ([tok.bos_id] if getattr(tok, "bos_id", None) is not None else []) + list(tok.encode(args.prompt))
    plan = None if args.plan is None else Plan.parse(args.plan, model.config.n_layer)
    kw = dict(max_new_tokens=args.max_new_tokens, eos_id=eos_id)
    compile = getattr(args, "compile", False)

    printed = [""]

    def stream(_new: list[int]) -> None:  # decode everything so far: merges across tokens stay right
        text = tok.decode(res_tokens)
        sys.stdout.write(text[len(printed[0]):])
        sys.stdout.flush()
        printed[0] = text

    res_tokens: list[int] = []
    on_tokens = None if args.quiet else (lambda new: (res_tokens.extend(new), stream(new)))
    if not args.quiet:
        sys.stdout.write(args.prompt)
    if args.mode == "sequential":
        res = sequential_generate(model, prompt, temperature=args.temperature, seed=args.seed, on_tokens=on_tokens,
                                  compile=compile, **kw)
    elif args.mode == "snlp":
        res = snlp_generate(model, prompt, plan, temperature=args.temperature, seed=args.seed, on_tokens=on_tokens,
                            compile=compile, **kw)
    elif args.mode == "speculative":
        res = speculative_generate(model, prompt, plan, block=args.block, temperature=args.temperature,
                                   seed=args.seed, on_tokens=on_tokens, compile=compile, **kw)
    else:
        res = jacobi_generate(model, prompt, plan, block=args.block, on_tokens=on_tokens, **kw)
    if not args.quiet:
        sys.stdout.write("\n")
    text = tok.decode(res.tokens)
    stats = f"[{res.mode}{' ' + res.plan if res.plan else ''}] {len(res.tokens)} tokens, " \
            f"{res.tokens_per_s:.1f} tok/s, stop: {res.stop}"
    if compile:
        stats += f", compiled in {res.compile_s:.1f} s (before timing, not in tok/s)"
    record = {"tokens": res.tokens, "text": text, **{k: v for k, v in res.to_dict().items() if k != "tokens"}}
    if res.mode in ("speculative", "jacobi"):
        stats += f", B={res.block}, alpha={res.acceptance_rate:.3f}, tokens/round={res.tokens_per_round:.2f}"
    if res.mode == "speculative" and not args.no_baseline:  # s and the measured speedup: warm, repeated, medians
        # the same stop rule as the run above (eos_id: the chat EOS under --chat), so both sides of the
        # comparison decode the same tokens and the speedup compares runs of the same length
        rows, seq_tokens = speculative_benchmark(model, [prompt], plan, (args.block,), args.max_new_tokens,
                                                 repeats=args.repeats, warmup=1, temperature=args.temperature,
                                                 seed=args.seed, eos_id=eos_id, compile=compile)
        rep = rows[0]
        record["report"] = rep
        record["sequential_tokens_per_s"] = 1e3 / rep["sequential_ms_per_token"]
        record["matches_sequential"] = rep["matches_sequential"] and res.tokens == seq_tokens[0]
        stats += (f", s={rep['drafter_speedup_s']:.2f}, speedup measured {rep['measured_speedup']:.2f}x "
                  f"vs ideal SSD {rep['ideal_ssd_speedup']:.2f}x (medians of {args.repeats} runs after a warm-up; "
                  f"sequential {record['sequential_tokens_per_s']:.1f} tok/s)")
    print(stats)
    if args.json:
        write_json(args.json, record)
    return 0

"""The KV-cached decode benchmark: per-token latency of sequential, SNLP and self-speculative decoding.

`snlp bench --decode` (snlp.apps.bench) drives it; the suite (snlp.bench.suite) reuses it.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch

from snlp.bench.stats import paired_fields
from snlp.decode.batch import check_batch_plan
from snlp.decode.generate import sequential_generate, snlp_generate
from snlp.decode.penalty import check_repetition_penalty
from snlp.decode.session import pooled_alpha
from snlp.decode.speculative import ideal_ssd_speedup, speculative_generate
from snlp.decode.steps import host_syncs, sequential_step, snlp_step
from snlp.method.plan import Plan
from snlp.method.solver import Runner, bind
from snlp.model.cache import KVCache
from snlp.model.gpt import GPT, eval_mode
from snlp.runtime.timing import round_order


@dataclass
class DecodeRow:
    """One row of the decode benchmark: a mode (sequential / snlp / speculative), plan and block size."""

    mode: str  # sequential, snlp (the plan decodes alone) or speculative (the plan drafts, sequential verifies)
    plan: str  # "sequential" or the plan's text
    block: int | None  # speculative draft block size B; None otherwise
    ms_per_token: float  # median over runs
    tokens_per_s: float
    speedup: float  # sequential ms/token over this row's
    matches_sequential: bool  # every timed run's greedy tokens equal sequential's (every run of it)
    new_tokens: int
    prompt_len: int
    runs: int
    n_layer: int
    device: str
    dtype: str
    compiled: bool
    compile_s: float  # compile time of this row's steps (speculative: drafter + verifier), never timed
    repetition_penalty: float  # the penalty every row (and the sequential reference) decoded with; 1 = none
    host_syncs: float | None  # host syncs per compiled step (0 is the contract); None when eager
    # sequential row only: gpt-fast's "bandwidth achieved" = model bytes x tokens/s
    model_bytes: int | None = None
    bandwidth_gb_s: float | None = None
    # speculative rows only
    alpha: float | None = None  # acceptance rate, pooled over the timed runs: accepted over examined drafts
    alpha_runs: list[float | None] | None = None  # each timed run's alpha, in run order (None: drafted nothing)
    tokens_per_round: float | None = None  # pooled over the timed runs: tokens over rounds
    drafter_speedup_s: float | None = None  # sequential over drafter ms per cached single-token step
    drafter_ms_per_step: float | None = None
    sequential_ms_per_step: float | None = None
    ideal_ssd_speedup: float | None = None  # from alpha, B and s (snlp.decode.generate.ideal_ssd_speedup)
    # noise: every run calls each row once, round-robin, so run i of this row and of sequential pair up
    ms_per_token_runs: list[float] | None = None  # every timed run's ms/token, in run order
    speedup_rounds: list[float] | None = None  # per run: sequential ms/token / this row's (None for sequential)
    speedup_verdict: str | None = None  # snlp.bench.stats.paired_verdict of speedup_rounds: faster | slower | tie
    speedup_wins: int | None = None
    speedup_losses: int | None = None
    speedup_p: float | None = None
    drafter_speedup_rounds: list[float] | None = None  # speculative rows: s of each run (its paired steps)
    drafter_speedup_verdict: str | None = None  # paired_verdict of drafter_speedup_rounds
    drafter_speedup_wins: int | None = None  # runs whose drafter step beat sequential's / lost to it
    drafter_speedup_losses: int | None = None
    drafter_speedup_p: float | None = None  # the two-sided sign test's p over drafter_speedup_rounds
    # speculative rows: each timed run's median single-token step, in run order, of the drafter and of the
    # sequential model (the same runs' steps): drafter_ms_per_step, sequential_ms_per_step and s are their medians'
    drafter_ms_per_step_runs: list[float] | None = None
    sequential_ms_per_step_runs: list[float] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def model_bytes(model: GPT) -> int:
    """Bytes of the model's parameters and buffers: what one sequential decode step streams from memory
    (gpt-fast's "model size"; tied embeddings counted once)."""
    seen, n = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            n += t.numel() * t.element_size()
    return n


def draft_runners(model: GPT, specs) -> dict[tuple[Plan, bool], Runner]:
    """One bound drafter per distinct (plan, shared weights) of `specs`. Shared ones over any suffixes are views of
    the model's one copy of its weights (snlp.method.sharing homes every layer once), so the "+shared" rows time
    drafters that add no weight bytes (`storage_bytes`)."""
    return {(p, s): bind(model, p, check_finite=False, share_weights=s) for p, s in dict.fromkeys(specs)}


def storage_bytes(model: GPT, runners=()) -> int:
    """Bytes of the distinct storages holding the model's parameters and the runners' floating-point chunk
    weights (integer layout tensors, built from the config, left out): the model's own bytes when every runner
    shares them, plus a copy of the suffix per unshared runner."""
    seen = {}
    tensors = list(model.parameters()) + [t for r in runners for t in vars(r.weights).values()
                                          if isinstance(t, torch.Tensor) and t.is_floating_point()]
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def decode_benchmark(model: GPT, plans: list[Plan], prompt_len: int = 16, new_tokens: int = 64,
                     blocks: tuple[int, ...] = (4,), warmup: int = 1, runs: int = 5, seed: int = 0,
                     compile: bool = False, share_weights: bool = False, min_confidence: float = 0.0,
                     adaptive: bool = False, repetition_penalty: float = 1.0) -> list[DecodeRow]:
    """KV-cached greedy decoding, measured round-robin in one process: per-token latency of sequential
    and of SNLP decoding with each plan, then speculative decoding (plan drafts, sequential verifies)
    with alpha, tokens/round, the drafter speedup s, measured and ideal speedup vs sequential. The
    sequential row also gives the achieved memory bandwidth, model bytes x tokens/s (gpt-fast's figure).

    `compile`: every side runs compiled static-shape steps (snlp.decode.steps: prefill, the one-token step, the
    verifier's B+1 positions, fullgraph; CUDA graphs on CUDA), built once here and shared by every run, so
    the baseline gets the same treatment as the plans. Compilation happens in the warm-up (and in each
    generate call's own warm-up, before its timer starts); its time is reported in `compile_s`, never in
    the latencies. With `compile`, each row's `host_syncs` counts the host syncs per step of its compiled
    steps (snlp.decode.steps.host_syncs: sync-debug mode on CUDA, a profiler count on CPU): 0 is the contract.
    `share_weights` / `min_confidence` / `adaptive`: the speculative rows' drafter options (speculative_generate).
    `repetition_penalty`: every row decodes with it (snlp.decode.penalty), so `matches_sequential` compares the
    same decoding."""
    for plan in plans:
        plan.check(model.config.n_layer)
    if prompt_len < 1 or new_tokens < 1 or not blocks or min(blocks) < 1:
        raise ValueError("--prompt-len, --new-tokens and every block size must be >= 1")
    pen = dict(repetition_penalty=check_repetition_penalty(repetition_penalty))
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=gen).tolist()
    with eval_mode(model):  # a caller's model leaves with every submodule in the mode it came in
        seq = sequential_step(model, compile)  # built once: compiled graphs are shared by every run
        runners = draft_runners(model, [(plan, share_weights) for plan in plans])
        drafts = {plan: snlp_step(runners[(plan, share_weights)], compile) for plan in plans}
        spec_kw = dict(min_confidence=min_confidence, adaptive=adaptive, **pen)
        fns = {("sequential", None, 0): lambda: sequential_generate(model, prompt, new_tokens, step=seq, **pen)}
        for plan in plans:
            fns[("snlp", plan, 0)] = (lambda p: lambda: snlp_generate(model, prompt, p, new_tokens, step=drafts[p],
                                                                      **pen))(plan)
        for plan in plans:
            for b in blocks:
                fns[("speculative", plan, b)] = (lambda p, b: lambda: speculative_generate(
                    model, prompt, p, b, new_tokens, draft=drafts[p], verify=seq, **spec_kw))(plan, b)
        for r in range(warmup):
            for key in round_order(fns, r):
                fns[key]()
        results = {key: [] for key in fns}
        for r in range(runs):  # round-robin, the order rotated: drift and the row before hit every row alike
            for key in round_order(fns, r):
                results[key].append(fns[key]())
        syncs = _compiled_syncs(model, seq, drafts, prompt_len + new_tokens + seq.slack + max(blocks),
                                max(blocks)) if compile else None
        return _rows(model, results, seq, drafts, syncs, dict(new_tokens=new_tokens, prompt_len=prompt_len, runs=runs,
                                                              compiled=compile, **pen))


def _compiled_syncs(model: GPT, seq, drafts: dict, max_len: int, block: int) -> dict:
    """Host syncs per compiled step, on the very steps timed (0 expected; snlp.decode.steps.host_syncs):
    {None: sequential one-token step, "verify": the verifier's block + 1 positions, plan: its drafter}."""
    syncs = {}
    with torch.inference_mode():
        size = seq.cache_len(max_len)  # a bucket the runs used
        for key, step, T in [(None, seq, 1), ("verify", seq, block + 1)] + [(p, d, 1) for p, d in drafts.items()]:
            cache = KVCache.for_model(model, max_len=size)
            syncs[key] = host_syncs(step, cache, T, calls=2) / 2
    return syncs


def _rows(model: GPT, results: dict, seq, drafts: dict, syncs: dict | None, common: dict) -> list[DecodeRow]:
    """One DecodeRow per (mode, plan, block) from the runs' GenerationResults (sequential first)."""
    key0 = ("sequential", None, 0)
    ms = {key: statistics.median(1e3 * r.decode_s / len(r.tokens) for r in rs) for key, rs in results.items()}
    seq_step_ms = statistics.median(r.ms_per_step for r in results[key0])
    ref_tokens = results[key0][0].tokens
    param = next(model.parameters())
    per_run = {key: [1e3 * r.decode_s / len(r.tokens) for r in rs] for key, rs in results.items()}
    rows = []
    seq_agree = all(x.tokens == ref_tokens for x in results[key0])  # a run of sequential that differs: no row matches
    for (mode, plan, b), rs in results.items():
        t = ms[(mode, plan, b)]
        rounds = None if mode == "sequential" else [a / x for a, x in zip(per_run[key0], per_run[(mode, plan, b)])]
        row = DecodeRow(
            mode=mode, plan="sequential" if plan is None else str(plan), block=b or None, ms_per_token=t,
            tokens_per_s=1e3 / t, speedup=ms[key0] / t,
            # every timed run, as the median's: a run whose tokens differ is a row that does not match
            matches_sequential=seq_agree and all(x.tokens == ref_tokens for x in rs),
            n_layer=model.config.n_layer, device=str(param.device), dtype=str(param.dtype).replace("torch.", ""),
            compile_s=seq.compile_s if plan is None else drafts[plan].compile_s + (seq.compile_s if b else 0.0),
            host_syncs=None if syncs is None else syncs[plan] + (syncs["verify"] if b else 0.0),
            ms_per_token_runs=per_run[(mode, plan, b)], **paired_fields("speedup", rounds), **common)
        if mode == "sequential":
            row.model_bytes = model_bytes(model)
            row.bandwidth_gb_s = row.model_bytes * row.tokens_per_s / 1e9
        # alpha and tokens/round over the same timed runs as the median times (pooled: accepted over examined
        # drafts, tokens over rounds, of all of them), each run's alpha beside
        examined = sum(x.examined for x in rs)
        n_rounds = sum(x.rounds for x in rs)
        tokens_per_round = sum(len(x.tokens) for x in rs) / n_rounds if n_rounds else float("nan")
        if mode == "speculative" and not examined:  # one new token (the prefill's): nothing drafted, so alpha,
            # s and the ideal are not measured (None, said under the table) and the row keeps its timing only
            row.tokens_per_round = tokens_per_round
        elif mode == "speculative":
            draft_ms = statistics.median(x.draft_ms_per_step for x in rs)
            # drafter speedup, like with like: sequential over drafter ms per cached single-token step
            row.drafter_speedup_s = seq_step_ms / draft_ms
            s_rounds = [q.ms_per_step / x.draft_ms_per_step for q, x in zip(results[key0], rs)
                        if x.draft_ms_per_step]  # a run that drafted nothing has no s
            for k, v in paired_fields("drafter_speedup", s_rounds).items():
                setattr(row, k, v)
            row.alpha, row.tokens_per_round = pooled_alpha(rs), tokens_per_round
            row.alpha_runs = [pooled_alpha([x]) for x in rs]
            row.drafter_ms_per_step, row.sequential_ms_per_step = draft_ms, seq_step_ms
            row.drafter_ms_per_step_runs = [x.draft_ms_per_step for x in rs]
            row.sequential_ms_per_step_runs = [q.ms_per_step for q in results[key0]]
            row.ideal_ssd_speedup = ideal_ssd_speedup(row.alpha, b, row.drafter_speedup_s)
        rows.append(row)
    return rows


@dataclass
class BatchDecodeRow:
    """One row of the batched decode benchmark (`batch_decode_benchmark`): a batch size, a mode and its drafter
    options. tokens_per_s is the batch's aggregate: all rows' tokens over the batch's decode wall time (prefill
    excluded), the median over runs; speedup is over batched sequential decoding at the same batch size."""

    batch: int
    mode: str  # sequential | speculative
    plan: str
    block: int | None
    variant: str  # "" (fixed block), "adaptive" (AdaptiveBlock), "conf:<t>" (min_confidence), "+shared" (share_weights)
    tokens_per_s: float
    speedup: float
    matches_sequential: bool  # every row equals its own single-prompt sequential greedy output, every run
    # pooled over the timed runs, as tokens_per_s is their median: accepted over examined drafts, tokens (drafts)
    # over rounds of every row of every run
    alpha: float | None
    tokens_per_round: float | None
    drafted_per_round: float | None  # drafter work: drafts made per round, those after an accepted stop id too
    new_tokens: int
    prompt_lens: list
    runs: int
    compiled: bool
    repetition_penalty: float  # the penalty every row (and its sequential reference) decoded with; 1 = none
    # noise: each run calls every row of the batch size once, round-robin, so run i of this row and of batched
    # sequential pair up
    tokens_per_s_runs: list[float] | None = None  # every timed run's aggregate tok/s, in run order
    alpha_runs: list[float | None] | None = None  # speculative rows: each timed run's alpha (None: drafted nothing)
    speedup_rounds: list[float] | None = None  # per run: this row's tok/s / batched sequential's (None for sequential)
    speedup_verdict: str | None = None  # snlp.bench.stats.paired_verdict of speedup_rounds: faster | slower | tie
    speedup_wins: int | None = None
    speedup_losses: int | None = None
    speedup_p: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _variants(plans, blocks, share_weights: bool, min_confidence: float, adaptive: bool) -> list[tuple]:
    """(plan, block, variant, speculative_generate kwargs) of every speculative row."""
    out = []
    for plan in plans:
        for b in blocks:
            for shared in (False, True) if share_weights and plan.fuse == 1 else (False,):  # sharing needs M = 1
                tag = "+shared" if shared else ""
                out.append((plan, b, tag, dict(share_weights=shared)))
                if min_confidence:
                    out.append((plan, b, f"conf:{min_confidence:g}{tag}", dict(share_weights=shared,
                                                                             min_confidence=min_confidence)))
                if adaptive:
                    out.append((plan, b, f"adaptive{tag}", dict(share_weights=shared, adaptive=True)))
    return out


def check_batch_plans(plans: list[Plan], batch_sizes, hint: str = "batch size 1 runs it") -> None:
    """Refuse, before any work, a plan batched decoding cannot run (DiagN / Newton: check_batch_plan) when a batch size
    is above 1; a batch of one runs as a single prompt, which every plan supports."""
    if max(batch_sizes, default=1) > 1:
        for plan in plans:
            check_batch_plan(plan, hint)


def batch_decode_benchmark(model: GPT, plans: list[Plan], batch_sizes=(1, 4, 8), prompt_len: int = 16,
                           new_tokens: int = 64, blocks=(4,), warmup: int = 1, runs: int = 3, seed: int = 0,
                           compile: bool = False, share_weights: bool = False, min_confidence: float = 0.0,
                           adaptive: bool = False, repetition_penalty: float = 1.0) -> list[BatchDecodeRow]:
    """Batched greedy decoding (snlp.decode.batch) at each batch size: sequential vs self-speculative with every
    plan x block (x shared weights off/on, x the --min-confidence stop, x the adaptive block), measured round-robin
    in one process after `warmup` untimed runs. The prompts are ragged (lengths prompt_len/2..prompt_len, seeded);
    every row is checked against its own single-prompt sequential output. Steps are built once per side and shared
    by every run (compiled ones during the warm-up). `repetition_penalty`: every row and reference decodes with it
    (each batch row penalised by its own prompt and tokens)."""
    for plan in plans:
        plan.check(model.config.n_layer)
    if prompt_len < 1 or new_tokens < 1 or not blocks or min(blocks) < 1 or min(batch_sizes) < 1:
        raise ValueError("--prompt-len, --new-tokens, every block size and every batch size must be >= 1")
    pen = dict(repetition_penalty=check_repetition_penalty(repetition_penalty))
    check_batch_plans(plans, batch_sizes)  # before the references are decoded and the drafters bound
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, prompt_len // 2), prompt_len + 1, (max(batch_sizes),), generator=gen).tolist()
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    with eval_mode(model):  # a caller's model leaves with every submodule in the mode it came in
        seq = sequential_step(model, compile)
        ref = [sequential_generate(model, p, new_tokens, step=seq, **pen).tokens for p in prompts]
        specs = _variants(plans, blocks, share_weights, min_confidence, adaptive)
        runners = draft_runners(model, [(p, kw.get("share_weights", False)) for p, _, _, kw in specs])
        drafts = {key: snlp_step(r, compile) for key, r in runners.items()}
        rows = []
        for B in batch_sizes:
            ps = prompts[:B]
            fns = {("sequential", "sequential", None, ""): lambda: sequential_generate(model, [*ps], new_tokens,
                                                                                       step=seq, **pen)}
            for plan, b, tag, kw in specs:
                kw = {**{k: v for k, v in kw.items() if k != "share_weights"}, **pen}
                fns[("speculative", str(plan), b, tag)] = (lambda p, b, kw, d: lambda: speculative_generate(
                    model, [*ps], p, b, new_tokens, draft=d, verify=seq, **kw))(
                    plan, b, kw, drafts[(plan, "shared" in tag)])
            rows += _batch_rows(fns, ref[:B], warmup, runs, dict(batch=B, new_tokens=new_tokens, prompt_lens=lens[:B],
                                                                 runs=runs, compiled=compile, **pen))
        return rows


def _batch_rows(fns: dict, ref: list, warmup: int, runs: int, common: dict) -> list[BatchDecodeRow]:
    for r in range(warmup):
        for k in round_order(fns, r):
            fns[k]()
    res = {k: [] for k in fns}
    for r in range(runs):  # round-robin, the order rotated: load drift and the row before hit every row alike
        for k in round_order(fns, r):
            res[k].append(fns[k]())
    runs_tps = {k: [r[0].extra["batch"]["tokens_per_s"] for r in rs] for k, rs in res.items()}
    tps = {k: statistics.median(v) for k, v in runs_tps.items()}
    key0 = ("sequential", "sequential", None, "")
    base = tps[key0]
    rows = []
    for (mode, plan, b, tag), rs in res.items():
        # every timed run's rows, as tokens_per_s is their median (not the last run's alone)
        every = [r for run in rs for r in run]
        rounds, drafted = sum(r.rounds for r in every), sum(r.drafted for r in every)
        acc, exam = sum(r.accepted for r in every), sum(r.examined for r in every)
        spec = mode == "speculative"
        mine = runs_tps[(mode, plan, b, tag)]
        ratios = [x / y for x, y in zip(mine, runs_tps[key0])] if spec else None
        rows.append(BatchDecodeRow(
            mode=mode, plan=plan, block=b, variant=tag, tokens_per_s=tps[(mode, plan, b, tag)],
            speedup=tps[(mode, plan, b, tag)] / base,
            matches_sequential=all([r.tokens for r in run] == ref for run in rs),
            alpha=acc / exam if spec and exam else None,
            tokens_per_round=sum(len(r.tokens) for r in every) / rounds if spec and rounds else None,
            drafted_per_round=drafted / rounds if spec and rounds else None, tokens_per_s_runs=mine,
            alpha_runs=[pooled_alpha(run) for run in rs] if spec else None,
            **paired_fields("speedup", ratios), **common))
    return rows

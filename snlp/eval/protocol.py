"""The evaluation protocol: the sequential model and SNLP plans on validation tokens (paper metrics).

`evaluate(model, val_tokens, plans, EvalConfig, tokenizer=...) -> list[EvalRecord]`, one record per
row, the sequential baseline first (paper, "Metrics and protocol"):
  PPL, dPPL         token-weighted over non-overlapping windows of `seq_len` validation tokens
                    (up to `max_tokens` predicted tokens); dPPL relative to sequential
  Top-1, LogitSim   teacher-forced on the same windows vs the sequential logits: argmax agreement
                    and the mean cosine of the logit vectors
  AR Match, beta    greedy generation of `gen_tokens` tokens from `prompts` validation prompts of
                    `prompt_len` tokens by the paper's loop (every token a forward over the whole prefix:
                    recomputed_greedy), positional agreement with the sequential model
                    (one reference for every row, so rows compare); beta is the implied per-token
                    agreement. `ar_match_fused`: for fused plans (M > 1) the agreement with the paper's
                    reference for them, the same fused model run sequentially (the plan with K = C,
                    named in `ar_fused_reference`); None for M = 1
  EmbSim            cosine of MiniLM sentence embeddings of the decoded continuations vs the
                    sequential ones (snlp.eval.embsim; `pip install snlp[emb]`, offline)
  Speedup           per-token latency of KV-cached greedy decoding (`time_tokens` tokens at batch 1,
                    prompt prefill not timed), sequential over plan: the median of `speedup_rounds`, each
                    timed round's paired ratio, sequential over plan ms/token of that round (pairs
                    share the round's load; the speedrun report's main table pools the same ratios);
                    `latency_ms` is the median of the plan's own rounds; Prefill: the ratio of the
                    median batch-1 forward times over `seq_len` tokens; both measured round-robin in
                    this process after a warm-up (snlp.runtime.timing)
                    The paper's Speedup column is neither ratio's protocol but times what Prefill times:
                    its evaluator (nanochat-snlp snlp/eval_snlp.py, `bench`) takes the mean of 150 batch-1
                    forwards over its 2048-token window (docs/usage.md, "Against the paper's tables")
  Ideal (layers)    ideal_layer_speedup = L / (S + K * evals + [fwd]) layer steps (Plan.ideal_speedup),
                    not to be confused with the self-speculative ideal (generate.ideal_ssd_speedup)
A plan whose solve diverges (NaN/inf) is reported with PPL inf and the note "diverged"; one that stays finite on the
windows but diverges in an AR prompt's decode keeps its teacher-forced columns, with AR Match, beta and EmbSim None
and the note "diverged in decoding".
Data loading is snlp.eval.data, tables / CSV / plots snlp.eval.present, the `snlp eval` command snlp.eval.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from snlp.eval.config import EvalConfig
from snlp.eval.embsim import embedding_sims
from snlp.eval.data import as_tokens, sample_prompts, windows
from snlp.decode.generate import sequential_generate, snlp_generate
from snlp.decode.session import NonFiniteModelError
from snlp.eval.metrics import ar_match, implied_beta, logit_sim, perplexity, top1_agreement
from snlp.model.gpt import GPT, check_gpt, eval_mode
from snlp.method.plan import Plan, parse_plans
from snlp.runtime.device import json_number, progress_bar
from snlp.method.preheat import Preheat
from snlp.method.solver import SNLPDivergenceError, bind, preheat_for
from snlp.runtime.timing import time_round_robin

SEQ = "sequential"
# the note of a plan finite on the PPL windows whose greedy decode of an AR prompt turned NaN/inf: its teacher-forced
# columns stand, its AR Match, β̂ and EmbSim are None, its speed columns measured where the timing prompt decodes
DECODE_DIVERGED = "diverged in decoding"


@dataclass(kw_only=True)
class EvalRecord:
    """One row of `evaluate`: the sequential model (plan "sequential", K/C/M/init None) or a plan.
    Fields in the order of the JSON / CSV columns; None where a value does not apply or could not be
    computed (a diverged plan has ppl inf, note "diverged" and no Top-1 / LogitSim / AR match)."""

    plan: str
    K: int | None = None  # iterations
    S: int | None = None  # sequential prefix layers (L for the sequential model)
    C: int | None = None  # chunks
    M: int | None = None  # layers fused per chunk
    init: str | None = None
    ppl: float = math.nan
    top1: float | None = None
    logit_sim: float | None = None
    note: str = ""  # "", "diverged" or DECODE_DIVERGED (finite on the windows, not in an AR decode)
    delta_ppl: float | None = None  # relative to sequential: 0.055 = +5.5%
    ar_match: float | None = None  # AR match against the sequential model (every row)
    ar_beta: float | None = None  # per-token agreement implied by ar_match over gen_tokens
    ar_match_fused: float | None = None  # fused plans (M > 1): AR match against the same fused model run sequentially
    ar_fused_reference: str | None = None  # that reference plan (K = C); None for M = 1 and the sequential row
    emb_sim: float | None = None
    latency_ms: float | None = None  # median decode ms/token
    prefill_ms: float | None = None  # median ms of a batch-1 forward over seq_len tokens
    speedup: float | None = None  # median of speedup_rounds (not sequential latency_ms / this latency_ms)
    speedup_rounds: list[float] | None = None  # per timed round: sequential / this ms per token of that round
    prefill_speedup: float | None = None  # sequential prefill_ms / this prefill_ms (a ratio of the two medians)
    # per timed round: sequential / this forward's ms of that round (round-robin: one forward of each per round)
    prefill_speedup_rounds: list[float] | None = None
    ideal_layer_speedup: float | None = None  # L / (S + K * evals + [fwd])
    n_layer: int | None = None
    tokens: int | None = None  # predicted tokens of the PPL windows
    seq_len: int | None = None
    # the model's config sequence_len, the context it was trained for: a seq_len past it measures RoPE extrapolation
    # (evaluate warns); None in records written before it was kept
    model_seq_len: int | None = None
    prompts: int | None = None
    gen_tokens: int | None = None
    device: str | None = None
    dtype: str | None = None
    window_ce: list[float] | None = None  # mean next-token cross-entropy of each PPL window (paired across rows)

    @property
    def is_sequential(self) -> bool:
        return self.plan == SEQ

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EvalRecord":
        """A record from its `to_dict` (e.g. a stored JSON row). Records written before the ideal
        speedups got separate names carry the layer-step ideal as `ideal_speedup`; records written before
        `ar_match_fused` held a fused plan's agreement with its fused reference in `ar_match` (and its
        reference in `ar_reference`), the agreement with the sequential model in `ar_match_seq` where they
        have it: read into the fields of one meaning each; the CLI's `load` key (the run's, not the record's) is
        dropped."""
        d = dict(d)
        # strict JSON (snlp.runtime.outputs.json_safe) holds an inf as "inf" (a diverged plan's PPL and dPPL; any
        # float field's, so that every record to_dict wrote reads back) and a NaN as null: ppl is a float always (its
        # NaN: not measured), the other floats None where not computed; the rounds and windows are lists of floats
        # whose NaN came back as null
        if "ppl" in d:
            d["ppl"] = json_number(d["ppl"])
        for f in dataclasses.fields(cls):  # every float field's "inf" / "-inf" (a string field keeps its text)
            if "float" in str(f.type) and "list" not in str(f.type) and isinstance(d.get(f.name), str):
                d[f.name] = json_number(d[f.name])
        for k in ("speedup_rounds", "prefill_speedup_rounds", "window_ce"):
            if isinstance(d.get(k), list):
                d[k] = [json_number(v) for v in d[k]]
        d.pop("load", None)  # `snlp eval --json`'s rows carry the run's load window (snlp.runtime.load) beside the record
        if "ideal_speedup" in d and "ideal_layer_speedup" not in d:
            d["ideal_layer_speedup"] = d.pop("ideal_speedup")
        if "ar_match_fused" not in d and ("ar_reference" in d or "ar_match_seq" in d):
            fused = (d.get("M") or 1) > 1
            old, seq, ref = d.get("ar_match"), d.pop("ar_match_seq", None), d.pop("ar_reference", None)
            d["ar_match_fused"], d["ar_fused_reference"] = (old, ref) if fused else (None, None)
            d["ar_match"] = seq if seq is not None or fused else old
            gen = d.get("gen_tokens") or 1
            d["ar_beta"] = None if d["ar_match"] is None else implied_beta(d["ar_match"], gen)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown evaluation record fields {unknown}; valid: {sorted(names)}")
        return cls(**d)


@dataclass
class Quality:
    """Teacher-forced metrics of one row (the sequential model or a plan) over the evaluation windows, as
    `teacher_forced` returns them: the quality columns of an `EvalRecord`, and what `snlp tune`'s stage 1 reads."""

    ppl: float  # perplexity on the windows' next tokens; inf when the plan diverged
    top1: float | None  # fraction of positions whose argmax equals sequential's (1.0 for sequential); None: diverged
    logit_sim: float | None  # mean cosine similarity of the logits to sequential's; None: diverged
    note: str = ""  # "" or "diverged" (the solve turned NaN/inf: no metric is measured)
    window_ce: list[float] | None = None  # each window's mean cross-entropy, in window order (the PPL's sample)


@dataclass
class _Timing:  # medians of one row, and its decode ms/token of every timed round (round-robin order)
    latency_ms: float
    prefill_ms: float
    rounds_ms: list[float] = dataclasses.field(default_factory=list)
    prefill_rounds_ms: list[float] = dataclasses.field(default_factory=list)  # each timed round's forward ms


def _bar(total: int, desc: str, cfg: EvalConfig):
    return progress_bar(total, desc, cfg.progress)


# ----- teacher-forced: PPL, Top-1, LogitSim -----
def _logits_fns(model: GPT, plans: list[Plan], preheat: Preheat | None = None) -> dict:
    """name -> idx (B, T) -> logits (B, T, V); the sequential model first (it is the reference).
    Plans check for NaN/inf (SNLPDivergenceError)."""
    return {SEQ: model, **{str(plan): bind(model, plan, preheat=preheat_for(plan, preheat)) for plan in plans}}


@torch.inference_mode()
def teacher_forced(model: GPT, wins: Tensor, plans: list[Plan], cfg: EvalConfig, preheat: Preheat | None = None
                   ) -> dict[str, Quality]:
    """PPL, Top-1 and LogitSim (vs sequential) of the sequential model and each plan over the
    windows wins (W, T + 1); a plan that diverges gets PPL inf and note "diverged"."""
    device = next(model.parameters()).device
    fns = _logits_fns(model, plans, preheat)
    acc = {name: {"nll": 0.0, "top1": 0.0, "sim": 0.0, "n": 0, "win": []} for name in fns}
    diverged = set()
    batches = wins.split(cfg.batch)
    with _bar(len(batches) * len(fns), "PPL / Top-1 / LogitSim", cfg) as bar:
        for b in batches:
            x, y = b[:, :-1].to(device), b[:, 1:].to(device)  # (B, T) inputs, targets
            ref = None
            for name, fn in fns.items():
                bar.update()
                if name in diverged:
                    continue
                try:
                    logits = fn(x)  # (B, T, V) fp32, fp64 for an fp64 model
                except SNLPDivergenceError:
                    diverged.add(name)
                    continue
                if name == SEQ and not bool(torch.isfinite(logits).all()):
                    # the sequential model itself: its NaN/inf would print as PPL "-", and every plan built on the
                    # same weights as "diverged", a failure of the plans that is the model's own
                    raise NonFiniteModelError(f"the model's own forward (not an SNLP plan) gives NaN/inf logits on "
                                              f"the PPL windows ({wins.shape[0]} windows of {wins.shape[1] - 1} tokens): "
                                              f"check its weights are finite, or use a wider --dtype")
                ref = logits if ref is None else ref
                a, n = acc[name], y.numel()
                a["nll"] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
                nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)  # (B, T)
                a["win"] += nll.mean(1).tolist()  # (B,) per window: every row's windows pair by position
                a["top1"] += top1_agreement(logits, ref) * n
                a["sim"] += logit_sim(logits, ref) * n
                a["n"] += n
    return {name: Quality(math.inf, None, None, "diverged") if name in diverged else
            Quality(perplexity(a["nll"], a["n"]), a["top1"] / a["n"], a["sim"] / a["n"], window_ce=a["win"])
            for name, a in acc.items()}


# ----- generation: AR Match, EmbSim -----
def reference_plan(plan: Plan) -> Plan | None:
    """The AR-match reference of a plan: None (the sequential model) for M = 1, else the same fused
    model run sequentially, i.e. the plan with K = C iterations (exact for the fused model); a `causal` plan's is
    its own fused model with full-attention suffix layers (the causal plan at K = C), the function it converges to."""
    return None if plan.fuse == 1 else Plan(chunks=plan.chunks, fuse=plan.fuse, init="h0", iters=plan.chunks,
                                            causal=plan.causal)


def generation_rows(plans: list[Plan]) -> dict[str, Plan | None]:
    """What `generations` decodes, by name: the sequential model (None), each plan, and each plan's AR-match
    reference (shared between plans with the same reference; a plan that is its own reference is one row)."""
    refs_needed = {str(r): r for r in map(reference_plan, plans) if r is not None}
    return {SEQ: None, **{str(p): p for p in plans}, **refs_needed}


@torch.inference_mode()
def recomputed_greedy(fn, prompts: list[list[int]], n: int, device, batch: int = 8) -> list[list[int]]:
    """`n` greedy tokens after each prompt by the paper's AR loop (nanochat-snlp eval_snlp_ar.py ar_generate_no_kv):
    every token is the argmax of `fn` (the sequential model or a bound plan) run over the whole prefix. Prompts of
    one length go `batch` at a time (a row's solve does not depend on its batch: DiagN's probes are one draw shared
    by the rows, `tol` stops each row on its own; sample_prompts' prompts share one length).
    For a plan with 1 < K < plan.exact_iters() or a fwd init below it this is not what KV-cached SNLP decoding
    computes (snlp_generate keeps one K/V per suffix layer, the last evaluation's, where the re-solved prefix attends
    at evaluation k to the earlier positions' evaluation-k K/V), so AR Match reads the paper's definition, the same
    function the teacher-forced columns measure, at n forwards of up to len(prompt) + n tokens per batch."""
    out: list[list[int] | None] = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for rows in by_len.values():
        for k in range(0, len(rows), batch):
            part = rows[k:k + batch]
            ids = torch.tensor([prompts[i] for i in part], dtype=torch.long, device=device)  # (b, T0)
            t0 = ids.shape[1]
            for _ in range(n):
                nxt = fn(ids)[:, -1].argmax(-1, keepdim=True)  # (b, 1); a plan's NaN/inf: SNLPDivergenceError
                ids = torch.cat([ids, nxt], 1)
            for i, row in zip(part, ids[:, t0:].tolist()):
                out[i] = row
    return out


def generations(model: GPT, prompts: list[list[int]], plans: list[Plan], cfg: EvalConfig,
                preheat: Preheat | None = None) -> tuple[dict[str, list[list[int]]], dict[str, list[list[int]]]]:
    """Greedy continuations (prompts x gen_tokens ids) of the sequential model and each plan, and
    each plan's AR-match reference continuations (generation_rows), by the paper's recompute loop
    (recomputed_greedy). A plan (or reference) whose solve raises SNLPDivergenceError on a prompt has no entry (its
    AR Match, β̂ and EmbSim are None: DECODE_DIVERGED)."""
    rows = generation_rows(plans)
    device = next(model.parameters()).device
    out = {}
    with _bar(len(rows) * len(prompts), "AR match generation", cfg) as bar:
        for name, plan in rows.items():
            fn = model if plan is None else bind(model, plan, preheat=preheat_for(plan, preheat))
            try:
                out[name] = recomputed_greedy(fn, prompts, cfg.gen_tokens, device, cfg.batch)
            except SNLPDivergenceError:  # finite on the windows, not on a prompt's prefixes: no AR row, not a crash
                pass  # that loses every row
            bar.update(len(prompts))
    keyed = {str(p): SEQ if reference_plan(p) is None else str(reference_plan(p)) for p in plans}
    refs = {name: out[ref] for name, ref in keyed.items() if ref in out}
    return {name: out[name] for name in [SEQ, *map(str, plans)] if name in out}, {SEQ: out[SEQ], **refs}


# ----- timing: speedup -----
def time_plans(model: GPT, prompt: list[int], window: Tensor, plans: list[Plan], cfg: EvalConfig,
               preheat: Preheat | None = None) -> dict[str, _Timing]:
    """Median decode ms/token (KV-cached greedy, batch 1, `cfg.time_tokens` tokens, prompt prefill
    not timed) and median ms of a batch-1 forward over `window` (1, T) for the sequential model and
    each plan, round-robin after max(cfg.warmup, 1) untimed rounds. The first untimed round decodes each row on its
    own: a plan whose cached decode turns NaN/inf there (SNLPDivergenceError; possible where the AR loop's solve
    stayed finite, the cached decode being another function for 1 < K < C) is left untimed, not a crash that loses
    every row."""
    device = next(model.parameters()).device
    rows = {SEQ: None, **{str(p): p for p in plans}}
    decode_ms: dict[str, list[float]] = {name: [] for name in rows}
    warmup = max(cfg.warmup, 1)
    bar = _bar((warmup + cfg.runs) * len(rows), "decode timing (round-robin)", cfg)

    def decoder(name, plan):  # appends ms/token; generate times its own decode loop (prefill excluded)
        def run():
            r = sequential_generate(model, prompt, cfg.time_tokens) if plan is None else \
                snlp_generate(model, prompt, plan, cfg.time_tokens, preheat=preheat_for(plan, preheat))
            decode_ms[name].append(1e3 * r.decode_s / len(r.tokens))
            bar.update()
        return run

    def forward(plan):
        if plan is None:
            return lambda: model(window)
        runner = bind(model, plan, check_finite=False, preheat=preheat_for(plan, preheat))
        return lambda: runner(window)

    with bar:
        fns = {name: decoder(name, p) for name, p in rows.items()}
        for name in list(fns):  # the first warm-up round
            try:
                fns[name]()
            except SNLPDivergenceError:
                del fns[name], rows[name]
                bar.update(warmup + cfg.runs)
        time_round_robin(fns, warmup - 1, cfg.runs, device)
    with torch.inference_mode():
        prefill = time_round_robin({name: forward(p) for name, p in rows.items()}, warmup, cfg.runs, device)
    return {name: _Timing(latency_ms=statistics.median(decode_ms[name][-cfg.runs:]),  # the timed rounds
                          prefill_ms=statistics.median(prefill[name]), rounds_ms=decode_ms[name][-cfg.runs:],
                          prefill_rounds_ms=list(prefill[name]))
            for name in rows}


# ----- the evaluation -----
def evaluate(model: GPT, val_tokens, plans, cfg: EvalConfig = EvalConfig(), tokenizer=None,
             preheat: Preheat | None = None, on_phase=None) -> list[EvalRecord]:
    """Evaluate the sequential model and each plan (str or Plan) on validation token ids
    `val_tokens` (1-D): one EvalRecord per row, plan "sequential" first, then the plans in order
    (a list's duplicates dropped; a string is a comma-separated list read as `--plans` reads it, snlp.parse_plans:
    a plan named twice is refused, a K past the plan's exact count capped to it with a warning). EmbSim needs
    `tokenizer` (to decode continuations) and the emb extra, else it is None. The model's train / eval mode is
    restored on return (it runs in eval mode). `preheat`: the calibration that plans with the
    preheat init read (others ignore it). `on_phase(records, done)`, if given, is called with every row's record
    after each phase but the last: first with the teacher-forced columns (PPL, dPPL, Top-1, LogitSim), then with
    AR Match and EmbSim too, the speed columns None until the timing (one round-robin over every row) has run: what
    `snlp eval` writes as it goes, so a run cut short keeps the phases it finished."""
    check_gpt(model)
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):  # EmbSim decodes with it, last
        raise TypeError(f"tokenizer must be the model's tokenizer (snlp.Tokenizer, e.g. from snlp.load), got "
                        f"{type(tokenizer).__name__} {tokenizer!r:.40}")
    cfg.check()
    L = model.config.n_layer
    if isinstance(plans, str):  # iterating it would parse its characters as plans ("malformed plan '4'")
        plans = parse_plans(plans, L)
    if isinstance(plans, Plan) or not isinstance(plans, Iterable):  # a Plan or an int failed as "not iterable"
        raise ValueError(f"plans must be a list of plans (strings or Plans) or one comma-separated string, got "
                         f"{type(plans).__name__} {plans!r:.40}")
    plans = list(dict.fromkeys(Plan.parse(p, L) for p in plans))
    device = next(model.parameters()).device
    val = as_tokens(val_tokens)  # (n,)
    # the caller's model leaves as it came: a training loop that evaluates mid-run keeps its train mode
    with eval_mode(model):
        return _evaluate(model, val, plans, cfg, tokenizer, preheat, on_phase, device)


def _evaluate(model: GPT, val, plans: list[Plan], cfg: EvalConfig, tokenizer, preheat: Preheat | None, on_phase,
              device) -> list[EvalRecord]:
    L = model.config.n_layer
    wins = windows(val, cfg.seq_len, cfg.max_tokens)  # (W, T + 1)
    prompts = sample_prompts(val, cfg.prompts, cfg.prompt_len, cfg.seed)
    trained = model.config.sequence_len
    if cfg.seq_len > trained:  # RoPE's tables are computed for any position (GPT.rotary): it runs, as extrapolation
        warnings.warn(f"seq_len {cfg.seq_len} is past the model's sequence_len {trained} (the context it was trained "
                      f"for): the PPL windows measure extrapolation past it, not the model as trained (the records "
                      f"keep both: seq_len, model_seq_len)", stacklevel=2)
    # the AR loop's last forward and the timing decode's last step read prompt_len + n - 1 positions (the last token
    # generated is never fed back)
    reach = cfg.prompt_len + max(cfg.gen_tokens, cfg.time_tokens) - 1
    if reach > trained:
        warnings.warn(f"the AR loop and the decode timing run prompt_len {cfg.prompt_len} + max(gen_tokens "
                      f"{cfg.gen_tokens}, time_tokens {cfg.time_tokens}) - 1 = {reach} positions, past the model's "
                      f"sequence_len {trained}: AR Match and the speed columns measure positions it was not trained "
                      f"for (extrapolation)", stacklevel=2)
    protocol = dict(n_layer=L, tokens=wins.shape[0] * cfg.seq_len, seq_len=cfg.seq_len, model_seq_len=trained,
                    prompts=cfg.prompts,
                    gen_tokens=cfg.gen_tokens, device=str(device),
                    dtype=str(next(model.parameters()).dtype).replace("torch.", ""))
    tf = teacher_forced(model, wins, plans, cfg, preheat)

    def rows(gens, refs, embs, times) -> list[EvalRecord]:
        return [_record(plan, L, tf, gens, refs, embs, times, cfg, protocol) for plan in [None, *plans]]

    if on_phase is not None:
        on_phase(rows({}, {}, {}, None), "PPL, dPPL, Top-1 and LogitSim")
    gens, refs = generations(model, prompts, [p for p in plans if tf[str(p)].note != "diverged"], cfg, preheat)
    embs = embedding_sims(gens, tokenizer, device, SEQ) if cfg.emb else {}
    if on_phase is not None:
        # EmbSim only where it was computed (--no-emb, no tokenizer or no emb extra: its column stays empty)
        on_phase(rows(gens, refs, embs, None), "PPL, dPPL, Top-1, LogitSim, AR Match and EmbSim" if embs else
                 "PPL, dPPL, Top-1, LogitSim and AR Match")
    # every plan, one diverged on the windows too: time_plans leaves untimed a plan whose first (untimed) cached
    # decode of the timing prompt diverges, since that decode is another function than the AR loop's for 1 < K < C
    times = time_plans(model, prompts[0], wins[:1, :-1].to(device), plans, cfg, preheat)
    return rows(gens, refs, embs, times)


def paired_median(seq_ms: list[float], plan_ms: list[float]) -> float:
    """Sequential over plan: the median of each timed round's paired ratio seq_ms[i] / plan_ms[i] (both sides of a
    round ran back to back under the same load)."""
    if not seq_ms:
        raise ValueError("paired_median needs the timed rounds of both sides")
    return statistics.median(a / b for a, b in zip(seq_ms, plan_ms, strict=True))


def _record(plan: Plan | None, L: int, tf, gens, refs, embs, times, cfg: EvalConfig, protocol: dict) -> EvalRecord:
    """One row of `evaluate` from the per-phase results, each keyed by row name (plan None = sequential); `times`
    None: the timing has not run (evaluate's on_phase), the speed columns are None."""
    name = SEQ if plan is None else str(plan)
    ref = None if plan is None else reference_plan(plan)
    ar = ar_match(gens[name], gens[SEQ]) if name in gens else None  # None: diverged
    fused = ar_match(gens[name], refs[name]) if name in gens and name in refs and ref is not None else None
    q = tf[name]
    note = DECODE_DIVERGED if gens and not q.note and name not in gens else q.note
    speed = {} if times is None or name not in times else _speed(times[name], times[SEQ])
    return EvalRecord(
        plan=name, K=None if plan is None else plan.iters, S=L if plan is None else plan.prefix_len(L),
        C=None if plan is None else plan.chunks, M=None if plan is None else plan.fuse,
        init=None if plan is None else plan.init, ppl=q.ppl, top1=q.top1, logit_sim=q.logit_sim, note=note,
        delta_ppl=q.ppl / tf[SEQ].ppl - 1.0, ar_match=ar,
        ar_beta=None if ar is None else implied_beta(ar, cfg.gen_tokens), ar_match_fused=fused,
        ar_fused_reference=None if ref is None else str(ref), emb_sim=embs.get(name), **speed,
        ideal_layer_speedup=1.0 if plan is None else plan.ideal_speedup(L), window_ce=q.window_ce, **protocol)


def _speed(t: _Timing, seq_t: _Timing) -> dict:
    """A row's speed columns from its timing and the sequential row's (paired by round)."""
    return dict(latency_ms=t.latency_ms, prefill_ms=t.prefill_ms, speedup=paired_median(seq_t.rounds_ms, t.rounds_ms),
                speedup_rounds=[a / b for a, b in zip(seq_t.rounds_ms, t.rounds_ms)],
                prefill_speedup=seq_t.prefill_ms / t.prefill_ms,
                prefill_speedup_rounds=[a / b for a, b in zip(seq_t.prefill_rounds_ms, t.prefill_rounds_ms)] or None)

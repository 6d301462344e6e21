"""Correction propagation (App. "Correction Propagation"): PPL with only the last j of N suffix layers
active (the others skipped), j = 1..N, at K = 1..N, IDN vs no correction: the staircase + heat map."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from snlp.eval.analysis.common import AnalysisConfig, add_nll, section_bar
from snlp.eval.data import as_tokens, windows
from snlp.eval.metrics import perplexity
from snlp.method.plan import Plan
from snlp.method.solver import solve
from snlp.model.gpt import GPT


@dataclass
class PropagationResult:
    N: int
    iters: list[int]
    with_correction: list[list[float]]  # [K index][j - 1]: PPL with the last j suffix layers active
    without_correction: list[list[float]]
    tokens: int | None = None  # predicted tokens per cell: min(prop_tokens, --max-tokens) in whole windows, at least one


@torch.inference_mode()
def correction_propagation(model: GPT, val_tokens, cfg: AnalysisConfig = AnalysisConfig()) -> PropagationResult:
    """Subset ablation: the prefix (L - N layers) runs exactly, the first N - j suffix layers are
    skipped and the last j are solved by `jxF1-h0-K{K}` (IDN or none) from the prefix state; over
    cfg.prop_tokens predicted tokens (the prefix runs once per batch for all 2 N^2 cells)."""
    L = model.config.n_layer
    N = min(cfg.prop_suffix, L)
    wins = windows(as_tokens(val_tokens), cfg.seq_len, min(cfg.prop_tokens, cfg.max_tokens))
    device = next(model.parameters()).device
    iters, js, surs = list(range(1, N + 1)), list(range(1, N + 1)), ("idn", "none")
    nll = {(s, K, j): 0.0 for s in surs for K in iters for j in js}
    bad, n_tok = set(), 0
    batches = wins.split(cfg.batch)
    with section_bar(len(batches) * len(nll), "propagation", cfg) as bar:
        for b in batches:
            x, y = b[:, :-1].to(device), b[:, 1:].to(device)  # (B, T)
            ctx = model.embed(x)
            hS = model.run_layers(ctx.x0, ctx, 0, L - N)  # the state before the (partly skipped) suffix
            for key in nll:
                sur, K, j = key
                plan = Plan(chunks=j, iters=K, surrogate=sur)
                b = model.config.backout_layer  # nanochat's backout: a skipped layer's output stands at h_S, as
                hb = None if b is None or b >= L - j else ctx.hb if b < L - N else hS  # the paper's code fills it
                h = solve(model, x, plan, check_finite=False, prefix=hS, hb=hb).hidden
                add_nll(model, h, y, nll, bad, key)
                bar.update()
            n_tok += y.numel()
    ppl = {k: float("inf") if k in bad else perplexity(v, n_tok) for k, v in nll.items()}
    return PropagationResult(N=N, iters=iters, with_correction=[[ppl["idn", K, j] for j in js] for K in iters],
                             without_correction=[[ppl["none", K, j] for j in js] for K in iters], tokens=n_tok)


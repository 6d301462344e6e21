"""Evaluation metrics of the paper's main table (PPL, Top-1, LogitSim, EmbSim, AR Match), the
AR-match -> per-token agreement conversion and the speed-quality Pareto front. Pure functions:
no model, no I/O."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def perplexity(nll_sum: float, n_tokens: int) -> float:
    """Token-weighted perplexity exp(sum of token NLLs / number of tokens); inf on overflow."""
    if n_tokens <= 0:
        raise ValueError(f"perplexity needs at least one token (got n_tokens={n_tokens})")
    try:
        return math.exp(float(nll_sum) / n_tokens)
    except OverflowError:
        return math.inf


def _same_shape(a: Tensor, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs reference {tuple(b.shape)}")


def top1_agreement(logits: Tensor, ref_logits: Tensor) -> float:
    """Fraction of positions whose argmax token equals the reference's. logits, ref_logits (..., V)."""
    _same_shape(logits, ref_logits)
    return (logits.argmax(-1) == ref_logits.argmax(-1)).double().mean().item()  # mean over (...)


def logit_sim(logits: Tensor, ref_logits: Tensor) -> float:
    """Mean over positions of the cosine between logit vectors, in fp32 (fp64 for fp64 logits). logits, ref_logits
    (..., V)."""
    _same_shape(logits, ref_logits)
    return cosine(logits, ref_logits).double().mean().item()  # cosine (...) -> mean


def cosine(a, b) -> Tensor:
    """Cosine similarity along the last dim in fp32, fp64 where an input is fp64 (an fp64 model's logits: 1 - cos of
    a near-exact plan is far below fp32's 6e-8): a, b (..., D) -> (...), e.g. of sentence embeddings."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    dt = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    a, b = a.to(dt), b.to(dt)
    _same_shape(a, b)
    return F.cosine_similarity(a, b, dim=-1)


def ar_match(generated: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """Token-level greedy-generation agreement: #positions i with generated[n][i] == reference[n][i]
    over all N*T reference positions. Purely positional: after a divergence the sequences are not
    re-synchronised, and a missing generated position (e.g. generation stopped at EOS) counts as a
    mismatch (paper App. "Interpreting AR Match Rate"). A generated sequence LONGER than its
    reference is an error: its extra tokens could be compared with nothing and would silently
    drop out. generated, reference: N sequences (lists or a (N, T) tensor)."""
    generated, reference = [list(map(int, g)) for g in generated], [list(map(int, r)) for r in reference]
    if len(generated) != len(reference):
        raise ValueError(f"{len(generated)} generated sequences vs {len(reference)} references")
    longer = [(n, len(g), len(r)) for n, (g, r) in enumerate(zip(generated, reference)) if len(g) > len(r)]
    if longer:
        n, lg, lr = longer[0]
        raise ValueError(f"generated sequence {n} has {lg} tokens but its reference only {lr} ({len(longer)} "
                         f"sequence(s) longer than their reference): AR match compares the same positions, "
                         f"generate at most as many tokens as the reference")
    total = sum(len(r) for r in reference)
    if total == 0:
        raise ValueError("AR match needs at least one reference token")
    return sum(g == r for gen, ref in zip(generated, reference) for g, r in zip(gen, ref)) / total


def _mean_geometric(beta: float, T: int) -> float:
    """alpha(beta) = (1/T) sum_{i=1..T} beta^i = beta (1 - beta^T) / (T (1 - beta)), increasing on [0, 1]."""
    return sum(beta ** i for i in range(1, T + 1)) / T


def implied_beta(alpha: float, T: int = 32) -> float:
    """Per-token agreement beta implied by an AR match rate alpha over T generated tokens under the
    absorbing-divergence model (token i matches with probability beta^i): inverts
    alpha = beta (1 - beta^T) / (T (1 - beta)) by bisection (alpha is increasing in beta on [0, 1],
    from 0 at beta = 0 to 1 at beta = 1). Note: the paper's conversion table follows this formula
    for alpha >= 0.9 only; its lower rows lie up to 0.005 below it (e.g. 0.30 -> 0.9048, the
    formula gives 0.9098)."""
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"T must be an integer >= 1 (got {T!r})")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"AR match rate alpha must lie in [0, 1] (got {alpha})")
    if alpha in (0.0, 1.0):
        return float(alpha)
    lo, hi = 0.0, 1.0
    for _ in range(60):  # interval 2^-60: far below the 4 decimals the paper reports
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _mean_geometric(mid, T) < alpha else (lo, mid)
    return (lo + hi) / 2


def pareto_front(points: Iterable[tuple[float, float]]) -> list[int]:
    """Indices of the (speedup, ppl) points not dominated by another (higher speedup is better,
    lower PPL is better), ordered by increasing speedup. Points with a None or non-finite
    coordinate are never on the front."""
    pts = list(points)
    ok = [i for i, (s, p) in enumerate(pts) if s is not None and p is not None and math.isfinite(s)
          and math.isfinite(p)]

    def dominated(i: int) -> bool:
        (s, p) = pts[i]
        return any(pts[j][0] >= s and pts[j][1] <= p and (pts[j][0] > s or pts[j][1] < p) for j in ok)

    return sorted((i for i in ok if not dominated(i)), key=lambda i: (pts[i][0], -pts[i][1]))

"""The SNLP solver: sequential prefix, then K batched iterations over the fused suffix chunks.

Per iteration k (paper Eq. snlp-iterative, Algorithm "IDN/HCN Batched SNLP Inference"):
    inputs_c  = h_{c-1}^{(k)}            (h_0 = h_S, the exact prefix state)
    tilde_c   = F_c(inputs_c)            all C chunks in ONE batched op (fusion.chunk_forward)
    h_c^{(k+1)} = tilde_c + A_c (h_{c-1}^{(k+1)} - h_{c-1}^{(k)})
Writing d_c = h_c^{(k+1)} - h_c^{(k)} turns the correction into the linear recurrence
    d_c = a_c d_{c-1} + (tilde_c - h_c^{(k)}),   d_0 = 0,
with a scalar a_c for IDN (1, times the ELK factor 1 - elk, times 0 where the correction order
visits chunk c before chunk c-1) and a_c = 0 without correction (Jacobi). For the default
forward IDN this is a prefix sum over chunks (cumsum); otherwise it is one (C x C) transfer
matrix contraction. Either way no Python loop runs over layers or chunks on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import Tensor

from .fusion import ChunkWeights, chunk_forward, chunk_weights
from .model import GPT
from .plan import Plan


class SNLPDivergenceError(FloatingPointError):
    """The SNLP iteration produced NaN/inf hidden states."""


@dataclass
class SolveResult:
    """Outcome of an SNLP solve (or of the fused model run sequentially)."""

    hidden: Tensor  # (B, T, D) final state h_L
    prefix: Tensor  # (B, T, D) exact prefix state h_S
    plan: Plan
    states: list[Tensor] = field(default_factory=list)  # chunk outputs (C, B, T, D); [0] = init


@lru_cache(maxsize=256)
def _transfer(plan: Plan) -> Tensor | None:
    """(C, C) matrix P with d = P @ b solving d_c = a_c d_{c-1} + b_c; None means plain cumsum."""
    C = plan.chunks
    a = [(1.0 - plan.elk) if linked else 0.0 for linked in plan.link()]
    if plan.surrogate == "idn" and all(x == 1.0 for x in a):
        return None
    if plan.surrogate == "none":
        a = [0.0] * C
    P = torch.zeros(C, C, dtype=torch.float64)
    for c in range(C):  # built once per plan (cached), never on the hot path
        if c > 0:
            P[c, :c] = a[c] * P[c - 1, :c]
        P[c, c] = 1.0
    return P


def correct(b: Tensor, plan: Plan) -> Tensor:
    """Solve the correction recurrence over chunks for b = tilde - h_old, b (C, ...)."""
    P = _transfer(plan)
    if P is None:
        return b.cumsum(0)  # IDN, forward order: prefix sum over depth
    return torch.einsum("cj,j...->c...", P.to(device=b.device, dtype=b.dtype), b)


def _as_plan(model: GPT, plan: Plan | str) -> Plan:
    plan = Plan.parse(plan) if isinstance(plan, str) else plan
    return plan.check(model.config.n_layer)


def _check_finite(h: Tensor, plan: Plan) -> None:
    if not bool(torch.isfinite(h).all()):
        raise SNLPDivergenceError(
            f"SNLP plan {plan} diverged: the final hidden state contains NaN/inf. Try more iterations "
            f"(K >= {plan.chunks} is exact), fewer/larger chunks, ELK damping (-elk:0.1) or the h0 init; "
            f"check the sequential forward is finite first.")


def solve(model: GPT, idx: Tensor, plan: Plan | str, keep_states: bool = False,
          check_finite: bool = True, cache=None, weights: ChunkWeights | None = None,
          prefix: Tensor | None = None) -> SolveResult:
    """Run the SNLP solve for token ids idx (B, T). `keep_states` records the chunk-output states
    (C, B, T, D) of the init and of every iteration. Raises SNLPDivergenceError on NaN/inf.

    With a KV `cache` (snlp.cache.KVCache) idx continues the cached sequence (SNLP decoding): the
    prefix layers read/write the cache exactly; every suffix branch attends over the cached K/V
    of earlier positions plus the new tokens' K/V computed from its current input estimate, so
    the K/V left in the cache are those of the inputs the last iteration used. The cache then
    advances by T. `weights` (from `chunk_weights`) skips the cache lookup, e.g. under torch.compile.
    `prefix` is an already computed h_S (B, T, D) for idx, e.g. from the training forward's trace,
    so the prefix layers are not run twice."""
    plan = _as_plan(model, plan)
    S, C = plan.prefix_len(model.config.n_layer), plan.chunks
    ctx = model.embed(idx, cache)
    hS = prefix if prefix is not None else model.run_layers(ctx.x0, ctx, 0, S)  # exact sequential prefix
    w = weights if weights is not None else chunk_weights(model, S, C, plan.fuse)
    h = hS.expand(C, *hS.shape)  # (C, B, T, D) h0 init: every chunk output starts at h_S
    if plan.init == "fwd":
        h = chunk_forward(w, h, ctx, cache)  # one-shot batched forward F_c(h_S)
    states = [h] if keep_states else []
    for _ in range(plan.iters):
        inputs = torch.cat([hS[None], h[:-1]], 0)  # (C, B, T, D): chunk c reads h_{c-1}^{(k)}
        tilde = chunk_forward(w, inputs, ctx, cache)
        h = tilde if plan.surrogate == "none" else h + correct(tilde - h, plan)
        if keep_states:
            states.append(h)
    if cache is not None:
        if plan.iters == 0 and plan.init == "h0":  # nothing evaluated the suffix: write the K/V of
            chunk_forward(w, torch.cat([hS[None], h[:-1]], 0), ctx, cache)  # the final inputs (all h_S)
        cache.advance(idx.shape[1])
    if check_finite:
        _check_finite(h[-1], plan)
    return SolveResult(hidden=h[-1], prefix=hS, plan=plan, states=states)


def parallel_forward(model: GPT, idx: Tensor, plan: Plan | str, check_finite: bool = True, cache=None) -> Tensor:
    """SNLP forward: token ids (B, T) -> logits (B, T, V). With a KV `cache`, an SNLP decode step
    (see `solve`)."""
    return model.head(solve(model, idx, plan, check_finite=check_finite, cache=cache).hidden)


def fused_sequential(model: GPT, idx: Tensor, plan: Plan | str) -> SolveResult:
    """Run the *fused* model of `plan` sequentially (prefix, then chunk 1, 2, ..., C with the same
    fused weights and op as the solver). This is what SNLP converges to for K >= C; fused plans
    are compared against it (AR match, exactness). states[0] holds all chunk outputs (C,B,T,D)."""
    plan = _as_plan(model, plan)
    S = plan.prefix_len(model.config.n_layer)
    ctx = model.embed(idx)
    hS = model.run_layers(ctx.x0, ctx, 0, S)
    w = chunk_weights(model, S, plan.chunks, plan.fuse)
    h, outs = hS, []
    for c in range(plan.chunks):  # inherently sequential: this is the reference, not the solver
        h = chunk_forward(w.chunk(c), h[None], ctx)[0]
        outs.append(h)
    return SolveResult(hidden=h, prefix=hS, plan=plan, states=[torch.stack(outs)])


def fused_forward(model: GPT, idx: Tensor, plan: Plan | str) -> Tensor:
    """Logits (B, T, V) of the fused model of `plan` run sequentially."""
    return model.head(fused_sequential(model, idx, plan).hidden)

"""The SNLP solver: sequential prefix, then K batched iterations over the fused suffix chunks.

Per iteration k (paper Eq. snlp-iterative, Algorithm "IDN/HCN Batched SNLP Inference"):
    inputs_c  = h_{c-1}^{(k)}            (h_0 = h_S, the exact prefix state)
    tilde_c   = F_c(inputs_c)            all C chunks in ONE batched op (fusion.chunk_forward)
    h_c^{(k+1)} = tilde_c + A_c e_{c-1}
Correction order (paper App. "Correction Ordering"): the sweep visits the chunks in the order pi
(`Plan.order`, forward by default) and chunk c is corrected by its predecessor's MOST RECENT update
e_{c-1}: the update of this sweep, d_{c-1}^{(k)} = h_{c-1}^{(k+1)} - h_{c-1}^{(k)}, if pi visits
c-1 before c ("linked"), else the update made in the previous sweep, d_{c-1}^{(k-1)} ("lagged";
d^{(-1)} = 0, so at K = 1 a lagged chunk gets no correction and reversed order equals Jacobi, while
from K = 2 on the previous sweep's updates still propagate along the permutation chain).
Writing d_c = h_c^{(k+1)} - h_c^{(k)} turns the correction into the linear recurrence
    d_c = a_c o d_{c-1} + (tilde_c - h_c^{(k)}) + a'_c o d_{c-1}^{(k-1)},   d_{-1} = 0,
where a_c is the surrogate A_c times the link factor (the ELK factor 1 - elk where linked, else 0)
and a'_c the surrogate times the lag factor (1 - elk where lagged, else 0); forward order has no
lagged chunk, so its recurrence (and result, bit for bit) is the plain one:
  - idn: a_c = 1. Forward order is a prefix sum over chunks (cumsum); otherwise one (C x 2C)
    transfer-matrix contraction of [b; d^{(k-1)}].
  - none (Jacobi): a_c = 0, h^{(k+1)} = tilde.
  - hcn: a_c = the chunk's H_res product over the mHC streams at the current iterate (returned by
    the chunk forward); solved by a matrix associative scan (snlp.scan).
  - diag: a_c = Hutchinson estimate of diag(J_c) (snlp.surrogates); elementwise associative scan.
  - newton: the exact J_c d_{c-1} by JVPs, one chunk after another (reference solver, not fast).
The lagged term is folded into b before the scan, so every surrogate keeps its one vectorised solve.
Exactness (`Plan.exact_after`): after k iterations chunk c is exact once k >= t_c, t_0 = 1, t_c =
t_{c-1} + 1 (linked) or + 2 (lagged); K >= C is exact for forward order, K >= C + #lagged for any.
No Python loop runs over layers or chunks on the hot path except in the exact-Newton reference.
With `tol` > 0, K is a maximum: the solve stops once max over the batch of
||d_{C-1}|| / ||h_{C-1}^{(k+1)}|| (the final state's relative update) is below tol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import Tensor

from .fusion import ChunkWeights, chunk_forward, chunk_weights
from .model import GPT
from .plan import Plan
from .scan import affine_scan


class SNLPDivergenceError(FloatingPointError):
    """The SNLP iteration produced NaN/inf hidden states."""


@dataclass
class SolveResult:
    """Outcome of an SNLP solve (or of the fused model run sequentially)."""

    hidden: Tensor  # (B, T, D) final state h_L; with mHC every state has the stream dim: (B, T, n, D)
    prefix: Tensor  # (B, T, D) exact prefix state h_S
    plan: Plan
    states: list[Tensor] = field(default_factory=list)  # chunk outputs (C, B, T, D); [0] = init
    iters: int = 0  # iterations run (< plan.iters when `tol` stopped early)
    updates: list[float] = field(default_factory=list)  # final-state relative update per iteration (tol > 0)


@lru_cache(maxsize=256)
def _transfer(plan: Plan) -> Tensor | None:
    """(C, C) matrix P with d = P @ b solving d_c = a_c d_{c-1} + b_c; None means plain cumsum.
    With lagged chunks (non-forward order), a (C, 2C) matrix [P, P U] with d = [P, P U] @ [b; d_prev],
    U[c, c-1] = the lag factor of chunk c (the previous sweep's update enters chunk c's b)."""
    C = plan.chunks
    a = plan.link_factors()
    if plan.surrogate == "idn" and all(x == 1.0 for x in a):
        return None
    if plan.surrogate == "none":
        a = [0.0] * C
    P = torch.zeros(C, C, dtype=torch.float64)
    for c in range(C):  # built once per plan (cached), never on the hot path
        if c > 0:
            P[c, :c] = a[c] * P[c - 1, :c]
        P[c, c] = 1.0
    lag = plan.lag_factors()
    if plan.surrogate == "none" or not any(lag):
        return P
    U = torch.zeros(C, C, dtype=torch.float64)
    for c in range(1, C):
        U[c, c - 1] = lag[c]
    return torch.cat([P, P @ U], 1)


def correct(b: Tensor, plan: Plan, prev: Tensor | None = None) -> Tensor:
    """Solve the correction recurrence over chunks for b = tilde - h_old, b (C, ...); `prev` (C, ...)
    is the previous sweep's update d^{(k-1)} (None = zeros), read by lagged chunks only."""
    P = _transfer(plan)
    if P is None:
        return b.cumsum(0)  # IDN, forward order: prefix sum over depth
    P = P.to(device=b.device, dtype=b.dtype)
    C = b.shape[0]
    if P.shape[1] > C:  # lagged chunks: [P, P U] @ [b; d_prev]
        if prev is None:
            P = P[:, :C]
        else:
            b = torch.cat([b, prev], 0)  # (2C, ...)
    return torch.einsum("cj,j...->c...", P, b)


def link_factors(plan: Plan, like: Tensor) -> Tensor:
    """`Plan.link_factors` as a (C,) tensor like `like`."""
    return torch.tensor(plan.link_factors(), device=like.device, dtype=like.dtype)


def lag_factors(plan: Plan, like: Tensor) -> Tensor:
    """`Plan.lag_factors` as a (C,) tensor like `like`."""
    return torch.tensor(plan.lag_factors(), device=like.device, dtype=like.dtype)


def shift(d: Tensor) -> Tensor:
    """d_{c-1} at index c (zeros at c = 0): (C, ...) -> (C, ...)."""
    return torch.cat([torch.zeros_like(d[:1]), d[:-1]], 0)


def _lagged(plan: Plan, prev: Tensor | None) -> bool:
    return prev is not None and plan.order is not None and any(plan.lag_factors())


def _as_plan(model: GPT, plan: Plan | str) -> Plan:
    plan = Plan.parse(plan) if isinstance(plan, str) else plan
    plan.check(model.config.n_layer)
    if plan.surrogate == "hcn" and model.config.hc_streams < 1:
        raise ValueError(f"plan {plan}: the hcn surrogate needs an mHC model (GPTConfig.hc_streams >= 1); "
                         f"this model has a plain residual stream, use idn")
    return plan


def _delta(plan: Plan, w: ChunkWeights, ctx, inputs: Tensor, tilde: Tensor, h: Tensor, mix: Tensor | None,
           gen: torch.Generator | None, prev: Tensor | None = None) -> Tensor:
    """d = h^{(k+1)} - h^{(k)} (C, B, T, ...) for the plan's surrogate, given the batched chunk
    forward tilde = F(inputs), for hcn the chunks' stream-mixing matrices `mix`, and the previous
    sweep's update `prev` (C, B, T, ...; None in the first sweep) that lagged chunks read."""
    b = tilde - h
    lagged = _lagged(plan, prev)
    if plan.surrogate == "idn":
        return correct(b, plan, prev if lagged else None)
    if plan.surrogate == "hcn":  # mix (C, B, T, n, n) acts on the stream dim of b (C, B, T, n, D)
        with torch.autocast(b.device.type, enabled=False):  # corrections in h's dtype (fp32 under autocast)
            if lagged:  # b_c += lag_c A_c d_{c-1}^{(k-1)}
                b = b + (mix * lag_factors(plan, mix).view(-1, 1, 1, 1, 1)) @ shift(prev)
            return affine_scan(mix * link_factors(plan, mix).view(-1, 1, 1, 1, 1), b, matrix=True)
    from . import surrogates  # DiagN / exact Newton live in their own module
    if plan.surrogate == "diag":
        a = surrogates.diag_jacobian(w, inputs, tilde, ctx, plan, gen)  # (C, B, T, ..., D)
        if lagged:
            b = b + a * lag_factors(plan, a).view(-1, *[1] * (a.dim() - 1)) * shift(prev)
        return affine_scan(a * link_factors(plan, a).view(-1, *[1] * (a.dim() - 1)), b)
    return surrogates.newton_delta(w, inputs, b, ctx, plan, prev if lagged else None)


def _relative_update(d: Tensor, h: Tensor) -> float:
    """max over the batch of ||d|| / ||h|| for final-chunk tensors (B, T, ...)."""
    num = d.float().flatten(1).norm(dim=1)
    return float((num / (h.float().flatten(1).norm(dim=1) + 1e-12)).max())


def _check_finite(h: Tensor, plan: Plan) -> None:
    if not bool(torch.isfinite(h).all()):
        raise SNLPDivergenceError(
            f"SNLP plan {plan} diverged: the final hidden state contains NaN/inf. Try more iterations "
            f"(K >= {plan.chunks} is exact), fewer/larger chunks, ELK damping (-elk:0.1) or the h0 init; "
            f"check the sequential forward is finite first.")


def solve(model: GPT, idx: Tensor, plan: Plan | str, keep_states: bool = False,
          check_finite: bool = True, cache=None, weights: ChunkWeights | None = None,
          prefix: Tensor | None = None, init_states: Tensor | None = None) -> SolveResult:
    """Run the SNLP solve for token ids idx (B, T). `keep_states` records the chunk-output states
    (C, B, T, D) of the init and of every iteration. Raises SNLPDivergenceError on NaN/inf.

    With a KV `cache` (snlp.cache.KVCache) idx continues the cached sequence (SNLP decoding): the
    prefix layers read/write the cache exactly; every suffix branch attends over the cached K/V
    of earlier positions plus the new tokens' K/V computed from its current input estimate, so
    the K/V left in the cache are those of the inputs the last iteration used. The cache then
    advances by T. `weights` (from `chunk_weights`) skips the cache lookup, e.g. under torch.compile.
    `prefix` is an already computed h_S (B, T, D) for idx, e.g. from the training forward's trace,
    so the prefix layers are not run twice. `init_states` (C, B, T, D) replaces the plan's init
    (h0 / fwd / preheat) by given chunk states, e.g. a warm start from an earlier solve."""
    plan = _as_plan(model, plan)
    S, C = plan.prefix_len(model.config.n_layer), plan.chunks
    ctx = model.embed(idx, cache)
    hS = prefix if prefix is not None else model.run_layers(ctx.x0, ctx, 0, S)  # exact sequential prefix
    w = weights if weights is not None else chunk_weights(model, S, C, plan.fuse)
    if init_states is not None:  # a warm start (e.g. h0-JD: the previous Jacobi iteration's states)
        if init_states.shape != (C, *hS.shape):
            raise ValueError(f"init_states must have shape (C, *h_S.shape) = {(C, *hS.shape)}, got "
                             f"{tuple(init_states.shape)}")
        h = init_states.to(hS.dtype)
    elif plan.init == "preheat":  # per-layer low-rank affine predictors of the chunk outputs (snlp.preheat)
        from . import preheat
        h = preheat.of(model).predict(ctx.x0, [S + (c + 1) * plan.fuse - 1 for c in range(C)])  # (C, B, T, D)
    else:
        h = hS.expand(C, *hS.shape)  # (C, B, T, D) h0 init: every chunk output starts at h_S
        if plan.init == "fwd":
            h = chunk_forward(w, h, ctx, cache)  # one-shot batched forward F_c(h_S)
    states = [h] if keep_states else []
    hcn = plan.surrogate == "hcn"
    gen = torch.Generator(hS.device).manual_seed(0) if plan.surrogate == "diag" else None  # reproducible probes
    iters, updates, d = 0, [], None
    for _ in range(plan.iters):
        inputs = torch.cat([hS[None], h[:-1]], 0)  # (C, B, T, D): chunk c reads h_{c-1}^{(k)}
        tilde, mix = chunk_forward(w, inputs, ctx, cache, mix=True) if hcn else (chunk_forward(w, inputs, ctx, cache), None)
        if plan.surrogate == "none":
            d, h = tilde - h, tilde
        else:
            d = _delta(plan, w, ctx, inputs, tilde, h, mix, gen, d)  # d: the previous sweep's update
            h = h + d
        iters += 1
        if keep_states:
            states.append(h)
        if plan.tol:
            updates.append(_relative_update(d[-1], h[-1]))
            if updates[-1] < plan.tol:
                break
    if cache is not None:
        if plan.iters == 0 and (plan.init != "fwd" or init_states is not None):  # nothing evaluated the
            chunk_forward(w, torch.cat([hS[None], h[:-1]], 0), ctx, cache)  # suffix: write the final inputs' K/V
        cache.advance(idx.shape[1])
    if check_finite:
        _check_finite(h[-1], plan)
    return SolveResult(hidden=h[-1], prefix=hS, plan=plan, states=states, iters=iters, updates=updates)


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


def permuted_sequential(model: GPT, idx: Tensor, plan: Plan | str, order: tuple[int, ...] | None = None,
                        prefix: Tensor | None = None) -> SolveResult:
    """Seq-Perm (paper App. "Correction Ordering"): the prefix, then the plan's fused suffix chunks
    run sequentially in the order `order` (default `plan.order`; None = forward, which is
    `fused_sequential`). It measures how much the suffix depends on its layer order at all, apart
    from any solver. states[0] holds the chunk outputs (C, B, T, D) in execution order. `prefix` is
    an already computed h_S (as in `solve`)."""
    plan = _as_plan(model, plan)
    order = plan.order if order is None else tuple(order)
    if order is not None and sorted(order) != list(range(plan.chunks)):
        raise ValueError(f"order {order} must be a permutation of 0..{plan.chunks - 1}")
    S = plan.prefix_len(model.config.n_layer)
    ctx = model.embed(idx)
    hS = prefix if prefix is not None else model.run_layers(ctx.x0, ctx, 0, S)
    w = chunk_weights(model, S, plan.chunks, plan.fuse)
    h, outs = hS, []
    for c in (order or range(plan.chunks)):  # inherently sequential: one chunk after another
        h = chunk_forward(w.chunk(c), h[None], ctx)[0]
        outs.append(h)
    return SolveResult(hidden=h, prefix=hS, plan=plan, states=[torch.stack(outs)])


def fused_forward(model: GPT, idx: Tensor, plan: Plan | str) -> Tensor:
    """Logits (B, T, V) of the fused model of `plan` run sequentially."""
    return model.head(fused_sequential(model, idx, plan).hidden)

"""The SNLP solve under self-speculative-decoding conditions, over a whole window in one forward.

In self-speculative decoding (snlp.decode.speculative) the drafter decodes with the verifier's KV cache: at
a draft position t every suffix branch attends to the EXACT per-layer K/V of the earlier positions j < t (the
sequential verifier wrote them) and to its own estimate only at t itself (computed from its chunk input).
A plain teacher-forced window forward (`snlp.solve` over T tokens) instead attends to the drafter's own K/V at
every position: a different, harder problem. `ssd_solve` computes, for every position of a window at once,
what the cached drafter step computes there:

    y_t = softmax([q_t k_j^exact (j < t, window) ; q_t k_t^own]) [v_j^exact ; v_t^own]

with k^exact, v^exact the base model's own K/V of each suffix layer from its exact sequential input
(`exact_kv`). tests/train/test_adapt.py checks it position by position against the real cached decode step.
Training a drafter through it (snlp.train.adapt, kv="exact") trains exactly what speculative decoding runs.
Supported: h0 / fwd init, idn (forward order) or none surrogates, plain residual-stream models; a `causal` plan's
branches attend over every earlier exact K/V (no window), as its cached decode step does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from snlp.method.fusion import ChunkWeights, bmm, chunk_weights
from snlp.method.plan import Plan
from snlp.method.surrogates import Identity, Jacobi
from snlp.model.gpt import GPT, Context
from snlp.model.ops import mlp_act, norm, qk_rope, window_mask


def check_ssd_plan(plan: Plan) -> Plan:
    """Raise a ValueError for plans `ssd_solve` does not implement."""
    if not isinstance(plan.surrogate, (Identity, Jacobi)) or plan.order is not None or plan.tol or plan.elk \
            or plan.init == "preheat":
        raise ValueError(f"SSD-conditions training supports h0/fwd plans with the idn or none surrogate, forward "
                         f"order, no tol/elk (got {plan}); use kv='own' (teacher-forced windows) for this plan")
    return plan


def _qkv(w: ChunkWeights, h: Tensor, ctx: Context) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The chunks' attention inputs from chunk inputs h (C, B, T, D): x (the residual stream, x0 mixed in),
    q (C, M, B, Hq, T, hd) and k, v (C, M, B, Hkv, T, hd) after value embeddings, QK-norm and RoPE
    (what snlp.method.fusion.chunk_forward computes before attending)."""
    C, B, T, D = h.shape
    M, Hq, Hkv, hd = w.fuse, w.n_head, w.n_kv_head, w.head_dim
    x = h if w.alpha is None else w.alpha.view(C, 1, 1, 1) * h + w.beta.view(C, 1, 1, 1) * ctx.x0
    xn = norm(x, eps=w.eps)  # (C, B, T, D)
    xf = xn.view(C, B * T, D) if w.attn_in is None else xn.view(C, B * T, D) * w.attn_in
    qkv = bmm(xf, w.qkv, w.qkv_bias).view(C, B, T, M, Hq + 2 * Hkv, hd).permute(0, 3, 1, 2, 4, 5)
    q, k, v = qkv.split([Hq, Hkv, Hkv], dim=-2)  # (C, M, B, T, H, hd)
    if w.ve_slot is not None:
        ve_all = torch.cat([ctx.ve, torch.zeros_like(ctx.ve[:1])], 0)  # zero slot for layers without
        ve = ve_all[w.ve_slot].view(C, M, B, T, Hkv, hd)
        G = w.ve_gate.shape[1]
        # the gate reads the block's normed input, norm weights included (folded into ve_gate, or applied in xf)
        gate = w.ve_scale * torch.sigmoid(bmm(xf[..., :G], w.ve_gate))  # (C, B*T, M*Hkv)
        v = v + gate.view(C, B, T, M, Hkv).permute(0, 3, 1, 2, 4).unsqueeze(-1) * ve
    qw = kw = None
    if w.q_norm is not None:
        qw, kw = w.q_norm.view(C, M, 1, 1, 1, hd), w.k_norm.view(C, M, 1, 1, 1, hd)
    q, k = qk_rope(q, k, ctx.cos, ctx.sin, w.qk_norm, qw, kw, w.eps)
    return x, q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)


@torch.no_grad()
def exact_kv(base: GPT, trace: list[Tensor], plan: Plan, ctx: Context) -> tuple[Tensor, Tensor]:
    """The base's exact K/V of every suffix layer, (C, M, B, Hkv, T, hd) each, from its sequential hidden
    states `trace` = [h_0, ..., h_L] (GPT.hidden_states): layer l's K/V come from its exact input h_{l-1}."""
    L = base.config.n_layer
    S, C, M = plan.prefix_len(L), plan.chunks, plan.fuse
    wb = chunk_weights(base, S, C * M, 1)  # every suffix layer its own chunk: per-layer exact K/V
    _, _, k, v = _qkv(wb, torch.stack(trace[S:L]), ctx)  # (C*M, 1, B, Hkv, T, hd)
    return k.reshape(C, M, *k.shape[2:]), v.reshape(C, M, *v.shape[2:])


def _attend_exact(q: Tensor, k: Tensor, v: Tensor, kx: Tensor, vx: Tensor, windows) -> Tensor:
    """q (C, M, B, Hq, T, hd); own k, v and exact kx, vx (C, M, B, Hkv, T, hd) -> (C, M, B, Hq, T, hd):
    query t attends to the exact keys j < t (within its branch's window) and to its own key at t."""
    T, hd = q.shape[-2], q.shape[-1]
    rep = q.shape[-3] // k.shape[-3]  # GQA
    if rep > 1:
        k, v, kx, vx = (t.repeat_interleave(rep, dim=-3) for t in (k, v, kx, vx))
    scale, acc = hd ** -0.5, torch.promote_types(q.dtype, torch.float32)  # softmax in >= fp32 (fp64 stays fp64)
    s_ex = (q @ kx.transpose(-1, -2)).to(acc) * scale  # (C, M, B, Hq, T, T)
    win = -1 if windows is None else windows.view(*windows.shape[:2], 1, 1)  # (C, M, 1, 1) -> over (B, Hq)
    mask = window_mask(win, T, T, 0, q.device) & ~torch.eye(T, dtype=torch.bool, device=q.device)  # strict j < t
    s_ex = s_ex.masked_fill(~mask, float("-inf"))
    s_self = (q * k).sum(-1, keepdim=True).to(acc) * scale  # (C, M, B, Hq, T, 1)
    p = torch.softmax(torch.cat([s_ex, s_self], -1), -1).to(q.dtype)
    return p[..., :T] @ vx + p[..., T:] * v


def ssd_chunk_forward(w: ChunkWeights, h: Tensor, ctx: Context, kv: tuple[Tensor, Tensor] | None) -> Tensor:
    """snlp.method.fusion.chunk_forward with the attention of a speculative draft step: chunk inputs h
    (C, B, T, D) -> outputs (C, B, T, D); `kv` = exact_kv(...) (None: plain causal attention over the chunk's
    own K/V, which is chunk_forward's own math)."""
    C, B, T, D = h.shape
    M, Hq, hd = w.fuse, w.n_head, w.head_dim
    x, q, k, v = _qkv(w, h, ctx)
    if kv is None:
        mask = window_mask(-1 if w.windows is None else w.windows.view(C, M, 1, 1), T, T, 0, q.device)
        rep = Hq // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        y = _attend_exact(q, k, v, kv[0], kv[1], w.windows)  # (C, M, B, Hq, T, hd)
    y = y.permute(0, 2, 4, 1, 3, 5).reshape(C, B * T, M * Hq * hd)
    u = x + bmm(y, w.attn_out).view(C, B, T, D)
    un = norm(u, eps=w.eps).view(C, B * T, D)
    hid = mlp_act(bmm(un if w.mlp_in is None else un * w.mlp_in, w.fc), w.swiglu_dim)
    return u + bmm(hid, w.proj).view(C, B, T, D)


def ssd_solve(model: GPT, idx: Tensor, plan: Plan, prefix: Tensor, kv: tuple[Tensor, Tensor] | None) -> Tensor:
    """The final state h_L (B, T, D) of `plan`'s K-iteration solve of `model`'s suffix from the exact prefix
    state `prefix` = h_S (B, T, D), every position under SSD conditions (`kv` = the base's exact K/V; None:
    own K/V, i.e. snlp.solve). Differentiable in the model's suffix weights (the drafter's training forward)."""
    check_ssd_plan(plan)
    if model.config.backout:
        raise ValueError("ssd_solve returns h_L, and this model's head reads h_L minus its backout state: drafter "
                         "training under SSD conditions does not carry nanochat's backout")
    S, C = plan.prefix_len(model.config.n_layer), plan.chunks
    ctx = model.embed(idx)
    w = chunk_weights(model, S, C, plan.fuse, plan.causal)  # causal: the drafter's branches attend fully
    h = prefix.expand(C, *prefix.shape)  # (C, B, T, D): the h0 init
    if plan.init == "fwd":
        h = ssd_chunk_forward(w, h, ctx, kv)
    for _ in range(plan.iters):
        tilde = ssd_chunk_forward(w, torch.cat([prefix[None], h[:-1]], 0), ctx, kv)
        # idn, forward order: d_c = d_{c-1} + (tilde_c - h_c) is a prefix sum over chunks; none: h = tilde
        h = h + torch.cumsum(tilde - h, 0) if isinstance(plan.surrogate, Identity) else tilde
    return h[-1]

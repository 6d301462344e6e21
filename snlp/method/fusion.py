"""Fused, stacked chunk weights and the batched chunk forward.

A chunk of M consecutive layers is fused into ONE wide layer (paper App. "Fused Cross-Layer
Coupling"): the Q/K/V and MLP up-projections of its layers are concatenated along the output
dim, the attention-out and MLP down-projections along the input dim, so every branch reads the
same chunk input and the branch outputs are summed by the wide matmuls:

    x_C  = alpha_C * h + beta_C * x0                      (composed residual/x0 path, see below)
    u_C  = x_C + sum_l gamma_l * O_l Attn_l(norm(x_C))     (each Attn_l keeps its own window, VE)
    F_C  = u_C + sum_l gamma_l * P_l relu^2(W_l norm(u_C))

Llama-family models (GPTConfig.norm_weights): each layer's RMSNorm weight w feeds a projection W, and
W (norm(x) * w) = (W diag(w)) norm(x), so it is folded exactly into that layer's own columns of the wide
q/k/v (input_layernorm) and gate/up (post_attention_layernorm) matrices: every branch still reads the one
parameter-free norm(x_C). (Averaging the weights over the chunk, as the paper's reference code does, is
not the fused model of the layers: on SmolLM2 layers 20-23 (M = 4) and a 21-token sentence the chunk update
moves by 24 %, docs/hf.md.) SwiGLU
branches are silu(gate) * up per branch; q/k/v biases and Qwen3's per-head q/k norm weights stay per branch.

The C chunks of a plan are stacked along a leading dim and evaluated in one batched matmul per
projection: `chunk_forward` maps (C, B, T, D) chunk inputs to (C, B, T, D) outputs.

x0 residual inside a chunk. Sequentially, layer l reads lam_r[l] * h + lam_0[l] * x0, so over a
chunk the residual path composes exactly to alpha_C * h + beta_C * x0 with alpha_C = prod lam_r and
beta_C = sum_l lam_0[l] * gamma_l, and branch l's output is scaled by gamma_l = prod_{j>l} lam_r[j]
(the later layers' resid scalars that multiply it). The fused chunk uses exactly these: its
residual path equals the sequential one, all branches read norm(x_C), and gamma_l is folded into
O_l and P_l. For M = 1 this is the layer itself; with x0 off it is the paper's fused layer.

Value embeddings inside a chunk: each layer that has them keeps its own table and gate; its gate
reads the shared norm(x_C). Layers without them get a zero embedding (so their gate is inert),
which keeps the whole chunk one batched op. Sliding windows: every branch keeps its own window
(the reference code drops windows; we do so only for a plan that names it, `-causal`, `full_causal`):
through a per-branch attention mask, branches grouped by window (banded kernel), or one FlexAttention
call with a per-branch window mask inside compiled graphs (snlp.model.ops.set_window_kernel).

mHC chunks (GPTConfig.hc_streams = n; states (C, B, T, n, D)). Layer l's sublayers are
x' = R x + p (x) F(norm(q . x)) with R = H_res, q = H_pre, p = H_post (see snlp.model). A chunk
keeps the two-stage shape of the plain fused layer, with stream mixing in place of "+":

    stage A (attention):  u = P_A x + sum_l G_{a,l} p_{a,l} (x) Attn_l(norm(q_{a,l} . x)),   H's from x
    stage M (MLP):        F = P_M u + sum_l G_{m,l} p_{m,l} (x) MLP_l(norm(q_{m,l} . u)),    H's from u

with P_A = R_{a,M} ... R_{a,1} and G_{a,l} = R_{a,M} ... R_{a,l+1} (likewise for M): the later
residual mixes of the same stage that multiply branch l's output are folded into its H_post, like
the gamma folding of the x0 residual above. Why this definition:
  - for M = 1 it is exactly the sequential mHC layer (tests/model/test_mhc.py), as the plain fused layer is;
  - it is the plain fused layer's recipe (all attention branches read the chunk input, all MLP
    branches read the aggregate post-attention state) with each "+ branch" replaced by the mHC
    sublayer; with n = 1 it is the plain fused layer up to the scalar branch scales;
  - its residual path is P_M P_A, the product of the same 2M H_res the sequential chunk multiplies,
    grouped by stage instead of interleaved (equal whenever they commute, e.g. n = 1 or H_res = I);
  - that path's Jacobian, A = P_M P_A (n x n, at the current iterate; for M = 1 H_res,mlp H_res,attn,
    paper Eq. hcn-A), is the chunk-level HCN surrogate: the structured part of the Jacobian of the
    very map the solver iterates (the fused model it converges to), and `chunk_forward(..., mix=True)`
    gets it for free from the H's the forward computes anyway;
  - it stays two batched stages; only tiny n x n products are extra.
Dynamic H are computed from the stage input (x, resp. u) at the current iterate, for all M
sublayers with one batched matmul; static H (parameters only) are folded once per weight set.
Every branch reads its own input (q . x), so the projections run batched over the C*M branches
(bmm over (C*M, B*T, D)); only the tiny n x n products loop over M inside `_hc_fold`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from snlp.model.gpt import GPT, Context
from snlp.model.hc import hc_gate, hc_maps, maps_of
from snlp.model.ops import (attend, attend_branches, flex_window_attention, mlp_act, norm, qk_rope, uses_band,
                            uses_flex, window_groups)


@dataclass
class HCWeights:
    """Stacked mHC coefficients of C chunks of M layers, per stage (0 = attention, 1 = MLP sublayers).
    Dynamic: logits = bias + gate * (norm(vec(x)) @ phi). Static: the folded (P, H_pre, coef) per stage."""

    n: int
    bias: tuple[Tensor, Tensor]  # (C, M, n*n + 2n) logits bias per stage
    phi: tuple[Tensor, Tensor] | None  # (C, n*D, M*(n*n + 2n)) dynamic projections, the M sublayers side by side
    gate: tuple[Tensor, Tensor] | None  # (C, M, n*n + 2n) dynamic gates (alpha per logit)
    fixed: tuple[tuple[Tensor, Tensor, Tensor], ...] | None  # static: per stage (P (C,n,n), pre (C,M,n), coef (C,M,n))
    maps: dict = field(default_factory=dict)  # hc_maps' kind and Sinkhorn settings (snlp.model.hc.maps_of)

    def take(self, c: int) -> "HCWeights":
        sl = lambda ts: None if ts is None else tuple(t[c:c + 1] for t in ts)  # noqa: E731
        return replace(self, bias=sl(self.bias), phi=sl(self.phi), gate=sl(self.gate),
                       fixed=None if self.fixed is None else tuple(sl(f) for f in self.fixed))


@dataclass
class ChunkWeights:
    """Stacked weights of C fused plain chunks of M layers (layers start .. start + C*M - 1), laid out wide:
    each projection of a chunk is ONE matmul over its M branches side by side. `HCChunkWeights` (mHC) has the
    same fields and interface, laid out per branch. X = (Hq + 2 Hkv) hd, F' = F (relu^2) or 2F (SwiGLU)."""

    start: int
    fuse: int
    n_head: int
    n_kv_head: int
    head_dim: int
    qkv: Tensor  # (C, D, M*X)   per layer [q | k | v], layers concatenated, input RMSNorm weight folded in
    attn_out: Tensor  # (C, M*Hq*hd, D)    gamma folded in
    fc: Tensor  # (C, D, M*F')             post-attention RMSNorm weight folded in; SwiGLU: per layer [gate | up]
    proj: Tensor  # (C, M*F, D)            gamma folded in
    alpha: Tensor | None  # (C,) residual scale of the chunk (None: x0 residual off)
    beta: Tensor | None  # (C,) x0 scale of the chunk
    ve_gate: Tensor | None  # (C, G, M*Hkv)  zero for layers without value embeddings
    ve_slot: Tensor | None  # (C*M,) slot in the padded value-embedding stack (n_ve = zero pad)
    windows: Tensor | None  # (C, M, 1) left context per branch, None when all are full
    qkv_bias: Tensor | None = None  # (C, 1, M*X) (Qwen2)
    qk_norm: str = "rope_norm"  # GPTConfig.qk_norm
    q_norm: Tensor | None = None  # (C, M, hd) Qwen3 per-head q/k RMSNorm weights (not foldable: they act per head);
    k_norm: Tensor | None = None  # (C, M, hd)   with qk_norm "rope_norm", the constant GPTConfig.qk_scale (or None)
    eps: float | None = None  # RMSNorm eps (GPTConfig.norm_eps)
    swiglu_dim: int = 0  # SwiGLU hidden width F; 0 = relu^2
    ve_scale: float = 2.0  # value-embedding gate = ve_scale * sigmoid(.) (GPTConfig.ve_gate_scale)
    attn_in: Tensor | None = None  # (C, 1, D) input RMSNorm weights applied, not folded (shared weights, M = 1)
    mlp_in: Tensor | None = None  # (C, 1, D) post-attention RMSNorm weights likewise (snlp.method.sharing)
    window_values: tuple[int, ...] | None = None  # the C*M branches' windows as host ints (None: all full)
    window_groups: tuple | None = None  # snlp.model.ops.window_groups(window_values): prefill attention by window
    views: bool = False  # every tensor is a view of the model's own parameters (snlp.method.sharing): in-place edits
    #                      of the parameters reach these weights, and any copy derived from them must not be kept

    @property
    def chunks(self) -> int:
        return self.qkv.shape[0]

    def chunk(self, c: int) -> "ChunkWeights":
        """The weights of chunk c alone (a C = 1 stack), for running the fused model sequentially."""
        M = self.fuse
        take = lambda t, s=slice(c, c + 1): None if t is None else t[s]  # noqa: E731
        vals = None if self.window_values is None else self.window_values[c * M:(c + 1) * M]
        return replace(self, start=self.start + c * M, qkv=take(self.qkv), attn_out=take(self.attn_out),
                       fc=take(self.fc), proj=take(self.proj), alpha=take(self.alpha), beta=take(self.beta),
                       ve_gate=take(self.ve_gate), ve_slot=take(self.ve_slot, slice(c * M, (c + 1) * M)),
                       qkv_bias=take(self.qkv_bias), q_norm=take(self.q_norm),
                       k_norm=take(self.k_norm), attn_in=take(self.attn_in), mlp_in=take(self.mlp_in),
                       **window_fields(vals, self.qkv.device, vals is not None and any(w >= 0 for w in vals)))


@dataclass
class HCChunkWeights(ChunkWeights):
    """mHC chunks: the ChunkWeights interface with per-branch weights (every branch reads its own input
    H_pre x, so the projections run batched over the C*M branches): qkv (C, M, D, X), qkv_bias (C, M, 1, X),
    attn_out (C, M, Hq*hd, D), fc (C, M, D, F'), proj (C, M, F, D), ve_gate (C, M, G, Hkv), no gamma; alpha/beta
    None; plus the stacked mHC coefficients `hc`."""

    hc: HCWeights | None = None

    def chunk(self, c: int) -> "HCChunkWeights":
        return replace(super().chunk(c), hc=self.hc.take(c))


@torch.library.custom_op("snlp::cpu_bmm", mutates_args=())
def _cpu_bmm(a: Tensor, b: Tensor) -> Tensor:
    return torch.bmm(a, b)


@_cpu_bmm.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty(a.shape[0], a.shape[1], b.shape[2])


_cpu_bmm.register_autograd(
    lambda ctx, g: (torch.bmm(g, ctx.b.transpose(1, 2)), torch.bmm(ctx.a.transpose(1, 2), g)),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "a", inputs[0]) or setattr(ctx, "b", inputs[1]))


def bmm(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """The chunks' batched matmul (C, N, K) @ (C, K, X) [+ bias (C, 1, X)]. On CPU it is an opaque op to
    torch.compile: inductor lowers a CPU bmm with one row per batch (the one-token decode step, N = B*T = 1)
    to a generic mul + sum loop that runs 2-2.5x slower than the aten (MKL) bmm it replaces (measured on the
    speedrun shape: 12 x (1x128 @ 128x512) then (1x512 @ 512x128), 880 vs 400 us), which cost a compiled SNLP
    decode step its whole gain. Eager (and on GPUs) it is the plain aten bmm / baddbmm: a custom op would only
    add Python dispatch there."""
    if a.device.type == "cpu" and torch.compiler.is_compiling():
        out = _cpu_bmm(a, b)
        return out if bias is None else out + bias
    return torch.bmm(a, b) if bias is None else torch.baddbmm(bias, a, b)


def _exclusive_suffix_prod(x: Tensor) -> Tensor:
    """gamma[:, m] = prod_{j > m} x[:, j] for x (C, M)."""
    ones = torch.ones_like(x[:, :1])
    return torch.cat([ones, torch.cumprod(x.flip(1), 1)[:, :-1]], 1).flip(1)


def build_chunk_weights(model: GPT, start: int, chunks: int, fuse: int) -> ChunkWeights:
    """Fuse layers start .. start + chunks*fuse - 1 into `chunks` stacked wide layers.

    RMSNorm weights (GPTConfig.norm_weights) fold exactly into the projections they feed, W' = W diag(w):
    each branch keeps its own layer's weight, so the chunk stays exact for M = 1 and K >= C (averaging the
    weights over a chunk, as the paper's reference code does, is not the fused model of the layers)."""
    cfg = model.config
    C, M, N = chunks, fuse, chunks * fuse
    blocks = [model.blocks[l] for l in range(start, start + N)]
    if cfg.x0_residual:
        lr = model.resid_lambdas[start:start + N].view(C, M)
        l0 = model.x0_lambdas[start:start + N].view(C, M)
        gamma = _exclusive_suffix_prod(lr)  # (C, M)
        alpha, beta = lr.prod(1), (l0 * gamma).sum(1)
        g = gamma.reshape(N, 1, 1)
    else:
        alpha = beta = None
        g = 1.0
    ln = lambda w: 1.0 if w is None else w  # noqa: E731  (unit norm weight)
    qkv = torch.stack([torch.cat([b.attn.c_q.weight, b.attn.c_k.weight, b.attn.c_v.weight], 0) * ln(b.ln_attn)
                       for b in blocks])  # (N, X, D)
    qkv_bias = None
    if cfg.qkv_bias:
        qkv_bias = torch.stack([torch.cat([b.attn.c_q.bias, b.attn.c_k.bias, b.attn.c_v.bias]) for b in blocks])
    attn_out = torch.stack([b.attn.c_proj.weight.t() for b in blocks]) * g  # (N, Hq*hd, D)
    fc = torch.stack([(b.mlp.c_fc.weight * ln(b.ln_mlp)).t() for b in blocks])  # (N, D, F')
    proj = torch.stack([b.mlp.c_proj.weight.t() for b in blocks]) * g  # (N, F, D)
    D, Fp, Fh = cfg.n_embd, fc.shape[-1], proj.shape[1]
    q_norm = k_norm = None
    if cfg.qk_norm == "weighted":
        q_norm = torch.stack([b.attn.q_norm for b in blocks]).view(C, M, -1)
        k_norm = torch.stack([b.attn.k_norm for b in blocks]).view(C, M, -1)
    else:
        q_norm = k_norm = qk_scale_rows(cfg, C, M, qkv)

    hc = cfg.hc_streams > 0
    ve_gate, ve_slot = value_embed_weights(model, start, C, M)
    common = dict(start=start, fuse=M, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, head_dim=cfg.head_dim,
                  ve_slot=ve_slot, **branch_windows(model, start, C, M, qkv.device), qk_norm=cfg.qk_norm, q_norm=q_norm, k_norm=k_norm, eps=cfg.norm_eps,
                  swiglu_dim=Fh if cfg.mlp_act == "swiglu" else 0, ve_scale=cfg.ve_gate_scale)
    if hc:  # every branch reads its own input: weights stay per branch, batched over C*M in the forward
        return HCChunkWeights(
            qkv=qkv.transpose(1, 2).reshape(C, M, D, -1).contiguous(), attn_out=attn_out.reshape(C, M, -1, D),
            fc=fc.view(C, M, D, Fp), proj=proj.reshape(C, M, Fh, D), alpha=None, beta=None, ve_gate=ve_gate,
            qkv_bias=None if qkv_bias is None else qkv_bias.view(C, M, 1, -1),
            hc=_hc_weights(blocks, C, M, cfg.hc_streams, maps_of(cfg)), **common)
    return ChunkWeights(
        qkv=qkv.view(C, M * qkv.shape[1], D).transpose(1, 2).contiguous(),
        attn_out=attn_out.reshape(C, -1, D).contiguous(),
        fc=fc.view(C, M, D, Fp).permute(0, 2, 1, 3).reshape(C, D, M * Fp).contiguous(),
        proj=proj.reshape(C, M * Fh, D).contiguous(), alpha=alpha, beta=beta, ve_gate=ve_gate,
        qkv_bias=None if qkv_bias is None else qkv_bias.view(C, 1, -1), **common)


def qk_scale_rows(cfg, C: int, M: int, like: Tensor) -> Tensor | None:
    """GPTConfig.qk_scale as every branch's (C, M, hd) q/k multiplier (a broadcast constant, no memory), None at 1:
    with the "rope_norm" QK-norm the fused attention multiplies q and k by q_norm / k_norm after the norm."""
    if cfg.qk_scale == 1.0:
        return None
    return like.new_full((), cfg.qk_scale).expand(C, M, cfg.head_dim)


def branch_windows(model: GPT, start: int, chunks: int, fuse: int, device) -> dict:
    """The ChunkWeights window fields of layers start .. start + C*M - 1: `windows`, each branch's left attention
    context (C, M, 1) (None when every layer attends fully), its host copy `window_values` and the branches grouped
    by window for prefill attention (`window_groups`, see snlp.model.ops.attend_branches)."""
    values = tuple(model.config.window(l) for l in range(start, start + chunks * fuse))
    return window_fields(values, device, any(w >= 0 for w in values), (chunks, fuse, 1))


def window_fields(values: tuple[int, ...] | None, device, windowed: bool, shape: tuple | None = None) -> dict:
    """windows / window_values / window_groups from the branches' host windows (see branch_windows)."""
    if values is None or not windowed:
        return dict(windows=None, window_values=None, window_groups=None)
    shape = shape or (1, len(values), 1)
    return dict(windows=torch.tensor(values, device=device).view(shape), window_values=values,
                window_groups=window_groups(values, device))


def value_embed_weights(model: GPT, start: int, chunks: int, fuse: int) -> tuple[Tensor | None, Tensor | None]:
    """The value-embedding gates of the chunks' layers, (C, G, M*Hkv) (mHC: (C, M, G, Hkv)), zero for layers
    without value embeddings, and each layer's slot (C*M,) in the padded table (n_ve = the zero pad); (None,
    None) when no layer of the chunks has them."""
    cfg, C, M = model.config, chunks, fuse
    blocks = [model.blocks[l] for l in range(start, start + C * M)]
    if not any(b.attn.ve_gate is not None for b in blocks):
        return None, None
    G, Hkv = min(cfg.ve_gate_channels, cfg.n_embd), cfg.n_kv_head
    w = next(b.attn.ve_gate.weight for b in blocks if b.attn.ve_gate is not None)
    zero = w.new_zeros(G, Hkv)
    # the block gates on norm(x, ln_attn)[:G]: a learned norm weight is folded into the gate's rows, as into qkv
    ve_gate = torch.stack([zero if b.attn.ve_gate is None else b.attn.ve_gate.weight.t() if b.ln_attn is None else
                           b.attn.ve_gate.weight.t() * b.ln_attn[:G, None] for b in blocks])
    ve_gate = ve_gate.view(C, M, G, Hkv)
    if not cfg.hc_streams:
        ve_gate = ve_gate.permute(0, 2, 1, 3).reshape(C, G, M * Hkv)
    n_ve = model.value_embeds.shape[0]
    ve_slot = torch.tensor([model.ve_slot[l] if model.ve_slot[l] >= 0 else n_ve
                            for l in range(start, start + C * M)], device=w.device)
    return ve_gate, ve_slot


def _hc_fold(res: Tensor, post: Tensor) -> tuple[Tensor, Tensor]:
    """Fold a stage's M sublayers: res (..., M, n, n), post (..., M, n) -> the residual path
    P = R_M ... R_1 (..., n, n) and each branch's output coefficient G_l p_l = R_M ... R_{l+1} p_l (..., M, n)."""
    M = res.shape[-3]
    G, coefs = None, [None] * M
    with torch.autocast(res.device.type, enabled=False):  # n x n products in the H's dtype, also under autocast
        for m in reversed(range(M)):  # M is the (small) number of layers per chunk, never the chunk count
            p = post[..., m, :]
            coefs[m] = p if G is None else (G @ p.unsqueeze(-1)).squeeze(-1)
            G = res[..., m, :, :] if G is None else G @ res[..., m, :, :]
    return G, torch.stack(coefs, -2)


def _hc_weights(blocks, C: int, M: int, n: int, maps: dict) -> HCWeights:
    k = n * (n + 2)
    stages = [[b.hc_attn for b in blocks], [b.hc_mlp for b in blocks]]
    bias = tuple(torch.stack([h.bias for h in st]).view(C, M, k) for st in stages)
    if blocks[0].hc_attn.phi is None:  # static: fold the parameter-only H once per weight set
        fixed = []
        for b in bias:
            res, pre, post = hc_maps(b, n, b.dtype, **maps)
            P, coef = _hc_fold(res, post)
            fixed.append((P, pre, coef))
        return HCWeights(n=n, bias=bias, phi=None, gate=None, fixed=tuple(fixed), maps=maps)
    nD = blocks[0].hc_attn.phi.shape[0]
    phi = tuple(torch.stack([h.phi for h in st]).view(C, M, nD, k).permute(0, 2, 1, 3).reshape(C, nD, M * k)
                for st in stages)
    gate = tuple(torch.stack([hc_gate(h.alpha, n) for h in st]).view(C, M, k) for st in stages)
    return HCWeights(n=n, bias=bias, phi=phi, gate=gate, fixed=None, maps=maps)


def full_causal(w: ChunkWeights) -> ChunkWeights:
    """The weights `w` with every branch attending fully causally (windows dropped): the paper code's approximation,
    a `causal` plan's suffix (snlp.method.plan). Only the window fields change, so the forward stays one batched op."""
    return w if w.windows is None else replace(w, **window_fields(None, None, False))


def chunk_weights(model: GPT, start: int, chunks: int, fuse: int, causal: bool = False) -> ChunkWeights:
    """Fused weights for (model, suffix layout), built from the model's current parameters; `causal` drops the
    branches' sliding windows (`full_causal`, a `causal` plan's suffix).

    Nothing is cached here: a cache keyed on parameter versions misses in-place edits through
    `.data`, which silently returned stale logits. Code that runs a plan repeatedly holds its weights
    explicitly (`snlp.bind(model, plan)`, refreshed on demand). Under autograd (training through the
    solve, grad mode on) the weights are built with the graph so gradients reach the parameters."""
    w = build_chunk_weights(model, start, chunks, fuse)
    return full_causal(w) if causal else w


def _padded_ve(ctx: Context) -> Tensor:
    """Value-embedding stack with one trailing zero slot for layers that have none."""
    if "ve_pad" not in ctx.extra:
        ctx.extra["ve_pad"] = torch.cat([ctx.ve, torch.zeros_like(ctx.ve[:1])], 0)
    return ctx.extra["ve_pad"]


def chunk_ve(w: ChunkWeights, ctx: Context) -> Tensor:
    """The value embeddings of every branch (C*M, B, T, Hkv*hd): a gather of the padded stack by w.ve_slot, made
    once per forward (memoised in ctx.extra: the solver's iterations all read the same ones) instead of once per
    chunk evaluation. One slot, keyed by the ve_slot tensor itself (held, so its id stays unique): callers that
    slice weights per chunk (exact Newton, fused_sequential) replace it instead of piling up gathers."""
    if torch.compiler.is_compiling():  # traced once; an identity-keyed memo would only add guards
        return _padded_ve(ctx)[w.ve_slot]
    hit = ctx.extra.get("chunk_ve")
    if hit is None or hit[0] is not w.ve_slot:
        hit = ctx.extra["chunk_ve"] = (w.ve_slot, _padded_ve(ctx)[w.ve_slot])
    return hit[1]


def chunk_forward(w: ChunkWeights, h: Tensor, ctx: Context, cache=None, mix: bool = False):
    """Evaluate all C fused chunks at once: chunk inputs h (C, B, T, D) -> outputs (C, B, T, D);
    mHC: (C, B, T, n, D) -> (C, B, T, n, D), and with `mix` (the HCN surrogate) also the chunks'
    residual-path stream matrices A = P_M P_A (C, B, T, n, n) at these inputs: returns (out, A).

    With a KV `cache` (decoding, snlp.model.cache.KVCache) the T tokens sit at positions ctx.start..:
    each branch writes the K/V it computes from its chunk input into its layer's slot and attends
    over the cached positions before them, still one batched op for all chunks. It does not
    advance the cache (the caller does, once the whole forward is done)."""
    if isinstance(w, HCChunkWeights):
        return _hc_chunk_forward(w, h, ctx, cache, mix)
    if mix:
        raise ValueError("chunk_forward(mix=True) returns the mHC stream-mixing matrices (HCN surrogate), "
                         "but this model has a plain residual stream (GPTConfig.hc_streams = 0)")
    C, B, T, D = h.shape
    M, Hq, Hkv, hd = w.fuse, w.n_head, w.n_kv_head, w.head_dim
    x = h if w.alpha is None else w.alpha.view(C, 1, 1, 1) * h + w.beta.view(C, 1, 1, 1) * ctx.x0
    xn = norm(x, eps=w.eps)  # (C, B, T, D); the branches' norm weights are folded into qkv (or applied: attn_in)
    xf = xn.view(C, B * T, D) if w.attn_in is None else xn.view(C, B * T, D) * w.attn_in
    qkv = bmm(xf, w.qkv, w.qkv_bias)
    qkv = qkv.view(C, B, T, M, Hq + 2 * Hkv, hd).permute(0, 3, 1, 2, 4, 5)  # (C, M, B, T, Hq+2Hkv, hd)
    q, k, v = qkv.split([Hq, Hkv, Hkv], dim=-2)
    if w.ve_slot is not None:
        ve = chunk_ve(w, ctx).view(C, M, B, T, Hkv, hd)
        G = w.ve_gate.shape[1]
        # the gate reads the block's normed input, norm weights included (folded into ve_gate, or applied in xf)
        gate = w.ve_scale * torch.sigmoid(bmm(xf[..., :G], w.ve_gate))  # (C, B*T, M*Hkv)
        v = v + gate.view(C, B, T, M, Hkv).permute(0, 3, 1, 2, 4).unsqueeze(-1) * ve
    y = _branch_attention(w, q, k, v, ctx, cache)  # (C, M, B, T, Hq, hd)
    y = y.permute(0, 2, 3, 1, 4, 5).reshape(C, B * T, M * Hq * hd)
    u = x + bmm(y, w.attn_out).view(C, B, T, D)  # summed attention branches
    un = norm(u, eps=w.eps).view(C, B * T, D)
    hid = mlp_act(bmm(un if w.mlp_in is None else un * w.mlp_in, w.fc), w.swiglu_dim)  # (C, B*T, M*F)
    return u + bmm(hid, w.proj).view(C, B, T, D)  # summed MLP branches


def _branch_attention(w: ChunkWeights, q: Tensor, k: Tensor, v: Tensor, ctx: Context, cache) -> Tensor:
    """Attention of all C*M fused branches, plain and mHC alike: q (C, M, B, T, Hq, hd), k/v (C, M, B, T, Hkv, hd)
    before RoPE -> (C, M, B, T, Hq, hd). QK-norm (with branch m's own Qwen3 weights) and RoPE, then causal
    attention with each branch's own window; with a KV cache, branch m of chunk c writes and reads layer
    start + c*M + m's slot (see snlp.model.cache) and the queries sit at ctx.start.."""
    C, M, B, T, Hq, hd = q.shape
    Hkv = k.shape[-2]
    qw = kw = None
    if w.q_norm is not None:
        qw, kw = w.q_norm.view(C, M, 1, 1, 1, hd), w.k_norm.view(C, M, 1, 1, 1, hd)
    q, k = qk_rope(q, k, ctx.cos, ctx.sin, w.qk_norm, qw, kw, w.eps)
    if cache is None and w.window_values is not None and uses_flex(T, w.window_values, q.device, q.requires_grad):
        # one FlexAttention call over every branch (entry (c*M + m)*B + b has branch c*M + m's window, read from the
        # weights' window tensor): each visits only the key blocks its window sees, no gathers by window (compiled
        # graphs only, see set_window_kernel)
        q, k, v = (t.reshape(C * M * B, T, -1, hd).transpose(1, 2) for t in (q, k, v))  # (C*M*B, H, T, hd)
        if q.device.type == "cpu":  # inductor's CPU flex template reads its inputs' layout as 4-D buffers: a view of
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # the 6-D stack fails to lower
        y = flex_window_attention(q, k, v, w.windows.view(-1), B, ctx.extra.setdefault("masks", {}), w.window_values)
        return y.transpose(1, 2).reshape(C, M, B, T, Hq, hd)
    q, k, v = q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)  # (C, M, B, H, T, hd)
    win = -1 if w.windows is None else w.windows  # (C, M, 1): leading dims (C, M, B)
    if cache is not None:
        kc, vc = cache.write(slice(w.start, w.start + C * M), k.reshape(C * M, B, Hkv, T, hd),
                             v.reshape(C * M, B, Hkv, T, hd), ctx.start)  # (C*M, B, Hkv, S, hd)
        if ctx.span is not None:  # eager ragged call: attend over the positions in use only (RowPositions)
            kc, vc = kc[..., :ctx.span, :], vc[..., :ctx.span, :]
        S = kc.shape[-2]
        k, v = kc.view(C, M, B, Hkv, S, hd), vc.view(C, M, B, Hkv, S, hd)
    masks = ctx.extra.setdefault("masks", {})  # masks built once per forward, not per iteration
    # prefill: branches grouped by window (full ones causal, short ones banded) where the banded kernel is taken; on
    # CUDA one masked SDPA over every branch was measured faster than gathering the groups (H200, 24 branches of 5
    # heads at T = 2048: 0.95 ms against 1.18 ms, docs/records/2026-11-26-gpu-h200.md)
    if cache is None and w.window_values is not None and \
            uses_band(T, min(x for x in w.window_values if x >= 0), q.device):
        y = attend_branches(q.reshape(C * M, B, Hq, T, hd), k.reshape(C * M, B, Hkv, T, hd),
                            v.reshape(C * M, B, Hkv, T, hd), w.window_values, w.window_groups, masks)
        return y.view(C, M, B, Hq, T, hd).transpose(-3, -2)
    y = attend(q, k, v, win, q_start=ctx.start if cache is not None else 0, masks=masks)  # (C, M, B, Hq, T, hd)
    return y.transpose(-3, -2)


# ----------------------------------------------------------------- mHC chunks (see the module docstring)
def _hc_stage(hw: HCWeights, s: int, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Stage s's (P (C,B,T,n,n), H_pre (C,B,T,M,n), coef (C,B,T,M,n)) for stage input z (C,B,T,n,D);
    static mHC gives the folded constants with singleton B, T dims."""
    if hw.fixed is not None:
        return tuple(t[:, None, None] for t in hw.fixed[s])
    C, B, T, n, D = z.shape
    M, k = hw.bias[s].shape[1:]
    dyn = bmm(norm(z.reshape(C, B * T, n * D)), hw.phi[s]).view(C, B, T, M, k)  # all M sublayers at once
    res, pre, post = hc_maps(hw.bias[s][:, None, None] + hw.gate[s][:, None, None] * dyn, n, z.dtype, **hw.maps)
    P, coef = _hc_fold(res, post)
    return P, pre, coef


def _hc_branch_inputs(pre: Tensor, z: Tensor, eps: float | None = None) -> Tensor:
    """norm(H_pre z) of every branch: pre (C,B,T,M,n), z (C,B,T,n,D) -> (C*M, B*T, D), branch-major."""
    C, B, T, n, D = z.shape
    xn = norm(pre @ z, eps=eps)  # (C, B, T, M, D)
    return xn.permute(0, 3, 1, 2, 4).reshape(-1, B * T, D)


def _hc_branch_sum(coef: Tensor, y: Tensor) -> Tensor:
    """sum_m coef_m (x) y_m: coef (C,B,T,M,n), branch outputs y (C,M,B,T,D) -> (C,B,T,n,D) in coef's dtype."""
    return coef.transpose(-1, -2) @ y.permute(0, 2, 3, 1, 4).to(coef.dtype)  # caller disables autocast


def _hc_attention(w: HCChunkWeights, xn: Tensor, ctx: Context, cache, B: int, T: int) -> Tensor:
    """All C*M attention branches on their own normed inputs xn (C*M, B*T, D) -> outputs (C, M, B, T, D)."""
    CM, _, D = xn.shape
    M, Hq, Hkv, hd = w.fuse, w.n_head, w.n_kv_head, w.head_dim
    C = CM // M
    wq = w.qkv.view(CM, D, -1)
    qkv = bmm(xn, wq, None if w.qkv_bias is None else w.qkv_bias.view(CM, 1, -1))
    q, k, v = qkv.view(C, M, B, T, Hq + 2 * Hkv, hd).split([Hq, Hkv, Hkv], dim=4)  # (C, M, B, T, H*, hd)
    if w.ve_slot is not None:
        ve = chunk_ve(w, ctx).view(C, M, B, T, Hkv, hd)
        G = w.ve_gate.shape[2]
        gate = w.ve_scale * torch.sigmoid(bmm(xn[..., :G], w.ve_gate.view(CM, G, Hkv)))
        v = v + gate.view(C, M, B, T, Hkv, 1) * ve
    y = _branch_attention(w, q, k, v, ctx, cache).reshape(CM, B * T, Hq * hd)
    return bmm(y, w.attn_out.view(CM, Hq * hd, D)).view(C, M, B, T, D)


def _hc_chunk_forward(w: HCChunkWeights, h: Tensor, ctx: Context, cache, mix: bool):
    """The fused mHC chunk (module docstring) for all C chunks: h (C, B, T, n, D) -> (C, B, T, n, D)."""
    C, B, T, n, D = h.shape
    M = w.fuse
    no_autocast = torch.autocast(h.device.type, enabled=False)  # stream mixing stays in h's dtype
    P_a, pre_a, coef_a = _hc_stage(w.hc, 0, h)
    y = _hc_attention(w, _hc_branch_inputs(pre_a, h, w.eps), ctx, cache, B, T)
    with no_autocast:
        u = P_a @ h + _hc_branch_sum(coef_a, y)
    P_m, pre_m, coef_m = _hc_stage(w.hc, 1, u)
    Fp, Fh = w.fc.shape[-1], w.proj.shape[-2]
    hid = mlp_act(bmm(_hc_branch_inputs(pre_m, u, w.eps), w.fc.view(C * M, D, Fp)), w.swiglu_dim)  # (C*M, B*T, F)
    y = bmm(hid, w.proj.view(C * M, Fh, D)).view(C, M, B, T, D)
    with no_autocast:
        out = P_m @ u + _hc_branch_sum(coef_m, y)
        if not mix:
            return out
        return out, (P_m @ P_a).expand(C, B, T, n, n)

"""A nanochat-style decoder-only Transformer.

RoPE, QK-norm, parameter-free RMSNorm, relu^2 MLP, untied lm_head, tanh logit softcap,
GQA, optional x0 residual (per-layer learnable scalars), optional gated value embeddings
on alternating layers and optional sliding-window layers. One dial (depth) sets the size.

The hidden state h_l is the output of block l, h_0 = norm(wte(idx)) = x0. Layer l maps
    f_l(h) = Block_l(lam_resid[l] * h + lam_x0[l] * x0)        (x0 residual on)
    f_l(h) = Block_l(h)                                         (x0 residual off)
which is the layer map G_l(h) = h_l - f_l(h_{l-1}) of the paper's Eq. (residual).

Llama family (snlp.hf.from_hf sets the switches; defaults are the nanochat model above): SwiGLU MLP,
q/k/v biases (Qwen2), weighted per-head q/k RMSNorm before RoPE (Qwen3) or no QK-norm, h_0 = wte(idx)
un-normalised, learned RMSNorm weights (ln_attn / ln_mlp per block, ln_f) with the model's eps,
rotate-half RoPE with transformers' frequencies (llama3 scaling), explicit head_dim, no softcap,
per-layer sliding windows and tied embeddings: the forward then equals transformers' (tests/test_hf.py).

mHC (GPTConfig.hc_streams = n >= 1; manifold-constrained hyper-connections, Xie et al. 2025, after
Zhu et al.'s hyper-connections; paper App. "Connection to Hyper-Connections and mHC"): the hidden
state is n residual streams, h_l (B, T, n, D). h_0 copies the normed embedding to every stream
(expand) and `head` sums the streams (reduce) before the final norm. Each attention and MLP
sublayer of every block is wrapped as
    x' = H_res x + H_post (x) F(norm(H_pre x))
with H_res (n x n) = Sinkhorn-Knopp(exp(logits)) (doubly stochastic, HC_SINKHORN_ITERS rounds of
row/column normalisation, in at least fp32), H_pre = sigmoid(logits) (1 x n), H_post = 2 sigmoid(logits) (n x 1).
Static mHC (hc_dynamic=False): the logits are learned biases. Dynamic (default): logits = bias +
alpha (.) (norm(vec(x)) @ phi), alpha (one gate each for res/pre/post) zero at init, so the model
starts static. Init: H_res ~ I, H_pre favours stream l mod n (breaks the symmetry between the
copied streams), H_post = 1; with the zero output projections every block starts as the identity
on identical streams, so the initial model computes what the plain one does. The x0 residual is
off with mHC (x0_residual=None picks it automatically; explicitly asking for both is an error).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

VE_GATE_CHANNELS = 32  # value-embedding gate reads the first channels of the normed input (nanochat)
HC_SINKHORN_ITERS = 20  # Sinkhorn-Knopp rounds for H_res (mHC paper: 20)
HC_RES_INIT = 4.0  # H_res logits at init: 0 on the diagonal, -HC_RES_INIT off it (H_res ~ I)
HC_PRE_INIT = 2.0  # H_pre logits at init: +2 for stream (layer mod n), -2 for the others


@dataclass
class GPTConfig:
    """Model hyper-parameters. Use `GPTConfig.from_depth` to size a model with one dial."""

    vocab_size: int = 32768
    n_layer: int = 16
    n_head: int = 8
    n_kv_head: int | None = None  # None -> n_head (no GQA)
    n_embd: int = 1024
    sequence_len: int = 2048
    mlp_ratio: int = 4
    window_pattern: str = "L"  # tiled over layers: L = full causal, S = sliding window of short_window
    short_window: int = 0  # 0 -> sequence_len // 2 (nanochat)
    x0_residual: bool | None = None  # None -> on for the plain model, off with mHC
    value_embeds: bool = True
    softcap: float = 15.0
    rope_base: float = 10000.0
    hc_streams: int = 0  # 0 = plain residual stream; n >= 1 = mHC with n streams
    hc_dynamic: bool = True  # mHC: input-dependent H (dynamic) or learned constants (static)
    # --- Llama-family switches (snlp.hf.from_hf sets them; the defaults are the nanochat model) ---
    mlp_act: str = "relu2"  # "relu2": proj(relu(fc x)^2); "swiglu": proj(silu(gate x) * up x), c_fc = [gate; up]
    ffn_dim: int = 0  # MLP hidden width; 0 -> mlp_ratio * n_embd
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    qk_norm: str = "rope_norm"  # "rope_norm": parameter-free RMSNorm after RoPE (nanochat); "weighted": per-head
    #                             RMSNorm with a learned weight before RoPE (Qwen3); "none" (Llama, Qwen2, Mistral)
    embed_norm: bool = True  # h_0 = norm(wte(idx)) (nanochat) or wte(idx) (Llama)
    norm_eps: float | None = None  # RMSNorm eps; None -> torch's default (finfo(dtype).eps)
    norm_weights: bool = False  # learned RMSNorm weights: per block ln_attn / ln_mlp, and ln_f before the head
    rope_rotate_half: bool = False  # RoPE sign convention of HF's rotate_half (x1 cos - x2 sin, x2 cos + x1 sin)
    rope_scaling: dict | None = None  # None or HF's {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    attn_head_dim: int = 0  # explicit head dim (Qwen3: n_head * head_dim != n_embd); 0 -> n_embd // n_head
    layer_windows: list | None = None  # explicit left context per layer (-1 full); overrides window_pattern
    tie_embeddings: bool = False  # lm_head.weight is wte.weight

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        errors = []
        for name in ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "sequence_len", "mlp_ratio"):
            if int(getattr(self, name)) < 1:
                errors.append(f"{name} must be >= 1 (got {getattr(self, name)})")
        if not errors and self.attn_head_dim:
            if self.attn_head_dim < 2 or self.attn_head_dim % 2:
                errors.append(f"attn_head_dim={self.attn_head_dim} must be even and >= 2 (0 = n_embd // n_head)")
            if self.n_head % self.n_kv_head:
                errors.append(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head} (GQA)")
        elif not errors:
            if self.n_embd % self.n_head:
                errors.append(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
            elif (self.n_embd // self.n_head) % 2:
                errors.append(f"head dim n_embd/n_head={self.n_embd // self.n_head} must be even for RoPE")
            if self.n_head % self.n_kv_head:
                errors.append(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head} (GQA)")
        if not self.window_pattern or set(self.window_pattern.upper()) - {"S", "L"}:
            errors.append(f"window_pattern={self.window_pattern!r} must be a non-empty string of 'S' and 'L'")
        if self.short_window < 0:
            errors.append(f"short_window must be >= 0 (got {self.short_window})")
        if self.softcap < 0:
            errors.append(f"softcap must be >= 0, 0 disables it (got {self.softcap})")
        if not isinstance(self.hc_streams, int) or self.hc_streams < 0:
            errors.append(f"hc_streams must be an integer >= 0, 0 = no mHC (got {self.hc_streams!r})")
        elif self.hc_streams > 0 and self.x0_residual:
            errors.append(f"the x0 residual cannot be combined with mHC (hc_streams={self.hc_streams}): pass "
                          f"x0_residual=False or leave it None (off automatically with mHC)")
        if self.mlp_act not in ("relu2", "swiglu"):
            errors.append(f"mlp_act={self.mlp_act!r} must be 'relu2' or 'swiglu'")
        if self.qk_norm not in ("rope_norm", "weighted", "none"):
            errors.append(f"qk_norm={self.qk_norm!r} must be 'rope_norm', 'weighted' or 'none'")
        if self.ffn_dim < 0:
            errors.append(f"ffn_dim must be >= 0, 0 = mlp_ratio * n_embd (got {self.ffn_dim})")
        if self.norm_eps is not None and not self.norm_eps > 0:
            errors.append(f"norm_eps must be > 0 or None (got {self.norm_eps})")
        if self.rope_scaling is not None:
            try:
                rope_inv_freq(self.rope_base, 2, self.rope_scaling)
            except ValueError as e:
                errors.append(str(e))
        if self.layer_windows is not None:
            if len(self.layer_windows) != self.n_layer or any(int(w) != w or w < -1 for w in self.layer_windows):
                errors.append(f"layer_windows must list n_layer={self.n_layer} integers >= -1 (-1 = full causal), "
                              f"got {self.layer_windows}")
            else:
                self.layer_windows = [int(w) for w in self.layer_windows]
        if self.hc_streams and (self.tie_embeddings or self.norm_weights):
            errors.append("tie_embeddings and norm_weights are not supported with mHC (hc_streams > 0)")
        if errors:
            raise ValueError("invalid GPTConfig: " + "; ".join(errors))
        self.window_pattern = self.window_pattern.upper()
        if self.x0_residual is None:
            self.x0_residual = self.hc_streams == 0
        self.x0_residual, self.hc_dynamic = bool(self.x0_residual), bool(self.hc_dynamic)

    @classmethod
    def from_depth(cls, depth: int, aspect_ratio: int = 64, head_dim: int = 128, width: int | None = None,
                   n_kv_head: int | None = None, **kw) -> "GPTConfig":
        """Size a model from its depth like nanochat: width = depth * aspect_ratio rounded up to a
        multiple of head_dim, heads = width / head_dim. `width` overrides the aspect ratio (the
        paper's 0.5B model is depth 32, width 640, 5 heads of 128)."""
        if depth < 1:
            raise ValueError(f"depth must be >= 1 (got {depth})")
        if width is None:
            width = head_dim * max(1, math.ceil(depth * aspect_ratio / head_dim))
        elif width % head_dim:
            raise ValueError(f"width={width} must be a multiple of head_dim={head_dim}")
        n_head = width // head_dim
        return cls(n_layer=depth, n_embd=width, n_head=n_head, n_kv_head=n_kv_head or n_head, **kw)

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.n_embd // self.n_head

    @property
    def hidden_dim(self) -> int:
        """MLP hidden width F (SwiGLU: c_fc has 2F outputs, gate then up)."""
        return self.ffn_dim or self.mlp_ratio * self.n_embd

    def window(self, layer: int) -> int:
        """Left context of `layer` in tokens (-1 = full causal). With window_pattern the last layer is
        always full; explicit layer_windows (HF sliding windows) are taken as they are."""
        if self.layer_windows is not None:
            return self.layer_windows[layer]
        kind = self.window_pattern[layer % len(self.window_pattern)]
        if kind == "L" or layer == self.n_layer - 1:
            return -1
        return self.short_window or self.sequence_len // 2

    def has_ve(self, layer: int) -> bool:
        """Value embeddings on alternating layers, always including the last (nanochat)."""
        return self.value_embeds and layer % 2 == (self.n_layer - 1) % 2

    def to_dict(self) -> dict:
        return asdict(self)


def norm(x: Tensor, weight: Tensor | None = None, eps: float | None = None) -> Tensor:
    """RMSNorm over the last dim; parameter-free unless a weight is given."""
    return F.rms_norm(x, (x.size(-1),), weight, eps)


def rope_inv_freq(base: float, head_dim: int, scaling: dict | None = None) -> Tensor:
    """RoPE inverse frequencies (head_dim/2,) in fp32, as transformers computes them; `scaling` is an HF
    rope_scaling dict: None/"default", or "llama3" (Llama 3.1: long wavelengths divided by `factor`,
    a smooth ramp between low_freq_factor and high_freq_factor). Any other rope_type is a ValueError."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: none/'default' and 'llama3'")
    try:
        factor, lo, hi = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"llama3 rope_scaling needs factor, low_freq_factor, high_freq_factor and "
                         f"original_max_position_embeddings (got {scaling})") from e
    lo_wavelen, hi_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > lo_wavelen, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
    return torch.where(medium, smoothed, out)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding on the last dim; x (..., T, H, hd), cos/sin (T, 1, hd/2)."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


def window_mask(windows: Tensor | int, T: int, S: int, q_start: int | Tensor, device) -> Tensor:
    """Boolean mask (..., T, S): query i (absolute position q_start + i, or q_start[i] when q_start is a
    (T,) position tensor) sees key j when j <= its position and, for a window w >= 0, position - j <= w."""
    if isinstance(q_start, Tensor):
        qpos = q_start.to(device)[:, None]
    else:
        qpos = torch.arange(q_start, q_start + T, device=device)[:, None]
    diff = qpos - torch.arange(S, device=device)[None, :]  # (T, S)
    w = torch.as_tensor(windows, device=device)[..., None, None]
    return (diff >= 0) & ((w < 0) | (diff <= w))


def attend(q: Tensor, k: Tensor, v: Tensor, windows: Tensor | int = -1, q_start: int | Tensor = 0) -> Tensor:
    """Causal (optionally sliding-window) attention. q (..., Hq, T, hd), k/v (..., Hkv, S, hd).

    `windows` is -1 (full) or an int/long tensor broadcastable to q.shape[:-3] (one window per
    leading index, e.g. per fused branch). Leading dims are flattened so fused SDPA kernels apply.
    `q_start` is the absolute position of the first query (keys sit at 0..S-1), or a (T,) tensor of
    the queries' positions: the static-shape decode step (snlp.steps), whose keys are a whole
    preallocated cache of which the mask hides every position after the query's.

    No host sync: a tensor of windows always takes the mask path (reading the windows back to pick the
    is_causal kernel would stall a CUDA stream and break a fullgraph torch.compile)."""
    lead, (Hq, T, hd), S = q.shape[:-3], q.shape[-3:], k.shape[-2]
    gqa = Hq != k.shape[-3]
    q4, k4, v4 = (t.reshape(-1, *t.shape[-3:]) for t in (q, k, v))
    full = isinstance(windows, int) and (windows < 0 or windows >= S)
    if full and isinstance(q_start, int) and q_start == 0 and T == S:
        y = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=gqa)
    elif full and isinstance(q_start, int) and T == 1 and q_start == S - 1:  # one cached decode query sees every
        y = F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=gqa)  # key: no mask to build (per layer, per token)
    else:
        mask = window_mask(windows if not full else -1, T, S, q_start, q.device)  # (..., T, S)
        if mask.dim() > 2:  # per-branch windows: one mask per flattened leading index
            mask = mask.expand(*lead, T, S).reshape(-1, 1, T, S)
        y = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=gqa)
    return y.view(*lead, Hq, T, hd)


def qk_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, mode: str, qw: Tensor | None = None,
            kw: Tensor | None = None, eps: float | None = None) -> tuple[Tensor, Tensor]:
    """RoPE and the QK-norm of GPTConfig.qk_norm on q/k (..., T, H, hd); qw/kw broadcast against them."""
    if mode == "rope_norm":  # nanochat: QK-norm after RoPE
        return norm(rope(q, cos, sin)), norm(rope(k, cos, sin))
    if mode == "weighted":  # Qwen3: weighted RMSNorm per head, then RoPE
        q, k = norm(q, eps=eps) * qw, norm(k, eps=eps) * kw
    return rope(q, cos, sin), rope(k, cos, sin)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        D, hd = cfg.n_embd, cfg.head_dim
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, hd
        self.c_q = nn.Linear(D, cfg.n_head * hd, bias=cfg.qkv_bias)
        self.c_k = nn.Linear(D, cfg.n_kv_head * hd, bias=cfg.qkv_bias)
        self.c_v = nn.Linear(D, cfg.n_kv_head * hd, bias=cfg.qkv_bias)
        self.c_proj = nn.Linear(cfg.n_head * hd, D, bias=False)
        self.qk_norm, self.eps = cfg.qk_norm, cfg.norm_eps
        if cfg.qk_norm == "weighted":  # Qwen3: per-head RMSNorm weights of q and k, applied before RoPE
            self.q_norm = nn.Parameter(torch.ones(hd))
            self.k_norm = nn.Parameter(torch.ones(hd))
        self.ve_gate = nn.Linear(min(VE_GATE_CHANNELS, D), cfg.n_kv_head, bias=False) if cfg.has_ve(layer) else None
        self.window = cfg.window(layer)
        self.layer_idx = layer  # slot in a KV cache (snlp.cache.KVCache)

    def forward(self, xn: Tensor, ve: Tensor | None, cos: Tensor, sin: Tensor, cache=None, start: int | Tensor = 0) -> Tensor:
        B, T, _ = xn.shape
        q = self.c_q(xn).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(xn).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(xn).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:  # gated value embedding (ResFormer-style), gate in (0, 2)
            gate = 2 * torch.sigmoid(self.ve_gate(xn[..., : self.ve_gate.in_features]))
            v = v + gate.unsqueeze(-1) * ve.view_as(v)
        q, k = qk_rope(q, k, cos, sin, self.qk_norm, getattr(self, "q_norm", None), getattr(self, "k_norm", None),
                       self.eps)
        if cache is not None:  # cached: write the new K/V at start.., attend over positions 0..start+T-1
            kc, vc = cache.write(self.layer_idx, k.transpose(1, 2), v.transpose(1, 2), start)  # (B, Hkv, S, hd)
            y = attend(q.transpose(1, 2), kc, vc, self.window, q_start=start)
            return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))
        y = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.window)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def sinkhorn(logits: Tensor, iters: int = HC_SINKHORN_ITERS) -> Tensor:
    """Sinkhorn-Knopp projection of exp(logits) (..., n, n) onto the doubly stochastic matrices:
    `iters` rounds of row then column normalisation, in at least fp32 (fp64 stays fp64). Columns
    sum to 1 exactly, rows up to the convergence error. Each row is shifted by its max before exp
    and entries are floored at 1e-30, so extreme logits neither overflow nor leave an all-zero
    row/column (NaN); plain sums and divisions (not log space) keep it to 4 small ops per round."""
    lg = logits.to(torch.promote_types(logits.dtype, torch.float32))
    m = (lg - lg.amax(-1, keepdim=True)).exp().clamp_min(1e-30)
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


def hc_gate(alpha: Tensor, n: int) -> Tensor:
    """Per-logit gate (..., n*n + 2n) from the three dynamic-mHC gates alpha (..., 3) = (res, pre, post)."""
    return torch.cat([alpha[..., 0:1].expand(*alpha.shape[:-1], n * n), alpha[..., 1:2].expand(*alpha.shape[:-1], n),
                      alpha[..., 2:3].expand(*alpha.shape[:-1], n)], -1)


def hc_maps(logits: Tensor, n: int, dtype) -> tuple[Tensor, Tensor, Tensor]:
    """mHC logits (..., n*n + 2n) = [res | pre | post] -> H_res (..., n, n) doubly stochastic,
    H_pre (..., n) in (0, 1), H_post (..., n) in (0, 2); computed in at least fp32, returned in `dtype`."""
    lg = logits.to(torch.promote_types(logits.dtype, torch.float32))
    res = sinkhorn(lg[..., : n * n].unflatten(-1, (n, n)))
    pre, post = torch.sigmoid(lg[..., n * n: n * n + n]), 2 * torch.sigmoid(lg[..., n * n + n:])
    return res.to(dtype), pre.to(dtype), post.to(dtype)


class HyperConn(nn.Module):
    """The mHC coefficients of one sublayer: bias (n*n + 2n) and, dynamic, phi (n*D, n*n + 2n) and
    gates alpha (3,). forward(x (..., n, D)) -> (H_res, H_pre, H_post), see `hc_maps`; static H
    have no leading dims (they broadcast)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        n, k = cfg.hc_streams, cfg.hc_streams * (cfg.hc_streams + 2)
        self.n = n
        self.bias = nn.Parameter(torch.zeros(k))
        self.phi = nn.Parameter(torch.zeros(n * cfg.n_embd, k)) if cfg.hc_dynamic else None
        self.alpha = nn.Parameter(torch.zeros(3)) if cfg.hc_dynamic else None

    def logits(self, x: Tensor) -> Tensor:
        if self.phi is None:
            return self.bias
        return self.bias + hc_gate(self.alpha, self.n) * (norm(x.flatten(-2)) @ self.phi)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return hc_maps(self.logits(x), self.n, x.dtype)


def hc_sublayer(hc: HyperConn, x: Tensor, branch) -> Tensor:
    """One mHC sublayer on streams x (..., n, D): H_res x + H_post (x) branch(norm(H_pre x))."""
    res, pre, post = hc(x)
    y = branch(norm((pre.unsqueeze(-2) @ x).squeeze(-2)))  # (..., D)
    with torch.autocast(x.device.type, enabled=False):  # the streams stay in x's dtype (fp32 under autocast)
        mixed = res @ x
    return mixed + post.unsqueeze(-1) * y.unsqueeze(-2)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        F_ = cfg.hidden_dim
        self.swiglu = cfg.mlp_act == "swiglu"
        self.c_fc = nn.Linear(cfg.n_embd, 2 * F_ if self.swiglu else F_, bias=False)
        self.c_proj = nn.Linear(F_, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(mlp_act(self.c_fc(x), self.c_proj.in_features if self.swiglu else 0))


def mlp_act(a: Tensor, swiglu_dim: int = 0) -> Tensor:
    """MLP activation of c_fc's output: relu^2 (..., F) -> (..., F) when swiglu_dim = 0, else SwiGLU with
    hidden width F = swiglu_dim on k branches side by side, each [gate | up]: (..., k*2F) -> (..., k*F)."""
    if not swiglu_dim:
        return F.relu(a).square()
    gu = a.unflatten(-1, (-1, 2, swiglu_dim))  # (..., k, 2, F)
    return (F.silu(gu[..., 0, :]) * gu[..., 1, :]).flatten(-2)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.)). With mHC each sublayer is
    wrapped by its HyperConn (`hc_sublayer`) and x holds the streams (..., n, D)."""

    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.hc_attn = HyperConn(cfg) if cfg.hc_streams else None
        self.hc_mlp = HyperConn(cfg) if cfg.hc_streams else None
        self.eps = cfg.norm_eps
        if cfg.norm_weights:  # HF input_layernorm / post_attention_layernorm
            self.ln_attn = nn.Parameter(torch.ones(cfg.n_embd))
            self.ln_mlp = nn.Parameter(torch.ones(cfg.n_embd))
        else:
            self.ln_attn = self.ln_mlp = None

    def forward(self, x: Tensor, ve: Tensor | None, cos: Tensor, sin: Tensor, cache=None, start: int | Tensor = 0) -> Tensor:
        if self.hc_attn is not None:
            x = hc_sublayer(self.hc_attn, x, lambda xn: self.attn(xn, ve, cos, sin, cache, start))
            return hc_sublayer(self.hc_mlp, x, self.mlp)
        x = x + self.attn(norm(x, self.ln_attn, self.eps), ve, cos, sin, cache, start)
        return x + self.mlp(norm(x, self.ln_mlp, self.eps))


@dataclass
class Context:
    """Per-forward inputs shared by every layer: x0 (B,T,D) = h_0 (with mHC (B,T,n,D): the normed
    embedding copied to every stream), value embeddings (n_ve,B,T,kv_dim)
    or None, and RoPE tables (T,1,hd/2). With a KV cache (decoding) the tokens sit at absolute
    positions start..start+T-1 and every layer reads/writes `cache` (snlp.cache.KVCache)."""

    idx: Tensor
    x0: Tensor
    ve: Tensor | None
    cos: Tensor
    sin: Tensor
    extra: dict = field(default_factory=dict)
    start: int | Tensor = 0  # a (T,) positions tensor in the static-shape step (snlp.steps)
    cache: object | None = None


class GPT(nn.Module):
    """nanochat-style GPT. `forward` is the sequential reference; `snlp.parallel_forward` is SNLP."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = cfg = config
        L, D, V = cfg.n_layer, cfg.n_embd, cfg.vocab_size
        self.wte = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(cfg, l) for l in range(L))
        self.lm_head = nn.Linear(D, V, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.ln_f = nn.Parameter(torch.ones(D)) if cfg.norm_weights else None
        if cfg.x0_residual:
            self.resid_lambdas = nn.Parameter(torch.ones(L))
            self.x0_lambdas = nn.Parameter(torch.zeros(L))
        # value embeddings live in ONE stacked table so all layers' lookups are a single gather
        self.ve_slot = [-1] * L
        ve_layers = [l for l in range(L) if cfg.has_ve(l)]
        for slot, l in enumerate(ve_layers):
            self.ve_slot[l] = slot
        if ve_layers:
            self.value_embeds = nn.Parameter(torch.empty(len(ve_layers), V, cfg.n_kv_head * cfg.head_dim))
        if cfg.rope_scaling is None and not cfg.rope_rotate_half:
            inv_freq = 1.0 / cfg.rope_base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        else:  # HF models: exactly transformers' frequencies
            inv_freq = rope_inv_freq(cfg.rope_base, cfg.head_dim, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None):
        """All initialisation in one place (nanochat): N(0,1) embeddings, tiny lm_head, uniform
        input projections with bound sqrt(3/D), zero output projections (each block starts as the
        identity), resid scalars 1 and x0 scalars 0.1. mHC: see the module docstring (H_res ~ I,
        H_pre favours stream l mod n, H_post = 1, phi uniform with bound sqrt(3/(nD)), gates 0)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        cfg = self.config
        s = math.sqrt(3.0 / cfg.n_embd)

        def uniform_(t, bound):
            t.copy_((torch.rand(t.shape, generator=gen) * 2 - 1) * bound)

        self.wte.weight.copy_(torch.randn(self.wte.weight.shape, generator=gen))
        if not cfg.tie_embeddings:
            self.lm_head.weight.copy_(torch.randn(self.lm_head.weight.shape, generator=gen) * 1e-3)
        if self.ln_f is not None:
            self.ln_f.fill_(1.0)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                uniform_(lin.weight, s)
                if lin.bias is not None:
                    lin.bias.zero_()
            for w in (block.ln_attn, block.ln_mlp, getattr(block.attn, "q_norm", None),
                      getattr(block.attn, "k_norm", None)):
                if w is not None:
                    w.fill_(1.0)
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()
            if block.attn.ve_gate is not None:
                block.attn.ve_gate.weight.zero_()
        if cfg.x0_residual:
            self.resid_lambdas.fill_(1.0)
            self.x0_lambdas.fill_(0.1)
        if hasattr(self, "value_embeds"):
            uniform_(self.value_embeds, s)
        n = cfg.hc_streams
        for l, block in enumerate(self.blocks if n else []):
            for hc in (block.hc_attn, block.hc_mlp):
                res = torch.full((n, n), -HC_RES_INIT)
                res.fill_diagonal_(0.0)
                pre = torch.full((n,), -HC_PRE_INIT)
                pre[l % n] = HC_PRE_INIT
                hc.bias.copy_(torch.cat([res.flatten(), pre, torch.zeros(n)]))
                if hc.phi is not None:
                    uniform_(hc.phi, math.sqrt(3.0 / (n * cfg.n_embd)))
                    hc.alpha.zero_()

    # ----- pieces shared by the sequential and the parallel forward -----
    def check_tokens(self, idx: Tensor) -> None:
        """Raise a ValueError for token ids of the wrong type, shape or range."""
        if not isinstance(idx, Tensor):
            raise ValueError(f"token ids must be a torch.Tensor of shape (B, T), got {type(idx).__name__}")
        if idx.dtype not in (torch.long, torch.int32, torch.int16, torch.uint8):
            raise ValueError(f"token ids must be an integer tensor, got dtype {idx.dtype}")
        if idx.dim() != 2 or idx.shape[0] < 1 or idx.shape[1] < 1:
            raise ValueError(f"token ids must have shape (B, T) with B, T >= 1, got {tuple(idx.shape)}")
        # host-side range check: skipped on CUDA (a device-side assert fires instead, no sync here)
        # and under torch.compile (it would break the graph)
        if not idx.is_cuda and not torch.compiler.is_compiling():
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got range [{lo}, {hi}]")

    def rotary(self, T: int, start: int | Tensor = 0) -> tuple[Tensor, Tensor]:
        """RoPE tables for positions start..start+T-1 (or the (T,) positions tensor `start`), (T, 1, hd/2)."""
        if isinstance(start, Tensor):
            t = start.to(device=self.inv_freq.device, dtype=torch.float32)
        else:
            t = torch.arange(start, start + T, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.float())[:, None, :]  # fp32 in every dtype, as transformers does
        dtype = self.wte.weight.dtype
        sin = freqs.sin().to(dtype)
        return freqs.cos().to(dtype), -sin if self.config.rope_rotate_half else sin

    def embed(self, idx: Tensor, cache=None, pos: Tensor | None = None) -> Context:
        """Token ids (B,T) -> the per-forward Context (x0, value embeddings, RoPE). With a KV
        `cache` the tokens continue the cached sequence: they sit at positions cache.length..
        With `pos` (a (T,) long tensor of absolute positions, static-shape decoding, snlp.steps) they sit
        at those positions instead and `cache.length` is not read: the caller checked the room and owns
        the length, so nothing here depends on a Python-side position (one compiled graph for every step)."""
        self.check_tokens(idx)
        idx = idx.long()
        start: int | Tensor = 0
        if pos is not None:
            if cache is None:
                raise ValueError("embed(pos=...) is the static-shape KV-cached step: pass the cache too")
            if pos.shape != (idx.shape[1],):
                raise ValueError(f"pos must be a (T,) = ({idx.shape[1]},) tensor of positions, got {tuple(pos.shape)}")
            if idx.shape[0] != cache.batch or idx.shape[1] > cache.max_len:
                raise ValueError(f"KV cache holds batch {cache.batch} x {cache.max_len} positions, got ids "
                                 f"{tuple(idx.shape)}")
            start = pos
        elif cache is not None:
            cache.check(idx.shape[0], idx.shape[1])
            start = cache.length
        x0 = self.wte(idx)
        if self.config.embed_norm:
            x0 = norm(x0)
        if self.config.hc_streams:  # mHC expand: h_0 = the embedding copied to every stream
            x0 = x0.unsqueeze(-2).expand(*x0.shape[:-1], self.config.hc_streams, x0.shape[-1])
        ve = self.value_embeds[:, idx] if hasattr(self, "value_embeds") else None  # (n_ve, B, T, kv)
        cos, sin = self.rotary(idx.shape[1], start)
        return Context(idx=idx, x0=x0, ve=ve, cos=cos, sin=sin, start=start, cache=cache)

    def layer(self, l: int, h: Tensor, ctx: Context) -> Tensor:
        """f_l(h): the full map of layer l from h_{l-1} to h_l (x0 mixing included)."""
        if self.config.x0_residual:
            h = self.resid_lambdas[l] * h + self.x0_lambdas[l] * ctx.x0
        slot = self.ve_slot[l]
        ve = ctx.ve[slot] if slot >= 0 else None
        if ctx.cache is not None:
            return self.blocks[l](h, ve, ctx.cos, ctx.sin, ctx.cache, ctx.start)
        return self.blocks[l](h, ve, ctx.cos, ctx.sin)

    def head(self, h: Tensor) -> Tensor:
        """Final norm, lm_head and tanh softcap: h_L (B,T,D) -> logits (B,T,V) in fp32. With mHC,
        h_L (B,T,n,D) is first reduced by summing the streams."""
        if self.config.hc_streams:
            h = h.sum(-2)
        logits = self.lm_head(norm(h, self.ln_f, self.config.norm_eps)).float()
        c = self.config.softcap
        return c * torch.tanh(logits / c) if c > 0 else logits

    def run_layers(self, h: Tensor, ctx: Context, start: int, stop: int, trace: list | None = None) -> Tensor:
        """Apply layers start..stop-1 sequentially, optionally appending each h_l to `trace`."""
        for l in range(start, stop):
            h = self.layer(l, h, ctx)
            if trace is not None:
                trace.append(h)
        return h

    def hidden_states(self, idx: Tensor) -> list[Tensor]:
        """Sequential trace [h_0, h_1, ..., h_L], each (B,T,D) ((B,T,n,D) with mHC)."""
        ctx = self.embed(idx)
        trace = [ctx.x0]
        self.run_layers(ctx.x0, ctx, 0, self.config.n_layer, trace)
        return trace

    def forward(self, idx: Tensor, targets: Tensor | None = None, cache=None, pos: Tensor | None = None) -> Tensor:
        """Sequential forward: logits (B,T,V), or the mean cross-entropy if `targets` is given
        (targets == -1 are ignored). With a KV `cache` (snlp.cache.KVCache) idx continues the
        cached sequence: its K/V are written at cache.length.. and the cache advances by T. With `pos`
        ((T,) positions, the static-shape step of snlp.steps) the K/V go to those positions, the whole
        cache is attended under a mask and the cache does not advance (the caller owns the length)."""
        ctx = self.embed(idx, cache, pos)
        logits = self.head(self.run_layers(ctx.x0, ctx, 0, self.config.n_layer))
        if cache is not None and pos is None:
            cache.advance(idx.shape[1])
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

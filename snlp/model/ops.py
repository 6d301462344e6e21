"""The model's tensor ops, shared by the sequential model and the fused chunks: RMSNorm, RoPE, masked
attention over a (possibly static, masked) KV window, q/k norm + RoPE, MLP activations."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

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
    (T,) position tensor) sees key j when j <= its position and, for a window w >= 0, position - j <= w.
    With q_start a (B, T) tensor (ragged batched decoding: every row at its own positions, snlp.decode.batch)
    the mask is per row, (..., B, 1, T, S) (the 1 broadcasts over heads), and `windows` broadcasts against
    the leading dims before B (e.g. (C, M, 1) per fused branch, whose trailing 1 is the batch dim)."""
    if isinstance(q_start, Tensor) and q_start.dim() == 2:
        diff = q_start.to(device)[:, None, :, None] - torch.arange(S, device=device)  # (B, 1, T, S)
        if isinstance(windows, int) and windows < 0:  # full attention: causal only (fewer ops per layer and step)
            return diff >= 0
        if isinstance(windows, int):  # a Python window compares as a scalar: no host-to-device copy per layer
            return (diff >= 0) & (diff <= windows)
        w = windows.to(device)[..., None, None, None]
        return (diff >= 0) & ((w < 0) | (diff <= w))
    if isinstance(q_start, Tensor):
        qpos = q_start.to(device)[:, None]
    else:
        qpos = torch.arange(q_start, q_start + T, device=device)[:, None]
    diff = qpos - torch.arange(S, device=device)[None, :]  # (T, S)
    if isinstance(windows, int):  # scalar compares: torch.as_tensor of a Python int is a synchronising H2D copy
        return diff >= 0 if windows < 0 else (diff >= 0) & (diff <= windows)
    w = windows.to(device)[..., None, None]
    return (diff >= 0) & ((w < 0) | (diff <= w))


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """The float attention mask SDPA makes of a boolean one itself (aten.where in the query's dtype: 0 where
    `allowed`, -inf elsewhere), so SDPA needs no conversion of its own (scalar_tensor x 2 + where, a mask-sized
    write, on every call). Values identical to the boolean mask's, hence outputs too."""
    return torch.full(allowed.shape, float("-inf"), dtype=dtype, device=allowed.device).masked_fill_(allowed, 0.0)


def _memo_key(x) -> tuple:
    """A mask memo's key part for a window / position argument: Python ints by value, tensors by identity (the
    entry keeps a reference, so an id is never reused while its entry lives; no host read of the values)."""
    return ("tensor", id(x)) if isinstance(x, Tensor) else ("int", x)


def attention_mask(windows: Tensor | int, T: int, S: int, q_start: int | Tensor, lead: tuple, device,
                   dtype: torch.dtype, masks: dict | None = None) -> Tensor:
    """The additive mask `attend` hands SDPA: (T, S) for one int window and int / (T,) positions (broadcast over
    every head and batch row: never materialised per row), else (N, 1, T, S) with N = prod(lead) (per-row positions
    (B, T), or per-branch window tensors). With `masks` (a dict that lives for one forward, Context.extra["masks"])
    each mask is built once per forward instead of once per layer / branch stack / iteration: entries for int
    windows are keyed by (window, T, S, positions, lead, dtype, device); a window TENSOR (a fused branch stack's
    (C, M, 1)) keeps a single slot that the next different stack replaces, so callers that slice weights per
    chunk (the exact-Newton reference, fused_sequential) never pile up masks. Not used while compiling."""
    # a compiled graph is traced once, and a key by tensor identity would make dynamo guard on that identity (a
    # recompile per call): no memo while compiling
    if masks is None or torch.compiler.is_compiling():
        return _build_mask(windows, T, S, q_start, lead, device, dtype)
    key = (_memo_key(windows), T, S, _memo_key(q_start), tuple(lead), dtype, str(device))
    slot = "branch" if isinstance(windows, Tensor) else key
    if slot in masks and masks[slot][1] == key:
        return masks[slot][2]
    mask = _build_mask(windows, T, S, q_start, lead, device, dtype)
    masks[slot] = ((windows, q_start), key, mask)  # the keyed tensors stay referenced (see _memo_key)
    return mask


def _build_mask(windows: Tensor | int, T: int, S: int, q_start: int | Tensor, lead: tuple, device,
                dtype: torch.dtype) -> Tensor:
    """attention_mask without the memo."""
    mask = window_mask(windows, T, S, q_start, device)  # (..., T, S) bool
    if isinstance(q_start, Tensor) and q_start.dim() == 2:  # per-row mask (..., B, 1, T, S)
        mask = mask.expand(*lead, 1, T, S).reshape(-1, 1, T, S)
    elif mask.dim() > 2:  # per-branch windows: one mask per flattened leading index
        mask = mask.expand(*lead, T, S).reshape(-1, 1, T, S)
    return additive_mask(mask, dtype)


def attend(q: Tensor, k: Tensor, v: Tensor, windows: Tensor | int = -1, q_start: int | Tensor = 0,
           masks: dict | None = None) -> Tensor:
    """Causal (optionally sliding-window) attention. q (..., Hq, T, hd), k/v (..., Hkv, S, hd).

    `windows` is -1 (full) or an int/long tensor broadcastable to q.shape[:-3] (one window per
    leading index, e.g. per fused branch). Leading dims are flattened so fused SDPA kernels apply.
    `q_start` is the absolute position of the first query (keys sit at 0..S-1), or a (T,) tensor of
    the queries' positions: the static-shape decode step (snlp.decode.steps), whose keys are a whole
    preallocated cache of which the mask hides every position after the query's; or a (B, T) tensor, one
    row of positions per sequence (ragged batches, q.shape[-4] = B). `masks`: a per-forward memo (see
    `attention_mask`); without it the mask is built for this call alone.

    Full causal attention from position 0 takes SDPA's is_causal path (no mask: the flash kernel on CUDA); every
    other case hands SDPA an additive float mask in q's dtype (`attention_mask`).

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
        mask = attention_mask(windows if not full else -1, T, S, q_start, lead, q.device, q.dtype, masks)
        y = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=gqa)
    return y.view(*lead, Hq, T, hd)


def qk_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, mode: str, qw: Tensor | None = None,
            kw: Tensor | None = None, eps: float | None = None) -> tuple[Tensor, Tensor]:
    """RoPE and the QK-norm of GPTConfig.qk_norm on q/k (..., T, H, hd); qw/kw broadcast against them: Qwen3's
    per-head weights ("weighted"), or with "rope_norm" the scale GPTConfig.qk_scale (None: 1)."""
    if mode == "rope_norm":  # nanochat: QK-norm after RoPE (then nanochat-snlp's qk_scale)
        q, k = norm(rope(q, cos, sin)), norm(rope(k, cos, sin))
        return (q, k) if qw is None else (q * qw, k * kw)
    if mode == "weighted":  # Qwen3: weighted RMSNorm per head, then RoPE
        q, k = norm(q, eps=eps) * qw, norm(k, eps=eps) * kw
    return rope(q, cos, sin), rope(k, cos, sin)


def mlp_act(a: Tensor, swiglu_dim: int = 0) -> Tensor:
    """MLP activation of c_fc's output: relu^2 (..., F) -> (..., F) when swiglu_dim = 0, else SwiGLU with
    hidden width F = swiglu_dim on k branches side by side, each [gate | up]: (..., k*2F) -> (..., k*F)."""
    if not swiglu_dim:
        return F.relu(a).square()
    gu = a.unflatten(-1, (-1, 2, swiglu_dim))  # (..., k, 2, F)
    return (F.silu(gu[..., 0, :]) * gu[..., 1, :]).flatten(-2)

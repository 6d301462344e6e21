"""The model's tensor ops, shared by the sequential model and the fused chunks: RMSNorm, RoPE, masked
attention over a (possibly static, masked) KV window, sliding-window attention that pays for the window only
(banded; FlexAttention with a block-sparse window mask inside compiled graphs), q/k norm + RoPE, MLP activations."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.torch_version import TorchVersion

from snlp.runtime.checks import ENV_CHOICES, env_choice


def norm(x: Tensor, weight: Tensor | None = None, eps: float | None = None) -> Tensor:
    """RMSNorm over the last dim; parameter-free unless a weight is given."""
    return F.rms_norm(x, (x.size(-1),), weight, eps)


def rope_inv_freq(base: float, head_dim: int, scaling: dict | None = None) -> Tensor:
    """RoPE inverse frequencies (head_dim/2,) in fp32, as transformers computes them; `scaling` is an HF
    rope_scaling dict: None/"default", "linear" (every frequency divided by `factor`: positions interpolated), or
    "llama3" (Llama 3.1: long wavelengths divided by `factor`, a smooth ramp between low_freq_factor and
    high_freq_factor). Any other rope_type is a ValueError (yarn and longrope also scale cos/sin, dynamic changes the
    frequencies with the sequence length: no fixed table reproduces them)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        factor = (scaling or {}).get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"linear rope_scaling needs a factor > 0 (got {scaling})")
        return inv / float(factor)
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: none/'default', 'linear' and 'llama3'")
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


def round_bf16(x: Tensor) -> Tensor:
    """fp32 `x` rounded to the nearest bf16 value (ties to even), still fp32. Integer arithmetic on the bits, since
    inductor folds a cast round trip x.bfloat16().float() away (emulate_precision_casts is off by default), and a
    compiled forward would then use other values than the eager one. Finite fp32 only (RoPE tables): a NaN would come
    out as inf or 0, and another dtype's bits would be read as fp32."""
    if x.dtype != torch.float32:
        raise ValueError(f"round_bf16 takes fp32, got {x.dtype}")
    b = x.contiguous().view(torch.int32)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536  # -65536: the top 16 bits, bf16's sign, exponent and mantissa
    return b.view(torch.float32)


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


WINDOW_KERNELS = ENV_CHOICES["SNLP_WINDOW_ATTENTION"][0]
# None until first read: SNLP_WINDOW_ATTENTION is read when a model is built (window_kernel, called by GPT()), not at
# import, so a misspelt value is a ValueError there (it would otherwise run as "auto") while `import snlp` works
_window_kernel: str | None = None


def set_window_kernel(kind: str | None) -> str | None:
    """How a sliding-window layer's prefill attention is computed; returns the previous setting (None where none was
    set or read yet: passing None back restores that state, SNLP_WINDOW_ATTENTION read at the next model). "masked": one
    SDPA over all T x T scores under an additive mask (the reference); "banded": query blocks of b attend only
    their w + b keys (`banded_attention`); "flex": FlexAttention with a block-sparse sliding-window mask
    (`flex_window_attention`) wherever it runs compiled, i.e. inside a torch.compile'd forward, plan or train step
    (eager FlexAttention materialises every score: a slow reference), and not where torch has no kernel for it (its
    backward on the CPU) or a broken one (the CPU before torch 2.13: CPU_FLEX_THREADS_SAFE); elsewhere "flex" chooses
    as "auto" does. "auto": by measurement, per device:
      - CPU: banded once the band excludes at least half of the causal scores (14.5 against 108 ms of thread time at
        T = 4096, w = 256, one layer), compiled graphs included: FlexAttention compiled beats the banded kernel per
        call (thread time, one thread, fp32, 4 heads of 64: one layer at T = 4096, w = 256 18.8 ms against 22.7
        banded compiled; a stack of 6 short + 2 full branches 316 against 432), but not per compiled forward (depth
        8, width 256, T = 4096, w = 256: flex / banded 0.94-1.08 over the sequential forward, 6xF1-h0-K1 and
        3xF2-h0-K1 in two runs: ties) while its CPU compile takes longer (docs/records/2026-11-26-flex-windows.md);
      - CUDA, one layer: masked (H200, T = 2048, window 512, bf16: cuDNN's masked SDPA 0.069 ms, banded 0.466,
        FlexAttention compiled 0.134);
      - CUDA, a compiled fused stack whose branches mix windows (an SSSL suffix: 18 short + 6 full branches of 5
        heads, same card and shapes): FlexAttention with a per-branch window 0.44 ms against 0.95 for one masked
        SDPA over every branch and 1.18 for the branches grouped by window (docs/records/2026-11-26-gpu-h200.md);
        eager, or in a graph that builds a backward (not measured), masked.
    Fused stacks group their branches by window only where the banded kernel is taken (snlp.method.fusion). The
    environment variable SNLP_WINDOW_ATTENTION sets the default. All four compute the same function (round-off
    apart)."""
    global _window_kernel
    if kind is not None and kind not in WINDOW_KERNELS:
        raise ValueError(f"window attention kernel must be one of {', '.join(WINDOW_KERNELS)}, got {kind!r}")
    # the previous value as held, not window_kernel(): a kernel set in code overrides the environment, so a misspelt
    # SNLP_WINDOW_ATTENTION must not stop a caller from setting one
    prev, _window_kernel = _window_kernel, kind
    return prev


def window_kernel() -> str:
    """The window attention kernel set now (set_window_kernel): traced code reads it as a constant, so a compiled
    decode step's own check of what its guards protect reads it too (snlp.decode.steps.StepState). The first call reads
    SNLP_WINDOW_ATTENTION (a ValueError in one line for a value not in WINDOW_KERNELS); GPT() makes that call, so
    traced code only reads the global."""
    global _window_kernel
    if _window_kernel is None:
        _window_kernel = env_choice("SNLP_WINDOW_ATTENTION")
    return _window_kernel


_window_tally: list[int] | None = None  # window_flops_tally's count while it is open


@contextmanager
def window_flops_tally():
    """Count the attention FLOPs sliding windows leave out, for model-FLOP counts (snlp.train.flops): while open,
    every sliding-window layer takes the masked kernel, which a FLOP counter charges the whole T x S score square
    (QK^T and PV: 4 x head_dim FLOPs per query and key, per head), and `attend` adds to the yielded one-element list
    what that charges beyond the window, query by query: S - min(window, S) keys, the convention of nanochat's
    estimate_flops (12 x heads x head_dim x min(window, T) per token and layer, forward and backward). Its backward
    (twice the forward) is added when the gradient really flows through the layer, a forward-mode tangent's
    matmuls (DiagN's jvp estimator) as the layer computes them, and the backward of a jvp that the step
    differentiates (exact Newton) by jvp_flops_tally. Eager only; not thread-safe
    (the window kernel it sets is process-wide)."""
    global _window_tally
    prev_kernel, prev, _window_tally = set_window_kernel("masked"), _window_tally, [0]
    try:
        yield _window_tally
    finally:
        _window_tally = prev
        set_window_kernel(prev_kernel)


def _tally_window(q: Tensor, k: Tensor, v: Tensor, windows: Tensor | int, y: Tensor) -> None:
    lead, (Hq, T, hd), S = q.shape[:-3], q.shape[-3:], k.shape[-2]
    if isinstance(windows, int):
        skipped = (S - min(windows, S)) * math.prod(lead) if windows >= 0 else 0
    else:  # one window per leading index (fused branches): -1 is full
        w = torch.broadcast_to(windows.detach().to("cpu", torch.long), lead)
        skipped = int(torch.where(w < 0, 0, S - w.clamp(max=S)).sum())
    fwd = 4 * hd * Hq * T * skipped
    if not fwd:
        return
    tally = _window_tally
    tally[0] += fwd
    # forward-mode AD (DiagN's jvp estimator, snlp.method.jacobian.jvp: the math SDPA differentiated op by op)
    # computes the tangent of each matmul with a dual input over the same square, both of its terms (dQ K^T +
    # Q dK^T; dP V + P dV, dP dual iff Q or K is), each term as much work as that matmul's forward (half of fwd)
    tq, tk, tv = (fwAD.unpack_dual(t).tangent is not None for t in (q, k, v))
    tangent = fwd * ((tq or tk) + (tq or tk or tv))
    tally[0] += tangent
    if _jvp_excess is not None:  # inside a jvp the caller's autograd may differentiate: see jvp_flops_tally
        _jvp_excess[0] += fwd + tangent
    if y.requires_grad:
        y.register_hook(lambda g: tally.__setitem__(0, tally[0] + 2 * fwd))


_jvp_excess: list[int] | None = None  # jvp_flops_tally's forward excess of the jvp in progress


def jvp_flops_tally(run: Callable[[], Tensor]) -> Tensor:
    """run() (a torch.func.jvp call, snlp.method.jacobian.jvp) with window_flops_tally's count of the backward that
    the caller's autograd runs through it: exact Newton (snlp.method.jacobian.newton_delta) differentiates its JVPs,
    i.e. every matmul of the primal and the tangent over again (twice each), each over the whole masked square,
    while inside the transform no tensor says it records a gradient (functorch hides the outer autograd), so the
    tensor hook `attend` puts on a layer's output never fires. Their window excess is charged twice when the
    gradient reaches the jvp's result instead. Nothing but run() outside an open tally or while compiling."""
    global _jvp_excess
    if _window_tally is None or torch.compiler.is_compiling():
        return run()
    prev, _jvp_excess = _jvp_excess, [0]
    try:
        out = run()
        excess = _jvp_excess[0]
    finally:
        _jvp_excess = prev
    if excess and out.requires_grad:
        tally = _window_tally
        out.register_hook(lambda g: tally.__setitem__(0, tally[0] + 2 * excess))
    return out


def band_block(window: int) -> int:
    """Query block size b of the banded formulation for a window w: about w / 2 (a multiple of 16, at least 16).
    Each block attends w + b keys; smaller blocks waste fewer scores but make smaller matmuls (on the CPU, w = 256
    at T = 4096: b = 128 cost 14.5 ms of thread time, b = 256 18.6, b = 512 27.8, the masked SDPA 108)."""
    return max(16, (window // 2 + 15) // 16 * 16)


def uses_band(T: int, window: int, device) -> bool:
    """Whether `attend` takes the banded path for a prefill of T tokens with this window (see set_window_kernel)."""
    kernel = window_kernel()
    if kernel == "masked" or window < 0 or window >= T - 1:
        return False
    pays = 2 * (window + band_block(window)) <= T  # keys per block vs the causal average T / 2
    return pays if kernel == "banded" else pays and torch.device(device).type == "cpu"  # auto, flex


def uses_flex(T: int, windows: tuple[int, ...], device, requires_grad: bool) -> bool:
    """Whether a prefill of T tokens (queries and keys at 0..T-1) over branches with these windows (one entry for
    a single layer, the C*M branches' for a fused stack) takes `flex_window_attention` (see set_window_kernel):
    only while torch.compile traces (eager FlexAttention is an unfused reference that materialises every score),
    only if some window bites (w < T - 1), never for a CPU backward (torch 2.13 refuses it: "FlexAttention does
    not support backward on CPU"), and never on the CPU before torch 2.13 (CPU_FLEX_THREADS_SAFE). "auto" takes it
    on CUDA for stacks that mix windows in graphs without a backward only (their forward measured faster there, one
    layer measured slower, no backward measured yet; see set_window_kernel for the CPU's measurements)."""
    kernel = window_kernel()
    if kernel in ("masked", "banded") or not torch.compiler.is_compiling():
        return False
    if all(w < 0 or w >= T - 1 for w in windows):
        return False
    kind = torch.device(device).type
    backward = requires_grad and torch.is_grad_enabled()
    if kind == "cpu" and (backward or not CPU_FLEX_THREADS_SAFE):
        return False
    if kernel == "flex":
        return True
    return kind == "cuda" and len(set(windows)) > 1 and not backward


# torch before 2.13: the compiled CPU FlexAttention kernel corrupts the heap when it runs on more than one thread
# ("corrupted double-linked list" / SIGSEGV under torch 2.11, one thread correct; 2.13 correct on any number). The
# thread count cannot be read inside a traced graph (a graph break), so there the CPU never takes it
# (docs/records/2026-11-27-torch-2.11-on-cpu.md)
CPU_FLEX_THREADS_SAFE = TorchVersion(torch.__version__) >= (2, 13)

FLEX_BLOCK = 128  # FlexAttention's tile (its default BLOCK_SIZE): the block mask's granularity


def flex_block_mask(windows: Tensor | int, rows: int, T: int, device, grad: bool = True) -> BlockMask:
    """The FlexAttention BlockMask of causal sliding-window attention over a batch of sequences, queries and keys at
    0..T-1: query p sees key j iff j <= p and (w < 0 or p - j <= w), as window_mask. `windows` is one int window
    for every sequence, or a (W,) tensor: sequence n has window windows[n // rows] (a fused stack's branches, each
    over `rows` batch rows; read from the tensor inside the mask, so no host copy and no per-value recompile).

    Built from block-level arithmetic, not by evaluating the mask on every (p, j) pair as create_block_mask does
    (a T x T pass per sequence): query block i (positions i*b .. i*b + b - 1, b = FLEX_BLOCK) and key block j have
    differences p - j in [lo, hi], lo = (i - j) b - b + 1, hi = (i - j) b + b - 1, so the pair is visited iff
    hi >= 0 and lo <= w, and needs no mask (a full block) iff lo >= 0 and hi <= w and both blocks lie inside the
    sequence (a partial last block keeps the mask). O(W (T / b)^2) small integer ops, built inside the compiled
    graph (no host cache to guard on), once per forward through the forward's mask memo (flex_window_attention).
    `grad`: also build the transposed (key-major) block lists the backward reads."""
    b = FLEX_BLOCK
    n = -(-T // b)
    inside = T // b  # blocks wholly inside the sequence
    one = isinstance(windows, int)
    if one:  # host arithmetic, and a (1, 1, ...) block mask that broadcasts over the batch
        wb, W, R = T if windows < 0 else windows, 1, 1  # full attention = a window no pair exceeds
    else:
        w = windows.reshape(-1)  # (W,)
        wb, W, R = torch.where(w < 0, T, w)[:, None, None], w.shape[0], rows  # (W, 1, 1)
    i = torch.arange(n, device=device)
    d = (i[:, None] - i[None, :]) * b  # (n, n): query block i, key block j
    lo, hi = d - (b - 1), d + (b - 1)
    visit = ((hi >= 0) & (lo <= wb)).expand(W, n, n)
    full = ((lo >= 0) & (hi <= wb) & (i[:, None] < inside) & (i[None, :] < inside)).expand(W, n, n)
    part = visit & ~full

    def lists(m: Tensor) -> tuple[Tensor, Tensor]:  # (W, n, n) bool -> counts (W*R, 1, n), indices (W*R, 1, n, n)
        num = m.sum(-1, dtype=torch.int32)
        # listed key blocks first, in order: block j goes to slot (number of listed blocks before it); unlisted ones
        # to a spare slot n that is cut off (a scatter, not a sort: inductor lowers it, a sort falls back to aten)
        slot = torch.where(m, m.cumsum(-1) - 1, n)
        idx = torch.zeros(W, n, n + 1, dtype=torch.int32, device=device).scatter_(
            -1, slot, i.to(torch.int32).expand(W, n, n))[..., :n]
        return (num[:, None].expand(W, R, n).reshape(W * R, 1, n),
                idx[:, None].expand(W, R, n, n).reshape(W * R, 1, n, n))

    (kv_num, kv_idx), (full_num, full_idx) = lists(part), lists(full)
    if one:
        def mask_mod(bi, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) if windows < 0 else (kv_idx <= q_idx) & (q_idx - kv_idx <= windows)
    else:
        def mask_mod(bi, h, q_idx, kv_idx):  # bi: the batch entry, a sequence of branch bi // rows
            win = w[bi // rows]
            return (kv_idx <= q_idx) & ((win < 0) | (q_idx - kv_idx <= win))

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=b, mask_mod=mask_mod,
                                    seq_lengths=(T, T), compute_q_blocks=grad)


def flex_window_attention(q: Tensor, k: Tensor, v: Tensor, windows: Tensor | int, rows: int = 1,
                          masks: dict | None = None, key: tuple | int | None = None) -> Tensor:
    """Causal sliding-window attention through FlexAttention: q (N, Hq, T, hd), k/v (N, Hkv, T, hd) -> (N, Hq, T,
    hd); `windows` one int for every sequence, or a (W,) tensor with N = W * rows, entry n attending with window
    windows[n // rows] (w < 0: causal only), so a fused stack's branches, each with its own window, run as ONE call
    that visits only the key blocks each window can see. Meant for compiled graphs (`uses_flex`); the softmax scale
    is SDPA's 1 / sqrt(hd). With `masks` (the forward's memo, see `attention_mask`) the block mask is built once per
    forward for each (`key`, rows): `key` names the windows by host values (the int, or a stack's window tuple),
    never by tensor identity, so a compiled graph keeps it in its memo without guarding on an object."""
    T = q.shape[-2]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    # No T in the key: the memo lives for one forward (one T), and a dict keyed by T would make dynamo specialise T
    # (one graph per prompt length even under dynamic=True)
    slot = ("flex", windows if isinstance(windows, int) else key, rows, grad, str(q.device))
    bm = None if masks is None or slot[1] is None else masks.get(slot)
    if bm is None:
        bm = flex_block_mask(windows, rows, T, q.device, grad=grad)
        if masks is not None and slot[1] is not None:
            masks[slot] = bm
    return flex_attention(q, k, v, block_mask=bm, enable_gqa=q.shape[1] != k.shape[1])


def _band_masks(T: int, w: int, b: int, device, dtype, masks: dict | None) -> tuple[Tensor, Tensor]:
    """The banded formulation's additive masks: (head, body). Block i's queries sit at i*b + r (r < b) and its keys
    at i*b + s - w (s < w + b): key s is visible to query r iff r <= s <= r + w (causal, within the window), and,
    for the first blocks only (head, (n0, 1, b, w + b) with n0 = ceil(w / b)), iff its position i*b + s - w >= 0
    (keys before the sequence are zero padding). Every later block shares one (b, w + b) body mask."""
    key = ("band", T, w, b, dtype, str(device))
    if masks is not None and not torch.compiler.is_compiling() and key in masks:
        return masks[key]
    r = torch.arange(b, device=device)[:, None]
    s = torch.arange(w + b, device=device)[None, :]
    body = (s >= r) & (s <= r + w)  # (b, w + b)
    n0 = min(-(-w // b), -(-T // b))
    i = torch.arange(n0, device=device)[:, None, None]
    head = body & (i * b + s - w >= 0)  # (n0, b, w + b)
    out = (additive_mask(head.unsqueeze(1), dtype), additive_mask(body, dtype))
    if masks is not None and not torch.compiler.is_compiling():
        masks[key] = out
    return out


def banded_attention(q: Tensor, k: Tensor, v: Tensor, window: int, masks: dict | None = None) -> Tensor:
    """Causal sliding-window attention from position 0 that computes only the scores its window can see (up to the
    block edges): q (N, Hq, T, hd), k/v (N, Hkv, T, hd) -> (N, Hq, T, hd); query p sees keys p - window .. p.

    The T queries are cut into n = ceil(T / b) blocks of b = band_block(window); block i attends the w + b keys
    before and inside it, gathered from the keys padded by w zeros in front (padding keys are masked out). So a
    forward costs T (w + b) scores instead of T^2 / 2 (causal) or T^2 (masked): 4x fewer than causal at T = 4096,
    w = 256. The first n0 = ceil(w / b) blocks (whose band starts before the sequence) run as one SDPA with their own
    masks, every later block as one SDPA sharing a single (b, w + b) mask."""
    N, Hq, T, hd = q.shape
    Hkv = k.shape[1]
    w = window
    b = band_block(w)
    n = -(-T // b)
    Tp = n * b
    qp = F.pad(q, (0, 0, 0, Tp - T))
    kb, vb = (F.pad(t, (0, 0, w, Tp - T)).unfold(2, w + b, b) for t in (k, v))  # (N, Hkv, n, hd, w + b): views
    qb = qp.view(N, Hq, n, b, hd).transpose(1, 2)  # (N, n, Hq, b, hd)
    kb, vb = kb.permute(0, 2, 1, 4, 3), vb.permute(0, 2, 1, 4, 3)  # (N, n, Hkv, w + b, hd)
    head_mask, body_mask = _band_masks(T, w, b, q.device, q.dtype, masks)
    n0 = head_mask.shape[0]
    gqa = Hq != Hkv

    def run(sl: slice, mask: Tensor) -> Tensor:  # blocks sl of every sequence as one 4-D SDPA batch
        m = sl.stop - sl.start
        return F.scaled_dot_product_attention(
            qb[:, sl].reshape(N * m, Hq, b, hd), kb[:, sl].reshape(N * m, Hkv, w + b, hd),
            vb[:, sl].reshape(N * m, Hkv, w + b, hd), attn_mask=mask, enable_gqa=gqa).view(N, m, Hq, b, hd)

    parts = [run(slice(0, n0), head_mask.repeat(N, 1, 1, 1))]  # (N * n0, 1, b, w + b): head masks per sequence
    if n > n0:
        parts.append(run(slice(n0, n), body_mask))
    y = torch.cat(parts, 1) if len(parts) > 1 else parts[0]  # (N, n, Hq, b, hd)
    return y.transpose(1, 2).reshape(N, Hq, Tp, hd)[:, :, :T]


def attend(q: Tensor, k: Tensor, v: Tensor, windows: Tensor | int = -1, q_start: int | Tensor = 0,
           masks: dict | None = None) -> Tensor:
    """Causal (optionally sliding-window) attention. q (..., Hq, T, hd), k/v (..., Hkv, S, hd).

    `windows` is -1 (full), an int, or an int/long tensor broadcastable to q.shape[:-3] (one window per
    leading index, e.g. per fused branch). Leading dims are flattened so fused SDPA kernels apply.
    `q_start` is the absolute position of the first query (keys sit at 0..S-1), or a (T,) tensor of
    the queries' positions: the static-shape decode step (snlp.decode.steps), whose keys are a whole
    preallocated cache of which the mask hides every position after the query's; or a (B, T) tensor, one
    row of positions per sequence (ragged batches, q.shape[-4] = B). `masks`: a per-forward memo (see
    `attention_mask`); without it the mask is built for this call alone.

    Full causal attention from position 0 takes SDPA's is_causal path (no mask: the flash kernel on CUDA); an int
    window from position 0 takes FlexAttention inside a compiled graph where chosen (`uses_flex`), else the banded
    path where it pays (`uses_band`); every other case hands SDPA an additive float mask in q's dtype
    (`attention_mask`). Fused stacks whose branches differ in window go through
    `attend_branches`, which groups them.

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
    elif isinstance(windows, int) and isinstance(q_start, int) and q_start == 0 and T == S and \
            uses_flex(T, (windows,), q.device, q.requires_grad):
        y = flex_window_attention(q4, k4, v4, windows, masks=masks)
    elif isinstance(windows, int) and isinstance(q_start, int) and q_start == 0 and T == S and \
            uses_band(T, windows, q.device):
        y = banded_attention(q4, k4, v4, windows, masks)
    else:
        mask = attention_mask(windows if not full else -1, T, S, q_start, lead, q.device, q.dtype, masks)
        y = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=gqa)
        if _window_tally is not None and not full and not torch.compiler.is_compiling():
            _tally_window(q, k, v, windows, y)
    return y.view(*lead, Hq, T, hd)


def window_groups(windows: tuple[int, ...], device) -> tuple[tuple[int, Tensor | None], ...] | None:
    """Branches grouped by window for `attend_branches`: ((window, branch indices (n_g,) on `device`), ...) in
    order of first appearance, plus, last, (-2, the inverse permutation) that puts the groups' outputs back in
    branch order; None when every branch has the same window (no grouping needed). Built once per bound plan
    (snlp.method.fusion), never per call: an index tensor made from host ints per call is a copy to the device."""
    distinct = list(dict.fromkeys(windows))
    if len(distinct) == 1:
        return None
    order = [i for w in distinct for i in range(len(windows)) if windows[i] == w]
    inv = [0] * len(order)
    for pos, i in enumerate(order):
        inv[i] = pos
    groups = tuple((w, torch.tensor([i for i in range(len(windows)) if windows[i] == w], dtype=torch.long,
                                    device=device)) for w in distinct)
    return groups + ((-2, torch.tensor(inv, dtype=torch.long, device=device)),)


def attend_branches(q: Tensor, k: Tensor, v: Tensor, windows: tuple[int, ...],
                    groups: tuple[tuple[int, Tensor | None], ...] | None, masks: dict | None = None) -> Tensor:
    """Prefill attention (queries and keys at 0..T-1) of N fused branches that may differ in window: q (N, ..., Hq,
    T, hd), k/v (N, ..., Hkv, T, hd), `windows` the N branches' windows (host ints), `groups` =
    window_groups(windows). Each group of equal windows runs as one `attend` call with an int window, so full
    branches take the causal flash path and short ones the banded / masked path for their own window, instead of
    all N paying a T x T mask; the outputs return to branch order by one gather."""
    if groups is None:
        return attend(q, k, v, windows[0], masks=masks)
    ys = [attend(q.index_select(0, idx), k.index_select(0, idx), v.index_select(0, idx), w, masks=masks)
          for w, idx in groups[:-1]]
    return torch.cat(ys, 0).index_select(0, groups[-1][1])


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

"""torch.optim.Muon with its Newton–Schulz orthogonalisation in a dtype the device computes fast.

torch.optim.Muon (torch/optim/_muon.py) always casts the update to bfloat16 before the five
Newton–Schulz iterations. That is fast on CUDA and on CPUs with native bf16 GEMMs (oneDNN with
AVX512_BF16 or AMX: ~2x fp32 per core), but a CPU without them (AVX2-only EPYC/Xeon) emulates bf16 at
1-3 GFLOP/s against 60-150 in fp32, and `snlp train --depth 8` made ~100 tokens/s with Muon against
~2,100 with AdamW there.

`Muon` here is torch's optimiser with one change: the orthogonalisation runs in `ns_dtype`
(default `default_ns_dtype`: bf16 where the device has native bf16 GEMMs, as torch does, fp32 where
bf16 is emulated). Everything else (constructor checks, param groups, momentum buffers, the
state-dict format, nesterov, decoupled weight decay, adjust_lr_fn, the ns coefficients and eps) is
torch's, so a checkpoint written by either optimiser resumes with the other. The step below mirrors
torch's `_single_tensor_muon` line by line; with ns_dtype=bfloat16 it is bit-identical to
torch.optim.Muon (tests/train/test_muon.py checks this). With `stack=True` (what `snlp train` builds) the
matrices of each shape are updated together, the same algorithm with multi-tensor ops and one stacked
Newton-Schulz (`zeropower_stacked`), equal to torch's per-matrix result to the NS dtype's rounding: a
per-matrix loop costs ~20 small kernels per matrix, 4,824 launches per step at depth 32, 140 stacked
(docs/records/2026-11-26-training-step-audit.md).

`emulated_dtype(device, dtype)` says when a low-precision dtype has no native kernels on the device,
and `warn_if_emulated` lets `snlp train` say so before a run crawls.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from torch.optim._muon import _adjust_lr

__all__ = ["Muon", "default_ns_dtype", "emulated_dtype", "warn_if_emulated", "zeropower_stacked",
           "zeropower_via_newtonschulz"]


def default_ns_dtype(device) -> torch.dtype:
    """bf16 where the device has native bf16 GEMMs (CUDA as in torch; CPUs with AVX512_BF16/AMX, where
    bf16 runs ~2x fp32), else fp32 (a CPU without them emulates bf16 ~20-30x slower than fp32)."""
    return torch.float32 if emulated_dtype(device, torch.bfloat16) else torch.bfloat16


def zeropower_via_newtonschulz(grad: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                               eps: float, dtype: torch.dtype) -> Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz with `dtype` in place of its hard-wired bfloat16
    (same checks, same operations in the same order)."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(grad.shape) != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = ns_coefficients
    # copy=True: torch's .bfloat16() always copies an fp32 update; .to(float32) would not, and the
    # in-place div_ below would then scale the momentum buffer itself (nesterov=False passes it here)
    ortho_grad = grad.to(dtype, copy=True)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


def zeropower_stacked(grads: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float,
                      dtype: torch.dtype) -> Tensor:
    """`zeropower_via_newtonschulz` of k same-shape matrices at once: grads (k, m, n) -> (k, m, n). The same
    iteration (each matrix scaled by its own Frobenius norm, tall ones transposed, the same addmm chain as batched
    baddbmm), so one launch per operation for the k matrices instead of k launches: a model's blocks give k =
    depth matrices of each of ~4 shapes, which a per-matrix loop turns into ~60 small kernels per matrix."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if grads.dim() != 3:
        raise ValueError("zeropower_stacked takes a (k, m, n) stack of matrices")
    a, b, c = ns_coefficients
    x = grads.to(dtype, copy=True)  # (k, m, n)
    tall = grads.size(-2) > grads.size(-1)
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.mT  # (k, r, r), r = min(m, n)
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon whose Newton–Schulz iterations run in `ns_dtype` (None: `default_ns_dtype` of
    each parameter's device, fp32 where bf16 is emulated). Same arguments, defaults and state dict as
    torch.optim.Muon; ns_dtype is an attribute, not a param-group entry, so optimizer checkpoints stay
    interchangeable."""

    def __init__(self, params, *args, ns_dtype: torch.dtype | None = None, stack: bool = False, **kwargs) -> None:
        if ns_dtype is not None and not (isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point):
            raise ValueError(f"Muon: ns_dtype must be a floating torch.dtype or None (got {ns_dtype!r})")
        super().__init__(params, *args, **kwargs)
        self.ns_dtype = ns_dtype
        # stack: update the matrices of each shape together (multi-tensor momentum / decay / update, one stacked
        # Newton-Schulz), the same algorithm to the NS dtype's rounding; False: torch's per-matrix loop, bit for bit
        self.stack = stack
        self.orthogonalize = zeropower_via_newtonschulz  # snlp.train.compiled.compile_optimizers compiles these
        self.orthogonalize_stacked = zeropower_stacked

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step (torch's `step` + `_single_tensor_muon`, the NS dtype being the only change)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            self._init_group(group, params, grads, bufs)
            lr = group["lr"]
            lr = lr.item() if isinstance(lr, Tensor) else lr  # torch: _to_scalar (a 1-element Tensor lr)
            wd, momentum = group["weight_decay"], group["momentum"]
            if self.stack:
                self._stacked_update(group, params, grads, bufs, lr)
                continue
            for param, grad, buf in zip(params, grads, bufs):
                if grad.ndim != 2:
                    raise ValueError("Param gradient must be a 2D matrix")
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                dtype = self.ns_dtype or default_ns_dtype(param.device)
                update = self.orthogonalize(update, group["ns_coefficients"], group["ns_steps"],
                                                    group["eps"], dtype)
                adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], param.shape)
                param.mul_(1 - lr * wd)
                param.add_(update, alpha=-adjusted_lr)
        return loss

    def _stacked_update(self, group: dict, params: list[Tensor], grads: list[Tensor], bufs: list[Tensor],
                        lr: float) -> None:
        """The per-matrix update of `step` for every matrix of the group, a shape at a time: momentum, nesterov,
        decay and update as multi-tensor ops, the orthogonalisation as one stacked Newton-Schulz."""
        by_shape: dict = {}
        for p, g, b in zip(params, grads, bufs):
            if g.ndim != 2:
                raise ValueError("Param gradient must be a 2D matrix")
            by_shape.setdefault((tuple(p.shape), p.dtype, p.device), []).append((p, g, b))
        wd, momentum = group["weight_decay"], group["momentum"]
        for (shape, _, device), items in by_shape.items():
            ps, gs, bs = (list(t) for t in zip(*items))
            torch._foreach_lerp_(bs, gs, 1 - momentum)
            ups = torch._foreach_lerp(gs, bs, momentum) if group["nesterov"] else bs
            dtype = self.ns_dtype or default_ns_dtype(device)
            ortho = self.orthogonalize_stacked(torch.stack(ups), group["ns_coefficients"], group["ns_steps"],
                                               group["eps"], dtype)  # (k, m, n)
            adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], torch.Size(shape))
            torch._foreach_mul_(ps, 1 - lr * wd)
            torch._foreach_add_(ps, list(ortho.to(ps[0].dtype).unbind(0)), alpha=-adjusted_lr)


def emulated_dtype(device, dtype: torch.dtype) -> bool:
    """True when `dtype` (bf16/fp16) GEMMs on `device` have no native kernel, so torch emulates them at a
    small fraction of fp32 speed. On CPU the low-precision GEMMs are oneDNN's, native only where oneDNN
    has an ISA for the dtype (bf16: AVX512_BF16 or AMX; fp16: AVX512_FP16 or AMX-FP16), which it reports
    itself, honouring ONEDNN_MAX_CPU_ISA (measured here: bf16 addmm 180 GFLOP/s per core natively,
    3 with ONEDNN_MAX_CPU_ISA=AVX2, where fp32 makes 60-90). CUDA and fp32/fp64 are never flagged."""
    if torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return True
    probe = "_is_mkldnn_bf16_supported" if dtype == torch.bfloat16 else "_is_mkldnn_fp16_supported"
    try:
        return not bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):  # a build without the probe: fall back on the CPU flags
        cpu = torch.cpu
        if dtype == torch.bfloat16:
            return not (_flag(cpu, "_is_avx512_bf16_supported") or _flag(cpu, "_is_amx_tile_supported"))
        return not _flag(cpu, "_is_amx_fp16_supported")


def _flag(mod, name: str) -> bool:
    f = getattr(mod, name, None)  # private torch helpers: absent on some builds -> "not supported"
    return bool(f()) if f is not None else False


def warn_if_emulated(device, dtypes, where: str = "snlp") -> str | None:
    """Warn (one line, warnings.warn) when any of `dtypes` is emulated on `device` (see `emulated_dtype`);
    returns the message, or None when every dtype is native."""
    slow = sorted(str(d).removeprefix("torch.") for d in set(dtypes) if emulated_dtype(device, d))
    if not slow:
        return None
    msg = (f"{where}: {', '.join(slow)} math is emulated on this CPU (oneDNN has no native kernel for it: no "
           f"AVX512_BF16/AMX): expect it to run 10-100x slower than float32; use float32 on this machine")
    warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return msg

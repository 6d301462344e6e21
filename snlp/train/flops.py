"""Model FLOPs of one training micro-batch, counted once on the real step, and model FLOPs utilisation (MFU).

`step_flops` runs the eager loss module forward and backward once under torch.utils.flop_counter.FlopCounterMode:
every matmul the step does is counted (the regulariser's K=1 solve and an SNLP-forward SFT plan included), so the
number follows whatever the step computes instead of a formula of the architecture. For a nanochat model it comes
to nanochat's estimate_flops, 6 x (matmul parameters) + 12 x (heads x head_dim) x min(window, T) per token and
layer (tested), on every device; for an mHC model to that estimate over the stream count S plus the streams'
mixing matmuls (the paper code's estimate multiplies by S, though its blocks run once per token on the pooled
streams; tests/bench/test_vs_paper.py).

Attention is counted as MODEL FLOPs (the PaLM convention MFU uses): causal attention counted over the full T x T
square as nanochat does, a sliding-window layer over T x min(window, T) as nanochat does (whatever kernel the device
would pick: while counting every window takes the masked kernel and snlp.model.ops.window_flops_tally takes off
what it charges past the window; the banded CPU kernel alone would count its tiles, the masked CUDA one the whole
square), and the backward without the score recompute of flash kernels (torch's own formula counts that
recompute: hardware FLOPs, not model FLOPs). torch has no formula for the CPU flash-attention ops, which would
otherwise count as zero. Element-wise ops (norms, activations, softcap, the optimizer) are not counted, as in
every MFU figure we compare with."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode, bmm_flop

from snlp.model.ops import window_flops_tally

aten = torch.ops.aten


def _sdpa_fwd(q_shape, k_shape, v_shape, *args, **kwargs) -> int:
    """q (B, Hq, Tq, d) @ k^T and scores @ v; GQA's KV heads are broadcast to Hq (the kernel does that work)."""
    b, h, tq, d = q_shape
    tk, dv = k_shape[-2], v_shape[-1]
    return bmm_flop((b * h, tq, d), (b * h, d, tk)) + bmm_flop((b * h, tq, tk), (b * h, tk, dv))


def _sdpa_bwd(grad_shape, q_shape, k_shape, v_shape, *args, **kwargs) -> int:
    """The four backward matmuls (dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q): twice the forward."""
    return 2 * _sdpa_fwd(q_shape, k_shape, v_shape)


def _mapping() -> dict:
    fwd = ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"]
    out = {}
    for name in fwd:
        for op, fn in ((name, _sdpa_fwd), (name + "_backward", _sdpa_bwd)):
            if hasattr(aten, op):
                out[getattr(aten, op)] = fn
    return out


def step_flops(step: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, lam: float, autocast, *extra) -> int:
    """Model FLOPs of one forward + backward of the loss module `step` (forward(x, y, lam, *extra) -> (loss, ...))
    on the batch (x, y) (`extra`: the batch's valid mask, if it has one). The parameters' gradients are left as
    they were (None in the trainer: counted between steps), and the RNG states too, so counting changes nothing the
    run computes."""
    params = [p for p in step.parameters() if p.requires_grad]
    before = [p.grad for p in params]
    for p in params:
        p.grad = None
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        with window_flops_tally() as past_window, FlopCounterMode(display=False, custom_mapping=_mapping()) as counter:
            with autocast():
                loss = step(x, y, lam, *extra)[0]
            loss.backward()
        return int(counter.get_total_flops()) - past_window[0]
    finally:
        for p, g in zip(params, before):
            p.grad = g
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def mfu(flops_per_token: float | None, tokens_per_s: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the device's peak (None without a known peak)."""
    if not flops_per_token or not peak_flops:
        return None
    return flops_per_token * tokens_per_s / peak_flops

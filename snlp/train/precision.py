"""The mixed-precision context of training and validation."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

import torch


def autocast_context(device) -> Callable[[], ContextManager]:
    """A factory of the forward's autocast context: bf16 autocast on CUDA, nothing elsewhere (CPU runs
    stay fp32, which keeps `--resume` bitwise exact there). A factory, not a context, because a context
    manager is single-use and the loop enters one per micro-batch."""
    if torch.device(device).type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext


def step_dtype(device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the training step's forward computes in on `device` for weights of `dtype`: bf16 under
    `autocast_context`'s CUDA autocast, else the weights' own. Autocast casts no fp64 tensor (its cast policy skips
    double), so fp64 weights compute in fp64 on CUDA too."""
    cast = torch.device(device).type == "cuda" and dtype.is_floating_point and dtype != torch.float64
    return torch.bfloat16 if cast else dtype

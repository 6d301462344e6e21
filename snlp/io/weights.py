"""Checks of loaded weights, shared by every loader (snlp checkpoints, transformers / GGUF, nanochat, drafters)."""

from __future__ import annotations

import torch


def check_finite(state: dict, where) -> None:
    """Raise a ValueError naming the first tensor of `state` that holds a NaN or an infinity (and how many):
    such a model decodes garbage and every SNLP plan built on it inherits the non-finite values, so the
    error belongs to the checkpoint, said once at load, not to whatever runs it later."""
    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            raise ValueError(f"weights in {where} are not finite: tensor {name} {tuple(t.shape)} holds {nan} NaN and "
                             f"{inf} inf values (of {t.numel()}); the checkpoint is broken (a diverged training run "
                             f"saves such weights): restore or re-train it")


def check_cast(stored: dict, cast: dict, dtype, where) -> None:
    """Raise a ValueError naming the first tensor that is finite in `stored` (checked by check_finite) but not in
    `cast`, its copy in `dtype` (float16 past 65504): the dtype cannot hold the checkpoint, which is not broken."""
    for k, v in cast.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            big = stored[k][~torch.isfinite(v)].abs().max().item()
            holds = [n for n in ("float32", "bfloat16", "float64")  # the advice names dtypes that do hold it
                     if getattr(torch, n) != dtype and torch.finfo(getattr(torch, n)).max >= big][:2]
            raise ValueError(f"{dtype} cannot hold {where}'s {k}: |{big:.4g}| is past its largest finite value "
                             f"({torch.finfo(dtype).max:.4g}): choose {' or '.join(holds)}"
                             f"{'' if holds == ['float64'] else ' (snlp convert --dtype)'}")

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


def cast_model(model, device, dtype, where):
    """`model.to(device, dtype)`, refusing a float16 cast of a finite weight past 65504 (it would become inf, and
    every forward after it NaN) with check_cast's one line naming the tensor and dtypes that hold it. `dtype`: a
    torch dtype or its name; `where`: what the user gave (the checkpoint's path)."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dtype == torch.float16:
        for k, v in model.state_dict().items():
            if v.is_floating_point() and v.device.type != "meta":
                c = v.to(dtype)
                if not bool(torch.isfinite(c).all()) and bool(torch.isfinite(v).all()):
                    check_cast({k: v}, {k: c}, dtype, where)
    return model.to(device=device, dtype=dtype)

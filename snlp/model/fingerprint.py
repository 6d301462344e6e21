"""A fingerprint of a model's weights: what a calibration or a drafter was fitted on.

The digest covers every parameter and buffer name, shape and value, with the values rounded to bfloat16
first (through fp32). Why bf16: a calibration fitted on fp32 weights must stay valid after
`model.to(torch.bfloat16)` or `.to(torch.float64)` (the same weights in another precision), while any real
change of the weights (a training step, another checkpoint) changes the rounded values of some of its
millions of entries. Weights that differ by less than bf16 rounding everywhere fingerprint alike: a
calibration fitted on one is as valid for the other."""

from __future__ import annotations

import hashlib

import torch


@torch.no_grad()
def tensor_digest(t: torch.Tensor) -> str:
    """A digest of one tensor's shape and bf16-rounded values (see the module docstring)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{tuple(t.shape)};".encode())
    if t.is_floating_point():
        # through fp32 first, so fp64 -> fp32 -> bf16 and fp64 -> bf16 cannot differ by double rounding
        t = t.detach().float().to(torch.bfloat16).view(torch.int16)  # rounding, not math: no bf16 matmuls
    h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def weights_digests(model: torch.nn.Module) -> dict[str, str]:
    """{name: tensor_digest} of the model's state: what lets a rank that holds only some tensors check them."""
    return {name: tensor_digest(t) for name, t in model.state_dict(keep_vars=False).items()}


def fingerprint_digests(digests: dict[str, str]) -> str:
    """The fingerprint of a whole state from its per-tensor digests (names sorted)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(digests):
        h.update(f"{name}:{digests[name]};".encode())
    return h.hexdigest()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A 32-hex-digit digest of the model's state (names, shapes, bf16-rounded values); device and dtype free."""
    return fingerprint_digests(weights_digests(model))

"""Log-depth associative scan for the correction recurrence over chunks.

Every SNLP surrogate turns the correction (paper Eq. snlp-iterative) into the affine recurrence
    d_c = a_c o d_{c-1} + b_c,   d_{-1} = 0,   d_c = h_c^{(k+1)} - h_c^{(k)},  b_c = tilde_c - h_c^{(k)}
where `o` is an elementwise product (DiagN, paper Algorithm "DiagN Inference with Associative
Scan") or a small matrix product over the mHC streams (HCN). Affine maps compose associatively,
(a2, b2) after (a1, b1) = (a2 a1, a2 b1 + b2), so a Hillis-Steele scan solves all C chunks in
ceil(log2 C) vectorised rounds instead of a C-step Python loop.
"""

from __future__ import annotations

import torch
from torch import Tensor


def affine_scan(a: Tensor, b: Tensor, matrix: bool = False) -> Tensor:
    """Solve d_c = a_c o d_{c-1} + b_c (d_{-1} = 0) over the leading (chunk) dim of b (C, ...).

    Elementwise: a broadcasts against b, e.g. (C, B, T, D) or (C, 1, 1, 1). Matrix (`matrix=True`):
    a (C, ..., n, n) multiplies b (C, ..., n, D) from the left. a[0] is never used."""
    mul = torch.matmul if matrix else torch.mul
    C, s = b.shape[0], 1
    while s < C:  # after the round with offset s, entry c holds the composition of chunks c-2s+1..c
        b = torch.cat([b[:s], mul(a[s:], b[:-s]) + b[s:]])
        if 2 * s < C:
            a = torch.cat([a[:s], mul(a[s:], a[:-s])])
        s *= 2
    return b


def sequential_scan(a: Tensor, b: Tensor, matrix: bool = False) -> Tensor:
    """The same recurrence as a plain loop over chunks: the reference `affine_scan` is tested against."""
    mul = torch.matmul if matrix else torch.mul
    out = [b[0]]
    for c in range(1, b.shape[0]):
        out.append(mul(a[c], out[-1]) + b[c])
    return torch.stack(out)

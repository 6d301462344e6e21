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


def transfer_blocks(a: Tensor) -> Tensor:
    """The recurrence d_c = a_c d_{c-1} + b_c written as d_c = sum_j P[c, j] b_j for matrices a (C, n, n) that do
    not vary over the token dims: P (C, C, n, n) with P[c, c] = I, P[c, j] = a_c a_{c-1} ... a_{j+1} (j < c), 0
    above the diagonal. Built by `affine_scan` itself on identity blocks (ceil(log2 C) rounds of n x n products)."""
    C, n = a.shape[0], a.shape[-1]
    eye = torch.eye(C * n, dtype=a.dtype, device=a.device).view(C, n, C, n).transpose(1, 2)  # [c, j] = I if c == j
    return affine_scan(a[:, None], eye, matrix=True)  # (C, C, n, n): column j is the scan of the unit input at j


def transfer_scan(P: Tensor, b: Tensor) -> Tensor:
    """Solve the recurrence of `transfer_blocks` (P (C, C, n, n)) for b (C, ..., n, D): ONE (C n x C n) matmul over
    all tokens, d[c, ..., i, :] = sum_{j, k} P[c, j, i, k] b[j, ..., k, :], instead of the ceil(log2 C) rounds of
    `affine_scan`, each of which writes the whole state three times (matmul, add, cat). The (j, k) contraction
    needs b with chunk and stream dims in front: one copy of b; the result is returned as a view in b's layout."""
    C, n, D = b.shape[0], b.shape[-2], b.shape[-1]
    mid = b.shape[1:-2]
    B = mid[0] if mid else 1  # batch rows (b is (C, B, T, n, D) in the solver)
    # One GEMM per row, not one over all rows' columns: a GEMM's rounding in a column can depend on how many columns
    # there are (fp64 on the CPU: 1e-13 between a row alone and in a batch of 3), and a row must never depend on its
    # batch (the tol stop test, the seam matrix). Same FLOPs, one (bmm) launch.
    rows = b.reshape(C, B, -1, n, D).permute(1, 0, 3, 2, 4).reshape(B, C * n, -1)  # (B, C n, R D): the one copy
    out = torch.bmm(P.transpose(1, 2).reshape(C * n, C * n).expand(B, C * n, C * n), rows)  # (B, C n, R D)
    return out.view(B, C, n, -1, D).permute(1, 0, 3, 2, 4).reshape(b.shape)  # (C, ..., n, D)


def sequential_scan(a: Tensor, b: Tensor, matrix: bool = False) -> Tensor:
    """The same recurrence as a plain loop over chunks: the reference `affine_scan` is tested against."""
    mul = torch.matmul if matrix else torch.mul
    out = [b[0]]
    for c in range(1, b.shape[0]):
        out.append(mul(a[c], out[-1]) + b[c])
    return torch.stack(out)

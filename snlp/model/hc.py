"""mHC: manifold-constrained hyper-connections (n residual streams, Sinkhorn-projected H_res, sigmoid
H_pre / H_post around every sublayer); see snlp.model.gpt for the model they wrap."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from snlp.model.config import HC_SINKHORN_ITERS, GPTConfig
from snlp.model.ops import norm

def sinkhorn(logits: Tensor, iters: int = HC_SINKHORN_ITERS) -> Tensor:
    """Sinkhorn-Knopp projection of exp(logits) (..., n, n) onto the doubly stochastic matrices:
    `iters` rounds of row then column normalisation, in at least fp32 (fp64 stays fp64). Columns
    sum to 1 exactly, rows up to the convergence error. Each row is shifted by its max before exp
    and entries are floored at 1e-30, so extreme logits neither overflow nor leave an all-zero
    row/column (NaN); plain sums and divisions (not log space) keep it to 4 small ops per round."""
    lg = logits.to(torch.promote_types(logits.dtype, torch.float32))
    m = (lg - lg.amax(-1, keepdim=True)).exp().clamp_min(1e-30)
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


def sinkhorn_log(logits: Tensor, iters: int, tau: float) -> Tensor:
    """nanochat-snlp's Sinkhorn (GPTConfig.hc_maps = "softmax"): the doubly stochastic projection of exp(logits / tau)
    in log space, `iters` rounds of row then column log-normalisation (logsumexp), in at least fp32. The same
    projection as `sinkhorn` of logits / tau, but log space keeps its rounding (and its range: a small tau turns
    logits of order 1 into exponents of order 100) equal to the paper's code."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / tau
    u = torch.zeros(z.shape[:-1], dtype=z.dtype, device=z.device)  # (..., n) row potentials
    v = torch.zeros_like(u)  # (..., n) column potentials
    for _ in range(iters):
        u = -torch.logsumexp(z + v.unsqueeze(-2), dim=-1)
        v = -torch.logsumexp(z + u.unsqueeze(-1), dim=-2)
    return torch.exp(z + u.unsqueeze(-1) + v.unsqueeze(-2))


def hc_gate(alpha: Tensor, n: int) -> Tensor:
    """Per-logit gate (..., n*n + 2n) from the three dynamic-mHC gates alpha (..., 3) = (res, pre, post)."""
    return torch.cat([alpha[..., 0:1].expand(*alpha.shape[:-1], n * n), alpha[..., 1:2].expand(*alpha.shape[:-1], n),
                      alpha[..., 2:3].expand(*alpha.shape[:-1], n)], -1)


def hc_maps(logits: Tensor, n: int, dtype, kind: str = "sigmoid", iters: int = HC_SINKHORN_ITERS,
            tau: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """mHC logits (..., n*n + 2n) = [res | pre | post] -> H_res (..., n, n) doubly stochastic, and (kind "sigmoid")
    H_pre (..., n) in (0, 1), H_post (..., n) in (0, 2), or (kind "softmax", nanochat-snlp) H_pre, H_post softmaxes
    over the streams with H_res = `sinkhorn_log` at temperature tau; computed in at least fp32, returned in
    `dtype`. `kind`, `iters`, `tau`: GPTConfig.hc_maps, hc_sinkhorn_iters, hc_sinkhorn_tau (`maps_of(cfg)`)."""
    lg = logits.to(torch.promote_types(logits.dtype, torch.float32))
    pre, post = lg[..., n * n: n * n + n], lg[..., n * n + n:]
    if kind == "softmax":
        res = sinkhorn_log(lg[..., : n * n].unflatten(-1, (n, n)), iters, tau)
        pre, post = torch.softmax(pre, -1), torch.softmax(post, -1)
    else:
        res = sinkhorn(lg[..., : n * n].unflatten(-1, (n, n)), iters)
        pre, post = torch.sigmoid(pre), 2 * torch.sigmoid(post)
    return res.to(dtype), pre.to(dtype), post.to(dtype)


def maps_of(cfg: GPTConfig) -> dict:
    """The keyword arguments of `hc_maps` that a config sets (its kind and Sinkhorn settings)."""
    return dict(kind=cfg.hc_maps, iters=cfg.hc_sinkhorn_iters, tau=cfg.hc_sinkhorn_tau)


class HyperConn(nn.Module):
    """The mHC coefficients of one sublayer: bias (n*n + 2n) and, dynamic, phi (n*D, n*n + 2n) and
    gates alpha (3,). forward(x (..., n, D)) -> (H_res, H_pre, H_post), see `hc_maps`; static H
    have no leading dims (they broadcast)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        n, k = cfg.hc_streams, cfg.hc_streams * (cfg.hc_streams + 2)
        self.n, self.maps = n, maps_of(cfg)
        self.bias = nn.Parameter(torch.zeros(k))
        self.phi = nn.Parameter(torch.zeros(n * cfg.n_embd, k)) if cfg.hc_dynamic else None
        self.alpha = nn.Parameter(torch.zeros(3)) if cfg.hc_dynamic else None

    def logits(self, x: Tensor) -> Tensor:
        if self.phi is None:
            return self.bias
        return self.bias + hc_gate(self.alpha, self.n) * (norm(x.flatten(-2)) @ self.phi)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return hc_maps(self.logits(x), self.n, x.dtype, **self.maps)


def hc_sublayer(hc: HyperConn, x: Tensor, branch, maps: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """One mHC sublayer on streams x (..., n, D): H_res x + H_post (x) branch(norm(H_pre x)). `maps`: its
    (H_res, H_pre, H_post) already computed (static mHC: once per forward for every layer, GPT.static_hc)."""
    res, pre, post = hc(x) if maps is None else maps
    y = branch(norm((pre.unsqueeze(-2) @ x).squeeze(-2)))  # (..., D)
    with torch.autocast(x.device.type, enabled=False):  # the streams stay in x's dtype (fp32 under autocast)
        mixed = res @ x
    return mixed + post.unsqueeze(-1) * y.unsqueeze(-2)

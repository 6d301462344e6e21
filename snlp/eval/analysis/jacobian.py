"""Jacobian diagnostics (paper Tables jacobian_norms / amplification / variance_reduction): per suffix
layer l, on real validation windows at the sequential input h_{l-1}: sigma_max of J_g (g_l = the
non-residual branch, f_l(h) = x_in,l(h) + g_l(h)) by power iteration on J_g^T J_g with JVP/VJP
(`power_iters`, the last relative change reported), Hutchinson ||J_g||_F (E_v ||J_g v||^2 = ||J_g||_F^2
for Rademacher v), amplification ||J_f v|| / ||v|| (Gaussian v), and the substitution errors |eps_l|,
C_eps(l), Delta_g(l) of the paper's variance-reduction paragraph (Sec. "Inference effect"), relative
to the prefix-state scale. J is the Jacobian of the whole window map (tokens couple through
attention); sigma_max is the window's, ||J||_F is reported per token: sqrt(||J||_F^2 / T).
mHC models: the same on the stream state (x_in = h, g = f - h)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from snlp.eval.analysis.common import AnalysisConfig, section_bar
from snlp.eval.data import as_tokens, windows
from snlp.method.jacobian import jvp, repeat_context
from snlp.model.gpt import GPT

@dataclass
class LayerDiag:
    layer: int  # 0-based layer index (the paper numbers layers the same way: 31 = the last of 32)
    sigma_max: float  # mean over windows of the window-map sigma_max(J_g)
    sigma_rel_change: float  # relative change of sigma_max in the last power iteration (convergence)
    frob: float  # per-token Hutchinson ||J_g||_F = sqrt(E||J_g v||^2 / T), mean over windows
    amp: float  # mean ||J_f v|| / ||v||
    eps: float  # |eps_l|
    c_eps: float  # C_eps(l)
    delta_g: float  # Delta_g(l)


@dataclass
class JacobianResult:
    suffix: int  # N: h_S is the state after L - N layers
    windows: int
    seq_len: int
    power_iters: int
    probes: int
    layers: list[LayerDiag] = field(default_factory=list)


def residual_input(model: GPT, l: int, h: Tensor, ctx) -> Tensor:
    """x_in,l(h): what layer l's residual path carries, lam_r h + lam_0 x0 (x0 residual) or h."""
    if model.config.x0_residual and not model.config.hc_streams:
        return model.resid_lambdas[l] * h + model.x0_lambdas[l] * ctx.x0
    return h


def branch(model: GPT, l: int, ctx) -> Callable[[Tensor], Tensor]:
    """g_l(h) = f_l(h) - x_in,l(h), the non-residual (attention + MLP) update of layer l."""
    return lambda h: model.layer(l, h, ctx) - residual_input(model, l, h, ctx)


def _per_sample_norm(x: Tensor) -> Tensor:
    return x.flatten(1).norm(dim=1)  # (B,)


def _jvp_at(fn: Callable[[Tensor], Tensor], h: Tensor) -> Callable[[Tensor], Tensor]:
    """v -> J_fn(h) v by forward-mode AD (snlp.method.jacobian.jvp: math SDPA, which forward AD supports)."""
    return lambda v: jvp(fn, h, v)


def power_sigma(fn: Callable[[Tensor], Tensor], h: Tensor, iters: int, gen: torch.Generator | None = None
                ) -> tuple[Tensor, float]:
    """Largest singular value of the Jacobian of fn at h, per batch element (fn maps each element
    independently: (B, ...) -> (B, ...)), by power iteration on J^T J: v <- J^T J v / ||.||, with J v
    by forward-mode AD (torch.func.jvp, math SDPA) and J^T u by reverse mode (torch.func.vjp, whose
    linearisation is built once).
    Returns (sigma (B,), the largest relative change of sigma in the last iteration)."""
    with torch.inference_mode(False), torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        h = h.detach().clone()
        jvp_fn = _jvp_at(fn, h)
        _, vjp_fn = torch.func.vjp(fn, h)
        v = torch.randn(h.shape, generator=gen, dtype=h.dtype, device=h.device)
        shape = (-1,) + (1,) * (h.dim() - 1)
        v = v / _per_sample_norm(v).view(shape)
        sigma, change = torch.zeros(h.shape[0], dtype=h.dtype), float("nan")
        for _ in range(iters):
            u = jvp_fn(v)
            new = _per_sample_norm(u).detach().cpu()
            change = float(((new - sigma).abs() / new.clamp_min(1e-30)).max())
            sigma = new
            w = vjp_fn(u)[0]
            v = (w / _per_sample_norm(w).clamp_min(1e-30).view(shape)).detach()
        return sigma, change


def hutchinson_frob2(fn: Callable[[Tensor], Tensor], h: Tensor, probes: int, gen: torch.Generator | None = None
                     ) -> Tensor:
    """Per-probe, per-element ||J v||^2 (P, B) with Rademacher v: an unbiased estimate of ||J||_F^2
    (E[v v^T] = I, so E ||J v||^2 = tr(J^T J))."""
    with torch.inference_mode(False), torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        h = h.detach().clone()
        jvp_fn = _jvp_at(fn, h)
        out = []
        for _ in range(probes):
            v = (torch.randint(0, 2, h.shape, generator=gen, device=h.device) * 2 - 1).to(h.dtype)
            out.append(_per_sample_norm(jvp_fn(v)).detach().cpu() ** 2)
        return torch.stack(out)


def amplification(fn: Callable[[Tensor], Tensor], h: Tensor, probes: int, gen: torch.Generator | None = None
                  ) -> Tensor:
    """Per-probe, per-element ||J v|| / ||v|| (P, B) for Gaussian v."""
    with torch.inference_mode(False), torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        h = h.detach().clone()
        jvp_fn = _jvp_at(fn, h)
        out = []
        for _ in range(probes):
            v = torch.randn(h.shape, generator=gen, dtype=h.dtype, device=h.device)
            out.append((_per_sample_norm(jvp_fn(v)) / _per_sample_norm(v)).detach().cpu())
        return torch.stack(out)


def substitution_errors(g_seq: list[Tensor], g_S: list[Tensor], hS: Tensor, tiny: float = 1e-12
                        ) -> list[tuple[float, float, float]]:
    """(|eps_l|, C_eps(l), Delta_g(l)) per suffix layer (paper, "Variance reduction"), from
    g_l(h_{l-1}^seq) and g_l(h_S) (each (B, ...)) and h_S (B, ...): eps_l = g_l(h^seq) - g_l(h_S),
    |eps_l| = E_b||eps_l,b|| / (E_b||h_S,b|| + tiny), C_eps(l) = E_b||sum_{r<=l} eps_r,b|| / (same),
    Delta_g(l) = E_b||eps_l,b|| / (E_b||g_l(h_S,b)|| + tiny). Norms over each element's (T, D)."""
    scale = float(_per_sample_norm(hS).mean()) + tiny
    out, acc = [], torch.zeros_like(hS)
    for gs, g0 in zip(g_seq, g_S):
        eps = gs - g0
        acc = acc + eps
        e = float(_per_sample_norm(eps).mean())
        out.append((e / scale, float(_per_sample_norm(acc).mean()) / scale,
                    e / (float(_per_sample_norm(g0).mean()) + tiny)))
    return out


def jacobian_diagnostics(model: GPT, val_tokens, cfg: AnalysisConfig = AnalysisConfig()) -> JacobianResult:
    """The paper's Table jacobian_norms / amplification / variance_reduction on `cfg.jac_windows`
    validation windows of `cfg.seq_len` tokens."""
    L = model.config.n_layer
    N = min(cfg.jac_suffix, L)
    S = L - N
    # a repeat is one row; in depth order, as the plot joins the rows with a line over the layer axis
    layers = sorted(set(cfg.layers)) if cfg.layers is not None else list(range(S, L))
    wins = windows(as_tokens(val_tokens), cfg.seq_len, cfg.jac_windows * cfg.seq_len)
    device = next(model.parameters()).device
    x = wins[:, :-1].to(device)  # (B, T)
    gen = torch.Generator().manual_seed(cfg.seed)
    res = JacobianResult(suffix=N, windows=x.shape[0], seq_len=x.shape[1], power_iters=cfg.power_iters,
                         probes=cfg.probes)
    with torch.no_grad():
        ctx = model.embed(x)
        trace = [ctx.x0]
        model.run_layers(ctx.x0, ctx, 0, L, trace)  # trace[l] = input of layer l
        hS = trace[S]
        sub_layers = list(range(S, L))
        g_seq = [branch(model, l, ctx)(trace[l]) for l in sub_layers]
        g_S = [branch(model, l, ctx)(hS) for l in sub_layers]
        subs = dict(zip(sub_layers, substitution_errors(g_seq, g_S, hS)))
    T, P = x.shape[1], cfg.probes
    ctxP = repeat_context(ctx, P)
    with section_bar(len(layers), "jacobian", cfg) as bar:
        for l in layers:
            g = branch(model, l, ctx)
            sigma, change = power_sigma(g, trace[l], cfg.power_iters, gen)
            # the probes ride in the batch dim (index p * B + b): one JVP for all of them
            hP = trace[l].repeat(P, *[1] * (trace[l].dim() - 1))  # (P * B, T, D)
            frob2 = hutchinson_frob2(branch(model, l, ctxP), hP, 1, gen).view(P, -1)  # (P, B)
            amp = amplification(lambda h, l=l: model.layer(l, h, ctxP), hP, 1, gen).view(P, -1)
            e, c, d = subs.get(l, (float("nan"),) * 3)
            res.layers.append(LayerDiag(layer=l, sigma_max=float(sigma.mean()), sigma_rel_change=change,
                                        frob=float((frob2.mean(0) / T).sqrt().mean()), amp=float(amp.mean()),
                                        eps=e, c_eps=c, delta_g=d))
            bar.update()
    return res


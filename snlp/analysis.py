"""Analyse a checkpoint: the paper's layer-parallelism diagnostics and inference ablations.

`snlp analyze CKPT --out DIR` writes DIR/analysis.md (paper-style tables), DIR/analysis.json and PNG
plots; every section is a function here (config dataclass in, result dataclass out):

  jacobian     per suffix layer l, on real validation windows at the sequential input h_{l-1}:
               sigma_max of J_g (g_l = the non-residual branch, f_l(h) = x_in,l(h) + g_l(h)) by power
               iteration on J_g^T J_g with JVP/VJP (`power_iters`, the last relative change reported),
               Hutchinson ||J_g||_F (E_v ||J_g v||^2 = ||J_g||_F^2 for Rademacher v), amplification
               ||J_f v|| / ||v|| (Gaussian v), and the substitution errors |eps_l|, C_eps(l), Delta_g(l)
               of the paper's variance-reduction paragraph (Sec. "Inference effect"), relative to the
               prefix-state scale. J is the Jacobian of the whole window map (tokens couple through
               attention); sigma_max is the window's, ||J||_F is reported per token: sqrt(||J||_F^2 / T).
               mHC models: the same on the stream state (x_in = h, g = f - h).
  ordering     per suffix size N: forward, reversed and R random shuffles of the IDN correction order:
               Seq-Perm PPL (the permuted suffix run sequentially), IDN K = 1 / K = 4 PPL, no-correction
               PPL, AR-ness (DiffuCoder, Gong et al. 2025: mean of local AR-ness@1, the fraction of
               the N - 1 steps that visit the position right after the previous one, and global
               AR-ness@1, the fraction of the N steps that visit the leftmost unvisited position;
               forward 1, reversed 1 / (2N), the paper's values); summary: best shuffle, shuffle std
               over finite values, "diverged" for non-finite PPL (paper Table ordering_summary, App.
               "Correction Ordering").
  propagation  PPL with only the last j of N suffix layers active (the others skipped), j = 1..N, at
               K = 1..N, IDN vs no correction: the staircase (App. "Correction Propagation") + heat map.
  early-exit   K = 0 PPL with the last N layers skipped (paper Table early_exit).
  elk          PPL over ELK a x init {h0, fwd, preheat} x chunkings of N layers at K = 1 (App. "ELK
               Tempering and Preheat Initialization"); preheat from the attached calibration or a
               random-token one fitted here.
  preheat      preheat calibrated on random tokens vs on data, per chunking (K = 1, a = 0), h0 alongside.
  jacobi       JD x SNLP coupling (App. "Coupling SNLP with Jacobi Decoding"): naive composition (a
               fresh SNLP solve per JD iteration) and h0-JD (deeper chunk states warm-started from the
               previous JD iteration), K = 1, 2, lookahead window W, unverified: token match vs
               sequential greedy, accepted tokens per JD iteration, JD iterations per round, forwards
               per token.
All PPLs are token-weighted over non-overlapping windows of `seq_len` validation tokens (snlp.eval).
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .evaldata import as_tokens, windows
from .evaluation import EvalConfig
from .fmt import DIVERGED, PPL_SCI, sci
from .metrics import ar_match, perplexity
from .model import GPT
from .plan import Plan
from .runtime import progress_bar
from .solver import permuted_sequential, solve

SECTIONS = ("jacobian", "ordering", "propagation", "early-exit", "elk", "preheat", "jacobi")
DIV = DIVERGED  # snlp.fmt's word for a non-finite PPL, the same in every table the project writes


# ============================================================================ configuration
@dataclass
class AnalysisConfig:
    """Settings of `analyze` (defaults sized for a depth-16 model on 2 CPU cores in minutes)."""

    seq_len: int = 128  # tokens per PPL window
    max_tokens: int = 1024  # predicted tokens per PPL
    batch: int = 8  # windows per forward
    only: tuple[str, ...] = SECTIONS
    layers: tuple[int, ...] | None = None  # jacobian layers (0-based); default: the last `jac_suffix`
    jac_suffix: int = 8  # N for the jacobian section's h_S (S = L - N)
    jac_windows: int = 2  # validation windows the Jacobian diagnostics average over
    power_iters: int = 20  # the last iteration's relative change is reported (convergence)
    probes: int = 16  # Hutchinson / amplification probes (batched: one JVP for all)
    suffixes: tuple[int, ...] | None = None  # ordering / early-exit N; default (8, 12, L) that fit
    shuffles: int = 6  # random orders per N
    ordering_iters: tuple[int, ...] = (1, 4)
    prop_suffix: int = 8  # N of the propagation staircase
    prop_tokens: int = 512  # predicted tokens per propagation cell (2 N^2 cells)
    elk_suffix: int = 12
    elk_values: tuple[float, ...] = (0.0, 0.1)
    elk_chunks: tuple[int, ...] = (1, 2, 4, 0)  # C values (0 = N, i.e. xF1) of the ELK sweep
    preheat_rank: int = 32
    jacobi_plans: tuple[str, ...] | None = None  # chunkings (K, init set per row); default 8xF1, 12xF1, 4xF3 that fit
    jacobi_prompts: int = 4
    jacobi_prompt_len: int = 16
    jacobi_tokens: int = 16
    jacobi_window: int = 5
    seed: int = 0
    progress: bool = True

    def check(self, n_layer: int) -> None:
        bad = [s for s in self.only if s not in SECTIONS]
        if bad:
            raise ValueError(f"unknown analysis section(s) {bad}: valid sections are {', '.join(SECTIONS)}")
        low = [f"{k}={getattr(self, k)}" for k in ("seq_len", "max_tokens", "batch", "jac_suffix", "jac_windows",
                                                   "power_iters", "probes", "prop_suffix", "prop_tokens", "elk_suffix",
                                                   "jacobi_prompts", "jacobi_prompt_len", "jacobi_tokens",
                                                   "jacobi_window", "preheat_rank") if getattr(self, k) < 1]
        if self.shuffles < 0:
            low.append(f"shuffles={self.shuffles}")
        if low:
            raise ValueError(f"analysis settings out of range: {', '.join(low)} (shuffles >= 0, the others >= 1)")
        if self.layers is not None and not all(0 <= l < n_layer for l in self.layers):
            raise ValueError(f"--layers must lie in 0..{n_layer - 1} (got {list(self.layers)})")
        if self.suffixes is not None and not all(1 <= n <= n_layer for n in self.suffixes):
            raise ValueError(f"suffix sizes N must lie in 1..L = {n_layer} (got {list(self.suffixes)})")
        if not all(0 <= a < 1 for a in self.elk_values):
            raise ValueError(f"ELK values must lie in [0, 1) (got {list(self.elk_values)})")

    def eval_config(self) -> EvalConfig:
        return EvalConfig(seq_len=self.seq_len, max_tokens=self.max_tokens, batch=self.batch, progress=self.progress)

    def suffix_sizes(self, L: int) -> list[int]:
        if self.suffixes is not None:
            return list(dict.fromkeys(self.suffixes))
        return list(dict.fromkeys(n for n in (8, 12, L) if n <= L))


# ============================================================================ shared helpers
def _fmt(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if not math.isfinite(x):
        return DIV
    return f"{x:.{digits}f}" if abs(x) < PPL_SCI else sci(x)  # snlp.fmt's rule: 1.7e8, not 174060849.26


def md_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table of already formatted cells."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


@torch.inference_mode()
def window_ppl(model: GPT, wins: Tensor, hidden: Callable[[Tensor], Tensor], batch: int = 8) -> float:
    """Token-weighted PPL over windows wins (W, T + 1) of the final states hidden(idx) (B, T, D)
    -> head; inf when a state is non-finite (a diverged solve)."""
    device = next(model.parameters()).device
    nll, n = 0.0, 0
    for b in wins.split(batch):
        x, y = b[:, :-1].to(device), b[:, 1:].to(device)  # (B, T)
        h = hidden(x)
        if not bool(torch.isfinite(h).all()):
            return float("inf")
        logits = model.head(h)  # (B, T, V)
        nll += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        n += y.numel()
    return perplexity(nll, n)


def plan_ppl(model: GPT, wins: Tensor, plan: Plan | str, batch: int = 8) -> float:
    return window_ppl(model, wins, lambda x: solve(model, x, plan, check_finite=False).hidden, batch)


def sequential_ppl(model: GPT, wins: Tensor, batch: int = 8) -> float:
    return window_ppl(model, wins, lambda x: model.hidden_states(x)[-1], batch)


def _bar(total: int, desc: str, cfg: AnalysisConfig):
    return progress_bar(total, desc, cfg.progress)


# ============================================================================ 1. Jacobian diagnostics
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
    """v -> J_fn(h) v by forward-mode AD (snlp.surrogates.jvp: math SDPA, which forward AD supports)."""
    from .surrogates import jvp
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
    layers = list(cfg.layers) if cfg.layers is not None else list(range(S, L))
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
    from .surrogates import repeat_context
    ctxP = repeat_context(ctx, P)
    with _bar(len(layers), "jacobian", cfg) as bar:
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


# ============================================================================ 2. correction ordering
def ar_ness(order) -> float:
    """AR-ness of a visiting order (DiffuCoder, Gong et al. 2025, k = 1): the mean of local AR-ness
    (fraction of the N - 1 consecutive steps that visit position prev + 1) and global AR-ness
    (fraction of the N steps that visit the leftmost not yet visited position). Forward = 1,
    reversed = 1 / (2N) (the paper's 0.062 at N = 8)."""
    order = [int(i) for i in order]
    N = len(order)
    if N <= 1:
        return 1.0
    local = sum(b == a + 1 for a, b in zip(order, order[1:])) / (N - 1)
    left, glob = set(range(N)), 0
    for c in order:
        glob += c == min(left)
        left.discard(c)
    return (local + glob / N) / 2


@dataclass
class OrderRow:
    name: str  # forward | reversed | shuffle_i | no correction
    order: list[int] | None
    ar_ness: float | None
    seq_perm: float | None  # PPL of the permuted suffix run sequentially
    ppl: dict[int, float]  # K -> IDN PPL in this correction order


@dataclass
class OrderingTable:
    N: int
    rows: list[OrderRow]

    def summary(self) -> dict:
        """The paper's Table ordering_summary row for this N (K = the first and last iterations)."""
        shuf = [r for r in self.rows if r.name.startswith("shuffle")]
        get = {r.name: r for r in self.rows}
        out = {"N": self.N}
        fin = lambda xs: [x for x in xs if x is not None and math.isfinite(x)]  # noqa: E731
        seq = fin([r.seq_perm for r in shuf])
        out.update(seq_forward=get["forward"].seq_perm, seq_reversed=get["reversed"].seq_perm,
                   seq_best_shuffle=min(seq) if seq else float("inf"),
                   seq_shuffle_std=statistics.pstdev(seq) if len(seq) > 1 else float("nan"))
        for K in get["forward"].ppl:
            vals = fin([r.ppl[K] for r in shuf])
            out[f"K{K}"] = {"forward": get["forward"].ppl[K], "reversed": get["reversed"].ppl[K],
                            "best_shuffle": min(vals) if vals else float("inf"),
                            "no_correction": get["no correction"].ppl[K],
                            "shuffle_std": statistics.pstdev(vals) if len(vals) > 1 else float("nan")}
        return out


@dataclass
class OrderingResult:
    sequential_ppl: float
    tables: list[OrderingTable]


def orders_for(N: int, shuffles: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """forward, reversed and `shuffles` seeded random permutations of 0..N-1."""
    gen = torch.Generator().manual_seed(seed + N)
    out = [("forward", list(range(N))), ("reversed", list(range(N - 1, -1, -1)))]
    out += [(f"shuffle_{i}", torch.randperm(N, generator=gen).tolist()) for i in range(shuffles)]
    return out


@torch.inference_mode()
def correction_ordering(model: GPT, val_tokens, cfg: AnalysisConfig = AnalysisConfig()) -> OrderingResult:
    """Seq-Perm, IDN K = cfg.ordering_iters and no-correction PPL per order and suffix size N (xF1, h0).
    The prefix runs once per batch and N for every cell."""
    L = model.config.n_layer
    wins = windows(as_tokens(val_tokens), cfg.seq_len, cfg.max_tokens)
    device = next(model.parameters()).device
    Ns, Ks = cfg.suffix_sizes(L), list(cfg.ordering_iters)
    orders = {N: orders_for(N, cfg.shuffles, cfg.seed) for N in Ns}
    cells = []  # (N, order name, what): what = "seq" or K (IDN) or ("none", K)
    for N in Ns:
        cells += [(N, name, w) for name, _ in orders[N] for w in ["seq", *Ks]]
        cells += [(N, "no correction", ("none", K)) for K in Ks]
    nll, bad, n_tok = dict.fromkeys(cells, 0.0), set(), 0
    batches = wins.split(cfg.batch)
    with _bar(len(batches) * len(cells), "ordering", cfg) as bar:
        for b in batches:
            x, y = b[:, :-1].to(device), b[:, 1:].to(device)  # (B, T)
            ctx = model.embed(x)
            prefix = {N: model.run_layers(ctx.x0, ctx, 0, L - N) for N in Ns}
            for cell in cells:
                N, name, what = cell
                order = dict(orders[N]).get(name)
                if what == "seq":
                    h = permuted_sequential(model, x, Plan(chunks=N), order=tuple(order), prefix=prefix[N]).hidden
                elif isinstance(what, tuple):
                    h = solve(model, x, Plan(chunks=N, iters=what[1], surrogate="none"), check_finite=False,
                              prefix=prefix[N]).hidden
                else:
                    h = solve(model, x, Plan(chunks=N, iters=what, order=tuple(order)), check_finite=False,
                              prefix=prefix[N]).hidden
                _add_nll(model, h, y, nll, bad, cell)
                bar.update()
            n_tok += y.numel()
    ppl = {c: float("inf") if c in bad else perplexity(v, n_tok) for c, v in nll.items()}
    tables = []
    for N in Ns:
        rows = [OrderRow(name=name, order=order, ar_ness=ar_ness(order), seq_perm=ppl[N, name, "seq"],
                         ppl={K: ppl[N, name, K] for K in Ks}) for name, order in orders[N]]
        rows.append(OrderRow(name="no correction", order=None, ar_ness=None, seq_perm=None,
                             ppl={K: ppl[N, "no correction", ("none", K)] for K in Ks}))
        tables.append(OrderingTable(N=N, rows=rows))
    return OrderingResult(sequential_ppl=sequential_ppl(model, wins, cfg.batch), tables=tables)


# ============================================================================ 3. correction propagation
@dataclass
class PropagationResult:
    N: int
    iters: list[int]
    with_correction: list[list[float]]  # [K index][j - 1]: PPL with the last j suffix layers active
    without_correction: list[list[float]]


@torch.inference_mode()
def correction_propagation(model: GPT, val_tokens, cfg: AnalysisConfig = AnalysisConfig()) -> PropagationResult:
    """Subset ablation: the prefix (L - N layers) runs exactly, the first N - j suffix layers are
    skipped and the last j are solved by `jxF1-h0-K{K}` (IDN or none) from the prefix state; over
    cfg.prop_tokens predicted tokens (the prefix runs once per batch for all 2 N^2 cells)."""
    L = model.config.n_layer
    N = min(cfg.prop_suffix, L)
    wins = windows(as_tokens(val_tokens), cfg.seq_len, min(cfg.prop_tokens, cfg.max_tokens))
    device = next(model.parameters()).device
    iters, js, surs = list(range(1, N + 1)), list(range(1, N + 1)), ("idn", "none")
    nll = {(s, K, j): 0.0 for s in surs for K in iters for j in js}
    bad, n_tok = set(), 0
    batches = wins.split(cfg.batch)
    with _bar(len(batches) * len(nll), "propagation", cfg) as bar:
        for b in batches:
            x, y = b[:, :-1].to(device), b[:, 1:].to(device)  # (B, T)
            ctx = model.embed(x)
            hS = model.run_layers(ctx.x0, ctx, 0, L - N)  # the state before the (partly skipped) suffix
            for key in nll:
                sur, K, j = key
                h = solve(model, x, Plan(chunks=j, iters=K, surrogate=sur), check_finite=False, prefix=hS).hidden
                _add_nll(model, h, y, nll, bad, key)
                bar.update()
            n_tok += y.numel()
    ppl = {k: float("inf") if k in bad else perplexity(v, n_tok) for k, v in nll.items()}
    return PropagationResult(N=N, iters=iters, with_correction=[[ppl["idn", K, j] for j in js] for K in iters],
                             without_correction=[[ppl["none", K, j] for j in js] for K in iters])


# ============================================================================ 4. early exit
@torch.inference_mode()
def early_exit(model: GPT, val_tokens, suffixes: list[int], cfg: EvalConfig = EvalConfig()) -> list[dict]:
    """Early-exit PPL (K = 0: skip the last N layers, logits = head(h_S), S = L - N; paper Table
    early_exit) over the same windows as `snlp.evaluation.evaluate` (cfg.seq_len, cfg.max_tokens,
    cfg.batch): one record {N, seq_layers, ppl} per suffix length N, N = 0 (sequential) first, then
    `suffixes` in order (duplicates dropped). One sequential pass per batch serves every N. Its PPL
    shows that suffix layers whose Jacobians are near the identity are still not droppable."""
    L = model.config.n_layer
    Ns = list(dict.fromkeys([0, *(int(n) for n in suffixes)]))
    bad = [n for n in Ns if not 0 <= n <= L]
    if bad:
        raise ValueError(f"early-exit suffix lengths must lie in [0, L = {L}] (got {bad})")
    device = next(model.parameters()).device
    wins = windows(as_tokens(val_tokens), cfg.seq_len, cfg.max_tokens)  # (W, T + 1)
    nll, n_tok = dict.fromkeys(Ns, 0.0), 0
    batches = wins.split(cfg.batch)
    with progress_bar(len(batches), "early exit", cfg.progress) as bar:
        for b in batches:
            x, y = b[:, :-1].to(device), b[:, 1:].to(device)  # (B, T)
            trace = model.hidden_states(x)  # [h_0 .. h_L], each (B, T, D)
            for n in Ns:
                logits = model.head(trace[L - n])  # (B, T, V)
                nll[n] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            n_tok += y.numel()
            bar.update()
    return [{"N": n, "seq_layers": L - n, "ppl": perplexity(nll[n], n_tok)} for n in Ns]


# ============================================================================ 5. ELK x init, preheat
@dataclass
class ElkResult:
    N: int
    iters: int
    sequential_ppl: float
    preheat_source: str
    ppl: dict[str, float]  # "a|init|CxFM" -> PPL


def _chunkings(N: int, chunks: tuple[int, ...]) -> list[tuple[int, int]]:
    """(C, M) pairs with C * M = N for the requested C values (0 = N); those not dividing N dropped."""
    out = []
    for c in chunks:
        c = N if c == 0 else c
        if 1 <= c <= N and N % c == 0 and (c, N // c) not in out:
            out.append((c, N // c))
    return out


def _ensure_preheat(model: GPT, cfg: AnalysisConfig) -> str:
    from . import preheat
    pre = model.__dict__.get("preheat")
    if pre is None:
        preheat.attach(model, preheat.fit(model, preheat.CalibrateConfig(rank=cfg.preheat_rank, seed=cfg.seed,
                                                                          seq_len=cfg.seq_len)))
        return "random (fitted by analyze)"
    return pre.source


def elk_sweep(model: GPT, val_tokens, cfg: AnalysisConfig = AnalysisConfig()) -> ElkResult:
    """PPL over ELK a x init {h0, fwd, preheat} x chunkings at N = cfg.elk_suffix, K = 1."""
    L = model.config.n_layer
    N = min(cfg.elk_suffix, L)
    wins = windows(as_tokens(val_tokens), cfg.seq_len, cfg.max_tokens)
    saved = model.__dict__.get("preheat")
    source = _ensure_preheat(model, cfg)
    chunkings = _chunkings(N, cfg.elk_chunks)
    ppl = {}
    try:
        with _bar(len(cfg.elk_values) * 3 * len(chunkings), "elk x init", cfg) as bar:
            for a in cfg.elk_values:
                for init in ("h0", "fwd", "preheat"):
                    for C, M in chunkings:
                        plan = Plan(chunks=C, fuse=M, init=init, iters=1, elk=a)
                        ppl[f"{a:g}|{init}|{C}xF{M}"] = plan_ppl(model, wins, plan, cfg.batch)
                        bar.update()
    finally:
        from . import preheat
        preheat.attach(model, saved)  # leave the model as it came
    return ElkResult(N=N, iters=1, sequential_ppl=sequential_ppl(model, wins, cfg.batch), preheat_source=source,
                     ppl=ppl)


@dataclass
class PreheatResult:
    N: int
    rank: int
    ppl: dict[str, dict[str, float]]  # calibration (h0 / random / data) -> CxFM -> PPL at K = 1


def preheat_calibrations(model: GPT, val_tokens, cfg: AnalysisConfig = AnalysisConfig()) -> PreheatResult:
    """K = 1 PPL with preheat calibrated on random tokens vs on validation data (the windows after
    the PPL windows where the split is long enough, else the same ones), h0 alongside."""
    from . import preheat
    L = model.config.n_layer
    N = min(cfg.elk_suffix, L)
    toks = as_tokens(val_tokens)
    wins = windows(toks, cfg.seq_len, cfg.max_tokens)
    used = wins.shape[0] * cfg.seq_len
    calib_data = toks[used:] if toks.numel() - used >= 8 * cfg.seq_len else toks
    saved = model.__dict__.get("preheat")
    chunkings = _chunkings(N, cfg.elk_chunks)
    ppl: dict[str, dict[str, float]] = {"h0": {}, "random": {}, "data": {}}
    try:
        with _bar(3 * len(chunkings), "preheat", cfg) as bar:
            for C, M in chunkings:
                ppl["h0"][f"{C}xF{M}"] = plan_ppl(model, wins, Plan(chunks=C, fuse=M, iters=1), cfg.batch)
                bar.update()
            for name, toks_ in (("random", None), ("data", calib_data)):
                ccfg = preheat.CalibrateConfig(rank=cfg.preheat_rank, seed=cfg.seed, seq_len=cfg.seq_len)
                preheat.attach(model, preheat.fit(model, ccfg, toks_))
                for C, M in chunkings:
                    ppl[name][f"{C}xF{M}"] = plan_ppl(model, wins, Plan(chunks=C, fuse=M, init="preheat", iters=1),
                                                      cfg.batch)
                    bar.update()
    finally:
        preheat.attach(model, saved)
    return PreheatResult(N=N, rank=cfg.preheat_rank, ppl=ppl)


# ============================================================================ 6. Jacobi coupling
@dataclass
class JacobiRow:
    config: str  # naive K=1 | naive K=2 | h0-JD K=1 | h0-JD K=2
    plan: str
    match: float  # positional token match vs sequential greedy
    accept_per_iter: float  # tokens kept per JD iteration
    jd_iters_per_round: float
    forwards_per_token: float
    tokens: int
    jd_iters: int
    forwards: int
    rounds: int


@dataclass
class JacobiResult:
    window: int
    prompts: int
    gen_tokens: int
    rows: list[JacobiRow]


def _add_nll(model: GPT, h: Tensor, y: Tensor, nll: dict, bad: set, key) -> None:
    """Add the summed next-token NLL of final states h (B, T, D) for targets y (B, T) under `key`; a non-finite
    state marks the key diverged instead (its PPL is reported as "diverged")."""
    if not bool(torch.isfinite(h).all()):
        bad.add(key)
    else:
        nll[key] += F.cross_entropy(model.head(h).flatten(0, 1), y.flatten(), reduction="sum").item()


def _prompts(val_tokens: Tensor, n: int, length: int, seed: int) -> list[list[int]]:
    from .evaldata import sample_prompts
    return sample_prompts(val_tokens, n, length, seed)


def jacobi_coupling(model: GPT, val_tokens, cfg: AnalysisConfig = AnalysisConfig()) -> JacobiResult:
    """Unverified JD over SNLP (naive / h0-JD, K = 1, 2) vs sequential greedy decoding."""
    from .generate import jacobi_generate, sequential_generate
    L = model.config.n_layer
    prompts = _prompts(as_tokens(val_tokens), cfg.jacobi_prompts, cfg.jacobi_prompt_len, cfg.seed)
    ref = [sequential_generate(model, p, max_new_tokens=cfg.jacobi_tokens).tokens for p in prompts]
    heads = list(cfg.jacobi_plans or [h for h in ("8xF1", "12xF1", "4xF3") if Plan.parse(h).n_suffix <= L] or
                 [f"{L}xF1"])
    for h in heads:
        Plan.parse(h, L)  # a clear error for a chunking that does not fit
    rows = []
    configs = [("naive", 1), ("naive", 2), ("h0-JD", 1), ("h0-JD", 2)]
    with _bar(len(heads) * len(configs) * len(prompts), "jacobi", cfg) as bar:
        for head in heads:
            for kind, K in configs:
                plan = Plan.parse(head).with_(iters=K)
                outs, it, fw, rounds = [], 0, 0, 0
                for p in prompts:
                    r = jacobi_generate(model, p, plan, block=cfg.jacobi_window, max_new_tokens=cfg.jacobi_tokens,
                                        verify=False, warm_start=kind == "h0-JD")
                    outs.append(r.tokens)
                    it, fw, rounds = it + r.jacobi_iters, fw + r.forwards, rounds + r.rounds
                    bar.update()
                n_tok = sum(len(o) for o in outs)
                rows.append(JacobiRow(config=f"{kind} K={K}", plan=str(plan), match=ar_match(outs, ref),
                                      accept_per_iter=n_tok / max(it, 1), jd_iters_per_round=it / max(rounds, 1),
                                      forwards_per_token=fw / max(n_tok, 1), tokens=n_tok, jd_iters=it, forwards=fw,
                                      rounds=rounds))
    return JacobiResult(window=cfg.jacobi_window, prompts=len(prompts), gen_tokens=cfg.jacobi_tokens, rows=rows)


# ============================================================================ the whole analysis
@dataclass
class AnalysisResult:
    checkpoint: str
    config: dict
    environment: dict
    seconds: dict[str, float] = field(default_factory=dict)
    jacobian: JacobianResult | None = None
    ordering: OrderingResult | None = None
    propagation: PropagationResult | None = None
    early_exit: list[dict] | None = None
    elk: ElkResult | None = None
    preheat: PreheatResult | None = None
    jacobi: JacobiResult | None = None


def environment() -> dict:
    try:
        load = open("/proc/loadavg").read().split()[0]
    except OSError:
        load = "n/a"
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "python": platform.python_version(), "machine": f"{platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads", "loadavg_1min_start": load}


def analyze(model: GPT, val_tokens, cfg: AnalysisConfig = AnalysisConfig(), checkpoint: str = "") -> AnalysisResult:
    """Run the selected sections (cfg.only) on `model` with validation token ids `val_tokens`."""
    L = model.config.n_layer
    cfg.check(L)
    model.eval()
    res = AnalysisResult(checkpoint=str(checkpoint), config=asdict(cfg), environment=environment())
    steps = [("jacobian", lambda: jacobian_diagnostics(model, val_tokens, cfg)),
             ("ordering", lambda: correction_ordering(model, val_tokens, cfg)),
             ("propagation", lambda: correction_propagation(model, val_tokens, cfg)),
             ("early-exit", lambda: early_exit(model, val_tokens, cfg.suffix_sizes(L), cfg.eval_config())),
             ("elk", lambda: elk_sweep(model, val_tokens, cfg)),
             ("preheat", lambda: preheat_calibrations(model, val_tokens, cfg)),
             ("jacobi", lambda: jacobi_coupling(model, val_tokens, cfg))]
    for name, fn in steps:
        if name not in cfg.only:
            continue
        t0 = time.perf_counter()
        setattr(res, name.replace("-", "_"), fn())
        res.seconds[name] = round(time.perf_counter() - t0, 1)
        if cfg.progress:
            print(f"analyze: {name} done in {res.seconds[name]:.1f}s", file=sys.stderr)
    try:
        res.environment["loadavg_1min_end"] = open("/proc/loadavg").read().split()[0]
    except OSError:
        pass
    return res


# ============================================================================ presentation
def jacobian_table(j: JacobianResult) -> str:
    rows = [[d.layer, _fmt(d.sigma_max), _fmt(d.frob), _fmt(d.amp), _fmt(1e3 * d.eps, 3), _fmt(1e3 * d.c_eps, 3),
             _fmt(d.delta_g, 3)] for d in j.layers]
    return md_table(["Layer", "σmax", "‖J‖_F", "amp.", "10³ \\|ε_l\\|", "10³ C_ε", "Δ_g"], rows)


def ordering_tables(o: OrderingResult) -> str:
    parts = []
    for t in o.tables:
        Ks = list(t.rows[0].ppl)
        rows = [[r.name, _fmt(r.ar_ness, 3), _fmt(r.seq_perm, 1), *[_fmt(r.ppl[K], 1) for K in Ks]] for r in t.rows]
        parts.append(f"**N = {t.N}** (sequential PPL {_fmt(o.sequential_ppl)})\n\n"
                     + md_table(["Order", "AR-ness", "Seq-Perm", *[f"K={K}" for K in Ks]], rows))
    return "\n\n".join(parts)


def ordering_summary(o: OrderingResult) -> str:
    rows = []
    for t in o.tables:
        s = t.summary()
        K1 = s[f"K{list(t.rows[0].ppl)[0]}"]
        rows.append([t.N, _fmt(s["seq_forward"], 1), _fmt(s["seq_reversed"], 1), _fmt(s["seq_best_shuffle"], 1),
                     _fmt(s["seq_shuffle_std"]), _fmt(K1["forward"], 1), _fmt(K1["reversed"], 1),
                     _fmt(K1["best_shuffle"], 1), _fmt(K1["no_correction"], 1), _fmt(K1["shuffle_std"])])
    return md_table(["N", "Seq fwd", "Seq rev", "Seq best shuffle", "Seq shuffle std", "IDN K=1 fwd",
                     "K=1 rev", "K=1 best shuffle", "K=1 no corr.", "K=1 shuffle std"], rows)


def propagation_table(p: PropagationResult) -> str:
    head = ["Correction", "K", *[f"last {j}" for j in range(1, p.N + 1)]]
    rows = [["w/ corr.", K, *[_fmt(v) for v in row]] for K, row in zip(p.iters, p.with_correction)]
    rows += [["w/o corr.", K, *[_fmt(v) for v in row]] for K, row in zip(p.iters, p.without_correction)]
    return md_table(head, rows)


def early_exit_table(rows: list[dict]) -> str:
    return md_table(["N", "Seq layers", "PPL"], [[r["N"], r["seq_layers"], _fmt(r["ppl"])] for r in rows])


def elk_table(e: ElkResult) -> str:
    chunkings = list(dict.fromkeys(k.split("|")[2] for k in e.ppl))
    head = ["ELK a", *[f"{c} {i}" for c in chunkings for i in ("h0", "fwd", "preheat")]]
    elks = list(dict.fromkeys(k.split("|")[0] for k in e.ppl))
    rows = [[a, *[_fmt(e.ppl[f"{a}|{i}|{c}"]) for c in chunkings for i in ("h0", "fwd", "preheat")]] for a in elks]
    return md_table(head, rows)


def preheat_table(p: PreheatResult) -> str:
    chunkings = list(p.ppl["h0"])
    return md_table(["Init (K=1)", *chunkings], [[k, *[_fmt(v[c]) for c in chunkings]] for k, v in p.ppl.items()])


def jacobi_table(j: JacobiResult) -> str:
    rows = [[r.plan.split("-")[0], r.config, f"{100 * r.match:.1f}%", _fmt(r.accept_per_iter), _fmt(r.jd_iters_per_round),
             _fmt(r.forwards_per_token)] for r in j.rows]
    return md_table(["Chunking", "Config", "Match", "Accept/iter", "JD iters/round", "Fwd/token"], rows)


def to_markdown(res: AnalysisResult, plots: dict[str, str] | None = None) -> str:
    plots = plots or {}
    env = res.environment
    out = [f"# SNLP analysis of `{res.checkpoint}`", "",
           f"{env['date']}; {env['machine']}; torch {env['torch']}; 1-min load average "
           f"{env.get('loadavg_1min_start')} (start) / {env.get('loadavg_1min_end', 'n/a')} (end); "
           f"section times (s): {res.seconds}.", ""]
    c = res.config
    if res.jacobian:
        j = res.jacobian
        out += ["## Jacobian diagnostics", "",
                f"Suffix N = {j.suffix} (h_S = the state after the first L - N layers; layers are 0-based), "
                f"{j.windows} windows of {j.seq_len} tokens; σmax by {j.power_iters} power iterations (largest "
                f"relative change in the last one: "
                f"{max((d.sigma_rel_change for d in j.layers), default=float('nan')):.2e}); ‖J‖_F per token from "
                f"{j.probes} Hutchinson probes; amp. = ‖J_f v‖/‖v‖ over {j.probes} Gaussian probes.", "",
                jacobian_table(j), ""]
        if "jacobian" in plots:
            out += [f"![jacobian]({plots['jacobian']})", ""]
    if res.ordering:
        out += ["## Correction ordering", "", "Summary (paper Table ordering_summary):", "",
                ordering_summary(res.ordering), "", ordering_tables(res.ordering), ""]
        if "ordering" in plots:
            out += [f"![ordering]({plots['ordering']})", ""]
    if res.propagation:
        out += ["## Correction propagation", "", f"N = {res.propagation.N}: PPL with only the last j suffix layers "
                "active (the others skipped).", "", propagation_table(res.propagation), ""]
        if "propagation" in plots:
            out += [f"![propagation]({plots['propagation']})", ""]
    if res.early_exit:
        out += ["## Early exit (K = 0)", "", early_exit_table(res.early_exit), ""]
    if res.elk:
        out += ["## ELK tempering x init", "", f"N = {res.elk.N}, K = {res.elk.iters}, sequential PPL "
                f"{_fmt(res.elk.sequential_ppl)}; preheat calibration: {res.elk.preheat_source}.", "",
                elk_table(res.elk), ""]
    if res.preheat:
        out += ["## Preheat calibration", "", f"N = {res.preheat.N}, rank {res.preheat.rank}, K = 1, ELK 0.", "",
                preheat_table(res.preheat), ""]
    if res.jacobi:
        j = res.jacobi
        out += ["## Jacobi decoding x SNLP (unverified)", "", f"{j.prompts} prompts, {j.gen_tokens} tokens, "
                f"lookahead window W = {j.window}; match vs sequential greedy.", "", jacobi_table(j), ""]
    out += [f"Settings: `{json.dumps({k: v for k, v in c.items() if k != 'progress'})}`", ""]
    return "\n".join(out)


def report_section(res: AnalysisResult) -> str:
    """A short markdown diagnostics section for the speedrun report: Jacobian table, ordering summary
    and early exit, whichever were run."""
    out = ["### SNLP diagnostics (snlp analyze)", ""]
    if res.jacobian:
        out += [jacobian_table(res.jacobian), ""]
    if res.ordering:
        out += [ordering_summary(res.ordering), ""]
    if res.early_exit:
        out += [early_exit_table(res.early_exit), ""]
    return "\n".join(out)


def write_plots(res: AnalysisResult, out: Path) -> dict[str, str]:
    """PNG plots (matplotlib, Agg): per-layer Jacobian norms, ordering scatter, propagation heat maps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    made = {}
    if res.jacobian and res.jacobian.layers:
        ls = [d.layer for d in res.jacobian.layers]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, label in (("sigma_max", "σmax(J_g)"), ("frob", "‖J_g‖_F / √T"), ("amp", "amp. ‖J_f v‖/‖v‖")):
            ax.plot(ls, [getattr(d, key) for d in res.jacobian.layers], marker="o", label=label)
        ax.set_xlabel("layer"), ax.set_yscale("log"), ax.legend(), ax.set_title("Jacobian diagnostics")
        fig.tight_layout(), fig.savefig(out / "jacobian.png", dpi=120), plt.close(fig)
        made["jacobian"] = "jacobian.png"
    if res.ordering:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for t in res.ordering.tables:
            K = list(t.rows[0].ppl)[0]
            pts = [(r.ar_ness, r.ppl[K]) for r in t.rows if r.ar_ness is not None and math.isfinite(r.ppl[K])]
            if pts:
                ax.scatter(*zip(*pts), label=f"N={t.N}, K={K}")
        ax.set_xlabel("AR-ness of the correction order"), ax.set_ylabel("IDN PPL"), ax.set_yscale("log")
        ax.legend(), ax.set_title("Correction ordering")
        fig.tight_layout(), fig.savefig(out / "ordering.png", dpi=120), plt.close(fig)
        made["ordering"] = "ordering.png"
    if res.propagation:
        p = res.propagation
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
        for ax, data, title in ((axes[0], p.with_correction, "w/ correction"),
                                (axes[1], p.without_correction, "w/o correction")):
            arr = np.log(np.clip(np.nan_to_num(np.array(data, dtype=float), nan=1e9, posinf=1e9), 1, 1e9))
            im = ax.imshow(arr, aspect="auto", cmap="viridis", origin="upper",
                           extent=(0.5, p.N + 0.5, p.N + 0.5, 0.5))
            ax.set_xlabel("last j layers active"), ax.set_ylabel("K"), ax.set_title(title)
            fig.colorbar(im, ax=ax, label="log PPL")
        fig.tight_layout(), fig.savefig(out / "propagation.png", dpi=120), plt.close(fig)
        made["propagation"] = "propagation.png"
    return made


def _jsonable(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def write(res: AnalysisResult, out) -> Path:
    """Write analysis.md, analysis.json and the PNG plots into the folder `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(res, out)
    (out / "analysis.json").write_text(json.dumps(_jsonable(asdict(res)), indent=1))
    (out / "analysis.md").write_text(to_markdown(res, plots))
    return out


# ============================================================================ CLI: snlp analyze
def _ints(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(p) -> None:
    p.add_argument("ckpt", help="checkpoint directory")
    p.add_argument("--data", default=None, help="validation data spec (default: the checkpoint's training data)")
    p.add_argument("--seq-len", type=int, default=AnalysisConfig.seq_len, help="tokens per PPL window")
    p.add_argument("--max-tokens", type=int, default=AnalysisConfig.max_tokens, help="predicted tokens per PPL")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections: {', '.join(SECTIONS)}")
    p.add_argument("--layers", default=None, help="jacobian layers, 0-based, comma-separated (default: the last 8)")
    p.add_argument("--suffixes", default=None, help="ordering / early-exit suffix sizes N (default 8,12,L)")
    p.add_argument("--shuffles", type=int, default=AnalysisConfig.shuffles, help="random correction orders per N")
    p.add_argument("--preheat-rank", type=int, default=AnalysisConfig.preheat_rank)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: on a shared or busy CPU "
                   "more threads only add contention; raise it on a free machine)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", required=True, help="output folder for analysis.md, analysis.json and plots")


def run(args) -> int:
    from .checkpoint import load
    from .evaldata import checkpoint_data, validation_tokens

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if not Path(args.ckpt).exists():
        raise FileNotFoundError(f"checkpoint {args.ckpt} does not exist")
    model, tok = load(args.ckpt)
    if tok is None:
        raise ValueError(f"checkpoint {args.ckpt} has no tokenizer: validation tokens cannot be made")
    only = tuple(s.strip() for s in args.only.split(",") if s.strip())
    cfg = AnalysisConfig(seq_len=args.seq_len, max_tokens=args.max_tokens, only=only, layers=_ints(args.layers),
                         suffixes=_ints(args.suffixes), shuffles=args.shuffles, preheat_rank=args.preheat_rank,
                         seed=args.seed, progress=not args.no_progress)
    cfg.check(model.config.n_layer)
    val = validation_tokens(tok, **checkpoint_data(args.ckpt, data=args.data))
    res = analyze(model, val, cfg, checkpoint=args.ckpt)
    out = write(res, args.out)
    print(f"wrote {out / 'analysis.md'}, {out / 'analysis.json'} and plots ({sum(res.seconds.values()):.0f}s)")
    return 0

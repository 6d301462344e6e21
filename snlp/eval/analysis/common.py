"""What every analysis section shares: the settings (AnalysisConfig), PPL over validation windows of
given final states / a plan / the sequential model, and markdown cell formatting.
All PPLs are token-weighted over non-overlapping windows of `seq_len` validation tokens (snlp.eval)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import Tensor

from snlp.runtime.checks import check_bools, count_error, number_error
from snlp.runtime.fmt import DIVERGED, PPL_SCI, sci
from snlp.eval.metrics import perplexity
from snlp.eval.protocol import EvalConfig
from snlp.method.plan import Plan
from snlp.method.solver import solve
from snlp.model.gpt import GPT
from snlp.runtime.device import progress_bar

SECTIONS = ("jacobian", "ordering", "propagation", "early-exit", "elk", "preheat", "jacobi")
# the sections that read validation windows of seq_len tokens (jacobi decodes its own prompts of jacobi_prompt_len)
WINDOWED = ("jacobian", "ordering", "propagation", "early-exit", "elk", "preheat")
# the integer settings (scalars, and tuples of them); `check` refuses a bool or another type before their ranges:
# True is an int, so seq_len=True read windows of one token and batch=True ran one window per forward
COUNTS = ("seq_len", "max_tokens", "batch", "jac_suffix", "jac_windows", "power_iters", "probes", "shuffles", "prop_suffix",
          "prop_tokens", "elk_suffix", "preheat_rank", "jacobi_prompts", "jacobi_prompt_len", "jacobi_tokens",
          "jacobi_window", "seed")
COUNT_TUPLES = ("layers", "suffixes", "ordering_iters", "elk_chunks")
DIV = DIVERGED  # snlp.runtime.fmt's word for a non-finite PPL, the same in every table the project writes


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
        if isinstance(self.only, str):  # a str is a tuple of its letters: named as such, not as 8 unknown sections
            raise ValueError(f"only must be a tuple of section names, not the string {self.only!r} (e.g. "
                             f"only=({self.only!r},))")
        for name in COUNTS:
            if err := count_error(name, getattr(self, name)):
                raise ValueError(f"analysis setting {err}")
        for name in COUNT_TUPLES:
            for v in getattr(self, name) or ():
                if err := count_error(f"each of {name}", v):
                    raise ValueError(f"analysis setting {err}")
        for v in self.elk_values:
            if err := number_error("each ELK value", v):
                raise ValueError(err)
        check_bools(progress=self.progress)
        bad = [s for s in self.only if s not in SECTIONS]
        if bad:
            raise ValueError(f"unknown analysis section(s) {bad}: valid sections are {', '.join(SECTIONS)}")
        low = [f"{k}={getattr(self, k)}" for k in ("seq_len", "max_tokens", "batch", "jac_suffix", "jac_windows",
                                                   "power_iters", "probes", "prop_suffix", "prop_tokens", "elk_suffix",
                                                   "jacobi_prompts", "jacobi_prompt_len", "jacobi_tokens",
                                                   "jacobi_window", "preheat_rank") if getattr(self, k) < 1]
        low += [f"{k}={getattr(self, k)}" for k in ("shuffles", "seed") if getattr(self, k) < 0]
        low += [f"{k}={list(getattr(self, k))}" for k in ("ordering_iters", "elk_chunks")
                if min(getattr(self, k), default=0) < 0]
        if low:
            raise ValueError(f"analysis settings out of range: {', '.join(low)} (shuffles, seed, ordering_iters and elk_chunks >= 0, the others >= 1)")
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


def section_bar(total: int, desc: str, cfg: AnalysisConfig):
    """The progress bar of one section (silent unless cfg.progress)."""
    return progress_bar(total, desc, cfg.progress)


def fmt(x, digits: int = 2) -> str:
    """A table cell: '-' for a missing value, 'diverged' for a non-finite one (a diverged solve)."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if not math.isfinite(x):
        return DIV
    return f"{x:.{digits}f}" if abs(x) < PPL_SCI else sci(x)  # snlp.runtime.fmt's rule: 1.7e8, not 174060849.26


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
    return window_ppl(model, wins, model.final_state, batch)


def add_nll(model: GPT, h: Tensor, y: Tensor, nll: dict, bad: set, key: Hashable) -> None:
    """Add the summed next-token NLL of final states h (B, T, D) for targets y (B, T) under `key`; a
    non-finite state marks the key diverged instead (its PPL is reported as "diverged"). Sections that
    share one prefix run over many cells accumulate per cell with this, then take perplexity()."""
    if not bool(torch.isfinite(h).all()):
        bad.add(key)
    else:
        nll[key] += F.cross_entropy(model.head(h).flatten(0, 1), y.flatten(), reduction="sum").item()

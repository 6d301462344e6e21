"""Correction ordering (paper Table ordering_summary, App. "Correction Ordering"): per suffix size N,
forward, reversed and R random shuffles of the IDN correction order: Seq-Perm PPL (the permuted
suffix run sequentially), IDN K = 1 / K = 4 PPL, no-correction PPL, AR-ness (DiffuCoder, Gong et al.
2025: mean of local AR-ness@1, the fraction of the N - 1 steps that visit the position right after
the previous one, and global AR-ness@1, the fraction of the N steps that visit the leftmost unvisited
position; forward 1, reversed 1 / (2N), the paper's values); summary: best shuffle, shuffle std over
finite values, "diverged" for non-finite PPL."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from snlp.eval.analysis.common import AnalysisConfig, add_nll, section_bar, sequential_ppl
from snlp.eval.data import as_tokens, windows
from snlp.eval.metrics import perplexity
from snlp.method.plan import Plan
from snlp.method.solver import permuted_sequential, solve
from snlp.model.gpt import GPT


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
class IdnSummary:
    """IDN PPL at one K over the correction orders of one N (paper Table ordering_summary)."""

    forward: float
    reversed: float
    best_shuffle: float | None  # inf when no shuffle stayed finite; None when none was run (--shuffles 0)
    no_correction: float
    shuffle_std: float  # population std over the finite shuffles; nan for fewer than two


@dataclass
class OrderingSummary:
    """The paper's Table ordering_summary row for one N."""

    N: int
    seq_forward: float | None  # Seq-Perm PPL (the permuted suffix run sequentially)
    seq_reversed: float | None
    seq_best_shuffle: float | None  # None when no shuffle was run (--shuffles 0)
    seq_shuffle_std: float
    idn: dict[int, IdnSummary]  # K -> IDN PPL by order, in the table's K order


def _finite(xs) -> list[float]:
    return [x for x in xs if x is not None and math.isfinite(x)]


def _spread(vals: list[float]) -> tuple[float, float]:
    """(best, std) of finite values: a diverged order must not hide the others' spread."""
    return (min(vals) if vals else float("inf")), (statistics.pstdev(vals) if len(vals) > 1 else float("nan"))


@dataclass
class OrderingTable:
    N: int
    rows: list[OrderRow]

    def summary(self) -> OrderingSummary:
        shuf = [r for r in self.rows if r.name.startswith("shuffle")]
        get = {r.name: r for r in self.rows}
        # no shuffle run (--shuffles 0) is a missing value ('-'), not inf: inf prints 'diverged', a solve that failed
        none = lambda best: best if shuf else None  # noqa: E731
        seq_best, seq_std = _spread(_finite(r.seq_perm for r in shuf))
        seq_best = none(seq_best)
        idn = {}
        for K in get["forward"].ppl:
            best, std = _spread(_finite(r.ppl[K] for r in shuf))
            best = none(best)
            idn[K] = IdnSummary(forward=get["forward"].ppl[K], reversed=get["reversed"].ppl[K], best_shuffle=best,
                                no_correction=get["no correction"].ppl[K], shuffle_std=std)
        return OrderingSummary(N=self.N, seq_forward=get["forward"].seq_perm, seq_reversed=get["reversed"].seq_perm,
                               seq_best_shuffle=seq_best, seq_shuffle_std=seq_std, idn=idn)


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


@dataclass(frozen=True)
class Cell:
    """One PPL of the ordering section: suffix size N, correction order (by name) and what runs:
    "seq" (Seq-Perm: the permuted suffix sequentially), "idn" (IDN at K iterations in that order) or
    "none" (no correction at K; order "no correction")."""

    N: int
    order: str
    kind: str
    K: int = 0


def _cells(Ns: list[int], Ks: list[int], orders: dict[int, list[tuple[str, list[int]]]]) -> list[Cell]:
    cells = []
    for N in Ns:
        for name, _ in orders[N]:
            cells += [Cell(N, name, "seq"), *[Cell(N, name, "idn", K) for K in Ks]]
        cells += [Cell(N, "no correction", "none", K) for K in Ks]
    return cells


def _cell_hidden(model: GPT, x, cell: Cell, order: list[int] | None, prefix, hb=None):
    """The final states of `cell` from the prefix state (B, T, D) of its N."""
    if cell.kind == "seq":
        return permuted_sequential(model, x, Plan(chunks=cell.N), order=tuple(order), prefix=prefix).hidden
    if cell.kind == "none":
        plan = Plan(chunks=cell.N, iters=cell.K, surrogate="none")
    else:
        plan = Plan(chunks=cell.N, iters=cell.K, order=tuple(order))
    return solve(model, x, plan, check_finite=False, prefix=prefix, hb=hb).hidden


@torch.inference_mode()
def correction_ordering(model: GPT, val_tokens, cfg: AnalysisConfig = AnalysisConfig()) -> OrderingResult:
    """Seq-Perm, IDN K = cfg.ordering_iters and no-correction PPL per order and suffix size N (xF1, h0).
    The prefix runs once per batch and N for every cell."""
    L = model.config.n_layer
    if model.config.backout:  # Seq-Perm (permuted_sequential) refuses it; say so before any work
        raise ValueError("correction ordering runs Seq-Perm, which nanochat's backout does not define (it reads a "
                         "layer's output at a fixed depth)")
    wins = windows(as_tokens(val_tokens), cfg.seq_len, cfg.max_tokens)
    device = next(model.parameters()).device
    Ns, Ks = cfg.suffix_sizes(L), list(cfg.ordering_iters)
    orders = {N: orders_for(N, cfg.shuffles, cfg.seed) for N in Ns}
    cells = _cells(Ns, Ks, orders)
    nll, bad, n_tok = dict.fromkeys(cells, 0.0), set(), 0
    batches = wins.split(cfg.batch)
    with section_bar(len(batches) * len(cells), "ordering", cfg) as bar:
        for b in batches:
            x, y = b[:, :-1].to(device), b[:, 1:].to(device)  # (B, T)
            ctx = model.embed(x)
            prefix = {N: model.run_layers(ctx.x0, ctx, 0, L - N) for N in Ns}
            for cell in cells:
                hb = ctx.hb if model.config.backout and model.config.backout_layer < L - cell.N else None
                h = _cell_hidden(model, x, cell, dict(orders[cell.N]).get(cell.order), prefix[cell.N], hb)
                add_nll(model, h, y, nll, bad, cell)
                bar.update()
            n_tok += y.numel()
    ppl = {c: float("inf") if c in bad else perplexity(v, n_tok) for c, v in nll.items()}
    tables = []
    for N in Ns:
        rows = [OrderRow(name=name, order=order, ar_ness=ar_ness(order), seq_perm=ppl[Cell(N, name, "seq")],
                         ppl={K: ppl[Cell(N, name, "idn", K)] for K in Ks}) for name, order in orders[N]]
        rows.append(OrderRow(name="no correction", order=None, ar_ness=None, seq_perm=None,
                             ppl={K: ppl[Cell(N, "no correction", "none", K)] for K in Ks}))
        tables.append(OrderingTable(N=N, rows=rows))
    return OrderingResult(sequential_ppl=sequential_ppl(model, wins, cfg.batch), tables=tables)

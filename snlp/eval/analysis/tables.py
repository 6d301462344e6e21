"""The analysis sections' results as GitHub markdown tables (paper layouts)."""

from __future__ import annotations

import math

from snlp.eval.analysis.common import fmt, md_table
from snlp.eval.analysis.earlyexit import ExitRow
from snlp.eval.analysis.elk import INITS, ElkResult, PreheatResult
from snlp.eval.analysis.jacobi import JacobiResult
from snlp.eval.analysis.jacobian import JacobianResult
from snlp.eval.analysis.ordering import OrderingResult
from snlp.eval.analysis.propagation import PropagationResult


def _sub(x: float, scale: float = 1.0) -> str:
    """A substitution-error cell: nan is a layer outside the suffix (--layers below L - N), where eps_l = g_l(h^seq) -
    g_l(h_S) is not defined (h_S comes after it), so '-' rather than fmt's 'diverged'."""
    return fmt(None if math.isnan(x) else scale * x, 3)


def jacobian_table(j: JacobianResult) -> str:
    rows = [[d.layer, fmt(d.sigma_max), fmt(d.frob), fmt(d.amp), _sub(d.eps, 1e3), _sub(d.c_eps, 1e3), _sub(d.delta_g)]
            for d in j.layers]
    return md_table(["Layer", "σmax", "‖J‖_F", "amp.", "10³ \\|ε_l\\|", "10³ C_ε", "Δ_g"], rows)


def ordering_tables(o: OrderingResult) -> str:
    parts = []
    for t in o.tables:
        Ks = list(t.rows[0].ppl)
        rows = [[r.name, fmt(r.ar_ness, 3), fmt(r.seq_perm, 1), *[fmt(r.ppl[K], 1) for K in Ks]] for r in t.rows]
        parts.append(f"**N = {t.N}** (sequential PPL {fmt(o.sequential_ppl)})\n\n"
                     + md_table(["Order", "AR-ness", "Seq-Perm", *[f"K={K}" for K in Ks]], rows))
    return "\n\n".join(parts)


def _std(x: float) -> str:
    """A shuffle-spread cell: nan is fewer than two finite shuffles (`--shuffles 1`), a spread not defined, not a
    diverged solve, so '-' (a missing value) rather than fmt's 'diverged'."""
    return fmt(None if math.isnan(x) else x)


def ordering_summary(o: OrderingResult) -> str:
    rows = []
    for t in o.tables:
        s = t.summary()
        K1 = next(iter(s.idn.values()))  # the first K of the table (K = 1 by default)
        rows.append([t.N, fmt(s.seq_forward, 1), fmt(s.seq_reversed, 1), fmt(s.seq_best_shuffle, 1),
                     _std(s.seq_shuffle_std), fmt(K1.forward, 1), fmt(K1.reversed, 1),
                     fmt(K1.best_shuffle, 1), fmt(K1.no_correction, 1), _std(K1.shuffle_std)])
    return md_table(["N", "Seq fwd", "Seq rev", "Seq best shuffle", "Seq shuffle std", "IDN K=1 fwd",
                     "K=1 rev", "K=1 best shuffle", "K=1 no corr.", "K=1 shuffle std"], rows)


def propagation_table(p: PropagationResult) -> str:
    head = ["Correction", "K", *[f"last {j}" for j in range(1, p.N + 1)]]
    rows = [["w/ corr.", K, *[fmt(v) for v in row]] for K, row in zip(p.iters, p.with_correction)]
    rows += [["w/o corr.", K, *[fmt(v) for v in row]] for K, row in zip(p.iters, p.without_correction)]
    return md_table(head, rows)


def early_exit_table(rows: list[ExitRow]) -> str:
    return md_table(["N", "Seq layers", "PPL"], [[r.N, r.seq_layers, fmt(r.ppl)] for r in rows])


def elk_table(e: ElkResult) -> str:
    """One row per ELK a; a column per chunking x init."""
    chunkings = list(dict.fromkeys(r.chunking for r in e.rows))
    ppl = {(r.alpha, r.init, r.chunking): r.ppl for r in e.rows}
    head = ["ELK a", *[f"{c} {i}" for c in chunkings for i in INITS]]
    rows = [[f"{a:g}", *[fmt(ppl[a, i, c]) for c in chunkings for i in INITS]]
            for a in dict.fromkeys(r.alpha for r in e.rows)]
    return md_table(head, rows)


def preheat_table(p: PreheatResult) -> str:
    """One row per calibration (h0 first); a column per chunking."""
    chunkings = list(dict.fromkeys(r.chunking for r in p.rows))
    ppl = {(r.calibration, r.chunking): r.ppl for r in p.rows}
    rows = [[k, *[fmt(ppl[k, c]) for c in chunkings]] for k in dict.fromkeys(r.calibration for r in p.rows)]
    return md_table(["Init (K=1)", *chunkings], rows)


def jacobi_table(j: JacobiResult) -> str:
    rows = [[r.plan.split("-")[0], r.config, f"{100 * r.match:.1f}%", fmt(r.accept_per_iter), fmt(r.jd_iters_per_round),
             fmt(r.forwards_per_token)] for r in j.rows]
    return md_table(["Chunking", "Config", "Match", "Accept/iter", "JD iters/round", "Fwd/token"], rows)


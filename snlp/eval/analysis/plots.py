"""PNG plots of the analysis sections (matplotlib, Agg): per-layer Jacobian norms, ordering scatter,
propagation heat maps. Each takes its section's result and the file to write."""

from __future__ import annotations

import math
from pathlib import Path

from snlp.eval.analysis.jacobian import JacobianResult
from snlp.eval.analysis.ordering import OrderingResult
from snlp.eval.analysis.propagation import PropagationResult


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only: no display, and no GUI backend on a headless box
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> None:
    plt = _pyplot()
    fig.tight_layout(), fig.savefig(path, dpi=120), plt.close(fig)


def jacobian_plot(j: JacobianResult, path: Path) -> None:
    plt = _pyplot()
    ls = [d.layer for d in j.layers]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("sigma_max", "σmax(J_g)"), ("frob", "‖J_g‖_F / √T"), ("amp", "amp. ‖J_f v‖/‖v‖")):
        ax.plot(ls, [getattr(d, key) for d in j.layers], marker="o", label=label)
    ax.set_xlabel("layer"), ax.set_yscale("log"), ax.legend(), ax.set_title("Jacobian diagnostics")
    _save(fig, path)


def ordering_plot(o: OrderingResult, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for t in o.tables:
        K = list(t.rows[0].ppl)[0]
        pts = [(r.ar_ness, r.ppl[K]) for r in t.rows if r.ar_ness is not None and math.isfinite(r.ppl[K])]
        if pts:
            ax.scatter(*zip(*pts), label=f"N={t.N}, K={K}")
    ax.set_xlabel("AR-ness of the correction order"), ax.set_ylabel("IDN PPL"), ax.set_yscale("log")
    ax.legend(), ax.set_title("Correction ordering")
    _save(fig, path)


def log_ppl_cells(data):
    """The heat map's cells: log PPL, diverged (non-finite) cells masked. Clipping them to a fixed top (1e9) drew
    every finite PPL above it (a 1e10 cell) in the same colour as a diverged one."""
    import numpy as np

    arr = np.array(data, dtype=float)
    return np.ma.masked_invalid(np.log(np.where(np.isfinite(arr), arr, np.nan)))


def propagation_plot(p: PropagationResult, path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, data, title in ((axes[0], p.with_correction, "w/ correction"),
                            (axes[1], p.without_correction, "w/o correction")):
        cmap = plt.get_cmap("viridis").with_extremes(bad="red")  # diverged cells: red, outside the scale
        im = ax.imshow(log_ppl_cells(data), aspect="auto", cmap=cmap, origin="upper",
                       extent=(0.5, p.N + 0.5, p.N + 0.5, 0.5))
        ax.set_xlabel("last j layers active"), ax.set_ylabel("K"), ax.set_title(title)
        fig.colorbar(im, ax=ax, label="log PPL (red: diverged)")
    _save(fig, path)

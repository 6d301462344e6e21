"""Presentation of evaluation records (snlp.evaluation.EvalRecord): the terminal table, the markdown
table of the paper's main-table columns, CSV and the speed-quality frontier plot. No computation
beyond formatting and the Pareto front."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from snlp.eval.protocol import EvalRecord
from snlp.eval.metrics import pareto_front

COLUMNS = (  # (header, field, format) of the tables
    ("Plan", "plan", "{}"), ("K", "K", "{}"), ("PPL", "ppl", "{:.2f}"), ("ΔPPL", "delta_ppl", "{:+.1%}"),
    ("Speedup", "speedup", "{:.2f}x"), ("Prefill", "prefill_speedup", "{:.2f}x"),
    ("Ideal (layers)", "ideal_layer_speedup", "{:.2f}x"), ("Top-1", "top1", "{:.1%}"),
    ("LogitSim", "logit_sim", "{:.3f}"), ("EmbSim", "emb_sim", "{:.3f}"), ("AR Match", "ar_match", "{:.1%}"),
    ("β̂", "ar_beta", "{:.4f}"))


def _cells(rec: EvalRecord) -> list[str]:
    vals = [getattr(rec, key) for _, key, _ in COLUMNS]
    cells = ["-" if v is None else fmt.format(v) for v, (_, _, fmt) in zip(vals, COLUMNS)]
    if rec.note:
        cells[0] += f" ({rec.note})"
    return cells


def markdown_table(records: list[EvalRecord]) -> str:
    """The records as a GitHub markdown table (the paper's main-table columns, '-' where empty)."""
    lines = ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
             "|" + "|".join(":---" if i == 0 else "---:" for i in range(len(COLUMNS))) + "|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in records]
    return "\n".join(lines) + "\n"


def print_table(records: list[EvalRecord], title: str) -> None:
    """The records as a rich table on the terminal."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for header, _, _ in COLUMNS:
        table.add_column(header, justify="left" if header == "Plan" else "right")
    for r in records:
        table.add_row(*_cells(r))
    Console(width=200).print(table)


def write_csv(rows: list[dict], path) -> None:
    """Rows (e.g. EvalRecord.to_dict()) as CSV: columns in first-seen order, empty cells for None."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows({k: ("" if r.get(k) is None else r[k]) for k in fields} for r in rows)
    print(f"wrote {path}")


def frontier_plot(groups: dict[str, list[EvalRecord]], path, title: str = "") -> None:
    """PNG of the speed-quality frontier: PPL vs measured speedup, one point per plan (labelled),
    the sequential baseline (1.0x) as a star and each group's Pareto front as a line; one colour per
    group, e.g. {"No Reg.": records, "IDN Reg.": records}. Diverged/untimed rows are left out."""
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, no display needed

    fig = Figure(figsize=(8, 5.5), layout="constrained")
    ax = fig.add_subplot()
    ppls = []
    for i, (group, recs) in enumerate(groups.items()):
        color = f"C{i % 10}"
        pts = [(r.speedup, r.ppl) for r in recs]
        keep = [j for j, (s, p) in enumerate(pts) if s is not None and p is not None and math.isfinite(p)]
        front = pareto_front(pts)
        ax.plot([pts[j][0] for j in front], [pts[j][1] for j in front], "-o", color=color, lw=2, alpha=0.5,
                mfc="none", ms=12, label=f"{group}: Pareto front (ringed)")
        for j in keep:
            seq = recs[j].is_sequential
            ax.scatter(*pts[j], color=color, marker="*" if seq else "o", s=140 if seq else 30, zorder=3,
                       label=f"{group} (star: sequential)" if seq else None)
            ax.annotate(recs[j].plan, pts[j], textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color=color)
            ppls.append(pts[j][1])
    ax.axvline(1.0, color="gray", ls=":", lw=1)
    ax.margins(x=0.12, y=0.08)  # room for the point labels
    if ppls and max(ppls) > 3 * min(ppls):
        ax.set_yscale("log")
    else:
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax.set_xlabel("measured speedup vs sequential (decode, batch 1)")
    ax.set_ylabel("validation PPL (lower is better)")
    ax.set_title(title or "SNLP speed-quality frontier")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    print(f"wrote {path}")

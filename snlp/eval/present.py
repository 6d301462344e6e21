"""Presentation of evaluation records (snlp.eval.protocol.EvalRecord): the terminal table, the markdown
table of the paper's main-table columns, CSV and the speed-quality frontier plot. No computation
beyond formatting and the Pareto front."""

from __future__ import annotations

import csv
from pathlib import Path

from snlp.eval.protocol import EvalRecord
from snlp.runtime.device import write_atomic
from snlp.runtime.fmt import fmt_delta_ppl, fmt_ppl

COLUMNS = (  # (header, field, format string or formatter) of the tables; PPL / ΔPPL: snlp.runtime.fmt's rule
    ("Plan", "plan", "{}"), ("K", "K", "{}"), ("PPL", "ppl", fmt_ppl), ("ΔPPL", "delta_ppl", fmt_delta_ppl),
    ("Speedup", "speedup", "{:.2f}x"), ("Prefill", "prefill_speedup", "{:.2f}x"),
    ("Ideal (layers)", "ideal_layer_speedup", "{:.2f}x"), ("Top-1", "top1", "{:.1%}"),
    ("LogitSim", "logit_sim", "{:.3f}"), ("EmbSim", "emb_sim", "{:.3f}"), ("AR Match", "ar_match", "{:.1%}"),
    ("β̂", "ar_beta", "{:.4f}"))


def _cells(rec: EvalRecord) -> list[str]:
    vals = [getattr(rec, key) for _, key, _ in COLUMNS]
    cells = [fmt(v) if callable(fmt) else "-" if v is None else fmt.format(v) for v, (_, _, fmt) in zip(vals, COLUMNS)]
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
    fields = list(dict.fromkeys(k for r in rows for k in r))

    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows({k: ("" if r.get(k) is None else r[k]) for k in fields} for r in rows)

    write_atomic(path, write)
    print(f"wrote {path}")


def frontier_plot(groups: dict[str, list[EvalRecord]], path, title: str = "", xlabel: str = "",
                  fronts: dict[str, set[str]] | None = None, spreads: dict | None = None) -> None:
    """PNG of the speed-quality frontier (snlp.eval.frontier.frontier_figure): ΔPPL (%) vs measured speedup, one
    series per group with its Pareto front, e.g. {"No Reg.": records, "IDN Reg.": records}; the sequential
    run at (1.0x, 0 %), labels placed without overlaps, a symlog axis when ΔPPL spans decades, diverged and
    untimed plans listed in the legend instead of plotted."""
    from snlp.eval.frontier import frontier_figure

    fig = frontier_figure(groups, title, xlabel, fronts, spreads)
    path = Path(path)
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=150, format=path.suffix.lstrip(".").lower() or "png"))
    print(f"wrote {path}")

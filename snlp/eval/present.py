"""Presentation of evaluation records (snlp.eval.protocol.EvalRecord): the terminal table, the markdown
table of the paper's main-table columns, CSV and the speed-quality frontier plot. No computation
beyond formatting and the Pareto front."""

from __future__ import annotations

from pathlib import Path

from snlp.eval.protocol import EvalRecord
from snlp.runtime.device import write_atomic
from snlp.runtime.fmt import fmt_delta_ppl, fmt_ppl, fmt_share

COLUMNS = (  # (header, field, format string or formatter) of the tables; PPL / ΔPPL: snlp.runtime.fmt's rule
    ("Plan", "plan", "{}"), ("K", "K", "{}"), ("PPL", "ppl", fmt_ppl), ("ΔPPL", "delta_ppl", fmt_delta_ppl),
    ("Speedup", "speedup", "{:.2f}x"), ("Prefill", "prefill_speedup", "{:.2f}x"),
    ("Ideal (layers)", "ideal_layer_speedup", "{:.2f}x"), ("Top-1", "top1", fmt_share),
    ("LogitSim", "logit_sim", "{:.3f}"), ("EmbSim", "emb_sim", "{:.3f}"), ("AR Match", "ar_match", fmt_share),
    ("β̂", "ar_beta", "{:.3f}"), ("AR Match vs fused", "ar_match_fused", fmt_share))
# AR Match and β̂ are against the sequential model in every row; a fused plan's agreement with the same fused model
# run sequentially (the paper's reference for M > 1) has its own column, shown only when a record has it. β̂ to three
# decimals: from a few hundred greedy tokens its third decimal is already noise.
OPTIONAL = ("ar_match_fused",)


def columns(records: list[EvalRecord]) -> list[tuple]:
    """COLUMNS, without the optional ones no record fills."""
    return [c for c in COLUMNS if c[1] not in OPTIONAL or any(getattr(r, c[1]) is not None for r in records)]


_SPEEDUP_TIE = ("Speedup (the median of the paired per-round ratios) is not resolved by a two-sided sign test at 5 % "
                "over its rounds (6 of 6 at the fewest)")
TIE_NOTE = ("(tie): not told from sequential by this run: ΔPPL's 95 % paired-window interval includes 0; "
            + _SPEEDUP_TIE + ". Prefill: a ratio of medians, not tested")


_PREFILL_TIE = ("Prefill (the ratio of the two medians): likewise, by the sign test over the paired rounds of its "
                "teacher-forced forward; where those rounds resolve the other side of 1.00x from the two medians, the "
                "cell says so, e.g. (15 of 20 rounds below 1.00x)")


def tested(records: list[EvalRecord]) -> bool:
    """Whether ΔPPL has intervals in these records (the sequential row, first, holds two or more windows)."""
    return len((records[0].window_ce or []) if records else []) >= 2


def tie_note(records: list[EvalRecord]) -> str:
    """TIE_NOTE for these records: where the sequential row holds fewer than two validation windows (one window of
    --max-tokens, or records without per-window losses) no ΔPPL has an interval, so an unmarked ΔPPL was not told
    from sequential either, and the note says ΔPPL is untested rather than what a (tie) on it would mean. Records
    that keep Prefill's paired rounds (prefill_speedup_rounds) have it tested too; older ones say it is not."""
    n = len((records[0].window_ce or []) if records else [])
    prefill = any(r.prefill_speedup_rounds for r in records[1:])
    note = TIE_NOTE if n >= 2 else (f"(tie): not told from sequential by this run: {_SPEEDUP_TIE}. Prefill: a ratio "
                                    f"of medians, not tested")
    note = note.replace("Prefill: a ratio of medians, not tested", _PREFILL_TIE) if prefill else note
    # ΔPPL's clause last: Prefill's "likewise" reads back to the Speedup test, not to an untested ΔPPL
    why = "one validation window" if n == 1 else "no per-window losses"
    return note if n >= 2 else f"{note}. ΔPPL: untested ({why}: no interval, so no (tie) mark either way)"


def protocol_note(records: list[EvalRecord]) -> str:
    """What the table's columns measured, from the records' own protocol fields, for the note `snlp eval` writes under
    its table. Its Speedup is not the paper's: the paper's evaluator (nanochat-snlp snlp/eval_snlp.py, `bench`) times a
    batch-1 teacher-forced forward over its 2048-token window, the mean of 150 calls, which is this table's Prefill
    (over --seq-len tokens, a ratio of medians); a reader comparing with the paper's Speedup column must read Prefill.
    EmbSim's encoder differs from the paper's too (snlp.eval.embsim)."""
    if not records:
        return ""
    r = records[0]
    parts = []
    if r.seq_len and r.tokens:
        parts.append(f"PPL (token-weighted), ΔPPL (relative to sequential), Top-1 and LogitSim (vs the sequential "
                     f"logits, cosine over the vocabulary) over {r.tokens // r.seq_len} "
                     f"window{'' if r.tokens // r.seq_len == 1 else 's'} of {r.seq_len} tokens "
                     f"({r.tokens:,} predicted tokens)")
    if r.prompts and r.gen_tokens:
        parts.append(f"AR Match and β̂ over {r.prompts} prompts x {r.gen_tokens} greedy tokens vs the sequential model "
                     "(each token a forward over the whole prefix, the paper's AR loop)")
    rounds = next((len(x.speedup_rounds) for x in records[1:] if x.speedup_rounds), None)
    parts.append("Speedup: KV-cached greedy decode ms/token at batch 1 (prefill not timed), the median of the paired "
                 "per-round ratios" + (f" over {rounds} rounds" if rounds else ""))
    parts.append(f"Prefill: a batch-1 forward over {r.seq_len or '--seq-len'} tokens, the ratio of the two medians; "
                 f"the paper's Speedup column times this forward (over 2048 tokens, the mean of 150 calls): compare "
                 f"it with Prefill, not Speedup")
    if any(x.emb_sim is not None for x in records):
        parts.append("EmbSim: all-MiniLM-L6-v2 on the decoded continuations (the paper: BGE-small-en-v1.5 on "
                     "'Continuation of \"prompt\": continuation'), not comparable in value")
    return "Protocol: " + "; ".join(parts) + "."


def _cells(rec: EvalRecord, cols=COLUMNS, ties: dict | None = None, tested: bool = False) -> list[str]:
    """A row's cells. `tested`: the sequential row holds two or more windows, so every ΔPPL not marked (tie) was
    told from zero by its interval (fmt_delta_ppl's `resolved`)."""
    vals = [getattr(rec, key) for _, key, _ in cols]
    cells = [fmt(v) if callable(fmt) else "-" if v is None else fmt.format(v) for v, (_, _, fmt) in zip(vals, cols)]
    if ties is not None and tested and len(rec.window_ce or []) >= 2 and rec.plan not in ties.get("delta_ppl", ()):
        cells = [fmt_delta_ppl(rec.delta_ppl, resolved=True) if key == "delta_ppl" else c
                 for c, (_, key, _) in zip(cells, cols)]
    for i, (_, key, _) in enumerate(cols):  # the fused agreement names its reference; K = C is the reference itself
        if key == "ar_match_fused" and rec.ar_match_fused is not None and rec.ar_fused_reference:
            cells[i] = ("= itself (K = C)" if rec.ar_fused_reference == rec.plan
                        else f"{cells[i]} vs {rec.ar_fused_reference}")
        marks = (ties or {}).get(key, ())  # a set of plans marked (tie), or {plan: its own mark}
        if rec.plan in marks:
            cells[i] += marks[rec.plan] if isinstance(marks, dict) else " (tie)"
    if rec.note:
        cells[0] += f" ({rec.note})"
    return cells


def markdown_table(records: list[EvalRecord], ties: dict[str, set[str]] | None = None) -> str:
    """The records as a GitHub markdown table (the paper's main-table columns, '-' where empty). `ties`: field
    ("delta_ppl", "speedup") -> the plans whose value this run does not tell from sequential, marked "(tie)" with
    TIE_NOTE under the table, or -> {plan: its own mark} ("prefill_speedup": snlp.apps.report.record_ties) (None: no
    marks and no note)."""
    cols = columns(records)
    lines = ["| " + " | ".join(h for h, _, _ in cols) + " |",
             "|" + "|".join(":---" if i == 0 else "---:" for i in range(len(cols))) + "|"]
    lines += ["| " + " | ".join(_cells(r, cols, ties, tested(records))) + " |" for r in records]
    return "\n".join(lines) + "\n" + ("" if ties is None else f"\n{tie_note(records)}\n")


def print_table(records: list[EvalRecord], title: str, ties: dict[str, set[str]] | None = None) -> None:
    """The records as a rich table on the terminal (`ties` as for markdown_table)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=None if ties is None else tie_note(records))
    cols = columns(records)
    for header, _, _ in cols:
        table.add_column(header, justify="left" if header == "Plan" else "right")
    for r in records:
        table.add_row(*_cells(r, cols, ties, tested(records)))
    Console(width=200).print(table)


def write_csv(rows: list[dict], path, partial: str | None = None, announce: bool = True) -> None:
    """Rows (e.g. EvalRecord.to_dict()) as CSV: columns in first-seen order, cells by snlp.runtime.outputs.csv_cell
    as snlp.bench.records.write_csv writes them (empty for None and NaN; lists and dicts, e.g. window_ce,
    speedup_rounds, the CLI's `load`, as strict JSON: csv wrote a dict's Python repr, {'start': 0.5, ...}, which
    json.loads refuses). `partial`: what the rows of a run still going are; the file then starts with
    snlp.runtime.outputs.partial_comment's line."""
    from snlp.runtime.outputs import partial_comment, write_csv_rows

    fields = list(dict.fromkeys(k for r in rows for k in r))

    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            if partial is not None:
                f.write(partial_comment(partial) + "\n")
            write_csv_rows(f, fields, ({k: r.get(k) for k in fields} for r in rows))

    write_atomic(path, write)
    if announce:
        print(f"wrote {path}")


def frontier_plot(groups: dict[str, list[EvalRecord]], path, title: str = "", xlabel: str = "",
                  fronts: dict[str, set[str]] | None = None, spreads: dict | None = None,
                  intervals: dict | None = None, announce: bool = True) -> None:
    """PNG of the speed-quality frontier (snlp.eval.frontier.frontier_figure): ΔPPL (%) vs measured speedup, one
    series per group with its Pareto front, e.g. {"No Reg.": records, "IDN Reg.": records}; the sequential
    run at (1.0x, 0 %), labels placed without overlaps, a symlog axis when ΔPPL spans decades (its linear part covering the
    `intervals` when given), diverged and
    untimed plans listed in the legend instead of plotted."""
    from snlp.eval.frontier import frontier_figure

    fig = frontier_figure(groups, title, xlabel, fronts, spreads, intervals)
    path = Path(path)
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=150, format=path.suffix.lstrip(".").lower() or "png"))
    if announce:
        print(f"wrote {path}")

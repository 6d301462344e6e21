"""Writing benchmark records: one writer per format (JSON, CSV, markdown).

A record is a dataclass with a `to_dict()` (ForwardRow, DecodeRow, OpRow, SuiteRow, the distributed rows):
`to_dict()` fixes its JSON keys, and every format below is written from those dicts, so a file in any
format carries the same keys as the JSON.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Protocol

from snlp.runtime.device import json_text, write_atomic


class Record(Protocol):
    def to_dict(self) -> dict: ...


def _plain(obj: Any) -> Any:
    """json.dumps' fallback: a record by its to_dict(), any other dataclass (a config) by its fields."""
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def write_json(path, payload: Any, announce: bool = True) -> None:
    """Write records (a list of them, or a dict holding them, e.g. {"meta", "config", "records"}) as JSON,
    creating parent folders; `announce` prints where (the CLI's commands do, the suite's library call not)."""
    write_atomic(path, json_text(payload, default=_plain, indent=2))  # strict JSON: a NaN field is null
    if announce:
        print(f"wrote {path}")


def write_csv(path, records: Iterable[Record], announce: bool = True, partial: str | None = None) -> None:
    """Write records as CSV, one row each; the columns are every key of any record, in order of first
    appearance (rows of different kinds leave the others' columns empty). Cells by snlp.runtime.outputs.csv_cell:
    nested values (lists, dicts) as strict JSON, None and NaN empty. `partial`: what the rows of a run still going
    are; the file then starts with snlp.runtime.outputs.partial_comment's line."""
    from snlp.runtime.outputs import partial_comment, write_csv_rows

    rows = [r.to_dict() for r in records]
    columns = list(dict.fromkeys(k for row in rows for k in row))

    def write(tmp: Path) -> None:
        with tmp.open("w", newline="") as f:
            if partial is not None:
                f.write(partial_comment(partial) + "\n")
            write_csv_rows(f, columns, rows)  # nested cells as strict JSON, NaN empty (csv_cell)

    write_atomic(path, write)
    if announce:
        print(f"wrote {path}")


@dataclasses.dataclass
class _Row:
    """A record's dict with keys added (write_records' `load`)."""

    row: dict

    def to_dict(self) -> dict:
        return self.row


def write_records(records: list, json_path: str | None = None, csv_path: str | None = None,
                  load: dict | None = None, extra: dict | None = None) -> None:
    """A command's --json / --csv outputs (either may be None: not asked for). `load`: the load window its timings
    ran in (snlp.runtime.load.LoadWindow.to_json), added to every row as its `load` (the files are lists of rows);
    `extra`: fields every row shares that its record type does not carry (e.g. where its settings came from)."""
    if load is not None or extra:
        records = [_Row({**r.to_dict(), **(extra or {}), **({} if load is None else {"load": load})})
                   for r in records]
    if json_path:
        write_json(json_path, records)
    if csv_path:
        write_csv(csv_path, records)


def markdown_table(columns: list[str], rows: Iterable[list[str]]) -> list[str]:
    """A markdown table's lines: header, separator, one line per row of already-formatted cells."""
    line = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    return [line(columns), "|" + "---|" * len(columns), *(line(r) for r in rows)]


def marked_partial(path) -> bool:
    """Whether a suite's file says it was written before the run ended: its JSON's "complete": false, its markdown's
    PARTIAL line (snlp.runtime.outputs.partial_line), its CSV's first line (partial_comment)."""
    path = Path(path)
    text = path.read_text(errors="replace")
    if path.suffix == ".csv":
        return text.startswith("# PARTIAL")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError:
            return True
        return isinstance(data, dict) and data.get("complete") is False
    return "**PARTIAL**" in text

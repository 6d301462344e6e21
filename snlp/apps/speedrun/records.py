"""Stage records: each finished stage written atomically into OUT/stages/NAME.json, reused by a re-run made with the
same settings."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import time
from datetime import datetime
from pathlib import Path

import torch

from snlp.apps.report import fmt_s
from snlp.runtime.device import json_text, write_atomic
from snlp.runtime.load import load_average


def canon(obj):
    """The strict JSON round trip (json_text: NaN -> null, inf -> "inf"; tuples -> lists), so that stored and fresh
    settings compare equal and a stage's result in memory is the one its record holds on disk (a stage ran now and one
    reused read alike, by the report too)."""
    return json.loads(json_text(obj, sort_keys=True))


def digest(obj) -> str:
    return hashlib.sha256(json_text(obj, sort_keys=True).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 of snlp's own source (every module of the package but the report's renderer, snlp.apps.report): a stage
    record is reused only by the code that made it, so a re-run after an upgrade or an edit does not print results
    of the earlier code beside those of the new (a tokenizer stage's counts, an evaluation's PPLs). The report is
    rendered anew by every invocation from the records, so its renderer is left out: editing it re-renders."""
    import snlp

    root = Path(snlp.__file__).parent
    skip = {root / "apps" / "report.py"}
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        if f not in skip:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def keyed(settings: dict) -> dict:
    """The settings a stage record stores and a re-run must match: the stage's own, and the code that ran it."""
    return canon({**settings, "snlp_code": code_digest()})


def write_json(path: Path, obj) -> None:
    write_atomic(path, json_text(obj, default=str, indent=2))  # strict JSON: a diverged PPL is "inf", NaN null


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def intra_op_threads(n: int):
    """torch intra-op threads = n inside the block (n = 0: unchanged). Batch-1 decoding is latency
    bound: on a 2-core box a second thread only adds contention, and under load it is far slower."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@dataclasses.dataclass
class StageRecord:
    """What a finished stage left in OUT/stages/NAME.json: the settings it was made with (compared on a
    re-run), its JSON result, its wall time and when / under what load it ran. `status` (ran / reused)
    belongs to this invocation and is not stored."""

    stage: str
    settings: dict
    result: dict
    seconds: float
    finished: str
    load_start: float | None = None
    load_end: float | None = None
    id: str = ""  # digest of settings, finish time and seconds: a stage made from this one names it
    planned: float | None = None  # the seconds the budget planned for it when it started (snlp.bench.budget)
    shrunk: str = ""  # what the budget shrank to keep the total ("prompts 8 -> 5, ..."; "" = nothing)
    scale: float | None = None  # the budget's scale it ran at (None: not budgeted, or an older record)
    # it ran at its cost model's min_scale, so nothing of it could shrink further (a stage whose min_scale is 1
    # shrinks nothing: early exit); None: not budgeted, or an older record. The report's stage table marks it
    floor: bool | None = None
    status: str = "ran"

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        del d["status"]
        return d

    @classmethod
    def from_json(cls, d) -> "StageRecord | None":
        """The record in a stored JSON object; None for anything else (a corrupt or older file is redone)."""
        need = ("stage", "settings", "result", "seconds", "finished", "id")
        if not (isinstance(d, dict) and all(k in d for k in need)):
            return None
        return cls(**{k: d[k] for k in need}, load_start=d.get("load_start"), load_end=d.get("load_end"),
                   planned=d.get("planned"), shrunk=d.get("shrunk", ""), scale=d.get("scale"), floor=d.get("floor"),
                   status="reused")


class Stages:
    """Runs named stages; a stage whose stored record has the same settings is reused."""

    def __init__(self, out: Path, force: bool, total: int, console, t0: float | None = None):
        self.dir, self.force, self.total, self.console = out / "stages", force, total, console
        self.t0 = time.perf_counter() if t0 is None else t0  # the run's clock (perf_counter at its start)
        self.records: dict[str, StageRecord] = {}  # this invocation's stages, in the order they finished
        self.running: dict[str, tuple[float, float | None]] = {}
        self.notes: dict[str, dict] = {}  # name -> {"planned", "shrunk", "scale", "floor"}: the budget's, by finish

    @property
    def ran(self) -> list[str]:
        return [n for n, r in self.records.items() if r.status == "ran"]

    @property
    def reused(self) -> list[str]:
        return [n for n, r in self.records.items() if r.status == "reused"]

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def elapsed(self) -> str:
        return fmt_s(time.perf_counter() - self.t0)

    def peek(self, name: str, settings: dict, outputs: list[Path] = ()) -> StageRecord | None:
        """The stored record of `name` if it was made with `settings` and its `outputs` still exist (and not
        --force), else None; nothing is registered or printed (lookup does that)."""
        rec = None if self.force else StageRecord.from_json(read_json(self.path(name)))
        if not (rec is not None and rec.settings == keyed(settings) and all(Path(o).exists() for o in outputs)):
            return None
        return rec

    def lookup(self, name: str, settings: dict, outputs: list[Path] = ()) -> StageRecord | None:
        """The stored record of `name` if it was made with `settings` and its `outputs` still exist
        (and not --force), else None."""
        rec = self.peek(name, settings, outputs)
        if rec is None:
            return None
        self.console.print(f"[dim][{self.number()}/{self.total}] reusing {name}[/dim] (made {rec.finished} in "
                           f"{fmt_s(rec.seconds)}; elapsed {self.elapsed()})")
        self.records[name] = rec
        return rec

    def number(self) -> int:
        return len(self.records) + len(self.running) + 1

    def begin(self, name: str, desc: str) -> None:
        self.console.rule(f"[bold][{self.number()}/{self.total}] {name}[/bold]: {desc} (elapsed {self.elapsed()})")
        self.running[name] = (time.perf_counter(), load_average())

    def finish(self, name: str, settings: dict, result: dict, seconds: float | None = None,
               ended: tuple[str, float | None] | None = None) -> StageRecord:
        """Store stage `name`'s record; `ended`: (finish time, load average) taken when its work ended, for a stage
        recorded later than that (side-by-side training waits for both runs), else both are taken now."""
        t, load0 = self.running.pop(name)
        seconds = time.perf_counter() - t if seconds is None else seconds
        finished, load1 = ended or (datetime.now().astimezone().isoformat(timespec="seconds"), load_average())
        rec = StageRecord(stage=name, settings=keyed(settings), result=canon(result), seconds=seconds,
                          finished=finished, load_start=load0, load_end=load1, **self.notes.pop(name, {}))
        rec.id = digest([rec.settings, rec.finished, seconds])
        write_json(self.path(name), rec.to_json())
        self.console.print(f"[green]{name} done[/green] in {fmt_s(seconds)} (elapsed {self.elapsed()})")
        self.records[name] = rec
        return rec

    def run(self, name: str, desc: str, settings: dict, fn, outputs: list[Path] = ()) -> StageRecord:
        """Reuse the stored record of `name` if its settings match (lookup), else run fn() -> result
        and store it."""
        rec = self.lookup(name, settings, outputs)
        if rec is not None:
            return rec
        self.begin(name, desc)
        try:
            result = fn()
        except BaseException:
            self.running.pop(name, None)
            raise
        return self.finish(name, settings, result)

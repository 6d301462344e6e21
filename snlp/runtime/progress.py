"""Progress for streams that are not terminals (CI logs, `> file`, pytest's capture): a tqdm bar there
writes one carriage-return update per step, thousands of '\\r' fragments that a log viewer shows as one
endless line or as thousands of lines. LineProgress prints whole lines instead: one every `interval`
seconds while the work runs and one when it ends, with the same calls the project makes on a tqdm bar
(update, set_postfix, write, close, context manager)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

LOG_INTERVAL = 30.0  # seconds between status lines in a log: frequent enough to show a stage is alive


def is_terminal(stream) -> bool:
    """Whether `stream` is an interactive terminal (a live bar makes sense there and nowhere else)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


@dataclass
class LineProgress:
    """A tqdm-compatible progress reporter that writes plain lines to `file`: 'desc: n/total (p%) 12s',
    at most one per `interval` seconds, plus one when closed (the stage's total time: 'done in' where it reached
    its total, 'stopped after' where it was closed short of it)."""

    total: int | None
    desc: str
    file: TextIO
    interval: float = LOG_INTERVAL
    n: int = 0
    postfix: str = ""
    start: float = field(default_factory=time.perf_counter)
    last: float = field(default=0.0)
    closed: bool = False

    def __post_init__(self):
        self.last = self.start

    def _line(self, done: bool = False) -> str:
        frac = f" ({self.n / self.total:.0%})" if self.total else ""
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        secs = time.perf_counter() - self.start
        tail = f" | {self.postfix}" if self.postfix else ""
        if done and self.total is not None and self.n < self.total:  # closed short of its total (Ctrl-C, a
            return f"{self.desc}: {count}{frac} stopped after {secs:.1f}s{tail}"  # budget, an early end): not done
        return f"{self.desc}: {count}{frac} {'done in' if done else 'at'} {secs:.1f}s{tail}"

    def _emit(self, msg: str) -> None:
        print(msg, file=self.file, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self.last >= self.interval:
            self.last = now
            self._emit(self._line())

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def write(self, msg: str, file=None, end: str = "\n") -> None:
        """A message, to stdout unless `file` says otherwise: where tqdm.write puts it (callers rely on that)."""
        print(msg, file=file or sys.stdout, end=end, flush=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._emit(self._line(done=True))

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

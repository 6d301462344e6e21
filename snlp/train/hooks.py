"""How a caller steers `fit`'s loop from outside the library without the library knowing the mechanism
(snlp speedrun's lockstep, `snlp train --stop-file`: files, built in snlp.apps)."""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

# A stop check: given the number of optimizer steps done, None to go on or the reason to end the run
# (saved after that step; the reason is logged with the step and becomes TrainResult.stopped_by).
StopCheck = Callable[[int], "str | None"]


@dataclass
class TrainHooks:
    """Callbacks `fit` asks on rank 0 only; under DDP rank 0's answer is broadcast, so all ranks agree.

    should_stop(steps_done): asked before the first step and after every step, after the step's
    statistics are reduced and before the step is logged, so a log reader sees the step and the
    decision together. The run's own limits (budget, stop_after) are asked first.
    before_step(steps_done): asked before each step in a single-process run (DDP: skipped, a rank
    waiting alone would stall the others' collectives); it may block (e.g. until a lockstep peer catches
    up) and, like should_stop, returns a reason to end the run instead of starting the step."""

    should_stop: StopCheck | None = None
    before_step: StopCheck | None = None


def with_stop(hooks: TrainHooks, check: Callable[[], str | None]) -> TrainHooks:
    """`hooks` with one more stop reason, `check()`, asked before the hooks' own (after every step and before the
    next; rank 0's answer is broadcast like theirs, so under DDP every rank stops at the same step)."""
    def stop(inner: StopCheck | None) -> StopCheck:
        return lambda steps_done: check() or (inner(steps_done) if inner is not None else None)

    return TrainHooks(should_stop=stop(hooks.should_stop), before_step=stop(hooks.before_step))


class InterruptStop:
    """A stop check that answers "interrupt" once Ctrl-C (SIGINT) was pressed while `armed`. Armed, the first
    Ctrl-C does not raise: the loop ends after the step in progress, logs it, validates and saves (a
    KeyboardInterrupt in the middle of an optimizer step would leave half-updated weights and nothing saved); a
    second Ctrl-C raises KeyboardInterrupt at once. Outside the main thread (no signal handlers there) it never
    fires."""

    def __init__(self):
        self.hit = False

    def __call__(self) -> str | None:
        return "interrupt" if self.hit else None

    def _handler(self, signum, frame):
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True
        print("\ninterrupt: finishing the current step and saving the checkpoint (Ctrl-C again to abort without "
              "saving)", file=sys.stderr, flush=True)

    @contextmanager
    def armed(self) -> Iterator[None]:
        try:
            previous = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread
            yield
            return
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

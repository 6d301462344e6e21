"""How a caller steers `fit`'s loop from outside the library without the library knowing the mechanism
(snlp speedrun's lockstep, `snlp train --stop-file`: files, built in snlp.apps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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

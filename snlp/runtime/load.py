"""The machine's load around a timing: the one reader of the load average and of the cores this process may use,
and the two lines a timed command prints from them.

A CPU timing on a shared box measures the box as much as the code: with more runnable threads than cores, each
thread gets a share of a core, and torch's OpenMP workers, which meet at a barrier after every parallel op, wait
for the slowest of them (a 2-thread decode on 2 cores under other jobs ran 20x slower than idle, with its rounds
spread over +-176 %). Nothing here changes a timing; a command samples the load before and after it
(`LoadWindow.begin` / `close`, never inside a timed loop), records the window in its JSON and, where the load is
more than its own threads explain, says so beside its numbers (`contention_note`).

The 1-min load average is the kernel's exponentially damped count of runnable (and uninterruptible) tasks over the
whole machine; it lags a command's start by tens of seconds, so a command's own threads may not show in it yet:
subtracting them anyway only makes the note rarer, never a false alarm. The average counts every core of the
machine while `cores` counts this process's (its affinity and cgroup quota): in a container given a few cores of a
larger host, other containers' load on the other cores can raise the note where this process's cores were free.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

# others' load below this is within the 1-min average's wander on an idle box (a shell, the kernel's own threads)
SLACK = 0.5
CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
CFS = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")  # cgroup v1 (-1: no quota)


def load_averages() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 min load averages (two decimals, as /proc/loadavg writes them); None where the platform has
    none (os.getloadavg is missing on Windows and raises OSError where it cannot be read)."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except (OSError, AttributeError):
        return None


def load_average() -> float | None:
    """The 1-min load average; None where there is none."""
    loads = load_averages()
    return None if loads is None else loads[0]


def _cgroup_quota() -> float | None:
    """The cgroup's CPU quota in cores (quota / period), None when unlimited or unreadable."""
    try:
        with open(CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(CFS[0]) as q, open(CFS[1]) as p:
            quota, period = int(q.read()), int(p.read())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (os.sched_getaffinity, else os.cpu_count), capped by its
    cgroup's CPU quota rounded up (a quota of 1.5 cores lets two threads run, throttled)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(n, math.ceil(quota))) if quota else max(1, n)


@dataclass
class LoadWindow:
    """The 1-min load average when a timing began (`start`), ended (`end`) and the highest of every sample taken
    between (`peak`, with start and end), and the cores the process could use (`cores`). None: no load average on
    this platform."""

    start: float | None
    end: float | None = None
    peak: float | None = None
    cores: int = 1

    @classmethod
    def begin(cls) -> "LoadWindow":
        start = load_average()
        return cls(start=start, peak=start, cores=usable_cores())

    def sample(self) -> "LoadWindow":
        """Take one more sample into the peak (between timed parts, never inside one)."""
        self._peak(load_average())
        return self

    def close(self) -> "LoadWindow":
        self.end = load_average()
        self._peak(self.end)
        return self

    def _peak(self, x: float | None) -> None:
        if x is not None:
            self.peak = x if self.peak is None else max(self.peak, x)

    def to_json(self) -> dict:
        return asdict(self)

    def note(self, own: float) -> str | None:
        return contention_note(self, own)


def own_threads(threads, device="cpu") -> int:
    """The threads a timed command keeps busy: the most of the torch thread counts it times with on a CPU; on a GPU
    one, the host thread that launches kernels."""
    return max(threads, default=1) if is_cpu(device) else 1


def is_cpu(device) -> bool:
    """Whether `device` (a torch.device, or its name / type: "cpu", "cuda:0") is the CPU."""
    return getattr(device, "type", str(device).split(":")[0]) == "cpu"


def contention_note(window: LoadWindow, own: float) -> str | None:
    """One sentence when the timings of `window` were contended: its peak load is more than the cores, and more
    (by SLACK) than what the command's own busy threads or processes (`own`) explain; else None (also where the
    platform has no load average)."""
    if window.peak is None:
        return None
    others = window.peak - own
    if others < SLACK or window.peak <= window.cores:
        return None
    return (f"timings contended: the 1-min load average reached {window.peak:.2f} on {window.cores} "
            f"core{'s' if window.cores != 1 else ''}, {others:.1f} more than this command's own {own:g} busy "
            f"thread{'s' if own != 1 else ''} explain: other work shared the cores, so these times are slower and "
            f"noisier than on an idle machine")


CALLER = 1.0  # the command's own thread, busy loading the model and data until the timing began: in the average


def free_cores(window: LoadWindow) -> int | None:
    """The cores left free by other work when the window began: cores - (load - CALLER), rounded (None without a
    load average). The 1-min average still holds the command's own preparation (a minute of loading data on an
    idle 2-core box reads 0.95), which would otherwise warn the command about itself."""
    if window.start is None:
        return None
    return max(0, round(window.cores - max(0.0, window.start - CALLER)))


def oversubscription_note(threads: int, window: LoadWindow, remedy: str | None = "--threads 1") -> str | None:
    """One sentence, said before timing, when `threads` torch threads exceed the cores left free (free_cores):
    OpenMP's workers meet at a barrier after every parallel op, so a worker without a core stalls the others.
    `remedy`: the setting that times with one thread (None: the command has none). One thread is never warned of:
    it waits on no other."""
    free = free_cores(window)
    if free is None or threads <= 1 or threads <= free:
        return None
    return (f"about to time with {threads} torch threads on {free} free core{'s' if free != 1 else ''} "
            f"({window.cores} cores, 1-min load average {window.start:.2f}): OpenMP threads will wait on each other "
            f"and the timings collapse" + (f"; {remedy} times with one" if remedy else ""))

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
larger host, other containers' load on the other cores can raise the note where this process's cores were free. The
window records the machine's CPUs too (`machine_cpus`), and both sentences say so in one clause where they exceed
`cores`.

A command's own threads are every thread it keeps busy on this machine: under torchrun, every local rank's
(`ranks_threads`), since the ranks time together and all of them are in the machine's load.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict, dataclass

# others' load below this is within the 1-min average's wander on an idle box (a shell, the kernel's own threads):
# no contention is said below it, and before timing other work takes a core from this much of one on (free_cores)
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


def machine_cpus() -> int | None:
    """The machine's logical CPUs (os.cpu_count: every CPU the kernel runs, whatever this process's affinity or
    quota), the CPUs the load average counts runnable tasks over; None where it cannot tell."""
    return os.cpu_count()


@dataclass
class LoadWindow:
    """The 1-min load average when a timing began (`start`), ended (`end`) and the highest of every sample taken
    between (`peak`, with start and end), the cores the process could use (`cores`) and the machine's CPUs
    (`machine_cpus`, which the load average counts; None: not known, or a file written before it was recorded).
    None loads: no load average on this platform."""

    start: float | None
    end: float | None = None
    peak: float | None = None
    cores: int = 1
    machine_cpus: int | None = None

    @classmethod
    def begin(cls, cores: int | None = None) -> "LoadWindow":
        """Sample the start. `cores`: the cores the command may use where this process's own affinity no longer
        tells them (a torchrun rank pinned to one core by --pin; None: usable_cores())."""
        start = load_average()
        return cls(start=start, peak=start, cores=usable_cores() if cores is None else cores,
                   machine_cpus=machine_cpus())

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
    one, the host thread that launches kernels. Under torchrun, every local rank's: `ranks_threads`."""
    return max(threads, default=1) if is_cpu(device) else 1


def ranks_threads(ranks: list[tuple[str, int]], host: str) -> tuple[int, int]:
    """(the busy threads, the ranks) of a torchrun job on `host`: `ranks` holds every rank's (host name, own_threads);
    the ranks on other hosts load other machines' averages, not this one's."""
    here = [n for h, n in ranks if h == host]
    return sum(here), len(here)


def is_cpu(device) -> bool:
    """Whether `device` (a torch.device, or its name / type: "cpu", "cuda:0") is the CPU."""
    return getattr(device, "type", str(device).split(":")[0]) == "cpu"


def _plural(n: float, word: str) -> str:
    return f"{n:g} {word}{'s' if n != 1 else ''}"


def machine_clause(window: LoadWindow) -> str:
    """Where the machine has more CPUs than the process may use, the clause that says the load average counts all
    of them (other work on CPUs this process cannot run on raises it too); else ''."""
    if window.machine_cpus is None or window.machine_cpus <= window.cores:
        return ""
    return f" (the load average counts the whole machine's {window.machine_cpus} CPUs)"


def contention_note(window: LoadWindow, own: float) -> str | None:
    """One sentence when the timings of `window` were contended: its peak load is more than the cores, and more
    (by SLACK) than what the command's own busy threads or processes (`own`) explain; else None (also where the
    platform has no load average)."""
    if window.peak is None:
        return None
    others = window.peak - own
    if others < SLACK or window.peak <= window.cores:
        return None
    return (f"timings contended: the 1-min load average reached {window.peak:.2f} on "
            f"{_plural(window.cores, 'core')}{machine_clause(window)}, {others:.1f} more than this command's own "
            f"{_plural(own, 'busy thread')} explain: other work shared the cores, so these times are slower and "
            f"noisier than on an idle machine")


# the command's own thread, busy loading the model and data until the timing began, in the 1-min average (a minute
# of loading data on an idle 2-core box reads 0.95); under torchrun, one per local rank. An upper bound: where the
# command started seconds ago the average holds less of it, and other work up to CALLER goes unseen before timing
# (the contention note after the timing, which subtracts the timed threads instead, still sees it)
CALLER = 1.0


def free_cores(window: LoadWindow, callers: int = 1, busy: float | None = None) -> int | None:
    """The cores left free by other work when the window began (None without a load average): the other work is
    the load less CALLER per caller (`callers`: the command's processes, its torchrun ranks on this machine), or
    less `busy` where the command kept more threads busy until the window began (train --time-reg times after its
    training loop, whose threads fill the 1-min average: subtracting one per rank warned an idle box about the
    run's own training), and it takes whole cores, rounded half up at SLACK (0.5 of other work takes a core, 0.49
    does not; never Python's half-to-even round, under which on 4 cores 0.5 of other work took no core and 1.5
    took two): cores - floor(others + SLACK)."""
    if window.start is None:
        return None
    own = CALLER * callers if busy is None else busy
    others = round(max(0.0, window.start - own), 2)  # two decimals, as the average is read
    return max(0, window.cores - math.floor(others + SLACK))


def oversubscription_note(threads: int, window: LoadWindow, remedy: str | None = "--threads 1",
                          ranks: int = 1, busy: float | None = None) -> str | None:
    """One sentence, said before timing, when `threads` torch threads exceed the cores left free (free_cores),
    with what it read (the load, the cores, the free ones) so a reader can judge it: OpenMP's workers meet at a
    barrier after every parallel op, so a worker without a core stalls the others. `ranks`: torchrun ranks on this
    machine whose threads `threads` sums (each waits on the others at every collective). `remedy`: the setting
    that times with one thread (None: the command has none). `busy`: the command's own busy threads before the
    window (free_cores; None: CALLER per rank). One thread is never warned of: it waits on no other."""
    free = free_cores(window, ranks, busy)
    if free is None or threads <= 1 or threads <= free:
        return None
    over = f" over {ranks} ranks" if ranks > 1 else ""
    return (f"about to time with {_plural(threads, 'torch thread')}{over}: 1-min load average {window.start:.2f} on "
            f"{_plural(window.cores, 'core')}{machine_clause(window)}, {free} free (other work: the load less "
            f"{CALLER * ranks if busy is None else busy:g} for this command's own "
            f"{'ranks' if ranks > 1 and busy is None else 'thread' if busy is None else 'busy threads'}, rounded half "
            f"up to whole cores): OpenMP threads will wait on each other and the timings collapse"
            + (f"; {remedy} times with one" if remedy else ""))


def warn_oversubscribed(threads, window: LoadWindow, device="cpu", remedy: str | None = "--threads 1",
                        ranks: int = 1, busy: float | None = None) -> str | None:
    """Say once on stderr, before any timing, the oversubscription sentence of a command about to time with
    `threads` (the torch thread counts it will time with; their most is what runs at once) on `device`; returns it
    (None: nothing to say). On a GPU the threads are not warned of (its host thread launches kernels; the intra-op
    workers stay idle). `busy`: oversubscription_note's. Nothing is refused or changed."""
    note = oversubscription_note(max(threads, default=1), window, remedy, ranks, busy) if is_cpu(device) else None
    if note:
        print(f"note: {note}", file=sys.stderr)
    return note


def begin_timing(threads, device="cpu", remedy: str | None = "--threads 1") -> LoadWindow:
    """The load window of a command about to time (LoadWindow.begin), having said once on stderr, before any timing,
    where its torch threads (`threads`: the counts it will time with) exceed the cores left free
    (warn_oversubscribed). `remedy`: the command's option that times with one thread (None: it has none). A timing
    that begins and ends in one place uses Timed, which calls this."""
    window = LoadWindow.begin()
    warn_oversubscribed(threads, window, device, remedy)
    return window


def say_contention(window: LoadWindow, own: float, what: str = "") -> str | None:
    """Print the contention sentence of a closed `window` (contention_note), prefixed by `what` (e.g. "stage 1: "),
    where the load was more than the command's `own` busy threads explain; returns it (None: not contended)."""
    note = contention_note(window, own)
    if note:
        print(f"{what}{note}")
    return note


@dataclass
class Timed:
    """The load around one timed part of a command: `with Timed(threads, device) as t:` samples the start and says
    the oversubscription sentence (begin_timing) on entry, closes the window on exit (right after the timed
    code, before any table is printed); `t.say()` then prints the contention line and `t.window.to_json()` is the
    record's `load`. `threads`: the torch thread counts it times with (own_threads)."""

    threads: tuple
    device: object = "cpu"
    remedy: str | None = "--threads 1"
    window: LoadWindow | None = None

    def __post_init__(self):
        self.threads = tuple(self.threads)

    def __enter__(self) -> "Timed":
        self.window = begin_timing(self.threads, self.device, self.remedy)
        return self

    def __exit__(self, *exc) -> None:
        self.window.close()

    def say(self, what: str = "") -> str | None:
        return say_contention(self.window, own_threads(self.threads, self.device), what)

    def to_json(self) -> dict:
        return self.window.to_json()


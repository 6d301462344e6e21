"""How a caller steers `fit`'s loop from outside the library without the library knowing the mechanism
(snlp speedrun's lockstep, `snlp train --stop-file`: files, built in snlp.apps)."""

from __future__ import annotations

import errno
import os
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator

# A stop check: given the number of optimizer steps done, None to go on or the reason to end the run
# (saved after that step; the reason is logged with the step and becomes TrainResult.stopped_by).
StopCheck = Callable[[int], "str | None"]


# What a before_step hook returns while the step may not start yet (a lockstep gate still closed): the loop asks its
# stop checks (a signal's, the hooks') and then the hook again after TrainHooks.poll_s seconds.
WAIT = "wait"


@dataclass
class TrainHooks:
    """Callbacks `fit` asks on rank 0 only; under DDP rank 0's answer is broadcast, so all ranks agree.

    should_stop(steps_done): asked before the first step and after every step, after the step's
    statistics are reduced and before the step is logged, so a log reader sees the step and the
    decision together. The run's own limits (budget, stop_after) are asked first.
    before_step(steps_done): asked before each step in a single-process run (DDP: skipped, a rank
    waiting alone would stall the others' collectives); like should_stop it returns a reason to end the run
    instead of starting the step, None to start it, or WAIT to hold it (e.g. until a lockstep peer catches
    up): the loop then asks again every `poll_s` seconds, asking its own stop checks in between, so a signal
    ends the wait. A hook never blocks itself.

    pass_late_signal: a signal that arrives after the loop's last stop check (during the last step, the final
    validation or the save) finds the run finished and saved. True: fit raises it again once its handlers are
    restored, so a program that goes on after fit (adapt writes its drafter, sft-grid trains its next run, a
    speedrun child reports) stops there. False: fit returns, TrainResult.late_signal naming it; a command whose work
    ends with the run (snlp train, snlp sft; snlp adapt, after its drafter) then says it finished and exits 0, so a
    requeue script that resumes on a status above 128 does not resume a finished run (its --resume is refused)."""

    should_stop: StopCheck | None = None
    before_step: StopCheck | None = None
    poll_s: float = 0.002
    pass_late_signal: bool = True


def with_stop(hooks: TrainHooks, check: Callable[[], str | None]) -> TrainHooks:
    """`hooks` with one more stop reason, `check()`, asked before the hooks' own (after every step, and before the
    next at every poll of a held step; rank 0's answer is broadcast like theirs, so under DDP every rank stops at
    the same step)."""
    def stop(inner: StopCheck | None) -> StopCheck:
        return lambda steps_done: check() or (inner(steps_done) if inner is not None else None)

    return replace(hooks, should_stop=stop(hooks.should_stop), before_step=stop(hooks.before_step))


# The signals a training run turns into "stop after this step and save" (InterruptStop): Ctrl-C (SIGINT); SIGTERM, what
# `kill`, `docker stop`, torchrun's shutdown and Slurm at a time limit or preemption send before SIGKILL; SIGHUP, the
# terminal closing; SIGUSR1 / SIGUSR2, what Slurm's `--signal` (Lightning: USR1, submitit: USR2) sends ahead of the
# limit. Each would otherwise end the process at once with nothing saved (their default action).
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
                     if hasattr(signal, n))
INTERRUPT = "interrupt"  # the stop reason of a run ended by one of them (TrainResult.stopped_by)


class Interrupted(KeyboardInterrupt):
    """A KeyboardInterrupt raised for `signum` (SIGINT or another STOP_SIGNALS member): `except KeyboardInterrupt`
    cleanups run as for Ctrl-C, and the command line exits with 128 + signum (snlp.apps.cli)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal_name(signum))
        self.signum = signum


def signal_number(name: str | None, default: int = signal.SIGINT) -> int:
    """The number of the signal `name` (TrainResult.signal: SIGTERM, ...); `default` where it names none (another DDP
    rank's signal stopped the run, or a hook's own "interrupt")."""
    return int(signal.Signals[name]) if name in signal.Signals.__members__ else int(default)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class InterruptStop:
    """A stop check that answers INTERRUPT once a STOP_SIGNALS signal arrived while `armed`. The first one does not
    raise: the loop ends after the step in progress and saves (a KeyboardInterrupt in the middle of an optimizer
    step would leave half-updated weights and nothing saved); `signum` records which one. Afterwards a Ctrl-C
    raises Interrupted at once (the person at the terminal asks to abort without saving), while a repeat of any
    other signal is ignored: Slurm signals every process of a job step, and torchrun forwards its own SIGTERM to
    its workers, so a process may get two without anyone asking twice. Outside the main thread (no signal
    handlers there) it never fires."""

    def __init__(self):
        self.signum: int | None = None

    @property
    def hit(self) -> bool:
        return self.signum is not None

    def __call__(self) -> str | None:
        return INTERRUPT if self.hit else None

    def _handler(self, signum, frame):
        if self.hit:
            if signum == signal.SIGINT:
                raise Interrupted(signum)
            return
        self.signum = signum
        if signum == getattr(signal, "SIGHUP", None):
            mute_hung_up_terminal()
        again = "Ctrl-C again" if signum == signal.SIGINT else "Ctrl-C"
        try:  # after SIGHUP the terminal may be gone: a failed write must not raise inside the step
            print(f"\n{signal_name(signum)}: finishing the current step and saving the checkpoint ({again} to abort "
                  f"without saving)", file=sys.stderr, flush=True)
        except (OSError, ValueError, RuntimeError):  # RuntimeError: the handler ran inside a write to stderr the
            pass  # main thread was blocked in (a full pipe): a reentrant write is refused

    @contextmanager
    def armed(self) -> Iterator[None]:
        with handled(STOP_SIGNALS, self._handler):
            yield


def mute_hung_up_terminal() -> None:
    """Point stdout and stderr at os.devnull where they are a terminal that hung up (SIGHUP: its window closed, an ssh
    session dropped): every write to it fails with EIO, so the prints that follow the stop (the last validation,
    the summary lines, the resume line) would raise after the save and before train_summary.json is written, and
    the command would exit 1 instead of 129."""
    try:
        import termios
    except ImportError:  # no terminals (Windows, where there is no SIGHUP either)
        return
    for fd in (1, 2):
        try:
            termios.tcgetattr(fd)
        except termios.error as e:  # EIO: a terminal that hung up (ENOTTY: a file or a pipe, left as it is)
            if e.args and e.args[0] == errno.EIO:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)
        except OSError:  # a closed descriptor
            pass


@contextmanager
def handled(signums, handler) -> Iterator[None]:
    """`handler` for each of `signums` during the block, the previous handlers restored after it; nothing in a
    thread other than the main one (signal handlers can only be set there). A signal the process was started
    ignoring stays ignored: `nohup` starts it with SIGHUP ignored so that closing the terminal does not end the
    run, and a shell starts a background job of a script with SIGINT ignored."""
    previous = {}
    try:
        for s in signums:
            if signal.getsignal(s) is signal.SIG_IGN:
                continue
            previous[s] = signal.signal(s, handler)
    except ValueError:  # not the main thread
        for s, h in previous.items():
            signal.signal(s, h)
        yield
        return
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def raise_interrupted(signum, frame):
    """A signal handler: raise Interrupted(signum), as Python's own SIGINT handler raises KeyboardInterrupt (a process
    that steers others, e.g. snlp speedrun's parent, then runs its cleanup: it asks its children to stop). After a
    hang-up the lines that cleanup and the command print go to os.devnull (mute_hung_up_terminal)."""
    if signum == getattr(signal, "SIGHUP", None):
        mute_hung_up_terminal()
    raise Interrupted(signum)


def raising_stops():
    """A context in which SIGTERM, SIGHUP and SIGUSR1/2 raise Interrupted as Ctrl-C raises KeyboardInterrupt (for a
    process with nothing to save at a step boundary: a measurement, snlp speedrun's parent), the first one only:
    Slurm signals every process of a job step and torchrun forwards its own SIGTERM, so a second may come while the
    first one's cleanup runs (stopping children, writing files, printing the line), and raising there would cut it
    short. Ctrl-C keeps Python's own handler (a second one aborts)."""
    fired: list[int] = []

    def once(signum, frame):
        if not fired:
            fired.append(signum)
            raise_interrupted(signum, frame)

    return handled([s for s in STOP_SIGNALS if s != signal.SIGINT], once)


@contextmanager
def deferred(signums=STOP_SIGNALS) -> Iterator[None]:
    """Hold back the `signums` signals that arrive during the block and deliver the first to the handler in place
    before it once the block is done: work that must follow `fit` (snlp adapt writes its drafter from the run fit
    saved) is not cut off by a signal that fit took after its last stop check and passed on (fit re-raises it once
    the run is saved). A Ctrl-C after a held signal raises at once, as a second Ctrl-C does in fit. Nothing is held
    outside the main thread."""
    held: list[int] = []

    def hold(signum, frame):
        if held and signum == signal.SIGINT:
            raise Interrupted(signum)
        if not held:
            held.append(signum)

    with handled(signums, hold):
        yield
    if held:
        signal.raise_signal(held[0])

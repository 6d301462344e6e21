"""Wall-clock timing done one way for every app: synchronise the device, then perf_counter; several
callables are timed round-robin (one call of each per round, after a warm-up) so that drift in the
machine's load hits them all alike, and callers report medians."""

from __future__ import annotations

import time

import torch


def sync(device) -> None:
    """Wait for queued device work (CUDA); a no-op on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def now(device) -> float:
    """perf_counter after the device's queued work has finished (seconds)."""
    sync(device)
    return time.perf_counter()


def mark(device):
    """A point in a loop's time that does not wait for the device: on CUDA an event recorded on the current stream
    (the host runs on), elsewhere perf_counter (CPU work is done when the call returns). Read two with `between`."""
    if torch.device(device).type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def between(start, end) -> float:
    """Seconds from mark `start` to mark `end`. On CUDA both events must have passed: call it after a host read of
    the device made after `end` (the loop's own read), which waited for them; before that CUDA raises "not ready"."""
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3


def time_round_robin(fns: dict, warmup: int, runs: int, device) -> dict[str, list[float]]:
    """Milliseconds per call for each callable, interleaved round-robin after `warmup` untimed rounds."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = now(device)
            fn()
            times[name].append((now(device) - t0) * 1e3)
    return times

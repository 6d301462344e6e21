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

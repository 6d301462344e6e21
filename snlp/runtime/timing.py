"""Wall-clock timing done one way for every app: synchronise the device, then perf_counter; several
callables are timed round-robin (one call of each per round, after a warm-up) so that drift in the
machine's load hits them all alike, and callers report medians. The order within a round changes from round
to round (`round_order`, a Williams design): a call right after another one finds the caches, allocator and clocks
as that one left them, so a fixed order, or a rotation of one (the same call always before), would read the
position's effect as the callable's."""

from __future__ import annotations

import time

import torch


def sync(device) -> None:
    """Wait for queued device work (CUDA, and other accelerators: MPS, XPU, ...); a no-op on CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type not in ("cpu", "meta"):
        torch.accelerator.synchronize(dev)


def now(device) -> float:
    """perf_counter after the device's queued work has finished (seconds)."""
    sync(device)
    return time.perf_counter()


def mark(device):
    """A point in a decode loop's time that does not wait for a CUDA device: an event recorded on `device`'s current
    stream (the host runs on). Elsewhere `now`: perf_counter on the CPU (its work is done when the call returns), after
    waiting for the device on another accelerator (MPS, XPU, ...). Read two with `between`."""
    dev = torch.device(device)
    if dev.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(dev))
        return ev
    return now(dev)


def between(start, end) -> float:
    """Seconds from mark `start` to mark `end`. On CUDA both events must have passed: call it after a host read of
    the device made after `end` (which waited for it), else CUDA refuses an event not yet completed."""
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3


def rotation(slot: int, n: int) -> list[int]:
    """The order of n callables in the `slot`-th round of a round-robin: the rows of a Williams design (a Latin square
    balanced for the call before; odd n takes its mirror rows too, 2n rows in all), relabelled so that slot 0 is
    0..n-1. Over S slots each callable runs at each position floor(S / n) or ceil(S / n) times, and over every
    n (even n) or 2n (odd n) slots right after each other one equally often. A plain rotation (slot + i) % n kept
    the cyclic order, so a callable always ran right after the same one (or first): with three, the cost the
    one before left (a cache it evicted) read as a 1.5x gap between two equal callables. A round that times
    several prompts counts a slot per prompt (slot = round x prompts + prompt)."""
    if n < 2:
        return list(range(n))
    first = [0] + [(i + 1) // 2 if i % 2 else n - i // 2 for i in range(1, n)]  # 0, 1, n-1, 2, n-2, ...
    label = {item: pos for pos, item in enumerate(first)}  # so that row 0 reads 0..n-1
    k = slot % (n if n % 2 == 0 else 2 * n)
    row = [(x + k) % n for x in first]
    if k >= n:  # odd n: the mirror rows
        row = [(x + k - n) % n for x in first][::-1]
    return [label[x] for x in row]


def round_order(items, slot: int) -> list:
    """`items` (a sequence, or a dict's keys) in the order of round `slot` of a round-robin (`rotation`); slot 0
    keeps their own order. Every paired or round-robin timing loop of snlp orders its calls with it."""
    items = list(items)
    return [items[i] for i in rotation(slot, len(items))]


def time_round_robin(fns: dict, warmup: int, runs: int, device, on_round=None) -> dict[str, list[float]]:
    """Milliseconds per call for each callable, interleaved round-robin after `warmup` untimed rounds, the
    order rotated round by round (`round_order`). `on_round()`, if given, is called after every round, warm-up
    included, outside the timed calls (a progress bar)."""
    for r in range(warmup):
        for name in round_order(fns, r):
            fns[name]()
        if on_round is not None:
            on_round()
    sync(device)
    times = {name: [] for name in fns}
    for r in range(runs):
        for name in round_order(fns, r):
            t0 = now(device)
            fns[name]()
            times[name].append((now(device) - t0) * 1e3)
        if on_round is not None:
            on_round()
    return times

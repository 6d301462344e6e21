"""Eager vs compiled `snlp train` steps, plain vs the IDN regulariser, timed ROUND-ROBIN in one process (one step of
each variant per round, so the shared machine's drift hits all alike), single-threaded, CPU thread time and wall.

Each variant is the trainer's step (snlp.train.trainer.train_step's work): TrainStep forward + backward (compiled
with snlp.train.compiled.CompiledStep or eager), gradient clipping, the run's optimizers (Muon + AdamW; eager on a
CPU as `compile_optimizers` leaves them), zero_grad, one host read of the CE. Every variant owns a model from the
same seed. Prints a JSON line per variant and a table: median and p10-p90 of thread ms per step, model FLOPs per
token (snlp.train.flops, counted once on the eager step), and each ratio with the range the spreads allow (a range
that holds 1 is a tie). A variant is TREATMENT-KIND, KIND none, idn, hcn or KIND:F (the regulariser on the first
ceil(F x batch) rows of each step, `snlp train --reg-rows F`).

    PYTHONPATH=$PWD nice -n 10 python scripts/train_step_rr.py [--rounds 8] [--depth 16 --width 128 ...]
    PYTHONPATH=$PWD nice -n 10 python scripts/train_step_rr.py --variants eager-none,eager-idn,eager-idn:0.25
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext

import torch

from snlp.model.config import GPTConfig
from snlp.model.gpt import GPT
from snlp.train.compiled import CompiledStep, compile_optimizers
from snlp.train.flops import step_flops
from snlp.train.config import TrainConfig
from snlp.train.job import TrainStep
from snlp.train.optim import build_optimizers
from snlp.train.regularizer import RegConfig


def variant(mcfg: GPTConfig, compiled: bool, reg: RegConfig, seed: int):
    torch.manual_seed(seed)
    model = GPT(mcfg)
    model.init_weights(seed=seed)
    model.train()
    opts = build_optimizers(model, TrainConfig(out="", optimizer="muon", compile=compiled))
    step = TrainStep(model, reg)
    fn = CompiledStep(step, "cpu") if compiled else step
    if compiled:
        compile_optimizers(opts, "cpu")
    lam = reg.weight(0) if reg.active else 0.0

    def flops(x, y) -> float:  # model FLOPs per token of one forward + backward of the eager step
        return step_flops(step, x, y, lam, nullcontext) / x.numel()

    def run(x, y) -> float:
        loss, ce, _ = fn(x, y, lam)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad(set_to_none=True)
        return float(ce)  # the trainer's one host read per step
    run.flops = flops
    return run


def q(v: list[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(v, n=10, method="inclusive") if len(v) > 1 else [v[0]] * 9
    return statistics.median(v), qs[0], qs[-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reg-n", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default="eager-none,compiled-none,eager-idn,compiled-idn")
    a = ap.parse_args()
    torch.set_num_threads(1)
    mcfg = GPTConfig.from_depth(a.depth, width=a.width, head_dim=a.head_dim, vocab_size=a.vocab,
                                sequence_len=a.seq_len)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, a.vocab, (a.batch, a.seq_len + 1), generator=g) for _ in range(4)]
    batches = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in batches]
    fns, first, fpt = {}, {}, {}
    for name in a.variants.split(","):
        treat, kind = name.split("-")
        kind, _, frac = kind.partition(":")
        reg = RegConfig() if kind == "none" else RegConfig(surrogate=kind, lam=0.5, suffixes=(a.reg_n,),
                                                           rows=float(frac) if frac else 1.0)
        fns[name] = variant(mcfg, treat == "compiled", reg, 0)
        fpt[name] = fns[name].flops(*batches[0])
        t0 = time.perf_counter()
        fns[name](*batches[0])  # compiles (compiled variants)
        first[name] = time.perf_counter() - t0
        print(f"{name}: first step {first[name]:.1f}s wall", flush=True)
    for i in range(a.warmup):
        for fn in fns.values():
            fn(*batches[(i + 1) % 4])
    thread = {n: [] for n in fns}
    wall = {n: [] for n in fns}
    for r in range(a.rounds):
        for n, fn in fns.items():
            x, y = batches[r % 4]
            t0, c0 = time.perf_counter(), time.thread_time()
            fn(x, y)
            thread[n].append((time.thread_time() - c0) * 1e3)
            wall[n].append((time.perf_counter() - t0) * 1e3)
    tokens = a.batch * a.seq_len
    stats = {}
    for n in fns:
        med, p10, p90 = q(thread[n])
        wmed, wp10, wp90 = q(wall[n])
        stats[n] = (med, p10, p90)
        print(json.dumps({"variant": n, "thread_ms": thread[n], "wall_ms": wall[n], "thread_median_ms": med,
                          "thread_p10_ms": p10, "thread_p90_ms": p90, "wall_median_ms": wmed, "wall_p10_ms": wp10,
                          "wall_p90_ms": wp90, "first_step_s": first[n], "tok_s_thread": tokens / (med / 1e3),
                          "flops_per_token": fpt[n]}))
    print("\n| variant | thread ms/step median (p10-p90) | tok/s (thread) | MFLOP/token | first step s |\n"
          "|---|---|---|---|---|")
    for n, (med, p10, p90) in stats.items():
        print(f"| {n} | {med:.0f} ({p10:.0f}-{p90:.0f}) | {tokens / (med / 1e3):,.0f} | {fpt[n] / 1e6:.2f} "
              f"| {first[n]:.1f} |")

    def ratio(label, num, den):
        if num in stats and den in stats:
            (a_, a10, a90), (b_, b10, b90) = stats[num], stats[den]
            lo, hi = a10 / b90, a90 / b10
            print(f"{label}: {a_ / b_:.2f}x ({lo:.2f}-{hi:.2f}{': tie' if lo <= 1 <= hi else ''})")
    print()
    for n in stats:
        treat, kind = n.split("-")
        if treat == "eager" and f"compiled-{kind}" in stats:
            ratio(f"compiled speedup, {kind} (eager / compiled ms)", n, f"compiled-{kind}")
    for n in stats:
        treat, kind = n.split("-")
        if kind != "none" and f"{treat}-none" in stats:
            ratio(f"regulariser overhead {kind}, {treat} ({kind} / plain ms; FLOP ratio "
                  f"{fpt[n] / fpt[f'{treat}-none']:.3f})", n, f"{treat}-none")


if __name__ == "__main__":
    main()

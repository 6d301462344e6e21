"""How the off-the-shelf stage's pricing tracks the box (docs/records/speedrun-2026-11-26.md): the median
time of `snlp.bench.budget.reference_work` (the probe's fixed workload) beside a SmolLM2 teacher-forced window
(batch 1, 256 tokens, fp32, one thread), idle and then with 1, 2, 3 busy single-thread neighbours (fp32 matmul
loops) started one by one.

    PYTHONPATH=$PWD python3 scripts/ots_window_load.py RUN/cache/ots-*/   # the speedrun's converted SmolLM2

Measured 2026-11-26 on the 2-core EPYC VM: window / reference_work 43.5, 43.8, 46.8, 50.0 at 0-3 neighbours.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

import snlp
from snlp.bench.budget import reference_work

BUSY = "import torch\ntorch.set_num_threads(1)\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a"


def median_s(fn, n: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a converted SmolLM2 (snlp.load), e.g. the speedrun's OUT/cache/ots-*/")
    ap.add_argument("--neighbours", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, _ = snlp.load(args.checkpoint)
    x = torch.randint(0, model.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    ref, procs = reference_work(), []
    try:
        for k in range(args.neighbours + 1):
            time.sleep(3)  # let the neighbours start
            with torch.inference_mode():
                before = median_s(ref, 5)
                w = median_s(lambda: model(x), 3)
                r = (before + median_s(ref, 5)) / 2  # reference_work before and after the windows
            print(f"neighbours {k}: reference_work {1e3 * r:.1f} ms, SmolLM2 window {w:.3f} s, ratio {w / r:.1f}",
                  flush=True)
            procs.append(subprocess.Popen([sys.executable, "-c", BUSY]))
    finally:
        for p in procs:
            p.kill()


if __name__ == "__main__":
    main()

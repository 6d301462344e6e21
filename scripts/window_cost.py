"""What a sliding window costs on the CPU: a model whose layers all have a 256-token window at T = 4096 against the
same model with full attention, sequential and two fused plans, under the masked reference kernel and the default
("auto": banded on the CPU). Thread CPU time, one thread, medians of 3 (robust to other processes on a shared box).

    PYTHONPATH=$PWD python3 scripts/window_cost.py
"""

from __future__ import annotations

import statistics
import time

import torch

import snlp
from snlp.model.ops import set_window_kernel


def build(pattern: str):
    cfg = snlp.GPTConfig.from_depth(8, width=256, head_dim=64, vocab_size=512, window_pattern=pattern,
                                    short_window=256, sequence_len=4096)
    torch.manual_seed(0)
    m = snlp.GPT(cfg)
    m.init_weights(seed=0)
    return m.eval()


def thread_ms(fn, n=3):
    fn()
    ts = []
    for _ in range(n):
        t = time.thread_time()
        fn()
        ts.append(time.thread_time() - t)
    return statistics.median(ts) * 1e3


def main():
    torch.set_num_threads(1)
    windowed, full = build("S"), build("L")
    idx = torch.randint(0, 512, (1, 4096))
    print("| forward | windowed, masked ms | windowed, auto ms | full ms | windowed / full: masked | auto |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for plan in (None, "6xF1-h0-K1", "3xF2-h0-K1"):
            rw = snlp.bind(windowed, plan) if plan else windowed
            rf = snlp.bind(full, plan) if plan else full
            res = {}
            for kind in ("masked", "auto"):
                set_window_kernel(kind)
                res[kind] = thread_ms(lambda: rw(idx))
            f = thread_ms(lambda: rf(idx))
            print(f"| {plan or 'sequential'} | {res['masked']:.0f} | {res['auto']:.0f} | {f:.0f} | "
                  f"{res['masked'] / f:.2f} | {res['auto'] / f:.2f} |")


if __name__ == "__main__":
    main()

"""Time a compiled static-shape prefill with and without the head, in one process, round-robin: `Step.prefill` (the
fill graph, keep=0: no logits, what every decode loop runs) against the same step called with logits over the same
padded length (the graph a prefill ran before it had a fill graph). Same model, same compiled mode (inductor on the
CPU; CUDA graphs on CUDA), warm-up (compilation) outside timing. Prints compile time, each side's median / min / max
and the per-round ratio with-head / fill.

    PYTHONPATH=$PWD python3 scripts/compiled_prefill_head.py MODEL [--tokens 128] [--rounds 11] [--threads 2]

MODEL: an snlp checkpoint or a transformers directory (converted on load with snlp.from_hf)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import snlp
from snlp.decode.steps import sequential_step
from snlp.runtime.timing import sync


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    hf = os.path.exists(os.path.join(a.model, "config.json")) and "architectures" in json.load(
        open(os.path.join(a.model, "config.json")))
    model = (snlp.from_hf(a.model) if hf else snlp.load(a.model))[0].float().eval().to(a.device)
    step = sequential_step(model, compile=True)
    T = a.tokens
    idx = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0)).to(a.device)
    n = step.prefill_len(T)
    with torch.inference_mode():
        cache = step.new_cache(model, 1, step.cache_len(T + 64))
        t0 = time.perf_counter()
        step.warm_prefill(cache, T)
        step.warm(cache, [n])
        print(f"compile s {time.perf_counter() - t0:.1f}", flush=True)
        res: dict[str, list[float]] = {"fill": [], "with head": []}
        for _ in range(a.rounds):
            for k in res:
                cache.seek(0)
                sync(step.device)
                t0 = time.perf_counter()
                step.prefill(idx, cache) if k == "fill" else step(idx, cache, pad_to=n)
                sync(step.device)
                res[k].append(time.perf_counter() - t0)
    for k, v in res.items():
        print(f"{k}: median {1e3 * statistics.median(v):.1f} ms, min {1e3 * min(v):.1f}, max {1e3 * max(v):.1f}")
    ratios = [b / f for f, b in zip(res["fill"], res["with head"])]
    print("with head / fill per round:", ", ".join(f"{r:.2f}" for r in ratios),
          f"(median {statistics.median(ratios):.2f}; fill faster in {sum(r > 1 for r in ratios)} of {len(ratios)})")


if __name__ == "__main__":
    main()

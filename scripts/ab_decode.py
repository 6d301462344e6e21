"""Time KV-cached batch-1 greedy decoding under TWO versions of snlp in ONE process (the package of a git ref, as in
scripts/ab_prefill.py, beside this worktree's): sequential_generate and snlp_generate of each plan on one checkpoint,
every callable round-robin in the same rounds, medians of ms per generated token. The tokens of both versions are
compared first (they must be identical: the changes are meant to keep the function).

    PYTHONPATH=$PWD python3 scripts/ab_decode.py CKPT [--ref REF] [--plans 12xF1-h0-K1,6xF2-h0-K1] [--tokens 32]
        [--warmup 3] [--runs 21] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_prefill import old_package  # noqa: E402  (a sibling script)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt")
    p.add_argument("--ref", default="HEAD")
    p.add_argument("--plans", default="12xF1-h0-K1,6xF2-h0-K1")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs", type=int, default=21)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from snlp.decode.generate import sequential_generate, snlp_generate
    from snlp.io.checkpoint import load
    from snlp.runtime.timing import time_round_robin

    tmp = tempfile.TemporaryDirectory()
    old = old_package(a.ref, Path(tmp.name))
    for m in ("snlp_old.io.checkpoint", "snlp_old.decode.generate"):
        importlib.import_module(m)
    new_m, _ = load(a.ckpt)
    old_m, _ = old.io.checkpoint.load(a.ckpt)
    prompt = torch.randint(0, new_m.config.vocab_size, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    gens = {"new": (sequential_generate, snlp_generate, new_m),
            "old": (old.decode.generate.sequential_generate, old.decode.generate.snlp_generate, old_m)}
    names = ["sequential", *a.plans.split(",")]
    ms: dict = {}

    def call(ver, name):
        seq, snlp, m = gens[ver]
        r = seq(m, prompt, a.tokens) if name == "sequential" else snlp(m, prompt, name, a.tokens)
        ms.setdefault((ver, name), []).append(1e3 * r.decode_s / len(r.tokens))
        return r.tokens

    same = {n: call("old", n) == call("new", n) for n in names}
    ms.clear()
    time_round_robin({(v, n): (lambda v=v, n=n: call(v, n)) for v in gens for n in names}, a.warmup, a.runs,
                     torch.device("cpu"))
    print(f"# KV-cached greedy decode, batch 1, {a.tokens} tokens after a 16-token prompt, {a.ckpt}, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}; old = {a.ref}, new = worktree; "
          f"{a.warmup} warm-up + {a.runs} round-robin rounds, medians of ms per token")
    print("| forward | old ms/token | new ms/token | new/old | old speedup | new speedup | same tokens |")
    print("|---|---|---|---|---|---|---|")
    med = {k: statistics.median(v[-a.runs:]) for k, v in ms.items()}
    for n in names:
        o, w = med[("old", n)], med[("new", n)]
        print(f"| {n} | {o:.2f} | {w:.2f} | {w / o:.2f} | {med[('old', 'sequential')] / o:.2f}x | "
              f"{med[('new', 'sequential')] / w:.2f}x | {'yes' if same[n] else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time KV-cached batch-1 decoding (greedy, or sampled with --temperature) under TWO versions of snlp in ONE
process (the package of a git ref, as in scripts/ab_prefill.py, beside this worktree's): sequential_generate and
snlp_generate of each plan on one checkpoint, every callable round-robin in the same rounds, medians of ms per
generated token. The tokens of both versions are
compared first (they must be identical: the changes are meant to keep the function).

    PYTHONPATH=$PWD python3 scripts/ab_decode.py CKPT [--ref REF] [--plans 12xF1-h0-K1,6xF2-h0-K1] [--tokens 32]
        [--spec 12xF1-h0-K1:4] [--compile] [--temperature 0.8] [--warmup 3] [--runs 21] [--threads 1]

`--spec PLAN:BLOCK,...` adds self-speculative decoding (the plan drafts BLOCK tokens, the model verifies);
`--compile` runs every callable through compiled static-shape steps, built once per version before the rounds.
`--temperature T` samples (seed 0 in every call, so both versions draw the same tokens if they draw alike).
`--clock thread` times each whole call (prefill included) on this thread's CPU clock instead of the decode wall
clock: with --threads 1 on a loaded shared box, what other processes take from the core does not count.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
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
    p.add_argument("--spec", default="", help="PLAN:BLOCK,... self-speculative rows")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--clock", choices=("wall", "thread"), default="wall")
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
    for m in ("snlp_old.io.checkpoint", "snlp_old.decode.generate", "snlp_old.decode.speculative",
              "snlp_old.decode.steps", "snlp_old.method.solver"):
        importlib.import_module(m)
    from snlp.decode.speculative import speculative_generate
    from snlp.decode.steps import sequential_step, snlp_step
    from snlp.method.solver import bind
    new_m, _ = load(a.ckpt)
    old_m, _ = old.io.checkpoint.load(a.ckpt)
    prompt = torch.randint(0, new_m.config.vocab_size, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    new_mods = dict(seq=sequential_generate, snlp=snlp_generate, spec=speculative_generate, seq_step=sequential_step,
                    snlp_step=snlp_step, bind=bind)
    o = old.decode
    old_mods = dict(seq=o.generate.sequential_generate, snlp=o.generate.snlp_generate,
                    spec=o.speculative.speculative_generate, seq_step=o.steps.sequential_step,
                    snlp_step=o.steps.snlp_step, bind=old.method.solver.bind)
    gens = {"new": (new_mods, new_m), "old": (old_mods, old_m)}
    specs = [(s.split(":")[0], int(s.split(":")[1])) for s in a.spec.split(",") if s]
    plans = [p for p in a.plans.split(",") if p]
    names = ["sequential", *plans, *(f"spec {p} B={b}" for p, b in specs)]
    # compiled: one step per callable and version, built (and compiled on first use) outside the timed rounds
    steps = {}
    for ver, (f, m) in gens.items():
        steps[ver, "sequential"] = f["seq_step"](m, a.compile)
        for p in {*plans, *(p for p, _ in specs)}:
            steps[ver, p] = f["snlp_step"](f["bind"](m, p, check_finite=False), a.compile)
    ms: dict = {}

    def call(ver, name):
        f, m = gens[ver]
        kw = dict(temperature=a.temperature, seed=0)
        c0 = time.thread_time()
        if name == "sequential":
            r = f["seq"](m, prompt, a.tokens, step=steps[ver, name], **kw)
        elif name.startswith("spec "):
            p, b = name.split()[1], int(name.split("=")[1])
            r = f["spec"](m, prompt, p, block=b, max_new_tokens=a.tokens, compile=a.compile,
                          draft=steps[ver, p], verify=steps[ver, "sequential"], **kw)
        else:
            r = f["snlp"](m, prompt, name, a.tokens, step=steps[ver, name], **kw)
        spent = time.thread_time() - c0 if a.clock == "thread" else r.decode_s
        ms.setdefault((ver, name), []).append(1e3 * spent / len(r.tokens))
        return r.tokens

    same = {n: call("old", n) == call("new", n) for n in names}
    ms.clear()
    time_round_robin({(v, n): (lambda v=v, n=n: call(v, n)) for v in gens for n in names}, a.warmup, a.runs,
                     torch.device("cpu"))
    how = "greedy" if a.temperature == 0 else f"sampled at temperature {a.temperature}"
    print(f"# KV-cached {how} decode, batch 1, {a.tokens} tokens after a 16-token prompt, {a.ckpt}, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}, {'compiled' if a.compile else 'eager'}; "
          f"old = {a.ref}, new = worktree; "
          f"{a.warmup} warm-up + {a.runs} round-robin rounds, medians of ms per token "
          f"({'thread CPU time of the whole call' if a.clock == 'thread' else 'decode wall time'})")
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

"""Time one eager prefill forward of the paper's suite shapes under TWO versions of snlp in ONE process: the
package of a git ref (default HEAD, i.e. before uncommitted changes; e.g. `--ref a8fe3f9`) and this worktree's.

    PYTHONPATH=$PWD python3 scripts/ab_prefill.py [--ref REF] [--shapes 0.5B-nox0ve,0.5B,0.5B-mhc] [--tokens 256]
        [--short-window 64] [--warmup 2] [--runs 7] [--device cpu|cuda] [--dtype float32|bfloat16] [--threads N]
        [--quick]

The ref's `snlp/` is extracted with `git archive` into a temporary directory and imported as `snlp_old` (its
imports rewritten), both models get the same random weights (one state dict), and every callable (sequential and
each plan, old and new) is timed round-robin in the same rounds (snlp.runtime.timing.time_round_robin): medians in
ms, and each plan's speedup over its own version's sequential forward. Before the timing, every new logit is
compared with the old one (max abs difference printed: the changes are meant to keep the function). On a GPU this
is the before/after measurement docs/records/gpu-prefill-gap-2026-11-26.md asks for; on a CPU its numbers are CPU
numbers.
"""

from __future__ import annotations

import argparse
import importlib
import io
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def old_package(ref: str, where: Path):
    """snlp of git `ref`, importable as `snlp_old`."""
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "snlp"], check=True, capture_output=True).stdout
    tarfile.open(fileobj=io.BytesIO(blob)).extractall(where, filter="data")
    (where / "snlp").rename(where / "snlp_old")
    for f in (where / "snlp_old").rglob("*.py"):
        src = f.read_text()
        src = re.sub(r"\bsnlp\.", "snlp_old.", src)
        src = re.sub(r"\bfrom snlp import\b", "from snlp_old import", src)
        src = re.sub(r"\bimport snlp\b(?!_)", "import snlp_old", src)
        src = src.replace('"snlp::', '"snlp_old::')  # custom ops are registered by name
        f.write_text(src)
    sys.path.insert(0, str(where))
    return importlib.import_module("snlp_old")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", default="HEAD")
    p.add_argument("--shapes", default="0.5B-nox0ve,0.5B,0.5B-mhc")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--short-window", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="the suite's smoke-size shapes (width 64, depth = largest "
                   "suffix + 2, vocab 256): dispatch-bound, like a GPU at batch 1")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from snlp.bench.suite import PAPER_SHAPES
    from snlp.method.solver import bind
    from snlp.model.gpt import GPT
    from snlp.runtime.timing import time_round_robin

    tmp = tempfile.TemporaryDirectory()
    old = old_package(a.ref, Path(tmp.name))
    importlib.import_module("snlp_old.method.solver")
    OldGPT, old_bind = old.model.gpt.GPT, old.method.solver.bind
    dtype, dev = getattr(torch, a.dtype), torch.device(a.device)
    print(f"# eager prefill, batch 1, T = {a.tokens}, short window {a.short_window}, {a.dtype} on {a.device} "
          f"{'(QUICK smoke-size shapes) ' if a.quick else ''}"
          f"({torch.get_num_threads()} threads), torch {torch.__version__}; old = {a.ref}, new = worktree; "
          f"{a.warmup} warm-up + {a.runs} round-robin rounds, medians")
    print("| shape | forward | old ms | new ms | new/old | old speedup | new speedup | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for key in a.shapes.split(","):
        shape = next(s for s in PAPER_SHAPES if s.key == key)
        shape = shape.quick() if a.quick else shape
        cfg = shape.config(256 if a.quick else 32768, "SSSL", a.short_window, max(2048, a.tokens))
        new = GPT(cfg)
        new.init_weights(seed=0)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # non-identity blocks (the init zeroes the output projections)
            for prm in new.parameters():
                prm.add_(torch.randn(prm.shape, generator=gen) * 0.02)
        oldm = OldGPT(old.model.config.GPTConfig(**cfg.to_dict()))
        oldm.load_state_dict(new.state_dict())
        new, oldm = new.to(dev, dtype).eval(), oldm.to(dev, dtype).eval()
        idx = torch.randint(0, cfg.vocab_size, (1, a.tokens), generator=gen).to(dev)
        fns, names = {}, ["sequential", *shape.plans]
        for name in names:
            if name == "sequential":
                fns[("old", name)], fns[("new", name)] = (lambda: oldm(idx)), (lambda: new(idx))
            else:
                ro, rn = old_bind(oldm, name, check_finite=False), bind(new, name, check_finite=False)
                fns[("old", name)], fns[("new", name)] = (lambda r=ro: r(idx)), (lambda r=rn: r(idx))
        with torch.inference_mode():
            diffs = {n: (fns[("new", n)]().float() - fns[("old", n)]().float()).abs().max().item() for n in names}
            t = time_round_robin(fns, a.warmup, a.runs, dev)
        med = {k: statistics.median(v) for k, v in t.items()}
        for n in names:
            o, w = med[("old", n)], med[("new", n)]
            so, sn = med[("old", "sequential")] / o, med[("new", "sequential")] / w
            print(f"| {key} | {n} | {o:.1f} | {w:.1f} | {w / o:.2f} | {so:.2f}x | {sn:.2f}x | {diffs[n]:.1e} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

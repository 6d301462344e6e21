"""Acceptance (alpha) of a self-speculative drafter on held-out prompts, with its exact 95 % interval.

    PYTHONPATH=$PWD python3 scripts/alpha_held_out.py CKPT --plan 12xF1-h0-K1 [--blocks 4,8] [--prompts 48]
        [--prompt-len 16] [--new-tokens 64] [--seed 1234] [--dtypes float32[,bfloat16]] [--threads 1] [--data D]
        [--json FILE] [--write-prompts FILE]

`--write-prompts FILE` writes the prompts (token ids, JSON) for `snlp bench --suite decode --prompts-file FILE`, so
a GPU run decodes the prompts whose alpha was measured here; without `--plan` it only writes them.

Prompts are `--prompts` windows of `--prompt-len` consecutive tokens of the checkpoint's own validation split (the
split `snlp train` held out, snlp.eval.data.validation_tokens / sample_prompts). Each is decoded greedily with
`speculative_generate(model, prompt, plan, block=B)`; alpha = accepted / examined drafts summed over the prompts
(examined: the accepted drafts plus each round's first rejection), with two 95 % intervals: Clopper-Pearson over the
drafts, and a bootstrap over the prompts (drafts of one prompt are correlated, so the first is too narrow; compare
plans by the second). Every fp32 run's
output (and fp64's) is compared with `sequential_generate` (they must be equal: greedy self-speculation is exact); in bf16 the
(B + 1)-position verifier may round a near-tie differently from one-token steps, so bf16 outputs are reported, not
required equal. This is the alpha docs/gpu.md's decode prediction rests on
(docs/records/2026-11-27-decode-speedrun-model.md): measure it for the model a lease carries.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from snlp.decode.generate import sequential_generate
from snlp.decode.speculative import speculative_generate
from snlp.eval.data import checkpoint_data, sample_prompts, validation_tokens
from snlp.io.checkpoint import load
from snlp.train.muon import emulated_dtype, warn_if_emulated


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact binomial interval for k successes in n trials: the p at which P(X >= k) resp. P(X <= k) under
    Binomial(n, p) equals (1 - level) / 2, by bisection on the binomial tail summed in log space (no scipy)."""
    def tail_ge(j: int, p: float) -> float:  # P(X >= j), increasing in p
        if p <= 0.0 or p >= 1.0:
            return float(p >= 1.0 or j <= 0)
        lp, lq, lc = math.log(p), math.log1p(-p), math.lgamma(n + 1)
        return sum(math.exp(lc - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
                   for i in range(max(j, 0), n + 1))

    def solve(j: int, target: float) -> float:  # the p with tail_ge(j, p) = target
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if tail_ge(j, mid) < target else (lo, mid)
        return (lo + hi) / 2

    a = (1 - level) / 2
    low = 0.0 if k == 0 else solve(k, a)  # P(X >= k) = a
    high = 1.0 if k == n else solve(k + 1, 1 - a)  # P(X <= k) = a, i.e. P(X >= k + 1) = 1 - a
    return low, high


def prompt_bootstrap(acc: list[int], exam: list[int], level: float = 0.95, draws: int = 4000,
                     seed: int = 0) -> tuple[float, float]:
    """Percentile interval of alpha = sum(acc) / sum(exam) over prompts resampled with replacement: drafts of one
    prompt are not independent (a prompt's text is easy or hard to draft all along), so the binomial interval over
    drafts is too narrow; this one treats the prompt as the unit."""
    a, e = torch.tensor(acc, dtype=torch.float64), torch.tensor(exam, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    i = torch.randint(0, len(acc), (draws, len(acc)), generator=g)
    r = (a[i].sum(1) / e[i].sum(1).clamp_min(1)).sort().values
    lo, hi = int((1 - level) / 2 * draws), int((1 + level) / 2 * draws) - 1
    return float(r[lo]), float(r[hi])


def measure(model, prompts: list[list[int]], plan: str, blocks: list[int], new_tokens: int, dtypes: list,
            report=None) -> list[dict]:
    """One row per (dtype, block): alpha = accepted / examined drafts summed over the prompts, its 95 % intervals
    (Clopper-Pearson over drafts, and a bootstrap over prompts, the wider and the one to compare plans by), each
    prompt's counts, and how many outputs equal sequential greedy decoding's. `model` is cast to each dtype in turn
    (in place)."""
    rows = []
    for dtype in dtypes:
        m = model.to(dtype)
        with torch.inference_mode():
            ref = [sequential_generate(m, pr, max_new_tokens=new_tokens).tokens for pr in prompts]
            for B in blocks:
                accs, exams, same = [], [], 0
                for pr, r in zip(prompts, ref):
                    out = speculative_generate(m, pr, plan, block=B, max_new_tokens=new_tokens)
                    accs.append(out.accepted)
                    exams.append(out.examined)
                    same += out.tokens == r
                acc, exam = sum(accs), sum(exams)
                lo, hi = clopper_pearson(acc, exam) if exam else (0.0, 1.0)
                blo, bhi = prompt_bootstrap(accs, exams) if exam else (0.0, 1.0)
                row = dict(dtype=str(dtype).replace("torch.", ""), block=B, alpha=acc / exam if exam else None,
                           accepted=acc, examined=exam, low=lo, high=hi, boot_low=blo, boot_high=bhi,
                           equal_outputs=same, prompts=len(prompts), per_prompt=list(zip(accs, exams)))
                rows.append(row)
                if report is not None:
                    report(row)
    return rows


def default_dtypes() -> list:
    """float32, and bfloat16 where this CPU has native bf16 kernels (elsewhere torch emulates it, 10-100x slower)."""
    return [torch.float32] + ([] if emulated_dtype("cpu", torch.bfloat16) else [torch.bfloat16])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt")
    p.add_argument("--plan", default=None, help="the drafter's plan (without it: --write-prompts only)")
    p.add_argument("--blocks", default="4,8")
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dtypes", default=None, help="comma-separated (default float32, and bfloat16 where this CPU "
                   "has native bf16 kernels: elsewhere torch emulates it 10-100x slower)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data", default=None, help="the text whose validation split gives the prompts (default: the "
                   "checkpoint's training data, else stdlib)")
    p.add_argument("--json", default=None)
    p.add_argument("--write-prompts", default=None, metavar="FILE",
                   help="write the prompts (token ids, JSON) for snlp bench --suite decode --prompts-file")
    a = p.parse_args(argv)
    if a.plan is None and a.write_prompts is None:
        p.error("give --plan (measure alpha), --write-prompts FILE, or both")
    blocks = [int(b) for b in a.blocks.split(",")]
    dtypes = [getattr(torch, d) for d in a.dtypes.split(",")] if a.dtypes else default_dtypes()
    warn_if_emulated("cpu", dtypes, "alpha_held_out")
    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load(a.ckpt, device="cpu")
    model.eval()
    d = checkpoint_data(a.ckpt, data=a.data)
    val = validation_tokens(tok, d["data"], d["text_field"], d["max_chars"], d["val_frac"], d["cache_dir"],
                            d["data_encoding"])
    prompts = sample_prompts(val, a.prompts, a.prompt_len, a.seed)
    if a.write_prompts:
        with open(a.write_prompts, "w") as f:
            json.dump([list(map(int, pr)) for pr in prompts], f)
        print(f"# wrote {len(prompts)} prompts of {a.prompt_len} tokens to {a.write_prompts}")
    if a.plan is None:
        return 0
    print(f"# {a.ckpt}: {a.prompts} held-out prompts of {a.prompt_len} tokens (seed {a.seed}), {a.new_tokens} greedy "
          f"tokens each, plan {a.plan}")
    print("| dtype | block | alpha | accepted / examined | 95 % over drafts | 95 % over prompts | output = sequential greedy |")
    print("|---|---|---|---|---|---|---|")
    rows = measure(model, prompts, a.plan, blocks, a.new_tokens, dtypes, report=lambda row: print(
        f"| {row['dtype']} | {row['block']} | {row['alpha']:.3f} | {row['accepted']} / {row['examined']} | "
        f"{row['low']:.3f}-{row['high']:.3f} | {row['boot_low']:.3f}-{row['boot_high']:.3f} | "
        f"{row['equal_outputs']} of {row['prompts']} |", flush=True))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(ckpt=a.ckpt, plan=a.plan, prompt_len=a.prompt_len, new_tokens=a.new_tokens, seed=a.seed,
                           rows=rows), f, indent=1)
    bad = [r for r in rows if r["dtype"] in ("float32", "float64") and r["equal_outputs"] != r["prompts"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Count the kernel chain of one KV-cached decode step, for the model's sequential step and drafter plans.

    PYTHONPATH=$PWD python3 scripts/decode_ops.py CKPT_OR_CONFIG_DIR [--plans 22xF1-h0-K1,11xF2-h0-K2]
                                                  [--prompt 128] [--blocks 2,4,8] [--dtype bfloat16] [--json FILE]

What a batch-1 decode step costs on a GPU is its chain of dependent kernels: at SmolLM2's width (576) every kernel
of a step is tiny (tens of KB of activations, < 10 us of work), so with CUDA graphs (one launch per step) the step
time is the sum of per-kernel latencies, not arithmetic or weight bytes. This script counts that chain, the way
scripts/prefill_ops.py counts a prefill: the model is built on the `meta` device from the checkpoint's config (no
weights are read), a cache of `prompt` valid positions is set up, and one step runs through the static-shape
forward that `Step` compiles (snlp.decode.steps.sequential_fn / snlp_fn: positions as a tensor, attention over the
whole cache buffer), under prefill_ops' counters (every non-view aten op = one eager kernel; SDPA and rms_norm =
one kernel each, as on CUDA). Counted per step:

  kernels   eager aten kernels (inductor fuses pointwise ones, so a compiled step launches fewer);
  heavy     the ops inductor cannot fuse away (matmuls, attention, norms, embedding / index, cat / copies, softmax,
            reductions): a lower bound of the compiled chain, the count the prediction uses beside `kernels`.

Steps: `sequential` (T = 1), `verify B` (the model over B + 1 positions, what self-speculative decoding's verifier
runs), and each plan's drafter step (T = 1). A count is not a time: the GPU prediction that uses these counts
(t_step proportional to the chain) is labelled as such wherever it is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prefill_ops import _Autocast, measure  # noqa: E402  (a sibling script, not a package)

from snlp.decode.steps import sequential_fn, snlp_fn  # noqa: E402
from snlp.io.checkpoint import load_config  # noqa: E402
from snlp.method.plan import Plan  # noqa: E402
from snlp.method.solver import bind  # noqa: E402
from snlp.model.cache import KVCache  # noqa: E402
from snlp.model.gpt import GPT  # noqa: E402

# aten ops a fusing compiler keeps as their own kernels (everything else is pointwise / layout and fuses into them)
HEAVY = ("mm", "bmm", "addmm", "baddbmm", "matmul", "sdpa", "rms_norm", "embedding", "index", "index_select",
         "gather", "cat", "stack", "index_put_", "index_copy_", "index_copy", "copy_", "_softmax", "sum", "mean",
         "amax", "argmax", "max", "where (sdpa mask)", "scatter", "scatter_")


def count_step(model: GPT, fn, T: int, prompt: int, cache_len: int) -> dict:
    cache = KVCache.for_model(model, batch=1, max_len=cache_len)
    cache.length = prompt
    idx = torch.zeros(1, T, dtype=torch.long, device="meta")
    pos = torch.arange(prompt, prompt + T, device="meta")
    r = measure(lambda: fn(idx, pos, cache))
    r["heavy"] = sum(n for op, n in r["ops"].items() if op in HEAVY)
    return r


def predict(n_seq: float, n_draft: float, n_verify: float, block: int, alpha: float, overhead: float = 0.0,
            reads: str = "round", read_every: int = 8) -> dict:
    """PREDICTED self-speculative speedup when a step's time is its kernel chain times a per-kernel latency c plus
    a fixed cost f (overhead x the sequential chain) for each wait on the device: the host takes the tokens, then
    launches the next graph, while the GPU idles. c cancels: speedup = tokens per round x t_token / t_round, tokens
    per round = (1 - a^(B+1)) / (1 - a). `reads`: "round" (snlp's one-prompt loops since 2026-11-27: one wait per
    speculative round, one per `read_every` sequential tokens; a launch that the host queues ahead costs nothing
    more) or "step" (one wait per step on both sides: the loops before, and what the records before assumed)."""
    fixed = overhead * n_seq
    per_round = block + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (block + 1)) / (1.0 - alpha)
    if reads == "step":
        t_seq, t_draft, t_verify = n_seq + fixed, n_draft + fixed, n_verify + fixed
        t_round = block * t_draft + t_verify
    else:
        t_seq, t_draft = n_seq + fixed / read_every, n_draft
        t_round = block * n_draft + n_verify + fixed
    return dict(s=t_seq / t_draft, tokens_per_round=per_round, speedup=per_round * t_seq / t_round)


def weight_mb(cfg, plan: Plan | None, dtype: str) -> float:
    """MB of weights one step reads: every layer once per evaluation (a drafter: its prefix once, its suffix once
    per iteration, once more for a `fwd` init) plus the head; the embedding row is negligible."""
    D, hd = cfg.n_embd, cfg.head_dim
    layer = 2 * D * cfg.n_head * hd + 2 * D * cfg.n_kv_head * hd + (3 if cfg.mlp_act == "swiglu" else 2) * D * \
        (cfg.ffn_dim or cfg.mlp_ratio * D)
    L = cfg.n_layer
    evals = L if plan is None else plan.prefix_len(L) + (L - plan.prefix_len(L)) * (
        plan.iters * plan.evals_per_iter + (plan.init == "fwd"))
    return (evals * layer + cfg.vocab_size * D) * torch.finfo(getattr(torch, dtype)).bits / 8 / 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="snlp checkpoint directory (only its config.json is read)")
    p.add_argument("--plans", default="8xF1-h0-K1,8xF1-h0-K2,22xF1-h0-K1,22xF1-h0-K2,11xF2-h0-K2")
    p.add_argument("--prompt", type=int, default=128, help="valid cache positions before the step")
    p.add_argument("--blocks", default="2,4,8", help="verifier steps over B + 1 positions")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--alpha", default="", help="PLAN:B:ALPHA,... measured acceptance rates: print the PREDICTED GPU "
                   "speedup of those rows (t_step proportional to the chain, see predict())")
    p.add_argument("--overhead", default="0,0.1", help="fixed cost f of each wait on the device (the token read, "
                   "then the next launch) as a fraction of the sequential step: the prediction is printed for each")
    p.add_argument("--reads", default="round", choices=("round", "step"), help="where the loops wait (predict()): "
                   "once per speculative round and per 8 sequential tokens (today's one-prompt loops), or once per "
                   "step on both sides (before 2026-11-27)")
    p.add_argument("--kernel-us", default="", help="per-kernel latencies c (us, comma-separated): also print the "
                   "prediction with t = c x chain + the step's weight bytes / --hbm-gbps (each weight read once per "
                   "evaluation of its layer), i.e. neither term assumed away")
    p.add_argument("--hbm-gbps", type=float, default=3350 * 0.7, help="weight-read bandwidth (GB/s; default an "
                   "H100 SXM's 3,350 at 70 %%)")
    p.add_argument("--json", help="write every count here")
    a = p.parse_args(argv)
    torch.autocast = _Autocast  # the model runs on meta (see prefill_ops._Autocast)
    cfg = load_config(a.src)
    with torch.device("meta"):
        model = GPT(cfg)
    model = model.to(dtype=getattr(torch, a.dtype)).eval()
    blocks = [int(b) for b in a.blocks.split(",")]
    cache_len = max(64, 1 << (a.prompt + max(blocks) + 1 - 1).bit_length())  # Step.cache_len's power of two
    steps = {"sequential": (sequential_fn(model), 1)}
    steps.update({f"verify B={b}": (sequential_fn(model), b + 1) for b in blocks})
    for s in a.plans.split(","):
        plan = Plan.parse(s, cfg.n_layer)
        plan.check(cfg.n_layer)
        steps[str(plan)] = (snlp_fn(bind(model, plan, check_finite=False)), 1)
    print(f"# one KV-cached decode step, batch 1, {a.prompt} cached positions (cache buffer {cache_len}), {a.dtype}, "
          f"L={cfg.n_layer} D={cfg.n_embd}, meta device (counts, not times)")
    print("| step | T | kernels | heavy | sdpa | GFLOP | kernels / sequential | heavy / sequential |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for name, (fn, T) in steps.items():
        r = count_step(model, fn, T, a.prompt, cache_len)
        rows.append(dict(step=name, T=T, **r))
    seq = rows[0]
    for r in rows:
        print(f"| {r['step']} | {r['T']} | {r['kernels']} | {r['heavy']} | {r['sdpa_causal'] + r['sdpa_masked'] + r['sdpa_plain']} | "
              f"{r['gflop']:.3f} | {r['kernels'] / seq['kernels']:.3f} | {r['heavy'] / seq['heavy']:.3f} |")
    preds = []
    if a.alpha:
        by = {r["step"]: r for r in rows}
        print("\n# PREDICTED GPU self-speculative speedup (batch 1, CUDA graphs; t_step = c x chain, plus f x c x "
              f"chain_seq per wait on the device ({'each step' if a.reads == 'step' else 'each round; each 8 sequential tokens'}); "
              "alpha measured; not a GPU measurement)")
        print("| plan | B | alpha | chain | f | s | tokens/round | PREDICTED speedup |")
        print("|---|---|---|---|---|---|---|---|")
        for item in a.alpha.split(","):
            plan, b, alpha = item.rsplit(":", 2)
            plan, b, alpha = str(Plan.parse(plan, cfg.n_layer)), int(b), float(alpha)
            for col in ("kernels", "heavy"):
                for f in (float(x) for x in a.overhead.split(",")):
                    r = predict(by["sequential"][col], by[plan][col], by[f"verify B={b}"][col], b, alpha, f, a.reads)
                    preds.append(dict(plan=plan, block=b, alpha=alpha, chain=col, overhead=f, **r))
                    print(f"| {plan} | {b} | {alpha:.3f} | {col} | {f:g} | {r['s']:.2f} | {r['tokens_per_round']:.2f} "
                          f"| {r['speedup']:.2f}x (predicted) |")
                for c in (float(x) for x in a.kernel_us.split(",") if x):
                    us = lambda n, mb: c * n + mb * 1e3 / a.hbm_gbps  # MB / (GB/s) = ms; x 1e3 -> us
                    mb_seq, mb_plan = weight_mb(cfg, None, a.dtype), weight_mb(cfg, Plan.parse(plan), a.dtype)
                    t_seq, t_d = us(by["sequential"][col], mb_seq), us(by[plan][col], mb_plan)
                    t_v = us(by[f"verify B={b}"][col], mb_seq)
                    per_round = b + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (b + 1)) / (1.0 - alpha)
                    r = dict(s=t_seq / t_d, tokens_per_round=per_round, speedup=per_round * t_seq / (b * t_d + t_v),
                             seq_us=t_seq, draft_us=t_d, verify_us=t_v)
                    preds.append(dict(plan=plan, block=b, alpha=alpha, chain=col, kernel_us=c, **r))
                    print(f"| {plan} | {b} | {alpha:.3f} | {col} x {c:g} us + bytes | - | {r['s']:.2f} | "
                          f"{r['tokens_per_round']:.2f} | {r['speedup']:.2f}x (predicted; seq {t_seq:.0f} us, "
                          f"draft {t_d:.0f} us) |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(src=os.path.abspath(a.src), prompt=a.prompt, cache_len=cache_len, dtype=a.dtype,
                           torch=torch.__version__, rows=rows, predictions=preds), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`snlp eval CKPT --drafter DIR` for the ADAPTED drafter only, one block size per process if wanted.

    PYTHONPATH=$PWD python3 scripts/drafter_eval.py CKPT DIR --chat-prompts chat:dolly_open_qa.jsonl \
        [--data tinyshakespeare.txt] [--max-tokens 4096] [--prompts 8] [--gen-tokens 64] [--blocks 4] \
        [--quality] [--posthoc-quality] [--warmup 1] [--runs 1] [--threads 1] [--json FILE]

`snlp eval --drafter` runs, for each plan, the post-hoc drafter's rows before the adapted one's, SSD included: for a
deep-suffix plan whose post-hoc drafter is never accepted (alpha ~ 0) that SSD costs B + 1 model steps per emitted
token, most of the evaluation's time. This script takes the same held-out split, windows and chat prompts (the
library functions `snlp eval` calls: snlp.eval.drafter.drafter_split / held_out_tokens / drafter_prompts / quality,
snlp.decode.speculative.speculative_benchmark) and runs the adapted drafter's SSD at the given blocks, its quality
with --quality, and the post-hoc drafter's quality (no SSD) with --posthoc-quality. Split the blocks over processes
to use several cores.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from snlp.decode.speculative import speculative_benchmark
from snlp.eval.drafter import drafter_prompts, drafter_split, held_out_tokens, quality
from snlp.eval.data import as_tokens, windows
from snlp.io.checkpoint import load
from snlp.io.drafter import load_drafter, load_record
from snlp.method.drafter import make_drafter
from snlp.runtime.fmt import matches


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt")
    p.add_argument("drafter")
    p.add_argument("--chat-prompts", required=True)
    p.add_argument("--data", default=None, help="parts of the drafter's data whose held-out split to score")
    p.add_argument("--seq-len", type=int, default=None, help="PPL window (default min(256, model sequence_len), "
                   "as snlp eval)")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--blocks", default="4")
    p.add_argument("--quality", action="store_true", help="also the adapted drafter's Top-1 / LogitSim / PPL")
    p.add_argument("--posthoc-quality", action="store_true", help="also the post-hoc drafter's (no SSD)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, tok = load(a.ckpt)
    model = model.eval()
    drafter = load_drafter(a.drafter, model)
    split = drafter_split(load_record(a.drafter), data=a.data)
    if split is None:
        raise ValueError(f"{a.drafter} records no adaptation data; use snlp eval --drafter with --data")
    out = dict(ckpt=a.ckpt, drafter=a.drafter, plan=str(drafter.plan), data=split.data, val_frac=split.val_frac,
               torch=torch.__version__, threads=a.threads)
    with torch.inference_mode():
        if a.quality or a.posthoc_quality:
            seq_len = min(256, model.config.sequence_len) if a.seq_len is None else a.seq_len
            wins = windows(as_tokens(held_out_tokens(split, tok)), seq_len, a.max_tokens)
            if a.quality:
                out["adapted_quality"] = quality(model, drafter, wins, a.batch)
                print("adapted:", out["adapted_quality"], flush=True)
            if a.posthoc_quality:
                post = make_drafter(model, drafter.plan, fingerprint=drafter.base_fingerprint)
                out["posthoc_quality"] = quality(model, post, wins, a.batch)
                print("post-hoc:", out["posthoc_quality"], flush=True)
    blocks = tuple(int(b) for b in a.blocks.split(",")) if a.blocks else ()
    if blocks:
        prompts = drafter_prompts(split, a.chat_prompts, tok, split.val_frac, a.prompts)
        # the stop ids of snlp eval --drafter: a reply ends where its chat turn ends (our BPE has no EOS, stop_ids ())
        rows, _ = speculative_benchmark(model, prompts, drafter.plan, blocks, a.gen_tokens, a.runs, a.warmup,
                                        eos_id=list(tok.chat_stop_ids) or None, drafter=drafter)
        out["ssd"] = [r.to_dict() for r in rows]
        for r in rows:
            d = r.to_dict()
            print(f"B={d['block']}: alpha {d['alpha']:.3f} tokens/round {d['tokens_per_round']:.2f} "
                  f"s {d['drafter_speedup_s']:.2f} tok/s vs seq {d['measured_speedup']:.2f}x identical "
                  f"{matches(d['matches_sequential'])} ({d['prompts']} prompts x {d['gen_tokens']} tokens)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

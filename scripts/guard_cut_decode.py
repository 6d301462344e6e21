"""End-to-end compiled greedy decoding with and without the guard cut (snlp.decode.steps, Step guards="cut" / "full").

    PYTHONPATH=$PWD python3 scripts/guard_cut_decode.py [--depth 16] [--width 64] [--head-dim 32] [--tokens 64]
        [--prompt 16] [--rounds 12] [--speculative PLAN] [--block 4] [--device cpu|cuda] [--out DIR]

Two compiled sequential steps of one model (inductor on the CPU, CUDA graphs on CUDA), one with guards="full" (dynamo
evaluates its guards on every call) and one with guards="cut" (SNLP_COMPILE_GUARDS=cut), each warmed by a first decode. Each
round decodes the same prompt greedily with both, in alternating order, and records the thread time (CPU: host work
of the one thread; on CUDA the wall time, device synchronised) of each decode: a paired ratio full / cut per round
(> 1: the cut was faster), its median and range, and the verdict of snlp.runtime.stats' two-sided sign test (a tie
where it does not resolve). Both decodes must give the same tokens. With --speculative PLAN the rounds decode
self-speculatively instead (draft = the plan's step, verify = the sequential step, block --block), each treatment's
two steps built with its guards.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from snlp.decode import sequential_generate, speculative_generate
from snlp.decode.steps import sequential_step, snlp_step
from snlp.method.solver import bind
from snlp.model.gpt import GPT, GPTConfig
from snlp.runtime.stats import paired_marks, ratio_range, verdict_text


def build(depth: int, width: int, head_dim: int, device: str) -> GPT:
    cfg = GPTConfig.from_depth(depth, width=width, head_dim=head_dim, vocab_size=512, sequence_len=1024)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights(seed=0)
    return model.eval().to(device)


def measure(depth=16, width=64, head_dim=32, tokens=64, prompt=16, rounds=12, speculative=None, block=4,
            device="cpu") -> dict:
    cuda = torch.device(device).type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    model = build(depth, width, head_dim, device)
    ids = torch.randint(0, 512, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    runner = bind(model, speculative, check_finite=False) if speculative else None

    def decoder(guards):
        seq = sequential_step(model, compile=True, guards=guards)
        if runner is None:
            return lambda: sequential_generate(model, ids, max_new_tokens=tokens, step=seq).tokens
        draft = snlp_step(runner, compile=True, guards=guards)
        return lambda: speculative_generate(model, ids, speculative, block=block, max_new_tokens=tokens, draft=draft,
                                            verify=seq).tokens
    runs = {"full": decoder("full"), "cut": decoder("cut")}
    want = {k: f() for k, f in runs.items()}  # compiles every graph, outside the timings
    if want["full"] != want["cut"]:
        raise AssertionError("the guard cut changed the greedy tokens")
    times = {k: [] for k in runs}
    for r in range(rounds):
        for k in (("full", "cut") if r % 2 == 0 else ("cut", "full")):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter() if cuda else time.thread_time()
            got = runs[k]()
            if cuda:
                torch.cuda.synchronize()
            times[k].append((time.perf_counter() if cuda else time.thread_time()) - t0)
            if got != want[k]:
                raise AssertionError(f"round {r}: the {k} decode's tokens changed")
    ratios = [f / c for f, c in zip(times["full"], times["cut"])]
    return {"config": dict(depth=depth, width=width, head_dim=head_dim, tokens=tokens, prompt=prompt, rounds=rounds,
                           speculative=speculative, block=block, device=device, torch=torch.__version__,
                           clock="wall, device synchronised" if cuda else "thread time"),
            "seconds": times,
            "tokens_per_s": {k: tokens / statistics.median(v) for k, v in times.items()},
            "speedup_rounds": ratios, "speedup": statistics.median(ratios), **paired_marks(ratios),
            "verdict_text": verdict_text(ratios, baseline="full guards", rounds="rounds")}


def markdown(out: dict) -> str:
    tps = out["tokens_per_s"]
    return "\n".join([
        "| guards | tokens/s (median) |", "|---|---|",
        f"| full | {tps['full']:.1f} |", f"| cut | {tps['cut']:.1f} |", "",
        f"speedup full / cut per round: median {out['speedup']:.3f}, range {ratio_range(out['speedup_rounds'])}; "
        f"the cut is {out['verdict_text']}."])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--speculative", default=None)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = measure(a.depth, a.width, a.head_dim, a.tokens, a.prompt, a.rounds, a.speculative, a.block, a.device)
    text = markdown(out)
    if a.out:
        d = Path(a.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "guard_cut_decode.json").write_text(json.dumps(out, indent=1))
        (d / "guard_cut_decode.md").write_text(text + "\n")
    print(json.dumps(out["config"]))
    print(text)


if __name__ == "__main__":
    main()

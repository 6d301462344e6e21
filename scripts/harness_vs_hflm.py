"""Time lm-evaluation-harness requests through snlp's backend (SNLPLM) and the harness's own `hf` model (HFLM) on
ONE transformers directory, in one process, round-robin: generate_until (greedy, until "\\n\\n", max_gen_toks) and,
with --ll, loglikelihood, same requests, same batch size, both float32 on the CPU. Prints each side's seconds per
round, the medians and the per-round ratios hf / snlp, and checks that the greedy answers agree.

    PYTHONPATH=$PWD python3 scripts/harness_vs_hflm.py HF_DIR [--batch 8] [--rounds 5] [--gen-toks 32] [--ll]
    PYTHONPATH=$PWD python3 scripts/harness_vs_hflm.py --cut SNLP_CKPT --layers 6 --out DIR   # write HF_DIR first

`--cut` exports the first --layers layers of an snlp checkpoint (e.g. the converted SmolLM2) as a transformers
directory, as the harness tests do (tests/conftest.py smol_cut_hf)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402


def cut(src: str, layers: int, out: str) -> None:
    from snlp import load
    from snlp.io.hf import export_hf
    from snlp.model.gpt import GPT

    model, tok = load(src)
    small = GPT(dataclasses.replace(model.config, n_layer=layers))
    small.load_state_dict({k: v for k, v in model.state_dict().items()
                           if not k.startswith("blocks.") or int(k.split(".")[1]) < layers}, strict=False)
    export_hf(small.eval(), out, tokenizer=tok)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("hf_dir", nargs="?")
    p.add_argument("--cut"), p.add_argument("--layers", type=int, default=6), p.add_argument("--out")
    p.add_argument("--batch", type=int, default=8), p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gen-toks", type=int, default=32), p.add_argument("--ll", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    if a.cut:
        cut(a.cut, a.layers, a.out)
        return
    torch.set_num_threads(a.threads)
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from snlp.eval.harness import SNLPLM

    rng = random.Random(0)
    words = "the cat sat on a mat while dogs ran in parks and birds flew over green hills under blue skies".split()
    ctx = [" ".join(rng.choices(words, k=rng.randint(40, 120))) for _ in range(32)]
    reqs = {"generate_until": [Instance("generate_until", {}, (c, {"until": ["\n\n"], "max_gen_toks": a.gen_toks,
                                                                    "do_sample": False}), 0) for c in ctx[:a.batch]]}
    if a.ll:
        reqs["loglikelihood"] = [Instance("loglikelihood", {}, (c, " " + " ".join(rng.choices(words, k=3))), 0)
                                 for c in ctx for _ in range(4)]
    lms = {"hf": HFLM(pretrained=a.hf_dir, device="cpu", batch_size=a.batch, dtype="float32"),
           "snlp": SNLPLM(pretrained=a.hf_dir, dtype="float32", batch_size=a.batch)}
    secs = {(n, k): [] for n in lms for k in reqs}
    answers = {}
    for r in range(a.rounds):
        for name, lm in lms.items():
            for kind, rs in reqs.items():
                t = time.perf_counter()
                out = getattr(lm, kind)(rs)
                secs[name, kind].append(time.perf_counter() - t)
                answers.setdefault((name, kind), out)
    for kind in reqs:
        h, s = secs["hf", kind], secs["snlp", kind]
        ratios = sorted(x / y for x, y in zip(h, s))
        print(f"{kind}: hf {[round(x, 2) for x in h]} median {statistics.median(h):.2f} s | snlp "
              f"{[round(x, 2) for x in s]} median {statistics.median(s):.2f} s | hf/snlp per round "
              f"{[round(x, 2) for x in ratios]} (median {statistics.median(ratios):.2f})")
    same = answers["hf", "generate_until"] == answers["snlp", "generate_until"]
    print(f"greedy answers identical: {same}")


if __name__ == "__main__":
    main()

"""Where one prefill goes, kernel by kernel: torch.profiler over one call of snlp's and the paper's sequential
forward and plan on the same shape (random weights), the top kernels by device time, and each call's totals
(kernel count, device ms, host ms).

    PYTHONPATH=$PWD python3 scripts/profile_prefill.py --paper PATH [--shape 0.5B] [--plan 24xF1-h0-K2]
        [--plan2 24xF1-h0-K4] [--tokens 2048] [--out DIR]

`--plan2` adds the same plan at another K, so one more iteration's kernels are the difference of the two.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from snlp.bench.paper_peer import (build_paper_model, load_paper_code, paper_config, paper_plan_fn,
                                   paper_sequential_fn, snlp_model_from_paper)
from snlp.bench.suite import PAPER_SHAPES
from snlp.method.plan import Plan
from snlp.method.solver import bind


def prof(fn, device, rows=14):
    for _ in range(3):
        fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts) as p:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    ev = p.key_averages()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kernels = [e for e in ev if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA")] \
        if device.type == "cuda" else []
    n_kernels = sum(e.count for e in kernels)
    dev_us = sum(getattr(e, "self_device_time_total", 0) for e in kernels)
    table = ev.table(sort_by=key, row_limit=rows, max_name_column_width=60)
    return dict(kernels=n_kernels, device_ms=dev_us / 1e3, table=table)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--paper", required=True)
    ap.add_argument("--shape", default="0.5B")
    ap.add_argument("--plan", default="24xF1-h0-K2")
    ap.add_argument("--plan2", default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    code = load_paper_code(a.paper, dtype)
    shape = next(s for s in PAPER_SHAPES if s.key == a.shape)
    if a.quick:
        shape = shape.quick()
    seq_len = max(2048, a.tokens)
    pcfg = paper_config(code, shape, 32768 if not a.quick else 256, seq_len, "SSSL")
    paper = build_paper_model(code, pcfg, dev)
    model = snlp_model_from_paper(paper, dev, dtype)  # the same weights and window widths
    idx = torch.randint(0, pcfg.vocab_size, (1, a.tokens), device=dev)
    fns = {"paper sequential": lambda: paper_sequential_fn(code, paper)(idx), "snlp sequential": lambda: model(idx)}
    for text in filter(None, (a.plan, a.plan2)):
        plan = Plan.parse(text, shape.depth)
        pf = paper_plan_fn(code, paper, plan, shape)
        r = bind(model, plan, check_finite=False)
        fns[f"paper {plan}"] = (lambda f: lambda: f(idx))(pf)
        fns[f"snlp {plan}"] = (lambda r: lambda: r(idx))(r)
    res = {}
    with torch.inference_mode():
        for name, fn in fns.items():
            res[name] = prof(fn, dev)
    summary = {k: {"kernels": v["kernels"], "device_ms": v["device_ms"]} for k, v in res.items()}
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile.txt").write_text("\n\n".join(f"== {k}: {v['kernels']} kernels, {v['device_ms']:.2f} ms "
                                                     f"device\n{v['table']}" for k, v in res.items()))
        (out / "profile.json").write_text(json.dumps(summary, indent=1))
    for k, v in res.items():
        print(f"== {k}: {v['kernels']} kernels, {v['device_ms']:.2f} ms of kernels")
        print("\n".join(v["table"].splitlines()[:18]))


if __name__ == "__main__":
    main()

"""Where one prefill goes, kernel by kernel: torch.profiler over one call of snlp's and the paper's sequential
forward and plan on the same shape (random weights), the top kernels by device time, and each call's totals
(kernel count, device ms, host ms).

    PYTHONPATH=$PWD python3 scripts/profile_prefill.py --paper PATH [--shape 0.5B] [--plan 24xF1-h0-K2]
        [--plan2 24xF1-h0-K4] [--tokens 2048] [--compiled graphs|kernels] [--out DIR]

`--plan2` adds the same plan at another K. Then a forward's kernels are split by name into what one more
iteration costs and what the plan pays once, t(K) = once + K * iter fitted per kernel name on the two plans: the
table "paid once / per iteration" (what a K = 1 plan spends beyond one evaluation of its stack).

`--compiled` profiles snlp's sequential forward and plans compiled as `snlp bench` times them (torch.compile
fullgraph): `graphs` with CUDA graphs (mode reduce-overhead, the benchmarked treatment: input copies a replay makes
show up as memcpy kernels), `kernels` without (mode default: every generated kernel launched on its own, so each is
attributed by name). The paper's code stays eager, as it runs.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from snlp.bench.paper_peer import (build_paper_model, load_paper_code, paper_config, paper_plan_fn,
                                   paper_sequential_fn, snlp_model_from_paper)
from snlp.bench.suite import PAPER_SHAPES
from snlp.decode.steps import mark_static_runner
from snlp.method.plan import Plan
from snlp.method.solver import bind


REPS = 3  # calls per profile


def prof(fn, device, rows=14, reps=REPS):
    """One profile over `reps` calls after 3 warm-up calls; kernel counts and times are per call (their mean)."""
    for _ in range(3):
        fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts) as p:
        for _ in range(reps):
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
    # per name: device kernels on CUDA; on a CPU the ops' self time (no kernels there), so the split runs anywhere
    named = kernels if device.type == "cuda" else [e for e in ev if e.self_cpu_time_total > 0]
    by_name = {}
    for e in named:
        us = getattr(e, key, 0)
        c, t = by_name.get(e.key, (0, 0.0))
        by_name[e.key] = (c + e.count / reps, t + us / 1e3 / reps)
    return dict(kernels=n_kernels / reps, device_ms=dev_us / 1e3 / reps, table=table, by_name=by_name)


def split_once(a: dict, b: dict, ka: int, kb: int, rows: int = 16) -> list[dict]:
    """Per kernel name, t(K) = once + K * iter fitted on two profiles of one plan at K = ka and kb (ka < kb):
    iter = (t_b - t_a) / (kb - ka), once = t_a - ka * iter; the rows with the largest |once| first. Names differ
    between compiles of two graphs only by a generated counter (triton_poi_fused_add_3 vs _7), so generated names
    are pooled with the counter dropped."""
    def pool(d):
        out = {}
        for name, (c, ms) in d.items():
            k = re.sub(r"_\d+$", "", name) if name.startswith(("triton_", "cpp_")) else name
            c0, t0 = out.get(k, (0, 0.0))
            out[k] = (c0 + c, t0 + ms)
        return out
    a, b = pool(a), pool(b)
    res = []
    for name in set(a) | set(b):
        (ca, ta), (cb, tb) = a.get(name, (0, 0.0)), b.get(name, (0, 0.0))
        it = (tb - ta) / (kb - ka)
        res.append(dict(name=name, calls_a=ca, ms_a=ta, calls_b=cb, ms_b=tb, iter_ms=it, once_ms=ta - ka * it))
    res.sort(key=lambda r: -abs(r["once_ms"]))
    return res[:rows]


def split_table(rows: list[dict], pa: str, pb: str) -> str:
    head = f"| kernel | calls {pa} | ms {pa} | calls {pb} | ms {pb} | per iteration ms | paid once ms |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['name'][:70]} | {r['calls_a']:g} | {r['ms_a']:.3f} | {r['calls_b']:g} | {r['ms_b']:.3f} | "
              f"{r['iter_ms']:.3f} | {r['once_ms']:.3f} |" for r in rows]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--paper", required=True)
    ap.add_argument("--shape", default="0.5B")
    ap.add_argument("--plan", default="24xF1-h0-K2")
    ap.add_argument("--plan2", default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compiled", choices=("graphs", "kernels"), default=None,
                    help="profile snlp's callables compiled: graphs = CUDA graphs (reduce-overhead, as benchmarked), "
                         "kernels = no CUDA graphs (each kernel attributed)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    shape = next(s for s in PAPER_SHAPES if s.key == a.shape)
    if a.plan2:  # checked before the paper's code is loaded or any model built
        pa, pb = Plan.parse(a.plan, shape.depth), Plan.parse(a.plan2, shape.depth)
        if replace(pa, iters=1) != replace(pb, iters=1) or pa.iters >= pb.iters:
            ap.error(f"--plan2 must be --plan at a larger K (got {a.plan} and {a.plan2})")
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    code = load_paper_code(a.paper, dtype)
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
        if a.compiled and dev.type == "cuda":
            mark_static_runner(r)  # as the benchmark does: the fused weights keep their address across replays
    if a.compiled:
        mode = "reduce-overhead" if a.compiled == "graphs" and dev.type == "cuda" else None
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8)
        for name in [n for n in fns if n.startswith("snlp ")]:
            fns[name] = torch.compile(fns[name], fullgraph=True, mode=mode)
    res = {}
    with torch.inference_mode():
        for name, fn in fns.items():
            res[name] = prof(fn, dev, reps=REPS)
    tag = f" ({a.compiled})" if a.compiled else ""
    summary = {k + (tag if k.startswith("snlp ") else ""): {"kernels": v["kernels"], "device_ms": v["device_ms"]}
               for k, v in res.items()}
    splits = {}
    if a.plan2:
        pa, pb = Plan.parse(a.plan, shape.depth), Plan.parse(a.plan2, shape.depth)
        for side in ("snlp", "paper"):
            splits[side + (tag if side == "snlp" else "")] = split_once(
                res[f"{side} {pa}"]["by_name"], res[f"{side} {pb}"]["by_name"], pa.iters, pb.iters)
    text = "\n\n".join(f"== {k}: {v['kernels']:g} kernels, {v['device_ms']:.2f} ms device per call (the table: "
                        f"totals over {REPS} calls)\n{v['table']}"
                        for k, v in res.items())
    for side, rows in splits.items():
        text += (f"\n\n== {side}: paid once / per iteration, per kernel name (t(K) = once + K * iter on {a.plan} "
                 f"and {a.plan2}; {'device' if dev.type == 'cuda' else 'CPU self'} ms)\n"
                 + split_table(rows, f"K={Plan.parse(a.plan, shape.depth).iters}",
                               f"K={Plan.parse(a.plan2, shape.depth).iters}"))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile.txt").write_text(text)
        (out / "profile.json").write_text(json.dumps(summary, indent=1))
        if splits:
            (out / "split.json").write_text(json.dumps(splits, indent=1))
    print(text)


if __name__ == "__main__":
    main()

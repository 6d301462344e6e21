"""Where one prefill goes, kernel by kernel: torch.profiler over one call of snlp's and the paper's sequential
forward and plan on the same shape (random weights), the top kernels by device time, and each call's totals
(kernel count, device ms, host ms).

    PYTHONPATH=$PWD python3 scripts/profile_prefill.py --paper PATH [--shape 0.5B] [--plan 24xF1-h0-K2]
        [--plan2 24xF1-h0-K4] [--tokens 2048] [--compiled graphs|kernels] [--out DIR]

`--plan2` adds the same plan at another K (and, on snlp's side, the plan at K = 0: embedding, prefix, init and head
only). Then a forward's kernels are split by name into what one more iteration costs and what the plan pays once,
t(K) = once + K * iter fitted per kernel name on the two plans, with t(K = 0) beside it: "stack once" = once - t(0)
is what the K = 1 plan spends beyond one evaluation of its stack and beyond the sequential work every K pays (the
table "paid once / per iteration"). Generated kernels (triton_* / cpp_*) are pooled by name without their counter,
i.e. per list of fused ops, so a pooled row may hold several kernels of one graph (its name says how many). On a CPU
there are no device kernels: the split runs over aten ops' self CPU time (a smoke test, not a measurement).

`--compiled` profiles snlp's plans (and, with `graphs` or on a CPU, the sequential forward) compiled as `snlp bench`
times them (torch.compile fullgraph): `graphs` with CUDA graphs (mode reduce-overhead, the
benchmarked treatment: input copies a replay makes show up as memcpy kernels; on a CPU, where there are no CUDA
graphs, it is refused), `kernels` without (mode default: every generated kernel launched on its own, so each is
attributed by name). The paper's code stays eager, as it runs. Each callable also reports its wall time per call
(median, host clock around a synchronise, as the benchmark times it), and on CUDA the host gap (wall minus the kernels'
device time: what a call costs before and between its kernels, the device's own gaps between a graph's kernels
included; off CUDA these figures are None) and its CUDA graph replays and single kernel launches per
call (one replay and no single launch: the forward was captured whole). A fixed per-call cost that the sequential
forward pays too shows up in t(K = 0) and in the gap, not in the split's kernels
(docs/records/2026-11-28-prefill-once.md).
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
    named = kernels if device.type == "cuda" else [e for e in ev if e.self_cpu_time_total > 0
                                                   and e.key.startswith(("aten::", "snlp::"))]
    by_name = {}
    for e in named:
        us = getattr(e, key, 0)
        c, t = by_name.get(e.key, (0, 0.0))
        by_name[e.key] = (c + e.count / reps, t + us / 1e3 / reps)
    api = runtime_launches([(e.key, e.count) for e in ev], reps)
    return dict(kernels=n_kernels / reps, device_ms=dev_us / 1e3 / reps, table=table, by_name=by_name,
                cpu_ms=sum(t for _, t in by_name.values()), wall_ms=wall_ms(fn, device), **api)


def runtime_launches(events, reps: int) -> dict:
    """Per call: CUDA graph replays (cudaGraphLaunch) and single kernel launches (cudaLaunchKernel / cuLaunchKernel /
    cudaLaunchKernelExC) the host made, from the profile's runtime events (name, count). A forward that CUDA graphs
    captured whole makes one replay and no single launch; one that inductor left uncaptured (it logs "skipping
    cudagraphs") makes a launch per kernel, each with its host gap. Both 0 on a CPU (summary_row: None)."""
    graph = sum(c for name, c in events if name == "cudaGraphLaunch")
    single = sum(c for name, c in events if name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                       "cuLaunchKernelEx"))
    return dict(graph_launches=graph / reps, kernel_launches=single / reps)


def wall_ms(fn, device, runs: int = 20) -> float:
    """Median host milliseconds per call around a device synchronise, as the benchmark times a call
    (snlp.runtime.timing.time_round_robin): the device time plus what the host spends before and between its
    kernels (guards, CUDA graph bookkeeping, input copies, launches) with the device idle."""
    import statistics

    from snlp.runtime.timing import time_round_robin

    # statistics.median: torch's Tensor.median takes the lower middle value of an even count (20 runs by default)
    return statistics.median(time_round_robin({"f": fn}, 2, runs, device)["f"])


def summary_row(v: dict, cuda: bool) -> dict:
    """A callable's per-call figures for profile.json. Off CUDA there are no device kernels and no CUDA graphs: the
    device figures are None there (not 0, which would read as a measured forward that launched nothing)."""
    keys = ("kernels", "device_ms", "graph_launches", "kernel_launches")
    row = {k: v[k] if cuda else None for k in keys}
    # wall minus the kernels' device time: the host's time before and between launches, and on a graph replay also
    # the device's own gaps between the graph's kernels (more kernels, more gaps: not host time alone)
    return {"kernels": row["kernels"], "device_ms": row["device_ms"], "wall_ms": v["wall_ms"],
            "host_gap_ms": v["wall_ms"] - v["device_ms"] if cuda else None,
            "graph_launches": row["graph_launches"], "kernel_launches": row["kernel_launches"]}


def headline(name: str, v: dict, cuda: bool) -> str:
    """The line above a callable's profile table in profile.txt."""
    if not cuda:
        return (f"== {name}: {v['wall_ms']:.2f} ms wall (median, synchronised); a CPU: no device kernels or CUDA graph "
                f"replays to count (the table: ops' CPU times, totals over {REPS} calls)")
    return (f"== {name}: {v['kernels']:g} kernels, {v['device_ms']:.2f} ms device, {v['wall_ms']:.2f} ms wall (median, "
            f"synchronised), {v['graph_launches']:g} graph replays and {v['kernel_launches']:g} single launches per "
            f"call (the table: totals over {REPS} calls)")


def pooled(d: dict) -> dict:
    """{name: (calls, ms, distinct kernels)} with generated kernels' counters dropped (triton_poi_fused_add_3 and _7
    are one row: two compiles number them differently, so rows of two graphs compare like with like)."""
    out = {}
    for name, (c, ms) in d.items():
        k = re.sub(r"_\d+$", "", name) if name.startswith(("triton_", "cpp_")) else name
        c0, t0, n0 = out.get(k, (0, 0.0, 0))
        out[k] = (c0 + c, t0 + ms, n0 + 1)
    return out


def split_once(a: dict, b: dict, ka: int, kb: int, rows: int = 16, zero: dict | None = None) -> list[dict]:
    """Per kernel name, t(K) = once + K * iter fitted on two profiles of one plan at K = ka and kb (ka < kb):
    iter = (t_b - t_a) / (kb - ka), once = t_a - ka * iter; with `zero` (the plan at K = 0), t0 beside it and
    stack_once = once - t0, the part of `once` that K = 0 does not pay. Rows with the largest |stack once| (|once|
    without K = 0) first."""
    a, b, z = pooled(a), pooled(b), pooled(zero or {})
    res = []
    for name in set(a) | set(b) | set(z):
        (ca, ta, na), (cb, tb, nb) = a.get(name, (0, 0.0, 0)), b.get(name, (0, 0.0, 0))
        it = (tb - ta) / (kb - ka)
        once = ta - ka * it
        row = dict(name=name, kernels=max(na, nb), calls_a=ca, ms_a=ta, calls_b=cb, ms_b=tb, iter_ms=it, once_ms=once)
        if zero is not None:
            c0, t0, _ = z.get(name, (0, 0.0, 0))
            row.update(calls_0=c0, ms_0=t0, stack_once_ms=once - t0)
        res.append(row)
    res.sort(key=lambda r: -abs(r.get("stack_once_ms", r["once_ms"])))
    return res[:rows]


def split_table(rows: list[dict], pa: str, pb: str) -> str:
    zero = bool(rows) and "ms_0" in rows[0]
    head = (f"| kernel | calls {pa} | ms {pa} | calls {pb} | ms {pb} | per iteration ms | paid once ms |"
            + (" ms K=0 | stack once ms |" if zero else ""))
    lines = [head, "|---" * (9 if zero else 7) + "|"]
    for r in rows:
        name = r["name"][:70] + (f" ({r['kernels']} kernels)" if r["kernels"] > 1 else "")
        lines.append(f"| {name} | {r['calls_a']:g} | {r['ms_a']:.3f} | {r['calls_b']:g} | {r['ms_b']:.3f} | "
                     f"{r['iter_ms']:.3f} | {r['once_ms']:.3f} |"
                     + (f" {r['ms_0']:.3f} | {r['stack_once_ms']:.3f} |" if zero else ""))
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
    dev = torch.device(a.device)
    for text in filter(None, (a.plan, a.plan2)):
        try:
            Plan.parse(text, shape.depth)
        except ValueError as e:
            ap.error(str(e).splitlines()[0])
    if a.plan2:  # checked before the paper's code is loaded or any model built
        pa, pb = Plan.parse(a.plan, shape.depth), Plan.parse(a.plan2, shape.depth)
        if replace(pa, iters=1) != replace(pb, iters=1) or pa.iters >= pb.iters:
            ap.error(f"--plan2 must be --plan at a larger K (got {a.plan} and {a.plan2})")
        if pa.tol:  # a tol plan may stop before K, and the fit would use a K it never ran
            ap.error(f"--plan / --plan2 with a tol stop cannot be split by K (got {a.plan})")
    if a.compiled == "graphs" and dev.type != "cuda":
        ap.error("--compiled graphs needs CUDA (CUDA graphs); on a CPU use --compiled kernels")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    code = load_paper_code(a.paper, dtype)
    if a.quick:
        shape = shape.quick()
    seq_len = max(2048, a.tokens)
    pcfg = paper_config(code, shape, 32768 if not a.quick else 256, seq_len, "SSSL")
    paper = build_paper_model(code, pcfg, dev)
    model = snlp_model_from_paper(paper, dev, dtype)  # the same weights and window widths
    idx = torch.randint(0, pcfg.vocab_size, (1, a.tokens), device=dev)
    fns = {"paper sequential": lambda: paper_sequential_fn(code, paper)(idx)}
    if a.compiled != "kernels" or dev.type != "cuda":  # eager, graphs (its host gap and replays: the baseline's
        fns["snlp sequential"] = lambda: model(idx)     # fixed per-call cost, which t(K = 0) shares) and the CPU smoke
    plans = [Plan.parse(t, shape.depth) for t in filter(None, (a.plan, a.plan2))]
    k0 = replace(plans[0], iters=0) if a.plan2 else None
    for plan in plans:
        pf = paper_plan_fn(code, paper, plan, shape)
        fns[f"paper {plan}"] = (lambda f: lambda: f(idx))(pf)
    for plan in ([k0] if k0 else []) + plans:
        r = bind(model, plan, check_finite=False)
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
    cuda = dev.type == "cuda"
    summary = {k + (tag if k.startswith("snlp ") else ""): summary_row(v, cuda) for k, v in res.items()}
    splits = {}
    if a.plan2:
        pa, pb = plans  # parsed at the profiled (maybe --quick) depth
        for side in ("snlp", "paper"):
            zero = res[f"snlp {k0}"]["by_name"] if side == "snlp" else None
            splits[side + (tag if side == "snlp" else "")] = split_once(
                res[f"{side} {pa}"]["by_name"], res[f"{side} {pb}"]["by_name"], pa.iters, pb.iters, zero=zero)
    text = "\n\n".join(f"{headline(k, v, cuda)}\n{v['table']}" for k, v in res.items())
    for side, rows in splits.items():
        t0, t1, t2 = (res[f"snlp {p}"]["device_ms" if dev.type == "cuda" else "cpu_ms"] for p in (k0, pa, pb))
        lin = (f"; whole forward t(0) / t({pa.iters}) / t({pb.iters}) = {t0:.3f} / {t1:.3f} / {t2:.3f} ms"
               if side.startswith("snlp") else "")
        text += (f"\n\n== {side}: paid once / per iteration, per kernel name (t(K) = once + K * iter on {a.plan} "
                 f"and {a.plan2}{', t(0) from ' + str(k0) if side.startswith('snlp') else ''}; "
                 f"{'device' if dev.type == 'cuda' else 'CPU self'} ms{lin})\n"
                 + split_table(rows, f"K={pa.iters}", f"K={pb.iters}"))
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

"""The FlexAttention window kernel (snlp.model.ops.set_window_kernel("flex")) against the others, three ways:

    PYTHONPATH=$PWD python3 scripts/flex_windows.py kernels [--device cpu] [--json F]
        one attention call (a windowed layer; a fused stack of mixed windows), thread time on the CPU (one thread) or
        device events on CUDA: masked SDPA, banded (eager), FlexAttention compiled; max abs error against the naive
        masked reference. CPU: T = 4096, w = 256 and T = 2048, w = 512 (the shapes `auto` was chosen on).
    PYTHONPATH=$PWD python3 scripts/flex_windows.py counts [--json F]
        kernels per compiled forward (inductor's generated code, counted by kind) of a small windowed model, sequential
        and a fused plan, under the masked and the flex kernel (CPU).
    PYTHONPATH=$PWD python3 scripts/flex_windows.py forward [--pattern S|SSSL] [--json F]
        whole compiled forwards on the CPU (scripts/window_cost.py's model, T = 4096, window 256): the sequential
        forward, 6xF1-h0-K1 and 3xF2-h0-K1 under the masked, banded and flex kernels, thread time, one thread.
    PYTHONPATH=$PWD python3 scripts/flex_windows.py prefill [--device cuda] [--quick] [--out DIR]
        the GPU campaign's `flex` part: the 0.5B-nox0ve shape (SSSL, short window 512, T = 2048, bf16), its
        sequential forward and `12xF2-h0-K1`, `12xF2-h0-K2`, each compiled (fullgraph; CUDA graphs on CUDA) once per
        window kernel (masked, flex), timed round-robin in one process; logits of flex against masked checked first.
        --quick: the shape shrunk to CPU smoke size (width 64, T = 64, window 8).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from snlp.model import ops
from snlp.runtime.device import write_atomic


def _thread_ms(fn, runs: int) -> float:
    """Median thread CPU time of the calling thread (robust to other processes on a shared box); the process CPU
    time of the same calls must agree (a kernel that spread work over other threads would show there only)."""
    fn()
    ts, ps = [], []
    for _ in range(runs):
        t, p = time.thread_time(), time.process_time()
        fn()
        ts.append((time.thread_time() - t) * 1e3)
        ps.append((time.process_time() - p) * 1e3)
    _thread_ms.process_ms = statistics.median(ps)
    return statistics.median(ts)


def _cuda_ms(fn, runs: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _reference(q, k, v, windows, rows):
    """Naive masked reference in fp64: per entry n its window windows[n // rows] (w < 0: causal)."""
    N, Hq, T, _ = q.shape
    rep = Hq // k.shape[1]
    w = torch.tensor([windows[n // rows] for n in range(N)], device=q.device)[:, None, None, None]
    i = torch.arange(T, device=q.device)[:, None]
    d = i - i.T
    allowed = (d >= 0) & ((w < 0) | (d <= w))  # (N, 1, T, T)
    return F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(rep, 1),
                                          v.double().repeat_interleave(rep, 1), attn_mask=allowed)


def in_kernel(kind, fn):
    prev = ops.set_window_kernel(kind)
    try:
        return fn()
    finally:
        ops.set_window_kernel(prev)


def kernels(a) -> dict:
    dev = torch.device(a.device)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    dt = torch.float32 if dev.type == "cpu" else torch.bfloat16
    timer = _thread_ms if dev.type == "cpu" else _cuda_ms
    out = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "clock": "thread time, 1 thread" if dev.type == "cpu" else "CUDA events", "rows": []}
    flex = torch.compile(ops.flex_window_attention, fullgraph=True, dynamic=False)
    shapes = [(4096, 256), (2048, 512)] if not a.quick else [(256, 32)]
    for T, w in shapes:
        for case, windows in (("layer", (w,)), ("stack", (w,) * (3 * a.branches // 4) + (-1,) * (a.branches // 4))):
            torch.manual_seed(0)
            N = len(windows)
            q, k, v = (torch.randn(N, a.heads, T, a.head_dim, device=dev, dtype=dt) for _ in range(3))
            ref = _reference(q, k, v, windows, 1)
            groups = ops.window_groups(windows, dev)
            wt = torch.tensor(windows, device=dev)  # (N,) one window per branch

            def run(kind):
                prev = ops.set_window_kernel(kind)
                try:
                    if case == "layer":
                        return ops.attend(q, k, v, w, masks={})
                    if kind == "banded":
                        return ops.attend_branches(q, k, v, windows, groups, {})
                    return ops.attend(q, k, v, wt, masks={})  # one masked SDPA over every branch
                finally:
                    ops.set_window_kernel(prev)

            banded = "banded" if case == "layer" else "grouped by window, banded"
            fns = {"masked (eager)": lambda: run("masked"), f"{banded} (eager)": lambda: run("banded"),
                   "masked (compiled)": lambda: in_kernel("masked", compiled["masked"]),
                   f"{banded} (compiled)": lambda: in_kernel("banded", compiled["banded"]),
                   "flex (compiled)": lambda: flex(q, k, v, w if case == "layer" else wt, 1)}
            # attend / attend_branches compiled, the kernel read while tracing (each its own graph)
            compiled = {kind: torch.compile(lambda: (ops.attend(q, k, v, w) if case == "layer" else
                                                     ops.attend_branches(q, k, v, windows, groups) if kind == "banded"
                                                     else ops.attend(q, k, v, wt)), fullgraph=True, dynamic=False)
                        for kind in ("masked", "banded")}
            with torch.inference_mode():
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    y = fn()
                    first = time.perf_counter() - t0
                    err = (y.double() - ref).abs().max().item()
                    ms = timer(fn, a.runs)
                    pms = getattr(timer, "process_ms", None)
                    out["rows"].append(dict(T=T, window=w, case=case, branches=N, heads=a.heads, formulation=name,
                                            ms=ms, process_ms=pms, max_abs_err=err, first_call_s=first))
                    print(f"| {T} | {w} | {case} | {N} | {name} | {ms:.2f} | "
                          f"{'-' if pms is None else f'{pms:.2f}'} | {err:.1e} | {first:.1f} |", flush=True)
    return out


_CALL = re.compile(r"^\s*(?:buf\w+ = )?(cpp_\w+|extern_kernels\.\w+|torch\.ops\.[\w.]+|\w+\.run)\(")


def count_calls(code: str) -> dict:
    """Kernel launches in inductor's generated `call` (one forward): generated kernels (cpp_* / triton .run),
    extern kernels (matmuls, SDPA) and aten fallbacks (torch.ops.*), by kind."""
    body = code[code.find("def call("):]
    counts = {"generated": 0, "extern": 0, "aten fallback": 0}
    names: dict[str, int] = {}
    for line in body.splitlines():
        m = _CALL.match(line)
        if not m:
            continue
        name = m.group(1)
        kind = "extern" if name.startswith("extern_kernels") else "aten fallback" if name.startswith("torch.ops") \
            else "generated"
        counts[kind] += 1
        key = name if kind != "generated" else ("flex template" if "flex" in name else "fused")
        names[key] = names.get(key, 0) + 1
    return {**counts, "total": sum(counts.values()), "by_name": names}


def counts(a) -> dict:
    from torch._inductor.utils import run_and_get_code

    from snlp import GPT, GPTConfig, bind

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, n_layer=8, n_head=2, n_kv_head=2, n_embd=128, sequence_len=512,
                    window_pattern="SSSL", short_window=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights(seed=0)
    model.eval()
    idx = torch.randint(0, 256, (1, 512))
    out = {"model": "depth 8, width 128 (2 heads of 64), SSSL, window 128, T = 512, fp32, CPU inductor",
           "torch": torch.__version__, "rows": []}
    with torch.inference_mode():
        for plan in (None, "4xF2-h0-K1", "4xF2-h0-K2"):
            r = bind(model, plan, check_finite=False) if plan else model
            for kind in ("masked", "flex"):
                ops.set_window_kernel(kind)
                torch._dynamo.reset()
                _, codes = run_and_get_code(torch.compile(lambda: r(idx), fullgraph=True, dynamic=False))
                c = count_calls(codes[-1])
                out["rows"].append(dict(forward=plan or "sequential", kernel=kind, **c))
                print(f"| {plan or 'sequential'} | {kind} | {c['total']} | {c['generated']} | {c['extern']} | "
                      f"{c['aten fallback']} | {c['by_name']} |", flush=True)
    ops.set_window_kernel("auto")
    return out


def prefill(a, save=lambda out: None) -> dict:
    from snlp import bind
    from snlp.bench.forward import COMPILE_CALLS, compile_step
    from snlp.bench.suite import PAPER_SHAPES
    from snlp.decode.steps import mark_static_runner
    from snlp.model.gpt import GPT
    from snlp.runtime.timing import now, sync, time_round_robin

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    shape = next(s for s in PAPER_SHAPES if s.key == "0.5B-nox0ve")
    T, w = (64, 8) if a.quick else (2048, 512)
    if a.quick:
        shape = shape.quick()
    cfg = shape.config(256 if a.quick else 32768, "SSSL", w, T)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights(seed=0)
    with torch.no_grad():  # init zeroes the output projections: attention would not reach the logits to be checked
        for prm in model.parameters():
            prm.add_(torch.randn_like(prm) * 0.02)
    model = model.to(dev, torch.bfloat16 if cuda else torch.float32).eval()
    idx = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(0)).to(dev)
    plans = ["12xF2-h0-K1", "12xF2-h0-K2"]
    runners = {p: bind(model, p, check_finite=False) for p in plans}
    if cuda:
        for r in runners.values():
            mark_static_runner(r)
    targets = {"sequential": lambda: model(idx), **{p: (lambda r: lambda: r(idx))(r) for p, r in runners.items()}}
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "shape": shape.key, "T": T, "window": w, "pattern": "SSSL", "dtype": "bfloat16" if cuda else "float32",
           "cuda_graphs": cuda, "compile_s": {}, "max_abs_diff_logits": {}, "rows": [], "failures": [],
           "flex_taken": cuda or ops.CPU_FLEX_THREADS_SAFE}  # torch < 2.13 takes no CPU flex (snlp.model.ops)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    with torch.inference_mode():
        for name, fn in targets.items():  # per forward: compile both kernels, then time them round-robin, then save
            ref, fns = None, {}
            for kind in ("masked", "flex"):
                cfn = compile_step(fn, dev)

                def call(cfn=cfn, kind=kind):  # the kernel is read while tracing: each variant guards on its own
                    ops.set_window_kernel(kind)
                    return cfn()
                label = f"{name} / {kind}"
                try:
                    t0 = now(dev)
                    for _ in range(COMPILE_CALLS):
                        y = call()
                    sync(dev)
                    out["compile_s"][label] = now(dev) - t0
                    y = y.float().clone()
                except Exception as e:  # noqa: BLE001  (recorded; the other variants still run)
                    out["failures"].append(f"{label}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
                    continue
                if kind == "masked":
                    ref = y
                elif ref is not None:
                    out["max_abs_diff_logits"][name] = (y - ref).abs().max().item()
                fns[label] = call
                print(f"compiled {label} in {out['compile_s'][label]:.1f} s", flush=True)
            times = time_round_robin(fns, a.warmup, a.runs, dev)
            for label, ts in times.items():
                kind = label.split(" / ")[1]
                base = times.get(f"{name} / masked")
                out["rows"].append(dict(forward=name, kernel=kind, median_ms=statistics.median(ts), p10_ms=_q(ts, 0.1),
                                        p90_ms=_q(ts, 0.9), runs=len(ts), vs_masked=None if base is None else
                                        statistics.median(base) / statistics.median(ts)))
            save(out)  # a part cut short by its time limit keeps the forwards it finished
    ops.set_window_kernel("auto")
    return out


def forward(a) -> dict:
    """Whole compiled forwards on the CPU: scripts/window_cost.py's model (depth 8, width 256, every layer but the
    last with a 256-token window; --pattern SSSL mixes full layers in), T = 4096, fp32, one thread, thread time:
    the sequential forward and two plans, compiled under each window kernel."""
    import snlp

    torch.set_num_threads(1)
    T, w = (256, 32) if a.quick else (4096, 256)
    cfg = snlp.GPTConfig.from_depth(8, width=256, head_dim=64, vocab_size=512, window_pattern=a.pattern,
                                    short_window=w, sequence_len=T)
    torch.manual_seed(0)
    model = snlp.GPT(cfg)
    model.init_weights(seed=0)
    with torch.no_grad():  # init zeroes the output projections: attention would not reach the compared logits
        for prm in model.parameters():
            prm.add_(torch.randn_like(prm) * 0.02)
    model.eval()
    idx = torch.randint(0, 512, (1, T))
    out = {"T": T, "window": w, "pattern": a.pattern, "clock": "thread time, 1 thread", "rows": []}
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    with torch.inference_mode():
        for plan in (None, "6xF1-h0-K1", "3xF2-h0-K1"):
            r = snlp.bind(model, plan, check_finite=False) if plan else model
            ref = None
            for kind in ("masked", "banded", "flex"):
                ops.set_window_kernel(kind)
                torch._dynamo.reset()
                c = torch.compile(lambda: r(idx), fullgraph=True, dynamic=False)
                t0 = time.perf_counter()
                y = c()
                first = time.perf_counter() - t0
                ref = y if ref is None else ref
                ms = _thread_ms(c, a.runs)
                row = dict(forward=plan or "sequential", kernel=kind, ms=ms, compile_s=first,
                           max_abs_diff_vs_masked=(y - ref).abs().max().item())
                out["rows"].append(row)
                print(f"| {row['forward']} | {kind} | {ms:.0f} | {first:.0f} | {row['max_abs_diff_vs_masked']:.1e} |",
                      flush=True)
    ops.set_window_kernel("auto")
    return out


def _q(ts, p):
    s = sorted(ts)
    return s[min(len(s) - 1, int(p * len(s)))]


def prefill_markdown(out: dict) -> str:
    lines = [f"## FlexAttention window kernel, compiled prefill ({out['device']}, {out['shape']}, {out['pattern']} "
             f"window {out['window']}, T = {out['T']}, {out['dtype']}" + (", CUDA graphs" if out["cuda_graphs"] else "")
             + ")", "",
             "| forward | kernel | median ms (p10-p90) | masked / this | compile s | max abs diff vs masked |",
             "|---|---|---|---|---|---|"]
    if not out["cuda_graphs"]:
        lines[1:1] = ["", "Smoke run off a GPU: the shapes and the device are not the ones the kernels are chosen for; "
                      "the timings below check that each path runs, they compare nothing.", ""]
    if not out.get("flex_taken", True):
        lines[1:1] = ["", f"torch {out['torch']} on the CPU: snlp takes no FlexAttention there "
                      "(ops.CPU_FLEX_THREADS_SAFE), so the \"flex\" rows time the kernel it falls back to.", ""]
    base = {r["forward"]: r for r in out["rows"] if r["kernel"] == "masked"}
    for r in out["rows"]:
        label = f"{r['forward']} / {r['kernel']}"
        diff = out["max_abs_diff_logits"].get(r["forward"]) if r["kernel"] == "flex" else None
        vs = "-" if r["vs_masked"] is None or r["kernel"] == "masked" else f"{r['vs_masked']:.2f}x"
        m = base.get(r["forward"])
        if m is not None and r is not m and (m["p10_ms"] <= r["median_ms"] <= m["p90_ms"]
                                             and r["p10_ms"] <= m["median_ms"] <= r["p90_ms"]):
            vs += " (tie: each median inside the other's p10-p90)"
        lines.append(f"| {r['forward']} | {r['kernel']} | {r['median_ms']:.2f} ({r['p10_ms']:.2f}-{r['p90_ms']:.2f}) | "
                     f"{vs} | {out['compile_s'].get(label, float('nan')):.1f} | "
                     f"{'-' if diff is None else f'{diff:.1e}'} |")
    lines += [f"- FAILED {f}" for f in out["failures"]]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["kernels", "counts", "prefill", "forward"])
    p.add_argument("--pattern", default="S", help="forward: the model's window pattern")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--branches", type=int, default=8)
    p.add_argument("--runs", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None, help="prefill: write flex.json and flex.md here")
    a = p.parse_args()
    a.runs = a.runs or (3 if a.quick or a.what != "prefill" else 50)
    a.warmup = a.warmup or (1 if a.quick else 10)
    if a.what == "kernels":
        print("| T | window | case | branches | formulation | ms | process ms | max abs err | first call s |\n"
              "|---|---|---|---|---|---|---|---|---|")
        out = kernels(a)
    elif a.what == "forward":
        print("| forward | kernel (compiled) | ms | compile s | max abs diff vs masked |\n|---|---|---|---|---|")
        out = forward(a)
    elif a.what == "counts":
        print("| forward | kernel | launches | generated | extern | aten fallback | by name |\n"
              "|---|---|---|---|---|---|---|")
        out = counts(a)
    else:
        def save(out):
            if a.out:  # rewritten after every forward: a limit's kill mid-write keeps the previous pair whole (atomic
                # writes), and the .md goes first, so a flex.json (what campaign_table looks for) always has its .md
                write_atomic(Path(a.out) / "flex.md", prefill_markdown(out))
                write_atomic(Path(a.out) / "flex.json", json.dumps(out, indent=1))
        out = prefill(a, save)
        save(out)
        print(prefill_markdown(out))
        if out["failures"]:
            raise SystemExit(1)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""What a compiled SNLP plan runs once per call beyond one evaluation of its stack, counted on the CPU.

    PYTHONPATH=$PWD python3 scripts/prefill_once.py [--shape 0.5B-nox0ve] [--plan 12xF2-h0] [--iters 0,1,2,3]
        [--width 80] [--head-dim 16] [--tokens 256] [--kernels masked,flex] [--out DIR]

The campaign times `torch.compile(lambda: runner(idx), fullgraph=True)` (mode "reduce-overhead" on CUDA, CUDA
graphs; snlp.bench.vs_paper, snlp.bench.forward.compile_step) and the sequential forward the same way. This compiles
the same callables with inductor on the CPU, at the shape's depth and plan but a small width and T (the kernels
inductor generates, their order and the graph structure do not depend on the width or T; their bytes do), and
reports for the sequential forward and the plan at each K:

- graphs: how many graphs dynamo made (one per callable: under CUDA graphs, one replay per call, no host gap);
- launches in inductor's generated `call` by kind (generated kernels, extern GEMMs, aten fallbacks) and the
  stack's once-only launches: the multiset t(K=1) - t(K=0) - (t(K=2) - t(K=1)) of launch names (generated
  kernels pooled without their counter). Empty means K = 1 launches exactly the K = 0 forward (embedding, prefix,
  head) plus one iteration;
- graph inputs at the real width (the shape's model on `meta`, T = 2048, bf16, traced by dynamo without
  compiling): which ones CUDA graphs treat as static (parameters, buffers, `mark_static_runner`'s fused weights)
  and which ones a replay copies into its static buffers, with their bytes;
- dynamo's guard check per call, host microseconds on this CPU (it runs before every replay).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from snlp.bench.suite import PAPER_SHAPES
from snlp.decode.steps import mark_static_runner
from snlp.method.plan import Plan
from snlp.method.solver import bind
from snlp.model import ops
from snlp.model.gpt import GPT

from host_per_call import guard_check  # noqa: E402  (a sibling script, not a package)

_LAUNCH = re.compile(r"\s*(?:buf\d+ = )?(cpp_fused\w+|triton_\w+|extern_kernels\.\w+|torch\.ops\.[\w.]+)\(")


def launches(code: str) -> list[str]:
    """The launches of inductor's generated `call` (one forward), in order: generated kernels without their
    counter (cpp_fused_add_3 and _7 are one name: two compiles number them differently), extern kernels and
    aten fallbacks by name."""
    body = code[code.find("def call("):]
    out = []
    for line in body.splitlines():
        m = _LAUNCH.match(line)
        if m:
            name = m.group(1)
            out.append(re.sub(r"_\d+$", "", name) if name.startswith(("cpp_", "triton_")) else name)
    return out


def kind(name: str) -> str:
    return "extern" if name.startswith("extern_kernels") else "aten fallback" if name.startswith("torch.ops") \
        else "generated"


def stack_once(k0: list[str], k1: list[str], k2: list[str]) -> dict[str, int]:
    """Launches the K = 1 forward makes beyond the K = 0 forward and one iteration (K = 2 minus K = 1), by name;
    negative counts are launches one iteration makes that K = 1 does not. Empty: nothing is paid once."""
    once = Counter(k1)
    once.subtract(k0)
    once.subtract(Counter(k2) - Counter(k1))
    return {n: c for n, c in sorted(once.items()) if c}


def graph_inputs(fn) -> dict:
    """Trace `fn` (no arguments) with dynamo, fullgraph, without compiling, and list its graph inputs: source,
    shape, dtype, bytes and whether CUDA graphs treat it as static (dynamo's _dynamo_static_input_type, set on
    parameters, buffers and mark_static_address'ed tensors; every other input is copied in on every replay)."""
    seen = {}

    def capture(gm, example_inputs):
        rows = []
        for node, ex in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
            static = bool(node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"))
            t = ex if isinstance(ex, torch.Tensor) else None
            rows.append(dict(source=str(getattr(node, "_dynamo_source", None)), static=static,
                             shape=list(t.shape) if t is not None else None, dtype=str(t.dtype) if t is not None else None,
                             bytes=t.numel() * t.element_size() if t is not None else 0))
        seen.setdefault("graphs", []).append(rows)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=capture)()
    rows = [r for g in seen["graphs"] for r in g]
    copied = [r for r in rows if not r["static"]]
    return dict(graphs=len(seen["graphs"]), inputs=len(rows), static=len(rows) - len(copied),
                static_mb=sum(r["bytes"] for r in rows if r["static"]) / 2**20,
                copied=copied, copied_bytes=sum(r["bytes"] for r in copied))


def guard_us(fn, reps: int = 2000) -> float:
    """Host microseconds of dynamo's guard check of the compiled `fn` (a closure of no argument), on this CPU: the
    check host_per_call.guard_check finds (the graph whose guards pass on fn's frame), back to back."""
    check, _, _ = guard_check(fn)
    t = time.perf_counter()
    for _ in range(reps):
        check()
    return (time.perf_counter() - t) / reps * 1e6


def callables(model: GPT, idx, plans: list[Plan], static: bool) -> dict:
    """The benchmark's callables: the sequential forward and a bound runner per plan (fused weights marked static,
    as snlp.bench.vs_paper does on CUDA)."""
    fns = {"sequential": (lambda: model(idx))}
    for p in plans:
        r = bind(model, p, check_finite=False)
        if static:
            mark_static_runner(r)
        fns[str(p)] = (lambda r: lambda: r(idx))(r)
    return fns


def count(shape, plans: list[Plan], width: int, head_dim: int, T: int, kernel: str) -> dict:
    """Compile every callable with inductor on the CPU at a small width and T; launches and guard time."""
    from torch._inductor.utils import run_and_get_code

    small = replace(shape, width=width, head_dim=head_dim)
    cfg = small.config(512, "SSSL", max(1, T // 4), T)  # the campaign's short window is T / 4 (512 of 2048)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights(seed=0)
    model.eval()
    idx = torch.randint(0, cfg.vocab_size, (1, T))
    ops.set_window_kernel(kernel)
    rows = {}
    try:
        with torch.inference_mode():
            for name, fn in callables(model, idx, plans, static=True).items():
                torch._dynamo.reset()
                cfn = torch.compile(fn, fullgraph=True)
                _, codes = run_and_get_code(cfn)
                names = [n for c in codes for n in launches(c)]
                kinds = Counter(map(kind, names))
                rows[name] = dict(graphs=len(codes), launches=len(names), by_kind=dict(kinds), names=names,
                                  guard_us=guard_us(fn))
                print(f"{kernel} {name}: {len(codes)} graph(s), {len(names)} launches {dict(kinds)}, "
                      f"guards {rows[name]['guard_us']:.0f} us", flush=True)
    finally:
        ops.set_window_kernel("auto")
    return rows


def real_inputs(shape, plans: list[Plan], T: int = 2048) -> dict:
    cfg = shape.config(32768, "SSSL", 512, T)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    idx = torch.zeros(1, T, dtype=torch.long, device="meta")
    with torch.inference_mode():
        return {name: graph_inputs(fn) for name, fn in callables(model, idx, plans, static=True).items()}


def _name(source: str) -> str:
    """A dynamo source's variable name (LocalSource(local_name='idx', ...) -> idx), or the source as written."""
    m = re.search(r"_name='([^']+)'", source)
    return m.group(1) if m else source


def markdown(out: dict) -> str:
    lines = []
    for kernel, rows in out["counts"].items():
        lines += [f"### kernel {kernel}: {out['small']}", "",
                  "| forward | graphs | launches | generated | extern | aten fallback | guard check us (this CPU) |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in rows.items():
            k = r["by_kind"]
            lines.append(f"| `{name}` | {r['graphs']} | {r['launches']} | {k.get('generated', 0)} | "
                         f"{k.get('extern', 0)} | {k.get('aten fallback', 0)} | {r['guard_us']:.0f} |")
        lines += ["", f"stack once-only launches (K=1 - K=0 - one iteration): {out['once'][kernel] or 'none'}", ""]
    lines += [f"### graph inputs at the real width ({out['real']})", "",
              "| forward | graphs | inputs | static (CUDA graphs keep them) | static MB | copied per replay |",
              "|---|---|---|---|---|---|"]
    for name, r in out["inputs"].items():
        cp = ", ".join(f"{_name(c['source'])} {c['shape']} {c['bytes']} B" for c in r["copied"]) or "none"
        lines.append(f"| `{name}` | {r['graphs']} | {r['inputs']} | {r['static']} | {r['static_mb']:.1f} | {cp} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5B-nox0ve", choices=[s.key for s in PAPER_SHAPES])
    ap.add_argument("--plan", default="12xF2-h0", help="the plan without its K (C x F M - init)")
    ap.add_argument("--iters", default="0,1,2,3", help="the Ks to compile; 0, 1 and 2 give the once-only split")
    ap.add_argument("--width", type=int, default=80)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--kernels", default="masked,flex", help="window kernels (snlp.model.ops.set_window_kernel)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    shape = next(s for s in PAPER_SHAPES if s.key == a.shape)
    try:
        ks = [int(k) for k in a.iters.split(",")]
        plans = [Plan.parse(f"{a.plan}-K{k}", shape.depth) for k in ks]
    except ValueError as e:
        ap.error(str(e).splitlines()[0])
    if a.width % a.head_dim:
        ap.error(f"--width {a.width} must be a multiple of --head-dim {a.head_dim}")
    torch.set_num_threads(1)
    out = dict(torch=torch.__version__, shape=shape.key, plan=a.plan, iters=ks,
               small=f"depth {shape.depth}, width {a.width} ({a.width // a.head_dim} heads of {a.head_dim}), "
                     f"T = {a.tokens}, window {max(1, a.tokens // 4)}, fp32, CPU inductor",
               real=f"{shape.key}: depth {shape.depth}, width {shape.width}, T = 2048, bf16, on meta",
               counts={}, once={})
    out["inputs"] = real_inputs(shape, plans)
    for kernel in a.kernels.split(","):
        rows = count(shape, plans, a.width, a.head_dim, a.tokens, kernel)
        out["counts"][kernel] = rows
        by_k = {p.iters: rows[str(p)]["names"] for p in plans}
        out["once"][kernel] = stack_once(by_k[0], by_k[1], by_k[2]) if {0, 1, 2} <= set(by_k) else None
    text = markdown(out)
    if a.out:
        d = Path(a.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "prefill_once.json").write_text(json.dumps(out, indent=1))
        (d / "prefill_once.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

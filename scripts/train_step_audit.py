"""What one `snlp train` step dispatches, eager vs compiled, counted on the CPU with torch.profiler (op counts do
not depend on the width, so a narrow model of the 0.5B shape's depth and window pattern stands in for it):

- leaf aten ops per phase (forward + backward; clip_grad_norm_; the optimizers' step; zero_grad): on CUDA each
  leaf op is at least one kernel launch; inductor's own fused kernels are counted from torch._inductor.metrics
  (generated_kernel_count, forward + backward graph) since they are not aten ops;
- host syncs: aten::_local_scalar_dense (every .item() / float() / bool() of a tensor) per phase;
- dynamo: graphs, graph breaks, recompiles of the compiled step over several steps;
- the Muon parameter list: matrices, distinct shapes (what a shape-stacked Newton-Schulz would batch).

    PYTHONPATH=$PWD nice -n 10 python scripts/train_step_audit.py [--depth 32 --compile-depth 8]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch._inductor.metrics
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from snlp.bench.launches import leaf_ops
from snlp.model.config import GPTConfig
from snlp.model.gpt import GPT
from snlp.train.compiled import CompiledStep
from snlp.train.config import TrainConfig
from snlp.train.job import TrainStep
from snlp.train.muon import Muon
from snlp.train.optim import build_optimizers
from snlp.train.regularizer import RegConfig


def build(depth: int, width: int, T: int, reg: RegConfig, compiled: bool):
    mcfg = GPTConfig.from_depth(depth, width=width, head_dim=32, vocab_size=512, sequence_len=T,
                                window_pattern="SSSL", short_window=T // 4)
    torch.manual_seed(0)
    model = GPT(mcfg)
    model.init_weights(seed=0)
    model.train()
    opts = build_optimizers(model, TrainConfig(out="", optimizer="muon", compile=compiled))
    step = TrainStep(model, reg)
    return model, opts, (CompiledStep(step, "cpu") if compiled else step)


def phases(model, opts, fn, x, y, lam) -> dict:
    out = {}
    with profile(activities=[ProfilerActivity.CPU]) as p:
        loss, ce, _ = fn(x, y, lam)
        loss.backward()
    out["forward+backward"] = leaf_ops(p)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    out["clip_grad_norm"] = leaf_ops(p)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for o in opts:
            o.step()
    out["optimizer step"] = leaf_ops(p)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for o in opts:
            o.zero_grad(set_to_none=True)
        float(ce)
    out["zero_grad + log read"] = leaf_ops(p)
    return out


def optimizer_setup(a, stack: bool):
    """The audit's model, optimizers (Muon per matrix or stacked) and step function, with one fixed batch."""
    model, opts, fn = build(a.depth, a.width, a.seq_len, RegConfig(), False)
    for o in opts:
        if isinstance(o, Muon):
            o.stack = stack
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 512, (a.batch, a.seq_len), generator=g) for _ in range(2))
    return model, opts, fn, x, y


def time_optimizer(a) -> None:
    """Host cost of the optimizer step at the full depth with a narrow model (dispatch dominates): the run's
    optimizers with Muon per matrix and stacked, round-robin, thread time per step, median (p10-p90)."""
    import statistics
    import time

    runs = {}
    for stack in (False, True):
        model, opts, fn, x, y = optimizer_setup(a, stack)
        fn(x, y, 0.0)[0].backward()
        grads = [(p, p.grad.clone()) for p in model.parameters() if p.grad is not None]
        runs["stacked" if stack else "per matrix"] = (opts, grads)
    times = {k: [] for k in runs}
    for r in range(a.time_optimizer + 2):
        for k, (opts, grads) in runs.items():
            for p, gr in grads:
                p.grad = gr
            c0 = time.thread_time()
            for o in opts:
                o.step()
            if r >= 2:
                times[k].append((time.thread_time() - c0) * 1e3)
    for k, v in times.items():
        q = statistics.quantiles(v, n=10, method="inclusive")
        print(f"optimizer step, depth {a.depth} width {a.width}, Muon {k}: {statistics.median(v):.2f} ms thread "
              f"({q[0]:.2f}-{q[-1]:.2f}), {len(v)} rounds")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--compile-depth", type=int, default=8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--time-optimizer", type=int, default=0, metavar="ROUNDS",
                    help="only time the optimizer step, Muon per matrix vs stacked, round-robin (thread ms)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.time_optimizer:
        return time_optimizer(a)
    report = {}
    for stack in (False, True):  # the optimizer alone at the full depth: torch's per-matrix loop vs stacked
        model, opts, fn, x, y = optimizer_setup(a, stack)
        for _ in range(2):
            fn(x, y, 0.0)[0].backward()
            with profile(activities=[ProfilerActivity.CPU]) as p:
                for o in opts:
                    o.step()
            for o in opts:
                o.zero_grad(set_to_none=True)
        c = leaf_ops(p)
        print(json.dumps({f"optimizer step, depth {a.depth}, Muon {'stacked' if stack else 'per matrix'}":
                          {"launches": sum(v for k, v in c.items() if k != "sync"),
                           "matmuls": sum(v for k, v in c.items() if "mm" in k),
                           "top": c.most_common(6)}}), flush=True)
    for reg_name, reg in (("none", RegConfig()), ("idn", RegConfig(surrogate="idn", lam=0.5, suffixes=(24,)))):
        for compiled in (False, True):
            depth = a.compile_depth if compiled else a.depth
            r = RegConfig(surrogate="idn", lam=0.5, suffixes=(min(24, depth - 1),)) if reg.active else reg
            model, opts, fn = build(depth, a.width, a.seq_len, r, compiled)
            g = torch.Generator().manual_seed(0)
            x, y = (torch.randint(0, 512, (a.batch, a.seq_len), generator=g) for _ in range(2))
            lam = 0.5 if r.active else 0.0
            counters.clear()
            torch._inductor.metrics.reset()
            for _ in range(2):  # warm-up: compiles (the compiled step), creates the optimizer states
                loss = fn(x, y, lam)[0]
                loss.backward()
                for o in opts:
                    o.step()
                    o.zero_grad(set_to_none=True)
            kernels = torch._inductor.metrics.generated_kernel_count
            with torch._dynamo.config.patch(error_on_recompile=True):
                ph = phases(model, opts, fn, x, y, lam)
            key = f"{'compiled' if compiled else 'eager'}-{reg_name} (depth {depth})"
            report[key] = {
                "leaf_aten_ops": {k: sum(n for op, n in v.items() if op != "sync") for k, v in ph.items()},
                "host_syncs": {k: v.get("sync", 0) for k, v in ph.items()},
                "top_ops_fwd_bwd": ph["forward+backward"].most_common(8),
                "top_ops_optimizer": ph["optimizer step"].most_common(8),
                "inductor_kernels_generated": kernels if compiled else None,
                "graphs": counters["stats"]["unique_graphs"] if compiled else None,
                "graph_breaks": sum(counters["graph_break"].values()) if compiled else None,
            }
            muon = [p for o in opts if isinstance(o, Muon) for g_ in o.param_groups for p in g_["params"]]
            report[key]["muon_matrices"] = len(muon)
            report[key]["muon_shapes"] = sorted({tuple(p.shape) for p in muon})
            print(json.dumps({key: report[key]}), flush=True)
            torch._dynamo.reset()
    print("\n| step | fwd+bwd leaf ops | inductor kernels | clip ops | optimizer ops | Muon matrices (shapes) | "
          "host syncs (fwd+bwd / clip / opt / log) |\n|---|---|---|---|---|---|---|")
    for k, v in report.items():
        ops, s = v["leaf_aten_ops"], v["host_syncs"]
        print(f"| {k} | {ops['forward+backward']} | {v['inductor_kernels_generated'] or '-'} | "
              f"{ops['clip_grad_norm']} | {ops['optimizer step']} | {v['muon_matrices']} ({len(v['muon_shapes'])}) | "
              f"{s['forward+backward']} / {s['clip_grad_norm']} / {s['optimizer step']} / "
              f"{s['zero_grad + log read']} |")


if __name__ == "__main__":
    main()

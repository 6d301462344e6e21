"""Host time of one compiled call, split: dynamo's guard check, our Python around the graph, the graph's own call.

    PYTHONPATH=$PWD python3 scripts/host_per_call.py [--depth 32] [--width 64] [--head-dim 16] [--tokens 16]
        [--plan 12xF2-h0-K1] [--block 4] [--rounds 400] [--device cpu|cuda] [--out DIR]

With `--device cuda` (the campaign's `host` part) the callables are compiled as the campaign and the decode loops
compile them there (CUDA graphs); the device is synchronised before every timed call, so a call's thread time is its
host time alone (the device idle when it starts), and `synced_us` is the time until the device has finished it: where
host time is most of that, the call is host-bound.

At a width where the compute is about zero (depth 32, width 64: each graph call is a few tens of microseconds of C++
on one thread), every callable the campaign and the decode loops call per forward or per token is compiled with
inductor on the CPU and timed round-robin (one call of each per round, per-call thread time and wall time, medians):

- `seq forward` / `plan forward`: the prefill callables of snlp.bench.forward / vs_paper / the campaign,
  `compile_step(lambda: model(idx))` and `compile_step(lambda: runner(idx))`;
- `seq step` (T = 1), `draft step` (the SNLP runner's step, T = 1) and `verify step` (the sequential step padded to
  block + 1): snlp.decode.steps.Step as the decode loops call it.

Each is timed three ways: as called (guards evaluated: the Steps built with guards="full"), under
`torch.compiler.set_stance(skip_guard_eval_unsafe=True)` (no guard runs while a code object has one compiled graph),
and, for the Steps, the compiled function alone on prebuilt inputs (the graph call with its guards), so Step's own
Python is the difference. The guard check alone is timed on the guard manager dynamo built (`guard_manager.check` on
the frame's locals), and its guards counted. The Steps are also built as the decode loops build them by default,
with the guard cut (guards="cut": dynamo's guards skipped while the step's own snapshot is unchanged,
snlp.decode.steps.StepState), timed as called (`guard cut`), and the snapshot it takes per call timed alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from snlp.bench.forward import compile_step
from snlp.decode.steps import mark_static_runner, sequential_step, snlp_step
from snlp.method.solver import bind
from snlp.model.gpt import GPT, GPTConfig


def _entries(code) -> list:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return _debug_get_cache_entry_list(code)


def count_guards(mgr) -> int:
    """Leaf guards under a dynamo guard manager (every check the manager makes per call)."""
    n = len(mgr.get_leaf_guards())
    return n + sum(count_guards(c) for c in mgr.get_child_managers())


def frame_locals(fn, args: tuple = ()) -> dict:
    """The locals dynamo's guards read for a call of `fn(*args)`: its arguments and its closure's cells."""
    code = fn.__code__
    loc = dict(zip(code.co_varnames[:code.co_argcount], args))
    loc.update({n: c.cell_contents for n, c in zip(code.co_freevars, fn.__closure__ or ())})
    return loc


def guard_check(fn, args: tuple = ()):
    """(one guard check as a no-argument callable, number of guards, graphs of the code object) for a call of the
    compiled `fn(*args)`: the guard manager of the graph this call runs (the one whose guards pass)."""
    loc = frame_locals(fn, args)
    entries = _entries(fn.__code__)
    hits = [e.guard_manager for e in entries if e.guard_manager.check(loc)]
    if not hits:
        raise RuntimeError(f"{fn.__code__.co_name}: no compiled graph's guards pass on this frame")
    mgr = hits[0]
    return (lambda: mgr.check(loc)), count_guards(mgr.root if hasattr(mgr, "root") else mgr), len(entries)


def skipping(fn):
    def call():
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return fn()
    return call


def time_calls(fns: dict, rounds: int, warmup: int = 20, device: str = "cpu") -> dict:
    """Per-call thread and wall microseconds, round-robin, medians (and the thread-time spread). On CUDA the device is
    synchronised before each call (its thread time is then host work only) and after it (`synced_us`: until the
    device finished the call)."""
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        for f in fns.values():
            f()
    th = {k: [] for k in fns}
    wa = {k: [] for k in fns}
    sy = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            sync()
            t0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            f()
            th[k].append((time.thread_time_ns() - t0) / 1e3)
            wa[k].append((time.perf_counter_ns() - w0) / 1e3)
            sync()
            sy[k].append((time.perf_counter_ns() - w0) / 1e3)
    return {k: dict(thread_us=statistics.median(th[k]), wall_us=statistics.median(wa[k]),
                    synced_us=statistics.median(sy[k]) if cuda else None,
                    thread_q1_us=statistics.quantiles(th[k], n=4)[0], thread_q3_us=statistics.quantiles(th[k], n=4)[2])
            for k in fns}


def build(depth: int, width: int, head_dim: int, T: int) -> GPT:
    cfg = GPTConfig.from_depth(depth, width=width, head_dim=head_dim, vocab_size=512, sequence_len=max(256, 2 * T))
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights(seed=0)
    return model.eval()


def measure(depth=32, width=64, head_dim=16, T=16, plan="12xF2-h0-K1", block=4, rounds=400, device="cpu") -> dict:
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)
    model = build(depth, width, head_dim, T).to(device)
    idx = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0)).to(device)
    runner = bind(model, plan, check_finite=False)
    if torch.device(device).type == "cuda":  # as snlp.bench.vs_paper: the fused weights keep their address (no copy per replay)
        mark_static_runner(runner)
    out = {"config": dict(depth=depth, width=width, head_dim=head_dim, tokens=T, plan=plan, block=block,
                          torch=torch.__version__, device=device,
                          device_name=torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu"),
           "rows": {}}
    fns, guards, extra = {}, {}, {}
    with torch.inference_mode():
        seq_f = compile_step(lambda: model(idx), device)
        plan_f = compile_step(lambda: runner(idx), device)
        for name, f in (("seq forward", seq_f), ("plan forward", plan_f)):
            f()
            g, n, _ = guard_check(f._torchdynamo_orig_callable if hasattr(f, "_torchdynamo_orig_callable") else f)
            fns[name], fns[name + " [skip guards]"], fns[name + " [guard check]"] = f, skipping(f), g
            guards[name] = n
    # decode Steps, as the loops call them: a prefill, then T = 1 calls (sequential / draft) and B + 1 (verify)
    seq, draft = sequential_step(model, compile=True, guards="full"), snlp_step(runner, compile=True, guards="full")
    seq_cut, draft_cut = sequential_step(model, compile=True, guards="cut"), snlp_step(runner, compile=True, guards="cut")
    max_len = seq.cache_len(T + 4 * rounds + 64)
    tok = idx[:, -1:]
    vblock = idx[:, :block + 1]
    calls = {"seq step": (seq, tok, None), "draft step": (draft, tok, None), "verify step": (seq, vblock, block + 1)}
    calls.update({k + " [guard cut]": (s, x, pad) for k, (s, x, pad) in
                  (("seq step", (seq_cut, tok, None)), ("draft step", (draft_cut, tok, None)),
                   ("verify step", (seq_cut, vblock, block + 1)))})
    caches = {k: seq.new_cache(model, 1, max_len) for k in calls}
    for k, (s, _, _) in calls.items():
        s.prefill(idx, caches[k])
    start = {k: c.length for k, c in caches.items()}

    def stepper(k):
        s, x, pad = calls[k]
        c = caches[k]

        def call():
            if c.length + x.shape[1] + s.slack > c.max_len:
                c.length = start[k]
            s(x, c, pad)
        return call
    for k, (s, x, pad) in calls.items():
        s.warm(caches[k], [x.shape[1] if pad is None else pad])
        fns[k] = stepper(k)
        if k.endswith(" [guard cut]"):  # as the decode loops call it; and the snapshot the cut takes per call
            fns[k.replace("[guard cut]", "[snapshot]")] = (lambda s=s, c=caches[k]: s.state.take(c))
            continue
        fns[k + " [skip guards]"] = skipping(fns[k])
        # the compiled function alone on prebuilt inputs: Step's Python is the difference
        c = caches[k]
        n = x.shape[1] if pad is None else pad
        with torch.inference_mode():
            gi = s.graph_input(torch.zeros(1, n, dtype=torch.long))
            gp = s.graph_input(torch.arange(c.length, c.length + n))
        inner = s.fn

        def graph_call(inner=inner, gi=gi, gp=gp, c=c):
            with torch.inference_mode():
                inner(gi, gp, c)
        fns[k + " [compiled fn alone]"] = graph_call
        fns[k + " [compiled fn alone, skip guards]"] = skipping(graph_call)
        orig = inner._torchdynamo_orig_callable if hasattr(inner, "_torchdynamo_orig_callable") else inner
        with torch.inference_mode():
            g, ng, graphs = guard_check(orig, (gi, gp, c))
        extra[k] = graphs
        fns[k + " [guard check]"] = g
        guards[k] = ng
    with torch.inference_mode():
        res = time_calls(fns, rounds, device=device)
    out["rows"] = res
    out["guards"] = guards
    out["extra"] = extra
    return out


def markdown(out: dict) -> str:
    r, g = out["rows"], out["guards"]
    synced = any(v.get("synced_us") is not None for v in r.values())
    lines = ["| callable | guards | as called (us) | guard check (us) | skip guards (us) | guard cut (us) | snapshot (us) | "
             "compiled fn alone (us) | compiled fn alone, skip guards (us) |"
             + (" as called, until the device finished (us) | guard cut, until the device finished (us) |" if synced else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if synced else "")]
    for k in ("seq forward", "plan forward", "seq step", "draft step", "verify step"):
        def v(suffix):
            row = r.get(k + suffix)
            return f"{row['thread_us']:.0f}" if row else "-"
        def dev(suffix):
            row = r.get(k + suffix)
            return f"{row['synced_us']:.0f}" if row else "-"
        lines.append(f"| {k} | {g[k]} | {v('')} | {v(' [guard check]')} | {v(' [skip guards]')} | "
                     f"{v(' [guard cut]')} | {v(' [snapshot]')} | "
                     f"{v(' [compiled fn alone]')} | {v(' [compiled fn alone, skip guards]')} |"
                     + (f" {dev('')} | {dev(' [guard cut]')} |" if synced else ""))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--plan", default="12xF2-h0-K1")
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = measure(a.depth, a.width, a.head_dim, a.tokens, a.plan, a.block, a.rounds, a.device)
    text = markdown(out)
    if a.out:
        d = Path(a.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "host_per_call.json").write_text(json.dumps(out, indent=1))
        (d / "host_per_call.md").write_text(text + "\n")
    print(json.dumps(out["config"]))
    print(text)


if __name__ == "__main__":
    main()

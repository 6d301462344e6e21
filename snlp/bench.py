"""Benchmark SNLP plans against the sequential forward, measured side by side in one process.

Teacher-forced forward over T tokens at batch B. Every callable is warmed up, then timed
round-robin (one call of each per round, so drift hits all alike); we report medians, the speedup
over sequential and the ideal speedup L / (S + K*evals + [fwd init]) so the gap is visible.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch

from .model import GPT, GPTConfig
from .plan import Plan, parse_plans
from .solver import parallel_forward


def add_arguments(p) -> None:
    src = p.add_argument_group("model (random weights unless --ckpt)")
    src.add_argument("--depth", type=int, default=16, help="number of layers (the size dial), default 16")
    src.add_argument("--width", type=int, default=None, help="model width; default depth * aspect ratio")
    src.add_argument("--aspect-ratio", type=int, default=64, help="width per layer of depth (default 64)")
    src.add_argument("--head-dim", type=int, default=128, help="attention head dim (default 128)")
    src.add_argument("--kv-heads", type=int, default=None, help="KV heads for GQA (default: = heads)")
    src.add_argument("--vocab-size", type=int, default=32768)
    src.add_argument("--window-pattern", default="L", help="sliding-window pattern, e.g. SSSL (default L)")
    src.add_argument("--no-x0", action="store_true", help="disable the x0 residual")
    src.add_argument("--no-ve", action="store_true", help="disable value embeddings")
    src.add_argument("--ckpt", default=None, help="benchmark a checkpoint directory instead of random weights")
    p.add_argument("--plans", default="1xF12-h0-K1,12xF1-h0-K1", help="comma-separated plans")
    p.add_argument("--tokens", "-T", type=int, default=1, help="tokens per forward (teacher-forced)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile both the sequential and SNLP forwards")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the records to this JSON file")


def build_model(args) -> GPT:
    """Random-weight model from the CLI size flags, or a checkpoint with --ckpt."""
    if args.ckpt:
        from .checkpoint import load  # the checkpoint format belongs to the training module
        return load(args.ckpt, device="cpu")[0]
    cfg = GPTConfig.from_depth(args.depth, aspect_ratio=args.aspect_ratio, head_dim=args.head_dim,
                               width=args.width, n_kv_head=args.kv_heads, vocab_size=args.vocab_size,
                               window_pattern=args.window_pattern, x0_residual=not args.no_x0,
                               value_embeds=not args.no_ve)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    model.init_weights(seed=args.seed)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round_robin(fns: dict, warmup: int, runs: int, device: torch.device) -> dict[str, list[float]]:
    """Milliseconds per call for each callable, interleaved round-robin after a warm-up."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    _sync(device)
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def benchmark(model: GPT, plans: list[Plan], tokens: int = 1, batch: int = 1, warmup: int = 5, runs: int = 30,
              compile: bool = False, seed: int = 0) -> list[dict]:
    """Time the sequential forward and each plan; returns one record per row (sequential first)."""
    L = model.config.n_layer
    for plan in plans:
        plan.check(L)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=gen).to(device)
    model.eval()
    fwd = {"sequential": lambda: model(idx)}
    for plan in plans:
        fwd[str(plan)] = (lambda p: lambda: parallel_forward(model, idx, p, check_finite=False))(plan)
    with torch.inference_mode():
        for name, plan in zip(list(fwd)[1:], plans):  # once with the NaN/inf check, before timing
            parallel_forward(model, idx, plan)
        if compile:
            fwd = {name: torch.compile(fn) for name, fn in fwd.items()}
        times = time_round_robin(fwd, warmup, runs, device)
    base = statistics.median(times["sequential"])
    records = []
    for name, ts in times.items():
        med = statistics.median(ts)
        plan = None if name == "sequential" else Plan.parse(name)
        records.append({
            "plan": name, "median_ms": med, "speedup": base / med,
            "ideal_speedup": 1.0 if plan is None else plan.ideal_speedup(L),
            "min_ms": min(ts), "max_ms": max(ts), "runs": len(ts), "tokens": tokens, "batch": batch,
            "n_layer": L, "prefix": L if plan is None else plan.prefix_len(L), "device": str(device),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "compiled": compile,
        })
    return records


def print_table(records: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("plan", "S", "median ms", "speedup", "ideal", "min ms", "max ms"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for r in records:
        table.add_row(r["plan"], str(r["prefix"]), f"{r['median_ms']:.3f}", f"{r['speedup']:.2f}x",
                      f"{r['ideal_speedup']:.2f}x", f"{r['min_ms']:.3f}", f"{r['max_ms']:.3f}")
    Console().print(table)


def run(args) -> int:
    if args.tokens < 1 or args.batch < 1 or args.runs < 1 or args.warmup < 0:
        raise ValueError("--tokens, --batch and --runs must be >= 1 and --warmup >= 0")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available; use --device cpu")
    model = build_model(args)
    plans = parse_plans(args.plans, model.config.n_layer)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model = model.to(device=device, dtype=getattr(torch, dtype))
    records = benchmark(model, plans, tokens=args.tokens, batch=args.batch, warmup=args.warmup, runs=args.runs,
                        compile=args.compile, seed=args.seed)
    cfg = model.config
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"
    print_table(records, f"L={cfg.n_layer} D={cfg.n_embd} heads={cfg.n_head} T={args.tokens} B={args.batch} "
                         f"{dtype} on {where}, median of {args.runs} runs")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=2))
        print(f"wrote {path}")
    return 0

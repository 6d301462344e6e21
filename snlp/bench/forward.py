"""Benchmark SNLP plans against the sequential forward, measured side by side in one process.

Teacher-forced forward over T tokens at batch B. Every callable is warmed up, then timed
round-robin (one call of each per round, so drift hits all alike); we report medians, the speedup
over sequential and the ideal speedup L / (S + K*evals + [fwd init]) so the gap is visible; the
`iters` column is the iterations each plan ran (fewer than K when its `tol` stopped it).
`--decode` times KV-cached decoding; `--ops` the per-layer cost of forward, FD, JVP and VJP (the
DiagN probe primitives) at each of `--tokens 1,16,...`.
"""

from __future__ import annotations

import statistics

import torch

from snlp.method.fusion import chunk_weights
from snlp.model.gpt import GPT, GPTConfig
from snlp.method.plan import Plan, parse_plans
from snlp.runtime.device import cli_device, cli_dtype, device_label, set_threads, write_json
from snlp.method.solver import bind
from snlp.decode.steps import check_compilable, compile_fullgraph, mark_static_runner
from snlp.runtime.timing import now, time_round_robin


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
    src.add_argument("--hc-streams", type=int, default=0, help="mHC with this many residual streams (0 = plain; "
                     "turns the x0 residual off); plans may then use the hcn surrogate")
    src.add_argument("--hc-static", action="store_true", help="static mHC (constant H) instead of dynamic")
    src.add_argument("--ckpt", default=None, help="benchmark a checkpoint directory instead of random weights")
    p.add_argument("--plans", default="1xF12-h0-K1,12xF1-h0-K1", help="comma-separated plans")
    p.add_argument("--tokens", "-T", type=_token_counts, default="1",
                   help="tokens per forward (teacher-forced); with --ops a comma list, e.g. 1,16,32,64,128")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile (fullgraph) both the sequential and SNLP forwards; with --decode the static-shape "
                        "decode steps of both sides (CUDA graphs on CUDA); compile time is reported apart from timings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the records to this JSON file")
    dec = p.add_argument_group("decode benchmark (--decode)")
    dec.add_argument("--decode", action="store_true",
                     help="benchmark KV-cached greedy decoding instead: per-token latency of sequential and each "
                          "plan, and self-speculative decoding (each plan drafts, sequential verifies)")
    dec.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (prefilled, not timed)")
    dec.add_argument("--new-tokens", type=int, default=64, help="generated tokens per run")
    dec.add_argument("--blocks", default="4", help="comma-separated speculative draft block sizes B")
    dec.add_argument("--threads", type=int, default=None,
                     help="torch CPU threads, also for the teacher-forced and --ops runs (tiny ops: 1 is often best "
                          "on a shared CPU)")
    suite = p.add_argument_group("the paper's speed suite (--suite paper; snlp.suite)")
    suite.add_argument("--suite", choices=["paper"], default=None,
                       help="run the paper's speed column: its 4 shapes and plans, prefill T=2048 and KV-cached "
                            "decode, eager and compiled, random weights; writes suite.json + suite.md to --out")
    suite.add_argument("--quick", action="store_true",
                       help="--suite: CPU smoke-size run (shrunk shapes, T=16, few runs)")
    suite.add_argument("--out", default="bench-suite", help="--suite: output directory")
    suite.add_argument("--shapes", default=None,
                       help="--suite: comma-separated subset of the shapes 0.5B-nox0ve,0.5B,0.5B-mhc,3B "
                            "(default all)")
    suite.add_argument("--suite-tokens", type=int, default=None,
                       help="--suite: prefill length T (default 2048; 16 quick)")
    suite.add_argument("--suite-warmup", type=int, default=None,
                       help="--suite: prefill warm-up rounds (default 50 on cuda as the paper, 2 on cpu)")
    suite.add_argument("--suite-runs", type=int, default=None,
                       help="--suite: prefill timed rounds (default 200 on cuda as the paper, 5 on cpu)")
    suite.add_argument("--suite-new-tokens", type=int, default=None,
                       help="--suite: decoded tokens per decode run (default 128; 4 quick)")
    suite.add_argument("--treatments", default="eager,compiled", help="--suite: eager and/or compiled")
    suite.add_argument("--no-decode", action="store_true", help="--suite: skip the KV-cached decode rows")
    ops = p.add_argument_group("single-layer op benchmark (--ops)")
    ops.add_argument("--ops", action="store_true",
                     help="time forward, FD, JVP and VJP of ONE layer (the DiagN probe primitives) at each --tokens, "
                          "batch 1, with their ratio to forward (paper Table diag_ops_bench)")
    ops.add_argument("--layer", type=int, default=None, help="layer for --ops (default: the middle layer L // 2)")
    dist = p.add_argument_group("multi-device (snlp.distributed, snlp.costmodel)")
    dist.add_argument("--distributed", action="store_true",
                      help="under torchrun: distributed SNLP vs the layer-pipelined sequential forward (with --decode "
                           "also decoding), e.g. torchrun --nproc_per_node=2 -m snlp bench --distributed --pin")
    dist.add_argument("--dist-timeout", type=float, default=120.0, help="seconds before a dead peer rank is an error")
    dist.add_argument("--pin", action="store_true", help="--distributed on CPU: pin local rank r to core r, 1 thread")
    dist.add_argument("--simulate-devices", type=int, default=None, metavar="P",
                      help="cost model: predicted per-token latency of sequential, pipeline, tensor parallel and SNLP "
                           "over P devices (snlp.costmodel)")
    dist.add_argument("--link-gbps", type=float, default=3600.0,
                      help="--simulate-devices: link bandwidth per direction, Gbit/s (3600 ~ NVLink 4, 256 ~ PCIe 5 x16)")
    dist.add_argument("--link-latency-us", type=float, default=10.0, help="--simulate-devices: per-message latency, us")
    dist.add_argument("--shape", default=None, help="--simulate-devices: a preset shape (0.5B, 3B, 70B) instead of the "
                      "size flags")
    dist.add_argument("--roofline-gbytes", type=float, default=None,
                      help="--simulate-devices: model compute as weight bytes / this memory bandwidth (GB/s) instead "
                           "of measuring on --device (e.g. 3350 for an H100 SXM)")
    dist.add_argument("--roofline-efficiency", type=float, default=0.7,
                      help="fraction of --roofline-gbytes achieved (default 0.7)")
    dist.add_argument("--op-floor-us", type=float, default=20.0,
                      help="with --roofline-gbytes: the least time any op takes (kernel launches), us")


def _token_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(t) for t in str(text).split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--tokens must be an integer or a comma list like 1,16,32, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"--tokens must be >= 1, got {text!r}")
    return counts


def build_model(args) -> GPT:
    """Random-weight model from the CLI size flags, or a checkpoint with --ckpt."""
    if args.ckpt:
        from snlp.io.checkpoint import load  # the checkpoint format belongs to the training module
        return load(args.ckpt, device="cpu")[0]
    cfg = GPTConfig.from_depth(args.depth, aspect_ratio=args.aspect_ratio, head_dim=args.head_dim,
                               width=args.width, n_kv_head=args.kv_heads, vocab_size=args.vocab_size,
                               window_pattern=args.window_pattern, x0_residual=False if args.no_x0 else None,
                               value_embeds=not args.no_ve, hc_streams=getattr(args, "hc_streams", 0),
                               hc_dynamic=not getattr(args, "hc_static", False))
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    model.init_weights(seed=args.seed)
    return model


COMPILE_CALLS = 3  # untimed calls that trigger compilation (and, on CUDA, CUDA-graph warm-up and recording)


def compile_step(fn, device):
    """torch.compile a benchmark callable as the decode steps are compiled (steps.compile_fullgraph)."""
    return compile_fullgraph(fn, device)


def _trigger_compile(fns: dict, device) -> dict[str, float]:
    """Call each compiled callable COMPILE_CALLS times, untimed by the benchmark: the seconds this
    takes per callable is its compile time, reported apart from (never inside) the timings."""
    secs = {}
    for name, fn in fns.items():
        t0 = now(device)
        try:
            for _ in range(COMPILE_CALLS):
                fn()
        except torch._dynamo.exc.TorchDynamoException as e:  # e.g. a graph break under fullgraph=True
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{name} does not compile as one graph (torch.compile fullgraph=True): {first}") from e
        secs[name] = now(device) - t0
    return secs


def structural_ideal(t_seq: float, t_fixed: float, n_layer: int, steps: int) -> tuple[float, float]:
    """(t_layer, ideal): with the sequential forward t_seq = t_fixed + L * t_layer (t_fixed = what both
    sides pay once: embedding and head), a plan evaluating `steps` layers on its critical path
    (Plan.critical_path_layers) ideally takes t_fixed + steps * t_layer, so its structural ideal is
    t_seq / (t_fixed + steps * t_layer). It lies between 1 and the op-count ideal L / steps: the
    fixed costs pull it towards 1. t_layer is clamped at 0 (noise could make t_fixed > t_seq)."""
    t_layer = max(t_seq - t_fixed, 0.0) / n_layer
    denom = t_fixed + max(steps, 1) * t_layer
    return t_layer, (t_seq / denom if denom > 0 else 1.0)


def benchmark(model: GPT, plans: list[Plan], tokens: int = 1, batch: int = 1, warmup: int = 5, runs: int = 30,
              compile: bool = False, seed: int = 0) -> list[dict]:
    """Time the sequential forward and each plan; returns one record per row (sequential first).

    Besides the rows, the fixed costs both sides pay once per forward are timed in the same
    round-robin with the same treatment: the embedding (`model.embed`: token embedding, value
    embeddings, RoPE tables) and the head (`model.head`: final norm, lm_head, softcap). Each record
    carries them (`embed_ms`, `head_ms`, `fixed_ms`), the per-layer time of the sequential forward
    `layer_ms` = (t_seq - fixed) / L, the `structural_ideal` = t_seq / (fixed + steps * layer_ms)
    (steps = Plan.critical_path_layers at the iterations actually run) and `of_structural` = speedup /
    structural_ideal: how much of what the plan allows on this device the implementation achieves.
    `ideal_layer_speedup` is the op-count ideal L / steps (fixed costs ignored).

    With `compile` every callable (rows, embed, head) is compiled by `compile_step` (fullgraph; on
    CUDA reduce-overhead); the calls that trigger compilation run before the warm-up and are
    reported as `compile_s` (`fixed_compile_s` for embed + head), never inside the timings. A
    callable that does not compile as one graph is a ValueError naming it."""
    L = model.config.n_layer
    for plan in plans:
        plan.check(L)
    if compile:
        for plan in plans:
            check_compilable(plan)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=gen).to(device)
    model.eval()
    fwd = {"sequential": lambda: model(idx)}
    # bound runners: fused weights built once here, so neither the timed call nor a compiled graph rebuilds them
    runners = {str(plan): bind(model, plan, check_finite=False) for plan in plans}
    for name, runner in runners.items():
        fwd[name] = (lambda r: lambda: r(idx))(runner)
    iters = {}  # iterations each plan ran (< K when its `tol` stopped it early; same idx every run)
    compile_s: dict[str, float] = {}
    with torch.inference_mode():
        for name, runner in runners.items():  # once with the NaN/inf check, before timing
            iters[name] = runner.solve(idx, check_finite=True).iters
        h_last = model.embed(idx).x0.clone()  # a hidden state of h_L's shape ((B, T, n, D) with mHC) for the head
        # the fixed costs: return every tensor of the Context so a compiled graph cannot drop any of it
        fixed = {"_embed": lambda: tuple(v for v in vars(model.embed(idx)).values() if isinstance(v, torch.Tensor)),
                 "_head": lambda: model.head(h_last)}
        fns = {**fwd, **fixed}
        if compile:  # the plan callables share one code object: allow one compiled graph per plan
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(fns) + 1)
            if device.type == "cuda":  # CUDA graphs would copy the fused weights (plain tensors) in every replay
                for runner in runners.values():
                    mark_static_runner(runner)
            fns = {name: compile_step(fn, device) for name, fn in fns.items()}
            compile_s = _trigger_compile(fns, device)
        times = time_round_robin(fns, warmup, runs, device)
    base = statistics.median(times["sequential"])
    embed_ms, head_ms = statistics.median(times["_embed"]), statistics.median(times["_head"])
    fixed_ms = embed_ms + head_ms
    records = []
    for name in fwd:
        ts = times[name]
        med = statistics.median(ts)
        plan = None if name == "sequential" else Plan.parse(name)
        steps = L if plan is None else plan.critical_path_layers(L, iters[name])
        layer_ms, struct = structural_ideal(base, fixed_ms, L, steps)
        records.append({
            "plan": name, "median_ms": med, "speedup": base / med,
            "ideal_layer_speedup": 1.0 if plan is None else plan.ideal_speedup(L, iters[name]), "iters": iters.get(name),
            "critical_path_layers": steps, "embed_ms": embed_ms, "head_ms": head_ms, "fixed_ms": fixed_ms,
            "layer_ms": layer_ms, "structural_ideal": struct, "of_structural": (base / med) / struct,
            "min_ms": min(ts), "max_ms": max(ts), "runs": len(ts), "tokens": tokens, "batch": batch,
            "n_layer": L, "prefix": L if plan is None else plan.prefix_len(L), "device": str(device),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "compiled": compile,
            "compile_s": compile_s.get(name),
            "fixed_compile_s": (compile_s["_embed"] + compile_s["_head"]) if compile else None,
        })
    return records


def print_table(records: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    r0 = records[0]
    title += (f"\nfixed (embed + head) {r0['fixed_ms']:.3f} ms, per layer {r0['layer_ms']:.3f} ms; "
              f"ideal (layers) = L / steps, ideal (struct.) = t_seq / (fixed + steps * t_layer)")
    if r0.get("compiled"):
        title += f"; compile time {sum(r['compile_s'] for r in records) + r0['fixed_compile_s']:.1f} s (not timed)"
    table = Table(title=title)
    for col in ("plan", "S", "iters", "median ms", "speedup", "ideal (layers)", "ideal (struct.)", "of struct.",
                "min ms", "max ms"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for r in records:
        its = "-" if r.get("iters") is None else str(r["iters"])  # iterations run (tol may stop before K)
        table.add_row(r["plan"], str(r["prefix"]), its, f"{r['median_ms']:.3f}", f"{r['speedup']:.2f}x",
                      f"{r['ideal_layer_speedup']:.2f}x", f"{r['structural_ideal']:.2f}x",
                      f"{100 * r['of_structural']:.0f}%", f"{r['min_ms']:.3f}", f"{r['max_ms']:.3f}")
    Console(width=160).print(table)


def model_bytes(model: GPT) -> int:
    """Bytes of the model's parameters and buffers: what one sequential decode step streams from memory
    (gpt-fast's "model size"; tied embeddings counted once)."""
    seen, n = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            n += t.numel() * t.element_size()
    return n


def decode_benchmark(model: GPT, plans: list[Plan], prompt_len: int = 16, new_tokens: int = 64,
                     blocks: tuple[int, ...] = (4,), warmup: int = 1, runs: int = 5, seed: int = 0,
                     compile: bool = False) -> list[dict]:
    """KV-cached greedy decoding, measured round-robin in one process: per-token latency of sequential
    and of SNLP decoding with each plan, then speculative decoding (plan drafts, sequential verifies)
    with alpha, tokens/round, the drafter speedup s, measured and ideal speedup vs sequential. The
    sequential row also gives the achieved memory bandwidth, model bytes x tokens/s (gpt-fast's figure).

    `compile`: every side runs compiled static-shape steps (snlp.steps: prefill, the one-token step, the
    verifier's B+1 positions, fullgraph; CUDA graphs on CUDA), built once here and shared by every run, so
    the baseline gets the same treatment as the plans. Compilation happens in the warm-up (and in each
    generate call's own warm-up, before its timer starts); its time is reported in `compile_s`, never in
    the latencies. With `compile`, each record's `host_syncs` counts the host syncs per step of its compiled
    steps (snlp.steps.host_syncs: sync-debug mode on CUDA, a profiler count on CPU): 0 is the contract."""
    from snlp.decode.speculative import ideal_ssd_speedup, speculative_generate
    from snlp.decode.generate import sequential_generate, snlp_generate
    from snlp.model.cache import KVCache
    from snlp.decode.steps import host_syncs, sequential_step, snlp_step

    L = model.config.n_layer
    for plan in plans:
        plan.check(L)
    if prompt_len < 1 or new_tokens < 1 or not blocks or min(blocks) < 1:
        raise ValueError("--prompt-len, --new-tokens and every block size must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=gen).tolist()
    model.eval()
    seq = sequential_step(model, compile)  # built once: compiled graphs are shared by every run
    drafts = {plan: snlp_step(bind(model, plan, check_finite=False), compile) for plan in plans}
    fns = {("sequential", None, 0): lambda: sequential_generate(model, prompt, new_tokens, step=seq)}
    for plan in plans:
        fns[("snlp", plan, 0)] = (lambda p: lambda: snlp_generate(model, prompt, p, new_tokens, step=drafts[p]))(plan)
    for plan in plans:
        for b in blocks:
            fns[("speculative", plan, b)] = (lambda p, b: lambda: speculative_generate(
                model, prompt, p, b, new_tokens, draft=drafts[p], verify=seq))(plan, b)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    results = {key: [] for key in fns}
    for _ in range(runs):  # round-robin: drift hits every row alike
        for key, fn in fns.items():
            results[key].append(fn())
    syncs = {}  # host syncs per compiled step, on the very steps timed (0 expected; snlp.steps.host_syncs)
    if compile:
        with torch.inference_mode():
            size = seq.cache_len(prompt_len + new_tokens + seq.slack + max(blocks))  # a bucket the runs used
            for key, step, T in [(None, seq, 1), ("verify", seq, max(blocks) + 1)] + [(p, drafts[p], 1) for p in plans]:
                cache = KVCache.for_model(model, max_len=size)
                syncs[key] = host_syncs(step, cache, T, calls=2) / 2
    ms = {key: statistics.median(1e3 * r.decode_s / len(r.tokens) for r in rs) for key, rs in results.items()}
    base = ms[("sequential", None, 0)]
    seq_step_ms = statistics.median(r.ms_per_step for r in results[("sequential", None, 0)])
    ref_tokens = results[("sequential", None, 0)][0].tokens
    records = []
    for (mode, plan, b), rs in results.items():
        r = rs[0]
        rec = {"mode": mode, "plan": "sequential" if plan is None else str(plan), "block": b or None,
               "ms_per_token": ms[(mode, plan, b)], "tokens_per_s": 1e3 / ms[(mode, plan, b)],
               "speedup": base / ms[(mode, plan, b)], "matches_sequential": r.tokens == ref_tokens,
               "new_tokens": new_tokens, "prompt_len": prompt_len, "runs": runs, "n_layer": L,
               "device": str(next(model.parameters()).device),
               "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "compiled": compile,
               "compile_s": seq.compile_s if plan is None else drafts[plan].compile_s + (seq.compile_s if b else 0.0),
               "host_syncs": None if not compile else syncs[plan] + (syncs["verify"] if b else 0.0)}
        if mode == "sequential":
            rec["model_bytes"] = model_bytes(model)
            rec["bandwidth_gb_s"] = rec["model_bytes"] * rec["tokens_per_s"] / 1e9
        if mode == "speculative":
            draft_ms = statistics.median(x.draft_ms_per_step for x in rs)
            # drafter speedup, like with like: sequential over drafter ms per cached single-token step
            s = seq_step_ms / draft_ms
            rec.update(alpha=r.acceptance_rate, tokens_per_round=r.tokens_per_round, drafter_speedup_s=s,
                       drafter_ms_per_step=draft_ms, sequential_ms_per_step=seq_step_ms,
                       ideal_ssd_speedup=ideal_ssd_speedup(r.acceptance_rate, b, s))
        records.append(rec)
    return records


def print_decode_table(records: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("mode", "plan", "B", "ms/token", "tok/s", "speedup", "alpha", "tok/round", "s", "SSD ideal", "=seq"):
        table.add_column(col, justify="left" if col in ("mode", "plan") else "right")
    f = lambda r, k, fmt: fmt.format(r[k]) if r.get(k) is not None else "-"  # noqa: E731
    for r in records:
        table.add_row(r["mode"], r["plan"], f(r, "block", "{}"), f(r, "ms_per_token", "{:.3f}"),
                      f(r, "tokens_per_s", "{:.1f}"), f(r, "speedup", "{:.2f}x"), f(r, "alpha", "{:.3f}"),
                      f(r, "tokens_per_round", "{:.2f}"), f(r, "drafter_speedup_s", "{:.2f}"),
                      f(r, "ideal_ssd_speedup", "{:.2f}x"), "yes" if r["matches_sequential"] else "no")
    Console(width=160).print(table)


def run_decode(args, model: GPT, plans: list[Plan], device: torch.device, dtype: str) -> int:
    set_threads(args.threads)
    try:
        blocks = tuple(int(b) for b in args.blocks.split(",") if b.strip())
    except ValueError:
        raise ValueError(f"--blocks must be comma-separated integers, got {args.blocks!r}") from None
    records = decode_benchmark(model, plans, args.prompt_len, args.new_tokens, blocks, args.warmup, args.runs,
                               args.seed, compile=args.compile)
    cfg = model.config
    where = device_label(device)
    print_decode_table(records, f"cached greedy decode{' (compiled)' if args.compile else ''}: L={cfg.n_layer} "
                                f"D={cfg.n_embd} heads={cfg.n_head} prompt={args.prompt_len} new={args.new_tokens} "
                                f"{dtype} on {where}, median of {args.runs} runs")
    seq = records[0]
    print(f"sequential: {seq['model_bytes'] / 1e6:.1f} MB of weights x {seq['tokens_per_s']:.1f} tok/s = "
          f"{seq['bandwidth_gb_s']:.2f} GB/s achieved"
          + (f"; compile time (not in any timing): {sum(r['compile_s'] for r in records if r['mode'] != 'speculative'):.1f} s"
             f"; host syncs per compiled step: {max(r['host_syncs'] for r in records):g}" if args.compile else ""))
    if args.json:
        write_json(args.json, records)
    return 0


def run(args) -> int:
    if getattr(args, "suite", None):
        return run_suite_cli(args)
    if getattr(args, "simulate_devices", None) is not None:
        from snlp.apps.dist import run_simulate

        return run_simulate(args)
    if getattr(args, "distributed", False):
        from snlp.apps.dist import run_bench

        return run_bench(args)
    counts = args.tokens if isinstance(args.tokens, tuple) else (args.tokens,)
    if args.ops:
        return run_ops(args, counts)
    if len(counts) != 1:
        raise ValueError(f"--tokens takes one value (a comma list only with --ops), got {','.join(map(str, counts))}")
    args.tokens = counts[0]
    if args.tokens < 1 or args.batch < 1 or args.runs < 1 or args.warmup < 0:
        raise ValueError("--tokens, --batch and --runs must be >= 1 and --warmup >= 0")
    device = cli_device(args.device)
    set_threads(args.threads)  # --threads (decode group) applies to the teacher-forced benchmark too
    model = build_model(args)
    plans = parse_plans(args.plans, model.config.n_layer)
    dtype = cli_dtype(args.dtype, device)
    model = model.to(device=device, dtype=getattr(torch, dtype))
    if args.decode:
        return run_decode(args, model, plans, device, dtype)
    records = benchmark(model, plans, tokens=args.tokens, batch=args.batch, warmup=args.warmup, runs=args.runs,
                        compile=args.compile, seed=args.seed)
    cfg = model.config
    where = device_label(device)
    print_table(records, f"L={cfg.n_layer} D={cfg.n_embd} heads={cfg.n_head} T={args.tokens} B={args.batch} "
                         f"{dtype} on {where}, median of {args.runs} runs")
    if args.json:
        write_json(args.json, records)
    return 0


def run_suite_cli(args) -> int:
    import shlex
    import sys

    from snlp.bench.suite import SuiteConfig, run_suite

    split = lambda text: tuple(t.strip() for t in text.split(",") if t.strip()) if text else None  # noqa: E731
    cfg = SuiteConfig(quick=args.quick, shapes=split(args.shapes), device=args.device, dtype=args.dtype,
                      tokens=args.suite_tokens, warmup=args.suite_warmup, runs=args.suite_runs,
                      new_tokens=args.suite_new_tokens,
                      treatments=split(args.treatments) or (), decode=not args.no_decode, seed=args.seed,
                      threads=args.threads,
                      out=args.out, command=shlex.join(["snlp", *sys.argv[1:]]))
    result = run_suite(cfg)
    print(result.markdown)
    print(f"wrote {result.json_path} and {result.markdown_path}")
    return 0


# ----------------------------------------------------------------- single-layer op benchmark (--ops)
OPS = ("forward", "fd", "jvp", "vjp")


def op_benchmark(model: GPT, tokens: tuple[int, ...] = (1, 16, 32, 64, 128), layer: int | None = None,
                 warmup: int = 5, runs: int = 30, seed: int = 0, eps: float = 1e-3) -> list[dict]:
    """Per-layer cost of the DiagN probe primitives (paper Table diag_ops_bench) for ONE layer: a
    C = 1, M = 1 chunk at `layer` (default L // 2) via chunk_forward, batch 1, input = the real
    hidden state entering that layer. The timed callables are the solver's own code
    (snlp.surrogates.probe_products, one Rademacher probe):
      forward  f(x)
      fd       f(x) AND f(x + s v), then (f(x + s v) - f(x)) / s: two evaluations, like the paper's
               ~2x column. In the solver f(x) is already computed, so DiagN-FD adds only `fd_extra`
               (one evaluation + the difference), also recorded.
      jvp      torch.func.jvp: f(x) and J v in one forward-mode pass (math SDPA: no forward AD for
               the fused kernels)
      vjp      f(x) with autograd, then J^T v by one backward
    Timed under torch.no_grad() (VJP enables grad locally), warm-up + round-robin, medians."""
    from snlp.method.jacobian import chunk_probe_map, probe_products, rademacher

    L = model.config.n_layer
    layer = L // 2 if layer is None else layer
    if not 0 <= layer < L:
        raise ValueError(f"--layer must lie in [0, {L - 1}] for a {L}-layer model (got {layer})")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    records = []
    for T in tokens:
        idx = torch.randint(0, model.config.vocab_size, (1, T), generator=gen).to(device)
        with torch.no_grad():
            ctx = model.embed(idx)
            x = model.run_layers(ctx.x0, ctx, 0, layer)[None]  # (C=1, B=1, T, ..., D): the layer's real input
            w = chunk_weights(model, layer, 1, 1)
            f = chunk_probe_map(w, ctx)  # probe-stacked (P, C, B, T, ..., D) map, as in the solver
            v = rademacher((1, *x.shape), x, torch.Generator(device).manual_seed(seed))
            fx = f(x[None])[0]
            fns = {"forward": lambda: f(x[None]),
                   "fd": lambda: probe_products(f, x, v, "fd", eps),
                   "jvp": lambda: probe_products(f, x, v, "jvp"),
                   "vjp": lambda: probe_products(f, x, v, "vjp"),
                   "fd_extra": lambda: probe_products(f, x, v, "fd", eps, fx=fx)}
            times = time_round_robin(fns, warmup, runs, device)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        rec = {"tokens": T, "layer": layer, "batch": 1, "runs": runs, "n_layer": L, "n_embd": model.config.n_embd,
               "device": str(device), "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}
        for name, ms in med.items():
            rec[f"{name}_ms"] = ms
            rec[f"{name}_ratio"] = ms / med["forward"]
        records.append(rec)
    return records


def print_ops_table(records: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("T", "Forward (ms)", "FD (ms)", "JVP (ms)", "VJP (ms)", "FD extra (ms)"):
        table.add_column(col, justify="right")
    cell = lambda r, op: f"{r[op + '_ms']:.3f} ({r[op + '_ratio']:.2f}x)"  # noqa: E731
    for r in records:
        table.add_row(str(r["tokens"]), f"{r['forward_ms']:.3f}", cell(r, "fd"), cell(r, "jvp"), cell(r, "vjp"),
                      cell(r, "fd_extra"))
    Console(width=140).print(table)


def run_ops(args, counts: tuple[int, ...]) -> int:
    if args.runs < 1 or args.warmup < 0:
        raise ValueError("--runs must be >= 1 and --warmup >= 0")
    set_threads(args.threads)  # --threads (decode group) applies here too
    device = cli_device(args.device)
    dtype = cli_dtype(args.dtype, device)
    model = build_model(args).to(device=device, dtype=getattr(torch, dtype))
    records = op_benchmark(model, counts, args.layer, args.warmup, args.runs, args.seed)
    cfg = model.config
    print_ops_table(records, f"single-layer ops: layer {records[0]['layer']} of L={cfg.n_layer} D={cfg.n_embd} "
                             f"heads={cfg.n_head} B=1 {dtype} on {device_label(device)}, median of {args.runs} runs")
    if args.json:
        write_json(args.json, records)
    return 0

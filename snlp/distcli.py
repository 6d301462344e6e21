"""CLI glue for `--distributed` (torchrun): `snlp generate CKPT --distributed` and `snlp bench --distributed`.
snlp.generate.run / snlp.bench.run dispatch here; the work is done by snlp.distributed."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from .runtime import cli_device, cli_dtype, set_threads, write_json
from .distributed import (CollectiveError, DistributedSNLP, RankFailureError, gather_objects, distributed_benchmark,
                          init_distributed, partition)
from .plan import Plan, parse_plans


def _setup(args) -> tuple[int, int, torch.device]:
    """Process group, device and CPU pinning for a `--distributed` command."""
    device = cli_device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    rank, world = init_distributed(args.dist_timeout, device)
    if getattr(args, "pin", False):  # one core per rank (local rank r -> core r), one intra-op thread
        cores = sorted(os.sched_getaffinity(0))
        local = int(os.environ.get("LOCAL_RANK", rank))
        os.sched_setaffinity(0, {cores[local % len(cores)]})
        torch.set_num_threads(1)
    set_threads(getattr(args, "threads", None))
    return rank, world, device


def _run_ranked(command: str, args, body) -> int:
    """Set up the process group, run body(rank, world, device) -> exit code and tear the group down; a dead or
    hung peer (RankFailureError), or a collective that failed for another reason (CollectiveError, which quotes
    it), ends this rank with a clear message and exit code 3 instead of a hang."""
    rank, world, device = _setup(args)
    try:
        return body(rank, world, device)
    except (RankFailureError, CollectiveError) as e:
        print(f"snlp {command} (rank {rank}): error: {e}", file=sys.stderr)
        return 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _refuse_compile(args) -> None:
    """--compile has no distributed counterpart: the distributed solve and the layer-pipelined forward
    interleave collectives with the layer math and run eagerly; refused rather than silently ignored."""
    if getattr(args, "compile", False):
        raise ValueError("--compile is not supported with --distributed: the distributed solve and the "
                         "layer-pipelined forward run eagerly (their collectives sit between the layer ops); "
                         "drop --compile")


def run_generate(args) -> int:
    """`torchrun --nproc_per_node=P -m snlp generate CKPT --distributed ...` (called by snlp.generate.run)."""
    if args.mode not in ("snlp", "sequential", "speculative"):
        raise ValueError(f"--distributed supports --mode snlp, speculative or sequential (layer-pipelined), "
                         f"not {args.mode}")
    if args.plan is None:
        raise ValueError("--distributed needs --plan: its chunks are what the ranks split (e.g. --plan 8xF1-h0-K1)")
    _refuse_compile(args)
    if args.mode == "speculative" and not args.no_baseline and args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1 (got {args.repeats})")
    if not os.path.exists(args.ckpt):
        raise FileNotFoundError(f"checkpoint {args.ckpt} does not exist")
    return _run_ranked("generate", args, lambda rank, world, device: _run_generate_ranked(args, rank, world, device))


def _run_generate_ranked(args, rank: int, world: int, device) -> int:
    from .distload import RankCheckpoint

    ckpt = RankCheckpoint(args.ckpt, device)  # this rank reads only its own layers' tensors (snlp.distload)
    tok = ckpt.tokenizer()
    if tok is None:
        raise ValueError(f"checkpoint {args.ckpt} has no tokenizer; save it with one to use `snlp generate`")
    plan = Plan.parse(args.plan, ckpt.config.n_layer)
    eos_id = args.eos_id
    if getattr(args, "chat", False):  # as snlp.generate.run: the chat template, and stop at its EOS
        prompt = list(tok.encode(tok.apply_chat_template([{"role": "user", "content": args.prompt}])))
        eos_id = tok.eos_id if eos_id is None else eos_id
    else:
        prompt = ([tok.bos_id] if getattr(tok, "bos_id", None) is not None else []) + list(tok.encode(args.prompt))
    runner = DistributedSNLP(ckpt.meta_model(), plan, keep_layers=args.mode != "snlp", checkpoint=ckpt,
                             preheat=ckpt.preheat() if plan.init == "preheat" else None)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, eos_id=eos_id,
              seed=args.seed)
    out: list[int] = []
    printed = [""]

    def stream(new: list[int]) -> None:
        out.extend(new)
        text = tok.decode(out)
        print(text[len(printed[0]):], end="", flush=True)
        printed[0] = text

    if rank == 0 and not args.quiet:
        print(args.prompt, end="", flush=True)
    base = None
    if args.mode == "speculative" and not args.no_baseline:
        base = runner.generate(prompt, "sequential", **kw)
    res = runner.generate(prompt, args.mode, block=args.block,
                          on_tokens=stream if rank == 0 and not args.quiet else None, **kw)
    rounds = []  # as snlp.generate.run: the runs above warm both sides up, then --repeats timed rounds of each
    if base is not None:
        for _ in range(args.repeats):
            rounds.append((runner.generate(prompt, "sequential", **kw),
                           runner.generate(prompt, args.mode, block=args.block, **kw)))
    mem = gather_objects(runner.memory())
    if rank == 0:
        if not args.quiet:
            print()
        record = {"tokens": res.tokens, "text": tok.decode(res.tokens), "world_size": world,
                  "chunks_per_rank": [list(b) for b in partition(plan.chunks, world)], "memory_per_rank": mem,
                  **{k: v for k, v in res.to_dict().items() if k != "tokens"}}
        stats = (f"[distributed {res.mode} {plan} over {world} ranks] {len(res.tokens)} tokens, "
                 f"{res.tokens_per_s:.1f} tok/s, stop: {res.stop}")
        if base is not None:
            from statistics import median as med

            record["sequential_tokens"] = base.tokens
            record["matches_sequential"] = all(r.tokens == res.tokens for r in [base, *(x for p in rounds for x in p)])
            record["repeats"] = len(rounds)
            record["pipeline_sequential_tokens_per_s"] = med([s.tokens_per_s for s, _ in rounds])
            record["speculative_tokens_per_s"] = med([p.tokens_per_s for _, p in rounds])
            record["measured_speedup"] = med([p.tokens_per_s / s.tokens_per_s for s, p in rounds])
            stats += (f", alpha={res.acceptance_rate:.3f}, tokens/round={res.tokens_per_round:.2f}, "
                      f"pipelined sequential {record['pipeline_sequential_tokens_per_s']:.1f} tok/s, speedup "
                      f"{record['measured_speedup']:.2f}x (medians of {len(rounds)} runs after a warm-up)")
        print(stats)
        if args.json:
            write_json(args.json, record)
    return 0


def run_bench(args) -> int:
    """`torchrun --nproc_per_node=P -m snlp bench --distributed ...` (called by snlp.bench.run)."""
    _refuse_compile(args)
    if getattr(args, "ops", False):
        raise ValueError("--ops (the single-layer op benchmark) is a single-process benchmark: drop --distributed")
    counts = args.tokens if isinstance(args.tokens, tuple) else (args.tokens,)
    if len(counts) != 1:
        raise ValueError(f"--distributed takes one --tokens value (got {','.join(map(str, counts))})")
    return _run_ranked("bench", args, lambda rank, world, device: _run_bench_ranked(args, rank, world, device))


def _run_bench_ranked(args, rank: int, world: int, device) -> int:
    from .bench import build_model

    dtype = getattr(torch, cli_dtype(args.dtype, device))
    ckpt = None
    if args.ckpt:  # a rank reads only its own layers (snlp.distload)
        from .distload import RankCheckpoint

        ckpt = RankCheckpoint(args.ckpt, device)
        model_fn = lambda: ckpt.meta_model().to(dtype=dtype)  # noqa: E731  filled by DistributedSNLP(checkpoint=)
        L = ckpt.config.n_layer
    else:  # random weights come from one RNG stream over the whole model: every rank draws all of it
        model_fn = lambda: build_model(args).to(device=device, dtype=dtype).eval()  # noqa: E731  same seed everywhere
        L = args.depth
    plans = parse_plans(args.plans, L)
    blocks = tuple(int(b) for b in args.blocks.split(",") if b.strip())
    counts = args.tokens if isinstance(args.tokens, tuple) else (args.tokens,)
    recs = distributed_benchmark(model_fn, plans, counts[0], args.batch, args.warmup, args.runs, args.seed,
                                 args.decode, args.prompt_len, args.new_tokens, blocks, checkpoint=ckpt)
    if rank == 0:
        load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else []
        for r in recs:
            r.update(loadavg=load, pinned=bool(args.pin), threads=torch.get_num_threads())
        for r in recs:
            if r["what"] == "prefill":
                print(f"[{world} ranks] {r['plan']} prefill T={r['tokens']} B={r['batch']}: pipelined sequential "
                      f"{r['pipeline_sequential_ms']:.2f} ms, distributed SNLP {r['snlp_ms']:.2f} ms "
                      f"({r['speedup']:.2f}x); max rank memory {r['max_rank_bytes'] / 1e6:.1f} MB")
            else:
                print(f"[{world} ranks] {r['plan']} decode {r['mode']}{' B=' + str(r['block']) if r['block'] else ''}: "
                      f"{r['ms_per_token']:.2f} ms/token ({r['speedup_vs_pipeline']:.2f}x vs pipelined sequential)"
                      f"{', =seq' if r['matches_sequential'] else ''}")
        print(f"load average {' '.join(load)}")
        if args.json:
            write_json(args.json, recs)
    return 0


def run_simulate(args) -> int:
    """`snlp bench --simulate-devices P --link-gbps G --link-latency-us U`: the cost model (snlp.costmodel)."""
    from .costmodel import SHAPES, Link, Shape, measure_layer_ms, predict, roofline_layer_ms

    P = args.simulate_devices
    if P < 1:
        raise ValueError(f"--simulate-devices must be >= 1 (got {P})")
    if args.shape:
        if args.shape not in SHAPES:
            raise ValueError(f"unknown --shape {args.shape!r}: valid shapes are {', '.join(SHAPES)}")
        shape = SHAPES[args.shape]
    else:
        from .model import GPTConfig

        cfg = GPTConfig.from_depth(args.depth, aspect_ratio=args.aspect_ratio, head_dim=args.head_dim,
                                   width=args.width, n_kv_head=args.kv_heads, vocab_size=args.vocab_size)
        shape = Shape(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                      vocab_size=cfg.vocab_size, mlp_ratio=cfg.mlp_ratio)
    device = cli_device(args.device)
    dtype = getattr(torch, cli_dtype(args.dtype, device))
    shape = Shape(**{**shape.__dict__, "dtype_bytes": torch.finfo(dtype).bits // 8})
    link = Link(args.link_gbps, args.link_latency_us)
    plans = parse_plans(args.plans, shape.n_layer)
    counts = args.tokens if isinstance(args.tokens, tuple) else (args.tokens,)
    recs = []
    for plan in plans:
        if args.roofline_gbytes:
            layer, head = roofline_layer_ms(shape, args.roofline_gbytes, args.roofline_efficiency)
            chunk, source = None, (f"roofline {args.roofline_gbytes:g} GB/s x {args.roofline_efficiency:g}, "
                                   f"op floor {args.op_floor_us:g} us")
        else:
            layer, head, chunk = measure_layer_ms(shape, plan, P, counts[0], args.batch, str(device), dtype,
                                                  args.warmup, args.runs)
            source = f"measured on {device}"
        p = predict(shape, plan, P, link, layer, head, counts[0], args.batch, chunk,
                    floor_ms=1e-3 * args.op_floor_us if args.roofline_gbytes else 0.0)
        recs.append({"plan": str(plan), "devices": P, "link_gbps": link.gbps, "link_latency_us": link.latency_us,
                     "tokens": counts[0], "batch": args.batch, "compute": source, "shape": shape.__dict__,
                     **p.to_dict()})
        print(f"{plan} on {P} devices ({source}; link {link.gbps:g} Gbit/s, {link.latency_us:g} us): "
              f"sequential {p.sequential_ms:.3f} ms, pipeline {p.pipeline_ms:.3f} ms, tensor parallel "
              f"{p.tensor_parallel_ms:.3f} ms, SNLP {p.snlp_ms:.3f} ms (SNLP comm {p.comm_snlp_ms:.3f} ms, "
              f"TP comm {p.comm_tp_ms:.3f} ms); weights {p.fits_one_device_gb:.1f} GB")
    if args.json:
        write_json(args.json, recs)
    return 0

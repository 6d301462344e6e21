"""CLI glue for `--distributed` (torchrun): `snlp generate CKPT --distributed` and `snlp bench --distributed`,
and the cost model's `snlp bench --simulate-devices`. snlp.decode.generate.run / snlp.apps.bench.run dispatch
here; the work is done by snlp.dist.layer_parallel and snlp.dist.costmodel."""

from __future__ import annotations

import math
import os
import socket
import sys
import warnings
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from snlp.bench.forward import ModelSpec, build_model, spec_config
from snlp.bench.records import write_records
from snlp.dist.costmodel import Prediction
from snlp.dist.costmodel import Shape as CostShape
from snlp.runtime.device import cli_device, cli_dtype, set_threads, write_json
from snlp.runtime.load import (LoadWindow, load_averages, own_threads, ranks_threads, say_contention, usable_cores,
                               warn_oversubscribed)
from snlp.dist.layer_parallel import (CollectiveError, DistributedSNLP, RankFailureError, check_distributable,
                                      check_timeout, distributed_benchmark, gather_objects, init_distributed, partition)
from snlp.dist.load import RankCheckpoint
from snlp.method.plan import cli_plan, parse_plans


def _setup(args) -> tuple[int, int, torch.device, int]:
    """Process group, device and CPU pinning for a `--distributed` command; (rank, world, device, the cores the job
    may use, read before --pin narrows this rank to one of them)."""
    cores = usable_cores()
    device = cli_device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    rank, world = init_distributed(args.dist_timeout, device)
    if getattr(args, "pin", False):  # one core per rank (local rank r -> core r), one intra-op thread
        allowed = sorted(os.sched_getaffinity(0))  # not `cores`: the job's count stays what it was before pinning
        local = int(os.environ.get("LOCAL_RANK", rank))
        os.sched_setaffinity(0, {allowed[local % len(allowed)]})
        torch.set_num_threads(1)
    set_threads(getattr(args, "threads", None))
    return rank, world, device, cores


def _run_ranked(command: str, args, body) -> int:
    """Set up the process group, run body(rank, world, device, cores) -> exit code and tear the group down; a dead
    or hung peer (RankFailureError), or a collective that failed for another reason (CollectiveError, which quotes
    it), ends this rank with a clear message and exit code 3 instead of a hang."""
    rank, world, device, cores = _setup(args)
    try:
        return body(rank, world, device, cores)
    except (RankFailureError, CollectiveError) as e:
        print(f"snlp {command} (rank {rank}): error: {e}", file=sys.stderr)
        return 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def check_world_fits(plans) -> None:
    """Refuse a plan with fewer chunks than torchrun's WORLD_SIZE before any process group starts (every rank
    would start one, open the checkpoint and then fail in `partition` at the same line). Without WORLD_SIZE,
    init_distributed refuses the missing torchrun environment."""
    world = os.environ.get("WORLD_SIZE")
    if world is None or not world.strip().isdigit():
        return
    for p in plans:
        partition(p.chunks, int(world))


def check_before_ranks(args, plans, ckpt, spec: ModelSpec | None = None) -> None:
    """What every rank would refuse, refused once before any process group starts: the --dist-timeout, a chunk for
    every rank, plans whose surrogate has no distributed form, a checkpoint with nanochat's smear / backout, a plan
    the model's residual stream cannot take (hcn without mHC) and a preheat plan without a calibration (a bench over
    several plans would otherwise time the first ones, then fail on a later one). `spec`: bench's random-weights
    model, which has no calibration to read."""
    try:
        check_timeout(args.dist_timeout)
    except ValueError:
        raise ValueError(f"--dist-timeout must be a finite number of seconds > 0 (got {args.dist_timeout:g})") from None
    check_world_fits(plans)
    for p in plans:
        check_distributable(p)
    from snlp.method.preheat import FILENAME as PREHEAT_FILE

    preheat = [p for p in plans if p.init == "preheat"]
    if ckpt:  # what every rank's RankCheckpoint refuses (a transformers folder, a .gguf file, no weights: with what
        #      it is), refused here once; it reads the config and the weights' header only
        config = RankCheckpoint(ckpt).config
        check_distributable(config=config)
        for p in plans:
            p.check_model(config)
        if preheat and not (Path(ckpt) / PREHEAT_FILE).is_file():  # as snlp.apps.common.plans_preheat
            raise ValueError(f"plan {preheat[0]} starts from the preheat init but checkpoint {ckpt} has no "
                             f"calibration: run `snlp calibrate {ckpt}` first")
    elif spec is not None and not ckpt:
        if preheat:
            raise ValueError(f"plan {preheat[0]} starts from the preheat init, which needs a calibrated checkpoint: "
                             f"give --ckpt CKPT (after `snlp calibrate CKPT`); random weights have no calibration")
        for p in plans:
            if p.surrogate.needs_mhc and spec.hc_streams < 1:
                raise ValueError(f"plan {p}: the {p.surrogate.token} surrogate needs an mHC model: give --hc-streams "
                                 f"N >= 1, or use idn")
        config = spec_config(spec)  # the rest of what every rank's DistributedSNLP refuses (-causal with no window
        for p in plans:  #           in the suffix), here, not after the plans before it were timed
            p.check_model(config)


def refuse_compile(args) -> None:
    """--compile has no distributed counterpart: the distributed solve and the layer-pipelined forward
    interleave collectives with the layer math and run eagerly; refused rather than silently ignored."""
    if getattr(args, "compile", False):
        raise ValueError("--compile is not supported with --distributed: the distributed solve and the "
                         "layer-pipelined forward run eagerly (their collectives sit between the layer ops); "
                         "drop --compile")


def run_generate(args) -> int:
    """`torchrun --nproc_per_node=P -m snlp generate CKPT --distributed ...` (called by snlp.apps.generate.run)."""
    if getattr(args, "share_weights", False) or getattr(args, "min_confidence", 0.0):
        raise ValueError("--share-weights and --min-confidence are single-process drafter options; the distributed "
                         "drafter keeps each rank's own fused chunk weights and drafts whole blocks: drop them")
    if args.mode not in ("snlp", "sequential", "speculative"):
        raise ValueError(f"--distributed supports --mode snlp, speculative or sequential (layer-pipelined), "
                         f"not {args.mode}")
    if args.plan is None:
        raise ValueError("--distributed needs --plan: its chunks are what the ranks split (e.g. --plan 8xF1-h0-K1)")
    refuse_compile(args)
    if args.mode == "speculative" and not args.no_baseline and args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1 (got {args.repeats})")
    # bad values before the process group is set up and every rank reads its layers (snlp.apps.generate.check_args
    # is the single-process run's)
    from snlp.apps.common import check_plans_fit
    from snlp.decode.session import check_decode_args, sampling
    from snlp.method.plan import Plan

    check_decode_args(args.max_new_tokens, args.temperature, args.block if args.mode == "speculative" else None)
    sampling(args.temperature, args.top_k, args.top_p)
    from snlp.apps.generation_defaults import check_penalty_flag

    check_penalty_flag(getattr(args, "repetition_penalty", None))
    from snlp.io.source import check_source

    check_source(args.ckpt, "checkpoint", hub=False)  # one line, with the closest names
    check_plans_fit(args.ckpt, [args.plan])  # its depth from the checkpoint's config, before any rank starts
    check_before_ranks(args, [Plan.parse(args.plan)], args.ckpt)  # a chunk for every rank, a distributed surrogate
    # a diag:fd eps below the FD step floor of the dtype every rank builds its model in (GPT(config)'s, on `meta`:
    # no weights read): each rank's DistributedSNLP refused it only after the process group had started
    from snlp.method.jacobian import check_fd_step

    check_fd_step(Plan.parse(args.plan), RankCheckpoint(args.ckpt).meta_model().wte.weight.dtype, "meta")
    if RankCheckpoint(args.ckpt).tokenizer() is None:  # as snlp.apps.generate.run, before any rank reads weights
        raise ValueError(f"checkpoint {args.ckpt} has no tokenizer; save it with one to use `snlp generate`")
    if args.eos_id:  # an id the model can never generate: as snlp.apps.generate.run, from the config
        from snlp.decode.session import stop_set
        from snlp.io.checkpoint import is_snlp_checkpoint, load_config

        if is_snlp_checkpoint(args.ckpt):
            stop_set(args.eos_id if len(args.eos_id) > 1 else args.eos_id[0], load_config(args.ckpt).vocab_size)
    return _run_ranked("generate", args, lambda rank, world, device, cores: _run_generate_ranked(args, rank, world,
                                                                                                 device, cores))


def _run_generate_ranked(args, rank: int, world: int, device, cores: int) -> int:

    ckpt = RankCheckpoint(args.ckpt, device)  # this rank reads only its own layers' tensors (snlp.dist.load)
    tok = ckpt.tokenizer()
    if tok is None:
        raise ValueError(f"checkpoint {args.ckpt} has no tokenizer; save it with one to use `snlp generate`")
    plan = cli_plan(args.plan, ckpt.config.n_layer)
    from snlp.apps.generation_defaults import penalty_and_source

    given = getattr(args, "repetition_penalty", None) is not None
    # as snlp.apps.generate.run: the flag, else the generation config's, else 1; the record names which
    penalty, penalty_source = penalty_and_source(args, tok)
    if rank == 0 and tok.foreign:  # as snlp.apps.generate.run: the converted model's generation defaults not applied
        from snlp.apps.generation_defaults import defaults_note

        note = defaults_note(tok.meta.get("generation_config") or {}, args.temperature, args.top_k, args.top_p,
                             repetition_penalty=penalty, penalty_given=given)
        if note:
            print(note, file=sys.stderr)
    from snlp.apps.generation_defaults import stop_ids_and_source

    # as snlp.apps.generate.prompt_ids: the chat template or the text, stopping at --eos-id's ids, else the model's
    chat = getattr(args, "chat", False)
    prompt = tok.chat_prompt([{"role": "user", "content": args.prompt}]) if chat else tok.prompt_ids(args.prompt)
    stops = stop_ids_and_source(args.eos_id, tok, chat)
    eos_id = stops[0] or None
    if rank == 0:  # snlp.apps.generate.run's notes: an empty prompt, a decode reaching past the trained context
        from snlp.apps.common import warn_causal_idle
        from snlp.apps.streaming import past_context

        if not args.prompt and not getattr(args, "chat", False):
            print("snlp generate: the prompt is empty: generating from the tokenizer's BOS alone (give --prompt TEXT "
                  "to continue a text)", file=sys.stderr)
        past_context(ckpt, len(prompt), args.max_new_tokens)
        warn_causal_idle([plan], ckpt.config, len(prompt) + args.max_new_tokens)
    runner = DistributedSNLP(ckpt.meta_model(), plan, keep_layers=args.mode != "snlp", checkpoint=ckpt,
                             preheat=ckpt.preheat() if plan.init == "preheat" else None)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, eos_id=eos_id,
              seed=args.seed, top_k=args.top_k, top_p=args.top_p, repetition_penalty=penalty)
    # rank 0 streams as snlp.apps.generate.run does: the prompt with the first tokens (a chat's on a line of its own),
    # the stop id not printed (the summary line names it)
    from snlp.apps.streaming import streamer

    hide = stops[0]
    stream = streamer(tok, hide, head=args.prompt + ("\n" if getattr(args, "chat", False) else "")) \
        if rank == 0 and not args.quiet else None
    base = None
    if args.mode == "speculative" and not args.no_baseline:
        base = runner.generate(prompt, "sequential", **kw)
    res = runner.generate(prompt, args.mode, block=args.block,
                          on_tokens=stream, **kw)
    # gathered before the timing (a collective every rank reaches): a cut timing leaves no collective to finish
    mem = gather_objects(runner.memory(max_len=len(prompt) + args.max_new_tokens))  # the decodes' KV window too
    if rank == 0 and stream is not None:
        stream.flush_head()
        print()
    rounds = []  # as snlp.apps.generate.run: the runs above warm both sides up, then --repeats timed rounds of each
    window = None
    if base is not None:
        from snlp.runtime.timing import round_order

        try:
            window, own = rank_load(device, cores, rank, remedy=False)  # generate has no --threads
            for r in range(args.repeats):  # the pair's order rotated round by round (the same on every rank)
                got = {mode: runner.generate(prompt, mode, **(dict(kw, block=args.block) if mode != "sequential"
                                                                else kw))
                       for mode in round_order(["sequential", args.mode], r)}
                rounds.append((got["sequential"], got[args.mode]))
        except KeyboardInterrupt:  # Ctrl-C (or a signal raised as one) in the timing, after the generation: rank 0
            if rank == 0:  # keeps it as snlp generate does (printed, --json with "timing": "interrupted")
                from snlp.apps.streaming import keep_on_interrupt

                record, stats = generation_record(args, res, tok, plan, world, mem, penalty, penalty_source, base,
                                                   stops)
                with keep_on_interrupt(args, stats, record):
                    raise
            raise
        finally:
            if window is not None:
                window.close()
    if rank == 0:
        record, stats = generation_record(args, res, tok, plan, world, mem, penalty, penalty_source, base,
                                                   stops)
        if base is not None:
            from statistics import median as med

            from snlp.bench.stats import paired_verdict, ratio_range, verdict_text

            record["sequential_tokens"] = base.tokens
            # sampled: each side draws its own tokens (the same law, not the same draws): nothing to compare
            record["matches_sequential"] = None if args.temperature > 0 else \
                all(r.tokens == res.tokens for r in [base, *(x for p in rounds for x in p)])
            record["repeats"] = len(rounds)
            # every timed run of each side and each round's paired ratio, in round order: the medians and the
            # verdict below are recomputable from the record
            record["pipeline_sequential_tokens_per_s_runs"] = [s.tokens_per_s for s, _ in rounds]
            record["speculative_tokens_per_s_runs"] = [p.tokens_per_s for _, p in rounds]
            ratios = record["speedup_rounds"] = [p.tokens_per_s / s.tokens_per_s for s, p in rounds]
            record["pipeline_sequential_tokens_per_s"] = med(record["pipeline_sequential_tokens_per_s_runs"])
            record["speculative_tokens_per_s"] = med(record["speculative_tokens_per_s_runs"])
            record["measured_speedup"] = med(ratios)
            record["speedup_verdict"] = paired_verdict(ratios)[0]
            record["speedup_range"] = [min(ratios), max(ratios)]
            # as snlp.apps.generate: the streamed run's rate ran once at its own moment's load; the warm medians
            # of both sides stand beside the ratio, and the ratio says whether the paired runs resolve it; the
            # ratios' range holds both the median ratio and the ratio of the two medians, which can differ in sign
            stats += (f"; timed over "
                      f"{len(rounds)} runs of each after a warm-up: speculative "
                      f"{record['speculative_tokens_per_s']:.1f} tok/s, pipelined sequential "
                      f"{record['pipeline_sequential_tokens_per_s']:.1f} tok/s (each side's own median), speedup "
                      f"{record['measured_speedup']:.2f}x (the median of the paired per-run ratios, which ran "
                      f"{ratio_range(ratios)}: {verdict_text(ratios, 'pipelined sequential')})")
        print(stats)
        if window is not None:  # rank 0's window around the timed rounds, against every local rank's threads
            say_contention(window, own)
            record["load"] = window.to_json()
        if args.json:
            write_json(args.json, record)
    return 0


def generation_record(args, res, tok, plan, world: int, mem, penalty, penalty_source, base,
                      stops: tuple[list[int], str]) -> tuple[dict, str]:
    """Rank 0's --json record and summary line of a distributed generation, before any timing fields (the timed
    comparison adds them; a cut timing keeps these alone). `stops`: the run's stop ids and their source
    (snlp.apps.generation_defaults.stop_ids_and_source)."""
    from snlp.apps.generation_defaults import sampling_record, stop_phrase

    record = {"tokens": res.tokens, "text": tok.decode(res.tokens, mark_missing=True),
              "sampling": sampling_record(args, penalty, penalty_source), "world_size": world,
              "chunks_per_rank": [list(b) for b in partition(plan.chunks, world)], "memory_per_rank": mem,
              **{k: v for k, v in res.to_dict().items() if k != "tokens"}, "stop_ids": stops[0],
              "stop_ids_source": stops[1],
              "drafter": None}  # the key snlp generate's record holds (its --drafter): --distributed refuses one
    stats = (f"[distributed {res.mode} {plan} over {n_ranks(world)}] {len(res.tokens)} tokens, "
             f"{res.tokens_per_s:.1f} tok/s{' in this one run' if base is not None else ''}, stop: {res.stop}, "
             f"{stop_phrase(*stops)}")
    if res.mode == "speculative":  # as snlp generate's line: the block and the acceptance, --no-baseline or not
        from snlp.apps.common import NO_DRAFTS

        alpha = f"alpha={res.acceptance_rate:.3f}" if res.examined else NO_DRAFTS
        stats += f", B={res.block}, {alpha}, tokens/round={res.tokens_per_round:.2f}"
    return record, stats


@dataclass
class DistBenchRow:
    """What every row of `snlp bench --distributed` carries (snlp.dist.layer_parallel.distributed_benchmark's
    keys), plus rank 0's run context."""

    what: ClassVar[str]  # prefill | decode: the subclass
    plan: str
    world_size: int
    tokens: int
    batch: int
    runs: int
    chunks_per_rank: list[list[int]]
    max_rank_bytes: int
    memory_per_rank: list[dict]
    loadavg: list[str]  # /proc/loadavg's 1, 5 and 15 min (empty where there is none)
    pinned: bool  # --pin: one core and one thread per rank
    threads: int

    def to_dict(self) -> dict:
        return {"what": self.what, **asdict(self)}


@dataclass
class DistPrefillRow(DistBenchRow):
    """Distributed SNLP prefill vs the layer-pipelined sequential forward (ms, medians)."""

    what: ClassVar[str] = "prefill"
    pipeline_sequential_ms: float
    snlp_ms: float
    speedup: float
    h_S_broadcast_ms: float  # what replicating the prefix would save
    prefix_ms_rank0: float  # ... and what it costs
    # the two sides are timed one loop after the other, not paired: the speedup's noise is the range their p10-p90
    # spreads allow, a tie where it holds 1 or where the rank-sum test does not resolve it (stats.unpaired_verdict)
    pipeline_sequential_times_ms: list[float] | None = None
    snlp_times_ms: list[float] | None = None
    speedup_lo: float | None = None
    speedup_hi: float | None = None
    speedup_tie: bool | None = None


@dataclass
class DistDecodeRow(DistBenchRow):
    """Per-token decode latency of one mode (sequential pipelined / snlp / speculative at `block`)."""

    what: ClassVar[str] = "decode"
    mode: str
    block: int | None
    ms_per_token: float
    speedup_vs_pipeline: float
    matches_sequential: bool
    prompt_len: int
    new_tokens: int
    repetition_penalty: float = 1.0  # the penalty every mode's decode applied (1: none) ...
    repetition_penalty_source: str = "default"  # ... from: flag | generation_config (a converted --ckpt's) | default
    alpha: float | None = None  # speculative rows only: pooled over the timed runs (accepted / examined drafts)
    alpha_runs: list[float | None] | None = None  # ... and each timed run's own (None: it drafted nothing)
    tokens_per_round: float | None = None  # output tokens per round (cut at a stop id)
    draft_ms_per_step: float | None = None
    verify_ms_per_round: float | None = None
    # every mode runs once per round: run i pairs with the pipelined sequential run i (snlp.bench.stats.paired_verdict)
    ms_per_token_runs: list[float] | None = None
    sequential_ms_per_token_runs: list[float] | None = None
    speedup_rounds: list[float] | None = None  # sequential / this ms per token, run by run (None for sequential)
    speedup_verdict: str | None = None  # faster | slower | tie
    speedup_wins: int | None = None
    speedup_losses: int | None = None
    speedup_p: float | None = None


def dist_bench_row(rec: dict, **context) -> DistPrefillRow | DistDecodeRow:
    """A distributed_benchmark record (a dict, keyed by `what`) as its typed row, with rank 0's context and its
    speedup's noise verdict: the spreads rule for prefill (its sides are not paired), the sign test for decode."""
    from snlp.bench.stats import paired_fields, unpaired_verdict

    cls = DistPrefillRow if rec["what"] == "prefill" else DistDecodeRow
    row = cls(**{k: v for k, v in rec.items() if k != "what"}, **context)
    if isinstance(row, DistPrefillRow) and row.pipeline_sequential_times_ms and row.snlp_times_ms:
        row.speedup_lo, row.speedup_hi, row.speedup_tie = unpaired_verdict(row.pipeline_sequential_times_ms,
                                                                           row.snlp_times_ms)
    if isinstance(row, DistDecodeRow) and row.ms_per_token_runs and row.mode != "sequential":
        for k, v in paired_fields("speedup", [a / b for a, b in zip(row.sequential_ms_per_token_runs,
                                                                    row.ms_per_token_runs)]).items():
            setattr(row, k, v)
    return row


@dataclass
class SimulateRow:
    """One plan's cost-model prediction (`snlp bench --simulate-devices`)."""

    plan: str
    devices: int
    link_gbps: float
    link_latency_us: float
    tokens: int
    batch: int
    compute: str  # where the per-layer times come from: measured on a device, or a roofline
    shape: CostShape
    prediction: Prediction

    def to_dict(self) -> dict:
        d = asdict(self)
        return {**{k: v for k, v in d.items() if k != "prediction"}, **self.prediction.to_dict()}


def run_bench(args, spec: ModelSpec, unread_flags) -> int:
    """`torchrun --nproc_per_node=P -m snlp bench --distributed ...` (called by snlp.apps.bench.run with the
    model flags as `spec`, and its check of the flags a benchmark does not read, `unread_flags(args, kind)`)."""
    refuse_compile(args)
    if getattr(args, "ops", False):
        raise ValueError("--ops (the single-layer op benchmark) is a single-process benchmark: drop --distributed")
    counts = args.tokens if isinstance(args.tokens, tuple) else (args.tokens,)
    if len(counts) != 1:
        raise ValueError(f"--distributed takes one --tokens value (got {','.join(map(str, counts))})")
    unread_flags(args, "distributed --decode" if args.decode else "distributed")  # e.g. --simulate-devices' flags
    # the counts the single-process bench refuses (snlp.apps.bench.run, snlp.bench.decode), refused here too: every
    # rank would otherwise fail late (--runs 0: the median of no runs) or run something else (--blocks 0 ran B = 1
    # under a row that names no block)
    if args.batch < 1 or args.runs < 1 or args.warmup < 0:
        raise ValueError("--tokens, --batch and --runs must be >= 1 and --warmup >= 0")
    if getattr(args, "threads", None) is not None and args.threads < 1:  # as set_threads refuses it on every rank
        raise ValueError("--threads must be >= 1")
    if args.decode:
        blocks = dist_blocks(args.blocks)
        if args.prompt_len < 1 or args.new_tokens < 1 or not blocks or min(blocks) < 1:
            raise ValueError("--prompt-len, --new-tokens and every block size must be >= 1")
        # as the single-process `snlp bench --decode` (snlp.apps.bench.bench_penalty): --repetition-penalty, else a
        # converted --ckpt's generation_config value, else 1; checked before any rank starts
        from snlp.apps.generation_defaults import check_penalty_flag, penalty_and_source
        from snlp.io.checkpoint import checkpoint_tokenizer

        check_penalty_flag(args.repetition_penalty)
        tok = checkpoint_tokenizer(spec.ckpt) if spec.ckpt and args.repetition_penalty is None else None
        args.repetition_penalty, args.repetition_penalty_source = penalty_and_source(args, tok)
    from snlp.apps.common import check_plans_fit, check_plans_grammar, warn_causal_idle

    plans = check_plans_grammar(args.plans)
    # as the single-process bench: a -causal plan whose windows all span the longest sequence is warned about, before
    # any rank starts; every plan runs its prefill rows at --tokens, with --decode its decodes of prompt and new tokens
    # too (the longer of the two: a warning from the decodes alone was false for a longer prefill)
    longest = max(counts[0], args.prompt_len + args.new_tokens) if args.decode else counts[0]
    check_plans_fit(spec.ckpt, plans, longest=longest)
    if not spec.ckpt:  # random weights: the depth is --depth's (every rank would refuse a too deep plan alike)
        for p in plans:
            p.check(spec.depth)
        warn_causal_idle(plans, spec_config(spec), longest)
    check_before_ranks(args, plans, spec.ckpt, spec)
    # a plan listed twice (parse_plans refuses it) and a K beyond the exact count (it warns and caps it): said here,
    # before the process group starts (every rank refused a duplicate after it had), not again by the rank's parse
    parse_plans(args.plans, RankCheckpoint(spec.ckpt).config.n_layer if spec.ckpt else spec.depth)
    # a diag:fd eps below the FD step floor of the dtype every rank builds its model in (_run_bench_ranked's): each
    # rank's DistributedSNLP refused it only at that plan's turn, after the plans before it were timed
    from snlp.method.jacobian import check_fd_step

    device = cli_device(args.device)
    for p in plans:
        check_fd_step(p, getattr(torch, cli_dtype(args.dtype, device)), device.type)
    return _run_ranked("bench", args, lambda rank, world, device, cores: _run_bench_ranked(args, spec, rank, world,
                                                                                            device, cores))


def prefill_line(world: int, r: DistPrefillRow) -> str:
    """A prefill row's line. Its speedup is a tie where the p10-p90 spreads' range holds 1, or where the rank-sum
    test over the two sides' timings does not resolve it (snlp.bench.stats.unpaired_verdict; with too few runs a side
    it never can): the line says which, since a range clear of 1 read beside "tie" looks like a contradiction."""
    from snlp.bench.stats import SIGN_LEVEL, rank_sum_p, separation_p

    spread = ""
    if r.speedup_lo is not None:
        spread = f", p10-p90 spreads allow {r.speedup_lo:.2f}-{r.speedup_hi:.2f}x"
        if r.speedup_tie and not r.speedup_lo <= 1.0 <= r.speedup_hi:
            n, m = len(r.pipeline_sequential_times_ms or ()), len(r.snlp_times_ms or ())
            spread += (f": tie, {r.runs} runs a side are too few for separated spreads to tell a difference"
                       if separation_p(n, m) >= SIGN_LEVEL else
                       f": tie, the rank-sum test over the {n} and {m} runs does not resolve it (p = "
                       f"{rank_sum_p(r.pipeline_sequential_times_ms, r.snlp_times_ms):.2f})")
        elif r.speedup_tie:
            spread += ": tie"
    return (f"[{n_ranks(world)}] {r.plan} prefill T={r.tokens} B={r.batch}: pipelined sequential "
            f"{r.pipeline_sequential_ms:.2f} ms, distributed SNLP {r.snlp_ms:.2f} ms "
            f"({r.speedup:.2f}x{spread}); max rank memory {r.max_rank_bytes / 1e6:.1f} MB")


PENALTY_SOURCE = {"flag": "--repetition-penalty", "generation_config": "the --ckpt's generation_config",
                  "default": "none: 1 = no penalty"}


def n_ranks(world: int) -> str:
    """"1 rank", "2 ranks": a line's count of the job's processes."""
    return f"{world} rank{'s' if world != 1 else ''}"


def dist_blocks(text: str) -> tuple[int, ...]:
    """--blocks B1,B2,... as integers, in the single-process bench's words where they are not."""
    try:
        return tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise ValueError(f"--blocks must be comma-separated integers, got {text!r}") from None


def rank_load(device, cores: int, rank: int, remedy: bool) -> tuple[LoadWindow | None, int]:
    """Before a distributed timing, on every rank (a collective): the threads the job keeps busy on rank 0's
    machine (every local rank's own_threads, snlp.runtime.load.ranks_threads: the ranks time together), and on
    rank 0 the load window begun over the job's `cores`, with the oversubscription line said once (`remedy`: the
    rank's threads above one, which --threads 1 lowers)."""
    every = gather_objects((socket.gethostname(), own_threads([torch.get_num_threads()], device)))
    own, ranks = ranks_threads(every, every[0][0])
    if rank != 0:
        return None, own
    window = LoadWindow.begin(cores=cores)
    warn_oversubscribed([own], window, device, "--threads 1" if remedy else None, ranks=ranks)
    return window, own


def _run_bench_ranked(args, spec: ModelSpec, rank: int, world: int, device, cores: int) -> int:
    from snlp.bench.stats import tie_footnote, tie_mark

    dtype = getattr(torch, cli_dtype(args.dtype, device))
    ckpt = None
    if spec.ckpt:  # a rank reads only its own layers (snlp.dist.load)
        ckpt = RankCheckpoint(spec.ckpt, device)
        model_fn = lambda: ckpt.meta_model().to(dtype=dtype)  # noqa: E731  filled by DistributedSNLP(checkpoint=)
        L = ckpt.config.n_layer
    else:  # random weights come from one RNG stream over the whole model: every rank draws all of it
        model_fn = lambda: build_model(spec).to(device=device, dtype=dtype).eval()  # noqa: E731  same seed everywhere
        L = spec.depth
    with warnings.catch_warnings():  # run_bench said them before the process group started
        warnings.simplefilter("ignore")
        plans = parse_plans(args.plans, L)
    blocks = dist_blocks(args.blocks)
    counts = args.tokens if isinstance(args.tokens, tuple) else (args.tokens,)
    window, own = rank_load(device, cores, rank, torch.get_num_threads() > 1)
    penalty = args.repetition_penalty if args.decode else 1.0  # resolved in run_bench
    recs = distributed_benchmark(model_fn, plans, counts[0], args.batch, args.warmup, args.runs, spec.seed,
                                 args.decode, args.prompt_len, args.new_tokens, blocks, checkpoint=ckpt,
                                 repetition_penalty=penalty)
    if rank == 0:
        window.close()
        loads = load_averages()  # /proc/loadavg's strings, as the rows always carried them
        load = [] if loads is None else [f"{x:.2f}" for x in loads]
        rows = [dist_bench_row(r, loadavg=load, pinned=bool(args.pin), threads=torch.get_num_threads(),
                               **(dict(repetition_penalty_source=args.repetition_penalty_source)
                                  if r["what"] == "decode" else {}))
                for r in recs]
        if args.decode:  # the penalty every decode row ran with, and its source, above the rows
            print(f"[{n_ranks(world)}] decode rows: repetition penalty {penalty:g} "
                  f"({PENALTY_SOURCE[args.repetition_penalty_source]})")
        for r in rows:
            if isinstance(r, DistPrefillRow):
                print(prefill_line(world, r))
            else:
                print(f"[{n_ranks(world)}] {r.plan} decode {r.mode}{' B=' + str(r.block) if r.block else ''}: "
                      f"{r.ms_per_token:.2f} ms/token ({r.speedup_vs_pipeline:.2f}x"
                      f"{tie_mark(r.speedup_rounds, r.speedup_vs_pipeline)} "
                      f"vs pipelined sequential){', =seq' if r.matches_sequential else ''}")
        print(f"load average {' '.join(load)}")
        say_contention(window, own)  # every local rank's threads are this command's own
        if any(isinstance(r, DistDecodeRow) for r in rows):
            print(tie_footnote(args.runs, "decode speedup", "pipelined sequential over this mode's ms/token of "
                               "the same round"))
        write_records(rows, args.json, args.csv, load=window.to_json())
    return 0


def run_simulate(args, unread_flags, shape_flags, defaults: dict) -> int:
    """`snlp bench --simulate-devices P --link-gbps G --link-latency-us U`: the cost model (snlp.dist.costmodel).
    From snlp.apps.bench: its check of unread flags, the size flags a --shape replaces and the parser's defaults."""
    from snlp.dist.costmodel import (SHAPES, Link, check_devices, measure_chunk_ms, measure_layer_head_ms, predict,
                                     roofline_layer_ms)

    P = args.simulate_devices
    if P < 1:
        raise ValueError(f"--simulate-devices must be >= 1 (got {P})")
    from snlp.apps.common import flag

    # a flag the cost model does not read (--ckpt, --distributed, --hc-streams, ...) would change nothing: refused
    unread_flags(args, "simulate-devices --roofline-gbytes" if args.roofline_gbytes else "simulate-devices")
    # the counts and roofline inputs before anything is measured: a batch < 1 priced a message of no or negative
    # bytes, --runs 0 failed after the first plan's layers were built (the median of no runs)
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1 (got {args.batch})")
    if args.roofline_gbytes is not None:
        from snlp.dist.costmodel import check_roofline

        check_roofline(args.roofline_gbytes, args.roofline_efficiency, args.op_floor_us)
    elif args.runs < 1 or args.warmup < 0:
        raise ValueError("--runs must be >= 1 and --warmup >= 0")
    counts = args.tokens if isinstance(args.tokens, tuple) else (args.tokens,)
    if len(counts) != 1:
        raise ValueError(f"--simulate-devices takes one --tokens value (got {','.join(map(str, counts))})")
    if args.shape:
        if args.shape not in SHAPES:
            raise ValueError(f"unknown --shape {args.shape!r}: valid shapes are {', '.join(SHAPES)}")
        sizes = [flag(d) for d in shape_flags if d in defaults and getattr(args, d) != defaults[d]]
        if sizes:
            raise ValueError(f"--shape {args.shape} is a whole shape; {', '.join(sizes)} would change nothing: drop "
                             f"{'it' if len(sizes) == 1 else 'them'} or --shape")
        shape = SHAPES[args.shape]
    else:
        from snlp.model.gpt import GPTConfig

        cfg = GPTConfig.from_depth(args.depth, aspect_ratio=args.aspect_ratio, head_dim=args.head_dim,
                                   width=args.width, n_kv_head=args.kv_heads, vocab_size=args.vocab_size)
        shape = CostShape(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                          vocab_size=cfg.vocab_size, mlp_ratio=cfg.mlp_ratio)
    device = cli_device(args.device)
    dtype = getattr(torch, cli_dtype(args.dtype, device))
    shape = CostShape(**{**shape.__dict__, "dtype_bytes": torch.finfo(dtype).bits // 8})
    link = Link(args.link_gbps, args.link_latency_us)
    plans = parse_plans(args.plans, shape.n_layer)
    # every plan before the first is measured: a chunk per device (a later plan with fewer failed after the earlier
    # ones were measured and printed), and no -causal: it drops sliding windows, the shape's layers have none (the
    # cost model prices no window), so it would be priced as its non-causal twin (Plan.check_model's refusal, as the
    # benchmarks that run a model give it; warn_causal_idle as they call it, for a shape that had windows)
    from snlp.apps.common import warn_causal_idle

    config = shape.config()
    for p in plans:
        check_devices(p, P)
        if p.causal:
            p.check_model(config)
    warn_causal_idle(plans, config, counts[0])
    rows = []
    # the layer and head times are the shape's, not a plan's: measured once, so every row's sequential, pipeline and
    # tensor-parallel columns are one measurement (timed per plan they differed by the timer's noise between rows);
    # a rank's batched chunks once per (ceil(C/P), M)
    timing = (str(device), dtype, args.warmup, args.runs)
    if args.roofline_gbytes:
        layer, head = roofline_layer_ms(shape, args.roofline_gbytes, args.roofline_efficiency)
        source = f"roofline {args.roofline_gbytes:g} GB/s x {args.roofline_efficiency:g}, op floor {args.op_floor_us:g} us"
    else:
        layer, head = measure_layer_head_ms(shape, counts[0], args.batch, *timing)
        source = f"measured on {device}"
    chunks: dict[tuple[int, int], float | None] = {}
    for plan in plans:
        chunk = None
        if not args.roofline_gbytes:
            key = (math.ceil(plan.chunks / P), plan.fuse)
            if key not in chunks:
                chunks[key] = measure_chunk_ms(shape, plan, P, counts[0], args.batch, *timing)
            chunk = chunks[key]
        p = predict(shape, plan, P, link, layer, head, counts[0], args.batch, chunk,
                    floor_ms=1e-3 * args.op_floor_us if args.roofline_gbytes else 0.0)
        rows.append(SimulateRow(plan=str(plan), devices=P, link_gbps=link.gbps, link_latency_us=link.latency_us,
                                tokens=counts[0], batch=args.batch, compute=source, shape=shape, prediction=p))
        print(f"{plan} on {P} device{'s' if P != 1 else ''} ({source}; link {link.gbps:g} Gbit/s, "
              f"{link.latency_us:g} us): "
              f"sequential {p.sequential_ms:.3f} ms, pipeline {p.pipeline_ms:.3f} ms, tensor parallel "
              f"{p.tensor_parallel_ms:.3f} ms, SNLP {p.snlp_ms:.3f} ms (SNLP comm {p.comm_snlp_ms:.3f} ms, "
              f"TP comm {p.comm_tp_ms:.3f} ms); weights {p.fits_one_device_gb:.1f} GB")
    write_records(rows, args.json, args.csv)
    return 0

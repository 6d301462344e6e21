"""Generate text from a checkpoint: sequential, SNLP, self-speculative or Jacobi decoding (KV-cached).

Modes: sequential (the model's own cached decoding), snlp (every forward an SNLP solve: an
approximation of the model unless K >= the plan's exact iteration count, M = 1 and no -causal), speculative (the SNLP forward drafts, the model verifies: greedy output
identical to sequential), jacobi (Jacobi decoding over a block of future tokens, verified).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from snlp.apps.generation_defaults import (check_penalty_flag, defaults_note, eos_flag, penalty_and_source,
                                           sampling_record, stop_ids_and_source, stop_phrase)
from snlp.apps.streaming import keep_on_interrupt, past_context, streamer

SUMMARY = "Generate text: sequential, SNLP, self-speculative or Jacobi decoding."
DESCRIPTION = """\
--mode sequential is the model's own KV-cached decoding; snlp runs every forward as an SNLP solve (an
approximation of the model unless M = 1, no -causal and K reaches the plan's exact count: the chunks, more in other
orders); speculative drafts with the SNLP forward (or an adapted --drafter) and lets the model verify, so greedy
output equals sequential; jacobi decodes a block of future tokens, verified. Prints the text and the decoding statistics;
speculative mode also times sequential decoding beside it (--no-baseline skips that).

  snlp generate runs/y --prompt "ROMEO:" --max-new-tokens 64
  snlp generate runs/y --prompt "ROMEO:" --mode speculative --plan 4xF2-h0-K1 --block 4
  snlp generate runs/smol --chat --prompt "Hello!" --mode speculative --drafter runs/smol-d8
  snlp generate runs/y --prompts-file prompts.jsonl --batch-size 4 --json out.json
"""
GUIDE = "docs/usage.md#train-generate"
# SIGTERM / SIGHUP / SIGUSR1/2 (docker stop, a closed terminal, a Slurm limit) raise as Ctrl-C does
# (snlp.apps.cli.measurement_signals), so a generation finished before its timed comparison is kept as keep_on_interrupt
# keeps it on Ctrl-C; their default action ended the process with the generation lost and --json unwritten
RAISE_STOPS = True


# The library (and torch) loads inside the functions, after the flags are parsed: --help answers at once.
MODES = ("sequential", "snlp", "speculative", "jacobi")  # snlp.decode.generate.MODES (tests check they agree)
# Flags that only some runs read default to None, so one given to a run that does not read it is refused
# (unread_flags) instead of ignored; resolve_defaults then fills these values in.
DEFAULTS = {"block": 4, "seed": 0, "repeats": 3, "prompts_encoding": "utf-8", "dist_timeout": 120.0, "top_k": 0,
            "top_p": 1.0}


def add_arguments(p) -> None:
    p.add_argument("ckpt", help="checkpoint directory (snlp.io.checkpoint.save_checkpoint)")
    p.add_argument("--prompt", default="", help="prompt text (snlp's own tokenizer: its BOS, then the text; a converted "
                   "model's: encoded as transformers' tokenizer(text) encodes it, BOS only where that adds one)")
    p.add_argument("--chat", action="store_true", help="instruct models: wrap --prompt as a user turn with the "
                   "chat template (snlp's own tokenizer: the format `snlp sft` trains, stopping at its "
                   "<|assistant_end|> or <|bos|>)")
    p.add_argument("--mode", default="sequential", help=f"one of {', '.join(MODES)}")
    p.add_argument("--plan", default=None, help="SNLP plan for snlp/speculative/jacobi, e.g. 4xF1-h0-K1")
    p.add_argument("--drafter", default=None, help="an adapted drafter directory (`snlp adapt`): speculative mode drafts "
                   "with it and the checkpoint verifies (output identical to sequential); snlp mode decodes with it "
                   "alone, which is the drafter's approximation of the model, not the model. --plan defaults to "
                   "the drafter's")
    p.add_argument("--block", type=int, default=None, help=f"draft block size B (speculative, jacobi; default "
                   f"{DEFAULTS['block']})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sampling: draw from the K most likely tokens only (ties at "
                   "the K-th kept, as transformers does; default 0 = all)")
    p.add_argument("--top-p", type=float, default=None, help="sampling: draw from the most likely tokens whose "
                   "probability first reaches P (nucleus sampling, after --top-k, as transformers does; default 1 = "
                   "all)")
    p.add_argument("--repetition-penalty", type=float, default=None, help="divide the logit of every id already in "
                   "the text (prompt included) by P where positive, multiply it where negative, as transformers does "
                   "(default: the converted model's generation_config value, else 1 = none)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--eos-id", action="append", default=None, metavar="ID[,ID...]",
                   help="stop after these token ids, or none: decode the whole --max-new-tokens budget (default: a "
                        "converted model's generation-config EOS ids, where transformers' generate() stops; none for "
                        "snlp's own tokenizer, a --chat its end of turn)")
    p.add_argument("--seed", type=int, default=None, help=f"sampling seed (--temperature > 0; default "
                   f"{DEFAULTS['seed']}; prompt i of --prompts-file samples with seed + i)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--no-baseline", action="store_true",
                   help="speculative mode: skip the timed comparison with sequential decoding (no measured "
                        "speedup / s)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"speculative mode: timed rounds of sequential and speculative decoding after one warm-up "
                        f"round of each; the speedups reported are medians (default {DEFAULTS['repeats']}; 6 or "
                        f"more let the sign test tell a speedup from a tie)")
    p.add_argument("--share-weights", action="store_true",
                   help="speculative, M = 1 plans: the drafter's stacked weights and the verifier's layers share one "
                        "storage (each weight byte streamed once; snlp.method.sharing)")
    p.add_argument("--min-confidence", type=float, default=0.0,
                   help="speculative: stop a round's drafting after a draft whose drafter probability is below this "
                        "(adaptive drafting; 0 = always draft --block tokens; exact either way)")
    p.add_argument("--adaptive-block", action="store_true",
                   help="speculative: each round drafts the block (1..--block) that maximises the expected tokens per "
                        "second at the running acceptance rate and the measured drafter/verifier costs (exact either way)")
    p.add_argument("--prompts-file", default=None,
                   help="decode every prompt of this file instead of --prompt: JSONL with a \"prompt\" field per line, "
                        "or one prompt per line; results are printed (and written to --json) one per prompt, in order")
    p.add_argument("--prompts-encoding", default=None, help=f"text encoding of --prompts-file (e.g. latin-1; default "
                   f"{DEFAULTS['prompts_encoding']})")
    p.add_argument("--batch-size", type=int, default=1,
                   help="--prompts-file: decode this many prompts at once as one ragged batch (sequential, snlp, "
                        "speculative; every row's tokens equal its own single-prompt output)")
    p.add_argument("--compile", action="store_true",
                   help="run prefill and decode steps compiled (torch.compile fullgraph static-shape steps, CUDA graphs on "
                        "CUDA; sequential, snlp and speculative modes); compile time is reported, not timed")
    p.add_argument("--quiet", action="store_true", help="do not stream the text")
    p.add_argument("--json", default=None, help="write tokens, text and statistics to this JSON file")
    p.add_argument("--distributed", action="store_true",
                   help="layer-parallel over torchrun ranks (snlp.dist.layer_parallel): `torchrun --nproc_per_node=P -m snlp "
                        "generate CKPT --distributed --plan ... --mode snlp|speculative|sequential`")
    p.add_argument("--dist-timeout", type=float, default=None,
                   help=f"--distributed: seconds before a dead or silent peer rank makes the others fail (default "
                        f"{DEFAULTS['dist_timeout']:g})")


def unread_flags(args) -> None:
    """Refuse a flag the chosen run does not read (it would change nothing), in one line, before anything loads."""
    spec = args.mode == "speculative"
    rules = [
        (args.block is not None and args.mode not in ("speculative", "jacobi"),
         f"--block is the draft block of --mode speculative and jacobi; --mode {args.mode} drafts nothing"),
        (args.plan is not None and args.mode == "sequential" and not args.distributed,
         "--mode sequential decodes with the model alone and reads no --plan (did you mean --mode snlp or "
         "speculative?)"),
        (args.no_baseline and not spec, f"--no-baseline skips speculative mode's timed comparison; --mode {args.mode} "
                                        f"has none"),
        (args.repeats is not None and (not spec or args.no_baseline or args.prompts_file is not None),
         "--repeats sets the timed rounds of speculative mode's comparison with sequential decoding" +
         (", which --no-baseline skips" if spec and args.no_baseline else
          "; --prompts-file times one batched run of each side, no rounds" if spec else
          f"; --mode {args.mode} has none")),
        (args.seed is not None and args.temperature == 0,
         "--seed seeds sampling; greedy decoding (--temperature 0) draws nothing: give --temperature > 0 or drop "
         "--seed"),
        ((args.top_k is not None or args.top_p is not None) and args.temperature == 0,
         "--top-k / --top-p filter what sampling draws from; greedy decoding (--temperature 0) draws nothing: give "
         "--temperature > 0 or drop them"),
        (args.dist_timeout is not None and not args.distributed,
         "--dist-timeout is the peer-rank timeout of --distributed; a single process has no peers"),
        (args.prompts_encoding is not None and args.prompts_file is None,
         "--prompts-encoding reads --prompts-file; give --prompts-file (or drop it: --prompt is text already)"),
    ]
    for bad, why in rules:
        if bad:
            raise ValueError(why)


def resolve_defaults(args) -> None:
    for k, v in DEFAULTS.items():
        if getattr(args, k, None) is None and not (k == "seed" and args.temperature == 0):
            setattr(args, k, v)  # greedy decoding keeps seed None: the decode functions refuse a seed it cannot use


def check_args(args) -> None:
    """Refuse flag combinations a mode cannot honour, and bad values, before anything is loaded."""
    from snlp.decode.batch import check_batch_plan
    from snlp.decode.session import check_decode_args, sampling
    from snlp.method.plan import Plan

    if args.mode not in MODES:
        raise ValueError(f"unknown mode {args.mode!r}: valid modes are {', '.join(MODES)}")
    if args.drafter and args.mode not in ("speculative", "snlp"):
        raise ValueError("--drafter drafts in --mode speculative (exact) or decodes alone in --mode snlp "
                         f"(approximate); --mode {args.mode} does not use it")
    if args.drafter and args.share_weights:
        raise ValueError("--drafter has its own suffix weights: --share-weights cannot use it")
    if args.mode != "sequential" and args.plan is None and args.mode != "jacobi" and not args.drafter:
        raise ValueError(f"--mode {args.mode} needs --plan (e.g. --plan 4xF1-h0-K1)")
    if args.mode == "jacobi" and args.temperature != 0:
        raise ValueError("--mode jacobi is greedy only: use --temperature 0")
    if args.mode == "jacobi" and args.compile:
        raise ValueError("--compile supports the sequential, snlp and speculative modes (Jacobi rounds change shape "
                         "every iteration); drop --compile for --mode jacobi")
    check_max_new_tokens(args.max_new_tokens)  # before the library's check, which names its argument, not the flag
    check_decode_args(args.max_new_tokens, args.temperature, args.block)
    sampling(args.temperature, args.top_k, args.top_p)
    check_penalty_flag(args.repetition_penalty)
    # the plan's grammar, and the drafter's directory, before the model loads (its depth is checked once it has)
    plan = None if args.plan is None else Plan.parse(args.plan)
    if args.drafter:
        from snlp.io.drafter import read_meta

        drafted = Plan.parse(read_meta(args.drafter)["plan"])
        plan = plan or drafted
    if not 0.0 <= args.min_confidence <= 1.0:  # as speculative_generate refuses it, before anything loads
        raise ValueError(f"--min-confidence must lie in [0, 1], a probability (got {args.min_confidence!r})")
    if args.compile and plan is not None:  # a tol / DiagN / Newton plan cannot run as one graph (snlp.decode.steps)
        from snlp.decode.steps import check_compilable

        check_compilable(plan)
    if args.share_weights and plan is not None and plan.fuse != 1:  # what snlp.method.sharing refuses once bound
        raise ValueError(f"--share-weights shares each suffix layer's weights between drafter and verifier: it needs "
                         f"one layer per chunk (M = 1, CxF1 plans), and {plan} fuses {plan.fuse} layers per chunk")
    if args.mode != "speculative" and (args.share_weights or args.min_confidence or args.adaptive_block):
        raise ValueError("--share-weights, --min-confidence and --adaptive-block shape the speculative drafter: use "
                         "them with --mode speculative")
    if not isinstance(args.batch_size, int) or args.batch_size < 1:
        raise ValueError(f"--batch-size must be an integer >= 1 (got {args.batch_size!r})")
    if args.prompts_file is None and args.batch_size != 1:
        raise ValueError("--batch-size batches the prompts of --prompts-file: give --prompts-file")
    if args.prompts_file is not None:
        if args.prompt:
            raise ValueError("give either --prompt or --prompts-file, not both")
        if args.mode == "jacobi":
            raise ValueError("--prompts-file decodes batches with --mode sequential, snlp or speculative; Jacobi "
                             "decoding serves one prompt at a time (use --prompt)")
        # a missing or undecodable file: before the model loads
        n = len(read_prompts(args.prompts_file, args.prompts_encoding))
        if min(n, args.batch_size) > 1 and args.mode in ("snlp", "speculative"):  # a batch of several prompts
            check_batch_plan(plan, hint="--batch-size 1 decodes the prompts one at a time")
    if args.mode == "speculative" and not args.no_baseline and args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1 (got {args.repeats})")


def prompt_ids(args, tok) -> tuple[list[int], list[int] | None]:
    """The prompt's ids and the ids to stop after (None: none, the whole budget): with --chat the tokenizer's chat
    template, else the text's ids (Tokenizer.prompt_ids: a converted model's as transformers' tokenizer encodes them);
    the stop ids are --eos-id's where given (`eos_flag`), else the model's (`stop_ids_and_source`: a converted model's
    generation-config EOS ids for a plain prompt and a chat alike, as transformers' generate() stops)."""
    ids = tok.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat else tok.prompt_ids(args.prompt)
    return ids, stop_ids_and_source(args.eos_id, tok, args.chat)[0] or None


def decode(args, model, prompt, plan, preheat, eos_id, on_tokens, steps: dict | None = None, drafter=None):
    """One generate call in --mode; `steps` ({"seq": ..., "draft": ...}, prebuilt) lets several calls share compiled
    graphs (--prompts-file decodes one batch per call); `drafter`: an adapted drafter (`snlp adapt`)."""
    from snlp.decode.generate import sequential_generate, snlp_generate
    from snlp.decode.jacobi import jacobi_generate
    from snlp.decode.speculative import speculative_generate

    kw = dict(max_new_tokens=args.max_new_tokens, eos_id=eos_id, on_tokens=on_tokens,
              repetition_penalty=args.repetition_penalty)
    if args.mode != "jacobi":  # greedy only (check_args)
        kw.update(top_k=args.top_k, top_p=args.top_p)
    steps = steps or {}
    if args.mode == "sequential":
        return sequential_generate(model, prompt, temperature=args.temperature, seed=args.seed, compile=args.compile,
                                   step=steps.get("seq"), **kw)
    if args.mode == "snlp":
        return snlp_generate(model if drafter is None else drafter.model, prompt, plan, temperature=args.temperature,
                             seed=args.seed, compile=args.compile, preheat=preheat, step=steps.get("draft"), **kw)
    if args.mode == "speculative":
        return speculative_generate(model, prompt, plan, block=args.block, temperature=args.temperature,
                                    seed=args.seed, compile=args.compile, preheat=preheat,
                                    share_weights=args.share_weights, min_confidence=args.min_confidence,
                                    adaptive=args.adaptive_block, draft=steps.get("draft"), verify=steps.get("seq"),
                                    drafter=drafter, **kw)
    return jacobi_generate(model, prompt, plan, block=args.block, preheat=preheat, **kw)


def interrupt_hint(args) -> str:
    """What an interrupted `snlp generate` kept: set by keep_on_interrupt where the cut came in the timing."""
    return getattr(args, "kept", "")


def baseline(args, model, prompt, plan, preheat, eos_id, res, record: dict, drafter=None) -> str:
    """s and the measured speedup of a speculative run: both sides warm, repeated, medians, stopping at the same
    EOS as the run itself (like for like). Fills `record`, returns the summary's tail."""
    from snlp.bench.stats import fewest_sign_rounds, paired_verdict, ratio_range, verdict_text
    from snlp.decode.speculative import speculative_benchmark

    if not args.quiet:  # the output is done but the command is not: say what the minutes after it are
        print(f"snlp generate: timing speculative against sequential decoding, 1 warm-up and {args.repeats} timed "
              f"runs of each (up to {args.max_new_tokens} tokens a run; --no-baseline skips this)", file=sys.stderr)
    rows, seq_tokens = speculative_benchmark(model, [prompt], plan, (args.block,), args.max_new_tokens,
                                             progress=not args.quiet,
                                             repeats=args.repeats, warmup=1, temperature=args.temperature,
                                             top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_id=eos_id,
                                             compile=args.compile, preheat=preheat,
                                             share_weights=args.share_weights, min_confidence=args.min_confidence,
                                             adaptive=args.adaptive_block, drafter=drafter,
                                             repetition_penalty=args.repetition_penalty)
    rep = rows[0]
    record["report"] = rep.to_dict()
    record["sequential_tokens_per_s"] = 1e3 / rep.sequential_ms_per_token
    record["speculative_tokens_per_s"] = 1e3 / rep.speculative_ms_per_token
    record["matches_sequential"] = None if args.temperature > 0 else \
        rep.matches_sequential and res.tokens == seq_tokens[0]  # sampled: two sides' own draws, nothing to compare
    # both sides' warm rates beside the ratio: the line's first tok/s is the one streamed run's, which ran cold and
    # at another moment's load (a run printed 28 tok/s there beside sequential 321 tok/s and a 1.30x speedup)
    # the ratio is a result only where the paired runs resolve it (the main table's sign test): 3 runs never do
    record["speedup_verdict"] = paired_verdict(rep.round_speedups)[0]
    need = fewest_sign_rounds()  # the default --repeats is below it: say which value can give a verdict
    more = f"; --repeats {need} or more can resolve it" if args.repeats < need else ""
    # each rate is its own side's median and the speedup the median of the paired ratios: under load the two can
    # disagree in sign (3.5 vs 3.3 tok/s beside 0.74x); the ratios' range holds both (stats.ratio_range), so it is
    # printed beside them
    record["speedup_range"] = [min(rep.round_speedups), max(rep.round_speedups)]
    s = f"s={rep.drafter_speedup_s:.2f}" if rep.drafter_speedup_s is not None else "s not measured (no drafter steps)"
    ideal = f"{rep.ideal_ssd_speedup:.2f}x" if rep.ideal_ssd_speedup is not None else "not measured (no drafts)"
    return (f", {s}; timed over {args.repeats} runs of each after a warm-up: "
            f"speculative {record['speculative_tokens_per_s']:.1f} tok/s, sequential "
            f"{record['sequential_tokens_per_s']:.1f} tok/s (each side's own median), speedup measured "
            f"{rep.measured_speedup:.2f}x (the median of the paired per-run ratios, which ran "
            f"{ratio_range(rep.round_speedups)}: {verdict_text(rep.round_speedups)}{more}) vs ideal SSD {ideal}")


def check_max_new_tokens(n: int) -> None:
    """Refuse --max-new-tokens 0 (the library's empty generation: here a run that printed "0 tokens, nan tok/s") and
    below, in the flag's words (single-process and --distributed alike: run_generate returns before check_args)."""
    if n < 1:
        raise ValueError(f"--max-new-tokens {n} generates nothing: give N >= 1")


def read_prompts(path: str, encoding: str = "utf-8") -> list[str]:
    """The prompts of a --prompts-file: JSONL (every non-empty line a JSON object with a "prompt" string) or plain
    text (one prompt per non-empty line; a line is JSONL if it starts with "{")."""
    from snlp.io.data import read_text

    if Path(path).is_dir():
        raise ValueError(f"--prompts-file {path} is a folder; name a file (JSONL with a \"prompt\" field per line, or "
                         f"one prompt per line)")
    if not Path(path).is_file():
        from snlp.io.source import did_you_mean

        raise ValueError(f"--prompts-file {path} does not exist{did_you_mean(path)}")
    prompts = []
    for n, line in enumerate(read_text(path, encoding, "--prompts-encoding").splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: a line starting with '{{' must be a JSON object ({e})") from e
            if not isinstance(rec.get("prompt"), str):
                raise ValueError(f"{path}:{n}: a JSONL line needs a \"prompt\" string field")
            prompts.append(rec["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompts-file {path} holds no prompt")
    return prompts


def decode_batches(args, model, prompts: list, plan, preheat, eos_id, mode: str | None = None,
                   drafter=None) -> tuple[list, float]:
    """Decode the prompts in batches of --batch-size (one ragged batch each); returns the results in order and the
    decode seconds summed over the batches (each batch's wall time, prefill excluded). Row i samples with seed
    --seed + i (snlp.decode.batch)."""
    results, wall = [], 0.0
    steps = shared_steps(args, model, plan, preheat, drafter)
    for k in range(0, len(prompts), args.batch_size):
        a = argparse_copy(args, mode=mode or args.mode, seed=None if args.seed is None else args.seed + k)
        batch = prompts[k:k + args.batch_size]
        if len(batch) == 1:  # one prompt (--batch-size 1, or the last of a file): the single-prompt path, which
            #                  every plan runs (DiagN / Newton cannot batch) and which gives the same tokens
            res = decode(a, model, batch[0], plan, preheat, eos_id, None, steps, drafter)
            results.append(res)
            wall += res.decode_s
            continue
        rows = decode(a, model, batch, plan, preheat, eos_id, None, steps, drafter)
        results.extend(rows)
        wall += rows[0].extra["batch"]["wall_s"]
    return results, wall


def shared_steps(args, model, plan, preheat, drafter=None) -> dict:
    """--compile: the sequential and drafter steps built once, so every batch reuses their compiled graphs."""
    if not args.compile:
        return {}
    from snlp.decode.steps import sequential_step, snlp_step
    from snlp.method.solver import bind

    steps = {"seq": sequential_step(model, compile=True)}
    if plan is not None:
        steps["draft"] = snlp_step(bind(model if drafter is None else drafter.model, plan, check_finite=False,
                                        preheat=preheat,
                                        share_weights=args.share_weights and args.mode == "speculative"), compile=True)
    return steps


def argparse_copy(args, **kw):
    new = type(args)(**vars(args))
    for k, v in kw.items():
        setattr(new, k, v)
    return new


def method_label(plan, drafter) -> str:
    """What decoded, for the summary line: " PLAN", and ", drafter DIR" where an adapted drafter drafted (speculative)
    or decoded alone (snlp mode: its approximation of the model, not the plan's), which the plan alone reads as the
    model's own post-hoc plan; "" for the model alone."""
    return (f" {plan}" if plan else "") + (f", drafter {drafter}" if drafter else "")


def run_prompts_file(args, model, tok, plan, preheat, drafter=None) -> int:
    """--prompts-file: every prompt decoded (in batches of --batch-size), printed and recorded in order."""
    import torch

    from snlp.apps.common import say_contention, warn_causal_idle
    from snlp.runtime.load import begin_timing
    from snlp.runtime.device import write_json

    texts = read_prompts(args.prompts_file, args.prompts_encoding)
    pairs = [prompt_ids(argparse_copy(args, prompt=t), tok) for t in texts]
    prompts, eos_id = [p for p, _ in pairs], pairs[0][1]
    past_context(model, max(len(p) for p in prompts), args.max_new_tokens)
    warn_causal_idle([plan], (drafter.model if drafter else model).config,
                     max(len(p) for p in prompts) + args.max_new_tokens)
    timed = args.mode == "speculative" and not args.no_baseline  # the two sides' speeds are compared
    threads, device = [torch.get_num_threads()], next(model.parameters()).device
    window = begin_timing(threads, device, remedy=None) if timed else None  # generate has no --threads
    res, wall = decode_batches(args, model, prompts, plan, preheat, eos_id, drafter=drafter)
    total = sum(len(r.tokens) for r in res)
    stops, source = stop_ids_and_source(args.eos_id, tok, args.chat)
    record = {"mode": args.mode, "plan": None if plan is None else str(plan), "drafter": args.drafter,
              "batch_size": args.batch_size, "stop_ids": stops, "stop_ids_source": source,
              "prompts": len(prompts), "tokens": total, "decode_s": wall, "tokens_per_s": total / wall if wall else None,
              "sampling": sampling_record(args),  # row i drew with seed + i (decode_batches)
              "results": [{"prompt": t, "tokens": r.tokens, "text": tok.decode(r.tokens, mark_missing=True),
                           "seed": None if args.seed is None else args.seed + i,
                           **{k: v for k, v in r.to_dict().items() if k not in ("tokens", "extra")}}
                          for i, (t, r) in enumerate(zip(texts, res))]}
    hide = set(stops)  # as run's streamer: the stop id not printed (the summary names it; --json's text keeps it)
    for i, (t, r) in enumerate(zip(texts, res)):
        if not args.quiet:
            print(f"[{i}] {t}{tok.decode([x for x in r.tokens if x not in hide], mark_missing=True)}")
    stats = f"[{args.mode}{method_label(plan, args.drafter)}] {len(prompts)} prompts in batches of " \
            f"{args.batch_size}: " \
            f"{total} tokens, {record['tokens_per_s']:.1f} tok/s, {stop_phrase(stops, source)}"
    if args.mode == "speculative":
        acc, exam = sum(r.accepted for r in res), sum(r.examined for r in res)
        from snlp.apps.common import NO_DRAFTS

        stats += f", alpha={acc / exam:.3f}" if exam else f", {NO_DRAFTS}"
        if not args.no_baseline:  # batched sequential decoding of the same batches: tokens and speed side by side
            with keep_on_interrupt(args, stats, record):
                seq, seq_wall = decode_batches(args, model, prompts, plan, preheat, eos_id, mode="sequential")
            record["sequential_tokens_per_s"] = sum(len(r.tokens) for r in seq) / seq_wall
            # sampled: each side draws its own tokens (the same law, not the same draws), so there is nothing
            # to compare token for token
            record["matches_sequential"] = None if args.temperature > 0 else \
                all(a.tokens == b.tokens for a, b in zip(res, seq))
            record["measured_speedup"] = record["tokens_per_s"] / record["sequential_tokens_per_s"]
            stats += f", speedup {record['measured_speedup']:.2f}x over batched sequential " \
                     f"({record['sequential_tokens_per_s']:.1f} tok/s; one run each, no warm-up: use snlp bench " \
                     f"--decode for medians), identical: " + \
                     ("n/a (sampled: each side draws its own tokens)" if args.temperature > 0
                      else str(record["matches_sequential"]))
    if window is not None:  # above the summary, which stays the last line (before --json's)
        record["load"] = window.close().to_json()
        say_contention(window, threads, device)
    print(stats)
    if args.json:
        write_json(args.json, record)
    return 0


def run(args) -> int:
    import torch

    from snlp.apps.common import check_plans_fit, plans_preheat, say_contention, warn_causal_idle
    from snlp.runtime.load import begin_timing
    from snlp.io.checkpoint import load
    from snlp.io.drafter import load_drafter
    from snlp.method.plan import cli_plan
    from snlp.runtime.device import cli_device, write_json

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    unread_flags(args)
    resolve_defaults(args)
    args.eos_id = eos_flag(args.eos_id)  # None (the model's stop ids), [] (none) or the ids: before anything loads
    if args.distributed and (args.prompts_file or args.batch_size != 1 or args.adaptive_block):
        raise ValueError("--prompts-file, --batch-size and --adaptive-block are single-process options; "
                         "--distributed decodes one --prompt: drop them")
    if args.distributed and args.drafter:
        raise ValueError("--drafter has its own suffix weights: --distributed cannot use it")
    if args.distributed:
        from snlp.apps.dist import run_generate

        check_max_new_tokens(args.max_new_tokens)

        return run_generate(args)
    check_args(args)
    device = cli_device(args.device)
    from snlp.io.source import check_source

    check_source(args.ckpt, "checkpoint", hub=False)  # one line, with the closest names
    check_plans_fit(args.ckpt, [args.plan])  # before the weights load
    model, tok = load(args.ckpt, device="cpu", need_tokenizer="save it with one to use `snlp generate`")
    model = model.to(device).eval()
    if args.eos_id:  # its range needs the model's vocabulary: here, before the prompt is echoed
        from snlp.decode.session import stop_set

        stop_set(args.eos_id if len(args.eos_id) > 1 else args.eos_id[0], model.config.vocab_size)  # as typed
    drafter = None if args.drafter is None else load_drafter(args.drafter, model)  # refuses another base
    plan = drafter.plan if args.plan is None and drafter else None if args.plan is None else \
        cli_plan(args.plan, model.config.n_layer)
    if plan is not None:  # what the model's config refuses (hcn without mHC), before the prompt is echoed
        plan.check_model(model.config)
    if drafter is not None:
        drafter.check_plan(plan)
        if args.mode == "snlp":
            print(f"snlp generate: decoding with the adapted drafter alone ({plan}): its approximation of the model, "
                  "not the model's output (--mode speculative with --drafter is exact)", file=sys.stderr)
    if args.share_weights:  # the model's part of it (mHC layouts): refused here, not after the prompt is echoed
        from snlp.method.sharing import check_shareable

        check_shareable(model, plan.fuse)
    preheat = plans_preheat(args.ckpt, model, [plan])
    given = args.repetition_penalty is not None
    # what every decode call of this run applies, and where it came from (both in --json's record)
    args.repetition_penalty, args.repetition_penalty_source = penalty_and_source(args, tok)
    note = defaults_note(tok.meta.get("generation_config") or {}, args.temperature, args.top_k, args.top_p,
                         greedy_only=args.mode == "jacobi", repetition_penalty=args.repetition_penalty,
                         penalty_given=given) if tok.foreign else None
    if note:  # transformers applies these by default; snlp only its flags (docs/usage.md, Sampling)
        print(note, file=sys.stderr)
    if args.compile:  # the first token waits for every graph: say why the terminal goes quiet (4 minutes on a CPU)
        print("snlp generate: --compile builds the compiled steps before the first token (torch.compile; on a CPU "
              "inductor's C++ build takes minutes on a cold cache); the compile time is printed, not timed",
              file=sys.stderr)
    if args.prompts_file is not None:
        return run_prompts_file(args, model, tok, plan, preheat, drafter)
    if not args.prompt and not args.chat:  # legal (unconditional), but say so; a blank prompt is not empty: its
        # whitespace tokens condition (after BOS where Tokenizer.prompt_ids adds one). Here, after every refusal above
        # (no tokenizer, an --eos-id past the vocabulary, a plan the model or its calibration cannot run): a note
        # before one of them announced a generation that never came
        print("snlp generate: the prompt is empty: generating from the tokenizer's BOS alone (give --prompt TEXT to "
              "continue a text)", file=sys.stderr)
    prompt, eos_id = prompt_ids(args, tok)
    past_context(model, len(prompt), args.max_new_tokens)
    # a kept token's query sits at position < prompt + new tokens: no window narrower than that drops a key it reads
    warn_causal_idle([plan], (drafter.model if drafter else model).config, len(prompt) + args.max_new_tokens)
    # a chat's template markers are not printed, the stop id neither (the summary line says stop: eos and names the
    # ids); a chat prompt is the user's turn: the answer starts on its own line
    stops, source = stop_ids_and_source(args.eos_id, tok, args.chat)
    hide = stops
    stream = None if args.quiet else streamer(tok, hide, head=args.prompt + ("\n" if args.chat else ""))
    res = decode(args, model, prompt, plan, preheat, eos_id, stream, drafter=drafter)
    if stream is not None:
        stream.flush_head()
        sys.stdout.write("\n")
    timed = res.mode == "speculative" and not args.no_baseline  # warm, repeated timings follow on the line
    stats = f"[{res.mode}{method_label(res.plan, args.drafter)}] {len(res.tokens)} tokens, " \
            f"{res.tokens_per_s:.1f} tok/s{' in this one run' if timed else ''}, stop: {res.stop}, " \
            f"{stop_phrase(stops, source)}"
    if args.compile:
        stats += f", compiled in {res.compile_s:.1f} s (before timing, not in tok/s)"
    record = {"tokens": res.tokens, "text": tok.decode(res.tokens, mark_missing=True),
              "sampling": sampling_record(args),  # what repeats the draws: temperature, filters, seed, penalty
              **{k: v for k, v in res.to_dict().items() if k != "tokens"}, "drafter": args.drafter,
              "stop_ids": stops, "stop_ids_source": source}
    if res.mode in ("speculative", "jacobi"):
        from snlp.apps.common import NO_DRAFTS

        alpha = f"alpha={res.acceptance_rate:.3f}" if res.examined else NO_DRAFTS
        stats += f", B={res.block}, {alpha}, tokens/round={res.tokens_per_round:.2f}"
    if res.mode == "speculative" and not args.no_baseline:
        window = begin_timing([torch.get_num_threads()], device, remedy=None)  # generate has no --threads
        with keep_on_interrupt(args, stats, record):
            stats += baseline(args, model, prompt, plan, preheat, eos_id, res, record, drafter)
        record["load"] = window.close().to_json()
        # above the summary, which stays the last line (before --json's) for whoever reads it
        say_contention(window, [torch.get_num_threads()], device)
    print(stats)
    if args.json:
        write_json(args.json, record)
    return 0

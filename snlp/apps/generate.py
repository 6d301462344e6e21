"""Generate text from a checkpoint: sequential, SNLP, self-speculative or Jacobi decoding (KV-cached).

Modes: sequential (the model's own cached decoding), snlp (every forward an SNLP solve: the model's
approximation unless K >= chunks), speculative (the SNLP forward drafts, the model verifies: greedy output
identical to sequential), jacobi (Jacobi decoding over a block of future tokens, verified).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from snlp.decode.generate import MODES, sequential_generate, snlp_generate
from snlp.decode.jacobi import jacobi_generate
from snlp.decode.session import check_decode_args
from snlp.decode.speculative import speculative_benchmark, speculative_generate
from snlp.apps.common import plans_preheat
from snlp.io.checkpoint import load
from snlp.method.plan import Plan
from snlp.runtime.device import cli_device, write_json


def add_arguments(p) -> None:
    p.add_argument("ckpt", help="checkpoint directory (snlp.checkpoint.save_checkpoint)")
    p.add_argument("--prompt", default="", help="prompt text (the tokenizer's BOS is prepended)")
    p.add_argument("--chat", action="store_true", help="instruct models: wrap --prompt as a user turn with the "
                   "tokenizer's chat template (no extra BOS) and stop at its EOS unless --eos-id is given")
    p.add_argument("--mode", default="sequential", help=f"one of {', '.join(MODES)}")
    p.add_argument("--plan", default=None, help="SNLP plan for snlp/speculative/jacobi, e.g. 4xF1-h0-K1")
    p.add_argument("--block", type=int, default=4, help="draft block size B (speculative, jacobi)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--eos-id", type=int, default=None, help="stop after this token id (default: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-baseline", action="store_true",
                   help="speculative mode: skip the timed comparison with sequential decoding (no measured "
                        "speedup / s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="speculative mode: timed rounds of sequential and speculative decoding after one warm-up "
                        "round of each; the speedups reported are medians")
    p.add_argument("--compile", action="store_true",
                   help="run prefill and decode steps compiled (torch.compile fullgraph static-shape steps, CUDA graphs on "
                        "CUDA; sequential, snlp and speculative modes); compile time is reported, not timed")
    p.add_argument("--quiet", action="store_true", help="do not stream the text")
    p.add_argument("--json", default=None, help="write tokens, text and statistics to this JSON file")
    p.add_argument("--distributed", action="store_true",
                   help="layer-parallel over torchrun ranks (snlp.distributed): `torchrun --nproc_per_node=P -m snlp "
                        "generate CKPT --distributed --plan ... --mode snlp|speculative|sequential`")
    p.add_argument("--dist-timeout", type=float, default=120.0,
                   help="--distributed: seconds before a dead or silent peer rank makes the others fail")


def run(args) -> int:
    if getattr(args, "distributed", False):
        from snlp.apps.dist import run_generate

        return run_generate(args)
    if args.mode not in MODES:
        raise ValueError(f"unknown mode {args.mode!r}: valid modes are {', '.join(MODES)}")
    if args.mode != "sequential" and args.plan is None and args.mode != "jacobi":
        raise ValueError(f"--mode {args.mode} needs --plan (e.g. --plan 4xF1-h0-K1)")
    if args.mode == "jacobi" and args.temperature != 0:
        raise ValueError("--mode jacobi is greedy only: use --temperature 0")
    if args.mode == "jacobi" and getattr(args, "compile", False):
        raise ValueError("--compile supports the sequential, snlp and speculative modes (Jacobi rounds change shape "
                         "every iteration); drop --compile for --mode jacobi")
    check_decode_args(args.max_new_tokens, args.temperature, args.block)
    if args.mode == "speculative" and not args.no_baseline and args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1 (got {args.repeats})")
    device = cli_device(args.device)
    if not Path(args.ckpt).exists():
        raise FileNotFoundError(f"checkpoint {args.ckpt} does not exist")
    model, tok = load(args.ckpt, device="cpu")
    model = model.to(device).eval()
    if tok is None:
        raise ValueError(f"checkpoint {args.ckpt} has no tokenizer; save it with one to use `snlp generate`")
    eos_id = args.eos_id
    if args.chat:
        prompt = list(tok.encode(tok.apply_chat_template([{"role": "user", "content": args.prompt}])))
        eos_id = tok.eos_id if eos_id is None else eos_id
    else:
        prompt = ([tok.bos_id] if getattr(tok, "bos_id", None) is not None else []) + list(tok.encode(args.prompt))
    plan = None if args.plan is None else Plan.parse(args.plan, model.config.n_layer)
    preheat = plans_preheat(args.ckpt, model, [plan])
    kw = dict(max_new_tokens=args.max_new_tokens, eos_id=eos_id)
    compile = getattr(args, "compile", False)

    printed = [""]

    def stream(_new: list[int]) -> None:  # decode everything so far: merges across tokens stay right
        text = tok.decode(res_tokens)
        sys.stdout.write(text[len(printed[0]):])
        sys.stdout.flush()
        printed[0] = text

    res_tokens: list[int] = []
    on_tokens = None if args.quiet else (lambda new: (res_tokens.extend(new), stream(new)))
    if not args.quiet:
        sys.stdout.write(args.prompt)
    if args.mode == "sequential":
        res = sequential_generate(model, prompt, temperature=args.temperature, seed=args.seed, on_tokens=on_tokens,
                                  compile=compile, **kw)
    elif args.mode == "snlp":
        res = snlp_generate(model, prompt, plan, temperature=args.temperature, seed=args.seed, on_tokens=on_tokens,
                            compile=compile, preheat=preheat, **kw)
    elif args.mode == "speculative":
        res = speculative_generate(model, prompt, plan, block=args.block, temperature=args.temperature,
                                   seed=args.seed, on_tokens=on_tokens, compile=compile, preheat=preheat, **kw)
    else:
        res = jacobi_generate(model, prompt, plan, block=args.block, on_tokens=on_tokens, preheat=preheat, **kw)
    if not args.quiet:
        sys.stdout.write("\n")
    text = tok.decode(res.tokens)
    stats = f"[{res.mode}{' ' + res.plan if res.plan else ''}] {len(res.tokens)} tokens, " \
            f"{res.tokens_per_s:.1f} tok/s, stop: {res.stop}"
    if compile:
        stats += f", compiled in {res.compile_s:.1f} s (before timing, not in tok/s)"
    record = {"tokens": res.tokens, "text": text, **{k: v for k, v in res.to_dict().items() if k != "tokens"}}
    if res.mode in ("speculative", "jacobi"):
        stats += f", B={res.block}, alpha={res.acceptance_rate:.3f}, tokens/round={res.tokens_per_round:.2f}"
    if res.mode == "speculative" and not args.no_baseline:  # s and the measured speedup: warm, repeated, medians
        rows, seq_tokens = speculative_benchmark(model, [prompt], plan, (args.block,), args.max_new_tokens,
                                                 repeats=args.repeats, warmup=1, temperature=args.temperature,
                                                 seed=args.seed, eos_id=eos_id, compile=compile,
                                                 preheat=preheat)  # the same EOS as the run above
        rep = rows[0]
        record["report"] = rep.to_dict()
        record["sequential_tokens_per_s"] = 1e3 / rep.sequential_ms_per_token
        record["matches_sequential"] = rep.matches_sequential and res.tokens == seq_tokens[0]
        stats += (f", s={rep.drafter_speedup_s:.2f}, speedup measured {rep.measured_speedup:.2f}x "
                  f"vs ideal SSD {rep.ideal_ssd_speedup:.2f}x (medians of {args.repeats} runs after a warm-up; "
                  f"sequential {record['sequential_tokens_per_s']:.1f} tok/s)")
    print(stats)
    if args.json:
        write_json(args.json, record)
    return 0

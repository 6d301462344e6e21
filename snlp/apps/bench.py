"""Benchmark SNLP plans against the sequential forward, measured side by side in one process.

Teacher-forced forward over T tokens at batch B. Every callable is warmed up, then timed
round-robin (one call of each per round, so drift hits all alike); we report medians, the speedup
over sequential and the ideal speedup L / (S + K*evals + [fwd init]) so the gap is visible; the
`iters` column is the iterations each plan ran (fewer than K when its `tol` stopped it).
`--decode` times KV-cached decoding; `--ops` the per-layer cost of forward, FD, JVP and VJP (the
DiagN probe primitives) at each of `--tokens 1,16,...`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

# the flags read no torch: `snlp bench --help` and argument errors answer before it loads (snlp.apps.cli); the
# library is imported inside the functions that run
if TYPE_CHECKING:
    import torch

    from snlp.bench.decode import DecodeRow
    from snlp.bench.forward import ForwardRow, ModelSpec
    from snlp.bench.ops import OpRow
    from snlp.method.plan import Plan
    from snlp.model.gpt import GPT

SUMMARY = "Time SNLP plans against the sequential model, side by side in one process."
DESCRIPTION = """\
Every callable is warmed up, then timed round-robin; the table gives medians, the measured speedup over sequential
and the ideal one, L / (S + K*evals + [fwd]). The model has random weights (--depth) or a checkpoint's (--ckpt).
--decode times KV-cached decoding, --ops one layer's forward, FD, JVP and VJP, --suite the paper's speed column
(paper), snlp's decoders against transformers' (decode) or training steps (train); --json and --csv keep every record.

  snlp bench --depth 16 --tokens 1 --plans 1xF12-h0-K1,12xF1-h0-K1 --json out.json
  snlp bench --decode --ckpt runs/q --plans 6xF1-h0-K1 --blocks 2,4 --new-tokens 64
  snlp bench --ops --tokens 1,16,128
  snlp bench --suite paper --quick --out /tmp/suite     # the paper's speed suite at smoke size
"""
GUIDE = "docs/benchmarks.md"
LOCK_OUTPUTS = True  # a second run writing one of its output paths is refused (snlp.apps.cli.output_locks)


def add_arguments(p) -> None:
    _add_model_flags(p)
    _add_run_flags(p)
    _add_decode_flags(p)
    _add_suite_flags(p)
    _add_ops_flags(p)
    _add_dist_flags(p)


def _add_model_flags(p) -> None:
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
    src.add_argument("--ckpt", default=None, help="benchmark a checkpoint directory instead of random weights "
                     "(--suite decode: also a transformers directory, a .gguf, 'smollm2', or 'random-smollm2' for "
                     "random weights at its shape)")


DEFAULT_PLANS = "1xF12-h0-K1,12xF1-h0-K1"
DEFAULT_BLOCKS = "4"  # --blocks
DEFAULT_TREATMENTS = "eager,compiled"


def _add_run_flags(p) -> None:
    p.add_argument("--plans", default=DEFAULT_PLANS, help="comma-separated plans")
    p.add_argument("--tokens", "-T", type=_token_counts, default="1",
                   help="tokens per forward (teacher-forced); with --ops a comma list, e.g. 1,16,32,64,128")
    p.add_argument("--batch", type=int, default=1, help="sequences per forward")
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds before the timed ones")
    p.add_argument("--runs", type=int, default=30, help="timed rounds (the table gives their medians)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile (fullgraph) both the sequential and SNLP forwards; with --decode the static-shape "
                        "decode steps of both sides (CUDA graphs on CUDA); compile time is reported apart from timings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the records to this JSON file")
    p.add_argument("--csv", default=None, help="write the records to this CSV file (the JSON's keys as columns; "
                   "while a suite goes: under a '# PARTIAL' line)")


def _add_decode_flags(p) -> None:
    dec = p.add_argument_group("decode benchmark (--decode)")
    dec.add_argument("--decode", action="store_true",
                     help="benchmark KV-cached greedy decoding instead: per-token latency of sequential and each "
                          "plan, and self-speculative decoding (each plan drafts, sequential verifies)")
    dec.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (prefilled, not timed; --suite decode: "
                     "each timed call prefills its prompts)")
    dec.add_argument("--new-tokens", type=int, default=64, help="generated tokens per run")
    dec.add_argument("--blocks", default=DEFAULT_BLOCKS, help="comma-separated speculative draft block sizes B")
    dec.add_argument("--batch-sizes", default=None,
                     help="comma-separated batch sizes, e.g. 1,4,8: batched decoding of ragged prompts (one batch of "
                          "each size), aggregate tok/s of batched sequential vs batched SSD per size, every row checked "
                          "against its own sequential output")
    dec.add_argument("--share-weights", action="store_true",
                     help="speculative rows: the drafter shares the verifier's weights (M = 1 plans; with --batch-sizes "
                          "both off and on are measured)")
    dec.add_argument("--min-confidence", type=float, default=0.0,
                     help="speculative rows: stop a round's drafting after a draft below this drafter probability "
                          "(with --batch-sizes an extra variant beside the fixed block)")
    dec.add_argument("--adaptive-block", action="store_true",
                     help="speculative rows: the block adapts to the running acceptance rate (with --batch-sizes an "
                          "extra variant beside the fixed block)")
    dec.add_argument("--repetition-penalty", type=float, default=None, metavar="P",
                     help="every decode (--suite decode: transformers' rows too, generate(repetition_penalty=P)) "
                          "applies transformers' repetition penalty P; default: a converted --ckpt's generation_config "
                          "value, else 1 = none")
    dec.add_argument("--threads", type=int, default=None,
                     help="torch CPU threads, also for the teacher-forced and --ops runs (tiny ops: 1 is often best "
                          "on a shared CPU)")


def _add_suite_flags(p) -> None:
    suite = p.add_argument_group("the suites (--suite paper, decode; snlp.bench.suite, snlp.bench.decode_suite)")
    suite.add_argument("--suite", choices=["paper", "decode", "train"], default=None,
                       help="paper: the paper's speed column (4 shapes, prefill T=2048 and KV-cached decode, eager "
                            "and compiled); decode: snlp's decoders against transformers' generate on one model "
                            "(--ckpt) at --batch-sizes (default 1,4,8); train: training step speed, eager vs "
                            "compiled, plain vs --regs. Written to --out")
    suite.add_argument("--quick", action="store_true",
                       help="--suite: CPU smoke-size run (shrunk shapes, T=16, few runs)")
    suite.add_argument("--out", default="bench-suite", help="--suite: output directory")
    suite.add_argument("--shapes", default=None,
                       help="--suite: comma-separated subset of the shapes 0.5B-nox0ve,0.5B,0.5B-mhc,3B "
                            "(default all); --suite decode: random weights at a paper shape, drafter vs sequential "
                            "step times and a PREDICTED speedup at --alpha")
    suite.add_argument("--suite-tokens", type=int, default=None,
                       help="--suite: prefill length T (default 2048; 16 quick)")
    suite.add_argument("--suite-warmup", type=int, default=None,
                       help="--suite: prefill warm-up rounds (default 50 on cuda as the paper, 2 on cpu); --suite "
                            "decode: untimed rounds (default 2 on cuda, 1 on cpu and quick; --shapes 5, 2, 1)")
    suite.add_argument("--suite-runs", type=int, default=None,
                       help="--suite: prefill timed rounds (default 200 on cuda as the paper, 5 on cpu); --suite "
                            "decode: timed rounds (default 10 on cuda, 5 on cpu, 3 quick; --shapes 50, 10, 3)")
    suite.add_argument("--suite-new-tokens", type=int, default=None,
                       help="--suite: decoded tokens per decode run (default 128; 4 quick, 8 with --suite decode "
                            "--quick)")
    suite.add_argument("--treatments", default=None,
                       help=f"--suite: eager and/or compiled (default {DEFAULT_TREATMENTS}; --suite decode: both on "
                            f"cuda, eager on cpu unless --compile)")
    suite.add_argument("--no-decode", action="store_true", help="--suite paper: skip the KV-cached decode rows")
    suite.add_argument("--suite-plans", default=None,
                       help="--suite decode: comma-separated SNLP plans (snlp rows and drafters); default one plan, "
                            "L/2 layers of F1, K=1; with --shapes the shape's own plans")
    suite.add_argument("--suite-prompts", type=int, default=None,
                       help="--suite decode: prompts one timed call decodes, a batch at a time (a multiple of every "
                            "batch size, at most 8, or the --prompts-file's count): batch-1 rows over several prompts "
                            "(default: one batch)")
    suite.add_argument("--prompts-file", default=None, metavar="FILE",
                       help="--suite decode: a JSON list of prompts (texts, or lists of token ids) to decode instead "
                            "of the suite's eight English texts; each at least --prompt-len tokens")
    suite.add_argument("--suite-methods", default=None,
                       help="--suite decode: which snlp rows run beside snlp sequential (always: the reference and "
                            "the verifier), comma-separated: snlp (SNLP decoding), speculative (default both)")
    suite.add_argument("--early-exit", type=int, default=None,
                       help="--suite decode: transformers' assistant_early_exit E (default L // 4)")
    suite.add_argument("--prompt-lookup", type=int, default=None,
                       help="--suite decode: transformers' prompt_lookup_num_tokens (default 10; 3 quick)")
    suite.add_argument("--no-transformers", action="store_true", help="--suite decode: skip the transformers rows")
    suite.add_argument("--drafter", default=None,
                       help="--suite decode: an adapted drafter directory (snlp adapt) of --ckpt: extra "
                            "self-speculative rows where it drafts with its own plan")
    suite.add_argument("--alpha", default=None,
                       help="--suite decode --shapes: comma-separated acceptance rates the PREDICTED speedup assumes "
                            "(take them from a trained model's measured alpha; default 0.6,0.8)")
    suite.add_argument("--vs-paper", default=None, metavar="PATH",
                       help="time snlp and the paper's own code (nanochat-snlp at PATH) round-robin in one process on "
                            "the paper's prefill plans; vs_paper.json + .md in --out. Its defaults: --shapes the three "
                            "0.5B, --suite-tokens 2048 (256 --quick), --suite-warmup 20 and --suite-runs 50 on cuda, "
                            "1 and 3 on cpu")
    suite.add_argument("--no-ablations", action="store_true",
                       help="--vs-paper: skip the baseline ablations (the paper's bf16 weights, windows off)")
    tr = p.add_argument_group("training step speed (--suite train; snlp.bench.train)")
    tr.add_argument("--regs", default="none,idn", help="--suite train: regulariser variants, none and/or idn / hcn; "
                    "KIND:F (e.g. idn:0.25) runs it on the first ceil(F x batch) rows of each step (snlp train "
                    "--reg-rows F)")
    tr.add_argument("--reg-n", default="24", help="--suite train: the regulariser's suffix lengths N (24: the "
                    "paper table's N of its 0.5B IDN-Reg run, whose script sums N = 8,16,24: pass that for its cost; "
                    "clipped to depth - 1)")
    tr.add_argument("--train-batch", type=int, default=None, help="--suite train: sequences per step (default 8 on "
                    "cuda, 4 on cpu, 2 quick)")
    tr.add_argument("--train-seq-len", type=int, default=None, help="--suite train: tokens per sequence (default "
                    "2048 on cuda, 256 on cpu, 32 quick)")
    tr.add_argument("--train-steps", type=int, default=None, help="--suite train: timed steps (default 20 cuda, 5 "
                    "cpu, 3 quick; each row reports their median and p10-p90)")
    tr.add_argument("--train-warmup", type=int, default=None, help="--suite train: untimed steps after the first "
                    "(default 3 cuda, 1 cpu)")
    tr.add_argument("--optimizer", choices=["muon", "adamw"], default="muon", help="--suite train: the block "
                    "matrices' optimizer")


def _add_ops_flags(p) -> None:
    ops = p.add_argument_group("single-layer op benchmark (--ops)")
    ops.add_argument("--ops", action="store_true",
                     help="time forward, FD, JVP and VJP of ONE layer (the DiagN probe primitives) at each --tokens, "
                          "batch 1, with their ratio to forward (paper Table diag_ops_bench)")
    ops.add_argument("--layer", type=int, default=None, help="layer for --ops (default: the middle layer L // 2)")


def _add_dist_flags(p) -> None:
    dist = p.add_argument_group("multi-device (snlp.dist.layer_parallel, snlp.dist.costmodel)")
    dist.add_argument("--distributed", action="store_true",
                      help="under torchrun: distributed SNLP vs the layer-pipelined sequential forward (with --decode "
                           "also decoding), e.g. torchrun --nproc_per_node=2 -m snlp bench --distributed --pin")
    dist.add_argument("--dist-timeout", type=float, default=120.0, help="seconds before a dead peer rank is an error")
    dist.add_argument("--pin", action="store_true", help="--distributed on CPU: pin local rank r to core r, 1 thread")
    dist.add_argument("--simulate-devices", type=int, default=None, metavar="P",
                      help="cost model: predicted per-token latency of sequential, pipeline, tensor parallel and SNLP "
                           "over P devices (snlp.dist.costmodel)")
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
    """--tokens as argparse's type: argparse shows an ArgumentTypeError's message (a ValueError's it replaces by
    "invalid _token_counts value")."""
    import argparse

    try:
        counts = tuple(int(t) for t in str(text).split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or a comma list like 1,16,32, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return counts


# What each kind of `snlp bench` run reads besides --device, --dtype, --threads and --seed (read by all): a flag of
# another kind given with a non-default value is refused (unread_flags), never ignored: `--suite paper --ckpt X`
# timed random weights, `--ops --plans P` one layer, `--ckpt X --depth 4` the checkpoint's own depth.
SHAPE = ("depth", "width", "aspect_ratio", "head_dim", "kv_heads", "vocab_size", "window_pattern", "no_x0", "no_ve",
         "hc_streams", "hc_static")
DECODE = ("decode", "prompt_len", "new_tokens", "blocks", "batch_sizes", "share_weights", "min_confidence",
          "adaptive_block", "repetition_penalty")
BENCH_READS = {
    "forward": (*SHAPE, "ckpt", "plans", "tokens", "batch", "warmup", "runs", "compile", "json", "csv"),
    "decode": (*SHAPE, "ckpt", "plans", *DECODE, "warmup", "runs", "compile", "json", "csv"),
    "ops": (*SHAPE, "ckpt", "ops", "tokens", "layer", "warmup", "runs", "json", "csv"),
    "suite paper": ("suite", "quick", "out", "shapes", "suite_tokens", "suite_warmup", "suite_runs",
                    "suite_new_tokens", "treatments", "no_decode"),
    # the decode suite decodes its own random model or --ckpt, its rounds and tokens set by the --suite-* flags (the
    # flags it refuses with a reason of their own, such as --plans, are checked before these)
    "suite decode": ("suite", "quick", "out", "ckpt", "shapes", "prompt_len", "blocks", "batch_sizes", "treatments",
                     "compile", "suite_warmup", "suite_runs", "suite_new_tokens", "suite_plans", "suite_methods",
                     "suite_prompts", "prompts_file", "early_exit", "prompt_lookup", "no_transformers", "drafter",
                     "alpha", "repetition_penalty", "json", "csv"),
    "suite train": ("suite", "quick", "out", "shapes", "treatments", "regs", "reg_n", "train_batch", "train_seq_len",
                    "train_steps", "train_warmup", "optimizer"),
    "vs-paper": ("vs_paper", "quick", "out", "shapes", "suite_tokens", "suite_warmup", "suite_runs", "treatments",
                 "no_ablations"),
    # snlp.apps.dist: the layer-parallel benchmark under torchrun (--decode adds its decode flags) and the cost model
    # (a shape preset or the size flags it reads; the measured path reads --warmup / --runs, the roofline its own)
    "distributed": (*SHAPE, "ckpt", "plans", "tokens", "batch", "warmup", "runs", "json", "csv", "distributed", "pin",
                    "dist_timeout"),
    "distributed --decode": (*SHAPE, "ckpt", "plans", "tokens", "batch", "warmup", "runs", "json", "csv",
                             "distributed", "pin", "dist_timeout", "decode", "prompt_len", "new_tokens", "blocks",
                             "repetition_penalty"),
    "simulate-devices": ("simulate_devices", "shape", "depth", "width", "aspect_ratio", "head_dim", "kv_heads",
                         "vocab_size", "plans", "tokens", "batch", "json", "csv", "link_gbps", "link_latency_us",
                         "warmup", "runs"),
    "simulate-devices --roofline-gbytes": ("simulate_devices", "shape", "depth", "width", "aspect_ratio", "head_dim",
                                           "kv_heads", "vocab_size", "plans", "tokens", "batch", "json", "csv",
                                           "link_gbps", "link_latency_us", "roofline_gbytes", "roofline_efficiency",
                                           "op_floor_us"),
}
CHECKED = tuple(dict.fromkeys([*(d for ds in BENCH_READS.values() for d in ds),
    "suite_plans", "suite_methods", "suite_prompts", "prompts_file", "early_exit", "prompt_lookup", "no_transformers",
    "drafter", "alpha", "no_ablations", "pin", "dist_timeout", "link_gbps", "link_latency_us", "shape",
    "roofline_gbytes", "roofline_efficiency", "op_floor_us"]))  # each once: a flag is named once in the refusal


def unread_flags(args, kind: str) -> None:
    """Refuse, in one line before any work, flags the `kind` of run (BENCH_READS) does not read, and a random
    model's shape flags beside --ckpt (the checkpoint has its own shape)."""
    from snlp.apps.common import flag, parser_defaults

    defaults = parser_defaults(add_arguments)
    given = [d for d in CHECKED if d in defaults and getattr(args, d, defaults[d]) != defaults[d]]
    stray = [d for d in given if d not in BENCH_READS[kind]]
    if stray:
        one = len(stray) == 1
        run = {"forward": "`snlp bench` (the forward benchmark)",
               "distributed": "`snlp bench --distributed` without --decode"}.get(kind, f"`snlp bench --{kind}`")
        raise ValueError(f"{', '.join(map(flag, stray))} {'is' if one else 'are'} not read by {run} and would change "
                         f"nothing: drop {'it' if one else 'them'}"
                         + (" (its rounds: --suite-warmup, --suite-runs; its tokens: --suite-new-tokens; its model: "
                            "--ckpt, else its own random one)" if kind == "suite decode" else
                            " (the suites time their own shapes and plans with random weights)"
                            if kind.startswith("suite") else " (it times the paper's shapes and plans with random "
                            "weights; its own flags: --shapes, --quick, --treatments, --suite-tokens, --suite-warmup, "
                            "--suite-runs, --no-ablations)" if kind == "vs-paper" else ""))
    shape = [d for d in given if d in SHAPE]
    if args.ckpt and shape:
        raise ValueError(f"{', '.join(map(flag, shape))} shape{'s' if len(shape) == 1 else ''} a random-weights "
                         f"model; --ckpt {args.ckpt} has its own shape: drop {'it' if len(shape) == 1 else 'them'}")


def model_spec(args) -> ModelSpec:
    """The model flags as a ModelSpec (snlp.bench.forward.build_model's input)."""
    from snlp.bench.forward import ModelSpec

    return ModelSpec(depth=args.depth, width=args.width, aspect_ratio=args.aspect_ratio, head_dim=args.head_dim,
                     kv_heads=args.kv_heads, vocab_size=args.vocab_size, window_pattern=args.window_pattern,
                     x0_residual=False if args.no_x0 else None, value_embeds=not args.no_ve,
                     hc_streams=args.hc_streams, hc_dynamic=not args.hc_static, ckpt=args.ckpt, seed=args.seed)


def partial_files(args) -> list[Path]:
    """The files a long `snlp bench` run rewrites after every finished part (the suites, --vs-paper; the decode
    suite's --csv too, under snlp.runtime.outputs.partial_comment's line): what a run cut short keeps, marked
    partial ("complete": false). The other runs time every row in one round-robin and write their records once, at
    the end."""
    out = None if args.out == "bench-suite" else Path(args.out)
    if getattr(args, "vs_paper", None):
        return [(out or Path("bench-vs-paper")) / f for f in ("vs_paper.json", "vs_paper.md")]
    if args.suite == "decode" and not args.shapes:
        return [Path(p) for p in (args.json, args.csv) if p] + ([out / "decode.json", out / "decode.md"] if out else [])
    if args.suite in ("paper", "train"):
        return [(out or Path(args.out)) / f"{'suite' if args.suite == 'paper' else 'train'}.{ext}" for ext in
                ("json", "md")]
    return []


def default_out_writable(args, out) -> None:
    """Refuse, before any work, a default --out folder that cannot be written (snlp.apps.cli checks only the paths
    typed: a forward benchmark writes no folder): the suite wrote its first file there after its first part ran, and
    stopped with a traceback."""
    from snlp.runtime.outputs import check_output_dir

    if out and args.out == "bench-suite":
        check_output_dir(out, "the default --out")
        if "out" not in getattr(args, "given", ()):  # held while the run goes, as a typed one (snlp.apps.cli)
            getattr(args, "hold_output", lambda *a: None)(str(out), "--out")


def result_files(args) -> list[Path]:
    """Every file this `snlp bench` run writes: the ones it rewrites after every part (partial_files), else its --json
    and --csv (once, at the end) and, for the random-weights prediction (--suite decode --shapes), --out's
    prediction.json and prediction.md."""
    if files := partial_files(args):
        return files
    files = [Path(p) for p in (args.json, args.csv) if p]
    if getattr(args, "suite", None) == "decode" and args.shapes and args.out != "bench-suite":
        files += [Path(args.out) / "prediction.json", Path(args.out) / "prediction.md"]
    return files


def stamp(path: Path) -> tuple | None:
    """What tells a file this run wrote from one an earlier run left at its path: its inode, mtime and size
    (write_atomic renames a new file over the old one, so a new inode) where it exists, else None. Not its mtime
    against the run's start: a file server whose clock is ahead of this host's dates an earlier run's file after
    this run started, and the run would end with status 0 having written nothing."""
    try:
        s = Path(path).stat()
    except OSError:
        return None
    return s.st_dev, s.st_ino, s.st_mtime_ns, s.st_size


def stamp_outputs(args) -> None:
    """Record the files at every path this run may write before it writes any (`written` compares against them)."""
    paths = [*result_files(args), *partial_files(args), *(Path(p) for p in (args.json, args.csv) if p)]
    args.before = {p: stamp(p) for p in paths}


def written(args, paths) -> list[Path]:
    """The `paths` this run wrote: changed since stamp_outputs (a file of an earlier run there is not its own)."""
    before = getattr(args, "before", None)
    if before is None:  # stopped before stamp_outputs: nothing of this run's written
        return []
    return [p for p in map(Path, paths) if p.is_file() and stamp(p) != before.get(p)]


def finished(args) -> str | None:
    """Where a signal came after every file of the run was written complete (its tables' print, the locks'
    release): what holds the results, so that snlp.apps.cli ends with status 0 (not 128 + signum: a requeue script
    would run the whole benchmark again); else None."""
    from snlp.bench.records import marked_partial
    from snlp.runtime.outputs import complete_in

    files = result_files(args)
    kept = written(args, files)
    if not files or len(kept) < len(files) or any(marked_partial(p) for p in kept):
        return None
    if getattr(args, "vs_paper", None) and json.loads(kept[0].read_text()).get("failures"):
        return None  # the run's own status is 1 (a callable failed), which 0 would hide
    return complete_in(kept)


def interrupt_hint(args) -> str:
    """What `snlp bench` says after Ctrl-C (snlp.apps.cli): which files keep the parts that had finished (a run
    whose files were all complete ends through `finished`)."""
    kept = written(args, partial_files(args))
    if kept:
        return (f"kept the parts that had finished in {' and '.join(map(str, kept))}, marked partial "
                f"(\"complete\": false)")
    if partial_files(args):
        return "no part had finished: nothing written"
    if done := written(args, (p for p in (args.json, args.csv) if p)):  # written once, at the end
        return f"the run had finished writing {' and '.join(map(str, done))} only"
    if args.json or args.csv or (args.suite == "decode" and args.out != "bench-suite"):
        return "this run writes its records once every round has run: nothing written"
    return ""


def run(args) -> int:
    import torch

    from snlp.apps.common import check_plans_fit, check_plans_grammar, warn_causal_idle
    from snlp.bench.forward import benchmark, build_model, spec_config
    from snlp.bench.records import write_records
    from snlp.method.plan import parse_plans
    from snlp.runtime.device import cli_device, cli_dtype, device_label, set_threads
    from snlp.runtime.load import Timed

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")  # the flag's default
    stamp_outputs(args)  # interrupt_hint and finished name only the files this run wrote
    if getattr(args, "vs_paper", None):
        if getattr(args, "suite", None):
            raise ValueError("--vs-paper and --suite are two runs: give one")
        return run_vs_paper_cli(args)
    if getattr(args, "suite", None) == "train":
        unread_flags(args, "suite train")
        return run_train_suite_cli(args)
    if getattr(args, "suite", None):
        return run_suite_cli(args)
    if getattr(args, "simulate_devices", None) is not None:
        from snlp.apps.common import parser_defaults
        from snlp.apps.dist import run_simulate

        # this module's flag tables go with the call: snlp.apps.dist importing them back would close an import cycle
        return run_simulate(args, unread_flags, SHAPE, parser_defaults(add_arguments))
    if getattr(args, "distributed", False):
        from snlp.apps.dist import run_bench

        return run_bench(args, model_spec(args), unread_flags)
    if not args.decode and (args.batch_sizes or args.share_weights or args.min_confidence or args.adaptive_block):
        raise ValueError("--batch-sizes, --share-weights, --min-confidence and --adaptive-block shape the decode "
                         "benchmark: use them with --decode")
    if args.ops and args.decode:
        raise ValueError("--ops times single-layer ops and --decode cached decoding: two runs, give one")
    unread_flags(args, "ops" if args.ops else "decode" if args.decode else "forward")
    counts = args.tokens if isinstance(args.tokens, tuple) else (args.tokens,)
    if args.ops:
        return run_ops(args, counts)
    if len(counts) != 1:
        raise ValueError(f"--tokens takes one value (a comma list only with --ops), got {','.join(map(str, counts))}")
    args.tokens = counts[0]
    if args.tokens < 1 or args.batch < 1 or args.runs < 1 or args.warmup < 0:
        raise ValueError("--tokens, --batch and --runs must be >= 1 and --warmup >= 0")
    written = check_plans_grammar(args.plans)  # before the model is built (checked against its depth below)
    refuse_preheat(written, args.ckpt)
    # a checkpoint's depth is in its config: before its weights load. A forward's sequences hold --tokens tokens; a
    # decode's at most --prompt-len + --new-tokens (a kept token's query sits below that position; a batch's prompts
    # are at most --prompt-len long), each >= 1 or decode_benchmark refuses them
    longest = args.tokens if not args.decode else \
        args.prompt_len + args.new_tokens if min(args.prompt_len, args.new_tokens) >= 1 else None
    check_plans_fit(args.ckpt, written, longest=longest)
    if not args.ckpt:  # random weights: the warning from the config the model will be built with
        warn_causal_idle(written, spec_config(model_spec(args)), longest)
    if args.decode and args.batch_sizes is not None:  # before the model is built: the sizes, and the plans at them
        from snlp.bench.decode import check_batch_plans

        check_batch_plans(written, batch_sizes(args), hint="--batch-sizes 1 runs it")
    if args.decode:  # the penalty every decode applies, before the model is built (a bad one refused here)
        args.repetition_penalty, args.repetition_penalty_source = bench_penalty(args)
    device = cli_device(args.device)
    set_threads(args.threads)  # --threads (decode group) applies to the teacher-forced benchmark too
    model = build_model(model_spec(args))
    plans = parse_plans(args.plans, model.config.n_layer)
    dtype = cli_dtype(args.dtype, device)
    model = model.to(device=device, dtype=getattr(torch, dtype))
    if args.decode:
        return run_decode(args, model, plans, device, dtype)
    with Timed([torch.get_num_threads()], device) as load:
        rows = benchmark(model, plans, tokens=args.tokens, batch=args.batch, warmup=args.warmup, runs=args.runs,
                         compile=args.compile, seed=args.seed)
    cfg = model.config
    print_table(rows, f"L={cfg.n_layer} D={cfg.n_embd} heads={cfg.n_head} T={args.tokens} B={args.batch} "
                      f"{dtype} on {device_label(device)}, median of {args.runs} runs")
    load.say()
    write_records(rows, args.json, args.csv, load=load.to_json())
    return 0


def refuse_preheat(plans, ckpt) -> None:
    """The forward and decode benchmarks and the decode suite bind `plans` (Plans) without a calibration: a -preheat-
    plan is refused here, before any model is built (the solve refused it after the load, asking for the `snlp
    calibrate` a checkpoint may already have had)."""
    preheat = [str(p) for p in plans if p.init == "preheat"]
    if preheat:
        raise ValueError(f"{', '.join(preheat)}: snlp bench times plans without a preheat calibration (it reads no "
                         f"preheat.pt{', ' + str(ckpt) + '/preheat.pt included' if ckpt else ''}): give these plans "
                         f"the h0 or fwd init")


def print_table(rows: list[ForwardRow], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from snlp.bench.stats import tie_footnote, tie_mark

    r0 = rows[0]
    title += (f"\nfixed (embed + head) {r0.fixed_ms:.3f} ms, per layer {r0.layer_ms:.3f} ms; "
              f"ideal (layers) = L / steps, ideal (struct.) = t_seq / (fixed + steps * t_layer)")
    if r0.compiled:
        title += f"; compile time {sum(r.compile_s for r in rows) + r0.fixed_compile_s:.1f} s (not timed)"
    table = Table(title=title)
    for col in ("plan", "S", "iters", "median ms", "speedup", "ideal (layers)", "ideal (struct.)", "of struct.",
                "min ms", "max ms"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for r in rows:
        its = "-" if r.iters is None else str(r.iters)  # iterations run (tol may stop before K)
        table.add_row(r.plan, str(r.prefix), its, f"{r.median_ms:.3f}",
                      f"{r.speedup:.2f}x{tie_mark(r.speedup_rounds, r.speedup)}",
                      f"{r.ideal_layer_speedup:.2f}x", f"{r.structural_ideal:.2f}x",
                      f"{100 * r.of_structural:.0f}%", f"{r.min_ms:.3f}", f"{r.max_ms:.3f}")
    Console(width=160).print(table)
    if len(rows) > 1:
        print(tie_footnote(r0.runs, pairing="sequential ms / plan ms of the same round, one call of each per round"))


# a speculative row of one new token: the prefill gives it, so no round drafts anything
NO_DRAFTS = ("alpha, s and SSD ideal: not measured (--new-tokens {n}: the prefill gives the first token and nothing "
             "was drafted; a draft needs --new-tokens 2 or more)")


def print_decode_table(rows: list[DecodeRow], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from snlp.bench.stats import tie_footnote, tie_mark

    table = Table(title=title)
    for col in ("mode", "plan", "B", "ms/token", "tok/s", "speedup", "alpha", "tok/round", "s", "SSD ideal", "=seq"):
        table.add_column(col, justify="left" if col in ("mode", "plan") else "right")
    f = lambda v, fmt: "-" if v is None else fmt.format(v)  # noqa: E731  (None: not this row's mode)
    for r in rows:
        table.add_row(r.mode, r.plan, f(r.block, "{}"), f(r.ms_per_token, "{:.3f}"), f(r.tokens_per_s, "{:.1f}"),
                      f(r.speedup, "{:.2f}x") + tie_mark(r.speedup_rounds, r.speedup), f(r.alpha, "{:.3f}"),
                      f(r.tokens_per_round, "{:.2f}"),
                      f(r.drafter_speedup_s, "{:.2f}") + tie_mark(r.drafter_speedup_rounds, r.drafter_speedup_s),
                      f(r.ideal_ssd_speedup, "{:.2f}x"), "yes" if r.matches_sequential else "no")
    Console(width=160).print(table)
    if any(r.mode == "speculative" and r.alpha is None for r in rows):
        print(NO_DRAFTS.format(n=rows[0].new_tokens))
    if len(rows) > 1:  # SSD ideal is a formula of alpha, B and s: no rounds of its own
        print(tie_footnote(rows[0].runs, "speedup or s", "sequential over this row's ms/token of the same run, "
                           "one run of each per round; s: their cached single-token steps"))


def batch_sizes(args) -> tuple[int, ...]:
    """--batch-sizes as integers >= 1 (ValueError otherwise)."""
    try:
        sizes = tuple(int(b) for b in args.batch_sizes.split(",") if b.strip())
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes must be integers >= 1, got {args.batch_sizes!r}")
    return sizes


def run_batch_decode(args, model: GPT, plans: list[Plan], blocks: tuple[int, ...], device, dtype: str) -> int:
    """--decode --batch-sizes: batched sequential vs batched SSD at each batch size (snlp.bench.decode)."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from snlp.bench.decode import batch_decode_benchmark
    from snlp.bench.records import write_records
    from snlp.bench.stats import tie_footnote, tie_mark
    from snlp.runtime.device import device_label
    from snlp.runtime.load import Timed

    sizes = batch_sizes(args)
    with Timed([torch.get_num_threads()], device) as load:
        rows = batch_decode_benchmark(model, plans, sizes, args.prompt_len, args.new_tokens, blocks, args.warmup,
                                      args.runs, args.seed, compile=args.compile, share_weights=args.share_weights,
                                      min_confidence=args.min_confidence, adaptive=args.adaptive_block,
                                      repetition_penalty=args.repetition_penalty)
    table = Table(title=f"batched greedy decode{' (compiled)' if args.compile else ''}"
                        f"{penalty_label(args.repetition_penalty)}: ragged prompts "
                        f"{args.prompt_len // 2 or 1}-{args.prompt_len} tokens, new={args.new_tokens}, {dtype} on "
                        f"{device_label(device)}, median of {args.runs} runs, tok/s = the batch's aggregate")
    for col in ("batch", "mode", "plan", "B", "variant", "tok/s", "vs batched seq", "alpha", "tok/round", "=seq"):
        table.add_column(col, justify="left" if col in ("mode", "plan", "variant") else "right")
    f = lambda v, fmt: "-" if v is None else fmt.format(v)  # noqa: E731
    for r in rows:
        table.add_row(str(r.batch), r.mode, r.plan, f(r.block, "{}"), r.variant or "-", f"{r.tokens_per_s:.1f}",
                      f"{r.speedup:.2f}x{tie_mark(r.speedup_rounds, r.speedup)}", f(r.alpha, "{:.3f}"),
                      f(r.tokens_per_round, "{:.2f}"), "yes" if r.matches_sequential else "no")
    Console(width=160).print(table)
    if any(r.mode == "speculative" and r.alpha is None for r in rows):
        print(NO_DRAFTS.format(n=args.new_tokens).replace(", s and SSD ideal", ""))
    if len(rows) > 1:
        print(tie_footnote(args.runs, "speedup over batched sequential", "this row's tok/s over batched sequential's in the same run, "
                           "one run of each per round at that batch size"))
    load.say()
    write_records(rows, args.json, args.csv, load=load.to_json(), extra=penalty_source(args))
    return 0


def bench_penalty(args) -> tuple[float, str]:
    """The repetition penalty `snlp bench --decode` decodes with, and its source as `snlp generate --json` records
    it (flag, generation_config or default): --repetition-penalty (checked in the flag's words), else a converted
    --ckpt's generation_config value (as `snlp generate` applies it), else 1 (none)."""
    from snlp.apps.generation_defaults import check_penalty_flag, penalty_and_source
    from snlp.io.checkpoint import checkpoint_tokenizer

    check_penalty_flag(args.repetition_penalty)
    tok = checkpoint_tokenizer(args.ckpt) if args.ckpt and args.repetition_penalty is None else None
    return penalty_and_source(args, tok)


def penalty_source(args) -> dict:
    """Every decode row's record of where its repetition_penalty came from (bench_penalty), as generate's --json."""
    return {"repetition_penalty_source": args.repetition_penalty_source}


def penalty_label(p: float) -> str:
    """The table title's words for the penalty that ran (none: nothing)."""
    return "" if p == 1.0 else f", repetition penalty {p:g} on every row"


def run_decode(args, model: GPT, plans: list[Plan], device: torch.device, dtype: str) -> int:
    import torch

    from snlp.bench.decode import decode_benchmark
    from snlp.bench.records import write_records
    from snlp.method.sharing import check_shareable
    from snlp.runtime.device import device_label, set_threads
    from snlp.runtime.load import Timed

    set_threads(args.threads)
    try:
        blocks = tuple(int(b) for b in args.blocks.split(",") if b.strip())
    except ValueError:
        raise ValueError(f"--blocks must be comma-separated integers, got {args.blocks!r}") from None
    if not 0.0 <= args.min_confidence <= 1.0:
        raise ValueError(f"--min-confidence must lie in [0, 1], a probability (got {args.min_confidence})")
    if args.batch_sizes is not None:
        return run_batch_decode(args, model, plans, blocks, device, dtype)
    if args.share_weights:
        for plan in plans:
            check_shareable(model, plan.fuse)
    with Timed([torch.get_num_threads()], device) as load:
        rows = decode_benchmark(model, plans, args.prompt_len, args.new_tokens, blocks, args.warmup, args.runs,
                                args.seed, compile=args.compile, share_weights=args.share_weights,
                                min_confidence=args.min_confidence, adaptive=args.adaptive_block,
                                repetition_penalty=args.repetition_penalty)
    cfg = model.config
    print_decode_table(rows, f"cached greedy decode{' (compiled)' if args.compile else ''}"
                             f"{penalty_label(args.repetition_penalty)}: L={cfg.n_layer} "
                             f"D={cfg.n_embd} heads={cfg.n_head} prompt={args.prompt_len} new={args.new_tokens} "
                             f"{dtype} on {device_label(device)}, median of {args.runs} runs")
    seq = rows[0]
    print(f"sequential: {seq.model_bytes / 1e6:.1f} MB of weights x {seq.tokens_per_s:.1f} tok/s = "
          f"{seq.bandwidth_gb_s:.2f} GB/s achieved"
          + (f"; compile time (not in any timing): {sum(r.compile_s for r in rows if r.mode != 'speculative'):.1f} s"
             f"; host syncs per compiled step: {max(r.host_syncs for r in rows):g}" if args.compile else ""))
    load.say()
    write_records(rows, args.json, args.csv, load=load.to_json(), extra=penalty_source(args))
    return 0


def _treatments(args, split) -> tuple:
    """--treatments of the paper suite and --vs-paper: the default when not given; empty when given empty (refused)."""
    return split(DEFAULT_TREATMENTS if args.treatments is None else args.treatments) or ()


def run_vs_paper_cli(args) -> int:
    import shlex
    import sys

    from snlp.bench.vs_paper import VsPaperConfig, run_vs_paper

    unread_flags(args, "vs-paper")  # --tokens, --runs, --compile, --plans, ... are the forward benchmark's
    split = lambda text: tuple(t.strip() for t in text.split(",") if t.strip()) if text else None  # noqa: E731
    out = None if args.out == "bench-suite" else args.out
    cfg = VsPaperConfig(paper=args.vs_paper, shapes=split(args.shapes), device=args.device, quick=args.quick,
                        tokens=args.suite_tokens, warmup=args.suite_warmup, runs=args.suite_runs,
                        treatments=_treatments(args, split), ablations=not args.no_ablations, seed=args.seed,
                        out=out or "bench-vs-paper", command=shlex.join(["snlp", *sys.argv[1:]]))
    resolved = cfg.resolved()  # bad flags fail before the paper's code is imported or any model is built
    want = "bfloat16" if resolved.device.split(":")[0] == "cuda" else "float32"
    if args.dtype is not None and args.dtype != want:  # nanochat's COMPUTE_DTYPE, which both sides then use
        raise ValueError(f"--dtype {args.dtype}: --vs-paper runs the paper's code in its own dtype on "
                         f"{resolved.device} ({want}, bf16 on CUDA and fp32 on the CPU), and snlp in the same: drop it")
    default_out_writable(args, cfg.out)
    import torch

    from snlp.bench.paper_peer import load_paper_code
    from snlp.bench.vs_paper import paper_dtype
    from snlp.runtime.load import begin_timing
    from snlp.runtime.device import set_threads

    load_paper_code(resolved.paper, paper_dtype(resolved.device))  # a path that is not the paper's code: one line
    set_threads(args.threads)  # the remedy the oversubscription line names: --threads 1 must time with one
    # the run records its own window (its meta's load) and its markdown says a contended one
    begin_timing([torch.get_num_threads()], resolved.device)
    result = run_vs_paper(cfg)
    print(result.markdown)
    print(f"wrote {cfg.out}/vs_paper.json and {cfg.out}/vs_paper.md")
    return 1 if result.failures else 0


def run_train_suite_cli(args) -> int:
    """--suite train: snlp.bench.train.run_train_bench from the flags."""
    import shlex
    import sys

    from snlp.bench.train import TrainBenchConfig, run_train_bench

    split = lambda text: tuple(t.strip() for t in text.split(",") if t.strip()) if text else ()  # noqa: E731
    shapes = split(args.shapes) or ("0.5B",)
    if len(shapes) != 1:
        raise ValueError(f"--suite train runs one shape, got --shapes {args.shapes}")
    cfg = TrainBenchConfig(shape=shapes[0], quick=args.quick, device=args.device, batch_size=args.train_batch,
                           seq_len=args.train_seq_len, steps=args.train_steps, warmup=args.train_warmup,
                           treatments=_treatments(args, split), regs=split(args.regs), reg_n=args.reg_n,
                           optimizer=args.optimizer, threads=args.threads, seed=args.seed, out=args.out,
                           command=shlex.join(["snlp", *sys.argv[1:]]))
    default_out_writable(args, cfg.out)
    import torch

    from snlp.runtime.load import begin_timing

    resolved = cfg.resolved()  # the run records its own window (its meta's load) and its markdown says a contended one
    begin_timing([resolved.threads or torch.get_num_threads()], resolved.device)
    result = run_train_bench(cfg)
    print(result.markdown)
    if result.json_path:
        print(f"wrote {result.json_path} and {result.markdown_path}")
    return 0


def run_suite_cli(args) -> int:
    import shlex
    import sys

    from snlp.bench.suite import SuiteConfig, run_suite

    if args.suite == "decode":
        return run_decode_suite_cli(args, shlex.join(["snlp", *sys.argv[1:]]))
    if args.suite_plans or args.early_exit is not None or args.prompt_lookup is not None or args.no_transformers \
            or args.alpha or args.drafter:
        raise ValueError("--suite-plans, --early-exit, --prompt-lookup, --no-transformers, --alpha and --drafter "
                         "belong to --suite decode")
    unread_flags(args, "suite paper")

    split = lambda text: tuple(t.strip() for t in text.split(",") if t.strip()) if text else None  # noqa: E731
    cfg = SuiteConfig(quick=args.quick, shapes=split(args.shapes), device=args.device, dtype=args.dtype,
                      tokens=args.suite_tokens, warmup=args.suite_warmup, runs=args.suite_runs,
                      new_tokens=args.suite_new_tokens,
                      treatments=_treatments(args, split), decode=not args.no_decode, seed=args.seed,
                      threads=args.threads,
                      out=args.out, command=shlex.join(["snlp", *sys.argv[1:]]))
    default_out_writable(args, cfg.out)
    import torch

    from snlp.runtime.load import begin_timing

    # the suite records its own window (its meta's loadavg and cores) and prints its contention note
    resolved = cfg.resolved()
    begin_timing([resolved.threads or torch.get_num_threads()], resolved.device)
    result = run_suite(cfg)
    print(result.markdown)
    print(f"wrote {result.json_path} and {result.markdown_path}")
    return 0


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        vals = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{flag} must be integers >= 1, got {text!r}")
    return vals


def run_decode_suite_cli(args, command: str) -> int:
    """--suite decode: the decode suite on one model, or (--shapes) the random-weights prediction at paper shapes."""
    from snlp.apps.common import check_plans_fit
    from snlp.bench.decode_suite import DecodeSuiteConfig, markdown, progress_line, run_decode_suite, suite_source
    from snlp.bench.ssd_prediction import paper_shape_prediction, prediction_markdown
    from snlp.bench.records import write_csv, write_json
    from snlp.method.plan import Plan, parse_plans
    from snlp.runtime.device import write_atomic

    refused = [flag for flag, used in (
        ("--suite-tokens", args.suite_tokens is not None), ("--no-ablations", args.no_ablations),
        ("--no-decode", args.no_decode), ("--decode", args.decode), ("--ops", args.ops),
        ("--share-weights", args.share_weights), ("--min-confidence", bool(args.min_confidence)),
        ("--adaptive-block", args.adaptive_block), ("--distributed", args.distributed),
        ("--simulate-devices", args.simulate_devices is not None),
        ("--plans", args.plans != DEFAULT_PLANS)) if used]
    if refused:
        raise ValueError(f"--suite decode does not take {', '.join(refused)} (plans: --suite-plans)")
    unread_flags(args, "suite decode")  # --runs, --new-tokens, --depth, ...: the forward and decode benchmarks' flags
    out = None if args.out == "bench-suite" else Path(args.out)  # --out DIR: JSON + markdown there
    split = lambda text: tuple(t.strip() for t in text.split(",") if t.strip()) if text else None  # noqa: E731
    if args.treatments and args.compile:
        raise ValueError("--suite decode: give the treatments once, --treatments or --compile (= eager,compiled)")
    treatments = split(args.treatments) if args.treatments else ("eager", "compiled") if args.compile else None
    blocks = _ints(args.blocks, "--blocks")
    # read as --plans is (parse_plans): a K past the plan's exact count is capped to it with a warning (it changes
    # no token and only costs time), a plan named twice is refused; the depth is checked once the model is known
    parsed = None if args.suite_plans is None else parse_plans(args.suite_plans, flag="--suite-plans")
    refuse_preheat(parsed or (), args.ckpt)
    plans = None if parsed is None else tuple(str(p) for p in parsed)
    if args.shapes:
        if args.ckpt or args.drafter:
            raise ValueError("--suite decode --shapes times random weights at the paper's shapes; drop --ckpt and "
                             "--drafter (or drop --shapes to decode the checkpoint)")
        unused = [flag for flag, used in (
            ("--batch-sizes", args.batch_sizes is not None), ("--suite-new-tokens", args.suite_new_tokens is not None),
            ("--suite-methods", args.suite_methods is not None), ("--suite-prompts", args.suite_prompts is not None),
            ("--prompts-file", args.prompts_file is not None),
            ("--early-exit", args.early_exit is not None), ("--prompt-lookup", args.prompt_lookup is not None),
            ("--no-transformers", args.no_transformers),
            ("--repetition-penalty", args.repetition_penalty is not None)) if used]
        if unused:
            raise ValueError(f"--suite decode --shapes times single steps at batch 1 (no decoding, no transformers): "
                             f"it does not take {', '.join(unused)}")
        try:
            alphas = tuple(float(a) for a in split(args.alpha or "0.6,0.8"))
        except ValueError:
            raise ValueError(f"--alpha must be comma-separated numbers in [0, 1], got {args.alpha!r}") from None
        from snlp.apps.common import warn_causal_idle
        from snlp.bench.ssd_prediction import SHAPE_KEYS, shape_config

        unknown = [s for s in split(args.shapes) if s not in SHAPE_KEYS]
        if unknown:  # before any shape is timed: a later unknown one ended the run after the earlier ones' timings
            raise ValueError(f"unknown --shapes {','.join(unknown)}: valid shapes are {', '.join(SHAPE_KEYS)}")
        for shape in split(args.shapes) if plans else ():
            config = shape_config(shape, args.quick)[0]  # before any shape's model is built and timed
            checked = [Plan.parse(p, config.n_layer).check_model(config) for p in plans]
            # a drafter step decodes one token after a prompt of --prompt-len: its sequences hold prompt_len + 1
            warn_causal_idle(checked, config, args.prompt_len + 1)
        rows = []
        for shape in split(args.shapes):
            rows += paper_shape_prediction(shape, alphas, plans, blocks, args.quick, args.device, args.dtype,
                                           treatments, args.suite_warmup, args.suite_runs, args.seed, args.threads,
                                           args.prompt_len)
        text = prediction_markdown(rows, args.quick)
        for path in [args.json] + ([out / "prediction.json"] if out else []):
            if path:
                write_json(path, {"command": command, "rows": rows})
        if out:
            write_atomic(out / "prediction.md", text + "\n")
        if args.csv:
            write_csv(args.csv, rows)
        print(text)
        return 0
    if args.alpha:
        raise ValueError("--alpha prices the random-weights prediction: use it with --shapes")
    from snlp.apps.generation_defaults import check_penalty_flag

    check_penalty_flag(args.repetition_penalty)  # in the flag's words (the suite's own check names its field)
    methods = None if args.suite_methods is None else split(args.suite_methods) or ()
    hf_only = [f for f, used in (("--early-exit", args.early_exit is not None),
                                 ("--prompt-lookup", args.prompt_lookup is not None)) if used]
    if args.no_transformers and hf_only:  # they set transformers' assisted rows, which --no-transformers drops
        raise ValueError(f"{' and '.join(hf_only)} set{'s' if len(hf_only) == 1 else ''} transformers' assisted rows "
                         f"and --no-transformers drops them: drop one or the other")
    if methods is not None and "speculative" not in methods and args.blocks != DEFAULT_BLOCKS:
        # the draft block sizes only shape speculative rows: without them the table would not show them anywhere
        raise ValueError(f"--blocks sizes the speculative rows' drafts and --suite-methods {args.suite_methods} runs "
                         f"none: add speculative to the methods or drop --blocks")
    cfg = DecodeSuiteConfig(ckpt=args.ckpt, quick=args.quick, device=args.device, dtype=args.dtype,
                            batch_sizes=_ints(args.batch_sizes, "--batch-sizes"), prompts=args.suite_prompts,
                            prompts_file=args.prompts_file, prompt_len=args.prompt_len,
                            new_tokens=args.suite_new_tokens, plans=plans, blocks=blocks, drafter=args.drafter,
                            early_exit=args.early_exit,
                            prompt_lookup=args.prompt_lookup, treatments=treatments, warmup=args.suite_warmup,
                            rounds=args.suite_runs, transformers=not args.no_transformers, methods=methods,
                            threads=args.threads, seed=args.seed, command=command,
                            repetition_penalty=args.repetition_penalty)
    paths = [p for p in (args.json, out and out / "decode.json") if p]

    def progress(result, what: str) -> None:  # a run cut short keeps every round it finished
        progress_line(result, what)
        for path in paths:
            write_json(path, result.to_dict(), announce=False)
        if out:  # atomically too: a kill between rounds never leaves half a table
            write_atomic(out / "decode.md", markdown(result) + "\n")
        if args.csv:  # its first line says it is partial (snlp.runtime.outputs.partial_comment)
            write_csv(args.csv, result.rows, announce=False, partial=what)

    import torch

    from snlp.runtime.load import begin_timing

    resolved = cfg.resolved()  # the suite records its own window (its meta's load) and its markdown says a contended one
    # --suite-plans against the model's config (a transformers folder's, a GGUF header's too), before its weights load;
    # every prompt is cut to the prompt length, so a sequence holds at most prompt_len + new_tokens tokens: a -causal
    # plan whose windows all span that many is warned about, as `snlp bench --decode` does
    check_plans_fit(suite_source(args.ckpt), plans or (), transformers_ok=True,
                    longest=resolved.prompt_len + resolved.new_tokens)
    begin_timing([resolved.threads or torch.get_num_threads()], resolved.device)
    result = run_decode_suite(cfg, progress=progress)
    text = markdown(result)
    for path in paths:
        write_json(path, result.to_dict())
    if out:
        write_atomic(out / "decode.md", text + "\n")
    if args.csv:
        write_csv(args.csv, result.rows)
    print(text)
    return 0


def print_ops_table(rows: list[OpRow], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from snlp.bench.stats import tie_footnote, tie_mark

    table = Table(title=title)
    for col in ("T", "Forward (ms)", "FD (ms)", "JVP (ms)", "VJP (ms)", "FD extra (ms)"):
        table.add_column(col, justify="right")
    cell = lambda r, op: f"{r.ms(op):.3f} ({r.ratio(op):.2f}x{tie_mark(r.ratio_rounds(op), r.ratio(op))})"  # noqa: E731
    for r in rows:
        table.add_row(str(r.tokens), f"{r.forward_ms:.3f}", cell(r, "fd"), cell(r, "jvp"), cell(r, "vjp"),
                      cell(r, "fd_extra"))
    Console(width=140).print(table)
    print(tie_footnote(rows[0].runs, "ratio to forward", "op ms / forward ms of the same round, one call of each per "
                       "round"))


def run_ops(args, counts: tuple[int, ...]) -> int:
    import torch

    from snlp.bench.forward import build_model
    from snlp.bench.ops import op_benchmark
    from snlp.bench.records import write_records
    from snlp.runtime.device import cli_device, cli_dtype, device_label, set_threads
    from snlp.runtime.load import Timed

    if args.runs < 1 or args.warmup < 0:
        raise ValueError("--runs must be >= 1 and --warmup >= 0")
    set_threads(args.threads)  # --threads (decode group) applies here too
    device = cli_device(args.device)
    dtype = cli_dtype(args.dtype, device)
    model = build_model(model_spec(args)).to(device=device, dtype=getattr(torch, dtype))
    with Timed([torch.get_num_threads()], device) as load:
        rows = op_benchmark(model, counts, args.layer, args.warmup, args.runs, args.seed)
    cfg = model.config
    print_ops_table(rows, f"single-layer ops: layer {rows[0].layer} of L={cfg.n_layer} D={cfg.n_embd} "
                          f"heads={cfg.n_head} B=1 {dtype} on {device_label(device)}, median of {args.runs} runs")
    load.say()
    write_records(rows, args.json, args.csv, load=load.to_json())
    return 0

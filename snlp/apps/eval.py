"""Evaluate a checkpoint: the sequential model and SNLP plans on its validation split (paper metrics).

One row per plan, the sequential baseline first: PPL / dPPL over non-overlapping --seq-len windows,
Top-1 and LogitSim vs the sequential logits, AR Match over --gen-tokens greedy tokens vs the sequential
model (a fused plan's agreement with its fused model run sequentially is its own column, AR Match vs fused)
with the implied per-token agreement beta, EmbSim (MiniLM sentence
embeddings, `pip install snlp[emb]`), the decode / prefill speedup measured round-robin in this
process, and the ideal layer-step speedup L / (S + K + [fwd]). The protocol is
snlp.eval.protocol.evaluate (see its docstring); this module only parses flags and presents the records.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from snlp.apps import eval_harness
from snlp.eval.config import EvalConfig
from snlp.runtime.outputs import complete_in

if TYPE_CHECKING:  # the library (and torch) loads in run(), after the flags are parsed: --help answers at once
    from snlp.eval.mc import MCConfig
    from snlp.model.gpt import GPT

SUMMARY = "Evaluate the sequential model and SNLP plans of a checkpoint (paper metrics)."
DESCRIPTION = """\
One row per plan, the sequential model first, on the checkpoint's validation split: PPL and dPPL, Top-1 and LogitSim
vs the sequential logits, AR Match over greedy tokens vs the sequential model, EmbSim, the measured decode and prefill
speedups and the ideal one. --task scores multiple-choice questions instead, --harness runs lm-evaluation-harness
tasks, --drafter measures an adapted drafter.

  snlp eval runs/y --plans 4xF1-h0-K1,4xF1-h0-K2 --json e.json --markdown e.md --plot e.png
  snlp eval runs/sft --task mc:ARC-Easy-Test.jsonl --plans 8xF1-h0-K1
  snlp eval runs/smol --drafter runs/smol-d8 --chat-prompts chat:dolly_open_qa.jsonl
"""
GUIDE = "docs/usage.md#evaluate"
LOCK_OUTPUTS = True  # a second run writing one of its output paths is refused (snlp.apps.cli.output_locks)


OUTPUT_DIRS = ("harness_out",)  # checked with --json/--csv/... before any work (snlp.apps.cli)

# The flags each mode of `snlp eval` reads, besides the checkpoint, --plans, --device, --dtype, --threads, --batch,
# --json, --markdown and --no-progress (read by every mode) and the mode switches themselves (--drafter, --task,
# --harness, whose conflicts are refused where they are read). A flag a mode does not read is refused (mode_flags),
# never ignored: `--num-fewshot 5` without --harness, or `--runs 50` with it, changed nothing.
DATA_FLAGS = ("data", "text_field", "max_chars", "val_frac", "cache_dir", "data_encoding")
READS = {
    "lm": (*DATA_FLAGS, "seq_len", "max_tokens", "prompts", "prompt_len", "gen_tokens", "warmup", "runs",
           "time_tokens", "no_emb", "seed", "csv", "plot"),
    "drafter": (*DATA_FLAGS, "seq_len", "max_tokens", "prompts", "gen_tokens", "warmup", "runs", "blocks",
                "chat_prompts"),
    "task": ("mc_scoring", "mc_shots", "mc_shots_from", "mc_limit"),
    "harness": ("harness_include", "num_fewshot", "limit", "fewshot_seed", "apply_chat_template", "harness_decode",
                "harness_block", "harness_ignore_generation_config", "bootstrap_iters", "harness_out", "force"),
}
# the flags of --drafter that set its SSD rows, which decode the --chat-prompts only (snlp.eval.drafter)
SSD_FLAGS = ("prompts", "gen_tokens", "warmup", "runs", "blocks")
MODES = {"lm": "the LM metrics", "drafter": "--drafter", "task": "--task", "harness": "--harness"}
RUN_AS = {"lm": "without --drafter, --task or --harness", "drafter": "with --drafter", "task": "with --task",
          "harness": "with --harness"}


# ----- CLI -----
def add_arguments(p) -> None:
    p.add_argument("ckpt", help="checkpoint directory (snlp train --out / snlp.save_checkpoint)")
    p.add_argument("--plans", default=None, help="comma-separated SNLP plans, e.g. 4xF1-h0-K1,3xF2-fwd-K2 (required "
                   "unless --drafter: then default the drafter's plan)")
    a = p.add_argument_group("adapted drafter (snlp adapt): its SNLP forward vs the checkpoint run sequentially")
    a.add_argument("--drafter", default=None, help="drafter directory: rows for the post-hoc and the adapted drafter "
                   "(SNLP-decoding PPL; Top-1, LogitSim, SSD Top-1 vs the model; SSD alpha, tokens per round, tok/s) "
                   "on its held-out adaptation data (--data may name some of its parts; another --val-frac or "
                   "--max-chars is refused)")
    a.add_argument("--chat-prompts", default=None, help="--drafter: the drafter's adaptation data or one of its "
                   "chat parts (chat:PATH.jsonl or PATH.jsonl); the openings (through the first user turn, in the chat "
                   "template) of its held-out conversations are the SSD prompts")
    a.add_argument("--blocks", default="2,4,8", help="--drafter: SSD draft block sizes B")
    d = p.add_argument_group("validation data (default: the checkpoint's training source and split)")
    d.add_argument("--data", default=None, help="data spec as for `snlp train --data`; default the one the "
                   "checkpoint was trained on, else stdlib")
    d.add_argument("--text-field", default=None, help="text field of .jsonl/.parquet/hf rows")
    d.add_argument("--max-chars", type=int, default=None, help="as for snlp train")
    d.add_argument("--val-frac", type=float, default=None, help="validation fraction (default: training's, 0.05)")
    d.add_argument("--cache-dir", default=None, help="token cache folder (default: training's / $SNLP_CACHE)")
    d.add_argument("--data-encoding", default=None, help="text encoding of local data files (default: training's, "
                   "utf-8)")
    e = p.add_argument_group("protocol")
    e.add_argument("--seq-len", type=int, default=None, help="PPL window (default min(256, model sequence_len))")
    e.add_argument("--max-tokens", type=int, default=EvalConfig.max_tokens, help="PPL tokens at most, in whole "
                   "--seq-len windows, but at least one window (below --seq-len: --seq-len tokens)")
    e.add_argument("--batch", type=int, default=EvalConfig.batch, help="windows per forward")
    e.add_argument("--prompts", type=int, default=EvalConfig.prompts, help="AR-match prompts")
    e.add_argument("--prompt-len", type=int, default=EvalConfig.prompt_len)
    e.add_argument("--gen-tokens", type=int, default=EvalConfig.gen_tokens, help="greedy tokens per prompt")
    e.add_argument("--warmup", type=int, default=EvalConfig.warmup, help="timing warm-up rounds")
    e.add_argument("--runs", type=int, default=EvalConfig.runs, help="timed rounds")
    e.add_argument("--time-tokens", type=int, default=EvalConfig.time_tokens,
                   help="tokens decoded per timed run (prefill not timed)")
    e.add_argument("--no-emb", action="store_true", help="skip EmbSim (sentence embeddings)")
    e.add_argument("--seed", type=int, default=EvalConfig.seed, help="prompt sampling seed")
    e.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    e.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    e.add_argument("--threads", type=int, default=None, help="torch CPU threads (tiny models: 1 is often fastest)")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    t = p.add_argument_group("multiple-choice task (snlp.eval.mc): accuracy instead of the LM metrics")
    t.add_argument("--task", default=None, help="mc:PATH[,PATH...] (ARC .jsonl, MMLU .csv, {question, choices, "
                   "answer} .jsonl; folders allowed) | arc-easy | arc-challenge | mmlu[:SUBJECT,...] (the last three "
                   "via the datasets library, online)")
    t.add_argument("--mc-scoring", choices=["letter", "loglik", "harness"], default=None, help="letter: answer-letter "
                   "logits after the lettered question (nanochat); loglik: mean log-prob of each choice's text as a "
                   "chat reply; harness: lm-evaluation-harness's protocol (acc and acc_norm). Default: letter for "
                   "checkpoints fine-tuned by snlp sft, else harness")
    t.add_argument("--mc-shots", type=int, default=0, help="harness scoring: solved examples before each question")
    t.add_argument("--mc-shots-from", default=None, help="harness k-shot: task spec the shots are drawn from "
                   "(the train/dev split, e.g. mc:ARC-Easy-Train.jsonl)")
    t.add_argument("--mc-limit", type=int, default=0, help="first N questions only (0 = all)")
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, help="write the records to this JSON file")
    o.add_argument("--csv", default=None, help="write the records to this CSV file (while the run goes: under a "
                   "'# PARTIAL' line, pandas.read_csv(comment='#'))")
    o.add_argument("--markdown", default=None, help="write the table to this markdown file")
    o.add_argument("--plot", default=None, help="write the speed-quality frontier to this PNG")
    eval_harness.add_arguments(p)  # --harness TASKS ... (snlp.apps.eval_harness)


def seq_len(args, model: GPT) -> int:
    """--seq-len, by default min(256, the model's sequence_len) (an explicit 0 is refused, not read as the default)."""
    return min(256, model.config.sequence_len) if args.seq_len is None else args.seq_len


def config_from_args(args, model: GPT) -> EvalConfig:
    """EvalConfig from the CLI flags (--seq-len: `seq_len`)."""
    return EvalConfig(seq_len=seq_len(args, model), max_tokens=args.max_tokens,
                      prompts=args.prompts, prompt_len=args.prompt_len, gen_tokens=args.gen_tokens,
                      warmup=args.warmup, runs=args.runs, time_tokens=args.time_tokens, emb=not args.no_emb,
                      seed=args.seed, progress=not args.no_progress, batch=args.batch)


def mode_flags(args) -> None:
    """Refuse flags the chosen mode does not read (READS), given with a value other than their default, in one
    line naming them and the mode(s) that do read them."""
    from snlp.apps.common import flag, parser_defaults

    defaults = parser_defaults(add_arguments, [args.ckpt])
    mode = "harness" if args.harness else "drafter" if args.drafter else "task" if args.task else "lm"
    stray = [d for d in dict.fromkeys(d for ds in READS.values() for d in ds)
             if d not in READS[mode] and getattr(args, d) != defaults[d]]
    if stray:
        one = len(stray) == 1
        where = ", ".join(f"{'it' if one else flag(d)} is for {' or '.join(MODES[m] for m in READS if d in READS[m])}"
                          for d in stray)
        raise ValueError(f"{', '.join(flag(d) for d in stray)} {'is' if one else 'are'} not read {RUN_AS[mode]} "
                         f"({where}): {'it' if one else 'they'} would change nothing; drop {'it' if one else 'them'}")
    if mode == "drafter":
        ssd = [d for d in SSD_FLAGS if getattr(args, d) != defaults[d]]
        if ssd and not args.chat_prompts:  # without prompts the drafter rows have no SSD columns
            raise ValueError(f"{', '.join(flag(d) for d in ssd)} {'sets' if len(ssd) == 1 else 'set'} the SSD "
                             f"decoding of --drafter's chat prompts; without --chat-prompts no prompt is decoded: "
                             f"give --chat-prompts or drop {'it' if len(ssd) == 1 else 'them'}")
        drafter_blocks(args.blocks)
        if args.chat_prompts and args.prompts < 1:  # no prompt drawn: the SSD rows were dropped, nothing said
            raise ValueError(f"--prompts must be >= 1 with --chat-prompts (got {args.prompts}): it is how many chat "
                             f"prompts the SSD rows decode; drop --chat-prompts for the quality rows alone")
    if args.max_chars is not None and args.max_chars < 0:  # a negative cap stopped after the first document: the
        # split then said "the data source has only one document"
        raise ValueError(f"--max-chars must be >= 0 (0: all; got {args.max_chars})")
    if args.val_frac is not None:  # refused by the split too, after the model loaded
        from snlp.io.data import check_val_frac

        check_val_frac(args.val_frac)
    if args.seq_len is not None and args.seq_len < 1:  # 0 read as "the default" (an `or`), a negative one late
        raise ValueError(f"--seq-len must be >= 1 (got {args.seq_len}; leave it out for min(256, the model's "
                         f"sequence_len))")
    if mode == "harness":
        if args.harness_block != defaults["harness_block"] and args.harness_decode != "speculative" \
                and not args.drafter:
            raise ValueError("--harness-block is the draft block of speculative decoding: use it with "
                             "--harness-decode speculative or --drafter")
        if args.harness_decode is not None and not args.plans:
            raise ValueError("--harness-decode chooses how --plans decode generate_until tasks; without --plans "
                             "there is no plan to decode (the sequential model decodes as itself)")


def check_drafter_outputs(args) -> None:
    """Refuse a --json / --markdown that is a file of the data the drafter records (its adaptation --data, a
    --from-model drafter's tuned split), in one line before the model loads (check_recorded_data)."""
    from snlp.io.drafter import load_record

    record = load_record(args.drafter)
    specs = [(record.get("config") or {}).get("data"), (((record.get("tuned") or {}).get("split")) or {}).get("data")]
    check_recorded_data(args, specs, f"drafter {args.drafter} records")


def reads_checkpoint_data(args) -> bool:
    """Whether this run reads the checkpoint's recorded training data (its train_state.pt), which no flag names: the
    LM metrics without --data, and --drafter without --data for a drafter that records no split of its own
    (run_drafter_eval then falls back to the checkpoint's)."""
    from snlp.eval.drafter import records_split
    from snlp.io.drafter import load_record

    if args.task or args.data:
        return False
    return not args.drafter or not records_split(load_record(args.drafter))


def check_recorded_data(args, specs, whose: str) -> None:
    """Refuse an output file (--json, --csv, --markdown, --plot) that is a file of `specs`, data a checkpoint or a
    drafter records and eval reads without a flag naming it, in one line before the model loads: snlp.apps.cli's
    check_outputs compares the outputs with the flags' inputs only, so the table was written over the user's
    training text or chat set. A folder part holds every file under it."""
    import snlp.io.data as D
    from snlp.apps.cli import input_paths
    from snlp.io.source import home_path

    outs = {home_path(v).resolve(): "--" + f for f in ("json", "csv", "markdown", "plot")
            if isinstance(v := getattr(args, f, None), str) and v}
    if not outs:
        return
    for spec in filter(None, specs):
        for part in D.parts(spec):
            for src in input_paths(part, spec=True):
                for out, flag in outs.items():
                    if out == src or (src.is_dir() and src in out.parents):
                        raise ValueError(f"{flag} {out} is a file of the data {whose} ({part}), which eval reads: "
                                         f"writing the result there would overwrite it; choose another path")


def drafter_blocks(text: str) -> tuple[int, ...]:
    """The --blocks of `snlp eval --drafter`: draft block sizes B >= 1, refused in one line before the model loads
    (`--blocks x` said "invalid literal for int()", and `--blocks 0` ran)."""
    try:
        blocks = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        blocks = ()
    if not blocks or min(blocks) < 1:
        raise ValueError(f"--blocks must be draft block sizes B >= 1, comma-separated like 2,4,8 (got {text!r})")
    return blocks


def record_ties(records) -> dict[str, set[str]]:
    """The `ties` of snlp.eval.present.markdown_table / print_table for `evaluate`'s records (the sequential row
    first): the plans whose Speedup the paired rounds do not resolve and those whose ΔPPL 95 % paired-window
    interval includes 0 (snlp.apps.report.record_ties, the speedrun report's rule, which its off-the-shelf table
    uses too). What `snlp eval` marks "(tie)"; a Python caller passes it to the tables too (docs/usage.md)."""
    from snlp.apps.report import record_ties as ties

    return ties(records)


def run(args) -> int:
    import torch

    from snlp.apps.common import check_plans_fit, check_plans_grammar, plans_preheat, say_contention, warn_causal_idle
    from snlp.runtime.load import begin_timing
    from snlp.eval.data import DATA_DEFAULTS, checkpoint_data, validation_tokens
    from snlp.eval.present import markdown_table, print_table, protocol_note, write_csv
    from snlp.eval.protocol import evaluate
    from snlp.io.checkpoint import load
    from snlp.method.plan import parse_plans
    from snlp.runtime.device import cli_device, cli_dtype, device_label, set_threads, write_atomic, write_json

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.plot:  # the figure is first drawn after the first phase: a format matplotlib lacks fails here
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = FigureCanvasBase.get_supported_filetypes()
        if Path(args.plot).suffix.lstrip(".").lower() not in kinds:
            raise ValueError(f"--plot {args.plot}: name a file ending in one of .{', .'.join(sorted(kinds))}")
    mode_flags(args)
    # before the checkpoint loads (--harness also takes a transformers directory as it is)
    check_plans_fit(args.ckpt, check_plans_grammar(args.plans), transformers_ok=bool(args.harness))
    if args.drafter:  # a missing or wrong drafter folder: one line before the checkpoint loads
        from snlp.io.drafter import read_meta

        read_meta(args.drafter)
        check_drafter_outputs(args)
    if args.harness:  # lm-evaluation-harness tasks, one run per method (snlp.apps.eval_harness)
        return eval_harness.run(args)
    device = cli_device(args.device)
    if args.data and not (args.task or args.drafter):  # a --data part naming nothing here, before the load (the
        # drafter's --data names parts of its adaptation spec, chat: ones too: its split checks them)
        from snlp.io.data import check_local_parts

        check_local_parts(args.data)
    if args.task:  # the questions and the scoring settings before the checkpoint loads
        args.mc_questions = mc_task_input(args)
    elif args.plans is None and not args.drafter:
        raise ValueError("--plans is required (e.g. --plans 4xF1-h0-K1)")
    if reads_checkpoint_data(args):  # the checkpoint's recorded data, which no flag names
        check_recorded_data(args, [checkpoint_data(args.ckpt)["data"]], f"checkpoint {args.ckpt} was trained on")
    set_threads(args.threads)
    need = ("`snlp eval --drafter` needs it" if args.drafter else "`snlp eval --task` needs it to tokenize the "
            "questions" if args.task else "`snlp eval` needs it to tokenize the validation data; save the checkpoint "
            "with its tokenizer")
    model, tok = load(args.ckpt, device="cpu", need_tokenizer=need)  # refused before the weights are read
    if args.drafter:
        return run_drafter_eval(args, model, tok, device)
    plans = parse_plans(args.plans, model.config.n_layer)
    cfg = config_from_args(args, model)
    cfg.check()
    # the longest sequence run: the teacher-forced windows, or an AR prompt with its greedy tokens
    warn_causal_idle(plans, model.config, max(cfg.seq_len, cfg.prompt_len + cfg.gen_tokens))
    dtype = cli_dtype(args.dtype, device)
    from snlp.io.weights import cast_model  # float16 refuses a weight it cannot hold
    model = cast_model(model, device, dtype, args.ckpt).eval()
    from snlp.method.jacobian import check_fd_step

    w = model.wte.weight  # a diag:fd eps the --dtype cannot take: before the questions or the validation text are read
    for p in plans:  #     (the plans' first bind refused it only after the validation text was tokenized)
        check_fd_step(p, w.dtype, w.device.type)
    preheat = plans_preheat(args.ckpt, model, plans)
    if args.task:
        args.plans_list = plans
        return run_mc_task(args, model, tok, preheat)
    data = checkpoint_data(args.ckpt, **{k: getattr(args, k) for k in DATA_DEFAULTS})
    val = validation_tokens(tok, **data)
    print(f"snlp eval: {args.ckpt}: {len(val):,} validation tokens of {data['data']} (val split {data['val_frac']})",
          file=sys.stderr)
    outputs = result_files(args)
    writer = partial_writer(args) if outputs else None
    threads = [torch.get_num_threads()]
    window = begin_timing(threads, device)  # the run's load: the timing comes last, after the metrics' phases

    def on_phase(records, done: str) -> None:
        window.sample()
        if writer is not None:
            writer(records, done)

    records = evaluate(model, val, plans, cfg, tokenizer=tok, preheat=preheat, on_phase=on_phase)
    window.close()
    c = model.config
    ties = record_ties(records)
    print_table(records, f"{args.ckpt}: L={c.n_layer} D={c.n_embd} | PPL on {records[0].tokens:,} tokens at "
                         f"T={cfg.seq_len} | AR: {cfg.prompts} prompts x {cfg.gen_tokens} tokens | {dtype} on "
                         f"{device_label(device)}, median of {cfg.runs} runs", ties=ties)
    print(protocol_note(records))
    say_contention(window, threads, device)
    finished: list[str] = []

    def done(path: str) -> None:  # a Ctrl-C from here on names the finished files as such, the others as partial
        finished.append(path)
        rest = [p for p in outputs if p not in finished]
        args.kept = f"the finished results in {' and '.join(finished)}" + (
            f" ({' and '.join(rest)} still marked partial)" if rest else "")
        if not rest:
            args.finished = complete_in(finished)

    load = {"load": window.to_json()}  # in every row: the file is a list of records
    if args.json:
        write_json(args.json, [{**r.to_dict(), **load} for r in records])
        done(args.json)
    if args.csv:
        write_csv([{**r.to_dict(), **load} for r in records], args.csv)
        done(args.csv)
    if args.markdown:
        write_atomic(args.markdown, markdown_table(records, ties=ties) + f"\n{protocol_note(records)}\n")
        print(f"wrote {args.markdown}")
        done(args.markdown)
    if args.plot:
        draw_plot(args, records, title="ΔPPL vs speedup")
        done(args.plot)
    return 0


def result_files(args) -> list[str]:
    """The files `snlp eval`'s LM metrics write, in the order they are written."""
    return [p for p in (args.json, args.csv, args.markdown, args.plot) if p]


def draw_plot(args, records, title: str, announce: bool = True) -> None:
    """--plot: the speed-quality frontier of the records, the front ringed and the bars drawn by the table's (tie)
    rule (plans not timed yet are listed in the legend instead of plotted)."""
    from snlp.apps.report import eval_frontier
    from snlp.eval.present import frontier_plot

    name = Path(args.ckpt).name
    frontier_plot({name: records}, args.plot, title=f"{name}: {title}", announce=announce,
                  **eval_frontier(records, name))


def partial_writer(args):
    """evaluate's on_phase for the CLI: every output file rewritten (atomically) after each phase with every row so
    far, marked partial: the JSON as {"complete": false, "done": ..., "records": [...]} (the finished file is the
    list of records, so a reader of it never takes a partial file for one), the markdown under a PARTIAL line, the
    CSV under a comment line (snlp.runtime.outputs.partial_comment), the plot with PARTIAL in its title (its plans
    listed as not timed). The speed columns come last: the timing is one round-robin over every row, so no row is
    finished before all are."""
    from snlp.runtime.outputs import partial_line
    from snlp.eval.present import markdown_table, protocol_note, write_csv
    from snlp.runtime.device import json_text, write_atomic

    def write(records, done: str) -> None:
        if args.json:
            write_atomic(args.json, json_text({"complete": False, "done": done,
                                               "records": [r.to_dict() for r in records]}, indent=2))
        if args.csv:
            write_csv([r.to_dict() for r in records], args.csv, partial=done, announce=False)
        if args.markdown:  # the kept ΔPPLs marked as the finished table marks them (the speed columns are empty)
            write_atomic(args.markdown, partial_line(f"every row's {done}; the speed columns not measured yet")
                         + "\n\n" + markdown_table(records, ties=record_ties(records))
                         + f"\n{protocol_note(records)}\n")
        def keep(paths) -> None:  # what interrupt_hint names (None: nothing of this run's written yet)
            args.kept = (f"every row's {done} in {' and '.join(paths)}, marked partial"
                         + (' ("complete": false)' if args.json else "")) if paths else None

        keep([p for p in result_files(args) if p != args.plot or getattr(args, "plotted", False)])
        if args.plot:  # last: matplotlib takes seconds, and a Ctrl-C there names the files written before it
            draw_plot(args, records, title=f"PARTIAL ({done}; not timed yet)", announce=False)
            args.plotted = True
            keep(result_files(args))

    return write


def finished(args) -> str | None:
    """Where a signal came after every file of the run was written complete (snlp.apps.cli: status 0, not 128 +
    signum, so a requeue script does not run it again): what holds the results; else None."""
    return getattr(args, "finished", None)


def interrupt_hint(args) -> str:
    """What `snlp eval` says after Ctrl-C (snlp.apps.cli): what its partial files keep, and where (the LM metrics'
    finished phases, the finished methods of --harness and --task; --drafter writes once, at the end)."""
    kept = getattr(args, "kept", None)  # set by the writers of the LM metrics (partial_writer) and of --harness
    if kept:
        return f"kept {kept}"
    if args.harness:
        return "no method had finished: nothing written"
    if not (args.json or args.markdown or getattr(args, "csv", None) or getattr(args, "plot", None)):
        return ""
    return ("nothing written (--drafter writes its files once, at the end)" if args.drafter else
            "no method had been scored: nothing written" if args.task else "no phase had finished: nothing written")


def run_drafter_eval(args, model, tok, device) -> int:
    """`snlp eval CKPT --drafter DIR`: post-hoc vs adapted drafter rows (snlp.eval.drafter), on the held-out part
    of the drafter's own adaptation split (flags that contradict it are refused)."""
    import torch

    from snlp.apps.common import say_contention
    from snlp.runtime.load import LoadWindow, begin_timing
    from snlp.eval.data import DATA_DEFAULTS, checkpoint_data, validation_tokens
    from snlp.eval.drafter import (DrafterEvalConfig, drafter_prompts, drafter_split, evaluate_drafter,
                                   held_out_tokens, markdown as drafter_markdown)
    from snlp.io.drafter import load_drafter, load_record
    from snlp.method.plan import parse_plans
    from snlp.runtime.device import cli_dtype, device_label, write_atomic, write_json

    if args.task:
        raise ValueError("--drafter evaluates the LM metrics and SSD; --task is for the checkpoint's own plans")
    dtype = cli_dtype(args.dtype, device)
    from snlp.io.weights import cast_model  # float16 refuses a weight it cannot hold
    model = cast_model(model, device, dtype, args.ckpt).eval()
    drafter = load_drafter(args.drafter, model)  # refuses another base
    plans = parse_plans(args.plans, model.config.n_layer) if args.plans else [drafter.plan]
    split = drafter_split(load_record(args.drafter), data=args.data, val_frac=args.val_frac, max_chars=args.max_chars,
                          text_field=args.text_field, cache_dir=args.cache_dir)
    if split is None:  # the drafter records no adaptation data: the checkpoint's split, as for the plans
        data = checkpoint_data(args.ckpt, **{k: getattr(args, k) for k in DATA_DEFAULTS})
        val, val_frac, source = validation_tokens(tok, **data), data["val_frac"], data["data"]
    else:
        whose = "the tuned model's split" if split.tuned is not None else "the drafter's split"
        val, val_frac, source = held_out_tokens(split, tok), split.val_frac, f"{split.data} ({whose})"
    prompts = drafter_prompts(split, args.chat_prompts, tok, val_frac, args.prompts) if args.chat_prompts else []
    cfg = DrafterEvalConfig(seq_len=seq_len(args, model), max_tokens=args.max_tokens, batch=args.batch,
                            blocks=drafter_blocks(args.blocks), gen_tokens=args.gen_tokens, repeats=args.runs, warmup=args.warmup,
                            progress=not args.no_progress)
    threads = [torch.get_num_threads()]
    # only the SSD rows' tok/s vs sequential are timed: without prompts nothing is, and no timing sentence is said
    window = begin_timing(threads, device) if prompts else LoadWindow.begin()
    rows = evaluate_drafter(model, drafter, val, prompts, plans, cfg, eos_id=list(tok.chat_stop_ids) or None)
    window.close()
    table = drafter_markdown(rows)
    print(f"{args.ckpt} with drafter {args.drafter}: {rows[0].tokens:,} held-out tokens of {source}, "
          f"{f'{len(prompts)} chat prompts x up to {cfg.gen_tokens} tokens' if prompts else 'no chat prompts (no SSD rows)'}"
          f", {dtype} on {device_label(device)}\n{table}")
    if prompts:
        say_contention(window, threads, device)
    if args.json:
        write_json(args.json, [{**r.to_dict(), "load": window.to_json()} for r in rows])
    if args.markdown:
        write_atomic(args.markdown, table + "\n")
        print(f"wrote {args.markdown}")  # as the LM metrics' --markdown and write_json's --json say theirs
    if args.json or args.markdown:
        args.finished = complete_in([p for p in (args.json, args.markdown) if p])
    return 0


def mc_config(args, plans=()) -> "MCConfig":
    """The MCConfig of `snlp eval --task` (scoring: --mc-scoring, else the checkpoint's default_scoring)."""
    from snlp.eval.mc import MCConfig
    from snlp.eval.mc_harness import default_scoring

    return MCConfig(task=args.task, plans=list(plans), scoring=args.mc_scoring or default_scoring(args.ckpt),
                    limit=args.mc_limit, batch=args.batch, shots=args.mc_shots, shot_task=args.mc_shots_from)


def mc_task_input(args) -> list:
    """`snlp eval --task`'s questions, read and checked before the checkpoint loads: a missing or malformed task file,
    a shot pool that cannot serve --mc-shots, --mc-shots without --mc-shots-from, --mc-limit -1 or --plans left out
    each fail in one line before any work (they surfaced after the model had loaded, a shot pool's only as the first
    method was scored)."""
    from snlp.eval.mc import shot_layout
    from snlp.io.mctasks import load_task

    if args.drafter:
        raise ValueError("--drafter evaluates the LM metrics and SSD; --task is for the checkpoint's own plans")
    if args.plans is None:
        raise ValueError("--plans is required (e.g. --plans 4xF1-h0-K1)")
    cfg = mc_config(args)
    cfg.check()
    questions = load_task(cfg.task)
    if cfg.limit:
        questions = questions[:cfg.limit]
    if cfg.shots:
        shot_layout(questions, load_task(cfg.shot_task), cfg.shots)
    return questions


def run_mc_task(args, model, tokenizer, preheat=None) -> int:
    """`snlp eval CKPT --task ...`: multiple-choice accuracy instead of the LM metrics."""
    from snlp.eval.mc import markdown, pct, print_table as print_mc_table
    from snlp.eval.mc_eval import evaluate_mc
    from snlp.runtime.device import json_text, write_atomic
    cfg = mc_config(args, args.plans_list)
    def write(result) -> None:  # every method scored so far, marked partial until the last (and at the end)
        if args.json:
            write_atomic(args.json, json_text(result.to_dict(), indent=2))
        if args.markdown:
            write_atomic(args.markdown, markdown(result))
        where = ' and '.join(p for p in (args.json, args.markdown) if p)
        if not result.complete:
            done = ", ".join(r.method for r in result.records)
            args.kept = f"the accuracy of {done} in {where}, marked partial (\"complete\": false)"
        else:  # a Ctrl-C after the last write names the files as finished (and the run ends with status 0)
            args.kept = f"the finished results in {where}"
            args.finished = complete_in([p for p in (args.json, args.markdown) if p])

    questions = getattr(args, "mc_questions", None)  # read before the model loaded (mc_task_input), --mc-limit applied
    result = evaluate_mc(model, tokenizer, cfg, questions=questions, preheat=preheat,
                         on_record=write if args.json or args.markdown else None)
    r0 = result.records[0]
    shots = f", {cfg.shots}-shot" if cfg.scoring == "harness" else ""
    print_mc_table(result, f"{args.ckpt}: {args.task}, {cfg.scoring} scoring{shots}, N = {r0.n} (chance "
                        f"{pct(r0.chance)} %), 95 % Wilson CI")
    write(result)
    for path in (args.json, args.markdown):
        if path:
            print(f"wrote {path}")  # on stdout, as the LM metrics, the drafter and the harness say theirs
    return 0

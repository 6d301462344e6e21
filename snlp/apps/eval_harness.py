"""`snlp eval CKPT --harness TASKS`: lm-evaluation-harness tasks for the sequential model and each plan.

One harness run per method (sequential, every --plans plan, and the --drafter's plan through the adapted drafter),
one table of the harness's metrics with their stderr (snlp.eval.harness.markdown), and the harness's own JSON per
method under --harness-out. Tasks are the harness's names (online: its hub datasets) or YAML files under
--harness-include (offline: `dataset_path: json` with local `data_files`; tests/data/harness/ has examples).
Needs the optional extra: pip install -e ".[harness]" (lm-eval); it is imported only when --harness is given.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path



def add_arguments(p) -> None:
    h = p.add_argument_group("lm-evaluation-harness tasks (pip install -e '.[harness]'): one run per method")
    h.add_argument("--harness", default=None, metavar="TASKS", help="comma-separated harness task names (e.g. "
                   "arc_easy,hellaswag; online) or names of tasks in --harness-include YAML files (offline)")
    h.add_argument("--harness-include", default=None, metavar="DIR", help="folder of task YAML files (e.g. "
                   "dataset_path: json with local data_files); the harness's own tasks stay available")
    h.add_argument("--num-fewshot", type=int, default=None, help="--harness: solved examples per prompt (default: "
                   "each task's own)")
    h.add_argument("--limit", type=float, default=None, help="--harness: first N documents per task (a fraction "
                   "below 1: that share)")
    h.add_argument("--fewshot-seed", type=int, default=1234, help="--harness: the few-shot sampler's seed (the "
                   "harness's default)")
    h.add_argument("--apply-chat-template", action="store_true", help="--harness: prompts in the model's chat "
                   "template, as the harness's --apply_chat_template")
    h.add_argument("--harness-decode", choices=["snlp", "speculative"], default=None, help="--harness generate_until "
                   "with a plan: snlp (the plan's own answers; default for --plans) or speculative (exact: the model's "
                   "answers; always for --drafter)")
    h.add_argument("--harness-block", type=int, default=4, help="--harness-decode speculative: draft block size")
    h.add_argument("--harness-ignore-generation-config", action="store_true", help="--harness generate_until: "
                   "decode without the model's generation_config settings (its repetition_penalty, applied by "
                   "default; what snlp does not apply, e.g. no_repeat_ngram_size, refused by default)")
    h.add_argument("--bootstrap-iters", type=int, default=None, help="--harness: bootstrap draws of the stderr of "
                   "bootstrapped metrics (default: the harness's own, 100000 in lm-eval 0.4; 0 = no stderr)")
    h.add_argument("--harness-out", default=None, metavar="DIR", help="the harness's JSON per method "
                   "(DIR/<method>.json) and the table (DIR/table.md); default harness-<CKPT name>")
    h.add_argument("--force", action="store_true", help="--harness: replace an earlier run's files in --harness-out "
                   "(this run's methods' JSON and table.md are removed before the first harness run; other files "
                   "there are left as they are and named)")


def method_file(method: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", method) + ".json"


def check_method_files(methods: list[str]) -> None:
    """Refuse methods whose harness JSON files would coincide (one would overwrite the other): a plan listed twice,
    two spellings of one plan (8xF1-K1 and 8xF1-h0-K1), or names that map to one file name (compared without case,
    as a case-insensitive file system does)."""
    seen: dict[str, str] = {}
    for m in methods:
        f = method_file(m).lower()
        if f in seen:
            same = "is listed twice" if seen[f] == m else f"and {seen[f]} would both be written to {method_file(m)}"
            raise ValueError(f"--harness: method {m} {same}: each method's harness JSON needs its own file; give each "
                             f"plan once")
        seen[f] = m


def check_harness_out(out: Path, methods: list[str], force: bool = False) -> list[str]:
    """Refuse a --harness-out that already holds a file this run would write (a method's JSON, table.md): the run
    replaced them and left the other methods' files of the earlier run beside the new ones, one folder mixing two
    runs' results. With `force` (--force) nothing is refused: returns the names of those files (`clear_harness_out`
    removes them)."""
    names = [method_file(m) for m in methods] + ["table.md"]
    there = [n for n in names if (out / n).exists()]
    if there and not force:
        it = "it" if len(there) == 1 else "them"
        raise ValueError(f"--harness-out {out} already holds {', '.join(there)} of an earlier run; this run would "
                         f"replace {it}: choose another --harness-out, pass --force to replace {it}, or move {it} "
                         f"away")
    return there


def clear_harness_out(out: Path, methods: list[str]) -> str:
    """--force: remove the files of `out` this run writes (its methods' JSON, table.md), before the first harness
    run, so that a run that stops half way leaves none of the earlier run's files looking like its own. Nothing
    else in `out` is touched. Returns the line saying what was removed and what was left ("" when `out` holds
    nothing)."""
    gone = check_harness_out(out, methods, force=True)
    for n in gone:
        (out / n).unlink()
    left = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not gone and not left:
        return ""
    return (f"--force: removed {', '.join(gone) or 'nothing'} from {out}"
            + (f"; left {', '.join(left)} (not written by this run)" if left else ""))


def planned_methods(plans: list, drafter: str | None) -> list[str]:
    """The methods a run will evaluate, named as SNLPLM.method names them (sequential, each plan, drafter:PLAN with
    the drafter's own plan, read from its drafter.json), known before the checkpoint loads."""
    methods = ["sequential"] + [str(p) for p in plans]
    if drafter:
        from snlp.io.drafter import read_meta
        from snlp.method.plan import Plan

        methods.append(f"drafter:{Plan.parse(read_meta(drafter)['plan'])}")
    return methods


def run(args) -> int:
    from snlp.apps.common import plans_preheat
    from snlp.method.plan import parse_plans
    from snlp.runtime.device import cli_device, cli_dtype, device_label, json_text, set_threads, write_atomic
    from snlp.runtime.outputs import check_output_dir

    try:
        from snlp.eval.harness import (SNLPLM, evaluate_methods, generation_note, load_any, markdown, model_arg,
                                       print_table, task_manager, value_caption)
    except ImportError as e:
        if getattr(e, "name", None) and e.name.split(".")[0] == "lm_eval":
            raise ValueError("--harness needs lm-evaluation-harness: pip install -e '.[harness]' (or pip install "
                             "lm-eval)") from e
        raise

    if args.task:
        raise ValueError("--harness runs harness tasks; --task is snlp's own multiple-choice scoring: give one of them")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError(f"--num-fewshot must be >= 0 (got {args.num_fewshot})")
    if args.bootstrap_iters is not None and args.bootstrap_iters < 0:
        raise ValueError(f"--bootstrap-iters must be >= 0 (got {args.bootstrap_iters})")
    if args.limit is not None and args.limit <= 0:
        raise ValueError(f"--limit must be > 0 (got {args.limit})")
    if args.harness_include and not Path(args.harness_include).is_dir():
        from snlp.io.source import did_you_mean

        missing = not Path(args.harness_include).exists()
        raise ValueError(f"--harness-include {args.harness_include} " + (
            f"does not exist{did_you_mean(args.harness_include)}" if missing else "is not a folder of task YAML files"))
    tasks = [t.strip() for t in args.harness.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--harness needs at least one task name")
    device = cli_device(args.device)
    set_threads(args.threads)
    dtype = cli_dtype(args.dtype, device)
    # a plan given twice (or two spellings of one) would overwrite its own JSON: parse_plans refuses it before the
    # checkpoint loads
    early = parse_plans(args.plans) if args.plans else []
    model_arg("pretrained", args.ckpt)  # each run records them in its model_args: a ',' is refused before loading
    if args.drafter:
        model_arg("drafter", args.drafter)
    out = Path(args.harness_out or f"harness-{Path(args.ckpt).name}")
    check_output_dir(out, "--harness-out")  # its default too (the CLI checks typed paths): before any harness run
    methods = planned_methods(early, args.drafter)
    check_method_files(methods)
    check_harness_out(out, methods, args.force)  # an earlier run's files: refused before the model loads
    tm = task_manager(tasks, args.harness_include)  # an unknown task name: refused before the model loads
    # an snlp / nanochat checkpoint without tokenizer.json: refused before its weights are read
    model, tok, ckpt = load_any(args.ckpt, need_tokenizer="the harness sends text, so the model needs its own")
    if tok is None:  # a transformers directory or .gguf file loaded without one
        raise ValueError(f"{args.ckpt} has no tokenizer: the harness sends text, so the model needs its own (a "
                         f"transformers directory: its tokenizer.json beside config.json)")
    plans = parse_plans(args.plans, model.config.n_layer) if args.plans else []
    preheat = plans_preheat(ckpt, model, plans) if ckpt is not None else None
    # loaded here, so converted here: SNLPLM never converts a model object it is given
    from snlp.io.weights import cast_model  # float16 refuses a weight it cannot hold
    model = cast_model(model, device, dtype, args.ckpt).eval()
    common = dict(tokenizer=tok, dtype=dtype, device=device, batch_size=args.batch, block=args.harness_block,
                  name=args.ckpt, ignore_generation_config=args.harness_ignore_generation_config)
    lms = [SNLPLM(pretrained=model, **common)]
    lms += [SNLPLM(pretrained=model, plan=p, preheat=preheat, decode=args.harness_decode, **common) for p in plans]
    if args.drafter:
        lms.append(SNLPLM(pretrained=model, drafter=args.drafter, decode="speculative", **common))
    methods = [lm.method for lm in lms]  # as planned_methods named them; checked again from the built models
    check_method_files(methods)
    if not args.harness_out:  # the default, held from here (before --force clears it), as a typed one (snlp.apps.cli)
        getattr(args, "hold_output", lambda *a: None)(str(out), "--harness-out")
    check_harness_out(out, methods, args.force)
    said = clear_harness_out(out, methods) if args.force else ""
    if said:
        print(f"snlp eval: {said}", file=sys.stderr)
    shots = "task default" if args.num_fewshot is None else f"{args.num_fewshot}-shot"
    # lm-eval reads a limit >= 1 as a count (int(limit)) and one below 1 as a share: the title names what runs
    run_limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    limit = "" if run_limit is None else f", limit {run_limit:g}"
    chat = ", chat template (few-shot as turns)" if args.apply_chat_template else ""
    title = (f"{args.ckpt}: lm-evaluation-harness {','.join(tasks)}, {shots} (seed {args.fewshot_seed}){limit}{chat} | "
             f"{dtype} on {device_label(device)}")

    def write(records, complete: bool) -> None:
        """Each finished method's JSON, table.md and --markdown / --json; until the last method, marked partial."""
        from snlp.runtime.outputs import complete_in, make_folders, partial_line

        make_folders(out)
        for rec in records:
            write_atomic(out / method_file(rec.method), json_text(rec.harness or rec.to_dict(), indent=2))
        done = f"{len(records)} of {len(methods)} methods ({', '.join(r.method for r in records)})"
        note = generation_note(lms, records)  # how each plan column's generation rows were decoded
        table = (f"{title}\n\n" + ("" if complete else partial_line(done) + "\n\n") + (f"{note}\n\n" if note else "")
                 + markdown(records))
        write_atomic(out / "table.md", table)
        if args.markdown:
            write_atomic(args.markdown, table)
        if args.json:
            rows = [r.to_dict() for r in records]
            write_atomic(args.json, json_text(rows if complete else {"complete": False, "done": done, "records": rows},
                                               indent=2))
        if not complete:
            args.kept = (f"the results of {done} in {out}" + (f" and {args.json}" if args.json else "")
                         + " (table.md marked partial; a re-run into it needs --force)")
        else:  # a Ctrl-C after the last write names the files as finished (and the run ends with status 0)
            args.kept = f"the finished results in {out}" + (f" and {args.json}" if args.json else "")
            args.finished = complete_in([out, *([args.json] if args.json else [])])

    records = evaluate_methods(lms, tasks, num_fewshot=args.num_fewshot,
                               limit=run_limit,
                               include=args.harness_include, apply_chat_template=args.apply_chat_template,
                               fewshot_seed=args.fewshot_seed, bootstrap_iters=args.bootstrap_iters, tm=tm,
                               on_record=lambda records: write(records, complete=False))
    note = generation_note(lms, records)
    print_table(records, title, caption=value_caption(records) + (f"; {note}" if note else ""))
    write(records, complete=True)
    for path in [out / method_file(r.method) for r in records] + ([args.json] if args.json else []):
        print(f"wrote {path}")
    print(f"wrote the harness's JSON per method and table.md to {out}", file=sys.stderr)
    return 0

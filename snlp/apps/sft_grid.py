"""The paper's SFT x inference table (Table sft_task_results) in one command.

`snlp sft-grid CKPT --data CHATS --plan PLAN --task T [--task T ...] --out DIR` fine-tunes CKPT twice
(snlp.train.sft: the sequential forward, then the SNLP forward of PLAN) into DIR/sft-sequential and
DIR/sft-PLAN (an existing run there is resumed or, if finished, reused), evaluates each under
sequential and PLAN inference on every task (snlp.eval.mc) and writes the 2 x 2 table with the paper's
layout (SFT | Inference | one column per task | Avg.) to DIR/grid.md and DIR/grid.json.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from snlp.apps.sft import add_train_arguments, train_config
from snlp.apps.train import file_hooks, read_stop_file
from snlp.runtime.device import json_text, write_atomic

SUMMARY = "Build the paper's SFT x inference table: two SFT runs, each evaluated two ways."
DESCRIPTION = """\
Fine-tunes CKPT twice (the sequential forward, then the SNLP forward of PLAN) into OUT/sft-sequential and
OUT/sft-PLAN, evaluates each under sequential and PLAN inference on every --task (repeatable), and writes the paper's
2 x 2 table (SFT | Inference | one column per task | Avg.) to OUT/grid.md and OUT/grid.json. A finished run in OUT is
reused, an unfinished one resumed.

  snlp sft-grid CKPT --data chats.jsonl --plan 8xF1-h0-K1 --task mc:arc.jsonl --out runs/grid
"""
GUIDE = "docs/sft.md"


def interrupt_hint(args) -> str:
    """What to do after Ctrl-C or a signal (snlp.apps.cli): the SFT run it stopped saved where it stopped."""
    return "run the same command again to continue: a finished SFT run is reused, a stopped one resumes from its save"


@dataclass
class GridConfig:
    ckpt: str
    data: str
    plan: str
    tasks: list[str]
    out: str
    sft_args: object = None  # the parsed shared training flags (see snlp.train.sft.add_train_arguments)
    scoring: str = "letter"
    limit: int = 0


@dataclass
class GridRow:
    sft: str  # "sequential" or the plan
    inference: str
    accuracy: dict  # task -> accuracy
    ci: dict  # task -> (low, high)
    n: dict  # task -> questions
    avg: float


@dataclass
class GridResult:
    ckpt: str
    plan: str
    tasks: list[str]
    scoring: str
    rows: list[GridRow] = field(default_factory=list)
    sft_runs: dict = field(default_factory=dict)  # forward -> the run's train_summary.json
    protocol: str = ""  # the scoring protocol's caption (snlp.eval.mc.protocol_caption, and who scored: harness)
    # the SFT run a --stop-file holding text ("stop") stopped: the grid stops there, unscored (a step number in the
    # file stops each run at that step instead, and the grid scores both)
    stopped: str | None = None


def run_grid(cfg: GridConfig) -> GridResult:
    # the library (and torch) loads here, not at the top: --help answers without it
    import torch

    from snlp.eval.mc import SEQ, MCConfig
    from snlp.eval.mc_eval import evaluate_mc
    from snlp.io.checkpoint import load
    from snlp.io.mctasks import load_task
    from snlp.train.sft import SEQUENTIAL, SFTConfig, forward_plan, sft

    plan = str(forward_plan(cfg.plan, "--plan"))  # refused before the first SFT run trains
    mc = {t: MCConfig(task=t, plans=[plan], scoring=cfg.scoring, limit=cfg.limit) for t in cfg.tasks}
    for c in mc.values():  # a bad --mc-limit was refused only when the first SFT run was scored, after its training
        c.check()
    questions = {t: load_task(t) for t in cfg.tasks}  # fail on bad tasks before any training
    res = GridResult(cfg.ckpt, plan, list(cfg.tasks), cfg.scoring)
    device = cfg.sft_args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from snlp.method.jacobian import check_fd_step
    from snlp.train.precision import step_dtype

    # the SNLP-forward run's diag:fd eps against its step's dtype (the checkpoint loads in float32; bf16 under CUDA
    # autocast), before the sequential run trains: that run's job refused it only after the first run was scored
    check_fd_step(forward_plan(plan, "--plan"), step_dtype(device, torch.float32), torch.device(device).type)
    for forward in (SEQUENTIAL, plan):
        out = Path(cfg.out) / f"sft-{forward}"
        tcfg = train_config(cfg.sft_args, str(out), resume=(out / "train_state.pt").is_file())
        r = sft(SFTConfig(ckpt=cfg.ckpt, data=cfg.data, train=tcfg, forward=forward,
                          max_conversations=cfg.sft_args.max_conversations, val_frac=cfg.sft_args.val_frac),
                hooks=dropping_table(file_hooks(cfg.sft_args.stop_file), Path(cfg.out)))
        if r.stopped_by == "interrupt":  # saved: the next sft-grid of the same command resumes it; the grid stops here
            from snlp.train.hooks import Interrupted, signal_number
            raise Interrupted(signal_number(r.signal))
        # the run's own record: a finished run reused here ran no step, and its TrainResult holds no loss
        res.sft_runs[forward] = json.loads((out / "train_summary.json").read_text())
        if r.stopped_by == "stop_file" and read_stop_file(cfg.sft_args.stop_file)[1] is not None:
            # text ("stop") asks the grid to stop now: the next run would read it before its first step and train
            # nothing, and the table would score that base model as an SFT run
            res.stopped = forward
            return res
        model, tok = load(out, device=device)  # scored where it trained: --device, else cuda if available (as fit)
        per_task = {t: evaluate_mc(model, tok, mc[t], questions[t]) for t in cfg.tasks}
        res.protocol = per_task[cfg.tasks[0]].protocol  # one MCConfig but the task: one protocol
        for i, inference in enumerate((SEQ, plan)):
            res.rows.append(grid_row(forward, inference, {t: per_task[t].records[i] for t in cfg.tasks}))
    return res


def dropping_table(hooks, out: Path):
    """`hooks` that remove OUT/grid.md and grid.json once a run goes on to a step (the loop asks should_stop before
    the first step only where the run has steps left): the table describes the runs as they were, and a rerun that
    trains them further and is stopped or fails before it writes the new table would leave the old one beside runs
    it no longer describes. A run reused as it is asks nothing, and the table stays until the new one replaces it."""
    ask = hooks.should_stop

    def should_stop(steps_done: int):
        reason = ask(steps_done) if ask is not None else None
        if reason is None:
            for name in GRID_FILES:
                (out / name).unlink(missing_ok=True)
        return reason

    return replace(hooks, should_stop=should_stop)


def grid_row(forward: str, inference: str, recs: dict) -> GridRow:
    """One grid row from each task's MCRecord; a diverged record (accuracy None) makes Avg. NaN, not a crash."""
    accs = [r.accuracy for r in recs.values()]
    return GridRow(sft=forward, inference=inference, accuracy={t: r.accuracy for t, r in recs.items()},
                   ci={t: (r.ci_low, r.ci_high) for t, r in recs.items()}, n={t: r.n for t, r in recs.items()},
                   avg=float("nan") if None in accs else sum(accs) / len(accs))


GRID_FILES = ("grid.md", "grid.json")  # what the grid writes into --out (and removes once a run trains on)


def check_grid_files(out: str) -> None:
    """Refuse, before any work, an --out whose grid.md or grid.json is not an earlier grid's (its grid.json: a JSON
    object with the grid's `plan`, `tasks` and `rows`): the grid removes both once a run goes on to a step and writes
    its own, so a file of the user's under either name was lost. An earlier grid's table is the one a rerun replaces."""
    from snlp.io.source import home_path

    folder = home_path(out)
    held = [n for n in GRID_FILES if (folder / n).exists()]
    if not held:
        return
    try:
        rec = json.loads((folder / "grid.json").read_text())
        ours = isinstance(rec, dict) and {"plan", "tasks", "rows"} <= rec.keys()
    except (OSError, ValueError):  # no grid.json, a folder of that name, or text that is not JSON
        ours = False
    if not ours:
        raise ValueError(f"--out {out} holds {' and '.join(held)} but no earlier grid (grid.json of snlp sft-grid): "
                         f"this run would write over or remove them; name another folder")


def check_distinct_tasks(tasks: list[str]) -> None:
    """Refuse a task given twice (or two --task naming one file, as a file and as its folder, or spelled from
    another folder): its column would stand twice in the table and count twice in Avg., the mean of the columns."""
    from snlp.io.source import home_path

    seen = {}
    for t in tasks:
        keys = [t]
        if t.startswith("mc:"):
            keys = []
            for part in (p for p in t[3:].split(",") if p.strip()):
                p = home_path(part)
                files = sorted(f for f in p.iterdir() if f.suffix.lower() in (".jsonl", ".csv")) if p.is_dir() else [p]
                keys += [f.resolve() for f in files]
        for k in dict.fromkeys(keys):  # a file twice within one task: load_task refuses it in its own words
            if k in seen and seen[k] != t:
                raise ValueError(f"--task {t} and --task {seen[k]} both name {k}: its questions would make two "
                                 f"columns and count twice in Avg.; give each task once")
            if k in seen:
                raise ValueError(f"--task {t} is given twice: its column would count twice in Avg.; give it once")
            seen[k] = t


def task_labels(tasks: list[str]) -> list[str]:
    """One column name per task, task_label's where it names one task only, else the task as given (files of the
    same name in two folders would otherwise make two columns of one name)."""
    short = [task_label(t) for t in tasks]
    return [s if short.count(s) == 1 else t.removeprefix("mc:") for s, t in zip(short, tasks)]


def task_label(task: str) -> str:
    """Short column name: a hub task as given, local files by their names (mc:a/b/x_test.csv -> x_test)."""
    if not task.startswith("mc:"):
        return task
    names = [Path(p).stem or Path(p).name for p in task[3:].split(",") if p.strip()]
    return "+".join(names) if len(names) <= 2 else f"{names[0]}+{len(names) - 1} more"


def markdown(res: GridResult) -> str:
    tasks = res.tasks
    head = ("| SFT | Inference | " + " | ".join(f"{label} (N={res.rows[0].n[t]})" for t, label in
                                              zip(tasks, task_labels(tasks))) + " | Avg. |")
    what = "acc (summed log-prob)" if res.scoring == "harness" else "accuracy"
    lines = [f"`{res.ckpt}`, {res.scoring} scoring; {what} % (95 % Wilson interval)", res.protocol, "", head,
             "|---|---|" + "---:|" * (len(tasks) + 1)]
    for r in res.rows:
        cells = ["diverged" if r.accuracy[t] is None else
                 f"{100 * r.accuracy[t]:.1f} ({100 * r.ci[t][0]:.1f}–{100 * r.ci[t][1]:.1f})" for t in tasks]
        avg = "–" if r.avg != r.avg else f"{100 * r.avg:.1f}"  # NaN: a task diverged
        lines.append(f"| {r.sft} | {r.inference} | " + " | ".join(cells) + f" | {avg} |")
    if res.sft_runs:  # what each SFT row is: a run --stop-after or a stop file's step ended is not its budget's run
        lines += ["", "SFT runs: " + ", ".join(f"{forward} {rec.get('steps')} steps" + run_end(rec.get("stopped_by"))
                                               for forward, rec in res.sft_runs.items())]
    return "\n".join(lines) + "\n"


def run_end(stopped_by: str | None) -> str:
    """How an SFT run of the table ended, where not by its budget (--steps / --minutes)."""
    if stopped_by in (None, "budget"):
        return ""
    flag = {"stop_after": "--stop-after", "stop_file": "--stop-file"}.get(stopped_by, stopped_by)
    return f" (stopped by {flag} before its budget)"


def add_arguments(p) -> None:
    p.add_argument("ckpt", help="checkpoint to fine-tune")
    p.add_argument("--data", required=True, help="chat data, as for snlp sft")
    p.add_argument("--plan", required=True, help="SNLP plan for SNLP-forward SFT and SNLP inference, e.g. 8xF1-h0-K1")
    p.add_argument("--task", action="append", required=True, help="multiple-choice task as for snlp eval --task; repeatable")
    p.add_argument("--out", required=True, help="folder for the two SFT checkpoints and grid.md / grid.json")
    p.add_argument("--mc-scoring", choices=["letter", "loglik", "harness"], default="letter")
    p.add_argument("--mc-limit", type=int, default=0, help="first N questions per task (0 = all)")
    add_train_arguments(p)


def check_grid_stop_file(args) -> None:
    """snlp sft's --stop-file refusal for each of the grid's two runs that has steps left: a file an earlier grid
    left at a step a run starts at or past stopped it before its first step, and the grid scored an SFT run of no
    training with status 0. A finished run (reused) has no step for the file to stop."""
    from snlp.apps.train import check_stop_file
    from snlp.train.checkpointing import check_resume_left
    from snlp.train.sft import SEQUENTIAL

    if args.stop_file is None:
        return
    for forward in (SEQUENTIAL, args.plan):
        out = Path(args.out) / f"sft-{forward}"
        resume = (out / "train_state.pt").is_file()
        try:
            if resume:
                check_resume_left(train_config(args, str(out), resume=True))
        except ValueError:
            continue  # finished: reused as it is
        check_stop_file(args.stop_file, str(out), resume, made=args.out)  # the grid makes both runs' folders


def check_grid_runs(args) -> None:
    """Each of the grid's two SFT runs, before either trains: snlp sft's refusals of its folder (what a new run would
    write over; a saved run of another command, chats, split, forward or base) and of the saved run's settings, so
    the second run's refusal no longer comes after the first has trained. A saved run past --steps or --stop-after
    would be scored as the grid of that budget: refused, as is a setting it was saved with other than this command's,
    in the grid's words (snlp sft's advice, to leave the flag out, does not hold: the grid takes no saved values)."""
    import math

    from snlp.io.chat import resolve_spec
    from snlp.train.checkpointing import check_resume_command, open_run, saved_state
    from snlp.train.config import TrainConfig, resume_changes
    from snlp.train.sft import BASE_DATA, SEQUENTIAL, SFTConfig, check_resume_sft, with_base_data

    for forward in (SEQUENTIAL, args.plan):
        out = Path(args.out) / f"sft-{forward}"
        tcfg = train_config(args, str(out), resume=(out / "train_state.pt").is_file())
        if not tcfg.resume:
            open_run(out, resume=False)  # raises where the new run would write over what the folder holds
            continue
        if not (out / "model.safetensors").is_file():  # fit's refusal says "drop --resume", a flag the grid lacks
            raise ValueError(f"{out} holds train_state.pt but no model.safetensors: no SFT run the grid can resume "
                             f"or reuse; put its weights back, move the folder away, or choose another --out")
        check_resume_command(out, "snlp sft")
        check_resume_sft(SFTConfig(ckpt=args.ckpt, data=resolve_spec(args.data), train=tcfg, forward=forward,
                                   max_conversations=args.max_conversations, val_frac=args.val_frac))
        st = saved_state(out) or {}
        saved = st.get("args") if isinstance(st.get("args"), dict) else None
        step = st.get("step")
        past = [f"--{k.replace('_', '-')} {v}" for k, v in (("steps", tcfg.total_steps), ("stop_after", args.stop_after))
                if isinstance(step, int) and v is not None and step > v]
        if past:
            raise ValueError(f"{out} holds this grid's SFT run at step {step}, past {past[0]}: the table would score "
                             f"it as the grid of that budget; give its budget, or another --out")
        if saved is None:
            continue
        cfg = replace(with_base_data(tcfg, args.ckpt), **{k: saved[k] for k in BASE_DATA if k in saved})
        diff = [(k, was, now) for k, was, now in resume_changes(cfg, saved) if not k.endswith("_lr")]
        if "embedding_lr" in saved:  # the five LRs are --lr-scale times the defaults (train_config)
            was = saved["embedding_lr"] / TrainConfig(out="").embedding_lr
            if not math.isclose(was, args.lr_scale, rel_tol=1e-9):
                diff.append(("lr_scale", float(f"{was:.6g}"), args.lr_scale))
        if diff:
            raise ValueError(f"{out} holds this grid's SFT run, saved with "
                             + ", ".join(f"--{k.replace('_', '-')} {was!r} (given: {now!r})" for k, was, now in diff)
                             + ": the grid resumes or reuses its runs as they were made: give those values, or "
                               "another --out")


def run(args) -> int:
    from snlp.apps.common import check_plans_fit
    from snlp.apps.train import check_reg_flags
    from snlp.method.plan import cli_plan

    check_reg_flags(args.reg, getattr(args, "given", None))  # --reg-lambda without --reg: refused, as by snlp sft
    args.plan = str(cli_plan(args.plan))  # a K beyond the exact count capped (with a warning), as for every --plan
    check_plans_fit(args.ckpt, [args.plan])  # its depth from its config, before its weights load
    check_distinct_tasks(args.task)
    check_grid_files(args.out)
    check_grid_stop_file(args)
    check_grid_runs(args)
    res = run_grid(GridConfig(ckpt=args.ckpt, data=args.data, plan=args.plan, tasks=args.task, out=args.out,
                              sft_args=args, scoring=args.mc_scoring, limit=args.mc_limit))
    if res.stopped is not None:
        import sys

        print(f"snlp sft-grid: --stop-file {args.stop_file} stopped SFT run sft-{res.stopped} (saved); the grid stops "
              f"there, unscored: empty the file (or write a step number in it) and {interrupt_hint(args)}",
              file=sys.stderr)
        return 0
    md = markdown(res)
    out = Path(args.out)
    # grid.json first, each file whole or absent (write_atomic): a grid cut between the two leaves the record that
    # marks OUT as a grid's (check_grid_files), never a grid.md alone, which the rerun would refuse as the user's
    write_atomic(out / "grid.json", json_text(asdict(res), indent=2))  # strict: a diverged row's Avg. NaN is null
    write_atomic(out / "grid.md", md)
    print(md)
    print(f"wrote {out / 'grid.md'} and {out / 'grid.json'}")
    return 0

"""Stage `report`: OUT/report.md, OUT/frontier.png, OUT/records.csv, OUT/summary.json (always rewritten)."""

from __future__ import annotations

import dataclasses
import time
from datetime import datetime
from typing import TYPE_CHECKING

import torch

from snlp.apps.report import (MODELS, environment, fmt_s, front_rows, pooled_speeds, ppl_intervals, render_report,
                              tied_front)
from snlp.apps.speedrun.evaluate import eval_records
from snlp.apps.speedrun.preset import BLOCKS, REG_LAMBDA, SELECT_BLOCK
from snlp.apps.speedrun.records import write_json
from snlp.apps.speedrun.train import FLOOR_RECORD, MIN_TRAIN_STEPS
from snlp.runtime.device import write_atomic

if TYPE_CHECKING:
    from snlp.apps.speedrun.job import Speedrun


def report_context(sr: Speedrun, records: dict[str, list], wall: float) -> dict:
    """Everything render_report prints, in the dict form it reads (snlp.apps.report)."""
    from snlp.io.checkpoint import load_config
    from snlp.model.gpt import GPT

    mcfg = load_config(sr.out / "noreg")
    with torch.device("meta"):  # the parameter count without allocating the weights
        params = GPT(mcfg).num_params()
    st = sr.stages
    return {"cfg": sr.settings(), "env": environment(sr.cfg.device),
            "stages": {n: r.to_json() for n, r in st.records.items()}, "evals": records, "preset": sr.preset,
            "params": params, "model": {"x0_residual": mcfg.x0_residual, "value_embeds": mcfg.value_embeds},
            "date": datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            "command": sr.command, "order": sr.order, "ran": st.ran, "reused": st.reused, "wall": wall,
            "threads": sr.eval_threads, "parallel": sr.parallel, "train_threads": sr.train_threads,
            "reg_lambda": REG_LAMBDA, "select_block": SELECT_BLOCK, "blocks": BLOCKS,
            "budget": None if sr.budget is None else sr.budget.to_dict(), "budget_minutes": sr.preset.budget_minutes,
            "train_floor_steps": MIN_TRAIN_STEPS if sr.preset.budget_minutes is not None else None,
            "train_floor_record": FLOOR_RECORD}


def summary(sr: Speedrun, env: dict, date: str, wall: float) -> dict:
    """summary.json: the command, settings, which stages ran or were reused, and every stage's result."""
    st = sr.stages
    return {"command": sr.command, "date": date, "settings": sr.settings(), "preset": dataclasses.asdict(sr.preset),
            "plans": sr.plans, "ran": st.ran, "reused": st.reused, "wall_seconds": wall, "environment": env,
            "budget": None if sr.budget is None else sr.budget.to_dict(),
            "budget_exceeded_s": None if sr.preset.budget_minutes is None else max(0.0, wall - 60 * sr.preset.budget_minutes),
            "stages": {n: {"seconds": st.records[n].seconds, "result": st.records[n].result} for n in sr.order}}


def step_report(sr: Speedrun) -> None:
    """report.md, frontier.png, records.csv, summary.json: always rewritten (cheap, and they name this invocation)."""
    from snlp.eval.present import frontier_plot, write_csv

    sr.console.rule(f"[bold]report[/bold] (elapsed {sr.stages.elapsed()})")
    records = {k: eval_records(sr.stages.records[f"eval-{k}"]) for k, _ in MODELS}
    speeds = pooled_speeds(records)  # the main table's Speedup: one per plan, both models' rounds
    pooled = {label: [dataclasses.replace(r, speedup=speeds[r.plan].median) if r.plan in speeds else r
                      for r in records[k]] for k, label in MODELS}
    where = (f"{sr.eval_threads} CPU thread{'s' if sr.eval_threads != 1 else ''}" if sr.cfg.device == "cpu"
             and sr.eval_threads else sr.cfg.device)
    frontier_plot(pooled, sr.out / "frontier.png", title=f"SNLP speed-quality frontier: depth {sr.cfg.depth}, {where}",
                  xlabel=f"decode speedup vs sequential (wall clock, batch 1, {where}; both models' rounds)",
                  fronts={label: tied_front(front_rows(records[k], speeds)) for k, label in MODELS},  # the main table's `*`: paired rounds and PPL ties
                  spreads={label: {p: (sp.lo, sp.hi) for p, sp in speeds.items()} for _, label in MODELS},
                  intervals={label: {p: (100 * lo, 100 * hi) for p, (lo, hi) in ppl_intervals(records)[k].items()}
                             for k, label in MODELS})  # the paired t-test's ΔPPL intervals, the report's rule
    write_csv([{"model": label, **r.to_dict()} for k, label in MODELS for r in records[k]], sr.out / "records.csv")
    ctx = report_context(sr, records, 0.0)  # the parameter count (a meta-device model: seconds) and the environment
    # are part of the invocation: the wall is read after them, so report.md, summary.json and the budget's verdict
    # count them
    ctx["wall"] = wall = time.perf_counter() - sr.t_start
    write_atomic(sr.out / "report.md", render_report(ctx))
    write_json(sr.out / "summary.json", summary(sr, ctx["env"], ctx["date"], wall))
    sr.console.print(f"wrote {sr.out / 'report.md'}, {sr.out / 'frontier.png'}")
    if sr.preset.budget_minutes is not None and wall > 60 * sr.preset.budget_minutes:
        sr.console.print(f"[yellow]budget exceeded by {fmt_s(wall - 60 * sr.preset.budget_minutes)}[/yellow] "
                         f"({fmt_s(wall)} of {fmt_s(60 * sr.preset.budget_minutes)}; report.md says so)")
    sr.console.print(f"[bold]speedrun finished[/bold] in {fmt_s(wall)} ({len(sr.stages.ran)} stage{'s' if len(sr.stages.ran) != 1 else ''} ran, "
                     f"{len(sr.stages.reused)} reused)")

"""Stages `eval-noreg`, `eval-idn`: the plan grid on the validation split (snlp.eval.protocol), its cost and its shrink
rule."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from snlp.apps.report import MODELS
from snlp.apps.speedrun.common import ar_rows, fewer, floor_scale, plan_factor, shrink_text
from snlp.apps.speedrun.preset import Preset
from snlp.apps.speedrun.records import StageRecord

if TYPE_CHECKING:
    from snlp.bench.budget import StageCost
    from snlp.apps.speedrun.job import Speedrun


EVAL_ROWS = 3  # what an eval stage record holds (job.stage_settings): 2 = ar_match_seq, speedup_rounds, "eval";
# 3 = window_ce (the report's PPL ties)
AR_TOKEN = 0.75  # an AR Match token of the sequential model over a cached decode step (cost: measured 0.71-0.74)
EVAL_FLOORS = dict(prompts=2, runs=3)  # what shrink_eval never goes below


def shrink_eval(ecfg, scale: float):
    """(EvalConfig, description) of an eval-* stage at `scale`: fewer AR-Match prompts and timing rounds (the warm-up
    rounds, the teacher-forced tokens and the plans stay)."""
    new = dataclasses.replace(ecfg, prompts=fewer(ecfg.prompts, scale, EVAL_FLOORS["prompts"]),
                              runs=fewer(ecfg.runs, scale, EVAL_FLOORS["runs"]))
    return new, shrink_text([("prompts", ecfg.prompts, new.prompts), ("timing rounds", ecfg.runs, new.runs)])


def stage_eval(model_dir: Path, val: torch.Tensor, plans: list[str], ecfg, device: str) -> dict:
    from snlp.apps.report import record_ties
    from snlp.io.checkpoint import load
    from snlp.eval.protocol import evaluate
    from snlp.eval.present import print_table

    model, tok = load(model_dir, device=device)
    records = evaluate(model, val, plans, ecfg, tokenizer=tok)
    # marked as `snlp eval` marks them: a --quick stage's 5 rounds can never resolve a Speedup (6 of 6 at the fewest)
    print_table(records, f"{model_dir.name}: L={model.config.n_layer} D={model.config.n_embd}",
                ties=record_ties(records))
    # stored as JSON (EvalRecord.from_dict reads the rows back), with the settings it ran with (a budget may have
    # shrunk them: the report states these, not the preset's)
    return {"records": [r.to_dict() for r in records], "eval": dataclasses.asdict(ecfg)}


def eval_records(stage_record: StageRecord) -> list:
    """The EvalRecords of a stored eval-* stage record (JSON rows)."""
    from snlp.eval.protocol import EvalRecord

    return [EvalRecord.from_dict(d) for d in stage_record.result["records"]]


def step_eval(sr: Speedrun) -> None:
    def run(key, scale):
        ecfg, shrunk = shrink_eval(sr.ecfg, scale)
        return stage_eval(sr.out / key, sr.validation(), sr.plans, ecfg, sr.cfg.device), shrunk

    for key, label in MODELS:
        sr.evals[key] = sr.run_stage(f"eval-{key}", f"{label}: sequential + {len(sr.plans)} plans",
                                     sr.stage_settings(f"eval-{key}")[0], lambda scale, key=key: run(key, scale),
                                     same_as=None if key == MODELS[0][0] else f"eval-{MODELS[0][0]}")


def cost(name: str, pre: Preset, plans: list[str], pr, ecfg) -> StageCost:
    """An eval-* stage's predicted seconds on the box the probe `pr` measured: the teacher-forced windows of the
    sequential model and every plan, the warm-up rounds (fixed), and the generations and timed rounds shrink_eval
    sets at a scale (AR Match also decodes each fused plan's reference model)."""
    from snlp.bench.budget import StageCost

    w, tok = pr.window_s, pr.decode_token_s
    W = max(1, ecfg.max_tokens // ecfg.seq_len)
    rows = 1 + len(plans)  # sequential + every plan
    tf = W * w * (1 + sum(plan_factor(p, pre.depth) for p in plans))  # teacher forced
    # AR Match / EmbSim generations: each token a forward over the whole prefix (the paper's loop,
    # protocol.recomputed_greedy), the prompts batched. A row's token costs about plan_factor times the sequential
    # row's, which costs AR_TOKEN decode steps (FULL shape, one thread, loaded 2-core box: 4.7 ms sequential, 5.6 ms
    # 12xF1-h0-K1, 10.7 ms K2, 16.2 ms K4, 9.2 ms 12xF1-fwd-K1, 22.3 ms the 6xF2-h0-K6 reference, against a 6.6 ms
    # decode step; the grid's rows came to 87 ms per prompt and token, priced 81 ms, where one decode step per row
    # priced 59 ms)
    gen = AR_TOKEN * (1 + sum(plan_factor(r, pre.depth) for r in ar_rows(plans)))

    def knobs(e) -> float:  # the generations and the timed rounds
        return (e.prompts * e.gen_tokens * gen + e.runs * e.time_tokens * rows) * tok

    # fixed: the warm-up rounds (at least one: protocol.time_plans checks each plan's cached decode there)
    return StageCost(name, 3 + tf + max(ecfg.warmup, 1) * ecfg.time_tokens * tok * rows, knobs(ecfg),
                     min_scale=floor_scale(((ecfg.prompts, EVAL_FLOORS["prompts"]), (ecfg.runs, EVAL_FLOORS["runs"]))),
                     vary=lambda s: knobs(shrink_eval(ecfg, s)[0]))

"""Stages `ssd-noreg`, `ssd-idn`: self-speculative decoding with the drafter `snlp tune` picks, its cost and its shrink
rule."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from snlp.apps.report import MODELS
from snlp.apps.speedrun.common import fewer, floor_scale, shrink_text
from snlp.apps.speedrun.evaluate import eval_records
from snlp.apps.speedrun.preset import BLOCKS, Preset, SELECT_BLOCK
from snlp.bench.stats import fewest_sign_rounds, tie_mark
from snlp.runtime.fmt import matches

if TYPE_CHECKING:
    from snlp.bench.budget import StageCost
    from snlp.apps.speedrun.job import Speedrun


SPEC_TOKEN = 0.5  # a speculative decode's cost per token relative to sequential's (drafting plus verification)


def select_drafter(records: list, block: int = SELECT_BLOCK) -> tuple[object | None, list[tuple[str, float]]]:
    """The proxy drafter rule (module docstring; the speedrun drafts with tune_drafter's measured pick and
    records this one next to it): the EvalRecord maximising ideal_ssd_speedup(Top-1, B,
    speedup) among plans that did not diverge; returns (record or None, [(plan, predicted speedup)])."""
    from snlp.decode.speculative import ideal_ssd_speedup

    scored = []
    for r in records:
        if r.is_sequential or r.note or r.top1 is None or not r.speedup:
            continue
        scored.append((r, ideal_ssd_speedup(float(r.top1), block, float(r.speedup))))
    best = max(scored, key=lambda t: t[1])[0] if scored else None
    return best, [(r.plan, v) for r, v in scored]


def tune_drafter(model, val: torch.Tensor, eval_records: list, preset: Preset, seed: int, block: int = SELECT_BLOCK):
    """The drafter by measurement (snlp.bench.tune) for draft block `block` (the report's headline B, at which the
    proxy rule compares plans too): stage 1 reuses the eval stage's Top-1 / dPPL of every plan (no second
    teacher-forced pass), measures each plan's SSD acceptance profile (a short greedy speculative decode) and times
    the decode steps once (cached single-token steps, the verifier over B+1 positions) to predict each plan;
    stage 2 decodes the preset.tune_top best predictions in ONE round-robin after one sequential baseline
    (snlp.decode.speculative.speculative_shootout), preset.tune_repeats rounds, and the best MEASURED one is the pick
    where the paired rounds resolve its lead (snlp.bench.tune.pick: else the best stage-1 prediction among those
    they do not separate from it, the best measured where those predictions are within 2 % of each other). One block, not the best
    of B = 2, 4, 8: the stage-2 budget then buys more prompts and rounds for the choice the report headlines
    (a pick made at B = 8, or on one prompt and one round, drafted the B = 4 row with a slower plan)."""
    from snlp.bench.tune import TuneConfig, quality_from_records, tune

    quality = {p: q for p, q in quality_from_records(eval_records).items() if not q.note and q.top1 is not None}
    if not quality:
        return None
    cfg = TuneConfig(plans=list(quality), blocks=(block,), top=preset.tune_top, prompts=preset.tune_prompts,
                     prompt_len=preset.eval_prompt_len, gen_tokens=preset.tune_tokens, repeats=preset.tune_repeats,
                     warmup=1, step_runs=20, accept_tokens=preset.tune_accept_tokens, seed=seed + 2)
    return tune(model, val, cfg, quality=quality)


def tune_rows(result) -> list[dict]:
    """The stage record's candidate rows: every measured candidate, then the next best predictions (the table)."""
    keys = ("plan", "block", "top1", "accept_alpha", "s", "ideal_ssd_speedup", "predicted_tokens_per_round",
            "predicted_speedup", "measured", "tokens_per_round", "measured_speedup", "round_speedups", "noise", "alpha",
            "matches_sequential")
    rows = sorted((c for c in result.candidates if c.goal == "ssd"), key=lambda c: (not c.measured,
                                                                                    -c.predicted_speedup))
    return [{k: getattr(c, k) for k in keys} | {"pick": c is result.picks["ssd"]} for c in rows[:8]]


SSD_FLOORS = dict(ssd_prompts=3, ssd_repeats=fewest_sign_rounds(), tune_prompts=2, tune_tokens=16)  # what shrink_ssd
# never goes below: a median of one round of one prompt is noise (at 1-3 prompts and 1-2 rounds a one-prompt
# measurement picked a slower drafter and the SSD rows swung by 0.3x); 16 tokens leave a decode at B = 4 three full
# rounds. The SSD rounds keep the fewest at which the report's sign test can tell SSD from sequential decoding (6):
# at 2 (the old floor) or 3 (the old default) every Measured of the table was a tie by construction.
# tune's shootout rounds never shrink: fewer than snlp.bench.stats.fewest_sign_rounds() (6) and no lead can pass the
# pick's sign test, so the best prediction would pick whatever was measured; its decodes get shorter instead.
# Floors bound shrinking only: they never raise a preset's value (--quick's 2 SSD prompts stay 2: a smoke test,
# docs/speedrun.md)
SSD_KNOBS = ("ssd_prompts", "ssd_repeats", "tune_prompts", "tune_tokens")


def shrink_ssd(pre: Preset, scale: float) -> tuple[Preset, str]:
    """An ssd-* stage at `scale`: fewer prompts and timed rounds of the benchmark, fewer prompts and shorter decodes
    of tune's brief measurement (its rounds stay: they decide whether a lead resolves), never below SSD_FLOORS; the
    plans tune considers and the blocks stay."""
    new = dataclasses.replace(pre, **{k: fewer(getattr(pre, k), scale, lo) for k, lo in SSD_FLOORS.items()})
    return new, shrink_text([(k.replace("_", " "), getattr(pre, k), getattr(new, k)) for k in SSD_KNOBS])


def stage_ssd(model_dir: Path, val: torch.Tensor, eval_records: list, preset: Preset, seed: int,
              device: str, blocks=BLOCKS) -> dict:
    """SSD with the drafter `snlp tune` picks by measurement (tune_drafter), then measured at every B by
    snlp.decode.speculative.speculative_benchmark: a warm-up of both sides, then preset.ssd_repeats rounds, each
    decoding every prompt sequentially and at each B (interleaved, so load changes hit every row
    alike), counters summed over the prompts; the rows hold the medians over the rounds. The proxy rule
    (`select_drafter`) is recorded next to it for comparison."""
    from snlp.io.checkpoint import load
    from snlp.eval.data import sample_prompts
    from snlp.decode.speculative import speculative_benchmark

    proxy, scored = select_drafter(eval_records)
    model, _ = load(model_dir, device=device)
    tuned = tune_drafter(model, val, eval_records, preset, seed)
    pick = tuned.picks["ssd"] if tuned is not None else None
    # what the choice found, kept whether or not it picked: a stage without a drafter still reports tune's candidates,
    # its rule's verdict, its time and the proxy rule's plan
    chose = {"proxy_drafter": proxy.plan if proxy else None, "candidates": scored}
    if tuned is not None:
        chose.update({"tune": tune_rows(tuned), "pick_rule": tuned.pick_rule.get("ssd", ""),
                      "pick_tie": tuned.pick_tie.get("ssd"),
                      "tune_notes": list(tuned.notes), "tune_s": tuned.stage1_s + tuned.stage2_s,
                      "tune_prompts": preset.tune_prompts, "tune_accept_tokens": preset.tune_accept_tokens,
                      "tune_repeats": preset.tune_repeats,
                      "tune_tokens": preset.tune_tokens,  # stage 2's greedy tokens per prompt: they cap Meas. tok/rnd
                      "tune_clock": tuned.costs[0].clock if tuned.costs else None})
    if pick is None:
        print(f"no drafter (snlp tune): {chose.get('pick_rule') or 'no plan has an evaluation to predict from'} "
              f"(proxy rule: {chose['proxy_drafter']})")
    else:
        print(f"drafter (snlp tune): {pick.plan} B={pick.block}: predicted {pick.predicted_speedup:.2f}x, measured "
              f"{pick.measured_speedup:.2f}x{tie_mark(pick.round_speedups)} (proxy rule: {chose['proxy_drafter']}); "
              f"tune took {chose['tune_s']:.0f} s; {chose['pick_rule']}")
    for note in tuned.notes if tuned is not None else ():  # e.g. the pick is slower than sequential: pick_rule alone
        print(f"snlp tune: {note}")  # never says so
    if pick is None:
        return {"drafter": None, **chose, "rows": []}
    plan = pick.plan
    prompts = sample_prompts(val, preset.ssd_prompts, preset.eval_prompt_len, seed + 1)
    G = preset.ssd_tokens
    rows, _ = speculative_benchmark(model, prompts, plan, blocks, G, repeats=preset.ssd_repeats, warmup=1,
                                    progress=True)
    for rep in rows:
        print(ssd_line(rep))
    return {"drafter": plan, "drafter_block": pick.block, "drafter_top1": pick.top1, **chose,
            "prompts": len(prompts), "gen_tokens": G,
            "repeats": preset.ssd_repeats, "sequential_ms_per_token": rows[0].sequential_ms_per_token,
            "rows": [r.to_dict() for r in rows]}


def ssd_line(rep) -> str:
    """The console line of one SSD row (snlp.decode.speculative.SSDRow): its medians, and whether the paired rounds
    resolve its measured speedup from sequential decoding by the report's sign test (the report marks the rest
    "(tie)"; the line printed "measured 1.08x" for a row whose rounds ran 0.92-1.30x)."""
    from snlp.bench.stats import paired_verdict

    verdict, wins, _, _ = paired_verdict(rep.round_speedups)
    said = {"faster": "faster than sequential", "slower": "slower than sequential",
            "tie": "not told from sequential"}[verdict]

    def f(x, fmt: str, unit: str = "") -> str:  # None: nothing drafted (SSDRow), not measured
        return "not measured" if x is None else format(x, fmt) + unit

    return (f"B={rep.block}: alpha {f(rep.alpha, '.3f')}, {rep.tokens_per_round:.2f} tok/round, "
            f"s {f(rep.drafter_speedup_s, '.2f')}, ideal SSD {f(rep.ideal_ssd_speedup, '.2f', 'x')}, measured "
            f"{rep.measured_speedup:.2f}x (medians of {rep.repeats}; {said}: faster in {wins} of "
            f"{len(rep.round_speedups)} paired rounds, a two-sided sign test at 5 %), output "
            f"{matches(rep.matches_sequential, '==', '!=')} sequential")


def step_ssd(sr: Speedrun) -> None:
    pre = sr.preset

    def run(key, scale):
        p, shrunk = shrink_ssd(pre, scale)
        return stage_ssd(sr.out / key, sr.validation(), eval_records(sr.evals[key]), p, sr.cfg.seed,
                         sr.cfg.device), shrunk

    for key, label in MODELS:
        sr.run_stage(f"ssd-{key}", f"{label}: self-speculative decoding with the best drafter, B = "
                      f"{','.join(map(str, BLOCKS))}", sr.stage_settings(f"ssd-{key}")[0],
                      lambda scale, key=key: run(key, scale),
                      same_as=None if key == MODELS[0][0] else f"ssd-{MODELS[0][0]}")  # equal samples


def cost(name: str, pre: Preset, plans: list[str], pr) -> StageCost:
    """An ssd-* stage's predicted seconds. snlp tune at one block (tune_drafter): stage 1 = each plan's acceptance
    decode on every tune prompt + the step timing (20 rounds of every step); stage 2 = per timed round and prompt,
    sequential + the top plans (one round-robin), plus a warm-up on one prompt; the benchmark likewise with every B
    of BLOCKS. The prompts and rounds are what shrink_ssd sets at a scale."""
    from snlp.bench.budget import StageCost

    tok = pr.decode_token_s
    bench_tok = pre.ssd_tokens * tok * (1 + len(BLOCKS) * SPEC_TOKEN)

    def knobs(p) -> float:  # stage 2's warm-up decodes p.tune_tokens too, so it shrinks with them
        tune2_tok = p.tune_tokens * tok * (1 + p.tune_top * SPEC_TOKEN)
        return (len(plans) * p.tune_prompts * p.tune_accept_tokens * tok * 2 + (p.tune_repeats * p.tune_prompts + 1)
                * tune2_tok + p.ssd_repeats * p.ssd_prompts * bench_tok)

    fixed = 3 + 20 * (2 * len(plans) + 1) * tok + bench_tok  # step timing, the benchmark's warm-up
    return StageCost(name, fixed, knobs(pre), min_scale=floor_scale([(getattr(pre, k), lo) for k, lo in SSD_FLOORS.items()]),
                     vary=lambda s: knobs(shrink_ssd(pre, s)[0]))

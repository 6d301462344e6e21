"""The budget's view of the stages: each budgeted stage's predicted seconds on the box the probe measured, from
the cost model beside its shrink rule in the stage's own module (snlp.bench.budget plans with them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from snlp.apps.report import MODELS
from snlp.apps.speedrun import diagnostics, early_exit, evaluate, off_the_shelf, ssd
from snlp.apps.speedrun.preset import Preset

if TYPE_CHECKING:
    from snlp.bench.budget import StageCost


# The budget (snlp.bench.budget): fixed seconds outside the planned stages (REPORT_S, train.TRAIN_OVERHEAD_S), and
# each stage's cost model in units the probe measures (a training step, a teacher-forced window, a cached decode token). The counts come
# from the preset; the factors are coarse (a K-iteration plan's teacher-forced pass ~ 0.25 + 0.75 K windows at
# N = 3L/4; a speculative decode ~ half a sequential one per token; the off-the-shelf model ~ OTS_*_RATIO times
# ours), set so that the probe on a loaded 2-core box (load 2-3: window 68 ms, decode 11 ms/token) predicts the
# stage times an idle run recorded on 2026-11-24 (when these were set, commit 81ed552) within ~1.5x (eval 72 s,
# off-the-shelf ~185 s without its now cached conversion and data, SSD 78 s); while the run goes, overruns correct them (BudgetPlan.drift). Each
# stage's shrinkable part is the cost of exactly the knobs its shrink_* sets at a scale (whole prompts and rounds,
# rounded as shrink_* rounds them); what shrink_* never changes (warm-up rounds, the off-the-shelf timing rounds,
# teacher-forced windows) is in the fixed part.
REPORT_S = 5.0  # writing the report, its plot and the records (fixed, after the last stage)


def stage_costs(pre: Preset, plans: list[str], order: list[str], pr, ecfg, ots_convert: bool = False,
                ots_tokenise: bool = False) -> list[StageCost]:
    """Each budgeted stage of `order` (snlp.bench.budget.StageCost) on the box the probe `pr` measured: a fixed part
    and the cost of the knobs its shrink rule sets at a scale (`vary`: prompts, rounds, repeats, the adaptation's
    minutes), down to the scale where they all sit at their floors (`min_scale`). `ots_convert` / `ots_tokenise`:
    OUT/cache lacks the converted off-the-shelf model / its tokenised data (a fresh run)."""
    out = {f"eval-{k}": evaluate.cost(f"eval-{k}", pre, plans, pr, ecfg) for k, _ in MODELS}
    out["early-exit"] = early_exit.cost(pre, pr, ecfg)
    out["off-the-shelf"] = off_the_shelf.cost(pre, pr, ots_convert, ots_tokenise)
    out["diagnostics"] = diagnostics.cost(pre, pr)
    out.update({f"ssd-{k}": ssd.cost(f"ssd-{k}", pre, plans, pr) for k, _ in MODELS})
    return [out[n] for n in order if n in out]

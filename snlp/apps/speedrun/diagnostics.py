"""Stage `diagnostics`: per-layer Jacobian diagnostics of both models' suffix, its cost and its shrink rule."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch


from snlp.apps.speedrun.common import fewer, floor_scale, shrink_text
from snlp.apps.speedrun.preset import Preset, suffix_depth

if TYPE_CHECKING:
    from snlp.bench.budget import StageCost
    from snlp.apps.speedrun.job import Speedrun


DIAG_SETUP_ITERS = 18  # diagnostics: each suffix layer's set-up costs about as much as 18 of its iterations


DIAG_FLOORS = dict(diag_power_iters=3, diag_probes=2)  # what shrink_diagnostics never goes below


def shrink_diagnostics(pre: Preset, scale: float) -> tuple[Preset, str]:
    new = dataclasses.replace(pre, **{k: fewer(getattr(pre, k), scale, lo) for k, lo in DIAG_FLOORS.items()})
    return new, shrink_text([("power iterations", pre.diag_power_iters, new.diag_power_iters),
                         ("probes", pre.diag_probes, new.diag_probes)])


def stage_diagnostics(model_dirs: dict[str, Path], val: torch.Tensor, preset: Preset, device: str) -> dict:
    """A short `snlp analyze` per model: the Jacobian diagnostics of the suffix the plans use, as markdown."""
    from snlp.eval.analysis.common import AnalysisConfig
    from snlp.eval.analysis.report import analyze, report_section
    from snlp.io.checkpoint import load

    cfg = AnalysisConfig(only=("jacobian",), seq_len=preset.seq_len, jac_suffix=suffix_depth(preset.depth),
                         jac_windows=1, power_iters=preset.diag_power_iters, probes=preset.diag_probes, progress=False)
    out = {}
    for name, d in model_dirs.items():
        model, _ = load(d, device=device)
        out[name] = report_section(analyze(model, val, cfg, checkpoint=str(d)))
    return {"markdown": out, "power_iters": cfg.power_iters, "probes": cfg.probes}


def step_diagnostics(sr: Speedrun) -> None:
    pre = sr.preset

    def run(scale):
        p, shrunk = shrink_diagnostics(pre, scale)
        return stage_diagnostics(sr.model_dirs(), sr.validation(), p, sr.cfg.device), shrunk

    sr.run_stage("diagnostics", f"Jacobian diagnostics of the last {sr.cfg.reg_n} layers (snlp analyze)",
                 sr.stage_settings("diagnostics")[0], run)


def cost(pre: Preset, pr) -> StageCost:
    """The diagnostics stage's predicted seconds: each suffix layer's set-up (fixed) and the power iterations and
    probes shrink_diagnostics sets at a scale, each a JVP / VJP over the suffix of both models."""
    from snlp.bench.budget import StageCost

    L = pre.depth
    iter_s = suffix_depth(L) * 3 * pr.window_s / L  # one power iteration or probe over the suffix of both models
    return StageCost(
        "diagnostics", 3 + DIAG_SETUP_ITERS * iter_s, (pre.diag_power_iters + pre.diag_probes) * iter_s,
        min_scale=floor_scale(((pre.diag_power_iters, DIAG_FLOORS["diag_power_iters"]),
                               (pre.diag_probes, DIAG_FLOORS["diag_probes"]))),
        vary=lambda s: iter_s * sum(getattr(shrink_diagnostics(pre, s)[0], k) for k in DIAG_FLOORS))

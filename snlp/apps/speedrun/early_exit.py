"""Stage `early-exit`: K = 0 PPL with the last N layers skipped, and its cost (nothing shrinks)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from snlp.apps.speedrun.preset import Preset


if TYPE_CHECKING:
    from snlp.bench.budget import StageCost
    from snlp.apps.speedrun.job import Speedrun


def early_exit_suffixes(L: int) -> list[int]:
    return sorted({max(1, L // 4), L // 2, (3 * L) // 4} - {0})


def stage_early_exit(model_dirs: dict[str, Path], val: torch.Tensor, suffixes: list[int], ecfg, device: str) -> dict:
    from snlp.eval.analysis.earlyexit import early_exit
    from snlp.io.checkpoint import load

    out = {}
    for name, d in model_dirs.items():
        model, _ = load(d, device=device)
        rows = early_exit(model, val, suffixes, ecfg)
        print(f"{name}: " + ", ".join(f"N={r.N}: {r.ppl:.2f}" for r in rows))
        out[name] = [dataclasses.asdict(r) for r in rows]  # the stage record is JSON
    return {"rows": out}


def step_early_exit(sr: Speedrun) -> None:
    suffixes = early_exit_suffixes(sr.cfg.depth)
    sr.run_stage("early-exit", f"K=0 PPL skipping the last N = {suffixes} layers",
                 sr.stage_settings("early-exit")[0],
                 lambda scale: (stage_early_exit(sr.model_dirs(), sr.validation(), suffixes, sr.ecfg, sr.cfg.device),
                                ""))


def cost(pre: Preset, pr, ecfg) -> StageCost:
    """The early-exit stage's predicted seconds: two windows' worth per suffix and model over the evaluation tokens;
    nothing shrinks."""
    from snlp.bench.budget import StageCost

    W = max(1, ecfg.max_tokens // ecfg.seq_len)
    return StageCost("early-exit", 2 + 2 * len(early_exit_suffixes(pre.depth)) * W * pr.window_s, min_scale=1.0)

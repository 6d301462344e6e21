"""Validation during training: the held-out CE and the measured K=1 SNLP gap, as a typed record."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

from snlp.method.plan import Plan
from snlp.method.solver import solve
from snlp.model.gpt import GPT
from snlp.train.regularizer import RegConfig, snlp_gap


@dataclass
class ValidationResult:
    """One validation: mean CE over the fixed validation batches, the K=1 SNLP gap per suffix length N and,
    when a plan was given, the CE of that plan's SNLP logits."""

    loss: float
    gaps: dict[int, float] = field(default_factory=dict)  # N -> measured K=1 final-state relative error
    loss_plan: float | None = None

    @property
    def ppl(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf  # math.exp overflows past ~709

    def record(self) -> dict:
        """The log.jsonl entry (val_loss, val_loss_plan, gap_N<n>): the keys readers of training logs
        (snlp speedrun, the docs' tables) know."""
        return {"val_loss": self.loss, **({"val_loss_plan": self.loss_plan} if self.loss_plan is not None else {}),
                **{f"gap_N{n}": g for n, g in self.gaps.items()}}

    def __str__(self) -> str:
        return " ".join(f"{k} {v:.4f}" for k, v in self.record().items())


@torch.no_grad()
def validate(model: GPT, batches, device, autocast: Callable[[], ContextManager], suffixes,
             reg: RegConfig | None = None, plan: Plan | None = None) -> ValidationResult:
    """Validation CE (targets == -1 ignored), the measured K=1 SNLP gap (final-state relative error)
    per suffix N with the regulariser's surrogate (IDN without one) and, with `plan`, the CE of the SNLP
    logits of that plan. `autocast`: a context factory (snlp.train.precision.autocast_context)."""
    reg = reg or RegConfig()
    was = model.training
    model.eval()
    ce, ce_plan, gaps = 0.0, 0.0, {n: 0.0 for n in suffixes}
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast():
            ce += float(model(x, y))
            if plan is not None:
                lg = model.head(solve(model, x, plan, check_finite=False).hidden)
                ce_plan += float(F.cross_entropy(lg.view(-1, lg.size(-1)), y.reshape(-1), ignore_index=-1))
            for n in suffixes:
                gaps[n] += snlp_gap(model, x, reg.plan(n))
    model.train(was)
    k = len(batches)
    return ValidationResult(loss=ce / k, gaps={n: g / k for n, g in gaps.items()},
                            loss_plan=ce_plan / k if plan is not None else None)

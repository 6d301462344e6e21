"""Validation during training: the held-out CE and the measured K=1 SNLP gap, as a typed record."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

from snlp.method.plan import Plan
from snlp.method.solver import solve
from snlp.model.gpt import GPT, eval_mode
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
        return " ".join(f"{k} {v:.4f}" if v is not None else f"{k} -" for k, v in self.record().items())


def row_slices(n: int, rows: int | None) -> list[slice]:
    """The slices of a batch of `n` rows that validation runs one forward each on: at most `rows` rows (a DDP run's
    per-process batch, while its validation batches hold the global batch's rows); None: all n in one."""
    step = n if rows is None else max(1, min(rows, n))
    return [slice(i, i + step) for i in range(0, n, step)]


@torch.no_grad()
def validate(model: GPT, batches, device, autocast: Callable[[], ContextManager], suffixes,
             reg: RegConfig | None = None, plan: Plan | None = None, rows: int | None = None) -> ValidationResult:
    """Validation CE (targets == -1 ignored), the measured K=1 SNLP gap (final-state relative error)
    per suffix N with the regulariser's surrogate (IDN without one) and, with `plan`, the CE of the SNLP
    logits of that plan. `autocast`: a context factory (snlp.train.precision.autocast_context). `rows`: the most
    rows one forward runs (a DDP run's per-process batch: its validation batches hold the global batch's rows, and
    one forward of them all would hold P times the (rows, T, V) logits training needs); each batch's CE and gaps
    are then its slices' means weighted by their targets / positions, the batch's own token means. None: whole."""
    reg = reg or RegConfig()
    # a batch's CE is the mean over its targets (-1 ignored): a batch with none has no CE (0/0, the NaN the loss
    # logged), so the CE averages over the batches that have targets, and batches with none at all are refused
    scored = sum(int((yb != -1).sum()) > 0 for _, yb in batches)
    if batches and not scored:
        raise ValueError(f"none of the {len(batches)} validation batches has a target (every target is -1, "
                         f"ignored): the validation loss over no token is undefined")
    ce, ce_plan, gaps = 0.0, 0.0, {n: 0.0 for n in suffixes}
    # the training loop's model leaves in the modes it came in (each submodule's own), an exception too
    with eval_mode(model):
        for xb, yb in batches:
            cuts = row_slices(xb.size(0), rows)
            n_ce = max(int((yb != -1).sum()), 1)
            for cut in cuts:
                x, y = xb[cut], yb[cut]
                # each slice's share of the batch's targets (CE; one forward: 1, or 0 for a batch without any) and
                # positions (gaps)
                w_ce, w_pos = int((y != -1).sum()) / n_ce, x.size(0) / xb.size(0)
                x, y = x.to(device), y.to(device)
                with autocast():
                    if w_ce > 0:  # a slice without targets: its CE mean is 0/0 and weighs nothing
                        ce += float(model(x, y)) * w_ce
                    if plan is not None and w_ce > 0:
                        lg = model.head(solve(model, x, plan, check_finite=False).hidden)
                        ce_plan += float(F.cross_entropy(lg.view(-1, lg.size(-1)), y.reshape(-1),
                                                         ignore_index=-1)) * w_ce
                    for n in suffixes:
                        gaps[n] += snlp_gap(model, x, reg.plan(n)) * w_pos
    k = len(batches)
    return ValidationResult(loss=ce / scored, gaps={n: g / k for n, g in gaps.items()},
                            loss_plan=ce_plan / scored if plan is not None else None)

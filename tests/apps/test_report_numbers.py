"""Numbers the speedrun report prints in its sentences, recomputed here from the records the sentence reads (outside
the report code): each test builds the smallest records that reach the sentence."""

import re

from snlp.apps.report import model_gap
from snlp.eval.protocol import EvalRecord


def _model(speedups: dict[str, list[float]]) -> list[EvalRecord]:
    """One model's records: the sequential row first, then a plan per entry with its paired per-round ratios."""
    return [EvalRecord(plan="sequential", ppl=10.0, latency_ms=2.0)] + [
        EvalRecord(plan=p, ppl=10.0, speedup_rounds=r) for p, r in speedups.items()]


def test_the_two_models_speedup_gap_does_not_depend_on_which_model_is_which():
    """A run's records held one plan at 1.40x (No Reg.) and 1.94x (IDN Reg.), 1.94 / 1.40 = 1.39, and the report
    said the two models' medians "differ by up to 28%": the gap was taken relative to IDN Reg.'s median, so the same
    two medians swapped between the models read 38%. The gap is now the larger median over the smaller, as the
    report's other "apart" figures are, and the same whichever model ran faster."""
    slow, fast = [1.30, 1.40, 1.50], [1.84, 1.94, 2.04]  # medians 1.40 and 1.94
    want = 1.94 / 1.40 - 1  # 38.6 %
    for noreg, idn in ((slow, fast), (fast, slow)):
        text = model_gap({"noreg": _model({"6xF1-fwd-K1": noreg}), "idn": _model({"6xF1-fwd-K1": idn})})
        got = re.search(r"differ by up to (\d+)%", text)
        assert got and int(got.group(1)) == round(100 * want), text

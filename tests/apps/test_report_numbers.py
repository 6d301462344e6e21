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


def test_a_share_below_one_never_prints_as_the_sequential_100_percent():
    """A plan whose argmax differed from sequential at 1 of 2,048 positions (Top-1 0.99951) printed "100.0%", the
    cell of sequential itself and of an exact plan, in `snlp eval`'s table and the report's main table. The cell
    now carries the decimals that keep it below 100 %, and an exact plan keeps "100.0%"."""
    from snlp.apps.report import main_table
    from snlp.eval.present import markdown_table

    near, exact = 2047 / 2048, 1.0
    seq = EvalRecord(plan="sequential", ppl=10.0, top1=1.0, ar_match=1.0, S=4, n_layer=4, gen_tokens=16)
    recs = [seq, EvalRecord(plan="4xF1-h0-K2", ppl=10.0, top1=near, K=2, S=0, C=4, M=1, n_layer=4, ar_match=1.0,
                            gen_tokens=16),
            EvalRecord(plan="4xF1-h0-K4", ppl=10.0, top1=exact, K=4, S=0, C=4, M=1, n_layer=4, ar_match=1.0,
                       gen_tokens=16)]
    # 2047 / 2048 = 0.999512: one decimal rounds onto 100.0, two keep it below (99.95)
    for text in (markdown_table(recs), main_table({"noreg": recs, "idn": recs}, {"noreg": None, "idn": None})):
        near_rows = [line for line in text.splitlines() if line.startswith("|") and "99.95%" in line]
        assert near_rows and all("4xF1-h0-K2" in r or ("`4xF1-h0`" in r and "| 2 |" in r) for r in near_rows), text
    assert "| 100.0% |" in markdown_table(recs).split("| 4xF1-h0-K4 |")[1].splitlines()[0]  # the exact plan


def test_fmt_share_keeps_a_share_off_its_ends_only_from_inside():
    from snlp.runtime.fmt import fmt_share

    assert [fmt_share(x) for x in (1.0, 0.0, 0.933, 2047 / 2048, 1 / 3000, None)] == [
        "100.0%", "0.0%", "93.3%", "99.95%", "0.03%", "-"]
    assert fmt_share(0.9999996) == "99.99996%" and fmt_share(0.5, sep=" ") == "50.0 %"

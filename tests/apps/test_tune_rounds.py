"""`snlp tune`'s shootout decides its pick by a two-sided sign test over paired rounds; at 3 rounds no split can pass
it (3 of 3: p = 0.25), so the best prediction always picked. tune now times the fewest rounds at which a lead can
resolve, in the speedrun too, whose budget pays for them with shorter decodes, not with training."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import binomtest

from snlp.apps.speedrun.preset import FULL, QUICK
from snlp.apps.speedrun.ssd import SSD_FLOORS, shrink_ssd
from snlp.bench.stats import SIGN_LEVEL, fewest_sign_rounds
from snlp.bench.tune import Candidate, TuneConfig, pick


def test_the_fewest_rounds_that_can_resolve_a_lead():
    """Outside reference: scipy's exact binomial test, two-sided as the code's."""
    n = fewest_sign_rounds()
    assert binomtest(n, n, 0.5).pvalue < SIGN_LEVEL <= binomtest(n - 1, n - 1, 0.5).pvalue
    assert n == 6


def test_tune_times_enough_rounds_and_the_speedrun_pays_with_shorter_decodes():
    n = fewest_sign_rounds()
    assert TuneConfig().repeats >= n and FULL.tune_repeats >= n and QUICK.tune_repeats >= n
    for scale in (1.0, 0.7, 0.4, 0.1, 0.01):  # a budget shrinks the decodes and prompts, never the rounds
        assert shrink_ssd(FULL, scale)[0].tune_repeats == FULL.tune_repeats
    at_floor, what = shrink_ssd(FULL, 0.01)
    assert at_floor.tune_tokens == SSD_FLOORS["tune_tokens"] < FULL.tune_tokens and "tune tokens" in what
    # stage 2 decodes no more tokens per prompt than the 3 rounds of 64 it timed before: the time the added rounds
    # take comes from the rounds' length, so nothing else (training) pays for them
    assert FULL.tune_repeats * FULL.tune_tokens <= 3 * 64


def _cand(plan, rounds, pred):
    return Candidate(goal="ssd", plan=plan, block=4, threads=1, compiled=False, top1=0.9, delta_ppl=0.0,
                     accept_alpha=0.9, predicted_tokens_per_round=4.5, s=1.5, predicted_speedup=pred,
                     predicted_tokens_per_s=pred * 100, measured=True, measured_speedup=sorted(rounds)[len(rounds) // 2],
                     round_speedups=list(rounds), noise=0.05, tokens_per_s=100 * sorted(rounds)[len(rounds) // 2],
                     alpha=0.9, matches_sequential=True)


@pytest.mark.parametrize("n", [3, 6])
def test_a_lead_won_in_every_round_resolves_only_from_six_rounds(n):
    """The same lead, won in every round: at 3 rounds a tie (the better prediction picks), at 6 the best measured."""
    fast = _cand("12xF1-h0-K2", [1.32, 1.33, 1.30, 1.31, 1.34, 1.29][:n], pred=1.28)
    slow = _cand("6xF2-h0-K2", [1.16, 1.17, 1.15, 1.18, 1.16, 1.15][:n], pred=1.32)
    chosen, rule = pick([fast, slow])
    if n < fewest_sign_rounds():
        assert chosen is slow and rule.startswith("tie") and f"no split of {n} rounds resolves a lead" in rule
    else:
        assert chosen is fast and "which the rounds resolve" in rule and "from 6 of 6 rounds won" in rule


def _beats(a: list[float], b: list[float]) -> bool:
    """Hand reference: a's speedups beat b's in enough of their paired rounds for an exact two-sided binomial test
    at 5 % (ties dropped), by summing the binomial tail directly."""
    from math import comb
    w, lo = sum(x > y for x, y in zip(a, b)), sum(x < y for x, y in zip(a, b))
    n = w + lo
    return n > 0 and w > lo and min(1.0, 2 * sum(comb(n, i) for i in range(w, n + 1)) / 2 ** n) < 0.05


def test_the_pick_is_never_one_the_paired_rounds_resolve_slower_than_another():
    """Bimodal rounds: A's median (5.0x: 11 rounds at 5.0x, 9 at 1.0x) is above B's (4.0x), yet B was faster in 15 of
    the 20 rounds that timed both (p = 0.041): the rounds resolve B's lead, so A is no tie with B to hand to A's
    better prediction, and no line may say that A leads B unresolved."""
    a = _cand("12xF1-h0-K2", [5.0] * 11 + [1.0] * 9, pred=1.5)
    b = _cand("6xF2-h0-K2", [6.0] * 6 + [4.0] * 5 + [2.0] * 9, pred=1.0)
    assert _beats(b.round_speedups, a.round_speedups) and a.tokens_per_s > b.tokens_per_s
    chosen, rule = pick([a, b])
    assert chosen is b, rule
    assert "faster in 15 of 20 paired rounds, which the rounds resolve" in rule and "the higher median is 12xF1-h0-K2 B=4's" in rule


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.sampled_from([0.8, 1.0, 1.2, 1.5, 2.0, 3.0]), min_size=8, max_size=8),
                          st.floats(0.5, 2.0)), min_size=2, max_size=4))
def test_the_pick_is_resolved_slower_than_no_candidate_where_one_such_exists(rounds):
    """Random paired rounds and predictions for 2-4 candidates: where some candidate is beaten by none (hand binomial
    reference), the pick is beaten by none either, whatever the medians and predictions say; a resolved lead the
    rule states is one the reference resolves."""
    cands = [_cand(f"{i + 1}xF1-h0-K1", r, pred=p) for i, (r, p) in enumerate(rounds)]
    beaten = [any(_beats(d.round_speedups, c.round_speedups) for d in cands if d is not c) for c in cands]
    chosen, rule = pick(cands)
    if not all(beaten):
        assert not beaten[cands.index(chosen)], rule
    if "which the rounds resolve" in rule:
        nxt = next(c for c in cands if f"over the next ({c.plan} B=4)" in rule)
        assert _beats(chosen.round_speedups, nxt.round_speedups), rule


def test_a_candidate_beaten_by_another_is_no_tie_to_hand_to_its_prediction():
    """A has the highest median and the best prediction, but C beats it in 15 of 20 paired rounds; B (unbeaten, the
    higher median of the rest) does not resolve a lead over A or C. The tie is B's and C's: A never picks."""
    a = _cand("12xF1-h0-K1", [5.0] * 11 + [1.0] * 9, pred=3.0)
    c = _cand("6xF2-h0-K1", [6.0] * 6 + [4.0] * 5 + [2.0] * 9, pred=1.0)
    b = _cand("4xF3-h0-K1", [4.5] * 11 + [3.0] * 9, pred=1.2)
    assert _beats(c.round_speedups, a.round_speedups)
    assert not any(_beats(x.round_speedups, b.round_speedups) for x in (a, c))
    chosen, rule = pick([a, b, c])
    assert chosen is not a, rule


def test_leads_that_cycle_are_said_and_no_lead_the_rounds_resolve_is_called_unresolved():
    """Intransitive rounds (60 paired rounds, three kinds of 20: A > B > C, B > C > A, C > A > B): by the hand binomial
    reference A beats B, B beats C and C beats A, each in 40 of 60. No candidate is unbeaten; A has the highest
    median. The rule must say that the leads cycle and must never call A's lead over C unresolved: C beats A."""
    a = _cand("12xF1-h0-K1", [3.03] * 20 + [1.01] * 20 + [2.02] * 20, pred=1.0)
    b = _cand("6xF2-h0-K1", [2.0] * 20 + [3.0] * 20 + [1.0] * 20, pred=1.2)
    c = _cand("4xF3-h0-K1", [1.0] * 20 + [2.0] * 20 + [3.0] * 20, pred=3.0)
    r = lambda x: x.round_speedups  # noqa: E731
    assert _beats(r(a), r(b)) and _beats(r(b), r(c)) and _beats(r(c), r(a)) and a.tokens_per_s > c.tokens_per_s
    chosen, rule = pick([a, b, c])
    assert "cycle" in rule and "4xF3-h0-K1 B=4 beats 12xF1-h0-K1 B=4 (faster in 40 of 60 paired rounds)" in rule, rule
    assert "leads 4xF3-h0-K1" not in rule and "faster in 20 of 60" not in rule, rule


def test_a_non_finite_round_excludes_the_candidate_even_where_its_median_is_finite():
    """statistics.median sorts a NaN round anywhere: [1.5, nan, 1.4, 1.6, 1.5, 1.45] gives 1.425, not numpy's nan nor
    1.5, the median of the finite rounds. Such a candidate is a non-finite measurement: never eligible, never a tie
    handed to its prediction."""
    import math
    import statistics
    import numpy as np
    r = [1.5, float("nan"), 1.4, 1.6, 1.5, 1.45]
    assert math.isnan(np.median(r)) and math.isfinite(statistics.median(r))
    a = _cand("12xF1-h0-K1", [2.0] * 6, pred=1.0)
    b = _cand("6xF2-h0-K1", r, pred=1.2)
    b.measured_speedup = statistics.median(r)
    b.tokens_per_s = 100 * b.measured_speedup
    chosen, rule = pick([a, b])
    assert chosen is a and rule.startswith("the only measured candidate"), rule


def test_an_unbeaten_best_that_resolves_no_lead_itself_never_claims_one():
    """A (2.0x every round) is beaten by none and beats none (20 rounds won, 20 lost, 20 equal against each); B, C
    and D beat one another in a cycle (40 of 60 each, hand binomial reference). A is the pick, and the rule must not
    say that the rounds resolve its lead over the next (they do not: 20 of 60)."""
    a = _cand("2xF1-h0-K1", [2.0] * 60, pred=1.0)
    b = _cand("12xF1-h0-K1", [3.0] * 20 + [1.0] * 20 + [2.0] * 20, pred=1.0)
    c = _cand("6xF2-h0-K1", [2.0] * 20 + [3.0] * 20 + [1.0] * 20, pred=1.2)
    d = _cand("4xF3-h0-K1", [1.0] * 20 + [2.0] * 20 + [3.0] * 20, pred=3.0)
    r = lambda x: x.round_speedups  # noqa: E731
    assert _beats(r(d), r(b)) and _beats(r(b), r(c)) and _beats(r(c), r(d))
    assert not any(_beats(r(x), r(a)) or _beats(r(a), r(x)) for x in (b, c, d))
    chosen, rule = pick([a, b, c, d])
    assert chosen is a, rule
    assert "which the rounds resolve" not in rule and "faster in 20 of 60" not in rule, rule
    assert "the only candidate no other one beats" in rule and "beaten by another" in rule, rule

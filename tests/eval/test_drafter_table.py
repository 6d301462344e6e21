"""`snlp eval --drafter`'s table (snlp.eval.drafter.markdown): its SSD speedup column follows the rule of every other
speed table, a ratio its paired rounds do not resolve from 1.00x is marked (tie) where it is printed. The reference is
scipy's exact two-sided binomial test over the rounds faster and slower than sequential."""

import statistics

from scipy.stats import binomtest

from snlp.eval.drafter import DrafterRecord, markdown


def _ssd(block: int, rounds: list[float]) -> dict:
    return dict(block=block, alpha=0.9, tokens_per_round=3.0, measured_speedup=statistics.median(rounds),
                matches_sequential=True, repeats=len(rounds), round_speedups=rounds)


def test_an_ssd_speedup_inside_the_noise_is_marked_a_tie():
    """The table printed "1.13x" from rounds 0.8x-1.5x, faster in 4 of 6, as a gain; it now marks it (tie), says
    under the table what the column is and when the rounds resolve it, and leaves a speedup won in every round
    unmarked."""
    tied = [0.8, 1.5, 1.2, 0.9, 1.3, 1.06]  # 4 of 6 faster
    won = [1.30, 1.35, 1.32, 1.40, 1.31, 1.33]  # 6 of 6 faster
    for rounds, resolved in ((tied, False), (won, True)):
        w, lo = sum(x > 1 for x in rounds), sum(x < 1 for x in rounds)
        assert (binomtest(w, w + lo, 0.5).pvalue < 0.05) == resolved
    rec = DrafterRecord(plan="2xF1-h0-K1", drafter="adapted", ppl=10.0, ppl_base=10.0, top1=0.9, logit_sim=0.99,
                        top1_ssd=0.9, tokens=64, ssd=[_ssd(2, tied), _ssd(4, won)])
    lines = markdown([rec]).splitlines()
    b2, b4 = lines[2], lines[3]
    assert f"| {statistics.median(tied):.2f}x (tie) |" in b2, b2
    assert f"| {statistics.median(won):.2f}x |" in b4, b4
    (note,) = [line for line in lines if line.startswith("(tie)")]
    assert "each tok/s vs seq is the median of those paired ratios" in note and "ratio of the two medians" not in note
    # no round to test (a record written before rows kept them): nothing is marked, and no note
    bare = DrafterRecord(**{**rec.to_dict(), "ssd": [{k: v for k, v in _ssd(2, won).items() if k != "round_speedups"}]})
    assert "(tie)" not in markdown([bare])

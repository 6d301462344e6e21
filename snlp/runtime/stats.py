"""Paired-round statistics for timings (pure Python but the tied rank-sum table, on the runtime floor so that every
floor marks a paired ratio by one rule; snlp.bench.stats re-exports them): the exact two-sided sign test that decides
whether one plan's speed beats another's from rounds that timed both (round-robin, so a round's load hits both
alike); for timings that are not paired, the p10-p90 spreads rule with the rank-sum test (unpaired_verdict;
spread_verdict where only the spreads were kept)."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from functools import lru_cache

SIGN_LEVEL = 0.05  # the two-sided sign test's level at which one plan's speed beats another's


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test: the chance, under equal speed (each round a fair coin), of a split at least as
    lopsided as wins : losses (rounds where the two are equal are left out)."""
    n, k = wins + losses, max(wins, losses)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n)


def sign_test_wins(n: int, level: float = SIGN_LEVEL) -> int | None:
    """The fewest wins of n paired rounds at which the sign test calls one plan faster (None: n rounds never can)."""
    return next((k for k in range((n + 1) // 2, n + 1) if k * 2 > n and sign_test_p(k, n - k) < level), None)


def fewest_sign_rounds(level: float = SIGN_LEVEL) -> int:
    """The fewest paired rounds at which the sign test can call one plan faster at all (every round won): 6 at the
    two-sided 5 % level (6 of 6: p = 2/64; 5 of 5: p = 2/32 = 0.0625)."""
    return next(n for n in range(1, 64) if sign_test_wins(n, level) is not None)


def separation_p(n: int, m: int) -> float:
    """Two-sided exact p of the rank-sum (Mann-Whitney) test when the min-max ranges of n and m unpaired timings do
    not overlap, i.e. every timing of one side beats every timing of the other: 2 / C(n + m, n) (1.0 without
    timings). Separated ranges mean a lead only where this is under the level: 4 rounds each (p = 0.029) or more; 3
    and 3 give 0.1, so a few rounds can look separated by chance."""
    return 1.0 if n < 1 or m < 1 else min(1.0, 2 / math.comb(n + m, n))


@lru_cache(maxsize=64)
def _rank_sum_counts(n: int, m: int) -> tuple[int, ...]:
    """How many of the C(n + m, n) orderings of n and m distinct timings give each U = 0 .. n·m (U: the pairs where
    the n side's timing is the larger): the coefficients of the Gaussian binomial [n + m, n]_q = prod_i (1 - q^(m+i))
    / (1 - q^i), each factor applied in turn (the quotient stays a polynomial after every i)."""
    poly = [1]
    for i in range(1, n + 1):
        k = m + i
        poly = poly + [0] * k  # times (1 - q^k)
        for j in range(len(poly) - 1, k - 1, -1):
            poly[j] -= poly[j - k]
        for j in range(i, len(poly)):  # divided by (1 - q^i)
            poly[j] += poly[j - i]
        poly = poly[:len(poly) - i]
    return tuple(poly[:n * m + 1])


def _rank_sum_tied_counts(values: list[float], n: int) -> list[float]:
    """How many of the C(N, n) ways to take n of the N pooled timings `values` (some equal) as the first side give
    each doubled midrank sum 2·R = 0 .. 2·n·N of that side: the exact null distribution of the rank-sum statistic
    given the ties. A run of g equal timings at ranks r+1 .. r+g has the doubled midrank 2r + g + 1 each, and k of
    them go to the first side in C(g, k) ways; one pass per run of equal timings (numpy over (side count, 2·R))."""
    import numpy as np

    N, hi = len(values), 2 * n * len(values)
    dp = np.zeros((n + 1, hi + 1))  # (first side's count so far, its doubled midrank sum so far)
    dp[0, 0] = 1.0
    ordered, r, top = sorted(values), 0, 0  # top: the largest sum reached so far (the columns past it are 0)
    while r < N:
        g = next((j for j in range(r, N) if ordered[j] != ordered[r]), N) - r
        w = 2 * r + g + 1
        new_top = min(hi, top + min(g, n) * w)
        new = dp.copy()  # k = 0 of this run on the first side
        for k in range(1, min(g, n) + 1):
            if k * w <= new_top:
                span = min(top, new_top - k * w) + 1
                new[k:, k * w:k * w + span] += math.comb(g, k) * dp[:n + 1 - k, :span]
        dp, r, top = new, r + g, new_top
    return dp[n].tolist()


# above this much work, equal timings take the normal limit: the exact table holds (s + 1) x (2sN + 1) entries (s the
# shorter side), one pass over it per distinct timing, ~0.2 s at this bound (80 and 80 timings, 10 and 1,400, 1 and
# 10,000). The normal limit's error goes with the shorter side, not the pairs: within ~1e-3 of the exact p at 50 and
# 50, but 0.08 for the exact 2/2502 of 1 timing above 2,501 (the table there: 0.05 s)
TIED_EXACT_WORK = 400_000_000


def _rank_sum_tied_work(n: int, m: int, distinct: int) -> int:
    """The entries _rank_sum_tied_counts passes over for sides of n and m timings with `distinct` values."""
    s = min(n, m)
    return distinct * (s + 1) * (2 * s * (n + m) + 1)


def _rank_sum_tied_normal_p(a: list[float], b: list[float], u: float) -> float:
    """The two-sided p of U in the normal limit, its variance corrected for the runs of equal timings (each run of
    g subtracts (g^3 - g) / (N (N - 1)) from N + 1) and a continuity correction of 1/2."""
    n, m = len(a), len(b)
    N = n + m
    runs = Counter([*a, *b]).values()
    var = n * m / 12 * ((N + 1) - sum(g ** 3 - g for g in runs) / (N * (N - 1)))
    if var <= 0:  # every timing equal
        return 1.0
    z = max(0.0, abs(u - n * m / 2) - 0.5) / math.sqrt(var)
    return min(1.0, math.erfc(z / math.sqrt(2)))


def rank_sum_p(a: list[float], b: list[float]) -> float:
    """Two-sided exact p of the rank-sum (Mann-Whitney) test of unpaired timings a against b: the chance, were both
    drawn from one distribution, of a split of the n·m pairs at least as lopsided as the one seen (a pair of equal
    timings counts half). With equal timings among the n + m, the null distribution is the one of these very timings
    split every way (_rank_sum_tied_counts): the untied distribution at the half-counted U understates p there, and
    could call a lead (p 0.048) that the splits of the timings themselves do not (p 0.071). 1.0 without timings;
    with every a above every b it is separation_p."""
    n, m = len(a), len(b)
    if n < 1 or m < 1:
        return 1.0
    u = sum((x > y) + 0.5 * (x == y) for x in a for y in b)
    distinct = len(set(a) | set(b))
    if distinct < n + m:  # equal timings: the splits of these timings
        if _rank_sum_tied_work(n, m, distinct) > TIED_EXACT_WORK:  # too big a table: the normal limit
            return _rank_sum_tied_normal_p(a, b, u)
        if n > m:  # the table's rows are the first side's counts: the smaller side (p is symmetric)
            return rank_sum_p(b, a)
        counts = _rank_sum_tied_counts([*a, *b], n)
        r2 = round(2 * u) + n * (n + 1)  # 2·R = 2·U + n(n + 1)
        total = sum(counts)
        return min(1.0, 2 * min(sum(counts[:r2 + 1]), sum(counts[r2:])) / total)
    counts = _rank_sum_counts(n, m)
    total = math.comb(n + m, n)
    low = sum(counts[:math.ceil(u) + 1]) / total  # P(U <= u)
    high = sum(counts[math.floor(u):]) / total  # P(U >= u)
    return min(1.0, 2 * min(low, high))


def paired_verdict(ratios: list[float], level: float = SIGN_LEVEL) -> tuple[str, int, int, float]:
    """("faster" | "slower" | "tie", rounds faster, rounds slower, p) of a method against its baseline from the
    paired per-round ratios baseline time / method time (> 1: the method was faster that round), by the two-sided
    sign test at `level`; rounds that tie exactly are left out."""
    wins, losses = sum(r > 1.0 for r in ratios), sum(r < 1.0 for r in ratios)
    p = sign_test_p(wins, losses)
    return ("tie" if p >= level else "faster" if wins > losses else "slower"), wins, losses, p


def verdict_text(ratios: list[float], baseline: str = "sequential", rounds: str = "runs") -> str:
    """The sentence a report prints for paired_verdict: resolved, or a tie with how far the rounds are from
    resolving it (fewer rounds than fewest_sign_rounds can never resolve anything)."""
    verdict, wins, losses, p = paired_verdict(ratios)
    n, need = len(ratios), fewest_sign_rounds()
    if verdict != "tie":
        return (f"{verdict} than {baseline} in {max(wins, losses)} of {n} paired {rounds} (two-sided sign test "
                f"p = {p:.3f})")
    why = (f"{n} paired {rounds} cannot resolve a lead (the sign test needs {need} of {need} at the fewest)" if n < need else
           f"the two-sided sign test at {SIGN_LEVEL:.0%} does not resolve it, p = {p:.2f}")
    return f"a tie with {baseline}: faster in {wins} of {n} paired {rounds}; {why}"


def paired_marks(ratios: list[float] | None) -> dict:
    """The JSON fields a paired ratio carries beside its median: paired_verdict's verdict ("faster" | "slower" |
    "tie"), wins, losses and p over the per-round ratios; every field None where there are no rounds (the baseline's
    own row)."""
    if not ratios:
        return {"verdict": None, "wins": None, "losses": None, "p": None}
    verdict, wins, losses, p = paired_verdict(ratios)
    return {"verdict": verdict, "wins": wins, "losses": losses, "p": p}


def paired_fields(name: str, ratios: list[float] | None) -> dict:
    """A record's fields for a paired ratio `name` (e.g. "speedup"): `{name}_rounds` (the per-round ratios) and
    paired_marks' verdict, wins, losses and p as `{name}_verdict`, `{name}_wins`, `{name}_losses`, `{name}_p`."""
    return {f"{name}_rounds": ratios, **{f"{name}_{k}": v for k, v in paired_marks(ratios).items()}}


def tie_mark(ratios: list[float] | None, value: float | None = None) -> str:
    """The mark after a printed ratio `value` with its paired per-round ratios (the same orientation): " (tie)" where
    the sign test does not resolve the rounds from 1.00x; where `value` is a ratio of the two sides' medians and the
    rounds resolve the other side of 1.00x (the medians can: 19.5 ms / 15 ms = 1.30x from rounds the plan lost 15 of
    20), " (15 of 20 rounds below 1.00x)"; "" otherwise (resolved on the value's side, or no rounds: the baseline)."""
    if not ratios:
        return ""
    verdict, above, below, _ = paired_verdict(ratios)
    if verdict == "tie":
        return " (tie)"
    if value is not None and (verdict == "slower" and value > 1.0 or verdict == "faster" and value < 1.0):
        return f" ({max(above, below)} of {len(ratios)} rounds {'below' if verdict == 'slower' else 'above'} 1.00x)"
    return ""


def tie_footnote(rounds: int, ratio: str = "speedup", pairing: str = "one call of each per round",
                 of_medians: bool = True) -> str:
    """The line under a table whose paired ratios carry "(tie)": the rule, and how many rounds can resolve one (with
    `rounds` of them: the fewest wins; below fewest_sign_rounds never), and what a resolved ratio on the other side of
    1.00x from its rounds is marked (tie_mark). `of_medians` False: the printed ratio is the median of the paired
    ratios themselves, which lies on the side of 1.00x that most rounds took, so no such mark can occur and the line
    says what the ratio is instead."""
    need, k = fewest_sign_rounds(), sign_test_wins(rounds)
    can = (f"{rounds} round{' never resolves' if rounds == 1 else 's never resolve'} one ({need} of {need} at the fewest), so every "
           f"{ratio} here is marked (tie)" if k is None else
           f"{rounds} rounds resolve one at {k} of {rounds} won one way ({need} of {need} at the fewest rounds); "
           + (f"a {ratio} (a ratio of the two medians) whose rounds resolve it on the other side of 1.00x says so "
              f"beside it, e.g. ({k} of {rounds} rounds below 1.00x)" if of_medians else
              f"each {ratio} is the median of those paired ratios"))
    return (f"(tie): not told from 1.00x by this run: the paired per-round ratios behind the {ratio} ({pairing}) do "
            f"not resolve it by a two-sided sign test at {SIGN_LEVEL * 100:g} %; {can}")


def ratio_range(ratios: list[float]) -> str:
    """"lo-hi x" of paired per-round ratios: the range that holds both their median and the ratio of the two sides'
    own medians (a median is monotone and scales, so med(a) / med(b) lies within min..max of a_i / b_i), printed
    beside both so the two never read as a contradiction."""
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"


def p10_p90(times: list[float]) -> tuple[float, float]:
    """The 10th and 90th percentiles of unpaired timings (inclusive method: within min..max; one timing: itself)."""
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
    return q[0], q[-1]


def spread_verdict(num_p10: float, num_p90: float, den_p10: float, den_p90: float, n: int | None = None,
                   m: int | None = None) -> tuple[float, float, bool]:
    """The rule for a ratio num / den of times whose rounds are NOT paired (each side timed in its own loop, so a
    round of one has no partner in the other): (lo, hi, tie), the range the two sides' p10-p90 spreads allow,
    num_p10 / den_p90 .. num_p90 / den_p10, and whether it is a tie: the range holds 1 (the difference is inside the
    noise), or, given the two sides' numbers of timings n and m, there are too few of them for separated spreads to
    mean a difference (with 3 a side the p10-p90 is nearly the min-max, which separates by chance one time in ten:
    separation_p)."""
    lo, hi = num_p10 / den_p90, num_p90 / den_p10
    few = n is not None and m is not None and separation_p(n, m) >= SIGN_LEVEL
    return lo, hi, lo <= 1.0 <= hi or few


def unpaired_verdict(num_times: list[float], den_times: list[float]) -> tuple[float, float, bool]:
    """spread_verdict's (lo, hi, tie) for a ratio num / den of unpaired timings, from the timings themselves: the
    range the p10-p90 spreads allow, and a tie where it holds 1 or where the rank-sum test (rank_sum_p) does not
    resolve the two sides at SIGN_LEVEL. Separated p10-p90 spreads alone are a weaker event than separated min-max
    ranges: 4 timings a side can separate them with two of the 16 pairs the other way round (p = 0.11)."""
    lo, hi, _ = spread_verdict(*p10_p90(num_times), *p10_p90(den_times))
    return lo, hi, lo <= 1.0 <= hi or rank_sum_p(num_times, den_times) >= SIGN_LEVEL


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularised incomplete beta function (modified Lentz), converging for
    x < (a + 1) / (a + b + 2)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), a, b > 0, 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def t_test_p(t: float, df: int) -> float:
    """Two-sided p-value of Student's t statistic `t` with `df` degrees of freedom: P(|T| >= |t|)."""
    if not math.isfinite(t):
        return 0.0
    return incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


@lru_cache(maxsize=None)
def t_quantile(df: int, level: float = 0.05) -> float:
    """The t with t_test_p(t, df) = level: the half-width, in standard errors, of a two-sided (1 - level) interval
    and the bound of a two-sided test at `level` (12.706 at df = 1, 2.0395 at df = 31, the speedrun's 32 validation
    windows), by bisection; exact at every df, where a table stopping at df = 30 used 2.042 there."""
    lo, hi = 0.0, 1.0
    while t_test_p(hi, df) > level:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_test_p(mid, df) > level:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return hi

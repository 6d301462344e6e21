"""Paired-round statistics for timings: the exact two-sided sign test that decides whether one plan's speed beats
another's from rounds that timed both (round-robin, so a round's load hits both alike)."""

from __future__ import annotations

import math

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

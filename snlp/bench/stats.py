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

"""The SSD cost formulas against outside references: Leviathan et al. 2023 (expected tokens per round
(1 - a^(g+1)) / (1 - a), walltime improvement with drafter/target cost c = 1/s) and a naive loop over simulated
rounds of i.i.d. acceptances (the model the formula assumes)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snlp.bench.tune import Acceptance
from snlp.decode.speculative import ideal_ssd_speedup


def _leviathan(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al. 2023, Theorem 3.8: (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1))."""
    tokens = gamma + 1 if alpha == 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + 1)


@settings(max_examples=200, deadline=None)
@given(st.floats(0.0, 1.0), st.integers(1, 16), st.floats(0.05, 50.0))
def test_ideal_ssd_speedup_is_leviathans_improvement_with_c_one_over_s(alpha, block, s):
    assert ideal_ssd_speedup(alpha, block, s) == pytest.approx(_leviathan(alpha, block, 1 / s), rel=1e-12)


def _rounds(alpha: float, block: int, n: int, seed: int) -> list[int]:
    """Accepted drafts of n simulated rounds: each draft accepted with chance alpha until the first rejection."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        k = 0
        while k < block and rng.random() < alpha:
            k += 1
        out.append(k)
    return out


@settings(max_examples=25, deadline=None)
@given(st.floats(0.05, 0.95), st.integers(1, 8), st.integers(0, 10 ** 6))
def test_simulated_rounds_match_the_formulas_tokens_and_the_acceptance_estimate(alpha, block, seed):
    """A naive loop over 20000 rounds: tokens per round (accepted + the verifier's own) tends to the formula's
    numerator; accepted / examined (examined: accepted + the first rejection) to alpha; tune's profile
    (Acceptance.tokens_per_round from P(n >= i)) equals the loop's mean at every B <= block."""
    n = 20000
    ks = _rounds(alpha, block, n, seed)
    tokens = sum(k + 1 for k in ks) / n
    assert tokens == pytest.approx((1 - alpha ** (block + 1)) / (1 - alpha), rel=0.03)
    examined = sum(k + (k < block) for k in ks)
    assert sum(ks) / examined == pytest.approx(alpha, abs=0.03)
    acc = Acceptance("p", block, n, [sum(k >= i for k in ks) / n for i in range(1, block + 1)], sum(ks) / examined)
    for b in range(1, block + 1):
        assert acc.tokens_per_round(b) == pytest.approx(sum(min(k, b) + 1 for k in ks) / n, rel=1e-12)

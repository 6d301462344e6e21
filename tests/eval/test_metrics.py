"""snlp.metrics against hand-computed examples and the paper's AR-match conversion table."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from snlp.eval.metrics import ar_match, cosine, implied_beta, logit_sim, pareto_front, perplexity, top1_agreement

# paper, App. "Interpreting AR Match Rate", table ar_match_rate_conversion (T = 32)
PAPER_BETA = {0.95: 0.9969, 0.90: 0.9935, 0.80: 0.9859, 0.70: 0.9767, 0.60: 0.9654, 0.50: 0.9510,
              0.40: 0.9320, 0.30: 0.9048}
# the same alphas inverted exactly through the paper's formula alpha = beta (1 - beta^T) / (T (1 - beta))
FORMULA_BETA = {0.95: 0.9969, 0.90: 0.9935, 0.80: 0.9861, 0.70: 0.9773, 0.60: 0.9667, 0.50: 0.9533,
                0.40: 0.9356, 0.30: 0.9098}


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return F.cross_entropy(logits.double().flatten(0, 1), targets.flatten(), reduction="sum").item()


def test_perplexity_of_a_uniform_distribution_is_the_vocab_size():
    V = 37
    logits = torch.zeros(2, 5, V)  # uniform: every token has probability 1/V
    targets = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0))
    assert perplexity(_nll_sum(logits, targets), targets.numel()) == pytest.approx(V, rel=1e-12)


def test_perplexity_of_a_peaked_distribution():
    # p(target) = 1/2 at half the positions and 1/4 at the other half -> PPL = exp(mean(ln 2, ln 4)) = 2^1.5
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]]))  # (2, 3)
    logits = logp[None].expand(3, 2, 3)  # (B=3, T=2, V=3)
    targets = torch.tensor([[0, 0]] * 3)  # position 0: p = 1/2, position 1: p = 1/4
    assert perplexity(_nll_sum(logits, targets), 6) == pytest.approx(2 ** 1.5, rel=1e-12)
    assert perplexity(0.0, 10) == 1.0  # a perfect model
    assert perplexity(1e6, 1) == math.inf  # overflow is inf, not an exception
    with pytest.raises(ValueError, match="at least one token"):
        perplexity(1.0, 0)


def test_perplexity_is_token_weighted_across_batches():
    # two batches with 1 and 3 tokens: the PPL of the pooled NLL, not the mean of two PPLs
    assert perplexity(math.log(2) + 3 * math.log(8), 4) == pytest.approx(2 ** 2.5)  # exp((ln 2 + 3 ln 8) / 4)


def test_top1_agreement_and_logit_sim():
    ref = torch.tensor([[[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]], [[1.0, 0.0, 0.0], [0.0, 0.0, 5.0]]])  # (2, 2, 3)
    other = ref.clone()
    other[1, 1] = torch.tensor([4.0, 0.0, 0.0])  # one of four argmaxes differs, and is orthogonal to ref
    assert top1_agreement(ref, ref) == 1.0 and top1_agreement(other, ref) == 0.75
    assert logit_sim(ref, ref) == pytest.approx(1.0, abs=1e-7)
    assert logit_sim(other, ref) == pytest.approx(0.75, abs=1e-7)  # cosines 1, 1, 1, 0
    assert logit_sim(2.5 * ref, ref) == pytest.approx(1.0, abs=1e-7)  # scale-invariant
    with pytest.raises(ValueError, match="shapes differ"):
        top1_agreement(ref, ref[:1])


def test_cosine_hand_examples():
    assert float(cosine([1.0, 0.0], [1.0, 1.0])) == pytest.approx(1 / math.sqrt(2))
    assert float(cosine([1.0, 2.0], [-2.0, 1.0])) == pytest.approx(0.0, abs=1e-7)
    assert float(cosine([1.0, 2.0, 2.0], [-2.0, -4.0, -4.0])) == pytest.approx(-1.0)
    rows = cosine(torch.tensor([[3.0, 4.0], [1.0, 0.0]]), torch.tensor([[3.0, 4.0], [0.0, 1.0]]))  # (2, D) -> (2,)
    assert rows.shape == (2,) and rows.tolist() == pytest.approx([1.0, 0.0], abs=1e-7)


def test_logit_sim_of_fp64_logits_is_taken_in_fp64():
    """cosine cast its inputs to fp32: an fp64 model's LogitSim (its logits are fp64) was rounded to fp32, whose
    error (~1e-7) is larger than 1 - cos of a plan off by 1e-5. Now it is taken in fp64 there: it equals a naive
    fp64 cosine; fp32 / bf16 inputs still compute in fp32."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, 50, generator=g, dtype=torch.float64)
    b = a + 1e-5 * torch.randn(3, 5, 50, generator=g, dtype=torch.float64)
    naive = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))  # (3, 5)
    assert cosine(a, b).dtype == torch.float64
    torch.testing.assert_close(cosine(a, b), naive, rtol=0, atol=1e-14)
    assert abs(logit_sim(a, b) - naive.mean().item()) < 1e-14
    assert cosine(a.bfloat16(), b.float()).dtype == torch.float32


def test_ar_match_counts_positions_without_resynchronising():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert ar_match(ref, ref) == 1.0
    # sample 0 diverges at position 1 and is then shifted by one: 3 and 4 still sit at the wrong
    # positions, so only position 0 matches (no re-synchronisation); sample 1 differs at position 2 only
    gen = [[1, 9, 2, 3], [5, 6, 0, 8]]
    assert ar_match(gen, ref) == pytest.approx((1 + 3) / 8)
    assert ar_match(torch.tensor(gen), torch.tensor(ref)) == pytest.approx(0.5)  # (N, T) tensors
    assert ar_match([[1, 2]], [[1, 2, 3, 4]]) == 0.5  # missing generated positions are mismatches
    with pytest.raises(ValueError, match="references"):
        ar_match([[1]], [[1], [2]])
    # extra generated tokens have no reference position: an error, not silently ignored
    with pytest.raises(ValueError, match="sequence 1 has 3 tokens but its reference only 2"):
        ar_match([[1, 2], [1, 2, 3]], [[1, 2], [1, 2]])


def test_implied_beta_reproduces_the_paper_formula_and_its_table():
    T = 32
    for alpha, beta in FORMULA_BETA.items():
        b = implied_beta(alpha, T)
        assert round(b, 4) == beta
        assert b * (1 - b ** T) / (T * (1 - b)) == pytest.approx(alpha, abs=1e-12)  # round trip
    for alpha in (0.95, 0.90):  # the paper's table follows its formula to 4 decimals here ...
        assert round(implied_beta(alpha), 4) == PAPER_BETA[alpha]
    for alpha, beta in PAPER_BETA.items():  # ... and lies up to 0.005 below it in the lower rows
        assert implied_beta(alpha) == pytest.approx(beta, abs=0.0051)
        assert implied_beta(alpha) >= beta - 1e-4


def test_implied_beta_edges_and_monotonicity():
    assert implied_beta(1.0) == 1.0 and implied_beta(0.0) == 0.0
    assert implied_beta(0.5, T=1) == pytest.approx(0.5)  # T = 1: alpha = beta
    assert implied_beta(1 / 32) == pytest.approx(0.5, abs=1e-9)  # alpha = 1/T: sum beta^i = 1, beta ~ 1/2
    betas = [implied_beta(a / 20) for a in range(21)]
    assert betas == sorted(betas) and len(set(betas)) == 21
    for bad in (-0.1, 1.1):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            implied_beta(bad)
    with pytest.raises(ValueError, match="T must be"):
        implied_beta(0.5, T=0)


def test_pareto_front_hand_example():
    pts = [(1.0, 10.0),   # 0 sequential: on the front (nothing is both as fast and as good)
           (1.2, 11.0),   # 1 dominated by 5 (same speed, lower PPL)
           (0.9, 9.5),    # 2 slower but best PPL: on the front
           (1.1, 12.0),   # 3 dominated by 5
           (2.0, math.inf),  # 4 diverged: never on the front
           (1.2, 10.5),   # 5 on the front
           (2.5, 30.0),   # 6 fastest: on the front
           (None, 5.0)]   # 7 untimed: never on the front
    assert pareto_front(pts) == [2, 0, 5, 6]
    assert pareto_front([]) == []
    assert pareto_front([(1.0, 2.0), (1.0, 2.0)]) == [0, 1]  # equal points do not dominate each other

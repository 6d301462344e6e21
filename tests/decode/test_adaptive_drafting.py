"""Adaptive drafting: a round stops drafting after a low-confidence draft. Exact by
construction: greedy output equals sequential greedy decoding whatever the threshold (law, hypothesis over
models, prompts, blocks, plans and thresholds), and a higher threshold never drafts more."""

from __future__ import annotations

import pytest
import torch
from conftest import examples, make_model
from hypothesis import given, settings
from hypothesis import strategies as st

from snlp import sequential_generate, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")


@settings(max_examples=examples(8), deadline=None)
@given(seed=st.integers(0, 50), plen=st.integers(1, 6), block=st.integers(1, 5),
       plan=st.sampled_from(["4xF1-h0-K1", "2xF2-h0-K1", "4xF1-fwd-K1", "4xF1-h0-K2"]),
       conf=st.sampled_from([0.0, 0.2, 0.6, 0.95, 1.0]))
def test_adaptive_drafting_keeps_greedy_output_exact(seed, plen, block, plan, conf):
    m = make_model(seed=seed, n_layer=5)
    prompt = torch.randint(0, m.config.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
    seq = sequential_generate(m, prompt, max_new_tokens=10)
    spec = speculative_generate(m, prompt, plan, block=block, max_new_tokens=10, min_confidence=conf)
    assert spec.tokens == seq.tokens
    assert spec.drafted <= spec.rounds * block


def test_a_higher_threshold_drafts_less_and_one_drafts_once_per_round():
    m = make_model(seed=7, n_layer=5)
    prompt = [1, 2, 3]
    runs = {c: speculative_generate(m, prompt, "4xF1-h0-K1", block=4, max_new_tokens=24, min_confidence=c)
            for c in (0.0, 0.5, 1.0)}
    per_round = {c: r.drafted / r.rounds for c, r in runs.items()}
    assert per_round[0.0] >= per_round[0.5] >= per_round[1.0]
    r1 = runs[1.0]  # a probability is < 1 unless certain: one draft per round (none in a last, budget-cut round)
    assert r1.rounds - 1 <= r1.drafted <= r1.rounds
    assert per_round[0.0] > 1.0


def test_sampling_with_adaptive_drafting_runs_and_bad_thresholds_are_refused():
    m = make_model(seed=8, n_layer=5)
    res = speculative_generate(m, [1, 2], "4xF1-h0-K1", block=3, max_new_tokens=8, temperature=1.0, seed=0,
                               min_confidence=0.5)
    assert len(res.tokens) == 8
    with pytest.raises(ValueError, match="min_confidence"):
        speculative_generate(m, [1, 2], "4xF1-h0-K1", min_confidence=1.5)

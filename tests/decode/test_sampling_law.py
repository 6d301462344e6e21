"""The law of a whole sampled continuation, enumerated exactly: every sequence of up to 4 new tokens over a vocabulary
of 8 (stopping after the stop id), its probability the product of transformers' own processors on a full forward of
the prefix (RepetitionPenaltyLogitsProcessor, then TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, in
generate()'s order), against the frequencies of a few thousand rows (each its own generator, one batch) of
sequential decoding and of self-speculative decoding whatever the drafter: a poor SNLP drafter (K = 0), another
model's forward, and the model itself (K = C), at blocks 1 to 8, a stop id often accepted mid-round and the
penalty on. A chi-square test (seeded, so deterministic) at p > 1e-3."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

from snlp.decode import sequential_generate, speculative_generate
from snlp.decode.steps import snlp_step
from snlp.method.solver import bind

pytest.importorskip("transformers")
chi2 = pytest.importorskip("scipy.stats").chi2
from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,  # noqa: E402
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

pytestmark = pytest.mark.usefixtures("one_thread")

HOW = dict(temperature=0.9, top_k=5, top_p=0.95, repetition_penalty=1.3)
PROMPT, L, EOS, N = [1, 2, 0], 4, 1, 3000


@torch.no_grad()
def exact_law(model) -> dict[tuple, float]:
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(HOW["repetition_penalty"]),
                                 TemperatureLogitsWarper(HOW["temperature"]), TopKLogitsWarper(HOW["top_k"]),
                                 TopPLogitsWarper(HOW["top_p"])])
    law: dict[tuple, float] = {}

    def walk(seq: list[int], pr: float) -> None:
        if len(seq) == L or seq[-1:] == [EOS]:
            law[tuple(seq)] = pr
            return
        ids = torch.tensor([PROMPT + seq])
        q = torch.softmax(procs(ids, model(ids)[:, -1].float()), -1)[0].double()
        for t in torch.nonzero(q).flatten().tolist():
            walk(seq + [t], pr * float(q[t]))
    walk([], 1.0)
    return law


def chi_square_p(law: dict[tuple, float], samples: list[list[int]]) -> float:
    counts: dict[tuple, int] = {}
    for s in samples:
        assert tuple(s) in law, f"an impossible sequence {s}"  # a filtered-out token, or tokens after the stop id
        counts[tuple(s)] = counts.get(tuple(s), 0) + 1
    stat, bins, pool_e, pool_o = 0.0, 0, 0.0, 0
    for s, pr in law.items():  # bins expected >= 5; the rest pooled into one
        e, o = pr * len(samples), counts.get(s, 0)
        if e >= 5:
            stat, bins = stat + (o - e) ** 2 / e, bins + 1
        else:
            pool_e, pool_o = pool_e + e, pool_o + o
    if pool_e > 0:
        stat, bins = stat + (pool_o - pool_e) ** 2 / pool_e, bins + 1
    return float(chi2.sf(stat, bins - 1))


@pytest.fixture(scope="module")
def setup():
    model = make_model(vocab_size=8, scale=0.8, n_layer=4)
    law = exact_law(model)
    assert abs(sum(law.values()) - 1) < 1e-5  # float32 probabilities
    assert sum(p for s, p in law.items() if s[-1] == EOS and len(s) < L) > 0.3  # the stop id ends many rows early
    return model, law


def test_sequential_sampling_has_transformers_law(setup):
    model, law = setup
    rows = sequential_generate(model, [PROMPT] * N, max_new_tokens=L, eos_id=EOS, seed=0, **HOW)
    assert chi_square_p(law, [r.tokens for r in rows]) > 1e-3


@pytest.mark.parametrize("drafter, block", [("poor", 1), ("other", 3), ("exact", 8), ("poor", 8)])
def test_speculative_sampling_has_the_verifiers_law_whatever_the_drafter(setup, drafter, block):
    model, law = setup
    plan = {"poor": "2xF2-h0-K0", "other": "4xF1-h0-K4", "exact": "4xF1-h0-K4"}[drafter]
    draft = snlp_step(bind(make_model(seed=5, vocab_size=8, scale=1.5, n_layer=4), plan)) if drafter == "other" \
        else None
    rows = speculative_generate(model, [PROMPT] * N, plan, block=block, max_new_tokens=L, eos_id=EOS, seed=1,
                                draft=draft, **HOW)
    assert chi_square_p(law, [r.tokens for r in rows]) > 1e-3

"""top_k / top_p sampling (snlp.decode.session.Sampling): the filtered distribution equals transformers' own
warpers (temperature, then top-k, then top-p, with their tie rules), every decoder samples from it (the law of the
first tokens, against a naive full forward), self-speculative decoding keeps the filtered law exactly, and a filter
that cannot act (greedy decoding) or a bad value is refused before any work."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model
from hypothesis import given, settings
from hypothesis import strategies as st

from snlp.decode import sequential_generate, snlp_generate, speculative_generate
from snlp.decode.session import Sampling, pick_tensor, sampling

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,  # noqa: E402
                                                    TopKLogitsWarper, TopPLogitsWarper)


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' sampling distribution: the warpers generate() builds for do_sample=True, in its order."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return torch.softmax(warpers(None, logits.float()), -1)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10_000), V=st.integers(2, 40), rows=st.integers(1, 4), ties=st.booleans(),
       temperature=st.sampled_from([0.3, 0.7, 1.0, 2.5]), top_k=st.integers(0, 45),
       top_p=st.sampled_from([1.0, 0.999, 0.95, 0.8, 0.5, 0.1, 1e-6]))
def test_filtered_distribution_equals_transformers_warpers(seed, V, rows, ties, temperature, top_k, top_p):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g) * 3
    if ties:  # repeated values at the cut-offs: transformers keeps every logit equal to the k-th largest
        logits = logits.round()
    got = Sampling(temperature, top_k, top_p).probs(logits)
    want = hf_probs(logits, temperature, top_k, top_p)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert ((got > 0).sum(-1) >= 1).all()


def test_an_fp64_models_logits_sample_from_transformers_float32_copy():
    """An fp64 model's logits are fp64 (GPT.head); transformers' generate samples from a float32 copy of the logits
    whatever the model's dtype, and so does Sampling.probs: float32, equal to the warpers on that copy."""
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    got = Sampling(0.7, 5, 0.9).probs(logits)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, hf_probs(logits, 0.7, 5, 0.9), rtol=0, atol=0)


def test_decoders_sample_from_the_filtered_distribution():
    """The first sampled token of sequential, SNLP (K >= C, M = 1: the model itself) and self-speculative decoding
    follows the filtered distribution of a naive full forward (4 sigma per token). N copies of the prompt decode as
    one batch, row i drawing from its own generator (seed i): N independent draws in one call (a row draws as it
    would alone: tests/test_seam_matrix.py)."""
    model = make_model(vocab_size=8, scale=0.8, n_layer=4)
    prompt = [1, 2, 0]
    how = dict(temperature=1.3, top_k=5, top_p=0.8)
    with torch.no_grad():
        exact = hf_probs(model(torch.tensor([prompt]))[0, -1:], how["temperature"], how["top_k"], how["top_p"])[0]
    assert 1 < int((exact > 0).sum()) < 5  # both filters act
    N = 3000
    batch = [prompt] * N
    for name, fn in (("sequential", lambda: sequential_generate(model, batch, max_new_tokens=1, seed=0, **how)),
                     ("snlp", lambda: snlp_generate(model, batch, "4xF1-h0-K4", max_new_tokens=1, seed=0, **how)),
                     ("speculative", lambda: speculative_generate(model, batch, "2xF2-h0-K0", block=2,
                                                                  max_new_tokens=2, seed=0, **how))):
        first = torch.tensor([r.tokens[0] for r in fn()])
        freq = torch.bincount(first, minlength=8).double() / N
        assert (freq[exact == 0] == 0).all(), (name, freq)  # a filtered-out token is never drawn
        assert (freq - exact.double()).abs().max() < 4 * math.sqrt(0.25 / N), (name, freq, exact)


def test_speculative_sampling_keeps_the_filtered_joint_law():
    """The joint law of the first two tokens of self-speculative decoding with a poor drafter (K = 0) equals the
    model's filtered p(t1) p(t2 | t1), for rows of different blocks in one round: prompts of 3 and 4 tokens with
    max_len 6 leave budgets of 3 and 2 (first round: 2 drafts and 1). N copies of each, one batch, each row its own
    generator."""
    model = make_model(vocab_size=5, scale=0.7)
    prompts = [[1, 2, 0], [3, 1, 2, 0]]
    how = dict(temperature=1.0, top_k=4, top_p=0.85)
    exact = []
    with torch.no_grad():
        for pr in prompts:
            p1 = hf_probs(model(torch.tensor([pr]))[0, -1:], 1.0, 4, 0.85)[0]
            p2 = hf_probs(model(torch.tensor([pr + [a] for a in range(5)]))[:, -1], 1.0, 4, 0.85)
            exact.append((p1[:, None] * p2).flatten())  # (25,)
    N = 2000
    rows = speculative_generate(model, prompts * N, "3xF2-h0-K0", block=2, max_new_tokens=3, max_len=6, seed=0,
                                **how)
    for i in range(2):
        got = rows[i::2]
        assert {len(r.tokens) for r in got} == {3 - i}
        counts = torch.bincount(torch.tensor([r.tokens[0] * 5 + r.tokens[1] for r in got]), minlength=25).float()
        assert (counts[exact[i] == 0] == 0).all(), i
        tv = 0.5 * (counts / N - exact[i]).abs().sum()
        assert tv < 0.06, (i, tv)


def test_pick_tensor_draws_only_kept_tokens():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 4)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    for _ in range(50):
        assert set(pick_tensor(logits, sampling(5.0, top_k=2), gens).tolist()) <= {0, 1}
        assert set(pick_tensor(logits, sampling(1.0, top_p=1e-6), gens).tolist()) == {0}


@pytest.mark.parametrize("kw, words", [
    (dict(temperature=0.0, top_k=5), "greedy decoding"),
    (dict(temperature=0.0, top_p=0.9), "greedy decoding"),
    (dict(temperature=1.0, top_k=-1), "top_k must be an integer >= 0"),
    (dict(temperature=1.0, top_k=2.5), "top_k must be an integer >= 0"),
    (dict(temperature=1.0, top_k=True), "top_k must be an integer >= 0"),
    (dict(temperature=1.0, top_p=0.0), "top_p must lie in (0, 1]"),
    (dict(temperature=1.0, top_p=1.5), "top_p must lie in (0, 1]"),
    (dict(temperature=1.0, top_p=float("nan")), "top_p must lie in (0, 1]"),
    (dict(temperature=1e-38), "below 1e-30"),  # logits / T overflows float32: NaN probabilities after the prefill
    (dict(temperature=1.0, seed=2 ** 64), "seed must lie in"),
    (dict(temperature=1.0, seed=-2 ** 63 - 1), "seed must lie in"),
])
def test_bad_filters_are_refused_before_any_work(kw, words, monkeypatch):
    model = make_model(n_layer=4)
    import snlp.decode.generate as gen_mod
    import snlp.decode.speculative as spec_mod

    def no_work(*a, **k):
        raise AssertionError("work started before the refusal")
    monkeypatch.setattr(gen_mod, "sequential_forward", no_work)
    monkeypatch.setattr(gen_mod, "snlp_forward", no_work)
    monkeypatch.setattr(spec_mod, "snlp_forward", no_work)
    for call in (lambda: sequential_generate(model, [1, 2], max_new_tokens=2, **kw),
                 lambda: snlp_generate(model, [1, 2], "2xF2-h0-K1", max_new_tokens=2, **kw),
                 lambda: speculative_generate(model, [[1, 2], [3]], "2xF2-h0-K1", max_new_tokens=2, **kw)):
        with pytest.raises(ValueError) as err:
            call()
        assert words in str(err.value) and "\n" not in str(err.value), err.value


def test_a_batch_whose_last_row_would_seed_past_64_bits_is_refused(monkeypatch):
    """Row i samples with seed + i: 2**64 - 1 seeds one prompt, but a batch of two would seed 2**64 (torch: "Overflow
    when unpacking long long", after the cache was allocated)."""
    model = make_model(n_layer=4)
    sequential_generate(model, [1, 2], max_new_tokens=1, temperature=1.0, seed=2 ** 64 - 1)
    with pytest.raises(ValueError, match=r"seed must lie in \[-2\*\*63, 2\*\*64 - 2\]"):
        speculative_generate(model, [[1, 2], [3]], "2xF2-h0-K1", max_new_tokens=2, temperature=1.0, seed=2 ** 64 - 1)

"""The weights fingerprint's stated tolerance (snlp.model.fingerprint): equal across every
chain of casts among fp64/fp32/bf16/fp16 of the same weights (both orders, either side recorded), different for
a real change, and the exact digest different for any change of the stored bits."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from conftest import examples, make_model
from snlp.model.fingerprint import exact_digest, same_weights, tensor_digest, weights_fingerprint

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@st.composite
def originals(draw):
    """A random tensor in a random precision: normal entries at a random scale (1e-9 .. 1e4, so fp16
    subnormals, underflow and overflow all occur), with zeros, ties and extreme values mixed in."""
    seed = draw(st.integers(0, 2**31 - 1))
    n = draw(st.integers(1, 300))
    scale = 10.0 ** draw(st.floats(-9, 4))
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g, dtype=torch.float64) * scale
    if draw(st.booleans()):  # exact midpoints of the bf16 grid (fp16-representable ties) and specials
        k = torch.randint(0, n, (max(1, n // 4),), generator=g)
        mid = (1 + torch.randint(0, 128, k.shape, generator=g, dtype=torch.float64) / 128 + 1 / 256)
        t[k] = mid * 2.0 ** torch.randint(-20, 10, k.shape, generator=g).double()
        t[0] = draw(st.sampled_from([0.0, -0.0, 65504.0, 65519.0, 70000.0, 2.0**-24, 6e-8, -1e-30]))
    return t.to(draw(st.sampled_from(DTYPES)))


@settings(max_examples=examples(300), deadline=None)
@given(originals(), st.lists(st.sampled_from(DTYPES), min_size=1, max_size=4))
def test_every_cast_chain_fingerprints_as_its_original(t, chain):
    """Law: same_weights(digest(c(t)), digest(t)) for every chain c of casts, with either side recorded."""
    c = t
    for dt in chain:
        c = c.to(dt)
    a, b = tensor_digest(t), tensor_digest(c)
    assert same_weights(a, b) and same_weights(b, a), (t.dtype, chain)


@settings(max_examples=examples(100), deadline=None)
@given(originals())
def test_both_orders_of_the_half_precisions_match_the_original(t):
    """The issue's case: fp32 -> fp16 -> bf16 (double rounding in ~6 % of entries) and fp32 -> bf16 -> fp16."""
    for chain in ((torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)):
        c = t
        for dt in chain:
            c = c.to(dt)
        assert same_weights(tensor_digest(t), tensor_digest(c))


def test_double_rounding_case_is_really_exercised():
    """Guard of the law above: the tensors do contain fp16-then-bf16 double roundings (a plain bf16 digest would
    refuse them), and a real change of ~1e-2 relative (a training step) is seen."""
    t = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 0.02
    twice = t.to(torch.float16).to(torch.bfloat16)
    assert (twice.float() != t.to(torch.bfloat16).float()).double().mean() > 0.01
    assert same_weights(tensor_digest(t), tensor_digest(twice))
    stepped = t + 3e-4 * torch.randn(t.shape, generator=torch.Generator().manual_seed(1))
    assert not same_weights(tensor_digest(t), tensor_digest(stepped))
    assert not same_weights(tensor_digest(t), tensor_digest(t.reshape(100, 100)))  # the shape counts


def test_exact_digest_sees_a_change_below_bf16_resolution():
    t = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    r = t.to(torch.bfloat16).float()  # below bf16 resolution: the tolerant digest cannot see it
    assert same_weights(tensor_digest(t), tensor_digest(r))
    assert exact_digest(t) != exact_digest(r)
    assert exact_digest(t) == exact_digest(t.clone())
    nudged = t.clone()
    nudged.view(-1)[5] = torch.nextafter(nudged.view(-1)[5], torch.tensor(1.0))  # one entry, one ulp
    assert exact_digest(nudged) != exact_digest(t)
    assert exact_digest(t) != exact_digest(t.double())  # the dtype counts


def test_model_fingerprint_is_precision_tolerant_and_sees_training():
    """Whole models: the fp32 original vs its fp16 / bf16 / fp64 copies and both double casts match; a
    different model or one optimizer-sized step does not."""
    m = make_model(seed=0, dtype=torch.float32, scale=0.05)
    fp = weights_fingerprint(m)
    for chain in ((torch.float16,), (torch.bfloat16,), (torch.float64,), (torch.float16, torch.bfloat16),
                  (torch.bfloat16, torch.float16), (torch.float16, torch.float64)):
        c = make_model(seed=0, dtype=torch.float32, scale=0.05)
        for dt in chain:
            c = c.to(dt)
        assert same_weights(fp, weights_fingerprint(c)) and same_weights(weights_fingerprint(c), fp), chain
    assert not same_weights(fp, weights_fingerprint(make_model(seed=1, dtype=torch.float32, scale=0.05)))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    assert not same_weights(fp, weights_fingerprint(m))

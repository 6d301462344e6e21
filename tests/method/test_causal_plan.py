"""The `causal` plan option (the paper code's approximation: the batched suffix attends fully causally, its layers'
sliding windows dropped, the prefix keeps them) against an outside reference: a copy of the model whose SUFFIX layers'
windows are set to full (-1) through its config (GPTConfig.layer_windows), run with the same plan WITHOUT the
option. Both build their weights from the same parameters, so they agree bit for bit (fp64); at K >= C both equal
the copy's own sequential forward, which differs from the original model's where the windows bite."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import argmax_loop, make_model, mhc_model

from snlp import GPT, GPTConfig, Plan, bind, fused_forward, solve
from snlp.decode import sequential_generate, snlp_generate
from snlp.decode.jacobi import jacobi_generate
from snlp.decode.speculative import speculative_generate
from snlp.method.plan import cli_plan, parse_plans

pytestmark = pytest.mark.usefixtures("one_thread")


def full_suffix(model: GPT, n_suffix: int) -> GPT:
    """The outside reference: `model` with its last `n_suffix` layers' windows set to full causal (-1) in its
    config, the same parameters; the prefix layers keep their windows."""
    cfg, L = model.config, model.config.n_layer
    wins = [cfg.window(l) if l < L - n_suffix else -1 for l in range(L)]
    ref = GPT(GPTConfig(**{**cfg.to_dict(), "layer_windows": wins})).to(model.wte.weight.dtype)
    ref.load_state_dict(model.state_dict())
    return ref.eval()


def ids(T: int = 12, B: int = 2, seed: int = 0, V: int = 61) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


PLANS = ["4xF1-h0-K1", "4xF1-h0-K2", "4xF1-h0-K3", "4xF1-h0-K4", "2xF2-h0-K1", "2xF2-h0-K2", "4xF1-fwd-K1",
         "4xF1-fwd-K3", "6xF1-h0-K2-none", "3xF2-fwd-K1", "5xF1-h0-K2-order:reversed", "4xF1-h0-K2-elk:0.3",
         "4xF1-h0-K3-tol:1e-3"]


def test_the_token_parses_in_any_position_and_prints_canonically():
    want = Plan(chunks=4, fuse=2, init="fwd", iters=2, causal=True)
    for text in ("4xF2-fwd-K2-causal", "4xF2-causal-fwd-K2", "4xF2-K2-causal-fwd"):
        assert Plan.parse(text) == want
    assert str(want) == "4xF2-fwd-K2-causal" and Plan.parse(str(want)) == want
    assert str(Plan.parse("4xF1-K1-causal-order:reversed-elk:0.5")) == "4xF1-h0-K1-elk:0.5-order:reversed-causal"
    with pytest.raises(ValueError, match="causal given twice"):
        Plan.parse("4xF1-causal-K1-causal")
    with pytest.raises(ValueError, match="causal must be True or False"):
        Plan(chunks=2, causal="yes")
    assert Plan.parse("4xF1-K1") != Plan.parse("4xF1-K1-causal")
    with pytest.raises(ValueError, match="lists 4xF1-h0-K1-causal twice"):
        parse_plans("4xF1-K1-causal,4xF1-h0-causal-K1")


def test_no_K_is_exact_for_a_causal_plan():
    """The option changes the function: exact_iters claims no K; the solve still stops moving from C on, so a
    larger K is capped there, with a warning that says converged, not exact."""
    p = Plan.parse("4xF1-h0-K9-causal")
    assert p.exact_iters() is None and p.converged_iters() == 4
    assert Plan.parse("4xF1-h0-K9").exact_iters() == 4
    with pytest.warns(UserWarning, match="converged .*full-attention suffix layers") as rec:
        capped = cli_plan("4xF1-h0-K9-causal")
    assert capped == p.with_(iters=4) and "exact" not in str(rec[0].message)
    assert "has converged" in Plan.parse("4xF1-K1-causal").divergence_hints()
    assert "is exact" not in Plan.parse("4xF1-K1-causal").divergence_hints()


def test_a_model_with_no_window_in_the_suffix_refuses_it():
    full = make_model(window_pattern="L")
    with pytest.raises(ValueError, match="have none .* changes nothing, drop -causal"):
        bind(full, "4xF1-h0-K1-causal")
    with pytest.raises(ValueError, match="changes nothing"):
        solve(full, ids(), "4xF1-h0-K1-causal")
    # windows only in the prefix (layers 0, 2 of 6 under "SL"): a 3-layer suffix 3..5 has layer 4 windowed, a
    # 1-layer suffix (the last layer is always full) has none
    bind(make_model(), "3xF1-h0-K1-causal")
    with pytest.raises(ValueError, match="changes nothing"):
        bind(make_model(), "1xF1-h0-K1-causal")


@pytest.mark.parametrize("plan", PLANS)
def test_causal_plan_equals_the_same_plan_on_the_full_suffix_copy(plan):
    """3(a): bind / Runner, snlp.solve and fused_forward of a causal plan = the plain plan on the copy, bit for bit."""
    model = make_model()
    p = Plan.parse(plan)
    causal, ref = p.with_(causal=True), full_suffix(model, p.n_suffix)
    x = ids()
    got = bind(model, causal)(x)
    assert torch.equal(got, bind(ref, p)(x))
    assert torch.equal(model.head(solve(model, x, causal).hidden), got)
    assert torch.equal(fused_forward(model, x, causal), fused_forward(ref, x, p))
    assert not torch.equal(got, bind(model, p)(x))  # the windows bite at T = 12 > 3


def test_causal_plan_with_shared_weights_equals_the_copy():
    model, x = make_model(), ids()
    got = bind(model, "4xF1-h0-K2-causal", share_weights=True)(x)
    copy = full_suffix(make_model(), 4)
    # bit for bit against the copy's own shared-weights path (the same kernels); the unshared path sums in another
    # order, equal to round-off only on some CPUs (AVX-512 boxes differ in the last bits)
    assert torch.equal(got, bind(copy, "4xF1-h0-K2", share_weights=True)(x))
    torch.testing.assert_close(got, bind(copy, "4xF1-h0-K2")(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("plan", ["4xF1-h0-K1-hcn", "4xF1-h0-K2-hcn", "2xF2-h0-K1-hcn", "4xF1-h0-K1"])
def test_causal_plan_on_an_mhc_model_equals_the_copy(plan):
    model, p = mhc_model(), Plan.parse(plan)
    x = ids()
    assert torch.equal(bind(model, p.with_(causal=True))(x), bind(full_suffix(model, p.n_suffix), p)(x))


@pytest.mark.parametrize("plan", ["4xF1-h0-K4", "6xF1-h0-K6", "4xF1-fwd-K3", "5xF1-h0-K9-order:reversed",
                                  "3xF1-h0-K3-none"])
def test_converged_causal_plan_is_the_copys_sequential_forward_not_the_models(plan):
    """3(b): at K >= C (M = 1) the causal plan equals the copy's sequential forward to round-off and differs from
    the original model's sequential forward (the windows bite)."""
    model, p = make_model(), Plan.parse(plan)
    causal = p.with_(causal=True)
    assert causal.iters >= causal.converged_iters()
    x = ids(T=16)
    got = bind(model, causal)(x)
    assert torch.allclose(got, full_suffix(model, p.n_suffix)(x), atol=1e-10, rtol=0)
    assert (got - model(x)).abs().max() > 1e-3
    assert torch.allclose(bind(model, p)(x), model(x), atol=1e-10, rtol=0)  # the windowed plan is exact


def test_short_inputs_inside_every_window_are_unchanged():
    """Where no window bites (T <= the window + 1), dropping it changes nothing."""
    model, x = make_model(), ids(T=4)
    assert torch.allclose(bind(model, "4xF1-h0-K2-causal")(x), bind(model, "4xF1-h0-K2")(x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("plan", ["4xF1-h0-K1", "2xF2-h0-K1", "4xF1-h0-K4", "4xF1-fwd-K3"])
def test_snlp_decoding_with_a_causal_plan_equals_the_naive_loop(plan):
    """3(c): KV-cached SNLP decoding keeps every position, so the causal suffix attends over all of them: its tokens
    equal a naive argmax loop over the per-step full forward of the same plan on the copy (K = 1 from h0 and
    K >= C, where cached SNLP decoding is the per-step forward), and differ from the windowed plan's."""
    model, p = make_model(), Plan.parse(plan)
    prompt, n = [3, 1, 4, 1, 5, 9, 2], 14
    ref = bind(full_suffix(model, p.n_suffix), p)
    want = argmax_loop(ref, prompt, n)
    assert snlp_generate(model, prompt, p.with_(causal=True), n).tokens == want
    assert argmax_loop(bind(model, p.with_(causal=True)), prompt, n) == want


def test_batched_snlp_decoding_with_a_causal_plan_equals_each_row_alone():
    model = make_model()
    prompts, n = [[3, 1, 4, 1, 5, 9, 2], [7, 7], [2, 6, 5, 3, 5]], 10
    ref = bind(full_suffix(model, 4), "4xF1-h0-K1")
    got = snlp_generate(model, prompts, "4xF1-h0-K1-causal", n)
    assert [r.tokens for r in got] == [argmax_loop(ref, q, n) for q in prompts]


@pytest.mark.parametrize("plan", ["4xF1-h0-K1-causal", "2xF2-h0-K1-causal", "4xF1-fwd-K2-causal"])
def test_speculative_decoding_with_a_causal_drafter_gives_the_sequential_tokens(plan):
    """The verifier is the windowed model run sequentially: a causal drafter changes what is accepted, never the
    tokens; Jacobi decoding with a causal plan verifies likewise."""
    model = make_model()
    prompt, n = [3, 1, 4, 1, 5, 9, 2], 16
    want = sequential_generate(model, prompt, n).tokens
    assert want == argmax_loop(model, prompt, n)
    assert speculative_generate(model, prompt, plan, block=3, max_new_tokens=n).tokens == want
    assert jacobi_generate(model, prompt, plan, block=3, max_new_tokens=n).tokens == want


def test_str_of_a_causal_runner_names_it():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = bind(make_model(), "4xF1-K1-causal")
    assert "4xF1-h0-K1-causal" in repr(r) and r.weights.windows is None and r.weights.window_values is None


def test_the_decode_suite_never_calls_a_causal_row_exact():
    """run_decode_suite's exact rule (K >= exact_iters, M = 1, no tol) and its note: a causal plan is approximate at
    any K, and the note names why."""
    from snlp.bench.decode_suite import approximate_note

    assert "causal" in approximate_note("4xF1-h0-K4-causal")
    assert approximate_note("4xF1-h0-K4") == "approximate by design"
    note = approximate_note("4xF1-h0-K1-causal")
    assert "K = 1 < 4" not in note and "causal" in note

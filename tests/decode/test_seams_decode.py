"""Seams of batched and compiled decoding: a row of a ragged batch equals the same prompt
run alone for a `tol` plan with K < C too (padding stays out of the per-row stop test); sampling without a seed leaves
torch's global RNG alone; compiled steps compile exactly the graphs their warm-up compiled, and a second call with a
FRESH cache compiles nothing (dynamo's own count, torch._dynamo.testing.CompileCounter: no inductor, so these are
fast). References: a naive full-prefix argmax loop written here, the single-prompt run, torch's own RNG stream."""

from __future__ import annotations

import pytest
import torch
from conftest import argmax_loop, make_model
from torch._dynamo.testing import CompileCounter

from snlp import bind, sequential_generate, snlp_generate, speculative_generate
from snlp.decode.session import NonFiniteModelError
from snlp.decode.steps import Step, sequential_fn, snlp_fn
from snlp.model.cache import KVCache

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(model, lens, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in lens]


@pytest.mark.parametrize("seed", [3, 5, 6])
def test_tol_rows_with_k_below_chunks_equal_their_single_prompt_run(seed):
    """Prompts of 3 and 15 tokens, 7xF1-h0-K6-tol:0.5 (K < C), 10 new tokens: row 0 of the batch equals the
    prompt run alone and as a list of one (on a6631c2 the ragged prefill's padding entered row 0's stop norm, so it
    froze at another iteration and cached other K/V: these seeds differed)."""
    m = make_model(seed=seed, n_layer=8)
    prompts = _prompts(m, (3, 15), seed)
    plan, kw = "7xF1-h0-K6-tol:0.5", dict(max_new_tokens=10)
    alone = [snlp_generate(m, p, plan, **kw).tokens for p in prompts]
    assert [r.tokens for r in snlp_generate(m, prompts[:1], plan, **kw)] == alone[:1]
    assert [r.tokens for r in snlp_generate(m, prompts, plan, **kw)] == alone
    assert [r.tokens for r in snlp_generate(m, prompts[::-1], plan, **kw)] == alone[::-1]
    # the same plan as a drafter: rows equal the naive argmax loop (the verifier keeps the model's output)
    ref = [argmax_loop(m, p, 10) for p in prompts]
    assert [r.tokens for r in speculative_generate(m, prompts, plan, block=3, **kw)] == ref


@pytest.mark.parametrize("plan,seed", [("7xF1-h0-K5-tol:0.5", 0), ("7xF1-fwd-K5-tol:0.5", 2),
                                       ("7xF1-h0-K6-tol:0.5-order:reversed", 1), ("7xF1-h0-K5-tol:0.5-hcn", 8),
                                       ("4xF2-h0-K3-tol:0.5", 0)])
def test_tol_plans_of_every_kind_batch_exactly(plan, seed):
    """The same over plan kinds (h0 / fwd init, reversed, mHC with hcn, F2; all K < C): every row of a ragged batch
    (a 1-token prompt, which caches nothing, among them) equals its single-prompt run. The seeds are ones where
    a6631c2 differed (the F2 case did not differ there in 12 seeds; it is kept for coverage)."""
    from conftest import mhc_model
    m = mhc_model(seed=seed, n_layer=8) if "hcn" in plan else make_model(seed=seed, n_layer=8)
    prompts = _prompts(m, (15, 1, 3), seed)
    kw = dict(max_new_tokens=8)
    assert [r.tokens for r in snlp_generate(m, prompts, plan, **kw)] == \
        [snlp_generate(m, p, plan, **kw).tokens for p in prompts]


def test_sampling_without_a_seed_leaves_the_global_rng_alone():
    """A caller's seeded global stream is the same with and without a seed=None sampling call in between
    (on a6631c2 make_generator called torch.seed(), which reseeds the global generator)."""
    m = make_model(seed=0, n_layer=4)
    prompts = _prompts(m, (4, 2), 0)
    torch.manual_seed(1234)
    want = torch.rand(8)
    for call in (lambda: sequential_generate(m, prompts[0], max_new_tokens=3, temperature=1.0),
                 lambda: snlp_generate(m, prompts, "4xF1-h0-K1", max_new_tokens=3, temperature=1.0),
                 lambda: speculative_generate(m, prompts[0], "4xF1-h0-K1", block=2, max_new_tokens=3, temperature=1.0),
                 lambda: speculative_generate(m, prompts, "4xF1-h0-K1", block=2, max_new_tokens=3, temperature=1.0)):
        torch.manual_seed(1234)
        call()
        assert torch.equal(torch.rand(8), want)


# ----- compiled steps, counted by dynamo itself (CompileCounter backend: graphs are captured, not inductor-compiled)

def _counted(fn):
    cnt = CompileCounter()
    return Step(fn, "cpu", backend=cnt), cnt


def test_compiled_ragged_prefill_compiles_once():
    """The ragged prefill's warm-up and real call pass identically laid-out inputs, so every graph is
    compiled once, by the warm-up, and none inside the timed prefill (on a6631c2 the warm-up's positions were an
    expand (stride 0) and the real call's contiguous: one more compile than shapes). Rows equal the argmax loop."""
    m = make_model(seed=1, n_layer=4)
    prompts = _prompts(m, (5, 2, 9), 1)
    step, cnt = _counted(sequential_fn(m))
    rows = sequential_generate(m, prompts, max_new_tokens=4, step=step)
    assert [r.tokens for r in rows] == [argmax_loop(m, p, 4) for p in prompts]
    assert cnt.frame_count == len(step._seen) == 2  # the prefill graph and the one-token graph, once each
    rows = sequential_generate(m, _prompts(m, (7, 3, 4), 2), max_new_tokens=4, step=step)  # a fresh cache, same shapes
    assert cnt.frame_count == 2


def test_compiled_drafter_with_eager_verifier_compiles_nothing_per_step():
    """A compiled drafter beside the eager verifier compiles its graph once for a batch, not at every step
    (on a6631c2 the eager verifier's span, state on the shared cache, changed the drafter's attended cache length every
    step: a recompile each), and a second call with a fresh cache compiles nothing. Greedy rows equal the argmax
    loop."""
    m = make_model(seed=2, n_layer=4)
    runner = bind(m, "4xF1-h0-K1", check_finite=False)
    draft, cnt = _counted(snlp_fn(runner))
    prompts = _prompts(m, (4, 1, 7), 2)
    rows = speculative_generate(m, prompts, "4xF1-h0-K1", block=3, max_new_tokens=6, draft=draft)
    assert [r.tokens for r in rows] == [argmax_loop(m, p, 6) for p in prompts]
    first = cnt.frame_count
    assert first == len(draft._seen) == 1
    speculative_generate(m, _prompts(m, (6, 2, 3), 3), "4xF1-h0-K1", block=3, max_new_tokens=6, draft=draft)
    assert cnt.frame_count == first
    one = speculative_generate(m, prompts[0], "4xF1-h0-K1", block=3, max_new_tokens=6, draft=draft)  # single prompt
    assert one.tokens == rows[0].tokens
    n = cnt.frame_count
    speculative_generate(m, prompts[2], "4xF1-h0-K1", block=3, max_new_tokens=6, draft=draft)  # fresh cache
    assert cnt.frame_count == n


def test_second_calls_with_fresh_caches_compile_nothing():
    """Every KVCache is laid out the same way at creation, so generate / speculative_generate / batched calls
    that reuse compiled steps compile nothing new on a fresh cache of a seen shape (compiled drafter AND verifier)."""
    m = make_model(seed=4, n_layer=4)
    runner = bind(m, "2xF2-h0-K1", check_finite=False)
    seq, cs = _counted(sequential_fn(m))
    draft, cd = _counted(snlp_fn(runner))
    p = _prompts(m, (5, 3), 4)
    calls = [lambda q: sequential_generate(m, q[0], max_new_tokens=5, step=seq),
             lambda q: sequential_generate(m, q, max_new_tokens=5, step=seq),
             lambda q: speculative_generate(m, q[0], "2xF2-h0-K1", block=2, max_new_tokens=5, draft=draft, verify=seq),
             lambda q: speculative_generate(m, q, "2xF2-h0-K1", block=2, max_new_tokens=5, draft=draft, verify=seq)]
    for call in calls:
        call(p)
    counts = (cs.frame_count, cd.frame_count)
    assert counts[0] == len(seq._seen) and counts[1] == len(draft._seen)
    for call in calls:
        got = call(_prompts(m, (6, 2), 5))  # new prompts of lengths in the same buckets: fresh caches of seen shapes
        for r in (got if isinstance(got, list) else [got]):
            assert r.compile_s == 0.0
    assert (cs.frame_count, cd.frame_count) == counts


def test_a_cache_holds_no_per_call_state():
    """The span of a ragged call travels with its positions (RowPositions), not on the cache: a KVCache is per-position
    data (K/V, and the token ids a smear model reads back) and a length only, so one shared cache can serve an eager
    and a compiled step in the same loop."""
    import dataclasses
    assert [f.name for f in dataclasses.fields(KVCache)] == ["k", "v", "length", "ids"]


# ----- one speculative round for one prompt and for a batch (a single prompt is a batch of one)

@pytest.mark.parametrize("plan", ["6xF1-h0-K1", "3xF2-h0-K1", "6xF1-fwd-K2", "6xF1-h0-K3-tol:0.3",
                                  "3xF1-h0-K1-diag:fd", "2xF1-h0-K2-order:reversed"])
def test_single_prompt_speculative_equals_the_argmax_loop_and_its_batch_row(plan):
    """Greedy speculative decoding of one prompt (fixed block, adaptive block, confidence stop) equals the naive
    full-prefix argmax loop, streams what it returns, and equals its row in a ragged batch (eager) for the plans a
    batch supports; the per-row surrogates a batch refuses (diag) still decode a single prompt."""
    m = make_model(seed=7, n_layer=6)
    prompts = _prompts(m, (6, 2, 11), 7)
    ref = [argmax_loop(m, p, 9) for p in prompts]
    for kw in (dict(block=3), dict(block=4, adaptive=True), dict(block=4, min_confidence=0.4)):
        got = []
        one = speculative_generate(m, prompts[0], plan, max_new_tokens=9, on_tokens=got.extend, **kw)
        assert one.tokens == got == ref[0] and "batch" not in one.extra
        assert one.drafted <= one.rounds * kw["block"] and one.accepted <= one.drafted
        if "diag" not in plan:
            assert [r.tokens for r in speculative_generate(m, prompts, plan, max_new_tokens=9, **kw)] == ref


def test_sampled_single_prompt_equals_its_batch_row():
    """Sampling: one prompt with seed s draws what row 0 of a batch draws (its generator is seeded s + 0), in fp64."""
    m = make_model(seed=8, n_layer=4)
    prompts = _prompts(m, (3, 8), 8)
    kw = dict(block=3, max_new_tokens=12, temperature=0.8, seed=11)
    one = speculative_generate(m, prompts[0], "4xF1-h0-K1", **kw)
    rows = speculative_generate(m, prompts, "4xF1-h0-K1", **kw)
    assert one.tokens == rows[0].tokens and len(one.tokens) == 12


def test_adaptive_sampling_repeats_and_its_rows_do_not_depend_on_the_batch():
    """adaptive=True with temperature > 0 picked its block from wall-clock timings (a seeded run drew differently from
    run to run) and a batch drafted the largest row's block for every row (a row's draws depended on its
    neighbours). Now: the same seed gives the same tokens, and row i equals the prompt alone with seed + i."""
    m = make_model(seed=9, n_layer=6)
    prompts = _prompts(m, [3, 7, 2, 5], 9)
    kw = dict(plan="4xF1-h0-K1", block=4, max_new_tokens=12, temperature=1.0, adaptive=True)
    runs = {tuple(speculative_generate(m, prompts[1], seed=9, **kw).tokens) for _ in range(4)}
    assert len(runs) == 1
    rows = speculative_generate(m, prompts, seed=100, **kw)
    assert [r.tokens for r in rows] == [speculative_generate(m, p, seed=100 + i, **kw).tokens
                                        for i, p in enumerate(prompts)]


def test_batch_rows_count_their_own_forwards():
    """A speculative row's `forwards` counted the round's longest drafting (the batch's), not its own drafts + 1."""
    m = make_model(seed=10, n_layer=6)
    prompts = _prompts(m, [4, 6, 3], 10)
    rows = speculative_generate(m, prompts, "4xF1-h0-K1", block=3, max_new_tokens=7, min_confidence=0.5)
    for p, r in zip(prompts, rows):
        one = speculative_generate(m, p, "4xF1-h0-K1", block=3, max_new_tokens=7, min_confidence=0.5)
        assert (r.tokens, r.drafted, r.forwards, r.rounds) == (one.tokens, one.drafted, one.forwards, one.rounds)


def test_a_pooled_cache_is_not_poisoned_by_an_earlier_call():
    """CUDA graphs reuse one cache buffer per shape (Step.new_cache); masked attention multiplies the scratch past a
    call's positions by 0, so a NaN an earlier call wrote there (a diverged drafter, an fp16 overflow; here a token
    that embeds to NaN) turned every later healthy call into token 0. The pooled branch runs on the CPU by giving an
    eager-compiled Step the mode compile takes on CUDA."""
    m = make_model(seed=11, n_layer=2, sequence_len=256, window_pattern="L", dtype=torch.float32)
    with torch.no_grad():
        m.wte.weight[7] = float("nan")
    step = Step(sequential_fn(m), "cpu", compile=False)
    step.mode = "reduce-overhead"  # the pooled (static-address) cache branch, as compile selects it on CUDA
    ref = argmax_loop(m, [1, 2, 3], 8)
    assert sequential_generate(m, [1, 2, 3], 8, step=step).tokens == ref
    with pytest.raises(NonFiniteModelError):  # the model's own NaN logits raise, after writing NaN K/V across the
        sequential_generate(m, [7] * 40, 8, step=step)  # pooled buffer
    assert sequential_generate(m, [1, 2, 3], 8, step=step).tokens == ref

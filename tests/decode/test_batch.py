"""Batched decoding of ragged prompts (snlp.decode.batch): every row's tokens equal that prompt's own
single-prompt output (sequential, SNLP, self-speculative, adaptive block and confidence stop), greedy speculative
rows equal sequential greedy decoding, rows stop on their own (EOS, budget, max_len), sampled rows do not depend on
the batch, and batched greedy decoding equals transformers' left-padded batched generate (the outside reference)."""

from __future__ import annotations

import pytest
import torch
from conftest import configs, examples, make_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snlp import jacobi_generate, sequential_generate, snlp_generate, speculative_generate
from snlp.decode.batch import is_batch
from snlp.decode.speculative import AdaptiveBlock, ideal_ssd_speedup
from snlp.model.cache import KVCache

pytestmark = pytest.mark.usefixtures("one_thread")

PLANS = ["4xF1-h0-K1", "2xF2-h0-K1", "4xF1-fwd-K1", "4xF1-h0-K2", "2xF1-h0-K2-order:reversed", "3xF1-h0-K4-tol:1e-6"]


def _prompts(model, lens, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in lens]


@settings(max_examples=examples(10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(min_layers=4, max_layers=6), seed=st.integers(0, 100),
       lens=st.lists(st.integers(1, 9), min_size=2, max_size=4), block=st.integers(1, 4),
       plan=st.sampled_from(PLANS), n=st.integers(1, 10), eos=st.one_of(st.none(), st.integers(0, 60)))
def test_every_row_equals_its_own_single_prompt_run(cfg, seed, lens, block, plan, n, eos):
    """fp64: batched sequential / SNLP / speculative (fixed and adaptive block, confidence stop) rows equal the
    single-prompt runs, and the greedy speculative rows equal sequential greedy decoding; with an EOS id rows end
    (and leave the batch) at different steps."""
    m = make_model(seed=seed, **cfg)
    prompts = _prompts(m, lens, seed)
    kw0 = dict(max_new_tokens=n, eos_id=eos)
    seq = [sequential_generate(m, p, **kw0).tokens for p in prompts]
    assert [r.tokens for r in sequential_generate(m, prompts, **kw0)] == seq
    assert [r.tokens for r in snlp_generate(m, prompts, plan, **kw0)] == \
        [snlp_generate(m, p, plan, **kw0).tokens for p in prompts]
    for kw in (dict(), dict(adaptive=True), dict(min_confidence=0.5)):
        rows = speculative_generate(m, prompts, plan, block=block, **kw0, **kw)
        assert [r.tokens for r in rows] == seq
        assert all(r.drafted <= r.rounds * block and r.accepted <= r.drafted for r in rows)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fp32_rows_equal_single_prompt_runs(seed):
    m = make_model(seed=seed, dtype=torch.float32, n_layer=6, n_embd=32, n_head=4, n_kv_head=2)
    prompts = _prompts(m, [5, 1, 9, 3, 7], seed)
    seq = [sequential_generate(m, p, max_new_tokens=12).tokens for p in prompts]
    assert [r.tokens for r in sequential_generate(m, prompts, max_new_tokens=12)] == seq
    for plan in ("6xF1-h0-K1", "3xF2-h0-K1"):
        assert [r.tokens for r in speculative_generate(m, prompts, plan, block=4, max_new_tokens=12)] == seq
        assert [r.tokens for r in speculative_generate(m, prompts, plan, block=4, max_new_tokens=12,
                                                       adaptive=True)] == seq


def test_rows_stop_on_their_own_and_stream_in_order():
    """EOS, per-row budgets under max_len and the (prompt index, tokens) stream: each row as if alone."""
    m = make_model(seed=3, n_layer=5)
    prompts = _prompts(m, [2, 6, 4, 1], 3)
    eos = sequential_generate(m, prompts[1], max_new_tokens=12).tokens[3]  # row 1 ends at its 4th token
    streamed = {i: [] for i in range(4)}
    for fn, kw in ((sequential_generate, {}), (speculative_generate, dict(plan="4xF1-h0-K1", block=3)),
                   (speculative_generate, dict(plan="2xF2-h0-K1", block=4, adaptive=True, min_confidence=0.3))):
        for i in streamed:
            streamed[i].clear()
        rows = fn(m, prompts, max_new_tokens=12, eos_id=eos, max_len=14,
                  on_tokens=lambda i, new: streamed[i].extend(new), **kw)
        for i, (p, r) in enumerate(zip(prompts, rows)):
            one = fn(m, p, max_new_tokens=12, eos_id=eos, max_len=14, **kw)
            assert (r.tokens, r.stop) == (one.tokens, one.stop)
            assert streamed[i] == r.tokens
        assert rows[1].stop == "eos" and len(rows[1].tokens) <= 4
        assert len(rows[1].tokens) < len(rows[0].tokens)  # row 1 left the batch, the others went on
        assert rows[0].extra["batch"]["size"] == 4


def test_sampled_rows_do_not_depend_on_the_batch():
    """temperature > 0: prompt i samples from its own generator (seed + i), so it draws the same tokens in a batch
    as alone (fp64: the batched logits equal the single ones up to rounding)."""
    m = make_model(seed=4, n_layer=5)
    prompts = _prompts(m, [3, 5, 2], 4)
    for fn, kw in ((sequential_generate, {}), (speculative_generate, dict(plan="4xF1-h0-K1", block=3))):
        rows = fn(m, prompts, max_new_tokens=10, temperature=1.0, seed=7, **kw)
        for i, p in enumerate(prompts):
            assert fn(m, [p], max_new_tokens=10, temperature=1.0, seed=7 + i, **kw)[0].tokens == rows[i].tokens
        assert len({tuple(r.tokens) for r in rows}) == 3


def test_single_prompts_stay_single_and_bad_batches_are_refused():
    m = make_model(seed=5, n_layer=4)
    assert not is_batch([1, 2, 3]) and not is_batch(torch.tensor([[1, 2]])) and not is_batch(torch.tensor([1, 2]))
    assert is_batch([[1], [2, 3]]) and is_batch(torch.tensor([[1, 2], [3, 4]])) and is_batch([torch.tensor([1])])
    single = sequential_generate(m, torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    assert isinstance(single.tokens, list) and len(single.tokens) == 4
    two = sequential_generate(m, torch.tensor([[1, 2, 3], [4, 5, 6]]), max_new_tokens=4)
    assert [r.tokens for r in two] == [sequential_generate(m, p, max_new_tokens=4).tokens for p in ([1, 2, 3], [4, 5, 6])]
    with pytest.raises(ValueError, match="at least one token"):
        speculative_generate(m, [[1, 2], []], "4xF1-h0-K1")
    with pytest.raises(ValueError, match="prompt 1 of 5 tokens"):
        sequential_generate(m, [[1], [1, 2, 3, 4, 5]], max_len=4)
    with pytest.raises(ValueError, match="token ids"):
        sequential_generate(m, [[1], [10 ** 6]])


def test_ragged_forward_writes_each_row_at_its_own_positions():
    """The (B, T) positions path directly: one ragged call equals each row's own cached forward."""
    m = make_model(seed=6, n_layer=3)
    a, b = [3, 1, 4, 1, 5], [9, 2]
    cache = KVCache.for_model(m, batch=2, max_len=12)
    with torch.no_grad():
        pos = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])
        m(torch.tensor([a, b + [2, 2, 2]]), cache=cache, pos=pos)  # row 1 padded at its end: scratch
        got = m(torch.tensor([[2], [6]]), cache=cache, pos=torch.tensor([[5], [2]]))[:, -1]
        ref = torch.stack([m(torch.tensor([a + [2]]))[0, -1], m(torch.tensor([b + [6]]))[0, -1]])
    assert (got - ref).abs().max() < 1e-10


def test_adaptive_block_follows_the_acceptance_rate():
    """The controller's block is the argmax of the ideal SSD speedup at its running alpha and measured s: the
    largest block when every draft is accepted, 1 when none is."""
    ctl = AdaptiveBlock(6, rows=2)
    assert ctl.block(0) == 6  # nothing measured yet
    for _ in range(30):
        ctl.timed(draft_s=0.4, steps=4, verify_s=0.3)  # s = 3
        ctl.update(0, 4, 4)
        ctl.update(1, 4, 0)
    assert ctl.block(0) == 6 and ctl.block(1) == 1
    a = (ctl.acc[0] + 1) / (ctl.exam[0] + 1)
    assert ideal_ssd_speedup(a, 6, 3.0) >= max(ideal_ssd_speedup(a, b, 3.0) for b in range(1, 6))


def test_adaptive_speculative_drafts_less_with_a_poor_drafter():
    """A drafter that agrees rarely (the h0 init on a random model, K = 1) ends with shorter rounds than fixed B
    (the block an exact drafter keeps depends on the measured s, timing: not asserted). Output is sequential's."""
    m = make_model(seed=8, n_layer=6, scale=1.0)
    p = _prompts(m, [4], 8)[0]
    seq = sequential_generate(m, p, max_new_tokens=40).tokens
    poor = speculative_generate(m, p, "6xF1-h0-K1", block=6, max_new_tokens=40, adaptive=True)
    fixed = speculative_generate(m, p, "6xF1-h0-K1", block=6, max_new_tokens=40)
    exact = speculative_generate(m, p, "2xF1-h0-K2", block=6, max_new_tokens=40, adaptive=True)
    assert poor.tokens == fixed.tokens == exact.tokens == seq
    assert fixed.acceptance_rate < 0.5
    assert poor.drafted / poor.rounds < fixed.drafted / fixed.rounds
    assert exact.accepted == exact.drafted


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batched_greedy_equals_transformers_left_padded_generate(family):
    """The outside reference: transformers' batched greedy generate over left-padded prompts (attention mask)
    equals our ragged batch, sequential and self-speculative, on a random tiny model converted by snlp.io.hf (fp64,
    sdpa attention: in fp64 transformers' eager attention turns fully masked padding rows into NaN logits)."""
    from snlp.io.hf import from_hf

    C = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(C(
        vocab_size=89, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")).double().eval()
    model, _ = from_hf(hf)
    gen = torch.Generator().manual_seed(1)
    lens, n = [7, 3, 5, 1], 12
    prompts = [torch.randint(1, 89, (k,), generator=gen).tolist() for k in lens]
    T = max(lens)
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0)[:, T:].tolist()
    assert [r.tokens for r in sequential_generate(model, prompts, max_new_tokens=n)] == out
    for plan in ("4xF1-h0-K1", "2xF2-h0-K1"):
        assert [r.tokens for r in speculative_generate(model, prompts, plan, block=3, max_new_tokens=n)] == out


def test_mhc_hcn_and_preheat_plans_batch_exactly_and_diag_is_refused():
    """mHC models with the HCN surrogate and preheat plans decode ragged batches row-exactly too; DiagN / Newton,
    whose probes read the cache at one start position, are refused with a clear error."""
    from conftest import mhc_model

    from snlp.method.preheat import CalibrateConfig, fit

    m = mhc_model(n_layer=5)
    prompts = _prompts(m, [3, 7, 1], 0)
    seq = [sequential_generate(m, p, max_new_tokens=8).tokens for p in prompts]
    for plan in ("4xF1-h0-K1-hcn", "2xF2-h0-K1-hcn"):
        assert [r.tokens for r in snlp_generate(m, prompts, plan, max_new_tokens=8)] == \
            [snlp_generate(m, p, plan, max_new_tokens=8).tokens for p in prompts]
        assert [r.tokens for r in speculative_generate(m, prompts, plan, block=3, max_new_tokens=8)] == seq
    p = make_model(seed=9, n_layer=5)
    pre = fit(p, CalibrateConfig(rank=4, batch=2, seq_len=16))
    prompts = _prompts(p, [2, 5], 9)
    assert [r.tokens for r in snlp_generate(p, prompts, "4xF1-preheat-K1", max_new_tokens=6, preheat=pre)] == \
        [snlp_generate(p, q, "4xF1-preheat-K1", max_new_tokens=6, preheat=pre).tokens for q in prompts]
    with pytest.raises(ValueError, match="per row"):
        snlp_generate(p, prompts, "4xF1-h0-K1-diag")
    with pytest.raises(ValueError, match="per row"):
        speculative_generate(p, prompts, "4xF1-h0-K1-diag")


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 50), block=st.integers(1, 5), cap=st.sampled_from([None, 14, 24]),
       eos=st.sampled_from([None, [3, 7, 11]]), lens=st.lists(st.integers(1, 19), min_size=2, max_size=4))
def test_greedy_batch_rows_draft_and_accept_as_each_prompt_alone(seed, block, cap, eos, lens):
    """Speculative tokens are exact whatever is drafted, so only the statistics show a drafter fed the wrong token:
    in fp64, with a fixed block, a greedy batch row drafts, accepts and examines what its prompt alone does (the one
    prompt runs the plain single-row round, the batch the ragged one), round for round."""
    m = make_model(seed=seed, n_layer=8, sequence_len=64, scale=0.05)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, m.config.vocab_size, (k,), generator=g).tolist() for k in lens]
    kw = dict(block=block, max_new_tokens=12, max_len=None if cap is None else max(cap, max(lens)), eos_id=eos)
    rows = speculative_generate(m, prompts, "6xF1-h0-K1", **kw)
    stats = ("tokens", "drafted", "accepted", "examined", "rounds", "draft_steps", "forwards", "stop")
    for p, r in zip(prompts, rows):
        alone = speculative_generate(m, p, "6xF1-h0-K1", **kw)
        assert [getattr(r, k) for k in stats] == [getattr(alone, k) for k in stats]


def test_a_short_rows_padding_is_its_last_token_not_the_drafters_extra_drafts():
    """A batch row that wants fewer drafts than the others is padded, in the verifier's forward, with its own last
    token (positions past its real ones are scratch). Its extra drafts must not be fed there: masked attention still
    multiplies their K/V by 0, and a token whose embedding is NaN would make the row's real logits NaN. Outside
    reference: a naive full-prefix argmax loop per prompt, finite on these prompts although token 23 is NaN."""
    m = make_model(seed=1, n_layer=8, sequence_len=64, scale=0.05)
    with torch.no_grad():
        m.wte.weight[23] = float("nan")
    prompts = [[30, 25, 31], [0, 57, 29, 4, 42, 40, 20, 29, 60, 7, 16, 46], [56, 36, 50, 5, 7]]

    @torch.no_grad()
    def naive(p, n):
        ids = list(p)
        for _ in range(n):
            logits = m(torch.tensor([ids]))[0, -1]
            assert torch.isfinite(logits).all()
            ids.append(int(logits.argmax()))
        return ids[len(p):]

    rows = speculative_generate(m, prompts, "6xF1-h0-K1", block=4, max_new_tokens=10, max_len=17)
    assert [r.tokens for r in rows] == [naive(p, min(10, 17 - len(p))) for p in prompts]


@pytest.mark.parametrize("mode, batch", [(m, b) for m in ("sequential", "snlp", "speculative") for b in (False, True)]
                         + [("jacobi", False)])  # Jacobi decoding takes one prompt
def test_on_tokens_returning_true_ends_the_row_there(mode, batch):
    """The streaming callback is the caller's stopping criterion: a call returning True ends that row (stop
    "on_tokens") with the tokens emitted so far, the other rows decode on unchanged, and a callback returning
    anything else (a list, 1) stops nothing. Reference: each row's free run, cut after the token where the callback
    fired."""
    m = make_model(seed=4, n_layer=4, dtype=torch.float64)
    prompts = _prompts(m, [3, 5, 2], 7)
    fn = dict(sequential=sequential_generate, snlp=lambda *a, **k: snlp_generate(m, a[1], "4xF1-h0-K4", **k),
              speculative=lambda *a, **k: speculative_generate(m, a[1], "4xF1-h0-K1", block=3, **k),
              jacobi=lambda *a, **k: jacobi_generate(m, a[1], block=3, **k))[mode]
    run = (lambda p, **k: fn(m, p, **k)) if mode == "sequential" else (lambda p, **k: fn(None, p, **k))
    free = [run(p, max_new_tokens=12).tokens for p in prompts]
    at = [4, 7, 1]  # the callback fires once a row has this many tokens
    seen = [[] for _ in prompts]

    def stop(i, new):
        seen[i].extend(new)
        return len(seen[i]) >= at[i]

    if batch:
        got = run(prompts, max_new_tokens=12, on_tokens=stop)
        ignored = run(prompts, max_new_tokens=12, on_tokens=lambda i, new: [new])
    else:
        got = [run(p, max_new_tokens=12, on_tokens=lambda new, i=i: stop(i, new)) for i, p in enumerate(prompts)]
        ignored = [run(p, max_new_tokens=12, on_tokens=lambda new: 1) for p in prompts]
    for f, r, n in zip(free, got, at):
        assert r.stop == "on_tokens"
        # a round's tokens are emitted at once: the row ends after the round that reached n tokens
        assert len(r.tokens) >= n and r.tokens == f[:len(r.tokens)]
        assert len(r.tokens) == n or mode in ("speculative", "jacobi")
    assert [r.tokens for r in ignored] == free and all(r.stop == "max_new_tokens" for r in ignored)

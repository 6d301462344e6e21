"""The repetition penalty (snlp.decode.penalty) against transformers: the tokens of every decoding entry equal
`generate(repetition_penalty=p, do_sample=False)` of the same weights (a tiny LlamaForCausalLM converted with
snlp.from_hf; one prompt and a left-padded ragged batch on transformers' side), the penalised sampling distribution
equals transformers' RepetitionPenaltyLogitsProcessor followed by its warpers, self-speculative decoding stays exact
(greedy: the sequential tokens; sampled: the model's penalised joint law), and a bad penalty is refused in one line
before any work."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import argmax_loop, make_model

from snlp import from_hf, jacobi_generate, sequential_generate, snlp_generate, speculative_generate
from snlp.decode.penalty import RepetitionPenalty

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (LogitsProcessorList,  # noqa: E402
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

pytestmark = pytest.mark.usefixtures("one_thread")

V = 24  # a tiny vocabulary: 24 new tokens must repeat
N = 24
PENALTIES = (0.5, 1.05, 1.3, 2.0)
PROMPTS = [[3, 7, 7, 1, 12], [5], [9, 2, 14, 2, 20, 8, 3, 11]]
PAD = 0  # no prompt holds it: a penalised pad id would show


def tiny_llama(dtype=torch.float64):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=None, tie_word_embeddings=False,
                                   attn_implementation="sdpa")
    hf = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(2.0)  # logits spread enough that the penalty moves the argmax, and not always to one token
    return hf.to(dtype).eval()


@pytest.fixture(scope="module")
def pair():
    hf = tiny_llama()
    model, _ = from_hf(hf)
    return hf, model


def hf_greedy(hf, prompts: list[list[int]], p: float, n: int = N) -> list[list[int]]:
    """transformers' own greedy generate with the penalty, the prompts LEFT-padded into one batch (its attention
    mask tells it where each row starts: the penalty skips the padding, prompt_ignore_length)."""
    T = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (T - len(q)) + q for q in prompts])
    mask = torch.tensor([[0] * (T - len(q)) + [1] * len(q) for q in prompts])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          repetition_penalty=p, pad_token_id=PAD)
    return out[:, T:].tolist()


@pytest.mark.parametrize("p", PENALTIES)
def test_every_entry_point_decodes_transformers_penalised_tokens(pair, p):
    hf, model = pair
    alone = [hf_greedy(hf, [q], p)[0] for q in PROMPTS]
    assert hf_greedy(hf, PROMPTS, p) == alone  # transformers' batch: each row as alone (the padding not penalised)
    plain = [hf_greedy(hf, [q], 1.0)[0] for q in PROMPTS]
    assert alone != plain  # the penalty acts on these prompts
    kw = dict(max_new_tokens=N, repetition_penalty=p)
    for q, want in zip(PROMPTS, alone):
        assert sequential_generate(model, q, **kw).tokens == want
        assert snlp_generate(model, q, "4xF1-h0-K4", **kw).tokens == want  # K >= C, M = 1: the model
        assert speculative_generate(model, q, "2xF2-h0-K1", block=3, **kw).tokens == want
        assert jacobi_generate(model, q, "4xF1-h0-K1", block=4, **kw).tokens == want
        assert jacobi_generate(model, q, None, block=3, **kw).tokens == want
    for rows in (sequential_generate(model, PROMPTS, **kw), sequential_generate(model, PROMPTS, read_every=5, **kw),
                 snlp_generate(model, PROMPTS, "4xF1-h0-K4", **kw),
                 speculative_generate(model, PROMPTS, "4xF1-h0-K1", block=4, **kw),
                 speculative_generate(model, torch.tensor([PROMPTS[2], PROMPTS[2][::-1]]), "2xF2-h0-K1", block=2,
                                      **kw)):
        got = [r.tokens for r in rows]
        assert got == (alone if len(got) == 3 else [alone[2], hf_greedy(hf, [PROMPTS[2][::-1]], p)[0]])


def test_fp32_batch_of_one_equals_transformers(pair):
    hf, _ = pair
    hf32 = tiny_llama(torch.float32)
    model, _ = from_hf(hf32)
    for p in (1.05, 1.3):
        for q in PROMPTS:
            want = hf_greedy(hf32, [q], p)[0]
            assert sequential_generate(model, q, max_new_tokens=N, repetition_penalty=p).tokens == want
            assert speculative_generate(model, q, "2xF1-h0-K1", block=3, max_new_tokens=N,
                                        repetition_penalty=p).tokens == want


SPEC_PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 2], [9]]


@pytest.fixture(scope="module")
def spec_case():
    model = make_model(seed=2, vocab_size=13, scale=0.3)
    refs = {p: [argmax_loop(model, q, 20, penalty=p) for q in SPEC_PROMPTS] for p in (0.5, 1.3, 2.0)}
    assert refs[2.0] != [argmax_loop(model, q, 20, penalty=1.0) for q in SPEC_PROMPTS]
    return model, refs


@pytest.mark.parametrize("plan, block, extra", [("6xF1-h0-K1", 1, {}), ("6xF1-h0-K1", 4, dict(adaptive=True)),
                                                ("3xF2-h0-K1", 3, {}), ("6xF1-fwd-K1", 2, dict(min_confidence=0.5)),
                                                ("6xF1-h0-K6", 5, {}), ("3xF2-h0-K0", 4, dict(adaptive=True))])
def test_speculative_equals_sequential_with_the_penalty(spec_case, plan, block, extra):
    """Several plans and blocks, one prompt and a ragged batch, adaptive blocks and min_confidence: the tokens of
    the naive penalised loop, which the penalised sequential decoding gives too."""
    model, refs = spec_case
    for p, ref in refs.items():
        kw = dict(max_new_tokens=20, repetition_penalty=p)
        if plan == "6xF1-h0-K1" and block == 1:
            assert [r.tokens for r in sequential_generate(model, SPEC_PROMPTS, **kw)] == ref
        assert [r.tokens for r in speculative_generate(model, SPEC_PROMPTS, plan, block=block, **kw, **extra)] == ref
        assert [speculative_generate(model, q, plan, block=block, **kw, **extra).tokens for q in SPEC_PROMPTS] == ref


def test_penalised_sampling_distribution_is_transformers_processor_then_warpers():
    """The distribution a sampled step draws from: transformers' RepetitionPenaltyLogitsProcessor over the sequence
    so far, then its temperature / top-k / top-p warpers (generate's order), for rows with different histories."""
    from snlp.decode.session import Sampling

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g) * 3
    seqs = [[1, 2, 3, 3], [5], [0, 23, 9, 9, 9, 4]]
    for p, (t, k, top_p) in ((1.3, (0.7, 0, 1.0)), (0.5, (1.5, 6, 0.9)), (2.0, (1.0, 0, 0.5))):
        pen = RepetitionPenalty.of(p, seqs, V, "cpu")
        got = Sampling(t, k, top_p).probs(pen(logits))
        procs = LogitsProcessorList([TemperatureLogitsWarper(t)] + ([TopKLogitsWarper(k)] if k else [])
                                    + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
        for i, s in enumerate(seqs):
            scores = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([s]), logits[i:i + 1].clone())
            torch.testing.assert_close(got[i:i + 1], torch.softmax(procs(None, scores), -1), rtol=0, atol=0)


def test_at_positions_is_the_prefix_penalty_at_each_draft():
    """The verifier's position i is penalised by the seen ids and drafts 1..i only (a repeated draft once)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, V, generator=g)
    seqs, drafts = [[1, 2], [7]], torch.tensor([[5, 5, 2], [7, 8, 9]])
    pen = RepetitionPenalty.of(1.7, seqs, V, "cpu")
    got = pen.at_positions(logits, drafts)
    for b in range(2):
        for i in range(4):
            s = seqs[b] + drafts[b, :i].tolist()
            want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([s]), logits[b, i][None].clone())[0]
            torch.testing.assert_close(got[b, i], want, rtol=0, atol=0)


def test_speculative_sampling_keeps_the_penalised_joint_law():
    """Sampled self-speculative decoding with a poor drafter (K = 0): the joint law of the first two tokens equals
    the model's penalised p(t1) p(t2 | t1), where t1 is penalised for t2 (TV < 0.06 over 2000 rows of one batch)."""
    model = make_model(vocab_size=5, scale=0.7)
    prompt, p = [1, 2, 0], 2.0
    with torch.no_grad():
        def probs(seqs):
            x = model(torch.tensor(seqs))[:, -1].float()
            return torch.softmax(RepetitionPenaltyLogitsProcessor(p)(torch.tensor(seqs), x), -1)
        p1 = probs([prompt])[0]
        p2 = probs([prompt + [a] for a in range(5)])
    exact = (p1[:, None] * p2).flatten()
    assert (exact - (torch.softmax(model(torch.tensor([prompt]))[0, -1].float(), -1)[:, None] * p2).flatten()
            ).abs().max() > 0.01  # the penalty changes the law
    n = 2000
    rows = speculative_generate(model, [prompt] * n, "3xF2-h0-K0", block=2, max_new_tokens=2, seed=0,
                                temperature=1.0, repetition_penalty=p)
    counts = torch.bincount(torch.tensor([r.tokens[0] * 5 + r.tokens[1] for r in rows]), minlength=25).float()
    tv = 0.5 * (counts / n - exact).abs().sum()
    assert tv < 0.06, tv
    seq = sequential_generate(model, [prompt] * n, max_new_tokens=2, seed=0, temperature=1.0, repetition_penalty=p)
    counts = torch.bincount(torch.tensor([r.tokens[0] * 5 + r.tokens[1] for r in seq]), minlength=25).float()
    assert 0.5 * (counts / n - exact).abs().sum() < 0.06
    assert (counts[exact == 0] == 0).all()
    assert math.isclose(float(exact.sum()), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, float("nan"), float("inf"), True, "1.05", None])
def test_a_bad_penalty_is_refused_in_one_line_before_any_work(bad, monkeypatch):
    model = make_model(n_layer=4)
    import snlp.decode.generate as gen_mod
    import snlp.decode.jacobi as jac_mod
    import snlp.decode.speculative as spec_mod

    def no_work(*a, **k):
        raise AssertionError("work started before the refusal")
    for mod in (gen_mod, spec_mod, jac_mod):
        monkeypatch.setattr(mod, "sequential_forward", no_work)
    monkeypatch.setattr(gen_mod, "snlp_forward", no_work)
    monkeypatch.setattr(spec_mod, "snlp_forward", no_work)
    for call in (lambda: sequential_generate(model, [1, 2], max_new_tokens=2, repetition_penalty=bad),
                 lambda: snlp_generate(model, [[1, 2], [3]], "2xF2-h0-K1", max_new_tokens=2, repetition_penalty=bad),
                 lambda: speculative_generate(model, [1, 2], "2xF2-h0-K1", max_new_tokens=2, repetition_penalty=bad),
                 lambda: jacobi_generate(model, [1, 2], max_new_tokens=2, repetition_penalty=bad)):
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert "repetition_penalty must be a finite number > 0" in msg and "\n" not in msg, msg


def test_penalty_one_runs_no_penalty_op(monkeypatch):
    """p = 1 costs nothing: no seen-mask is built, so the decode loops run no penalty op."""
    import snlp.decode.penalty as pen_mod

    model = make_model(n_layer=4)
    built = []
    real = pen_mod.RepetitionPenalty.__init__
    monkeypatch.setattr(pen_mod.RepetitionPenalty, "__init__", lambda self, *a: built.append(1) or real(self, *a))
    sequential_generate(model, [[1, 2], [3]], max_new_tokens=3, repetition_penalty=1.0)
    speculative_generate(model, [1, 2], "2xF2-h0-K1", max_new_tokens=3, repetition_penalty=1)
    jacobi_generate(model, [1, 2], max_new_tokens=3)
    assert built == []
    sequential_generate(model, [1, 2], max_new_tokens=3, repetition_penalty=1.2)
    assert built == [1]


def test_every_one_token_loop_picks_through_the_one_penalty_step(monkeypatch):
    """The single-prompt loop, the batch loop and Jacobi's session hold their penalty state on the session
    (DecodeSession.penalty, BatchSession.penalty) and the one-token loops pick through RepetitionPenalty.pick, one
    call per step for the whole batch; the tokens are still the penalised loop's."""
    model = make_model(seed=2, vocab_size=13, scale=0.3)
    calls = []
    real = RepetitionPenalty.pick
    monkeypatch.setattr(RepetitionPenalty, "pick",
                        lambda self, logits, pick: calls.append(logits.shape[0]) or real(self, logits, pick))
    kw = dict(max_new_tokens=6, repetition_penalty=1.3)
    assert sequential_generate(model, SPEC_PROMPTS[0], **kw).tokens == argmax_loop(model, SPEC_PROMPTS[0], 6, penalty=1.3)
    assert calls == [1] * 6
    calls.clear()
    rows = snlp_generate(model, SPEC_PROMPTS[:2], "6xF1-h0-K6", read_every=4, **kw)
    assert [r.tokens for r in rows] == [argmax_loop(model, q, 6, penalty=1.3) for q in SPEC_PROMPTS[:2]]
    assert calls == [2] * 6


def test_the_penalty_reads_nothing_back_to_the_host():
    """Every penalty op of a decode step or round stays on the device: no aten::_local_scalar_dense (what .item() /
    int() / bool() of a tensor end in, a host sync on an accelerator) in building the state, penalising logits one
    step or a round of positions, and marking picked, drafted and kept tokens."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pen = RepetitionPenalty.of(1.3, [[1, 2, 3], [4]], V, "cpu")
        pen(torch.randn(2, V, generator=g))
        pen.add(torch.tensor([5, -1]))
        drafter = pen.fork()
        drafter.add(torch.tensor([[6], [7]]))
        drafts = torch.tensor([[6, 8], [7, 7]])
        pen.at_positions(torch.randn(2, 3, V, generator=g), drafts)
        pen.accept(drafts, torch.tensor([1, 2]), torch.tensor([9, -1]))
        pen.keep_rows(torch.tensor([1]))
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense") == 0
    assert pen.seen[0, :V].nonzero().flatten().tolist() == [4, 7]  # row [4]: its prompt, its draft 7 kept twice


@pytest.mark.slow
def test_compiled_steps_with_the_penalty_equal_eager():
    """--compile: the penalty acts on the compiled steps' logits outside their graphs (no graph break, no new
    graph): sequential and self-speculative decoding, one prompt and a ragged batch, give the eager tokens."""
    model = make_model(seed=2, vocab_size=13, scale=0.3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 2], [9]]
    kw = dict(max_new_tokens=16, repetition_penalty=1.3)
    eager = [r.tokens for r in sequential_generate(model, prompts, **kw)]
    assert eager == [argmax_loop(model, q, 16, penalty=1.3) for q in prompts]
    assert [r.tokens for r in sequential_generate(model, prompts, compile=True, **kw)] == eager
    assert sequential_generate(model, prompts[0], compile=True, **kw).tokens == eager[0]
    assert [r.tokens for r in speculative_generate(model, prompts, "6xF1-h0-K1", block=3, compile=True,
                                                   **kw)] == eager
    assert speculative_generate(model, prompts[1], "6xF1-h0-K1", block=3, compile=True, **kw).tokens == eager[1]

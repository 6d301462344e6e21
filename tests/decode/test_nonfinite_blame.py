"""NaN/inf logits met while SNLP-decoding are blamed on where they came from: the model's own head or layers
(its sequential forward, the outside reference, gives them too) or the plan's solver state."""

import math
import re

import pytest
import torch

from conftest import argmax_loop

from snlp import SNLPDivergenceError, jacobi_generate, sequential_generate, snlp_generate, speculative_generate
from snlp.decode.session import NonFiniteModelError
from snlp.model.gpt import GPT, GPTConfig


def overflowing_head_model() -> GPT:
    """fp16, no softcap, an lm_head whose logits exceed fp16's 65504 on every token: the head overflows, the layers
    do not."""
    m = GPT(GPTConfig.from_depth(4, width=32, head_dim=16, vocab_size=61, sequence_len=32, softcap=0.0))
    m.init_weights(seed=0)
    with torch.no_grad():
        m.lm_head.weight.normal_(0, 1, generator=torch.Generator().manual_seed(0)).mul_(3e4)
    return m.half().eval()


def test_exact_plan_on_an_overflowing_head_names_the_head_not_the_plan():
    m = overflowing_head_model()
    prompt = [1, 5, 7, 3]
    with torch.inference_mode():  # the outside reference: the model's own forward, layer after layer
        h = m.hidden_states(torch.tensor([prompt]))[-1]
        assert torch.isfinite(h).all() and not torch.isfinite(m(torch.tensor([prompt]))[0, -1]).all()
    with pytest.raises(NonFiniteModelError, match=r"the model's own forward \(not an SNLP plan\) gives NaN/inf "
                       r"logits for generated token 1 \(its logits at sequence position 3\): its final hidden state is "
                       r"finite but its head"):
        sequential_generate(m, prompt, max_new_tokens=3)  # it read token 0 off the inf logits before
    for prompts in (prompt, [prompt, prompt[:3]]):  # one prompt, and a ragged batch
        with pytest.raises(NonFiniteModelError, match=r"under plan 4xF1-h0-K4, and so do the model's own: its final "
                           r"hidden state is finite but its head .*no logit softcap.*overflows.*the plan is not the "
                           r"cause") as e:
            snlp_generate(m, prompts, "4xF1-h0-K4", max_new_tokens=3)
        assert not isinstance(e.value, SNLPDivergenceError) and "try more iterations" not in str(e.value).lower()


def test_a_diverging_plan_on_a_finite_model_is_still_the_plans():
    from conftest import blowup_model  # its sequential forward is finite; the Newton step overflows

    m = blowup_model(61, sequence_len=64)
    with pytest.raises(SNLPDivergenceError, match=r"come from the solver's state \(the model's own forward gives "
                       r"finite logits here\)"):
        snlp_generate(m, [3, 1, 4, 1, 5, 9], "8xF1-h0-K1-newton", max_new_tokens=3)


def nan_after_token_model():
    """A float32 model whose embedding row of one token X is NaN, X being a token its finite greedy decoding of
    PROMPT emits (and PROMPT does not hold): the model's own forward is finite until X is fed, then NaN at every later
    position (attention mixes it in). Returns the model and, from the outside reference (a full-prefix forward per
    token, no cache), the 1-based index of the first generated token whose logits are NaN/inf, and X."""
    m = GPT(GPTConfig.from_depth(4, width=32, head_dim=16, vocab_size=61, sequence_len=64))
    m.init_weights(seed=0)
    m.eval()
    assert m.lm_head.weight.data_ptr() != m.wte.weight.data_ptr()
    with torch.no_grad():
        m.lm_head.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))  # varied greedy tokens
        x = next(t for t in argmax_loop(m, PROMPT, 8) if t not in PROMPT)
        m.wte.weight[x] = float("nan")
    ids = list(PROMPT)
    for k in range(1, 9):  # the naive loop: token k's logits are those at position len(ids) - 1
        with torch.no_grad():
            lg = m(torch.tensor([ids]))[0, -1]
        if not torch.isfinite(lg).all():
            return m, k, x
        ids.append(int(lg.argmax()))
    raise AssertionError("the model never turned NaN")


PROMPT = [1, 5, 7, 3]
MODEL_CALLS = {  # every decoding path whose tokens are (or are verified by) the model's own forward
    "sequential": lambda m, p: sequential_generate(m, p, max_new_tokens=8),
    "sequential-sampled": lambda m, p: sequential_generate(m, p, max_new_tokens=8, temperature=0.8, seed=0),
    "sequential-batch": lambda m, p: sequential_generate(m, [p, p[1:]], max_new_tokens=8),
    # several steps queued per read (a GPU's default): the error still names the first token read off NaN/inf
    "sequential-read3": lambda m, p: sequential_generate(m, p, max_new_tokens=8, read_every=3),
    "sequential-sampled-read3": lambda m, p: sequential_generate(m, p, max_new_tokens=8, temperature=0.8, seed=0,
                                                                 read_every=3),
    "speculative": lambda m, p: speculative_generate(m, p, "4xF1-h0-K1", block=3, max_new_tokens=8),
    "speculative-sampled": lambda m, p: speculative_generate(m, p, "4xF1-h0-K1", block=3, max_new_tokens=8,
                                                             temperature=0.8, seed=0),
    "speculative-batch": lambda m, p: speculative_generate(m, [p, p[1:]], "4xF1-h0-K1", block=3, max_new_tokens=8),
    "jacobi": lambda m, p: jacobi_generate(m, p, None, block=3, max_new_tokens=8),
    "jacobi-plan-verified": lambda m, p: jacobi_generate(m, p, "4xF1-h0-K1", block=3, max_new_tokens=8),
}


@pytest.mark.parametrize("entry", MODEL_CALLS)
def test_the_models_own_nonfinite_forward_raises_naming_the_model_and_the_step(entry):
    """Outside reference: the full-prefix forward loop finds the first generated token k whose logits are NaN/inf.
    Every path that read its tokens off the model's own forward emitted token 0 there silently; now each raises
    NonFiniteModelError naming the model's own forward (never the plan), the token and its position. One token per
    forward (sequential): exactly token k, at position len(prompt) + k - 2. Several tokens per forward (a verifier
    over drafts, Jacobi guesses): token k or an earlier one, since a NaN fed later in the same forward reaches earlier
    positions through masked attention (0 * NaN is NaN), which the message then says."""
    m, k, x = nan_after_token_model()
    prompt = PROMPT
    if "sampled" in entry:  # the draws need not emit X: the prompt ends with it, so token 1's logits are NaN
        prompt, k = PROMPT + [x], 1
    with pytest.raises(NonFiniteModelError, match=r"^the model's own forward \(not an SNLP plan\) gives NaN/inf "
                       r"logits for generated token \d+") as e:
        MODEL_CALLS[entry](m, prompt)
    msg = str(e.value)
    assert not isinstance(e.value, SNLPDivergenceError) and "\n" not in msg and "plan 4x" not in msg
    got = re.match(r".*generated token (\d+)( of prompt\(s\) \[0(, 1)?\])? \(its logits at sequence position (\d+)\)",
                   msg)
    step, pos = int(got.group(1)), int(got.group(4))
    assert pos == len(prompt) + step - 2
    if entry.startswith("sequential"):
        assert step == k and "its layers' final hidden state is already NaN/inf" in msg
    else:
        assert 1 <= step <= k
        assert ("its layers' final hidden state is already NaN/inf" in msg) == (step == k)
        assert ("masked attention" in msg) == (step < k)


def test_a_finite_model_decodes_as_before_through_the_model_check():
    """The check changes no token of a finite model: each path equals the full-prefix argmax loop."""
    m, _, _ = nan_after_token_model()
    with torch.no_grad():
        m.wte.weight.nan_to_num_(0.0)
    ref = argmax_loop(m, PROMPT, 8)
    for entry in ("sequential", "speculative", "jacobi", "jacobi-plan-verified"):
        assert MODEL_CALLS[entry](m, PROMPT).tokens == ref, entry


def test_without_the_model_the_error_claims_no_source():
    """A caller that cannot rerun the model (a distributed rank) gets the step, and no claim about where the NaN/inf
    came from that nothing checked."""
    from snlp.decode.session import NONFINITE, check_picked

    check_picked([3, 4], None, 0)  # finite tokens: nothing to say
    with pytest.raises(NonFiniteModelError) as e:
        check_picked([NONFINITE], None, 4)
    assert str(e.value) == ("the model's own forward (not an SNLP plan) gives NaN/inf logits for generated token 5; no "
                            "token is read off them (check its weights are finite)")


def _nan_token_model():
    """A depth-4 model whose token 32 has a NaN embedding row, a prompt whose greedy continuation never emits 32 and a
    second prompt; the drafter of 4xF1-h0-K1 at block 4 proposes 32 on the first."""
    from conftest import make_model

    m = make_model(seed=0, n_layer=4, sequence_len=64, scale=0.05)
    with torch.no_grad():
        m.wte.weight[32] = float("nan")
    return m, [1, 5, 9], [3, 4, 7, 8]


def test_a_rejected_nan_draft_does_not_poison_the_positions_before_it():
    """Token 32's embedding row is NaN: the model never emits it on this prompt (the naive argmax loop over the
    uncached forward of each prefix, the outside reference, stays finite and equals sequential decoding), but the
    drafter of 4xF1-h0-K1 proposes it at block 4. Greedy self-speculative decoding must still give the model's
    tokens, for the prompt alone and in a batch. A drafter whose own state is NaN is harmless (the verifier rewrites
    every slot it wrote: test_a_nan_drafter_only_costs_acceptance)."""
    m, prompt, other = _nan_token_model()
    with torch.inference_mode():
        ref = argmax_loop(m, prompt, 8)
        assert torch.isfinite(m(torch.tensor([prompt + ref]))).all() and 32 not in ref
        assert torch.isnan(m(torch.tensor([prompt + ref[:1] + [32]]))[0, :-1]).all()  # the mechanism, uncached
    assert sequential_generate(m, prompt, max_new_tokens=8).tokens == ref
    assert speculative_generate(m, prompt, "4xF1-h0-K1", block=4, max_new_tokens=8).tokens == ref
    rows = speculative_generate(m, [prompt, other], "4xF1-h0-K1", block=4, max_new_tokens=8)
    assert [r.tokens for r in rows] == [ref, sequential_generate(m, other, max_new_tokens=8).tokens]


def test_poison_tokens_at_different_layers_are_found_in_turn():
    """Token 3 is non-finite only from layer 3 (a NaN value-embedding row there), token 0 from layer 0 (a NaN
    embedding row). A round drafting [3, 4, 0] shows its lowest non-finite K/V at layer 0, at the later draft, which
    hides the earlier draft's layer-3 poison; the row must be searched again below it. Greedy speculative decoding
    equals the naive argmax loop (which never feeds 3 or 0 on these prompts), one prompt and a batch."""
    from conftest import make_model

    m = make_model(seed=0, vocab_size=5, scale=0.7)
    with torch.no_grad():
        m.value_embeds[m.ve_slot[3], 3] = float("nan")
        m.wte.weight[0] = float("nan")
    for prompt in ([1, 2, 4], [4, 1, 2], [2, 2, 1]):
        with torch.inference_mode():
            ref = argmax_loop(m, prompt, 6)
            assert torch.isfinite(m(torch.tensor([prompt + ref]))).all()
        for block in (2, 3):
            assert speculative_generate(m, prompt, "3xF2-h0-K0", block=block, max_new_tokens=6).tokens == ref
    rows = speculative_generate(m, [[1, 2, 4], [4, 1, 2]], "3xF2-h0-K0", block=3, max_new_tokens=6)
    assert [r.tokens for r in rows] == [argmax_loop(m, p, 6) for p in ([1, 2, 4], [4, 1, 2])]


@pytest.mark.slow
def test_a_rejected_nan_draft_does_not_poison_compiled_rounds():
    """The same with compiled steps: the verifier attends the whole bucketed cache under a mask, so the NaN K/V a
    rejected draft left in a slot must be rewritten by the second verify (it is: the same width, the slot holds the
    last accepted token's K/V after it)."""
    m, prompt, other = _nan_token_model()
    with torch.inference_mode():
        ref = argmax_loop(m, prompt, 8)
    assert speculative_generate(m, prompt, "4xF1-h0-K1", block=4, max_new_tokens=8, compile=True).tokens == ref
    rows = speculative_generate(m, [prompt, other], "4xF1-h0-K1", block=4, max_new_tokens=8, compile=True)
    assert [r.tokens for r in rows] == [ref, sequential_generate(m, other, max_new_tokens=8).tokens]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_poisoning_draft_keeps_the_models_law(temperature):
    """Token 4's embedding row is NaN on a vocabulary of 5 (p(4 | prompt) ~ 0.22): a run that emits 4 must raise at
    its next forward, as sequential decoding does, and a run that does not must follow the model's law. Budget 3,
    block 2: the first round drafts 2, so a poisoning draft sits at position 1 or 2. Over N seeds: the fraction of
    runs that raise is P(t1 = 4) + P(t1 != 4, t2 = 4), and the finished runs' (t1, t2) follow p(t1) p(t2 | t1) over
    t1, t2 != 4, from a naive full forward (fp32; greedy: the argmax path, which here avoids 4)."""
    from conftest import make_model

    from snlp.decode.session import NonFiniteModelError

    m = make_model(seed=5, vocab_size=5, scale=0.7)
    X, prompt = 4, [1, 2, 0]
    with torch.no_grad():
        m.wte.weight[X] = float("nan")
        p1 = torch.softmax(m(torch.tensor([prompt]))[0, -1].double(), -1)  # (5,)
        p2 = torch.stack([torch.softmax(m(torch.tensor([prompt + [a]]))[0, -1].double(), -1) if a != X
                          else torch.zeros(5, dtype=torch.float64) for a in range(5)])  # (5, 5)
    joint = p1[:, None] * p2  # (t1, t2)
    raise_p = float(p1[X] + joint[:, X].sum())
    finished = joint.clone()
    finished[X], finished[:, X] = 0, 0
    if temperature == 0:
        ref = argmax_loop(m, prompt, 3)
        assert X not in ref and speculative_generate(m, prompt, "3xF2-h0-K0", block=2, max_new_tokens=3).tokens == ref
        return
    N, raised, counts = 1000, 0, torch.zeros(5, 5, dtype=torch.float64)
    for s in range(N):
        try:
            t = speculative_generate(m, prompt, "3xF2-h0-K0", block=2, max_new_tokens=3, temperature=1.0,
                                     seed=s).tokens
        except NonFiniteModelError:
            raised += 1
            continue
        assert X not in t[:2]
        counts[t[0], t[1]] += 1
    assert abs(raised / N - raise_p) < 4 * math.sqrt(raise_p * (1 - raise_p) / N), (raised / N, raise_p)
    tv = 0.5 * (counts / counts.sum() - finished / finished.sum()).abs().sum()
    assert tv < 0.08, tv


def test_a_nan_drafter_only_costs_acceptance():
    """An adapted drafter whose suffix gives NaN at every step (NaN drafts, NaN K/V written into the shared cache)
    leaves the output the model's own: the verifier rewrites every cache slot the drafter wrote before it attends,
    and no NaN draft is accepted."""
    from conftest import make_model

    from snlp.method.drafter import make_drafter
    from snlp.method.plan import Plan

    m = make_model(seed=0, n_layer=4, sequence_len=64, scale=0.05)
    d = make_drafter(m, Plan.parse("2xF1-h0-K1"))
    with torch.no_grad():
        d.model.blocks[3].mlp.c_proj.weight[0, 0] = float("nan")  # the drafter's own suffix copy only
    prompts = [[1, 5, 9], [3, 4, 7, 8]]
    seq = [sequential_generate(m, p, max_new_tokens=12).tokens for p in prompts]
    for block in (1, 4):
        r = speculative_generate(m, prompts[0], "2xF1-h0-K1", block=block, max_new_tokens=12, drafter=d)
        assert r.tokens == seq[0] and r.accepted == 0 and r.drafted > 0
        assert [x.tokens for x in speculative_generate(m, prompts, "2xF1-h0-K1", block=block, max_new_tokens=12,
                                                       drafter=d)] == seq

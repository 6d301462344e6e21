"""What the decoding functions do with the prompt, budget, sampling and stop arguments a Python caller may pass:
each form either decodes exactly as the plain list of ids does (checked against a full-forward greedy loop), or is
refused with one ValueError / TypeError that names the argument, raised in snlp's own argument checks before any
forward (never an error from inside int(), numpy, torch.Generator or a transformers model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import argmax_loop, make_model

import snlp
from snlp.decode.jacobi import jacobi_generate
from snlp.decode.speculative import speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")

PLAN = "3xF1-h0-K1"
DECODERS = {
    "sequential": lambda m, p, **kw: snlp.sequential_generate(m, p, **kw),
    "snlp": lambda m, p, **kw: snlp.snlp_generate(m, p, PLAN, **kw),
    "speculative": lambda m, p, **kw: speculative_generate(m, p, PLAN, block=3, **kw),
}


@pytest.fixture(scope="module")
def model():
    return make_model(n_layer=4)


def _no_forward(model, monkeypatch):
    """Make any forward of `model` fail loudly: a refusal must come before the first one."""
    def boom(*a, **k):
        raise AssertionError("a forward ran before the refusal")
    monkeypatch.setattr(model, "forward", boom)
    monkeypatch.setattr(model, "embed", boom)


@pytest.mark.parametrize("name", DECODERS)
def test_numpy_prompts_decode_as_their_lists(model, name):
    dec = DECODERS[name]
    one, two = (3, 1, 4, 1, 5), (9, 2, 6)
    # the reference: the list form; sequential and speculative (exact) also equal a full-forward greedy loop
    ref = {p: dec(model, p, max_new_tokens=6).tokens for p in (one, two, (2, 7, 1, 8, 2))}
    if name != "snlp":
        assert ref == {p: argmax_loop(model, list(p), 6) for p in ref}
    assert dec(model, np.array(one), max_new_tokens=6).tokens == ref[one]
    assert dec(model, np.array([one]), max_new_tokens=6).tokens == ref[one]  # (1, T): one prompt
    rows = dec(model, np.array([one, [2, 7, 1, 8, 2]]), max_new_tokens=6)  # (B, T): a batch
    assert [r.tokens for r in rows] == [ref[one], ref[2, 7, 1, 8, 2]]
    rows = dec(model, [np.array(one), np.array(two)], max_new_tokens=6)  # a list of arrays: a ragged batch
    assert [r.tokens for r in rows] == [ref[one], ref[two]]


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("prompt, match", [
    ("ROMEO:", "prompt is text"),
    (b"ROMEO:", "prompt is text"),
    (["ROMEO:", "JULIET:"], "prompt is text"),
    ([1.5, 2.0], "token ids must be integers"),
    (torch.tensor([1.0, 2.0]), "integer dtype"),
    (torch.tensor([True, False]), "integer dtype"),
    (np.array([1.5, 2.0]), "integer dtype"),
    ([[1, 2], [3.5]], "token ids must be integers"),
    # a bool is no id, as a Python bool or as a 0-d bool tensor (operator.index read it as 0 or 1)
    ([True, 2], "token ids must be integers"),
    ([torch.tensor(True), 2], "token ids must be integers"),
    ([[torch.tensor(2), torch.tensor(False)], [3]], "token ids must be integers"),
])
def test_a_prompt_that_is_not_token_ids_is_refused_before_any_forward(model, monkeypatch, name, prompt, match):
    _no_forward(model, monkeypatch)
    with pytest.raises(ValueError, match=match):
        DECODERS[name](model, prompt, max_new_tokens=3)


def test_jacobi_refuses_text_and_float_prompts(model):
    with pytest.raises(ValueError, match="prompt is text"):
        jacobi_generate(model, "hi", PLAN, max_new_tokens=3)
    with pytest.raises(ValueError, match="token ids must be integers"):
        jacobi_generate(model, [1.5], PLAN, max_new_tokens=3)


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("kw, match", [
    (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
    (dict(max_new_tokens=np.int64(3)), r"max_new_tokens must be an integer >= 0 \(got .*numpy.int64: pass int"),
    (dict(temperature="0.7"), "temperature must be a finite number"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(temperature=1.0, seed="7"), "seed must be an integer"),
    (dict(temperature=1.0, seed=1.5), "seed must be an integer"),
    (dict(eos_id=61), r"eos_id .* outside the model's vocabulary \[0, 61\)"),
    (dict(eos_id=[3, 10 ** 6]), r"outside the model's vocabulary"),
    (dict(on_tokens=5), "on_tokens must be callable"),
])
def test_bad_decode_arguments_are_refused_before_any_forward(model, monkeypatch, name, kw, match):
    _no_forward(model, monkeypatch)
    kw = {"max_new_tokens": 3, **kw}
    with pytest.raises((ValueError, TypeError), match=match):
        DECODERS[name](model, [1, 2, 3], **kw)


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("prompt", [[1, 2, 3], [[1, 2, 3], [4, 5]]], ids=["one prompt", "a ragged batch"])
def test_a_seed_with_greedy_decoding_is_refused_before_any_forward(model, monkeypatch, name, prompt):
    """Greedy decoding (temperature 0) draws nothing, so a seed could not act: refused in one line as
    `snlp generate --seed` is (it used to be ignored silently); with a temperature > 0 the same seed is taken."""
    _no_forward(model, monkeypatch)
    with pytest.raises(ValueError, match=r"^seed seeds sampling; greedy decoding \(temperature 0\) draws nothing: "
                                         r"give a temperature > 0 or drop seed \(got seed=0\)$"):
        DECODERS[name](model, prompt, max_new_tokens=3, seed=0)
    with pytest.raises(ValueError, match="^seed seeds sampling"):
        DECODERS[name](model, prompt, max_new_tokens=3, temperature=0.0, seed=np.int64(7))
    monkeypatch.undo()
    DECODERS[name](model, prompt, max_new_tokens=2, temperature=0.5, seed=0)


@pytest.mark.parametrize("call, name", [
    (lambda m, v: snlp.sequential_generate(m, [1, 2], max_new_tokens=2, compile=v), "compile"),
    (lambda m, v: snlp.snlp_generate(m, [1, 2], PLAN, max_new_tokens=2, compile=v), "compile"),
    (lambda m, v: speculative_generate(m, [1, 2], PLAN, max_new_tokens=2, compile=v), "compile"),
    (lambda m, v: speculative_generate(m, [1, 2], PLAN, max_new_tokens=2, share_weights=v), "share_weights"),
    (lambda m, v: speculative_generate(m, [[1, 2], [3]], PLAN, max_new_tokens=2, adaptive=v), "adaptive"),
    (lambda m, v: jacobi_generate(m, [1, 2], PLAN, max_new_tokens=2, verify=v), "verify"),
    (lambda m, v: jacobi_generate(m, [1, 2], PLAN, max_new_tokens=2, warm_start=v), "warm_start"),
])
def test_boolean_options_are_true_or_false_before_any_forward(model, monkeypatch, call, name):
    """`compile="no"` used to compile (a truthy string) and `verify=0` to skip the exact check; every boolean
    option of the decode functions is refused in one line naming it unless it is True or False (numpy's too)."""
    _no_forward(model, monkeypatch)
    for bad in ("no", "False", 1, None, 0.0):
        with pytest.raises(ValueError, match=rf"^{name} must be True or False \(got {bad!r} of type \w+\)$"):
            call(model, bad)
    monkeypatch.undo()
    call(model, np.bool_(False))


def test_the_speculative_benchmark_refuses_a_seed_with_greedy_decoding(model, monkeypatch):
    from snlp.decode.speculative import speculative_benchmark

    _no_forward(model, monkeypatch)
    with pytest.raises(ValueError, match="^seed seeds sampling; greedy decoding"):
        speculative_benchmark(model, [[1, 2, 3]], PLAN, max_new_tokens=3, seed=0)
    monkeypatch.undo()
    greedy, _ = speculative_benchmark(model, [[1, 2, 3]], PLAN, max_new_tokens=3, repeats=1, warmup=0)
    assert greedy[0].matches_sequential


def test_a_streaming_callback_of_the_wrong_shape_is_refused_before_any_forward(model, monkeypatch):
    _no_forward(model, monkeypatch)
    with pytest.raises(TypeError, match=r"cannot be called as on_tokens\(prompt_index, new_tokens\) for a batch"):
        snlp.sequential_generate(model, [[1, 2], [3, 4, 5]], max_new_tokens=3, on_tokens=lambda new: None)
    with pytest.raises(TypeError, match=r"cannot be called as on_tokens\(new_tokens\) for one prompt"):
        snlp.snlp_generate(model, [1, 2], PLAN, max_new_tokens=3, on_tokens=lambda i, new: None)


def test_evaluate_refuses_a_tokenizer_that_cannot_decode_before_any_forward(model, monkeypatch):
    _no_forward(model, monkeypatch)
    with pytest.raises(TypeError, match="tokenizer must be the model's tokenizer"):
        snlp.evaluate(model, torch.arange(200) % 61, [PLAN], tokenizer="gpt2")


def test_a_transformers_model_is_refused_with_the_way_to_convert_it():
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1)).eval()
    idx = torch.tensor([[1, 2, 3]])
    calls = [lambda: snlp.sequential_generate(hf, [1, 2]), lambda: snlp.snlp_generate(hf, [1, 2], "2xF1-h0-K1"),
             lambda: speculative_generate(hf, [1, 2], "2xF1-h0-K1"), lambda: jacobi_generate(hf, [1, 2]),
             lambda: snlp.parallel_forward(hf, idx, "2xF1-h0-K1"), lambda: snlp.bind(hf, "2xF1-h0-K1"),
             lambda: snlp.fused_forward(hf, idx, "1xF2-h0-K1"), lambda: snlp.solve(hf, idx, "2xF1-h0-K1"),
             lambda: snlp.evaluate(hf, torch.arange(300) % 32, ["2xF1-h0-K1"])]
    for call in calls:
        with pytest.raises(TypeError, match=r"LlamaForCausalLM .*not an snlp GPT.*snlp\.from_hf"):
            call()


def test_token_ids_on_another_device_than_the_model_are_refused_by_name(model):
    """torch's own error ("Expected all tensors to be on the same device ... index_select") names neither tensor; the
    meta device stands in for a GPU on a CPU-only machine."""
    idx = torch.zeros(1, 3, dtype=torch.long, device="meta")
    for call in (lambda: model(idx), lambda: snlp.parallel_forward(model, idx, PLAN),
                 lambda: snlp.bind(model, PLAN)(idx), lambda: snlp.fused_forward(model, idx, "2xF2-h0-K1")):
        with pytest.raises(ValueError, match=r"token ids are on meta but the model is on cpu: move them first"):
            call()


def test_a_drafter_given_as_a_path_is_refused_in_one_line_before_any_forward(model, monkeypatch):
    """speculative_generate(drafter="runs/drafter") failed with "'str' object has no attribute 'check'" from inside
    the drafter checks; it now names the type and the loader."""
    _no_forward(model, monkeypatch)
    for d in ("runs/drafter", object()):
        with pytest.raises(ValueError, match=r"drafter must be a snlp.method.drafter.Drafter .*load_drafter"):
            snlp.speculative_generate(model, [1, 2, 3], PLAN, max_new_tokens=3, drafter=d)


def test_a_prebuilt_step_of_another_model_or_plan_is_refused_before_any_forward(model, monkeypatch):
    """`step=` / `draft=` / `verify=` pass prebuilt steps so calls share compiled graphs; one built for another model
    or plan decoded with it under this call's model and plan label: sequential_generate(a, step=sequential_step(b))
    returned b's tokens, snlp_generate(a, '6xF1-h0-K6', step=<3xF1-h0-K1>) the 3xF1 plan's labelled 6xF1, and a
    verifier of another model broke speculative decoding's exactness. Each is refused before any forward; steps
    of this model and plan decode as without them (an adapted drafter's step drafts for its base: any module).
    compile=True beside an eager step is refused too (it ran eagerly)."""
    from snlp.decode.steps import sequential_step, snlp_step
    from snlp.method.drafter import make_drafter
    from snlp.method.solver import bind

    other = make_model(seed=5, n_layer=4)
    prompt, ref = [1, 2, 3], argmax_loop(model, [1, 2, 3], 6)
    runner = lambda m, plan: snlp_step(bind(m, plan, check_finite=False))  # noqa: E731
    refused = [
        (lambda: snlp.sequential_generate(model, prompt, 6, step=sequential_step(other)), "step= .* another model"),
        (lambda: snlp.sequential_generate(model, prompt, 6, step=runner(model, PLAN)), "step= computes the SNLP"),
        (lambda: snlp.snlp_generate(model, prompt, "4xF1-h0-K4", 6, step=runner(model, PLAN)),
         "plan 3xF1-h0-K1, but this call decodes with the SNLP forward of plan 4xF1-h0-K4"),
        (lambda: snlp.snlp_generate(model, prompt, PLAN, 6, step=runner(other, PLAN)), "another model"),
        (lambda: speculative_generate(model, prompt, PLAN, 3, 6, verify=sequential_step(other)), "verify= .* another"),
        (lambda: speculative_generate(model, prompt, PLAN, 3, 6, verify=runner(model, PLAN)), "verify= computes the"),
        (lambda: speculative_generate(model, prompt, PLAN, 3, 6, draft=runner(model, "2xF2-h0-K1")), "draft= comp"),
        # compile=True beside an eager step ran eagerly, the flag ignored
        (lambda: snlp.sequential_generate(model, prompt, 6, compile=True, step=sequential_step(model)), "eager step"),
        (lambda: snlp.snlp_generate(model, prompt, PLAN, 6, compile=True, step=runner(model, PLAN)), "eager step"),
        (lambda: speculative_generate(model, prompt, PLAN, 3, 6, compile=True, verify=sequential_step(model)),
         "the verify= passed is an eager step"),
    ]
    for call, says in refused:
        with monkeypatch.context() as m:
            _no_forward(model, m)
            _no_forward(other, m)
            with pytest.raises(ValueError, match=says):
                call()
    d = make_drafter(model, PLAN)
    assert snlp.sequential_generate(model, prompt, 6, step=sequential_step(model)).tokens == ref
    assert snlp.snlp_generate(model, prompt, PLAN, 6, step=runner(model, PLAN)).tokens == \
        snlp.snlp_generate(model, prompt, PLAN, 6).tokens
    assert speculative_generate(model, prompt, PLAN, 3, 6, draft=runner(d.model, PLAN),
                                verify=sequential_step(model)).tokens == ref


def test_a_prompt_of_the_wrong_shape_is_told_what_a_prompt_and_a_batch_are(model):
    """A (2, 2, 3) or (0, 3) tensor was refused with "(batched decoding is not supported)", which these decoders
    do support (a list of prompts, a (B, T) tensor); now the shape alone is named. A bad prompt inside a batch is
    named by its index."""
    for name, decode in DECODERS.items():
        for bad in (torch.zeros(2, 2, 3, dtype=torch.long), torch.zeros(0, 3, dtype=torch.long)):
            with pytest.raises(ValueError) as e:
                decode(model, bad, max_new_tokens=2)
            assert "not supported" not in str(e.value) and f"got shape {tuple(bad.shape)}" in str(e.value), name
        with pytest.raises(ValueError, match=r"^prompt 1 of the batch: prompt must contain at least one token"):
            decode(model, [[1, 2], [], [3]], max_new_tokens=2)


@pytest.mark.parametrize("name", [*DECODERS, "jacobi"])
def test_a_meta_tensor_or_a_generator_prompt_is_refused_before_any_forward(model, monkeypatch, name):
    """A meta tensor holds no ids: torch's "Cannot copy out of meta tensor; no data!" came from inside the checks. A
    generator was read once by the argument checks and again by the session, so it was reported as an empty prompt
    ("must contain at least one token") though it held four."""
    _no_forward(model, monkeypatch)
    dec = DECODERS.get(name, lambda m, p, **kw: jacobi_generate(m, p, PLAN, block=3, **kw))
    with pytest.raises(ValueError, match=r"prompt token ids are a meta tensor, which holds no values"):
        dec(model, torch.tensor([3, 1, 4]).to("meta"), max_new_tokens=3)
    with pytest.raises(ValueError, match=r"prompt must be a list of ids, .* got generator"):
        dec(model, (i for i in [3, 1, 4, 1]), max_new_tokens=3)


def test_jacobi_without_a_plan_refuses_a_preheat_calibration_before_any_forward(model, monkeypatch):
    """jacobi_generate(plan=None, preheat=...) decoded with the sequential model's forwards and dropped the
    calibration without a word (with an h0 plan the same calibration is refused)."""
    from snlp.method.preheat import CalibrateConfig, fit
    pre = fit(model, CalibrateConfig(rank=2, batch=2, seq_len=8))
    _no_forward(model, monkeypatch)
    with pytest.raises(ValueError, match=r"preheat= is the calibration of a -preheat- plan; without a plan"):
        jacobi_generate(model, [1, 2, 3], None, preheat=pre, max_new_tokens=3)


@pytest.mark.parametrize("name", [*DECODERS, "jacobi"])
def test_a_sequence_prompt_decodes_as_its_list_and_a_set_is_refused(model, name):
    """The generator check refused every type but list / tuple / range / tensor: a deque or an array.array of ids,
    which read the same twice and decoded as their list before it, became "prompt must be a list of ids". Any
    sequence is taken again; one-shot iterators and unordered sets stay refused."""
    import array
    import collections

    dec = DECODERS.get(name, lambda m, p, **kw: jacobi_generate(m, p, PLAN, block=3, **kw))
    want = dec(model, [3, 1, 4, 1], max_new_tokens=3).tokens
    for seq in (collections.deque([3, 1, 4, 1]), array.array("l", [3, 1, 4, 1])):
        assert dec(model, seq, max_new_tokens=3).tokens == want, type(seq).__name__
    for bad in (iter([3, 1, 4, 1]), {3, 1, 4}):
        with pytest.raises(ValueError, match=rf"prompt must be a list of ids, .* got {type(bad).__name__}"):
            dec(model, bad, max_new_tokens=3)


@pytest.mark.parametrize("name", DECODERS)
def test_a_0d_tensor_eos_id_stops_where_its_int_does_and_a_2d_one_is_refused(model, monkeypatch, name):
    """A 0-d tensor eos_id was refused as no token id while a 1-D one was taken; transformers' generate(eos_token_id=)
    takes a 0-d tensor as one id (it unsqueezes it). Reference: the full-forward greedy loop stopping at that id;
    a 2-D eos_id (a nested list as a tensor) is neither an id nor a list of them: refused in one line, before any
    forward."""
    dec = DECODERS[name]
    prompt = [3, 1, 4, 1, 5]
    free = argmax_loop(model, prompt, 8)
    eos = free[3]  # stops there (or earlier, where it came first)
    want = argmax_loop(model, prompt, 8, eos)
    assert len(want) < len(free) and want[-1] == eos
    for form in (eos, [eos], torch.tensor(eos), torch.tensor([eos]), np.int64(eos), np.array(eos)):
        got = dec(model, prompt, max_new_tokens=8, eos_id=form).tokens
        if name != "snlp":
            assert got == want, form
        assert got == dec(model, prompt, max_new_tokens=8, eos_id=eos).tokens, form
    _no_forward(model, monkeypatch)
    for bad in (torch.tensor([[eos]]), torch.tensor(True), torch.tensor(float(eos))):
        with pytest.raises(ValueError, match="eos_id must be a token id") as err:
            dec(model, prompt, max_new_tokens=8, eos_id=bad)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", DECODERS)
def test_an_iterator_or_bool_eos_id_is_refused_not_decoded_past(model, monkeypatch, name):
    """A generator or iter() eos_id was read by the input checks and again by the session, which then found no stop
    id: decoding ran past eos (the full-forward greedy loop stops there), silently. A bool inside a list ran as the
    id 0 or 1. Each is refused in one line before any forward; a tuple, set or range of ids stops as the list does."""
    dec = DECODERS[name]
    prompt = [3, 1, 4, 1, 5]
    free = argmax_loop(model, prompt, 8)
    eos = free[3]
    want = dec(model, prompt, max_new_tokens=8, eos_id=[eos]).tokens
    assert want == argmax_loop(model, prompt, 8, eos) or name == "snlp"
    for form in ((eos,), {eos}, range(eos, eos + 1)):
        assert dec(model, prompt, max_new_tokens=8, eos_id=form).tokens == want, form
    _no_forward(model, monkeypatch)
    # a 0-d bool tensor or numpy bool inside a list is a bool too (a bare one, of bool dtype, is refused already)
    for bad in ((i for i in [eos]), iter([eos]), [True], [eos, False], [torch.tensor(True)], [eos, torch.tensor(False)],
                [np.True_]):
        with pytest.raises(ValueError, match="eos_id must be a token id") as err:
            dec(model, prompt, max_new_tokens=8, eos_id=bad)
        assert "\n" not in str(err.value)

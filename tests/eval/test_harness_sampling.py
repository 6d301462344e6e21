"""Sampled generate_until of the snlp harness model: a task that asks to sample with no temperature (do_sample true,
temperature 0 or unset) is refused as transformers' generate (the hf model's) refuses it, not decoded greedily; the
seed= model arg is an integer, never a truncated float or a boolean that model_args would then record as another
seed."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import make_model  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from snlp.eval.harness import SNLPLM  # noqa: E402
from snlp.io.tokenizer import Tokenizer  # noqa: E402


def _tiny():
    tok = Tokenizer.train(["the cat sat on the mat. a dog ran in the park. " * 4], 300)
    return make_model(vocab_size=tok.vocab_size, n_layer=2, sequence_len=64, window_pattern="L"), tok


def _reqs(args):
    return [Instance(request_type="generate_until", doc={}, arguments=a, idx=0) for a in args]


@pytest.mark.parametrize("gen", [{"do_sample": True}, {"do_sample": True, "temperature": 0.0},
                                 {"do_sample": True, "temperature": 0}])
def test_do_sample_without_a_temperature_is_refused_as_transformers_refuses_it(gen, monkeypatch):
    """The reference: transformers' generate(do_sample=True, temperature=0.0), which lm-eval's hf model calls for such
    a task (its _model_generate sets a missing temperature to 0.0), raises. snlp decoded the task greedily: answers
    of another decoding than the task asked for, silently. Now refused, before anything is decoded."""
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).eval()
    with pytest.raises(ValueError, match="temperature"):
        hf.generate(torch.tensor([[1, 2]]), do_sample=True, temperature=0.0, max_new_tokens=2, pad_token_id=0)
    model, tok = _tiny()
    lm = SNLPLM(pretrained=model, tokenizer=tok)
    monkeypatch.setattr(lm, "_generate", lambda *a, **k: pytest.fail("decoded before the refusal"))
    with pytest.raises(ValueError, match=r"do_sample=True with temperature 0 \(or none\)") as err:
        lm.generate_until(_reqs([("the cat", {"until": ["."], "max_gen_toks": 4, **gen})]))
    assert "\n" not in str(err.value)


def test_a_greedy_task_with_a_temperature_stays_greedy():
    """do_sample false is greedy whatever the temperature (normalize_gen_kwargs sets it to 0), as before."""
    model, tok = _tiny()
    lm = SNLPLM(pretrained=model, tokenizer=tok)
    base = {"until": ["."], "max_gen_toks": 4, "do_sample": False}
    assert lm.generate_until(_reqs([("the cat", {**base, "temperature": 0.7})])) == \
        lm.generate_until(_reqs([("the cat", base)]))


@pytest.mark.parametrize("seed", [1.7, True, "abc", None, 2 ** 64, -2 ** 63 - 1])
def test_a_seed_that_is_not_an_integer_is_refused(seed):
    """seed=1.7 was int()-truncated to 1 (and model_args recorded seed=1), True read as 1; a seed past 64 bits was
    taken and failed only at the first sampled batch."""
    model, tok = _tiny()
    with pytest.raises(ValueError, match="seed") as err:
        SNLPLM(pretrained=model, tokenizer=tok, seed=seed)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("seed, want", [(7, 7), ("7", 7), (-3, -3), (2 ** 64 - 1, 2 ** 64 - 1)])
def test_an_integer_seed_is_taken_and_recorded_as_given(seed, want):
    model, tok = _tiny()
    lm = SNLPLM(pretrained=model, tokenizer=tok, seed=seed)
    assert lm.seed == want and f"seed={want}," in lm.model_args


def _transformers_default(name):
    """transformers' own default filter: GenerationConfig's field (4.x), else the global default generate() fills a
    None field with (5.x)."""
    g = transformers.GenerationConfig()
    value = getattr(g, name)
    if value is None and hasattr(g, "_get_default_generation_params"):
        value = g._get_default_generation_params()[name]
    return value


@pytest.mark.parametrize("task, config, ignore, want", [
    ({}, {}, False, ("default", "default")),
    ({}, {"top_k": 20, "top_p": 0.9}, False, (20, 0.9)),
    ({"top_k": 0}, {"top_k": 20}, False, (0, "default")),
    ({"top_p": 0.8}, {}, False, ("default", 0.8)),
    ({}, {"top_k": 20, "top_p": 0.9}, True, ("default", "default")),
])
def test_a_sampled_task_without_filters_gets_the_ones_transformers_generate_applies(task, config, ignore, want,
                                                                                     monkeypatch):
    """The hf model's generate() merges the task's kwargs over the model's generation config, whose unset filters
    are transformers' defaults (top_k 50): a sampled task without top_k drew from the whole vocabulary here and from
    the 50 likeliest tokens there, and a generation config's top_k / top_p were neither applied nor refused."""
    model, tok = _tiny()
    bos = tok.tok.id_to_token(tok.bos_id)
    tok = Tokenizer(tok.tok, {"bos_token": bos, "eos_token": bos, "generation_config": config})  # a converted one
    lm = SNLPLM(pretrained=model, tokenizer=tok, ignore_generation_config=ignore)
    seen = []
    monkeypatch.setattr(lm, "_generate", lambda prompts, max_new, temperature, first, top_k, top_p, *a:
                        seen.append((top_k, top_p)) or [[] for _ in prompts])
    lm.generate_until(_reqs([("the cat", {"until": ["."], "max_gen_toks": 4, "do_sample": True, "temperature": 0.7,
                                          **task})]))
    want = tuple(_transformers_default(k) if w == "default" else w for k, w in zip(("top_k", "top_p"), want))
    assert seen == [want] and want[0] in (0, 20, 50)


def _hf_filters(task: dict, config: dict) -> tuple:
    """The reference: the top_k / top_p transformers' generate() samples with for the task's kwargs (lm-eval's hf
    model passes them through unchanged, explicit nulls included) over a model whose generation config is `config`,
    read from generate's own config merge; None / 0 / 1.0 is no filter (snlp's 0 / 1.0)."""
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2))
    hf.generation_config = transformers.GenerationConfig(**config)
    g, _ = hf._prepare_generation_config(None, do_sample=True, temperature=0.7, **task)
    return (0 if g.top_k is None else g.top_k, 1.0 if g.top_p is None else g.top_p)


@pytest.mark.parametrize("task, config", [
    ({}, {}), ({"top_k": None}, {}), ({"top_k": None}, {"top_k": 20}), ({"top_p": None}, {"top_p": 0.9}),
    ({"top_k": None, "top_p": None}, {"top_k": 20, "top_p": 0.9}), ({}, {"top_k": 20}), ({"top_k": 7}, {"top_k": 20}),
])
def test_a_sampled_tasks_filters_are_the_ones_transformers_generate_samples_with(task, config, monkeypatch):
    """A task that writes `top_k: null` (or `top_p: null`) passes None to the hf model's generate(), which then
    filters nothing (the call's None overrides the config and transformers' default 50): it is the no-op value, as
    GEN_NOOPS says, not a filter left out (the config's or top_k 50)."""
    model, tok = _tiny()
    bos = tok.tok.id_to_token(tok.bos_id)
    tok = Tokenizer(tok.tok, {"bos_token": bos, "eos_token": bos, "generation_config": config})
    lm = SNLPLM(pretrained=model, tokenizer=tok)
    seen = []
    monkeypatch.setattr(lm, "_generate", lambda prompts, max_new, temperature, first, top_k, top_p, *a:
                        seen.append((top_k, top_p)) or [[] for _ in prompts])
    lm.generate_until(_reqs([("the cat", {"until": ["."], "max_gen_toks": 4, "do_sample": True, "temperature": 0.7,
                                          **task})]))
    assert seen == [_hf_filters(task, config)]

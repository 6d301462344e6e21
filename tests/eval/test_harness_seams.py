"""Seams of the snlp harness model found by independent reviews: each against the harness's own `hf`
model (HFLM) on the same tiny random Llama saved as a transformers directory, or against a naive loop written here.
A DiagN plan's scores do not depend on the batch; a stop string that is a special token stops generation; snlp's
own tokenizer scores a rolling document once from BOS; an explicit add_bos_token=False is honoured; a template
without a system role drops the system turn, as the hf model does. Second review (rev-harness): identical sampled
requests draw their own samples; a caller's model and drafter are never converted; a drafter with a preheat plan
is refused for its real reason; no-op generation options are accepted, the others refused; model_args values
round-trip through the harness's parser (a ',' is refused)."""

from __future__ import annotations

import json
import os
import shutil
import re

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import transformers  # noqa: E402
from conftest import make_model  # noqa: E402
from harness_fixtures import tasks  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from tokenizers import Tokenizer as HFTok  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, processors  # noqa: E402

from lm_eval.utils import simple_parse_args_string  # noqa: E402

from snlp.eval.harness import SNLPLM, model_arg  # noqa: E402
from snlp.io.tokenizer import Tokenizer  # noqa: E402
from snlp.method.drafter import make_drafter  # noqa: E402

V = 64
FIXTURES = (tasks,)  # pytest finds the fixture by its name in this module


def _word_tok(bos_post: bool = False, template: str | None = None):
    vocab = {f"t{i}": i for i in range(V - 3)} | {"<s>": V - 3, "</s>": V - 2, "<unk>": V - 1}
    tok = HFTok(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    if bos_post:  # Llama-style: the post-processor prepends <s>
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", V - 3)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", chat_template=template)


def _tiny_dir(path, bos_post=False, template=None):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                   bos_token_id=V - 3, eos_token_id=V - 2, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0)  # sharper distributions: greedy answers are not all one token
    m.save_pretrained(path)
    _word_tok(bos_post, template).save_pretrained(path)
    return path


def _reqs(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


def test_a_special_token_stop_string_stops_generation(tmp_path):
    """until=[w] where w is a special token (an end-of-turn marker that is not EOS): it vanished from the
    skip-special decoding the answer was cut from, so generation went on past it."""
    d = _tiny_dir(tmp_path / "m")
    free = SNLPLM(pretrained=str(d), dtype="float64").generate_until(
        _reqs("generate_until", [("t4", {"until": [], "max_gen_toks": 12, "do_sample": False})]))[0].split()
    stop = free[3]  # a word the greedy answer reaches, made a special token of the tokenizer
    t = transformers.AutoTokenizer.from_pretrained(str(d))
    t.add_special_tokens({"additional_special_tokens": [stop]})
    t.save_pretrained(d)
    g = _reqs("generate_until", [("t4", {"until": [stop], "max_gen_toks": 12, "do_sample": False})])
    hf = HFLM(pretrained=str(d), device="cpu", batch_size=1, dtype="float64").generate_until(g)
    ours = SNLPLM(pretrained=str(d), dtype="float64").generate_until(g)
    assert ours == hf
    assert ours[0].split() == free[:free.index(stop)]  # cut before the stop word's first occurrence


@pytest.mark.parametrize("add_bos", [None, True, False])
def test_add_bos_token_as_the_hf_model(tmp_path, add_bos):
    d = _tiny_dir(tmp_path / "m", bos_post=True)
    kw = {} if add_bos is None else {"add_bos_token": add_bos}
    hf = HFLM(pretrained=str(d), device="cpu", batch_size=1, dtype="float64", **kw)
    ours = SNLPLM(pretrained=str(d), dtype="float64", **kw)
    assert ours.tok_encode("t1 t2") == hf.tok_encode("t1 t2")
    ll = _reqs("loglikelihood", [("t1 t2", " t3 t4")])
    assert ours.loglikelihood(ll)[0][0] == pytest.approx(hf.loglikelihood(ll)[0][0], abs=1e-6)
    roll = _reqs("loglikelihood_rolling", [("t1 t2 t3 t4 t5",)])
    assert ours.loglikelihood_rolling(roll)[0] == pytest.approx(hf.loglikelihood_rolling(roll)[0], abs=1e-6)


def test_a_template_without_a_system_role_drops_the_system_turn(tmp_path):
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
                "{% endif %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant{% endif %}")
    d = _tiny_dir(tmp_path / "m", template=template)
    chat = [{"role": "system", "content": "t1 t2"}, {"role": "user", "content": "t3 t4"}]
    hf = HFLM(pretrained=str(d), device="cpu", batch_size=1, dtype="float64")
    assert SNLPLM(pretrained=str(d), dtype="float64").apply_chat_template(chat) == hf.apply_chat_template(chat)


def test_own_tokenizer_rolling_document_is_scored_once_from_bos():
    """snlp's own tokenizer adds BOS to a document and the harness prepends its prefix token: the score included
    log p(BOS | BOS). Reference: the naive sum of log p(token | <|bos|>, earlier tokens)."""
    tok = Tokenizer.train(["the cat sat on the mat. a dog ran in the park. " * 4], 300)
    model = make_model(vocab_size=tok.vocab_size, n_layer=3, sequence_len=128, window_pattern="L")
    doc = "the cat sat on the mat. a dog ran"
    got = SNLPLM(pretrained=model, tokenizer=tok, dtype="float64").loglikelihood_rolling(
        _reqs("loglikelihood_rolling", [(doc,)]))[0]
    ids = [tok.bos_id] + tok.encode(doc)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), -1)
    assert got == pytest.approx(sum(float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1)), abs=1e-9)


@pytest.mark.parametrize("plan", ["7xF1-h0-K2-diag:fd-probes:2", "7xF1-h0-K1-diag-subset:0.3"])
def test_diag_plan_scores_do_not_depend_on_the_batch(plan):
    """DiagN draws its probes with the shape of the whole padded batch: a request's score moved by up to 2.6."""
    tok = Tokenizer.train(["the cat sat on the mat. a dog ran in the park. " * 4], 300)
    model = make_model(seed=5, vocab_size=tok.vocab_size, n_layer=8, sequence_len=64, window_pattern="L")
    pairs = [("the cat sat on the mat. a dog ran in the park. the cat", " sat on the mat"), ("a", " in"),
             ("the", " park. a cat"), ("a dog", " mat")]
    reqs = _reqs("loglikelihood", pairs)
    one = SNLPLM(pretrained=model, tokenizer=tok, plan=plan, batch_size=1, dtype="float64").loglikelihood(reqs)
    four = SNLPLM(pretrained=model, tokenizer=tok, plan=plan, batch_size=4, dtype="float64").loglikelihood(reqs)
    assert [a[0] for a in one] == pytest.approx([b[0] for b in four], abs=1e-10)


def test_bad_block_and_max_length_are_refused_up_front():
    tok = Tokenizer.train(["the cat sat on the mat. " * 4], 300)
    model = make_model(vocab_size=tok.vocab_size, n_layer=3)
    with pytest.raises(ValueError, match="block"):
        SNLPLM(pretrained=model, tokenizer=tok, plan="2xF1-h0-K1", decode="speculative", block=0)
    with pytest.raises(ValueError, match="max_length"):
        SNLPLM(pretrained=model, tokenizer=tok, max_length=0)


def _own_tiny(n_layer=3, **kw):
    tok = Tokenizer.train(["the cat sat on the mat. a dog ran in the park. " * 4], 300)
    return make_model(vocab_size=tok.vocab_size, n_layer=n_layer, sequence_len=64, window_pattern="L", **kw), tok


def test_sampled_requests_draw_their_own_samples():
    """A task with `repeats: N` and do_sample sends one request N times: every batch was re-seeded with seed=, so the
    N answers were ~batch_size distinct samples (at batch 1 all identical). Now the r-th request decoded in a call
    draws from seed + r: reference, a naive loop sampling softmax(logits / T) (top 50) of the full forward from a generator
    seeded 1234 + r, at batch 1 and 4; the same seed gives the same answers, another seed others."""
    model, tok = _own_tiny()
    g = {"until": [], "max_gen_toks": 8, "do_sample": True, "temperature": 5.0}
    reqs = _reqs("generate_until", [("the cat", dict(g))] * 8)
    lm = SNLPLM(pretrained=model, tokenizer=tok, dtype="float64")
    prompt = lm.tok_encode("the cat")

    def naive(seed):
        gen, ids = torch.Generator().manual_seed(seed), list(prompt)
        for _ in range(8):
            with torch.no_grad():
                x = model(torch.tensor([ids]))[0, -1].float() / 5.0
            if x.numel() > 50:  # the hf model's generate filters to transformers' default top_k 50 (no task top_k)
                x = x.masked_fill(x < torch.topk(x, 50).values[-1:], -torch.inf)
            probs = torch.softmax(x, -1)
            ids.append(int(torch.multinomial(probs, 1, generator=gen)))
            if ids[-1] in (lm.eot_token_id, tok.token_id("<|assistant_end|>")):  # nanochat's end of a reply
                break
        return lm.tok_decode(ids[len(prompt):])

    ref = [naive(1234 + r) for r in range(8)]
    assert len(set(ref)) == 8
    for bs in (1, 4):
        assert SNLPLM(pretrained=model, tokenizer=tok, batch_size=bs).generate_until(reqs) == ref, bs
    assert SNLPLM(pretrained=model, tokenizer=tok, batch_size=4).generate_until(reqs) == ref  # one seed: one answer
    other = SNLPLM(pretrained=model, tokenizer=tok, batch_size=4, seed=7).generate_until(reqs)
    assert other == [naive(7 + r) for r in range(8)] and other != ref


def test_caller_objects_are_never_converted():
    """SNLPLM converted a GPT object in place (model.to(dtype, device)): the caller's model changed dtype, and with a
    Drafter object the base and the shared prefix were converted but the drafter's own suffix not (a dtype crash at
    the first request; on CUDA the default bfloat16 did it with no dtype given). Now a caller's objects are used as
    they are: no dtype given takes the model's own, a different dtype / device is refused in one line, and nothing
    of the caller's changes (dtype, device, values)."""
    model, tok = _own_tiny(n_layer=4, dtype=torch.float32)
    d = make_drafter(model, "2xF1-h0-K2")
    with torch.no_grad():  # an "adapted" suffix: the drafter's own weights
        for p in d.model.blocks[d.suffix_start:].parameters():
            p.add_(0.05)
    states = {"model": model.state_dict(), "drafter": d.model.state_dict()}
    before = {k: {n: (v.clone(), v.dtype, v.device) for n, v in sd.items()} for k, sd in states.items()}
    reqs = _reqs("loglikelihood", [("the cat", " sat on the mat")])

    for kw, says in ((dict(dtype="float64"), "dtype=float64"), (dict(device="meta"), "device=meta"),
                     (dict(drafter=d, dtype="float64"), "dtype=float64")):
        with pytest.raises(ValueError, match=f"GPT object in float32 on cpu, but {says} was asked") as err:
            SNLPLM(pretrained=model, tokenizer=tok, **kw)
        assert "\n" not in str(err.value)
    lm = SNLPLM(pretrained=model, tokenizer=tok, drafter=d, dtype="float32", device="cpu")
    assert lm.model is model and lm.loglikelihood(reqs)[0][0] < 0
    for name, sd in (("model", model.state_dict()), ("drafter", d.model.state_dict())):
        for n, v in sd.items():
            ref, dt, dev = before[name][n]
            assert v.dtype == dt and v.device == dev and torch.equal(v, ref), (name, n)

    # an fp64 model without dtype= stays fp64 (the CPU default float32 converted it before)
    m64, _ = _own_tiny(n_layer=4)
    assert SNLPLM(pretrained=m64, tokenizer=tok).model.wte.weight.dtype == torch.float64
    assert m64.wte.weight.dtype == torch.float64

    # a drafter in another dtype than its base: refused (the crash of the review), and once both are converted by
    # their owner, its log-likelihoods are its model's own (plan K >= C: the drafter's model run sequentially)
    model.double()
    with pytest.raises(ValueError, match="Drafter object's suffix is in float32 on cpu, the model in float64"):
        SNLPLM(pretrained=model, tokenizer=tok, drafter=d)
    d.model.double()
    got = SNLPLM(pretrained=model, tokenizer=tok, drafter=d).loglikelihood(reqs)[0][0]
    ids = [tok.bos_id] + tok.encode("the cat sat on the mat")
    ctx = 1 + len(tok.encode("the cat"))
    with torch.no_grad():
        logp = torch.log_softmax(d.model(torch.tensor([ids[:-1]]))[0].double(), -1)
    assert got == pytest.approx(sum(float(logp[t - 1, ids[t]]) for t in range(ctx, len(ids))), abs=1e-9)


def test_a_drafter_with_a_preheat_plan_is_refused_for_its_reason():
    """The calibration describes the base's suffix, not the drafter's adapted one: refused up front as `snlp eval
    --drafter` does (it said the weights changed and to re-run `snlp calibrate`, which cannot help)."""
    model, tok = _own_tiny(n_layer=4)
    d = make_drafter(model, "2xF1-h0-K1")
    with pytest.raises(ValueError, match="preheat init, whose calibration describes the base model's suffix, not the "
                                         "drafter's own adapted one: use the -h0 or -fwd init"):
        SNLPLM(pretrained=model, tokenizer=tok, drafter=d, plan="2xF1-preheat-K1")


def test_no_op_generation_options_are_accepted_and_the_others_refused():
    """num_beams: 1 (two stock harness tasks), top_p: 1.0, top_k: 0 / None, ... change nothing in transformers'
    generate (the hf model's): accepted, the same answers as without them; sampling filters under greedy decoding
    (top_p: 0.95 with do_sample false, as the harness's cruxeval) filter nothing greedy picks: accepted. top_k / top_p
    under sampling are honoured (top_k 1, or a top_p that keeps one token, sample the argmax: the greedy answers at
    any temperature). A repetition penalty is honoured (tokens against the hf model:
    test_a_generation_config_repetition_penalty_is_applied_as_the_hf_model_applies_it). Options that change the answer
    and that snlp does not implement (beam search, min_p / typical sampling, n-gram bans) stay refused, naming the
    option."""
    model, tok = _own_tiny()
    lm = SNLPLM(pretrained=model, tokenizer=tok)
    base = {"until": ["."], "max_gen_toks": 5, "do_sample": False}
    want = lm.generate_until(_reqs("generate_until", [("the cat", base)]))
    noops = [dict(num_beams=1), dict(top_p=1.0, top_k=0, min_p=0.0), dict(top_k=None, typical_p=1.0),
             dict(repetition_penalty=1.0, no_repeat_ngram_size=0, num_return_sequences=1, use_cache=True),
             dict(top_p=0.95), dict(top_k=50, early_stopping=True, length_penalty=2.0)]
    for extra in noops:
        assert lm.generate_until(_reqs("generate_until", [("the cat", {**base, **extra})])) == want, extra
    sampled = {**base, "do_sample": True, "temperature": 0.7}
    lm.generate_until(_reqs("generate_until", [("the cat", {**sampled, "top_p": 1.0, "num_beams": 1})]))
    for one in (dict(top_k=1), dict(top_p=1e-9), dict(top_k=1, top_p=0.5, temperature=5.0)):
        assert lm.generate_until(_reqs("generate_until", [("the cat", {**sampled, **one})])) == want, one
    # a filter value transformers refuses (a float top_k, a string), or one that do_sample at temperature 0 (greedy)
    # could not apply, is refused as written, never rounded or dropped
    for gen, bad in (({**sampled, "top_k": 2.7}, "top_k must be an integer"), ({**sampled, "top_p": "0.5"}, "top_p"),
                     ({**sampled, "temperature": 0.0, "top_p": 0.5}, "greedy decoding")):
        with pytest.raises(ValueError, match=bad):
            lm.generate_until(_reqs("generate_until", [("the cat", gen)]))
    for gen, bad in (({**sampled, "min_p": 0.1}, "min_p=0.1"), ({**sampled, "typical_p": 0.5}, "typical_p=0.5"),
                     ({**base, "num_beams": 4}, "num_beams=4"), ({**base, "no_repeat_ngram_size": 2},
                                                                "no_repeat_ngram_size=2")):
        with pytest.raises(ValueError, match=f"generation options {bad} are not supported"):
            lm.generate_until(_reqs("generate_until", [("the cat", gen)]))


@pytest.mark.parametrize("value", ["/ckpts/run=3/step=100", "123", "1e3", "true", "None", " padded ", '"quoted"',
                                   "8xF1-h0-K1-tol:0.05"])
def test_model_arg_values_read_back_unchanged(value):
    """A model_args value is read back by the harness's parser (split at ',', then at the first '=', then typed):
    '='s in a path survive, a value it would type (a number, a boolean, None) or strip is quoted."""
    assert simple_parse_args_string(f"pretrained={model_arg('pretrained', value)},batch_size=2") == {
        "pretrained": value, "batch_size": 2}


def test_a_path_with_a_comma_cannot_be_recorded(tmp_path):
    """lm-eval splits model_args at every ',' (no escape): such a path is refused wherever model_args are recorded,
    naming the reason, instead of a JSON whose recorded model_args rebuild another path."""
    model, tok = _own_tiny()
    with pytest.raises(ValueError, match="holds a ',', which the harness's model_args string cannot carry"):
        model_arg("pretrained", "/ckpts/a,b")
    lm = SNLPLM(pretrained=model, tokenizer=tok, name=str(tmp_path / "a,b"))
    with pytest.raises(ValueError, match="holds a ','"):
        lm.model_args


def test_snlp_generation_and_loglikelihood_are_two_approximations():
    """What docs/harness.md says of decode=snlp: generation is KV-cached SNLP decoding (snlp_generate), loglikelihood
    the plan's full-sequence solve. They coincide for K = 1 from h0 and for K >= C: the plan's generated tokens are
    greedy under its own loglikelihood scores; for K = 2 < C or the fwd init they are not (on this model and these
    prompts, fp64), so a table's generation rows and MC rows are two approximations."""
    from snlp.decode.generate import snlp_generate

    model, tok = _own_tiny(n_layer=6)
    prompts = ["the cat", "a dog ran", "the"]
    greedy = {}
    for plan in ("4xF1-h0-K1", "4xF1-h0-K4", "2xF2-h0-K2", "4xF1-h0-K2", "4xF1-fwd-K1"):
        lm = SNLPLM(pretrained=model, tokenizer=tok, plan=plan)
        ids = [lm.tok_encode(p) for p in prompts]
        gens = [r.tokens for r in snlp_generate(model, ids, plan, max_new_tokens=8)]
        greedy[plan] = [g for _, g in lm._loglikelihood_tokens([((p, ""), c, g) for p, c, g in zip(prompts, ids, gens)])]
    assert all(greedy["4xF1-h0-K1"]) and all(greedy["4xF1-h0-K4"]) and all(greedy["2xF2-h0-K2"]), greedy
    assert not all(greedy["4xF1-h0-K2"]) and not all(greedy["4xF1-fwd-K1"]), greedy


@pytest.mark.parametrize("bad, says", [(dict(num_beams=4), "num_beams=4 are not supported"),
                                       (dict(max_gen_toks=64), "max_gen_toks 64 must be below"),
                                       (dict(do_sample=True, temperature=0.7, top_p=2.0), "top_p")])
def test_a_refused_generation_option_is_refused_before_any_request_is_decoded(bad, says, monkeypatch):
    """The harness sends the generate_until requests of all its tasks in one call, decoded group by group (one group
    per distinct generation kwargs): a later group's refused option (beam search, a max_gen_toks the model's
    max_length cannot hold, a bad sampling filter) was raised only after the earlier groups had been decoded, so a
    run lost that work. Now every request's options are checked first: nothing is decoded."""
    model, tok = _own_tiny()
    lm = SNLPLM(pretrained=model, tokenizer=tok, batch_size=2)
    decoded = []
    real = lm._generate
    monkeypatch.setattr(lm, "_generate", lambda prompts, *a, **k: decoded.append(len(prompts)) or real(prompts, *a,
                                                                                                          **k))
    good = {"until": ["."], "max_gen_toks": 4}
    reqs = _reqs("generate_until", [("the cat", dict(good)), ("a dog", dict(good)), ("the mat", dict(good)),
                                    ("the park", {**good, **bad})])
    with pytest.raises(ValueError, match=says):
        lm.generate_until(reqs)
    assert decoded == []
    assert len(lm.generate_until(reqs[:3])) == 3 and decoded  # the good group alone decodes


@pytest.mark.parametrize("bad, max_length, says", [
    (("", "<|bos|>"), None, "encodes to 1 context and 0 continuation tokens"),  # BOS alone: the context takes it
    (("a dog", " ran in the park. the cat sat on"), 6, "continuation of 9 tokens does not fit max_length 6")])
def test_a_bad_loglikelihood_request_is_refused_before_any_forward(bad, max_length, says, monkeypatch):
    """The requests are scored longest first, so a request with no continuation token, or one longer than
    max_length, was refused only when its turn came, after the forwards of the requests before it. Now every
    request is checked first, and the message names it."""
    model, tok = _own_tiny()
    lm = SNLPLM(pretrained=model, tokenizer=tok, batch_size=1, max_length=max_length)
    forwards = []
    real = lm._hidden
    monkeypatch.setattr(lm, "_hidden", lambda *a: forwards.append(1) or real(*a))
    reqs = _reqs("loglikelihood", [("the cat sat on the mat. a dog ran in the park", " sat"), ("the", " mat"), bad])
    with pytest.raises(ValueError, match=f"the loglikelihood request {re.escape(repr(bad))}.*{says}"):
        lm.loglikelihood(reqs)
    assert forwards == []


def test_batched_answers_without_a_stop_string_equal_the_hf_models_batched_answers(tmp_path):
    """docs/harness.md: the hf model's batched generate runs to the left-padded prompt length + max_gen_toks, i.e.
    max_gen_toks new tokens for every row, as snlp's ragged batch gives each row: prompts of different lengths with
    no stop string but EOS give the same answers at batch 1 and 3 on both sides (fp64)."""
    d = _tiny_dir(tmp_path / "m")
    prompts = ["t4", "t1 t2 t3 t5 t6 t7 t8", "t9 t10 t11", "t20 t21 t22 t23 t24 t25 t26 t27 t28 t29 t30", "t5 t6"]
    g = _reqs("generate_until", [(p, {"until": [], "max_gen_toks": 10, "do_sample": False}) for p in prompts])
    hf = [HFLM(pretrained=str(d), device="cpu", batch_size=b, dtype="float64").generate_until(g) for b in (1, 3)]
    ours = [SNLPLM(pretrained=str(d), dtype="float64", batch_size=b).generate_until(g) for b in (1, 3)]
    assert hf[0] == hf[1] == ours[0] == ours[1]
    assert max(len(a.split()) for a in ours[0]) == 10  # an answer that ran to max_gen_toks


def test_a_generation_config_repetition_penalty_is_applied_as_the_hf_model_applies_it(tmp_path, tasks, monkeypatch):
    """A converted model's generation_config.json with a repetition penalty (Qwen2.5-Instruct ships 1.05): lm-eval's
    hf model's generate merges it into every call, greedy included. generate_until refused it; it now applies it, so
    the answers are the hf model's at batch 1 and 3 (ragged prompts, left-padded on the hf side), by every decode
    mode; a task's own repetition_penalty wins over the config's, as generate merges the task's kwargs over it;
    ignore_generation_config=True generates without it (the hf model's answers without the penalty); a sampled task
    gets the penalty too; loglikelihood tasks are unaffected; a setting snlp does not apply is still refused."""
    from snlp.eval.harness import evaluate_methods, task_manager

    d = _tiny_dir(tmp_path / "m")
    prompts = ["t4 t5", "t1 t2 t3 t5 t6 t7 t8", "t9 t9 t9", "t20 t21 t22 t20 t21"]
    g = _reqs("generate_until", [(p, {"until": [], "max_gen_toks": 12, "do_sample": False}) for p in prompts])
    plain = HFLM(pretrained=str(d), device="cpu", batch_size=1, dtype="float64").generate_until(g)
    transformers.GenerationConfig(bos_token_id=V - 3, eos_token_id=V - 2, repetition_penalty=3.0).save_pretrained(d)
    hf = [HFLM(pretrained=str(d), device="cpu", batch_size=b, dtype="float64").generate_until(g) for b in (1, 3)]
    assert hf[0] == hf[1] and hf[0] != plain  # the hf model applies the penalty in greedy decoding
    lm = SNLPLM(pretrained=str(d), dtype="float64")
    assert lm.generate_until(g) == hf[0]
    assert SNLPLM(pretrained=str(d), dtype="float64", batch_size=3).generate_until(g) == hf[0]
    for kw in (dict(plan="2xF1-h0-K1", decode="speculative", block=3), dict(plan="2xF1-h0-K2", decode="snlp")):
        assert SNLPLM(pretrained=str(d), dtype="float64", batch_size=3, **kw).generate_until(g) == hf[0]
    own = _reqs("generate_until", [(p, {"until": [], "max_gen_toks": 12, "do_sample": False,
                                        "repetition_penalty": 1.5}) for p in prompts])
    assert lm.generate_until(own) == HFLM(pretrained=str(d), device="cpu", batch_size=1,
                                          dtype="float64").generate_until(own) != hf[0]
    free = SNLPLM(pretrained=str(d), dtype="float64", ignore_generation_config=True)
    assert free.generate_until(g) == plain and "ignore_generation_config=True" in free.model_args
    import snlp.eval.harness as harness_mod

    seen = []
    real = harness_mod.sequential_generate
    monkeypatch.setattr(harness_mod, "sequential_generate",
                        lambda *a, **k: seen.append(k["repetition_penalty"]) or real(*a, **k))
    lm.generate_until(_reqs("generate_until", [("t4", {"until": [], "max_gen_toks": 3, "do_sample": True,
                                                       "temperature": 1.0})]))
    assert seen == [3.0]  # a sampled task: the penalised distribution, as the hf model's generate samples
    ll = _reqs("loglikelihood", [("t1 t2", " t3")])
    assert lm.loglikelihood(ll)[0][0] == pytest.approx(hf_ll := HFLM(pretrained=str(d), device="cpu", batch_size=1,
                                                                      dtype="float64").loglikelihood(ll)[0][0])
    assert hf_ll < 0
    tm = task_manager(["snlp_arc_tiny", "snlp_gen_tiny"], str(tasks))
    [rec] = evaluate_methods([lm], ["snlp_arc_tiny", "snlp_gen_tiny"], limit=2, tm=tm, bootstrap_iters=0)
    assert "exact_match,none" in rec.results["snlp_gen_tiny"]

    transformers.GenerationConfig(bos_token_id=V - 3, eos_token_id=V - 2, repetition_penalty=3.0,
                                  no_repeat_ngram_size=2).save_pretrained(d)
    lm = SNLPLM(pretrained=str(d), dtype="float64")
    with pytest.raises(ValueError, match=r"no_repeat_ngram_size=2.*ignore_generation_config=True") as err:
        lm.generate_until(g)
    assert "\n" not in str(err.value) and "repetition_penalty" not in str(err.value)

    def no_work(*a, **k):
        raise AssertionError("a task ran before the refusal")

    monkeypatch.setattr(SNLPLM, "_loglikelihood_tokens", no_work)
    with pytest.raises(ValueError, match="no_repeat_ngram_size=2"):
        evaluate_methods([lm], ["snlp_arc_tiny", "snlp_gen_tiny"], limit=2, tm=tm)


@pytest.mark.parametrize("bad", [0.0, -1.0, "x"])
def test_a_penalty_that_is_none_is_refused_before_any_task(tmp_path, tasks, bad):
    """A task's repetition_penalty, or the generation config's, that transformers refuses too (not a number > 0):
    one line naming it, before anything is decoded."""
    d = _tiny_dir(tmp_path / "m")
    lm = SNLPLM(pretrained=str(d), dtype="float64")
    g = _reqs("generate_until", [("t4", {"until": [], "max_gen_toks": 3, "do_sample": False,
                                         "repetition_penalty": bad})])
    with pytest.raises(ValueError, match="repetition_penalty must be a finite number > 0") as err:
        lm.generate_until(g)
    assert "\n" not in str(err.value)
    (d / "generation_config.json").write_text(json.dumps(dict(bos_token_id=V - 3, eos_token_id=V - 2,
                                                              repetition_penalty=bad)))
    from snlp.eval.harness import evaluate_methods, task_manager

    tm = task_manager(["snlp_gen_tiny"], str(tasks))
    with pytest.raises(ValueError, match=r"generation_config sets repetition_penalty=.*refuses it too"):
        evaluate_methods([SNLPLM(pretrained=str(d), dtype="float64")], ["snlp_gen_tiny"], tm=tm)


def test_cli_harness_applies_a_generation_config_penalty_and_refuses_what_it_cannot(tmp_path, tasks, capsys):
    """`snlp eval --harness` on a model whose generation config sets a repetition penalty: it runs (the penalty is
    applied); one that also sets no_repeat_ngram_size is refused in one line naming the flag, nothing written; with
    --harness-ignore-generation-config that run goes through."""
    from snlp.apps.cli import main

    d = _tiny_dir(tmp_path / "m")
    transformers.GenerationConfig(bos_token_id=V - 3, eos_token_id=V - 2, repetition_penalty=1.05).save_pretrained(d)
    capsys.readouterr()  # transformers' progress bars
    args = ["eval", str(d), "--harness", "snlp_gen_tiny", "--harness-include", str(tasks), "--limit", "1",
            "--harness-out", str(tmp_path / "out")]
    assert main(args) == 0 and (tmp_path / "out" / "table.md").exists()
    transformers.GenerationConfig(bos_token_id=V - 3, eos_token_id=V - 2, repetition_penalty=1.05,
                                  no_repeat_ngram_size=3).save_pretrained(d)
    args[-1] = str(tmp_path / "out2")
    capsys.readouterr()
    assert main(args) == 2
    [err] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("snlp eval: error")]
    assert "no_repeat_ngram_size=3" in err and "--harness-ignore-generation-config" in err
    assert not (tmp_path / "out2").exists()
    assert main(args + ["--harness-ignore-generation-config"]) == 0
    assert (tmp_path / "out2" / "table.md").exists()


def test_dtype_auto_is_the_checkpoints_own_as_the_hf_model(tmp_path):
    """dtype=auto was read as snlp's default (float32 on the CPU); the hf model's dtype=auto is the checkpoint's
    own dtype (here bfloat16), so the two scored in different precisions."""
    d = _tiny_dir(tmp_path / "m")
    transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16).save_pretrained(d)
    hf = HFLM(pretrained=str(d), device="cpu", batch_size=1, dtype="auto")
    ours = SNLPLM(pretrained=str(d), dtype="auto")
    assert ours.model.wte.weight.dtype == hf.model.dtype == torch.bfloat16
    assert "dtype=bfloat16" in ours.model_args
    assert SNLPLM(pretrained=str(d)).model.wte.weight.dtype == torch.float32  # no dtype: snlp's CPU default


def test_dtype_auto_on_an_snlp_checkpoint_is_the_dtype_it_was_saved_in(tmp_path):
    """snlp.load builds every checkpoint in float32, and dtype=auto read the loaded model's dtype: an snlp checkpoint
    saved in bfloat16 was scored in float32, not in "the checkpoint's own dtype" (docs/harness.md)."""
    import snlp
    from snlp.io.checkpoint import stored_dtype

    d = _tiny_dir(tmp_path / "m")
    transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16).save_pretrained(d)
    model, tok = snlp.from_hf(str(d))
    ckpt = snlp.save_checkpoint(tmp_path / "c", model, tokenizer=tok)
    assert stored_dtype(ckpt) == torch.bfloat16 and snlp.load(ckpt)[0].wte.weight.dtype == torch.float32
    assert SNLPLM(pretrained=str(ckpt), dtype="auto").model.wte.weight.dtype == torch.bfloat16
    assert SNLPLM(pretrained=str(ckpt)).model.wte.weight.dtype == torch.float32  # no dtype: snlp's CPU default


def test_a_sampling_only_setting_is_refused_before_the_tasks_of_a_sampled_run(tmp_path, tasks, monkeypatch):
    """A generation config whose setting transformers applies only when sampling (min_p: the hf model filters a
    sampled task's draws with it) and a task list with a sampled generate_until task behind a multiple-choice one:
    the up-front check asked only about greedy decoding, so the multiple-choice task's work ran and generate_until
    refused afterwards. Now the run is refused before any task's work; a greedy task list with that model runs."""
    from snlp.eval.harness import evaluate_methods, task_manager

    d = _tiny_dir(tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps(dict(bos_token_id=V - 3, eos_token_id=V - 2, min_p=0.3)))
    sampled = tmp_path / "tasks"
    shutil.copytree(tasks, sampled)
    text = (sampled / "gen_tiny.yaml").read_text()
    assert "do_sample: false" in text
    (sampled / "gen_tiny_sampled.yaml").write_text(text.replace("task: snlp_gen_tiny", "task: snlp_gen_tiny_sampled")
                                                   .replace("do_sample: false", "do_sample: true\n  temperature: 1.0"))
    lm = SNLPLM(pretrained=str(d), dtype="float64")
    tm = task_manager(["snlp_arc_tiny", "snlp_gen_tiny", "snlp_gen_tiny_sampled"], str(sampled))

    def no_work(*a, **k):
        raise AssertionError("a task ran before the refusal")

    with monkeypatch.context() as mp:
        mp.setattr(SNLPLM, "_loglikelihood_tokens", no_work)
        with pytest.raises(ValueError, match="min_p=0.3"):
            evaluate_methods([lm], ["snlp_arc_tiny", "snlp_gen_tiny_sampled"], limit=1, tm=tm)
    [rec] = evaluate_methods([lm], ["snlp_arc_tiny", "snlp_gen_tiny"], limit=1, tm=tm, bootstrap_iters=0)
    assert "exact_match,none" in rec.results["snlp_gen_tiny"]


def test_a_stop_string_early_in_a_long_speculative_round_stops_the_row(tmp_path):
    """generate_until's stop-string callback looked for the stop in the answer's last 4 x len(stop) + 4 tokens only,
    but a speculative round streams up to block + 1 tokens at once: a stop early in a round of 31 was past that
    window at once and ever after, and the row decoded on to max_gen_toks. The window now also covers the tokens of
    the call; the answer is the free answer cut at the stop, as before."""
    d = _tiny_dir(tmp_path / "m")
    # K = C: the drafts are the model's own tokens, every one accepted, 31 tokens a round
    lm = SNLPLM(pretrained=str(d), dtype="float64", plan="2xF1-h0-K2", decode="speculative", block=30)
    decoded = []
    inner = lm._generate
    lm._generate = lambda *a, **k: decoded.append(inner(*a, **k)) or decoded[-1]

    def ask(until):
        return lm.generate_until(_reqs("generate_until", [("t7", {"until": until, "max_gen_toks": 40,
                                                                   "do_sample": False})]))[0]

    free = ask([])
    words = free.split()
    assert len(decoded[0][0]) == 40 and words.count("t32") == 1 and words.index("t32") < 8
    assert ask(["t32"]) == free.split("t32")[0]
    assert len(decoded[1][0]) == 31  # the first round's tokens, not max_gen_toks


def test_a_generation_config_max_new_tokens_is_refused_not_ignored(tmp_path):
    """A generation_config.json with max_new_tokens: transformers' generate lets it win over the max_length lm-eval's
    hf model passes, so the hf model's answers ran to 20 tokens where the task asks max_gen_toks 5, and snlp's
    stopped at 5, silently. Refused now, as the processors are; ignore_generation_config=True decodes max_gen_toks."""
    d = _tiny_dir(tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps(dict(bos_token_id=V - 3, eos_token_id=V - 2,
                                                              max_new_tokens=20)))
    g = _reqs("generate_until", [("t4 t5", {"until": [], "max_gen_toks": 5, "do_sample": False})])
    hf = HFLM(pretrained=str(d), device="cpu", batch_size=1, dtype="float64").generate_until(g)
    assert len(hf[0].split()) == 20  # the hf model's own answer: the config's budget, not the task's
    with pytest.raises(ValueError, match=r"max_new_tokens=20.*ignore_generation_config=True"):
        SNLPLM(pretrained=str(d), dtype="float64").generate_until(g)
    free = SNLPLM(pretrained=str(d), dtype="float64", ignore_generation_config=True).generate_until(g)
    assert free[0].split() == hf[0].split()[:5]


def test_an_integer_penalty_is_refused_as_the_hf_models_generate_refuses_it(tmp_path, tasks):
    """A task's repetition_penalty, or the generation config's, written as an integer other than 1 (2 for 2.0): the
    hf model's generate() raises on it (transformers' RepetitionPenaltyLogitsProcessor takes a float) while snlp
    applied 2.0, so the harness's answers parted from the hf model's error silently. Now it is refused in one line
    before anything is decoded; 1 (no processor built there either) and 2.0 run."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    with pytest.raises(ValueError):  # the reference: transformers itself
        RepetitionPenaltyLogitsProcessor(2)
    d = _tiny_dir(tmp_path / "m")
    lm = SNLPLM(pretrained=str(d), dtype="float64")
    assert lm.repetition_penalty_for(1) == 1.0 and lm.repetition_penalty_for(2.0) == 2.0
    g = _reqs("generate_until", [("t4", {"until": [], "max_gen_toks": 3, "do_sample": False,
                                         "repetition_penalty": 2})])
    with pytest.raises(ValueError, match=r"repetition_penalty=2 is an integer, which the hf model's generate\(\) "
                                         r"refuses too") as err:
        lm.generate_until(g)
    assert "\n" not in str(err.value)
    (d / "generation_config.json").write_text(json.dumps(dict(bos_token_id=V - 3, eos_token_id=V - 2,
                                                              repetition_penalty=2)))
    from snlp.eval.harness import evaluate_methods, task_manager

    tm = task_manager(["snlp_gen_tiny"], str(tasks))
    with pytest.raises(ValueError, match=r"generation_config sets repetition_penalty=2, an integer"):
        evaluate_methods([SNLPLM(pretrained=str(d), dtype="float64")], ["snlp_gen_tiny"], tm=tm)


def test_a_config_penalty_alpha_is_refused_before_any_task(tmp_path, tasks, monkeypatch):
    """A generation config with penalty_alpha (contrastive search in a greedy task: transformers 5's generate()
    refuses it without trust_remote_code) was missed by the up-front check, which asked about sampling alone (where
    penalty_alpha is unread): the multiple-choice task's work ran first and generate_until refused afterwards."""
    from snlp.eval.harness import evaluate_methods, task_manager

    d = _tiny_dir(tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps(dict(bos_token_id=V - 3, eos_token_id=V - 2,
                                                              penalty_alpha=0.6)))
    lm = SNLPLM(pretrained=str(d), dtype="float64")
    tm = task_manager(["snlp_arc_tiny", "snlp_gen_tiny"], str(tasks))

    def no_work(*a, **k):
        raise AssertionError("a task ran before the refusal")

    monkeypatch.setattr(SNLPLM, "_loglikelihood_tokens", no_work)
    with pytest.raises(ValueError, match="penalty_alpha=0.6"):
        evaluate_methods([lm], ["snlp_arc_tiny", "snlp_gen_tiny"], limit=1, tm=tm)


@pytest.mark.parametrize("config,task", [
    ({"penalty_alpha": 0.6}, {}), ({"penalty_alpha": 0.6}, {"top_k": 1}), ({"penalty_alpha": 0.6}, {"top_k": None}),
    ({"penalty_alpha": 0.6}, {"penalty_alpha": 0.0}), ({"penalty_alpha": 0.6, "top_k": 1}, {}),
    ({"penalty_alpha": 0.6, "top_k": 1}, {"top_k": 4}), ({"penalty_alpha": 0.6, "top_k": 1}, {"top_k": 4,
                                                                                            "do_sample": True,
                                                                                            "temperature": 1.0})])
def test_a_config_penalty_alpha_is_read_with_the_tasks_kwargs_merged_over_it(tmp_path, config, task):
    """The hf model's generate() merges a task's kwargs over the model's generation config before it picks its mode:
    a config's penalty_alpha under a task's top_k 1 (or null, or penalty_alpha 0) stays greedy, and a config's top_k
    1 under a task's top_k 4 is contrastive search. generate_until read the config alone: it refused the first and
    decoded the second greedily. Now it refuses exactly where transformers leaves greedy / sampling decoding."""
    import warnings

    d = _tiny_dir(tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps(dict(bos_token_id=V - 3, eos_token_id=V - 2, **config)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gc = transformers.GenerationConfig(**config)
        gc.update(**gc._get_default_generation_params(), defaults_only=True)
        gc.update(**{"do_sample": False, **task})
        mode = gc.get_generation_mode()
    lm = SNLPLM(pretrained=str(d), dtype="float64")
    g = _reqs("generate_until", [("t4", {"until": [], "max_gen_toks": 2, "do_sample": False, **task})])
    if mode in ("greedy_search", "sample"):
        assert len(lm.generate_until(g)) == 1
    else:
        with pytest.raises(ValueError, match="penalty_alpha=0.6"):
            lm.generate_until(g)


@pytest.mark.parametrize("config,task", [
    ({}, {"penalty_alpha": 0.6, "top_k": 1}), ({}, {"penalty_alpha": 0.6, "top_k": 0}),
    ({}, {"penalty_alpha": 0.6, "top_k": None}), ({"top_k": 1}, {"penalty_alpha": 0.6}),
    ({}, {"penalty_alpha": -0.5, "top_k": 4}), ({}, {"penalty_alpha": 0.6}),
    ({"top_k": 1}, {"penalty_alpha": 0.6, "top_k": 4}), ({}, {"penalty_alpha": 0.6, "top_k": 4})])
def test_a_tasks_penalty_alpha_is_refused_exactly_where_transformers_runs_contrastive_search(tmp_path, config, task):
    """A greedy task's penalty_alpha was refused whatever its top_k, though transformers' generate() decodes greedily
    under top_k <= 1 (the task's, or the model's generation config's where the task sets none) or penalty_alpha <= 0.
    Reference: the mode the installed transformers picks, its own merge of the call's kwargs over the model's
    generation config (GenerationMixin._prepare_generation_config) and its GenerationConfig.get_generation_mode."""
    import warnings

    d = _tiny_dir(tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps(dict(bos_token_id=V - 3, eos_token_id=V - 2, **config)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mode = hf._prepare_generation_config(None, do_sample=False, **task)[0].get_generation_mode()
    assert mode in ("greedy_search", "contrastive_search")
    lm = SNLPLM(pretrained=str(d), dtype="float64")
    g = _reqs("generate_until", [("t4", {"until": [], "max_gen_toks": 2, "do_sample": False, **task})])
    if mode == "greedy_search":
        assert len(lm.generate_until(g)) == 1
    else:
        with pytest.raises(ValueError, match="penalty_alpha"):
            lm.generate_until(g)

"""Seams of the snlp harness model found by an independent review (issue 29): each against the harness's own `hf`
model (HFLM) on the same tiny random Llama saved as a transformers directory, or against a naive loop written here.
A DiagN plan's scores do not depend on the batch; a stop string that is a special token stops generation; snlp's
own tokenizer scores a rolling document once from BOS; an explicit add_bos_token=False is honoured; a template
without a system role drops the system turn, as the hf model does."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import transformers  # noqa: E402
from conftest import make_model  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from tokenizers import Tokenizer as HFTok  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, processors  # noqa: E402

from snlp.eval.harness import SNLPLM  # noqa: E402
from snlp.io.tokenizer import Tokenizer  # noqa: E402

V = 64


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

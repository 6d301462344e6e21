"""Chat SFT and multiple-choice evaluation: assistant-only masks, rows that never see each other,
SNLP-forward SFT = sequential SFT of the fused model when K >= C, MC parsing/scoring/errors, and a
tiny model that learns a synthetic MC chat task (SNLP-forward SFT wins under that plan's inference)."""

import importlib
import json
import random
import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from snlp.io import chat
from snlp.io.checkpoint import save_checkpoint
from snlp.apps.cli import main
from snlp.eval.mc import MCConfig, wilson
from snlp.eval.mc_eval import evaluate_mc
from snlp.io.mctasks import LETTERS, Question, letter_prompt, load_task, parse_file
from snlp.model.gpt import GPT, GPTConfig
from snlp.method.plan import Plan
from snlp.train.regularizer import RegConfig
from snlp.method.solver import fused_forward, parallel_forward
from snlp.io.tokenizer import Tokenizer
from snlp.train.job import TrainStep
from snlp.train.optim import lr_multiplier

TEXT = ["Which number is largest? Multiple Choice question: hello there, how are you today?"] * 20


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(TEXT + [letter_prompt(Question("q", ("1", "2"), 0))] * 5, 300)


def tiny(tok, depth=4, seed=0, dtype=torch.float32, train=False):
    m = GPT(GPTConfig.from_depth(depth, width=32, head_dim=16, vocab_size=tok.vocab_size, sequence_len=64))
    m.init_weights(seed=seed)
    if train:  # non-zero output projections: blocks that are not the identity
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for b in m.blocks:
                for lin in (b.attn.c_proj, b.mlp.c_proj):
                    lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.2)
            if hasattr(m, "value_embeds"):
                for b in m.blocks:
                    if b.attn.ve_gate is not None:
                        b.attn.ve_gate.weight.copy_(torch.randn(b.attn.ve_gate.weight.shape, generator=g) * 0.2)
            m.lm_head.weight.normal_(0, 0.3, generator=g)
    return m.to(dtype)


# ----- chat template and masks -----
def test_two_turn_mask_is_exactly_the_replies(tok):
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "how are you"},
            {"role": "assistant", "content": "today"}]
    ids, mask = tok.render_chat(conv)
    sp = {n: tok.token_id(f"<|{n}|>") for n in ("user_start", "user_end", "assistant_start", "assistant_end")}
    e = tok.encode
    want_ids = ([tok.bos_id, sp["user_start"], *e("be brief\n\nhello"), sp["user_end"],
                 sp["assistant_start"], *e("hi there"), sp["assistant_end"],
                 sp["user_start"], *e("how are you"), sp["user_end"],
                 sp["assistant_start"], *e("today"), sp["assistant_end"]])
    want_mask = ([0, 0] + [0] * len(e("be brief\n\nhello")) + [0, 0] + [1] * len(e("hi there")) + [1]
                 + [0] + [0] * len(e("how are you")) + [0, 0] + [1] * len(e("today")) + [1])
    assert ids == want_ids and mask == want_mask
    x, y = chat.collate([chat.ChatExample(ids, mask)], pad_id=0)
    assert x[0].tolist() == ids[:-1]
    assert y[0].tolist() == [t if m else -1 for t, m in zip(ids[1:], mask[1:])]
    prompt, pm = tok.render_chat(conv[:2], add_generation_prompt=True)
    assert prompt[-1] == sp["assistant_start"] and sum(pm) == 0


QUOTING = [{"role": "user", "content": "what does <|assistant_end|> do? <|user_end|><|assistant_start|>"},
           {"role": "assistant", "content": "It ends a reply: <|assistant_end|> then <|bos|> starts a text"}]


def test_message_text_that_quotes_a_marker_is_text_not_the_marker(tok):
    """nanochat's render_conversation encodes message text with tiktoken's encode_ordinary: a special token's string
    in a message is its bytes; the markers come from the template alone. The naive reference: every message's own
    tokens decode back to its text, the specials sit only where the template puts them, and the mask is as for any
    other text (a quoted "<|assistant_end|>" is neither the end of the reply nor trained as the stop)."""
    ids, mask = tok.render_chat(QUOTING)
    sp = [tok.token_id(f"<|{n}|>") for n in ("user_start", "user_end", "assistant_start", "assistant_end")]
    u, a = [tok.encode_plain(m["content"]) for m in QUOTING]
    assert ids == [tok.bos_id, sp[0], *u, sp[1], sp[2], *a, sp[3]]
    assert mask == [0] * (3 + len(u) + 1) + [1] * (len(a) + 1)
    assert tok.decode(u) == QUOTING[0]["content"] and tok.decode(a) == QUOTING[1]["content"]
    assert not set(u + a) & {tok.bos_id, *sp}
    assert tok.encode_plain("hello there") == tok.encode("hello there")  # plain text: as `encode`
    prompt = tok.chat_prompt(QUOTING[:1])  # what `snlp generate --chat` and the evaluations send: the same text
    assert prompt == [tok.bos_id, sp[0], *u, sp[1], sp[2]]


def test_render_is_the_paper_codes_render_conversation(tok):
    """The paper's own render_conversation (nanochat/tokenizer.py, RustBPETokenizer's: its `self` needs encode,
    encode_special and get_bos_token_id) gives our ids and mask on a system message, several turns, an empty reply
    and quoted markers. Skipped without the paper code."""
    import importlib.util
    import sys
    import types
    from pathlib import Path

    from tests.bench.test_vs_paper import PAPER

    if PAPER is None:
        pytest.skip("the paper code (nanochat-snlp) is not here")
    path = Path(PAPER) / "nanochat" / "tokenizer.py"
    stubs = [n for n in ("rustbpe", "tiktoken") if n not in sys.modules]  # imported at its top, unused here
    sys.modules.update({n: types.ModuleType(n) for n in stubs})
    try:
        spec = importlib.util.spec_from_file_location("paper_nanochat_tokenizer", path)
        paper = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(paper)
    finally:
        for n in stubs:
            sys.modules.pop(n, None)
    ordinary = types.SimpleNamespace(encode=tok.encode_plain, encode_special=tok.tok.token_to_id,
                                     get_bos_token_id=lambda: tok.bos_id)
    convs = [QUOTING, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                       {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "and?"},
                       {"role": "assistant", "content": ""}]]
    for conv in convs:
        ids, mask = paper.RustBPETokenizer.render_conversation(ordinary, {"messages": conv})
        assert tok.render_chat(conv) == (ids, mask)


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("tagged", [True, False])
def test_converted_template_mask_is_transformers_assistant_mask(tagged):
    """A converted model's chat template (ChatML, which writes a newline after each <|im_end|>): the assistant mask
    is transformers' apply_chat_template(return_assistant_tokens_mask=True) on the template with `{% generation %}`
    blocks around each reply and its <|im_end|>: the reply and the stop token, not the template's newline after it
    (never generated: a reply ends at the stop). The same template without the blocks gives the same mask."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    raw = HFTokenizer(models.BPE())
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    raw.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                      special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    template = CHATML if tagged else CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tok = Tokenizer(raw, {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": template})
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "how are you"},
            {"role": "assistant", "content": "today"}]
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", chat_template=CHATML)
    want = ref.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = tok.render_chat(msgs)
    assert ids == list(want["input_ids"]) and mask == list(want["assistant_masks"])
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "hi there<|im_end|>today<|im_end|>"


LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|eot_id|>' }}{% endgeneration %}"
          "{% else %}{{ m['content'] + '<|eot_id|>' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


def test_converted_template_mask_keeps_a_reply_that_quotes_a_stop_id():
    """A reply whose text spells a stop id's string (rendered text is tokenized with its specials parsed, as
    transformers does) keeps its whole mask: the turn ends at the stop the template writes after the reply, not at
    the quoted one. A Llama-3-style template on a model whose only stop id is the tokenizer's EOS <|end_of_text|>
    (not the template's <|eot_id|>): the mask is transformers' generation-block mask, reply and <|eot_id|>; the
    last stop id in the turn, the quoted one, cut the reply's rest out of training."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    raw = HFTokenizer(models.BPE())
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    raw.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    plain = LLAMA3.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tok = Tokenizer(raw, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": plain})
    assert tok.stop_ids == (raw.token_to_id("<|end_of_text|>"),)
    msgs = [{"role": "user", "content": "hello"},
            {"role": "assistant", "content": "a document ends with <|end_of_text|> and the next begins"},
            {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "today"}]
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|begin_of_text|>",
                                               eos_token="<|end_of_text|>", chat_template=LLAMA3)
    want = ref.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = tok.render_chat(msgs)
    assert ids == list(want["input_ids"]) and mask == list(want["assistant_masks"])
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == (
        "a document ends with <|end_of_text|> and the next begins<|eot_id|>today<|eot_id|>")


@pytest.mark.parametrize("bad, msg", [([], "non-empty"), ([{"role": "bot", "content": "x"}], "valid roles"),
                                      ([{"role": "assistant", "content": "x"}], "'user' was expected"),
                                      ([{"role": "user", "content": 3}], "string")])
def test_bad_conversations_are_named(tok, bad, msg, tmp_path):
    with pytest.raises(ValueError, match=msg):
        tok.render_chat(bad)
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}]}) + "\n" + json.dumps({"messages": bad}) + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl:2"):
        chat.load_conversations(str(f))


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_chat_rows_are_lines_as_text_mode_cuts_them(tmp_path, end):
    """Chat JSONL rows are the lines Python's text mode (universal newlines) reads, as the paper's CustomJSON loader
    reads them: \\n, \\r\\n and a lone \\r each end a row (the binary read that names a bad byte's line cut at \\n
    only, so a \\r-ended file was one row, refused as "Extra data"); a bad byte is named by that line."""
    rows = [json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}).encode()
            for q, a in (("a", "b"), ("c", "d"), ("e", "f"))]
    f = tmp_path / "c.jsonl"
    f.write_bytes(end.join(rows) + end)
    assert [c[1]["content"] for c in chat.load_conversations(str(f))] == ["b", "d", "f"]
    f.write_bytes(end.join(rows[:2] + [b'{"messages": "caf\xe9"}']) + end)
    with pytest.raises(ValueError, match=r"c.jsonl:3 is not UTF-8"):
        chat.load_conversations(str(f))


def test_the_tokenizers_floor_has_encode_special_tokens():
    """Tokenizer.encode_plain, which renders every chat message, sets the `tokenizers` attribute
    encode_special_tokens, which tokenizers 0.15.1 introduced (an older one has no such attribute: every chat render
    raised AttributeError): pyproject.toml's dependency names that floor."""
    from pathlib import Path

    py = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert re.search(r'"tokenizers>=0\.15\.1"', py)
    from tokenizers import Tokenizer as HFTokenizer, models
    assert hasattr(HFTokenizer(models.BPE()), "encode_special_tokens")


def test_bad_bytes_and_tool_parts_are_named_by_file_line(tmp_path):
    """A chat file that is not UTF-8 is refused naming its file and line (it was the codec's bare message, no file);
    an assistant turn in nanochat's tool-use form (content a list of parts) is refused saying that form is not
    supported (it was "content must be a string" alone)."""
    good = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    f = tmp_path / "c.jsonl"
    f.write_bytes(good.encode() + b"\n" + b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2 is not UTF-8"):
        chat.load_conversations(str(f))
    parts = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": [{"type": "python", "text": "2+2"}]}]
    f.write_text(good + "\n" + json.dumps({"messages": parts}) + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl:2: message 1 content must be a string \(a list of parts.*tool"):
        chat.load_conversations(str(f))
    f.write_text(good + "\n" + json.dumps(parts[:1] + [{"role": "assistant", "content": "4"}]) + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl:2 has no 'messages' field .*nanochat's CustomJSON form"):
        chat.load_conversations(str(f))  # nanochat's identity_conversations.jsonl rows: named, not a bare "no field"


@pytest.mark.parametrize("plan", [None, "3xF1-h0-K1", "2xF2-fwd-K1"])
def test_padded_rows_never_see_each_other(tok, plan):
    """Perturbing one conversation (and its length) changes no logit of the other: with one row per
    conversation, right padding and causal attention, documents never attend across each other."""
    m = tiny(tok, train=True).eval()
    rng = random.Random(0)
    a = chat.ChatExample([rng.randrange(tok.vocab_size) for _ in range(12)], [0] * 6 + [1] * 6)
    b = chat.ChatExample([rng.randrange(tok.vocab_size) for _ in range(20)], [1] * 20)
    b2 = chat.ChatExample([rng.randrange(tok.vocab_size) for _ in range(31)], [1] * 31)
    fwd = (lambda x: m(x)) if plan is None else (lambda x: parallel_forward(m, x, plan))
    with torch.no_grad():
        alone = fwd(chat.collate([a], 0)[0])[0]
        x1, x2 = chat.collate([a, b], 0)[0], chat.collate([a, b2], 0)[0]
        l1, l2 = fwd(x1), fwd(x2)
    n = len(a.ids) - 1
    torch.testing.assert_close(l1[0, :n], alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(l2[0, :n], alone, rtol=0, atol=1e-5)
    assert not torch.allclose(l1[1, :5], l2[1, :5])  # the perturbation is real


@pytest.mark.parametrize("plan", ["3xF1-h0-K3", "3xF1-fwd-K4", "2xF2-h0-K2", "1xF3-h0-K1"])
def test_snlp_forward_sft_with_k_ge_c_is_sequential_sft_of_the_fused_model(tok, plan):
    """Loss and every parameter gradient of SNLP-forward SFT (K >= C) equal those of sequential SFT
    of the fused model (F1: the model itself; FM: snlp.fused_forward), in float64."""
    m = tiny(tok, train=True, dtype=torch.float64)
    p = Plan.parse(plan)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, tok.vocab_size, (2, 9), generator=g)
    y = torch.randint(0, tok.vocab_size, (2, 9), generator=g)
    y[:, :4] = -1  # masked (user) positions
    loss, _, _ = TrainStep(m, RegConfig(), p)(x, y, 0.0)
    loss.backward()
    got = {k: v.grad.clone() for k, v in m.named_parameters() if v.grad is not None}
    m.zero_grad()
    if p.fuse == 1:
        ref, _, _ = TrainStep(m, RegConfig(), None)(x, y, 0.0)
    else:
        lg = fused_forward(m, x, p)
        ref = F.cross_entropy(lg.view(-1, lg.size(-1)), y.reshape(-1), ignore_index=-1)
    ref.backward()
    want = {k: v.grad.clone() for k, v in m.named_parameters() if v.grad is not None}
    assert torch.allclose(loss, ref, rtol=0, atol=1e-12)
    assert got.keys() == want.keys() and len(got) > 5
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12, msg=k)
    assert any(float(v.abs().max()) > 0 for k, v in want.items() if k.startswith("blocks.3"))  # suffix params learn


def test_lr_multiplier_is_stateless_schedule():
    assert lr_multiplier(0, 0.0, 10, 0.4) == pytest.approx(0.1)
    assert lr_multiplier(50, 0.5, 10, 0.4) == 1.0
    assert lr_multiplier(80, 0.8, 10, 0.4) == pytest.approx(0.5)
    assert lr_multiplier(99, 1.0, 0, 0.4) == 0.0


# ----- multiple choice -----
QS = [Question("Which is red?", ("apple", "sky", "grass", "coal"), 0),
      Question("Which is blue?", ("apple", "sky", "grass", "coal"), 1),
      Question("What is 2+2?", ("4", "5", "3", "22"), 0)]


def write_schemas(d):
    (d / "arc.jsonl").write_text("\n".join(json.dumps(
        {"id": str(i), "question": {"stem": q.question, "choices": [{"label": L, "text": c} for L, c in zip("ABCD", q.choices)]},
         "answerKey": "ABCD"[q.answer]}) for i, q in enumerate(QS)) + "\n")
    (d / "toy_test.csv").write_text("".join(f'"{q.question}",{",".join(q.choices)},{"ABCD"[q.answer]}\n' for q in QS))
    (d / "plain.jsonl").write_text("\n".join(json.dumps({"question": q.question, "choices": list(q.choices),
                                                         "answer": [q.answer, "ABCD"[q.answer], q.choices[q.answer]][i]})
                                             for i, q in enumerate(QS)) + "\n")


def test_three_schemas_parse_to_the_same_questions(tmp_path):
    write_schemas(tmp_path)
    arc, mmlu, plain = (parse_file(tmp_path / f) for f in ("arc.jsonl", "toy_test.csv", "plain.jsonl"))
    assert arc == plain == QS
    assert [Question(q.question, q.choices, q.answer) for q in mmlu] == QS and {q.subject for q in mmlu} == {"toy"}
    assert len(load_task(f"mc:{tmp_path}")) == 9


@pytest.mark.parametrize("line, msg", [
    ({"question": "q", "choices": ["a", "b"]}, "missing answer"),
    ({"question": "q", "choices": ["a", "b"], "answer": "C"}, "not among the choices"),
    ({"question": "q", "choices": ["a", "b"], "answer": 5}, "not among the 2 choices"),
    ({"question": "q", "choices": [], "answer": 0}, "no choices"),
    ({"question": {"stem": "q", "choices": []}, "answerKey": "A"}, "empty or missing question.choices"),
])
def test_malformed_questions_name_the_line(tmp_path, line, msg):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"question": "ok", "choices": ["a", "b"], "answer": 0}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=rf"bad.jsonl:2: .*{msg}"):
        parse_file(f)


def test_malformed_csv_and_unknown_task(tmp_path):
    f = tmp_path / "x_test.csv"
    f.write_text("q,a,b,c,d,A\nq2,a,b,c,d,E\n")
    with pytest.raises(ValueError, match=r"x_test.csv:2: .*'E' is not among"):
        parse_file(f)
    with pytest.raises(ValueError, match="unknown task"):
        load_task("arc-hard")


def test_wilson_interval():
    lo, hi = wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    lo, hi = wilson(0, 5)
    assert lo == 0.0 and 0 < hi < 0.5


@pytest.mark.parametrize("letter, acc", [("A", 2 / 3), ("B", 1 / 3), ("C", 0.0)])
def test_forced_letter_logits_give_the_known_accuracy(tok, tmp_path, letter, acc):
    """Identity blocks (zero output projections, the init) make the last hidden state depend only on the
    last token (always <|assistant_start|>); an lm_head that points only the forced letter at it makes
    every prediction that letter, under the sequential forward and every plan alike."""
    write_schemas(tmp_path)
    m = tiny(tok).eval()
    prompt = tok.render_chat([{"role": "user", "content": "x"}], add_generation_prompt=True)[0]
    with torch.no_grad():
        h = F.rms_norm(m.hidden_states(torch.tensor([prompt]))[-1][0, -1], (32,))
        m.lm_head.weight.zero_()
        m.lm_head.weight[tok.encode(letter)[0]] = 5 * h
    res = evaluate_mc(m, tok, MCConfig(task=f"mc:{tmp_path / 'plain.jsonl'}", plans=["3xF1-h0-K1", "2xF2-fwd-K1"]))
    assert [r.method for r in res.records][0] == "sequential" and len(res.records) == 3
    for r in res.records:
        assert r.n == 3 and r.accuracy == pytest.approx(acc)
        assert r.ci_low <= acc <= r.ci_high and r.chance == pytest.approx(0.25)


def test_eval_task_cli(tok, tmp_path, capsys):
    write_schemas(tmp_path)
    save_checkpoint(tmp_path / "ck", tiny(tok), tok)
    for scoring in ("letter", "loglik"):
        rc = main(["eval", str(tmp_path / "ck"), "--task", f"mc:{tmp_path / 'toy_test.csv'},{tmp_path / 'arc.jsonl'}",
                   "--plans", "3xF1-h0-K1", "--mc-scoring", scoring, "--device", "cpu", "--json", str(tmp_path / "r.json"),
                   "--markdown", str(tmp_path / "r.md")])
        assert rc == 0
        res = json.loads((tmp_path / "r.json").read_text())
        assert res["scoring"] == scoring and [r["n"] for r in res["records"]] == [6, 6]
        assert set(res["records"][0]["subjects"]) == {"", "toy"} or res["records"][0]["subjects"] == {}
        assert "| sequential |" in (tmp_path / "r.md").read_text()
    assert main(["eval", str(tmp_path / "ck"), "--task", f"mc:{tmp_path / 'nope.csv'}", "--plans", "3xF1-h0-K1",
                 "--device", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err


# ----- learning: a synthetic chat task -----
def synthetic(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ds = rng.sample(range(10), 4)
        out.append(Question("Which number is largest?", tuple(map(str, ds)), max(range(4), key=lambda i: ds[i])))
    return out


def write_task(d, n: int, n_train: int, n_tok: int, depth: int, width: int):
    """A synthetic multiple-choice task in `d`: chats.jsonl (n_train SFT chats), test.jsonl (the rest) and a base
    checkpoint (a tokenizer trained on n_tok prompts, a fresh model of `depth` x `width`)."""
    qs = synthetic(n, 0)
    with open(d / "chats.jsonl", "w") as f:
        for q in qs[:n_train]:
            f.write(json.dumps({"messages": [{"role": "user", "content": letter_prompt(q)},
                                             {"role": "assistant", "content": LETTERS[q.answer]}]}) + "\n")
    with open(d / "test.jsonl", "w") as f:
        for q in qs[n_train:]:
            f.write(json.dumps({"question": q.question, "choices": list(q.choices), "answer": q.answer}) + "\n")
    tk = Tokenizer.train([letter_prompt(q) for q in qs[:n_tok]] * 5, 400)
    m = GPT(GPTConfig.from_depth(depth, width=width, head_dim=16, vocab_size=tk.vocab_size, sequence_len=128))
    m.init_weights(seed=0)
    save_checkpoint(d / "base", m, tk)
    return d


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return write_task(tmp_path_factory.mktemp("sft"), 1000, 800, 100, 4, 64)


SFT_FLAGS = ["--steps", "{steps}", "--batch-size", "16", "--seq-len", "128", "--lr-scale", "1", "--warmdown", "0.3",
             "--eval-every", "1000", "--eval-batches", "1", "--no-progress", "--device", "cpu"]


def sft_flags(steps):
    return [s.format(steps=steps) for s in SFT_FLAGS]


def test_sft_grid_learns_and_snlp_forward_wins_under_its_plan(task):
    """Sequential SFT learns the task far above chance (25 %); SFT through the plan's SNLP forward beats
    sequential SFT when both are served with that plan (the paper's mechanism). Loose bounds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plan = "3xF1-h0-K1"
        rc = main(["sft-grid", str(task / "base"), "--data", str(task / "chats.jsonl"), "--plan", plan,
                   "--task", f"mc:{task / 'test.jsonl'}", "--out", str(task / "grid"), *sft_flags(120)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    g = json.loads((task / "grid" / "grid.json").read_text())
    acc = {(r["sft"], r["inference"]): r["accuracy"][f"mc:{task / 'test.jsonl'}"] for r in g["rows"]}
    assert acc[("sequential", "sequential")] > 0.5
    assert acc[(plan, plan)] > 0.5
    assert acc[(plan, plan)] > acc[("sequential", plan)]
    assert "| SFT | Inference |" in (task / "grid" / "grid.md").read_text()
    log = [json.loads(l) for l in (task / "grid" / f"sft-{plan}" / "log.jsonl").read_text().splitlines()]
    ev = [r for r in log if "val_loss_plan" in r]
    assert ev[-1]["val_loss_plan"] < ev[0]["val_loss_plan"] - 0.5  # validation loss under the plan logged and falling


def test_sft_resume_is_bitwise_identical(task, tmp_path, capsys):
    """SNLP-forward SFT with the regulariser, stopped by --stop-after and by a --stop-file, resumes
    bitwise identically (the LR schedule is stateless); bad plans and data give clear errors."""
    from safetensors.torch import load_file

    flags = [*sft_flags(5), "--batch-size", "4", "--forward", "2xF2-h0-K1", "--reg", "idn", "--reg-n", "2",
             "--warmup-steps", "2"]
    base = ["sft", str(task / "base"), "--data", str(task / "chats.jsonl"), "--max-conversations", "40"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([*base, "--out", str(tmp_path / "full"), *flags]) == 0
        assert main([*base, "--out", str(tmp_path / "part"), *flags, "--stop-after", "2"]) == 0
        (tmp_path / "stop").write_text("3")
        assert main([*base, "--out", str(tmp_path / "part"), *flags, "--resume", "--stop-file", str(tmp_path / "stop")]) == 0
        assert torch.load(tmp_path / "part" / "train_state.pt", weights_only=False)["step"] == 3  # the stop file
        # a flag that would change the run is refused before any work; every flag left out keeps the saved value
        capsys.readouterr()
        assert main([*base[:2], "--data", str(task / "chats.jsonl"), "--out", str(tmp_path / "part"), "--resume",
                     "--forward", "2xF2-h0-K2"]) == 2
        assert main([*base[:2], "--data", str(task / "chats.jsonl"), "--out", str(tmp_path / "part"), "--resume",
                     "--lr-scale", "0.3"]) == 2
        assert main([*base[:2], "--data", str(task / "chats.jsonl"), "--out", str(tmp_path / "part"), "--resume",
                     "--optimizer", "adamw"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert "--forward '2xF2-h0-K1' (given: '2xF2-h0-K2')" in err[0] and "--lr-scale 1 (given: 0.3)" in err[1], err
        assert "--optimizer 'muon' (given: 'adamw')" in err[2] and "-lr" not in err[2], err
        # typed at the saved values, alone or together: not a change
        assert main([*base[:2], "--data", str(task / "chats.jsonl"), "--out", str(tmp_path / "part"), "--resume",
                     "--lr-scale", "1", "--stop-after", "4"]) == 0
        assert torch.load(tmp_path / "part" / "train_state.pt", weights_only=False)["step"] == 4
        assert main([*base[:2], "--data", str(task / "chats.jsonl"), "--out", str(tmp_path / "part"), "--resume",
                     "--optimizer", "muon"]) == 0
        # the run is done: a resume with no step left is refused, nothing rewritten
        assert main([*base[:2], "--data", str(task / "chats.jsonl"), "--out", str(tmp_path / "part"), "--resume"]) == 2
    finally:
        torch.set_num_threads(threads)
    full, part = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(tmp_path / "part" / "model.safetensors"))
    for k in full:
        assert torch.equal(full[k], part[k]), k
    st = torch.load(tmp_path / "part" / "train_state.pt", weights_only=False)
    assert st["sft"]["forward"] == "2xF2-h0-K1" and st["step"] == 5
    assert main([*base, "--out", str(tmp_path / "x"), *sft_flags(2), "--forward", "9xF1-h0-K1"]) == 2
    assert main(["sft", str(task / "base"), "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "y")]) == 2


def test_resume_continues_a_run_only_as_the_command_that_saved_it(task, tmp_path, capsys):
    """`snlp sft --resume` of a pretraining run and `snlp train --resume` of an SFT run are refused in one line
    before any work, their checkpoints untouched: the loop would continue one as the other (a pretraining run
    fine-tuned on chats, an SFT run pretrained on the base's text) and save over it. The library refuses too."""
    from dataclasses import fields

    from snlp.train.config import TrainConfig
    from snlp.train.sft import SFTConfig, sft_job
    from snlp.train.trainer import fit

    text = task / "text.txt"
    text.write_text("\n\n".join(" ".join(random.Random(i).choices(TEXT[0].split(), k=40)) for i in range(200)))
    pre, tuned = tmp_path / "pre", tmp_path / "sft"
    assert main(["train", "--out", str(pre), "--data", str(text), "--cache-dir", str(tmp_path / "cache"), "--depth",
                 "2", "--width", "32", "--head-dim", "16", "--vocab-size", "300", "--seq-len", "128", "--batch-size",
                 "2", "--steps", "2", "--eval-batches", "1", "--no-progress", "--device", "cpu"]) == 0
    chats = ["--data", str(task / "chats.jsonl"), "--max-conversations", "40"]
    assert main(["sft", str(task / "base"), *chats, "--out", str(tuned), *sft_flags(2), "--batch-size", "4"]) == 0
    files = lambda d: {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}  # noqa: E731
    before = {pre: files(pre), tuned: files(tuned)}
    capsys.readouterr()
    assert main(["sft", str(pre), *chats, "--out", str(pre), "--resume", "--steps", "4", "--no-progress"]) == 2
    assert main(["train", "--out", str(tuned), "--resume", "--steps", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert f"{pre} holds a run of `snlp train`, not of `snlp sft`" in err[0]
    assert f"{tuned} holds a run of `snlp sft`, not of `snlp train`" in err[1]
    assert {pre: files(pre), tuned: files(tuned)} == before
    # the library: the pretraining run's own settings, with an SFT job
    saved = torch.load(pre / "train_state.pt", weights_only=False)["args"]
    cfg = TrainConfig(**{**{f.name: saved[f.name] for f in fields(TrainConfig) if f.name in saved}, "resume": True,
                         "device": "cpu"})
    with pytest.raises(ValueError, match="holds a run of `snlp train`, not of `snlp sft`"):
        fit(cfg, sft_job(SFTConfig(ckpt=str(pre), data=str(task / "chats.jsonl"), train=cfg, max_conversations=40)))
    assert files(pre) == before[pre]


def test_mc_questions_as_chats_and_hub_tasks_offline(tmp_path, tok):
    write_schemas(tmp_path)
    convs = chat.load_conversations(f"mc:{tmp_path / 'arc.jsonl'}")
    assert convs[1] == [{"role": "user", "content": letter_prompt(QS[1])}, {"role": "assistant", "content": "B"}]
    ids, mask = tok.render_chat(convs[1])
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "B<|assistant_end|>"
    try:
        importlib.import_module("datasets")
    except ImportError:  # without the datasets library (or offline) the hub tasks fail clearly
        with pytest.raises(ValueError, match="datasets"):
            load_task("arc-easy")


def test_sft_resume_from_another_folder_keeps_its_chats_and_its_bases_split(task, tmp_path, monkeypatch, capsys):
    """An SFT run started with relative chats (and a base whose own record names its data relative) resumes from
    another folder: typing the same chats by their absolute path is no change; another folder's chats.jsonl of the
    same name is refused, not trained on; the base's split is the one the run recorded."""
    import shutil

    from snlp.io.checkpoint import load

    a, b = tmp_path / "a", tmp_path / "b"
    (a / "corp").mkdir(parents=True)
    b.mkdir()
    shutil.copy(task / "chats.jsonl", a / "chats.jsonl")
    (a / "corp" / "c.txt").write_text("some text\n" * 50)
    lines = (task / "chats.jsonl").read_text().splitlines()
    (b / "chats.jsonl").write_text("\n".join(lines[:100]) + "\n")  # another set under the same name
    base = a / "base"  # the task's base, with a pretraining record naming its data relative (as older snlp wrote)
    m, tk = load(task / "base")
    save_checkpoint(base, m, tk, train_state={"step": 1, "args": {"data": "corp/c.txt", "vocab_size": tk.vocab_size,
                                                                  "data_encoding": "latin-1"}})
    flags = [*sft_flags(4), "--batch-size", "4", "--max-conversations", "40"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.chdir(a)
        assert main(["sft", "base", "--data", "chats.jsonl", "--out", str(tmp_path / "run"), *flags,
                     "--stop-after", "2"]) == 0
        st = torch.load(tmp_path / "run" / "train_state.pt", weights_only=False)
        assert st["sft"]["data"] == str(a / "chats.jsonl") and st["args"]["data"] == str(a / "corp" / "c.txt")
        assert st["args"]["data_encoding"] == "latin-1"  # the base's split as `snlp eval SFT_CKPT` reads it
        (a / "corp" / "c.txt").write_text("other text\n" * 7)  # the base's text rewritten: SFT never reads it
        monkeypatch.chdir(b)
        capsys.readouterr()
        assert main(["sft", str(base), "--data", "chats.jsonl", "--out", str(tmp_path / "run"), "--resume"]) == 2
        assert "--data" in capsys.readouterr().err
        assert main(["sft", str(base), "--data", str(a / "chats.jsonl"), "--out", str(tmp_path / "run"),
                     "--resume", "--stop-after", "3"]) == 0
        shutil.rmtree(a / "corp")  # and gone: the resume does not care either
        assert main(["sft", str(base), "--data", str(a / "chats.jsonl"), "--out", str(tmp_path / "run"),
                     "--resume"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert torch.load(tmp_path / "run" / "train_state.pt", weights_only=False)["step"] == 4


def test_sft_chats_are_the_same_only_when_their_conversations_are(tmp_path):
    """mc: / chat: prefixed chat specs count as present when their file is (a prefix is not a path), and moved chats
    are accepted from a new place only where it gives the recorded conversations, in order (an mc: folder of .csv
    tasks included: what the loader reads, not what a file listing would)."""
    from snlp.train.sft import chat_digest, same_chats

    def task(d, rows):
        d.mkdir(parents=True, exist_ok=True)
        (d / "t.csv").write_text("".join(f"q{i},a,b,c,d,{ans}\n" for i, ans in rows))

    task(tmp_path / "mc", [(1, "A"), (2, "B")])
    task(tmp_path / "new", [(1, "A"), (2, "B")])
    task(tmp_path / "other", [(1, "A"), (2, "C")])
    assert chat.missing_parts(f"mc:{tmp_path / 'mc'},chat:{tmp_path / 'gone.jsonl'},hf:x") == \
        [f"chat:{tmp_path / 'gone.jsonl'}"]
    saved = {"data": f"mc:{tmp_path / 'mc'}", "max_conversations": 0,
             "data_digest": chat_digest(chat.load_conversations(f"mc:{tmp_path / 'mc'}"))}
    assert not same_chats(saved, f"mc:{tmp_path / 'other'}")  # the saved chats still there: another set refused
    gone = {**saved, "data": f"mc:{tmp_path / 'moved-away'}"}
    assert same_chats(gone, f"mc:{tmp_path / 'new'}")  # moved: the same conversations
    assert not same_chats(gone, f"mc:{tmp_path / 'other'}")  # one answer differs
    assert not same_chats(gone, f"mc:{tmp_path / 'nothing-here'}")
    assert same_chats({"data": gone["data"]}, f"mc:{tmp_path / 'other'}")  # an older record: nothing to check


def test_sft_grid_stopped_by_stop_file_text_stops_the_grid_unscored(tmp_path, monkeypatch, capsys):
    """A --stop-file holding "stop" written during the first SFT run stopped it, then the grid started the second,
    which read the text before its first step: 0 steps, saved, and the grid scored that base model as the SNLP-forward
    SFT run, status 0. Text stops the grid there now, unscored, and a rerun resumes the stopped run."""
    import snlp.apps.sft_grid as G

    write_task(tmp_path, 120, 100, 50, 2, 32)
    stop, out, plan = tmp_path / "STOP", tmp_path / "grid", "1xF1-h0-K1"
    hooks = G.file_hooks

    def writing(path):  # the file's text lands after the first run's step 2, as another process would write it
        h = hooks(path)

        def should_stop(done):
            if done == 2 and not stop.exists():
                stop.write_text("stop\n")
            return h.should_stop(done)
        return replace(h, should_stop=should_stop)
    monkeypatch.setattr(G, "file_hooks", writing)
    cmd = ["sft-grid", str(tmp_path / "base"), "--data", str(tmp_path / "chats.jsonl"), "--plan", plan,
           "--task", f"mc:{tmp_path / 'test.jsonl'}", "--out", str(out), "--stop-file", str(stop), *sft_flags(6),
           "--batch-size", "4"]
    assert main(cmd) == 0
    err = capsys.readouterr().err
    assert err.count("not a step number: stopping now") == 1, err
    assert "stopped SFT run sft-sequential (saved); the grid stops there, unscored" in err, err
    assert torch.load(out / "sft-sequential" / "train_state.pt", weights_only=False)["step"] == 2
    assert not (out / f"sft-{plan}").exists() and not (out / "grid.json").exists()
    stop.write_text("")  # emptied: the rerun resumes the stopped run, then trains and scores the other
    row = G.grid_row  # every row as a diverged record makes it (grid_row: Avg. NaN), which strict JSON holds as null
    monkeypatch.setattr(G, "grid_row", lambda *a: replace(row(*a), avg=float("nan")))
    assert main(cmd) == 0
    g = json.loads((out / "grid.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in grid.json"))
    assert all(r["avg"] is None for r in g["rows"])
    assert {k: v["steps"] for k, v in g["sft_runs"].items()} == {"sequential": 6, plan: 6}


def test_sft_loss_and_gradients_are_the_paper_models_on_the_same_conversations():
    """The training signal of one micro-batch against the paper's chat_sft: its GPT (nanochat-snlp, weights copied
    into ours) on the rows its loader builds (a conversation, then <|bos|> padding; targets the next ids, -1 where
    the mask is 0 and on the padding) gives the CE (the mean over the supervised targets, ignore_index -1) and every
    parameter's gradient that TrainStep gives on chat.collate's batch of the same conversations. Skipped without the
    paper code."""
    from tests.bench.test_vs_paper import PAPER

    if PAPER is None:
        pytest.skip("the paper code (nanochat-snlp) is not here")
    from snlp.bench.paper_peer import build_paper_model, load_paper_code, snlp_model_from_paper
    from snlp.io.nanochat import state_from_nanochat

    code = load_paper_code(PAPER, torch.float32)
    cfg = code.gpt.GPTConfig(sequence_len=32, vocab_size=256, n_layer=3, n_head=2, n_kv_head=2, n_embd=64,
                             window_pattern="L")
    paper = build_paper_model(code, cfg, torch.device("cpu"))
    with torch.no_grad():  # blocks that are not the identity, so every gradient is non-trivial
        for b in paper.transformer.h:
            b.attn.c_proj.weight.normal_(0, 0.05)
            b.mlp.c_proj.weight.normal_(0, 0.05)
        paper.lm_head.weight.normal_(0, 0.1)
    ours = snlp_model_from_paper(paper, "cpu", torch.float32).train()
    paper.train()
    g = torch.Generator().manual_seed(0)
    examples = []
    for n in (12, 20, 7):  # BOS, a user turn (mask 0), a reply (mask 1), another user turn
        ids = [0] + torch.randint(1, 256, (n - 1,), generator=g).tolist()
        mask = [0] * (n // 3) + [1] * (n // 3) + [0] * (n - 2 * (n // 3))
        examples.append(chat.ChatExample(ids, mask))
    capacity = max(len(e.ids) for e in examples)  # chat_sft's row_capacity: its rows are max_seq_len + 1 long
    rows = torch.tensor([e.ids + [0] * (capacity - len(e.ids)) for e in examples])
    x_p, y_p = rows[:, :-1].clone(), rows[:, 1:].clone()
    y_p[torch.tensor([e.mask + [0] * (capacity - len(e.mask)) for e in examples])[:, 1:] == 0] = -1
    for i, e in enumerate(examples):
        y_p[i, len(e.ids) - 1:] = -1
    loss_p = paper(x_p, y_p)
    loss_p.backward()
    x, y = chat.collate(examples, pad_id=0)
    loss, _, _ = TrainStep(ours, RegConfig(), None)(x, y, 0.0)
    loss.backward()
    assert loss.item() == pytest.approx(loss_p.item(), rel=1e-5)
    ours_cfg = ours.config
    want = state_from_nanochat({k: p.grad for k, p in paper.named_parameters() if p.grad is not None}, ours_cfg)
    got = {k: p.grad for k, p in ours.named_parameters()}
    assert set(want) <= set(got)
    assert len(want) >= 3 * 4 + 2  # every block's matrices, the embedding and the head
    for k, gw in want.items():
        assert torch.allclose(got[k], gw, rtol=1e-4, atol=1e-6), k


def test_chat_replies_are_the_paper_engines_greedy_tokens(tok):
    """`snlp generate --chat`'s decoding (Tokenizer.chat_prompt, sequential_generate stopping at chat_stop_ids) on
    the paper's GPT (weights copied into ours) gives its Engine's greedy reply (nanochat/engine.py, temperature 0,
    a row ends at <|assistant_end|> or <|bos|>), ours with the stop token at its end (the Engine drops it).
    Skipped without the paper code."""
    import sys
    import types

    from tests.bench.test_vs_paper import PAPER

    if PAPER is None:
        pytest.skip("the paper code (nanochat-snlp) is not here")
    from snlp.bench.paper_peer import build_paper_model, load_paper_code, snlp_model_from_paper
    from snlp.decode.generate import sequential_generate

    code = load_paper_code(PAPER, torch.float32)
    engine = sys.modules["nanochat.engine"]
    if not hasattr(engine, "Engine"):
        pytest.skip("the paper's engine could not be imported here (stubbed)")
    cfg = code.gpt.GPTConfig(sequence_len=64, vocab_size=tok.vocab_size, n_layer=3, n_head=2, n_kv_head=2,
                             n_embd=64, window_pattern="L")
    paper = build_paper_model(code, cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    end = tok.token_id("<|assistant_end|>")
    with torch.no_grad():  # random blocks and head, <|assistant_end|> raised so that replies stop within 24 tokens
        for b in paper.transformer.h:
            b.attn.c_proj.weight.normal_(0, 0.05, generator=g)
            b.mlp.c_proj.weight.normal_(0, 0.05, generator=g)
        paper.lm_head.weight.normal_(0, 0.1, generator=g)
        paper.lm_head.weight[end] += 0.2
    ours = snlp_model_from_paper(paper, "cpu", torch.float32)
    paper_tok = types.SimpleNamespace(encode_special=tok.tok.token_to_id, get_bos_token_id=lambda: tok.bos_id)
    stopped = 0
    for text in ("hello there", "how are you today", "fine"):
        prompt = tok.chat_prompt([{"role": "user", "content": text}])
        ref, _ = engine.Engine(paper.eval(), paper_tok).generate_batch(prompt, max_tokens=24, temperature=0.0)
        got = sequential_generate(ours, prompt, max_new_tokens=24, eos_id=list(tok.chat_stop_ids))
        want = ref[0][len(prompt):]
        assert got.tokens == (want + [end] if got.stop == "eos" else want)
        stopped += got.stop == "eos"
    assert stopped >= 2


def test_sft_start_line_counts_the_conversations_dropped_by_truncation(tok, tmp_path, capsys):
    """A conversation whose first user turn fills --seq-len + 1 tokens has no reply token left and is dropped
    (chat.render); the start line says how many, where it said only the kept counts."""
    save_checkpoint(tmp_path / "ck", tiny(tok, depth=2), tok)
    short = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "there"}]}
    long = {"messages": [{"role": "user", "content": "hello there " * 40}, {"role": "assistant", "content": "x"}]}
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps(c) + "\n" for c in [short] * 4 + [long] * 3))
    assert main(["sft", str(tmp_path / "ck"), "--data", str(f), "--out", str(tmp_path / "out"), "--steps", "1",
                 "--batch-size", "2", "--seq-len", "32", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "3 train / 1 val conversations" in out and "(3 dropped: no assistant token within 33 tokens)" in out


@pytest.mark.slow
def test_sft_under_ddp_equals_one_process_on_ragged_replies(tmp_path):
    """Two gloo ranks of batch 2 against one process of batch 4 (the same global batches, snlp.io.chat.batch_at) on
    conversations whose replies differ in length: the logged losses (token means over the global batch) and the
    weights agree. Each rank's CE is the mean over its own replies' tokens; averaged unweighted over the ranks
    (DDP's gradient average) a rank of short replies weighs as much as one of long ones, unlike one process."""
    import os
    import subprocess
    import sys

    from conftest import free_port
    from safetensors.torch import load_file

    rng = random.Random(0)
    words = "alpha beta gamma delta eps zeta eta theta iota kappa".split()
    with open(tmp_path / "chats.jsonl", "w") as f:
        for i in range(40):
            reply = " ".join(rng.choices(words, k=rng.choice([1, 2, 12, 20])))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"say {i}"},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    tk = Tokenizer.train([" ".join(words)] * 20 + [f"say {i}" for i in range(40)], 300)
    save_checkpoint(tmp_path / "base", tiny(tk, depth=3, train=True), tk)
    common = ["sft", str(tmp_path / "base"), "--data", str(tmp_path / "chats.jsonl"), "--steps", "2", "--seq-len", "64",
              "--eval-every", "1000", "--eval-batches", "1", "--log-every", "1", "--no-progress", "--device", "cpu",
              "--reg", "idn", "--reg-n", "2", "--reg-lambda", "5"]  # the regulariser's mean over real positions too
    assert main([*common, "--out", str(tmp_path / "one"), "--batch-size", "4"]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "-m",
           "snlp", *common, "--out", str(tmp_path / "two"), "--batch-size", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    logs = [[json.loads(l) for l in (tmp_path / d / "log.jsonl").read_text().splitlines()] for d in ("one", "two")]
    for a, b in zip(*logs):
        for k in ("loss", "reg", "val_loss"):
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-5), (k, a, b)
    one, two = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("one", "two"))
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-4, msg=k)  # fp32 reduction order, via Muon


def test_sft_resume_and_sft_grid_reuse_refuse_another_base(tmp_path, capsys):
    """A resumed SFT run continues its own weights whatever CKPT names: `snlp sft-grid B --out G` over a grid finished
    from base A reused A's fine-tunes and wrote a table captioned B (and `snlp sft B --resume` said "SFT of B" while
    fine-tuning A). The run records its base's weights fingerprint: another base is refused before any step, the
    same base under another path (moved) is accepted."""
    import shutil

    write_task(tmp_path, 40, 30, 20, 2, 32)
    tk = Tokenizer.load(tmp_path / "base" / "tokenizer.json")
    other = GPT(GPTConfig.from_depth(2, width=32, head_dim=16, vocab_size=tk.vocab_size, sequence_len=128))
    other.init_weights(seed=1)
    save_checkpoint(tmp_path / "other", other, tk)
    flags = ["--steps", "1", "--batch-size", "2", "--seq-len", "64", "--eval-every", "1000", "--eval-batches", "1",
             "--no-progress", "--device", "cpu"]
    grid = ["--data", str(tmp_path / "chats.jsonl"), "--plan", "1xF1-h0-K1", "--task", f"mc:{tmp_path / 'test.jsonl'}",
            "--out", str(tmp_path / "grid"), "--mc-limit", "2", *flags]
    assert main(["sft-grid", str(tmp_path / "base"), *grid]) == 0
    table = (tmp_path / "grid" / "grid.json").read_text()
    capsys.readouterr()
    assert main(["sft-grid", str(tmp_path / "other"), *grid]) == 2
    err = capsys.readouterr().err
    assert "whose weights are not" in err and "give the checkpoint it started from" in err, err
    assert (tmp_path / "grid" / "grid.json").read_text() == table
    shutil.copytree(tmp_path / "base", tmp_path / "moved")  # the same weights elsewhere: resumed
    assert main(["sft", str(tmp_path / "moved"), "--data", str(tmp_path / "chats.jsonl"), "--out",
                 str(tmp_path / "grid" / "sft-sequential"), "--resume", "--steps", "2"]) == 0
    assert torch.load(tmp_path / "grid" / "sft-sequential" / "train_state.pt", weights_only=False)["step"] == 2


@pytest.mark.parametrize("cmd", ["sft", "sft-grid", "adapt"])
def test_a_preheat_plan_is_refused_in_one_line_before_any_work(tmp_path, capsys, cmd):
    """The preheat init needs a calibration the training loops never pass: `snlp sft --forward` and `snlp adapt --plan`
    refused it only once the base and data were loaded (with the solver's library advice, preheat=...), and
    `snlp sft-grid` only after its whole sequential SFT run had trained. Now one line, before anything is written."""
    write_task(tmp_path, 40, 30, 20, 2, 32)
    base, chats, out, plan = str(tmp_path / "base"), str(tmp_path / "chats.jsonl"), tmp_path / "out", "1xF1-preheat-K1"
    flags = ["--steps", "1", "--batch-size", "2", "--seq-len", "32", "--no-progress", "--device", "cpu"]
    args = {"sft": ["sft", base, "--data", chats, "--forward", plan, "--out", str(out), *flags],
            "sft-grid": ["sft-grid", base, "--data", chats, "--plan", plan, "--task", f"mc:{tmp_path / 'test.jsonl'}",
                         "--out", str(out), *flags],
            "adapt": ["adapt", base, "--data", f"chat:{chats}", "--plan", plan, "--kv", "own", "--out", str(out),
                      *flags]}[cmd]
    capsys.readouterr()
    assert main(args) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.strip().splitlines() == [cap.err.strip()], cap.err
    assert "the preheat init" in cap.err and "use the h0 or fwd init" in cap.err, cap.err
    assert not out.exists() or not any(out.iterdir())


def test_sft_grid_refuses_regulariser_flags_without_a_regulariser(tmp_path, capsys):
    """`snlp sft --reg-lambda 3` without --reg is refused (the regulariser is off, the flag would do nothing);
    `snlp sft-grid`, which trains through the same flags, ran both SFT runs without it and said nothing."""
    write_task(tmp_path, 40, 30, 20, 2, 32)
    out = tmp_path / "grid"
    capsys.readouterr()
    assert main(["sft-grid", str(tmp_path / "base"), "--data", str(tmp_path / "chats.jsonl"), "--plan", "1xF1-h0-K1",
                 "--task", f"mc:{tmp_path / 'test.jsonl'}", "--out", str(out), "--reg-lambda", "3", "--steps", "1",
                 "--batch-size", "2", "--seq-len", "32", "--no-progress", "--device", "cpu"]) == 2
    cap = capsys.readouterr()
    assert cap.err.strip() == ("snlp sft-grid: error: --reg-lambda sets the SNLP-aware regulariser, and this run has "
                               "none (--reg none): give --reg idn, hcn or diag, or drop it"), cap.err
    assert not out.exists()


def test_negative_max_conversations_is_refused_not_read_as_one(tmp_path, capsys):
    """The chat loader stops once it holds `limit` conversations, so --max-conversations -1 read ONE conversation and
    the run failed with "gives 1 usable conversations" (or, over a folder, trained on a fraction of it). Refused."""
    write_task(tmp_path, 40, 30, 20, 2, 32)
    capsys.readouterr()
    assert main(["sft", str(tmp_path / "base"), "--data", str(tmp_path / "chats.jsonl"), "--out", str(tmp_path / "o"),
                 "--max-conversations", "-1", "--steps", "1", "--no-progress", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == "snlp sft: error: --max-conversations must be >= 0 (0: all; got -1)"
    assert not (tmp_path / "o").exists()


def test_sft_grid_refuses_a_bad_mc_limit_before_training(tmp_path, capsys):
    """sft-grid's --mc-limit reached MCConfig.check only when the first SFT run was scored: a negative one was
    refused after that run had trained (its folder left behind). Now before any training."""
    write_task(tmp_path, 40, 30, 20, 2, 32)
    out = tmp_path / "grid"
    capsys.readouterr()
    assert main(["sft-grid", str(tmp_path / "base"), "--data", str(tmp_path / "chats.jsonl"), "--plan", "1xF1-h0-K1",
                 "--task", f"mc:{tmp_path / 'test.jsonl'}", "--out", str(out), "--mc-limit", "-1", "--steps", "1",
                 "--batch-size", "2", "--seq-len", "32", "--no-progress", "--device", "cpu"]) == 2
    assert "--mc-limit must be >= 0" in capsys.readouterr().err
    assert not out.exists()


def test_forward_plan_fd_eps_below_the_step_dtype_floor_is_refused_before_the_data(tmp_path):
    """The SFT step computes under bf16 autocast on CUDA (snlp.train.precision), where diag:fd's step is at least
    0.088: a --forward plan with eps:0.01 was refused by solve only at the first step, after the conversations were
    read and rendered. The job refuses it before the data is read (the data here does not exist, so the loader's
    error is what a job that gets past the check raises); on CPU, fp32, eps:0.01 passes the check."""
    from conftest import text_checkpoint

    from snlp.train.config import TrainConfig
    from snlp.train.sft import SFTConfig, sft_job

    ckpt, _, _ = text_checkpoint(tmp_path)
    cfg = TrainConfig(out=str(tmp_path / "out"), device="cpu")
    scfg = SFTConfig(ckpt=str(ckpt), data=str(tmp_path / "missing.jsonl"), train=cfg, forward="2xF1-h0-K2-diag-eps:0.01")
    with pytest.raises(ValueError, match=r"eps:0.01 is below the smallest FD step of the compute dtype bfloat16"):
        sft_job(scfg)(cfg, None, None, 0, 1, torch.device("cuda"))
    with pytest.raises(Exception) as e:
        sft_job(scfg)(cfg, None, None, 0, 1, torch.device("cpu"))
    assert "FD step" not in str(e.value) and "missing.jsonl" in str(e.value)


def test_step_dtype_is_the_dtype_autocast_computes_in():
    """step_dtype names the dtype the SFT / training step computes in under autocast_context (bf16 autocast on CUDA):
    it said bf16 for fp64 weights, which autocast leaves in fp64 (its cast policy skips double), so SFT's fd-step
    check refused a diag:fd eps the fp64 step takes. Reference: the dtype torch's bf16 autocast gives a linear layer of
    each weight dtype (on the CPU, whose autocast casts the same dtypes); no autocast off CUDA."""
    from snlp.train.precision import step_dtype

    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        w = torch.ones(2, 2, dtype=dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = torch.nn.functional.linear(w, w).dtype
        assert step_dtype("cuda", dtype) == step_dtype(torch.device("cuda", 1), dtype) == autocast, dtype
        assert step_dtype("cpu", dtype) == dtype
    assert step_dtype("cuda", torch.int64) == torch.int64


def test_sft_grid_refuses_an_fd_eps_its_snlp_forward_run_cannot_take_before_training(tmp_path, capsys):
    """sft-grid trains the sequential SFT run first, then the SNLP-forward one, whose job refused a diag:fd eps below
    the FD step floor of its step's dtype (fp32 on the CPU: 3.45e-4) only then, after the first run had trained and
    been scored. Refused before any training: --out is never made."""
    write_task(tmp_path, 40, 30, 20, 2, 32)
    out = tmp_path / "grid"
    capsys.readouterr()
    assert main(["sft-grid", str(tmp_path / "base"), "--data", str(tmp_path / "chats.jsonl"), "--plan",
                 "1xF1-h0-K1-diag-eps:1e-5", "--task", f"mc:{tmp_path / 'test.jsonl'}", "--out", str(out), "--mc-limit",
                 "2", "--steps", "1", "--batch-size", "2", "--seq-len", "64", "--eval-every", "1000", "--eval-batches",
                 "1", "--no-progress", "--device", "cpu"]) == 2
    assert "eps:1e-05 is below the smallest FD step of the compute dtype float32" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("field, value, said", [("max_conversations", True, "--max-conversations must be an integer"),
                                                ("max_conversations", 2.0, "--max-conversations must be an integer"),
                                                ("val_frac", True, "--val-frac takes a number, not True")])
def test_sft_config_refuses_a_bool_as_a_count_or_fraction(field, value, said, tmp_path):
    """SFTConfig(max_conversations=True) read one conversation (True is the int 1), as TrainConfig's counts did:
    refused in one line before the checkpoint is read."""
    from snlp.train.config import TrainConfig
    from snlp.train.sft import SFTConfig, sft

    cfg = SFTConfig(ckpt=str(tmp_path / "missing"), data=str(tmp_path / "c.jsonl"),
                    train=TrainConfig(out=str(tmp_path / "o"), steps=1, device="cpu"), **{field: value})
    with pytest.raises(ValueError, match=said):
        sft(cfg)
    assert not (tmp_path / "o").exists()

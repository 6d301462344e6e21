"""Multiple-choice scoring: a diverged plan is reported diverged, not scored, and the
lm-evaluation-harness protocol (`--mc-scoring harness`) gives the same per-choice log-likelihoods and
picks as a transformers-only scorer written here, on real ARC-Easy questions with the real
SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import blowup_model

from snlp.io.checkpoint import save_checkpoint
from snlp.apps.cli import main
from snlp.eval.mc import MCConfig, markdown
from snlp.eval.mc_eval import evaluate_mc
from snlp.io.mctasks import Question, letter_prompt, parse_file
from snlp.eval.mc_harness import default_scoring, draw_shots, loglikelihoods, predictions
from snlp.method.plan import Plan
from snlp.method.solver import SNLPDivergenceError, bind
from snlp.io.tokenizer import Tokenizer


# The first 40 ARC-Easy test and 8 train questions, vendored (tests/data/README.md: source and licence), so the
# tests need nothing beside the repository.
ARC = Path(__file__).resolve().parents[1] / "data/arc"
ARC_TEST, ARC_TRAIN = ARC / "ARC-Easy-Test-head.jsonl", ARC / "ARC-Easy-Train-head.jsonl"


# ----- a diverged plan is not scored -----
QS = [Question("Which number is largest?", ("1", "7", "3", "2"), 1),
      Question("Which one is a colour?", ("red", "dog", "run", "ten"), 0),
      Question("hello there, how are you today?", ("fine", "bad", "ok"), 2)]
DIVERGING, EXACT = "8xF1-h0-K1-newton", "8xF1-h0-K8"


@pytest.fixture(scope="module")
def blowup():
    """A tiny depth-8 model whose MLP weights are scaled 1000x: the sequential forward stays finite
    (pre-norm blocks add bounded updates) but the exact-Jacobian Newton step of a K=1 plan multiplies
    the chunks' huge Jacobians and overflows to inf/NaN."""
    text = ["Which number is largest? Multiple Choice question: hello there, how are you today?"] * 20
    tok = Tokenizer.train(text + [letter_prompt(q) for q in QS] * 5, 300)
    return blowup_model(tok.vocab_size), tok


def test_the_plan_really_diverges_and_the_sequential_forward_does_not(blowup):
    m, tok = blowup
    x = torch.tensor([tok.render_chat([{"role": "user", "content": letter_prompt(QS[0])}],
                                      add_generation_prompt=True)[0]])
    with torch.no_grad():
        assert torch.isfinite(m(x)).all()
        assert not torch.isfinite(bind(m, DIVERGING, check_finite=False)(x)).all()
        with pytest.raises(SNLPDivergenceError):
            bind(m, DIVERGING)(x)
        torch.testing.assert_close(bind(m, EXACT)(x), m(x), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("scoring", ["letter", "loglik", "harness"])
def test_a_diverged_plan_is_reported_diverged_not_scored(blowup, scoring):
    m, tok = blowup
    res = evaluate_mc(m, tok, MCConfig(task="toy", plans=[DIVERGING, EXACT], scoring=scoring), QS)
    seq, div, exact = res.records
    assert [r.method for r in res.records] == ["sequential", DIVERGING, EXACT]
    assert div.diverged and div.accuracy is None and div.correct is None and div.ci_low is None
    assert div.norm_accuracy is None and div.n == 3
    assert not seq.diverged and not exact.diverged and seq.accuracy is not None
    assert exact.correct == seq.correct  # K >= C is exact: the same picks as sequential
    md = markdown(res)
    assert md.splitlines()[1].startswith(f"protocol: {scoring}")  # the caption line names the protocol
    row = next(line for line in md.splitlines() if line.startswith(f"| {DIVERGING} |"))
    assert "diverged" in row and "%" not in row
    assert json.loads(json.dumps(res.to_dict()))["records"][1]["diverged"] is True


# ----- the harness protocol -----
def test_draw_shots_is_the_harness_sampler():
    pool = [Question(f"q{i}", ("a", "b"), i % 2) for i in range(50)]
    qs = pool[:5] + [Question("new", ("a", "b"), 0)]
    shots = draw_shots(qs, pool, 3, seed=1234)
    rnd = random.Random(1234)  # the pool holds the questions: k + 1 drawn per question, itself removed
    want = [[s for s in rnd.sample(pool, 4) if s != q][:3] for q in qs]
    assert shots == want
    assert all(len(s) == 3 and q not in s and len(set(s)) == 3 for q, s in zip(qs, shots))
    other = [Question(f"t{i}", ("a", "b"), 0) for i in range(10)]
    rnd = random.Random(7)  # a disjoint pool: exactly k drawn
    assert draw_shots(qs, other, 2, seed=7) == [rnd.sample(other, 2) for _ in qs]
    with pytest.raises(ValueError, match="shot pool"):
        draw_shots(qs, other[:1], 2)


def test_harness_config_errors():
    with pytest.raises(ValueError, match="needs --mc-scoring harness"):
        MCConfig(task="x", scoring="loglik", shots=1, shot_task="y").check()
    with pytest.raises(ValueError, match="needs --mc-shots-from"):
        MCConfig(task="x", scoring="harness", shots=1).check()
    with pytest.raises(ValueError, match="letter, loglik or harness"):
        MCConfig(task="x", scoring="acc").check()


def test_default_scoring_is_harness_except_for_sft_checkpoints(blowup, tmp_path):
    m, tok = blowup
    save_checkpoint(tmp_path / "base", m, tok)
    save_checkpoint(tmp_path / "pre", m, tok, train_state={"step": 3, "args": {}})
    save_checkpoint(tmp_path / "sft", m, tok, train_state={"step": 3, "args": {}, "sft": {"forward": "sequential"}})
    assert [default_scoring(tmp_path / n) for n in ("base", "pre", "sft")] == ["harness", "harness", "letter"]


# ----- against transformers on real questions -----
N_Q = 8


@pytest.fixture(scope="module")
def arc():
    rows = [json.loads(line) for line in ARC_TEST.read_text().splitlines()[:N_Q]]
    train = [json.loads(line) for line in ARC_TRAIN.read_text().splitlines()[:1]]
    return rows, train, parse_file(ARC_TEST)[:N_Q], parse_file(ARC_TRAIN)[:1]


def hf_scores(hf, hf_tok, ctx: str, choices: list[str]) -> list[float]:
    """transformers alone: summed log-probs of the tokens of ' {choice}' after the context."""
    out = []
    ctx_ids = hf_tok(ctx, add_special_tokens=False)["input_ids"]
    for c in choices:
        cont = hf_tok(" " + c, add_special_tokens=False)["input_ids"]
        # the harness splits encode(ctx + cont) at len(encode(ctx)); on these questions that is the same as
        # encoding the continuation on its own (':' and ' word' never merge)
        assert hf_tok(ctx + " " + c, add_special_tokens=False)["input_ids"] == ctx_ids + cont
        ids = torch.tensor([ctx_ids + cont])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].float(), -1)  # (T, V)
        out.append(sum(float(logp[len(ctx_ids) - 1 + i, t]) for i, t in enumerate(cont)))
    return out


def _ctx(row, shot=None) -> str:
    pre = ""
    if shot is not None:
        ans = [c["text"] for c in shot["question"]["choices"] if c["label"] == shot["answerKey"]][0]
        pre = f"Question: {shot['question']['stem']}\nAnswer: {ans}\n\n"
    return pre + f"Question: {row['question']['stem']}\nAnswer:"


@pytest.fixture
def smol_pair(smol_ckpt, request):
    hf, hf_tok = request.getfixturevalue("hf_smol")
    model, tok = request.getfixturevalue("smol")
    return hf, hf_tok, model, tok


@pytest.mark.parametrize("k", [0, 1])
def test_harness_scores_equal_transformers(smol_pair, arc, k):
    hf, hf_tok, model, tok = smol_pair
    rows, train, qs, pool = arc
    assert [len(q.choices) for q in qs] == [len(r["question"]["choices"]) for r in rows]
    ref = [hf_scores(hf, hf_tok, _ctx(r, train[0] if k else None), [c["text"] for c in r["question"]["choices"]])
           for r in rows]
    got = loglikelihoods(model, tok, qs, None, [pool[:1] if k else [] for _ in qs], batch=8)
    for g, r in zip(got, ref):
        assert g == pytest.approx(r, abs=2e-4, rel=1e-5)
    acc, norm = predictions(qs, got)
    texts = [[c["text"] for c in r["question"]["choices"]] for r in rows]
    want_acc = [max(range(len(r)), key=r.__getitem__) for r in ref]
    want_norm = [max(range(len(r)), key=lambda i: r[i] / len(t[i])) for r, t in zip(ref, texts)]
    assert acc == want_acc and norm == want_norm
    assert acc != norm or k == 1  # acc and acc_norm differ on these questions 0-shot: they are not one metric


def test_harness_mode_runs_every_plan_and_the_exact_plan_matches(smol_pair, arc):
    _, _, model, tok = smol_pair
    qs = arc[2][:2]
    res = evaluate_mc(model, tok, MCConfig(task="arc", plans=["2xF1-h0-K2", "8xF1-h0-K1"], scoring="harness"), qs)
    seq, exact, approx = res.records
    assert [r.method for r in res.records] == ["sequential", "2xF1-h0-K2", "8xF1-h0-K1"]
    assert not any(r.diverged for r in res.records) and all(0 <= r.norm_correct <= 2 for r in res.records)
    assert (exact.correct, exact.norm_correct) == (seq.correct, seq.norm_correct)
    s_seq = loglikelihoods(model, tok, qs, None)
    s_exact = loglikelihoods(model, tok, qs, Plan.parse("2xF1-h0-K2"))
    for a, b in zip(s_seq, s_exact):
        assert a == pytest.approx(b, abs=1e-3)  # K >= C: exact up to fp32 reordering
    assert res.protocol.startswith("protocol: harness") and "0-shot" in res.protocol


def test_eval_cli_defaults_to_harness_and_captions_the_protocol(smol_pair, smol_ckpt, tmp_path, capsys):
    rc = main(["eval", str(smol_ckpt), "--task", f"mc:{ARC_TEST}", "--plans", "2xF1-h0-K2", "--mc-limit", "2",
               "--mc-shots", "1", "--mc-shots-from", f"mc:{ARC_TRAIN}", "--device", "cpu",
               "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md")])
    assert rc == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["scoring"] == "harness" and res["shots"] == 1 and [r["n"] for r in res["records"]] == [2, 2]
    md = (tmp_path / "r.md").read_text()
    assert "protocol: harness" in md and "1-shot" in md and "acc_norm" in md
    assert "protocol: harness" in capsys.readouterr().out


def test_sft_grid_shows_a_diverged_inference_row(blowup):
    """snlp sft-grid builds its rows from the MC records: a diverged one is shown, not a TypeError on None."""
    from snlp.apps.sft_grid import GridResult, grid_row
    from snlp.apps.sft_grid import markdown as grid_markdown

    m, tok = blowup
    res = evaluate_mc(m, tok, MCConfig(task="toy", plans=[DIVERGING]), QS)
    rows = [grid_row("sequential", r.method, {"toy": r}) for r in res.records]
    assert rows[0].avg == res.records[0].accuracy and rows[1].avg != rows[1].avg  # NaN
    md = grid_markdown(GridResult("ck", DIVERGING, ["toy"], "letter", rows))
    assert f"| sequential | {DIVERGING} | diverged | – |" in md


# ----- --mc-scoring loglik scores the choice's text, not the template's end-of-turn tokens -----
LOGLIK_QS = [Question("What is the capital of France?", ("Paris", "New York City", "a, b."), 0),
             Question("Which gas do plants take in?", ("carbon dioxide", "oxygen"), 0)]


@pytest.mark.slow
def test_loglik_scores_the_choice_text_only_with_smollm2s_template(smol_pair):
    """SmolLM2's ChatML template ends a reply in <|im_end|> + '\\n' (both in the assistant mask). Reference:
    transformers' own template rendering of the generation prompt, then the tokens of the choice alone, and
    the mean log-prob of those tokens under transformers' model."""
    from snlp.eval.mc import choice_positions, loglik_scores

    hf, hf_tok, model, tok = smol_pair
    ref = []
    for q in LOGLIK_QS:
        prompt = hf_tok.apply_chat_template([{"role": "user", "content": q.question}], add_generation_prompt=True,
                                            tokenize=False)
        p_ids = hf_tok(prompt, add_special_tokens=False)["input_ids"]
        row = []
        for c in q.choices:
            c_ids = hf_tok(c, add_special_tokens=False)["input_ids"]
            ids, pos = choice_positions(tok, q.question, c)
            assert tok.decode([ids[t] for t in pos]) == c  # before the fix: 'Paris<|im_end|>'
            assert ids[:len(p_ids) + len(c_ids)] == p_ids + c_ids and pos == list(range(len(p_ids), len(p_ids) + len(c_ids)))
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([p_ids + c_ids])).logits[0].float(), -1)  # (T, V)
            row.append(sum(float(logp[len(p_ids) - 1 + i, t]) for i, t in enumerate(c_ids)) / len(c_ids))
        ref.append(row)
    got = loglik_scores(model, tok, LOGLIK_QS, None)
    for g, r in zip(got, ref):
        assert g == pytest.approx(r, abs=1e-4)


CHATML_LIKE = [  # (template, what the reply's masked span holds besides the choice)
    # ChatML-like: a two-token end-of-turn suffix after the reply
    ("{% for m in messages %}<s> {{ m['content'] }} </s> t1{% endfor %}{% if add_generation_prompt %}<s>{% endif %}",
     "</s> t1"),
    # a longer suffix, and a template token inside the reply's span before the text
    ("{% for m in messages %}<s> t2 {{ m['content'] }} </s> t1 t3{% endfor %}{% if add_generation_prompt %}<s>{% endif %}",
     "t2 ... </s> t1 t3"),
    # a reply prefix inside the assistant turn that holds the choice's own words (a Qwen3-style think block): the
    # first window holding the text was the template's t5, not the reply's
    ("{% for m in messages %}<s> {% if m['role'] == 'assistant' %}t5 t6 {% endif %}{{ m['content'] }} </s>{% endfor %}"
     "{% if add_generation_prompt %}<s>{% endif %}", "t5 t6 ... </s>"),
]


@pytest.mark.parametrize("template,extra", CHATML_LIKE)
def test_loglik_scored_tokens_decode_to_the_choice_under_any_template(template, extra):
    from conftest import word_tokenizer
    from snlp.eval.mc import choice_positions

    hf = word_tokenizer(40)
    hf.chat_template = template
    tok = Tokenizer.from_hf(hf)
    for c in ("t5", "t6", "t5 t6 t7"):
        ids, mask = tok.render_chat([{"role": "user", "content": "t9 t8"}, {"role": "assistant", "content": c}])
        assert sum(mask) > len(c.split())  # the mask covers more than the choice: what the fix must leave out
        ids, pos = choice_positions(tok, "t9 t8", c)
        assert tok.decode([ids[t] for t in pos]) == c and len(pos) == len(c.split())
        # the reply's tokens are the last ones before the end-of-turn marker (the outside reference: the rendering)
        end = max(t for t, i in enumerate(ids) if i == tok.token_id("</s>"))
        assert pos == list(range(end - len(c.split()), end))
    native = Tokenizer.train(["the capital of france is paris"] * 5, 300)  # nanochat's own template
    ids, pos = choice_positions(native, "capital?", "paris")
    assert [ids[t] for t in pos] == native.encode("paris")


def test_loglik_refuses_a_template_that_does_not_render_the_choice():
    from conftest import word_tokenizer
    from snlp.eval.mc import choice_positions

    hf = word_tokenizer(40)
    hf.chat_template = ("{% for m in messages %}<s> t1{% if m['role'] == 'user' %} {{ m['content'] }}{% endif %} </s>"
                        "{% endfor %}{% if add_generation_prompt %}<s> t1{% endif %}")  # drops the reply's text
    with pytest.raises(ValueError, match="does not render the choice 't5'"):
        choice_positions(Tokenizer.from_hf(hf), "t9", "t5")


# ----- a question's score does not depend on the questions batched with it -----
BATCH_QS = QS + [Question("Which one is a colour, if any of these words is one at all?", ("blue", "cat"), 0),
                 Question("Pick", ("one", "two", "three"), 2)]


@pytest.mark.parametrize("plan", ["4xF1-h0-K1-diag", "4xF1-fwd-K2-diag:vjp-probes:2"])
def test_mc_scores_do_not_depend_on_the_batch(plan):
    """A DiagN plan draws its Hutchinson probes with the shape of the whole batch: the letter, loglik and
    harness-copy protocols solved the padded batch at once, so a question's scores moved with the questions batched
    with it (by nats, flipping picks). Now its rows are solved at their own lengths, as the harness path (SNLPLM)
    solves them: batch 1 == batch 8, and the harness copy's log-likelihoods equal the harness path's."""
    from conftest import make_model

    from snlp.eval.mc import loglik_scores, predict_letter

    tok = Tokenizer.train(["Which number is largest? Multiple Choice question: the colour red. " * 4]
                          + [letter_prompt(q) for q in BATCH_QS] * 3, 300)
    model = make_model(vocab_size=tok.vocab_size, n_layer=4, sequence_len=256, window_pattern="L")
    p = Plan.parse(plan, 4)
    for score in (loglikelihoods, loglik_scores, predict_letter):
        one, eight = (score(model, tok, BATCH_QS, p, batch=b) for b in (1, 8))
        assert one == eight, score.__name__
    lm_eval_path = pytest.importorskip("snlp.eval.harness_mc")
    via = [s.lls for s in lm_eval_path.mc_samples(model, tok, BATCH_QS, p, batch=8)]
    torch.testing.assert_close(torch.tensor([x for q in via for x in q], dtype=torch.float64),
                               torch.tensor([x for q in loglikelihoods(model, tok, BATCH_QS, p, batch=8) for x in q],
                                            dtype=torch.float64), atol=1e-4, rtol=0)


def test_harness_copy_log_likelihoods_of_an_fp64_model_are_fp64():
    """The harness copy took its log-softmax of `model.head(...).float()`: an fp64 model's log-likelihoods came out
    rounded to fp32 (errors ~1e-6 nats against fp64). Now the head's logits are taken as they are (fp32 at least,
    fp64 for an fp64 model): the scores equal a naive fp64 reference, the full forward's log-softmax summed over each
    continuation, to fp64 round-off."""
    from conftest import make_model

    from snlp.eval.mc_harness import TARGET_DELIMITER, context, encode_pair

    tok = Tokenizer.train(["Which number is largest? Multiple Choice question: the colour red. " * 4]
                          + [letter_prompt(q) for q in BATCH_QS] * 3, 300)
    model = make_model(vocab_size=tok.vocab_size, n_layer=4, sequence_len=256, window_pattern="L")  # fp64
    got = loglikelihoods(model, tok, BATCH_QS, None, batch=4)
    for q, scores in zip(BATCH_QS, got):
        for c, s in zip(q.choices, scores):
            ctx, cont = encode_pair(tok, context(q, []), TARGET_DELIMITER + c)
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ctx + cont[:-1]]))[0], -1)  # (T, V), fp64
            want = float(sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))
            assert abs(s - want) < 1e-10, (q.question, c, s - want)

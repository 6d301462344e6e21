"""Multiple-choice records and tables against hand counts: the per-subject rows cover every question, each question
is counted once, a bad task fails before the model loads, a model whose own forward is NaN is an error."""

import json

import pytest
import torch
from conftest import CITIZENS, make_model, text_checkpoint

import snlp.io.checkpoint
from snlp.apps.cli import main
from snlp.decode.session import NonFiniteModelError
from snlp.eval.mc import MCConfig, MCResult, markdown, score
from snlp.eval.mc_eval import evaluate_mc
from snlp.io.mctasks import Question, load_task
from snlp.io.tokenizer import MIN_VOCAB, Tokenizer


def test_the_per_subject_rows_cover_the_questions_without_a_subject():
    """An ARC file (no subject) beside MMLU CSVs of two subjects: the per-subject rows must add up to N, the questions
    without a subject a row of their own, counted by hand."""
    qs = [Question("a1", ("x", "y"), 0, "algebra"), Question("a2", ("x", "y"), 1, "algebra"),
          Question("b1", ("x", "y", "z"), 2, "biology"),
          Question("n1", ("x", "y"), 0), Question("n2", ("x", "y"), 1), Question("n3", ("x", "y"), 0)]
    preds = [0, 0, 2, 0, 1, 1]  # algebra 1 of 2, biology 1 of 1, no subject 2 of 3
    rec = score(preds, qs, "sequential")
    assert rec.n == 6 and rec.correct == 4
    assert sum(v["n"] for v in rec.subjects.values()) == rec.n
    assert sum(v["correct"] for v in rec.subjects.values()) == rec.correct
    assert {s: (v["n"], v["correct"]) for s, v in rec.subjects.items()} == {
        "algebra": (2, 1), "biology": (1, 1), "": (3, 2)}
    md = markdown(MCResult("mc:x", "letter", [rec]))
    assert "| (no subject) | 3 | 66.7 |" in md and "| algebra | 2 | 50.0 |" in md


def test_one_subject_or_none_has_no_per_subject_table():
    """A task with no subjects, or one subject only, has no per-subject rows (the overall row says it all)."""
    plain = [Question("q", ("x", "y"), 0), Question("r", ("x", "y"), 1)]
    assert score([0, 0], plain, "sequential").subjects == {}
    assert score([0, 0], [Question(q.question, q.choices, q.answer, "s") for q in plain], "sequential").subjects == {}


def test_a_task_file_named_twice_is_refused(tmp_path):
    """mc:a.jsonl,a.jsonl (or a file and its folder) scored every question twice: N doubled and the Wilson interval
    narrowed as if the task held twice the questions."""
    f = tmp_path / "a.jsonl"
    f.write_text(json.dumps({"question": "q", "choices": ["x", "y"], "answer": 0}) + "\n")
    assert len(load_task(f"mc:{f}")) == 1
    for spec in (f"mc:{f},{f}", f"mc:{tmp_path},{f}", f"mc:{f},{tmp_path / '.' / 'a.jsonl'}"):
        with pytest.raises(ValueError, match="twice"):
            load_task(spec)


@pytest.mark.parametrize("flags, msg", [
    (["--task", "mc:{d}/nope.jsonl", "--plans", "4xF1-h0-K1"], "does not exist"),
    (["--task", "mc:{d}/bad.jsonl", "--plans", "4xF1-h0-K1"], "bad.jsonl:2: answer index 7"),
    (["--task", "mc:{d}/q.jsonl"], "--plans is required"),
    (["--task", "mc:{d}/q.jsonl", "--plans", "4xF1-h0-K1", "--mc-shots", "2"], "needs --mc-shots-from"),
    (["--task", "mc:{d}/q.jsonl", "--plans", "4xF1-h0-K1", "--mc-shots", "3", "--mc-shots-from", "mc:{d}/q.jsonl"],
     "3-shot needs at least 4 questions in the shot pool, which holds 2"),
    (["--task", "mc:{d}/q.jsonl", "--plans", "4xF1-h0-K1", "--mc-limit", "-1"], "--mc-limit must be >= 0"),
    (["--task", "mc:{d}/q.jsonl", "--plans", "4xF1-h0-K1", "--mc-shots-from", "mc:{d}/q.jsonl"],
     "--mc-shots is 0: give --mc-shots K"),
])
def test_a_bad_task_is_refused_before_the_checkpoint_loads(tmp_path, monkeypatch, capsys, flags, msg):
    """`snlp eval --task`: a missing or malformed task file, a shot pool too small, --mc-shots without its pool,
    --mc-limit -1 or no --plans each fail in one line before the model loads (they came after it, the shot pool's
    only once the sequential method was being scored); --mc-shots-from without --mc-shots was ignored (a 0-shot
    run) and is refused."""
    ck, _, _ = text_checkpoint(tmp_path)
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"question": f"q{i}", "choices": ["x", "y"], "answer": 0})
                                              + "\n" for i in range(2)))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "q", "choices": ["x", "y"], "answer": 0}) + "\n"
                                        + json.dumps({"question": "r", "choices": ["x", "y"], "answer": 7}) + "\n")
    monkeypatch.setattr(snlp.io.checkpoint, "load", lambda *a, **k: pytest.fail("the checkpoint loaded first"))
    assert main(["eval", str(ck), *(f.format(d=tmp_path) for f in flags), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("scoring, implementation", [("letter", "auto"), ("loglik", "auto"), ("harness", "snlp"),
                                                     ("harness", "lm_eval")])
def test_a_model_whose_own_forward_is_nan_is_an_error_not_an_always_a_accuracy(scoring, implementation):
    """A NaN weight: the sequential forward's NaN logits argmaxed to choice 0, so letter and loglik scoring recorded
    the sequential model at 100 % on questions whose answer is A (every plan on the same weights "diverged"), and
    the harness scorings recorded the sequential model as a diverged plan. The model's own NaN is an error naming
    it (NonFiniteModelError), as decoding raises it."""
    if implementation == "lm_eval":
        pytest.importorskip("lm_eval")
    tok = Tokenizer.train([CITIZENS], vocab_size=MIN_VOCAB + 40)
    model = make_model(seed=5, vocab_size=tok.vocab_size, n_layer=4, n_embd=32, sequence_len=128)
    with torch.no_grad():
        next(model.blocks[1].parameters()).view(-1)[0] = float("nan")
    qs = [Question("Who speaks first?", ("First Citizen", "All", "Nobody"), 0), Question("What?", ("die", "famish"), 0)]
    cfg = MCConfig(task="mc:x", plans=["4xF1-h0-K1"], scoring=scoring, implementation=implementation)
    with pytest.raises(NonFiniteModelError, match="the model's own forward"):
        evaluate_mc(model, tok, cfg, questions=qs)

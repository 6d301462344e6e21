"""Multiple-choice records and tables against hand counts: the per-subject rows cover every question, each question
is counted once."""

import json

import pytest

from snlp.eval.mc import MCResult, markdown, score
from snlp.io.mctasks import Question, load_task


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

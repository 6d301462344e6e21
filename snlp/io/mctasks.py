"""Multiple-choice task data: parse ARC / MMLU / plain JSONL questions into `Question`s, and the lettered
prompt of a question. Read by the evaluation (snlp.eval.mc) and by chat SFT data (`mc:` sets).

Tasks: `mc:PATH[,PATH...]` local files or folders, `arc-easy`, `arc-challenge` and `mmlu[:SUBJECT,...]`
(through the Hugging Face `datasets` library: needs network). File schemas:
  - AI2 ARC JSONL: {"question": {"stem", "choices": [{"label", "text"}]}, "answerKey"}
  - MMLU CSV, no header: question,A,B,C,D,answer (letter); the subject is the file name without _test/_dev/_val
  - plain JSONL: {"question", "choices": [...], "answer": index | letter | choice text, "subject"?}
All parse to the same `Question`s.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from snlp.io.source import did_you_mean, home_path

LETTERS = "ABCDEFGHIJ"
HF_TASKS = {"arc-easy": ("allenai/ai2_arc", "ARC-Easy", "test"), "arc-challenge": ("allenai/ai2_arc", "ARC-Challenge", "test"),
            "mmlu": ("cais/mmlu", None, "test")}


@dataclass(frozen=True)
class Question:
    question: str
    choices: tuple[str, ...]
    answer: int  # index into choices
    subject: str = ""


# ----- parsing -----
def _check(q: str, choices, answer: int, where: str, subject: str = "") -> Question:
    if not isinstance(q, str) or not q.strip():
        raise ValueError(f"{where}: empty or missing question text")
    if not choices:
        raise ValueError(f"{where}: no choices")
    if len(choices) > len(LETTERS):
        raise ValueError(f"{where}: {len(choices)} choices; at most {len(LETTERS)} are supported")
    if any(not isinstance(c, str) or not c.strip() for c in choices):
        raise ValueError(f"{where}: every choice must be a non-empty string")
    if not 0 <= answer < len(choices):
        raise ValueError(f"{where}: answer index {answer} is not among the {len(choices)} choices")
    return Question(q, tuple(choices), answer, subject)


def _answer_index(ans, choices, labels, where: str) -> int:
    """An answer given as an index, a label/letter or the choice text -> index."""
    if ans is None or (isinstance(ans, str) and not ans.strip()):
        raise ValueError(f"{where}: missing answer")
    if isinstance(ans, bool):
        raise ValueError(f"{where}: answer {ans!r} is neither an index, a letter nor a choice text")
    if isinstance(ans, int):
        if not 0 <= ans < len(choices):
            raise ValueError(f"{where}: answer index {ans} is not among the {len(choices)} choices")
        return ans
    ans = str(ans).strip()
    if ans in labels:
        return labels.index(ans)
    if ans in choices:
        return list(choices).index(ans)
    raise ValueError(f"{where}: answer {ans!r} is not among the choices' labels {labels} nor their texts")


def parse_row(row, where: str, subject: str = "") -> Question:
    """One JSON row, ARC or plain schema."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object")
    q = row.get("question")
    if isinstance(q, dict):  # AI2 ARC
        raw = q.get("choices")
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"{where}: empty or missing question.choices")
        if any(not isinstance(c, dict) or "text" not in c or "label" not in c for c in raw):
            raise ValueError(f"{where}: each of question.choices needs 'label' and 'text'")
        labels = [str(c["label"]) for c in raw]
        choices = [c["text"] for c in raw]
        ans = _answer_index(row.get("answerKey"), choices, labels, where)
        return _check(q.get("stem"), choices, ans, where, subject)
    if "choices" not in row:
        raise ValueError(f"{where}: no 'choices' (plain rows are {{question, choices, answer}}, ARC rows "
                         f"{{question: {{stem, choices}}, answerKey}})")
    choices = row["choices"]
    if isinstance(choices, dict) and "text" in choices:  # Hugging Face ai2_arc rows: {text: [...], label: [...]}
        labels, choices = [str(x) for x in choices.get("label", [])], list(choices["text"])
    elif isinstance(choices, list):
        labels = list(LETTERS[:len(choices)])
    else:
        raise ValueError(f"{where}: 'choices' must be a list of strings")
    if not choices:
        raise ValueError(f"{where}: no choices")
    ans = _answer_index(row.get("answer", row.get("answerKey")), choices, labels, where)
    return _check(q, choices, ans, where, str(row.get("subject", subject) or ""))


def _subject_of(path: Path) -> str:
    stem = path.stem
    for suf in ("_test", "_dev", "_val", "_validation"):
        if stem.endswith(suf):
            return stem[: -len(suf)]
    return stem


def parse_file(path) -> list[Question]:
    """Questions of one .jsonl (ARC or plain) or .csv (MMLU) file; errors name the line."""
    path = Path(path)
    out = []
    if path.suffix.lower() == ".csv":
        subject = _subject_of(path)
        with open(path, newline="", encoding="utf-8") as f:
            for i, row in enumerate(csv.reader(f), 1):
                where = f"{path}:{i}"
                if not row:
                    continue
                if len(row) < 3:
                    raise ValueError(f"{where}: MMLU rows are question,A,B,C,D,answer (got {len(row)} fields)")
                choices = row[1:-1]
                out.append(_check(row[0], choices, _answer_index(row[-1], choices, list(LETTERS[:len(choices)]), where),
                                  where, subject))
    elif path.suffix.lower() == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{i}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e})") from e
                out.append(parse_row(row, where))
    else:
        raise ValueError(f"{path}: unknown multiple-choice file type; use .jsonl (ARC or {{question, choices, "
                         f"answer}}) or .csv (MMLU: question,A,B,C,D,answer)")
    if not out:
        raise ValueError(f"{path} holds no questions")
    return out


def _hf_rows(name: str, config: str | None, split: str):
    try:
        import datasets
    except ImportError as e:
        raise ValueError(f"task {name} needs the Hugging Face datasets library (pip install 'snlp[hf]') and "
                         f"network; offline, pass local files as --task mc:PATH") from e
    from snlp.io.hub import blocked, offline_if_unreachable

    try:
        with offline_if_unreachable():  # no hub: from datasets' cache at once, not after its retries
            return list(datasets.load_dataset(name, config, split=split))
    except Exception as e:  # offline / unknown: assorted exception types
        why = blocked()
        said = f"{type(e).__name__}: {' '.join(str(e).split())}"
        # datasets answers a name its cache lacks with the hub's ConnectionError (offline mode); any other error is
        # the cache's own (a truncated arrow file, another config only) and is said as it is
        where = (f"{why}, and datasets' cache does not hold it" if isinstance(e, ConnectionError)
                 else f"{why}; datasets' cache: {said}") if why else said
        raise ValueError(f"could not load {name} {config or ''} from the Hugging Face hub ({where}); "
                         f"offline, pass local files as --task mc:PATH (ARC JSONL or MMLU CSV)") from e


def load_task(task: str) -> list[Question]:
    """Questions of a --task spec (see the module docstring)."""
    if task.startswith("mc:"):
        out, seen = [], {}
        for part in (p for p in task[3:].split(",") if p.strip()):
            p = home_path(part)
            if p.is_dir():
                files = sorted(f for f in p.iterdir() if f.suffix.lower() in (".jsonl", ".csv"))
                if not files:
                    raise ValueError(f"task folder {p} holds no .jsonl/.csv files")
            elif p.is_file():
                files = [p]
            else:
                raise ValueError(f"task file {p} does not exist{did_you_mean(part)}")
            for f in files:
                # a file named twice (or a file and its folder) would count its questions twice: N and the
                # accuracy's interval would claim twice the evidence the task holds
                if f.resolve() in seen:
                    raise ValueError(f"task {task!r} names {f} twice ({seen[f.resolve()]} and {part}): each "
                                     f"question would be scored twice")
                seen[f.resolve()] = part
                out += parse_file(f)
        if not out:
            raise ValueError(f"task {task!r} names no files")
        return out
    name, _, rest = task.partition(":")
    if name not in HF_TASKS:
        raise ValueError(f"unknown task {task!r}; valid: mc:PATH[,PATH...], arc-easy, arc-challenge, mmlu[:SUBJECT,...]")
    repo, config, split = HF_TASKS[name]
    if name == "mmlu":
        out = []
        for subject in [s.strip() for s in rest.split(",") if s.strip()] or ["all"]:
            for i, row in enumerate(_hf_rows(repo, subject, split)):
                out.append(parse_row({"question": row["question"], "choices": row["choices"], "answer": row["answer"],
                                      "subject": row.get("subject", subject)}, f"{repo}/{subject} row {i}"))
        return out
    return [parse_row({"question": r["question"], "choices": r["choices"], "answer": r["answerKey"]},
                      f"{repo}/{config} row {i}") for i, r in enumerate(_hf_rows(repo, config, split))]


def letter_prompt(q: Question) -> str:
    """nanochat's multiple-choice user turn."""
    lines = [f"Multiple Choice question: {q.question}"] + [f"- {c}={LETTERS[i]}" for i, c in enumerate(q.choices)]
    return "\n".join(lines) + "\n\nRespond only with the letter of the correct answer."

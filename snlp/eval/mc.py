"""Multiple-choice evaluation (paper, "Downstream task evaluation"; nanochat's categorical scoring).

Tasks (`--task`): `mc:PATH[,PATH...]` local files or folders, `arc-easy`, `arc-challenge` and
`mmlu[:SUBJECT,...]` (through the Hugging Face `datasets` library: needs network). File schemas:
  - AI2 ARC JSONL: {"question": {"stem", "choices": [{"label", "text"}]}, "answerKey"}
  - MMLU CSV, no header: question,A,B,C,D,answer (letter); the subject is the file name without _test/_dev/_val
  - plain JSONL: {"question", "choices": [...], "answer": index | letter | choice text, "subject"?}
All parse to the same `Question`s.

Scoring (`--mc-scoring`):
  letter  (default, nanochat) the question and its lettered choices as a user turn of the chat
          template, then the assistant prompt; the prediction is the answer letter with the largest
          logit at that position, among the choices' letters only.
  loglik  the question as the user turn and each choice's text as the assistant reply; the prediction
          is the choice with the largest mean log-probability per token (length-normalised).
Each method (sequential, then every plan via a bound runner, snlp.bind) scores the same questions.
Accuracy comes with a 95 % Wilson score interval and N; MMLU-style data with subjects gets a
per-subject table.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from snlp.io.mctasks import LETTERS, Question, letter_prompt, load_task
from snlp.model.gpt import GPT
from snlp.method.plan import Plan
from snlp.method.solver import bind

SEQ = "sequential"


def letter_ids(tokenizer, n: int) -> list[int]:
    ids = []
    for L in LETTERS[:n]:
        t = tokenizer.encode(L)
        if len(t) != 1:
            raise ValueError(f"answer letter {L!r} is {len(t)} tokens in this tokenizer; use --mc-scoring loglik")
        ids.append(t[0])
    return ids


def _runner(model: GPT, method: Plan | None):
    """The method's forward for every batch: None (sequential) or a bound SNLP runner (fused once)."""
    return None if method is None else bind(model, method, check_finite=False)


def _final_state(model: GPT, x, runner) -> Tensor:
    """h_L (B, T, [n,] D) of the sequential model (runner None) or of the runner's SNLP solve."""
    if runner is None:
        ctx = model.embed(x)
        return model.run_layers(ctx.x0, ctx, 0, model.config.n_layer)
    return runner.solve(x).hidden


def _pad(seqs: list[list[int]], pad: int, device):
    """Right-padded (B, T) long tensor: causal attention keeps each row's real tokens exact."""
    T = max(len(s) for s in seqs)
    x = torch.full((len(seqs), T), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        x[i, :len(s)] = torch.tensor(s)
    return x.to(device)


@torch.no_grad()
def predict_letter(model: GPT, tokenizer, questions: list[Question], method: Plan | None, batch: int = 16,
                   max_len: int | None = None) -> list[int]:
    """Predicted choice index per question by comparing the answer letters' logits at the answer position."""
    dev = model.wte.weight.device
    runner, preds = _runner(model, method), []
    for s in range(0, len(questions), batch):
        qs = questions[s:s + batch]
        seqs = [tokenizer.render_chat([{"role": "user", "content": letter_prompt(q)}], add_generation_prompt=True)[0]
                for q in qs]
        if max_len:
            seqs = [sq[-max_len:] for sq in seqs]  # keep the answer position (left-truncate)
        h = _final_state(model, _pad(seqs, 0, dev), runner)  # (B, T, D): the head only where it is read
        last = model.head(h[torch.arange(len(qs)), torch.tensor([len(sq) - 1 for sq in seqs])][:, None])[:, 0]  # (B, V)
        for q, row in zip(qs, last):
            preds.append(int(row[letter_ids(tokenizer, len(q.choices))].argmax()))
    return preds


@torch.no_grad()
def predict_loglik(model: GPT, tokenizer, questions: list[Question], method: Plan | None, batch: int = 16,
                   max_len: int | None = None) -> list[int]:
    """Predicted choice index per question by the mean log-probability of each choice's text as the reply."""
    dev = model.wte.weight.device
    items = []  # (question index, ids, first scored position, last scored position + 1)
    for qi, q in enumerate(questions):
        for c in q.choices:
            ids, mask = tokenizer.render_chat([{"role": "user", "content": q.question},
                                               {"role": "assistant", "content": c}])
            pos = [t for t, m in enumerate(mask) if m][:-1]  # the choice's text, not the end marker
            if max_len and len(ids) > max_len:
                cut = len(ids) - max_len
                ids, pos = ids[cut:], [p - cut for p in pos if p - cut >= 1]
            items.append((qi, ids, pos))
    scores, runner = [[] for _ in questions], _runner(model, method)
    for s in range(0, len(items), batch):
        chunk = items[s:s + batch]
        x = _pad([it[1] for it in chunk], 0, dev)
        logp = F.log_softmax(model.head(_final_state(model, x, runner)), -1)  # (B, T, V)
        for b, (qi, ids, pos) in enumerate(chunk):
            p = torch.tensor(pos, device=dev)
            tok = torch.tensor([ids[t] for t in pos], device=dev)
            scores[qi].append(float(logp[b, p - 1, tok].mean()))  # token t is predicted at t-1
    return [max(range(len(sc)), key=sc.__getitem__) for sc in scores]


def wilson(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


@dataclass
class MCConfig:
    task: str  # --task spec
    plans: list = field(default_factory=list)  # Plans (or strings) evaluated after the sequential forward
    scoring: str = "letter"  # letter | loglik
    limit: int = 0  # first N questions (0 = all)
    batch: int = 16
    max_len: int | None = None  # prompt tokens kept (left-truncated); None = the model's sequence_len

    def check(self) -> None:
        if self.scoring not in ("letter", "loglik"):
            raise ValueError(f"--mc-scoring must be letter or loglik (got {self.scoring!r})")
        if self.limit < 0 or self.batch < 1:
            raise ValueError("--mc-limit must be >= 0 and the batch >= 1")


@dataclass
class MCRecord:
    method: str  # "sequential" or the plan
    n: int
    correct: int
    accuracy: float
    ci_low: float
    ci_high: float
    chance: float  # expected accuracy of uniform guessing (mean 1/choices)
    subjects: dict = field(default_factory=dict)  # subject -> {n, correct, accuracy, ci_low, ci_high}


@dataclass
class MCResult:
    task: str
    scoring: str
    records: list[MCRecord]

    def to_dict(self) -> dict:
        return asdict(self)


def score(preds: list[int], questions: list[Question], method: str) -> MCRecord:
    ok = [int(p == q.answer) for p, q in zip(preds, questions)]
    n, c = len(ok), sum(ok)
    subjects = {}
    for s in sorted({q.subject for q in questions if q.subject}):
        idx = [i for i, q in enumerate(questions) if q.subject == s]
        sc = sum(ok[i] for i in idx)
        lo, hi = wilson(sc, len(idx))
        subjects[s] = {"n": len(idx), "correct": sc, "accuracy": sc / len(idx), "ci_low": lo, "ci_high": hi}
    lo, hi = wilson(c, n)
    return MCRecord(method, n, c, c / max(n, 1), lo, hi, sum(1 / len(q.choices) for q in questions) / max(n, 1),
                    subjects if len(subjects) > 1 else {})


def evaluate_mc(model: GPT, tokenizer, cfg: MCConfig, questions: list[Question] | None = None) -> MCResult:
    """Accuracy of the sequential forward and of each plan on the task's questions."""
    cfg.check()
    qs = questions if questions is not None else load_task(cfg.task)
    if cfg.limit:
        qs = qs[:cfg.limit]
    plans = [Plan.parse(p) if isinstance(p, str) else p for p in cfg.plans]
    for p in plans:
        p.check(model.config.n_layer)
    predict = predict_letter if cfg.scoring == "letter" else predict_loglik
    max_len = cfg.max_len or model.config.sequence_len
    records = []
    for method in [None, *plans]:
        preds = predict(model, tokenizer, qs, method, cfg.batch, max_len)
        records.append(score(preds, qs, SEQ if method is None else str(method)))
    return MCResult(cfg.task, cfg.scoring, records)


# ----- presentation -----
def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def markdown(result: MCResult) -> str:
    r0 = result.records[0]
    lines = [f"Task `{result.task}`, {result.scoring} scoring, N = {r0.n} questions (chance {_pct(r0.chance)} %); "
             f"accuracy in % with 95 % Wilson interval", "",
             "| Inference | Accuracy | 95 % CI | Correct / N |", "|---|---:|---:|---:|"]
    for r in result.records:
        lines.append(f"| {r.method} | {_pct(r.accuracy)} | {_pct(r.ci_low)}–{_pct(r.ci_high)} | {r.correct} / {r.n} |")
    if r0.subjects:
        lines += ["", "| Subject | N | " + " | ".join(r.method for r in result.records) + " |",
                  "|---|---:|" + "---:|" * len(result.records)]
        for s, v in r0.subjects.items():
            lines.append(f"| {s} | {v['n']} | " + " | ".join(_pct(r.subjects[s]["accuracy"]) for r in result.records) + " |")
    return "\n".join(lines) + "\n"


def print_table(result: MCResult, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=200)
    t = Table(title=title)
    for h in ("Inference", "Accuracy %", "95 % CI", "Correct / N"):
        t.add_column(h, justify="left" if h == "Inference" else "right")
    for r in result.records:
        t.add_row(r.method, _pct(r.accuracy), f"{_pct(r.ci_low)}–{_pct(r.ci_high)}", f"{r.correct} / {r.n}")
    con.print(t)
    if result.records[0].subjects:
        s = Table(title="per subject (accuracy %)")
        s.add_column("Subject")
        s.add_column("N", justify="right")
        for r in result.records:
            s.add_column(r.method, justify="right")
        for name, v in result.records[0].subjects.items():
            s.add_row(name, str(v["n"]), *(_pct(r.subjects[name]["accuracy"]) for r in result.records))
        con.print(s)


def run_task(args, model: GPT, tokenizer) -> int:
    """`snlp eval CKPT --task ...` (called by snlp.eval.run)."""
    cfg = MCConfig(task=args.task, plans=args.plans_list, scoring=args.mc_scoring, limit=args.mc_limit, batch=args.batch)
    result = evaluate_mc(model, tokenizer, cfg)
    r0 = result.records[0]
    print_table(result, f"{args.ckpt}: {args.task}, {cfg.scoring} scoring, N = {r0.n} (chance {_pct(r0.chance)} %), "
                        f"95 % Wilson CI")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_dict(), indent=2))
        print(f"wrote {path}", file=sys.stderr)
    if args.markdown:
        path = Path(args.markdown)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(markdown(result))
        print(f"wrote {path}", file=sys.stderr)
    return 0

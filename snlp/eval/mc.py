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
          is the choice with the largest mean log-probability per token (length-normalised) over the
          tokens of the choice's text only, never the template's end-of-turn tokens (`choice_positions`).
  harness lm-evaluation-harness's multiple_choice protocol (its arc_easy task), the field's standard
          for base models: context "Question: {question}\\nAnswer:", continuation " {choice}", no chat
          template; `acc` ranks by the continuation's summed log-probability, `acc_norm` by that sum over
          the choice's character length. k-shot (`shots`) prepends k solved questions drawn from another
          split as "Question: ...\\nAnswer: {correct choice}" joined by "\\n\\n". Scored by lm-evaluation-harness
          itself when lm-eval is installed (snlp.eval.harness_mc), else by snlp's copy (snlp.eval.mc_harness).
The `snlp eval --task` default is `harness`, except for checkpoints fine-tuned by `snlp sft` (nanochat's
chat models), which default to `letter` (snlp.eval.mc_harness.default_scoring).
Each method (sequential, then every plan via a bound runner, snlp.bind) scores the same questions; a plan
whose solve turns NaN/inf is recorded as diverged (accuracy None), never scored.
Accuracy comes with a 95 % Wilson score interval and N; MMLU-style data with subjects gets a
per-subject table.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from snlp.decode.session import NonFiniteModelError
from snlp.io.mctasks import LETTERS, Question, letter_prompt
from snlp.model.gpt import GPT
from snlp.method.plan import Plan
from snlp.method.preheat import Preheat
from snlp.method.solver import SNLPDivergenceError, bind, preheat_for
from snlp.runtime.outputs import partial_line

SEQ = "sequential"


def letter_ids(tokenizer, n: int) -> list[int]:
    ids = []
    for L in LETTERS[:n]:
        t = tokenizer.encode(L)
        if len(t) != 1:
            raise ValueError(f"answer letter {L!r} is {len(t)} tokens in this tokenizer; use --mc-scoring loglik")
        ids.append(t[0])
    return ids


def method_runner(model: GPT, method: Plan | None, preheat: Preheat | None = None):
    """The method's forward for every batch: None (sequential) or a bound SNLP runner (fused once).
    The runner checks its final state: a NaN/inf solve raises SNLPDivergenceError (the method is then
    recorded as diverged) instead of NaN logits whose argmax silently picks choice 0."""
    return None if method is None else bind(model, method, check_finite=True, preheat=preheat_for(method, preheat))


def nonfinite(method: Plan | None, what: str) -> Exception:
    """The error for NaN/inf scores under `method`: SNLPDivergenceError for a plan (the method is recorded as
    diverged), NonFiniteModelError for the sequential forward (None): the model itself is broken (a NaN weight, an
    fp16 overflow), not a method to record; its NaN logits argmaxed to choice 0, an "always A" accuracy."""
    if method is None:
        return NonFiniteModelError(f"the model's own forward (not an SNLP plan) gives NaN/inf {what}: check its "
                                   f"weights are finite, or use a wider --dtype")
    return SNLPDivergenceError(f"non-finite {what} under {method}")


def final_state(model: GPT, x, runner, lengths: list[int]) -> Tensor:
    """h_L (B, T, [n,] D) of the sequential model (runner None) or of the runner's SNLP solve, for right-padded rows
    x (B, T) holding lengths[i] real tokens. A DiagN plan draws its Hutchinson probes with the shape of the whole
    batch and a `tol` plan's stop test takes norms over whole rows, padding included, so their rows are solved one at
    a time at their own lengths: a question's score never depends on the questions batched with it (as
    snlp.eval.harness.SNLPLM scores)."""
    if runner is None:
        ctx = model.embed(x)
        return model.run_layers(ctx.x0, ctx, 0, model.config.n_layer)
    if not (runner.plan.tol or runner.plan.surrogate.random):
        return runner.solve(x).hidden
    rows = [runner.solve(x[i:i + 1, :n]).hidden[0] for i, n in enumerate(lengths)]  # (n, [n,] D) each
    out = rows[0].new_zeros(x.shape[0], x.shape[1], *rows[0].shape[1:])
    for i, r in enumerate(rows):
        out[i, :r.shape[0]] = r
    return out


def pad_batch(seqs: list[list[int]], pad: int, device):
    """Right-padded (B, T) long tensor: causal attention keeps each row's real tokens exact."""
    T = max(len(s) for s in seqs)
    x = torch.full((len(seqs), T), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        x[i, :len(s)] = torch.tensor(s)
    return x.to(device)


@torch.no_grad()
def predict_letter(model: GPT, tokenizer, questions: list[Question], method: Plan | None, batch: int = 16,
                   max_len: int | None = None, preheat: Preheat | None = None) -> list[int]:
    """Predicted choice index per question by comparing the answer letters' logits at the answer position."""
    dev = model.wte.weight.device
    runner, preds = method_runner(model, method, preheat), []
    for s in range(0, len(questions), batch):
        qs = questions[s:s + batch]
        seqs = [tokenizer.render_chat([{"role": "user", "content": letter_prompt(q)}], add_generation_prompt=True)[0]
                for q in qs]
        if max_len:
            seqs = [sq[-max_len:] for sq in seqs]  # keep the answer position (left-truncate)
        h = final_state(model, pad_batch(seqs, 0, dev), runner, [len(sq) for sq in seqs])  # (B, T, D)
        at = torch.tensor([len(sq) - 1 for sq in seqs], device=dev)  # each row's answer position
        last = model.head(h[torch.arange(len(qs), device=dev), at][:, None])[:, 0]  # (B, V)
        if not bool(torch.isfinite(last).all()):
            raise nonfinite(method, "answer-letter logits")
        for q, row in zip(qs, last):
            preds.append(int(row[letter_ids(tokenizer, len(q.choices))].argmax()))
    return preds


def choice_positions(tokenizer, question: str, choice: str) -> tuple[list[int], list[int]]:
    """The conversation (`question` as the user turn, `choice` as the assistant reply) rendered with the
    tokenizer's chat template, and the positions of the tokens of the choice's text in it: the protocol scores
    the choice only, never the template's own tokens around it (nanochat's <|assistant_end|>; ChatML's
    `<|im_end|>`, which the assistant mask also covers, and the `\n` after it; a reply prefix such as Qwen3's
    empty think block).
    Derived from the rendering, not from a count of template tokens: the same conversation is rendered with two
    other replies (sentinels), and the tokens where the renderings differ are the reply's own (a token merged
    across the text's edge differs too, so it is kept: it carries part of the text); within them, the reply's
    masked tokens, less any at the edges that hold none of the text."""
    def render(reply: str) -> tuple[list[int], list[int]]:
        return tokenizer.render_chat([{"role": "user", "content": question}, {"role": "assistant", "content": reply}])

    ids, mask = render(choice)
    head = tail = len(ids)
    for sentinel in ("zqxjv", "QWKPF"):  # two, so a choice that starts or ends like one sentinel is still cut right
        other, _ = render(sentinel)
        n = min(len(ids), len(other))
        pre = next((k for k in range(n) if ids[k] != other[k]), n)
        suf = next((k for k in range(n - pre) if ids[-1 - k] != other[-1 - k]), n - pre)
        head, tail = min(head, pre), min(tail, suf)
    span = [t for t in range(head, len(ids) - tail) if mask[t]]  # the reply's own tokens
    text = choice.strip()  # templates may trim the reply

    def covers(a: int, b: int) -> bool:
        return text in tokenizer.decode([ids[t] for t in span[a:b]])

    if not span or span != list(range(span[0], span[-1] + 1)) or not covers(0, len(span)):
        raise ValueError(f"the chat template does not render the choice {choice!r} as the assistant reply's text "
                         f"(the reply's tokens decode to {tokenizer.decode([ids[t] for t in span])!r}); use "
                         f"--mc-scoring harness or letter")
    start = max(a for a in range(len(span)) if covers(a, len(span)))  # drop edge tokens that hold none of it
    stop = min(b for b in range(start + 1, len(span) + 1) if covers(start, b))
    return ids, span[start:stop]


@torch.no_grad()
def loglik_scores(model: GPT, tokenizer, questions: list[Question], method: Plan | None, batch: int = 16,
                  max_len: int | None = None, preheat: Preheat | None = None) -> list[list[float]]:
    """Per question, per choice: the mean log-probability of the tokens of the choice's text as the assistant
    reply (`choice_positions`)."""
    dev = model.wte.weight.device
    items = []  # (question index, ids, scored positions)
    for qi, q in enumerate(questions):
        for c in q.choices:
            ids, pos = choice_positions(tokenizer, q.question, c)
            if max_len and len(ids) > max_len:
                cut = len(ids) - max_len
                ids, pos = ids[cut:], [p - cut for p in pos if p - cut >= 1]
            items.append((qi, ids, pos))
    scores, runner = [[] for _ in questions], method_runner(model, method, preheat)
    for s in range(0, len(items), batch):
        chunk = items[s:s + batch]
        x = pad_batch([it[1] for it in chunk], 0, dev)
        logp = F.log_softmax(model.head(final_state(model, x, runner, [len(it[1]) for it in chunk])), -1)  # (B,T,V)
        for b, (qi, ids, pos) in enumerate(chunk):
            p = torch.tensor(pos, device=dev)
            tok = torch.tensor([ids[t] for t in pos], device=dev)
            scores[qi].append(float(logp[b, p - 1, tok].mean()))  # token t is predicted at t-1
            if not math.isfinite(scores[qi][-1]):
                raise nonfinite(method, "log-probabilities of a choice")
    return scores


def predict_loglik(model: GPT, tokenizer, questions: list[Question], method: Plan | None, batch: int = 16,
                   max_len: int | None = None, preheat: Preheat | None = None) -> list[int]:
    """Predicted choice index per question by the mean log-probability of each choice's text as the reply."""
    scores = loglik_scores(model, tokenizer, questions, method, batch, max_len, preheat)
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
    scoring: str = "letter"  # letter | loglik | harness
    limit: int = 0  # first N questions (0 = all)
    batch: int = 16
    max_len: int | None = None  # prompt tokens kept (left-truncated); None = the model's sequence_len
    shots: int = 0  # harness scoring: solved examples before each question (k-shot)
    shot_task: str | None = None  # harness k-shot: the --task spec the shots are drawn from (a train/dev split)
    shot_seed: int = 1234  # harness k-shot: the sampler's seed (lm-evaluation-harness's default fewshot seed)
    # harness scoring: "auto" (lm-evaluation-harness itself when lm-eval is installed, else snlp's copy of the
    # protocol), "lm_eval" (the harness, refused without it) or "snlp" (the copy)
    implementation: str = "auto"

    def check(self) -> None:
        if self.scoring not in ("letter", "loglik", "harness"):
            raise ValueError(f"--mc-scoring must be letter, loglik or harness (got {self.scoring!r})")
        if self.implementation not in ("auto", "lm_eval", "snlp"):
            raise ValueError(f"the harness scoring's implementation must be auto, lm_eval or snlp (got "
                             f"{self.implementation!r})")
        if self.implementation != "auto" and self.scoring != "harness":
            raise ValueError(f"implementation={self.implementation} applies to the harness scoring only (got "
                             f"{self.scoring})")
        if self.limit < 0 or self.batch < 1:
            raise ValueError("--mc-limit must be >= 0 and the batch >= 1")
        if self.shots < 0:
            raise ValueError(f"--mc-shots must be >= 0 (got {self.shots})")
        if self.shots and self.scoring != "harness":
            raise ValueError(f"--mc-shots {self.shots} needs --mc-scoring harness (the {self.scoring} protocol is "
                             f"0-shot only)")
        if self.shot_task and not self.shots:  # the pool would be read by nothing: a 0-shot run under its name
            raise ValueError(f"--mc-shots-from {self.shot_task} gives the pool of --mc-shots K solved examples, but "
                             f"--mc-shots is 0: give --mc-shots K (with --mc-scoring harness) or drop --mc-shots-from")
        if self.shots and not self.shot_task:
            raise ValueError(f"--mc-shots {self.shots} needs --mc-shots-from TASK: the split the solved examples are "
                             f"drawn from (e.g. mc:ARC-Easy-Train.jsonl for ARC-Easy test; the harness uses the "
                             f"task's train split)")


def shot_layout(questions: list[Question], pool: list[Question] | None, k: int) -> tuple[str | None, int | None]:
    """Where the shots come from, as the harness sees it: (None, None) for 0-shot or a pool disjoint from the
    questions (its own split); ("test", N) when the pool is the questions' own task and the questions are its first
    N (fewshot_split == test_split, --limit N). Refuses a pool that shares only some questions, and a pool too small
    for k shots (k + 1 when the question itself is in it)."""
    if not k:
        return None, None
    pool = pool or []
    same = not set(pool).isdisjoint(questions)
    if same and list(pool[:len(questions)]) != list(questions):
        raise ValueError("the shot pool (--mc-shots-from) shares some of the questions but the questions are not its "
                         "first N: draw the shots from another split (e.g. the train split) or from the questions' "
                         "own task")
    if len(pool) < k + same:
        raise ValueError(f"{k}-shot needs at least {k + same} questions in the shot pool, which holds {len(pool)}")
    return ("test", len(questions)) if same else (None, None)


@dataclass
class MCRecord:
    """One method's accuracy. harness scoring: `accuracy` is `acc`, the norm_* fields `acc_norm`. A
    diverged method (NaN/inf solve) has diverged True and correct / accuracy / intervals None."""

    method: str  # "sequential" or the plan
    n: int
    correct: int | None
    accuracy: float | None
    ci_low: float | None
    ci_high: float | None
    chance: float  # expected accuracy of uniform guessing (mean 1/choices)
    # subject -> {n, correct, accuracy, ci_low, ci_high[, norm_*]}; "" holds the questions without one
    subjects: dict = field(default_factory=dict)
    norm_correct: int | None = None  # harness acc_norm; None for the other scorings
    norm_accuracy: float | None = None
    norm_ci_low: float | None = None
    norm_ci_high: float | None = None
    diverged: bool = False


@dataclass
class MCResult:
    task: str
    scoring: str
    records: list[MCRecord]
    protocol: str = ""  # one caption line naming the scoring protocol (shown above every table)
    shots: int = 0
    complete: bool = True  # False: the records of the methods scored so far (evaluate_mc's on_record)

    def to_dict(self) -> dict:
        return asdict(self)


def score(preds: list[int], questions: list[Question], method: str) -> MCRecord:
    """The record of one method's predicted choice per question."""
    return score_ok([p == q.answer for p, q in zip(preds, questions)], questions, method)


def score_ok(right: list[bool], questions: list[Question], method: str) -> MCRecord:
    """The record of one method from whether each question was answered right."""
    ok = [int(bool(x)) for x in right]
    n, c = len(ok), sum(ok)
    subjects = {}
    # questions without a subject (an ARC file beside MMLU CSVs) are a row of their own, keyed "": left out, the
    # per-subject rows summed to fewer questions than N and the table did not say so
    named = {q.subject for q in questions if q.subject}
    for s in sorted(named) + ([""] if named and any(not q.subject for q in questions) else []):
        idx = [i for i, q in enumerate(questions) if q.subject == s]
        sc = sum(ok[i] for i in idx)
        lo, hi = wilson(sc, len(idx))
        subjects[s] = {"n": len(idx), "correct": sc, "accuracy": sc / len(idx), "ci_low": lo, "ci_high": hi}
    lo, hi = wilson(c, n)
    return MCRecord(method, n, c, c / max(n, 1), lo, hi, sum(1 / len(q.choices) for q in questions) / max(n, 1),
                    subjects if len(subjects) > 1 else {})


def diverged_record(method: str, questions: list[Question]) -> MCRecord:
    """The record of a method whose solve diverged: no accuracy (None), flagged, shown as "diverged"."""
    return MCRecord(method, len(questions), None, None, None, None,
                    sum(1 / len(q.choices) for q in questions) / max(len(questions), 1), {}, diverged=True)


def protocol_caption(cfg: MCConfig) -> str:
    """One line naming the scoring protocol: tables from different protocols are not comparable."""
    if cfg.scoring == "letter":
        return "protocol: letter (nanochat): lettered question as a chat user turn; argmax of the answer letters' logits"
    if cfg.scoring == "loglik":
        return ("protocol: loglik (snlp): question as a chat user turn, each choice as the assistant reply; "
                "mean log-prob per token of the choice's text")
    return (f"protocol: harness (lm-evaluation-harness multiple_choice, arc_easy format), {cfg.shots}-shot"
            + (f" from {cfg.shot_task} (seed {cfg.shot_seed})" if cfg.shots else "")
            + ": 'Question: {q}\\nAnswer:' + ' {choice}'; acc = summed log-prob, acc_norm = summed log-prob / "
              "choice characters")


# ----- presentation -----
def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _cells(r: MCRecord, harness: bool) -> list[str]:
    """Accuracy, CI, correct / N [, acc_norm, its CI, correct / N] of one row; "diverged" for a NaN/inf solve."""
    if r.diverged:
        return ["diverged", "–", f"– / {r.n}"] * (2 if harness else 1)
    out = [pct(r.accuracy), f"{pct(r.ci_low)}–{pct(r.ci_high)}", f"{r.correct} / {r.n}"]
    if r.norm_accuracy is not None:
        out += [pct(r.norm_accuracy), f"{pct(r.norm_ci_low)}–{pct(r.norm_ci_high)}", f"{r.norm_correct} / {r.n}"]
    return out


def _headers(result: MCResult) -> list[str]:
    if result.scoring == "harness":
        return ["Inference", "acc %", "95 % CI", "Correct / N", "acc_norm %", "95 % CI", "Correct / N"]
    return ["Inference", "Accuracy", "95 % CI", "Correct / N"]


NO_SUBJECT = "(no subject)"  # the tables' name of the questions without a subject (key "" in the records)


def _subject_name(s: str) -> str:
    return s or NO_SUBJECT


def _subject_cell(r: MCRecord, s: str) -> str:
    if r.diverged:
        return "diverged"
    v = r.subjects[s]
    return pct(v["accuracy"]) + (f" / {pct(v['norm_accuracy'])}" if "norm_accuracy" in v else "")


def markdown(result: MCResult) -> str:
    r0 = result.records[0]
    head = _headers(result)
    lines = [f"Task `{result.task}`, {result.scoring} scoring, N = {r0.n} questions (chance {pct(r0.chance)} %); "
             f"accuracy in % with 95 % Wilson interval", ""]
    if result.protocol:
        lines[-1:-1] = [result.protocol]  # the caption line: which protocol produced these numbers
    if not result.complete:
        lines[-1:-1] = [partial_line(f"the methods scored so far ({', '.join(r.method for r in result.records)})")]
    lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in result.records:
        lines.append(f"| {r.method} | " + " | ".join(_cells(r, result.scoring == "harness")) + " |")
    if r0.subjects:
        unit = " (acc / acc_norm %)" if result.scoring == "harness" else ""
        lines += ["", f"| Subject{unit} | N | " + " | ".join(r.method for r in result.records) + " |",
                  "|---|---:|" + "---:|" * len(result.records)]
        for s, v in r0.subjects.items():
            lines.append(f"| {_subject_name(s)} | {v['n']} | " + " | ".join(_subject_cell(r, s) for r in result.records)
                         + " |")
    return "\n".join(lines) + "\n"


def print_table(result: MCResult, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=200)
    t = Table(title=title, caption=result.protocol or None)
    for h in _headers(result):
        t.add_column(h if h != "Accuracy" else "Accuracy %", justify="left" if h == "Inference" else "right")
    for r in result.records:
        t.add_row(r.method, *_cells(r, result.scoring == "harness"))
    con.print(t)
    if result.records[0].subjects:
        s = Table(title="per subject (accuracy %" + (": acc / acc_norm)" if result.scoring == "harness" else ")"))
        s.add_column("Subject")
        s.add_column("N", justify="right")
        for r in result.records:
            s.add_column(r.method, justify="right")
        for name, v in result.records[0].subjects.items():
            s.add_row(_subject_name(name), str(v["n"]), *(_subject_cell(r, name) for r in result.records))
        con.print(s)

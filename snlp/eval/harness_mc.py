"""snlp's multiple-choice questions scored by lm-evaluation-harness itself: the `harness` scoring of
`snlp eval --task` / `evaluate_mc` when `lm-eval` is installed (the optional extra `.[harness]`).

The questions (snlp.io.mctasks.Question, from any `--task` spec: ARC JSONL, MMLU CSV, plain JSONL) become the docs
of one harness task in its `arc_easy` format, built here in memory (`mc_task`: `custom_dataset`, no file, no hub):

    doc_to_text    "Question: {{question}}\\nAnswer:"      doc_to_choice  the choices      doc_to_target  the answer
    output_type    multiple_choice (acc, acc_norm)        target_delimiter " ", fewshot_delimiter "\\n\\n"

and each method (the sequential forward, a plan, through snlp.eval.harness.SNLPLM) is run by the harness's own
`simple_evaluate`: its prompts, its few-shot sampler (seed, the question itself never its own shot when the shots
come from the questions' own task), its context/continuation encoding and its acc / acc_norm. snlp reads back the
per-question results the harness logs (`mc_samples`). snlp.eval.mc_harness keeps a copy of the protocol only for
installs without lm-eval.

Shots: `pool` None (0-shot), a pool disjoint from the questions (its own split, e.g. ARC's train), or the questions'
own task, of which the questions are the first N (the harness's fewshot_split == test_split with --limit N). A pool
that shares only some questions has no harness equivalent and is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lm_eval
from datasets import Dataset, DatasetDict
from lm_eval.api.task import ConfigurableTask
from lm_eval.tasks import TaskManager

from snlp.eval.harness import SNLPLM
from snlp.eval.mc import shot_layout
from snlp.io.mctasks import Question
from snlp.method.plan import Plan
from snlp.method.preheat import Preheat
from snlp.method.solver import SNLPDivergenceError
from snlp.model.gpt import GPT

TASK = "snlp_mc"
# the harness's arc_easy task (lm_eval/tasks/arc/arc_easy.yaml) over docs {question, choices, answer, subject}
ARC_FORMAT = dict(output_type="multiple_choice", doc_to_text="Question: {{question}}\nAnswer:", doc_to_choice="choices",
                  doc_to_target="answer", target_delimiter=" ", fewshot_delimiter="\n\n",
                  metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                               {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
                  metadata={"version": 1.0})


def _doc(q: Question) -> dict:
    return {"question": q.question, "choices": list(q.choices), "answer": q.answer, "subject": q.subject}


def mc_task(questions: list[Question], pool: list[Question] | None = None, k: int = 0,
            name: str = TASK) -> tuple[ConfigurableTask, int | None]:
    """(the harness task over the questions in the arc_easy format, the `limit` to evaluate it with). With k > 0
    shots from `pool` (see shot_layout); the task is built in memory, nothing is downloaded."""
    split, limit = shot_layout(questions, pool, k)
    splits = {"test": Dataset.from_list([_doc(q) for q in (pool if split == "test" else questions)])}
    cfg = dict(ARC_FORMAT, task=name, test_split="test")
    if k and split is None:
        splits["train"] = Dataset.from_list([_doc(q) for q in pool])
        cfg["fewshot_split"] = "train"
    elif k:
        cfg["fewshot_split"] = "test"
    data = DatasetDict(splits)
    cfg["custom_dataset"] = lambda **_: data
    return ConfigurableTask(config=cfg), limit


@dataclass
class MCSample:
    """One question as the harness scored it: each choice's summed log-likelihood (the harness's request results)
    and its acc / acc_norm."""

    lls: tuple[float, ...]
    acc: bool
    acc_norm: bool


def run_task(lm, task: ConfigurableTask, k: int, limit: int | None, seed: int = 1234) -> list[MCSample]:
    """lm_eval.simple_evaluate of one in-memory task with any harness LM (SNLPLM, or the harness's own `hf`), read
    back per question in the docs' order. No global RNG is reseeded (the scoring draws nothing but the shots)."""
    r = lm_eval.simple_evaluate(model=lm, tasks=[task], num_fewshot=k, limit=limit, fewshot_random_seed=seed,
                                task_manager=TaskManager(include_defaults=False), log_samples=True, bootstrap_iters=0,
                                random_seed=None, numpy_random_seed=None, torch_random_seed=None)
    out = []
    for s in sorted(r["samples"][task.config.task], key=lambda s: s["doc_id"]):
        lls = tuple(float(x[0]) for x in s["filtered_resps"])
        if not all(math.isfinite(x) for x in lls):  # NaN picks would argmax to choice 0: an "always A" accuracy
            raise SNLPDivergenceError(f"non-finite log-likelihood under {getattr(lm, 'method', lm)}")
        out.append(MCSample(lls, bool(s["acc"]), bool(s["acc_norm"])))
    return out


def mc_samples(model: GPT, tokenizer, questions: list[Question], method: Plan | None,
               pool: list[Question] | None = None, k: int = 0, seed: int = 1234, batch: int = 16,
               max_len: int | None = None, preheat: Preheat | None = None) -> list[MCSample]:
    """Each question scored by the harness through SNLPLM on `model` (its own device and dtype) under the sequential
    forward (method None) or a plan. Raises SNLPDivergenceError if the plan's solve (or the forward) turns NaN/inf."""
    w = model.wte.weight
    lm = SNLPLM(pretrained=model, tokenizer=tokenizer, plan=method, preheat=preheat, batch_size=batch,
                max_length=max_len, dtype=str(w.dtype).removeprefix("torch."), device=str(w.device))
    task, limit = mc_task(questions, pool, k)
    return run_task(lm, task, k, limit, seed)

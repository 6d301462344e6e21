"""lm-evaluation-harness's multiple-choice protocol for snlp.mc (`--mc-scoring harness`, `--mc-shots K`).

Where lm-eval is installed (the optional extra `.[harness]`) `evaluate_harness` scores through the harness itself
(snlp.eval.harness_mc: the questions as one harness task, each method an snlp.eval.harness.SNLPLM, the harness's
simple_evaluate): one implementation of the protocol. The functions below (`draw_shots`, `encode_pair`,
`loglikelihoods`, `predictions`) are snlp's COPY of that protocol, kept only as the fallback for installs without
lm-eval (tests/eval/test_harness_mc.py checks that both give the same numbers as the harness's `hf` model).

The field's standard numbers for base models (model cards, leaderboards) come from EleutherAI's
lm-evaluation-harness; its `arc_easy` task (output_type multiple_choice) scores
    context       "Question: {question}\\nAnswer:"             (doc_to_text)
    continuation  " {choice}"                                  (target_delimiter " " + doc_to_choice)
with `acc` = argmax of the continuation's summed log-probability given the context and `acc_norm` =
argmax of that sum divided by the choice's length in characters (len(choice), without the delimiter).
k-shot prepends k solved examples, "Question: {q}\\nAnswer: {correct choice}", each followed by the
fewshot delimiter "\\n\\n", drawn with `random.Random(seed).sample(pool, k)` per question in order
(seed 1234, its default); when the pool holds the question itself, k + 1 are drawn and it is dropped.
Tokenisation is the harness's causal-LM `_encode_pair`: trailing spaces of the context move to the
continuation, the continuation's tokens are encode(context + continuation)[len(encode(context)):], with a
foreign (converted Hugging Face) tokenizer's own special tokens (a BOS its post-processor adds, as the harness's hf
model encodes); checkpoints with snlp's own BPE
start every document with <|bos|> in training, so their context starts with it. Inputs longer than
max_len keep the last max_len tokens (the harness's left truncation). The same format is used for every
task (MMLU's harness task has its own lettered template, which this module does not reproduce).
Ties go to the first choice (numpy argmax).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F

from snlp.eval.mc import (SEQ, MCConfig, MCRecord, MCResult, diverged_record, final_state, method_runner, nonfinite,
                          pad_batch, protocol_caption, score_ok, shot_layout)
from snlp.io.mctasks import Question, load_task
from snlp.model.gpt import GPT
from snlp.method.plan import Plan
from snlp.method.preheat import Preheat
from snlp.method.solver import SNLPDivergenceError

TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"


def doc_to_text(q: Question) -> str:
    return f"Question: {q.question}\nAnswer:"


def context(q: Question, shots: list[Question]) -> str:
    """The harness's context: the solved shots, then the target question."""
    ex = "".join(doc_to_text(s) + TARGET_DELIMITER + s.choices[s.answer] + FEWSHOT_DELIMITER for s in shots)
    return ex + doc_to_text(q)


def draw_shots(questions: list[Question], pool: list[Question], k: int, seed: int = 1234) -> list[list[Question]]:
    """k solved examples per question from `pool`, one seeded sampler for the whole run (the harness's
    ContextSampler): random.Random(seed).sample(pool, k [+ 1 when the pool holds the question]) per
    question in order, the question itself removed (the fallback without lm-eval)."""
    if k == 0:
        return [[] for _ in questions]
    same = not set(pool).isdisjoint(questions)
    if len(pool) < k + same:
        raise ValueError(f"{k}-shot needs at least {k + same} questions in the shot pool, which holds {len(pool)}")
    rnd = random.Random(seed)
    return [[s for s in rnd.sample(pool, k + same) if s != q][:k] for q in questions]


def encode_pair(tokenizer, ctx: str, cont: str) -> tuple[list[int], list[int]]:
    """The harness's causal-LM `_encode_pair`: (context ids, continuation ids). A foreign tokenizer encodes with its
    own special tokens, as the harness's hf model encodes (tokenizer.encode's default): a Llama-2 / Mistral-style
    tokenizer's post-processor puts its BOS first, SmolLM2's adds nothing."""
    n = len(ctx) - len(ctx.rstrip())
    if n:
        cont, ctx = ctx[-n:] + cont, ctx[:-n]
    if tokenizer.meta is None:  # snlp's own BPE: every training document starts with <|bos|>
        whole, ctx_ids = ([tokenizer.bos_id, *tokenizer.encode(t)] for t in (ctx + cont, ctx))
    else:
        whole, ctx_ids = (tokenizer.tok.encode(t, add_special_tokens=True).ids for t in (ctx + cont, ctx))
    return ctx_ids, whole[len(ctx_ids):]


@torch.no_grad()
def loglikelihoods(model: GPT, tokenizer, questions: list[Question], method: Plan | None,
                   shots: list[list[Question]] | None = None, batch: int = 16, max_len: int | None = None,
                   preheat: Preheat | None = None) -> list[list[float]]:
    """Summed log-probability of each choice's continuation given its context, per question (fp32; fp64 for an
    fp64 model), under the sequential forward (method None) or a plan. Raises SNLPDivergenceError if the plan's
    solve turns NaN/inf."""
    dev = model.wte.weight.device
    shots = shots or [[] for _ in questions]
    max_len = max_len or model.config.sequence_len
    items = []  # (question index, model input ids, continuation ids)
    for qi, (q, sh) in enumerate(zip(questions, shots)):
        ctx = context(q, sh)
        for c in q.choices:
            ctx_ids, cont = encode_pair(tokenizer, ctx, TARGET_DELIMITER + c)
            if not cont:
                raise ValueError(f"choice {c!r} of question {q.question[:60]!r} encodes to no tokens")
            if len(cont) > max_len:
                raise ValueError(f"choice {c!r} is {len(cont)} tokens, more than the {max_len} the model reads")
            # the harness's input: all tokens but the last, left-truncated to max_len
            items.append((qi, (ctx_ids + cont)[:-1][-max_len:], cont))
    # longest first, as the harness batches: similar lengths pad little
    order = sorted(range(len(items)), key=lambda i: -len(items[i][1]))
    scores = [[0.0] * len(q.choices) for q in questions]
    slot = []  # (question, choice) of each item
    for qi, q in enumerate(questions):
        slot += [(qi, ci) for ci in range(len(q.choices))]
    runner = method_runner(model, method, preheat)
    for s in range(0, len(order), batch):
        chunk = [items[i] for i in order[s:s + batch]]
        h = final_state(model, pad_batch([it[1] for it in chunk], 0, dev), runner,
                        [len(it[1]) for it in chunk])  # (B, T, [n,] D)
        for b, (qi, inp, cont) in enumerate(chunk):
            pos = torch.arange(len(inp) - len(cont), len(inp), device=dev)  # positions predicting cont
            logp = F.log_softmax(model.head(h[b:b + 1, pos]), -1)[0]  # (n, V): the head's fp32, fp64 for an fp64 model
            total = logp.gather(-1, torch.tensor(cont, device=dev)[:, None]).sum()
            if not torch.isfinite(total):  # the sequential forward is not checked by a runner
                raise nonfinite(method, "log-likelihood")
            scores[slot[order[s + b]][0]][slot[order[s + b]][1]] = float(total)
    return scores


def _argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=xs.__getitem__)  # the first of ties, as numpy's argmax


def predictions(questions: list[Question], scores: list[list[float]]) -> tuple[list[int], list[int]]:
    """(acc picks, acc_norm picks): argmax of the summed log-prob, and of it over len(choice)."""
    acc = [_argmax(sc) for sc in scores]
    norm = [_argmax([v / len(c) for v, c in zip(sc, q.choices)]) for q, sc in zip(questions, scores)]
    return acc, norm


def harness_record(name: str, questions: list[Question], acc: list[bool], norm: list[bool]) -> MCRecord:
    """The record of one method from each question's acc and acc_norm (right or wrong): the acc counts, with the
    acc_norm counts in the norm_* fields (and per subject)."""
    r = score_ok(acc, questions, name)
    rn = score_ok(norm, questions, name)
    r.norm_correct, r.norm_accuracy, r.norm_ci_low, r.norm_ci_high = rn.correct, rn.accuracy, rn.ci_low, rn.ci_high
    for s, v in r.subjects.items():
        v.update({f"norm_{k}": rn.subjects[s][k] for k in ("correct", "accuracy", "ci_low", "ci_high")})
    return r


def lm_eval_scorer():
    """snlp.eval.harness_mc when lm-eval is installed, else None (the copy of the protocol in this module is used)."""
    try:
        from snlp.eval import harness_mc
    except ImportError as e:
        if (getattr(e, "name", None) or "").split(".")[0] != "lm_eval":
            raise
        return None
    return harness_mc


def evaluate_harness(model: GPT, tokenizer, cfg: MCConfig, questions: list[Question], plans: list[Plan],
                     max_len: int, preheat: Preheat | None = None, on_record=None) -> MCResult:
    """snlp.eval.mc.evaluate_mc for scoring "harness": acc and acc_norm of the sequential forward and each plan,
    scored by the harness itself when lm-eval is installed (cfg.implementation "auto" or "lm_eval"), else by the
    copy of the protocol in this module ("auto" without lm-eval, or "snlp"). `on_record`: as evaluate_mc's."""
    pool = load_task(cfg.shot_task) if cfg.shots else []
    shot_layout(questions, pool, cfg.shots)  # refuses, up front, shots the harness cannot express
    harness_mc = None if cfg.implementation == "snlp" else lm_eval_scorer()
    if harness_mc is None and cfg.implementation == "lm_eval":
        raise ValueError("implementation=lm_eval needs lm-evaluation-harness: pip install -e '.[harness]'")
    if harness_mc is not None:
        import lm_eval

        how = f"scored by lm-evaluation-harness {lm_eval.__version__} itself"
    else:
        shots = draw_shots(questions, pool, cfg.shots, cfg.shot_seed)
        how = "scored by snlp's copy of the protocol (" + ("implementation=snlp)" if cfg.implementation == "snlp"
                                                           else "lm-eval not installed)")
    records = []
    for method in [None, *plans]:
        name = SEQ if method is None else str(method)
        try:
            if harness_mc is not None:
                samples = harness_mc.mc_samples(model, tokenizer, questions, method, pool, cfg.shots, cfg.shot_seed,
                                                cfg.batch, max_len, preheat)
                acc, norm = [s.acc for s in samples], [s.acc_norm for s in samples]
            else:
                sc = loglikelihoods(model, tokenizer, questions, method, shots, cfg.batch, max_len, preheat)
                picks, norm_picks = predictions(questions, sc)
                acc = [p == q.answer for p, q in zip(picks, questions)]
                norm = [p == q.answer for p, q in zip(norm_picks, questions)]
        except SNLPDivergenceError:
            records.append(diverged_record(name, questions))
        else:
            records.append(harness_record(name, questions, acc, norm))
        if on_record is not None and len(records) <= len(plans):
            on_record(MCResult(cfg.task, cfg.scoring, list(records), f"{protocol_caption(cfg)}; {how}", cfg.shots,
                               complete=False))
    return MCResult(cfg.task, cfg.scoring, records, f"{protocol_caption(cfg)}; {how}", cfg.shots)


def default_scoring(ckpt) -> str:
    """The `snlp eval --task` default protocol for a checkpoint: "letter" (nanochat's, for its chat
    models) when it was fine-tuned by `snlp sft` (its train_state.pt records the SFT run), else
    "harness", so pretrained and converted models (Hugging Face Instruct models too, whose published
    ARC numbers are harness numbers) are comparable with the field."""
    from snlp.io.checkpoint import TRAIN_STATE, load_train_state

    if not (Path(ckpt) / TRAIN_STATE).is_file():
        return "harness"
    state = load_train_state(ckpt) or {}
    return "letter" if isinstance(state, dict) and "sft" in state else "harness"

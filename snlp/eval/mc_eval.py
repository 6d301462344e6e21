"""Multiple-choice evaluation: one entry point over the three scoring protocols (snlp.eval.mc: letter and
loglik; snlp.eval.mc_harness: lm-evaluation-harness acc / acc_norm), for the sequential forward and each plan."""

from __future__ import annotations

from snlp.eval.mc import (SEQ, MCConfig, MCResult, diverged_record, predict_letter, predict_loglik, protocol_caption,
                          score)
from snlp.eval.mc_harness import evaluate_harness
from snlp.io.mctasks import Question, load_task
from snlp.method.jacobian import check_fd_step
from snlp.method.plan import Plan
from snlp.method.preheat import Preheat
from snlp.method.solver import SNLPDivergenceError
from snlp.model.gpt import GPT


def evaluate_mc(model: GPT, tokenizer, cfg: MCConfig, questions: list[Question] | None = None,
                preheat: Preheat | None = None, on_record=None) -> MCResult:
    """Accuracy of the sequential forward and of each plan on the task's questions (`preheat`: the calibration
    plans with the preheat init read). `on_record(result)`, if given, is called after every method but the last with
    the records so far (`complete` False): each method is scored alone, so `snlp eval --task` writes them as it
    goes and a run cut short keeps them."""
    cfg.check()
    qs = questions if questions is not None else load_task(cfg.task)
    if cfg.limit:
        qs = qs[:cfg.limit]
    plans = [Plan.parse(p) if isinstance(p, str) else p for p in cfg.plans]
    w = model.wte.weight  # (a diag:fd eps this dtype cannot take: before the sequential forward is scored)
    for p in plans:
        p.check(model.config.n_layer)
        check_fd_step(p, w.dtype, w.device.type)
    max_len = cfg.max_len or model.config.sequence_len
    if cfg.scoring == "harness":
        return evaluate_harness(model, tokenizer, cfg, qs, plans, max_len, preheat, on_record)
    predict = predict_letter if cfg.scoring == "letter" else predict_loglik
    records = []
    for method in [None, *plans]:
        name = SEQ if method is None else str(method)
        try:
            preds = predict(model, tokenizer, qs, method, cfg.batch, max_len, preheat)
        except SNLPDivergenceError:  # NaN logits would argmax to choice 0: an "always A" accuracy
            records.append(diverged_record(name, qs))
        else:
            records.append(score(preds, qs, name))
        if on_record is not None and len(records) <= len(plans):
            on_record(MCResult(cfg.task, cfg.scoring, list(records), protocol_caption(cfg), complete=False))
    return MCResult(cfg.task, cfg.scoring, records, protocol_caption(cfg))

"""`snlp eval` measures a `causal` plan (the paper code's full-causal suffix, snlp.method.plan) like any plan: its PPL
is the full-suffix-attention model's, computed here by a naive cross-entropy over that model built as a copy whose
suffix layers' windows are full in its config; dPPL, Top-1 and AR Match are against the windowed sequential model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_model

from snlp import GPT, GPTConfig
from snlp.eval.data import windows
from snlp.eval.protocol import EvalConfig, evaluate, reference_plan
from snlp.io.tokenizer import MIN_VOCAB, Tokenizer
from snlp.method.plan import Plan

TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
        "First Citizen: You are all resolved rather to die than to famish? All: Resolved. resolved. ") * 20
CFG = EvalConfig(seq_len=16, max_tokens=96, prompts=2, prompt_len=4, gen_tokens=6, warmup=0, runs=1, time_tokens=2,
                 progress=False)

pytestmark = pytest.mark.usefixtures("one_thread")


def full_suffix(model: GPT, n_suffix: int) -> GPT:
    cfg, L = model.config, model.config.n_layer
    wins = [cfg.window(l) if l < L - n_suffix else -1 for l in range(L)]
    ref = GPT(GPTConfig(**{**cfg.to_dict(), "layer_windows": wins})).to(model.wte.weight.dtype)
    ref.load_state_dict(model.state_dict())
    return ref.eval()


def test_eval_measures_a_causal_plan_like_any_plan():
    tok = Tokenizer.train([TEXT], vocab_size=MIN_VOCAB + 40)
    model, val = make_model(seed=3, vocab_size=tok.vocab_size, sequence_len=64), torch.tensor(tok.encode(TEXT))
    recs = {r.plan: r for r in evaluate(model, val, ["6xF1-h0-K6-causal", "3xF2-h0-K1-causal"], CFG, tokenizer=tok)}
    seq, conv = recs["sequential"], recs["6xF1-h0-K6-causal"]
    wins = windows(val, CFG.seq_len, CFG.max_tokens)
    x, y = wins[:, :-1], wins[:, 1:]
    with torch.no_grad():
        ce = F.cross_entropy(full_suffix(model, 6)(x).flatten(0, 1), y.flatten())
    assert conv.ppl == pytest.approx(math.exp(ce.item()), rel=1e-6)  # K = C: the full-suffix model's PPL
    assert conv.delta_ppl == pytest.approx(conv.ppl / seq.ppl - 1, rel=1e-6) and abs(conv.delta_ppl) > 1e-4
    assert conv.top1 < 1.0 or conv.logit_sim < 1 - 1e-6  # measured against the windowed model, not itself
    assert recs["3xF2-h0-K1-causal"].ar_fused_reference == "3xF2-h0-K3-causal"
    assert reference_plan(Plan.parse("3xF2-h0-K1-causal")) == Plan.parse("3xF2-h0-K3-causal")

"""A plan the model's dtype cannot run is refused before the multiple-choice evaluator runs anything: a diag:fd eps
below the FD step floor of the compute dtype (snlp.method.jacobian.check_fd_step) is refused by bind when that plan's
turn comes, so `evaluate_mc` scored the sequential model (and every earlier plan) first and then failed, losing that
work (`snlp.evaluate` binds every plan before its first forward). The outside reference: a forward hook on the embedding counts the model calls made before the
refusal (none)."""

from __future__ import annotations

import pytest
import torch
from conftest import CITIZENS, make_model

from snlp.eval.mc import MCConfig
from snlp.eval.mc_eval import evaluate_mc
from snlp.io.mctasks import Question
from snlp.io.tokenizer import MIN_VOCAB, Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

PLANS = ["2xF1-h0-K1", "2xF1-h0-K2-diag-eps:1e-5"]  # the second's eps is below fp32's floor (3.45e-4)
REFUSED = r"eps:1e-05 is below the smallest FD step of the compute dtype float32"


def _counted(model):
    calls = []
    model.wte.register_forward_hook(lambda *a: calls.append(1))
    return calls


def test_evaluate_mc_refuses_an_fd_eps_before_the_sequential_scores():
    tok = Tokenizer.train([CITIZENS], vocab_size=MIN_VOCAB + 40)
    model = make_model(n_layer=4, dtype=torch.float32, vocab_size=tok.vocab_size, n_embd=32, sequence_len=128)
    calls = _counted(model)
    qs = [Question("Who speaks first?", ("All", "First Citizen"), 1)]
    with pytest.raises(ValueError, match=REFUSED):
        evaluate_mc(model, tok, MCConfig(task="toy", plans=PLANS, scoring="loglik"), qs)
    assert not calls

"""`snlp.evaluate` and `snlp.eval.analysis.analyze` on a caller's model: they run in eval mode and hand the model back
in the mode it came in (a training loop that evaluates mid-run and continues must not find its model switched to eval
mode, module by module), with its weights unchanged and no gradients left behind."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_model

import snlp

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = snlp.EvalConfig(seq_len=16, max_tokens=32, prompts=1, prompt_len=4, gen_tokens=3, warmup=0, runs=1,
                      time_tokens=2, emb=False, progress=False)


def test_evaluate_restores_the_callers_mode_module_by_module():
    model = make_model(n_layer=4).train()
    model.blocks[1].eval()  # a mixed state comes back mixed
    modes = [m.training for m in model.modules()]
    weights = [p.detach().clone() for p in model.parameters()]
    val = torch.randint(0, model.config.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny model's sequence_len: the extrapolation warning
        recs = snlp.evaluate(model, val, ["2xF1-h0-K1"], CFG)
    assert [r.plan for r in recs] == ["sequential", "2xF1-h0-K1"]
    assert [m.training for m in model.modules()] == modes  # before: every module left in eval mode
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_analyze_restores_the_callers_mode_module_by_module():
    """snlp analyze's library entry (snlp.eval.analysis.analyze) switched a caller's model to eval mode and left it
    there."""
    from snlp.eval.analysis import AnalysisConfig, analyze

    model = make_model(n_layer=4).train()
    model.blocks[1].eval()
    modes = [m.training for m in model.modules()]
    val = torch.randint(0, model.config.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    analyze(model, val, AnalysisConfig(only=("early-exit",), seq_len=8, max_tokens=32, batch=4, progress=False))
    assert [m.training for m in model.modules()] == modes

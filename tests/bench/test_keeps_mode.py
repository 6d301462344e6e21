"""The benchmarks that time a caller's model (tune, op_benchmark, benchmark, decode_benchmark,
batch_decode_benchmark) run it in eval mode and hand it back with every submodule in the train / eval mode it came in,
on return and on a refusal raised after the switch, as snlp.evaluate does. Reference: the modes read off the modules
before the call."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

from snlp.bench.decode import batch_decode_benchmark, decode_benchmark
from snlp.bench.forward import benchmark
from snlp.bench.ops import op_benchmark
from snlp.bench.tune import TuneConfig, tune
from snlp.method.plan import Plan

pytestmark = pytest.mark.usefixtures("one_thread")

PLAN = "2xF1-h0-K1"


def mixed(model: torch.nn.Module) -> dict[str, bool]:
    """`model` in train mode with its second block kept in eval mode (a frozen block), and every module's mode by
    name: a mixed state a plain `model.train(was)` would not give back either."""
    model.train()
    model.blocks[1].eval()
    return modes(model)


def modes(model: torch.nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in model.named_modules()}


def test_tune_restores_every_modules_mode_on_return_and_on_a_refusal():
    model = make_model(seed=5, n_layer=4, sequence_len=64)
    val = torch.randint(0, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    cfg = TuneConfig(plans=[PLAN], blocks=(2,), threads=(1,), top=1, calib_tokens=64, seq_len=16, prompts=1,
                     prompt_len=4, gen_tokens=4, repeats=1, warmup=0, step_runs=1, accept_tokens=8)
    before = mixed(model)
    tune(model, val, cfg)
    assert modes(model) == before  # before: every module left in eval mode
    with pytest.raises(ValueError, match="no calibration quality"):  # raised after the switch to eval mode
        tune(model, val, cfg, quality={})
    assert modes(model) == before


def test_op_benchmark_restores_every_modules_mode():
    model = make_model(n_layer=4)
    before = mixed(model)
    op_benchmark(model, tokens=(2,), warmup=0, runs=1)
    assert modes(model) == before


def test_forward_benchmark_restores_every_modules_mode():
    model = make_model(n_layer=4)
    before = mixed(model)
    benchmark(model, [Plan.parse(PLAN)], tokens=2, warmup=0, runs=1)
    assert modes(model) == before


def test_decode_benchmark_restores_every_modules_mode():
    model = make_model(n_layer=4)
    before = mixed(model)
    decode_benchmark(model, [Plan.parse(PLAN)], prompt_len=3, new_tokens=3, blocks=(2,), warmup=0, runs=1)
    assert modes(model) == before


def test_batch_decode_benchmark_restores_every_modules_mode():
    model = make_model(n_layer=4)
    before = mixed(model)
    batch_decode_benchmark(model, [Plan.parse(PLAN)], batch_sizes=(2,), prompt_len=3, new_tokens=3, blocks=(2,),
                           warmup=0, runs=1)
    assert modes(model) == before

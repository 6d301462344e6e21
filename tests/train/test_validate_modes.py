"""The training loop's validations (snlp.train.validate.validate: pretraining / SFT; validate_drafter: adapt) leave the
model in the train / eval modes each of its modules came in, on return and on an exception, as snlp.evaluate does.
Reference: the modes read off the modules before the call."""
from contextlib import nullcontext

import pytest
import torch

from conftest import make_model, tokens
from snlp.method.drafter import make_drafter
from snlp.train.adapt import AdaptConfig, validate_drafter
from snlp.train.validate import validate


def mixed_modes(model: torch.nn.Module) -> dict[str, bool]:
    """`model` in train mode with its second block kept in eval mode (a frozen block, dropout off in one part), and
    every module's mode by name."""
    model.train()
    model.blocks[1].eval()
    return {name: m.training for name, m in model.named_modules()}


def modes(model: torch.nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in model.named_modules()}


def bad_batches(model, good):
    """One good batch, then one whose token ids are past the vocabulary: the forward raises on it mid-validation."""
    x = torch.full_like(good[0], model.config.vocab_size + 5)
    return [good, (x, good[1])]


def test_validate_restores_every_modules_mode_on_return_and_on_an_exception():
    """validate read model.training and set model.train(was) at its end: a block kept in eval mode came back in train
    mode, and an exception mid-validation left the whole model in eval mode."""
    model = make_model(seed=1)
    x = tokens(model, B=2, T=9, seed=2)
    good = (x, torch.roll(x, -1, 1))
    before = mixed_modes(model)
    validate(model, [good], "cpu", nullcontext, [2])
    assert modes(model) == before
    with pytest.raises((IndexError, RuntimeError, ValueError)):
        validate(model, bad_batches(model, good), "cpu", nullcontext, [2])
    assert modes(model) == before


def test_validate_drafter_restores_every_modules_mode_on_return_and_on_an_exception():
    """validate_drafter (adapt's validation) restored only the drafter model's top-level mode, and not on an
    exception."""
    base = make_model(seed=3)
    x = tokens(base, B=2, T=9, seed=4)
    good = (x, torch.roll(x, -1, 1))
    drafter = make_drafter(base, "3xF2-h0-K1")
    cfg = AdaptConfig(src="unused", out="unused", plan="3xF2-h0-K1", kv="own")
    before = mixed_modes(drafter.model)
    validate_drafter(base, drafter, [good], cfg, "cpu")
    assert modes(drafter.model) == before
    with pytest.raises((IndexError, RuntimeError, ValueError)):
        validate_drafter(base, drafter, bad_batches(base, good), cfg, "cpu")
    assert modes(drafter.model) == before

"""snlp.train.validate.validate with `rows`: a DDP run's validation batches hold the global batch's rows; each forward
runs at most the per-process batch's rows (one forward of them all holds P times training's logits) and the batch's
CE, plan CE and gaps stay the whole batch's token means. Reference: the same batch in one forward, in float64."""
from contextlib import nullcontext

import pytest
import torch

from conftest import make_model, tokens
from snlp.method.plan import Plan
from snlp.train.validate import validate


def test_validation_in_row_slices_equals_one_forward_of_the_batch():
    model = make_model(seed=3)
    x = tokens(model, B=6, T=9, seed=1)
    y = torch.roll(x, -1, 1)
    y[0, 2:] = -1  # ragged targets (a padded SFT batch): slices hold different numbers of them
    y[3, 5:] = -1
    y[4, :] = -1  # a row without any
    batches = [(x, y), (x.flip(0), y.flip(0))]
    plan = Plan.parse("3xF2-h0-K1")
    ref = validate(model, batches, "cpu", nullcontext, [2, 3], plan=plan)
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a: seen.append(a[0].size(0)))
    try:
        got = validate(model, batches, "cpu", nullcontext, [2, 3], plan=plan, rows=2)
    finally:
        hook.remove()
    assert seen and max(seen) <= 2
    # the logits' CE runs in float32 (the head's output), so slices and the whole batch agree to its rounding
    assert got.loss == pytest.approx(ref.loss, rel=1e-6) and got.loss_plan == pytest.approx(ref.loss_plan, rel=1e-6)
    for n in ref.gaps:
        assert got.gaps[n] == pytest.approx(ref.gaps[n], rel=1e-6), n
    assert validate(model, batches, "cpu", nullcontext, [2], rows=6).loss == validate(model, batches, "cpu",
                                                                                      nullcontext, [2]).loss


def test_a_validation_batch_without_targets_has_no_ce_and_weighs_nothing():
    """A batch whose targets are all -1 has a CE mean of 0/0: in one forward (no `rows`) validation logged NaN as the
    loss, and in slices it added 0 and still counted in the average. Its CE is left out and the loss is the mean of
    the other batches' CE (reference: model(x, y) of the batch with targets alone); the gaps still average over
    every batch. No batch with a target at all is refused in one line."""
    model = make_model(seed=3)
    x = tokens(model, B=4, T=9, seed=1)
    y = torch.roll(x, -1, 1)
    empty = torch.full_like(y, -1)
    with torch.no_grad():
        want = float(model(x, y))
    for rows in (None, 2):
        got = validate(model, [(x, y), (x.flip(0), empty)], "cpu", nullcontext, [2], rows=rows)
        assert got.loss == pytest.approx(want, rel=1e-6), (rows, got.loss, want)
        both = validate(model, [(x, y), (x.flip(0), y.flip(0))], "cpu", nullcontext, [2], rows=rows)
        assert got.gaps == both.gaps
    with pytest.raises(ValueError, match="none of the 2 validation batches has a target"):
        validate(model, [(x, empty), (x, empty)], "cpu", nullcontext, [2])

"""scripts/alpha_held_out.py (the drafter acceptance a lease's decode prediction rests on): its exact binomial
interval against scipy's Clopper-Pearson values, and its counts on a drafter that is exact (K >= C: every draft
accepted) and on one that is not, against sequential greedy decoding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import make_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import alpha_held_out  # noqa: E402


# scipy.stats.binomtest(k, n).proportion_ci() (method "exact", 95 %), computed once with scipy 1.17.1
SCIPY = {(2406, 2471): (0.9665935075549305, 0.97964091843509), (0, 10): (0.0, 0.30849710781876294),
         (10, 10): (0.6915028921812371, 1.0), (3, 7): (0.09898827844243689, 0.81594843235993)}


@pytest.mark.parametrize("k,n", sorted(SCIPY))
def test_interval_is_scipys_clopper_pearson(k, n):
    lo, hi = alpha_held_out.clopper_pearson(k, n)
    assert lo == pytest.approx(SCIPY[k, n][0], abs=1e-9) and hi == pytest.approx(SCIPY[k, n][1], abs=1e-9)


def test_an_exact_drafter_is_always_accepted_and_an_approximate_one_is_not():
    torch.manual_seed(0)
    model = make_model(n_layer=4, vocab_size=32).eval()
    prompts = [torch.randint(0, 32, (5,)).tolist() for _ in range(3)]
    exact = alpha_held_out.measure(model, prompts, "2xF1-h0-K2", [3], 12, [torch.float64])  # K >= C: the model
    assert exact[0]["alpha"] == 1.0 and exact[0]["equal_outputs"] == 3 and exact[0]["high"] == 1.0
    approx = alpha_held_out.measure(model, prompts, "3xF1-h0-K1", [3], 12, [torch.float64])
    row = approx[0]
    assert row["equal_outputs"] == 3  # greedy self-speculation is exact whatever the drafter
    assert row["accepted"] < row["examined"] and row["low"] <= row["alpha"] <= row["high"] < 1.0


def test_the_prompt_bootstrap_is_wider_than_the_draft_interval_when_prompts_differ():
    """Prompts that are all easy or all hard: alpha's spread comes from which prompts were drawn, which the binomial
    interval over drafts ignores. Equal prompts: the bootstrap has no spread at all."""
    acc, exam = [10, 10, 10, 2, 2, 2] * 4, [10] * 24
    lo, hi = alpha_held_out.clopper_pearson(sum(acc), sum(exam))
    blo, bhi = alpha_held_out.prompt_bootstrap(acc, exam)
    assert blo < lo and bhi > hi and blo < 0.6 < bhi
    assert alpha_held_out.prompt_bootstrap([7] * 10, [10] * 10) == (0.7, 0.7)


def test_bf16_is_measured_by_default_only_where_the_cpu_has_native_kernels(monkeypatch):
    monkeypatch.setattr(alpha_held_out, "emulated_dtype", lambda device, dtype: True)
    assert alpha_held_out.default_dtypes() == [torch.float32]
    monkeypatch.setattr(alpha_held_out, "emulated_dtype", lambda device, dtype: False)
    assert alpha_held_out.default_dtypes() == [torch.float32, torch.bfloat16]

"""snlp.bench.forward.benchmark: the structural ideal (fixed costs measured) and the compiled teacher-forced path.
No wall-clock thresholds: only the records' consistency and compiled == eager."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from snlp.bench.forward import benchmark, compile_step, structural_ideal
from snlp.model.gpt import GPT, GPTConfig
from snlp.method.plan import Plan, parse_plans
from snlp.method.solver import bind


def _tiny(depth=4, **kw) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_depth(depth, width=32, head_dim=16, vocab_size=97, **kw))
    model.init_weights(seed=0)
    return model.eval()


@settings(max_examples=60, deadline=None)
@given(t_fixed=st.floats(0, 10), t_layer=st.floats(1e-4, 10), L=st.integers(1, 64), steps=st.integers(0, 80))
def test_structural_ideal_lies_between_one_and_the_op_count_ideal(t_fixed, t_layer, L, steps):
    t_seq = t_fixed + L * t_layer
    layer, ideal = structural_ideal(t_seq, t_fixed, L, steps)
    assert layer == pytest.approx(t_layer, rel=1e-9, abs=1e-12)
    op_count = L / max(steps, 1)
    # the fixed costs (paid once by both sides) pull the ideal from L / steps towards 1
    assert min(1.0, op_count) * (1 - 1e-9) <= ideal <= max(1.0, op_count) * (1 + 1e-9)
    if t_fixed == 0:
        assert ideal == pytest.approx(op_count)


def test_structural_ideal_clamps_a_negative_layer_time():
    layer, ideal = structural_ideal(1.0, 2.0, 8, 3)  # noise: fixed > sequential; the ideal stays in [1, L / steps]
    assert layer == 0.0 and ideal == pytest.approx(1.0) and math.isfinite(ideal)


def test_critical_path_layers_is_what_ideal_speedup_divides_by():
    for text, L, iters, steps in [("12xF2-h0-K1", 32, None, 9), ("12xF1-fwd-K2", 32, None, 23),
                                  ("4xF1-K2-diag:vjp", 8, None, 4 + 2 * 3), ("4xF1-h0-K3-tol:0.1", 8, 1, 5)]:
        plan = Plan.parse(text)
        assert plan.critical_path_layers(L, iters) == steps
        assert plan.ideal_speedup(L, iters) == L / steps


def test_benchmark_records_the_structural_ideal_consistently():
    model = _tiny(depth=4)
    records = benchmark(model, parse_plans("2xF2-h0-K1,4xF1-fwd-K1,2xF1-h0-K2"), tokens=5, warmup=1, runs=3)
    seq = records[0]
    assert seq.plan == "sequential" and seq.structural_ideal == 1.0 and seq.of_structural == 1.0
    for r in records:
        for key in ("embed_ms", "head_ms", "fixed_ms", "layer_ms", "structural_ideal", "of_structural"):
            assert math.isfinite(getattr(r, key)) and getattr(r, key) >= 0, (key, r)
        assert r.embed_ms == seq.embed_ms and r.head_ms == seq.head_ms  # one measurement, every row
        assert r.fixed_ms == pytest.approx(min(r.embed_ms + r.head_ms, seq.median_ms))  # noise can time them above
        assert r.layer_ms == pytest.approx(max(seq.median_ms - r.fixed_ms, 0) / 4)
        steps = r.critical_path_layers
        assert r.structural_ideal == pytest.approx(seq.median_ms / (r.fixed_ms + steps * r.layer_ms))
        assert r.of_structural == pytest.approx(r.speedup / r.structural_ideal)
        op = r.ideal_layer_speedup
        assert op == pytest.approx(4 / steps)
        assert min(1.0, op) - 1e-9 <= r.structural_ideal <= max(1.0, op) + 1e-9
        assert r.compiled is False and r.compile_s is None
    assert [r.critical_path_layers for r in records] == [4, 1, 2, 4]  # L; S + K; S + K + fwd; S + 2K


@pytest.mark.slow
def test_compiled_forwards_equal_eager_and_the_benchmark_reports_compile_time_apart():
    torch._dynamo.reset()
    model = _tiny(depth=4)
    idx = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    plans = parse_plans("2xF2-fwd-K1")  # one plan: compiling is slow on 2 cores (fused chunks, fwd init, IDN)
    with torch.inference_mode():
        runners = [bind(model, p, check_finite=False) for p in plans]
        for fn in [lambda: model(idx)] + [(lambda r: lambda: r(idx))(r) for r in runners]:
            eager = fn()
            compiled = compile_step(fn, idx.device)()
            torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)  # fp32: inductor's C++ vs eager
    records = benchmark(model, plans, tokens=6, warmup=1, runs=3, compile=True)
    assert [r.plan for r in records] == ["sequential", *map(str, plans)]
    for r in records:
        assert r.compiled is True and r.compile_s > 0 and r.fixed_compile_s > 0
        assert math.isfinite(r.structural_ideal) and r.runs == 3
    torch._dynamo.reset()


def test_compiled_benchmark_rejects_a_tol_plan_with_a_message():
    with pytest.raises(ValueError, match="fixed K"):
        benchmark(_tiny(depth=4), parse_plans("2xF2-h0-K2-tol:0.01"), tokens=2, warmup=0, runs=1, compile=True)


def test_the_sequential_forwards_structural_ideal_is_one_whatever_the_noise():
    """Timed apart, embedding + head can exceed the whole sequential forward on a loaded host: the sequential row's
    ideal must still be 1 (it was t_seq / t_fixed, e.g. 0.37), and no plan's may fall below 1 for it."""
    from snlp.bench.forward import structural_ideal
    for t_fixed in (0.0, 3.0, 8.9, 9.0, 24.0):
        layer, ideal = structural_ideal(9.0, t_fixed, 4, 4)
        assert ideal == 1.0 and layer >= 0
        assert structural_ideal(9.0, t_fixed, 4, 1)[1] >= 1.0
    # exactly 1, not within rounding: t_fixed + L t_layer rounded away from t_seq for ~3 % of timing pairs
    rng = random.Random(0)
    for _ in range(20000):
        t_seq, t_fixed, L = rng.uniform(0.1, 50), rng.uniform(0, 60), rng.randint(1, 64)
        assert structural_ideal(t_seq, t_fixed, L, L)[1] == 1.0
        steps = rng.randint(1, L)
        assert 1.0 <= structural_ideal(t_seq, t_fixed, L, steps)[1] <= L / steps * (1 + 1e-12)
    assert structural_ideal(3.7320184874022497, 1.553162578583102, 4, 4)[1] == 1.0  # the reviewer's pair

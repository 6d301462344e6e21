"""Seams of the solver and its plan strings (issue 22, items 3 and 7).

  - `Plan.parse(str(p)) == p` for every valid plan over the whole grammar (inits, surrogates and their
    options, tol, ELK, orders, chunkings): a plan string never loses digits (`elk:0.1000001` and
    `elk:0.1000002` stay two plans), and nice numbers keep their short form.
  - a `tol` plan's stop test is per row: a row that met tol is frozen while the others iterate, so
    solving a batch equals solving each row alone (final state, per-row iteration counts, the K/V a
    cached solve leaves behind), in `solve` and in `DistributedSNLP.solve`."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import examples, make_model, tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from snlp.correction import ESTIMATORS, HCN, DiagN, Identity, Jacobi, Newton
from snlp.plan import INITS, Plan

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- item 7: plan strings round-trip exactly
def _floats(lo: float, hi: float, **kw):
    """Any finite float in [lo, hi] (subnormals and 17-digit values included) or a nice short one."""
    return st.one_of(st.floats(lo, hi, allow_nan=False, allow_infinity=False, **kw),
                     st.sampled_from([x for x in (1e-5, 1e-3, 0.01, 0.1, 0.25, 0.5, 0.9, 2.0, 1e3) if lo <= x <= hi]))


@st.composite
def plans(draw):
    """A random valid Plan over the whole grammar."""
    chunks, fuse = draw(st.integers(1, 12)), draw(st.integers(1, 4))
    kind = draw(st.sampled_from(["idn", "none", "hcn", "newton", "diag"]))
    if kind == "diag":
        subset = draw(st.one_of(st.none(), st.sets(st.integers(0, chunks - 1), min_size=1).map(tuple)))
        sur = DiagN(draw(st.sampled_from(ESTIMATORS)), probes=draw(st.integers(1, 9)),
                    eps=draw(_floats(0.0, 1e6, exclude_min=True)), subset=subset)
    else:
        sur = {"idn": Identity(), "none": Jacobi(), "hcn": HCN(), "newton": Newton()}[kind]
    order = draw(st.one_of(st.none(), st.permutations(range(chunks)).map(tuple)))
    tol = draw(st.one_of(st.just(0.0), _floats(0.0, 1e6, exclude_min=True)))
    elk = draw(st.one_of(st.just(0.0), _floats(0.0, 1.0, exclude_max=True)))
    return Plan(chunks=chunks, fuse=fuse, init=draw(st.sampled_from(INITS)), iters=draw(st.integers(0, 40)),
                surrogate=sur, elk=elk, order=order, tol=tol)


@settings(max_examples=examples(300), deadline=None)
@given(plans())
def test_plan_string_round_trips_exactly(plan):
    text = str(plan)
    back = Plan.parse(text)
    assert back == plan, (text, back, plan)
    assert str(back) == text
    # the numbers really are equal as floats (== on the dataclass would also accept -0.0 == 0.0)
    assert (back.tol, back.elk) == (plan.tol, plan.elk)
    if isinstance(plan.surrogate, DiagN):
        assert back.surrogate.eps == plan.surrogate.eps


def test_close_plans_print_differently_and_nice_numbers_stay_short():
    a, b = Plan.parse("4xF1-h0-K2-elk:0.1000001"), Plan.parse("4xF1-h0-K2-elk:0.1000002")
    assert a != b and str(a) != str(b)  # `:g` printed both as elk:0.1
    assert Plan.parse(str(a)) == a and Plan.parse(str(b)) == b
    t = Plan.parse("4xF1-h0-K9-tol:1.0000001e-3")
    assert Plan.parse(str(t)) == t and t.tol == 1.0000001e-3
    e = Plan.parse("4xF1-h0-K2-diag:fd-eps:0.0100000003")
    assert Plan.parse(str(e)) == e and e.surrogate.eps == 0.0100000003
    # canonical short forms are kept for numbers :g writes exactly
    assert str(Plan.parse("4xF1-h0-K2-tol:1e-3-elk:0.5")) == "4xF1-h0-K2-tol:0.001-elk:0.5"
    assert str(Plan.parse("4xF1-h0-K2-tol:1e-5")) == "4xF1-h0-K2-tol:1e-05"
    assert str(Plan.parse("4xF1-h0-K2-diag:jvp-eps:0.01")) == "4xF1-h0-K2-diag:jvp-eps:0.01"
    from snlp.plan import format_number

    assert [format_number(x) for x in (0.5, 0.25, 1e-3, 100.0, 0.1 + 0.2)] == ["0.5", "0.25", "0.001", "100",
                                                                                repr(0.1 + 0.2)]
    assert all(float(format_number(x)) == x for x in (math.pi, 5e-324, 1.7976931348623157e308, 1 / 3))

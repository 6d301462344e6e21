from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snlp import DiagN, Identity, Jacobi, Newton, Plan, parse_plans
from snlp.method.plan import cli_plan


@st.composite
def plans(draw):
    chunks = draw(st.integers(1, 12))
    order = draw(st.one_of(st.none(), st.permutations(range(chunks)).map(tuple)))
    surrogate = draw(st.sampled_from(["idn", "none", "hcn", "diag", "newton"]))
    if surrogate == "diag":
        subset = draw(st.one_of(st.none(), st.sets(st.integers(0, chunks - 1), min_size=1).map(tuple)))
        est = draw(st.sampled_from(["fd", "jvp", "vjp"]))  # eps is fd's step only
        surrogate = DiagN(estimator=est, probes=draw(st.integers(1, 8)),
                          eps=draw(st.sampled_from([None, 1e-3, 1e-2, 2.5e-4])) if est == "fd" else None, subset=subset)
    corrects = surrogate != "none"  # Jacobi has no correction to damp or order
    return Plan(chunks=chunks, fuse=draw(st.integers(1, 4)), init=draw(st.sampled_from(["h0", "fwd"])),
                iters=draw(st.integers(0, 9)), surrogate=surrogate,
                elk=draw(st.sampled_from([0.0, 0.1, 0.5, 0.95])) if corrects else 0.0, order=order if corrects else None,
                tol=draw(st.sampled_from([0.0, 1e-5, 0.01])), causal=draw(st.booleans()))


@settings(max_examples=200)
@given(plans())
def test_str_round_trips(plan):
    assert Plan.parse(str(plan)) == plan


def test_paper_notation():
    p = Plan.parse("12xF2-h0-K1")
    assert (p.chunks, p.fuse, p.init, p.iters, p.surrogate, p.n_suffix) == (12, 2, "h0", 1, Identity(), 24)
    assert p.prefix_len(32) == 8
    assert str(p) == "12xF2-h0-K1"
    # the SSD table writes K before the init; defaults are h0 and K=1
    assert Plan.parse("24xF1-K2-h0") == Plan(24, 1, "h0", 2)
    assert Plan.parse("8xF1") == Plan(8, 1, "h0", 1)
    assert str(Plan.parse("4xF1-fwd-K2-newton-elk:0.1-order:reversed")) == "4xF1-fwd-K2-newton-elk:0.1-order:reversed"
    assert Plan.parse("3xF1-order:0.1.2").order is None  # forward is the default, not stored
    assert Plan.parse("3xF1-order:2.0.1").order == (2, 0, 1)


def test_surrogate_notation():
    assert Plan.parse("16xF1-h0-K1-hcn").surrogate.token == "hcn"
    assert Plan.parse("16xF1-h0-K1-none").surrogate == Jacobi() == Plan(16, surrogate="none").surrogate
    p = Plan.parse("8xF1-h0-K2-diag:vjp")
    assert p.surrogate == DiagN("vjp", probes=1, subset=None)
    assert Plan.parse("8xF1-diag") == Plan(8, surrogate=DiagN("fd")) == Plan(8, surrogate="diag")
    p = Plan.parse("4xF1-K3-diag-probes:4-eps:1e-2-subset:2.0-tol:1e-5")
    assert (p.surrogate.probes, p.surrogate.eps, p.surrogate.subset, p.tol) == (4, 0.01, (0, 2), 1e-5)
    assert str(p) == "4xF1-h0-K3-diag:fd-probes:4-eps:0.01-subset:0.2-tol:1e-05"


def test_ideal_speedup_counts_what_runs():
    """Layer-step ideal L / (S + K * evals + [fwd]): DiagN's P probes run in ONE batched pass (fd: one
    forward, jvp: one forward-mode pass, vjp: forward + backward); exact Newton costs one JVP per
    corrected chunk; with tol the iterations actually run are used."""
    assert Plan.parse("4xF1-K2-diag:fd-probes:8").ideal_speedup(8) == pytest.approx(8 / (4 + 2 * 2))
    assert Plan.parse("4xF1-K2-diag:jvp-probes:3").ideal_speedup(8) == pytest.approx(8 / (4 + 2 * 2))
    assert Plan.parse("4xF1-K2-diag:vjp").ideal_speedup(8) == pytest.approx(8 / (4 + 2 * 3))
    assert Plan.parse("4xF1-newton-K2").ideal_speedup(8) == pytest.approx(8 / (4 + 2 * 4))  # 3 JVPs + 1 forward
    assert Plan.parse("4xF1-newton-K2-order:reversed").ideal_speedup(8) == pytest.approx(8 / (4 + 2 * 4))
    assert Plan.parse("4xF1-K8-tol:1e-3").ideal_speedup(8, iters=2) == pytest.approx(8 / (4 + 2))
    assert Plan.parse("4xF1-fwd-K2").ideal_speedup(8) == pytest.approx(8 / (4 + 2 + 1))


def test_ideal_speedup_counts_batched_evaluations():
    assert Plan.parse("1xF12-h0-K1").ideal_speedup(16) == pytest.approx(16 / 5)
    assert Plan.parse("12xF1-h0-K1").ideal_speedup(16) == pytest.approx(16 / 5)
    assert Plan.parse("12xF1-fwd-K2").ideal_speedup(16) == pytest.approx(16 / 7)
    assert Plan.parse("12xF2-h0-K1").ideal_speedup(32) == pytest.approx(32 / 9)


def test_lag_and_exactness_follow_correction_order():
    assert Plan.parse("4xF1-order:0.2.1.3").lag() == [False, False, True, False]
    assert Plan.parse("4xF1-elk:0.5-order:0.2.1.3").lag_factors() == [0.0, 0.0, 0.5, 0.0]
    assert Plan.parse("4xF1").exact_after() == [1, 2, 3, 4] and Plan.parse("4xF1").exact_iters() == 4
    assert Plan.parse("4xF1-order:reversed").exact_after() == [1, 3, 5, 7]
    assert Plan.parse("4xF1-none").exact_after() == [1, 2, 3, 4]
    assert Plan.parse("4xF1-order:0.2.1.3").exact_iters() == 5
    # fwd: chunk 0 is exact from the init, and never moves, so its lagged successor needs no extra iteration
    assert Plan.parse("4xF1-fwd").exact_after() == [0, 1, 2, 3]
    assert Plan.parse("4xF1-fwd-order:reversed").exact_after() == [0, 1, 3, 5]
    assert Plan.parse("1xF1-fwd").exact_iters() == 0 and Plan.parse("1xF1-preheat").exact_iters() == 1
    for text in ("7xF1", "7xF2-fwd-none", "1xF3-fwd", "5xF1-preheat-newton"):  # the closed form is the staircase's
        assert Plan.parse(text).exact_iters() == Plan.parse(text).exact_after()[-1] == max(Plan.parse(text).exact_after())
    # a mistyped C reaches the does-not-fit error of the model, not a list of C entries (MemoryError before)
    assert Plan.parse("1000000000000000xF1-K5").exact_iters() == 10 ** 15
    assert str(cli_plan("1000000000000000xF1-K5")) == "1000000000000000xF1-h0-K5"
    with pytest.raises(ValueError, match="model has only L = 16"):
        cli_plan("1000000000000000xF1-K5", 16)


def test_link_follows_correction_order():
    assert Plan.parse("4xF1").link() == [True] * 4
    assert Plan.parse("4xF1-order:reversed").link() == [True, False, False, False]
    assert Plan.parse("4xF1-order:0.2.1.3").link() == [True, True, False, True]


@pytest.mark.parametrize("text,msg", [
    ("", "empty plan"),
    ("12F2-h0-K1", "must start with CxFM"),
    ("0xF2", "chunks C must be an integer >= 1"),
    ("2xF0", "M must be an integer >= 1"),
    ("4xF1-h1", "unknown part 'h1'"),
    ("4xF1-K-1", "the iteration count K-1 must be an integer >= 0"),
    ("4xF1-jacobi", "unknown part 'jacobi'"),
    ("4xF1-K1-K2", "iters given twice"),
    ("4xF1-elk:1.0", r"ELK damping must lie in \[0, 1\)"),
    ("4xF1-elk:x", r"elk must be a number in \[0, 1\), got 'x'"),
    ("4xF1-order:0.1.1.2", "must be a permutation of 0..3"),
    ("4xF1-order:0.1", "must be a permutation of 0..3"),
    ("4xF1-diag:adam", "unknown part 'diag:adam'"),
    ("4xF1-probes:2", "applies only to the diag surrogate"),
    ("4xF1-hcn-eps:0.1", "applies only to the diag surrogate"),
    ("4xF1-diag-probes:0", "probes must be an integer >= 1"),
    ("4xF1-diag-eps:0", "FD step eps must be > 0"),
    ("4xF1-diag-subset:4", r"distinct chunk indices in 0..3 \(got 4\)"),
    ("4xF1-diag-subset:1.1", "distinct chunk indices"),
    ("4xF1-tol:x", "tol must be a positive number, got 'x'"),
    ("4xF1-diag-eps:inf", "eps needs a finite number, got 'inf'"),
    ("4xF1-diag-eps:nan", "eps needs a finite number"),
    ("4xF1-diag-eps:0.0", "FD step eps must be > 0"),
    ("4xF1-tol:inf", "tol needs a finite number"),
    ("4xF1-tol:nan", "tol needs a finite number"),
    ("4xF1-tol:0", "tol must be a positive number, got '0'"),
    ("4xF1-elk:nan", "elk needs a finite number"),
    ("4xF1-elk:inf", "elk needs a finite number"),
])
def test_malformed_plans_say_what_is_wrong(text, msg):
    with pytest.raises(ValueError, match=msg) as e:
        Plan.parse(text)
    assert "Grammar:" in str(e.value)


@pytest.mark.parametrize("text,msg", [
    ("4xF1-none-elk:0.5", r"elk:0.5 scales the correction, and the none surrogate \(Jacobi, A = 0\) makes none"),
    ("4xF1-K3-none-order:reversed", r"the none surrogate \(Jacobi, A = 0\) makes no correction: drop order"),
    ("4xF1-order:1.0.2.3-none", "drop order"),
    ("4xF1-diag:jvp-eps:0.01", "diag:jvp computes its products by autodiff without reading it: drop eps"),
    ("4xF1-eps:0.001-diag:vjp", "diag:vjp computes its products by autodiff without reading it: drop eps"),
])
def test_options_the_surrogate_never_reads_are_refused(text, msg):
    """Jacobi's update is h^{(k+1)} = F(h^{(k)}) whatever the ELK damping and the correction order, and the jvp / vjp
    estimators never read the FD step: such a plan ran exactly as the plan without the option (same logits) while its
    name said otherwise. Refused in one line, parsed or constructed."""
    with pytest.raises(ValueError, match=msg) as e:
        Plan.parse(text)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="makes none"):
        Plan(4, surrogate="none", elk=0.25)
    with pytest.raises(ValueError, match="drop order"):
        Plan(4, surrogate=Jacobi(), order=(3, 2, 1, 0))
    with pytest.raises(ValueError, match="drop eps"):
        DiagN("vjp", eps=0.01)
    assert Plan.parse("4xF1-none-order:forward") == Plan(4, surrogate="none")  # forward is no option: the default
    assert Plan.parse("4xF1-diag:fd-eps:0.01").surrogate.eps == 0.01


def test_a_subset_of_every_chunk_is_the_default_diag_plan():
    """DiagN on every chunk is one plan (the same probe draw, the same solve) and so has one name: a list naming it
    twice is refused as a repeat."""
    p = Plan.parse("4xF1-K2-diag:vjp-subset:3.1.0.2")
    assert p == Plan.parse("4xF1-K2-diag:vjp") and str(p) == "4xF1-h0-K2-diag:vjp"
    assert Plan(4, surrogate=DiagN(subset=(0, 1, 2, 3))).surrogate.subset is None
    assert Plan.parse("4xF1-diag-subset:0.1.2").surrogate.subset == (0, 1, 2)
    with pytest.raises(ValueError, match="twice"):
        parse_plans("4xF1-diag,4xF1-diag-subset:0.1.2.3")


def test_plans_must_fit_the_model():
    with pytest.raises(ValueError, match="model has only L = 16"):
        Plan.parse("12xF2-h0-K1", n_layer=16)
    assert Plan.parse("8xF2", n_layer=16).prefix_len(16) == 0
    with pytest.raises(ValueError, match=r"M=5 must divide the suffix length N=12 \(valid M: \[1, 2, 3, 4, 6, 12\]\)"):
        Plan.for_suffix(12, 5)
    assert Plan.for_suffix(12, 3, iters=2) == Plan(4, 3, "h0", 2)
    with pytest.raises(ValueError, match="iterations K must be an integer >= 0"):
        Plan(4, iters=-1)
    with pytest.raises(ValueError, match="unknown init 'warm'"):
        Plan(4, init="warm")
    with pytest.raises(ValueError, match="unknown surrogate 'diagonal'"):
        Plan(4, surrogate="diagonal")
    for bad in (float("inf"), float("nan")):  # constructed directly, not parsed: the same checks
        with pytest.raises(ValueError, match="tol must be a finite number"):
            Plan(4, tol=bad)
        with pytest.raises(ValueError, match="ELK damping"):
            Plan(4, elk=bad)
        with pytest.raises(ValueError, match="FD step eps must be > 0 and finite"):
            DiagN(eps=bad)
    with pytest.raises(ValueError, match="the hcn surrogate needs an mHC model"):
        from snlp import GPTConfig
        Plan.parse("4xF1-hcn").check_model(GPTConfig(n_layer=4))
    assert Newton().evals_per_iter(Plan(1)) == 1  # a single chunk needs no JVP


def test_plan_lists():
    assert [str(p) for p in parse_plans("1xF12-h0-K1, 12xF1-h0-K1")] == ["1xF12-h0-K1", "12xF1-h0-K1"]
    with pytest.raises(ValueError, match="no plans"):
        parse_plans(" , ")


@pytest.mark.parametrize("text, says", [("4xF1-h0-K1,4xF1-h0-K1", "lists 4xF1-h0-K1 twice: "),
                                        ("4xF1-K1, 4xF1-h0-K1", "(4xF1-K1 and 4xF1-h0-K1 are one plan)")])
def test_parse_plans_refuses_a_plan_twice(text, says):
    """Every consumer keys rows / runners / files by the plan (bench's runner dict kept one of two, eval repeated the
    row): a plan named twice, in any spelling, is one line of refusal wherever a plan list is parsed."""
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_plans(text, 8)

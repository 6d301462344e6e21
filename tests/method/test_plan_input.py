"""Plan strings a user writes: a negative K is named as such, non-ASCII digits are refused (int() reads
full-width digits), and a K beyond the iteration count from which the plan is exact is capped with a warning
(K = 10**9 used to be accepted and never return)."""

import re
import warnings

import pytest
import torch

from snlp.method.plan import Plan, cli_plan, parse_plans
from snlp.method.solver import parallel_forward
from snlp.model.gpt import GPT, GPTConfig


@pytest.mark.parametrize("text", ["12xF1-h0-K-1", "12xF1-K-3-none", "12xF1-h0-K"])
def test_a_negative_or_missing_K_is_named(text):
    with pytest.raises(ValueError, match=r"the iteration count K(-\d)? must be an integer >= 0") as e:
        parse_plans(text)
    assert "unknown part" not in str(e.value)


@pytest.mark.parametrize("text", ["１２xF1-h0-K1", "12xF1-h0-K１", "4xF1-h0-K1-tol:１e-3",
                                  "4xF1-h0-K1-order:０.1.2.3", "4xF1-h0-K1-diag-probes:２"])
def test_non_ascii_digits_are_refused(text):
    with pytest.raises(ValueError, match=r"is not ASCII"):
        Plan.parse(text)


@pytest.mark.parametrize("text,capped", [("4xF1-h0-K999999999", "4xF1-h0-K4"), ("2xF3-fwd-K7", "2xF3-fwd-K1"),
                                         ("3xF1-h0-K9-order:reversed", "3xF1-h0-K5-order:reversed"),
                                         ("4xF1-h0-K50-tol:0.001", "4xF1-h0-K4-tol:0.001")])
def test_K_beyond_exact_is_capped_with_a_warning(text, capped):
    with pytest.warns(UserWarning, match=r"beyond K = \d+, from which the plan is exact"):
        assert str(parse_plans(text)[0]) == capped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert str(cli_plan(capped)) == capped  # no warning at or below the exact count
        assert Plan.parse(text).iters > Plan.parse(capped).iters  # the library's parse keeps what it is given


def test_capping_changes_no_output():
    """The capped plan's logits equal the uncapped plan's bit for bit, and for M = 1 the model's own forward (the
    outside reference: the layers run one after another)."""
    m = GPT(GPTConfig.from_depth(6, head_dim=8, width=16, vocab_size=64, sequence_len=16)).double()
    m.init_weights(seed=0)
    m.eval()
    idx = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    for text in ("3xF2-h0-K8", "6xF1-h0-K12", "6xF1-fwd-K30-order:reversed"):
        plan = Plan.parse(text)
        with pytest.warns(UserWarning):
            capped = cli_plan(text)
        with torch.no_grad():
            full, cut = parallel_forward(m, idx, plan), parallel_forward(m, idx, capped)
            ref = m(idx)
        torch.testing.assert_close(cut, full, rtol=0, atol=0)
        if plan.fuse == 1:
            torch.testing.assert_close(cut, ref, rtol=1e-10, atol=1e-10)


def test_the_command_line_says_so_in_one_line(tmp_path):
    """`snlp tune` reads its plans before the checkpoint: the cap is one warning line, then the missing checkpoint."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "snlp", "tune", str(tmp_path / "no-ckpt"), "--plans",
                        "2xF1-h0-K999999999"], cwd=root, capture_output=True, text=True,
                       env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    lines = r.stderr.strip().splitlines()
    assert lines[0] == ("snlp: warning: plan 2xF1-h0-K999999999: K = 999999999 is beyond K = 2, from which the plan "
                        "is exact (its output equals the model run sequentially); running 2xF1-h0-K2")
    assert r.returncode == 2 and "no-ckpt" in lines[-1]


def test_capped_duplicates_are_one_plan():
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="are one plan"):
        parse_plans("4xF1-h0-K4,4xF1-h0-K8")


@pytest.mark.parametrize("text,says", [
    # a negative value: the '-' split it off its part, which was reported as "unknown part 'tol:'"
    ("4xF1-h0-K1-tol:-1", "tol must be a positive number, got '-1'"),
    ("4xF1-h0-K1-tol:-1e-3", "tol must be a positive number, got '-1e-3'"),
    ("4xF1-h0-K1-tol:0", "tol must be a positive number, got '0'"),
    ("4xF1-h0-K1-tol:", "tol must be a positive number, got ''"),
    ("4xF1-h0-K1-tol:-inf", "tol needs a finite number, got '-inf'"),
    ("4xF1-h0-K1-elk:-0.5", r"ELK damping must lie in \[0, 1\) \(got -0.5\)"),
    ("4xF1-h0-K1-diag-eps:-1", r"FD step eps must be > 0 and finite \(got -1.0\)"),
    ("4xF1-h0-K1-diag-probes:-1", "probes must be an integer >= 1, got '-1'"),
    ("4xF1-h0-K1-diag-probes:1.5", "probes must be an integer >= 1, got '1.5'"),
    ("4xF1-h0-K1-diag-subset:-1", "subset must be chunk indices >= 0 joined by '.', got '-1'"),
    ("4xF1-h0-K1-order:-1", "order must be forward, reversed or a permutation of the chunk indices joined by '.', "
                            "got '-1'"),
    ("4xF1-h0-K1.5", "the iteration count K must be an integer >= 0 written right after K .*got 'K1.5'"),
    ("4xF1-h0-K-1", "the iteration count K-1 must be an integer >= 0"),
    ("0xF1-h0-K1", r"chunks C must be an integer >= 1 \(got 0\)"),
    ("-1xF1-h0-K1", "the chunk count C must be an integer >= 1, got '-1'"),
    ("4xF-1-h0-K1", "the fused layers per chunk M must be an integer >= 1, got '-1'"),
    ("4xF0-h0-K1", r"M must be an integer >= 1 \(got 0\)"),
    ("4xF1-h-1-K1", r"unknown part 'h-1' \(the inits are h0, fwd, preheat\)"),
])
def test_each_numeric_part_is_named_with_its_value(text, says):
    """Every numeric part of a plan (C, M, K, tol, eps, elk, probes, subset, order) with a bad value, a negative one
    included, gets one line naming the part and the value as written, from Plan.parse and from --plans alike."""
    for parse in (Plan.parse, parse_plans):
        with pytest.raises(ValueError, match=says) as e:
            parse(text)
        msg = str(e.value)
        assert "\n" not in msg and "unknown part 'tol:'" not in msg and "Grammar:" in msg, msg


@pytest.mark.parametrize("text,says", [
    ("16xF1\n-K1-hcn", r"whitespace '\\n' at position 5"),
    ("4xF1-h0-K1-elk: .25", "whitespace ' ' at position 15"),
    ("4xF1-h0-K1-diag-eps:1_0", "eps must be a positive number, got '1_0'"),
    ("4xF1-h0-K-newton", "the iteration count K must be an integer >= 0 .*got a K without its count"),
    ("12xF1-h0-K\n", "got a K without its count"),
])
def test_whitespace_underscores_and_a_bare_K_are_named(text, says):
    """Python's float() reads ' .25' and '1_0', and the head's '$' let a newline through, so these parsed as plans
    not written; a bare K followed by another part was reported as a negative count ('K-newton'), and a trailing
    newline after it ended up raw inside the one-line message."""
    for parse in (Plan.parse, parse_plans):
        with pytest.raises(ValueError, match=says) as e:
            parse(text)
        assert "\n" not in str(e.value) and "Grammar:" in str(e.value)


@pytest.mark.parametrize("text", [5, None, 1.5])
def test_a_plan_that_is_not_a_string_is_named_as_such(text):
    """Plan.parse(5) said "empty plan string"."""
    with pytest.raises(ValueError, match=r"a plan is a string \(e\.g\. 12xF2-h0-K1\) or a Plan, got"):
        Plan.parse(text)


def test_parse_plans_of_a_list_says_it_reads_one_string():
    """parse_plans(["4xF1", "2xF2"]) failed with "'list' object has no attribute 'split'"."""
    with pytest.raises(ValueError, match=r"parse_plans reads one comma-separated string .* got list"):
        parse_plans(["4xF1", "2xF2"], 8)
    assert [str(p) for p in parse_plans("4xF1,2xF2", 8)] == ["4xF1-h0-K1", "2xF2-h0-K1"]


@pytest.mark.parametrize("n_layer", [True, 8.0, "8"])
def test_n_layer_that_is_not_an_integer_is_refused(n_layer):
    """Plan.parse("2xF2", True) read True as a 1-layer model ("the model has only L = True")."""
    with pytest.raises(ValueError, match=r"n_layer is the model's layer count, an int; got"):
        Plan.parse("2xF2", n_layer)
    with pytest.raises(ValueError, match=r"n_layer is the model.s layer count"):
        Plan.parse(Plan.parse("2xF2"), n_layer)


def test_n_layer_of_any_integer_type_is_taken():
    import numpy as np
    assert str(Plan.parse("2xF2", np.int64(8))) == str(Plan.parse("2xF2", 8)) == "2xF2-h0-K1"


def test_every_entry_point_names_a_plan_that_is_neither_a_string_nor_a_plan():
    """The entry points that take `Plan | str` passed anything else on as a Plan: bind(m, 5), snlp_generate(m, p, 5),
    solve(m, idx, None), speculative_generate(m, p, [..]) and evaluate(m, val, [5]) failed with "'int' object has
    no attribute 'check_model'" (or 'check'), and evaluate(m, val, 5) with "'int' object is not iterable". Plan.parse,
    which each now reads its plan with, said "a plan is a string or a Plan" and refused a Plan."""
    import torch
    from conftest import make_model

    import snlp
    from snlp.decode import jacobi_generate, snlp_generate, speculative_generate

    m = make_model(n_layer=6)
    idx = torch.tensor([[1, 2, 3]])
    plan = Plan.parse("3xF1-h0-K1")
    assert Plan.parse(plan) is plan and Plan.parse(plan, 6) is plan
    with pytest.raises(ValueError, match="needs a suffix of N = 3x1 = 3 layers but the model has only L = 2"):
        Plan.parse(plan, 2)
    calls = {"bind": lambda p: snlp.bind(m, p), "solve": lambda p: snlp.solve(m, idx, p),
             "parallel_forward": lambda p: snlp.parallel_forward(m, idx, p),
             "snlp_generate": lambda p: snlp_generate(m, [1, 2], p, 2),
             "speculative_generate": lambda p: speculative_generate(m, [1, 2], p, 2, 2),
             "jacobi_generate": lambda p: jacobi_generate(m, [1, 2], p, 2, 2),
             "evaluate": lambda p: snlp.evaluate(m, torch.arange(200) % 61, [p])}
    for name, call in calls.items():
        for bad in (5, None, ["3xF1-h0-K1"]):
            if bad is None and name in ("jacobi_generate", "evaluate"):  # no plan: the sequential model there
                continue
            says = "needs an SNLP plan" if bad is None and "generate" in name else "a plan is a string"
            with pytest.raises(ValueError, match=says):
                call(bad)
    with pytest.raises(ValueError, match="plans must be a list of plans"):
        snlp.evaluate(m, torch.arange(200) % 61, 5)


@pytest.mark.parametrize("field,value,says", [("chunks", True, "chunks C must be an integer >= 1 (got True)"),
                                              ("fuse", True, "fused layers per chunk M must be an integer >= 1"),
                                              ("iters", True, "iterations K must be an integer >= 0 (got True)"),
                                              ("iters", False, "iterations K must be an integer >= 0 (got False)"),
                                              ("tol", True, "tol must be a finite number >= 0"),
                                              ("elk", False, "ELK damping must lie in [0, 1) (got False)")])
def test_a_bool_is_not_a_count_or_a_number(field, value, says):
    """bool is an int in Python: Plan(chunks=True) ran one chunk under the name 'TruexF1-h0-K1' and iters=True as
    'KTrue', names Plan.parse refuses, and tol=True ran as tol:1; each is refused in one line like any bad value."""
    kw = {"chunks": 2, field: value}
    with pytest.raises(ValueError, match=re.escape(says)):
        Plan(**kw)
    with pytest.raises(ValueError, match=re.escape(says)):
        Plan(chunks=2).with_(**{field: value})
    good = Plan(**{**kw, field: 1 if field != "elk" else 0.0})  # the int it stood for is a plan whose name parses
    assert Plan.parse(str(good)) == good

"""Seams of the solver and its plan strings.

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
from conftest import configs, examples, heads, make_model, mhc_model, tokens
from hypothesis import given, settings
from hypothesis import strategies as st
from test_laws import cases  # the laws' random plans

from snlp.model.cache import KVCache
from snlp.method.surrogates import ESTIMATORS, HCN, DiagN, Identity, Jacobi, Newton
from snlp.method.plan import INITS, Plan
from snlp.method.solver import solve

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- plan strings round-trip exactly
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
        est = draw(st.sampled_from(ESTIMATORS))  # eps is fd's step only
        sur = DiagN(est, probes=draw(st.integers(1, 9)),
                    eps=draw(st.one_of(st.none(), _floats(0.0, 1e6, exclude_min=True))) if est == "fd" else None, subset=subset)
    else:
        sur = {"idn": Identity(), "none": Jacobi(), "hcn": HCN(), "newton": Newton()}[kind]
    order = draw(st.one_of(st.none(), st.permutations(range(chunks)).map(tuple)))
    tol = draw(st.one_of(st.just(0.0), _floats(0.0, 1e6, exclude_min=True)))
    elk = draw(st.one_of(st.just(0.0), _floats(0.0, 1.0, exclude_max=True)))
    if kind == "none":  # Jacobi has no correction to damp or order
        order, elk = None, 0.0
    return Plan(chunks=chunks, fuse=fuse, init=draw(st.sampled_from(INITS)), iters=draw(st.integers(0, 40)),
                surrogate=sur, elk=elk, order=order, tol=tol, causal=draw(st.booleans()))


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
    assert str(Plan.parse("4xF1-h0-K2-diag:fd-eps:0.01")) == "4xF1-h0-K2-diag:fd-eps:0.01"
    from snlp.method.plan import format_number

    assert [format_number(x) for x in (0.5, 0.25, 1e-3, 100.0, 0.1 + 0.2)] == ["0.5", "0.25", "0.001", "100",
                                                                                repr(0.1 + 0.2)]
    assert all(float(format_number(x)) == x for x in (math.pi, 5e-324, 1.7976931348623157e308, 1 / 3))


# ---------------------------------------------------------------- a tol stop is per row
ROW = dict(rtol=1e-10, atol=1e-10)  # fp64: a row alone and in the batch differ only by batched-matmul round-off
TOLS = [0.1, 3e-2, 1e-2, 3e-3]
TOL_FAMILIES = [("plain", "idn"), ("plain", "none"), ("plain", "newton"), ("plain", "diag"), ("mhc", "hcn"),
                ("mhc", "idn")]


@st.composite
def tol_cases(draw, kind: str, family: str):
    """(model, plan, idx): a law case (test_laws.cases: random config, chunking, init, ELK, order) on a random
    model of small weight scale (whose iterations converge gradually, so rows meet tol at different
    iterations), made a tol plan with K up to exact + 1 (both the tol stop and the K cap happen), with 2-4
    rows of independent random tokens."""
    _, plan, idx = draw(cases(kind, family, exact=False, max_layers=7))
    scale, seed = draw(st.sampled_from([0.02, 0.05, 0.1])), draw(st.integers(0, 2 ** 16))
    if kind == "plain":  # a random config (x0 / VE / GQA / windows), as the laws draw it
        cfg = draw(configs())
    else:
        cfg = dict(**draw(heads(max_embd=64)), value_embeds=draw(st.booleans()),
                   window_pattern=draw(st.sampled_from(["L", "SL", "S"])), short_window=draw(st.integers(1, 4)))
    cfg["n_layer"] = plan.n_suffix + draw(st.integers(0, 1))  # the drawn plan plus 0-1 prefix layers
    model = make_model(seed=seed, scale=scale, **cfg) if kind == "plain" else mhc_model(seed=seed, scale=scale, **cfg)
    plan = plan.with_(iters=draw(st.integers(1, plan.exact_iters() + 1)), tol=draw(st.sampled_from(TOLS)))
    B, T = draw(st.integers(2, 4)), draw(st.integers(1, 12))
    return model, plan, tokens(model, B=B, T=T, seed=seed)


def _assert_rows_alone(batch, alone, B):
    for b in range(B):
        torch.testing.assert_close(batch.hidden[b:b + 1], alone[b].hidden, **ROW, msg=f"row {b}")
        assert int(batch.row_iters[b]) == alone[b].iters == int(alone[b].row_iters[0]), (b, batch.row_iters)
    assert batch.iters == int(batch.row_iters.max())
    assert len(batch.updates) == batch.iters


def _splitting_tol(model, plan, idx, draw) -> float | None:
    """A tol that falls between two rows' final-state relative updates at some iteration of the fixed-K solve
    (their geometric mean, at least 5% from both, above round-off), so that the rows meet it at different
    iterations: random rows of a random model converge at nearly the same pace, and a fixed tol would rarely
    split them. None if no iteration separates two rows."""
    with torch.no_grad():
        states = solve(model, idx, plan.with_(tol=0.0), keep_states=True, check_finite=False).states
    splits = []
    for old, new in zip(states, states[1:]):
        rel = sorted(((new[-1] - old[-1]).flatten(1).norm(dim=1) / new[-1].flatten(1).norm(dim=1).clamp_min(1e-300))
                     .flatten().tolist())  # (B,) per row (dim 0 of new[-1] is B)
        # above 1e-12: below it the updates are fp64 round-off, which batched kernels do not reproduce row by row
        splits += [math.sqrt(a * b) for a, b in zip(rel, rel[1:]) if a > 1e-12 and b > 1.1 * a]
    return draw(st.sampled_from(splits)) if splits else None


@pytest.mark.parametrize("kind,family", TOL_FAMILIES)
def test_a_tol_row_converges_as_if_alone(kind, family):
    """Law: with `tol`, solving a batch equals solving every row alone: final state (to fp64 round-off) and
    the iterations each row ran (exactly). Before the fix the stop test was a max over the batch, so a row
    that had converged kept iterating while a neighbour had not, and its result moved."""

    @settings(max_examples=examples(6), deadline=None)
    @given(tol_cases(kind, family), st.data())
    def law(case, data):
        model, plan, idx = case
        if data.draw(st.booleans()):  # a tol between two rows' updates (else the drawn one)
            plan = plan.with_(tol=_splitting_tol(model, plan, idx, data.draw) or plan.tol)
        with torch.no_grad():
            batch = solve(model, idx, plan, check_finite=False)
            alone = [solve(model, idx[b:b + 1], plan, check_finite=False) for b in range(idx.shape[0])]
        _assert_rows_alone(batch, alone, idx.shape[0])

    law()


@pytest.mark.parametrize("plan", ["4xF1-h0-K2-diag:fd", "4xF1-fwd-K3-diag:jvp-probes:2-order:reversed",
                                  "4xF1-h0-K3-diag:vjp-subset:0.2"])
def test_a_diag_row_does_not_depend_on_the_batch(plan):
    """DiagN draws its Rademacher probes once per chunk and token, shared by the rows: a row's estimate, and
    so its solve, is the same alone and in any batch (fixed K, no tol). Before, the draw spanned the batch,
    so a row got other probes (and moved by O(1)) when its batch changed size."""
    model = make_model(seed=0, scale=0.05, n_layer=6)
    idx = tokens(model, B=3, T=8, seed=3)
    with torch.no_grad():
        batch = solve(model, idx, plan)
        for b in range(3):
            torch.testing.assert_close(batch.hidden[b:b + 1], solve(model, idx[b:b + 1], plan).hidden, **ROW)
        torch.testing.assert_close(solve(model, idx[1:], plan).hidden, batch.hidden[1:], **ROW)


def test_rows_stop_at_different_iterations_and_frozen_rows_stay_put():
    """A concrete batch where the rows need different iteration counts (the bug's trigger): the frozen row
    equals the fixed-K solve of its own iteration count, bit for bit in its own batch position."""
    model = make_model(seed=0, scale=0.05, n_layer=8)
    idx = tokens(model, B=4, T=8, seed=3)
    plan = Plan.parse("8xF1-h0-K8-tol:2e-2")
    with torch.no_grad():
        res = solve(model, idx, plan, keep_states=True)
        counts = res.row_iters.tolist()
        assert len(set(counts)) > 1, counts  # otherwise this test would not exercise freezing
        for b, k in enumerate(counts):
            fixed = solve(model, idx, plan.with_(tol=0.0, iters=k))  # the same batch, K = this row's count
            torch.testing.assert_close(res.hidden[b], fixed.hidden[b], rtol=0, atol=0)
            for later in res.states[k:]:  # frozen from its last iteration on: the very same numbers
                assert torch.equal(later[:, b], res.states[k][:, b])
        assert res.updates[-1] < plan.tol and all(u >= plan.tol for u in res.updates[:-1])


@pytest.mark.parametrize("seed,layers,plan", [(0, 8, "8xF1-h0-K8-tol:2e-2"), (1, 6, "6xF1-h0-K6-tol:5e-2-elk:0.2")])
def test_a_cached_tol_solve_leaves_each_row_the_cache_it_would_have_alone(seed, layers, plan):
    """With a KV cache, a frozen row must not overwrite its K/V with those of later iterations: prefill a
    prompt and decode a block with a tol plan (rows stop at different iterations in both); the decode step's
    state and every cached K/V of a row equal the row's own single-row run."""
    model = make_model(seed=seed, scale=0.05, n_layer=layers)
    idx = tokens(model, B=4, T=10, seed=5)
    with torch.no_grad():
        cache = KVCache.for_model(model, batch=4, max_len=16)
        first = solve(model, idx[:, :6], plan, cache=cache)
        batch = solve(model, idx[:, 6:], plan, cache=cache)
        for b in range(4):
            own = KVCache.for_model(model, batch=1, max_len=16)
            solve(model, idx[b:b + 1, :6], plan, cache=own)
            alone = solve(model, idx[b:b + 1, 6:], plan, cache=own)
            torch.testing.assert_close(batch.hidden[b:b + 1], alone.hidden, **ROW)
            assert int(batch.row_iters[b]) == alone.iters
            torch.testing.assert_close(cache.k[:, b:b + 1, :, :10], own.k[:, :, :, :10], **ROW)
            torch.testing.assert_close(cache.v[:, b:b + 1, :, :10], own.v[:, :, :, :10], **ROW)
    assert len(set(first.row_iters.tolist() + batch.row_iters.tolist())) > 1  # rows were frozen somewhere


# ---------------------------------------------------------------- the same law in DistributedSNLP.solve
DIST_CASES = [(0, 8, "8xF1-h0-K8-tol:2e-2"), (1, 6, "6xF1-h0-K6-tol:5e-2-elk:0.2")]  # rows stop apart in both


def _dist_worker(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from conftest import init_gloo as _init

    from snlp.dist.layer_parallel import DistributedSNLP

    _init(rank, world, port)
    res = {}
    for seed, layers, plan in DIST_CASES:
        model = make_model(seed=seed, scale=0.05, n_layer=layers)
        idx = tokens(model, B=4, T=10, seed=5)
        runner = DistributedSNLP(model, plan)
        r = runner.solve(idx)
        cache = runner.new_cache(16, batch=4)
        first = runner.solve(idx[:, :6], cache=cache)
        step = runner.solve(idx[:, 6:], cache=cache)  # reads the K/V the tol-frozen rows left in the prefill
        res[plan] = [(x.hidden, x.row_iters, x.iters, x.updates) for x in (r, first, step)]
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_distributed_tol_rows_converge_as_if_alone(tmp_path):
    """DistributedSNLP.solve (2 gloo ranks; the last decides per row, every rank freezes the row) equals the
    single-process solve of every row alone: a plain solve, a cached prefill and the decode step after it."""
    from conftest import spawn_ranks as _spawn

    _spawn(_dist_worker, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for seed, layers, plan in DIST_CASES:
        model = make_model(seed=seed, scale=0.05, n_layer=layers)
        idx = tokens(model, B=4, T=10, seed=5)
        runs = []
        with torch.no_grad():
            for b in range(4):
                own = KVCache.for_model(model, batch=1, max_len=16)
                runs.append([solve(model, idx[b:b + 1], plan), solve(model, idx[b:b + 1, :6], plan, cache=own),
                             solve(model, idx[b:b + 1, 6:], plan, cache=own)])
        for j in range(3):
            hidden, row_iters, iters, updates = ranks[1][plan][j]
            assert torch.equal(ranks[0][plan][j][1], row_iters) and ranks[0][plan][j][3] == updates  # ranks agree
            for b in range(4):
                torch.testing.assert_close(hidden[b:b + 1], runs[b][j].hidden, **ROW, msg=f"{plan} run {j} row {b}")
                assert int(row_iters[b]) == runs[b][j].iters, (plan, j, b, row_iters)
            assert iters == int(row_iters.max()) and len(updates) == iters
        assert len({int(x) for j in range(3) for x in ranks[1][plan][j][1]}) > 1  # rows were frozen somewhere


@pytest.mark.parametrize("share", [False, True])
def test_value_embedding_gate_reads_the_weighted_norm(share):
    """norm_weights + value_embeds: the block gates its value embedding on norm(x, ln_attn)[:G]; a fused chunk gated
    on the unweighted norm (off by 0.08 at K >= C on a6631c2). K >= C, M = 1 equals the model (fp64)."""
    from snlp import bind

    m = make_model(seed=1, n_layer=4, value_embeds=True, norm_weights=True)
    with torch.no_grad():
        for b in m.blocks:
            b.ln_attn.normal_(1, 0.5, generator=torch.Generator().manual_seed(2))
        idx = torch.randint(0, m.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(bind(m, "4xF1-h0-K4", share_weights=share)(idx), m(idx), rtol=1e-12, atol=1e-12)

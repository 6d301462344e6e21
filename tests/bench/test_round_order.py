"""Every paired / round-robin timing loop rotates its order round by round (snlp.runtime.timing.round_order): with
a fixed order the row that always ran first (or always right after the same row) met caches, allocator and clocks
as that row left them, and the position's effect read as a difference between rows. The order is read off the
calls themselves: the loops' own callables (or the module's generate functions, wrapped to record, then called)."""

from __future__ import annotations

from conftest import make_model

from snlp.method.plan import Plan
from snlp.runtime.timing import time_round_robin


def recorders(names, calls: list) -> dict:
    return {n: (lambda n=n: calls.append(n)) for n in names}


def rounds_of(calls: list, n: int) -> list[list]:
    return [calls[i:i + n] for i in range(0, len(calls), n)]


def balanced(rounds: list[list], names) -> bool:
    """Each name at each position as often as any other, give or take one."""
    for pos in range(len(names)):
        counts = [sum(r[pos] == n for r in rounds) for n in names]
        if max(counts) - min(counts) > 1:
            return False
    return True


def after_each_other_alike(rounds: list[list], names) -> bool:
    """Each name right after each other one equally often (rounds: a whole period of the design)."""
    pairs = [(a, b) for a in names for b in names if a != b]
    counts = [sum(r[i] == a and r[i + 1] == b for r in rounds for i in range(len(r) - 1)) for a, b in pairs]
    return min(counts) == max(counts) > 0


def test_round_order_starts_in_the_given_order_and_balances_the_call_before():
    """A rotation by one kept the cyclic order: with three callables the second always ran right after the first (or
    first), so a cost the call before leaves (a cache it evicts) read as a gap between two equal callables. The
    Williams design puts each callable after each other one equally often (n rounds for even n, 2n for odd)."""
    from snlp.runtime.timing import round_order, rotation

    assert round_order({"a": 1, "b": 2}, 0) == ["a", "b"] and round_order({"a": 1, "b": 2}, 1) == ["b", "a"]
    assert round_order((), 5) == [] and round_order(["x"], 3) == ["x"]
    for n in range(2, 8):
        period = n if n % 2 == 0 else 2 * n
        rows = [rotation(k, n) for k in range(3 * period)]
        assert rows[0] == list(range(n)) and all(sorted(r) == list(range(n)) for r in rows)
        assert all(balanced(rows[:S], range(n)) for S in range(1, len(rows) + 1)), n
        assert after_each_other_alike(rows[:period], range(n)), n
        assert rows[period:2 * period] == rows[:period]


def test_a_cost_the_call_before_leaves_does_not_read_as_a_difference():
    """Hand arithmetic: every call costs 10, 5 more right after "a". Under a rotation by one "b" ran after "a" in
    every round it was not first: median 15 against 10, a 1.5x gap between equal callables."""
    import statistics

    from snlp.runtime.timing import round_order

    t: dict = {n: [] for n in ("seq", "a", "b")}
    for r in range(12):
        prev = None
        for n in round_order(t, r):
            t[n].append(10 + 5 * (prev == "a"))
            prev = n
    assert {n: statistics.median(v) for n, v in t.items()} == {"seq": 10, "a": 10, "b": 10}


def test_time_round_robin_changes_the_order_every_round():
    """Forward, --ops, eval's Prefill and decode timing, tune's step costs, train --time-reg, --vs-paper: one loop."""
    calls: list = []
    names = ["seq", "a", "b"]
    times = time_round_robin(recorders(names, calls), warmup=2, runs=6, device="cpu")
    assert list(times) == names and all(len(v) == 6 for v in times.values())
    timed = rounds_of(calls[2 * 3:], 3)
    assert balanced(timed, names) and after_each_other_alike(timed, names)


def test_tunes_cpu_clock_round_robin_rotates_too():
    from snlp.bench.tune import _cpu_round_robin

    calls: list = []
    _cpu_round_robin(recorders(["seq", 2, "plan"], calls), 2, 6)
    timed = rounds_of(calls[6:], 3)
    assert balanced(timed, ["seq", 2, "plan"]) and after_each_other_alike(timed, ["seq", 2, "plan"])


def test_decode_suite_rounds_rotate():
    from snlp.bench.decode_suite import DecodeSuiteRow, round_robin_calls

    calls: list = []
    fns = recorders([0, 1, 2], calls)
    rows = [DecodeSuiteRow(method=m, library="snlp", treatment="eager", batch=1) for m in "abc"]
    round_robin_calls(fns, rows, warmup=1, rounds=5, device="cpu", check=lambda i: None)
    every = rounds_of(calls, 3)  # the warm-up round is slot 0 of the design
    assert every[0] == [0, 1, 2] and balanced(every[1:], [0, 1, 2]) and after_each_other_alike(every, [0, 1, 2])


def test_decode_benchmark_rotates_sequential_snlp_and_speculative(monkeypatch):
    """`snlp bench --decode`: sequential ran first in every round."""
    import snlp.bench.decode as D

    calls: list = []
    for name in ("sequential_generate", "snlp_generate", "speculative_generate"):
        fn = getattr(D, name)
        monkeypatch.setattr(D, name, lambda *a, _n=name, _f=fn, **k: calls.append(_n) or _f(*a, **k))
    model = make_model(n_layer=4)
    D.decode_benchmark(model, [Plan.parse("2xF2-h0-K1")], prompt_len=3, new_tokens=3, blocks=(2,), warmup=1, runs=3)
    names = ["sequential_generate", "snlp_generate", "speculative_generate"]
    timed = rounds_of(calls[3:], 3)
    assert len(timed) == 3 and [r[0] for r in timed] == names and balanced(timed, names)


def test_batched_decode_benchmark_rotates(monkeypatch):
    """`snlp bench --decode --batch-sizes`: the sequential row ran first in every round."""
    import snlp.bench.decode as D

    calls: list = []
    seq, spec = D.sequential_generate, D.speculative_generate
    model = make_model(n_layer=4)
    monkeypatch.setattr(D, "sequential_generate", lambda *a, **k: calls.append("seq") or seq(*a, **k))
    monkeypatch.setattr(D, "speculative_generate", lambda *a, **k: calls.append("spec") or spec(*a, **k))
    D.batch_decode_benchmark(model, [Plan.parse("2xF2-h0-K1")], batch_sizes=(2,), prompt_len=3, new_tokens=3,
                             blocks=(2,), warmup=1, runs=4)
    timed = rounds_of(calls[-8:], 2)  # the last 4 rounds of 2 rows (the references and the warm-up come first)
    assert [r[0] for r in timed] == ["seq", "spec", "seq", "spec"]

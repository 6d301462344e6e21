"""Every paired / round-robin timing loop rotates its order round by round (snlp.runtime.timing.round_order): with
a fixed order the row that always ran first (or always right after the same row) met caches, allocator and clocks
as that row left them, and the position's effect read as a difference between rows. The order is read off the
calls themselves: the loops' own callables (or the module's generate functions, wrapped to record, then called)."""

from __future__ import annotations

import statistics

import pytest
import torch
from conftest import make_model

from snlp.method.plan import Plan
from snlp.runtime.timing import round_order, time_round_robin


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


# ----- the paired loops that had no test of their own: each call is a fake that logs its name and returns a time
# that encodes its round, so a ratio taken from two different rounds would differ from the same round's -----

def round_of(calls: list, per_round: int) -> int:
    """The round the call just logged ran in (`per_round` calls a round)."""
    return (len(calls) - 1) // per_round


def test_tunes_snlp_stage_rotates_and_pairs_each_round(monkeypatch):
    """`snlp tune`'s SNLP stage (measure_snlp): sequential and every candidate, round-robin over the prompts, the
    order rotated per prompt slot; a candidate's round_speedups[i] is round i's sequential over round i's own time
    (round r's calls take 10^r s: a ratio across rounds would be off by powers of ten)."""
    import snlp.bench.tune as T
    from snlp.decode.session import GenerateResult

    model = make_model(n_layer=4, dtype=torch.float32)
    plans, speed = ["2xF1-h0-K1", "2xF2-h0-K1"], {None: 1.0, "2xF1-h0-K1": 2.0, "2xF2-h0-K1": 4.0}
    prompts, warmup, repeats = [[1, 2], [3, 4]], 1, 4
    calls: list = []

    def timed(key):
        calls.append(key)
        r = round_of(calls, len(prompts) * len(speed))
        return GenerateResult(tokens=[7], mode="x", decode_s=10.0 ** r / speed[key])

    monkeypatch.setattr(T, "sequential_generate", lambda model, p, n, step=None: timed(None))
    monkeypatch.setattr(T, "snlp_generate", lambda model, p, plan, n, step=None: timed(plan))
    monkeypatch.setattr(T, "sequential_step", lambda *a, **k: None)
    monkeypatch.setattr(T, "snlp_step", lambda *a, **k: None)
    cands = [T.Candidate(goal="snlp", plan=p, block=None, threads=1, compiled=False, top1=None, delta_ppl=0.0,
                         accept_alpha=None, predicted_tokens_per_round=None, s=1.0, predicted_speedup=1.0,
                         predicted_tokens_per_s=1.0) for p in plans]
    T.measure_snlp(model, prompts, cands, T.TuneConfig(warmup=warmup, repeats=repeats, gen_tokens=1))
    slots = rounds_of(calls, len(speed))
    assert len(slots) == (warmup + repeats) * len(prompts)
    assert slots == [round_order([None, *plans], k) for k in range(len(slots))]  # slot = round x prompts + prompt
    assert balanced(slots, list(speed))
    for c in cands:
        assert c.round_speedups == pytest.approx([speed[c.plan]] * repeats, rel=1e-12), c.round_speedups


def test_forward_breakdowns_pair_rotates_and_drops_the_warm_up_rounds(monkeypatch):
    """snlp.bench.breakdown.forward_breakdown: the sequential / SNLP pair whose ratio is read runs in a rotated
    order, and the warm-up rounds' times are the ones dropped (round r's calls take r + 1 ms on a fake clock that
    only they advance)."""
    import types

    import snlp.bench.breakdown as B

    model = make_model(n_layer=4, dtype=torch.float32)
    clock, calls = [0.0], []
    warmup, runs = 2, 5
    forward, bind = model.forward, B.bind

    class Ticking:
        """`fn` (its attributes too), each call of the loop logged and advancing the clock by cost x (round + 1) ms."""

        def __init__(self, name, fn, cost):
            self.name, self.fn, self.cost = name, fn, cost

        def __getattr__(self, attr):
            return getattr(self.fn, attr)

        def __call__(self, *a, **k):
            if len(calls) < 2 * (warmup + runs):  # the loop's calls (count_ops calls them again after it)
                calls.append(self.name)
                clock[0] += self.cost * (round_of(calls, 2) + 1) / 1e3
            return self.fn(*a, **k)

    monkeypatch.setattr(model, "forward", Ticking("seq", forward, 1.0))
    monkeypatch.setattr(B, "bind", lambda *a, **k: Ticking("snlp", bind(*a, **k), 0.5))
    monkeypatch.setattr(B, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    bd = B.forward_breakdown(model, "2xF1-h0-K1", seq_len=4, runs=runs, warmup=warmup)
    slots = rounds_of(calls, 2)
    assert [s[0] for s in slots] == ["seq", "snlp"] * 3 + ["seq"]
    timed = range(warmup + 1, warmup + runs + 1)  # rounds 2..6 take 3..7 ms: median 5 (warm-ups' 1, 2 dropped)
    assert bd.seq_ms == pytest.approx(statistics.median(timed)) and bd.snlp_ms == pytest.approx(statistics.median(timed) / 2)


class FakeRunner:
    """DistributedSNLP's face to the decode loops: generate() logs its mode and takes 10^r s in round r."""

    def __init__(self, model, calls: list, per_round: int, speed: dict, rank: int = 0):
        self.model, self.calls, self.per_round, self.speed = model, calls, per_round, speed
        self.device, self.rank, self.S = "cpu", rank, 0

    def generate(self, prompt, mode, *a, block=None, **kw):
        from snlp.decode.session import GenerateResult

        self.calls.append((mode, block if mode == "speculative" else 0))
        r = round_of(self.calls, self.per_round)
        return GenerateResult(tokens=[7], mode=mode, decode_s=10.0 ** r / self.speed[mode], rounds=1)

    def memory(self, cache=None, max_len=None) -> dict:  # DistributedSNLP.memory's signature
        return {"total_bytes": 0}

    def pipeline_forward(self, idx):
        return None

    def solve(self, idx, **kw):
        return None


@pytest.fixture
def one_rank(monkeypatch):
    """A gloo group of one rank in this process (torchrun's environment), torn down after."""
    import torch.distributed as dist
    from conftest import free_port

    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(k, v)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_distributed_benchmarks_decode_rounds_rotate_and_pair(one_rank, monkeypatch):
    """`snlp bench --distributed --decode` (distributed_benchmark): sequential, snlp and speculative rotate round by
    round, and each mode's ms_per_token_runs[i] sits beside the sequential row's run i of the same round."""
    import snlp.dist.layer_parallel as LP

    LP.init_distributed()
    model = make_model(n_layer=4, dtype=torch.float32)
    calls: list = []
    speed = {"sequential": 1.0, "snlp": 2.0, "speculative": 4.0}
    monkeypatch.setattr(LP, "DistributedSNLP", lambda m, plan, **k: FakeRunner(m, calls, 3, speed))
    warmup, runs = 1, 4
    recs = LP.distributed_benchmark(lambda: model, [Plan.parse("2xF1-h0-K1")], tokens=4, batch=1, warmup=warmup,
                                    runs=runs, seed=0, decode=True, new_tokens=1, blocks=(3,))
    slots = rounds_of([m for m, _ in calls], 3)
    assert slots == [round_order(["sequential", "snlp", "speculative"], i) for i in range(warmup + runs)]
    for rec in (r for r in recs if r["what"] == "decode"):
        paired = [s / m for s, m in zip(rec["sequential_ms_per_token_runs"], rec["ms_per_token_runs"])]
        assert paired == pytest.approx([speed[rec["mode"]]] * runs, rel=1e-12), (rec["mode"], paired)


def test_distributed_generates_timed_pair_rotates_and_pairs(one_rank, monkeypatch, tmp_path, capsys):
    """`snlp generate --distributed --mode speculative`: the timed rounds run pipelined sequential and speculative
    in a rotated order, and each ratio is one round's pair (round r takes 10^r s: a cross-round pair would put
    powers of ten into the ratios' range)."""
    import json

    import torch

    import snlp.apps.dist as D
    from conftest import text_checkpoint

    from snlp.apps.cli import main

    ck, _, _ = text_checkpoint(tmp_path)
    calls: list = []
    speed = {"sequential": 1.0, "speculative": 3.0}
    made = []

    def runner(model, plan, **k):
        made.append(FakeRunner(model, calls, 2, speed))
        return made[-1]

    monkeypatch.setattr(D, "DistributedSNLP", runner)
    out = tmp_path / "g.json"
    assert main(["generate", str(ck), "--distributed", "--plan", "2xF1-h0-K1", "--mode", "speculative", "--prompt",
                 "All:", "--max-new-tokens", "2", "--repeats", "5", "--quiet", "--json", str(out)]) == 0, \
        capsys.readouterr().err
    timed = [m for m, _ in calls][2:]  # after the baseline and the streamed run (round 0, warming both sides)
    assert [timed[i] for i in range(0, len(timed), 2)] == ["sequential", "speculative"] * 2 + ["sequential"]
    rec = json.loads(out.read_text())
    assert rec["repeats"] == 5 and rec["speedup_range"] == pytest.approx([3.0, 3.0], rel=1e-12)
    assert rec["measured_speedup"] == pytest.approx(3.0, rel=1e-12)
    # the record keeps every timed run of both sides and the paired ratios, so its medians and verdict can be
    # recomputed from it (it kept the range alone)
    from statistics import median

    seq, spec = rec["pipeline_sequential_tokens_per_s_runs"], rec["speculative_tokens_per_s_runs"]
    assert len(seq) == len(spec) == 5 and rec["speedup_rounds"] == pytest.approx([b / a for a, b in zip(seq, spec)])
    assert (median(seq), median(spec), median(rec["speedup_rounds"])) == pytest.approx(
        (rec["pipeline_sequential_tokens_per_s"], rec["speculative_tokens_per_s"], rec["measured_speedup"]))
    assert torch.distributed.is_initialized() is False

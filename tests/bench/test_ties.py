"""A ratio a `snlp bench` table prints is a result only where its paired rounds resolve it: the forward benchmark
(random weights and --ckpt), --decode (and its batched rows), --suite paper and --vs-paper mark each speedup with the
sign test's verdict over the per-round ratios (snlp.bench.stats.paired_verdict) in the records and "(tie)" in the
tables, with a footnote saying the rule. The timings here are fabricated (the round-robin timer replaced), so the
verdicts are known by hand: the sign test's p of w wins and l losses is 2 * sum_{i >= max(w, l)} C(n, i) / 2^n."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from conftest import make_model

from snlp.apps.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: threads only add contention

TINY = ["--depth", "4", "--width", "32", "--head-dim", "16", "--vocab-size", "97", "--warmup", "0", "--runs", "8"]
# 8 paired rounds. TIE: the plan's median (5 ms) is half sequential's (10 ms), a 2.00x speedup of medians, but it won
# only 5 of 8 rounds: p = 2 (C(8,5) + C(8,6) + C(8,7) + C(8,8)) / 256 = 0.727, no lead. FAST: 8 of 8, p = 2 / 256.
SEQ = [10.0] * 8
TIE = [5.0, 5.0, 5.0, 5.0, 5.0, 12.0, 12.0, 12.0]
FAST = [5.0] * 8


def fake_round_robin(plans: dict[str, list[float]]):
    """A time_round_robin that returns these per-round times (ms) instead of timing: sequential SEQ, each plan its
    own list, embed and head 1 ms."""
    def timed(fns, warmup, runs, device):
        assert runs == 8
        return {name: list({"sequential": SEQ, "_embed": [1.0] * 8, "_head": [1.0] * 8, **plans}[name])
                for name in fns}
    return timed


@pytest.fixture
def fabricated(monkeypatch):
    import snlp.bench.forward as forward

    monkeypatch.setattr(forward, "time_round_robin", fake_round_robin({"1xF2-h0-K1": TIE, "2xF1-h0-K1": FAST}))


def _check_forward(path, out: str) -> None:
    recs = {r["plan"]: r for r in json.loads(path.read_text())}
    tie, fast, seq = recs["1xF2-h0-K1"], recs["2xF1-h0-K1"], recs["sequential"]
    assert tie["speedup"] == pytest.approx(2.0) and fast["speedup"] == pytest.approx(2.0)  # the same median ratio
    assert (tie["speedup_verdict"], tie["speedup_wins"], tie["speedup_losses"]) == ("tie", 5, 3)
    assert tie["speedup_p"] == pytest.approx(2 * (56 + 28 + 8 + 1) / 256)
    assert (fast["speedup_verdict"], fast["speedup_wins"], fast["speedup_losses"]) == ("faster", 8, 0)
    assert fast["speedup_p"] == pytest.approx(2 / 256)
    assert tie["times_ms"] == TIE and tie["speedup_rounds"] == [s / t for s, t in zip(SEQ, TIE)]
    assert seq["times_ms"] == SEQ and seq["speedup_verdict"] is None and seq["speedup_rounds"] is None
    lines = out.splitlines()
    row = lambda plan: next(ln for ln in lines if f" {plan} " in ln)  # noqa: E731
    assert "2.00x (tie)" in row("1xF2-h0-K1") and "2.00x" in row("2xF1-h0-K1") and "(tie)" not in row("2xF1-h0-K1")
    assert "(tie)" not in row("sequential")
    # the footnote: the rule, and what 8 rounds can resolve (7 of 8: p = 2 x 9 / 256 = 0.07; 8 of 8: 0.008)
    note = next(ln for ln in lines if ln.startswith("(tie):"))
    assert "two-sided sign test at 5 %" in note and "8 rounds resolve one at 8 of 8" in note and "6 of 6" in note


def test_forward_speedups_carry_the_sign_tests_verdict(fabricated, tmp_path, capsys):
    out = tmp_path / "f.json"
    assert main(["bench", *TINY, "--tokens", "2", "--plans", "1xF2-h0-K1,2xF1-h0-K1", "--json", str(out)]) == 0
    _check_forward(out, capsys.readouterr().out)


def test_a_checkpoints_forward_speedups_carry_it_too(fabricated, tmp_path, capsys):
    from snlp.io.checkpoint import save_checkpoint

    ckpt = save_checkpoint(tmp_path / "ck", make_model(n_layer=4, dtype=torch.float32))
    out = tmp_path / "f.json"
    assert main(["bench", "--ckpt", str(ckpt), "--warmup", "0", "--runs", "8", "--tokens", "2",
                 "--plans", "1xF2-h0-K1,2xF1-h0-K1", "--json", str(out)]) == 0
    _check_forward(out, capsys.readouterr().out)


DECODE = ["bench", "--decode", "--depth", "4", "--width", "32", "--head-dim", "16", "--vocab-size", "97",
          "--plans", "2xF1-h0-K1", "--blocks", "2", "--new-tokens", "4", "--prompt-len", "4", "--warmup", "0"]


def test_decode_speedups_carry_the_verdict_and_three_runs_are_a_tie(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main([*DECODE, "--runs", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    recs = json.loads(out.read_text())
    seq = recs[0]
    assert seq["speedup_verdict"] is None and len(seq["ms_per_token_runs"]) == 3
    assert seq["ms_per_token"] == pytest.approx(statistics.median(seq["ms_per_token_runs"]))
    for r in recs[1:]:  # 3 paired runs never resolve a lead (6 of 6 at the fewest): every ratio is a tie
        assert r["speedup_rounds"] == pytest.approx([a / b for a, b in zip(seq["ms_per_token_runs"],
                                                                           r["ms_per_token_runs"])])
        assert r["speedup_verdict"] == "tie" and r["speedup_wins"] + r["speedup_losses"] <= 3
    spec = recs[-1]
    assert spec["mode"] == "speculative" and len(spec["drafter_speedup_rounds"]) == 3
    assert spec["drafter_speedup_verdict"] == "tie"
    assert f"{recs[1]['speedup']:.2f}x (tie)" in text
    assert "3 rounds never resolve one (6 of 6 at the fewest), so every speedup or s here is marked (tie)" in text


def test_a_decode_speedup_the_runs_resolve_has_no_tie(monkeypatch, tmp_path, capsys):
    """Sequential decoding made 10x slower in every run (its decode time scaled): all 6 paired runs won, p = 2 / 64."""
    import snlp.bench.decode as decode

    real = decode.sequential_generate

    def slow(*a, **kw):
        res = real(*a, **kw)
        res.decode_s *= 10
        return res

    monkeypatch.setattr(decode, "sequential_generate", slow)
    out = tmp_path / "d.json"
    assert main([*DECODE, "--runs", "6", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    snlp = json.loads(out.read_text())[1]
    assert snlp["mode"] == "snlp" and (snlp["speedup_verdict"], snlp["speedup_wins"]) == ("faster", 6)
    assert snlp["speedup_p"] == pytest.approx(2 / 64)
    row = next(ln for ln in text.splitlines() if " snlp " in ln)
    assert f"{snlp['speedup']:.2f}x" in row and "(tie)" not in row


def test_batched_decode_rows_carry_the_verdict(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main([*DECODE, "--runs", "2", "--batch-sizes", "1,2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    recs = json.loads(out.read_text())
    for r in recs:
        base = next(b for b in recs if b["batch"] == r["batch"] and b["mode"] == "sequential")
        assert len(r["tokens_per_s_runs"]) == 2
        if r["mode"] == "sequential":
            assert r["speedup_verdict"] is None
        else:
            assert r["speedup_rounds"] == pytest.approx([a / b for a, b in zip(r["tokens_per_s_runs"],
                                                                               base["tokens_per_s_runs"])])
            assert r["speedup_verdict"] == "tie"
    assert "(tie)" in text and "2 rounds never resolve one" in text


def test_the_paper_suites_table_marks_its_ties(monkeypatch):
    """The suite's speedup table, from prefill rows whose rounds are fabricated: a tie is marked, a resolved speedup
    is not, and the records keep each round's times."""
    import snlp.bench.forward as forward
    from snlp.bench.forward import benchmark
    from snlp.bench.suite import PAPER_SHAPES, SuiteConfig, SuiteMeta, SuiteResult, SuiteRow, ShapeInfo, markdown
    from snlp.method.plan import Plan
    from snlp.model.gpt import GPT

    shape = next(s for s in PAPER_SHAPES if s.key == "3B")  # plans 8xF1-h0-K1 and 8xF1-h0-K4
    small = shape.quick()
    monkeypatch.setattr(forward, "time_round_robin", fake_round_robin({shape.plans[0]: TIE, shape.plans[1]: FAST}))
    model = GPT(small.config(97, "L", 4, 32))
    model.init_weights(seed=0)
    rows = benchmark(model, [Plan.parse(p, small.depth) for p in shape.plans], tokens=2, warmup=0, runs=8)
    cfg = SuiteConfig(quick=True, shapes=("3B",), treatments=("eager",), decode=False, runs=8).resolved()
    info = ShapeInfo(shape="3B", shape_title=shape.title, n_layer=small.depth, n_embd=small.width, n_head=2,
                     hc_streams=0, x0=True, ve=True, vocab_size=97, model_bytes=0)
    result = SuiteResult(config=cfg, meta=SuiteMeta.now(cfg), records=[SuiteRow("prefill", "eager", info, r)
                                                                       for r in rows], complete=True)
    text = markdown(result)
    row = lambda plan: next(ln for ln in text.splitlines() if f"`{plan}`" in ln)  # noqa: E731
    assert "| 2.00x (tie) |" in row(shape.plans[0]) and "(tie)" not in row(shape.plans[1])
    assert "| 2.00x |" in row(shape.plans[1])
    assert "8 rounds resolve one at 8 of 8" in text and "decode speedup" not in text  # no decode rows ran
    rec = result.records[1].to_dict()
    assert rec["times_ms"] == TIE and rec["speedup_verdict"] == "tie" and rec["kind"] == "prefill"


def test_vs_paper_ratios_carry_the_verdict():
    """The --vs-paper table's three ratios from fabricated rows of one shape's round-robin (no paper code needed):
    each marked "(tie)" where its rounds do not resolve it, and the JSON's "ratios" hold the rounds and verdicts."""
    from snlp.bench.paper_peer import summarise
    from snlp.bench.vs_paper import VsPaperConfig, VsPaperResult, markdown, paired_ratios

    cfg = VsPaperConfig(paper="unused", shapes=("0.5B-mhc",), runs=8, warmup=0).resolved()  # one plan, 16xF1-h0-K1-hcn
    plan = "16xF1-h0-K1-hcn"
    times = {"paper/sequential": [20.0] * 8, f"paper/{plan}": TIE, "snlp/sequential": SEQ,
             f"snlp/{plan}": [4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]}
    meta = {"paper/sequential": ("paper", "sequential", "as published", ""),
            f"paper/{plan}": ("paper", plan, "as published", ""),
            "snlp/sequential": ("snlp", "sequential", "eager", ""), f"snlp/{plan}": ("snlp", plan, "eager", "")}
    res = VsPaperResult(config=cfg, meta=dict(weights="random", dtype="float32", device="cpu", torch="t", cuda=None,
                                              date="d", paper_root="p", paper_stubs=[]),
                        rows=summarise("0.5B-mhc", times, meta), complete=True)
    ratios = {(r["plan"], r["ratio"]): r for r in paired_ratios(res)}
    # paper's speedup: 20 / TIE (4 of 8 rounds at 20 / 5, 3 at 20 / 12; all > 1): faster, 8 of 8
    assert ratios[(plan, "paper_speedup")]["verdict"] == "faster"
    # paper ms / snlp ms: TIE / 4 -> 5 rounds at 1.25x, 3 at 3x: faster 8 of 8; snlp vs the strongest sequential
    # (snlp's own, 10 ms): 10 / 4, faster; sequential paper / snlp: 20 / 10, faster
    assert ratios[(plan, "paper_over_snlp")]["verdict"] == "faster"
    tie = VsPaperResult(config=cfg, meta=res.meta, complete=True, rows=summarise("0.5B-mhc", dict(
        times, **{f"snlp/{plan}": [4.0, 4.0, 4.0, 4.0, 4.0, 13.0, 13.0, 13.0]}), meta))
    t = {(r["plan"], r["ratio"]): r for r in paired_ratios(tie)}
    # paper / snlp now 5 rounds 1.25x, 3 rounds 12 / 13 < 1: 5 of 8, p = 0.727: a tie though the medians say 1.25x
    assert (t[(plan, "paper_over_snlp")]["verdict"], t[(plan, "paper_over_snlp")]["wins"]) == ("tie", 5)
    assert t[(plan, "paper_over_snlp")]["value"] == pytest.approx(1.25)
    assert t[(plan, "paper_over_snlp")]["rounds"] == pytest.approx([a / b for a, b in zip(
        TIE, [4.0] * 5 + [13.0] * 3)])
    assert t[(plan, "snlp_vs_strongest_seq")]["verdict"] == "tie"  # 10 / (4 x 5, 13 x 3)
    row = next(ln for ln in markdown(tie).splitlines() if ln.startswith(f"| 0.5B-mhc | `{plan}`"))
    assert "| 1.25x (tie) |" in row and "| 4.00x |" in row  # the paper's own speedup 20 / 5 resolved
    assert "(tie)" not in next(ln for ln in markdown(res).splitlines() if ln.startswith(f"| 0.5B-mhc | `{plan}`"))
    assert "8 rounds resolve one at 8 of 8" in markdown(tie)


def test_vs_paper_ratios_say_which_side_their_verdict_calls_faster(tmp_path):
    """A ratio is numerator ms / denominator ms and its verdict is paired_verdict's (baseline over method): "faster"
    means the DENOMINATOR is faster, which the JSON did not say. Each entry names the faster side, and the file
    says how to read the verdict beside the entries."""
    from snlp.bench.paper_peer import summarise
    from snlp.bench.vs_paper import VsPaperConfig, VsPaperResult, _write, paired_ratios

    cfg = VsPaperConfig(paper="unused", shapes=("0.5B-mhc",), runs=8, warmup=0, out=str(tmp_path)).resolved()
    plan = "16xF1-h0-K1-hcn"
    times = {"paper/sequential": [20.0] * 8, f"paper/{plan}": [30.0] * 8, "snlp/sequential": SEQ,
             f"snlp/{plan}": [4.0] * 5 + [13.0] * 3}
    meta = {"paper/sequential": ("paper", "sequential", "as published", ""),
            f"paper/{plan}": ("paper", plan, "as published", ""),
            "snlp/sequential": ("snlp", "sequential", "eager", ""), f"snlp/{plan}": ("snlp", plan, "eager", "")}
    res = VsPaperResult(config=cfg, meta=dict(weights="random", dtype="float32", device="cpu", torch="t", cuda=None,
                                              date="d", paper_root="p", paper_stubs=[]),
                        rows=summarise("0.5B-mhc", times, meta), complete=True)
    r = {(x["plan"], x["ratio"]): x for x in paired_ratios(res)}
    over = r[(plan, "paper_over_snlp")]  # 30 ms / snlp's 4 or 13: snlp, the denominator, faster every round
    assert over["verdict"] == "faster" and over["faster_side"] == over["denominator"] == f"snlp {plan} eager"
    own = r[(plan, "paper_speedup")]  # the paper's sequential 20 ms / its plan's 30 ms: the numerator faster
    assert own["verdict"] == "slower" and own["faster_side"] == own["numerator"] == "paper sequential as published"
    assert r[(plan, "snlp_vs_strongest_seq")]["verdict"] == "tie" and r[(plan, "snlp_vs_strongest_seq")][
        "faster_side"] is None
    _write(res, cfg)
    data = json.loads((tmp_path / "vs_paper.json").read_text())
    assert "verdict 'faster': the DENOMINATOR is faster" in data["ratios_note"] and data["ratios"][0]["faster_side"]


FABRICATED_OPS = {"forward": [1.0] * 8, "fd": [2.0] * 8, "jvp": [0.5] * 5 + [1.5] * 3, "vjp": [3.0] * 8,
                  "fd_extra": [1.2] * 8}


def fabricated_ops(monkeypatch, tmp_path) -> dict:
    """`snlp bench --ops` on FABRICATED_OPS's round times (ms per round of each op): its JSON record."""
    import snlp.bench.ops as ops

    monkeypatch.setattr(ops, "time_round_robin", lambda fns, warmup, runs, device: {k: FABRICATED_OPS[k] for k in fns})
    out = tmp_path / "ops.json"
    assert main(["bench", "--ops", *TINY, "--tokens", "2", "--json", str(out)]) == 0
    return json.loads(out.read_text())[0]


def test_op_ratios_to_the_forward_carry_the_verdict(monkeypatch, tmp_path, capsys):
    """--ops: each op's cost over the forward's, from the same rounds: JVP's median ratio 0.50x from 5 of 8 rounds
    cheaper is a tie (p = 0.727); FD at 2x in all 8 rounds costs more (p = 2 / 256)."""
    rec = fabricated_ops(monkeypatch, tmp_path)
    assert rec["times_ms"] == FABRICATED_OPS and rec["jvp_ratio"] == pytest.approx(0.5)
    assert (rec["jvp_ratio_verdict"], rec["fd_ratio_verdict"]) == ("tie", "more")
    assert rec["jvp_ratio_p"] == pytest.approx(2 * (56 + 28 + 8 + 1) / 256) and rec["fd_ratio_p"] == pytest.approx(2 / 256)
    text = capsys.readouterr().out
    assert "0.500 (0.50x (tie))" in text and "2.000 (2.00x)" in text and "8 rounds resolve one at 8 of 8" in text


# A printed speedup is the ratio of the two medians; the sign test reads the paired rounds one by one. The two can fall
# on opposite sides of 1.00x: sequential slow (30 ms) in the 5 rounds the plan ran in 1 ms, the plan 0.5 ms slower in
# the other 15. Medians 19.5 ms / 15 ms = 1.30x, yet the plan lost 15 of 20 rounds (p = 0.041: resolved "slower").
SEQ20 = [10.0 + i for i in range(15)] + [30.0] * 5
SLOWER20 = [10.5 + i for i in range(15)] + [1.0] * 5


def test_a_speedup_whose_rounds_resolve_the_other_side_says_so(monkeypatch, tmp_path, capsys):
    """The forward table printed "1.30x" bare beside a record whose verdict is "slower" (15 of 20 rounds lost): a
    cell that read as a resolved 30 % gain. The cell now names the rounds' side of 1.00x, and the footnote says why."""
    from scipy.stats import binomtest

    import snlp.bench.forward as forward

    def timed(fns, warmup, runs, device):
        return {n: list({"sequential": SEQ20, "1xF2-h0-K1": SLOWER20}.get(n, [1.0] * 20)) for n in fns}

    monkeypatch.setattr(forward, "time_round_robin", timed)
    out = tmp_path / "f.json"
    argv = [a if a != "8" else "20" for a in TINY]
    assert main(["bench", *argv, "--tokens", "2", "--plans", "1xF2-h0-K1", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())[1]
    assert rec["speedup"] == pytest.approx(19.5 / 15.0)  # the ratio of medians: above 1
    assert (rec["speedup_verdict"], rec["speedup_wins"], rec["speedup_losses"]) == ("slower", 5, 15)
    assert rec["speedup_p"] == pytest.approx(binomtest(5, 20, 0.5).pvalue)
    text = capsys.readouterr().out
    row = next(ln for ln in text.splitlines() if " 1xF2-h0-K1 " in ln)
    assert "1.30x (15 of 20 rounds below 1.00x)" in row
    assert "on the other side of 1.00x" in text  # the footnote explains the mark


def test_the_mark_follows_the_rounds_against_a_ratio_of_medians():
    """tie_mark with the printed value: (tie) where the sign test does not resolve the rounds; the rounds' side where it
    resolves them against the value's side of 1.00x; nothing where both agree (either orientation of the ratio)."""
    from snlp.bench.stats import tie_mark

    rounds = [s / t for s, t in zip(SEQ20, SLOWER20)]
    assert tie_mark(rounds, 1.3) == " (15 of 20 rounds below 1.00x)"
    assert tie_mark(rounds, 0.9) == ""  # agrees: slower, printed below 1
    assert tie_mark([1.0 / r for r in rounds], 1 / 1.3) == " (15 of 20 rounds above 1.00x)"  # an op / forward ratio
    assert tie_mark(rounds[10:16], 1.3) == " (tie)"  # 5 below of 6 rounds: p = 0.22
    assert tie_mark(rounds) == ""  # no value: only ties are marked, as before
    assert tie_mark([1.0] * 20, 1.0) == " (tie)"  # every round an exact tie: nothing resolved


def test_s_and_the_op_ratios_keep_wins_losses_and_p_like_every_speedup(monkeypatch, tmp_path):
    """Every bench ratio's record carries its sign test (verdict, wins, losses, p); s kept only a verdict and the op
    ratios a verdict and p. Checked against a hand count of the recorded rounds and scipy's binomial test."""
    from scipy.stats import binomtest

    out = tmp_path / "d.json"
    assert main(["bench", "--decode", *TINY[:8], "--warmup", "0", "--runs", "3", "--plans", "2xF1-h0-K1",
                 "--blocks", "2", "--new-tokens", "4", "--json", str(out)]) == 0
    spec = next(r for r in json.loads(out.read_text()) if r["mode"] == "speculative")
    rounds = spec["drafter_speedup_rounds"]
    above, below = sum(x > 1 for x in rounds), sum(x < 1 for x in rounds)
    assert (spec["drafter_speedup_wins"], spec["drafter_speedup_losses"]) == (above, below)
    assert spec["drafter_speedup_p"] == pytest.approx(binomtest(max(above, below), above + below, 0.5).pvalue)

    rec = fabricated_ops(monkeypatch, tmp_path)
    assert (rec["jvp_ratio_wins"], rec["jvp_ratio_losses"]) == (3, 5)  # costs more than the forward in 3 rounds
    assert (rec["fd_ratio_wins"], rec["fd_ratio_losses"]) == (8, 0)


def test_the_spreads_rule_calls_separated_spreads_over_too_few_timings_a_tie():
    """With 3 timings a side the p10-p90 is nearly the min-max, and two sides' min-max ranges separate by chance one
    time in ten (the rank-sum test's exact p = 2 / C(6, 3) = 0.1): the spreads rule called such a pair a difference
    (`bench --suite train --quick` times 3 steps a row). Given the counts it is a tie; from 4 a side (p = 0.029) it
    is not, and without counts the rule is as before."""
    from scipy.stats import mannwhitneyu

    from snlp.bench.stats import p10_p90, spread_verdict

    for n, tie in ((2, True), (3, True), (4, False), (20, False)):
        a, b = [10.0 + i for i in range(n)], [100.0 + i for i in range(n)]  # every a below every b
        assert mannwhitneyu(a, b, method="exact").pvalue >= 0.05 if tie else \
            mannwhitneyu(a, b, method="exact").pvalue < 0.05
        assert spread_verdict(*p10_p90(b), *p10_p90(a), n, n)[2] is tie
        assert spread_verdict(*p10_p90(b), *p10_p90(a))[2] is False  # no counts: the spreads alone


def test_rank_sum_p_is_the_exact_mann_whitney_p():
    """rank_sum_p against two outside references: scipy's exact Mann-Whitney p, and a naive count over every split
    of the pooled timings into sides of n and m (the null distribution the exact test is defined by)."""
    import itertools
    import random

    from scipy.stats import mannwhitneyu

    from snlp.bench.stats import rank_sum_p, separation_p

    rng = random.Random(0)
    for n, m in ((1, 1), (1, 4), (3, 3), (4, 4), (5, 3), (6, 7)):
        for _ in range(5):
            a = [rng.random() + rng.choice((0.0, 0.5)) for _ in range(n)]
            b = [rng.random() for _ in range(m)]
            assert rank_sum_p(a, b) == pytest.approx(mannwhitneyu(a, b, alternative="two-sided", method="exact").pvalue,
                                                     abs=1e-12)
            pooled, u = a + b, sum(x > y for x in a for y in b)
            us = [sum(pooled[i] > pooled[j] for i in s for j in range(n + m) if j not in s)
                  for s in itertools.combinations(range(n + m), n)]
            naive = 2 * min(sum(v <= u for v in us), sum(v >= u for v in us)) / len(us)
            assert rank_sum_p(a, b) == pytest.approx(min(1.0, naive), abs=1e-12)
    assert rank_sum_p([2.0] * 4, [1.0] * 4) == pytest.approx(separation_p(4, 4))
    assert rank_sum_p([], [1.0]) == 1.0


def naive_rank_sum_p(a: list[float], b: list[float]) -> float:
    """The exact two-sided rank-sum p by definition: U (pairs a > b, an equal pair counting half) of every split of
    the pooled timings themselves into sides of len(a) and len(b), against the U seen."""
    import itertools

    pooled, n = [*a, *b], len(a)
    u_of = lambda x, y: sum((p > q) + 0.5 * (p == q) for p in x for q in y)  # noqa: E731
    u = u_of(a, b)
    us = [u_of([pooled[i] for i in s], [pooled[j] for j in range(len(pooled)) if j not in s])
          for s in itertools.combinations(range(len(pooled)), n)]
    return min(1.0, 2 * min(sum(v <= u for v in us), sum(v >= u for v in us)) / len(us))


def test_rank_sum_p_with_equal_timings_is_the_exact_p_over_the_splits_of_those_timings():
    """Equal timings (a coarse clock, rounded records): rank_sum_p took the untied null distribution at the
    half-counted U, which understates p, and called a lead where the splits of the timings themselves do not
    (0.048 against 0.071: prefill's sides below, a 1.04-1.47x range clear of 1 read as a speedup). Reference: the
    naive count over every split of the pooled timings."""
    import random

    from snlp.bench.stats import rank_sum_p, unpaired_verdict

    seq, snlp = [13.0, 16.0, 13.0], [11.0, 11.0, 10.0, 13.0, 12.0, 12.0]
    assert rank_sum_p(seq, snlp) == pytest.approx(naive_rank_sum_p(seq, snlp), abs=1e-12)
    assert naive_rank_sum_p(seq, snlp) > 0.05
    lo, hi, tie = unpaired_verdict(seq, snlp)
    assert lo > 1.0 and tie is True
    rng = random.Random(3)
    for _ in range(200):
        a = [float(rng.randint(0, 4)) for _ in range(rng.randint(1, 6))]
        b = [float(rng.randint(0, 4)) for _ in range(rng.randint(1, 6))]
        assert rank_sum_p(a, b) == pytest.approx(naive_rank_sum_p(a, b), abs=1e-12), (a, b)
    # past TIED_EXACT_WORK: the normal limit with the ties' variance correction, scipy's asymptotic p
    from scipy.stats import mannwhitneyu

    from snlp.runtime.stats import TIED_EXACT_WORK

    a = [float(rng.randint(0, 40)) for _ in range(300)]
    b = [float(rng.randint(3, 43)) for _ in range(280)]
    s, big = min(len(a), len(b)), len(a) + len(b)  # the exact table's entries, once per distinct timing
    assert len(set(a) | set(b)) * (s + 1) * (2 * s * big + 1) > TIED_EXACT_WORK
    assert rank_sum_p(a, b) == pytest.approx(mannwhitneyu(a, b, method="asymptotic").pvalue, abs=1e-12)
    assert rank_sum_p([1.0] * 200, [1.0] * 200) == 1.0


def test_rank_sum_p_with_equal_timings_and_one_short_side_is_exact():
    """The normal limit took every tied split of more than 2,500 pairs, however short one side was: 1 timing above
    2,501 others (two of them equal) got p = 0.083, a tie, where the splits of these timings give 2/2502 and the
    same timings all distinct gave that exact p (a lead); its error is of the order of 1/sqrt of the shorter side,
    not of the pairs. Reference: every split of the pooled timings into 1 or 2 and the rest, by their midranks
    (scipy's rankdata), counted directly."""
    import numpy as np
    from scipy.stats import rankdata

    from snlp.bench.stats import rank_sum_p

    def naive(a, b):  # the exact two-sided p over every split, by the first side's midrank sum
        mid = rankdata([*a, *b])
        r = mid[:len(a)].sum()
        sums = mid if len(a) == 1 else (mid[:, None] + mid[None, :])[np.triu_indices(len(mid), 1)]
        return min(1.0, 2 * min((sums <= r + 1e-9).sum(), (sums >= r - 1e-9).sum()) / len(sums))

    b = [float(i) for i in range(2500)] + [7.0]
    assert rank_sum_p([3000.0], b) == pytest.approx(naive([3000.0], b), abs=1e-12) == pytest.approx(2 / 2502)
    assert rank_sum_p(b, [3000.0]) == pytest.approx(2 / 2502)
    assert rank_sum_p([3000.0], b[:-1] + [2500.0]) == pytest.approx(2 / 2502)  # all distinct: the same p
    rng = np.random.default_rng(5)
    for n, m in ((1, 2600), (2, 1300)):
        a = [float(x) for x in rng.integers(20, 60, n)]
        b = [float(x) for x in rng.integers(0, 50, m)]
        assert rank_sum_p(a, b) == pytest.approx(naive(a, b), abs=1e-9), (n, m)


SEQ4, SNLP4 = [10.0, 10.1, 12.0, 12.0], [5.0, 5.0, 5.0, 10.2]  # p10-p90 apart (10.03 > 8.64), two pairs the other way


def test_separated_p10_p90_spreads_over_overlapping_timings_are_a_tie():
    """bench --distributed's prefill and --suite train called a lead wherever the two sides' p10-p90 spreads were
    apart and each side had 4 timings or more (the p = 0.029 of min-max ranges that do not overlap). But p10-p90
    spreads can part while the timings overlap: here two of the 16 pairs go the other way and the exact rank-sum p
    (over the splits of these timings, some equal) is 0.09, a tie at 5 %; the verdict now comes from the timings."""
    from scipy.stats import mannwhitneyu

    from snlp.apps.dist import dist_bench_row, prefill_line
    from snlp.bench.stats import p10_p90, spread_verdict, unpaired_verdict

    assert mannwhitneyu(SEQ4, SNLP4, method="exact").pvalue > 0.05
    assert spread_verdict(*p10_p90(SEQ4), *p10_p90(SNLP4), 4, 4)[2] is False  # the spreads alone: apart
    assert unpaired_verdict(SEQ4, SNLP4) == (*spread_verdict(*p10_p90(SEQ4), *p10_p90(SNLP4))[:2], True)
    assert unpaired_verdict([2.0] * 4, [1.0] * 4)[2] is False  # every timing apart: p = 0.029
    rec = dict(what="prefill", plan="4xF1-h0-K1", world_size=2, tokens=4, batch=1, runs=4,
               chunks_per_rank=[[0, 2], [2, 4]], max_rank_bytes=1, memory_per_rank=[], pipeline_sequential_ms=11.05,
               snlp_ms=5.0, speedup=2.21, h_S_broadcast_ms=0.1, prefix_ms_rank0=0.0,
               pipeline_sequential_times_ms=SEQ4, snlp_times_ms=SNLP4)
    row = dist_bench_row(rec, loadavg=[], pinned=False, threads=1)
    assert row.speedup_tie is True
    assert "tie, the rank-sum test over the 4 and 4 runs does not resolve it (p = 0.09)" in prefill_line(2, row)


def test_train_bench_ratios_tie_where_the_steps_overlap():
    """--suite train's ratio_spreads: the same rule over each row's timed steps (step_ms_timed)."""
    from snlp.bench.stats import p10_p90
    from snlp.bench.train import TrainBenchConfig, TrainBenchResult, TrainBenchRow

    def row(treatment, steps):
        p10, p90 = p10_p90(steps)
        return TrainBenchRow(shape="0.5B", treatment=treatment, reg="none", reg_n=[], n_layer=2, n_embd=64, params=1,
                             batch=1, seq_len=8, tokens_per_step=8, steps=len(steps), warmup=1,
                             step_ms=statistics.median(steps), step_ms_p10=p10, step_ms_p90=p90,
                             step_ms_timed=list(steps), tokens_per_s=8e3 / statistics.median(steps))

    res = TrainBenchResult(config=TrainBenchConfig(quick=True, regs=("none",)), meta={},
                           rows=[row("eager", SEQ4), row("compiled", SNLP4)])
    sp = res.ratio_spreads()["compiled_speedup_none"]
    assert sp["lo"] > 1.0 and sp["tie"] is True
    res.rows[1] = row("compiled", [5.0] * 4)
    assert res.ratio_spreads()["compiled_speedup_none"]["tie"] is False

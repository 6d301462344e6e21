"""Where the speedrun report's and `snlp eval`'s one rule for (tie) marks and the `*` front met the tables it had not
reached: the report's full evaluation records, the off-the-shelf stage's console table, `snlp eval --plot`, a table
of one validation window, and the Prefill sentence's band. References: scipy.stats (binomtest, ttest_rel) and
counts made here from the records."""

import dataclasses
import math
import statistics

import pytest
from scipy import stats
from test_report_claims import _section
from test_speedrun import _rec, _report_ctx

from snlp.apps.report import render_report


def _sign_tie(rounds) -> bool:
    wins, losses = sum(x > 1 for x in rounds), sum(x < 1 for x in rounds)
    return wins + losses == 0 or stats.binomtest(wins, wins + losses, 0.5).pvalue >= 0.05


def _rows(md_table: str) -> dict[str, dict[str, str]]:
    lines = [x for x in md_table.splitlines() if x.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return {cells[0]: dict(zip(head, cells)) for x in lines[2:]
            if (cells := [c.strip() for c in x.strip("|").split("|")])}


def test_the_full_records_mark_what_the_eval_stage_console_marks():
    """The eval stages print each model's records with (tie) where the rounds do not resolve a Speedup (record_ties,
    as `snlp eval`), and the report's full evaluation records printed the same records bare: a --quick run's console
    held 16 (tie) marks and its report's full records none. The fixture's plans have 3 timed rounds each."""
    ctx = _report_ctx()
    md = render_report(ctx)
    full = _section(md, "## Full evaluation records", "Files:")
    for key, label in (("noreg", "No Reg."), ("idn", "IDN Reg.")):
        table = _section(full, f"**{label}**", "\n\n(tie)")
        rows = _rows(table[table.index("| Plan"):])
        for r in ctx["evals"][key][1:]:
            tie = _sign_tie(r.speedup_rounds)
            assert rows[r.plan]["Speedup"] == f"{r.speedup:.2f}x" + (" (tie)" if tie else ""), (label, r.plan)
    assert full.count("not resolved by a two-sided sign test") == 2  # the rule under each table


def test_the_off_the_shelf_console_table_marks_what_the_report_marks(tmp_path, monkeypatch, capsys):
    """The off-the-shelf stage printed its table bare, where the report's section marks the same records by
    record_ties (3 timed rounds: every Speedup a tie) and says its one window leaves ΔPPL untested."""
    import torch

    import snlp.apps.speedrun.off_the_shelf as O
    import snlp.eval.data as D
    import snlp.eval.protocol as P
    from snlp.apps.speedrun.preset import QUICK, DataSpec
    from snlp.model.config import GPTConfig

    class Stub:  # what the stage reads of the model besides evaluate: its config, device and size
        config = GPTConfig.from_depth(16)

        def to(self, device):
            return self

        def eval(self):
            return self

        def num_params(self):
            return 1

    seq = dataclasses.replace(_rec("sequential", 9.0, [1.0] * 3, 1.0, 1.0), window_ce=[2.2])
    k1 = dataclasses.replace(_rec("12xF1-h0-K1", 12.0, [1.2, 1.3, 1.25], 0.5, 0.5), window_ce=[2.5])
    monkeypatch.setattr(O, "ots_model", lambda *a, **k: (Stub(), None))
    monkeypatch.setattr(D, "validation_tokens", lambda *a, **k: torch.zeros(8, dtype=torch.long))
    monkeypatch.setattr(P, "evaluate", lambda *a, **k: [seq, k1])
    pre = dataclasses.replace(QUICK, ots_adapt_minutes=0)
    O.stage_off_the_shelf(tmp_path / "m.gguf", DataSpec("stdlib", 0, 512), tmp_path, pre, 0, "cpu")
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "12xF1-h0-K1" in x)
    assert _sign_tie(k1.speedup_rounds) and "1.25x (tie)" in line
    assert "ΔPPL: untested (one validation window" in " ".join(out.split())


def test_a_table_of_one_validation_window_says_its_dpppl_is_untested():
    """`snlp eval --max-tokens` of one window printed ΔPPL bare under the note "(tie): ... ΔPPL's 95 % paired-window
    interval includes 0", which reads as every bare ΔPPL resolved; one window has no interval (delta_ppl_interval is
    None), so none is tested."""
    from snlp.apps.eval import record_ties
    from snlp.apps.report import delta_ppl_interval
    from snlp.eval.present import markdown_table

    seq = dataclasses.replace(_rec("sequential", 20.0, [1.0] * 6, 1.0, 1.0), window_ce=[3.0])
    plan = dataclasses.replace(_rec("12xF1-h0-K1", 20.5, [1.5] * 6, 0.5, 0.5), window_ce=[3.02])
    assert delta_ppl_interval(plan.window_ce, seq.window_ce) is None
    md = markdown_table([seq, plan], record_ties([seq, plan]))
    assert "paired-window interval includes 0" not in md
    assert "ΔPPL: untested (one validation window: no interval, so no (tie) mark either way)" in md
    assert "not resolved by a two-sided sign test" in md  # the Speedup half of the rule stays
    # two windows: the interval exists, and the note is the rule as before
    seq2, plan2 = (dataclasses.replace(r, window_ce=[*r.window_ce, r.window_ce[0] + 0.1]) for r in (seq, plan))
    assert "paired-window interval includes 0" in markdown_table([seq2, plan2], record_ties([seq2, plan2]))


def _front_reference(records) -> set[str]:
    """The `*` rule recomputed with scipy: a row is off the front when another (the sequential row included) is at
    least as good on speed (sign test over the paired rounds) and PPL (paired t-test over the windows), better on one."""
    def cmp_speed(a, b):
        r = [x / y for x, y in zip(a.speedup_rounds, b.speedup_rounds)]
        return 0 if _sign_tie(r) else (1 if sum(x > 1 for x in r) > sum(x < 1 for x in r) else -1)

    def cmp_ppl(a, b):
        res = stats.ttest_rel(a.window_ce, b.window_ce)
        if not math.isfinite(res.pvalue) or res.pvalue >= 0.05:
            return 0
        return 1 if statistics.fmean(a.window_ce) < statistics.fmean(b.window_ce) else -1

    def dominated(b):
        return any(s >= 0 and q >= 0 and (s > 0 or q > 0)
                   for a in records if a is not b for s, q in [(cmp_speed(a, b), cmp_ppl(a, b))])

    return {r.plan for r in records if not dominated(r)}


def _plot_records():
    """sequential; a K = 1 plan resolved faster (20 of 20 rounds) and resolved worse in PPL; a K = 2 plan whose median
    1.05x the rounds do not tell from 1.00x (10 of 20) with a PPL resolved worse than sequential's: sequential
    dominates it by the table's rule, while its median puts it on a front of medians."""
    base = [3.0 + 0.05 * (i % 7) for i in range(32)]
    wobble = [0.004 * (1 if i % 2 else -1) for i in range(32)]
    w1 = [b + 0.30 + e for b, e in zip(base, wobble)]
    w2 = [b + 0.01 + 0.003 * (i % 3 - 1) for i, b in enumerate(base)]  # another wobble: no difference is constant
    r1 = [1.8 + 0.01 * i for i in range(20)]
    r2 = [1.05 + (0.3 if i % 2 else -0.3) for i in range(20)]
    ppl = lambda w: math.exp(statistics.fmean(w))  # noqa: E731
    recs = [dataclasses.replace(_rec("sequential", ppl(base), [1.0] * 20, 1.0, 1.0), window_ce=base, delta_ppl=0.0)]
    for plan, w, r in (("12xF1-h0-K1", w1, r1), ("12xF1-h0-K2", w2, r2)):
        recs.append(dataclasses.replace(_rec(plan, ppl(w), r, 0.5, 0.5), window_ce=w,
                                        delta_ppl=ppl(w) / ppl(base) - 1))
    return recs


def test_snlp_eval_plot_rings_the_front_of_its_tables_rule(tmp_path, monkeypatch):
    """`snlp eval --plot` ringed the front of medians (pareto_front) and drew no bars, beside a table that marks the
    Speedups its rounds do not resolve: it ringed `12xF1-h0-K2` (1.05x, 10 of 20 rounds faster, PPL resolved worse
    than sequential), which the speedrun's `*` rule puts off the front through the sequential model. On the --steps
    444 run's No-Reg records alone the plot ringed 5 plans where the rule keeps 1. It now rings the rule's front and
    draws each plan's rounds and ΔPPL interval."""
    import copy

    import snlp.eval.present as PR
    import snlp.eval.protocol as P
    from snlp.apps.cli import main
    from snlp.eval.metrics import pareto_front
    from snlp.io.checkpoint import save_checkpoint
    from snlp.io.tokenizer import MIN_VOCAB, Tokenizer
    from snlp.model.config import GPTConfig
    from snlp.model.gpt import GPT

    recs = _plot_records()
    pts = [(r.speedup, r.delta_ppl) for r in recs]
    medians = {recs[i].plan for i in pareto_front(pts)}
    want = _front_reference(recs)
    assert "12xF1-h0-K2" in medians and "12xF1-h0-K2" not in want  # the two rules differ on these records
    text = "def f(x):\n    return x + 1\n" * 40
    data = tmp_path / "corpus.txt"
    data.write_text("\n\n".join([text] * 6))
    tok = Tokenizer.train([text], vocab_size=MIN_VOCAB + 20)
    model = GPT(GPTConfig.from_depth(16, head_dim=16, width=32, vocab_size=tok.vocab_size, sequence_len=32))
    args = {"data": str(data), "text_field": "text", "max_chars": 0, "val_frac": 0.5,
            "cache_dir": str(tmp_path / "cache")}
    ck = save_checkpoint(tmp_path / "ck", copy.deepcopy(model), tokenizer=tok, train_state={"args": args})
    got = {}
    monkeypatch.setattr(P, "evaluate", lambda *a, **k: recs)
    monkeypatch.setattr(PR, "frontier_plot", lambda groups, path, **kw: got.update(kw, groups=groups))
    assert main(["eval", str(ck), "--plans", "12xF1-h0-K1,12xF1-h0-K2", "--no-emb", "--no-progress",
                 "--plot", str(tmp_path / "f.png")]) == 0
    (label, _), = got["groups"].items()
    assert got["fronts"][label] == want
    assert got["spreads"][label] == {r.plan: (min(r.speedup_rounds), max(r.speedup_rounds)) for r in recs[1:]}
    for r in recs[1:]:  # each plan's ΔPPL interval: scipy's paired-t confidence interval, in %
        ci = stats.ttest_rel(r.window_ce, recs[0].window_ce).confidence_interval(0.95)
        assert got["intervals"][label][r.plan] == pytest.approx((100 * math.expm1(ci.low), 100 * math.expm1(ci.high)),
                                                               rel=1e-9)


def test_the_prefill_sentence_names_the_band_it_tests():
    """The sentence counted rows by |log(ratio)| > log 1.25 and called them "more than 25% from their L / Layer
    evals": a Prefill at 0.79 of it, 21 % below, was counted among them. It names the band: 0.80-1.25 times."""
    ctx = _report_ctx()
    pre = {"noreg": {"12xF1-h0-K1": 0.79, "12xF1-h0-K4": 16 / 52, "1xF12-h0-K1": 1.0},
           "idn": {"12xF1-h0-K1": 0.95, "12xF1-h0-K4": 16 / 52, "1xF12-h0-K1": 1.0}}
    for k in ("noreg", "idn"):
        ctx["evals"][k] = [r if r.plan == "sequential" else dataclasses.replace(r, prefill_speedup=pre[k][r.plan])
                           for r in ctx["evals"][k]]
    text = _section(render_report(ctx), "**What the speed columns measure**", "\n")
    assert "more than 25% from" not in text
    evals = {"12xF1-h0-K1": 16, "12xF1-h0-K4": 52, "1xF12-h0-K1": 16}  # layer evaluations per token, by hand
    outside = sum(not 0.8 <= v * evals[p] / 16 <= 1.25 for d in pre.values() for p, v in d.items())
    assert outside == 1  # the 0.79: 21 % below
    assert f"{outside} of 6 plan rows lie outside 0.80-1.25 times their L / Layer evals" in text


def test_a_cut_evals_kept_markdown_marks_its_dppl_as_the_finished_one(tmp_path):
    """`snlp eval` cut in its timing keeps the quality columns in --markdown, where every ΔPPL was printed bare and
    without the rule: the finished table marks (tie) where the paired-window interval includes 0 (scipy's paired t
    confidence interval here), and the kept one now does too."""
    from argparse import Namespace

    from snlp.apps.eval import partial_writer

    base = [3.0 + 0.05 * (i % 7) for i in range(32)]
    near = [b + 0.003 * (1 if i % 2 else -1) for i, b in enumerate(base)]  # mean difference 0
    far = [b + 0.2 + 0.003 * (i % 3) for i, b in enumerate(base)]
    recs = [dataclasses.replace(_rec(p, 20.0, [1.0], 1.0, 1.0), window_ce=w, speedup=None, speedup_rounds=None)
            for p, w in (("sequential", base), ("12xF1-h0-K2", near), ("12xF1-h0-K1", far))]
    out = tmp_path / "e.md"
    partial_writer(Namespace(json=None, markdown=str(out), csv=None, plot=None))(recs, "PPL, dPPL, Top-1 and LogitSim")
    rows = _rows(out.read_text().split("\n\n", 1)[1])
    for r in recs[1:]:
        ci = stats.ttest_rel(r.window_ce, base).confidence_interval(0.95)
        assert rows[r.plan]["ΔPPL"].endswith("(tie)") == (ci.low <= 0 <= ci.high), r.plan
    assert rows["12xF1-h0-K2"]["ΔPPL"].endswith("(tie)") and "paired-window interval includes 0" in out.read_text()

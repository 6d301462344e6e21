"""Presentation that must not mislead: blown-up PPLs in every table, the frontier
plot, and progress output in logs."""

from __future__ import annotations

import io
import math
import sys

import pytest
import torch

from snlp.eval.data import windows
from snlp.eval.protocol import EvalConfig, EvalRecord, teacher_forced
from snlp.runtime.fmt import fmt_delta_ppl, fmt_ppl, sci
from snlp.method.plan import Plan
from snlp.eval.present import markdown_table, print_table, protocol_note
from snlp.apps.report import early_exit_table, main_table, off_the_shelf_section, training_table
from snlp.runtime.device import progress_bar

from conftest import make_model

HUGE_PPL, SEQ_PPL = 174060849.26, 13.1978  # the off-the-shelf row that printed "+1318860828.9%"


def _recs(base: float = SEQ_PPL, huge: float = HUGE_PPL) -> list[EvalRecord]:
    rows = [("sequential", base, 1.0, "", None), ("12xF1-h0-K1", huge, 0.82, "", 1), ("6xF2-h0-K1", 2300.0, 0.9, "", 1),
            ("12xF1-h0-K2", 14.1, 0.71, "", 2), ("12xF1-h0-K4", 13.25, 0.55, "", 4),
            ("4xF3-h0-K1", math.inf, 0.95, "diverged", 1), ("6xF2-h0-K2", 13.9, None, "", 2)]
    return [EvalRecord(plan=p, K=k, ppl=v, delta_ppl=0.0 if p == "sequential" else v / base - 1, speedup=s, note=n,
                       tokens=1000, seq_len=128) for p, v, s, n, k in rows]


# ----- one formatting rule -----
def test_the_ppl_and_delta_rule():
    assert [fmt_ppl(x) for x in (35.6612, 9999.994, 1e4, HUGE_PPL, math.inf, -math.inf, math.nan, None)] == \
        ["35.66", "9999.99", "1.0e4", "1.7e8", "diverged", "diverged", "-", "-"]
    assert fmt_ppl(41.58, 1) == "41.6"
    d = HUGE_PPL / SEQ_PPL - 1  # +1318860828.9 %
    assert [fmt_delta_ppl(x) for x in (0.055, -0.011, 0.0, 10.0, 10.5, 173.2, d, math.inf, math.nan, None)] == \
        ["+5.5%", "-1.1%", "+0.0%", "+1000.0%", "×11.5", "×174.2", "×1.3e7", "diverged", "-", "-"]
    # a resolved change under 0.05 % does not print as "-0.0%" beside the sequential row's "+0.0%" (an eval of a
    # trained depth-8 model printed PPL 699.11 vs 699.28 as "-0.0%", not marked a tie); round-off stays 0.0
    assert [fmt_delta_ppl(x) for x in (-0.00024, 0.0004, 0.00005, -0.00004, 1e-9)] == \
        ["-0.02%", "+0.04%", "+0.01%", "-0.0%", "+0.0%"]
    assert sci(2.5e-5) == "2.5e-5" and sci(123456.0, 2) == "1.23e5"


def test_blown_up_rows_read_the_same_in_every_table(capsys):
    recs = _recs()
    md = markdown_table(recs)
    print_table(recs, "off the shelf")  # rich, on the terminal
    term = capsys.readouterr().out
    report = main_table({"noreg": recs, "idn": _recs(base=SEQ_PPL * 0.99)}, {})
    shelf = "\n".join(off_the_shelf_section({"result": {"model": "m", "n_layer": 30, "params": 1.35e8,
                                                        "records": [r.to_dict() for r in recs]}}))
    for name, text in (("markdown", md), ("terminal", term), ("report", report), ("off-the-shelf", shelf)):
        assert "174060849" not in text and "1318860828" not in text, name
        assert "1.7e8" in text and "×1.3e7" in text, name
        assert "×174.3" in text and "+6.8%" in text, name  # ×(1 + Δ) beyond +1000 %, percentages below it
        assert "inf" not in text, name  # a non-finite PPL says what happened
    assert "| 4xF3-h0-K1 (diverged) | 1 | diverged | diverged |" in md
    assert "| `4xF3-h0` | 1 | diverged | diverged |" in report


def test_report_side_tables_use_the_rule():
    ee = early_exit_table({"noreg": [{"N": 0, "seq_layers": 16, "ppl": 35.66}, {"N": 12, "seq_layers": 4, "ppl": HUGE_PPL}],
                           "idn": [{"N": 0, "seq_layers": 16, "ppl": 35.27}, {"N": 12, "seq_layers": 4, "ppl": math.inf}]})
    assert "| 12 | 4 | 1.7e8 | diverged |" in ee and "| 0 | 16 | 35.66 | 35.27 |" in ee  # No Reg. first
    train = {"steps": 10, "tokens": 1000, "train_seconds": 5.0, "median_tok_s": 200.0, "gap_at_0": 0.5, "gap": 0.1}
    # a CE whose exp overflows (a run that blew up) must not crash the report, and a large PPL is not 12 digits
    tt = training_table({"unigram_ce": 5.0}, {"noreg": {**train, "val_loss": 800.0}, "idn": {**train, "val_loss": 12.0}})
    assert "800.000 (diverged)" in tt and "12.000 (1.6e5)" in tt and "5.000 (148.4)" in tt


def test_analysis_tables_use_the_rule():
    from snlp.eval.analysis.common import fmt as analysis_cell  # the cell formatter of every `snlp analyze` table

    assert [analysis_cell(x) for x in (35.6612, HUGE_PPL, math.inf, None)] == ["35.66", "1.7e8", "diverged", "-"]


# ----- the frontier plot -----
def _readme_groups():
    """The speedrun's main table in README.md (what docs/speedrun_frontier.png shows)."""
    rows = {"No Reg.": (35.66, [("1xF8-h0-K1", 41.58, 1.48), ("8xF1-h0-K1", 37.96, 1.43), ("4xF2-h0-K1", 36.49, 1.50),
                                ("8xF1-fwd-K1", 36.21, 1.32), ("4xF2-h0-K2", 35.75, 1.31), ("8xF1-h0-K2", 35.73, 1.33),
                                ("8xF1-h0-K4", 35.66, 1.10)]),
            "IDN Reg.": (35.27, [("1xF8-h0-K1", 37.34, 1.49), ("4xF2-h0-K1", 35.57, 1.46), ("8xF1-fwd-K1", 35.49, 1.25),
                                 ("8xF1-h0-K1", 35.36, 1.40), ("4xF2-h0-K2", 35.30, 1.32), ("8xF1-h0-K2", 35.27, 1.24),
                                 ("8xF1-h0-K4", 35.27, 1.04)])}
    return {g: [EvalRecord(plan="sequential", ppl=b, delta_ppl=0.0, speedup=1.0)]
            + [EvalRecord(plan=p, ppl=v, delta_ppl=v / b - 1, speedup=s) for p, v, s in r] for g, (b, r) in rows.items()}


def _boxes(fig, ax):
    from snlp.eval.frontier import LABEL_GID

    r = fig.canvas.get_renderer()
    labels = [t for t in ax.texts if t.get_gid() == LABEL_GID]
    from matplotlib.text import Text

    return labels, [Text.get_window_extent(t, r) for t in labels]  # the text's box: an Annotation's own adds its leader line


def _points_px(ax):
    """Pixel centres of every scatter point (plans and the sequential star)."""
    return [tuple(ax.transData.transform(p)) for c in ax.collections for p in c.get_offsets()]


@pytest.mark.parametrize("case", ["speedrun", "off-the-shelf"])
def test_frontier_plots_delta_ppl_per_model_with_readable_labels(case, tmp_path):
    from snlp.eval.frontier import frontier_figure
    from snlp.eval.present import frontier_plot

    groups = _readme_groups() if case == "speedrun" else {"SmolLM2": _recs()}
    fig = frontier_figure(groups, "t")
    ax = fig.axes[0]
    fig.draw_without_rendering()
    assert "ΔPPL" in ax.get_ylabel() and "speedup" in ax.get_xlabel()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    for g in groups:  # one series per model, named with its sequential PPL
        assert any(t.startswith(g) and "Pareto front" in t for t in legend)
    star = [c for c in ax.collections if len(c.get_offsets()) == 1 and tuple(c.get_offsets()[0]) == (1.0, 0.0)]
    assert star, "the sequential run is drawn at (1.0x, 0 %)"
    # the plotted y is ΔPPL in %, not PPL
    ys = sorted(float(p[1]) for c in ax.collections for p in c.get_offsets())
    plotted = sorted([0.0] + [100 * r.delta_ppl for rs in groups.values() for r in rs
                              if not r.is_sequential and r.speedup is not None and math.isfinite(r.delta_ppl)])
    assert ys == pytest.approx(plotted)
    labels, boxes = _boxes(fig, ax)
    n_plans = len(plotted) - 1
    assert len(labels) == n_plans  # every plotted plan is labelled ...
    for i, a in enumerate(boxes):  # ... and no label overlaps another
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)
    for box in boxes:  # nor a point
        for x, y in _points_px(ax):
            assert not box.contains(x, y)
    frame = ax.get_window_extent(fig.canvas.get_renderer())
    assert all(frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1 for b in boxes)
    if case == "speedrun":  # 0.1 % next to 16.6 %: decades apart, symlog keeps the small ones apart
        assert ax.get_yscale() == "symlog"
    else:  # +1.3e9 % next to +0.4 %; a diverged and an untimed plan are listed, not silently dropped
        assert ax.get_yscale() == "symlog"
        assert any("4xF3-h0-K1 (diverged)" in t for t in legend) and any("6xF2-h0-K2 (not timed)" in t for t in legend)
    frontier_plot(groups, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_frontier_axis_is_linear_when_delta_ppl_is_narrow():
    from snlp.eval.frontier import frontier_figure, symlog_linthresh

    assert symlog_linthresh([0.0, 2.0, 3.0, 5.0]) is None
    assert symlog_linthresh([0.0, 0.085, 16.6]) == pytest.approx(0.1)
    assert symlog_linthresh([0.0, 0.4, 1.3e9, math.inf]) == pytest.approx(1.0)
    recs = [EvalRecord(plan="sequential", ppl=10.0, delta_ppl=0.0, speedup=1.0),
            EvalRecord(plan="4xF2-h0-K1", ppl=10.3, delta_ppl=0.03, speedup=1.4),
            EvalRecord(plan="4xF2-h0-K2", ppl=10.2, delta_ppl=0.02, speedup=1.2)]
    assert frontier_figure({"m": recs}).axes[0].get_yscale() == "linear"


# ----- progress in a log -----
class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_in_a_log_is_plain_lines(capsys):
    """stderr captured (not a terminal, like CI or `> file`): no carriage returns, a bounded number of lines
    however many updates (tqdm wrote one '\\r' update per step)."""
    with progress_bar(5000, "many steps") as bar:
        for _ in range(5000):
            bar.update()
        bar.set_postfix(loss="1.234")
        bar.write("a message")
    cap = capsys.readouterr()
    err = cap.err
    assert "\r" not in err
    lines = err.splitlines()
    assert len(lines) <= 2 and cap.out == "a message\n"  # messages go to stdout, as tqdm.write's do
    assert lines[-1].startswith("many steps: 5000/5000 (100%) done in") and "loss=1.234" in lines[-1]
    with progress_bar(10, "off", enabled=False) as bar:
        bar.update(10)
    assert capsys.readouterr().err == ""


def test_a_progress_producing_function_writes_no_carriage_returns(capsys):
    torch.manual_seed(0)
    model = make_model(n_layer=4)
    val = torch.randint(0, model.config.vocab_size, (200,))
    cfg = EvalConfig(seq_len=8, max_tokens=64, batch=1, progress=True)
    teacher_forced(model, windows(val, 8, 64), [Plan.parse("2xF1-h0-K1", 4)], cfg)  # 8 windows x 2 rows of updates
    err = capsys.readouterr().err
    assert "\r" not in err and 1 <= len(err.splitlines()) <= 2
    assert err.splitlines()[-1].startswith("PPL / Top-1 / LogitSim: 16/16 (100%) done in")


def test_progress_lines_are_periodic_and_a_terminal_keeps_its_bar(monkeypatch):
    from tqdm import tqdm

    from snlp.runtime.progress import LineProgress

    out = io.StringIO()
    with LineProgress(3, "stage", out, interval=0.0) as bar:  # interval 0: a line at every update
        for _ in range(3):
            bar.update()
    assert out.getvalue().splitlines()[0].startswith("stage: 1/3 (33%) at")
    assert len(out.getvalue().splitlines()) == 4  # 3 periodic + the final line
    monkeypatch.setattr(sys, "stderr", _Tty())
    bar = progress_bar(3, "live")
    assert isinstance(bar, tqdm)  # an interactive terminal keeps the live bar
    bar.close()


def test_training_in_a_log_writes_no_carriage_returns(tmp_path, capsys):
    """`snlp train` (its step bar, the main offender: one update per step) with stderr not a terminal."""
    from snlp.train.trainer import TrainConfig, fit

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"line {i}: the quick brown fox {i % 7} jumps over {i % 13} lazy dogs." * 3
                                  for i in range(60)))
    cfg = TrainConfig(out=str(tmp_path / "run"), data=str(corpus), cache_dir=str(tmp_path / "cache"), depth=2, width=32,
                      head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=4, eval_every=2, eval_batches=1,
                      no_progress=False, device="cpu", reg_n="1")
    assert fit(cfg).steps == 4
    cap = capsys.readouterr()
    assert "\r" not in cap.err and "\r" not in cap.out
    bar_lines = [line for line in cap.err.splitlines() if line.startswith("train: ")]
    assert bar_lines and bar_lines[-1].startswith("train: 4/4 (100%) done in") and "loss=" in bar_lines[-1]
    assert len(cap.err.splitlines()) <= 5  # however many steps: a line per 30 s and one at the end
    assert "step 2:" in cap.out and "step 4:" in cap.out  # the evaluations still reach stdout


def test_training_pace_is_tokens_over_the_summed_step_time_not_a_median():
    """A loaded box's heavy-tailed steps: the median of per-step tok/s overstates the pace the run stepped at (a
    fresh report said 1,183 tok/s where its own 909,312 tokens took 958 s). The stepping pace is the tokens over
    the summed step wall times; the table, its caption and the floor's price use it, and name their statistic."""
    from snlp.apps.report import stepping_pace_s
    from snlp.apps.speedrun.train import _mean_step_s, _stepping_tok_s

    log = [{"step": 0, "val_loss": 8.0}, {"step": 1, "tok_s": 50.0, "step_s": 9.0}] + \
        [{"step": s, "tok_s": x, "step_s": 2048 / x} for s, x in zip(range(2, 8), [1000, 1000, 1000, 1000, 250, 250])]
    walls = [2048 / x for x in (1000, 1000, 1000, 1000, 250, 250)]
    assert _stepping_tok_s(log) == pytest.approx(6 * 2048 / sum(walls))  # 500 tok/s; the median says 1000
    assert _mean_step_s(log) == pytest.approx(sum(walls) / 6)
    train = {"steps": 6, "tokens": 6 * 2048, "train_seconds": 40.0, "median_tok_s": 1000.0, "gap_at_0": 0.5, "gap": 0.1,
             "val_loss": 4.0, "median_step_s": 2.048, "stepping_tok_s": _stepping_tok_s(log),
             "mean_step_s": _mean_step_s(log)}
    tt = training_table({"unigram_ce": 5.0}, {"noreg": train, "idn": train})
    assert "tok/s (stepping)" in tt and "Own step (mean; tok/s)" in tt and "| 500 |" in tt
    ctx = {"stages": {"train-noreg": {"result": train}, "train-idn": {"result": train}}, "parallel": True}
    assert stepping_pace_s(ctx) == pytest.approx(sum(walls) / 6)
    old = {k: v for k, v in train.items() if k not in ("stepping_tok_s", "mean_step_s")}  # records before the fix
    assert "tok/s (median)" in training_table({"unigram_ce": 5.0}, {"noreg": old, "idn": old})


def test_the_captions_warm_steps_claim_no_compilation_of_an_eager_speedrun(tmp_path):
    """The caption names each leg's first step as left out of the pace; the speedrun trains eager, so it may not say
    those steps compiled. Reference: the TrainConfig the speedrun builds for both models."""
    from snlp.apps.report import warm_steps_text
    from snlp.apps.speedrun.train import train_config

    cfg = {"data": "d", "max_chars": 1, "vocab_size": 300, "depth": 2, "width": 32, "head_dim": 16, "seq_len": 8,
           "batch_size": 1, "seed": 0, "reg_n": 1, "device": "cpu"}
    assert not any(train_config(cfg, tmp_path / k, tmp_path, reg=k == "idn", steps=6).compile for k in ("noreg", "idn"))
    text = warm_steps_text({"noreg": {"warm_steps": [1, 4]}, "idn": {"warm_steps": [1]}})
    assert "No Reg. steps 1, 4; IDN Reg. step 1" in text and "compil" not in text


def test_the_full_records_fused_column_names_its_reference_and_k_eq_c_is_itself():
    """A fresh report's Full records printed "AR Match vs fused 100.0%" for `1xF12-h0-K1` (K = C: the plan is its own
    fused reference, so 100 % is guaranteed) where the main table says "= itself"; the column now shows what the main
    table's last column shows."""
    recs = [EvalRecord(plan="1xF12-h0-K1", K=1, ppl=40.0, ar_match=0.03, ar_match_fused=1.0,
                       ar_fused_reference="1xF12-h0-K1"),
            EvalRecord(plan="6xF2-h0-K1", K=1, ppl=39.0, ar_match=0.19, ar_match_fused=0.188,
                       ar_fused_reference="6xF2-h0-K6")]
    md = markdown_table(recs)
    assert "= itself (K = C)" in md and "100.0%" not in md and "18.8% vs 6xF2-h0-K6" in md


def test_record_ties_marks_what_snlp_eval_marks():
    """The tie rule a Python caller of `evaluate` gets (docs/usage.md): a Speedup whose paired rounds a two-sided sign
    test at 5 % does not resolve, and a ΔPPL whose 95 % paired-window interval includes 0, are "(tie)"."""
    from snlp.apps.eval import record_ties

    seq = EvalRecord(plan="sequential", ppl=10.0, delta_ppl=0.0, window_ce=[2.0, 2.1, 2.2, 2.3])
    noisy = EvalRecord(plan="4xF1-h0-K1", ppl=10.0, delta_ppl=0.0, speedup=1.75,  # 14 of 20 faster: p = 0.115
                       speedup_rounds=[0.2] * 6 + [1.9] * 14, window_ce=[2.01, 2.09, 2.21, 2.29])
    clear = EvalRecord(plan="4xF1-h0-K2", ppl=12.0, delta_ppl=0.2, speedup=1.3,  # 6 of 6 faster: p = 0.031
                       speedup_rounds=[1.3] * 6, window_ce=[2.2, 2.31, 2.39, 2.5])
    ties = record_ties([seq, noisy, clear])
    assert ties == {"speedup": {"4xF1-h0-K1"}, "delta_ppl": {"4xF1-h0-K1"}, "prefill_speedup": {}}
    table = markdown_table([seq, noisy, clear], ties=ties)
    assert "1.75x (tie)" in table and "1.30x |" in table and "(tie): not told from sequential" in table
    assert "Prefill: a ratio of medians, not tested" in table  # these records keep no prefill rounds


def test_a_resolved_tiny_dppl_prints_the_digits_that_show_it_is_not_zero():
    """`snlp eval` printed a resolved ΔPPL of +0.0036 % as "+0.0%" with no "(tie)": a zero the test had told from
    zero. A resolved change prints with two significant digits; an unresolved one of the same size keeps "+0.0%"
    and its (tie); the sequential row stays "+0.0%"."""
    import math

    from snlp.apps.eval import record_ties

    ws = [2.0, 2.1, 2.2, 2.3]
    seq = EvalRecord(plan="sequential", ppl=10.0, delta_ppl=0.0, window_ce=ws)
    tiny = [w + 3.6e-5 for w in ws]  # every window 3.6e-5 nats worse: ΔPPL = e^3.6e-5 - 1, interval excludes 0
    tiny[0] += 1e-7
    resolved = EvalRecord(plan="4xF1-h0-K1", ppl=10.0 * math.exp(3.6e-5), delta_ppl=math.expm1(3.6e-5), window_ce=tiny)
    noisy = [w + x for w, x in zip(ws, (1e-3, -1e-3, 1.2e-3, -1.056e-3))]  # mean 3.6e-5 nats, interval spans 0
    tied = EvalRecord(plan="4xF1-h0-K2", ppl=10.0 * math.exp(3.6e-5), delta_ppl=math.expm1(3.6e-5), window_ce=noisy)
    ties = record_ties([seq, resolved, tied])
    assert ties["delta_ppl"] == {"4xF1-h0-K2"}
    table = markdown_table([seq, resolved, tied], ties=ties)
    row = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "| +0.0036% |" in row["4xF1-h0-K1"], row["4xF1-h0-K1"]
    assert "| +0.0% (tie) |" in row["4xF1-h0-K2"] and "| +0.0% |" in row["sequential"]
    assert fmt_delta_ppl(-3.6e-5, resolved=True) == "-0.0036%" and fmt_delta_ppl(1.2e-9, resolved=True) == "+1.2e-7%"
    assert fmt_delta_ppl(0.0, resolved=True) == "+0.0%" and fmt_delta_ppl(0.0004, resolved=True) == "+0.04%"


def test_prefill_speedup_is_marked_by_its_paired_rounds():
    """`snlp eval` times the teacher-forced forwards round-robin too: a Prefill whose paired rounds the sign test does
    not resolve is "(tie)" like a Speedup (its median ratio 2.00x from 5 of 8 rounds won, p = 0.727), a resolved one
    (8 of 8, p = 2 / 256) is not, and the note says Prefill was tested."""
    from snlp.apps.eval import record_ties

    seq = EvalRecord(plan="sequential", ppl=10.0, delta_ppl=0.0, prefill_speedup=1.0)
    noisy = EvalRecord(plan="4xF1-h0-K1", ppl=10.0, delta_ppl=0.0, prefill_speedup=2.0,
                       prefill_speedup_rounds=[2.0] * 5 + [0.8] * 3)
    clear = EvalRecord(plan="4xF1-h0-K2", ppl=10.0, delta_ppl=0.0, prefill_speedup=1.5,
                       prefill_speedup_rounds=[1.5] * 8)
    ties = record_ties([seq, noisy, clear])
    assert ties["prefill_speedup"] == {"4xF1-h0-K1": " (tie)"}
    table = markdown_table([seq, noisy, clear], ties=ties)
    assert "2.00x (tie)" in table and "1.50x |" in table and "1.50x (tie)" not in table
    assert "Prefill (the ratio of the two medians): likewise" in table and "not tested" not in table


def test_a_prefill_whose_rounds_resolve_the_other_side_says_so():
    """Prefill is the ratio of the two medians: sequential slow (30 ms) in the 5 rounds the plan's forward took 1 ms,
    the plan 0.5 ms slower in the other 15 gives 19.5 / 15 = 1.30x, yet the plan lost 15 of 20 rounds (p = 0.041,
    scipy.stats.binomtest(5, 20)). The table printed "1.30x" unmarked beside a note saying Prefill is tested; the
    cell now names the rounds' side of 1.00x."""
    import statistics

    from snlp.apps.eval import record_ties

    seq_f = [10.0 + i for i in range(15)] + [30.0] * 5
    plan_f = [10.5 + i for i in range(15)] + [1.0] * 5
    seq = EvalRecord(plan="sequential", ppl=10.0, delta_ppl=0.0, prefill_speedup=1.0, prefill_speedup_rounds=[1.0] * 20)
    rec = EvalRecord(plan="4xF1-h0-K1", ppl=10.0, delta_ppl=0.0,
                     prefill_speedup=statistics.median(seq_f) / statistics.median(plan_f),
                     prefill_speedup_rounds=[a / b for a, b in zip(seq_f, plan_f)])
    ties = record_ties([seq, rec])
    assert ties["prefill_speedup"] == {"4xF1-h0-K1": " (15 of 20 rounds below 1.00x)"}
    table = markdown_table([seq, rec], ties=ties)
    assert "| 1.30x (15 of 20 rounds below 1.00x) |" in table and "(15 of 20 rounds below 1.00x)" in table.split("\n\n")[1]


def test_protocol_note_says_what_each_column_measured_and_which_is_the_papers_speedup():
    """The note under `snlp eval`'s table, from the records' own fields: the PPL windows, the AR sample, what Speedup
    and Prefill time, and that the paper's Speedup column (a batch-1 forward over its window, the mean of 150 calls)
    is Prefill's quantity; rounds and EmbSim's encoder only where the records have them (a partial file has no
    rounds yet; --no-emb no EmbSim)."""
    recs = _recs()
    for r in recs:
        r.prompts, r.gen_tokens = 8, 32
    note = protocol_note(recs)
    assert note.startswith("Protocol: ") and "7 windows of 128 tokens (1,000 predicted tokens)" in note
    assert "8 prompts x 32 greedy tokens" in note and "KV-cached greedy decode ms/token" in note
    assert "compare it with Prefill, not Speedup" in note
    assert "rounds" not in note.split("Prefill")[0].split("Speedup: ")[1] and "MiniLM" not in note
    recs[1].speedup_rounds, recs[2].emb_sim = [1.2] * 20, 0.9
    note = protocol_note(recs)
    assert "paired per-round ratios over 20 rounds" in note and "BGE-small-en-v1.5" in note
    assert protocol_note([]) == ""


def test_the_report_says_which_plan_diverged_in_decoding():
    """A plan finite on the PPL windows whose AR decode diverged (note "diverged in decoding", AR Match None) read in
    the speedrun report's main table like a plan whose AR Match was not measured: its Config cell did not carry the
    note that `snlp eval`'s own table shows."""
    from snlp.eval.protocol import DECODE_DIVERGED

    recs = _recs()
    recs[3].note = DECODE_DIVERGED  # 12xF1-h0-K2, PPL 14.1
    report = main_table({"noreg": recs, "idn": _recs(base=SEQ_PPL * 0.99)}, {})
    assert f"| `12xF1-h0` ({DECODE_DIVERGED}) | 2 | 14.10 |" in report
    assert "| `4xF3-h0` | 1 | diverged | diverged |" in report  # a PPL-diverged row: its PPL cell says it
    assert f"{DECODE_DIVERGED}" in markdown_table(recs)


def test_the_note_of_one_validation_window_says_prefill_is_tested_like_speedup_not_like_dppl():
    """With one validation window the note read "... ΔPPL: untested (...). Prefill (...): likewise, by the sign test",
    so "likewise" followed the untested ΔPPL; Prefill's clause follows the Speedup test it repeats now, ΔPPL's comes
    last. The protocol note counts "1 window", not "1 windows"."""
    from snlp.eval.present import protocol_note, tie_note

    seq = EvalRecord(plan="sequential", window_ce=[2.0], tokens=16, seq_len=16)
    plan = EvalRecord(plan="4xF1-h0-K1", window_ce=[2.1], speedup_rounds=[1.0] * 3, prefill_speedup_rounds=[1.0] * 3)
    note = tie_note([seq, plan])
    speedup, prefill, dppl = (note.index(s) for s in ("Speedup (the median", "Prefill (the ratio", "ΔPPL: untested"))
    assert speedup < prefill < dppl and note[prefill - 2:prefill] == ". "
    assert "over 1 window of 16 tokens (16 predicted tokens)" in protocol_note([seq, plan])


def test_a_progress_line_closed_short_of_its_total_says_stopped_not_done():
    """Ctrl-C in `snlp eval`'s decode timing printed 'decode timing (round-robin): 26/69 (38%) done in 3.8s'."""
    from snlp.runtime.progress import LineProgress

    out = io.StringIO()
    try:
        with LineProgress(69, "stage", out, interval=1e9) as bar:
            bar.update(26)
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert out.getvalue().splitlines()[-1].startswith("stage: 26/69 (38%) stopped after "), out.getvalue()
    out = io.StringIO()
    with LineProgress(3, "stage", out, interval=1e9) as bar:
        bar.update(3)
    assert out.getvalue().splitlines()[-1].startswith("stage: 3/3 (100%) done in ")

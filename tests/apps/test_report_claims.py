"""A reading of a `snlp speedrun --steps 444` report (2 cores, load up to 4.55) against its own records found
sentences the records contradict or a newcomer cannot follow. Each test builds the report from synthetic stage
records shaped like that run's and checks the sentence against figures computed here, outside the report code."""

import dataclasses

from test_speedrun import _rec, _report_ctx, column, tables

from snlp.apps.report import render_report


def _section(md: str, start: str, end: str = "\n#") -> str:
    return md.split(start, 1)[1].split(end, 1)[0]


def _mmss(s: float) -> str:
    s = round(s)
    return f"{s // 60}:{s % 60:02d}"


def _fixed_steps_ctx(noreg_s=544.2, idn_s=936.0):
    """The run's training: --steps 444, no budget, the two models side by side (2 cores) and not in lockstep: No
    Reg. took 9:04, IDN Reg. 15:36; both stage records were written when the second finished."""
    ctx = _report_ctx(steps=444)
    for key, secs in (("noreg", noreg_s), ("idn", idn_s)):
        rec = ctx["stages"][f"train-{key}"] = dict(ctx["stages"][f"train-{key}"], seconds=secs,
                                                   finished="2026-11-27T18:43:17+00:00", load_start=0.48,
                                                   load_end=4.47)
        rec["result"] = {**rec["result"], "minutes": None, "train_seconds": secs - 8}
    ctx["cfg"] = {**ctx["cfg"], "minutes": None, "budget_minutes": None}
    ctx.update(budget_minutes=None, train_floor_steps=None)
    return ctx


def test_fixed_step_training_side_by_side_is_not_called_lockstep():
    """The report said "the two trained side by side in lockstep, so each waits for the slower one and this is the
    pair's pace" while its own console showed No Reg. at step 444 and IDN Reg. at step 258, and its table gave the
    two 1,719 and 990 tok/s and 8:56 and 15:27 of training. Lockstep is only for a wall-clock limit (--minutes or a
    budget); with --steps each steps at its own pace, and the report now says so, and which finished how much
    earlier."""
    md = render_report(_fixed_steps_ctx())
    note = _section(md, "K=1 gap: relative error", "\n## ")
    gap = _mmss(936.0 - 544.2)
    assert "in lockstep, so each waits" not in note and "the pair's pace" not in note
    assert "without the lockstep wait" not in note
    assert "not in lockstep" in note and f"No Reg. finished {gap} before IDN Reg." in note
    assert f"(No Reg. finished {gap} before IDN Reg., which then trained alone" in _section(md, "Stages finished", "\n")
    # a wall-clock limit still trains in lockstep, and says so
    locked = render_report(_report_ctx())
    lock = _section(locked, "K=1 gap: relative error", "\n## ")
    assert "in lockstep, so each waits for the slower one" in lock and "not in lockstep" not in lock
    assert "which then trained alone" not in locked and "(sampled at" not in locked


def test_the_first_side_by_side_run_does_not_claim_the_others_end_load():
    """Both training stage records are written once both runs end, so No Reg.'s "Load at start → end" showed the
    load sampled 6:32 after it finished (at IDN Reg.'s end). The stage table now says where that sample is from."""
    t = tables(render_report(_fixed_steps_ctx()))["Wall time per stage"]
    loads = dict(zip(column(t, "Stage"), column(t, "Load at start → end")))
    assert loads["train-noreg"] == f"0.48 → 4.47 (sampled at IDN Reg.'s end, {_mmss(936.0 - 544.2)} after its own)"
    assert loads["train-idn"] == "0.48 → 4.47"


# the run's No Reg. timed rounds of `12xF1-h0-K4` (10 per model, both models' rounds pooled) and the ratios of the
# sequential model's own rounds
K4_ROUNDS = {"noreg": [0.94, 1.15, 1.02, 1.55, 0.87, 0.85, 1.15, 2.64, 0.60, 1.60],
             "idn": [1.03, 0.99, 0.98, 0.93, 0.99, 0.87, 0.89, 0.92, 0.91, 0.63]}
SEQ = [3.0 + 0.05 * (i % 7) for i in range(32)]


def test_a_plan_off_the_front_only_through_the_sequential_model_is_explained():
    """No Reg.'s `12xF1-h0-K4` had the lowest PPL of its plans and no `*`, and nothing in the table said why: the
    sequential model, not a row, dominated it (the sign test does not tell its speed from 1.00x: faster in 7 of 20
    paired rounds; its PPL higher beyond the t-test). The rule now says the sequential model takes part, and a
    sentence names such a plan."""
    evals = {}
    for key in ("noreg", "idn"):
        seq = _rec("sequential", 32.0, [1.0] * 10, 1.0, 1.0, window_ce=SEQ)
        k4 = _rec("12xF1-h0-K4", 32.07, K4_ROUNDS[key], 0.9, 0.9,
                  window_ce=[x + 0.002 + (0.0005 if i % 2 else -0.0005) for i, x in enumerate(SEQ)])
        k1 = _rec("12xF1-h0-K1", 47.5, [1.9 + 0.01 * i for i in range(10)], 0.3, 0.3,
                  window_ce=[x + 0.39 for x in SEQ])
        evals[key] = [seq, k1, k4]
    ctx = _report_ctx()
    ctx["evals"] = evals
    md = render_report(ctx)
    wins = sum(x > 1 for xs in K4_ROUNDS.values() for x in xs)
    assert wins == 7
    main = tables(md)["Main results"]
    assert [c for c, k in zip(column(main, "Config"), column(main, "K")) if k == "4"] == ["`12xF1-h0`"] * 2  # no `*`
    assert "a plan is off the front when another is at least as good on both and better on one, the sequential " \
           "model included" in md
    text = _section(md, "\n| IDN Reg. [", "![speed-quality")
    for label in ("No Reg.", "IDN Reg."):
        assert (f"{label}: `12xF1-h0-K4` is off the front only through the sequential model: it decoded faster than "
                f"sequential in {wins} of 20 paired rounds, which the sign test does not tell from 1.00x, and its PPL "
                "is higher beyond the paired t-test") in text
    assert "`12xF1-h0-K1` is off the front" not in text  # on the front: faster than sequential in 20 of 20
    # a plan another plan dominates as well is explained by the table itself
    ctx["evals"] = {k: rs + [_rec("6xF2-h0-K1", 32.05, [0.95] * 10, 0.9, 0.9, window_ce=[x + 0.0015 for x in SEQ])]
                    for k, rs in evals.items()}
    assert "`12xF1-h0-K4` is off the front only through the sequential" not in render_report(ctx)


def test_s_beside_the_step_medians_says_it_is_a_median_of_ratios():
    """The SSD text gave No Reg.'s sequential step (12.02 ms) and the drafter's (7.75-8.86 ms) and s as "sequential
    ms over drafter ms"; dividing gave 1.55 at B = 8 where the table said 1.45x. s is the median of the rounds' own
    ratios; the report now says so with the largest difference."""
    ctx = _report_ctx()
    for key, (seq_ms, steps, ss) in {"noreg": (12.0036, (8.8635, 8.2624, 7.7495), (1.3436, 1.3993, 1.4497)),
                                     "idn": (11.6324, (6.8030, 6.6270, 6.4380), (1.6713, 1.7566, 1.8321))}.items():
        rec = ctx["stages"][f"ssd-{key}"] = dict(ctx["stages"][f"ssd-{key}"])
        rec["result"] = {**rec["result"], "rows": [
            dict(rec["result"]["rows"][0], block=b, sequential_ms_per_step=seq_ms, drafter_ms_per_step=d,
                 drafter_speedup_s=s) for b, d, s in zip((2, 4, 8), steps, ss)]}
    text = _section(render_report(ctx), "## Self-speculative decoding", "\n|")
    worst = max(abs(seq / d / s - 1) for seq, ds, ss in ((12.0036, (8.8635, 8.2624, 7.7495), (1.3436, 1.3993, 1.4497)),
                                                         (11.6324, (6.8030, 6.6270, 6.4380), (1.6713, 1.7566, 1.8321)))
                for d, s in zip(ds, ss))
    assert f"{worst:.0%}" == "7%"
    assert ("s is the median over the rounds of each round's own ratio, not the ratio of the two step medians, so "
            f"the two differ by up to {worst:.0%} here (No Reg. B = 8: sequential step 12.00 ms / drafter step 7.75 ms "
            f"= {12.0036 / 7.7495:.2f}, s 1.45x)") in text
    # where s is the ratio of the medians there is nothing to say
    for key in ("noreg", "idn"):
        res = ctx["stages"][f"ssd-{key}"]["result"]
        res["rows"] = [dict(r, drafter_speedup_s=r["sequential_ms_per_step"] / r["drafter_ms_per_step"])
                       for r in res["rows"]]
    assert "not the ratio of the two step medians" not in render_report(ctx)


def test_abbreviations_and_plan_names_are_defined_where_first_printed():
    """IDN, SSD, Top-1, LogitSim and the plan names (`12xF1-h0-K1`: C, M, init) were printed undefined; a
    reader new to the paper could not read the main table's Config column."""
    md = render_report(_report_ctx())
    setup = _section(md, "## Setup", "\n## ")
    assert "IDN = Identity Newton" in setup
    assert md.index("self-speculative decoding (SSD)") < md.index("SSD ") and "(SSD)" in setup
    assert "Top-1 (the share of positions whose argmax token is the sequential model's)" in setup
    assert "LogitSim (the mean cosine of the logit vectors)" in setup
    assert "Corpus `stdlib` (the `.py` sources of Python 3.11's standard library, tests excluded" in setup
    assert "at B = 2, 4, 8 (B: the tokens the drafter proposes per round)" in md
    main = _section(md, "## Main results", "\n|")
    assert "the last N = C·M (the suffix) as C chunks of M layers" in main and "init `h0`" in main
    assert "`fwd` from one batched forward" in main



def test_an_invocation_that_reused_every_stage_defines_planned():
    """Re-running the report over the finished stages (`snlp speedrun --out DIR --steps 444` again: 9 reused)
    printed the Planned column (38s, 54s, ...) with no budget sentence at all: an invocation that trains nothing
    makes no plan, and the Planned cells are the records' own."""
    ctx = _fixed_steps_ctx()
    ctx.update(budget=None, ran=[], reused=list(ctx["order"]))
    t = tables(render_report(ctx))["Wall time per stage"]
    assert set(column(t, "Planned")[:-1]) == {"1:00"}  # the fixture's records were planned at 60 s
    tail = _section(render_report(ctx), "**end to end**", "\n## ")
    assert ("no budget (Planned = the cost model's prediction each stage was recorded with, made by the invocation "
            "that ran it; nothing shrinks)") in tail
    for n in ctx["order"]:
        ctx["stages"][n] = dict(ctx["stages"][n], planned=None)
    assert "; no budget (nothing shrinks)." in render_report(ctx)


def test_the_two_models_timing_gap_is_not_attributed_to_load_the_records_do_not_show():
    """The report said the two models' own medians of one plan differ by up to 17 % because "the box's load between
    them moves every plan's ratio", while its stage table sampled nearly the same load for both evaluations (4.47 ->
    4.55, 4.55 -> 4.26). It now gives what the records hold (each stage's sequential step) and attributes nothing."""
    ctx = _report_ctx()
    for key, ms in (("noreg", 15.66), ("idn", 6.63)):
        ctx["evals"][key][0] = dataclasses.replace(ctx["evals"][key][0], latency_ms=ms)
    md = render_report(ctx)
    assert "the box's load between them" not in md and "by the load of the moment each stage ran" not in md
    assert ("their evaluations ran in different stages, at different moments of the box (the sequential decode step: "
            "15.66 ms per token in No Reg.'s stage, 6.63 ms in IDN Reg.'s), which this run does not attribute") in md


def test_each_side_by_side_run_records_its_own_end(tmp_path, monkeypatch):
    """The source of the stage table's borrowed end load: both training records were written, with the finish time
    and load of that moment, once the second run ended. train_models now notes each run's end as it happens and
    the stage record keeps it."""
    from rich.console import Console

    from snlp.apps.speedrun import train
    from snlp.apps.speedrun.records import Stages
    from snlp.train.config import TrainConfig

    class Proc:  # a training process that ends after `polls` looks
        def __init__(self, polls):
            self.polls, self.exitcode = polls, 0

        def is_alive(self):
            self.polls -= 1
            return self.polls > 0

        def join(self):
            pass

        def terminate(self):
            pass

    polls = {"noreg": 1, "idn": 4}
    loads = iter([1.25, 3.5])  # the 1-minute load at No Reg.'s end, then at IDN Reg.'s
    monkeypatch.setattr(train, "_launch", lambda j, *a: Proc(polls[j.key]))
    monkeypatch.setattr(train, "load_average", lambda: next(loads))
    jobs = [train.TrainJob(k, TrainConfig(out=str(tmp_path / k), steps=5), {}, tmp_path / f"{k}.partial.json")
            for k in ("noreg", "idn")]
    ends: dict = {}
    walls = train.train_models(jobs, Console(force_terminal=False, quiet=True), parallel=True, ends=ends)
    assert walls["noreg"] < walls["idn"]
    assert [ends[k][1] for k in ("noreg", "idn")] == [1.25, 3.5]
    assert ends["noreg"][0] <= ends["idn"][0]  # ISO times of one zone sort as strings

    class Quiet:
        def print(self, *a, **k):
            pass

        def rule(self, *a, **k):
            pass

    st = Stages(tmp_path, False, 2, Quiet())
    st.begin("train-noreg", "x")
    rec = st.finish("train-noreg", {}, {}, seconds=1.0, ended=("2026-11-27T18:36:45+00:00", 1.25))
    assert (rec.finished, rec.load_end) == ("2026-11-27T18:36:45+00:00", 1.25)
    st.begin("tokenizer", "x")
    assert st.finish("tokenizer", {}, {}).finished != "2026-11-27T18:36:45+00:00"  # no `ended`: taken now


def test_the_files_line_names_the_training_logs():
    """The run folder holds `noreg.train.log` and `idn.train.log` (docs/speedrun.md's file table), the only place
    the training's own speed line and validation curve are printed; the report's Files line left them out."""
    files = render_report(_report_ctx()).rsplit("Files:", 1)[1]
    assert "`noreg.train.log`, `idn.train.log`" in files and "`cache/`" in files


def test_a_run_without_a_budget_has_no_shrunk_column():
    """A fixed-steps run kept no budget, so a "Shrunk to keep the budget" column of dashes said something about a
    budget that did not exist; a budgeted run keeps the column."""
    free = tables(render_report(_fixed_steps_ctx()))["Wall time per stage"]
    assert "Shrunk to keep the budget" not in free[0] and "Load at start → end" in free[0]
    kept = tables(render_report(_report_ctx()))["Wall time per stage"]
    assert "Shrunk to keep the budget" in kept[0]


def test_every_table_reads_first_with_its_method_folded_under_a_one_line_legend():
    """The report's tables came after paragraphs of up to 2,500 characters on how each number was made; a newcomer
    met the method before the result. Each section now opens with a legend of at most two sentences, and the method
    is folded (<details>) with its words unchanged."""
    md = render_report(_report_ctx())
    assert md.count("<details>") == md.count("</details>") >= 8
    for head in ("## Main results\n", "## Self-speculative decoding\n", "### Drafter choice", "## SNLP diagnostics\n"):
        opening = md.split(head, 1)[1].lstrip("\n").split("\n", 1)[0]
        assert len(opening) < 400 and not opening.startswith("<details>"), (head, opening)
    for block in md.split("<details>")[1:]:  # a folded block holds prose only: every table stays visible
        assert "\n|" not in block.split("</details>", 1)[0]
    # the folded words are the method's, unchanged: the main table's layout and the SSD formula are still there
    assert "Paper's main-table layout" in md and "Ideal SSD = ((1 − α^(B+1))/(1 − α))/(B/s + 1)" in md


def test_the_diagnostics_legend_does_not_read_amplification_as_smaller_is_better():
    """The legend said every column is 'smaller is closer to the identity Newton step's assumptions'; amp. is the
    whole layer's gain ||J_f v|| / ||v||, which that assumption (J_f = I) puts at 1, so an amp. of 0.95 is not
    closer to it than 1.03."""
    md = render_report(_report_ctx())
    legend = md.split("## SNLP diagnostics\n", 1)[1].lstrip("\n").split("\n", 1)[0]
    assert "smaller is closer" in legend and "amp." in legend and "is 1" in legend, legend


def test_end_to_end_overlaps_only_trainings_that_ran_at_the_same_time_and_a_resumed_leg_is_said():
    """"End to end" subtracted the shorter training stage whenever the run was parallel, also when No Reg.'s training
    was reused from an earlier invocation and only IDN Reg. trained now (nothing overlapped); and a training resumed
    from an earlier invocation's save was never said to span two invocations (its stage Wall time is the last leg's,
    the training table's Train time every leg's). The overlap is now read from the records' clock spans, and the
    resumed leg is named under the stage table."""
    ctx = _report_ctx()
    st = ctx["stages"]
    st["train-noreg"] = dict(st["train-noreg"], seconds=500.0, finished="2026-11-25T10:00:00")  # an earlier invocation
    st["train-idn"] = dict(st["train-idn"], result={**st["train-idn"]["result"], "resumed_from_step": 37})
    ctx.update(ran=[n for n in ctx["order"] if n != "train-noreg"], reused=["train-noreg"])
    md = render_report(ctx)
    t = tables(md)["Wall time per stage"]
    total = sum(st[n]["seconds"] for n in ctx["order"])  # nothing overlapped: the plain sum
    assert column(t, "Wall time")[-1] == f"**{_mmss(total)}**", column(t, "Wall time")
    tail = _section(md, "**end to end**", "\n## ")
    assert "overlapping" not in tail and "one after the other" in tail
    assert ("Training spanned two or more invocations (IDN Reg. resumed at step 37 from an earlier invocation's "
            "save)") in tail
    # both side by side in one invocation (the fixture as it is): the shorter one overlaps, nothing resumed
    ctx = _report_ctx()
    t = tables(render_report(ctx))["Wall time per stage"]
    assert column(t, "Wall time")[-1] == f"**{_mmss(sum(ctx['stages'][n]['seconds'] for n in ctx['order']) - 60)}**"
    assert "spanned" not in render_report(ctx)


def test_the_drafter_choice_table_marks_a_measured_speedup_its_rounds_do_not_resolve():
    """The report's drafter-choice table printed "0.968x ±8.3%" for No Reg.'s `6xF2-h0-K1` (rounds on both sides of
    1.0) bare, while `snlp tune`'s own table and the report's SSD table mark such a ratio "(tie)": read bare, it says
    the drafter is slower than sequential decoding. It now carries the mark of tune's table."""
    ctx = _report_ctx()
    md = render_report(ctx)
    row = next(ln for ln in md.splitlines() if ln.startswith("| No Reg. | > `12xF1-h0-K1` | 4 |"))
    assert "| 1.300x (tie) ±5.0% |" in row, row  # 2 rounds: no sign test resolves them
    for k in ("noreg", "idn"):
        ctx["stages"][f"ssd-{k}"]["result"]["tune"][0]["round_speedups"] = [1.2, 1.3, 1.25, 1.28, 1.31, 1.22]
    row = next(ln for ln in render_report(ctx).splitlines() if ln.startswith("| No Reg. | > `12xF1-h0-K1` | 4 |"))
    assert "| 1.300x ±5.0% |" in row, row  # 6 of 6 faster: resolved, no mark

"""The speedrun's budget planner (snlp.bench.budget) with fake stage costs: training gets what is left, an
overrunning stage makes the later ones shrink instead of the total growing, floors hold, too small is refused.
Checked against sums written out here, not against the planner's own arithmetic."""

import pytest

from snlp.bench.budget import StageCost, plan_budget

COSTS = [StageCost("eval", fixed_s=30, scalable_s=60, min_scale=0.25),
         StageCost("ots", fixed_s=60, scalable_s=120, min_scale=0.25),
         StageCost("ssd", fixed_s=20, scalable_s=40, min_scale=0.5)]


def test_training_gets_what_is_left():
    plan = plan_budget(1200, COSTS, fixed_s=40, min_train_s=60, margin=0.05)
    stages = 90 + 180 + 60  # every stage at scale 1
    assert plan.train_s == pytest.approx(1200 - 60 - 40 - stages)
    assert plan.train_share(elapsed_s=40) == pytest.approx(1200 - 60 - 40 - stages)  # on time: the same share


def test_overrun_shrinks_later_stages_and_keeps_the_total():
    budget, margin = 1200, 0.05
    plan = plan_budget(budget, COSTS, fixed_s=40, min_train_s=60, margin=margin)
    t = 40 + plan.train_share(40)  # training ends on its share
    assert plan.start("eval", t) == 1.0
    plan.finish("eval", 90 * 1.25)  # 25 % over its prediction: the rest is predicted 25 % slower (drift) ...
    t += 90 * 1.25
    s_ots = plan.start("ots", t)
    left = budget - budget * margin - t
    # ... and must fit in what is left: 1.25 * (60 + 20 + (120 + 40) s) = left
    assert s_ots == pytest.approx((left / 1.25 - 80) / 160) and 0.25 < s_ots < 1
    assert plan.stages["ots"].planned_s == pytest.approx(1.25 * (60 + 120 * s_ots))
    actual = plan.stages["ots"].planned_s  # it takes what it was given
    plan.finish("ots", actual)
    t += actual
    s_ssd = plan.start("ssd", t)
    t += plan.stages["ssd"].planned_s
    assert s_ssd < 1 and t == pytest.approx(budget - budget * margin)  # the budget holds


def test_floors_hold_and_the_total_then_grows():
    plan = plan_budget(1200, COSTS, fixed_s=40, min_train_s=60)
    plan.train_share(40)
    assert plan.start("eval", 1190) == 0.25  # out of time: every later stage at its floor, not below
    plan.finish("eval", 45)
    assert plan.start("ots", 1235) == 0.25 and plan.start("ssd", 1300) == 0.5


def test_no_budget_keeps_every_stage_whole():
    plan = plan_budget(None, COSTS, fixed_s=40, min_train_s=60)
    assert plan.train_share(10) == 0.0
    for c in COSTS:
        assert plan.start(c.name, 1e6) == 1.0 and plan.stages[c.name].planned_s == c.fixed_s + c.scalable_s


def test_tight_budget_shrinks_up_front_and_too_small_is_refused():
    # 300 s: 15 margin + 40 fixed + 60 training leave 185 s for stages that want 330 at scale 1
    plan = plan_budget(300, COSTS, fixed_s=40, min_train_s=60, margin=0.05)
    shares = {n: p.share_s for n, p in plan.stages.items()}
    assert sum(shares.values()) == pytest.approx(185) and plan.train_s == pytest.approx(60)
    assert all(shares[c.name] < c.fixed_s + c.scalable_s for c in COSTS)
    with pytest.raises(ValueError, match="budget of 2.0 min cannot hold"):
        plan_budget(120, COSTS, fixed_s=40, min_train_s=60)


def test_a_stage_cost_counts_its_knobs():
    """`vary`: the shrinkable part is what the knobs cost at a scale (a step function of whole rounds), not a line."""
    rounds = lambda s: max(3, round(10 * s))  # noqa: E731  3..10 rounds of 2 s
    c = StageCost("eval", fixed_s=30, scalable_s=20, min_scale=0.3, vary=lambda s: 2.0 * rounds(s))
    assert [c.at(s) for s in (1.0, 0.5, 0.3)] == [50.0, 40.0, 36.0]
    plan = plan_budget(300, [c], fixed_s=0, min_train_s=60, margin=0.0)
    plan.train_share(0)
    assert plan.start("eval", 300 - 41) == pytest.approx(0.5, abs=0.05)  # 41 s left: 5 rounds (40 s) fit, 6 do not
    assert plan.stages["eval"].planned_s == 40.0


def test_reused_stages_are_done_not_work_left():
    """Review finding 2: a stage an earlier invocation made is done in the plan (its recorded plan and wall time),
    so the stage that runs is not shrunk for work that will never happen, and it is not in the drift correction.
    Reference: 130 s left for the one stage that runs (110 s at scale 1) -> scale 1."""
    costs = [StageCost("eval", 10, 100), StageCost("ssd", 10, 100)]
    plan = plan_budget(600, costs, fixed_s=0, min_train_s=60, margin=0.0)
    plan.train_share(0)
    plan.reuse("eval", planned_s=110.0, actual_s=300.0, scale=0.5)  # it overran 3x in its own invocation
    assert plan.start("ssd", 600 - 130) == 1.0 and plan.drift() == 1.0
    d = plan.to_dict()["stages"]["eval"]
    assert (d["planned_s"], d["actual_s"], d["scale"], d["reused"]) == (110.0, 300.0, 0.5, True)


def test_a_rerun_of_the_last_stages_is_not_refused_for_work_done():
    """Review finding 2: with training and the early stages reused, planning counted them (and a minute of training)
    and refused a re-run of the last stage on a slow box; now only what runs is planned and nothing is refused."""
    costs = [StageCost("eval", 500, 500), StageCost("ssd", 10, 100)]  # eval alone does not fit at its floor
    with pytest.raises(ValueError, match="cannot hold"):
        plan_budget(600, costs, fixed_s=0, min_train_s=60)
    plan = plan_budget(600, costs, fixed_s=0, min_train_s=None, reused={"eval": (700.0, 650.0, None)})
    assert plan.train_reused and plan.stages["eval"].reused and plan.stages["ssd"].share_s == pytest.approx(110)
    assert plan.start("ssd", 20) == 1.0


def test_training_floor_shrinks_the_stages_first_and_says_when_it_is_cut():
    """Review finding 11: training absorbed every slow-down before any stage shrank. With a floor, the stages shrink
    toward their floors first; when even their floors leave training less, it gets what they leave and the plan says
    so (with the budget that would have held the floor). Sums written out here."""
    costs = [StageCost("a", 50, 200, min_scale=0.25), StageCost("b", 50, 100, min_scale=0.5)]  # 450 s; floors 200 s
    room = 1000 - 40 - 60  # budget - margin (4 %) - fixed
    plan = plan_budget(1000, costs, fixed_s=60, min_train_s=60, train_floor_s=200)
    assert plan.train_s == pytest.approx(room - 400) and not plan.train_cut  # nothing to shrink: 500 >= 200
    plan = plan_budget(1000, costs, fixed_s=60, min_train_s=60, train_floor_s=600)
    s = (room - 600 - 100) / 300  # a + b at a common scale s (>= both floors) leave training exactly 600
    assert plan.train_s == pytest.approx(600) and not plan.train_cut
    assert plan.stages["a"].share_s == pytest.approx(50 + 200 * s) and plan.stages["b"].share_s == pytest.approx(50 + 100 * s)
    plan = plan_budget(1000, costs, fixed_s=60, min_train_s=60, train_floor_s=800)
    assert plan.train_cut and plan.train_s == pytest.approx(room - 200)  # the stages at their floors: 100 + 100
    assert plan.floor_budget_s == pytest.approx((200 + 60 + 800) / 0.96)
    assert plan.to_dict()["train_cut"] is True


class FakeClock:
    """perf_counter for snlp.bench.budget: each timed call advances it by the next of `durations`."""

    def __init__(self, durations):
        self.now, self.durations = 0.0, list(durations)

    def perf_counter(self):
        return self.now

    def step(self):
        self.now += self.durations.pop(0)


@pytest.mark.parametrize("durations, reps, retries, price", [
    ([12.0, 4.0], 2, [], 4.0),  # two steps, one under a spike: the faster is the price (it took the slower)
    ([12.0, 4.0, 4.1], 3, [3.9, 3.8], 4.0),  # three that spread past SPREAD_RETRY: two more, the middle of five
    ([4.0, 12.0, 4.1], 3, [4.2, 11.0], 4.2),  # two spikes in five: still an unspiked step
    ([4.0, 4.4, 4.2], 3, [], 4.2),  # no spread: no retry
])
def test_a_load_spike_does_not_price_the_training_budget(monkeypatch, durations, reps, retries, price):
    """A probe under a load spike priced a speedrun's training step at 12.01 s (the slower of its two steps) where
    training stepped at 4.06 s: the floor looked out of reach, every later stage was priced 3x too and 10 of 20
    minutes went unused. A spike only slows a call: the price is the steps' low median, with two more steps when
    they spread."""
    import snlp.bench.budget as B

    clock = FakeClock([0.5] + durations + retries + [99.0])  # the untimed warm-up first
    monkeypatch.setattr(B, "time", clock)
    alone, lockstep, got = B.time_steps({"idn": clock.step, "noreg": lambda: None}, reps, side_by_side=True)
    assert got["idn"] == pytest.approx(durations + retries)
    assert alone["idn"] == lockstep == pytest.approx(price)  # the lockstep waits for the slower (noreg took no time)


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), 0.0, -60.0])
def test_a_budget_that_is_no_positive_finite_number_is_refused(budget):
    """plan_budget(nan) passed the `<= 0` check and planned NaN seconds of training (inf: NaN too, inf - inf); every
    budget that is not a finite number > 0 is refused in one line before anything is planned."""
    with pytest.raises(ValueError, match="finite number of seconds > 0"):
        plan_budget(budget, [StageCost("eval", 10.0, 20.0)], fixed_s=5.0, min_train_s=60.0)


def test_a_refused_budget_names_one_that_a_rerun_priced_within_this_probes_spread_accepts():
    """The refusal said "needs at least 3.0 min" of a need of 3.04 min (rounded to the nearest tenth: refused when
    given), and it priced the stages from one probe, which every run repeats: a rerun whose probe timed the box as
    slowly as this one's slowest sample refused a budget just above the one it named. The need is now rounded up,
    and the message says the probe is re-timed on every run, how far its timings ranged above its prices, and names
    the budget that holds with every stage priced at that slowest timing. Sums written out here."""
    import dataclasses

    from snlp.bench.budget import Probe

    def costs(window_s):  # an evaluation stage priced from the probe's window time
        return [StageCost("eval", fixed_s=100 * window_s, scalable_s=200 * window_s, min_scale=0.25)]

    need = (100 * 0.5 + 0.25 * 200 * 0.5 + 40 + 60) / 0.96 / 60  # 3.04 min
    slow = (100 * 0.65 + 0.25 * 200 * 0.65 + 40 + 60) / 0.96 / 60  # 3.43 min
    with pytest.raises(ValueError) as e:
        plan_budget(120, costs(0.5), fixed_s=40, min_train_s=60, margin=0.04, probe=Probe(1.0, 0.5, 0.01))
    assert "it needs at least 3.1 min" in str(e.value) and 3.0 < need < 3.1, e.value
    pr = dataclasses.replace(Probe(1.0, 0.5, 0.01), train_samples_s={"idn": [1.0, 1.05, 1.0]},
                             **{"window_samples_s": [0.5, 0.65, 0.5], "decode_samples_s": [0.16, 0.16, 0.17]})
    assert pr.spread() == pytest.approx(0.65 / 0.5 - 1)  # the window's slowest call, the widest of the three
    kw = dict(fixed_s=40, min_train_s=60, margin=0.04, probe=pr)
    with pytest.raises(ValueError) as e:
        plan_budget(120, costs(0.5), **kw)
    msg = str(e.value)
    assert "it needs at least 3.1 min at this run's prices" in msg, msg
    assert "the probe times the box again on every run, and its timings here ranged up to 30% above" in msg, msg
    assert msg.endswith("so give --budget 3.5 or more (the stages priced at those slowest timings)") and slow < 3.5
    plan_budget(3.1 * 60, costs(0.5), **kw)  # the need it names holds at its own prices
    with pytest.raises(ValueError, match="cannot hold"):  # a rerun whose probe is as slow as this one's slowest
        plan_budget(3.1 * 60, costs(0.65), **kw)
    plan_budget(3.5 * 60, costs(0.65), **kw)  # ... holds the budget the message tells the user to give


def test_the_probe_keeps_every_timed_call_behind_its_prices():
    """`Probe.spread` reads the samples the probe priced from: each price is the low median of the samples kept
    (a decode round's per token), so the spread a refusal names is of the very calls that set the prices."""
    from snlp.bench.budget import median_low, probe
    from snlp.model.gpt import GPTConfig

    pr = probe(GPTConfig(vocab_size=61, n_layer=2, n_head=2, n_kv_head=1, n_embd=16, sequence_len=16), 2,
               train_steps=3, decode_tokens=4)
    assert len(pr.window_samples_s) == len(pr.decode_samples_s) == 3 and len(pr.ref_samples_s) == 5
    assert pr.window_s == median_low(pr.window_samples_s) and pr.ref_s == median_low(pr.ref_samples_s)
    assert pr.decode_token_s == pytest.approx(median_low(pr.decode_samples_s) / 4, rel=1e-12)
    every = [*pr.train_samples_s.values(), pr.window_samples_s, pr.decode_samples_s, pr.ref_samples_s]
    assert pr.spread() == pytest.approx(max(max(ts) / sorted(ts)[(len(ts) - 1) // 2] - 1 for ts in every))

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

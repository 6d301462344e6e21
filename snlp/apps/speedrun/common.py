"""What the stages' cost models and shrink rules share: a plan's price in sequential windows, the scale at which a
stage's knobs sit at their floors, and the text that says what a scale shrank."""

from __future__ import annotations



from snlp.apps.report import layer_evaluations


def plan_factor(plan: str, depth: int) -> float:
    """A plan's teacher-forced cost in sequential windows of a `depth`-layer model (coarse; a CPU forward is FLOP
    bound, so a batched suffix evaluation costs its N layers): its layer evaluations per token (report.
    layer_evaluations: S + (K x evals per iteration + [init fwd]) N, the plan's own critical-path count with each
    batched evaluation weighted by N) over L. 0.25 + 0.75 K for the IDN/h0 plans at N = 3L/4 (the speedrun's grid);
    SmolLM2's 8-of-30-layer plans cost far less per K; DiagN and exact Newton add their probe and JVP passes; K = 0
    is the prefix alone."""
    return layer_evaluations(plan, depth) / depth


def ar_rows(plans: list[str]) -> list[str]:
    """The rows `snlp.eval.protocol.generations` decodes besides the sequential one: every plan, and each fused
    plan's AR Match reference model that is not itself a plan listed (as plan strings)."""
    from snlp.eval.protocol import generation_rows
    from snlp.method.plan import Plan

    return [name for name, plan in generation_rows([Plan.parse(p) for p in plans]).items() if plan is not None]


def ar_references(plans: list[str]) -> int:
    """How many AR Match reference models `snlp.eval.protocol.generations` decodes besides the sequential one and
    the plans: one per distinct fused model (CxFM with M > 1, run sequentially) that is not itself a plan listed."""
    from snlp.method.plan import Plan

    return len(ar_rows(plans)) - len({str(Plan.parse(p)) for p in plans})  # less the plans themselves


def floor_scale(pairs) -> float:
    """The scale at and below which every (n, floor) knob of a shrink is at its floor (fewer): the lowest of the knobs'
    own lo / n (the largest of them leaves a knob with a lower one above its floor); 1 if none shrinks."""
    return min((lo / n for n, lo in pairs if n > lo), default=1.0)


def fewer(n: int, scale: float, lo: int) -> int:
    """n scaled down (never up, never below lo unless n is)."""
    return min(n, max(lo, round(n * scale)))


def shrink_text(pairs: list[tuple[str, float, float]]) -> str:
    """ "prompts 8 -> 5, rounds 10 -> 6": the knobs a scale changed ("" when none)."""
    return ", ".join(f"{k} {a:g} -> {b:g}" for k, a, b in pairs if a != b)

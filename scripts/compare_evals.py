"""Compare `snlp eval --json` records of several checkpoints scored on the same validation windows (e.g. training arms
that differ only in their regulariser), with the paired 95 % intervals of snlp.apps.report (two-sided paired t over
the windows' cross-entropies, as the speedrun report tests its PPL ties).

    PYTHONPATH=$PWD python scripts/compare_evals.py noreg=runs/noreg.json idn=runs/idn.json rows25=runs/r25.json \
        [--against noreg]

Prints markdown: per arm and plan the PPL and ΔPPL against the arm's own sequential model with its interval; then
per plan each arm's ΔPPL against the `--against` arm's (the ratio (1 + ΔPPL_arm) / (1 + ΔPPL_ref) - 1, paired per
window) and each arm's sequential PPL against the reference arm's. An interval that holds 0 is a tie. A partial file
(`snlp eval` cut short after its teacher-forced phase: {"complete": false, ...}) is read too, and said to be partial.
A diverged plan (PPL inf, no per-window losses) is said to be diverged, in its row and in each ratio it enters.
"""

from __future__ import annotations

import argparse
import json

import math

from snlp.apps.report import delta_ppl_interval


def pct(v: float) -> str:
    return f"{100 * v:+.2f} %" if math.isfinite(v) else "diverged"


def diverged(r: dict) -> bool:
    """A plan whose solve turned non-finite: PPL inf and no per-window losses (snlp.eval.protocol.teacher_forced)."""
    ppl = r.get("ppl")
    return r.get("note") == "diverged" or not isinstance(ppl, (int, float)) or not math.isfinite(ppl)


def interval(iv) -> str:
    if iv is None:
        return "-"
    lo, hi = iv
    return f"[{pct(lo)}, {pct(hi)}]" + (" tie" if lo <= 0 <= hi else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("arms", nargs="+", help="NAME=PATH of an `snlp eval --json` file")
    ap.add_argument("--against", default=None, help="the reference arm (default: the first)")
    a = ap.parse_args()
    arms = {}
    for spec in a.arms:
        name, _, path = spec.partition("=")
        rows = json.loads(open(path).read())
        if isinstance(rows, dict):  # a run still going or cut short: its PPL columns are all this script reads
            if rows.get("complete") is not False or not isinstance(rows.get("records"), list):
                ap.error(f"{path} is not an `snlp eval --json` file (a list of records, or a partial run's object)")
            print(f"(arm {name}: {path} is PARTIAL, written before its run ended; it holds {rows.get('done')})\n")
            rows = rows["records"]
        if not all(isinstance(r, dict) and "plan" in r for r in rows):  # e.g. `snlp eval --harness --json`: methods
            ap.error(f"{path} is not an `snlp eval --json` file: its records have no `plan` (the harness's records "
                     f"hold no per-window losses to pair)")
        for r in rows:  # a diverged plan's PPL: "inf" in strict JSON (Infinity in files written before), a NaN null
            r.update({k: float(r[k]) for k in ("ppl", "delta_ppl") if isinstance(r.get(k), str)})
            r.update({k: math.nan for k in ("ppl", "delta_ppl") if k in r and r[k] is None})  # as NaN was read
        arms[name] = {r["plan"]: r for r in rows}
    ref = a.against or next(iter(arms))
    if ref not in arms:
        ap.error(f"--against {ref!r} is not one of the arms ({', '.join(arms)})")
    plans = [p for p in next(iter(arms.values())) if p != "sequential"]
    # the pairing the intervals assume, checked: every arm holds the sequential row and every plan, each row the
    # same number of windows of the same length over the same number of tokens (the records hold no window
    # offsets: same counts and lengths is what can be checked)
    for name, rs in arms.items():
        missing = [p for p in ["sequential", *plans] if p not in rs]
        if missing:
            ap.error(f"arm {name!r} has no row for {', '.join(missing)}: every arm must score the same plans")
    # a diverged row has no windows to pair (it was scored on the same ones until its solve turned non-finite)
    shapes = {(len(r.get("window_ce") or []), r.get("seq_len"), r.get("tokens"))
              for rs in arms.values() for p, r in rs.items() if p in ("sequential", *plans) and not diverged(r)}
    if len(shapes) != 1 or not next(iter(shapes))[0]:
        ap.error(f"the arms were not scored on the same validation windows (windows, window length, tokens: "
                 f"{sorted(shapes, key=str)}): paired intervals need the same windows")
    windows = next(iter(shapes))[0]
    print(f"Windows per row: [{windows}] (paired across rows and arms: the same validation windows)\n")
    print("| arm | plan | PPL | ΔPPL vs its sequential | 95 % interval |\n|---|---|---:|---:|---|")
    for name, rs in arms.items():
        seq = rs["sequential"]
        print(f"| {name} | sequential | {seq['ppl']:.2f} | - | - |")
        for p in plans:
            r = rs[p]
            print(f"| {name} | {p} | {r['ppl']:.2f} | {pct(r['delta_ppl'])} | "
                  f"{'-' if diverged(r) else interval(delta_ppl_interval(r['window_ce'], seq['window_ce']))} |")
    print(f"\nAgainst `{ref}` (paired per window; ΔPPL ratio = (1 + ΔPPL_arm) / (1 + ΔPPL_{ref}) - 1; "
          f"sequential = PPL_arm / PPL_{ref} - 1):\n")
    print("| arm | " + " | ".join(f"{p}: ΔPPL ratio [95 %]" for p in plans) + " | sequential PPL [95 %] |")
    print("|---|" + "---|" * (len(plans) + 1))
    rs0 = arms[ref]
    d0 = {p: [x - y for x, y in zip(rs0[p]["window_ce"], rs0["sequential"]["window_ce"])] for p in plans
          if not diverged(rs0[p])}
    for name, rs in arms.items():
        if name == ref:
            continue
        cells = []
        for p in plans:
            if diverged(rs[p]) or p not in d0:  # no ratio to a diverged side: say which side diverged
                cells.append("diverged" + ("" if diverged(rs[p]) else f" in {ref}"))
                continue
            d = [x - y for x, y in zip(rs[p]["window_ce"], rs["sequential"]["window_ce"])]
            iv = delta_ppl_interval(d, d0[p])
            ratio = (1 + rs[p]["delta_ppl"]) / (1 + rs0[p]["delta_ppl"]) - 1
            cells.append(f"{pct(ratio)} {interval(iv)}")
        seq = rs["sequential"]["ppl"] / rs0["sequential"]["ppl"] - 1
        seq_iv = delta_ppl_interval(rs["sequential"]["window_ce"], rs0["sequential"]["window_ce"])
        cells.append(f"{pct(seq)} {interval(seq_iv)}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

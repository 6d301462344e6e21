"""How the project's tables print perplexities and PPL changes: one rule, used by the terminal table, the
markdown tables and the speedrun report, so a blown-up plan reads the same everywhere.

The rule:
- a non-finite PPL (a plan whose solve diverged) prints as ``diverged``; None / NaN (not measured) as ``-``;
- PPL >= 1e4 prints in short scientific notation (``1.7e8``): digits after the point of a PPL in the
  millions are noise and a 12-character number reads as a precise, comparable value;
- ΔPPL (PPL / sequential PPL - 1) above +1000 % prints as the ratio to the sequential PPL (``×13.2``,
  ``×1.3e7``): "+1318860828.9%" hides the order of magnitude that matters; a non-finite ΔPPL is ``diverged``;
  otherwise the usual signed percentage (``+5.5%``).
"""

from __future__ import annotations

import math

PPL_SCI = 1e4  # a PPL at or above this prints in scientific notation
DELTA_RATIO = 10.0  # a ΔPPL above this (+1000 %) prints as the ratio ×(1 + ΔPPL)
DIVERGED = "diverged"
MISSING = "-"
# the rule in words, for the reports' table captions
RULE = ("PPL ≥ 10⁴ in scientific notation (1.7e8), ΔPPL above +1000 % as the PPL ratio to sequential (×1.3e7), "
        "a non-finite PPL as 'diverged'")


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def sci(x: float, digits: int = 1) -> str:
    """Short scientific notation: 174060849.26 -> '1.7e8', 2.5e-5 -> '2.5e-5' (no '+' or leading zeros
    in the exponent, unlike '{:.1e}', whose '1.7e+08' is wider and harder to read in a table column)."""
    mant, exp = f"{x:.{digits}e}".split("e")
    return f"{mant}e{int(exp)}"


def fmt_ppl(x, digits: int = 2) -> str:
    """A perplexity cell: '35.66', '1.7e8', 'diverged' (non-finite) or '-' (None / NaN)."""
    if _missing(x):
        return MISSING
    if not math.isfinite(x):
        return DIVERGED
    return sci(x) if abs(x) >= PPL_SCI else f"{x:.{digits}f}"


def fmt_delta_ppl(d, resolved: bool = False) -> str:
    """A ΔPPL cell from the relative change d = PPL / PPL_sequential - 1: '+5.5%', '-0.02%' (a change under
    0.05 % that one decimal would print as 0.0 %: two decimals), '×13.2', '×1.3e7',
    'diverged' (non-finite) or '-' (None / NaN). `resolved`: the table's test tells this change from zero (its
    paired-window interval excludes 0, so no "(tie)" follows the cell): a change under 0.005 % then prints with two
    significant digits ('+0.0036%', '+1.2e-7%'), not as '+0.0%', which beside no "(tie)" read as a resolved zero;
    an unresolved one keeps '+0.0%' (round-off of a K >= C plan) and its "(tie)"."""
    if _missing(d):
        return MISSING
    if not math.isfinite(d):
        return DIVERGED
    if d > DELTA_RATIO:
        ratio = 1.0 + d
        return "×" + (sci(ratio) if ratio >= PPL_SCI else f"{ratio:.1f}")
    if resolved and 0 < abs(d) < 0.00005:
        pct = 100 * abs(d)
        decimals = 1 - math.floor(math.log10(pct))  # two significant digits
        return ("+" if d > 0 else "-") + (f"{pct:.{decimals}f}" if decimals <= 6 else sci(pct)) + "%"
    if 0.00005 <= abs(d) < 0.0005:  # would read "+0.0%" / "-0.0%" beside an exact zero though a test may resolve it
        return f"{d:+.2%}"
    return f"{d:+.1%}"


def fmt_share(x, digits: int = 1, sep: str = "") -> str:
    """A share of positions in [0, 1] (Top-1, AR Match) as a percentage with `digits` decimals ('93.3%'), '-' for
    None / NaN; a share strictly between 0 and 1 gets as many more decimals as keep it off '100.0%' and '0.0%'
    (0.99951 -> '99.95%'): a plan that disagrees with sequential at 1 of 2,048 positions printed '100.0%', the cell
    of sequential itself and of an exact plan. `sep` goes between the number and '%' (' %' in some tables)."""
    return MISSING if _missing(x) else _inside(100 * x, 100.0, digits) + f"{sep}%"


def fmt_fraction(x, digits: int = 3) -> str:
    """A share in [0, 1] as a fraction ('0.961'), by fmt_share's rule: 0.99951 prints '0.9995', not '1.000'."""
    return MISSING if _missing(x) else _inside(x, 1.0, digits)


def _inside(x: float, top: float, digits: int) -> str:
    """x in [0, top] with `digits` decimals, more where fewer would round a value strictly inside onto an end."""
    d = digits
    while 0.0 < x < top and f"{x:.{d}f}" in (f"{top:.{d}f}", f"{0:.{d}f}") and d < 12:
        d += 1
    return f"{x:.{d}f}"


def ppl_from_ce(ce: float) -> float:
    """exp(cross-entropy) as a PPL, inf instead of OverflowError for a CE above ~709 (an early or
    diverged training run), so the PPL formatter can say 'diverged' instead of the report crashing."""
    try:
        return math.exp(ce)
    except OverflowError:
        return math.inf


def format_number(x: float) -> str:
    """The plan-string form of a float that parses back to exactly x: the short `:g` form where that is
    exact (0.5, 0.001, 1e-05), else repr's shortest round-trip digits (0.1000001, not :g's 0.1), so
    `Plan.parse(str(p)) == p` and result rows keyed by `str(plan)` never merge two different plans."""
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


NOT_COMPARED = "n/a"  # a sampled run's "equals sequential" cell: two sides' own draws, nothing to compare


def matches(x: bool | None, yes: str = "yes", no: str = "NO") -> str:
    """An "output equals sequential" cell (SSDRow.matches_sequential and its copies): `yes` / `no` for a greedy run,
    ``n/a`` for None, a sampled run's (each side draws its own tokens: the same law, not the same draws)."""
    return NOT_COMPARED if x is None else yes if x else no

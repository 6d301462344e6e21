"""The whole analysis: `analyze` runs the selected sections (AnalysisConfig.only) into one
AnalysisResult; `write` puts it into a folder as analysis.md (paper-style tables), analysis.json and
PNG plots; `report_section` is the short markdown block the speedrun report embeds."""

from __future__ import annotations

import json
import math
import platform
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from snlp.eval.analysis.common import WINDOWED, AnalysisConfig, fmt
from snlp.eval.analysis.earlyexit import ExitRow, early_exit
from snlp.eval.analysis.elk import ElkResult, PreheatResult, check_fits, elk_sweep, preheat_calibrations
from snlp.eval.analysis.jacobi import JacobiResult, jacobi_coupling
from snlp.eval.analysis.jacobian import JacobianResult, jacobian_diagnostics
from snlp.eval.analysis.ordering import OrderingResult, correction_ordering
from snlp.eval.analysis.plots import jacobian_plot, ordering_plot, propagation_plot
from snlp.eval.analysis.propagation import PropagationResult, correction_propagation
from snlp.eval.analysis.tables import (early_exit_table, elk_table, jacobi_table, jacobian_table, ordering_summary,
                                       ordering_tables, preheat_table, propagation_table)
from snlp.method.preheat import Preheat
from snlp.model.gpt import GPT, eval_mode
from snlp.runtime.device import json_text, write_atomic
from snlp.runtime.load import load_average
from snlp.runtime.outputs import make_folders, partial_line


@dataclass
class Environment:
    """Where and when the analysis ran: its timings are only comparable on a similar, similarly loaded box."""

    date: str
    torch: str
    python: str
    machine: str
    loadavg_1min_start: str
    loadavg_1min_end: str | None = None


@dataclass
class AnalysisResult:
    checkpoint: str
    config: AnalysisConfig
    environment: Environment
    model_seq_len: int | None = None  # the context the model was trained for (a longer seq_len extrapolates RoPE)
    seconds: dict[str, float] = field(default_factory=dict)  # section name -> wall time
    jacobian: JacobianResult | None = None
    ordering: OrderingResult | None = None
    propagation: PropagationResult | None = None
    early_exit: list[ExitRow] | None = None
    elk: ElkResult | None = None
    preheat: PreheatResult | None = None
    jacobi: JacobiResult | None = None


def _loadavg() -> str:
    """The 1-min load average as /proc/loadavg writes it ("0.52"); "n/a" where there is none."""
    load = load_average()
    return "n/a" if load is None else f"{load:.2f}"


def environment() -> Environment:
    return Environment(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
                       python=platform.python_version(),
                       machine=f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
                       loadavg_1min_start=_loadavg())


def past_context(cfg: AnalysisConfig, trained: int | None) -> bool:
    """Whether a section in cfg.only reads windows of cfg.seq_len tokens longer than the model's trained context.
    Jacobi decoding alone reads no window: its default seq_len past a short context extrapolates nothing, and the
    --seq-len the warning would ask for is refused there (snlp analyze: an option no section reads)."""
    return trained is not None and cfg.seq_len > trained and bool(set(cfg.only) & set(WINDOWED))


def check_model(model: GPT, cfg: AnalysisConfig, preheat: Preheat | None = None) -> None:
    """The settings' one-line errors for this model, before any work (`snlp analyze` calls it before the validation
    data is read). `preheat`: the checkpoint's calibration, which elk uses instead of fitting one."""
    cfg.check(model.config.n_layer)
    check_fits(model, cfg, preheat)
    if model.config.backout and "ordering" in cfg.only:
        raise ValueError("the ordering section runs Seq-Perm, which nanochat's backout does not define (it reads a "
                         "layer's output at a fixed depth): leave ordering out of --only for this model")


def analyze(model: GPT, val_tokens, cfg: AnalysisConfig = AnalysisConfig(), checkpoint: str = "",
            preheat: Preheat | None = None, on_section=None) -> AnalysisResult:
    """Run the selected sections (cfg.only) on `model` with validation token ids `val_tokens`. `preheat`: the
    checkpoint's calibration for the ELK x init sweep (one is fitted on random tokens when None). `on_section(res)`:
    called with the result so far after each section but the last (a section is tens of seconds to minutes on a CPU;
    `snlp analyze` writes them as they finish, so a run cut short keeps them)."""
    check_model(model, cfg, preheat)
    L = model.config.n_layer
    trained = model.config.sequence_len
    if past_context(cfg, trained):  # RoPE's tables cover any position (GPT.rotary): it runs, as extrapolation
        warnings.warn(f"seq_len {cfg.seq_len} is past the model's sequence_len {trained} (the context it was trained "
                      f"for): every section measures extrapolation past it, not the model as trained; pass --seq-len "
                      f"{trained} or less", stacklevel=2)
    with eval_mode(model):  # a caller's model leaves with every submodule in the mode it came in
        res = AnalysisResult(checkpoint=str(checkpoint), config=replace(cfg), environment=environment(),
                             model_seq_len=trained)  # config: a snapshot
        steps = [("jacobian", lambda: jacobian_diagnostics(model, val_tokens, cfg)),
                 ("ordering", lambda: correction_ordering(model, val_tokens, cfg)),
                 ("propagation", lambda: correction_propagation(model, val_tokens, cfg)),
                 ("early-exit", lambda: early_exit(model, val_tokens, cfg.suffix_sizes(L), cfg.eval_config())),
                 ("elk", lambda: elk_sweep(model, val_tokens, cfg, preheat)),
                 ("preheat", lambda: preheat_calibrations(model, val_tokens, cfg)),
                 ("jacobi", lambda: jacobi_coupling(model, val_tokens, cfg))]
        for name, fn in steps:
            if name not in cfg.only:
                continue
            t0 = time.perf_counter()
            setattr(res, name.replace("-", "_"), fn())
            res.seconds[name] = round(time.perf_counter() - t0, 1)
            if cfg.progress:
                print(f"analyze: {name} done in {res.seconds[name]:.1f}s", file=sys.stderr)
            if on_section is not None and len(res.seconds) < len([n for n, _ in steps if n in cfg.only]):
                on_section(res)
        end = _loadavg()
        res.environment.loadavg_1min_end = None if end == "n/a" else end
        return res


def _header(res: AnalysisResult) -> list[str]:
    env = res.environment
    return [f"# SNLP analysis of `{res.checkpoint}`", "",
            f"{env.date}; {env.machine}; torch {env.torch}; 1-min load average {env.loadavg_1min_start} (start) / "
            f"{env.loadavg_1min_end or 'n/a'} (end); section times (s): {res.seconds}.", "",
            *([f"Windows of {res.config.seq_len} tokens are past the model's sequence_len {res.model_seq_len}: the "
               f"numbers measure RoPE extrapolation, not the model as trained.", ""]
              if past_context(res.config, res.model_seq_len) else [])]


def _jacobian_md(j: JacobianResult) -> list[str]:
    change = max((d.sigma_rel_change for d in j.layers), default=float("nan"))
    return ["## Jacobian diagnostics", "",
            f"Suffix N = {j.suffix} (h_S = the state after the first L - N layers; layers are 0-based), "
            f"{j.windows} windows of {j.seq_len} tokens; σmax by {j.power_iters} power iterations (largest "
            f"relative change in the last one: {change:.2e}); ‖J‖_F per token from {j.probes} Hutchinson probes; "
            f"amp. = ‖J_f v‖/‖v‖ over {j.probes} Gaussian probes.", "", jacobian_table(j), ""]


def _sections_md(res: AnalysisResult) -> dict[str, list[str]]:
    """Each section that ran -> its markdown lines (title, note, tables)."""
    out = {}
    if res.jacobian:
        out["jacobian"] = _jacobian_md(res.jacobian)
    if res.ordering:
        out["ordering"] = ["## Correction ordering", "", "Summary (paper Table ordering_summary):", "",
                           ordering_summary(res.ordering), "", ordering_tables(res.ordering), ""]
    if p := res.propagation:
        out["propagation"] = ["## Correction propagation", "", f"N = {p.N}: PPL with only the last j suffix layers "
                              "active (the others skipped)" + (f", over {p.tokens} predicted tokens per cell (the section "
                              "reads whole windows of seq_len up to `prop_tokens`, 512 by default, of --max-tokens, "
                              "or one whole window where seq_len is longer: it solves 2 N^2 cells)"
                              if p.tokens else "")
                              + ".", "", propagation_table(p), ""]
    if res.early_exit:
        out["early-exit"] = ["## Early exit (K = 0)", "", early_exit_table(res.early_exit), ""]
    if e := res.elk:
        out["elk"] = ["## ELK tempering x init", "", f"N = {e.N}, K = {e.iters}, sequential PPL "
                      f"{fmt(e.sequential_ppl)}; preheat calibration: {e.preheat_source}.", "", elk_table(e), ""]
    if p := res.preheat:
        out["preheat"] = ["## Preheat calibration", "", f"N = {p.N}, rank {p.rank}, K = 1, ELK 0; the data "
                          f"calibration read {p.data_tokens or 'validation tokens'}.", "",
                          preheat_table(p), ""]
    if j := res.jacobi:
        out["jacobi"] = ["## Jacobi decoding x SNLP (unverified)", "", f"{j.prompts} prompts, {j.gen_tokens} new "
                         f"tokens each, lookahead window W = {j.window}; match vs sequential greedy.", "",
                         jacobi_table(j), ""]
    return out


def to_markdown(res: AnalysisResult, plots: dict[str, str] | None = None, complete: bool = True) -> str:
    """analysis.md: every section that ran, each followed by its plot (plots: section -> PNG file name); not
    `complete`: marked partial below the title (the sections finished so far)."""
    plots = plots or {}
    out = _header(res)
    if not complete:
        out[1:1] = ["", partial_line(f"the sections finished so far ({', '.join(res.seconds)})")]
    for name, lines in _sections_md(res).items():
        out += lines
        if name in plots:
            out += [f"![{name}]({plots[name]})", ""]
    settings = {k: v for k, v in asdict(res.config).items() if k != "progress"}
    out += [f"Settings: `{json.dumps(settings)}`", ""]
    return "\n".join(out)


def report_section(res: AnalysisResult) -> str:
    """A short markdown diagnostics section for the speedrun report: Jacobian table, ordering summary
    and early exit, whichever were run."""
    out = ["### SNLP diagnostics (snlp analyze)", ""]
    if res.jacobian:
        out += [jacobian_table(res.jacobian), ""]
    if res.ordering:
        out += [ordering_summary(res.ordering), ""]
    if res.early_exit:
        out += [early_exit_table(res.early_exit), ""]
    return "\n".join(out)


def write_plots(res: AnalysisResult, out: Path) -> dict[str, str]:
    """The PNG plots of the sections that ran, into `out`; returns section -> file name."""
    made = {}
    if res.jacobian and res.jacobian.layers:
        jacobian_plot(res.jacobian, out / "jacobian.png")
        made["jacobian"] = "jacobian.png"
    if res.ordering:
        ordering_plot(res.ordering, out / "ordering.png")
        made["ordering"] = "ordering.png"
    if res.propagation:
        propagation_plot(res.propagation, out / "propagation.png")
        made["propagation"] = "propagation.png"
    return made


def _jsonable(obj):
    """JSON has no inf / nan: diverged PPLs become "inf" / "-inf", nan becomes null; int keys become strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


PLOTS = ("jacobian.png", "ordering.png", "propagation.png")  # every file write_plots may make


def write(res: AnalysisResult, out, complete: bool = True) -> Path:
    """Write analysis.json, the PNG plots and analysis.md into the folder `out`, each atomically. The results go
    first, so a plot that fails loses none of the computed sections (minutes on a CPU); the plots of sections this run
    did not make are removed, so that a folder reused with a smaller --only describes this run alone. `complete`
    False: written after a section while the run goes on (its JSON says "complete": false, its markdown PARTIAL)."""
    out = Path(out)
    make_folders(out)
    write_atomic(out / "analysis.json", json_text({"complete": complete, **_jsonable(asdict(res))}, indent=1))
    for name in (*PLOTS, "analysis.md"):  # an earlier run's, before any plot: a plot that fails must not leave them
        (out / name).unlink(missing_ok=True)  # beside this run's analysis.json as if they described it
    plots = write_plots(res, out)
    write_atomic(out / "analysis.md", to_markdown(res, plots, complete))
    return out

"""ELK tempering x init, and preheat calibrations (App. "ELK Tempering and Preheat Initialization"):
  elk      PPL over ELK a x init {h0, fwd, preheat} x chunkings of N layers at K = 1; preheat from the
           checkpoint's calibration (preheat=) or a random-token one fitted here.
  preheat  preheat calibrated on random tokens vs on data, per chunking (K = 1, a = 0), h0 alongside.
Every use of snlp.method.preheat is in `preheat_ppls`, so a change of the preheat API is one edit."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from snlp.eval.analysis.common import AnalysisConfig, plan_ppl, section_bar, sequential_ppl, window_ppl
from snlp.eval.data import as_tokens, windows
from snlp.method.plan import Plan
from snlp.method.preheat import CalibrateConfig, Preheat, x0_width
from snlp.method.preheat import fit as fit_preheat
from snlp.method.solver import preheat_for, solve
from snlp.model.gpt import GPT

INITS = ("h0", "fwd", "preheat")


@dataclass
class ElkRow:
    alpha: float  # ELK a
    init: str  # h0 | fwd | preheat
    chunking: str  # CxFM
    ppl: float


@dataclass
class ElkResult:
    N: int
    iters: int
    sequential_ppl: float
    preheat_source: str
    rows: list[ElkRow]  # a-major, then init, then chunking (the sweep's order)


@dataclass
class PreheatRow:
    calibration: str  # h0 (no preheat) | random | data
    chunking: str  # CxFM
    ppl: float  # at K = 1


@dataclass
class PreheatResult:
    N: int
    rank: int  # of both fits: --preheat-rank, capped at the embedding width (fit_states keeps at most that many)
    rows: list[PreheatRow]  # calibration-major, then chunking
    data_tokens: str = ""  # which validation tokens the data calibration read (after the PPL windows, or the same)


def chunkings(N: int, chunks: tuple[int, ...]) -> list[tuple[int, int]]:
    """(C, M) pairs with C * M = N for the requested C values (0 = N); those not dividing N dropped."""
    out = []
    for c in chunks:
        c = N if c == 0 else c
        if 1 <= c <= N and N % c == 0 and (c, N // c) not in out:
            out.append((c, N // c))
    return out


def fit_config(cfg: AnalysisConfig) -> CalibrateConfig:
    """The settings of the preheat fits made here (random tokens, or data): --preheat-rank, windows of --seq-len."""
    return CalibrateConfig(rank=cfg.preheat_rank, seed=cfg.seed, seq_len=cfg.seq_len)


def check_fits(model: GPT, cfg: AnalysisConfig, preheat: Preheat | None = None) -> None:
    """The one-line refusal of a preheat fit the selected sections would make and could not (e.g. a rank above the
    batch x seq_len calibration tokens), before any section runs: elk fits one unless given the checkpoint's."""
    if "preheat" in cfg.only or ("elk" in cfg.only and preheat is None):
        fit_config(cfg).check(model)


def preheat_ppls(model: GPT, wins: Tensor, plans: list[Plan], cfg: AnalysisConfig, calibration: str = "given",
                 tokens: Tensor | None = None, bar=None, preheat: Preheat | None = None) -> tuple[str, list[float]]:
    """PPL of each plan over `wins`, the preheat plans with a calibration: "given" = `preheat` (the
    checkpoint's), or one fitted here on random tokens when none is given; "random" / "data" = one fitted
    here on random tokens / on `tokens`. Returns (where the calibration came from, the PPLs).
    The one place the analysis touches preheat."""
    if calibration == "given" and preheat is not None:
        pre, source = preheat, f"the checkpoint's ({preheat.source} tokens, rank {preheat.rank})"
    else:
        pre = fit_preheat(model, fit_config(cfg), tokens if calibration == "data" else None)
        # pre.rank, not cfg.preheat_rank: the fit keeps at most the embedding width's directions (fit_states)
        source = (f"fitted here on random tokens, rank {pre.rank} (no preheat.pt given)"
                  if calibration == "given" else calibration)
    ppls = []
    for plan in plans:
        p = preheat_for(plan, pre)
        ppls.append(window_ppl(model, wins, lambda x: solve(model, x, plan, check_finite=False, preheat=p).hidden,
                               cfg.batch))
        if bar is not None:
            bar.update()
    return source, ppls


def elk_sweep(model: GPT, val_tokens, cfg: AnalysisConfig = AnalysisConfig(), preheat: Preheat | None = None
              ) -> ElkResult:
    """PPL over ELK a x init {h0, fwd, preheat} x chunkings at N = cfg.elk_suffix, K = 1."""
    N = min(cfg.elk_suffix, model.config.n_layer)
    wins = windows(as_tokens(val_tokens), cfg.seq_len, cfg.max_tokens)
    cells = [(a, init, C, M) for a in cfg.elk_values for init in INITS for C, M in chunkings(N, cfg.elk_chunks)]
    plans = [Plan(chunks=C, fuse=M, init=init, iters=1, elk=a) for a, init, C, M in cells]
    with section_bar(len(plans), "elk x init", cfg) as bar:
        source, ppls = preheat_ppls(model, wins, plans, cfg, bar=bar, preheat=preheat)
    rows = [ElkRow(alpha=a, init=init, chunking=f"{C}xF{M}", ppl=p) for (a, init, C, M), p in zip(cells, ppls)]
    return ElkResult(N=N, iters=1, sequential_ppl=sequential_ppl(model, wins, cfg.batch), preheat_source=source,
                     rows=rows)


def preheat_calibrations(model: GPT, val_tokens, cfg: AnalysisConfig = AnalysisConfig()) -> PreheatResult:
    """K = 1 PPL with preheat calibrated on random tokens vs on validation data (the windows after
    the PPL windows where the split is long enough, else the same ones), h0 alongside."""
    N = min(cfg.elk_suffix, model.config.n_layer)
    toks = as_tokens(val_tokens)
    wins = windows(toks, cfg.seq_len, cfg.max_tokens)
    used = wins.shape[0] * cfg.seq_len + 1  # the windows' inputs and targets: tokens 0 .. W * seq_len
    ccfg = fit_config(cfg)
    after = toks.numel() - used >= ccfg.batch * cfg.seq_len
    calib_data = toks[used:] if after else toks
    n = min(ccfg.batch, calib_data.numel() // cfg.seq_len)
    data_tokens = (f"{n} windows of {cfg.seq_len} validation tokens " + ("after the PPL windows" if after else
                   "from the split's start, where the PPL windows are (too few tokens after them)"))
    chunks = chunkings(N, cfg.elk_chunks)
    rows = []
    with section_bar(3 * len(chunks), "preheat", cfg) as bar:
        for C, M in chunks:
            rows.append(PreheatRow("h0", f"{C}xF{M}", plan_ppl(model, wins, Plan(chunks=C, fuse=M, iters=1), cfg.batch)))
            bar.update()
        plans = [Plan(chunks=C, fuse=M, init="preheat", iters=1) for C, M in chunks]
        for name in ("random", "data"):
            _, ppls = preheat_ppls(model, wins, plans, cfg, calibration=name, tokens=calib_data, bar=bar)
            rows += [PreheatRow(name, f"{C}xF{M}", p) for (C, M), p in zip(chunks, ppls)]
    return PreheatResult(N=N, rank=min(cfg.preheat_rank, x0_width(model)), rows=rows, data_tokens=data_tokens)

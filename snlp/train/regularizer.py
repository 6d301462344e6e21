"""SNLP-aware training regulariser (paper Sec. "SNLP-Aware Training", Eq. snlp-training-loss):

    L = L_CE + lambda * sum_{N in S} sum_{l in T_N} ||h_hat_l(N, K=1; A) - h_l^seq||_2 / (||h_l^seq||_2 + eps)

h_hat comes from the REAL K=1 SNLP solve (`solver.solve`, h0 init, one layer per chunk) of the plan
`RegConfig.plan(N)`, whose surrogate A is the config's typed surrogate (snlp.method.surrogates). Norms are
over the hidden dim; the ratio is averaged over batch and positions, computed in fp32. With mHC
(states (B, T, n, D)) the ratio is taken per stream (norms over D) and averaged over the streams too, as the
paper's code (nanochat-snlp gpt.py, mhc_newton_reg: states (B*n, T, D), `.norm(dim=-1)`, `.mean()`) computes it.
T_N: stride 0 = {L}; stride s > 0 = the layers S + s, S + 2s, ... counted from the suffix's start, and L always
(S + 1 never: the K=1 state there is exactly the sequential one), as the paper's code picks them
(`(j + 1) % idn_stride == 0 or j == n_par - 1`, j >= 1 the suffix layer's index).

`rows` (F, `--reg-rows`): the K=1 solve runs on the first r = ceil(F * B) rows of each (B, T) micro-batch only, the
CE on all B. The term is a mean over rows and positions, so it is NOT rescaled: the data loader draws each row at
random, so the first rows are a random subset and the subset's mean has the full batch's expectation (a padded
SFT batch's term is a mean over its real tokens: the subset's masked sum is then divided by r / B of the whole
batch's real-token count, not by its own, which keeps that expectation exact), with more variance (the row draw's part B / r ~ 1/F times, rows being independent). The solve's cost scales with
the rows: its extra FLOPs per token are r / B ~ F times F = 1's (`snlp.train.flops`). The row count is a Python
int of the static batch shape, so a compiled step keeps one graph. F = 1 is the paper's objective exactly: nothing
is sliced.

`diag` (DiagN): the solve estimates diag(J) with the Plan defaults, one FD Hutchinson probe drawn afresh each
call (`snlp_states(fresh_probes=True)`: a fixed probe would bias every step the same way) (one
extra batched chunk forward, the cheapest estimator; paper App. "Diagonal-Jacobian Correction
Results"), and the estimate is detached (snlp.method.jacobian): gradients flow through the chunk
forwards tilde and b = tilde - h, while a, like IDN's A = I, only preconditions the correction.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from snlp.method.jacobian import check_fd_step
from snlp.method.surrogates import DiagN, Identity, Surrogate, parse_surrogate
from snlp.method.plan import Plan
from snlp.method.solver import solve

EPS = 1e-6


@dataclass
class RegConfig:
    """The regulariser's settings. `surrogate`: the K=1 solve's surrogate (a snlp.method.surrogates value or its
    plan token: Identity/"idn", HCN/"hcn" for mHC models, DiagN/"diag" = one FD probe, detached);
    None = no regulariser."""

    surrogate: Surrogate | str | None = None
    lam: float = 0.5
    suffixes: tuple[int, ...] = (8,)
    stride: int = 0
    detach: bool = False
    warmup: int = 0  # steps over which lambda ramps linearly from 0
    rows: float = 1.0  # F: the solve runs on the first ceil(F * B) rows of each micro-batch (`n_rows`)

    def __post_init__(self):
        check_rows(self.rows)
        if isinstance(self.surrogate, str):
            sur = parse_surrogate(self.surrogate)
            if sur is None:
                raise ValueError(f"unknown regulariser surrogate {self.surrogate!r}: use a plan surrogate token "
                                 f"(idn, hcn, diag[:fd|jvp|vjp], ...)")
            self.surrogate = sur

    @property
    def active(self) -> bool:
        return self.surrogate is not None and self.lam > 0

    @property
    def kind(self) -> str:
        """The surrogate's plan token, "none" without a regulariser (logs, records)."""
        return "none" if self.surrogate is None else self.surrogate.token

    def plan(self, n_suffix: int) -> Plan:
        """The K=1 plan whose solve is regularised for suffix length N (IDN when inactive: the logged gap)."""
        return k1_plan(n_suffix, self.surrogate or Identity())

    def plans(self, n_layer: int) -> tuple[Plan, ...]:
        """The K=1 plans of the suffix lengths N that fit an n_layer model (`resolve_suffixes`, no warning; N is
        each plan's n_suffix). Built before a step is traced and handed to `snlp_loss`: a Plan constructed inside a compiled
        graph makes dynamo wrap its dataclass defaults (a surrogate object), which torch 2.11's dynamo refuses
        ("SourcelessBuilder.create does not know how to wrap Identity")."""
        return tuple(self.plan(n) for n in resolve_suffixes(n_layer, self.suffixes, warn=False))

    def check_model(self, config) -> None:
        """Raise a ValueError unless every regularised plan fits the model (e.g. HCN needs mHC)."""
        for plan in self.plans(config.n_layer) if config.n_layer > 1 else ():
            plan.check_model(config)

    def check_fd_step(self, n_layer: int, dtype: torch.dtype, device_type: str) -> None:
        """Raise a ValueError where the surrogate's written diag:fd eps lies below the FD step floor of `dtype`, the
        dtype the step computes in (snlp.train.precision.step_dtype: bf16 under CUDA autocast): the regulariser's
        solve refused it only at the first step. A dtype and a device type, not a device: checked on any host."""
        for plan in self.plans(n_layer) if self.active and n_layer > 1 else ():
            check_fd_step(plan, dtype, device_type)

    def n_rows(self, batch: int) -> int:
        """Rows of a `batch`-row micro-batch the solve runs on: ceil(F * batch); a ValueError if that is 0
        (`check_rows`: a mean over no rows would be NaN)."""
        check_rows(self.rows, batch)
        return reg_rows(self.rows, batch)

    def rows_text(self, batch: int) -> str:
        """The banner's note of --reg-rows ("" for all rows, the paper's objective)."""
        return "" if self.rows == 1 else f" rows={self.n_rows(batch)}/{batch} (--reg-rows {self.rows:g})"

    def weight(self, step: int) -> float:
        """lambda at optimizer step `step` (linear ramp over `warmup` steps)."""
        if not self.active:
            return 0.0
        return self.lam * min(1.0, (step + 1) / self.warmup) if self.warmup > 0 else self.lam


def check_rows(rows: float, batch: int | None = None) -> None:
    """Raise a ValueError (one line, in --reg-rows' terms) unless 0 < rows <= 1 and, given the micro-batch size,
    it leaves the solve at least one row."""
    if not (isinstance(rows, (int, float)) and 0 < rows <= 1):  # also refuses NaN
        raise ValueError(f"--reg-rows must lie in (0, 1], a fraction of each micro-batch's rows (got {rows!r})")
    if batch is not None and reg_rows(rows, batch) < 1:
        raise ValueError(f"--reg-rows {rows:g} of a {batch}-row micro-batch leaves the regulariser no row "
                         f"(F x B rounds to 0 rows): any F whose F x B is at least 1e-9 gives one")


def reg_rows(rows: float, batch: int) -> int:
    """ceil(rows * batch), the product first rounded to 9 decimals so float noise does not add a row
    (0.3 * 10 = 3.0000000000000004 is 3 rows, not 4) or leave one (1.0 * B is B)."""
    return min(batch, math.ceil(round(rows * batch, 9)))


def parse_suffixes(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(s) for s in str(text).split(",") if s.strip())
    except ValueError as e:
        raise ValueError(f"--reg-n must be comma-separated integers like 8,16,24, got {text!r}") from e
    if not out or min(out) < 1:
        raise ValueError(f"--reg-n needs suffix lengths >= 1, got {text!r}")
    if len(set(out)) < len(out):  # the term sums each N once (resolve_suffixes); the paper's code sums a repeat again
        twice = next(n for n in out if out.count(n) > 1)
        raise ValueError(f"--reg-n lists N = {twice} more than once ({text!r}): each N is one term of the sum; list it "
                         f"once (its weight is --reg-lambda)")
    return out


def resolve_suffixes(n_layer: int, suffixes, warn: bool = True) -> list[int]:
    """Suffix lengths that fit: N >= L leaves no prefix, so it is clipped to L-1 (warned unless `warn` is False:
    the training step, which runs under torch.compile where a warning is a graph break, and whose run warned once
    when its RegConfig was checked)."""
    out = []
    for n in suffixes:
        if n >= n_layer:
            if warn:
                warnings.warn(f"regulariser suffix N={n} >= n_layer={n_layer}: clipped to N={n_layer - 1}",
                              stacklevel=2)
            n = n_layer - 1
        if n >= 1 and n not in out:
            out.append(n)
    if not out:
        raise ValueError(f"no regulariser suffix fits a {n_layer}-layer model (need 1 <= N < {n_layer})")
    return out


def supervised_layers(n_layer: int, n_suffix: int, stride: int) -> list[int]:
    """T_N: layers l (h_l, 1-based, h_L = final) supervised for suffix length N, ascending: {L} for stride 0, else
    every s-th layer counted from the suffix's start S (l - S = s, 2s, ...; l = S + 1 left out, its K=1 state is
    exact) and L. The paper's code counts the same way, so N not a multiple of s (its 0.5B runs: N = 8, 16 with
    stride 3) supervises the layers it does."""
    if stride < 0:
        raise ValueError(f"--reg-stride must be >= 0, got {stride}")
    S = n_layer - n_suffix
    if stride == 0:
        return [n_layer]
    return sorted({l for l in range(S + 2, n_layer + 1) if (l - S) % stride == 0} | {n_layer})


def k1_plan(n_suffix: int, surrogate: Surrogate | str = Identity()) -> Plan:
    """The regulariser's plan: N unfused chunks, h0 init, K = 1."""
    return Plan(chunks=n_suffix, fuse=1, init="h0", iters=1, surrogate=surrogate)


def snlp_states(model, idx: Tensor, plan: Plan, trace: list[Tensor] | None = None,
                fresh_probes: bool = False) -> tuple[Tensor, int]:
    """K=1 SNLP states (N, B, T, D) of `plan` (`k1_plan`) for its N suffix layers: [j] is h_hat_{S+j+1}.
    With the sequential `trace` [h_0..h_L] of idx, its h_S is reused instead of re-running the prefix.
    `fresh_probes` (DiagN): draw the probes from a generator seeded by the global torch RNG (one CPU draw), new each
    call, as the paper's code draws its probe `z` each forward; the RNG is in the checkpoint, so a resumed run draws
    the same ones. False: the solver's fixed seed-0 probes (the logged gap, reproducible)."""
    if plan.fuse != 1 or plan.iters != 1:  # states[1] is h_hat of every suffix layer only for K=1, M=1
        raise ValueError(f"the regulariser's states need a K=1 plan of one layer per chunk (k1_plan(N)), got {plan}: "
                         f"its iteration-1 states are not the layers' K=1 states h_hat_l")
    n_suffix = plan.n_suffix
    S = model.config.n_layer - n_suffix
    prefix, hb = (None, None) if trace is None else (trace[S], model.prefix_backout(trace, S))
    gen = None
    if fresh_probes and isinstance(plan.surrogate, DiagN):
        seed = int(torch.randint(0, 2 ** 62, (1,), device="cpu"))  # the CPU generator: no device read
        gen = torch.Generator(idx.device).manual_seed(seed)
    res = solve(model, idx, plan, keep_states=True, check_finite=False, prefix=prefix, hb=hb, probe_gen=gen)
    return res.states[1], model.config.n_layer - n_suffix


def relative_error(h_hat: Tensor, h_seq: Tensor, valid: Tensor | None = None, count: Tensor | None = None) -> Tensor:
    """mean over batch & positions of ||h_hat - h_seq||_2 / (||h_seq||_2 + eps), norms over the hidden dim, fp32;
    mHC states (B, T, n, D): the ratio per stream, averaged over the n streams (the paper's code's mean over its
    (B*n, T) rows), so a token's term is the mean of its streams' ratios. `valid` (B, T) bool: the mean runs over its True
    positions only (a padded batch's real tokens), so padding a batch changes nothing; a device-side division
    (no host read of the count). `count` (with `valid`): divide the masked sum by it instead of by valid's own
    count (`snlp_loss`'s row subset: the whole batch's real tokens scaled to the subset)."""
    h_hat, h_seq = h_hat.float(), h_seq.float()
    err = (h_hat - h_seq).norm(dim=-1) / (h_seq.norm(dim=-1) + EPS)  # (B, T) or mHC (B, T, n)
    if err.dim() > 2:  # mHC: per stream, then the mean over the streams (the paper's code's rows are (b, stream))
        err = err.flatten(2).mean(dim=-1)
    if valid is None:
        return err.mean()
    w = valid.to(err.dtype)
    return (err * w).sum() / (w.sum().clamp(min=1.0) if count is None else count)


def snlp_loss(model, idx: Tensor, trace: list[Tensor], cfg: RegConfig, valid: Tensor | None = None,
              plans: tuple[Plan, ...] | None = None) -> Tensor:
    """The regulariser sum (without lambda). `trace` is the sequential trace [h_0, ..., h_L] of
    the same forward that produced the CE loss (so the model is not run twice for the target). `valid`: the
    (B, T) mask of real positions of a padded batch (`relative_error`); None: every position. With cfg.rows < 1
    the sum is over the first r = `cfg.n_rows(B)` rows of idx, trace and valid (the module docstring: not
    rescaled); the trace may then hold just those r rows (a trace computed for the regulariser alone). `plans`:
    `cfg.plans(n_layer)`, built once outside a compiled step (TrainStep does); None builds them here."""
    L = model.config.n_layer
    if len(trace) != L + 1:
        raise ValueError(f"trace must hold h_0..h_L ({L + 1} states), got {len(trace)}")
    B, r, count = idx.size(0), cfg.n_rows(idx.size(0)), None
    if r < B:  # a static slice of the batch dim: the solve's work scales with r
        if valid is not None:
            # a padded batch's term is a token-weighted mean: over the subset's own tokens, short rows would weigh
            # more than in the whole batch's mean. Dividing the subset's masked sum by r / B of the whole batch's
            # real-token count makes its expectation over the random rows the whole batch's term, exactly
            count = valid.float().sum().clamp(min=1.0) * (r / B)  # 0-dim, on the device
            valid = valid[:r]  # (r, T)
        idx, trace = idx[:r], [h[:r] for h in trace]  # (r, T), [(r, T, D)] (mHC: (r, T, n, D))
    total = torch.zeros((), device=idx.device, dtype=torch.float32)
    for plan in cfg.plans(L) if plans is None else plans:
        states, S = snlp_states(model, idx, plan, trace, fresh_probes=True)
        for l in supervised_layers(L, plan.n_suffix, cfg.stride):
            target = trace[l].detach() if cfg.detach else trace[l]
            total = total + relative_error(states[l - S - 1], target, valid, count)
    return total


@torch.no_grad()
def snlp_gap(model, idx: Tensor, plan: Plan) -> float:
    """Measured K=1 SNLP-vs-sequential gap of `plan` (`k1_plan`; another plan is refused, `snlp_states`): relative
    error of the final state h_L."""
    trace = model.hidden_states(idx)
    states, _ = snlp_states(model, idx, plan, trace)
    return float(relative_error(states[-1], trace[-1]))

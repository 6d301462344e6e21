"""The structured surrogates A of the SNLP correction, one small typed value each (paper Sec.
"Structured Surrogates"). A surrogate owns three things, so adding one touches this file only:

  - its plan-grammar token (`token`, `__str__`; options such as DiagN's probes are extra plan parts),
  - its cost per iteration in batched-chunk-evaluation units on the critical path (`evals_per_iter`),
    which `Plan.ideal_speedup` uses,
  - its correction (`delta`): given the batched chunk forward tilde = F(inputs) of one iteration, the
    update d = h^{(k+1)} - h^{(k)} (C, B, T, ...) of the recurrence d_c = a_c o d_{c-1} + b_c,
    b = tilde - h^{(k)} (snlp.method.solver docstring), with a_c = the surrogate times the plan's link factor;
    and the same correction over a run of the chunks whose scan is given (`scan_step`: a rank of snlp.dist,
    whose scan composes the ranks' affine maps), from the surrogate's own local map A (`local_map`), so the
    distributed solver dispatches on nothing.

Identity (`idn`)    A = I: a prefix sum over chunks in forward order, else a transfer-matrix contraction.
Jacobi (`none`)     A = 0: h^{(k+1)} = tilde.
HCN (`hcn`)         A = the chunk's H_res product over the mHC streams (returned by the chunk forward;
                    mHC models only), solved by the matrix associative scan.
DiagN (`diag[:fd|jvp|vjp]`, options probes / eps / subset)
                    A = a Hutchinson estimate of diag(J_c) (snlp.method.jacobian), elementwise scan.
Newton (`newton`)   the exact J_c d_{c-1} by JVPs, chunk after chunk (DEER; a reference solver).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import lru_cache, wraps
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from snlp.runtime.fmt import format_number  # exact round trip of the plan grammar's numbers
from snlp.method.scan import affine_scan, transfer_blocks, transfer_scan

if TYPE_CHECKING:
    from snlp.method.plan import Plan

ESTIMATORS = ("fd", "jvp", "vjp")  # how DiagN estimates diag(J): finite difference, forward AD, reverse AD
# extra batched passes an estimator runs per iteration, all P probes stacked into one pass: fd one
# forward f(x + s v); jvp one forward-mode pass; vjp a forward that records the graph plus its backward
ESTIMATOR_PASSES = {"fd": 1, "jvp": 1, "vjp": 2}
# eps is the step of the finite difference (F(x + s v) - F(x)) / s; jvp and vjp get J v / J^T v from AD and never read it
EPS_UNREAD = ("eps is the finite-difference step of the diag:fd estimator, and diag:{est} computes its products by "
              "autodiff without reading it: drop eps, or use diag:fd")


@dataclass
class Iterate:
    """What one iteration hands a surrogate: the plan, the fused weights and context, the chunk inputs
    (C, B, T, ...), their batched forward tilde = F(inputs), the current chunk outputs h^{(k)}, the
    mHC stream matrices of the forward (HCN; else None) and the probe generator (DiagN)."""

    plan: "Plan"
    weights: object
    ctx: object
    inputs: Tensor
    tilde: Tensor
    h: Tensor
    mix: Tensor | None = None
    gen: torch.Generator | None = None
    prev: Tensor | None = None  # the previous sweep's update d^{(k-1)} (None in the first), for lagged chunks
    chunk0: int = 0  # the plan's index of the first chunk held here (a rank of snlp.dist holds a run of them)
    cache_first: int = 0  # the layer the KV cache's slot 0 holds (a rank's window; 0 for a full cache)

    @property
    def lagged(self) -> bool:
        """Whether some chunk reads the previous sweep's update (a non-forward correction order, K >= 2)."""
        return self.prev is not None and any(self.plan.lag_factors())


class Surrogate(ABC):
    """Base of the surrogate values. Subclasses are frozen dataclasses (hashable: plans are cache keys)."""

    token: ClassVar[str]
    needs_mhc: ClassVar[bool] = False  # the surrogate reads the mHC stream-mixing matrices
    needs_mix: ClassVar[bool] = False  # the chunk forward must also return them
    matrix: ClassVar[bool] = False  # A acts as an n x n matrix on the mHC stream dim (else elementwise)
    distributed: ClassVar[bool] = True  # DistributedSNLP can run it (its A is local to a chunk: I, H_res, diag J)
    random: ClassVar[bool] = False  # its map draws probes (a seeded generator per solve)
    gathered_states: ClassVar[int] = 1  # residual-stream-sized tensors a rank all-gathers per iteration (its
    # affine total B_r, plus A_r where A is as big as a state: DiagN); the mHC n x n maps are small

    def __str__(self) -> str:
        return "-" + self.token

    def evals_per_iter(self, plan: "Plan") -> int:
        return 1

    @abstractmethod
    def delta(self, it: Iterate) -> Tensor:
        """d = h^{(k+1)} - h^{(k)} (C, B, T, ...) for this iteration."""

    def step(self, it: Iterate) -> tuple[Tensor, Tensor]:
        """(d, h^{(k+1)}) for this iteration."""
        d = self.delta(it)
        return d, it.h + d

    def check(self, plan: "Plan") -> list[str]:
        """Problems of this surrogate within `plan` (e.g. a subset outside the chunk range)."""
        return []

    def local_map(self, it: Iterate) -> Tensor | None:
        """A_c of the iterate's chunks (n, B, T, ...), local to each chunk; None for the identity."""
        return None

    def apply(self, A: Tensor | None, x: Tensor) -> Tensor:
        """A_c o x_c."""
        return x if A is None else A @ x if self.matrix else A * x

    def scan_step(self, it: Iterate, scan, link: Tensor, lag: Tensor, prev: Tensor | None) -> tuple[Tensor, Tensor]:
        """(d, h^{(k+1)}) of the iterate's chunks, a contiguous run of the plan's chunks, when the recurrence
        d_c = link_c A_c o d_{c-1} + b_c + lag_c A_c o prev_c is solved by `scan(a, b, matrix)` over the run and
        whatever precedes it (snlp.dist: an exclusive scan over the ranks, then the run's own). `link` / `lag`:
        the run's factors (n, 1, ..., 1); `prev`: the previous sweep's update of each chunk's PREDECESSOR, at the
        chunk's index (the first one's lives on the previous rank), None in forward order or the first sweep."""
        A = self.local_map(it)
        b = it.tilde - it.h
        if prev is not None:  # b_c += lag_c A_c d_{c-1}^{(k-1)} (non-forward order, snlp.method.solver)
            b = b + lag * self.apply(A, prev)
        d = scan(link if A is None else A * link, b, self.matrix)
        return d, it.h + d


def device_constant(build):
    """Cache a small constant tensor `build(*args)` (args hashable, the device and dtype among them) per args and
    inference mode: torch.tensor of host data is a synchronising host-to-device copy on a GPU, so it is made once,
    not once per iteration; a tensor made under inference_mode cannot enter autograd, so the two modes keep their
    own. While compiling it is built in the graph as device ops (dynamo traces through lru_cache and cannot read the
    inference mode)."""
    cached = lru_cache(maxsize=256)(lambda inference, *args: build(*args))

    @wraps(build)
    def get(*args):
        if torch.compiler.is_compiling():
            return build(*args)
        return cached(torch.is_inference_mode_enabled(), *args)
    return get


@device_constant
def _factors(values: tuple[float, ...], device, dtype: torch.dtype) -> Tensor:
    """Per-chunk factors (C,) on the device."""
    return torch.tensor(values, device=device, dtype=dtype)


def _link(it: Iterate, like: Tensor) -> Tensor:
    """The plan's per-chunk link/ELK factors (C,) as a tensor like `like`."""
    return _factors(tuple(it.plan.link_factors()), like.device, like.dtype)


def _lag(it: Iterate, like: Tensor) -> Tensor:
    """The plan's per-chunk lag factors (C,) as a tensor like `like` (nonzero where the order visits a chunk
    before its predecessor)."""
    return _factors(tuple(it.plan.lag_factors()), like.device, like.dtype)


def shift(d: Tensor) -> Tensor:
    """d_{c-1} at index c (zeros at c = 0): (C, ...) -> (C, ...)."""
    return torch.cat([torch.zeros_like(d[:1]), d[:-1]], 0)


@device_constant
def transfer_matrix(a: tuple[float, ...], lag: tuple[float, ...] = (), device=None,
                    dtype: torch.dtype = torch.float64) -> Tensor:
    """(C, C) P with d = P @ b solving d_c = a_c d_{c-1} + b_c for scalar a (a[0] unused); with lag factors
    (some nonzero), the (C, 2C) [P, P U] with d = [P, P U] @ [b; d_prev], U[c, c-1] = lag[c]: the previous
    sweep's update enters chunk c's b. Built in fp64 on `device` and cast to `dtype`, once per plan, device, dtype
    and inference mode (device_constant)."""
    C = len(a)
    P = torch.zeros(C, C, dtype=torch.float64, device=device)
    for c in range(C):
        if c > 0:
            P[c, :c] = a[c] * P[c - 1, :c]
        P[c, c] = 1.0
    if any(lag):
        U = torch.zeros(C, C, dtype=torch.float64, device=device)
        for c in range(1, C):
            U[c, c - 1] = lag[c]
        P = torch.cat([P, P @ U], 1)
    return P.to(dtype)


def scalar_correct(b: Tensor, a: tuple[float, ...], lag: tuple[float, ...] = (), prev: Tensor | None = None) -> Tensor:
    """Solve d_c = a_c d_{c-1} + b_c + lag_c prev_{c-1} over the chunk dim of b (C, ...) for scalar factors."""
    if prev is None or not any(lag):
        if all(x == 1.0 for x in a[1:]):
            return b.cumsum(0)  # IDN, forward order: a prefix sum over depth
        P = transfer_matrix(tuple(a), (), b.device, b.dtype)
    else:
        P, b = transfer_matrix(tuple(a), tuple(lag), b.device, b.dtype), torch.cat([b, prev], 0)  # [P, P U] @ [b; d_prev]
    return torch.einsum("cj,j...->c...", P, b)


@dataclass(frozen=True)
class Identity(Surrogate):
    """IDN: A = I (residual Transformers; the paper's default)."""

    token: ClassVar[str] = "idn"

    def __str__(self) -> str:
        return ""  # the default: omitted from plan strings

    def delta(self, it: Iterate) -> Tensor:
        return scalar_correct(it.tilde - it.h, tuple(it.plan.link_factors()), tuple(it.plan.lag_factors()), it.prev)


@dataclass(frozen=True)
class Jacobi(Surrogate):
    """No correction, A = 0: plain Jacobi iteration over depth."""

    token: ClassVar[str] = "none"
    gathered_states: ClassVar[int] = 0  # no scan, nothing gathered

    def delta(self, it: Iterate) -> Tensor:
        return it.tilde - it.h

    def step(self, it: Iterate) -> tuple[Tensor, Tensor]:
        return it.tilde - it.h, it.tilde  # exactly tilde, not h + (tilde - h) rounded

    def scan_step(self, it: Iterate, scan, link: Tensor, lag: Tensor, prev: Tensor | None) -> tuple[Tensor, Tensor]:
        return self.step(it)  # A = 0: nothing couples the chunks, no scan


@dataclass(frozen=True)
class HCN(Surrogate):
    """HC Newton: A = the chunk's residual-path stream matrix P_M P_A (n x n) at the current iterate."""

    token: ClassVar[str] = "hcn"
    needs_mhc: ClassVar[bool] = True
    needs_mix: ClassVar[bool] = True
    matrix: ClassVar[bool] = True

    def local_map(self, it: Iterate) -> Tensor:
        return it.mix  # (n, B, T, n_s, n_s): returned by the chunk forward

    def delta(self, it: Iterate) -> Tensor:  # mix (C, B, T, n, n) acts on the stream dim of b (C, B, T, n, D)
        b = it.tilde - it.h
        # static mHC: the chunk forward returns one constant A per chunk (the folded H, fusion.HCWeights.fixed)
        # expanded over (B, T); use it as (C, 1, 1, n, n) so no product below materialises it per token. Decided by
        # the weights, never by B or T: a row's result must not depend on its batch (the two paths round differently)
        const = getattr(getattr(it.weights, "hc", None), "fixed", None) is not None
        A = it.mix[:, :1, :1] if const else it.mix
        with torch.autocast(b.device.type, enabled=False):  # corrections in h's dtype (fp32 under autocast)
            if it.lagged:  # b_c += lag_c A_c d_{c-1}^{(k-1)}
                b = b + (A * _lag(it, A).view(-1, 1, 1, 1, 1)) @ shift(it.prev)
            a = A * _link(it, A).view(-1, 1, 1, 1, 1)
            if const:  # one (C n x C n) contraction over all tokens instead of log2(C) rounds over the state
                return transfer_scan(_hcn_transfer(it, a[:, 0, 0]), b)
            return affine_scan(a, b, matrix=True)


def _hcn_transfer(it: Iterate, a: Tensor) -> Tensor:
    """transfer_blocks(a) for the constant linked maps a (C, n, n) of static mHC, built once per forward: they depend
    on the weights and the plan only, so the solver's iterations reuse it (memo in the Context, keyed by the weight
    set and the plan, both held so their ids stay unique)."""
    if torch.compiler.is_compiling():  # traced once; an identity-keyed memo would only add guards
        return transfer_blocks(a)
    hit = it.ctx.extra.get("hcn_transfer")
    if hit is None or hit[0] is not it.weights or hit[1] is not it.plan or hit[2] != (a.dtype, a.device):
        hit = it.ctx.extra["hcn_transfer"] = (it.weights, it.plan, (a.dtype, a.device), transfer_blocks(a))
    return hit[3]


@dataclass(frozen=True)
class DiagN(Surrogate):
    """A = diag(J_c) from `probes` Hutchinson Rademacher probes by `estimator` (FD step `eps`, relative),
    only on the chunks in `subset` (None = all; the others use A = I). `eps` None: not written, the step is
    1e-3 raised to the compute dtype's floor (snlp.method.jacobian.fd_step); a written eps is taken
    as it is, or refused below that floor (check_fd_step): eps:0.001 on bf16 would otherwise run as 0.088."""

    estimator: str = "fd"
    probes: int = 1
    eps: float | None = None
    subset: tuple[int, ...] | None = None
    token: ClassVar[str] = "diag"
    random: ClassVar[bool] = True
    gathered_states: ClassVar[int] = 2

    def __post_init__(self):
        problems = []
        if self.estimator not in ESTIMATORS:
            problems.append(f"unknown DiagN estimator {self.estimator!r}: valid estimators are {', '.join(ESTIMATORS)}")
        if not isinstance(self.probes, int) or isinstance(self.probes, bool) or self.probes < 1:
            problems.append(f"probes must be an integer >= 1 (got {self.probes!r})")
        if self.eps is None:
            pass
        elif isinstance(self.eps, bool) or not (isinstance(self.eps, (int, float)) and math.isfinite(self.eps)
                                                 and self.eps > 0):
            problems.append(f"FD step eps must be > 0 and finite (got {self.eps})")
        elif self.estimator in ESTIMATORS and self.estimator != "fd":  # any written eps, the default's value too
            problems.append(EPS_UNREAD.format(est=self.estimator))
        if self.subset is not None:
            sub = tuple(self.subset)
            if not sub or len(set(sub)) != len(sub) or min(sub) < 0:
                problems.append(f"subset must list distinct chunk indices >= 0 (got {'.'.join(map(str, sub))})")
            else:
                object.__setattr__(self, "subset", tuple(sorted(int(i) for i in sub)))
        if problems:
            raise ValueError("invalid DiagN surrogate: " + "; ".join(problems))
        if self.eps is not None:
            object.__setattr__(self, "eps", float(self.eps))

    def __str__(self) -> str:
        s = f"-diag:{self.estimator}"
        if self.probes != 1:
            s += f"-probes:{self.probes}"
        if self.eps is not None:  # written, so printed: the plan string parses back to the same step
            s += f"-eps:{format_number(self.eps)}"
        if self.subset is not None:
            s += "-subset:" + ".".join(map(str, self.subset))
        return s

    def evals_per_iter(self, plan: "Plan") -> int:
        return 1 + ESTIMATOR_PASSES[self.estimator]  # the P probes ride in the batch of one pass

    def check(self, plan: "Plan") -> list[str]:
        if self.subset is not None and max(self.subset) >= plan.chunks:
            return [f"subset must list distinct chunk indices in 0..{plan.chunks - 1} "
                    f"(got {'.'.join(map(str, self.subset))})"]
        return []

    def local_map(self, it: Iterate) -> Tensor:
        from snlp.method.jacobian import diag_jacobian  # the estimator machinery lives in its own module

        return diag_jacobian(it.weights, it.inputs, it.tilde, it.ctx, it.plan, it.gen, it.chunk0, it.cache_first)

    def delta(self, it: Iterate) -> Tensor:
        a = self.local_map(it)  # (C, B, T, ..., D)
        ones = [1] * (a.dim() - 1)
        b = it.tilde - it.h
        if it.lagged:  # b_c += lag_c a_c o d_{c-1}^{(k-1)}
            b = b + a * _lag(it, a).view(-1, *ones) * shift(it.prev)
        return affine_scan(a * _link(it, a).view(-1, *ones), b)


@dataclass(frozen=True)
class Newton(Surrogate):
    """Exact Newton over depth (DEER): J_c d_{c-1} by one JVP per linked chunk, chunk after chunk."""

    token: ClassVar[str] = "newton"
    distributed: ClassVar[bool] = False  # one JVP per chunk, chunk after chunk: a sequential reference solver

    def evals_per_iter(self, plan: "Plan") -> int:
        # the batched forward, then one JVP for every chunk c >= 1: each is corrected by its predecessor's
        # update of this sweep (linked) or of the previous one (lagged; skipped only in the first sweep)
        return plan.chunks

    def scan_step(self, it: Iterate, scan, link: Tensor, lag: Tensor, prev: Tensor | None) -> tuple[Tensor, Tensor]:
        raise ValueError("exact Newton runs one JVP per chunk, chunk after chunk: it has no local map to scan "
                         "(a sequential reference solver, not available distributed)")

    def delta(self, it: Iterate) -> Tensor:
        from snlp.method.jacobian import newton_delta

        return newton_delta(it.weights, it.inputs, it.tilde - it.h, it.ctx, it.plan, it.prev if it.lagged else None)


SURROGATES: tuple[type[Surrogate], ...] = (Identity, Jacobi, HCN, DiagN, Newton)  # the grammar's choices


def parse_surrogate(tok: str) -> Surrogate | None:
    """The surrogate a plan token names (`idn`, `none`, `hcn`, `newton`, `diag`, `diag:vjp`), else None."""
    for cls in SURROGATES:
        if tok == cls.token:
            return cls()
    if tok.startswith("diag:") and tok[5:] in ESTIMATORS:
        return DiagN(estimator=tok[5:])
    return None

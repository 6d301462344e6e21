"""SNLP execution plans: `CxFM-init-KK[-surrogate][-probes:P][-eps:e][-subset:i.j][-tol:t][-elk:a][-order:...][-causal]`.

`12xF2-h0-K1` = the last N = C*M = 24 layers split into C = 12 chunks of M = 2 layers, each
chunk fused into one wide layer, all chunks evaluated in one batched op per iteration,
suffix states initialised from the prefix state h_S (`h0`), from one batched forward
(`fwd`) or from per-layer low-rank predictors of the states from the embedding (`preheat`,
snlp.method.preheat; needs `snlp calibrate`), K = 1 correction iteration (paper Sec. "Inference With Fusion and Chunking").

Surrogates A (paper Sec. "Structured Surrogates"): `idn` A = I; `hcn` A = the chunk's H_res
product (mHC models); `diag[:fd|jvp|vjp]` A = diag(J) from `probes` Hutchinson probes (FD step
`eps`), optionally only on the chunks in `subset` (the others use A = I); `newton` the exact
Jacobian (JVP, DEER over depth; a reference solver); `none` A = 0 (Jacobi). `tol:t` makes K a
maximum: each sequence of the batch stops (is frozen) once the relative update of its final state
drops below t, and the solve ends when all have (snlp.method.solver), so a row never depends on its batch.

`causal` is the paper's approximation (its reference code runs the batched suffix with is_causal=True): every
suffix branch attends over all earlier positions, its layer's sliding window dropped; the prefix keeps its
windows. It changes the function: at K >= C the solve equals the model with full-attention suffix layers, not
the model, so `exact_iters` is None for it (no K is exact) and `converged_iters` says when it stops moving.
"""

from __future__ import annotations

import math
import numbers
import re
import unicodedata
import warnings
from dataclasses import dataclass, replace

from snlp.runtime.fmt import format_number
from snlp.method.surrogates import (EPS_UNREAD, ESTIMATORS, SURROGATES, DiagN, Identity, Jacobi, Surrogate,
                                    parse_surrogate)

INITS = ("h0", "fwd", "preheat")  # preheat: snlp.method.preheat (a calibration passed as preheat=)
GRAMMAR = ("CxFM[-h0|-fwd|-preheat][-K<iters>][-idn|-none|-hcn|-newton|-diag[:fd|:jvp|:vjp]][-probes:<P>][-eps:<e>]"
           "[-subset:<chunk indices joined by '.'>][-tol:<t>][-elk:<a in [0,1)>]"
           "[-order:forward|reversed|<permutation of 0..C-1 joined by '.'>][-causal]"
           ", e.g. 12xF2-h0-K1, 8xF1-fwd-K2-none, 16xF1-h0-K1-hcn or 8xF1-h0-K2-diag:vjp-probes:2")
_HEAD = re.compile(r"^([0-9]+)xF([0-9]+)$")
# the numeric parts read as floats, and what each must be (a bad value is named with its part)
NUMBERS = {"tol": "a positive number (the stopping tolerance; omit tol for a fixed K)",
           "eps": "a positive number (the FD step of the diag surrogate)",
           "elk": "a number in [0, 1) (the ELK damping)"}


@dataclass(frozen=True)
class Plan:
    """How to run the suffix: `chunks` x `fuse` layers, `init`, `iters` (K; the maximum when
    `tol` > 0), the `surrogate` (a typed value from snlp.method.surrogates: Identity, Jacobi, HCN,
    DiagN(estimator, probes, eps, subset), Newton; a grammar token such as "none" or "diag:vjp" is
    accepted and converted), ELK damping `elk` (the correction is scaled by 1 - elk) and the
    correction `order` (a permutation of chunk indices; None = forward, the paper's default). `causal`: the
    suffix branches attend fully causally, their layers' sliding windows dropped (the paper code's approximation;
    a different function, never exact: see the module docstring)."""

    chunks: int
    fuse: int = 1
    init: str = "h0"
    iters: int = 1
    surrogate: Surrogate = Identity()
    elk: float = 0.0
    order: tuple[int, ...] | None = None
    tol: float = 0.0
    causal: bool = False

    def __post_init__(self):
        problems = []
        if not isinstance(self.causal, bool):
            problems.append(f"causal must be True or False (got {self.causal!r})")
        # bool is an int: Plan(chunks=True) ran as 1 chunk under the name 'TruexF1-h0-K1', which Plan.parse refuses
        if not _integer(self.chunks) or self.chunks < 1:
            problems.append(f"chunks C must be an integer >= 1 (got {self.chunks!r})")
        if not _integer(self.fuse) or self.fuse < 1:
            problems.append(f"fused layers per chunk M must be an integer >= 1 (got {self.fuse!r})")
        if self.init not in INITS:
            problems.append(f"unknown init {self.init!r}: valid inits are {', '.join(INITS)}")
        if not _integer(self.iters) or self.iters < 0:
            problems.append(f"iterations K must be an integer >= 0 (got {self.iters!r})")
        if isinstance(self.surrogate, str):
            sur = parse_surrogate(self.surrogate)
            if sur is None:
                problems.append(f"unknown surrogate {self.surrogate!r}: valid surrogates are "
                                f"{', '.join(c.token for c in SURROGATES)} (diag[:{'|'.join(ESTIMATORS)}])")
            else:
                object.__setattr__(self, "surrogate", sur)
        elif not isinstance(self.surrogate, Surrogate):
            problems.append(f"surrogate must be a snlp.method.surrogates surrogate or its token, got {self.surrogate!r}")
        if not _finite(self.elk) or not 0.0 <= float(self.elk) < 1.0:
            problems.append(f"ELK damping must lie in [0, 1) (got {self.elk})")
        order_ok = True
        if self.order is not None and _integer(self.chunks):
            if sorted(self.order) != list(range(self.chunks)):
                order_ok = False
                problems.append(f"order {'.'.join(map(str, self.order))} must be a permutation of "
                                f"0..{self.chunks - 1} (one index per chunk)")
            elif list(self.order) == list(range(self.chunks)):
                object.__setattr__(self, "order", None)  # forward is the canonical default
            else:
                object.__setattr__(self, "order", tuple(int(i) for i in self.order))
        if not _finite(self.tol) or not float(self.tol) >= 0:
            problems.append(f"tol must be a finite number >= 0, 0 = fixed K (got {self.tol})")
        if self.surrogate == Jacobi():  # A = 0: h^{(k+1)} = F(h^{(k)}), no correction to damp or to order
            if _finite(self.elk) and 0.0 < float(self.elk) < 1.0:
                problems.append(f"ELK damping elk:{format_number(float(self.elk))} scales the correction, and the none "
                                "surrogate (Jacobi, A = 0) makes none: drop elk, or use a surrogate that corrects (idn)")
            if self.order is not None and order_ok:
                problems.append("a correction order sets which update of its predecessor each chunk's correction reads, "
                                "and the none surrogate (Jacobi, A = 0) makes no correction: drop order, or use a "
                                "surrogate that corrects (idn)")
        if isinstance(self.surrogate, Surrogate) and _integer(self.chunks):
            problems += self.surrogate.check(self)
            if isinstance(self.surrogate, DiagN) and self.surrogate.subset == tuple(range(self.chunks)):
                # every chunk is the default (the same probe draw, the same solve): one plan, one name
                object.__setattr__(self, "surrogate", replace(self.surrogate, subset=None))
        if problems:
            raise ValueError("invalid SNLP plan: " + "; ".join(problems) + f". Grammar: {GRAMMAR}")
        for name in ("elk", "tol"):
            object.__setattr__(self, name, float(getattr(self, name)))

    # ----- derived quantities -----
    @property
    def n_suffix(self) -> int:
        """N = C * M suffix layers solved in parallel."""
        return self.chunks * self.fuse

    def prefix_len(self, n_layer: int) -> int:
        """S = L - N sequential prefix layers; raises if the plan does not fit an L-layer model."""
        self.check(n_layer)
        return n_layer - self.n_suffix

    def check(self, n_layer: int) -> "Plan":
        """Raise a ValueError if the plan does not fit a model with `n_layer` layers."""
        if self.n_suffix > n_layer:
            fits = [f"{c}xF{self.fuse}" for c in range(1, n_layer // self.fuse + 1)][-3:]
            raise ValueError(
                f"plan {self} needs a suffix of N = {self.chunks}x{self.fuse} = {self.n_suffix} layers but the "
                f"model has only L = {n_layer}; use at most {n_layer // self.fuse} chunks of {self.fuse} "
                f"(e.g. {', '.join(fits) or 'a smaller M'})")
        return self

    def check_model(self, config) -> "Plan":
        """Raise a ValueError unless the plan fits a model with this GPTConfig (depth; HCN needs mHC; `causal` needs
        a sliding window in the suffix: without one it would drop nothing, and asking for it misreads the model)."""
        self.check(config.n_layer)
        if self.surrogate.needs_mhc and config.hc_streams < 1:
            raise ValueError(f"plan {self}: the {self.surrogate.token} surrogate needs an mHC model "
                             f"(GPTConfig.hc_streams >= 1); this model has a plain residual stream, use idn")
        if self.causal and all(config.window(l) < 0 for l in range(config.n_layer - self.n_suffix, config.n_layer)):
            raise ValueError(f"plan {self}: causal drops the suffix layers' sliding windows, and this model's suffix "
                             f"layers {config.n_layer - self.n_suffix}..{config.n_layer - 1} have none (they attend "
                             f"fully already): it changes nothing, drop -causal")
        return self

    def causal_idle(self, config, longest: int) -> str | None:
        """Why `causal` changes nothing on sequences of at most `longest` tokens of a model with this GPTConfig (a
        one-line warning), or None. A window w keeps keys i - j <= w (snlp.model.ops.window_mask), so at T tokens
        it drops a key only where w < T - 1: windows all that wide make the suffix layers attend fully already, and
        the causal approximation is the model's own function. A warning, not a refusal: `longest` is what this run
        reaches at most, the model may see longer sequences elsewhere (check_model refuses the model-wide case)."""
        if not self.causal:
            return None
        suffix = [config.window(l) for l in range(config.n_layer - self.n_suffix, config.n_layer)]
        windows = [w for w in suffix if w >= 0]
        if not windows or min(windows) < longest - 1:
            return None
        return (f"plan {self}: causal drops the suffix layers' sliding windows (the narrowest keeps "
                f"{min(windows) + 1} tokens), and this run's sequences have at most {longest} tokens: it changes "
                f"nothing here (the plan runs as its non-causal twin)")

    @property
    def evals_per_iter(self) -> int:
        """Batched suffix evaluations on the critical path per iteration (the surrogate's cost:
        DiagN adds its estimator's batched probe passes, all P probes in one batch; exact Newton one
        JVP per corrected chunk; real op costs are in `snlp bench --ops`)."""
        return self.surrogate.evals_per_iter(self)

    def critical_path_layers(self, n_layer: int, iters: int | None = None) -> int:
        """Layer evaluations on the critical path of the SNLP forward, S + K * evals_per_iter +
        [init == fwd], assuming a batched (fused) evaluation costs one layer. `iters` = the
        iterations actually run (with `tol` they may stop before K)."""
        K = self.iters if iters is None else iters
        return self.prefix_len(n_layer) + K * self.evals_per_iter + (1 if self.init == "fwd" else 0)

    def ideal_speedup(self, n_layer: int, iters: int | None = None) -> float:
        """The layer-step ideal L / (S + K * evals_per_iter + [init == fwd]) = L / `critical_path_layers`:
        layer evaluations on the critical path of sequential vs SNLP execution."""
        return n_layer / max(self.critical_path_layers(n_layer, iters), 1)

    def link(self) -> list[bool]:
        """link[c]: chunk c is visited after chunk c-1 in the correction sweep (`order`), so its
        correction uses the predecessor's update from THIS sweep. Forward order links every chunk;
        reversed order links only chunk 0 (which has no predecessor)."""
        if self.order is None:
            return [True] * self.chunks
        pos = {c: i for i, c in enumerate(self.order)}
        return [True] + [pos[c - 1] < pos[c] for c in range(1, self.chunks)]

    def lag(self) -> list[bool]:
        """lag[c]: chunk c > 0 is visited BEFORE chunk c-1 in the sweep, so its correction uses the
        predecessor's most recent update, the one made in the previous sweep (zero in the first
        sweep: at K = 1 a lagged chunk gets no correction). See `snlp.method.solver` for the recurrence."""
        return [False] + [not linked for linked in self.link()[1:]]

    def link_factors(self) -> list[float]:
        """Per chunk, the factor scaling its surrogate A_c applied to the predecessor's update of this
        sweep: the ELK factor 1 - elk where the chunk is linked (`link`), else 0."""
        return [(1.0 - self.elk) if linked else 0.0 for linked in self.link()]

    def lag_factors(self) -> list[float]:
        """Per chunk, the factor scaling A_c applied to the predecessor's update of the PREVIOUS sweep:
        1 - elk where the chunk is lagged (`lag`), else 0. link_factors + lag_factors = (1 - elk)
        for every chunk c > 0: each chunk is corrected by exactly one update of its predecessor."""
        return [(1.0 - self.elk) if lagged else 0.0 for lagged in self.lag()]

    def exact_after(self) -> list[int]:
        """t_c: after t_c iterations chunk c's output is exact (equals the fused model run
        sequentially) for every surrogate, starting from the plan's init. t_0 = 1, or 0 with the fwd
        init: its F_0(h_S) is already chunk 0's exact output (h_S is exact), and no iteration moves it.
        A linked chunk (or any chunk without correction, surrogate none) is exact one iteration after
        its predecessor, a lagged one two iterations after it (its input is exact at t_{c-1} + 1 but
        its lagged correction still carries the predecessor's last nonzero update, made at t_{c-1}),
        unless t_{c-1} = 0: a predecessor exact from the init never makes a nonzero update. So K >= C
        (C - 1 with fwd) is exact for the forward order, and K >= C + (number of lagged chunks) for any
        order from h0 (2C - 1 for reversed)."""
        t, lags = [0 if self.init == "fwd" else 1], self.lag()
        for c in range(1, self.chunks):
            lagged = lags[c] and self.surrogate != Jacobi() and t[-1] > 0
            t.append(t[-1] + (2 if lagged else 1))
        return t

    def converged_iters(self) -> int:
        """The smallest K from which the solve's output no longer changes for any input: max_c t_c (`exact_after`; C
        for the forward order from h0, C - 1 from fwd, whose init is one chunk evaluation already). The forward
        order's is that closed form, not a list of C entries: a plan list is capped (`cli_plan`) before any model
        bounds C, and a mistyped 10000000000xF1 must reach its does-not-fit error, not build ten billion entries.
        From here on the output is the (fused) suffix run sequentially: the model's own function unless `causal`."""
        if self.order is None:  # no lagged chunk: t_c = t_0 + c
            return self.chunks - (1 if self.init == "fwd" else 0)
        return self.exact_after()[-1]

    def exact_iters(self) -> int | None:
        """The smallest K from which the solve is exact (equals the model, or its fused model, run sequentially) for
        every input: `converged_iters`; None for a `causal` plan, which converges to the model with full-attention
        suffix layers instead: no K makes it exact."""
        return None if self.causal else self.converged_iters()

    def divergence_hints(self) -> str:
        """What to try when this plan's solve turns NaN/inf, only the changes this plan can take: more iterations below
        the exact count, fewer/larger chunks, ELK damping where the surrogate corrects (Jacobi makes no correction: elk
        is refused there), the h0 init where it is not already the init. From the exact count on the output is the
        fused model's own, which no solver setting changes (with `causal`: of the model with full-attention suffix
        layers)."""
        if self.iters >= self.converged_iters():
            what = "model's own" if self.fuse == 1 else "fused model's own"
            if self.causal:
                what += " with full-attention suffix layers"
            return (f"K reaches the {'converged' if self.causal else 'exact'} count, so the output is the {what}: "
                    + ("check its sequential forward" if self.fuse == 1 else "try fewer layers per chunk (smaller M)"))
        tries = [f"more iterations (K >= {self.converged_iters()} "
                 f"{'has converged' if self.causal else 'is exact'})"]
        if self.chunks > 1:
            tries.append("fewer/larger chunks")
        if self.surrogate != Jacobi():
            tries.append(f"more ELK damping (elk above {format_number(self.elk)})" if self.elk else
                         "ELK damping (-elk:0.1)")
        if self.init != "h0":
            tries.append("the h0 init")
        last = tries.pop()
        return "if the sequential forward is finite, try " + ", ".join(tries) + (" or " if tries else "") + last

    # ----- string form -----
    def __str__(self) -> str:
        s = f"{self.chunks}xF{self.fuse}-{self.init}-K{self.iters}{self.surrogate}"
        if self.tol:
            s += f"-tol:{format_number(self.tol)}"
        if self.elk:
            s += f"-elk:{format_number(self.elk)}"
        if self.order is not None:
            rev = tuple(range(self.chunks - 1, -1, -1))
            s += "-order:" + ("reversed" if self.order == rev else ".".join(map(str, self.order)))
        if self.causal:
            s += "-causal"
        return s

    @classmethod
    def parse(cls, text: "str | Plan", n_layer: int | None = None) -> "Plan":
        """Parse a plan string (see GRAMMAR); with `n_layer`, also check it fits the model. A Plan is taken as it is
        (checked with `n_layer`), so every entry point that takes a plan string or a Plan reads it here and anything
        else gets this one-line error, not an AttributeError of its first use."""
        if n_layer is not None and (isinstance(n_layer, bool) or not isinstance(n_layer, numbers.Integral)):
            # True is an int: it was read as a 1-layer model ("the model has only L = True")
            raise ValueError(f"n_layer is the model's layer count, an int; got {type(n_layer).__name__} {n_layer!r}")
        if isinstance(text, Plan):
            return text if n_layer is None else text.check(n_layer)
        if not isinstance(text, str):  # 5 or None read as "empty plan string"
            raise ValueError(f"a plan is a string (e.g. 12xF2-h0-K1) or a Plan, got {type(text).__name__} {text!r:.40}. "
                             f"Grammar: {GRAMMAR}")
        if not text.strip():
            raise ValueError(f"empty plan string. Grammar: {GRAMMAR}")
        _check_ascii(text)
        space = re.search(r"\s", text.strip())
        if space:  # float() reads ' .25' as 0.25 and the head's $ matches before a newline: spaced plans would parse
            raise ValueError(f"malformed plan {text!r}: whitespace {space.group(0)!r} at position "
                             f"{text.index(space.group(0), len(text) - len(text.lstrip()))}: write a plan without "
                             f"spaces, e.g. 12xF2-h0-K1. Grammar: {GRAMMAR}")
        bad_k = re.search(r"(?:^|-)K(?=-|$)", text)
        if bad_k:  # K-1 splits at its minus sign into 'K' and '1'
            neg = re.match(r"-[0-9.]+(?=-|$)", text[bad_k.end():])
            got = f"K{neg.group(0)}" if neg else "K"  # a bare K followed by another part names only the K
            raise ValueError(f"malformed plan {text!r}: the iteration count {got} must be an integer >= 0 written "
                             f"right after K (e.g. K1){'' if neg else ', got a K without its count'}. Grammar: {GRAMMAR}")
        head, *tokens = _split(text.strip())
        m = _HEAD.match(head)
        if not m:
            # a negative or fractional C or M ('-1xF1', '4xF-1', '1.5xF2') is named as such, not as a missing head
            num = re.match(r"\s*(-?[0-9.]+)xF(-?[0-9.]*)(?=-|$)", text)
            if num:
                part, got = ("C", num.group(1)) if not num.group(1).isdigit() else ("M", num.group(2))
                what = "the chunk count C" if part == "C" else "the fused layers per chunk M"
                raise ValueError(f"malformed plan {text!r}: {what} must be an integer >= 1, got {got!r}. "
                                 f"Grammar: {GRAMMAR}")
            raise ValueError(f"malformed plan {text!r}: it must start with CxFM (e.g. 12xF2), got {head!r}. "
                             f"Grammar: {GRAMMAR}")
        kw: dict = {"chunks": int(m.group(1)), "fuse": int(m.group(2))}
        seen = set()
        for tok in tokens:
            key, value = _token(tok, text)
            if key in seen:
                raise ValueError(f"malformed plan {text!r}: {key} given twice. Grammar: {GRAMMAR}")
            seen.add(key)
            kw[key] = value
        if kw.get("order") == "reversed":
            kw["order"] = tuple(range(kw["chunks"] - 1, -1, -1))
        elif kw.get("order") == "forward":
            kw["order"] = None
        diag = {k: kw.pop(k) for k in ("probes", "eps", "subset") if k in kw}
        if diag:
            if not isinstance(kw.get("surrogate"), DiagN):
                raise ValueError(f"malformed plan {text!r}: {'/'.join(diag)} "
                                 f"{'applies' if len(diag) == 1 else 'apply'} only to the diag surrogate. "
                                 f"Grammar: {GRAMMAR}")
            if "eps" in diag and kw["surrogate"].estimator != "fd":  # the default eps too: written, so meant
                raise ValueError(f"malformed plan {text!r}: {EPS_UNREAD.format(est=kw['surrogate'].estimator)}. "
                                 f"Grammar: {GRAMMAR}")
            try:
                kw["surrogate"] = DiagN(kw["surrogate"].estimator, **diag)
            except ValueError as e:
                raise ValueError(f"invalid SNLP plan {text!r}: {e}. Grammar: {GRAMMAR}") from None
        plan = cls(**kw)
        return plan.check(n_layer) if n_layer is not None else plan

    @classmethod
    def for_suffix(cls, n_suffix: int, fuse: int = 1, **kw) -> "Plan":
        """Plan for a suffix of `n_suffix` layers fused `fuse` at a time (M must divide N)."""
        if fuse < 1 or n_suffix < 1 or n_suffix % fuse:
            raise ValueError(f"fused layers per chunk M={fuse} must divide the suffix length N={n_suffix} "
                             f"(valid M: {[m for m in range(1, max(n_suffix, 1) + 1) if n_suffix % m == 0]})")
        return cls(chunks=n_suffix // fuse, fuse=fuse, **kw)

    def with_(self, **kw) -> "Plan":
        """A copy with some fields replaced (validated)."""
        return replace(self, **kw)

    def capped(self) -> "Plan":
        """This plan with K lowered to `converged_iters` where it is larger. From there on every chunk equals the
        (fused) suffix run sequentially, so each further iteration recomputes the same states: a larger K changes no
        output and only costs time (K = 10**9 never returns)."""
        return self if self.iters <= self.converged_iters() else self.with_(iters=self.converged_iters())


def _check_ascii(text: str) -> None:
    """Plan strings are ASCII: int() and float() would read full-width or other Unicode digits
    (１２xF１) as numbers, so a plan copied from formatted text would parse as something not written."""
    for i, ch in enumerate(text):
        if not ch.isascii():
            name = unicodedata.name(ch, f"U+{ord(ch):04X}")
            raise ValueError(f"malformed plan {text!r}: character {ch!r} ({name}) at position {i} is not ASCII; "
                             f"write plans with ASCII digits and letters, e.g. 12xF2-h0-K1")


def _split(text: str) -> list[str]:
    """Split on '-' but keep negative exponents of numbers (tol:1e-05) and negative values (tol:-1, h-1) inside
    their token, so that a bad value is named with its part instead of leaving a part without its value."""
    parts: list[str] = []
    for part in text.split("-"):
        glue = parts and (re.search(r"\d[eE]$", parts[-1]) and part[:1].isdigit()
                          or parts[-1].endswith(":") and part != ""
                          or parts[-1] == "h" and part[:1].isdigit())
        if glue:
            parts[-1] += "-" + part
        else:
            parts.append(part)
    return parts


def _token(tok: str, text: str):
    if tok in INITS:
        return "init", tok
    if tok == "causal":
        return "causal", True
    sur = parse_surrogate(tok)
    if sur is not None:
        return "surrogate", sur

    def bad(part: str, needs: str):  # needs: "what it must be (why)": the value is named before the why
        must, _, why = needs.partition(" (")
        return ValueError(f"malformed plan {text!r}: {part} must be {must}, got {tok[len(part) + 1:]!r}"
                          + (f" ({why}" if why else "") + f". Grammar: {GRAMMAR}")
    if tok.startswith("probes:"):
        if re.fullmatch(r"probes:[0-9]+", tok):
            return "probes", int(tok[7:])
        raise bad("probes", "an integer >= 1 (Hutchinson probes per chunk)")
    if tok.startswith("subset:"):
        if re.fullmatch(r"subset:[0-9]+(\.[0-9]+)*", tok):
            return "subset", tuple(int(i) for i in tok[7:].split("."))
        raise bad("subset", "chunk indices >= 0 joined by '.' (e.g. subset:0.2)")
    for key, needs in NUMBERS.items():
        if tok.startswith(key + ":"):
            value = _number(tok[len(key) + 1:])
            if value is None:
                raise bad(key, needs)
            if not math.isfinite(value):  # inf/nan would only surface as NaN logits later
                raise ValueError(f"malformed plan {text!r}: {key} needs a finite number, got {tok[len(key) + 1:]!r}. "
                                 f"Grammar: {GRAMMAR}")
            if key == "tol" and not value > 0:  # elk's and eps's ranges are checked by Plan / DiagN, naming them
                raise bad(key, needs)
            return key, value
    if re.fullmatch(r"K[0-9]+", tok):
        return "iters", int(tok[1:])
    if tok.startswith("K"):  # K1.5, Kx (K-1 is caught before the split)
        raise ValueError(f"malformed plan {text!r}: the iteration count K must be an integer >= 0 written right after "
                         f"K (e.g. K1), got {tok!r}. Grammar: {GRAMMAR}")
    if tok.startswith("order:"):
        val = tok[6:]
        if val in ("forward", "reversed"):
            return "order", val
        if re.fullmatch(r"[0-9]+(\.[0-9]+)*", val):
            return "order", tuple(int(i) for i in val.split("."))
        raise bad("order", "forward, reversed or a permutation of the chunk indices joined by '.'")
    hint = f" (the inits are {', '.join(INITS)})" if tok.startswith("h") else ""
    raise ValueError(f"malformed plan {text!r}: unknown part {tok!r}{hint}. Grammar: {GRAMMAR}")


def _number(text: str) -> float | None:
    if "_" in text:  # float() reads '1_0' as 10: not a number of the grammar
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _integer(x) -> bool:
    """An int that is not a bool (True would run as 1 and print as 'True' in the plan's name)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x) -> bool:
    """A finite real number; a bool is not one (tol=True ran as tol:1 and elk=False as no damping)."""
    if isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def cli_plan(text: str, n_layer: int | None = None) -> Plan:
    """A plan a user wrote (a command's --plan/--plans): `Plan.parse`, with a K beyond the plan's exact
    iteration count capped to it (`Plan.capped`) and a warning saying so."""
    plan = Plan.parse(text, n_layer)
    capped = plan.capped()
    if capped != plan:
        fused = 'fused ' if plan.fuse > 1 else ''
        what = (f"converged (its output equals the {fused}model with full-attention suffix layers run sequentially)"
                if plan.causal else f"exact (its output equals the {fused}model run sequentially)")
        warnings.warn(f"plan {text}: K = {plan.iters} is beyond K = {capped.iters}, from which the plan is {what}; "
                      f"running {capped}",
                      UserWarning, stacklevel=2)
    return capped


def parse_plans(text: str, n_layer: int | None = None, flag: str = "--plans") -> list[Plan]:
    """Comma-separated plan list, e.g. '1xF12-h0-K1,12xF1-h0-K1', each read by `cli_plan` (K capped). A plan named
    twice (as written, or as two spellings of one canonical plan: 8xF1-K1 and 8xF1-h0-K1) is refused: every consumer
    keys its rows, runners or output files by the plan, so the second would silently replace or repeat the first.
    `flag`: the option the list came from, as the refusal names it (e.g. `snlp bench --suite decode --suite-plans`)."""
    if not isinstance(text, str):  # a list failed with "'list' object has no attribute 'split'"
        raise ValueError(f"parse_plans reads one comma-separated string (e.g. '12xF1-h0-K1,6xF2-h0-K1'), got "
                         f"{type(text).__name__}: for a list, parse each with snlp.Plan.parse(p, n_layer)")
    plans, seen = [], {}
    for p in (x.strip() for x in text.split(",") if x.strip()):
        plan = cli_plan(p, n_layer)
        c = str(plan)
        if c in seen:
            same = "" if seen[c] == p else f" ({seen[c]} and {p} are one plan)"
            raise ValueError(f"{flag} lists {c} twice{same}: give each plan once")
        seen[c] = p
        plans.append(plan)
    if not plans:
        raise ValueError(f"no plans given. Grammar: {GRAMMAR}")
    return plans

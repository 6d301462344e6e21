"""DiagN and exact-Newton corrections (paper Sec. "Structured Surrogates", Algorithm "DiagN Inference
with Associative Scan", App. "Diagonal-Jacobian Correction Results").

The DiagN and Newton surrogates (snlp.method.surrogates: `DiagN.local_map`, `Newton.delta`) call the two entry
points once per iteration, after the batched chunk forward tilde = F(inputs):

  diag_jacobian(w, inputs, tilde, ctx, plan, gen) -> a   (C, B, T, ..., D)
      Hutchinson estimate a_c ~ diag(J_c), J_c = dF_c/dx at the chunk's current input, averaged
      over `probes` (DiagN) Rademacher probes v (E[v o Jv] = diag J since E[v_i v_j] = delta_ij; the
      VJP variant uses v o J^T v, same expectation). The solver scales it by the link/ELK factors
      and solves d_c = a_c o d_{c-1} + b_c with the log-depth `snlp.method.scan.affine_scan`.
  newton_delta(w, inputs, b, ctx, plan, prev) -> d        (C, B, T, ..., D)
      Exact Newton over depth (DEER): d_c = (1 - elk) J_c(inputs_c) e_{c-1} + b_c (e: the predecessor's
      most recent update, this sweep's or, for chunks visited first, the previous sweep's) with J_c e
      from one forward-mode JVP of chunk c alone. This is a Python loop over chunks (C - 1 sequential
      JVPs): the reference solver for small models, not a fast path.

What "diagonal" means. F_c maps the chunk input of ALL positions (B, T, ..., D) to its output;
attention mixes tokens, so J_c couples tokens. diag(J_c) is the same-token, same-channel entry
dF_c(x)[b, t, ..., i] / dx[b, t, ..., i] (for mHC models the stream dim is one more elementwise
dim). The probe is drawn over all positions at once, so cross-token terms only add variance.

Estimators (DiagN.estimator):
  fd   (F(x + s o v) - F(x)) / s with F(x) = tilde reused from the solver, so the extra cost is ONE
       batched chunk forward for all probes (probes are stacked into the batch dim). The step is
       relative: s = eps * max(RMS(x_token), 1) per token (RMS over the token's trailing dims), so
       eps means the same thing at layer 2 (RMS ~ 1) and at layer 30 (RMS ~ 100) and never falls
       below eps in absolute terms; dividing by the same per-token s keeps the estimator unbiased
       for the diagonal. The step is at least sqrt(machine eps) of the compute dtype (the autocast
       dtype under autocast), below which the difference is rounding noise: 0.088 for bf16, 0.031 for
       fp16, 3.5e-4 for fp32, 1.5e-8 for fp64. A plan that writes no eps (DiagN.eps None) steps by
       DEFAULT_FD_EPS (1e-3) raised to it (bf16, fp16); a written eps is the step as written, and one below
       the floor (eps:1e-5 on fp32, eps:0.001 on bf16, whatever the default's value) is refused before the
       solve runs (`check_fd_step`), as it would run as that floor under its own name.
  jvp  torch.func.jvp through chunk_forward (exact J v, one forward-mode pass for all probes).
       PyTorch has no forward AD for the fused SDPA kernels (CPU flash, CUDA flash/efficient), so
       the JVP runs under `sdpa_kernel(SDPBackend.MATH)` (the composite math attention, which
       forward AD differentiates); nothing in snlp.model changes. This is also why JVP is the
       expensive estimator (paper: "Exact JVP also lacks fused-SDPA support").
  vjp  torch.autograd.grad of <F(x), v> w.r.t. x (exact J^T v), with grad enabled locally, so it
       also works when the caller runs under torch.no_grad() or torch.inference_mode() (then the
       weights/context are cloned once into normal tensors; the clone is cached on the weights).

Autograd: the estimate is always DETACHED (computed from detached inputs, weights and context).
In the SNLP regulariser (`snlp train --reg diag`) gradients flow through tilde and b = tilde - h
into the weights, and a only preconditions the correction, like A = I does for IDN. Differentiating
through a would add a noisy second-order term (d diag J / d theta of a one-probe Hutchinson
estimate) and a second backward through the probe forward for little benefit.

KV cache (decoding). Probe evaluations must not write the K/V of perturbed (or dual / grad
tracking) inputs into the cache: the cache must keep the K/V of the inputs the real iterate used.
They therefore attend through `ReadOnlyCache`, which returns the cached K/V of earlier positions
concatenated with the probe's own new K/V and writes nothing. The same holds for the Newton JVPs.

`DiagN.subset` (chunk indices): only those chunks are probed (their weights are gathered into one
smaller stack), the others get a = 1 (IDN), so the extra cost is proportional to the subset.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from snlp.method.fusion import ChunkWeights, chunk_forward, window_fields
from snlp.model.ops import jvp_flops_tally
from snlp.runtime.fmt import format_number
if TYPE_CHECKING:  # annotations only: plan.py imports the surrogates, which import this module
    from snlp.method.plan import Plan

# ----------------------------------------------------------------------------- estimator core
ProbeFn = Callable[[Tensor], Tensor]  # probe-stacked map (P, *X) -> (P, *X), applied probe-wise


def rademacher(shape, like: Tensor, gen: torch.Generator | None = None) -> Tensor:
    """+-1 entries with probability 1/2 each, dtype/device of `like`."""
    bits = torch.randint(0, 2, tuple(shape), generator=gen, device=like.device)
    return (bits * 2 - 1).to(like.dtype)


def row_probes(P: int, x: Tensor, gen: torch.Generator | None = None, chunks: int | None = None) -> Tensor:
    """P Rademacher probes (P, C, B, T, ..., D) for chunk inputs x (C, B, T, ..., D): ONE draw (P, C, 1, T, ..., D)
    shared by every row of the batch, so a row's DiagN estimate (and with it its solve) does not depend on
    what else is in the batch (a draw over B gave row b different probes in batches of different sizes).
    `chunks` draws for that many chunks instead of x's (the distributed solve draws all chunks, then slices)."""
    C = x.shape[0] if chunks is None else chunks
    return rademacher((P, C, 1, *x.shape[2:]), x, gen).expand(P, C, *x.shape[1:]).contiguous()


DEFAULT_FD_EPS = 1e-3  # diag:fd's relative step where the plan writes none (DiagN.eps None), raised to `fd_floor`


def compute_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype the chunk forward computes in: the autocast dtype where autocast is on, else `dtype`. Autocast casts
    no fp64 tensor (its cast policy skips double), so an fp64 model computes in fp64 under any autocast. A `meta` model
    (DistributedSNLP's, before a rank's checkpoint fills it) computes nothing and has no autocast state to ask."""
    if (dtype.is_floating_point and dtype != torch.float64 and device_type != "meta"
            and torch.is_autocast_enabled(device_type)):
        return torch.get_autocast_dtype(device_type)
    return dtype


def fd_floor(dtype: torch.dtype) -> float:
    """The smallest relative FD step the diag:fd estimator takes in compute dtype `dtype`: sqrt(machine eps)."""
    return torch.finfo(dtype).eps ** 0.5


def check_fd_step(plan: "Plan", dtype: torch.dtype, device_type: str) -> None:
    """Refuse a diag:fd plan whose written eps lies below the FD step floor of the compute dtype (`fd_floor`): the
    estimator would run with the floor under the plan's name (on fp32, eps:1e-5 and eps:1e-4 were one computation;
    on bf16, eps:0.001 ran as 0.088). An unwritten eps (None) is DEFAULT_FD_EPS raised to the floor, as the module
    docstring says."""
    sur = plan.surrogate
    if getattr(sur, "estimator", None) != "fd" or sur.eps is None:  # first: solve calls this on every call
        return
    message = below_floor(sur.eps, compute_dtype(dtype, device_type))
    if message:
        raise ValueError(f"plan {plan}: {message}")


def below_floor(eps: float, dtype: torch.dtype) -> str | None:
    """Why a written FD step `eps` cannot run in compute dtype `dtype` (below `fd_floor`), or None where it can."""
    floor = fd_floor(dtype)
    if eps >= floor:
        return None
    least = float(f"{floor * (1 + 1e-3):.3g}")  # 3 digits, rounded up: a value the check takes
    return (f"eps:{format_number(eps)} is below the smallest FD step of the compute dtype "
            f"{str(dtype).replace('torch.', '')} (sqrt of its machine epsilon, {floor:.3g}), which diag:fd would take "
            f"instead: write eps:{least:g} or more, drop eps, or run the model in a wider dtype")


def fd_step(x: Tensor, eps: float | None, token_dims: int = 0) -> Tensor:
    """FD step s = eps' * max(RMS, 1), RMS over the trailing dims after the first `token_dims` dims
    of x (one step per token; token_dims = 0: one RMS over all of x). Broadcasts against x.
    eps None (unwritten): eps' = max(DEFAULT_FD_EPS, sqrt(machine eps of the compute dtype)), the compute dtype being
    the autocast dtype when autocast is on (bf16 training: eps' ~ 0.09), else x's dtype. A written eps is eps' as it
    is; one below that floor is refused (`below_floor`), never raised: check_fd_step refuses it before the solve, and
    this is the same rule for a caller of the estimator itself."""
    cd = compute_dtype(x.dtype, x.device.type)
    if eps is None:
        eps = max(DEFAULT_FD_EPS, fd_floor(cd))
    elif (message := below_floor(float(eps), cd)):
        raise ValueError(message)
    flat = x.flatten(token_dims) if token_dims else x.reshape(1, -1)
    rms = flat.float().pow(2).mean(-1).sqrt().clamp_min(1.0).to(x.dtype)
    return float(eps) * rms.view(*x.shape[:token_dims], *[1] * (x.dim() - token_dims))


def jvp(f: Callable[[Tensor], Tensor], x: Tensor, t: Tensor) -> Tensor:
    """J_f(x) t by forward-mode AD (torch.func.jvp) with the math SDPA backend: forward AD has no rule
    for the fused SDPA kernels (CPU flash, CUDA flash/efficient); the composite math attention is
    differentiated op by op. Under torch.inference_mode the pass runs with inference mode off: torch 2.11's
    jvp returns a zero tangent there, silently (2.13's does not), which turned Newton into Jacobi and DiagN's
    jvp estimate into 0; inputs made under inference mode are read as they are (no copy). PyTorch's one-time
    load of its JVP decompositions warns that torch.jit.script is deprecated (internal to torch); that warning
    is silenced here."""
    off = torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()
    with warnings.catch_warnings(), sdpa_kernel(SDPBackend.MATH), off:
        warnings.filterwarnings("ignore", message=".*torch.jit.script.* is deprecated", category=DeprecationWarning)
        return jvp_flops_tally(lambda: torch.func.jvp(f, (x,), (t,))[1])


def probe_products(f: ProbeFn, x: Tensor, v: Tensor, estimator: str, eps: float | None = None, fx: Tensor | None = None,
                   token_dims: int = 0) -> Tensor:
    """Per-probe Hutchinson products (P, *X) of the map f at x (X): v o Jv (fd, jvp) or v o J^T v
    (vjp), for probes v (P, *X). `fx` = f at x (X), reused by fd (computed if None). The mean over
    probes is the diagonal estimate (`hutchinson_diag`)."""
    xs = x.unsqueeze(0).expand_as(v)
    if estimator == "fd":
        if fx is None:
            fx = f(x.unsqueeze(0))[0]
        s = fd_step(x, eps, token_dims)
        jv = (f(xs + s * v) - fx) / s
    elif estimator == "jvp":
        jv = jvp(f, xs.contiguous(), v)  # contiguous: make_dual rejects expanded (self-overlapping) primals
    elif estimator == "vjp":
        with torch.enable_grad():
            xg = xs.detach().clone().requires_grad_(True)
            jv = torch.autograd.grad(f(xg), xg, v)[0]
    else:
        raise ValueError(f"unknown DiagN estimator {estimator!r}: valid estimators are fd, jvp, vjp")
    return v * jv


def hutchinson_diag(f: ProbeFn, x: Tensor, v: Tensor, estimator: str, eps: float | None = None,
                    fx: Tensor | None = None, token_dims: int = 0) -> Tensor:
    """diag(J_f(x)) estimated from probes v (P, *X): mean over probes of `probe_products`."""
    return probe_products(f, x, v, estimator, eps, fx, token_dims).mean(0)


# ----------------------------------------------------------------------------- chunk plumbing
class ReadOnlyCache:
    """KV-cache stand-in for probe / JVP evaluations: `write` returns the cached K/V of positions
    0..start-1 of the given layer slots (repeated `repeat` times along the batch for probe-stacked
    batches, batch index p*B + b) concatenated with the new K/V, and stores nothing."""

    def __init__(self, cache, layers: Tensor | None = None, repeat: int = 1):
        self.cache, self.layers, self.repeat = cache, layers, repeat

    def write(self, layers, k: Tensor, v: Tensor, start: int | Tensor) -> tuple[Tensor, Tensor]:
        sel = self.layers if self.layers is not None else layers
        if isinstance(start, Tensor):  # positions: (T,) (the static-shape step) or (B, T) (a ragged batched call)
            return self._put(self.cache.k[sel], k, start), self._put(self.cache.v[sel], v, start)
        old_k, old_v = self.cache.k[sel][..., :start, :], self.cache.v[sel][..., :start, :]
        if self.repeat > 1:
            rep = (1, self.repeat) + (1,) * (old_k.dim() - 2)
            old_k, old_v = old_k.repeat(rep), old_v.repeat(rep)
        return torch.cat([old_k.to(k.dtype), k], -2), torch.cat([old_v.to(v.dtype), v], -2)

    def _put(self, slot: Tensor, new: Tensor, pos: Tensor) -> Tensor:
        """What KVCache.write returns for a positions tensor, without writing: the whole slot (n, B, Hkv, max_len,
        hd) (batch repeated for the probes) with `new` (n, B', Hkv, T, hd) at positions `pos`, out of place."""
        out = slot.to(new.dtype).repeat(1, self.repeat, *[1] * (slot.dim() - 2))  # a copy: the cache stays as it is
        if pos.dim() == 1:  # (T,): every row at the same positions
            out[..., pos, :] = new
        else:  # (B', T): row b at pos[b] (a probe-stacked call's positions are repeated with its rows already)
            rows = torch.arange(pos.shape[0], device=pos.device)[:, None]  # (B', 1)
            out[:, rows, :, pos, :] = new.permute(1, 3, 0, 2, 4)  # indexed dims first: (B', T, n, Hkv, hd)
        return out

    def __getattr__(self, name):
        return getattr(self.cache, name)


def select_chunks(w: ChunkWeights, chunks) -> ChunkWeights:
    """The stacked weights of the given chunks only. Generic over ChunkWeights' fields (nested
    dataclasses such as the mHC coefficients and tuples included): whatever `ChunkWeights.chunk`
    slices is gathered by concatenating the per-chunk slices, the rest is kept."""
    chunks = list(chunks)
    if chunks == list(range(w.chunks)):
        return w
    parts = [w.chunk(c) for c in chunks]
    if len(parts) == 1:
        return parts[0]
    merged = _merge(w, parts)
    # the window fields are derived from the host windows, not concatenated (a chunk whose layers all attend
    # fully has none): rebuilt for the selection
    vals = None if w.window_values is None else tuple(x for c in chunks
                                                       for x in w.window_values[c * w.fuse:(c + 1) * w.fuse])
    return dataclasses.replace(merged, **window_fields(vals, w.qkv.device, vals is not None and any(x >= 0 for x in vals),
                                                       (len(chunks), w.fuse, 1)))


def _is_dataclass(x) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


_DERIVED = ("windows", "window_values", "window_groups")  # rebuilt by select_chunks, never concatenated


def _merge(full, vals: list):
    if isinstance(full, Tensor):
        return torch.cat(vals, 0) if any(v is not full for v in vals) else full
    if _is_dataclass(full):
        return dataclasses.replace(vals[0], **{f.name: _merge(getattr(full, f.name), [getattr(v, f.name) for v in vals])
                                               for f in dataclasses.fields(full) if f.init and f.name not in _DERIVED})
    if isinstance(full, tuple):
        return tuple(_merge(x, [v[i] for v in vals]) for i, x in enumerate(full))
    return vals[0]


def _plain(obj, clone: bool, skip: tuple[str, ...] = ("cache",)):
    """A copy of `obj` (ChunkWeights, Context; nested dataclasses and tuples too) with its tensors
    detached and, with `clone`, tensors made under inference mode cloned into normal ones (so autograd
    may save them). Derived caches in a dict field `extra` are dropped; fields named in `skip` (the
    KV cache, read through ReadOnlyCache) are kept as they are."""
    if isinstance(obj, Tensor):
        return obj.detach().clone() if clone and obj.is_inference() else obj.detach()
    if isinstance(obj, tuple):
        return tuple(_plain(x, clone, skip) for x in obj)
    if not _is_dataclass(obj):
        return obj
    kw = {}
    for f in dataclasses.fields(obj):
        if not f.init or f.name in skip:
            continue
        val = getattr(obj, f.name)
        kw[f.name] = {} if f.name == "extra" and isinstance(val, dict) else _plain(val, clone, skip)
    return dataclasses.replace(obj, **kw)


def _probe_weights(w: ChunkWeights, chunks: list[int], clone: bool) -> ChunkWeights:
    """select_chunks + _plain, cached on the weight set (a weight set built by `chunk_weights` never changes: a new
    one is built when a parameter changes, and on every call under autograd). Shared weights (`views`) change with
    the parameters in place (an edit through `.data` moves no counter, so no rebuild follows): a gathered or cloned
    copy of them would keep the old values, so it is made afresh on every call instead."""
    if w.views and (clone or list(chunks) != list(range(w.chunks))):
        return _plain(select_chunks(w, chunks), clone)
    store = w.__dict__.setdefault("_snlp_probe_weights", {})
    key = (tuple(chunks), clone)
    if key not in store:
        store[key] = _plain(select_chunks(w, chunks), clone)
    return store[key]


def repeat_context(ctx, P: int):
    """Context for a batch stacked P times (batch index p*B + b): x0/idx repeat along dim 0, the
    value embeddings (n_ve, B, ...) along dim 1; derived caches are dropped. A ragged call's per-row facts repeat
    with the rows: its (B, T) positions, their RoPE tables (B, T, 1, hd/2) and the real-token mask (B, T)."""
    if P == 1:
        return ctx
    rep = lambda t, dim: None if t is None else t.repeat(*[P if i == dim else 1 for i in range(t.dim())])  # noqa: E731
    rows = isinstance(ctx.start, Tensor) and ctx.start.dim() == 2  # per-row positions: RoPE tables per row too
    return dataclasses.replace(ctx, idx=rep(ctx.idx, 0), x0=rep(ctx.x0, 0), ve=rep(ctx.ve, 1), extra={},
                               start=rep(ctx.start, 0) if rows else ctx.start, real=rep(ctx.real, 0),
                               cos=rep(ctx.cos, 0) if rows else ctx.cos, sin=rep(ctx.sin, 0) if rows else ctx.sin)


def chunk_probe_map(w: ChunkWeights, ctx, cache=None, layers: Tensor | None = None, P: int = 1) -> ProbeFn:
    """The chunk map as a probe-stacked function (P, C, B, T, ..., D) -> (P, C, B, T, ..., D):
    probes ride in the batch dim of ONE chunk_forward; with a KV cache it reads, never writes."""
    ctx_p = repeat_context(ctx, P)
    pc = None if cache is None else ReadOnlyCache(cache, layers, P)

    def f(xp: Tensor) -> Tensor:
        n, C, B = xp.shape[:3]
        y = chunk_forward(w, xp.transpose(0, 1).reshape(C, n * B, *xp.shape[3:]), ctx_p, pc)
        return y.reshape(C, n, B, *y.shape[2:]).transpose(0, 1)

    return f


@contextlib.contextmanager
def _estimator_mode(estimator: str):
    """Autograd context for the estimators: no_grad (the estimate is detached), and inference mode
    switched off for vjp (autograd cannot record through inference tensors). Yields whether inference
    tensors must be cloned into normal ones."""
    clone = estimator == "vjp" and torch.is_inference_mode_enabled()
    with torch.inference_mode(False) if clone else contextlib.nullcontext(), torch.no_grad():
        yield clone


# ----------------------------------------------------------------------------- entry points
def diag_jacobian(w: ChunkWeights, inputs: Tensor, tilde: Tensor, ctx, plan: Plan,
                  gen: torch.Generator | None = None, chunk0: int = 0, cache_first: int = 0) -> Tensor:
    """Hutchinson estimate of diag(J_c) (n, B, T, ..., D) of every chunk map at its current input
    `inputs` (n, B, T, ..., D), tilde = F(inputs); chunks outside the DiagN subset get a = 1. Detached.
    The n chunks are the plan's chunks chunk0 .. chunk0 + n - 1 (a rank of snlp.dist holds a run of them; the
    single process all, chunk0 = 0): the Rademacher draw covers every (selected) chunk of the plan and each run
    takes its rows, so the ranks' estimates are exactly the single process's. `cache_first`: the layer the KV
    cache's slot 0 holds (a rank's window, snlp.dist; 0 for a full cache)."""
    sur = plan.surrogate  # a DiagN
    n, P, M = inputs.shape[0], sur.probes, w.fuse
    sel = list(range(max(plan.chunks, chunk0 + n))) if sur.subset is None else list(sur.subset)  # plan chunks
    pos = [i for i, c in enumerate(sel) if chunk0 <= c < chunk0 + n]  # rows of the draw this run owns
    local = [sel[i] - chunk0 for i in pos]
    v_all = row_probes(P, inputs, gen, chunks=len(sel))  # one draw over the plan's selected chunks, every run
    if not local:
        return torch.ones_like(inputs)
    cache = ctx.cache
    with _estimator_mode(sur.estimator) as clone:
        ws = _probe_weights(w, local, clone)
        cx = _plain(ctx, clone)
        layers = None
        if cache is not None and (sur.subset is not None or cache_first):  # gathered chunks or a window: name
            layers = torch.tensor([w.start - cache_first + c * M + m for c in local for m in range(M)],  # the slots
                                  device=cache.k.device)
        whole = local == list(range(n))
        idx = None if whole else torch.tensor(local, device=inputs.device)
        x = inputs.detach() if whole else inputs.detach().index_select(0, idx)
        fx = tilde.detach() if whole else tilde.detach().index_select(0, idx)
        v = v_all if len(pos) == len(sel) else v_all[:, pos]
        if clone:
            x, fx, v = x.clone(), fx.clone(), v.clone()
        est = hutchinson_diag(chunk_probe_map(ws, cx, cache, layers, P), x, v, sur.estimator, sur.eps, fx,
                              token_dims=3)
        if whole:
            return est
        return torch.ones_like(est[:1]).expand_as(inputs).index_copy(0, idx, est.to(inputs.dtype))


def newton_delta(w: ChunkWeights, inputs: Tensor, b: Tensor, ctx, plan: Plan, prev: Tensor | None = None) -> Tensor:
    """Exact Newton (DEER over depth): d_c = (1 - elk) J_c(inputs_c) e_{c-1} + b_c, d_0 = b_0, where
    e_{c-1} is the predecessor's update of this sweep d_{c-1} (linked chunk) or of the previous sweep
    `prev`[c-1] (lagged chunk, see snlp.method.solver; no correction when `prev` is None), J_c e by one
    forward-mode JVP of chunk c alone (math SDPA, read-only KV cache). A Python loop
    over chunks: the reference solver, C - 1 sequential JVPs per iteration. Unlike the DiagN
    estimate nothing is detached: under autograd the JVPs are differentiated too (K >= C gives the
    sequential model's gradients)."""
    link, lag = plan.link_factors(), plan.lag_factors()
    cache = ctx.cache
    pc = None if cache is None else ReadOnlyCache(cache)  # chunk(c) names its own layer slots
    out = [b[0]]
    for c in range(1, b.shape[0]):
        factor, e = (link[c], out[-1]) if link[c] else (lag[c], None if prev is None else prev[c - 1])
        if factor == 0.0 or e is None:
            out.append(b[c])
            continue
        wc = w.chunk(c)
        f = lambda x, wc=wc: chunk_forward(wc, x.unsqueeze(0), ctx, pc)[0]  # noqa: E731
        jd = jvp(f, inputs[c], e)
        out.append(factor * jd + b[c])
    return torch.stack(out)

"""The SNLP solver: sequential prefix, then K batched iterations over the fused suffix chunks.

Per iteration k (paper Eq. snlp-iterative, Algorithm "IDN/HCN Batched SNLP Inference"):
    inputs_c  = h_{c-1}^{(k)}            (h_0 = h_S, the exact prefix state)
    tilde_c   = F_c(inputs_c)            all C chunks in ONE batched op (fusion.chunk_forward)
    h_c^{(k+1)} = tilde_c + A_c e_{c-1}
Correction order (paper App. "Correction Ordering"): the sweep visits the chunks in the order pi
(`Plan.order`, forward by default) and chunk c is corrected by its predecessor's MOST RECENT update
e_{c-1}: the update of this sweep, d_{c-1}^{(k)} = h_{c-1}^{(k+1)} - h_{c-1}^{(k)}, if pi visits
c-1 before c ("linked"), else the update made in the previous sweep, d_{c-1}^{(k-1)} ("lagged";
d^{(-1)} = 0, so at K = 1 a lagged chunk gets no correction and reversed order equals Jacobi, while
from K = 2 on the previous sweep's updates still propagate along the permutation chain).
Writing d_c = h_c^{(k+1)} - h_c^{(k)} turns the correction into the linear recurrence
    d_c = a_c o d_{c-1} + (tilde_c - h_c^{(k)}) + a'_c o d_{c-1}^{(k-1)},   d_{-1} = 0,
where a_c is the surrogate A_c times the link factor (the ELK factor 1 - elk where linked, else 0)
and a'_c the surrogate times the lag factor (1 - elk where lagged, else 0); forward order has no
lagged chunk, so its recurrence (and result, bit for bit) is the plain one:
  - idn: A_c = 1, so a_c is the link factor. Forward order without ELK (a_c = 1) is a prefix sum over chunks
    (cumsum); with ELK one (C x C) transfer-matrix contraction of b; with lagged chunks one (C x 2C)
    contraction of [b; d^{(k-1)}] (surrogates.scalar_correct).
  - none (Jacobi): a_c = 0, h^{(k+1)} = tilde.
  - hcn: a_c = the chunk's H_res product over the mHC streams at the current iterate (returned by
    the chunk forward); solved by a matrix associative scan (snlp.method.scan).
  - diag: a_c = Hutchinson estimate of diag(J_c) (snlp.method.jacobian); elementwise associative scan.
  - newton: the exact J_c d_{c-1} by JVPs, one chunk after another (reference solver, not fast).
Each surrogate is a typed value in snlp.method.surrogates that owns its grammar token, cost and correction;
the lagged term is folded into b before the scan, so every surrogate keeps its one vectorised solve.
A `causal` plan (Plan.causal) runs every suffix branch fully causal (fusion.full_causal): the same solve of another
function, the model with full-attention suffix layers, which K >= C reaches instead of the model.
Exactness (`Plan.exact_after`): after k iterations chunk c is exact once k >= t_c, t_0 = 1 (0 with the fwd init,
whose F_0(h_S) is exact), t_c = t_{c-1} + 1 (linked) or + 2 (lagged, t_{c-1} > 0); K >= C is exact for forward
order (C - 1 from fwd), K >= C + #lagged for any. `init_states` replaces the plan's init: t_0 = 1 then.
No Python loop runs over layers or chunks on the hot path except in the exact-Newton reference.
With `tol` > 0, K is a maximum and every row (sequence) of the batch converges on its own: a row whose
final-state relative update ||d_{C-1}|| / ||h_{C-1}^{(k+1)}|| is below tol is frozen (its states kept
exactly, its chunk inputs held at those of its last iteration, so a KV cache gets that iteration's K/V)
while the other rows iterate, and the solve stops once every row is frozen. A row's result therefore
never depends on what else is in the batch (tests/method/test_seams_solver.py).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from snlp.method.surrogates import DiagN, Iterate
from snlp.method.fusion import ChunkWeights, chunk_forward, chunk_weights, full_causal
from snlp.method.jacobian import check_fd_step
from snlp.runtime.checks import check_bools
from snlp.model.gpt import GPT, check_gpt, check_keep
from snlp.method.plan import Plan
from snlp.method.preheat import Preheat
from snlp.method.sharing import check_shareable, share_chunk_weights


class SNLPDivergenceError(FloatingPointError):
    """The SNLP iteration produced NaN/inf hidden states."""


@dataclass
class SolveResult:
    """Outcome of an SNLP solve (or of the fused model run sequentially)."""

    hidden: Tensor  # (B, T, D) the state the head reads: h_L (with nanochat's backout, minus the backout state,
    #                 `backout_state`); with mHC every state has the stream dim: (B, T, n, D)
    prefix: Tensor  # (B, T, D) exact prefix state h_S
    plan: Plan
    states: list[Tensor] = field(default_factory=list)  # chunk outputs (C, B, T, D); [0] = init
    iters: int = 0  # batched iterations run (< plan.iters when `tol` stopped every row early) = max(row_iters)
    updates: list[float] = field(default_factory=list)  # per iteration, max over the batch of the final-state
    # relative update (tol > 0; frozen rows count 0)
    row_iters: Tensor | None = None  # (B,) iterations each row ran before `tol` froze it (all `iters` without tol)


def as_plan(model: GPT, plan: Plan | str) -> Plan:
    """`plan` parsed if given as a string, and checked against the model's config (which must be an snlp GPT's)."""
    check_gpt(model)
    return Plan.parse(plan).check_model(model.config)


def row_updates(d: Tensor, h: Tensor, real: Tensor | None = None) -> Tensor:
    """(B,) float64 ||d_b|| / ||h_b|| of final-chunk tensors (B, T, ...). Norms in fp32 (fp64 for fp64 states),
    the ratio in fp64 so the per-row test `rel < tol` on the device and the host's `float(rel.max()) < tol`
    (the Python float tol) compare the same numbers and can never disagree. `real` (B, T) bool: only those
    positions count (a ragged batch pads short rows at their end; the padding must not move a row's stop test,
    or a row would freeze, and cache K/V, differently than alone)."""
    acc = torch.promote_types(h.dtype, torch.float32)
    d, h = d.detach().to(acc), h.detach().to(acc)
    if real is not None:  # zero the padding: it adds nothing to either norm
        keep = real.view(*real.shape, *[1] * (h.dim() - 2))
        d, h = d.masked_fill(~keep, 0), h.masked_fill(~keep, 0)
    num = d.flatten(1).norm(dim=1).double()
    return num / (h.flatten(1).norm(dim=1).double() + 1e-12)


def row_mask(done: Tensor, like: Tensor) -> Tensor:
    """The (B,) row mask `done` shaped to broadcast over `like` (C, B, T, ...)."""
    return done.view(1, -1, *[1] * (like.dim() - 2))


def freeze_rows(done: Tensor, old: Tensor, new: Tensor) -> Tensor:
    """`new` with the rows (dim 1) flagged in `done` (B,) replaced by `old`, exactly (torch.where)."""
    return torch.where(row_mask(done, new), old, new)


def check_preheat(plan: Plan, preheat: Preheat | None, model: GPT, verify_weights: bool = True) -> None:
    """A preheat plan needs a calibration of this model; any other plan must not be given one."""
    if plan.init == "preheat":
        if preheat is None:
            raise ValueError(f"plan {plan} starts from the preheat init: pass its calibration (preheat=...): "
                             "snlp.method.preheat.fit(model), or `snlp calibrate CKPT` then "
                             "snlp.io.checkpoint.load_preheat(CKPT, model)")
        preheat.check(model, verify_weights)
    elif preheat is not None:
        raise ValueError(f"a preheat calibration was given but plan {plan} has the {plan.init} init, which does not "
                         "read it; drop preheat= or use a -preheat- plan")


def preheat_for(plan: Plan, preheat: Preheat | None) -> Preheat | None:
    """The calibration to give `plan` when one is at hand for a set of plans: only preheat plans read it."""
    return preheat if plan.init == "preheat" else None


def _check_finite(h: Tensor, plan: Plan) -> None:
    if not bool(torch.isfinite(h).all()):
        raise SNLPDivergenceError(
            f"SNLP plan {plan} diverged: the final hidden state contains NaN/inf; {plan.divergence_hints()}.")


def backout_state(model: GPT, plan: Plan, ctx, states: Tensor) -> Tensor | None:
    """What the backout subtracts (GPTConfig.backout; None without it): layer b = n_layer // 2's output, exact
    from the prefix when b < S (ctx.hb, kept by run_layers), else the current iterate of the chunk that holds layer
    b, states[(b - S) // M] (C, B, T, ...) -> (B, T, ...): for M = 1 layer b's own iterate (exact once that chunk
    is, so K >= C gives the sequential logits), for M > 1 the fused chunk's output, as the paper's code reads it."""
    b = model.config.backout_layer
    if b is None:
        return None
    S = plan.prefix_len(model.config.n_layer)
    return ctx.hb if b < S else states[(b - S) // plan.fuse]


def initial_states(plan: Plan, S: int, hS: Tensor, ctx, w: ChunkWeights, cache=None, init_states: Tensor | None = None,
                   preheat: Preheat | None = None) -> Tensor:
    """The chunk states (C, B, T, D) the iterations start from: given `init_states` (a warm start, e.g. h0-JD),
    the preheat predictors of each chunk's last layer, h_S everywhere (h0), or one batched forward F_c(h_S) (fwd)."""
    C = plan.chunks
    if init_states is not None:
        if init_states.shape != (C, *hS.shape):
            raise ValueError(f"init_states must have shape (C, *h_S.shape) = {(C, *hS.shape)}, got "
                             f"{tuple(init_states.shape)}")
        return init_states.to(hS.dtype)
    if plan.init == "preheat":  # per-layer low-rank affine predictors of the chunk outputs (snlp.method.preheat)
        return preheat.predict(ctx.x0, [S + (c + 1) * plan.fuse - 1 for c in range(C)])
    h = hS.expand(C, *hS.shape)  # h0 init: every chunk output starts at h_S
    return chunk_forward(w, h, ctx, cache) if plan.init == "fwd" else h  # fwd: one-shot batched F_c(h_S)


def solve(model: GPT, idx: Tensor, plan: Plan | str, keep_states: bool = False,
          check_finite: bool = True, cache=None, weights: ChunkWeights | None = None,
          prefix: Tensor | None = None, init_states: Tensor | None = None, pos: Tensor | None = None,
          preheat: Preheat | None = None, hb: Tensor | None = None,
          probe_gen: torch.Generator | None = None) -> SolveResult:
    """Run the SNLP solve for token ids idx (B, T). `keep_states` records the chunk-output states
    (C, B, T, D) of the init and of every iteration. Raises SNLPDivergenceError on NaN/inf.

    With a KV `cache` (snlp.model.cache.KVCache) idx continues the cached sequence (SNLP decoding): the
    prefix layers read/write the cache exactly; every suffix branch attends over the cached K/V
    of earlier positions plus the new tokens' K/V computed from its current input estimate, so
    the K/V left in the cache are those of the inputs the last iteration used. The cache then
    advances by T. `weights` (from `chunk_weights`) skips the cache lookup, e.g. under torch.compile.
    `prefix` is an already computed h_S (B, T, D) for idx, e.g. from the training forward's trace,
    so the prefix layers are not run twice (not with a cache: the prefix K/V would stay unwritten).
    `init_states` (C, B, T, D) replaces the plan's init (h0 / fwd / preheat) by given chunk states, e.g. a
    warm start from an earlier solve. `pos` ((T,) positions, with `cache`) is the static-shape decode step
    of snlp.decode.steps: K/V go to those positions, the whole cache is attended under a mask and the cache does
    not advance (the caller owns its length), so one compiled graph serves every step. `preheat` is the
    calibration (snlp.method.preheat.Preheat) that plans with the `preheat` init start from; it is required
    by them and refused by others (it would be silently unused). The solve checks only its shape (layers, width):
    its weights fingerprint (a calibration of other weights of the same shape) is compared by `bind`, once, and by
    `load_preheat` and the decoders, since hashing every weight per call would cost more than the solve. `hb`: with `prefix` and nanochat's backout
    (GPTConfig.backout) whose layer b lies in the prefix, that layer's output (`GPT.prefix_backout(trace, S)`).
    `probe_gen`: the generator DiagN's Rademacher probes are drawn from (on hS's device); None: one seeded 0 per call,
    so a solve is reproducible (evaluation). The DiagN regulariser passes a fresh one each step
    (snlp.train.regularizer), as a Hutchinson estimate averages over probes only when they change."""
    if probe_gen is not None and not isinstance(probe_gen, torch.Generator):
        raise ValueError(f"solve(probe_gen=...) must be a torch.Generator, got {type(probe_gen).__name__}")
    check_bools(keep_states=keep_states, check_finite=check_finite)
    plan = as_plan(model, plan)
    check_preheat(plan, preheat, model, verify_weights=False)  # the fingerprint is checked once, by bind
    check_fd_step(plan, model.wte.weight.dtype, model.wte.weight.device.type)  # an eps the FD step cannot take
    if prefix is not None and cache is not None:
        raise ValueError("solve(prefix=..., cache=...): a precomputed prefix state skips the prefix layers, so "
                         "their K/V would never reach the cache while it advances; pass one or the other")
    S, C = plan.prefix_len(model.config.n_layer), plan.chunks
    b = model.config.backout_layer
    if prefix is not None and b is not None and b < S:
        if hb is None:
            raise ValueError(f"solve(prefix=...) skips the prefix layers, but this model's backout reads layer {b}'s "
                             f"output, inside the prefix of plan {plan} (S = {S}): pass it as hb= "
                             f"(GPT.prefix_backout(trace, S)) or run the solve without prefix=")
    elif hb is not None:
        raise ValueError(f"solve(hb=...) is the backout state of a precomputed prefix holding the backout layer; "
                         f"plan {plan} (S = {S}) with {'no prefix' if prefix is None else 'this model'} never reads it")
    ctx = model.embed(idx, cache, pos)
    if hb is not None:
        ctx.hb = hb
    hS = prefix if prefix is not None else model.run_layers(ctx.x0, ctx, 0, S)  # exact sequential prefix
    w = weights if weights is not None else chunk_weights(model, S, C, plan.fuse)
    if plan.causal:  # the suffix attends fully (given weights too: the plan, not the caller, sets the function)
        w = full_causal(w)
    h = initial_states(plan, S, hS, ctx, w, cache, init_states, preheat)  # (C, B, T, D)
    states = [h] if keep_states else []
    sur = plan.surrogate
    gen = None if not isinstance(sur, DiagN) else probe_gen if probe_gen is not None else \
        torch.Generator(hS.device).manual_seed(0)  # reproducible probes unless the caller draws them
    iters, updates, d = 0, [], None
    done = None  # tol: (B,) rows frozen by the per-row stop test (None until the first test)
    last_inputs = None  # tol: the chunk inputs of the last iteration (what frozen rows keep reading)
    row_iters = torch.zeros(hS.shape[0], dtype=torch.long, device=hS.device) if plan.tol else None
    for _ in range(plan.iters):
        inputs = torch.cat([hS[None], h[:-1]], 0)  # (C, B, T, D): chunk c reads h_{c-1}^{(k)}
        if done is not None:  # a frozen row re-reads the inputs of its last iteration: its K/V in a cache are
            inputs = freeze_rows(done, last_inputs, inputs)  # those of that iteration, as if it had run alone
        if sur.needs_mix:
            tilde, mix = chunk_forward(w, inputs, ctx, cache, mix=True)
        else:
            tilde, mix = chunk_forward(w, inputs, ctx, cache), None
        prev = d if plan.order is not None else None  # the previous sweep's update: lagged chunks read it
        d, h_new = sur.step(Iterate(plan, w, ctx, inputs, tilde, h, mix, gen, prev))  # d = h^{(k+1)} - h^{(k)} (C, B, T, D)
        if done is not None:  # frozen rows keep their state exactly and report a zero update
            d, h_new = d.masked_fill(row_mask(done, d), 0), freeze_rows(done, h, h_new)
        h = h_new
        iters += 1
        if keep_states:
            states.append(h)
        if plan.tol:
            row_iters += 1 if done is None else ~done
            rel = row_updates(d[-1], h[-1], ctx.real)  # (B,); 0 for frozen rows; end padding left out
            updates.append(float(rel.max()))  # the one host sync of the stop test: every row is below tol
            if updates[-1] < plan.tol:
                break
            done = rel < plan.tol if done is None else done | (rel < plan.tol)
            last_inputs = inputs
    if cache is not None:
        if plan.iters == 0 and (plan.init != "fwd" or init_states is not None):  # nothing evaluated the
            chunk_forward(w, torch.cat([hS[None], h[:-1]], 0), ctx, cache)  # suffix: write the final inputs' K/V
        if pos is None:
            cache.advance(idx.shape[1])
    if check_finite:
        _check_finite(h[-1], plan)
    if row_iters is None:  # fixed K: every row ran every iteration
        row_iters = torch.full((hS.shape[0],), iters, dtype=torch.long, device=hS.device)
    hidden = model.finish(h[-1], backout_state(model, plan, ctx, h))
    return SolveResult(hidden=hidden, prefix=hS, plan=plan, states=states, iters=iters, updates=updates,
                       row_iters=row_iters)


def parallel_forward(model: GPT, idx: Tensor, plan: Plan | str, check_finite: bool = True, cache=None,
                     preheat: Preheat | None = None) -> Tensor:
    """SNLP forward: token ids (B, T) -> logits (B, T, V). With a KV `cache`, an SNLP decode step
    (see `solve`). `preheat`: the calibration a -preheat- plan starts from (as in `solve`: its shape is checked, its
    weights fingerprint is not; `bind` checks that). Fuses the suffix weights on every call (always current); to run a
    plan many times, `bind` it once."""
    check_gpt(model)  # before `model.head` is looked up
    return model.head(solve(model, idx, plan, check_finite=check_finite, cache=cache, preheat=preheat).hidden)


_VERSION = operator.attrgetter("_version")
_OPTIMIZER_STEPS = [0]  # optimizer steps taken in this process, by any optimizer (Runner.weights_stamp)
_STEP_HOOK = []


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    _OPTIMIZER_STEPS[0] += 1


def _watch_optimizer_steps() -> None:
    """Count every optimizer step (torch's global post-step hook; once per process): fused optimizers (AdamW /
    Adam / SGD with fused=True, nanochat's and `snlp train --compile`'s on CUDA) write the parameters in place
    without moving their version counters, so a runner would not see their updates otherwise."""
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_post_hook(_count_optimizer_step))


class Runner:
    """A model bound to an SNLP plan (`snlp.bind`). The fused chunk weights are built once, here, and
    held explicitly in `.weights`; nothing is cached behind the model's back. Each call first checks them
    against the model's parameters (`current`: the optimizer steps taken since, the sum of the parameters' version
    counters and their addresses, a few attribute reads per parameter and no host sync) and rebuilds them if any
    moved, so an optimizer step (fused ones included), `load_state_dict`, an in-place edit under no_grad,
    `p.data = t` and `model.to(...)` are followed without a `refresh()`. The storages the weights were built from
    are held until the next rebuild, so a new tensor cannot reuse a stamped address. Edits none of these see still
    need a `refresh()`: edits through `.data` (`p.data.copy_(t)`, or an alias rewritten and swapped back in:
    `.data` aliases carry version counters of their own), a parameter replaced by a new Parameter object
    (`load_state_dict(assign=True)`), and in-place updates of parameters made under `torch.inference_mode` (inference
    tensors have no version counter). Calling the runner is the SNLP forward
    idx (B, T) -> logits (B, T, V), optionally one KV-cached decode step; it is what bench, eval,
    generate and the speculative drafter take, and `torch.compile(runner)` compiles it (traced code cannot
    read version counters, so a compiled runner is not checked: call `current()` before it, as the decode steps
    of snlp.decode.steps do). The weights
    are built without autograd: to train through the solve, call `solve(model, ...)` (fresh weights
    with gradients) instead."""

    def __init__(self, model: GPT, plan: Plan | str, check_finite: bool = True, preheat: Preheat | None = None,
                 share_weights: bool = False):
        check_bools(check_finite=check_finite, share_weights=share_weights)
        self.model, self.plan, self.check_finite = model, as_plan(model, plan), check_finite
        self.preheat, self.share_weights = preheat, share_weights
        w = model.wte.weight  # a diag:fd eps this model's dtype cannot take is refused before the weights are fused
        check_fd_step(self.plan, w.dtype, w.device.type)
        if share_weights:
            check_shareable(model, self.plan.fuse)
        self.refresh()

    def refresh(self) -> "Runner":
        """Rebuild the fused weights from the model's current parameters (and re-check a preheat calibration
        against them: new weights make it stale). Shared weights: fresh views of the model's homes, re-homing
        only what was given new storage (no matrix copy otherwise)."""
        check_preheat(self.plan, self.preheat, self.model)
        if self.preheat is not None:
            w = self.model.wte.weight
            self.preheat = self.preheat.to(w.device, w.dtype)
        S = self.plan.prefix_len(self.model.config.n_layer)
        # normal tensors even when (re)built under inference_mode (`current` runs inside decode loops): a later call
        # under grad mode (the prefix's parameters require grad) could not save inference tensors for backward
        with torch.inference_mode(False), torch.no_grad():
            if self.share_weights:  # views of the model's own (re-homed) parameters: snlp.method.sharing
                self.weights = share_chunk_weights(self.model, S, self.plan.chunks, self.plan.causal)
            else:
                self.weights = chunk_weights(self.model, S, self.plan.chunks, self.plan.fuse, self.plan.causal)
        self._params = list(self.model.parameters())
        self._tracked = [p for p in self._params if not p.is_inference()]  # inference tensors have no counter
        # the storages the weights came from, held: freed, their addresses could come back under new tensors
        self._held = [p.untyped_storage() for p in self._params]
        _watch_optimizer_steps()
        self._stamp = self.weights_stamp()
        return self

    def weights_stamp(self) -> tuple:
        """What `current` compares: the optimizer steps taken in this process (fused optimizers move no counter),
        the sum of the parameters' version counters (they only grow, so any in-place update moves the sum) and every
        parameter's address (`p.data = t` and `model.to(...)` give new storage without moving a counter)."""
        return (_OPTIMIZER_STEPS[0], sum(map(_VERSION, self._tracked)), tuple(map(Tensor.data_ptr, self._params)))

    def current(self) -> bool:
        """Rebuild the fused weights (`refresh`) if the model's parameters changed since they were built (see the
        class docstring for what is seen); True if they were rebuilt. Every call of the runner runs it first,
        outside compiled code (a compiled decode step runs it before its graph: snlp.decode.steps.snlp_step)."""
        if self.weights_stamp() == self._stamp:
            return False
        self.refresh()
        return True

    def solve(self, idx: Tensor, cache=None, keep_states: bool = False, check_finite: bool | None = None,
              prefix: Tensor | None = None, init_states: Tensor | None = None, pos: Tensor | None = None,
              hb: Tensor | None = None) -> SolveResult:
        """`snlp.solve` with the bound weights (rebuilt first if the model's parameters changed: `current`)."""
        if not torch.compiler.is_compiling():  # traced code cannot read version counters: its step checks
            self.current()
        return solve(self.model, idx, self.plan, keep_states=keep_states, cache=cache, weights=self.weights,
                     check_finite=self.check_finite if check_finite is None else check_finite, prefix=prefix,
                     init_states=init_states, pos=pos, preheat=self.preheat, hb=hb)

    def __call__(self, idx: Tensor, cache=None, pos: Tensor | None = None, keep: int | None = None) -> Tensor:
        """Logits (B, T, V) of the plan's solve; `keep`: of the last `keep` positions only (GPT.forward's)."""
        check_keep(keep, idx)  # before the solve, as GPT.forward checks it
        return self.model.head(self.solve(idx, cache=cache, pos=pos).hidden, keep)

    def __repr__(self) -> str:
        return f"Runner(plan={self.plan}, layers={self.model.config.n_layer})"


def bind(model: GPT, plan: Plan | str, check_finite: bool = True, preheat: Preheat | None = None,
         share_weights: bool = False) -> Runner:
    """Bind `model` to `plan`: a Runner holding the plan's fused weights (see Runner). With
    `check_finite` a NaN/inf final state raises SNLPDivergenceError (a host sync per call; decoding
    loops and compiled code pass False and check outside the step). `preheat`: the calibration a plan with
    the preheat init needs (checked against the model's weights here, once). `share_weights` (M = 1 plans on
    plain models): every tensor the runner reads from the model is a view of the model's own parameter storage
    (the parameters of all layers are moved once into per-kind stacks, values unchanged; snlp.method.sharing),
    so a drafter and its verifier stream each weight byte once, any number of shared runners over any suffixes
    read one copy, and in-place weight updates (optimizer steps, load_state_dict, `.data[...]` edits) reach
    every shared runner through its views. Giving parameters new storage (`model.to`, `p.data = t`) moves their
    addresses, and each runner's next call rebuilds its weights (Runner.current), shared or not."""
    return Runner(model, plan, check_finite, preheat, share_weights)


def fused_sequential(model: GPT, idx: Tensor, plan: Plan | str) -> SolveResult:
    """Run the *fused* model of `plan` sequentially (prefix, then chunk 1, 2, ..., C with the same
    fused weights and op as the solver). This is what SNLP converges to for K >= C; fused plans
    are compared against it (AR match, exactness). states[0] holds all chunk outputs (C,B,T,D)."""
    plan = as_plan(model, plan)
    S = plan.prefix_len(model.config.n_layer)
    ctx = model.embed(idx)
    hS = model.run_layers(ctx.x0, ctx, 0, S)
    w = chunk_weights(model, S, plan.chunks, plan.fuse, plan.causal)
    h, outs = hS, []
    for c in range(plan.chunks):  # inherently sequential: this is the reference, not the solver
        h = chunk_forward(w.chunk(c), h[None], ctx)[0]
        outs.append(h)
    states = torch.stack(outs)
    return SolveResult(hidden=model.finish(h, backout_state(model, plan, ctx, states)), prefix=hS, plan=plan,
                       states=[states])


def permuted_sequential(model: GPT, idx: Tensor, plan: Plan | str, order: tuple[int, ...] | None = None,
                        prefix: Tensor | None = None) -> SolveResult:
    """Seq-Perm (paper App. "Correction Ordering"): the prefix, then the plan's fused suffix chunks
    run sequentially in the order `order` (default `plan.order`; None = forward, which is
    `fused_sequential`). It measures how much the suffix depends on its layer order at all, apart
    from any solver. states[0] holds the chunk outputs (C, B, T, D) in execution order. `prefix` is
    an already computed h_S (as in `solve`)."""
    plan = as_plan(model, plan)
    order = plan.order if order is None else tuple(order)
    if order is not None and sorted(order) != list(range(plan.chunks)):
        raise ValueError(f"order {order} must be a permutation of 0..{plan.chunks - 1}")
    S = plan.prefix_len(model.config.n_layer)
    if model.config.backout:  # which chunk output would stand for layer b's is not defined once the order changes
        raise ValueError("permuted_sequential reorders the suffix, and this model's backout reads a layer's output "
                         "at a fixed depth: Seq-Perm is not defined for nanochat's backout")
    ctx = model.embed(idx)
    hS = prefix if prefix is not None else model.run_layers(ctx.x0, ctx, 0, S)
    w = chunk_weights(model, S, plan.chunks, plan.fuse, plan.causal)
    h, outs = hS, []
    for c in (order or range(plan.chunks)):  # inherently sequential: one chunk after another
        h = chunk_forward(w.chunk(c), h[None], ctx)[0]
        outs.append(h)
    return SolveResult(hidden=h, prefix=hS, plan=plan, states=[torch.stack(outs)])


def fused_forward(model: GPT, idx: Tensor, plan: Plan | str) -> Tensor:
    """Logits (B, T, V) of the fused model of `plan` run sequentially."""
    check_gpt(model)
    return model.head(fused_sequential(model, idx, plan).hidden)

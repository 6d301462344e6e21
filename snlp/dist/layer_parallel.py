"""Layer-parallel SNLP across processes (torch.distributed; gloo on CPU, NCCL on GPU; launched by torchrun).

Partition (`partition`). With P ranks the plan's C suffix chunks are split into P contiguous blocks,
as even as possible (the first C mod P ranks get one chunk more; C < P is refused). Rank r builds
the fused weights of ITS block only (`fusion.chunk_weights` on its layer range, identical to
`jacobian.select_chunks` of the full stack) and allocates the KV cache of its layers only
(`WindowKVCache`); the suffix layers it does not own are dropped from its model copy. The
sequential prefix runs on rank 0, which broadcasts h_S once per solve (every rank needs h_S for the
h0/fwd init); the head runs on the last rank. Replicating the prefix instead would cost every rank
the prefix weights and KV cache and take the same time as rank 0's prefix, to save one O(B*T*D)
broadcast, so the prefix is not replicated. The token embedding is replicated (every rank needs x0);
of the per-layer value-embedding tables (each as big as the token embedding) a rank keeps only its
own layers'.

One iteration k on rank r (chunks c0..c1-1; paper Eq. snlp-iterative, the solver's recurrence
d_c = a_c o d_{c-1} + b_c with b = tilde - h^{(k)}):
  1. inputs = [h_{c0-1}^{(k)}, h_{c0}^{(k)}, ..., h_{c1-2}^{(k)}], the first one received from rank r-1
     (rank 0: h_S); tilde = F(inputs), one batched `chunk_forward` of the local chunks.
  2. local affine maps a_c (IDN: the link/ELK factor, a scalar; HCN: the chunk's n x n H_res product
     times it; DiagN: the Hutchinson diagonal times it; Jacobi/none: 0, no scan at all; each surrogate
     owns its map and correction, `Surrogate.scan_step`, which the rank calls with its cross-rank scan)
     and the local scan d^loc = affine_scan(a, b) (as if d_{c0-1} = 0); the block's total map is
     (A_r, B_r) = (a_{c1-1} o ... o a_{c0}, d^loc_{c1-1}).
  3. one all_gather of (A_q, B_q) over ranks, then rank r composes ranks 0..r-1 with the same
     `snlp.method.scan.affine_scan` (an exclusive scan over ranks) to get d_{c0-1}, and solves its chunks
     with d_{c0-1} prepended: exactly the single-process recurrence, regrouped.
  4. h^{(k+1)} = h^{(k)} + d; the boundary state h_{c1-1}^{(k+1)} goes to rank r+1 (point-to-point).
Communication per iteration and rank: one all_gather of B*T*D (+ A_q: nothing for IDN, B*T*n*n for
HCN, B*T*D for DiagN) and one B*T*D send/receive: O(B*T*D), independent of depth. Tensor
parallelism over the same ranks all-reduces B*T*D twice PER LAYER (after attention and after the
MLP), i.e. 2L all-reduces per forward vs 2K messages here (K iterations, K << L).

Decoding. SNLP decode steps use the rank-local KV windows exactly like `solver.solve` uses the
full cache; the token chosen on the last rank is broadcast. Self-speculative decoding drafts with
the distributed SNLP forward and verifies with the ORIGINAL layers run layer-pipelined over the
same ranks (`pipeline_forward`): every rank runs its own layer range sequentially and passes
h on. Why pipelined rather than on one rank: the point of P ranks is that one device need not hold
all weights and the whole KV cache, and the verifier shares the per-layer KV slots with the drafter
(snlp.model.cache), which live on the ranks that own the layers; a one-rank verifier would need every
layer's weights and cache there. The price is that the verifier keeps the original layer weights
of its range next to the fused ones (`keep_layers=True`; for M = 1 a second copy).

Start-up check: all ranks all_gather a SHA-256 of the plan string and of the model's state dict
(before dropping unowned layers; with `checkpoint=`, `RankCheckpoint.digest`); a mismatch is a
ValueError on every rank naming what differs.
Failure: `init_distributed(timeout_s=...)` sets the process group's timeout; every collective and
point-to-point call is wrapped so that a dead or hung peer surfaces as `RankFailureError` (which
says which op, which rank and the timeout) instead of a hang, and any other failure of the call as a
`CollectiveError` quoting its own reason (both chain the original exception).

Devices. Every tensor a collective or point-to-point call sees lives on the rank's device (the
model's: NCCL takes CUDA tensors only), sampling uses a generator on that device, and with
`checkpoint=` (snlp.dist.load) a rank reads from the checkpoint only the tensors of the layers it
computes, straight onto its device, from a model built on the `meta` device.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from snlp.model.cache import KVCache, check_cache_fits
from snlp.method.fusion import ChunkWeights, build_chunk_weights, chunk_forward, full_causal
from snlp.method.jacobian import check_fd_step
from snlp.model.gpt import GPT, check_keep
from snlp.method.surrogates import SURROGATES, Iterate
from snlp.method.plan import Plan
from snlp.method.scan import affine_scan
from snlp.decode.batch import is_batch
from snlp.decode.penalty import check_repetition_penalty
from snlp.decode.session import (DecodeSession, GenerateResult, Sampling, check_decode_args, check_picked,
                                 check_stream, make_generator, pooled_alpha, sampling)
from snlp.decode.speculative import penalised_draft_pick, speculative_verdict
from snlp.method.preheat import Preheat
from snlp.runtime.ranks import group_started
from snlp.runtime.timing import now, round_order
from snlp.method.solver import SNLPDivergenceError, as_plan, check_preheat, freeze_rows, row_mask, row_updates

DEFAULT_TIMEOUT_S = 120.0


class CollectiveError(RuntimeError):
    """A collective / point-to-point call failed on this rank; the message names the op and carries the
    original error (also chained as __cause__)."""


class RankFailureError(CollectiveError):
    """A peer rank died or did not answer within the process group's timeout."""


# what gloo and NCCL say when the failure is a peer that is gone or silent (a timeout, a closed / reset
# connection, an aborted communicator); any other failure is reported with its own reason
PEER_LOSS_MARKERS = ("timed out", "timeout", "connection reset", "connection closed", "broken pipe",
                     "connection refused", "communicator was aborted", "remote process exited", "network error")


def _peer_lost(e: BaseException) -> bool:
    msg = str(e).lower()
    return isinstance(e, dist.DistNetworkError) or any(m in msg for m in PEER_LOSS_MARKERS)


# ----------------------------------------------------------------------------- process group
def check_timeout(timeout_s) -> None:
    """The process-group timeout must be a finite number of seconds > 0: c10d takes 0 or a negative one as an already
    expired deadline (every rank fails its first rendezvous with a C++ traceback) and timedelta overflows on inf."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or timeout_s <= 0:
        raise ValueError(f"the distributed timeout must be a finite number of seconds > 0 (got {timeout_s!r})")


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, device: str | torch.device = "cpu") -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) unless it already is: gloo on CPU, NCCL on CUDA, with `timeout_s` as
    the collective timeout (a dead peer makes the others fail after at most this long). (rank, world)."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    check_timeout(timeout_s)
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"--distributed needs the torchrun environment ({', '.join(missing)} unset): launch with "
                             f"`torchrun --nproc_per_node=P -m snlp ...`")
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    group_started()  # from here a rank's error may be its own: every rank says it (snlp.runtime.ranks)
    return dist.get_rank(), dist.get_world_size()


@contextmanager
def _comm(op: str):
    """Say what failed: a collective / point-to-point call that failed because a peer is gone or silent
    becomes a RankFailureError; any other failure (a bad argument, a tensor on the wrong device, a
    backend error) a CollectiveError naming the op with the original error's own reason. Either way the
    original exception is chained (__cause__) and quoted."""
    try:
        yield
    except CollectiveError:
        raise
    except Exception as e:
        r, P = dist.get_rank(), dist.get_world_size()
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        if _peer_lost(e):
            raise RankFailureError(f"rank {r} of {P}: {op} failed: a peer rank died or did not answer within the "
                                   f"process-group timeout ({why})") from e
        raise CollectiveError(f"rank {r} of {P}: {op} failed: {why}") from e


def _all_gather(t: Tensor, op: str) -> Tensor:
    """(P, *t.shape): every rank's t."""
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    with _comm(op):
        dist.all_gather(out, t)
    return torch.stack(out)


def _gather_totals(A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    """Every rank's affine total (A_q, B_q) in ONE all_gather (A and B flattened into one buffer of their promoted
    dtype, a lossless cast): one collective per iteration, the count the module docstring and
    snlp.dist.costmodel charge; two calls would pay the link latency twice, which dominates small decode messages."""
    dt = torch.promote_types(A.dtype, B.dtype)
    na = A.numel()
    both = _all_gather(torch.cat([A.reshape(-1).to(dt), B.reshape(-1).to(dt)]),
                       "all_gather of the per-rank affine totals")
    P = both.shape[0]
    return both[:, :na].reshape(P, *A.shape).to(A.dtype), both[:, na:].reshape(P, *B.shape).to(B.dtype)


def _broadcast(t: Tensor, src: int, op: str) -> Tensor:
    with _comm(op):
        dist.broadcast(t, src)
    return t


# ----------------------------------------------------------------------------- partition and checks
def partition(chunks: int, world: int) -> list[tuple[int, int]]:
    """Contiguous chunk blocks [c0, c1) per rank, sizes differing by at most one (the first
    chunks mod world ranks get the extra chunk). Raises a ValueError if a rank would get none."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world size must be an integer >= 1 (got {world!r})")
    if chunks < world:
        raise ValueError(f"a plan with C = {chunks} chunks cannot be spread over {world} ranks: every rank needs at "
                         f"least one chunk; use a plan with C >= {world} chunks or at most {chunks} ranks")
    base, extra = divmod(chunks, world)
    bounds, c0 = [], 0
    for r in range(world):
        c1 = c0 + base + (r < extra)
        bounds.append((c0, c1))
        c0 = c1
    return bounds


def check_distributable(plan: Plan | None = None, config=None) -> None:
    """Refuse what DistributedSNLP cannot run: a plan whose surrogate is not available distributed, or a model
    config with nanochat's smear / backout. The CLI calls it before any rank starts (a bench over several plans would
    otherwise time the first ones and then fail on a later one)."""
    if plan is not None and not plan.surrogate.distributed:  # the surrogate says (snlp.method.surrogates)
        valid = ", ".join(c.token for c in SURROGATES if c.distributed)
        raise ValueError(f"plan {plan}: the {plan.surrogate.token} surrogate is not available distributed (valid: "
                         f"{valid}); exact Newton is a sequential reference solver")
    if config is not None and (config.smear or config.backout):
        raise ValueError("distributed SNLP does not carry nanochat's smear / backout (the smear's token history "
                         "and the backout's halfway state would have to cross ranks): run this model on one device")


def model_digest(model: GPT) -> bytes:
    """SHA-256 of the model config and every state-dict tensor's bytes (the start-up consistency check)."""
    h = hashlib.sha256(repr(sorted(model.config.to_dict().items())).encode())
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def check_consistent(model: GPT, plan: Plan, digest: bytes | None = None) -> None:
    """All ranks must run the same plan on the same weights: all_gather of SHA-256 digests, then a
    ValueError on EVERY rank (so none is left waiting) naming the ranks that differ. `digest` replaces
    `model_digest(model)` where a rank holds only part of the model (snlp.dist.load)."""
    mine = hashlib.sha256(str(plan).encode()).digest() + (model_digest(model) if digest is None else digest)
    dev = model.wte.weight.device  # the collective runs on the rank's device (NCCL takes CUDA tensors only)
    allv = _all_gather(torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(dev), "start-up consistency check")
    problems = []
    for what, sl in (("plan", slice(0, 32)), ("model weights/config", slice(32, 64))):
        ref = allv[0, sl].cpu()
        bad = [r for r in range(allv.shape[0]) if not torch.equal(allv[r, sl].cpu(), ref)]
        if bad:
            problems.append(f"ranks {bad} have a different {what} than rank 0")
    if problems:
        raise ValueError(f"distributed SNLP start-up check failed: {'; '.join(problems)} (plan on this rank: {plan}); "
                         f"every rank must load the same checkpoint and parse the same --plan")


class WindowKVCache(KVCache):
    """A KV cache holding only layers first..first+k.shape[0]-1 (this rank's); `write` takes the
    absolute layer indices the model and the fused chunks use, so the rest of the code is unchanged."""

    def __init__(self, k: Tensor, v: Tensor, first: int, length: int = 0):
        super().__init__(k=k, v=v, length=length)
        self.first = first

    def write(self, layers, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        f = self.first
        if isinstance(layers, slice):
            layers = slice(layers.start - f, layers.stop - f)
        elif isinstance(layers, Tensor):
            layers = layers - f
        else:
            layers = int(layers) - f
        return super().write(layers, k, v, start)


# ----------------------------------------------------------------------------- the per-rank solver
@dataclass
class DistSolveResult:
    """One rank's view of a distributed solve."""

    states: Tensor  # (c1 - c0, B, T, ..., D) this rank's chunk outputs h_c after the last iteration
    chunks: tuple[int, int]  # [c0, c1) owned by this rank
    hidden: Tensor | None = None  # (B, T, ..., D) final state h_L: last rank only
    logits: Tensor | None = None  # (B, T, V): last rank only, when asked for
    iters: int = 0
    updates: list[float] = field(default_factory=list)
    row_iters: Tensor | None = None  # (B,) iterations each row ran before `tol` froze it (as solver.SolveResult)


def _compose(a: Tensor, matrix: bool) -> Tensor:
    """a_{n-1} o ... o a_0 over the leading dim, log-depth (pairwise products, order kept)."""
    if not matrix:
        return a.prod(0)
    while a.shape[0] > 1:
        odd = a[-1:] if a.shape[0] % 2 else a[:0]
        even = a[: a.shape[0] - odd.shape[0]]
        a = torch.cat([even[1::2] @ even[0::2], odd])  # later @ earlier
    return a[0]


def _preheat_for(model: GPT, plan: Plan, preheat: Preheat | None) -> Preheat | None:
    """The calibration a `preheat`-init plan starts from, checked and on the model's device and dtype. A preheat
    plan without one, or a calibration given to a plan with another init (it would be silently unused), is a
    ValueError. Its weights fingerprint is checked here when the rank holds the whole model; a rank that holds
    only its own layers checks the digests of the tensors it read instead (DistributedSNLP.__init__)."""
    check_preheat(plan, preheat, model, verify_weights=False)
    if preheat is None:
        return None
    return preheat.check(model, verify_weights=not any(p.is_meta for p in model.parameters()))


class DistributedSNLP:
    """Rank-local part of a distributed SNLP model (see the module docstring). Construct it on every
    rank with the same model and plan, inside an initialised process group. It takes ownership of
    `model`: unowned suffix layers (and, off rank 0, the prefix; off the last rank, the LM head) are
    dropped to free their memory. `keep_layers` keeps the original layers of this rank's range for
    the layer-pipelined sequential forward (speculative verifier, pipeline baseline). `preheat` is the
    calibration (snlp.method.preheat.Preheat) a plan with the preheat init needs (required by such plans,
    refused by others); every rank predicts its own chunks' initial states (and the state its first chunk
    reads) from x0, so the preheat init costs no communication. `checkpoint` (a snlp.dist.load.RankCheckpoint)
    fills a `meta`-device `model` (RankCheckpoint.meta_model) with this rank's tensors only: the embedding,
    the per-layer scalars, the layers it computes (rank 0: and the prefix), their value-embedding rows and,
    on the last rank, the head; the start-up check then compares the checkpoint's digest."""

    def __init__(self, model: GPT, plan: Plan | str, keep_layers: bool = False, check: bool = True,
                 preheat=None, checkpoint=None):
        if not dist.is_initialized():
            raise ValueError("DistributedSNLP needs an initialised process group (snlp.dist.layer_parallel.init_distributed)")
        plan = as_plan(model, plan)
        check_distributable(plan, model.config)
        w = model.wte.weight  # a diag:fd eps below the dtype's FD step floor, refused as solve and bind refuse it
        check_fd_step(plan, w.dtype, w.device.type)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.last = self.world - 1
        self.plan, self.model, self.keep_layers = plan, model, keep_layers
        L = model.config.n_layer
        self.S, M = plan.prefix_len(L), plan.fuse
        self.c0, self.c1 = partition(plan.chunks, self.world)[self.rank]
        self._checkpoint = checkpoint
        if checkpoint is not None:  # only this rank's layers (the ones it computes, rank 0: the prefix too)
            first = 0 if self.rank == 0 else self.S + self.c0 * M
            # a tensor missing or mis-shaped in the file fails on the rank that reads it: every rank raises its error
            # (a rank failing alone would leave the others in the start-up check until the timeout, told only that a
            # peer died)
            self._agree(lambda: checkpoint.materialise(model, range(first, self.S + self.c1 * M),
                                                       head=self.rank == self.last))
        elif check and any(t.is_meta for t in model.parameters()):  # (check=False: a meta rank, shapes only)
            raise ValueError("DistributedSNLP got a model with meta-device weights: pass the checkpoint that fills "
                             "them (checkpoint=snlp.dist.load.RankCheckpoint(path, device))")
        if check:  # (collective: every rank agrees before any rank can fail alone below)
            check_consistent(model, plan, None if checkpoint is None else checkpoint.digest())
        self.preheat = _preheat_for(model, plan, preheat)  # after materialising: it goes to the embedding's device
        if self.preheat is not None and checkpoint is not None:  # the tensors each rank read are the calibrated ones
            self._agree(lambda: self.preheat.check_tensors(checkpoint.digests))
        with torch.no_grad():  # this rank's block only (== select_chunks of the full stack)
            self.w: ChunkWeights = build_chunk_weights(model, self.S + self.c0 * M, self.c1 - self.c0, M)
            if plan.causal:  # the paper's approximation: this rank's branches attend fully (Plan.causal)
                self.w = full_causal(self.w)
        # KV window and layer range this rank computes: rank 0 also owns the prefix layers
        self.first = 0 if self.rank == 0 else self.S + self.c0 * M
        self.stop = self.S + self.c1 * M
        keep = set(range(self.first, self.stop)) if keep_layers else set()
        if self.rank == 0:
            keep |= set(range(self.S))
        for l in range(L):
            if l not in keep:
                model.blocks[l] = torch.nn.Module()  # free the weights this rank never reads
        self._keep_value_embeds(set(range(self.first, self.stop)) | (set(range(self.S)) if self.rank == 0 else set()))
        if self.rank != self.last:
            model.lm_head = None
        self.device = model.wte.weight.device

    def _agree(self, check) -> None:
        """Run a local check on every rank and raise its ValueError on ALL ranks if it failed on any (a rank that
        failed alone would leave the others waiting in the next collective until the timeout)."""
        try:
            check()
            mine = None
        except ValueError as e:
            mine = str(e)
        failed = [(r, m) for r, m in enumerate(gather_objects(mine)) if m]
        if failed:
            r, m = failed[0]
            raise ValueError(f"rank {r}: {m}")

    def _keep_value_embeds(self, layers: set[int]) -> None:
        """Keep only the value-embedding tables of `layers` (each is vocab x kv_dim, as big as the token
        embedding) and renumber the model's and the fused chunks' slots to the kept tables."""
        model = self.model
        if not hasattr(model, "value_embeds"):
            return
        n_ve = model.value_embeds.shape[0]
        keep = sorted({model.ve_slot[l] for l in layers if model.ve_slot[l] >= 0})
        lut = torch.full((n_ve + 1,), len(keep), dtype=torch.long)  # the zero pad slot maps to the new pad
        lut[torch.tensor(keep, dtype=torch.long)] = torch.arange(len(keep))
        if model.value_embeds.is_meta and self._checkpoint is not None:  # a rank-local load (snlp.dist.load):
            table = self._checkpoint.rows("value_embeds", keep, model.value_embeds)  # read only the kept tables
        else:
            table = model.value_embeds.data[keep].clone()
        model.value_embeds = torch.nn.Parameter(table, requires_grad=False)
        model.ve_slot = [int(lut[s]) if s >= 0 and l in layers else -1 for l, s in enumerate(model.ve_slot)]
        if self.w.ve_slot is not None:
            self.w.ve_slot = lut.to(self.w.ve_slot.device)[self.w.ve_slot]

    # ----- memory -----
    def memory(self, cache: KVCache | None = None, max_len: int | None = None) -> dict:
        """Bytes this rank holds: fused chunk weights, the model parameters it kept, and its KV window: `cache`'s, or
        the window `new_cache(max_len)` allocates (a decode of a prompt of n tokens and N new ones holds n + N
        positions); kv_bytes is 0 with neither (a prefill without a cache)."""
        def nbytes(obj) -> int:
            if isinstance(obj, Tensor):
                return obj.numel() * obj.element_size()
            if hasattr(obj, "__dataclass_fields__"):
                return sum(nbytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
            if isinstance(obj, tuple):
                return sum(nbytes(x) for x in obj)
            return 0
        fused = nbytes(self.w)
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if cache is None and max_len is not None:  # the window's two tensors, K and V, without allocating them
            cfg, p = self.model.config, self.model.wte.weight
            kv = 2 * (self.stop - self.first) * cfg.n_kv_head * max_len * cfg.head_dim * p.element_size()
        else:
            kv = 0 if cache is None else nbytes(cache.k) + nbytes(cache.v)
        return {"fused_weight_bytes": fused, "param_bytes": params, "kv_bytes": kv, "total_bytes": fused + params + kv}

    def new_cache(self, max_len: int, batch: int = 1) -> WindowKVCache:
        """An empty KV cache for this rank's layers only (rank 0: prefix + its chunks)."""
        cfg = self.model.config
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"KV cache max_len must be an integer >= 1 (got {max_len!r})")
        p = self.model.wte.weight
        shape = (self.stop - self.first, batch, cfg.n_kv_head, max_len, cfg.head_dim)
        check_cache_fits(shape, p.dtype, p.device)  # as KVCache.for_model: one line, not an allocator's traceback
        return WindowKVCache(torch.zeros(shape, dtype=p.dtype, device=p.device),
                             torch.zeros(shape, dtype=p.dtype, device=p.device), self.first)

    # ----- communication helpers -----
    def _shift_boundary(self, last_state: Tensor, hS: Tensor) -> Tensor:
        """Send this rank's last chunk state to rank r+1 and receive rank r-1's (rank 0: h_S)."""
        with _comm("boundary-state exchange"):
            req = dist.isend(last_state.contiguous(), self.rank + 1) if self.rank < self.last else None
            if self.rank > 0:
                got = torch.empty_like(hS)
                dist.recv(got, self.rank - 1)
            else:
                got = hS
            if req is not None:
                req.wait()
        return got

    def _scan(self, a: Tensor, b: Tensor, matrix: bool) -> Tensor:
        """d for this rank's chunks: d_c = a_c o d_{c-1} + b_c across ALL ranks' chunks (module docstring, 2-3)."""
        d_loc = affine_scan(a, b, matrix)  # (n, ...) as if d_{c0-1} = 0
        A, Bt = _gather_totals(_compose(a, matrix), d_loc[-1])  # (P, ...), (P, B, T, ..., D)
        if self.rank == 0:
            return d_loc
        d_in = affine_scan(A[: self.rank], Bt[: self.rank], matrix)[-1]  # exclusive scan over ranks: d_{c0-1}
        one = a[:1]  # never used by affine_scan (entry 0's factor)
        return affine_scan(torch.cat([one, a]), torch.cat([d_in[None], b]), matrix)[1:]

    # ----- the solve -----
    @torch.no_grad()
    def solve(self, idx: Tensor, cache: KVCache | None = None, logits: bool = True,
              check_finite: bool = True) -> DistSolveResult:
        """Distributed `solver.solve` of token ids idx (B, T) (the same ids on every rank). With a KV
        `cache` (from `new_cache`) an SNLP decode step on this rank's window. The last rank returns the
        final state and (with `logits`) the logits; with `check_finite` every rank raises
        SNLPDivergenceError if the final state is not finite."""
        plan, w = self.plan, self.w
        sur = plan.surrogate
        ctx = self.model.embed(idx.to(self.device), cache)
        hS = self._prefix_state(ctx)
        h, boundary = self._init_states(ctx, hS, cache)  # (n, B, T, ..., D), the state chunk c0 reads
        gen = torch.Generator(hS.device).manual_seed(0) if sur.random else None  # as solver.solve
        factors = self._factors(hS)
        lagged = any(plan.lag_factors()[self.c0:self.c1])  # from the plan, not the tensor: no device sync
        iters, updates, d, last_boundary = 0, [], None, None
        done = None  # tol: (B,) rows frozen by the per-row stop test, on every rank (as solver.solve)
        last_inputs = None  # tol: the chunk inputs of the last iteration (what frozen rows keep reading)
        row_iters = torch.zeros(hS.shape[0], dtype=torch.long, device=hS.device) if plan.tol else None
        for k in range(plan.iters):
            inputs = torch.cat([boundary[None], h[:-1]], 0)  # (n, B, T, ..., D)
            if done is not None:  # a frozen row re-reads its last inputs (its cached K/V stay those of that iteration)
                inputs = freeze_rows(done, last_inputs, inputs)
            h_old = h
            tilde, mix = chunk_forward(w, inputs, ctx, cache, mix=True) if sur.needs_mix else (chunk_forward(w, inputs, ctx, cache), None)
            prev = None  # non-forward order: the previous sweep's updates; for the first local chunk the
            if d is not None and lagged:  # predecessor's is the change of the received boundary state
                prev = torch.cat([(boundary - last_boundary)[None], d[:-1]], 0)
            d, h = self._correct(inputs, tilde, mix, h, prev, factors, ctx, cache, gen)
            if done is not None:  # frozen rows keep their states exactly and report a zero update
                d, h = d.masked_fill(row_mask(done, d), 0), freeze_rows(done, h_old, h)
            last_boundary = boundary
            iters += 1
            stop = k == plan.iters - 1
            if plan.tol:  # the last rank owns the final state: it decides per row, everyone follows
                row_iters += 1 if done is None else ~done
                met, top = self._rows_met(d, h)
                updates.append(top)
                stop = stop or top < plan.tol
                done, last_inputs = (met if done is None else done | met), inputs
            if stop:
                break
            boundary = self._shift_boundary(h[-1], hS)
        if cache is not None:
            if plan.iters == 0 and plan.init != "fwd":  # as solver.solve: write the K/V of the final inputs
                chunk_forward(w, torch.cat([boundary[None], h[:-1]], 0), ctx, cache)
            cache.advance(idx.shape[1])
        if row_iters is None:  # fixed K: every row ran every iteration
            row_iters = torch.full((hS.shape[0],), iters, dtype=torch.long, device=hS.device)
        res = DistSolveResult(states=h, chunks=(self.c0, self.c1), iters=iters, updates=updates, row_iters=row_iters)
        return self._finish(res, h, logits, check_finite)

    def _prefix_state(self, ctx) -> Tensor:
        """h_S on every rank: rank 0 runs the prefix layers and broadcasts (with no prefix h_S = x0 everywhere)."""
        if self.S == 0:
            return ctx.x0.contiguous()
        if self.rank == 0:
            hS = self.model.run_layers(ctx.x0, ctx, 0, self.S).contiguous()
        else:
            hS = torch.empty(ctx.x0.shape, dtype=ctx.x0.dtype, device=ctx.x0.device)
        return _broadcast(hS, 0, "broadcast of the prefix state h_S")

    def _init_states(self, ctx, hS: Tensor, cache) -> tuple[Tensor, Tensor]:
        """This rank's chunk states at the init (n, B, T, ..., D) and the state its first chunk reads."""
        plan, n = self.plan, self.c1 - self.c0
        h = hS.expand(n, *hS.shape)  # h0 init
        if plan.init == "preheat":  # as solver.solve: chunk c starts at the predictor of its last layer; the
            # state chunk c0 reads is the prediction for chunk c0 - 1 (rank 0: h_S), computed here from x0
            M, lo = plan.fuse, max(self.c0 - 1, 0)
            pred = self.preheat.predict(ctx.x0, [self.S + (c + 1) * M - 1 for c in range(lo, self.c1)])
            return pred[self.c0 - lo:], (pred[0] if self.c0 > 0 else hS)
        if plan.init == "fwd":
            h = chunk_forward(self.w, h, ctx, cache)
            return h, self._shift_boundary(h[-1], hS)
        return h, hS

    def _factors(self, hS: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's link and lag (ELK / order) factors of the correction, (n, 1, ..., 1) each: built once per
        solve, not per iteration (each is a host-to-device copy)."""
        shape = (self.c1 - self.c0, *[1] * hS.dim())
        return tuple(torch.tensor(f[self.c0:self.c1], dtype=hS.dtype, device=hS.device).view(shape)
                     for f in (self.plan.link_factors(), self.plan.lag_factors()))

    def _correct(self, inputs: Tensor, tilde: Tensor, mix, h: Tensor, prev: Tensor | None,
                 factors: tuple[Tensor, Tensor], ctx, cache, gen) -> tuple[Tensor, Tensor]:
        """(d, h + d) of one iteration on this rank's chunks: the surrogate's own correction over this run of
        chunks (`Surrogate.scan_step`: its local A, e.g. a Hutchinson diagonal of the rank's rows of the one
        probe draw) with the scan across all ranks' chunks (`_scan`). Nothing here knows the surrogate's kind."""
        it = Iterate(self.plan, self.w, ctx, inputs, tilde, h, mix, gen, chunk0=self.c0, cache_first=self.first)
        return self.plan.surrogate.scan_step(it, self._scan, *factors, prev)

    def _rows_met(self, d: Tensor, h: Tensor) -> tuple[Tensor, float]:
        """The tol test per row, decided by the last rank (it owns the final state) and broadcast: (B,) rows
        whose relative update is below tol, and the largest update (0 for frozen rows)."""
        B = h.shape[1]
        rel = (row_updates(d[-1], h[-1]) if self.rank == self.last  # (B,) float64 on the rank's device
               else torch.zeros(B, dtype=torch.float64, device=self.device))
        rel = _broadcast(rel, self.last, "broadcast of the tol updates")
        return (rel < self.plan.tol).to(h.device), float(rel.max())

    def _finish(self, res: DistSolveResult, h: Tensor, logits: bool, check_finite: bool) -> DistSolveResult:
        if self.rank == self.last:
            res.hidden = h[-1]
            if logits:
                res.logits = self.model.head(res.hidden)
        if check_finite:
            ok = torch.tensor([1 if self.rank != self.last or bool(torch.isfinite(h[-1]).all()) else 0],
                              device=self.device)
            if not int(_broadcast(ok, self.last, "broadcast of the finiteness check")[0]):
                raise SNLPDivergenceError(f"distributed SNLP plan {self.plan} diverged: the final hidden state "
                                          f"contains NaN/inf; {self.plan.divergence_hints()}")
        return res

    @torch.no_grad()
    def pipeline_forward(self, idx: Tensor, cache: KVCache | None = None, keep: int | None = None) -> Tensor | None:
        """The ORIGINAL model run layer-pipelined over the ranks (rank r: its layer range, then h to
        rank r+1): logits (B, T, V) on the last rank, None elsewhere. Needs keep_layers=True. `keep`: the last
        `keep` positions' logits only (GPT.forward's; 0 for a prefill that only fills the cache)."""
        if not self.keep_layers:
            raise ValueError("pipeline_forward needs the original layers: construct DistributedSNLP(..., keep_layers=True)")
        model = self.model
        check_keep(keep, idx)
        ctx = model.embed(idx.to(self.device), cache)
        if self.rank == 0:
            h = ctx.x0
        else:
            h = torch.empty(ctx.x0.shape, dtype=ctx.x0.dtype, device=ctx.x0.device)
            with _comm("pipeline receive"):
                dist.recv(h, self.rank - 1)
        h = model.run_layers(h, ctx, self.first, self.stop)
        if self.rank < self.last:
            with _comm("pipeline send"):
                dist.send(h.contiguous(), self.rank + 1)
        if cache is not None:
            cache.advance(idx.shape[1])
        return model.head(h, keep) if self.rank == self.last else None

    # ----- decoding -----
    def _tokens_from_last(self, tokens: list[int] | None, count: int) -> list[int]:
        t = torch.tensor(tokens if self.rank == self.last else [0] * count, dtype=torch.long, device=self.device)
        return _broadcast(t, self.last, "broadcast of the chosen tokens").tolist()

    def generate(self, prompt_ids, mode: str = "snlp", max_new_tokens: int = 64, block: int = 4,
                 temperature: float = 0.0, eos_id: int | list[int] | None = None, seed: int | None = None,
                 max_len: int | None = None, on_tokens=None, top_k: int = 0, top_p: float = 1.0,
                 repetition_penalty: float = 1.0) -> GenerateResult:
        """KV-cached decoding on every rank (call it on all ranks with the same arguments); returns a
        `GenerateResult` with the same tokens on every rank. Modes: `snlp` (every forward a distributed SNLP
        solve), `sequential` (the original model layer-pipelined: the pipeline baseline), `speculative`
        (distributed SNLP drafts `block` tokens, the pipelined original model verifies B+1 positions in one
        forward; greedy output equals sequential decoding). The bookkeeping (prompt, budget, EOS, streaming,
        timing) is snlp.decode's DecodeSession, the same as single-process decoding; what differs is that only
        the last rank has logits: it picks, and every rank follows the broadcast tokens. `top_k` / `top_p`: the
        sampled distribution filtered as in snlp.decode's `sequential_generate` (snlp.decode.session.Sampling).
        `on_tokens` (a rank's own, or None) runs on its rank with the same tokens as every other rank's; a True from
        any rank's ends the decode on every rank after the same tokens (check_stream's stop "on_tokens"): the ranks
        learn whether any holds a callback once per call, and where one does they reduce the stop votes after every
        emitted batch of tokens (one small all_reduce, inside the decode time). `repetition_penalty`: as in `sequential_generate`
        (snlp.decode.penalty), applied where the tokens are picked: the last rank holds the seen ids (its session's
        penalty state) and penalises its logits before every pick, a speculative round's drafter and verifier as the
        single-process round does; the other ranks learn the tokens from the broadcast, as without a penalty."""
        if mode not in ("snlp", "sequential", "speculative"):
            raise ValueError(f"unknown distributed decoding mode {mode!r}: valid modes are snlp, sequential, speculative")
        if isinstance(prompt_ids, (list, tuple)) and is_batch(prompt_ids):
            # the single-process decoders take a batch as a list of prompts; every rank refuses one alike, before any
            # collective (DecodeSession said "token ids must be integers", naming the first prompt as a bad id). A list
            # of 0-d tensors is one prompt of ids there (is_batch) and here
            raise ValueError(f"distributed decoding takes one prompt (a list of token ids), got a list of "
                             f"{len(prompt_ids)} prompts: decode them one at a time (batched decoding of a list of "
                             f"prompts is single-process: snlp_generate, speculative_generate)")
        check_decode_args(max_new_tokens, temperature, block if mode == "speculative" else None)
        how = sampling(temperature, top_k, top_p, seed)
        penalty = check_repetition_penalty(repetition_penalty)
        ses = DecodeSession(self.model, prompt_ids, max_new_tokens, eos_id, max_len, self._voted(on_tokens), mode,
                            make_cache=self.new_cache, penalty=penalty if self.rank == self.last else 1.0)
        ses.result.plan = None if mode == "sequential" else str(self.plan)
        ses.result.block = block if mode == "speculative" else 0
        # sampling reads probabilities on the rank's device, so the generator lives there (a CPU generator
        # cannot drive CUDA sampling); only the last rank draws, and the tokens are broadcast
        gen = None if how.greedy else make_generator(seed, self.device)  # seed None: fresh, global RNG untouched
        snlp = lambda x: self.solve(ses.ids(x), ses.cache, check_finite=False).logits  # noqa: E731
        seq = lambda x: self.pipeline_forward(ses.ids(x), ses.cache)  # noqa: E731
        t0 = now(self.device)
        if len(ses.prompt) > 1:  # cache the prompt but its last token (the verifier's forward in SSD); no logits:
            # the last token starts the loop, and the head over every prompt position would be thrown away
            if mode == "snlp":
                self.solve(ses.ids(ses.prompt[:-1]), ses.cache, logits=False, check_finite=False)
            else:
                self.pipeline_forward(ses.ids(ses.prompt[:-1]), ses.cache, keep=0)
        ses.result.prefill_s = now(self.device) - t0
        ses.t0 = now(self.device)
        while not ses.done:
            if mode == "speculative":
                self._speculative_round(ses, snlp, seq, block, how, gen)
            else:
                t1 = time.perf_counter()
                logits = (snlp if mode == "snlp" else seq)([ses.last])
                ses.result.forwards += 1
                # the last rank's pick, penalised and marked seen there (DecodeSession.pick_tensor)
                pick = ses.pick_tensor(logits[:, -1], how, None if gen is None else [gen], flag=True).tolist() \
                    if self.rank == self.last else None
                toks = self._tokens_from_last(pick, 1)
                # NaN/inf logits (NONFINITE, broadcast like a token): every rank raises, none waits; plan None: the
                # model's own forward
                check_picked(toks, self.plan if mode == "snlp" else None, len(ses.out))
                # the single-process decoders' step counters: forward and pick (the broadcast read waited for both)
                ses.result.steps += 1
                ses.result.step_s += time.perf_counter() - t1
                ses.emit(toks)
        return ses.finish()

    def _voted(self, on_tokens):
        """`on_tokens` as DecodeSession calls it, with the stop decided by all ranks: None where no rank holds a
        callback (no collective per token); else a callback returning True on every rank iff some rank's returned
        True (DecodeSession calls it on every rank after the same emitted tokens). A malformed callback on any rank
        is refused on all of them (check_stream's TypeError), before any rank decodes."""
        try:
            check_stream(on_tokens)
            bad = None
        except TypeError as e:
            bad = str(e)
        # one tensor all_reduce, not an object gather: that pickles through a device byte tensor (a host round trip
        # per call on NCCL, and none at all on a tensor subclass such as a fake or traced device)
        flags = torch.tensor([int(on_tokens is not None), int(bad is not None)], device=self.device)  # (2,)
        with _comm("all_reduce of the on_tokens checks"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if bad is not None:
            raise TypeError(f"rank {self.rank}: {bad}")
        has, other_bad = flags.tolist()
        if other_bad:
            raise TypeError("another rank's on_tokens was refused (not a callable of one argument): every rank stops")
        if not has:
            return None

        def voted(new: list[int]) -> bool:
            stop = torch.tensor([int(on_tokens is not None and on_tokens(new) is True)], device=self.device)
            with _comm("all_reduce of the on_tokens stop votes"):
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            return bool(stop[0])
        return voted

    def _speculative_round(self, ses: DecodeSession, snlp, seq, block: int, how: Sampling, gen) -> None:
        """One self-speculative round: B distributed SNLP drafter steps, one pipelined verification of the B+1
        positions, the last rank's verdict (greedy prefix match or rejection sampling) broadcast to all."""
        cache, res, pen = ses.cache, ses.result, ses.penalty  # pen: the last rank's, None elsewhere and at 1
        P, Bk = cache.length, min(block, ses.remaining - 1)  # no drafts past the budget
        t1 = now(self.device)
        drafts, qs, x = [], [], ses.last
        dpen = None if pen is None else pen.fork()  # the drafter's: the round's drafts marked as they come
        for _ in range(Bk):
            logits = snlp([x])
            tok = None
            if self.rank == self.last:  # the single-process round's pick (NaN/inf: a uniform stand-in q)
                x_t, q, _ = penalised_draft_pick(dpen, logits[:, -1], how, [gen], [True])  # (1, 1), (1, V) or None
                if q is not None:
                    qs.append(q)
                tok = x_t[0].tolist()
            x = self._tokens_from_last(tok, 1)[0]
            drafts.append(x)
        t2 = now(self.device)
        cache.rollback(P)  # the verifier rewrites positions P..P+Bk with exact K/V
        logits = seq([ses.last] + drafts)
        verdict = None
        if self.rank == self.last:  # the single-process round's verdict: NaN/inf positions read as NONFINITE
            ids = torch.tensor([[ses.last] + drafts], device=logits.device)  # (1, Bk + 1)
            judged = logits[:, :Bk + 1] if pen is None else pen.at_positions(logits[:, :Bk + 1], ids[:, 1:])
            n_t, nxt_t = speculative_verdict(ids, judged, [Bk], None, qs, how, None if how.greedy else [gen])
            verdict = torch.cat([n_t, nxt_t]).tolist()
            if pen is not None:  # the state learns the kept drafts and the next token
                pen.accept(ids[:, 1:], n_t, nxt_t)
        nacc, nxt = self._tokens_from_last(verdict, 2)
        check_picked([nxt], None, len(ses.out) + nacc)  # the verifier's NaN/inf logits: every rank raises
        cache.rollback(P + nacc + 1)
        res.add_round(drafts, nacc, ses.stops, steps=Bk, forwards=Bk + 1, draft_s=t2 - t1,
                      verify_s=now(self.device) - t2)
        ses.emit(drafts[:nacc] + [nxt])


# ----------------------------------------------------------------------------- benchmark
def gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order."""
    out = [None] * dist.get_world_size()
    with _comm("all_gather_object"):
        dist.all_gather_object(out, obj)
    return out

def _timed(fn, warmup: int, runs: int) -> list[float]:
    """ms per call, every call between two barriers (the slowest rank sets the time)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(runs):
        with _comm("barrier"):
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        with _comm("barrier"):
            dist.barrier()
        ts.append(1e3 * (time.perf_counter() - t0))
    return ts

def distributed_benchmark(model_fn, plans: list[Plan], tokens: int, batch: int, warmup: int, runs: int, seed: int,
                          decode: bool = False, prompt_len: int = 16, new_tokens: int = 32,
                          blocks: tuple[int, ...] = (4,), checkpoint=None,
                          repetition_penalty: float = 1.0) -> list[dict]:
    """On every rank: per plan, the distributed SNLP prefill (T tokens) vs the layer-pipelined sequential
    forward, and with `decode` the per-token latency of pipelined sequential, distributed SNLP and
    speculative decoding. `model_fn()` builds the (same) model on every rank; with `checkpoint` (a
    snlp.dist.load.RankCheckpoint) it builds it on meta and the rank reads only its own layers. Every decode of
    every mode applies `repetition_penalty` (1: none; the decode records carry it). Medians in ms."""
    import statistics

    recs = []
    gen = torch.Generator().manual_seed(seed)
    for plan in plans:
        pre = checkpoint.preheat() if checkpoint is not None and plan.init == "preheat" else None
        runner = DistributedSNLP(model_fn(), plan, keep_layers=True, checkpoint=checkpoint, preheat=pre)
        V = runner.model.config.vocab_size
        idx = torch.randint(0, V, (batch, tokens), generator=gen).to(runner.device)  # same CPU draw on every rank
        mem = gather_objects(runner.memory())
        base = dict(plan=str(plan), world_size=dist.get_world_size(), tokens=tokens, batch=batch, runs=runs,
                    chunks_per_rank=[list(b) for b in partition(plan.chunks, dist.get_world_size())],
                    max_rank_bytes=max(m["total_bytes"] for m in mem), memory_per_rank=mem)
        with torch.inference_mode():
            pipe = _timed(lambda: runner.pipeline_forward(idx), warmup, runs)
            par = _timed(lambda: runner.solve(idx, check_finite=False), warmup, runs)
            # prefix placement: what replicating the prefix would save (the h_S broadcast) vs what it costs; a plan
            # without a prefix broadcasts nothing (h_S = x0 on every rank): both 0
            hS = runner.model.embed(idx).x0.contiguous()
            bcast = _timed(lambda: _broadcast(hS, 0, "broadcast of the prefix state h_S"), warmup, runs) \
                if runner.S > 0 else [0.0]
            prefix = []
            if runner.rank == 0 and runner.S > 0:
                ctx = runner.model.embed(idx)
                for _ in range(runs):
                    t0 = time.perf_counter()
                    runner.model.run_layers(ctx.x0, ctx, 0, runner.S)
                    prefix.append(1e3 * (time.perf_counter() - t0))
        recs.append({**base, "what": "prefill", "pipeline_sequential_ms": statistics.median(pipe),
                     "snlp_ms": statistics.median(par), "speedup": statistics.median(pipe) / statistics.median(par),
                     "h_S_broadcast_ms": statistics.median(bcast),
                     "prefix_ms_rank0": statistics.median(prefix) if prefix else 0.0,
                     # each side timed in its own loop (not paired): the per-call times for a spreads rule
                     "pipeline_sequential_times_ms": pipe, "snlp_times_ms": par})
        if decode:
            prompt = torch.randint(0, V, (prompt_len,), generator=gen).tolist()
            # a decode holds its KV window (prompt + new tokens) beside the weights: the decode rows count it
            dmem = gather_objects(runner.memory(max_len=prompt_len + new_tokens))
            # and decodes one prompt: batch 1 whatever the prefill's batch
            dbase = dict(base, batch=1, max_rank_bytes=max(m["total_bytes"] for m in dmem), memory_per_rank=dmem)
            # a block named twice is one row, as in the single-process decode benchmark (its runs keyed by block):
            # listed twice it ran twice a round into one row's runs, which then paired with the wrong sequential runs
            modes = [("sequential", 0), ("snlp", 0)] + [("speculative", b) for b in dict.fromkeys(blocks)]
            res: dict = {m: [] for m in modes}
            for i in range(warmup + runs):
                for mode, b in round_order(modes, i):  # rotated, so no mode always runs first
                    r = runner.generate(prompt, mode, new_tokens, block=max(b, 1),
                                        repetition_penalty=repetition_penalty)
                    if i >= warmup:
                        res[(mode, b)].append(r)
            seq_ms = statistics.median(1e3 * r.decode_s / len(r.tokens) for r in res[("sequential", 0)])
            ref = res[("sequential", 0)][0].tokens
            seq_agree = all(r.tokens == ref for r in res[("sequential", 0)])  # a differing sequential run: no row matches
            for (mode, b), rs in res.items():
                ms = statistics.median(1e3 * r.decode_s / len(r.tokens) for r in rs)
                rec = {**dbase, "what": "decode", "mode": mode, "block": b or None, "ms_per_token": ms,
                       # every timed run, as the median's: a run whose tokens differ is a row that does not match
                       "speedup_vs_pipeline": seq_ms / ms,
                       "matches_sequential": seq_agree and all(r.tokens == ref for r in rs),
                       "prompt_len": prompt_len, "new_tokens": new_tokens, "repetition_penalty": repetition_penalty,
                       # run i of every mode ran in round i (paired with the sequential row's run i)
                       "ms_per_token_runs": [1e3 * r.decode_s / len(r.tokens) for r in rs],
                       "sequential_ms_per_token_runs": [1e3 * r.decode_s / len(r.tokens)
                                                        for r in res[("sequential", 0)]]}
                if mode == "speculative":
                    # alpha and tokens/round over the same timed runs as the medians (pooled: accepted over examined
                    # drafts, tokens over rounds, of all of them), each run's alpha beside; one new token (the
                    # prefill's) drafts nothing: not measured, None
                    examined = sum(r.examined for r in rs)
                    rec.update(alpha=pooled_alpha(rs), alpha_runs=[pooled_alpha([r]) for r in rs],
                               tokens_per_round=sum(len(r.tokens) for r in rs) / sum(r.rounds for r in rs),
                               draft_ms_per_step=statistics.median(r.draft_ms_per_step for r in rs) if examined
                               else None,
                               verify_ms_per_round=statistics.median(1e3 * r.verify_s / r.rounds for r in rs))
                recs.append(rec)
    return recs

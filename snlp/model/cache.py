"""Static KV cache for decoding: preallocated per-layer K/V, a length pointer, rollback.

Layout k, v: (L, B, Hkv, max_len, hd), one slot per layer. Positions 0..length-1 are valid;
a forward over T new tokens writes their K/V at length..length+T-1 in every layer, attends over
0..length+T-1 and then advances `length` by T (GPT.forward / solver.solve with cache=). Anything
past `length` is scratch: rollback just moves the pointer back, and the next forward overwrites
those positions before reading them, so a rolled-back cache is exactly the earlier one.

Per-layer slots also serve the fused SNLP chunks: layers S..L-1 are contiguous, so the slots of
a suffix of C chunks x M layers view as (C, M, B, Hkv, max_len, hd) = a chunk-wide cache in which
fused branch m of chunk c owns layer S+c*M+m's slot. Keeping per-layer slots (rather than a
separate chunk cache) lets the SNLP drafter and the sequential verifier share one cache in
self-speculative decoding: the verifier (the ORIGINAL sequential model) overwrites every verified
position with exact per-layer K/V, so the drafter always conditions on the exact history, and
for M = 1 the drafter's branches are literally the model's layers. For M > 1 the fused branch
reads a different input (the chunk input) than layer S+c*M+m does sequentially, so what a drafter
writes there is only its estimate: fine for scratch positions the verifier rewrites, and in pure
SNLP decoding (no verifier) the slots hold the fused model's own K/V, so cached SNLP decoding
with K >= C equals the fused model run sequentially (tests/decode/test_decode.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from snlp.runtime import device as runtime_device


def check_cache_fits(shape: tuple[int, ...], dtype: torch.dtype, device, ids: bool = False) -> None:
    """Refuse K and V buffers of `shape` (layers, batch, kv heads, positions, head dim), and with `ids` the (batch,
    positions) token ids beside them, that exceed the memory `device` has free (snlp.runtime.device.
    free_memory_bytes: a GPU's free memory now, which the model's weights have already left; the CPU's physical
    memory or its cgroup's limit), in one line before they are allocated: an allocator's traceback after the model
    loaded. Every cache of a decode goes through here (KVCache.for_model, a layer-parallel rank's window cache in
    snlp.dist.layer_parallel). The batch is in `shape` (a ragged batch's rows share one cache); a self-speculative
    decode allocates no second cache, since its drafter and verifier share this one (the module docstring), and the
    caches a CUDA-graph step keeps between calls are out of the GPU's free memory already."""
    batch, max_len = shape[1], shape[3]
    need = 2 * math.prod(shape) * dtype.itemsize + (batch * max_len * 8 if ids else 0)
    have = runtime_device.free_memory_bytes(device)
    if have is not None and need > have:
        where = "free on" if torch.device(device).type == "cuda" else "of memory of"
        raise ValueError(f"a KV cache of {max_len:,} positions x batch {batch} needs {need / 2**30:,.1f} GiB, more "
                         f"than the {have / 2**30:,.1f} GiB {where} {torch.device(device)}: ask for fewer tokens "
                         f"(prompt + new tokens) or a smaller batch")


def mark_static_cuda(*tensors: Tensor) -> None:
    """Mark CUDA cache buffers as static inputs of compiled (CUDA-graph) steps, at creation, for EVERY cache: a graph
    then reads the buffer in place instead of copying the whole cache in per replay, and every cache is marked the
    same way, so a fresh cache of a seen shape matches the compiled graph (docs/usage.md, "Compiled decoding: what
    may change between calls"). Unguarded: a new buffer address re-records the CUDA graph (no recompile), which the
    decode loops do in their warm-up (snlp.decode.steps.Step.warm). A no-op on CPU (no CUDA graphs there)."""
    for t in tensors:
        if t.is_cuda:
            torch._dynamo.mark_static_address(t)


@dataclass(frozen=True)
class RowPositions:
    """The positions of one ragged batched call (snlp.decode.batch), passed as `pos=` with the ids: a step is a
    function of its arguments, the cache only data. pos (B, T): row b's tokens sit at positions pos[b]. `span`
    (eager only; None in compiled steps, whose shapes must not change): every position the call reads or writes
    is < span, so attention covers the cache's positions 0..span-1 instead of the whole slot. `real` (B, T) bool
    or None (all real): False on the padding at the end of a short row (a ragged prefill), which a `tol` plan's
    per-row stop test must not see (snlp.method.solver.row_updates), so a row freezes as it would alone."""

    pos: Tensor
    span: int | None = None
    real: Tensor | None = None


@dataclass
class KVCache:
    """Preallocated K/V of every layer. k, v: (L, B, Hkv, max_len, hd); `length` valid positions. `ids` (B, max_len)
    long: the token id at every position, for models whose layer input reads the previous token (the smear,
    GPTConfig.smear; None for the others); it follows the K/V's rules (written with them, scratch past `length`)."""

    k: Tensor
    v: Tensor
    length: int = 0
    ids: Tensor | None = None

    def __post_init__(self):
        mark_static_cuda(self.k, self.v)
        if self.ids is not None:
            mark_static_cuda(self.ids)

    @classmethod
    def for_model(cls, model, batch: int = 1, max_len: int | None = None, device=None, dtype=None) -> "KVCache":
        """An empty cache for `model` (max_len defaults to config.sequence_len)."""
        cfg = model.config
        max_len = cfg.sequence_len if max_len is None else max_len
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"KV cache batch must be an integer >= 1 (got {batch!r})")
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"KV cache max_len must be an integer >= 1 (got {max_len!r})")
        p = model.wte.weight
        shape = (cfg.n_layer, batch, cfg.n_kv_head, max_len, cfg.head_dim)
        kw = dict(device=device or p.device, dtype=dtype or p.dtype)
        check_cache_fits(shape, kw["dtype"], kw["device"], ids=cfg.smear)
        ids = torch.zeros(batch, max_len, dtype=torch.long, device=kw["device"]) if cfg.smear else None
        return cls(k=torch.zeros(shape, **kw), v=torch.zeros(shape, **kw), ids=ids)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def check(self, batch: int, T: int) -> None:
        """Raise a ValueError unless T new tokens of this batch size fit after `length`."""
        if batch != self.batch:
            raise ValueError(f"KV cache was allocated for batch {self.batch}, got a batch of {batch}")
        if self.length + T > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length} cached + {T} new tokens > max_len {self.max_len}; "
                             f"allocate a longer cache (KVCache.for_model(..., max_len=...))")

    def check_model(self, model) -> None:
        """Raise a ValueError unless this cache's K/V fit `model`: its layers (a window cache, snlp.dist, holds a run
        of them from `first`), KV heads, head dim, dtype (the weights', or autocast's while it is on) and device. A cache of another model failed deep inside the
        attention (a reshape or dtype error naming neither), or, with more layers or more KV heads than the model
        has, ran on: the extra slots unused, the writes broadcast over the extra heads."""
        cfg, w = model.config, model.wte.weight
        first = getattr(self, "first", None)
        layers = self.k.shape[0]
        problems = []
        if (layers != cfg.n_layer) if first is None else (first + layers > cfg.n_layer):
            problems.append(f"{layers} layers" + ("" if first is None else f" from layer {first}")
                            + f" (the model has {cfg.n_layer})")
        if self.k.shape[2] != cfg.n_kv_head or self.k.shape[4] != cfg.head_dim:
            problems.append(f"{self.k.shape[2]} KV heads of dim {self.k.shape[4]} (the model: {cfg.n_kv_head} of dim "
                            f"{cfg.head_dim})")
        if self.k.dtype != w.dtype and not self.autocast_dtype(w.device.type):
            problems.append(f"dtype {self.k.dtype} (the model: {w.dtype})")
        if self.k.device != w.device and w.device.type != "meta":
            problems.append(f"device {self.k.device} (the model: {w.device})")
        if problems:
            raise ValueError(f"KV cache of another model: {'; '.join(problems)}; allocate one with "
                             f"KVCache.for_model(model, ...)")

    def autocast_dtype(self, device_type: str) -> bool:
        """True when autocast is on for `device_type` in this cache's dtype: the K/V the attention computes are then
        in that dtype whatever the weights' (KVCache.for_model(model, dtype=torch.bfloat16) under bf16 autocast of an
        fp32 model), so the cache holds them as they are and the attention reads them as the model's own cache."""
        return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == self.k.dtype

    def write(self, layers: int | slice, k: Tensor, v: Tensor, start: int | Tensor) -> tuple[Tensor, Tensor]:
        """Store new K/V (layers..., B, Hkv, T, hd) at positions start..start+T-1 of the given layer
        slot(s); return views of positions 0..start+T-1 to attend over. With `start` a (T,) positions
        tensor (the static-shape step, snlp.decode.steps) the K/V go to those positions (one index_put_) and the
        WHOLE slot (max_len positions) is returned: shapes never depend on the length, and the attention
        mask (model.window_mask on the positions) hides everything after each query. With `start` a (B, T)
        tensor (ragged batches, snlp.decode.batch) row b's K/V go to its own positions start[b] and the whole slot
        is returned too; an eager caller that knows a bound on the positions in use (`RowPositions.span`, carried
        by the call's Context) cuts the returned views itself. The cache holds no per-call state."""
        if isinstance(start, Tensor) and start.dim() == 2:  # (B, T): row b's tokens at its own positions start[b]
            sl = layers if isinstance(layers, slice) else slice(layers, layers + 1)
            lay = torch.arange(sl.start, sl.stop, device=k.device)[:, None, None]  # (n, 1, 1) x (1, B, 1) x (B, T)
            rows = torch.arange(start.shape[0], device=k.device)[None, :, None]
            vals = lambda x: x.reshape(lay.shape[0], *x.shape[-4:]).permute(0, 1, 3, 2, 4)  # noqa: E731 (n, B, T, H, hd)
            torch.ops.aten.index_put_(self.k, [lay, rows, None, start[None]], vals(k))
            torch.ops.aten.index_put_(self.v, [lay, rows, None, start[None]], vals(v))
            return self.k[layers], self.v[layers]
        if isinstance(start, Tensor):
            # index_put_ on the whole buffer, not an index_copy_ into a per-layer view of it: under torch.compile
            # a mutation through a view is functionalised into a copy of the WHOLE base (every layer's cache) per
            # write, i.e. 2L full-cache copies per step; a direct index_put_ is re-inplaced into the buffer
            sl = layers if isinstance(layers, slice) else slice(layers, layers + 1)
            lay = torch.arange(sl.start, sl.stop, device=k.device)[:, None]  # (n, 1) layer slots x (T,) positions
            vals = lambda x: x.reshape(lay.shape[0], *x.shape[-4:]).permute(0, 3, 1, 2, 4)  # noqa: E731 (n, T, B, H, hd)
            torch.ops.aten.index_put_(self.k, [lay, None, None, start[None, :]], vals(k))
            torch.ops.aten.index_put_(self.v, [lay, None, None, start[None, :]], vals(v))
            return self.k[layers], self.v[layers]
        stop = start + k.shape[-2]
        self.k[layers, ..., start:stop, :] = k
        self.v[layers, ..., start:stop, :] = v
        return self.k[layers, ..., :stop, :], self.v[layers, ..., :stop, :]

    def write_ids(self, idx: Tensor, start: int | Tensor) -> Tensor:
        """Record token ids idx (B, T) at positions start.. (an int, a (T,) or a (B, T) positions tensor, as in
        `write`); returns the whole (B, max_len) id buffer."""
        if self.ids is None:
            raise ValueError("this model's smear reads the previous token from the KV cache, but the cache keeps no "
                             "token ids: allocate it with KVCache.for_model(model, ...)")
        if isinstance(start, Tensor):
            rows = torch.arange(idx.shape[0], device=idx.device)[:, None]  # (B, 1) x (T,) or (B, T) positions
            torch.ops.aten.index_put_(self.ids, [rows, start.expand(idx.shape)], idx)
        else:
            self.ids[:, start:start + idx.shape[1]] = idx
        return self.ids

    def seek(self, length: int) -> None:
        """Set the valid length to any position whose K/V have been written (a decode loop that keeps its rows'
        lengths itself, e.g. a batch of one row, snlp.decode.batch, moves the pointer both ways)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"cannot seek a KV cache of max_len {self.max_len} to length {length}")
        self.length = length

    def advance(self, n: int) -> None:
        """Commit n more positions (their K/V must have been written)."""
        if n < 0 or self.length + n > self.max_len:
            raise ValueError(f"cannot advance a KV cache of length {self.length}/{self.max_len} by {n}")
        self.length += n

    def rollback(self, length: int) -> None:
        """Forget every position >= length (e.g. rejected draft tokens). O(1): only the pointer moves."""
        if not 0 <= length <= self.length:
            raise ValueError(f"can only roll a KV cache back to a length in [0, {self.length}], got {length}")
        self.length = length

    def keep_rows(self, rows: Tensor) -> None:
        """Keep only these batch rows (a (B',) index tensor, in this order): finished sequences of a batch leave
        it so later steps stop computing them (one copy of the kept rows' K/V)."""
        self.k, self.v = self.k[:, rows], self.v[:, rows]
        mark_static_cuda(self.k, self.v)
        if self.ids is not None:
            self.ids = self.ids[rows]
            mark_static_cuda(self.ids)

    def reset(self) -> None:
        self.length = 0

"""One set of weights for the drafter and the verifier (issue 21 item 2).

A plan's fused chunk weights are stacked copies of the suffix layers' weights (`fusion.build_chunk_weights`):
in self-speculative decoding the drafter (the SNLP forward, reading the stacks) and the verifier (the model,
reading its own parameters) then stream two copies of every suffix weight byte, and on a cache- or
bandwidth-bound device each decode step pays for both (measured: the same compiled drafter step took 1.97 ms
alone and 2.79 ms inside SSD, docs/benchmarks.md).

For plans with M = 1 (one layer per chunk) on plain residual models the stacks need no arithmetic: chunk c is
layer start + c itself. `share_chunk_weights` therefore moves the suffix layers' parameters INTO the stacks
(each parameter's `.data` becomes a view of its row of the stack, values unchanged) and returns ChunkWeights
whose tensors are views of the same stacks, so both sides read one copy:

    stack (C, X, D) = [c_q; c_k; c_v] of every chunk layer   layer c's c_q.weight = stack[c, :Hq*hd]
    ChunkWeights.qkv = stack.transpose(1, 2)                  (C, D, X): the batched matmul reads it strided

Learned RMSNorm weights (Llama family) are not folded into the projections (that would make new numbers):
the chunk multiplies its normed input by its layer's weight instead (`ChunkWeights.attn_in` / `mlp_in`), which
is the layer's own arithmetic. The x0-residual scalars stay per layer (for M = 1, gamma = 1: nothing folds).

What keeps it correct: in-place updates of the parameters (optimizer steps, `load_state_dict`, edits through
`.data[...]`) write into the stacks, so the projection matrices are never stale; the few tiny tensors that are
still copies (value-embedding gates, G x Hkv per layer) follow on `Runner.refresh()`, which stays the contract
after any weight change and costs no matrix copy here. Giving a parameter new storage (`model.to(...)`,
`param.data = other`) breaks the sharing; `share_chunk_weights` (and so `refresh()`) notices and moves the
parameters into fresh stacks again. Plans with M > 1 or mHC models (whose fused weights
are sums and per-branch layouts, not the layers' tensors) are refused with a ValueError.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from snlp.method.fusion import ChunkWeights, branch_windows, value_embed_weights
from snlp.model.gpt import GPT


def _params(model: GPT, layers: range) -> dict[str, list[tuple[torch.nn.Parameter, ...]]]:
    """Per stack: for every layer, the parameters that are its rows, in stack order."""
    blocks = [model.blocks[l] for l in layers]
    out = {"qkv": [(b.attn.c_q.weight, b.attn.c_k.weight, b.attn.c_v.weight) for b in blocks],
           "attn_out": [(b.attn.c_proj.weight,) for b in blocks],
           "fc": [(b.mlp.c_fc.weight,) for b in blocks],
           "proj": [(b.mlp.c_proj.weight,) for b in blocks]}
    if model.config.qkv_bias:
        out["qkv_bias"] = [(b.attn.c_q.bias, b.attn.c_k.bias, b.attn.c_v.bias) for b in blocks]
    if blocks[0].ln_attn is not None:
        out["attn_in"] = [(b.ln_attn,) for b in blocks]
        out["mlp_in"] = [(b.ln_mlp,) for b in blocks]
    if model.config.qk_norm == "weighted":
        out["q_norm"] = [(b.attn.q_norm,) for b in blocks]
        out["k_norm"] = [(b.attn.k_norm,) for b in blocks]
    return out


def _stack_of(rows: list[tuple[torch.nn.Parameter, ...]]) -> Tensor | None:
    """The stack these parameters already live in (each one's storage the right rows of one contiguous
    (C, R, ...) storage), rebuilt as a tensor over that storage; None if they do not."""
    first = rows[0][0]
    storage, rest = first.untyped_storage(), tuple(first.shape[1:])
    R = sum(p.shape[0] for p in rows[0])
    inner = math.prod(rest)
    shape = (len(rows), R, *rest)
    if storage.nbytes() != math.prod(shape) * first.element_size():
        return None
    for c, ps in enumerate(rows):
        off = 0
        for p in ps:
            if (p.untyped_storage().data_ptr() != storage.data_ptr() or p.dtype != first.dtype
                    or tuple(p.shape[1:]) != rest or not p.is_contiguous()
                    or p.storage_offset() != (c * R + off) * inner):
                return None
            off += p.shape[0]
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, 0, shape)


@torch.no_grad()
def _rehome(rows: list[tuple[torch.nn.Parameter, ...]]) -> Tensor:
    """Copy the parameters into one new stack (C, sum of rows, ...) and make each a view of its rows."""
    stack = torch.stack([torch.cat([p.data for p in ps], 0) for ps in rows])
    for c, ps in enumerate(rows):
        off = 0
        for p in ps:
            p.data = stack[c, off:off + p.shape[0]]
            off += p.shape[0]
    return stack


def check_shareable(model: GPT, fuse: int) -> None:
    if fuse != 1:
        raise ValueError(f"shared drafter/verifier weights need one layer per chunk (M = 1, CxF1 plans); a fused "
                         f"chunk of M = {fuse} layers is a different matrix (concatenated, gamma-scaled)")
    if model.config.hc_streams:
        raise ValueError("shared drafter/verifier weights support plain residual models; mHC chunks keep a "
                         "per-branch layout with folded stream coefficients")


def share_chunk_weights(model: GPT, start: int, chunks: int) -> ChunkWeights:
    """ChunkWeights of layers start .. start + chunks - 1 (M = 1) that share storage with the model's own
    parameters (module docstring). Moves the parameters into stacks the first time (or after they were given
    new storage); later calls build only views, no copy."""
    check_shareable(model, 1)
    cfg = model.config
    stacks = {}
    for name, rows in _params(model, range(start, start + chunks)).items():
        stack = _stack_of(rows)
        stacks[name] = stack if stack is not None else _rehome(rows)
    C = chunks
    ve_gate, ve_slot = value_embed_weights(model, start, C, 1)  # tiny (G x Hkv per layer): copied
    alpha = beta = None
    if cfg.x0_residual:  # M = 1: the chunk's residual path is the layer's own scalars, gamma = 1
        alpha = model.resid_lambdas[start:start + C].detach()
        beta = model.x0_lambdas[start:start + C].detach()
    row = lambda k: None if k not in stacks else stacks[k].view(C, 1, -1)  # noqa: E731  (C, 1, D)
    return ChunkWeights(
        start=start, fuse=1, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, head_dim=cfg.head_dim,
        qkv=stacks["qkv"].transpose(1, 2),  # (C, D, X) view of (C, X, D)
        attn_out=stacks["attn_out"].transpose(1, 2),  # (C, Hq*hd, D) view of (C, D, Hq*hd)
        fc=stacks["fc"].transpose(1, 2),  # (C, D, F') view of (C, F', D)
        proj=stacks["proj"].transpose(1, 2),  # (C, F, D) view of (C, D, F)
        alpha=alpha, beta=beta, ve_gate=ve_gate, ve_slot=ve_slot,
        windows=branch_windows(model, start, C, 1, stacks["qkv"].device),
        qkv_bias=row("qkv_bias"), qk_norm=cfg.qk_norm, q_norm=row("q_norm"), k_norm=row("k_norm"), eps=cfg.norm_eps,
        swiglu_dim=stacks["proj"].shape[-1] if cfg.mlp_act == "swiglu" else 0,
        attn_in=row("attn_in"), mlp_in=row("mlp_in"))


def shares_storage(model: GPT, w: ChunkWeights) -> bool:
    """Whether `w` reads the model's own parameter storage (the qkv stack is the suffix layers' c_q/c_k/c_v)."""
    return model.blocks[w.start].attn.c_q.weight.data_ptr() == w.qkv.data_ptr()

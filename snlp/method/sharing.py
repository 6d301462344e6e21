"""One set of weights for the drafter and the verifier.

A plan's fused chunk weights are stacked copies of the suffix layers' weights (`fusion.build_chunk_weights`):
in self-speculative decoding the drafter (the SNLP forward, reading the stacks) and the verifier (the model,
reading its own parameters) then stream two copies of every suffix weight byte, and on a cache- or
bandwidth-bound device each decode step pays for both (measured: the same compiled drafter step took 1.97 ms
alone and 2.79 ms inside SSD, docs/records/2026-11-22-bench-cpu.md).

For plans with M = 1 (one layer per chunk) on plain residual models the stacks need no arithmetic: chunk c is
layer start + c itself. The model's per-layer parameters are therefore moved ONCE into one "home" stack per
kind of tensor covering ALL n_layer layers (each parameter's `.data` becomes a view of its row, values
unchanged), and every shared runner's ChunkWeights, whatever its suffix, are views of rows start .. start+C-1
of those same homes:

    home["qkv"] (L, X, D) = [c_q; c_k; c_v] of every layer   layer l's c_q.weight = home["qkv"][l, :Hq*hd]
    ChunkWeights.qkv = home["qkv"][start:start+C].transpose(1, 2)   (C, D, X): the batched matmul reads it strided

Why the whole depth and not the suffix: two shared runners over different suffixes (bench binds every plan of
a sweep shared) must read the same storage. Homing only a suffix made the second bind re-home the overlapping
layers into a new stack while the first runner kept reading the old one (stale after an update); one home over all
layers is the union of every suffix, built once, and a later bind finds it and only takes views.

Every tensor a shared runner reads from the model is a view of the model's own storage (`shared_tensors`):
  - the projections c_q/c_k/c_v, c_proj, c_fc, mlp.c_proj (homes qkv, attn_out, fc, proj);
  - Qwen2's q/k/v biases (qkv_bias), Qwen3's per-head q/k norm weights (q_norm, k_norm);
  - learned RMSNorm weights (Llama family; attn_in, mlp_in): not folded into the projections (that would make
    new numbers), the chunk multiplies its normed input by its layer's weight, the layer's own arithmetic;
  - the value-embedding gates (home ve_gate (L, Hkv, G); rows of layers without value embeddings are zeros
    that no parameter owns, so the chunk stays one batched op as in fusion);
  - the x0-residual scalars (slices of the model's resid_lambdas / x0_lambdas; for M = 1, gamma = 1).
What else the solve reads (embeddings, value-embedding tables, prefix layers, final norm, head) it reads from
the model directly. Integer layout (value-embedding slots, windows) comes from the config.

What keeps it correct: in-place updates of the parameters (optimizer steps, `load_state_dict`, edits through
`.data[...]`) write into the homes, so every shared runner follows them with no refresh. Giving a parameter
new storage (`model.to(...)`, `param.data = other`) breaks its home: `shares_storage` (which checks every
tensor of every chunk) then says False, and `Runner.refresh()` re-homes that kind of tensor (all layers) and
takes fresh views; each runner sees the moved parameter addresses on its next call and refreshes itself
(`Runner.current`), so every shared runner of the model follows (the re-homing moves the addresses again, and
the other runners' refreshes find the new home and only take views). Plans with M > 1 and mHC models (whose fused
weights are sums, products and per-branch layouts, not the layers' tensors) are refused with a one-line ValueError.
"""

from __future__ import annotations

import math

import torch
from torch.nn.utils import parametrize
from torch import Tensor

from snlp.method.fusion import ChunkWeights, branch_windows, qk_scale_rows, value_embed_weights, window_fields
from snlp.model.gpt import GPT

Row = tuple[torch.nn.Parameter | None, ...]  # one layer's parameters in home order; None: zero rows (no tensor)


def _groups(model: GPT) -> dict[str, list[Row]]:
    """Per home: for every layer 0 .. L-1, the parameters that are its rows, in home order."""
    blocks, cfg = list(model.blocks), model.config
    out = {"qkv": [(b.attn.c_q.weight, b.attn.c_k.weight, b.attn.c_v.weight) for b in blocks],
           "attn_out": [(b.attn.c_proj.weight,) for b in blocks],
           "fc": [(b.mlp.c_fc.weight,) for b in blocks],
           "proj": [(b.mlp.c_proj.weight,) for b in blocks]}
    if cfg.qkv_bias:
        out["qkv_bias"] = [(b.attn.c_q.bias, b.attn.c_k.bias, b.attn.c_v.bias) for b in blocks]
    if blocks[0].ln_attn is not None:
        out["attn_in"] = [(b.ln_attn,) for b in blocks]
        out["mlp_in"] = [(b.ln_mlp,) for b in blocks]
    if cfg.qk_norm == "weighted":
        out["q_norm"] = [(b.attn.q_norm,) for b in blocks]
        out["k_norm"] = [(b.attn.k_norm,) for b in blocks]
    if any(b.attn.ve_gate is not None for b in blocks):
        out["ve_gate"] = [(None if b.attn.ve_gate is None else b.attn.ve_gate.weight,) for b in blocks]
    return out


def _layout(rows: list[Row]) -> tuple[Tensor, tuple[int, ...], list[tuple[int, ...]]]:
    """(a parameter of the home, the home's shape (L, R, ...), each position's row count)."""
    first = next(p for ps in rows for p in ps if p is not None)
    sizes = [next(ps[i].shape[0] for ps in rows if ps[i] is not None) for i in range(len(rows[0]))]
    return first, (len(rows), sum(sizes), *first.shape[1:]), sizes


def _home_of(rows: list[Row]) -> Tensor | None:
    """The home these parameters already live in (each one's storage exactly its rows of one contiguous
    (L, R, ...) storage), rebuilt as a tensor over that storage; None if they do not (never homed, or some
    parameter was given new storage since)."""
    first, shape, sizes = _layout(rows)
    storage, inner = first.untyped_storage(), math.prod(shape[2:])
    if storage.nbytes() != math.prod(shape) * first.element_size():
        return None
    for l, ps in enumerate(rows):
        off = 0
        for p, r in zip(ps, sizes):
            if p is not None and (p.untyped_storage().data_ptr() != storage.data_ptr() or p.dtype != first.dtype
                                  or tuple(p.shape) != (r, *shape[2:]) or not p.is_contiguous()
                                  or p.storage_offset() != (l * shape[1] + off) * inner):
                return None
            off += r
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, 0, shape)


@torch.no_grad()
def _rehome(rows: list[Row]) -> Tensor:
    """Copy the parameters into one new home (L, R, ...) (zeros where a layer has no such tensor) and make each
    parameter a view of its rows: values unchanged, the parameter objects (and optimizer state) kept."""
    first, shape, sizes = _layout(rows)
    params = [p for ps in rows for p in ps if p is not None]
    if any(p.dtype != first.dtype or p.device != first.device for p in params):
        raise ValueError("shared drafter/verifier weights need every layer's parameters in one dtype and on one "
                         f"device; found {sorted({(str(p.dtype), str(p.device)) for p in params})}")
    with torch.inference_mode(False):  # a normal tensor even when bound under inference mode: the parameters
        home = first.new_zeros(shape)  # live here from now on, and training must still be able to save them
        for l, ps in enumerate(rows):
            off = 0
            for p, r in zip(ps, sizes):
                if p is not None:
                    home[l, off:off + r].copy_(p.data)
                    p.data = home[l, off:off + r]
                off += r
    return home


def homes(model: GPT) -> dict[str, Tensor]:
    """The model's home stacks (module docstring), found where the parameters already live or made (once per
    kind of tensor, over all layers) where they do not."""
    out = {}
    for name, rows in _groups(model).items():
        home = _home_of(rows)
        out[name] = home if home is not None else _rehome(rows)
    return out


def check_shareable(model: GPT, fuse: int) -> None:
    if fuse != 1:
        raise ValueError(f"shared drafter/verifier weights need one layer per chunk (M = 1, CxF1 plans); a fused "
                         f"chunk of M = {fuse} layers is a different matrix (concatenated, gamma-scaled)")
    if model.config.hc_streams:
        raise ValueError("shared drafter/verifier weights support plain residual models; mHC chunks keep a "
                         "per-branch layout with folded stream coefficients (computed, so not the layers' storage)")
    # checked before any parameter is re-homed, so a refusal leaves the model as it was
    if any(parametrize.is_parametrized(mod) for mod in model.modules()):
        raise ValueError("shared weights need the layers' own parameters; this model's weights are computed by a "
                         "parametrization (e.g. a LoRA drafter's merged deltas): bind it without share_weights")
    if any(p.is_inference() for p in model.parameters()):
        raise ValueError("shared weights re-home the model's parameters, and these are inference tensors (made "
                         "under torch.inference_mode, e.g. loaded there): load the model outside inference_mode or "
                         "bind without share_weights")


def share_chunk_weights(model: GPT, start: int, chunks: int, causal: bool = False) -> ChunkWeights:
    """ChunkWeights of layers start .. start + chunks - 1 (M = 1) whose every tensor is a view of the model's own
    parameter storage (module docstring). Homes the parameters the first time (or after some were given new
    storage); later calls, for any suffix, build only views, no copy. `causal`: every branch attends fully, the
    layers' sliding windows dropped (a `causal` plan's suffix, snlp.method.fusion.full_causal)."""
    check_shareable(model, 1)
    cfg, C = model.config, chunks
    h = {k: v[start:start + C] for k, v in homes(model).items()}  # (C, R, ...) views
    _, ve_slot = value_embed_weights(model, start, C, 1)  # None when no layer of the suffix has value embeddings
    alpha = beta = None
    if cfg.x0_residual:  # M = 1: the chunk's residual path is the layer's own scalars, gamma = 1 (views)
        alpha = model.resid_lambdas.data[start:start + C]
        beta = model.x0_lambdas.data[start:start + C]
    row = lambda k: None if k not in h else h[k].view(C, 1, -1)  # noqa: E731  (C, 1, D)
    return ChunkWeights(
        start=start, fuse=1, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, head_dim=cfg.head_dim,
        qkv=h["qkv"].transpose(1, 2),  # (C, D, X) view of (C, X, D)
        attn_out=h["attn_out"].transpose(1, 2),  # (C, Hq*hd, D) view of (C, D, Hq*hd)
        fc=h["fc"].transpose(1, 2),  # (C, D, F') view of (C, F', D)
        proj=h["proj"].transpose(1, 2),  # (C, F, D) view of (C, D, F)
        alpha=alpha, beta=beta,
        ve_gate=None if ve_slot is None else h["ve_gate"].transpose(1, 2),  # (C, G, Hkv) view of (C, Hkv, G)
        ve_slot=ve_slot, **(window_fields(None, None, False) if causal else
                             branch_windows(model, start, C, 1, h["qkv"].device)),
        qkv_bias=row("qkv_bias"), qk_norm=cfg.qk_norm, eps=cfg.norm_eps,
        q_norm=row("q_norm") if cfg.qk_norm == "weighted" else qk_scale_rows(cfg, C, 1, h["qkv"]),
        k_norm=row("k_norm") if cfg.qk_norm == "weighted" else qk_scale_rows(cfg, C, 1, h["qkv"]),
        swiglu_dim=h["proj"].shape[-1] if cfg.mlp_act == "swiglu" else 0, ve_scale=cfg.ve_gate_scale,
        attn_in=row("attn_in"), mlp_in=row("mlp_in"), views=True)


def shared_tensors(model: GPT, w: ChunkWeights) -> list[tuple[str, Tensor | None, Tensor | None]]:
    """Every tensor a shared runner reads from the model, element by element: (field of `w`, its part for one
    layer and one parameter, that parameter's own tensor). A None on one side only means that tensor is missing
    there (e.g. weights built for another config); a layer without value embeddings has no gate to pair."""
    C, S = w.chunks, w.start
    groups = _groups(model)
    rows_of = {"qkv": w.qkv.transpose(1, 2), "attn_out": w.attn_out.transpose(1, 2),  # (C, R, ...) each
               "fc": w.fc.transpose(1, 2), "proj": w.proj.transpose(1, 2)}
    for k in ("qkv_bias", "attn_in", "mlp_in", "q_norm", "k_norm"):  # (C, 1, R)
        if k in ("q_norm", "k_norm") and w.qk_norm != "weighted":  # the constant qk_scale: no parameter behind it
            continue
        rows_of[k] = None if getattr(w, k) is None else getattr(w, k)[:, 0]
    has_ve = any(p is not None for ps in groups.get("ve_gate", [])[S:S + C] for p in ps)
    rows_of["ve_gate"] = None if w.ve_gate is None else w.ve_gate.transpose(1, 2)  # (C, Hkv, G)
    out = []
    for k, t in rows_of.items():
        rows = groups.get(k) if k != "ve_gate" or has_ve else None
        if t is None or rows is None:
            if t is not None or rows is not None:
                out.append((k, t, None if rows is None else rows[S][0]))
            continue
        for c in range(C):
            off = 0
            for p in rows[S + c]:
                r = t.shape[1] if p is None else p.shape[0]
                if p is not None:
                    out.append((k, t[c, off:off + r], p.data))
                off += r
    for k, name in (("alpha", "resid_lambdas"), ("beta", "x0_lambdas")):
        t, lam = getattr(w, k), getattr(model, name, None) if model.config.x0_residual else None
        if t is None or lam is None:
            if t is not None or lam is not None:
                out.append((k, t, lam))
            continue
        out += [(k, t[c], lam.data[S + c]) for c in range(C)]
    return out


def _same_view(a: Tensor, b: Tensor) -> bool:
    """Whether a and b are the same elements of the same storage (a write through one is seen by the other)."""
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.dtype == b.dtype
            and a.storage_offset() == b.storage_offset() and tuple(a.shape) == tuple(b.shape)
            and all(s == 1 or x == y for s, x, y in zip(a.shape, a.stride(), b.stride())))


def shares_storage(model: GPT, w: ChunkWeights) -> bool:
    """Whether EVERY tensor `w` reads from the model (`shared_tensors`: every field, every chunk's layer, every
    parameter) is exactly that parameter's storage: then any in-place update of the model reaches `w` unrefreshed."""
    return all(a is not None and b is not None and _same_view(a, b) for _, a, b in shared_tensors(model, w))

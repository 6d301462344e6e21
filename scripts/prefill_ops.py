"""Count what one eager prefill forward launches, for the sequential forward and every plan of the paper's suite.

    PYTHONPATH=$PWD python3 scripts/prefill_ops.py [--shapes 0.5B-nox0ve,0.5B,0.5B-mhc,3B] [--tokens 2048]
                                                   [--dtype bfloat16] [--regions] [--extra-iter] [--json FILE]
                                                   [--batch B] [--plans P,...] [--paper PATH]
                                                   [--bound [--peak-tflops 989] [--hbm-tbs 4.8]
                                                    [--times sequential=MS,PLAN=MS,... [--target 2.0]
                                                     [--sweep T:B,... [--latency-us 30,35]]]]

The models are the suite's (snlp.bench.suite.PAPER_SHAPES: random weights, window pattern SSSL with a 512-token
short window, vocab 32768, batch 1), built on the `meta` device: every aten op runs its shape / dtype rules and no
arithmetic, so the counts below are those of the real T = 2048 bf16 shapes in seconds on a CPU box. What is counted
per forward (a TorchDispatchMode under every aten op, a TorchFunctionMode around scaled_dot_product_attention):

  kernels   aten ops that launch work on a GPU in eager mode (every op but views / metadata: view, transpose,
            expand, select, slice, _unsafe_view, ...). On a GPU each is >= 1 kernel launch (~5-10 us of host + launch).
  tiny      of those, ops whose output is < 256 KiB: launch-bound on any GPU whatever their arithmetic.
  MB out    bytes the kernels write (views write nothing); `mask MB built` the part written while building attention
            masks (window_mask and the mask conversions); `copy MB` the part written by pure data movement (cat,
            stack, clone, copy_, index / gather, _to_copy). bf16 -> fp32 upcasts are counted too (`f32_mb` in the
            JSON): in every forward here they are the head's fp32 logits only (256 MiB at T = 2048).
  sdpa      attention calls: `causal` (is_causal=True, no mask: the flash kernel on CUDA), `masked` (an explicit
            attn_mask: on CUDA no flash kernel; the memory-efficient kernel computes every (query, key) block);
            `mask MB read` the float mask those calls read (a bool mask counts as the float mask SDPA converts it to
            inside the call: scalar_tensor x 2 + where, counted as 3 kernels and as mask MB built).
  GFLOP     matmul + attention FLOPs (torch.utils.flop_counter; attention counted over all T x S pairs).

SDPA runs on `meta` through its math fallback: its inner ops are not counted (on a GPU it is one fused kernel);
the bool-mask conversion the CPU build dispatches before any backend (scalar_tensor x 2 + where, seen with a
TorchDispatchMode on CPU tensors) is counted as those 3 ops. rms_norm counts as ONE kernel (a CUDA build of torch
>= 2.8 dispatches it to aten._fused_rms_norm; the CPU build decomposes it into 7 ops with an fp32 upcast: to be
confirmed by the GPU profile). Counting only: nothing here is timed, and a count is not a time. `--regions` prints
each forward's kernels and bytes by the snlp function that issued them and its top ops; `--extra-iter` also counts
every plan at K + 1 and prints the difference (what one more iteration costs). `--json` keeps everything.

`--bound` adds the work the GPU kernels do: GEMM FLOPs (2 m n k per mm / bmm / addmm, and per linear / einsum /
matmul where they reach the counter whole), attention FLOPs per kernel model (4 hd per (query, key) pair the kernel
visits, tiles of 128: `measured` = a masked SDPA computes every score, an is_causal one the causal tiles, a fused
stack one masked call; `flex` = a mixed-window stack through FlexAttention's block mask; `paper` = the paper's
suffix full causal; `exact` = the visible pairs), the weight bytes GEMMs read (operands that existed before the
forward, or were made from such alone: casts and stacks of weights, whose writes are `weight MB prepared`), the
bytes GEMM and attention kernels must move, and the roofline floor sum(max(FLOPs / peak, bytes / bandwidth)) over
them. `--times` takes measured ms per forward (one shape) and prints the achieved TFLOP/s and each plan's best time
(at the sequential's efficiency, at its floor, and with its prefix at the measured cost and its stack at the floor);
`--sweep` PREDICTS times at other T / batch from a latency + throughput model calibrated on those times.
`--paper PATH` also counts the paper's own code (a nanochat-snlp checkout) for the same shapes and plans.
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import json
import os
import re
import sys
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from torch.utils._pytree import tree_leaves

from snlp.bench.suite import PAPER_SHAPES
from snlp.method.plan import Plan
from snlp.method.solver import bind
from snlp.model.gpt import GPT

aten = torch.ops.aten
TINY = 256 * 1024
COPIES = {"cat", "stack", "clone", "copy_", "copy", "index", "index_select", "gather", "_to_copy", "index_put_",
          "index_copy", "index_copy_", "masked_scatter", "repeat", "_unsafe_index"}
NO_KERNEL = (aten.empty.memory_format, aten.empty_strided.default, aten._unsafe_view.default, aten.lift_fresh.default,
             aten.alias.default)
# snlp functions a kernel is attributed to (the innermost one on the Python stack wins)
REGIONS = {"sinkhorn": "mhc H (sinkhorn)", "hc_maps": "mhc H (sinkhorn)", "hc_sublayer": "mhc mixing",
           "_hc_chunk_forward": "mhc mixing", "_hc_branch_sum": "mhc mixing", "_hc_branch_inputs": "mhc mixing",
           "window_mask": "attention mask", "branch_masks": "attention mask", "attend": "attention",
           "_branch_attention": "attention", "qk_rope": "rope / qk-norm", "rope": "rope / qk-norm",
           "_padded_ve": "value embeds", "chunk_ve": "value embeds", "norm": "rms_norm", "mlp_act": "mlp act",
           "bmm": "matmul", "forward": "layer (other)", "layer": "layer (other)", "chunk_forward": "chunk (other)",
           "scalar_correct": "correction (IDN scan)", "affine_scan": "correction (HCN scan)",
           "delta": "correction", "step": "correction", "initial_states": "solver init", "solve": "solver glue",
           "head": "head", "embed": "embed", "rotary": "embed"}
GEMMS = (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default)
# composite matmuls that reach the counter whole under inference_mode (the paper's code runs in it): one GEMM each
COMPOSITE_GEMMS = (aten.linear.default, aten.matmul.default, aten.einsum.default)
SNLP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + "snlp" + os.sep
# the functions whose kernels are a plan's fused stack or the LM head: snlp's, and the paper code's (peer counts)
STACK_FUNCS = {"chunk_forward", "_hc_chunk_forward", "_batched_forward", "_batched_chunks_forward",
               "_fused_forward_chunk", "_fused_split_forward"}
HEAD_FUNCS = {"head", "_logits"}


def _is_view(func) -> bool:
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _region(skip: int = 3) -> str:
    for fr in inspect.stack(context=0)[skip:]:
        if "snlp" in fr.filename and fr.function in REGIONS:
            return REGIONS[fr.function]
    return "other"


class Count(TorchDispatchMode):
    """aten-level counts of one forward (see the module docstring)."""

    def __init__(self, regions: bool = False):
        super().__init__()
        self.regions = regions
        self.ops = collections.Counter()
        self.by_region = collections.Counter()
        self.mb_region = collections.Counter()
        self.mb_op = collections.Counter()
        self.kernels = self.tiny = 0
        self.out = self.copy = self.f32 = 0
        self.quiet = 0  # > 0 inside SDPA's math fallback on meta
        self.made = set()  # storages written during the forward: a GEMM operand outside it is a weight (or buffer)
        self.gemms = []  # one _Heavy per GEMM kernel
        self.wd = set()  # storages computed from weights alone (the paper's per-call casts and stacks of them)
        self.wprep = 0  # bytes those ops write

    def _is_weight(self, t: torch.Tensor) -> bool:
        """A floating tensor that existed before the forward (not the token ids), or one made from such alone."""
        sid = t.untyped_storage()._cdata
        return sid in self.wd or (sid not in self.made and t.is_floating_point())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        view = _is_view(func)
        if view:  # ops that MAY alias (to, reshape, contiguous: they reach the counter whole under inference_mode)
            #       are kernels when they copy
            srcs = {t.untyped_storage()._cdata for t in _tensors(args)}
            view = all(t.untyped_storage()._cdata in srcs for t in _tensors(out))
        if not view:  # a view of a weight (w.t() in F.linear) shares the weight's storage
            outs = {t.untyped_storage()._cdata for t in _tensors(out)}
            ins = [t for t in _tensors(args) if t.dim() > 0]
            if ins and all(self._is_weight(t) for t in ins):  # made from weights alone: a cast or a stack of them
                self.wd.update(outs)
                if not self.quiet and not func._schema.name.endswith("_"):
                    self.wprep += sum(t.numel() * t.element_size() for t in _tensors(out))
            else:  # a freed storage's address can be reused by a new tensor
                self.wd.difference_update(outs)
            self.made.update(outs)
        if self.quiet or view or func in NO_KERNEL:
            return out
        if func in GEMMS or func in COMPOSITE_GEMMS:
            self.gemms.append(self._gemm(func, args, out))
        name = func._schema.name.split("::")[-1]
        if not _tensors(out):  # promote_types, sym_size, ...: no kernel
            return out
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(out))
        if name.endswith("_") and not nbytes:  # in-place op: it writes its first argument
            nbytes = sum(t.numel() * t.element_size() for t in _tensors(args[:1]))
        self.ops[name] += 1
        self.kernels += 1
        self.tiny += nbytes < TINY
        self.out += nbytes
        if name in COPIES:
            self.copy += nbytes
        if name in ("_to_copy", "to") and any(t.dtype in (torch.bfloat16, torch.float16) for t in _tensors(args[:1])) \
                and any(t.dtype == torch.float32 for t in _tensors(out)):
            self.f32 += nbytes
        r = _region()
        self.by_region[r] += 1
        self.mb_region[r] += nbytes / 2**20
        self.mb_op[name] += nbytes / 2**20
        return out


    def _gemm(self, func, args, out) -> "_Heavy":
        """2 m n k FLOPs (per batch entry) and the bytes a GEMM kernel must move at least: each operand read once,
        the result written once; `weight` = the bytes of operands that existed before the forward (parameters and
        the bound runner's stacked chunk weights)."""
        if func is aten.einsum.default:  # 2 x output size x the sizes of the summed-out indices
            eq, ops = args[0].replace(" ", ""), args[1]
            lhs, rhs = eq.split("->")
            sizes = {c: n for term, t in zip(lhs.split(","), ops) for c, n in zip(term, t.shape)}
            k = 1
            for c in set(lhs.replace(",", "")) - set(rhs):
                k *= sizes[c]
            ins = [t for t in ops if t.dim() > 0]
        else:
            a = args[1] if func in (aten.addmm.default, aten.baddbmm.default) else args[0]
            k = a.shape[-1]
            ins = [t for t in _tensors(args) if t.dim() > 0]
        flops = 2 * out.numel() * k
        moved = sum(t.numel() * t.element_size() for t in ins) + out.numel() * out.element_size()
        weight = sum(t.numel() * t.element_size() for t in ins if self._is_weight(t))
        return _Heavy("gemm", _part(), flops, moved, weight, out.numel() * out.element_size())


@dataclass
class _Heavy:
    """One GEMM or attention kernel: FLOPs as the CUDA kernel computes them (`flops`; attention: a dict by kernel
    model, see _attention_pairs), the HBM bytes it moves at least (`bytes`), of which weights (`weight`)."""

    kind: str  # gemm / attention
    part: str  # layers (sequential layers and a plan's prefix) / stack (fused chunks) / head
    flops: int | dict
    bytes: int
    weight: int = 0
    out: int = 0  # bytes written (the result)


def _part() -> str:
    """Which part of a forward issued the current op: the fused chunk stack of a plan, the LM head, or the sequential
    layers (a plan's prefix included)."""
    f = inspect.currentframe()
    while f is not None:
        if f.f_code.co_name in STACK_FUNCS:
            return "stack"
        if f.f_code.co_name in HEAD_FUNCS:
            return "head"
        f = f.f_back
    return "layers"


def _windows_of_call(n: int) -> list[int] | None:
    """The window of each of the n flattened sequences of the SDPA call being made (-1: full causal), read from the
    snlp frame that issued it: a fused stack's `_branch_attention` (the weights' host tuple of branch windows, each
    branch over n / (C*M) rows) or `attend` (an int window). None when neither says (then every score counts)."""
    f = inspect.currentframe()
    while f is not None:
        if f.f_code.co_filename.startswith(SNLP_DIR):  # this repository's package (the paper's has an snlp too)
            if f.f_code.co_name == "_branch_attention":
                wv = getattr(f.f_locals.get("w"), "window_values", None)
                if wv is None:
                    return [-1] * n
                return [w for w in wv for _ in range(n // len(wv))]
            if f.f_code.co_name == "attend" and isinstance(f.f_locals.get("windows"), int):
                return [f.f_locals["windows"]] * n
        f = f.f_back
    return None


@functools.lru_cache(maxsize=None)
def _attention_pairs(T: int, window: int, block: int = 128) -> dict:
    """(query, key) pairs one head of one causal sliding-window sequence (queries and keys at 0..T-1, key j visible
    to query p iff j <= p and (window < 0 or p - j <= window)) costs under each kernel model:
      all     every T x T score (SDPA with an explicit mask: cuDNN / memory-efficient kernels visit every block);
      causal  the key blocks a causal flash kernel visits (block x block tiles on or below the diagonal), windows
              ignored: SDPA is_causal=True, and the paper's parallel suffix, which drops the windows;
      flex    the tiles FlexAttention visits under snlp's sliding-window block mask (flex_block_mask's rule:
              hi >= 0 and lo <= w, tiles of `block`);
      exact   the visible pairs only (the work the function needs)."""
    n = -(-T // block)
    size = [min(block, T - i * block) for i in range(n)]
    wb = T if window < 0 else window
    causal = flex = 0
    for i in range(n):
        for j in range(i + 1):
            d = (i - j) * block
            causal += size[i] * size[j]
            if d + block - 1 >= 0 and d - (block - 1) <= wb:
                flex += size[i] * size[j]
    exact = sum(min(p, wb) + 1 for p in range(T))
    return dict(all=T * T, causal=causal, flex=flex, exact=exact)


class Attn(TorchFunctionMode):
    """Every scaled_dot_product_attention call: causal / masked, and the mask bytes."""

    def __init__(self, counter: Count):
        super().__init__()
        self.c = counter
        self.causal = self.masked = self.plain = 0
        self.mask_bytes = 0
        self.masks = collections.Counter()
        self.calls = []  # one _Heavy per SDPA kernel

    def one_kernel(self, name, func, args, kwargs):
        self.c.quiet += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.c.quiet -= 1
        nbytes = out.numel() * out.element_size()
        self.c.ops[name] += 1
        self.c.kernels += 1
        self.c.tiny += nbytes < TINY
        self.c.out += nbytes
        r = _region(2)
        self.c.by_region[r] += 1
        self.c.mb_region[r] += nbytes / 2**20
        self.c.mb_op[name] += nbytes / 2**20
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.rms_norm, torch.rms_norm):  # one fused kernel on CUDA (aten._fused_rms_norm); the CPU build
            return self.one_kernel("rms_norm", func, args, kwargs)  # decomposes it into 7 ops (fp32 upcast + 6)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        q = args[0]
        if mask is not None:
            self.masked += 1
            self.mask_bytes += mask.numel() * q.element_size()  # the float mask the kernel reads (a bool one: SDPA's
            #                                                     conversion of it)
            self.masks[(tuple(mask.shape), str(mask.dtype).replace("torch.", ""))] += 1
            if mask.dtype == torch.bool:  # SDPA's own conversion: scalar_tensor x 2 + where (-> q.dtype, mask shape)
                self.c.ops["where (sdpa mask)"] += 1
                self.c.ops["scalar_tensor"] += 2
                self.c.kernels += 3
                self.c.tiny += 2
                self.c.out += mask.numel() * q.element_size()
                self.c.by_region["attention mask"] += 3
                self.c.mb_region["attention mask"] += mask.numel() * q.element_size() / 2**20
                self.c.mb_op["where (sdpa mask)"] += mask.numel() * q.element_size() / 2**20
        elif kwargs.get("is_causal", False):
            self.causal += 1
        else:
            self.plain += 1
        self.calls.append(self._heavy(args, kwargs, mask))
        self.c.ops["sdpa"] += 1
        self.c.kernels += 1
        self.c.by_region["sdpa kernel"] += 1
        self.c.quiet += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.c.quiet -= 1


    @staticmethod
    def _heavy(args, kwargs, mask) -> _Heavy:
        """FLOPs of this call under each scenario of SCENARIOS (4 hd FLOPs per (query, key) pair: q.k and p.v), and
        the bytes it moves at least: q, k, v read, the output written, an explicit mask read."""
        q, k, v = args[:3]
        hd, T, S = q.shape[-1], q.shape[-2], k.shape[-2]
        n, H = int(torch.Size(q.shape[:-3]).numel()), q.shape[-3]
        el = q.element_size()
        moved = (q.numel() + k.numel() + v.numel() + q.numel()) * el + (0 if mask is None else mask.numel() * el)
        causal = kwargs.get("is_causal", False) and mask is None
        wins = _windows_of_call(n) if T == S else None
        part = _part()
        flops = {}
        for sc, route in SCENARIOS.items():
            total = 0
            for w in (wins if wins is not None else [None] * n):
                pairs = _attention_pairs(T, -1 if w is None else w)
                if w is None or T != S:
                    key = "causal" if causal else "all"
                    pairs = dict(all=T * S, causal=pairs["causal"] if T == S else T * S)
                else:
                    key = route(part, causal, wins)
                total += pairs[key]
            flops[sc] = 4 * H * hd * total
        return _Heavy("attention", part, flops, moved, 0, q.numel() * el)


# How each attention call is computed on CUDA, per scenario: (part, is_causal, the call's windows) -> a key of
# _attention_pairs. measured = what the H200 runs timed (T = 2048: one layer is_causal or masked, a fused stack one
# masked SDPA over every branch); flex = snlp's compiled CUDA default now (a stack that mixes windows through
# FlexAttention, single layers unchanged); paper = the paper's code (its parallel suffix full causal, windows
# dropped; its sequential layers masked); exact = the visible pairs only.
SCENARIOS = {
    "measured": lambda part, causal, wins: "causal" if causal else "all",
    "flex": lambda part, causal, wins: "causal" if causal else
    ("flex" if part == "stack" and len(set(wins)) > 1 else "all"),
    "paper": lambda part, causal, wins: "causal" if causal or part == "stack" else "all",
    "exact": lambda part, causal, wins: "exact",
}


def measure(fn, regions: bool = False) -> dict:
    c = Count(regions)
    a = Attn(c)
    flops = FlopCounterMode(display=False)
    with torch.no_grad(), flops, a, c:  # no_grad, not inference_mode: composite ops (linear, rms_norm, matmul) then
        #                                 reach the counter decomposed into the aten kernels they run
        fn()
    heavy = c.gemms + a.calls
    parts = {}
    for h in heavy:
        d = parts.setdefault(h.part, dict(gemm_gflop=0.0, weight_mb=0.0, heavy_mb=0.0,
                                          **{f"attn_gflop_{sc}": 0.0 for sc in SCENARIOS}))
        if h.kind == "gemm":
            d["gemm_gflop"] += h.flops / 1e9
        else:
            for sc in SCENARIOS:
                d[f"attn_gflop_{sc}"] += h.flops[sc] / 1e9
        d["weight_mb"] += h.weight / 2**20
        d["heavy_mb"] += h.bytes / 2**20
    return dict(kernels=c.kernels, tiny=c.tiny, out_mb=c.out / 2**20, weight_prep_mb=c.wprep / 2**20, mask_built_mb=c.mb_region["attention mask"],
                copy_mb=c.copy / 2**20, f32_mb=c.f32 / 2**20,
                sdpa_causal=a.causal, sdpa_masked=a.masked, sdpa_plain=a.plain, mask_mb=a.mask_bytes / 2**20,
                masks=dict((f"{s}:{d}", n) for (s, d), n in a.masks.items()),
                gflop=flops.get_total_flops() / 1e9, ops=dict(c.ops.most_common()),
                regions=dict(c.by_region.most_common()),
                mb_region={k: round(v) for k, v in c.mb_region.most_common()},
                mb_op={k: round(v) for k, v in c.mb_op.most_common()}, parts=parts,
                heavy=[(h.kind, h.part, h.flops, h.bytes) for h in heavy],
                heavy_out=[(h.kind, h.part, h.flops, h.out) for h in heavy])


class _Autocast(torch.autocast):
    """torch.autocast("meta") is refused by torch; snlp only ever disables autocast, which the CPU one does too."""

    def __init__(self, device_type, *args, **kwargs):
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


def build(shape, tokens: int, dtype) -> GPT:
    cfg = shape.config(32768, "SSSL", 512, max(2048, tokens))
    with torch.device("meta"):
        model = GPT(cfg)
    return model.to(dtype=dtype).eval()


def count_forwards(shape, tokens: int, batch: int, dtype, plans, regions: bool = False) -> list[dict]:
    """`measure` of the sequential forward and of each plan (bound runners) of one shape, batch x tokens ids."""
    model = build(shape, tokens, dtype)
    idx = torch.zeros(batch, tokens, dtype=torch.long, device="meta")
    fwds = {"sequential": lambda: model(idx)}
    for s in plans:
        fwds[s] = (lambda r: lambda: r(idx))(bind(model, s, check_finite=False))
    return [dict(shape=shape.key, side="snlp", forward=name, tokens=tokens, batch=batch, **measure(fn, regions))
            for name, fn in fwds.items()]


class MetaItems(torch.overrides.TorchFunctionMode):
    """The paper's IDN plans (CxFM, its batched and fused paths) average its per-layer resid / x0 lambdas into Python
    floats (`.item()`) when they build, which a `meta` tensor cannot give. While it builds, a meta tensor's `.item()` answers 1.0: the
    floats only scale the plan's elementwise work, so no kernel, FLOP or byte count depends on them (tensors it
    keeps, such as its stacked lambdas, stay on meta)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.item and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return 1.0
        return func(*args, **(kwargs or {}))


def count_paper(code, shape, tokens: int, batch: int, plans, regions: bool = False) -> list[dict]:
    """`measure` of the paper's own code (snlp.bench.paper_peer: its GPT with fp32 master weights, its sequential
    forward and its callable for each plan, on `meta`) for the same shape; plans it has no path for are left out."""
    from snlp.bench.paper_peer import build_paper_model, paper_config, paper_plan_fn, paper_sequential_fn
    model = build_paper_model(code, paper_config(code, shape, 32768, max(2048, tokens), "SSSL"), torch.device("meta"))
    idx = torch.zeros(batch, tokens, dtype=torch.long, device="meta")
    fwds = {"sequential": paper_sequential_fn(code, model)}
    for s in plans:
        try:
            with MetaItems():
                fwds[s] = paper_plan_fn(code, model, Plan.parse(s), shape)
        except ValueError:  # no path for this plan in the paper's evaluator
            continue
        except RuntimeError as e:  # a weight precomputation that reads other values than the lambdas
            print(f"paper: {shape.key} {s}: not countable on meta ({str(e).splitlines()[0]})", file=sys.stderr)
    rows = []
    for name, fn in fwds.items():
        try:
            rows.append(dict(shape=shape.key, side="paper", forward=name, tokens=tokens, batch=batch,
                             **measure((lambda f: lambda: f(idx))(fn), regions)))
        except RuntimeError as e:
            print(f"paper: {shape.key} {name}: not countable on meta ({str(e).splitlines()[0]})", file=sys.stderr)
    return rows


def label(r: dict) -> str:
    return r["forward"] if r["side"] == "snlp" else f"paper: {r['forward']}"


def floor_ms(heavy, scenario: str, peak: float, bw: float, parts=None) -> float:
    """Roofline floor of a forward's GEMM and attention kernels: the sum over kernels of max(FLOPs / peak, bytes /
    bandwidth) (peak in TFLOP/s, bandwidth in TB/s), attention FLOPs as `scenario` computes them; `parts` keeps
    only kernels of those parts. Everything else a forward runs (norms, RoPE, residuals, the correction) adds to it."""
    t = 0.0
    for kind, part, flops, nbytes in heavy:
        if parts is None or part in parts:
            f = flops if kind == "gemm" else flops[scenario]
            t = t + max(f / (peak * 1e12), nbytes / (bw * 1e12))
    return t * 1e3


def flops_of(row: dict, scenario: str, parts=None) -> float:
    """GFLOP of a forward (GEMMs + attention as `scenario` computes it), optionally of some parts only."""
    return sum(d["gemm_gflop"] + d[f"attn_gflop_{scenario}"] for p, d in row["parts"].items()
               if parts is None or p in parts)


def bound_report(rows: list[dict], peak: float, bw: float, times: dict, target: float) -> list[str]:
    """The bound tables (--bound): per forward FLOPs, bytes and roofline floors; with `times` (measured ms per
    forward name, one shape), the achieved TFLOP/s and the best time each plan could reach."""
    out = [f"\n# GEMM + attention work per forward, and its roofline floor at {peak:g} TFLOP/s and {bw:g} TB/s",
           "(attention GFLOP as CUDA computes it: measured = one layer causal or masked (all scores), a stack masked; "
           "flex = a mixed-window stack through FlexAttention's window blocks; paper = the paper's suffix full causal; "
           "exact = visible pairs only; MB = 2^20 bytes; weights = GEMM operands that exist before the forward or are made from weights alone; prepared = what such casts and stacks write)",
           "| shape | forward | GEMM GFLOP | attention GFLOP measured / flex / paper / exact | weight MB read | "
           "weight MB prepared | GEMM + attention MB moved | eager MB written by other ops | "
           "floor ms measured / flex / paper |", "|---" * 9 + "|"]
    scs = ("measured", "flex", "paper", "exact")
    for r in rows:
        P = r["parts"].values()
        # the paper's calls carry no window the counter can read (its frames are not snlp's): its one figure is
        # what its kernels compute, never a flex or visible-pairs figure
        attn = (f"{sum(d['attn_gflop_measured'] for d in P):.1f} (its kernels) / - / - / -" if r["side"] == "paper"
                else " / ".join(f"{sum(d[f'attn_gflop_{sc}'] for d in P):.1f}" for sc in scs))
        heavy_mb = sum(d["heavy_mb"] for d in P)
        written = sum(nb for kind, part, fl, nb in r["heavy_out"]) / 2**20
        out.append(f"| {r['shape']} | {label(r)} | {sum(d['gemm_gflop'] for d in P):.1f} | {attn} | "
                   f"{sum(d['weight_mb'] for d in P):.0f} | {r['weight_prep_mb']:.0f} | {heavy_mb:.0f} | "
                   f"{r['out_mb'] - written:.0f} | " +
                   " / ".join(f"{floor_ms(r['heavy'], sc, peak, bw):.3f}" for sc in scs[:3]) + " |")
    if not times:
        return out
    rows = [r for r in rows if r["side"] == "snlp"]
    seq = next((r for r in rows if r["forward"] == "sequential"), None)
    if seq is None or "sequential" not in times:
        raise SystemExit("--times needs a time for the sequential forward (sequential=MS)")
    t_seq = times["sequential"]
    head = floor_ms(seq["heavy"], "measured", peak, bw, ("head",))
    f_seq = flops_of(seq, "measured")
    ach = f_seq / t_seq  # GFLOP per ms = TFLOP/s
    out += [f"\n# against the measured sequential forward: {t_seq:g} ms, {f_seq:.1f} GFLOP as computed = "
            f"{ach:.0f} TFLOP/s, {100 * ach / peak:.1f} % of {peak:g}",
            f"(a) the plan at the sequential's achieved TFLOP/s; (b) the whole plan at its roofline floor; (c) its "
            f"sequential part (prefix layers at the measured sequential's cost per layer FLOP, the head at its floor "
            f"{head:.3f} ms) plus its stack at the stack's floor; budget = the stack time a {target:g}x speedup leaves, "
            f"and the TFLOP/s the stack then needs (% of peak). Speedups are over the measured sequential.",
            "| forward | scenario | measured ms | achieved TFLOP/s | GFLOP | (a) ms / x | (b) ms / x | (c) ms / x | "
            f"stack GFLOP | stack ms measured (derived) / TFLOP/s | stack budget ms for {target:g}x | "
            "stack TFLOP/s needed |", "|---" * 12 + "|"]
    f_layers = flops_of(seq, "measured", ("layers",))
    for r in rows:
        if r["forward"] == "sequential":
            continue
        t = times.get(r["forward"])
        for sc in ("measured", "flex"):
            f = flops_of(r, sc)
            ta = f / ach
            tb = floor_ms(r["heavy"], sc, peak, bw)
            prefix = (t_seq - head) * flops_of(r, "measured", ("layers",)) / f_layers
            stack_floor = floor_ms(r["heavy"], sc, peak, bw, ("stack",))
            tc = head + prefix + stack_floor
            budget = t_seq / target - head - prefix
            f_stack = flops_of(r, sc, ("stack",))
            need = f"{f_stack / budget:.0f} ({100 * f_stack / budget / peak:.0f} %)" if budget > 0 else "impossible"
            timed = t is not None and sc == "measured"
            meas = f"{t:g}" if timed else "-"
            achieved = f"{f / t:.0f}" if timed else "-"
            derived = f"{t - head - prefix:.2f} / {f_stack / (t - head - prefix):.0f}" if timed else "-"
            out.append(f"| {r['forward']} | {sc} | {meas} | {achieved} | {f:.1f} | {ta:.2f} / {t_seq / ta:.2f}x | "
                       f"{tb:.2f} / {t_seq / tb:.2f}x | {tc:.2f} / {t_seq / tc:.2f}x | {f_stack:.1f} | {derived} | "
                       f"{budget:.2f} | {need} |")
    return out


def sweep_report(calib: list[dict], points: list[list[dict]], depth: int, times: dict, lat_layer: float,
                 lat_iter: float, peak: float, bw: float) -> list[str]:
    """PREDICTED times at other (tokens, batch) from a latency + throughput model calibrated on the measured times
    at the counted point (`calib`): each sequential layer costs `lat_layer` us plus its FLOPs at a rate R_layers,
    each solver iteration `lat_iter` us plus its stack FLOPs at a rate R_stack (one per plan), the head its roofline
    floor; R_layers and R_stack are what the measured times leave after the latencies. Attention FLOPs as timed
    (scenario "measured"). At the calibration point it returns the measured times by construction."""
    calib = [r for r in calib if r["side"] == "snlp"]
    seq = next(r for r in calib if r["forward"] == "sequential")
    head = floor_ms(seq["heavy"], "measured", peak, bw, ("head",))
    f_layers = flops_of(seq, "measured", ("layers",))
    left = times["sequential"] - head - depth * lat_layer / 1e3
    if left <= 0:
        raise ValueError(f"--sweep: the measured sequential {times['sequential']:g} ms is at or under the model's "
                         f"latency alone ({depth} x {lat_layer:g} us + the head's floor {head:.3f} ms): lower "
                         f"--latency-us or calibrate at a larger T")
    r_layers = f_layers / left
    rate = {}
    for r in calib:
        t = times.get(r["forward"])
        if r["forward"] == "sequential" or t is None:
            continue
        plan = Plan.parse(r["forward"])
        n_pre = depth - plan.chunks * plan.fuse
        pre = n_pre * lat_layer / 1e3 + flops_of(r, "measured", ("layers",)) / r_layers
        left = t - head - pre - plan.iters * lat_iter / 1e3
        if left <= 0:
            raise ValueError(f"--sweep: the measured {r['forward']} {t:g} ms is at or under the model's latency and "
                             f"prefix alone ({t - left:.3f} ms): lower --latency-us or calibrate at a larger T")
        rate[r["forward"]] = flops_of(r, "measured", ("stack",)) / left
    out = [f"\n# PREDICTED (model, not measured): {lat_layer:g} us per sequential layer and {lat_iter:g} us per "
           f"iteration of latency, the rest at the rates the measured times imply at T = {seq['tokens']}, batch "
           f"{seq['batch']}: layers {r_layers:.0f} TFLOP/s, stacks " +
           ", ".join(f"{k} {v:.0f}" for k, v in rate.items()) + " TFLOP/s",
           "| T | batch | sequential ms | " + " | ".join(f"{k} ms / x" for k in rate) + " |",
           "|---" * (3 + len(rate)) + "|"]
    for rows in points:
        s = next(r for r in rows if r["forward"] == "sequential")
        hd = floor_ms(s["heavy"], "measured", peak, bw, ("head",))
        t_seq = hd + depth * lat_layer / 1e3 + flops_of(s, "measured", ("layers",)) / r_layers
        cells = []
        for name, rs in rate.items():
            r = next(x for x in rows if x["forward"] == name)
            plan = Plan.parse(name)
            n_pre = depth - plan.chunks * plan.fuse
            t = hd + n_pre * lat_layer / 1e3 + flops_of(r, "measured", ("layers",)) / r_layers + \
                plan.iters * lat_iter / 1e3 + flops_of(r, "measured", ("stack",)) / rs
            cells.append(f"{t:.3f} / {t_seq / t:.2f}x")
        out.append(f"| {s['tokens']} | {s['batch']} | {t_seq:.3f} | " + " | ".join(cells) + " |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="0.5B-nox0ve,0.5B,0.5B-mhc,3B")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--regions", action="store_true", help="split kernels by the snlp function that issued them")
    p.add_argument("--extra-iter", action="store_true", help="also count each plan at K + 1 (the cost of an iteration)")
    p.add_argument("--json", help="write every count here")
    p.add_argument("--batch", type=int, default=1, help="sequences per forward")
    p.add_argument("--paper", metavar="PATH", help="also count the paper's own code (a checkout of nanochat-snlp) "
                   "for the same shapes and plans, on meta")
    p.add_argument("--plans", help="comma-separated plans instead of each shape's suite plans")
    p.add_argument("--bound", action="store_true", help="also print GEMM / attention FLOPs per CUDA kernel model, "
                   "weight and GEMM bytes, and roofline floors")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for --bound (H200 SXM: 989)")
    p.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth for --bound, TB/s (H200: 4.8)")
    p.add_argument("--times", help="with --bound and one shape: measured ms per forward, e.g. "
                   "sequential=5.24,12xF2-h0-K1=3.96: achieved TFLOP/s and each plan's best time")
    p.add_argument("--target", type=float, default=2.0, help="speedup whose stack budget --times prints")
    p.add_argument("--sweep", help="with --times: PREDICTED times at other points, e.g. 256:1,512:1,2048:8 "
                   "(tokens:batch), from a model calibrated on the measured times (see sweep_report)")
    p.add_argument("--latency-us", default="30,35", help="--sweep's latency per sequential layer and per "
                   "solver iteration, in us (an assumption: compiled kernels per layer x the time per kernel)")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    torch.autocast = _Autocast  # the models run on meta (see _Autocast)
    rows = []
    cols = ("kernels", "tiny", "out_mb", "mask_built_mb", "copy_mb", "sdpa_causal", "sdpa_masked", "mask_mb", "gflop")
    head = ("| shape | forward | kernels | tiny | MB out | mask MB built | copy MB | sdpa causal | sdpa masked | "
            "mask MB read | GFLOP |")
    times = {}
    for item in (a.times or "").split(","):
        if item.strip():
            name, _, ms = item.partition("=")
            try:
                times[name.strip()] = float(ms)
            except ValueError:
                p.error(f"--times: {item!r} is not NAME=MS")
    if times and (not a.bound or len(a.shapes.split(",")) != 1):
        p.error("--times needs --bound and exactly one shape")
    keys = [k.strip() for k in a.shapes.split(",") if k.strip()]
    bad = [k for k in keys if k not in {s.key for s in PAPER_SHAPES}]
    if bad or not keys:
        p.error(f"--shapes: unknown {', '.join(bad) or '(none given)'}; valid: {', '.join(s.key for s in PAPER_SHAPES)}")
    for x in (a.plans or "").split(","):
        if x.strip():
            try:
                Plan.parse(x.strip())
            except ValueError as e:
                p.error(f"--plans: {e}")
    if times:
        shape0 = next((s for s in PAPER_SHAPES if s.key == a.shapes.split(",")[0]), None)
        known = {"sequential"} | set(x.strip() for x in a.plans.split(",")) if a.plans else \
            {"sequential"} | set(shape0.plans if shape0 else ())
        if a.extra_iter:
            known |= {str(replace(Plan.parse(x), iters=Plan.parse(x).iters + 1)) for x in known - {"sequential"}}
        bad = [n for n in times if n not in known]
        if bad:
            p.error(f"--times names forwards that are not counted: {', '.join(bad)} (counted: {', '.join(sorted(known))})")
    if min(a.peak_tflops, a.hbm_tbs, a.target) <= 0:
        p.error("--peak-tflops, --hbm-tbs and --target must be > 0")
    if a.sweep and not times:
        p.error("--sweep needs --times (the measured point it is calibrated on)")
    for item in (a.sweep or "").split(","):
        if item.strip() and not re.fullmatch(r"\s*[1-9][0-9]*(:[1-9][0-9]*)?\s*", item):
            p.error(f"--sweep: {item!r} is not TOKENS[:BATCH]")
    if not re.fullmatch(r"[0-9.]+(,[0-9.]+)?", a.latency_us):
        p.error(f"--latency-us must be US or US,US, got {a.latency_us!r}")
    if a.batch < 1:
        p.error(f"--batch must be >= 1, got {a.batch}")
    paper = None
    if a.paper:
        from snlp.bench.paper_peer import load_paper_code
        try:
            paper = load_paper_code(a.paper, dtype)
        except ValueError as e:
            p.error(str(e))
    print(f"# one eager prefill forward, batch {a.batch}, T = {a.tokens}, {a.dtype}, meta device (counts, not times)")
    print(head)
    print("|---" * 11 + "|")
    for key in a.shapes.split(","):
        shape = next(s for s in PAPER_SHAPES if s.key == key)
        suite = [x.strip() for x in a.plans.split(",")] if a.plans else list(shape.plans)
        plans = list(suite)
        if a.extra_iter:
            plans += [str(replace(Plan.parse(s), iters=Plan.parse(s).iters + 1)) for s in suite]
        counted = count_forwards(shape, a.tokens, a.batch, dtype, plans, a.regions)
        if paper is not None:
            counted += count_paper(paper, shape, a.tokens, a.batch, plans, a.regions)
        for r in counted:
            rows.append(r)
            print(f"| {key} | {label(r)} | " + " | ".join(
                f"{r[c]:.0f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    if a.extra_iter:  # one more iteration = the plan at K + 1 minus the plan at K
        print("\n# one more iteration (the plan at K + 1 minus the plan at K)")
        print(head.replace("forward", "plan"))
        print("|---" * 11 + "|")
        by = {(r["shape"], r["side"], r["forward"]): r for r in rows}
        for r in rows:
            if r["forward"] == "sequential":
                continue
            plan = Plan.parse(r["forward"])
            nxt = by.get((r["shape"], r["side"], str(replace(plan, iters=plan.iters + 1))))
            if nxt is None or plan.iters + 1 != Plan.parse(nxt["forward"]).iters or r["forward"] not in \
                    (a.plans.split(",") if a.plans else next(s for s in PAPER_SHAPES if s.key == r["shape"]).plans):
                continue
            print(f"| {r['shape']} | {label(r)} -> K+1 | " + " | ".join(
                f"{nxt[c] - r[c]:.0f}" for c in cols) + " |")
    if a.bound:
        print("\n".join(bound_report(rows, a.peak_tflops, a.hbm_tbs, times, a.target)))
    if a.sweep:
        shape = next(s for s in PAPER_SHAPES if s.key == a.shapes.split(",")[0])
        lat = [float(x) for x in a.latency_us.split(",")]
        try:  # the calibration alone (no points) first: a model the measured times cannot fit is refused before work
            sweep_report(rows, [], shape.depth, times, lat[0], lat[-1], a.peak_tflops, a.hbm_tbs)
        except ValueError as e:
            print(f"prefill_ops.py: error: {e}", file=sys.stderr)
            return 2
        pts = []
        for item in a.sweep.split(","):
            t, _, b = item.partition(":")
            pts.append(count_forwards(shape, int(t), int(b or 1), dtype, [x for x in times if x != "sequential"]))
        print("\n".join(sweep_report(rows, pts, shape.depth, times, lat[0], lat[-1], a.peak_tflops, a.hbm_tbs)))
    if a.regions:
        for r in rows:
            print(f"\n{r['shape']} {label(r)}: kernels by region: " +
                  ", ".join(f"{k} {v}" for k, v in r["regions"].items()))
            print(f"  masks: {r['masks'] or '-'}")
            print("  top ops: " + ", ".join(f"{k} {v}" for k, v in list(r["ops"].items())[:14]))
            print("  MB written by region: " + ", ".join(f"{k} {v}" for k, v in r["mb_region"].items() if v))
            print("  MB written by op: " + ", ".join(f"{k} {v}" for k, v in list(r["mb_op"].items())[:14]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(tokens=a.tokens, dtype=a.dtype, torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

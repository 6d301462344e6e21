"""Count what one eager prefill forward launches, for the sequential forward and every plan of the paper's suite.

    PYTHONPATH=$PWD python3 scripts/prefill_ops.py [--shapes 0.5B-nox0ve,0.5B,0.5B-mhc,3B] [--tokens 2048]
                                                   [--dtype bfloat16] [--regions] [--extra-iter] [--json FILE]

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
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import sys
from dataclasses import replace

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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.quiet or _is_view(func) or func in NO_KERNEL:
            return out
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
        if name == "_to_copy" and any(t.dtype in (torch.bfloat16, torch.float16) for t in _tensors(args[:1])) \
                and any(t.dtype == torch.float32 for t in _tensors(out)):
            self.f32 += nbytes
        r = _region()
        self.by_region[r] += 1
        self.mb_region[r] += nbytes / 2**20
        self.mb_op[name] += nbytes / 2**20
        return out


class Attn(TorchFunctionMode):
    """Every scaled_dot_product_attention call: causal / masked, and the mask bytes."""

    def __init__(self, counter: Count):
        super().__init__()
        self.c = counter
        self.causal = self.masked = self.plain = 0
        self.mask_bytes = 0
        self.masks = collections.Counter()

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
        self.c.ops["sdpa"] += 1
        self.c.kernels += 1
        self.c.by_region["sdpa kernel"] += 1
        self.c.quiet += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.c.quiet -= 1


def measure(fn, regions: bool = False) -> dict:
    c = Count(regions)
    a = Attn(c)
    flops = FlopCounterMode(display=False)
    with torch.no_grad(), flops, a, c:  # no_grad, not inference_mode: composite ops (linear, rms_norm, matmul) then
        #                                 reach the counter decomposed into the aten kernels they run
        fn()
    return dict(kernels=c.kernels, tiny=c.tiny, out_mb=c.out / 2**20, mask_built_mb=c.mb_region["attention mask"],
                copy_mb=c.copy / 2**20, f32_mb=c.f32 / 2**20,
                sdpa_causal=a.causal, sdpa_masked=a.masked, sdpa_plain=a.plain, mask_mb=a.mask_bytes / 2**20,
                masks=dict((f"{s}:{d}", n) for (s, d), n in a.masks.items()),
                gflop=flops.get_total_flops() / 1e9, ops=dict(c.ops.most_common()),
                regions=dict(c.by_region.most_common()),
                mb_region={k: round(v) for k, v in c.mb_region.most_common()},
                mb_op={k: round(v) for k, v in c.mb_op.most_common()})


class _Autocast(torch.autocast):
    """torch.autocast("meta") is refused by torch; snlp only ever disables autocast, which the CPU one does too."""

    def __init__(self, device_type, *args, **kwargs):
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


def build(shape, tokens: int, dtype) -> GPT:
    cfg = shape.config(32768, "SSSL", 512, max(2048, tokens))
    with torch.device("meta"):
        model = GPT(cfg)
    return model.to(dtype=dtype).eval()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="0.5B-nox0ve,0.5B,0.5B-mhc,3B")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--regions", action="store_true", help="split kernels by the snlp function that issued them")
    p.add_argument("--extra-iter", action="store_true", help="also count each plan at K + 1 (the cost of an iteration)")
    p.add_argument("--json", help="write every count here")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    torch.autocast = _Autocast  # the models run on meta (see _Autocast)
    rows = []
    cols = ("kernels", "tiny", "out_mb", "mask_built_mb", "copy_mb", "sdpa_causal", "sdpa_masked", "mask_mb", "gflop")
    head = ("| shape | forward | kernels | tiny | MB out | mask MB built | copy MB | sdpa causal | sdpa masked | "
            "mask MB read | GFLOP |")
    print(f"# one eager prefill forward, batch 1, T = {a.tokens}, {a.dtype}, meta device (counts, not times)")
    print(head)
    print("|---" * 11 + "|")
    for key in a.shapes.split(","):
        shape = next(s for s in PAPER_SHAPES if s.key == key)
        model = build(shape, a.tokens, dtype)
        idx = torch.zeros(1, a.tokens, dtype=torch.long, device="meta")
        fwds = {"sequential": lambda: model(idx)}
        plans = list(shape.plans)
        if a.extra_iter:
            plans += [str(replace(Plan.parse(s), iters=Plan.parse(s).iters + 1)) for s in shape.plans]
        for s in plans:
            runner = bind(model, s, check_finite=False)
            fwds[s] = (lambda r: lambda: r(idx))(runner)
        for name, fn in fwds.items():
            r = measure(fn, a.regions)
            rows.append(dict(shape=key, forward=name, **r))
            print(f"| {key} | {name} | " + " | ".join(
                f"{r[c]:.0f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    if a.extra_iter:  # one more iteration = the plan at K + 1 minus the plan at K
        print(f"\n# one more iteration (the plan at K + 1 minus the plan at K)")
        print(head.replace("forward", "plan"))
        print("|---" * 11 + "|")
        by = {(r["shape"], r["forward"]): r for r in rows}
        for r in rows:
            if r["forward"] == "sequential" or (r["shape"], r["forward"]) not in by:
                continue
            plan = Plan.parse(r["forward"])
            nxt = by.get((r["shape"], str(replace(plan, iters=plan.iters + 1))))
            if nxt is None or plan.iters + 1 != Plan.parse(nxt["forward"]).iters or r["forward"] not in \
                    next(s for s in PAPER_SHAPES if s.key == r["shape"]).plans:
                continue
            print(f"| {r['shape']} | {r['forward']} -> K+1 | " + " | ".join(
                f"{nxt[c] - r[c]:.0f}" for c in cols) + " |")
    if a.regions:
        for r in rows:
            print(f"\n{r['shape']} {r['forward']}: kernels by region: " +
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

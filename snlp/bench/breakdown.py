"""Where an SNLP forward's time goes, next to the sequential forward it replaces.

The structural ideal of a plan charges the batched suffix one layer per iteration,

    ideal = t_seq / (t_fixed + (S + K * evals) * t_layer),      t_fixed = embed + head,

which holds where a layer's cost is per-op dispatch (a GPU at batch 1, or tiny CPU models). The batched
suffix is C*M layers' weights in C*M-times wider matmuls, though, and at batch 1 / T = 1 on a CPU those
matmuls are GEMVs bound by how fast the weights stream from cache or memory: the suffix costs one layer's
dispatch PLUS C*M layers' weight traffic. `forward_breakdown` measures the pieces side by side in one
process (round-robin, medians) and reports, besides the measured and the structural ideal speedups,

    suffix_ideal = t_seq / (t_fixed + S * t_layer + K * evals * t_suffix)

with t_suffix the measured batched chunk evaluation: what the plan would reach if everything but the suffix
evaluation were free of overhead. structural_ideal - suffix_ideal is the price of the suffix's weight
traffic (and its C-times larger activations); suffix_ideal - measured is every other cost of the SNLP
forward (solver loop, correction, input stacking, host syncs). `suffix_matmul_ms` (the batched matmuls
alone) and `suffix_weight_bytes` give the achieved weight bandwidth. aten op and host-sync counts per
forward come from torch.profiler. Timings only: nothing here is asserted by tests (docs/records/2026-11-22-bench-cpu.md,
"Where the CPU time goes").
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor

from snlp.method.fusion import chunk_forward
from snlp.model.gpt import GPT
from snlp.method.plan import Plan
from snlp.method.solver import bind
from snlp.decode.steps import SYNC_OP
from snlp.runtime.timing import round_order, sync


def count_ops(fn, calls: int = 1) -> dict[str, int]:
    """aten ops per call of `fn` (all nesting levels, as torch.profiler counts them): {op name: count}, averaged
    over `calls` profiled calls (after one unprofiled warm-up call) and rounded."""
    from torch.profiler import ProfilerActivity, profile

    if not isinstance(calls, int) or calls < 1:
        raise ValueError(f"calls must be an integer >= 1 (got {calls!r})")
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    return {e.key: round(e.count / calls) for e in prof.key_averages() if e.key.startswith("aten::")}


@dataclass
class ForwardBreakdown:
    """One plan's forward taken apart (times in ms, medians over round-robin runs)."""

    plan: str
    prefix_layers: int  # S
    chunks: int  # C
    fuse: int  # M
    evals: int  # K * batched evaluations per iteration
    seq_ms: float  # sequential forward
    snlp_ms: float  # SNLP forward (bound plan, no finiteness check)
    embed_ms: float
    head_ms: float
    layer_ms: float  # mean sequential layer: (all L layers) / L
    suffix_ms: float  # one batched evaluation of the C fused chunks (chunk_forward) as a solve's first evaluation runs
    #                   it: the forward's attention masks and value-embedding gathers built in it
    suffix_again_ms: float  # the same evaluation with those reused, as each later iteration of a solve runs it
    suffix_matmul_ms: float  # ... of which its batched matmuls
    suffix_weight_bytes: int  # the fused chunks' matmul weights (read once per evaluation)
    seq_ops: int  # aten ops per forward (torch.profiler, all nesting levels)
    snlp_ops: int
    seq_syncs: int  # aten::_local_scalar_dense per forward (host syncs: .item(), int(), bool() of a tensor)
    snlp_syncs: int
    device: str = "cpu"
    threads: int = 1

    @property
    def fixed_ms(self) -> float:
        return self.embed_ms + self.head_ms

    @property
    def measured_speedup(self) -> float:
        return self.seq_ms / self.snlp_ms

    @property
    def structural_ideal(self) -> float:
        """t_seq / (t_fixed + (S + evals) t_layer): the batched suffix charged one layer per evaluation."""
        return self.seq_ms / (self.fixed_ms + (self.prefix_layers + self.evals) * self.layer_ms)

    @property
    def suffix_ideal(self) -> float:
        """t_seq / (t_fixed + S t_layer + t_suffix + (evals - 1) t_suffix_again): the batched suffix charged what it
        measurably costs, its first evaluation with the per-forward masks and gathers, the later ones without."""
        suffix = self.suffix_ms + max(self.evals - 1, 0) * self.suffix_again_ms
        return self.seq_ms / (self.fixed_ms + self.prefix_layers * self.layer_ms + suffix)

    @property
    def suffix_layers(self) -> float:
        """The batched suffix evaluation in sequential-layer equivalents (the structural ideal assumes 1)."""
        return self.suffix_ms / self.layer_ms

    @property
    def weight_gb_per_s(self) -> float:
        """Weight bandwidth the suffix's batched matmuls achieve."""
        return self.suffix_weight_bytes / (self.suffix_matmul_ms * 1e6) if self.suffix_matmul_ms > 0 else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("fixed_ms", "measured_speedup", "structural_ideal", "suffix_ideal", "suffix_layers",
                  "weight_gb_per_s"):
            d[k] = getattr(self, k)
        d["fraction_of_structural_ideal"] = self.measured_speedup / self.structural_ideal
        return d


class _MatmulClock:
    """Accumulates the wall time of torch.bmm / torch.baddbmm calls while active (the fused chunk's
    matmuls; chunk_forward calls them through the torch namespace)."""

    def __init__(self, device):
        self.device, self.total, self.saved = device, 0.0, None

    def _wrap(self, fn):
        def timed(*a, **k):
            sync(self.device)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync(self.device)
            self.total += time.perf_counter() - t0
            return out
        return timed

    def __enter__(self):
        self.saved = torch.bmm, torch.baddbmm
        torch.bmm, torch.baddbmm = self._wrap(self.saved[0]), self._wrap(self.saved[1])
        return self

    def __exit__(self, *exc):
        torch.bmm, torch.baddbmm = self.saved


def forward_breakdown(model: GPT, plan: Plan | str, batch: int = 1, seq_len: int = 1, runs: int = 50,
                      warmup: int = 5, seed: int = 0) -> ForwardBreakdown:
    """Time the sequential forward, the SNLP forward of `plan` and their pieces on random token ids
    (batch, seq_len), round-robin after `warmup` untimed rounds, medians of `runs` (module docstring).
    Each round runs the whole model once before the pieces, so every piece reads its weights from where
    a real forward would find them (not from a cache it just warmed)."""
    for name, v in (("batch", batch), ("seq_len", seq_len), ("runs", runs)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1 (got {v!r})")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0 (got {warmup!r})")
    runner = bind(model, plan, check_finite=False)
    plan, w = runner.plan, runner.weights
    if getattr(w, "hc", None) is not None:
        raise ValueError("forward_breakdown supports plain residual models (mHC chunks have per-branch weights)")
    L, dev = model.config.n_layer, model.wte.weight.device
    S, C = plan.prefix_len(L), plan.chunks
    evals = plan.iters * plan.evals_per_iter + int(plan.init == "fwd")
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen).to(dev)
    clock = _MatmulClock(dev)
    times: dict[str, list[float]] = {k: [] for k in ("seq", "snlp", "embed", "layers", "head", "suffix", "matmul",
                                                      "suffix_again")}
    with torch.inference_mode():
        ctx = model.embed(idx)
        hS = model.run_layers(ctx.x0, ctx, 0, S)
        inputs = hS.expand(C, *hS.shape)

        def timed(key: str, fn) -> Tensor:
            sync(dev)
            t0 = time.perf_counter()
            out = fn()
            sync(dev)
            times[key].append((time.perf_counter() - t0) * 1e3)
            return out

        for r in range(warmup + runs):
            for k in round_order(("seq", "snlp"), r):  # the pair whose ratio is read: neither always first
                timed(k, (lambda: model(idx)) if k == "seq" else (lambda: runner(idx)))
            c = timed("embed", lambda: model.embed(idx))
            h = timed("layers", lambda: model.run_layers(c.x0, c, 0, L))
            timed("head", lambda: model.head(h))
            clock.total = 0.0
            with clock:  # on a Context fresh for the call: the masks and value-embedding gathers a solve builds for
                # its first evaluation are paid here too (a K = 1 solve pays them once per forward)
                timed("suffix", lambda: chunk_forward(w, inputs, replace(ctx, extra={})))
            times["matmul"].append(clock.total * 1e3)
            timed("suffix_again", lambda: chunk_forward(w, inputs, ctx))  # what each later iteration pays
            if r < warmup:
                for v in times.values():
                    v.pop()
        seq_ops = count_ops(lambda: model(idx))
        snlp_ops = count_ops(lambda: runner(idx))
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = sum(t.numel() * t.element_size() for t in (w.qkv, w.attn_out, w.fc, w.proj))
    if w.ve_gate is not None:
        nbytes += w.ve_gate.numel() * w.ve_gate.element_size()
    return ForwardBreakdown(
        plan=str(plan), prefix_layers=S, chunks=C, fuse=plan.fuse, evals=evals, seq_ms=med["seq"],
        snlp_ms=med["snlp"], embed_ms=med["embed"], head_ms=med["head"], layer_ms=med["layers"] / L,
        suffix_ms=med["suffix"], suffix_again_ms=med["suffix_again"], suffix_matmul_ms=med["matmul"], suffix_weight_bytes=nbytes,
        seq_ops=sum(seq_ops.values()), snlp_ops=sum(snlp_ops.values()),
        seq_syncs=seq_ops.get(SYNC_OP, 0), snlp_syncs=snlp_ops.get(SYNC_OP, 0),
        device=str(dev), threads=torch.get_num_threads())

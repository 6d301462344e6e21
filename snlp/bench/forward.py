"""The teacher-forced forward (prefill) benchmark: SNLP plans against the sequential forward, side by side.

Teacher-forced forward over T tokens at batch B. Every callable is warmed up, then timed round-robin
(one call of each per round, so drift hits all alike); each `ForwardRow` holds the median, the speedup
over sequential, the op-count ideal L / (S + K*evals + [fwd init]) and the structural ideal (fixed costs
measured), so the gap is visible; `iters` is the iterations each plan ran (fewer than K when its `tol`
stopped it). Each row keeps its per-round times; the speedup carries the sign test's verdict over the paired
rounds (snlp.bench.stats.paired_verdict: a speedup they do not resolve is a tie, printed "(tie)"). The `snlp bench`
command (snlp.apps.bench) drives it.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch

from snlp.bench.stats import paired_fields
from snlp.decode.steps import check_compilable, compile_fullgraph, mark_static_runner
from snlp.method.plan import Plan
from snlp.method.solver import bind
from snlp.model.gpt import GPT, GPTConfig, eval_mode
from snlp.runtime.timing import now, time_round_robin


@dataclass(frozen=True)
class ModelSpec:
    """The benchmarked model: random weights of this shape (GPTConfig.from_depth), or a checkpoint."""

    depth: int = 16  # number of layers (the size dial)
    width: int | None = None  # None: depth * aspect_ratio
    aspect_ratio: int = 64
    head_dim: int = 128
    kv_heads: int | None = None  # GQA; None: = heads
    vocab_size: int = 32768
    window_pattern: str = "L"
    x0_residual: bool | None = None  # None: the model's default (on, off with mHC)
    value_embeds: bool = True
    hc_streams: int = 0  # mHC residual streams (0 = plain residual)
    hc_dynamic: bool = True
    ckpt: str | None = None  # a checkpoint directory instead of random weights (the shape fields are ignored)
    seed: int = 0


def spec_config(spec: ModelSpec) -> GPTConfig:
    """The GPTConfig of `spec`'s random-weight model (`build_model` without a checkpoint), no weights built: what a
    plan needs of the model (Plan.check_model) is checked on it before any work."""
    return GPTConfig.from_depth(spec.depth, aspect_ratio=spec.aspect_ratio, head_dim=spec.head_dim,
                                width=spec.width, n_kv_head=spec.kv_heads, vocab_size=spec.vocab_size,
                                window_pattern=spec.window_pattern, x0_residual=spec.x0_residual,
                                value_embeds=spec.value_embeds, hc_streams=spec.hc_streams,
                                hc_dynamic=spec.hc_dynamic)


def build_model(spec: ModelSpec) -> GPT:
    """Random-weight model of `spec`'s shape (seeded), or `spec.ckpt` loaded on the CPU."""
    if spec.ckpt:
        from snlp.io.checkpoint import load  # the checkpoint format belongs to the io floor

        return load(spec.ckpt, device="cpu")[0]
    cfg = spec_config(spec)
    torch.manual_seed(spec.seed)
    model = GPT(cfg)
    model.init_weights(seed=spec.seed)
    return model


@dataclass
class ForwardRow:
    """One row of the forward benchmark (the sequential forward or one plan); times in ms."""

    plan: str  # "sequential" or the plan's text
    median_ms: float
    speedup: float  # sequential median / this median
    ideal_layer_speedup: float  # op-count ideal L / critical_path_layers (fixed costs ignored)
    iters: int | None  # iterations the plan ran (< K when its tol stopped it); None for sequential
    critical_path_layers: int  # Plan.critical_path_layers at `iters`; L for sequential
    embed_ms: float  # the fixed costs both sides pay once, measured in the same round-robin
    head_ms: float
    fixed_ms: float  # embed + head, at most t_seq (noise can time them above the forward: structural_ideal)
    layer_ms: float  # (t_seq - fixed) / L
    structural_ideal: float  # t_seq / (fixed + critical_path_layers * layer_ms)
    of_structural: float  # speedup / structural_ideal
    min_ms: float
    max_ms: float
    runs: int
    tokens: int
    batch: int
    n_layer: int
    prefix: int  # S, the sequential prefix (L for sequential)
    device: str
    dtype: str
    compiled: bool
    compile_s: float | None  # untimed compile calls of this row's callable (None: eager)
    fixed_compile_s: float | None  # ... of embed + head
    # noise: the round-robin calls every callable once per round, so round i of this row and of sequential pair up
    times_ms: list[float] | None = None  # every timed round's ms, in round order
    speedup_rounds: list[float] | None = None  # per round: sequential ms / this row's ms (None for sequential)
    speedup_verdict: str | None = None  # snlp.bench.stats.paired_verdict of speedup_rounds: faster | slower | tie
    speedup_wins: int | None = None  # rounds this row was faster / slower than sequential in that round
    speedup_losses: int | None = None
    speedup_p: float | None = None  # the two-sided sign test's p

    def to_dict(self) -> dict:
        return asdict(self)


COMPILE_CALLS = 3  # untimed calls that trigger compilation (and, on CUDA, CUDA-graph warm-up and recording)


def compile_step(fn, device):
    """torch.compile a benchmark callable as the decode steps are compiled (steps.compile_fullgraph)."""
    return compile_fullgraph(fn, device)


def _trigger_compile(fns: dict, device) -> dict[str, float]:
    """Call each compiled callable COMPILE_CALLS times, untimed by the benchmark: the seconds this
    takes per callable is its compile time, reported apart from (never inside) the timings."""
    secs = {}
    for name, fn in fns.items():
        t0 = now(device)
        try:
            for _ in range(COMPILE_CALLS):
                fn()
        except torch._dynamo.exc.TorchDynamoException as e:  # e.g. a graph break under fullgraph=True
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{name} does not compile as one graph (torch.compile fullgraph=True): {first}") from e
        secs[name] = now(device) - t0
    return secs


def structural_ideal(t_seq: float, t_fixed: float, n_layer: int, steps: int) -> tuple[float, float]:
    """(t_layer, ideal): with the sequential forward t_seq = t_fixed + L * t_layer (t_fixed = what both
    sides pay once: embedding and head), a plan evaluating `steps` layers on its critical path
    (Plan.critical_path_layers) ideally takes t_fixed + steps * t_layer, so its structural ideal is
    t_seq / (t_fixed + steps * t_layer). It lies between 1 and the op-count ideal L / steps: the
    fixed costs pull it towards 1. Noise can make the separately timed t_fixed exceed t_seq (a tiny model on a
    loaded host); the split then takes t_fixed = t_seq and t_layer = 0, so the sequential forward's own ideal stays
    1 (it was t_seq / t_fixed < 1) and every plan's is 1."""
    t_fixed = min(t_fixed, t_seq)
    t_layer = (t_seq - t_fixed) / n_layer
    # t_fixed + steps t_layer, written as t_seq less the layers the plan skips: exactly t_seq when steps = L, so the
    # sequential forward's own ideal is 1.0 with no rounding either way
    denom = t_seq - (n_layer - max(steps, 1)) * t_layer
    return t_layer, (t_seq / denom if denom > 0 else 1.0)


def context_tensors(ctx) -> tuple[torch.Tensor, ...]:
    """Every tensor an embedding Context (snlp.model.gpt.Context) holds, named field by field: dynamo before torch
    2.13 cannot trace `vars()` of a dataclass under fullgraph (seen on torch 2.11 + CUDA: the compiled `_embed` of
    `snlp selfcheck` failed with "Unsupported method call")."""
    return tuple(t for t in (ctx.x0, ctx.ve, ctx.cos, ctx.sin) if t is not None)


def benchmark(model: GPT, plans: list[Plan], tokens: int = 1, batch: int = 1, warmup: int = 5, runs: int = 30,
              compile: bool = False, seed: int = 0) -> list[ForwardRow]:
    """Time the sequential forward and each plan; returns one row each (sequential first).

    Besides the rows, the fixed costs both sides pay once per forward are timed in the same
    round-robin with the same treatment: the embedding (`model.embed`: token embedding, value
    embeddings, RoPE tables) and the head (`model.head`: final norm, lm_head, softcap). Each row
    carries them (`embed_ms`, `head_ms`, `fixed_ms`), the per-layer time of the sequential forward
    `layer_ms` = (t_seq - fixed) / L, the `structural_ideal` = t_seq / (fixed + steps * layer_ms)
    (steps = Plan.critical_path_layers at the iterations actually run) and `of_structural` = speedup /
    structural_ideal: how much of what the plan allows on this device the implementation achieves.
    `ideal_layer_speedup` is the op-count ideal L / steps (fixed costs ignored).

    With `compile` every callable (rows, embed, head) is compiled by `compile_step` (fullgraph; on
    CUDA reduce-overhead); the calls that trigger compilation run before the warm-up and are
    reported as `compile_s` (`fixed_compile_s` for embed + head), never inside the timings. A
    callable that does not compile as one graph is a ValueError naming it."""
    L = model.config.n_layer
    for plan in plans:
        plan.check(L)
    if compile:
        for plan in plans:
            check_compilable(plan)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=gen).to(device)
    with eval_mode(model):  # a caller's model leaves with every submodule in the mode it came in
        fwd = {"sequential": lambda: model(idx)}
        # bound runners: fused weights built once here, so neither the timed call nor a compiled graph rebuilds them
        runners = {str(plan): bind(model, plan, check_finite=False) for plan in plans}
        for name, runner in runners.items():
            fwd[name] = (lambda r: lambda: r(idx))(runner)
        iters = {}  # iterations each plan ran (< K when its `tol` stopped it early; same idx every run)
        compile_s: dict[str, float] = {}
        with torch.inference_mode():
            for name, runner in runners.items():  # once with the NaN/inf check, before timing
                iters[name] = runner.solve(idx, check_finite=True).iters
            h_last = model.embed(idx).x0.clone()  # a hidden state of h_L's shape ((B, T, n, D) with mHC) for the head
            # the fixed costs: return every tensor of the Context so a compiled graph cannot drop any of it
            fixed = {"_embed": lambda: context_tensors(model.embed(idx)),
                     "_head": lambda: model.head(h_last)}
            fns = {**fwd, **fixed}
            if compile:  # the plan callables share one code object: allow one compiled graph per plan
                torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(fns) + 1)
                if device.type == "cuda":  # CUDA graphs would copy the fused weights (plain tensors) in every replay
                    for runner in runners.values():
                        mark_static_runner(runner)
                fns = {name: compile_step(fn, device) for name, fn in fns.items()}
                compile_s = _trigger_compile(fns, device)
            times = time_round_robin(fns, warmup, runs, device)
        common = dict(tokens=tokens, batch=batch, n_layer=L, device=str(device),
                      dtype=str(next(model.parameters()).dtype).replace("torch.", ""), compiled=compile,
                      fixed_compile_s=(compile_s["_embed"] + compile_s["_head"]) if compile else None)
        return [_row(name, times, iters.get(name), compile_s.get(name), common) for name in fwd]


def _row(name: str, times: dict[str, list[float]], iters: int | None, compile_s: float | None,
         common: dict) -> ForwardRow:
    """The row of callable `name` from the round-robin times (which hold the sequential and fixed-cost ones)."""
    L = common["n_layer"]
    base = statistics.median(times["sequential"])
    embed_ms, head_ms = statistics.median(times["_embed"]), statistics.median(times["_head"])
    ts = times[name]
    med = statistics.median(ts)
    rounds = None if name == "sequential" else [b / t for b, t in zip(times["sequential"], ts)]
    plan = None if name == "sequential" else Plan.parse(name)
    steps = L if plan is None else plan.critical_path_layers(L, iters)
    fixed = min(embed_ms + head_ms, base)  # what structural_ideal splits off: the record's fields obey its formula
    layer_ms, struct = structural_ideal(base, fixed, L, steps)
    return ForwardRow(
        plan=name, median_ms=med, speedup=base / med,
        ideal_layer_speedup=1.0 if plan is None else plan.ideal_speedup(L, iters), iters=iters,
        critical_path_layers=steps, embed_ms=embed_ms, head_ms=head_ms, fixed_ms=fixed,
        layer_ms=layer_ms, structural_ideal=struct, of_structural=(base / med) / struct,
        min_ms=min(ts), max_ms=max(ts), runs=len(ts), prefix=L if plan is None else plan.prefix_len(L),
        compile_s=compile_s, times_ms=list(ts), **paired_fields("speedup", rounds), **common)

"""The single-layer op benchmark: forward, FD, JVP and VJP of one layer (the DiagN probe primitives).

`snlp bench --ops` (snlp.apps.bench) drives it; paper Table diag_ops_bench.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch

from snlp.bench.stats import paired_marks
from snlp.method.fusion import chunk_weights
from snlp.model.gpt import GPT, eval_mode
from snlp.runtime.timing import time_round_robin

OPS = ("forward", "fd", "jvp", "vjp")
TIMED = (*OPS, "fd_extra")  # fd_extra: what DiagN-FD adds when f(x) is already computed


@dataclass
class OpRow:
    """One token count of the op benchmark: median ms of each op; `ratio(op)` is op / forward."""

    tokens: int
    layer: int
    batch: int
    runs: int
    n_layer: int
    n_embd: int
    device: str
    dtype: str
    forward_ms: float
    fd_ms: float
    jvp_ms: float
    vjp_ms: float
    fd_extra_ms: float
    times_ms: dict[str, list[float]] | None = None  # every timed round's ms per op, in round order (round-robin:
    #                                                 round i of each op pairs with the forward's round i)

    def ms(self, op: str) -> float:
        return getattr(self, f"{op}_ms")

    def ratio(self, op: str) -> float:
        return self.ms(op) / self.forward_ms

    def ratio_rounds(self, op: str) -> list[float] | None:
        """op ms / forward ms of each round (None without per-round times, and for the forward itself)."""
        if op == "forward" or not self.times_ms:
            return None
        return [a / b for a, b in zip(self.times_ms[op], self.times_ms["forward"])]

    def ratio_verdict(self, op: str) -> dict:
        """The sign test over ratio_rounds (paired_verdict on forward / op, its time-ratio convention): "more" or
        "less" (the op costs more / less than the forward), or "tie", with wins (rounds it cost more), losses, p."""
        rounds = self.ratio_rounds(op)
        marks = paired_marks(None if rounds is None else [1.0 / r for r in rounds])
        if marks["verdict"] is None:
            return marks
        return {"verdict": {"faster": "less", "slower": "more", "tie": "tie"}[marks["verdict"]],
                "wins": marks["losses"], "losses": marks["wins"], "p": marks["p"]}

    def to_dict(self) -> dict:
        """The fields plus `{op}_ratio` for every timed op (forward's is 1) and, where the rounds are kept, each ratio's
        sign-test verdict `{op}_ratio_verdict` (more / less / tie), the rounds the op cost more / less than the
        forward (`{op}_ratio_wins` / `{op}_ratio_losses`) and its `{op}_ratio_p`."""
        out = {**asdict(self), **{f"{op}_ratio": self.ratio(op) for op in TIMED}}
        for op in TIMED[1:]:
            v = self.ratio_verdict(op)
            out[f"{op}_ratio_verdict"], out[f"{op}_ratio_p"] = v["verdict"], v["p"]
            out[f"{op}_ratio_wins"], out[f"{op}_ratio_losses"] = v["wins"], v["losses"]
        return out


def op_benchmark(model: GPT, tokens: tuple[int, ...] = (1, 16, 32, 64, 128), layer: int | None = None,
                 warmup: int = 5, runs: int = 30, seed: int = 0, eps: float | None = None) -> list[OpRow]:
    """Per-layer cost of the DiagN probe primitives (paper Table diag_ops_bench) for ONE layer: a
    C = 1, M = 1 chunk at `layer` (default L // 2) via chunk_forward, batch 1, input = the real
    hidden state entering that layer. The timed callables are the solver's own code
    (snlp.method.jacobian.probe_products, one Rademacher probe):
      forward  f(x)
      fd       f(x) AND f(x + s v), then (f(x + s v) - f(x)) / s: two evaluations, like the paper's
               ~2x column. In the solver f(x) is already computed, so DiagN-FD adds only `fd_extra`
               (one evaluation + the difference), also recorded.
      jvp      torch.func.jvp: f(x) and J v in one forward-mode pass (math SDPA: no forward AD for
               the fused kernels)
      vjp      f(x) with autograd, then J^T v by one backward
    Timed under torch.no_grad() (VJP enables grad locally), warm-up + round-robin, medians."""
    from snlp.method.jacobian import chunk_probe_map, probe_products, rademacher

    L = model.config.n_layer
    layer = L // 2 if layer is None else layer
    if not 0 <= layer < L:
        raise ValueError(f"--layer must lie in [0, {L - 1}] for a {L}-layer model (got {layer})")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    with eval_mode(model):  # a caller's model leaves with every submodule in the mode it came in
        rows = []
        for T in tokens:
            idx = torch.randint(0, model.config.vocab_size, (1, T), generator=gen).to(device)
            with torch.no_grad():
                ctx = model.embed(idx)
                x = model.run_layers(ctx.x0, ctx, 0, layer)[None]  # (C=1, B=1, T, ..., D): the layer's real input
                w = chunk_weights(model, layer, 1, 1)
                f = chunk_probe_map(w, ctx)  # probe-stacked (P, C, B, T, ..., D) map, as in the solver
                v = rademacher((1, *x.shape), x, torch.Generator(device).manual_seed(seed))
                fx = f(x[None])[0]
                fns = {"forward": lambda: f(x[None]),
                       "fd": lambda: probe_products(f, x, v, "fd", eps),
                       "jvp": lambda: probe_products(f, x, v, "jvp"),
                       "vjp": lambda: probe_products(f, x, v, "vjp"),
                       "fd_extra": lambda: probe_products(f, x, v, "fd", eps, fx=fx)}
                times = time_round_robin(fns, warmup, runs, device)
            rows.append(OpRow(tokens=T, layer=layer, batch=1, runs=runs, n_layer=L, n_embd=model.config.n_embd,
                              device=str(device), dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
                              **{f"{name}_ms": statistics.median(ts) for name, ts in times.items()},
                              times_ms={name: list(ts) for name, ts in times.items()}))
        return rows

"""Cost model for layer parallelism at scale: per-token latency of sequential, pipeline, tensor-parallel
and SNLP execution over P devices, from per-layer compute times and a stated link model.

Nothing here is measured across devices (this project has no multi-device machine): the compute terms
are measured on ONE device (`measure_layer_head_ms`: one decoder layer and the LM head of the given shape,
batch B, T tokens, once per shape; `measure_chunk_ms`: a rank's batched chunks) or given by a bandwidth roofline
(`roofline_layer_ms`: weight bytes / memory bandwidth, the decode-time bound), and the communication terms come from `Link` (latency alpha and
bandwidth beta). Assumptions (written next to every table in docs/distributed.md):

  state   one message = B*T*D elements of the model dtype (the residual stream; mHC streams ignored).
  link    time(bytes) = alpha + bytes / beta for a point-to-point message; ring all_gather over P ranks
          = (P-1) (alpha + bytes/beta) (bytes per rank); ring all_reduce = 2 (P-1) (alpha + bytes/(P beta));
          tree broadcast = ceil(log2 P) (alpha + bytes/beta). No overlap of compute and communication.
  seq     sequential on one device: L t_layer + t_head (if the weights fit one device; the table says).
  pipe    pipeline over P devices, ONE request (decode / a single prefill): every layer still runs in
          turn, plus P-1 boundary sends: L t_layer + (P-1) p2p + t_head. (Pipelining only helps
          throughput with many requests in flight, not one token's latency.)
  tp      tensor parallel over P (Megatron): each layer's matmuls split P ways, t_layer / P (perfect
          split: optimistic), plus 2 all_reduces of the state per layer; head split P ways.
  floor   optional per-op floor (kernel launch overhead) for roofline inputs: an op never takes less.
  snlp    SNLP plan CxFM-init-KK over P ranks (snlp.dist.layer_parallel): the S-layer prefix on rank 0,
          broadcast of h_S (if S > 0), a fwd init costs one local batched chunk forward + one p2p, then
          K iterations of [evals_per_iter local batched forwards of ceil(C/P) chunks + one all_gather
          of the per-rank affine totals (B*T*D; twice that for DiagN) + one boundary p2p (not after the
          last iteration) + with `-tol:` one broadcast of the B per-row updates (the last rank's stop test; all
          K iterations are charged: an earlier stop is not predicted)], then the head on the last rank and a
          broadcast of the token. A batched forward of n fused chunks of M layers costs n*M*t_layer
          (bandwidth-bound: it reads n*M layers' weights) unless `chunk_ms` gives the measured time.
SNLP's output after K < C iterations is an approximation of the fused model (paper); latency is all
this model predicts.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from snlp.method.plan import Plan


@dataclass(frozen=True)
class Link:
    """A device-to-device link: bandwidth in Gbit/s and one-way latency in microseconds."""

    gbps: float
    latency_us: float

    def __post_init__(self):
        if not self.gbps > 0 or not self.latency_us >= 0:
            raise ValueError(f"link bandwidth must be > 0 Gbit/s and latency >= 0 us (got {self.gbps}, {self.latency_us})")

    def p2p_ms(self, nbytes: float) -> float:
        return 1e-3 * self.latency_us + 1e3 * nbytes * 8 / (self.gbps * 1e9)

    def all_gather_ms(self, nbytes_per_rank: float, P: int) -> float:
        return (P - 1) * self.p2p_ms(nbytes_per_rank)

    def all_reduce_ms(self, nbytes: float, P: int) -> float:
        return 2 * (P - 1) * self.p2p_ms(nbytes / P) if P > 1 else 0.0

    def broadcast_ms(self, nbytes: float, P: int) -> float:
        return math.ceil(math.log2(P)) * self.p2p_ms(nbytes) if P > 1 else 0.0


@dataclass(frozen=True)
class Shape:
    """A decoder shape: layers, width, heads, KV heads (GQA), MLP ratio, vocabulary, bytes per weight."""

    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    vocab_size: int = 32768
    mlp_ratio: int = 4
    dtype_bytes: int = 2
    mlp_hidden: int | None = None  # None: mlp_ratio * n_embd
    mlp_mats: int = 2  # 2: relu^2 up + down (nanochat); 3: SwiGLU gate + up + down (Llama)

    @property
    def layer_params(self) -> int:
        D, hd = self.n_embd, self.n_embd // self.n_head
        attn = 2 * D * D + 2 * D * self.n_kv_head * hd  # q, o and the GQA k, v
        return attn + self.mlp_mats * D * (self.mlp_hidden or self.mlp_ratio * D)

    @property
    def weight_bytes(self) -> int:
        return (self.n_layer * self.layer_params + 2 * self.vocab_size * self.n_embd) * self.dtype_bytes

    def config(self, n_layer: int | None = None, sequence_len: int = 16):
        """The GPTConfig of this shape (`n_layer` of them; default all): the layer `measure_layer_ms` times (its MLP
        kind and width, Shape.layer_params), every layer attending fully (the shape has no sliding windows, so a
        -causal plan changes nothing here; Plan.check_model refuses one)."""
        from snlp.model.gpt import GPTConfig

        if self.mlp_mats not in (2, 3):
            raise ValueError(f"mlp_mats must be 2 (relu^2) or 3 (SwiGLU) to build the layer it times (got "
                             f"{self.mlp_mats})")
        return GPTConfig(n_layer=self.n_layer if n_layer is None else n_layer, n_embd=self.n_embd,
                         n_head=self.n_head, n_kv_head=self.n_kv_head, vocab_size=self.vocab_size,
                         mlp_ratio=self.mlp_ratio, sequence_len=sequence_len,
                         mlp_act="swiglu" if self.mlp_mats == 3 else "relu2", ffn_dim=self.mlp_hidden or 0)


@dataclass
class Prediction:
    """Predicted per-token latency (ms) of each strategy and the terms behind the SNLP number."""

    sequential_ms: float
    pipeline_ms: float
    tensor_parallel_ms: float
    snlp_ms: float
    layer_ms: float
    head_ms: float
    chunk_ms: float  # one local batched forward of ceil(C/P) chunks
    comm_snlp_ms: float  # all SNLP communication on the critical path
    comm_tp_ms: float
    fits_one_device_gb: float  # weight GB a single device must hold (sequential)

    def to_dict(self) -> dict:
        return asdict(self)


def check_devices(plan: Plan, devices: int) -> None:
    """A ValueError unless `devices` is an integer >= 1 and the plan has a chunk for every device."""
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be an integer >= 1 (got {devices!r})")
    if plan.chunks < devices:
        raise ValueError(f"plan {plan} has C = {plan.chunks} chunks, fewer than the {devices} devices (every device "
                         f"needs one)")


def predict(shape: Shape, plan: Plan, devices: int, link: Link, layer_ms: float, head_ms: float,
            tokens: int = 1, batch: int = 1, chunk_ms: float | None = None, floor_ms: float = 0.0) -> Prediction:
    """Per-token latency of sequential / pipeline / tensor parallel / SNLP (module docstring). `floor_ms`
    is a per-op floor (kernel launches: no op takes less, however little it reads); measured times
    already contain it, so it is for roofline inputs. It makes one batched op of n chunks cost
    max(floor, n*M*layer_ms) and a tensor-parallel layer max(floor, layer_ms / P)."""
    check_devices(plan, devices)
    plan.check(shape.n_layer)
    L, P = shape.n_layer, devices
    S, C, M = plan.prefix_len(L), plan.chunks, plan.fuse
    msg = batch * tokens * shape.n_embd * shape.dtype_bytes  # one residual-stream state
    n_loc = math.ceil(C / P)
    t_chunk = max(floor_ms, n_loc * M * layer_ms) if chunk_ms is None else chunk_ms
    tp_layer, head_tp = max(floor_ms, layer_ms / P), max(floor_ms, head_ms / P)
    layer_ms, head_ms = max(floor_ms, layer_ms), max(floor_ms, head_ms)
    seq = L * layer_ms + head_ms
    pipe = L * layer_ms + (P - 1) * link.p2p_ms(msg) + head_ms
    comm_tp = L * 2 * link.all_reduce_ms(msg, P)
    tp = L * tp_layer + comm_tp + head_tp
    sur = plan.surrogate
    gather = link.all_gather_ms(msg * sur.gathered_states, P) if sur.gathered_states else 0.0  # the surrogate says
    comm = (link.broadcast_ms(msg, P) if S > 0 else 0.0) + link.broadcast_ms(8 * batch, P)
    compute = S * layer_ms + head_ms
    if plan.init == "fwd":
        compute += t_chunk
        comm += link.p2p_ms(msg) if P > 1 else 0.0
    compute += plan.iters * plan.evals_per_iter * t_chunk
    comm += plan.iters * (gather if P > 1 else 0.0) + max(plan.iters - 1, 0) * (link.p2p_ms(msg) if P > 1 else 0.0)
    if plan.tol:  # the last rank's per-row stop test (B float64 updates) broadcast every iteration it may stop at
        comm += plan.iters * link.broadcast_ms(8 * batch, P)
    return Prediction(sequential_ms=seq, pipeline_ms=pipe, tensor_parallel_ms=tp, snlp_ms=compute + comm,
                      layer_ms=layer_ms, head_ms=head_ms, chunk_ms=t_chunk, comm_snlp_ms=comm, comm_tp_ms=comm_tp,
                      fits_one_device_gb=shape.weight_bytes / 1e9)


def check_roofline(mem_gbytes_per_s: float, efficiency: float, floor_us: float = 0.0) -> None:
    """A ValueError unless the bandwidth is a finite number of GB/s > 0, the efficiency (the fraction of it a step
    reaches) lies in (0, 1] and the per-op floor is a finite number of us >= 0 (0 efficiency divided by zero; a
    negative bandwidth or floor priced negative or floor-less ops)."""
    if not (isinstance(mem_gbytes_per_s, (int, float)) and math.isfinite(mem_gbytes_per_s) and mem_gbytes_per_s > 0):
        raise ValueError(f"--roofline-gbytes must be a finite memory bandwidth > 0 GB/s (got {mem_gbytes_per_s!r})")
    if not (isinstance(efficiency, (int, float)) and 0 < efficiency <= 1):
        raise ValueError(f"--roofline-efficiency is the fraction of --roofline-gbytes a step reaches: it must lie in "
                         f"(0, 1] (got {efficiency!r})")
    if not (isinstance(floor_us, (int, float)) and math.isfinite(floor_us) and floor_us >= 0):
        raise ValueError(f"--op-floor-us must be a finite number of microseconds >= 0 (got {floor_us!r})")


def roofline_layer_ms(shape: Shape, mem_gbytes_per_s: float, efficiency: float = 0.7) -> tuple[float, float]:
    """(layer ms, head ms) of a bandwidth-bound decode step: weight bytes / (bandwidth * efficiency)."""
    check_roofline(mem_gbytes_per_s, efficiency)
    bw = mem_gbytes_per_s * 1e9 * efficiency
    return (1e3 * shape.layer_params * shape.dtype_bytes / bw,
            1e3 * shape.vocab_size * shape.n_embd * shape.dtype_bytes / bw)


def _timer(device: str, warmup: int, runs: int):
    """med(fn): the median of `runs` calls of fn after `warmup` untimed ones, ms (synchronised on CUDA)."""
    cuda = torch.device(device).type == "cuda"

    def med(fn) -> float:
        for _ in range(warmup):
            fn()
        ts = []
        for _ in range(runs):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            ts.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(ts)
    return med


def _timed_model(shape: Shape, depth: int, tokens: int, batch: int, device: str, dtype: torch.dtype):
    """A random-weights model of `depth` of the shape's layers and one (B, T) input's context (embedding)."""
    from snlp.model.gpt import GPT

    # the layer timed is the shape's (its MLP kind and width: Shape.layer_params), not the relu^2 4D default
    cfg = shape.config(depth, sequence_len=max(tokens, 16))
    with torch.device(device):
        model = GPT(cfg)
    model.init_weights(seed=0)
    model = model.to(dtype).eval()
    idx = torch.randint(0, shape.vocab_size, (batch, tokens), device=device)
    return model, model.embed(idx)


def measure_layer_head_ms(shape: Shape, tokens: int = 1, batch: int = 1, device: str = "cpu",
                          dtype: torch.dtype = torch.float32, warmup: int = 3, runs: int = 10) -> tuple[float, float]:
    """Measure on ONE local device, for `shape`: one decoder layer (the fused-chunk op with C = M = 1) and the LM
    head, medians of `runs` calls after `warmup`, ms. They depend on the shape, not on a plan: a run pricing several
    plans measures them once, so the sequential, pipeline and tensor-parallel columns of its rows are one
    measurement, not one per row that differ by the timer's noise."""
    from snlp.method.fusion import build_chunk_weights, chunk_forward

    med = _timer(device, warmup, runs)
    with torch.inference_mode():
        model, ctx = _timed_model(shape, 1, tokens, batch, device, dtype)
        h = ctx.x0
        w1 = build_chunk_weights(model, 0, 1, 1)
        return med(lambda: chunk_forward(w1, h[None], ctx)), med(lambda: model.head(h))


def measure_chunk_ms(shape: Shape, plan: Plan, devices: int, tokens: int = 1, batch: int = 1, device: str = "cpu",
                     dtype: torch.dtype = torch.float32, warmup: int = 3, runs: int = 10,
                     max_chunk_gb: float = 4.0) -> float | None:
    """One batched forward of a rank's ceil(C/P) fused chunks of M layers, measured on ONE local device, ms (median
    of `runs` after `warmup`); None where those layers' weights exceed `max_chunk_gb` (the cost model then prices
    n*M*layer_ms). It depends on the plan only through (ceil(C/P), M)."""
    from snlp.method.fusion import build_chunk_weights, chunk_forward

    n_loc = math.ceil(plan.chunks / devices)
    if n_loc * plan.fuse * shape.layer_params * torch.finfo(dtype).bits // 8 > max_chunk_gb * 1e9:
        return None
    med = _timer(device, warmup, runs)
    with torch.inference_mode():
        model, ctx = _timed_model(shape, n_loc * plan.fuse, tokens, batch, device, dtype)
        h = ctx.x0
        wn = build_chunk_weights(model, 0, n_loc, plan.fuse)
        hn = h.expand(n_loc, *h.shape)
        return med(lambda: chunk_forward(wn, hn, ctx))


def measure_layer_ms(shape: Shape, plan: Plan, devices: int, tokens: int = 1, batch: int = 1, device: str = "cpu",
                     dtype: torch.dtype = torch.float32, warmup: int = 3, runs: int = 10,
                     max_chunk_gb: float = 4.0) -> tuple[float, float, float | None]:
    """(layer ms, head ms, chunk ms or None) for one plan: measure_layer_head_ms and measure_chunk_ms. A run over
    several plans calls those two itself (the layer and head once, a chunk once per (ceil(C/P), M))."""
    layer, head = measure_layer_head_ms(shape, tokens, batch, device, dtype, warmup, runs)
    return layer, head, measure_chunk_ms(shape, plan, devices, tokens, batch, device, dtype, warmup, runs,
                                         max_chunk_gb)


# shapes of docs/distributed.md: the paper's 0.5B and 3B Nanochat models (32 layers; widths 640 / 2048,
# 5 / 16 heads of 128) and a 70B-class Llama-like shape (80 layers, width 8192, 64 heads, GQA 8 KV heads,
# SwiGLU MLP of 28672, vocabulary 128256: 69.5B parameters)
SHAPES = {
    "0.5B": Shape(n_layer=32, n_embd=640, n_head=5, n_kv_head=5),
    "3B": Shape(n_layer=32, n_embd=2048, n_head=16, n_kv_head=16),
    "70B": Shape(n_layer=80, n_embd=8192, n_head=64, n_kv_head=8, vocab_size=128256, mlp_hidden=28672, mlp_mats=3),
}

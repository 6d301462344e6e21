"""The paper's own code as a benchmark peer: `snlp bench --vs-paper PATH`.

The paper's numbers come from its repository (nanochat-snlp): its sequential forward is nanochat's
`GPT.forward` and its plans are `snlp/inference_idn.py` / `snlp/inference_hcn.py`. Their ratio and
ours are not the same quantity: its baseline keeps fp32 weights and casts them to bf16 in every Linear
call and runs short-window layers through SDPA with an explicit boolean mask; its parallel paths drop the
sliding windows (`is_causal=True`), its fused chunks also the value embeddings (with the x0 / residual lambdas
averaged per chunk), and `forward_idn_chunkwise` re-stacks the chunk weights inside every call. So this module times both codes side by side on one device in one
process, round-robin, each callable on the same tokens, and reports absolute milliseconds for the same
plan on the same shape, both speedup definitions, and ablations of the paper's baseline (bf16 weights,
windows off) so a reader sees what each definition costs.

The user's checkout is imported, never vendored: its packages are `nanochat` (no clash) and `snlp` (which
clashes with ours), so its `snlp/*.py` files are loaded by path under private module names and ours stay
importable. Its tokenizer and engine modules pull packages (rustbpe, tiktoken) that a timing run does not
need: when they do not import, minimal stand-ins are registered so the model and inference code load.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import statistics
import sys
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from snlp.io.source import home_path
from snlp.method.plan import Plan
from snlp.model.gpt import GPT
from snlp.runtime.timing import time_round_robin

PAPER_FILES = ("nanochat/gpt.py", "nanochat/jacobi_forward.py", "snlp/inference_idn.py", "snlp/inference_hcn.py")


@dataclass
class PaperCode:
    """The paper's modules, loaded from a checkout (see `load_paper_code`)."""

    root: str
    dtype: torch.dtype  # nanochat's COMPUTE_DTYPE, fixed when nanochat.common is first imported
    gpt: types.ModuleType  # nanochat.gpt
    idn: types.ModuleType  # snlp/inference_idn.py of the checkout
    hcn: types.ModuleType  # snlp/inference_hcn.py of the checkout
    stubs: list[str] = field(default_factory=list)  # modules replaced by stand-ins (they did not import)


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def load_paper_code(path: str, dtype: torch.dtype) -> PaperCode:
    """Import the paper's repository at `path` with nanochat's compute dtype `dtype`.

    ValueError (before any import) when `path` is not a checkout of it; ValueError when nanochat was
    already imported in this process with another compute dtype (it is fixed at import)."""
    root = home_path(path).resolve()
    missing = [f for f in PAPER_FILES if not (root / f).is_file()]
    if missing:
        raise ValueError(f"--vs-paper {path}: not a checkout of the paper's code (nanochat-snlp): missing "
                         f"{', '.join(missing)}")
    name = _DTYPE_NAMES[dtype]
    if "nanochat.common" in sys.modules:
        have = sys.modules["nanochat.common"].COMPUTE_DTYPE
        if have != dtype:
            raise ValueError(f"--vs-paper: the paper's nanochat is already loaded with dtype {have}; {dtype} needs a "
                             "fresh process")
    os.environ["NANOCHAT_DTYPE"] = name
    stubs: list[str] = []
    sys.path.insert(0, str(root))
    try:
        if (root / "nanochat").resolve() != Path(importlib.import_module("nanochat").__path__[0]).resolve():
            raise ValueError(f"--vs-paper: another `nanochat` package is importable "
                             f"({importlib.import_module('nanochat').__path__[0]}); run from a clean environment")
        _stub_if_broken("nanochat.tokenizer", _tokenizer_stub, stubs)
        _stub_if_broken("nanochat.engine", _engine_stub, stubs)
        try:
            gpt = importlib.import_module("nanochat.gpt")
            importlib.import_module("nanochat.jacobi_forward")
            idn = _load_by_path(root / "snlp" / "inference_idn.py", "_paper_snlp_inference_idn")
            hcn = _load_by_path(root / "snlp" / "inference_hcn.py", "_paper_snlp_inference_hcn")
        except Exception as e:  # the user's checkout: its own error, in one line
            first = f"{type(e).__name__}: {e}".splitlines()[0]
            raise ValueError(f"--vs-paper {path}: the paper's code does not import here: {first}") from e
    finally:
        sys.path.remove(str(root))
    lacking = [f"{mod}.{name}" for mod, obj, names in (("nanochat.common", sys.modules.get("nanochat.common"),
                                                        ("COMPUTE_DTYPE",)),
                                                       ("nanochat.gpt", gpt, PAPER_NAMES["gpt"]),
                                                       ("snlp/inference_idn.py", idn, PAPER_NAMES["idn"]),
                                                       ("snlp/inference_hcn.py", hcn, PAPER_NAMES["hcn"]))
               for name in names if not hasattr(obj, name)]
    if lacking:  # a folder with the files' names but not their code (or another version of it)
        raise ValueError(f"--vs-paper {path}: not the paper's code (nanochat-snlp) this benchmark drives: it lacks "
                         f"{', '.join(lacking)}")
    # inference_idn picks SDPA over FA3 at import (`fa._override_impl = 'sdpa'`), as the paper's evaluator does
    return PaperCode(root=str(root), dtype=sys.modules["nanochat.common"].COMPUTE_DTYPE, gpt=gpt, idn=idn, hcn=hcn,
                     stubs=stubs)


# what the benchmark calls in each module (paper_config, build_paper_model, paper_plan_fn, paper_sequential_fn)
PAPER_NAMES = {"gpt": ("GPT", "GPTConfig"),
               "idn": ("forward_sequential", "PrecomputedWeights", "ChunkWeights", "forward_idn_batched",
                       "forward_idn_fused", "forward_idn_chunkwise"),
               "hcn": ("forward_sequential", "MHCPrecomputedWeights", "forward_hcn_batched")}


def _load_by_path(path: Path, name: str) -> types.ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _stub_if_broken(name: str, make, stubs: list[str]) -> None:
    try:
        importlib.import_module(name)
    except ImportError:
        sys.modules[name] = make(name)
        stubs.append(name)


def _tokenizer_stub(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)

    def get_tokenizer(*_a, **_k):
        raise RuntimeError("the paper's tokenizer is not available in this process (stubbed for timing)")

    mod.get_tokenizer = get_tokenizer
    mod.get_token_bytes = get_tokenizer
    return mod


def _engine_stub(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)

    class KVCache:  # inference_idn imports the name; the prefill paths timed here never build one
        def __init__(self, *_a, **_k):
            raise RuntimeError("the paper's engine is not available in this process (stubbed for timing)")

    mod.KVCache = KVCache
    return mod


# ------------------------------------------------------------------------------------------ models
def paper_config(code: PaperCode, shape, vocab_size: int, sequence_len: int, window_pattern: str):
    """The paper's GPTConfig for one of snlp.bench.suite's PAPER_SHAPES."""
    return code.gpt.GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=shape.depth,
                              n_head=shape.width // shape.head_dim, n_kv_head=shape.width // shape.head_dim,
                              n_embd=shape.width, window_pattern=window_pattern,
                              no_x0_resid=not shape.x0 or bool(shape.hc_streams), no_ve=not shape.ve,
                              use_mhc=bool(shape.hc_streams), mhc_num_streams=shape.hc_streams or 4)


def build_paper_model(code: PaperCode, cfg, device: torch.device, seed: int = 0):
    """The paper's GPT as its `load_model` builds it (meta, to_empty, init_weights, eval; static mHC maps
    cached), with its zero-initialised output projections filled with small random values so no layer is an
    identity (speed does not depend on the values, but a zero layer would make the exactness checks vacuous), and the
    parameters its init_weights skips set (seeded: `seed` draws every random value here)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = code.gpt.GPT(cfg)
    model.to_empty(device=device)
    model.init_weights()
    with torch.no_grad():
        # its init_weights leaves the smear gate, the smear and backout scalars and a buffer as to_empty left them
        # (uninitialised memory: NaN at times); its load_model overwrites them from a checkpoint. Give them values
        # so the smear and the backout take part.
        model.smear_gate.weight.uniform_(-0.1, 0.1)
        model.smear_lambda.fill_(0.1)
        model.backout_lambda.fill_(0.2)
        if hasattr(model, "reg_warmup_factor"):
            model.reg_warmup_factor.fill_(1.0)
        s = 0.5 * cfg.n_embd ** -0.5
        for block in model.transformer.h:
            block.attn.c_proj.weight.uniform_(-s, s)
            block.mlp.c_proj.weight.uniform_(-s / 2, s / 2)
    model.eval()
    if cfg.use_mhc:
        for block in model.transformer.h:
            block.hc_attn.cache_hc_matrices(cfg.mhc_sinkhorn_iters, cfg.mhc_sinkhorn_tau)
            block.hc_mlp.cache_hc_matrices(cfg.mhc_sinkhorn_iters, cfg.mhc_sinkhorn_tau)
    return model


def paper_plan_fn(code: PaperCode, model, plan: Plan, shape):
    """The paper's callable for `plan` as its evaluator (snlp/eval_snlp.py) builds it: IDN_batched for
    C x F1 plans, ChunkB (forward_idn_chunkwise) for C x FM with C > 1, Fused (forward_idn_fused) for 1 x FM,
    mHC-Newton (forward_hcn_batched) for hcn plans. Weights are precomputed here, outside the timed call,
    as the evaluator does. Returns fn(idx) -> logits, or raises ValueError for a plan it has no path for."""
    L = model.config.n_layer
    n_par = plan.n_suffix
    seq_layers = L - n_par
    par = list(range(seq_layers, L))
    init = {"h0": "h0", "fwd": "batch_fwd"}.get(plan.init)
    if init is None:
        raise ValueError(f"the paper's evaluator has no init {plan.init!r}")
    surrogate = type(plan.surrogate).__name__
    if surrogate == "HCN":
        if plan.fuse != 1:  # its evaluator runs these through forward_hcn_chunkwise, which no paper shape times
            raise ValueError(f"{plan}: the paper's C x FM mHC path (forward_hcn_chunkwise: fused chunks with each "
                             f"chunk's H maps averaged) is not driven here; its C x F1 path (forward_hcn_batched) is")
        pw = code.hcn.MHCPrecomputedWeights(model, par)
        return lambda idx: code.hcn.forward_hcn_batched(model, idx, seq_layers=seq_layers, pw=pw, K=plan.iters, init=init)
    if surrogate != "Identity" or plan.elk or plan.order or plan.tol:
        raise ValueError(f"the paper's evaluator has no path for {plan} here (IDN and HCN, forward order, fixed K)")
    pw = code.idn.PrecomputedWeights(model, par)
    if plan.fuse == 1:
        return lambda idx: code.idn.forward_idn_batched(model, idx, seq_layers, pw, K=plan.iters, init=init)
    if plan.chunks == 1:
        cw = [code.idn.ChunkWeights(model, par)]
        return lambda idx: code.idn.forward_idn_fused(model, idx, seq_layers, pw, cw, K=plan.iters)
    cs = plan.fuse
    cwl = [code.idn.ChunkWeights(model, par[i * cs:(i + 1) * cs]) for i in range(plan.chunks)]
    return lambda idx: code.idn.forward_idn_chunkwise(model, idx, seq_layers, pw, cwl, K=plan.iters, init=init)


def paper_sequential_fn(code: PaperCode, model, windows: bool = True):
    """The paper's sequential forward (nanochat GPT.forward; inference_hcn's for mHC), with its windows, or,
    for the windows-off ablation, every layer at full context (flash `is_causal` SDPA)."""
    full = [(model.config.sequence_len, 0)] * model.config.n_layer
    seq = code.hcn.forward_sequential if model.config.use_mhc else code.idn.forward_sequential

    def fn(idx):
        if windows:
            return seq(model, idx)
        saved, model.window_sizes = model.window_sizes, full
        try:
            return seq(model, idx)
        finally:
            model.window_sizes = saved

    return fn


def cast_linear_weights(model, dtype: torch.dtype):
    """The bf16-weights ablation: every parameter in `dtype` once, so nanochat's Linear (which casts its weight
    to the activation dtype on every call) casts nothing. The logits stay fp32 (its head upcasts)."""
    return model.to(dtype)


# ------------------------------------------------------------------------------------------ timing
@dataclass
class PeerRow:
    """One timed callable of the side-by-side run; times in ms (medians over `runs` round-robin calls)."""

    shape: str
    side: str  # paper | snlp
    plan: str  # "sequential" or the plan text
    variant: str  # paper: "as published" | "bf16 weights" | "windows off"; snlp: "eager" | "compiled" | ...
    median_ms: float
    min_ms: float
    max_ms: float
    p10_ms: float
    p90_ms: float
    runs: int
    compile_s: float | None = None
    note: str = ""
    times_ms: list[float] | None = None  # every timed round's ms, in round order: round i of every callable of one
    #                                      shape ran in the same round-robin round, so two rows' ratios pair up

    def to_dict(self) -> dict:
        return asdict(self)


def summarise(shape: str, times: dict[str, list[float]], meta: dict[str, tuple[str, str, str, str]],
              compile_s: dict[str, float] | None = None) -> list[PeerRow]:
    """PeerRows from round-robin times; `meta[name]` = (side, plan, variant, note)."""
    rows = []
    for name, ts in times.items():
        side, plan, variant, note = meta[name]
        q = statistics.quantiles(ts, n=10, method="inclusive") if len(ts) >= 2 else [ts[0]] * 9  # within min..max
        rows.append(PeerRow(shape=shape, side=side, plan=plan, variant=variant, median_ms=statistics.median(ts),
                            min_ms=min(ts), max_ms=max(ts), p10_ms=q[0], p90_ms=q[-1], runs=len(ts),
                            compile_s=(compile_s or {}).get(name), note=note, times_ms=list(ts)))
    return rows


def time_side_by_side(fns: dict, warmup: int, runs: int, device) -> dict[str, list[float]]:
    """Round-robin medians (host clock around a device synchronise, as snlp.runtime.timing does)."""
    with torch.inference_mode():
        return time_round_robin(fns, warmup, runs, device)


def snlp_model_from_paper(paper, device, dtype) -> GPT:
    """snlp's GPT holding the paper model's own weights (snlp.io.nanochat's mapping, as for a checkpoint of it):
    the same function as the paper's sequential forward (tests/io/test_nanochat.py), so both sides time, and the
    CPU check compares, one set of weights."""
    from snlp.io.nanochat import config_from_nanochat, state_from_nanochat

    pc = paper.config
    gate = next((b.attn.ve_gate for b in paper.transformer.h if b.attn.ve_gate is not None), None)
    cfg = config_from_nanochat(asdict(pc), ve_gate_channels=12 if gate is None else gate.weight.shape[1])
    sd = {k: v.detach().float().cpu() for k, v in paper.state_dict().items()}
    model = GPT(cfg)
    model.load_state_dict(state_from_nanochat(sd, cfg))
    return model.to(device=device, dtype=dtype).eval()

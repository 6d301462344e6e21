"""Training speed: `snlp bench --suite train [--quick]` (`run_train_bench`): tokens/s, MFU and compile time of the
training step at one of the paper's shapes (default its 0.5B model, depth 32, width 640), eager vs compiled
(snlp.train.compiled) and plain vs the SNLP regulariser (`--reg idn --reg-n 24`, the N of the paper table's 0.5B IDN-Reg
row; the run's script, nanochat-snlp runs_snlp/train_d32s_idn.sh, sums N = 8, 16, 24, a K=1 solve of 48 suffix layers
per step, not 24: `--reg-n 8,16,24` prices it). A
variant `KIND:F` (e.g. `idn:0.25`) runs the regulariser on the first ceil(F x batch) rows of each step
(`snlp train --reg-rows F`): the same row and ratios, named by the variant.

Each variant trains a fresh model (same seed) for `warmup + steps` optimizer steps of `snlp train`'s step on random
tokens (speed does not depend on the data): bf16 autocast on CUDA, fp32 on CPU, the run's optimizers (Muon + AdamW;
compiled on CUDA: Muon's Newton-Schulz iterations compiled, AdamW fused), gradient clipping, one host read per step
as the trainer does. Step 1 compiles; its time is reported apart (`first_step_s`, and `compile_s` = that minus a
steady step). The timed steps are the `steps` after `warmup`; tokens/s = tokens per step / median step time.
Model FLOPs per token are counted once per variant on its real step (snlp.train.flops) and MFU is over the card's
dense bf16 peak (snlp.runtime.peak; none on CPU, where the model TFLOP/s is reported instead). A variant that
runs out of device memory is recorded as such and the others still run.

Noise: each row keeps its timed steps' p10-p90 (`step_ms_p10` / `step_ms_p90`, and every step in `step_ms_timed`),
and each ratio (compiled / eager tokens/s, regularised / plain step time) carries the range the two rows' spreads
allow (`ratio_spreads`: lowest = the ratio of the two rows' opposite ends); a range that contains 1, or timed steps
that the exact rank-sum test does not tell apart at 5 % (stats.unpaired_verdict), is reported as a tie, not as a
speedup or an overhead. The variants run one after another (each its own model), so the
spreads hold the noise within a variant, not a drift of the machine between variants: on a shared host time
steps round-robin instead (docs/records).

`quick` is the CPU smoke size (CI): depth 2, width 64, T = 32, batch 2, vocab 256, 1 warm-up + 3 timed steps,
regulariser N clipped to depth - 1.
"""

from __future__ import annotations

import datetime
import gc
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from snlp.bench.records import markdown_table, write_json
from snlp.bench.stats import spread_verdict, unpaired_verdict
from snlp.bench.suite import PAPER_SHAPES, SHAPE_KEYS, TREATMENTS, Shape
from snlp.model.gpt import GPT
from snlp.runtime.device import device_label, write_atomic
from snlp.runtime.load import LoadWindow, own_threads
from snlp.runtime.outputs import partial_line
from snlp.runtime.peak import peak_bf16_flops
from snlp.runtime.timing import sync
from snlp.train.compiled import CompiledStep, check_compile, compile_optimizers
from snlp.train.config import TrainConfig
from snlp.train.flops import mfu, step_flops
from snlp.train.job import TrainStep, reg_config
from snlp.train.optim import build_optimizers
from snlp.train.precision import autocast_context
from snlp.train.regularizer import RegConfig, check_rows, parse_suffixes, resolve_suffixes

REGS = ("none", "idn")
QUICK_SHAPE = dict(depth=2, width=64, head_dim=32)


@dataclass
class TrainBenchConfig:
    """What to run. None means the default for the device (see `resolved`)."""

    shape: str = "0.5B"  # a key of snlp.bench.suite.PAPER_SHAPES
    quick: bool = False  # CPU smoke size
    device: str | None = None  # None: cuda if available, else cpu
    batch_size: int | None = None  # sequences per step; None: 8 on cuda, 4 on cpu, 2 quick
    seq_len: int | None = None  # None: 2048 on cuda (the paper's), 256 on cpu, 32 quick
    steps: int | None = None  # timed steps; None: 20 on cuda, 5 on cpu, 3 quick (a p10-p90 needs several)
    warmup: int | None = None  # untimed steps after the first; None: 3 on cuda, 1 on cpu and quick
    treatments: tuple[str, ...] = TREATMENTS  # eager and/or compiled
    regs: tuple[str, ...] = REGS  # none (plain) and/or idn / hcn (the regulariser's surrogate), KIND:F a row fraction
    reg_n: str = "24"  # suffix lengths N of the regulariser (clipped to depth - 1)
    reg_lambda: float = 0.5
    optimizer: str = "muon"
    vocab_size: int | None = None  # None: 32768, 256 quick
    window_pattern: str = "SSSL"  # nanochat-snlp's base_train default (the paper's runs)
    threads: int | None = None  # torch CPU threads (restored after)
    seed: int = 0
    out: str | None = None  # directory for train.json and train.md (None: write nothing)
    command: str | None = None

    def resolved(self) -> "TrainBenchConfig":
        """A copy with every None default filled in for the device, validated (ValueError otherwise)."""
        device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("train bench: device cuda requested but CUDA is not available; use cpu")
        cuda, q = device.type == "cuda", self.quick
        pick = lambda v, quick, gpu, cpu: v if v is not None else (quick if q else gpu if cuda else cpu)  # noqa: E731
        if self.shape not in SHAPE_KEYS:
            raise ValueError(f"train bench: unknown shape {self.shape!r}; valid: {', '.join(SHAPE_KEYS)}")
        bad = [t for t in self.treatments if t not in TREATMENTS]
        if bad or not self.treatments:
            raise ValueError(f"train bench: treatments must be a non-empty subset of {', '.join(TREATMENTS)}")
        bad = [r for r in self.regs if reg_variant(r)[0] not in ("none", "idn", "hcn")]
        if bad or not self.regs:
            raise ValueError(f"train bench: regs must be a non-empty subset of none, idn, hcn (diag does not "
                             f"compile), each regulariser optionally as KIND:F (--reg-rows F), got "
                             f"{', '.join(self.regs) or 'none'}")
        parse_suffixes(self.reg_n)
        cfg = replace(self, device=str(device), batch_size=pick(self.batch_size, 2, 8, 4),
                      seq_len=pick(self.seq_len, 32, 2048, 256), steps=pick(self.steps, 3, 20, 5),
                      warmup=pick(self.warmup, 1, 3, 1), vocab_size=pick(self.vocab_size, 256, 32768, 32768),
                      threads=self.threads)
        if min(cfg.batch_size, cfg.seq_len, cfg.steps, cfg.vocab_size) < 1 or cfg.warmup < 0:
            raise ValueError("train bench: batch size, seq len, steps and vocab size must be >= 1, warm-up >= 0")
        if cfg.optimizer not in ("muon", "adamw"):
            raise ValueError(f"train bench: optimizer must be muon or adamw, got {cfg.optimizer!r}")
        shape = cfg.run_shape()
        for r in cfg.regs:  # each regulariser fits the shape's model (HCN needs mHC), before any variant runs
            kind = reg_variant(r)[0]
            if kind != "none" and RegConfig(surrogate=kind).surrogate.needs_mhc and not shape.hc_streams:
                mhc = ", ".join(s.key for s in PAPER_SHAPES if s.hc_streams)
                raise ValueError(f"train bench: variant {r!r} needs an mHC model and the {cfg.shape} shape has a plain "
                                 f"residual stream: use --shapes {mhc}, or idn")
        for r in cfg.regs:  # each row fraction leaves the batch a row (the refusal of snlp train --reg-rows)
            rows = reg_variant(r)[1]
            if rows is not None:
                try:
                    check_rows(rows, cfg.batch_size)
                except ValueError as e:
                    raise ValueError(f"train bench: variant {r!r} leaves a {cfg.batch_size}-row batch no row for "
                                     f"the regulariser (F x B rounds to 0)") from e
        return cfg

    def run_shape(self) -> Shape:
        shape = next(s for s in PAPER_SHAPES if s.key == self.shape)
        return replace(shape, **QUICK_SHAPE) if self.quick else shape


@dataclass
class TrainBenchRow:
    """One variant: a treatment (eager / compiled) and a regulariser (none / idn ...)."""

    shape: str
    treatment: str
    reg: str
    reg_n: list[int]  # the suffix lengths regularised (after clipping); [] without a regulariser
    n_layer: int
    n_embd: int
    params: int
    batch: int
    seq_len: int
    tokens_per_step: int
    steps: int  # timed
    warmup: int
    step_ms: float | None = None  # median
    step_ms_min: float | None = None
    step_ms_p10: float | None = None  # the timed steps' 10th / 90th percentiles (inclusive method: within min..max)
    step_ms_p90: float | None = None
    step_ms_timed: list[float] | None = None  # every timed step, in order
    tokens_per_s: float | None = None
    first_step_s: float | None = None  # step 1: compiled, this includes tracing and compiling
    compile_s: float | None = None  # first_step_s - one median step (compiled rows)
    flops_per_token: float | None = None
    tflops: float | None = None  # achieved model TFLOP/s
    mfu: float | None = None  # over the device's dense bf16 peak; None without one (CPU)
    peak_mem_gb: float | None = None  # CUDA max allocated
    loss_first: float | None = None
    loss_last: float | None = None
    error: str | None = None  # e.g. out of memory: the row has no timings
    reg_rows: int | None = None  # rows of each step the regulariser's solve ran on (None without a regulariser)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainBenchResult:
    config: TrainBenchConfig
    meta: dict
    rows: list[TrainBenchRow] = field(default_factory=list)
    json_path: str | None = None
    markdown_path: str | None = None
    complete: bool = False  # every variant ran (False in the files a run rewrites on its way)

    def row(self, treatment: str, reg: str) -> TrainBenchRow | None:
        return next((r for r in self.rows if r.treatment == treatment and r.reg == reg and r.error is None), None)

    def ratios(self) -> dict:
        """compiled / eager tokens/s per regulariser, and the regulariser's step-time overhead per treatment."""
        return {k: v["ratio"] for k, v in self.ratio_spreads().items()}

    def ratio_spreads(self) -> dict:
        """Each ratio of `ratios` with the range its two rows' p10-p90 spreads allow and whether that range holds 1
        (a tie: the difference is inside the noise). A ratio num/den of step times ranges over num_p10/den_p90 ..
        num_p90/den_p10 (a speedup, eager over compiled step time, likewise)."""
        out = {}

        def add(name: str, num: TrainBenchRow, den: TrainBenchRow) -> None:  # num / den of step times
            if num.step_ms_timed and den.step_ms_timed:  # the steps themselves: the rank-sum test decides
                lo, hi, tie = unpaired_verdict(num.step_ms_timed, den.step_ms_timed)
            else:  # a record that kept only the spreads
                lo, hi, tie = spread_verdict(num.step_ms_p10, num.step_ms_p90, den.step_ms_p10, den.step_ms_p90,
                                             num.steps, den.steps)
            out[name] = {"ratio": num.step_ms / den.step_ms, "lo": lo, "hi": hi, "tie": tie}

        for reg in self.config.regs:
            e, c = self.row("eager", reg), self.row("compiled", reg)
            if e and c:
                add(f"compiled_speedup_{reg}", e, c)
        for t in self.config.treatments:
            plain = self.row(t, "none")
            for reg in self.config.regs:
                r = self.row(t, reg)
                if reg != "none" and plain and r:
                    add(f"reg_overhead_{reg}_{t}", r, plain)
        return out

    def load_note(self) -> str | None:
        """The contention sentence of the run's window (meta's `load`, snlp.runtime.load) against its torch threads
        (one on a GPU); None where it was not contended, or for a file written before the window was recorded."""
        m = self.meta
        if m.get("load") is None:
            return None
        return LoadWindow(**m["load"]).note(own_threads([m["threads"]], m["device_type"]))

    @property
    def markdown(self) -> str:
        cfg, m = self.config, self.meta
        f = lambda v, fmt: "-" if v is None else fmt.format(v)  # noqa: E731
        rows = [[r.treatment, r.reg + (f" N={','.join(map(str, r.reg_n))}" if r.reg_n else "")
                 + (f" rows {r.reg_rows}/{r.batch}" if r.reg_rows is not None and r.reg_rows < r.batch else ""),
                 f(r.step_ms, "{:.1f}") + (f" ({r.step_ms_p10:.1f}-{r.step_ms_p90:.1f})" if r.step_ms_p10 else ""),
                 f(r.tokens_per_s, "{:,.0f}"), f(r.mfu, "{:.1%}"), f(r.tflops, "{:.4g}"),
                 f(r.flops_per_token and r.flops_per_token / 1e9, "{:.4g}"), f(r.first_step_s, "{:.1f}"),
                 f(r.compile_s, "{:.1f}"), f(r.peak_mem_gb, "{:.1f}"), r.error or ""] for r in self.rows]
        lines = [f"# Training step speed: {cfg.shape} shape ({'quick, shrunk: ' if cfg.quick else ''}depth "
                 f"{self.rows[0].n_layer if self.rows else '?'}, width {self.rows[0].n_embd if self.rows else '?'}), "
                 f"batch {cfg.batch_size} x T {cfg.seq_len}, {cfg.optimizer}", "",
                 f"{m['device']} ({m['dtype']}), torch {m['torch']}, {m['date']}; median (p10-p90) of {cfg.steps} "
                 f"steps after "
                 f"1 + {cfg.warmup} untimed; random tokens; MFU over {f(m['peak_tflops'], '{:.0f}')} TFLOP/s dense "
                 f"bf16" + ("" if m["peak_tflops"] else " (no known peak for this device: MFU n/a, model TFLOP/s "
                                                        "given instead)"), "",
                 *([] if self.complete else [partial_line("the rows of the variants that had finished"), ""]),
                 *([f"**{note}**", ""] if (note := self.load_note()) else []),
                 *markdown_table(["treatment", "reg", "ms/step (p10-p90)", "tok/s", "MFU", "model TFLOP/s",
                                  "GFLOP/token",
                                  "step 1 (s)", "compile (s)", "peak GB", "error"], rows)]
        spreads = self.ratio_spreads()
        if spreads:
            lines += ["", " | ".join(f"{k} {v['ratio']:.2f}x ({v['lo']:.2f}-{v['hi']:.2f}"
                                     + ((": tie, inside the spreads)" if v["lo"] <= 1.0 <= v["hi"] else
                                         ": tie, the steps' rank-sum test does not resolve it)") if v["tie"] else ")")
                                     for k, v in spreads.items())]
        return "\n".join(lines) + "\n"


def reg_variant(name: str) -> tuple[str, float | None]:
    """A --regs variant as (surrogate kind, row fraction F or None = every row): "idn" or "idn:0.25"."""
    kind, sep, frac = name.partition(":")
    if not sep:
        return kind, None
    if kind == "none":
        raise ValueError(f"train bench: variant {name!r}: a row fraction needs a regulariser (idn:F, hcn:F)")
    try:
        rows = float(frac)
    except ValueError:
        raise ValueError(f"train bench: variant {name!r}: F of KIND:F must be a number in (0, 1]") from None
    try:
        check_rows(rows)
    except ValueError as e:  # in the bench's own terms: it has no --reg-rows flag
        raise ValueError(f"train bench: variant {name!r}: F of KIND:F must lie in (0, 1], a fraction of each "
                         f"micro-batch's rows (as snlp train --reg-rows F)") from e
    return kind, rows


def run_train_bench(cfg: TrainBenchConfig) -> TrainBenchResult:
    """Run every (treatment, regulariser) variant of `cfg` and write train.json / train.md to cfg.out (if set)."""
    cfg = cfg.resolved()
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        device = torch.device(cfg.device)
        peak = peak_bf16_flops(device)
        result = TrainBenchResult(config=cfg, meta={
            "suite": "train", "quick": cfg.quick, "device": device_label(device), "device_type": device.type,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "dtype": "bfloat16 autocast" if device.type == "cuda" else "float32", "peak_tflops": peak and peak / 1e12,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": cfg.command, "platform": platform.platform(), "threads": torch.get_num_threads()})
        window = LoadWindow.begin()  # sampled between variants, outside every timed step
        result.meta["load"] = window.to_json()
        t0 = time.perf_counter()
        for reg in cfg.regs:
            for treatment in cfg.treatments:
                result.rows.append(run_variant(cfg, treatment, reg, peak))
                result.meta["load"] = window.sample().to_json()
                print(f"train bench: {treatment} reg={reg} done at {time.perf_counter() - t0:.0f}s", file=sys.stderr,
                      flush=True)
                _write(result, cfg)  # every row so far: a run cut short keeps what it measured
        result.meta["load"] = window.close().to_json()
        result.complete = True
        _write(result, cfg)
        return result
    finally:
        torch.set_num_threads(threads)


def build(cfg: TrainBenchConfig, reg_kind: str, device) -> tuple[GPT, TrainStep]:
    """A fresh model of the run's shape (seeded) and its training step with the regulariser variant `reg_kind`
    (`reg_variant`)."""
    shape = cfg.run_shape()
    mcfg = shape.config(cfg.vocab_size, cfg.window_pattern, max(cfg.seq_len // 4, 1), cfg.seq_len)
    model = GPT(mcfg)
    model.init_weights(seed=cfg.seed)
    model.to(device).train()
    kind, rows = reg_variant(reg_kind)
    tcfg = TrainConfig(out="", reg=kind, reg_n=cfg.reg_n, reg_lambda=cfg.reg_lambda, reg_rows=rows,
                       batch_size=cfg.batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # N >= depth is clipped (resolve_suffixes): the row records the N used
        reg = reg_config(tcfg, mcfg) if kind != "none" else RegConfig()  # as snlp train builds it
    return model, TrainStep(model, reg)


def run_variant(cfg: TrainBenchConfig, treatment: str, reg_kind: str, peak: float | None) -> TrainBenchRow:
    """Train a fresh model for 1 + warmup + steps steps in one variant and time the last `steps`."""
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    model, loss = build(cfg, reg_kind, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ns = resolve_suffixes(model.config.n_layer, loss.reg.suffixes) if loss.reg.active else []
    B, T = cfg.batch_size, cfg.seq_len
    row = TrainBenchRow(shape=cfg.shape, treatment=treatment, reg=reg_kind, reg_n=ns,
                        reg_rows=loss.reg.n_rows(cfg.batch_size) if loss.reg.active else None,
                        n_layer=model.config.n_layer, n_embd=model.config.n_embd, params=model.num_params(), batch=B,
                        seq_len=T, tokens_per_step=B * T, steps=cfg.steps, warmup=cfg.warmup)
    compiled = treatment == "compiled"
    tcfg = TrainConfig(out="", optimizer=cfg.optimizer, compile=compiled)
    autocast = autocast_context(device)
    gen = torch.Generator().manual_seed(cfg.seed)
    batches = [torch.randint(0, cfg.vocab_size, (B, T + 1), generator=gen) for _ in range(4)]
    batches = [(b[:, :-1].to(device), b[:, 1:].to(device)) for b in batches]
    lam = loss.reg.weight(0) if loss.reg.active else 0.0
    try:
        opts = build_optimizers(model, tcfg)
        step_fn = loss
        if compiled:
            check_compile(loss.reg)
            step_fn = CompiledStep(loss, device)
            compile_optimizers(opts, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        row.flops_per_token = step_flops(loss, *batches[0], lam, autocast) / (B * T)
        times, losses = [], []
        for i in range(1 + cfg.warmup + cfg.steps):
            x, y = batches[i % len(batches)]
            sync(device)
            t = time.perf_counter()
            with autocast():
                out = step_fn(x, y, lam)
            out[0].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad(set_to_none=True)
            losses.append(float(out[1]))  # the trainer's one host read per step
            times.append(time.perf_counter() - t)
        timed = times[1 + cfg.warmup:]
        med = statistics.median(timed)
        row.step_ms, row.step_ms_min = med * 1e3, min(timed) * 1e3
        q = statistics.quantiles(timed, n=10, method="inclusive") if len(timed) > 1 else [timed[0]] * 9
        row.step_ms_p10, row.step_ms_p90 = q[0] * 1e3, q[-1] * 1e3
        row.step_ms_timed = [t * 1e3 for t in timed]
        row.tokens_per_s = B * T / med
        row.first_step_s = times[0]
        row.compile_s = times[0] - med if compiled else None
        row.tflops = row.flops_per_token * row.tokens_per_s / 1e12
        row.mfu = mfu(row.flops_per_token, row.tokens_per_s, peak)
        row.loss_first, row.loss_last = losses[0], losses[-1]
        if device.type == "cuda":
            row.peak_mem_gb = torch.cuda.max_memory_allocated(device) / 1e9
    except torch.cuda.OutOfMemoryError as e:
        row.error = f"out of memory: {str(e).splitlines()[0][:160]}"
    finally:
        del model, loss
        if compiled:
            torch._dynamo.reset()  # the compiled code holds the variant's model: free it before the next
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _write(result: TrainBenchResult, cfg: TrainBenchConfig) -> None:
    if not cfg.out:
        return
    out = Path(cfg.out)
    write_json(out / "train.json", {"meta": result.meta, "config": cfg, "records": result.rows,
                                    "ratios": result.ratios(), "ratio_spreads": result.ratio_spreads(),
                                    "complete": result.complete}, announce=False)
    write_atomic(out / "train.md", result.markdown)  # a kill between variants never leaves half a table
    result.json_path, result.markdown_path = str(out / "train.json"), str(out / "train.md")

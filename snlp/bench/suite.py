"""The paper's speed column in one command: `snlp bench --suite paper [--quick]`.

For each of the paper's model shapes (Table "Main results for layer-parallel decoding",
tab:main_results; shapes from its Sec. Experiments and the authors' run scripts) and the plans the
paper times on it, with RANDOM weights (timing only: speed does not depend on the weights, quality
does and is not measured here):
  - teacher-forced prefill of T = 2048 tokens at batch 1 (`snlp.bench.forward.benchmark`: sequential and
    each plan round-robin in one process, medians, op-count and structural ideals),
  - KV-cached greedy decode, per-token latency (`snlp.bench.decode.decode_benchmark`; also self-speculative
    rows, whose acceptance rate means nothing with random weights),
each eager and compiled (torch.compile fullgraph, reduce-overhead on CUDA; compile time reported
apart), bf16 on CUDA (fp32 on CPU). A speedup the paired rounds do not resolve from 1.00x by the sign test
(snlp.bench.stats.paired_verdict) is marked "(tie)" in the table; the records keep each round's times. The paper's protocol is 50 warm-up + 200 timed runs: the
defaults on CUDA. Output: a JSON file (every record + device, torch / CUDA versions, dtype, date,
command) and a markdown table with the paper's speedup beside ours.

`quick` is a CPU smoke run (CI): the same shapes shrunk (width 64, vocab 256, T = 16; depth cut to
the plans' largest suffix + 2 prefix layers so every plan keeps its chunk structure), few runs, one
CPU thread, compiled prefill on one shape only and no compiled decode (compiling the static-shape
decode steps takes minutes on a 2-core CPU; tests/decode/test_steps.py checks them against eager).
"""

from __future__ import annotations

import datetime
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from snlp.bench.decode import DecodeRow, decode_benchmark, model_bytes
from snlp.bench.forward import ForwardRow, benchmark
from snlp.bench.records import markdown_table, write_json
from snlp.bench.stats import tie_footnote, tie_mark
from snlp.method.plan import Plan
from snlp.model.gpt import GPT, GPTConfig
from snlp.runtime.device import device_label, write_atomic
from snlp.runtime.load import LoadWindow, load_average, own_threads, usable_cores
from snlp.runtime.outputs import partial_line

RANDOM_WEIGHTS = "random weights (timing only)"
TREATMENTS = ("eager", "compiled")


@dataclass(frozen=True)
class Shape:
    """One of the paper's model shapes and the plans the paper times on it."""

    key: str  # short name used on the command line and in the JSON
    title: str  # the paper's name for the model
    depth: int
    width: int
    plans: tuple[str, ...]
    head_dim: int = 128
    x0: bool = True  # x0 residual
    ve: bool = True  # value embeddings
    hc_streams: int = 0  # mHC residual streams (0 = plain residual)

    def config(self, vocab_size: int, window_pattern: str, short_window: int, sequence_len: int) -> GPTConfig:
        # the paper's mHC has static H (learned logits, cached at inference) and no x0 residual
        return GPTConfig.from_depth(self.depth, width=self.width, head_dim=self.head_dim, vocab_size=vocab_size,
                                    window_pattern=window_pattern, short_window=short_window,
                                    sequence_len=sequence_len, x0_residual=self.x0 and not self.hc_streams,
                                    value_embeds=self.ve, hc_streams=self.hc_streams, hc_dynamic=False)

    def quick(self) -> "Shape":
        """The smoke-size version: width 64 (2 heads of 32), depth = largest suffix + 2."""
        n = max(Plan.parse(p).n_suffix for p in self.plans)
        return replace(self, depth=min(self.depth, n + 2), width=64, head_dim=32)


# The paper's shapes (Sec. Experiments: "two 32-layer scales: a 3B model with n_embd = 2048 and 16 heads,
# and a 0.5B model with n_embd = 640 and 5 heads"; the w/o-x0ve and mHC variants are 0.5B models; the
# authors' scripts runs_snlp/train_d32s_*.sh: depth 32, aspect ratio 20, mHC with 4 streams, mHC implies
# no x0 residual) and the plans of tab:main_results timed on each.
PAPER_SHAPES = (
    Shape("0.5B-nox0ve", "Nanochat-0.5B w/o x0ve", 32, 640, ("12xF2-h0-K1", "12xF2-h0-K2", "1xF12-h0-K1"),
          x0=False, ve=False),
    Shape("0.5B", "Nanochat-0.5B standard", 32, 640, ("24xF1-h0-K2", "24xF1-h0-K4", "12xF1-fwd-K2")),
    Shape("0.5B-mhc", "Nanochat-0.5B-mHC", 32, 640, ("16xF1-h0-K1-hcn",), hc_streams=4),
    Shape("3B", "Nanochat-3B standard", 32, 2048, ("8xF1-h0-K1", "8xF1-h0-K4")),
)
SHAPE_KEYS = tuple(s.key for s in PAPER_SHAPES)
QUICK_COMPILED = "3B"  # --quick compiles this (shrunk) shape only: compile on a 2-core CPU is slow

# The paper's wall-clock prefill speedups (tab:main_results "Speedup" column: H100, eager PyTorch, bf16,
# batch 1, one 2048-token forward, 50 warm-up + 200 timed runs), copied by hand: (shape, plan) -> speedup.
PAPER_PREFILL = {
    ("0.5B-nox0ve", "12xF2-h0-K1"): 2.58,  # Nanochat-0.5B w/o x0ve, IDN Reg., 12xF2-h0, K = 1
    ("0.5B-nox0ve", "12xF2-h0-K2"): 2.09,  # same, K = 2
    ("0.5B-nox0ve", "1xF12-h0-K1"): 1.40,  # same, 1xF12-h0, K = 1
    ("0.5B", "24xF1-h0-K2"): 1.88,  # Nanochat-0.5B standard, IDN Reg., 24xF1-h0, K = 2
    ("0.5B", "24xF1-h0-K4"): 1.33,  # same, K = 4
    ("0.5B", "12xF1-fwd-K2"): 1.14,  # same, 12xF1-fwd, K = 2
    ("0.5B-mhc", "16xF1-h0-K1-hcn"): 1.60,  # Nanochat-0.5B-mHC, HCN Reg., 16xF1-h0, K = 1
    ("3B", "8xF1-h0-K1"): 1.20,  # Nanochat-3B standard, IDN Reg., 8xF1-h0, K = 1
    ("3B", "8xF1-h0-K4"): 0.95,  # Nanochat-3B standard, No Reg. and IDN Reg. rows, 8xF1-h0, K = 4 (both 0.95)
}
# The drafter forward speedup s of tab:ssd_results (self-speculative decoding; the paper does not say
# at which length s was measured): the closest paper number to our per-token decode speedup.
PAPER_DRAFTER_S = {
    ("0.5B", "24xF1-h0-K2"): 1.86,  # Nanochat-0.5B standard, IDN Reg., 24xF1-K2-h0
    ("0.5B", "24xF1-h0-K4"): 1.30,  # same, 24xF1-K4-h0
    ("0.5B-nox0ve", "12xF2-h0-K1"): 2.63,  # Nanochat-0.5B w/o x0ve, IDN Reg., 12xF2-K1-h0
    ("0.5B-nox0ve", "12xF2-h0-K2"): 2.15,  # same, 12xF2-K2-h0
    ("0.5B-mhc", "16xF1-h0-K1-hcn"): 1.63,  # Nanochat-0.5B-mHC, HCN Reg., 16xF1-K1-h0
}


@dataclass
class SuiteConfig:
    """What to run. None means the protocol default for the device (see `resolved`)."""

    quick: bool = False  # CPU smoke run: shrunk shapes, T = 16, few runs, compiled on one shape
    shapes: tuple[str, ...] | None = None  # keys of PAPER_SHAPES; None = all
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    tokens: int | None = None  # prefill length T; None: 2048 (the paper), 16 with quick
    warmup: int | None = None  # prefill warm-up rounds; None: 50 on cuda (paper), 2 on cpu, 1 with quick
    runs: int | None = None  # prefill timed rounds; None: 200 on cuda (paper), 5 on cpu, 3 with quick
    treatments: tuple[str, ...] = TREATMENTS  # eager and/or compiled
    decode: bool = True  # also time KV-cached decoding
    decode_compiled: bool | None = None  # compiled decode too; None: yes, no with quick (compiling the static-shape
    #                                      decode steps takes minutes on a 2-core CPU; tests/decode/test_steps.py covers them)
    prompt_len: int = 16  # decode prompt (the paper's SSD protocol: prefill length 16)
    new_tokens: int | None = None  # decoded tokens per run; None: 128, 4 with quick
    decode_warmup: int | None = None  # None: 2 on cuda, 1 on cpu, 0 with quick
    decode_runs: int | None = None  # None: 10 on cuda, 3 on cpu, 1 with quick
    blocks: tuple[int, ...] = (4,)  # speculative draft block sizes of the decode rows
    vocab_size: int | None = None  # None: 32768, nanochat-snlp's GPTConfig default (the paper does not state
    #                                the tokenizer size); 256 with quick
    threads: int | None = None  # torch CPU threads during the run (restored after); None: leave, 1 with quick on
    #                             cpu (tiny ops: a second thread only adds contention on a shared box)
    window_pattern: str = "SSSL"  # nanochat-snlp's base_train default, which the paper's run scripts keep
    short_window: int | None = None  # None: 512 = nanochat-snlp's ceil(2048 / 4 / 128) * 128; T // 2 with quick
    seed: int = 0
    out: str | None = None  # directory for suite.json and suite.md (None: write nothing)
    command: str | None = None  # the command line that asked for this run, recorded as given

    def resolved(self) -> "SuiteConfig":
        """A copy with every None default filled in for the device, validated (ValueError otherwise)."""
        device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("suite: device cuda requested but CUDA is not available; use cpu")
        cuda, q = device.type == "cuda", self.quick
        pick = lambda v, quick, gpu, cpu: v if v is not None else (quick if q else gpu if cuda else cpu)  # noqa: E731
        if self.shapes is not None and not self.shapes:  # given, but empty (e.g. --shapes ","): not "all"
            raise ValueError(f"suite: --shapes names no shape; valid: {', '.join(SHAPE_KEYS)}")
        shapes = tuple(self.shapes) if self.shapes else SHAPE_KEYS
        bad = [s for s in shapes if s not in SHAPE_KEYS]
        if bad:
            raise ValueError(f"suite: unknown shape(s) {', '.join(bad)}; valid: {', '.join(SHAPE_KEYS)}")
        bad = [t for t in self.treatments if t not in TREATMENTS]
        if bad or not self.treatments:
            raise ValueError(f"suite: treatments must be a non-empty subset of {', '.join(TREATMENTS)}, got "
                             f"{', '.join(self.treatments) or 'none'}")
        tokens = pick(self.tokens, 16, 2048, 2048)
        cfg = replace(self, device=str(device), dtype=self.dtype or ("bfloat16" if cuda else "float32"),
                      shapes=shapes, tokens=tokens, warmup=pick(self.warmup, 1, 50, 2), runs=pick(self.runs, 3, 200, 5),
                      new_tokens=pick(self.new_tokens, 4, 128, 128), decode_warmup=pick(self.decode_warmup, 0, 2, 1),
                      decode_runs=pick(self.decode_runs, 1, 10, 3),
                      decode_compiled=self.decode_compiled if self.decode_compiled is not None else not q,
                      vocab_size=pick(self.vocab_size, 256, 32768, 32768),
                      threads=self.threads if self.threads is not None else (1 if q and not cuda else None),
                      short_window=self.short_window if self.short_window is not None else
                      (max(tokens // 2, 1) if q else 512))
        if cfg.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"suite: dtype must be float32, bfloat16 or float16, got {cfg.dtype!r}")
        counts = (cfg.tokens, cfg.runs, cfg.new_tokens, cfg.decode_runs, cfg.prompt_len, cfg.vocab_size,
                  cfg.threads or 1)
        if min(counts) < 1 or min(cfg.warmup, cfg.decode_warmup) < 0 or not cfg.blocks or min(cfg.blocks) < 1:
            raise ValueError("suite: tokens, runs, new_tokens, decode_runs, prompt_len, vocab_size, threads and every "
                             "block must be >= 1, warm-ups >= 0")
        return cfg


@dataclass(frozen=True)
class ShapeInfo:
    """What every row of one shape carries: the shape as run (shrunk with quick) and its model's bytes."""

    shape: str  # Shape.key
    shape_title: str
    n_layer: int
    n_embd: int
    n_head: int
    hc_streams: int
    x0: bool  # x0 residual (off with mHC)
    ve: bool
    vocab_size: int
    model_bytes: int


@dataclass
class SuiteRow:
    """One row of the suite: a prefill (ForwardRow) or decode (DecodeRow) row of one shape and treatment,
    with the paper's number for it where the paper has one."""

    kind: str  # prefill | decode
    treatment: str  # eager | compiled
    info: ShapeInfo
    row: ForwardRow | DecodeRow
    paper: float | None = None  # prefill: PAPER_PREFILL speedup; decode snlp rows: PAPER_DRAFTER_S

    @property
    def plan(self) -> str:
        return self.row.plan

    @property
    def mode(self) -> str | None:
        """A decode row's mode (sequential / snlp / speculative); None for prefill."""
        return self.row.mode if isinstance(self.row, DecodeRow) else None

    def to_dict(self) -> dict:
        """Flat for the JSON: the row's keys (a decode row's `mode` as `decode_mode`), the shape's, kind,
        treatment, and `paper_speedup` (prefill) or `paper_drafter_s` (decode)."""
        d = self.row.to_dict()
        if self.kind == "decode":
            d["decode_mode"] = d.pop("mode")
        d.update(asdict(self.info), kind=self.kind, treatment=self.treatment)
        d["paper_speedup" if self.kind == "prefill" else "paper_drafter_s"] = self.paper
        return d


@dataclass
class SuiteMeta:
    """Where and how the suite ran (the JSON's "meta"): device, versions, dtype, date, command, load."""

    quick: bool
    device: str  # device_label: the GPU's name, or the CPU's
    device_type: str  # cuda | cpu
    torch: str
    cuda: str | None  # torch.version.cuda (None: a CPU build)
    dtype: str
    date: str  # UTC, ISO 8601
    command: str | None
    platform: str
    threads: int  # torch CPU threads during the run
    suite: str = "paper"
    weights: str = RANDOM_WEIGHTS
    batch: int = 1
    loadavg_1min_start: float | None = None  # None where os.getloadavg does not exist
    loadavg_1min_end: float | None = None
    cores: int | None = None  # the cores the run could use (snlp.runtime.load.usable_cores)
    load: dict | None = None  # the run's load window (snlp.runtime.load.LoadWindow.to_json), sampled between parts

    @classmethod
    def now(cls, cfg: SuiteConfig) -> "SuiteMeta":
        device = torch.device(cfg.device)
        return cls(quick=cfg.quick, device=device_label(device), device_type=device.type, torch=torch.__version__,
                   cuda=torch.version.cuda, dtype=cfg.dtype,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   command=cfg.command, platform=platform.platform(), threads=torch.get_num_threads(),
                   loadavg_1min_start=load_average(), cores=usable_cores())

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SuiteResult:
    config: SuiteConfig  # resolved
    meta: SuiteMeta
    records: list[SuiteRow] = field(default_factory=list)  # one per (shape, treatment, kind, row)
    markdown: str = ""
    json_path: str | None = None
    markdown_path: str | None = None
    complete: bool = False  # every shape's every part ran (False in the files a run rewrites on its way)


def _build(shape: Shape, cfg: SuiteConfig) -> GPT:
    mcfg = shape.config(cfg.vocab_size, cfg.window_pattern, cfg.short_window, max(2048, cfg.tokens + cfg.new_tokens +
                                                                                     cfg.prompt_len))
    torch.manual_seed(cfg.seed)
    model = GPT(mcfg)
    model.init_weights(seed=cfg.seed)
    return model.to(device=cfg.device, dtype=getattr(torch, cfg.dtype)).eval()


def run_suite(config: SuiteConfig) -> SuiteResult:
    """Run the paper's speed suite (see the module docstring); write JSON + markdown when config.out is set."""
    cfg = config.resolved()
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: SuiteConfig) -> SuiteResult:
    result = SuiteResult(config=cfg, meta=SuiteMeta.now(cfg))
    window = LoadWindow.begin()
    result.meta.loadavg_1min_start, result.meta.cores, result.meta.load = window.start, window.cores, window.to_json()
    shapes = [s for s in PAPER_SHAPES if s.key in cfg.shapes]
    t0 = time.perf_counter()

    def done(what: str) -> None:
        """A line per finished part, and the files rewritten with every record so far: the full CUDA protocol
        runs for minutes, and a run cut short (a timeout, a lease that ends) keeps what it measured."""
        print(f"suite: {what} done at {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
        result.meta.load = window.sample().to_json()  # between parts, outside every timed round
        _write(result, cfg)

    for shape in shapes:
        run_shape = shape.quick() if cfg.quick else shape
        model = _build(run_shape, cfg)
        plans = [Plan.parse(p, run_shape.depth) for p in shape.plans]
        info = ShapeInfo(shape=shape.key, shape_title=shape.title, n_layer=run_shape.depth, n_embd=run_shape.width,
                         n_head=run_shape.width // run_shape.head_dim, hc_streams=shape.hc_streams,
                         x0=shape.x0 and not shape.hc_streams, ve=shape.ve, vocab_size=cfg.vocab_size,
                         model_bytes=model_bytes(model))
        for treatment in cfg.treatments:
            compiled = treatment == "compiled"
            if compiled and cfg.quick and shape.key != QUICK_COMPILED:
                continue
            rows = benchmark(model, plans, tokens=cfg.tokens, batch=1, warmup=cfg.warmup, runs=cfg.runs,
                             compile=compiled, seed=cfg.seed)
            result.records += [SuiteRow("prefill", treatment, info, r, PAPER_PREFILL.get((shape.key, r.plan)))
                               for r in rows]
            done(f"{shape.key} {treatment} prefill")
            if cfg.decode and (cfg.decode_compiled or not compiled):
                result.records += _decode(model, plans, cfg, treatment, info)
                done(f"{shape.key} {treatment} decode")
            if compiled:
                torch._dynamo.reset()  # free this shape's graphs (and CUDA-graph pools) before the next
        del model
        if torch.device(cfg.device).type == "cuda":
            torch.cuda.empty_cache()
    result.meta.load = window.close().to_json()
    result.meta.loadavg_1min_end = window.end
    result.complete = True
    _write(result, cfg)
    return result


def _write(result: SuiteResult, cfg: SuiteConfig) -> None:
    """result.markdown from the records so far, and suite.json + suite.md under cfg.out (when set)."""
    result.markdown = markdown(result)
    if cfg.out:
        out = Path(cfg.out)
        result.json_path, result.markdown_path = str(out / "suite.json"), str(out / "suite.md")
        write_json(result.json_path, {"meta": result.meta, "config": cfg, "records": result.records,
                                      "complete": result.complete}, announce=False)
        write_atomic(result.markdown_path, result.markdown)  # a kill between parts never leaves half a table


def _decode(model: GPT, plans: list[Plan], cfg: SuiteConfig, treatment: str, info: ShapeInfo) -> list[SuiteRow]:
    # compiled: static-shape steps (snlp.decode.steps) on both sides, compile time apart, host syncs per step
    # counted; the sequential row carries gpt-fast's "bandwidth achieved" = model bytes x tokens/s (bandwidth_gb_s)
    rows = decode_benchmark(model, plans, prompt_len=cfg.prompt_len, new_tokens=cfg.new_tokens, blocks=cfg.blocks,
                            warmup=cfg.decode_warmup, runs=cfg.decode_runs, seed=cfg.seed,
                            compile=treatment == "compiled")
    return [SuiteRow("decode", treatment, info, r,
                     PAPER_DRAFTER_S.get((info.shape, r.plan)) if r.mode == "snlp" else None) for r in rows]


# ----------------------------------------------------------------------------------------- markdown
def _x(v, fmt="{:.2f}x") -> str:
    return "-" if v is None else fmt.format(v)


def _speedup(r: SuiteRow | None) -> str:
    """A row's speedup over its sequential row, "(tie)" where its paired rounds do not resolve it (tie_mark)."""
    return "-" if r is None else f"{r.row.speedup:.2f}x{tie_mark(r.row.speedup_rounds, r.row.speedup)}"


def _find(rows: list[SuiteRow], shape: str, plan: str, kind: str, treatment: str,
          mode: str | None = None) -> SuiteRow | None:
    """The first row of this shape, plan, kind and treatment (and decode mode, when given)."""
    for r in rows:
        if (r.info.shape, r.plan, r.kind, r.treatment) == (shape, plan, kind, treatment) and mode in (None, r.mode):
            return r
    return None


def markdown(result: SuiteResult) -> str:
    """The suite as markdown: a header (device, versions, protocol, RANDOM weights), one speedup table
    (ours beside the paper's) and one baseline table (sequential ms, compile time, decode bandwidth)."""
    shapes = [s for s in PAPER_SHAPES if s.key in result.config.shapes]
    partial = [] if result.complete else [partial_line("the rows of the parts that had finished"), ""]
    lines = [*_header(result), "", *partial, *_speedup_table(shapes, result.records, result.config.quick), "",
             "Sequential baselines (the denominators): prefill median ms; compile s = the untimed calls that "
             "compile every callable of that treatment (never inside a timing); decode ms/token; GB/s = model bytes "
             "x tokens/s of sequential decoding (gpt-fast's 'bandwidth achieved'); syncs = host syncs per compiled "
             "decode step, the most over its steps (0 is the contract).", "",
             *_baseline_table(shapes, result.records), "",
             "Columns: *ideal (layers)* = L / (S + K x evals [+1 fwd]), the op-count ideal; *ideal (struct.)* = "
             "t_seq / (t_fixed + steps x t_layer) with the embedding + head time t_fixed measured (eager); *prefill* "
             "and *decode* = sequential time / plan time, same treatment both sides; *of struct.* = speedup / "
             "structural ideal of that treatment; *paper prefill* = tab:main_results Speedup (H100, eager, bf16); "
             "*paper s* = tab:ssd_results drafter speedup. '-' = not run or not in the paper.", "",
             tie_footnote(result.config.runs, "prefill speedup", "sequential ms / plan ms of the same round"), "",
             *([tie_footnote(result.config.decode_runs, "decode speedup", "sequential / plan ms per token of the "
                             "same run"), ""] if result.config.decode else [])]
    return "\n".join(lines)


def _header(result: SuiteResult) -> list[str]:
    cfg, m = result.config, result.meta
    lines = [f"## snlp bench --suite paper{' --quick' if cfg.quick else ''}", "",
             f"- {RANDOM_WEIGHTS}; batch 1; {m.dtype} on {m.device} ({m.device_type}); torch {m.torch}, "
             f"CUDA {m.cuda or '-'}; {m.threads} CPU threads; {m.date}",
             f"- prefill: T = {cfg.tokens}, {cfg.warmup} warm-up + {cfg.runs} timed rounds (round-robin, medians); "
             f"decode: prompt {cfg.prompt_len}, {cfg.new_tokens} new tokens, {cfg.decode_warmup} warm-up + "
             f"{cfg.decode_runs} timed runs" + ("" if cfg.decode else " (not run)"),
             f"- window pattern {cfg.window_pattern} (short window {cfg.short_window}), vocab {cfg.vocab_size}"]
    if cfg.quick:
        lines.append("- QUICK: smoke-size shapes (width 64, depth = largest suffix + 2), NOT the paper's shapes; "
                     f"compiled prefill only on {QUICK_COMPILED}"
                     + ("" if cfg.decode_compiled else ", no compiled decode"))
    if m.loadavg_1min_start is not None:
        end = float("nan") if m.loadavg_1min_end is None else m.loadavg_1min_end
        lines.append(f"- 1-min load average: {m.loadavg_1min_start:.2f} at start, {end:.2f} at end")
        if note := suite_load_note(m):
            lines.append(f"- **{note}**")
    if m.command:
        lines.append(f"- command: `{m.command}`")
    return lines


def suite_load_note(m: SuiteMeta) -> str | None:
    """The contention sentence of a suite's run (snlp.runtime.load.contention_note) from its meta: its window's
    peak (or, in a file written before the window was recorded, the higher of its start and end load) against its
    cores and its own torch threads (one on a GPU, whose host thread is the only one busy); None for a file
    written before the meta recorded its cores."""
    if m.load is not None:  # the window sampled between parts
        return LoadWindow(**m.load).note(own_threads([m.threads], m.device_type))
    if m.cores is None or m.loadavg_1min_start is None:
        return None
    loads = [x for x in (m.loadavg_1min_start, m.loadavg_1min_end) if x is not None]
    window = LoadWindow(start=m.loadavg_1min_start, end=m.loadavg_1min_end, peak=max(loads), cores=m.cores)
    return window.note(own_threads([m.threads], m.device_type))


def _speedup_table(shapes: list[Shape], recs: list[SuiteRow], quick: bool = False) -> list[str]:
    """Per (shape, plan): the ideals, our prefill / decode speedups (eager, compiled), the paper's beside them.
    `quick` shrinks every shape, so its rows are named "(smoke)" and the paper's columns say they are of the full
    shape: a smoke row's speedup is no comparison with the paper's."""
    rows = []
    for shape in shapes:
        for plan in shape.plans:
            pe, pc = (_find(recs, shape.key, plan, "prefill", t) for t in TREATMENTS)
            de, dc = (_find(recs, shape.key, plan, "decode", t, mode="snlp") for t in TREATMENTS)
            any_p = pe or pc
            rows.append([
                f"{shape.key} (smoke)" if quick else shape.key, f"`{plan}`",
                _x(any_p and any_p.row.ideal_layer_speedup),
                _x(pe and pe.row.structural_ideal), _speedup(pe),
                _x(pe and 100 * pe.row.of_structural, "{:.0f}%"), _speedup(pc),
                _x(pc and 100 * pc.row.of_structural, "{:.0f}%"), _x(PAPER_PREFILL.get((shape.key, plan))),
                _speedup(de), _speedup(dc), _x(PAPER_DRAFTER_S.get((shape.key, plan)))])
    full = " (full shape)" if quick else ""
    return markdown_table(["shape", "plan", "ideal (layers)", "ideal (struct.)", "prefill eager", "of struct.",
                           "prefill compiled", "of struct.", f"paper prefill{full}", "decode eager", "decode compiled",
                           f"paper s (SSD drafter){full}"], rows)


def _baseline_table(shapes: list[Shape], recs: list[SuiteRow]) -> list[str]:
    """Per shape: the sequential rows (the speedups' denominators), compile times and decode bandwidth."""
    rows = []
    for shape in shapes:
        pe, pc = (_find(recs, shape.key, "sequential", "prefill", t) for t in TREATMENTS)
        de, dc = (_find(recs, shape.key, "sequential", "decode", t) for t in TREATMENTS)
        any_r = pe or pc or de or dc
        if any_r is None:
            continue
        mine = [r for r in recs if r.info.shape == shape.key and r.treatment == "compiled"]
        p_comp = (sum(r.row.compile_s for r in mine if r.kind == "prefill") + pc.row.fixed_compile_s) if pc else None
        d_comp = sum(r.row.compile_s for r in mine if r.kind == "decode" and r.mode != "speculative") \
            if dc else None  # the speculative rows reuse the drafter's and the sequential verifier's graphs
        syncs = max(r.row.host_syncs for r in mine if r.kind == "decode") if dc else None
        rows.append([
            shape.key, str(any_r.info.n_layer), str(any_r.info.n_embd), f"{any_r.info.model_bytes / 1e6:.1f}",
            _x(pe and pe.row.median_ms, "{:.3f}"), _x(pc and pc.row.median_ms, "{:.3f}"), _x(p_comp, "{:.1f}"),
            _x(de and de.row.ms_per_token, "{:.3f}"), _x(dc and dc.row.ms_per_token, "{:.3f}"), _x(d_comp, "{:.1f}"),
            _x(de and de.row.bandwidth_gb_s, "{:.2f}"), _x(dc and dc.row.bandwidth_gb_s, "{:.2f}"),
            _x(syncs, "{:g}")])
    return markdown_table(["shape", "L", "D", "model MB", "prefill eager ms", "prefill compiled ms",
                           "prefill compile s", "decode eager ms/tok", "decode compiled ms/tok", "decode compile s",
                           "decode eager GB/s", "decode compiled GB/s", "syncs"], rows)

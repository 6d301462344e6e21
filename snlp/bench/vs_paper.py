"""`snlp bench --vs-paper PATH`: snlp and the paper's code on the paper's prefill suite, side by side.

For each shape of snlp.bench.suite.PAPER_SHAPES the paper's GPT (random weights) and snlp's GPT of the
same shape are built on one device; every callable below runs on the same tokens, round-robin in one
process (so load drift hits all alike), after a common warm-up; medians and spreads are reported:
  - paper: its sequential forward as published (fp32 weights cast per call, masked SDPA for short
    windows), the two baseline ablations (bf16 weights; windows off), and each plan through the path
    its evaluator uses (snlp.bench.paper_peer.paper_plan_fn);
  - snlp: its sequential forward and each plan (bound runner), eager and/or (the treatments asked for)
    torch.compile fullgraph (CUDA graphs on CUDA; compile time reported apart); eager, where the suffix windows
    bite, each plan also with `-causal` (variant "causal (eager)"): the paper path's full-causal suffix, named, so
    its timing has a like-for-like pair (the correctness check compares that plan's logits with the paper's too).
Both speedup definitions are in the table: the paper's (its sequential as published / its plan) and the
strongest-baseline one (the fastest sequential either side offers / the plan). Every ratio is marked "(tie)" where
the sign test over its paired rounds does not resolve it (the JSON's "ratios", with each round's ratio). Random
weights: speed only.
"""

from __future__ import annotations

import copy
import functools
import datetime
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from snlp.bench.forward import COMPILE_CALLS, compile_step
from snlp.bench.paper_peer import (PaperCode, PeerRow, build_paper_model, cast_linear_weights, load_paper_code,
                                   paper_config, paper_plan_fn, paper_sequential_fn, snlp_model_from_paper,
                                   summarise, time_side_by_side)
from snlp.bench.records import markdown_table, write_json
from snlp.bench.stats import paired_marks, tie_footnote, tie_mark
from snlp.bench.suite import PAPER_PREFILL, PAPER_SHAPES, SHAPE_KEYS, Shape
from snlp.decode.steps import check_compilable, mark_static_runner
from snlp.method.plan import Plan
from snlp.method.solver import bind
from snlp.runtime.device import device_label, write_atomic
from snlp.runtime.outputs import partial_line
from snlp.runtime.load import LoadWindow, own_threads
from snlp.runtime.timing import now

TREATMENTS = ("eager", "compiled")


@dataclass
class VsPaperConfig:
    """What to run; None = the device's default (see `resolved`)."""

    paper: str  # path of the paper's checkout
    shapes: tuple[str, ...] | None = None  # keys of PAPER_SHAPES; None: the three 0.5B shapes
    device: str | None = None
    quick: bool = False  # CPU smoke: shrunk shapes (width 64), T = 256 (windows of 128 bite), few runs
    tokens: int | None = None  # None: 2048 (the paper's prefill), 256 with quick
    warmup: int | None = None  # None: 20 on cuda, 1 elsewhere
    runs: int | None = None  # None: 50 on cuda, 3 elsewhere
    treatments: tuple[str, ...] = ("eager",)
    ablations: bool = True  # the paper baseline's bf16-weights and windows-off variants, snlp's windows-off
    vocab_size: int | None = None  # None: 32768 (256 with quick)
    seed: int = 0
    out: str | None = None  # directory for vs_paper.json and vs_paper.md
    command: str | None = None

    def resolved(self) -> "VsPaperConfig":
        device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--vs-paper: device cuda requested but CUDA is not available; use cpu")
        if self.shapes is not None and not self.shapes:  # given, but empty (e.g. --shapes ","): not the default
            raise ValueError(f"--vs-paper: --shapes names no shape; valid: {', '.join(SHAPE_KEYS)}")
        # each shape once: a repeated one was timed twice, and its table rows and ratios read the first run only
        shapes = tuple(dict.fromkeys(self.shapes)) if self.shapes else SHAPE_KEYS[:3]
        bad = [s for s in shapes if s not in SHAPE_KEYS]
        if bad:
            raise ValueError(f"--vs-paper: unknown shape(s) {', '.join(bad)}; valid: {', '.join(SHAPE_KEYS)}")
        bad = [t for t in self.treatments if t not in TREATMENTS]
        if bad or not self.treatments:
            raise ValueError(f"--vs-paper: treatments must be a non-empty subset of {', '.join(TREATMENTS)}")
        cuda, q = device.type == "cuda", self.quick
        cfg = replace(self, device=str(device), shapes=shapes,
                      tokens=self.tokens if self.tokens is not None else (256 if q else 2048),
                      warmup=self.warmup if self.warmup is not None else (1 if q or not cuda else 20),
                      runs=self.runs if self.runs is not None else (3 if q or not cuda else 50),
                      vocab_size=self.vocab_size if self.vocab_size is not None else (256 if q else 32768))
        if min(cfg.tokens, cfg.runs, cfg.vocab_size) < 1 or cfg.warmup < 0:
            raise ValueError("--vs-paper: tokens, runs and vocab size must be >= 1, warm-up >= 0")
        if cfg.tokens < 2:
            raise ValueError("--vs-paper: the paper's forward needs T >= 2 (its smear gate reads the previous token)")
        return cfg


@dataclass
class Agreement:
    """One plan's logits on both sides, same weights, same tokens (fp32 on the CPU): max |paper - snlp| and each
    side's max |plan - its sequential|, for the windows as published and for a window-free copy of the model."""

    shape: str
    plan: str
    windows: str  # "SSSL" (as published) | "L" (window-free copy)
    paper_vs_snlp: float  # max abs logit difference, paper's plan vs snlp's plan
    paper_vs_seq: float  # paper's plan vs the (shared) sequential model
    snlp_vs_seq: float
    same_function: bool  # paper_vs_snlp within fp32 round-off: AGREE_TOL x the largest |logit| of the sequential model
    why: str  # where they differ: the paper path's approximation(s) that apply here
    logit_scale: float = 0.0  # the largest |logit| of the sequential model (same_function's scale)

    def to_dict(self) -> dict:
        return asdict(self)


AGREE_TOL = 1e-5  # relative to the logits' scale: fp32 round-off of two orderings of the same arithmetic is ~1e-7,
#                   one dropped window of one layer moves them ~4e-3 (the paper's init keeps logits small: |logit| ~ 3e-2)


@dataclass
class VsPaperResult:
    config: VsPaperConfig
    meta: dict
    rows: list[PeerRow] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)  # {shape, callable, error, traceback}
    agreement: list[Agreement] = field(default_factory=list)
    markdown: str = ""
    complete: bool = False  # every shape ran (False in the files a run rewrites on its way)


def _meta(cfg: VsPaperConfig, code: PaperCode) -> dict:
    dev = torch.device(cfg.device)
    return dict(device=device_label(dev), device_type=dev.type, torch=torch.__version__, cuda=torch.version.cuda,
                dtype=str(code.dtype).replace("torch.", ""), python=platform.python_version(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=cfg.command, paper_root=code.root, paper_stubs=code.stubs,
                weights="random weights (timing only)", batch=1, threads=torch.get_num_threads())


def paper_dtype(device) -> torch.dtype:
    """nanochat's compute dtype on `device`, which both sides run in: bf16 on CUDA, fp32 elsewhere (as the paper)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def run_vs_paper(config: VsPaperConfig) -> VsPaperResult:
    cfg = config.resolved()
    dev = torch.device(cfg.device)
    code = load_paper_code(cfg.paper, paper_dtype(dev))
    result = VsPaperResult(config=cfg, meta=_meta(cfg, code))
    window = LoadWindow.begin()  # sampled between shapes, outside every timed round
    result.meta["load"] = window.to_json()
    t0 = time.perf_counter()
    for key in cfg.shapes:
        shape = next(s for s in PAPER_SHAPES if s.key == key)
        try:
            _run_shape(shape, cfg, code, dev, result)
        except Exception as e:  # one shape's failure must not discard the others' rows
            result.failures.append(_failure(key, "shape", e))
        result.meta["load"] = window.sample().to_json()
        print(f"vs-paper: {key} done at {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
        _write(result, cfg)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    result.meta["load"] = window.close().to_json()
    result.complete = True
    _write(result, cfg)
    return result


def _failure(shape: str, what: str, e: BaseException) -> dict:
    return dict(shape=shape, callable=what, error=f"{type(e).__name__}: {e}".splitlines()[0][:400],
                traceback=traceback.format_exc())


def _run_shape(shape: Shape, cfg: VsPaperConfig, code: PaperCode, dev: torch.device, result: VsPaperResult) -> None:
    run_shape = shape.quick() if cfg.quick else shape
    # the context the paper's model is built for, which sets its short window (ceil(seq_len / 4 / 128) * 128 tokens):
    # 2048 as in the paper; with quick the tokens themselves, so the 128-token windows bite at T = 256
    seq_len = cfg.tokens if cfg.quick else max(2048, cfg.tokens)
    pcfg = paper_config(code, run_shape, cfg.vocab_size, seq_len, "SSSL")
    paper = build_paper_model(code, pcfg, dev, cfg.seed)
    plans = [Plan.parse(p, run_shape.depth) for p in shape.plans]
    gen = torch.Generator().manual_seed(cfg.seed)
    idx = torch.randint(0, cfg.vocab_size, (1, cfg.tokens), generator=gen).to(dev)
    fns, meta = {}, {}

    def add(name, fn, side, plan, variant, note=""):  # fn: a callable of no argument (a compiled one)
        fns[name], meta[name] = fn, (side, plan, variant, note)

    def add_idx(name, fn, *rest):  # fn: a forward of the tokens, called on this shape's idx
        add(name, functools.partial(fn, idx), *rest)

    add_idx("paper/sequential", paper_sequential_fn(code, paper), "paper", "sequential",
        "as published", "fp32 weights cast per Linear call; short windows through a boolean-mask SDPA")
    if cfg.ablations:
        add_idx("paper/sequential/windows-off", paper_sequential_fn(code, paper, False), "paper", "sequential", "windows off", "every layer full causal (flash SDPA): a different function")
        if code.dtype != torch.float32:
            paper_bf16 = cast_linear_weights(copy.deepcopy(paper), code.dtype)
            add_idx("paper/sequential/bf16-weights", paper_sequential_fn(code, paper_bf16), "paper", "sequential", "bf16 weights", "weights cast once, not per call")
    for plan in plans:
        try:
            add_idx(f"paper/{plan}", paper_plan_fn(code, paper, plan, run_shape), "paper", str(plan), "as published",
                    paper_path_note(code, pcfg, plan, cfg.tokens))
        except Exception as e:
            result.failures.append(_failure(shape.key, f"paper/{plan}", e))

    model = snlp_model_from_paper(paper, dev, code.dtype)  # the paper model's own weights and window widths
    runners = {str(p): bind(model, p, check_finite=False) for p in plans}
    eager = "eager" in cfg.treatments  # --treatments compiled: snlp's eager rows are not run (the paper's are its own)
    if eager:
        add_idx("snlp/sequential", model, "snlp", "sequential", "eager")
        for name, r in runners.items():
            add_idx(f"snlp/{name}", r, "snlp", name, "eager")
    if cfg.ablations and eager:
        model_l = snlp_model_from_paper(build_paper_model(code, paper_config(
            code, run_shape, cfg.vocab_size, seq_len, "L"), dev, cfg.seed), dev, code.dtype)
        add_idx("snlp/sequential/windows-off", model_l, "snlp", "sequential", "windows off (eager)",
            "every layer full causal: a different function")
        for p in plans:
            add_idx(f"snlp/{p}/windows-off", bind(model_l, p, check_finite=False), "snlp", str(p), "windows off (eager)",
                "every layer full causal: a different function")
    if eager:  # the paper path's own function where the suffix windows bite: the like-for-like pair of its timing
        for p in plans:
            if _windows_bite(code, pcfg, p, cfg.tokens) and not p.causal:
                add_idx(f"snlp/{p}/causal", bind(model, p.with_(causal=True), check_finite=False), "snlp", str(p),
                        "causal (eager)", f"{p.with_(causal=True)}: suffix full causal, prefix windowed, as the paper's "
                        "path")
    compile_s = {}
    if "compiled" in cfg.treatments:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(plans) + 4)
        targets = {"snlp/sequential/compiled": (lambda: model(idx), "sequential")}
        for name, r in runners.items():
            try:
                check_compilable(r.plan)
            except ValueError as e:
                result.failures.append(_failure(shape.key, f"snlp/{name}/compiled", e))
                continue
            if dev.type == "cuda":
                mark_static_runner(r)
            targets[f"snlp/{name}/compiled"] = ((lambda r: lambda: r(idx))(r), name)
        for name, (fn, plan) in targets.items():
            cfn = compile_step(fn, dev)
            try:
                t = now(dev)
                with torch.inference_mode():
                    for _ in range(COMPILE_CALLS):
                        cfn()
                compile_s[name] = now(dev) - t
                add(name, cfn, "snlp", plan, "compiled", "torch.compile fullgraph" +
                    (", CUDA graphs (reduce-overhead)" if dev.type == "cuda" else ""))
            except Exception as e:
                result.failures.append(_failure(shape.key, name, e))
    # the same tokens for every callable; one failing callable is dropped before timing, not the shape
    with torch.inference_mode():
        for name in list(fns):
            try:
                fns[name]()
            except Exception as e:
                result.failures.append(_failure(shape.key, name, e))
                del fns[name]
    times = time_side_by_side(fns, cfg.warmup, cfg.runs, dev)
    result.rows += summarise(shape.key, times, meta, compile_s)
    if dev.type == "cpu":  # fp32: the correctness check (on a GPU bf16 round-off would hide small differences)
        try:
            result.agreement += agreement(code, shape, run_shape, plans, cfg, seq_len, dev)
        except Exception as e:
            result.failures.append(_failure(shape.key, "agreement", e))


PATH_NOTE = "its parallel path: "  # paper_path_note's lead; what follows are its parts, "; "-separated
OWN_FUNCTION = "the plan's own function"  # paper_path_note where nothing applies
STACKING = "stacks the chunk weights inside every call"  # a cost of forward_idn_chunkwise, no other function


def paper_path_note(code: PaperCode, pcfg, plan: Plan, tokens: int) -> str:
    """The timing table's note on the paper's path for `plan`: what it computes differently from the plan
    (_approximations, for this model and T) and, for C x FM with C > 1 (forward_idn_chunkwise), the stacking of the
    chunk weights it does inside every call; 1 x FM (forward_idn_fused) and C x F1 use weights built once."""
    why = _approximations(plan, _windows_bite(code, pcfg, plan, tokens), pcfg)
    if plan.fuse > 1 and plan.chunks > 1:
        why.append(STACKING)
    return PATH_NOTE + ("; ".join(why) if why else OWN_FUNCTION)


def _windows_bite(code: PaperCode, pcfg, plan: Plan, tokens: int) -> bool:
    """Whether a sliding window of the plan's suffix layers is shorter than the T tokens (a window w reaches w
    tokens back: it changes nothing while w >= T - 1)."""
    return any(w < tokens - 1 for w, _ in _paper_windows(code, pcfg)[-plan.n_suffix:])


def _approximations(plan: Plan, windowed: bool, cfg_paper) -> list[str]:
    """What the paper's path for `plan` computes differently from the plan over the same model (a `causal` plan drops
    the suffix windows as the paper's path does)."""
    why = []
    if windowed and not plan.causal:
        why.append("drops the sliding windows in the suffix (full causal attention)")
    if plan.fuse > 1 and not cfg_paper.no_ve:
        why.append("drops the value embeddings in fused chunks")
    if plan.fuse > 1 and not cfg_paper.no_x0_resid:
        why.append("scales fused chunks by averaged resid / x0 lambdas")
    L = cfg_paper.n_layer
    if plan.chunks == 1 and plan.fuse > 1:  # forward_idn_fused
        if L // 2 >= L - plan.n_suffix:
            why.append("subtracts the backout from the chunk's input (it fills every suffix state with it), not from "
                       f"layer {L // 2}'s output")
        if plan.iters > 1:
            why.append("applies the fused block to its own output once per extra iteration (F(F(h)); snlp's 1xFM is "
                       "exact after K = 1)")
    return why


def agreement(code: PaperCode, shape: Shape, run_shape: Shape, plans: list[Plan], cfg: VsPaperConfig, seq_len: int,
              dev) -> list[Agreement]:
    """Both sides' plans on the same weights and tokens, with the published windows and window-free."""
    out = []
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    idx = torch.randint(0, cfg.vocab_size, (1, cfg.tokens), generator=gen).to(dev)
    for pattern in ("SSSL", "L"):
        pcfg = paper_config(code, run_shape, cfg.vocab_size, seq_len, pattern)
        paper = build_paper_model(code, pcfg, dev, cfg.seed)
        model = snlp_model_from_paper(paper, dev, torch.float32)
        with torch.inference_mode():
            seq = model(idx).float()
            scale = seq.abs().max().item()
            for plan in plans:
                p = paper_plan_fn(code, paper, plan, run_shape)(idx).float()
                bite = _windows_bite(code, pcfg, plan, cfg.tokens)
                # where the windows bite, snlp's causal plan (the paper's full-causal suffix, named) is the like-for-like
                for sp in (plan, plan.with_(causal=True)) if bite and not plan.causal else (plan,):
                    sn = bind(model, sp)(idx).float()
                    d = (p - sn).abs().max().item()
                    why = _approximations(sp, bite, pcfg)  # a tie of the logits makes an approximation harmless
                    out.append(Agreement(shape=shape.key, plan=str(sp), windows=pattern, paper_vs_snlp=d,
                                         paper_vs_seq=(p - seq).abs().max().item(),
                                         snlp_vs_seq=(sn - seq).abs().max().item(), logit_scale=scale,
                                         same_function=d <= AGREE_TOL * scale,
                                         why="; ".join(why) if why else "-"))
    return out


def _paper_windows(code: PaperCode, pcfg) -> list[tuple[int, int]]:
    return code.gpt.GPT._compute_window_sizes(None, pcfg)


# ------------------------------------------------------------------------------------------ report
def _write(result: VsPaperResult, cfg: VsPaperConfig) -> None:
    result.markdown = markdown(result)
    if cfg.out:
        out = Path(cfg.out)
        write_json(out / "vs_paper.json", {"meta": result.meta, "config": asdict(cfg), "rows": result.rows,
                                           "ratios_note": RATIOS_NOTE, "ratios": paired_ratios(result),
                                           "agreement": result.agreement, "failures": result.failures,
                                           "complete": result.complete}, announce=False)
        write_atomic(out / "vs_paper.md", result.markdown)  # a kill between shapes never leaves half a table


def _get(rows, shape, side, plan, variant) -> PeerRow | None:
    return next((r for r in rows if (r.shape, r.side, r.plan, r.variant) == (shape, side, plan, variant)), None)


def _ms(r: PeerRow | None) -> str:
    return "-" if r is None else f"{r.median_ms:.2f} ({r.p10_ms:.2f}-{r.p90_ms:.2f})"


def _rounds(a: PeerRow, b: PeerRow) -> list[float] | None:
    """a's ms / b's ms round by round (both timed in one shape's round-robin), or None without per-round times."""
    if not a.times_ms or not b.times_ms or len(a.times_ms) != len(b.times_ms):
        return None
    return [x / y for x, y in zip(a.times_ms, b.times_ms)]


def _ratio(a: PeerRow | None, b: PeerRow | None) -> str:
    """a's median ms over b's, "(tie)" where the paired rounds do not resolve it from 1.00x (tie_mark)."""
    if a is None or b is None:
        return "-"
    value = a.median_ms / b.median_ms
    return f"{value:.2f}x{tie_mark(_rounds(a, b), value)}"


RATIOS = ("paper_over_snlp", "paper_speedup", "snlp_vs_strongest_seq")  # the table's three ratio columns


def _ratio_rows(rows: list[PeerRow], key: str, plan: str) -> dict[str, tuple[PeerRow, PeerRow] | None]:
    """The (numerator, denominator) rows of each RATIOS column for one (shape, plan), None where the column is '-':
    the paper's time over snlp's fastest treatment, the paper's own speedup, the strongest sequential over snlp."""
    p_seq = _get(rows, key, "paper", "sequential", "as published")
    seqs = [r for r in rows if r.plan == "sequential" and "windows off" not in r.variant]
    best = min(seqs, key=lambda r: r.median_ms) if seqs else None
    pp = _get(rows, key, "paper", plan, "as published")
    fastest = min((r for r in (_get(rows, key, "snlp", plan, "eager"), _get(rows, key, "snlp", plan, "compiled"))
                   if r), key=lambda r: r.median_ms, default=None)
    pair = lambda a, b: (a, b) if a is not None and b is not None else None  # noqa: E731
    seq = plan == "sequential"
    return {"paper_over_snlp": pair(p_seq if seq else pp, fastest),
            "paper_speedup": None if seq else pair(p_seq, pp),
            "snlp_vs_strongest_seq": None if seq else pair(best, fastest)}


# what a "ratios" entry's verdict says, in the JSON beside the entries: each ratio is numerator ms / denominator ms,
# so the verdict reads as the denominator's against the numerator (stats.paired_verdict: baseline over method)
RATIOS_NOTE = ("value and rounds: the numerator's ms / the denominator's ms (> 1: the denominator took less time); "
               "verdict 'faster': the DENOMINATOR is faster (the sign test over the rounds resolves ratios > 1), "
               "'slower': the numerator is faster, 'tie': the rounds resolve neither; wins / losses: the rounds "
               "the denominator was faster / slower; faster_side names the faster one (None for a tie)")


def paired_ratios(result: VsPaperResult) -> list[dict]:
    """Every ratio of the markdown table with its per-round ratios and the sign test's verdict on them (the JSON's
    "ratios"; snlp.bench.stats.paired_marks): what the table's "(tie)" marks rest on. The verdict is the
    denominator's (RATIOS_NOTE), and `faster_side` names the side it found faster."""
    out = []
    for key in result.config.shapes:
        shape = next(s for s in PAPER_SHAPES if s.key == key)
        rs = [r for r in result.rows if r.shape == key]
        for plan in ("sequential",) + tuple(shape.plans):
            for name, pair in _ratio_rows(rs, key, plan).items():
                if pair is not None:
                    a, b = pair
                    rounds = _rounds(a, b)
                    marks = paired_marks(rounds)
                    num, den = f"{a.side} {a.plan} {a.variant}", f"{b.side} {b.plan} {b.variant}"
                    out.append({"shape": key, "plan": plan, "ratio": name, "value": a.median_ms / b.median_ms,
                                "numerator": num, "denominator": den, "rounds": rounds, **marks,
                                "faster_side": {"faster": den, "slower": num}.get(marks["verdict"])})
    return out


def paper_paths_sentence(rows: list[PeerRow]) -> str:
    """The table footnote on what the paper's timed plan paths compute, from their rows' notes (paper_path_note,
    for this run's models and T): what they compute other than snlp's plans where anything applies, else that they
    compute the plans' own functions (window-free suffixes, or windows no longer than T, no value embeddings in
    fused chunks, ...)."""
    parts = [r.note.removeprefix(PATH_NOTE).split("; ") for r in rows
             if r.side == "paper" and r.plan != "sequential" and r.note.startswith(PATH_NOTE)]
    if not parts:
        return ""
    why = [w for w in dict.fromkeys(w for ws in parts for w in ws) if w not in (OWN_FUNCTION, STACKING)]
    if not why:
        return "The paper's parallel paths timed here compute the plans' own functions (as snlp's plans do)."
    return (f"The paper's parallel paths timed here compute other functions than the plans (snlp's plans compute "
            f"the plans): {'; '.join(why)} (each path's note below says which apply to it).")


def markdown(result: VsPaperResult) -> str:
    cfg, m = result.config, result.meta
    lines = [f"## snlp bench --vs-paper{' --quick' if cfg.quick else ''}", "",
             f"- {m['weights']}; batch 1; T = {cfg.tokens}; {m['dtype']} on {m['device']}; torch {m['torch']}, "
             f"CUDA {m['cuda'] or '-'}; {m['date']}",
             f"- {cfg.warmup} warm-up + {cfg.runs} timed rounds, every callable round-robin in one process; ms = median "
             "(p10-p90); host clock around a device synchronise",
             f"- the paper's code: {m['paper_root']}" + (f" (stand-ins for {', '.join(m['paper_stubs'])})"
                                                         if m["paper_stubs"] else "")]
    if cfg.quick:
        lines.append("- QUICK: smoke-size shapes (width 64), NOT the paper's shapes")
    if m.get("load") is not None and "threads" in m and \
            (note := LoadWindow(**m["load"]).note(own_threads([m["threads"]], m["device_type"]))):
        lines.append(f"- **{note}**")
    if not result.complete:
        lines += ["", partial_line("the rows of the shapes that had finished")]
    rows = []
    for key in cfg.shapes:
        shape = next(s for s in PAPER_SHAPES if s.key == key)
        rs = [r for r in result.rows if r.shape == key]
        for plan in ("sequential",) + tuple(shape.plans):
            pairs = _ratio_rows(rs, key, plan)
            rows.append([f"{key} (smoke)" if cfg.quick else key, f"`{plan}`",
                         _ms(_get(rs, key, "paper", plan, "as published")),
                         _ms(_get(rs, key, "snlp", plan, "eager")), _ms(_get(rs, key, "snlp", plan, "compiled")),
                         *(_ratio(*pairs[name]) if pairs[name] else "-" for name in RATIOS),
                         f"{PAPER_PREFILL[(key, plan)]:.2f}x" if (key, plan) in PAPER_PREFILL else "-"])
    # --quick shrinks every shape: its rows say so, and the paper's column that its number is of the full shape (a
    # smoke row's speedup beside it is no comparison), as in the paper suite's table
    lines += ["", *markdown_table(
        ["shape", "plan", "paper ms", "snlp eager ms", "snlp compiled ms", "paper ms / snlp ms",
         "paper's speedup (its seq / its plan)", "snlp vs strongest seq",
         "paper's table (full shape)" if cfg.quick else "paper's table"], rows)]
    lines += ["", "*paper ms / snlp ms*: the paper's time over snlp's fastest treatment (> 1: snlp is faster). "
              "*strongest seq*: the fastest sequential forward timed for that shape on either side (its variant "
              "below). " + paper_paths_sentence(result.rows),
              "", tie_footnote(cfg.runs, "ratio", "the two callables' ms of the same round, every callable once per "
                               "round")]
    abl = [[r.shape, r.side, f"`{r.plan}`", r.variant, _ms(r), "-" if r.compile_s is None else f"{r.compile_s:.1f}",
            r.note] for r in result.rows]
    lines += ["", "Every timed callable:", "", *markdown_table(
        ["shape", "side", "plan", "variant", "ms (p10-p90)", "compile s", "note"], abl)]
    if result.agreement:
        lines += ["", f"Correctness (fp32, same weights and tokens; agree = max |paper - snlp| <= {AGREE_TOL:g} x the "
                  "largest |logit| of the sequential model):", "",
                  *markdown_table(["shape", "plan", "windows", "max |paper - snlp|", "paper plan vs seq",
                                   "snlp plan vs seq", "agree", "the paper's path differs by"],
                                  [[a.shape, f"`{a.plan}`", a.windows, f"{a.paper_vs_snlp:.2e}", f"{a.paper_vs_seq:.2e}",
                                    f"{a.snlp_vs_seq:.2e}", "yes" if a.same_function else "no", a.why]
                                   for a in result.agreement])]
    if result.failures:
        lines += ["", "Failures (the JSON has the tracebacks):", ""]
        lines += [f"- {f['shape']} {f['callable']}: {f['error']}" for f in result.failures]
    return "\n".join(lines) + "\n"

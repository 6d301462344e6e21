"""`snlp selfcheck`: the first command a GPU user runs.

In a few minutes on the user's device it checks the laws that matter (each against an outside reference: the fused
model run sequentially, the sequential forward, single rows, the eager path, transformers' own logits), then times a
small version of the paper's speed suite (eager and compiled; prefill = a forward over T tokens, decode = KV-cached
greedy decoding) and returns one record: device, versions, every check and every number, for a bug report.

The laws run in fp32 (tolerances for fp32 accumulation order, which differs between a fused and an unfused
kernel); the timings in the device's default dtype (bf16 on CUDA, fp32 on CPU). Nothing here is asserted about speed.
"""

from __future__ import annotations

import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from snlp.bench.decode import decode_benchmark
from snlp.bench.forward import ModelSpec, benchmark, build_model
from snlp.bench.stats import fewest_sign_rounds, paired_verdict, tie_mark
from snlp.decode.generate import sequential_generate
from snlp.decode.speculative import speculative_generate
from snlp.decode.steps import sequential_step, snlp_fn
from snlp.method.plan import Plan
from snlp.method.solver import bind, fused_sequential, parallel_forward, solve
from snlp.model.fingerprint import weights_fingerprint
from snlp.model.gpt import GPT, GPTConfig
from snlp.runtime.load import LoadWindow, begin_timing, own_threads


@dataclass
class SelfcheckConfig:
    """What to run. `quick`: a smaller speed suite (CI); `compile`: the compiled checks and timings too."""

    device: str = "cpu"
    quick: bool = False
    compile: bool = True
    seed: int = 0


@dataclass
class Check:
    """One law or refusal: passed, what was compared (max error / tokens), seconds; for a check that raised, the
    traceback (the JSON carries it whole: the table's one line cannot hold, say, an inductor failure's cause)."""

    name: str
    passed: bool | None  # None: skipped (e.g. transformers not installed)
    detail: str
    seconds: float
    traceback: str | None = None


def failure(e: BaseException) -> str:
    """One line that names what went wrong: the exception's type and its first non-empty lines, then the innermost
    cause of its chain. A wrapper's first line alone can say nothing (torch's BackendCompilerFailed starts with
    "backend='inductor' raised:" and puts the reason on the lines after: all the first GPU run's report showed)."""
    def text(x: BaseException) -> str:
        lines = [ln.strip() for ln in str(x).splitlines() if ln.strip()]
        return f"{type(x).__name__}: {' | '.join(lines[:3])}" if lines else type(x).__name__

    root, seen = e, {id(e)}
    while (nxt := root.__cause__ or root.__context__) is not None and id(nxt) not in seen:
        root = nxt
        seen.add(id(root))
    out = text(e) if root is e else f"{text(e)} <- {text(root)}"
    return out[:600]


@dataclass
class SelfcheckResult:
    device: str
    device_name: str
    versions: dict
    config: dict
    checks: list[Check] = field(default_factory=list)
    forward: list[dict] = field(default_factory=list)  # snlp.bench.forward.ForwardRow dicts (prefill)
    decode: list[dict] = field(default_factory=list)  # snlp.bench.decode.DecodeRow dicts
    seconds: float = 0.0
    load: dict | None = None  # the speed suite's load window (snlp.runtime.load.LoadWindow.to_json)
    threads: int = 1  # torch CPU threads the speed suite timed with

    @property
    def passed(self) -> bool:
        return all(c.passed is not False for c in self.checks)

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def versions() -> dict:
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None}
    from snlp import __version__

    out["snlp"] = __version__
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = None
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def law_model(device, seed: int = 0) -> GPT:
    """A small fp32 model whose blocks are not identities (the product's init zeroes the output projections,
    which would make every law hold trivially): init + seeded noise on every parameter."""
    cfg = GPTConfig(vocab_size=97, n_layer=8, n_head=4, n_kv_head=2, n_embd=64, sequence_len=128,
                    window_pattern="SL", short_window=5)
    model = GPT(cfg)
    model.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.to(device).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (one host read: a check, not a hot path)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _ids(model: GPT, B: int, T: int, seed: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)  # the same ids on every device
    return torch.randint(0, model.config.vocab_size, (B, T), generator=gen).to(device)


TOL = 1e-4  # fp32: a fused chunk sums in another order than the layers it fuses


def law_checks(device, compile: bool, seed: int = 0) -> list[Check]:
    model = law_model(device, seed)
    idx = _ids(model, 2, 24, seed, device)
    prompts = [[int(t) for t in _ids(model, 1, n, seed + n, "cpu")[0]] for n in (5, 9)]
    checks: list[Check] = []

    def run(name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            passed, detail = fn()
        except Exception as e:  # a check that crashes fails with its reason: the report must still be written
            checks.append(Check(name, False, failure(e), time.perf_counter() - t0, traceback.format_exc()))
            return
        checks.append(Check(name, passed, detail, time.perf_counter() - t0))

    @torch.no_grad()
    def fused_exact():
        plan = Plan.parse("3xF2-h0-K3")
        err = _rel(solve(model, idx, plan).hidden, fused_sequential(model, idx, plan).hidden)
        return err < TOL, f"K >= C: SNLP vs the fused model run sequentially, max rel err {err:.2e} (tol {TOL})"

    @torch.no_grad()
    def m1_sequential():
        err = _rel(parallel_forward(model, idx, "4xF1-h0-K4"), model(idx))
        return err < TOL, f"M = 1, K = C: SNLP logits vs the sequential forward, max rel err {err:.2e}"

    @torch.no_grad()
    def argmax_loop(p: list[int], n: int) -> list[int]:
        """The outside reference of every decoding law: greedy by a full forward over the whole prefix per token (no
        KV cache, no static shapes), so a defect of the cached paths cannot hide in both sides of a law."""
        ids = list(p)
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids], device=device))[0, -1].argmax()))
        return ids[len(p):]

    def cached():
        ref = [argmax_loop(p, 12) for p in prompts]
        got = [sequential_generate(model, p, 12).tokens for p in prompts]
        return got == ref, f"KV-cached greedy decoding == a full-prefix argmax loop for {len(prompts)} prompts"

    def speculative():
        ref = [argmax_loop(p, 12) for p in prompts]
        got = [speculative_generate(model, p, "4xF1-h0-K1", block=3, max_new_tokens=12).tokens for p in prompts]
        return got == ref, f"greedy speculative (4xF1-h0-K1, B=3) tokens == the argmax loop for {len(prompts)} prompts"

    def batched():
        ref = [argmax_loop(p, 10) for p in prompts]
        got = [r.tokens for r in sequential_generate(model, prompts, 10)]
        spec = [r.tokens for r in speculative_generate(model, prompts, "4xF1-h0-K1", block=3, max_new_tokens=10)]
        return got == ref and spec == ref, "batched rows (ragged prompts 5, 9) == each row alone (sequential, " \
                                           "speculative)"

    def compiled():
        step = sequential_step(model, compile=True)
        ref = [argmax_loop(p, 8) for p in prompts]
        got = [sequential_generate(model, p, 8, step=step).tokens for p in prompts]
        spec = [r.tokens for r in speculative_generate(model, prompts, "4xF1-h0-K1", block=3, max_new_tokens=8,
                                                       compile=True, verify=step)]
        return got == ref and spec == ref, f"compiled sequential step (compile {step.compile_s:.1f} s) and " \
                                           "compiled speculative batch (drafter + padded verifier) == the argmax loop"

    def hf():
        try:
            import transformers
        except ImportError:
            return None, "transformers not installed: skipped"
        from snlp.io.hf import model_from_hf

        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                       attn_implementation="sdpa")
        ref_model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
        ours = model_from_hf(ref_model).to(device)
        ref_model = ref_model.to(device)
        x = _ids(ours, 2, 16, seed, device)
        with torch.no_grad():
            err = _rel(ours(x), ref_model(x).logits)
        return err < TOL, f"converted Llama logits vs transformers' own, max rel err {err:.2e}"

    def fingerprints():
        a, b = weights_fingerprint(model), weights_fingerprint(model)
        other = law_model("cpu", seed + 3)
        c = weights_fingerprint(other)
        return a == b and a != c, "weights fingerprint: stable for one model, different for other weights"

    def refusals():
        refused = []
        for what, fn in [("a malformed plan", lambda: Plan.parse("3xFoo")),
                         ("a compiled step with the host-side NaN check", lambda: snlp_fn(bind(model, "4xF1-h0-K1"))),
                         ("a tol plan compiled", lambda: snlp_fn(bind(model, "4xF1-h0-K4-tol:1e-3",
                                                                      check_finite=False))),
                         ("the preheat init without a calibration", lambda: solve(model, idx, "4xF1-preheat-K1"))]:
            try:
                fn()
            except ValueError:
                refused.append(what)
                continue
            return False, f"not refused: {what}"
        return True, "refused with a ValueError: " + "; ".join(refused)

    run("cached decoding == argmax loop", cached)
    run("K >= C reproduces the fused model", fused_exact)
    run("M = 1 equals sequential", m1_sequential)
    run("speculative greedy == sequential", speculative)
    run("batched rows == single rows", batched)
    if compile:
        run("compiled == eager", compiled)
    else:
        checks.append(Check("compiled == eager", None, "skipped (--compile off)", 0.0))
    run("transformers logits", hf)
    run("fingerprints", fingerprints)
    run("refusals", refusals)
    return checks


def speed_suite(device, quick: bool, compile: bool, seed: int = 0) -> tuple[list[dict], list[dict], list[Check]]:
    """A small version of the paper's speed column: prefill (a T-token forward) and KV-cached decoding,
    sequential vs SNLP plans, eager and (with `compile`) compiled. Each of the (up to) four parts runs on its own:
    one that raises becomes a failed check with its reason and traceback, and the rows of the others are kept."""
    spec = ModelSpec(depth=4 if quick else 8, aspect_ratio=32, head_dim=32 if quick else 64,
                     vocab_size=1024 if quick else 4096, seed=seed)
    model = build_model(spec).to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    L = model.config.n_layer
    plans = [Plan.parse(f"1xF{L // 2}-h0-K1", L), Plan.parse(f"{L // 2}xF1-h0-K1", L)]
    T = 64 if quick else 512
    runs, warm = (3, 1) if quick else (10, 2)
    forward, decode, failed = [], [], []
    for comp in ([False, True] if compile else [False]):
        parts = {"prefill": (forward, lambda: benchmark(model, plans, tokens=T, warmup=warm, runs=runs, compile=comp,
                                                         seed=seed)),
                 "decode": (decode, lambda: decode_benchmark(model, plans[1:], prompt_len=8,
                                                             new_tokens=8 if quick else 32, blocks=(3,), warmup=1,
                                                             runs=1 if quick else 3, seed=seed, compile=comp))}
        for part, (rows, fn) in parts.items():
            t0 = time.perf_counter()
            try:
                rows += [r.to_dict() for r in fn()]
            except Exception as e:
                failed.append(Check(f"speed: {'compiled' if comp else 'eager'} {part} runs", False, failure(e),
                                    time.perf_counter() - t0, traceback.format_exc()))
        if comp:
            torch._dynamo.reset()  # free the graphs (and CUDA-graph pools) of this model
    return forward, decode, failed


def selfcheck(cfg: SelfcheckConfig) -> SelfcheckResult:
    device = torch.device(cfg.device)
    t0 = time.perf_counter()
    res = SelfcheckResult(device=str(device), device_name=device_name(device), versions=versions(), config=asdict(cfg))
    res.checks = law_checks(device, cfg.compile, cfg.seed)
    t1 = time.perf_counter()
    res.threads = torch.get_num_threads()
    # the laws above are not timed: the window holds the speed suite alone; selfcheck has no --threads
    window = begin_timing([res.threads], device, remedy=None)
    try:
        res.forward, res.decode, failed = speed_suite(device, cfg.quick, cfg.compile, cfg.seed)
        res.checks += failed
    except Exception as e:  # the report (with the laws' results) must still be written: the failure is a check
        res.checks.append(Check("speed suite runs", False, failure(e), time.perf_counter() - t1,
                                traceback.format_exc()))
    res.load = window.close().to_json()
    res.seconds = time.perf_counter() - t0
    return res


def above_ideal(row: dict) -> str:
    """The note after a decode row whose speedup exceeds its ideal SSD speedup, from the row's own runs: each run's
    paired speedup against the ideal by the sign test the "(tie)" marks use. Not resolved (too few runs, or runs on
    both sides): the excess is within what the runs vary, "noise". Resolved above it: not noise, and the note sets
    the tokens per round the runs made beside the (1 - a^(B+1)) / (1 - a) the ideal expects at the row's alpha (it
    assumes each draft accepted independently at alpha, and a verifier step that costs one sequential step); ""
    where the row has no ideal or is not above it."""
    ideal = row.get("ideal_ssd_speedup")
    if not ideal or not row["speedup"] > ideal:
        return ""
    runs = row.get("speedup_rounds") or []
    if not runs:
        return f"  (above its ideal SSD {ideal:.2f}x; no per-run speedups recorded to tell that from noise)"
    verdict, above, below, p = paired_verdict([x / ideal for x in runs])
    n = len(runs)
    if verdict != "faster":
        return (f"  (above its ideal SSD {ideal:.2f}x in {above} of {n} run{'s' if n != 1 else ''}: not resolved "
                f"from it by the sign test, noise)")
    a, b = row.get("alpha"), row.get("block")
    expect = (b + 1.0 if a >= 1 else (1 - a ** (b + 1)) / (1 - a)) if a is not None and b else None
    why = (f"; {row['tokens_per_round']:.2f} tokens per round measured, {expect:.2f} the ideal expects at alpha "
           f"{a:.2f}" if expect is not None and row.get("tokens_per_round") is not None else "")
    return f"  (above its ideal SSD {ideal:.2f}x in {above} of {n} runs, sign test p = {p:.3f}: not noise{why})"


def table(res: SelfcheckResult) -> list[str]:
    """The pass/fail table and the speed rows, as lines of text."""
    lines = [f"snlp selfcheck on {res.device} ({res.device_name}); torch {res.versions['torch']}, "
             f"CUDA {res.versions['cuda']}", ""]
    w = max(len(c.name) for c in res.checks)
    for c in res.checks:
        mark = "PASS" if c.passed else ("skip" if c.passed is None else "FAIL")
        lines.append(f"{mark}  {c.name:<{w}}  {c.detail}  ({c.seconds:.1f} s)")
    # how many timed runs each speed row is: the quick suite's decode rows are ONE run (a smoke test of the timing
    # path), and a CPU run printed a speculative 7.21x beside its ideal SSD 3.29x with nothing to say so
    # each kind with its own count (3 prefill runs and 1 decode run with --quick): one merged list of counts cannot
    # say whose each count is
    counts = [(kind, sorted({r["runs"] for r in rows if r.get("runs") is not None}))
              for kind, rows in (("prefill", res.forward), ("decode", res.decode))]
    said = [f"{'/'.join(map(str, ns))} timed run{'' if ns == [1] else 's'} per {kind} row" for kind, ns in counts if ns]
    if said:
        lines += ["", f"speed rows: the median of {', '.join(said)}; below {fewest_sign_rounds()} paired runs no "
                      f"speedup here is resolved from noise: a check that the timing paths run, not a measurement "
                      f"(snlp bench for that)"]
    # "(tie)" (the sign test over the paired runs) stands beside the speedup it qualifies, the column widened for it
    cells = {id(r): f"{r['speedup']:6.2f}x{tie_mark(r.get('speedup_rounds'), r['speedup'])}"
             for r in res.forward + res.decode}
    w = max(map(len, cells.values()), default=7)
    lines += ["", "prefill (forward over T tokens)    ms     speedup" + " " * (w - 5) + "compiled"]
    for r in res.forward:
        lines.append(f"  {r['plan']:<30} {r['median_ms']:8.2f} {cells[id(r)]:<{w}}  {r['compiled']}")
    lines += ["", "decode (greedy, KV cache)          ms/tok speedup" + " " * (w - 5) + "compiled"]
    for r in res.decode:
        name = r["mode"] if r["mode"] == "sequential" else f"{r['mode']} {r['plan']}" + \
            (f" B={r['block']}" if r["block"] else "")
        above = above_ideal(r)
        lines.append(f"  {name:<30} {r['ms_per_token']:8.2f} {cells[id(r)]:<{w}}  {r['compiled']}{above}")
    if res.load is not None and (note := LoadWindow(**res.load).note(own_threads([res.threads], res.device))):
        lines += ["", note]
    # a skipped check (passed None) did not run: "ALL CHECKS PASSED" alone read as if it had been verified too
    skipped = [c.name for c in res.checks if c.passed is None]
    verdict = ("SOME CHECKS FAILED" if not res.passed else "ALL CHECKS PASSED" if not skipped else
               f"ALL CHECKS THAT RAN PASSED ({len(res.checks) - len(skipped)} of {len(res.checks)}; not run: "
               f"{', '.join(skipped)})")
    lines += ["", f"{verdict} in {res.seconds:.0f} s"]
    return lines

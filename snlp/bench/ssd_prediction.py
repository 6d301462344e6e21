"""`snlp bench --suite decode --shapes SHAPE --alpha A`: a PREDICTED self-speculative speedup at one of the paper's
shapes (snlp.bench.suite.PAPER_SHAPES) with random weights.

Random weights time the steps faithfully (speed does not depend on the weights) but have no meaningful acceptance
rate, so alpha is GIVEN (from a trained model's measured row of the decode suite, snlp.bench.decode_suite). Measured
here, at batch 1 after a prompt: the sequential single-token step, each drafter plan's single-token step (s = their
ratio) and the verifier's step over B + 1 positions; predicted = expected tokens per round x t_seq / (B t_draft +
t_verify), beside the paper's formula (t_verify = t_seq, snlp.decode.speculative.ideal_ssd_speedup). Every number it
prints is labelled a prediction.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch

from snlp.bench.suite import PAPER_SHAPES, SHAPE_KEYS
from snlp.decode.speculative import ideal_ssd_speedup
from snlp.decode.steps import sequential_step, snlp_step
from snlp.method.plan import Plan
from snlp.method.solver import bind
from snlp.model.gpt import GPT
from snlp.runtime.device import device_label
from snlp.runtime.timing import time_round_robin


@dataclass
class PredictionRow:
    """A drafter plan at a paper shape with random weights: measured step times, the drafter speedup s, and the
    PREDICTED end-to-end self-speculative speedup for an acceptance rate alpha that was given, not measured."""

    shape: str
    plan: str
    block: int
    alpha: float  # given (from a trained model), not measured: random weights have no meaningful alpha
    treatment: str
    sequential_ms: float  # a single-token sequential step (forward + argmax read), median
    drafter_ms: float  # a single-token drafter step, median
    verify_ms: float  # the verifier's step over block + 1 positions, median
    s: float  # sequential_ms / drafter_ms
    predicted_speedup: float  # tokens per round x sequential_ms / (block x drafter_ms + verify_ms)
    predicted_paper_formula: float  # ideal_ssd_speedup(alpha, block, s): the verifier priced as one sequential step
    n_layer: int
    n_embd: int
    device: str
    device_type: str
    dtype: str
    rounds: int
    label: str = "PREDICTION (random weights, alpha given)"

    def to_dict(self) -> dict:
        return asdict(self)


def shape_config(key: str, quick: bool):
    """(the GPTConfig of the random model timed at paper shape `key`, the shape run: its quick copy with `quick`);
    its layers keep nanochat's SSSL sliding windows (8 tokens quick, else 512)."""
    shape = next(s for s in PAPER_SHAPES if s.key == key)
    run = shape.quick() if quick else shape
    return run.config(256 if quick else 32768, "SSSL", 8 if quick else 512, 2048), run


def _shape_model(key: str, quick: bool, device, dtype, seed: int) -> tuple[GPT, object]:
    cfg, run = shape_config(key, quick)
    torch.manual_seed(seed)
    model = GPT(cfg)
    model.init_weights(seed=seed)
    return model.to(device=device, dtype=dtype).eval(), run


def step_times(model: GPT, steps: dict, prompt_len: int, warmup: int, rounds: int, device) -> dict[str, list[float]]:
    """ms per call of each `steps[name] = (step, T)`: T tokens at batch 1 after a prompt of prompt_len, the argmax
    of the last position read on the host (what a decode loop does every step), the cache rolled back after each
    call so every call runs at the same position. One untimed call of each, then `warmup` untimed and `rounds`
    timed rounds round-robin (snlp.runtime.timing)."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=gen)
    longest = max(T for _, T in steps.values())
    # one cache for every step, prefilled once by the first (the sequential step): a drafter reads the prefix K/V
    # the model wrote, as in self-speculative decoding, and no step compiles a prefill graph of its own
    first = next(iter(steps.values()))[0]
    cache = first.new_cache(model, 1, max(s.cache_len(s.prefill_len(prompt_len) + s.slack + longest)
                                          for s, _ in steps.values()))
    with torch.inference_mode():
        first.prefill(prompt.to(device), cache)

    def call(step, T):
        start = cache.length
        x = torch.zeros(1, T, dtype=torch.long, device=device)
        step(x, cache, pad_to=T)[:, -1].argmax(-1).tolist()
        cache.rollback(start)
    fns = {k: (lambda s=s, T=T: call(s, T)) for k, (s, T) in steps.items()}
    for fn in fns.values():  # compiles (a compiled step's first call at a shape), whatever `warmup` says
        fn()
    return time_round_robin(fns, warmup, rounds, device)


def paper_shape_prediction(shape: str = "0.5B", alphas: tuple[float, ...] = (0.6, 0.8), plans=None,
                           blocks: tuple[int, ...] = (4,), quick: bool = False, device: str | None = None,
                           dtype: str | None = None, treatments: tuple[str, ...] | None = None,
                           warmup: int | None = None, rounds: int | None = None, seed: int = 0,
                           threads: int | None = None, prompt_len: int = 16) -> list[PredictionRow]:
    """Random weights at a paper shape: s of each drafter plan (the shape's own plans unless `plans`) and the
    PREDICTED end-to-end speedup at each given alpha and block (module docstring), the steps timed after a prompt of
    `prompt_len` tokens. `threads`: torch CPU threads
    during the run (restored after); None: leave them, 1 with quick on the CPU."""
    if shape not in SHAPE_KEYS:
        raise ValueError(f"unknown shape {shape!r}; valid: {', '.join(SHAPE_KEYS)}")
    bad = [a for a in alphas if not 0.0 <= a <= 1.0]
    if bad or not alphas:
        raise ValueError(f"alpha must lie in [0, 1] (an acceptance rate), got {bad or 'none'}")
    if not blocks or min(blocks) < 1 or prompt_len < 1:
        raise ValueError("every block and the prompt length must be >= 1")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    dt = dtype or ("bfloat16" if cuda else "float32")
    treatments = treatments or (("eager", "compiled") if cuda else ("eager",))
    warmup = warmup if warmup is not None else (1 if quick else 5 if cuda else 2)
    rounds = rounds if rounds is not None else (3 if quick else 50 if cuda else 10)
    before = torch.get_num_threads()
    threads = threads if threads is not None else (1 if quick and not cuda else None)
    if threads:
        torch.set_num_threads(threads)
    try:
        return _predict(shape, alphas, plans, blocks, quick, dev, dt, treatments, warmup, rounds, seed, prompt_len)
    finally:
        torch.set_num_threads(before)


def _predict(shape, alphas, plans, blocks, quick, dev, dt, treatments, warmup, rounds, seed,
             prompt_len) -> list[PredictionRow]:
    model, run = _shape_model(shape, quick, dev, getattr(torch, dt), seed)
    L = model.config.n_layer
    plans = [Plan.parse(p, L) for p in (plans or run.plans)]
    for p in plans:
        p.check(L)
    rows = []
    for treatment in treatments:
        comp = treatment == "compiled"
        seq = sequential_step(model, comp)
        steps = {"seq": (seq, 1)}
        steps.update({("verify", b): (seq, b + 1) for b in blocks})
        steps.update({p: (snlp_step(bind(model, p, check_finite=False), comp), 1) for p in plans})
        ms = {k: statistics.median(v) for k, v in step_times(model, steps, prompt_len, warmup, rounds, dev).items()}
        for p in plans:
            s = ms["seq"] / ms[p]
            for b in blocks:
                for a in alphas:
                    per_round = b + 1.0 if a >= 1.0 else (1.0 - a ** (b + 1)) / (1.0 - a)
                    rows.append(PredictionRow(
                        shape=shape, plan=str(p), block=b, alpha=a, treatment=treatment, sequential_ms=ms["seq"],
                        drafter_ms=ms[p], verify_ms=ms[("verify", b)], s=s,
                        predicted_speedup=per_round * ms["seq"] / (b * ms[p] + ms[("verify", b)]),
                        predicted_paper_formula=ideal_ssd_speedup(a, b, s), n_layer=L, n_embd=model.config.n_embd,
                        device=device_label(dev), device_type=dev.type, dtype=dt, rounds=rounds))
    return rows


def prediction_markdown(rows: list[PredictionRow], quick: bool) -> str:
    r0 = rows[0]
    lines = [f"# PREDICTED self-speculative speedup, random weights at the paper's {r0.shape} shape"
             f"{' (shrunk: --quick)' if quick else ''}", "",
             f"{r0.device}, {r0.dtype}, L={r0.n_layer} D={r0.n_embd}; step times are medians of {r0.rounds} rounds "
             f"(batch 1, argmax read each step); alpha is GIVEN, not measured; predicted = tokens per round x "
             f"t_seq / (B t_draft + t_verify(B+1)); paper formula = the same with t_verify = t_seq. These are "
             f"predictions, not measured end-to-end speedups."
             + (" (CPU numbers)" if r0.device_type == "cpu" else ""), "",
             "| treatment | plan | B | alpha | seq ms | drafter ms | verify ms | s | PREDICTED speedup | "
             "paper formula |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.treatment} | {r.plan} | {r.block} | {r.alpha:.2f} | {r.sequential_ms:.3f} | "
                     f"{r.drafter_ms:.3f} | {r.verify_ms:.3f} | {r.s:.2f} | {r.predicted_speedup:.2f}x (predicted) | "
                     f"{r.predicted_paper_formula:.2f}x (predicted) |")
    return "\n".join(lines)

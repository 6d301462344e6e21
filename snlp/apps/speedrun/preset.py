"""The speedrun's settings: the presets (FULL, QUICK), the model and data config, the default plan grid."""

from __future__ import annotations

import dataclasses



REG_LAMBDA = 0.5


BLOCKS = (2, 4, 8)


SELECT_BLOCK = 4  # block size at which the drafter rule compares plans


@dataclasses.dataclass(frozen=True)
class Preset:
    """Everything a speedrun does that its flags do not set."""

    depth: int
    width: int
    head_dim: int
    vocab_size: int
    seq_len: int
    batch_size: int
    minutes: float | None  # training wall-clock budget, both models (None: train for `steps` or the budget's share)
    steps: int | None  # optimizer steps of each model when there is no time budget
    max_chars: int  # corpus cap (0 = all of it)
    eval_max_tokens: int
    eval_prompts: int
    eval_prompt_len: int
    eval_gen_tokens: int
    eval_warmup: int
    eval_runs: int
    eval_time_tokens: int  # tokens decoded per timed decode run (>= 32 in FULL: a lone first step misleads)
    ssd_prompts: int
    ssd_tokens: int
    ssd_repeats: int  # timed SSD rounds (after a warm-up of both sides); the report shows medians
    est_eval_s: float  # rough wall time of the evaluation stages, for the start-up estimate
    eval_threads: int = 1  # intra-op threads for evaluation and SSD (0 = torch's default)
    ots_plans: tuple[str, ...] = ("8xF1-h0-K1", "8xF1-h0-K2", "4xF2-h0-K1", "8xF1-h0-K8")  # off-the-shelf
    ots_tokens: int = 4096  # predicted tokens for the off-the-shelf PPL
    ots_adapt_minutes: float = 0.0  # off-the-shelf: minutes of `snlp adapt` of the 8xF1-h0-K1 drafter (0 = none)
    ots_check_tokens: int = 16  # and its SSD check (alpha, output == the model's): greedy tokens per prompt and drafter
    diag_power_iters: int = 10  # Jacobian diagnostics stage (snlp.eval.analysis): power iterations for sigma_max
    diag_probes: int = 8  # and Hutchinson / amplification probes
    tune_top: int = 3  # ssd-*: snlp tune's shortlist, measured end to end (stage 2)
    tune_prompts: int = 3  # and its brief measurement: prompts x tokens x timed rounds (medians)
    tune_tokens: int = 32  # 6 rounds of 32 tokens cost what 3 rounds of 64 did: the rounds' time comes from their length
    tune_repeats: int = 6  # the fewest at which its sign test can resolve a lead (snlp.bench.stats.fewest_sign_rounds)
    tune_accept_tokens: int = 64  # stage 1's acceptance profile: greedy SSD tokens per prompt and plan
    budget_minutes: float | None = None  # the whole run's wall-clock budget (`--budget`; training gets what is left)


# FULL fits 20 minutes on 2 idle cores: 10 min of training, then ~8 min of stages. Measured per
# unit (1 thread, CPU s): eval-* = teacher-forced 2.6 s per 1024 tokens (seq + 7 plans) + generations 17 s
# + 2.5 s per timing round; off-the-shelf = 25 s load + 30 s per 1024 tokens + 18 s generations + 15 s per
# timing round; SSD ~ prompts x tokens x repeats. Hence 8192 eval tokens (the plan-vs-sequential
# statistics are paired over the same tokens), 2 + 10 timing rounds (medians of 10, round-robin), 4 SSD
# prompts x 128 tokens x 3 rounds, 2048 off-the-shelf tokens with 1 + 3 rounds: ~14 min of stages -> ~8. SSD
# times 6 rounds: the fewest at which the report's sign test can tell SSD from sequential decoding
# (snlp.bench.stats.fewest_sign_rounds; with fewer, every SSD speedup would read as a tie whatever it was).
FULL = Preset(depth=16, width=128, head_dim=32, vocab_size=4096, seq_len=256, batch_size=8, minutes=None, steps=None,
              max_chars=0, eval_max_tokens=8192, eval_prompts=8, eval_prompt_len=16, eval_gen_tokens=32,
              eval_warmup=2, eval_runs=10, eval_time_tokens=32, ssd_prompts=4, ssd_tokens=128, ssd_repeats=6,
              est_eval_s=560, ots_tokens=1024, ots_adapt_minutes=1.0, budget_minutes=20.0)  # est: measured 2026-11-24 (docs/records/speedrun-2026-11-26.md)


QUICK = Preset(ots_plans=("8xF1-h0-K1",), ots_tokens=256, depth=8, width=64, head_dim=32, vocab_size=512, seq_len=64, batch_size=8, minutes=None, steps=120,
               max_chars=1_000_000, eval_max_tokens=2048, eval_prompts=4, eval_prompt_len=8, eval_gen_tokens=16,
               eval_warmup=1, eval_runs=5, eval_time_tokens=16, ssd_prompts=2, ssd_tokens=32, ssd_repeats=2,
               est_eval_s=30, tune_tokens=8, tune_accept_tokens=16)


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The corpus and tokenizer of a speedrun: the tokenizer stage's settings, shared by both models."""

    data: str
    max_chars: int  # corpus cap (0 = all of it)
    vocab_size: int


@dataclasses.dataclass(frozen=True)
class SpeedrunConfig:
    """The model, data and training settings of a speedrun (its flags over the preset): what both models
    are trained with, and the "settings" of summary.json."""

    data: str
    max_chars: int
    vocab_size: int
    depth: int
    width: int
    head_dim: int
    seq_len: int
    batch_size: int
    seed: int
    reg_n: int  # N of the IDN regulariser and of the default plans: suffix_depth(L) = 3L/4
    device: str
    minutes: float | None
    steps: int | None

    @property
    def data_spec(self) -> DataSpec:
        return DataSpec(data=self.data, max_chars=self.max_chars, vocab_size=self.vocab_size)


def suffix_depth(n_layer: int) -> int:
    """The parallel suffix N of a depth-L speedrun: three quarters of the depth, as the paper (its 32-layer
    0.5B models regularise and parallelise a suffix of N = 24, tab. idn_reg_ablation), e.g. 12 of 16 layers.
    The drafter then runs L - N = L/4 layers one after another instead of L/2 (with N = 8 of 16 the sequential
    prefix capped the drafter's speedup, and SSD's with it)."""
    return max(1, (3 * n_layer) // 4)


def default_plans(n_layer: int) -> list[str]:
    """The default grid on the N = suffix_depth(L) suffix layers, aggressive to conservative: one layer per
    chunk at K = 1, 2, 4 and with the one-shot `fwd` init, 2-layer fused chunks at K = 1, 2, and the whole
    suffix fused into one chunk (exact for the fused model). `snlp tune` picks the SSD drafter among them. K stops at
    N (K = C chunks is exact): on N = 1 or 2 suffix layers, K = 2 and 4 name one plan twice, which parse_plans
    refuses, and `--depth 2` / `--depth 3` failed on a grid the user never typed."""
    N = suffix_depth(n_layer)
    plans = [f"{N}xF1-h0-K{k}" for k in sorted({min(k, N) for k in (1, 2, 4)})]
    if N > 1:  # one layer's forward init is that layer: the plan is exact at K = 0
        plans.append(f"{N}xF1-fwd-K1")
    if N % 2 == 0 and N >= 4:
        plans += [f"{N // 2}xF2-h0-K1", f"{N // 2}xF2-h0-K2"]
    if N > 1:
        plans.append(f"1xF{N}-h0-K1")
    return plans


def eval_config(preset: Preset, seed: int, progress: bool = True):
    from snlp.eval.protocol import EvalConfig

    return EvalConfig(seq_len=preset.seq_len, max_tokens=preset.eval_max_tokens, prompts=preset.eval_prompts,
                      prompt_len=preset.eval_prompt_len, gen_tokens=preset.eval_gen_tokens,
                      warmup=preset.eval_warmup, runs=preset.eval_runs, time_tokens=preset.eval_time_tokens,
                      emb=True, seed=seed, progress=progress)

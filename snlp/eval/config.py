"""The settings of an evaluation (`EvalConfig`, read by snlp.eval.protocol.evaluate): a module of its own, free
of torch, so the command line builds its flags' defaults from it without loading the library."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalConfig:
    """Protocol settings of `evaluate` (see the module docstring); `evaluate` never modifies it."""

    seq_len: int = 256  # tokens per PPL window
    max_tokens: int = 32768  # predicted tokens for PPL / Top-1 / LogitSim (at least one window)
    prompts: int = 8  # AR-match / EmbSim prompts drawn from the validation tokens
    prompt_len: int = 16
    gen_tokens: int = 32  # greedy tokens generated per prompt (the T of the beta conversion)
    warmup: int = 3  # timing: untimed rounds
    runs: int = 20  # timing: timed rounds (medians)
    # tokens decoded per timed decode run; speedup = ratio of decode time / time_tokens. Not 1: a lone
    # first decode step right after the prefill is not representative (measured 2.7x vs 1.5x over 16)
    time_tokens: int = 32
    emb: bool = True  # compute EmbSim (needs the emb extra and a tokenizer)
    seed: int = 0  # picks the prompts
    progress: bool = True  # progress bars on stderr
    batch: int = 8  # windows per teacher-forced forward

    def check(self) -> None:
        """Raise a ValueError naming every out-of-range setting (and a switch that is not True or False)."""
        from snlp.runtime.checks import check_bools  # here, not at the top: the module stays free of numpy too

        check_bools(emb=self.emb, progress=self.progress)
        low = [f"{k}={getattr(self, k)}" for k in ("seq_len", "max_tokens", "prompts", "prompt_len", "gen_tokens",
                                                   "runs", "time_tokens", "batch") if getattr(self, k) < 1]
        if self.warmup < 0:
            low.append(f"warmup={self.warmup}")
        if low:
            raise ValueError(f"evaluation settings out of range: {', '.join(low)} (warmup must be >= 0, the "
                             f"others >= 1)")

"""Pieces every command shares: loading a checkpoint's model with the calibration its plans need; the defaults of a
command's flags, and their spelling, for refusing a flag the run does not read; the load window around a command's
timings and the lines it prints from it."""

from __future__ import annotations

import argparse
import warnings
from typing import Callable

from snlp.io.checkpoint import checkpoint_depth, is_snlp_checkpoint, is_transformers_dir, load_config, load_preheat
from snlp.method.plan import Plan
from snlp.method.preheat import Preheat
from snlp.runtime.load import LoadWindow, own_threads
from snlp.runtime.load import say_contention as load_say

# generate's line (one process or --distributed) for a speculative run whose rounds drafted nothing (one new token:
# the prefill's), which has no acceptance rate
NO_DRAFTS = "alpha not measured (nothing was drafted: the prefill gives the first token, drafts start at the second)"


def say_contention(window: LoadWindow, threads, device="cpu", what: str = "") -> str | None:
    """Print the contention sentence of a closed `window` (snlp.runtime.load.say_contention), prefixed by `what`
    (e.g. "stage 1: "), where the load was more than the command's own busy threads explain (own_threads); returns
    it (None: not contended)."""
    return load_say(window, own_threads(threads, device), what)


def plans_preheat(ckpt, model, plans) -> Preheat | None:
    """CKPT/preheat.pt, checked against `model`, if any of `plans` starts from the preheat init; else None
    (a checkpoint's calibration is read only when a plan needs it). A preheat plan without a calibration is
    a clear error here, before any work starts."""
    plans = [p for p in plans if p is not None]
    if not any((Plan.parse(p) if isinstance(p, str) else p).init == "preheat" for p in plans):
        return None
    pre = load_preheat(ckpt, model)
    if pre is None:
        raise ValueError(f"a plan starts from the preheat init but checkpoint {ckpt} has no calibration: run "
                         f"`snlp calibrate {ckpt}` first")
    return pre


def check_plans_fit(ckpt, plans, transformers_ok: bool = False, longest: int | None = None) -> None:
    """Refuse a plan too deep for the checkpoint's model (Plan.check's error, naming the plan and the depth) before
    its weights load: the depth is read from its config alone (snlp.io.checkpoint.checkpoint_depth). An snlp
    checkpoint's whole config is read too, so a plan its model cannot take (Plan.check_model: hcn without mHC,
    -causal without a window in the suffix) is refused there as well.
    A transformers directory or a .gguf file is checked the same way (snlp.io.hf.source_config: its config.json or
    its GGUF header) only for commands that load one (`transformers_ok`, e.g. adapt, eval --harness); for the others
    `load` refuses it with what it is and the command that converts it, the more useful error.
    `longest`: the most tokens a sequence of this run holds, where the command knows it: a -causal plan whose suffix
    windows all span that many is warned about (Plan.causal_idle). `plans`: strings or Plans (None skipped)."""
    if not ckpt:
        return
    plans = [Plan.parse(p) if isinstance(p, str) else p for p in plans if p is not None]
    if transformers_ok and not is_snlp_checkpoint(ckpt):
        from snlp.io.hf import source_config  # (transformers is imported only where such a model is given)

        if (config := source_config(ckpt)) is not None:
            for p in plans:
                p.check_model(config)
            return warn_causal_idle(plans, config, longest)
    elif is_transformers_dir(ckpt):
        return
    depth = checkpoint_depth(ckpt)
    if depth is None:
        return
    for p in plans:
        p.check(depth)
    if is_snlp_checkpoint(ckpt):  # its whole config is in config.json: what else a plan needs of the model (hcn:
        try:  #                     mHC; -causal: a window in the suffix), before the weights load or data is read
            config = load_config(ckpt)
        except (OSError, ValueError):  # a corrupt config: the load says why
            return
        for p in plans:
            p.check_model(config)
        warn_causal_idle(plans, config, longest)


def warn_causal_idle(plans, config, longest: int | None) -> None:
    """Warn (once per plan) where a -causal plan changes nothing on this run's sequences of at most `longest` tokens
    (Plan.causal_idle); None: the command does not know its longest sequence before it runs. `plans`: strings or
    Plans (None, a run without a plan, skipped)."""
    if longest is None:
        return
    for p in (p for p in plans if p is not None):
        if why := (Plan.parse(p) if isinstance(p, str) else p).causal_idle(config, longest):
            warnings.warn(why, stacklevel=2)


def check_plans_grammar(text: str | None) -> list[Plan]:
    """Refuse a malformed plan of a --plans list before the model loads (whether each fits the model, its depth, is
    checked once it has: snlp.method.plan.parse_plans); no warning here for a K beyond the exact count, which
    parse_plans gives once. Returns the plans as written (unchecked against any depth)."""
    return [Plan.parse(p.strip()) for p in (text or "").split(",") if p.strip()]


def flag(dest: str) -> str:
    """The command-line spelling of an argparse dest: --dest-with-dashes."""
    return "--" + dest.replace("_", "-")


def parser_defaults(add_arguments: Callable[[argparse.ArgumentParser], None], positionals=()) -> dict:
    """Every dest's default in a fresh parser built by `add_arguments` (`positionals`: values for its required
    positional arguments): what a flag the user did not give holds."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    return vars(p.parse_args(list(positionals)))

"""A run's checkpoint beyond the weights: where it stopped (step, data position, clock, tokens), the RNG
states and the optimizer states, so `--resume` continues bitwise exactly (on CPU)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from snlp.io.checkpoint import load, load_training, save_checkpoint
from snlp.io.tokenizer import Tokenizer
from snlp.model.gpt import GPT
from snlp.train.optim import OptimizerBundle


@dataclass
class ResumePoint:
    """Where a saved run stopped (train_state.pt) and its optimizer states (optimizer.pt)."""

    step: int
    micro: int  # micro-batches consumed: the data position
    elapsed: float  # the run's training clock
    tokens: int
    rng: dict
    optimizer: list  # one state dict per optimizer (OptimizerBundle)


@dataclass
class Start:
    """What a run starts from: a fresh start (all None) or the saved run in --out (model, tok, resume)."""

    model: GPT | None = None
    tokenizer: Tokenizer | None = None
    resume: ResumePoint | None = None


def open_run(out: Path, resume: bool) -> Start:
    """The saved run in `out` when resuming (checked complete); else check `out` holds no checkpoint yet."""
    has_ckpt = (out / "model.safetensors").is_file()
    if not resume:
        if has_ckpt:
            raise ValueError(f"{out} already holds a checkpoint; pass --resume to continue it or choose another --out")
        return Start()
    if not has_ckpt:
        raise FileNotFoundError(f"--resume: no checkpoint in {out}; drop --resume to start a new run")
    model, tok = load(out, device="cpu")
    opt_state, st = load_training(out)
    if opt_state is None or st is None:
        raise ValueError(f"--resume: {out} lacks optimizer.pt/train_state.pt (a weights-only checkpoint); "
                         f"start a new run instead")
    point = ResumePoint(step=st["step"], micro=st["micro"], elapsed=st.get("elapsed", 0.0),
                        tokens=int(st.get("tokens", 0)), rng=st["rng"], optimizer=opt_state["optimizer"])
    return Start(model, tok, point)


def save_run(out: Path, model: GPT, tok: Tokenizer, opts, state: dict) -> None:
    """The checkpoint (weights, tokenizer, optimizers) with `state` (step, micro, elapsed, tokens, args, ...)
    and this process's RNG states in train_state.pt."""
    save_checkpoint(out, model, tok, optimizer=OptimizerBundle(opts), train_state={**state, "rng": rng_state()})


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])

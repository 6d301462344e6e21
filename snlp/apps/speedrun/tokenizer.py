"""Stage `tokenizer`: the byte-level BPE tokenizer and the token cache of the corpus, shared by both models."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from snlp.apps.speedrun.preset import DataSpec
from snlp.train.config import TrainConfig

if TYPE_CHECKING:
    from snlp.apps.speedrun.job import Speedrun


def _train_config(spec: DataSpec, cache: Path) -> TrainConfig:
    return TrainConfig(out=str(cache / "unused"), data=spec.data, max_chars=spec.max_chars,
                       vocab_size=spec.vocab_size, cache_dir=str(cache))


def prepare(spec: DataSpec, cache: Path):
    """(tokenizer, TokenData) exactly as training builds them (cached under `cache`)."""
    from snlp.train.pretrain import prepare_data

    return prepare_data(_train_config(spec, cache), None, 0, 1)


def stage_tokenizer(spec: DataSpec, cache: Path) -> dict:
    t = time.perf_counter()
    tok, data = prepare(spec, cache)
    train_ids, val_ids = np.asarray(data.train, dtype=np.int64), np.asarray(data.val, dtype=np.int64)
    counts = np.bincount(train_ids, minlength=tok.vocab_size).astype(np.float64) + 1.0  # add-one smoothing
    unigram_ce = float(-np.log(counts / counts.sum())[val_ids].mean())
    print(f"tokenizer: vocab {tok.vocab_size}, {len(train_ids):,} train / {len(val_ids):,} val tokens, "
          f"unigram CE {unigram_ce:.3f} ({time.perf_counter() - t:.1f}s)")
    from snlp.io.data import validation_every

    return {"vocab_size": tok.vocab_size, "fingerprint": tok.fingerprint(), "train_tokens": int(len(train_ids)),
            "val_tokens": int(len(val_ids)), "unigram_ce": unigram_ce,
            "val_every": validation_every(_train_config(spec, cache).val_frac)}  # the split the report states


def val_tokens(spec: DataSpec, cache: Path) -> torch.Tensor:
    _, data = prepare(spec, cache)
    return torch.from_numpy(np.asarray(data.val, dtype=np.int64))


def step_tokenizer(sr: Speedrun) -> None:
    spec = sr.cfg.data_spec
    sr.tokenizer = sr.stages.run("tokenizer", "train the BPE tokenizer and tokenize the corpus",
                                 dataclasses.asdict(spec), lambda: stage_tokenizer(spec, sr.cache), outputs=[sr.cache])

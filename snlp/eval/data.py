"""The data an evaluation reads: validation token ids of a checkpoint's own training split (same
split and token cache as `snlp train`), non-overlapping PPL windows and seeded generation prompts."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from snlp.io import data as D

# `snlp train`'s data flags (argparse dests) and their defaults
DATA_DEFAULTS = {"data": "stdlib", "text_field": "text", "max_chars": 0, "val_frac": 0.05, "cache_dir": None,
                 "data_encoding": "utf-8"}


def as_tokens(val_tokens) -> Tensor:
    """Token ids (tensor, numpy array or memmap, list) as a 1-D int64 CPU tensor."""
    if isinstance(val_tokens, Tensor):
        return val_tokens.detach().long().flatten().cpu()
    return torch.from_numpy(np.asarray(val_tokens, dtype=np.int64).reshape(-1))


def windows(val_tokens: Tensor, seq_len: int, max_tokens: int) -> Tensor:
    """Non-overlapping windows (W, seq_len + 1) of the validation tokens (inputs + shifted targets),
    W = as many as fit, capped at max_tokens // seq_len (at least 1)."""
    n = val_tokens.numel()
    fit = (n - 1) // seq_len
    if fit < 1:
        raise ValueError(f"the validation split has only {n} tokens: one window needs seq_len + 1 = {seq_len + 1}; "
                         f"lower --seq-len or use more validation data")
    W = min(fit, max(1, max_tokens // seq_len))
    return val_tokens[:W * seq_len + 1].unfold(0, seq_len + 1, seq_len)  # (W, seq_len + 1)


def sample_prompts(val_tokens: Tensor, prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """`prompts` prompts of `prompt_len` consecutive validation tokens at seeded random offsets."""
    n = val_tokens.numel()
    if n < prompt_len:
        raise ValueError(f"the validation split has only {n} tokens: fewer than --prompt-len {prompt_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n - prompt_len + 1, (prompts,), generator=gen).tolist()
    return [val_tokens[s:s + prompt_len].tolist() for s in starts]


def checkpoint_data(ckpt, **overrides) -> dict:
    """The data settings (DATA_DEFAULTS keys) a checkpoint was trained with, from its train_state.pt
    args (defaults where absent); `overrides` that are not None win (the CLI flags)."""
    from snlp.io.checkpoint import load_train_state

    trained = (load_train_state(ckpt) or {}).get("args", {})
    out = {k: overrides[k] if overrides.get(k) is not None else trained.get(k, v) for k, v in DATA_DEFAULTS.items()}
    cache = out["cache_dir"]
    if overrides.get("cache_dir") is None and cache and not Path(cache).is_absolute() and not Path(cache).is_dir():
        # checkpoints record an absolute path now (snlp.train.checkpointing.recorded_args); an older one's is relative
        # to the folder its training ran in, which is not this one
        warnings.warn(f"checkpoint {ckpt} records its token cache as the relative path {cache} (from the folder its "
                      f"training ran in), which is not a folder here: the validation split is tokenised anew into "
                      f"{Path(cache).absolute()}; pass --cache-dir to read the run's cache", stacklevel=2)
    return out


def validation_tokens(tok, data: str = "stdlib", text_field: str = "text", max_chars: int = 0,
                      val_frac: float = 0.05, cache_dir=None, data_encoding: str = "utf-8") -> Tensor:
    """Validation token ids (1-D) of `data`'s document split, exactly as `snlp train` makes it (same
    split, same token cache key), tokenized with `tok` (the checkpoint's: no tokenizer training). Only
    the validation documents are tokenized when the cache lacks them."""
    cache = Path(cache_dir) if cache_dir else D.cache_dir()
    key = D.split_key(data, text_field, max_chars, val_frac, data_encoding)
    pval = D.token_paths(key, tok, cache)[1]
    if pval.is_file():
        return as_tokens(D.open_memmap(pval, tok.vocab_size))
    _, docs = D.split_documents(list(D.documents(data, text_field, max_chars, data_encoding)), val_frac)
    cache.mkdir(parents=True, exist_ok=True)
    return as_tokens(D.tokenize_to_memmap(docs, tok, pval))

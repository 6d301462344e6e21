"""Diagnostics for the report. Early exit (K = 0): skip the last N layers and read the logits
off the prefix state, logits = head(h_S), S = L - N (paper, early-exit table). Its PPL shows
that suffix layers whose Jacobians are near the identity are still not droppable."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .evaldata import as_tokens, windows
from .evaluation import EvalConfig
from .metrics import perplexity
from .model import GPT
from .runtime import progress_bar


@torch.inference_mode()
def early_exit(model: GPT, val_tokens, suffixes: list[int], cfg: EvalConfig = EvalConfig()) -> list[dict]:
    """Early-exit PPL over the same windows as `evaluate` (cfg.seq_len, cfg.max_tokens, cfg.batch):
    one record {N, seq_layers, ppl} per suffix length N, N = 0 (sequential) first, then
    `suffixes` in order (duplicates dropped). One sequential pass per batch serves every N."""
    L = model.config.n_layer
    Ns = list(dict.fromkeys([0, *(int(n) for n in suffixes)]))
    bad = [n for n in Ns if not 0 <= n <= L]
    if bad:
        raise ValueError(f"early-exit suffix lengths must lie in [0, L = {L}] (got {bad})")
    device = next(model.parameters()).device
    wins = windows(as_tokens(val_tokens), cfg.seq_len, cfg.max_tokens)  # (W, T + 1)
    nll, n_tok = dict.fromkeys(Ns, 0.0), 0
    batches = wins.split(cfg.batch)
    with progress_bar(len(batches), "early exit", cfg.progress) as bar:
        for b in batches:
            x, y = b[:, :-1].to(device), b[:, 1:].to(device)  # (B, T)
            trace = model.hidden_states(x)  # [h_0 .. h_L], each (B, T, D)
            for n in Ns:
                logits = model.head(trace[L - n])  # (B, T, V)
                nll[n] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            n_tok += y.numel()
            bar.update()
    return [{"N": n, "seq_layers": L - n, "ppl": perplexity(nll[n], n_tok)} for n in Ns]

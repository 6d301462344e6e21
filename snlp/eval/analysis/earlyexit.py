"""Early exit (paper Table early_exit): K = 0 PPL with the last N layers skipped."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from snlp.eval.data import as_tokens, windows
from snlp.eval.metrics import perplexity
from snlp.eval.protocol import EvalConfig
from snlp.model.gpt import GPT
from snlp.runtime.device import progress_bar


@dataclass
class ExitRow:
    N: int  # layers skipped (0: the sequential model)
    seq_layers: int  # layers run: L - N
    ppl: float


def _exit_state(model: GPT, trace: list, S: int):
    """What the head reads at K = 0 after the first S layers: h_S, with nanochat's backout the solver's K = 0 state
    (snlp.method.solver): h_S - backout_lambda * hb, hb = layer b's output when b < S (the prefix computed it), else
    the skipped layer's K = 0 iterate h_S (the paper's code fills it the same way). Without the subtraction an exit
    after layer b + 1 read h_S where the model's K = 0 solve reads h_S - lambda h_{b+1}: a different PPL under the
    same "K = 0" label."""
    if not model.config.backout:
        return trace[S]
    hb = model.prefix_backout(trace, S)
    return model.finish(trace[S], trace[S] if hb is None else hb)


@torch.inference_mode()
def early_exit(model: GPT, val_tokens, suffixes: list[int], cfg: EvalConfig = EvalConfig()) -> list[ExitRow]:
    """Early-exit PPL (K = 0: skip the last N layers, logits = head(h_S), S = L - N; paper Table
    early_exit) over the same windows as `snlp.eval.protocol.evaluate` (cfg.seq_len, cfg.max_tokens,
    cfg.batch): one ExitRow (N, seq_layers, ppl) per suffix length N, N = 0 (sequential) first, then
    `suffixes` in order (duplicates dropped). One sequential pass per batch serves every N. Its PPL
    shows that suffix layers whose Jacobians are near the identity are still not droppable."""
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
                logits = model.head(_exit_state(model, trace, L - n))  # (B, T, V)
                nll[n] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            n_tok += y.numel()
            bar.update()
    return [ExitRow(N=n, seq_layers=L - n, ppl=perplexity(nll[n], n_tok)) for n in Ns]


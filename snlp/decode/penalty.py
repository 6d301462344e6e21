"""The repetition penalty of transformers' generate() (its RepetitionPenaltyLogitsProcessor, CTRL's penalty): every
token id already in the sequence, the prompt included, has its logit divided by the penalty p where it is positive and
multiplied by p where it is negative, on the raw logits, before any temperature / top-k / top-p filter, in greedy
decoding and in sampling alike. p > 1 discourages repeats, p < 1 favours them, p = 1 changes nothing.

The state is one (B, V + 1) bool mask per decode, on the device: row b marks the ids of its own prompt and of every
token picked for it since. Column V absorbs what must not count (no token id: a NONFINITE flag, the ids past a
short row's end), as transformers' own processor maps ignored ids to an extra column. Nothing is read back to the
host, so the decode loops keep their one host read per step or round. The decode session holds the state
(DecodeSession.penalty, BatchSession.penalty; on a layer-parallel decode the last rank's, which picks the tokens),
and every one-token pick goes through `pick_penalised` (penalise, pick, mark seen)."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor


def check_repetition_penalty(penalty) -> float:
    """The penalty as a float, or a one-line ValueError: a finite number > 0 (1.0: none), as transformers refuses
    a penalty that is not strictly positive; nan and inf would turn every seen token's logit into nan / 0 / inf."""
    try:
        ok = not isinstance(penalty, bool) and math.isfinite(penalty) and penalty > 0
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"repetition_penalty must be a finite number > 0, 1 = none (got {penalty!r})")
    return float(penalty)


class RepetitionPenalty:
    """The seen-token mask of a batch of rows (module docstring) and the penalty applied through it."""

    def __init__(self, penalty: float, seen: Tensor):
        self.penalty, self.seen = penalty, seen  # seen (B, V + 1) bool

    @classmethod
    def of(cls, penalty: float, prompts: list[list[int]], vocab_size: int, device) -> RepetitionPenalty | None:
        """The state of rows starting from `prompts` (each row its own ids, no padding), or None for penalty 1 (the
        decode loops then skip every penalty op: a penalty of 1 costs nothing)."""
        if penalty == 1.0:
            return None
        V, T = vocab_size, max(len(p) for p in prompts)
        ids = torch.tensor([p + [V] * (T - len(p)) for p in prompts], device=device)  # (B, T), V past a row's end
        seen = torch.zeros(len(prompts), V + 1, dtype=torch.bool, device=device)
        return cls(penalty, seen.scatter_(1, ids, True))

    def __call__(self, logits: Tensor) -> Tensor:
        """Penalised logits (B, V) of logits (B, V), one row per row of the state."""
        return self._apply(logits, self.seen[:, :-1])

    def _apply(self, logits: Tensor, seen: Tensor) -> Tensor:
        # in float32 at least, as transformers penalises its float32 copy of the logits
        x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        return torch.where(seen, torch.where(x < 0, x * self.penalty, x / self.penalty), x)

    def at_positions(self, logits: Tensor, drafts: Tensor) -> Tensor:
        """Penalised logits (B, m + 1, V) of a forward over [last, d_1..d_m] (logits (B, m + 1, V), drafts (B, m)):
        position i predicts the token after d_i, so it is penalised by the row's seen ids and d_1..d_i, exactly as
        one-token-at-a-time decoding of that prefix would penalise it (a speculative verifier, a Jacobi iteration)."""
        B, m1, V1 = logits.shape[0], logits.shape[1], self.seen.shape[1]
        cols = torch.arange(m1, device=logits.device)  # (m + 1,)
        # draft k (1-based) counts from position k on; before it, its id goes to the absorbing column V
        ids = torch.where(cols[:, None] >= cols[None, 1:], drafts[:, None, :], V1 - 1)  # (B, m + 1, m)
        seen = self.seen[:, None, :].expand(B, m1, V1).clone()  # (B, m + 1, V + 1)
        seen.scatter_(2, ids.clamp(0, V1 - 1), True)
        return self._apply(logits, seen[..., :-1])

    def pick(self, logits: Tensor, pick: Callable[[Tensor], Tensor]) -> Tensor:
        """One decode step's tokens (B,) = pick(penalised logits (B, V)), marked as seen by their rows: the step
        after this one is penalised by them (a NONFINITE pick marks nothing, `add`)."""
        tok = pick(self(logits))
        self.add(tok)
        return tok

    def add(self, tokens: Tensor) -> None:
        """Mark tokens (B,) or (B, k) as seen by their rows; a negative entry (no token: NONFINITE, or a position a
        row did not accept) marks nothing."""
        tokens = tokens.reshape(self.seen.shape[0], -1)
        V = self.seen.shape[1] - 1
        self.seen.scatter_(1, torch.where(tokens < 0, V, tokens.clamp_max(V)), True)

    def accept(self, drafts: Tensor, n: Tensor, nxt: Tensor) -> None:
        """A speculative round's outcome: row b keeps its first n[b] drafts (drafts (B, m)) and its next token
        nxt[b] (n, nxt (B,))."""
        cols = torch.arange(drafts.shape[1], device=drafts.device)
        self.add(torch.cat([torch.where(cols[None] < n[:, None], drafts, -1), nxt[:, None]], 1))  # (B, m + 1)

    def fork(self) -> RepetitionPenalty:
        """A copy to draft with: a round's drafts are marked there, the state itself only learns what is kept."""
        return RepetitionPenalty(self.penalty, self.seen.clone())

    def keep_rows(self, rows: Tensor) -> None:
        """Keep these batch rows (an eager batch compacted its finished rows away)."""
        self.seen = self.seen[rows]


def pick_penalised(state: RepetitionPenalty | None, logits: Tensor, pick: Callable[[Tensor], Tensor]) -> Tensor:
    """The decode loops' one pick of a step: `state.pick` (penalise, pick, record), or pick(logits) where the
    penalty is 1 (`RepetitionPenalty.of` gave None: no penalty op at all)."""
    return pick(logits) if state is None else state.pick(logits, pick)

"""Batched decoding of prompts of different lengths, exact per row.

`sequential_generate`, `snlp_generate` and `speculative_generate` given a LIST of prompts (or a (B, T) tensor with
B > 1) decode them as one batch and return one GenerateResult per prompt, in order; one prompt still returns one
result. Self-speculative decoding runs ONE round for both: a single prompt is a batch of one whose forwards take
the plain cached path (`BatchSession.plain`: an int start, no per-row mask), so a fix to the round lands once;
sequential / SNLP decoding of one prompt keeps its own short loop (snlp.decode.generate).

Layout: ragged rows, LEFT-ALIGNED in one static KV cache (snlp.model.cache.KVCache, batch B). Row b's tokens sit at
slots 0..len_b-1 and its RoPE position is the slot, so every row is laid out exactly as it would be alone (no
left-padding offset, no position ids to shift): the only thing that differs from a single-prompt run is the
mask. Each forward of T tokens passes a (B, T) positions tensor pos (row b at len_b..len_b+T-1): K/V are
scattered there by one index_put_ with a batch index, attention covers the whole cache under a per-row causal
(and window) mask built from pos (snlp.model.ops.window_mask), and RoPE takes the (B, T) positions. Rows with
fewer real tokens than T in a call (a ragged prefill, the verifier of a row that drafted fewer tokens) are padded
at their END: the padding's K/V land past that row's length, i.e. in scratch that the row's next forward
overwrites before any query can see it (causal mask), so the cache is allocated with slack positions for it.

Rows advance independently: each keeps its own length, budget, EOS and, in self-speculative decoding, accepts its
own number of drafts per round and "rolls back" by setting its own length. Finished rows (EOS or their own budget)
leave the batch: eagerly, the active rows of the batch and of the cache are compacted (KVCache.keep_rows, one copy
of the kept K/V per finishing event), so later steps compute only live rows. Compiled steps keep the batch shape
(a new batch size would compile a new graph mid-run): a finished row there rides along at a frozen position,
its outputs ignored. Sampling (temperature > 0) draws row i (its index in the prompt list) from its own generator
seeded `seed + i`, so a row's draws do not depend on the batch it was decoded in (up to floating-point
differences of the batched matmuls).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import Tensor

from snlp.decode.penalty import RepetitionPenalty, pick_penalised
from snlp.decode.session import (GenerateResult, Sampling, as_ids_tensor, check_fits, check_max_len, check_picked,
                                 check_seed, check_stream, cut_at_stop,
                                 make_generator, pick_tensor, prompt_ids_list, read_every, stop_set)
from snlp.decode.steps import EagerStep, Step
from snlp.method.surrogates import DiagN, Newton
from snlp.model.cache import RowPositions
from snlp.model.gpt import GPT
from snlp.runtime.timing import now

RowsCallback = Callable[[int, list[int]], bool | None]  # on_tokens of a batch: (prompt index, new tokens); True ends the row


def check_batch_plan(plan, hint: str = "decode the prompts one at a time for this plan") -> None:
    """Raise a ValueError for plans batched decoding cannot run: the DiagN / Newton surrogates evaluate probes or JVPs
    through a read-only view of the cache that takes one Python start position, not per-row positions. `hint`: what
    to do instead, in the caller's words (a command names its flag)."""
    if plan is not None and isinstance(plan.surrogate, (DiagN, Newton)):
        raise ValueError(f"plan {plan}: the {plan.surrogate.token} surrogate's probes read the KV cache at one start "
                         f"position, not per row; batched decoding supports the idn, none and hcn surrogates ({hint})")


def check_decode_inputs(model: GPT, prompt_ids, max_new_tokens: int, max_len: int | None, eos_id, plan=None,
                        one_row_single: bool = False, on_tokens=None, seed: int | None = None) -> None:
    """Refuse bad decode inputs before any work (a plan bound, a step built or compiled, a cache allocated), with the
    errors the sessions give when they are built (DecodeSession, BatchSession): max_len, eos_id (ids in the model's
    vocabulary), the seed, the streaming callback's shape, every prompt (ids in the vocabulary, at least one token, no
    longer than max_len) and, for a batch, a plan batched decoding cannot run (`check_batch_plan`).
    `one_row_single`: the caller runs a list of ONE prompt as a single prompt (self-speculative decoding does), so
    such a list takes any plan."""
    check_max_len(max_len)
    stop_set(eos_id, model.config.vocab_size)
    check_seed(seed, len(prompt_ids) if is_batch(prompt_ids) else 1)
    check_stream(on_tokens, batch=is_batch(prompt_ids))
    if not is_batch(prompt_ids):
        n = len(prompt_ids_list(model, prompt_ids))
        if max_len is not None:
            check_fits(n, max_len)
        return
    prompts = list(prompt_ids)
    for i, p in enumerate(prompts):
        try:
            n = len(prompt_ids_list(model, p))
        except ValueError as e:  # which prompt of the batch
            raise ValueError(f"prompt {i} of the batch: {e}") from None
        if max_len is not None:
            check_fits(n, max_len, i)
    if not (one_row_single and len(prompts) == 1):
        check_batch_plan(plan)


def is_batch(prompt_ids) -> bool:
    """True for a list of prompts (a list whose items are id lists / tensors) or a (B, T) tensor with B > 1; a single
    prompt (a list of ids, a (T,) or (1, T) tensor) is not a batch."""
    prompt_ids = as_ids_tensor(prompt_ids)  # a numpy array: as the tensor it converts to
    if isinstance(prompt_ids, Tensor):
        return prompt_ids.dim() == 2 and prompt_ids.shape[0] > 1
    if not (isinstance(prompt_ids, (list, tuple)) and len(prompt_ids) > 0):
        return False
    first = as_ids_tensor(prompt_ids[0])
    return isinstance(first, (list, tuple, Tensor)) and not (isinstance(first, Tensor) and first.dim() == 0)


class BatchSession:
    """Prompts, one ragged KV cache and per-row bookkeeping for batched decoding (module docstring). Batch row j
    holds prompt `rows[j]`; `lens[j]` positions of it are cached (all its tokens but `last[j]`, which the next
    forward feeds)."""

    def __init__(self, model: GPT, prompts, max_new_tokens: int, eos_id: int | list[int] | None, max_len: int | None,
                 on_tokens: RowsCallback | None, mode: str, step: Step | EagerStep | tuple, slack: int = 0,
                 how: Sampling = Sampling(), seed: int | None = None, penalty: float = 1.0):
        self.model, self.device = model, model.wte.weight.device
        prompts = as_ids_tensor(prompts)
        if isinstance(prompts, Tensor):
            prompts = list(prompts)
        self.prompts = [prompt_ids_list(model, p) for p in prompts]
        lens = [len(p) for p in self.prompts]
        caps = [n + max_new_tokens if max_len is None else max_len for n in lens]
        check_max_len(max_len)
        for i, (n, cap) in enumerate(zip(lens, caps)):
            check_fits(n, cap, i)
        self.budget = [min(max_new_tokens, cap - n) for n, cap in zip(lens, caps)]
        # `step`: the step(s) this batch runs (a drafter and a verifier); if ANY is compiled, the cache size is the
        # compiled one's bucket and the batch keeps its shape (a new batch size or cache size would compile a new
        # graph mid-run, e.g. a compiled drafter beside an eager verifier)
        steps = tuple(step) if isinstance(step, (tuple, list)) else (step,)
        lead = next((s for s in steps if s.compiled), steps[0])
        # slack: the verifier's / a compiled step's padding past a row's length (module docstring)
        size = max(n + b for n, b in zip(lens, self.budget)) + slack + max(s.prefill_pad for s in steps)
        self.cache = lead.new_cache(model, len(self.prompts), lead.cache_len(size))
        self.compact = not lead.compiled  # compiled graphs keep their batch shape (module docstring)
        check_stream(on_tokens, batch=True)
        check_seed(seed)
        self.eos_id, self.stops, self.on_tokens = eos_id, stop_set(eos_id, model.config.vocab_size), on_tokens
        self.results = [GenerateResult(tokens=[], mode=mode, stop="max_new_tokens" if max_new_tokens <= cap - n
                                       else "max_len") for n, cap in zip(lens, caps)]
        self.rows = [i for i in range(len(self.prompts))]
        self.lens = [n - 1 for n in lens]
        self.last = [p[-1] for p in self.prompts]
        self.done = [b <= 0 for b in self.budget]
        self.gens = None if how.greedy else [make_generator(None if seed is None else seed + i, self.device)
                                                  for i in range(len(self.prompts))]
        self.prefill_s = 0.0
        # the repetition penalty's seen ids, one row per batch row (None at penalty 1: nothing to do)
        self.penalty = RepetitionPenalty.of(penalty, self.prompts, model.config.vocab_size, self.device)

    @property
    def plain(self) -> bool:
        """One row left (a single prompt, or an eager batch compacted down to one row): calls run the plain cached
        forward at the row's length (`call`), the single-prompt path: an int start, so no per-row mask is built and
        a one-token query attends through SDPA's unmasked fast path (the masked ragged path costs ~1 ms per forward
        on small CPU models), and compiled steps run their single-prompt graphs."""
        return len(self.rows) == 1 and (self.compact or len(self.prompts) == 1)

    def call(self, step: Step | EagerStep, rows: list[list[int]], T: int | None = None, extra: list[int] | None = None,
             pad_to: int | None = None) -> Tensor:
        """Logits (B, T', V) of one forward over `rows` (row j's tokens at lens[j] (+ extra[j]) ..; padded at their
        end to T, default the longest): a ragged call, or with one row (`plain`) the plain cached forward at that
        row's length (T' is then the row's own length; `pad_to` pads a compiled call, e.g. the verifier's B+1)."""
        if self.plain:
            return self.call_plain(step, self.ids(rows), extra[0] if extra is not None else 0, pad_to)
        T = T if T is not None else pad_to if pad_to is not None else max(len(r) for r in rows)
        return step.ragged(self.ids(rows, T), self.positions(T, extra), self.cache)

    def call_plain(self, step: Step | EagerStep, idx: Tensor, extra: int = 0, pad_to: int | None = None) -> Tensor:
        """The plain cached forward of the one row (`plain`) over ids (1, T) already on the device, at its length
        (+ extra): a decode loop that keeps its tokens on the device calls this, so no host list is copied in."""
        self.cache.seek(self.lens[0] + extra)
        return step(idx, self.cache, pad_to=pad_to)  # advances the length: callers re-seek

    def warm(self, step: Step | EagerStep, T: int) -> None:
        """Compile `step` for calls of T tokens before anything is timed (a no-op eagerly or for a seen shape)."""
        if self.plain:
            self.cache.seek(0)
            step.warm(self.cache, [T])
        else:
            step.warm_ragged(self.cache, self.positions(T, [1] * len(self.rows)))  # scratch: past every prompt

    @property
    def active(self) -> bool:
        return not all(self.done[i] for i in self.rows)

    def remaining(self, j: int) -> int:
        i = self.rows[j]
        return self.budget[i] - len(self.results[i].tokens)

    def positions(self, T: int, extra: list[int] | None = None) -> RowPositions:
        """Positions (B, T) of a call of T tokens: row j at lens[j] (+ extra[j]) ..; finished rows that still ride
        along (compiled) sit at their frozen length, which is scratch. Eagerly the call also carries its span:
        attention covers positions 0..span-1 only, all this call needs (compiled steps drop it: their shapes must
        not change). Every token counts as real: only the prefill pads rows that an SNLP plan reads (`prefill`)."""
        starts = self.lens if extra is None else [n + e for n, e in zip(self.lens, extra)]
        pos = torch.tensor(starts, device=self.device)[:, None] + torch.arange(T, device=self.device)
        return RowPositions(pos, span=max(starts) + T if self.compact else None)

    def ids(self, rows: list[list[int]], T: int | None = None) -> Tensor:
        """(B, T) ids, each row padded at its end (repeating its last token) to T (default: the longest row)."""
        T = max(len(r) for r in rows) if T is None else T
        return torch.tensor([r + [r[-1]] * (T - len(r)) for r in rows], dtype=torch.long, device=self.device)

    def prefill(self, step: Step | EagerStep) -> None:
        """Cache every prompt but its last token: one ragged forward over the right-padded prompts (one prompt: the
        plain padded prefill of the single-prompt path)."""
        if self.plain:
            n = self.lens[0]
            self.cache.seek(0)
            step.warm_prefill(self.cache, n)
            t0 = now(self.device)
            if n:
                step.prefill(self.ids([self.prompts[self.rows[0]][:-1]]), self.cache)
            self.prefill_s = self.results[self.rows[0]].prefill_s = now(self.device) - t0
            self.t0 = now(self.device)
            return
        T = -(-max(self.lens) // step.prefill_pad) * step.prefill_pad
        # every row from position 0 (lens are the prompts' cached lengths here); row j's first lens[j] tokens are
        # real, the rest end padding that a `tol` plan's stop test must not see (RowPositions.real)
        pos = RowPositions(torch.arange(T, device=self.device).repeat(len(self.prompts), 1),
                           span=T if self.compact else None,
                           real=torch.arange(T, device=self.device) < torch.tensor(self.lens, device=self.device)[:, None]
                           )
        if T > 0:
            step.warm_ragged(self.cache, pos, fill=True)  # compiled before the timer starts
        t0 = now(self.device)
        if T > 0:
            rows = [p[:-1] if len(p) > 1 else p[:1] for p in self.prompts]
            step.ragged_fill(self.ids(rows, T), pos, self.cache)
        self.prefill_s = now(self.device) - t0
        for r in self.results:
            r.prefill_s = self.prefill_s
        self.t0 = now(self.device)

    def emit(self, j: int, new: list[int], advance: int) -> None:
        """Batch row j advances its cached length by `advance` and emits `new` (cut at EOS / its budget)."""
        i = self.rows[j]
        if self.done[i]:
            return
        res = self.results[i]
        new = new[: self.remaining(j)]
        cut = cut_at_stop(new, self.stops)
        if cut is not None:
            new = cut
            self.done[i], res.stop = True, "eos"
        res.tokens.extend(new)
        self.lens[j] += advance
        self.last[j] = new[-1]
        if self.remaining(j) <= 0:
            self.done[i] = True
        if self.on_tokens is not None and new and self.on_tokens(i, new) is True and not self.done[i]:
            self.done[i], res.stop = True, "on_tokens"  # the caller's stopping criterion (check_stream)
        if self.done[i]:
            res.decode_s = now(self.device) - self.t0

    def drop_finished(self) -> None:
        """Eager: remove finished rows from the batch and the cache (they stop costing work)."""
        keep = [j for j, i in enumerate(self.rows) if not self.done[i]]
        if not self.compact or len(keep) == len(self.rows) or not keep:
            return
        self.cache.keep_rows(torch.tensor(keep, device=self.device))
        if self.penalty is not None:
            self.penalty.keep_rows(torch.tensor(keep, device=self.device))
        self.rows, self.lens, self.last = ([xs[j] for j in keep] for xs in (self.rows, self.lens, self.last))

    def live(self) -> list[int]:
        """Batch rows still decoding."""
        return [j for j, i in enumerate(self.rows) if not self.done[i]]

    def pick_tensor(self, logits: Tensor, how: Sampling, flag: bool = False) -> Tensor:
        """Next token of every batch row from logits (B, V), left on the device: argmax, or a sample from the row's
        own generator; `flag`: NONFINITE for a row whose logits hold NaN/inf (snlp.decode.session.pick_tensor). The
        logits are penalised by each row's seen ids and the picks marked seen (`pick_penalised`, as
        DecodeSession.pick_tensor for one prompt)."""
        gens = None if how.greedy else [self.gens[i] for i in self.rows]
        return pick_penalised(self.penalty, logits, lambda x: pick_tensor(x, how, gens, flag))

    def finish(self) -> list[GenerateResult]:
        wall = now(self.device) - self.t0
        total = sum(len(r.tokens) for r in self.results)
        for r in self.results:
            r.extra["batch"] = dict(size=len(self.results), wall_s=wall, tokens=total,
                                    tokens_per_s=total / wall if wall > 0 else float("nan"))
        return self.results


def batch_autoregressive(model: GPT, prompts, forward: Step | EagerStep, mode: str, plan, max_new_tokens: int,
                         how: Sampling, eos_id: int | list[int] | None, seed: int | None, max_len: int | None,
                         on_tokens: RowsCallback | None, every: int | None = None,
                         penalty: float = 1.0) -> list[GenerateResult]:
    """Sequential / SNLP decoding of a ragged batch: one cached forward of one token per live row per step, `every`
    steps queued per host read (snlp.decode.session.read_every): each step is fed the previous step's tokens on the
    device, and a row that reaches EOS inside a read computes the rest of it at its own positions (within its
    budget, so inside the cache) and drops those tokens. Rows finish, and an eager batch compacts, at reads.
    `penalty`: the repetition penalty (snlp.decode.penalty), each row's seen ids its own prompt's and tokens."""
    check_batch_plan(plan)
    c0 = forward.compile_s  # a prebuilt step's total so far: this call reports only what it compiled
    with torch.inference_mode():
        ses = BatchSession(model, prompts, max_new_tokens, eos_id, max_len, on_tokens, mode, forward,
                           forward.slack, how, seed, penalty)
        every = read_every(ses.device, every)
        for r in ses.results:
            r.plan = None if plan is None else str(plan)
        forward.warm_ragged(ses.cache, ses.positions(1, [1] * len(ses.rows)))  # scratch: past every prompt
        ses.prefill(forward)
        while ses.active:
            # the device is idle here (the prefill's clock, then each read, waited for it) but for an eager batch's
            # compaction after the last read, which counts in this read's step time
            t0 = time.perf_counter()
            live = ses.live()
            n = min(every, min(ses.remaining(j) for j in live))  # no live row steps past its budget
            # every row's last token, its length and whether it moves, in one copy in per read: finished rows that
            # ride along (compiled) stay at their frozen length, i.e. scratch (BatchSession.positions)
            rows = torch.tensor([[t, n_, int(not ses.done[i])] for t, n_, i in zip(ses.last, ses.lens, ses.rows)],
                                device=ses.device)  # (B, 3)
            x, first, step = rows[:, :1], rows[:, 1:2], rows[:, 2:3]  # (B, 1) each
            span = max(ses.lens) + 1 if ses.compact else None  # eager: attend positions 0..span-1 (positions())
            picked = []
            for k in range(n):
                pos = RowPositions(first + k * step, span=None if span is None else span + k)
                logits = forward.ragged(x, pos, ses.cache)[:, -1]  # (B, V)
                # penalised and marked seen; the finiteness flag rides on the read below (a finished row riding
                # along marks its dropped token: it emits nothing more)
                tok = ses.pick_tensor(logits, how, flag=True)  # (B,)
                picked.append(tok)
                x = tok.clamp_min(0)[:, None]  # NONFINITE (-1) is no token id; check_picked raises on it below
            toks = torch.stack(picked, 1).tolist()  # (B, n): one read for n steps
            dt = time.perf_counter() - t0
            for j in live:  # every row live at the read ran its n steps, those past its EOS included
                res = ses.results[ses.rows[j]]
                res.step_s, res.steps, res.forwards = res.step_s + dt, res.steps + n, res.forwards + n
            for k in range(n):
                live = ses.live()
                if not live:
                    break
                # NaN/inf logits of a live row raise, naming the plan or (plan None) the model's own forward (a
                # finished row riding along is ignored)
                check_picked([toks[j][k] for j in live], plan, len(ses.results[ses.rows[live[0]]].tokens),
                             [ses.rows[j] for j in live], model=model,
                             context=lambda m: ses.prompts[ses.rows[live[m]]] + ses.results[ses.rows[live[m]]].tokens)
                for j in live:
                    ses.emit(j, [toks[j][k]], 1)
            ses.drop_finished()
        for r in ses.results:
            r.compile_s = forward.compile_s - c0
        return ses.finish()

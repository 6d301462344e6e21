"""One decode session, shared by every decoding mode (sequential, SNLP, self-speculative, Jacobi) and by
the distributed decoder: argument checks, the prompt, one static KV cache, output bookkeeping (EOS, budget,
streaming), timing, and the result record `GenerateResult`."""

from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import Tensor

from snlp.decode.penalty import RepetitionPenalty, pick_penalised
from snlp.decode.steps import EagerStep, Step, sequential_step, snlp_step
from snlp.method.plan import Plan
from snlp.method.preheat import Preheat
from snlp.method.solver import SNLPDivergenceError, bind
from snlp.model.cache import KVCache
from snlp.model.gpt import GPT, check_gpt
from snlp.runtime.checks import check_count
from snlp.runtime.timing import now

@dataclass
class GenerateResult:
    """Generated ids and decode statistics. Times exclude the prompt prefill (prefill_s)."""

    tokens: list[int]
    mode: str
    decode_s: float = 0.0
    prefill_s: float = 0.0
    plan: str | None = None
    block: int = 0
    stop: str = ""  # eos | max_new_tokens | max_len | on_tokens (the streaming callback returned True)
    forwards: int = 0  # forwards on the critical path (each SNLP solve counts once); with read_every > 1 they
    # include the steps a row ran past its EOS inside its last read (computed, tokens dropped), as `steps` does
    rounds: int = 0  # speculative/Jacobi rounds
    drafted: int = 0  # drafter work: draft tokens proposed, all of them (a round's drafts after an accepted stop id too)
    usable: int = 0  # drafts that could have entered the output: each round's drafts up to the output's end (all of
    # them, or up to and including the accepted draft that is a stop id); the denominator of accepted_fraction
    accepted: int = 0  # draft tokens accepted into the output (none after an accepted stop id)
    examined: int = 0  # draft tokens compared: accepted ones + the first rejection of each round
    draft_steps: int = 0
    draft_s: float = 0.0  # time in the drafter's single-token steps (forward + next-token pick)
    steps: int = 0  # single-token decode steps of sequential / snlp decoding ...
    step_s: float = 0.0  # ... and the time in them (forward + next-token pick), timed like draft_s
    verify_s: float = 0.0
    jacobi_iters: int = 0
    compile_s: float = 0.0  # compiling the static-shape steps (--compile), done before any timing
    extra: dict = field(default_factory=dict)

    def add_round(self, drafts: list[int], kept: int, stops: frozenset[int], steps: int, forwards: int,
                  draft_s: float, verify_s: float) -> None:
        """Count one speculative / Jacobi round: the drafter proposed `drafts`, the verifier kept the leading `kept`
        of them (examined: those plus the first rejection, if any), `steps` drafter steps, `forwards` on the
        critical path, and the draft / verify time. A kept draft that is one of `stops` ends the output there (the
        session's emit cuts it): the drafts after it are drafter work the decode drops, so they count in `drafted`
        only, and alpha counts up to that stop and examines nothing after it (whatever the verifier said)."""
        end = cut_at_stop(drafts[:kept], stops)
        accepted = kept if end is None else len(end)
        self.rounds += 1
        self.draft_steps += steps
        self.drafted += len(drafts)
        self.usable += len(drafts) if end is None else accepted
        self.accepted += accepted
        self.examined += accepted + (accepted < len(drafts) and end is None)
        self.forwards += forwards
        self.draft_s += draft_s
        self.verify_s += verify_s

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """Per-draft acceptance alpha: P(draft token accepted | all earlier drafts of the round
        accepted), the maximum-likelihood alpha of the i.i.d. model behind the paper's formula."""
        return self.accepted / self.examined if self.examined else float("nan")

    @property
    def tokens_per_round(self) -> float:
        """Output tokens per round (the output ends at its stop id: nothing drafted after it counts)."""
        return len(self.tokens) / self.rounds if self.rounds else float("nan")

    @property
    def draft_ms_per_step(self) -> float:
        return 1e3 * self.draft_s / self.draft_steps if self.draft_steps else float("nan")

    @property
    def ms_per_step(self) -> float:
        """Mean ms of a single-token decode step (sequential / snlp modes; prefill excluded)."""
        return 1e3 * self.step_s / self.steps if self.steps else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tokens_per_s=self.tokens_per_s, ms_per_token=1e3 / self.tokens_per_s if self.tokens else None)
        if self.mode in ("speculative", "jacobi"):
            # no drafts examined (one new token, the prefill's): no rate, null in JSON rather than NaN
            d.update(acceptance_rate=self.acceptance_rate if self.examined else None,
                     tokens_per_round=self.tokens_per_round,
                     # the share of the drafts that could have entered the output that did (drafter work
                     # dropped after an accepted stop id is in `drafted`, not here)
                     accepted_fraction=self.accepted / self.usable if self.usable else None)
        return d



def pooled_alpha(results: list[GenerateResult]) -> float | None:
    """The acceptance alpha of several decodes (timed runs, a batch's rows) pooled: their accepted over their
    examined drafts, the maximum-likelihood alpha of them all (None where none examined a draft)."""
    examined = sum(r.examined for r in results)
    return sum(r.accepted for r in results) / examined if examined else None


def merge_results(results: list[GenerateResult]) -> GenerateResult:
    """Sum the counters and times of several runs (e.g. one per prompt) into one result."""
    first = results[0]
    agg = GenerateResult(tokens=[t for r in results for t in r.tokens], mode=first.mode, plan=first.plan,
                         block=first.block)
    for f in ("decode_s", "prefill_s", "forwards", "rounds", "drafted", "usable", "accepted", "examined", "draft_steps",
              "draft_s", "verify_s", "steps", "step_s", "jacobi_iters", "compile_s"):
        setattr(agg, f, sum(getattr(r, f) for r in results))
    return agg


def as_ids_tensor(prompt_ids):
    """A numpy array of prompt ids as a tensor (the decoders take tensors; numpy's own conversion of a 2-D array to
    ints fails with "only 0-dimensional arrays can be converted"), anything else unchanged."""
    if type(prompt_ids).__module__ == "numpy" and hasattr(prompt_ids, "ndim"):
        if prompt_ids.dtype.kind not in "iu":
            raise ValueError(f"prompt token ids must have an integer dtype, got a numpy array of {prompt_ids.dtype}")
        return torch.as_tensor(prompt_ids)
    return prompt_ids


TEXT_PROMPT = ("prompt is text ({!r}): the decoders take token ids; encode it with the model's tokenizer first "
               "(model, tok = snlp.load(dir); tok.encode(text))")


def prompt_ids_list(model: GPT, prompt_ids) -> list[int]:
    if isinstance(prompt_ids, (str, bytes)):
        raise ValueError(TEXT_PROMPT.format(prompt_ids[:40]))
    prompt_ids = as_ids_tensor(prompt_ids)
    if not isinstance(prompt_ids, (Sequence, Tensor)):
        # read more than once (checked, then decoded): a generator or iterator was empty by the second read and
        # reported as an empty prompt; a sequence (a list, a tuple, a deque, an array.array) reads the same twice
        raise ValueError(f"prompt must be a list of ids, a (T,) / (1, T) tensor or a numpy array, got "
                         f"{type(prompt_ids).__name__}")
    if isinstance(prompt_ids, Tensor):
        if prompt_ids.device.type == "meta":  # no values to read (torch's own error: "Cannot copy out of meta tensor")
            raise ValueError("prompt token ids are a meta tensor, which holds no values: pass the ids themselves")
        if prompt_ids.dtype.is_floating_point or prompt_ids.dtype.is_complex or prompt_ids.dtype == torch.bool:
            raise ValueError(f"prompt token ids must have an integer dtype, got a tensor of {prompt_ids.dtype}")
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        if prompt_ids.dim() != 1:
            # no word on batches: the single-process decoders take them (as a list or a (B, T) tensor, B > 1, which
            # never reaches here), Jacobi and the distributed decoder refuse them, each in its own words
            raise ValueError(f"prompt must be a list of ids or a (T,) / (1, T) tensor, got shape "
                             f"{tuple(prompt_ids.shape)}")
        prompt_ids = prompt_ids.tolist()
    ids = []
    for i in prompt_ids:
        if isinstance(i, (str, bytes)):
            raise ValueError(TEXT_PROMPT.format(i[:40]))
        try:  # operator.index: any integer (numpy's too), never a float's silent truncation; a bool is no id (a 0-d
            # bool tensor neither: operator.index reads it as 0 or 1)
            ids.append(operator.index(as_ids_tensor(i)) if not isinstance(i, bool)
                       and str(getattr(i, "dtype", "")) != "torch.bool" else None)
        except TypeError:
            ids.append(None)
        if ids[-1] is None:
            raise ValueError(f"prompt token ids must be integers, got {i!r} ({type(i).__name__})")
    if not ids:
        raise ValueError("prompt must contain at least one token (e.g. the tokenizer's BOS id)")
    V = model.config.vocab_size
    if min(ids) < 0 or max(ids) >= V:
        raise ValueError(f"prompt token ids must lie in [0, {V}), got range [{min(ids)}, {max(ids)}]")
    return ids


def check_max_len(max_len) -> None:
    """max_len (the KV cache's length, prompt included) None or an integer >= 1."""
    if max_len is not None and (not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"max_len must be an integer >= 1 (got {max_len!r})")


def check_fits(n: int, max_len: int, index: int | None = None) -> None:
    """A prompt of n tokens (prompt `index` of a batch) fits a KV cache of max_len positions."""
    if n > max_len:
        which = "prompt" if index is None else f"prompt {index}"
        raise ValueError(f"{which} of {n} tokens is longer than the KV cache (max_len {max_len})")


def check_decode_args(max_new_tokens: int, temperature: float, block: int | None = None) -> None:
    check_count(max_new_tokens, "max_new_tokens", 0)
    try:
        ok = not isinstance(temperature, bool) and math.isfinite(temperature) and temperature >= 0
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"temperature must be a finite number >= 0, 0 = greedy (got {temperature!r})")
    if block is not None:
        check_count(block, "draft block size B", 1)


def check_stream(on_tokens, batch: bool = False) -> None:
    """`on_tokens` is None or a callable that takes what the decode will pass it: `(new_tokens)` for one prompt,
    `(prompt_index, new_tokens)` for a batch (a TypeError here, not at the first streamed token after the prefill).
    A call that returns True (exactly True: a lambda that returns a list does not) ends that prompt's decoding there,
    as EOS would (stop "on_tokens"): the caller's stopping criterion, e.g. the harness's stop strings; the tokens
    already emitted stay, and a round's later tokens (speculative decoding emits a round at once) are kept too."""
    if on_tokens is None:
        return
    shape = "on_tokens(prompt_index, new_tokens) for a batch" if batch else "on_tokens(new_tokens) for one prompt"
    if not callable(on_tokens):
        raise TypeError(f"on_tokens must be callable, {shape} (got {on_tokens!r})")
    try:
        sig = inspect.signature(on_tokens)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return
    try:
        sig.bind(*([None] * (2 if batch else 1)))
    except TypeError:
        raise TypeError(f"on_tokens{sig} cannot be called as {shape}") from None


@dataclass(frozen=True)
class Sampling:
    """How a decode picks its next token from logits: greedy (the argmax) at temperature 0, else a draw from
    softmax(logits / temperature) restricted to the `top_k` most likely tokens (0: all; ties at the k-th logit are
    kept) and then to the most likely tokens whose probability first reaches `top_p` (1.0: all; at least one),
    renormalised. The filters run in transformers' order and with its tie rules (TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper), so a filtered distribution is the one `generate(do_sample=True, top_k=...,
    top_p=...)` samples. Self-speculative decoding filters the drafter's distribution the same way and verifies
    against the model's filtered one: rejection sampling keeps any target law exactly."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: Tensor) -> Tensor:
        """The sampled distribution (..., V) in float32 from logits (..., V), an fp64 model's fp64 logits too:
        transformers' generate samples from a float32 copy of the logits whatever the model's dtype."""
        x = logits.float() / self.temperature
        if 0 < self.top_k < x.shape[-1]:  # transformers: remove logits below the k-th largest (its ties stay)
            x = x.masked_fill(x < torch.topk(x, self.top_k, dim=-1).values[..., -1:], -torch.inf)
        if self.top_p < 1.0:  # transformers: ascending sort, drop the head whose cumulative mass is <= 1 - top_p
            xs, order = torch.sort(x, dim=-1)
            drop = xs.softmax(-1).cumsum(-1) <= 1 - self.top_p
            drop[..., -1] = False  # keep the most likely token
            x = x.masked_fill(drop.scatter(-1, order, drop), -torch.inf)
        return torch.softmax(x, -1)


GREEDY = Sampling()
# the smallest sampling temperature: logits / T stays finite in float32 (3.4e38) for logits up to 3.4e8 in size
MIN_TEMPERATURE = 1e-30


def sampling(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> Sampling:
    """A checked `Sampling`: a bad value, or a filter or a `seed` given to greedy decoding (which draws nothing, so
    neither could act), is refused with a one-line error before any work (the seed's own range: check_seed)."""
    check_decode_args(0, temperature)
    if seed is not None and temperature == 0:
        raise ValueError(f"seed seeds sampling; greedy decoding (temperature 0) draws nothing: give a temperature > 0 "
                         f"or drop seed (got seed={seed!r})")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature {temperature!r} is below {MIN_TEMPERATURE:g}: logits / temperature would "
                         f"overflow float32 (inf - inf = NaN in the softmax); use 0 for greedy decoding")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0, 0 = no top-k filter (got {top_k!r})")
    try:
        ok = not isinstance(top_p, bool) and 0 < top_p <= 1
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"top_p must lie in (0, 1], 1 = no top-p filter (got {top_p!r})")
    if temperature == 0 and (top_k or top_p < 1):
        raise ValueError(f"top_k / top_p filter the sampled distribution, and greedy decoding (temperature 0) draws "
                         f"nothing: give a temperature > 0 or drop them (got top_k={top_k}, top_p={top_p})")
    return Sampling(float(temperature), top_k, float(top_p))


def decode_plan(model: GPT, plan: Plan | str) -> Plan:
    check_gpt(model)
    if plan is None:
        raise ValueError("this decoding mode needs an SNLP plan (e.g. '4xF1-h0-K1')")
    return Plan.parse(plan, model.config.n_layer)


class DecodeSession:
    """Prompt, cache and output bookkeeping shared by every mode. The cache always holds the exact
    K/V of all tokens but the last one (`last`), which the next forward feeds."""

    def __init__(self, model: GPT, prompt_ids, max_new_tokens: int, eos_id: int | list[int] | None, max_len: int | None,
                 on_tokens: Callable[[list[int]], bool | None] | None, mode: str, step: Step | EagerStep | tuple | None = None,
                 slack: int = 0, make_cache: Callable[[int], KVCache] | None = None, penalty: float = 1.0):
        self.model, self.device = model, model.wte.weight.device
        self.prompt = prompt_ids_list(model, prompt_ids)
        max_len = len(self.prompt) + max_new_tokens if max_len is None else max_len
        check_max_len(max_len)
        check_fits(len(self.prompt), max_len)
        # `slack` extra positions: scratch for the padding of static-shape steps, and a compiled step's cache is
        # allocated at its bucketed length (snlp.decode.steps: the size is a graph shape); positions past max_len are
        # never valid, the budget below is what counts
        # with several steps (a drafter and a verifier) a compiled one sets the size: an eager verifier's exact size
        # would give a compiled drafter a new cache shape, i.e. a new graph, per call
        steps = tuple(step) if isinstance(step, (tuple, list)) else (() if step is None else (step,))
        lead = next((s for s in steps if s.compiled), steps[0] if steps else None)
        size = max_len + slack if lead is None else lead.cache_len(max_len + slack)
        # `make_cache(max_len)`: another cache layout, e.g. a distributed rank's window of its own layers
        self.cache = make_cache(size) if make_cache is not None else \
            KVCache.for_model(model, batch=1, max_len=size) if lead is None else lead.new_cache(model, 1, size)
        self.budget = min(max_new_tokens, max_len - len(self.prompt))
        check_stream(on_tokens)
        self.eos_id, self.stops, self.on_tokens = eos_id, stop_set(eos_id, model.config.vocab_size), on_tokens
        self.out: list[int] = []
        self.last = self.prompt[-1]
        self.result = GenerateResult(tokens=self.out, mode=mode)
        self.done = self.budget <= 0
        self.result.stop = "max_new_tokens" if max_new_tokens <= max_len - len(self.prompt) else "max_len"
        # the repetition penalty's seen ids (snlp.decode.penalty; None at penalty 1: nothing to do), as
        # BatchSession.penalty holds a batch's
        self.penalty = RepetitionPenalty.of(penalty, [self.prompt], model.config.vocab_size, self.device)

    def pick_tensor(self, logits: Tensor, how: Sampling, gens: list[torch.Generator] | None = None,
                    flag: bool = False) -> Tensor:
        """The next token (1,) from logits (1, V), left on the device, penalised by the tokens seen so far and then
        marked seen (`pick_penalised`, the pick BatchSession.pick_tensor makes for a batch); `gens`, `flag`: as in
        `pick_tensor`."""
        return pick_penalised(self.penalty, logits, lambda x: pick_tensor(x, how, gens, flag))

    def ids(self, tokens: list[int]) -> Tensor:
        return torch.tensor([tokens], dtype=torch.long, device=self.device)

    def warm(self, step: Step | EagerStep, lengths: list[int]) -> None:
        """Compile `step` for these input lengths before anything is timed (a no-op for eager steps);
        the time goes to result.compile_s, never into the decode times."""
        self.result.compile_s += step.warm(self.cache, lengths)

    def prefill(self, step: Step | EagerStep) -> None:
        """Cache the prompt without its last token (that one starts the decode loop); its graph compiles first,
        outside the prefill's clock (into result.compile_s)."""
        self.result.compile_s += step.warm_prefill(self.cache, len(self.prompt) - 1)
        t0 = now(self.device)
        if len(self.prompt) > 1:
            step.prefill(self.ids(self.prompt[:-1]), self.cache)
        self.result.prefill_s = now(self.device) - t0
        self.t0 = now(self.device)

    @property
    def remaining(self) -> int:
        return self.budget - len(self.out)

    def emit(self, new: list[int]) -> None:
        """Append new tokens, cut at EOS / the budget, stream them."""
        new = new[: self.remaining]
        cut = cut_at_stop(new, self.stops)
        if cut is not None:
            new = cut
            self.done, self.result.stop = True, "eos"
        self.out.extend(new)
        self.last = new[-1]
        if self.remaining <= 0:
            self.done = True
        if self.on_tokens is not None and new and self.on_tokens(new) is True and not self.done:
            self.done, self.result.stop = True, "on_tokens"  # the caller's stopping criterion (check_stream)

    def finish(self) -> GenerateResult:
        self.result.decode_s = now(self.device) - self.t0 if self.out else 0.0
        return self.result


class NonFiniteModelError(FloatingPointError):
    """Decoding met NaN/inf logits that the model's own sequential forward gives too: the model (its layers or
    its head, e.g. an fp16 lm_head without softcap overflowing) is the cause, not the SNLP plan."""


def stop_set(eos_id, vocab_size: int | None = None) -> frozenset[int]:
    """The token ids decoding stops after: `eos_id` None (none), one id, or several (a Hugging Face model's
    generation_config.json lists every end-of-sequence id: Llama-3-Instruct's <|eot_id|> and <|end_of_text|>, ...).
    With the model's `vocab_size`, an id it can never generate (>= vocab_size) is refused: decoding would run past
    where the caller meant it to stop, silently."""
    if eos_id is None:
        return frozenset()
    # an int or a list of them, as transformers' generate(eos_token_id=) takes; a tensor or array as those are:
    # 0-d one id (generate unsqueezes it), 1-D a list. A 0-d tensor has __iter__ but cannot be iterated
    # An iterator (a generator, iter(list)) is refused: the input checks read it once and the session again, which
    # then saw none and decoded past every stop id. A bool (True, or one inside a list) is no id either.
    ndim = getattr(eos_id, "ndim", None)
    try:
        if ndim is not None and ndim > 1 or str(getattr(eos_id, "dtype", "")) in ("torch.bool", "bool") \
                or hasattr(eos_id, "__next__"):
            raise TypeError("not one id or a list of ids")
        many = ndim != 0 and hasattr(eos_id, "__iter__")
        # a 0-d bool tensor inside a list is a bool as True is (operator.index reads it as 0 or 1)
        if any(isinstance(i, bool) or str(getattr(i, "dtype", "")) in ("torch.bool", "bool")
               for i in (eos_id if many else [eos_id])):
            raise TypeError("a bool is no id")
        ids = [operator.index(i) for i in eos_id] if many else [operator.index(eos_id)]
    except TypeError:
        ids = [-1]
    if any(i < 0 for i in ids):
        raise ValueError(f"eos_id must be a token id or a list of token ids >= 0 (got {eos_id!r:.80})")
    if vocab_size is not None and any(i >= vocab_size for i in ids):
        raise ValueError(f"eos_id {eos_id!r} holds ids outside the model's vocabulary [0, {vocab_size}): decoding "
                         f"could never stop there (another model's or tokenizer's id?)")
    return frozenset(ids)


def cut_at_stop(new: list[int], stops: frozenset[int]) -> list[int] | None:
    """`new` up to and including its first stop id, or None if it holds none."""
    for i, t in enumerate(new):
        if t in stops:
            return new[:i + 1]
    return None


NONFINITE = -1  # what a flagged pick returns for a row whose logits hold NaN/inf (never a token id)


def pick_tensor(logits: Tensor, how: Sampling, gens: list[torch.Generator | None] | None = None,
                flag: bool = False) -> Tensor:
    """Next token of each row of logits (B, V), on the logits' device (nothing is read back): the argmax when greedy,
    else a draw from the row's own generator gens[j] of `how`'s distribution (Sampling.probs). `flag`: a row whose
    logits hold NaN/inf gets NONFINITE instead of a token read off them, so the flag rides on the host read of the
    tokens that the loop does anyway (no extra sync), and `check_picked` raises on it."""
    finite = torch.isfinite(logits).all(-1) if flag else None  # (B,)
    if how.greedy:
        tok = logits.argmax(-1)
    else:
        probs = how.probs(logits)
        if flag:  # a non-finite row draws from a stand-in (its token is dropped below): multinomial refuses NaN
            probs = torch.where(finite[:, None], probs, 1.0)
        tok = torch.cat([torch.multinomial(probs[j], 1, generator=g) for j, g in enumerate(gens)])
    return tok if finite is None else torch.where(finite, tok, NONFINITE)  # (B,)


def pick_tokens(logits: Tensor, how: Sampling, gens: list[torch.Generator | None] | None = None,
                flag: bool = False) -> list[int]:
    """`pick_tensor` read back to the host: one read of the (B,) tokens."""
    return pick_tensor(logits, how, gens, flag).tolist()


READ_EVERY = 8  # decode steps between host reads of the tokens on an accelerator (see read_every)


def read_every(device, every: int | None = None) -> int:
    """How many single-token steps a decode loop queues before it reads their tokens back (`every`; None: 1 on the
    CPU, READ_EVERY elsewhere). A read waits for the device, and until the host has the token and launched the next
    step the device idles: at batch 1 under CUDA graphs a step is a few hundred microseconds of kernels and the host's
    side of a step (the read, the bookkeeping, the next launch) is of the same order. So the loop feeds each step
    the previous step's token as a device tensor and reads n at a time (gpt-fast queues every step and reads at the
    end). Tokens past an EOS in the same n are computed and dropped. On the CPU a read costs nothing: one step each,
    tokens streamed as they come. The tokens do not depend on it, with one exception in low precision: an eager
    batch's finished rows leave it at reads, so the batch's composition between reads, and with it the rounding of
    the live rows' bf16 / fp16 matmuls, differs, and a near-tie may go the other way (as a row's tokens may differ
    between batches anyway; within the near-argmax contract of tests/test_seam_matrix.py)."""
    check_read_every(every)
    if every is None:
        return 1 if torch.device(device).type == "cpu" else READ_EVERY
    return operator.index(every)


def check_read_every(every: int | None) -> None:
    if every is None:
        return
    try:
        ok = not isinstance(every, bool) and operator.index(every) >= 1  # any integer type (a numpy int too)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"read_every must be an integer >= 1, the decode steps between host reads (got {every!r})")


def pick_token(logits: Tensor, how: Sampling, gen: torch.Generator | None, flag: bool = False) -> int:
    """Next token from logits (V,) (`pick_tensor`); with `flag`, NONFINITE if the logits hold NaN/inf."""
    return pick_tokens(logits[None], how, [gen], flag)[0]


def check_picked(tokens: list[int], plan, step: int, prompts: list[int] | None = None, model: GPT | None = None,
                 context: Callable[[int], list[int]] | None = None) -> None:
    """Raise, naming the plan and the step, if a flagged pick of an SNLP forward's logits met NaN/inf (a NONFINITE
    entry): no token is emitted from them. `step`: tokens generated before this one; `prompts`: the batch rows'
    prompt indices. With the `model` and `context(j)`, the token ids whose last position's logits are entry j of
    `tokens` (called only on this error path), the error says where the values came from (`nonfinite_source`): the
    model's own forward (NonFiniteModelError, which does not blame the plan) or the plan's solver state
    (SNLPDivergenceError). `plan` None: the logits are the model's own forward's (sequential decoding, a
    speculative or Jacobi verifier), so a NONFINITE entry raises NonFiniteModelError."""
    if NONFINITE not in tokens:
        return
    bad = [j for j, t in enumerate(tokens) if t == NONFINITE]
    where = f"generated token {step + 1}"
    if prompts is not None:
        where += f" of prompt(s) {[prompts[j] for j in bad]}"
    if plan is None:
        if context is not None:  # the logits at the last position of context(j) predict the token after it
            where += f" (its logits at sequence position {len(context(bad[0])) - 1})"
        known = model is not None and context is not None  # else (a distributed rank) the source is not looked up
        source = (nonfinite_source(model, context(bad[0])) or UNCACHED_FINITE) if known else None
        raise NonFiniteModelError(f"the model's own forward (not an SNLP plan) gives NaN/inf logits for {where}"
                                  + (f": {source}" if source else "") + "; no token is read off them (check its "
                                  "weights are finite)")
    known = model is not None and context is not None
    source = nonfinite_source(model, context(bad[0])) if known else None
    if source is not None:
        raise NonFiniteModelError(f"the logits of {where} contain NaN/inf under plan {plan}, and so do the model's "
                                  f"own: {source}; the plan is not the cause")
    origin = ("they come from the solver's state (the model's own forward gives finite logits here)" if known else
              "check the model's own forward is finite")
    raise SNLPDivergenceError(f"SNLP plan {plan} diverged while decoding: the logits of {where} contain NaN/inf (no "
                              f"token is read off them); {origin}; {plan.divergence_hints()}")


# why a cached multi-token forward can be NaN/inf where the uncached one over the same prefix is not: masked attention
# weighs a later position's values by exactly 0, and 0 * inf / 0 * NaN is NaN (torch's attention does not skip them)
UNCACHED_FINITE = ("the uncached forward over the same prefix is finite, so NaN/inf keys/values of a later position "
                   "(a draft or guess fed in the same forward, or left in the cache) reach it through masked attention "
                   "(0 * inf is NaN)")


def nonfinite_source(model: GPT, seq: list[int]) -> str | None:
    """Why the model's own sequential forward over `seq` gives NaN/inf logits at its last position (its layers or
    its head: final norm, lm_head, softcap), or None if they are finite, so that non-finite SNLP logits come from
    the solver's state. Run only on the error path: one uncached forward, off the timed loop."""
    with torch.inference_mode():
        h = model.hidden_states(torch.tensor([seq], device=model.wte.weight.device))[-1][:, -1:]  # (1, 1, D)
        if not bool(torch.isfinite(h).all()):
            return "its layers' final hidden state is already NaN/inf (run sequentially)"
        if bool(torch.isfinite(model.head(h)).all()):
            return None
    cap = "" if model.config.softcap > 0 else ", which has no logit softcap,"
    return (f"its final hidden state is finite but its head (final norm and lm_head{cap} in "
            f"{model.lm_head.weight.dtype}) overflows on it; decode in float32 or bfloat16")


def check_seed(seed, rows: int = 1) -> None:
    """A sampling seed is an integer (numpy's too) or None, and every seed the call draws with (a batch's row i uses
    seed + i) fits torch's manual_seed, [-2**63, 2**64); torch's own errors name neither the argument nor the call."""
    try:
        ok = seed is None or not isinstance(seed, bool) and operator.index(seed) is not None
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"seed must be an integer or None (got {seed!r})")
    if seed is not None and not -2 ** 63 <= operator.index(seed) <= 2 ** 64 - max(rows, 1):
        raise ValueError(f"seed must lie in [-2**63, 2**64 - {max(rows, 1)}] (a batch's row i samples with seed + i; "
                         f"torch's generators take 64 bits; got {seed!r})")


def make_generator(seed: int | None, device) -> torch.Generator:
    """A generator for one run's draws: seeded with `seed`, or, without one, from fresh OS entropy
    (Generator.seed()) WITHOUT touching torch's global RNG (torch.seed() would reseed it: a caller's seeded
    global stream would change under a sampling call)."""
    check_seed(seed)
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(operator.index(seed))
    return gen


def check_step(step: Step | EagerStep, model: GPT | None, plan: Plan | None, name: str, compile: bool = False) -> None:
    """Refuse a prebuilt step (argument `name`) that computes another forward than the one the call decodes with:
    another model's (`model`; None: any module, as a speculative drafter may be) or another plan's (`plan`; None: the
    model's own sequential forward). It would decode with it, silently, under this call's model and plan label (a
    verifier of another model breaks speculative decoding's exactness). Steps that do not say what they compute
    (built from a function of one's own, Step.of_model None) are not checked. `compile` True: the step must be
    compiled (an eager one would run eagerly, the flag ignored)."""
    if compile and not step.compiled:
        raise ValueError(f"compile=True, but the {name}= passed is an eager step, which runs as it was built: pass a "
                         f"compiled one (compile=True where it is built) or drop compile")
    if step.of_model is None:
        return
    does = "the sequential forward" if step.of_plan is None else f"the SNLP forward of plan {step.of_plan}"
    wants = "the sequential forward" if plan is None else f"the SNLP forward of plan {plan}"
    if step.of_plan != plan:
        raise ValueError(f"{name}= computes {does}, but this call decodes with {wants}: pass a step built for it "
                         f"({'sequential_step(model)' if plan is None else 'snlp_step(bind(model, plan))'}) or none")
    if model is not None and step.of_model is not model:
        raise ValueError(f"{name}= computes {does} of another model than the one passed (a step is bound to the module "
                         f"it was built from): build it from this model, or pass none")


def sequential_forward(model: GPT, compile: bool = False, step: Step | EagerStep | None = None,
                       name: str = "step") -> Step | EagerStep:
    if step is None:
        return sequential_step(model, compile)
    check_step(step, model, None, name, compile)
    return step


def snlp_forward(model: GPT, plan: Plan, compile: bool = False, step: Step | EagerStep | None = None,
                 preheat: Preheat | None = None, share_weights: bool = False, name: str = "step",
                 same_model: bool = True) -> Step | EagerStep:
    # fused once per call; no NaN/inf check of the solve inside the step (a host sync per token): the decode loop
    # flags NaN/inf logits on the host read of the tokens it does anyway (pick_tokens / check_picked)
    if step is not None:  # `same_model` False: a speculative drafter may be another module (an adapted drafter's)
        check_step(step, model if same_model else None, plan, name, compile)
        return step
    return snlp_step(bind(model, plan, check_finite=False, preheat=preheat, share_weights=share_weights), compile)


def step_slack(*steps) -> int:
    return max(s.slack for s in steps)

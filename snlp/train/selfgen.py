"""Self-distillation data for `snlp adapt --self-distill N`: the base's own greedy replies to the training prompts.

A drafter is accepted where it agrees with the base's GREEDY continuation (self-speculative decoding verifies
against it), so its training text can be what the base itself writes rather than human replies: for every
TRAINING conversation of each `chat:` part of the data (snlp.io.chat.split_conversations, the split every
drafter user shares: held-out conversations are never read here), the opening through its first user turn is
rendered with the generation prompt (exactly how `snlp eval --drafter` renders its held-out prompts), the base
decodes N tokens greedily from it (snlp.decode's batched KV-cached sequential decoding, stopping after the
tokenizer's stop ids), and the row prompt + reply replaces the human conversation in the training stream. Text
parts stay as they are; the held-out stream is the unchanged human one.

A training prompt whose ids equal a held-out prompt's (two conversations that open alike) is left out, so no
reply the drafter is scored on is one it trained on.

Cache: one .npz per (base weights fingerprint, the base's config, its dtype and device type, N, stop ids) in
`cache_dir` (the config: a base re-saved with another rope_base or window decodes other replies from the same
weights), holding one reply per prompt keyed by the digest of the prompt's ids; a later run (more prompts, another --out, --resume) generates only the prompts
it lacks. Two runs writing one store at once lose nothing but work (the replace is atomic; the last one wins);
under torchrun every process decodes the replies it lacks itself (the same tokens: greedy and deterministic).
Decoding happens while the job is built, before the run's training clock (--minutes) starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

import snlp.io.chat as chat
import snlp.io.data as D
from snlp.decode.generate import sequential_generate
from snlp.model.gpt import GPT, eval_mode

GEN_BATCH = 32  # prompts per batched decode (sorted by length, so a batch's rows pad little) ...
GEN_TOKENS = 8192  # ... and at most this many cached positions per batch (rows x (longest prompt + N))


@dataclass
class SelfGen:
    """The self-distilled rows (prompt + reply) of the training prompts, and how they were obtained."""

    rows: list[list[int]]
    prompt_lens: list[int] = field(default_factory=list)  # the prompt's length in each row (the reply follows it)
    prompts: int = 0  # training prompts used
    skipped: int = 0  # prompts left out: prompt + N tokens longer than the model's sequence_len
    held_out_twins: int = 0  # training prompts left out: equal to a held-out prompt
    generated: int = 0  # prompts decoded by this call (the others came from the cache)
    reply_tokens: int = 0  # tokens of the base's replies in `rows`
    seconds: float = 0.0  # time spent decoding
    cache: str | None = None  # the store used (None: no cache_dir)
    per_part: dict = field(default_factory=dict)  # chat part -> prompts used


def prompt_key(ids: list[int]) -> str:
    """Digest of one prompt's token ids: its entry in the store."""
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:32]


def store_path(cache_dir: str, fingerprint: str, n_tokens: int, stops: tuple[int, ...]) -> Path:
    key = hashlib.sha256(f"{fingerprint}|{n_tokens}|{','.join(map(str, stops))}".encode()).hexdigest()[:20]
    return Path(cache_dir) / f"selfgen-{key}.npz"


def read_store(path: Path) -> dict[str, list[int]]:
    if not path.is_file():
        return {}
    with np.load(path) as z:
        keys, flat, off = z["keys"], z["ids"], z["offsets"]
    return {str(k): flat[off[i]:off[i + 1]].tolist() for i, k in enumerate(keys)}


def write_store(path: Path, store: dict[str, list[int]]) -> None:
    keys = sorted(store)
    off = np.cumsum([0] + [len(store[k]) for k in keys])
    flat = np.asarray([t for k in keys for t in store[k]], dtype=np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}.npz")
    np.savez(tmp, keys=np.asarray(keys, dtype="U32"), ids=flat, offsets=off)
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def training_prompts(spec: str, tok, val_frac: float, max_prompts: int = 0
                     ) -> tuple[list[tuple[str, list[list[int]]]], int]:
    """([(chat part, the token ids of its TRAINING conversations' openings)], training prompts left out), one entry
    per chat part of `spec` in order (a part named twice counts twice, as the human stream counts it). An opening
    runs through the first user turn, with the generation prompt, in conversation order, at most `max_prompts`
    per part (0: all). Each part is split on its own by snlp.io.chat.split_conversations, as adaptation and
    `snlp eval --drafter` split it; a training opening equal to a held-out one is left out and counted."""
    def render(e):
        return tok.render_chat(chat.prompt_messages(e.messages), add_generation_prompt=True)[0]

    out, twins = [], 0
    for part in D.parts(spec):
        if part.startswith("chat:"):
            tr, va = chat.split_conversations(chat.load_conversations(chat.chat_part(part)), tok, val_frac)
            held = {tuple(render(e)) for e in va}
            ps = [render(e) for e in tr]
            keep = [p for p in ps if tuple(p) not in held]
            twins += len(ps) - len(keep)
            out.append((part, keep[:max_prompts] if max_prompts else keep))
    return out, twins


def base_identity(model: GPT, fingerprint: str) -> str:
    """What decides the base's greedy replies, for the store's key: its weights fingerprint, its config (the same
    weights under another rope_base, window or softcap decode differently), dtype and device type."""
    p = next(model.parameters())
    conf = json.dumps(asdict(model.config), sort_keys=True, default=str)
    return f"{fingerprint}|{hashlib.sha256(conf.encode()).hexdigest()[:16]}|{p.dtype}|{p.device.type}"


@torch.no_grad()
def greedy_replies(model: GPT, prompts: list[list[int]], n_tokens: int, stops: tuple[int, ...],
                   batch: int = GEN_BATCH, max_positions: int = GEN_TOKENS) -> list[list[int]]:
    """The base's greedy reply (at most n_tokens, through the first stop id) to each prompt, in order: batched
    KV-cached sequential decoding of the prompts sorted by length (each row's tokens are its own single-prompt
    run's, snlp.decode.batch), at most `batch` prompts and `max_positions` cached positions per batch."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    groups, cur = [], []
    for i in order:  # ascending lengths: the row just added is the batch's longest
        if cur and (len(cur) >= batch or (len(cur) + 1) * (len(prompts[i]) + n_tokens) > max_positions):
            groups.append(cur)
            cur = []
        cur.append(i)
    groups += [cur] if cur else []
    for idx in groups:
        res = sequential_generate(model, [prompts[i] for i in idx], max_new_tokens=n_tokens,
                                  eos_id=list(stops) or None)
        res = res if isinstance(res, list) else [res]
        for i, r in zip(idx, res):
            out[i] = list(r.tokens)
    return out


def self_distill_rows(model: GPT, tok, spec: str, val_frac: float, n_tokens: int, fingerprint: str,
                      max_prompts: int = 0, cache_dir: str | None = None, verbose: bool = False,
                      need_tokens: int = 0, other_tokens: int = 0) -> SelfGen:
    """The rows prompt + the base's greedy reply of n_tokens for the training prompts of `spec`'s chat parts
    (`training_prompts`), read from / added to the store in `cache_dir` (keyed by `base_identity`, n_tokens and
    the tokenizer's stop ids; one entry per prompt digest). `need_tokens`: a ValueError, before any decoding, when
    even replies of the full n_tokens could not give the stream (with `other_tokens` of text beside it) more."""
    stops = tuple(int(t) for t in (tok.chat_stop_ids or ()))  # a reply ends where a chat turn ends
    limit = model.config.sequence_len
    parts, twins = training_prompts(spec, tok, val_frac, max_prompts)
    prompts, skipped, per_part = [], 0, {}
    for part, ps in parts:
        keep = [p for p in ps if len(p) + n_tokens <= limit]
        skipped += len(ps) - len(keep)
        prompts += keep
        per_part[part] = per_part.get(part, 0) + len(keep)
    most = other_tokens + sum(len(p) + n_tokens for p in prompts)
    if need_tokens and most <= need_tokens:
        raise ValueError(f"--self-distill {n_tokens}: {len(prompts):,} training prompts with replies of at most "
                         f"{n_tokens} tokens give at most {most:,} train tokens: need more than {need_tokens:,}")
    path = store_path(cache_dir, base_identity(model, fingerprint), n_tokens, stops) if cache_dir else None
    store = read_store(path) if path else {}
    keys = [prompt_key(p) for p in prompts]
    todo = sorted({k: p for k, p in zip(keys, prompts) if k not in store}.items())
    t0 = time.perf_counter()
    if todo:
        if verbose:
            print(f"self-distill: the base decodes {n_tokens} tokens for {len(todo):,} of {len(prompts):,} training "
                  f"prompts{f' ({len(prompts) - len(todo):,} cached)' if len(todo) < len(prompts) else ''}",
                  file=sys.stderr, flush=True)
        with eval_mode(model):  # every submodule leaves in the mode it came in (a caller's frozen prefix in eval)
            replies = greedy_replies(model, [p for _, p in todo], n_tokens, stops)
        store.update({k: r for (k, _), r in zip(todo, replies)})
        if path:
            write_store(path, store)
    seconds = time.perf_counter() - t0
    rows = [p + store[k] for p, k in zip(prompts, keys)]
    return SelfGen(rows=rows, prompt_lens=[len(p) for p in prompts], prompts=len(prompts), skipped=skipped, held_out_twins=twins, generated=len(todo),
                   reply_tokens=sum(len(store[k]) for k in keys), seconds=seconds,
                   cache=None if path is None else str(path), per_part=per_part)

"""Chat data for SFT: conversations in the common Hugging Face schema

    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}

from local JSONL files (comma-separated, folders and globs as for `snlp train --data`) or
`hf:NAME[:CONFIG][:SPLIT]` (the `datasets` library, needs network); a part `mc:PATH` turns
multiple-choice questions (snlp.eval.mc's files: ARC JSONL, MMLU CSV, plain JSONL) into one-turn chats,
the lettered question then the answer letter (nanochat mixes ARC/MMLU train sets into SFT so). Rendered with the tokenizer's
chat template (`Tokenizer.render_chat`) into token ids and an assistant mask.

Batches are padded, one conversation per row: row i holds conversation i's tokens then padding, and
its targets are the next tokens where the mask marks an assistant token and -1 (ignored) elsewhere.
Attention is causal, so a conversation's tokens never see the padding after it nor another row:
conversations never attend across each other, with the model's attention exactly as in pretraining
(no packed-document mask is needed; the price is the padded positions' compute).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from snlp.io import data as D
from snlp.io.mctasks import LETTERS, letter_prompt, load_task

ROLES = ("system", "user", "assistant")


def check_messages(messages, where: str = "conversation") -> list[dict]:
    """Validate one conversation: a non-empty list of {role, content} with string content, an optional
    leading system message, then user and assistant turns alternating, starting with user."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{where}: message {i} must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {i} has role {m['role']!r}; valid roles: {', '.join(ROLES)}")
        if not isinstance(m["content"], str):  # nanochat's list of parts (python tool calls) included: no tool tokens
            raise ValueError(f"{where}: message {i} content must be a string"
                             + (" (a list of parts, e.g. nanochat's python tool calls, is not supported: the "
                                "template has no tool tokens)" if isinstance(m["content"], list) else ""))
        out.append({"role": m["role"], "content": m["content"]})
    turns = out[1:] if out[0]["role"] == "system" else out
    if not turns:
        raise ValueError(f"{where}: a system message alone is not a conversation; add a user turn")
    for i, m in enumerate(turns):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            raise ValueError(f"{where}: turn {i} is {m['role']!r} but {want!r} was expected (after an optional "
                             f"system message, user and assistant alternate, starting with user)")
    return out


def _rows_from_file(path: Path):
    if path.suffix.lower() != ".jsonl":
        raise ValueError(f"chat data {path}: expected a .jsonl file of {{\"messages\": [...]}} rows")
    with open(path, "rb") as f:
        # lines as text mode's universal newlines cut them (\n, \r\n and a lone \r: bytes.splitlines), read in
        # binary so that a bad byte is named by its line, as a bad JSON row is
        for i, raw in enumerate((piece for chunk in f for piece in chunk.splitlines()), 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{i} is not UTF-8 text ({e.reason} at byte {e.start}); chat JSONL files "
                                 f"are read as UTF-8") from e
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i} is not valid JSON ({e})") from e
            if not isinstance(row, dict) or "messages" not in row:
                raise ValueError(f"{path}:{i} has no 'messages' field (chat rows look like "
                                 f"{{\"messages\": [{{\"role\": \"user\", \"content\": ...}}, ...]}}"
                                 + ("; a bare list of messages per line, nanochat's CustomJSON form, goes inside "
                                    "{\"messages\": ...}" if isinstance(row, list) else "") + ")")
            yield check_messages(row["messages"], f"{path}:{i}")


def _rows_from_hf(spec: str):
    parts = spec[3:].split(":")
    if not parts[0] or len(parts) > 3:
        raise ValueError(f"malformed Hugging Face source {spec!r}: use hf:NAME[:CONFIG][:SPLIT]")
    name, config = parts[0], (parts[1] if len(parts) > 1 and parts[1] else None)
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    try:
        import datasets
    except ImportError as e:
        raise ValueError(f"chat data {spec!r} needs the Hugging Face datasets library: pip install 'snlp[hf]'") from e
    from snlp.io.hub import blocked

    if why := blocked():  # a stream reads no cache: the client would retry every request first
        raise ValueError(f"could not stream Hugging Face dataset {spec!r}: {why}; use a local file")
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
        for i, row in enumerate(ds):
            if "messages" not in row:
                raise ValueError(f"dataset {name} rows have no 'messages' field (found {sorted(row)})")
            yield check_messages(row["messages"], f"dataset {name} row {i}")
    except ValueError:
        raise
    except Exception as e:  # offline, unknown dataset: assorted exception types
        raise ValueError(f"could not stream Hugging Face dataset {spec!r} ({type(e).__name__}: {e}); check the "
                         f"name and that the hub is reachable, or use a local .jsonl file") from e


def load_conversations(spec: str, limit: int = 0) -> list[list[dict]]:
    """Conversations of a data spec (comma-separated local .jsonl files/folders/globs or hf:...), at
    most `limit` (0 = all), in file order."""
    out = []
    for part in D.parts(spec):
        # chat:X is X here (every part is read as chat); missing_parts and resolve_part already read it so, and the
        # loader alone named it an unknown data source (`snlp sft --data chat:c.jsonl` refused an existing file)
        part = chat_part(part)
        if part.startswith("mc:"):
            rows = mc_conversations(part)
        elif part.startswith("hf:"):
            rows = _rows_from_hf(part)
        else:
            rows = (r for f in D.resolve_files(part) for r in _rows_from_file(f))
        for conv in rows:
            out.append(conv)
            if limit and len(out) >= limit:
                return out
    if not out:
        raise ValueError(f"chat data {spec!r} holds no conversations")
    return out


def mc_conversations(task: str):
    """One-turn chats of a multiple-choice task: the lettered question (snlp.io.mctasks.letter_prompt) and the
    answer letter, exactly what `snlp eval --task` scores."""
    for q in load_task(task):
        yield [{"role": "user", "content": letter_prompt(q)}, {"role": "assistant", "content": LETTERS[q.answer]}]


@dataclass
class ChatExample:
    ids: list[int]
    mask: list[int]  # 1 = assistant token (trained on)
    messages: list[dict] | None = None  # the conversation it was rendered from (held-out prompts are cut from it)


def render(conversations, tokenizer, max_len: int) -> list[ChatExample]:
    """Render conversations with the tokenizer's chat template, truncated to `max_len` tokens; those
    left with no assistant token to learn from are dropped."""
    out = []
    for conv in conversations:
        ids, mask = tokenizer.render_chat(conv)
        ids, mask = ids[:max_len], mask[:max_len]
        if sum(mask[1:]) > 0:
            out.append(ChatExample(ids, mask, conv))
    return out


def split(examples: list, val_frac: float) -> tuple[list, list]:
    """Deterministic split: every round(1/val_frac)-th example goes to validation (as snlp.io.data)."""
    return D.split_documents(examples, val_frac)


RENDER_MAX = 1 << 20  # adaptation renders whole conversations (its windows are cut from the token stream)


def split_conversations(conversations, tokenizer, val_frac: float,
                        max_len: int = RENDER_MAX) -> tuple[list[ChatExample], list[ChatExample]]:
    """THE train / held-out split of a chat set, one function for every user of it: `snlp adapt` trains on the
    first part (`token_streams`) and `snlp eval --drafter --chat-prompts` cuts its prompts from the second
    (snlp.eval.drafter.held_out_prompts). Conversations are rendered first and those left without an assistant
    token are dropped BEFORE the split (so they cannot shift which conversations are held out); each example
    keeps its `messages`."""
    return split(render(conversations, tokenizer, max_len), val_frac)


def local_path(path: str | None) -> str | None:
    """`path` made absolute when it names something local (a file, folder, or a glob that matches): what a
    drafter records, so that reading it again from another directory reads the same data. Names that are not
    local (stdlib, hf:..., a hub name) stay as they are."""
    return D.absolute_part(path) if path else path


def resolve_part(part: str) -> str:
    """One data spec part with its local path absolute (`local_path`), its chat: / mc: prefixes kept."""
    head, rest = D.split_heads(part)
    return head + local_path(rest)


def missing_parts(spec: str | None) -> list[str]:
    """The parts of a data spec (chat: / mc: prefixes allowed) whose local files are not here (data.missing_parts)."""
    return [p for p in D.parts(spec) if D.missing_parts(D.split_heads(p)[1])]


def resolve_spec(spec: str | None) -> str:
    """A data spec with every local part absolute (`resolve_part`): the form a drafter records and the form
    eval compares against (so `d/a.jsonl` and `/abs/d/a.jsonl` are one part, another cwd's `d/a.jsonl` not)."""
    return ",".join(resolve_part(p) for p in D.parts(spec))


def chat_part(spec: str) -> str:
    """The chat set of a `chat:SPEC` data part or a bare SPEC (what --chat-prompts takes)."""
    return spec[len("chat:"):] if spec.startswith("chat:") else spec


def token_streams(spec: str, tok, max_chars: int, val_frac: float, train: bool = True,
                  keep: tuple[str, ...] | None = None, with_mask: bool = False) -> tuple[np.ndarray, ...]:
    """(train, held-out) token streams of an adaptation data spec: text parts as `snlp train` reads them
    (documents, BOS before each, split by document with snlp.io.data.split_documents over all text parts
    together), `chat:` parts rendered with the tokenizer's chat template and split by `split_conversations`.
    `train` False: the held-out stream only (the train stream comes back empty, its text is not tokenized).
    `keep`: only these parts' rows (e.g. the held-out documents of one file of the spec); the split is still
    the whole spec's, so a kept document is held out exactly when adaptation held it out. `with_mask`: also
    the two streams' assistant masks (1 = a reply token, `ChatExample.mask`, the mask SFT trains on; 0 on
    every text token), aligned token for token: (train, held-out, train mask, held-out mask)."""
    all_parts = D.parts(spec)
    keep = tuple(all_parts) if keep is None else keep
    text = [s for s in all_parts if not s.startswith("chat:")]
    tr_rows, va_rows = [], []
    tr_mask, va_mask = [], []  # aligned with the rows: text documents have no replies (all 0)
    if any(s in keep for s in text):  # (no text part kept: the text is not even read)
        if set(text) <= set(keep):
            docs = [(None, d) for d in D.documents(",".join(text), "text", max_chars)]
        elif max_chars or any(s.startswith("hf:") for s in text):
            raise ValueError(f"cannot select parts of the capped text data {spec!r} (--max-chars or hf: sources): "
                             f"use the whole spec")
        else:  # uncapped local parts: documents(joined) is the parts' documents in order, so tag each with its part
            docs = [(s, d) for s in text for d in D.documents(s, "text", 0)]
        tr, va = D.split_documents(docs, val_frac)
        pick = lambda rows: [d for s, d in rows if s is None or s in keep]  # noqa: E731
        bos = tok.bos_id
        tr_rows += [[bos] + ids for ids in tok.encode_documents(pick(tr))] if train else []
        va_rows += [[bos] + ids for ids in tok.encode_documents(pick(va))]
        tr_mask += [[0] * len(r) for r in tr_rows]
        va_mask += [[0] * len(r) for r in va_rows]
    for s in all_parts:
        if s.startswith("chat:") and s in keep:
            tr, va = split_conversations(load_conversations(chat_part(s)), tok, val_frac)
            tr_rows += [e.ids for e in tr] if train else []
            va_rows += [e.ids for e in va]
            tr_mask += [e.mask for e in tr] if train else []
            va_mask += [e.mask for e in va]
    cat = lambda rows: np.asarray([t for r in rows for t in r], dtype=np.int64)  # noqa: E731
    if with_mask:
        return cat(tr_rows), cat(va_rows), cat(tr_mask), cat(va_mask)
    return cat(tr_rows), cat(va_rows)


def prompt_messages(messages: list[dict]) -> list[dict]:
    """A conversation's opening up to its first user turn (with the system message, if any): the prompt whose
    reply a held-out conversation's first assistant turn is."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[:first + 1]


def collate(examples: list[ChatExample], pad_id: int, with_valid: bool = False) -> tuple[Tensor, ...]:
    """Right-padded inputs x (B, T) and targets y (B, T): y[i, t] = ids[t+1] where mask[t+1] is set,
    else -1 (user turns, markers, padding). T = longest example - 1. With `with_valid`, also valid (B, T) bool:
    True on each row's own positions, False on its padding (the positions a mean over tokens must skip)."""
    T = max(len(e.ids) for e in examples) - 1
    x = torch.full((len(examples), T), pad_id, dtype=torch.long)
    y = torch.full((len(examples), T), -1, dtype=torch.long)
    valid = torch.zeros((len(examples), T), dtype=torch.bool)
    for i, e in enumerate(examples):
        ids, m = torch.tensor(e.ids), torch.tensor(e.mask, dtype=torch.bool)
        n = len(e.ids) - 1
        x[i, :n] = ids[:-1]
        y[i, :n] = torch.where(m[1:], ids[1:], -1)
        valid[i, :n] = True
    return (x, y, valid) if with_valid else (x, y)


def batch_at(examples: list[ChatExample], index: int, batch: int, seed: int, pad_id: int, rank: int = 0,
             world: int = 1, with_valid: bool = False) -> tuple[Tensor, ...]:
    """Micro-batch `index`: `batch * world` examples drawn by a generator seeded by (seed, index), this
    rank taking rows rank*batch..; depends only on the global index (exact resume, DDP = one process).
    `with_valid`: as for `collate`."""
    rng = np.random.default_rng([seed, index])
    pick = rng.integers(0, len(examples), size=batch * world)[rank * batch:(rank + 1) * batch]
    return collate([examples[i] for i in pick], pad_id, with_valid)


def val_batches(examples: list[ChatExample], batch: int, n_batches: int, pad_id: int) -> list:
    """Up to `n_batches` fixed batches of consecutive validation examples."""
    return [collate(examples[i:i + batch], pad_id) for i in range(0, min(len(examples), batch * n_batches), batch)]

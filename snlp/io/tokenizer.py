"""Tokenizer saved as tokenizer.json next to every checkpoint: either our own byte-level BPE (Hugging Face
`tokenizers`, special tokens reserved up front so later chat/SFT data needs no re-training) or a foreign
Hugging Face tokenizer of a converted model (snlp.io.hf), whose BOS/EOS tokens and chat template are kept in
tokenizer_meta.json beside it."""

from __future__ import annotations

import functools
import operator
import re

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

FILENAME = "tokenizer.json"
META_FILENAME = "tokenizer_meta.json"  # foreign tokenizers only: bos/eos tokens, chat template
BOS = "<|bos|>"
# reserved for chat / SFT: user and assistant turn markers
SPECIAL_TOKENS = [BOS, "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>"]
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte plus the specials
NO_LIMIT = int(1e30)  # transformers' model_max_length of a tokenizer that names none (VERY_LARGE_INTEGER)
# a chat template that marks assistant text for transformers' return_assistant_tokens_mask
GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def check_text(text, what: str) -> str:
    """`text` when it is a str; else a one-line ValueError naming the method `what` and what was given (tokenizers'
    own error, "TextInputSequence must be str", names neither)."""
    if not isinstance(text, str):
        raise ValueError(f"Tokenizer.{what} takes a str, got {type(text).__name__} {text!r:.40}"
                         + (": decode the bytes first" if isinstance(text, (bytes, bytearray)) else ""))
    return text


class Tokenizer:
    """Thin wrapper over a `tokenizers.Tokenizer`: encode/decode, bos_id, eos_id, vocab_size, save/load,
    chat template. `meta` is None for our own BPE; for a foreign (converted) tokenizer it holds
    {"bos_token", "eos_token", "chat_template"} (each may be None), "pad_token" / "unk_token" where the source has
    them, "eos_token_ids": every id generation stops after (`stop_ids`), the source generation config's list as
    `snlp convert` recorded it ([] where that config names no EOS: transformers' generate() then stops nowhere;
    absent in a checkpoint converted before the list was recorded: the tokenizer's EOS then stops it),
    "generation_config": the source's other generation defaults, and "model_max_length" /
    "padding_side" / "truncation_side" where the source sets them: `snlp export` writes all of these back."""

    def __init__(self, tok: HFTokenizer, meta: dict | None = None):
        self.tok, self.meta = tok, meta
        if meta is not None:
            for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                t = meta.get(key)
                if t is not None and tok.token_to_id(t) is None:
                    raise ValueError(f"tokenizer meta names {key}={t!r}, which is not in the tokenizer's vocabulary")
            extra = meta.get("extra_special_tokens")
            if extra is not None and not (isinstance(extra, list) and all(
                    isinstance(t, str) and tok.token_to_id(t) is not None for t in extra)):
                raise ValueError(f"tokenizer meta extra_special_tokens={extra!r} must be a list of tokens of this "
                                 f"tokenizer's vocabulary")
            ids = meta.get("eos_token_ids")
            # [] is recorded: the source's generation config names no EOS (a key left out is a checkpoint converted
            # before the list was recorded), so only a non-list or an id outside the vocabulary is refused
            if ids is not None and not (isinstance(ids, list) and all(
                    isinstance(i, int) and 0 <= i < tok.get_vocab_size(with_added_tokens=True) for i in ids)):
                raise ValueError(f"tokenizer meta eos_token_ids={ids!r} must be a list of token ids of this tokenizer "
                                 f"([]: the generation config names none)")
            return
        missing = [s for s in SPECIAL_TOKENS if tok.token_to_id(s) is None]
        if missing:
            raise ValueError(f"tokenizer lacks the special tokens {missing}; train it with snlp.io.tokenizer.Tokenizer.train")

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 4096) -> "Tokenizer":
        """Train a byte-level BPE with `vocab_size` entries (specials and the 256 bytes included)."""
        if vocab_size < MIN_VOCAB:
            raise ValueError(f"vocab_size must be >= {MIN_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} specials), got {vocab_size}")
        if vocab_size > 2 ** 32:
            raise ValueError(f"vocab_size {vocab_size} too large")
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        """The token ids of `text` (a str; anything else is a one-line ValueError, as `tokenizers` raised its own
        TypeError). Special-token strings in it are read as the markers (see encode_plain)."""
        return self.tok.encode(check_text(text, "encode"), add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """`text` as ordinary text: a special token's string in it (e.g. "<|assistant_end|>" quoted in a chat) is
        encoded as the bytes it is, never as the marker, as nanochat's tokenizer encodes chat content (tiktoken
        `encode_ordinary` in `render_conversation`). Equal to `encode` on text without such strings."""
        return self._plain.encode(check_text(text, "encode_plain"), add_special_tokens=False).ids

    @functools.cached_property
    def _plain(self) -> HFTokenizer:
        """A copy of the tokenizer that reads special-token strings as text (`encode_plain`); a copy, so the flag
        never changes how `encode` reads the same tokenizer."""
        plain = HFTokenizer.from_str(self.tok.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """Training / evaluation documents' ids (no separator). Our BPE reads a special token's string in a document
        ("<|bos|>" quoted in a file) as text, as nanochat's pretraining loader does (tiktoken `encode_ordinary`): a
        document never forges the separator or a chat marker. A converted tokenizer reads them as transformers'
        tokenizer(text) does (its special tokens parsed), so its streams are the ones that model was scored on."""
        tok = self.tok if self.foreign else self._plain
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    @property
    def documents_key(self) -> str:
        """The token cache's key of this tokenizer and of how `encode_documents` reads documents: our BPE's caches
        written before documents were read as plain text (special-token strings parsed) are never served again."""
        return self.fingerprint() if self.foreign else f"{self.fingerprint()}-plain"

    def decode(self, ids, mark_missing: bool = False) -> str:
        """The text of token ids (ints, numpy or 0-d tensor integers; a 1-D tensor or array). One id alone (an int,
        a numpy integer, a 0-d tensor or array) is its text, as transformers' tokenizer.decode takes it; a 2-D
        batch is refused in one line (decode each row). An id the tokenizer has no token for (a model
        whose vocabulary is padded past its tokenizer's sampled one of the padding rows) is refused in one line naming
        it, as `tokenizers` would drop it from the text silently; with `mark_missing` it is shown as
        `<|no token N|>` instead, so generated text is printed and saved whole, every id accounted for."""
        ndim = getattr(ids, "ndim", None)
        if ndim is not None and ndim > 1:
            raise ValueError(f"decode takes one sequence of token ids, got a {ndim}-D {type(ids).__name__} of shape "
                             f"{tuple(ids.shape)}: decode each row")
        if ndim == 0 or isinstance(ids, int):
            ids = [ids]  # one id (a bool is refused below, as in a list)
        elif not hasattr(ids, "__iter__") or isinstance(ids, (str, bytes)):
            raise ValueError(f"decode takes token ids (a list of ints, a 1-D tensor or array, or one id), got "
                             f"{type(ids).__name__} {ids!r:.40}")
        out, marks = [], []  # the ids with a token; (how many of them come first, id) for each id without one
        for i in ids:
            try:
                k = None if isinstance(i, (bool, float)) else operator.index(i)
            except TypeError:
                k = None
            if k is None:
                raise ValueError(f"token ids must be integers (got {i!r} of type {type(i).__name__})")
            if k < 0 or self.tok.id_to_token(k) is None:
                if not mark_missing:
                    raise ValueError(f"token id {k} is not in the tokenizer's vocabulary ({self.vocab_size} tokens): "
                                     f"it has no text (a model vocabulary padded past the tokenizer's?)")
                marks.append((len(out), k))
                continue
            out.append(k)
        text = self.tok.decode(out, skip_special_tokens=False)
        if not marks:
            return text
        # each mark goes where the text of the ids before it ends: decoding the pieces apart would lose what a
        # decoder does at a piece's start (SentencePiece strips the first token's leading space)
        pieces, start = [], 0
        for n, k in marks:
            end = len(self.tok.decode(out[:n], skip_special_tokens=False)) if n else 0
            end = max(end, start)
            pieces += [text[start:end], f"<|no token {k}|>"]
            start = end
        return "".join(pieces) + text[start:]

    @classmethod
    def from_hf(cls, hf_tokenizer) -> "Tokenizer":
        """Wrap a transformers fast tokenizer (its BOS/EOS tokens and chat template are kept)."""
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(hf_tokenizer).__name__} is not a fast (tokenizers-backed) tokenizer; "
                             f"load it with AutoTokenizer.from_pretrained(..., use_fast=True)")
        template = getattr(hf_tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates ({"default": ..., "tool_use": ...}): transformers'
            template = template.get("default")  # apply_chat_template without a name or tools renders "default"
        meta = {"bos_token": hf_tokenizer.bos_token, "eos_token": hf_tokenizer.eos_token,
                "chat_template": template if isinstance(template, str) else None}
        for key in ("pad_token", "unk_token"):  # an export writes them back: batched tokenizer calls pad with pad_token
            if isinstance(getattr(hf_tokenizer, key, None), str):
                meta[key] = getattr(hf_tokenizer, key)
        # the call settings an export writes back, where they are not transformers' defaults: a batch padded on the
        # left (what a decoder-only model's batched generate needs), truncation to the model's context
        limit = getattr(hf_tokenizer, "model_max_length", None)
        if isinstance(limit, int) and 0 < limit < NO_LIMIT:
            meta["model_max_length"] = limit
        for key in ("padding_side", "truncation_side"):
            if getattr(hf_tokenizer, key, None) == "left":
                meta[key] = "left"
        # transformers' decode drops these with skip_special_tokens and lists them in all_special_tokens; a WordPiece
        # / WordLevel tokenizer's decode removes the spaces before punctuation when clean_up_tokenization_spaces is set
        extra = [str(t) for t in (getattr(hf_tokenizer, "extra_special_tokens", None) or [])
                 if backend.token_to_id(str(t)) is not None]
        if extra:
            meta["extra_special_tokens"] = extra
        for key in ("clean_up_tokenization_spaces",  # and the flag that makes a BPE tokenizer's decode clean up too
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"):
            if getattr(hf_tokenizer, key, False) is True:
                meta[key] = True
        return cls(HFTokenizer.from_str(backend.to_str()), meta)

    @property
    def foreign(self) -> bool:
        """True for a converted model's tokenizer, False for our own BPE."""
        return self.meta is not None

    def prompt_ids(self, text: str) -> list[int]:
        """The ids a plain-text prompt is decoded from. Our BPE: <|bos|> then the text (every document of its training
        data starts so). A converted tokenizer: the text as transformers' `tokenizer(text)` encodes it for the
        original model, i.e. with the tokenizer's own special-token post-processing: Llama-3's adds
        <|begin_of_text|>, SmolLM2's and Qwen2's add nothing (prepending their bos_token, SmolLM2's chat marker
        <|im_start|> or Qwen2's <|endoftext|>, would decode another prompt than transformers' generate). An empty
        text is the BOS alone: transformers' generate() without input ids starts from bos_token_id too, the
        generation config's where the source had one (Qwen2.5's <|endoftext|>, its tokenizer naming no BOS)."""
        if not self.foreign:
            return [self.bos_id] + self.encode(text)
        start = (self.meta.get("generation_config") or {}).get("bos_token_id")
        return list(self.tok.encode(text, add_special_tokens=True).ids) or [self.bos_id if start is None else start]

    def token_id(self, token: str) -> int:
        i = self.tok.token_to_id(token)
        if i is None:
            raise ValueError(f"unknown special token {token!r}; known: "
                             f"{SPECIAL_TOKENS if self.meta is None else [self.meta['bos_token'], self.meta['eos_token']]}")
        return i

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
        """Chat template: token ids of a conversation and its assistant mask (1 = a token the model
        is trained to produce). The hook every tokenizer implements: ours uses the reserved specials,
        a wrapper of a Hugging Face tokenizer uses that model's own chat template.

            <|bos|> <|user_start|> user <|user_end|> <|assistant_start|> reply <|assistant_end|> ...

        The mask covers each reply and its <|assistant_end|> (so the model learns to stop), never the
        markers before it. A system message is prepended to the first user turn (nanochat). Message text is
        encoded as plain text (`encode_plain`): only the template puts markers in, as nanochat's
        render_conversation does, so a reply that quotes "<|assistant_end|>" neither ends its turn nor is
        trained as the stop. With
        `add_generation_prompt` an <|assistant_start|> is appended (the prompt for the reply)."""
        from snlp.io.chat import check_messages

        messages = check_messages(messages)
        if self.foreign:
            return self._render_foreign_chat(messages, add_generation_prompt)
        if messages[0]["role"] == "system":
            first = messages[1]  # check_messages guarantees a user turn follows
            messages = [{"role": "user", "content": messages[0]["content"] + "\n\n" + first["content"]}] + messages[2:]
        sp = {name: self.token_id(f"<|{name}|>") for name in ("user_start", "user_end", "assistant_start", "assistant_end")}
        ids, mask = [self.bos_id], [0]
        for m in messages:
            body = self.encode_plain(m["content"])
            if m["role"] == "user":
                part, pm = [sp["user_start"], *body, sp["user_end"]], [0] * (len(body) + 2)
            else:
                part, pm = [sp["assistant_start"], *body, sp["assistant_end"]], [0] + [1] * (len(body) + 1)
            ids += part
            mask += pm
        if add_generation_prompt:
            ids.append(sp["assistant_start"])
            mask.append(0)
        return ids, mask

    def _render_foreign_chat(self, messages: list[dict], add_generation_prompt: bool) -> tuple[list[int], list[int]]:
        """`render_chat` with a converted model's own chat template: the ids of the rendered conversation, and the
        assistant mask. A template that marks the replies with `{% generation %}` blocks gives transformers' own
        mask (`apply_chat_template(..., return_assistant_tokens_mask=True)`, what TRL's assistant-only loss trains
        on). Otherwise each assistant turn's tokens after the template's generation prompt for it, found by
        rendering the conversation up to every assistant turn, through its end-of-turn stop token (`stop_ids`):
        what the template writes after that token (ChatML's newline) is the template's, never generated (a reply
        ends at the stop), so it is not trained on. That stop is the first one the template writes after the reply
        (found by rendering the turn with two other replies): a stop id the reply's text quotes is the reply's."""
        def ids(upto: int, gen: bool, role: str | None = None, reply: str | None = None) -> list[int]:
            convo = messages[:upto] + ([{"role": role, "content": reply}] if reply is not None else [])
            text = self.apply_chat_template(convo, add_generation_prompt=gen)
            return self.tok.encode(text, add_special_tokens=False).ids

        def common_suffix(a: list[int], b: list[int], most: int) -> int:
            return next((k for k in range(min(len(a), len(b), most)) if a[-1 - k] != b[-1 - k]),
                        min(len(a), len(b), most))

        full = ids(len(messages), add_generation_prompt)
        if GENERATION_BLOCK.search(self.meta.get("chat_template") or ""):
            out = self._chat_renderer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                          return_assistant_tokens_mask=True,
                                                          add_generation_prompt=add_generation_prompt)
            if list(out["input_ids"]) != full:  # one tokenization of one text: a mismatch is a transformers change
                raise ValueError("transformers' apply_chat_template tokenizes this conversation unlike the "
                                 "tokenizer itself; the assistant mask cannot be placed")
            return full, [int(m) for m in out["assistant_masks"]]
        mask = [0] * len(full)
        stops = set(self.stop_ids)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head, turn = ids(i, True), ids(i + 1, False)
            start, stop = len(head), len(turn)
            if full[:stop] != turn or turn[:start] != head:
                raise ValueError("this chat template does not render a conversation as the concatenation of its "
                                 "turns (a later turn changes earlier tokens), so the assistant tokens cannot be "
                                 "masked; fine-tune with a template that appends turns")
            # the stop that ends the turn is the template's, in what it writes after the reply: a stop id the
            # reply's own text spells (a quoted "<|endoftext|>", parsed as the token like all rendered text) is
            # part of the reply, and ending there would leave the rest of the reply untrained
            tail = min(common_suffix(turn, ids(i, False, m["role"], sentinel), stop - start)
                       for sentinel in ("zqxjv", "QWKPF"))  # two: a reply ending like one sentinel is still cut right
            ends = [j for j in range(stop - tail, stop) if turn[j] in stops]
            stop = ends[0] + 1 if ends else stop
            mask[start:stop] = [1] * (stop - start)
        return full, mask

    @property
    def bos_id(self) -> int:
        """Our BPE's <|bos|>; a foreign tokenizer's BOS, or its EOS where it has none (documents are then
        separated by EOS, GPT-2 style)."""
        if self.meta is None:
            return self.token_id(BOS)
        t = self.meta.get("bos_token") or self.meta.get("eos_token")
        if t is None:
            raise ValueError("this tokenizer has neither a BOS nor an EOS token")
        return self.token_id(t)

    @property
    def eos_id(self) -> int | None:
        """A foreign tokenizer's EOS id (None for our BPE, which has no end-of-text token)."""
        t = (self.meta or {}).get("eos_token")
        return None if t is None else self.token_id(t)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids generation stops after, as transformers' generate stops: the model's generation config's
        eos_token_id list where `snlp convert` recorded one (Llama-3-Instruct and Qwen2.5 list several, not all of
        them the tokenizer's EOS; () where the config names none: generate() then decodes its whole budget), else
        (a checkpoint converted before the list was recorded, or a tokenizer alone) the tokenizer's EOS; () for our
        BPE (no end-of-text token)."""
        ids = (self.meta or {}).get("eos_token_ids")
        if ids is not None:
            return tuple(ids)
        return () if self.eos_id is None else (self.eos_id,)

    @property
    def chat_stop_ids(self) -> tuple[int, ...]:
        """The ids a chat reply stops after: `stop_ids` for a converted model; for our BPE (nanochat's chat format,
        no EOS) <|assistant_end|> and <|bos|>, where nanochat's engine ends a reply: without them a chat model's
        reply runs on into a made-up next turn."""
        if self.meta is not None:
            return self.stop_ids
        return self.token_id("<|assistant_end|>"), self.token_id(BOS)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The token ids that ask the model for the next assistant reply to `messages`: the converted model's own
        chat template (no extra BOS: the template has it), or our BPE's format (`render_chat`, what `snlp sft`
        trains on) ending in <|assistant_start|>."""
        if self.meta is None:
            return self.render_chat(messages, add_generation_prompt=True)[0]
        return list(self.encode(self.apply_chat_template(messages)))

    def with_stop_ids(self, ids) -> "Tokenizer":
        """This (foreign) tokenizer with `ids` as its stop ids: an int or a list of ints, [] for none (the
        generation config names no EOS: `stop_ids` is then empty), None for none recorded (`stop_ids` falls back to
        the tokenizer's EOS)."""
        if self.meta is None:
            raise ValueError("only a converted model's tokenizer records generation stop ids")
        ids = None if ids is None else [int(i) for i in ([ids] if isinstance(ids, int) else ids)]
        meta = {k: v for k, v in self.meta.items() if k != "eos_token_ids"}
        return Tokenizer(self.tok, meta if ids is None else {**meta, "eos_token_ids": list(dict.fromkeys(ids))})

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render chat messages [{"role", "content"}, ...] with the tokenizer's own chat template
        (jinja, rendered by transformers exactly as for the original model)."""
        template = (self.meta or {}).get("chat_template")
        if not template:
            raise ValueError("this tokenizer has no chat template (only converted instruct models carry one); "
                             "drop --chat")
        return self._chat_renderer.apply_chat_template(messages, tokenize=False,
                                                       add_generation_prompt=add_generation_prompt)

    @functools.cached_property
    def _chat_renderer(self):
        """transformers' tokenizer wrapper that renders the chat template, built once per Tokenizer (building
        it copies the whole vocabulary: ~0.2 s for a 49k vocabulary, per conversation turn before). It holds every
        special token the source's tokenizer had: transformers hands them all to the template (`pad_token`,
        `unk_token` too), and a template that writes one would render it empty."""
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=self.tok, chat_template=self.meta["chat_template"],
                                       **{k: self.meta.get(k) for k in ("bos_token", "eos_token", "pad_token",
                                                                        "unk_token")})

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def fingerprint(self) -> str:
        """Stable hash of the tokenizer (keys the token cache, the adaptation stream and the harness cache). A
        converted tokenizer's also hashes its document separator (`bos_id`, put before every document of a token
        cache), which lives in tokenizer_meta.json, not in tokenizer.json: a base model and its Instruct model can
        share one tokenizer.json whose tokenizer_config.json alone names another BOS / EOS (SmolLM2's base names
        <|endoftext|>, its Instruct <|im_start|>), and one cache file served to both scores the other's stream. Our
        BPE's is the hash of tokenizer.json alone, as it always was (its separator, <|bos|>, is in the file)."""
        import hashlib
        h = hashlib.sha256(self.tok.to_str().encode())
        if self.meta is not None:
            sep = self.meta.get("bos_token") or self.meta.get("eos_token")
            h.update(b"\0separator\0" + json.dumps(sep).encode())
        return h.hexdigest()[:16]

    def save(self, directory) -> Path:
        path = Path(directory) / FILENAME
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(path))
        if self.meta is not None:
            (path.parent / META_FILENAME).write_text(json.dumps(self.meta, indent=2))
        return path

    @classmethod
    def load(cls, directory) -> "Tokenizer":
        """Load tokenizer.json from a directory (or the file itself)."""
        path = Path(directory)
        if path.is_dir():
            path = path / FILENAME
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer at {path}; train one with `snlp train` (saved with every checkpoint)")
        meta = None
        if (path.parent / META_FILENAME).is_file():
            try:
                meta = json.loads((path.parent / META_FILENAME).read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"corrupt {path.parent / META_FILENAME} ({e}); re-convert the model") from e
        try:
            return cls(HFTokenizer.from_file(str(path)), meta)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            if isinstance(e, ValueError) and ("special tokens" in str(e) or "tokenizer meta" in str(e)):
                raise
            raise ValueError(f"corrupt tokenizer file {path} ({e}); delete it and re-train or re-save the checkpoint") from e

"""Byte-level BPE tokenizer (Hugging Face `tokenizers`), saved as tokenizer.json next to every
checkpoint. Special tokens are reserved up front so later chat/SFT data needs no re-training."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

FILENAME = "tokenizer.json"
BOS = "<|bos|>"
# reserved for chat / SFT (issue 5+): user and assistant turn markers
SPECIAL_TOKENS = [BOS, "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>"]
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte plus the specials


class Tokenizer:
    """Thin wrapper over a `tokenizers.Tokenizer`: encode/decode, bos_id, vocab_size, save/load."""

    def __init__(self, tok: HFTokenizer):
        self.tok = tok
        missing = [s for s in SPECIAL_TOKENS if tok.token_to_id(s) is None]
        if missing:
            raise ValueError(f"tokenizer lacks the special tokens {missing}; train it with snlp.tokenizer.Tokenizer.train")

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
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_id(self, token: str) -> int:
        i = self.tok.token_to_id(token)
        if i is None:
            raise ValueError(f"unknown special token {token!r}; known: {SPECIAL_TOKENS}")
        return i

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
        """Chat template: token ids of a conversation and its assistant mask (1 = a token the model
        is trained to produce). The hook every tokenizer implements: ours uses the reserved specials,
        a wrapper of a Hugging Face tokenizer uses that model's own chat template.

            <|bos|> <|user_start|> user <|user_end|> <|assistant_start|> reply <|assistant_end|> ...

        The mask covers each reply and its <|assistant_end|> (so the model learns to stop), never the
        markers before it. A system message is prepended to the first user turn (nanochat). With
        `add_generation_prompt` an <|assistant_start|> is appended (the prompt for the reply)."""
        from .chat import check_messages

        messages = check_messages(messages)
        if messages[0]["role"] == "system":
            first = messages[1]  # check_messages guarantees a user turn follows
            messages = [{"role": "user", "content": messages[0]["content"] + "\n\n" + first["content"]}] + messages[2:]
        sp = {name: self.token_id(f"<|{name}|>") for name in ("user_start", "user_end", "assistant_start", "assistant_end")}
        ids, mask = [self.bos_id], [0]
        for m in messages:
            body = self.encode(m["content"])
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

    @property
    def bos_id(self) -> int:
        return self.token_id(BOS)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def fingerprint(self) -> str:
        """Stable hash of the tokenizer (keys the token cache)."""
        import hashlib
        return hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:16]

    def save(self, directory) -> Path:
        path = Path(directory) / FILENAME
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(path))
        return path

    @classmethod
    def load(cls, directory) -> "Tokenizer":
        """Load tokenizer.json from a directory (or the file itself)."""
        path = Path(directory)
        if path.is_dir():
            path = path / FILENAME
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer at {path}; train one with `snlp train` (saved with every checkpoint)")
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            if isinstance(e, ValueError) and "special tokens" in str(e):
                raise
            raise ValueError(f"corrupt tokenizer file {path} ({e}); delete it and re-train or re-save the checkpoint") from e

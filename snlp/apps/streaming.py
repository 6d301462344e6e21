"""What `snlp generate` prints while it decodes, single-process and --distributed alike: the text streamed as it
grows, and the note where a decode reaches past the model's trained context."""

from __future__ import annotations

import sys


def streamer(tok, hide=(), head: str = ""):
    """on_tokens callback printing the text as it grows (decoding everything so far keeps merges right); token ids
    in `hide` (a chat's end-of-turn ids: the stop, which the summary line names) are not printed. `head` (the
    echoed prompt) is written with the first tokens, not before the decode starts: the decoders check their inputs
    against the loaded model (an --eos-id beyond its vocabulary, a surrogate its residual stream cannot take, ...)
    before the first token, and a refusal must be the error line alone, not glued to a prompt already on stdout.
    `on_tokens.flush_head()` writes it where no token was streamed."""
    tokens, printed, hide, pending = [], [""], set(hide), [head]

    def flush_head() -> None:
        if pending[0]:
            sys.stdout.write(pending[0])
            pending[0] = ""

    def on_tokens(new: list[int]) -> None:
        flush_head()
        tokens.extend(t for t in new if t not in hide)
        text = tok.decode(tokens, mark_missing=True)
        sys.stdout.write(text[len(printed[0]):])
        sys.stdout.flush()
        printed[0] = text
    on_tokens.flush_head = flush_head
    return on_tokens


def past_context(model, prompt_len: int, max_new: int) -> None:
    """A stderr line when decoding may run past the context the model was trained on (its sequence_len): positions
    beyond it are RoPE extrapolation, which decodes (snlp's cache has room) but is not the trained model's regime."""
    n = model.config.sequence_len
    if prompt_len + max_new > n:
        print(f"snlp generate: the prompt ({prompt_len} tokens) + --max-new-tokens {max_new} may reach past the "
              f"model's trained context ({n} tokens): positions past {n} are extrapolated", file=sys.stderr)

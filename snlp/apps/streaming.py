"""What `snlp generate` prints while it decodes, single-process and --distributed alike: the text streamed as it
grows, the note where a decode reaches past the model's trained context, and the generation kept when its timing is
interrupted."""

from __future__ import annotations

import sys
from contextlib import contextmanager


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


@contextmanager
def keep_on_interrupt(args, stats: str, record: dict):
    """Ctrl-C (or a signal raised as one) in speculative mode's timed comparison, which runs after the generation:
    the generation is done, so its summary line is printed and --json written (with "timing": "interrupted" and no
    timing fields) before the interrupt goes on; the command's interrupt line then says what was kept
    (interrupt_hint). Without this, minutes of decoding (a converted model's chat answer) were lost with the timing."""
    try:
        yield
    except KeyboardInterrupt:
        record["timing"] = "interrupted"
        print(f"{stats}; the timing against sequential decoding was interrupted (--no-baseline skips it)")
        if args.json:
            from snlp.runtime.device import write_json

            write_json(args.json, record)
        args.kept = "the generation and its statistics are printed above" + \
            (f" and written to {args.json} (\"timing\": \"interrupted\")" if args.json else "") + \
            "; only the timing was cut (--no-baseline skips it)"
        raise

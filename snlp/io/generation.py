"""What a converted model's generation defaults (its generation_config.json, kept by `snlp convert` in the
tokenizer's meta) would make transformers' generate() do that snlp's decoding does not: the logits processors it
turns on in greedy decoding too (a repetition penalty, banned n-grams, forced tokens, ...), the sampling-only filters,
and beam search. `snlp generate` names them in a note; the harness backend refuses them where lm-eval's hf model
would apply them (snlp.eval.harness)."""

from __future__ import annotations

# generation_config keys transformers' generate turns into logits processors that snlp has no flag for (it applies
# them in greedy decoding too, so the two greedy outputs part where one of them is set), and num_beams > 1, beam
# search, which parts them as well (snlp decodes one sequence)
UNMATCHED = ("repetition_penalty", "no_repeat_ngram_size", "encoder_repetition_penalty", "min_length",
             "min_new_tokens", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
             "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty", "min_p", "typical_p",
             "epsilon_cutoff", "eta_cutoff", "top_h", "guidance_scale", "watermarking_config", "num_beams")
# the values at which those change nothing (min_p 0 keeps every token, min_new_tokens 0 forces nothing,
# guidance_scale 1 is the conditional logits alone, num_beams 1 one sequence): set so, they are not named
NEUTRAL = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0,
           "min_new_tokens": 0, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
           "guidance_scale": 1.0, "num_beams": 1}
# the filters transformers applies only when it samples
SAMPLING_ONLY = ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")


def unapplied_defaults(defaults: dict, sampling: bool) -> dict:
    """The generation defaults (`Tokenizer.meta["generation_config"]`) that transformers' generate() applies and snlp
    does not, in a greedy run (`sampling` False: the sampling-only filters draw nothing there) or a sampled one."""
    return {k: v for k, v in (defaults or {}).items() if k in UNMATCHED and v not in (None, [], {}, NEUTRAL.get(k))
            and (sampling or k not in SAMPLING_ONLY)}

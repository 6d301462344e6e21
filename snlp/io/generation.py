"""What a converted model's generation defaults (its generation_config.json, kept by `snlp convert` in the
tokenizer's meta) would make transformers' generate() do: the repetition penalty, which snlp's decoders apply as
transformers does (`config_repetition_penalty`, snlp.decode.penalty), and what they do not apply: the other logits
processors it turns on in greedy decoding too (banned n-grams, forced tokens, ...), the sampling-only filters, and
beam search. `snlp generate` names those in a note; the harness backend refuses them where lm-eval's hf model would
apply them (snlp.eval.harness)."""

from __future__ import annotations

import math

# generation_config keys transformers' generate turns into logits processors that snlp has no flag for (it applies
# them in greedy decoding too, so the two greedy outputs part where one of them is set), and num_beams > 1, beam
# search, which parts them as well (snlp decodes one sequence). repetition_penalty is not among them: snlp applies it
UNMATCHED = ("no_repeat_ngram_size", "encoder_repetition_penalty", "min_length",
             "min_new_tokens", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
             "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty", "min_p", "typical_p",
             "epsilon_cutoff", "eta_cutoff", "top_h", "guidance_scale", "watermarking_config", "num_beams",
             # modes transformers 5's generate() moved to hub repos (DoLa, constrained beam search): set, it raises
             # unless called with trust_remote_code=True, and then decodes otherwise than greedy or sampling
             "dola_layers", "force_words_ids", "constraints")
# the values at which those change nothing (min_p 0 keeps every token, min_new_tokens 0 forces nothing,
# guidance_scale 1 is the conditional logits alone, num_beams 1 one sequence): set so, they are not named
NEUTRAL = {"encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0,
           "min_new_tokens": 0, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
           "guidance_scale": 1.0, "num_beams": 1}
# the filters transformers applies only when it samples
SAMPLING_ONLY = ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")


def unapplied_defaults(defaults: dict, sampling: bool) -> dict:
    """The generation defaults (`Tokenizer.meta["generation_config"]`) that transformers' generate() applies and snlp
    does not, in a greedy run (`sampling` False: the sampling-only filters draw nothing there) or a sampled one.
    penalty_alpha counts only where it turns greedy decoding into contrastive search (GenerationConfig.
    get_generation_mode: penalty_alpha > 0 with top_k > 1, the config's or transformers' default 50, not sampling);
    transformers 5 moved that mode to a hub repo too (generate() raises without trust_remote_code)."""
    defaults = defaults or {}
    extra = {k: v for k, v in defaults.items() if k in UNMATCHED and v not in (None, [], {}, NEUTRAL.get(k))
             and (sampling or k not in SAMPLING_ONLY)}
    alpha, top_k = defaults.get("penalty_alpha"), defaults.get("top_k")
    top_k = 50 if top_k is None else top_k
    if not sampling and contrastive(alpha, top_k):
        extra["penalty_alpha"] = alpha
    return extra


def contrastive(alpha, top_k) -> bool:
    """Whether transformers' generate() without sampling runs contrastive search under the penalty_alpha `alpha` and
    top_k `top_k` it ends up with (a call's kwargs merged over the generation config; None: unset): both set, alpha
    > 0 and top_k > 1 (GenerationConfig.get_generation_mode), else it decodes greedily and `alpha` changes nothing.
    A value that is no number (generate()'s comparison raises on it) counts as contrastive: never decoded greedily
    unasked."""
    def above(v, floor) -> bool:
        return v is not None and (not isinstance(v, (int, float)) or v > floor)

    return above(alpha, 0) and above(top_k, 1)


def config_repetition_penalty(defaults: dict, where: str = "its generation_config") -> float:
    """The repetition penalty transformers' generate() applies by default under these generation defaults
    (`Tokenizer.meta["generation_config"]`): its repetition_penalty, 1.0 (none) where it is unset or null. A value
    transformers refuses (not a number > 0, or an integer other than 1: `integer_penalty`) is a one-line ValueError
    naming `where`, as generate() raises there instead of decoding."""
    p = (defaults or {}).get("repetition_penalty")
    if p is None:
        return 1.0
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or p <= 0:
        raise ValueError(f"{where} sets repetition_penalty={p!r}, which is no penalty: transformers' generate() "
                         f"refuses it too (a finite number > 0)")
    if integer_penalty(p):
        raise ValueError(f"{where} sets repetition_penalty={p!r}, an integer, which transformers' generate() "
                         f"refuses too (its RepetitionPenaltyLogitsProcessor takes a float): write {p}.0")
    return float(p)


def integer_penalty(p) -> bool:
    """A repetition penalty transformers' generate() raises on although it is a number > 0: an integer other than 1
    (RepetitionPenaltyLogitsProcessor checks isinstance(penalty, float); at 1 generate builds no processor), as a
    generation_config.json or a task's YAML may write it (2 for 2.0)."""
    return isinstance(p, int) and not isinstance(p, bool) and p != 1


def model_repetition_penalty(tok, where: str = "its generation_config") -> float:
    """The repetition penalty transformers' generate() applies by default to the model `tok` (an snlp Tokenizer, or
    None) belongs to: a converted model's generation_config value (`config_repetition_penalty`), else 1.0 (none: an
    snlp-trained model has no generation config)."""
    if tok is None or not tok.foreign:
        return 1.0
    return config_repetition_penalty(tok.meta.get("generation_config") or {}, where)

"""A converted model's generation defaults (its generation_config.json) against `snlp generate`'s flags: the one
stderr line naming what transformers' generate() would apply that this run does not (`snlp generate` and its
--distributed path both print it)."""

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


def defaults_note(defaults: dict, temperature: float, top_k: int, top_p: float, greedy_only: bool = False
                  ) -> str | None:
    """A converted model's generation defaults (generation_config.json, kept by `snlp convert`) against this run's
    flags: where transformers' generate() would decode otherwise (called without arguments when this run is greedy,
    with do_sample=True when it samples, and this temperature unless the config sets one, which generate() then
    samples with), or None if nowhere. snlp applies only its flags, so a user comparing the two outputs is told which
    flags make them alike. `greedy_only`: a mode that refuses sampling (--mode jacobi), so no sampling flags are
    offered: the like-for-like call there is generate(do_sample=False)."""
    samples = defaults.get("do_sample") is True
    sampling_only = ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")
    extra = {k: v for k, v in defaults.items() if k in UNMATCHED and v not in (None, [], {}, NEUTRAL.get(k))
             and (samples or temperature > 0 or k not in sampling_only)}
    # transformers' sampling filters: top_k 50 and top_p 1 unless the model's config says otherwise
    def given(k, v):
        return v if defaults.get(k) is None else defaults[k]

    want = {"top_k": given("top_k", 50), "top_p": given("top_p", 1.0)}
    # a config's temperature is generate(do_sample=True)'s even where the config does not sample by default (a
    # temperature beside do_sample false or unset): it is named with the filters, not assumed to be this run's
    own_t = isinstance(defaults.get("temperature"), (int, float)) and defaults["temperature"] > 0
    if samples or own_t:
        want["temperature"] = given("temperature", 1.0)
    differ = temperature > 0 and any(want[k] != v and not (k == "top_k" and not want[k] and not v)
                                     for k, v in (("top_k", top_k), ("top_p", top_p), ("temperature", temperature))
                                     if k in want)
    parts = []
    if temperature == 0 and samples and greedy_only:
        parts.append(f"this model's generation_config samples (temperature {want['temperature']:g}, top_k "
                     f"{want['top_k']}, top_p {want['top_p']:g}): transformers' generate() draws by default, this mode "
                     f"decodes greedily only (compare with generate(do_sample=False))")
    elif temperature == 0 and samples:
        parts.append(f"this model's generation_config samples (temperature {want['temperature']:g}, top_k "
                     f"{want['top_k']}, top_p {want['top_p']:g}): transformers' generate() draws by default, this run "
                     f"decodes greedily (give --temperature {want['temperature']:g} --top-k {want['top_k']} --top-p "
                     f"{want['top_p']:g} to sample alike)")
    elif differ:
        ours = f"top_k {top_k or 'off'}, top_p {top_p:g}"
        theirs = ", ".join(f"{k} {want[k]:g}" for k in ("temperature", "top_k", "top_p") if k in want)
        flags = " ".join(f"--{k.replace('_', '-')} {want[k]:g}" for k in ("temperature", "top_k", "top_p")
                         if k in want)
        call = "do_sample=True" if "temperature" in want else f"do_sample=True, temperature={temperature:g}"
        parts.append(f"transformers' generate({call}) samples this model with {theirs} ("
                     f"{'its generation_config' if any(defaults.get(k) is not None for k in want) else 'transformers defaults'}"
                     f"), this run with temperature {temperature:g}, "
                     f"{ours} (give {flags} to sample alike)")
    if extra:
        parts.append(("it also sets " if parts else "this model's generation_config sets ")
                     + ", ".join(f"{k}={v}" for k, v in extra.items())
                     + ", which snlp does not apply (no flag): outputs differ from transformers' generate()")
    return "snlp generate: " + "; ".join(parts) if parts else None

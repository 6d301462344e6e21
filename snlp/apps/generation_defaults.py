"""A converted model's generation defaults (its generation_config.json) against `snlp generate`'s flags: the one
stderr line naming what transformers' generate() would apply that this run does not, and the repetition penalty the
run applies from it (`snlp generate` and its --distributed path both print it)."""

from __future__ import annotations

from snlp.io.generation import config_repetition_penalty, unapplied_defaults


def defaults_note(defaults: dict, temperature: float, top_k: int, top_p: float, greedy_only: bool = False,
                  repetition_penalty: float = 1.0, penalty_given: bool = False) -> str | None:
    """A converted model's generation defaults (generation_config.json, kept by `snlp convert`) against this run's
    flags: where transformers' generate() would decode otherwise (called without arguments when this run is greedy,
    with do_sample=True when it samples, and this temperature unless the config sets one, which generate() then
    samples with), or None if nowhere. snlp applies only its flags, so a user comparing the two outputs is told which
    flags make them alike. `greedy_only`: a mode that refuses sampling (--mode jacobi), so no sampling flags are
    offered: the like-for-like call there is generate(do_sample=False). `repetition_penalty`: the penalty this run
    applies (single-process and --distributed alike); `penalty_given`: it came from --repetition-penalty. A
    config's penalty the run applies is said (transformers' generate() applies it by default too), one it does not
    apply or replaces is named as a difference."""
    t = defaults.get("temperature")
    # a sampling config at temperature <= 0: generate() raises (its temperature warper takes only t > 0), so there is
    # no default draw to match and no --temperature to offer (0 is greedy decoding here); the call compared with is
    # then generate(do_sample=False) for a greedy run, generate(do_sample=True, temperature=T) for a sampled one
    refused = defaults.get("do_sample") is True and isinstance(t, (int, float)) and not isinstance(t, bool) and t <= 0
    samples = defaults.get("do_sample") is True and not refused
    extra = unapplied_defaults(defaults, sampling=samples or temperature > 0)
    # transformers' sampling filters: top_k 50 and top_p 1 unless the model's config says otherwise
    def given(k, v):
        return v if defaults.get(k) is None else defaults[k]

    want = {"top_k": given("top_k", 50), "top_p": given("top_p", 1.0)}
    # a config's temperature is generate(do_sample=True)'s even where the config does not sample by default (a
    # temperature beside do_sample false or unset): it is named with the filters, not assumed to be this run's
    own_t = isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0
    if samples or own_t:
        want["temperature"] = given("temperature", 1.0)
    differ = temperature > 0 and any(want[k] != v and not (k == "top_k" and not want[k] and not v)
                                     for k, v in (("top_k", top_k), ("top_p", top_p), ("temperature", temperature))
                                     if k in want)
    keys = [k for k in ("temperature", "top_k", "top_p") if k in want]

    def whence(sep: str) -> str:
        """Where each value of `want` comes from, where not all from the config: transformers' defaults fill the
        ones it leaves unset (top_k 50 was named as the config's)."""
        unset = [k for k in keys if defaults.get(k) is None]
        if not unset:
            return ""
        if len(unset) == len(keys):
            return f"{sep}transformers' defaults"
        return f"{sep}{', '.join(unset)} transformers' default{'s' if len(unset) > 1 else ''}"

    parts = []
    if refused:
        parts.append(f"this model's generation_config samples at temperature {t:g}, which transformers' generate() "
                     f"refuses (it raises unless the call gives do_sample=False or a temperature > 0)"
                     + (": compare this run with generate(do_sample=False)" if temperature == 0 else "" if differ
                        else f": compare this run with generate(do_sample=True, temperature={temperature:g})"))
    if temperature == 0 and samples and greedy_only:
        parts.append(f"this model's generation_config samples (temperature {want['temperature']:g}, top_k "
                     f"{want['top_k']}, top_p {want['top_p']:g}{whence('; ')}): transformers' generate() draws by "
                     f"default, this mode "
                     f"decodes greedily only (compare with generate(do_sample=False))")
    elif temperature == 0 and samples:
        parts.append(f"this model's generation_config samples (temperature {want['temperature']:g}, top_k "
                     f"{want['top_k']}, top_p {want['top_p']:g}{whence('; ')}): transformers' generate() draws by "
                     f"default, this run "
                     f"decodes greedily (give --temperature {want['temperature']:g} --top-k {want['top_k']} --top-p "
                     f"{want['top_p']:g} to sample alike)")
    elif differ:
        ours = f"top_k {top_k or 'off'}, top_p {top_p:g}"
        theirs = ", ".join(f"{k} {want[k]:g}" for k in keys)
        flags = " ".join(f"--{k.replace('_', '-')} {want[k]:g}" for k in keys)
        call = "do_sample=True" if "temperature" in want else f"do_sample=True, temperature={temperature:g}"
        src = "transformers' defaults" if all(defaults.get(k) is None for k in keys) else \
            "its generation_config" + whence("; ")
        parts.append(f"transformers' generate({call}) samples this model with {theirs} ({src}), this run with "
                     f"temperature {temperature:g}, {ours} (give {flags} to sample alike)")
    if extra:
        parts.append(("it also sets " if parts else "this model's generation_config sets ")
                     + ", ".join(f"{k}={v}" for k, v in extra.items())
                     + ", which snlp does not apply (no flag): outputs differ from transformers' generate()")
    try:
        own = config_repetition_penalty(defaults)
    except ValueError:  # a value generate() raises on, which only a run given --repetition-penalty gets past
        own = None
    if own == 1.0 and penalty_given and repetition_penalty != 1.0:  # the flag alone penalises: a difference too
        whose = "its" if parts else "this model's"
        parts.append(f"this run applies --repetition-penalty {repetition_penalty:g} where transformers' generate() "
                     f"applies none ({whose} generation_config sets no repetition_penalty other than 1): outputs "
                     f"differ")
    elif own != 1.0:
        whose = "its" if parts else "this model's generation_config's"
        if own is None:
            parts.append(f"transformers' generate() raises on {whose} repetition_penalty="
                         f"{defaults['repetition_penalty']!r} unless the call gives one; this run applies "
                         f"--repetition-penalty {repetition_penalty:g}")
        elif repetition_penalty == own and not penalty_given:
            parts.append(f"this run applies {whose} repetition_penalty={defaults['repetition_penalty']} as "
                         f"transformers' generate() does (--repetition-penalty 1 turns it off)")
        elif repetition_penalty != own:
            parts.append(f"this run applies --repetition-penalty {repetition_penalty:g} where transformers' generate() "
                         f"applies {whose} repetition_penalty={defaults['repetition_penalty']}: outputs differ")
    return "snlp generate: " + "; ".join(parts) if parts else None


def check_penalty_flag(p: float | None) -> None:
    """--repetition-penalty P: a finite number > 0 (snlp.decode.penalty), refused in the flag's words."""
    from snlp.decode.penalty import check_repetition_penalty

    if p is not None:
        try:
            check_repetition_penalty(p)
        except ValueError:
            raise ValueError(f"--repetition-penalty must be a finite number > 0, 1 = none (got {p!r})") from None


def resolve_penalty(args, tok) -> float:
    """The repetition penalty this run applies: --repetition-penalty, else a converted model's generation_config
    value (transformers' generate() applies it by default), else 1 (none)."""
    return penalty_and_source(args, tok)[0]


def penalty_and_source(args, tok) -> tuple[float, str]:
    """`resolve_penalty`'s value and where it came from, as the run's records name it: "flag"
    (--repetition-penalty), "generation_config" (a converted model's value) or "default" (1, none)."""
    from snlp.io.generation import model_repetition_penalty

    if args.repetition_penalty is not None:
        return float(args.repetition_penalty), "flag"
    p = model_repetition_penalty(tok, f"{args.ckpt}: its generation_config")
    cfg = (tok.meta.get("generation_config") or {}) if tok is not None and tok.foreign else {}
    return p, "default" if cfg.get("repetition_penalty") is None else "generation_config"


def sampling_record(args, penalty: float | None = None, source: str | None = None) -> dict:
    """How a `snlp generate` run picked its tokens, for its --json record (single-process and --distributed alike):
    without the seed and the filters a sampled record's tokens cannot be drawn again. `seed` is None for greedy
    decoding (it draws nothing); a --prompts-file row i drew with seed + i (its own result says so). The repetition
    penalty that ran (1: none) is here, and only here, with its source (penalty_and_source: flag, generation_config
    or default); `penalty` / `source` default to the args' resolved ones."""
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
            "repetition_penalty": args.repetition_penalty if penalty is None else penalty,
            "repetition_penalty_source": source or getattr(args, "repetition_penalty_source", None) or "default"}


# where a run's stop ids came from (its --json's "stop_ids_source"), as its summary line says it
STOP_SOURCES = {"flag": "--eos-id",
                "generation_config": "the model's generation config, where transformers' generate() stops",
                "tokenizer": "the tokenizer's EOS, where transformers' generate() of its export stops",
                "chat_format": "the chat format's end of turn and <|bos|>",
                "own_tokenizer": "snlp's own tokenizer has no end-of-text token",
                "no_eos": "the model names no EOS"}


def eos_flag(given) -> list[int] | None:
    """--eos-id as parsed (argparse's append: every occurrence's string, or None): None where it was not given (the
    model's own stop ids apply, `stop_ids_and_source`), [] for `none` (decode the whole --max-new-tokens budget),
    else the ids of `ID` or `ID,ID,...`. A second --eos-id, `none` beside an id, or an id that is no integer >= 0 is
    a one-line ValueError: the run cannot honour two answers to where it stops."""
    if given is None:
        return None
    if len(given) > 1:
        raise ValueError(f"--eos-id was given {len(given)} times ({', '.join(given)}): give it once (ID, ID,ID,... "
                         f"or none)")
    parts = [p.strip() for p in given[0].split(",")]
    if [p.lower() for p in parts] == ["none"]:
        return []
    if "none" in (p.lower() for p in parts):
        raise ValueError(f"--eos-id {given[0]} says both none and ids: give none (decode the whole budget) or the ids")
    ids = []
    for p in parts:
        try:
            ids.append(int(p))
        except ValueError:
            raise ValueError(f"--eos-id takes token ids (ID or ID,ID,...) or none, got {given[0]!r}") from None
        if ids[-1] < 0:
            raise ValueError(f"--eos-id must be a token id >= 0 (got {ids[-1]})")
    return list(dict.fromkeys(ids))


def stop_ids_and_source(eos: list[int] | None, tok, chat: bool) -> tuple[list[int], str]:
    """The ids a `snlp generate` run stops after and where they came from (a key of STOP_SOURCES): `eos` (`eos_flag`:
    the flag's ids, [] for none) where given; else a converted model's `Tokenizer.stop_ids` for a plain prompt and a
    chat alike (its generation config's eos_token_id list, which transformers' generate() stops after, [] where
    that config names none, else, for a checkpoint converted before the list was recorded, its tokenizer's EOS,
    which `snlp export` writes as that list); for snlp's own BPE a chat stops at its end of turn
    (`chat_stop_ids`) and a plain prompt nowhere: the BPE has no end-of-text token, and its <|bos|> separates
    training documents, plain text cut into ~4 KB pieces among them, so a base model's <|bos|> need not end its
    text (--eos-id with its id stops there). [] is no stop id: the whole --max-new-tokens budget."""
    if eos is not None:
        return list(eos), "flag"
    if tok.foreign:
        ids = list(tok.stop_ids)
        if "eos_token_ids" in tok.meta:  # recorded by `snlp convert`, [] where the source's config names no EOS
            return ids, "generation_config"
        return ids, "tokenizer" if ids else "no_eos"
    if chat:
        return list(tok.chat_stop_ids), "chat_format"
    return [], "own_tokenizer"


def stop_phrase(ids: list[int], source: str) -> str:
    """The summary line's words for a run's stop ids: `stop ids 2 (the model's generation config, ...)`."""
    if not ids:
        why = "--eos-id none" if source == "flag" else \
            "the model's generation config names no EOS, and transformers' generate() stops nowhere" \
            if source == "generation_config" else STOP_SOURCES[source]
        return f"stop ids none ({why}: the whole --max-new-tokens budget)"
    return f"stop ids {','.join(map(str, ids))} ({STOP_SOURCES[source]})"

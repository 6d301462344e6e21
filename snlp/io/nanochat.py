"""nanochat and nanochat-snlp checkpoints in: a directory of `model_NNNNNN.pt` + `meta_NNNNNN.json` (as their
`checkpoint_manager.save_checkpoint` writes them) becomes an snlp GPT with the logits of the nanochat version that
wrote it (fp32, CPU; tests/io/test_nanochat.py checks checkpoints written by the paper's code and by upstream
nanochat at the last commit of each version below), or a one-line ValueError before any model is built where the
files cannot say which version wrote them. `snlp.load(DIR, overrides=...)`, `load_nanochat(DIR, overrides=...)` and
`snlp convert DIR --out OUT --nanochat-override FIELD=VALUE` take such a directory.

nanochat's model code changed its function over time, and its constants live in the code, not in the files. The
versions of karpathy/nanochat's nanochat/gpt.py (VERSIONS; commit dates; T = sequence_len; the commit-by-commit
detail is docs/records/2026-11-27-nanochat-versions.md):

  key              commits, dates                        RoPE base, tables  q,k x  softcap  VE gate    "S" window
  base             3a5e0bc..2c4473d 2025-10-13..01-11    10000, bf16        1      15       -          - (full)
  lambdas          aa530cd..2ff7d51 2026-01-11           10000, bf16        1      15       -          - (full)
  windows          fbc1484..184d4c1 2026-01-11..01-16    10000, bf16        1      15       -          T // 2
  ve32             e85db6b..83dccc2 2026-01-16..03-02    10000, bf16        1      15       2 sig, 32  T // 2
  ve32-cap20-bf16  aba30cb..752abc8 2026-03-03..03-04    10000, bf16        1      20       2 sig, 32  T // 2
  ve32-cap20       1076f97          2026-03-04..03-09    10000, compute     1      20       2 sig, 32  T // 2
  ve12             6ed7d1d..f068604 2026-03-09..03-14    100000, compute    1.15   15       3 sig, 12  ceil(T/3/128)*128
  smear            a825e63..92d63d4 2026-03-14..07-03    100000, compute    1.2    15       3 sig, 12  ceil(T/4/128)*128
                   and nanochat-snlp 330ce33 (the paper's fork)

resid / x0 lambdas from `lambdas` on, window_pattern from `windows` on, value embeddings (alternating layers, the
last included) from `ve32` on, smear and backout in `smear`. Every version: QK-norm after RoPE, relu^2 MLP of width
4D, parameter-free RMSNorm, untied head; with windows, "L" layers and the last layer see T earlier tokens (FA3's
window_size=(T, 0)), without them the whole input (the two differ past T tokens only). Tables "bf16": the RoPE
cos / sin tables are rounded to bf16 in every dtype (GPTConfig.rope_bf16); "compute": kept in the compute dtype.
The vocabulary is padded to a multiple of 64 from f1bf69d (2025-12-09) on, which changes no logit.

What the files show, and so how a checkpoint is placed (`nanochat_versions`):
  - smear_gate / smear_lambda / backout_lambda, or a nanochat-snlp meta (use_mhc, no_ve, num_mtp_steps, ...): smear;
  - a value-embedding gate (n_kv_head, 12): ve12; (n_kv_head, 32) with window_pattern in the meta: ve32,
    ve32-cap20-bf16 or ve32-cap20, whose files are alike (refused); (n_kv_head, 32) without it: ve32 (mid_train and
    chat_sft wrote no window_pattern up to 2026-02-01, 8b4849d; nanochat's loader then runs "L");
  - no value embeddings, window_pattern in the meta: windows; resid_lambdas without it: lambdas or a midtrained
    windows checkpoint (mid_train wrote no window_pattern; nanochat's loader runs it with "L", windows of T; the two
    differ past T tokens) (refused); no resid_lambdas: base.
A refusal lists each candidate and what differs; `overrides={"version": KEY}` names the version outright, or the
GPTConfig values that differ do (softcap / rope_bf16, layer_windows). Refused in one line too: the value-residual
experiments of 2026-01-16 (e3f58b8..9a88194: value_embed_A / value_embed / v0_lambdas) and the bigram "engram" of
2026-01-25..28 (59e36cc..c8d93be: bigram_embed / bigram_lambdas), whose parts snlp's model does not carry, and
combinations no version wrote.

What maps to what (GPTConfig fields set here; snlp.model.gpt documents each part):
  - the padded vocabulary (wte, lm_head, value embeddings) is cut to vocab_size;
  - the version's constants above (rope_base, rope_bf16, qk_scale, softcap, ve_gate_scale; ve_gate_channels is
    read from the stored gate) and its windows as layer_windows (window_pattern tiled over the layers, the last
    always "L"; -1, full causal, for the versions without windows);
  - resid / x0 lambdas unless no_x0_resid, set to 1 / 0 where a checkpoint lacks them (as nanochat's loader patches
    them: the same function); the smear gate and the backout (smear, backout); mHC with mhc_num_streams static
    streams, softmax H_pre / H_post and a log-space Sinkhorn (hc_maps="softmax" with its iterations and
    temperature); multi-token-prediction heads (mtp_projs, training only) are dropped;
  - a nanochat-snlp checkpoint without smear / backout tensors loads with those parts off, as nanochat-snlp's loader
    patches them to zero (upstream's loader refuses such a checkpoint);
  - nanochat-snlp's scripts/chat_sft.py writes a model_config of the size fields and window_pattern only: value
    embeddings stored without gates are its no_ve model; resid / x0 lambdas at its init_weights values (never
    optimised: no_x0_resid keeps them out of the optimizer) are refused until overrides name x0_residual; mHC
    tensors are refused (the Sinkhorn settings are not in the files).
`overrides` (GPTConfig fields) change any of these after the version is placed; window_pattern and sequence_len
are nanochat's fields, from which the windows are recomputed (short_window, never read by them, is refused, as is a
field only a part the model lacks reads: the mHC settings without mHC, the value-embedding gate's without them, and
tie_embeddings, as nanochat stores wte and lm_head apart); an override that turns a part off (smear, backout,
value_embeds, x0_residual) loads without that part's tensors.
nanochat's tokenizer (a tiktoken pickle in its base directory) is not read: the model comes without one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from snlp.io.weights import check_cast, check_finite
from snlp.model.gpt import GPT, GPTConfig

# the names save_checkpoint writes and nanochat's loader opens, f"model_{step:06d}.pt": another spelling of a step
# (model_7.pt) is not one, as nanochat's loader would open model_000007.pt for it
STEP = r"(\d{6}|[1-9]\d{6,})"
MODEL_RE, META_RE = re.compile(rf"^model_{STEP}\.pt$"), re.compile(rf"^meta_{STEP}\.json$")
OTHER_STEP_RE = re.compile(r"^model_(\d+)\.pt$")  # a step spelt otherwise (model_7.pt) where MODEL_RE does not match
DROPPED = ("mtp_projs.",)  # training-only heads
SMEAR_KEYS = ("smear_gate.weight", "smear_lambda", "backout_lambda")
# model_config keys only nanochat-snlp's GPTConfig has (its meta is written from the whole dataclass)
FORK_KEYS = {"no_x0_resid", "no_ve", "use_mhc", "mhc_num_streams", "mhc_sinkhorn_iters", "mhc_sinkhorn_tau",
             "num_mtp_steps", "mtp_loss_weight"}
KNOWN_KEYS = {"sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "window_pattern"} | FORK_KEYS
GATE_RE = re.compile(r"transformer\.h\.\d+\.attn\.ve_gate\.weight$")
HC_RE = re.compile(r"transformer\.h\.\d+\.hc_(attn|mlp)\.")
# tensors of short-lived upstream experiments whose parts snlp's model does not carry
EXPERIMENTS = {("value_embed_A.", "value_embed_B.", "value_embed.", "v0_lambdas"):
               "the value-residual experiments of 2026-01-16 (e3f58b8..9a88194)",
               ("bigram_embed.", "bigram_lambdas"): "the bigram 'engram' of 2026-01-25..28 (59e36cc..c8d93be)"}


@dataclass(frozen=True)
class NanochatVersion:
    """The constants of one version of nanochat's forward that its checkpoint files do not store."""

    commits: str  # first..last commit of nanochat/gpt.py with this function, and their commit dates
    rope_base: float
    rope_bf16: bool  # RoPE tables rounded to bf16 in every dtype
    qk_scale: float
    softcap: float
    ve_gate_scale: float  # value-embedding gate = scale * sigmoid(.) (unused without value embeddings)
    short: str  # the "S" window of sequence_len T: "" (no windows: every layer full causal), "half", "third", "quarter"


VERSIONS = {
    "base": NanochatVersion("3a5e0bc..2c4473d, 2025-10-13..2026-01-11", 10000.0, True, 1.0, 15.0, 2.0, ""),
    "lambdas": NanochatVersion("aa530cd..2ff7d51, 2026-01-11", 10000.0, True, 1.0, 15.0, 2.0, ""),
    "windows": NanochatVersion("fbc1484..184d4c1, 2026-01-11..16", 10000.0, True, 1.0, 15.0, 2.0, "half"),
    "ve32": NanochatVersion("e85db6b..83dccc2, 2026-01-16..03-02", 10000.0, True, 1.0, 15.0, 2.0, "half"),
    "ve32-cap20-bf16": NanochatVersion("aba30cb..752abc8, 2026-03-03..04", 10000.0, True, 1.0, 20.0, 2.0, "half"),
    "ve32-cap20": NanochatVersion("1076f97, 2026-03-04..09", 10000.0, False, 1.0, 20.0, 2.0, "half"),
    "ve12": NanochatVersion("6ed7d1d..f068604, 2026-03-09..14", 100000.0, False, 1.15, 15.0, 3.0, "third"),
    "smear": NanochatVersion("a825e63..92d63d4, 2026-03-14..07-03, and nanochat-snlp", 100000.0, False, 1.2, 15.0,
                             3.0, "quarter"),
}
# GPTConfig fields the forward reads only with a part on (that part's switch): overrides of them without it are refused
UNREAD_WITHOUT = {"hc_dynamic": "hc_streams", "hc_maps": "hc_streams", "hc_sinkhorn_iters": "hc_streams",
                  "hc_sinkhorn_tau": "hc_streams", "ve_gate_scale": "value_embeds", "ve_gate_channels": "value_embeds"}
PART = {"hc_streams": "mHC", "value_embeds": "value embeddings"}
# the fields of GPTConfig a version sets (what an override must name to choose between versions)
VERSION_FIELDS = ("rope_base", "rope_bf16", "qk_scale", "softcap", "ve_gate_scale")


def steps(path) -> list[int]:
    """The steps with both model_NNNNNN.pt and meta_NNNNNN.json in directory `path` (ascending)."""
    path = Path(path)
    if not path.is_dir():
        return []
    names = [p.name for p in path.iterdir()]
    models = {int(m.group(1)) for n in names if (m := MODEL_RE.match(n))}
    metas = {int(m.group(1)) for n in names if (m := META_RE.match(n))}
    return sorted(models & metas)


def last_model_step(path) -> int | None:
    """The step of the newest model_NNNNNN.pt in directory `path` (nanochat's find_last_step), None without one."""
    path = Path(path)
    found = [int(m.group(1)) for p in path.iterdir() if (m := MODEL_RE.match(p.name))] if path.is_dir() else []
    return max(found, default=None)


def is_nanochat_dir(path) -> bool:
    """A nanochat checkpoint: a directory (or a model_NNNNNN.pt inside one) with a model/meta pair and no snlp or
    transformers config.json."""
    path = Path(path)
    if path.is_file() and MODEL_RE.match(path.name):
        path = path.parent
    return path.is_dir() and not (path / "config.json").exists() and bool(steps(path))


def why_not_nanochat(path) -> str | None:
    """Why `path`, which no loader takes, is no nanochat checkpoint although it looks like one, else None (the
    loaders that look for other formats would otherwise say it lacks a config.json, or is no directory): a
    meta_NNNNNN.json given for its checkpoint; model files named otherwise than save_checkpoint names them (model_7.pt:
    nanochat's loader opens model_000007.pt); model_NNNNNN.pt files without their meta_NNNNNN.json (a folder copied
    without them), or a folder of nanochat checkpoint folders (nanochat's base_checkpoints/, one folder per model tag,
    of which nanochat's own loader takes the deepest)."""
    path = Path(path)
    if path.is_file():
        if m := META_RE.match(path.name):
            return (f"{path} is a nanochat meta file: give its folder {path.parent} (its last step) or its model "
                    f"file {path.parent / f'model_{m.group(1)}.pt'} (this step)")
        return misnamed(path.parent, [path.name]) if paired_otherwise(path) else None
    if not path.is_dir() or steps(path) or (path / "config.json").exists():
        return None
    if odd := sorted(p.name for p in path.iterdir() if paired_otherwise(p)):
        return misnamed(path, odd)
    models = sorted(p.name for p in path.iterdir() if MODEL_RE.match(p.name))
    if models:
        return (f"{path} holds nanochat model files ({', '.join(models[:3])}{', ...' if len(models) > 3 else ''}) but "
                f"no meta_NNNNNN.json beside them: copy each step's meta file (nanochat's checkpoint_manager writes "
                f"it with the model) into {path}")
    tags = sorted(p.name for p in path.iterdir() if p.is_dir() and is_nanochat_dir(p))
    if tags:
        return (f"{path} is not a nanochat checkpoint but a folder of {len(tags)} ({', '.join(tags[:4])}"
                f"{', ...' if len(tags) > 4 else ''}): give one of them, e.g. {path / tags[0]}")
    return None


def paired_otherwise(p: Path) -> bool:
    """A model_<digits>.pt beside its meta_<digits>.json, both spelt otherwise than save_checkpoint's six digits."""
    return (bool(m := OTHER_STEP_RE.match(p.name)) and not MODEL_RE.match(p.name)
            and (p.parent / f"meta_{m.group(1)}.json").is_file())


def misnamed(folder: Path, names: list[str]) -> str:
    """The refusal of model files `names` in `folder` that save_checkpoint's spelling of a step does not name."""
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return (f"{folder} holds {shown}, which is not how nanochat's save_checkpoint names a step (model_NNNNNN.pt with "
            f"meta_NNNNNN.json, six digits at least, e.g. model_000007.pt) nor what its loader opens: rename each "
            f"model / meta pair so")


def nanochat_depth(path) -> int | None:
    """n_layer of the step `load_nanochat` loads by default (the last one, or the step a model_NNNNNN.pt names),
    read from its meta_NNNNNN.json alone; None if that file does not say (the load then says why)."""
    path = Path(path)
    if path.is_file() and (m := MODEL_RE.match(path.name)):
        path, step = path.parent, int(m.group(1))
    else:
        step = last_model_step(path)  # without its meta: None, as load_nanochat refuses it
    try:
        return int(json.loads((path / f"meta_{step:06d}.json").read_text())["model_config"]["n_layer"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def short_window(sequence_len: int, rule: str = "quarter") -> int:
    """nanochat's "S" window: half the context (2026-01-11..03-09), then a third and from 2026-03-14 a quarter of
    it rounded up to FA3's tile of 128."""
    if rule == "half":
        return sequence_len // 2
    return -(-sequence_len // {"third": 3, "quarter": 4}[rule] // 128) * 128  # nanochat's integer ceil


def nanochat_windows(pattern: str, n_layer: int, sequence_len: int, rule: str = "quarter") -> list[int]:
    """Each layer's left context as nanochat's _compute_window_sizes sets it: "L" -> sequence_len, "S" ->
    short_window(sequence_len, rule), the pattern tiled over the layers and the last layer "L"; rule "" (the
    versions before windows): every layer full causal (-1)."""
    if not rule:
        return [-1] * n_layer
    w = [short_window(sequence_len, rule) if pattern[i % len(pattern)] == "S" else sequence_len
         for i in range(n_layer)]
    return w[:-1] + [sequence_len]


def nanochat_versions(names, mc: dict, gate_width: int | None) -> list[str]:
    """The VERSIONS keys whose files look like these: state dict keys `names` (`_orig_mod.` stripped), meta
    model_config `mc`, the input width of the stored value-embedding gates (None: none stored). ValueError for
    tensors of an upstream experiment snlp does not load, and for combinations no version wrote."""
    names = set(names)
    for prefixes, what in EXPERIMENTS.items():
        hit = sorted(k for k in names if k.startswith(prefixes))
        if hit:
            raise ValueError(f"this nanochat checkpoint holds {hit[:3]}: it was written by {what}, whose model parts "
                             f"snlp does not carry")
    if FORK_KEYS & set(mc) or names & set(SMEAR_KEYS):
        return ["smear"]
    if gate_width is not None:
        if gate_width == 12:
            return ["ve12"]
        if gate_width == 32:  # every script wrote window_pattern into the meta from 2026-02-01 (8b4849d) on, so a
            # meta without it (mid_train, chat_sft of 2026-01-31..02-01) comes from before the softcap-20 versions
            return ["ve32", "ve32-cap20-bf16", "ve32-cap20"] if "window_pattern" in mc else ["ve32"]
        raise ValueError(f"this nanochat checkpoint's value-embedding gate reads {gate_width} channels; nanochat's "
                         f"read 32 (2026-01-16..03-09) or 12 (from 2026-03-09)")
    if any(k.startswith("value_embeds.") for k in names):
        raise ValueError("this nanochat checkpoint has value embeddings but no ve_gate: no nanochat version wrote that")
    lambdas = "resid_lambdas" in names
    if "window_pattern" in mc:
        if not lambdas:
            raise ValueError("this nanochat checkpoint has a window_pattern but no resid_lambdas: no nanochat version "
                             "wrote that (windows came after the lambdas, 2026-01-11)")
        return ["windows"]
    # scripts/mid_train.py wrote its model_config without window_pattern up to its removal (2026-01-31), so a
    # midtrained checkpoint of the windows version looks like the lambdas version's (nanochat loads it with "L")
    return ["lambdas", "windows"] if lambdas else ["base"]


def config_from_nanochat(mc: dict, ve_gate_channels: int = 12, smear: bool = True, backout: bool = True,
                         version: str = "smear") -> GPTConfig:
    """The GPTConfig of nanochat's model_config dict (meta_NNNNNN.json) under VERSIONS[version]'s constants, with
    nanochat's defaults for absent keys."""
    sizes = ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "sequence_len")
    kw = {**{"n_kv_head": mc.get("n_head")}, **{k: mc[k] for k in sizes if k in mc}}
    # an int as nanochat's GPTConfig holds it: int() of 4.7 or True built a model of another size, refused later
    # for tensors it lacked (or not at all)
    odd = [f"{k}={kw.get(k)!r}" for k in sizes if not isinstance(kw.get(k), int) or isinstance(kw.get(k), bool)]
    if odd:
        raise ValueError(f"nanochat model_config lacks or mangles a size field ({', '.join(odd)}; each must be an "
                         f"integer): {mc}")
    L = kw["n_layer"]
    unknown = sorted(set(mc) - KNOWN_KEYS)
    if unknown:
        raise ValueError(f"nanochat model_config has fields this loader does not know: {unknown}")
    mhc = bool(mc.get("use_mhc", False))
    if mhc and not mc.get("no_x0_resid", False):
        raise ValueError("this nanochat checkpoint combines mHC with the x0 residual (use_mhc without no_x0_resid), "
                         "which snlp's mHC model does not carry (nanochat-snlp's trainer turns x0 off with mHC)")
    pattern = str(mc.get("window_pattern", "L")).upper()  # nanochat's loader patches a missing pattern to "L"
    if not pattern or set(pattern) - {"S", "L"}:
        raise ValueError(f"nanochat window_pattern {pattern!r} must be a non-empty string of 'S' and 'L'")
    v = VERSIONS[version]
    value_embeds = not mc.get("no_ve", False) and version not in ("base", "lambdas", "windows")
    return GPTConfig(
        **kw, mlp_ratio=4, window_pattern=pattern, short_window=short_window(kw["sequence_len"], v.short or "half"),
        layer_windows=nanochat_windows(pattern, L, kw["sequence_len"], v.short),
        x0_residual=not mc.get("no_x0_resid", False), value_embeds=value_embeds, softcap=v.softcap,
        rope_base=v.rope_base, rope_bf16=v.rope_bf16, qk_norm="rope_norm", qk_scale=v.qk_scale,
        ve_gate_channels=ve_gate_channels, ve_gate_scale=v.ve_gate_scale, smear=smear, backout=backout,
        hc_streams=int(mc.get("mhc_num_streams", 4)) if mhc else 0, hc_dynamic=False,
        hc_maps="softmax" if mhc else "sigmoid", hc_sinkhorn_iters=int(mc.get("mhc_sinkhorn_iters", 10)) if mhc else 20,
        hc_sinkhorn_tau=float(mc.get("mhc_sinkhorn_tau", 0.05)) if mhc else 1.0)


def state_from_nanochat(sd: dict, cfg: GPTConfig) -> dict:
    """snlp state dict from nanochat's (keys `_orig_mod.`-stripped, padded vocab cut, value embeddings stacked,
    mHC logits concatenated as [H_res | H_pre | H_post], resid / x0 lambdas a checkpoint from before them lacks set
    to 1 / 0 as nanochat's loader patches them); ValueError for missing or unexpected tensors."""
    sd = {k.removeprefix("_orig_mod."): v for k, v in sd.items() if not k.removeprefix("_orig_mod.").startswith(DROPPED)}
    V, L = cfg.vocab_size, cfg.n_layer
    if cfg.x0_residual and "resid_lambdas" not in sd and "x0_lambdas" not in sd:
        dev = sd["transformer.wte.weight"].device if "transformer.wte.weight" in sd else "cpu"
        sd = {**sd, "resid_lambdas": torch.ones(L, device=dev), "x0_lambdas": torch.zeros(L, device=dev)}
    used: set[str] = set()

    def take(k: str) -> torch.Tensor:
        if k not in sd:
            raise ValueError(f"nanochat checkpoint lacks {k}")
        used.add(k)
        return sd[k]

    padded = -(-V // 64) * 64  # nanochat pads the vocabulary to a multiple of 64 from f1bf69d (2025-12-09) on
    for k in ("transformer.wte.weight", "lm_head.weight"):
        rows = sd[k].shape[0] if k in sd and sd[k].ndim == 2 else None
        if rows is not None and rows not in (V, padded):
            # cutting the rows to V would load another function (the softmax over fewer tokens) without a word
            raise ValueError(f"nanochat checkpoint's {k} has {rows} rows, which vocab_size {V} does not explain "
                             f"(nanochat stores vocab_size rows, or {padded}: vocab_size padded to a multiple of "
                             f"64): its meta's model_config is not this model's")
    out = {"wte.weight": take("transformer.wte.weight")[:V], "lm_head.weight": take("lm_head.weight")[:V]}
    for i in range(L):
        p, q = f"transformer.h.{i}.", f"blocks.{i}."
        for name in ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            out[f"{q}{name}.weight"] = take(f"{p}{name}.weight")
        if cfg.has_ve(i):
            out[f"{q}attn.ve_gate.weight"] = take(f"{p}attn.ve_gate.weight")
        for hc in ("hc_attn", "hc_mlp") if cfg.hc_streams else ():
            out[f"{q}{hc}.bias"] = torch.cat([take(f"{p}{hc}.H_res_logits").flatten(), take(f"{p}{hc}.H_pre_logits"),
                                              take(f"{p}{hc}.H_post_logits")])
    ve = [take(f"value_embeds.{i}.weight")[:V] for i in range(L) if cfg.has_ve(i)]
    if ve:
        out["value_embeds"] = torch.stack(ve)
    names = [("resid_lambdas", cfg.x0_residual), ("x0_lambdas", cfg.x0_residual), ("smear_gate.weight", cfg.smear),
             ("smear_lambda", cfg.smear), ("backout_lambda", cfg.backout)]
    out.update({k: take(k) for k, on in names if on})
    # a checkpoint trained with an option off still stores its (unused) tensors, and an override that turns a part
    # off (x0_residual, value_embeds, smear, backout) leaves its tensors unread: they are not part of this model
    off = ("smear_gate.", "smear_lambda") * (not cfg.smear) + ("backout_lambda",) * (not cfg.backout)
    ignored = {k for k in sd if k.startswith(("value_embeds.", "resid_lambdas", "x0_lambdas", *off))
               or re.match(r"transformer\.h\.\d+\.attn\.ve_gate\.", k)}
    unexpected = sorted(set(sd) - used - ignored)
    if unexpected:
        raise ValueError(f"nanochat checkpoint has tensors this loader does not map: {unexpected[:6]}")
    return out


def check_overrides(overrides: dict | None) -> None:
    """A one-line ValueError for `overrides` no nanochat checkpoint can take, read before any file: names that are no
    GPTConfig field (nor "version"), a version that is no VERSIONS key, short_window, layer_windows beside
    window_pattern / sequence_len."""
    over = dict(overrides or {})
    want = over.pop("version", None)
    if want is not None and want not in VERSIONS:
        raise ValueError(f"overrides name version {want!r}, which is none of nanochat's: {list(VERSIONS)}")
    bad = sorted(set(over) - set(GPTConfig.__dataclass_fields__))
    if bad:
        raise ValueError(f"overrides name no GPTConfig field: {bad} (or 'version', one of {list(VERSIONS)})")
    # nanochat derives every layer's window from window_pattern and sequence_len (_compute_window_sizes): overrides
    # of those two are nanochat's fields, so the windows follow them; GPTConfig's short_window is not read where
    # layer_windows is set, so overriding it alone could not be honoured
    nano = sorted(k for k in ("window_pattern", "sequence_len") if k in over)
    if "short_window" in over:
        raise ValueError("overrides name short_window, which a nanochat checkpoint's windows do not read (nanochat's "
                         "'S' window follows from sequence_len): override window_pattern / sequence_len, or give "
                         "every layer's window as layer_windows")
    if nano and "layer_windows" in over:
        raise ValueError(f"overrides name layer_windows and {nano}, which nanochat turns into other windows: "
                         f"give one or the other")
    if over.get("tie_embeddings"):
        # GPT ties lm_head.weight to wte.weight: loading nanochat's two tables into one parameter would keep one of
        # them and drop the other without a word
        raise ValueError("overrides name tie_embeddings=True, but nanochat stores the embedding (transformer.wte) and "
                         "the head (lm_head) as two tables: a tied model would drop one of them")


def nanochat_config(sd: dict, mc: dict, overrides: dict | None = None, where="this nanochat checkpoint") -> GPTConfig:
    """The GPTConfig of a nanochat checkpoint: state dict `sd` (`_orig_mod.` stripped), meta model_config `mc`,
    placed in its version (nanochat_versions) and then `overrides` applied: GPTConfig fields, and "version" (a
    VERSIONS key) to name the version outright. Where several versions fit the files and their configs still
    differ, a one-line ValueError naming each with the overrides that choose it."""
    check_overrides(overrides)
    over = dict(overrides or {})
    want = over.pop("version", None)
    nano = {k: over.pop(k) for k in ("window_pattern", "sequence_len") if k in over}
    if "use_mhc" not in mc and any(HC_RE.match(k) for k in sd):
        raise ValueError(f"{where} holds mHC tensors but its meta's model_config lacks use_mhc and the Sinkhorn "
                         f"settings (nanochat-snlp's chat_sft writes only the size fields and window_pattern): copy "
                         f"use_mhc, mhc_num_streams, mhc_sinkhorn_iters, mhc_sinkhorn_tau, no_x0_resid and no_ve "
                         f"from the model_config of the base checkpoint it was fine-tuned from")
    gate = next((v for k, v in sd.items() if GATE_RE.match(k)), None)
    width = None if gate is None else int(gate.shape[1])
    found = nanochat_versions(sd, mc, width)
    if want is not None and want not in found:
        raise ValueError(f"overrides name version {want!r}, but {where}'s files fit {found} only")
    if "window_pattern" in nano and not any(VERSIONS[k].short for k in ([want] if want else found)):
        raise ValueError(f"overrides name window_pattern, but {where} was written by nanochat code without windows "
                         f"(version {want or found[0]}: every layer full causal)")
    mc = {**mc, **nano}
    if found == ["smear"] and "no_ve" not in mc and width is None and any(k.startswith("value_embeds.") for k in sd):
        # nanochat-snlp stores value_embeds whatever no_ve says but gates only with value embeddings on: stored
        # embeddings without a gate are its no_ve model (a meta without no_ve: its chat_sft's)
        mc["no_ve"] = True
    if (found == ["smear"] and "no_x0_resid" not in mc and "x0_residual" not in over
            and untrained_lambdas(sd)):
        raise ValueError(f"{where}'s resid / x0 lambdas hold nanochat-snlp's initial values and its meta lacks "
                         f"no_x0_resid (nanochat-snlp's chat_sft writes only the size fields and window_pattern): a "
                         f"model trained with no_x0_resid never updates them, so say which it is, as "
                         f"overrides={{'x0_residual': False}} (trained with no_x0_resid) or True, or `snlp convert DIR "
                         f"--out OUT --nanochat-override x0_residual=false`")
    # the versions the overrides name: outright, or by their own constants (all found where the values are others)
    fit = [want] if want else [k for k in found if all(getattr(VERSIONS[k], f) == v for f, v in over.items()
                                                       if f in VERSION_FIELDS)] or found

    def config(key: str) -> GPTConfig:
        # the smear is on with either of its tensors, so a file holding one of them is refused for the other (not
        # loaded with the smear off, as an override that turns it off loads: nanochat-snlp's loader would patch
        # a missing gate to zeros, a smear of smear_lambda / 2)
        cfg = config_from_nanochat(mc, ve_gate_channels=12 if width is None else width,
                                   smear=any(k in sd for k in SMEAR_KEYS[:2]), backout="backout_lambda" in sd,
                                   version=key)
        try:
            return GPTConfig(**{**cfg.to_dict(), **over}) if over else cfg
        except (TypeError, ValueError) as e:
            raise ValueError(f"overrides {overrides} do not make a valid model config: {e}") from e

    configs = [config(k) for k in fit]
    unread = sorted(k for k in over if k in UNREAD_WITHOUT and not getattr(configs[0], UNREAD_WITHOUT[k]))
    if unread:  # GPTConfig keeps them, the forward never reads them: the override would change nothing
        raise ValueError(f"overrides name {unread}, which {where}'s model does not read (it has no "
                         f"{' / '.join(sorted({PART[UNREAD_WITHOUT[k]] for k in unread}))})")
    if any(c != configs[0] for c in configs[1:]):
        choices = "; ".join(f"version={k} ({VERSIONS[k].commits}: {_differs(k, found)})" for k in found)
        raise ValueError(f"{where} was written by one of {len(found)} nanochat versions whose files are alike and "
                         f"whose logits differ; name yours, as overrides={{'version': KEY}} to snlp.load / "
                         f"load_nanochat or `snlp convert DIR --out OUT --nanochat-override version=KEY`, or by the "
                         f"constants that differ: {choices}")
    return configs[0]


def untrained_lambdas(sd: dict) -> bool:
    """Whether the stored resid / x0 lambdas equal nanochat-snlp's GPT.init_weights values (resid 1.15 - 0.10 i /
    (L - 1), x0 0.20 - 0.15 i / (L - 1), in their stored dtype): never updated, as with no_x0_resid, which keeps them
    out of the optimizer (GPT.setup_optimizer) and out of the forward."""
    r, x = sd.get("resid_lambdas"), sd.get("x0_lambdas")
    if r is None or x is None or r.ndim != 1 or r.shape != x.shape or not len(r):
        return False
    n_layer = len(r)
    d = max(n_layer - 1, 1)
    init = torch.tensor([[1.15 - 0.10 * i / d for i in range(n_layer)], [0.20 - 0.15 * i / d for i in range(n_layer)]],
                        device="cpu")  # compared with the stored tensors moved to the CPU
    return bool(torch.equal(r.cpu(), init[0].to(r.dtype)) and torch.equal(x.cpu(), init[1].to(x.dtype)))


def _differs(key: str, among: list[str]) -> str:
    """How version `key` differs from the others in `among`: its values of the VERSIONS fields that differ."""
    v = VERSIONS[key]
    parts = [f"{f}={json.dumps(getattr(v, f))}" for f in VERSION_FIELDS
             if len({getattr(VERSIONS[k], f) for k in among}) > 1]
    if len({VERSIONS[k].short for k in among}) > 1:
        parts.append({"": "no windows (full causal attention)", "half": "windows of sequence_len (its loader "
                      "patches a missing window_pattern to L)"}.get(v.short, f"{v.short} windows"))
    return ", ".join(parts)


def nanochat_step(path, step: int | None = None) -> tuple[Path, int]:
    """(directory, step) that `load_nanochat(path, step)` reads: `step`, the step a model_NNNNNN.pt path names, or
    the last one; a one-line ValueError (FileNotFoundError without any step) where that step is not complete."""
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise ValueError(f"step must be an int (the NNNNNN of model_NNNNNN.pt), got {step!r}")
    path = Path(path)
    if path.is_file() and (m := MODEL_RE.match(path.name)):
        if step is not None and step != int(m.group(1)):
            raise ValueError(f"{path} names step {int(m.group(1))}, and step {step} was asked for: give the directory "
                             f"with the step, or the file alone")
        path, step = path.parent, int(m.group(1))
    have = steps(path)
    if not have:
        raise FileNotFoundError(f"{path} holds no nanochat checkpoint (model_NNNNNN.pt + meta_NNNNNN.json)")
    if step is None:
        # nanochat's find_last_step takes the newest model_NNNNNN.pt; one without its meta (a save cut short) is not
        # replaced by an older step unasked
        last = last_model_step(path)
        if last not in have:
            raise ValueError(f"{path}'s last model file, model_{last:06d}.pt, has no meta_{last:06d}.json: name one "
                             f"of its complete steps {have} (the path of its model_NNNNNN.pt to snlp.load, step= "
                             f"to load_nanochat, --step to snlp convert)")
    step = have[-1] if step is None else step
    if step not in have:
        raise ValueError(f"{path} has no step {step}; it has steps {have}")
    return path, step


def unreadable_model_file(mf: Path, e: Exception) -> str:
    """Why torch.load(mf, weights_only=True) failed, in one line. nanochat's save_checkpoint writes a torch.save
    of a state dict of tensors, which always loads so: a file that pickles other objects (a whole module, numpy
    arrays; torch names the first such global) or a safetensors file was written by another code base, and is not
    called corrupt; anything else is."""
    msg = str(e)
    if "This file can still be loaded" in msg:  # a valid pickle of objects weights_only does not allow
        found = re.search(r"GLOBAL (\S+)", msg)
        return (f"{mf} pickles {'a ' + found.group(1) if found else 'objects other than tensors'}, not the state dict "
                f"of tensors nanochat's save_checkpoint writes: a file of another code base? (not unpickled: that "
                f"would run its code)")
    try:
        with open(mf, "rb") as f:
            head = f.read(9)
    except OSError:
        head = b""
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < (1 << 30):  # its JSON header
        return f"{mf} is a safetensors file, not the torch.save state dict nanochat's save_checkpoint writes"
    first = msg.strip().splitlines()[0] if msg.strip() else ""  # its unpickling errors run to many lines
    return f"corrupt or truncated {mf} ({type(e).__name__}: {first})"


def read_state(mf: Path, mmap: bool = False) -> dict[str, torch.Tensor]:
    """The state dict in nanochat model file `mf`, in the file's order, torch.compile's `_orig_mod.` prefix dropped;
    a one-line ValueError for a file that holds no state dict of named tensors. `mmap`: the tensors stay in the file
    (mapped, read only where touched), for a look at their dtypes without reading gigabytes."""
    try:
        try:
            sd = torch.load(mf, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError as e:
            if not (mmap and "mmap can only be used" in str(e)):
                raise
            sd = torch.load(mf, map_location="cpu", weights_only=True)  # torch.save's legacy format maps nothing
    except Exception as e:  # torch.load raises assorted types on truncated / foreign files
        raise ValueError(unreadable_model_file(mf, e)) from e
    if not isinstance(sd, dict):
        raise ValueError(f"{mf} does not hold a state dict")
    odd = sorted(str(k) for k, v in sd.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor))
    if odd:
        raise ValueError(f"{mf} does not hold a state dict of named tensors: {odd[:3]} are not")
    return {k.removeprefix("_orig_mod."): v for k, v in sd.items()}


def nanochat_stored_dtype(path, step: int | None = None) -> torch.dtype:
    """The dtype transformers' from_pretrained(dtype="auto") (lm-eval's hf model's dtype=auto) picks for the
    weights of nanochat checkpoint `path` at `step` (default: the last; a model_NNNNNN.pt path names its step): its
    config names no dtype (nanochat's meta has none), so the dtype of the file's first floating-point tensor in the
    order torch.save wrote them (transformers' modeling_utils.get_state_dict_dtype). A file of bf16 tensors gives
    bfloat16; the paper's code keeps only its embeddings in bf16 and saves resid_lambdas, fp32, first: float32."""
    path, step = nanochat_step(path, step)
    mf = path / f"model_{step:06d}.pt"
    sd = read_state(mf, mmap=True)
    for v in sd.values():
        if v.is_floating_point() and v.element_size() > 1:  # float8 / float4: transformers skips them too
            return v.dtype
    raise ValueError(f"{mf} holds no floating-point tensor: not a nanochat model's weights")


def load_nanochat(path, step: int | None = None, device="cpu", dtype: torch.dtype = torch.float32,
                  overrides: dict | None = None) -> GPT:
    """The snlp GPT (eval mode, `dtype`, on `device`) of nanochat checkpoint directory `path` at `step` (default:
    the last one; a model_NNNNNN.pt path names its step), with the function of the nanochat version that wrote it
    (the module docstring's table). bf16 checkpoints are upcast to fp32 by default, as nanochat's own CPU loader
    does. `overrides` ({"version": KEY} of VERSIONS, or GPTConfig fields such as {"softcap": 20.0}) choose
    between versions the files cannot tell apart, and GPTConfig fields otherwise replace the version's constants."""
    check_overrides(overrides)  # a typo is refused before a model file of gigabytes is read
    path, step = nanochat_step(path, step)
    mf, jf = path / f"model_{step:06d}.pt", path / f"meta_{step:06d}.json"
    try:
        meta = json.loads(jf.read_text())
        mc = meta["model_config"]
        if not isinstance(mc, dict):
            raise TypeError("model_config is not an object")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, OSError) as e:
        raise ValueError(f"corrupt {jf}: expected JSON with a model_config object ({e})") from e
    sd = read_state(mf)
    cfg = nanochat_config(sd, mc, overrides, mf)
    stored = state_from_nanochat(sd, cfg)
    check_finite(stored, mf)  # the file's own values: a NaN / inf there is the checkpoint's
    state = {k: v.to(dtype) for k, v in stored.items()}
    check_cast(stored, state, dtype, mf)  # finite in the file, infinite in `dtype` (float16 past 65504)
    with torch.device("meta"):
        ref = GPT(cfg).state_dict()
    bad = sorted(set(ref) ^ set(state)) + [f"{k}: {tuple(state[k].shape)} vs {tuple(ref[k].shape)}"
                                           for k in ref if k in state and state[k].shape != ref[k].shape]
    if bad:
        if overrides:  # the files agreed with each other before the overrides changed the model they describe
            raise ValueError(f"overrides {overrides} describe a model whose tensors {mf} does not hold: {bad[:6]}")
        raise ValueError(f"{mf} does not match its {jf.name}: {bad[:6]}")
    model = GPT(cfg).to(dtype)
    model.load_state_dict(state)
    return model.to(device).eval()

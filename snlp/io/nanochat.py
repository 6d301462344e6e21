"""nanochat and nanochat-snlp checkpoints in: a directory of `model_NNNNNN.pt` + `meta_NNNNNN.json` (as their
`checkpoint_manager.save_checkpoint` writes them) becomes an snlp GPT with the same logits (fp32, CPU;
tests/io/test_nanochat.py checks checkpoints written by the paper's own code). `snlp.load(DIR)` and
`snlp convert DIR --out OUT` take such a directory.

What maps to what (GPTConfig fields set here; snlp.model.gpt documents each part):
  - the padded vocabulary (wte, lm_head, value embeddings padded to a multiple of 64) is cut to vocab_size;
  - RoPE base 100000, QK-norm after RoPE then q, k x 1.2 (qk_scale), softcap 15, relu^2 MLP of width 4D;
  - value embeddings on alternating layers (the last included) with a gate of 3 sigmoid over the first 12
    channels (ve_gate_scale, ve_gate_channels; the channel count is read from the stored gate);
  - window_pattern tiled over the layers, the last always "L" (`layer_windows`, nanochat's FA3 window_size=(w, 0):
    a query sees itself and the w tokens before it): "S" layers see ceil(sequence_len / 4 / 128) * 128 earlier
    tokens, "L" layers sequence_len, so past sequence_len tokens the loaded model computes nanochat's function
    (not full causal attention; up to sequence_len tokens the two are the same);
  - resid / x0 lambdas unless no_x0_resid; the smear gate and the backout (smear, backout); mHC with
    mhc_num_streams static streams, softmax H_pre / H_post and a log-space Sinkhorn (hc_maps="softmax" with its
    iterations and temperature); multi-token-prediction heads (mtp_projs, training only) are dropped;
  - parameters an older checkpoint lacks get the values nanochat's loader patches in (smear, backout off).
nanochat's tokenizer (a tiktoken pickle in its base directory) is not read: the model comes without one.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from snlp.io.weights import check_finite
from snlp.model.gpt import GPT, GPTConfig

MODEL_RE, META_RE = re.compile(r"^model_(\d+)\.pt$"), re.compile(r"^meta_(\d+)\.json$")
ROPE_BASE, QK_SCALE, VE_GATE_SCALE, SOFTCAP = 100000.0, 1.2, 3.0, 15.0
DROPPED = ("mtp_projs.",)  # training-only heads


def steps(path) -> list[int]:
    """The steps with both model_NNNNNN.pt and meta_NNNNNN.json in directory `path` (ascending)."""
    path = Path(path)
    if not path.is_dir():
        return []
    names = [p.name for p in path.iterdir()]
    models = {int(m.group(1)) for n in names if (m := MODEL_RE.match(n))}
    metas = {int(m.group(1)) for n in names if (m := META_RE.match(n))}
    return sorted(models & metas)


def is_nanochat_dir(path) -> bool:
    """A nanochat checkpoint: a directory (or a model_NNNNNN.pt inside one) with a model/meta pair and no snlp or
    transformers config.json."""
    path = Path(path)
    if path.is_file() and MODEL_RE.match(path.name):
        path = path.parent
    return path.is_dir() and not (path / "config.json").exists() and bool(steps(path))


def short_window(sequence_len: int) -> int:
    """nanochat's "S" window: a quarter of the context, rounded up to FA3's tile of 128."""
    return math.ceil(sequence_len / 4 / 128) * 128


def nanochat_windows(pattern: str, n_layer: int, sequence_len: int) -> list[int]:
    """Each layer's left context as nanochat's _compute_window_sizes sets it: "L" -> sequence_len, "S" ->
    short_window(sequence_len), the pattern tiled over the layers and the last layer "L"."""
    w = [short_window(sequence_len) if pattern[i % len(pattern)] == "S" else sequence_len for i in range(n_layer)]
    return w[:-1] + [sequence_len]


def config_from_nanochat(mc: dict, ve_gate_channels: int = 12, smear: bool = True, backout: bool = True) -> GPTConfig:
    """The GPTConfig of nanochat's model_config dict (meta_NNNNNN.json), with its defaults for absent keys."""
    try:
        L, D = int(mc["n_layer"]), int(mc["n_embd"])
        kw = dict(vocab_size=int(mc["vocab_size"]), n_layer=L, n_head=int(mc["n_head"]),
                  n_kv_head=int(mc.get("n_kv_head", mc["n_head"])), n_embd=D, sequence_len=int(mc["sequence_len"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"nanochat model_config lacks or mangles a size field ({e}): {mc}") from e
    unknown = sorted(set(mc) - {"sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd",
                                "window_pattern", "no_x0_resid", "no_ve", "use_mhc", "mhc_num_streams",
                                "mhc_sinkhorn_iters", "mhc_sinkhorn_tau", "num_mtp_steps", "mtp_loss_weight"})
    if unknown:
        raise ValueError(f"nanochat model_config has fields this loader does not know: {unknown}")
    mhc = bool(mc.get("use_mhc", False))
    if mhc and not mc.get("no_x0_resid", False):
        raise ValueError("this nanochat checkpoint combines mHC with the x0 residual (use_mhc without no_x0_resid), "
                         "which snlp's mHC model does not carry (nanochat-snlp's trainer turns x0 off with mHC)")
    pattern = str(mc.get("window_pattern", "L")).upper()  # nanochat's loader patches a missing pattern to "L"
    if not pattern or set(pattern) - {"S", "L"}:
        raise ValueError(f"nanochat window_pattern {pattern!r} must be a non-empty string of 'S' and 'L'")
    return GPTConfig(
        **kw, mlp_ratio=4, window_pattern=pattern, short_window=short_window(kw["sequence_len"]),
        layer_windows=nanochat_windows(pattern, L, kw["sequence_len"]),
        x0_residual=not mc.get("no_x0_resid", False), value_embeds=not mc.get("no_ve", False), softcap=SOFTCAP,
        rope_base=ROPE_BASE, qk_norm="rope_norm", qk_scale=QK_SCALE, ve_gate_channels=ve_gate_channels,
        ve_gate_scale=VE_GATE_SCALE, smear=smear, backout=backout,
        hc_streams=int(mc.get("mhc_num_streams", 4)) if mhc else 0, hc_dynamic=False,
        hc_maps="softmax" if mhc else "sigmoid", hc_sinkhorn_iters=int(mc.get("mhc_sinkhorn_iters", 10)) if mhc else 20,
        hc_sinkhorn_tau=float(mc.get("mhc_sinkhorn_tau", 0.05)) if mhc else 1.0)


def state_from_nanochat(sd: dict, cfg: GPTConfig) -> dict:
    """snlp state dict from nanochat's (keys `_orig_mod.`-stripped, padded vocab cut, value embeddings stacked,
    mHC logits concatenated as [H_res | H_pre | H_post]); ValueError for missing or unexpected tensors."""
    sd = {k.removeprefix("_orig_mod."): v for k, v in sd.items() if not k.removeprefix("_orig_mod.").startswith(DROPPED)}
    V, L = cfg.vocab_size, cfg.n_layer
    used: set[str] = set()

    def take(k: str) -> torch.Tensor:
        if k not in sd:
            raise ValueError(f"nanochat checkpoint lacks {k}")
        used.add(k)
        return sd[k]

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
    # a checkpoint trained with an option off still stores its (unused) tensors: they are not part of this model
    ignored = {k for k in sd if k.startswith(("value_embeds.", "resid_lambdas", "x0_lambdas"))
               or re.match(r"transformer\.h\.\d+\.attn\.ve_gate\.", k)}
    unexpected = sorted(set(sd) - used - ignored)
    if unexpected:
        raise ValueError(f"nanochat checkpoint has tensors this loader does not map: {unexpected[:6]}")
    return out


def load_nanochat(path, step: int | None = None, device="cpu", dtype: torch.dtype = torch.float32,
                  overrides: dict | None = None) -> GPT:
    """The snlp GPT (eval mode, `dtype`, on `device`) of nanochat checkpoint directory `path` at `step` (default:
    the last one; a model_NNNNNN.pt path names its step). bf16 checkpoints are upcast to fp32 by default, as
    nanochat's own CPU loader does. The code constants above (RoPE base, q/k scale, gate scale) are those of
    nanochat-snlp at 330ce33 and are not recorded in the files: a checkpoint of another nanochat version that
    changed them loads with `overrides` (GPTConfig fields, e.g. {"rope_base": 10000.0, "qk_scale": 1.0})."""
    path = Path(path)
    if path.is_file() and (m := MODEL_RE.match(path.name)):
        path, step = path.parent, int(m.group(1)) if step is None else step
    have = steps(path)
    if not have:
        raise FileNotFoundError(f"{path} holds no nanochat checkpoint (model_NNNNNN.pt + meta_NNNNNN.json)")
    step = have[-1] if step is None else step
    if step not in have:
        raise ValueError(f"{path} has no step {step}; it has steps {have}")
    mf, jf = path / f"model_{step:06d}.pt", path / f"meta_{step:06d}.json"
    try:
        meta = json.loads(jf.read_text())
        mc = meta["model_config"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"corrupt {jf}: expected JSON with a model_config object ({e})") from e
    try:
        sd = torch.load(mf, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises assorted types on truncated / foreign files
        raise ValueError(f"corrupt or truncated {mf} ({type(e).__name__}: {e})") from e
    if not isinstance(sd, dict):
        raise ValueError(f"{mf} does not hold a state dict")
    sd = {k.removeprefix("_orig_mod."): v for k, v in sd.items()}
    gate = next((v for k, v in sd.items() if re.match(r"transformer\.h\.\d+\.attn\.ve_gate\.weight$", k)), None)
    cfg = config_from_nanochat(mc, ve_gate_channels=12 if gate is None else int(gate.shape[1]),
                               smear="smear_gate.weight" in sd, backout="backout_lambda" in sd)
    if overrides:
        bad = sorted(set(overrides) - set(GPTConfig.__dataclass_fields__))
        if bad:
            raise ValueError(f"overrides name no GPTConfig field: {bad}")
        cfg = GPTConfig(**{**cfg.to_dict(), **overrides})
    state = {k: v.to(dtype) for k, v in state_from_nanochat(sd, cfg).items()}
    check_finite(state, mf)
    with torch.device("meta"):
        ref = GPT(cfg).state_dict()
    bad = sorted(set(ref) ^ set(state)) + [f"{k}: {tuple(state[k].shape)} vs {tuple(ref[k].shape)}"
                                           for k in ref if k in state and state[k].shape != ref[k].shape]
    if bad:
        raise ValueError(f"{mf} does not match its {jf.name}: {bad[:6]}")
    model = GPT(cfg).to(dtype)
    model.load_state_dict(state)
    return model.to(device).eval()

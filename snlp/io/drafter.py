"""A drafter directory (`snlp adapt --out DIR`): the adapted suffix weights of an SNLP drafter and what they
belong to, without any of the base model's weights.

    DIR/drafter.safetensors   the suffix blocks' weights only ("blocks.<l>.<name>", l = S..L-1)
    DIR/drafter.json          format, plan, the base's weights fingerprint and config, an exact digest per
                              tensor, a digest of every field that shapes the weights (plan, suffix_start, dtype,
                              LoRA rank/alpha, config, fingerprint, the tensor digests), and the adaptation record
                              (command, data, steps, minutes, tokens, metrics)

`load_drafter(DIR, base)` rebuilds the Drafter on the base's own prefix (snlp.method.drafter) and refuses a
different base (config or weights fingerprint: the precision-tolerant one of snlp.model.fingerprint, so a
base cast to fp16 / bf16 / fp64 keeps its drafter), a missing, truncated or edited weights file (per-tensor
EXACT digests of the stored bytes: any edit, even below bf16 resolution, is refused), an edited drafter.json
field that changes what the weights compute (e.g. LoRA alpha; its `meta_digest`) and missing or extra tensors, each with a clear ValueError. Writes are atomic: both files go to
temporary names first, then replace the old ones; the per-tensor digests catch a half-replaced pair.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from snlp.method.drafter import Drafter, make_drafter
from snlp.method.plan import Plan
from snlp.model.fingerprint import exact_digest, precision_note, same_weights
from snlp.model.gpt import GPT
from snlp.runtime.device import json_text, write_atomic
from snlp.runtime.outputs import make_folders
from snlp.io.checkpoint import DRAFTER_META as META
from snlp.io.source import did_you_mean, home_path
from snlp.io.weights import check_finite

FORMAT = "snlp-drafter"
VERSION = 3  # 2: exact per-tensor digests, precision-tolerant base fingerprint; 3: meta_digest
SIGNED = ("format", "version", "plan", "base_fingerprint", "config", "suffix_start", "dtype", "digests", "lora")
WEIGHTS = "drafter.safetensors"


def meta_digest(meta: dict) -> str:
    """A digest of the drafter.json fields that decide what the stored weights compute (SIGNED: the plan, the
    suffix start, the dtype, LoRA rank/alpha, config, base fingerprint and the per-tensor digests): an edit of
    any of them (alpha 2 -> 8 moves the logits, the tensors stay bit-identical) no longer matches."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps({k: meta.get(k) for k in SIGNED}, sort_keys=True).encode())
    return h.hexdigest()


def is_drafter_dir(path) -> bool:
    """True when `path` is a directory holding a drafter (drafter.json)."""
    return (Path(path) / META).is_file()


def save_drafter(path, drafter: Drafter, record: dict | None = None) -> Path:
    """Write `drafter` (its suffix weights, plan, base fingerprint and config) and the adaptation `record`
    (JSON-serialisable) to the directory `path`, atomically per file. Returns the path."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"drafter path {path} exists and is not a directory; choose another --out")
    make_folders(path)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in drafter.suffix_state().items()}
    meta = {"format": FORMAT, "version": VERSION, "plan": str(drafter.plan),
            "base_fingerprint": drafter.base_fingerprint, "config": drafter.model.config.to_dict(),
            "suffix_start": drafter.suffix_start, "dtype": str(next(iter(state.values())).dtype),
            "digests": {k: exact_digest(v) for k, v in state.items()}, "record": record or {}}
    if drafter.rank:  # LoRA deltas on the base's own suffix matrices (snlp.method.lowrank)
        meta["lora"] = {"rank": drafter.rank, "alpha": drafter.alpha}
    meta["meta_digest"] = meta_digest(meta)
    write_atomic(path / WEIGHTS, lambda p: save_file(state, str(p), metadata={"format": "pt", "snlp": FORMAT}))
    write_atomic(path / META, lambda p: p.write_text(json_text(meta, indent=2)))  # strict: the record's NaN is null
    return path


def read_meta(path) -> dict:
    """The drafter.json of a drafter directory, checked to be one (ValueError otherwise; where `path` does not exist
    the error names the closest names, as a checkpoint's typo gets: snlp.io.source)."""
    path = home_path(path)
    f = path / META
    if not path.exists():
        raise ValueError(f"drafter {path} does not exist{did_you_mean(str(path))}")
    if not f.is_file():
        raise ValueError(f"{path} is not a drafter directory (no {META}); make one with `snlp adapt`")
    try:
        meta = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f} is corrupt (not JSON: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{f} is not a {FORMAT} file")
    if meta.get("version") != VERSION:
        raise ValueError(f"{f} has drafter format version {meta.get('version')!r}; this snlp reads version {VERSION} "
                         f"(older drafters lack checks this snlp needs: adapt again)")
    missing = [k for k in ("plan", "base_fingerprint", "config", "digests", "meta_digest") if k not in meta]
    if missing:
        raise ValueError(f"{f} is corrupt: it lacks {', '.join(missing)}")
    if meta_digest(meta) != meta["meta_digest"]:
        raise ValueError(f"{f} was edited: its fields that decide what the weights compute ({', '.join(SIGNED[2:])}) "
                         f"do not match its meta_digest; the directory is corrupt (adapt again)")
    return meta


def load_drafter(path, base: GPT) -> Drafter:
    """The drafter in directory `path`, built on `base` (which must be the model it was adapted from: same
    config and weights fingerprint, else a ValueError saying so). Its suffix weights take the base's dtype
    and device."""
    path = home_path(path)
    meta = read_meta(path)
    if meta["config"] != base.config.to_dict():
        raise ValueError(f"drafter {path} was adapted for another model architecture "
                         f"({meta['config'].get('n_layer')} layers, width {meta['config'].get('n_embd')}) than this "
                         f"base ({base.config.n_layer} layers, width {base.config.n_embd})")
    lora = meta.get("lora") or {}
    if not isinstance(lora, dict) or not isinstance(lora.get("rank", 0), int):
        raise ValueError(f"{path / META} is corrupt: bad 'lora' entry {lora!r}")
    drafter = make_drafter(base, Plan.parse(meta["plan"]), rank=lora.get("rank", 0), alpha=lora.get("alpha"))
    if not same_weights(drafter.base_fingerprint, meta["base_fingerprint"]):
        note = precision_note(meta.get("dtype"), base.wte.weight.dtype)
        if note:  # the documented fp16-vs-bf16 exception (snlp.model.fingerprint), not another model
            raise ValueError(f"drafter {path}'s base weights fingerprint does not match this model's{note}")
        raise ValueError(f"drafter {path} was adapted from base weights {meta['base_fingerprint']}, but this model's "
                         f"weights fingerprint {drafter.base_fingerprint}: it belongs to another model (or the model "
                         f"changed since); adapt a drafter for this one with `snlp adapt`")
    try:
        state = load_file(str(path / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"drafter weights {path / WEIGHTS} are missing or corrupt: {e}") from None
    check_finite(state, path / WEIGHTS)
    want = set(drafter.suffix_state())
    if set(state) != want or set(meta["digests"]) != want:
        extra, lack = sorted(set(state) - want)[:3], sorted(want - set(state))[:3]
        raise ValueError(f"drafter weights {path / WEIGHTS} do not match plan {meta['plan']}'s suffix "
                         f"(unexpected {extra}, missing {lack}); the directory is corrupt")
    bad = [k for k, v in state.items() if exact_digest(v) != meta["digests"][k]]
    if bad:
        raise ValueError(f"drafter weights {path / WEIGHTS} do not match the digests in {META} ({len(bad)} tensors, "
                         f"e.g. {bad[0]}): the files are corrupt or from different saves")
    ref = base.wte.weight
    with torch.no_grad():
        own = drafter.model.state_dict()
        for k, v in state.items():
            own[k].copy_(v.to(device=ref.device, dtype=own[k].dtype))
    return drafter


def load_record(path) -> dict:
    """The adaptation record saved with a drafter (empty if none)."""
    return read_meta(path).get("record", {})


def export_drafter_hf(drafter: Drafter, out, tokenizer=None) -> Path:
    """Write the drafter as a transformers directory (snlp.io.hf.export_hf): the base's embedding, prefix layers,
    norm and head with the drafter's adapted suffix layers, a plain Llama-family model that transformers runs
    alone. transformers runs it SEQUENTIALLY, which is not the drafter's SNLP solve: the plan and the base's
    fingerprint are recorded in config.json ("snlp_drafter"), and `snlp convert HF_DIR` + the plan (or
    `make_drafter`) give back the drafter's SNLP forward exactly."""
    from snlp.io.hf import export_hf

    return export_hf(drafter.merged().model, out, tokenizer, config_extra={"snlp_drafter": {
        "plan": str(drafter.plan), "base_fingerprint": drafter.base_fingerprint, "suffix_start": drafter.suffix_start}})

"""Checkpoints: one directory holding

    model.safetensors   weights (safetensors, no pickle)
    config.json         GPTConfig.to_dict()
    tokenizer.json      the BPE tokenizer (optional)
    optimizer.pt        optimizer + LR-scheduler state (torch.save; optional, for --resume)
    train_state.pt      step, data position, RNG states, CLI args (torch.save; optional)
    preheat.pt          a preheat calibration (`snlp calibrate`; optional, read by `load_preheat`)

The directory is written to a temporary sibling and swapped in with os.replace, so a crash
mid-save never leaves a half-written checkpoint under the real name (a kill between the swap's two
renames leaves the previous checkpoint whole in a hidden sibling: `cut_off_save` finds it). Files in an existing
checkpoint directory that the save does not write (e.g. the training log) are carried over, except a
preheat calibration of other weights: it describes the old weights only, so it is dropped.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from snlp.method.preheat import FILENAME as PREHEAT_FILE
from snlp.method.preheat import Preheat
from snlp.model.fingerprint import same_weights, weights_fingerprint
from snlp.model.gpt import GPT, GPTConfig, check_gpt
from snlp.io.nanochat import is_nanochat_dir, load_nanochat, why_not_nanochat, nanochat_depth, nanochat_stored_dtype
from snlp.io.source import did_you_mean, home_path
from snlp.io.weights import check_cast, check_finite
from snlp.io.tokenizer import FILENAME as TOKENIZER_FILE
from snlp.io.tokenizer import META_FILENAME as TOKENIZER_META
from snlp.io.tokenizer import Tokenizer
from snlp.runtime.device import cli_device
from snlp.runtime.outputs import make_folders

WEIGHTS, CONFIG, OPTIMIZER, TRAIN_STATE = "model.safetensors", "config.json", "optimizer.pt", "train_state.pt"
DRAFTER_META = "drafter.json"  # what marks a drafter folder (snlp.io.drafter writes it, named here with the rest)
OWN_FILES = (WEIGHTS, CONFIG, TOKENIZER_FILE, TOKENIZER_META, OPTIMIZER, TRAIN_STATE)
TIED = "lm_head.weight"  # not stored when GPTConfig.tie_embeddings (it is wte.weight)


def unwrap(model: torch.nn.Module) -> GPT:
    """The bare GPT inside DDP / torch.compile wrappers."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or getattr(model, "_orig_mod")
    return model


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """A tensor safetensors can write: contiguous and alone in its storage (parameters shared with a drafter's
    stacked weights, snlp.method.sharing, are views of one bigger storage)."""
    t = t.contiguous()
    return t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t


def save_checkpoint(path, model: torch.nn.Module, tokenizer: Tokenizer | None = None, optimizer=None,
                    scheduler=None, train_state: dict | None = None) -> Path:
    """Write a checkpoint directory atomically; returns its path. Only `model` (an snlp GPT, or DDP / torch.compile
    around one) is required; `tokenizer` is an snlp Tokenizer (a transformers one converts: Tokenizer.from_hf). A
    failure while writing leaves nothing behind (the temporary folder is removed) and `path` as it was."""
    path = Path(path)
    model = unwrap(model)
    check_gpt(model)
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be an snlp Tokenizer (a transformers tokenizer converts with "
                        f"snlp.Tokenizer.from_hf), got {type(tokenizer).__name__}")
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:  # `load` refuses the pair
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                         f"{model.config.vocab_size}: its ids past the embedding have no row; save the model with its "
                         f"own tokenizer")
    make_folders(path.parent)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        state = {k: _own_storage(v.detach().cpu()) for k, v in model.state_dict().items()
                 if not (model.config.tie_embeddings and k == TIED)}
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt", "snlp": "1"})
        (tmp / CONFIG).write_text(json.dumps(model.config.to_dict(), indent=2))
        if tokenizer is not None:
            tokenizer.save(tmp)
        if optimizer is not None:
            torch.save({"optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict() if scheduler is not None else None}, tmp / OPTIMIZER)
        if train_state is not None:
            torch.save(train_state, tmp / TRAIN_STATE)
    except BaseException:  # a failed write (disk full, an unpicklable state, Ctrl-C) leaves no half folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists() and not path.is_dir():
        shutil.rmtree(tmp)
        raise ValueError(f"checkpoint path {path} exists and is not a directory; choose another --out")
    try:
        _swap_in(tmp, path, model)
    except BaseException:  # e.g. a second Ctrl-C in the middle: the new checkpoint is whole, so finish putting it in
        _swap_in(tmp, path, model)  # place (carried files and all) rather than leave it hidden beside a broken path
        raise
    return path


def _swap_in(tmp: Path, path: Path, model) -> None:
    """Put the complete checkpoint `tmp` in place of `path`: carry over the files of `path` this save does not own
    (training log, notes), move `path` aside, move `tmp` in, remove the old one. Each part checks what is left to
    do, so a second call finishes a first one that was interrupted."""
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    if tmp.is_dir() and path.is_dir():
        for f in path.iterdir():  # carry over files this save does not own (training log, notes)
            if f.name not in OWN_FILES and not (tmp / f.name).exists() and not _stale_preheat(f, model):
                os.replace(f, tmp / f.name)
        os.replace(path, old)
    if tmp.is_dir() and not path.exists():
        os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def stale_saves(path) -> list[Path]:
    """The hidden copies that saves of `path` cut off by SIGKILL or a crash left beside it: the new checkpoint being
    written (.NAME.tmp-PID, a full model copy) or, once `path` is back in place, the previous one (.NAME.old-PID);
    only those of processes no longer running. The caller holds the folder's lock, so no live run is saving them."""
    path = Path(path)
    found = []
    name = glob.escape(path.name)  # a name such as run[12] would match other runs' copies (.run1.old-PID)
    for p in sorted(path.parent.glob(f".{name}.tmp-*")) + sorted(path.parent.glob(f".{name}.old-*")):
        pid = p.name.rsplit("-", 1)[1]
        if not p.is_dir() or not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        if p.name.startswith(f".{path.name}.old-") and not path.is_dir():
            continue  # the last checkpoint itself (cut_off_save): never removed
        found.append(p)
    return found


def clear_stale_saves(path) -> list[tuple[Path, int]]:
    """Remove `stale_saves(path)`, after moving back into `path` any file of its own a copy holds that `path` lacks (a
    kill in the middle of a save's carry-over of the training log); returns each removed copy with its size in
    bytes."""
    path = Path(path)
    removed = []
    for p in stale_saves(path):
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        if path.is_dir() and p.name.startswith(f".{path.name}.tmp-"):  # (an old copy's files went to the new one)
            for f in p.iterdir():
                if f.name not in OWN_FILES + (PREHEAT_FILE,) and not (path / f.name).exists():
                    os.replace(f, path / f.name)
        shutil.rmtree(p, ignore_errors=True)
        removed.append((p, size))
    return removed


def _alive(pid: int) -> bool:
    if sys.platform == "win32":  # there os.kill(pid, 0) sends CTRL_C_EVENT to pid's group: no test, copies are kept
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def cut_off_save(path) -> Path | None:
    """The checkpoint that a save cut off between its two renames left hidden beside `path`, where `path` itself is
    gone: save_checkpoint moves the previous checkpoint to .NAME.old-PID, then the new one in; a kill in between
    leaves only the former (complete, the last one saved). None where there is none."""
    path = Path(path)
    if path.exists():
        return None
    old = sorted(p for p in path.parent.glob(f".{glob.escape(path.name)}.old-*") if (p / WEIGHTS).is_file())
    return old[-1] if old else None


def _stale_preheat(f: Path, model: GPT) -> bool:
    """A preheat.pt that was not fitted on `model`'s weights (or cannot be read): not to be carried over."""
    if f.name != PREHEAT_FILE:
        return False
    try:
        # same_weights, as load_preheat's check: the same weights saved in another precision keep their calibration
        return not same_weights(Preheat.load(f).fingerprint, weights_fingerprint(model))
    except ValueError:
        return True


def load_preheat(path, model: GPT) -> Preheat | None:
    """The preheat calibration stored in checkpoint `path` (CKPT/preheat.pt), checked against `model` and moved
    to its device and dtype; None if the checkpoint has none. A calibration of other weights (the model was
    trained after `snlp calibrate`) or of another model is a ValueError, never silently used."""
    f = checkpoint_dir(path) / PREHEAT_FILE
    return Preheat.load(f).check(model) if f.is_file() else None


def checkpoint_dir(path) -> Path:
    """The checkpoint directory `path` names (a file inside it is accepted; `~` is the home), or a clear error."""
    path = home_path(path)
    if path.is_file() and path.name in OWN_FILES:  # accept a file inside the checkpoint too
        path = path.parent
    if not path.exists():
        hint = did_you_mean(str(path))  # '; did you mean X?' ends a sentence: the next one starts after it
        raise FileNotFoundError(f"checkpoint {path} does not exist{hint}" + (" Or train one" if hint else "; train one")
                                + f" with `snlp train --out {path}`")
    if not path.is_dir():
        if why := why_not_nanochat(path):  # a nanochat meta file, or a model file nanochat would not name so
            raise ValueError(why)
        gguf = ("; a .gguf file is converted first: `snlp convert FILE --out DIR` then load DIR, or "
                "snlp.from_hf(FILE)") if path.suffix.lower() == ".gguf" else ""
        raise ValueError(f"checkpoint {path} is not a directory (expected {WEIGHTS} + {CONFIG} inside){gguf}")
    return path


def not_a_checkpoint(path: Path) -> str:
    """Why folder `path` (no config.json) is not a checkpoint, saying what it is where that is plain: a drafter
    (snlp adapt), a folder of checkpoints (snlp speedrun's noreg/ and idn/), a checkpoint missing its config; the
    advice to re-train fits only the last."""
    if (path / DRAFTER_META).is_file():
        return (f"{path} is a drafter (snlp adapt), not a checkpoint: give its base checkpoint, with "
                f"`--drafter {path}` where the command takes one")
    inner = sorted(d for d in path.iterdir() if d.is_dir() and (d / CONFIG).is_file() and (d / WEIGHTS).is_file())
    if inner:
        names = ", ".join(str(d) for d in inner[:4]) + (", ..." if len(inner) > 4 else "")
        return f"{path} is not a checkpoint but a folder holding {len(inner)}: {names}; give one of them"
    if (path / WEIGHTS).is_file():
        return f"checkpoint {path} has no {CONFIG}; it is incomplete, re-save or re-train it"
    if why := why_not_nanochat(path):
        return why
    return (f"{path} is not a checkpoint (no {CONFIG} or {WEIGHTS}): give the folder that `snlp train --out` or "
            f"`snlp convert --out` wrote")


def holds_speedrun(path) -> bool:
    """A `snlp speedrun` output folder: it keeps its stage records in OUT/stages from its first stage on. A
    checkpoint written there would make the speedrun take the folder for a checkpoint and reuse none of them."""
    return (Path(path) / "stages").is_dir()


def names_transformers_model(config: dict) -> bool:
    """A config.json that transformers wrote: it names an architecture / model_type (an snlp config holds GPTConfig
    fields only)."""
    return bool({"architectures", "model_type"} & set(config))


def is_snlp_checkpoint(path) -> bool:
    """An snlp checkpoint directory: config.json holds GPTConfig fields next to model.safetensors (a transformers
    directory has the same two files, but its config names an architecture / model_type). A config.json that is
    not a JSON object tells neither: a ValueError saying so, rather than a guess that sends it to the wrong loader."""
    path = Path(path)
    cfg = path / CONFIG
    if not (path.is_dir() and cfg.is_file() and (path / WEIGHTS).is_file()):
        return False
    try:
        d = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt {cfg}: not valid JSON ({e}); restore it or re-save the checkpoint") from e
    if not isinstance(d, dict):
        raise ValueError(f"corrupt {cfg}: expected a JSON object, got {type(d).__name__}")
    return not names_transformers_model(d)


def load_config(path) -> GPTConfig:
    """The GPTConfig stored in a checkpoint's config.json."""
    f = checkpoint_dir(path) / CONFIG
    if not f.is_file():
        raise FileNotFoundError(not_a_checkpoint(f.parent))
    try:
        d = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt {f}: not valid JSON ({e}); restore it or re-save the checkpoint") from e
    if not isinstance(d, dict):
        raise ValueError(f"corrupt {f}: expected a JSON object of GPTConfig fields")
    if names_transformers_model(d):
        arch = ", ".join(d.get("architectures") or []) or d.get("model_type")
        raise ValueError(f"{f.parent} is a transformers model directory ({arch}), not an snlp checkpoint: convert it "
                         f"first, `snlp convert {f.parent} --out DIR` (snlp eval --harness and snlp.from_hf take it "
                         f"as it is)")
    known = set(GPTConfig.__dataclass_fields__)
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{f} has unknown GPTConfig fields {unknown}; was it written by a newer snlp?")
    try:
        return GPTConfig(**d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"invalid model config in {f}: {e}") from e


def _config_json(path) -> dict | None:
    """The JSON object in the config.json of `path` (a folder, or a file inside one); None if there is none or it is
    unreadable (the load then says why)."""
    p = Path(path)
    try:
        d = json.loads(((p.parent if p.is_file() else p) / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def is_transformers_dir(path) -> bool:
    """A folder whose config.json names a transformers architecture / model_type (an export, a downloaded model):
    what `load` refuses with the command that converts it. False for anything else, unreadable configs included."""
    d = _config_json(path)
    return d is not None and names_transformers_model(d)


def checkpoint_depth(path) -> int | None:
    """The layer count of the model at `path`, read from its config alone, before any weight is: an snlp
    checkpoint's config.json, a nanochat checkpoint's meta_NNNNNN.json, a transformers directory's config.json
    (num_hidden_layers). None where no config tells it without the weights (a GGUF file, a hub id) or the path is
    no model (its load then says why), so commands can refuse a plan too deep for the model before loading it."""
    if is_nanochat_dir(Path(path)):
        return nanochat_depth(path)
    d = _config_json(path)
    if d is None:
        return None
    n = d.get("num_hidden_layers") if names_transformers_model(d) else d.get("n_layer")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def checkpoint_vocab(path) -> int | None:
    """The vocabulary size of the snlp checkpoint at `path`, read from its config.json alone, before any weight is
    (as checkpoint_depth); None for any other folder or file (the load then tells it), so commands can refuse a
    token id outside the model before loading it."""
    if not is_snlp_checkpoint(path):
        return None
    n = (_config_json(path) or {}).get("vocab_size")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def stored_dtype(path) -> torch.dtype:
    """The dtype an snlp checkpoint's weights were saved in (its embedding's), read from the file's header without
    loading them, or for a nanochat checkpoint the dtype transformers' dtype="auto" picks for its weights (its first
    floating tensor's: snlp.io.nanochat.nanochat_stored_dtype): `load` builds the model in float32 whatever it is."""
    from safetensors import safe_open

    if is_nanochat_dir(home_path(path)):
        return nanochat_stored_dtype(home_path(path))
    wf = checkpoint_dir(path) / WEIGHTS
    try:
        with safe_open(str(wf), "pt") as f:
            name = f.get_slice("wte.weight").get_dtype() if "wte.weight" in f.keys() else None  # F32, BF16, F16, F64
    except (SafetensorError, OSError, RuntimeError) as e:  # as `load` says it (a caller may read this first)
        raise ValueError(f"corrupt or truncated weights file {wf} ({e}); restore it or re-train") from e
    dtypes = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"weights in {wf} " + ("hold no wte.weight" if name is None else f"are in {name}") +
                         ": not an snlp checkpoint's (float64, float32, bfloat16 or float16 weights)")
    return dtypes[name]


def load(path, device="cpu", overrides: dict | None = None, need_tokenizer: str | None = None,
         dtype: torch.dtype | None = None) -> tuple[GPT, Tokenizer | None]:
    """Load a checkpoint directory -> (model in eval mode on `device`, in float32 whatever dtype its weights were
    saved in (`stored_dtype`), or in `dtype`: the weights then convert once from the stored dtype, so an fp64
    checkpoint loaded with dtype=torch.float64 keeps its own weights, which load's float32 followed by model.to
    would have rounded to float32; tokenizer or None): an snlp checkpoint, or a
    nanochat / nanochat-snlp one (model_NNNNNN.pt + meta_NNNNNN.json, its last step; snlp.io.nanochat: fp32, no
    tokenizer; `overrides`, GPTConfig fields, pick the nanochat version where its files do not). Raises
    FileNotFoundError for missing files and ValueError for corrupt or mismatched ones, and for a `device` this
    machine does not have (before any file is read). A leading `~` in `path` is the user's home (as snlp.io.source
    reads a model name), so `load("~/runs/x")` loads what the name check found. `need_tokenizer`: what the caller
    needs a tokenizer for; a checkpoint without one is then refused with it before its weights are read (a large
    model's load was spent on a run that could not start)."""
    cli_device(device, "device=")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype={dtype!r}: a floating torch dtype (e.g. torch.float64) or None (float32)")
    path = home_path(path)
    if is_nanochat_dir(path):
        if need_tokenizer:
            raise ValueError(f"nanochat checkpoint {path} has no {TOKENIZER_FILE} (nanochat's tokenizer is not "
                             f"converted): {need_tokenizer}")
        return load_nanochat(path, device=device, overrides=overrides, dtype=dtype or torch.float32), None
    if overrides:
        raise ValueError(f"overrides apply to nanochat checkpoints (model_NNNNNN.pt + meta_NNNNNN.json); {path} is "
                         f"not one, and an snlp checkpoint's config.json already holds every constant")
    path = checkpoint_dir(path)
    cfg = load_config(path)
    wf = path / WEIGHTS
    if not wf.is_file():
        raise FileNotFoundError(f"checkpoint {path} has no {WEIGHTS}; it is incomplete, re-save or re-train it")
    # after the config: a folder that is no snlp checkpoint (empty, a transformers model) is named as such, not as
    # one without a tokenizer; before the weights, which a run that cannot start need not read
    if need_tokenizer and not (path / TOKENIZER_FILE).is_file():
        raise ValueError(f"checkpoint {path} has no {TOKENIZER_FILE}: {need_tokenizer}")
    try:
        state = load_file(str(wf))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"corrupt or truncated weights file {wf} ({e}); restore it or re-train") from e
    with torch.device("meta"):
        ref = GPT(cfg).state_dict()  # expected names and shapes, no memory
    if cfg.tie_embeddings:
        ref.pop(TIED)
    missing, unexpected = sorted(set(ref) - set(state)), sorted(set(state) - set(ref))
    bad = [f"{k}: file {tuple(state[k].shape)} vs config {tuple(ref[k].shape)}"
           for k in ref if k in state and state[k].shape != ref[k].shape]
    if missing or unexpected or bad:
        raise ValueError(f"weights in {wf} do not match {path / CONFIG}: " + "; ".join(
            p for p in (f"missing {missing[:5]}" if missing else "", f"unexpected {unexpected[:5]}" if unexpected else "",
                        "shape mismatch " + ", ".join(bad[:5]) if bad else "") if p)
            + ". The files come from different models; re-save the checkpoint.")
    check_finite(state, wf)
    model = GPT(cfg)
    if dtype is not None and dtype != torch.float32:
        if dtype == torch.float16:  # a finite weight past float16's range is refused, as cast_model refuses it
            check_cast(state, {k: v.to(dtype) for k, v in state.items() if v.is_floating_point()}, dtype, wf)
        model.to(dtype)
    model.load_state_dict(state, strict=not cfg.tie_embeddings)
    model.to(device).eval()
    tok = None
    if (path / TOKENIZER_FILE).is_file():
        tok = Tokenizer.load(path)
        if tok.vocab_size > cfg.vocab_size:
            raise ValueError(f"{path / TOKENIZER_FILE} has {tok.vocab_size} tokens but the model's vocab_size is "
                             f"{cfg.vocab_size}; the tokenizer belongs to another model")
    return model, tok


def checkpoint_tokenizer(path) -> Tokenizer | None:
    """The tokenizer of the checkpoint at `path` without its weights (what `load` returns beside the model), or None
    where it has none (a nanochat checkpoint, an snlp one saved without)."""
    path = home_path(path)
    if is_nanochat_dir(path):
        return None
    path = checkpoint_dir(path)
    return Tokenizer.load(path) if (path / TOKENIZER_FILE).is_file() else None


def load_training(path) -> tuple[dict | None, dict | None]:
    """(optimizer.pt contents, train_state.pt contents) of a checkpoint, None where absent."""
    path = checkpoint_dir(path)
    return _load_pt(path / OPTIMIZER), _load_pt(path / TRAIN_STATE)


def load_train_state(path) -> dict | None:
    """train_state.pt of a checkpoint (step, data position, RNG, the run's settings), None where absent: what
    readers of a run's settings need, without the optimizer states (twice the model's size with Adam)."""
    return _load_pt(checkpoint_dir(path) / TRAIN_STATE)


def _load_pt(f: Path) -> dict | None:
    if not f.is_file():
        return None
    try:
        return torch.load(f, map_location="cpu", weights_only=False)
    except Exception as e:  # torch.load raises various types on truncation
        raise ValueError(f"corrupt or truncated {f} ({type(e).__name__}: {e}); resume from another "
                         f"checkpoint or start afresh without --resume") from e

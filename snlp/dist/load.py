"""Rank-local checkpoint loading for distributed SNLP (snlp.dist.layer_parallel): a rank builds the model on the
`meta` device (shapes only, no memory) and reads from the checkpoint's model.safetensors only the tensors
it computes with, one at a time (`safetensors.safe_open` maps the file and reads a tensor's bytes only
when asked), straight to its device. Loading the whole model on every rank and dropping layers after,
as `snlp.io.checkpoint.load` would, costs every rank the full model's memory at start-up, which is what
layer parallelism exists to avoid.

    ckpt = RankCheckpoint(path, device)
    runner = DistributedSNLP(ckpt.meta_model(), plan, checkpoint=ckpt, preheat=ckpt.preheat())

Dtypes follow `snlp.io.checkpoint.load`: every tensor is cast to the dtype GPT(config) gives the parameter.
The start-up consistency check cannot hash the whole model on a rank that never reads it; `digest`
hashes the config, the safetensors header (every tensor's name, dtype, shape and byte range, in a canonical key
order) and the bytes of the token embedding, which every rank reads anyway. So it catches another model or a
re-shaped or re-typed one, but not two files of the same layout whose layer weights differ (e.g. a stale copy of
a checkpoint re-trained in place): no rank reads another rank's layers to compare them."""

from __future__ import annotations

import hashlib
import json

import torch
from safetensors import safe_open
from torch import Tensor

from snlp.io.checkpoint import TIED, WEIGHTS, checkpoint_dir, load_config
from snlp.method.preheat import FILENAME as PREHEAT_FILE
from snlp.method.preheat import Preheat
from snlp.model.fingerprint import tensor_digest
from snlp.model.gpt import GPT


class RankCheckpoint:
    """Lazy access to one checkpoint directory's weights for one rank on `device`."""

    def __init__(self, path, device: str | torch.device = "cpu"):
        self.path = checkpoint_dir(path)
        self.config = load_config(self.path)
        self.device = torch.device(device)
        self.file = self.path / WEIGHTS
        if not self.file.is_file():
            raise FileNotFoundError(f"checkpoint {self.path} has no {WEIGHTS}; it is incomplete, re-save or re-train it")
        try:
            self._f = safe_open(str(self.file), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise ValueError(f"corrupt or truncated weights file {self.file} ({e}); restore it or re-train") from e
        self.keys = set(self._f.keys())
        self.digests: dict[str, str] = {}  # tensor_digest of every whole tensor read so far

    def meta_model(self) -> GPT:
        """GPT(config) on the meta device (no weights allocated), ready for `materialise`."""
        with torch.device("meta"):
            model = GPT(self.config)
        return model.eval()

    # ----- reading single tensors -----
    def _slice(self, name: str):
        """safetensors' lazy slice of `name`, or this checkpoint's one-line error if the file lacks it (get_slice's
        own is a bare SafetensorError naming neither the file nor the config)."""
        if name not in self.keys:
            raise ValueError(f"weights in {self.file} lack {name} (config {self.path / 'config.json'} expects it): the "
                             f"files come from different models; re-save the checkpoint")
        return self._f.get_slice(name)

    def _check(self, name: str, like: Tensor, shape) -> None:
        if tuple(shape) != tuple(like.shape):
            raise ValueError(f"weights in {self.file}: {name} has shape {tuple(shape)}, the config expects "
                             f"{tuple(like.shape)}; the files come from different models")

    def tensor(self, name: str, like: Tensor) -> Tensor:
        """The stored tensor `name`, checked against `like` (its meta parameter), on this rank's device in
        like's dtype."""
        sl = self._slice(name)
        self._check(name, like, sl.get_shape())
        t = self._f.get_tensor(name)
        self.digests[name] = tensor_digest(t)  # what this rank holds, for checking a calibration against it
        return t.to(device=self.device, dtype=like.dtype)

    def rows(self, name: str, rows: list[int], like: Tensor) -> Tensor:
        """like[rows] of the stored tensor `name` (e.g. some value-embedding tables), reading only those rows."""
        sl = self._slice(name)
        self._check(name, like, sl.get_shape())
        parts = [sl[r:r + 1] for r in rows]
        out = torch.cat(parts) if parts else torch.empty(0, *like.shape[1:])
        return out.to(device=self.device, dtype=like.dtype)

    def materialise(self, model: GPT, layers, head: bool) -> GPT:
        """Fill a meta `model` in place with what a rank computes with: the token embedding, the per-layer
        residual scalars and final norm, the blocks of `layers` and, with `head`, the LM head. Everything
        else (other blocks, the value-embedding tables: `DistributedSNLP` reads its own rows) stays on meta."""
        layers = set(layers)
        cfg = self.config
        for name, p in list(model.named_parameters()):
            parts = name.split(".")
            if parts[0] == "blocks" and int(parts[1]) not in layers:
                continue
            if parts[0] == "value_embeds" or (parts[0] == "lm_head" and not head):
                continue
            key = "wte.weight" if cfg.tie_embeddings and name == TIED else name
            mod = model.get_submodule(".".join(parts[:-1]))
            mod._parameters[parts[-1]] = torch.nn.Parameter(self.tensor(key, p), requires_grad=False)
        if cfg.tie_embeddings and head:
            model.lm_head.weight = model.wte.weight
        # the RoPE frequencies are a non-persistent buffer computed from the config: build them on CPU exactly
        # as GPT.__init__ does (on a tiny twin of the config) rather than re-deriving the formula here
        twin = GPT(_rope_twin(cfg))
        model.inv_freq = twin.inv_freq.to(device=self.device)  # fp32 in every dtype, as GPT._apply keeps it
        return model

    def digest(self) -> bytes:
        """SHA-256 of the config, the safetensors header and the token embedding's bytes (module docstring)."""
        h = hashlib.sha256(repr(sorted(self.config.to_dict().items())).encode())
        with open(self.file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        # the header's JSON in a canonical order: safetensors writes its maps (the metadata, the tensors) in no fixed
        # order, so two saves of the same weights can differ in bytes and would fail the check as "different weights"
        h.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
        t = self._f.get_tensor("wte.weight").contiguous()
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.digest()

    # ----- what travels with the weights -----
    def tokenizer(self):
        """The checkpoint's tokenizer or None (as `snlp.io.checkpoint.load`)."""
        from snlp.io.checkpoint import TOKENIZER_FILE
        from snlp.io.tokenizer import Tokenizer

        if not (self.path / TOKENIZER_FILE).is_file():
            return None
        tok = Tokenizer.load(self.path)
        if tok.vocab_size > self.config.vocab_size:
            raise ValueError(f"{self.path / TOKENIZER_FILE} has {tok.vocab_size} tokens but the model's vocab_size is "
                             f"{self.config.vocab_size}; the tokenizer belongs to another model")
        return tok

    def preheat(self):
        """CKPT/preheat.pt (snlp calibrate) or None. A rank never reads the whole model, so it cannot check the
        calibration's fingerprint here; `DistributedSNLP` checks the per-tensor digests of every tensor this rank
        read (`digests`) against the calibration's, so all ranks together check every weight."""
        f = self.path / PREHEAT_FILE
        return Preheat.load(f) if f.is_file() else None


def _rope_twin(cfg):
    """A tiny config (one layer, one head, width = head dim, vocab 1) with cfg's RoPE: same head dim, base,
    scaling and sign convention, so GPT(twin).inv_freq is cfg's in a few hundred bytes of weights."""
    import dataclasses

    return dataclasses.replace(cfg, n_layer=1, vocab_size=1, n_head=1, n_kv_head=1, n_embd=cfg.head_dim,
                               attn_head_dim=0, ffn_dim=0, mlp_ratio=1, hc_streams=0, x0_residual=None,
                               layer_windows=None, tie_embeddings=False, smear=False, backout=False)


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters that hold memory (meta parameters hold none)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)

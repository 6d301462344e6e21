"""Calibrate the preheat init: per-layer low-rank affine predictors of the states (paper App. "ELK Tempering and Preheat Initialization").

Offline calibration fits, for every layer l, a low-rank affine predictor of the layer's output from
the token's embedding x0 (per token):

    h_l(x0) ~ (x0 V) U_l^T + b_l        x0 (..., D0), V (D0, r), U_l (Dh, r), b_l (Dh,)

V holds the top-r right singular vectors of the (centred) calibration embeddings (a truncated SVD,
shared by all layers since every layer reads the same x0), U_l and b_l are the least-squares fit of
[x0 V, 1] to the sequential states h_l. D0 and Dh are the flattened trailing dims of x0 and h_l
(D for plain models, n*D for mHC stream states). At inference the plan init `preheat`
(`8xF1-preheat-K1`) starts chunk c at the predictor of its last layer instead of at h_S (h0) or
F_c(h_S) (fwd). The calibration tokens are random tokens or real data (`snlp calibrate --data`); the
paper calibrated on random tokens and found data calibration no better.

A calibration is an explicit value: `fit(model)` returns a `Preheat`, which is passed to `solve` /
`bind` / the generate and eval functions (`preheat=`); nothing is attached to the model. It records a
fingerprint of the weights it was fitted on (`snlp.model.fingerprint`) and `check(model)` refuses other
weights, so a calibration never outlives the weights it describes (a training step, a resumed run). It
follows the states it predicts: `predict` returns them on x0's device and in x0's dtype.

Storage: `preheat.pt` beside the checkpoint (`snlp calibrate CKPT`); `snlp.io.checkpoint.load_preheat(CKPT,
model)` reads it back and checks it against the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from snlp.model.fingerprint import (fingerprint_digests, precision_note, same_weights, weights_digests,
                                   weights_fingerprint)
from snlp.runtime.device import write_atomic

FILENAME = "preheat.pt"


@dataclass
class Preheat:
    """Per-layer low-rank affine predictors of the sequential states from the embedding."""

    V: Tensor  # (D0, r) shared embedding basis
    U: Tensor  # (L, Dh, r) per-layer maps
    b: Tensor  # (L, Dh) per-layer offsets
    source: str = "random"  # calibration tokens: "random" (uniform ids) or "data" (given validation tokens)
    fingerprint: str | None = None  # weights_fingerprint of the model it was fitted on (None: unknown)
    digests: dict[str, str] | None = None  # per-tensor digests of those weights (a rank checks its own tensors)

    @property
    def rank(self) -> int:
        return self.V.shape[1]

    def predict(self, x0: Tensor, layers: list[int]) -> Tensor:
        """Predicted outputs of `layers` (0-based layer indices) for embeddings x0 (B, T, *E):
        (len(layers), B, T, *E) in x0's dtype."""
        lead = x0.shape[:2]
        V, U, b = (t.to(device=x0.device, dtype=x0.dtype) for t in (self.V, self.U, self.b))  # no-ops once moved
        z = x0.reshape(*lead, -1) @ V  # (B, T, r)
        idx = torch.tensor(layers, device=x0.device)
        U, b = U.index_select(0, idx), b.index_select(0, idx)  # (C, Dh, r), (C, Dh)
        h = torch.einsum("btr,cdr->cbtd", z, U) + b[:, None, None, :]  # (C, B, T, Dh)
        return h.reshape(len(layers), *lead, *x0.shape[2:])

    def check(self, model, verify_weights: bool = True) -> "Preheat":
        """Refuse a calibration of another model: other layer count or width, or (with `verify_weights`)
        other weights than the fingerprint it recorded. Returns self, moved to the model's device/dtype."""
        n, D = model.config.n_layer, x0_width(model)
        if self.U.shape[0] != n:
            raise ValueError(f"preheat calibration has {self.U.shape[0]} layers, the model has {n}: it belongs to "
                             "another model; re-run `snlp calibrate`")
        if self.V.shape[0] != D:
            raise ValueError(f"preheat calibration reads embeddings of width {self.V.shape[0]}, the model's are {D}")
        if verify_weights:
            if self.fingerprint is None or len(self.fingerprint) != 64:
                raise ValueError("preheat calibration records no precision-tolerant weights fingerprint (written by an "
                                 "older snlp): "
                                 "re-run `snlp calibrate` so it can be checked against the model")
            if not same_weights(self.fingerprint, weights_fingerprint(model)):  # tolerant of casts (fingerprint.py)
                note = precision_note(self.V.dtype, model.wte.weight.dtype)  # V keeps the dtype it was fitted in
                if note:  # the documented fp16-vs-bf16 exception, not another model
                    raise ValueError(f"preheat calibration does not match this model's weights fingerprint{note}")
                raise ValueError("preheat calibration was fitted on other weights than this model's (the weights "
                                 "changed since `snlp calibrate`, e.g. training went on): re-run `snlp calibrate`")
        w = model.wte.weight
        return self.to(w.device, w.dtype)

    def check_tensors(self, read: dict[str, str]) -> None:
        """Refuse the calibration unless every tensor in `read` ({name: tensor_digest}, e.g. what one rank of a
        distributed run loaded) is the one it was fitted on: the per-rank form of `check`'s fingerprint test."""
        if self.digests is None:
            raise ValueError("preheat calibration records no per-tensor digests (written by an older snlp): re-run "
                             "`snlp calibrate` so it can be checked against the weights")
        bad = sorted(n for n, d in read.items() if not same_weights(self.digests.get(n), d))
        if bad:
            raise ValueError(f"preheat calibration was fitted on other weights than this checkpoint's ({', '.join(bad[:3])}"
                             f"{', ...' if len(bad) > 3 else ''} differ): re-run `snlp calibrate`")

    def to(self, device=None, dtype=None) -> "Preheat":
        mv = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
        return Preheat(V=mv(self.V), U=mv(self.U), b=mv(self.b), source=self.source, fingerprint=self.fingerprint,
                       digests=self.digests)

    def save(self, path) -> Path:
        """Write the calibration to `path` atomically: a save cut short (Ctrl-C, a full disk) leaves the calibration
        that was there (a checkpoint's preheat.pt) whole, not a truncated file that every preheat plan refuses."""
        path = Path(path)
        data = {"V": self.V.cpu(), "U": self.U.cpu(), "b": self.b.cpu(), "source": self.source,
                "fingerprint": self.fingerprint, "digests": self.digests}
        write_atomic(path, lambda tmp: torch.save(data, tmp))
        return path

    @classmethod
    def load(cls, path) -> "Preheat":
        try:
            d = torch.load(path, map_location="cpu", weights_only=True)
            return cls(V=d["V"], U=d["U"], b=d["b"], source=d.get("source", "random"),
                       fingerprint=d.get("fingerprint"), digests=d.get("digests"))
        except Exception as e:  # torch.load raises many types on truncated / foreign files
            raise ValueError(f"corrupt preheat calibration {path} ({type(e).__name__}: {e}); re-run `snlp calibrate`"
                             ) from e


@dataclass
class CalibrateConfig:
    """`fit` settings: rank r, calibration tokens (random ids unless `tokens` are given to `fit`)."""

    rank: int = 32
    batch: int = 8
    seq_len: int = 128
    seed: int = 0

    def check(self, model) -> None:
        for name in ("rank", "batch", "seq_len"):  # True is an int: it would fit rank 1 (or run one window) silently
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"preheat {name} must be an integer >= 1 (got {value!r})")
        check_tokens(self.batch * self.seq_len, min(self.rank, x0_width(model)),
                     f"batch x seq_len = {self.batch} x {self.seq_len}")


def x0_width(model) -> int:
    """D0, the flattened width of the embedding x0 the predictors read: D, or n*D for mHC stream states."""
    return model.config.n_embd * max(model.config.hc_streams, 1)


def check_tokens(n: int, r: int, what: str) -> None:
    """Refuse a fit of rank r on n <= r calibration tokens: the centred embeddings span at most n - 1 directions, so
    the basis V would hold fewer than r (or arbitrary) columns and [x0 V, 1] (r + 1 unknowns per output) would
    interpolate the n states rather than fit them."""
    if n <= r:
        raise ValueError(f"preheat calibration of rank {r} needs more than {r} tokens, got {n} ({what}): give more "
                         f"tokens or a lower rank")


def fit_states(x0: Tensor, states: list[Tensor], rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """Fit V (D0, r), U (L, Dh, r), b (L, Dh) from token embeddings x0 (N, D0) and per-layer
    sequential states (N, Dh) each, in fp64: V = top-r right singular vectors of the centred x0,
    [U_l^T; b_l] = least squares of [x0 V, 1] onto h_l."""
    X = x0.double()
    r = min(rank, X.shape[1])
    V = torch.linalg.svd(X - X.mean(0), full_matrices=False).Vh[:r].T  # (D0, r)
    Z = torch.cat([X @ V, torch.ones(X.shape[0], 1, dtype=X.dtype)], 1)  # (N, r + 1)
    H = torch.stack([h.double() for h in states], 0)  # (L, N, Dh)
    sol = torch.linalg.lstsq(Z.expand(H.shape[0], *Z.shape), H).solution  # (L, r + 1, Dh)
    return V, sol[:, :r].transpose(1, 2), sol[:, r]


@torch.no_grad()
def fit(model, cfg: CalibrateConfig = CalibrateConfig(), tokens: Tensor | None = None) -> Preheat:
    """Calibrate the preheat predictors of every layer of `model` on `tokens` (1-D validation ids,
    cut into cfg.batch windows of cfg.seq_len) or, if None, on uniformly random token ids."""
    cfg.check(model)
    device = next(model.parameters()).device
    if tokens is None:
        gen = torch.Generator().manual_seed(cfg.seed)
        idx = torch.randint(0, model.config.vocab_size, (cfg.batch, cfg.seq_len), generator=gen)
        source = "random"
    else:
        tokens = tokens.flatten().long()
        n = min(cfg.batch, tokens.numel() // cfg.seq_len)
        if n < 1:
            raise ValueError(f"calibration data has {tokens.numel()} tokens, fewer than one window of {cfg.seq_len}")
        check_tokens(n * cfg.seq_len, min(cfg.rank, x0_width(model)),
                     f"{n} windows of {cfg.seq_len} data tokens")
        idx = tokens[:n * cfg.seq_len].view(n, cfg.seq_len)
        source = "data"
    trace = model.hidden_states(idx.to(device))  # [h_0 = x0, h_1 .. h_L]
    flat = lambda t: t.reshape(t.shape[0] * t.shape[1], -1).cpu()  # noqa: E731  (B, T, *E) -> (N, prod E)
    V, U, b = fit_states(flat(trace[0]), [flat(h) for h in trace[1:]], cfg.rank)
    dtype = model.wte.weight.dtype
    digests = weights_digests(model)
    return Preheat(V=V.to(dtype), U=U.to(dtype), b=b.to(dtype), source=source,
                   fingerprint=fingerprint_digests(digests), digests=digests).to(device)

"""Fingerprints of a model's weights: what a calibration or a drafter was fitted on, in any precision.

Two digests live here, for two different questions:

`exact_digest(t)`: the stored bytes (shape, dtype, every bit). File integrity: a drafter file whose tensor was
edited by one ulp no longer matches (snlp.io.drafter).

`tensor_digest(t)` / `weights_fingerprint(model)`: "the same weights in another precision". A calibration fitted
on fp32 weights must stay valid after `model.to(torch.float16)`, `.to(torch.bfloat16)` or `.to(torch.float64)`,
while a real change of the weights (a training step, another checkpoint) must change the fingerprint.

Why not one rounded digest: NO digest that is a function of the values can be equal for x, its fp16 cast r16(x)
and its bf16 cast rb(x) for every fp32 x. Take any two adjacent bf16 values b < b'; an fp32 x just below their
midpoint has rb(x) = b, but r16(x) can be the midpoint (fp16 has 3 more mantissa bits) whose bf16 rounding
(ties to even) is b': rb(r16(x)) = b' (double rounding, ~6 % of entries). A digest equal on all copies would
have to give b and b' the same value, and by induction every value: it would detect nothing.

So a fingerprint is a PAIR of digests of two canonical forms, and two fingerprints match when the pairs share
one (`same_weights`). With g = bf16 ∘ fp16 (round to fp16, then to bf16) and G(v) = the fixed point of g's
iteration from v (g is monotone, so the iteration settles within a few steps; values beyond fp16's range
settle at ±inf, as an fp16 copy holds them):

    pair(v) = (G(v), G(rb(v)))          computed from v's fp32 value (fp64 -> fp32 is how torch casts fp64
                                        to fp16 / bf16 too, so an fp64 original behaves as its fp32 cast)

Every cast chain c among fp64/fp32/bf16/fp16 gives G(c(v)) in {G(v), G(rb(v))}: G(r16(y)) = G(y) for any y
(G starts with a fp16 rounding), casts to fp32/fp64 of a bf16/fp16 value are exact, rb(r16(y)) = g(y) and
the fixed point from g(y) is the one from y; only a bf16 cast BEFORE any fp16 one moves G(v) to G(rb(v)).
Hence the stated tolerance:

    same_weights(fingerprint(A), fingerprint(B)) is True whenever B is any chain of casts among fp64, fp32, bf16
    and fp16 of A, or A of B (e.g. fp32 -> fp16, fp32 -> fp16 -> bf16, fp32 -> bf16 -> fp16, their fp64 casts).
    It is False for the fp16 and the bf16 cast of a common fp32 original when they differ (as above, no digest
    can accept that pair and still detect anything), and for any change of the values that survives
    bf16 ∘ fp16 rounding (a training step, another checkpoint; a change below bf16 resolution is not seen).

Property-tested with hypothesis over random tensors in tests/model/test_fingerprint.py. Digests hash the values
(bf16 bits, so no bf16 arithmetic happens: rounding only), the shape, and for non-float tensors their exact bytes.
"""

from __future__ import annotations

import hashlib

import torch

HALF = 32  # hex digits of one of a fingerprint's two digests


def _bits(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (any dtype, including bf16/fp16 which numpy lacks)."""
    t = t.detach().contiguous().cpu().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


@torch.no_grad()
def exact_digest(t: torch.Tensor) -> str:
    """A digest of the stored tensor itself: shape, dtype and every bit (file integrity)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{tuple(t.shape)};{t.dtype};".encode())
    h.update(_bits(t))
    return h.hexdigest()


def _settle(t: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """G: iterate g = bf16(fp16(.)) from t (fp32 or bf16, flat) to its fixed point; returned as bf16. `odd`: the
    flat indices of the entries that may need more than one step (see `tensor_digest`); the rest settle in one."""
    cur = t.to(torch.float16).to(torch.bfloat16)
    if not len(odd):
        return cur
    sub = cur[odd]
    for _ in range(64):  # monotone rounding on a finite grid: a few steps in practice
        nxt = sub.to(torch.float16).to(torch.bfloat16)
        if torch.equal(nxt.view(torch.int16), sub.view(torch.int16)):  # bit equality: NaN-safe
            cur[odd] = sub
            return cur
        sub = nxt
    raise RuntimeError("fingerprint: bf16(fp16(.)) iteration did not settle")  # cannot happen (monotone, finite)


def _hash(shape, payload: bytes) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{tuple(shape)};".encode())
    h.update(payload)
    return h.hexdigest()


@torch.no_grad()
def tensor_digest(t: torch.Tensor) -> str:
    """A precision-tolerant digest of one tensor: the pair (G(v), G(rb(v))) of the module docstring as 64 hex
    digits (two halves); compare with `same_weights`. Non-float tensors: their exact values, twice."""
    t = t.detach()
    if not t.is_floating_point():
        d = _hash(t.shape, _bits(t))
        return d + d
    v = t.float().reshape(-1)  # fp64 -> fp32 as torch's casts to half precision do; lower precisions: exact
    # For 2^-14 <= |v| <= 65000 one step of g from v or from bf16(v) lands in fp16's normal range (at most 65024),
    # where a bf16 value (8 significant bits) is an fp16 value (11): g is the identity there, the entry settled.
    # Only the rest (subnormal range, zeros, overflow, NaN) is iterated. (Python scalars vs fp32: exact compares.)
    m = v.abs()
    odd = (~((m >= 2.0 ** -14) & (m <= 65000.0))).nonzero().squeeze(1)  # few: near-zero entries, mostly
    a = _hash(t.shape, _bits(_settle(v, odd)))
    b = _hash(t.shape, _bits(_settle(v.to(torch.bfloat16), odd)))
    return a + b


def same_weights(a: str | None, b: str | None) -> bool:
    """True when two digests/fingerprints (tensor_digest, weights_fingerprint) describe the same weights up to
    the casts stated in the module docstring: their pairs share a half. Old single digests never match."""
    if not a or not b or len(a) != 2 * HALF or len(b) != 2 * HALF:
        return False
    return bool({a[:HALF], a[HALF:]} & {b[:HALF], b[HALF:]})


def weights_digests(model: torch.nn.Module) -> dict[str, str]:
    """{name: tensor_digest} of the model's state: what lets a rank that holds only some tensors check them."""
    return {name: tensor_digest(t) for name, t in model.state_dict(keep_vars=False).items()}


def fingerprint_digests(digests: dict[str, str]) -> str:
    """The fingerprint of a whole state from its per-tensor digests (names sorted): the pair of the hashes of
    all first halves and of all second halves. A model is cast as a whole, so every tensor's match lies in the
    same half pairing (see the module docstring) and the whole-model pairs match too."""
    out = ""
    for part in (slice(0, HALF), slice(HALF, 2 * HALF)):
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(digests):
            h.update(f"{name}:{digests[name][part]};".encode())
        out += h.hexdigest()
    return out


def weights_fingerprint(model: torch.nn.Module) -> str:
    """The model's precision-tolerant fingerprint (64 hex digits; names, shapes, values): compare with
    `same_weights`. Device free; dtype tolerant as the module docstring states."""
    return fingerprint_digests(weights_digests(model))


HALVES = ("torch.float16", "torch.bfloat16")


def precision_note(made_in, used_in) -> str:
    """The mismatch message's precision clause: when a drafter / calibration made on an fp16 copy meets a bf16
    one (or the reverse), the fingerprints can differ although both are casts of one original (the documented
    exception above): say so and name the dtype to use, instead of blaming another model. "" otherwise."""
    a, b = str(made_in), str(used_in)
    if a != b and a in HALVES and b in HALVES:
        return (f"; it was made on a {a} copy and this model is {b}: if both are copies of one model, an fp16 and a "
                f"bf16 copy need not fingerprint alike (snlp.model.fingerprint): load the model in {a} (the dtype it "
                f"was made on) or in the original's dtype; else it belongs to another model")
    return ""

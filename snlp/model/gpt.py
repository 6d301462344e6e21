"""A nanochat-style decoder-only Transformer.

RoPE, QK-norm, parameter-free RMSNorm, relu^2 MLP, untied lm_head, tanh logit softcap,
GQA, optional x0 residual (per-layer learnable scalars), optional gated value embeddings
on alternating layers and optional sliding-window layers. One dial (depth) sets the size.

The hidden state h_l is the output of block l, h_0 = norm(wte(idx)) = x0. Layer l maps
    f_l(h) = Block_l(lam_resid[l] * h + lam_x0[l] * x0)        (x0 residual on)
    f_l(h) = Block_l(h)                                         (x0 residual off)
which is the layer map G_l(h) = h_l - f_l(h_{l-1}) of the paper's Eq. (residual).

Llama family (snlp.io.hf.from_hf sets the switches; defaults are the nanochat model above): SwiGLU MLP,
q/k/v biases (Qwen2), weighted per-head q/k RMSNorm before RoPE (Qwen3) or no QK-norm, h_0 = wte(idx)
un-normalised, learned RMSNorm weights (ln_attn / ln_mlp per block, ln_f) with the model's eps,
rotate-half RoPE with transformers' frequencies (linear or llama3 scaling), explicit head_dim, no softcap,
per-layer sliding windows and tied embeddings: the forward then equals transformers' (tests/io/test_hf.py).

mHC (GPTConfig.hc_streams = n >= 1; manifold-constrained hyper-connections, Xie et al. 2025, after
Zhu et al.'s hyper-connections; paper App. "Connection to Hyper-Connections and mHC"): the hidden
state is n residual streams, h_l (B, T, n, D). h_0 copies the normed embedding to every stream
(expand) and `head` sums the streams (reduce) before the final norm. Each attention and MLP
sublayer of every block is wrapped as
    x' = H_res x + H_post (x) F(norm(H_pre x))
with H_res (n x n) = Sinkhorn-Knopp(exp(logits)) (doubly stochastic, HC_SINKHORN_ITERS rounds of
row/column normalisation, in at least fp32), H_pre = sigmoid(logits) (1 x n), H_post = 2 sigmoid(logits) (n x 1).
Static mHC (hc_dynamic=False): the logits are learned biases. Dynamic (default): logits = bias +
alpha (.) (norm(vec(x)) @ phi), alpha (one gate each for res/pre/post) zero at init, so the model
starts static. Init: H_res ~ I, H_pre favours stream l mod n (breaks the symmetry between the
copied streams), H_post = 1; with the zero output projections every block starts as the identity
on identical streams, so the initial model computes what the plain one does. The x0 residual is
off with mHC (x0_residual=None picks it automatically; explicitly asking for both is an error).
nanochat-snlp's mHC (GPTConfig.hc_maps = "softmax") is static with H_pre, H_post softmaxes over the streams and
H_res a log-space Sinkhorn of logits / tau (snlp.model.hc.hc_maps).

nanochat(-snlp) parts (snlp.io.nanochat sets them; all off by default):
  - smear (GPTConfig.smear): h_0[t] = e[t] + smear_lambda * sigmoid(smear_gate . e[t, :24]) * e[t-1] with e the
    normed embeddings (e[-1] = 0). It depends on the previous TOKEN only, so a KV-cached call reads the previous
    position's id from the cache (KVCache.ids), and a cached multi-token call smears its first token too (the full
    sequence's function; nanochat's engine skips that token in chunked prefill).
  - backout (GPTConfig.backout): the head reads h_L - backout_lambda * h_{b+1}, b = n_layer // 2 the halfway
    layer (h_{b+1} its output). `run_layers` keeps h_{b+1} in the Context (Context.hb) and subtracts it once it
    has run the last layer; an SNLP solve subtracts the current iterate of the chunk holding layer b (its output
    state; for M = 1 layer b's iterate, exact at convergence), as the paper's code does (snlp.method.solver).
  - qk_scale (q, k times 1.2 after the QK-norm), ve_gate_channels / ve_gate_scale (12 channels, 3 sigmoid).
  - rope_bf16: the RoPE cos / sin tables rounded to bf16 before use in any dtype, as nanochat kept them until
    2026-03-04 (in fp32 its q, k rotate by the rounded tables; snlp.io.nanochat lists the versions).
"""


from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from snlp.model.cache import RowPositions
from snlp.model.config import HC_PRE_INIT, HC_RES_INIT, SMEAR_CHANNELS, GPTConfig
from snlp.model.hc import HyperConn, hc_maps, hc_sublayer, maps_of
from snlp.model.ops import attend, mlp_act, norm, qk_rope, rope_inv_freq, round_bf16, window_kernel


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        D, hd = cfg.n_embd, cfg.head_dim
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, hd
        self.c_q = nn.Linear(D, cfg.n_head * hd, bias=cfg.qkv_bias)
        self.c_k = nn.Linear(D, cfg.n_kv_head * hd, bias=cfg.qkv_bias)
        self.c_v = nn.Linear(D, cfg.n_kv_head * hd, bias=cfg.qkv_bias)
        self.c_proj = nn.Linear(cfg.n_head * hd, D, bias=False)
        self.qk_norm, self.eps = cfg.qk_norm, cfg.norm_eps
        if cfg.qk_norm == "weighted":  # Qwen3: per-head RMSNorm weights of q and k, applied before RoPE
            self.q_norm = nn.Parameter(torch.ones(hd))
            self.k_norm = nn.Parameter(torch.ones(hd))
        self.ve_gate = nn.Linear(min(cfg.ve_gate_channels, D), cfg.n_kv_head, bias=False) if cfg.has_ve(layer) else None
        self.ve_scale = cfg.ve_gate_scale
        self.qk_scale = cfg.qk_scale if cfg.qk_scale != 1.0 else None
        self.window = cfg.window(layer)
        self.layer_idx = layer  # slot in a KV cache (snlp.model.cache.KVCache)

    def forward(self, xn: Tensor, ve: Tensor | None, cos: Tensor, sin: Tensor, cache=None, start: int | Tensor = 0,
                span: int | None = None, masks: dict | None = None) -> Tensor:
        """`masks`: the forward's attention-mask memo (snlp.model.ops.attention_mask), shared by its layers."""
        B, T, _ = xn.shape
        q = self.c_q(xn).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(xn).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(xn).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:  # gated value embedding (ResFormer-style), gate in (0, 2)
            gate = self.ve_scale * torch.sigmoid(self.ve_gate(xn[..., : self.ve_gate.in_features]))
            v = v + gate.unsqueeze(-1) * ve.view_as(v)
        qw, kw = (self.qk_scale, self.qk_scale) if self.qk_scale else (getattr(self, "q_norm", None),
                                                                       getattr(self, "k_norm", None))
        q, k = qk_rope(q, k, cos, sin, self.qk_norm, qw, kw, self.eps)
        if cache is not None:  # cached: write the new K/V at start.., attend over positions 0..start+T-1
            kc, vc = cache.write(self.layer_idx, k.transpose(1, 2), v.transpose(1, 2), start)  # (B, Hkv, S, hd)
            if span is not None:  # eager ragged call: attend over the positions in use only (RowPositions)
                kc, vc = kc[..., :span, :], vc[..., :span, :]
            y = attend(q.transpose(1, 2), kc, vc, self.window, q_start=start, masks=masks)
            return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))
        y = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.window, masks=masks)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        F_ = cfg.hidden_dim
        self.swiglu = cfg.mlp_act == "swiglu"
        self.c_fc = nn.Linear(cfg.n_embd, 2 * F_ if self.swiglu else F_, bias=False)
        self.c_proj = nn.Linear(F_, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(mlp_act(self.c_fc(x), self.c_proj.in_features if self.swiglu else 0))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.)). With mHC each sublayer is
    wrapped by its HyperConn (`hc_sublayer`) and x holds the streams (..., n, D)."""

    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.hc_attn = HyperConn(cfg) if cfg.hc_streams else None
        self.hc_mlp = HyperConn(cfg) if cfg.hc_streams else None
        self.eps = cfg.norm_eps
        if cfg.norm_weights:  # HF input_layernorm / post_attention_layernorm
            self.ln_attn = nn.Parameter(torch.ones(cfg.n_embd))
            self.ln_mlp = nn.Parameter(torch.ones(cfg.n_embd))
        else:
            self.ln_attn = self.ln_mlp = None

    def forward(self, x: Tensor, ve: Tensor | None, cos: Tensor, sin: Tensor, cache=None, start: int | Tensor = 0,
                span: int | None = None, masks: dict | None = None, hc: tuple | None = None) -> Tensor:
        """`masks`: the forward's attention-mask memo; `hc`: static mHC's precomputed ((H_res, H_pre, H_post) of the
        attention sublayer, the same of the MLP sublayer) (GPT.static_hc), None to compute them here."""
        if self.hc_attn is not None:
            x = hc_sublayer(self.hc_attn, x, lambda xn: self.attn(xn, ve, cos, sin, cache, start, span, masks),
                            None if hc is None else hc[0])
            return hc_sublayer(self.hc_mlp, x, self.mlp, None if hc is None else hc[1])
        x = x + self.attn(norm(x, self.ln_attn, self.eps), ve, cos, sin, cache, start, span, masks)
        return x + self.mlp(norm(x, self.ln_mlp, self.eps))


@dataclass
class Context:
    """Per-forward inputs shared by every layer: x0 (B,T,D) = h_0 (with mHC (B,T,n,D): the normed
    embedding copied to every stream), value embeddings (n_ve,B,T,kv_dim)
    or None, and RoPE tables (T,1,hd/2). With a KV cache (decoding) the tokens sit at absolute
    positions start..start+T-1 and every layer reads/writes `cache` (snlp.model.cache.KVCache). A ragged batched
    call (snlp.model.cache.RowPositions) also carries `span` (eager: attention covers cache positions 0..span-1)
    and `real` ((B, T) bool, False on a short row's end padding): per-call facts travel with the call, never as
    state on the shared cache. `extra` holds what the forward derives once and every layer / iteration reuses (the
    attention masks, static mHC's maps, the fused branches' value embeddings, HCN's transfer blocks): it lives and
    dies with the Context, and a Context whose batch changes drops it (snlp.method.jacobian.repeat_context)."""

    idx: Tensor
    x0: Tensor
    ve: Tensor | None
    cos: Tensor
    sin: Tensor
    extra: dict = field(default_factory=dict)
    start: int | Tensor = 0  # a (T,) positions tensor in the static-shape step (snlp.decode.steps)
    cache: object | None = None
    span: int | None = None
    real: Tensor | None = None

    @property
    def hb(self) -> Tensor | None:
        """backout: layer n_layer // 2's output, set by GPT.run_layers when it runs that layer (or by a solve given
        it for a precomputed prefix). Kept in `extra` rather than as a field: under torch.compile (2.13) an attribute
        set on a Context made inside the graph is lost when dynamo traces a FlexAttention call after it (the
        higher-order op's subgraph speculation restores the object's attributes, not its dict's entries)."""
        return self.extra.get("hb")

    @hb.setter
    def hb(self, value: Tensor | None) -> None:
        self.extra["hb"] = value


class GPT(nn.Module):
    """nanochat-style GPT. `forward` is the sequential reference; `snlp.parallel_forward` is SNLP."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        window_kernel()  # reads SNLP_WINDOW_ATTENTION now (a misspelt value refused), not inside a traced forward
        self.config = cfg = config
        L, D, V = cfg.n_layer, cfg.n_embd, cfg.vocab_size
        self.wte = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(cfg, l) for l in range(L))
        self.lm_head = nn.Linear(D, V, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.ln_f = nn.Parameter(torch.ones(D)) if cfg.norm_weights else None
        if cfg.x0_residual:
            self.resid_lambdas = nn.Parameter(torch.ones(L))
            self.x0_lambdas = nn.Parameter(torch.zeros(L))
        if cfg.smear:  # nanochat's names, so its state dicts load as they are
            self.smear_gate = nn.Linear(SMEAR_CHANNELS, 1, bias=False)
            self.smear_lambda = nn.Parameter(torch.zeros(1))
        if cfg.backout:
            self.backout_lambda = nn.Parameter(torch.zeros(1))
        # value embeddings live in ONE stacked table so all layers' lookups are a single gather
        self.ve_slot = [-1] * L
        ve_layers = [l for l in range(L) if cfg.has_ve(l)]
        for slot, l in enumerate(ve_layers):
            self.ve_slot[l] = slot
        if ve_layers:
            self.value_embeds = nn.Parameter(torch.empty(len(ve_layers), V, cfg.n_kv_head * cfg.head_dim))
        if cfg.rope_scaling is None and not cfg.rope_rotate_half:
            inv_freq = 1.0 / cfg.rope_base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        else:  # HF models: exactly transformers' frequencies
            inv_freq = rope_inv_freq(cfg.rope_base, cfg.head_dim, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.init_weights()

    def _apply(self, fn, recurse=True):
        # .to(dtype) / .half() cast every floating buffer, and a bf16 inv_freq rotates position t by
        # t * round_bf16(f): a phase error that grows with t (0.35 in cos at t = 2000). nanochat's models, and
        # transformers' loaded with from_pretrained(dtype=...), keep the frequencies in fp32 and round only the
        # tables (GPT.rotary), so the cast moves inv_freq, never rounds it.
        inv = self.inv_freq
        out = super()._apply(fn, recurse)
        if inv.dtype == torch.float32 and self.inv_freq.dtype != torch.float32:
            new = self.inv_freq
            self.inv_freq = new.float() if inv.device.type == "meta" else inv.to(new.device)
        return out

    @torch.no_grad()
    def init_weights(self, seed: int | None = None):
        """All initialisation in one place (nanochat): N(0,1) embeddings, tiny lm_head, uniform
        input projections with bound sqrt(3/D), zero output projections (each block starts as the
        identity), resid scalars 1 and x0 scalars 0.1. mHC: see the module docstring (H_res ~ I,
        H_pre favours stream l mod n, H_post = 1, phi uniform with bound sqrt(3/(nD)), gates 0)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        cfg = self.config
        s = math.sqrt(3.0 / cfg.n_embd)

        def uniform_(t, bound):
            t.copy_((torch.rand(t.shape, generator=gen) * 2 - 1) * bound)

        self.wte.weight.copy_(torch.randn(self.wte.weight.shape, generator=gen))
        if not cfg.tie_embeddings:
            self.lm_head.weight.copy_(torch.randn(self.lm_head.weight.shape, generator=gen) * 1e-3)
        if self.ln_f is not None:
            self.ln_f.fill_(1.0)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                uniform_(lin.weight, s)
                if lin.bias is not None:
                    lin.bias.zero_()
            for w in (block.ln_attn, block.ln_mlp, getattr(block.attn, "q_norm", None),
                      getattr(block.attn, "k_norm", None)):
                if w is not None:
                    w.fill_(1.0)
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()
            if block.attn.ve_gate is not None:
                block.attn.ve_gate.weight.zero_()
        if cfg.x0_residual:
            self.resid_lambdas.fill_(1.0)
            self.x0_lambdas.fill_(0.1)
        if cfg.smear:  # smear starts off (lambda 0), backout at nanochat's 0.2
            self.smear_gate.weight.zero_()
            self.smear_lambda.zero_()
        if cfg.backout:
            self.backout_lambda.fill_(0.2)
        if hasattr(self, "value_embeds"):
            uniform_(self.value_embeds, s)
        n = cfg.hc_streams
        for l, block in enumerate(self.blocks if n else []):
            for hc in (block.hc_attn, block.hc_mlp):
                res = torch.full((n, n), -HC_RES_INIT)
                res.fill_diagonal_(0.0)
                pre = torch.full((n,), -HC_PRE_INIT)
                pre[l % n] = HC_PRE_INIT
                hc.bias.copy_(torch.cat([res.flatten(), pre, torch.zeros(n)]))
                if hc.phi is not None:
                    uniform_(hc.phi, math.sqrt(3.0 / (n * cfg.n_embd)))
                    hc.alpha.zero_()

    # ----- pieces shared by the sequential and the parallel forward -----
    def check_tokens(self, idx: Tensor) -> None:
        """Raise a ValueError for token ids of the wrong type, shape, device or range."""
        if not isinstance(idx, Tensor):
            raise ValueError(f"token ids must be a torch.Tensor of shape (B, T), got {type(idx).__name__}")
        if idx.dtype not in (torch.long, torch.int32, torch.int16, torch.uint8):
            raise ValueError(f"token ids must be an integer tensor, got dtype {idx.dtype}")
        if idx.dim() != 2 or idx.shape[0] < 1 or idx.shape[1] < 1:
            raise ValueError(f"token ids must have shape (B, T) with B, T >= 1, got {tuple(idx.shape)}")
        w = self.wte.weight
        if idx.device != w.device and w.device.type != "meta":  # a Python compare, no sync: torch's own error names
            # neither tensor ("Expected all tensors to be on the same device ... index_select")
            raise ValueError(f"token ids are on {idx.device} but the model is on {w.device}: move them first "
                             f"(idx.to({str(w.device)!r}))")
        # range check only where the ids already sit in host memory (CPU): on any accelerator it would be a
        # device-to-host sync on every forward (CUDA's embedding kernel asserts on the device instead; decode
        # entry points validate a request's prompt once, where it is made), and under torch.compile it would break
        # the graph. docs/gpu-internals.md lists the host syncs of every path.
        if idx.device.type == "cpu" and not torch.compiler.is_compiling():
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got range [{lo}, {hi}]")

    def check_targets(self, targets, idx) -> Tensor:
        """Next-token targets for `forward`'s loss: an integer tensor of idx's shape (B, T) (-1: ignored), as long. The
        loss flattens both, so targets of another shape with as many elements (a transposed (T, B)) gave the CE of
        misaligned pairs without a word; int32 ones, which the ids may be, failed inside cross_entropy."""
        if not isinstance(targets, Tensor) or targets.dtype.is_floating_point or targets.dtype.is_complex \
                or targets.dtype == torch.bool:
            what = type(targets).__name__ if not isinstance(targets, Tensor) else f"a tensor of {targets.dtype}"
            raise ValueError(f"targets must be an integer tensor of the ids' shape (B, T), got {what}")
        if isinstance(idx, Tensor) and targets.shape != idx.shape:
            raise ValueError(f"targets must have the ids' shape {tuple(idx.shape)} (the next token of each position, "
                             f"-1 where ignored), got {tuple(targets.shape)}")
        # the loss is the mean over the targets that are not -1: with none it is 0/0, a NaN that F.cross_entropy
        # returns without a word (a training loop stepped on it or logged it as the loss). Read only where the
        # targets sit in host memory, as check_tokens reads the ids: elsewhere it would be a sync on every forward.
        # Read as long, as the loss reads them: a uint8 255 compares equal to -1 (the scalar wraps) yet is class 255
        targets = targets.long()
        if targets.device.type == "cpu" and not torch.compiler.is_compiling() and targets.numel():
            real = targets[targets != -1]
            if real.numel() == 0:
                raise ValueError(f"targets of shape {tuple(targets.shape)} are all -1 (ignored): the mean "
                                 f"cross-entropy over no token is undefined; give at least one real target")
            lo, hi = int(real.min()), int(real.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"targets must be -1 (ignored) or lie in [0, {self.config.vocab_size}), got "
                                 f"range [{lo}, {hi}]")
        return targets

    def rotary(self, T: int, start: int | Tensor = 0) -> tuple[Tensor, Tensor]:
        """RoPE tables for positions start..start+T-1 (or the (T,) positions tensor `start`), (T, 1, hd/2);
        for a (B, T) positions tensor (ragged batches) per row, (B, T, 1, hd/2)."""
        if isinstance(start, Tensor):
            t = start.to(device=self.inv_freq.device, dtype=torch.float32)
        else:
            t = torch.arange(start, start + T, device=self.inv_freq.device, dtype=torch.float32)
        freqs = (t[..., None] * self.inv_freq.float())[..., None, :]  # fp32 in every dtype, as transformers does
        dtype = self.wte.weight.dtype
        cos, sin = freqs.cos(), freqs.sin()
        if self.config.rope_bf16:  # nanochat up to 2026-03-03 kept its tables in bf16 whatever the compute dtype
            cos, sin = round_bf16(cos), round_bf16(sin)
        cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, -sin if self.config.rope_rotate_half else sin

    def embed(self, idx: Tensor, cache=None, pos: Tensor | RowPositions | None = None) -> Context:
        """Token ids (B,T) -> the per-forward Context (x0, value embeddings, RoPE). With a KV
        `cache` the tokens continue the cached sequence: they sit at positions cache.length..
        With `pos` (a (T,) long tensor of absolute positions, static-shape decoding, snlp.decode.steps, or (B, T):
        each row at its own positions, ragged batched decoding, snlp.decode.batch) they sit at those positions instead and `cache.length` is not read: the caller checked the room and owns
        the length, so nothing here depends on a Python-side position (one compiled graph for every step). A
        `RowPositions` (an eager ragged call) brings its (B, T) positions plus `span` / `real` into the Context."""
        self.check_tokens(idx)
        idx = idx.long()
        start: int | Tensor = 0
        span = real = None
        if isinstance(pos, RowPositions):  # a ragged batched call: positions plus what the call knows of them
            pos, span, real = pos.pos, pos.span, pos.real
        if cache is not None:  # every call: a model moved (.to) or autocast turned on since the cache was made is
            cache.check_model(self)  # caught; ~2 us, a tie against an eager decode step (docs/records, 2026-11-29)
        if pos is not None:
            if cache is None:
                raise ValueError("embed(pos=...) is the static-shape KV-cached step: pass the cache too")
            if pos.shape != (idx.shape[1],) and pos.shape != idx.shape:
                raise ValueError(f"pos must be a (T,) = ({idx.shape[1]},) tensor of positions, or (B, T) = "
                                 f"{tuple(idx.shape)} (one row of positions per sequence), got {tuple(pos.shape)}")
            if idx.shape[0] != cache.batch or idx.shape[1] > cache.max_len:
                raise ValueError(f"KV cache holds batch {cache.batch} x {cache.max_len} positions, got ids "
                                 f"{tuple(idx.shape)}")
            start = pos
        elif cache is not None:
            cache.check(idx.shape[0], idx.shape[1])
            start = cache.length
        x0 = self.wte(idx)
        if self.config.embed_norm:
            x0 = norm(x0)
        if self.config.smear:
            x0 = self.smear(x0, idx, cache, start)
        if self.config.hc_streams:  # mHC expand: h_0 = the embedding copied to every stream
            x0 = x0.unsqueeze(-2).expand(*x0.shape[:-1], self.config.hc_streams, x0.shape[-1])
        ve = self.value_embeds[:, idx] if hasattr(self, "value_embeds") else None  # (n_ve, B, T, kv)
        cos, sin = self.rotary(idx.shape[1], start)
        return Context(idx=idx, x0=x0, ve=ve, cos=cos, sin=sin, start=start, cache=cache, span=span, real=real)

    def smear(self, e: Tensor, idx: Tensor, cache=None, start: int | Tensor = 0) -> Tensor:
        """h_0 from the embeddings e (B, T, D): each position mixes in the previous token's embedding through the
        smear gate (module docstring). Without a cache the call starts at position 0 (no predecessor). With one,
        the ids are recorded at their positions (KVCache.ids) and the predecessor of the call's first token (of
        every token, for position tensors: static-shape steps, ragged rows) is read back from there."""
        if cache is None:
            prev = torch.cat([torch.zeros_like(e[:, :1]), e[:, :-1]], 1)  # (B, T, D), e[-1] = 0
        elif isinstance(start, Tensor):  # (T,) or (B, T) positions: write the ids, then read each position - 1
            ids = cache.write_ids(idx, start)  # (B, max_len)
            before = (start - 1).clamp_min(0).expand(idx.shape)  # (B, T)
            prev = self.embed_ids(ids.gather(1, before)) * (start > 0).expand(idx.shape).unsqueeze(-1)
        else:
            ids = cache.write_ids(idx, start)
            first = self.embed_ids(ids[:, start - 1:start]) if start > 0 else torch.zeros_like(e[:, :1])
            prev = torch.cat([first, e[:, :-1]], 1)
        gate = self.smear_lambda * torch.sigmoid(self.smear_gate(e[..., :SMEAR_CHANNELS]))  # (B, T, 1)
        return e + gate * prev

    def embed_ids(self, idx: Tensor) -> Tensor:
        """The (normed) token embeddings of idx, before the smear."""
        e = self.wte(idx)
        return norm(e) if self.config.embed_norm else e

    def finish(self, h: Tensor, hb: Tensor | None) -> Tensor:
        """What the head reads: h_L, minus backout_lambda * hb (layer n_layer // 2's output, or the SNLP iterate
        that stands for it) with the backout on."""
        if not self.config.backout:
            return h
        if hb is None:
            raise ValueError(f"the backout subtracts layer {self.config.backout_layer}'s output, which this run did "
                             f"not compute (it started after that layer); run the layers from 0 with one Context")
        return h - self.backout_lambda * hb

    def prefix_backout(self, trace: list[Tensor], S: int) -> Tensor | None:
        """From a sequential trace [h_0, ..h_S..]: the backout state a solve from the precomputed prefix h_S needs
        (`solve(..., prefix=trace[S], hb=...)`): layer b's output when b < S, else None (the solve has it)."""
        b = self.config.backout_layer
        return trace[b + 1] if b is not None and b < S else None

    def static_hc(self, ctx: Context, dtype: torch.dtype) -> tuple[dict, tuple[Tensor, Tensor, Tensor]] | None:
        """Static mHC (hc_dynamic=False): the (H_res (N, 2, n, n), H_pre (N, 2, n), H_post (N, 2, n)) of both
        sublayers of every layer that has them (N of them; row i of the returned {layer: i} map), from ONE batched
        Sinkhorn per forward, memoised in ctx.extra. Static H depend on parameters only, so computing them per
        sublayer repeats the same ~90 tiny ops (20 Sinkhorn rounds of 4) 2L times per forward: launch-bound work
        on a GPU (docs/records/2026-11-26-gpu-h100.md). None for plain and dynamic-mHC models."""
        cfg = self.config
        if not cfg.hc_streams or cfg.hc_dynamic:
            return None
        key = ("static_hc", dtype)
        if key not in ctx.extra:
            # every layer that has its blocks (a rank of snlp.dist frees the blocks it never runs)
            layers = [l for l, b in enumerate(self.blocks) if getattr(b, "hc_attn", None) is not None]
            bias = torch.stack([h.bias for l in layers for h in (self.blocks[l].hc_attn, self.blocks[l].hc_mlp)])
            maps = hc_maps(bias.view(len(layers), 2, -1), cfg.hc_streams, dtype, **maps_of(cfg))
            ctx.extra[key] = ({l: i for i, l in enumerate(layers)}, maps)
        return ctx.extra[key]

    def layer(self, l: int, h: Tensor, ctx: Context) -> Tensor:
        """f_l(h): the full map of layer l from h_{l-1} to h_l (x0 mixing included)."""
        if self.config.x0_residual:
            h = self.resid_lambdas[l] * h + self.x0_lambdas[l] * ctx.x0
        slot = self.ve_slot[l]
        ve = ctx.ve[slot] if slot >= 0 else None
        masks = ctx.extra.setdefault("masks", {})
        hc = self.static_hc(ctx, h.dtype)
        if hc is not None:  # layer l's row: views, no kernel
            i, (res, pre, post) = hc[0][l], hc[1]
            hc = ((res[i, 0], pre[i, 0], post[i, 0]), (res[i, 1], pre[i, 1], post[i, 1]))
        if ctx.cache is not None:
            return self.blocks[l](h, ve, ctx.cos, ctx.sin, ctx.cache, ctx.start, ctx.span, masks, hc)
        return self.blocks[l](h, ve, ctx.cos, ctx.sin, masks=masks, hc=hc)

    def head(self, h: Tensor, keep: int | None = None) -> Tensor:
        """Final norm, lm_head and tanh softcap: h_L (B,T,D) -> logits (B,T,V) in fp32, fp64 in an fp64 model
        (max(model dtype, fp32)). With mHC, h_L (B,T,n,D) is first reduced by summing the streams. `keep`: the last
        `keep` positions only (B, keep, V), checked by the caller before its forward (`check_keep`)."""
        if keep is not None:
            h = h[:, h.shape[1] - keep:]
        if self.config.hc_streams:
            h = h.sum(-2)
        logits = self.lm_head(norm(h, self.ln_f, self.config.norm_eps))
        # fp32 at least (bf16 / fp16 logits lose the softcap's and the softmax's precision); an fp64 model keeps fp64,
        # so fp64 references compare logits, not their fp32 rounding
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        c = self.config.softcap
        return c * torch.tanh(logits / c) if c > 0 else logits

    def run_layers(self, h: Tensor, ctx: Context, start: int, stop: int, trace: list | None = None) -> Tensor:
        """Apply layers start..stop-1 sequentially, optionally appending each h_l to `trace`. With the backout
        on, layer n_layer // 2's output is kept in ctx.hb, and a run that ends with the last layer returns what the
        head reads, h_L - backout_lambda * ctx.hb (`finish`; the trace keeps the layers' own outputs)."""
        b = self.config.backout_layer
        for l in range(start, stop):
            h = self.layer(l, h, ctx)
            if l == b:
                ctx.hb = h
            if trace is not None:
                trace.append(h)
        if b is not None and stop == self.config.n_layer:
            h = self.finish(h, ctx.hb)
        return h

    def hidden_states(self, idx: Tensor) -> list[Tensor]:
        """Sequential trace [h_0, h_1, ..., h_L], each (B,T,D) ((B,T,n,D) with mHC): the layers' outputs (with the
        backout on, the head reads `final_state`, not h_L)."""
        ctx = self.embed(idx)
        trace = [ctx.x0]
        self.run_layers(ctx.x0, ctx, 0, self.config.n_layer, trace)
        return trace

    def final_state(self, idx: Tensor) -> Tensor:
        """The state the head reads after the sequential forward of idx (h_L, backout applied)."""
        ctx = self.embed(idx)
        return self.run_layers(ctx.x0, ctx, 0, self.config.n_layer)

    def forward(self, idx: Tensor, targets: Tensor | None = None, cache=None,
                pos: Tensor | RowPositions | None = None, keep: int | None = None) -> Tensor:
        """Sequential forward: logits (B,T,V), or the mean cross-entropy if `targets` is given
        (targets == -1 are ignored). With a KV `cache` (snlp.model.cache.KVCache) idx continues the
        cached sequence: its K/V are written at cache.length.. and the cache advances by T. With `pos`
        ((T,) positions, the static-shape step of snlp.decode.steps) the K/V go to those positions, the whole
        cache is attended under a mask and the cache does not advance (the caller owns the length). `keep`: logits
        of the last `keep` positions only (B, keep, V), as transformers' logits_to_keep: a prefill that only fills
        the cache takes keep=0 and pays no head (on a small model the vocabulary projection costs as much as its
        layers). Not with `targets`."""
        if keep is not None and targets is not None:
            raise ValueError(f"keep={keep!r} gives logits, targets a loss: pass one of them")
        check_keep(keep, idx)
        if targets is not None:
            targets = self.check_targets(targets, idx)
        ctx = self.embed(idx, cache, pos)
        logits = self.head(self.run_layers(ctx.x0, ctx, 0, self.config.n_layer), keep)
        if cache is not None and pos is None:
            cache.advance(idx.shape[1])
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def check_keep(keep: int | None, idx) -> None:
    """Refuse a `keep` (logits of the last `keep` of idx's T positions) outside 0..T before any forward: the slice
    h[:, T - keep:] would read keep > T as fewer rows (a negative start) and a negative keep as none, silently.
    Token ids that are not a (B, T) tensor pass here: the forward's own check (GPT.check_tokens) names them.
    A bool or non-integer keep is refused too: True sliced as 1 row and False as none, and 1.5 failed in the slice
    only after the whole forward (a Runner's solve) had run."""
    if keep is None:
        return
    if isinstance(keep, bool) or not isinstance(keep, int):
        raise ValueError(f"keep={keep!r}: an integer number of last positions (0..T) or None, "
                         f"not a {type(keep).__name__}")
    if not isinstance(idx, Tensor) or idx.dim() != 2:
        return
    T = idx.shape[1]
    if not 0 <= keep <= T:
        raise ValueError(f"keep={keep!r}: the logits of the last 0..T positions (T = {T})")


def check_gpt(model, what: str = "model") -> None:
    """Raise a TypeError, naming what `model` is, unless it is an snlp GPT: the functions that take one read its own
    attributes (config, blocks, head), which another module lacks, so without this check a transformers model fails
    with an AttributeError from deep inside transformers or torch. A transformers model converts with snlp.from_hf."""
    if isinstance(model, GPT):
        return
    cls = type(model)
    name = f"{cls.__name__} ({cls.__module__.split('.')[0]})"
    if cls.__module__.startswith("transformers"):
        how = "convert it first: `model, tok = snlp.from_hf(hf_model)` (Llama, Qwen2, Mistral, Qwen3)"
    elif isinstance(getattr(model, "module", None), GPT) or isinstance(getattr(model, "_orig_mod", None), GPT):
        how = "it wraps one (DDP / torch.compile): pass the GPT inside it"
    else:
        how = "build one with snlp.GPT(config), snlp.load(dir) or snlp.from_hf(src)"
    raise TypeError(f"{what} is a {name}, not an snlp GPT: {how}")


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """`module` in eval mode inside the block, and on leaving it (an exception too) every submodule back in the
    train / eval mode it came in: a caller's model with some parts kept in eval mode (a frozen prefix, dropout off in
    one block) keeps them so, which `module.train(was)` would not (it sets every submodule to `was`)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in modes:
            m.training = training

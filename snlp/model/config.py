"""GPTConfig: the model's switches (nanochat defaults; the Llama-family and mHC switches documented in
snlp.model.gpt) and the size dial `from_depth`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from snlp.model.ops import rope_inv_freq
from snlp.runtime.checks import bool_error

# the boolean fields of GPTConfig (x0_residual may also be None: on unless mHC)
SWITCHES = ("x0_residual", "value_embeds", "hc_dynamic", "qkv_bias", "embed_norm", "norm_weights", "rope_rotate_half",
            "tie_embeddings", "smear", "backout", "rope_bf16")

VE_GATE_CHANNELS = 32  # value-embedding gate reads the first channels of the normed input (nanochat)
HC_SINKHORN_ITERS = 20  # Sinkhorn-Knopp rounds for H_res (mHC paper: 20)
HC_RES_INIT = 4.0  # H_res logits at init: 0 on the diagonal, -HC_RES_INIT off it (H_res ~ I)
HC_PRE_INIT = 2.0  # H_pre logits at init: +2 for stream (layer mod n), -2 for the others
SMEAR_CHANNELS = 24  # the smear gate reads the first channels of the normed embedding (nanochat)
HC_MAPS = ("sigmoid", "softmax")  # GPTConfig.hc_maps


@dataclass
class GPTConfig:
    """Model hyper-parameters. Use `GPTConfig.from_depth` to size a model with one dial."""

    vocab_size: int = 32768
    n_layer: int = 16
    n_head: int = 8
    n_kv_head: int | None = None  # None -> n_head (no GQA)
    n_embd: int = 1024
    sequence_len: int = 2048
    mlp_ratio: int = 4
    window_pattern: str = "L"  # tiled over layers: L = full causal, S = sliding window of short_window
    short_window: int = 0  # 0 -> sequence_len // 2 (nanochat)
    x0_residual: bool | None = None  # None -> on for the plain model, off with mHC
    value_embeds: bool = True
    softcap: float = 15.0
    rope_base: float = 10000.0
    hc_streams: int = 0  # 0 = plain residual stream; n >= 1 = mHC with n streams
    hc_dynamic: bool = True  # mHC: input-dependent H (dynamic) or learned constants (static)
    # --- Llama-family switches (snlp.io.hf.from_hf sets them; the defaults are the nanochat model) ---
    mlp_act: str = "relu2"  # "relu2": proj(relu(fc x)^2); "swiglu": proj(silu(gate x) * up x), c_fc = [gate; up]
    ffn_dim: int = 0  # MLP hidden width; 0 -> mlp_ratio * n_embd
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    qk_norm: str = "rope_norm"  # "rope_norm": parameter-free RMSNorm after RoPE (nanochat); "weighted": per-head
    #                             RMSNorm with a learned weight before RoPE (Qwen3); "none" (Llama, Qwen2, Mistral)
    embed_norm: bool = True  # h_0 = norm(wte(idx)) (nanochat) or wte(idx) (Llama)
    norm_eps: float | None = None  # RMSNorm eps; None -> torch's default: finfo of the op's compute dtype (fp32 for bf16 / fp16 inputs)
    norm_weights: bool = False  # learned RMSNorm weights: per block ln_attn / ln_mlp, and ln_f before the head
    rope_rotate_half: bool = False  # RoPE sign convention of HF's rotate_half (x1 cos - x2 sin, x2 cos + x1 sin)
    rope_scaling: dict | None = None  # None or HF's {"rope_type": "linear", "factor"} or {"rope_type": "llama3", "factor", ...}
    attn_head_dim: int = 0  # explicit head dim (Qwen3: n_head * head_dim != n_embd); 0 -> n_embd // n_head
    layer_windows: list | None = None  # explicit left context per layer (-1 full); overrides window_pattern
    tie_embeddings: bool = False  # lm_head.weight is wte.weight
    # --- nanochat(-snlp) checkpoints (snlp.io.nanochat sets them; defaults keep the model above unchanged) ---
    smear: bool = False  # h_0[t] += smear_lambda * sigmoid(smear_gate . h_0[t, :24]) * h_0[t-1] (pre-smear values)
    backout: bool = False  # the head reads h_L - backout_lambda * h_{backout_layer + 1} (GPT.backout_layer)
    qk_scale: float = 1.0  # q and k are multiplied by it after RoPE + QK-norm (nanochat-snlp: 1.2)
    ve_gate_channels: int = VE_GATE_CHANNELS  # the value-embedding gate reads this many channels (nanochat-snlp: 12)
    ve_gate_scale: float = 2.0  # value-embedding gate = scale * sigmoid(.) (nanochat-snlp: 3)
    hc_maps: str = "sigmoid"  # mHC maps: "sigmoid" (H_pre = sigmoid, H_post = 2 sigmoid, Sinkhorn of exp(logits))
    #                           or "softmax" (nanochat-snlp: H_pre, H_post = softmax, log-space Sinkhorn of logits/tau)
    hc_sinkhorn_iters: int = HC_SINKHORN_ITERS  # Sinkhorn rounds for H_res (nanochat-snlp: 10)
    hc_sinkhorn_tau: float = 1.0  # Sinkhorn temperature (hc_maps="softmax" only; nanochat-snlp: 0.05)
    rope_bf16: bool = False  # RoPE cos / sin tables rounded to bf16 in every dtype (nanochat before 2026-03-04)

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        errors = []
        for name in SWITCHES:  # truthiness would read "no" as on; numpy's bool_ is kept as a plain bool (JSON)
            v = getattr(self, name)
            if v is None and name == "x0_residual":
                continue
            if (err := bool_error(name, v)) is not None:
                errors.append(err)
            else:
                setattr(self, name, bool(v))
        for name in ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "sequence_len", "mlp_ratio"):
            if int(getattr(self, name)) < 1:
                errors.append(f"{name} must be >= 1 (got {getattr(self, name)})")
        if not errors and self.attn_head_dim:
            if self.attn_head_dim < 2 or self.attn_head_dim % 2:
                errors.append(f"attn_head_dim={self.attn_head_dim} must be even and >= 2 (0 = n_embd // n_head)")
            if self.n_head % self.n_kv_head:
                errors.append(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head} (GQA)")
        elif not errors:
            if self.n_embd % self.n_head:
                errors.append(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
            elif (self.n_embd // self.n_head) % 2:
                errors.append(f"head dim n_embd/n_head={self.n_embd // self.n_head} must be even for RoPE")
            if self.n_head % self.n_kv_head:
                errors.append(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head} (GQA)")
        if not self.window_pattern or set(self.window_pattern.upper()) - {"S", "L"}:
            errors.append(f"window_pattern={self.window_pattern!r} must be a non-empty string of 'S' and 'L'")
        if self.short_window < 0:
            errors.append(f"short_window must be >= 0 (got {self.short_window})")
        if self.softcap < 0:
            errors.append(f"softcap must be >= 0, 0 disables it (got {self.softcap})")
        if not isinstance(self.hc_streams, int) or self.hc_streams < 0:
            errors.append(f"hc_streams must be an integer >= 0, 0 = no mHC (got {self.hc_streams!r})")
        elif self.hc_streams > 0 and self.x0_residual:
            errors.append(f"the x0 residual cannot be combined with mHC (hc_streams={self.hc_streams}): pass "
                          f"x0_residual=False or leave it None (off automatically with mHC)")
        if self.mlp_act not in ("relu2", "swiglu"):
            errors.append(f"mlp_act={self.mlp_act!r} must be 'relu2' or 'swiglu'")
        if self.qk_norm not in ("rope_norm", "weighted", "none"):
            errors.append(f"qk_norm={self.qk_norm!r} must be 'rope_norm', 'weighted' or 'none'")
        if self.ffn_dim < 0:
            errors.append(f"ffn_dim must be >= 0, 0 = mlp_ratio * n_embd (got {self.ffn_dim})")
        if self.norm_eps is not None and not self.norm_eps > 0:
            errors.append(f"norm_eps must be > 0 or None (got {self.norm_eps})")
        if self.rope_scaling is not None:
            try:
                rope_inv_freq(self.rope_base, 2, self.rope_scaling)
            except ValueError as e:
                errors.append(str(e))
        if self.layer_windows is not None:
            if len(self.layer_windows) != self.n_layer or any(int(w) != w or w < -1 for w in self.layer_windows):
                errors.append(f"layer_windows must list n_layer={self.n_layer} integers >= -1 (-1 = full causal), "
                              f"got {self.layer_windows}")
            else:
                self.layer_windows = [int(w) for w in self.layer_windows]
        if self.qk_scale <= 0 or (self.qk_scale != 1.0 and self.qk_norm != "rope_norm"):
            errors.append(f"qk_scale={self.qk_scale} must be > 0, and != 1 only with qk_norm='rope_norm'")
        if not 1 <= self.ve_gate_channels:
            errors.append(f"ve_gate_channels must be >= 1 (got {self.ve_gate_channels})")
        if self.ve_gate_scale <= 0:
            errors.append(f"ve_gate_scale must be > 0 (got {self.ve_gate_scale})")
        if self.smear and self.n_embd < SMEAR_CHANNELS:
            errors.append(f"smear needs n_embd >= {SMEAR_CHANNELS} (its gate reads that many channels), got "
                          f"{self.n_embd}")
        if self.hc_maps not in HC_MAPS:
            errors.append(f"hc_maps={self.hc_maps!r} must be one of {HC_MAPS}")
        if self.hc_sinkhorn_iters < 1 or not self.hc_sinkhorn_tau > 0:
            errors.append(f"hc_sinkhorn_iters must be >= 1 and hc_sinkhorn_tau > 0 (got {self.hc_sinkhorn_iters}, "
                          f"{self.hc_sinkhorn_tau})")
        elif self.hc_maps == "sigmoid" and self.hc_sinkhorn_tau != 1.0:
            errors.append(f"hc_sinkhorn_tau={self.hc_sinkhorn_tau} is read by hc_maps='softmax' only")
        if self.hc_streams and (self.tie_embeddings or self.norm_weights):
            errors.append("tie_embeddings and norm_weights are not supported with mHC (hc_streams > 0)")
        if errors:
            raise ValueError("invalid GPTConfig: " + "; ".join(errors))
        self.window_pattern = self.window_pattern.upper()
        if self.x0_residual is None:
            self.x0_residual = self.hc_streams == 0
        self.x0_residual, self.hc_dynamic = bool(self.x0_residual), bool(self.hc_dynamic)

    @classmethod
    def from_depth(cls, depth: int, aspect_ratio: int = 64, head_dim: int = 128, width: int | None = None,
                   n_kv_head: int | None = None, **kw) -> "GPTConfig":
        """Size a model from its depth like nanochat: width = depth * aspect_ratio rounded up to a
        multiple of head_dim, heads = width / head_dim. `width` overrides the aspect ratio (the
        paper's 0.5B model is depth 32, width 640, 5 heads of 128)."""
        if depth < 1:
            raise ValueError(f"depth must be >= 1 (got {depth})")
        if width is None:
            width = head_dim * max(1, math.ceil(depth * aspect_ratio / head_dim))
        elif width % head_dim:
            raise ValueError(f"width={width} must be a multiple of head_dim={head_dim}")
        n_head = width // head_dim
        return cls(n_layer=depth, n_embd=width, n_head=n_head, n_kv_head=n_kv_head or n_head, **kw)

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.n_embd // self.n_head

    @property
    def hidden_dim(self) -> int:
        """MLP hidden width F (SwiGLU: c_fc has 2F outputs, gate then up)."""
        return self.ffn_dim or self.mlp_ratio * self.n_embd

    def window(self, layer: int) -> int:
        """Left context of `layer` in tokens (-1 = full causal). With window_pattern the last layer is
        always full; explicit layer_windows (HF sliding windows) are taken as they are."""
        if self.layer_windows is not None:
            return self.layer_windows[layer]
        kind = self.window_pattern[layer % len(self.window_pattern)]
        if kind == "L" or layer == self.n_layer - 1:
            return -1
        return self.short_window or self.sequence_len // 2

    @property
    def backout_layer(self) -> int | None:
        """The layer whose output the backout subtracts (the halfway layer n_layer // 2, as nanochat), or None."""
        return self.n_layer // 2 if self.backout else None

    def has_ve(self, layer: int) -> bool:
        """Value embeddings on alternating layers, always including the last (nanochat)."""
        return self.value_embeds and layer % 2 == (self.n_layer - 1) % 2

    def to_dict(self) -> dict:
        return asdict(self)

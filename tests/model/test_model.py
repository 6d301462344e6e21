from __future__ import annotations

import pytest
import torch
from conftest import make_model, tokens

from snlp import GPT, GPTConfig


def test_depth_dial_sizes_the_model_like_nanochat():
    c = GPTConfig.from_depth(16)
    assert (c.n_layer, c.n_embd, c.n_head, c.head_dim) == (16, 1024, 8, 128)
    paper_05b = GPTConfig.from_depth(32, width=640)  # the paper's 0.5B: depth 32, width 640, 5 heads
    assert (paper_05b.n_embd, paper_05b.n_head, paper_05b.head_dim) == (640, 5, 128)
    assert GPTConfig.from_depth(6, aspect_ratio=20, head_dim=64).n_embd == 128  # 120 rounded up to 64s
    with pytest.raises(ValueError, match="multiple of head_dim=128"):
        GPTConfig.from_depth(8, width=600)


@pytest.mark.parametrize("kw,msg", [(dict(n_embd=30, n_head=4), "divisible by n_head"),
                                    (dict(n_head=3, n_kv_head=2, n_embd=24), "multiple of n_kv_head"),
                                    (dict(window_pattern="SXL"), "window_pattern"),
                                    (dict(n_embd=12, n_head=4, n_kv_head=4), "must be even for RoPE"),
                                    (dict(n_layer=0), "n_layer must be >= 1")])
def test_invalid_configs_raise(kw, msg):
    with pytest.raises(ValueError, match=msg):
        GPTConfig(**kw)


@pytest.mark.parametrize("name", ["value_embeds", "smear", "backout", "qkv_bias", "tie_embeddings", "rope_bf16",
                                  "x0_residual", "hc_dynamic"])
def test_config_switches_are_true_or_false(name):
    """A switch given "no" (truthy) or 0 used to switch the feature on or off by truthiness; numpy's bool_ is a
    bool and is kept as Python's (configs are written as JSON)."""
    import numpy as np

    for bad in ("no", 1, 0.0):
        with pytest.raises(ValueError, match=rf"^invalid GPTConfig: {name} must be True or False \(got "):
            GPTConfig(n_embd=32, **{name: bad})
    cfg = GPTConfig(n_embd=32, **{name: np.bool_(False)})
    assert getattr(cfg, name) is False and type(cfg.to_dict()[name]) is bool


def test_forward_shapes_loss_and_softcap():
    model = make_model(dtype=torch.float32, scale=3.0)
    idx = tokens(model, B=3, T=10)
    logits = model(idx)
    assert logits.shape == (3, 10, 61) and logits.dtype == torch.float32
    assert logits.abs().max() <= 15.0  # tanh softcap
    loss = model(idx, targets=idx)
    assert torch.isfinite(loss) and loss.ndim == 0
    masked = idx.clone()
    masked[:, :5] = -1  # ignored positions
    assert not torch.isclose(model(idx, targets=masked), loss)


def test_the_loss_reads_targets_of_the_ids_shape_only():
    """forward(idx, targets) flattens both: targets (T, B) of a (B, T) batch (as many elements) gave the CE of
    misaligned pairs without a word, and int32 targets (ids may be int32) failed inside cross_entropy. Now: int32
    gives the long targets' loss, another shape or a float tensor is one ValueError."""
    model = make_model()
    idx = tokens(model, B=2, T=6)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        assert model(idx, targets=idx.int()) == want == model(idx, targets=idx)
        for bad in (idx.t(), idx[:, 1:], idx.double()):
            with pytest.raises(ValueError, match=r"targets must (have the ids' shape \(2, 6\)|be an integer tensor)"):
                model(idx, targets=bad)


def test_fresh_init_blocks_are_identities_and_scalars_like_nanochat():
    model = GPT(GPTConfig(vocab_size=50, n_layer=3, n_head=2, n_embd=16))
    idx = torch.randint(0, 50, (1, 5))
    hs = model.hidden_states(idx)
    # zero output projections: every block passes its (x0-mixed) input through
    torch.testing.assert_close(hs[1], 1.0 * hs[0] + 0.1 * hs[0])
    assert model.lm_head.weight.std() < 0.01


def test_sliding_window_limits_context():
    """With window w, the state after a windowed layer at position t ignores tokens before t - w."""
    model = make_model(seed=1, n_layer=2, window_pattern="SL", short_window=2, x0_residual=False,
                       value_embeds=False)
    assert [model.config.window(l) for l in range(2)] == [2, -1]
    idx = tokens(model, B=1, T=8)
    other = idx.clone()
    other[0, 2] = (idx[0, 2] + 1) % 61
    h1a, h1b = model.hidden_states(idx)[1], model.hidden_states(other)[1]
    changed = [not torch.allclose(h1a[0, t], h1b[0, t]) for t in range(8)]
    assert changed == [False, False, True, True, True, False, False, False]


def test_gqa_and_value_embedding_layout():
    model = make_model(n_layer=5, n_head=4, n_kv_head=2, n_embd=16)
    assert model.blocks[0].attn.c_k.weight.shape == (2 * 4, 16)  # kv heads * head dim
    assert [model.config.has_ve(l) for l in range(5)] == [True, False, True, False, True]  # last layer has VE
    assert model.value_embeds.shape == (3, 61, 8)
    assert model.ve_slot == [0, -1, 1, -1, 2]
    plain = GPT(GPTConfig(vocab_size=61, n_layer=5, n_head=4, n_kv_head=2, n_embd=16, x0_residual=False,
                          value_embeds=False))
    names = {n for n, _ in plain.named_parameters()}
    assert not {"value_embeds", "resid_lambdas", "x0_lambdas"} & names
    assert model(tokens(model)).shape == plain(tokens(plain)).shape


def test_x0_and_value_embeddings_change_the_function():
    idx = None
    outs = []
    for x0, ve in [(True, True), (False, True), (True, False)]:
        m = make_model(seed=2, x0_residual=x0, value_embeds=ve)
        idx = tokens(m) if idx is None else idx
        outs.append(m(idx))
    assert not torch.allclose(outs[0], outs[1]) and not torch.allclose(outs[0], outs[2])


# ---------------------------------------------------------------- attention masks (docs/records/2026-11-26-gpu-h100.md)
def test_additive_window_mask_is_the_naive_visibility_rule():
    """additive_mask(window_mask(...)): 0 exactly where query i (at position q_start + i) may see key j by the
    definition (j <= position, position - j <= w for a window w >= 0), -inf elsewhere, in the query's dtype."""
    from snlp.model.ops import additive_mask, window_mask

    for w, T, S, start in [(-1, 5, 5, 0), (2, 6, 6, 0), (2, 3, 7, 4), (0, 4, 4, 0), (9, 4, 4, 0)]:
        m = additive_mask(window_mask(w, T, S, start, "cpu"), torch.bfloat16)
        assert m.dtype == torch.bfloat16 and m.shape == (T, S)
        for i in range(T):
            for j in range(S):
                p = start + i
                visible = j <= p and (w < 0 or p - j <= w)
                assert m[i, j].item() == (0.0 if visible else float("-inf")), (w, T, S, start, i, j)


def test_sequential_forward_builds_each_window_mask_once_and_sdpa_gets_no_bool_mask():
    """A boolean attn_mask makes SDPA convert it to a float mask of the same shape on every call (scalar_tensor x 2 +
    where), and the mask itself was rebuilt by every windowed layer. Now every windowed layer of a forward receives
    the same additive float mask object (one per distinct window), and the logits are those of the same layers
    with a fresh boolean mask per layer (SDPA's own conversion: the values are identical)."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from snlp.model.ops import window_mask

    class Record(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.masks, self.causal = [], 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                if kwargs.get("attn_mask") is not None:
                    self.masks.append(kwargs["attn_mask"])
                self.causal += bool(kwargs.get("is_causal"))
            return func(*args, **kwargs)

    model = make_model(seed=3, n_layer=6, window_pattern="SSL", short_window=3)  # windows 3, 3, -1, 3, 3, -1
    idx = tokens(model, B=2, T=9)
    with torch.no_grad(), Record() as rec:
        out = model(idx)
    assert len(rec.masks) == 4 and rec.causal == 2
    assert all(m.dtype == torch.float64 for m in rec.masks)
    assert len({id(m) for m in rec.masks}) == 1  # one mask for the one short window, built once

    def bool_mask_attend(q, k, v, windows=-1, q_start=0, masks=None):  # the old path: a bool mask per call
        T, S = q.shape[-2], k.shape[-2]
        if windows < 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[-3] != k.shape[-3])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(windows, T, S, 0, q.device),
                                              enable_gqa=q.shape[-3] != k.shape[-3])

    import snlp.model.gpt as gpt

    orig, gpt.attend = gpt.attend, bool_mask_attend
    try:
        with torch.no_grad():
            ref = model(idx)
    finally:
        gpt.attend = orig
    assert torch.equal(out, ref)


def test_a_loss_over_no_target_is_refused_not_nan():
    """forward(idx, targets) is the mean CE over the targets that are not -1; with every target -1 it is 0/0, and
    F.cross_entropy (the reference below) returns NaN without a word, which a loop then stepped on or logged as the
    loss. Refused in one line where the targets are host memory (no sync); a target outside [0, V) other than -1 is
    named too (cross_entropy raised an IndexError about 'Target -2'); one real target gives its CE."""
    model = make_model()
    idx = tokens(model, B=2, T=6)
    none = torch.full_like(idx, -1)
    with torch.no_grad():
        assert torch.isnan(torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), none.flatten(),
                                                             ignore_index=-1))
        with pytest.raises(ValueError, match=r"targets of shape \(2, 6\) are all -1 \(ignored\)"):
            model(idx, targets=none)
        for bad in (-2, model.config.vocab_size):
            y = idx.clone()
            y[1, 3] = bad
            with pytest.raises(ValueError, match=rf"targets must be -1 \(ignored\) or lie in \[0, "
                                                 rf"{model.config.vocab_size}\), got range \[{min(bad, 0)}"):
                model(idx, targets=y)
        one = none.clone()
        one[1, 4] = idx[1, 5]
        want = -torch.log_softmax(model(idx)[1, 4].double(), -1)[idx[1, 5]]
        assert abs(float(model(idx, targets=one)) - float(want)) < 1e-5


def test_uint8_targets_are_read_as_the_loss_reads_them():
    """uint8 targets (an integer dtype forward takes) are classes 0..255 to the loss, which reads them as long; the
    target check compared them with -1, which a uint8 tensor holds as 255: targets all 255 were refused as 'all -1'
    on a 300-token vocabulary, where 255 is a token, and a 255 past a smaller vocabulary escaped the range check to
    fail inside cross_entropy. Reference: the CE of the same targets as long, and a naive log-softmax in fp64."""
    model = make_model(vocab_size=300)
    idx = tokens(model, B=2, T=5)
    y8 = torch.full_like(idx, 255, dtype=torch.uint8)
    with torch.no_grad():
        got = float(model(idx, targets=y8))
        assert got == float(model(idx, targets=y8.long()))
        want = -torch.log_softmax(model(idx).double(), -1)[..., 255].mean()
        assert abs(got - float(want)) < 1e-9
        small = make_model(vocab_size=61)
        with pytest.raises(ValueError, match=r"lie in \[0, 61\), got range \[3, 255\]"):
            small(idx % 61, targets=torch.tensor([[3] * 5, [255] * 5], dtype=torch.uint8))

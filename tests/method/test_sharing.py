"""One set of weights for drafter and verifier (snlp.method.sharing): a shared runner gives
the copied runner's logits, reads the model's own parameter storage, follows in-place updates without a
refresh, re-homes after the parameters get new storage, and refuses what it cannot share."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_model, tokens

from snlp import bind, load, parallel_forward, save_checkpoint, sequential_generate, speculative_generate
from snlp.io.hf import config_from_hf
from snlp.method.sharing import shares_storage, shared_tensors
from snlp.model.gpt import GPT

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = dict(mlp_act="swiglu", norm_weights=True, qkv_bias=True, qk_norm="weighted", x0_residual=False,
             value_embeds=False, softcap=0.0)


def _model(**kw):
    return make_model(seed=11, n_layer=5, **kw)


@pytest.mark.parametrize("cfg", [{}, {"x0_residual": False}, LLAMA], ids=["nanochat", "no-x0", "llama-like"])
def test_shared_runner_equals_the_copied_runner_and_shares_storage(cfg):
    try:
        m = _model(**cfg)
    except TypeError as e:  # a switch this GPTConfig does not have: the test must say so, not pass silently
        pytest.fail(f"config switch missing: {e}")
    idx = tokens(m, T=9)
    with torch.no_grad():
        want = bind(m, "4xF1-h0-K1")(idx)
        ref = m(idx)
        shared = bind(m, "4xF1-h0-K1", share_weights=True)
        got = shared(idx)
        after = m(idx)  # the model itself is unchanged by the move
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(after, ref, rtol=0, atol=0)
    assert shares_storage(m, shared.weights)
    assert m.blocks[1].attn.c_q.weight.data_ptr() == shared.weights.qkv[0].data_ptr()


def test_in_place_updates_reach_the_shared_matrices_and_refresh_copies_none_of_them():
    m = _model()
    idx = tokens(m, T=7)
    runner = bind(m, "4xF1-h0-K1", share_weights=True)
    ptrs = [t.data_ptr() for t in (runner.weights.qkv, runner.weights.attn_out, runner.weights.fc, runner.weights.proj)]
    opt = torch.optim.SGD(m.parameters(), lr=0.1)  # every parameter, the value-embedding gates included
    m(idx).square().mean().backward()
    assert any(b.attn.ve_gate is not None and b.attn.ve_gate.weight.grad.abs().max() > 0 for b in m.blocks[1:])
    opt.step()  # in place: the homes see it, no refresh
    with torch.no_grad():
        torch.testing.assert_close(runner(idx), bind(m, "4xF1-h0-K1")(idx), rtol=1e-10, atol=1e-10)
        m.load_state_dict({k: v * 1.01 for k, v in m.state_dict().items()})  # copy_ in place, gates too
        torch.testing.assert_close(runner(idx), bind(m, "4xF1-h0-K1")(idx), rtol=1e-10, atol=1e-10)  # unrefreshed
        runner.refresh()  # takes fresh views, copies nothing
        assert ptrs == [t.data_ptr() for t in (runner.weights.qkv, runner.weights.attn_out, runner.weights.fc,
                                              runner.weights.proj)]
        torch.testing.assert_close(runner(idx), bind(m, "4xF1-h0-K1")(idx), rtol=1e-10, atol=1e-10)
        m.to(torch.float32)  # new storage for every parameter: the runner is stale until refresh
        assert not shares_storage(m, runner.weights)
        runner.refresh()
        assert shares_storage(m, runner.weights)
        torch.testing.assert_close(runner(idx.clone()), bind(m, "4xF1-h0-K1")(idx), rtol=1e-5, atol=1e-5)


def test_shared_parameters_save_and_load(tmp_path):
    m = _model().float()  # checkpoints load in fp32
    bind(m, "4xF1-h0-K1", share_weights=True)
    back, _ = load(save_checkpoint(tmp_path / "ck", m))
    for (k, a), (_, b) in zip(m.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)


def test_speculative_decoding_with_shared_weights_is_exact():
    m = _model()
    prompt = tokens(m, B=1, T=5)[0].tolist()
    seq = sequential_generate(m, prompt, max_new_tokens=12)
    spec = speculative_generate(m, prompt, "4xF1-h0-K1", block=3, max_new_tokens=12, share_weights=True)
    assert spec.tokens == seq.tokens


def test_what_cannot_be_shared_is_refused():
    m = _model()
    with pytest.raises(ValueError, match="M = 1"):
        bind(m, "2xF2-h0-K1", share_weights=True)
    with pytest.raises(ValueError, match="mHC"):
        bind(make_model(seed=1, n_layer=4, hc_streams=2, x0_residual=False), "2xF1-h0-K1", share_weights=True)


def _fresh(m, plan, idx):
    """The outside reference: an unshared runner bound now, from the model's current parameters."""
    return bind(m, plan)(idx)


def _hf_model(family: str, seed: int = 3) -> GPT:
    """A random fp64 model of a converted transformers config (Llama: norm weights, SwiGLU; Qwen2: q/k/v biases;
    Qwen3: per-head q/k norm weights), every parameter random (not the identity init of norms)."""
    import transformers

    C = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    cfg = config_from_hf(C[family](vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    m = GPT(cfg)
    m.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return m.double().eval()


FAMILIES = {"nanochat-ve": lambda: _model(), "nanochat-no-x0": lambda: _model(x0_residual=False),
            "llama": lambda: _hf_model("llama"), "qwen2": lambda: _hf_model("qwen2"),
            "qwen3": lambda: _hf_model("qwen3")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_tensor_a_shared_runner_reads_follows_an_in_place_update_of_every_parameter(family):
    """Two shared runners over different suffixes, then p.add_(noise) for EVERY parameter of
    the model and no refresh: both equal a fresh unshared bind (fp64), and every tensor they read (projections,
    biases, norm weights, q/k norms, value-embedding gates, x0 scalars) is the model's own storage."""
    m = FAMILIES[family]()
    idx = tokens(m, T=8)
    plans = ("4xF1-h0-K1", "2xF1-h0-K1", "3xF1-h0-K3")  # suffixes of 4, 2 and 3 layers: overlapping, different
    runners = [bind(m, p, share_weights=True) for p in plans]
    for r in runners:
        assert shares_storage(m, r.weights), r.plan
    fields = {k for r in runners for k, _, _ in shared_tensors(m, r.weights)}
    cfg = m.config
    want = {"qkv", "attn_out", "fc", "proj"} | ({"qkv_bias"} if cfg.qkv_bias else set()) \
        | ({"attn_in", "mlp_in"} if cfg.norm_weights else set()) \
        | ({"q_norm", "k_norm"} if cfg.qk_norm == "weighted" else set()) \
        | ({"ve_gate"} if cfg.value_embeds else set()) | ({"alpha", "beta"} if cfg.x0_residual else set())
    assert fields == want
    floating = {f.name for r in runners for f in dataclasses.fields(r.weights)
                if isinstance(getattr(r.weights, f.name), torch.Tensor) and getattr(r.weights, f.name).is_floating_point()}
    assert floating == want  # nothing the chunk forward multiplies by is left out of the check
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2)
        for r in runners:  # no refresh
            torch.testing.assert_close(r(idx), _fresh(m, r.plan, idx), rtol=1e-10, atol=1e-10, msg=str(r.plan))


@pytest.mark.parametrize("plan", ["4xF1-h0-K2-diag-subset:1.2", "4xF1-h0-K2-diag:vjp-subset:1.3"])
def test_a_diag_subset_on_shared_weights_follows_a_data_edit(plan):
    """An edit through `.data` moves no version counter, so the runner is not rebuilt; shared weights follow it
    through their views (bind's docstring). The DiagN probe pass of a subset ran on a gathered copy of the subset's
    weights cached on the weight set, so it kept the old values: Δlogit 6.7 against a fresh solve. Both the plain
    and the inference-mode call equal a fresh unshared parallel_forward of the edited model (fp64)."""
    m = _model()
    idx = tokens(m, T=6)
    r = bind(m, plan, share_weights=True)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            r(idx)  # the probe weights of the subset exist now
            m.blocks[2].mlp.c_fc.weight.data.mul_(1.5)  # layer 2 is chunk 1 of the 4-layer suffix: in the subset
            want = parallel_forward(m, idx, plan)
            torch.testing.assert_close(r(idx), want, rtol=1e-9, atol=1e-9)


def test_two_shared_runners_over_different_suffixes_follow_an_optimizer_step():
    """The second shared bind over another suffix must not un-share the first (it used to
    re-home the overlapping layers into a new stack: the first runner then read stale weights)."""
    m = _model()
    idx = tokens(m, T=7)
    a = bind(m, "4xF1-h0-K1", share_weights=True)
    b = bind(m, "2xF1-h0-K1", share_weights=True)
    assert shares_storage(m, a.weights) and shares_storage(m, b.weights)
    assert a.weights.qkv[2].data_ptr() == b.weights.qkv[0].data_ptr()  # layer 3: one copy for both
    opt = torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1)
    for _ in range(2):
        opt.zero_grad()
        m(idx).square().mean().backward()
        opt.step()
    with torch.no_grad():
        for r in (a, b):
            torch.testing.assert_close(r(idx), _fresh(m, r.plan, idx), rtol=1e-10, atol=1e-10, msg=str(r.plan))
    a.refresh()  # refreshing one runner must not un-share the other (it used to re-home its layers again)
    assert shares_storage(m, a.weights) and shares_storage(m, b.weights)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0.9)
        for r in (a, b):
            torch.testing.assert_close(r(idx), _fresh(m, r.plan, idx), rtol=1e-10, atol=1e-10, msg=str(r.plan))


def test_shares_storage_checks_every_layer_and_every_tensor():
    """A parameter of the LAST layer (or a norm/gate tensor) given new storage makes shares_storage False (it used
    to look at the first layer's c_q only); refresh re-homes it and shares again, and the other shared runner sees
    that it must refresh too."""
    m = make_model(seed=2, n_layer=5, **LLAMA)
    a, b = bind(m, "4xF1-h0-K1", share_weights=True), bind(m, "2xF1-h0-K1", share_weights=True)
    for p in (m.blocks[4].mlp.c_proj.weight, m.blocks[3].ln_mlp, m.blocks[4].attn.k_norm, m.blocks[2].attn.c_v.bias):
        with torch.no_grad():
            p.data = p.data.clone()  # new storage, same values
        assert not shares_storage(m, a.weights)
        a.refresh()
        assert shares_storage(m, a.weights)
        assert not shares_storage(m, b.weights)
        b.refresh()
        assert shares_storage(m, b.weights) and shares_storage(m, a.weights)


def test_binding_shared_under_inference_mode_leaves_the_model_trainable():
    """The homes the parameters move into are normal tensors even when the bind runs under inference mode (an
    inference tensor cannot be saved for backward: the model could no longer be trained)."""
    m = _model()
    idx = tokens(m, T=5)
    with torch.inference_mode():
        r = bind(m, "2xF1-h0-K1", share_weights=True)
    assert shares_storage(m, r.weights) and not any(p.is_inference() for p in m.parameters())
    m(idx).square().mean().backward()
    assert all(p.grad is not None for p in m.blocks[-1].parameters())


def test_sharing_refuses_inference_tensors_and_parametrized_weights_and_leaves_the_model_working():
    """A model whose parameters are inference tensors (built or loaded under inference_mode) raised deep inside the
    re-homing and left the model unusable; a LoRA drafter's parametrized .weight is computed, so sharing it shared
    nothing (a stale runner, 0.9 off). Both are refused up front and the model still decodes (fp64)."""
    from snlp import sequential_generate
    from snlp.method.drafter import make_drafter

    with torch.inference_mode():
        m = make_model(seed=4, n_layer=4)
    before = sequential_generate(m, [1, 2, 3], max_new_tokens=4).tokens
    with pytest.raises(ValueError, match="inference tensors"):
        bind(m, "2xF1-h0-K1", share_weights=True)
    assert sequential_generate(m, [1, 2, 3], max_new_tokens=4).tokens == before
    d = make_drafter(make_model(seed=5, n_layer=4, n_kv_head=2, n_head=2), "2xF1-h0-K1", rank=1)
    with pytest.raises(ValueError, match="parametrization"):
        bind(d.model, "2xF1-h0-K1", share_weights=True)

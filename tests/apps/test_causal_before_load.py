"""A -causal plan on a model whose suffix has no sliding window changes nothing (Plan.check_model refuses it): for a
.gguf file or a transformers directory the refusal comes from its header / config.json, before any weight loads;
and a -causal plan whose windows all span the run's longest sequence is warned about (Plan.causal_idle)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import transformers

import snlp.eval.harness
import snlp.io.hf
import snlp.train.adapt
from snlp.apps.cli import main
from snlp.apps.common import check_plans_fit
from snlp.method.plan import Plan

gguf = pytest.importorskip("gguf")

L, D, F, V = 4, 8, 16, 16


def tiny_gguf(path):
    """A complete 4-layer dense Llama GGUF (zeros; what check_gguf accepts): header and tensors, no tokenizer."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L)
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    shapes = {"attn_norm": (D,), "ffn_norm": (D,), "attn_q": (D, D), "attn_k": (D // 2, D), "attn_v": (D // 2, D),
              "attn_output": (D, D), "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}
    w.add_tensor("token_embd.weight", np.zeros((V, D), np.float32))
    w.add_tensor("output_norm.weight", np.zeros(D, np.float32))
    for layer in range(L):
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{layer}.{name}.weight", np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def mistral_dir(path, sliding_window):
    transformers.MistralConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                               num_attention_heads=2, num_key_value_heads=1, sliding_window=sliding_window,
                               architectures=["MistralForCausalLM"]).save_pretrained(path)
    return path


@pytest.fixture
def no_load(monkeypatch):
    """Any model load fails the test: the refusal must come before it."""
    def loaded(*a, **k):
        raise AssertionError("the model loaded before the refusal")

    # the modules that bind from_hf at import are imported at the top and patched here: one first imported under
    # the patch kept the fake for every later test of its process (a later `snlp adapt` test failed with this)
    for mod in (snlp.io.hf, snlp.train.adapt, snlp.eval.harness):
        monkeypatch.setattr(mod, "from_hf", loaded)
    monkeypatch.setattr(snlp.io.hf, "_load_hf", loaded)


def test_check_plans_fit_reads_a_gguf_header_and_a_transformers_config(tmp_path, no_load):
    g = tiny_gguf(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="layers 2..3 have none .* changes nothing, drop -causal"):
        check_plans_fit(str(g), ["2xF1-h0-K1-causal"], transformers_ok=True)
    with pytest.raises(ValueError, match="only L = 4"):  # its depth from the header too
        check_plans_fit(str(g), ["5xF1-h0-K1"], transformers_ok=True)
    check_plans_fit(str(g), ["2xF1-h0-K1"], transformers_ok=True)
    full = mistral_dir(tmp_path / "full", None)
    with pytest.raises(ValueError, match="changes nothing, drop -causal"):
        check_plans_fit(str(full), ["2xF1-h0-K1-causal"], transformers_ok=True)
    slid = mistral_dir(tmp_path / "slid", 4)  # windows w = 3: keys i - j <= 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_plans_fit(str(slid), ["2xF1-h0-K1-causal"], transformers_ok=True)  # T unknown: no warning
        check_plans_fit(str(slid), ["2xF1-h0-K1-causal"], transformers_ok=True, longest=5)  # 5 - 1 > 3: it bites
    with pytest.warns(UserWarning, match="at most 4 tokens: it changes nothing here"):
        check_plans_fit(str(slid), ["2xF1-h0-K1-causal"], transformers_ok=True, longest=4)


@pytest.mark.parametrize("argv", [
    ["adapt", "{src}", "--plan", "2xF1-h0-K1-causal", "--out", "{tmp}/ad"],
    ["eval", "{src}", "--harness", "lambada_openai", "--plans", "2xF1-h0-K1-causal"],
    ["bench", "--suite", "decode", "--ckpt", "{src}", "--suite-plans", "2xF1-h0-K1-causal"],
])
@pytest.mark.parametrize("kind", ["gguf", "transformers"])
def test_commands_refuse_a_causal_plan_before_the_model_loads(tmp_path, no_load, capsys, argv, kind):
    src = tiny_gguf(tmp_path / "m.gguf") if kind == "gguf" else mistral_dir(tmp_path / "hf", None)
    rc = main([a.format(src=src, tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and "changes nothing, drop -causal" in err and "loaded before" not in err


def test_causal_idle_is_the_window_law():
    """causal_idle says 'nothing changes' exactly where every windowed suffix layer keeps all T keys (w >= T - 1)."""
    from conftest import make_model

    m = make_model()  # windows in layers 0, 2, 4 of 6 (pattern "SL"), sequence_len // 2 wide
    w = m.config.window(4)
    p = Plan.parse("3xF1-h0-K1-causal")
    assert p.causal_idle(m.config, w + 1) and p.causal_idle(m.config, 1)
    assert p.causal_idle(m.config, w + 2) is None
    assert Plan.parse("3xF1-h0-K1").causal_idle(m.config, 1) is None

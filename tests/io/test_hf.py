"""Hugging Face models (snlp.hf): transformers is the reference. Random tiny Llama / Qwen2 / Mistral / Qwen3
models built with transformers (GQA, biases, Qwen3 q/k norm, sliding windows, tied and untied embeddings,
llama3 RoPE scaling) against snlp's conversion: sequential logits, fused plans (K >= C exact, M = 1 equal to
transformers), KV-cached greedy and speculative decoding vs transformers' generate, export round trip,
checkpoint round trip, CLI convert/export, and the errors. The real SmolLM2-135M-Instruct tests are in
tests/io/test_smollm2.py."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")  # a dev dependency: installed in CI, so this never skips there

from snlp import GPT, GPTConfig, Plan, fused_sequential, load, save_checkpoint, solve  # noqa: E402
from snlp.method.fusion import build_chunk_weights, chunk_forward  # noqa: E402
from snlp.decode import sequential_generate, speculative_generate  # noqa: E402
from snlp.io.hf import config_from_hf, export_hf, from_hf  # noqa: E402
from snlp.io.tokenizer import Tokenizer  # noqa: E402
from conftest import word_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

V = 97
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
FAMILIES = {
    "llama": dict(),
    "llama-tied-llama3": dict(tie_word_embeddings=True, rope_parameters=LLAMA3),
    "qwen2-window": dict(use_sliding_window=True, sliding_window=5, max_window_layers=2),
    "qwen2-tied": dict(tie_word_embeddings=True),
    "mistral-window": dict(sliding_window=6),
    "qwen3-headdim": dict(head_dim=32),
}


def hf_tiny(family: str, seed: int = 0, dtype=torch.float32, layers: int = 4, **kw):
    """A random transformers model of `family` (hidden 64, 4 layers, 4 heads / 2 KV heads) whose norm
    weights and biases are random too (not the identity init), in eval mode."""
    fam = family.split("-")[0]
    C = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
         "mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config}[fam]
    base = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")
    base.update(FAMILIES.get(family, {}))
    base.update(kw)
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(C(**base))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return m.to(dtype).eval()


def ids(B=2, T=14, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sequential_logits_equal_transformers(family):
    hf = hf_tiny(family)
    model, _ = from_hf(hf)
    x = ids()
    with torch.no_grad():
        ref, out = hf(x).logits, model(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # fp64: transformers' RMSNorm computes in fp32 even for fp64 models, so the agreement is ~1e-7, not 1e-10
    hf64 = hf.double()
    m64, _ = from_hf(hf64)
    with torch.no_grad():
        torch.testing.assert_close(m64(x), hf64(x).logits, atol=1e-6, rtol=0)  # both fp64 logits


def test_windows_and_rope_are_real():
    """The switches matter: a different window or rope scaling changes transformers' logits (so the
    equality above is not vacuous)."""
    x = ids(T=20)
    with torch.no_grad():
        a = hf_tiny("mistral-window")(x).logits
        b = hf_tiny("mistral-window", sliding_window=None)(x).logits
        c = hf_tiny("llama-tied-llama3")(x).logits
        d = hf_tiny("llama-tied-llama3", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})(x).logits
    assert (a - b).abs().max() > 1e-3 and (c - d).abs().max() > 1e-3


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_plans_exact(family):
    """K >= C reproduces the fused model run sequentially (fp64, ~1e-10); M = 1 with K >= C equals transformers."""
    hf = hf_tiny(family, dtype=torch.float64)
    model, _ = from_hf(hf)
    x = ids()
    with torch.no_grad():
        ref = hf(x).logits
        for text in ("4xF1-h0-K4", "2xF2-h0-K2", "1xF4-h0-K1", "3xF1-fwd-K3", "2xF1-h0-K2-idn"):
            plan = Plan.parse(text, 4)
            hid = solve(model, x, plan).hidden
            torch.testing.assert_close(hid, fused_sequential(model, x, plan).hidden, atol=1e-10, rtol=0)
            if plan.fuse == 1:
                torch.testing.assert_close(model.head(hid), ref, atol=1e-6, rtol=0)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["llama", "qwen2", "mistral", "qwen3"]), tied=st.booleans(),
       window=st.sampled_from([None, 3, 7]), fuse=st.sampled_from([1, 2]), seed=st.integers(0, 99))
def test_fused_chunk_m1_is_the_layer(family, tied, window, fuse, seed):
    """One fused chunk (norm weights folded into q/k/v and gate/up) equals the layers it fuses: for M = 1 its
    output is transformers' decoder layer output exactly (up to rounding), for every family and option."""
    kw = dict(tie_word_embeddings=tied)
    if family == "mistral":
        kw["sliding_window"] = window
    elif family == "qwen2" and window:
        kw.update(use_sliding_window=True, sliding_window=window, max_window_layers=1)
    hf = hf_tiny(family, seed=seed, dtype=torch.float64, layers=2, **kw)
    model, _ = from_hf(hf)
    x = ids(B=1, T=10, seed=seed)
    ctx = model.embed(x)
    w = build_chunk_weights(model, 0, 2 // fuse, fuse)
    with torch.no_grad():
        h = ctx.x0
        for c in range(w.chunks):  # the fused model run sequentially
            h = chunk_forward(w.chunk(c), h.unsqueeze(0), ctx)[0]
        ref = hf(x, output_hidden_states=True).hidden_states
        if fuse == 1:  # transformers' hidden_states[-1] has the final norm applied; compare the logits instead
            torch.testing.assert_close(model.head(h), hf(x).logits, atol=1e-6, rtol=0)
            h1 = chunk_forward(w.chunk(0), ctx.x0.unsqueeze(0), ctx)[0]
            torch.testing.assert_close(h1, ref[1], atol=1e-6, rtol=0)


def test_folding_is_exact_not_averaged():
    """Folding each layer's norm weight into its own projection is the layer; averaging the weights over a
    chunk (the paper's reference code) is not: the M = 2 chunk differs from the M = 2 chunk built from the
    averaged weights."""
    hf = hf_tiny("llama", dtype=torch.float64, layers=2)
    model, _ = from_hf(hf)
    x = ids(B=1)
    ctx = model.embed(x)
    with torch.no_grad():
        exact = chunk_forward(build_chunk_weights(model, 0, 1, 2), ctx.x0.unsqueeze(0), ctx)
        avg = (model.blocks[0].ln_attn + model.blocks[1].ln_attn) / 2
        for b in model.blocks:
            b.ln_attn.copy_(avg)
        averaged = chunk_forward(build_chunk_weights(model, 0, 1, 2), ctx.x0.unsqueeze(0), ctx)
    assert (exact - averaged).norm() / (exact - ctx.x0).norm() > 1e-2


@pytest.mark.parametrize("family", ["llama-tied-llama3", "qwen2-window", "mistral-window", "qwen3-headdim"])
def test_greedy_decoding_equals_transformers_generate(family):
    """KV-cached sequential greedy decoding and self-speculative decoding both equal transformers'
    generate(do_sample=False) token for token."""
    hf = hf_tiny(family)
    model, _ = from_hf(hf)
    prompt = ids(B=1, T=6, seed=3)
    n = 16
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0)[0, 6:].tolist()
    assert sequential_generate(model, prompt[0].tolist(), max_new_tokens=n).tokens == ref
    for plan in ("2xF1-h0-K1", "1xF2-h0-K1", "4xF1-fwd-K2"):
        assert speculative_generate(model, prompt[0].tolist(), plan, block=4, max_new_tokens=n).tokens == ref


@pytest.mark.parametrize("family", ["llama-tied-llama3", "qwen2-window", "mistral-window", "qwen3-headdim"])
def test_export_round_trip(family, tmp_path):
    """export -> transformers' from_pretrained gives the same logits and the source's own tensors (norm weights
    included); the exported directory converts back to the same model."""
    hf = hf_tiny(family)
    model, _ = from_hf(hf)
    out = export_hf(model, tmp_path / "exp")
    re = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    src = hf.state_dict()
    assert all(torch.equal(p, src[n]) for n, p in re.state_dict().items() if "rotary" not in n)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(re(x).logits, hf(x).logits, atol=1e-4, rtol=1e-4)
        back, _ = from_hf(str(out))
        torch.testing.assert_close(back(x), hf(x).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama-tied-llama3", "qwen2-tied", "llama"])
def test_export_keeps_the_embedding_tied_as_the_source_had_it(family, tmp_path):
    """A tied model (SmolLM2, Qwen2-0.5B) was exported with an untied copy of the head (vocab x width more
    parameters: 134.5M -> 162.8M for SmolLM2-135M), and converting the export back gave an untied model. The
    reference is the transformers source model: same tie flag, same parameter count, same logits."""
    hf = hf_tiny(family)
    model, _ = from_hf(hf)
    out = export_hf(model, tmp_path / "exp")
    re = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert re.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert re.num_parameters() == hf.num_parameters()
    assert (re.lm_head.weight is re.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    back, _ = from_hf(str(out))
    assert back.config.tie_embeddings == model.config.tie_embeddings and back.num_params() == model.num_params()
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(re(x).logits, hf(x).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama-tied-llama3", "qwen3-headdim", "qwen2-window"])
def test_checkpoint_round_trip(family, tmp_path):
    hf = hf_tiny(family)
    model, _ = from_hf(hf)
    save_checkpoint(tmp_path / "ck", model)
    back, _ = load(tmp_path / "ck")
    assert back.config == model.config
    assert back.lm_head.weight is back.wte.weight if model.config.tie_embeddings else True
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(back(x), model(x), atol=0, rtol=0)


def _tiny_dir(tmp_path, family="llama"):
    """A transformers directory (config.json + safetensors + tokenizer) of a tiny random model."""
    hf = hf_tiny(family)
    d = tmp_path / f"hf-{family}"
    hf.save_pretrained(str(d))
    word_tokenizer(V).save_pretrained(str(d))
    return hf, d


def test_from_dir_tokenizer_and_checkpoint(tmp_path):
    hf, d = _tiny_dir(tmp_path)
    model, tok = from_hf(str(d))
    assert tok.foreign and tok.bos_id == V - 3 and tok.eos_id == V - 2
    assert tok.encode("t1 t5") == [1, 5]
    assert tok.apply_chat_template([{"role": "user", "content": "t3"}]) == "<s>t3</s><s>"
    save_checkpoint(tmp_path / "ck", model, tok)
    m2, t2 = load(tmp_path / "ck")
    assert t2.foreign and t2.meta == tok.meta and t2.encode("t1 t5") == [1, 5]
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(m2(x), hf(x).logits, atol=1e-5, rtol=1e-5)


def test_convert_of_an_snlp_checkpoint_says_so_in_one_line(tmp_path, capsys):
    """An snlp checkpoint has config.json and model.safetensors like a transformers directory: `snlp convert` of it
    (and from_hf) answer that it is one already, not transformers' "Unrecognized model" about its config."""
    from snlp.apps.cli import main

    hf, d = _tiny_dir(tmp_path)
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 0  # a transformers directory converts
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "ck"), "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert "is already an snlp checkpoint" in err and "snlp.load" in err and "Unrecognized" not in err, err
    assert err.count("\n") == 1 and not (tmp_path / "again").exists()
    with pytest.raises(ValueError, match="is already an snlp checkpoint"):
        from_hf(str(tmp_path / "ck"))
    for text, says in (('{"model_type": "llama",', "not valid JSON"), ("42", "expected a JSON object")):
        (d / "config.json").write_text(text)  # a config.json that tells neither kind: corrupt, not "snlp"
        assert main(["convert", str(d), "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err
        assert "corrupt" in err and says in err and "already an snlp" not in err and err.count("\n") == 1, err


def test_cli_convert_export_generate(tmp_path, capsys):
    from snlp.apps.cli import main

    hf, d = _tiny_dir(tmp_path, "mistral-window")
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 0
    model, tok = load(tmp_path / "ck")
    assert tok is not None and model.config.layer_windows == [5] * 4
    assert main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "exp")]) == 0
    re = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exp")).eval()
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(re(x).logits, hf(x).logits, atol=1e-4, rtol=1e-4)
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "exp"))("t1 t2")["input_ids"][-2:] == [1, 2]
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "ck"), "--prompt", "t3", "--chat", "--max-new-tokens", "4"]) == 0
    assert main(["eval", str(tmp_path / "ck"), "--plans", "2xF1-h0-K1", "--data", str(_text(tmp_path)),
                 "--seq-len", "16", "--max-tokens", "64", "--no-emb", "--prompts", "2", "--gen-tokens", "4",
                 "--runs", "1", "--warmup", "0", "--no-progress"]) == 0


def _text(tmp_path):
    f = tmp_path / "text.txt"
    f.write_text("\n\n".join(" ".join(f"t{(i * 7 + j) % 90}" for j in range(300)) for i in range(8)))
    return f


# ------------------------------------------------------------------------------------------------ errors
def test_unsupported_architecture_and_options():
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        config_from_hf(transformers.GPT2Config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="unsupported architecture"):
        from_hf(transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2)))
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        config_from_hf(transformers.LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}))
    with pytest.raises(ValueError, match="attention_bias"):
        config_from_hf(transformers.LlamaConfig(attention_bias=True))
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf(transformers.LlamaConfig(hidden_act="gelu"))
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        GPTConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="linear rope_scaling needs a factor > 0"):
        GPTConfig(rope_scaling={"rope_type": "linear", "factor": 0})


@pytest.mark.parametrize("family,kw", [("mistral", dict(mlp_bias=True, attention_bias=True)),
                                       ("qwen2", dict(mlp_bias=True, attention_bias=True)),
                                       ("qwen3", dict(mlp_bias=True))])
def test_a_bias_flag_the_class_does_not_read_is_no_reason_to_refuse(family, kw, tmp_path):
    """Mistral, Qwen2 and Qwen3 build bias-free MLPs (Mistral bias-free attention, Qwen2 its own q/k/v biases)
    whatever mlp_bias / attention_bias say: transformers runs such a config as without the flag, and snlp refused
    it as biased. Converted now, from an object and a folder, with transformers' logits (fp64); the classes that
    read the flags (Llama's mlp_bias, Llama's and Qwen3's attention_bias) stay refused."""
    hf = hf_tiny(family, layers=2, dtype=torch.float64, **kw)
    assert not any(n.endswith("bias") and ("mlp" in n or "o_proj" in n) for n, _ in hf.named_parameters())
    hf.save_pretrained(str(tmp_path / "m"))
    with torch.no_grad():
        for src in (hf, str(tmp_path / "m")):
            torch.testing.assert_close(from_hf(src)[0](ids()), hf(ids()).logits, atol=1e-6, rtol=0)
    for C, flag in ((transformers.LlamaConfig, "mlp_bias"), (transformers.LlamaConfig, "attention_bias"),
                    (transformers.Qwen3Config, "attention_bias")):
        with pytest.raises(ValueError, match=f"unsupported option {flag}=True"):
            config_from_hf(C(**{flag: True}))


def test_missing_and_corrupt_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file"):
        from_hf(str(tmp_path / "nope.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ValueError, match="GGUF"):
        from_hf(str(bad))
    with pytest.raises(FileNotFoundError, match="missing_dir does not exist"):  # never sent to the hub
        from_hf(str(tmp_path / "missing_dir"))
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="neither a .gguf file nor a directory"):
        from_hf(str(tmp_path / "weights.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_hf(str(tmp_path / "empty"))
    _, d = _tiny_dir(tmp_path)
    (d / "model.safetensors").write_bytes(b"corrupt")
    with pytest.raises(ValueError, match="cannot load the weights"):
        from_hf(str(d))
    with pytest.raises(ValueError, match="transformers model"):
        from_hf(12)


def test_vocab_mismatch(tmp_path):
    hf, d = _tiny_dir(tmp_path)
    small = hf_tiny("llama", vocab_size=50)
    from transformers import AutoTokenizer
    with pytest.raises(ValueError, match="vocab mismatch"):
        from_hf(small, tokenizer=AutoTokenizer.from_pretrained(str(d)))


def test_export_rejects_nanochat_models(tmp_path):
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, sequence_len=16))
    with pytest.raises(ValueError, match="Llama-family models only"):
        export_hf(model, tmp_path / "x")
    # bf16-rounded RoPE tables (older nanochat's) are no transformers rotary: refused even on a Llama-family config
    cfg = config_from_hf(hf_tiny("llama-tied-llama3").config)
    with pytest.raises(ValueError, match="rope_bf16=True"):
        export_hf(GPT(GPTConfig(**{**cfg.to_dict(), "rope_bf16": True})), tmp_path / "y")


def test_config_json_round_trip(tmp_path):
    cfg = config_from_hf(hf_tiny("llama-tied-llama3").config)
    assert GPTConfig(**json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("family", ["llama-tied-llama3", "qwen3-headdim"])
def test_train_init_from_and_freeze_prefix(family, tmp_path):
    """`snlp train --init-from` continues a converted model with its own tokenizer (no BPE training) under
    the IDN regulariser; `--freeze-prefix` (S = L - max(--reg-n)) leaves the embedding and the first S
    layers bit-identical while the suffix moves; the result still exports to transformers."""
    from safetensors.torch import load_file

    from snlp.apps.cli import main

    hf, d = _tiny_dir(tmp_path, family)
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 0
    common = ["train", "--init-from", str(tmp_path / "ck"), "--data", str(_text(tmp_path)), "--cache-dir",
              str(tmp_path / "cache"), "--seq-len", "16", "--batch-size", "2", "--steps", "3", "--eval-every", "100",
              "--eval-batches", "1", "--no-progress", "--device", "cpu", "--optimizer", "adamw", "--matrix-lr", "1e-3",
              "--embedding-lr", "1e-3", "--reg", "idn", "--reg-n", "2"]
    assert main([*common, "--out", str(tmp_path / "ft"), "--freeze-prefix"]) == 0
    before, after = load_file(str(tmp_path / "ck" / "model.safetensors")), load_file(str(tmp_path / "ft" / "model.safetensors"))
    assert before.keys() == after.keys()
    for k in before:
        same = torch.equal(before[k], after[k])
        if k == "wte.weight" or k.startswith(("blocks.0.", "blocks.1.")):
            assert same, k  # frozen prefix S = 4 - 2
        elif k.startswith(("blocks.2.", "blocks.3.")) and k.endswith("c_fc.weight"):
            assert not same, k
    model, tok = load(tmp_path / "ft")
    assert tok.foreign and tok.vocab_size == V and not list(tmp_path.glob("cache/*bpe*"))  # no tokenizer trained
    assert main([*common, "--out", str(tmp_path / "ft2")]) == 0  # no freeze: everything trains
    assert not torch.equal(load_file(str(tmp_path / "ft2" / "model.safetensors"))["wte.weight"], before["wte.weight"])
    export_hf(model, tmp_path / "exp")
    re = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exp")).eval()
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(re(x).logits, model(x), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="freeze-prefix S=9"):
        main_raise = __import__("snlp.train.pretrain", fromlist=["freeze_prefix"]).freeze_prefix
        main_raise(model, 9)


def test_a_converted_run_on_edited_text_is_refused_naming_the_edit_only(tmp_path, capsys):
    """The resume refusal for other tokens named, besides an edit, a run from before snlp's own BPE read quoted
    special-token strings as text; a converted tokenizer's reading never changed, so for it only the edit is named."""
    from snlp.apps.cli import main

    _, d = _tiny_dir(tmp_path, "llama-tied-llama3")
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 0
    text = _text(tmp_path)
    run = tmp_path / "ft"
    assert main(["train", "--init-from", str(tmp_path / "ck"), "--data", str(text), "--cache-dir",
                 str(tmp_path / "cache"), "--seq-len", "16", "--batch-size", "2", "--steps", "3", "--eval-every", "100",
                 "--eval-batches", "1", "--no-progress", "--device", "cpu", "--optimizer", "adamw", "--out", str(run),
                 "--stop-after", "1"]) == 0
    body = text.read_text()
    text.write_text(body[:10] + body[10:14].upper() + body[14:])  # the same size, other text
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "other tokens" in err and "text edited in place?" in err and "special-token" not in err, err


def test_adapt_reads_a_transformers_directory_and_an_snlp_checkpoint(tmp_path):
    """`snlp adapt HF_DIR`: a transformers directory also holds model.safetensors, and was taken for an snlp checkpoint
    ("unknown GPTConfig fields"); both kinds load, with transformers' logits as the reference."""
    from snlp.io.checkpoint import is_snlp_checkpoint
    from snlp.train.adapt import load_base

    hf, d = _tiny_dir(tmp_path)
    assert not is_snlp_checkpoint(d)
    model, tok = load_base(str(d))
    save_checkpoint(tmp_path / "ck", model, tok)
    assert is_snlp_checkpoint(tmp_path / "ck")
    again, _ = load_base(str(tmp_path / "ck"))
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(again(x), model(x), atol=0, rtol=0)


def test_a_transformers_directory_given_as_a_checkpoint_says_so(tmp_path, capsys):
    """`snlp generate HF_DIR` (an export, a downloaded model) said "config.json has unknown GPTConfig fields
    ['architectures', ... 24 names]; was it written by a newer snlp?": it names what the folder is and the command
    that converts it."""
    from snlp.apps.cli import main

    _, d = _tiny_dir(tmp_path)
    with pytest.raises(ValueError, match="is a transformers model directory .*LlamaForCausalLM.*snlp convert"):
        load(d)
    for argv in (["generate", str(d), "--prompt", "a"], ["tune", str(d)], ["bench", "--ckpt", str(d)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "is a transformers model directory (LlamaForCausalLM), not an snlp checkpoint" in err, err


def test_an_snlp_model_given_to_from_hf_says_it_is_converted_already():
    model = GPT(GPTConfig.from_depth(2, head_dim=8, width=16, vocab_size=64, sequence_len=16))
    with pytest.raises(ValueError, match="from_hf was given an snlp GPT: it is already converted"):
        from_hf(model)


def test_a_plan_too_deep_for_a_transformers_directory_is_refused_only_where_one_loads(tmp_path):
    """check_plans_fit reads a transformers config's depth for the commands that take the folder as it is (adapt, eval
    --harness) and leaves the others to `load`, whose error says what the folder is and how to convert it."""
    from snlp.apps.common import check_plans_fit

    _, d = _tiny_dir(tmp_path)
    check_plans_fit(d, ["40xF1-h0-K1"])  # generate, bench, tune...: load's error comes first
    with pytest.raises(ValueError, match="needs a suffix of N = 40"):
        check_plans_fit(d, ["40xF1-h0-K1"], transformers_ok=True)


# ------------------------------------------------------------------------------ the audit of unusual configs
def test_a_model_objects_class_decides_not_its_configs_architectures(tmp_path):
    """`LlamaForCausalLM.from_pretrained(a Mistral folder)` keeps architectures=['MistralForCausalLM'] in its config
    but computes full attention (Llama has no sliding window); from_hf of that object applied Mistral's window and
    its logits were 0.44 off the object's, silently. Likewise a Qwen2 folder with sliding layers loaded as Llama (no
    biases, no windows). The reference is the object the user passed: its own logits."""
    x = ids(T=20)
    for family, kw in (("mistral-window", dict(sliding_window=4)),
                       ("qwen2-window", dict(sliding_window=4, max_window_layers=0))):
        hf_tiny(family, layers=2, **kw).save_pretrained(str(tmp_path / family))
        as_llama = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / family)).eval()
        model, _ = from_hf(as_llama)
        assert model.config.layer_windows is None and not model.config.qkv_bias
        with torch.no_grad():
            torch.testing.assert_close(model(x), as_llama(x).logits, atol=1e-5, rtol=1e-5)


def test_a_model_object_outside_the_four_causal_lm_classes_is_refused_by_its_class_name():
    """A LlamaForSequenceClassification (a Llama config, a score head instead of lm_head) with tied embeddings was
    converted into a language model without a word; a LlamaModel said its weights lack 'model.embed_tokens.weight';
    a Gemma object was named by its model_type ('gemma'). Each is refused in one line naming its class."""
    cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2, pad_token_id=0)
    for m in (transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**cfg, tie_word_embeddings=True)),
              transformers.LlamaModel(transformers.LlamaConfig(**cfg)),
              transformers.AutoModelForCausalLM.from_config(transformers.GemmaConfig(**cfg, head_dim=16))):
        with pytest.raises(ValueError, match=f"unsupported architecture '{type(m).__name__}'") as e:
            from_hf(m)
        assert "\n" not in str(e.value)


def test_export_writes_back_the_sources_generation_defaults_pad_token_and_window_layers(tmp_path):
    """convert -> export dropped the source's generation defaults (do_sample, temperature, top_p: the exported folder's
    generate() decoded greedily where the source sampled), its pad_token_id and the tokenizer's pad token (a batched
    `tok(texts, padding=True)` of the export raised), and wrote max_window_layers=28 beside layer_types that slide from
    layer 1. The reference is the source folder's own files."""
    from snlp.apps.cli import main

    hf = hf_tiny("llama", layers=2, pad_token_id=V - 1)
    hf.generation_config.update(do_sample=True, temperature=0.6, top_p=0.9, pad_token_id=V - 1, eos_token_id=V - 2)
    src = tmp_path / "src"
    hf.save_pretrained(str(src))
    tok = word_tokenizer(V)
    tok.pad_token = "<unk>"
    tok.save_pretrained(str(src))
    assert main(["convert", str(src), "--out", str(tmp_path / "ck")]) == 0
    assert main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "exp")]) == 0
    want, got = (json.loads((d / "generation_config.json").read_text()) for d in (src, tmp_path / "exp"))
    for key in ("do_sample", "temperature", "top_p", "pad_token_id", "eos_token_id"):
        assert got.get(key) == want[key], (key, got.get(key), want[key])
    assert json.loads((tmp_path / "exp" / "config.json").read_text())["pad_token_id"] == V - 1
    re_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "exp"))
    assert re_tok.pad_token == "<unk>"
    batch = re_tok(["t1 t2", "t1 t2 t3 t4"], padding=True)["input_ids"]  # raised: no padding token
    assert len(batch[0]) == len(batch[1]) and V - 1 in batch[0]

    qwen = hf_tiny("qwen2-window", layers=3, sliding_window=4, max_window_layers=1)
    model, _ = from_hf(qwen)
    got = json.loads((export_hf(model, tmp_path / "qwen") / "config.json").read_text())
    for key in ("max_window_layers", "layer_types", "sliding_window", "use_sliding_window"):
        assert got[key] == getattr(qwen.config, key), (key, got[key], getattr(qwen.config, key))


def test_export_writes_back_a_tokenizer_without_bos_its_bos_id_context_length_and_padding_side(tmp_path):
    """A Qwen2.5-like source: its tokenizer names no BOS (snlp separates documents by the EOS), its configs name
    bos_token_id 5, its tokenizer_config model_max_length 64 and padding_side left. convert -> export wrote bos_token_id
    = the EOS id (the export's generate() without inputs started from another token than the source's), dropped
    model_max_length (truncation=True no longer cut at 64) and padded batches on the right (a decoder-only batched
    generate continues from pad tokens). The reference is the source folder read by transformers."""
    from snlp.apps.cli import main
    from transformers import PreTrainedTokenizerFast

    src, exp = tmp_path / "src", tmp_path / "exp"
    hf = hf_tiny("llama", layers=2, bos_token_id=5, eos_token_id=V - 2, pad_token_id=V - 1)
    hf.generation_config = transformers.GenerationConfig(bos_token_id=5, eos_token_id=[V - 2, 7], pad_token_id=V - 1)
    hf.save_pretrained(str(src))
    words = word_tokenizer(V)
    PreTrainedTokenizerFast(tokenizer_object=words.backend_tokenizer, bos_token=None, eos_token="</s>",
                            pad_token="<unk>", chat_template=words.chat_template, model_max_length=64,
                            padding_side="left").save_pretrained(str(src))
    assert main(["convert", str(src), "--out", str(tmp_path / "ck")]) == 0
    assert load(tmp_path / "ck")[1].prompt_ids("") == [5]  # an empty prompt starts where the source's generate() does
    assert main(["export", str(tmp_path / "ck"), "--out", str(exp)]) == 0
    for name in ("config.json", "generation_config.json"):
        want, got = (json.loads((d / name).read_text()) for d in (src, exp))
        assert {k: got.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == {
            k: want.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}, name
    a, b = (transformers.AutoTokenizer.from_pretrained(str(d)) for d in (src, exp))
    assert (b.model_max_length, b.padding_side, b.bos_token) == (a.model_max_length, a.padding_side, a.bos_token)
    texts = ["t1 t2", " ".join(["t3"] * 80)]
    assert b(texts, padding=True, truncation=True)["input_ids"] == a(texts, padding=True, truncation=True)["input_ids"]
    ma, mb = (transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval() for d in (src, exp))
    assert torch.equal(ma.generate(max_new_tokens=4, do_sample=False), mb.generate(max_new_tokens=4, do_sample=False))


def test_export_refuses_an_out_holding_files_it_would_overwrite_or_delete(tmp_path, capsys):
    """`snlp export --out DIR` with the user's tokenizer_config.json, chat_template.jinja or generation_config.json in
    DIR wrote over them, and transformers' save_pretrained deleted a model-00001-of-00002.safetensors it did not
    write, exit 0: refused in one line before the model loads, every file kept. A new folder, an empty one, or one
    holding only hidden entries (a git clone's .git) is written."""
    from snlp.apps.cli import main

    hf, d = _tiny_dir(tmp_path)
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 0
    for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "model-00001-of-00002.safetensors"):
        out = tmp_path / f"out-{name}"
        out.mkdir()
        (out / name).write_text("the user's")
        capsys.readouterr()
        assert main(["export", str(tmp_path / "ck"), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "is not empty" in err and name in err and err.count("\n") == 1, err
        assert [p.name for p in out.iterdir()] == [name] and (out / name).read_text() == "the user's"
    (tmp_path / "clone" / ".git").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "clone", tmp_path / "empty"):
        assert main(["export", str(tmp_path / "ck"), "--out", str(out)]) == 0
        assert (out / "config.json").is_file()


def test_a_torch_compiled_model_object_converts_as_the_model_inside():
    """torch.compile(hf) is an OptimizedModule: its class is none of the four and its state dict prefixes every key
    `_orig_mod.`, so from_hf refused it (after audit51b by the wrapper's class name). Reference: transformers."""
    hf = hf_tiny("qwen2-window")
    model, _ = from_hf(torch.compile(hf, backend="eager"))
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=1e-5)


def test_export_keeps_the_generation_defaults_a_greedy_source_uses_beside_its_ignored_sampling_flags(tmp_path):
    """An older hub generation_config.json sets temperature / top_p without do_sample (generate ignores them: greedy).
    save_pretrained refuses such a config, and the export dropped every default but the pad id with it:
    repetition_penalty, no_repeat_ngram_size and max_new_tokens too, so the export's generate() differed from the
    source's. Reference: transformers' generate() of the source folder."""
    from snlp.apps.cli import main

    src = tmp_path / "src"
    hf_tiny("llama", layers=2).save_pretrained(str(src))
    word_tokenizer(V).save_pretrained(str(src))
    gc = json.loads((src / "generation_config.json").read_text())
    gc.update(temperature=0.7, top_p=0.9, repetition_penalty=3.0, no_repeat_ngram_size=2, max_new_tokens=16)
    (src / "generation_config.json").write_text(json.dumps(gc))
    assert main(["convert", str(src), "--out", str(tmp_path / "ck")]) == 0
    assert main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "exp")]) == 0
    got = json.loads((tmp_path / "exp" / "generation_config.json").read_text())
    for key in ("repetition_penalty", "no_repeat_ngram_size", "max_new_tokens"):
        assert got.get(key) == gc[key], (key, got.get(key), gc[key])
    assert "temperature" not in got and "top_p" not in got
    x = torch.tensor([[3, 4, 5, 3, 4]])
    load = transformers.AutoModelForCausalLM.from_pretrained
    a, b = (load(str(d)).eval().generate(x) for d in (src, tmp_path / "exp"))
    assert torch.equal(a, b), (a.tolist(), b.tolist())


def test_linear_rope_scaling_and_swish_convert_exactly_and_export_back(tmp_path):
    """rope_type 'linear' (positions interpolated: every frequency / factor; Llama-2 long-context fine-tunes) and
    hidden_act 'swish' (transformers' name for SiLU) were refused though snlp computes both exactly; a legacy
    config.json's `rope_scaling: {"type": "linear"}` is read too. Reference: transformers' logits, fp64."""
    x = ids(T=20)
    linear = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    hf = hf_tiny("llama", layers=2, dtype=torch.float64, rope_parameters=linear, hidden_act="swish")
    with torch.no_grad():
        assert (hf(x).logits - hf_tiny("llama", layers=2, dtype=torch.float64)(x).logits).abs().max() > 1e-3  # real
        model, _ = from_hf(hf)
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-6, rtol=0)
        re = transformers.AutoModelForCausalLM.from_pretrained(str(export_hf(model, tmp_path / "exp"))).eval()
        torch.testing.assert_close(re(x).logits, hf(x).logits, atol=1e-10, rtol=0)
    hf_tiny("qwen2", layers=2).save_pretrained(str(tmp_path / "legacy"))
    cfg = json.loads((tmp_path / "legacy" / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    (tmp_path / "legacy" / "config.json").write_text(json.dumps({**cfg, "rope_theta": 1e6,
                                                                 "rope_scaling": {"type": "linear", "factor": 2.0}}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "legacy")).eval()
    model, _ = from_hf(str(tmp_path / "legacy"))
    assert model.config.rope_base == 1e6 and model.config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x).logits, atol=1e-5, rtol=1e-5)


def convert_refusal_of_a_folder(hf, tmp_path, capsys) -> str:
    """`snlp convert`'s stderr for `hf` saved as a folder whose weights are corrupt (a refusal from the config must
    come before they are read), its exit status 2 checked."""
    from snlp.apps.cli import main

    hf.save_pretrained(str(tmp_path / "m"))
    word_tokenizer(V).save_pretrained(str(tmp_path / "m"))
    (tmp_path / "m" / "model.safetensors").write_bytes(b"corrupt")
    capsys.readouterr()  # (save_pretrained's progress bar)
    assert main(["convert", str(tmp_path / "m"), "--out", str(tmp_path / "ck")]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                   "original_max_position_embeddings": 64}])
def test_other_rope_types_are_refused_in_one_line_before_the_weights_load(rope, tmp_path, capsys):
    """dynamic (frequencies that change with the sequence length), yarn and longrope (cos/sin scaled too) have no
    fixed RoPE table in snlp: refused by name, from an object and from a folder whose weights are never read (here
    they are corrupt, and the error is the rope type's)."""
    hf = hf_tiny("llama", layers=2, rope_parameters={"rope_theta": 10000.0, **rope})
    with pytest.raises(ValueError, match=f"unsupported rope type '{rope['rope_type']}'"):
        from_hf(hf)
    err = convert_refusal_of_a_folder(hf, tmp_path, capsys)
    assert f"unsupported rope type '{rope['rope_type']}'" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {**LLAMA3, "original_max_position_embeddings": 64}], ids=["linear", "llama3"])
def test_a_scaled_rope_of_part_of_each_head_is_refused_not_converted_as_a_full_rotation(rope, tmp_path, capsys):
    """partial_rotary_factor < 1 with a linear / llama3 table: transformers builds frequencies for
    int(head_dim * factor) dims only and its forward fails on them; snlp rotated every dimension, a model no config
    describes. Refused in one line, from an object and from a folder whose weights are never read. The default
    table ignores the field in transformers' Llama, and so does snlp: the same logits."""
    part = {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    hf = hf_tiny("llama", layers=2, rope_parameters={**part, **rope})
    with pytest.raises(RuntimeError), torch.no_grad():
        hf(ids())  # transformers cannot run it either
    with pytest.raises(ValueError, match="unsupported partial_rotary_factor=0.5"):
        from_hf(hf)
    err = convert_refusal_of_a_folder(hf, tmp_path, capsys)
    assert "unsupported partial_rotary_factor=0.5" in err and err.count("\n") == 1, err
    hf = hf_tiny("llama", layers=2, dtype=torch.float64, rope_parameters={**part, "rope_type": "default"})
    with torch.no_grad():
        torch.testing.assert_close(from_hf(hf)[0](ids()), hf(ids()).logits, atol=1e-6, rtol=0)


def test_a_head_of_its_own_under_a_tied_config_is_converted_as_transformers_computes_it(tmp_path):
    """tie_word_embeddings=True in the config, but the logits come from an lm_head of its own: a folder whose weights
    hold their own lm_head.weight (transformers 5 loads it untied) and a model object whose head was given its own
    tensor. snlp tied the head to the embedding by the config's flag and computed other logits; fp64, reference
    transformers' forward; the export of the conversion loads in transformers with the same logits."""
    x = ids()
    untied = hf_tiny("llama", layers=2, dtype=torch.float64)
    untied.save_pretrained(str(tmp_path / "m"))
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")).eval()
    obj = hf_tiny("llama", layers=2, dtype=torch.float64, tie_word_embeddings=True)
    obj.lm_head.weight = torch.nn.Parameter(obj.lm_head.weight + 0.1)
    for src, hf in ((str(tmp_path / "m"), ref), (obj, obj)):
        model, _ = from_hf(src)
        with torch.no_grad():
            tied_logits = hf.model(x).last_hidden_state @ hf.model.embed_tokens.weight.T
            assert (hf(x).logits - tied_logits).abs().max() > 1e-2  # the head of its own is what transformers reads
            torch.testing.assert_close(model(x), hf(x).logits, atol=1e-6, rtol=0)
        assert not model.config.tie_embeddings
        with torch.no_grad():
            out = tmp_path / f"exp{id(src)}"
            back = transformers.AutoModelForCausalLM.from_pretrained(str(export_hf(model, out))).eval()
            torch.testing.assert_close(back(x).logits, model(x), atol=1e-6, rtol=0)
    tied = hf_tiny("llama", layers=2, tie_word_embeddings=True)  # a head that is the embedding stays tied
    assert from_hf(tied)[0].config.tie_embeddings


@pytest.mark.parametrize("bad", ['{"version": "1.0", "model": {"type": "BPE"}}', "{not json"],
                         ids=["no-added-tokens", "not-json"])
def test_a_folder_whose_tokenizer_cannot_be_read_says_so_in_one_line(bad, tmp_path, capsys):
    """A tokenizer.json transformers cannot read: one lacking a key crashed `snlp convert` with a KeyError traceback,
    one that is no JSON was dropped without a word (from_hf returned no tokenizer; convert said the folder had
    none). Both are named; a tokenizer passed by the caller is used without reading the folder's, and a folder
    without tokenizer files still converts without one."""
    from snlp.apps.cli import main

    _, d = _tiny_dir(tmp_path)
    (d / "tokenizer.json").write_text(bad)
    with pytest.raises(ValueError, match=r"cannot read the tokenizer of .*tokenizer\.json"):
        from_hf(str(d))
    capsys.readouterr()
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]  # (transformers' progress bar aside)
    assert len(errors) == 1 and "cannot read the tokenizer" in errors[0] and "Traceback" not in err, err
    assert from_hf(str(d), tokenizer=word_tokenizer(V))[1].vocab_size == V
    for f in d.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    assert from_hf(str(d))[1] is None


def test_a_text_prompt_is_encoded_as_transformers_tokenizer_encodes_it():
    """`snlp generate --prompt` (and --distributed's) feed a converted model the ids transformers' tokenizer(text)
    gives, which `generate` then continues: no BOS where the tokenizer adds none (SmolLM2's bos_token is its chat
    marker <|im_start|>, Qwen2's fallback its <|endoftext|>), one where its post-processor adds it (Llama-3); our own
    BPE keeps its <|bos|> (its documents start so); an empty text is the BOS alone (generate() without inputs)."""
    from tokenizers import processors

    from snlp.apps.generate import prompt_ids
    from snlp.io.tokenizer import Tokenizer
    import argparse

    args = lambda text: argparse.Namespace(chat=False, prompt=text, eos_id=None)  # noqa: E731
    plain = word_tokenizer(V)  # no post-processor: transformers adds no BOS
    adds = word_tokenizer(V)
    adds.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", V - 3)])
    for hf_tok in (plain, adds):
        tok = Tokenizer.from_hf(hf_tok)
        for text in ("t1 t5 t2", "t7"):
            # and the stop ids transformers' generate() of its export stops after: the tokenizer's EOS
            assert prompt_ids(args(text), tok) == (hf_tok(text)["input_ids"], [V - 2])
        assert tok.prompt_ids("") == [V - 3]
    assert prompt_ids(args("t1"), Tokenizer.from_hf(plain))[0] == [1]  # was [<s>, t1]
    own = Tokenizer.train(["hello world"] * 4, vocab_size=300)
    assert own.prompt_ids("hello") == [own.bos_id] + own.encode("hello")


@pytest.mark.parametrize("bos", [True, False], ids=["bos", "eos-only"])
def test_eval_stream_of_a_converted_model_is_lm_evals_prefix_token_then_the_text(tmp_path, bos):
    """`snlp eval`'s validation stream on a converted model: each document after the token lm-evaluation-harness puts
    before a document of the same transformers model (HFLM.prefix_token_id: BOS, else EOS, as Qwen2's tokenizers have
    no BOS), then the text as `tokenizer(text, add_special_tokens=False)` encodes it."""
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    from snlp.eval.data import validation_tokens
    from snlp.io import data as D

    hf = hf_tiny("llama")
    ht = word_tokenizer(V)
    if not bos:
        ht.bos_token = None
    d = tmp_path / "hf"
    hf.save_pretrained(str(d))
    ht.save_pretrained(str(d))
    _, tok = from_hf(str(d))
    src = tmp_path / "docs.txt"
    src.write_text("\n\n".join(" ".join(f"t{(7 * i + j) % 90}" for j in range(600)) for i in range(4)))
    val = validation_tokens(tok, data=str(src), val_frac=0.5, cache_dir=tmp_path / "cache")
    prefix = HFLM(pretrained=hf, tokenizer=ht, batch_size=1).prefix_token_id
    _, docs = D.split_documents(list(D.documents(str(src))), 0.5)
    assert prefix == (V - 3 if bos else V - 2)
    assert val.tolist() == [i for doc in docs for i in [prefix] + ht(doc, add_special_tokens=False).input_ids]


# ------------------------------------------------------------------- export of snlp-built Llama-family configs
def snlp_llama(dtype=torch.float64, seed=0, **kw) -> GPT:
    """An snlp GPT with the Llama switches (as from_hf sets them) and random weights everywhere, norms included."""
    cfg = dict(vocab_size=V, n_layer=3, n_head=4, n_kv_head=2, n_embd=32, sequence_len=64, x0_residual=False,
               value_embeds=False, softcap=0.0, mlp_act="swiglu", ffn_dim=48, qk_norm="none", embed_norm=False,
               norm_eps=1e-5, norm_weights=True, rope_rotate_half=True)
    torch.manual_seed(seed)
    m = GPT(GPTConfig(**{**cfg, **kw}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen) if n.startswith("ln") or ".ln" in n
                    else 0.3 * torch.randn(p.shape, generator=gen))
    return m.to(dtype).eval()


def test_an_export_without_tokenizer_names_no_bos_eos_and_generates_as_snlp(tmp_path):
    """Without a tokenizer (export_hf(model, out); `snlp export DRAFTER --base HF_DIR` of a folder without one) the
    written config.json and generation_config.json said bos 1 / eos 2, LlamaConfig's defaults, though nothing names
    such tokens: transformers' generate() stopped after token 2 where snlp's decoding (no stop ids) went on.
    Reference: snlp's sequential greedy decoding, and the model's own KV-free argmax loop."""
    model = snlp_llama(attn_head_dim=12)
    prompt = [5, 6, 7, 8, 9]
    first = sequential_generate(model, prompt, max_new_tokens=1).tokens[0]
    with torch.no_grad():  # make token 2 the first greedy token: the stop LlamaConfig's default names
        model.lm_head.weight[2] = model.lm_head.weight[first] * 1.5
    ours = sequential_generate(model, prompt, max_new_tokens=8).tokens
    assert ours[0] == 2 and len(ours) == 8
    out = export_hf(model, tmp_path / "exp")
    for name in ("config.json", "generation_config.json"):
        got = json.loads((out / name).read_text())
        assert all(got.get(k) is None for k in ("bos_token_id", "eos_token_id", "pad_token_id")), (name, got)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 5:].tolist()
    assert theirs == ours


def test_an_export_writes_the_norm_eps_snlp_computes_with_when_the_config_leaves_it_to_torch(tmp_path):
    """norm_eps=None (snlp's RMSNorm then adds torch.finfo(dtype).eps, F.rms_norm's default) was written as
    rms_norm_eps=1e-6: on hidden states of small variance transformers' logits were far off snlp's. Reference: snlp's
    sequential logits of the exported model, fp32 (its eps 1.19e-7)."""
    model = snlp_llama(dtype=torch.float32, norm_eps=None)
    with torch.no_grad():
        model.wte.weight.mul_(1e-3)  # variance ~1e-7: the eps decides the normalised embedding
    out = export_hf(model, tmp_path / "exp")
    assert json.loads((out / "config.json").read_text())["rms_norm_eps"] == torch.finfo(torch.float32).eps
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    x = ids(T=12)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-4, rtol=1e-4)


def test_an_export_reads_the_windows_of_a_window_pattern(tmp_path):
    """window_pattern='LL' (every layer full, as 'L') was refused as 'not Llama-family'; 'SL' with q/k/v biases (one
    window size, the last layer full) has transformers' Qwen2 layer_types and was refused too. Reference: snlp's
    sequential logits past the window."""
    x = ids(T=20)
    for kw, arch in ((dict(window_pattern="LL"), "LlamaForCausalLM"),
                     (dict(window_pattern="SL", short_window=3, qkv_bias=True), "Qwen2ForCausalLM")):
        model = snlp_llama(n_layer=4, **kw)
        out = export_hf(model, tmp_path / kw["window_pattern"])
        assert json.loads((out / "config.json").read_text())["architectures"] == [arch]
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
        with torch.no_grad():
            torch.testing.assert_close(hf(x).logits.double(), model(x).double(), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="sliding-window layers without q/k/v biases"):
        export_hf(snlp_llama(window_pattern="SL", short_window=3), tmp_path / "nobias")


def test_an_export_refuses_a_tokenizer_that_transformers_would_read_back_as_another(tmp_path):
    """transformers 5's AutoTokenizer builds a `qwen2` folder's tokenizer as Qwen2Tokenizer (from the vocabulary and
    merges, with Qwen2's normalizer and pre-tokenizer) whatever its tokenizer.json holds: a Qwen2-architecture export
    (q/k/v biases) with another tokenizer was written, and `AutoTokenizer(export)("t1 t2")` gave [] where snlp's
    tokenizer gives two ids. Now refused in one line, nothing written; a tokenizer transformers reads as it is (a
    Qwen2 source's own, or any tokenizer beside a Llama / Qwen3 / Mistral) exports. Reference: AutoTokenizer."""
    from tokenizers import Tokenizer as HFTokenizer

    from snlp.io.tokenizer import Tokenizer

    words = Tokenizer.from_hf(word_tokenizer(V))
    with pytest.raises(ValueError, match="read this Qwen2ForCausalLM folder's tokenizer as Qwen2Tokenizer") as e:
        export_hf(snlp_llama(qkv_bias=True), tmp_path / "q", words)
    assert "\n" not in str(e.value) and not (tmp_path / "q").exists()
    src = tmp_path / "src"  # a Qwen2 source folder: transformers reads its tokenizer as Qwen2Tokenizer itself
    transformers.Qwen2Config(vocab_size=V).save_pretrained(str(src))
    word_tokenizer(V).save_pretrained(str(src))
    as_qwen2 = Tokenizer.from_hf(transformers.AutoTokenizer.from_pretrained(str(src)))
    bare = Tokenizer(HFTokenizer.from_str(words.tok.to_str()), words.meta)  # no post-processor: transformers writes
    bare.tok.post_processor = None  # one that adds nothing, the same ids
    for name, model, tok in (("llama", snlp_llama(), words), ("bare", snlp_llama(), bare),
                             ("qwen2", snlp_llama(qkv_bias=True, vocab_size=as_qwen2.vocab_size), as_qwen2)):
        back = transformers.AutoTokenizer.from_pretrained(str(export_hf(model, tmp_path / name, tok)))
        for text in ("t1 t2", " t3  t95 <s>", "t1</s>t2"):
            assert back(text, add_special_tokens=False)["input_ids"] == tok.encode(text), (name, text)


def test_export_hf_writes_a_compiled_model_and_refuses_what_is_no_plain_gpt_in_one_line(tmp_path):
    """export_hf(torch.compile(model)) raised KeyError 'blocks.0.attn.c_q.weight' (the wrapper's state dict prefixes
    `_orig_mod.`), as did a LoRA drafter's model (its weights parametrized: W0 + delta); a transformers model or a path
    raised AttributeError. Now the compiled model is written as the model inside, the others refused in one line.
    Reference: the model's own sequential logits."""
    from snlp.method.drafter import make_drafter

    model = snlp_llama()
    out = export_hf(torch.compile(model, backend="eager"), tmp_path / "compiled")
    x = ids()
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
        torch.testing.assert_close(hf(x).logits.double(), model(x).double(), atol=1e-4, rtol=0)
    for bad, match in ((hf, "got LlamaForCausalLM: a transformers model is written with its own save_pretrained"),
                       ("runs/x", "got str"),
                       (make_drafter(snlp_llama(n_layer=4), "2xF1-h0-K1", rank=2, alpha=4.0).model,
                        "parametrized .*export_drafter_hf")):
        with pytest.raises(ValueError, match=match) as e:
            export_hf(bad, tmp_path / "bad")
        assert "\n" not in str(e.value) and not (tmp_path / "bad").exists()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(["llama", "qwen2", "qwen3", "mistral"]), layers=st.integers(1, 3),
       heads=st.sampled_from([(4, 4), (4, 2), (4, 1), (2, 1)]), head_dim=st.sampled_from([0, 6, 12]),
       tied=st.booleans(), eps=st.sampled_from([1e-6, 0.1, None]), window=st.integers(3, 6),
       slides=st.lists(st.booleans(), min_size=3, max_size=3), vocab=st.sampled_from([3, 50, 97]),
       seed=st.integers(0, 99))
def test_export_of_random_llama_family_configs_is_snlps_forward_and_greedy_decoding(
        family, layers, heads, head_dim, tied, eps, window, slides, vocab, seed, tmp_path_factory):
    """Any Llama-family config export writes (GQA / MQA, explicit head_dim, tied or untied head, eps incl. torch's
    default, odd vocabularies, Mistral windows, Qwen2 / Qwen3 window layers) gives transformers' logits equal to snlp's
    sequential logits and greedy generate() equal to snlp's decoding (windows >= 3: see CONTRIBUTING's seam row)."""
    kw = dict(n_layer=layers, n_head=heads[0], n_kv_head=heads[1], n_embd=24, attn_head_dim=head_dim,
              tie_embeddings=tied, norm_eps=eps, vocab_size=vocab)
    per_layer = [window if s else -1 for s in slides[:layers]]
    kw.update({"llama": {}, "mistral": dict(layer_windows=[window] * layers),
               "qwen2": dict(qkv_bias=True, layer_windows=per_layer),
               "qwen3": dict(qk_norm="weighted", layer_windows=per_layer)}[family])
    model = snlp_llama(seed=seed, **kw)
    out = export_hf(model, tmp_path_factory.mktemp("exp"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    x = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits.double(), model(x).double(), atol=1e-4, rtol=1e-5)
        theirs = hf.generate(x[:1, :4], max_new_tokens=12, do_sample=False)[0, 4:].tolist()
    assert theirs == sequential_generate(model, x[0, :4].tolist(), max_new_tokens=12).tokens


def test_a_tokenizer_with_named_chat_templates_keeps_the_default_one_through_convert_and_export(tmp_path):
    """A tokenizer whose chat_template is a dict of named templates (Hermes-2-Pro-Llama-3: "default" and "tool_use")
    was converted without any: `snlp generate --chat` said the model has no chat template, and the export wrote none.
    transformers' apply_chat_template without a name (or tools) renders "default": that one is kept and exported.
    Reference: transformers' rendering of the source tokenizer."""
    from snlp.apps.cli import main

    src = tmp_path / "src"
    hf_tiny("llama", layers=1).save_pretrained(str(src))
    ht = word_tokenizer(V)
    ht.chat_template = {"default": "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
                                   "{% if add_generation_prompt %}<s>{% endif %}", "tool_use": "{{ 'tools' }}"}
    ht.save_pretrained(str(src))
    ref = transformers.AutoTokenizer.from_pretrained(str(src))
    assert isinstance(ref.chat_template, dict)
    msgs = [{"role": "user", "content": "t1 t2"}, {"role": "assistant", "content": "t3"}, {"role": "user", "content": "t4"}]
    want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    _, tok = from_hf(str(src))
    assert tok.apply_chat_template(msgs) == want
    assert main(["convert", str(src), "--out", str(tmp_path / "ck")]) == 0
    assert main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "exp")]) == 0
    back = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "exp"))
    assert back.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == want


def test_a_chat_template_writing_the_pad_or_unk_token_renders_them_as_transformers_does():
    """transformers hands a chat template every special token of the tokenizer (pad_token and unk_token too); snlp's
    renderer held the BOS and EOS only, so a template writing {{ pad_token }} or {{ unk_token }} rendered them empty
    (`snlp generate --chat` then decoded from another prompt). Reference: transformers' apply_chat_template."""
    from snlp.io.tokenizer import Tokenizer

    ht = word_tokenizer(V)
    ht.pad_token = "<unk>"
    ht.chat_template = ("{% for m in messages %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}{{ pad_token }}"
                        "{{ unk_token }}{% endfor %}")
    msgs = [{"role": "user", "content": "t3"}]
    want = ht.apply_chat_template(msgs, tokenize=False)
    assert want == "<s>t3</s><unk><unk>"
    assert Tokenizer.from_hf(ht).apply_chat_template(msgs) == want


def test_an_export_with_our_own_bpe_tokenizes_a_prompt_as_snlp_generate_does(tmp_path):
    """Our BPE was written without a bos_token or anything adding it (config.json named <|bos|>'s id as bos_token_id
    all the same): transformers' tokenizer(text) of the export gave the text without the <|bos|> that
    `Tokenizer.prompt_ids` (snlp generate --prompt) puts first, so its generate() continued another prompt, and
    lm-eval's prefix token (bos, else eos) was None. Reference: Tokenizer.prompt_ids / encode and snlp's greedy
    decoding of that prompt."""
    from snlp.io.tokenizer import Tokenizer

    tok = Tokenizer.train(["hello world, it's a test of <|bos|> text " * 3, "naïve café 12345"] * 20, vocab_size=300)
    model = snlp_llama(vocab_size=tok.vocab_size, n_layer=2)
    out = export_hf(model, tmp_path / "exp", tok)
    back = transformers.AutoTokenizer.from_pretrained(str(out))
    assert back.bos_token_id == tok.bos_id == json.loads((out / "config.json").read_text())["bos_token_id"]
    for text in ("hello world", " it's <|bos|> a test", "naïve café", ""):
        assert back(text)["input_ids"] == tok.prompt_ids(text), text
        assert back(text, add_special_tokens=False)["input_ids"] == tok.encode(text), text
    assert tok.prompt_ids("hello")[0] == tok.bos_id  # the model's own tokenizer is unchanged by the export
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    prompt = back("hello world", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=8, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert theirs == sequential_generate(model, tok.prompt_ids("hello world"), max_new_tokens=8).tokens


def test_a_float16_load_of_weights_past_its_range_is_refused_naming_the_dtype():
    """from_hf(..., dtype="float16") checked the weights for NaN / inf before the cast only: a finite weight past
    65504 became inf and the model loaded silently (every logit of that row inf). The cast is checked too, and the
    dtype, not the checkpoint, is named."""
    hf = hf_tiny("llama")
    with torch.no_grad():
        hf.lm_head.weight[0, 0] = 1e5
    with pytest.raises(ValueError, match=r"torch.float16 cannot hold .*lm_head.weight: \|1e\+05\|.*float32 or bfloat16"):
        from_hf(hf, dtype="float16")
    model, _ = from_hf(hf, dtype="bfloat16")  # bf16 holds it
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_float16_load_from_a_directory_names_the_dtype_not_a_broken_checkpoint(tmp_path):
    """A directory given to from_hf(dtype="float16") was cast by transformers: a finite weight past 65504 arrived
    as inf and was called a broken checkpoint ("restore or re-train it"). The dtype is named (the .gguf case:
    tests/io/test_gguf.py)."""
    hf = hf_tiny("llama")
    with torch.no_grad():
        hf.lm_head.weight[0, 0] = 1e5
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"torch.float16 cannot hold {tmp_path}'s lm_head.weight: \|1e\+05\|.*"
                                         rf"choose float32 or bfloat16"):
        from_hf(tmp_path, dtype="float16")
    model, _ = from_hf(tmp_path, dtype="bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.lm_head.weight[0, 0].item() == 99840.0


def test_a_cast_past_float32s_range_advises_a_dtype_that_holds_it():
    """check_cast advised 'choose float32 or bfloat16' to a float32 / bfloat16 cast of a float64 weight past both
    ranges; it names float64, the only one that holds it."""
    hf = hf_tiny("llama", dtype=torch.float64)
    with torch.no_grad():
        hf.lm_head.weight[0, 0] = 1e39
    for dtype in ("float32", "bfloat16"):
        with pytest.raises(ValueError, match=r"cannot hold .*\|1e\+39\|.*: choose float64$"):
            from_hf(hf, dtype=dtype)


# ------------------------------------------------------------------------------ export target, tokenizer, windows
def test_export_hf_refuses_a_folder_holding_files_unless_told_to_overwrite(tmp_path):
    """export_hf(model, DIR) (the Python API; `snlp export --out` refused already) wrote transformers' files over the
    user's tokenizer_config.json / chat_template.jinja / generation_config.json and save_pretrained deleted a
    model-00001-of-00002.safetensors shard it did not write. Now refused in one line before any work, every file
    kept; a new folder, an empty one or one holding hidden entries only is written, and overwrite=True writes into a
    folder that holds files (the export then loads in transformers with snlp's logits)."""
    model = snlp_llama()
    for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "model-00001-of-00002.safetensors", "notes.txt"):
        out = tmp_path / f"out-{name}"
        out.mkdir()
        (out / name).write_text("the user's")
        with pytest.raises(ValueError, match="is not empty") as e:
            export_hf(model, out, Tokenizer.from_hf(word_tokenizer(V)))
        assert name in str(e.value) and "overwrite=True" in str(e.value) and "\n" not in str(e.value)
        assert [p.name for p in out.iterdir()] == [name] and (out / name).read_text() == "the user's"
    (tmp_path / "file").write_text("the user's")
    for path in (tmp_path / "file", tmp_path / "file" / "sub"):  # (the second raised NotADirectoryError at the end)
        with pytest.raises(ValueError, match="is a file"):
            export_hf(model, path)
    (tmp_path / "clone" / ".git").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "clone", tmp_path / "empty", tmp_path / "new" / "sub"):
        assert (export_hf(model, out) / "config.json").is_file()
    out = tmp_path / "out-notes.txt"
    export_hf(model, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "the user's"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits.double(), model(x).double(), atol=1e-4, rtol=0)


def _punct_tokenizer():
    """A transformers WordLevel tokenizer (words and punctuation, joined by spaces on decode) with two additional
    special tokens and clean_up_tokenization_spaces=True: its decode writes "a, b." for the ids of "a , b ."."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers

    words = ["<s>", "</s>", "<unk>", "<tool>", "<think>", "hello", "world", ",", ".", "?", "it", "'s", "ok"]
    tok = HFTok(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=["<tool>", "<think>"], clean_up_tokenization_spaces=True)


def test_an_export_keeps_the_sources_additional_special_tokens_and_its_clean_up_of_spaces(tmp_path):
    """A source tokenizer with additional special tokens and clean_up_tokenization_spaces=True was exported without
    either: transformers' tokenizer of the export listed only bos / eos / unk as special (its extra_special_tokens
    empty) and decoded "hello , world ." where the source's decodes "hello, world.". Reference: the source's own
    transformers tokenizer, read back from its folder, against AutoTokenizer of `convert` -> `export`."""
    src = tmp_path / "src"
    hf = hf_tiny("llama", vocab_size=13)
    hf.save_pretrained(str(src))
    _punct_tokenizer().save_pretrained(str(src))
    theirs = transformers.AutoTokenizer.from_pretrained(str(src))
    model, tok = from_hf(str(src))
    save_checkpoint(tmp_path / "ck", model, tok)
    model, tok = load(tmp_path / "ck")
    back = transformers.AutoTokenizer.from_pretrained(str(export_hf(model, tmp_path / "exp", tok)))
    assert back.extra_special_tokens == theirs.extra_special_tokens == ["<tool>", "<think>"]
    assert back.all_special_tokens == theirs.all_special_tokens
    for text in ("hello , world .", "<tool> it 's ok ? <think>", "<s> hello </s>"):
        ids_ = theirs(text)["input_ids"]
        assert back(text)["input_ids"] == ids_
        for skip in (False, True):
            assert back.decode(ids_, skip_special_tokens=skip) == theirs.decode(ids_, skip_special_tokens=skip)
    assert theirs.decode(theirs("hello , world .")["input_ids"]) == "hello, world."


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_sliding_layer_without_a_window_width_is_refused_as_transformers_cannot_run_it(family, tmp_path):
    """A Qwen2 / Qwen3 config whose layer_types names 'sliding_attention' but whose sliding_window is null (Qwen2Config
    nulls it when use_sliding_window is False, even where config.json gives a width) converted as full attention
    without a word; transformers itself cannot run it (its forward raises). Now refused in one line, before the
    weights load from a folder; the same layer_types with a width convert as before."""
    types = ["sliding_attention", "full_attention"] * 2
    hf = hf_tiny(family, layer_types=types, sliding_window=4)
    assert hf.config.sliding_window is None  # use_sliding_window defaults to False
    with pytest.raises((ValueError, TypeError)), torch.no_grad():
        hf(ids())
    with pytest.raises(ValueError, match="sliding_window=None") as e:
        from_hf(hf)
    assert "\n" not in str(e.value)
    hf.save_pretrained(str(tmp_path / "d"))
    with pytest.raises(ValueError, match="sliding_window=None"):
        from_hf(str(tmp_path / "d"))
    ok = hf_tiny(family, layer_types=types, sliding_window=4, use_sliding_window=True)
    model, _ = from_hf(ok)
    assert model.config.layer_windows == [3, -1, 3, -1]
    x = ids(T=20)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ok(x).logits, atol=1e-5, rtol=1e-5)


def test_a_bfloat16_export_holds_the_models_own_weights_and_converts_back_to_the_same_model(tmp_path):
    """export_hf folded each RMSNorm weight into the projections it feeds (W diag(w)) and wrote unit norms: in bfloat16
    every product was rounded, so the exported folder was another model (snlp's logits of `from_hf(export)` 0.5 off the
    model's own, transformers' argmax departing on some positions). Now the model's tensors are written as they are:
    `from_hf(export_hf(m))` has m's state and logits bit for bit. Reference: the model itself."""
    for kw in (dict(), dict(tie_embeddings=True), dict(qk_norm="weighted", layer_windows=[3, -1, -1]),
               dict(qkv_bias=True)):
        model = snlp_llama(dtype=torch.bfloat16, **kw)
        out = export_hf(model, tmp_path / str(len(list(tmp_path.iterdir()))))
        back, _ = from_hf(str(out))
        ours = model.state_dict()
        assert back.config == model.config and back.state_dict().keys() == ours.keys()
        assert all(torch.equal(v, ours[k]) for k, v in back.state_dict().items()), kw
        x = ids(T=12)
        with torch.no_grad():
            assert torch.equal(back(x), model(x))


def test_an_export_refuses_a_tokenizer_larger_than_the_models_vocabulary_before_writing(tmp_path):
    """export_hf(model, out, tokenizer) with a tokenizer of 200 tokens for a 97-token model wrote the folder (exit 0),
    whose transformers model then raised IndexError on the tokenizer's ids past 96 (and config.json named bos / eos
    ids outside the vocabulary). Now refused in one line before anything is written, as from_hf refuses the pair."""
    with pytest.raises(ValueError, match="vocab mismatch") as e:
        export_hf(snlp_llama(), tmp_path / "exp", Tokenizer.from_hf(word_tokenizer(200)))
    assert "\n" not in str(e.value) and not (tmp_path / "exp").exists()


def test_a_half_precision_export_writes_the_norm_eps_torch_computes_with(tmp_path):
    """norm_eps=None leaves the eps to F.rms_norm, which computes bfloat16 / float16 inputs in float32 with float32's
    eps (1.2e-7); the export wrote the input dtype's own (bfloat16 2^-7, float16 2^-10), so transformers' logits of a
    model whose hidden states have small variance were another model's (max error 8.5 on logits of scale 7, argmax
    agreeing on 4 % of positions). Reference: F.rms_norm itself, and snlp's logits of the model."""
    import torch.nn.functional as F

    for dtype, atol in ((torch.bfloat16, 0.5), (torch.float16, 0.1)):
        model = snlp_llama(dtype=dtype, norm_eps=None)
        with torch.no_grad():
            model.wte.weight.mul_(1e-3)  # variance ~1e-7: the eps decides the normalised embedding
        out = export_hf(model, tmp_path / str(dtype))
        eps = json.loads((out / "config.json").read_text())["rms_norm_eps"]
        h = model.wte.weight[:8].detach()
        naive = (h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
        torch.testing.assert_close(F.rms_norm(h, (h.size(-1),)), naive, atol=0, rtol=0.01)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=dtype).eval()
        x = ids(T=12)
        with torch.no_grad():
            torch.testing.assert_close(hf(x).logits.double(), model(x).double(), atol=atol, rtol=0)


def test_a_transformers_folder_missing_a_weight_is_refused_not_converted_with_random_weights(tmp_path):
    """A folder whose safetensors lack a tensor (lm_head of an untied model, one layer's up_proj, a q_proj bias, the
    final norm) converted without a word: transformers initialised the tensor (at random; norms at one) and only
    logged it, and the conversion held that init. Refused in one line, as check_gguf refuses a GGUF missing a tensor;
    a tied model's folder (no lm_head in the file, as save_pretrained writes it) converts. Reference: the loading
    info of transformers' from_pretrained."""
    from safetensors.torch import load_file, save_file

    for family, drop in (("llama", "lm_head.weight"), ("llama", "model.layers.1.mlp.up_proj.weight"),
                         ("qwen2-window", "model.layers.0.self_attn.q_proj.bias"), ("qwen3-headdim", "model.norm.weight")):
        d = tmp_path / f"{family}-{drop}"
        hf_tiny(family).save_pretrained(str(d))
        sd = load_file(str(d / "model.safetensors"))
        save_file({k: v for k, v in sd.items() if k != drop}, str(d / "model.safetensors"), metadata={"format": "pt"})
        _, info = transformers.AutoModelForCausalLM.from_pretrained(str(d), output_loading_info=True)
        assert info["missing_keys"] == {drop} or list(info["missing_keys"]) == [drop]
        with pytest.raises(ValueError, match="checkpoint is incomplete") as e:
            from_hf(str(d))
        assert drop in str(e.value) and "\n" not in str(e.value)
    hf = hf_tiny("qwen2-tied")
    hf.save_pretrained(str(tmp_path / "tied"))
    assert "lm_head.weight" not in load_file(str(tmp_path / "tied" / "model.safetensors"))
    model, _ = from_hf(str(tmp_path / "tied"))
    with torch.no_grad():
        torch.testing.assert_close(model(ids()), hf(ids()).logits, atol=1e-5, rtol=1e-5)


def test_export_hf_takes_a_transformers_tokenizer_as_from_hf_does_and_refuses_anything_else_in_one_line(tmp_path):
    """export_hf(model, out, tokenizer=<a transformers tokenizer>) (what from_hf's tokenizer= takes) raised
    AttributeError 'TokenizersBackend has no attribute meta'; a path string raised AttributeError too. Now the
    transformers tokenizer is written as snlp's Tokenizer.from_hf of it is, anything else refused in one line.
    Reference: AutoTokenizer of the export against the tokenizer given."""
    hf_tok = word_tokenizer(V)
    back = transformers.AutoTokenizer.from_pretrained(str(export_hf(snlp_llama(), tmp_path / "a", hf_tok)))
    for text in ("t1 t2", "<s>t3</s>"):
        assert back(text)["input_ids"] == hf_tok(text)["input_ids"]
    assert back.chat_template == hf_tok.chat_template
    for bad in ("path/to/tokenizer", 5):
        with pytest.raises(ValueError, match="not a fast") as e:
            export_hf(snlp_llama(), tmp_path / "b", bad)
        assert "\n" not in str(e.value) and not (tmp_path / "b").exists()


@pytest.mark.parametrize("family,kw", [("mistral", dict(sliding_window=0)),
                                       ("qwen2", dict(use_sliding_window=True, sliding_window=0, max_window_layers=2)),
                                       ("qwen3", dict(use_sliding_window=True, sliding_window=0, max_window_layers=0))])
def test_a_sliding_window_of_zero_width_is_refused_not_converted_as_full_attention(family, kw, tmp_path):
    """sliding_window=0 keeps no key in transformers (key j is kept for query i when i - j < sliding_window; its
    forward fails on the mask), yet from_hf converted it to window -1, full causal attention, without a word: a model
    that computed something transformers never does. Now refused in one line, from the object and from a folder; a
    width of 1 (each token sees itself only) still converts, with the same logits as transformers."""
    hf = hf_tiny(family, **kw)
    assert hf.config.sliding_window == 0
    with pytest.raises(Exception), torch.no_grad():
        hf(ids())
    with pytest.raises(ValueError, match="sliding_window=0") as e:
        from_hf(hf)
    assert "\n" not in str(e.value)
    hf.save_pretrained(str(tmp_path / "d"))
    with pytest.raises(ValueError, match="sliding_window=0"):
        from_hf(str(tmp_path / "d"))
    one = hf_tiny(family, **{**kw, "sliding_window": 1}).double()
    model, _ = from_hf(one)
    assert 0 in model.config.layer_windows and -2 not in model.config.layer_windows
    x = ids(T=12)
    with torch.no_grad():
        torch.testing.assert_close(model(x).double(), one(x).logits, atol=1e-6, rtol=0)


def test_an_export_of_a_source_whose_generation_config_pads_with_minus_one_generates_as_the_source(tmp_path, capsys):
    """Older Llama ports write pad_token_id -1 (none) into their generation config: transformers loads it (a warning)
    and its generate() applies the rest, here repetition_penalty 1.3. `snlp export` of its conversion failed with
    transformers' multi-line 'GenerationConfig is invalid' after config.json was written (the --out then refused as
    not empty). Now the -1 is dropped, the rest kept: the export's generate() equals the source's, token for token."""
    from snlp.apps.cli import main

    src, exp = tmp_path / "src", tmp_path / "exp"
    hf_tiny("llama", layers=2, bos_token_id=V - 3, eos_token_id=V - 2).save_pretrained(str(src))
    word_tokenizer(V).save_pretrained(str(src))
    (src / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": V - 3, "eos_token_id": V - 2, "pad_token_id": -1, "repetition_penalty": 1.3}))
    assert main(["convert", str(src), "--out", str(tmp_path / "ck")]) == 0
    assert main(["export", str(tmp_path / "ck"), "--out", str(exp)]) == 0, capsys.readouterr().err
    got = json.loads((exp / "generation_config.json").read_text())
    assert got["repetition_penalty"] == 1.3 and got.get("pad_token_id") is None
    x = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    a, b = (transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval() for d in (src, exp))
    with torch.no_grad():
        assert b.generate(x, max_new_tokens=12).tolist() == a.generate(x, max_new_tokens=12).tolist()


def test_an_exported_folder_has_the_umasks_mode_as_save_pretrained_gives_it(tmp_path):
    """export_hf writes into a hidden folder beside `out` and renames it: made by tempfile.mkdtemp, that folder was
    0700 whatever the umask, so an export (snlp export --out) was unreadable to every other user where
    save_pretrained's own folder is not. The folder now gets the mode os.mkdir gives under the umask, checked
    against a folder made so, beside it."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        out = export_hf(snlp_llama(), tmp_path / "exp")
        (tmp_path / "ref").mkdir()
    finally:
        os.umask(old)
    mode = stat.S_IMODE(out.stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "ref").stat().st_mode) == 0o755, oct(mode)


def test_an_interrupted_export_leaves_no_folder_that_loads_as_a_model_without_its_tokenizer(tmp_path, monkeypatch):
    """export_hf wrote config.json, generation_config.json and model.safetensors straight into `out`, then the
    tokenizer: interrupted there (Ctrl-C, a full disk), `out` held a model transformers loads, without the tokenizer
    it was exported with (and a rerun was refused as not empty). Now the files are written beside it and moved in
    when all are written: an interrupted export leaves nothing at `out` and no hidden leftovers; a whole one is
    transformers' model of the source. overwrite=True still removes a stale weight shard it does not write."""
    from transformers import PreTrainedTokenizerFast

    model, tok = snlp_llama(), Tokenizer.from_hf(word_tokenizer(V))
    save, calls = PreTrainedTokenizerFast.save_pretrained, []

    def interrupted(self, *a, **k):  # the first save is the reload check's, in a temporary folder; the second, out's
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return save(self, *a, **k)

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_hf(model, tmp_path / "exp", tok)
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", save)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "model-00001-of-00002.safetensors").write_text("a stale shard")
    for out in (export_hf(model, tmp_path / "exp", tok), export_hf(model, tmp_path / "old", tok, overwrite=True)):
        assert not (out / "model-00001-of-00002.safetensors").exists()
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
        assert transformers.AutoTokenizer.from_pretrained(str(out))("t1 t2")["input_ids"] == tok.prompt_ids("t1 t2")
        x = ids()
        with torch.no_grad():
            torch.testing.assert_close(hf(x).logits.double(), model(x).double(), atol=1e-4, rtol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "old"]
    with pytest.raises(ValueError, match="vocab_size is transformers' own"):  # it would describe another model
        export_hf(model, tmp_path / "extra", config_extra={"vocab_size": 5, "note": 1})
    assert json.loads((export_hf(model, tmp_path / "extra", config_extra={"note": 1}) / "config.json").read_text())[
        "note"] == 1


def test_convert_keeps_an_fp64_source_in_fp64_when_asked(tmp_path):
    """`snlp convert --dtype` offered no float64, so an fp64 transformers folder could only be converted rounded to
    fp32 (its logits then ~1e-7 off the source's). With --dtype float64 the checkpoint stores fp64 weights equal to
    the source's, bit for bit, and its logits equal transformers' fp64 forward to fp64 round-off (transformers keeps
    RoPE and RMSNorm in fp32 even in an fp64 model, hence not 1e-12)."""
    from snlp.apps.cli import main
    from snlp.io.checkpoint import stored_dtype

    hf = hf_tiny("llama", layers=2, dtype=torch.float64)
    src = tmp_path / "src"
    hf.save_pretrained(str(src))
    word_tokenizer(V).save_pretrained(str(src))
    assert main(["convert", str(src), "--out", str(tmp_path / "ck"), "--dtype", "float64"]) == 0
    assert stored_dtype(tmp_path / "ck") == torch.float64
    model, _ = load(tmp_path / "ck", dtype=torch.float64)
    assert torch.equal(model.wte.weight, hf.model.embed_tokens.weight.detach())
    idx = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(idx).logits
        got = model(idx)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

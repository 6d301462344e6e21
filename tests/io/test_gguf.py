"""GGUF files in: `snlp.from_hf(FILE.gguf)` against outside references, on tiny GGUFs written here with gguf's own
GGUFWriter the way llama.cpp's convert_hf_to_gguf writes them (Llama q/k rows permuted for its RoPE, Qwen2 biases,
Qwen3 q/k norms; tied = no output.weight). The converted weights equal gguf.quants.dequantize of the file's tensors
(reverse-permuted by this file's own code) bit for bit, and the converted logits equal those of a transformers model
holding those dequantized weights. What transformers' GGUF loader would load silently wrong (it initialises a weight
it finds no tensor for at random and reads no rope scaling for these architectures) is refused in one line before
any weights load (snlp.io.hf.check_gguf)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

from snlp.io.hf import from_hf  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet (tokenizers' ByteLevel) and one merge, " t": a BPE that encodes any text."""
    from tokenizers.pre_tokenizers import ByteLevel

    return SPECIALS + sorted(ByteLevel.alphabet()) + ["Ġt"]


def llama_permute(w, n_head, n_kv):  # llama.cpp convert_hf_to_gguf: LlamaModel.permute
    n = n_kv if n_kv is not None and n_kv != n_head else n_head
    return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w, n_head, n_kv):  # its inverse, written out here rather than taken from transformers
    n = n_kv if n_kv is not None and n_kv != n_head else n_head
    return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(x: np.ndarray, t, rng) -> np.ndarray:
    """x as GGUF tensor data of type t: gguf's own quantiser, or (K-quants, which gguf cannot quantise) random
    blocks with sane fp16 scales, whose values the test takes from gguf's dequantiser."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if t == Q.F32:
        return x
    if t == Q.F16:
        return x.astype(np.float16)
    if t in (Q.Q4_K, Q.Q6_K):
        bs, ts = gguf.GGML_QUANT_SIZES[t]
        b = rng.integers(0, 256, size=(x.shape[0], x.shape[1] // bs, ts), dtype=np.uint8)
        d = np.full(b.shape[:2], 0.01, np.float16).view(np.uint8).reshape(*b.shape[:2], 2)
        if t == Q.Q6_K:
            b[..., -2:] = d  # d is a block's last field
        else:
            b[..., 0:2], b[..., 2:4] = d, d  # d and dmin open a Q4_K block
        return b.reshape(x.shape[0], -1)
    return quants.quantize(x, t)


def tiny_hf(kind="llama", tie=False, **kw):
    C, M = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]
    torch.manual_seed(0)
    cfg = C(vocab_size=len(byte_tokens()), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=3e-6,
            tie_word_embeddings=tie, rope_parameters={"rope_type": "default", "rope_theta": 5e5}, **kw)
    m = M(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.05 * torch.randn_like(p))
    return m


_NAMES = (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
          ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
          ("mlp.down_proj", "ffn_down"), ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
          ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm"))


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, l, rest = hf_name.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{l}.{dict(_NAMES)[module]}.{leaf}"


def write_gguf(path, hf, arch="llama", qtype=Q.F32, meta=(), tensors=None, drop=(), add_bos=False, bos=1) -> dict:
    """Write transformers model `hf` as a GGUF file of tensor type `qtype` (norms and biases F32, as llama.cpp keeps
    them); `meta` (callables on the writer) add fields, `tensors` extra tensors, `drop` names tensors left out.
    Returns {transformers name: the fp32 weight the file holds}, dequantized by gguf and un-permuted here."""
    c, rng = hf.config, np.random.default_rng(0)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(hd)
    if arch == "qwen3":
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(byte_tokens())
    w.add_token_types([3] * len(SPECIALS) + [1] * 257)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(TEMPLATE)
    for f in meta:
        f(w)
    nh, nkv, held = c.num_attention_heads, c.num_key_value_heads, {}
    for k, x in hf.state_dict().items():
        g = gguf_name(k)
        if (k == "lm_head.weight" and c.tie_word_embeddings) or g in drop:
            continue
        x = x.float().numpy()
        perm = arch == "llama" and (".attn_q." in g or ".attn_k." in g)
        kv = nh if ".attn_q." in g else nkv
        y = llama_permute(x, nh, kv) if perm else x
        t = Q.F32 if x.ndim == 1 else qtype
        data = encode(y, t, rng)
        w.add_tensor(g, data, raw_dtype=None if t in (Q.F32, Q.F16) else t)
        deq = quants.dequantize(data, t).astype(np.float32).reshape(y.shape)
        held[k] = torch.from_numpy(np.ascontiguousarray(llama_unpermute(deq, nh, kv) if perm else deq))
    for g, data in (tensors or {}).items():  # an array, or (raw bytes, their tensor type)
        w.add_tensor(g, *data[:1], raw_dtype=data[1]) if isinstance(data, tuple) else w.add_tensor(g, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def ours(model, hf_name: str, cfg) -> torch.Tensor:
    """The converted model's tensor for a transformers weight name."""
    sd, top = model.state_dict(), {"model.embed_tokens.weight": "wte.weight", "model.norm.weight": "ln_f",
                                   "lm_head.weight": "lm_head.weight"}
    if hf_name in top:
        return sd[top[hf_name]]
    _, _, l, rest = hf_name.split(".", 3)
    b, F = f"blocks.{l}.", cfg.intermediate_size
    return {"self_attn.q_proj.weight": lambda: sd[b + "attn.c_q.weight"],
            "self_attn.k_proj.weight": lambda: sd[b + "attn.c_k.weight"],
            "self_attn.v_proj.weight": lambda: sd[b + "attn.c_v.weight"],
            "self_attn.q_proj.bias": lambda: sd[b + "attn.c_q.bias"],
            "self_attn.k_proj.bias": lambda: sd[b + "attn.c_k.bias"],
            "self_attn.v_proj.bias": lambda: sd[b + "attn.c_v.bias"],
            "self_attn.o_proj.weight": lambda: sd[b + "attn.c_proj.weight"],
            "self_attn.q_norm.weight": lambda: sd[b + "attn.q_norm"],
            "self_attn.k_norm.weight": lambda: sd[b + "attn.k_norm"],
            "mlp.gate_proj.weight": lambda: sd[b + "mlp.c_fc.weight"][:F],
            "mlp.up_proj.weight": lambda: sd[b + "mlp.c_fc.weight"][F:],
            "mlp.down_proj.weight": lambda: sd[b + "mlp.c_proj.weight"],
            "input_layernorm.weight": lambda: sd[b + "ln_attn"],
            "post_attention_layernorm.weight": lambda: sd[b + "ln_mlp"]}[rest]()


def check_exact(path, hf, held):
    """Every converted weight is the file's dequantized tensor bit for bit; the converted logits equal transformers'
    model holding those weights; the metadata (theta, eps, context, GQA, tying) came through."""
    model, tok = from_hf(str(path))
    c, cfg = hf.config, model.config
    assert (cfg.rope_base, cfg.norm_eps, cfg.sequence_len, cfg.n_head, cfg.n_kv_head, cfg.tie_embeddings) == (
        5e5, pytest.approx(3e-6), 1024, 4, 2, c.tie_word_embeddings)
    assert model.wte.weight.dtype == torch.float32
    for k, v in held.items():
        assert torch.equal(ours(model, k, c), v), k
    if c.tie_word_embeddings:
        assert model.lm_head.weight is model.wte.weight
    sd = hf.state_dict()
    sd.update(held)
    if c.tie_word_embeddings:
        sd["lm_head.weight"] = held["model.embed_tokens.weight"]
    hf.load_state_dict(sd)
    ids = torch.randint(0, c.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids), hf(ids).logits)
    return model, tok


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K],
                         ids=lambda t: t.name)
def test_llama_gguf_dequantizes_bit_for_bit(tmp_path, qtype):
    hf = tiny_hf("llama", tie=qtype in (Q.Q4_1, Q.Q6_K))  # tied (no output.weight) and untied files
    held = write_gguf(tmp_path / "m.gguf", hf, qtype=qtype)
    check_exact(tmp_path / "m.gguf", hf, held)


@pytest.mark.parametrize("case", ["linear x1", "linear x4", "rope_freqs of ones"])
def test_gguf_linear_rope_scaling_loads(tmp_path, case):
    """Linear rope scaling (what llama.cpp's converter writes for `rope_scaling: {type: linear, factor}`) was refused,
    though snlp runs it: transformers' GGUF mapping reads no rope.scaling, so from_hf sets it on the config and the
    logits equal a transformers model built with that scaling. Factor 1 and a `rope_freqs` table of ones ('llama3'
    scaling that scales nothing) leave every rotary frequency as it is."""
    import copy

    hf, factor = tiny_hf("llama"), {"linear x1": 1.0, "linear x4": 4.0}.get(case)
    if factor is not None:
        cfg = copy.deepcopy(hf.config)
        cfg.rope_parameters = {"rope_type": "linear", "factor": factor, "rope_theta": 5e5}
        ref = transformers.LlamaForCausalLM(cfg).eval()
        ref.load_state_dict(hf.state_dict())
        hf, kw = ref, dict(meta=[lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
                                 lambda w: w.add_rope_scaling_factor(factor)])
    else:
        kw = dict(tensors={"rope_freqs.weight": np.ones(32, np.float32)})
    held = write_gguf(tmp_path / "m.gguf", hf, **kw)
    model, _ = check_exact(tmp_path / "m.gguf", hf, held)
    assert model.config.rope_scaling == (None if factor in (None, 1.0) else {"rope_type": "linear", "factor": 4.0})


def test_qwen2_gguf_biases(tmp_path):
    hf = tiny_hf("qwen2")
    held = write_gguf(tmp_path / "m.gguf", hf, arch="qwen2", qtype=Q.Q8_0)
    assert any(k.endswith("q_proj.bias") for k in held)
    check_exact(tmp_path / "m.gguf", hf, held)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_qwen3_gguf_head_dim_from_key_length(tmp_path, head_dim):
    """transformers' Qwen3 GGUF mapping reads no attention.key_length: its config kept Qwen3Config's default
    head_dim 128, so a Qwen3 of another head_dim failed to load ('corrupt or unreadable')."""
    hf = tiny_hf("qwen3", tie=True, head_dim=head_dim)
    held = write_gguf(tmp_path / "m.gguf", hf, arch="qwen3", qtype=Q.F16)
    model, _ = check_exact(tmp_path / "m.gguf", hf, held)
    assert model.config.head_dim == head_dim


def test_gguf_tokenizer_and_chat(tmp_path):
    hf = tiny_hf("llama", tie=True)
    write_gguf(tmp_path / "m.gguf", hf)
    _, tok = from_hf(str(tmp_path / "m.gguf"))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    for text in ["  many   spaces\n\n\tx", "émoji 🙂 日本語 12345", "<|im_start|>user\nhi<|im_end|>", " lead"]:
        assert tok.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(tok.encode(text)) == text
    msgs = [{"role": "user", "content": "Hi 🙂"}, {"role": "assistant", "content": "Yo"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (tok.bos_id, tok.eos_id) == (1, 2)


def test_a_gguf_separates_documents_by_its_own_bos_token_id(tmp_path):
    """llama.cpp's converter writes config.json's bos_token_id where tokenizer_config.json names no BOS (Qwen2.5: id
    151643, <|endoftext|>, though its transformers tokenizer has none and separates by <|im_end|>): the GGUF's BOS is
    the converted tokenizer's separator and fingerprint, as transformers' tokenizer of the same file says."""
    hf = tiny_hf("qwen2")
    seps = {}
    for bos in (0, 1):
        write_gguf(tmp_path / f"q{bos}.gguf", hf, arch="qwen2", bos=bos)
        _, tok = from_hf(str(tmp_path / f"q{bos}.gguf"))
        ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f"q{bos}.gguf")
        assert tok.bos_id == ref.bos_token_id == bos and tok.eos_id == ref.eos_token_id == 2
        seps[bos] = tok.tok.to_str(), tok.fingerprint()
    assert seps[0][0] == seps[1][0] and seps[0][1] != seps[1][1]  # one tokenizer.json, two separators: two caches


def _refused(monkeypatch, path, match):
    """from_hf(path) refuses in one line naming `match`, before transformers loads any weights."""
    def no_weights(*a, **k):
        raise AssertionError("weights were loaded before the refusal")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(ValueError, match=match) as e:
        from_hf(str(path))
    assert "\n" not in str(e.value)


def test_gguf_refusals_before_weights(tmp_path, monkeypatch):
    """Each of these loaded silently before: transformers drops the rope scaling of a Llama GGUF (a rope_freqs table,
    a yarn rope.scaling.type), initialises at random the weights a file lacks (a missing tensor, the other shards of a
    split file, a mixture of experts' expert FFNs, which no dense Llama parameter maps)."""
    hf, f32 = tiny_hf("llama"), np.zeros(32, np.float32)
    cases = {
        "rope_freqs": dict(tensors={"rope_freqs.weight": f32}),
        "rope scaling 'yarn'.*only 'linear' and 'llama3'": dict(meta=[  # Qwen2.5's 128k: not 'convert the folder'
            lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN), lambda w: w.add_rope_scaling_factor(4.0)]),
        r"lacks 1 tensor\(s\).*blk.1.ffn_up.weight": dict(drop=("blk.1.ffn_up.weight",)),
        "shard 1 of a split GGUF": dict(meta=[lambda w: w.add_uint16("split.no", 0),
                                              lambda w: w.add_uint16("split.count", 3)]),
        "mixture of experts": dict(meta=[lambda w: w.add_expert_count(4), lambda w: w.add_expert_used_count(2)],
                                   drop=("blk.0.ffn_up.weight",),
                                   tensors={"blk.0.ffn_up_exps.weight": np.zeros((4, 512, 256), np.float32)}),
        "holds tensors a dense llama model has not": dict(tensors={"blk.0.extra.weight": f32}),
    }
    for i, (match, kw) in enumerate(cases.items()):
        write_gguf(tmp_path / f"m{i}.gguf", hf, **kw)
        _refused(monkeypatch, tmp_path / f"m{i}.gguf", match)
    whole = (tmp_path / "m5.gguf").read_bytes()
    for i, data in enumerate([whole[: len(whole) // 2], whole[:300], b"", b"not a gguf\n" * 50]):
        (tmp_path / f"bad{i}.gguf").write_bytes(data)
        _refused(monkeypatch, tmp_path / f"bad{i}.gguf", "not a readable GGUF file")


def test_gguf_unsupported_architecture_and_type(tmp_path, monkeypatch):
    hf = tiny_hf("llama")
    for arch in ("phi3", "mistral"):  # llama.cpp writes no `mistral` (Mistral is `llama`, its q/k rows permuted)
        w = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
        w.add_block_count(1)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        _refused(monkeypatch, tmp_path / f"{arch}.gguf", f"unsupported architecture '{arch}'")
    w = gguf.GGUFWriter(str(tmp_path / "be.gguf"), "llama", endianess=gguf.GGUFEndian.BIG)  # gguf_convert_endian's
    w.add_block_count(1)  # output: transformers' reader said 'GGUF v50331648; this reader handles v2 and v3'
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _refused(monkeypatch, tmp_path / "be.gguf", "big-endian GGUF file.*gguf_convert_endian")
    (tmp_path / "M.GGUF").write_bytes((tmp_path / "phi3.gguf").read_bytes())  # snlp.load of it names snlp convert,
    _refused(monkeypatch, tmp_path / "M.GGUF", "named [*].gguf only; rename it to M.gguf")  # which said 'no .gguf'
    q8_1 = np.zeros((512, 256 // 32 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), np.uint8)  # a type gguf cannot dequantize
    write_gguf(tmp_path / "q81.gguf", hf, tensors={"blk.0.ffn_up.weight": (q8_1, Q.Q8_1)}, drop=("blk.0.ffn_up.weight",))
    _refused(monkeypatch, tmp_path / "q81.gguf", "unsupported tensor type Q8_1")


@pytest.mark.parametrize("add_bos", [False, True])
def test_plain_prompt_as_the_models_own_tokenizer(tmp_path, add_bos):
    """`snlp generate --prompt` feeds what transformers' tokenizer(text) gives (llama.cpp honours add_bos_token the
    same way): SmolLM2-style files (add_bos_token false) got their `bos_id`, <|im_start|>, put before the text."""
    import argparse

    from snlp.apps.generate import prompt_ids

    write_gguf(tmp_path / "m.gguf", tiny_hf("llama", tie=True), add_bos=add_bos)
    _, tok = from_hf(str(tmp_path / "m.gguf"))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    args = argparse.Namespace(chat=False, prompt="Hi there", eos_id=None)
    assert prompt_ids(args, tok)[0] == ref("Hi there")["input_ids"]
    assert (ref("Hi there")["input_ids"][0] == tok.bos_id) == add_bos


def test_load_of_a_gguf_names_the_conversion(tmp_path):
    """snlp.load reads converted checkpoints; given the .gguf itself it said only 'not a directory'."""
    from snlp import load

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="snlp convert FILE --out DIR"):
        load(tmp_path / "m.gguf")


def test_a_qwen2_gguf_exports_with_the_tokenizer_transformers_reads_back(tmp_path):
    """transformers 5 reads a `qwen2` folder's tokenizer as Qwen2Tokenizer, rebuilt with Qwen2's pre-tokenizer and
    NFC normaliser, so `snlp export` checks the tokenizer reads back as written. A Qwen2 GGUF as llama.cpp writes it
    (tokenizer.ggml.pre "qwen2") converts to the same pre-tokenizer without the NFC (transformers' GGUF reader sets
    none): exported, the ids equal snlp's on NFC text (what the original Qwen2 tokenizer computes too). A file
    without that field has GPT-2's pre-tokenizer, which a Qwen2 folder cannot carry: refused in one line."""
    from snlp.io.hf import export_hf

    write_gguf(tmp_path / "m.gguf", tiny_hf("qwen2"), arch="qwen2", meta=[lambda w: w.add_tokenizer_pre("qwen2")])
    model, tok = from_hf(str(tmp_path / "m.gguf"))
    back = transformers.AutoTokenizer.from_pretrained(str(export_hf(model, tmp_path / "exp", tok)))
    for text in ["  many   spaces\n\n\tx", "émoji 🙂 日本語 12345", "<|im_start|>user\nhi<|im_end|>", " lead it's"]:
        assert back(text, add_special_tokens=False)["input_ids"] == tok.encode(text), text
    write_gguf(tmp_path / "gpt2pre.gguf", tiny_hf("qwen2"), arch="qwen2")
    model, tok = from_hf(str(tmp_path / "gpt2pre.gguf"))
    with pytest.raises(ValueError, match="as Qwen2Tokenizer, with another normalizer / pre_tokenizer") as e:
        export_hf(model, tmp_path / "exp2", tok)
    assert "\n" not in str(e.value) and not (tmp_path / "exp2").exists()


def test_a_float16_load_of_a_gguf_past_its_range_names_the_dtype_and_the_file(tmp_path):
    """from_hf(FILE.gguf, dtype="float16") had transformers cast the dequantized weights: a finite weight past 65504
    arrived as inf and the checkpoint was called broken, named by its folder; the dtype and the file are named."""
    hf = tiny_hf("llama")
    with torch.no_grad():
        hf.lm_head.weight[0, 0] = 1e5
    write_gguf(tmp_path / "m.gguf", hf, qtype=Q.F32)
    with pytest.raises(ValueError, match=r"torch.float16 cannot hold .*m\.gguf's lm_head.weight: \|1e\+05\|"):
        from_hf(tmp_path / "m.gguf", dtype="float16")
    model, _ = from_hf(tmp_path / "m.gguf", dtype="bfloat16")
    assert model.lm_head.weight[0, 0].item() == 99840.0

"""A checkpoint's weights are checked once, at load: a NaN or inf tensor is named there, before any decoding or
evaluation blames a plan for it."""

from pathlib import Path

import pytest
import torch

from snlp.apps.cli import main
from snlp.io.checkpoint import load, save_checkpoint
from snlp.io.tokenizer import Tokenizer
from snlp.model.gpt import GPT, GPTConfig


def tiny():
    m = GPT(GPTConfig.from_depth(2, head_dim=8, width=16, vocab_size=300, sequence_len=16))
    m.init_weights(seed=0)
    return m


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_named_at_load(tmp_path, bad, capsys):
    m = tiny()
    with torch.no_grad():
        m.blocks[1].mlp.c_fc.weight[3, 2] = bad
    tok = Tokenizer.train(["the quick brown fox jumps over the lazy dog\n"] * 20, vocab_size=300)
    save_checkpoint(tmp_path / "ck", m, tok)
    with pytest.raises(ValueError, match=r"blocks\.1\.mlp\.c_fc\.weight .*holds "
                       + ("1 NaN and 0 inf" if bad != bad else "0 NaN and 1 inf")):
        load(tmp_path / "ck")
    # the command line refuses before decoding (it printed <|bos|> eight times and exited 0)
    rc = main(["generate", str(tmp_path / "ck"), "--prompt", "the", "--max-new-tokens", "8"])
    err = capsys.readouterr().err
    assert rc == 2 and "blocks.1.mlp.c_fc.weight" in err and len(err.strip().splitlines()) == 1


def test_finite_weights_load_unchanged(tmp_path):
    m = tiny()
    save_checkpoint(tmp_path / "ck", m)
    m2, _ = load(tmp_path / "ck")
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k


def test_every_loader_names_non_finite_weights(tmp_path):
    """Not only snlp checkpoints: a transformers directory (and a model object), a nanochat checkpoint and an adapted
    drafter with one NaN are refused at load naming the tensor (from_hf loaded them silently and sequential decoding
    then emitted token 0 forever)."""
    import shutil

    from snlp.io.drafter import load_drafter, save_drafter
    from snlp.io.hf import export_hf, from_hf
    from snlp.io.nanochat import load_nanochat
    from snlp.method.drafter import make_drafter
    from snlp.method.plan import Plan

    from transformers import AutoModelForCausalLM

    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=16, sequence_len=16, mlp_act="swiglu",
                    embed_norm=False, x0_residual=False, value_embeds=False, rope_rotate_half=True, norm_weights=True,
                    softcap=0.0, qk_norm="none")
    m = GPT(cfg)
    m.init_weights(seed=0)
    with torch.no_grad():
        m.blocks[1].mlp.c_proj.weight[0, 0] = float("nan")
    export_hf(m, tmp_path / "hf")
    with pytest.raises(ValueError, match=r"blocks\.1\.mlp\.c_proj\.weight .*holds 1 NaN"):
        from_hf(tmp_path / "hf")
    with pytest.raises(ValueError, match="holds 1 NaN"):
        from_hf(AutoModelForCausalLM.from_pretrained(tmp_path / "hf"))

    src = Path(__file__).resolve().parents[1] / "data" / "nanochat" / "nanochat-L"
    shutil.copytree(src, tmp_path / "nc")
    pt = sorted((tmp_path / "nc").glob("model_*.pt"))[-1]
    sd = torch.load(pt, weights_only=True)
    key = next(k for k in sd if k.endswith("mlp.c_fc.weight"))
    sd[key] = sd[key].clone()
    sd[key].view(-1)[0] = float("inf")
    torch.save(sd, pt)
    with pytest.raises(ValueError, match=r"mlp\.c_fc\.weight .*holds 0 NaN and 1 inf"):
        load_nanochat(tmp_path / "nc")

    base = tiny()
    d = make_drafter(base, Plan.parse("1xF1-h0-K1"))
    save_drafter(tmp_path / "dr", d)
    from safetensors.torch import load_file, save_file

    w = load_file(str(tmp_path / "dr" / "drafter.safetensors"))
    k = next(iter(w))
    w[k] = w[k].clone()
    w[k].view(-1)[0] = float("nan")
    save_file(w, str(tmp_path / "dr" / "drafter.safetensors"))
    with pytest.raises(ValueError, match="not finite"):
        load_drafter(tmp_path / "dr", base)


def test_checkpoint_depth_reads_the_config_alone(tmp_path):
    """The depth each kind of checkpoint declares, read without its weights (commands refuse a too-deep plan with
    it before loading): an snlp config.json, a nanochat meta_NNNNNN.json (the step `load` takes), a transformers
    config.json; None where no config tells it (a GGUF file, a missing path)."""
    import json

    from snlp.io.checkpoint import checkpoint_depth

    m = GPT(GPTConfig.from_depth(3, head_dim=8, width=16, vocab_size=64, sequence_len=16))
    ck = save_checkpoint(tmp_path / "ck", m)
    (ck / "model.safetensors").write_bytes(b"garbage")  # never read
    assert checkpoint_depth(ck) == 3 and checkpoint_depth(ck / "config.json") == 3
    nano = tmp_path / "nano"
    nano.mkdir()
    for step, depth in ((100, 5), (200, 7)):
        (nano / f"model_{step:06d}.pt").write_bytes(b"garbage")
        (nano / f"meta_{step:06d}.json").write_text(json.dumps({"model_config": {"n_layer": depth}}))
    assert checkpoint_depth(nano) == 7 and checkpoint_depth(nano / "model_000100.pt") == 5
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 30}))
    assert checkpoint_depth(hf) == 30
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert checkpoint_depth(tmp_path / "m.gguf") is None and checkpoint_depth(tmp_path / "nope") is None


@pytest.mark.parametrize("argv", [["eval", "--dtype", "float16", "--max-tokens", "64", "--plans", "2xF1-h0-K1"],
                                  ["tune", "--dtype", "float16", "--plans", "2xF1-h0-K1"]])
def test_a_float16_cast_that_cannot_hold_a_weight_is_refused(tmp_path, capsys, argv):
    """`snlp eval / tune --dtype float16` (and the harness model's dtype=float16) cast an snlp checkpoint with
    .to(float16): a finite weight past 65504 became inf and every forward after it NaN, without a word. Refused
    in one line naming the tensor and float16; within range the cast goes through."""
    from snlp.eval.harness import SNLPLM
    from snlp.io.weights import cast_model

    m = tiny()
    with torch.no_grad():
        m.blocks[0].attn.c_q.weight[0, 0] = 1e5
    tok = Tokenizer.train(["the quick brown fox jumps over the lazy dog\n"] * 20, vocab_size=300)
    save_checkpoint(tmp_path / "ck", m, tok)
    rc = main([argv[0], str(tmp_path / "ck"), *argv[1:]])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert rc == 2 and len(err) == 1 and "float16 cannot hold" in err[0] and "blocks.0.attn.c_q.weight" in err[0], err
    with pytest.raises(ValueError, match=r"torch.float16 cannot hold .*blocks\.0\.attn\.c_q\.weight"):
        SNLPLM(pretrained=str(tmp_path / "ck"), dtype="float16")
    ok = cast_model(tiny(), "cpu", "float16", "tiny")
    assert ok.wte.weight.dtype == torch.float16 and all(bool(torch.isfinite(p).all()) for p in ok.parameters())

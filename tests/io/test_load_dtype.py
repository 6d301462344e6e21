"""An fp64 snlp checkpoint keeps its own weights where a caller asks for fp64: `load(dir, dtype=torch.float64)`, the
harness model's dtype=auto / float64 and `snlp export`. `load` alone builds float32, and a cast after it (what each
of them did) rounded every weight to float32 first: the "checkpoint's own dtype" scored, and exported, other
weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from snlp.io.checkpoint import load, save_checkpoint, stored_dtype
from snlp.io.tokenizer import Tokenizer
from snlp.model.gpt import GPT, GPTConfig


def fp64_model(**cfg) -> GPT:
    """A float64 model whose weights float32 cannot hold (each rounds when cast to float32)."""
    m = GPT(GPTConfig.from_depth(2, head_dim=8, width=16, vocab_size=300, sequence_len=16, **cfg))
    m.init_weights(seed=0)
    m = m.double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.1)
    assert any(not torch.equal(p, p.float().double()) for p in m.parameters())
    return m.eval()


def same_state(a: GPT, b: GPT) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def ckpt(tmp_path):
    m = fp64_model()
    tok = Tokenizer.train(["the quick brown fox jumps over the lazy dog\n"] * 20, vocab_size=300)
    return m, save_checkpoint(tmp_path / "ck", m, tok)


def test_load_in_float64_keeps_an_fp64_checkpoints_weights(ckpt):
    m, ck = ckpt
    assert stored_dtype(ck) == torch.float64
    assert same_state(load(ck, dtype=torch.float64)[0], m)
    assert load(ck)[0].wte.weight.dtype == torch.float32  # no dtype: float32, as before
    assert same_state(load(ck, dtype=torch.bfloat16)[0], m.bfloat16())  # one rounding, from the stored weights
    with pytest.raises(ValueError, match="a floating torch dtype"):
        load(ck, dtype="float64")


@pytest.mark.parametrize("dtype", ["auto", "float64"])
def test_the_harness_model_scores_an_fp64_checkpoints_own_weights(ckpt, dtype):
    pytest.importorskip("lm_eval")
    from snlp.eval.harness import SNLPLM

    m, ck = ckpt
    lm = SNLPLM(pretrained=str(ck), dtype=dtype, device="cpu")
    assert same_state(lm.model, m)


def test_snlp_export_of_an_fp64_checkpoint_writes_its_own_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    from snlp.apps.cli import main
    from snlp.io.hf import from_hf

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    src = transformers.LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    m = from_hf(src)[0]  # a Llama-family snlp model in float64
    assert m.wte.weight.dtype == torch.float64
    ck = save_checkpoint(tmp_path / "ck", m)
    assert main(["export", str(ck), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.dtype == torch.float64
    assert all(torch.equal(a, b) for a, b in zip(hf.state_dict().values(), src.state_dict().values()))
    assert same_state(from_hf(str(tmp_path / "hf"))[0], m)


def test_a_truncated_checkpoint_is_named_as_load_names_it_where_its_stored_dtype_is_read_first(ckpt, tmp_path):
    """stored_dtype read the safetensors header raw: a truncated file gave safetensors' own 'Error while deserializing
    header' (a SafetensorError) to the harness's dtype=auto and to `snlp export`, which read it before `load` says
    'corrupt or truncated weights file'."""
    from snlp.apps.cli import main

    m, ck = ckpt
    wf = ck / "model.safetensors"
    wf.write_bytes(wf.read_bytes()[:100])
    with pytest.raises(ValueError, match="corrupt or truncated weights file"):
        stored_dtype(ck)
    pytest.importorskip("lm_eval")
    from snlp.eval.harness import SNLPLM

    with pytest.raises(ValueError, match="corrupt or truncated weights file"):
        SNLPLM(pretrained=str(ck), dtype="auto")
    assert main(["export", str(ck), "--out", str(tmp_path / "hf")]) == 2


def test_snlp_export_reads_the_stored_dtype_of_a_checkpoint_named_by_a_file_inside_it(ckpt, tmp_path):
    """`snlp export` takes what load takes (a file inside the checkpoint, a leading ~); the stored dtype was read
    only for the folder itself, so `snlp export CK/model.safetensors` of an fp64 checkpoint still wrote float32."""
    transformers = pytest.importorskip("transformers")
    from snlp.apps.cli import main
    from snlp.io.hf import from_hf

    src = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32)).double().eval()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # weights float32 cannot hold
    m = from_hf(src)[0]
    ck = save_checkpoint(tmp_path / "ck", m)
    assert main(["export", str(ck / "model.safetensors"), "--out", str(tmp_path / "hf")]) == 0
    assert same_state(from_hf(str(tmp_path / "hf"))[0], m)


def test_snlp_adapt_base_in_float64_is_the_checkpoints_own(ckpt):
    """`snlp adapt --dtype float64` (load_base) loaded float32 and cast: the base every drafter distils from had its
    weights rounded to float32."""
    from snlp.train.adapt import load_base

    m, path = ckpt
    base, tok = load_base(str(path), "float64")
    assert tok is not None and same_state(base, m)
    assert next(load_base(str(path))[0].parameters()).dtype == torch.float32  # the default stays float32


NANOCHAT = Path(__file__).resolve().parents[1] / "data" / "nanochat"


def paper_layout(src: Path, dst: Path) -> Path:
    """`src`'s nanochat checkpoint re-saved as the paper's code keeps its weights on a GPU: the embeddings in bf16,
    every other tensor in fp32, in the file's own order (resid_lambdas first)."""
    dst.mkdir()
    sd = torch.load(src / "model_000000.pt", map_location="cpu", weights_only=True)
    keep = ("transformer.wte.", "value_embeds.")
    torch.save({k: v if k.startswith(keep) else v.float() for k, v in sd.items()}, dst / "model_000000.pt")
    shutil.copy(src / "meta_000000.json", dst / "meta_000000.json")
    return dst


@pytest.mark.parametrize("name", ["nanochat-L", "upstream-2c4473d", "upstream-92d63d4", "paper-layout"])
def test_dtype_auto_of_a_nanochat_checkpoint_is_what_transformers_auto_picks(name, tmp_path):
    """The harness model's dtype=auto built a nanochat checkpoint in float32 (load's default) whatever its weights,
    and stored_dtype refused the folder as a corrupt snlp checkpoint. transformers' dtype="auto" takes a config's
    dtype, else the file's first floating tensor's (nanochat's meta has none): stored_dtype, load(dtype=) and the
    harness's auto now agree with it, bf16 for the vendored all-bf16 files, fp32 for the paper's layout."""
    pytest.importorskip("lm_eval")
    from transformers.modeling_utils import get_state_dict_dtype

    from snlp.eval.harness import SNLPLM

    d = paper_layout(NANOCHAT / "nanochat-L", tmp_path / "p") if name == "paper-layout" else NANOCHAT / name
    want = get_state_dict_dtype(torch.load(d / "model_000000.pt", map_location="cpu", weights_only=True))
    assert want == (torch.float32 if name == "paper-layout" else torch.bfloat16)
    assert stored_dtype(d) == stored_dtype(d / "model_000000.pt") == want
    tok = Tokenizer.train(["the quick brown fox jumps over the lazy dog\n"] * 20, vocab_size=300)  # none comes with it
    lm = SNLPLM(pretrained=str(d), tokenizer=tok, dtype="auto", device="cpu")
    assert lm.model.wte.weight.dtype == want and f"dtype={str(want).removeprefix('torch.')}," in lm.model_args
    assert load(d, dtype=stored_dtype(d))[0].wte.weight.dtype == want
    assert load(d)[0].wte.weight.dtype == torch.float32  # no dtype: float32, as nanochat's CPU loader upcasts

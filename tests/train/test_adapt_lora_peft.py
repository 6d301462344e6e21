"""LoRA drafters against peft, the reference LoRA: the same A, B, alpha and rank on the same matrices give the same
model (peft's merged LoRA model run by transformers = the drafter's merged model), B = 0 at the start, peft's rank
rule (any rank on any matrix; a rank above a matrix's smaller dimension is rank-deficient, not an error); and the
adapt options a mode cannot honour are refused before any work."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from snlp.io.hf import from_hf
from snlp.method.drafter import make_drafter
from conftest import make_model

pytestmark = pytest.mark.usefixtures("one_thread")

# snlp's suffix matrices and the transformers Llama modules they come from (snlp.io.hf): c_fc is gate_proj and
# up_proj stacked, so its one delta B A is peft's pair of deltas with a shared A and B cut in two halves
TARGETS = {"attn.c_q": ["self_attn.q_proj"], "attn.c_k": ["self_attn.k_proj"], "attn.c_v": ["self_attn.v_proj"],
           "attn.c_proj": ["self_attn.o_proj"], "mlp.c_fc": ["mlp.gate_proj", "mlp.up_proj"],
           "mlp.c_proj": ["mlp.down_proj"]}


def test_lora_drafter_is_peft_lora_with_the_same_a_b_alpha_rank_and_targets():
    """A LoRA drafter of rank r and alpha a whose deltas are set, merged, equals peft's LoRA model (r, a, every
    projection of the suffix layers) holding the same A and B, run by transformers; both scale alpha / r, and both
    start with B = 0 (the untrained drafter is the post-hoc one, bit for bit)."""
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from test_adapt import hf_tiny

    hf = hf_tiny(seed=1, layers=4).double()
    base, _ = from_hf(hf)
    base = base.double()
    r, alpha = 4, 10.0
    d = make_drafter(base, "2xF1-h0-K1", rank=r, alpha=alpha)
    x = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(d.merged().model(x), base(x))  # B = 0: W0 + 0 exactly
    sd = d.suffix_state()
    adapted = sorted({k.split(".parametrizations")[0].split(".", 2)[2] for k in sd if ".parametrizations." in k})
    assert adapted == sorted(TARGETS)  # every projection of the block, nothing else
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for k, v in sd.items():
            if k.endswith(".B"):
                v.copy_(torch.randn(v.shape, generator=gen, dtype=v.dtype) * 0.1)
    pm = peft.get_peft_model(hf, peft.LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0, layers_to_transform=[2, 3],
        target_modules=[t.split(".")[1] for ts in TARGETS.values() for t in ts]))
    with torch.no_grad():
        for l in (2, 3):
            for ours, theirs in TARGETS.items():
                A, B = (sd[f"blocks.{l}.{ours}.parametrizations.weight.0.{n}"] for n in "AB")
                for t, half in zip(theirs, B.chunk(len(theirs), 0)):
                    mod = pm.base_model.model.model.layers[l].get_submodule(t)
                    assert mod.scaling["default"] == alpha / r
                    assert torch.equal(mod.lora_B["default"].weight, torch.zeros_like(half))  # peft's init: B = 0
                    mod.lora_A["default"].weight.copy_(A)
                    mod.lora_B["default"].weight.copy_(half)
        ref = pm(x).logits.double()  # transformers returns fp32 logits (about 1e-8 of rounding here)
    got = d.merged().model(x)
    assert (got - ref).abs().max().item() < 1e-6
    assert (got - base(x)).abs().max().item() > 1e-2  # the deltas moved the logits


def test_lora_on_a_model_with_value_embedding_gates_takes_ranks_above_the_gates_size():
    """The value-embedding gate (n_kv_head x 12 channels in nanochat) is a suffix linear too: a rank above its
    smaller dimension is a rank-deficient delta there, as in peft, not a refusal of every useful rank (before:
    `--lora-rank 3 exceeds attn.ve_gate's smaller dimension 2`)."""
    m = make_model(n_layer=4, n_head=4, n_kv_head=2, n_embd=32, value_embeds=True)
    x = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(0))
    d = make_drafter(m, "2xF1-h0-K1", rank=8)
    assert any("ve_gate.parametrizations" in k for k in d.suffix_state())
    assert torch.equal(d.merged().model(x), m(x))  # B = 0
    with pytest.raises(ValueError, match="--lora-rank 999"):  # beyond every matrix of the block: a typo
        make_drafter(m, "2xF1-h0-K1", rank=999)


@pytest.mark.parametrize("kw,says", [
    (dict(lora_alpha=16.0), "--lora-alpha scales LoRA deltas"),
    (dict(lora_alpha=16.0, lora_rank=0), "--lora-alpha scales LoRA deltas"),
])
def test_lora_alpha_without_a_lora_rank_is_refused_not_ignored(kw, says):
    """--lora-alpha of a full-weight run (rank 0) scaled nothing and was dropped without a word."""
    from snlp.train.adapt import AdaptConfig

    with pytest.raises(ValueError, match=says):
        AdaptConfig(src="x", plan="2xF1-h0-K1", out="o", **kw).check()
    with pytest.raises(ValueError, match=says):
        make_drafter(make_model(n_layer=4), "2xF1-h0-K1", alpha=16.0)


@pytest.mark.parametrize("kw,says", [(dict(rank=True), "--lora-rank must be an integer >= 0 .*got True"),
                                     (dict(rank=False, alpha=None), "--lora-rank must be an integer >= 0 .*got False"),
                                     (dict(rank=4, alpha=True), "--lora-alpha must be a finite number > 0 .*got True")])
def test_a_bool_lora_rank_or_alpha_is_refused_not_read_as_a_number(kw, says):
    """bool is an int in Python: rank=True passed check_rank and failed later in torch.empty with a TypeError, and
    alpha=True built a drafter scaling by 1.0. Refused in one line, as Plan refuses a bool count; numbers build."""
    from snlp.method.lowrank import check_rank

    with pytest.raises(ValueError, match=says) as e:
        check_rank(kw["rank"], kw.get("alpha"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=says):
        make_drafter(make_model(n_layer=4), "2xF1-h0-K1", **kw)
    d = make_drafter(make_model(n_layer=4), "2xF1-h0-K1", rank=1, alpha=1.0)
    assert (d.rank, d.alpha) == (1, 1.0)


def test_every_integer_setting_of_adapt_refuses_a_bool():
    """AdaptConfig's integer settings (found here from the dataclass's annotations) passed check() as bools (steps=True
    reached the shared loop's settings as `steps: True`): each is refused in one line naming its flag."""
    from snlp.train.adapt import AdaptConfig

    ints = [f.name for f in dataclasses.fields(AdaptConfig) if f.type in ("int", "int | None")]
    assert {"steps", "lora_rank", "self_distill", "seed"} <= set(ints)
    for name in ints:
        for value in (True, False):
            cfg = AdaptConfig(src="x", plan="2xF1-h0-K1", out="o", **{name: value})
            with pytest.raises(ValueError, match=f"^--{name.replace('_', '-')} takes an integer, not {value}$"):
                cfg.check()


@pytest.mark.parametrize("flag,value", [("lr", 1e-2), ("warmup_steps", 3), ("warmdown", 0.5), ("grad_clip", 0.5),
                                        ("eval_every", 7), ("log_every", 3), ("seed", 4), ("stop_after", 2),
                                        ("hidden_weight", 2.0), ("kl_weight", 0.5)])
def test_from_model_refuses_training_options_it_cannot_honour(flag, value):
    """--from-model trains nothing: the optimizer, schedule, loss weights, logging and stop settings were silently
    dropped; each is refused before any work, naming the flag. (--tau and --kv shape the validation it runs, --device
    places it and --cache-dir keeps its tokenised text: honoured.)"""
    from snlp.train.adapt import AdaptConfig

    cfg = AdaptConfig(src="x", plan="2xF1-h0-K1", out="o", from_model="t", **{flag: value})
    with pytest.raises(ValueError, match=f"--from-model .*--{flag.replace('_', '-')}"):
        cfg.check()
    AdaptConfig(src="x", plan="2xF1-h0-K1", out="o", from_model="t", tau=2.0, kv="own", cache_dir="c",
                device="cpu").check()


def test_a_transformers_directory_without_tokenizer_is_a_from_model_tuned_and_an_export_base(tmp_path):
    """Neither a --from-model TUNED (its suffix alone is read) nor `snlp export DRAFTER --base HF_DIR` (the tokenizer
    is copied only when there is one) needs a tokenizer; both refused a `save_pretrained` directory without one,
    saying "adaptation data must be tokenized with the model's own"."""
    transformers = pytest.importorskip("transformers")
    from snlp.apps.cli import main
    from snlp.io.checkpoint import load
    from snlp.io.drafter import load_drafter
    from snlp.train.adapt import adapt
    from test_adapt import IMPORT, adapt_cfg, hf_tiny

    cfg = adapt_cfg(tmp_path, **IMPORT)  # writes the tiny base checkpoint (with its tokenizer) and the data
    base, _ = load(cfg.src)
    hf_tiny(seed=11, layers=4, initializer_range=0.25).save_pretrained(tmp_path / "base-hf")  # tiny_ckpt's base
    tuned = hf_tiny(seed=11, layers=4, initializer_range=0.25)
    with torch.no_grad():
        tuned.model.layers[3].mlp.gate_proj.weight.mul_(1.01)  # a "fine-tuned" suffix
    tuned.save_pretrained(tmp_path / "tuned-hf")  # model files only, no tokenizer
    res = adapt(dataclasses.replace(cfg, from_model=str(tmp_path / "tuned-hf")))
    assert res.stopped_by == "from_model"
    d = load_drafter(tmp_path / "d", base)
    gate = d.suffix_state()["blocks.3.mlp.c_fc.weight"][: tuned.config.intermediate_size]
    torch.testing.assert_close(gate, tuned.model.layers[3].mlp.gate_proj.weight, atol=0, rtol=0)
    text = cfg.data.split(",")[0]  # a text-only --data: the import keeps its tokenised text in --cache-dir
    adapt(dataclasses.replace(cfg, out=str(tmp_path / "d2"), data=text, cache_dir=str(tmp_path / "cache"),
                              device="cpu", from_model=str(tmp_path / "tuned-hf")))
    assert list((tmp_path / "cache").glob("*.adapt.npz"))  # before: the import never passed --cache-dir on
    assert main(["export", str(tmp_path / "d"), "--base", str(tmp_path / "base-hf"), "--out",
                 str(tmp_path / "out")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    x = torch.randint(0, 90, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, d.model(x), atol=1e-4, rtol=1e-4)

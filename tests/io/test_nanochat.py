"""nanochat / nanochat-snlp checkpoints in (snlp.io.nanochat): the tiny checkpoints under tests/data/nanochat were
written by the paper's own code (nanochat-*, tests/data/nanochat/make_fixtures.py) and by upstream nanochat at the
last commit of each version of its model (upstream-<commit>, make_upstream_fixtures.py), and reference.pt beside
each holds the logits that code computed on them (its GPT.forward, and for nanochat-L its per-layer IDN solve).
snlp must load each with `snlp.load(DIR)` / `snlp convert DIR` and give those logits (fp32, CPU), or, where the
files cannot say which version wrote them, refuse in one line and load with the overrides the refusal names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import argmax_loop

import snlp
from snlp import parallel_forward, sequential_generate, snlp_generate, solve, speculative_generate
from snlp.apps.cli import main as cli_main
from snlp.io.checkpoint import checkpoint_depth
from snlp.io.nanochat import VERSIONS, is_nanochat_dir, load_nanochat, nanochat_stored_dtype, nanochat_versions
from snlp.model.cache import KVCache
from snlp.train.config import TrainConfig
from snlp.train.optim import build_optimizers

DATA = Path(__file__).resolve().parents[1] / "data" / "nanochat"
NAMES = ("nanochat-sw", "nanochat-L", "nanochat-mhc", "nanochat-mix", "nanochat-mhc3")
ATOL = 2e-5  # fp32 logits of order 5: round-off of two implementations of the same function


# upstream nanochat's versions (snlp.io.nanochat.VERSIONS), each checkpoint written by the version's last commit
# (the lambdas version: 201d705, its last commit that runs on a CPU)
UPSTREAM = {"upstream-2c4473d": "base", "upstream-201d705": "lambdas", "upstream-184d4c1": "windows",
            "upstream-83dccc2": "ve32", "upstream-1076f97": "ve32-cap20", "upstream-f068604": "ve12",
            "upstream-92d63d4": "smear"}
VE32 = ("ve32", "ve32-cap20-bf16", "ve32-cap20")  # alike files, other softcap / RoPE tables
ALIKE = {"lambdas": ["lambdas", "windows"], **{k: list(VE32) for k in VE32}}  # what nanochat_versions finds


def ref(name: str) -> dict:
    return torch.load(DATA / name / "reference.pt")


def files_of(d: Path) -> tuple[dict, dict, int | None]:
    sd = torch.load(d / "model_000000.pt")
    mc = json.loads((d / "meta_000000.json").read_text())["model_config"]
    gate = next((v.shape[1] for k, v in sd.items() if k.endswith("attn.ve_gate.weight")), None)
    return sd, mc, gate


def max_err(model, r: dict, key: str = "logits") -> float:
    with torch.no_grad():
        got = model(r["idx"])
    return (got[:, -r[key].shape[1]:] - r[key]).abs().max().item()


@pytest.mark.parametrize("name", list(UPSTREAM))
def test_each_upstream_version_is_placed_by_its_files(name):
    """nanochat_versions places each upstream checkpoint in the version that wrote it, or among the versions whose
    files are alike (a lambdas checkpoint looks like a midtrained windows one; the three ve32 versions alike)."""
    assert nanochat_versions(*files_of(DATA / name)) == ALIKE.get(UPSTREAM[name], [UPSTREAM[name]])


@pytest.mark.parametrize("name", [n for n, v in UPSTREAM.items() if v not in ALIKE])
def test_each_upstream_version_loads_with_the_logits_it_computes(name):
    """snlp.load of a checkpoint an upstream nanochat version wrote gives that version's own fp32 CPU logits:
    base (no lambdas: patched to 1 / 0; RoPE 10000 with bf16 tables; full causal attention past sequence_len = 128
    on 160 tokens), windows (S = T // 2, L = T), ve12 (RoPE 100000, q,k x 1.15, gate 3 sigmoid over 12 channels,
    S = ceil(T / 3 / 128) * 128 = 256, crossed by 272 tokens), smear (upstream HEAD). A loader with the smear
    version's constants for every checkpoint refuses base and windows and gives ve12 logits 2.3 off
    (docs/records/2026-11-27-nanochat-versions.md)."""
    model, tok = snlp.load(DATA / name)
    r = ref(name)
    assert tok is None
    with torch.no_grad():
        torch.testing.assert_close(model(r["idx"]), r["logits"], rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", ["upstream-83dccc2", "upstream-1076f97"])
def test_the_ve32_versions_are_refused_then_load_with_the_named_version(name, tmp_path, capsys):
    """The files of ve32 (softcap 15, bf16 RoPE tables), ve32-cap20-bf16 (softcap 20) and ve32-cap20 (softcap 20,
    fp32 tables) are alike: snlp.load refuses them in one line naming the three and what differs, before any model
    is built; with the version that wrote the checkpoint (overrides={"version": KEY}, or the constants that name
    it) it gives that version's logits, and with another's it does not; `snlp convert --nanochat-override` does the
    same. The smear version's constants give logits 3.7 (ve32) and 4.4 (ve32-cap20) off."""
    r = ref(name)
    with pytest.raises(ValueError, match="one of 3 nanochat versions") as err:
        snlp.load(DATA / name)
    msg = str(err.value)
    assert "\n" not in msg and all(f"version={k} (" in msg for k in VE32)
    assert "rope_bf16=true, softcap=15.0" in msg and "rope_bf16=false, softcap=20.0" in msg
    with pytest.raises(ValueError, match="one of 3"):  # softcap 20 alone leaves two versions
        snlp.load(DATA / name, overrides={"softcap": 20.0})
    for key in VE32:
        model, _ = snlp.load(DATA / name, overrides={"version": key})
        assert (max_err(model, r) <= ATOL) == (key == UPSTREAM[name]), key
        v = VERSIONS[key]
        by_constants, _ = snlp.load(DATA / name, overrides={"softcap": v.softcap, "rope_bf16": v.rope_bf16})
        assert by_constants.config == model.config
    if UPSTREAM[name] == "ve32":  # softcap 15 alone names one version: its rope_bf16 follows
        assert snlp.load(DATA / name, overrides={"softcap": 15.0})[0].config.rope_bf16
        # a meta without window_pattern (mid_train / chat_sft up to 2026-02-01) predates the softcap-20 versions:
        # ve32, run with "L" windows as nanochat's loader patches the pattern
        d = tmp_path / "mid"
        shutil.copytree(DATA / name, d)
        meta = json.loads((d / "meta_000000.json").read_text())
        meta["model_config"].pop("window_pattern")
        (d / "meta_000000.json").write_text(json.dumps(meta))
        cfg = snlp.load(d)[0].config
        assert cfg.softcap == 15.0 and cfg.rope_bf16 and cfg.layer_windows == [cfg.sequence_len] * cfg.n_layer
    with pytest.raises(ValueError, match="fit"):
        snlp.load(DATA / name, overrides={"version": "ve12"})
    out = tmp_path / "conv"
    assert cli_main(["convert", str(DATA / name), "--out", str(out)]) == 2
    assert "one of 3 nanochat versions" in capsys.readouterr().err and not out.exists()
    assert cli_main(["convert", str(DATA / name), "--out", str(out), "--nanochat-override",
                     f"version={UPSTREAM[name]}"]) == 0
    model, _ = snlp.load(out)
    with torch.no_grad():
        torch.testing.assert_close(model(r["idx"]), r["logits"], rtol=0, atol=ATOL)


def test_lambdas_and_a_midtrained_windows_checkpoint_are_refused_then_load_with_the_named_version(tmp_path):
    """A lambdas-version checkpoint (2026-01-11: no windows, full causal attention) and a midtrained one of the
    windows version (mid_train wrote no window_pattern; nanochat's loader then runs "L": windows of sequence_len)
    have alike files and differ past sequence_len (128; 160 tokens): both refused in one line; version=lambdas gives
    201d705's logits, version=windows 184d4c1's run with "L" (its reference logits_L, past sequence_len), and
    neither the other's."""
    mid = tmp_path / "mid"
    shutil.copytree(DATA / "upstream-184d4c1", mid)
    meta = json.loads((mid / "meta_000000.json").read_text())
    meta["model_config"].pop("window_pattern")
    (mid / "meta_000000.json").write_text(json.dumps(meta))
    for d, r, right in ((DATA / "upstream-201d705", ref("upstream-201d705"), "lambdas"),
                        (mid, ref("upstream-184d4c1"), "windows")):
        with pytest.raises(ValueError, match="one of 2 nanochat versions") as err:
            snlp.load(d)
        assert "\n" not in str(err.value) and "version=lambdas (" in str(err.value)
        for key in ("lambdas", "windows"):
            model, _ = snlp.load(d, overrides={"version": key})
            off = max_err(model, r, "logits" if right == "lambdas" else "logits_L")
            assert (off <= ATOL) == (key == right), (d.name, key, off)


def test_a_2025_checkpoint_unpadded_and_compiled_loads_with_patched_lambdas(tmp_path):
    """A checkpoint from before the vocabulary padding (f1bf69d, 2025-12-09: wte / lm_head of vocab_size rows) with
    torch.compile's key prefix loads as the padded one: resid / x0 lambdas set to 1 / 0 (nanochat's patch), every
    layer full causal past sequence_len (128 here, 160 tokens), RoPE 10000 with bf16 tables."""
    d = tmp_path / "old"
    shutil.copytree(DATA / "upstream-2c4473d", d)
    sd = torch.load(d / "model_000000.pt")
    sd = {f"_orig_mod.{k}": v[:100] if k in ("transformer.wte.weight", "lm_head.weight") else v for k, v in sd.items()}
    torch.save(sd, d / "model_000000.pt")
    model, _ = snlp.load(d)
    cfg = model.config
    assert cfg.layer_windows == [-1] * cfg.n_layer and cfg.rope_bf16 and cfg.rope_base == 10000.0
    assert cfg.qk_scale == 1.0 and not cfg.value_embeds and not cfg.smear and not cfg.backout
    assert model.resid_lambdas.eq(1).all() and model.x0_lambdas.eq(0).all()
    r = ref("upstream-2c4473d")
    with torch.no_grad():
        torch.testing.assert_close(model(r["idx"]), r["logits"], rtol=0, atol=ATOL)


@pytest.mark.parametrize("tensor,what", [("value_embed_A.weight", "value-residual experiments"),
                                         ("v0_lambdas", "value-residual experiments"),
                                         ("bigram_embed.embed.weight", "engram")])
def test_upstream_experiments_are_refused_in_one_line(tmp_path, tensor, what):
    """Checkpoints of nanochat's short-lived experiments (value residuals of 2026-01-16, the bigram engram of
    2026-01-25..28) hold parts snlp's model does not carry: a one-line refusal naming the experiment."""
    d = tmp_path / "exp"
    shutil.copytree(DATA / "upstream-184d4c1", d)
    sd = torch.load(d / "model_000000.pt")
    torch.save({**sd, tensor: torch.zeros(4, 2)}, d / "model_000000.pt")
    with pytest.raises(ValueError, match=what) as err:
        snlp.load(d)
    assert "\n" not in str(err.value) and tensor in str(err.value)


def test_files_no_version_wrote_and_overrides_outside_nanochat_are_refused(tmp_path):
    """A 12-or-32-channel VE gate is all nanochat ever stored, windows came after the lambdas: other combinations
    are one-line refusals; overrides on an snlp checkpoint are refused (its config.json holds every constant)."""
    d = tmp_path / "w"
    shutil.copytree(DATA / "upstream-184d4c1", d)
    sd = torch.load(d / "model_000000.pt")
    torch.save({k: v for k, v in sd.items() if "lambdas" not in k}, d / "model_000000.pt")
    with pytest.raises(ValueError, match="window_pattern but no resid_lambdas"):
        snlp.load(d)
    g = tmp_path / "g"
    shutil.copytree(DATA / "upstream-f068604", g)
    sd = torch.load(g / "model_000000.pt")
    torch.save({k: v[:, :8] if k.endswith("ve_gate.weight") else v for k, v in sd.items()}, g / "model_000000.pt")
    with pytest.raises(ValueError, match="reads 8 channels"):
        snlp.load(g)
    out = tmp_path / "conv"
    assert cli_main(["convert", str(DATA / "upstream-92d63d4"), "--out", str(out)]) == 0
    with pytest.raises(ValueError, match="overrides apply to nanochat checkpoints"):
        snlp.load(out, overrides={"softcap": 20.0})


@pytest.mark.parametrize("name", NAMES)
def test_load_gives_the_paper_codes_logits(name):
    """snlp.load(DIR) of a checkpoint the paper's code wrote gives that code's logits on 2 x 160 tokens (windows
    of 128 crossed, value embeddings, x0 lambdas, smear, backout, GQA, mHC with softmax maps and a tau-0.05
    Sinkhorn); the MTP head it stores is dropped."""
    model, tok = snlp.load(DATA / name)
    r = ref(name)
    assert tok is None and model.config.smear and model.config.backout and model.config.qk_scale == 1.2
    with torch.no_grad():
        torch.testing.assert_close(model(r["idx"]), r["logits"], rtol=0, atol=ATOL)
    assert not any("mtp" in k for k in model.state_dict())


@pytest.mark.parametrize("plan,key", [("4xF1-h0-K1", "idn_S2_K1"), ("4xF1-h0-K2", "idn_S2_K2"),
                                      ("6xF1-h0-K2", "idn_S0_K2"), ("2xF1-h0-K1", "idn_S4_K1")])
def test_idn_solve_gives_the_paper_codes_plan_logits(plan, key):
    """The paper's per-layer IDN solve (forward_idn_batched, h0 init, K iterations) on its own checkpoint equals
    snlp's M = 1 IDN plan, with the backout (layer 3 of 6) read from the iterate when it sits in the suffix
    (S = 0, 2) and from the exact prefix when it does not (S = 4); K >= C gives the sequential logits."""
    model, _ = snlp.load(DATA / "nanochat-L")
    r = ref("nanochat-L")
    with torch.no_grad():
        torch.testing.assert_close(parallel_forward(model, r["idx"], plan), r[key], rtol=0, atol=ATOL)
        C = int(plan.split("x")[0])
        torch.testing.assert_close(parallel_forward(model, r["idx"], f"{C}xF1-h0-K{C}"), r["logits"], rtol=0,
                                   atol=ATOL)


@pytest.mark.parametrize("plan,key", [("3xF1-h0-K1-hcn", "hcn_S1_K1"), ("4xF1-h0-K2-hcn", "hcn_S0_K2")])
def test_hcn_solve_gives_the_paper_codes_plan_logits(plan, key):
    """The paper's per-layer HCN solve (forward_hcn_batched: A = H_res,mlp H_res,attn of its softmax-map mHC, h0
    init, K iterations, the backout of layer 2 of 4 read from the iterate) on its own mHC checkpoint equals snlp's
    M = 1 HCN plan."""
    model, _ = snlp.load(DATA / "nanochat-mhc")
    r = ref("nanochat-mhc")
    with torch.no_grad():
        torch.testing.assert_close(parallel_forward(model, r["idx"], plan), r[key], rtol=0, atol=ATOL)


@pytest.mark.parametrize("name,plan,key", [("nanochat-mix", "3xF1-h0-K1-causal", "idn_S2_K1"),
                                           ("nanochat-mix", "5xF1-h0-K3-causal", "idn_S0_K3"),
                                           ("nanochat-mhc3", "4xF1-h0-K2-hcn-causal", "hcn_S1_K2"),
                                           ("nanochat-mhc3", "5xF1-h0-K1-hcn-causal", "hcn_S0_K1")])
def test_causal_plans_give_the_paper_codes_solve_where_the_windows_bite(name, plan, key):
    """The paper's per-layer solves (forward_idn_batched, forward_hcn_batched) run the batched suffix with
    is_causal=True, the windows dropped, the prefix keeping them: on inputs the windows cut (140 tokens; "L" = 64 and
    "S" = 128 in nanochat-mix, "L" = 32 and "S" = 128 in nanochat-mhc3) they equal snlp's `causal` plans, which name
    that approximation, and not the plans without it (the windowed model's solve), at the last 40 positions."""
    model, _ = snlp.load(DATA / name)
    r = ref(name)
    with torch.no_grad():
        torch.testing.assert_close(parallel_forward(model, r["idx"], plan)[:, -40:], r[key], rtol=0, atol=ATOL)
        windowed = parallel_forward(model, r["idx"], plan.removesuffix("-causal"))[:, -40:]
    assert (windowed - r[key]).abs().max() > 100 * ATOL


@pytest.mark.parametrize("name", ["nanochat-mix", "nanochat-mhc3"])
def test_kv_cached_decode_gives_the_paper_engines_logits(name):
    """The paper's KV-cached path (its engine's KVCache: a prefill of 100 tokens, then one token per call, SDPA with
    the window masks past the "L" window of 64 / 32 and the wider "S" window of 128) and snlp's KVCache give the same
    logits at every step, for a batch of 2; nanochat-mix is stored as the paper's GPU runs store it (bf16
    embeddings, fp32 rest), whose dtype transformers' dtype="auto" reads off the first tensor (fp32)."""
    model, _ = snlp.load(DATA / name)
    r = ref(name)
    idx = r["idx"]
    with torch.no_grad():
        cache = KVCache.for_model(model, batch=2, max_len=idx.shape[1])
        steps = [model(idx[:, :100], cache=cache)[:, -1:]]
        steps += [model(idx[:, t:t + 1], cache=cache) for t in range(100, idx.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), r["kv_P100"], rtol=0, atol=ATOL)
    stored = {v.dtype for v in torch.load(DATA / name / "model_000000.pt").values()}
    assert stored == ({torch.bfloat16, torch.float32} if name == "nanochat-mix" else {torch.float32})
    assert nanochat_stored_dtype(DATA / name) == torch.float32


def test_convert_writes_an_snlp_checkpoint_with_the_same_logits(tmp_path, capsys):
    out = tmp_path / "conv"
    assert cli_main(["convert", str(DATA / "nanochat-sw"), "--out", str(out)]) == 0
    assert "no tokenizer" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["smear"] and cfg["backout"] and cfg["ve_gate_channels"] == 12 and cfg["short_window"] == 128
    model, _ = snlp.load(out)
    r = ref("nanochat-sw")
    with torch.no_grad():
        torch.testing.assert_close(model(r["idx"]), r["logits"], rtol=0, atol=ATOL)


def test_steps_paths_and_bad_input(tmp_path):
    """The last step by default, a model_NNNNNN.pt path names its step; a missing step, a corrupt meta, a foreign
    tensor and mHC with the x0 residual are one-line ValueErrors before any model is built."""
    d = tmp_path / "ck"
    shutil.copytree(DATA / "nanochat-L", d)
    shutil.copy(d / "model_000000.pt", d / "model_000100.pt")
    meta = json.loads((d / "meta_000000.json").read_text())
    (d / "meta_000100.json").write_text(json.dumps({**meta, "step": 100}))
    assert is_nanochat_dir(d) and is_nanochat_dir(d / "model_000100.pt") and not is_nanochat_dir(tmp_path)
    load_nanochat(d / "model_000000.pt")
    changed = load_nanochat(d, step=0, overrides={"rope_base": 10000.0})  # another nanochat version's constant
    assert changed.config.rope_base == 10000.0 and changed.config.smear
    with pytest.raises(ValueError, match="no GPTConfig field"):
        load_nanochat(d, overrides={"rope": 1})
    with pytest.raises(ValueError, match="no step 7"):
        load_nanochat(d, step=7)
    (d / "meta_000100.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        load_nanochat(d)
    sd = torch.load(d / "model_000000.pt")
    torch.save({**sd, "transformer.h.0.attn.extra": torch.zeros(1)}, d / "model_000100.pt")
    (d / "meta_000100.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="does not map") as err:
        load_nanochat(d)
    assert "\n" not in str(err.value)
    mc = json.loads((DATA / "nanochat-mhc" / "meta_000000.json").read_text())
    mc["model_config"]["no_x0_resid"] = False
    m = tmp_path / "mhc"
    shutil.copytree(DATA / "nanochat-mhc", m)
    (m / "meta_000000.json").write_text(json.dumps(mc))
    with pytest.raises(ValueError, match="mHC with the x0 residual"):
        snlp.load(m)


def test_an_older_checkpoint_without_smear_and_backout(tmp_path):
    """nanochat-snlp's loader patches a missing smear gate / backout scalar with zeros (off): snlp loads such a
    checkpoint (its meta is nanochat-snlp's, so its other constants are too) without those parts, and its logits
    are the full model's with smear_lambda = backout_lambda = 0. (An upstream checkpoint without them was written
    before smear existed: test_each_upstream_version_loads_with_the_logits_it_computes, ve12.)"""
    d = tmp_path / "old"
    shutil.copytree(DATA / "nanochat-L", d)
    sd = torch.load(d / "model_000000.pt")
    for k in ("smear_gate.weight", "smear_lambda", "backout_lambda"):
        sd.pop(k)
    torch.save(sd, d / "model_000000.pt")
    old, _ = snlp.load(d)
    full, _ = snlp.load(DATA / "nanochat-L")
    assert not old.config.smear and not old.config.backout
    with torch.no_grad():
        full.smear_lambda.zero_()
        full.backout_lambda.zero_()
        idx = ref("nanochat-L")["idx"]
        torch.testing.assert_close(old(idx), full(idx), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["nanochat-sw", "nanochat-mhc"])
def test_chunked_cached_prefill_equals_the_full_forward(name):
    """The smear reads the previous TOKEN: a KV-cached forward in pieces (int positions, then a static-shape (T,)
    positions call) gives the full forward's logits at every position, in fp64 (nanochat's own engine skips the
    smear of a cached multi-token call's first token; the sequence's function does not)."""
    model, _ = snlp.load(DATA / name)
    model = model.double()
    idx = ref(name)["idx"][:, :140]
    with torch.no_grad():
        full = model(idx)
        cache = KVCache.for_model(model, batch=2, max_len=160)
        parts = [model(idx[:, :50], cache=cache), model(idx[:, 50:51], cache=cache), model(idx[:, 51:100], cache=cache)]
        pos = torch.arange(100, 140)
        parts.append(model(idx[:, 100:], cache=cache, pos=pos))
        torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["nanochat-sw", "nanochat-mhc"])
def test_decoding_a_checkpoint_equals_the_argmax_loop(name):
    """Sequential, SNLP (K >= C) and speculative decoding of a ragged batch of the paper's checkpoint: the full-prefix
    argmax loop over its forward (the paper's function), fp64."""
    model, _ = snlp.load(DATA / name)
    model = model.double()
    idx = ref(name)["idx"]
    prompts = [idx[0, :5].tolist(), idx[1, :17].tolist()]
    want = [argmax_loop(model, p, 6) for p in prompts]
    L = model.config.n_layer
    plan, kind = (f"{L - 1}xF1-h0-K{L - 1}", "") if name == "nanochat-sw" else (f"{L}xF1-h0-K{L}-hcn", "-hcn")
    assert [r.tokens for r in sequential_generate(model, prompts, max_new_tokens=6)] == want
    assert [r.tokens for r in snlp_generate(model, prompts, plan, max_new_tokens=6)] == want
    assert [r.tokens for r in speculative_generate(model, prompts, f"{L - 1}xF1-h0-K1{kind}", block=3,
                                                   max_new_tokens=6)] == want


def test_training_reaches_the_smear_and_backout():
    """Both training forwards (sequential loss, loss through an SNLP solve) give the smear gate, smear scalar and
    backout scalar a gradient, and the optimizer groups hold them."""
    model, _ = snlp.load(DATA / "nanochat-sw")
    model.train()
    idx = ref("nanochat-sw")["idx"][:, :40]
    for loss in (lambda: model(idx[:, :-1], targets=idx[:, 1:]),
                 lambda: torch.nn.functional.cross_entropy(
                     model.head(solve(model, idx[:, :-1], "4xF1-h0-K1").hidden).flatten(0, 1), idx[:, 1:].flatten())):
        model.zero_grad()
        loss().backward()
        for p in (model.smear_gate.weight, model.smear_lambda, model.backout_lambda):
            assert p.grad is not None and p.grad.abs().sum() > 0
    groups = [p for o in build_optimizers(model, TrainConfig(out="unused")) for g in o.param_groups for p in g["params"]]
    assert any(p is model.smear_lambda for p in groups) and any(p is model.backout_lambda for p in groups)


def test_export_and_distributed_refuse_the_parts_they_lack(tmp_path):
    model, _ = snlp.load(DATA / "nanochat-L")
    with pytest.raises(ValueError, match="Llama-family") as err:
        snlp.export_hf(model, tmp_path / "hf")
    assert "smear" in str(err.value) and "\n" not in str(err.value)


def test_a_solve_from_a_precomputed_prefix_takes_the_backout_state():
    """solve(prefix=h_S) skips the prefix layers: with the backout layer (3 of 6) inside the prefix it needs that
    layer's output as hb= (GPT.prefix_backout of the trace) and then equals the plain solve; without it, or with an
    hb the plan never reads, it is a one-line ValueError."""
    model, _ = snlp.load(DATA / "nanochat-L")
    idx = ref("nanochat-L")["idx"][:, :32]
    with torch.no_grad():
        trace = model.hidden_states(idx)
        for plan, S in (("2xF1-h0-K1", 4), ("5xF1-h0-K2", 1)):
            hb = model.prefix_backout(trace, S)
            assert (hb is None) == (S <= 3)
            got = solve(model, idx, plan, prefix=trace[S], hb=hb).hidden
            torch.testing.assert_close(got, solve(model, idx, plan).hidden, rtol=0, atol=1e-6)
        with pytest.raises(ValueError, match="pass it as hb=") as err:
            solve(model, idx, "2xF1-h0-K1", prefix=trace[4])
        assert "\n" not in str(err.value)
        with pytest.raises(ValueError, match="never reads it"):
            solve(model, idx, "5xF1-h0-K2", prefix=trace[1], hb=trace[4])


def test_log_space_sinkhorn_is_the_sinkhorn_of_the_tempered_logits():
    """hc_maps="softmax"'s H_res (nanochat-snlp's log-space Sinkhorn at temperature tau) is the same projection as
    snlp's exp-space Sinkhorn of logits / tau (fp64, logits of moderate range), columns summing to 1 exactly."""
    from snlp.model.hc import sinkhorn, sinkhorn_log

    lg = torch.randn(5, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for tau, iters in ((1.0, 20), (0.25, 10)):
        a, b = sinkhorn_log(lg, iters, tau), sinkhorn(lg / tau, iters)
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(a.sum(-2), torch.ones(5, 4, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("share", [False, True])
def test_exact_plans_on_the_windowed_checkpoint_give_the_paper_codes_logits(share):
    """nanochat-sw (windows of 128 crossed by its 160 tokens, VE, smear, backout in the suffix): a bound K >= C, M = 1
    plan (shared or own weights) gives the paper code's sequential logits; the paper's own parallel path drops the
    windows, so no plan reference of its own exists for this checkpoint."""
    model, _ = snlp.load(DATA / "nanochat-sw")
    r = ref("nanochat-sw")
    with torch.no_grad():
        torch.testing.assert_close(snlp.bind(model, "5xF1-h0-K5", share_weights=share)(r["idx"]), r["logits"],
                                   rtol=0, atol=ATOL)


def test_the_analyses_read_the_backed_out_state():
    """The early-exit table's N = 0 row and the analyses' sequential PPL are the model's own PPL (the head reads
    h_L minus the backout state), exp of the mean NLL of its logits on the same windows."""
    from snlp.eval.analysis.common import sequential_ppl
    from snlp.eval.analysis.earlyexit import early_exit
    from snlp.eval.protocol import EvalConfig

    model, _ = snlp.load(DATA / "nanochat-L")
    val = ref("nanochat-L")["idx"].flatten()
    wins = torch.stack([val[i * 32:(i + 1) * 32 + 1] for i in range(4)])
    with torch.no_grad():
        logp = torch.log_softmax(model(wins[:, :-1]).double(), -1)
        want = float(torch.exp(-logp.gather(-1, wins[:, 1:, None]).mean()))
    assert sequential_ppl(model, wins) == pytest.approx(want, rel=1e-5)
    rows = early_exit(model, val, [2], EvalConfig(seq_len=32, max_tokens=128, batch=2, progress=False))
    assert rows[0].N == 0 and rows[0].ppl == pytest.approx(want, rel=1e-5)


def test_analyze_runs_on_a_checkpoint_and_refuses_ordering_before_any_work():
    """snlp's analyses on the paper's checkpoint: propagation runs (a skipped backout layer's output stands at h_S,
    as the paper's code fills it), and the ordering section (Seq-Perm, undefined with the backout) is a one-line
    refusal before any section runs."""
    from snlp.eval import analysis as A

    model, _ = snlp.load(DATA / "nanochat-L")
    val = ref("nanochat-L")["idx"].flatten()
    cfg = A.AnalysisConfig(seq_len=16, max_tokens=64, batch=2, progress=False)
    res = A.analyze(model, val, A.AnalysisConfig(**{**cfg.__dict__, "only": ("propagation", "early-exit")}))
    assert res.propagation is not None and res.early_exit[0].N == 0
    with pytest.raises(ValueError, match="ordering") as err:
        A.analyze(model, val, cfg)
    assert "\n" not in str(err.value)


def test_compiled_state_keys_and_an_older_meta(tmp_path):
    """A state dict saved from a torch.compile'd model (keys prefixed `_orig_mod.`) and a meta from before the
    window / mHC / MTP options (nanochat's loader patches them: window "L", mHC and MTP off) load to the same logits."""
    d = tmp_path / "old"
    shutil.copytree(DATA / "nanochat-L", d)
    sd = torch.load(d / "model_000000.pt")
    torch.save({f"_orig_mod.{k}": v for k, v in sd.items()}, d / "model_000000.pt")
    meta = json.loads((d / "meta_000000.json").read_text())
    for k in ("window_pattern", "use_mhc", "mhc_num_streams", "mhc_sinkhorn_iters", "mhc_sinkhorn_tau",
              "num_mtp_steps", "mtp_loss_weight", "no_x0_resid", "no_ve"):
        meta["model_config"].pop(k)
    (d / "meta_000000.json").write_text(json.dumps(meta))
    model, _ = snlp.load(d)
    r = ref("nanochat-L")
    with torch.no_grad():
        torch.testing.assert_close(model(r["idx"]), r["logits"], rtol=0, atol=ATOL)


def naive_window_attention(windows: dict[int, int]):
    """Attention as nanochat defines its windows, written out: query i attends to keys j with 0 <= i - j <= w
    (FA3's window_size=(w, 0); its SDPA fallback's mask `row - col <= window`), softmax(q k^T / sqrt(hd)) v; `w` is
    the calling layer's entry of `windows`, set by a pre-hook on its attention (not read from the snlp config)."""
    current = {}

    def attend(q, k, v, _windows=-1, q_start=0, masks=None):  # q (B, Hq, T, hd), k/v (B, Hkv, S, hd)
        T, S = q.shape[-2], k.shape[-2]
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
        i = torch.arange(T)[:, None] + q_start
        j = torch.arange(S)[None, :]
        allowed = (j <= i) & (i - j <= current["w"])  # (T, S)
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v

    def hooks(model):
        return [blk.attn.register_forward_pre_hook(lambda mod, args, w=windows[n]: current.update(w=w))
                for n, blk in enumerate(model.blocks)]

    return attend, hooks


@pytest.mark.parametrize("name", ["nanochat-L", "nanochat-sw"])
def test_inputs_past_sequence_len_get_nanochats_windows(name, monkeypatch):
    """nanochat's "L" layers (and its last layer) attend over a window of sequence_len tokens, not the whole input:
    past sequence_len tokens the loaded model computed full causal attention there, another function than the
    checkpoint's. Outside reference: the same weights with attention written out naively, each layer's window
    taken from nanochat's rule (L: sequence_len, S: ceil(sequence_len / 4 / 128) * 128, the last layer L) and
    checked to be the model's own function on inputs of at most sequence_len tokens."""
    import snlp.model.gpt as G

    model, _ = snlp.load(DATA / name)
    model = model.double()
    cfg = model.config
    mc = json.loads(next((DATA / name).glob("meta_*.json")).read_text())["model_config"]
    W, pattern = mc["sequence_len"], mc["window_pattern"]
    short = -(-W // 4 // 128) * 128
    windows = {n: short if pattern[n % len(pattern)] == "S" and n < cfg.n_layer - 1 else W
               for n in range(cfg.n_layer)}
    idx = torch.randint(0, cfg.vocab_size, (1, W + 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, short_got = model(idx), model(idx[:, :W])
    attend, hooks = naive_window_attention(windows)
    monkeypatch.setattr(G, "attend", attend)
    handles = hooks(model)
    with torch.no_grad():
        want, short_want = model(idx), model(idx[:, :W])
    for h in handles:
        h.remove()
    torch.testing.assert_close(short_got, short_want, rtol=0, atol=1e-9)  # the naive attention is the model's
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    monkeypatch.undo()
    # cached decoding across sequence_len equals the argmax loop over the windowed forward
    prompt = idx[0, : W - 3].tolist()
    assert sequential_generate(model, prompt, max_new_tokens=8).tokens == argmax_loop(model, prompt, 8)


def test_compiled_forward_keeps_the_bf16_rope_tables():
    """A version whose RoPE tables were bf16 (base, up to 2026-03-04) computes the same logits compiled as eager.
    A cast round trip cos.bfloat16().float() is folded away by inductor, so a compiled forward rotated by the
    unrounded tables: 7.8e-3 off this reference, the size of the gap between versions the loader refuses to guess."""
    model, _ = snlp.load(DATA / "upstream-2c4473d")
    r = ref("upstream-2c4473d")
    with torch.no_grad():
        got = torch.compile(model, fullgraph=True)(r["idx"])
    torch.testing.assert_close(got, r["logits"], rtol=0, atol=ATOL)


def test_a_bf16_model_rotates_by_fp32_frequencies():
    """.to(bfloat16) keeps inv_freq fp32 (as nanochat and transformers do), so a bf16 model's RoPE tables are the
    fp32 model's tables rounded once to bf16. A bf16 inv_freq put a phase error of t (f - round(f)) into them: 0.35
    in cos at t = 2000, where the rounding alone moves a value by at most 2^-9."""
    model, _ = snlp.load(DATA / "upstream-92d63d4")
    cos32, sin32 = model.rotary(4, 2000)
    bf = model.to(torch.bfloat16)
    assert bf.inv_freq.dtype == torch.float32
    cos16, sin16 = bf.rotary(4, 2000)
    assert cos16.dtype == torch.bfloat16
    assert torch.equal(cos16, cos32.bfloat16()) and torch.equal(sin16, sin32.bfloat16())


SFT_KEYS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "window_pattern")


@pytest.mark.parametrize("name", ["nanochat-sft", "nanochat-sft-ve"])
def test_a_chat_sft_checkpoint_of_a_no_x0_model_is_refused_then_loads_as_named(name, tmp_path, capsys):
    """The paper's scripts/chat_sft.py writes a model_config of the size fields and window_pattern only, dropping
    no_x0_resid / no_ve / use_mhc: its checkpoint of a no_x0_resid model (the paper's headline models are
    no_x0_resid + no_ve) still stores resid / x0 lambdas, at their initial values (never optimised). Read with the x0
    residual it gives logits 1.8 (value embeddings on) and 3.0 (off) away from the code that wrote it, so it is
    refused in one line naming the override; with x0_residual=False it gives that code's logits, value embeddings
    read from the files (stored embeddings without gates: no_ve), through snlp.load and `snlp convert`."""
    r = ref(name)
    with pytest.raises(ValueError, match="x0_residual") as err:
        snlp.load(DATA / name)
    assert "\n" not in str(err.value) and "no_x0_resid" in str(err.value)
    model, _ = snlp.load(DATA / name, overrides={"x0_residual": False})
    assert model.config.value_embeds == (name == "nanochat-sft-ve") and not model.config.x0_residual
    assert max_err(model, r) <= ATOL
    assert max_err(snlp.load(DATA / name, overrides={"x0_residual": True})[0], r) > 1.0
    out = tmp_path / "conv"
    assert cli_main(["convert", str(DATA / name), "--out", str(out)]) == 2
    assert "x0_residual" in capsys.readouterr().err and not out.exists()
    assert cli_main(["convert", str(DATA / name), "--out", str(out), "--nanochat-override", "x0_residual=false"]) == 0
    assert max_err(snlp.load(out)[0], r) <= ATOL


def test_a_chat_sft_meta_with_trained_lambdas_loads_and_mhc_without_its_keys_is_refused(tmp_path):
    """A size-fields-only meta over trained lambdas (the x0 residual on: upstream's chat_sft, or the paper's without
    no_x0_resid) loads with the logits of the code that wrote the weights; mHC tensors under such a meta are refused
    in one line (the Sinkhorn settings are not in the files), naming the keys to copy from the base checkpoint."""
    for name, ok in (("nanochat-sw", True), ("nanochat-mhc", False)):
        d = tmp_path / name
        shutil.copytree(DATA / name, d)
        meta = json.loads((d / "meta_000000.json").read_text())
        meta["model_config"] = {k: meta["model_config"][k] for k in SFT_KEYS}
        (d / "meta_000000.json").write_text(json.dumps(meta))
        if ok:
            assert max_err(snlp.load(d)[0], ref(name)) <= ATOL
        else:
            with pytest.raises(ValueError, match="lacks use_mhc") as err:
                snlp.load(d)
            assert "\n" not in str(err.value) and "mhc_sinkhorn_tau" in str(err.value)


def test_window_overrides_move_the_windows_as_nanochat_would():
    """overrides of window_pattern / sequence_len are nanochat's fields: the windows follow them as its
    _compute_window_sizes sets them (184d4c1's checkpoint with window_pattern "L" gives that code's logits run with
    "L", reference logits_L); short_window, which nanochat's windows never read, is refused, as is window_pattern on
    a version without windows, and layer_windows beside them."""
    model, _ = snlp.load(DATA / "upstream-184d4c1", overrides={"window_pattern": "L"})
    assert model.config.layer_windows == [128] * model.config.n_layer
    assert max_err(model, ref("upstream-184d4c1"), "logits_L") <= ATOL
    longer, _ = snlp.load(DATA / "upstream-184d4c1", overrides={"sequence_len": 256})
    assert longer.config.layer_windows == [128, 128, 256, 256]  # "SSL" tiled, the last layer L; S = T // 2
    for over, msg in (({"short_window": 32}, "short_window"), ({"window_pattern": "L", "layer_windows": [8] * 4},
                                                               "one or the other")):
        with pytest.raises(ValueError, match=msg):
            snlp.load(DATA / "upstream-184d4c1", overrides=over)
    with pytest.raises(ValueError, match="without windows"):
        snlp.load(DATA / "upstream-2c4473d", overrides={"window_pattern": "SL"})


def test_a_model_file_and_another_step_are_refused(tmp_path):
    """load_nanochat(model_000000.pt, step=N) names two steps: refused in one line, not one of them dropped."""
    d = tmp_path / "ck"
    shutil.copytree(DATA / "nanochat-L", d)
    shutil.copy(d / "model_000000.pt", d / "model_000100.pt")
    shutil.copy(d / "meta_000000.json", d / "meta_000100.json")
    with pytest.raises(ValueError, match="names step 0, and step 100"):
        load_nanochat(d / "model_000000.pt", step=100)
    assert load_nanochat(d / "model_000000.pt", step=0).config.n_layer == 6


def test_a_last_model_file_without_its_meta_is_not_replaced_by_an_older_step(tmp_path):
    """nanochat's find_last_step takes the newest model_NNNNNN.pt: when its meta is missing (a save cut short) the
    default load is refused in one line naming the complete steps, not served from an older step; a named step
    still loads."""
    d = tmp_path / "ck"
    shutil.copytree(DATA / "nanochat-L", d)
    shutil.copy(d / "model_000000.pt", d / "model_000100.pt")
    with pytest.raises(ValueError, match=r"model_000100.pt, has no meta_000100.json.*\[0\]") as err:
        snlp.load(d)
    assert "\n" not in str(err.value)
    assert checkpoint_depth(d) is None and checkpoint_depth(d / "model_000000.pt") == 6  # no depth of another step
    assert max_err(snlp.load(d / "model_000000.pt")[0], ref("nanochat-L")) <= ATOL
    assert load_nanochat(d, step=0).config.n_layer == 6


def test_model_files_without_any_meta_are_named_as_such(tmp_path, capsys):
    """A folder of model_NNNNNN.pt files copied without their meta_NNNNNN.json was refused as a folder lacking a
    config.json (snlp.load: "not a checkpoint"; snlp convert: "expected a transformers model directory"): every
    entry says what is missing, in one line."""
    d = tmp_path / "ck"
    d.mkdir()
    shutil.copy(DATA / "nanochat-L" / "model_000000.pt", d / "model_000000.pt")
    with pytest.raises(FileNotFoundError, match=r"holds nanochat model files \(model_000000.pt\) but no meta_NNNNNN.json"):
        snlp.load(d)
    with pytest.raises(FileNotFoundError, match=r"holds nanochat model files"):
        snlp.from_hf(str(d))
    assert cli_main(["convert", str(d), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds nanochat model files (model_000000.pt) but no meta_NNNNNN.json" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_a_meta_whose_vocab_size_the_stored_rows_do_not_fit_is_refused(tmp_path):
    """nanochat stores vocab_size rows of wte / lm_head, or vocab_size padded to a multiple of 64 (100 -> 128): a
    meta (or an override) with another vocab_size, 50 here, is not this model's config, and cutting the rows to it
    loaded another function (a softmax over 50 tokens) without a word; now a one-line ValueError."""
    d = tmp_path / "ck"
    shutil.copytree(DATA / "nanochat-L", d)
    meta = json.loads((d / "meta_000000.json").read_text())
    meta["model_config"]["vocab_size"] = 50
    (d / "meta_000000.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="has 128 rows, which vocab_size 50 does not explain") as err:
        snlp.load(d)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="which vocab_size 50 does not explain"):
        snlp.load(DATA / "nanochat-L", overrides={"vocab_size": 50})
    assert snlp.load(DATA / "nanochat-L")[0].config.vocab_size == 100


def test_the_last_step_refusal_names_ways_to_pick_a_step_that_exist(tmp_path, capsys):
    """The refusal of a last model file without its meta names how to pick a complete step; it said `step= in
    snlp.load`, which takes no step. Each way it names now loads step 0, and `snlp convert` says which step of a
    folder of several it converted."""
    import inspect

    d = tmp_path / "ck"
    shutil.copytree(DATA / "nanochat-L", d)
    shutil.copy(d / "model_000000.pt", d / "model_000100.pt")
    with pytest.raises(ValueError, match="complete steps") as err:
        snlp.load(d)
    msg = str(err.value)
    assert "step= in snlp.load" not in msg and "step" not in inspect.signature(snlp.load).parameters
    assert "model_NNNNNN.pt to snlp.load" in msg and "step= to load_nanochat" in msg and "--step to snlp convert" in msg
    assert snlp.load(d / "model_000000.pt")[0].config.n_layer == load_nanochat(d, step=0).config.n_layer == 6
    shutil.copy(d / "meta_000000.json", d / "meta_000100.json")
    assert cli_main(["convert", str(d), "--out", str(tmp_path / "a"), "--step", "0"]) == 0
    assert f"converted nanochat checkpoint {d}, step 0 (of steps 0, 100):" in capsys.readouterr().out
    assert cli_main(["convert", str(DATA / "nanochat-L"), "--out", str(tmp_path / "b")]) == 0
    assert ", step 0: 6 layers" in capsys.readouterr().out


def test_bad_model_files_and_step_arguments_are_one_line_value_errors(tmp_path):
    """A file torch cannot unpickle (its message runs to many lines), a state dict holding a non-tensor (was an
    AttributeError), a meta that is a folder (was an IsADirectoryError), a step that is not an int (was a format
    error): each a one-line ValueError naming the file or the argument. A step spelt otherwise than
    save_checkpoint's model_NNNNNN.pt (model_7.pt, which nanochat's loader would open as model_000007.pt) is no
    nanochat step (it was taken for one, then its files were not found)."""
    def refused(d, match, **kw):
        with pytest.raises(ValueError, match=match) as err:
            load_nanochat(d, **kw)
        assert "\n" not in str(err.value)

    d = tmp_path / "ck"
    shutil.copytree(DATA / "nanochat-L", d)
    sd = torch.load(d / "model_000000.pt")
    (d / "model_000000.pt").write_bytes(b"not a torch file")
    refused(d, "corrupt or truncated")
    torch.save({**sd, "smear_lambda": 0.5}, d / "model_000000.pt")
    refused(d, r"does not hold a state dict of named tensors: \[.smear_lambda.\]")
    torch.save(sd, d / "model_000000.pt")
    refused(d, "step must be an int", step=0.0)
    refused(d, "step must be an int", step="0")
    (d / "meta_000000.json").unlink()
    (d / "meta_000000.json").mkdir()
    refused(d, "corrupt .*meta_000000.json")
    e = tmp_path / "short"
    e.mkdir()
    shutil.copy(DATA / "nanochat-L" / "model_000000.pt", e / "model_7.pt")
    shutil.copy(DATA / "nanochat-L" / "meta_000000.json", e / "meta_7.json")
    assert not is_nanochat_dir(e) and not is_nanochat_dir(e / "model_7.pt")


def test_overrides_of_fields_the_model_does_not_read_are_refused():
    """An override of a GPTConfig field that only a part the model lacks reads (the Sinkhorn settings and map kind
    without mHC, the value-embedding gate without value embeddings) changed nothing and loaded silently; now a
    one-line ValueError naming the part. With the part the same override loads and changes the function."""
    for name, over, part in (("nanochat-L", {"hc_sinkhorn_iters": 3}, "mHC"), ("nanochat-L", {"hc_maps": "softmax"}, "mHC"),
                             ("upstream-2c4473d", {"ve_gate_scale": 5.0}, "value embeddings"),
                             ("nanochat-L", {"value_embeds": False, "ve_gate_channels": 8}, "value embeddings")):
        with pytest.raises(ValueError, match=rf"does not read \(it has no {part}\)") as err:
            snlp.load(DATA / name, overrides=over)
        assert "\n" not in str(err.value)
    r = ref("nanochat-mhc")
    m, _ = snlp.load(DATA / "nanochat-mhc", overrides={"hc_sinkhorn_iters": 3})
    assert m.config.hc_sinkhorn_iters == 3 and max_err(m, r) > 1e-4  # Sinkhorn converges fast at tau 0.05
    m, _ = snlp.load(DATA / "nanochat-L", overrides={"ve_gate_scale": 2.0})
    assert max_err(m, ref("nanochat-L")) > 1e-3


def test_a_folder_of_nanochat_checkpoints_is_named_as_such(tmp_path, capsys):
    """nanochat keeps one folder per model tag under base_checkpoints/ (its loader picks one): that parent folder was
    refused as lacking a config.json ("expected a transformers model directory" from snlp convert); each entry now
    says it holds nanochat checkpoints and names them, in one line."""
    for tag in ("d4", "d6"):
        shutil.copytree(DATA / ("nanochat-mhc" if tag == "d4" else "nanochat-L"), tmp_path / "base" / tag)
    base = tmp_path / "base"
    with pytest.raises(FileNotFoundError, match=r"not a nanochat checkpoint but a folder of 2 \(d4, d6\): give one"):
        snlp.load(base)
    assert cli_main(["convert", str(base), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "folder of 2 (d4, d6)" in err and "\n" not in err and not (tmp_path / "out").exists()
    assert cli_main(["bench", "--ckpt", str(base), "--plans", "2xF1-h0-K1"]) == 2
    assert "folder of 2 (d4, d6)" in capsys.readouterr().err


def test_overrides_no_checkpoint_takes_are_refused_before_the_model_file_is_read(tmp_path):
    """A misspelt override field, an unknown version key, short_window: refused in one line before torch.load reads
    the model file (a real one is gigabytes); here that file is garbage, so a refusal that names the override shows
    it was not read. An unknown version was refused as 'the files fit [smear] only', as if it were a version."""
    d = tmp_path / "ck"
    shutil.copytree(DATA / "nanochat-L", d)
    (d / "model_000000.pt").write_bytes(b"garbage")
    for over, match in (({"softcapp": 20}, r"no GPTConfig field: \['softcapp'\]"),
                        ({"version": "v12"}, r"version 'v12', which is none of nanochat's"),
                        ({"short_window": 64}, "short_window"),
                        ({"sequence_len": 64, "layer_windows": [1] * 6}, "give one or the other")):
        with pytest.raises(ValueError, match=match) as err:
            load_nanochat(d, overrides=over)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_nanochat(d, overrides={"softcap": 20.0})


def test_a_size_field_that_is_no_integer_is_named(tmp_path):
    """n_layer 4.7 or true in a meta was read as int() of it (4, 1): a model of another size, refused later as
    lacking a ve_gate or holding tensors it does not map, which says nothing of the meta; now the field is named."""
    d = tmp_path / "ck"
    shutil.copytree(DATA / "nanochat-L", d)
    meta = json.loads((d / "meta_000000.json").read_text())
    for value in (4.7, True, "6"):
        (d / "meta_000000.json").write_text(json.dumps({**meta, "model_config": {**meta["model_config"],
                                                                               "n_layer": value}}))
        with pytest.raises(ValueError, match=rf"size field \(n_layer={value!r}; each must be an integer\)") as err:
            snlp.load(d)
        assert "\n" not in str(err.value)


def test_a_dtype_that_cannot_hold_the_weights_is_named_not_the_checkpoint(tmp_path, capsys):
    """A finite weight past float16's 65504 turned inf in the cast, and the refusal called the checkpoint broken
    ('a diverged training run saves such weights: restore or re-train it'); the file is fine, the dtype cannot hold
    it: now said so, and bfloat16 converts it. A NaN stored in the file is still the checkpoint's."""
    d = tmp_path / "ck"
    shutil.copytree(DATA / "nanochat-L", d)
    sd = torch.load(d / "model_000000.pt")
    sd["lm_head.weight"][0, 0] = 1e5
    torch.save(sd, d / "model_000000.pt")
    assert cli_main(["convert", str(d), "--out", str(tmp_path / "h"), "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert "torch.float16 cannot hold" in err and "lm_head.weight" in err and "diverged" not in err
    assert cli_main(["convert", str(d), "--out", str(tmp_path / "b"), "--dtype", "bfloat16"]) == 0
    sd["lm_head.weight"][0, 0] = float("nan")
    torch.save(sd, d / "model_000000.pt")
    with pytest.raises(ValueError, match="diverged training run"):
        load_nanochat(d, dtype=torch.float16)


def test_a_convert_override_given_twice_is_refused(tmp_path, capsys):
    """--nanochat-override softcap=20 --nanochat-override softcap=15 converted with 15 and dropped 20 without a word;
    now a one-line refusal before any file is read (the same value twice is one override)."""
    args = ["convert", str(DATA / "nanochat-L"), "--out", str(tmp_path / "o")]
    assert cli_main(args + ["--nanochat-override", "softcap=20", "--nanochat-override", "softcap=15"]) == 2
    err = capsys.readouterr().err.strip()
    assert "gives softcap twice (20 and 15)" in err and "\n" not in err and not (tmp_path / "o").exists()
    assert cli_main(args + ["--nanochat-override", "softcap=20", "--nanochat-override", "softcap=20"]) == 0
    assert json.loads((tmp_path / "o" / "config.json").read_text())["softcap"] == 20


def test_a_tie_embeddings_override_is_refused_not_loaded_with_one_table_dropped(tmp_path, capsys):
    """overrides={"tie_embeddings": True} loaded nanochat's wte and lm_head into one parameter: the embedding table
    was the head's (wte dropped), logits 16 off the checkpoint's, without a word; nanochat stores the two apart, so
    the override is refused in one line before any file is read, by snlp.load and by snlp convert."""
    with pytest.raises(ValueError, match="tie_embeddings=True, but nanochat stores") as err:
        snlp.load(DATA / "nanochat-sw", overrides={"tie_embeddings": True})
    assert "\n" not in str(err.value)
    out = tmp_path / "o"
    assert cli_main(["convert", str(DATA / "nanochat-sw"), "--out", str(out), "--nanochat-override",
                     "tie_embeddings=true"]) == 2
    assert "tie_embeddings" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("part,scalars", [("smear", ("smear_lambda",)), ("backout", ("backout_lambda",))])
def test_an_override_that_turns_the_smear_or_backout_off_loads_without_it(part, scalars):
    """overrides={"smear": False} (or backout) was refused as 'tensors this loader does not map' although
    x0_residual / value_embeds False load without their tensors; now the part is off and its tensors unread: the
    logits of the checkpoint's model with that part's scalar at zero."""
    r = ref("nanochat-sw")
    off, _ = snlp.load(DATA / "nanochat-sw", overrides={part: False})
    full, _ = snlp.load(DATA / "nanochat-sw")
    assert not getattr(off.config, part) and getattr(full.config, part)
    with torch.no_grad():
        for name in scalars:
            getattr(full, name).zero_()
        torch.testing.assert_close(off(r["idx"]), full(r["idx"]), rtol=0, atol=1e-6)


def test_a_file_with_half_the_smear_is_refused_not_loaded_without_it(tmp_path):
    """A smear_lambda without its smear_gate (which nanochat-snlp's loader would patch to zeros: a smear of
    smear_lambda / 2) is refused naming the gate; it must not load with the smear off as the override does."""
    d = tmp_path / "ck"
    shutil.copytree(DATA / "nanochat-sw", d)
    sd = torch.load(d / "model_000000.pt")
    sd.pop("smear_gate.weight")
    torch.save(sd, d / "model_000000.pt")
    with pytest.raises(ValueError, match="lacks smear_gate.weight"):
        snlp.load(d)


def test_a_mismatch_the_overrides_make_names_the_overrides_not_the_files(tmp_path):
    """An override that changes the model's tensors (mlp_ratio, hc_dynamic's extra maps, the gate's channels) was
    refused as 'model_000000.pt does not match its meta_000000.json', which blamed the files; it now names the
    overrides. Without overrides a model file another meta describes is still the files' mismatch."""
    for name, over in (("nanochat-sw", {"mlp_ratio": 2}), ("nanochat-mhc", {"hc_dynamic": True}),
                       ("nanochat-sw", {"ve_gate_channels": 8})):
        with pytest.raises(ValueError, match=r"^overrides \{.*\} describe a model whose tensors") as err:
            snlp.load(DATA / name, overrides=over)
        assert "does not match its meta" not in str(err.value) and "\n" not in str(err.value)
    d = tmp_path / "ck"
    shutil.copytree(DATA / "nanochat-sw", d)
    sd = torch.load(d / "model_000000.pt")
    sd["transformer.h.0.mlp.c_fc.weight"] = sd["transformer.h.0.mlp.c_fc.weight"][:64]
    sd["transformer.h.0.mlp.c_proj.weight"] = sd["transformer.h.0.mlp.c_proj.weight"][:, :64]
    torch.save(sd, d / "model_000000.pt")
    with pytest.raises(ValueError, match="does not match its meta_000000.json"):
        snlp.load(d)


def test_a_model_file_of_another_code_base_is_named_not_called_corrupt(tmp_path):
    """A model_NNNNNN.pt that pickles a whole module or numpy arrays, or is a safetensors file, was refused as
    'corrupt or truncated' (with torch's advice to unpickle it, escape codes included); nanochat's save_checkpoint
    writes a state dict of tensors, so such a file comes from another code base and is named so, in one line. A cut
    file is still corrupt."""
    from safetensors.torch import save_file

    d = tmp_path / "ck"
    shutil.copytree(DATA / "nanochat-L", d)
    mf = d / "model_000000.pt"
    good = mf.read_bytes()

    def refused(match):
        with pytest.raises(ValueError, match=match) as err:
            snlp.load(d)
        assert "\n" not in str(err.value) and "\x1b" not in str(err.value)
        return str(err.value)

    torch.save(torch.nn.Linear(2, 2), mf)
    assert "corrupt" not in refused(r"pickles a torch\.nn\.modules\.linear\.Linear, not the state dict of tensors")
    save_file({"transformer.wte.weight": torch.zeros(2, 2)}, str(mf))
    assert "corrupt" not in refused("is a safetensors file, not the torch.save state dict")
    mf.write_bytes(good[:len(good) // 2])
    refused("corrupt or truncated")


def test_a_step_spelt_otherwise_and_a_meta_file_path_are_named_for_what_they_are(tmp_path, capsys):
    """model_7.pt + meta_7.json (a step spelt otherwise than save_checkpoint's model_000007.pt, which nanochat's
    loader would open) was refused as 'not a checkpoint (no config.json ...): give the folder snlp train wrote' or,
    given as a file, 'is not a directory (expected model.safetensors + config.json)'; a meta_NNNNNN.json path the
    same. Each is now named in one line with what to give instead, by snlp.load and snlp convert; a model_9.pt
    with no meta beside it is not taken for nanochat's."""
    e = tmp_path / "short"
    e.mkdir()
    shutil.copy(DATA / "nanochat-L" / "model_000000.pt", e / "model_7.pt")
    shutil.copy(DATA / "nanochat-L" / "meta_000000.json", e / "meta_7.json")
    for p in (e, e / "model_7.pt"):
        with pytest.raises((ValueError, FileNotFoundError), match="holds model_7.pt, which is not how nanochat's "
                                                                  "save_checkpoint names a step") as err:
            snlp.load(p)
        assert "\n" not in str(err.value)
        assert cli_main(["convert", str(p), "--out", str(tmp_path / "o")]) == 2
        assert "model_000007.pt" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"is a nanochat meta file: give its folder .* or its model file "
                                         r".*model_000000\.pt"):
        snlp.load(DATA / "nanochat-L" / "meta_000000.json")
    shutil.copy(DATA / "nanochat-L" / "model_000000.pt", e / "model_9.pt")
    with pytest.raises(ValueError, match="is not a directory"):
        snlp.load(e / "model_9.pt")

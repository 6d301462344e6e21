"""Adapted SNLP drafters: the drafter shares the base's prefix, the SSD-conditions solve equals the
real cached draft step, speculative decoding with an adapted drafter is the base's greedy output (tiny random
transformers Llama models and the real SmolLM2), adaptation raises Top-1 agreement, resume is exact,
drafter directories refuse other bases and corrupt files, export round-trips through transformers."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from snlp.io.checkpoint import save_checkpoint
from snlp.io.drafter import load_drafter, save_drafter
from snlp.io.hf import from_hf
from snlp.method.drafter import make_drafter
from snlp.method.plan import Plan
from snlp.method.solver import solve
from snlp.method.ssd_solve import exact_kv, ssd_solve
from snlp.model.cache import KVCache
from conftest import make_model, word_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
V = 96


def hf_tiny(seed: int = 0, layers: int = 4, **kw):
    """A random transformers Llama (hidden 64, 4 heads / 2 KV heads) with random norm weights."""
    cfg = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")
    cfg.update(kw)
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    return m.eval()


def tiny_base(seed: int = 0, layers: int = 4, **kw):
    model, _ = from_hf(hf_tiny(seed, layers, **kw))
    return model


def perturb(drafter, seed: int = 3, scale: float = 0.05):
    """Change the drafter's own weights (a stand-in for adaptation) so it really differs from the base."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for v in drafter.suffix_state().values():
            v.add_(torch.randn(v.shape, generator=gen, dtype=v.dtype) * scale)
    return drafter


def ids(B=2, T=12, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------- Drafter
def test_drafter_shares_prefix_and_leaves_the_base_alone():
    base = tiny_base()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    d = perturb(make_drafter(base, "2xF1-h0-K1"))
    assert d.model.wte is base.wte and d.model.blocks[1] is base.blocks[1] and d.model.lm_head is base.lm_head
    assert d.model.blocks[2] is not base.blocks[2] and d.model.ln_f is base.ln_f
    assert set(d.suffix_state()) == {k for k in base.state_dict() if k.startswith(("blocks.2.", "blocks.3."))}
    for k, v in base.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert d.check(base) is d
    assert d.extra_bytes() == sum(p.numel() * 4 for l in (2, 3) for p in base.blocks[l].parameters())


def test_fingerprint_refuses_another_base(tmp_path):
    base, other = tiny_base(0), tiny_base(1)
    d = make_drafter(base, "2xF1-h0-K1")
    with pytest.raises(ValueError, match="another model"):
        d.check(other)
    save_drafter(tmp_path / "d", d)
    with pytest.raises(ValueError, match="another model"):
        load_drafter(tmp_path / "d", other)
    with pytest.raises(ValueError, match="architecture"):
        load_drafter(tmp_path / "d", tiny_base(0, layers=5))
    with pytest.raises(ValueError, match="not this base's own"):
        make_drafter(tiny_base(0), "2xF1-h0-K1").check(base)  # same weights, but not the base's own modules


def test_drafter_dir_round_trip_and_corruption(tmp_path):
    base = tiny_base()
    d = perturb(make_drafter(base, "1xF2-h0-K2"))
    p = save_drafter(tmp_path / "d", d, {"steps": 3})
    back = load_drafter(p, base)
    assert str(back.plan) == str(d.plan)
    for k, v in d.suffix_state().items():
        assert torch.equal(back.suffix_state()[k], v)
    assert json.loads((p / "drafter.json").read_text())["record"] == {"steps": 3}
    with pytest.raises(ValueError, match="not a drafter directory"):
        load_drafter(tmp_path, base)
    good = (p / "drafter.json").read_text()
    meta = json.loads(good)
    meta["digests"]["blocks.3.mlp.c_fc.weight"] = "0" * 32
    (p / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="digests"):
        load_drafter(p, base)
    (p / "drafter.json").write_text(good)
    (p / "drafter.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="missing or corrupt"):
        load_drafter(p, base)
    (p / "drafter.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        load_drafter(p, base)


def test_drafter_file_refuses_an_edit_below_bf16_resolution(tmp_path):
    """One stored tensor replaced by its bf16 rounding (nearly every entry changed, each by less
    than bf16 resolution) is an edited file: the per-tensor digests are exact."""
    from safetensors.torch import load_file, save_file

    base = tiny_base()
    p = save_drafter(tmp_path / "d", perturb(make_drafter(base, "2xF1-h0-K1")))
    state = load_file(str(p / "drafter.safetensors"))
    k = "blocks.3.mlp.c_fc.weight"
    rounded = state[k].to(torch.bfloat16).float()
    assert (rounded != state[k]).double().mean() > 0.9  # the edit really touches the tensor
    state[k] = rounded
    save_file(state, str(p / "drafter.safetensors"))
    with pytest.raises(ValueError, match="digests"):
        load_drafter(p, base)


def test_fp16_base_accepts_its_own_drafter_and_calibration(tmp_path):
    """A model cast to float16 (fp16 -> bf16 double-rounds some entries) keeps its drafter and
    its preheat calibration, and so do its bf16 / fp64 casts; another model is still refused."""
    from snlp.method import preheat

    base = tiny_base()  # fp32
    p = save_drafter(tmp_path / "d", perturb(make_drafter(base, "2xF1-h0-K1")))
    pre = preheat.fit(base, preheat.CalibrateConfig(rank=3, batch=2, seq_len=8), tokens=torch.arange(40) % V)
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        cast = tiny_base().to(dt)
        d = load_drafter(p, cast)
        assert d.model.blocks[3].mlp.c_fc.weight.dtype == dt
        pre.check(cast)
        d.check(cast)
    with pytest.raises(ValueError, match="another model"):
        load_drafter(p, tiny_base(1).to(torch.float16))
    with pytest.raises(ValueError, match="other weights"):
        pre.check(tiny_base(1).to(torch.float16))


# ------------------------------------------------------------------------------------------- SSD conditions
@pytest.mark.parametrize("plan", ["2xF1-h0-K1", "3xF1-fwd-K2", "1xF2-h0-K1-none", "2xF2-h0-K1", "3xF1-h0-K2-causal",
                                  "2xF2-fwd-K1-causal"])
def test_ssd_solve_own_kv_is_the_solve(plan):
    model = make_model(seed=1, n_layer=6)
    x = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    p = Plan.parse(plan)
    ref = solve(model, x, p)
    got = ssd_solve(model, x, p, ref.prefix, None)
    torch.testing.assert_close(got, ref.hidden, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("plan", ["2xF1-h0-K1", "2xF2-fwd-K2", "3xF1-h0-K2-none", "3xF1-h0-K2-causal",
                                  "2xF2-fwd-K2-causal"])
def test_ssd_solve_is_the_cached_draft_step(plan):
    """Position t of the window solve under SSD conditions = the real drafter decode step at t on a KV cache
    that holds the base's exact K/V of positions < t (what the verifier leaves in self-speculative decoding)."""
    base = make_model(seed=2, n_layer=6, window_pattern="SL", short_window=3)  # windows, x0, value embeddings
    d = perturb(make_drafter(base, plan), scale=0.1)
    x = torch.randint(0, base.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    p = Plan.parse(plan)
    with torch.no_grad():
        ctx = base.embed(x)
        trace = [ctx.x0]
        base.run_layers(ctx.x0, ctx, 0, 6, trace)
        S = p.prefix_len(6)
        got = ssd_solve(d.model, x, p, trace[S], exact_kv(base, trace, p, ctx))  # (1, T, D)
        for t in range(x.shape[1]):
            cache = KVCache.for_model(base, max_len=16)
            if t:
                base(x[:, :t], cache=cache)  # the verifier's exact K/V
            step = solve(d.model, x[:, t:t + 1], p, cache=cache).hidden[0, -1]
            torch.testing.assert_close(got[0, t], step, atol=1e-9, rtol=1e-9)


# ---------------------------------------------------------------------------------- speculative decoding
@pytest.mark.parametrize("plan,block", [("2xF1-h0-K1", 3), ("1xF2-h0-K2", 4), ("3xF1-fwd-K1", 2)])
def test_speculative_with_adapted_drafter_is_the_base_greedy(plan, block):
    """Greedy SSD with an adapted (here: perturbed) drafter emits exactly transformers' greedy output."""
    from snlp.decode.speculative import speculative_generate

    hf = hf_tiny(seed=5)
    base, _ = from_hf(hf)
    d = perturb(make_drafter(base, plan), scale=0.2)
    prompt = ids(1, 5, seed=7)[0].tolist()
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20,
                      pad_token_id=0)[0, len(prompt):].tolist()
    got = speculative_generate(base, prompt, plan, block=block, max_new_tokens=20, drafter=d)
    assert got.tokens == ref
    assert got.drafted > 0 and got.mode == "speculative"
    with pytest.raises(ValueError, match="share_weights"):
        speculative_generate(base, prompt, plan, max_new_tokens=4, drafter=d, share_weights=True)
    with pytest.raises(ValueError, match="does not fit this drafter"):
        speculative_generate(base, prompt, "1xF1-h0-K1", max_new_tokens=4, drafter=d)
    with pytest.raises(ValueError, match="another model"):
        speculative_generate(tiny_base(9), prompt, plan, max_new_tokens=4, drafter=make_drafter(base, plan))


def test_batched_speculative_with_adapted_drafter_is_each_prompts_greedy():
    """A ragged batch of prompts drafted by an adapted drafter: every row equals transformers' greedy output for
    that prompt alone (the batch path builds its draft step from the drafter's module, the base verifies)."""
    from snlp.decode.speculative import speculative_generate

    hf = hf_tiny(seed=6)
    base, _ = from_hf(hf)
    d = perturb(make_drafter(base, "2xF1-h0-K1"), scale=0.2)
    prompts = [ids(1, n, seed=10 + n)[0].tolist() for n in (3, 9, 6)]
    got = speculative_generate(base, prompts, "2xF1-h0-K1", block=3, max_new_tokens=12, drafter=d, adaptive=True)
    assert len(got) == len(prompts)
    for p, r in zip(prompts, got):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                          pad_token_id=0)[0, len(p):].tolist()
        assert r.tokens == ref
    assert sum(r.drafted for r in got) > 0


@pytest.mark.parametrize("rank,block", [(0, 1), (2, 3)])
def test_acceptance_counts_equal_a_naive_replay_of_the_drafts(rank, block):
    """alpha's counts (accepted / examined / drafted, what `snlp eval --drafter` and adapt report) against a naive
    replay of the greedy output: each round's drafts recomputed one token at a time on a fresh cache that holds the
    base's exact K/V of the verified positions, compared with the emitted tokens up to the first mismatch."""
    from snlp.decode.speculative import speculative_generate
    from snlp.method.solver import solve

    base, _ = from_hf(hf_tiny(seed=6).double())
    base = base.double()
    d = perturb(make_drafter(base, "2xF1-h0-K1", rank=rank), scale=0.02)
    prompt, N = ids(1, 3, seed=13)[0].tolist(), 16
    res = speculative_generate(base, prompt, d.plan, block=block, max_new_tokens=N, drafter=d)
    full = prompt + res.tokens

    def drafts(t: int, k: int) -> list[int]:  # a round after t emitted tokens: its input is position len(prompt)+t-1
        pos, out = len(prompt) + t - 1, []
        cache = KVCache.for_model(base, max_len=64)
        with torch.no_grad():
            base(torch.tensor([full[:pos]]), cache=cache)
            tok = full[pos]
            for _ in range(k):
                tok = int(base.head(solve(d.model, torch.tensor([[tok]]), d.plan, cache=cache).hidden)[0, -1].argmax())
                out.append(tok)
        return out

    t = acc = exam = drafted = 0
    while t < N:
        k = min(block, N - t - 1)  # the last token of the budget is the verifier's: no draft for it
        if k <= 0:
            t += 1
            continue
        dr, n = drafts(t, k), 0
        while n < k and dr[n] == res.tokens[t + n]:
            n += 1
        acc, exam, drafted, t = acc + n, exam + n + (n < k), drafted + k, t + n + 1
    assert (res.accepted, res.examined, res.drafted) == (acc, exam, drafted)
    assert 0 < acc < exam


def test_acceptance_stops_at_the_eos_a_round_accepted():
    """A round whose accepted drafts hold an EOS ends the output there: the drafts after it are not part of the
    decode, so alpha's counts (accepted / examined, `snlp eval --drafter`'s alpha column) stop at that EOS. Before,
    every draft the verifier accepted past the EOS counted as accepted, and its first rejection past it as examined
    (here: 5 examined where the output holds 4). Reference: a naive replay of the greedy output cut at the
    EOS, each round's drafts recomputed on a fresh cache of the base's exact K/V and compared with the output up to
    its end (fp64); every EOS candidate of the output is tried, and at least one round drafts past its EOS."""
    from snlp.decode.speculative import speculative_generate
    from snlp.method.solver import solve

    base, _ = from_hf(hf_tiny(seed=6).double())
    base = base.double()
    d = perturb(make_drafter(base, "2xF1-h0-K1"), scale=0.02)
    prompt, N, block = ids(1, 3, seed=13)[0].tolist(), 16, 4
    free = speculative_generate(base, prompt, d.plan, block=block, max_new_tokens=N, drafter=d).tokens

    def drafts(full: list[int], t: int, k: int) -> list[int]:  # the round after t emitted tokens
        pos, out = len(prompt) + t - 1, []
        cache = KVCache.for_model(base, max_len=64)
        with torch.no_grad():
            base(torch.tensor([full[:pos]]), cache=cache)
            tok = full[pos]
            for _ in range(k):
                tok = int(base.head(solve(d.model, torch.tensor([[tok]]), d.plan, cache=cache).hidden)[0, -1].argmax())
                out.append(tok)
        return out

    past = 0  # rounds whose drafts went past the EOS, over the candidates
    for e in range(1, N - 2):
        if free[e] in free[:e]:
            continue  # the EOS must end the output at e
        res = speculative_generate(base, prompt, d.plan, block=block, max_new_tokens=N, drafter=d, eos_id=free[e])
        out = free[:e + 1]
        assert res.tokens == out and res.stop == "eos"
        t = acc = exam = 0
        while t < len(out):
            k = min(block, N - t - 1)
            dr, n = drafts(prompt + free, t, k), 0
            while n < k and t + n < len(out) and dr[n] == out[t + n]:
                n += 1
            past += t + k > len(out) and dr[:len(out) - t] == out[t:]
            acc, exam, t = acc + n, exam + n + (n < k and t + n < len(out)), t + n + 1
        assert (res.accepted, res.examined) == (acc, exam), e
    assert past > 0


@pytest.mark.slow  # adapts and decodes the real SmolLM2 (CI runs -m slow)
def test_speculative_with_drafter_on_smollm2(smol):
    """The real SmolLM2: SSD with a (perturbed) adapted drafter = the base's sequential greedy output."""
    from snlp.decode.generate import sequential_generate
    from snlp.decode.speculative import speculative_generate

    model, tok = smol
    d = perturb(make_drafter(model, "8xF1-h0-K1"), scale=0.002)
    prompt = tok.render_chat([{"role": "user", "content": "Name three colours."}], add_generation_prompt=True)[0]
    ref = sequential_generate(model, prompt, max_new_tokens=16)
    got = speculative_generate(model, prompt, "8xF1-h0-K1", block=4, max_new_tokens=16, drafter=d)
    assert got.tokens == ref.tokens


# ------------------------------------------------------------------------------------------------ adapt()
def tiny_ckpt(tmp_path, layers: int = 4):
    """An snlp checkpoint of a tiny random Llama with a word-level tokenizer (t0..t92, <s>, </s>) and a
    chat template, plus a text file and a chat file in its vocabulary."""
    model, stok = from_hf(hf_tiny(seed=11, layers=layers, initializer_range=0.25), tokenizer=word_tokenizer(V))  # not ~identity
    save_checkpoint(tmp_path / "base", model, stok)
    text = tmp_path / "text.txt"
    # structured text (arithmetic progressions mod 93): the base's behaviour on it is learnable from 2k tokens
    text.write_text("\n\n".join(" ".join(f"t{(3 * d + 1 + k * (d % 5 + 1)) % (V - 3)}" for k in range(200))
                                for d in range(12)))
    chats = tmp_path / "chat.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"t{i} t{i + 1}"},
                                                        {"role": "assistant", "content": f"t{i + 2} t{i + 3} t{i}"}]})
                               for i in range(40)))
    return tmp_path / "base", text, chats


# an import (--from-model) takes no training settings: adapt_cfg's lr, eval_every and warmup_steps at their defaults
IMPORT = dict(steps=None, lr=3e-4, eval_every=50, warmup_steps=10)


def adapt_cfg(tmp_path, out="d", **kw):
    from snlp.train.adapt import AdaptConfig

    base, text, chats = tiny_ckpt(tmp_path)
    cfg = dict(src=str(base), plan="2xF1-h0-K1", out=str(tmp_path / out), data=f"{text},chat:{chats}", steps=100,
               seq_len=24, batch_size=4, lr=3e-3, eval_every=100, eval_batches=2, save_every=0, no_progress=True,
               warmup_steps=2)
    cfg.update(kw)
    return AdaptConfig(**cfg)


@pytest.mark.parametrize("kv", ["exact", "own"])
def test_adapt_raises_top1_agreement(tmp_path, kv):
    from snlp.io.checkpoint import load
    from snlp.train.adapt import adapt

    res = adapt(adapt_cfg(tmp_path, kv=kv))
    key = "top1_ssd" if kv == "exact" else "top1"
    assert res.steps == 100 and res.stopped_by == "budget"
    assert res.after[key] > res.before[key] + 0.05, (res.before, res.after)
    assert res.after["val_loss"] < 0.8 * res.before["val_loss"]
    assert not (tmp_path / "d" / "run").exists()  # finished: only the drafter's own files remain
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["drafter.json", "drafter.safetensors", "log.jsonl"]
    base, _ = load(tmp_path / "base")
    d = load_drafter(tmp_path / "d", base)  # the adapted drafter drafts for its base, the base's output unchanged
    from snlp.decode.generate import sequential_generate
    from snlp.decode.speculative import speculative_generate
    ref = sequential_generate(base, [1, 2, 3], max_new_tokens=12)
    assert speculative_generate(base, [1, 2, 3], d.plan, block=3, max_new_tokens=12, drafter=d).tokens == ref.tokens
    with pytest.raises(ValueError, match="already holds a drafter"):
        adapt(adapt_cfg(tmp_path / "again", out=str(tmp_path / "d")))


def test_adapt_refuses_an_out_that_holds_another_run_and_a_base_without_tokenizer(tmp_path):
    """`snlp adapt CKPT --out CKPT` (or any folder holding files) wrote the drafter and its log.jsonl over the
    checkpoint's training log; a base saved without tokenizer.json failed mid-run on an AttributeError. Both are
    refused before anything is loaded or written."""
    from snlp.train.adapt import adapt

    cfg = adapt_cfg(tmp_path, out="base", steps=2)
    base = tmp_path / "base"
    (base / "log.jsonl").write_text('{"step": 0, "val_loss": 1.0}\n')
    before = {f.name: f.read_bytes() for f in base.iterdir()}
    with pytest.raises(ValueError, match=r"--out .*base is not empty \(it holds config.json, log.jsonl"):
        adapt(cfg)
    assert {f.name: f.read_bytes() for f in base.iterdir()} == before  # nothing written, nothing lost
    # the weights file inside the checkpoint names the checkpoint, as for snlp eval / generate / train --init-from
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / ".gitkeep").write_text("")  # an empty folder but for a dot-file is empty, as the loader reads it
    res = adapt(dataclasses.replace(cfg, src=str(base / "model.safetensors"), out=str(tmp_path / "f")))
    assert res.steps == 2 and (tmp_path / "f" / "drafter.json").is_file()
    (base / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="has no tokenizer"):
        adapt(dataclasses.replace(cfg, out=str(tmp_path / "d")))
    assert not (tmp_path / "d").exists()


def test_the_summary_line_names_out_run_only_where_it_stays(tmp_path, capsys):
    """The training loop's summary line said "saved OUT/run" for a finished adaptation, whose OUT/run is removed once
    the drafter is written; a run stopped early keeps OUT/run (for --resume), and its line names it."""
    from snlp.train.adapt import adapt

    adapt(adapt_cfg(tmp_path, steps=2))
    said = capsys.readouterr().out
    assert not (tmp_path / "d" / "run").exists()
    assert "trained 2 steps" in said and f"saved {tmp_path / 'd' / 'run'}" not in said, said
    adapt(adapt_cfg(tmp_path / "b", steps=4, stop_after=1))
    said = capsys.readouterr().out
    assert (tmp_path / "b" / "d" / "run").is_dir()
    assert f"saved {tmp_path / 'b' / 'd' / 'run'} after 1 steps" in said, said


def test_adapt_resume_equals_uninterrupted(tmp_path):
    from safetensors.torch import load_file

    from snlp.train.adapt import adapt

    adapt(adapt_cfg(tmp_path / "a", steps=8, eval_every=4))
    r1 = adapt(adapt_cfg(tmp_path / "b", steps=8, eval_every=4, stop_after=4, save_every=4))
    assert r1.stopped_by == "stop_after" and (tmp_path / "b" / "d" / "run").is_dir()
    r2 = adapt(adapt_cfg(tmp_path / "b", steps=8, eval_every=4, resume=True))
    assert r2.steps == 8 and r2.stopped_by == "budget"
    wa, wb = (load_file(str(tmp_path / x / "d" / "drafter.safetensors")) for x in ("a", "b"))
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_cli_adapt_resume_alone_continues_the_run_with_its_saved_settings(tmp_path, monkeypatch, capsys):
    """`snlp adapt --out DIR --resume` alone, from another folder, continues the run as `snlp train --resume` does: the
    base, the plan and every setting not typed are the saved run's (relative paths recorded absolute), and the
    drafter equals the uninterrupted run's bit for bit; a typed other value of a setting the run keeps is refused
    before any work, naming the saved one."""
    from safetensors.torch import load_file

    from snlp.apps.cli import main

    tiny_ckpt(tmp_path)
    monkeypatch.chdir(tmp_path)
    run = ["adapt", "base", "--plan", "2xF1-h0-K1", "--data", "text.txt,chat:chat.jsonl", "--steps", "8",
           "--seq-len", "24", "--batch-size", "4", "--lr", "3e-3", "--warmup-steps", "2", "--eval-every", "4",
           "--eval-batches", "2", "--val-frac", "0.25", "--seed", "3", "--no-progress"]
    assert main([*run, "--out", "a"]) == 0
    assert main([*run, "--out", "b", "--stop-after", "4", "--save-every", "4"]) == 0
    assert (tmp_path / "b" / "run").is_dir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    b = str(tmp_path / "b")
    log = (tmp_path / "b" / "run" / "log.jsonl").read_text()
    capsys.readouterr()
    for typed, said in ((["--lr", "0.01"], "--lr 0.003 (not 0.01)"), (["--seed", "0"], "--seed 3 (not 0)"),
                        (["--plan", "1xF2-h0-K1"], "plan 2xF1-h0-K1")):
        assert main(["adapt", "--out", b, "--resume", *typed]) == 2
        assert said in capsys.readouterr().err
    assert (tmp_path / "b" / "run" / "log.jsonl").read_text() == log  # refused before any work
    assert main(["adapt", "--out", b, "--resume"]) == 0
    wa, wb = (load_file(str(tmp_path / x / "drafter.safetensors")) for x in ("a", "b"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    ca, cb = (json.loads((tmp_path / x / "drafter.json").read_text())["record"]["config"] for x in ("a", "b"))
    assert cb["src"] == str(tmp_path / "base") and cb["data"] == f"{tmp_path / 'text.txt'},chat:{tmp_path / 'chat.jsonl'}"
    assert {k for k in ca if ca[k] != cb[k]} == {"out", "resume", "save_every"}
    # without a saved run there is nothing to take SRC and --plan from
    assert main(["adapt", "--out", str(tmp_path / "c"), "--resume"]) == 2
    assert "SRC and --plan" in capsys.readouterr().err
    assert main(["adapt", "--out", str(tmp_path / "c"), "--steps", "2"]) == 2


def test_adapt_resume_refuses_another_base(tmp_path):
    """--resume with another base is refused before any work (it would otherwise continue and
    stamp the new base's fingerprint on a drafter trained on the old one)."""
    from snlp.train.adapt import adapt

    adapt(adapt_cfg(tmp_path, steps=6, eval_every=100, stop_after=2, save_every=2))
    run = tmp_path / "d" / "run"
    log, meta = (run / "log.jsonl").read_text(), (tmp_path / "d" / "drafter.json").read_text()
    other, otok = from_hf(hf_tiny(seed=12, layers=4, initializer_range=0.25), tokenizer=word_tokenizer(V))
    save_checkpoint(tmp_path / "other", other, otok)
    with pytest.raises(ValueError, match="another base"):
        adapt(adapt_cfg(tmp_path, src=str(tmp_path / "other"), steps=6, resume=True))
    with pytest.raises(ValueError, match="plan"):
        adapt(adapt_cfg(tmp_path, plan="1xF2-h0-K1", steps=6, resume=True))
    # what the steps optimise, named by adapt's own flags
    with pytest.raises(ValueError, match=r"--seq-len 24 \(not 8\), --lr 0.003 \(not 0.01\)"):
        adapt(adapt_cfg(tmp_path, steps=6, resume=True, lr=1e-2, seq_len=8))
    assert (run / "log.jsonl").read_text() == log and (tmp_path / "d" / "drafter.json").read_text() == meta  # no work
    assert adapt(adapt_cfg(tmp_path, steps=6, resume=True)).steps == 6  # its own base resumes


def test_adapt_leaves_the_callers_model_where_and_as_it_was(tmp_path):
    """Adapting a caller's loaded model (the speedrun's) neither moves it nor leaves it frozen or
    in eval mode; a run on another device trains a copy there (a meta device stands in for a GPU); the speedrun
    stage trains on the device it is given and records it."""
    from snlp.apps.adapt import speedrun_adaptation
    from snlp.io.checkpoint import load
    from snlp.train.adapt import adapt, adapt_job, train_config
    from snlp.model.fingerprint import weights_fingerprint

    cfg = adapt_cfg(tmp_path, steps=2, device="cpu")
    model, tok = load(cfg.src)
    model.train()
    model.blocks[0].eval()  # a part the caller keeps in eval mode (the drafter shares this prefix block)
    modes = {n: m.training for n, m in model.named_modules()}
    before = {n: (p.data_ptr(), p.device, p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()}
    assert all(rg for _, _, rg, _ in before.values())
    res = adapt(cfg, base=(model, tok))
    for n, p in model.named_parameters():
        ptr, dev, rg, val = before[n]
        assert (p.data_ptr(), p.device, p.requires_grad) == (ptr, dev, rg) and torch.equal(p, val), n
    assert {n: m.training for n, m in model.named_modules()} == modes  # model.train(was) set blocks[0] training
    assert model.training and res.device == "cpu" and res.steps == 2

    held: dict = {}
    make_job = adapt_job(cfg, Plan.parse(cfg.plan), held, (model, tok), weights_fingerprint(model), owned=False)
    job = make_job(train_config(cfg, model.config.n_embd), None, None, 0, 1, torch.device("meta"))
    assert job.model.wte.weight.device.type == "meta" and held["base"] is not model
    assert all((p.data_ptr(), p.device) == before[n][:2] for n, p in model.named_parameters())

    val = torch.arange(200) % V
    a = speedrun_adaptation(model, tok, cfg.src, cfg.data, 0, val, minutes=0.005, plan="2xF1-h0-K1", gen_tokens=6,
                            device="cpu")
    assert a["device"] == "cpu" and all(r["matches_sequential"] for r in a["ssd"].values())
    assert all((p.data_ptr(), p.device, p.requires_grad) == before[n][:3] for n, p in model.named_parameters())


def _ddp_adapt_rank(rank, world, port, cfg):
    from conftest import init_gloo
    from snlp.train.adapt import adapt

    init_gloo(rank, world, port)
    res = adapt(cfg)
    assert res.world == world and res.steps == cfg.steps


@pytest.mark.slow  # two spawned gloo ranks (CI runs -m slow)
def test_adapt_under_ddp_equals_one_process(tmp_path):
    """Two gloo ranks of batch 2 all-reduce their gradients: the drafter equals one process's
    of batch 4 (the same global batches, snlp.io.data.batch_at) up to fp32 reduction order; rank 0 alone writes."""
    from safetensors.torch import load_file

    from conftest import spawn_ranks
    from snlp.train.adapt import adapt

    one = adapt_cfg(tmp_path, out="one", steps=3, batch_size=4, eval_every=100, device="cpu")
    adapt(one)
    two = adapt_cfg(tmp_path, out="two", steps=3, batch_size=2, eval_every=100, device="cpu")
    spawn_ranks(_ddp_adapt_rank, 2, two)
    wa, wb = (load_file(str(tmp_path / x / "drafter.safetensors")) for x in ("one", "two"))
    base = load_file(str(tmp_path / "base" / "model.safetensors"))
    assert set(wa) == set(wb)
    moved = max((wa[k] - base[k]).abs().max().item() for k in wa)
    assert moved > 1e-3  # the runs really trained
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=moved * 1e-3, rtol=0), k
    rec = json.loads((tmp_path / "two" / "drafter.json").read_text())["record"]
    assert rec["world"] == 2 and rec["steps"] == 3


@pytest.mark.slow  # two spawned gloo ranks
def test_adapt_loss_on_replies_under_ddp_equals_one_process(tmp_path):
    """--loss-on replies averages KL and MSE over each window's reply positions, whose number differs between ranks
    (replies of 1, 2 and 15 tokens): two gloo ranks of batch 2 train the drafter of one process of batch 4 only when
    each rank's means are weighted by its share of the global batch's reply positions (unweighted, DDP's average
    weighs a rank of few reply tokens as much as one of many: the drafters differed by more than training moved them)."""
    import random

    from safetensors.torch import load_file

    from conftest import spawn_ranks
    from snlp.train.adapt import adapt

    def cfg(out, batch_size):
        c = adapt_cfg(tmp_path, out=out, steps=3, batch_size=batch_size, eval_every=100, device="cpu",
                      loss_on="replies", data=f"chat:{tmp_path / 'ragged.jsonl'}")
        r = random.Random(0)
        (tmp_path / "ragged.jsonl").write_text("\n".join(json.dumps({"messages": [
            {"role": "user", "content": f"t{i} t{i + 1}"},
            {"role": "assistant", "content": " ".join(f"t{(7 * i + k) % 90}" for k in range(r.choice([1, 2, 15])))}]})
            for i in range(60)))
        return c

    adapt(cfg("one", 4))
    spawn_ranks(_ddp_adapt_rank, 2, cfg("two", 2))
    wa, wb = (load_file(str(tmp_path / x / "drafter.safetensors")) for x in ("one", "two"))
    base = load_file(str(tmp_path / "base" / "model.safetensors"))
    moved = max((wa[k] - base[k]).abs().max().item() for k in wa)
    assert moved > 1e-3
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=moved * 1e-3, rtol=0), k


def test_eval_chat_prompts_are_held_out_of_adaptation(tmp_path):
    """With user-only conversations in the chat set (dropped by adaptation before its split),
    `snlp eval --drafter --chat-prompts` takes its prompts from the conversations adaptation held out at the
    drafter's own val_frac, never from those it trained on. Reference: the documented rule written out here
    (render, drop conversations without an assistant token, every round(1/val_frac)-th held out)."""
    from snlp.eval.drafter import drafter_split, held_out_prompts
    from snlp.io.checkpoint import load
    from snlp.io.drafter import load_record
    from snlp.train.adapt import adapt, token_stream

    base_dir, _, _ = tiny_ckpt(tmp_path)
    convs = []
    for i in range(40):  # unique user turns: a prompt identifies its conversation
        user = {"role": "user", "content": f"t{i} t{(7 * i + 3) % 93} t{(11 * i + 5) % 93}"}
        convs.append([user, {"role": "assistant", "content": f"t{(i + 2) % 93} t{(i + 3) % 93} t{i}"}])
    for j in (0, 9, 23):  # user-only conversations: nothing to learn, adaptation drops them
        convs.insert(j, [{"role": "user", "content": f"t{90 - j} t{91 - j}"}])
    chats = tmp_path / "mixed.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": c}) for c in convs))
    cfg = adapt_cfg(tmp_path, data=f"chat:{chats}", val_frac=0.2, steps=1, seq_len=16)
    adapt(cfg)
    _, tok = load(base_dir)

    kept = [c for c in convs if sum(tok.render_chat(c)[1][1:]) > 0]  # the documented rule, by hand
    trained = [c for i, c in enumerate(kept) if i % 5 != 4]
    held = [c for i, c in enumerate(kept) if i % 5 == 4]
    old_pick = [c for i, c in enumerate(convs) if i % 20 == 19]  # a6631c2: the raw list at the base's 0.05
    assert any(c in trained for c in old_pick)  # the scenario is one where the old choice measured training data

    split = drafter_split(load_record(cfg.out))
    assert split.val_frac == 0.2 and split.data == cfg.data
    prompts = held_out_prompts(f"chat:{chats}", tok, split.val_frac, 100)
    assert prompts == [tok.render_chat(c[:1], add_generation_prompt=True)[0] for c in held]
    train_ids = token_stream(cfg.data, tok, 0, cfg.val_frac)[0].tolist()
    train_str = " " + " ".join(map(str, train_ids)) + " "
    for c in held:  # behaviourally: no held-out user turn occurs in the token stream adaptation trained on
        user = tok.render_chat(c[:1])[0][1:]
        assert " " + " ".join(map(str, user)) + " " not in train_str
    for c in trained[:3]:  # (and the check can fail: a trained one does occur)
        assert " " + " ".join(map(str, tok.render_chat(c[:1])[0][1:])) + " " in train_str
    with pytest.raises(ValueError, match="contradicts"):
        drafter_split(load_record(cfg.out), val_frac=0.05)
    with pytest.raises(ValueError, match="contradicts"):
        drafter_split(load_record(cfg.out), data=str(chats))


def test_eval_data_part_reads_the_adaptation_held_out_documents(tmp_path):
    """Text side of the chat-set split: `snlp eval --drafter --data PART` (one file of the drafter's data) reads the
    documents of PART that adaptation held out in ITS split of the whole spec (every round(1/val_frac)-th
    document of all text parts together), not PART's own split."""
    import snlp.io.data as D
    from snlp.eval.drafter import DrafterSplit, held_out_tokens

    _, tok = from_hf(hf_tiny(), tokenizer=word_tokenizer(V))
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("\n\n".join(f"t{i} t{i + 1} " * 900 for i in range(5)))  # ~4 KB paragraphs: one document each
    b.write_text("\n\n".join(f"t{40 + i} t{41 + i} " * 900 for i in range(7)))
    docs = [(f, d) for f in (a, b) for d in D.documents(str(f))]
    assert len(docs) == 12
    held = [d for i, (f, d) in enumerate(docs) if i % 4 == 3 and f == b]  # by hand: the whole spec's split
    want = [t for d in held for t in [tok.bos_id] + tok.encode(d)]
    got = held_out_tokens(DrafterSplit(data=f"{a},{b}", val_frac=0.25, keep=(str(b),)), tok)
    assert got.tolist() == want and len(held) == 2
    own = [d for i, d in enumerate(D.documents(str(b))) if i % 4 == 3]  # b's own split: another document
    assert own != held


# ------------------------------------------------------------------------------------------- CLI, export
def test_cli_adapt_generate_eval_export(tmp_path, capsys):
    from snlp.apps.cli import main
    from snlp.io.checkpoint import load

    base_dir, text, chats = tiny_ckpt(tmp_path)
    d = tmp_path / "drafter"
    assert main(["adapt", str(base_dir), "--plan", "2xF1-h0-K1", "--out", str(d), "--data", f"{text},chat:{chats}",
                 "--steps", "4", "--seq-len", "16", "--eval-every", "2", "--no-progress"]) == 0
    assert "adapted 2xF1-h0-K1 drafter" in capsys.readouterr().out
    for mode in ("speculative", "snlp"):
        assert main(["generate", str(base_dir), "--mode", mode, "--drafter", str(d), "--prompt", "t3 t4",
                     "--max-new-tokens", "6", "--quiet", *(["--no-baseline"] if mode == "speculative" else []),
                     "--json", str(tmp_path / f"{mode}.json")]) == 0
    spec, seq = json.loads((tmp_path / "speculative.json").read_text()), None
    assert main(["generate", str(base_dir), "--prompt", "t3 t4", "--max-new-tokens", "6", "--quiet",
                 "--json", str(tmp_path / "seq.json")]) == 0
    seq = json.loads((tmp_path / "seq.json").read_text())
    assert spec["tokens"] == seq["tokens"] and spec["plan"] == "2xF1-h0-K1"
    assert main(["generate", str(base_dir), "--mode", "jacobi", "--drafter", str(d), "--prompt", "t1"]) == 2
    # a prompts file decoded in ragged batches with the drafter: every row is its prompt's sequential output
    (tmp_path / "prompts.txt").write_text("t3 t4\nt1\nt5 t6 t7\n")
    assert main(["generate", str(base_dir), "--mode", "speculative", "--drafter", str(d), "--prompts-file",
                 str(tmp_path / "prompts.txt"), "--batch-size", "2", "--max-new-tokens", "6", "--quiet",
                 "--json", str(tmp_path / "batch.json")]) == 0
    batch = json.loads((tmp_path / "batch.json").read_text())
    assert batch["matches_sequential"] and len(batch["results"]) == 3
    assert set(batch["load"]) == {"start", "end", "peak", "cores", "machine_cpus"}  # its baseline's window (snlp.runtime.load)
    assert batch["results"][0]["tokens"] == seq["tokens"]
    for bad in (["--val-frac", "0.5"], ["--data", str(tmp_path / "elsewhere.txt")], ["--max-chars", "100"]):
        assert main(["eval", str(base_dir), "--drafter", str(d), "--seq-len", "16", *bad]) == 2
        assert "contradicts the drafter's adaptation split" in capsys.readouterr().err
    assert main(["eval", str(base_dir), "--drafter", str(d), "--data", str(text), "--seq-len", "16",
                 "--max-tokens", "64", "--chat-prompts", f"chat:{chats}", "--prompts", "2", "--gen-tokens", "6",
                 "--blocks", "2,3", "--json", str(tmp_path / "ev.json"), "--no-progress"]) == 0
    rows = json.loads((tmp_path / "ev.json").read_text())
    assert [r["drafter"] for r in rows] == ["post-hoc", "adapted"]
    assert all(r["load"]["cores"] >= 1 for r in rows)  # the window its SSD tok/s were timed in
    assert all(s["matches_sequential"] for r in rows for s in r["ssd"]) and len(rows[0]["ssd"]) == 2
    # export: base prefix + adapted suffix as a transformers model; back through transformers it is the drafter
    assert main(["export", str(d), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    base, _ = load(base_dir)
    drafter = load_drafter(d, base)
    back, _ = from_hf(hf)
    x = ids(2, 10)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, drafter.model(x), atol=1e-4, rtol=1e-4)
        p = drafter.plan
        torch.testing.assert_close(back.head(solve(back, x, p).hidden), drafter.model.head(solve(drafter.model, x, p).hidden),
                                   atol=1e-4, rtol=1e-4)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["snlp_drafter"]["plan"] == "2xF1-h0-K1"


def test_speedrun_adaptation_stage(tmp_path):
    """The speedrun's off-the-shelf adaptation on a tiny model: a timed run, before/after records, SSD rows for
    the post-hoc and the adapted drafter, both exact."""
    from snlp.apps.adapt import speedrun_adaptation
    from snlp.apps.report import adaptation_lines
    from snlp.io.checkpoint import load

    base_dir, text, _ = tiny_ckpt(tmp_path)
    model, tok = load(base_dir)
    val = torch.tensor(tok.encode(text.read_text()[:3000]))
    a = speedrun_adaptation(model, tok, str(base_dir), str(text), 0, val, minutes=0.03, plan="2xF1-h0-K1",
                            gen_tokens=8)
    assert a["steps"] >= 1 and set(a["ssd"]) == {"post-hoc", "adapted"}
    assert all(r["matches_sequential"] for r in a["ssd"].values())
    assert "top1" in a["before"] and "top1" in a["after"]
    assert "B = 4 over" in adaptation_lines(a)[0] and "acceptance alpha" in adaptation_lines(a)[0]


def test_adapt_own_kv_with_a_plan_ssd_does_not_cover(tmp_path):
    from snlp.train.adapt import adapt

    with pytest.raises(ValueError, match="SSD-conditions training supports"):
        adapt(adapt_cfg(tmp_path, plan="2xF1-h0-K1-diag", steps=2))
    res = adapt(adapt_cfg(tmp_path, plan="2xF1-h0-K1-diag", kv="own", steps=3, eval_every=3))
    assert res.steps == 3 and res.after["top1_ssd"] is None and res.after["top1"] > 0  # not measured, never 0


def test_cli_adapt_says_when_the_ssd_conditions_top1_was_not_measured(tmp_path, monkeypatch, capsys):
    """A plan ssd_solve does not cover has no SSD-conditions Top-1: the end-of-run line printed "SSD conditions
    0.0 -> 0.0 %", and log.jsonl / --json said 0."""
    import json

    from snlp.apps.cli import main

    tiny_ckpt(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["adapt", "base", "--plan", "2xF1-h0-K1-diag", "--kv", "own", "--data", "text.txt", "--steps", "2",
                 "--seq-len", "24", "--batch-size", "2", "--eval-every", "2", "--eval-batches", "1", "--out", "d",
                 "--json", "d.json", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "SSD conditions not measured for this plan" in out and "SSD conditions 0.0" not in out
    rec = json.loads((tmp_path / "d.json").read_text())
    assert rec["before"]["top1_ssd"] is None and rec["after"]["top1_ssd"] is None and rec["after"]["top1"] > 0


# ------------------------------------------------------------------------------------------- LoRA drafters
def test_lora_drafter_shares_the_base_matrices_and_merges_exactly(tmp_path):
    base = tiny_base()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    d = make_drafter(base, "2xF1-h0-K1", rank=4)
    lin = d.model.blocks[2].attn.c_q
    assert lin.parametrizations.weight.original is base.blocks[2].attn.c_q.weight  # W0 is the base's, no copy
    x = ids(2, 10)
    with torch.no_grad():  # B = 0 at the start: the LoRA drafter is the post-hoc drafter
        torch.testing.assert_close(solve(d.model, x, d.plan).hidden,
                                   solve(make_drafter(base, d.plan).model, x, d.plan).hidden, atol=0, rtol=0)
    assert all(k.endswith((".A", ".B", "ln_attn", "ln_mlp")) for k in d.suffix_state())
    assert d.extra_bytes() < 0.5 * make_drafter(base, d.plan).extra_bytes()
    perturb(d, scale=0.2)
    with torch.no_grad():
        want = solve(d.model, x, d.plan).hidden
        m = d.merged()
        torch.testing.assert_close(solve(m.model, x, d.plan).hidden, want, atol=1e-6, rtol=1e-6)
    assert not any(".A" in k for k in m.suffix_state()) and m.check(base) is m and d.check(base) is d
    twin = tiny_base()  # the same weights, but not the base's own Parameter objects under the deltas
    stray = make_drafter(twin, "2xF1-h0-K1", rank=4)
    stray.model = copy.copy(stray.model)
    stray.model._modules = dict(stray.model._modules, wte=base.wte, lm_head=base.lm_head)
    stray.model.blocks = torch.nn.ModuleList(list(base.blocks[:2]) + list(stray.model.blocks[2:]))
    with pytest.raises(ValueError, match="another model's suffix matrices"):
        stray.check(base)
    back = load_drafter(save_drafter(tmp_path / "d", d), base)
    assert back.rank == 4 and set(back.suffix_state()) == set(d.suffix_state())
    with torch.no_grad():
        torch.testing.assert_close(solve(back.model, x, d.plan).hidden, want, atol=0, rtol=0)
    for k, v in base.state_dict().items():  # adapting, merging and loading never wrote into the base
        assert torch.equal(v, before[k]), k
    with pytest.raises(ValueError, match="lora-rank"):
        make_drafter(base, "2xF1-h0-K1", rank=-1)
    with pytest.raises(ValueError, match="exceeds"):
        make_drafter(base, "2xF1-h0-K1", rank=1000)


def test_adapt_lora_raises_top1_and_drafts_exactly(tmp_path):
    from snlp.decode.generate import sequential_generate
    from snlp.decode.speculative import speculative_generate
    from snlp.io.checkpoint import load
    from snlp.train.adapt import adapt

    res = adapt(adapt_cfg(tmp_path, lora_rank=4, lr=1e-2))
    assert res.after["top1_ssd"] > res.before["top1_ssd"] + 0.05, (res.before, res.after)
    assert res.after["val_loss"] < 0.8 * res.before["val_loss"]
    base, _ = load(tmp_path / "base")
    before = {k: v.clone() for k, v in base.state_dict().items()}
    d = load_drafter(tmp_path / "d", base)
    assert d.rank == 4 and res.extra_bytes == d.extra_bytes()
    ref = sequential_generate(base, [1, 2, 3], max_new_tokens=12)
    assert speculative_generate(base, [1, 2, 3], d.plan, block=3, max_new_tokens=12, drafter=d).tokens == ref.tokens
    for k, v in base.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(ValueError, match="cannot be stopped and resumed"):
        adapt(adapt_cfg(tmp_path / "r", lora_rank=4, stop_after=2))


def test_lora_drafter_exports_merged_to_transformers(tmp_path):
    from snlp.io.drafter import export_drafter_hf

    base = tiny_base()
    d = perturb(make_drafter(base, "2xF1-h0-K1", rank=2), scale=0.2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(export_drafter_hf(d, tmp_path / "hf"))).eval()
    x = ids(2, 10)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, d.model(x), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------- the paper's route, packaged as a drafter
def test_idn_finetune_with_frozen_prefix_becomes_a_drafter(tmp_path):
    """`snlp train --init-from BASE --reg idn --freeze-prefix` (the paper's route: it changes the model) and
    `snlp adapt BASE --from-model TUNED`: the tuned copy's suffix drafts for the unchanged base, exactly."""
    from snlp.decode.generate import sequential_generate
    from snlp.decode.speculative import speculative_generate
    from snlp.io.checkpoint import load
    from snlp.train.adapt import adapt
    from snlp.train.config import TrainConfig
    from snlp.train.trainer import fit

    base_dir, text, _ = tiny_ckpt(tmp_path)
    common = dict(init_from=str(base_dir), reg="idn", reg_n="2", reg_lambda=2.0, optimizer="adamw", matrix_lr=3e-3,
                  unembedding_lr=3e-3, data=str(text), seq_len=24, batch_size=4, steps=6, eval_every=6,
                  eval_batches=1, no_progress=True, cache_dir=str(tmp_path / "cache"))
    fit(TrainConfig(out=str(tmp_path / "idn"), freeze_prefix=-1, **{**common, "unembedding_lr": 0.0}))
    res = adapt(adapt_cfg(tmp_path, plan="2xF1-h0-K1", from_model=str(tmp_path / "idn"), **IMPORT))
    assert res.steps == 0 and res.stopped_by == "from_model" and "top1_ssd" in res.after
    base, _ = load(base_dir)
    tuned, _ = load(tmp_path / "idn")
    d = load_drafter(tmp_path / "d", base)
    for k, v in d.suffix_state().items():
        assert torch.equal(v, tuned.state_dict()[k]), k
        assert not torch.equal(v, base.state_dict()[k]) or "ln_" in k  # the fine-tuning changed the suffix
    ref = sequential_generate(base, [1, 2, 3], max_new_tokens=10)
    assert speculative_generate(base, [1, 2, 3], d.plan, block=3, max_new_tokens=10, drafter=d).tokens == ref.tokens
    fit(TrainConfig(out=str(tmp_path / "all"), **common))  # the whole model fine-tuned: its prefix moved too
    with pytest.raises(ValueError, match="freeze-prefix"):
        adapt(adapt_cfg(tmp_path, out="d2", plan="2xF1-h0-K1", from_model=str(tmp_path / "all"), **IMPORT))
    with pytest.raises(ValueError, match="without training"):
        adapt(adapt_cfg(tmp_path, out="d3", from_model=str(tmp_path / "idn"), **{**IMPORT, "steps": 5}))


@pytest.mark.parametrize("kv", ["exact", "own"])
def test_validate_drafter_in_row_slices_equals_one_forward(tmp_path, kv):
    """Under DDP a validation batch holds the global batch's B*P rows; validate_drafter(rows=B) runs at most B rows a
    forward (one forward of them all would hold P times training's logits) and its KL, MSE and Top-1 agreements stay
    the whole batch's position means. Reference: the same batches in one forward each."""
    from snlp.train.adapt import validate_drafter

    base = tiny_base()
    d = perturb(make_drafter(base, "2xF1-h0-K1"))
    cfg = adapt_cfg(tmp_path, kv=kv)
    batches = [(ids(B=5, T=12, seed=s), None) for s in (1, 2)]
    ref = validate_drafter(base, d, batches, cfg, "cpu")
    seen = []
    hook = base.wte.register_forward_pre_hook(lambda m, a: seen.append(a[0].size(0)))  # every forward embeds
    try:
        got = validate_drafter(base, d, batches, cfg, "cpu", rows=2)
    finally:
        hook.remove()
    assert seen and max(seen) <= 2
    for k in ("loss", "mse", "top1", "top1_ssd"):
        assert getattr(got, k) == pytest.approx(getattr(ref, k), rel=1e-6, abs=1e-9), k


def test_a_drafter_refuses_a_plan_that_adds_or_drops_causal(tmp_path):
    """A drafter's suffix weights are fitted through its plan's function, with the suffix windows (plain) or without
    them (`causal`); a plan that flips the option runs the weights through the other function. It was accepted (only
    the layout was compared) and decoded with the other function silently; now refused, the drafter's own plan and a
    plan with another K keep working, also after a save / load round trip."""
    from snlp.decode.speculative import speculative_generate

    base = make_model()
    for own, other in (("4xF1-h0-K1-causal", "4xF1-h0-K2"), ("4xF1-h0-K1", "4xF1-h0-K2-causal")):
        d = load_drafter(save_drafter(tmp_path / own, make_drafter(base, own)), base)
        assert d.plan == Plan.parse(own)
        assert d.check_plan(Plan.parse(own).with_(iters=3)) == Plan.parse(own).with_(iters=3)
        with pytest.raises(ValueError, match="does not fit this drafter.*-causal"):
            d.check_plan(Plan.parse(other))
        with pytest.raises(ValueError, match="does not fit this drafter.*-causal"):
            speculative_generate(base, [3, 1, 4], other, max_new_tokens=4, drafter=d)

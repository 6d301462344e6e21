"""`snlp adapt --self-distill N`: the training rows are the training prompts followed by the base's own greedy
reply (outside reference: a full-prefix argmax loop over the base's forward), the store is reused, held-out
conversations are never prompted and the held-out stream is untouched; bad combinations are refused up front."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import snlp.io.data as D
import snlp.train.selfgen as SG
from conftest import argmax_loop
from snlp.io.checkpoint import load
from snlp.model.fingerprint import weights_fingerprint
from test_adapt import adapt_cfg, tiny_ckpt

pytestmark = pytest.mark.usefixtures("one_thread")


def chat_file(tmp_path, n: int = 24):
    """Conversations with unique user turns (a prompt identifies its conversation), one user-only (dropped)."""
    convs = [[{"role": "user", "content": f"t{i} t{(7 * i + 3) % 93} t{(5 * i) % 90}"},
              {"role": "assistant", "content": f"t{(i + 2) % 93} t{i}"}] for i in range(n)]
    convs.insert(3, [{"role": "user", "content": "t1 t2"}])
    path = tmp_path / "convs.jsonl"
    path.write_text("\n".join(json.dumps({"messages": c}) for c in convs))
    return path, convs


def test_replies_are_the_base_greedy_decode_cached_and_held_out_prompts_are_never_used(tmp_path, monkeypatch):
    base_dir, _, _ = tiny_ckpt(tmp_path)
    model, tok = load(base_dir)
    model = model.double().eval()  # fp64: the batched cached decode and the reference loop cannot split a near-tie
    path, convs = chat_file(tmp_path)
    kept = [c for c in convs if len(c) > 1]  # the user-only conversation has no assistant token: dropped
    trained = [c for i, c in enumerate(kept) if i % 5 != 4]  # val_frac 0.2: every 5th held out
    held = [c for i, c in enumerate(kept) if i % 5 == 4]
    prompts = [tok.render_chat(c[:1], add_generation_prompt=True)[0] for c in trained]
    stops = list(tok.stop_ids)
    assert stops, "the tiny tokenizer stops after </s>"
    want = [p + argmax_loop(model, p, 7, eos_id=stops) for p in prompts]
    fp = weights_fingerprint(model)
    cache = tmp_path / "cache"

    g = SG.self_distill_rows(model, tok, f"chat:{path}", 0.2, 7, fp, cache_dir=str(cache))
    assert g.rows == want and g.prompts == len(trained) == g.generated
    assert g.reply_tokens == sum(len(w) - len(p) for w, p in zip(want, prompts))
    held_prompts = [tok.render_chat(c[:1], add_generation_prompt=True)[0] for c in held]
    assert not any(r[:len(h)] == h for r in g.rows for h in held_prompts)  # no held-out prompt is ever decoded

    def fail(*a, **k):
        raise AssertionError("decoded again although the store holds every reply")

    monkeypatch.setattr(SG, "greedy_replies", fail)
    again = SG.self_distill_rows(model, tok, f"chat:{path}", 0.2, 7, fp, cache_dir=str(cache))
    assert again.rows == want and again.generated == 0
    assert SG.self_distill_rows(model, tok, f"chat:{path}", 0.2, 7, fp, max_prompts=3,
                                cache_dir=str(cache)).rows == want[:3]
    with pytest.raises(AssertionError, match="decoded again"):  # another N is another store
        SG.self_distill_rows(model, tok, f"chat:{path}", 0.2, 5, fp, cache_dir=str(cache))
    assert len(list(cache.glob("selfgen-*.npz"))) == 1


def test_adapt_trains_on_the_replies_and_keeps_the_held_out_stream(tmp_path):
    from snlp.train.adapt import adapt, adapt_job, token_stream, train_config

    cfg = adapt_cfg(tmp_path, self_distill=6, self_distill_prompts=10, steps=2, cache_dir=str(tmp_path / "cache"))
    model, tok = load(cfg.src)
    plan = cfg.check()
    fp = weights_fingerprint(model)
    held: dict = {}
    job = adapt_job(cfg, plan, held, (model, tok), fp)(train_config(cfg, model.config.n_embd), None, tok, 0, 1, "cpu")
    train, val = token_stream(cfg.data, tok, cfg.max_chars, cfg.val_frac)
    ref_val = D.val_batches(val, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(job.val_batches, ref_val))  # the human held-out stream
    text = cfg.data.split(",")[0]
    text_train = token_stream(text, tok, cfg.max_chars, cfg.val_frac)[0]
    g = SG.self_distill_rows(held["base"], tok, cfg.data, cfg.val_frac, 6, fp, 10, cfg.cache_dir)
    assert g.generated == 0 and g.prompts == 10  # the job's own call filled the store
    stream = np.concatenate([text_train, np.asarray([t for r in g.rows for t in r])])
    x, _ = job.batch(0, 0, 1)
    s = " " + " ".join(map(str, stream.tolist())) + " "
    for row in x.tolist():  # every window is cut from text + prompts with the base's replies
        assert " " + " ".join(map(str, row)) + " " in s
    assert "10 chat prompts with the base's greedy replies" in job.describe
    res = adapt(cfg)
    assert res.steps == 2
    rec = json.loads((tmp_path / "d" / "drafter.json").read_text())
    assert rec["record"]["config"]["self_distill"] == 6 and rec["record"]["config"]["self_distill_prompts"] == 10


@pytest.mark.parametrize("kw, msg", [
    (dict(self_distill=-1), "must be >= 0"),
    (dict(self_distill_prompts=5), "give --self-distill too"),
    (dict(self_distill=8, from_model="x"), "--from-model trains nothing"),
    (dict(self_distill=8, data="a.txt"), "no chat:PATH part"),
])
def test_bad_self_distill_combinations_are_refused_before_any_work(tmp_path, kw, msg):
    from snlp.train.adapt import AdaptConfig, adapt

    cfg = AdaptConfig(src=str(tmp_path / "missing"), plan="2xF1-h0-K1", out=str(tmp_path / "d"), **kw)
    with pytest.raises(ValueError, match=msg):
        adapt(cfg)  # (the base does not even exist: refused before loading it)
    assert not (tmp_path / "d").exists()


def test_store_key_follows_what_decides_the_replies_and_bad_data_is_refused_before_decoding(tmp_path, monkeypatch):
    """The same weights under another config (rope_base) or dtype decode other replies: they get their own store,
    never the other base's replies. A stream too short even with full replies is refused before any decoding."""
    import dataclasses

    base_dir, _, _ = tiny_ckpt(tmp_path)
    model, tok = load(base_dir)
    model = model.double().eval()
    path, _ = chat_file(tmp_path)
    fp, cache = weights_fingerprint(model), str(tmp_path / "cache")
    first = SG.self_distill_rows(model, tok, f"chat:{path}", 0.2, 7, fp, cache_dir=cache)
    other = type(model)(dataclasses.replace(model.config, rope_base=model.config.rope_base * 50)).double().eval()
    other.load_state_dict(model.state_dict())
    assert weights_fingerprint(other) == fp  # the weights alone cannot tell the two bases apart
    again = SG.self_distill_rows(other, tok, f"chat:{path}", 0.2, 7, fp, cache_dir=cache)
    assert again.generated == again.prompts and again.cache != first.cache
    prompts = SG.training_prompts(f"chat:{path}", tok, 0.2)[0][0][1]
    assert again.rows == [p + argmax_loop(other, p, 7, eos_id=list(tok.stop_ids)) for p in prompts]
    assert SG.base_identity(model.float(), fp) != SG.base_identity(model.double(), fp)

    def fail(*a, **k):
        raise AssertionError("decoded although the stream cannot be long enough")

    monkeypatch.setattr(SG, "greedy_replies", fail)
    with pytest.raises(ValueError, match="give at most .* train tokens: need more than 100,000"):
        SG.self_distill_rows(model, tok, f"chat:{path}", 0.2, 8, fp, cache_dir=cache, need_tokens=100_000)


def test_a_part_named_twice_counts_twice_and_held_out_twins_are_left_out(tmp_path):
    """`chat:X,chat:X` weighs X twice in the human stream, so its prompts count twice here too; a training
    conversation that opens exactly as a held-out one does is left out (its reply is what the drafter is scored
    on), and counted."""
    base_dir, _, _ = tiny_ckpt(tmp_path)
    model, tok = load(base_dir)
    path, convs = chat_file(tmp_path)
    one, _ = SG.training_prompts(f"chat:{path}", tok, 0.2)
    two, _ = SG.training_prompts(f"chat:{path},chat:{path}", tok, 0.2)
    assert len(two) == 2 and two[0][1] == two[1][1] == one[0][1]
    g = SG.self_distill_rows(model, tok, f"chat:{path},chat:{path}", 0.2, 3, weights_fingerprint(model))
    assert g.prompts == 2 * len(one[0][1]) and sum(g.per_part.values()) == g.prompts
    kept = [c for c in convs if len(c) > 1]
    # with the twin second, conversation 4 (every 5th is held out) is kept[3]: the twin opens as it does
    twin = [dict(kept[3][0]), {"role": "assistant", "content": "t5"}]
    path2 = tmp_path / "twins.jsonl"
    path2.write_text("\n".join(json.dumps({"messages": c}) for c in [kept[0], twin, *kept[1:]]))
    parts, twins = SG.training_prompts(f"chat:{path2}", tok, 0.2)
    opening = tok.render_chat(kept[3][:1], add_generation_prompt=True)[0]
    assert twins == 1 and opening not in parts[0][1]


def test_the_bases_submodules_leave_the_decode_in_the_modes_they_came_in(tmp_path, monkeypatch):
    """The replies are decoded in eval mode; afterwards `model.train(was)` set every submodule to the top-level mode, so
    a caller's block kept in eval mode left training. Each submodule's own mode is kept, after a decode and after a
    decode that raised."""
    base_dir, _, _ = tiny_ckpt(tmp_path)
    model, tok = load(base_dir)
    model.train()
    model.blocks[0].eval()
    modes = {n: m.training for n, m in model.named_modules()}
    path, _ = chat_file(tmp_path)
    seen = []
    decode = SG.greedy_replies

    def watched(m, *a, **k):
        seen.append(any(x.training for x in m.modules()))
        return decode(m, *a, **k)

    monkeypatch.setattr(SG, "greedy_replies", watched)
    g = SG.self_distill_rows(model, tok, f"chat:{path}", 0.2, 3, weights_fingerprint(model))
    assert g.generated > 0 and seen == [False]  # decoded with every submodule in eval mode
    assert {n: m.training for n, m in model.named_modules()} == modes

    def fail(*a, **k):
        raise RuntimeError("decode failed")

    monkeypatch.setattr(SG, "greedy_replies", fail)
    with pytest.raises(RuntimeError, match="decode failed"):
        SG.self_distill_rows(model, tok, f"chat:{path}", 0.2, 3, weights_fingerprint(model))
    assert {n: m.training for n, m in model.named_modules()} == modes

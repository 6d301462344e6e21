"""`snlp adapt --loss-on replies` and `--init-drafter DIR`: the replies-only loss is a hand-written masked mean over the
positions that predict a reply token (fp64, a reply masker written here from the template's markers), `all` is the
plain mean over every position and the plain batches; a run started from a drafter starts from its weights exactly
(LoRA and full suffix); bad combinations are refused with one line before any work."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import snlp.io.data as D
from snlp.io.checkpoint import load, save_checkpoint
from snlp.io.drafter import load_drafter
from snlp.io.hf import from_hf
from snlp.model.fingerprint import weights_fingerprint
from snlp.model.ops import norm
from conftest import word_tokenizer
from test_adapt import V, adapt_cfg, hf_tiny, tiny_ckpt

pytestmark = pytest.mark.usefixtures("one_thread")


def chat_cfg(tmp_path, out="d", **kw):
    """adapt_cfg on the chat part alone (--loss-on replies refuses text parts), windows short enough for its
    two held-out conversations."""
    cfg = adapt_cfg(tmp_path, out=out, **{"seq_len": 8, **kw})
    cfg.data = cfg.data.split(",")[1]
    return cfg


def naive_reply_mask(stream: list[int], tok) -> list[int]:
    """1 on every reply token of a stream of two-turn conversations rendered by the tiny template
    (`<s>user</s><s>assistant</s>` per conversation): the tokens after every second <s> through the next </s>."""
    bos, eos = tok.bos_id, tok.token_id("</s>")
    out, opened, inside = [], 0, False
    for t in stream:
        out.append(int(inside))
        if t == bos and not inside:
            opened += 1
            inside = opened % 2 == 0
        elif t == eos and inside:
            inside = False
    return out


def build_job(cfg, dtype=torch.float64, init=None):
    from snlp.train.adapt import adapt_job, train_config

    model, tok = load(cfg.src)
    model = model.to(dtype)
    held: dict = {}
    job = adapt_job(cfg, cfg.check(), held, (model, tok), weights_fingerprint(model), init=init)(
        train_config(cfg, model.config.n_embd), None, tok, 0, 1, "cpu")
    return job, held, tok


def naive_terms(held, x, mask, tau):
    """(KL, MSE) of the drafter against the base on x, each a Python-loop mean over the positions with mask 1
    (every position when mask is None), in fp64."""
    from snlp.train.adapt import student, teacher

    base, drafter = held["base"], held["drafter"]
    with torch.no_grad():
        hS, hL_t, lg_t, kvx, hb = teacher(base, x, drafter.plan, "exact")
        hL_s = student(drafter, x, hS, kvx, "exact", hb)
        lg_s = drafter.model.head(hL_s)
    kl = mse = 0.0
    n = 0
    B, T = x.shape
    for b in range(B):
        for t in range(T):
            if mask is not None and not mask[b][t]:
                continue
            p = torch.softmax(lg_t[b, t].double() / tau, -1)
            q = torch.softmax(lg_s[b, t].double() / tau, -1)
            kl += float((p * (p.log() - q.log())).sum()) * tau * tau
            d = norm(hL_s[b, t].double()) - norm(hL_t[b, t].double())
            mse += float((d * d).mean())
            n += 1
    return kl / max(n, 1), mse / max(n, 1), n


def test_replies_loss_is_the_masked_mean_over_reply_positions_and_all_is_unchanged(tmp_path):
    from snlp.train.adapt import token_stream

    cfg = chat_cfg(tmp_path, loss_on="replies", tau=1.5)
    job, held, tok = build_job(cfg)
    train, _ = token_stream(cfg.data, tok, cfg.max_chars, cfg.val_frac)
    ref_mask = naive_reply_mask(train.tolist(), tok)
    assert 0 < sum(ref_mask) < len(ref_mask)
    n_len = len(train) - cfg.seq_len - 1
    for micro in range(3):
        x, w = job.batch(micro, 0, 1)
        assert torch.equal(x, D.batch_at(train, micro, cfg.seq_len, cfg.batch_size, cfg.seed)[0])
        # the windows' offsets (D.batch_at's draw) and the mask of the token AFTER each position
        starts = np.random.default_rng([cfg.seed, micro]).integers(0, n_len + 1, size=cfg.batch_size)
        want = [[ref_mask[s + t + 1] for t in range(cfg.seq_len)] for s in starts]
        assert w.tolist() == want
        loss, kl, mse = (float(v.detach()) for v in job.loss(x, w, 0.0))
        rkl, rmse, n = naive_terms(held, x, want, cfg.tau)
        assert n > 0
        assert abs(kl - rkl) < 1e-6 * max(1, rkl) and abs(mse - rmse) < 1e-6 * max(1, rmse)
        assert abs(loss - (cfg.kl_weight * rkl + cfg.hidden_weight * rmse)) < 1e-6
    # a window without reply positions contributes nothing (not a NaN)
    zero = job.loss(x, torch.zeros_like(w), 0.0)[0]
    assert float(zero.detach()) == 0.0

    job_all, held_all, _ = build_job(chat_cfg(tmp_path, out="d_all", tau=1.5))
    for micro in range(2):
        b = job_all.batch(micro, 0, 1)
        ref = D.batch_at(train, micro, cfg.seq_len, cfg.batch_size, cfg.seed)
        assert all(torch.equal(u, v) for u, v in zip(b, ref))  # the plain batches: y the next tokens
        loss, kl, mse = job_all.loss(*b, 0.0)
        rkl, rmse, n = naive_terms(held_all, b[0], None, 1.5)
        assert n == b[0].numel()
        assert abs(float(kl) - rkl) < 1e-6 * max(1, rkl) and abs(float(mse) - rmse) < 1e-6 * max(1, rmse)


@pytest.mark.parametrize("loss_on", ["all", "replies"])
def test_an_fp64_runs_kl_and_mse_terms_are_fp64_means(tmp_path, loss_on):
    """An fp64 base's distillation terms (the trained loss and the validation's) are its fp64 means: the MSE of the
    RMS-normalised final states was computed on `.float()` copies, fp32 (~1e-8 relative, its gradient too).
    Reference: naive_terms' per-position fp64 loop."""
    from snlp.train.adapt import validate_drafter

    cfg = chat_cfg(tmp_path, loss_on=loss_on)
    job, held, _ = build_job(cfg)
    perturb_suffix(held["drafter"])
    x, w = job.batch(0, 0, 1)
    _, kl, mse = job.loss(x, w, 0.0)
    assert kl.dtype == mse.dtype == torch.float64
    rkl, rmse, n = naive_terms(held, x, w.tolist() if loss_on == "replies" else None, cfg.tau)
    assert n > 0
    assert abs(float(kl) - rkl) <= 1e-12 * rkl and abs(float(mse) - rmse) <= 1e-12 * rmse
    v = validate_drafter(held["base"], held["drafter"], [(x, None)], cfg, "cpu")
    vkl, vmse, _ = naive_terms(held, x, None, cfg.tau)
    assert abs(v.loss - vkl) <= 1e-12 * vkl and abs(v.mse - vmse) <= 1e-12 * vmse


def perturb_suffix(drafter, scale: float = 0.05):
    """Move the drafter's suffix off the base's (an unadapted drafter's final states are close to the base's)."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for v in drafter.suffix_state().values():
            v.add_(torch.randn(v.shape, generator=gen, dtype=v.dtype) * scale)


def test_replies_mask_of_self_distilled_rows_marks_the_base_replies(tmp_path):
    """With --self-distill the reply positions are the base's reply tokens after each training prompt."""
    import snlp.train.selfgen as SG

    cfg = chat_cfg(tmp_path, loss_on="replies", self_distill=5, cache_dir=str(tmp_path / "cache"))
    job, held, tok = build_job(cfg)
    g = SG.self_distill_rows(held["base"], tok, cfg.data, cfg.val_frac, 5, weights_fingerprint(held["base"]),
                             cache_dir=cfg.cache_dir)
    assert g.generated == 0  # the job's own call decoded them
    prompts = [p for _, ps in SG.training_prompts(cfg.data, tok, cfg.val_frac)[0] for p in ps]
    stream, ref = [], []
    for row, p in zip(g.rows, prompts):
        assert row[:len(p)] == p
        stream += row
        ref += [0] * len(p) + [1] * (len(row) - len(p))
    assert sum(ref) == g.reply_tokens
    n_len = len(stream) - cfg.seq_len - 1
    for micro in range(3):
        x, w = job.batch(micro, 0, 1)
        starts = np.random.default_rng([cfg.seed, micro]).integers(0, n_len + 1, size=cfg.batch_size)
        assert x.tolist() == [stream[s:s + cfg.seq_len] for s in starts]
        assert w.tolist() == [ref[s + 1:s + cfg.seq_len + 1] for s in starts]
    assert "loss on the" in job.describe and "reply tokens only" in job.describe


@pytest.mark.parametrize("lora", [0, 4])
def test_init_drafter_starts_from_its_weights_exactly(tmp_path, lora):
    from snlp.train.adapt import adapt, init_state

    first = adapt(chat_cfg(tmp_path, out="a", steps=3, lora_rank=lora))
    model, _ = load(chat_cfg(tmp_path).src)
    saved = load_drafter(tmp_path / "a", model).suffix_state()
    cfg = chat_cfg(tmp_path, out="b", steps=2, lora_rank=lora, init_drafter=str(tmp_path / "a"), loss_on="replies")
    state, digest = init_state(cfg, cfg.check(), model, weights_fingerprint(model))
    assert set(state) == set(saved) and all(torch.equal(state[k], saved[k]) for k in saved)
    fresh = build_job(cfg, dtype=torch.float32)[1]["drafter"].suffix_state()
    assert not all(torch.equal(fresh[k], saved[k]) for k in saved)  # (without it: the post-hoc drafter)
    own = build_job(cfg, dtype=torch.float32, init=state)[1]["drafter"].suffix_state()
    assert all(torch.equal(own[k], saved[k]) for k in saved)  # loaded bit for bit into the run's drafter
    res = adapt(cfg)
    assert res.before["val_loss"] == first.after["val_loss"]  # step 0 validates the drafter it started from
    rec = json.loads((tmp_path / "b" / "drafter.json").read_text())["record"]
    assert rec["init_drafter_digest"] == digest and rec["config"]["init_drafter"] == str(tmp_path / "a")
    assert rec["config"]["loss_on"] == "replies"


def test_init_drafter_refusals_before_any_work(tmp_path):
    from snlp.train.adapt import adapt

    adapt(chat_cfg(tmp_path, out="a", steps=2, lora_rank=4))
    a = str(tmp_path / "a")
    other, otok = from_hf(hf_tiny(seed=12, layers=4, initializer_range=0.25), tokenizer=word_tokenizer(V))
    save_checkpoint(tmp_path / "other", other, otok)
    cases = [
        (dict(src=str(tmp_path / "other")), "other base weights"),
        (dict(plan="1xF2-h0-K1"), "suffix"),
        (dict(plan="1xF1-h0-K1"), "suffix"),
        (dict(lora_rank=8), "LoRA rank 4"),
        (dict(lora_rank=4, lora_alpha=8.0), "alpha 4"),
        (dict(lora_rank=0), "LoRA rank 4"),
        (dict(lora_rank=4, val_frac=0.1), "--val-frac 0.05"),
        (dict(lora_rank=4, from_model=a), "--from-model trains nothing"),
        (dict(lora_rank=4, init_drafter=str(tmp_path / "nothing")), "drafter .*nothing does not exist"),
    ]
    for kw, msg in cases:
        cfg = chat_cfg(tmp_path, out="b", steps=2, **{"init_drafter": a, **kw})
        with pytest.raises(ValueError, match=msg) as e:
            adapt(cfg)
        assert "\n" not in str(e.value)
        assert not (tmp_path / "b").exists()  # refused before any work
    # another data spec (the text + chat one): its split differs
    cfg = adapt_cfg(tmp_path, out="b", steps=2, lora_rank=4, init_drafter=a)
    with pytest.raises(ValueError, match="--data"):
        adapt(cfg)
    # K and the init may differ: the same suffix
    assert adapt(chat_cfg(tmp_path, out="c", steps=1, lora_rank=4, plan="2xF1-fwd-K2", init_drafter=a)).steps == 1


@pytest.mark.parametrize("kw, msg", [
    (dict(loss_on="prompts"), "--loss-on must be one of all, replies"),
    (dict(loss_on="replies", data="a.txt,chat:b.jsonl"), "text parts without replies \\(a.txt\\)"),
    (dict(loss_on="replies", from_model="x"), "--from-model trains nothing"),
])
def test_bad_loss_on_is_refused_before_any_work(tmp_path, kw, msg):
    from snlp.train.adapt import AdaptConfig, adapt

    cfg = AdaptConfig(src=str(tmp_path / "missing"), plan="2xF1-h0-K1", out=str(tmp_path / "d"), **kw)
    with pytest.raises(ValueError, match=msg) as e:
        adapt(cfg)  # (the base does not even exist: refused before loading it)
    assert "\n" not in str(e.value) and not (tmp_path / "d").exists()


def test_save_every_of_a_lora_run_is_refused_not_ignored(tmp_path):
    """A LoRA run keeps no resumable checkpoint (its drafter is saved at the end only): --save-every N > 0 would be
    silently dropped, so it is refused before any work; the default and 0 save at the end only."""
    from snlp.train.adapt import AdaptConfig, adapt, train_config

    kw = dict(src=str(tmp_path / "missing"), plan="2xF1-h0-K1", out=str(tmp_path / "d"))
    with pytest.raises(ValueError, match="--save-every 60 keeps resumable checkpoints") as e:
        adapt(AdaptConfig(**kw, lora_rank=4, save_every=60))  # (the base does not even exist)
    assert "\n" not in str(e.value) and not (tmp_path / "d").exists()
    for save_every in (None, 0):
        cfg = AdaptConfig(**kw, lora_rank=4, save_every=save_every)
        cfg.check()
        assert train_config(cfg, 64).save_every == 0
    assert train_config(AdaptConfig(**kw), 64).save_every == 50  # full suffix weights: resumable, every 50 by default
    assert train_config(AdaptConfig(**kw, save_every=7), 64).save_every == 7


def test_save_every_means_an_interval_and_the_record_says_what_ran(tmp_path, capsys):
    """--save-every N: a resumable checkpoint every N > 0 steps, 0 at the end only; a negative N means nothing (the
    loop's `step % N` would save after every step) and is refused with one line before any work, by snlp adapt and
    snlp train alike (--from-model, which trains nothing, takes none). The drafter's record holds the interval the
    run used: 50 for a full-weight run without the flag, 0 for a LoRA run (not null)."""
    from snlp.apps.cli import main
    from snlp.train.adapt import AdaptConfig, adapt
    from snlp.train.config import TrainConfig

    kw = dict(src=str(tmp_path / "missing"), plan="2xF1-h0-K1", out=str(tmp_path / "d"))
    for bad in (dict(save_every=-1), dict(save_every=-1, lora_rank=4), dict(save_every=5, from_model="x")):
        with pytest.raises(ValueError, match="--save-every") as e:
            adapt(AdaptConfig(**kw, **bad))  # (the base does not even exist)
        assert "\n" not in str(e.value) and not (tmp_path / "d").exists()
    with pytest.raises(ValueError, match="--save-every must be >= 0"):
        TrainConfig(out=str(tmp_path / "t"), save_every=-1).check()
    capsys.readouterr()
    assert main(["adapt", kw["src"], "--plan", kw["plan"], "--out", kw["out"], "--save-every", "-1"]) == 2
    assert main(["train", "--out", str(tmp_path / "t"), "--save-every", "-1"]) == 2
    assert capsys.readouterr().err.count("--save-every must be >= 0") == 2
    assert not (tmp_path / "d").exists() and not (tmp_path / "t").exists()
    for out, lora, want in (("full", 0, 50), ("lora", 4, 0)):
        adapt(adapt_cfg(tmp_path, out=out, steps=2, save_every=None, lora_rank=lora))
        assert json.loads((tmp_path / out / "drafter.json").read_text())["record"]["config"]["save_every"] == want


def test_cli_takes_the_options(tmp_path, capsys):
    from snlp.apps.cli import main

    base, _, chats = tiny_ckpt(tmp_path)
    common = [str(base), "--plan", "2xF1-h0-K1", "--data", f"chat:{chats}", "--steps", "2", "--seq-len", "8",
              "--eval-every", "100", "--save-every", "0", "--no-progress", "--lora-rank", "4"]
    assert main(["adapt", *common, "--out", str(tmp_path / "a")]) == 0
    assert main(["adapt", *common, "--out", str(tmp_path / "b"), "--loss-on", "replies",
                 "--init-drafter", str(tmp_path / "a")]) == 0
    rec = json.loads((tmp_path / "b" / "drafter.json").read_text())["record"]["config"]
    assert rec["loss_on"] == "replies" and rec["init_drafter"] == str(tmp_path / "a")


def test_an_adaptation_keeps_the_log_a_killed_earlier_run_left(tmp_path, capsys):
    """A run killed before its first save leaves OUT/run/log.jsonl; the next run's loop sets it aside as
    OUT/run/log.unsaved.jsonl and says so, but a finished adaptation removes OUT/run: the log is kept beside the
    drafter (it was deleted with the folder, the message naming a file that no longer existed)."""
    from snlp.train.adapt import adapt

    cfg = adapt_cfg(tmp_path, out="d", steps=2)
    dead = "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(1, 4))
    (tmp_path / "d" / "run").mkdir(parents=True)
    (tmp_path / "d" / "run" / "log.jsonl").write_text(dead)
    adapt(cfg)
    assert "log.unsaved.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "d" / "run").exists()
    assert (tmp_path / "d" / "log.unsaved.jsonl").read_text() == dead
    assert dead not in (tmp_path / "d" / "log.jsonl").read_text()  # the drafter's log is this run's alone


@pytest.mark.parametrize("from_model", [False, True])
def test_windows_longer_than_the_bases_context_are_refused(tmp_path, from_model):
    """--seq-len above the base's sequence_len trained (and validated) the drafter on positions the model never
    decodes at (its KV cache holds sequence_len), against the base's untrained outputs there, silently; `snlp sft`
    caps its rows at that length. Refused in one line, before the data is read or anything written."""
    from snlp.train.adapt import adapt

    base_dir, _, _ = tiny_ckpt(tmp_path)
    n = load(base_dir)[0].config.sequence_len
    cfg = adapt_cfg(tmp_path, out="d", seq_len=n + 1, steps=1)
    if from_model:
        from snlp.train.adapt import AdaptConfig

        cfg = AdaptConfig(src=cfg.src, plan=cfg.plan, out=cfg.out, data=cfg.data, seq_len=n + 1,
                          from_model=str(base_dir))
    with pytest.raises(ValueError, match=f"--seq-len {n + 1} exceeds the base's context \\({n} positions\\)") as e:
        adapt(cfg)
    assert "\n" not in str(e.value) and not (tmp_path / "d").exists()


WEIGHTS_FINITE, TAU_LR_FINITE = "--hidden-weight and --kl-weight must be finite", "--tau and --lr must be finite"


@pytest.mark.parametrize("kw, says", [(dict(hidden_weight=float("inf")), WEIGHTS_FINITE),
                                      (dict(kl_weight=float("inf")), WEIGHTS_FINITE),
                                      (dict(tau=float("inf")), TAU_LR_FINITE), (dict(lr=float("inf")), TAU_LR_FINITE)])
def test_infinite_loss_settings_are_refused_before_any_work(tmp_path, kw, says):
    """An inf --hidden-weight / --kl-weight passed the `>= 0` check and made every gradient NaN (the run ended with
    status 0 and a NaN drafter), an inf --tau failed at step 1, an inf --lr was refused as `--matrix-lr`, a flag
    adapt has not. Each is now one line naming its own flag, before the base loads."""
    from snlp.train.adapt import AdaptConfig, adapt

    with pytest.raises(ValueError, match=says) as e:
        adapt(AdaptConfig(src=str(tmp_path / "missing"), plan="2xF1-h0-K1", out=str(tmp_path / "d"), **kw))
    assert "\n" not in str(e.value) and not (tmp_path / "d").exists()


def test_a_non_finite_weighted_loss_stops_the_run_and_writes_no_drafter(tmp_path):
    """The shared loop stops on a non-finite logged loss; adapt logs the KL, and stepped on KL + hidden_weight * MSE:
    an MSE term that overflows (here a finite weight of 1e300) turned the drafter's weights NaN while the KL stayed
    finite, and the run wrote that drafter with status 0. Now the step's non-finite sum stops it, nothing written."""
    from snlp.train.adapt import adapt

    cfg = adapt_cfg(tmp_path, out="d", steps=2, hidden_weight=1e300, eval_every=1000)
    with pytest.raises(FloatingPointError, match="training loss became nan at step 1"):
        adapt(cfg)
    assert not (tmp_path / "d" / "drafter.json").exists()


def test_max_chars_with_chat_parts_only_is_refused_not_ignored(tmp_path):
    """--max-chars caps the text parts of --data; chat: parts are read whole, so with chat parts only it was dropped
    without a word (and recorded as the split's cap). Refused before the base loads; with a text part it applies."""
    from snlp.train.adapt import AdaptConfig, adapt

    kw = dict(src=str(tmp_path / "missing"), plan="2xF1-h0-K1", out=str(tmp_path / "d"), max_chars=500)
    with pytest.raises(ValueError, match="--max-chars caps the text parts of --data") as e:
        adapt(AdaptConfig(**kw, data=f"chat:{tmp_path / 'c.jsonl'}"))
    assert "\n" not in str(e.value) and not (tmp_path / "d").exists()
    AdaptConfig(**kw, data=f"{tmp_path / 't.txt'},chat:{tmp_path / 'c.jsonl'}").check()


@pytest.mark.parametrize("kv", ["exact", "own"])
def test_an_early_exit_plan_is_refused_before_any_work(tmp_path, kv):
    """`--plan CxFM-h0-K0` skips the suffix (the drafter's logits are the head of h_S): no adapted weight reaches the
    loss, and the run crashed at its first backward with a bare autograd RuntimeError after loading the base and the
    data. One line before any work now; the fwd init at K = 0 (one batched forward of the suffix) still adapts."""
    from snlp.train.adapt import AdaptConfig, adapt

    kw = dict(src=str(tmp_path / "missing"), out=str(tmp_path / "d"), kv=kv)
    with pytest.raises(ValueError, match="the suffix is skipped \\(early exit\\)") as e:
        adapt(AdaptConfig(plan="2xF1-h0-K0", **kw))
    assert "\n" not in str(e.value) and not (tmp_path / "d").exists()
    AdaptConfig(plan="2xF1-fwd-K0", **kw).check()


def test_a_resumed_init_drafter_run_neither_reads_that_drafter_again_nor_records_another(tmp_path):
    """A resumed run continues its own checkpoint's weights, yet it re-read its --init-drafter folder: moved since, the
    resume failed ("does not exist"), and replaced by another drafter of the base at the same path, the finished
    drafter's record named the new one's digest as the drafter it started from. The resume equals a run never
    stopped (weights), and its record holds the digest of the drafter the first leg read."""
    import dataclasses
    import shutil

    from safetensors.torch import load_file

    from snlp.train.adapt import adapt

    adapt(adapt_cfg(tmp_path, out="a", steps=3))
    digest = json.loads((tmp_path / "a" / "drafter.json").read_text())["meta_digest"]
    ref = adapt_cfg(tmp_path, out="ref", steps=4, init_drafter=str(tmp_path / "a"))
    adapt(ref)
    cfg = dataclasses.replace(ref, out=str(tmp_path / "b"), stop_after=2, save_every=2)
    assert adapt(cfg).stopped_by == "stop_after"
    shutil.move(tmp_path / "a", tmp_path / "a-moved")
    adapt(adapt_cfg(tmp_path, out="a", steps=2, seed=1))  # another drafter of the same base, where the first was
    assert json.loads((tmp_path / "a" / "drafter.json").read_text())["meta_digest"] != digest
    res = adapt(dataclasses.replace(cfg, stop_after=None, resume=True))
    assert res.steps == 4 and res.stopped_by == "budget"
    wr, wb = (load_file(str(tmp_path / x / "drafter.safetensors")) for x in ("ref", "b"))
    assert wr.keys() == wb.keys() and all(torch.equal(wr[k], wb[k]) for k in wr)
    rec = json.loads((tmp_path / "b" / "drafter.json").read_text())["record"]
    assert rec["init_drafter_digest"] == digest
    shutil.rmtree(tmp_path / "a")  # and with no drafter left at that path, a stopped run still resumes
    cfg2 = dataclasses.replace(cfg, out=str(tmp_path / "c"))
    shutil.move(tmp_path / "a-moved", tmp_path / "a")
    assert adapt(cfg2).stopped_by == "stop_after"
    shutil.rmtree(tmp_path / "a")
    res = adapt(dataclasses.replace(cfg2, stop_after=None, resume=True))
    assert res.steps == 4
    wc = load_file(str(tmp_path / "c" / "drafter.safetensors"))
    assert all(torch.equal(wr[k], wc[k]) for k in wr)
    assert json.loads((tmp_path / "c" / "drafter.json").read_text())["record"]["init_drafter_digest"] == digest


def test_a_cache_dir_the_run_would_not_use_is_refused_not_ignored(tmp_path, capsys):
    """`snlp adapt --cache-dir DIR` with a chat: part in --data and no --self-distill kept nothing there (a spec with a
    chat part is rendered again on every run) and said nothing. Refused in one line before any work; with text parts
    only it keeps the tokens there, and with --self-distill the base's replies."""
    from snlp.apps.cli import main

    base, text, chats = tiny_ckpt(tmp_path)
    cache = tmp_path / "cache"
    common = [str(base), "--plan", "2xF1-h0-K1", "--steps", "1", "--seq-len", "8", "--eval-every", "100",
              "--eval-batches", "1", "--save-every", "0", "--no-progress", "--cache-dir", str(cache)]
    capsys.readouterr()
    for data in (f"chat:{chats}", f"{text},chat:{chats}"):
        assert main(["adapt", *common, "--data", data, "--out", str(tmp_path / "a")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--cache-dir" in err and "chat: parts" in err, err
        assert not cache.exists() and not (tmp_path / "a").exists()
    assert main(["adapt", *common, "--data", str(text), "--out", str(tmp_path / "t")]) == 0
    assert [p.suffix for p in cache.iterdir()] == [".npz"]
    assert main(["adapt", *common, "--data", f"chat:{chats}", "--self-distill", "4", "--out", str(tmp_path / "s")]) == 0
    assert any(p.name.startswith("selfgen-") for p in cache.iterdir())


def test_an_adapt_resume_refusal_says_a_flag_left_out_not_none(tmp_path):
    """Resuming a run started without --init-drafter with one typed was refused as "--init-drafter None (not ...)"."""
    import dataclasses

    from snlp.train.adapt import adapt

    adapt(adapt_cfg(tmp_path, out="a", steps=2))
    cfg = adapt_cfg(tmp_path, out="b", steps=4, stop_after=2, save_every=2)
    adapt(cfg)
    with pytest.raises(ValueError) as e:
        adapt(dataclasses.replace(cfg, stop_after=None, resume=True, init_drafter=str(tmp_path / "a")))
    assert f"--init-drafter (not given) (not '{tmp_path / 'a'}')" in str(e.value) and "None" not in str(e.value)


def test_the_logs_train_rows_name_the_kl_and_the_mse_not_a_regulariser(tmp_path):
    """An adaptation's train rows logged its final-state MSE as `reg` beside `lambda: 0.0`, the pretraining
    regulariser's keys (docs/training.md), for a term that is no regulariser and a weight that is none. They hold
    `loss` (the KL term) and `mse`, step 1's the naive terms of the first batch on the unadapted drafter."""
    from snlp.train.checkpointing import read_log
    from snlp.train.adapt import adapt

    cfg = adapt_cfg(tmp_path, steps=1, log_every=1, tau=1.5)
    adapt(cfg)
    rows = [r for r in read_log(tmp_path / "d" / "log.jsonl") if "loss" in r]
    assert len(rows) == 1 and "mse" in rows[0] and "reg" not in rows[0] and "lambda" not in rows[0], rows
    job, held, _ = build_job(adapt_cfg(tmp_path, out="fresh", steps=1, tau=1.5), dtype=torch.float32)
    x, _ = job.batch(0, 0, 1)
    kl, mse, n = naive_terms(held, x, None, 1.5)
    assert n == x.numel()
    assert abs(rows[0]["loss"] - kl) < 1e-5 * kl and abs(rows[0]["mse"] - mse) < 1e-5 * mse, (rows[0], kl, mse)


def test_a_callers_base_has_its_fd_eps_checked_in_its_own_dtype(tmp_path):
    """adapt(cfg, base=(model, tok)) trains the drafter in the caller's model's dtype (the run moves a base, never casts
    it), so a diag:fd eps is checked against that dtype, not against cfg.dtype (float32 unless given). An fp64 base
    takes eps:1e-5 (fp64's FD step floor is 1.5e-8; the run's solve takes it): the pre-run check read float32's
    floor (3.45e-4) and refused it. A bf16 base on the CPU cannot take eps:0.01 (bf16's floor, 0.088): refused
    before --out is made, where the float32 check passed it to the student's first solve."""
    from snlp.method.plan import Plan
    from snlp.method.solver import solve
    from snlp.train.adapt import adapt

    plan = "2xF1-h0-K1-diag-eps:1e-5"
    cfg = adapt_cfg(tmp_path, plan=plan, kv="own", steps=1, eval_every=50, eval_batches=1, device="cpu")
    base, tok = load(tmp_path / "base", dtype=torch.float64)
    solve(base, torch.tensor([[1, 2, 3]]), Plan.parse(plan))  # the fp64 model's own solve takes the step
    res = adapt(cfg, base=(base, tok))
    assert res.steps == 1 and (tmp_path / "d" / "drafter.json").is_file()
    out = tmp_path / "d16"
    cfg16 = adapt_cfg(tmp_path, out="d16", plan="2xF1-h0-K1-diag-eps:0.01", kv="own", steps=1, eval_every=50,
                      eval_batches=1, device="cpu")
    with pytest.raises(ValueError, match=r"eps:0.01 is below the smallest FD step of the compute dtype bfloat16"):
        adapt(cfg16, base=(load(tmp_path / "base", dtype=torch.bfloat16)[0], tok))
    assert not out.exists()


# ------------------------------------------------------------------------------ steps with no reply position
def sparse_replies_cfg(tmp_path, out="d", **kw):
    """--loss-on replies on chats of 10-token prompts and 1-token replies, in windows of 4 positions, one per step, at
    a seed whose first micro-batch and some later ones hold no reply position (found here from the hand-written
    reply mask): (the config, the training stream, its naive reply mask, the micro-batches with no reply position
    among the first 12)."""
    from snlp.train.adapt import AdaptConfig, token_stream

    base, _, _ = tiny_ckpt(tmp_path)
    chats = tmp_path / "long_prompts.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(f"t{(i + k) % 90}" for k in range(10))},
        {"role": "assistant", "content": f"t{5 * i % 90}"}]}) for i in range(40)))
    cfg = dict(src=str(base), plan="2xF1-h0-K1", out=str(tmp_path / out), data=f"chat:{chats}", steps=4, seq_len=4,
               batch_size=1, lr=3e-3, eval_every=100, eval_batches=1, save_every=0, no_progress=True, warmup_steps=0,
               warmdown=0.0, loss_on="replies")
    cfg.update(kw)
    _, tok = load(base)
    train, _ = token_stream(cfg["data"], tok, 0, 0.05)
    mask = np.asarray(naive_reply_mask(train.tolist(), tok))

    def empty(seed):
        return [m for m in range(12) if not D.batch_at(mask, m, 4, cfg["batch_size"], seed)[1].any()]
    # micro 0 empty (the first step has nothing to learn), micro 1 not, and an empty one between trained ones
    seed = next(s for s in range(1000) if empty(s)[:1] == [0] and 1 not in empty(s) and 2 not in empty(s)
                and 3 in empty(s))
    return AdaptConfig(**{"seed": seed, **cfg}), train, mask, empty(seed)


def test_a_step_without_reply_positions_is_skipped_and_the_run_equals_a_naive_fp64_loop_that_skips_it(tmp_path):
    """A step whose windows hold no reply position has a 0 loss and a zero gradient (distill_terms' empty mean), on
    which AdamW stepped all the same: its momentum moved the drafter, its step count changed every later bias
    correction, and the step counted against --steps. Reference: a hand-written fp64 loop (per-position KL and MSE,
    gradient clipping, AdamW's update written out) over the micro-batches that hold a reply position, skipping the
    others; the run takes --steps trained steps, logs each skipped one and counts them."""
    from snlp.method.drafter import make_drafter, suffix_parameters
    from snlp.model.ops import norm
    from snlp.train.adapt import adapt, student, teacher

    cfg, train, mask, empty = sparse_replies_cfg(tmp_path, dtype="float64")
    res = adapt(cfg)
    got = load_file_tensors(tmp_path / "d" / "drafter.safetensors")

    base, _ = load(cfg.src, dtype=torch.float64)
    base.requires_grad_(False)
    d = make_drafter(base, cfg.plan)
    names = list(d.suffix_state())
    params = suffix_parameters(d)
    for p in params:
        p.requires_grad_(True)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    b1, b2, eps = 0.8, 0.95, 1e-10
    t = micro = 0
    skipped = []
    while t < cfg.steps:
        x, w = D.batch_at(train, micro, cfg.seq_len, 1, cfg.seed)[0], D.batch_at(mask, micro, cfg.seq_len, 1,
                                                                                   cfg.seed)[1]
        micro += 1
        pos = [(b, i) for b in range(w.shape[0]) for i in range(w.shape[1]) if w[b, i]]
        if not pos:
            skipped.append(micro - 1)
            continue
        hS, hL_t, lg_t, kvx, hb = teacher(base, x, d.plan, cfg.kv)
        hL_s = student(d, x, hS, kvx, cfg.kv, hb)
        lg_s = d.model.head(hL_s)
        loss = 0
        for b, i in pos:
            p_t = torch.softmax(lg_t[b, i] / cfg.tau, -1)
            loss = loss + cfg.kl_weight * (p_t * (p_t.log() - torch.log_softmax(lg_s[b, i] / cfg.tau, -1))).sum() \
                * cfg.tau ** 2
            diff = norm(hL_s[b, i]) - norm(hL_t[b, i])
            loss = loss + cfg.hidden_weight * (diff * diff).mean()
        grads = torch.autograd.grad(loss / len(pos), params)
        total = torch.sqrt(sum((g * g).sum() for g in grads))
        coef = min(1.0, cfg.grad_clip / (float(total) + 1e-6))
        t += 1
        with torch.no_grad():
            for p, g, mi, vi in zip(params, grads, m, v):
                g = g * coef
                mi.mul_(b1).add_(g, alpha=1 - b1)
                vi.mul_(b2).addcmul_(g, g, value=1 - b2)
                p.sub_(cfg.lr / (1 - b1 ** t) * mi / ((vi / (1 - b2 ** t)).sqrt() + eps))
    assert skipped[:1] == [0] and len(skipped) >= 2 and skipped == empty[:len(skipped)]
    want = dict(zip(names, (p.detach() for p in params)))
    moved = max(float((want[k] - base.state_dict()[k]).abs().max()) for k in names)
    assert moved > 1e-3
    for k in names:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-12 * max(1.0, moved)), k
    assert res.steps == cfg.steps and res.skipped_steps == len(skipped)
    rows = [json.loads(ln) for ln in (tmp_path / "d" / "log.jsonl").read_text().splitlines()]
    assert [r["skipped_micro"] for r in rows if "skipped_micro" in r] == skipped
    assert [r["step"] for r in rows if "loss" in r] == [1, cfg.steps]  # (log_every 10: step 1 and the last)
    rec = json.loads((tmp_path / "d" / "drafter.json").read_text())["record"]
    assert rec["steps"] == cfg.steps and rec["skipped_steps"] == len(skipped)


@pytest.mark.parametrize("hook", ["should_stop", "before_step"])
def test_a_run_that_stops_on_a_skipped_step_logs_its_last_trained_step(tmp_path, hook):
    """A stop decided on a skipped step (should_stop after it) or between steps right after one (before_step) ends the
    run on a row of its own; the last trained step's loss row is in log.jsonl all the same, off --log-every (10) as it
    is: every run's log ends with its last trained step, as one that stops right after a trained step does. Reference:
    the run's own step count and the micro-batches the stream leaves empty."""
    from snlp.train.adapt import adapt
    from snlp.train.hooks import TrainHooks

    cfg, _, _, empty = sparse_replies_cfg(tmp_path, steps=8)
    assert empty[:2] == [0, 3]  # micro 1, 2: steps 1, 2; micro 3: a skip after step 2, off --log-every and not step 1
    seen: list = []

    def stop(step):  # asked after every step (should_stop) or before each (before_step); a skip leaves `step` as it was
        seen.append(step)  # the second ask at step 2: after the skip of micro 3 (should_stop) or before the next step
        return "stop_file" if seen.count(2) == 2 else None

    res = adapt(cfg, TrainHooks(**{hook: stop}))
    assert res.steps == 2 and res.skipped_steps == 2 and res.stopped_by == "stop_file"
    rows = [json.loads(ln) for ln in (tmp_path / "d" / "log.jsonl").read_text().splitlines()]
    trained = [r["step"] for r in rows if "loss" in r]
    assert trained == [1, res.steps]  # the last trained step's row, written before the stop's
    last = max(i for i, r in enumerate(rows) if "loss" in r)
    stops = [i for i, r in enumerate(rows) if "stop" in r]
    assert len(stops) == 1 and stops[0] > last and rows[stops[0]]["step"] == res.steps
    assert [r["skipped_micro"] for r in rows if "skipped_micro" in r] == empty[:2]


def load_file_tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_a_run_killed_after_a_skipped_step_resumes_to_the_uninterrupted_run(tmp_path):
    """Resume stays exact across skipped steps: a run that dies right after logging a skipped step (the checkpoint
    of the trained step before it on disk, the skip's micro-batch not in it) and is resumed writes the drafter, the
    skip count and the log rows (times aside) of the uninterrupted run: the resumed leg draws the skipped micro-batch
    again, skips it again, and its row is not logged twice."""
    from safetensors.torch import load_file

    from snlp.train.adapt import adapt
    from snlp.train.hooks import TrainHooks

    cfg, _, _, empty = sparse_replies_cfg(tmp_path, out="a", save_every=1)
    one = adapt(cfg)
    calls: dict = {}
    armed = []

    def crash(step):  # should_stop: asked after every step, a skipped one too
        if armed:
            raise RuntimeError("killed")
        calls[step] = calls.get(step, 0) + 1
        if step >= 1 and calls[step] == 2:  # the first skip after a trained (and saved) step: let its row out
            armed.append(step)
        return None

    b = dataclasses.replace(cfg, out=str(tmp_path / "b"))
    with pytest.raises(RuntimeError, match="killed"):
        adapt(b, TrainHooks(should_stop=crash))
    logged = [json.loads(ln) for ln in (tmp_path / "b" / "run" / "log.jsonl").read_text().splitlines()]
    assert logged[-1]["step"] == armed[0] and "skipped_micro" in logged[-1]  # the killed leg's last row: a skip
    two = adapt(dataclasses.replace(b, resume=True))
    assert (two.steps, two.skipped_steps) == (one.steps, one.skipped_steps) and one.skipped_steps >= 2
    wa, wb = (load_file(str(tmp_path / x / "drafter.safetensors")) for x in ("a", "b"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    clock = {"elapsed", "tok_s", "step_s", "mfu", "leg_start"}  # leg_start: the resumed leg's first step, timed apart
    rows = [[{k: v for k, v in json.loads(ln).items() if k not in clock}
             for ln in (tmp_path / x / "log.jsonl").read_text().splitlines()] for x in ("a", "b")]
    assert rows[0] == rows[1]
    assert [r["skipped_micro"] for r in rows[0] if "skipped_micro" in r] == empty[:one.skipped_steps]


def _ddp_adapt_rank(rank, world, port, cfg):
    from conftest import init_gloo
    from snlp.train.adapt import adapt

    init_gloo(rank, world, port)
    res = adapt(cfg)
    assert (res.world, res.steps) == (world, cfg.steps)


@pytest.mark.slow  # two spawned gloo ranks
def test_under_ddp_a_skipped_step_is_every_ranks_and_a_rank_without_replies_weighs_nothing(tmp_path):
    """Two gloo ranks of one window each train the drafter of one process of two windows (fp64, to rounding), at a
    seed whose first global micro-batch holds no reply position (both ranks skip it together: one all_reduce of the
    count) and whose later ones include some where one rank's window holds none and the other's some (that rank's
    share is 0: the step is the other window's reply mean, as the one process computes it)."""
    from safetensors.torch import load_file

    from conftest import spawn_ranks
    from snlp.train.adapt import adapt

    cfg, _, mask, _ = sparse_replies_cfg(tmp_path, out="one", batch_size=2, steps=5, dtype="float64", device="cpu")

    def replies(seed, micro):  # reply positions in each of the global micro-batch's two windows
        return D.batch_at(mask, micro, cfg.seq_len, 2, seed)[1].sum(1).tolist()
    seed = next(s for s in range(1000) if replies(s, 0) == [0, 0]
                and any(0 in replies(s, m) and sum(replies(s, m)) > 0 for m in range(1, 4)))
    one = adapt(dataclasses.replace(cfg, seed=seed))
    assert one.skipped_steps >= 1
    spawn_ranks(_ddp_adapt_rank, 2, dataclasses.replace(cfg, seed=seed, batch_size=1, out=str(tmp_path / "two")))
    wa, wb = (load_file(str(tmp_path / x / "drafter.safetensors")) for x in ("one", "two"))
    base = load_file(str(tmp_path / "base" / "model.safetensors"))
    moved = max(float((wa[k] - base[k]).abs().max()) for k in wa)
    assert moved > 1e-3
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=moved * 1e-10, rtol=0), k
    rec = json.loads((tmp_path / "two" / "drafter.json").read_text())["record"]
    assert (rec["world"], rec["steps"], rec["skipped_steps"]) == (2, cfg.steps, one.skipped_steps)


def test_cli_says_how_many_steps_were_skipped(tmp_path, capsys):
    """`snlp adapt`'s summary says the skipped steps beside the trained ones, the trainer's line says why, and
    --json records the count; the count is the micro-batches without a reply position before the last trained one
    (the hand-written mask's)."""
    from snlp.apps.cli import main

    cfg, _, mask, _ = sparse_replies_cfg(tmp_path)
    trained = micro = 0
    skipped = 0
    while trained < cfg.steps:
        has = D.batch_at(mask, micro, cfg.seq_len, cfg.batch_size, cfg.seed)[1].any()
        trained, skipped, micro = trained + bool(has), skipped + (not has), micro + 1
    assert skipped >= 2
    assert main(["adapt", cfg.src, "--plan", cfg.plan, "--data", cfg.data, "--out", cfg.out, "--steps", str(cfg.steps),
                 "--seq-len", str(cfg.seq_len), "--batch-size", "1", "--seed", str(cfg.seed), "--loss-on", "replies",
                 "--eval-every", "100", "--save-every", "0", "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert f"{skipped} steps skipped (no reply position in their micro-batches)" in out
    assert f": {cfg.steps} steps (+{skipped} skipped: no reply position)," in out
    assert json.loads((tmp_path / "r.json").read_text())["skipped_steps"] == skipped

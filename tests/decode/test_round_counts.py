"""The round accounting of the drafting decoders against a naive fp64 replay with a stop id that an accepted draft
hits mid-round: `drafted` counts the drafter's work (every draft made, those after the accepted stop too), `usable`
the drafts that could have entered the output (up to and including the accepted stop), and every ratio a report
prints (alpha, tokens/round, accepted_fraction, bench's drafted/round) equals its hand count."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

from snlp.decode.jacobi import jacobi_generate
from snlp.decode.speculative import speculative_generate
from snlp.method.solver import solve
from snlp.model.cache import KVCache

pytestmark = pytest.mark.usefixtures("one_thread")

PLAN, BLOCK, N = "3xF2-h0-K1", 4, 14
PROMPTS = [[5, 9, 2, 40], [3, 1, 4]]


def _drafts(model, prompt: list[int], full: list[int], t: int, k: int) -> list[int]:
    """The k drafts of the round after t emitted tokens, one token at a time: a fresh cache holding the model's exact
    K/V of prompt + full[:t - 1] (what the verifier left), then the plan's solve of each draft's input token."""
    pos, out = len(prompt) + t - 1, []
    cache = KVCache.for_model(model, max_len=64)
    with torch.no_grad():
        model(torch.tensor([full[:pos]]), cache=cache)
        tok = full[pos]
        for _ in range(k):
            tok = int(model.head(solve(model, torch.tensor([[tok]]), PLAN, cache=cache).hidden)[0, -1].argmax())
            out.append(tok)
    return out


def _hand_count(model, prompt: list[int], free: list[int], e: int) -> dict:
    """Greedy self-speculative decoding replayed round by round with stop id free[e] (its first occurrence): the
    verifier keeps the leading drafts equal to the free output; a kept draft at output e ends the output there."""
    full = prompt + free
    t = rounds = drafted = usable = acc = exam = 0  # t: outputs emitted; a round drafts outputs t .. t + k - 1
    past = False  # some round drafted past the accepted stop
    while t <= e:
        k = min(BLOCK, N - t - 1)
        dr, n = _drafts(model, prompt, full, t, k), 0
        while n < k and dr[n] == free[t + n]:
            n += 1
        rounds, drafted = rounds + 1, drafted + k
        if t + n > e:  # the stop is among the kept drafts: nothing after it is usable or examined
            kept = e - t + 1
            acc, exam, usable = acc + kept, exam + kept, usable + kept
            past |= kept < k
        else:
            acc, exam, usable = acc + n, exam + n + (n < k), usable + k
        t += n + 1
    return dict(rounds=rounds, drafted=drafted, usable=usable, accepted=acc, examined=exam, past=past)


def _check(res, want: dict, out_len: int) -> None:
    assert {f: getattr(res, f) for f in ("rounds", "drafted", "usable", "accepted", "examined")} == \
        {f: want[f] for f in ("rounds", "drafted", "usable", "accepted", "examined")}
    d = res.to_dict()
    assert d["acceptance_rate"] == pytest.approx(want["accepted"] / want["examined"])
    assert d["tokens_per_round"] == pytest.approx(out_len / want["rounds"])
    assert d["accepted_fraction"] == pytest.approx(want["accepted"] / want["usable"])


def test_speculative_round_counts_equal_a_naive_replay_with_a_stop_mid_round():
    """Before, accepted_fraction divided by every draft made, those after an accepted stop too (drafts no output
    could hold), so a run that ended on an accepted stop read as a worse drafter than it was.
    Every stop candidate of two prompts."""
    model = make_model(n_layer=6, vocab_size=61)
    frees = [speculative_generate(model, p, PLAN, block=BLOCK, max_new_tokens=N).tokens for p in PROMPTS]
    past = 0
    for e in range(N - 1):
        for p, free in zip(PROMPTS, frees):
            if free[e] in free[:e]:
                continue  # the stop must end the output at e
            want = _hand_count(model, p, free, e)
            past += want["past"]
            res = speculative_generate(model, p, PLAN, block=BLOCK, max_new_tokens=N, eos_id=free[e])
            assert res.tokens == free[:e + 1] and res.stop == "eos"
            _check(res, want, e + 1)
    assert past > 0  # some round drafted past its accepted stop: drafted > usable there


def test_batch_rows_with_their_own_stops_count_as_their_single_prompt_runs():
    """A batch whose rows end at different accepted stops (a stop set holding both rows' stop ids): each row's
    counts and ratios equal the naive replay of that row alone with its own stop."""
    model = make_model(n_layer=6, vocab_size=61)
    frees = [speculative_generate(model, p, PLAN, block=BLOCK, max_new_tokens=N).tokens for p in PROMPTS]
    for e0 in range(1, N - 1):
        for e1 in range(1, N - 1):
            a, b = frees[0][e0], frees[1][e1]
            if e0 == e1 or a in frees[0][:e0] or b in frees[0][:e0] or b in frees[1][:e1] or a in frees[1][:e1]:
                continue
            wants = [_hand_count(model, p, free, e) for p, free, e in zip(PROMPTS, frees, (e0, e1))]
            if not any(w["past"] for w in wants):
                continue  # a row that drafted past its accepted stop: its drafted and usable differ
            rows = speculative_generate(model, PROMPTS, PLAN, block=BLOCK, max_new_tokens=N, eos_id=[a, b])
            for free, e, r, want in zip(frees, (e0, e1), rows, wants):
                assert r.tokens == free[:e + 1]
                _check(r, want, e + 1)
            return
    pytest.fail("no pair of stops that end the rows at their own positions, one past a drafted stop")


def test_jacobi_round_counts_with_a_stop_mid_round():
    """Exact Jacobi keeps its whole block every round: round r emits outputs 5r .. 5r + 4 (4 guesses, then the
    prediction), so a stop at output e = 5r + j (j < 4) is the (j + 1)-th kept guess of round r and the 3 - j
    guesses after it were made but unusable. Before, accepted_fraction counted them (e = 0: 1/4 where the one
    usable guess was kept), and before that alpha's counts did too (tokens [78, 87] with accepted 4 in one round)."""
    model = make_model(n_layer=4)
    prompt = [5, 9, 2, 40]
    free = jacobi_generate(model, prompt, None, block=4, max_new_tokens=15).tokens
    seen = 0
    for e in range(15):
        if free[e] in free[:e]:
            continue
        res = jacobi_generate(model, prompt, None, block=4, max_new_tokens=15, eos_id=free[e])
        r, j = divmod(e, 5)
        kept = 4 * r + min(j + 1, 4)
        want = dict(rounds=r + 1, drafted=4 * (r + 1), usable=kept, accepted=kept, examined=kept)
        assert res.tokens == free[:e + 1]
        _check(res, want, e + 1)
        seen += j < 3
    assert seen > 0

"""The repetition penalty in layer-parallel decoding (snlp.dist, gloo on CPU, 1 and 2 ranks): the last rank, which
picks the tokens, holds the seen ids; every mode's tokens equal the single-process decoder's with the same penalty
(snlp / sequential / speculative, greedy and sampled with one seed), on every rank, and greedy equals the penalised
full-prefix argmax loop written out here (every id already in the sequence divided by p where positive, multiplied
where negative, as transformers' RepetitionPenaltyLogitsProcessor). fp64."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import init_gloo as _init
from conftest import argmax_loop, make_model
from conftest import spawn_ranks as _spawn

from snlp.decode import sequential_generate, snlp_generate, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")

PLAN = "4xF1-h0-K1"
PROMPTS = [[1, 2, 3, 2], [7], [4, 5, 6, 7, 8, 2]]
N = 10
PENALTIES = (0.5, 1.3, 2.0)
SAMPLED = dict(temperature=0.9, seed=5)


def _model():
    return make_model(seed=2, vocab_size=13, scale=0.3)  # a small vocabulary: repeats within N tokens


def _penalty_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from snlp.dist.layer_parallel import DistributedSNLP

    _init(rank, world, port)
    runner = DistributedSNLP(_model(), PLAN, keep_layers=True)
    res = {}
    for p in PENALTIES:
        for i, prompt in enumerate(PROMPTS):
            for mode in ("snlp", "sequential", "speculative"):
                res[(p, i, mode, "greedy")] = runner.generate(prompt, mode, N, block=3, repetition_penalty=p).tokens
                res[(p, i, mode, "sampled")] = runner.generate(prompt, mode, N, block=3, repetition_penalty=p,
                                                               **SAMPLED).tokens
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_distributed_decoding_applies_the_repetition_penalty(world, tmp_path):
    """It refused repetition_penalty (a TypeError in the library, a refusal in `snlp generate --distributed`): now
    each mode decodes the single-process decoder's penalised tokens on 1 and 2 ranks."""
    _spawn(_penalty_worker, world, str(tmp_path))
    model = _model()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for p in PENALTIES:
        for i, prompt in enumerate(PROMPTS):
            ref = argmax_loop(model, prompt, N, penalty=p)
            kw = dict(max_new_tokens=N, repetition_penalty=p)
            want = {("sequential", "greedy"): sequential_generate(model, prompt, **kw).tokens,
                    ("snlp", "greedy"): snlp_generate(model, prompt, PLAN, **kw).tokens,
                    ("sequential", "sampled"): sequential_generate(model, prompt, **kw, **SAMPLED).tokens,
                    ("snlp", "sampled"): snlp_generate(model, prompt, PLAN, **kw, **SAMPLED).tokens,
                    ("speculative", "sampled"): speculative_generate(model, prompt, PLAN, block=3, **kw,
                                                                     **SAMPLED).tokens}
            assert want[("sequential", "greedy")] == ref
            want[("speculative", "greedy")] = ref
            for rk in ranks:  # every rank returns the broadcast tokens
                for (mode, how), toks in want.items():
                    assert rk[(p, i, mode, how)] == toks, (world, p, prompt, mode, how)
    # the penalty acts on these prompts: without it, greedy decoding differs somewhere
    assert any(argmax_loop(model, q, N, penalty=1.0) != argmax_loop(model, q, N, penalty=p) for q in PROMPTS for p in PENALTIES)


EXACT = "4xF1-h0-K4"  # K = C: the drafter is the model


def _eos_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from snlp.dist.layer_parallel import DistributedSNLP

    _init(rank, world, port)
    runner = DistributedSNLP(_model(), EXACT, keep_layers=True)
    free = runner.generate(PROMPTS[0], "speculative", N, block=3).tokens
    res = {}
    for e in range(N):
        if free[e] not in free[:e]:
            r = runner.generate(PROMPTS[0], "speculative", N, block=3, eos_id=free[e])
            res[e] = (r.tokens, r.accepted, r.examined, r.rounds, r.drafted, r.usable)
    torch.save(res, os.path.join(out, f"eos{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_distributed_speculative_acceptance_stops_at_the_eos_a_round_accepted(world, tmp_path):
    """An accepted draft that is the EOS ends the output: the drafts after it are no part of the decode, so alpha's
    counts stop there, as the single-process decoder's do (they counted the whole round), and the drafts after it
    count as drafter work (drafted) but not as usable drafts, as there too. Every EOS candidate of
    the free output; the single-process counts are the reference. The drafter is exact (K = C), so every round
    accepts its drafts and an EOS among them has accepted drafts after it."""
    _spawn(_eos_worker, world, str(tmp_path))
    model = _model()
    got = torch.load(tmp_path / "eos0.pt")
    assert got
    for e, (tokens, accepted, examined, rounds, drafted, usable) in got.items():
        ref = speculative_generate(model, PROMPTS[0], EXACT, block=3, max_new_tokens=N, eos_id=tokens[-1])
        assert accepted <= len(tokens) - rounds + 1
        assert (tokens, accepted, examined, rounds, drafted, usable) == (ref.tokens, ref.accepted, ref.examined,
                                                                         ref.rounds, ref.drafted, ref.usable), e

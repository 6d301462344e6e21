"""Host syncs of the decode loops, inventoried by running them on fake cuda (tests/gpu/fakecuda.py): every read of a
device value back to the host (.item(), int() / float() / bool() of a tensor, .tolist()) and every
torch.cuda.synchronize() is recorded with the snlp function that made it. The steps themselves (prefill, sequential,
drafter, verify, ragged) read nothing (test_fake_cuda.py raises on any read there); the loops read only at the
sites documented in docs/gpu-internals.md ("Host syncs"), listed here with the reason. A new site fails this test:
document it (and say why a loop needs it) or take it off the path."""

from __future__ import annotations

import collections

import pytest
import torch

from fakecuda import fake_cuda, to_cuda
from snlp.decode.generate import sequential_generate, snlp_generate
from snlp.decode.jacobi import jacobi_generate
from snlp.decode.speculative import speculative_generate
from snlp.model.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")

TIMER = "snlp/runtime/timing.py:sync <- "
# site -> why the loop reads the device there (docs/gpu-internals.md keeps the same list with accept / should-go)
DOCUMENTED = {
    "snlp/decode/session.py:pick_tokens": "Jacobi decoding's verified tokens of a sweep, with the NaN/inf flag",
    "snlp/decode/batch.py:batch_autoregressive": "a batch: every row's tokens of read_every steps in one read",
    "snlp/decode/generate.py:_autoregressive": "one prompt: the tokens of read_every steps (8 on a GPU) in one read",
    "snlp/decode/speculative.py:_round": "a self-speculative round's drafts, accepted counts and next tokens in one "
                                         "read (min_confidence: and each drafter step's confidences)",
    "snlp/decode/jacobi.py:jacobi_generate": "a verified plan's Jacobi sweep: its guesses (accept by design)",
    "snlp/method/solver.py:solve": "a tol plan's stop test, once per iteration (by design)",
    TIMER + "snlp/decode/session.py:prefill": "prefill timing",
    TIMER + "snlp/decode/session.py:finish": "the decode clock",
    TIMER + "snlp/decode/batch.py:prefill": "prefill timing",
    TIMER + "snlp/decode/batch.py:emit": "a finished row's clock",
    TIMER + "snlp/decode/batch.py:finish": "the decode clock",
    TIMER + "snlp/decode/jacobi.py:jacobi_generate": "sweep timing",
}

LOOPS = {
    "sequential": lambda m: sequential_generate(m, [1, 2, 3], max_new_tokens=4),
    "sequential-batch": lambda m: sequential_generate(m, [[1, 2, 3], [4, 5]], max_new_tokens=4),
    "snlp": lambda m: snlp_generate(m, [1, 2, 3], "2xF2-h0-K1", max_new_tokens=4),
    "speculative": lambda m: speculative_generate(m, [1, 2, 3], "2xF2-h0-K1", block=2, max_new_tokens=4),
    "speculative-batch": lambda m: speculative_generate(m, [[1, 2, 3], [4, 5]], "2xF2-h0-K1", block=2,
                                                        max_new_tokens=4),
    "jacobi": lambda m: jacobi_generate(m, [1, 2, 3], max_new_tokens=4),
    "jacobi-plan-verified": lambda m: jacobi_generate(m, [1, 2, 3], "2xF2-h0-K1", max_new_tokens=4),
    "sequential-batch-sampled": lambda m: sequential_generate(m, [[1, 2, 3], [4, 5]], max_new_tokens=3,
                                                              temperature=0.8, seed=1),
    "speculative-batch-sampled": lambda m: speculative_generate(m, [[1, 2, 3], [4, 5]], "2xF2-h0-K1", block=2,
                                                                max_new_tokens=3, temperature=0.8, seed=1),
    "speculative-batch-confidence": lambda m: speculative_generate(m, [[1, 2, 3], [4, 5]], "2xF2-h0-K1", block=2,
                                                                   max_new_tokens=4, min_confidence=0.5),
    "speculative-shared-weights": lambda m: speculative_generate(m, [1, 2, 3], "4xF1-h0-K1", block=2,
                                                                 max_new_tokens=3, share_weights=True),
    "snlp-tol": lambda m: snlp_generate(m, [1, 2, 3], "2xF2-h0-K3-tol:1e-3", max_new_tokens=3),
}


def loop_sites(loop: str) -> collections.Counter:
    """The device reads (not the copies in) of one LOOPS entry on fake cuda, by site."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, n_layer=6, n_head=2, n_kv_head=1, n_embd=32, sequence_len=64,
                              window_pattern="SL", short_window=3))
    reads: list = []
    with fake_cuda(host_reads=reads), torch.no_grad():
        LOOPS[loop](to_cuda(model))
    return collections.Counter(where for where, what in reads if not what.startswith("h2d:"))


@pytest.mark.parametrize("loop", list(LOOPS))
def test_decode_loops_read_the_device_only_where_documented(loop):
    sites = loop_sites(loop)
    undocumented = sorted(set(sites) - set(DOCUMENTED))
    assert not undocumented, f"{loop}: host syncs at undocumented sites {undocumented} (all: {dict(sites)})"
    assert any(not s.startswith(TIMER) for s in sites), "a decode loop reads its tokens: the recorder saw nothing"


def test_every_documented_site_is_still_read_somewhere():
    """The inventory cannot drift: a documented site that no decode loop reads any more is a stale entry."""
    seen = set().union(*(loop_sites(loop) for loop in LOOPS))
    assert set(DOCUMENTED) <= seen, f"documented but never read: {sorted(set(DOCUMENTED) - seen)}"


def _run(device):
    """The parts of a training Run that reduce_step reads (a single process, no hooks)."""
    from types import SimpleNamespace

    from snlp.train.distributed import DistContext
    from snlp.train.optim import Progress

    return SimpleNamespace(ctx=DistContext(rank=0, world=1, device=torch.device(device)),
                           hooks=SimpleNamespace(should_stop=None), t_start=0.0, progress=Progress(10, None),
                           interrupt=None)


def test_training_step_statistics_read_the_device_once():
    """reduce_step read the step's statistics with five float()s of device tensors (clock, loss twice, reg, grad
    norm): five syncs per training step. Now one .tolist() of them stacked."""
    from snlp.train.trainer import LoopState, reduce_step

    reads: list = []
    with fake_cuda(host_reads=reads):
        reduce_step(_run("cuda"), LoopState(step=1), torch.zeros(2, device="cuda"), 8, 0.5, 1.0,
                    torch.zeros((), device="cuda"))
    assert [what for _, what in reads] == ["tolist"], reads
    # the values, on the CPU, against the inputs
    st = reduce_step(_run("cpu"), LoopState(step=1), torch.tensor([2.5, 0.25]), 8, 0.5, 1.0, torch.tensor(1.5))
    assert (st.loss, st.reg, st.grad_norm, st.tokens, st.lam) == (2.5, 0.25, 1.5, 8, 0.5)
    assert reduce_step(_run("cpu"), LoopState(step=1), torch.tensor([1.0, 0.0]), 8, 0.5, 1.0, None).grad_norm is None


def _waits(fn) -> collections.Counter:
    """Every wait for the device a call makes (reads, synchronize, host data copied in), by site."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, n_layer=4, n_head=2, n_kv_head=1, n_embd=32, sequence_len=128))
    reads: list = []
    with fake_cuda(host_reads=reads), torch.no_grad():
        out = fn(to_cuda(model))
    return collections.Counter(where for where, _ in reads), out


@pytest.mark.parametrize("every", [None, 1, 4])
def test_one_prompt_decoding_waits_once_per_read_every_tokens(every):
    """Batch 1 on a GPU: a wait per token leaves the device idle while the host takes the token and launches the
    next step, about as long as a CUDA-graph step itself. Sequential and SNLP decoding of one prompt feed each step
    the previous token on the device and read `read_every` tokens at once (8 by default off the CPU): 16 more tokens
    add 16 / read_every waits, all at the loop's read, and nothing else grows with the tokens."""
    k = 8 if every is None else every
    for gen in (lambda m, n: sequential_generate(m, [1, 2, 3], max_new_tokens=n, read_every=every),
                lambda m, n: snlp_generate(m, [1, 2, 3], "2xF2-h0-K1", max_new_tokens=n, read_every=every)):
        short, _ = _waits(lambda m: gen(m, 8))
        long, _ = _waits(lambda m: gen(m, 24))
        assert long - short == collections.Counter({"snlp/decode/generate.py:_autoregressive": 16 // k}), \
            (short, long)


@pytest.mark.parametrize("every", [None, 4])
def test_batch_decoding_waits_once_per_read_every_tokens(every):
    """A ragged batch the same way: per read, one read of every row's tokens and one copy in of the rows' last tokens
    and lengths (rows finish, and an eager batch compacts, between reads); nothing per step."""
    k = 8 if every is None else every
    gen = lambda m, n: sequential_generate(m, [[1, 2, 3], [4, 5]], max_new_tokens=n, read_every=every)
    short, _ = _waits(lambda m: gen(m, 8))
    long, _ = _waits(lambda m: gen(m, 24))
    reads = 16 // k
    assert long - short == collections.Counter({"snlp/decode/batch.py:batch_autoregressive": 2 * reads}), \
        (short, long)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("block", [1, 3])
def test_one_prompt_speculative_round_waits_once(block, temperature):
    """Self-speculative decoding of one prompt, greedy or sampled: one wait per round (the drafts, the accepted count
    and the next token in one read), none per drafter step; a round's draft / verify times come from CUDA events
    read after it."""
    spec = lambda m, n: speculative_generate(m, [1, 2, 3], "2xF2-h0-K1", block=block, max_new_tokens=n,
                                             temperature=temperature, seed=0 if temperature else None)
    short, r8 = _waits(lambda m: spec(m, 8))
    long, r24 = _waits(lambda m: spec(m, 24))
    # fake cuda reads every value as 0, the accepted count too: a round emits one token after its `block` drafter
    # steps, so a wait per drafter step would show as block + 1 per round
    assert (r8.rounds, r24.rounds, r24.draft_steps - r8.draft_steps) == (8, 24, 16 * block)
    assert long - short == collections.Counter({"snlp/decode/speculative.py:_round": 16})


def test_a_timing_event_is_read_only_after_a_wait_that_covers_it():
    """CUDA refuses elapsed_time on an event that has not completed; the fake event completes once the host waited
    for the device after it was recorded, so a loop that reads its round times too early fails here, not on a GPU."""
    from snlp.runtime.timing import between, mark

    reads: list = []
    with fake_cuda(host_reads=reads):
        a, b = mark("cuda"), mark("cuda")
        with pytest.raises(RuntimeError, match="must be completed"):
            between(a, b)
        torch.zeros(2, device="cuda").tolist()
        assert between(a, b) == 0.0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("block", [1, 3])
def test_batch_speculative_round_waits_once_per_round(block, temperature):
    """A ragged batch, greedy or sampled: per round one copy in of the rows' last tokens, lengths and blocks and one
    read of every row's drafts, accepted counts and next tokens; no drafter step waits."""
    spec = lambda m, n: speculative_generate(m, [[1, 2, 3], [4, 5]], "2xF2-h0-K1", block=block, max_new_tokens=n,
                                             temperature=temperature, seed=0 if temperature else None)
    short, r8 = _waits(lambda m: spec(m, 8))
    long, r24 = _waits(lambda m: spec(m, 24))
    # fake cuda reads every accepted count as 0: a round emits one token per row after its `block` drafter steps
    assert (r24[0].rounds - r8[0].rounds, r24[0].draft_steps - r8[0].draft_steps) == (16, 16 * block)
    assert long - short == collections.Counter({"snlp/decode/speculative.py:_round": 2 * 16})


def test_min_confidence_round_waits_once_per_drafter_step_and_once_per_round():
    """min_confidence decides on the host whether a row drafts on: one read per drafter step (the drafted tokens'
    probabilities; the tokens stay on the device) and the round's one read."""
    spec = lambda m, n: speculative_generate(m, [1, 2, 3], "2xF2-h0-K1", block=3, max_new_tokens=n,
                                             min_confidence=1e-9)
    short, r8 = _waits(lambda m: spec(m, 8))
    long, r24 = _waits(lambda m: spec(m, 24))
    # fake cuda reads every confidence as 0.0 (< 1e-9): a round stops drafting after its first draft
    assert (r24.rounds - r8.rounds, r24.draft_steps - r8.draft_steps) == (16, 16)
    assert long - short == collections.Counter({"snlp/decode/speculative.py:_round": 16 + 16})


def test_batch_min_confidence_round_copies_in_once():
    """A batch with min_confidence: the round's one copy in (last tokens, lengths, blocks), one read per drafter
    step, the round's read; the rows' draft counts for the verifier are counted again on the device from the same
    confidences, not copied in a second time."""
    spec = lambda m, n: speculative_generate(m, [[1, 2, 3], [4, 5]], "2xF2-h0-K1", block=3, max_new_tokens=n,
                                             min_confidence=1e-9)
    short, r8 = _waits(lambda m: spec(m, 8))
    long, r24 = _waits(lambda m: spec(m, 24))
    # fake cuda reads every confidence as 0.0 (< 1e-9): a round stops drafting after its first draft
    assert (r24[0].rounds - r8[0].rounds, r24[0].draft_steps - r8[0].draft_steps) == (16, 16)
    assert long - short == collections.Counter({"snlp/decode/speculative.py:_round": 3 * 16})

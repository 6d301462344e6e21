"""Host syncs of the decode loops, inventoried by running them on fake cuda (tests/gpu/fakecuda.py): every read of a
device value back to the host (.item(), int() / float() / bool() of a tensor, .tolist()) and every
torch.cuda.synchronize() is recorded with the snlp function that made it. The steps themselves (prefill, sequential,
drafter, verify, ragged) read nothing (test_fake_cuda.py raises on any read there); the loops read only at the
sites documented in docs/gpu.md ("Host syncs"), listed here with the reason. A new site fails this test: document
it (and say why a loop needs it) or take it off the path."""

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
# site -> why the loop reads the device there (docs/gpu.md keeps the same list with accept / should-go)
DOCUMENTED = {
    "snlp/decode/session.py:pick_token": "the next token goes back into the prompt list / EOS test (by design)",
    "snlp/decode/batch.py:pick": "each row's next token (EOS, per-row lengths): one read per row and step",
    "snlp/decode/speculative.py:speculative_generate": "draft tokens (one read per drafted token) and accept/reject",
    "snlp/decode/speculative.py:_draft_rows": "batched drafting: the drafted tokens of every row",
    "snlp/decode/speculative.py:_verify_rows": "batched verify: target tokens and the accepted counts",
    "snlp/decode/jacobi.py:jacobi_generate": "the fixed-point test of each Jacobi sweep (accept by design)",
    TIMER + "snlp/decode/generate.py:_autoregressive": "per-step timing (step_s); the token read waits anyway",
    TIMER + "snlp/decode/session.py:prefill": "prefill timing",
    TIMER + "snlp/decode/session.py:finish": "the decode clock",
    TIMER + "snlp/decode/batch.py:batch_autoregressive": "per-step timing",
    TIMER + "snlp/decode/batch.py:prefill": "prefill timing",
    TIMER + "snlp/decode/batch.py:emit": "a finished row's clock",
    TIMER + "snlp/decode/batch.py:finish": "the decode clock",
    TIMER + "snlp/decode/speculative.py:speculative_generate": "draft / verify timing (draft_s, step_s)",
    TIMER + "snlp/decode/speculative.py:_speculative_rows": "batched draft / verify timing",
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
}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_decode_loops_read_the_device_only_where_documented(loop):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, n_layer=6, n_head=2, n_kv_head=1, n_embd=32, sequence_len=64,
                              window_pattern="SL", short_window=3))
    reads: list = []
    with fake_cuda(host_reads=reads), torch.no_grad():
        LOOPS[loop](to_cuda(model))
    sites = collections.Counter(where for where, _ in reads)
    undocumented = sorted(set(sites) - set(DOCUMENTED))
    assert not undocumented, f"{loop}: host syncs at undocumented sites {undocumented} (all: {dict(sites)})"
    assert any(not s.startswith(TIMER) for s in sites), "a decode loop reads its tokens: the recorder saw nothing"

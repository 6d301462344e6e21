"""scripts/host_per_call.py: the guard manager it times is the one dynamo runs for the call, its guard count is
every leaf guard, and skipping guard evaluation (what the record weighs) runs the graph compiled for other weights
(another dtype) without recompiling (docs/records/2026-11-28-host-per-call.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch._dynamo.testing
from conftest import make_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import host_per_call  # noqa: E402


def test_guard_check_is_the_entry_dynamo_runs_and_counts_its_guards():
    torch._dynamo.reset()
    model = make_model(dtype=torch.float32, n_layer=2, n_embd=32, n_head=2, n_kv_head=2)
    idx = torch.zeros(1, 4, dtype=torch.long)

    def fwd(x):
        return model(x)
    f = torch.compile(fwd, backend="eager", fullgraph=True)
    with torch.inference_mode():
        f(idx)
        f(torch.zeros(1, 5, dtype=torch.long))  # a second graph: the check must pick the one whose guards pass
        check, n, graphs = host_per_call.guard_check(fwd, (idx,))
        assert graphs == 2 and check() is True
    assert check() is False  # out of inference mode the dispatch-key guard fails: the timed check is the real one
    # every parameter is guarded (dtype, shape, strides): at least one leaf guard per parameter tensor
    assert n >= len(list(model.parameters()))


def test_skipped_guards_keep_the_graph_compiled_for_other_weights():
    """What skip_guard_eval_unsafe gives up: with one graph compiled for float32 weights, `model.double()` (every
    parameter given float64 storage) is run through that graph without recompiling. With the eager backend used here
    the graph's ops follow the new dtype; inductor's kernels are generated for float32, so a safe cut needs a check of
    our own of what the guards protected. With guards on, the call equals the eager forward."""
    torch._dynamo.reset()
    model = make_model(dtype=torch.float32, n_layer=2, n_embd=32, n_head=2, n_kv_head=2)
    idx = torch.randint(0, model.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(0))
    cnt = torch._dynamo.testing.CompileCounter()

    def fwd(x):
        return model(x)
    f = torch.compile(fwd, backend=cnt, fullgraph=True)
    with torch.inference_mode():
        f(idx)
        model.double()
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            f(idx)
        assert cnt.frame_count == 1  # nothing recompiled: no guard ran
        assert torch.equal(f(idx), fwd(idx))
        if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13):
            assert cnt.frame_count == 2  # with guards on, the dtype change recompiles (2.11 does not: the record)

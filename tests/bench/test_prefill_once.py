"""scripts/prefill_once.py: what a compiled plan launches once per call beyond one evaluation of its stack, and which
graph inputs CUDA graphs would copy in on every replay (docs/records/2026-11-28-prefill-once.md)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import prefill_once  # noqa: E402

from snlp.bench.suite import PAPER_SHAPES  # noqa: E402
from snlp.method.plan import Plan  # noqa: E402

CODE = """
def call(args):
    buf0 = empty_strided_cpu((1, 8), (8, 1), torch.float32)
    cpp_fused_add_embedding_0(arg0_1, buf0)
    extern_kernels.mm(buf0, arg1_1, out=buf1)
    buf2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(buf1, buf1, buf1)
    cpp_fused_add_embedding_7(arg0_1, buf0)
    buf3 = torch.ops.snlp.cpu_bmm.default(buf2, arg2_1)
    return (buf3, )
"""


def test_launch_names_pool_generated_kernels_by_their_fused_ops():
    assert prefill_once.launches(CODE) == [
        "cpp_fused_add_embedding", "extern_kernels.mm", "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default",
        "cpp_fused_add_embedding", "torch.ops.snlp.cpu_bmm.default"]
    assert [prefill_once.kind(n) for n in prefill_once.launches(CODE)] == [
        "generated", "extern", "aten fallback", "generated", "aten fallback"]


def test_stack_once_is_what_k1_launches_beyond_k0_and_one_iteration():
    k0 = ["embed", "mm", "mm", "head"]
    it = ["cat", "bmm", "sdpa", "bmm", "cumsum"]
    assert prefill_once.stack_once(k0, k0 + it, k0 + it + it) == {}
    # a mask built once per call (memoised) and a copy of the prefix state made only by the first iteration
    assert prefill_once.stack_once(k0, k0 + ["mask"] + it + ["copy"], k0 + ["mask"] + it + ["copy"] + it) == \
        {"copy": 1, "mask": 1}
    # a mask rebuilt in every iteration is not paid once
    assert prefill_once.stack_once(k0, k0 + ["mask"] + it, k0 + ["mask"] + it + ["mask"] + it) == {}


def test_only_the_token_ids_are_copied_in_per_replay():
    # the benchmark's callables traced by dynamo (no compile) on meta: parameters, buffers and the runner's fused
    # weights (marked static as snlp.bench.vs_paper does on CUDA) keep their address; CUDA graphs copy the rest
    shape = replace(next(s for s in PAPER_SHAPES if s.key == "0.5B-nox0ve"), depth=6, width=64, head_dim=32)
    cfg = shape.config(256, "SSSL", 16, 64)
    with torch.device("meta"):
        model = prefill_once.GPT(cfg)
    idx = torch.zeros(1, 64, dtype=torch.long, device="meta")
    plans = [Plan.parse("2xF2-h0-K1", 6)]
    with torch.inference_mode():
        seq = prefill_once.graph_inputs(prefill_once.callables(model, idx, [], static=True)["sequential"])
        assert seq["graphs"] == 1 and len(seq["copied"]) == 1 and "idx" in seq["copied"][0]["source"]
        assert seq["copied_bytes"] == 64 * 8
        for static in (True, False):
            plan = prefill_once.graph_inputs(prefill_once.callables(model, idx, plans, static=static)["2xF2-h0-K1"])
            assert plan["graphs"] == 1
            if static:
                assert len(plan["copied"]) == 1 and "idx" in plan["copied"][0]["source"]
                assert plan["copied_bytes"] == 64 * 8
            else:  # without mark_static_runner every fused weight would be streamed in on every replay
                assert len(plan["copied"]) > 1 and plan["copied_bytes"] > 64 * 8


@pytest.mark.slow
def test_compiled_k1_launches_k0_plus_one_iteration_in_one_graph():
    # inductor on the CPU, the masked window kernel the H200 timed: the K = 1 forward launches exactly the K = 0
    # forward (embedding, prefix, head) and one iteration, in one graph; nothing in the stack is paid once per call
    # (the flex kernel's block lists are, once per forward: scripts/prefill_once.py counts them, too slow to compile
    # here on a CPU)
    shape = replace(next(s for s in PAPER_SHAPES if s.key == "0.5B-nox0ve"), depth=6)
    plans = [Plan.parse(f"2xF2-h0-K{k}", 6) for k in (0, 1, 2)]
    rows = prefill_once.count(shape, plans, width=32, head_dim=16, T=64, kernel="masked")
    assert all(r["graphs"] == 1 for r in rows.values())
    n = [rows[str(p)]["launches"] for p in plans]
    assert n[2] - n[1] == n[1] - n[0] > 0
    assert prefill_once.stack_once(*(rows[str(p)]["names"] for p in plans)) == {}

"""What layer-parallel decoding reports about itself (snlp.dist, gloo on CPU): the memory figures count the KV window a
decode holds, and the decode counters equal the single-process decoder's. fp64, tiny models, 1 and 2 ranks."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import init_gloo as _init
from conftest import make_model
from conftest import spawn_ranks as _spawn

pytestmark = pytest.mark.usefixtures("one_thread")

PLAN = "5xF1-h0-K1"  # 5 chunks: uneven blocks over 2 ranks
PROMPT_LEN, NEW = 4, 5


def _model():
    return make_model(seed=0, vocab_size=17)


def _bench_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from snlp.dist.layer_parallel import distributed_benchmark

    _init(rank, world, port)
    from snlp.method.plan import Plan

    recs = distributed_benchmark(_model, [Plan.parse(PLAN)], tokens=3, batch=1, warmup=0, runs=1, seed=0, decode=True,
                                 prompt_len=PROMPT_LEN, new_tokens=NEW, blocks=(2,))
    torch.save(recs, os.path.join(out, f"bench{rank}.pt"))
    dist.destroy_process_group()


def _kv_bytes(model, layers: int, positions: int) -> int:
    cfg = model.config
    return 2 * layers * cfg.n_kv_head * positions * cfg.head_dim * model.wte.weight.element_size()


@pytest.mark.parametrize("world", [1, 2])
def test_bench_decode_rows_count_the_kv_window(world, tmp_path):
    """The decode rows' memory_per_rank / max_rank_bytes counted the weights only (kv_bytes 0) while every decode
    held a KV window of prompt + new tokens on each rank; the prefill rows run without a cache and count none."""
    _spawn(_bench_worker, world, str(tmp_path))
    recs = torch.load(tmp_path / "bench0.pt", weights_only=False)
    model = _model()
    prefill = [r for r in recs if r["what"] == "prefill"]
    decode = [r for r in recs if r["what"] == "decode"]
    assert len(prefill) == 1 and {r["mode"] for r in decode} == {"sequential", "snlp", "speculative"}
    assert all(m["kv_bytes"] == 0 for m in prefill[0]["memory_per_rank"])
    for r in decode:
        kv = [m["kv_bytes"] for m in r["memory_per_rank"]]
        assert sum(kv) == _kv_bytes(model, model.config.n_layer, PROMPT_LEN + NEW), r["mode"]  # every layer once
        assert min(kv) > 0
        assert r["max_rank_bytes"] == max(m["total_bytes"] for m in r["memory_per_rank"])
        assert r["max_rank_bytes"] > prefill[0]["max_rank_bytes"]

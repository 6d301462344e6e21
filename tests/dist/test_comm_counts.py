"""What a distributed solve sends is what snlp.dist.costmodel charges: the collectives each rank makes in one
`DistributedSNLP.solve` (gloo, 2 spawned ranks, recorded at torch.distributed) against the message count of
`costmodel.predict` on a latency-only link, and the all_gather's size against the surrogate's `gathered_states`."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import make_model, spawn_ranks, tokens
from conftest import init_gloo as _init

from snlp.method.plan import Plan

pytestmark = pytest.mark.usefixtures("one_thread")

# (model kind, plan): h0 and fwd init, a prefix (S = 2 of 6 layers) and none (6xF1), tol, DiagN, Jacobi, HCN on mHC
PLANS = [("plain", "4xF1-h0-K2"), ("plain", "4xF1-fwd-K3"), ("plain", "6xF1-h0-K2"), ("plain", "4xF1-h0-K3-tol:1e-30"),
         ("plain", "4xF1-h0-K2-diag:fd"), ("plain", "4xF1-h0-K2-none"), ("mhc", "4xF1-h0-K2-hcn")]
B, T = 2, 5


def _model(kind: str):
    return make_model(seed=0) if kind == "plain" else make_model(seed=1, hc_streams=2)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from snlp.dist.layer_parallel import DistributedSNLP

    _init(rank, world, port)
    log: list = []
    for name in ("all_gather", "broadcast", "send", "recv", "isend", "irecv", "all_reduce"):
        real = getattr(dist, name)

        def f(*args, _real=real, _name=name, **kw):
            t = args[1] if _name == "all_gather" else args[0]  # all_gather(out_list, tensor): the rank's own part
            log.append((_name, t.numel()))
            return _real(*args, **kw)
        setattr(dist, name, f)
    res = {}
    for kind, plan in PLANS:
        model = _model(kind)
        runner = DistributedSNLP(model, plan)
        log.clear()
        runner.solve(tokens(model, B=B, T=T), check_finite=False)
        res[plan] = list(log)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_a_solve_sends_what_the_cost_model_charges(tmp_path):
    from snlp.dist.costmodel import Link, Shape, predict

    spawn_ranks(_worker, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for kind, plan in PLANS:
        p, cfg = Plan.parse(plan), _model(kind).config
        shape = Shape(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                      vocab_size=cfg.vocab_size)
        # a link of 1 ms latency and no bandwidth cost, no compute: over P = 2 ranks every message costs 1 ms
        # (an all_gather (P-1) p2p, a broadcast ceil(log2 P) p2p), so the SNLP comm term counts the messages
        pred = predict(shape, p, 2, Link(gbps=1e15, latency_us=1000.0), layer_ms=0.0, head_ms=0.0, tokens=T,
                       batch=B)
        expected = round(pred.comm_snlp_ms) - 1  # less the decoded token's broadcast (a solve decodes none)
        last = ranks[-1][plan]  # the last rank receives every boundary state: its calls are the critical path
        ops = [op for op, _ in last]
        assert ops.count("all_gather") + ops.count("broadcast") + ops.count("recv") == expected, (plan, ops)
        assert ops.count("all_gather") == (p.iters if p.surrogate.gathered_states else 0), (plan, ops)
        state = B * T * cfg.n_embd * max(cfg.hc_streams, 1)
        for op, n in last:
            if op == "all_gather":  # the affine totals: gathered_states states, plus A_r where it is small
                extra = n - p.surrogate.gathered_states * state
                assert 0 <= extra < state, (plan, n, state)

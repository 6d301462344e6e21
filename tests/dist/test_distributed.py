"""Distributed SNLP (snlp.distributed) on CPU/gloo: the processes are spawned here (torch.multiprocessing,
127.0.0.1, a free port). Each spawn runs many cases, so the whole file costs a few process starts.

Laws: the distributed solve equals the single-process `solve` (states of every chunk, final state, logits)
for idn / none / hcn / diag plans, h0 and fwd init, K = 1..C, even and uneven blocks; distributed cached
SNLP decoding equals single-process `snlp_generate`; distributed speculative decoding equals sequential
greedy decoding; a dead rank makes the survivor fail with RankFailureError instead of hanging; ranks
with different plans or weights fail at start-up."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.multiprocessing as mp
from conftest import make_model, tokens, free_port as _free_port, init_gloo as _init, spawn_ranks as _spawn

from snlp.method.fusion import chunk_weights
from snlp.decode import sequential_generate, snlp_generate
from snlp.method.plan import Plan
from snlp.method.solver import solve
from snlp.method.jacobian import select_chunks

pytestmark = pytest.mark.usefixtures("one_thread")

PLAIN = dict()
MHC = dict(hc_streams=2)
SOLVE_CASES = (
    [("plain", f"4xF1-h0-K{k}") for k in range(1, 5)]  # K = 1..C, C = 4 over 2 (even) and 3 (uneven) ranks
    + [("plain", "4xF1-fwd-K2"), ("plain", "5xF1-h0-K2"), ("plain", "3xF2-fwd-K1"), ("plain", "6xF1-h0-K6"),
       ("plain", "4xF1-h0-K2-elk:0.3"), ("plain", "4xF1-h0-K2-order:reversed"),
       ("plain", "4xF1-h0-K3-order:2.0.3.1"), ("plain", "4xF1-h0-K3-diag:fd-order:reversed"),
       ("mhc", "4xF1-h0-K3-hcn-order:3.1.2.0"), ("plain", "4xF1-h0-K4-tol:1e-3"),
       ("plain", "4xF1-fwd-K2-none"), ("plain", "5xF1-h0-K1-none"),
       ("plain", "4xF1-h0-K2-diag:fd-probes:2"), ("plain", "5xF1-fwd-K1-diag:vjp-subset:1.3"),
       ("plain", "4xF1-h0-K1-diag:jvp"),
       ("mhc", "4xF1-h0-K2-hcn"), ("mhc", "3xF2-fwd-K1-hcn"), ("mhc", "5xF1-h0-K5-hcn"), ("mhc", "4xF1-h0-K1-diag:fd"),
       ("fp32", "4xF1-h0-K2"), ("fp32", "4xF1-fwd-K1-hcn-mhc"),
       ("plain", "4xF1-h0-K2-causal"), ("plain", "3xF2-fwd-K1-causal"), ("mhc", "4xF1-h0-K2-hcn-causal")])
DECODE_CASES = [("plain", "4xF1-h0-K1"), ("plain", "5xF1-h0-K5"), ("plain", "4xF1-h0-K1-diag:fd"),
                ("mhc", "4xF1-h0-K2-hcn"), ("plain", "4xF1-h0-K1-causal")]
PROMPTS = [[1, 5, 9], [7], [3, 3, 14, 2, 8]]


def _model(kind: str):
    if kind == "plain":
        return make_model(seed=0)
    if kind == "mhc":
        return make_model(seed=1, **MHC)
    if kind == "fp32":
        return make_model(seed=2, dtype=torch.float32)
    if kind == "fp32-mhc":
        return make_model(seed=2, dtype=torch.float32, **MHC)
    raise AssertionError(kind)


def _case(kind: str, plan: str) -> tuple[str, str]:
    if plan.endswith("-mhc"):  # fp32 mHC case
        return "fp32-mhc", plan[:-4]
    return kind, plan




def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from snlp.dist.layer_parallel import DistributedSNLP

    _init(rank, world, port)
    res = {"solve": {}, "decode": {}, "memory": {}}
    for kind, plan in SOLVE_CASES:
        kind, plan = _case(kind, plan)
        model = _model(kind)
        r = DistributedSNLP(model, plan).solve(tokens(model))
        res["solve"][(kind, plan)] = dict(states=r.states, chunks=r.chunks, hidden=r.hidden, logits=r.logits,
                                          iters=r.iters)
    for kind, plan in DECODE_CASES:
        runner = DistributedSNLP(_model(kind), plan, keep_layers=True)
        for i, prompt in enumerate(PROMPTS):
            res["decode"][(kind, plan, "snlp", i)] = runner.generate(prompt, "snlp", max_new_tokens=6).tokens
            res["decode"][(kind, plan, "speculative", i)] = runner.generate(prompt, "speculative", 6, block=3).tokens
            res["decode"][(kind, plan, "sequential", i)] = runner.generate(prompt, "sequential", 6).tokens
    runner = DistributedSNLP(_model("plain"), "4xF1-h0-K1")
    res["memory"] = runner.memory(runner.new_cache(32))
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()



@pytest.fixture(scope="module", params=[2, 3], ids=["P2", "P3"])
def dist_results(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"dist{request.param}")
    _spawn(_worker, request.param, str(out))
    return request.param, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(request.param)]


def _tol(kind: str) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if kind.startswith("fp32") else dict(rtol=1e-10, atol=1e-10)


def test_distributed_solve_equals_single_process(dist_results):
    P, ranks = dist_results
    for kind, plan in SOLVE_CASES:
        kind, plan = _case(kind, plan)
        model = _model(kind)
        with torch.no_grad():
            ref = solve(model, tokens(model), plan, keep_states=True)
        parts = [rk["solve"][(kind, plan)] for rk in ranks]
        bounds = [p["chunks"] for p in parts]
        assert bounds[0][0] == 0 and bounds[-1][1] == Plan.parse(plan).chunks
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous blocks covering every chunk
        assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1  # as even as possible
        states = torch.cat([p["states"] for p in parts])
        torch.testing.assert_close(states, ref.states[-1], **_tol(kind), msg=f"{kind} {plan} P={P}")
        torch.testing.assert_close(parts[-1]["hidden"], ref.hidden, **_tol(kind))
        torch.testing.assert_close(parts[-1]["logits"], model.head(ref.hidden), **_tol(kind))
        assert all(p["hidden"] is None for p in parts[:-1])
        assert all(p["iters"] == ref.iters for p in parts)


def test_distributed_decoding_equals_single_process(dist_results):
    P, ranks = dist_results
    for kind, plan in DECODE_CASES:
        model = _model(kind)
        for i, prompt in enumerate(PROMPTS):
            seq = sequential_generate(model, prompt, 6).tokens
            snlp = snlp_generate(model, prompt, plan, 6).tokens
            for rk in ranks:  # every rank returns the broadcast tokens
                assert rk["decode"][(kind, plan, "snlp", i)] == snlp, (kind, plan, prompt, P)
                assert rk["decode"][(kind, plan, "speculative", i)] == seq
                assert rk["decode"][(kind, plan, "sequential", i)] == seq


def test_rank_holds_only_its_block(dist_results):
    P, ranks = dist_results
    full = make_model(seed=0)
    total = sum(p.numel() * p.element_size() for b in full.blocks[2:] for p in b.parameters())  # the suffix
    for r, rk in enumerate(ranks):
        mem = rk["memory"]
        assert mem["fused_weight_bytes"] < total * (2 / P if P == 3 else 0.6)  # its block, not the suffix
        assert mem["kv_bytes"] > 0
    # prefix layers live on rank 0 only; the last rank alone keeps the LM head
    assert ranks[0]["memory"]["param_bytes"] > ranks[1]["memory"]["param_bytes"] or P == 2


def test_local_weights_are_the_global_stack_sliced():
    from snlp.dist.layer_parallel import partition

    for kind in ("plain", "mhc"):
        model = _model(kind)
        for plan, P in (("4xF1-h0-K1", 3), ("3xF2-h0-K1", 2), ("5xF1-h0-K1", 2)):
            p = Plan.parse(plan)
            S = p.prefix_len(model.config.n_layer)
            full = chunk_weights(model, S, p.chunks, p.fuse)
            for c0, c1 in partition(p.chunks, P):
                local = chunk_weights(model, S + c0 * p.fuse, c1 - c0, p.fuse)
                ref = select_chunks(full, range(c0, c1))
                for name in ("qkv", "attn_out", "fc", "proj", "alpha", "beta", "ve_gate", "ve_slot", "windows"):
                    a, b = getattr(local, name), getattr(ref, name)
                    if a is None and name in ("ve_gate", "ve_slot") and b is not None:
                        # a block without value-embedding layers has none; the global stack pads it with zero slots
                        assert bool((ref.ve_slot == model.value_embeds.shape[0]).all()), (kind, plan)
                        continue
                    if a is None and name == "windows" and b is not None:
                        assert bool((b < 0).all()), (kind, plan)  # all-full windows are stored as None locally
                        continue
                    assert (a is None) == (b is None), name
                    if a is not None:
                        assert torch.equal(a, b), (kind, plan, name)


def test_partition_uneven_and_refused():
    from snlp.dist.layer_parallel import partition

    assert partition(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert partition(7, 2) == [(0, 4), (4, 7)]
    assert partition(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="C = 2 chunks cannot be spread over 3 ranks"):
        partition(2, 3)


# ----------------------------------------------------------------------------- failures
def _mismatch_worker(rank: int, world: int, port: int, out: str) -> None:
    from snlp.dist.layer_parallel import DistributedSNLP

    _init(rank, world, port)
    msgs = []
    for seed, plan in (((0, 1), ("4xF1-h0-K1",) * 2), ((0, 0), ("4xF1-h0-K1", "4xF1-h0-K2"))):
        try:
            DistributedSNLP(make_model(seed=seed[rank]), plan[rank])
            msgs.append("")
        except ValueError as e:
            msgs.append(str(e))
    torch.save(msgs, os.path.join(out, f"rank{rank}.pt"))
    # a rank that exits with its gloo group alive can abort in the group's threads at interpreter exit (SIGABRT,
    # "terminate called without an active exception"): the spawn then fails although both ranks saved their messages
    import torch.distributed as dist

    dist.destroy_process_group()


def test_mismatched_plans_or_weights_fail_at_start_up(tmp_path):
    _spawn(_mismatch_worker, 2, str(tmp_path))
    for r in range(2):
        weights, plan = torch.load(tmp_path / f"rank{r}.pt")
        assert "ranks [1] have a different model weights/config than rank 0" in weights
        assert "ranks [1] have a different plan than rank 0" in plan


def _dying_worker(rank: int, world: int, port: int, q, how: str) -> None:
    import time

    from snlp.dist.layer_parallel import DistributedSNLP, RankFailureError

    _init(rank, world, port, timeout_s=30.0 if how == "kill" else 5.0)
    runner = DistributedSNLP(make_model(seed=0), "4xF1-h0-K2")
    model_idx = torch.tensor([[1, 2, 3]])
    for step in range(1000):
        if rank == 1 and step == 3:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)  # a rank dying mid-run
            time.sleep(600)  # a rank hanging mid-run: the others must give up after the 5 s timeout
        try:
            runner.solve(model_idx)
        except RankFailureError as e:
            q.put((rank, step, str(e)))
            raise SystemExit(3)
    q.put((rank, -1, "finished without noticing the dead rank"))


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_dead_or_hung_rank_makes_the_others_fail_not_hang(how):
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_dying_worker, args=(r, 2, port, q, how)) for r in range(2)]
    for p in procs:
        p.start()
    procs[0].join(timeout=180)  # a hang guard, not a speed threshold: the gloo timeout is 30 s / 5 s
    alive = procs[0].is_alive()
    if how == "hang" or alive:
        procs[1].kill()
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert not alive, "rank 0 hung after its peer died"
    assert procs[1].exitcode == -signal.SIGKILL
    assert procs[0].exitcode == 3
    rank, step, msg = q.get(timeout=5)
    assert rank == 0 and step >= 3 and "rank 0 of 2" in msg and "peer rank died or did not answer" in msg


# ----------------------------------------------------------------------------- CLI (torchrun) and cost model
def test_torchrun_generate_distributed_matches_sequential(tmp_path):
    import json
    import subprocess
    import sys

    from snlp.io.checkpoint import save_checkpoint
    from snlp.apps.cli import main
    from snlp.io.tokenizer import MIN_VOCAB, Tokenizer

    text = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. " * 20
    tok = Tokenizer.train([text], vocab_size=MIN_VOCAB + 40)
    model = make_model(seed=3, dtype=torch.float32, vocab_size=tok.vocab_size, n_layer=4, n_head=2, n_kv_head=1,
                       n_embd=32, sequence_len=128, scale=0.15)
    ckpt = save_checkpoint(tmp_path / "tiny", model, tokenizer=tok)
    common = ["--prompt", "First Citizen:", "--max-new-tokens", "12", "--quiet"]
    assert main(["generate", str(ckpt), "--mode", "sequential", "--json", str(tmp_path / "seq.json"), *common]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           "-m", "snlp", "generate", str(ckpt), "--distributed", "--mode", "speculative", "--plan", "3xF1-h0-K1",
           "--block", "3", "--json", str(tmp_path / "dist.json"), *common]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    seq, dst = (json.loads((tmp_path / f).read_text()) for f in ("seq.json", "dist.json"))
    assert dst["tokens"] == seq["tokens"] and dst["matches_sequential"] and dst["world_size"] == 2
    assert dst["chunks_per_rank"] == [[0, 2], [2, 3]] and len(dst["memory_per_rank"]) == 2
    assert dst["sampling"] == seq["sampling"] == dict(temperature=0.0, top_k=0, top_p=1.0, seed=None,
                                                      repetition_penalty=1.0,
                                                      repetition_penalty_source="default")  # greedy: no seed
    assert "over 2 ranks" in out.stdout
    # the timed rounds' load window (snlp.runtime.load), over the cores the job may use
    assert set(dst["load"]) == {"start", "end", "peak", "cores", "machine_cpus"} and dst["load"]["cores"] >= 1


def test_cost_model_laws():
    from snlp.dist.costmodel import SHAPES, Link, predict

    shape, P = SHAPES["3B"], 4
    free = Link(gbps=1e12, latency_us=0.0)
    plan = Plan.parse("12xF1-h0-K2")
    p = predict(shape, plan, P, free, layer_ms=1.0, head_ms=0.5)
    assert p.sequential_ms == pytest.approx(32 * 1.0 + 0.5)
    assert p.pipeline_ms == pytest.approx(p.sequential_ms)  # one request: pipelining adds only messages
    assert p.tensor_parallel_ms == pytest.approx(p.sequential_ms / P)  # perfect split on a free link
    assert p.snlp_ms == pytest.approx(20 + 2 * 3 + 0.5)  # S = 20 prefix layers + K * ceil(12/4) chunk layers + head
    slow = Link(gbps=1e12, latency_us=1000.0)  # 1 ms per message: count the messages on the critical path
    q = predict(shape, plan, P, slow, layer_ms=1.0, head_ms=0.5)
    assert q.pipeline_ms - p.pipeline_ms == pytest.approx(P - 1)
    assert q.tensor_parallel_ms - p.tensor_parallel_ms == pytest.approx(32 * 2 * 2 * (P - 1))  # 2 ring all-reduces/layer
    # h_S broadcast (log2 P) + K all_gathers (P-1 each) + K-1 boundary sends + the token broadcast (log2 P)
    assert q.snlp_ms - p.snlp_ms == pytest.approx(2 + 2 * (P - 1) + 1 + 2)
    with pytest.raises(ValueError, match="fewer than the 4 devices"):
        predict(shape, Plan.parse("2xF1-h0-K1"), P, free, 1.0, 0.5)


def test_bench_simulate_devices_cli(tmp_path):
    import json

    from snlp.apps.cli import main

    out = tmp_path / "sim.json"
    assert main(["bench", "--simulate-devices", "8", "--shape", "70B", "--roofline-gbytes", "3350", "--dtype",
                 "bfloat16", "--plans", "16xF4-h0-K2", "--link-gbps", "3600", "--link-latency-us", "2",
                 "--json", str(out)]) == 0
    rec = json.loads(out.read_text())[0]
    assert rec["devices"] == 8 and rec["snlp_ms"] < rec["sequential_ms"] and rec["fits_one_device_gb"] > 100
    assert main(["bench", "--simulate-devices", "2", "--depth", "4", "--width", "64", "--head-dim", "32",
                 "--vocab-size", "128", "--plans", "2xF1-h0-K1", "--runs", "2", "--warmup", "1",
                 "--json", str(out)]) == 0  # measured on this CPU
    assert json.loads(out.read_text())[0]["compute"].startswith("measured on cpu")


def test_bench_simulate_devices_refuses_a_plan_with_too_few_chunks_before_measuring_any(monkeypatch, tmp_path, capsys):
    """--simulate-devices 4 --plans 4xF1-h0-K1,2xF1-h0-K1 measured and printed the first plan, then stopped on the
    second's C < P, writing nothing: every plan is checked before the first is measured."""
    import snlp.dist.costmodel as costmodel
    from snlp.apps.cli import main

    measured = []
    for name in ("measure_layer_head_ms", "measure_chunk_ms"):
        real = getattr(costmodel, name)
        monkeypatch.setattr(costmodel, name, lambda *a, real=real, **k: measured.append(a) or real(*a, **k))
    assert main(["bench", "--simulate-devices", "4", "--depth", "4", "--width", "64", "--head-dim", "32",
                 "--vocab-size", "128", "--plans", "4xF1-h0-K1,2xF1-h0-K1", "--runs", "1", "--warmup", "0"]) == 2
    out = capsys.readouterr()
    assert "plan 2xF1-h0-K1 has C = 2 chunks, fewer than the 4 devices" in out.err
    assert measured == [] and "4xF1-h0-K1 on 4 devices" not in out.out


def test_simulated_rows_of_one_shape_share_one_layer_and_head_measurement(tmp_path, monkeypatch):
    """`--simulate-devices` measured the layer and head again for every plan, so rows of one shape printed
    sequential / pipeline / tensor-parallel times that differed by the timer's noise (4.72 ms, 3.50 ms, 3.55 ms for
    three plans at depth 4). They are the shape's: measured once, every row's columns are one measurement, each row
    the cost model of that layer and head written out (L t_layer + t_head; + (P-1) sends on the pipeline), and a
    rank's batched chunks are timed once per (ceil(C/P), M)."""
    import json

    from snlp.apps.cli import main
    from snlp.dist import costmodel

    calls = {"layer": 0, "chunk": []}
    real_layer, real_chunk = (getattr(costmodel, n, None) for n in ("measure_layer_head_ms", "measure_chunk_ms"))

    def layer(*a, **k):
        calls["layer"] += 1
        return real_layer(*a, **k)

    def chunk(shape, plan, devices, *a, **k):
        calls["chunk"].append((-(-plan.chunks // devices), plan.fuse))
        return real_chunk(shape, plan, devices, *a, **k)

    monkeypatch.setattr(costmodel, "measure_layer_head_ms", layer, raising=False)
    monkeypatch.setattr(costmodel, "measure_chunk_ms", chunk, raising=False)
    out = tmp_path / "sim.json"
    plans = "2xF1-h0-K1,2xF2-h0-K1,4xF1-h0-K2,2xF1-h0-K2"
    assert main(["bench", "--simulate-devices", "2", "--depth", "4", "--width", "64", "--head-dim", "32",
                 "--vocab-size", "128", "--plans", plans, "--runs", "1", "--warmup", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["plan"] for r in rows] == plans.split(",")
    for key in ("layer_ms", "head_ms", "sequential_ms", "pipeline_ms", "tensor_parallel_ms"):
        assert len({r[key] for r in rows}) == 1, key
    t, h = rows[0]["layer_ms"], rows[0]["head_ms"]
    msg = 1 * 1 * 64 * 4  # one fp32 state of B = 1, T = 1, D = 64
    for r in rows:
        assert r["sequential_ms"] == pytest.approx(4 * t + h, rel=1e-12)
        assert r["pipeline_ms"] == pytest.approx(4 * t + (2 - 1) * (10e-3 + msg * 8 / 3600e9 * 1e3) + h, rel=1e-9)
    assert rows[0]["chunk_ms"] == rows[3]["chunk_ms"]  # 2xF1 at K = 1 and K = 2: one rank's chunk, timed once
    assert calls["layer"] == 1 and sorted(calls["chunk"]) == [(1, 1), (1, 2), (2, 1)]


def test_measured_layer_is_the_shapes_layer(monkeypatch):
    """`measure_layer_ms` times the layer of the Shape it is given: a SwiGLU MLP of mlp_hidden (the 70B shape's kind)
    is built as one, with Shape.layer_params weights, not as the relu^2 MLP of 4 D."""
    from snlp.dist import costmodel
    from snlp.model.gpt import GPT

    built = []
    init = GPT.__init__

    def spy(self, cfg, *a, **kw):
        init(self, cfg, *a, **kw)
        built.append(sum(p.numel() for n, p in self.blocks[0].named_parameters() if "ve_gate" not in n))

    monkeypatch.setattr(GPT, "__init__", spy)
    for shape in (costmodel.Shape(n_layer=4, n_embd=32, n_head=4, n_kv_head=2, vocab_size=64, mlp_hidden=88,
                                  mlp_mats=3),
                  costmodel.Shape(n_layer=4, n_embd=32, n_head=4, n_kv_head=2, vocab_size=64)):
        built.clear()
        costmodel.measure_layer_ms(shape, Plan.parse("2xF1-h0-K1"), 2, warmup=0, runs=1)
        assert built and built[0] == shape.layer_params, (shape, built)


def _fd_floor_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from snlp.dist.layer_parallel import DistributedSNLP

    _init(rank, world, port)
    model = make_model(seed=1, n_layer=4, dtype=torch.float32)
    said = {}
    for eps in ("1e-5", "0.000346"):
        try:
            DistributedSNLP(model, f"3xF1-h0-K2-diag-eps:{eps}")
            said[eps] = None
        except ValueError as e:
            said[eps] = str(e)
    torch.save(said, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_distributed_refuses_an_fd_eps_below_the_dtype_floor_as_solve_does(tmp_path):
    """solve and bind refuse a written diag:fd eps below sqrt(machine eps) of the compute dtype (fd_step would take
    the floor instead: on fp32, eps:1e-5 and eps:1e-4 are one computation under two names). DistributedSNLP ran such
    a plan, bit for bit the floor's result; every rank now refuses it at construction with solve's message, and the
    smallest eps the message suggests runs."""
    _spawn(_fd_floor_worker, 2, str(tmp_path))
    for rank in range(2):
        said = torch.load(tmp_path / f"rank{rank}.pt")
        assert said["1e-5"] is not None and "eps:1e-05 is below the smallest FD step of the compute dtype float32" \
            in said["1e-5"], said
        assert said["0.000346"] is None

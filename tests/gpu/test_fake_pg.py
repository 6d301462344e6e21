"""The distributed path on a fake process group: DistributedSNLP's solve and speculative decode on
fake cuda tensors (tests/gpu/fakecuda.py) with torch.distributed's `fake` backend (collectives that communicate
nothing), for world sizes 2-4 and every rank index. A recording shim wraps the torch.distributed functions (it
observes the calls and forwards them unchanged) and every collective's tensors are checked for what NCCL needs:
CUDA tensors on this rank's device, contiguous, of a dtype NCCL reduces / moves, the same shape and dtype on both
sides of an all_gather; and no Python object goes through a collective on the hot path (all_gather_object /
broadcast_object_list only at start-up). The gloo CPU tests (tests/dist) check the values."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from fakecuda import fake_cuda
from snlp.dist.layer_parallel import DistributedSNLP
from snlp.model.gpt import GPT, GPTConfig

fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
pytestmark = pytest.mark.usefixtures("one_thread")

NCCL_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
               torch.int64, torch.bool}
TENSOR_OPS = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "send", "recv", "isend", "irecv",
              "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce", "gather",
              "scatter", "batch_isend_irecv")
OBJECT_OPS = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
              "send_object_list", "recv_object_list")


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dist.P2POp):
        yield x.tensor


class Recorder:
    """Wraps torch.distributed's collectives: each call is recorded (op, tensors) and forwarded unchanged."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, list[torch.Tensor]]] = []
        for op in TENSOR_OPS + OBJECT_OPS:
            if hasattr(dist, op):
                monkeypatch.setattr(dist, op, self._wrap(op, getattr(dist, op)))

    def _wrap(self, op, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            self.calls.append((op, list(_tensors(list(args) + list(kwargs.values())))))
            return fn(*args, **kwargs)
        return call

    def check(self, device: torch.device) -> list[str]:
        bad = []
        for op, ts in self.calls:
            if op in OBJECT_OPS:
                bad.append(f"{op}: a Python object through the process group on the hot path")
                continue
            if not ts:
                bad.append(f"{op}: no tensor argument")
            for t in ts:
                if t.device != device:
                    bad.append(f"{op}: tensor on {t.device}, this rank's device is {device}")
                if t.dtype not in NCCL_DTYPES:
                    bad.append(f"{op}: dtype {t.dtype} is not an NCCL dtype")
                if not t.is_contiguous():
                    bad.append(f"{op}: non-contiguous tensor {tuple(t.shape)} (NCCL needs contiguous buffers)")
            if op == "all_gather" and len({(tuple(t.shape), t.dtype) for t in ts}) != 1:
                bad.append(f"{op}: outputs and input differ in shape / dtype {[(tuple(t.shape), t.dtype) for t in ts]}")
        return bad


@pytest.fixture
def fake_group():
    made = []

    def init(rank: int, world: int):
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)
        made.append(True)
    yield init
    if made and dist.is_initialized():
        dist.destroy_process_group()


CFG = dict(vocab_size=64, n_layer=6, n_head=2, n_kv_head=1, n_embd=32, sequence_len=64, window_pattern="SL",
           short_window=3)
CASES = [(w, r) for w in (2, 3, 4) for r in range(w)]


@pytest.mark.parametrize("world,rank", CASES)
def test_distributed_solve_and_speculative_decode_on_a_fake_group(world, rank, fake_group, monkeypatch):
    fake_group(rank, world)
    with torch.device("meta"):
        model = GPT(GPTConfig(**CFG))
    device = torch.device("cuda", rank)  # torchrun: one GPU per rank, rank r on cuda:r
    reads: list = []
    with fake_cuda(host_reads=reads), torch.no_grad():
        with torch.enable_grad():
            model = model.to_empty(device=device)
        for p in model.parameters():
            p.requires_grad_(False)
        # check=False: the start-up check hashes the weights' bytes (host work, off the hot path; none here)
        dsnlp = DistributedSNLP(model, "4xF1-h0-K2", keep_layers=True, check=False)
        rec = Recorder(monkeypatch)
        res = dsnlp.solve(torch.zeros(1, 5, dtype=torch.long, device=device), check_finite=False)
        assert res.states.device == device
        solve_calls = len(rec.calls)
        out = dsnlp.generate([1, 2, 3], mode="speculative", max_new_tokens=3, block=2)
        assert len(out.tokens) == 3
    assert solve_calls > 0 and len(rec.calls) > solve_calls, "the solve and the decode communicate"
    ops = {op for op, _ in rec.calls}
    assert {"broadcast", "all_gather"} <= ops, ops
    assert bool(ops & {"send", "isend"}) == (rank < world - 1), ops  # the boundary state goes to rank r+1
    assert bool(ops & {"recv", "irecv"}) == (rank > 0), ops
    problems = rec.check(device)
    assert not problems, f"world {world} rank {rank}:\n" + "\n".join(sorted(set(problems)))

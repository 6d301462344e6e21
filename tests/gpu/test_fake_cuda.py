"""The device-mismatch tier: every CUDA path run on a device that holds no data.

Models are built on `meta` and moved to data-less `cuda:0` tensors under FakeTensorMode (tests/gpu/fakecuda.py), so
on this CPU-only torch any tensor a path creates on the CPU raises FakeTensorDeviceMismatchError where it meets a
cuda tensor (what a GPU raises), and any host read of a device value (.item(), int(t), .tolist()) raises
DataDependentOutputException (a device-to-host sync on a GPU). Paths that need autograd (the VJP / Newton
estimators, a training step) run on `meta` instead, where the same CPU tensor raises too. Values are not checked here
(there are none): the CPU tests check them; this tier checks where tensors live and that no step reads the device.
"""

from __future__ import annotations

import pytest
import torch

from fakecuda import fake_cuda, on_cuda, tagged_generators, to_cuda
from snlp.method.plan import Plan
from snlp.method.preheat import Preheat
from snlp.method.solver import bind, parallel_forward, solve
from snlp.method.surrogates import HCN, DiagN, Identity, Jacobi, Newton
from snlp.model.cache import KVCache
from snlp.model.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")

V, L, D = 64, 6, 32
BASE = dict(vocab_size=V, n_layer=L, n_head=2, n_kv_head=1, n_embd=D, sequence_len=64)


def hf_config(family: str) -> GPTConfig:
    """The GPTConfig snlp.io.hf converts a tiny transformers config of `family` to (no weights are made)."""
    transformers = pytest.importorskip("transformers")
    from snlp.io.hf import config_from_hf

    C = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
         "mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config}[family.split("-")[0]]
    kw = dict(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=L, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64)
    if family == "qwen2-window":
        kw.update(use_sliding_window=True, sliding_window=5, max_window_layers=2)
    if family == "mistral-window":
        kw.update(sliding_window=6)
    if family == "qwen3":
        kw.update(head_dim=24)
    if family == "llama-llama3":
        kw.update(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8}, tie_word_embeddings=True)
    return config_from_hf(C(**kw))


def config(family: str) -> GPTConfig:
    if family == "nanochat":  # value embeddings, x0 residual, sliding windows, softcap
        return GPTConfig(**BASE, window_pattern="SL", short_window=3)
    if family == "mhc":
        return GPTConfig(**BASE, hc_streams=2)
    return hf_config(family)


FAMILIES = ["nanochat", "mhc", "llama", "llama-llama3", "qwen2-window", "qwen3", "mistral-window"]


def meta_model(family: str) -> GPT:
    with torch.device("meta"):
        return GPT(config(family))


def ids(B=2, T=5, device="cuda"):
    return torch.zeros(B, T, dtype=torch.long, device=device)


@pytest.mark.parametrize("family", FAMILIES)
def test_sequential_forward(family):
    model = meta_model(family)
    with fake_cuda(), torch.no_grad():
        model = to_cuda(model)
        logits = model(ids())
        assert on_cuda(logits) and logits.shape == (2, 5, V) and logits.dtype == torch.float32
        trace = model.hidden_states(ids())
        assert all(on_cuda(h) for h in trace) and len(trace) == L + 1


SURROGATES = {"idn": Identity(), "jacobi": Jacobi(), "hcn": HCN(), "diag:fd": DiagN("fd"), "diag:jvp": DiagN("jvp")}


def preheat_for(model, rank=3):
    E = model.config.n_embd * max(model.config.hc_streams, 1)
    dev = model.wte.weight.device
    return Preheat(V=torch.empty(E, rank, device=dev), U=torch.empty(L, E, rank, device=dev),
                   b=torch.empty(L, E, device=dev))


@pytest.mark.parametrize("sur", list(SURROGATES))
@pytest.mark.parametrize("init", ["h0", "fwd", "preheat"])
def test_solve_every_surrogate_and_init(sur, init):
    family = "mhc" if sur == "hcn" else "nanochat"
    model = meta_model(family)
    with fake_cuda(), torch.no_grad():
        model = to_cuda(model)
        plan = Plan(chunks=2, fuse=2, iters=2, init=init, surrogate=SURROGATES[sur])
        ph = preheat_for(model) if init == "preheat" else None
        r = solve(model, ids(), plan, check_finite=False, keep_states=True, preheat=ph)
        assert on_cuda(r.hidden) and on_cuda(r.prefix) and on_cuda(r.row_iters)
        assert all(on_cuda(s) for s in r.states)
        if init == "preheat":  # parallel_forward has no preheat=; bind checks the calibration's weights
            return  # fingerprint (a hash of the weights' bytes, once per bind: host work by design)
        assert on_cuda(parallel_forward(model, ids(), plan, check_finite=False))
        assert on_cuda(bind(model, plan, check_finite=False)(ids()))


@pytest.mark.parametrize("sur", ["diag:vjp", "newton"])
def test_solve_autograd_estimators_on_meta(sur):
    """VJP / JVP-per-chunk estimators need autograd, which fake cuda tensors cannot run: trace them on meta."""
    model = meta_model("nanochat")
    plan = Plan(chunks=2, fuse=2, iters=2, surrogate=DiagN("vjp") if sur == "diag:vjp" else Newton())
    with tagged_generators(), torch.no_grad():
        r = solve(model, ids(device="meta"), plan, check_finite=False)
    assert r.hidden.device.type == "meta"


def test_solve_tol_syncs_once_per_iteration():
    """A `tol` plan reads the largest row update back to the host each iteration (by design: it decides to stop);
    nothing else in the solve reads the device."""
    model = meta_model("nanochat")
    reads = []
    with fake_cuda(host_reads=reads), torch.no_grad():
        model = to_cuda(model)
        r = solve(model, ids(), Plan(chunks=2, fuse=2, iters=3, tol=1e-3), check_finite=False)
    assert on_cuda(r.hidden) and on_cuda(r.row_iters)
    reads = [r for r in reads if not r[1].startswith("h2d:")]  # the fused weights' host tables, made once per solve
    assert [where for where, _ in reads] == ["snlp/method/solver.py:solve"] * len(reads) and 1 <= len(reads) <= 3


def test_check_finite_is_the_one_host_read_of_a_solve():
    model = meta_model("nanochat")
    reads = []
    with fake_cuda(host_reads=reads), torch.no_grad():
        model = to_cuda(model)
        solve(model, ids(), Plan(chunks=2, fuse=2, iters=1), check_finite=True)
    reads = [r for r in reads if not r[1].startswith("h2d:")]  # the fused weights' host tables, made once per solve
    assert [where for where, _ in reads] == ["snlp/method/solver.py:_check_finite"]


def test_forward_reads_nothing_back():
    """GPT.check_tokens read the id range back to the host (int(idx.min()), int(idx.max())) on every forward off
    the CPU; on a data-less device that read raises. The range is checked only where the ids are host memory."""
    model = meta_model("nanochat")
    model(ids(device="meta"))  # raised "Tensor.item() cannot be called on meta tensors" before the fix
    with pytest.raises(ValueError, match="token ids must lie in"):
        GPT(GPTConfig(**BASE))(torch.full((1, 2), V))  # the CPU still gets the clear error


# ----------------------------------------------------------------------------- decode steps and the KV cache
def test_kv_cache_write_rollback_keep_rows():
    model = meta_model("nanochat")
    with fake_cuda(), torch.no_grad():
        model = to_cuda(model)
        cache = KVCache.for_model(model, batch=3, max_len=16)
        assert on_cuda(cache.k) and on_cuda(cache.v)
        model(ids(3, 4), cache=cache)  # eager write at length 0..3
        cache.rollback(2)
        model(ids(3, 1), cache=cache)
        pos = torch.arange(cache.length, cache.length + 2, device="cuda")
        assert on_cuda(model(ids(3, 2), cache=cache, pos=pos))  # static-shape write
        rag = torch.tensor([[3, 4], [5, 6], [7, 8]], device="cuda")
        assert on_cuda(model(ids(3, 2), cache=cache, pos=rag))  # ragged (B, T) write
        cache.keep_rows(torch.tensor([0, 2], device="cuda"))
        assert on_cuda(cache.k) and cache.batch == 2


def test_decode_steps():
    """Prefill, the sequential step, the drafter (SNLP) step and the verifier's padded call, through the
    static-shape Step (uncompiled here: what torch.compile traces) and the eager step, plus the ragged batched step."""
    from snlp.decode.steps import Step, sequential_fn, sequential_step, snlp_fn, snlp_step

    model = meta_model("nanochat")
    with fake_cuda(), torch.no_grad():
        model = to_cuda(model)
        runner = bind(model, Plan(chunks=2, fuse=2, iters=1), check_finite=False)
        for seq, draft in [(Step(sequential_fn(model), "cuda", compile=False), Step(snlp_fn(runner), "cuda", compile=False)),
                           (sequential_step(model), snlp_step(runner))]:
            cache = KVCache.for_model(model, batch=1, max_len=64)
            assert on_cuda(seq.prefill(ids(1, 7), cache))  # prefill (padded to a bucket by Step)
            assert on_cuda(seq(ids(1, 1), cache))  # one sequential step
            start = cache.length
            assert on_cuda(draft(ids(1, 1), cache))  # one drafter step
            cache.rollback(start)
            assert on_cuda(seq(ids(1, 3), cache, pad_to=5))  # verify a block of drafts
            cache.rollback(start + 1)
            batch = KVCache.for_model(model, batch=2, max_len=64)
            pos = torch.tensor([[3], [6]], device="cuda")
            assert on_cuda(seq.ragged(ids(2, 1), pos, batch)) and on_cuda(draft.ragged(ids(2, 1), pos, batch))


# ----------------------------------------------------------------------------- training (meta) and adaptation
def test_training_step_with_muon_and_regulariser_on_meta():
    """A pretraining micro-batch as the trainer runs it (snlp.train.job.TrainStep: CE + the SNLP regulariser),
    backward, then AdamW + Muon (snlp.train.optim.build_optimizers) on meta: autograd cannot run on fake cuda
    tensors, and autocast("cuda") is disabled without CUDA, so bf16 autocast itself is not traced."""
    from snlp.train.config import TrainConfig
    from snlp.train.job import TrainStep
    from snlp.train.optim import build_optimizers
    from snlp.train.regularizer import RegConfig

    model = meta_model("nanochat").train()
    x = ids(2, 6, device="meta")
    loss, ce, reg = TrainStep(model, RegConfig(surrogate="idn", suffixes=(4,)))(x, x, 0.5)
    loss.backward()
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters())
    opts = build_optimizers(model, TrainConfig(out="unused", optimizer="muon"))
    with tagged_generators():
        for o in opts:
            o.step()
    assert all(p.device.type == "meta" for p in model.parameters()) and ce.device.type == reg.device.type == "meta"


def test_ssd_solve():
    from snlp.method.ssd_solve import exact_kv, ssd_solve

    model = meta_model("nanochat")
    plan = Plan(chunks=2, fuse=2, iters=1)
    with fake_cuda(), torch.no_grad():
        model = to_cuda(model)
        x = ids(2, 5)
        trace = model.hidden_states(x)
        ctx = model.embed(x)
        kv = exact_kv(model, trace, plan, ctx)
        S = plan.prefix_len(L)
        assert on_cuda(ssd_solve(model, x, plan, trace[S], kv)) and on_cuda(ssd_solve(model, x, plan, trace[S], None))


def test_flex_window_path_stays_on_cuda_without_host_reads(monkeypatch):
    """The FlexAttention window kernel's tensors (block lists, the per-branch window its mask reads) are made on the
    query's device and never read back: the sequential forward and a mixed-window fused plan under "flex", with the
    compiled-graph condition forced. FlexAttention itself (torch's, compiled even in its eager form) is replaced by a
    stand-in that checks every tensor it would receive, evaluates the mask once on cuda indices and returns q's
    shape (the values are tests/model/test_flex_windows.py's)."""
    from snlp.model import ops

    seen = []

    def stand_in(q, k, v, block_mask, enable_gqa):
        bm = block_mask
        tensors = (q, k, v, bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
        assert all(on_cuda(t) for t in tensors)
        i = torch.zeros((), dtype=torch.int32, device="cuda")
        assert on_cuda(bm.mask_mod(i, i, i, i))
        seen.append(q.shape)
        return torch.empty_like(q)

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(ops, "flex_attention", stand_in)
    prev = ops.set_window_kernel("flex")
    reads: list = []
    try:
        cfg = GPTConfig(vocab_size=64, n_layer=4, n_head=2, n_kv_head=1, n_embd=32, sequence_len=300,
                        window_pattern="SSSL", short_window=130)
        with torch.device("meta"):
            model = GPT(cfg).eval()
        with fake_cuda(reads), torch.no_grad():
            model = to_cuda(model)
            idx = torch.zeros(2, 260, dtype=torch.long, device="cuda")
            assert on_cuda(model(idx))
            assert on_cuda(bind(model, "2xF2-h0-K2", check_finite=False)(idx))
        # host tables copied in (window lists, block indices) are made at bind time or, under compile, become the
        # graph's constants: only reads of device values are claimed absent here
        assert not [r for r in reads if not r[1].startswith("h2d:")]
        # 3 windowed layers of the sequential forward, then the plan's 2 iterations over one stack of 4 branches
        assert seen == [(2, 2, 260, 16)] * 3 + [(8, 2, 260, 16)] * 2
    finally:
        ops.set_window_kernel(prev)

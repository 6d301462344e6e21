"""The FlexAttention window kernel (set_window_kernel("flex")) computes the masked reference's function: its block
lists are exactly the blocks a window sees (against torch's create_block_mask, which evaluates the mask on every
pair), compiled (inductor, fp32) it equals a naive softmax loop and the masked SDPA over T, windows, heads, GQA and
batch rows, forward and gradients, and it is taken where `set_window_kernel` says: inside compiled graphs only, one
graph per forward, no recompiles after the first call."""

from __future__ import annotations

import pytest
import torch
from conftest import examples, make_model, tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask

from snlp import bind
from snlp.model import ops


# torch < 2.13 takes no CPU FlexAttention (its CPU kernel is not thread-safe there: ops.CPU_FLEX_THREADS_SAFE)
needs_cpu_flex = pytest.mark.skipif(not ops.CPU_FLEX_THREADS_SAFE, reason="torch < 2.13: no CPU FlexAttention")


def naive_loop(q, k, v, windows, rows):
    """Softmax over the keys j with 0 <= i - j <= w (w < 0: j <= i), one query row of one sequence at a time;
    sequence n has window windows[n // rows]; GQA by repeating k/v."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    N, _, T, hd = q.shape
    out = torch.empty_like(q)
    for n in range(N):
        w = windows[n // rows]
        for i in range(T):
            lo = max(0, i - w) if w >= 0 else 0
            s = q[n, :, i:i + 1] @ k[n, :, lo:i + 1].transpose(-1, -2) / hd ** 0.5
            out[n, :, i:i + 1] = torch.softmax(s, -1) @ v[n, :, lo:i + 1]
    return out


def masked_reference(q, k, v, windows, rows):
    """The masked kernel: one SDPA over every score under each sequence's window mask (ops.attention_mask)."""
    wt = torch.tensor(windows).repeat_interleave(rows)  # (N,)
    return ops.attend(q, k, v, wt)


# ------------------------------------------------------------------------------------------ the block lists
@settings(max_examples=examples(40), deadline=None)
@given(T=st.integers(1, 700), windows=st.lists(st.integers(-1, 700), min_size=1, max_size=4),
       rows=st.integers(1, 3))
def test_block_lists_are_exactly_the_blocks_the_window_sees(T, windows, rows):
    """Visited blocks = the blocks holding at least one visible (query, key) pair, as create_block_mask finds them by
    evaluating the mask everywhere; a block listed as full has every pair visible (so skipping its mask is exact)."""
    wt = torch.tensor(windows)
    mine = ops.flex_block_mask(wt, rows, T, "cpu")
    N = len(windows) * rows

    def mask_mod(b, h, qi, ki):
        w = wt[b // rows]
        return (ki <= qi) & ((w < 0) | (qi - ki <= w))
    ref = create_block_mask(mask_mod, N, None, T, T, device="cpu")
    assert torch.equal(mine.to_dense(), ref.to_dense())
    # every pair inside a full block is visible
    i = torch.arange(T)
    d = i[:, None] - i[None, :]
    for n in range(N):
        w = windows[n // rows]
        vis = (d >= 0) & ((w < 0) | (d <= w))
        nf = int(mine.full_kv_num_blocks[n, 0].sum())
        qb, kb = torch.nonzero(torch.stack([
            torch.zeros(mine.full_kv_num_blocks.shape[-1], mine.full_kv_num_blocks.shape[-1], dtype=torch.bool)
            .index_fill_(1, mine.full_kv_indices[n, 0, r, :mine.full_kv_num_blocks[n, 0, r]].long(), True)[r]
            for r in range(mine.full_kv_num_blocks.shape[-1])]), as_tuple=True)
        assert len(qb) == nf
        B = ops.FLEX_BLOCK
        for a, b in zip(qb.tolist(), kb.tolist()):
            assert vis[a * B:(a + 1) * B, b * B:(b + 1) * B].all()
            assert (a + 1) * B <= T and (b + 1) * B <= T


def test_one_int_window_gives_a_broadcast_block_mask():
    bm = ops.flex_block_mask(300, 5, 1000, "cpu")
    assert bm.kv_num_blocks.shape[:2] == (1, 1)  # one mask for every sequence and head
    assert torch.equal(bm.to_dense(), create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= 300), None, None,
                                                        1000, 1000, device="cpu").to_dense())


# ------------------------------------------------------------------------------------------ compiled, exact
_flex = torch.compile(ops.flex_window_attention, fullgraph=True, dynamic=False)


@pytest.mark.slow
@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.sampled_from([40, 200]), n_win=st.sampled_from([1, 3]), rows=st.sampled_from([1, 2]),
       hkv=st.sampled_from([1, 2]), rep=st.sampled_from([1, 2]), data=st.data(), seed=st.integers(0, 2 ** 16))
@needs_cpu_flex
def test_compiled_flex_is_the_naive_loop_and_the_masked_reference(T, n_win, rows, hkv, rep, data, seed):
    """fp32, inductor: per-branch windows (a tensor: its values vary without a recompile) over `rows` batch rows,
    GQA (Hq = rep * Hkv), windows from 0 (the diagonal only) past T (causal) and -1 (full)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    windows = tuple(data.draw(st.lists(st.integers(-1, T + 5), min_size=n_win, max_size=n_win)))
    gen = torch.Generator().manual_seed(seed)
    N = n_win * rows
    q = torch.randn(N, hkv * rep, T, 16, generator=gen)
    k, v = (torch.randn(N, hkv, T, 16, generator=gen) for _ in range(2))
    with torch.no_grad():
        got = _flex(q, k, v, torch.tensor(windows), rows)
        torch.testing.assert_close(got, masked_reference(q, k, v, windows, rows), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.double(), naive_loop(q.double(), k.double(), v.double(), windows, rows),
                                   rtol=1e-5, atol=1e-5)


@needs_cpu_flex
def test_compiled_flex_one_window_equals_the_naive_loop():
    """The single-layer form (an int window, a broadcast block mask) at T across a block edge, GQA, two rows."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 150, 16, generator=gen)
    k, v = (torch.randn(2, 2, 150, 16, generator=gen) for _ in range(2))
    with torch.no_grad():
        got = _flex(q, k, v, 37)
    torch.testing.assert_close(got.double(), naive_loop(q.double(), k.double(), v.double(), (37,), 2),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("windows,rows", [((5, -1, 0), 2), ((130,), 1)])
def test_flex_gradients_equal_the_masked_reference(monkeypatch, windows, rows):
    """Training through the kernel: autograd gradients of q, k, v through FlexAttention's own autograd (its dense
    backward, traced by aot_autograd) equal the masked SDPA's, fp64. torch 2.13 refuses any FlexAttention backward
    on the CPU at its input check (and inductor has no CPU backward kernel), so this lifts the check to test the
    block lists' transposes and the mask under autograd; a CPU training step takes the masked kernel instead
    (test_cpu_training_never_takes_flex)."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    gen = torch.Generator().manual_seed(3)
    N, T = len(windows) * rows, 150
    q = torch.randn(N, 4, T, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(N, 2, T, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    g = torch.randn(N, 4, T, 8, generator=gen, dtype=torch.float64)
    f = torch.compile(ops.flex_window_attention, backend="aot_eager", fullgraph=True)
    win = torch.tensor(windows) if len(windows) > 1 else windows[0]
    got = torch.autograd.grad(f(q, k, v, win, rows), (q, k, v), g)
    want = torch.autograd.grad(masked_reference(q, k, v, windows, rows), (q, k, v), g)
    naive = torch.autograd.grad(naive_loop(q, k, v, windows, rows), (q, k, v), g)
    for a, b, c in zip(got, want, naive):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------ where it is taken
def _recording_compile(fn, **kw):
    """torch.compile(fn, fullgraph=True) after a dynamo reset, with a backend that records every graph dynamo
    captures (and runs it eagerly): (compiled fn, the list of graphs)."""
    graphs = []

    def backend(gm, example):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True, **kw), graphs


def _graphs(fn):
    """Graphs dynamo captures for one call of fn (run eagerly after capture), fullgraph."""
    c, graphs = _recording_compile(fn)
    return graphs, c()


def _has_flex(graphs) -> bool:
    return any("flex_attention" in g.code for g in graphs)


@needs_cpu_flex
@pytest.mark.parametrize("plan", [None, "3xF2-h0-K2", "6xF1-h0-K1"])
def test_flex_is_taken_inside_compiled_graphs_only(kernel, plan):
    """With "flex" the compiled sequential forward and plans (mixed S/L stacks) run FlexAttention, and equal the
    masked reference; eager calls, "masked" and "banded" never do, nor "auto" on the CPU."""
    model = make_model(seed=2, n_layer=6, window_pattern="SSSL", short_window=5, sequence_len=64)
    idx = tokens(model, T=40)
    run = (lambda: model(idx)) if plan is None else (lambda r=bind(model, plan, check_finite=False): r(idx))
    with torch.no_grad():
        kernel("masked")
        ref = run()
        for kind, want in (("flex", True), ("masked", False), ("banded", False), ("auto", False)):
            kernel(kind)
            graphs, out = _graphs(run)
            assert _has_flex(graphs) == want, kind
            torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
        kernel("flex")  # eager: the unfused FlexAttention would materialise every score; the auto choice runs
        torch.testing.assert_close(run(), ref, rtol=1e-10, atol=1e-10)


def test_auto_follows_the_measurements(kernel, monkeypatch):
    """auto, while compiling: FlexAttention on CUDA for stacks that mix windows (measured faster than one masked SDPA
    over every branch and than grouping) without a backward, not for one layer or a stack of one window (masked
    measured faster / not measured); never on the CPU (a tie with the banded kernel per compiled forward); never
    while not compiling; "flex" wherever a window bites, except a CPU backward."""
    assert not ops.uses_flex(2048, (512, -1), "cuda", False)  # not compiling
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(ops, "CPU_FLEX_THREADS_SAFE", True)  # torch < 2.13's thread guard: the next test
    kernel("auto")
    assert ops.uses_flex(2048, (512, 512, 512, -1), "cuda", False)
    assert not ops.uses_flex(2048, (512, 512, 512, -1), "cuda", True)  # a training graph: backward not measured
    with torch.no_grad():
        assert ops.uses_flex(2048, (512, 512, 512, -1), "cuda", True)
    assert not ops.uses_flex(2048, (512,), "cuda", False)
    assert not ops.uses_flex(2048, (512, 512), "cuda", False)
    assert not ops.uses_flex(2048, (512, -1), "cpu", False) and not ops.uses_flex(4096, (256,), "cpu", False)
    kernel("flex")
    assert ops.uses_flex(2048, (512,), "cuda", True) and ops.uses_flex(2048, (512,), "cpu", False)
    assert not ops.uses_flex(2048, (-1, 2047, 4000), "cuda", False)  # no window bites: the causal path
    assert not ops.uses_flex(2048, (512,), "cpu", True)  # torch has no CPU backward for it
    with torch.no_grad():
        assert ops.uses_flex(2048, (512,), "cpu", True)  # requires_grad tensors under no_grad: no backward
    for kind in ("masked", "banded"):
        kernel(kind)
        assert not ops.uses_flex(2048, (512, -1), "cuda", False)


def test_cpu_training_never_takes_flex(kernel):
    """A compiled CPU forward that builds a graph for the backward (a training step) takes the masked kernel even
    under "flex" (torch refuses FlexAttention's CPU backward), and its gradients are the masked reference's."""
    model = make_model(seed=4, n_layer=4, window_pattern="SL", short_window=3, sequence_len=64)
    idx = tokens(model, T=20)

    def loss():
        return model(idx).square().mean()
    kernel("masked")
    want = torch.autograd.grad(loss(), list(model.parameters()))
    kernel("flex")
    c, graphs = _recording_compile(loss)
    got = torch.autograd.grad(c(), list(model.parameters()))
    assert not _has_flex(graphs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@needs_cpu_flex
def test_backout_survives_flex_in_a_compiled_graph(kernel):
    """nanochat-snlp's backout keeps layer n_layer // 2's output in the Context across later FlexAttention calls (an
    attribute of an object made inside the graph was lost there under torch 2.13: the head read None)."""
    model = make_model(seed=3, n_layer=6, window_pattern="SSSL", short_window=5, sequence_len=64, smear=True,
                       backout=True, qk_scale=1.2, ve_gate_channels=12, ve_gate_scale=3.0, n_embd=32)
    idx = tokens(model, T=40)
    r = bind(model, "3xF2-h0-K1", check_finite=False)
    with torch.no_grad():
        kernel("masked")
        refs = (model(idx), r(idx))
        kernel("flex")
        for fn, ref in zip((lambda: model(idx), lambda: r(idx)), refs):
            graphs, out = _graphs(fn)
            assert _has_flex(graphs)
            torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.slow
def test_compiled_plan_and_forward_with_flex_compile_once_and_equal_the_reference(kernel):
    """inductor, fp32: the sequential forward and a fused plan under "flex" equal the masked eager reference; three
    calls after a reset make one graph each (no graph break, no recompile after the first call)."""
    model = make_model(seed=6, n_layer=6, window_pattern="SSSL", short_window=5, sequence_len=64, dtype=torch.float32)
    idx = tokens(model, T=40)
    r = bind(model, "3xF2-h0-K2", check_finite=False)
    with torch.no_grad():
        kernel("masked")
        refs = (model(idx), r(idx))
        kernel("flex")
        for fn, ref in zip((lambda: model(idx), lambda: r(idx)), refs):
            torch._dynamo.reset()
            counters.clear()
            c = torch.compile(fn, fullgraph=True, dynamic=False)
            outs = [c() for _ in range(3)]
            assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
            for out in outs:
                torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


@needs_cpu_flex
@pytest.mark.parametrize("plan", [None, "2xF2-h0-K1"])
def test_new_prompt_lengths_do_not_recompile_a_dynamic_flex_graph(kernel, plan):
    """A graph compiled with dynamic=True serves every prompt length under "flex" as it does under "masked": the
    block-mask memo is per forward, so its key must not hold T (a dict keyed by T specialises T, one graph per
    length, and torch's recompile limit then fails a fullgraph compile at the ninth length)."""
    model = make_model(seed=2, n_layer=4, window_pattern="SSSL", short_window=5, sequence_len=300)
    run = model if plan is None else bind(model, plan, check_finite=False)
    kernel("flex")
    c, graphs = _recording_compile(lambda i: run(i), dynamic=True)
    with torch.no_grad():
        for T in range(40, 50):
            idx = tokens(model, B=2, T=T, seed=T)
            kernel("masked")
            ref = run(idx)
            kernel("flex")
            torch.testing.assert_close(c(idx), ref, rtol=1e-9, atol=1e-9)
    assert _has_flex(graphs) and len(graphs) == 1


def test_a_misspelt_window_kernel_variable_is_refused_when_a_model_is_built():
    """SNLP_WINDOW_ATTENTION=flexx used to run as "auto" silently, then raised at `import snlp.model.ops` (every
    library import failed, even code that builds no model): it is a one-line ValueError when a model is built."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "SNLP_WINDOW_ATTENTION": "flexx"}
    build = "import snlp; from snlp.model.config import GPTConfig; snlp.GPT(GPTConfig(n_layer=1, n_embd=8, n_head=1, n_kv_head=1, vocab_size=16))"
    assert subprocess.run([sys.executable, "-c", "import snlp, snlp.model.ops"], env=env).returncode == 0
    r = subprocess.run([sys.executable, "-c", build], env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert "ValueError: SNLP_WINDOW_ATTENTION must be one of auto, banded, masked, flex, got 'flexx'" in r.stderr
    env["SNLP_WINDOW_ATTENTION"] = "banded"
    r = subprocess.run([sys.executable, "-c", build + "; from snlp.model.ops import window_kernel; print(window_kernel())"],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "banded"


def test_a_kernel_set_in_code_wins_over_a_misspelt_variable(monkeypatch):
    """set_window_kernel used to read SNLP_WINDOW_ATTENTION for the value it returns, so with the variable misspelt no
    code could set a kernel (the ValueError came from the setter). It returns what was held (None: nothing yet) and
    None given back restores the unread state, where the variable is read (and refused) at the next model."""
    import snlp
    from snlp.model.config import GPTConfig

    monkeypatch.setattr(ops, "_window_kernel", None)
    monkeypatch.setenv("SNLP_WINDOW_ATTENTION", "flexx")
    assert ops.set_window_kernel("banded") is None and ops.window_kernel() == "banded"
    snlp.GPT(GPTConfig(n_layer=1, n_embd=8, n_head=1, n_kv_head=1, vocab_size=16))
    assert ops.set_window_kernel(None) == "banded"
    with pytest.raises(ValueError, match="SNLP_WINDOW_ATTENTION must be one of"):
        ops.window_kernel()
    monkeypatch.setenv("SNLP_WINDOW_ATTENTION", "masked")
    assert ops.window_kernel() == "masked"


def test_cpu_flex_is_not_taken_before_torch_2_13(kernel, monkeypatch):
    """torch 2.11's compiled CPU FlexAttention kernel corrupts the heap on two threads (SIGABRT / SIGSEGV; one thread
    computes it right; docs/records/2026-11-27-torch-2.11-on-cpu.md), and the thread count cannot be read inside a
    traced graph: before 2.13 "flex" never takes it on the CPU (the other kernels compute the same function); CUDA and
    torch >= 2.13 are unaffected."""
    assert ops.CPU_FLEX_THREADS_SAFE is (torch.__version__ >= "2.13")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    kernel("flex")
    for safe in (True, False):
        monkeypatch.setattr(ops, "CPU_FLEX_THREADS_SAFE", safe)
        assert ops.uses_flex(2048, (512,), "cpu", False) is safe
        assert ops.uses_flex(2048, (512,), "cuda", False)

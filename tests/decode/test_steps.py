"""Static-shape KV-cached steps (snlp.steps): positions as a tensor and masked attention over the whole cache
equal the dynamic eager path; compiled (inductor, fullgraph) steps equal eager (logits within fp32 rounding,
greedy tokens identical) for sequential, SNLP, speculative draft and verify steps; a compiled decode step
runs no host sync (no aten::item / _local_scalar_dense in its profile); bad input is refused."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import configs, examples, make_model, mhc_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import snlp
from snlp import Plan
from snlp.bench.decode import decode_benchmark
from snlp.model.cache import KVCache
from snlp.decode import sequential_generate, snlp_generate, speculative_generate
from snlp.decode.steps import EagerStep, Step, host_syncs, sequential_fn, sequential_step, snlp_fn, snlp_step

pytestmark = pytest.mark.usefixtures("one_thread")


def _static_vs_dynamic(model, forward, ids, cut):
    """Logits of a prefill of ids[:, :cut] and then one-token steps, through the dynamic path (cache length)
    and through the static one (pos tensor, whole cache under a mask), max abs difference."""
    B, T = ids.shape
    dyn, sta = KVCache.for_model(model, batch=B, max_len=T + 3), KVCache.for_model(model, batch=B, max_len=T + 3)
    diffs = []
    with torch.no_grad():
        for a, b in [(0, cut)] + [(t, t + 1) for t in range(cut, T)]:
            x = forward(ids[:, a:b], dyn)
            y = forward(ids[:, a:b], sta, pos=torch.arange(a, b))
            sta.advance(b - a)
            diffs.append((x - y).abs().max().item())
    assert dyn.length == sta.length == T
    return max(diffs)


@given(cfg=configs(max_layers=5), plan_kind=st.sampled_from(["seq", "F1", "F2", "fwd"]), B=st.integers(1, 2),
       T=st.integers(2, 12), data=st.data())
@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_static_positions_equal_dynamic_path(cfg, plan_kind, B, T, data):
    model = make_model(**cfg)
    L = model.config.n_layer
    cut = data.draw(st.integers(1, T))
    if plan_kind == "seq":
        forward = lambda idx, cache, pos=None: model(idx, cache=cache, pos=pos)  # noqa: E731
    else:
        fuse = 2 if plan_kind == "F2" and L >= 3 else 1
        C = (L - 1) // fuse
        plan = f"{C}xF{fuse}-{'fwd' if plan_kind == 'fwd' else 'h0'}-K{data.draw(st.integers(1, C))}"
        forward = snlp.bind(model, plan, check_finite=False)
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(T))
    assert _static_vs_dynamic(model, forward, ids, cut) < 1e-10  # fp64


def test_static_positions_mhc_hcn():
    model = mhc_model(n_layer=4)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    for forward in (lambda idx, cache, pos=None: model(idx, cache=cache, pos=pos),
                    snlp.bind(model, "3xF1-h0-K1-hcn", check_finite=False)):
        assert _static_vs_dynamic(model, forward, ids, 5) < 1e-10


# ----- compiled steps (inductor compiles to C++ on CPU). One tiny model, few graphs: compiling is slow on
# 2 cores, so every test below shares the module's steps (a graph per (step, length), compiled once).
PLAN = "2xF1-h0-K1"
BLOCK = 3


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    model = make_model(dtype=torch.float32, n_layer=3, scale=0.3)  # sliding windows on: the mask path
    runner = snlp.bind(model, PLAN, check_finite=False)
    # graphs (all on one cache bucket of 64 positions): seq prefill (16), seq step (1), verify (B+1), snlp prefill
    # (16), snlp step (1); every test below (and decode_benchmark) reuses them: prompts are <= 17 tokens
    steps = {"seq": sequential_step(model, compile=True), "snlp": snlp_step(runner, compile=True)}
    return model, runner, steps


@pytest.mark.slow
def test_compiled_steps_equal_eager(compiled):
    model, runner, steps = compiled
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    for name, eager in (("seq", sequential_step(model)), ("snlp", snlp_step(runner))):
        step = steps[name]
        with torch.inference_mode():  # caches made as generate makes them (guards check dispatch keys)
            ce = KVCache.for_model(model, max_len=10)
            cc = KVCache.for_model(model, max_len=step.cache_len(10 + step.slack))  # the bucket generate uses too
            pieces = [(0, 4)] + [(t, t + 1) for t in range(4, 10)]
            for a, b in pieces:  # a prefill computes no logits (both sides): its K/V are checked by the steps after it
                one = b - a == 1
                x = eager(ids[:, a:b], ce) if one else eager.prefill(ids[:, a:b], ce)
                y = step(ids[:, a:b], cc) if one else step.prefill(ids[:, a:b], cc)
                assert y.shape == x.shape and (x.shape[1] == 1) == one
                if one:
                    assert (x - y).abs().max().item() < 1e-4, name  # fp32: rounding of fused kernels only
                    assert torch.equal(x.argmax(-1), y.argmax(-1))
        assert cc.length == ce.length == 10
    assert steps["seq"].compile_s > 0 and ("step", 1, 1, cc.max_len) in steps["seq"]._seen


def test_compiled_generation_equals_eager(compiled):
    model, runner, steps = compiled
    prompt = [3, 14, 15, 9, 2]
    ref = sequential_generate(model, prompt, max_new_tokens=12)
    got = sequential_generate(model, prompt, max_new_tokens=12, step=steps["seq"])
    assert got.tokens == ref.tokens and len(got.tokens) == 12
    spec = speculative_generate(model, prompt, PLAN, block=BLOCK, max_new_tokens=12, draft=steps["snlp"],
                                verify=steps["seq"])
    assert spec.tokens == ref.tokens  # the verifier keeps greedy output exact; short last rounds are padded
    assert spec.rounds >= 3
    eager_snlp = snlp_generate(model, prompt, PLAN, max_new_tokens=8)
    got_snlp = snlp_generate(model, prompt, PLAN, max_new_tokens=8, step=steps["snlp"])
    assert got_snlp.tokens == eager_snlp.tokens
    again = sequential_generate(model, prompt, max_new_tokens=12, step=steps["seq"])
    assert again.tokens == ref.tokens and again.compile_s == 0.0  # compiled by the call before: nothing left


@pytest.mark.slow
def test_compiled_hcn_step_equals_eager():
    """mHC with the HCN surrogate (the chunk forward also returns the stream-mixing matrices) compiles into one
    graph too; one-token steps only (one graph)."""
    model = mhc_model(n_layer=3).float()
    runner = snlp.bind(model, "2xF1-h0-K1-hcn", check_finite=False)
    eager, step = snlp_step(runner), snlp_step(runner, compile=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ce, cc = KVCache.for_model(model, max_len=8), KVCache.for_model(model, max_len=step.cache_len(8))
        for t in range(6):
            x, y = eager(ids[:, t:t + 1], ce), step(ids[:, t:t + 1], cc)
            assert (x - y).abs().max().item() < 1e-4 and torch.equal(x.argmax(-1), y.argmax(-1))
        assert host_syncs(step, cc, 1, calls=1) == 0


def test_compiled_decode_benchmark(compiled):
    """`snlp bench --decode --compile`'s library function: both sides compiled, compile time reported apart, the
    speculative rows still equal sequential, and the sequential row's achieved bandwidth is model bytes x tok/s."""
    model, _, _ = compiled
    recs = [r.to_dict() for r in decode_benchmark(model, [Plan.parse(PLAN, 3)], prompt_len=5, new_tokens=6,
                                                  blocks=(BLOCK,), warmup=1, runs=1, compile=True)]
    assert [r["mode"] for r in recs] == ["sequential", "snlp", "speculative"]
    assert all(r["compiled"] for r in recs) and recs[-1]["matches_sequential"]
    assert all(r["host_syncs"] == 0 for r in recs)  # checked on the steps the benchmark timed
    seq = recs[0]
    assert seq["model_bytes"] == sum(p.numel() * p.element_size() for p in model.parameters()) + \
        model.inv_freq.numel() * 4
    assert seq["bandwidth_gb_s"] == pytest.approx(seq["model_bytes"] * seq["tokens_per_s"] / 1e9)


@pytest.mark.parametrize("name,T", [("seq", 1), ("snlp", 1), ("seq", BLOCK + 1)])
def test_compiled_step_has_no_host_sync(compiled, name, T):
    """A compiled decode step (sequential, SNLP drafter, verifier over B+1 positions) never reads a value back
    to the host: no aten::item / _local_scalar_dense in its CPU profile (on CUDA they would stall the stream
    and forbid CUDA graphs; there `host_syncs` runs under torch.cuda.set_sync_debug_mode("error"))."""
    model, _, steps = compiled
    step = steps[name]
    with torch.inference_mode():
        cache = KVCache.for_model(model, max_len=step.cache_len(4 * T + step.slack))  # same graph shapes as above
        step(torch.ones(1, T, dtype=torch.long), cache)  # compiled already (shared graphs); now the cache has a length
        assert host_syncs(step, cache, T, calls=3) == 0
    assert cache.length == 4 * T


def test_eager_step_does_sync_so_the_probe_can_fail():
    """The eager CPU path still checks token ids on the host (an aten::item per forward): the probe sees it."""
    model = make_model(dtype=torch.float32, n_layer=3)
    with torch.inference_mode():
        cache = KVCache.for_model(model, max_len=4)
        assert host_syncs(sequential_step(model), cache, 1, calls=2) > 0


def test_step_input_errors():
    model = make_model(dtype=torch.float32, n_layer=3)
    with pytest.raises(ValueError, match="check_finite=False"):
        snlp_fn(snlp.bind(model, PLAN))
    with pytest.raises(ValueError, match="tol"):
        snlp_fn(snlp.bind(model, "2xF1-h0-K2-tol:0.01", check_finite=False))
    for plan in ("2xF1-h0-K1-diag:fd", "2xF1-h0-K2-newton"):  # measured to break a fullgraph compile
        with pytest.raises(ValueError, match="does not compile into one graph"):
            snlp_fn(snlp.bind(model, plan, check_finite=False))
    with pytest.raises(ValueError, match="prefill_pad"):
        Step(sequential_fn(model), "cpu", compile=False, prefill_pad=0)
    with pytest.raises(ValueError, match="pass the cache"):
        model(torch.tensor([[1, 2]]), pos=torch.arange(2))
    cache = KVCache.for_model(model, max_len=4)
    with pytest.raises(ValueError, match=r"pos must be a \(T,\)"):
        model(torch.tensor([[1, 2]]), cache=cache, pos=torch.arange(3))
    with pytest.raises(ValueError, match="KV cache overflow"):  # the room check stays on the host, outside
        Step(sequential_fn(model), "cpu", compile=False)(torch.ones(1, 5, dtype=torch.long), cache)


@pytest.mark.slow
def test_compiled_ragged_batches_equal_eager_and_do_not_sync(compiled):
    """Batched self-speculative decoding of ragged prompts (snlp.decode.batch) through the compiled steps: every row
    equals its own sequential output, a finished row rides along at a frozen position, and the ragged (B, T)-positions
    steps (drafter, verifier) run no host sync. Three new graphs (batch 3: prefill, drafter step, verifier)."""
    from torch.profiler import ProfilerActivity, profile

    from snlp.decode.steps import SYNC_OP

    model, _, steps = compiled
    prompts = [[3, 14, 15, 9, 2], [7], [1, 2, 3]]
    ref = sequential_generate(model, prompts, max_new_tokens=10)
    eos = ref[1].tokens[2]  # row 1 stops early and rides along in the compiled batch
    ref = [sequential_generate(model, p, max_new_tokens=10, eos_id=eos).tokens for p in prompts]
    spec = speculative_generate(model, prompts, PLAN, block=BLOCK, max_new_tokens=10, draft=steps["snlp"],
                                verify=steps["seq"], eos_id=eos)
    assert [r.tokens for r in spec] == ref and spec[1].stop == "eos"
    assert spec[0].compile_s > 0
    with torch.inference_mode():
        cache = KVCache.for_model(model, batch=3, max_len=64)  # the bucket the run used: no new graph
        pos = torch.tensor([[4], [0], [2]])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for t in range(2):
                steps["snlp"].ragged(torch.ones(3, 1, dtype=torch.long), pos + t, cache)
                steps["seq"].ragged(torch.ones(3, BLOCK + 1, dtype=torch.long), pos + t + torch.arange(BLOCK + 1), cache)
    assert sum(e.count for e in prof.key_averages() if e.key == SYNC_OP) == 0
    assert ("ragged step", 3, BLOCK + 1, 64) in steps["seq"]._seen


@pytest.mark.parametrize("compile", [False, True])
def test_a_prebuilt_snlp_step_follows_weight_updates(compile):
    """A prebuilt SNLP step (a decode loop's drafter, kept across calls) decodes with the model's current weights
    after an in-place update (as an optimizer step makes) and after model.to: its runner's fused weights are rebuilt before the next call (the
    compiled step checks outside its graph, Step.before), so its tokens equal a fresh snlp_generate's (fp64); they
    used to stay the old weights' tokens, silently. Compiled with dynamo's eager backend (the graph, not inductor)."""
    model = make_model(seed=4, n_layer=4)
    runner = snlp.bind(model, "3xF1-h0-K1", check_finite=False)
    step = snlp_step(runner, compile=compile, backend="eager") if compile else snlp_step(runner)
    prompt = [3, 14, 15, 9, 2]
    before = snlp_generate(model, prompt, "3xF1-h0-K1", max_new_tokens=8, step=step).tokens
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # in place, as an optimizer step writes
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    want = snlp_generate(model, prompt, "3xF1-h0-K1", max_new_tokens=8).tokens
    assert want != before  # the update changes the output: the law below can fail
    assert snlp_generate(model, prompt, "3xF1-h0-K1", max_new_tokens=8, step=step).tokens == want
    model.to(torch.float32)  # new storage; the step's next call rebuilds in float32
    with torch.inference_mode():
        cache = KVCache.for_model(model, max_len=step.cache_len(8 + step.slack))
        got = step(torch.tensor([prompt]), cache)  # an eager prefill computes no logits (EagerStep.prefill)
        want = snlp.bind(model, "3xF1-h0-K1")(torch.tensor([prompt]))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_keep_gives_the_last_logits_and_refuses_what_it_cannot():
    """GPT.forward / Runner(keep=k): the full forward's last k logit rows (k = 0: none), fp64; with targets or k
    outside 0..T a ValueError."""
    model = make_model(seed=2, n_layer=4, dtype=torch.float64)
    idx = torch.randint(0, model.config.vocab_size, (2, 7))
    runner = snlp.bind(model, "3xF1-h0-K1")
    for fn in (model, runner):
        full = fn(idx)
        for k in (0, 1, 3, 7):
            got = fn(idx, keep=k)
            assert got.shape == (2, k, full.shape[-1])
            torch.testing.assert_close(got, full[:, 7 - k:], rtol=0, atol=1e-12)  # fp64 GEMMs of other shapes
    for bad in (-1, 8, 15):  # the Runner sliced these silently: 8 gave one row, -1 none, 15 all seven
        for fn in (model, runner):
            with pytest.raises(ValueError, match="keep"):
                fn(idx, keep=bad)
    # True sliced as one row and False as none, silently; 1.5 and "2" failed with a TypeError, 1.5 only after the
    # whole forward: each is refused by name before it
    for bad in (True, False, 1.5, "2"):
        for fn in (model, runner):
            with pytest.raises(ValueError, match="keep=.*an integer"):
                fn(idx, keep=bad)
    with pytest.raises(ValueError, match="keep"):
        model(idx, targets=idx, keep=1)


@pytest.mark.parametrize("mode", ["sequential", "snlp", "speculative"])
@pytest.mark.parametrize("batch", [False, True])
def test_an_eager_prefill_computes_no_logits(mode, batch):
    """The prefill only fills the cache (the prompt's last token is fed by the first step): its head over every
    prompt position was computed and thrown away, on a small model as much work as its layers. Now the head reads
    the decode steps' positions only; the tokens are the full-prefix argmax loop's."""
    model = make_model(seed=6, n_layer=4, dtype=torch.float64)
    prompts = [list(range(3, 23)), list(range(5, 18))]
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[1]))
    run = dict(sequential=lambda p: sequential_generate(model, p, max_new_tokens=4),
               snlp=lambda p: snlp_generate(model, p, "4xF1-h0-K4", max_new_tokens=4),
               speculative=lambda p: speculative_generate(model, p, "4xF1-h0-K1", block=2, max_new_tokens=4))[mode]
    out = run(prompts if batch else prompts[0])
    hook.remove()
    assert max(seen) <= 3, seen  # one token per step, or a verifier's block + 1; never a prompt's 13-19 positions
    for p, r in zip(prompts, out if batch else [out]):
        ids = list(p)
        for _ in range(4):
            with torch.no_grad():
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        assert r.tokens == ids[len(p):]


def linear_flops(graphs: list):
    """A torch.compile backend that appends each graph's F.linear FLOPs (2 x rows x in x out, from dynamo's example
    values) to `graphs` and runs the graph as traced."""
    def backend(gm, example_inputs):
        n = 0
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in (F.linear, torch._C._nn.linear):
                x, w = node.args[0].meta["example_value"], node.args[1].meta["example_value"]
                n += 2 * math.prod(x.shape[:-1]) * w.shape[0] * w.shape[1]
        graphs.append(n)
        return gm.forward
    return backend


@pytest.mark.parametrize("kind", ["sequential", "snlp"])
def test_a_compiled_prefill_computes_no_logits(kind):
    """A compiled step's prefill (static shapes, padded to 16) computed the head over every padded prompt position,
    logits nobody reads, as the eager prefill did before it took keep=0. Now it runs a graph of its own without
    the head: the same call with logits counts exactly the head's 2 x B x 16 x D x V FLOPs more (counted in the
    traced graphs), and the prefill returns (B, 0, V)."""
    model = make_model(seed=3, n_layer=4, dtype=torch.float32)
    graphs: list = []
    step = sequential_step(model, compile=True, backend=linear_flops(graphs)) if kind == "sequential" else \
        snlp_step(snlp.bind(model, "4xF1-h0-K1", check_finite=False), compile=True, backend=linear_flops(graphs))
    D, V = model.config.n_embd, model.config.vocab_size
    idx = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = step.new_cache(model, 2, step.cache_len(40))
        filled = step.prefill(idx, cache)
        assert cache.length == 13 and filled.shape == (2, 0, V)
        cache.seek(0)
        full = step(idx, cache, pad_to=16)
    assert full.shape == (2, 13, V) and len(graphs) == 2
    assert graphs[1] - graphs[0] == 2 * 2 * 16 * D * V
    assert {k[0] for k in step._seen} == {"fill", "step"}


@pytest.mark.parametrize("batch", [False, True])
def test_compiled_decoding_prefills_without_logits_and_keeps_its_tokens(batch):
    """Sequential, SNLP and speculative decoding through compiled steps (dynamo's eager backend: the traced graphs,
    not inductor) prefill through the fill graphs, compiled before the prefill's clock, and give the eager loops'
    tokens (fp64), one prompt and a ragged batch."""
    model = make_model(seed=6, n_layer=4, dtype=torch.float64)
    prompts = [list(range(3, 23)), list(range(5, 18))]
    p = prompts if batch else prompts[0]
    seq = sequential_step(model, compile=True, backend="eager")
    drafter = snlp_step(snlp.bind(model, "4xF1-h0-K1", check_finite=False), compile=True, backend="eager")
    runs = [(sequential_generate(model, p, max_new_tokens=5), sequential_generate(model, p, max_new_tokens=5, step=seq)),
            (snlp_generate(model, p, "4xF1-h0-K1", max_new_tokens=5),
             snlp_generate(model, p, "4xF1-h0-K1", max_new_tokens=5, step=drafter)),
            (speculative_generate(model, p, "4xF1-h0-K1", block=2, max_new_tokens=5),
             speculative_generate(model, p, "4xF1-h0-K1", block=2, max_new_tokens=5, draft=drafter, verify=seq))]
    for want, got in runs:
        assert [r.tokens for r in (got if batch else [got])] == [r.tokens for r in (want if batch else [want])]
    fills = {k for k in seq._seen if k[0] in ("fill", "ragged fill")}
    assert {k[0] for k in fills} == {"ragged fill" if batch else "fill"}
    assert not any(k[2] > 3 for k in seq._seen if k[0] in ("step", "ragged step"))  # no prefill-length logits graph
    assert (runs[0][1][0] if batch else runs[0][1]).compile_s > 0


def test_an_eager_step_without_a_positions_forward_refuses_a_batch_in_one_line():
    """EagerStep(forward) without fn= cannot run a ragged batch: its ragged call says so in one line. The batch's
    prefill went through ragged_fill, which called the missing forward: TypeError 'NoneType' object is not
    callable. Now the same one-line ValueError, before any forward."""
    model = make_model(seed=1, n_layer=2)
    step = EagerStep(lambda idx, cache: model(idx, cache=cache))
    with pytest.raises(ValueError, match="no positions-tensor forward"):
        sequential_generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=2, step=step)

"""The guard cut of compiled decode steps (snlp.decode.steps: Step(guards="cut"), StepState, own_code): a step runs
its graph without evaluating dynamo's guards only while nothing those guards protect changed since its last guarded
call of that shape. Checked against outside references: greedy tokens of the naive argmax loop over full forwards
and of the eager decode loops, and every logit of a cut call against the same positions-tensor forward run eagerly
on a copy of the cache; every mutation a caller can make between calls either is seen (a guarded call: it
recompiles where dynamo's guards fail) or needs nothing (an in-place weight update: the graph reads the storage);
with the step's snapshot made blind the stale graph runs (what the check protects); two models of one shape each
get their own graphs. Most use torch._dynamo.testing.CompileCounter (dynamo's tracing, guards and cache, without
inductor's compile time); one runs inductor, whose kernels are generated for one dtype."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch._dynamo.testing
from conftest import make_model

import snlp
from snlp.decode import sequential_generate, snlp_generate, speculative_generate
from snlp.decode import steps as steps_mod
from snlp.decode.steps import GUARD_MODES, StepState, Step, sequential_fn, sequential_step, snlp_fn, snlp_step
from snlp.model.cache import KVCache
from snlp.model.ops import set_window_kernel

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not steps_mod.CAN_SKIP_GUARDS, reason="this torch has no skip_guard_eval_unsafe")]

PLAN = "3xF1-h0-K1"


@pytest.fixture(autouse=True)
def cut_by_default(monkeypatch):
    """These tests are about the cut: steps built without guards= get it, as SNLP_COMPILE_GUARDS=cut gives them."""
    monkeypatch.setenv("SNLP_COMPILE_GUARDS", "cut")


def naive_greedy(model, prompt, n):
    """Greedy tokens by argmax over a full forward per token (no cache, no step)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def model32(seed=0, **cfg):
    torch._dynamo.reset()
    return make_model(seed=seed, dtype=torch.float32, n_layer=4, **cfg)


def test_cut_tokens_equal_the_naive_loop_sequential_snlp_and_speculative():
    model = model32()
    prompt = [3, 1, 4, 1, 5, 9]
    cnt = torch._dynamo.testing.CompileCounter()
    seq = sequential_step(model, compile=True, backend=cnt)
    draft = snlp_step(snlp.bind(model, PLAN, check_finite=False), compile=True, backend=cnt)
    assert seq.guards == draft.guards == "cut"
    want = naive_greedy(model, prompt, 12)
    for _ in range(2):  # the second run: a new cache (guarded once per shape), then the cut
        assert sequential_generate(model, prompt, max_new_tokens=12, step=seq).tokens == want
    assert seq.cut_calls >= 20 and seq.guarded_calls == 4  # prefill + step shape, once per cache
    spec = speculative_generate(model, prompt, PLAN, block=3, max_new_tokens=12, draft=draft, verify=seq)
    assert spec.tokens == want
    eager_snlp = snlp_generate(model, prompt, PLAN, max_new_tokens=10).tokens
    assert snlp_generate(model, prompt, PLAN, max_new_tokens=10, step=draft).tokens == eager_snlp
    assert draft.cut_calls > draft.guarded_calls


@pytest.mark.slow  # inductor compiles three graphs: ~45 s on a loaded 2-core box
def test_cut_with_inductor_equals_eager_and_a_dtype_change_recompiles():
    """Inductor's kernels are generated for the dtype they were compiled for: after model.double() a graph run with
    its guards skipped would compute in float32 (or fail); the step sees the new storage and recompiles."""
    model = model32()
    prompt = [2, 7, 1, 8]
    seq = sequential_step(model, compile=True)
    want = naive_greedy(model, prompt, 6)
    assert sequential_generate(model, prompt, max_new_tokens=6, step=seq).tokens == want
    assert seq.cut_calls >= 4
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    cache = seq.new_cache(model, 1, seq.cache_len(9 + seq.slack))
    seq.prefill(ids[:, :4], cache)
    seq(ids[:, 4:5], cache)
    guarded = seq.guarded_calls
    model.double()
    _retype_cache(cache, torch.float64)
    for _ in range(3):  # a guarded call (a new fp64 graph), then the cut on it
        got, want = _call_vs_eager(seq, sequential_fn(model), ids, cache)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # the head's logits are fp32; computed in fp64
    assert seq.guarded_calls == guarded + 1


def _warm(step, model, T0=4, calls=3):
    """A step prefilled on a fixed prompt and advanced `calls` tokens: its T = 1 shape is on the cut path."""
    ids = torch.randint(0, model.config.vocab_size, (1, T0 + calls + 2), generator=torch.Generator().manual_seed(1))
    cache = step.new_cache(model, 1, step.cache_len(ids.shape[1] + step.slack))
    step.prefill(ids[:, :T0], cache)
    for t in range(T0, T0 + calls):
        step(ids[:, t:t + 1], cache)
    assert step.cut_calls >= calls - 1
    return ids, cache


def _call_vs_eager(step, eager_fn, ids, cache):
    """One T = 1 call of the step and the same positions-tensor forward run eagerly on a copy of the cache."""
    ref = KVCache(k=cache.k.clone(), v=cache.v.clone(), length=cache.length,
                  ids=None if cache.ids is None else cache.ids.clone())
    tok = ids[:, cache.length:cache.length + 1]
    got = step(tok, cache)
    with torch.inference_mode():
        want = eager_fn(tok, torch.arange(ref.length, ref.length + 1), ref)
    return got, want


def _retype_cache(cache, dtype):
    cache.k, cache.v = cache.k.to(dtype), cache.v.to(dtype)


# (name, mutation(model, cache) -> undo or None, seen: the step must take a guarded call)
MUTATIONS = [
    ("model.double()", lambda m, c: (m.double(), _retype_cache(c, torch.float64)) and None, True),
    ("replaced Parameter", lambda m, c: setattr(m.lm_head, "weight", torch.nn.Parameter(m.lm_head.weight * 2)), True),
    ("p.data = other tensor", lambda m, c: setattr(m.lm_head.weight, "data", m.lm_head.weight.data * 3), True),
    ("in-place weight update", lambda m, c: (m.lm_head.weight.data.mul_(-1), None)[1], False),
    ("cache reallocated", lambda m, c: (setattr(c, "k", c.k.clone()), setattr(c, "v", c.v.clone())) and None, True),
    ("config edited (softcap)", lambda m, c: setattr(m.config, "softcap", 2.0), True),
    ("window kernel switched", lambda m, c: (lambda prev: lambda: set_window_kernel(prev))(set_window_kernel(
        "flex" if steps_mod.window_kernel() != "flex" else "masked")), True),
    ("default dtype", lambda m, c: (lambda prev: lambda: torch.set_default_dtype(prev))(
        (torch.get_default_dtype(), torch.set_default_dtype(torch.float64))[0]), True),
    ("deterministic algorithms", lambda m, c: (lambda prev: lambda: torch.use_deterministic_algorithms(prev))(
        (torch.are_deterministic_algorithms_enabled(), torch.use_deterministic_algorithms(True))[0]), True),
    ("train mode", lambda m, c: (m.train(), None)[1], True),
    ("replaced submodule", lambda m, c: m.blocks.__setitem__(0, copy.deepcopy(m.blocks[1])), True),
    # a submodule's own attributes, traced as constants: no registration, nothing on the model or its config moves
    ("a layer's attention window", lambda m, c: setattr(m.blocks[1].attn, "window", 1), True),
    ("a layer's norm eps", lambda m, c: setattr(m.blocks[1], "eps", 10.0), True),
    ("a layer's MLP forward patched", lambda m, c: setattr(m.blocks[2].mlp, "forward", torch.zeros_like), True),
]


@pytest.mark.parametrize("name,mutate,seen", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_every_mutation_is_seen_or_needs_nothing(name, mutate, seen):
    model = model32()
    cnt = torch._dynamo.testing.CompileCounter()
    step = sequential_step(model, compile=True, backend=cnt)
    ids, cache = _warm(step, model)
    guarded, cut = step.guarded_calls, step.cut_calls
    undo = mutate(model, cache)
    try:
        got, want = _call_vs_eager(step, sequential_fn(model), ids, cache)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if seen:
            assert step.guarded_calls == guarded + 1 and step.cut_calls == cut
        else:  # the graph reads the weights' storage: the cut path runs and sees the update
            assert step.cut_calls == cut + 1 and step.guarded_calls == guarded
        got, want = _call_vs_eager(step, sequential_fn(model), ids, cache)  # and then the cut again
        assert step.cut_calls == cut + 1 + (not seen)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        if undo is not None:
            undo()


@pytest.mark.parametrize("ctx", ["enable_grad", "no_grad"])
def test_grad_mode_is_not_the_steps(ctx):
    """Every call runs under inference mode (Step.__call__): the caller's grad mode leaves it on the cut path."""
    model = model32()
    step = sequential_step(model, compile=True, backend=torch._dynamo.testing.CompileCounter())
    ids, cache = _warm(step, model)
    guarded = step.guarded_calls
    with getattr(torch, ctx)():
        got, want = _call_vs_eager(step, sequential_fn(model), ids, cache)
    assert step.guarded_calls == guarded
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_autocast_entered_is_seen():
    """Under CPU autocast the eager forward fails (bf16 K/V into the fp32 cache); so must the step, rather than run
    the fp32 graph traced before autocast was entered, with its guards skipped, and return its logits."""
    model = model32()
    step = sequential_step(model, compile=True, backend=torch._dynamo.testing.CompileCounter())
    ids, cache = _warm(step, model)
    cut = step.cut_calls
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(Exception, match="Index put requires the source and destination dtypes match"):
            _call_vs_eager(step, sequential_fn(model), ids, cache)
        ref = KVCache(k=cache.k.clone(), v=cache.v.clone(), length=cache.length)
        with torch.inference_mode(), pytest.raises(RuntimeError, match="Index put requires"):
            sequential_fn(model)(ids[:, :1], torch.arange(ref.length, ref.length + 1), ref)
    assert step.cut_calls == cut


def test_snlp_step_sees_a_weight_update_through_the_runners_rebuild():
    model = model32()
    runner = snlp.bind(model, PLAN, check_finite=False)
    step = snlp_step(runner, compile=True, backend=torch._dynamo.testing.CompileCounter())
    ids, cache = _warm(step, model)
    guarded, old = step.guarded_calls, runner.weights
    with torch.no_grad():
        model.blocks[2].mlp.c_fc.weight.mul_(1.5)
    got, want = _call_vs_eager(step, snlp_fn(runner), ids, cache)
    assert runner.weights is not old and step.guarded_calls == guarded + 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    model.double()
    _retype_cache(cache, torch.float64)
    got, want = _call_vs_eager(step, snlp_fn(runner), ids, cache)
    assert step.guarded_calls == guarded + 2
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-7)


def test_a_blind_snapshot_runs_the_stale_graph(monkeypatch):
    """What the check protects, shown by removing it: with the step's state constant, a config edit (softcap, a
    constant of the traced graph) runs the graph traced before it, without recompiling: guards are skipped."""
    model = model32()
    cnt = torch._dynamo.testing.CompileCounter()
    step = sequential_step(model, compile=True, backend=cnt)
    ids, cache = _warm(step, model)
    monkeypatch.setattr(step.state, "take", lambda cache: ())
    monkeypatch.setattr(step.state, "keep", lambda cache: ())
    _call_vs_eager(step, sequential_fn(model), ids, cache)  # guarded once (() is not the kept snapshot), then blind
    frames, cut = cnt.frame_count, step.cut_calls
    model.config.softcap = 2.0
    got, want = _call_vs_eager(step, sequential_fn(model), ids, cache)
    assert cnt.frame_count == frames and step.cut_calls == cut + 1  # no guard ran, nothing recompiled
    assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3)  # the graph traced with softcap 15


def test_two_models_of_one_shape_each_run_their_own_graphs():
    """sequential_fn's closures share one code object; each Step compiles a copy of its own (own_code): its code
    object holds its own graph (T = 1) only, its fill function's copy its prefill graph, and under the cut
    alternating calls each equal their own model. (With one shared code object torch 2.13 still picks the right graph here: under skip_guard_eval_unsafe it
    keeps checking the guards that failed when it recompiled, which tell the two models apart; the shared cache would
    then hold every Step's graphs, checked in turn and counted against one recompile limit.)"""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    a = make_model(seed=0, dtype=torch.float32, n_layer=4)
    b = make_model(seed=5, dtype=torch.float32, n_layer=4, softcap=3.0)  # same shapes; another constant too
    cnt = torch._dynamo.testing.CompileCounter()
    sa, sb = (sequential_step(m, compile=True, backend=cnt) for m in (a, b))
    assert sa.fn._torchdynamo_orig_callable.__code__ is not sb.fn._torchdynamo_orig_callable.__code__
    ids = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(2))
    ca, cb = (s.new_cache(m, 1, s.cache_len(12 + s.slack)) for s, m in ((sa, a), (sb, b)))
    sa.prefill(ids[:, :4], ca)
    sb.prefill(ids[:, :4], cb)
    for t in range(4, 11):
        for s, m, c in ((sa, a, ca), (sb, b, cb)):
            got, want = _call_vs_eager(s, sequential_fn(m), ids, c)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sa.cut_calls >= 5 and sb.cut_calls >= 5
    for s in (sa, sb):
        assert len(_debug_get_cache_entry_list(s.fn._torchdynamo_orig_callable.__code__)) == 1
        assert len(_debug_get_cache_entry_list(s.fill_fn._torchdynamo_orig_callable.__code__)) == 1


def test_guards_option_surface():
    model = model32()
    full = sequential_step(model, compile=True, backend=torch._dynamo.testing.CompileCounter(), guards="full")
    assert sequential_generate(model, [1, 2, 3], max_new_tokens=4, step=full).tokens == naive_greedy(model, [1, 2, 3], 4)
    assert full.guards == "full" and full.cut_calls == full.guarded_calls == 0
    with pytest.raises(ValueError, match="guards must be one of"):
        sequential_step(model, compile=True, guards="off")
    with pytest.raises(ValueError, match="compiled step"):
        sequential_step(model, compile=False, guards="cut")
    with pytest.raises(ValueError, match="StepState"):
        Step(sequential_fn(model), "cpu", guards="cut")  # nothing to snapshot: refused, not run with guards skipped
    assert Step(sequential_fn(model), "cpu", backend=torch._dynamo.testing.CompileCounter()).guards == "full"
    state, cache = StepState(model), KVCache.for_model(model, max_len=8)
    assert state.take(cache) == state.keep(cache) != state.take(KVCache.for_model(model, max_len=8))


def test_environment_variable_turns_the_cut_on_and_a_bad_value_is_refused_at_first_use():
    """A misspelt SNLP_COMPILE_GUARDS raised at `import snlp.decode.steps` (so at any use of decoding, with a
    traceback): the import now works and the first step built refuses it in one ValueError naming the variable."""
    env = {k: v for k, v in os.environ.items() if k != "SNLP_COMPILE_GUARDS"}
    code = ("import torch; from snlp.decode import steps; from conftest import make_model; "
            "s = steps.sequential_step(make_model(n_layer=2), compile=True, backend='eager'); print(s.guards)")
    env["PYTHONPATH"] = os.pathsep.join((os.getcwd(), os.path.join(os.getcwd(), "tests")))
    for value, want in ((None, "full"), ("full", "full"), ("cut", "cut")):  # full guards unless asked for the cut
        out = subprocess.run([sys.executable, "-c", code], env=env if value is None else dict(env, SNLP_COMPILE_GUARDS=value),
                             capture_output=True, text=True)
        assert out.stdout.strip() == want, out.stderr
    bad = dict(env, SNLP_COMPILE_GUARDS="none")
    imported = subprocess.run([sys.executable, "-c", "import snlp.decode.steps, snlp.decode.generate"], env=bad,
                              capture_output=True, text=True)
    assert imported.returncode == 0, imported.stderr
    built = subprocess.run([sys.executable, "-c", code], env=bad, capture_output=True, text=True)
    assert built.returncode != 0 and "ValueError: SNLP_COMPILE_GUARDS must be one of cut, full, got 'none'" in built.stderr


def test_a_bad_environment_variable_is_one_cli_line_before_any_work(tmp_path, capsys, monkeypatch):
    """The CLI refuses a misspelt SNLP_* variable (exit 2, one line naming it and its values) before it reads a
    checkpoint: here a checkpoint that does not exist, whose error would otherwise come first."""
    from snlp.apps.cli import main
    from snlp.model.ops import WINDOW_KERNELS
    from snlp.runtime.checks import ENV_CHOICES

    assert ENV_CHOICES["SNLP_WINDOW_ATTENTION"][0] == WINDOW_KERNELS and ENV_CHOICES["SNLP_COMPILE_GUARDS"][0] == GUARD_MODES
    monkeypatch.setenv("SNLP_COMPILE_GUARDS", "bogus")
    out = tmp_path / "o"
    assert main(["generate", str(tmp_path / "missing"), "--json", str(out / "r.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["snlp generate: error: SNLP_COMPILE_GUARDS must be one of cut, full, got 'bogus' (unset it for full)"]
    assert not out.exists()
    monkeypatch.setenv("SNLP_COMPILE_GUARDS", "cut")
    monkeypatch.setenv("SNLP_WINDOW_ATTENTION", "flexx")
    assert main(["bench", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "snlp bench: error: SNLP_WINDOW_ATTENTION must be one of auto, banded, masked, flex, got 'flexx' (unset it for auto)"]


def test_cut_calls_in_two_threads_take_turns_and_leave_every_guard_on():
    """Thread A's decode step is held inside its graph (a backend that waits) while thread B calls a decode step of
    its own that would be cut, whose graph waits for A's call to end. dynamo's stance is one process-wide setting
    and set_stance restores what it found when built: B's cut call built while A's stance was on would restore
    "skip guards" after A's had restored the default, for good, and every later compiled call of the process would
    run its stale graph. The steps take turns (STANCE_LOCK): B runs after A, and guards stay on."""
    import threading

    import torch._dynamo.eval_frame as eval_frame

    waits = {}  # thread id -> what that thread's graph does first

    def waiting(gm, example_inputs):
        def run(*args):
            waits.get(threading.get_ident(), lambda: None)()
            return gm.forward(*args)
        return run

    models = [make_model(seed=seed, dtype=torch.float32, n_layer=2) for seed in (0, 1)]
    steps = [(step, step.new_cache(m, 1, 64)) for m in models
             for step in [sequential_step(m, compile=True, backend=waiting)]]
    for step, cache in steps:  # both built first (a registration anywhere moves every snapshot), then warmed:
        for _ in range(3):  # the next call of this shape and cache would be cut
            step(torch.tensor([[1, 2, 3, 4]]), cache)
    cut = [step.cut_calls for step, _ in steps]
    (a_in, a_go, a_done, b_in), errors = (threading.Event() for _ in range(4)), []

    def call(step, cache, first):
        try:
            waits[threading.get_ident()] = first
            step(torch.tensor([[1, 2, 3, 4]]), cache)
        except Exception as e:  # a thread's exception would not fail the test
            errors.append(e)

    def thread_a():
        call(*steps[0], lambda: (a_in.set(), a_go.wait(30)))
        a_done.set()

    a = threading.Thread(target=thread_a)
    b = threading.Thread(target=call, args=(*steps[1], lambda: (b_in.set(), a_done.wait(30))))
    a.start()
    try:
        assert a_in.wait(30)
        b.start()
        b_in.wait(2)  # B inside its graph while A is in its own: only without the lock
    finally:
        a_go.set()
        a.join()
        b.join()
    assert not errors
    assert [step.cut_calls for step, _ in steps] == [c + 1 for c in cut]
    assert not eval_frame._stance.skip_guard_eval_unsafe
    scale = [2.0]

    @torch.compile(backend="eager", fullgraph=True)
    def times(x):
        return x * scale[0]

    x = torch.ones(3)
    assert times(x).tolist() == [2.0] * 3
    scale[0] = 3.0
    assert times(x).tolist() == [3.0] * 3


def test_a_step_built_again_for_the_same_model_compiles_nothing(monkeypatch):
    """sequential_generate / snlp_generate with compile=True and no step= build a new step per call: its graphs are
    the first call's (one code object per model or runner, own_code), as before the guard cut; another model of
    the same shape still compiles its own."""
    cnt = torch._dynamo.testing.CompileCounter()
    monkeypatch.setattr(steps_mod, "compile_fullgraph",
                        lambda fn, device, **kw: torch.compile(fn, fullgraph=True, backend=cnt, **kw))
    model = model32()
    want = naive_greedy(model, [1, 2, 3], 5)
    assert sequential_generate(model, [1, 2, 3], max_new_tokens=5, compile=True).tokens == want
    first = cnt.frame_count
    assert first == 2
    assert sequential_generate(model, [1, 2, 3], max_new_tokens=5, compile=True).tokens == want
    assert cnt.frame_count == first
    eager = snlp_generate(model, [1, 2, 3], PLAN, max_new_tokens=5).tokens
    assert snlp_generate(model, [1, 2, 3], PLAN, max_new_tokens=5, compile=True).tokens == eager
    drafts = cnt.frame_count
    assert drafts == first + 2
    assert snlp_generate(model, [1, 2, 3], PLAN, max_new_tokens=5, compile=True).tokens == eager  # a new runner too
    assert cnt.frame_count == drafts
    other = make_model(seed=3, dtype=torch.float32, n_layer=4)
    assert sequential_generate(other, [1, 2, 3], max_new_tokens=5, compile=True).tokens == naive_greedy(other, [1, 2, 3], 5)
    assert cnt.frame_count == drafts + 2


def test_runners_of_two_plans_on_one_model_alternate_under_the_cut():
    """The snlp steps of one model share one code object (own_code), so the graphs of two plans sit in one cache,
    told apart by the guards that failed when the second compiled: alternating calls each equal their own eager
    runner, logit for logit."""
    model = model32()
    cnt = torch._dynamo.testing.CompileCounter()
    plans = ("3xF1-h0-K1", "2xF2-h0-K1")
    runners = [snlp.bind(model, p, check_finite=False) for p in plans]
    steps = [snlp_step(r, compile=True, backend=cnt) for r in runners]
    assert steps[0].fn._torchdynamo_orig_callable.__code__ is steps[1].fn._torchdynamo_orig_callable.__code__
    ids = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(4))
    caches = [s.new_cache(model, 1, s.cache_len(12 + s.slack)) for s in steps]
    for s, c in zip(steps, caches):
        s.prefill(ids[:, :4], c)
    for t in range(4, 11):
        for s, r, c in zip(steps, runners, caches):
            got, want = _call_vs_eager(s, snlp_fn(r), ids, c)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(s.cut_calls >= 5 for s in steps)

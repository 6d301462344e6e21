"""Static-shape KV-cached steps: the forwards decoding runs, optionally compiled whole (gpt-fast's recipe).

A decode loop calls one forward per token (sequential, an SNLP plan, the speculative drafter) or per round
(the verifier over B+1 positions), plus one prefill. Run eagerly that is hundreds of small ops per token;
compiled with `torch.compile(fullgraph=True)` (inductor: fused C++ on CPU, Triton + CUDA graphs with
mode="reduce-overhead" on CUDA) it is a few kernels, but only if the step's graph never changes and never
waits on the host. So a `Step` feeds the model
  - the positions as a tensor `pos` (T,) instead of the cache's Python-side length: K/V are written to
    those positions by one index_put_ and the WHOLE preallocated cache is attended under a causal/window mask built from
    `pos` (snlp.model.attend), so every decode step has the same shapes;
  - no host syncs: no token-range check (skipped under compile), no finiteness check (the runner is bound
    with check_finite=False, as the eager decode loops always bound theirs), no `.item()`
    (tests/decode/test_steps.py counts `aten::_local_scalar_dense` in a profile of a compiled step: 0);
  - bucketed cache sizes: a compiled step's cache is allocated at a power-of-two length (`cache_len`);
  - padded lengths: prefill pads the prompt to a multiple of `prefill_pad` (one graph per bucket, not per
    prompt length) and the verifier pads a short last round to the full block, so a run compiles a handful
    of graphs, once. Padding sits AFTER the real tokens, causal attention keeps it out of their outputs,
    and its K/V land past the cache length, i.e. in scratch the next step overwrites before reading
    (snlp.model.cache); the cache is allocated `slack` positions longer to hold it.
The Python side (length bookkeeping, room check) stays outside the compiled function, where it is free.
Compilation happens in `warm`, called by the decode loops before their timers start (and by a call with a
shape not compiled yet); `compile_s` accumulates its time so benchmarks report it apart from the timings.
"""

from __future__ import annotations

import copy
import inspect
import threading
import time
import types
import weakref
from typing import Callable

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from snlp.model.cache import KVCache, RowPositions
from snlp.method.surrogates import DiagN, Newton
from snlp.model.gpt import GPT
from snlp.method.solver import Runner
from snlp.model.ops import window_kernel
from snlp.runtime.checks import ENV_CHOICES, env_choice
from snlp.runtime.timing import sync

StepFn = Callable[[Tensor, Tensor, KVCache], Tensor]  # (idx (B, T), pos (T,), cache) -> logits (B, T, V)

PREFILL_PAD = 16  # prefill lengths are rounded up to a multiple of this: one compiled graph per bucket
MIN_CACHE = 64  # compiled steps get caches of a power-of-two length >= this: the cache size is a graph shape
RECOMPILE_LIMIT = 64  # dynamo's per-code-object limit (default 8): one graph per (step kind, shape) is expected

GUARD_MODES = ENV_CHOICES["SNLP_COMPILE_GUARDS"][0]
# torch.compiler.set_stance(skip_guard_eval_unsafe=True) exists in torch 2.11 and 2.13 (checked); an older torch
# without it gets full guards on every call
CAN_SKIP_GUARDS = "skip_guard_eval_unsafe" in inspect.signature(torch.compiler.set_stance).parameters


def default_guards() -> str:
    """The guard mode a compiled step gets without guards=: SNLP_COMPILE_GUARDS, "full" when unset. Read when a
    step is built, not at import: a misspelt value is a ValueError there (it would otherwise run as the default),
    while an import of snlp (and every library function that never builds a step) keeps working."""
    return env_choice("SNLP_COMPILE_GUARDS")


def sequential_fn(model: GPT, keep: int | None = None) -> StepFn:
    """The model's own forward as a static-shape step (`keep`: GPT.forward's; 0 for a prefill's, no logits)."""
    def step(idx: Tensor, pos: Tensor, cache: KVCache) -> Tensor:
        return model(idx, cache=cache, pos=pos, keep=keep)
    return step


def check_compilable(plan) -> None:
    """Raise a ValueError unless `plan` can run as ONE compiled graph: a `tol` plan decides on the host every
    iteration whether to stop, and (measured) dynamo refuses DiagN's probe torch.Generator created inside the
    solve and Newton's torch.func JVP ("opaque object created", "function marked as skipped")."""
    if plan.tol:
        raise ValueError(f"plan {plan} stops on a tolerance (tol), a host-side decision every iteration; a compiled "
                         f"forward needs a fixed K (drop -tol)")
    if isinstance(plan.surrogate, (DiagN, Newton)):
        raise ValueError(f"plan {plan}: the {plan.surrogate.token} surrogate does not compile into one graph (a probe "
                         f"generator / torch.func JVP inside the solve); compiled forwards support the idn, none and "
                         f"hcn surrogates; run this plan eagerly")


def compile_fullgraph(fn, device, **kw):
    """torch.compile as every compiled path here does it, gpt-fast style: one graph (fullgraph=True, so a graph
    break or host sync is an error instead of a silent slowdown) and, on CUDA, mode="reduce-overhead" (CUDA
    graphs: one launch per call). `kw` goes to torch.compile (e.g. dynamic=False)."""
    mode = "reduce-overhead" if torch.device(device).type == "cuda" else None
    return torch.compile(fn, fullgraph=True, mode=mode, **kw)


def snlp_fn(runner: Runner, keep: int | None = None) -> StepFn:
    """An SNLP runner's forward as a static-shape step (`keep`: Runner's; 0 for a prefill's, no logits). The runner
    must be bound with check_finite=False (its NaN/inf check reads the state back to the host) and its plan must
    compile (`check_compilable`)."""
    if runner.check_finite:
        raise ValueError("a static-shape step needs a runner bound with check_finite=False (snlp.bind(model, plan, "
                         "check_finite=False)): the NaN/inf check is a host sync; check the output outside the step")
    check_compilable(runner.plan)

    def step(idx: Tensor, pos: Tensor, cache: KVCache) -> Tensor:
        return runner(idx, cache=cache, pos=pos, keep=keep)
    return step


_OWN_CODES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {a step function's code: its copy}


def own_code(fn: StepFn, owner=None, kind: str = "step") -> StepFn:
    """`fn` as a function with a code object of its own. Dynamo keeps its compiled graphs per code object, and every
    closure sequential_fn / snlp_fn returns shares one: two models of one shape then share one cache of graphs, told
    apart only by guards, which the guard cut skips (StepState) but for those that failed at a recompile (torch 2.13
    keeps checking these under skip_guard_eval_unsafe), and every Step's graphs count against one recompile limit.
    With its own code object a Step's graphs are its own, and differ by the shapes of its calls only. The steps of
    one `owner` (the model of sequential_step and snlp_step) built from one function share one copy, so a step built
    anew for the same model and plan (`sequential_generate` / `snlp_generate(..., compile=True)` without `step=`
    build one per call) finds the graphs an earlier one compiled, after one guarded call, instead of compiling them
    all again (a new runner's weights pass the same guards); runners of other plans are told apart by the guards a
    recompile failed, which dynamo keeps checking under the cut. `kind` ("step" or "fill") keeps a step's fill
    function (the prefill's, no logits: the same Python function with keep=0 in its closure) in a cache of its own."""
    if not isinstance(fn, types.FunctionType):
        def call(idx: Tensor, pos: Tensor, cache: KVCache) -> Tensor:
            return fn(idx, pos, cache)
        fn = call
    codes = _OWN_CODES.setdefault(owner, {}) if owner is not None else {}
    code = codes.setdefault((fn.__code__, kind), fn.__code__.replace())
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class StepState:
    """What the guards of a compiled step's graphs protect and a caller can change between calls, as one tuple that
    is cheap to take and to compare (`take`): the guard cut (Step, guards="cut") runs a graph without evaluating
    dynamo's guards (about 1250 per sequential step: ~0.5 ms of host time on this CPU, 0.1-0.4 ms predicted on the
    lent GPUs' hosts, docs/records/2026-11-28-host-per-call.md) only while this tuple equals the one taken at the
    last call of the same shape that evaluated them. It holds
      - every parameter and buffer of the model, and the tensors of a runner's fused weights (and of the KV cache):
        object identity, address, dtype, device, shape, stride. A replaced Parameter, `p.data = t`, `.to()`,
        `.double()` and a runner's rebuild of its weights (Runner.current, run before every call) each change it;
        an in-place update changes nothing, and needs nothing: the graphs read the weights' storage. For an SNLP
        runner's step the model's parameters are left to Runner.current (it rebuilds the fused weights, a new
        object, when any parameter's address or version moved): the snapshot holds the rebuilt weights instead, so
        it costs a fifth of the sequential step's (a view of a parameter's storage with another shape, same address,
        is seen by neither);
      - the model's module tree (a parameter, buffer or submodule set on any module: watch_registrations), every
        module's class, number of attributes (a method patched on one instance adds one) and public attributes by
        identity (`training`, a layer's attention `window`, a norm's `eps`: traced as constants);
      - the attributes of the model and runner objects (by identity: a new config, plan, preheat or weights) and the
        config's field values (GPTConfig is a mutable dataclass read as constants while tracing; Plan is frozen);
      - global state dynamo guards on: grad / inference mode, autocast (enabled and dtype, on the CPU and the
        step's device), the default dtype, deterministic algorithms, and the window attention kernel
        (snlp.model.ops.set_window_kernel).
    The module and tensor lists are walked once (`scan`) and again after any mismatch."""

    def __init__(self, model: GPT, runner: Runner | None = None, device=None):
        self.model, self.runner = model, runner
        self.devices = tuple(sorted({"cpu", torch.device(device if device is not None else "cpu").type}))
        watch_registrations()
        self.scan()

    def scan(self) -> None:
        mods = list(self.model.modules())
        self.mods, self.registrations = mods, _REGISTRATIONS[0]
        # where a module keeps its parameters and buffers (torch.nn internals): the dicts that hold any are read on
        # every call, so a tensor put into one in place of another (`Module._apply` with overwritten parameters,
        # `load_state_dict(assign=True)`) is seen; a new name in any module is a registration (watch_registrations)
        self.tensor_dicts = [d for m in mods for d in (m._parameters, m._buffers) if d]
        if self.runner is not None:  # Runner.current, run before every call of its step (Step.before), rebuilds the
            # fused weights when any parameter's address or in-place version moved (a new weights object: its
            # identity and leaves are held below), and a replaced Parameter is a registration; the buffers stay
            self.tensor_dicts = [d for m in mods for d in (m._buffers,) if d]
        self.owners = [self.model] + ([self.runner] if self.runner is not None else [])
        # every module's own attributes, read as constants while tracing (a layer's attention window, a norm's eps,
        # a method patched on one instance): the number of each module's attributes (a new one: `m.forward = f`)
        # and the identity of each public one (a reassigned value, the `training` flag); torch.nn's own state lives
        # under `_` names
        self.attr_dicts = [vars(m) for m in mods]
        self.plain = [(d, k) for d in self.attr_dicts for k in d if not k.startswith("_")]
        self.weights, self.leaves = None, []

    def tensors(self, cache: KVCache) -> list:
        ts = [t for d in self.tensor_dicts for t in d.values() if t is not None]
        if self.runner is not None:
            if self.runner.weights is not self.weights:  # a rebuild makes a new weights object
                self.weights, self.leaves = self.runner.weights, runner_tensors(self.runner)
            ts += self.leaves
        ts += [cache.k, cache.v] + ([cache.ids] if cache.ids is not None else [])
        return ts

    def take(self, cache: KVCache) -> tuple:
        ts = self.tensors(cache)
        dev = self.devices
        return (_REGISTRATIONS[0], [id(v) for o in self.owners for v in vars(o).values()], list(map(type, self.mods)),
                list(map(len, self.attr_dicts)), [id(d.get(k)) for d, k in self.plain],
                tuple(vars(self.model.config).values()),
                list(map(id, ts)), list(map(Tensor.data_ptr, ts)), [t.dtype for t in ts], [t.device for t in ts],
                [t.shape for t in ts], [t.stride() for t in ts],
                torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(),
                torch.are_deterministic_algorithms_enabled(), window_kernel(),
                [torch.is_autocast_enabled(d) for d in dev], [torch.get_autocast_dtype(d) for d in dev])

    def keep(self, cache: KVCache) -> tuple:
        """A snapshot to compare later calls with: `take`, its config values copied (a list or dict field edited in
        place must differ from the copy)."""
        snap = self.take(cache)
        kept = Kept(snap[:5] + (copy.deepcopy(snap[5]),) + snap[5 + 1:])
        kept.held = [d.get(k) for d, k in self.plain]
        return kept


class Kept(tuple):
    """A kept snapshot (StepState.keep). It holds the module attribute values whose identities it compares: a value
    replaced later (`m.eps = 1e-3`) cannot be freed and its id then reused by the new value, which would compare
    equal."""


# dynamo's stance is one process-wide setting, and set_stance restores the stance it found when it was built: a step
# call in another thread during a cut call would run with its guards skipped, and two interleaved cut calls would leave
# the stance skipping guards for good. Every compiled step call holds this lock (uncontended: well under a µs), so
# steps in several threads take turns; other compiled code running in another thread meanwhile is not covered
# (SNLP_COMPILE_GUARDS=full there)
STANCE_LOCK = threading.RLock()

_REGISTRATIONS = [0]  # parameters, buffers and submodules set on any module since watch_registrations (StepState)


def watch_registrations() -> None:
    """Count, once per process, every parameter, buffer and submodule set on any torch module (torch.nn's global
    registration hooks: attribute assignment, register_*, ModuleList / Sequential item assignment): a StepState
    walks its module tree again after one, instead of on every call."""
    if _REGISTRATIONS[1:]:
        return

    def count(*_):
        _REGISTRATIONS[0] += 1
    _REGISTRATIONS.append([hook(count) for hook in (torch.nn.modules.module.register_module_parameter_registration_hook,
                                                    torch.nn.modules.module.register_module_buffer_registration_hook,
                                                    torch.nn.modules.module.register_module_module_registration_hook)])


def runner_tensors(runner: Runner) -> list:
    """Every tensor of a runner's fused weights (plain tensors, not parameters)."""
    w = runner.weights
    hc = list(vars(w.hc).values()) if getattr(w, "hc", None) is not None else []
    return [t for t in tree_leaves(list(vars(w).values()) + hc) if isinstance(t, Tensor)]


def mark_static(*tensors) -> None:
    """Tell CUDA graphs these tensors keep their address (the KV cache, fused weights): without it every
    replay would copy them into the graph's input buffers, i.e. stream the whole cache and weights per token."""
    for t in tensors:
        if isinstance(t, Tensor):
            torch._dynamo.mark_static_address(t)


class Step:
    """A KV-cached forward `(idx (B, T), cache) -> logits (B, T, V)` that advances the cache by T, run through
    the static-shape path (positions as a tensor) and, with `compile`, torch.compile(fullgraph=True) of it
    (mode="reduce-overhead", i.e. CUDA graphs, on CUDA; inductor's C++ on CPU). `pad_to` pads a call to a
    fixed length (the verifier's B+1); `prefill` pads to a multiple of `prefill_pad`. Logits are cloned out
    of CUDA-graph memory, which the next replay overwrites. `backend`: another torch.compile backend (e.g.
    torch._dynamo.testing.CompileCounter, which counts the graphs dynamo compiles without inductor's cost).

    `guards`: "full" (the default) evaluates dynamo's guards on every call. "cut" (a compiled step given a `state`;
    SNLP_COMPILE_GUARDS=cut makes it the default) evaluates them only when the step's `state` (StepState: the weights,
    cache, configs and global modes the guards protect) differs from its snapshot at the last guarded call of the
    same shape, and otherwise runs the graph under torch.compiler.set_stance(skip_guard_eval_unsafe=True). It is not
    the default because it saved no measurable time on the CPU once the snapshot covered every module's attributes
    (docs/records/2026-11-28-guard-cut.md) and its stance is process-wide; a GPU host may differ (the campaign's
    `host` part measures it). A torch without that stance gets "full". `cut_calls` / `guarded_calls` count the two
    paths."""

    # what the step computes, set by sequential_step / snlp_step: the forward of model `of_model`, sequential (`of_plan`
    # None) or the SNLP solve of plan `of_plan`; None for a step built from another function (not known, not checked)
    of_model, of_plan = None, None

    def __init__(self, fn: StepFn, device, compile: bool = True, prefill_pad: int = PREFILL_PAD, backend=None,
                 before: Callable[[], None] | None = None, state: StepState | None = None, guards: str | None = None,
                 owner=None, fill: StepFn | None = None):
        self.device = torch.device(device)
        self.before = before  # run on the host before every call, outside the graph (an SNLP runner's `current`)
        if not isinstance(prefill_pad, int) or prefill_pad < 1:
            raise ValueError(f"prefill_pad must be an integer >= 1 (got {prefill_pad!r})")
        if guards is not None and guards not in GUARD_MODES:
            raise ValueError(f"guards must be one of {', '.join(GUARD_MODES)} (got {guards!r})")
        if guards == "cut" and not (compile and state is not None):
            raise ValueError("guards='cut' needs a compiled step (compile=True) and the StepState its guards protect "
                             "(state=...; sequential_step / snlp_step pass it): an eager step evaluates no guards")
        self.prefill_pad, self.compiled, self.state = prefill_pad, compile, state
        self.slack = prefill_pad  # extra cache positions padding may write past the logical length
        self.compile_s, self._seen, self._pool = 0.0, set(), {}
        self._snaps, self.cut_calls, self.guarded_calls = {}, 0, 0
        if compile:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)

            def compiled(f: StepFn, kind: str) -> StepFn:
                f = own_code(f, owner, kind)  # this step's (and its model's other steps') graphs in a cache apart
                return compile_fullgraph(f, self.device, dynamic=False) if backend is None else \
                    torch.compile(f, fullgraph=True, dynamic=False, backend=backend)
            fn, fill = compiled(fn, "step"), fill if fill is None else compiled(fill, "fill")
        # fill: the same forward without the logits (keep=0), which prefills run: their logits are never read (the
        # prompt's last token starts the decode loop), and the head over T prompt positions costs as much as a
        # small model's layers. Its graphs are its own (kind "fill"); a Step given none prefills through fn.
        self.fn, self.fill_fn = fn, fill
        env = default_guards() if guards is None else None  # checked on every step built from it, eager too
        wanted = guards if guards is not None else (env if compile and state is not None else "full")
        self.guards = wanted if CAN_SKIP_GUARDS else "full"
        self.mode = "reduce-overhead" if compile and backend is None and self.device.type == "cuda" else None

    def __call__(self, idx: Tensor, cache: KVCache, pad_to: int | None = None, fill: bool = False) -> Tensor:
        B, T = idx.shape
        cache.check(B, T)
        if self.before is not None:
            self.before()
        n = self.padded(T, cache, pad_to)
        with torch.inference_mode():
            return self._run(idx, cache, T, n, fill)

    def _run(self, idx: Tensor, cache: KVCache, T: int, n: int, fill: bool = False) -> Tensor:
        B = idx.shape[0]
        if n > T:  # repeat the last token: positions after the real ones are scratch (module docstring)
            idx = torch.cat([idx, idx[:, -1:].expand(B, n - T)], 1)
        idx = self.graph_input(idx)  # laid out as the warm-up's (graph_input): the guards pass
        self.warm(cache, [n], fill)  # a shape not seen yet compiles here, timed into compile_s (a no-op otherwise)
        pos = self.graph_input(torch.arange(cache.length, cache.length + n, device=self.device))
        kind, fn = self.kind(fill)
        logits = self.call_fn(self.key(kind, cache, n), idx, pos, cache, fn)
        if self.mode == "reduce-overhead":
            logits = logits.clone()
        cache.advance(T)
        return logits[:, :T] if n > T else logits

    def kind(self, fill: bool) -> tuple[str, StepFn]:
        """The graph kind and function of a call: "fill" (no logits) for a prefill when the step has a fill function,
        else "step"."""
        return ("fill", self.fill_fn) if fill and self.fill_fn is not None else ("step", self.fn)

    def call_fn(self, key: tuple, idx: Tensor, pos: Tensor, cache: KVCache, fn: StepFn | None = None) -> Tensor:
        """The compiled function (`fn`, default the step's) on graph inputs, for a call of shape `key` (Step.key):
        with guards="cut", without evaluating dynamo's guards while the step's state equals its snapshot at the last
        guarded call of this shape; else with them (compiling a new graph where they fail) and a new snapshot taken.
        Every call holds STANCE_LOCK (see there)."""
        fn = self.fn if fn is None else fn
        if self.guards != "cut":
            with STANCE_LOCK:
                return fn(idx, pos, cache)
        kept = self._snaps.get(key)
        with STANCE_LOCK:
            if kept is not None and kept == self.state.take(cache):
                try:
                    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                        out = fn(idx, pos, cache)
                    self.cut_calls += 1
                    return out
                except RuntimeError as e:  # with several graphs dynamo still checks the guards that tell them apart,
                    if "skip_guard_eval_unsafe" not in str(e):  # and refuses to recompile under this stance: something
                        raise  # the snapshot does not hold changed; the call then runs with every guard (below)
            self.state.scan()  # a new parameter, buffer or submodule: walk the module tree again
            out = fn(idx, pos, cache)
            self._snaps[key] = self.state.keep(cache)
            self.guarded_calls += 1
            return out

    def new_cache(self, model: GPT, batch: int, max_len: int) -> KVCache:
        """An empty cache for a decode call through this step. With CUDA graphs the buffers of a shape are reused
        from call to call (a call's positions are all written before they are read, snlp.model.cache), so the
        graph's static cache address never changes and no later call re-records it; otherwise a new cache."""
        if self.mode != "reduce-overhead":
            return KVCache.for_model(model, batch=batch, max_len=max_len)
        w = model.wte.weight
        key = (id(model), batch, max_len, w.dtype, w.device)
        if key not in self._pool:
            self._pool[key] = KVCache.for_model(model, batch=batch, max_len=max_len)
        kept = self._pool[key]
        # a fresh length over the same (static-address) buffers, zeroed: masked attention still multiplies the
        # scratch past a call's positions by 0, and a NaN / inf an earlier call left there (a diverged drafter, an
        # fp16 overflow) would poison every later call (0 * NaN = NaN); a memset on the device, no host sync
        kept.k.zero_()
        kept.v.zero_()
        return KVCache(k=kept.k, v=kept.v, ids=kept.ids)

    def cache_len(self, n: int) -> int:
        """Cache length to allocate for n positions: the next power of two (>= MIN_CACHE). The cache's size is a
        static shape of the compiled graph, so exact sizes would recompile for every prompt / token budget;
        buckets cost at most 2x masked attention work and a handful of graphs."""
        return max(MIN_CACHE, 1 << (max(n, 1) - 1).bit_length())

    def padded(self, T: int, cache: KVCache, pad_to: int | None = None) -> int:
        """The length a call of T tokens runs at: pad_to when there is room for it in the cache, else T."""
        return T if pad_to is None else max(T, min(pad_to, cache.max_len - cache.length))

    def prefill_len(self, T: int) -> int:
        return -(-T // self.prefill_pad) * self.prefill_pad

    def prefill(self, idx: Tensor, cache: KVCache) -> Tensor:
        """Cache a prompt (B, T): padded up to a multiple of `prefill_pad`, so prompts of similar length share a
        graph. With a fill function (sequential_step / snlp_step) no logits are computed: (B, 0, V)."""
        return self(idx, cache, pad_to=self.prefill_len(idx.shape[1]), fill=True)

    def warm_prefill(self, cache: KVCache, T: int) -> float:
        """Compile the graph `prefill` runs for a prompt of T tokens (see `warm`); 0 tokens: nothing to compile."""
        return self.warm(cache, [self.prefill_len(T)], fill=True) if T > 0 else 0.0

    def graph_input(self, x: Tensor) -> Tensor:
        """`x` as every compiled call receives it: a fresh contiguous long inference tensor on the step's device.
        The graph's guards check dtype, strides and dispatch keys, so a warm-up with an expanded (stride 0) or
        non-inference tensor and a real call with a contiguous one would compile twice."""
        with torch.inference_mode():
            return x.to(device=self.device, dtype=torch.long).clone(memory_format=torch.contiguous_format)

    def key(self, kind, cache: KVCache, n: int) -> tuple:
        """What a compiled graph is specialised on: every static shape (batch, length, cache size) and, with CUDA
        graphs, the cache's buffer (a new address re-records the graph, so a fresh cache is warmed too)."""
        buf = (cache.k.data_ptr(), cache.v.data_ptr()) if self.mode == "reduce-overhead" else ()
        return (kind, cache.batch, n, cache.max_len, *buf)

    def ragged(self, idx: Tensor, pos: Tensor | RowPositions, cache: KVCache, fill: bool = False) -> Tensor:
        """A ragged batched call (snlp.decode.batch): idx (B, T) with row b at its own positions pos[b] (B, T);
        the cache's length is neither read nor advanced (the caller keeps every row's length). A new shape
        compiles here (into compile_s); `warm_ragged` does that before a decode loop's timers start. Of a
        RowPositions only the positions enter the graph (its span would change the shapes; `real` only serves
        `tol` plans, which do not compile)."""
        pos = self.graph_input(pos.pos if isinstance(pos, RowPositions) else pos)
        if self.before is not None:
            self.before()
        with torch.inference_mode():
            idx = self.graph_input(idx)
            self.warm_ragged(cache, pos, fill)
            kind, fn = self.kind(fill)
            logits = self.call_fn(self.key("ragged " + kind, cache, pos.shape[1]), idx, pos, cache, fn)
            return logits.clone() if self.mode == "reduce-overhead" else logits

    def ragged_fill(self, idx: Tensor, pos: Tensor | RowPositions, cache: KVCache) -> None:
        """A ragged call that only fills the cache (a batch's prefill): compiled, the fill graph (no logits) where
        the step has one, else the ragged graph with its logits unread."""
        self.ragged(idx, pos, cache, fill=True)

    def warm_ragged(self, cache: KVCache, pos: Tensor | RowPositions, fill: bool = False) -> float:
        """Compile the ragged graph (`fill`: the ragged prefill's, see `ragged_fill`) for positions of this shape
        (B, T). It runs at `pos`, which must be scratch (past every row's length): the real call writes there again
        before anything reads it. The inputs are laid out exactly as `ragged` lays them out (`graph_input`), so the
        real call compiles nothing new."""
        pos = self.graph_input(pos.pos if isinstance(pos, RowPositions) else pos)
        kind, fn = self.kind(fill)
        key = self.key("ragged " + kind, cache, pos.shape[1])
        if not self.compiled or key in self._seen:
            return 0.0
        sync(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.call_fn(key, self.graph_input(torch.zeros(pos.shape, dtype=torch.long, device=self.device)), pos,
                         cache, fn)
        sync(self.device)
        self._seen.add(key)
        dt = time.perf_counter() - t0
        self.compile_s += dt
        return dt

    def warm(self, cache: KVCache, lengths, fill: bool = False) -> float:
        """Compile the graphs for calls that will run at these (already padded, see `prefill_len`) lengths
        before anything is timed; returns the seconds spent. `fill`: the prefill's graphs (`warm_prefill`). They run
        on `cache` at positions from its current length WITHOUT advancing it: what they write lies past the length,
        i.e. scratch that the real calls overwrite before reading (snlp.model.cache)."""
        t = 0.0
        kind, fn = self.kind(fill)
        for n in lengths:
            key = self.key(kind, cache, n)  # every static shape of the graph: a new one compiles
            if not self.compiled or key in self._seen or not 1 <= n <= cache.max_len - cache.length:
                continue
            if self.before is not None:  # compile against the weights the real calls will read (only where a
                self.before()  # graph is built: every call runs `before` itself, and warms each step on the way)
            sync(self.device)
            t0 = time.perf_counter()
            with torch.inference_mode():  # as __call__ runs it: same guards, same graph
                idx = self.graph_input(torch.zeros(cache.batch, n, dtype=torch.long, device=self.device))
                pos = self.graph_input(torch.arange(cache.length, cache.length + n, device=self.device))
                self.call_fn(key, idx, pos, cache, fn)
            sync(self.device)
            t += time.perf_counter() - t0
            self._seen.add(key)
        self.compile_s += t
        return t


class EagerStep:
    """The plain eager KV-cached forward with the Step interface: attends over the valid positions only (no
    padding, no mask over the whole cache), which is what an eager CPU loop runs fastest."""

    compiled, compile_s, slack, prefill_pad = False, 0.0, 0, 1
    of_model, of_plan = None, None  # what the step computes (Step.of_model)

    def __init__(self, forward: Callable[[Tensor, KVCache], Tensor], fn: StepFn | None = None,
                 fill: Callable[[Tensor, KVCache], Tensor] | None = None, fill_ragged: StepFn | None = None):
        self.forward, self.fn = forward, fn  # fn: the positions-tensor forward that ragged batches run
        # fill / fill_ragged: forward / fn without the logits (keep=0), for prefills whose logits nobody reads
        self.fill, self.fill_ragged = fill or forward, fill_ragged or fn

    def ragged(self, idx: Tensor, pos: Tensor | RowPositions, cache: KVCache) -> Tensor:
        """A ragged batched call (see Step.ragged), eager: the cache's positions 0..span-1 (all of it without a
        span) are attended under per-row masks."""
        if self.fn is None:
            raise ValueError("this eager step has no positions-tensor forward (EagerStep(forward, fn=...)), which "
                             "batched decoding of prompts of different lengths needs")
        return self.fn(idx, pos, cache)

    def ragged_fill(self, idx: Tensor, pos: Tensor | RowPositions, cache: KVCache) -> None:
        """A ragged call that only fills the cache (the prefill of a batch): no logits are computed."""
        if self.fn is None:  # no positions-tensor forward: ragged's one-line refusal, not a call of None
            self.ragged(idx, pos, cache)
        self.fill_ragged(idx, pos, cache)

    def warm_ragged(self, cache: KVCache, pos: Tensor, fill: bool = False) -> float:
        return 0.0

    def warm_prefill(self, cache: KVCache, T: int) -> float:
        return 0.0

    def __call__(self, idx: Tensor, cache: KVCache, pad_to: int | None = None) -> Tensor:
        return self.forward(idx, cache)

    def prefill(self, idx: Tensor, cache: KVCache) -> Tensor:
        """Cache a prompt; its logits are not computed (every caller feeds the prompt's last token next): the
        logits of no position, (B, 0, V), on the model's device (an EagerStep given no `fill`: its forward's)."""
        return self.fill(idx, cache)

    def prefill_len(self, T: int) -> int:
        return T

    def cache_len(self, n: int) -> int:
        return n

    def new_cache(self, model: GPT, batch: int, max_len: int) -> KVCache:
        return KVCache.for_model(model, batch=batch, max_len=max_len)

    def warm(self, cache: KVCache, lengths) -> float:
        return 0.0


def check_eager_guards(compile: bool, kw: dict) -> None:
    if not compile and kw.get("guards") is not None:
        raise ValueError(f"guards={kw['guards']!r} applies to a compiled step (compile=True): an eager step evaluates "
                         f"no guards")


def sequential_step(model: GPT, compile: bool = False, **kw) -> Step | EagerStep:
    """The sequential model's cached forward: a compiled static-shape Step, or the eager forward."""
    check_eager_guards(compile, kw)
    if not compile:
        step = EagerStep(lambda idx, cache: model(idx, cache=cache), sequential_fn(model),
                         lambda idx, cache: model(idx, cache=cache, keep=0),
                         lambda idx, pos, cache: model(idx, cache=cache, pos=pos, keep=0))
    else:
        device = model.wte.weight.device
        step = Step(sequential_fn(model), device, state=StepState(model, device=device), owner=model,
                    fill=sequential_fn(model, keep=0), **kw)
    step.of_model = model
    return step


def snlp_step(runner: Runner, compile: bool = False, **kw) -> Step | EagerStep:
    """An SNLP runner's cached forward (bound with check_finite=False): compiled Step or the eager runner."""
    check_eager_guards(compile, kw)
    if not compile:  # the eager runner checks its weights are current on every call (Runner.current)
        step = EagerStep(runner, lambda idx, pos, cache: runner(idx, cache=cache, pos=pos),
                         lambda idx, cache: runner(idx, cache=cache, keep=0),
                         lambda idx, pos, cache: runner(idx, cache=cache, pos=pos, keep=0))
        step.of_model, step.of_plan = runner.model, runner.plan
        return step

    def before() -> None:  # the compiled graph cannot read version counters: rebuild stale fused weights here
        if runner.current() and step.mode == "reduce-overhead":
            mark_static_runner(runner)  # the rebuilt tensors have new addresses: CUDA graphs re-record once

    device = runner.model.wte.weight.device
    step = Step(snlp_fn(runner), device, before=before, state=StepState(runner.model, runner, device),
                owner=runner.model, fill=snlp_fn(runner, keep=0), **kw)
    if step.mode == "reduce-overhead":
        mark_static_runner(runner)
    step.of_model, step.of_plan = runner.model, runner.plan
    return step


def mark_static_runner(runner: Runner) -> None:
    """mark_static on every tensor of a runner's fused weights (they are plain tensors, not parameters, so
    CUDA graphs would otherwise copy them in on every replay)."""
    mark_static(*runner_tensors(runner))


SYNC_OP = "aten::_local_scalar_dense"  # the host read of a device value behind .item() / int() / bool()


def host_syncs(step: Step | EagerStep, cache: KVCache, T: int = 1, calls: int = 3) -> int:
    """Host syncs in `calls` calls of `step` on T tokens (it advances `cache`). On CUDA the calls run under
    torch.cuda.set_sync_debug_mode("error"), which raises on any synchronising op, so this returns 0 or raises;
    on CPU it counts aten::_local_scalar_dense (what every .item() / int() / bool() of a tensor ends in; one
    per read) in a torch.profiler trace (the same reads are what a CUDA sync would be). A compiled step must give 0 (tests/decode/test_steps.py; bench --decode --compile checks it)."""
    idx = torch.zeros(cache.batch, T, dtype=torch.long, device=cache.k.device)
    if cache.k.is_cuda:
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(calls):
                step(idx, cache)
        finally:
            torch.cuda.set_sync_debug_mode(prev)
        return 0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            step(idx, cache)
    return sum(e.count for e in prof.key_averages() if e.key == SYNC_OP)

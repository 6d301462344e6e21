"""snlp.train.muon.Muon against torch.optim.Muon and against torch's algorithm re-run in float64.

Tolerances come from the unit roundoff u of the Newton–Schulz dtype (2^-8 bf16, 2^-24 fp32): the
relative error of the parameter change after a few steps is at most K*u, K = 128. Five quintic NS
iterations amplify rounding (slope a = 3.44 at zero); on these shapes the observed error is <= 26u
in fp32 and <= 16u in bf16, so K leaves a margin for other BLAS summation orders while keeping
fp32 (K*u = 7.6e-6) three orders of magnitude below the bf16 error (~1e-2) it must beat.
"""

from __future__ import annotations

import copy
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from snlp.bench.launches import launches
from snlp.train.muon import Muon, emulated_dtype, warn_if_emulated

K = 128
ROOT = Path(__file__).resolve().parents[2]
U = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}


def reference_steps(p0, grads, lr, weight_decay, momentum, nesterov, adjust_lr_fn, coeffs=(3.4445, -4.7750, 2.0315),
                    ns_steps=5, eps=1e-7):
    """torch/optim/_muon.py's `_single_tensor_muon` written out in float64 (the code's lerp forms of the
    momentum, which equal the docstring's up to a scale the NS normalisation removes)."""
    p, buf = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64)
    A, B = p0.shape
    ratio = {None: math.sqrt(max(1, A / B)), "original": math.sqrt(max(1, A / B)),
             "match_rms_adamw": 0.2 * math.sqrt(max(A, B))}[adjust_lr_fn]
    a, b, c = coeffs
    for g in grads:
        g = g.double()
        buf = momentum * buf + (1 - momentum) * g
        u = (1 - momentum) * g + momentum * buf if nesterov else buf
        X = u.T if A > B else u
        X = X / max(X.norm().item(), eps)
        for _ in range(ns_steps):
            G = X @ X.T
            X = a * X + (b * G + c * G @ G) @ X
        O = X.T if A > B else X
        p = p * (1 - lr * weight_decay) - lr * ratio * O
    return p


def run_opt(opt_cls, p0, grads, **kw):
    p = torch.nn.Parameter(p0.clone())
    opt = opt_cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def rel_change_err(p, ref, p0):
    """|(p - p0) - (ref - p0)| / |ref - p0|: the error of the parameter change, not of p itself."""
    d_ref = ref - p0.double()
    return ((p.double() - p0.double()) - d_ref).norm().item() / d_ref.norm().item()


options = st.fixed_dictionaries({
    "shape": st.sampled_from([(8, 8), (24, 8), (8, 24), (16, 48), (40, 16)]),
    "lr": st.sampled_from([0.02, 0.1]),
    "weight_decay": st.sampled_from([0.0, 0.1]),
    "momentum": st.sampled_from([0.0, 0.9, 0.95]),
    "nesterov": st.booleans(),
    "adjust_lr_fn": st.sampled_from([None, "original", "match_rms_adamw"]),
    "seed": st.integers(0, 2 ** 16),
})


def _problem(o, steps=3):
    gen = torch.Generator().manual_seed(o["seed"])
    p0 = 0.05 * torch.randn(*o["shape"], generator=gen)
    grads = [torch.randn(*o["shape"], generator=gen) for _ in range(steps)]
    kw = {k: o[k] for k in ("lr", "weight_decay", "momentum", "nesterov", "adjust_lr_fn")}
    return p0, grads, kw


@settings(max_examples=25, deadline=None)
@given(options)
def test_bf16_is_bit_identical_to_torch_muon(o):
    """ns_dtype=bfloat16 reproduces torch.optim.Muon exactly: every other part of the step (momentum,
    nesterov, weight decay, adjust_lr_fn, coefficients, eps) is torch's."""
    p0, grads, kw = _problem(o)
    ours = run_opt(Muon, p0, grads, ns_dtype=torch.bfloat16, **kw)
    theirs = run_opt(torch.optim.Muon, p0, grads, **kw)
    assert torch.equal(ours, theirs)


@settings(max_examples=25, deadline=None)
@given(options)
def test_fp32_matches_torch_algorithm_to_fp32_rounding(o):
    """On CPU the default NS dtype is fp32: the step equals torch's algorithm (float64 re-run) to K*u_fp32,
    and the float64 re-run is torch's algorithm: torch.optim.Muon itself lies within K*u_bf16 of it."""
    p0, grads, kw = _problem(o)
    ref = reference_steps(p0, grads, **kw)
    assert rel_change_err(run_opt(torch.optim.Muon, p0, grads, **kw), ref, p0) <= K * U[torch.bfloat16]
    assert rel_change_err(run_opt(Muon, p0, grads, ns_dtype=torch.float32, **kw), ref, p0) <= K * U[torch.float32]


def check_train_muon(expected: torch.dtype) -> None:
    """`snlp train`'s block-matrix optimiser on CPU matches the float64 re-run of torch's algorithm to the
    rounding of `expected`, the NS dtype it must use (fp32: torch.optim.Muon's bf16 misses by ~1000x)."""
    from snlp.model import GPT, GPTConfig
    from snlp.train.config import TrainConfig
    from snlp.train.optim import build_optimizers

    model = GPT(GPTConfig.from_depth(2, aspect_ratio=16, head_dim=16, vocab_size=64, sequence_len=16))
    model.init_weights(seed=0)
    opts = build_optimizers(model, TrainConfig(out="unused", weight_decay=0.1))
    muon = [o for o in opts if isinstance(o, torch.optim.Muon)]
    assert len(muon) == 1
    params = [p for g in muon[0].param_groups for p in g["params"]]
    gen = torch.Generator().manual_seed(1)
    p0 = [p.detach().clone() for p in params]
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(2)]
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        muon[0].step()
    g0 = muon[0].param_groups[0]
    for i, p in enumerate(params):
        ref = reference_steps(p0[i], [gs[i] for gs in grads], lr=g0["lr"], weight_decay=g0["weight_decay"],
                              momentum=g0["momentum"], nesterov=g0["nesterov"], adjust_lr_fn=g0["adjust_lr_fn"])
        assert rel_change_err(p.detach(), ref, p0[i]) <= K * U[expected], (tuple(p.shape), expected)


def test_train_muon_on_this_cpu():
    """Here the NS dtype is bf16 where oneDNN has native bf16 GEMMs (torch's choice), else fp32."""
    check_train_muon(torch.bfloat16 if not emulated_dtype("cpu", torch.bfloat16) else torch.float32)


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@pytest.mark.skipif(not _x86(), reason="ONEDNN_MAX_CPU_ISA=AVX2 caps oneDNN on x86 only")
def test_train_muon_uses_fp32_where_bf16_is_emulated():
    """oneDNN capped at AVX2 (ONEDNN_MAX_CPU_ISA, oneDNN's own switch: an AVX2-only EPYC as far as bf16
    goes) has no native bf16 GEMM: emulated_dtype says so, the warning names bf16, and `snlp train`'s
    Muon orthogonalises in fp32
    (torch.optim.Muon stays in bf16 and runs ~20x slower there)."""
    code = "\n".join([
        "import sys, warnings, torch", "sys.path[:0] = sys.argv[1:]", "import test_muon as t",
        "from snlp.train.muon import emulated_dtype, warn_if_emulated",
        "assert emulated_dtype('cpu', torch.bfloat16)",
        "with warnings.catch_warnings(record=True) as w:",
        "    warnings.simplefilter('always')",
        "    warn_if_emulated('cpu', {torch.float32, torch.bfloat16}, 'snlp train')",
        "assert len(w) == 1 and str(w[0].message).startswith('snlp train: bfloat16 math is emulated'), w",
        "t.check_train_muon(torch.float32)"])
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    here = Path(__file__).resolve().parent  # this file's folder, and tests/ for conftest
    r = subprocess.run([sys.executable, "-c", code, str(here), str(here.parent)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_state_dict_interchangeable_with_torch_muon():
    """An optimizer.pt written by torch.optim.Muon (older checkpoints) resumes in snlp's Muon and vice versa."""
    gen = torch.Generator().manual_seed(0)
    p0, g1, g2 = (torch.randn(12, 20, generator=gen) for _ in range(3))
    p = torch.nn.Parameter(p0.clone())
    t = torch.optim.Muon([p], lr=0.02)
    p.grad = g1.clone()
    t.step()
    q = torch.nn.Parameter(p.detach().clone())
    ours = Muon([q], lr=0.02, ns_dtype=torch.bfloat16)
    ours.load_state_dict(copy.deepcopy(t.state_dict()))  # as through optimizer.pt: no shared buffers
    p.grad, q.grad = g2.clone(), g2.clone()
    t.step()
    ours.step()
    assert torch.equal(p, q)
    back = torch.optim.Muon([torch.nn.Parameter(q.detach().clone())], lr=0.02)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert torch.equal(back.state[back.param_groups[0]["params"][0]]["momentum_buffer"],
                       ours.state[q]["momentum_buffer"])


def test_bad_ns_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2))], ns_dtype=torch.int32)
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2))], ns_dtype="float32")


def test_emulated_dtype_follows_cpu_flags():
    """Without ONEDNN_MAX_CPU_ISA, bf16 is native on a CPU whose flags (/proc/cpuinfo, the kernel's view:
    an outside reference to oneDNN's own check) list avx512_bf16 or amx_bf16, and emulated on one that
    lists none of avx512_bf16, amx_bf16, avx_ne_convert; fp32 and CUDA are never flagged."""
    assert not emulated_dtype("cpu", torch.float32)
    assert not emulated_dtype("cuda", torch.bfloat16)
    info = Path("/proc/cpuinfo")
    if not info.is_file() or not _x86() or os.environ.get("ONEDNN_MAX_CPU_ISA"):
        pytest.skip("needs an x86 /proc/cpuinfo and no ONEDNN_MAX_CPU_ISA cap")
    flags = set()
    for line in info.read_text().splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    if flags & {"avx512_bf16", "amx_bf16"}:
        assert not emulated_dtype("cpu", torch.bfloat16)
    elif "avx_ne_convert" not in flags:  # (AVX-NE-CONVERT CPUs: oneDNN's avx2_vnni_2 may have bf16 GEMMs)
        assert emulated_dtype("cpu", torch.bfloat16)


def test_warning_names_the_emulated_dtype():
    """One warning, naming the dtype, exactly when some dtype is emulated; none for fp32 or on CUDA."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_emulated("cpu", {torch.float32}) is None
        assert warn_if_emulated("cuda", {torch.bfloat16}) is None
    if emulated_dtype("cpu", torch.bfloat16):
        with pytest.warns(RuntimeWarning, match="bfloat16 math is emulated"):
            msg = warn_if_emulated("cpu", {torch.float32, torch.bfloat16}, "snlp train")
        assert msg.startswith("snlp train: bfloat16") and "\n" not in msg
    else:
        assert warn_if_emulated("cpu", {torch.float32, torch.bfloat16}) is None


shapes = st.lists(st.sampled_from([(8, 8), (24, 8), (8, 24), (16, 48)]), min_size=1, max_size=6)


@settings(max_examples=20, deadline=None)
@given(options, shapes)
def test_stacked_update_is_torch_muon_per_matrix_to_fp32_rounding(o, shape_list):
    """Muon(stack=True) (snlp train's: the matrices of a shape updated together, one stacked Newton-Schulz) gives
    every matrix the update of torch's per-matrix algorithm (float64 re-run) to fp32 rounding, whatever the mix of
    shapes (square, tall, wide; several of a shape) and options."""
    gen = torch.Generator().manual_seed(o["seed"])
    kw = {k: o[k] for k in ("lr", "weight_decay", "momentum", "nesterov", "adjust_lr_fn")}
    p0 = [0.05 * torch.randn(*s, generator=gen) for s in shape_list]
    grads = [[torch.randn(*s, generator=gen) for s in shape_list] for _ in range(3)]
    params = [torch.nn.Parameter(p.clone()) for p in p0]
    opt = Muon(params, ns_dtype=torch.float32, stack=True, **kw)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    for i, p in enumerate(params):
        ref = reference_steps(p0[i], [gs[i] for gs in grads], **kw)
        assert rel_change_err(p.detach(), ref, p0[i]) <= K * U[torch.float32], shape_list[i]


def test_stacked_step_launches_per_shape_not_per_matrix():
    """The launches of a stacked Muon step (torch.profiler: leaf aten ops, a multi-tensor op once; see `launches`)
    barely grow with the number of matrices of a shape (the stack's copies); torch's per-matrix loop grows
    ~linearly with it."""
    from torch.profiler import ProfilerActivity, profile

    def ops(n_per_shape: int, stack: bool) -> int:
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in [(16, 16), (16, 48)] * n_per_shape]
        opt = Muon(params, lr=0.02, ns_dtype=torch.float32, stack=stack)
        for _ in range(2):  # the second step: buffers exist
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                opt.step()
        return launches(prof)

    stack2, stack8 = ops(2, stack=True), ops(8, stack=True)
    loop2, loop8 = ops(2, stack=False), ops(8, stack=False)
    assert loop8 > 3.5 * loop2 and stack8 < 1.5 * stack2 and stack8 < loop8 / 4, (stack2, stack8, loop2, loop8)

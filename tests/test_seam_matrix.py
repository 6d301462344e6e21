"""The seam-law matrix: every public entry point x input form x plan kind x treatment, drawn by hypothesis.

Each cell obeys ONE law: its output equals its reference, or the call is refused with a one-line ValueError that
names the combination. A cell that is neither is a defect. The references are written here:

  entry point                      reference
  -------------------------------  ------------------------------------------------------------------------------
  sequential_generate              a full-prefix argmax loop over model(idx) (no cache, no solver)
  speculative_generate (drafter=)  the same loop (speculative decoding is exact whatever the drafter drafts)
  jacobi_generate (verified)       the same loop
  snlp_generate, K >= C, forward   the same loop for M = 1; for M > 1 the loop over fused_forward (the fused model:
                                   snlp's fusion run chunk by chunk, not its solver)
  snlp_generate, K < C / tol       the same prompt run alone as a single prompt (a row never depends on its batch)
  bind / Runner                    IDN, M = 1, h0 / fwd (any K): the paper's iteration written out layer by layer
                                   below (naive_idn_logits); tol / DiagN / F2 / HCN: each row alone through a fresh
                                   unshared bind. Also after an in-place update of every parameter with no refresh,
                                   and for a second shared runner over another suffix bound in between
  evaluate                         a K >= C, M = 1 row equals the sequential row; a K < C row's PPL equals the
                                   exp(mean NLL) of the plan's logits on the protocol's windows
  run_decode_suite (bench)         its reference tokens are the argmax loop; every row it calls exact equals them
                                   (fp64), a K >= C plan with M > 1 (the fused model) is not called exact
  a diverging plan (blow-up model) snlp_generate (any form, greedy or sampled), jacobi verify=False: raise
                                   SNLPDivergenceError naming the step; speculative / verified jacobi: the argmax loop
  a model whose own forward is     every entry and form (sequential, snlp, speculative with the plan's forward or
  NaN/inf (a NaN weight)           a drafter, jacobi with or without a plan): raise NonFiniteModelError naming the
                                   model and generated token 1, never SNLPDivergenceError nor tokens read off NaN

Input forms: one prompt (list of ids), a (T,) tensor, a (1, T) tensor, a list of one, a ragged list, a (B, T) tensor.
Plan kinds: F1, F2 (M > 1), fwd init, tol (K < C), DiagN, HCN (mHC model), preheat, K >= C.
Treatments: eager / compiled (tests below; inductor is slow on 2 cores), shared / unshared weights, fp64 / fp32 /
bf16 / fp16, adaptive block, min_confidence, an EOS id, value embeddings / x0 residual / sliding windows, the window
kernel (masked reference / banded with stacks grouped by window: test_window_kernel_is_invisible_at_every_entry_point), nanochat-
snlp's parts on / off (NANOCHAT: the smear, whose decode-time state is the previous token's id in the KV cache; the
backout, which inside an SNLP suffix reads the iterate of the chunk holding the halfway layer; q/k scale 1.2; the
12-channel, 3-sigmoid value-embedding gate; with HCN cells also the static softmax-map mHC with a tau-0.05 Sinkhorn).

Precision of each claim: fp64: token for token, every cell. fp32 / bf16 / fp16: every token the cell produced is
within MARGIN[dtype] of the best logit of its reference run in fp64 on the same weights, teacher-forced along the
produced path (so every step is checked, and a near-tie may go either way), and the run stops at its budget or EOS;
cells whose reference is itself an snlp run (K < C) are claimed in fp64 only. A new entry point, input form, plan
kind or treatment adds its row here (CONTRIBUTING.md).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass

import pytest
import torch
from conftest import argmax_loop, blowup_model, examples, make_model, mhc_model
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from snlp import (SNLPDivergenceError, bind, evaluate, fused_forward, jacobi_generate, parallel_forward,
                  sequential_generate, snlp_generate, speculative_generate)
from snlp.decode.session import NonFiniteModelError
from snlp.eval.protocol import EvalConfig
from snlp.method.drafter import make_drafter
from snlp.method.plan import Plan
from snlp.method.preheat import CalibrateConfig, fit

pytestmark = pytest.mark.usefixtures("one_thread")

L = 8  # every plan below is over a depth-8 model (the tol-rows-versus-batch seam needs the depth)
PLANS = {
    "F1": "6xF1-h0-K1",
    "F2": "3xF2-h0-K1",
    "fwd": "6xF1-fwd-K1",
    "tol": "7xF1-h0-K6-tol:0.5",
    "diag": "6xF1-h0-K1-diag",
    "hcn": "6xF1-h0-K2-hcn",
    "preheat": "6xF1-preheat-K1",
    "exact": "6xF1-h0-K6",
    "exactF2": "3xF2-h0-K3",
}
ENTRIES = ("sequential", "snlp", "speculative", "drafter", "jacobi")
FORMS = ("one", "tensor1d", "tensor1T", "list1", "ragged", "tensorBT")
BATCH_FORMS = ("list1", "ragged", "tensorBT")
# bf16 / fp16 cells on the CPU: the claim under test is the dtype treatment itself, on models of width 16, where
# emulated bf16 (AVX2-only boxes) costs microseconds; nothing here picks a dtype for speed
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# how far below the best logit of an fp64 copy of the same weights a low-precision cell's token may be
MARGIN = {"fp32": 1e-3, "bf16": 0.3, "fp16": 0.1}
# nanochat-snlp's model parts (snlp.io.nanochat sets them on its checkpoints); the smear gate reads 24 channels
NANOCHAT = dict(smear=True, backout=True, qk_scale=1.2, ve_gate_channels=12, ve_gate_scale=3.0, n_embd=32)
NANOCHAT_MHC = dict(dynamic=False, hc_maps="softmax", hc_sinkhorn_iters=10, hc_sinkhorn_tau=0.05)


@dataclass(frozen=True)
class Cell:
    entry: str
    form: str
    kind: str
    dtype: str = "fp64"
    share: bool = False
    adaptive: bool = False
    min_confidence: float = 0.0
    block: int = 3


# ----------------------------------------------------------------------------- the references (no snlp decoding)
@torch.no_grad()
def near_argmax_path(ref_model, prompt: list[int], got: list[int], n: int, eos: int | list[int] | None,
                     delta: float) -> str | None:
    """None if every produced token is within `delta` of the largest logit of `ref_model` (an fp64 copy) given the
    prompt and the tokens produced before it, and the run stopped where it should (n tokens, or at EOS); else why
    not. Teacher-forced along the produced path, so a low-precision cell is checked at every step it took."""
    stops = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    if len(got) != n and not (got and got[-1] in stops):
        return f"{len(got)} tokens, neither the budget {n} nor ending at EOS {eos}"
    if stops & set(got[:-1]):
        return f"went past EOS {eos}"
    for i, tok in enumerate(got):
        logits = ref_model(torch.tensor([prompt + got[:i]]))[0, -1].double()
        gap = float(logits.max() - logits[tok])
        if gap > delta:
            return f"step {i}: token {tok} is {gap:.4f} below the best logit (allowed {delta})"
    return None


# ----------------------------------------------------------------------------- the cells
def refusals(cell: Cell) -> list[str]:
    """The combinations snlp refuses by design, each with the words its one-line error must contain (a cell that
    several rules refuse may name any one of them)."""
    plan, why = PLANS[cell.kind], []
    if cell.entry == "jacobi" and cell.form in BATCH_FORMS:
        why.append("jacobi")
    # DiagN probes read the cache at one start: a batch of several prompts is refused; speculative decoding runs a
    # list of one as a single prompt, snlp_generate does not
    several = cell.form in ("ragged", "tensorBT") or (cell.form == "list1" and cell.entry == "snlp")
    if cell.kind == "diag" and several and cell.entry != "sequential":
        why.append("batched decoding supports")
    if cell.share and cell.entry == "drafter":
        why.append("share_weights")
    if cell.share and "xF1" not in plan:
        why.append("M = 1")
    if cell.share and cell.kind == "hcn":
        why.append("mHC")
    return why


def model_for(kind: str, seed: int, cfg: dict):
    """The cell's model: mHC for HCN cells (nanochat-snlp's static softmax-map mHC with cfg["nanochat"]), else a
    plain one with cfg's switches; cfg["nanochat"] turns on nanochat-snlp's parts (NANOCHAT)."""
    cfg = dict(cfg)
    nano = NANOCHAT if cfg.pop("nanochat", False) else None
    if kind == "hcn":
        return mhc_model(seed=seed, n_layer=L, **({**NANOCHAT, **NANOCHAT_MHC} if nano else {}))
    return make_model(seed=seed, n_layer=L, **cfg, **(nano or {}))


def build(cell: Cell, seed: int, cfg: dict):
    """(model, prompts as lists, the call's prompt argument, preheat or None)."""
    dtype = DTYPES[cell.dtype]
    m = model_for(cell.kind, seed, cfg)
    gen = torch.Generator().manual_seed(seed)
    lens = {"ragged": [3, 15, 5], "tensorBT": [7, 7]}.get(cell.form, [6])
    prompts = [torch.randint(0, m.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    preheat = fit(m, CalibrateConfig(rank=4, batch=2, seq_len=16)) if cell.kind == "preheat" else None
    m = m.to(dtype)
    if preheat is not None:
        preheat = preheat.to("cpu", dtype)
    arg = {"one": lambda: prompts[0], "tensor1d": lambda: torch.tensor(prompts[0]),
           "tensor1T": lambda: torch.tensor([prompts[0]]), "list1": lambda: [prompts[0]], "ragged": lambda: prompts,
           "tensorBT": lambda: torch.tensor(prompts)}[cell.form]()
    return m, prompts, arg, preheat


def run(cell: Cell, m, arg, preheat, n: int, eos: int | None, drafter=None):
    plan = PLANS[cell.kind]
    kw = dict(max_new_tokens=n, eos_id=eos)
    if cell.entry == "sequential":
        return sequential_generate(m, arg, **kw)
    if cell.entry == "snlp":
        return snlp_generate(m, arg, plan, preheat=preheat, **kw)
    if cell.entry == "jacobi":
        return jacobi_generate(m, arg, plan, block=cell.block, preheat=preheat, **kw)
    return speculative_generate(m, arg, plan, block=cell.block, preheat=preheat, share_weights=cell.share,
                                adaptive=cell.adaptive, min_confidence=cell.min_confidence, drafter=drafter, **kw)


def rows_of(cell: Cell, out) -> list[list[int]]:
    if cell.form in BATCH_FORMS:
        assert isinstance(out, list) and len(out) >= 1, f"{cell}: a batch form returns one result per prompt"
        return [r.tokens for r in out]
    assert not isinstance(out, list), f"{cell}: a single prompt returns one result"
    return [out.tokens]


def reference_fn(cell: Cell, m):
    """The logits function (ids (1, T) -> logits) whose full-prefix argmax loop is the cell's outside reference, or
    None when the reference is the same prompt run alone (snlp K < C, tol, preheat)."""
    plan = Plan.parse(PLANS[cell.kind], L)
    if cell.entry in ("sequential", "speculative", "drafter", "jacobi"):
        return m
    if plan.iters >= plan.chunks and plan.order is None and not plan.tol and cell.kind != "preheat":
        # M = 1: the model itself; M > 1: the fused model of the plan (fused_forward runs its chunks one by one)
        return m if plan.fuse == 1 else (lambda idx: fused_forward(m, idx, plan))
    return None


settings_matrix = settings(max_examples=examples(40), deadline=None,
                           suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@st.composite
def cells(draw):
    entry = draw(st.sampled_from(ENTRIES))
    kind = draw(st.sampled_from(list(PLANS)))
    form = draw(st.sampled_from(FORMS))
    spec = entry in ("speculative", "drafter")
    cell = Cell(entry=entry, form=form, kind=kind, dtype=draw(st.sampled_from(list(DTYPES))),
                share=spec and draw(st.booleans()), adaptive=spec and draw(st.booleans()),
                min_confidence=draw(st.sampled_from([0.0, 0.5])) if spec else 0.0, block=draw(st.integers(1, 4)))
    if reference_is_snlp(cell):  # claimed in fp64 only (see the module docstring)
        cell = Cell(**{**cell.__dict__, "dtype": "fp64"})
    return cell


def reference_is_snlp(cell: Cell) -> bool:
    plan = Plan.parse(PLANS[cell.kind], L)
    return cell.entry == "snlp" and not (plan.iters >= plan.chunks and not plan.tol and cell.kind != "preheat")


@settings_matrix
@given(cell=cells(), seed=st.integers(0, 50), n=st.integers(1, 8),
       eos=st.one_of(st.none(), st.integers(0, 60), st.lists(st.integers(0, 60), min_size=1, max_size=3)),
       cfg=st.fixed_dictionaries({"value_embeds": st.booleans(), "x0_residual": st.booleans(),
                                  "window_pattern": st.sampled_from(["L", "SL"]), "nanochat": st.booleans()}))
def test_decoding_cell_equals_its_reference_or_is_refused(cell, seed, n, eos, cfg):
    note(f"cell: {cell}")
    m, prompts, arg, preheat = build(cell, seed, cfg)
    drafter = make_drafter(m, PLANS[cell.kind]) if cell.entry == "drafter" and cell.kind != "hcn" else None
    if cell.entry == "drafter" and drafter is None:  # the drafter itself is refused for mHC models
        with pytest.raises(ValueError, match="mHC"):
            make_drafter(m, PLANS[cell.kind])
        return
    why = refusals(cell)
    if why:
        with pytest.raises(ValueError) as err:
            run(cell, m, arg, preheat, n, eos, drafter)
        msg = str(err.value)
        assert "\n" not in msg.strip(), f"{cell}: the refusal is not one line: {msg}"
        assert any(re.search(re.escape(w), msg, re.I) for w in why), f"{cell}: refused for another reason: {msg}"
        return
    rows = rows_of(cell, run(cell, m, arg, preheat, n, eos, drafter))
    used = prompts if cell.form in ("ragged", "tensorBT") else prompts[:1]
    assert len(rows) == len(used)
    m64 = None if cell.dtype == "fp64" else copy.deepcopy(m).double()  # the same weights in fp64
    for p, got in zip(used, rows):
        if m64 is not None:  # low precision: a near-argmax of the reference in fp64 at every step taken
            why = near_argmax_path(reference_fn(cell, m64), p, got, n, eos, MARGIN[cell.dtype])
            assert why is None, f"{cell}: {why}"
            continue
        fn = reference_fn(cell, m)
        if fn is None:  # K < C: the same prompt alone, as a single prompt
            alone = Cell(**{**cell.__dict__, "form": "one"})
            assert got == run(alone, m, p, preheat, n, eos, drafter).tokens, f"{cell}: row != its single-prompt run"
        else:
            ref = argmax_loop(fn, p, n, eos)
            assert got == ref, f"{cell}: {got} != reference {ref}"


@pytest.mark.parametrize("seed", [3, 5, 6])
def test_tol_rows_do_not_depend_on_the_batch(seed):
    """A tol row must not depend on its batch, as fixed cells: a tol plan with K < C, prompts of 3 and 15 tokens, a
    depth-8 fp64 model (the seeds whose row 0 froze at another iteration in the batch than alone on a6631c2)."""
    m = make_model(seed=seed, n_layer=8)
    gen = torch.Generator().manual_seed(seed)
    a, b = (torch.randint(0, m.config.vocab_size, (k,), generator=gen).tolist() for k in (3, 15))
    plan = "7xF1-h0-K6-tol:0.5"
    alone = snlp_generate(m, a, plan, max_new_tokens=10).tokens
    assert snlp_generate(m, [a], plan, max_new_tokens=10)[0].tokens == alone
    assert snlp_generate(m, [a, b], plan, max_new_tokens=10)[0].tokens == alone
    assert snlp_generate(m, [b, a], plan, max_new_tokens=10)[1].tokens == alone


# ----------------------------------------------------------------------------- a diverging plan
DIVERGING_ENTRIES = ("snlp", "snlp-sampled", "speculative", "drafter", "jacobi", "jacobi-unverified")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("entry", DIVERGING_ENTRIES)
def test_a_diverging_plan_raises_or_equals_its_reference(entry, form):
    """A plan whose solve turns NaN/inf: the blow-up model (tests/conftest.py; its sequential forward is finite, the
    exact-Newton step of 8xF1-h0-K1-newton overflows). Newton plans cannot batch (refused as in the matrix), so the
    batch forms of snlp_generate take the same model in fp16, whose own sequential forward overflows (8xF1-h0-K1):
    there the error names the model (NonFiniteModelError), not the plan.
    Law: where the tokens are the plan's own (snlp_generate, greedy or sampled; Jacobi with verify=False) the call
    raises SNLPDivergenceError naming the plan and the generated token whose logits were NaN/inf; it emitted the
    argmax of NaN logits (token 0) before (rev-harness finding 2). Where the model verifies (speculative decoding with
    the plan's forward or a drafter, verified Jacobi) the output equals the full-prefix argmax loop: diverged drafts
    cost speed only. Any other outcome is a defect; the flag rides on the decode loop's own host read."""
    several = form in ("ragged", "tensorBT") or (form == "list1" and entry.startswith("snlp"))
    m, plan = blowup_model(61, sequence_len=64), "8xF1-h0-K1-newton"
    if several and entry.startswith("snlp"):
        m, plan = m.half(), "8xF1-h0-K1"
    lens = {"ragged": [3, 9, 5], "tensorBT": [6, 6]}.get(form, [6])
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 61, (k,), generator=gen).tolist() for k in lens]
    arg = {"one": lambda: prompts[0], "tensor1d": lambda: torch.tensor(prompts[0]),
           "tensor1T": lambda: torch.tensor([prompts[0]]), "list1": lambda: [prompts[0]], "ragged": lambda: prompts,
           "tensorBT": lambda: torch.tensor(prompts)}[form]()
    kw = dict(max_new_tokens=5)
    call = {"snlp": lambda: snlp_generate(m, arg, plan, **kw),
            "snlp-sampled": lambda: snlp_generate(m, arg, plan, temperature=1.0, seed=0, **kw),
            "speculative": lambda: speculative_generate(m, arg, plan, block=3, **kw),
            "drafter": lambda: speculative_generate(m, arg, plan, block=3, drafter=make_drafter(m, plan), **kw),
            "jacobi": lambda: jacobi_generate(m, arg, plan, block=3, **kw),
            "jacobi-unverified": lambda: jacobi_generate(m, arg, plan, block=3, verify=False, **kw)}[entry]
    refused = "jacobi" if entry.startswith("jacobi") and form in BATCH_FORMS else \
        "batched decoding supports" if form in ("ragged", "tensorBT") and not entry.startswith("snlp") else None
    if refused:
        with pytest.raises(ValueError, match=refused):
            call()
    elif entry in ("snlp", "snlp-sampled") and several:  # fp16: the model's own forward overflows too (in its
        # layers: the sequential trace, the outside reference, is NaN/inf), so the error names the model, not the plan
        assert not torch.isfinite(m.hidden_states(torch.tensor([prompts[0]]))[-1]).all()
        with pytest.raises(NonFiniteModelError, match=r"the logits of generated token 1 of prompt\(s\) "
                           r"\[0(, 1)*(, 2)*\] contain NaN/inf under plan 8xF1-h0-K1, and so do the model's own: its "
                           r"layers' .*the plan is not the cause") as err:
            call()
        assert "\n" not in str(err.value)
    elif entry in ("snlp", "snlp-sampled", "jacobi-unverified"):
        rows = r"contain NaN/inf"
        with pytest.raises(SNLPDivergenceError, match=rf"SNLP plan {plan} diverged while decoding: the logits of "
                                                      rf"generated token 1 .*{rows}") as err:
            call()
        assert "\n" not in str(err.value)
    else:
        out = call()
        got = [r.tokens for r in out] if isinstance(out, list) else [out.tokens]
        assert got == [argmax_loop(m, p, 5) for p in prompts[:len(got)]] and len(got) == (len(prompts) if several
                                                                                             or form == "list1" else 1)


NONFINITE_ENTRIES = ("sequential", "sequential-sampled", "snlp", "speculative", "speculative-sampled", "drafter",
                     "jacobi", "jacobi-plan", "jacobi-unverified")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("entry", NONFINITE_ENTRIES)
def test_a_model_whose_own_forward_is_nonfinite_raises_naming_the_model(entry, form):
    """A NaN weight in a middle layer (set after building, as after loading): the model's own forward is NaN from
    the first generated token on. Law: every entry and form raises NonFiniteModelError (one line, generated token 1,
    the model named as the cause), never SNLPDivergenceError and never tokens read off NaN logits (greedy read token
    0 before, on every path but SNLP decoding's); Jacobi refuses batch forms as in the matrix."""
    m, plan = blowup_model(61, sequence_len=64), "8xF1-h0-K1"
    with torch.no_grad():
        m.blocks[3].mlp.c_proj.weight[0, 0] = float("nan")
    lens = {"ragged": [3, 9, 5], "tensorBT": [6, 6]}.get(form, [6])
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 61, (k,), generator=gen).tolist() for k in lens]
    arg = {"one": lambda: prompts[0], "tensor1d": lambda: torch.tensor(prompts[0]),
           "tensor1T": lambda: torch.tensor([prompts[0]]), "list1": lambda: [prompts[0]], "ragged": lambda: prompts,
           "tensorBT": lambda: torch.tensor(prompts)}[form]()
    kw, hot = dict(max_new_tokens=5), dict(temperature=0.8, seed=0)
    call = {"sequential": lambda: sequential_generate(m, arg, **kw),
            "sequential-sampled": lambda: sequential_generate(m, arg, **hot, **kw),
            "snlp": lambda: snlp_generate(m, arg, plan, **kw),
            "speculative": lambda: speculative_generate(m, arg, plan, block=3, **kw),
            "speculative-sampled": lambda: speculative_generate(m, arg, plan, block=3, **hot, **kw),
            "drafter": lambda: speculative_generate(m, arg, plan, block=3, drafter=make_drafter(m, plan), **kw),
            "jacobi": lambda: jacobi_generate(m, arg, None, block=3, **kw),
            "jacobi-plan": lambda: jacobi_generate(m, arg, plan, block=3, **kw),
            "jacobi-unverified": lambda: jacobi_generate(m, arg, plan, block=3, verify=False, **kw)}[entry]
    if entry.startswith("jacobi") and form in BATCH_FORMS:
        with pytest.raises(ValueError, match="jacobi"):
            call()
        return
    with pytest.raises(NonFiniteModelError, match=r"generated token 1\b") as err:
        call()
    msg = str(err.value)
    assert not isinstance(err.value, SNLPDivergenceError) and "\n" not in msg
    assert ("the plan is not the cause" if entry in ("snlp", "jacobi-unverified") else
            "the model's own forward (not an SNLP plan)") in msg


def test_finite_snlp_decoding_is_unchanged_by_the_check():
    """The same blow-up model with an exact plan (K >= C, M = 1: the model itself) decodes as the full-prefix argmax
    loop, alone and in a ragged batch, and its sampled tokens are those of a naive loop drawing softmax(logits / T)
    of the full forward from a generator seeded seed + i for prompt i (snlp.decode.batch's rule)."""
    m = blowup_model(61, sequence_len=64).double()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 61, (k,), generator=gen).tolist() for k in (3, 8)]
    plan = "8xF1-h0-K8"
    assert snlp_generate(m, prompts[0], plan, max_new_tokens=6).tokens == argmax_loop(m, prompts[0], 6)
    assert [r.tokens for r in snlp_generate(m, prompts, plan, max_new_tokens=6)] == [argmax_loop(m, p, 6)
                                                                                     for p in prompts]

    def naive_sample(p, seed, n=6, t=2.0):
        g, ids = torch.Generator().manual_seed(seed), list(p)
        for _ in range(n):
            with torch.no_grad():
                probs = torch.softmax(m(torch.tensor([ids]))[0, -1].float() / t, -1)
            ids.append(int(torch.multinomial(probs, 1, generator=g)))
        return ids[len(p):]

    rows = snlp_generate(m, prompts, plan, max_new_tokens=6, temperature=2.0, seed=5)
    assert [r.tokens for r in rows] == [naive_sample(p, 5 + i) for i, p in enumerate(prompts)]
    assert snlp_generate(m, prompts[1], plan, max_new_tokens=6, temperature=2.0, seed=9).tokens == \
        naive_sample(prompts[1], 9)


# ----------------------------------------------------------------------------- bind / Runner
RUNNER_KINDS = ("F1", "fwd", "tol", "diag", "exact", "F2", "hcn")


@torch.no_grad()
def naive_idn_logits(m, idx, plan: Plan):
    """The paper's IDN iteration for M = 1, forward order, written out layer by layer with the model's own layers:
    G_c(H) = H_c - f_c(H_{c-1}), A = I, so H_c <- f_c(H_{c-1}^old) + (H_{c-1}^new - H_{c-1}^old), H_{-1} = h_S fixed;
    init h0: every H_c = h_S; fwd: H_c = f_c(h_S). nanochat's backout (the paper's _logits): the head reads
    H_{C-1} - backout_lambda * h_b with h_b layer b = L // 2's output, its iterate H_{b-S} when b >= S."""
    S, C = plan.prefix_len(L), plan.chunks
    ctx = m.embed(idx)
    h_s, hb = ctx.x0, None
    for l in range(S):  # the exact prefix; hb: the backout layer's output if the prefix holds it
        h_s = m.layer(l, h_s, ctx)
        hb = h_s if l == L // 2 else hb
    f = lambda c, x: m.layer(S + c, x, ctx)  # noqa: E731
    H = [h_s] * C if plan.init == "h0" else [f(c, h_s) for c in range(C)]
    for _ in range(plan.iters):
        new = []
        for c in range(C):
            out = f(c, h_s if c == 0 else H[c - 1])
            new.append(out if c == 0 else out + new[c - 1] - H[c - 1])
        H = new
    if not m.config.backout:
        return m.head(H[-1])
    b = L // 2
    return m.head(H[-1] - m.backout_lambda * (H[b - S] if b >= S else hb))


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(RUNNER_KINDS), share=st.booleans(), other=st.sampled_from(["2xF1-h0-K1", "7xF1-h0-K2", None]),
       seed=st.integers(0, 50), ve=st.booleans(), nano=st.booleans())
def test_runner_cell_equals_a_fresh_bind(kind, share, other, seed, ve, nano):
    """A (B, T) batch through a runner equals its reference (F1 / fwd / K >= C: the IDN iteration written out above;
    tol / DiagN / F2 / HCN: each row alone through a fresh unshared bind), before and after an in-place update of
    EVERY parameter with no refresh (shared) or with refresh (unshared), with a second shared runner over another
    suffix bound in between (and checked too); or sharing is refused with a one-line error (M > 1, mHC). `nano`:
    nanochat-snlp's parts (smear, backout read from the iterate, q/k scale, its VE gate; its mHC for HCN)."""
    m = model_for(kind, seed, {"value_embeds": ve, "nanochat": nano})
    plan = PLANS[kind]
    idx = torch.randint(0, m.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(seed))
    if share and (kind in ("F2", "hcn")):
        with pytest.raises(ValueError, match="M = 1|mHC"):
            bind(m, plan, share_weights=True)
        return

    def expected(model, p):
        pp = Plan.parse(p, L)
        if pp.fuse == 1 and pp.surrogate.token == "idn" and not pp.tol and pp.order is None and pp.init != "preheat":
            return naive_idn_logits(model, idx, pp)
        fresh = bind(model, p)
        return torch.cat([fresh(idx[i:i + 1]) for i in range(idx.shape[0])])

    with torch.no_grad():
        runner = bind(m, plan, share_weights=share)
        second = bind(m, other, share_weights=True) if other is not None and share else None
        for _ in range(2):  # as bound, then after an in-place update of every parameter (gates and norms included)
            torch.testing.assert_close(runner(idx), expected(m, plan), rtol=1e-6, atol=1e-6)  # fp32 logits
            if second is not None:
                torch.testing.assert_close(second(idx), expected(m, other), rtol=1e-6, atol=1e-6)
            gen = torch.Generator().manual_seed(seed + 1)
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)
            if not share:
                runner.refresh()


# ----------------------------------------------------------------------------- evaluate
@pytest.mark.parametrize("nano", [False, True])
def test_evaluate_cells_equal_their_references(nano):
    """evaluate: the K >= C, M = 1 row equals the sequential row; a K < C row's PPL equals exp(mean NLL) of the
    plan's own teacher-forced logits on every window of the protocol (seq_len + 1 tokens each, non-overlapping);
    `nano`: with nanochat-snlp's parts (NANOCHAT)."""
    m = make_model(seed=3, n_layer=L, **(NANOCHAT if nano else {}))
    val = torch.randint(0, m.config.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    cfg = EvalConfig(seq_len=16, max_tokens=64, prompts=2, prompt_len=4, gen_tokens=4, warmup=0, runs=1,
                     time_tokens=2, emb=False, progress=False, batch=2)
    seq, exact, approx = evaluate(m, val, ["6xF1-h0-K6", "6xF1-h0-K1"], cfg)
    assert exact.ppl == pytest.approx(seq.ppl, rel=1e-12) and exact.top1 == seq.top1 and exact.ar_match == 1.0
    with torch.no_grad():
        wins = torch.stack([val[i * 16:(i + 1) * 16 + 1] for i in range(64 // 16)])
        for fn, rec in ((m, seq), (lambda x: parallel_forward(m, x, "6xF1-h0-K1"), approx)):
            logp = torch.log_softmax(fn(wins[:, :-1]).double(), -1)
            nll = -logp.gather(-1, wins[:, 1:, None]).mean()
            assert rec.ppl == pytest.approx(math.exp(float(nll)), rel=1e-6), rec.plan  # fp32 logits, fp32 sums


# ----------------------------------------------------------------------------- compiled cells (inductor: few, small)
@pytest.mark.parametrize("kind", ["tol", "diag"])
def test_compiled_cells_that_cannot_compile_are_refused(kind):
    m = make_model(seed=1, n_layer=L)
    for call in (lambda: snlp_generate(m, [1, 2, 3], PLANS[kind], max_new_tokens=2, compile=True),
                 lambda: speculative_generate(m, [[1, 2, 3], [4]], PLANS[kind], max_new_tokens=2, compile=True)):
        with pytest.raises(ValueError, match="compile|batched decoding supports") as err:
            call()
        assert "\n" not in str(err.value)


def test_compiled_cells_equal_their_references():
    """compile=True (one cell: inductor costs minutes on 2 cores; tests/decode/test_steps.py has the others): a ragged
    speculative batch with shared weights and an adaptive block equals the full-prefix argmax loop, in fp64."""
    m = make_model(seed=2, n_layer=L)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, m.config.vocab_size, (k,), generator=gen).tolist() for k in (3, 9)]
    rows = speculative_generate(m, prompts, PLANS["F1"], block=3, max_new_tokens=6, compile=True, share_weights=True,
                                adaptive=True)
    assert [r.tokens for r in rows] == [argmax_loop(m, p, 6) for p in prompts]


# ----------------------------------------------------------------------------- the decode suite (snlp bench --suite decode)
@settings(max_examples=examples(4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["F1", "F2", "fwd", "exact", "exactF2"]), seed=st.integers(0, 50),
       sizes=st.sampled_from([(1,), (1, 3), (2,)]), drafter=st.booleans())
def test_decode_suite_exact_rows_equal_the_argmax_loop(kind, seed, sizes, drafter, tmp_path_factory):
    """The decode suite's rows (bench entry point): its reference is the argmax loop, every row it calls exact (snlp
    sequential, speculative with the model's own or an adapted drafter, an SNLP plan with K >= C and M = 1) gives
    the reference's tokens in fp64, and a K >= C plan with M > 1 (the fused model) is not called exact."""
    from snlp.bench.decode_suite import DecodeSuiteConfig, run_decode_suite
    from snlp.io.drafter import save_drafter

    m = make_model(seed=seed, n_layer=L)
    path = None
    if drafter:
        d = make_drafter(m, PLANS["F1"])
        with torch.no_grad():
            for p in d.model.blocks[d.suffix_start:].parameters():
                p.add_(0.05 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(seed)))
        path = tmp_path_factory.mktemp("drafter")
        save_drafter(path, d)
    cfg = DecodeSuiteConfig(quick=True, device="cpu", dtype="float64", batch_sizes=sizes, prompt_len=5, new_tokens=6,
                            plans=(PLANS[kind],), blocks=(3,), rounds=1, warmup=0, transformers=False, seed=seed,
                            drafter=None if path is None else str(path))
    res = run_decode_suite(cfg, model=m)
    assert res.reference == [argmax_loop(m, p, 6) for p in res.prompts]
    snlp_row = next(r for r in res.rows if r.method == "snlp snlp")
    assert snlp_row.exact == (kind == "exact")
    assert ("snlp speculative (drafter)" in {r.method for r in res.rows}) == drafter
    for r in res.rows:
        if r.library == "snlp" and r.exact:
            assert r.matches_sequential, r


def test_compiled_nanochat_cell_equals_its_reference():
    """compile=True with nanochat-snlp's parts: the static-shape steps write the ids at their (B, T) positions and
    read each predecessor back for the smear, and the backout reads the suffix iterate; a ragged speculative batch
    with shared weights and an SNLP K >= C batch equal the full-prefix argmax loop, in fp64."""
    m = make_model(seed=4, n_layer=L, **NANOCHAT)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, m.config.vocab_size, (k,), generator=gen).tolist() for k in (3, 9)]
    want = [argmax_loop(m, p, 6) for p in prompts]
    rows = speculative_generate(m, prompts, PLANS["F1"], block=3, max_new_tokens=6, compile=True, share_weights=True)
    assert [r.tokens for r in rows] == want
    assert [r.tokens for r in snlp_generate(m, prompts, PLANS["exact"], max_new_tokens=6, compile=True)] == want


# ----------------------------------------------------------------------------- the window kernel (a treatment)
@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["F1", "F2", "fwd", "hcn", "diag", "exact", "exactF2", "tol"]), seed=st.integers(0, 50),
       nano=st.booleans(), pattern=st.sampled_from(["S", "SSSL", "SL"]), share=st.booleans())
def test_window_kernel_is_invisible_at_every_entry_point(kind, seed, nano, pattern, share):
    """snlp.model.ops.set_window_kernel("banded") (sliding windows through query blocks that attend their w + b keys;
    fused stacks grouped by window) against "masked" (every score under one mask, the reference) at prompts long
    enough for the band to skip keys: the sequential forward, a runner (shared weights where allowed), parallel_forward
    and SNLP decoding give the masked kernel's results (fp64 weights); speculative decoding gives the argmax loop."""
    from snlp.model.ops import set_window_kernel

    cfg = {"window_pattern": pattern, "short_window": 4, "sequence_len": 96, "nanochat": nano}
    m = model_for(kind, seed, cfg if kind != "hcn" else {"nanochat": nano})
    if kind == "hcn":  # the mHC cell's model, with windows
        m = mhc_model(seed=seed, n_layer=L, window_pattern=pattern, short_window=4, sequence_len=96,
                      **({**NANOCHAT, **NANOCHAT_MHC} if nano else {}))
    plan = PLANS[kind]
    share = share and kind in ("F1", "fwd", "exact")
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, m.config.vocab_size, (2, 48), generator=gen)
    prompts = [idx[0, :40].tolist(), idx[1, :37].tolist()]
    prev = set_window_kernel("masked")
    try:
        with torch.no_grad():
            ref = (m(idx), bind(m, plan)(idx), parallel_forward(m, idx, plan))
            ref_dec = [r.tokens for r in snlp_generate(m, prompts, plan, max_new_tokens=4)] if kind != "diag" else None
            set_window_kernel("banded")
            got = (m(idx), bind(m, plan, share_weights=share)(idx), parallel_forward(m, idx, plan))
            for a, b in zip(got, ref):  # fp64 states, fp32 logits (the head's softcap runs in fp32)
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            if ref_dec is not None:
                assert [r.tokens for r in snlp_generate(m, prompts, plan, max_new_tokens=4)] == ref_dec
            spec = speculative_generate(m, prompts, PLANS["F1"], block=3, max_new_tokens=4)
            assert [r.tokens for r in spec] == [argmax_loop(m, p, 4) for p in prompts]
    finally:
        set_window_kernel(prev)

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
                                   unshared bind. Also after an update of every parameter (in place, or new storage:
                                   `p.data = t`) with no refresh, shared or not, and for a second shared runner over
                                   another suffix bound in between
  evaluate                         a K >= C, M = 1 row equals the sequential row; a K < C row's PPL equals the
                                   exp(mean NLL) of the plan's logits on the protocol's windows
  run_decode_suite (bench)         its reference tokens are the argmax loop; every row it calls exact equals them
                                   (fp64), a K >= C plan with M > 1 (the fused model) is not called exact
  self-distillation replies        the argmax loop of each prompt, stopped at its first stop id (fp64; prompts
  (snlp adapt --self-distill)      sorted and batched by length, returned in order)
  a diverging plan (blow-up model) snlp_generate (any form, greedy or sampled), jacobi verify=False: raise
                                   SNLPDivergenceError naming the step; speculative / verified jacobi: the argmax loop
  a model whose own forward is     every entry and form (sequential, snlp, speculative with the plan's forward or
  NaN/inf (a NaN weight)           a drafter, jacobi with or without a plan): raise NonFiniteModelError naming the
                                   model and generated token 1, never SNLPDivergenceError nor tokens read off NaN
  static mHC (every entry point)   its dynamic twin: the same weights with random phi and gates alpha = 0, whose H
                                   are the maps of the biases computed per token (no GPT.static_hc, no transfer_scan)
  window wider than every T        the same weights with full causal attention (window_pattern "L")
  window 0 on every layer          each token run alone (RoPE rotates its query and key alike)
  windows T - 2 .. T + 1 of the    the same weights with attention written out (naive_attend: an explicit softmax
  prompts, 0, 1, 2, full, mixed    over each query's window, fp64): forward and K >= C plans under every window
                                   kernel; sequential, K >= C SNLP, speculative, Jacobi decoding: its argmax loop
  a converted transformers model   transformers itself: its logits, the argmax loop over its forward, its generate
  with sliding windows             (sliding_window >= 3); export: from_pretrained of the written directory
  a causal plan (-causal: the       a copy of the model whose suffix windows are full (-1) in its config, run with the
  suffix's windows dropped)        same plan without the option: bind / parallel_forward bit for bit, SNLP decoding
                                   its argmax loop (K = 1 from h0, K >= C), evaluate its PPL; speculative, drafter=,
                                   jacobi: the model's loop; refused in one line where the suffix has no window
  every model part x greedy        sequential, speculative (plan's forward, adaptive, a full / LoRA drafter with its
  decoding (part_models: 1-5       own suffix), verified Jacobi: the argmax loop; snlp_generate: the argmax loop of the
  layers, GQA 1-4, windows 0 to    model (fused model for M > 1) from exact_iters() on without tol, of parallel_forward
  wide, VE, x0, smear, backout,    where the solve evaluates the suffix at most once (K = 1 from h0 with idn / none /
  softcap 0 / > 0, rope bases,     hcn, K = 0), of the full-suffix copy for causal plans; unverified Jacobi, exact
  tied embeddings, norm weights,   M = 1 plan: the argmax loop; prompts of 1-20 tokens, a ragged batch's row, max_len
  mHC 1-3 streams, Llama parts)    ending the budget; GenerateResult.stop and round counters against the tokens
  compiled (compile=True,          the eager cell's reference (COMPILED: plan forward, sequential, SNLP and
  torch.compile(runner))           speculative decoding on static mHC, nanochat-snlp's parts, mixed widths)
  tokens with NaN embeddings       greedy speculative decoding (either drafter): the argmax loop of the model, raising
  (poison drafts, speculative)     NonFiniteModelError exactly where the loop's logits turn non-finite; sampled: the
                                   model's law (tests/decode/test_nonfinite_blame.py)
  sampled decoding (sequential,    each row of a batch equals the same prompt decoded alone with its own seed (seed
  snlp, speculative, drafter=;     + its index), fp64; a self-speculative round's verdict is drawn per row on the
  temperature > 0, top_k, top_p)   device, from the row's own generator (the law of the draws, filtered or not,
                                   against transformers' warpers and a naive forward: tests/decode/test_decode.py,
                                   tests/decode/test_sampling.py); greedy (temperature 0), every entry and input form:
                                   a seed, top_k or top_p refused in one line naming it (nothing is drawn)
  repetition_penalty (every entry, the penalised argmax loop: each id already in the row's sequence (its own prompt,
  form and plan kind; sampled      no padding) has its logit divided by p where positive, multiplied where negative, as
  rows too)                        transformers' RepetitionPenaltyLogitsProcessor (tokens against transformers'
                                   generate: tests/decode/test_repetition_penalty.py); K < C: the prompt alone with
                                   the penalty; sampled: each batch row equals its own run with seed + i
  repetition_penalty in the bench  the suite's reference is the penalised argmax loop, which every exact snlp row
  (run_decode_suite, --decode)     and every transformers row (generate(repetition_penalty=p)) equals (fp64); a
                                   generation_config's penalty by default: tests/bench/test_decode_suite.py,
                                   tests/io/test_generation_config.py
  repetition_penalty in the layer- the single-process decoder with the same penalty and seed (snlp, sequential,
  parallel decoder (1, 2 ranks)    speculative; greedy: the penalised loop): tests/dist/test_dist_penalty.py;
  and its bench (distributed_      every decode of every mode gets it, a converted --ckpt's generation_config value
  benchmark, --distributed         by default, named in the header and rows: tests/dist/test_seams_dist.py
  --decode)
  a budget beyond memory (every    refused in one line naming the KV cache's size, before any forward (max_new_tokens
  decoding entry and input form)   whose cache needs more than the device has free: KVCache.for_model; a layer-
                                   parallel rank's window cache too: tests/dist/test_seams_dist.py)
  the training step's regulariser  the CE over all B rows + lambda x a fresh regulariser call (its own trace) on the
  on a row fraction (snlp train /  first ceil(F B) rows and their valid mask, gradients included (fp64; IDN, HCN, DiagN,
  sft --reg-rows F)                the SNLP-forward SFT step); refused: F outside (0, 1], an F that leaves no row
  the logits' dtype (forward,      max(model dtype, fp32): fp32 for fp32 / bf16 / fp16 models, fp64 for an fp64 model
  keep=, a cache, head(solve),     (whose logits equal the head written out in fp64 to 1e-12); the layer-parallel
  bind, parallel_forward, fused_   runner's solve(...).logits and pipeline_forward the same (one gloo rank)
  forward, the decode steps)

Input forms: one prompt (list of ids), a (T,) tensor, a (1, T) tensor, a list of one, a ragged list, a (B, T) tensor,
a (T,) numpy array, a (B, T) numpy array.
Plan kinds: F1, F2 (M > 1), fwd init, tol (K < C), DiagN, HCN (mHC model), HCN with tol, preheat, K >= C; causal
(fixed cells: test_causal_plan_cells_equal_the_full_suffix_copy).
Treatments: eager / compiled (tests below; inductor is slow on 2 cores), compiled steps with dynamo's guards cut
(guards="cut", SNLP_COMPILE_GUARDS=cut) or evaluated on every call (guards="full", the default: test_guard_cut_cells_equal_the_argmax_loop), shared / unshared weights, fp64 / fp32 /
bf16 / fp16, adaptive block, min_confidence, read_every (sequential / snlp steps queued per host read), a repetition
penalty (test_repetition_penalty_cell_equals_the_penalised_loop_or_is_refused, fp64; fp32 / bf16 / fp16:
test_low_precision_repetition_penalty_cell_is_a_near_argmax_of_the_penalised_fp64_loop), an EOS id, value embeddings / x0 residual / sliding windows, the window
kernel (masked reference / banded with stacks grouped by window: test_window_kernel_is_invisible_at_every_entry_point /
flex, FlexAttention in compiled graphs: test_flex_window_kernel_is_invisible_at_every_entry_point), nanochat-
snlp's parts on / off (NANOCHAT: the smear, whose decode-time state is the previous token's id in the KV cache; the
backout, which inside an SNLP suffix reads the iterate of the chunk holding the halfway layer; q/k scale 1.2; the
12-channel, 3-sigmoid value-embedding gate; with HCN cells also the static softmax-map mHC with a tau-0.05 Sinkhorn),
older nanochat's bf16 RoPE tables on / off (rope_bf16, drawn in the decoding cells: every path reads GPT.rotary).
Window widths (WINDOWS): one width tiled ("SL"), width 1, a width wider than T, and widths 0 / 1 / 2 / 3 / 5 / wider
than T / full mixed per layer. mHC of the HCN cells (MHC): dynamic or static (sigmoid maps; with NANOCHAT the softmax
maps).

Precision of each claim: fp64: token for token, every cell. fp32 / bf16 / fp16: every token the cell produced is
within MARGIN[dtype] of the best logit of its reference run in fp64 on the same weights, teacher-forced along the
produced path (so every step is checked, and a near-tie may go either way), and the run stops at its budget or EOS;
cells whose reference is itself an snlp run (K < C) are claimed in fp64 only. A new entry point, input form, plan
kind or treatment adds its row here (CONTRIBUTING.md).
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import argmax_loop, blowup_model, examples, make_model, mhc_model
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

from snlp import (GPT, GPTConfig, SNLPDivergenceError, bind, evaluate, fused_forward, jacobi_generate, parallel_forward,
                  sequential_generate, snlp_generate, speculative_generate)
from snlp.decode.batch import is_batch
from snlp.decode.session import NonFiniteModelError
from snlp.eval.protocol import EvalConfig
from snlp.method.drafter import make_drafter
from snlp.method.plan import Plan
from snlp.method.surrogates import DiagN, Newton
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
    "hcntol": "6xF1-h0-K3-hcn-tol:0.5",
    "preheat": "6xF1-preheat-K1",
    "exact": "6xF1-h0-K6",
    "exactF2": "3xF2-h0-K3",
    "whole": "8xF1-h0-K3",  # S = 0: every layer in the suffix, iterated from h0 (the short-chain GPU drafter)
}
ENTRIES = ("sequential", "snlp", "speculative", "drafter", "jacobi")
FORMS = ("one", "tensor1d", "tensor1T", "list1", "ragged", "tensorBT", "numpy1d", "numpyBT")
BATCH_FORMS = ("list1", "ragged", "tensorBT", "numpyBT")
SEVERAL = ("ragged", "tensorBT", "numpyBT")  # the forms that hold more than one prompt


def as_form(prompts: list[list[int]], form: str):
    """The generation entries' prompt argument in one of FORMS, from the prompts as lists (one prompt for the
    single-prompt forms, all of them for the batch forms)."""
    return {"one": lambda: prompts[0], "tensor1d": lambda: torch.tensor(prompts[0]),
            "tensor1T": lambda: torch.tensor([prompts[0]]), "list1": lambda: [prompts[0]], "ragged": lambda: prompts,
            "tensorBT": lambda: torch.tensor(prompts), "numpy1d": lambda: np.array(prompts[0]),
            "numpyBT": lambda: np.array(prompts)}[form]()


# bf16 / fp16 cells on the CPU: the claim under test is the dtype treatment itself, on models of width 16, where
# emulated bf16 (AVX2-only boxes) costs microseconds; nothing here picks a dtype for speed
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# how far below the best logit of an fp64 copy of the same weights a low-precision cell's token may be
MARGIN = {"fp32": 1e-3, "bf16": 0.3, "fp16": 0.1}
# nanochat-snlp's model parts (snlp.io.nanochat sets them on its checkpoints); the smear gate reads 24 channels
NANOCHAT = dict(smear=True, backout=True, qk_scale=1.2, ve_gate_channels=12, ve_gate_scale=3.0, n_embd=32)
NANOCHAT_MHC = dict(dynamic=False, hc_maps="softmax", hc_sinkhorn_iters=10, hc_sinkhorn_tau=0.05)
MHC_KINDS = ("hcn", "hcntol")  # the plan kinds that run on an mHC model
# mHC variants of the HCN cells: input-dependent H (dynamic), or learned constants (static: GPT.static_hc's one
# batched Sinkhorn per forward, the solver's constant A through transfer_scan); with NANOCHAT, nanochat-snlp's static
# softmax-map mHC (NANOCHAT_MHC)
MHC = {"dynamic": dict(dynamic=True), "static": dict(dynamic=False)}
# the window widths of the cells (left context per layer, -1 = full causal; every prompt + budget here is <= 32
# tokens): one width tiled as "SL" (the last layer is always full), width 1 on every layer but the last, a width
# wider than any sequence (the full causal function, taken through the window path), and widths mixed per layer:
# 0 (each token sees itself only), 1, 2, 3, 5, wider than T, and full, in an order that puts different widths in
# one fused stack of F2 / F3 plans
WINDOWS = {"L": dict(window_pattern="L"), "SL": dict(window_pattern="SL", short_window=3),
           "S1": dict(window_pattern="S", short_window=1), "wide": dict(window_pattern="S", short_window=64),
           "mixed": dict(layer_windows=[1, 2, 5, 100, -1, 3, 0, -1])}


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
    read_every: int | None = None  # sequential / snlp: decode steps queued per host read


# ----------------------------------------------------------------------------- the references (no snlp decoding)
@torch.no_grad()
def near_argmax_path(ref_model, prompt: list[int], got: list[int], n: int, eos: int | list[int] | None,
                     delta: float, penalty: float = 1.0) -> str | None:
    """None if every produced token is within `delta` of the largest logit of `ref_model` (an fp64 copy) given the
    prompt and the tokens produced before it, and the run stopped where it should (n tokens, or at EOS); else why
    not. Teacher-forced along the produced path, so a low-precision cell is checked at every step it took.
    `penalty`: the logits compared are penalised as transformers' repetition penalty does (conftest.argmax_loop with `penalty`) by the
    prompt and the tokens before it."""
    stops = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    if len(got) != n and not (got and got[-1] in stops):
        return f"{len(got)} tokens, neither the budget {n} nor ending at EOS {eos}"
    if stops & set(got[:-1]):
        return f"went past EOS {eos}"
    for i, tok in enumerate(got):
        logits = ref_model(torch.tensor([prompt + got[:i]]))[0, -1].double()
        if penalty != 1.0:
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[prompt + got[:i]] = True
            logits = torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
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
    several = cell.form in SEVERAL or (cell.form == "list1" and cell.entry == "snlp")
    if cell.kind == "diag" and several and cell.entry != "sequential":
        why.append("batched decoding supports")
    if cell.share and cell.entry == "drafter":
        why.append("share_weights")
    if cell.share and "xF1" not in plan:
        why.append("M = 1")
    if cell.share and cell.kind in MHC_KINDS:
        why.append("mHC")
    return why


def model_for(kind: str, seed: int, cfg: dict):
    """The cell's model: mHC for HCN cells (cfg["hc"]: an MHC variant, dynamic by default; with cfg["nanochat"]
    nanochat-snlp's static softmax-map mHC), else a plain one with cfg's switches; cfg["nanochat"] turns on
    nanochat-snlp's parts (NANOCHAT); cfg["windows"] names the window widths (WINDOWS; default: make_model's)."""
    cfg = dict(cfg)
    nano = NANOCHAT if cfg.pop("nanochat", False) else None
    hc = MHC[cfg.pop("hc", "dynamic")]
    cfg.update(WINDOWS[cfg.pop("windows")] if "windows" in cfg else {})
    if kind in MHC_KINDS:  # mHC has no x0 residual
        keep = {k: v for k, v in cfg.items() if k != "x0_residual"}
        return mhc_model(seed=seed, n_layer=L, **{**hc, **keep, **({**NANOCHAT, **NANOCHAT_MHC} if nano else {})})
    return make_model(seed=seed, n_layer=L, **cfg, **(nano or {}))


def build(cell: Cell, seed: int, cfg: dict):
    """(model, prompts as lists, the call's prompt argument, preheat or None)."""
    dtype = DTYPES[cell.dtype]
    m = model_for(cell.kind, seed, cfg)
    gen = torch.Generator().manual_seed(seed)
    lens = {"ragged": [3, 15, 5], "tensorBT": [7, 7], "numpyBT": [7, 7]}.get(cell.form, [6])
    prompts = [torch.randint(0, m.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    preheat = fit(m, CalibrateConfig(rank=4, batch=2, seq_len=16)) if cell.kind == "preheat" else None
    m = m.to(dtype)
    if preheat is not None:
        preheat = preheat.to("cpu", dtype)
    arg = as_form(prompts, cell.form)
    return m, prompts, arg, preheat


def run(cell: Cell, m, arg, preheat, n: int, eos: int | None, drafter=None, on_tokens=None, penalty: float = 1.0):
    plan = PLANS[cell.kind]
    kw = dict(max_new_tokens=n, eos_id=eos, on_tokens=on_tokens)
    if penalty != 1.0:
        kw.update(repetition_penalty=penalty)
    if cell.entry == "sequential":
        return sequential_generate(m, arg, read_every=cell.read_every, **kw)
    if cell.entry == "snlp":
        return snlp_generate(m, arg, plan, preheat=preheat, read_every=cell.read_every, **kw)
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
                min_confidence=draw(st.sampled_from([0.0, 0.5])) if spec else 0.0, block=draw(st.integers(1, 4)),
                read_every=draw(st.sampled_from([None, 1, 3])) if entry in ("sequential", "snlp") else None)
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
                                  "windows": st.sampled_from(list(WINDOWS)), "hc": st.sampled_from(list(MHC)),
                                  "nanochat": st.booleans(), "rope_bf16": st.booleans()}))
def test_decoding_cell_equals_its_reference_or_is_refused(cell, seed, n, eos, cfg):
    note(f"cell: {cell}")
    m, prompts, arg, preheat = build(cell, seed, cfg)
    drafter = make_drafter(m, PLANS[cell.kind]) if cell.entry == "drafter" and cell.kind not in MHC_KINDS else None
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
    used = prompts if cell.form in SEVERAL else prompts[:1]
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


@settings(max_examples=examples(25), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(cell=cells(), seed=st.integers(0, 50), n=st.integers(4, 12), penalty=st.sampled_from([0.5, 1.05, 1.3, 2.0]),
       eos=st.one_of(st.none(), st.integers(0, 10)),
       cfg=st.fixed_dictionaries({"value_embeds": st.booleans(), "windows": st.sampled_from(list(WINDOWS)),
                                  "hc": st.sampled_from(list(MHC)), "nanochat": st.booleans(),
                                  "vocab_size": st.just(11)}))  # a small vocabulary: repeats inside one round
def test_repetition_penalty_cell_equals_the_penalised_loop_or_is_refused(cell, seed, n, penalty, eos, cfg):
    """repetition_penalty at every entry point, input form and plan kind (fp64): each row equals the penalised
    argmax loop of its reference (a batch row penalised by its own prompt only, a speculative verifier at each draft
    by the drafts before it), or the same prompt decoded alone with the penalty where the reference is an snlp run
    (K < C); the combinations refused without a penalty are refused with one, for the same reason."""
    cell = Cell(**{**cell.__dict__, "dtype": "fp64"})
    note(f"cell: {cell}, penalty {penalty}")
    m, prompts, arg, preheat = build(cell, seed, cfg)
    drafter = make_drafter(m, PLANS[cell.kind]) if cell.entry == "drafter" and cell.kind not in MHC_KINDS else None
    assume(not (cell.entry == "drafter" and drafter is None))  # mHC drafters are refused by make_drafter itself
    why = refusals(cell)
    if why:
        with pytest.raises(ValueError) as err:
            run(cell, m, arg, preheat, n, eos, drafter, penalty=penalty)
        assert any(re.search(re.escape(w), str(err.value), re.I) for w in why), f"{cell}: {err.value}"
        return
    rows = rows_of(cell, run(cell, m, arg, preheat, n, eos, drafter, penalty=penalty))
    used = prompts if cell.form in SEVERAL else prompts[:1]
    assert len(rows) == len(used)
    fn = reference_fn(cell, m)
    for p, got in zip(used, rows):
        if fn is None:  # K < C: the same prompt alone, as a single prompt
            alone = Cell(**{**cell.__dict__, "form": "one"})
            assert got == run(alone, m, p, preheat, n, eos, drafter, penalty=penalty).tokens, \
                f"{cell}: row != its single-prompt run"
        else:
            ref = argmax_loop(fn, p, n, eos, penalty)
            assert got == ref, f"{cell}: {got} != penalised reference {ref}"


@settings(max_examples=examples(15), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(cell=cells(), dtype=st.sampled_from(["fp32", "bf16", "fp16"]), seed=st.integers(0, 50), n=st.integers(4, 10),
       penalty=st.sampled_from([0.5, 1.05, 1.3, 2.0]), eos=st.one_of(st.none(), st.integers(0, 10)),
       cfg=st.fixed_dictionaries({"value_embeds": st.booleans(), "windows": st.sampled_from(list(WINDOWS)),
                                  "nanochat": st.booleans(), "vocab_size": st.just(11)}))
def test_low_precision_repetition_penalty_cell_is_a_near_argmax_of_the_penalised_fp64_loop(cell, dtype, seed, n,
                                                                                          penalty, eos, cfg):
    """repetition_penalty in fp32 / bf16 / fp16 at every entry point, input form and plan kind whose reference is
    not an snlp run: every token is within MARGIN[dtype] x max(p, 1/p) of the best PENALISED logit of the fp64
    copy's forward, teacher-forced along the produced path (the penalty scales a logit's rounding error by p or
    1/p), and the run stops at its budget or EOS; the refused combinations are refused for the same reason."""
    cell = Cell(**{**cell.__dict__, "dtype": dtype})
    assume(not reference_is_snlp(cell))
    note(f"cell: {cell}, penalty {penalty}")
    m, prompts, arg, preheat = build(cell, seed, cfg)
    drafter = make_drafter(m, PLANS[cell.kind]) if cell.entry == "drafter" and cell.kind not in MHC_KINDS else None
    assume(not (cell.entry == "drafter" and drafter is None))  # mHC drafters are refused by make_drafter itself
    why = refusals(cell)
    if why:
        with pytest.raises(ValueError) as err:
            run(cell, m, arg, preheat, n, eos, drafter, penalty=penalty)
        assert any(re.search(re.escape(w), str(err.value), re.I) for w in why), f"{cell}: {err.value}"
        return
    rows = rows_of(cell, run(cell, m, arg, preheat, n, eos, drafter, penalty=penalty))
    used = prompts if cell.form in SEVERAL else prompts[:1]
    assert len(rows) == len(used)
    m64 = copy.deepcopy(m).double()  # the same weights in fp64
    delta = MARGIN[dtype] * max(penalty, 1 / penalty)
    for p, got in zip(used, rows):
        why = near_argmax_path(reference_fn(cell, m64), p, got, n, eos, delta, penalty)
        assert why is None, f"{cell}: {why}"


@settings_matrix
@given(cell=cells(), seed=st.integers(0, 50), n=st.integers(2, 8), at=st.lists(st.integers(1, 8), min_size=3,
                                                                                  max_size=3))
def test_a_stopping_callback_ends_each_row_where_it_fired(cell, seed, n, at):
    """`on_tokens` returning True (the caller's stopping criterion: the harness's stop strings) ends that row after
    the call that brought it to at[i] tokens, every entry, form and plan kind, fp64: each row's tokens are its free
    run's (the main cell's law ties that run to the outside references) cut there; a one-token step stops exactly
    at at[i], a speculative or Jacobi round within one round of it; a call that also reached the budget leaves the
    budget's stop."""
    cell = Cell(**{**cell.__dict__, "dtype": "fp64"})
    assume(not refusals(cell) and not (cell.entry == "drafter" and cell.kind in MHC_KINDS))
    note(f"cell: {cell}")
    m, prompts, arg, preheat = build(cell, seed, {})
    drafter = make_drafter(m, PLANS[cell.kind]) if cell.entry == "drafter" else None
    free = rows_of(cell, run(cell, m, arg, preheat, n, None, drafter))
    seen: dict[int, list[int]] = {}

    def stop(i, new):
        seen.setdefault(i, []).extend(new)
        return len(seen[i]) >= at[i]

    out = run(cell, m, arg, preheat, n, None, drafter, on_tokens=stop if is_batch(arg) else lambda new: stop(0, new))
    rows = out if isinstance(out, list) else [out]
    round_ = 1 if cell.entry in ("sequential", "snlp") else cell.block + 1
    for i, (f, r) in enumerate(zip(free, rows)):
        k = len(r.tokens)
        assert r.tokens == f[:k], f"{cell}: row {i} {r.tokens} is not its free run {f} cut"
        if at[i] < n:  # a round that reached the budget too ends by the budget
            assert at[i] <= k < at[i] + round_ and r.stop == ("on_tokens" if k < n else "max_new_tokens"), \
                f"{cell}: row {i} {k} tokens, {r.stop}"
        else:
            assert r.stop == "max_new_tokens" and k == n, f"{cell}: row {i} {k} tokens, {r.stop}"


@pytest.mark.parametrize("entry", ("sequential", "snlp", "speculative", "drafter"))
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kw, match", [(dict(seed=3), "seed seeds sampling"), (dict(top_k=2), "top_k / top_p"),
                                       (dict(top_p=0.5), "top_k / top_p")])
def test_greedy_cells_refuse_what_only_sampling_reads(entry, form, kw, match, monkeypatch):
    """Greedy decoding (temperature 0) at every sampling entry point and input form: a `seed`, `top_k` or `top_p`
    could not act (nothing is drawn), so each is refused in one line naming it, before any forward (a seed used to
    be ignored silently)."""
    m = model_for("F1", 0, {})
    plan = PLANS["F1"]
    drafter = make_drafter(m, plan) if entry == "drafter" else None
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]] if form in ("tensorBT", "numpyBT") else [[1, 2, 3], [4, 5], [6, 7]]
    monkeypatch.setattr(m, "embed", lambda *a, **k: pytest.fail("a forward ran before the refusal"))
    call = {"sequential": lambda: sequential_generate(m, as_form(prompts, form), max_new_tokens=2, **kw),
            "snlp": lambda: snlp_generate(m, as_form(prompts, form), plan, max_new_tokens=2, **kw),
            "speculative": lambda: speculative_generate(m, as_form(prompts, form), plan, max_new_tokens=2, **kw),
            "drafter": lambda: speculative_generate(m, as_form(prompts, form), plan, max_new_tokens=2,
                                                    drafter=drafter, **kw)}[entry]
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("form", FORMS)
def test_a_budget_beyond_the_devices_memory_is_refused_before_any_forward(entry, form, monkeypatch):
    """max_new_tokens whose KV cache cannot fit the device's memory, at every decoding entry point and input form:
    refused in one line naming the cache's size, before any forward (KVCache.for_model; it was the allocator's
    RuntimeError, a traceback, after the model loaded). Jacobi refuses batch forms first, as in the matrix."""
    m = model_for("F1", 0, {})
    plan = PLANS["F1"]
    drafter = make_drafter(m, plan) if entry == "drafter" else None
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]] if form in ("tensorBT", "numpyBT") else [[1, 2, 3], [4, 5], [6, 7]]
    monkeypatch.setattr(m, "embed", lambda *a, **k: pytest.fail("a forward ran before the refusal"))
    n = 10 ** 12
    call = {"sequential": lambda: sequential_generate(m, as_form(prompts, form), max_new_tokens=n),
            "snlp": lambda: snlp_generate(m, as_form(prompts, form), plan, max_new_tokens=n),
            "speculative": lambda: speculative_generate(m, as_form(prompts, form), plan, max_new_tokens=n),
            "drafter": lambda: speculative_generate(m, as_form(prompts, form), plan, max_new_tokens=n,
                                                    drafter=drafter),
            "jacobi": lambda: jacobi_generate(m, as_form(prompts, form), plan, max_new_tokens=n)}[entry]
    match = "jacobi_generate decodes one prompt" if entry == "jacobi" and form in BATCH_FORMS else \
        r"a KV cache of [\d,]+ positions x batch \d+ needs [\d,.]+ GiB, more than the"
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 50), kind=st.sampled_from([k for k in PLANS if k != "diag"]),
       entry=st.sampled_from(("sequential", "snlp", "speculative", "drafter")),
       form=st.sampled_from(("ragged", "tensorBT")), adaptive=st.booleans(),
       min_confidence=st.sampled_from([0.0, 0.3]), block=st.integers(1, 4), n=st.integers(1, 8),
       temperature=st.sampled_from([0.7, 1.0, 2.0]), top_k=st.sampled_from([0, 1, 3, 20]),
       top_p=st.sampled_from([1.0, 0.9, 0.5]), eos=st.one_of(st.none(), st.integers(0, 60)),
       cfg=st.fixed_dictionaries({"value_embeds": st.booleans(), "windows": st.sampled_from(list(WINDOWS)),
                                  "nanochat": st.booleans()}), penalty=st.sampled_from([1.0, 1.0, 0.5, 1.3]))
def test_sampled_rows_do_not_depend_on_the_batch(seed, kind, entry, form, adaptive, min_confidence, block, n,
                                                 temperature, top_k, top_p, eos, cfg, penalty):
    """Sampled decoding of a batch (sequential, SNLP, self-speculative with the plan's forward or a drafter): row i is
    the same prompt decoded alone with seed + i, token for token (fp64), whatever its neighbours draw (each row's
    draws come from its own generator; a self-speculative round's drafts, uniforms and tokens too, its verdict
    computed for the whole batch on the device), with and without top_k / top_p and a repetition penalty (each
    row's own seen ids)."""
    spec = entry in ("speculative", "drafter")
    cell = Cell(entry=entry, form=form, kind=kind, adaptive=spec and adaptive,
                min_confidence=min_confidence if spec else 0.0, block=block)
    note(f"cell: {cell}")
    m, prompts, arg, preheat = build(cell, seed, cfg)
    d = make_drafter(m, PLANS[kind]) if entry == "drafter" and kind not in MHC_KINDS else None
    kw = dict(max_new_tokens=n, eos_id=eos, temperature=temperature, top_k=top_k, top_p=top_p,
              repetition_penalty=penalty)
    if entry == "sequential":
        call = lambda x, s: sequential_generate(m, x, seed=s, **kw)  # noqa: E731
    elif entry == "snlp":
        call = lambda x, s: snlp_generate(m, x, PLANS[kind], preheat=preheat, seed=s, **kw)  # noqa: E731
    else:
        call = lambda x, s: speculative_generate(m, x, PLANS[kind], block=block, preheat=preheat,  # noqa: E731
                                                 adaptive=cell.adaptive, min_confidence=cell.min_confidence,
                                                 drafter=d, seed=s, **kw)
    rows = call(arg, seed)
    for i, p in enumerate(prompts):
        alone = call(p, seed + i)
        assert rows[i].tokens == alone.tokens, f"{cell}: row {i} {rows[i].tokens} != alone {alone.tokens}"
        assert (rows[i].drafted, rows[i].accepted) == (alone.drafted, alone.accepted), cell


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 50), kind=st.sampled_from(["F1", "F2", "fwd", "tol", "exact", "whole"]),
       form=st.sampled_from(("one", "ragged")), drafter=st.booleans(), adaptive=st.booleans(),
       min_confidence=st.sampled_from([0.0, 0.3]), block=st.integers(1, 4), n=st.integers(1, 8),
       poison=st.lists(st.integers(0, 60), min_size=1, max_size=6, unique=True),
       deep=st.lists(st.integers(0, 60), max_size=4, unique=True), layer=st.integers(0, L - 1),
       cfg=st.fixed_dictionaries({"value_embeds": st.booleans(), "windows": st.sampled_from(list(WINDOWS))}))
def test_a_poison_token_decodes_as_the_model_does(seed, kind, form, drafter, adaptive, min_confidence, block, n,
                                                  poison, deep, layer, cfg):
    """Tokens whose embedding rows are NaN (their K/V NaN from layer 0; the drafter may propose them) and, with value
    embeddings, tokens whose value-embedding row of one deeper layer is NaN (their K/V NaN from that layer only, so an
    earlier deep poison hides behind a later shallow one): greedy self-speculative decoding (the plan's forward or a
    drafter) gives the full-prefix argmax loop of the model, and raises NonFiniteModelError exactly where that loop's
    logits turn non-finite (after it emits a poison token), never earlier. Each prompt's own tokens are clean (fp64)."""
    cell = Cell(entry="drafter" if drafter else "speculative", form=form, kind=kind, adaptive=adaptive,
                min_confidence=min_confidence, block=block)
    note(f"cell: {cell}")
    m, prompts, arg, preheat = build(cell, seed, cfg)
    used = prompts if form == "ragged" else prompts[:1]
    poison = [t for t in poison if all(t not in p for p in used)]
    deep = [t for t in deep if all(t not in p for p in used)]
    slots = [sl for sl in m.ve_slot[layer:] if sl >= 0] if cfg["value_embeds"] else []
    with torch.no_grad():
        m.wte.weight[poison] = float("nan")
        if slots:  # the first value-embedding layer at or after `layer`
            m.value_embeds[slots[0], deep] = float("nan")
    d = make_drafter(m, PLANS[kind]) if drafter else None  # the poisoned model's drafter (its own fingerprint)

    def loop(p):  # None: the model's own logits turn non-finite before n tokens
        ids = list(p)
        for _ in range(n):
            logits = m(torch.tensor([ids]))[0, -1]
            if not torch.isfinite(logits).all():
                return None
            ids.append(int(logits.argmax()))
        return ids[len(p):]

    with torch.no_grad():
        refs = [loop(p) for p in used]
    call = lambda x: speculative_generate(m, x, PLANS[kind], block=block, preheat=preheat,  # noqa: E731
                                          adaptive=adaptive, min_confidence=min_confidence, drafter=d,
                                          max_new_tokens=n)
    if any(r is None for r in refs):
        with pytest.raises(NonFiniteModelError):
            call(arg)
        return
    rows = call(arg)
    got = [r.tokens for r in rows] if form == "ragged" else [rows.tokens]
    assert got == refs, f"{cell}: {got} != {refs} (poison {poison})"


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
    several = form in SEVERAL or (form == "list1" and entry.startswith("snlp"))
    m, plan = blowup_model(61, sequence_len=64), "8xF1-h0-K1-newton"
    if several and entry.startswith("snlp"):
        m, plan = m.half(), "8xF1-h0-K1"
    lens = {"ragged": [3, 9, 5], "tensorBT": [6, 6], "numpyBT": [6, 6]}.get(form, [6])
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 61, (k,), generator=gen).tolist() for k in lens]
    arg = as_form(prompts, form)
    kw = dict(max_new_tokens=5)
    call = {"snlp": lambda: snlp_generate(m, arg, plan, **kw),
            "snlp-sampled": lambda: snlp_generate(m, arg, plan, temperature=1.0, seed=0, **kw),
            "speculative": lambda: speculative_generate(m, arg, plan, block=3, **kw),
            "drafter": lambda: speculative_generate(m, arg, plan, block=3, drafter=make_drafter(m, plan), **kw),
            "jacobi": lambda: jacobi_generate(m, arg, plan, block=3, **kw),
            "jacobi-unverified": lambda: jacobi_generate(m, arg, plan, block=3, verify=False, **kw)}[entry]
    refused = "jacobi" if entry.startswith("jacobi") and form in BATCH_FORMS else \
        "batched decoding supports" if form in SEVERAL and not entry.startswith("snlp") else None
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
        # the advice names what this h0 plan can change (Plan.divergence_hints), not the init it already has
        assert "h0 init" not in str(err.value) and "ELK damping (-elk:0.1)" in str(err.value), str(err.value)
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
    lens = {"ragged": [3, 9, 5], "tensorBT": [6, 6], "numpyBT": [6, 6]}.get(form, [6])
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 61, (k,), generator=gen).tolist() for k in lens]
    arg = as_form(prompts, form)
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
RUNNER_KINDS = ("F1", "fwd", "tol", "diag", "exact", "F2", "hcn", "hcntol", "whole")


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
       seed=st.integers(0, 50), ve=st.booleans(), nano=st.booleans(), windows=st.sampled_from(list(WINDOWS)),
       hc=st.sampled_from(list(MHC)), update=st.sampled_from(["in place", "new storage"]))
def test_runner_cell_equals_a_fresh_bind(kind, share, other, seed, ve, nano, windows, hc, update):
    """A (B, T) batch through a runner equals its reference (F1 / fwd / K >= C: the IDN iteration written out above;
    tol / DiagN / F2 / HCN: each row alone through a fresh unshared bind), before and after an update of EVERY
    parameter (`update`: in place, as an optimizer step, or new storage, `p.data = t`) with no refresh, shared or
    not (Runner.current rebuilds stale weights), with a second shared runner over another suffix bound in between
    (and checked too); or sharing is refused with a one-line error (M > 1, mHC). `nano`:
    nanochat-snlp's parts (smear, backout read from the iterate, q/k scale, its VE gate; its mHC for HCN); `windows`:
    the window widths (WINDOWS); `hc`: dynamic or static mHC for the HCN kinds (MHC)."""
    m = model_for(kind, seed, {"value_embeds": ve, "nanochat": nano, "windows": windows, "hc": hc})
    plan = PLANS[kind]
    idx = torch.randint(0, m.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(seed))
    if share and (kind in ("F2", *MHC_KINDS)):
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
            torch.testing.assert_close(runner(idx), expected(m, plan), rtol=1e-10, atol=1e-10)  # fp64 logits
            if second is not None:
                torch.testing.assert_close(second(idx), expected(m, other), rtol=1e-10, atol=1e-10)
            gen = torch.Generator().manual_seed(seed + 1)
            for p in m.parameters():
                noise = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05
                if update == "in place":
                    p.add_(noise)
                else:
                    p.data = p.data + noise


# ----------------------------------------------------------------------------- evaluate
@pytest.mark.parametrize("model", ["plain", "nanochat", "static-mhc", "nanochat-mhc"])
def test_evaluate_cells_equal_their_references(model):
    """evaluate: the K >= C, M = 1 row equals the sequential row; a K < C row's PPL equals exp(mean NLL) of the
    plan's own teacher-forced logits on every window of the protocol (seq_len + 1 tokens each, non-overlapping);
    with nanochat-snlp's parts (NANOCHAT), and on static mHC (an HCN row too) with widths mixed per layer."""
    mhc = model.endswith("mhc")
    m = model_for("hcn" if mhc else "F1", 3, {"nanochat": model.startswith("nanochat"), "hc": "static",
                                              **({"windows": "mixed"} if mhc else {})})
    val = torch.randint(0, m.config.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    cfg = EvalConfig(seq_len=16, max_tokens=64, prompts=2, prompt_len=4, gen_tokens=4, warmup=0, runs=1,
                     time_tokens=2, emb=False, progress=False, batch=2)
    approx_plans = ["6xF1-h0-K1"] + (["6xF1-h0-K2-hcn"] if mhc else [])
    seq, exact, *approx = evaluate(m, val, ["6xF1-h0-K6", *approx_plans], cfg)
    assert exact.ppl == pytest.approx(seq.ppl, rel=1e-12) and exact.top1 == seq.top1 and exact.ar_match == 1.0
    with torch.no_grad():
        wins = torch.stack([val[i * 16:(i + 1) * 16 + 1] for i in range(64 // 16)])
        rows = [(m, seq)] + [(lambda x, p=p: parallel_forward(m, x, p), r) for p, r in zip(approx_plans, approx)]
        for fn, rec in rows:
            logp = torch.log_softmax(fn(wins[:, :-1]).double(), -1)
            nll = -logp.gather(-1, wins[:, 1:, None]).mean()
            # fp64 model: fp64 logits and NLL sums (fp32 logits held this to 1e-6)
            assert rec.ppl == pytest.approx(math.exp(float(nll)), rel=1e-10), rec.plan


# ----------------------------------------------------------------------------- static mHC (fixed cells)
STATIC_MHC = {"sigmoid": dict(dynamic=False), "softmax": NANOCHAT_MHC, "nanochat": {**NANOCHAT, **NANOCHAT_MHC}}
MHC_PLANS = ("6xF1-h0-K2-hcn", "6xF1-h0-K3-hcn-tol:0.5", "3xF2-h0-K1-hcn", "7xF1-h0-K1", "6xF1-h0-K6-hcn")


def dynamic_twin(m, seed: int):
    """The dynamic-mHC model computing the same function as the static mHC model `m`: its weights, every HyperConn
    given a random phi and gates alpha = 0, so each H is the maps of its bias computed per token on the dynamic path
    (HyperConn.forward per sublayer; the solver's A per token through affine_scan), not by GPT.static_hc's one
    batched Sinkhorn and the constant A of transfer_scan."""
    twin = GPT(GPTConfig(**{**m.config.to_dict(), "hc_dynamic": True})).to(m.wte.weight.dtype)
    missing, unexpected = twin.load_state_dict(m.state_dict(), strict=False)
    assert not unexpected and all(k.endswith((".phi", ".alpha")) for k in missing), (missing, unexpected)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if name.endswith(".phi"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif name.endswith(".alpha"):
                p.zero_()
    return twin.eval()


@pytest.mark.parametrize("windows", ["SL", "mixed"])
@pytest.mark.parametrize("maps", list(STATIC_MHC))
def test_static_mhc_cells_equal_their_dynamic_twin(maps, windows):
    """Static mHC (hc_dynamic=False: GPT.static_hc, HCN's constant A through transfer_scan) at every entry point,
    against its dynamic twin (`dynamic_twin`, the same function through the per-token path), fp64: the forward,
    parallel_forward and a runner over a (B, T) batch give the twin's logits for every plan in MHC_PLANS (HCN with
    K < C, with tol, fused F2, the IDN surrogate on an mHC model, K >= C); sequential, SNLP (ragged list and (B, T)
    tensor), speculative (ragged) and Jacobi decoding give the twin's tokens: the argmax loop for the exact entries,
    the twin's own SNLP decoding of each prompt alone for the plans with K < C. `maps`: sigmoid maps, nanochat-snlp's
    softmax maps with a tau-0.05 Sinkhorn, and those with nanochat-snlp's other parts (NANOCHAT)."""
    m = mhc_model(seed=5, n_layer=L, **{**STATIC_MHC[maps], **WINDOWS[windows]})
    twin = dynamic_twin(m, seed=5)
    gen = torch.Generator().manual_seed(5)
    idx = torch.randint(0, m.config.vocab_size, (3, 13), generator=gen)
    prompts = [torch.randint(0, m.config.vocab_size, (k,), generator=gen).tolist() for k in (3, 15, 5)]
    square = idx[:2, :6]  # a (B, T) tensor of prompts
    n = 6
    with torch.no_grad():
        torch.testing.assert_close(m(idx), twin(idx), rtol=1e-10, atol=1e-10)  # fp64 states and logits
        for plan in MHC_PLANS:
            want = torch.cat([bind(twin, plan)(idx[i:i + 1]) for i in range(idx.shape[0])])
            torch.testing.assert_close(bind(m, plan)(idx), want, rtol=1e-10, atol=1e-10, msg=plan)
            torch.testing.assert_close(parallel_forward(m, idx, plan), want, rtol=1e-10, atol=1e-10, msg=plan)
    loop = [argmax_loop(twin, p, n) for p in prompts]
    assert [r.tokens for r in sequential_generate(m, prompts, max_new_tokens=n)] == loop
    for plan in MHC_PLANS:
        p = Plan.parse(plan, L)
        exact = p.iters >= p.chunks and p.fuse == 1 and not p.tol
        alone = loop if exact else [snlp_generate(twin, q, plan, max_new_tokens=n).tokens for q in prompts]
        assert [r.tokens for r in snlp_generate(m, prompts, plan, max_new_tokens=n)] == alone, plan
        sq = [snlp_generate(twin, q, plan, max_new_tokens=n).tokens for q in square.tolist()]
        assert [r.tokens for r in snlp_generate(m, square, plan, max_new_tokens=n)] == sq, plan
        spec = speculative_generate(m, prompts, plan, block=3, max_new_tokens=n)
        assert [r.tokens for r in spec] == loop, plan
        assert jacobi_generate(m, prompts[1], plan, block=3, max_new_tokens=n).tokens == loop[1], plan


# ----------------------------------------------------------------------------- window widths (fixed cells)
@pytest.mark.parametrize("windows", ["S1", "wide", "mixed"])
@pytest.mark.parametrize("mhc", [False, True])
def test_window_widths_at_every_entry_point(windows, mhc):
    """Widths 0 (each token sees itself only), 1, 2, 3, 5, wider than the sequence, and full, mixed per layer
    (WINDOWS), on plain models with value embeddings and the x0 residual and on static-mHC models: the sequential
    forward equals its outside reference where one exists without the window code (widths wider than every sequence:
    the same weights with full causal attention, window_pattern "L"), and for every plan (fused stacks mixing
    widths, K < C, tol, K >= C) the forward and a runner over a (B, T) batch equal each row alone through a fresh
    bind, and parallel_forward the runner; decoding: sequential, speculative, K >= C SNLP (M = 1: the argmax loop,
    M > 1: the loop over fused_forward) and, for K < C, each prompt alone, ragged; at prompts of 48 tokens the banded
    kernel (stacks grouped by window) gives the masked kernel's results. A window of w keeps w keys to the left."""
    from snlp.model.ops import set_window_kernel

    cfg = {"windows": windows, "hc": "static", "sequence_len": 96}
    m = model_for("hcn" if mhc else "F1", 7, cfg)
    if windows == "wide":
        full = GPT(GPTConfig(**{**m.config.to_dict(), "window_pattern": "L"})).double().eval()
        full.load_state_dict(m.state_dict())  # no layer windowed: attention never takes the window path
        assert all(b.attn.window == -1 for b in full.blocks) and any(b.attn.window > 0 for b in m.blocks)
    gen = torch.Generator().manual_seed(7)
    idx = torch.randint(0, m.config.vocab_size, (2, 48), generator=gen)
    prompts = [torch.randint(0, m.config.vocab_size, (k,), generator=gen).tolist() for k in (3, 15, 9)]
    plans = ["6xF1-h0-K1", "3xF2-h0-K1", "2xF3-fwd-K1", "7xF1-h0-K6-tol:0.5", "6xF1-h0-K6", "3xF2-h0-K3"]
    plans += ["6xF1-h0-K2-hcn"] if mhc else []
    n = 6
    prev = set_window_kernel("masked")
    try:
        with torch.no_grad():
            ref = m(idx)
            if windows == "wide":
                torch.testing.assert_close(ref, full(idx), rtol=1e-6, atol=1e-6)
            outs = {}
            for plan in plans:
                want = torch.cat([bind(m, plan)(idx[i:i + 1, :13]) for i in range(2)])
                got = bind(m, plan)(idx[:, :13])
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=plan)
                torch.testing.assert_close(parallel_forward(m, idx[:, :13], plan), got, rtol=1e-6, atol=1e-6)
                outs[plan] = (bind(m, plan)(idx), parallel_forward(m, idx, plan))
            set_window_kernel("banded")
            torch.testing.assert_close(m(idx), ref, rtol=1e-6, atol=1e-6)
            for plan in plans:
                for a, b in zip((bind(m, plan)(idx), parallel_forward(m, idx, plan)), outs[plan]):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"banded {plan}")
    finally:
        set_window_kernel(prev)
    loop = [argmax_loop(m, p, n) for p in prompts]
    if windows == "wide":
        assert loop == [argmax_loop(full, p, n) for p in prompts]
    assert [r.tokens for r in sequential_generate(m, prompts, max_new_tokens=n)] == loop
    for plan in plans:
        p = Plan.parse(plan, L)
        if p.iters >= p.chunks and not p.tol:
            fn = m if p.fuse == 1 else (lambda x, plan=plan: fused_forward(m, x, plan))
            want = loop if p.fuse == 1 else [argmax_loop(fn, q, n) for q in prompts]
        else:
            want = [snlp_generate(m, q, plan, max_new_tokens=n).tokens for q in prompts]
        assert [r.tokens for r in snlp_generate(m, prompts, plan, max_new_tokens=n)] == want, plan
        assert [r.tokens for r in speculative_generate(m, prompts, plan, block=3, max_new_tokens=n)] == loop, plan


def test_window_zero_sees_each_token_alone():
    """An outside law of the narrowest window: with width 0 on every layer (each token attends to itself only; no
    smear) the logits at position t are the logits of token t run alone (RoPE rotates its query and key alike), for
    the forward, a runner and SNLP decoding (the argmax loop of the same law)."""
    m = make_model(seed=9, n_layer=L, layer_windows=[0] * L)
    idx = torch.randint(0, m.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        alone = torch.cat([m(idx[:, t:t + 1]) for t in range(idx.shape[1])], 1)
        torch.testing.assert_close(m(idx), alone, rtol=1e-6, atol=1e-6)
        for plan in ("6xF1-h0-K1", "3xF2-h0-K3", "6xF1-h0-K6"):
            each = torch.cat([bind(m, plan)(idx[:, t:t + 1]) for t in range(idx.shape[1])], 1)
            torch.testing.assert_close(bind(m, plan)(idx), each, rtol=1e-6, atol=1e-6, msg=plan)
    token_alone = lambda ids: m(ids[:, -1:])  # noqa: E731
    p = idx[0, :4].tolist()
    assert sequential_generate(m, p, max_new_tokens=6).tokens == argmax_loop(token_alone, p, 6)
    assert snlp_generate(m, [p, idx[1, :7].tolist()], "6xF1-h0-K6", max_new_tokens=6)[0].tokens == \
        argmax_loop(token_alone, p, 6)


def naive_attend(q, k, v, windows=-1, q_start=0, masks=None):
    """Causal sliding-window attention written out: query i (a Python loop over positions) takes an explicit softmax
    over the scores of keys max(0, i - w) .. i (every key 0 .. i for w = -1), scale 1 / sqrt(hd), GQA by repeating
    the KV heads. Full-prefix calls only (no KV cache: queries and keys at 0 .. T-1)."""
    assert isinstance(windows, int) and isinstance(q_start, int) and q_start == 0 and q.shape[-2] == k.shape[-2]
    Hq, T, hd = q.shape[-3:]
    k, v = (t.repeat_interleave(Hq // t.shape[-3], -3) for t in (k, v))
    out = torch.empty_like(q)
    for i in range(T):
        lo = 0 if windows < 0 else max(0, i - windows)
        scores = q[..., i:i + 1, :] @ k[..., lo:i + 1, :].transpose(-1, -2) / math.sqrt(hd)
        out[..., i:i + 1, :] = torch.softmax(scores, -1) @ v[..., lo:i + 1, :]
    return out


# widths at the edges of the prompts below (9, 10, 11 tokens, decoded 6 more): T - 2, T - 1, T and T + 1 of some
# prefill, each crossed by a decode step, next to 0, 1, 2 and full
EDGE_WINDOWS = [8, 9, 10, 1, 2, 0, 11, -1]


@pytest.mark.parametrize("kernel", ["masked", "banded", "auto"])
def test_window_widths_at_the_prompt_length_equal_a_naive_attention(kernel, monkeypatch):
    """An outside reference for every width, not only the widths wider than the sequence: the same weights with
    snlp's attention replaced by naive_attend (an explicit softmax over each query's window, fp64). Widths T - 2 ..
    T + 1 of the prompts (where the kernel choice switches between the window path, the mask and is_causal), 0, 1,
    2 and full, mixed per layer; the forward and K >= C plans at T = 11 and T = 40 (the banded kernel pays there)
    under each window kernel, and sequential, K >= C SNLP, speculative and verified Jacobi decoding of a ragged batch
    whose rows cross each window at different steps: the argmax loop over the naive forward."""
    from snlp.model import gpt as gpt_module
    from snlp.model.ops import set_window_kernel

    m = make_model(seed=13, n_layer=L, layer_windows=EDGE_WINDOWS, sequence_len=64, value_embeds=True)
    gen = torch.Generator().manual_seed(13)
    xs = [torch.randint(0, m.config.vocab_size, (2, T), generator=gen) for T in (11, 40)]
    prompts = [torch.randint(0, m.config.vocab_size, (k,), generator=gen).tolist() for k in (9, 10, 11)]
    n = 6
    with monkeypatch.context() as mp, torch.no_grad():
        mp.setattr(gpt_module, "attend", naive_attend)
        refs = [m(x) for x in xs]
        loop = [argmax_loop(m, p, n) for p in prompts]
        mp.setattr(gpt_module, "attend", lambda q, k, v, windows=-1, **kw: naive_attend(q, k, v))
        assert not torch.allclose(m(xs[1]), refs[1], rtol=1e-3, atol=1e-3)  # the windows bite in the reference
    prev = set_window_kernel(kernel)
    try:
        with torch.no_grad():
            for x, ref in zip(xs, refs):
                torch.testing.assert_close(m(x), ref, rtol=1e-9, atol=1e-9)
                for plan in ("6xF1-h0-K6", "8xF1-fwd-K8", "3xF1-h0-K3"):
                    torch.testing.assert_close(bind(m, plan)(x), ref, rtol=1e-9, atol=1e-9, msg=plan)
                    torch.testing.assert_close(parallel_forward(m, x, plan), ref, rtol=1e-9, atol=1e-9, msg=plan)
        assert [r.tokens for r in sequential_generate(m, prompts, max_new_tokens=n)] == loop
        assert [r.tokens for r in snlp_generate(m, prompts, "6xF1-h0-K6", max_new_tokens=n)] == loop
        for plan in ("6xF1-h0-K1", "2xF2-h0-K1"):
            spec = speculative_generate(m, prompts, plan, block=3, max_new_tokens=n)
            assert [r.tokens for r in spec] == loop, plan
        assert [jacobi_generate(m, p, "6xF1-h0-K1", block=3, max_new_tokens=n).tokens for p in prompts] == loop
    finally:
        set_window_kernel(prev)


# ----------------------------------------------------------------------------- Hugging Face sliding windows
# transformers' Mistral (one sliding_window on every layer) and Qwen2 (use_sliding_window: sliding layers from
# max_window_layers on, full ones below) with sliding_window < T, random weights (norms and biases too), built
# offline; snlp.io.hf converts sliding_window s to a left context of s - 1 keys
HF_WINDOWS = {"mistral-4": ("MistralConfig", dict(sliding_window=4)),
              "mistral-1": ("MistralConfig", dict(sliding_window=1)),
              "qwen2-3": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=3, max_window_layers=2)),
              "qwen2-2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=2, max_window_layers=0))}


def hf_window_model(case: str, dtype=torch.float64):
    """(transformers model, the left context per layer it computes) for a HF_WINDOWS case: 4 layers, width 64, 4
    heads over 2 KV heads, vocabulary 97, no EOS id (so generate runs its whole budget)."""
    transformers = pytest.importorskip("transformers")
    name, kw = HF_WINDOWS[case]
    cfg = getattr(transformers, name)(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      attn_implementation="sdpa", eos_token_id=None, bos_token_id=None, **kw)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * 4
    return hf.to(dtype).eval(), [cfg.sliding_window - 1 if t == "sliding_attention" else -1 for t in types]


@pytest.mark.parametrize("case", list(HF_WINDOWS))
def test_hf_sliding_window_conversion_at_every_entry_point(case, tmp_path):
    """A converted transformers model with sliding windows shorter than the sequence, against transformers itself
    (fp64; transformers' RMSNorm computes in fp32, so logits agree to ~1e-7): the forward and K >= C plans (a runner,
    parallel_forward) give its logits; sequential, K >= C SNLP and speculative decoding (M = 1 and M = 2 drafts) of
    a ragged batch (shared weights with an adaptive block, an adapted drafter) and verified Jacobi decoding give the
    argmax loop over its full-prefix forward, and, where sliding_window >= 3, the tokens of its `generate`
    (transformers 5.24's cached generate departs from its own full-prefix forward at sliding_window 1, and at 2 on
    some prompts); a K >= C plan with M = 2 decodes as the loop over fused_forward; a K < C plan (with and without
    tol) decodes each row as alone; export writes a transformers directory that
    loads with the same logits and converts back to the same windows. Export refuses a model with two sliding
    widths (no transformers architecture has them) with a one-line error."""
    from snlp.io.hf import export_hf, from_hf

    hf, windows = hf_window_model(case)
    model, _ = from_hf(hf)
    assert model.config.layer_windows == windows and max(windows) < 12
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 97, (2, 20), generator=gen)
    with torch.no_grad():
        ref = hf(x).logits  # fp64, as ours
        torch.testing.assert_close(model(x), ref, rtol=0, atol=1e-6)
        for plan in ("4xF1-h0-K4", "2xF1-fwd-K2", "3xF1-h0-K3"):
            torch.testing.assert_close(bind(model, plan)(x), ref, rtol=0, atol=1e-6, msg=plan)
            torch.testing.assert_close(parallel_forward(model, x, plan), ref, rtol=0, atol=1e-6, msg=plan)
    prompts = [torch.randint(0, 97, (k,), generator=gen).tolist() for k in (3, 11, 6)]
    n = 10
    loop = [argmax_loop(lambda ids: hf(ids).logits, p, n) for p in prompts]
    if min(w for w in windows if w >= 0) >= 2:
        with torch.no_grad():
            outs = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(p):]
                    for p in prompts]
        assert [o.tolist() for o in outs] == loop  # transformers' cache agrees with its own forward here
    assert [r.tokens for r in sequential_generate(model, prompts, max_new_tokens=n)] == loop
    assert [r.tokens for r in snlp_generate(model, prompts, "4xF1-h0-K4", max_new_tokens=n)] == loop
    for plan in ("2xF1-h0-K1", "1xF2-h0-K1"):
        assert [r.tokens for r in speculative_generate(model, prompts, plan, block=3, max_new_tokens=n)] == loop
    shared = speculative_generate(model, prompts, "3xF1-h0-K1", block=3, max_new_tokens=n, share_weights=True,
                                  adaptive=True)
    drafted = speculative_generate(model, prompts, "2xF1-h0-K1", block=3, max_new_tokens=n,
                                   drafter=make_drafter(model, "2xF1-h0-K1"))
    assert [r.tokens for r in shared] == [r.tokens for r in drafted] == loop
    assert [jacobi_generate(model, p, "3xF1-h0-K1", block=3, max_new_tokens=n).tokens for p in prompts] == loop
    fused = [argmax_loop(lambda ids: fused_forward(model, ids, "2xF2-h0-K2"), p, n) for p in prompts]
    assert [r.tokens for r in snlp_generate(model, prompts, "2xF2-h0-K2", max_new_tokens=n)] == fused
    for plan in ("3xF1-h0-K1", "3xF1-h0-K2-tol:0.5"):
        alone = [snlp_generate(model, p, plan, max_new_tokens=n).tokens for p in prompts]
        assert [r.tokens for r in snlp_generate(model, prompts, plan, max_new_tokens=n)] == alone, plan
    # export round trip (fp32 files: transformers' own loading path)
    transformers = pytest.importorskip("transformers")
    m32, _ = from_hf(hf.float())
    out = export_hf(m32, tmp_path / "exp")
    back_hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    back, _ = from_hf(str(out))
    assert back.config.layer_windows == windows
    with torch.no_grad():
        ref32 = hf.float()(x).logits
        torch.testing.assert_close(back_hf(x).logits, ref32, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(back(x), ref32, rtol=1e-4, atol=1e-4)
    two = copy.deepcopy(m32)
    two.config.layer_windows = [1, 2, -1, -1]
    with pytest.raises(ValueError, match="several sliding-window sizes") as err:
        export_hf(two, tmp_path / "two")
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- compiled cells (inductor: few, small)
@pytest.mark.parametrize("kind", ["tol", "diag"])
def test_compiled_cells_that_cannot_compile_are_refused(kind):
    m = make_model(seed=1, n_layer=L)
    for call in (lambda: snlp_generate(m, [1, 2, 3], PLANS[kind], max_new_tokens=2, compile=True),
                 lambda: speculative_generate(m, [[1, 2, 3], [4]], PLANS[kind], max_new_tokens=2, compile=True)):
        with pytest.raises(ValueError, match="compile|batched decoding supports") as err:
            call()
        assert "\n" not in str(err.value)


@pytest.mark.slow
def test_compiled_cells_equal_their_references():
    """compile=True (one cell: inductor costs minutes on 2 cores; tests/decode/test_steps.py has the others): a ragged
    speculative batch with shared weights and an adaptive block equals the full-prefix argmax loop, in fp64."""
    m = make_model(seed=2, n_layer=L)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, m.config.vocab_size, (k,), generator=gen).tolist() for k in (3, 9)]
    rows = speculative_generate(m, prompts, PLANS["F1"], block=3, max_new_tokens=6, compile=True, share_weights=True,
                                adaptive=True)
    assert [r.tokens for r in rows] == [argmax_loop(m, p, 6) for p in prompts]


# compiled cells of the main entry points on a depth-6 model (inductor compiles a few graphs per cell: ~15-55 s of
# CPU each, so every cell is marked slow; tests/decode/test_steps.py and tests/model/test_flex_windows.py keep small
# compiled checks in the default run): static mHC or nanochat-snlp's parts, with widths mixed per layer (full,
# wider than T, 0, 1, 2, 3: the F2 stacks hold two finite widths each)
COMPILED_WINDOWS = [-1, 100, 0, 1, 2, 3]
COMPILED = {
    "plan-static": ("plan", dict(dynamic=False), "4xF1-h0-K2-hcn"),
    "sequential-static": ("sequential", dict(dynamic=False), None),
    "decode-static": ("snlp", dict(dynamic=False), "4xF1-h0-K2-hcn"),
    "decode-exact-nanochat": ("snlp", {**NANOCHAT, **NANOCHAT_MHC}, "4xF1-h0-K4-hcn"),
    "speculative-windows": ("speculative", None, "2xF2-h0-K1"),
    "speculative-static": ("speculative", dict(dynamic=False), "4xF1-h0-K1-hcn"),
    "plan-nanochat": ("plan", NANOCHAT, "2xF2-h0-K1"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_entry_points_equal_their_references(name):
    """compile=True / torch.compile at the main entry points equals the eager cell's reference (fp64 weights):
    the plan forward (torch.compile of a runner over a (B, T) batch: each row alone through a fresh eager bind),
    sequential decoding and SNLP decoding of a ragged batch (K >= C, M = 1: the full-prefix argmax loop; K < C: each
    prompt alone, eager), and speculative decoding (the argmax loop). The models: static mHC (its maps and HCN's
    constant A folded into the graph), nanochat-snlp's parts (with its static softmax-map mHC where the plan is
    HCN), a plain model; every one with the widths of COMPILED_WINDOWS."""
    entry, extra, plan = COMPILED[name]
    n_layer = len(COMPILED_WINDOWS)
    kw = dict(seed=11, n_layer=n_layer, layer_windows=COMPILED_WINDOWS, sequence_len=64)
    if extra is None:
        m = make_model(**kw)
    elif "dynamic" in extra:
        m = mhc_model(**kw, **extra)
    else:
        m = make_model(**kw, **extra)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, m.config.vocab_size, (k,), generator=gen).tolist() for k in (3, 9)]
    n = 5
    if entry == "plan":
        idx = torch.randint(0, m.config.vocab_size, (2, 12), generator=gen)
        with torch.no_grad():
            want = torch.cat([bind(m, plan)(idx[i:i + 1]) for i in range(2)])
            got = torch.compile(bind(m, plan, check_finite=False), fullgraph=True)(idx)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # fp64 (inductor's kernels)
        return
    loop = [argmax_loop(m, p, n) for p in prompts]
    if entry == "sequential":
        rows = sequential_generate(m, prompts, max_new_tokens=n, compile=True)
        want = loop
    elif entry == "speculative":
        rows = speculative_generate(m, prompts, plan, block=3, max_new_tokens=n, compile=True)
        want = loop
    else:
        p = Plan.parse(plan, n_layer)
        rows = snlp_generate(m, prompts, plan, max_new_tokens=n, compile=True)
        want = loop if p.iters >= p.chunks and p.fuse == 1 else \
            [snlp_generate(m, q, plan, max_new_tokens=n).tokens for q in prompts]
    assert [r.tokens for r in rows] == want


@pytest.mark.parametrize("guards", ["cut", "full"])
@pytest.mark.parametrize("entry", ["sequential", "snlp", "speculative"])
def test_guard_cut_cells_equal_the_argmax_loop(entry, guards):
    """Compiled steps with dynamo's guards cut (Step guards="cut": snlp.decode.steps.StepState) or evaluated on
    every call (the default): one prompt and a ragged batch, then the same after an in-place update of every parameter
    and after `p.data = t` on every parameter, each decode equal to the full-prefix argmax loop of the model as it is
    then (fp64, mixed window widths; dynamo's CompileCounter backend: its tracing, guards and graph cache without
    inductor's compile time; inductor: tests/decode/test_guard_cut.py)."""
    from torch._dynamo.testing import CompileCounter

    from snlp.decode.steps import sequential_step, snlp_step

    torch._dynamo.reset()
    m = make_model(seed=3, n_layer=len(COMPILED_WINDOWS), layer_windows=COMPILED_WINDOWS, sequence_len=64)
    plan = "5xF1-h0-K5" if entry == "snlp" else "5xF1-h0-K2"  # K >= C: the SNLP decode is the argmax loop
    seq = sequential_step(m, compile=True, backend=CompileCounter(), guards=guards)
    draft = snlp_step(bind(m, plan, check_finite=False), compile=True, backend=CompileCounter(), guards=guards)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, m.config.vocab_size, (k,), generator=gen).tolist() for k in (3, 9)]

    def decode(p):
        if entry == "sequential":
            return sequential_generate(m, p, max_new_tokens=5, step=seq)
        if entry == "snlp":
            return snlp_generate(m, p, plan, max_new_tokens=5, step=draft)
        return speculative_generate(m, p, plan, block=3, max_new_tokens=5, draft=draft, verify=seq)

    def check():
        assert decode(prompts[1]).tokens == argmax_loop(m, prompts[1], 5)
        assert [r.tokens for r in decode(prompts)] == [argmax_loop(m, p, 5) for p in prompts]
    check()
    with torch.no_grad():
        for q in m.parameters():
            q.mul_(1.1)
    check()
    for q in m.parameters():
        q.data = q.data.flip(-1).clone()
    check()
    assert (seq.cut_calls + draft.cut_calls > 0) == (guards == "cut")


# ----------------------------------------------------------------------------- the decode suite (snlp bench --suite decode)
@settings(max_examples=examples(4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["F1", "F2", "fwd", "exact", "exactF2", "whole"]), seed=st.integers(0, 50),
       sizes=st.sampled_from([(1,), (1, 3), (2,)]), drafter=st.booleans(), nano=st.booleans(),
       windows=st.sampled_from(list(WINDOWS)), prompts=st.sampled_from([None, 6]), from_file=st.booleans(),
       methods=st.sampled_from([None, ("speculative",), ("snlp",)]))
def test_decode_suite_exact_rows_equal_the_argmax_loop(kind, seed, sizes, drafter, nano, windows, prompts, from_file,
                                                        methods, tmp_path_factory):
    """The decode suite's rows (bench entry point): its reference is the argmax loop, every row it calls exact (snlp
    sequential, speculative with the model's own or an adapted drafter, an SNLP plan with K >= C and M = 1) gives
    the reference's tokens in fp64, and a K >= C plan with M > 1 (the fused model) is not called exact; `nano`:
    nanochat-snlp's parts (NANOCHAT), `windows`: the window widths (WINDOWS); `prompts`: one call decodes six
    prompts a batch at a time (None: one batch); `from_file`: token-id prompts of several lengths from a prompts
    file, each cut to the prompt length; `methods`: the snlp rows beside sequential (a drafter needs speculative)."""
    from snlp.bench.decode_suite import DecodeSuiteConfig, run_decode_suite
    from snlp.io.drafter import save_drafter

    m = model_for(kind, seed, {"nanochat": nano, "windows": windows})
    path = None
    if drafter:
        d = make_drafter(m, PLANS["F1"])
        with torch.no_grad():
            for p in d.model.blocks[d.suffix_start:].parameters():
                p.add_(0.05 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(seed)))
        path = tmp_path_factory.mktemp("drafter")
        save_drafter(path, d)
    if drafter and methods == ("snlp",):
        methods = ("snlp", "speculative")
    given, file = None, None
    if from_file:
        gen = torch.Generator().manual_seed(seed)
        given = [torch.randint(0, m.config.vocab_size, (5 + k % 3,), generator=gen).tolist() for k in range(6)]
        file = tmp_path_factory.mktemp("prompts") / "prompts.json"
        file.write_text(json.dumps(given))
    cfg = DecodeSuiteConfig(quick=True, device="cpu", dtype="float64", batch_sizes=sizes, prompt_len=5, new_tokens=6,
                            plans=(PLANS[kind],), blocks=(3,), rounds=1, warmup=0, transformers=False, seed=seed,
                            drafter=None if path is None else str(path), prompts=prompts,
                            prompts_file=None if file is None else str(file), methods=methods)
    res = run_decode_suite(cfg, model=m)
    assert len(res.prompts) == (prompts or max(sizes))
    if given is not None:
        assert res.prompts == [g[:5] for g in given[:len(res.prompts)]]
    assert res.reference == [argmax_loop(m, p, 6) for p in res.prompts]
    ran = {r.method for r in res.rows}
    assert "snlp sequential" in ran and ("snlp snlp" in ran) == ("snlp" in (methods or ("snlp",)))
    assert ("snlp speculative" in ran) == ("speculative" in (methods or ("speculative",)))
    for snlp_row in (r for r in res.rows if r.method == "snlp snlp"):
        assert snlp_row.exact == (kind == "exact")
    assert ("snlp speculative (drafter)" in ran) == drafter
    for r in res.rows:
        if r.library == "snlp" and r.exact:
            assert r.matches_sequential, r


@pytest.mark.slow
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



# ----------------------------------------------------------------------------- self-distillation data (snlp adapt)
@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 50), lens=st.lists(st.integers(1, 12), min_size=1, max_size=5), nano=st.booleans(),
       windows=st.sampled_from(list(WINDOWS)), eos=st.booleans(), budget=st.sampled_from([8192, 20]))
def test_self_distill_replies_equal_the_argmax_loop(seed, lens, nano, windows, eos, budget):
    """`snlp adapt --self-distill`'s replies (snlp.train.selfgen.greedy_replies: prompts sorted by length, grouped
    into ragged batches under a cached-positions budget, returned in the caller's order) are the argmax loop of
    each prompt, in fp64; with a stop id, each reply ends at its first stop; `nano`: nanochat-snlp's parts,
    `windows`: the window widths, `budget` 20: one or two prompts per batch."""
    import snlp.train.selfgen as SG

    m = model_for("F1", seed, {"nanochat": nano, "windows": windows})
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, m.config.vocab_size, (k,), generator=gen).tolist() for k in lens]
    want = [argmax_loop(m, p, 6) for p in prompts]
    stops = (want[0][2],) if eos else ()  # a token the first reply really emits
    if eos:
        want = [argmax_loop(m, p, 6, eos_id=list(stops)) for p in prompts]
    assert SG.greedy_replies(m, prompts, 6, stops, batch=3, max_positions=budget) == want


# ----------------------------------------------------------------------------- the window kernel (a treatment)
@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["F1", "F2", "fwd", "hcn", "diag", "exact", "exactF2", "tol", "whole"]),
       seed=st.integers(0, 50),
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
    share = share and kind in ("F1", "fwd", "exact", "whole")
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
            for a, b in zip(got, ref):  # fp64 states and logits; the kernels sum attention in other orders
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            if ref_dec is not None:
                assert [r.tokens for r in snlp_generate(m, prompts, plan, max_new_tokens=4)] == ref_dec
            spec = speculative_generate(m, prompts, PLANS["F1"], block=3, max_new_tokens=4)
            assert [r.tokens for r in spec] == [argmax_loop(m, p, 4) for p in prompts]
    finally:
        set_window_kernel(prev)


@settings(max_examples=examples(4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["F1", "F2", "fwd", "hcn", "exact", "exactF2", "whole"]), seed=st.integers(0, 50),
       nano=st.booleans(), pattern=st.sampled_from(["S", "SSSL", "SL"]), share=st.booleans())
@pytest.mark.slow
def test_flex_window_kernel_is_invisible_at_every_entry_point(kind, seed, nano, pattern, share):
    """set_window_kernel("flex") (FlexAttention with a block-sparse window mask, taken inside compiled graphs only;
    fused stacks as one call with per-branch windows) against "masked": the compiled sequential forward and compiled
    runner (shared weights where allowed) run FlexAttention and give the masked kernel's results (fp64, aot_autograd
    graphs: FlexAttention's own reference kernel; inductor's is tests/model/test_flex_windows.py); eagerly (no flex:
    parallel_forward, SNLP decoding, whose cached calls never take it) the results are the masked kernel's too."""
    from snlp.model.ops import set_window_kernel

    cfg = {"window_pattern": pattern, "short_window": 4, "sequence_len": 96, "nanochat": nano}
    m = model_for(kind, seed, cfg if kind != "hcn" else {"nanochat": nano})
    if kind == "hcn":
        m = mhc_model(seed=seed, n_layer=L, window_pattern=pattern, short_window=4, sequence_len=96,
                      **({**NANOCHAT, **NANOCHAT_MHC} if nano else {}))
    plan = PLANS[kind]
    share = share and kind in ("F1", "fwd", "exact", "whole")
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, m.config.vocab_size, (2, 48), generator=gen)
    prompts = [idx[0, :40].tolist(), idx[1, :37].tolist()]
    graphs = []

    def backend(gm, example):
        graphs.append(gm.code)
        from torch._dynamo.backends.common import aot_autograd
        return aot_autograd(fw_compiler=lambda g, _: g.forward)(gm, example)

    prev = set_window_kernel("masked")
    try:
        with torch.no_grad():
            runner = bind(m, plan, check_finite=False, share_weights=share)
            ref = (m(idx), runner(idx), parallel_forward(m, idx, plan))
            ref_dec = [r.tokens for r in snlp_generate(m, prompts, plan, max_new_tokens=4)]
            set_window_kernel("flex")
            torch._dynamo.reset()
            got = tuple(torch.compile(f, backend=backend, fullgraph=True)() for f in (lambda: m(idx),
                                                                                      lambda: runner(idx)))
            assert len(graphs) == 2 and all("flex_attention" in g for g in graphs)
            for a, b in zip(got + (parallel_forward(m, idx, plan),), ref):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            assert [r.tokens for r in snlp_generate(m, prompts, plan, max_new_tokens=4)] == ref_dec
    finally:
        set_window_kernel(prev)


# ----------------------------------------------------------------------------- the regulariser on a row fraction
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["F1", "hcn", "diag"]), seed=st.integers(0, 50), B=st.integers(1, 5),
       rows=st.sampled_from([0.01, 0.2, 0.25, 0.5, 0.6, 0.75, 1.0]), masked=st.booleans(), sft_plan=st.booleans(),
       nano=st.booleans(), windows=st.sampled_from(list(WINDOWS)), N=st.sampled_from([3, 6]),
       stride=st.sampled_from([0, 2]), detach=st.booleans())
def test_regulariser_row_fraction_equals_a_fresh_call_on_its_rows(kind, seed, B, rows, masked, sft_plan, nano,
                                                                   windows, N, stride, detach):
    """`snlp train / sft --reg-rows F` (RegConfig.rows): the training step's loss, regulariser term and every gradient
    equal the CE over all B rows plus lambda x a FRESH regulariser call (rows = 1, its own sequential trace) on the
    first r = ceil(F B) rows and their valid mask (a padded subset's masked sum over r / B of the whole batch's real
    tokens), fp64; F = 1 is r = B (bit for bit: tests/train/test_reg_rows.py).
    Crossed with the surrogate (IDN, HCN on an mHC model, DiagN), a padded SFT batch's mask, the SNLP-forward SFT
    step (a plan's CE; the regulariser's trace of its rows only), nanochat's parts and window widths. Compiled: the
    eager cell's reference (tests/train/test_compiled.py, slow). Refused: F outside (0, 1] and an F that leaves no
    row, each a one-line ValueError naming --reg-rows."""
    import torch.nn.functional as F

    from snlp.train.job import TrainStep
    from snlp.train.regularizer import RegConfig, check_rows, snlp_loss

    sur = {"F1": "idn", "hcn": "hcn", "diag": "diag"}[kind]
    m = model_for(kind, seed, {"nanochat": nano, "windows": windows})
    gen = torch.Generator().manual_seed(seed)
    T = 9
    x, y = (torch.randint(0, m.config.vocab_size, (B, T), generator=gen) for _ in range(2))
    valid = None
    if masked:  # each row's real tokens first, as snlp.io.chat.collate pads
        valid = torch.arange(T)[None, :] < torch.randint(1, T + 1, (B,), generator=gen)[:, None]  # (B, T)
    plan = Plan.parse("2xF2-h0-K1") if sft_plan and kind != "hcn" else None
    lam = 0.5
    cfg = RegConfig(surrogate=sur, lam=lam, suffixes=(N,), stride=stride, detach=detach, rows=rows)
    r = min(B, math.ceil(round(rows * B, 9)))
    assert cfg.n_rows(B) == r >= 1
    step = TrainStep(m, cfg, plan)
    extra = () if valid is None else (valid,)
    torch.manual_seed(seed)  # DiagN draws its probe from the global RNG: the reference below draws the same one
    loss, ce, rg = step(x, y, lam, *extra)
    loss.backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    # the reference: the CE of the whole batch (sequential, or the plan's logits) + a fresh call on the first r rows
    logits = m(x) if plan is None else parallel_forward(m, x, plan, check_finite=False)
    ref_ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)
    xs = x[:r].clone()
    fresh = RegConfig(surrogate=sur, lam=lam, suffixes=(N,), stride=stride, detach=detach)
    torch.manual_seed(seed)
    ref_rg = snlp_loss(m, xs, m.hidden_states(xs), fresh, None if valid is None else valid[:r].clone())
    tol = 1e-10
    if valid is not None and r < B:  # a subset's masked sum is over r / B of the whole batch's real tokens
        ref_rg = ref_rg * valid[:r].sum().clamp(min=1) / (valid.sum().clamp(min=1) * r / B)
        tol = 2e-7  # the term's own fp32 arithmetic against the rescaled reference
    torch.testing.assert_close(rg, ref_rg.detach(), rtol=tol, atol=1e-12)
    torch.testing.assert_close(ce.double(), ref_ce.detach().double(), rtol=1e-10, atol=1e-12)
    (ref_ce + lam * ref_rg).backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    assert got.keys() == want.keys()
    for n in want:  # (the rescaled reference: fp32 rounding of the term reaches the gradients)
        torch.testing.assert_close(got[n], want[n], rtol=1e-9 if tol == 1e-10 else 1e-6,
                                   atol=1e-11 if tol == 1e-10 else 1e-7, msg=n)
    for bad in (0.0, -rows, 1.0 + rows, float("nan")):
        with pytest.raises(ValueError, match=r"--reg-rows must lie in \(0, 1\]") as e:
            RegConfig(surrogate=sur, rows=bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="--reg-rows .* leaves the regulariser no row"):
        check_rows(1e-12, B)


# ----------------------------------------------------------------------------- causal plans (fixed cells)
# Plan.causal: the paper code's full-causal suffix (every suffix branch's window dropped, the prefix keeps its own).
# Reference: a copy of the model whose suffix layers' windows are full (-1) in its config, run with the same plan
# without the option (the same parameters, so bit for bit in fp64), or its argmax loop; the decoders that verify
# (speculative, drafter=, jacobi) the windowed model's own argmax loop. A model whose suffix has no window refuses it.
CAUSAL_PLANS = ("6xF1-h0-K1-causal", "3xF2-h0-K1-causal", "6xF1-h0-K6-causal", "6xF1-fwd-K2-causal")


def full_suffix_copy(m: GPT, n_suffix: int) -> GPT:
    cfg = m.config
    depth = cfg.n_layer
    wins = [cfg.window(l) if l < depth - n_suffix else -1 for l in range(depth)]
    ref = GPT(GPTConfig(**{**cfg.to_dict(), "layer_windows": wins})).to(m.wte.weight.dtype)
    ref.load_state_dict(m.state_dict())
    return ref.eval()


@pytest.mark.parametrize("windows", list(WINDOWS))
@pytest.mark.parametrize("plan", CAUSAL_PLANS)
def test_causal_plan_cells_equal_the_full_suffix_copy(plan, windows):
    """bind / Runner (shared where M = 1), snlp_generate (one prompt, ragged batch, (B, T) tensor), speculative (the
    plan's forward and drafter=), Jacobi and evaluate with a causal plan, against the full-suffix copy; refused in one
    line where no suffix layer has a window."""
    m = model_for("F1", 5, {"value_embeds": True, "nanochat": False, "windows": windows})
    p = Plan.parse(plan, L)
    idx = torch.randint(0, m.config.vocab_size, (3, 13), generator=torch.Generator().manual_seed(5))
    if all(m.config.window(l) < 0 for l in range(L - p.n_suffix, L)):
        for call in (lambda: bind(m, plan), lambda: snlp_generate(m, [1, 2, 3], plan, 2),
                     lambda: speculative_generate(m, [1, 2, 3], plan, max_new_tokens=2)):
            with pytest.raises(ValueError, match="changes nothing") as err:
                call()
            assert "\n" not in str(err.value)
        return
    plain = p.with_(causal=False)
    ref = full_suffix_copy(m, p.n_suffix)
    with torch.no_grad():
        want = bind(ref, plain)(idx)
        assert torch.equal(bind(m, p)(idx), want)
        assert torch.equal(parallel_forward(m, idx, p), want)
        if p.fuse == 1:  # the shared-weights path against the copy's shared-weights path: the same kernels, so bit
            # for bit (against `want` it is a different summation order, equal only to round-off on some CPUs)
            shared = bind(m, p, share_weights=True)(idx)
            assert torch.equal(shared, bind(ref, plain, share_weights=True)(idx))
            torch.testing.assert_close(shared, want, rtol=0, atol=1e-12)
    prompts, n = [idx[0, :6].tolist(), idx[1, :11].tolist(), idx[2, :3].tolist()], 6
    # cached SNLP decoding = the per-step forward for K = 1 from h0 and from K = C on (the K < C fwd plan: each row
    # equals the same prompt decoded alone)
    cached_is_forward = p.init == "h0" and (p.iters == 1 or p.iters >= p.chunks)
    for arg in (prompts[0], prompts, torch.tensor([prompts[0], prompts[0]])):
        got = snlp_generate(m, arg, p, n)
        rows = [got.tokens] if not isinstance(got, list) else [r.tokens for r in got]
        used = [prompts[0]] if isinstance(arg, list) and not isinstance(arg[0], list) else \
            prompts if isinstance(arg, list) else [prompts[0], prompts[0]]
        for q, toks in zip(used, rows):
            want_toks = argmax_loop(bind(ref, plain), q, n) if cached_is_forward else snlp_generate(m, q, p, n).tokens
            assert toks == want_toks, (plan, windows, q)
            if cached_is_forward:
                assert toks == snlp_generate(ref, q, plain, n).tokens
    seq = [argmax_loop(m, q, n) for q in prompts]
    assert [r.tokens for r in speculative_generate(m, prompts, p, block=3, max_new_tokens=n)] == seq
    assert [r.tokens for r in speculative_generate(m, prompts, p, block=2, max_new_tokens=n,
                                                   drafter=make_drafter(m, p))] == seq
    assert jacobi_generate(m, prompts[1], p, block=3, max_new_tokens=n).tokens == seq[1]
    if p.iters >= p.chunks and windows == "SL":  # evaluate: the row's PPL is the copy's sequential PPL
        val = torch.randint(0, m.config.vocab_size, (120,), generator=torch.Generator().manual_seed(6))
        cfg = EvalConfig(seq_len=16, max_tokens=48, prompts=1, prompt_len=4, gen_tokens=3, warmup=0, runs=1,
                         time_tokens=2, emb=False, progress=False, batch=2)
        seq_rec, rec = evaluate(m, val, [plan], cfg)
        wins = torch.stack([val[i * 16:(i + 1) * 16 + 1] for i in range(3)])
        with torch.no_grad():
            logp = torch.log_softmax(ref(wins[:, :-1]).double(), -1)
        nll = -logp.gather(-1, wins[:, 1:, None]).mean()
        assert rec.ppl == pytest.approx(math.exp(float(nll)), rel=1e-6) and rec.ppl != seq_rec.ppl


# ----------------------------------------------------------------------------- model parts x decoding entry points
@st.composite
def part_models(draw):
    """A random fp64 model of 1-5 layers with any mix of the parts GPTConfig has: GQA ratios 1-4, windows per layer
    (0, 1, 2, 3, 5, wider than every sequence, full) or a tiled pattern (short_window 0: sequence_len // 2), value
    embeddings, x0 residual, smear, backout, softcap 0 or > 0, rope bases, tied embeddings, learned norm weights, mHC
    with 1-3 streams (dynamic / static, sigmoid / softmax maps), the Llama-family switches (SwiGLU, q/k/v biases,
    QK-norm kinds, no embedding norm, rotate-half RoPE, explicit head dim, linear RoPE scaling) and nanochat-snlp's
    q/k scale and VE gate. Vocabulary 50, width 16 or 32 (the smear gate reads 24 channels)."""
    L, hc = draw(st.integers(1, 5)), draw(st.sampled_from([0, 0, 0, 1, 2, 3]))
    smear = draw(st.booleans())
    n_kv = draw(st.sampled_from([1, 2]))
    n_head = n_kv * draw(st.sampled_from([1, 2, 4]))
    cfg = dict(vocab_size=50, n_layer=L, n_head=n_head, n_kv_head=n_kv,
               n_embd=32 if smear else draw(st.sampled_from([16, 32])),
               sequence_len=draw(st.sampled_from([8, 16, 64])), value_embeds=draw(st.booleans()), smear=smear,
               backout=draw(st.booleans()), softcap=draw(st.sampled_from([0.0, 2.0, 15.0])),
               rope_base=draw(st.sampled_from([7.0, 10000.0, 500000.0])), hc_streams=hc, hc_dynamic=draw(st.booleans()),
               window_pattern=draw(st.sampled_from(["L", "SL", "S"])), short_window=draw(st.sampled_from([0, 1, 3])),
               rope_bf16=draw(st.booleans()))
    if draw(st.booleans()):
        cfg["layer_windows"] = draw(st.lists(st.sampled_from([-1, 0, 1, 2, 3, 5, 100]), min_size=L, max_size=L))
    if hc:
        if draw(st.booleans()):
            cfg.update(hc_maps="softmax", hc_sinkhorn_iters=draw(st.sampled_from([3, 10])),
                       hc_sinkhorn_tau=draw(st.sampled_from([1.0, 0.05])))
    else:
        cfg.update(x0_residual=draw(st.booleans()), tie_embeddings=draw(st.booleans()),
                   norm_weights=draw(st.booleans()))
    if draw(st.booleans()):
        cfg.update(mlp_act=draw(st.sampled_from(["relu2", "swiglu"])), qkv_bias=draw(st.booleans()),
                   qk_norm=draw(st.sampled_from(["rope_norm", "weighted", "none"])), embed_norm=draw(st.booleans()),
                   rope_rotate_half=draw(st.booleans()), attn_head_dim=draw(st.sampled_from([0, 0, 4, 12])),
                   rope_scaling=draw(st.sampled_from([None, {"rope_type": "linear", "factor": 2.0}])))
    if cfg.get("qk_norm", "rope_norm") == "rope_norm" and draw(st.booleans()):
        cfg.update(qk_scale=1.2, ve_gate_channels=draw(st.sampled_from([4, 12, 32])), ve_gate_scale=3.0)
    m = make_model(seed=draw(st.integers(0, 50)), **cfg)
    if hc:  # H_res that really mix the streams
        gen = torch.Generator().manual_seed(L + hc)
        with torch.no_grad():
            for block in m.blocks:
                for h in (block.hc_attn, block.hc_mlp):
                    h.bias[: hc * hc] = torch.randn(hc * hc, generator=gen, dtype=h.bias.dtype)
    return m


@st.composite
def part_plans(draw, L: int, hc: int):
    """A plan for an L-layer model: M = 1 or 2, any C that fits, h0 / fwd, K from 0 to 2C, every surrogate the model
    takes, and order:reversed / elk / causal."""
    M = draw(st.sampled_from([1, 2])) if L >= 2 else 1
    C = draw(st.integers(1, L // M))
    sur = draw(st.sampled_from(["", "-none", "-diag", "-newton"] + (["-hcn"] if hc else [])))
    extra = draw(st.sampled_from(["", "", "-causal"] + ([] if sur == "-none" else ["-order:reversed", "-elk:0.3"])))
    return f"{C}xF{M}-{draw(st.sampled_from(['h0', 'fwd']))}-K{draw(st.sampled_from([0, 1, 2, C, 2 * C]))}{sur}{extra}"


def plan_function(m: GPT, plan: str):
    """The logits function whose full-prefix argmax loop KV-cached SNLP decoding with `plan` claims to equal
    (snlp_generate's docstring), or None where it claims none: from plan.exact_iters() on without tol, the model for
    M = 1 and its fused model for M > 1; where the solve evaluates the suffix once (K = 1 from h0 with idn / none /
    hcn, K = 0 from any init), the plan's own forward over the whole prefix. A causal plan: the same, on the copy of
    the model whose suffix windows are full."""
    p = Plan.parse(plan, m.config.n_layer)
    if p.causal:
        return plan_function(full_suffix_copy(m, p.n_suffix), str(p.with_(causal=False)))
    if not p.tol and p.iters >= p.exact_iters():
        return m if p.fuse == 1 else (lambda idx: fused_forward(m, idx, p))
    once = (p.iters == 1 and p.init == "h0") or p.iters == 0
    if once and p.order is None and p.surrogate.token in ("idn", "none", "hcn"):
        return lambda idx: parallel_forward(m, idx, p)
    return None


def check_stop_and_rounds(res, got: list[int], n: int, eos, max_len: int | None, prompt_len: int) -> None:
    """GenerateResult's stop and round counters against the tokens: stop "eos" where the last token is a stop id,
    "max_len" where the cache ended the budget, else "max_new_tokens"; a drafting decoder's rounds each keep their
    accepted drafts plus the verifier's token (none after an accepted stop id), drafted >= usable >= examined >=
    accepted, at most one rejection per round."""
    stops = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    want = "eos" if got and got[-1] in stops else "max_len" if max_len is not None and n > max_len - prompt_len \
        else "max_new_tokens"
    assert res.stop == want, (res.stop, want)
    if res.mode in ("speculative", "jacobi"):
        assert res.drafted >= res.usable >= res.examined >= res.accepted >= 0
        assert res.examined - res.accepted <= res.rounds
        ended_on_draft = bool(got) and got[-1] in stops and res.accepted + res.rounds == len(got) + 1
        assert len(got) == res.accepted + res.rounds - ended_on_draft


PART_ENTRIES = ("sequential", "sequential_batch", "snlp", "snlp_batch", "speculative", "speculative_batch", "adaptive",
                "drafter", "jacobi", "jacobi_plan", "jacobi_unverified")


@settings(max_examples=examples(60), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data(), entry=st.sampled_from(PART_ENTRIES), prompt_len=st.sampled_from([1, 2, 3, 7, 12, 20]),
       n=st.sampled_from([0, 1, 3, 8, 14]), seed=st.integers(0, 50),
       eos=st.one_of(st.none(), st.integers(0, 49), st.lists(st.integers(0, 49), min_size=1, max_size=2)),
       room=st.one_of(st.none(), st.integers(0, 4)), block=st.integers(1, 5))
def test_model_parts_at_every_decoding_entry_equal_the_argmax_loop(data, entry, prompt_len, n, seed, eos, room, block):
    """Every model part GPTConfig has (part_models), crossed with every greedy decoding entry (one prompt of 1 to 20
    tokens, past the widest window, and ragged batches whose other row may be longer), plans of every shape the
    model takes (part_plans), an EOS id or several, and a max_len that may end the budget before max_new_tokens (fp64):
    sequential, speculative (the plan's forward, adaptive blocks, an adapted-style drafter whose suffix, full or
    LoRA, differs from the model's) and verified Jacobi equal the model's full-prefix argmax loop; snlp_generate and
    unverified Jacobi equal the argmax loop of the function their plan claims (plan_function; plans that claim none are
    drawn again); every result's stop and round counters match its tokens."""
    m = data.draw(part_models())
    cfg = m.config
    plan = data.draw(part_plans(cfg.n_layer, cfg.hc_streams))
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 50, (prompt_len,), generator=gen).tolist()
    other = torch.randint(0, 50, (int(torch.randint(1, 13, (1,), generator=gen)),), generator=gen).tolist()
    max_len = None if room is None else max(prompt_len, len(other)) + room
    budget = n if max_len is None else min(n, max_len - prompt_len)
    note(f"entry {entry}, plan {plan}, config {cfg}")
    p = Plan.parse(plan, cfg.n_layer)
    warm = entry.startswith("jacobi_") and data.draw(st.booleans())  # jacobi_generate(warm_start=...)
    # a causal plan on a model whose suffix has no window is refused (it would change nothing)
    causal_refused = entry not in ("sequential", "sequential_batch", "jacobi") and p.causal and all(
        cfg.window(l) < 0 for l in range(cfg.n_layer - p.n_suffix, cfg.n_layer))
    fn = m
    if entry in ("snlp", "snlp_batch", "jacobi_unverified") and not causal_refused:
        fn = plan_function(m, plan)
        assume(fn is not None)  # no law but batch independence (test_decoding_cell_equals_its_reference_or_is_refused)
        # unverified Jacobi keeps what its last SNLP iteration reproduces, after a prompt prefilled by the model
        # itself: the model's loop where the plan is exact with M = 1 (for M > 1 or causal, neither the model's nor
        # the plan's function: the prompt's K/V are the model's); a warm start replaces the fwd init by stale states,
        # so there it is exact from the h0 init's count
        assume(entry != "jacobi_unverified" or (fn is m and (not warm or p.iters >= p.with_(init="h0").exact_iters())))
    if entry == "drafter":
        assume(not cfg.hc_streams)  # drafters of mHC models are refused (test_decoding_cell_equals_its_reference_...)
    if entry in ("snlp_batch", "speculative_batch"):
        assume(not isinstance(p.surrogate, (DiagN, Newton)))  # refused in a batch (the matrix's refusals)
    kw = dict(max_new_tokens=n, eos_id=eos, max_len=max_len)
    try:
        if entry == "sequential":
            res = sequential_generate(m, prompt, **kw)
        elif entry == "sequential_batch":
            res = sequential_generate(m, [other, prompt], **kw)[1]
        elif entry == "snlp":
            res = snlp_generate(m, prompt, plan, **kw)
        elif entry == "snlp_batch":
            res = snlp_generate(m, [other, prompt], plan, read_every=data.draw(st.sampled_from([None, 3])), **kw)[1]
        elif entry in ("speculative", "adaptive"):
            res = speculative_generate(m, prompt, plan, block=block, adaptive=entry == "adaptive",
                                       min_confidence=data.draw(st.sampled_from([0.0, 0.5])), **kw)
        elif entry == "speculative_batch":
            res = speculative_generate(m, [other, prompt], plan, block=block, **kw)[1]
        elif entry == "drafter":
            # LoRA drafters cover bias-free linear layers only (refused with q/k/v biases)
            d = make_drafter(m, plan, rank=0 if cfg.qkv_bias else data.draw(st.sampled_from([0, 2])))
            with torch.no_grad():  # an adapted drafter: its own suffix, whatever it drafts the model verifies
                g = torch.Generator().manual_seed(seed + 1)
                for v in d.suffix_state().values():
                    v.add_(torch.randn(v.shape, generator=g, dtype=v.dtype) * 0.2)
            res = speculative_generate(m, prompt, plan, block=block, drafter=d, **kw)
        elif entry == "jacobi":
            res = jacobi_generate(m, prompt, None, block=block, **kw)
        else:
            res = jacobi_generate(m, prompt, plan, block=block, verify=entry == "jacobi_plan", warm_start=warm, **kw)
    except ValueError as e:
        assert causal_refused and "changes nothing" in str(e), f"{entry} {plan}: refused: {e}"
        return
    assert not causal_refused, f"{entry} {plan}: a causal plan whose suffix has no window ran"
    want = argmax_loop(fn, prompt, budget, eos) if budget > 0 else []
    assert res.tokens == want, f"{entry} {plan}: {res.tokens} != reference {want}"
    check_stop_and_rounds(res, res.tokens, n, eos, max_len, prompt_len)


def test_unverified_jacobi_prefills_the_prompt_with_the_model():
    """jacobi_generate(verify=False) prefills the prompt with the model's own forward (its docstring): from
    exact_iters() on an M = 1 plan without tol decodes the model's argmax loop (with warm_start from the h0 init's
    count); an
    exact M = 2 plan decodes neither the model's loop nor the fused model's (snlp_generate's, whose prefill is the
    plan's solve)."""
    m = make_model(seed=1, vocab_size=50, n_layer=2, n_head=2, n_kv_head=2, window_pattern="L")
    prompt, n = [7, 17], 8
    model_loop = argmax_loop(m, prompt, n)
    assert jacobi_generate(m, prompt, "2xF1-h0-K2", block=3, max_new_tokens=n, verify=False).tokens == model_loop
    fused_loop = argmax_loop(lambda idx: fused_forward(m, idx, "1xF2-h0-K1"), prompt, n)
    assert snlp_generate(m, prompt, "1xF2-h0-K1", n).tokens == fused_loop
    got = jacobi_generate(m, prompt, "1xF2-h0-K1", block=3, max_new_tokens=n, verify=False).tokens
    assert got != fused_loop and got != model_loop
    # a warm start replaces the fwd init (chunk 0 exact from the start) by the previous JD iteration's states: exact
    # from the h0 init's count C, not from exact_iters() = C - 1
    for plan, exact in (("2xF1-fwd-K1", False), ("2xF1-fwd-K2", True), ("1xF1-fwd-K0", False), ("1xF1-fwd-K1", True)):
        assert jacobi_generate(m, prompt, plan, block=3, max_new_tokens=n, verify=False).tokens == model_loop
        warm = jacobi_generate(m, prompt, plan, block=3, max_new_tokens=n, verify=False, warm_start=True).tokens
        assert (warm == model_loop) == exact, plan
    # a tol plan stops its solve before K (the docstring's "without tol"): K = C is no longer the model's loop
    assert jacobi_generate(m, prompt, "2xF1-h0-K2-tol:3", block=3, max_new_tokens=n, verify=False).tokens != model_loop


# ----- the logits' dtype: max(model dtype, fp32) at every entry point that returns logits -----
LOGITS_PLAN = "3xF1-h0-K3"  # K >= C: exact, so its logits equal the naive ones


def logits_entries(m: GPT, idx: torch.Tensor) -> dict:
    """Every entry point's logits for idx (B, T) on model m (the single-process ones)."""
    from snlp.decode.steps import Step, sequential_fn, sequential_step, snlp_fn, snlp_step
    from snlp.method.solver import solve
    from snlp.model.cache import KVCache

    def cached(step):
        return step(idx, KVCache.for_model(m, batch=idx.shape[0]))  # sequence_len 32: room for the prefill pad

    runner, loose = bind(m, LOGITS_PLAN), bind(m, LOGITS_PLAN, check_finite=False)
    out = {"forward": m(idx), "forward keep=1": m(idx, keep=1), "forward cache": cached(lambda x, c: m(x, cache=c)),
           "head(solve)": m.head(solve(m, idx, LOGITS_PLAN).hidden), "bind": runner(idx),
           "bind keep=1": runner(idx, keep=1), "bind cache": cached(lambda x, c: runner(x, cache=c)),
           "parallel_forward": parallel_forward(m, idx, LOGITS_PLAN), "fused_forward": fused_forward(m, idx, "3xF2-h0-K1"),
           "sequential_step": cached(sequential_step(m)), "snlp_step": cached(snlp_step(loose)),
           "Step sequential": cached(Step(sequential_fn(m), "cpu", compile=False)),
           "Step snlp": cached(Step(snlp_fn(loose), "cpu", compile=False))}
    if m.lm_head.weight.dtype == torch.float64:  # dynamo over the promote (the eager backend: no inductor build)
        out["Step compiled"] = cached(Step(sequential_fn(m), "cpu", backend="eager"))
    return out


def _dist_logits_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from conftest import init_gloo

    from snlp.dist.layer_parallel import DistributedSNLP

    init_gloo(rank, world, port)
    res = {}
    for name, dt in (("fp64", torch.float64), ("bf16", torch.bfloat16)):
        m = make_model(n_layer=6, dtype=dt)
        runner = DistributedSNLP(m, LOGITS_PLAN, keep_layers=True)
        idx = torch.randint(0, m.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
        res[name] = {"solve": runner.solve(idx).logits, "pipeline_forward": runner.pipeline_forward(idx)}
    torch.save(res, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_logits_are_fp32_at_least_and_fp64_in_an_fp64_model(dtype):
    """GPT.head cast its logits to fp32: an fp64 model's logits were rounded to fp32 at every entry point, so no
    fp64 reference could compare logits below fp32's round-off. The law: logits come in max(model dtype, fp32) from
    the model's forward (keep=, a cache), head(solve(...)), a bound Runner, parallel_forward, fused_forward, every
    decode step (eager, static-shape, compiled); an fp64 model's equal a naive fp64 computation of them."""
    m = make_model(n_layer=6, dtype=DTYPES[dtype])
    idx = torch.randint(0, m.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    want = torch.promote_types(DTYPES[dtype], torch.float32)
    with torch.no_grad():
        got = logits_entries(m, idx)
    assert {k: v.dtype for k, v in got.items()} == {k: want for k in got}
    if dtype == "fp64":  # the head written out in fp64 on the layers' output: RMSNorm, lm_head, softcap
        with torch.no_grad():
            ctx = m.embed(idx)
            h = m.run_layers(ctx.x0, ctx, 0, m.config.n_layer)
            eps = m.config.norm_eps or torch.finfo(torch.float64).eps
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1 if m.ln_f is None else m.ln_f)
            z = h @ m.lm_head.weight.T
            c = m.config.softcap
            naive = c * torch.tanh(z / c) if c > 0 else z
        torch.testing.assert_close(got["forward"], naive, rtol=0, atol=1e-12)
        for k in ("bind", "parallel_forward", "sequential_step", "Step sequential", "Step compiled"):
            torch.testing.assert_close(got[k], naive, rtol=0, atol=1e-10, msg=k)


def test_distributed_logits_are_fp32_at_least_and_fp64_in_an_fp64_model(tmp_path):
    """The layer-parallel runner's logits (DistributedSNLP.solve(...).logits, pipeline_forward; one gloo rank) come
    in max(model dtype, fp32), as the single-process entry points' (the head is the model's)."""
    from conftest import spawn_ranks

    spawn_ranks(_dist_logits_worker, 1, str(tmp_path))
    res = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert {k: {e: t.dtype for e, t in v.items()} for k, v in res.items()} == {
        "fp64": {"solve": torch.float64, "pipeline_forward": torch.float64},
        "bf16": {"solve": torch.float32, "pipeline_forward": torch.float32}}

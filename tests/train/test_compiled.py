"""The compiled training step (snlp.train.compiled) against the eager one, and its model-FLOPs / MFU arithmetic.

References: the eager TrainStep under autograd (loss, CE, regulariser and every parameter's gradient, fp32) for
the compiled step; dynamo's own counters (graphs compiled, graph breaks) and `error_on_recompile` for "one graph,
traced once"; a hand count of the model's matmuls for FlopCounterMode's number. Inductor compiles C++ on the CPU:
the models are tiny (depth 3, width 64) and each test compiles one graph."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from snlp.method.plan import Plan
from snlp.model.config import VE_GATE_CHANNELS
from snlp.runtime.peak import PEAK_BF16_TFLOPS, peak_for_name
from snlp.train.compiled import CompiledStep, check_compile
from snlp.train.flops import mfu, step_flops
from snlp.train.job import TrainStep
from snlp.train.regularizer import RegConfig
from conftest import make_model

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(**cfg):
    """fp32, non-identity blocks, GQA (2 query heads, 1 KV head), sliding-window layers (the mask path)."""
    return make_model(**{"dtype": torch.float32, "n_layer": 3, "n_embd": 64, "n_head": 2, "n_kv_head": 1,
                         "vocab_size": 64, "sequence_len": 16, **cfg}).train()


def batch(seed: int, B: int = 2, T: int = 16, V: int = 64):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    y[0, :3] = -1  # ignored targets, as SFT's masks make them
    return x, y


def eager_reference(step: TrainStep, x, y, lam: float):
    """(loss, ce, reg, {name: grad}) of the eager step; leaves the gradients cleared."""
    loss, ce, rg = step(x, y, lam)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in step.model.named_parameters() if p.grad is not None}
    step.model.zero_grad(set_to_none=True)
    return loss.detach(), ce, rg, grads


def run_compiled_against_eager(step: TrainStep, lams: list[float]) -> CompileCounterWithBackend:
    """Call the compiled step on a new batch and lambda each time, with the weights updated in place in between
    (an optimizer's way): loss, CE, regulariser and every gradient equal the eager step's. After the first call a
    recompile is an error (dynamo's error_on_recompile)."""
    counters.clear()
    backend = CompileCounterWithBackend("inductor")
    compiled = CompiledStep(step, "cpu", backend=backend)
    for i, lam in enumerate(lams):
        x, y = batch(i)
        ref = eager_reference(step, x, y, lam)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            loss, ce, rg = compiled(x, y, lam)
            loss.backward()
        torch.testing.assert_close(loss.detach(), ref[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ce, ref[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rg, ref[2], rtol=1e-5, atol=1e-6)
        grads = {n: p.grad for n, p in step.model.named_parameters() if p.grad is not None}
        assert grads.keys() == ref[3].keys()
        for n in grads:
            torch.testing.assert_close(grads[n], ref[3][n], rtol=1e-4, atol=1e-6, msg=n)
        with torch.no_grad():  # a step of plain SGD: the graph must read the live weights, not copies of them
            for p in step.model.parameters():
                if p.grad is not None:
                    p.sub_(0.05 * p.grad)
        step.model.zero_grad(set_to_none=True)
    assert backend.frame_count == 1  # one graph, traced once for all the calls
    assert not counters["graph_break"], dict(counters["graph_break"])
    return backend


@pytest.mark.slow
def test_compiled_pretraining_step_with_regulariser_equals_eager_and_compiles_once():
    """The sequential forward, CE and the IDN regulariser's K=1 solve (N = 2 of 3 layers: 2 chunks, K=1 is not
    exact, so the term is non-zero) in one graph; lambda ramping (--reg-warmup) is an input, not a recompile."""
    step = TrainStep(tiny(), RegConfig(surrogate="idn", lam=0.5, suffixes=(2,), warmup=4))
    lams = [step.reg.weight(s) for s in range(3)]
    assert len(set(lams)) == 3
    assert float(eager_reference(step, *batch(0), lams[0])[2]) > 1e-3  # the regulariser really contributes
    run_compiled_against_eager(step, lams)


@pytest.mark.slow
def test_compiled_step_on_a_row_fraction_equals_eager_and_compiles_once():
    """--reg-rows 0.5 (the solve on the first ceil(F B) rows): the row count is a Python int of the static batch shape,
    so the slice is part of the one graph, traced once whatever lambda (--reg-warmup), and equal to eager."""
    step = TrainStep(tiny(), RegConfig(surrogate="idn", lam=0.5, suffixes=(2,), warmup=4, rows=0.5))
    assert step.reg.n_rows(batch(0)[0].size(0)) == 1
    lams = [step.reg.weight(s) for s in range(3)]
    assert float(eager_reference(step, *batch(0), lams[0])[2]) > 1e-3
    run_compiled_against_eager(step, lams)


@pytest.mark.slow
def test_compiled_snlp_forward_sft_step_equals_eager_and_compiles_once():
    """SNLP-forward SFT: CE on the logits of a fused plan's solve (chunk weights rebuilt from the parameters inside
    the graph, gradients through the K iterations)."""
    step = TrainStep(tiny(x0_residual=False), RegConfig(), Plan.parse("1xF2-h0-K2"))
    run_compiled_against_eager(step, [0.0, 0.0, 0.0])


def test_compile_refuses_what_does_not_trace_into_one_graph():
    with pytest.raises(ValueError, match="--reg diag"):
        check_compile(RegConfig(surrogate="diag"))
    with pytest.raises(ValueError, match="tol"):
        check_compile(RegConfig(), Plan.parse("2xF1-h0-K4-tol1e-3"))
    check_compile(RegConfig(surrogate="idn"), Plan.parse("2xF1-h0-K2"))  # these compile


def matmul_params(model) -> int:
    """Every weight a matmul reads: the blocks' 2-D matrices and lm_head (embedding tables are lookups)."""
    return sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks")) \
        + model.lm_head.weight.numel()


def attn_flops(cfg, layers, T: int) -> int:
    """nanochat's estimate_flops attention term per token: 12 x heads x head_dim x min(window, T) per layer (forward
    QK^T and PV: 4; backward: 8), the full T for a causal layer."""
    return sum(12 * cfg.n_head * cfg.head_dim * (T if cfg.window(l) < 0 else min(cfg.window(l), T)) for l in layers)


@pytest.mark.parametrize("window_pattern, short_window, T", [("L", 3, 16), ("SL", 3, 16), ("SSL", 5, 16),
                                                             ("SL", 200, 256), ("S", 40, 256)])
def test_step_flops_equal_a_hand_count(window_pattern, short_window, T, monkeypatch):
    """6 FLOPs per matmul weight per token (forward 2, backward 4) and nanochat's estimate_flops attention term
    (attn_flops): a window layer charged its window, whatever kernel the device takes (T = 256 with a 40-token window:
    the banded kernel on this CPU, which counted only its tiles; the masked one on CUDA counted the square). The
    regulariser adds its K=1 solve: N suffix layers once more (the prefix state is the trace's)."""
    from snlp.model import ops

    model = tiny(window_pattern=window_pattern, short_window=short_window, sequence_len=T)
    cfg = model.config
    x, y = batch(0, T=T)
    B = x.shape[0]
    if short_window == 40:  # the case whose count depended on the kernel: the banded one is this CPU's choice
        assert ops.uses_band(T, short_window, "cpu")
    attn = attn_flops(cfg, range(cfg.n_layer), T)
    for kernel in ("auto", "banded", "masked"):  # the device's choice does not change the count
        monkeypatch.setattr(ops, "_window_kernel", kernel)
        assert step_flops(TrainStep(model, RegConfig()), x, y, 0.0, nullcontext) / (B * T) == \
            6 * matmul_params(model) + attn
    plain = step_flops(TrainStep(model, RegConfig()), x, y, 0.0, nullcontext) / (B * T)
    assert plain == 6 * matmul_params(model) + attn
    N = 2
    reg = step_flops(TrainStep(model, RegConfig(surrogate="idn", suffixes=(N,))), x, y, 0.5, nullcontext) / (B * T)
    suffix = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "ve_gate" not in n
                 and any(n.startswith(f"blocks.{l}.") for l in range(cfg.n_layer - N, cfg.n_layer)))
    # the solve's batched chunks all run a value-embedding gate (zero weights and a zero embedding slot for a layer
    # without one): executed matmuls, counted
    gate = cfg.n_kv_head * min(VE_GATE_CHANNELS, cfg.n_embd) if hasattr(model, "value_embeds") else 0
    assert reg == plain + 6 * (suffix + N * gate) + attn_flops(cfg, range(cfg.n_layer - N, cfg.n_layer), T)
    assert all(p.grad is None for p in model.parameters())  # counting leaves no gradients behind
    assert ops.window_kernel() == "masked"  # as monkeypatch left it: counting restores the kernel


@pytest.mark.parametrize("rows", [0.25, 0.5, 0.6, 1.0])
def test_step_flops_of_a_row_fraction_scale_the_regulariser_by_its_rows(rows):
    """--reg-rows F: the regulariser's K=1 solve runs on r = ceil(F B) of the B rows, so its FLOPs per token are the
    hand count of the whole batch's solve (as above) times r / B, and the plain step's are unchanged:
    FLOPs = plain x (1 + (reg extra) x r / B)."""
    model = tiny()
    cfg = model.config
    x, y = batch(0, B=5)
    B, T = x.shape
    plain = step_flops(TrainStep(model, RegConfig()), x, y, 0.0, nullcontext)
    assert plain == (6 * matmul_params(model) + attn_flops(cfg, range(cfg.n_layer), T)) * B * T
    N = 2
    suffix = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "ve_gate" not in n
                 and any(n.startswith(f"blocks.{l}.") for l in range(cfg.n_layer - N, cfg.n_layer)))
    gate = cfg.n_kv_head * min(VE_GATE_CHANNELS, cfg.n_embd) if hasattr(model, "value_embeds") else 0
    extra = 6 * (suffix + N * gate) + attn_flops(cfg, range(cfg.n_layer - N, cfg.n_layer), T)  # per regularised row
    r = {0.25: 2, 0.5: 3, 0.6: 3, 1.0: 5}[rows]  # ceil(F x 5)
    reg = step_flops(TrainStep(model, RegConfig(surrogate="idn", suffixes=(N,), rows=rows)), x, y, 0.5, nullcontext)
    assert reg == plain + extra * r * T
    assert reg / (B * T) == pytest.approx(plain / (B * T) + extra * r / B, rel=1e-12)


def windowed_attend(q, k, v, windows=-1, q_start=0, masks=None):
    """The outside reference of nanochat's count: attention computed by a loop over the leading indices, each query
    against exactly min(window, S) gathered keys (S for a full layer), so a FLOP counter charges every matmul of the
    forward, backward and forward-mode tangent (QK^T, PV) over the window alone (the values are not attention's:
    the keys before position 0 repeat key 0; only the counts are compared)."""
    import math

    lead, (Hq, T, hd), S = q.shape[:-3], q.shape[-3:], k.shape[-2]
    k, v = (t.repeat_interleave(Hq // k.shape[-3], dim=-3) for t in (k, v))
    n = math.prod(lead)
    q4, k4, v4 = (t.reshape(n, Hq, t.shape[-2], hd) for t in (q, k, v))
    ws = [windows] * n if isinstance(windows, int) else torch.broadcast_to(windows.cpu(), lead).reshape(-1).tolist()
    outs = []
    for i, w in enumerate(ws):
        W = S if w < 0 or w >= S else w
        idx = (torch.arange(T)[:, None] + q_start - torch.arange(W)[None, :]).clamp(0, S - 1)  # (T, W)
        s = q4[i].unsqueeze(-2) @ k4[i][:, idx].transpose(-1, -2)  # (Hq, T, 1, W)
        outs.append((s.softmax(-1) @ v4[i][:, idx]).squeeze(-2))
    return torch.stack(outs).view(*lead, Hq, T, hd)


@pytest.mark.parametrize("reg, plan", [("diag:jvp", None), (None, "4xF1-h0-K2-diag:jvp"), (None, "1xF3-h0-K2-diag:jvp"),
                                       (None, "4xF1-h0-K2-newton"), ("idn", "4xF1-h0-K2-newton"), ("idn", None),
                                       ("diag:vjp", None), (None, "1xF3-h0-K2")])
def test_step_flops_of_a_jacobian_pass_equal_a_windowed_attention_count(reg, plan, monkeypatch):
    """Every attention a step runs (the regulariser's solve, an SNLP-forward plan's iterations, DiagN's probe through
    forward-mode AD or a vjp, exact Newton's JVPs) charged its window, as a step whose attention computes only its
    window's scores (windowed_attend, counted by a bare FlopCounterMode) is charged. DiagN's jvp estimator
    differentiates the masked SDPA op by op: its tangent's matmuls were charged the whole square; Newton's JVPs are
    differentiated by the step's backward too, which no hook inside the transform saw."""
    import snlp.method.fusion as fusion
    import snlp.model.gpt as gpt
    from torch.utils.flop_counter import FlopCounterMode

    model = make_model(n_layer=4, window_pattern="SSL", short_window=3, sequence_len=16).train()  # fp64, GQA
    step = TrainStep(model, RegConfig(surrogate=reg, suffixes=(3,)) if reg else RegConfig(),
                     Plan.parse(plan) if plan else None)
    x, y = batch(0, V=61)
    lam = 0.5 if reg else 0.0
    got = step_flops(step, x, y, lam, nullcontext)
    for mod in (gpt, fusion):
        monkeypatch.setattr(mod, "attend", windowed_attend)
    monkeypatch.setattr(fusion, "uses_band", lambda *a: False)
    monkeypatch.setattr(fusion, "uses_flex", lambda *a: False)
    with FlopCounterMode(display=False) as counter:  # no SDPA left to count
        step(x, y, lam)[0].backward()
    assert got == counter.get_total_flops()


@pytest.mark.parametrize("dual", [(1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1), (1, 1, 1)])
def test_attention_under_forward_mode_ad_is_charged_its_window(dual):
    """attend under torch.func.jvp with tangents on some of q, k, v (the math SDPA, as snlp.method.jacobian.jvp runs
    it), windows per leading index (a fused stack's: short, full, longer than the keys): its count equals the
    windowed reference's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from snlp.model.ops import attend, window_flops_tally

    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(3, 2, h, 12, 4, generator=g, dtype=torch.float64) for h in (2, 1, 1)]  # GQA
    wins = torch.tensor([5, -1, 20]).view(3, 1)

    def count(fn, tally: bool) -> int:
        def f(*duals):
            it = iter(duals)
            return fn(*[next(it) if d else t for d, t in zip(dual, qkv)], wins)

        primals = tuple(t for d, t in zip(dual, qkv) if d)
        with sdpa_kernel(SDPBackend.MATH), window_flops_tally() as past, FlopCounterMode(display=False) as counter:
            torch.func.jvp(f, primals, tuple(torch.ones_like(t) for t in primals))
        return counter.get_total_flops() - (past[0] if tally else 0)

    assert count(attend, True) == count(windowed_attend, False)


def test_mfu_arithmetic_and_peak_table():
    assert mfu(1e9, 4e5, 989e12) == pytest.approx(1e9 * 4e5 / 989e12)
    assert mfu(1e9, 4e5, None) is None and mfu(None, 4e5, 989e12) is None
    assert peak_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_for_name("NVIDIA H200") == 989e12 and peak_for_name("NVIDIA H200 NVL") == 836e12
    assert peak_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_for_name("Some Future GPU") is None


def test_a_card_whose_name_holds_another_entrys_name_gets_its_own_peak():
    """First match wins, so a name that contains a shorter entry's must come before it: "NVIDIA L40" contains "L4"
    (its MFU was taken against the L4's 121 TFLOP/s, 1.5x too high), "NVIDIA GH200 480GB" contains "H200"."""
    assert peak_for_name("NVIDIA L40") == 181e12 and peak_for_name("NVIDIA L40S") == 362e12
    assert peak_for_name("NVIDIA L4") == 121e12
    assert peak_for_name("NVIDIA GH200 480GB") == 989e12
    for i, (key, _) in enumerate(PEAK_BF16_TFLOPS):  # every entry reachable: no earlier key is inside it
        assert not any(k in key for k, _ in PEAK_BF16_TFLOPS[:i]), key


# ----------------------------------------------------------------------------- snlp train --compile end to end
SHAKESPEARE = Path(__file__).resolve().parents[1] / "data/tinyshakespeare-head.txt"
TINY = ["--depth", "3", "--width", "64", "--head-dim", "32", "--vocab-size", "300", "--seq-len", "16",
        "--batch-size", "2", "--eval-every", "100", "--eval-batches", "1", "--no-progress", "--device", "cpu",
        "--steps", "4", "--warmup-steps", "1", "--log-every", "1", "--reg", "idn", "--reg-n", "2",
        "--reg-warmup", "3"]


@pytest.mark.slow
def test_train_compile_follows_the_eager_run_and_reports_mfu(tmp_path):
    """`snlp train --compile` and the eager run log the same losses step for step (fp32, same data and init); every
    log row has `mfu` (null on a CPU: no known peak), train_summary.json the steady speed and model FLOPs; --time-reg
    times the step with and without the regulariser."""
    from snlp.apps.cli import main

    corpus = tmp_path / "c.txt"
    corpus.write_text(SHAKESPEARE.read_text()[:60_000])
    common = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY]
    assert main(["train", "--out", str(tmp_path / "eager"), *common, "--time-reg", "2"]) == 0
    assert main(["train", "--out", str(tmp_path / "compiled"), *common, "--compile"]) == 0
    logs = {k: [json.loads(l) for l in (tmp_path / k / "log.jsonl").read_text().splitlines()]
            for k in ("eager", "compiled")}
    for rows in logs.values():
        assert all("mfu" in r and r["mfu"] is None for r in rows)
    steps = {k: [r for r in rows if "loss" in r] for k, rows in logs.items()}
    assert [r["step"] for r in steps["compiled"]] == [1, 2, 3, 4]
    # The step itself is equal up to fp32 rounding (the tests above). Over steps that rounding grows where a gradient
    # is rounding noise: at init the K=1 states equal the sequential ones up to rounding (reg ~2e-8 at step 1), so
    # the regulariser's gradient is noise, which Muon orthogonalises into a full-size update. Measured (eager vs
    # compiled, and vs compiled with eager Newton-Schulz): the CE agrees to ~1e-5 relative over 6 steps, the small
    # regulariser term (~1e-3) by ~1-2 %.
    # With torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 box) the two runs'
    # loss differed by 3.9e-4 relative at step 4 (5.4494 vs 5.4516) while step 1 agreed: the same amplification,
    # larger rounding. Step 1 (before any update) is held to rounding; later steps to what the amplification allows.
    for a, b in zip(steps["eager"], steps["compiled"]):
        rel = 1e-5 if a["step"] == 1 else 2e-3
        assert b["loss"] == pytest.approx(a["loss"], rel=rel) and b["lambda"] == a["lambda"]
        assert b["reg"] == pytest.approx(a["reg"], rel=0.25, abs=1e-6)  # AVX2 kernels: 10 % apart at step 4
    summaries = {k: json.loads((tmp_path / k / "train_summary.json").read_text()) for k in ("eager", "compiled")}
    for k, s in summaries.items():
        sp = s["speed"]
        assert sp["compiled"] is (k == "compiled") and s["mfu"] is None and sp["peak_flops"] is None
        assert sp["steps"] == 2 and sp["warm"] == 2 and sp["tok_s"] > 0 and sp["flops_per_token"] > 0
        assert sp["tflops"] == pytest.approx(sp["flops_per_token"] * sp["tok_s"] / 1e12)
    assert summaries["eager"]["speed"]["flops_per_token"] == summaries["compiled"]["speed"]["flops_per_token"]
    sp = summaries["eager"]["speed"]
    assert sp["reg_step_s"] > 0 and sp["plain_step_s"] > 0
    assert sp["reg_overhead"] == pytest.approx(sp["reg_step_s"] / sp["plain_step_s"])


@pytest.mark.slow
def test_the_compiled_training_loop_traces_one_graph_across_everything_between_steps(tmp_path):
    """The whole `snlp train --compile` loop, not the step alone: gradient accumulation (two calls a step), the LR
    schedule, --reg-warmup's lambda, a validation after every step (the model switched to eval and back) and a save
    every other step change no guard of the compiled step: one graph, no recompile (an error here), no graph break."""
    from snlp.train.config import TrainConfig
    from snlp.train.trainer import fit

    corpus = tmp_path / "c.txt"
    corpus.write_text(SHAKESPEARE.read_text()[:60_000])
    torch._dynamo.reset()  # an earlier test in this process may have compiled the same step: count this run's own
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        res = fit(TrainConfig(out=str(tmp_path / "run"), data=str(corpus), cache_dir=str(tmp_path / "cache"), depth=3,
                              width=64, head_dim=32, vocab_size=300, seq_len=16, batch_size=2, grad_accum=2, steps=4,
                              warmup_steps=2, eval_every=1, save_every=2, eval_batches=1, log_every=1,
                              no_progress=True, device="cpu", reg="idn", reg_n="2", reg_warmup=3, compile=True))
    assert res.steps == 4
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])
    rows = [json.loads(l) for l in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert len({r["lambda"] for r in rows if "loss" in r}) == 3 and len({r["lr_scale"] for r in rows if "loss" in r}) > 1


def test_train_compile_refuses_diag_before_any_work(tmp_path, capsys):
    from snlp.apps.cli import main

    missing = tmp_path / "missing.txt"  # never read: the refusal comes first
    assert main(["train", "--out", str(tmp_path / "x"), "--data", str(missing), *TINY, "--compile", "--reg",
                 "diag"]) == 2
    assert "--compile with --reg diag" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_sft_fixed_length_batches_leave_the_loss_unchanged():
    """--compile pads SFT batches to one length (static shapes): inputs after every real token (causal attention
    keeps them out of the real positions) and targets -1, so the sequential CE and its gradients are the unpadded
    batch's."""
    from snlp.train.sft import fixed_length

    model = tiny()
    x, y = batch(3, T=9)
    padded = fixed_length(lambda micro, rank, world: (x, y), 16, 0)
    px, py = padded(0, 0, 1)
    assert px.shape == py.shape == (2, 16) and (py[:, 9:] == -1).all() and torch.equal(px[:, :9], x)
    step = TrainStep(model, RegConfig())
    ref, got = eager_reference(step, x, y, 0.0), eager_reference(step, px, py, 0.0)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    for n in ref[3]:
        torch.testing.assert_close(got[3][n], ref[3][n], rtol=1e-5, atol=1e-6, msg=n)


def test_sft_padding_changes_neither_the_regulariser_nor_the_tokens_counted():
    """SFT batches are padded (to the longest row eagerly, to one fixed length under --compile). The regulariser is
    a mean over the real tokens (the paper's mean over batch and positions of the sequences), so padding must not
    move it: the reference is the padding-free value, each row's regulariser computed on the row alone (no padding
    at all) and averaged over the rows' tokens. The compiled step on the fixed-length batch gives that value, and
    the trainer counts only real tokens (tokens/s and MFU)."""
    from snlp.io.chat import ChatExample, collate
    from snlp.train.regularizer import snlp_loss
    from snlp.train.sft import fixed_length
    from snlp.train.trainer import unpack

    model = tiny()
    with torch.no_grad():  # weights away from the init, so the K=1 gap is far from 0 at every position
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (12, 6)]
    exs = [ChatExample(ids, [False] * 3 + [True] * (len(ids) - 3)) for ids in rows]
    reg = RegConfig(surrogate="idn", lam=0.5, suffixes=(2,))
    with torch.no_grad():  # padding-free reference: each row alone, weighted by its token count
        alone = [(snlp_loss(model, x, model.hidden_states(x), reg), x.numel())
                 for x, _ in (collate([e], 0) for e in exs)]
        ref = sum(r * n for r, n in alone) / sum(n for _, n in alone)
    x, y, valid = collate(exs, 0, with_valid=True)
    assert valid.sum() == 11 + 5 and x.shape == (2, 11)
    px, py, pvalid = fixed_length(lambda micro, rank, world: (x, y, valid), 16, 0)(0, 0, 1)
    assert px.shape == pvalid.shape == (2, 16) and int(pvalid.sum()) == 16
    assert unpack((px, py))[2] is None and unpack((px, py, pvalid))[2] is pvalid
    step = TrainStep(model, reg)
    with torch.no_grad():
        eager_rg = step(x, y, 0.5, valid)[2]
        padded_rg = step(px, py, 0.5, pvalid)[2]
    torch.testing.assert_close(eager_rg, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded_rg, ref, rtol=1e-5, atol=1e-6)
    compiled = CompiledStep(step, "cpu")
    loss, ce, rg = compiled(px, py, 0.5, pvalid)
    torch.testing.assert_close(rg, ref, rtol=1e-5, atol=1e-6)
    ref_loss = step(x, y, 0.5, valid)[0]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_sft_compile_logs_real_tokens_not_padding(tmp_path):
    """`snlp sft --compile --reg idn` pads every batch to one length; the tokens it logs are the rows' real tokens,
    the same count as the eager run (which pads to the longest row), and its regulariser the eager one's."""
    from snlp.apps.cli import main
    from snlp.io.checkpoint import save_checkpoint
    from snlp.io.tokenizer import Tokenizer
    from snlp.model.config import GPTConfig
    from snlp.model.gpt import GPT

    text = ["what is %d plus %d" % (i, i + 1) for i in range(40)]
    tk = Tokenizer.train(text * 3, 300)
    m = GPT(GPTConfig.from_depth(3, width=64, head_dim=32, vocab_size=tk.vocab_size, sequence_len=64))
    m.init_weights(seed=0)
    with torch.no_grad():  # away from the init (zero output projections: a K=1 gap of ~1e-8, all rounding)
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    save_checkpoint(tmp_path / "base", m, tk)
    with open(tmp_path / "chats.jsonl", "w") as f:
        for i, t in enumerate(text):
            f.write(json.dumps({"messages": [{"role": "user", "content": t},
                                             {"role": "assistant", "content": str(2 * i + 1) * (1 + i % 4)}]}) + "\n")
    flags = ["--steps", "2", "--batch-size", "4", "--seq-len", "64", "--eval-every", "1000", "--eval-batches", "1",
             "--no-progress", "--device", "cpu", "--reg", "idn", "--reg-n", "2", "--log-every", "1"]
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        out = tmp_path / name
        assert main(["sft", str(tmp_path / "base"), "--data", str(tmp_path / "chats.jsonl"), "--out", str(out),
                     *flags, *extra]) == 0
        runs[name] = (json.loads((out / "train_summary.json").read_text()),
                      [json.loads(l) for l in (out / "log.jsonl").read_text().splitlines()])
    (es, elog), (cs, clog) = runs["eager"], runs["compiled"]
    assert cs["tokens"] == es["tokens"] and es["tokens"] < 2 * 4 * 63  # real tokens, not 63 padded positions a row
    er, cr = [r for r in elog if "reg" in r], [r for r in clog if "reg" in r]
    assert len(er) == len(cr) == 2
    for a, b in zip(er, cr):
        assert abs(a["reg"] - b["reg"]) <= 1e-4 * abs(a["reg"]) and a["reg"] > 0

"""snlp.eval.analysis (`snlp analyze`), preheat (`snlp calibrate`) and unverified Jacobi decoding: the
issue's tests against dense autograd Jacobians, hand-computed values and the exactness laws."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import make_model, tokens

import snlp.eval.analysis as A
from snlp import load_preheat
from snlp.method import preheat
from snlp.decode.jacobi import jacobi_generate
from snlp.decode import sequential_generate
from snlp.eval.metrics import ar_match

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: threads only add contention

SMALL = dict(seq_len=8, max_tokens=48, batch=8, progress=False)


@pytest.fixture(scope="module")
def model():
    return make_model(seed=3, n_layer=5)  # float64, perturbed weights (not identity blocks)


@pytest.fixture(scope="module")
def val(model):
    return torch.randint(0, model.config.vocab_size, (400,), generator=torch.Generator().manual_seed(1))


def _layer_setup(model, l=3, T=4):
    idx = tokens(model, B=1, T=T, seed=5)
    ctx = model.embed(idx)
    h = model.run_layers(ctx.x0, ctx, 0, l)  # input of layer l
    return A.branch(model, l, ctx), (lambda x: model.layer(l, x, ctx)), h


def _dense(fn, h):
    n = h.numel()
    return torch.autograd.functional.jacobian(lambda x: fn(x.view_as(h)).reshape(-1), h.reshape(-1)).view(n, n)


# ---------------------------------------------------------------- Jacobian diagnostics vs dense autograd
def test_power_iteration_sigma_max_equals_dense_largest_singular_value(model):
    g, _, h = _layer_setup(model)
    want = torch.linalg.svdvals(_dense(g, h))[0]
    sigma, change = A.power_sigma(g, h, iters=60, gen=torch.Generator().manual_seed(0))
    assert abs(float(sigma[0]) - float(want)) / float(want) < 1e-3
    assert change < 1e-3


def test_hutchinson_frobenius_is_unbiased(model):
    g, _, h = _layer_setup(model)
    want = float((_dense(g, h) ** 2).sum())
    est = A.hutchinson_frob2(g, h, probes=200, gen=torch.Generator().manual_seed(0))[:, 0]  # (P,)
    se = float(est.std()) / math.sqrt(est.numel())
    assert abs(float(est.mean()) - want) < 4 * se, (float(est.mean()), want, se)
    assert se < 0.2 * want  # the test has power: the estimate is not just noise


def test_amplification_is_the_dense_jacobian_vector_norm_ratio(model):
    _, f, h = _layer_setup(model)
    J = _dense(f, h)
    got = A.amplification(f, h, probes=3, gen=torch.Generator().manual_seed(7))[:, 0]
    gen = torch.Generator().manual_seed(7)  # the same probes, drawn in the same order
    for p in range(3):
        v = torch.randn(h.shape, generator=gen, dtype=h.dtype).reshape(-1)
        assert float(got[p]) == pytest.approx(float((J @ v).norm() / v.norm()), rel=1e-9)


def test_branch_is_the_layer_minus_its_residual_input(model):
    g, f, h = _layer_setup(model)
    ctx = model.embed(tokens(model, B=1, T=4, seed=5))
    want = f(h) - (model.resid_lambdas[3] * h + model.x0_lambdas[3] * ctx.x0)
    torch.testing.assert_close(g(h), want)


def test_substitution_errors_hand_computed_on_a_linear_two_layer_toy():
    """g_l(h) = W_l h (2 layers, one token, D = 2): h_1 = h_S + W_1 h_S, eps_1 = 0, eps_2 = W_2 W_1 h_S."""
    W1 = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    W2 = torch.tensor([[2.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    hS = torch.tensor([[[3.0, 4.0]], [[0.0, 1.0]]], dtype=torch.float64)  # (B=2, T=1, D=2), ||h_S|| = 5, 1
    g = lambda W, h: h @ W.T  # noqa: E731
    h1 = hS + g(W1, hS)
    errs = A.substitution_errors([g(W1, hS), g(W2, h1)], [g(W1, hS), g(W2, hS)], hS, tiny=0.0)
    # eps_2 = W2 W1 h_S = (2 * h_S[1], 0): norms 8 and 2 -> mean 5; mean ||h_S|| = 3;
    # g_2(h_S) = (2 h_S[0], 0): norms 6 and 0 -> mean 3
    assert errs[0] == (0.0, 0.0, 0.0)
    assert errs[1] == pytest.approx((5 / 3, 5 / 3, 5 / 3))
    # C_eps accumulates: with eps_1 != 0 (swap the evaluation points) the sum's norm is used
    errs = A.substitution_errors([hS, 2 * hS], [0 * hS, 0 * hS], hS, tiny=1e-300)
    assert [e[1] for e in errs] == pytest.approx([1.0, 3.0]) and [e[0] for e in errs] == pytest.approx([1.0, 2.0])


def test_jacobian_diagnostics_rows(model, val):
    res = A.jacobian_diagnostics(model, val, A.AnalysisConfig(jac_suffix=3, jac_windows=2, power_iters=5, probes=2,
                                                              **SMALL))
    assert [d.layer for d in res.layers] == [2, 3, 4] and res.windows == 2
    first = res.layers[0]
    assert first.eps == 0 and first.c_eps == 0  # the first suffix layer reads h_S itself
    assert all(d.sigma_max > 0 and d.frob > 0 and d.amp > 0 for d in res.layers)
    assert all(d.eps > 0 and d.c_eps > 0 for d in res.layers[1:])


def test_layers_before_the_suffix_print_no_substitution_error_and_a_repeated_layer_is_one_row(model, val):
    """eps_l = g_l(h_l^seq) - g_l(h_S) is defined for suffix layers only: a --layers entry before L - N has none
    ('-', not 'diverged', the word for a failed solve); --layers 4,0,4 is one row per layer, in depth order (the plot
    joins them with a line), not two draws of layer 4."""
    res = A.jacobian_diagnostics(model, val, A.AnalysisConfig(jac_suffix=2, layers=(4, 0, 4), jac_windows=1,
                                                              power_iters=2, probes=1, **SMALL))
    assert [d.layer for d in res.layers] == [0, 4]
    table = A.jacobian_table(res)
    assert A.DIV not in table
    first = table.splitlines()[2].split("|")
    assert [c.strip() for c in first[5:8]] == ["-", "-", "-"] and math.isfinite(res.layers[0].sigma_max)


# ---------------------------------------------------------------- ordering, Seq-Perm, AR-ness
def test_ar_ness_matches_diffucoder_and_the_paper():
    assert A.ar_ness(range(8)) == 1.0
    assert A.ar_ness(range(7, -1, -1)) == pytest.approx(1 / 16)  # paper: 0.062 at N = 8
    assert A.ar_ness(range(11, -1, -1)) == pytest.approx(0.042, abs=5e-4)
    assert A.ar_ness([0, 2, 1, 3]) == pytest.approx((0 / 3 + 3 / 4) / 2)


def test_seq_perm_identity_is_sequential_and_reversed_differs_from_no_correction(model, val):
    cfg = A.AnalysisConfig(suffixes=(4,), shuffles=2, ordering_iters=(1, 2, 4), **SMALL)
    res = A.correction_ordering(model, val, cfg)
    rows = {r.name: r for r in res.tables[0].rows}
    assert rows["forward"].seq_perm == pytest.approx(res.sequential_ppl, rel=1e-12)
    assert rows["reversed"].ppl[1] == pytest.approx(rows["no correction"].ppl[1], rel=1e-12)  # K = 1: Jacobi
    for K in (2, 4):
        assert abs(rows["reversed"].ppl[K] - rows["no correction"].ppl[K]) > 1e-6
    assert rows["reversed"].seq_perm != pytest.approx(res.sequential_ppl, rel=1e-9)
    s = res.tables[0].summary()
    assert s.idn[1].forward == rows["forward"].ppl[1] and s.seq_forward == rows["forward"].seq_perm
    assert [r.name for r in res.tables[0].rows] == ["forward", "reversed", "shuffle_0", "shuffle_1", "no correction"]


def test_one_shuffle_has_no_spread_and_the_summary_says_so_not_diverged(model, val):
    """`--shuffles 1`: a population std of one finite PPL is undefined (nan), not a diverged solve: the summary cell is
    '-' (like every missing value), 'diverged' being kept for a non-finite PPL."""
    from snlp.eval.analysis.tables import ordering_summary

    res = A.correction_ordering(model, val, A.AnalysisConfig(suffixes=(4,), shuffles=1, ordering_iters=(1,), **SMALL))
    rows = {r.name: r for r in res.tables[0].rows}
    assert math.isfinite(rows["shuffle_0"].seq_perm) and math.isfinite(rows["shuffle_0"].ppl[1])
    line = ordering_summary(res).splitlines()[-1].split("|")
    assert "diverged" not in line and line[5].strip() == "-" and line[10].strip() == "-"  # the two std cells



def test_no_shuffle_run_is_a_missing_best_shuffle_not_diverged(model, val):
    """`--shuffles 0` (accepted): no shuffle was run, so both best-shuffle cells are '-' like the std cells; the min
    over no shuffles used to be inf, which the table prints as 'diverged', a solve that failed."""
    from snlp.eval.analysis.tables import ordering_summary

    res = A.correction_ordering(model, val, A.AnalysisConfig(suffixes=(4,), shuffles=0, ordering_iters=(1,), **SMALL))
    assert [r.name for r in res.tables[0].rows] == ["forward", "reversed", "no correction"]
    line = ordering_summary(res).splitlines()[-1].split("|")
    assert "diverged" not in line and [line[i].strip() for i in (4, 5, 8, 10)] == ["-"] * 4
    assert res.tables[0].summary().seq_best_shuffle is None

# ---------------------------------------------------------------- propagation staircase
def test_propagation_staircase(model, val):
    res = A.correction_propagation(model, val, A.AnalysisConfig(prop_suffix=4, **SMALL))
    assert res.iters == [1, 2, 3, 4]
    for K, row in zip(res.iters, res.without_correction):  # fp64: exactly identical columns j >= K
        assert len(set(row[K - 1:])) == 1, (K, row)
        assert len(set(row[:K])) == K  # and the earlier ones differ
    first = res.with_correction[0]
    assert len(set(first)) == len(first)  # with correction every active layer matters at K = 1
    # K >= j is exact: the last-j model run sequentially, with or without correction
    for j in range(1, 5):
        assert res.with_correction[3][j - 1] == pytest.approx(res.without_correction[3][j - 1], rel=1e-10)


def test_propagation_says_how_many_tokens_it_read_below_max_tokens(model, val):
    """The section reads min(prop_tokens, --max-tokens) predicted tokens: a --max-tokens above the cap is not what
    it ran on, and its markdown says the count (whole windows of seq_len)."""
    cfg = A.AnalysisConfig(prop_suffix=2, prop_tokens=16, **SMALL)  # max_tokens 48 > 16
    res = A.correction_propagation(model, val, cfg)
    assert res.tokens == 16
    md = A.to_markdown(A.AnalysisResult(checkpoint="m", config=cfg, environment=A.environment(), propagation=res))
    assert "over 16 predicted tokens per cell" in md



def test_propagation_with_a_window_past_prop_tokens_says_it_read_the_whole_window(model, val):
    """windows() takes at least one whole window: at seq_len > prop_tokens the section reads seq_len tokens, more
    than prop_tokens, and its sentence must not call prop_tokens a cap it went past."""
    cfg = A.AnalysisConfig(prop_suffix=2, prop_tokens=4, **SMALL)  # seq_len 8 > 4
    res = A.correction_propagation(model, val, cfg)
    assert res.tokens == 8
    md = A.to_markdown(A.AnalysisResult(checkpoint="m", config=cfg, environment=A.environment(), propagation=res))
    line = next(s for s in md.splitlines() if "predicted tokens per cell" in s)
    assert "over 8 predicted tokens per cell" in line and "at most" not in line, line
    assert "one whole window" in line, line

# ---------------------------------------------------------------- early exit moved here
def test_early_exit_is_importable_from_everywhere(model, val):
    from snlp.eval.analysis.earlyexit import early_exit
    assert early_exit is A.early_exit
    rows = A.early_exit(model, val, [2, 5], A.AnalysisConfig(**SMALL).eval_config())
    assert [r.N for r in rows] == [0, 2, 5]


def test_early_exit_with_backout_is_the_k0_solve_and_a_naive_loop():
    """nanochat's backout: the K = 0 head input after S layers is h_S - lambda * (layer b's output if b < S, else
    h_S, the skipped layer's K = 0 iterate). The exit after layer b + 1 < S read h_S alone."""
    import torch.nn.functional as F

    from snlp.eval.data import windows
    from snlp.eval.metrics import perplexity
    from snlp.method.plan import Plan

    m = make_model(seed=3, n_layer=6, backout=True, n_embd=32)
    b = m.config.backout_layer
    val = torch.randint(0, m.config.vocab_size, (400,), generator=torch.Generator().manual_seed(1))
    cfg = A.AnalysisConfig(**SMALL)
    rows = A.early_exit(m, val, [1, 2, 3, 6], cfg.eval_config())
    wins = windows(val, cfg.seq_len, cfg.max_tokens)
    x, y = wins[:, :-1], wins[:, 1:]
    for r in rows:
        S = 6 - r.N
        with torch.no_grad():
            ctx = m.embed(x)
            h, hb = ctx.x0, None
            for l in range(S):  # naive loop
                h = m.layer(l, h, ctx)
                hb = h if l == b else hb
            h = h - m.backout_lambda * (hb if hb is not None else h)
            nll = F.cross_entropy(m.head(h).flatten(0, 1), y.flatten(), reduction="sum").item()
        assert r.ppl == pytest.approx(perplexity(nll, y.numel()), rel=1e-9), r
        if r.N:
            assert r.ppl == pytest.approx(A.plan_ppl(m, wins, Plan(chunks=r.N, iters=0)), rel=1e-9), r


# (the preheat calibration itself is tested in tests/method/test_preheat.py)


# ---------------------------------------------------------------- Jacobi coupling
@pytest.mark.parametrize("warm", [False, True])
def test_naive_and_h0jd_with_K_ge_C_match_sequential_and_counts_follow_the_trace(model, warm):
    prompt = [1, 5, 9]
    ref = sequential_generate(model, prompt, max_new_tokens=10).tokens
    res = jacobi_generate(model, prompt, "4xF1-h0-K4", block=3, max_new_tokens=10, verify=False, warm_start=warm)
    assert res.tokens == ref and ar_match([res.tokens], [ref]) == 1.0
    assert res.forwards == res.jacobi_iters == res.draft_steps  # unverified: no sequential check forwards
    assert len(res.tokens) == res.accepted + res.rounds  # each round keeps n accepted guesses + 1 prediction
    ver = jacobi_generate(model, prompt, "4xF1-h0-K1", block=3, max_new_tokens=10)
    assert ver.tokens == ref and ver.forwards == ver.jacobi_iters + ver.rounds  # verified: one check per round


def test_jacobi_coupling_rows(model, val):
    cfg = A.AnalysisConfig(jacobi_plans=("4xF1",), jacobi_prompts=2, jacobi_prompt_len=3, jacobi_tokens=6,
                           jacobi_window=3, **SMALL)
    res = A.jacobi_coupling(model, val, cfg)
    assert [r.config for r in res.rows] == ["naive K=1", "naive K=2", "h0-JD K=1", "h0-JD K=2"]
    for r in res.rows:
        assert r.tokens == 12 and r.forwards == r.jd_iters and 0 <= r.match <= 1
        assert r.accept_per_iter == pytest.approx(r.tokens / r.jd_iters)
        assert r.forwards_per_token == pytest.approx(r.forwards / r.tokens)
    with pytest.raises(ValueError, match="warm_start"):
        jacobi_generate(model, [1], None, warm_start=True)
    # the line said "2 prompts, 6 tokens" beside rows of 12 tokens: 6 is each prompt's count
    md = A.to_markdown(A.AnalysisResult(checkpoint="x", config=cfg, environment=A.environment(), jacobi=res))
    assert "2 prompts, 6 new tokens each," in md


# ---------------------------------------------------------------- the whole analysis, CLI
def test_analyze_writes_markdown_json_and_plots(model, val, tmp_path):
    cfg = A.AnalysisConfig(jac_suffix=2, jac_windows=1, power_iters=3, probes=2, suffixes=(3,), shuffles=1,
                           ordering_iters=(1, 2), prop_suffix=2, elk_suffix=2, elk_chunks=(1, 0), preheat_rank=2,
                           jacobi_plans=("2xF1",), jacobi_prompts=1, jacobi_prompt_len=3, jacobi_tokens=4,
                           jacobi_window=2, **SMALL)
    res = A.analyze(model, val, cfg, checkpoint="tiny")
    out = A.write(res, tmp_path / "an")
    md = (out / "analysis.md").read_text()
    for title in ("Jacobian diagnostics", "Correction ordering", "Correction propagation", "Early exit",
                  "ELK tempering", "Preheat calibration", "Jacobi decoding"):
        assert f"## {title}" in md
    data = json.loads((out / "analysis.json").read_text())
    assert set(res.seconds) == set(A.SECTIONS) and data["early_exit"][0]["N"] == 0
    for png in ("jacobian.png", "ordering.png", "propagation.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    sec = A.report_section(res)
    assert sec.startswith("### SNLP diagnostics") and "σmax" in sec
    assert model.__dict__.get("preheat") is None  # the analysis leaves the model as it found it
    with pytest.raises(ValueError, match="unknown analysis section"):
        A.analyze(model, val, A.AnalysisConfig(only=("jacobians",)))


def test_windows_past_the_trained_context_are_said_not_silent(model, val, tmp_path):
    """The default --seq-len 128 on a model trained at 32 ran every section on RoPE extrapolation without a word (snlp
    eval warns of the same); now a warning and a line in analysis.md."""
    cfg = A.AnalysisConfig(only=("early-exit",), seq_len=40, max_tokens=40, progress=False)
    with pytest.warns(UserWarning, match="past the model's sequence_len 32"):
        res = A.analyze(model, val, cfg)
    assert "past the model's sequence_len 32" in A.to_markdown(res)
    ok = A.analyze(model, val, A.AnalysisConfig(only=("early-exit",), **SMALL))
    assert "past the model" not in A.to_markdown(ok)


def test_jacobi_alone_reads_no_window_so_a_default_seq_len_past_the_context_is_not_said(model, val, recwarn):
    """Jacobi decoding reads its own prompts, not --seq-len windows: with --only jacobi the default seq_len 128 past a
    32-token context warned 'every section measures extrapolation ... pass --seq-len 32 or less' and put that line in
    analysis.md, and `snlp analyze --only jacobi --seq-len 32` is refused (an option no section reads): a dead end."""
    import warnings

    cfg = A.AnalysisConfig(only=("jacobi",), jacobi_prompts=1, jacobi_tokens=4, jacobi_plans=("2xF1",),
                           progress=False)
    assert cfg.seq_len > model.config.sequence_len
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all
        res = A.analyze(model, val, cfg)
    assert res.jacobi is not None and "past the model" not in A.to_markdown(res)
    both = A.AnalysisConfig(only=("jacobi", "early-exit"), jacobi_prompts=1, jacobi_tokens=4, jacobi_plans=("2xF1",),
                            max_tokens=256, progress=False)
    with pytest.warns(UserWarning, match="past the model's sequence_len 32"):
        res = A.analyze(model, val, both)
    assert "past the model's sequence_len 32" in A.to_markdown(res)


def test_elk_names_the_rank_its_preheat_was_fitted_at(val):
    """ELK's calibration line named --preheat-rank (32) where the fit kept the embedding width's 16 directions."""
    m = make_model(seed=3, n_layer=4)  # n_embd 16 < the default preheat rank 32
    cfg = A.AnalysisConfig(elk_suffix=2, elk_chunks=(0,), elk_values=(0.0,), **SMALL)
    res = A.elk_sweep(m, val, cfg)
    assert cfg.preheat_rank == 32 and "rank 16 (no preheat.pt given)" in res.preheat_source, res.preheat_source


def test_propagation_heat_map_tells_a_large_finite_ppl_from_a_diverged_cell(tmp_path, monkeypatch):
    """The heat map clipped PPL at 1e9 and drew non-finite cells at that top: a 1e10 cell (a converted model's
    skipped suffix gives such PPLs) looked diverged. Diverged cells are masked now; finite ones keep their value."""
    import numpy as np
    from matplotlib.axes import Axes

    from snlp.eval.analysis.plots import propagation_plot

    shown, real = [], Axes.imshow
    monkeypatch.setattr(Axes, "imshow", lambda self, X, *a, **k: shown.append(X) or real(self, X, *a, **k))
    p = A.PropagationResult(N=2, iters=[1, 2], with_correction=[[1e10, float("inf")], [5.0, 1e12]],
                            without_correction=[[1e10, float("nan")], [5.0, 7.0]])
    propagation_plot(p, tmp_path / "p.png")
    cells = np.ma.masked_invalid(np.ma.asarray(shown[0], dtype=float))
    assert not np.ma.is_masked(cells[0, 0]) and cells[0, 0] == pytest.approx(math.log(1e10))
    assert np.ma.is_masked(cells[0, 1]) and cells[1, 1] == pytest.approx(math.log(1e12))
    assert np.ma.is_masked(np.ma.masked_invalid(np.ma.asarray(shown[1], dtype=float))[0, 1])


def test_write_keeps_the_results_when_a_plot_fails_and_drops_a_reused_folders_stale_plots(model, val, tmp_path,
                                                                                          monkeypatch):
    """The plots were written before analysis.json, so a plot that failed lost every computed section; a folder
    reused with a smaller --only kept the earlier run's plots beside the new analysis.md."""
    import snlp.eval.analysis.report as R

    res = A.analyze(model, val, A.AnalysisConfig(only=("jacobian",), jac_suffix=2, jac_windows=1, power_iters=3,
                                                 probes=2, **SMALL), checkpoint="tiny")
    out = tmp_path / "an"
    out.mkdir()
    (out / "ordering.png").write_bytes(b"an earlier run's")
    A.write(res, out)
    assert (out / "jacobian.png").is_file() and not (out / "ordering.png").exists()

    def broken(*a, **k):
        raise RuntimeError("the plot failed")

    monkeypatch.setattr(R, "write_plots", broken)
    with pytest.raises(RuntimeError):
        A.write(res, tmp_path / "again")
    data = json.loads((tmp_path / "again" / "analysis.json").read_text())
    assert data["jacobian"]["layers"] and data["checkpoint"] == "tiny"


def test_a_failed_plot_leaves_no_earlier_runs_report_or_plots_beside_the_new_results(model, val, tmp_path,
                                                                                      monkeypatch):
    """A reused folder whose new run's plot fails: its analysis.json is this run's, so the earlier run's analysis.md
    and plots (other sections, other numbers) must not stay beside it as if they described it."""
    import snlp.eval.analysis.report as R

    res = A.analyze(model, val, A.AnalysisConfig(only=("jacobian",), jac_suffix=2, jac_windows=1, power_iters=3,
                                                 probes=2, **SMALL), checkpoint="tiny")
    out = tmp_path / "an"
    out.mkdir()
    for name in ("analysis.md", "ordering.png", "jacobian.png"):  # an earlier run's, all sections
        (out / name).write_bytes(b"an earlier run's")

    def broken(*a, **k):
        raise RuntimeError("the plot failed")

    monkeypatch.setattr(R, "write_plots", broken)
    with pytest.raises(RuntimeError):
        A.write(res, out)
    assert json.loads((out / "analysis.json").read_text())["checkpoint"] == "tiny"
    assert sorted(p.name for p in out.iterdir()) == ["analysis.json"]


def test_cli_analyze_and_calibrate(tmp_path, capsys):
    from snlp.io.checkpoint import load, save_checkpoint
    from snlp.apps.cli import main
    from snlp.io.tokenizer import MIN_VOCAB, Tokenizer

    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 40
    tok = Tokenizer.train([text], vocab_size=MIN_VOCAB + 20)
    data = tmp_path / "corpus.txt"
    data.write_text("\n\n".join(text[i:i + 400] for i in range(0, len(text), 400)) * 4)  # ~14 KB: 3 docs
    args = {"data": str(data), "text_field": "text", "max_chars": 0, "val_frac": 0.5, "cache_dir": str(tmp_path / "c")}
    ck = save_checkpoint(tmp_path / "ck", make_model(seed=2, n_layer=4, vocab_size=tok.vocab_size).float(),
                         tokenizer=tok, train_state={"args": args})
    assert main(["calibrate", str(ck), "--rank", "4", "--batch", "2", "--seq-len", "8"]) == 0
    model, _ = load(ck)
    assert load_preheat(ck, model).rank == 4  # stored beside the checkpoint, checked against its weights
    assert main(["calibrate", str(ck), "--rank", "4", "--data", "train", "--seq-len", "8",
                 "--out", str(tmp_path / "d.pt")]) == 0
    assert preheat.Preheat.load(tmp_path / "d.pt").source == "data"
    rc = main(["analyze", str(ck), "--only", "early-exit,ordering,elk", "--suffixes", "2", "--shuffles", "1",
               "--seq-len", "8", "--max-tokens", "32", "--no-progress", "--out", str(tmp_path / "out")])
    assert rc == 0
    md = (tmp_path / "out" / "analysis.md").read_text()
    assert "## Early exit" in md and "## Correction ordering" in md
    assert "preheat calibration: the checkpoint's (random tokens, rank 4)" in md  # not one fitted at --preheat-rank
    assert "## Jacobian" not in md
    # elk reads the checkpoint's preheat.pt: a --preheat-rank only the preheat section could use is refused
    assert main(["analyze", str(ck), "--only", "elk", "--preheat-rank", "8", "--out", str(tmp_path / "x")]) == 2
    assert "--preheat-rank 8 would be unused" in capsys.readouterr().err and not (tmp_path / "x").exists()
    # nor does a --seed: elk fits nothing to seed (the checkpoint's preheat.pt) and early-exit draws nothing
    assert main(["analyze", str(ck), "--only", "elk,early-exit", "--seed", "3", "--out", str(tmp_path / "x")]) == 2
    assert "--seed 3 would be unused" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["analyze", str(ck), "--only", "nope", "--out", str(tmp_path / "x")]) == 2
    assert main(["analyze", str(ck), "--layers", "9", "--out", str(tmp_path / "x")]) == 2
    assert "unknown analysis section" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [(["--only", "jacobian", "--shuffles", "3"], "--shuffles"),
                                          (["--only", "jacobian,jacobi", "--max-tokens", "64"], "--max-tokens"),
                                          (["--only", "early-exit", "--layers", "1"], "--layers"),
                                          (["--only", "jacobian", "--suffixes", "2"], "--suffixes"),
                                          (["--only", "jacobi", "--seq-len", "16"], "--seq-len"),
                                          (["--only", "propagation", "--preheat-rank", "4"], "--preheat-rank"),
                                          (["--only", "early-exit", "--seed", "3"], "--seed"),
                                          (["--only", " , "], "names no section")])
def test_an_option_no_selected_section_reads_is_refused_before_the_checkpoint_loads(tmp_path, capsys, flags, named):
    """`--only jacobian --shuffles 3` ran and wrote a report as if the 3 shuffles had been honoured; `--only ,` wrote
    an empty report. Both are one line now, before the checkpoint (here: none) is read and before --out is made."""
    from snlp.apps.cli import main

    assert main(["analyze", str(tmp_path / "no-checkpoint"), *flags, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert named in err and "does not exist" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def tiny_checkpoint(tmp_path):
    """A 4-layer checkpoint with a tokenizer and the training data it records (~14 KB of text)."""
    from snlp.io.checkpoint import save_checkpoint
    from snlp.io.tokenizer import MIN_VOCAB, Tokenizer

    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 40
    tok = Tokenizer.train([text], vocab_size=MIN_VOCAB + 20)
    data = tmp_path / "corpus.txt"
    data.write_text("\n\n".join(text[i:i + 400] for i in range(0, len(text), 400)) * 4)
    args = {"data": str(data), "text_field": "text", "max_chars": 0, "val_frac": 0.5, "cache_dir": str(tmp_path / "c")}
    return save_checkpoint(tmp_path / "ck", make_model(seed=2, n_layer=4, vocab_size=tok.vocab_size).float(),
                           tokenizer=tok, train_state={"args": args})


def test_ordering_on_a_backout_checkpoint_is_refused_before_the_validation_data_is_read(tmp_path, capsys,
                                                                                         monkeypatch):
    """The refusal came from analyze(), after the CLI had tokenised the validation split (minutes on a real corpus)."""
    import snlp.eval.data as data
    from snlp.apps.cli import main
    from snlp.io.checkpoint import save_checkpoint
    from snlp.io.tokenizer import MIN_VOCAB, Tokenizer

    tok = Tokenizer.train(["to be or not to be " * 20], vocab_size=MIN_VOCAB + 5)
    ck = save_checkpoint(tmp_path / "ck", make_model(seed=2, n_layer=4, backout=True, n_embd=32,
                                                     vocab_size=tok.vocab_size).float(), tokenizer=tok)

    def read(*a, **k):
        raise AssertionError("the validation data was read before the refusal")

    monkeypatch.setattr(data, "validation_tokens", read)
    assert main(["analyze", str(ck), "--only", "ordering,early-exit", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "backout" in err and "ordering" in err and len(err.strip().splitlines()) == 1


def test_the_closing_line_names_the_plots_the_folder_holds(tmp_path, capsys):
    """`snlp analyze`'s last line names the files it wrote: early-exit alone makes no plot (it said "and plots"
    where the folder held none), ordering makes ordering.png."""
    from snlp.apps.cli import main
    from snlp.eval.analysis.report import PLOTS

    ck = tiny_checkpoint(tmp_path)
    common = ["--suffixes", "2", "--seq-len", "8", "--max-tokens", "32", "--no-progress"]
    assert main(["analyze", str(ck), "--only", "early-exit", *common, "--out", str(tmp_path / "a")]) == 0
    said = capsys.readouterr().out.strip().splitlines()[-1]
    assert not [p for p in PLOTS if (tmp_path / "a" / p).exists()]
    assert "plot" not in said and ".png" not in said, said
    assert main(["analyze", str(ck), "--only", "early-exit,ordering", "--shuffles", "1", *common,
                 "--out", str(tmp_path / "b")]) == 0
    said = capsys.readouterr().out.strip().splitlines()[-1]
    made = [p for p in PLOTS if (tmp_path / "b" / p).exists()]
    assert made == ["ordering.png"] and str(tmp_path / "b" / "ordering.png") in said, said


def test_analyze_into_the_checkpoint_folder_keeps_the_checkpoint_whole(tmp_path, capsys):
    """`snlp analyze CKPT --out CKPT` is accepted, as the other commands' conventions have it: calibrate writes its
    preheat into CKPT by default, and eval's / tune's --json / --csv / --markdown may name a file in CKPT, refused only
    where it is one of the checkpoint's own files (snlp.apps.cli.check_not_a_model_file). analyze writes none of
    those names: the checkpoint's files stay byte for byte, it loads, a later save of it carries the analysis over,
    and the lock it holds is the checkpoint's own (a training run on CKPT meanwhile is refused)."""
    from snlp.apps.cli import main
    from snlp.eval.analysis.report import PLOTS
    from snlp.io.checkpoint import OWN_FILES, load, save_checkpoint
    from snlp.method.preheat import FILENAME

    assert not {"analysis.json", "analysis.md", *PLOTS} & {*OWN_FILES, FILENAME}
    ck = tiny_checkpoint(tmp_path)
    before = {f.name: f.read_bytes() for f in ck.iterdir()}
    assert main(["analyze", str(ck), "--only", "early-exit", "--suffixes", "2", "--seq-len", "8", "--max-tokens", "32",
                 "--no-progress", "--out", str(ck)]) == 0
    assert {f.name: f.read_bytes() for f in ck.iterdir() if f.name in before} == before
    assert (ck / "analysis.json").is_file() and (ck / "analysis.md").is_file()
    model, tok = load(ck)
    save_checkpoint(ck, model, tokenizer=tok)
    assert (ck / "analysis.md").is_file()


def test_a_cut_analysis_keeps_its_finished_sections_marked_partial(tmp_path, capsys, monkeypatch):
    """`snlp analyze` wrote its files only after the last section (minutes each on a CPU at the default sizes: 13 to
    54 s per section on the speedrun's 16-layer model), so a SIGTERM or Ctrl-C in the last one lost every finished
    section, and the line said only "interrupted". Each section is now written as it finishes, marked partial
    ("complete": false, the markdown's PARTIAL line); the signal's line names what was kept; a finished run's files
    are complete."""
    import signal

    import snlp.apps.analyze
    import snlp.eval.analysis.report as R
    from snlp.apps.cli import main

    ck = tiny_checkpoint(tmp_path)
    argv = ["analyze", str(ck), "--only", "early-exit,ordering,elk", "--suffixes", "2", "--shuffles", "1",
            "--seq-len", "8", "--max-tokens", "32", "--no-progress", "--out", str(tmp_path / "out")]

    def ctrl_c(*a, **k):  # the last section (elk) is where the interrupt arrives
        raise KeyboardInterrupt

    def sigterm(*a, **k):
        signal.raise_signal(signal.SIGTERM)

    kept = (f"kept the finished sections (ordering, early-exit) in {tmp_path}/out/analysis.md and analysis.json, "
            f"marked partial (\"complete\": false); a rerun computes every section again (--only picks the rest)")
    with monkeypatch.context() as m:
        m.setattr(R, "elk_sweep", ctrl_c)
        assert main(argv) == 130
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"snlp analyze: interrupted; {kept}"
        assert getattr(snlp.apps.analyze, "LOCK_OUTPUTS", False)  # SIGTERM raised as Ctrl-C (cli.measurement_signals)
        m.setattr(R, "elk_sweep", sigterm)
        assert main(argv) == 128 + signal.SIGTERM
        # the first cut run's files were there: the line says the new sections replaced them (a complete earlier
        # analysis in --out is replaced by a cut rerun's first section, which the line did not say)
        replaced = kept.replace('"complete": false);', '"complete": false); they replaced the analysis an earlier run '
                                                         'had written there;')
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"snlp analyze: interrupted by SIGTERM; {replaced}"
    data = json.loads((tmp_path / "out" / "analysis.json").read_text())
    assert data["complete"] is False and data["early_exit"] and data["ordering"] and data["elk"] is None
    md = (tmp_path / "out" / "analysis.md").read_text()
    assert "**PARTIAL**" in md and "(ordering, early-exit)" in md and "## Early exit" in md and "## ELK" not in md
    assert main(argv) == 0
    data = json.loads((tmp_path / "out" / "analysis.json").read_text())
    assert data["complete"] is True and data["elk"] is not None
    assert "PARTIAL" not in (tmp_path / "out" / "analysis.md").read_text()


def test_mhc_models_are_analysed_on_the_stream_state():
    model = make_model(seed=1, n_layer=3, hc_streams=2, x0_residual=False, value_embeds=False)
    val = torch.randint(0, 61, (200,), generator=torch.Generator().manual_seed(0))
    cfg = A.AnalysisConfig(only=("jacobian", "elk"), jac_suffix=2, jac_windows=1, power_iters=2, probes=1,
                           elk_suffix=2, elk_chunks=(0,), elk_values=(0.0,), preheat_rank=2, seq_len=4, max_tokens=8,
                           progress=False)
    res = A.analyze(model, val, cfg)
    assert len(res.jacobian.layers) == 2 and all(math.isfinite(d.sigma_max) for d in res.jacobian.layers)
    assert {(r.alpha, r.init, r.chunking) for r in res.elk.rows} == {(0, "h0", "2xF1"), (0, "fwd", "2xF1"),
                                                                      (0, "preheat", "2xF1")}


def test_a_signal_during_a_sections_write_is_held_until_the_files_agree_with_the_line(tmp_path, capsys, monkeypatch):
    """A Ctrl-C that came while `snlp analyze` wrote a finished section (after analysis.json, before analysis.md: write
    removes the old markdown and plots first) cut the write short: the folder held a partial analysis.json and no
    analysis.md, and the line said "no section had finished: nothing written". The signal is now held until the write
    is done, so the line names the section the files hold, both files present and marked partial."""
    import signal

    import snlp.eval.analysis.report as R
    from snlp.apps.cli import main

    ck = tiny_checkpoint(tmp_path)
    out = tmp_path / "out"
    argv = ["analyze", str(ck), "--only", "ordering,early-exit", "--suffixes", "2", "--shuffles", "1",
            "--seq-len", "8", "--max-tokens", "32", "--no-progress", "--out", str(out)]
    real = R.write_plots

    def ctrl_c_mid_write(res, folder):  # analysis.json is written, the markdown not yet
        signal.raise_signal(signal.SIGINT)
        return real(res, folder)

    monkeypatch.setattr(R, "write_plots", ctrl_c_mid_write)
    assert main(argv) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("snlp analyze: interrupted; kept the finished sections (ordering) in "), last
    assert json.loads((out / "analysis.json").read_text())["complete"] is False
    assert "**PARTIAL**" in (out / "analysis.md").read_text()


def test_a_preheat_fit_with_too_few_tokens_is_refused_before_any_section(model, val, monkeypatch):
    """--seq-len 1 with elk or preheat: the fits made here (8 windows of seq_len tokens, rank --preheat-rank) crashed
    with an IndexError in fit_states after the sections before them had run; now one line before any section."""
    ran = []
    import snlp.eval.analysis.report as R

    monkeypatch.setattr(R, "jacobian_diagnostics", lambda *a, **k: ran.append("jacobian"))
    for only in (("jacobian", "elk"), ("jacobian", "preheat")):
        with pytest.raises(ValueError, match="rank 16 needs more than 16 tokens, got 8"):
            A.analyze(model, val, A.AnalysisConfig(only=only, **{**SMALL, "seq_len": 1}))
    assert not ran
    pre = preheat.fit(model, preheat.CalibrateConfig(rank=4, batch=2, seq_len=8))
    R.check_model(model, A.AnalysisConfig(only=("elk",), **{**SMALL, "seq_len": 1}), pre)  # elk fits none: fine


def test_the_preheat_section_names_the_rank_it_fitted_and_the_data_it_read(val):
    """The section said "rank 32" (--preheat-rank) where both fits kept the embedding width's 16 directions, and did
    not say that on a short split its data calibration read the PPL windows themselves."""
    from snlp.eval.analysis.elk import fit_config
    from snlp.eval.data import windows
    from snlp.method.solver import solve

    m = make_model(seed=3, n_layer=4)  # n_embd 16 < the default preheat rank 32
    cfg = A.AnalysisConfig(elk_suffix=2, elk_chunks=(0,), only=("preheat",), **SMALL)  # 6 windows of 8: tokens 0..48
    res = A.analyze(m, val, cfg)
    md = A.to_markdown(res)
    assert res.preheat.rank == 16 and "N = 2, rank 16, K = 1" in md, md
    assert "8 windows of 8 validation tokens after the PPL windows" in md
    pre = preheat.fit(m, fit_config(cfg), tokens=val[49:])  # from the first token after the last window's target
    want = A.window_ppl(m, windows(val, 8, 48), lambda x: solve(m, x, "2xF1-preheat-K1", preheat=pre).hidden)
    assert [r.calibration for r in res.preheat.rows] == ["h0", "random", "data"]
    assert res.preheat.rows[-1].ppl == pytest.approx(want, rel=1e-12)
    short = A.analyze(m, val[:100], cfg)  # 51 tokens after the windows: fewer than 8 x 8
    assert "from the split's start, where the PPL windows are" in A.to_markdown(short)


def test_calibrate_out_replaces_only_a_calibration(tmp_path, capsys):
    """`--out mine.pt` wrote the calibration over any existing .pt (a user's torch file), and `--out OTHER/preheat.pt`
    over another checkpoint's own calibration; both are refused in one line before the model loads. An earlier
    calibration and the checkpoint's own preheat.pt (even an unreadable one: the advice is to re-run) are replaced."""
    from snlp.apps.cli import main

    ck = tiny_checkpoint(tmp_path)
    (tmp_path / "o").mkdir()
    other = tiny_checkpoint(tmp_path / "o")
    small = ["--rank", "2", "--batch", "1", "--seq-len", "8"]
    mine = tmp_path / "mine.pt"
    torch.save({"w": torch.ones(3)}, mine)
    assert main(["calibrate", str(ck), *small, "--out", str(mine)]) == 2
    assert "not a preheat calibration" in capsys.readouterr().err and list(torch.load(mine)) == ["w"]
    assert main(["calibrate", str(other), *small]) == 0
    before = (other / "preheat.pt").read_bytes()
    assert main(["calibrate", str(ck), *small, "--out", str(other / "preheat.pt")]) == 2
    assert "another checkpoint" in capsys.readouterr().err and (other / "preheat.pt").read_bytes() == before
    assert main(["calibrate", str(ck), *small, "--out", str(tmp_path / "p.pt")]) == 0
    assert main(["calibrate", str(ck), *small, "--rank", "3", "--out", str(tmp_path / "p.pt")]) == 0  # an earlier one
    assert preheat.Preheat.load(tmp_path / "p.pt").rank == 3
    (ck / "preheat.pt").write_text("not a calibration")
    assert main(["calibrate", str(ck), *small, "--out", str(ck / "preheat.pt")]) == 0
    assert load_preheat(ck, __import__("snlp").load(ck)[0]).rank == 2


def test_calibrate_says_what_it_fitted_on_and_refuses_what_it_cannot_honour(tmp_path, capsys):
    """`snlp calibrate CKPT/model.safetensors` (a file naming its checkpoint, as load accepts) fitted, then failed with
    a FileExistsError writing CKPT/model.safetensors/preheat.pt; `--data X --seed 3` ignored the seed; --data with
    more --batch windows than the split holds fitted on fewer, and a --seq-len past the trained context ran,
    silently."""
    from snlp.apps.cli import main

    ck = tiny_checkpoint(tmp_path)  # sequence_len 32
    assert main(["calibrate", str(ck / "model.safetensors"), "--rank", "2", "--batch", "1", "--seq-len", "8"]) == 0
    assert "calibrated on 1 window of 8 random tokens" in capsys.readouterr().out
    assert load_preheat(ck, __import__("snlp").load(ck)[0]).rank == 2
    assert main(["calibrate", str(tmp_path / "missing"), "--rank", "0", "--seq-len", "-2"]) == 2  # before the load
    assert "--rank 0, --seq-len -2: must be >= 1" in capsys.readouterr().err
    assert main(["calibrate", str(ck), "--data", "train", "--seed", "3", "--out", str(tmp_path / "s.pt")]) == 2
    assert "--seed 3 would be unused" in capsys.readouterr().err and not (tmp_path / "s.pt").exists()
    assert main(["calibrate", str(ck), "--rank", "2", "--data", "train", "--batch", "100000", "--seq-len", "8",
                 "--out", str(tmp_path / "d.pt")]) == 0
    line = capsys.readouterr().out
    n = int(line.split("calibrated on ")[1].split()[0])
    assert 0 < n < 100000 and "8 data tokens (asked for 100000: the split has" in line, line
    with pytest.warns(UserWarning, match="--seq-len 40 is past the model's sequence_len 32"):
        assert main(["calibrate", str(ck), "--rank", "2", "--batch", "1", "--seq-len", "40",
                     "--out", str(tmp_path / "l.pt")]) == 0


def test_a_stale_preheat_file_is_refused_only_by_the_section_that_reads_it(tmp_path, capsys):
    """A checkpoint whose preheat.pt was fitted on other weights: `--only early-exit` (no section reads it) was
    refused with "re-run snlp calibrate"; only elk, which uses the checkpoint's calibration, refuses it now."""
    from snlp.apps.cli import main

    ck = tiny_checkpoint(tmp_path)
    other = make_model(seed=9, n_layer=4, vocab_size=__import__("snlp").load(ck)[0].config.vocab_size).float()
    preheat.fit(other, preheat.CalibrateConfig(rank=2, batch=1, seq_len=8)).save(ck / "preheat.pt")
    common = ["--seq-len", "8", "--max-tokens", "16", "--no-progress"]
    assert main(["analyze", str(ck), "--only", "early-exit", *common, "--out", str(tmp_path / "a")]) == 0
    assert "## Early exit" in (tmp_path / "a" / "analysis.md").read_text()
    assert main(["analyze", str(ck), "--only", "elk", *common, "--out", str(tmp_path / "b")]) == 2
    assert "other weights" in capsys.readouterr().err


def test_analyze_out_replaces_an_earlier_analysis_but_not_the_users_files(tmp_path, capsys):
    """--out into a folder holding the user's own analysis.md and ordering.png: the run wrote over the one and deleted
    the other (write removes the plots it does not make). Refused now in one line before the checkpoint loads; a
    folder holding an earlier analysis (its analysis.json) is still replaced."""
    from snlp.apps.cli import main

    ck = tiny_checkpoint(tmp_path)
    common = ["--only", "early-exit", "--seq-len", "8", "--max-tokens", "16", "--no-progress", "--out"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "analysis.md").write_text("my notes")
    (mine / "ordering.png").write_text("my plot")
    assert main(["analyze", str(ck), *common, str(mine)]) == 2
    assert "holds analysis.md, ordering.png but no earlier analysis" in capsys.readouterr().err
    assert (mine / "analysis.md").read_text() == "my notes" and (mine / "ordering.png").read_text() == "my plot"
    (mine / "analysis.json").write_text('{"mine": 1}')
    assert main(["analyze", str(ck), *common, str(mine)]) == 2
    assert main(["analyze", str(ck), *common, str(tmp_path / "an")]) == 0
    assert main(["analyze", str(ck), *common, str(tmp_path / "an")]) == 0  # an earlier analysis: replaced


def test_calibrate_names_the_stream_width_an_mhc_rank_is_capped_at(tmp_path, capsys):
    """On an mHC model (2 streams of n_embd 16) --rank 40 was "capped at the model width, 32": the predictors read the
    flattened stream embedding, 2 x 16 wide, not the model's width 16."""
    from snlp.apps.cli import main
    from snlp.io.checkpoint import save_checkpoint

    ck = save_checkpoint(tmp_path / "ck", make_model(seed=2, n_layer=2, hc_streams=2).float())
    assert main(["calibrate", str(ck), "--rank", "40", "--batch", "2", "--seq-len", "32"]) == 0
    assert "(asked for 40: capped at the width of its 2 x 16 stream embedding, 32)" in capsys.readouterr().out


@pytest.mark.parametrize("kw, said", [
    (dict(seq_len=True), "seq_len must be an integer (got True)"),
    (dict(batch=True), "batch must be an integer (got True)"),
    (dict(probes=2.0), "probes must be an integer (got 2.0)"),
    (dict(seed=-1), "seed=-1"),
    (dict(layers=(True,)), "each of layers must be an integer (got True)"),
    (dict(suffixes=(False, 2)), "each of suffixes must be an integer (got False)"),
    (dict(ordering_iters=(-1,)), "ordering_iters=[-1]"),
    (dict(elk_chunks=(True,)), "each of elk_chunks must be an integer (got True)"),
    (dict(elk_values=(True,)), "each ELK value takes a number, not True"),
    (dict(progress="no"), "progress must be True or False"),
    (dict(only="jacobian"), "only must be a tuple of section names, not the string 'jacobian'"),
])
def test_analysis_config_refuses_a_bool_or_wrong_type_in_one_line(kw, said):
    """True is an int: AnalysisConfig(seq_len=True) read one-token windows and batch=True one window per forward,
    layers=(True,) diagnosed layer 1, and only='jacobian' was named as eight unknown sections ('j', 'a', ...).
    `analyze` refuses each in one line before any work (check_model calls check); the defaults pass."""
    A.AnalysisConfig().check(4)
    with pytest.raises(ValueError) as e:
        A.AnalysisConfig(**kw).check(4)
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)

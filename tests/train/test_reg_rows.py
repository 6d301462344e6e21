"""--reg-rows F: the regulariser's K=1 solve on the first ceil(F * B) rows of each micro-batch.

References: for F = 1, the regulariser as it was before the option existed (`paper_loss` below: the paper's sum
over every row, written from the public snlp_states / relative_error / supervised_layers), bit for bit; for F < 1,
a fresh regulariser call on the sliced batch (its own sequential trace of the first r rows, fp64), the CE on the
whole batch, gradients included. The seam matrix (tests/test_seam_matrix.py) draws the same law over surrogates,
masks, the SNLP-forward SFT path and nanochat's parts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model
from snlp.train.config import TrainConfig
from snlp.train.job import TrainStep
from snlp.train.regularizer import (RegConfig, check_rows, reg_rows, relative_error, resolve_suffixes,
                                    snlp_states, supervised_layers)

pytestmark = pytest.mark.usefixtures("one_thread")


def paper_loss(model, idx, trace, cfg: RegConfig, valid=None):
    """The regulariser over every row of the batch (Eq. snlp-training-loss as snlp computed it before --reg-rows)."""
    L = model.config.n_layer
    total = torch.zeros((), dtype=torch.float32)
    for N in resolve_suffixes(L, cfg.suffixes, warn=False):
        states, S = snlp_states(model, idx, cfg.plan(N), trace, fresh_probes=True)  # DiagN: a probe per call
        for l in supervised_layers(L, N, cfg.stride):
            total = total + relative_error(states[l - S - 1], trace[l].detach() if cfg.detach else trace[l], valid)
    return total


def grads_of(model, loss) -> dict:
    loss.backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def batch(B=6, T=10, V=61, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def test_row_counts_and_refusals():
    assert [reg_rows(f, 8) for f in (0.25, 0.5, 0.75, 1.0, 0.01, 0.125)] == [2, 4, 6, 8, 1, 1]
    assert reg_rows(0.3, 10) == 3 and reg_rows(0.7, 10) == 7  # float noise adds no row (0.3 * 10 > 3 in floats)
    for bad in (0, -0.5, 1.01, float("nan"), "0.5"):
        with pytest.raises(ValueError, match=r"--reg-rows must lie in \(0, 1\]"):
            RegConfig(surrogate="idn", rows=bad)
    with pytest.raises(ValueError, match="leaves the regulariser no row"):
        check_rows(1e-12, 8)
    with pytest.raises(ValueError, match="leaves the regulariser no row"):
        RegConfig(surrogate="idn", rows=1e-12).n_rows(8)
    ok = dict(out="x", reg="idn", batch_size=8)
    TrainConfig(**ok, reg_rows=0.25).check()
    TrainConfig(**ok).check()  # the default: every row
    for cfg, msg in ((dict(out="x", reg_rows=0.5), "needs --reg"),
                     (dict(**ok, reg_rows=0.5, reg_lambda=0.0), "needs --reg"),
                     (dict(**ok, reg_rows=0.0), r"must lie in \(0, 1\]"),
                     (dict(**ok, reg_rows=2.0), r"must lie in \(0, 1\]"),
                     (dict(**ok, reg_rows=1e-12), "no row")):
        with pytest.raises(ValueError, match=msg) as e:
            TrainConfig(**cfg).check()
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("surrogate,suffixes,stride", [("idn", (3,), 0), ("idn", (2, 4), 1), ("diag", (3,), 0)])
def test_all_rows_is_the_paper_objective_bit_for_bit(surrogate, suffixes, stride):
    """F = 1 (the default, or given): the training step's loss, terms and every gradient are those of the
    regulariser over every row, bit for bit (no slice, no rescale)."""
    model = make_model(seed=1, n_layer=6)
    x, y = batch()
    lam = 0.5
    for rows in (1.0, 1):
        step = TrainStep(model, RegConfig(surrogate=surrogate, lam=lam, suffixes=suffixes, stride=stride, rows=rows))
        torch.manual_seed(7)  # DiagN's probes: drawn from the global RNG, so both sides draw the same
        loss, ce, rg = step(x, y, lam)
        got = grads_of(model, loss)
        torch.manual_seed(7)
        ctx = model.embed(x)
        trace = [ctx.x0]
        logits = model.head(model.run_layers(ctx.x0, ctx, 0, model.config.n_layer, trace))
        ref_ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)
        ref_rg = paper_loss(model, x, trace, step.reg)
        assert float(ref_rg.detach()) > 1e-3
        ref_loss = ref_ce + lam * ref_rg
        assert torch.equal(rg, ref_rg.detach()) and torch.equal(ce, ref_ce.detach())
        assert torch.equal(loss.detach(), ref_loss.detach())
        want = grads_of(model, ref_loss)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("rows,B", [(0.25, 6), (0.5, 6), (0.34, 3), (0.01, 4)])
@pytest.mark.parametrize("masked", [False, True])
def test_a_row_fraction_equals_a_fresh_regulariser_on_the_sliced_batch(rows, B, masked):
    """F < 1: the regulariser of the step is a fresh call on x[:r] (its own trace, `valid[:r]`), the CE is the
    whole batch's, and so are the gradients (fp64)."""
    model = make_model(seed=2, n_layer=6)
    x, y = batch(B=B, seed=3)
    valid = None
    if masked:  # a padded SFT batch: each row's real tokens first
        lens = torch.randint(1, x.size(1) + 1, (B,), generator=torch.Generator().manual_seed(4))
        valid = torch.arange(x.size(1))[None, :] < lens[:, None]  # (B, T)
    lam = 0.7
    cfg = RegConfig(surrogate="idn", lam=lam, suffixes=(4,), stride=2, rows=rows)
    r = -(-round(rows * B * 1e6) // 10**6)  # ceil by integer arithmetic
    assert cfg.n_rows(B) == r and r < B
    step = TrainStep(model, cfg)
    loss, ce, rg = step(x, y, lam, *(() if valid is None else (valid,)))
    got = grads_of(model, loss)
    xs = x[:r].clone()
    ref_rg = paper_loss(model, xs, model.hidden_states(xs), RegConfig(surrogate="idn", suffixes=(4,), stride=2),
                        None if valid is None else valid[:r].clone())
    if valid is not None:  # the subset's masked sum over r / B of the whole batch's real tokens, not its own
        ref_rg = ref_rg * valid[:r].sum() / (valid.sum() * r / B)
    ref_ce = TrainStep(model, RegConfig())(x, y, 0.0)[0]
    assert float(ref_rg.detach()) > 1e-3
    tol = 1e-12 if valid is None else 2e-7  # the rescaled reference: the term's own fp32 arithmetic (relative_error)
    torch.testing.assert_close(rg, ref_rg.detach(), rtol=tol, atol=1e-12)
    torch.testing.assert_close(ce, ref_ce.detach(), rtol=0, atol=0)
    want = grads_of(model, ref_ce + lam * ref_rg)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12, msg=n)
    # and it is not the whole batch's regulariser (the rows differ)
    full = TrainStep(model, RegConfig(surrogate="idn", lam=lam, suffixes=(4,), stride=2))
    assert abs(float(full(x, y, lam, *(() if valid is None else (valid,)))[2]) - float(rg)) > 1e-6


@pytest.mark.parametrize("B,rows", [(4, 0.25), (4, 0.5), (5, 0.4)])
def test_a_padded_subset_has_the_whole_batchs_expectation_exactly(B, rows):
    """The loader's rows are exchangeable, so every r-subset of a batch is equally likely to be its first r rows:
    the mean of the subset term over all C(B, r) subsets must equal the whole batch's term (fp64), padded rows of
    unequal length included (a mean over the subset's own tokens would weigh short rows more)."""
    import itertools

    model = make_model(seed=5, n_layer=5)
    x, _ = batch(B=B, seed=6)
    lens = torch.tensor([1, x.size(1), 3, 7, 2][:B])
    valid = torch.arange(x.size(1))[None, :] < lens[:, None]  # (B, T), rows of very unequal length
    full = RegConfig(surrogate="idn", suffixes=(3,), stride=1)
    sub = RegConfig(surrogate="idn", suffixes=(3,), stride=1, rows=rows)
    from snlp.train.regularizer import snlp_loss

    with torch.no_grad():
        want = float(snlp_loss(model, x, model.hidden_states(x), full, valid))
        r = sub.n_rows(B)
        terms = []
        for rows_first in itertools.combinations(range(B), r):
            order = list(rows_first) + [i for i in range(B) if i not in rows_first]
            xo, vo = x[order], valid[order]
            terms.append(float(snlp_loss(model, xo, model.hidden_states(xo), sub, vo)))
    assert r < B and len(set(round(t, 9) for t in terms)) > 1  # the subsets differ
    assert sum(terms) / len(terms) == pytest.approx(want, rel=1e-6)  # the term's fp32 norms; the old bias was ~4 %


def test_snlp_forward_sft_traces_only_the_regularised_rows():
    """SNLP-forward SFT (a plan's CE): the regulariser's own sequential trace covers only the first r rows and
    equals a fresh call on them; the CE is the plan's over the whole batch."""
    from snlp.method.plan import Plan
    from snlp.method.solver import solve

    model = make_model(seed=5, n_layer=6)
    x, y = batch(B=4, seed=6)
    plan = Plan.parse("3xF1-h0-K2")
    lam = 0.5
    step = TrainStep(model, RegConfig(surrogate="idn", lam=lam, suffixes=(3,), rows=0.5), plan)
    calls = []
    orig = model.hidden_states
    model.hidden_states = lambda idx, *a, **k: (calls.append(tuple(idx.shape)), orig(idx, *a, **k))[1]
    try:
        loss, ce, rg = step(x, y, lam)
    finally:
        del model.hidden_states
    assert calls == [(2, x.size(1))]
    got = grads_of(model, loss)
    logits = model.head(solve(model, x, plan, check_finite=False).hidden)
    ref_ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)
    ref_rg = paper_loss(model, x[:2], model.hidden_states(x[:2]), RegConfig(surrogate="idn", suffixes=(3,)))
    torch.testing.assert_close(rg, ref_rg.detach(), rtol=1e-12, atol=1e-12)
    want = grads_of(model, ref_ce + lam * ref_rg)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12, msg=n)


def test_train_and_sft_refuse_reg_rows_before_any_work(tmp_path, capsys):
    from snlp.apps.cli import main

    missing = tmp_path / "missing.txt"  # never read: the refusal comes first
    base = ["--depth", "2", "--batch-size", "4", "--steps", "1", "--no-progress", "--device", "cpu"]
    for argv, msg in ((["train", "--out", str(tmp_path / "a"), "--data", str(missing), *base, "--reg-rows", "0.5"],
                       "--reg-rows sets the regulariser's share"),
                      (["train", "--out", str(tmp_path / "a"), "--data", str(missing), *base, "--reg", "idn",
                        "--reg-rows", "1.5"], "--reg-rows must lie in (0, 1]"),
                      (["train", "--out", str(tmp_path / "a"), "--data", str(missing), *base, "--reg", "idn",
                        "--reg-rows", "1e-12"], "leaves the regulariser no row"),
                      (["sft", str(tmp_path / "no-ckpt"), "--data", str(missing), "--out", str(tmp_path / "a"),
                        "--batch-size", "4", "--reg-rows", "0.5"], "--reg-rows sets the regulariser's share"),
                      (["sft", str(tmp_path / "no-ckpt"), "--data", str(missing), "--out", str(tmp_path / "a"),
                        "--batch-size", "4", "--reg", "idn", "--reg-rows", "0"], "--reg-rows must lie in (0, 1]")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "a").exists()


def test_train_logs_the_subset_term_under_its_own_name(tmp_path, capsys):
    """`snlp train --reg-rows 0.5`: the log's train rows carry `reg_subset` (the term over the regularised rows), never
    `reg` (the whole micro-batch's, which a default run logs); the validation gap keeps its name; the banner says the
    rows; the summary's FLOPs per token are the plain step's plus half the full regulariser's extra."""
    import json
    from pathlib import Path

    from snlp.apps.cli import main

    corpus = tmp_path / "c.txt"
    corpus.write_text((Path(__file__).resolve().parents[1] / "data/tinyshakespeare-head.txt").read_text()[:30_000])
    common = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), "--depth", "3", "--width", "64",
              "--head-dim", "32", "--vocab-size", "300", "--seq-len", "16", "--batch-size", "4", "--eval-every", "2",
              "--eval-batches", "1", "--no-progress", "--device", "cpu", "--steps", "2", "--log-every", "1",
              "--reg-n", "2"]
    logs, fpt = {}, {}
    for name, extra in (("plain", []), ("all", ["--reg", "idn"]), ("half", ["--reg", "idn", "--reg-rows", "0.5"])):
        assert main(["train", "--out", str(tmp_path / name), *common, *extra]) == 0
        said = capsys.readouterr()
        assert ("rows=2/4 (--reg-rows 0.5)" in said.out + said.err) is (name == "half")
        logs[name] = [json.loads(l) for l in (tmp_path / name / "log.jsonl").read_text().splitlines()]
        fpt[name] = json.loads((tmp_path / name / "train_summary.json").read_text())["speed"]["flops_per_token"]
    train = lambda rows: [r for r in rows if "loss" in r]  # noqa: E731
    assert all("reg" in r and "reg_subset" not in r for r in train(logs["all"]))
    assert all("reg_subset" in r and "reg" not in r for r in train(logs["half"]))
    assert any(r["reg_subset"] > 0 for r in train(logs["half"]))
    assert any("gap_N2" in r for r in logs["half"]) and any("gap_N2" in r for r in logs["all"])
    assert fpt["half"] == pytest.approx(fpt["plain"] + (fpt["all"] - fpt["plain"]) / 2)

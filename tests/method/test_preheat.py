"""The preheat init (paper App. "ELK Tempering and Preheat Initialization") as an explicit value: fitted,
passed to solve/bind, stored with a fingerprint of the weights it describes, refused when they change,
following the model's dtype/device (never a hidden attribute)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, tokens

from snlp import Plan, bind, fused_sequential, load, load_preheat, parallel_forward, save_checkpoint, solve
from snlp.method import preheat

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return make_model(seed=3, n_layer=5)  # float64, perturbed weights (not identity blocks)


def _fit(model, **kw):
    return preheat.fit(model, preheat.CalibrateConfig(**{"rank": 4, "batch": 2, "seq_len": 8, **kw}))


def test_preheat_recovers_the_states_of_a_linear_toy():
    """States exactly affine in x0 (a linear toy model: h_l = x0 A_l + c_l) are recovered at rank D."""
    gen = torch.Generator().manual_seed(0)
    N, D, L = 200, 6, 3
    x0 = torch.randn(N, D, generator=gen, dtype=torch.float64)
    A_ = torch.randn(L, D, D, generator=gen, dtype=torch.float64)
    c = torch.randn(L, D, generator=gen, dtype=torch.float64)
    states = [x0 @ A_[l] + c[l] for l in range(L)]
    V, U, b = preheat.fit_states(x0, states, rank=D)
    got = preheat.Preheat(V=V, U=U, b=b).predict(x0.view(4, 50, D), [0, 2])  # (2, B, T, D)
    torch.testing.assert_close(got[0], states[0].view(4, 50, D), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got[1], states[2].view(4, 50, D), rtol=1e-9, atol=1e-9)
    V, U, b = preheat.fit_states(x0, states, rank=2)  # low rank: an approximation, not exact
    assert (preheat.Preheat(V=V, U=U, b=b).predict(x0.view(4, 50, D), [0])[0] - states[0].view(4, 50, D)).abs().max() > 1e-3


@pytest.mark.parametrize("plan", ["4xF1-preheat-K4", "2xF2-preheat-K2", "4xF1-preheat-K7-order:reversed",
                                  "3xF1-preheat-K3-elk:0.25", "4xF1-preheat-K4-diag:jvp"])
def test_preheat_init_keeps_the_exactness_laws(model, plan):
    p = Plan.parse(plan)
    idx = tokens(model, T=7)
    pre = _fit(model)
    with torch.no_grad():
        states = solve(model, idx, p, keep_states=True, preheat=pre).states
        exact = fused_sequential(model, idx, p).states[0]
        # the init is the predictor of each chunk's last layer, not h_S
        want0 = pre.predict(model.embed(idx).x0, [model.config.n_layer - p.n_suffix + (c + 1) * p.fuse - 1
                                                  for c in range(p.chunks)])
        torch.testing.assert_close(states[0], want0)
        torch.testing.assert_close(states[-1], exact, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(bind(model, p, preheat=pre).solve(idx).hidden, states[-1][-1], rtol=0, atol=0)
    assert "preheat" not in model.__dict__  # nothing hidden on the caller's model


def test_preheat_plans_need_a_calibration_and_others_refuse_one(model):
    with pytest.raises(ValueError, match="snlp calibrate"):
        parallel_forward(model, tokens(model), "4xF1-preheat-K1")
    with pytest.raises(ValueError, match="does not read it"):
        bind(model, "4xF1-h0-K1", preheat=_fit(model))


def test_parallel_forward_takes_the_calibration_its_refusal_asks_for(model):
    """parallel_forward refused a -preheat- plan with "pass its calibration (preheat=...)" but took no preheat=
    (a TypeError when the caller did as told); it now passes it to the solve, giving bind's logits."""
    idx, pre = tokens(model, T=7), _fit(model)
    with torch.no_grad():
        got = parallel_forward(model, idx, "4xF1-preheat-K1", preheat=pre)
        torch.testing.assert_close(got, bind(model, "4xF1-preheat-K1", preheat=pre)(idx), rtol=0, atol=0)
        assert (got - model(idx)).abs().max() > 1e-6  # K = 1 from the preheat init: not the sequential model
    with pytest.raises(ValueError, match="does not read it"):
        parallel_forward(model, idx, "4xF1-h0-K1", preheat=pre)


def test_calibration_file_roundtrips_with_its_fingerprint(tmp_path, model):
    pre = preheat.fit(model, preheat.CalibrateConfig(rank=3, batch=2, seq_len=8), tokens=torch.arange(40) % 61)
    assert pre.source == "data" and pre.rank == 3 and pre.fingerprint
    back = preheat.Preheat.load(pre.save(tmp_path / "p.pt"))
    torch.testing.assert_close(back.U, pre.U)
    torch.testing.assert_close(back.V, pre.V)
    assert back.fingerprint == pre.fingerprint
    with pytest.raises(ValueError, match="rank"):
        preheat.fit(model, preheat.CalibrateConfig(rank=0))
    (tmp_path / "bad.pt").write_bytes(b"not a calibration")
    with pytest.raises(ValueError, match="corrupt preheat"):
        preheat.Preheat.load(tmp_path / "bad.pt")


def test_a_calibration_of_other_weights_is_refused(model):
    """A calibration must not outlive its weights (training went on, another checkpoint)."""
    other = make_model(seed=3, n_layer=5)
    pre = _fit(other)
    bind(other, "4xF1-preheat-K1", preheat=pre)  # its own weights: fine
    with torch.no_grad():
        next(p for n, p in other.named_parameters() if p.dim() == 2 and "wte" not in n).add_(1e-3)
    with pytest.raises(ValueError, match="other weights"):
        bind(other, "4xF1-preheat-K1", preheat=pre)
    legacy = preheat.Preheat(V=pre.V, U=pre.U, b=pre.b)  # an old file: no fingerprint, cannot be checked
    with pytest.raises(ValueError, match="fingerprint"):
        bind(model, "4xF1-preheat-K1", preheat=legacy)
    wrong = make_model(seed=3, n_layer=4)
    with pytest.raises(ValueError, match="layers"):
        bind(wrong, "2xF1-preheat-K1", preheat=pre)


def test_runner_refresh_rechecks_the_calibration(model):
    m = make_model(seed=4, n_layer=5)
    runner = bind(m, "4xF1-preheat-K1", preheat=_fit(m))
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.01)
    with pytest.raises(ValueError, match="other weights"):
        runner.refresh()
    with pytest.raises(ValueError, match="other weights"):  # a call sees the update itself (Runner.current)
        runner(tokens(m))


def test_checkpoint_save_drops_a_stale_calibration_and_keeps_a_current_one(tmp_path):
    """`preheat.pt` used to be carried over by every save (--save-every, --resume, speedrun re-runs) and
    attached by load to whatever weights were saved next."""
    m = make_model(seed=5, n_layer=4).float()
    ck = save_checkpoint(tmp_path / "ck", m)
    _fit(m).save(ck / preheat.FILENAME)
    save_checkpoint(ck, m)  # same weights: the calibration stays valid and is kept
    assert load_preheat(ck, load(ck)[0]) is not None
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01)
    save_checkpoint(ck, m)  # a training step later: the calibration describes the old weights
    assert not (ck / preheat.FILENAME).exists()
    assert load_preheat(ck, load(ck)[0]) is None


def test_load_preheat_refuses_a_file_that_does_not_match(tmp_path):
    a, b = make_model(seed=6, n_layer=4).float(), make_model(seed=7, n_layer=4).float()
    ck = save_checkpoint(tmp_path / "ck", a)
    _fit(b).save(ck / preheat.FILENAME)  # copied in by hand from another model
    with pytest.raises(ValueError, match="other weights"):
        load_preheat(ck, load(ck)[0])


def test_preheat_follows_the_model_dtype(model):
    """After model.to(float32) (or to a GPU) the calibration's predictions follow; before,
    it stayed fp32 on CPU and any -preheat plan on another dtype/device failed."""
    m = make_model(seed=8, n_layer=5)  # fp64
    pre = _fit(m)
    idx = tokens(m, T=6)
    with torch.no_grad():
        want = solve(m, idx, "4xF1-preheat-K1", preheat=pre).hidden
        m32 = make_model(seed=8, n_layer=5).float()
        got = solve(m32, idx, "4xF1-preheat-K1", preheat=pre.check(m32)).hidden  # the same weights in fp32
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_a_rank_above_the_calibration_tokens_is_refused_in_one_line(model):
    """4 random tokens at rank 32 on a width-16 model stopped in fit_states with an IndexError (the centred embeddings
    span at most 3 directions, so V had 4 columns, not 16); a fit needs more tokens than its rank."""
    with pytest.raises(ValueError, match=r"rank 16 needs more than 16 tokens, got 4 \(batch x seq_len = 1 x 4\)"):
        preheat.fit(model, preheat.CalibrateConfig(rank=32, batch=1, seq_len=4))
    with pytest.raises(ValueError, match=r"rank 8 needs more than 8 tokens, got 8 \(2 windows of 4 data tokens\)"):
        preheat.fit(model, preheat.CalibrateConfig(rank=8, batch=5, seq_len=4), tokens=torch.arange(11) % 61)
    assert preheat.fit(model, preheat.CalibrateConfig(rank=8, batch=3, seq_len=3)).rank == 8  # 9 tokens: enough


def test_a_save_of_the_same_weights_in_another_precision_keeps_the_calibration(tmp_path):
    """save_checkpoint compared the fingerprint strings exactly, so re-saving the calibrated weights in bf16 deleted
    preheat.pt, while load_preheat (same_weights, tolerant of casts) accepts that calibration for the bf16 model."""
    m = make_model(seed=5, n_layer=4).float()
    ck = save_checkpoint(tmp_path / "ck", m)
    _fit(m).save(ck / preheat.FILENAME)
    b16 = load(ck)[0].to(torch.bfloat16)
    assert load_preheat(ck, b16) is not None  # the check accepts it for the cast model
    save_checkpoint(ck, b16)
    assert (ck / preheat.FILENAME).is_file() and load_preheat(ck, load(ck)[0]) is not None


def test_a_save_cut_short_keeps_the_calibration_that_was_there(tmp_path, model, monkeypatch):
    """Preheat.save wrote CKPT/preheat.pt in place: a save cut short (here torch.save failing half way) left a truncated
    file ("corrupt preheat calibration") where a valid calibration had been."""
    path = _fit(model).save(tmp_path / preheat.FILENAME)
    before = path.read_bytes()
    real = torch.save

    def cut(obj, f, *a, **k):
        real(obj, f, *a, **k)
        with open(f, "r+b") as fh:
            fh.truncate(100)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", cut)
    with pytest.raises(KeyboardInterrupt):
        _fit(model, rank=2).save(path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [preheat.FILENAME]


@pytest.mark.parametrize("field,value", [("rank", True), ("batch", True), ("seq_len", True), ("batch", 2.0),
                                         ("seq_len", 8.0)])
def test_a_count_that_is_not_an_integer_is_refused_in_one_line(model, field, value):
    """CalibrateConfig(rank=True) fitted a rank-1 calibration, True standing for 1, as batch=True and seq_len=True ran
    one window or one token (a Plan refuses True as a count: plan.py); a float batch passed the check and failed
    inside the fit."""
    kw = {"rank": 4, "batch": 2, "seq_len": 8, field: value}
    with pytest.raises(ValueError, match=rf"^preheat {field} must be an integer >= 1 \(got {value!r}\)$"):
        preheat.fit(model, preheat.CalibrateConfig(**kw))

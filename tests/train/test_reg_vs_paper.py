"""The regulariser against the paper's own training code (nanochat-snlp gpt.py, GPT.forward with
identity_newton_reg / mhc_newton_reg): same weights (snlp.io.nanochat's mapping), same batch, fp32. Skips without a
checkout beside the repository; tests/train/test_regularizer.py holds the references written from its loops."""

import pytest
import torch

from tests.bench.test_vs_paper import PAPER, needs_paper

pytestmark = needs_paper


def pair(mhc=False, wp="SSL"):
    from snlp.bench.paper_peer import build_paper_model, load_paper_code, snlp_model_from_paper
    code = load_paper_code(PAPER, torch.float32)
    cfg = code.gpt.GPTConfig(sequence_len=16, vocab_size=64, n_layer=6, n_head=2, n_kv_head=2, n_embd=32,
                             window_pattern=wp, use_mhc=mhc, no_x0_resid=mhc, mhc_num_streams=2)
    pm = build_paper_model(code, cfg, torch.device("cpu"), seed=0)
    if mhc:  # H logits away from their init, so the streams differ (at init they are copies and hide the norm)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "hc_" in name:
                    p.add_(0.5 * torch.randn(p.shape, generator=g))
        for block in pm.transformer.h:
            block.hc_attn.cache_hc_matrices(cfg.mhc_sinkhorn_iters, cfg.mhc_sinkhorn_tau)
            block.hc_mlp.cache_hc_matrices(cfg.mhc_sinkhorn_iters, cfg.mhc_sinkhorn_tau)
    pm.train()
    sm = snlp_model_from_paper(pm, torch.device("cpu"), torch.float32).train()
    g = torch.Generator().manual_seed(1)
    return pm, sm, torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)


@pytest.mark.parametrize("n_par,stride,detach", [((4,), 3, False), ((2, 4, 5), 2, False), ((5,), 2, True)])
def test_idn_term_and_gradients_equal_the_papers_for_strides(n_par, stride, detach):
    from snlp.io.nanochat import state_from_nanochat
    from snlp.train.job import TrainStep
    from snlp.train.regularizer import RegConfig
    pm, sm, x, y = pair()
    pm.n_par_configs, pm.idn_stride, pm.idn_detach_target = list(n_par), stride, detach
    want = pm(x, y, identity_newton_reg=0.5)
    want.backward()
    got, _, _ = TrainStep(sm, RegConfig(surrogate="idn", lam=0.5, suffixes=n_par, stride=stride, detach=detach))(
        x, y, 0.5)
    got.backward()
    torch.testing.assert_close(got, want.reshape(()), rtol=1e-6, atol=1e-6)  # its warm-up factor is (1,)
    grads = state_from_nanochat({k: p.grad if p.grad is not None else torch.zeros_like(p)
                                 for k, p in pm.named_parameters()}, sm.config)
    for k, p in sm.named_parameters():
        if p.grad is not None and k in grads:
            torch.testing.assert_close(p.grad, grads[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("stride", [0, 2])
def test_hcn_term_equals_the_papers_mhc_newton_reg(stride):
    from snlp.train.job import TrainStep
    from snlp.train.regularizer import RegConfig
    pm, sm, x, y = pair(mhc=True, wp="L")
    pm.n_par_configs, pm.idn_stride, pm.idn_detach_target = [3], stride, True
    with torch.no_grad():
        want = pm(x, y, mhc_newton_reg=0.5)
        got, _, _ = TrainStep(sm, RegConfig(surrogate="hcn", lam=0.5, suffixes=(3,), stride=stride, detach=True))(
            x, y, 0.5)
    torch.testing.assert_close(got, want.reshape(()), rtol=1e-6, atol=1e-6)  # its warm-up factor is (1,)

"""`fit` against a training loop written out by hand from docs/training.md: the same init and batches, AdamW groups
with the documented LRs, betas and weight decay, the documented LR schedule (linear warm-up, linear warm-down, their
product), gradient accumulation, clipping at the documented norm, and the IDN regulariser of paper Eq.
(snlp-training-loss) computed from its definition (the K=1 state h_S + sum_j (f_j(h_S) - h_S), the relative error
averaged over rows and positions) with lambda ramped by --reg-warmup. The log's loss, regulariser, lambda, LR scale and
gradient norm and the saved weights are the hand loop's."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import snlp.io.data as D
from snlp.model.gpt import GPT
from snlp.train.config import TrainConfig
from snlp.train.pretrain import build_config, prepare_data
from snlp.train.trainer import fit

pytestmark = pytest.mark.usefixtures("one_thread")
SHAKESPEARE = Path(__file__).resolve().parents[1] / "data/tinyshakespeare-head.txt"


def naive_idn_term(model, trace, ctx, N: int) -> torch.Tensor:
    """Eq. (snlp-training-loss) for one N, stride 0: ||h_hat_L - h_L|| / (||h_L|| + eps), mean over rows and positions,
    h_hat_L = h_S + sum_{l=S+1..L} (f_l(h_S) - h_S) (K = 1 from h_S, A = I)."""
    L = model.config.n_layer
    S = L - N
    hS = trace[S]
    hat = hS + sum(model.layer(l, hS, ctx) - hS for l in range(S, L))
    return ((hat - trace[L]).norm(dim=-1) / (trace[L].norm(dim=-1) + 1e-6)).mean()


def hand_loop(cfg: TrainConfig, N: int):
    tok, tokens = prepare_data(cfg, None, 0, 1)
    m = GPT(build_config(cfg, tok.vocab_size))
    m.init_weights(seed=cfg.seed)
    m.train()
    scale = (m.config.n_embd / 768) ** -0.5  # the AdamW embedding-side LRs' width scaling
    mats = [p for p in m.blocks.parameters() if p.dim() == 2]
    groups = [{"params": [m.wte.weight, m.value_embeds], "lr": cfg.embedding_lr * scale},
              {"params": [m.lm_head.weight], "lr": cfg.unembedding_lr * scale},
              {"params": [m.x0_lambdas], "lr": cfg.scalar_lr}, {"params": [m.resid_lambdas], "lr": cfg.scalar_lr * 0.01},
              {"params": mats, "lr": cfg.matrix_lr}]
    assert sum(p.numel() for g in groups for p in g["params"]) == sum(p.numel() for p in m.parameters())
    opt = torch.optim.AdamW(groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=cfg.weight_decay)
    peak = [g["lr"] for g in opt.param_groups]
    rows, micro = [], 0
    for s in range(cfg.steps):
        warm = min(1.0, (s + 1) / cfg.warmup_steps)
        down = min(1.0, (1 - s / cfg.steps) / cfg.warmdown)
        for g, lr in zip(opt.param_groups, peak):
            g["lr"] = lr * warm * down
        lam = cfg.reg_lambda * min(1.0, (s + 1) / cfg.reg_warmup)
        ces, regs = [], []
        for _ in range(cfg.grad_accum):
            x, y = D.batch_at(tokens.train, micro, cfg.seq_len, cfg.batch_size, cfg.seed)
            micro += 1
            ctx = m.embed(x)
            trace = [ctx.x0]
            h = m.run_layers(ctx.x0, ctx, 0, m.config.n_layer, trace)
            ce = F.cross_entropy(m.head(h).flatten(0, 1), y.flatten())
            reg = naive_idn_term(m, trace, ctx, N)
            ((ce + lam * reg) / cfg.grad_accum).backward()
            ces.append(ce.item())
            regs.append(reg.item())
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in m.parameters())).item()
        for p in m.parameters():
            p.grad.mul_(min(1.0, cfg.grad_clip / (norm + 1e-6)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        rows.append({"step": s + 1, "loss": sum(ces) / len(ces), "reg": sum(regs) / len(regs), "lambda": lam,
                     "lr_scale": warm * down, "grad_norm": norm})
    return rows, m.state_dict()


def test_fit_is_the_documented_loop(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(SHAKESPEARE.read_text()[:30_000])
    cfg = TrainConfig(out=str(tmp_path / "run"), data=str(corpus), cache_dir=str(tmp_path / "cache"), depth=3, width=64,
                      head_dim=32, vocab_size=300, seq_len=16, batch_size=2, grad_accum=2, steps=5, warmup_steps=2,
                      warmdown=0.5, optimizer="adamw", matrix_lr=0.003, weight_decay=0.1, grad_clip=1.0, reg="idn",
                      reg_n="2", reg_lambda=0.5, reg_warmup=3, log_every=1, eval_every=100, eval_batches=1,
                      no_progress=True, device="cpu")
    fit(cfg)
    logged = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    logged = [r for r in logged if "loss" in r]
    want, weights = hand_loop(cfg, N=2)
    assert [r["step"] for r in logged] == [r["step"] for r in want] == [1, 2, 3, 4, 5]
    for got, ref in zip(logged, want):
        assert got["lambda"] == pytest.approx(ref["lambda"], rel=1e-12) and got["lr_scale"] == pytest.approx(
            ref["lr_scale"], rel=1e-12)
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), got["step"]
        assert got["reg"] == pytest.approx(ref["reg"], rel=1e-3, abs=1e-7), got["step"]
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), got["step"]
    assert sum(r["reg"] for r in want) > 1e-4  # the regulariser took part
    saved = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert saved.keys() == weights.keys()
    for k, w in weights.items():
        # fp32 round-off between the two summation orders of the regulariser, which Adam's per-element
        # normalisation lifts in elements whose gradient is near 0 (measured: <= 1e-3 in 95 of value_embeds' 38400)
        torch.testing.assert_close(saved[k], w, rtol=1e-3, atol=2e-3, msg=k)


def test_the_logged_loss_of_an_fp64_model_is_its_fp64_mean(tmp_path):
    """The step summed its micro-batches' CE into an fp32 zero (`+=` in place), so an fp64 model's logged loss was
    rounded to fp32 (~1e-7 relative). Reference: each micro-batch's CE written out from the log-softmax in fp64 and
    their plain mean, on the same init and batches; they agree to fp64 round-off."""
    from snlp.train.pretrain import pretrain_job

    corpus = tmp_path / "c.txt"
    corpus.write_text(SHAKESPEARE.read_text()[:30_000])
    cfg = TrainConfig(out=str(tmp_path / "run"), data=str(corpus), cache_dir=str(tmp_path / "cache"), depth=2, width=32,
                      head_dim=16, vocab_size=300, seq_len=16, batch_size=2, grad_accum=3, steps=1, optimizer="adamw",
                      reg="none", log_every=1, eval_every=100, eval_batches=1, no_progress=True, device="cpu")

    def fp64_job(*args):
        job = pretrain_job(*args)
        job.model.double()  # in place: the job's step holds this model
        return job

    fit(cfg, make_job=fp64_job)
    logged = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    loss = next(r["loss"] for r in logged if r.get("step") == 1 and "loss" in r)
    tok, tokens = prepare_data(cfg, None, 0, 1)
    m = GPT(build_config(cfg, tok.vocab_size))
    m.init_weights(seed=cfg.seed)
    m = m.double().eval()
    ces = []
    with torch.no_grad():
        for micro in range(cfg.grad_accum):
            x, y = D.batch_at(tokens.train, micro, cfg.seq_len, cfg.batch_size, cfg.seed)
            logits = m(x)
            assert logits.dtype == torch.float64
            lp = torch.log_softmax(logits, -1).gather(-1, y[..., None])  # (B, T, 1)
            ces.append(-sum(float(v) for v in lp.flatten()) / y.numel())
    ref = sum(ces) / len(ces)
    assert abs(loss - ref) <= 1e-12 * abs(ref), (loss, ref, loss - ref)


def ragged(y: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank 0 keeps the first 5 targets of each row, rank 1 all: the ranks' CE means cover 10 and 32 tokens."""
    return torch.cat([y[:, :5], torch.full_like(y[:, 5:], -1)], 1) if rank == 0 else y


def fp64_ragged_job(*args):
    """pretrain_job with its model in fp64 and ragged targets counted per rank (Job.counts): under DDP each rank's CE
    is weighted by its share of the global batch's targets (10 x 2 / 42 and 32 x 2 / 42, not fp32 numbers)."""
    from snlp.train.pretrain import pretrain_job

    job = pretrain_job(*args)
    job.model.double()  # in place: the job's step holds this model
    base = job.batch
    job.batch = lambda micro, r, w: (lambda x, y: (x, ragged(y, r)))(*base(micro, r, w))
    job.counts = lambda y, valid: (float((y != -1).sum()), float(y.numel()))
    return job


def _fp64_ddp_rank(rank, world, port, cfg):
    from conftest import init_gloo

    init_gloo(rank, world, port)
    fit(cfg, make_job=fp64_ragged_job)


def two_rank_step(tmp_path, rank_fn, grad_accum: int):
    """One AdamW step of a depth-2 model over 2 gloo ranks (`rank_fn` runs each): the run's config, step 1's logged
    row, the data's tokens and the same init in fp64 (train mode) for a one-process reference."""
    from conftest import spawn_ranks

    corpus = tmp_path / "c.txt"
    corpus.write_text(SHAKESPEARE.read_text()[:30_000])
    cfg = TrainConfig(out=str(tmp_path / "run"), data=str(corpus), cache_dir=str(tmp_path / "cache"), depth=2, width=32,
                      head_dim=16, vocab_size=300, seq_len=16, batch_size=2, grad_accum=grad_accum, steps=1,
                      optimizer="adamw", reg="none", log_every=1, eval_every=100, eval_batches=1, no_progress=True,
                      device="cpu")
    spawn_ranks(rank_fn, 2, cfg)
    logged = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    got = next(r for r in logged if r.get("step") == 1 and "loss" in r)
    tok, tokens = prepare_data(cfg, None, 0, 1)
    m = GPT(build_config(cfg, tok.vocab_size))
    m.init_weights(seed=cfg.seed)
    return cfg, got, tokens, m.double().train()


@pytest.mark.slow  # two spawned gloo ranks: ~15 s on 2 cores
def test_an_fp64_ddp_steps_loss_and_gradient_norm_are_the_global_token_means(tmp_path):
    """Under DDP each rank's CE was weighted by an fp32 share of the global token count, so an fp64 model's gradient
    and logged loss were rounded to fp32 (~1e-8 relative). Reference: one process, the same init, both ranks'
    micro-batches with their ragged targets; each micro-batch's CE summed from the fp64 log-softmax over the global
    batch's kept targets, divided by their count, averaged over the micro-batches; its autograd gradient's norm.
    Step 1's logged loss and gradient norm agree to fp64 round-off."""
    cfg, got, tokens, m = two_rank_step(tmp_path, _fp64_ddp_rank, grad_accum=2)
    means = []
    for micro in range(cfg.grad_accum):
        total, n = 0.0, 0
        for r in range(2):
            x, y = D.batch_at(tokens.train, micro, cfg.seq_len, cfg.batch_size, cfg.seed, r, 2)
            y = ragged(y, r)
            lp = torch.log_softmax(m(x), -1)  # (B, T, V) fp64
            for b, t in (y != -1).nonzero().tolist():
                total = total - lp[b, t, y[b, t]]
                n += 1
        assert n == 42
        means.append(total / n)
    loss = sum(means) / len(means)
    loss.backward()
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in m.parameters())).item()
    assert abs(got["loss"] - loss.item()) <= 1e-12 * loss.item(), (got["loss"], loss.item())
    assert abs(got["grad_norm"] - norm) <= 1e-12 * norm, (got["grad_norm"], norm)


def test_a_micro_batch_without_targets_is_refused_before_its_step(tmp_path):
    """A micro-batch whose targets are all -1 has a CE mean of 0/0: the step applied the NaN and the run stopped
    saying 'training loss became nan ... lower the learning rates', a divergence that never was. Refused in one line
    naming the micro-batch, before its forward; the step before it trained and was logged."""
    from snlp.train.pretrain import pretrain_job

    corpus = tmp_path / "c.txt"
    corpus.write_text(SHAKESPEARE.read_text()[:30_000])
    cfg = TrainConfig(out=str(tmp_path / "run"), data=str(corpus), cache_dir=str(tmp_path / "cache"), depth=2, width=32,
                      head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=3, optimizer="adamw", reg="none",
                      log_every=1, eval_every=100, eval_batches=1, no_progress=True, device="cpu")

    def second_empty(*args):
        job = pretrain_job(*args)
        base = job.batch
        job.batch = lambda micro, r, w: (lambda x, y: (x, torch.full_like(y, -1) if micro == 1 else y))(
            *base(micro, r, w))
        return job

    with pytest.raises(ValueError, match=r"micro-batch 1 \(step 2\) has no target to train on") as e:
        fit(cfg, make_job=second_empty)
    assert "\n" not in str(e.value)
    logged = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == [1]


def empty_rank0_job(*args):
    """fp64_ragged_job with rank 0's targets all -1 (its share of the global targets 0): rank 1 holds all 32."""
    job = fp64_ragged_job(*args)
    base = job.batch
    job.batch = lambda micro, r, w: (lambda x, y: (x, torch.full_like(y, -1) if r == 0 else y))(*base(micro, r, w))
    return job


def _empty_rank0_ddp(rank, world, port, cfg):
    from conftest import init_gloo

    init_gloo(rank, world, port)
    fit(cfg, make_job=empty_rank0_job)


def test_a_ddp_rank_without_targets_weighs_nothing_and_logs_no_nan(tmp_path):
    """Under DDP a rank whose micro-batch has no target has share 0 and a CE mean of 0/0 = NaN; its gradient is 0 (the
    step is right) but its logged CE, NaN x 0, made the step's loss NaN, and the run stopped saying the loss had
    diverged. Its mean now weighs nothing: step 1's logged loss and gradient norm are the global batch's token mean
    and its autograd norm (rank 1's targets only), computed in one process in fp64."""
    cfg, got, tokens, m = two_rank_step(tmp_path, _empty_rank0_ddp, grad_accum=1)
    x, y = D.batch_at(tokens.train, 0, cfg.seq_len, cfg.batch_size, cfg.seed, 1, 2)  # rank 1's rows
    lp = torch.log_softmax(m(x), -1)  # (B, T, V) fp64
    loss = -lp.gather(-1, y[..., None]).sum() / y.numel()
    loss.backward()
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in m.parameters())).item()
    assert abs(got["loss"] - loss.item()) <= 1e-12 * loss.item(), (got["loss"], loss.item())
    assert abs(got["grad_norm"] - norm) <= 1e-12 * norm, (got["grad_norm"], norm)

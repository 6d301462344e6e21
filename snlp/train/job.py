"""What the shared training loop trains (`Job`) and its per-micro-batch objective (`TrainStep`: CE plus the
SNLP-aware regulariser), with the run's regulariser settings (`reg_config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from snlp.io.tokenizer import Tokenizer
from snlp.method.jacobian import check_fd_step
from snlp.method.plan import Plan
from snlp.method.solver import solve
from snlp.model.gpt import GPT, GPTConfig
from snlp.train.config import TrainConfig, effective_detach
from snlp.train.precision import step_dtype
from snlp.train.regularizer import RegConfig, parse_suffixes, resolve_suffixes, snlp_loss
from snlp.train.validate import ValidationResult


@dataclass
class Job:
    """What the shared loop (`fit`) trains: pretraining (`pretrain_job`) and SFT (snlp.train.sft) build one.
    The optimiser, LR schedule, checkpointing, resume and DDP machinery are the same for both."""

    model: GPT
    tokenizer: Tokenizer
    # (micro-batch index, rank, world) -> (x, y) or (x, y, valid); y == -1 ignored; valid (B, T) bool marks a padded
    # batch's real positions (the regulariser's mean and the tokens counted run over them)
    batch: Callable[[int, int, int], tuple[Tensor, ...]]
    val_batches: list  # fixed [(x, y)] for validation
    loss: nn.Module  # forward(x, y, lam) -> (loss, ce.detach(), reg.detach()); DDP wraps it
    validate: Callable[[GPT, list], ValidationResult]  # (model, val_batches) -> the validation (no_grad)
    describe: str = ""  # one line for the start banner
    name: str = "snlp train"  # the banner's command name
    state: dict = field(default_factory=dict)  # extra entries saved into train_state.pt (e.g. the SFT config)
    # (y, valid) -> a micro-batch's (CE, regulariser) token counts, the denominators of its two means, on the host;
    # under DDP each rank's means are weighted by its share of the global counts (trainer.token_shares). None: SFT's
    # (y != -1, valid) when the batch has `valid`, else unweighted (every rank's mean over the same number of tokens)
    counts: Callable[[Tensor, Tensor | None], tuple[float, float]] | None = None
    data_digest: str | None = None  # data.tokens_digest of the tokens it trains on (pretraining); a resume checks it
    # the train rows' key of the second term `loss` returns, for a job whose second term is not the regulariser (snlp
    # adapt's final-state MSE); None: the regulariser's `reg` (`reg_subset` under --reg-rows) beside its `lambda`
    second_term: str | None = None
    # with `counts`: a step whose micro-batches hold no position to learn from (its first count 0 on every rank) is
    # skipped before its forward: no optimizer step, no LR-schedule step, not counted as a step, the data cursor moved
    # past it, a log row and the summary's count. This says what such a step lacks (snlp adapt --loss-on replies: "no
    # reply position"). None: such a step is refused in one process (trainer.check_has_targets); a loss that defines
    # the empty mean as 0 would otherwise step AdamW on a zero gradient, whose momentum still moves the weights
    skip_empty: str | None = None
    # whether the checkpoint in `out` stays once a run that stopped for this reason (`stopped_by`, "budget" when its
    # budget ended it) returns; None: always. snlp adapt's OUT/run is removed once a finished run's drafter is written,
    # so the summary line then says what ran, not "saved OUT/run"
    keeps_checkpoint: Callable[[str], bool] | None = None


class TrainStep(nn.Module):
    """One micro-batch: CE (targets == -1 ignored) and the regulariser. A module so DDP wraps it and
    syncs the gradients of both terms.

    plan None: the sequential forward; its trace feeds the regulariser (one forward for both).
    plan given: CE on the SNLP logits of `plan` (snlp.solve under autograd: the fused chunk weights
    are rebuilt from the parameters on every call, so gradients flow through all K iterations into
    the model; the paper's SNLP-forward SFT); the regulariser then needs its own sequential trace."""

    def __init__(self, model: GPT, reg: RegConfig, plan: Plan | None = None):
        super().__init__()
        self.model, self.reg, self.plan = model, reg, plan
        # the regulariser's K=1 plans, built here, never inside a (compiled) forward: RegConfig.plans
        self.reg_plans = reg.plans(model.config.n_layer) if reg.active and model.config.n_layer > 1 else None

    def check_fd_step(self, device) -> None:
        """Refuse a diag:fd eps below the FD step floor of the dtype this step computes in on `device` (step_dtype:
        bf16 under CUDA autocast), in the SNLP forward's plan or the regulariser's surrogate, before any step (the
        solve refused it at the first step, after the data was read). `device` need not exist on this host."""
        dtype, kind = step_dtype(device, self.model.wte.weight.dtype), torch.device(device).type
        if self.plan is not None:
            check_fd_step(self.plan, dtype, kind)
        self.reg.check_fd_step(self.model.config.n_layer, dtype, kind)

    def forward(self, x, y, lam: float | Tensor, valid: Tensor | None = None, share: Tensor | None = None):
        """lam: the regulariser weight, a float (eager: 0 skips the regulariser) or a 0-dim tensor (the compiled
        step: an input of the graph, so the ramp of --reg-warmup is no recompile; the regulariser then runs
        whenever it is active, and the branch is fixed when the graph is traced). An inactive RegConfig (no
        surrogate, or lambda 0) runs none whatever `lam`, eager as compiled. `valid` (B, T) bool: a padded
        batch's real positions (SFT), over which the regulariser averages; the CE needs none (padding's targets
        are -1). `share` (2,): under DDP, this rank's share of the global batch's targets and real positions
        (its counts x world / the global counts; snlp.train.trainer.token_shares), weighting its CE and regulariser
        means so that DDP's average of the ranks' gradients is the token mean over the global batch, as one process
        of that batch computes it (an unweighted average of the ranks' means weighs a rank of short replies as
        much as one of long ones). The returned CE and term stay this rank's own means."""
        m = self.model
        trace = None
        if self.plan is None:
            ctx = m.embed(x)
            trace = [ctx.x0]
            logits = m.head(m.run_layers(ctx.x0, ctx, 0, m.config.n_layer, trace))
        else:
            # check_finite=False: no host sync per micro-batch; the trainer checks the loss is finite each step
            logits = m.head(solve(m, x, self.plan, check_finite=False).hidden)
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)
        if self.reg.active and (isinstance(lam, Tensor) or lam > 0):
            if trace is None:  # SNLP-forward SFT: the sequential trace of only the rows the regulariser reads
                r = self.reg.n_rows(x.size(0))
                trace = m.hidden_states(x if r == x.size(0) else x[:r])
            reg = snlp_loss(m, x, trace, self.reg, valid, self.reg_plans)
            if share is not None:
                return ce * share[0] + lam * reg * share[1], ce.detach(), reg.detach()
            return ce + lam * reg, ce.detach(), reg.detach()
        return ce if share is None else ce * share[0], ce.detach(), torch.zeros((), device=x.device)


def reg_config(cfg: TrainConfig, model_cfg: GPTConfig, master: bool = True) -> RegConfig:
    """The regulariser of a run (paper: HCN's target detached, IDN's not); checked against the model once
    (e.g. --reg hcn needs an mHC model: --hc-streams N). A suffix length N >= depth is clipped, and warned once
    (on the `master` rank) only when the regulariser is on: with --reg none, N only names the logged gap."""
    reg = RegConfig(surrogate=None if cfg.reg == "none" else cfg.reg, lam=cfg.reg_lambda,
                    suffixes=parse_suffixes(cfg.reg_n), stride=cfg.reg_stride, warmup=cfg.reg_warmup,
                    rows=1.0 if cfg.reg_rows is None else cfg.reg_rows)
    reg.detach = effective_detach(cfg.reg_detach, cfg.reg)
    if reg.active and model_cfg.n_layer < 2:  # its K=1 solve needs a prefix and a suffix: N = 1 .. depth - 1
        raise ValueError(f"--reg {cfg.reg}: no regulariser suffix fits a {model_cfg.n_layer}-layer model (need 1 <= N < "
                         f"depth): train 2 or more layers, or use --reg none")
    try:
        reg.check_model(model_cfg)
    except ValueError as e:  # the one check (Plan.check_model), said in the flags' terms
        raise ValueError(f"--reg {cfg.reg} needs an mHC model: add --hc-streams N (N >= 1), or use --reg idn ({e})"
                         if reg.surrogate.needs_mhc else str(e)) from None
    if reg.active and master and model_cfg.n_layer > 1:
        resolve_suffixes(model_cfg.n_layer, reg.suffixes)  # warns of each clipped N
    return reg


def gap_suffixes(cfg: TrainConfig, model_cfg: GPTConfig, reg: RegConfig, master: bool) -> list[int]:
    """The suffix lengths N of the logged gap (the regulariser's), clipped to the model; `reg_config` warned
    of the clipping if the regulariser is on."""
    return resolve_suffixes(model_cfg.n_layer, reg.suffixes, warn=False) if model_cfg.n_layer > 1 else []

"""Adapt an SNLP drafter to a pretrained model: `adapt(AdaptConfig) -> AdaptResult`, `snlp adapt`.

The base model stays unchanged (it verifies in self-speculative decoding, so greedy output stays the base's
own, bit for bit). Only the drafter's copy of the plan's suffix layers is trained (snlp.method.drafter):

  teacher  the base run sequentially, once per batch without gradients: its exact prefix state h_S (the
           drafter's prefix IS the base's, so this is also the student's), its suffix layers' exact K/V,
           its final state h_L and its logits;
  student  the plan's K-iteration SNLP solve of the drafter's suffix from h_S, trained through the solve:
           kv="exact" (default) under self-speculative-decoding conditions (snlp.method.ssd_solve: each
           position attends to the base's exact K/V of earlier positions and to its own only at itself,
           what a cached draft step sees), or kv="own" (a plain teacher-forced window, snlp.solve);
  loss     KL(teacher || student) on the logits (temperature tau) + hidden_weight * MSE between the
           RMS-normalised final states (the issue's probe used the MSE term alone), averaged over every window
           position (loss_on="all") or over the positions whose next token is an assistant reply token only
           (loss_on="replies": the chat mask SFT trains on, snlp.io.chat; prompts stay in the context; a step
           whose windows hold no reply position on any rank is skipped, not stepped: Job.skip_empty).

A run can start its suffix from a saved drafter of the same base and suffix layout (init_drafter) with a fresh
optimiser and LR schedule, to continue training it on other settings (unlike resume, which continues one run).

Optimiser (AdamW on the suffix weights), stateless LR schedule, progress, checkpoints with exact resume and
atomic saves are `snlp train`'s (snlp.train.trainer.fit with an adaptation `Job`): the run's checkpoint lives
in OUT/run while it runs (for --resume) and the drafter directory OUT (snlp.io.drafter) is written at the end.
Data: any `--data` spec `snlp train` takes (text), and chat sets as `chat:SPEC` (snlp.io.chat: JSONL
{"messages": [...]} or hf:NAME), rendered with the model's own chat template; comma-separated specs mix.
With `self_distill` N the chat parts' training conversations are replaced by their opening prompts followed by the
base's own greedy reply of N tokens (snlp.train.selfgen: what self-speculative decoding verifies against); the
held-out stream stays the human one.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import snlp.io.chat as chat
import snlp.io.data as D
from snlp.io.checkpoint import DRAFTER_META, WEIGHTS, checkpoint_dir, is_snlp_checkpoint, load, load_train_state
from snlp.io.nanochat import is_nanochat_dir
from snlp.io.drafter import load_drafter, read_meta, save_drafter
from snlp.io.hf import from_hf
from snlp.io.source import home_path
from snlp.method.jacobian import check_fd_step
from snlp.method.drafter import Drafter, drafter_from_model, make_drafter, suffix_parameters
from snlp.method.lowrank import check_rank
from snlp.method.plan import Plan
from snlp.method.solver import solve
from snlp.method.ssd_solve import check_ssd_plan, exact_kv, ssd_solve
from snlp.model.fingerprint import same_weights, weights_fingerprint
from snlp.model.gpt import GPT, eval_mode
from snlp.model.ops import norm
from snlp.runtime.device import cli_device
from snlp.train.checkpointing import UNSAVED_LOG, check_resume_left, read_log, unsaved_log_path
from snlp.train.config import TrainConfig, resumed, shown
from snlp.train.distributed import setup_dist, teardown_dist
from snlp.train.hooks import TrainHooks, deferred
from snlp.train.job import Job
from snlp.train.precision import step_dtype
from snlp.train.selfgen import self_distill_rows
from snlp.train.trainer import fit
from snlp.train.validate import ValidationResult, row_slices

KV_MODES = ("exact", "own")
LOSS_ON = ("all", "replies")
RESUME_FIXED = ("data", "val_frac", "max_chars", "kv", "lora_rank", "lora_alpha", "self_distill",
                "self_distill_prompts", "loss_on", "init_drafter",  # --resume must keep these: the data and split,
                "seq_len", "batch_size", "lr", "hidden_weight", "kl_weight", "tau", "warmup_steps", "warmdown",
                "grad_clip", "seed", "dtype")  # and what the steps optimise and how (the trainer refuses them too,
#                                                but under its own names, after the replies are decoded)
# What `--resume` never takes from the saved run (config.NOT_INHERITED's counterparts): where it writes, that it
# resumes, a one-off stop, the machine it runs on. Every other setting not typed is the saved run's.
NOT_INHERITED = ("out", "resume", "stop_after", "device")
SPLIT = ("data", "val_frac", "max_chars")  # what decides a run's held-out documents
TRAIN_DATA = ("data", "text_field", "max_chars", "val_frac", "cache_dir")  # snlp train's split (eval.data keys)
RUN = "run"  # OUT/run: the training checkpoint (resume); removed once the run has finished


SAVE_EVERY = 50  # full-weight runs' checkpoint interval when --save-every is not given (LoRA runs keep none)
# the training settings a --from-model import (no training; validation on the base's device, the CPU) has no use for
FROM_MODEL_UNUSED = ("lr", "warmup_steps", "warmdown", "grad_clip", "hidden_weight", "kl_weight", "eval_every",
                     "log_every", "stop_after", "seed")
# the integer settings (counts, sizes, the seed), which `check` refuses as bools
COUNTS = ("steps", "seq_len", "batch_size", "lora_rank", "warmup_steps", "max_chars", "eval_every", "eval_batches",
          "save_every", "log_every", "stop_after", "seed", "self_distill", "self_distill_prompts")

@dataclass
class AdaptConfig:
    """An adaptation run: the base `src` (snlp checkpoint, or anything `snlp convert` takes), the `plan`, the
    drafter directory `out`, the data and the budget (steps and/or minutes; neither = 200 steps)."""

    src: str
    plan: str
    out: str
    data: str = "stdlib"
    steps: int | None = None
    minutes: float | None = None
    seq_len: int = 128
    batch_size: int = 4
    lr: float = 3e-4
    kv: str = "exact"
    lora_rank: int = 0  # > 0: train rank-r deltas of the base's suffix matrices (snlp.method.lowrank), not copies
    lora_alpha: float | None = None  # LoRA scale alpha / r (default alpha = r)
    from_model: str | None = None  # no training: the drafter's suffix = this fine-tuned copy's (drafter_from_model)
    hidden_weight: float = 1.0
    kl_weight: float = 1.0
    tau: float = 1.0
    warmup_steps: int = 10
    warmdown: float = 0.3
    grad_clip: float = 1.0
    val_frac: float = 0.05
    max_chars: int = 0
    eval_every: int = 50
    eval_batches: int = 2
    save_every: int | None = None  # resumable checkpoints every N steps, 0: end only (None: `saves_every`)
    log_every: int = 10
    stop_after: int | None = None
    resume: bool = False
    seed: int = 0
    device: str | None = None
    cache_dir: str | None = None  # keep the tokenised text data here, keyed by data and tokenizer (None: re-tokenise)
    self_distill: int = 0  # > 0: train on the base's own greedy replies of this many tokens (snlp.train.selfgen)
    self_distill_prompts: int = 0  # at most this many training prompts per chat part (0: all)
    loss_on: str = "all"  # "replies": the loss averaged over assistant-reply positions only (chat data)
    init_drafter: str | None = None  # a saved drafter of this base whose suffix weights the run starts from
    dtype: str = "float32"
    no_progress: bool = False

    @property
    def saves_every(self) -> int:
        """The checkpoint interval the run uses (and its record holds): `save_every`, else SAVE_EVERY for a
        full-weight run and 0 (end only) for a LoRA one or a --from-model import (which trains nothing)."""
        return 0 if self.lora_rank or self.from_model else SAVE_EVERY if self.save_every is None else self.save_every

    def check(self) -> Plan:
        # bool is an int: steps=True passed into the shared loop as `steps: True` (the rule of Plan's counts)
        for k in COUNTS:
            if isinstance(getattr(self, k), bool):
                raise ValueError(f"--{k.replace('_', '-')} takes an integer, not {getattr(self, k)!r}")
        plan = Plan.parse(self.plan)
        if plan.init == "preheat":  # the solve would refuse it only after the base and data load; ssd_solve's own
            # refusal pointed at --kv own, which takes no calibration either
            raise ValueError(f"--plan {plan}: the preheat init predicts the suffix states from a calibration (snlp "
                             f"calibrate) that adaptation neither takes nor could keep valid while the suffix trains, "
                             f"and drafter eval refuses it: use the h0 or fwd init")
        if plan.init == "h0" and plan.iters == 0:  # the early exit: the drafter's logits are the head of h_S, so
            # no suffix weight reaches the loss (the first backward failed with a bare autograd RuntimeError)
            raise ValueError(f"--plan {plan}: with the h0 init and K = 0 the suffix is skipped (early exit), so the "
                             f"drafter has no weight to adapt: give K >= 1, or the fwd init")
        if self.save_every is not None and self.save_every < 0:  # the loop's step % N would save every step
            raise ValueError(f"--save-every must be >= 0 (N > 0: every N steps, 0: at the end only; got "
                             f"{self.save_every})")
        D.check_val_frac(self.val_frac)  # the split's own refusal came after the base loaded
        if self.kv not in KV_MODES:
            raise ValueError(f"--kv must be one of {', '.join(KV_MODES)} (got {self.kv!r})")
        if self.kv == "exact":
            check_ssd_plan(plan)
        if not (0 <= self.hidden_weight < math.inf and 0 <= self.kl_weight < math.inf) \
                or self.hidden_weight + self.kl_weight <= 0:  # an inf weight made every step's gradient NaN
            raise ValueError(f"--hidden-weight and --kl-weight must be finite numbers >= 0, not both 0 (got "
                             f"{self.hidden_weight}, {self.kl_weight})")
        if not (0 < self.tau < math.inf and 0 < self.lr < math.inf):  # (the shared loop's check named --matrix-lr)
            raise ValueError(f"--tau and --lr must be finite numbers > 0 (got {self.tau}, {self.lr})")
        check_rank(self.lora_rank, self.lora_alpha)
        if self.init_drafter and self.from_model:
            raise ValueError("--init-drafter starts training from a drafter, and --from-model trains nothing: use one")
        if self.init_drafter and not self.resume:  # a typo or a folder of another kind: one line before the base
            # loads (init_state reads it again and checks it against the base). A resumed run continues its own
            # weights and records the digest its first leg saved (`init_digest`): the folder is not read again
            read_meta(self.init_drafter)
        if self.from_model and (self.lora_rank or self.resume or self.steps is not None or self.minutes is not None
                                or self.save_every):
            raise ValueError("--from-model packages another model's suffix as the drafter without training: it takes "
                             "no --lora-rank, --resume, --steps, --minutes or --save-every")
        if self.from_model:
            unused = [f"--{k.replace('_', '-')}" for k in FROM_MODEL_UNUSED
                      if getattr(self, k) != AdaptConfig.__dataclass_fields__[k].default]
            if unused:  # the import trains nothing and validates on the base's own device: these would be dropped
                raise ValueError(f"--from-model packages another model's suffix as the drafter without training: "
                                 f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} nothing to set (it "
                                 f"validates with --data, --seq-len, --batch-size, --eval-batches, --kv and --tau on "
                                 f"--device): drop {'it' if len(unused) == 1 else 'them'}")
        if self.max_chars < 0:  # the shared loop's check below does not see it (its TrainConfig takes no data cap)
            raise ValueError(f"--max-chars must be >= 0 (0: all; got {self.max_chars})")
        if self.max_chars and all(p.startswith("chat:") for p in D.parts(self.data)):  # chat parts are never capped
            raise ValueError(f"--max-chars caps the text parts of --data, and {self.data!r} has none (chat: parts are "
                             f"read whole): drop it")
        if self.self_distill < 0 or self.self_distill_prompts < 0:
            raise ValueError(f"--self-distill and --self-distill-prompts must be >= 0 (got {self.self_distill}, "
                             f"{self.self_distill_prompts})")
        if self.self_distill_prompts and not self.self_distill:
            raise ValueError("--self-distill-prompts caps the prompts of --self-distill N: give --self-distill too")
        if self.self_distill and self.from_model:
            raise ValueError("--self-distill generates training data, and --from-model trains nothing: use one")
        if self.self_distill and not any(p.startswith("chat:") for p in D.parts(self.data)):
            raise ValueError(f"--self-distill needs chat prompts: --data {self.data!r} has no chat:PATH part (the "
                             f"base replies to the opening user turn of each training conversation)")
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"--loss-on must be one of {', '.join(LOSS_ON)} (got {self.loss_on!r})")
        if self.loss_on == "replies":
            text = [p for p in D.parts(self.data) if not p.startswith("chat:")]
            if text or self.from_model:
                raise ValueError("--loss-on replies averages the loss over chat replies: " + (
                    "--from-model trains nothing" if self.from_model else
                    f"--data has text parts without replies ({', '.join(text)}): give chat:PATH parts only, "
                    "or --loss-on all"))
        if self.lora_rank and (self.resume or self.stop_after is not None):
            # the shared loop's checkpoint is a plain GPT state; a LoRA drafter's parametrized state is not one
            raise ValueError("--lora-rank runs cannot be stopped and resumed (--stop-after/--resume): run them to "
                             "the end, or adapt full suffix weights (--lora-rank 0)")
        if self.lora_rank and self.save_every:
            # the same reason: a LoRA run saves its drafter at the end only, so DIR/run would hold nothing usable
            raise ValueError(f"--save-every {self.save_every} keeps resumable checkpoints, and --lora-rank runs keep "
                             "none (their drafter is saved at the end only): drop --save-every, or give 0")
        if not self.from_model:
            # the shared loop's refusals (a negative --warmup-steps or --grad-clip, ...) before the base loads; fit
            # asks them again (the width, unknown here, only scales the head's LR)
            train_config(self, 768).check()
        return plan


@dataclass
class AdaptResult:
    """What `adapt` did: the drafter directory, the run's size and the validation before and after."""

    out: str
    plan: str
    kv: str
    steps: int
    tokens: int
    minutes: float
    stopped_by: str
    before: dict = field(default_factory=dict)  # the first validation's record (the unadapted drafter)
    after: dict = field(default_factory=dict)  # the last one
    extra_bytes: int = 0  # the drafter's own weights (what it adds to the base's memory)
    device: str = ""  # where the run trained (the resolved --device)
    world: int = 1  # processes (torchrun): gradients all-reduced, rank 0 the one writer
    rank: int = 0  # this process's rank (only rank 0's result carries the validation records)
    signal: str | None = None  # stopped_by "interrupt": the signal's name (TrainResult.signal)
    late_signal: str | None = None  # one after the run's last stop check, held (TrainResult.late_signal)
    skipped_steps: int = 0  # --loss-on replies: steps whose windows held no reply position (no update, not in steps)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class AdaptValidation(ValidationResult):
    """Validation of a drafter against its base on held-out windows: `loss` = the training KL under the
    run's kv mode, Top-1 agreement with the base's argmax in a teacher-forced window (`top1`, the paper's
    metric: pure SNLP forward) and under SSD conditions (`top1_ssd`, what a first draft step sees)."""

    top1: float = 0.0
    top1_ssd: float | None = 0.0  # None: a plan ssd_solve does not cover (kv="own" only), not measured
    mse: float = 0.0

    def record(self) -> dict:
        return {"val_loss": self.loss, "top1": self.top1, "top1_ssd": self.top1_ssd, "val_mse": self.mse}


def load_base(src: str, dtype: str = "float32", need_tokenizer: bool = True):
    """(model, tokenizer) of an snlp checkpoint directory, or of anything `snlp convert` takes (from_hf).
    `need_tokenizer` False: a transformers directory without one gives (model, None) (a --from-model TUNED, whose
    suffix alone is read, and a drafter's base for `snlp export`, which writes a tokenizer only when there is one)."""
    p = Path(src)
    if p.is_file() and is_snlp_checkpoint(p.parent):  # a file inside an snlp checkpoint names it (as `snlp eval`)
        p = p.parent
    if is_snlp_checkpoint(p) or is_nanochat_dir(p):  # a transformers directory also holds model.safetensors
        # built in `dtype` from the stored weights (load + .to would round an fp64 checkpoint through float32)
        return load(p, dtype=getattr(torch, dtype))
    model, tok = from_hf(src, dtype=dtype)
    if tok is None and need_tokenizer:
        raise ValueError(f"{src} has no tokenizer; adaptation data must be tokenized with the model's own")
    return model, tok


def token_stream(spec: str, tok, max_chars: int, val_frac: float, cache_dir=None) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) token streams of a data spec: snlp.io.chat.token_streams (text parts as `snlp train` reads
    them, `chat:` parts split by snlp.io.chat.split_conversations, the split `snlp eval --drafter` reuses).
    `cache_dir`: read from / write to an .npz there keyed like `snlp train`'s token cache (the data's files, cap
    and split, the tokenizer's fingerprint); text-only specs (chat: parts are re-rendered every time)."""
    if cache_dir is None or any(s.startswith("chat:") for s in D.parts(spec)):
        return chat.token_streams(spec, tok, max_chars, val_frac)
    path = Path(cache_dir) / f"{D.split_key(spec, 'text', max_chars, val_frac)}-{tok.documents_key}.adapt.npz"
    if path.is_file():
        with np.load(path) as z:
            return z["train"], z["val"]
    train, val = chat.token_streams(spec, tok, max_chars, val_frac)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}.npz")
    np.savez(tmp, train=train, val=val)
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    return train, val


def teacher(base: GPT, x: torch.Tensor, plan: Plan, kv: str):
    """The base's sequential pass over x (no grad): prefix state h_S, final state h_L, logits, for kv="exact" the
    suffix layers' exact K/V, and the backout state a solve from h_S needs (GPT.prefix_backout; None without)."""
    with torch.no_grad():
        ctx = base.embed(x)
        trace = [ctx.x0]
        hL = base.run_layers(ctx.x0, ctx, 0, base.config.n_layer, trace)  # what the head reads (backout applied)
        S = plan.prefix_len(base.config.n_layer)
        kvx = exact_kv(base, trace, plan, ctx) if kv == "exact" else None
        return trace[S], hL, base.head(hL), kvx, base.prefix_backout(trace, S)


def student(drafter: Drafter, x: torch.Tensor, hS: torch.Tensor, kvx, kv: str, hb: torch.Tensor | None = None
            ) -> torch.Tensor:
    """The drafter's final state h_L (B, T, D) from the exact h_S: SSD conditions or a teacher-forced window."""
    if kv == "exact":
        return ssd_solve(drafter.model, x, drafter.plan, hS, kvx)
    return solve(drafter.model, x, drafter.plan, prefix=hS, check_finite=False, hb=hb).hidden


def distill_terms(drafter: Drafter, hL_t, logits_t, hL_s, tau: float, weight: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(KL(teacher || student) per token at temperature tau (scaled by tau^2), MSE of the RMS-normalised final
    states, the student's logits). `weight` (B, T) 0/1: both terms averaged over the positions it marks only
    (0 when it marks none, with a zero gradient: the trainer skips a step whose windows hold none, Job.skip_empty);
    None: over every position."""
    logits_s = drafter.model.head(hL_s)
    V = logits_s.shape[-1]
    # the MSE in fp32 at least (bf16 states upcast) and in the states' own dtype when wider: `.float()` rounded an
    # fp64 run's final states, so its MSE term and that term's gradient, to fp32 (~1e-8 relative)
    wide = torch.promote_types(hL_s.dtype, torch.float32)
    hs, ht = norm(hL_s.to(wide)), norm(hL_t.to(wide))
    ls, lt = F.log_softmax(logits_s.view(-1, V) / tau, -1), F.log_softmax(logits_t.view(-1, V) / tau, -1)
    if weight is None:
        kl = F.kl_div(ls, lt, log_target=True, reduction="batchmean") * tau * tau
        mse = F.mse_loss(hs, ht)
        return kl, mse, logits_s
    w = weight.reshape(-1).to(ls.dtype)  # (B*T,)
    n = w.sum().clamp_min(1.0)
    kl = (F.kl_div(ls, lt, log_target=True, reduction="none").sum(-1) * w).sum() / n * tau * tau
    sq = (hs - ht).pow(2).mean(-1).reshape(-1)  # (B*T,)
    mse = (sq * w.to(sq.dtype)).sum() / n.to(sq.dtype)
    return kl, mse, logits_s


class AdaptStep(nn.Module):
    """One micro-batch of distillation: forward(x, y, lam) -> (loss, KL, MSE), the trainer's TrainStep
    interface (lam unused; the targets are the base's own outputs, so y carries the loss_on="replies" mask:
    y[b, t] = 1 when the token after position t is a reply token, unused with "all"). The drafter's model is a submodule,
    so DDP (torchrun) all-reduces the gradients of its trainable suffix weights; the shared prefix, embedding
    and head are frozen (requires_grad False) and DDP leaves them alone."""

    def __init__(self, base: GPT, drafter: Drafter, cfg: AdaptConfig):
        super().__init__()
        self.drafter, self.cfg = drafter, cfg
        self.student = drafter.model  # registered: the parameters DDP syncs (the drafter's trainable suffix)
        self.base = [base]  # not a submodule: the base is the frozen teacher, never DDP-wrapped or saved here

    def forward(self, x, y, lam: float, share: torch.Tensor | None = None):
        """`share` (2,): under DDP with loss_on="replies", this rank's share of the global micro-batch's reply
        positions (snlp.train.trainer.token_shares; both entries equal, KL and MSE average over the same positions):
        each rank's means are over its own replies, so DDP's average of the ranks' gradients is the global batch's
        mean only when each is weighted by it. The returned KL and MSE stay this rank's own means."""
        c = self.cfg
        hS, hL_t, logits_t, kvx, hb = teacher(self.base[0], x, self.drafter.plan, c.kv)
        w = y if c.loss_on == "replies" else None  # the batch's y: 1 where the next token is a reply token
        kl, mse, _ = distill_terms(self.drafter, hL_t, logits_t, student(self.drafter, x, hS, kvx, c.kv, hb), c.tau,
                                   w)
        loss = c.kl_weight * kl + c.hidden_weight * mse
        # the shared loop stops on a non-finite logged loss (the KL here), not on the weighted sum it steps on: a
        # finite KL beside an inf/NaN MSE term stepped NaN into the drafter, which was then written with status 0.
        # 0 * loss is 0 where the sum is finite (the KL logged unchanged) and NaN where it is not (no host sync)
        kl_log = kl.detach() + 0 * loss.detach()
        return loss if share is None else loss * share[0], kl_log, mse.detach()


@torch.no_grad()
def validate_drafter(base: GPT, drafter: Drafter, batches, cfg: AdaptConfig, device,
                     rows: int | None = None) -> AdaptValidation:
    """KL, MSE and Top-1 agreement with the base (teacher-forced window and SSD conditions) on `batches`. `rows`:
    the most rows one forward runs (under DDP a batch holds the global batch's rows: snlp.train.validate.validate);
    every position counts in each term, so a batch's means are its slices' means weighted by their rows."""
    kl = mse = top1 = top1_ssd = 0.0
    # the training loop's drafter leaves in the modes it came in (each submodule's own), an exception too
    with eval_mode(drafter.model):
        try:
            modes = KV_MODES if check_ssd_plan(drafter.plan) else ()
        except ValueError:  # a plan ssd_solve does not cover (kv="own" only): no SSD-conditions metric (None)
            modes = ("own",)
        slices = ((xb[cut], xb[cut].size(0) / xb.size(0)) for xb, _ in batches for cut in row_slices(xb.size(0), rows))
        for x, w in slices:
            x = x.to(device)
            hS, hL_t, logits_t, kvx, hb = teacher(base, x, drafter.plan, "exact" if "exact" in modes else "own")
            ref = logits_t.argmax(-1)
            outs = {"exact": (0.0, 0.0, 0.0)}
            for mode in modes:
                k, m, lg = distill_terms(drafter, hL_t, logits_t, student(drafter, x, hS, kvx, mode, hb), cfg.tau)
                outs[mode] = (float(k), float(m), float((lg.argmax(-1) == ref).double().mean()))
            kl += outs[cfg.kv][0] * w
            mse += outs[cfg.kv][1] * w
            top1 += outs["own"][2] * w
            top1_ssd += outs["exact"][2] * w
    n = len(batches)
    return AdaptValidation(loss=kl / n, top1=top1 / n, top1_ssd=top1_ssd / n if "exact" in modes else None,
                           mse=mse / n)


def train_config(cfg: AdaptConfig, width: int) -> TrainConfig:
    """The shared loop's settings: AdamW at cfg.lr on every suffix weight (matrices and norm weights alike)."""
    return TrainConfig(out=str(Path(cfg.out) / RUN), resume=cfg.resume, seq_len=cfg.seq_len,
                       batch_size=cfg.batch_size, steps=cfg.steps if cfg.steps is not None or cfg.minutes else 200,
                       minutes=cfg.minutes, stop_after=cfg.stop_after, optimizer="adamw", matrix_lr=cfg.lr,
                       unembedding_lr=cfg.lr * (width / 768) ** 0.5, weight_decay=0.0,
                       warmup_steps=cfg.warmup_steps, warmdown=cfg.warmdown, grad_clip=cfg.grad_clip,
                       seed=cfg.seed, device=cfg.device, eval_every=cfg.eval_every, eval_batches=cfg.eval_batches,
                       save_every=cfg.saves_every,
                       log_every=cfg.log_every, no_progress=cfg.no_progress)


def adapt_job(cfg: AdaptConfig, plan: Plan, held: dict, loaded: tuple, fingerprint: str, owned: bool = True,
              init: dict | None = None, digest: str | None = None):
    """The `make_job` of fit: the base (`loaded` = (model, tokenizer), loaded once by the caller; frozen, with
    its weights `fingerprint`), its drafter (resumed: the run's suffix weights), the token streams and the
    distillation step. `owned`: the base was loaded for this run and may be moved to the run's device; a
    caller's model (owned False) is never moved: the run uses a copy on its device when they differ. `held`
    receives the base, the drafter, this process's rank and world and the device for the caller. `init`: the
    suffix state the drafter starts from (`init_state`; a resumed run's own weights replace it); `digest`: the meta
    digest of the --init-drafter it came from, saved with every checkpoint so that a resumed run records it without
    reading that folder again."""

    def make_job(tcfg: TrainConfig, model, tok, rank: int, world: int, device) -> Job:
        base, btok = loaded
        device = torch.device(device)
        if base.wte.weight.device != device:
            base = base.to(device) if owned else copy.deepcopy(base).to(device)  # the caller's model stays put
        base.requires_grad_(False)  # adapt() restores a caller's flags and mode when it returns
        base.eval()
        drafter = make_drafter(base, plan, fingerprint=fingerprint, rank=cfg.lora_rank, alpha=cfg.lora_alpha)
        if init is not None:  # --init-drafter: its suffix weights, exactly (checked by init_state)
            with torch.no_grad():
                for k, v in drafter.suffix_state().items():
                    v.copy_(init[k])
        if model is not None:  # --resume: the run's own suffix weights (and its tokenizer)
            saved = model.state_dict()
            with torch.no_grad():
                for k, v in drafter.suffix_state().items():
                    v.copy_(saved[k])
        for p in suffix_parameters(drafter):
            p.requires_grad_(True)
        mask = None
        if cfg.loss_on == "replies" and not cfg.self_distill:  # chat parts only (check): one rendering, both
            train, val, mask, _ = chat.token_streams(cfg.data, btok, cfg.max_chars, cfg.val_frac, with_mask=True)
        else:
            train, val = token_stream(cfg.data, btok, cfg.max_chars, cfg.val_frac, cfg.cache_dir)
        what = cfg.data
        if cfg.self_distill and len(val) > cfg.seq_len + 1:  # a data error is refused before the decoding
            train, what, mask = self_distilled_stream(cfg, base, btok, fingerprint, verbose=rank == 0)
        if len(train) <= cfg.seq_len + 1 or len(val) <= cfg.seq_len + 1:
            raise ValueError(f"--data {cfg.data!r} gives {len(train):,} train / {len(val):,} val tokens: need more "
                             f"than --seq-len + 1 = {cfg.seq_len + 1} in each")
        if mask is not None:
            assert len(mask) == len(train), (len(mask), len(train))  # one mask entry per training token
            what += f"; loss on the {int(mask.sum()):,} reply tokens only"

        def batch(micro, r, w):
            x, y = D.batch_at(train, micro, cfg.seq_len, cfg.batch_size, cfg.seed, r, w)
            if mask is None:
                return x, y
            # the same windows of the mask (batch_at's offsets depend only on the stream's length and the seed):
            # its shifted half marks the positions whose next token is a reply token, SFT's target mask
            return x, D.batch_at(mask, micro, cfg.seq_len, cfg.batch_size, cfg.seed, r, w)[1]

        held.update(base=base, drafter=drafter, rank=rank, world=world, device=str(device))
        return Job(model=drafter.model, tokenizer=btok,
                   batch=batch,
                   val_batches=D.val_batches(val, cfg.seq_len, cfg.batch_size * world, cfg.eval_batches),
                   loss=AdaptStep(base, drafter, cfg),
                   # replies: KL and MSE average over the reply positions y marks (distill_terms); "all": every position
                   counts=(lambda y, v: (float(y.sum()),) * 2) if mask is not None else None,
                   # a step whose windows hold no reply position (on any rank) has nothing to learn: distill_terms'
                   # empty mean is 0, and AdamW's step on that zero gradient still moved the drafter (momentum)
                   skip_empty="no reply position" if mask is not None else None,
                   validate=lambda m, vb: validate_drafter(base, drafter, vb, cfg, device, rows=cfg.batch_size),
                   describe=f"adapting the {plan} drafter of {cfg.src} (kv={cfg.kv}, "
                   f"{f'LoRA rank {cfg.lora_rank} deltas' if cfg.lora_rank else 'suffix'} "
                   f"{drafter.extra_bytes() / 2**20:.1f} MiB) on {len(train):,} train / {len(val):,} val tokens of "
                   f"{what}", name="snlp adapt", second_term="mse", keeps_checkpoint=lambda why: keeps_run(cfg, why),
                   state={"adapt": asdict(cfg), "adapt_base": fingerprint,
                          **({"adapt_init_digest": digest} if digest else {})})

    return make_job


def self_distilled_stream(cfg: AdaptConfig, base: GPT, tok, fingerprint: str, verbose: bool = False
                          ) -> tuple[np.ndarray, str, np.ndarray | None]:
    """The training stream of a --self-distill run: the text parts' training documents as `token_stream` reads
    them, then every chat part's training prompts each followed by the base's greedy reply (snlp.train.selfgen),
    in place of the human conversations; a description of it; and with loss_on="replies" its reply mask (1 on
    the base's reply tokens, 0 on the prompts; None otherwise). The held-out stream is not touched."""
    text = tuple(p for p in D.parts(cfg.data) if not p.startswith("chat:"))
    rows = chat.token_streams(cfg.data, tok, cfg.max_chars, cfg.val_frac, keep=text)[0] if text else \
        np.zeros(0, dtype=np.int64)
    g = self_distill_rows(base, tok, cfg.data, cfg.val_frac, cfg.self_distill, fingerprint,
                          cfg.self_distill_prompts, cfg.cache_dir, verbose=verbose, need_tokens=cfg.seq_len + 1,
                          other_tokens=len(rows))
    if not g.rows:
        raise ValueError(f"--self-distill {cfg.self_distill}: no training prompt of {cfg.data!r} fits the model's "
                         f"{base.config.sequence_len} positions with its reply")
    gen = np.asarray([t for r in g.rows for t in r], dtype=np.int64)
    what = (f"{cfg.data} ({g.prompts:,} chat prompts with the base's greedy replies of <= {cfg.self_distill} tokens"
            f"{f', {g.skipped} too long skipped' if g.skipped else ''}"
            f"{f', {g.held_out_twins} equal to a held-out prompt left out' if g.held_out_twins else ''}: "
            f"{g.reply_tokens:,} reply tokens, "
            + (f"all read from {g.cache}" if g.cache and not g.generated else f"{g.generated:,} decoded in {g.seconds:.0f} s")
            + (f", {g.prompts - g.generated:,} read from {g.cache}" if g.cache and 0 < g.generated < g.prompts else "") + ")")
    mask = None
    if cfg.loss_on == "replies":  # (no text parts: refused by AdaptConfig.check)
        mask = np.asarray([int(i >= n) for r, n in zip(g.rows, g.prompt_lens) for i in range(len(r))],
                          dtype=np.int64)
        mask = np.concatenate([np.zeros(len(rows), dtype=np.int64), mask])
    return np.concatenate([rows, gen]), what, mask


def init_state(cfg: AdaptConfig, plan: Plan, base: GPT, fingerprint: str) -> tuple[dict, str]:
    """The suffix weights (and the meta digest) of `cfg.init_drafter`, which the run starts from, after refusing,
    before any work, a drafter of another base (weights fingerprint), another suffix (prefix length and fusion:
    K and the init may differ), another LoRA rank / alpha, or another data split (its training documents could
    be this run's held-out ones); snlp.io.drafter.load_drafter then checks its files' digests."""
    d = cfg.init_drafter
    meta = read_meta(d)
    if not same_weights(meta["base_fingerprint"], fingerprint):
        raise ValueError(f"--init-drafter {d} was adapted from other base weights ({meta['base_fingerprint'][:16]}...) "
                         f"than {cfg.src} ({fingerprint[:16]}...): start from a drafter of this base")
    was = Plan.parse(meta["plan"])
    n = base.config.n_layer
    if was.prefix_len(n) != plan.prefix_len(n) or was.fuse != plan.fuse:
        raise ValueError(f"--init-drafter {d} drafts plan {was}, whose suffix (layers {was.prefix_len(n)}.., fused "
                         f"by {was.fuse}) is not plan {plan}'s (layers {plan.prefix_len(n)}.., fused by {plan.fuse})")
    lora = meta.get("lora") or {}
    have = (lora.get("rank", 0), float(lora.get("alpha", 0.0)) if lora else 0.0)
    want = (cfg.lora_rank, float(cfg.lora_alpha if cfg.lora_alpha is not None else cfg.lora_rank) if cfg.lora_rank
            else 0.0)
    if have != want:
        raise ValueError(f"--init-drafter {d} has LoRA rank {have[0]}, alpha {have[1]:g} (0: full suffix weights), "
                         f"this run --lora-rank {want[0]}, alpha {want[1]:g}: give the drafter's own")
    rec = meta.get("record") or {}
    was_cfg = rec.get("config") or {}
    if rec.get("stopped_by") == "from_model" or not all(k in was_cfg for k in SPLIT):
        raise ValueError(f"--init-drafter {d} records no `snlp adapt` data split (a --from-model or library-made "
                         f"drafter): its training documents are unknown, so this run's held-out ones could be "
                         f"among them")
    split = {k: chat.resolve_spec(was_cfg[k]) if k == "data" else was_cfg[k] for k in SPLIT}
    now = {k: getattr(cfg, k) for k in SPLIT}
    diff = [k for k in SPLIT if split[k] != now[k]]
    if diff:
        raise ValueError(f"--init-drafter {d} was adapted with " + ", ".join(
            f"--{k.replace('_', '-')} {split[k]!r} (not {now[k]!r})" for k in diff)
            + ": another split would hold out documents it trained on; use its split")
    state = load_drafter(d, base).suffix_state()
    return {k: v.detach().cpu().clone() for k, v in state.items()}, meta["meta_digest"]


def init_digest(cfg: AdaptConfig) -> str | None:
    """The meta digest of the --init-drafter a resumed run started from, as its first leg saved it in OUT/run (None:
    a run without --init-drafter, or none to resume: fit refuses that with its own message)."""
    run = Path(cfg.out) / RUN
    st = load_train_state(run) if (run / "train_state.pt").is_file() else None
    return st.get("adapt_init_digest") if isinstance(st, dict) else None


def saved_adapt(out) -> dict | None:
    """The AdaptConfig settings saved with the run in OUT/run (as `adapt` resolved them: paths absolute); None where
    it holds no resumable run (or one that records none)."""
    run = Path(out) / RUN
    if not (run / "model.safetensors").is_file():
        return None
    st = load_train_state(run)
    return st["adapt"] if isinstance(st, dict) and isinstance(st.get("adapt"), dict) else None


def resumed_adapt(cfg: AdaptConfig, given) -> AdaptConfig:
    """`cfg` for `snlp adapt --resume`: every setting whose flag was not typed (`given`: field names), the base and
    the plan included, takes the saved run's value (config.resumed, as `snlp train --resume`); typed ones are
    checked against it by `check_resume` and the trainer. `given` None: `cfg` as it is (a library caller's)."""
    if not cfg.resume or given is None:
        return cfg
    return resumed(cfg, saved_adapt(cfg.out), given, NOT_INHERITED)


def check_resume_left_adapt(cfg: AdaptConfig) -> None:
    """Refuse `snlp adapt --resume` (its settings resolved: `resumed_adapt`) where there is nothing to continue, before
    any work: a finished run (its drafter written, OUT/run removed at the end), or a run whose budget or --stop-after
    leaves no step (checkpointing.check_resume_left): it would write the drafter's record again, the run's own
    validation, time and stop reason replaced by those of a leg that ran no step. A run whose drafter is missing or
    older than its checkpoint (killed after its last save, before the drafter was written) is resumed: that leg
    writes it."""
    out = Path(cfg.out)
    if (out / DRAFTER_META).is_file() and not (out / RUN / WEIGHTS).is_file():
        raise ValueError(f"--resume: {out} holds a finished drafter (its run's checkpoint is removed at the end): "
                         f"nothing to continue; to train it further, start a new run from it in another --out "
                         f"(--init-drafter {out})")
    st = load_train_state(out / RUN) if (out / RUN / "train_state.pt").is_file() else None
    drafter_step = read_meta(out).get("record", {}).get("steps") if (out / DRAFTER_META).is_file() else None
    if isinstance(st, dict) and drafter_step != st.get("step"):  # a run saved at its last step but killed before
        return  # it wrote its drafter (or wrote it at an earlier stop): the run, resumed, writes it without a step
    check_resume_left(train_config(cfg, width=0))  # (the width sets a learning rate only: not read here)


def check_resume(cfg: AdaptConfig, plan: Plan, fingerprint: str) -> None:
    """Refuse `--resume` of a run made for another base (weights fingerprint, snlp.model.fingerprint) or another
    plan, before any work: continuing would stamp this base's fingerprint on a drafter trained on the other."""
    run = Path(cfg.out) / RUN
    if not run.is_dir():
        return  # nothing to resume: fit refuses it with its own message
    st = load_train_state(run)
    if st is None:
        return
    rec = st.get("adapt_base")
    if rec is None:
        raise ValueError(f"--resume: the run in {run} records no base weights fingerprint (an older snlp), so it "
                         f"cannot be checked against {cfg.src}: start a new run (without --resume)")
    if not same_weights(rec, fingerprint):
        raise ValueError(f"--resume: the run in {run} adapts a drafter of another base (weights {rec[:16]}...) than "
                         f"{cfg.src} ({fingerprint[:16]}...): resume it with the base it started on, or start a new "
                         f"run in another --out")
    saved = st.get("adapt") or {}
    prev = saved.get("plan")
    if prev is not None and str(Plan.parse(prev)) != str(plan):
        raise ValueError(f"--resume: the run in {run} adapts plan {prev}, not {plan}: resume it with --plan {prev}")
    # the run's data, split and training mode: another one would train the second leg on what the record (the
    # last leg's settings) calls held out, or change what the drafter learns mid-run
    now = asdict(cfg)
    was = {k: chat.resolve_spec(saved[k]) if k == "data" else saved[k] for k in RESUME_FIXED if k in saved}
    diff = [k for k in RESUME_FIXED if k in was and was[k] != now[k]]
    if diff:
        raise ValueError(f"--resume: the run in {run} was started with "
                         + ", ".join(f"--{k.replace('_', '-')} {shown(k, was[k])} (not {shown(k, now[k])})"
                                     for k in diff)
                         + ": resume it with the settings it started with, or start a new run in another --out")


def check_new_out(out: Path) -> None:
    """Refuse an --out that a new run would write over: a drafter, or a folder holding anything else (a checkpoint,
    the base's own folder, another run: the drafter's log.jsonl and files would replace or mix with its files).
    OUT/run alone is an interrupted adaptation, which `fit` refuses unless --resume."""
    if (out / DRAFTER_META).is_file():
        raise ValueError(f"{out} already holds a drafter; choose another --out")
    held = sorted(p.name for p in out.iterdir() if p.name != RUN and not p.name.startswith(".")) if out.is_dir() else []
    if held:
        raise ValueError(f"--out {out} is not empty (it holds {', '.join(held[:4])}{', ...' if len(held) > 4 else ''}): "
                         f"a drafter gets a folder of its own; choose a new or empty --out")


def adapt(cfg: AdaptConfig, hooks: TrainHooks | None = None, base: tuple | None = None) -> AdaptResult:
    """Adapt the drafter of `cfg.plan` to `cfg.src` and write it to `cfg.out` (snlp.io.drafter). A run stopped
    early (stop_after, a hook) keeps its checkpoint in OUT/run for `resume=True`; a finished one removes it
    (the drafter directory then holds only the suffix weights, the record and log.jsonl). `base`: the
    (model, tokenizer) of cfg.src when the caller has it loaded already: it is not changed, not moved (the run
    uses a copy on cfg.device when it lives elsewhere), and its requires_grad flags and train/eval mode are as
    before when this returns. Under torchrun the gradients are all-reduced and rank 0 alone writes."""
    plan = cfg.check()
    if not cfg.from_model:  # a diag:fd eps the student's step cannot take (the base's dtype, bf16 under CUDA
        # autocast): before the base loads and --out is made (the student's first solve refused it after the data was
        # read). A caller's `base` keeps its own dtype (the run moves it, never casts it); a loaded one takes --dtype
        device = cli_device(cfg.device) if cfg.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        given = base is not None and isinstance(base[0], GPT)
        weights = base[0].wte.weight.dtype if given else getattr(torch, cfg.dtype)
        check_fd_step(plan, step_dtype(device, weights), device.type)
    # local paths absolute: the drafter's record (and eval's held-out split) then names the same data from any cwd
    cfg = replace(cfg, src=chat.local_path(cfg.src), data=chat.resolve_spec(cfg.data),
                  from_model=chat.local_path(cfg.from_model), init_drafter=chat.local_path(cfg.init_drafter),
                  cache_dir=str(home_path(cfg.cache_dir).absolute()) if cfg.cache_dir else None,
                  save_every=cfg.saves_every)  # what ran, in the record (not None for "the default")
    out = Path(cfg.out)
    if not cfg.resume:
        check_new_out(out)
    t0 = time.perf_counter()
    owned = base is None
    base = base if base is not None else load_base(cfg.src, cfg.dtype)
    if base[1] is None:  # an snlp checkpoint saved without tokenizer.json, a nanochat folder
        raise ValueError(f"{cfg.src} has no tokenizer: the adaptation data must be tokenized with the model's own; "
                         f"save the checkpoint with its tokenizer.json")
    if cfg.seq_len > base[0].config.sequence_len:  # windows past the model's context: positions it never decodes
        # at (its KV cache holds sequence_len), where its outputs, the teacher's targets, were never trained
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the base's context ({base[0].config.sequence_len} "
                         f"positions): give --seq-len {base[0].config.sequence_len} or less")
    if cfg.from_model:
        return import_drafter(cfg, plan, base, owned)
    fingerprint = weights_fingerprint(base[0])
    if cfg.resume:
        check_resume(cfg, plan, fingerprint)
    # a resumed run's suffix is its own checkpoint's (adapt_job), so the --init-drafter folder, which may have moved
    # or been replaced since, is not read: the digest of the drafter it started from is the one its first leg saved
    init = (None, init_digest(cfg)) if cfg.resume else \
        init_state(cfg, plan, base[0], fingerprint) if cfg.init_drafter else None
    # torchrun: the group outlives fit (which leaves a group it did not create alone), so every rank can wait for
    # rank 0's drafter below; it is destroyed here only if this call created it (a caller's group stays)
    ctx = setup_dist(cfg.device) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    try:
        return _adapt(cfg, plan, hooks, base, owned, fingerprint, t0, init)
    finally:
        if ctx is not None:
            teardown_dist(ctx)


def _adapt(cfg: AdaptConfig, plan: Plan, hooks, base: tuple, owned: bool, fingerprint: str, t0: float,
           init: tuple | None = None) -> AdaptResult:
    """adapt's run and save (see `adapt`); all ranks return once rank 0 has written the drafter."""
    out = Path(cfg.out)
    held: dict = {}
    model = base[0]
    flags = [p.requires_grad for p in model.parameters()]
    # a signal fit takes after its last step (the run is saved and done) reaches the caller only once the drafter is
    # written: fit passes it on as it returns, and `--resume` of the finished run, refused, could not write it
    with deferred():
        # a caller's model leaves as it came: the run froze it, put it in eval mode, and the drafter's train mode
        # reached the prefix blocks, embedding and head it shares; eval_mode gives every submodule its own mode back
        try:
            with eval_mode(model) if not owned else nullcontext():
                res = fit(train_config(cfg, model.config.n_embd),
                          adapt_job(cfg, plan, held, base, fingerprint, owned, init[0] if init else None,
                                    init[1] if init else None), hooks)
        finally:
            if not owned:
                for p, f in zip(model.parameters(), flags):
                    p.requires_grad_(f)
        drafter: Drafter = held["drafter"]
        result = AdaptResult(out=str(out), plan=str(plan), kv=cfg.kv, steps=res.steps, tokens=res.tokens,
                             minutes=res.elapsed_s / 60, stopped_by=res.stopped_by, extra_bytes=drafter.extra_bytes(),
                             device=held["device"], world=held["world"], rank=held["rank"], signal=res.signal,
                             late_signal=res.late_signal, skipped_steps=res.skipped_steps)
        if held["rank"] == 0:  # one writer: rank 0 (its log and checkpoint are the run's)
            save_result(cfg, out, drafter, result, res.stopped_by, t0, init[1] if init else None)
        if held["world"] > 1 and dist.is_initialized():  # the others return once the drafter is on disk
            dist.barrier()
        return result


def keeps_run(cfg: AdaptConfig, stopped_by: str) -> bool:
    """Whether OUT/run stays once the drafter is written: not for a finished run, nor for LoRA (never resumed)."""
    return stopped_by != "budget" and not cfg.lora_rank


def save_result(cfg: AdaptConfig, out: Path, drafter: Drafter, result: AdaptResult, stopped_by: str, t0: float,
                init_digest: str | None = None):
    """Rank 0's end of a run: the validation records into `result`, the drafter directory, the log.
    `init_digest`: the meta digest of the --init-drafter the run started from (recorded)."""
    log = read_log(out / RUN / "log.jsonl")  # strict JSON: a NaN Top-1 read back as NaN
    vals = [r for r in log if "top1" in r]
    result.before, result.after = (vals[0], vals[-1]) if vals else ({}, {})
    record = {**result.to_dict(), "config": asdict(cfg), "wall_s": time.perf_counter() - t0,
              **({"init_drafter_digest": init_digest} if init_digest else {})}
    save_drafter(out, drafter, record)
    shutil.copyfile(out / RUN / "log.jsonl", out / "log.jsonl")
    if not keeps_run(cfg, stopped_by):
        for log in sorted((out / RUN).glob(UNSAVED_LOG.replace(".jsonl", "*.jsonl"))):  # killed earlier runs' logs,
            aside = unsaved_log_path(out)  # set aside by fit: kept beside the drafter, under a free name
            os.replace(log, aside)
            print(f"{log} (a killed earlier run's log) kept as {aside}", file=sys.stderr, flush=True)
        shutil.rmtree(out / RUN, ignore_errors=True)


def import_drafter(cfg: AdaptConfig, plan: Plan, loaded: tuple, owned: bool = True) -> AdaptResult:
    """`adapt` with `from_model`: the drafter whose suffix is a fine-tuned copy's (snlp.method.drafter.
    drafter_from_model; e.g. the paper's IDN fine-tuning with a frozen prefix), validated against the base on the
    run's held-out batches (before = the post-hoc drafter, after = the imported one) on cfg.device (default: where
    the base is; a caller's model, `owned` False, is copied there, never moved) and written to cfg.out."""
    base, tok = loaded
    if cfg.device is not None and torch.device(cfg.device) != base.wte.weight.device:
        base = base.to(cfg.device) if owned else copy.deepcopy(base).to(cfg.device)
    with eval_mode(base):  # a caller's model leaves with every submodule in the mode it came in
        tuned, _ = load_base(cfg.from_model, cfg.dtype, need_tokenizer=False)  # stays on the CPU: its suffix is copied onto the base's device
        d = drafter_from_model(base, tuned, plan)
        del tuned
        device = base.wte.weight.device
        _, val = token_stream(cfg.data, tok, cfg.max_chars, cfg.val_frac, cfg.cache_dir)
        vb = D.val_batches(val, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
        before = validate_drafter(base, make_drafter(base, plan, d.base_fingerprint), vb, cfg, device).record()
        after = validate_drafter(base, d, vb, cfg, device).record()
    result = AdaptResult(out=cfg.out, plan=str(plan), kv=cfg.kv, steps=0, tokens=0, minutes=0.0,
                         stopped_by="from_model", before=before, after=after, extra_bytes=d.extra_bytes())
    save_drafter(cfg.out, d, {**result.to_dict(), "config": asdict(cfg), "tuned": tuned_split(cfg.from_model)})
    return result


def tuned_split(ckpt: str) -> dict:
    """What a --from-model drafter's suffix was trained on: `snlp train`'s data settings (TRAIN_DATA, from the
    tuned checkpoint's train_state.pt args; `split` None when it records none, e.g. a .gguf or transformers
    directory). `snlp eval --drafter` holds out THIS split (the adapt command's --data only validated the
    import), or asks for explicit held-out data when there is none."""
    p = Path(ckpt)
    args = {}
    if is_snlp_checkpoint(p):
        args = (load_train_state(checkpoint_dir(p)) or {}).get("args") or {}
    split = None
    if "data" in args and "val_frac" in args:
        split = {k: args.get(k) for k in TRAIN_DATA}
        split["data"] = chat.resolve_spec(split["data"])  # (as snlp train read it from this cwd, if it exists here)
    return {"src": ckpt, "split": split}

"""Train a GPT from scratch, optionally with the SNLP-aware regulariser (--reg idn).

Works out of the box on CPU with no network: `snlp train --out runs/x --depth 8 --minutes 3`
trains a byte-level BPE on the standard library's Python sources and a small model on them.
Training defaults (aspect ratio 32, head dim 64, vocab 4096, seq len 256) are smaller than
`snlp bench`'s so a CPU run makes progress in minutes. Multi-process: `torchrun
--nproc_per_node=P -m snlp train ...` (DDP; NCCL on GPU, gloo on CPU; rank 0 logs and saves).

Library: `fit(TrainConfig(out=..., ...)) -> TrainResult`. The loop (optimisers, the stateless LR
multiplier written into every param group each step, checkpoints, exact resume, DDP, --stop-file)
is shared: a `Job` supplies the model, the batch source, the loss module and the validation, so
pretraining (`pretrain_job`) and chat SFT (snlp.sft) run the same machinery.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import data as D
from .checkpoint import load, load_training, save_checkpoint
from .correction import HCN
from .model import GPT, GPTConfig
from .muon import Muon, default_ns_dtype, warn_if_emulated
from .plan import Plan
from .regularizer import RegConfig, parse_suffixes, resolve_suffixes, snlp_gap, snlp_loss
from .solver import solve
from .tokenizer import Tokenizer

TOKENIZER_CHARS = 20_000_000  # BPE is trained on at most this many characters of the train split


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="checkpoint directory (created; with --resume, continued)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out (weights, optimizer, data position, RNG)")
    p.add_argument("--init-from", default=None, metavar="CKPT",
                   help="start from this checkpoint's weights and tokenizer (e.g. `snlp convert` of a Hugging Face "
                   "model; paper App. 'Pretrained TinyLlama Fine-Tuning'): no tokenizer training, the model flags "
                   "(--depth, ...) are taken from the checkpoint")
    p.add_argument("--freeze-prefix", type=int, nargs="?", const=-1, default=None, metavar="S",
                   help="train only layers S.. (and the final norm / untied lm_head); the embedding and the first S "
                   "layers stay frozen. Without a value S = depth - max(--reg-n), the SNLP suffix")
    d = p.add_argument_group("data")
    d.add_argument("--data", default="stdlib", help="stdlib | file/folder/glob (.txt, .py, .jsonl, .parquet) | "
                   "hf:NAME[:CONFIG][:SPLIT]; comma-separated to combine")
    d.add_argument("--text-field", default="text", help="text field of .jsonl/.parquet/hf rows")
    d.add_argument("--max-chars", type=int, default=0, help="use at most this many characters (0 = all; hf: 200M)")
    d.add_argument("--val-frac", type=float, default=0.05, help="fraction of documents held out for validation")
    d.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (specials included)")
    d.add_argument("--cache-dir", default=None, help="token cache folder (default $SNLP_CACHE or ~/.cache/snlp)")
    m = p.add_argument_group("model (one dial: depth)")
    m.add_argument("--depth", type=int, default=8)
    m.add_argument("--width", type=int, default=None, help="model width; default depth * aspect ratio")
    m.add_argument("--aspect-ratio", type=int, default=32, help="width per layer of depth (bench: 64)")
    m.add_argument("--head-dim", type=int, default=64, help="attention head dim (bench: 128)")
    m.add_argument("--kv-heads", type=int, default=None)
    m.add_argument("--window-pattern", default="L")
    m.add_argument("--no-x0", action="store_true", help="disable the x0 residual")
    m.add_argument("--no-ve", action="store_true", help="disable value embeddings")
    m.add_argument("--hc-streams", type=int, default=0, help="mHC with this many residual streams (0 = plain "
                   "residual model); turns the x0 residual off")
    m.add_argument("--hc-static", action="store_true", help="static mHC (learned constant H) instead of dynamic")
    o = p.add_argument_group("optimisation")
    o.add_argument("--seq-len", type=int, default=256)
    o.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per process")
    o.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    o.add_argument("--steps", type=int, default=None, help="optimizer steps (default 1000 unless --minutes)")
    o.add_argument("--minutes", type=float, default=None, help="wall-clock budget; the LR schedule follows elapsed time")
    o.add_argument("--stop-after", type=int, default=None, help="stop (and save) after this step; schedule still follows --steps")
    o.add_argument("--stop-file", default=None, help="stop (and save) once the step number written in this file is done "
                   "(checked every step; e.g. to stop two side-by-side runs at the same step)")
    o.add_argument("--optimizer", choices=["muon", "adamw"], default="muon", help="for the 2-D block matrices")
    o.add_argument("--matrix-lr", type=float, default=None, help="block-matrix LR (default 0.02 muon, 0.003 adamw)")
    o.add_argument("--embedding-lr", type=float, default=0.2, help="AdamW LR of wte and value embeddings")
    o.add_argument("--unembedding-lr", type=float, default=0.004, help="AdamW LR of lm_head")
    o.add_argument("--scalar-lr", type=float, default=0.5, help="AdamW LR of the x0 scalars (resid scalars: x0.01)")
    o.add_argument("--hc-lr", type=float, default=0.005, help="AdamW LR of the mHC coefficient parameters "
                   "(H biases, dynamic projections and gates)")
    o.add_argument("--weight-decay", type=float, default=0.0)
    o.add_argument("--warmup-steps", type=int, default=10, help="linear LR warm-up")
    o.add_argument("--warmdown", type=float, default=0.4, help="final fraction of the run with linear LR decay to 0")
    o.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm (0 = off)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--device", default=None, help="default: cuda if available (per local rank), else cpu")
    r = p.add_argument_group("SNLP-aware regulariser (paper Eq. snlp-training-loss)")
    r.add_argument("--reg", choices=["idn", "hcn", "diag", "none"], default="none", help="surrogate of the regulariser's "
                   "K=1 solve (hcn: mHC models, --hc-streams; diag: DiagN, one FD Hutchinson probe per step, "
                   "the diagonal estimate detached: gradients flow through the chunk forwards)")
    r.add_argument("--reg-lambda", type=float, default=0.5)
    r.add_argument("--reg-n", default="4", help="suffix lengths N, e.g. 8,16,24 (N >= depth is clipped to depth-1); also the N of the logged gap")
    r.add_argument("--reg-stride", type=int, default=0, help="0 = final layer only; s > 0 adds L-s, L-2s, ...")
    r.add_argument("--reg-detach", action=argparse.BooleanOptionalAction, default=None,
                   help="detach the sequential target (default: on for --reg hcn as in the paper's mHC run, "
                   "off otherwise)")
    r.add_argument("--reg-warmup", type=int, default=0, help="steps to ramp lambda from 0")
    e = p.add_argument_group("logging")
    e.add_argument("--eval-every", type=int, default=50, help="validation every N steps (and at the end)")
    e.add_argument("--eval-batches", type=int, default=4)
    e.add_argument("--save-every", type=int, default=0, help="also save every N steps (0 = only at the end)")
    e.add_argument("--log-every", type=int, default=10)
    e.add_argument("--no-progress", action="store_true", help="no tqdm bar")


@dataclass
class TrainConfig:
    """Everything a training run needs (the flags of `snlp train`); `fit` never modifies it."""

    out: str
    resume: bool = False
    init_from: str | None = None  # start from this checkpoint's weights and tokenizer (no tokenizer training)
    freeze_prefix: int | None = None  # train only layers S..; -1 = S = depth - max(reg_n), the SNLP suffix
    # data
    data: str = "stdlib"
    text_field: str = "text"
    max_chars: int = 0
    val_frac: float = 0.05
    vocab_size: int = 4096
    cache_dir: str | None = None
    # model (one dial: depth)
    depth: int = 8
    width: int | None = None
    aspect_ratio: int = 32
    head_dim: int = 64
    kv_heads: int | None = None
    window_pattern: str = "L"
    no_x0: bool = False
    no_ve: bool = False
    hc_streams: int = 0
    hc_static: bool = False
    # optimisation
    seq_len: int = 256
    batch_size: int = 8
    grad_accum: int = 1
    steps: int | None = None  # None and no minutes -> 1000
    minutes: float | None = None
    stop_after: int | None = None
    stop_file: str | None = None  # a file holding an integer N: stop (and save) once step N is done
    step_gate: str | None = None  # a file holding an integer G: step s starts only once G >= s (lockstep runs)
    optimizer: str = "muon"
    matrix_lr: float | None = None
    embedding_lr: float = 0.2
    unembedding_lr: float = 0.004
    scalar_lr: float = 0.5
    hc_lr: float = 0.005
    weight_decay: float = 0.0
    warmup_steps: int = 10
    warmdown: float = 0.4
    grad_clip: float = 1.0
    seed: int = 0
    device: str | None = None
    # SNLP-aware regulariser
    reg: str = "none"
    reg_lambda: float = 0.5
    reg_n: str = "4"
    reg_stride: int = 0
    reg_detach: bool | None = None
    reg_warmup: int = 0
    # logging
    eval_every: int = 50
    eval_batches: int = 4
    save_every: int = 0
    log_every: int = 10
    no_progress: bool = False

    @classmethod
    def from_args(cls, args) -> "TrainConfig":
        """The TrainConfig of parsed `snlp train` flags (attributes named like the fields)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    @property
    def total_steps(self) -> int | None:
        return 1000 if self.steps is None and self.minutes is None else self.steps

    def check(self) -> None:
        for name in ("seq_len", "batch_size", "grad_accum", "depth", "eval_every", "eval_batches", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1 (got {self.steps})")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"--minutes must be > 0 (got {self.minutes})")
        if not 0 <= self.warmdown <= 1:
            raise ValueError(f"--warmdown must lie in [0, 1] (got {self.warmdown})")
        if self.hc_streams < 0:
            raise ValueError(f"--hc-streams must be >= 0 (got {self.hc_streams})")
        if self.reg_lambda < 0 or self.reg_warmup < 0 or self.reg_stride < 0:
            raise ValueError("--reg-lambda, --reg-warmup and --reg-stride must be >= 0")
        if self.optimizer not in ("muon", "adamw"):
            raise ValueError(f"--optimizer must be muon or adamw (got {self.optimizer!r})")
        if self.reg not in ("idn", "hcn", "diag", "none"):
            raise ValueError(f"--reg must be one of idn, hcn, diag, none (got {self.reg!r})")
        if self.init_from and self.resume:
            raise ValueError("--init-from starts a new run from a checkpoint's weights; --resume continues --out: pick one")
        if self.freeze_prefix is not None and self.freeze_prefix < -1:
            raise ValueError(f"--freeze-prefix must be >= 0 (got {self.freeze_prefix})")


@dataclass
class TrainResult:
    """What `fit` did: where the checkpoint is and how the run ended."""

    out: str
    steps: int
    tokens: int  # input tokens processed (all ranks)
    train_loss: float | None  # last step's training CE (all ranks' mean)
    val_loss: float | None
    wall_s: float  # this process's wall time, eval and saving included (the resumed part only)
    elapsed_s: float  # the run's training clock (carried across resumes)
    evals: dict = field(default_factory=dict)  # last validation metrics (val_loss, gap_N*, ...)
    stopped_by: str = "budget"  # budget | stop_after | stop_file


@dataclass
class Job:
    """What the shared loop (`fit`) trains: pretraining (`pretrain_job`) and SFT (snlp.sft) build one.
    The optimiser, LR schedule, checkpointing, resume and DDP machinery are the same for both."""

    model: GPT
    tokenizer: Tokenizer
    batch: Callable[[int, int, int], tuple[Tensor, Tensor]]  # (micro-batch index, rank, world) -> (x, y); y == -1 ignored
    val_batches: list  # fixed [(x, y)] for validation
    loss: nn.Module  # forward(x, y, lam) -> (loss, ce.detach(), reg.detach()); DDP wraps it
    evaluate: Callable[[GPT, list], dict]  # (model, val_batches) -> {"val_loss": ..., ...} (no_grad)
    describe: str = ""  # one line for the start banner
    name: str = "snlp train"  # the banner's command name
    state: dict = field(default_factory=dict)  # extra entries saved into train_state.pt (e.g. the SFT config)


# ----- distributed -----
def setup_dist(device_arg):
    """(rank, world, device); initialises the process group when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_arg:
        device = torch.device(device_arg)
    else:
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda requested but CUDA is not available; use --device cpu")
        if device.index is None:
            device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


# ----- model and optimizers -----
def build_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    return GPTConfig.from_depth(cfg.depth, aspect_ratio=cfg.aspect_ratio, head_dim=cfg.head_dim, width=cfg.width,
                                n_kv_head=cfg.kv_heads, vocab_size=vocab_size, sequence_len=cfg.seq_len,
                                window_pattern=cfg.window_pattern, x0_residual=False if cfg.no_x0 else None,
                                value_embeds=not cfg.no_ve, hc_streams=cfg.hc_streams, hc_dynamic=not cfg.hc_static)


def freeze_prefix(model: GPT, S: int) -> None:
    """Train only layers S.. : the embedding (and a tied lm_head with it) and blocks 0..S-1 stop
    requiring gradients. The paper's cheap CPU fine-tuning: only the SNLP suffix changes."""
    L = model.config.n_layer
    if not 0 <= S < L:
        raise ValueError(f"--freeze-prefix S={S} must lie in [0, {L - 1}] (the model has {L} layers)")
    model.wte.weight.requires_grad_(False)
    if hasattr(model, "value_embeds"):
        model.value_embeds.requires_grad_(False)
    for block in model.blocks[:S]:
        block.requires_grad_(False)


def init_from_checkpoint(path) -> tuple[GPT, Tokenizer]:
    """Model (on CPU, train mode) and tokenizer of a checkpoint to start a new run from (fine-tuning:
    `snlp sft`, `snlp train --init-from`). Only the weights are taken: optimiser state, step and
    schedule start afresh."""
    model, tok = load(path, device="cpu")
    if tok is None:
        raise ValueError(f"checkpoint {path} has no tokenizer.json; fine-tuning needs the model's tokenizer")
    model.train()
    return model, tok


def build_optimizers(model: GPT, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """AdamW for embeddings, lm_head and scalars; Muon (snlp.muon: torch.optim.Muon's step) or AdamW for the 2-D
    block matrices. LRs are nanochat's, scaled by (width/768)^-0.5 for the AdamW embedding groups.
    The mHC coefficient parameters (blocks.*.hc_*: tiny H biases, projections, gates) go to AdamW.
    Every param group records its peak LR as "base_lr"; `set_lr` scales it each step."""
    scale = (model.config.n_embd / 768) ** -0.5
    hc = [p for name, p in model.blocks.named_parameters() if ".hc_" in name]
    matrices = [p for name, p in model.blocks.named_parameters() if p.dim() == 2 and ".hc_" not in name]
    vectors = [p for name, p in model.blocks.named_parameters() if p.dim() == 1 and ".hc_" not in name]
    vectors += [model.ln_f] if model.ln_f is not None else []  # Llama family: norm weights, q/k/v biases
    groups = [{"params": [model.wte.weight] + ([model.value_embeds] if hasattr(model, "value_embeds") else []),
               "lr": cfg.embedding_lr * scale}]
    if not model.config.tie_embeddings:
        groups.append({"params": [model.lm_head.weight], "lr": cfg.unembedding_lr * scale})
    if vectors:
        groups.append({"params": vectors, "lr": cfg.unembedding_lr * scale})
    if model.config.x0_residual:
        groups += [{"params": [model.x0_lambdas], "lr": cfg.scalar_lr},
                   {"params": [model.resid_lambdas], "lr": cfg.scalar_lr * 0.01}]
    if hc:
        groups.append({"params": hc, "lr": cfg.hc_lr})
    known = {id(p) for g in groups for p in g["params"]} | {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in known]
    if rest:
        raise ValueError(f"{len(rest)} parameters have no optimizer group")
    for g in groups:  # --freeze-prefix: frozen parameters are not optimised
        g["params"] = [p for p in g["params"] if p.requires_grad]
    groups = [g for g in groups if g["params"]]
    matrices = [p for p in matrices if p.requires_grad]
    opts = []
    if cfg.optimizer == "muon" and matrices:
        # snlp.muon.Muon: torch.optim.Muon with the Newton-Schulz iterations in fp32 where bf16 is emulated
        # (CPUs without AVX512_BF16/AMX: torch's always-bf16 ones made a step ~20x slower than AdamW's)
        opts.append(Muon(matrices, lr=cfg.matrix_lr or 0.02, weight_decay=cfg.weight_decay, momentum=0.95))
    elif matrices:
        groups.append({"params": matrices, "lr": cfg.matrix_lr or 0.003})
    opts.insert(0, torch.optim.AdamW(groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=cfg.weight_decay))
    for o in opts:
        for g in o.param_groups:
            g["base_lr"] = g["lr"]
    return opts


class Progress:
    """Fraction of the run done: steps/total, or elapsed/budget with --minutes."""

    def __init__(self, steps: int | None, minutes: float | None):
        self.steps, self.seconds, self.step, self.elapsed = steps, (minutes * 60 if minutes else None), 0, 0.0

    @property
    def frac(self) -> float:
        fr = [self.step / self.steps] if self.steps else []
        if self.seconds:
            fr.append(self.elapsed / self.seconds)
        return min(1.0, max(fr))

    def done(self) -> bool:
        return (self.steps is not None and self.step >= self.steps) or \
            (self.seconds is not None and self.elapsed >= self.seconds)


def lr_multiplier(step: int, frac: float, warmup_steps: int, warmdown: float) -> float:
    """LR scale for optimizer step `step` (0-based) at run fraction `frac` (nanochat's
    get_lr_multiplier): linear warm-up over `warmup_steps`, constant, then linear warm-down to 0 over
    the last `warmdown` of the run. Stateless: resume needs no scheduler state."""
    w = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    return w * (min(1.0, (1.0 - frac) / warmdown) if warmdown > 0 else 1.0)


def set_lr(opts, mult: float) -> None:
    for o in opts:
        for g in o.param_groups:
            g["lr"] = g["base_lr"] * mult


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

    def forward(self, x, y, lam: float):
        m = self.model
        trace = None
        if self.plan is None:
            ctx = m.embed(x)
            trace = [ctx.x0]
            logits = m.head(m.run_layers(ctx.x0, ctx, 0, m.config.n_layer, trace))
        else:
            logits = m.head(solve(m, x, self.plan).hidden)
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)
        if lam > 0:
            trace = trace if trace is not None else m.hidden_states(x)
            reg = snlp_loss(m, x, trace, self.reg)
            return ce + lam * reg, ce.detach(), reg.detach()
        return ce, ce.detach(), torch.zeros((), device=x.device)


def reg_config(cfg: TrainConfig, model_cfg: GPTConfig) -> RegConfig:
    """The regulariser of a run (paper: HCN's target detached, IDN's not); checked against the model once
    (e.g. --reg hcn needs an mHC model: --hc-streams N)."""
    reg = RegConfig(surrogate=None if cfg.reg == "none" else cfg.reg, lam=cfg.reg_lambda,
                    suffixes=parse_suffixes(cfg.reg_n), stride=cfg.reg_stride, warmup=cfg.reg_warmup)
    reg.detach = cfg.reg_detach if cfg.reg_detach is not None else isinstance(reg.surrogate, HCN)
    try:
        reg.check_model(model_cfg)
    except ValueError as e:  # the one check (Plan.check_model), said in the flags' terms
        raise ValueError(f"--reg {cfg.reg} needs an mHC model: add --hc-streams N (N >= 1), or use --reg idn ({e})"
                         if reg.surrogate.needs_mhc else str(e)) from None
    return reg


def gap_suffixes(cfg: TrainConfig, model_cfg: GPTConfig, reg: RegConfig, master: bool) -> list[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if not master else "default")
        return resolve_suffixes(model_cfg.n_layer, reg.suffixes) if model_cfg.n_layer > 1 else []


@torch.no_grad()
def evaluate(model: GPT, batches, device, autocast, suffixes, reg: RegConfig | None = None,
             plan: Plan | None = None) -> dict:
    """Validation CE (targets == -1 ignored), the measured K=1 SNLP gap (final-state relative error)
    per suffix N with the regulariser's surrogate (IDN without one) and, with `plan`, the CE of the SNLP
    logits of that plan (val_loss_plan)."""
    reg = reg or RegConfig()
    was = model.training
    model.eval()
    ce, ce_plan, gaps = 0.0, 0.0, {n: 0.0 for n in suffixes}
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast():
            ce += float(model(x, y))
            if plan is not None:
                lg = model.head(solve(model, x, plan, check_finite=False).hidden)
                ce_plan += float(F.cross_entropy(lg.view(-1, lg.size(-1)), y.reshape(-1), ignore_index=-1))
            for n in suffixes:
                gaps[n] += snlp_gap(model, x, reg.plan(n))
    model.train(was)
    k = len(batches)
    return {"val_loss": ce / k, **({"val_loss_plan": ce_plan / k} if plan is not None else {}),
            **{f"gap_N{n}": g / k for n, g in gaps.items()}}


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def prepare_data(cfg, tok: Tokenizer | None, rank: int, world: int) -> tuple[Tokenizer, D.TokenData]:
    """Tokenizer (trained unless given) and cached token arrays. Rank 0 builds, others wait.
    `cfg` is a TrainConfig (or anything with its data attributes)."""
    cache = Path(cfg.cache_dir) if cfg.cache_dir else D.cache_dir()
    key = D.split_key(cfg.data, cfg.text_field, cfg.max_chars, cfg.val_frac)
    tok_path = cache / f"{key}-bpe{cfg.vocab_size}.tokenizer.json"

    def build():
        nonlocal tok
        docs = None
        if tok is None and not tok_path.is_file():
            docs = list(D.documents(cfg.data, cfg.text_field, cfg.max_chars))
            train, _ = D.split_documents(docs, cfg.val_frac)
            tok = Tokenizer.train(_capped(train, TOKENIZER_CHARS), cfg.vocab_size)
            cache.mkdir(parents=True, exist_ok=True)
            tmp = tok_path.with_name(tok_path.name + f".tmp-{os.getpid()}")
            tok.tok.save(str(tmp))
            os.replace(tmp, tok_path)
        tok = tok or Tokenizer.load(tok_path)
        ptrain, pval = D.token_paths(key, tok, cache)
        if not (ptrain.is_file() and pval.is_file()):
            docs = docs if docs is not None else list(D.documents(cfg.data, cfg.text_field, cfg.max_chars))
            train, val = D.split_documents(docs, cfg.val_frac)
        else:
            train = val = []
        return tok, D.load_tokens(train, val, tok, key, cache)

    return rank0_first(build, rank, world)


def rank0_first(build: Callable, rank: int, world: int):
    """Run `build` on rank 0 first (it fills caches), then on the other ranks."""
    if world > 1:
        if rank == 0:
            out = build()
        dist.barrier()
        if rank != 0:
            out = build()
        return out
    return build()


def _capped(docs, chars):
    n = 0
    for d in docs:
        yield d
        n += len(d)
        if n >= chars:
            return


def pretrain_job(cfg: TrainConfig, model: GPT | None, tok: Tokenizer | None, rank: int, world: int,
                 device) -> Job:
    """Next-token pretraining on `cfg.data` (random windows of the token cache), with the regulariser.
    `model`/`tok` are given when resuming; otherwise the tokenizer is trained and the model initialised."""
    if model is None and cfg.init_from:  # fine-tuning: the checkpoint's weights and tokenizer
        model, tok = init_from_checkpoint(cfg.init_from)
    tok, tokens = prepare_data(cfg, tok, rank, world)
    if model is None:
        model = GPT(build_config(cfg, tok.vocab_size))
        model.init_weights(seed=cfg.seed)
    reg = reg_config(cfg, model.config)
    suffixes = gap_suffixes(cfg, model.config, reg, rank == 0)
    autocast = _autocast(device)
    return Job(model=model, tokenizer=tok,
               batch=lambda micro, r, w: D.batch_at(tokens.train, micro, cfg.seq_len, cfg.batch_size, cfg.seed, r, w),
               val_batches=D.val_batches(tokens.val, cfg.seq_len, cfg.batch_size, cfg.eval_batches),
               loss=TrainStep(model, reg),
               evaluate=lambda m, vb: evaluate(m, vb, device, autocast, suffixes, reg),
               describe=f"{len(tokens.train):,} train / {len(tokens.val):,} val tokens | reg {cfg.reg}"
               + (f" lambda={reg.lam} N={suffixes} stride={reg.stride}" if reg.active else ""))


def _autocast(device):
    return (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if torch.device(device).type == "cuda" else nullcontext


def read_stop_file(path: str | None) -> int | None:
    """The step number written in a stop file (None while it is absent or not yet an integer)."""
    if not path:
        return None
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def run(args) -> int:
    fit(TrainConfig.from_args(args))
    return 0


def fit(cfg: TrainConfig, make_job: Callable[..., Job] = pretrain_job) -> TrainResult:
    """Train as `cfg` says and save the checkpoint to cfg.out. `make_job(cfg, model, tok, rank, world,
    device) -> Job` supplies the model, data and loss (default: pretraining); model/tok are the
    checkpoint's when resuming, else None. Multi-process under torchrun (DDP)."""
    cfg.check()
    rank, world, device = setup_dist(cfg.device)
    try:
        return _fit(cfg, make_job, rank, world, device)
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _fit(cfg: TrainConfig, make_job, rank, world, device) -> TrainResult:
    master = rank == 0
    out = Path(cfg.out)
    t_wall = time.perf_counter()
    torch.manual_seed(cfg.seed)
    resume_state, opt_state, tok, model = None, None, None, None
    if cfg.resume:
        if not (out / "model.safetensors").is_file():
            raise FileNotFoundError(f"--resume: no checkpoint in {out}; drop --resume to start a new run")
        model, tok = load(out, device="cpu")
        opt_state, resume_state = load_training(out)
        if opt_state is None or resume_state is None:
            raise ValueError(f"--resume: {out} lacks optimizer.pt/train_state.pt (a weights-only checkpoint); "
                             f"start a new run instead")
    elif (out / "model.safetensors").is_file():
        raise ValueError(f"{out} already holds a checkpoint; pass --resume to continue it or choose another --out")
    job = make_job(cfg, model, tok, rank, world, device)
    model, tok = job.model, job.tokenizer
    mcfg = model.config
    if cfg.freeze_prefix is not None:  # (a resumed run gets the same TrainConfig, so the same freeze)
        S = cfg.freeze_prefix
        if S == -1:  # the SNLP suffix of the regulariser: S = L - max(N)
            S = mcfg.n_layer - max(resolve_suffixes(mcfg.n_layer, parse_suffixes(cfg.reg_n)))
        freeze_prefix(model, S)
    model.to(device)
    model.train()
    opts = build_optimizers(model, cfg)
    if master:  # the dtypes the step computes in: weights, CUDA autocast, Muon's Newton-Schulz iterations
        warn_if_emulated(device, {p.dtype for p in model.parameters()}
                         | ({torch.bfloat16} if device.type == "cuda" else set())
                         | {o.ns_dtype or default_ns_dtype(device) for o in opts if isinstance(o, Muon)}, job.name)
    progress = Progress(cfg.total_steps, cfg.minutes)
    step, micro, elapsed0 = 0, 0, 0.0
    if resume_state is not None:
        for o, s in zip(opts, opt_state["optimizer"]):
            bases = [g["base_lr"] for g in o.param_groups]
            o.load_state_dict(s)
            for g, b in zip(o.param_groups, bases):  # the peak LRs are this run's (old checkpoints lack them)
                g["base_lr"] = b
        step, micro, elapsed0 = resume_state["step"], resume_state["micro"], resume_state.get("elapsed", 0.0)
        set_rng_state(resume_state["rng"])
    progress.step, progress.elapsed = step, elapsed0
    stepper = job.loss
    if world > 1:
        stepper = nn.parallel.DistributedDataParallel(stepper, device_ids=[device.index] if device.type == "cuda" else None)
    autocast = _autocast(device)
    vb = job.val_batches
    log_path = out / "log.jsonl"
    if master:
        out.mkdir(parents=True, exist_ok=True)
        print(f"{job.name}: {mcfg.n_layer} layers, width {mcfg.n_embd}, {mcfg.n_head} heads, vocab {mcfg.vocab_size}, "
              f"{model.num_params() / 1e6:.2f}M params | {job.describe} | {cfg.batch_size}x{cfg.grad_accum} "
              f"sequences/step/process on {world} x {device}", flush=True)
    bar = None
    if master and not cfg.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=progress.steps, initial=step, unit="step", dynamic_ncols=True)
    tokens = int(resume_state.get("tokens", 0)) if resume_state else 0

    def save():
        if master:
            state = {"step": step, "micro": micro, "elapsed": progress.elapsed, "tokens": tokens, "rng": rng_state(),
                     "args": asdict(cfg), **job.state}
            save_checkpoint(out, model, tok, optimizer=_Bundle(opts), train_state=state)
        if world > 1:
            dist.barrier()

    def log(rec: dict):
        if master:
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    t_start = time.perf_counter() - elapsed0
    t_last, last_eval, train_loss, stopped_by = time.perf_counter(), None, None, "budget"
    if step == 0:
        last_eval = job.evaluate(model, vb)
        log({"step": 0, **last_eval})
        if master:
            _write(bar, "step 0: " + _fmt(last_eval))
    stop_at = read_stop_file(cfg.stop_file)
    reg = getattr(job.loss, "reg", None)

    def stop_reason():
        nonlocal stop_at
        if world == 1:  # re-read before every step: a lockstep peer may have fixed the stop step meanwhile
            stop_at = read_stop_file(cfg.stop_file)  # (DDP: rank 0 reads after each step and broadcasts)
        if progress.done():
            return "budget"
        if cfg.stop_after is not None and step >= cfg.stop_after:
            return "stop_after"
        if stop_at is not None and step >= stop_at:
            return "stop_file"
        return None

    def wait_gate():
        """The stop reason, or None once the step gate lets step `step + 1` start (lockstep: a side-by-side
        run never starts a step its peers have not all finished the one before; the stop file may end the
        wait). Single-process runs only."""
        while True:
            reason = stop_reason()
            if reason is not None or world > 1 or not cfg.step_gate:
                return reason
            gate = read_stop_file(cfg.step_gate)
            if gate is not None and gate > step:
                return None
            time.sleep(0.002)

    while wait_gate() is None:
        lam = reg.weight(step) if reg is not None else 0.0
        mult = lr_multiplier(step, progress.frac, cfg.warmup_steps, cfg.warmdown)
        set_lr(opts, mult)
        ce_sum = torch.zeros((), device=device)
        reg_sum = torch.zeros((), device=device)
        n_tok = 0
        for a in range(cfg.grad_accum):
            x, y = job.batch(micro, rank, world)
            micro += 1
            n_tok += x.numel()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync = nullcontext() if (world == 1 or a == cfg.grad_accum - 1) else stepper.no_sync()
            with sync:
                with autocast():
                    loss, ce, rg = stepper(x, y, lam)
                (loss / cfg.grad_accum).backward()
            ce_sum += ce
            reg_sum += rg
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip) if cfg.grad_clip > 0 else None
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad(set_to_none=True)
        step += 1
        # time budget and stop file: all ranks must agree, so rank 0's clock and file decide
        if master:
            stop_at = read_stop_file(cfg.stop_file)
        ctl = torch.tensor([time.perf_counter() - t_start, -1 if stop_at is None else stop_at, n_tok],
                           dtype=torch.float64, device=device)
        stats = torch.stack([ce_sum.float(), reg_sum.float()]) / cfg.grad_accum
        if world > 1:
            dist.broadcast(ctl[:2], 0)
            dist.all_reduce(ctl[2:])
            dist.all_reduce(stats)
            stats /= world
        progress.step, progress.elapsed = step, float(ctl[0])
        stop_at = None if ctl[1] < 0 else int(ctl[1])
        step_tokens = int(ctl[2]) if world > 1 else n_tok
        tokens += step_tokens
        train_loss = float(stats[0])
        now = time.perf_counter()
        tps = step_tokens / max(now - t_last, 1e-9)
        t_last = now
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{stats[0]:.3f}", reg=f"{stats[1]:.3f}", tok_s=f"{tps:,.0f}",
                            lr=f"{opts[0].param_groups[0]['lr']:.2e}", refresh=False)
        stopped_by = stop_reason()  # decided before the step is logged: a lockstep peer reads both together
        end = stopped_by is not None
        if step % cfg.log_every == 0 or step == 1 or end:
            log({"step": step, "loss": train_loss, "reg": float(stats[1]), "lambda": lam, "tok_s": tps,
                 "elapsed": progress.elapsed, "lr_scale": mult,
                 "grad_norm": float(gnorm) if gnorm is not None else None, **({"stop": stopped_by} if end else {})})
        if not math.isfinite(train_loss):
            raise FloatingPointError(f"training loss became {train_loss} at step {step}; lower the learning "
                                     f"rates or --reg-lambda")
        if step % cfg.eval_every == 0 or end:
            last_eval = job.evaluate(model, vb)
            log({"step": step, "elapsed": progress.elapsed, **last_eval})
            if master:
                _write(bar, f"step {step}: " + _fmt(last_eval) + f" | train loss {train_loss:.4f}")
        if cfg.save_every and step % cfg.save_every == 0 and not end:
            save()
    save()
    if bar is not None:
        bar.close()
    total = time.perf_counter() - t_start
    if master:
        print(f"saved {out} after {step} steps, {tokens:,} tokens in {total:.0f}s "
              f"({tokens / max(total, 1e-9):,.0f} tokens/s incl. eval)"
              + (f" | {_fmt(last_eval)}" if last_eval else ""), flush=True)
    return TrainResult(out=str(out), steps=step, tokens=tokens, train_loss=train_loss,
                       val_loss=(last_eval or {}).get("val_loss"), wall_s=time.perf_counter() - t_wall,
                       elapsed_s=progress.elapsed, evals=last_eval or {}, stopped_by=stopped_by or "budget")


class _Bundle:
    """Several optimizers saved as one optimizer.pt entry: a list of state dicts."""

    def __init__(self, items):
        self.items = items

    def state_dict(self):
        return [o.state_dict() for o in self.items]


def _fmt(ev: dict) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in ev.items())


def _write(bar, msg: str) -> None:
    if bar is not None:
        bar.write(msg)
    else:
        print(msg, flush=True)

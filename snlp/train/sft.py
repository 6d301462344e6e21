"""Chat SFT of a checkpoint with the sequential forward or an SNLP forward (paper, "Downstream task evaluation").

`snlp sft CKPT --data CHATS --out DIR --forward sequential|PLAN` fine-tunes on conversations
(snlp.chat: JSONL {"messages": [...]}, or hf:NAME[:CONFIG][:SPLIT]) with the loss on assistant
tokens only. --forward PLAN computes that loss on the SNLP logits of PLAN with gradients through
all K iterations (SNLP-forward SFT); --reg adds the SNLP-aware regulariser. Optimiser, LR schedule,
checkpoints, --resume and DDP (torchrun) are `snlp train`'s (snlp.train.fit). LRs default to
snlp train's times --lr-scale (0.1), as fine-tuning wants smaller steps than pretraining.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace

from snlp.io import chat
from snlp.method.plan import Plan
from snlp.method.solver import as_plan
from snlp.train.trainer import (Job, TrainConfig, TrainResult, TrainStep, _autocast, evaluate, fit, init_from_checkpoint,
                    rank0_first, reg_config)

SEQUENTIAL = "sequential"


@dataclass
class SFTConfig:
    """An SFT run: start from `ckpt`, train on `data`, save to `train.out`. `train` holds the shared
    optimisation settings (its data/model fields are unused: the model and tokenizer are the checkpoint's)."""

    ckpt: str
    data: str
    train: TrainConfig
    forward: str = SEQUENTIAL  # "sequential" or an SNLP plan string
    max_conversations: int = 0  # 0 = all
    val_frac: float = 0.05

    def plan(self) -> Plan | None:
        return None if self.forward == SEQUENTIAL else Plan.parse(self.forward)


def sft_job(scfg: SFTConfig):
    """The `make_job` of `train.fit` for SFT (see `fit`)."""

    def make_job(cfg: TrainConfig, model, tok, rank: int, world: int, device) -> Job:
        if model is None:  # a new run starts from the checkpoint; --resume passes the run's own
            model, tok = init_from_checkpoint(scfg.ckpt)
        plan = None if scfg.plan() is None else as_plan(model, scfg.plan())
        max_len = min(cfg.seq_len, model.config.sequence_len) + 1
        convs = rank0_first(lambda: chat.load_conversations(scfg.data, scfg.max_conversations), rank, world)
        examples = chat.render(convs, tok, max_len)
        if len(examples) < 2:
            raise ValueError(f"chat data {scfg.data!r} gives {len(examples)} usable conversations (with an "
                             f"assistant reply within {max_len} tokens); need at least 2")
        train, val = chat.split(examples, scfg.val_frac)
        pad = 0  # any id: padding sits after each row's tokens (causal: unseen) and its targets are -1
        reg = reg_config(cfg, model.config)
        autocast = _autocast(device)
        return Job(model=model, tokenizer=tok,
                   batch=lambda micro, r, w: chat.batch_at(train, micro, cfg.batch_size, cfg.seed, pad, r, w),
                   val_batches=chat.val_batches(val, cfg.batch_size, cfg.eval_batches, pad),
                   loss=TrainStep(model, reg, plan),
                   evaluate=lambda m, vb: evaluate(m, vb, device, autocast, [], plan=plan),
                   describe=f"SFT of {scfg.ckpt} with the {plan or 'sequential'} forward on {len(train):,} train / "
                   f"{len(val):,} val conversations of {scfg.data}" + (f" | reg {cfg.reg} lambda={reg.lam}" if reg.active else ""),
                   name="snlp sft", state={"sft": {k: v for k, v in asdict(scfg).items() if k != "train"}})

    return make_job


def sft(scfg: SFTConfig) -> TrainResult:
    """Fine-tune `scfg.ckpt` on chats; the checkpoint (with tokenizer) lands in scfg.train.out."""
    if scfg.forward != SEQUENTIAL:
        Plan.parse(scfg.forward)  # a clear error before any loading
    if not 0 < scfg.val_frac < 1:
        raise ValueError(f"--val-frac must lie in (0, 1), got {scfg.val_frac}")
    return fit(with_base_data(scfg.train, scfg.ckpt), sft_job(scfg))


def with_base_data(cfg: TrainConfig, ckpt) -> TrainConfig:
    """`cfg` with the base checkpoint's pretraining data settings (defaults where it has none): they
    are saved with the SFT checkpoint, so `snlp eval SFT_CKPT` measures PPL on the pretraining split."""
    from snlp.io.checkpoint import load_training

    base = (load_training(ckpt)[1] or {}).get("args", {})
    default = TrainConfig(out="")
    keys = ("data", "text_field", "max_chars", "val_frac", "cache_dir", "vocab_size")
    return replace(cfg, **{k: base.get(k, getattr(default, k)) for k in keys})


# ----- CLI -----
def add_train_arguments(p, steps: int = 200) -> None:
    """The optimisation flags SFT shares with `snlp train` (also used by `snlp sft-grid`)."""
    o = p.add_argument_group("optimisation (as snlp train)")
    o.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    o.add_argument("--minutes", type=float, default=None, help="wall-clock budget; the LR schedule follows elapsed time")
    o.add_argument("--stop-after", type=int, default=None, help="stop (and save) after this step")
    o.add_argument("--stop-file", default=None, help="stop once the step number written in this file is done")
    o.add_argument("--seq-len", type=int, default=512, help="conversations are truncated to this many tokens")
    o.add_argument("--batch-size", type=int, default=8, help="conversations per micro-batch per process")
    o.add_argument("--grad-accum", type=int, default=1)
    o.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    o.add_argument("--lr-scale", type=float, default=0.1, help="multiplies snlp train's default LRs")
    o.add_argument("--warmup-steps", type=int, default=0)
    o.add_argument("--warmdown", type=float, default=0.5)
    o.add_argument("--grad-clip", type=float, default=1.0)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    r = p.add_argument_group("SNLP-aware regulariser (as snlp train)")
    r.add_argument("--reg", choices=["idn", "hcn", "diag", "none"], default="none")
    r.add_argument("--reg-lambda", type=float, default=0.5)
    r.add_argument("--reg-n", default="4")
    r.add_argument("--reg-stride", type=int, default=0)
    r.add_argument("--reg-detach", action=argparse.BooleanOptionalAction, default=None)
    r.add_argument("--reg-warmup", type=int, default=0)
    e = p.add_argument_group("data and logging")
    e.add_argument("--max-conversations", type=int, default=0, help="use at most this many (0 = all)")
    e.add_argument("--val-frac", type=float, default=0.05, help="fraction of conversations held out")
    e.add_argument("--eval-every", type=int, default=50)
    e.add_argument("--eval-batches", type=int, default=4)
    e.add_argument("--save-every", type=int, default=0)
    e.add_argument("--log-every", type=int, default=10)
    e.add_argument("--no-progress", action="store_true")


def train_config(args, out: str, resume: bool = False) -> TrainConfig:
    """TrainConfig of the shared flags, LRs scaled by --lr-scale."""
    base = TrainConfig(out=out)
    cfg = TrainConfig.from_args(args)
    s = args.lr_scale
    if s <= 0:
        raise ValueError(f"--lr-scale must be > 0 (got {s})")
    return replace(cfg, out=out, resume=resume, matrix_lr=(0.02 if args.optimizer == "muon" else 0.003) * s,
                   embedding_lr=base.embedding_lr * s, unembedding_lr=base.unembedding_lr * s,
                   scalar_lr=base.scalar_lr * s, hc_lr=base.hc_lr * s)


def add_arguments(p) -> None:
    p.add_argument("ckpt", help="checkpoint to fine-tune (snlp train --out)")
    p.add_argument("--data", required=True, help="chat JSONL file(s)/folder/glob, comma-separated, or hf:NAME[:CONFIG][:SPLIT]")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--forward", default=SEQUENTIAL, help="sequential, or an SNLP plan (e.g. 4xF1-h0-K1) whose logits "
                   "the loss is computed on, gradients through all K iterations")
    p.add_argument("--resume", action="store_true", help="continue the SFT run saved in --out")
    add_train_arguments(p)


def run(args) -> int:
    scfg = SFTConfig(ckpt=args.ckpt, data=args.data, train=train_config(args, args.out, args.resume),
                     forward=args.forward, max_conversations=args.max_conversations, val_frac=args.val_frac)
    sft(scfg)
    return 0

"""Chat SFT of a checkpoint with the sequential forward or an SNLP forward (paper, "Downstream task evaluation").

`snlp sft CKPT --data CHATS --out DIR --forward sequential|PLAN` fine-tunes on conversations
(snlp.io.chat: JSONL {"messages": [...]}, or hf:NAME[:CONFIG][:SPLIT]) with the loss on assistant
tokens only. --forward PLAN computes that loss on the SNLP logits of PLAN with gradients through
all K iterations (SNLP-forward SFT); --reg adds the SNLP-aware regulariser. Optimiser, LR schedule,
checkpoints, --resume and DDP (torchrun) are `snlp train`'s (snlp.train.fit). LRs default to
snlp train's times --lr-scale (0.1), as fine-tuning wants smaller steps than pretraining.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

from typing import TYPE_CHECKING

from snlp.apps.train import (add_reg_rows_argument, add_speed_arguments, check_reg_flags, check_stop_file,
                             config_from_args, file_hooks, finished_despite, interrupted, not_inherited)

if TYPE_CHECKING:  # the library (and torch) loads in run(), after the flags are parsed: --help answers at once
    from snlp.train.config import TrainConfig

SUMMARY = "Fine-tune a checkpoint on chats with the sequential forward or an SNLP forward."
DESCRIPTION = """\
The loss is on assistant tokens only; --forward PLAN computes it on the SNLP logits of PLAN, with gradients through
all K iterations (the paper's SNLP-forward SFT), and --reg adds the SNLP-aware regulariser. --data: JSONL of
{"messages": [...]} conversations or hf:NAME[:CONFIG][:SPLIT]. OUT is a checkpoint as `snlp train` writes one; the
optimiser, --resume and torchrun work as there, with `snlp train`'s learning rates times --lr-scale.

  snlp sft CKPT --data chats.jsonl --out runs/sft --forward sequential
  snlp sft CKPT --data chats.jsonl --out runs/sft-snlp --forward 8xF1-h0-K1 --reg idn
"""
GUIDE = "docs/sft.md"


SEQUENTIAL = "sequential"  # snlp.train.sft.SEQUENTIAL (tests check they agree)


def add_train_arguments(p, steps: int = 200) -> None:
    """The optimisation flags SFT shares with `snlp train` (also used by `snlp sft-grid`)."""
    o = p.add_argument_group("optimisation (as snlp train)")
    o.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    o.add_argument("--minutes", type=float, default=None, help="wall-clock budget; the LR schedule follows elapsed time")
    o.add_argument("--stop-after", type=int, default=None, help="stop (and save) after this step")
    o.add_argument("--stop-file", default=None, help="stop once the step number written in this file is done; "
                   "other text, such as 'stop', stops it after the step in progress")
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
    add_speed_arguments(o)
    r = p.add_argument_group("SNLP-aware regulariser (as snlp train)")
    r.add_argument("--reg", choices=["idn", "hcn", "diag", "none"], default="none")
    r.add_argument("--reg-lambda", type=float, default=0.5)
    r.add_argument("--reg-n", default="4")
    r.add_argument("--reg-stride", type=int, default=0)
    r.add_argument("--reg-detach", action=argparse.BooleanOptionalAction, default=None)
    r.add_argument("--reg-warmup", type=int, default=0)
    add_reg_rows_argument(r)
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
    from snlp.train.config import TrainConfig

    base = TrainConfig(out=out)
    cfg = config_from_args(args)
    s = args.lr_scale
    if not (math.isfinite(s) and s > 0):  # NaN passed `s <= 0` and was refused as --matrix-lr, a flag sft has not
        raise ValueError(f"--lr-scale must be a finite number > 0 (got {s})")
    return replace(cfg, out=out, resume=resume, matrix_lr=(0.02 if args.optimizer == "muon" else 0.003) * s,
                   embedding_lr=base.embedding_lr * s, unembedding_lr=base.unembedding_lr * s,
                   scalar_lr=base.scalar_lr * s, hc_lr=base.hc_lr * s)


def check_lr_scale(args, given) -> None:
    """`--lr-scale` typed on `--resume`: refused unless it is the saved run's (its embedding LR over the default
    one: train_config scales every LR by it), so a typed scale equal to the saved one is not a change, whatever
    --optimizer (checked on its own: a setting the run keeps) was typed beside it."""
    from snlp.train.config import TrainConfig
    from snlp.train.sft import saved_sft

    saved = saved_sft(args.out)[0]
    if "lr_scale" not in given or not saved or "embedding_lr" not in saved:
        return
    was = saved["embedding_lr"] / TrainConfig(out="").embedding_lr
    if not math.isclose(was, args.lr_scale, rel_tol=1e-9):
        raise ValueError(f"--resume: the SFT run in {args.out} was saved with --lr-scale {was:g} (given: "
                         f"{args.lr_scale:g}); a resumed run keeps its learning rates: leave --lr-scale out or start "
                         f"a new run in another --out")


def add_arguments(p) -> None:
    p.add_argument("ckpt", help="checkpoint to fine-tune (snlp train --out)")
    p.add_argument("--data", required=True, help="chat JSONL file(s)/folder/glob, comma-separated, or hf:NAME[:CONFIG][:SPLIT]")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--forward", default=SEQUENTIAL, help="sequential, or an SNLP plan (e.g. 4xF1-h0-K1) whose logits "
                   "the loss is computed on, gradients through all K iterations")
    p.add_argument("--resume", action="store_true", help="continue the SFT run saved in --out with its saved "
                   "settings (flags left out keep them; as snlp train --resume)")
    add_train_arguments(p)


def run(args) -> int:
    from snlp.apps.common import check_plans_fit
    from snlp.method.plan import cli_plan
    from snlp.train.checkpointing import check_resume_command, check_resume_left
    from snlp.train.sft import SFTConfig, resumed_sft, sft

    if args.resume:  # before the saved settings are read as an SFT run's (snlp.train.sft checks it too)
        check_resume_command(args.out, "snlp sft")
    check_stop_file(args.stop_file, args.out, args.resume)
    if args.forward != SEQUENTIAL:  # a K beyond the exact count capped (with a warning), as for every --plan
        args.forward = str(cli_plan(args.forward))
        check_plans_fit(args.ckpt, [args.forward])  # its depth from its config, before its weights load
    scfg = SFTConfig(ckpt=args.ckpt, data=args.data, train=train_config(args, args.out, args.resume),
                     forward=args.forward, max_conversations=args.max_conversations, val_frac=args.val_frac)
    given = getattr(args, "given", None)
    if args.resume and given is not None:  # the flags not typed keep the saved run's values
        check_lr_scale(args, given)
        scfg = resumed_sft(scfg, given)  # the five LRs are never "typed": the saved ones are kept
    check_reg_flags(scfg.train.reg, given)
    if args.resume:
        check_resume_left(scfg.train)
    res = sft(scfg, hooks=replace(file_hooks(args.stop_file), pass_late_signal=False))
    if res.stopped_by == "interrupt":
        return interrupted("sft", res.out, res.steps, res.signal, [args.ckpt, "--data", args.data, "--out", res.out,
                                                                    *not_inherited(args)])
    return finished_despite("sft", res)

"""Calibrate the preheat init of a checkpoint (paper App. "ELK Tempering and Preheat Initialization"):
per-layer low-rank affine predictors of the states from the token embedding, written to CKPT/preheat.pt
with a fingerprint of the weights they were fitted on (plans with the `preheat` init read it)."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

SUMMARY = "Fit the preheat initialisation of a checkpoint's plans (CKPT/preheat.pt)."
DESCRIPTION = """\
Per-layer low-rank affine predictors of the states from the token embedding (paper App. "ELK Tempering and Preheat
Initialization"), fitted on uniformly random tokens (or --data) and saved with a fingerprint of the weights they were
fitted on; plans with the preheat init (e.g. 8xF1-preheat-K1) read them.

  snlp calibrate runs/y --rank 32          # runs/y/preheat.pt
  snlp calibrate runs/y --data train       # fitted on the validation split of its training data
"""
GUIDE = "docs/plans.md"

# stand-ins for snlp.method.preheat's FILENAME and CalibrateConfig's defaults: the library (and torch) loads in run(),
# after the flags are parsed, so --help answers at once (tests/apps/test_cli_fast.py checks that they agree)
FILENAME = "preheat.pt"
CALIBRATE_DEFAULTS = SimpleNamespace(rank=32, batch=8, seq_len=128)

OUTPUT_FILES = ("out",)  # --out names a file (snlp.apps.cli checks it before the run)


def add_arguments(p) -> None:
    p.add_argument("ckpt", help="checkpoint directory")
    p.add_argument("--rank", type=int, default=CALIBRATE_DEFAULTS.rank, help="rank r of the embedding basis V")
    p.add_argument("--data", default=None, help="calibrate on this data spec's validation split (default: "
                   "uniformly random tokens, as the paper); 'train' = the checkpoint's training data")
    p.add_argument("--batch", type=int, default=CALIBRATE_DEFAULTS.batch, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=CALIBRATE_DEFAULTS.seq_len, help="tokens per calibration window")
    p.add_argument("--seed", type=int, default=0, help="seed of the random calibration tokens (not with --data)")
    p.add_argument("--out", default=None, help=f"output file (default: CKPT/{FILENAME}, read by plans with the "
                   "preheat init)")


def check_out(out: str) -> None:
    """Refuse an --out that names an existing file that is not a .pt: the preheat would be written over it (an
    existing .pt is read by check_replaced once the library has loaded: only a calibration is replaced). (A file of
    a checkpoint, drafter or run folder, `--out CKPT/model.safetensors`, is refused with every command's outputs:
    snlp.apps.cli.check_not_a_model_file.)"""
    path = Path(out)
    if path.exists() and path.suffix != ".pt":
        raise ValueError(f"--out {out} is an existing file: the preheat would be written over it; name a new file "
                         f"(default CKPT/{FILENAME})")


def check_replaced(out: Path, ckpt: Path) -> None:
    """Refuse an --out whose file another model or the user owns: a .pt that is not a preheat calibration (a
    user's torch file), or the preheat.pt of another checkpoint (that checkpoint's own calibration: its preheat plans
    would then refuse this model's). The checkpoint's own CKPT/preheat.pt is its calibration slot, replaced even when
    stale or unreadable (the advice for both is to re-run `snlp calibrate`), as is an earlier calibration elsewhere."""
    from snlp.io.checkpoint import WEIGHTS
    from snlp.method.preheat import Preheat

    folder = out.parent.resolve()
    if out.name == FILENAME and folder == ckpt.resolve():
        return
    if out.name == FILENAME and (folder / WEIGHTS).is_file():
        raise ValueError(f"--out {out} is the preheat calibration of another checkpoint ({out.parent}): its "
                         f"preheat plans would read this one's; choose another path (`snlp calibrate {out.parent}` "
                         f"fits its own)")
    if out.is_file():
        try:
            Preheat.load(out)
        except ValueError:
            raise ValueError(f"--out {out} is an existing file that is not a preheat calibration: it would be written "
                             f"over; name a new file (default CKPT/{FILENAME})") from None


def run(args) -> int:
    from snlp.eval.data import checkpoint_data, validation_tokens
    from snlp.io.checkpoint import checkpoint_dir, load
    from snlp.method.preheat import CalibrateConfig, fit

    bad = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("rank", "batch", "seq_len") if getattr(args, k) < 1]
    if bad:  # before the checkpoint loads (CalibrateConfig.check says the same after it, for the library)
        raise ValueError(f"{', '.join(bad)}: must be >= 1")
    if args.out is not None:
        check_out(args.out)
    if args.data is not None and args.seed != 0:  # the data windows are the split's first ones: no draw
        raise ValueError(f"--seed {args.seed} would be unused: it draws the random calibration tokens, and --data "
                         f"{args.data} calibrates on the split's first windows (drop --seed or --data)")
    from snlp.io.source import check_source

    check_source(args.ckpt, "checkpoint", hub=False)  # one line, with the closest names
    ckpt = checkpoint_dir(args.ckpt)  # CKPT/model.safetensors names the checkpoint too: the default --out is beside it
    out = Path(args.out) if args.out is not None else ckpt / FILENAME
    check_replaced(out, ckpt)
    model, tok = load(ckpt, need_tokenizer="use random-token calibration (no --data)" if args.data is not None else None)
    cfg = CalibrateConfig(rank=args.rank, batch=args.batch, seq_len=args.seq_len, seed=args.seed)
    cfg.check(model)
    if args.seq_len > model.config.sequence_len:  # RoPE runs there (GPT.rotary), as extrapolation
        warnings.warn(f"--seq-len {args.seq_len} is past the model's sequence_len {model.config.sequence_len} (the "
                      f"context it was trained for): the states are fitted on positions it never runs at; pass "
                      f"--seq-len {model.config.sequence_len} or less")
    tokens, used = None, args.batch
    if args.data is not None:
        tokens = validation_tokens(tok, **checkpoint_data(ckpt, data=None if args.data == "train" else args.data))
        used = min(args.batch, tokens.numel() // args.seq_len)
    pre = fit(model, cfg, tokens)
    pre.save(out)
    streams = model.config.hc_streams
    width = f"the width of its {streams} x {model.config.n_embd} stream embedding" if streams else "the model width"
    capped = f" (asked for {args.rank}: capped at {width}, {pre.rank})" if pre.rank < args.rank else ""
    fewer = f" (asked for {args.batch}: the split has {tokens.numel()} tokens)" if used < args.batch else ""
    windows = f"{used} window{'s' * (used != 1)}"
    print(f"wrote {out}: rank {pre.rank}{capped}, {pre.U.shape[0]} layers, calibrated on {windows} of {args.seq_len} "
          f"{pre.source} tokens{fewer}")
    return 0

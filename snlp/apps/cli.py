"""The `snlp` command line. Each sub-command lives in its own module, which provides
`add_arguments(parser)` and `run(args) -> int`; the module's docstring is its help text."""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> module
COMMANDS = {
    "adapt": "snlp.apps.adapt",
    "analyze": "snlp.apps.analyze",
    "bench": "snlp.apps.bench",
    "calibrate": "snlp.apps.calibrate",
    "convert": "snlp.apps.convert",
    "eval": "snlp.apps.eval",
    "export": "snlp.apps.export",
    "generate": "snlp.apps.generate",
    "speedrun": "snlp.apps.speedrun",
    "sft": "snlp.apps.sft",
    "selfcheck": "snlp.apps.selfcheck",
    "sft-grid": "snlp.apps.sft_grid",
    "train": "snlp.apps.train",
    "tune": "snlp.apps.tune",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="snlp", description="Layer-parallel inference of Transformer LMs "
                                     "(Structured Newton Layer Parallelism).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, modname in COMMANDS.items():
        mod = importlib.import_module(modname)
        doc = (mod.__doc__ or name).strip()
        p = sub.add_parser(name, help=doc.splitlines()[0], description=doc,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FloatingPointError) as e:  # bad input: say what and why, no traceback
        print(f"snlp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"snlp {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

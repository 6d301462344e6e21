"""The `snlp` command line. Each sub-command lives in its own module, which provides
`add_arguments(parser)` and `run(args) -> int`; the module's docstring is its help text."""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from pathlib import Path

# sub-command -> module
COMMANDS = {
    "bench": "snlp.bench",
    "convert": "snlp.convert",
    "eval": "snlp.eval",
    "export": "snlp.export",
    "generate": "snlp.generate",
    "speedrun": "snlp.speedrun",
    "train": "snlp.train",
}


def write_json(path, obj) -> None:
    """Write a command's machine-readable results (creating parent folders) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2))
    print(f"wrote {path}")


def cli_device(name: str):
    """torch.device of a --device flag; a clear error when CUDA is asked for but not available."""
    import torch

    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available; use --device cpu")
    return device


def cli_dtype(dtype: str | None, device) -> str:
    """A --dtype flag's value, defaulting to bfloat16 on CUDA and float32 elsewhere."""
    return dtype or ("bfloat16" if device.type == "cuda" else "float32")


def set_threads(n: int | None) -> None:
    """Apply a --threads flag: torch's intra-op CPU threads (None leaves the default)."""
    if n is not None:
        import torch

        if n < 1:
            raise ValueError("--threads must be >= 1")
        torch.set_num_threads(n)


def device_label(device) -> str:
    """What a benchmark ran on, for table titles: the GPU name or the CPU and its thread count."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


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

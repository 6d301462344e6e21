"""Check this install on your device (the first command to run on a GPU): the exactness laws, then a small timed suite.

Laws: K >= C reproduces the fused model, M = 1 equals sequential, speculative greedy == sequential, batched rows ==
single rows, compiled == eager, a converted transformers model's logits == transformers' own (when installed),
fingerprints and refusals. Then prefill and decode timings (eager and compiled). Prints one pass/fail table and
writes selfcheck.json (device, versions, every check and number) to --out: attach it to a bug report. Exit status 1
when a check fails.
"""

from __future__ import annotations

from pathlib import Path

SUMMARY = "Check this install on your device: the exactness laws, then a timed suite."
DESCRIPTION = """\
The first command to run on a GPU. It checks that K >= C reproduces the fused model, speculative greedy decoding
equals sequential, batched rows equal single rows, compiled equals eager and a converted transformers model gives
transformers' logits, then times prefill and decoding. Prints a pass/fail table, writes OUT/selfcheck.json (attach it
to a bug report) and exits with status 1 when a check fails.

  snlp selfcheck --device cuda
  snlp selfcheck --quick                # a smaller speed suite
"""
GUIDE = "docs/gpu.md"
LOCK_OUTPUTS = True  # a second run writing one of its output paths is refused (snlp.apps.cli.output_locks)


def add_arguments(p) -> None:
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", default="selfcheck", help="directory for selfcheck.json")
    p.add_argument("--quick", action="store_true", help="a smaller speed suite (CI)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="the compiled check and timings (torch.compile; CUDA graphs on CUDA); auto: on for cuda, off "
                        "on the CPU, where inductor's C++ compile takes minutes on a cold cache")
    p.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    import torch  # here, not at the top: --help answers without loading torch

    from snlp.bench.records import write_json
    from snlp.bench.selfcheck import SelfcheckConfig, selfcheck, table
    from snlp.runtime.device import cli_device

    from snlp.runtime.outputs import check_output_dir

    check_output_dir(args.out, "--out")  # its default too (the CLI checks typed paths): before minutes of checks
    if "out" not in getattr(args, "given", ()):  # the default, held while the run goes, as a typed one (snlp.apps.cli)
        getattr(args, "hold_output", lambda *a: None)(args.out, "--out")
    device = cli_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    compile = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    res = selfcheck(SelfcheckConfig(device=str(device), quick=args.quick, compile=compile, seed=args.seed))
    print("\n".join(table(res)))
    write_json(Path(args.out) / "selfcheck.json", res.to_dict())
    if res.passed:  # a signal from here on finds the run finished: status 0, as the run's own (snlp.apps.cli)
        from snlp.runtime.outputs import complete_in

        args.finished = complete_in([Path(args.out) / "selfcheck.json"])
    return 0 if res.passed else 1


def finished(args) -> str | None:
    """Where a signal came after a passing selfcheck wrote selfcheck.json: what holds its results; else None (a
    failing one keeps 128 + signum, not its status 1)."""
    return getattr(args, "finished", None)

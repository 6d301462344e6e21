"""Which process of a torchrun launch says what every process would say alike.

Under torchrun every rank runs the same command line: the checks before the processes join a process group read
only the flags and the files they name, so each rank refuses the same input with the same line and issues the same
warnings, which the terminal then shows once per rank. The first process of each node (LOCAL_RANK 0; rank 0 among
them) says those: a multi-node launch runs one torchrun per node, each with its own terminal, and a file the flags
name may be missing on one node only, whose ranks alone refuse it. Once a group has started the ranks may fail each
for its own reason (a dead peer, a device of its own), so from then on every rank says its errors."""

from __future__ import annotations

import os
import sys

# holds True once this process has joined a process group (group_started): a group torn down by the time an error
# reaches the command line still counts, the error may have been this rank's own
STARTED: list[bool] = []


def launch_rank() -> tuple[int, int]:
    """(rank, world size) of this process from torchrun's environment (RANK, WORLD_SIZE); (0, 1) outside one, or
    where either is not a whole number (the process group's own setup says so)."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def group_started() -> None:
    """Record that this process joined a process group (called where snlp initialises one)."""
    if not STARTED:
        STARTED.append(True)


def node_lead() -> bool:
    """Whether this process is the first torchrun starts on its node (LOCAL_RANK 0): on one node that is rank 0."""
    return os.environ.get("LOCAL_RANK", "").strip() == "0"


def speaks() -> bool:
    """Whether this process prints a refusal, warning or note that every rank would print alike: a single process,
    rank 0 and the first process of every other node (`node_lead`: that node's terminal, and a file missing there
    alone) always; another rank only once a process group has started (its errors may then be its own)."""
    rank, world = launch_rank()
    if world <= 1 or rank == 0 or node_lead() or STARTED:
        return True
    dist = sys.modules.get("torch.distributed")  # not imported: no group (the CLI's first lines import no torch)
    return dist is not None and dist.is_available() and dist.is_initialized()

"""Data-parallel training's process plumbing: rank/world/device from torchrun's environment, rank-0-first
builds, and the per-step agreement of all ranks on the clock and on stopping."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from snlp.runtime.device import cli_device
from snlp.runtime.load import own_threads, ranks_threads
from snlp.runtime.ranks import group_started


@dataclass(frozen=True)
class DistContext:
    """This process's place in the run: rank, number of processes and its device."""

    rank: int
    world: int
    device: torch.device
    owns_group: bool = False  # setup_dist created the process group (teardown_dist destroys only such a one)

    @property
    def master(self) -> bool:
        """Rank 0 logs, saves and decides what all ranks must agree on (clock, stop)."""
        return self.rank == 0


def setup_dist(device_arg: str | None) -> DistContext:
    """This process's DistContext; initialises the process group when launched by torchrun (NCCL on GPU,
    gloo on CPU). Without `device_arg`: cuda (per local rank) if available, else cpu."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_arg:
        device = cli_device(device_arg)  # a typo or a device this machine lacks: one line, not torch's traceback
    else:
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda requested but CUDA is not available; use --device cpu")
        if device.index is None:
            device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    owns = world > 1 and not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.is_initialized():  # from here a rank's error may be its own: every rank says it (snlp.runtime.ranks)
        group_started()
    return DistContext(rank, world, device, owns)


def teardown_dist(ctx: DistContext) -> None:
    """Destroy the process group if setup_dist created it (a caller's group outlives the run)."""
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


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


def barrier(ctx: DistContext) -> None:
    if ctx.world > 1:
        dist.barrier()


def agree_on_reason(ctx: DistContext, reason: str | None) -> str | None:
    """Rank 0's `reason` on every rank (a stop decision all ranks must share, or they deadlock)."""
    if ctx.world == 1:
        return reason
    box = [reason]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def busy_threads(ctx: DistContext) -> tuple[int, int]:
    """(the threads, the ranks) this run keeps busy on rank 0's machine while every rank times at once: each
    rank's own_threads (its torch threads on a CPU, one on a GPU) summed over the ranks on that host
    (snlp.runtime.load.ranks_threads). A collective under DDP: every rank calls it."""
    mine = (socket.gethostname(), own_threads([torch.get_num_threads()], ctx.device))
    if ctx.world == 1:
        return mine[1], 1
    every: list = [None] * ctx.world
    dist.all_gather_object(every, mine)
    return ranks_threads(every, every[0][0])

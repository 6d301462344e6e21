"""Low-rank (LoRA) deltas of a drafter's suffix weights (the drafter stores full suffix weights or low-rank deltas).

A LoRA drafter does not copy the base's suffix matrices. Each suffix linear weight is re-parametrised as

    W = W0 + (alpha / r) * B @ A        W0: the BASE's own Parameter (shared, frozen); A: (r, in), B: (out, r)

with B = 0 at the start (the drafter starts as the post-hoc SNLP forward, as LoRA starts at the pretrained
model; Hu et al. 2021). It is a `torch.nn.utils.parametrize` parametrization, so `linear.weight` IS the merged
weight: the fused chunk weights (snlp.method.fusion), which read `.weight`, see the delta merged before fusion
and gradients reach A and B through the whole K-iteration solve. peft's LoRA layers add the delta in their
own forward instead, which the batched chunk forward never calls; that is why the delta lives on the weight.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.nn.utils import parametrize


class LowRankDelta(nn.Module):
    """The parametrization W0 -> W0 + scale * B @ A of one (out, in) weight."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float, like: torch.Tensor):
        super().__init__()
        self.rank, self.scale = rank, alpha / rank
        self.A = nn.Parameter(torch.empty(rank, in_features, device=like.device, dtype=like.dtype))
        self.B = nn.Parameter(torch.zeros(out_features, rank, device=like.device, dtype=like.dtype))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # LoRA's init of A; B = 0 makes the delta 0

    def forward(self, W0: torch.Tensor) -> torch.Tensor:
        return W0 + self.scale * (self.B @ self.A)  # (out, in)


def check_rank(rank: int, alpha: float | None) -> float:
    """The LoRA alpha to use (default: alpha = rank, scale 1), or a ValueError for a bad rank/alpha."""
    # bool is an int: rank=True passed here and failed later in torch.empty (the rule of Plan's counts)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"--lora-rank must be an integer >= 0 (0: full suffix weights; got {rank!r})")
    if not rank and alpha is not None:  # full suffix weights have no delta to scale: the alpha would be dropped
        raise ValueError(f"--lora-alpha scales LoRA deltas (alpha / R), and --lora-rank 0 trains full suffix weights: "
                         f"give --lora-rank R > 0 or drop --lora-alpha (got {alpha!r})")
    if isinstance(alpha, bool):  # not a number: alpha=True ran as 1.0
        raise ValueError(f"--lora-alpha must be a finite number > 0 (got {alpha!r})")
    alpha = float(rank if alpha is None else alpha)
    if rank and not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"--lora-alpha must be a finite number > 0 (got {alpha!r})")
    return alpha


def add_low_rank(block: nn.Module, base_block: nn.Module, rank: int, alpha: float) -> None:
    """Re-parametrise every nn.Linear weight of `block` (the drafter's copy of `base_block`) as the base's own
    weight plus a rank-`rank` delta. The copy's matrices are dropped: W0 is the base block's Parameter object.
    Every matrix takes rank `rank`, as peft's LoRA does: where it exceeds a matrix's smaller dimension (nanochat's
    value-embedding gate, n_kv_head x 12) that delta is rank-deficient, not an error; a rank above every
    matrix's smaller dimension is refused (no delta of the block could use it)."""
    base_linears = dict(base_block.named_modules())
    linears = [(name, lin) for name, lin in block.named_modules() if isinstance(lin, nn.Linear)]
    widest = max((min(lin.weight.shape) for _, lin in linears), default=0)
    if rank > widest:
        raise ValueError(f"--lora-rank {rank} exceeds the smaller dimension of every matrix of the block (at most "
                         f"{widest}): give a smaller rank, or --lora-rank 0 for full suffix weights")
    for name, lin in linears:
        if lin.bias is not None:
            raise ValueError(f"LoRA drafters cover bias-free linear layers (the Llama family); {name} has a bias: "
                             "adapt full suffix weights (--lora-rank 0)")
        W0 = base_linears[name].weight
        lin.weight = W0  # the base's own (frozen) Parameter: no copy
        parametrize.register_parametrization(lin, "weight", LowRankDelta(W0.shape[0], W0.shape[1], rank, alpha, W0))


def is_shared_key(key: str) -> bool:
    """True for a state-dict entry of a LoRA drafter that is the base's own weight (not the drafter's)."""
    return key.endswith(".parametrizations.weight.original")


def shares_low_rank_base(block: nn.Module, base_block: nn.Module) -> bool:
    """True when every parametrized linear of `block` re-parametrises `base_block`'s own weight (W0 is the same
    Parameter object), i.e. the deltas apply to this base."""
    base_linears = dict(base_block.named_modules())
    return all(lin.parametrizations.weight.original is base_linears[name].weight
               for name, lin in block.named_modules() if parametrize.is_parametrized(lin, "weight"))


def merge_low_rank(block: nn.Module) -> None:
    """Replace every low-rank parametrized linear of `block` by a plain nn.Linear holding its merged weight (a new
    Parameter). W0, the base's, is untouched: torch's remove_parametrizations(leave_parametrized=True) would write
    the merged value INTO it, and removing a parametrization edits the parametrized class that deep copies share."""
    for name, lin in list(block.named_modules()):
        if isinstance(lin, nn.Linear) and parametrize.is_parametrized(lin, "weight"):
            with torch.no_grad():
                merged = lin.weight.detach().clone()  # (out, in) = W0 + scale * B @ A
            plain = nn.Linear(merged.shape[1], merged.shape[0], bias=False, device="meta")
            plain.weight = nn.Parameter(merged, requires_grad=lin.parametrizations.weight[0].A.requires_grad)
            parent, _, leaf = name.rpartition(".")
            setattr(block.get_submodule(parent) if parent else block, leaf, plain)

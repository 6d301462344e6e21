"""The compiled training step: the loss module (model, CE, the SNLP regulariser's K=1 solve or the SNLP-forward
SFT solve) under one `torch.compile(fullgraph=True, dynamic=False)` graph, as nanochat compiles its model.

AOTAutograd traces forward and backward together, so `loss.backward()` outside the call runs the compiled backward.
What keeps it ONE graph, traced once per run:
  - static shapes: pretraining batches are always (batch_size, seq_len); SFT batches are padded to a fixed length
    by their job (snlp.train.sft);
  - lambda is a graph input: a 0-dim device tensor updated in place each micro-batch (`fill_`, no host-to-device
    copy, which would be a sync), so --reg-warmup's ramp changes a value, not a guard; whether the regulariser
    runs is fixed by the run's RegConfig (`TrainStep.forward`);
  - no host syncs inside: the solves run with check_finite=False (the trainer checks the loss every step), and
    the model skips its token-range check while compiling;
  - fullgraph=True: a graph break is an error, not a silent slowdown.
bf16 autocast on CUDA is entered around the call (snlp.train.precision), fp32 on CPU. The optimizers: AdamW's
fused multi-tensor kernel and Muon's Newton-Schulz iterations compiled, both on CUDA only (`compile_optimizers`).

Refused (a ValueError before any work): the DiagN regulariser and SFT plans that cannot run as one graph (a
`tol` stop test is a host decision every iteration; DiagN's probe generator and Newton's JVP do not trace), the
same rule as compiled decoding (snlp.decode.steps.check_compilable).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from snlp.decode.steps import check_compilable
from snlp.method.surrogates import DiagN, Newton
from snlp.train.muon import Muon, zeropower_stacked, zeropower_via_newtonschulz
from snlp.train.regularizer import RegConfig

RECOMPILE_LIMIT = 64  # dynamo's per-code-object limit (default 8): each TrainStep instance compiled (the bench's
#                       plain and regularised steps of several models) is one entry of TrainStep.forward's cache


def check_compile(reg: RegConfig, plan=None) -> None:
    """Raise a ValueError naming the setting when the step cannot be compiled into one graph."""
    if reg.active and isinstance(reg.surrogate, (DiagN, Newton)):
        raise ValueError(f"--compile with --reg {reg.kind}: the DiagN regulariser's probe generator does not trace "
                         f"into one graph; use --reg idn / hcn, or train without --compile")
    if plan is not None:
        try:
            check_compilable(plan)
        except ValueError as e:
            raise ValueError(f"--compile with --forward {plan}: {e}") from None


class CompiledStep:
    """`module(x, y, lam) -> (loss, ce, reg)` (a TrainStep) compiled whole. Called like the module: lam a float,
    written into the graph's lambda input. `wrap` wraps the compiled module (DDP under torchrun: DDP around the
    compiled step, since dynamo cannot trace DDP's own forward into one graph: its bucket rebuild is a graph break;
    the gradients are all-reduced by DDP's hooks as in eager). `backend`: another torch.compile backend (tests:
    torch._dynamo.testing.CompileCounterWithBackend("inductor") counts the graphs dynamo hands inductor). The
    first call and its backward compile (the backward lazily, at the first `backward()`): callers time that step
    apart."""

    def __init__(self, module: nn.Module, device, backend=None, wrap=None):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        compiled = torch.compile(module, fullgraph=True, dynamic=False, backend=backend or "inductor")
        self.fn = wrap(compiled) if wrap is not None else compiled
        self.lam = torch.zeros((), dtype=torch.float32, device=device)

    def __call__(self, x: Tensor, y: Tensor, lam: float, valid: Tensor | None = None, share: Tensor | None = None):
        self.lam.fill_(lam)
        if valid is None:  # share by keyword: the 4th positional input of a padded step is `valid`
            return self.fn(x, y, self.lam) if share is None else self.fn(x, y, self.lam, share=share)
        return self.fn(x, y, self.lam, valid) if share is None else self.fn(x, y, self.lam, valid, share)

    def no_sync(self):
        """DDP's no_sync (gradient accumulation; only with a DDP `wrap`)."""
        return self.fn.no_sync()


def compile_optimizers(opts, device) -> None:
    """On CUDA, compile what pays in the optimizer step there (nanochat compiles the same): Muon's Newton-Schulz
    iterations (5 x 3 GEMMs per matrix and the element-wise work between them, which inductor fuses; one graph per
    distinct matrix shape; stacked, snlp.train.muon.zeropower_stacked, one call per shape). On a CPU they stay
    eager: GEMM-bound there and not measured to pay; (measured on a CPU with native bf16) the compiled bf16
    iterations also round differently from oneDNN's, ~1 % of the update apart, each ~1 % from the fp32 result.
    AdamW gets its fused kernel where it is built (snlp.train.optim.build_optimizers, CUDA)."""
    if torch.device(device).type != "cuda":
        return
    for o in opts:
        if isinstance(o, Muon):
            o.orthogonalize = torch.compile(zeropower_via_newtonschulz, fullgraph=True, dynamic=False)
            o.orthogonalize_stacked = torch.compile(zeropower_stacked, fullgraph=True, dynamic=False)

"""The optimisers and the LR schedule: Muon/AdamW parameter groups, a stateless LR multiplier written into
every param group each step (so resume needs no scheduler state) and the run's progress fraction."""

from __future__ import annotations

import torch

from snlp.model.gpt import GPT
from snlp.train.config import TrainConfig
from snlp.train.muon import Muon


def build_optimizers(model: GPT, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """AdamW for embeddings, lm_head and scalars; Muon (snlp.train.muon: torch.optim.Muon's step) or AdamW for the 2-D
    block matrices. LRs are nanochat's, scaled by (width/768)^-0.5 for the AdamW embedding groups.
    The mHC coefficient parameters (blocks.*.hc_*: tiny H biases, projections, gates) go to AdamW.
    Every param group records its peak LR as "base_lr"; `set_lr` scales it each step."""
    scale = (model.config.n_embd / 768) ** -0.5
    hc = [p for name, p in model.blocks.named_parameters() if ".hc_" in name]
    matrices = [p for name, p in model.blocks.named_parameters() if p.dim() == 2 and ".hc_" not in name]
    vectors = [p for name, p in model.blocks.named_parameters() if p.dim() == 1 and ".hc_" not in name]
    vectors += [model.ln_f] if model.ln_f is not None else []  # Llama family: norm weights, q/k/v biases
    groups = [{"params": [model.wte.weight] + ([model.value_embeds] if hasattr(model, "value_embeds") else []),
               "lr": cfg.embedding_lr * scale}]
    if not model.config.tie_embeddings:
        groups.append({"params": [model.lm_head.weight], "lr": cfg.unembedding_lr * scale})
    if vectors:
        groups.append({"params": vectors, "lr": cfg.unembedding_lr * scale})
    if model.config.x0_residual:
        groups += [{"params": [model.x0_lambdas], "lr": cfg.scalar_lr},
                   {"params": [model.resid_lambdas], "lr": cfg.scalar_lr * 0.01}]
    # nanochat's smear gate and backout scalar: AdamW at nanochat-snlp's 0.2 (= 0.4 x its scalar LR of 0.5)
    smear = [p for name in ("smear_gate", "smear_lambda", "backout_lambda") if hasattr(model, name)
             for p in ([getattr(model, name)] if name != "smear_gate" else [model.smear_gate.weight])]
    if smear:
        groups.append({"params": smear, "lr": cfg.scalar_lr * 0.4})
    if hc:
        groups.append({"params": hc, "lr": cfg.hc_lr})
    known = {id(p) for g in groups for p in g["params"]} | {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in known]
    if rest:
        raise ValueError(f"{len(rest)} parameters have no optimizer group")
    for g in groups:  # --freeze-prefix: frozen parameters are not optimised
        g["params"] = [p for p in g["params"] if p.requires_grad]
    groups = [g for g in groups if g["params"]]
    matrices = [p for p in matrices if p.requires_grad]
    opts = []
    if cfg.optimizer == "muon" and matrices:
        # snlp.train.muon.Muon: torch.optim.Muon with the Newton-Schulz iterations in fp32 where bf16 is emulated
        # (CPUs without AVX512_BF16/AMX: torch's always-bf16 ones made a step ~20x slower than AdamW's)
        # stack=True: the matrices of each shape updated together (nanochat stacks them too): ~60 small launches per
        # matrix in the per-matrix loop, the bulk of a step's kernels at depth 32 (scripts/train_step_audit.py)
        opts.append(Muon(matrices, lr=0.02 if cfg.matrix_lr is None else cfg.matrix_lr,  # 0: frozen
                         weight_decay=cfg.weight_decay, momentum=0.95, stack=True))
    elif matrices:
        groups.append({"params": matrices, "lr": 0.003 if cfg.matrix_lr is None else cfg.matrix_lr})  # 0: frozen
    # --compile on CUDA: AdamW's fused multi-tensor kernel (nanochat's choice), same update and state dict format
    fused = cfg.compile and model.wte.weight.is_cuda
    opts.insert(0, torch.optim.AdamW(groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=cfg.weight_decay,
                                     **({"fused": True} if fused else {})))
    for o in opts:
        for g in o.param_groups:
            g["base_lr"] = g["lr"]
    return opts


class Progress:
    """Fraction of the run done: steps/total, or elapsed/budget with --minutes."""

    def __init__(self, steps: int | None, minutes: float | None):
        self.steps, self.seconds, self.step, self.elapsed = steps, (minutes * 60 if minutes else None), 0, 0.0

    @property
    def frac(self) -> float:
        fr = [self.step / self.steps] if self.steps else []
        if self.seconds:
            fr.append(self.elapsed / self.seconds)
        return min(1.0, max(fr))

    def done(self) -> bool:
        return (self.steps is not None and self.step >= self.steps) or \
            (self.seconds is not None and self.elapsed >= self.seconds)


def lr_multiplier(step: int, frac: float, warmup_steps: int, warmdown: float) -> float:
    """LR scale for optimizer step `step` (0-based) at run fraction `frac` (after nanochat's
    get_lr_multiplier): linear warm-up over `warmup_steps`, constant, then linear warm-down to 0 over
    the last `warmdown` of the run; where the two overlap (a run of fewer than warmup_steps / (1 - warmdown)
    steps) the product of both, where nanochat's takes the warm-up alone. Stateless: resume needs no scheduler
    state."""
    w = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    return w * (min(1.0, (1.0 - frac) / warmdown) if warmdown > 0 else 1.0)


def set_lr(opts, mult: float) -> None:
    for o in opts:
        for g in o.param_groups:
            g["lr"] = g["base_lr"] * mult


class OptimizerBundle:
    """Several optimizers saved as one optimizer.pt entry: a list of state dicts."""

    def __init__(self, items):
        self.items = items

    def state_dict(self):
        return [o.state_dict() for o in self.items]


# Param-group entries that say how this process computes an update, not what the update is: a resume may change the
# device and --compile (fused AdamW on CUDA), so they stay the resuming run's instead of the saved groups'
KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def load_optimizer_states(opts, states: list) -> None:
    """Load the saved state dicts (an OptimizerBundle's) into this run's optimizers. The peak LRs ("base_lr")
    stay this run's: old checkpoints lack them, and a resumed run's flags decide its schedule; so do the kernel
    choices (KERNEL_KEYS), which follow this process's device and --compile."""
    for o, s in zip(opts, states):
        bases = [g["base_lr"] for g in o.param_groups]
        # into the saved groups before loading: torch places each state's step count by the groups it loads (on the
        # parameter's device for a fused kernel, on the CPU otherwise)
        groups = [{**sg, **{k: g[k] for k in KERNEL_KEYS if k in g}} for sg, g in zip(s["param_groups"], o.param_groups)]
        o.load_state_dict({**s, "param_groups": groups})
        for g, b in zip(o.param_groups, bases):
            g["base_lr"] = b

"""An SNLP drafter adapted to a pretrained base model (issue 20; paper App. "Pretrained TinyLlama Fine-Tuning").

Post hoc, a pretrained model's K = 1 SNLP forward is a poor approximation of the model (paper, off-the-shelf
table): its suffix layers were never trained to be run from the prefix state h_S. A `Drafter` keeps the base
model unchanged as the VERIFIER and owns its own copy of the plan's suffix layers, adapted (snlp.train.adapt)
so that the plan's K-iteration SNLP forward through them matches the base's sequential forward:

    drafter.model = base's embedding, prefix blocks 0..S-1, final norm and head  (the SAME Parameter objects)
                  + adapted copies of blocks S..L-1                               (the drafter's own weights)

Nothing is attached to the base: the drafter is a second GPT module object whose prefix modules ARE the
base's, so the prefix is exact by construction and costs no memory; only the suffix blocks are extra. Its
layers keep their indices (Attention.layer_idx), so in self-speculative decoding it shares the verifier's KV
cache slot for slot (snlp.model.cache): the verifier rewrites every verified position with exact K/V.

`base_fingerprint` (snlp.model.fingerprint) records which weights the drafter was adapted from; `check(base)`
refuses any other base with a ValueError (an adapted suffix is meaningless on another model's prefix).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from snlp.method.plan import Plan
from snlp.model.fingerprint import weights_fingerprint
from snlp.model.gpt import GPT


@dataclass
class Drafter:
    """A base model's adapted SNLP drafter: `model` (prefix shared with the base, suffix its own), the `plan`
    it was adapted for, and the fingerprint of the base weights it belongs to."""

    model: GPT
    plan: Plan
    base_fingerprint: str

    @property
    def suffix_start(self) -> int:
        """S: the first suffix layer (the drafter's own blocks are S..L-1)."""
        return self.plan.prefix_len(self.model.config.n_layer)

    def suffix_state(self) -> dict[str, torch.Tensor]:
        """The drafter's own weights: the suffix blocks' state, keyed as in the model ("blocks.<l>.<name>")."""
        S = self.suffix_start
        return {f"blocks.{l}.{k}": v for l in range(S, self.model.config.n_layer)
                for k, v in self.model.blocks[l].state_dict().items()}

    def extra_bytes(self) -> int:
        """Memory the drafter adds to its base: its suffix weights (the prefix, embedding and head are shared)."""
        return sum(t.numel() * t.element_size() for t in self.suffix_state().values())

    def check(self, base: GPT, verify_weights: bool = True) -> "Drafter":
        """Raise a ValueError unless `base` is the model this drafter was adapted from (same config, same
        weights by fingerprint: `verify_weights`, which reads every weight once) and the drafter's prefix is
        that base's own (shared) modules."""
        if base.config.to_dict() != self.model.config.to_dict():
            raise ValueError(f"drafter for a {self.model.config.n_layer}-layer width-{self.model.config.n_embd} model "
                             f"cannot draft for this {base.config.n_layer}-layer width-{base.config.n_embd} model "
                             "(different config): adapt one for it with `snlp adapt`")
        fp = weights_fingerprint(base) if verify_weights else self.base_fingerprint
        if fp != self.base_fingerprint:
            raise ValueError(f"drafter was adapted from base weights {self.base_fingerprint}, but this model's "
                             f"weights fingerprint {fp}: it belongs to another model (or the model was changed "
                             "since); adapt a drafter for this one with `snlp adapt`")
        if not shares_prefix(self.model, base, self.suffix_start):
            raise ValueError("drafter's prefix is not this base's own modules: load it against the base "
                             "(snlp.io.drafter.load_drafter(DIR, base)) or build it with make_drafter(base, plan)")
        return self


    def check_plan(self, plan: Plan) -> Plan:
        """`plan` if it runs this drafter's suffix (same prefix length S and chunk layout: K, the init and the
        surrogate may differ from the plan it was adapted for), else a ValueError."""
        n = self.model.config.n_layer
        if plan.prefix_len(n) != self.suffix_start or plan.fuse != self.plan.fuse:
            raise ValueError(f"plan {plan} does not fit this drafter, adapted for {self.plan} (suffix of "
                             f"{self.plan.chunks}x{self.plan.fuse} layers from layer {self.suffix_start}): use "
                             f"{self.plan.chunks}xF{self.plan.fuse}-... or adapt a drafter for {plan}")
        return plan


def shares_prefix(drafter_model: GPT, base: GPT, S: int) -> bool:
    """True when the drafter's embedding, prefix blocks and head are the base's own Parameter objects."""
    if drafter_model.wte is not base.wte or drafter_model.lm_head is not base.lm_head:
        return False
    return all(drafter_model.blocks[l] is base.blocks[l] for l in range(S))


def drafter_model(base: GPT, S: int) -> GPT:
    """A GPT module object sharing `base`'s embedding, prefix blocks 0..S-1, final norm, head, scalars and
    buffers, with deep copies of blocks S..L-1 (the drafter's own, trainable weights). The base is untouched."""
    m = copy.copy(base)  # a new Module object whose registries are replaced below (never shared dicts)
    m._parameters = dict(base._parameters)  # ln_f, value_embeds, lambdas: shared Parameter objects
    m._buffers = dict(base._buffers)
    m._modules = dict(base._modules)
    m._non_persistent_buffers_set = set(base._non_persistent_buffers_set)
    m.__dict__["_forward_hooks"] = type(base._forward_hooks)()
    m.__dict__["_forward_pre_hooks"] = type(base._forward_pre_hooks)()
    blocks = list(base.blocks)
    m.blocks = nn.ModuleList(blocks[:S] + [copy.deepcopy(b) for b in blocks[S:]])
    m.ve_slot = list(base.ve_slot)
    return m


def make_drafter(base: GPT, plan: Plan | str, fingerprint: str | None = None) -> Drafter:
    """The unadapted drafter of `base` for `plan` (its suffix = copies of the base's own suffix layers, so it
    starts as the post-hoc SNLP forward of the base). `fingerprint`: the base's weights_fingerprint if already
    computed (it reads every weight once)."""
    plan = Plan.parse(plan) if isinstance(plan, str) else plan
    plan.check_model(base.config)
    if base.config.hc_streams:
        raise ValueError("drafters are built for plain residual-stream models (pretrained Llama-family checkpoints); "
                         "this model uses mHC (hc_streams > 0): train it with the SNLP regulariser instead")
    S = plan.prefix_len(base.config.n_layer)
    return Drafter(model=drafter_model(base, S), plan=plan, base_fingerprint=fingerprint or weights_fingerprint(base))


def suffix_parameters(drafter: Drafter) -> list[nn.Parameter]:
    """The drafter's own (adaptable) parameters: those of its suffix blocks."""
    return [p for l in range(drafter.suffix_start, drafter.model.config.n_layer)
            for p in drafter.model.blocks[l].parameters()]

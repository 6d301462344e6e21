"""An SNLP drafter adapted to a pretrained base model (paper App. "Pretrained TinyLlama Fine-Tuning").

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

A LoRA drafter (`rank` > 0, snlp.method.lowrank) does not even copy the suffix matrices: each is the base's
own weight plus a trained rank-r delta (merged into `.weight` by a parametrization, so fusion sees W0 + BA);
it adds only the deltas and the suffix norm weights.

`base_fingerprint` (snlp.model.fingerprint) records which weights the drafter was adapted from; `check(base)`
refuses any other base with a ValueError (an adapted suffix is meaningless on another model's prefix).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from snlp.method.lowrank import add_low_rank, check_rank, is_shared_key, merge_low_rank, shares_low_rank_base
from snlp.method.plan import Plan
from snlp.model.fingerprint import precision_note, same_weights, weights_fingerprint
from snlp.model.gpt import GPT


@dataclass
class Drafter:
    """A base model's adapted SNLP drafter: `model` (prefix shared with the base, suffix its own), the `plan`
    it was adapted for, and the fingerprint of the base weights it belongs to. `rank` > 0: the suffix matrices
    are the base's plus rank-`rank` deltas of scale `alpha / rank` (snlp.method.lowrank); 0: full copies."""

    model: GPT
    plan: Plan
    base_fingerprint: str
    rank: int = 0
    alpha: float = 0.0

    @property
    def suffix_start(self) -> int:
        """S: the first suffix layer (the drafter's own blocks are S..L-1)."""
        return self.plan.prefix_len(self.model.config.n_layer)

    def suffix_state(self) -> dict[str, torch.Tensor]:
        """The drafter's own weights: the suffix blocks' state, keyed as in the model ("blocks.<l>.<name>"); for a
        LoRA drafter the deltas ("...parametrizations.weight.0.A/B") and norm weights, not the base's matrices."""
        S = self.suffix_start
        return {f"blocks.{l}.{k}": v for l in range(S, self.model.config.n_layer)
                for k, v in self.model.blocks[l].state_dict().items() if not is_shared_key(k)}

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
        if verify_weights and not same_weights(fp, self.base_fingerprint):  # tolerant of casts (fingerprint.py)
            note = precision_note(next(self.model.blocks[self.suffix_start].parameters()).dtype, base.wte.weight.dtype)
            if note:  # the documented fp16-vs-bf16 exception (snlp.model.fingerprint), not another model
                raise ValueError(f"drafter's base weights fingerprint {self.base_fingerprint} does not match this "
                                 f"model's {fp}{note}")
            raise ValueError(f"drafter was adapted from base weights {self.base_fingerprint}, but this model's "
                             f"weights fingerprint {fp}: it belongs to another model (or the model was changed "
                             "since); adapt a drafter for this one with `snlp adapt`")
        if not shares_prefix(self.model, base, self.suffix_start):
            raise ValueError("drafter's prefix is not this base's own modules: load it against the base "
                             "(snlp.io.drafter.load_drafter(DIR, base)) or build it with make_drafter(base, plan)")
        if self.rank and not all(shares_low_rank_base(self.model.blocks[l], base.blocks[l])
                                 for l in range(self.suffix_start, base.config.n_layer)):
            raise ValueError("LoRA drafter's deltas sit on another model's suffix matrices, not this base's own: load "
                             "it against the base (snlp.io.drafter.load_drafter(DIR, base))")
        return self


    def check_plan(self, plan: Plan) -> Plan:
        """`plan` if it runs this drafter's suffix (same prefix length S and chunk layout: K, the init and the
        surrogate may differ from the plan it was adapted for) as the function it was adapted through (`causal`
        drops the suffix windows: the weights were fitted with or without them), else a ValueError."""
        n = self.model.config.n_layer
        if plan.prefix_len(n) != self.suffix_start or plan.fuse != self.plan.fuse:
            raise ValueError(f"plan {plan} does not fit this drafter, adapted for {self.plan} (suffix of "
                             f"{self.plan.chunks}x{self.plan.fuse} layers from layer {self.suffix_start}): use "
                             f"{self.plan.chunks}xF{self.plan.fuse}-... or adapt a drafter for {plan}")
        if plan.causal != self.plan.causal:
            raise ValueError(f"plan {plan} does not fit this drafter, adapted for {self.plan}: its suffix was adapted "
                             f"{'with' if self.plan.causal else 'without'} -causal (the windows dropped or kept), "
                             f"{'add' if self.plan.causal else 'drop'} -causal or adapt a drafter for {plan}")
        return plan

    def merged(self) -> "Drafter":
        """This drafter with plain suffix weights (LoRA deltas merged into copies; the base is untouched), e.g. to
        export it. A full-weight drafter is returned as is."""
        if not self.rank:
            return self
        m = drafter_model(self.model, self.suffix_start)  # copies of the suffix blocks, parametrizations included
        for block in m.blocks[self.suffix_start:]:
            merge_low_rank(block)
        return Drafter(model=m, plan=self.plan, base_fingerprint=self.base_fingerprint)


def shares_prefix(drafter_model: GPT, base: GPT, S: int) -> bool:
    """True when the drafter's embedding, prefix blocks and head are the base's own Parameter objects."""
    if drafter_model.wte is not base.wte or drafter_model.lm_head is not base.lm_head:
        return False
    return all(drafter_model.blocks[l] is base.blocks[l] for l in range(S))


def drafter_model(base: GPT, S: int, rank: int = 0, alpha: float = 0.0) -> GPT:
    """A GPT module object sharing `base`'s embedding, prefix blocks 0..S-1, final norm, head, scalars and
    buffers, with deep copies of blocks S..L-1 (the drafter's own, trainable weights); `rank` > 0: the copies'
    linear weights are the base's own plus rank-`rank` deltas instead. The base is untouched."""
    m = copy.copy(base)  # a new Module object whose registries are replaced below (never shared dicts)
    m._parameters = dict(base._parameters)  # ln_f, value_embeds, lambdas: shared Parameter objects
    m._buffers = dict(base._buffers)
    m._modules = dict(base._modules)
    m._non_persistent_buffers_set = set(base._non_persistent_buffers_set)
    m.__dict__["_forward_hooks"] = type(base._forward_hooks)()
    m.__dict__["_forward_pre_hooks"] = type(base._forward_pre_hooks)()
    blocks = list(base.blocks)
    m.blocks = nn.ModuleList(blocks[:S] + [copy.deepcopy(b) for b in blocks[S:]])
    if rank:
        for own, theirs in zip(m.blocks[S:], blocks[S:]):
            add_low_rank(own, theirs, rank, alpha)
    m.ve_slot = list(base.ve_slot)
    return m


def make_drafter(base: GPT, plan: Plan | str, fingerprint: str | None = None, rank: int = 0,
                 alpha: float | None = None) -> Drafter:
    """The unadapted drafter of `base` for `plan` (its suffix = copies of the base's own suffix layers, so it
    starts as the post-hoc SNLP forward of the base). `fingerprint`: the base's weights_fingerprint if already
    computed (it reads every weight once). `rank` > 0: LoRA deltas of that rank (alpha default: rank) on the
    base's own suffix matrices instead of copies."""
    alpha = check_rank(rank, alpha)
    plan = Plan.parse(plan)
    plan.check_model(base.config)
    if base.config.hc_streams:
        raise ValueError("drafters are built for plain residual-stream models (pretrained Llama-family checkpoints); "
                         "this model uses mHC (hc_streams > 0): train it with the SNLP regulariser instead")
    S = plan.prefix_len(base.config.n_layer)
    return Drafter(model=drafter_model(base, S, rank, alpha), plan=plan,
                   base_fingerprint=fingerprint or weights_fingerprint(base), rank=rank, alpha=alpha if rank else 0.0)


def drafter_from_model(base: GPT, tuned: GPT, plan: Plan | str, fingerprint: str | None = None) -> Drafter:
    """The drafter of `base` for `plan` whose suffix layers are `tuned`'s: e.g. the paper's route, `snlp train
    --init-from BASE --reg idn --freeze-prefix`, which fine-tunes a copy of the model with the SNLP regulariser.
    `tuned` must be `base` with only the suffix changed (same config; embedding, prefix blocks, final norm and
    head equal: `--freeze-prefix S --unembedding-lr 0`), else its suffix would draft from a prefix state, or into a
    head, it was not trained with: a ValueError."""
    d = make_drafter(base, plan, fingerprint)
    if tuned.config.to_dict() != base.config.to_dict():
        raise ValueError("the fine-tuned model has another architecture than the base; a drafter needs the base's")
    own = tuned.state_dict()
    suffix = set(d.suffix_state())
    changed = [k for k, v in base.state_dict().items() if k not in suffix and not torch.equal(v, own[k].to(v))]
    if changed:
        raise ValueError(f"the fine-tuned model differs from the base outside the suffix of {d.plan} ({len(changed)} "
                         f"tensors, e.g. {changed[0]}): fine-tune with the prefix frozen (`snlp train --freeze-prefix "
                         f"{d.suffix_start}`) and the final norm and head too (`--unembedding-lr 0`), so that its "
                         "suffix drafts from the base's own prefix state into the base's own head")
    with torch.no_grad():
        for k, v in d.suffix_state().items():
            v.copy_(own[k])
    return d


def suffix_parameters(drafter: Drafter) -> list[nn.Parameter]:
    """The drafter's own (adaptable) parameters: those of its suffix blocks (a LoRA drafter: the deltas and norm
    weights, never the base's matrices under them)."""
    return [p for l in range(drafter.suffix_start, drafter.model.config.n_layer)
            for k, p in drafter.model.blocks[l].named_parameters() if not is_shared_key(k)]

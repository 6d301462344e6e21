"""`bench --decode --share-weights` binds every plan shared: with plans over different suffixes its "+shared" rows
must time drafters that read ONE copy of the weights, the model's own."""

from __future__ import annotations

import pytest
from conftest import make_model

from snlp.bench.decode import decode_benchmark, draft_runners, storage_bytes
from snlp.method.plan import Plan

pytestmark = pytest.mark.usefixtures("one_thread")

PLANS = ("4xF1-h0-K1", "2xF1-h0-K1", "3xF1-h0-K2")  # suffixes of 4, 2 and 3 of 5 layers


def _suffix_bytes(m, chunks: int) -> int:
    """Bytes of the last `chunks` layers' parameters: what one unshared drafter copies (fp64 model)."""
    return sum(p.numel() * p.element_size() for b in m.blocks[-chunks:] for p in b.parameters())


def test_shared_drafters_over_different_suffixes_add_no_weight_storage():
    m = make_model(seed=4, n_layer=5)
    own = storage_bytes(m)
    assert own == sum(p.numel() * p.element_size() for p in m.parameters())  # one storage per parameter
    plans = [Plan.parse(p) for p in PLANS]
    shared = draft_runners(m, [(p, True) for p in plans])
    assert storage_bytes(m, shared.values()) == storage_bytes(m)  # one copy: the model's
    gate = next(b.attn.ve_gate.weight for b in m.blocks if b.attn.ve_gate is not None)
    no_ve = sum(b.attn.ve_gate is None for b in m.blocks)  # the gates' home has zero rows for these layers
    assert storage_bytes(m) == own + no_ve * gate.numel() * gate.element_size()
    copied = draft_runners(m, [(p, False) for p in plans])
    # each unshared drafter holds its own suffix copy (the VE gates' zero rows aside): the measure sees copies
    assert storage_bytes(m, copied.values()) >= own + sum(_suffix_bytes(m, p.chunks) for p in plans) * 0.9


def test_decode_benchmark_with_shared_weights_leaves_one_copy_of_every_layer():
    m = make_model(seed=4, n_layer=5)
    rows = decode_benchmark(m, [Plan.parse(p) for p in PLANS[:2]], prompt_len=3, new_tokens=3, blocks=(2,),
                            warmup=0, runs=1, share_weights=True)
    assert {r.mode for r in rows} == {"sequential", "snlp", "speculative"}
    for name in ("attn.c_q.weight", "mlp.c_fc.weight", "attn.ve_gate.weight"):
        ptrs = {b.get_parameter(name).untyped_storage().data_ptr() for b in m.blocks if b.attn.ve_gate is not None
                or "ve_gate" not in name}
        assert len(ptrs) == 1, name  # every layer's tensor lives in one home, not one stack per plan

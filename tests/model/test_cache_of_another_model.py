"""A KV cache passed by a library caller (`model(idx, cache=c)`, `snlp.parallel_forward(..., cache=c)`,
`runner(idx, c)`) must be one of this model's shape, dtype and device: otherwise one ValueError naming what differs,
before any layer runs. Without the check a cache of another model either failed deep inside the attention (a reshape
or dtype error naming neither the cache nor the model) or, with more layers or more KV heads than the model has,
ran on without a word."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

import snlp
from snlp.model.cache import KVCache

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return make_model(n_layer=6)


@pytest.mark.parametrize("other, match", [
    (dict(n_layer=8), "8 layers"),                    # ran on before: the two extra slots never written
    (dict(n_kv_head=2), "2 KV heads"),                 # ran on before: the writes broadcast over the 2nd head
    (dict(n_layer=4), "4 layers"),                     # an IndexError from inside the cache write before
    (dict(n_embd=32, n_head=2), "1 KV heads of dim 16"),           # an expand error from inside the attention before
])
@pytest.mark.parametrize("call", ["model", "parallel_forward", "runner"])
def test_a_cache_of_another_model_is_refused(model, other, match, call):
    cache = KVCache.for_model(make_model(**other), batch=1, max_len=16)
    idx = torch.tensor([[3, 1, 4, 1, 5]])
    run = {"model": lambda: model(idx, cache=cache),
           "parallel_forward": lambda: snlp.parallel_forward(model, idx, "4xF1-h0-K2", cache=cache),
           "runner": lambda: snlp.bind(model, "4xF1-h0-K2")(idx, cache)}[call]
    with torch.no_grad(), pytest.raises(ValueError, match=f"KV cache of another model: {match}"):
        run()
    assert cache.length == 0  # refused before anything was written or advanced


@pytest.mark.parametrize("kw, match", [(dict(dtype=torch.float32), "dtype torch.float32"),
                                       (dict(device="meta"), "device meta")])
def test_a_cache_of_another_dtype_or_device_is_refused(model, kw, match):
    cache = KVCache.for_model(model, batch=1, max_len=16, **kw)
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        model(torch.tensor([[3, 1, 4]]), cache=cache)


def test_the_models_own_cache_still_decodes_as_the_full_forward(model):
    idx = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    cache = KVCache.for_model(model, batch=1, max_len=16)
    with torch.no_grad():
        parts = torch.cat([model(idx[:, :4], cache=cache), model(idx[:, 4:], cache=cache)], 1)
        torch.testing.assert_close(parts, model(idx), rtol=0, atol=1e-6)


@pytest.mark.parametrize("call", ["model", "parallel_forward", "runner"])
def test_a_cache_in_the_autocast_dtype_decodes_under_autocast(call):
    """Under bf16 autocast an fp32 model's attention computes its K/V in bf16, so a bf16 cache
    (KVCache.for_model(model, dtype=torch.bfloat16)) is the model's own: the cached calls equal the full forward
    under the same autocast. Outside autocast the same cache is still refused."""
    model = make_model(n_layer=6, dtype=torch.float32)
    idx = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    cache = KVCache.for_model(model, batch=1, max_len=16, dtype=torch.bfloat16)
    runner = snlp.bind(model, "3xF2-h0-K3")
    step = {"model": lambda x: model(x, cache=cache),
            "parallel_forward": lambda x: snlp.parallel_forward(model, x, "3xF2-h0-K3", cache=cache),
            "runner": lambda x: runner(x, cache)}[call]
    full = {"model": model, "parallel_forward": lambda x: snlp.parallel_forward(model, x, "3xF2-h0-K3"),
            "runner": runner}[call]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        parts = torch.cat([step(idx[:, :4]), step(idx[:, 4:])], 1)
        torch.testing.assert_close(parts, full(idx), rtol=0, atol=1e-6)
    with torch.no_grad(), pytest.raises(ValueError, match="dtype torch.bfloat16"):
        model(idx, cache=KVCache.for_model(model, batch=1, max_len=16, dtype=torch.bfloat16))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16), pytest.raises(ValueError, match="dtype"):
        model(idx, cache=KVCache.for_model(model, batch=1, max_len=16, dtype=torch.bfloat16))

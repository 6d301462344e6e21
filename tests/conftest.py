"""Shared fixtures: tiny random models whose blocks are NOT identities (the product's init zeroes the
output projections, which would make every SNLP law hold trivially)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from snlp import GPT, GPTConfig


@pytest.fixture
def one_thread():
    """Run single-threaded: the tiny models' thousands of small ops only gain contention from intra-op
    threads (10-50x slower on a busy 2-core box). Use via `pytestmark = pytest.mark.usefixtures(...)`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_model(seed: int = 0, dtype=torch.float64, scale: float = 0.3, **cfg) -> GPT:
    base = dict(vocab_size=61, n_layer=6, n_head=2, n_kv_head=1, n_embd=16, sequence_len=32,
                window_pattern="SL", short_window=3)
    base.update(cfg)
    model = GPT(GPTConfig(**base))
    model.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model.to(dtype).eval()


def tokens(model: GPT, B: int = 2, T: int = 9, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (B, T), generator=gen)


@st.composite
def configs(draw, min_layers: int = 2, max_layers: int = 7):
    """Random small nanochat configs: x0 / VE / GQA / sliding windows on and off."""
    n_kv = draw(st.sampled_from([1, 2]))
    n_head = n_kv * draw(st.sampled_from([1, 2]))
    return dict(
        n_layer=draw(st.integers(min_layers, max_layers)),
        n_head=n_head, n_kv_head=n_kv, n_embd=n_head * draw(st.sampled_from([4, 8])),
        x0_residual=draw(st.booleans()), value_embeds=draw(st.booleans()),
        window_pattern=draw(st.sampled_from(["L", "SL", "SSL", "S"])),
        short_window=draw(st.integers(1, 4)),
    )

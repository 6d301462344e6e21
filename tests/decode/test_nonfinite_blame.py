"""NaN/inf logits met while SNLP-decoding are blamed on where they came from: the model's own head or layers
(its sequential forward, the outside reference, gives them too) or the plan's solver state."""

import pytest
import torch

from snlp import SNLPDivergenceError, sequential_generate, snlp_generate
from snlp.decode.session import NonFiniteModelError
from snlp.model.gpt import GPT, GPTConfig


def overflowing_head_model() -> GPT:
    """fp16, no softcap, an lm_head whose logits exceed fp16's 65504 on every token: the head overflows, the layers
    do not."""
    m = GPT(GPTConfig.from_depth(4, width=32, head_dim=16, vocab_size=61, sequence_len=32, softcap=0.0))
    m.init_weights(seed=0)
    with torch.no_grad():
        m.lm_head.weight.normal_(0, 1, generator=torch.Generator().manual_seed(0)).mul_(3e4)
    return m.half().eval()


def test_exact_plan_on_an_overflowing_head_names_the_head_not_the_plan():
    m = overflowing_head_model()
    prompt = [1, 5, 7, 3]
    with torch.inference_mode():  # the outside reference: the model's own forward, layer after layer
        h = m.hidden_states(torch.tensor([prompt]))[-1]
        assert torch.isfinite(h).all() and not torch.isfinite(m(torch.tensor([prompt]))[0, -1]).all()
    assert len(sequential_generate(m, prompt, max_new_tokens=3).tokens) == 3  # it reads argmax off inf logits
    for prompts in (prompt, [prompt, prompt[:3]]):  # one prompt, and a ragged batch
        with pytest.raises(NonFiniteModelError, match=r"under plan 4xF1-h0-K4, and so do the model's own: its final "
                           r"hidden state is finite but its head .*no logit softcap.*overflows.*the plan is not the "
                           r"cause") as e:
            snlp_generate(m, prompts, "4xF1-h0-K4", max_new_tokens=3)
        assert not isinstance(e.value, SNLPDivergenceError) and "try more iterations" not in str(e.value).lower()


def test_a_diverging_plan_on_a_finite_model_is_still_the_plans():
    from conftest import blowup_model  # its sequential forward is finite; the Newton step overflows

    m = blowup_model(61, sequence_len=64)
    with pytest.raises(SNLPDivergenceError, match=r"come from the solver's state \(the model's own forward gives "
                       r"finite logits here\)"):
        snlp_generate(m, [3, 1, 4, 1, 5, 9], "8xF1-h0-K1-newton", max_new_tokens=3)

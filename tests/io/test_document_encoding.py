"""Training and evaluation documents are read as text: a special token's string quoted in a document ("<|bos|>" in a
file about tokenizers) is encoded as the bytes it is with our BPE, as nanochat's pretraining loader encodes it
(tiktoken `encode_ordinary`), never as the document separator or a chat marker. A converted tokenizer reads
documents as transformers' tokenizer(text) does. Caches written by the old reading are not served again."""

from __future__ import annotations

import numpy as np
import pytest

from snlp.io import data as D
from snlp.io.tokenizer import Tokenizer

QUOTED = "the separator is <|bos|> and a reply ends at <|assistant_end|>; <|user_start|>hi<|user_end|> too."


@pytest.fixture(scope="module")
def bpe():
    return Tokenizer.train(["plain words about tokenizers and separators " * 40, QUOTED * 3], vocab_size=300)


def test_own_bpe_documents_hold_no_special_id_but_the_separator(bpe, tmp_path):
    docs = [QUOTED, "x" + QUOTED, "no markers here"]
    tokens = D.tokenize_to_memmap(docs, bpe, tmp_path / "t.bin")
    specials = {bpe.token_id(t) for t in ("<|bos|>", "<|assistant_end|>", "<|user_start|>", "<|user_end|>")}
    ids = np.asarray(tokens).tolist()
    seps = [i for i, t in enumerate(ids) if t == bpe.bos_id]
    assert len(seps) == len(docs) and seps[0] == 0  # one separator per document, nothing forged
    assert not (set(ids) - {bpe.bos_id}) & specials
    bounds = seps + [len(ids)]
    assert [bpe.decode(ids[a + 1:b]) for a, b in zip(bounds, bounds[1:])] == docs  # the text, byte for byte


def test_own_bpe_cache_name_changed_with_the_reading(bpe, tmp_path):
    train, val = D.token_paths("k", bpe, tmp_path)
    assert bpe.fingerprint() in train.name and f"k-{bpe.fingerprint()}.train.bin" != train.name


def test_converted_tokenizer_reads_documents_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    from conftest import word_tokenizer

    hf = word_tokenizer(97)
    tok = Tokenizer.from_hf(hf)
    text = f"t3 {hf.eos_token} t7"
    assert tok.encode_documents([text]) == [hf(text, add_special_tokens=False)["input_ids"]]
    assert tok.documents_key == tok.fingerprint()
    del transformers

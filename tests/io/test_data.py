"""Data sources, the document split, the token cache and batch determinism."""

import itertools
import json
import os
import sys

import numpy as np
import pytest
import torch

from snlp.io import data as D
from snlp.io.tokenizer import Tokenizer


def test_stdlib_default_needs_no_files():
    docs = list(itertools.islice(D.documents("stdlib"), 5))
    assert len(docs) == 5 and all(d.strip() for d in docs)
    assert docs == list(itertools.islice(D.documents(None), 5))  # default, deterministic order
    assert all("test" not in f.parts for f in D.stdlib_files()[:50])


def test_local_files_folders_globs(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n".join(f"paragraph {i} " + "x" * 500 for i in range(30)))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("hello world")
    rows = [{"text": "json doc one"}, {"text": "json doc two"}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    docs_a = list(D.documents(str(tmp_path / "a.txt")))
    assert len(docs_a) > 2 and all(len(d) >= D.DOC_CHARS for d in docs_a[:-1])  # cut at blank lines
    assert "".join(docs_a).count("paragraph") == 30
    folder = list(D.documents(str(tmp_path)))
    assert folder[:len(docs_a)] == docs_a and "json doc two" in folder and "hello world" in folder
    assert list(D.documents(str(tmp_path / "*.jsonl"))) == ["json doc one", "json doc two"]
    combo = list(D.documents(f"{tmp_path / 'c.jsonl'},{tmp_path / 'sub'}"))
    assert combo == ["json doc one", "json doc two", "hello world"]
    assert len(list(D.documents(str(tmp_path), max_chars=10))) == 1
    k1 = D.source_key(str(tmp_path))
    (tmp_path / "sub" / "b.md").write_text("hello world, changed")
    assert D.source_key(str(tmp_path)) != k1  # keyed by file sizes/mtimes


def test_text_field_and_parquet(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"content": "abc"}) + "\n")
    with pytest.raises(ValueError, match="text field 'text'.*--text-field"):
        list(D.documents(str(tmp_path / "d.jsonl")))
    assert list(D.documents(str(tmp_path / "d.jsonl"), text_field="content")) == ["abc"]
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        list(D.documents(str(tmp_path / "bad.jsonl")))
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["p one", "p two"]}), tmp_path / "e.parquet")
    assert list(D.documents(str(tmp_path / "e.parquet"), text_field="body")) == ["p one", "p two"]
    with pytest.raises(ValueError, match="no text column 'text'"):
        list(D.documents(str(tmp_path / "e.parquet")))


def test_empty_and_unknown_sources(tmp_path):
    with pytest.raises(ValueError, match="unknown data source .*nope"):
        list(D.documents(str(tmp_path / "nope.txt")))
    with pytest.raises(ValueError, match="glob .* matched no files"):
        list(D.documents(str(tmp_path / "*.zzz")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no text files"):
        list(D.documents(str(tmp_path / "empty")))
    (tmp_path / "blank.txt").write_text("   \n\n  ")
    with pytest.raises(ValueError, match="no non-empty documents"):
        D.split_documents(list(D.documents(str(tmp_path / "blank.txt"))), 0.1)
    with pytest.raises(ValueError, match="hf:NAME"):
        list(D.documents("hf:"))


def test_hf_source_without_datasets():
    if "datasets" in sys.modules or _has("datasets"):
        pytest.skip("datasets installed; offline behaviour tested elsewhere")
    with pytest.raises(ValueError, match=r"pip install 'snlp\[hf\]'"):
        list(D.documents("hf:roneneldan/TinyStories"))


def _has(mod):
    import importlib.util
    return importlib.util.find_spec(mod) is not None


def test_split_cache_and_batches(tmp_path):
    docs = [f"document number {i} " * 20 for i in range(40)]
    train, val = D.split_documents(docs, 0.1)
    assert len(val) == 4 and len(train) == 36 and not set(train) & set(val)
    assert D.split_documents(docs, 0.1) == (train, val)
    tok = Tokenizer.train(docs, 300)
    td = D.load_tokens(train, val, tok, "k", tmp_path)
    assert td.train.dtype == np.uint16 and td.train[0] == tok.bos_id
    assert int((np.asarray(td.val) == tok.bos_id).sum()) == 4  # bos before each document
    assert tok.decode(np.asarray(td.val[1:20])).startswith("document number 9")
    ptrain, _ = D.token_paths("k", tok, tmp_path)
    mtime = ptrain.stat().st_mtime_ns
    td2 = D.load_tokens([], [], tok, "k", tmp_path)  # cache hit: nothing re-tokenized
    assert ptrain.stat().st_mtime_ns == mtime and np.array_equal(td2.train, td.train)
    x, y = D.batch_at(td.train, 3, 16, 4, seed=0)
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    x0, _ = D.batch_at(td.train, 3, 16, 2, seed=0, rank=0, world=2)
    x1, _ = D.batch_at(td.train, 3, 16, 2, seed=0, rank=1, world=2)
    assert torch.equal(torch.cat([x0, x1]), x)  # DDP ranks split the same global batch
    assert not torch.equal(D.batch_at(td.train, 4, 16, 4, seed=0)[0], x)
    vb = D.val_batches(td.val, 16, 2, 3)
    assert 1 <= len(vb) <= 3 and vb[0][0].shape == (2, 16)
    with pytest.raises(ValueError, match="--seq-len"):
        D.batch_at(td.val[:10], 0, 16, 1, seed=0)


def test_converted_tokenizers_differing_only_in_their_separator_get_their_own_token_caches(tmp_path):
    """A converted tokenizer's document separator (its BOS, else its EOS) is in tokenizer_meta.json, not in
    tokenizer.json: a base model and its Instruct model share the file (SmolLM2-135M: <|endoftext|> / <|im_start|>),
    so the cache key must tell them apart, or the second model is scored on the first one's stream."""
    from snlp.eval.data import validation_tokens

    docs = [f"document number {i} " * 20 for i in range(40)]
    src = tmp_path / "docs.txt"
    src.write_text("\n\n".join(docs))
    own = Tokenizer.train(docs, 300)
    meta = {"eos_token": None, "chat_template": None}
    a = Tokenizer(own.tok, {**meta, "bos_token": "<|bos|>"})
    b = Tokenizer(own.tok, {**meta, "bos_token": "<|user_start|>"})
    assert a.bos_id != b.bos_id
    cache = tmp_path / "cache"
    va = validation_tokens(a, data=str(src), cache_dir=cache)
    vb = validation_tokens(b, data=str(src), cache_dir=cache)
    _, val = D.split_documents(list(D.documents(str(src))), 0.05)
    ref = [i for d in val for i in [b.bos_id] + b.encode(d)]  # the stream written out: separator, then the text
    assert vb.tolist() == ref and va.tolist() != ref
    assert D.token_paths("k", a, cache) != D.token_paths("k", b, cache)
    assert own.fingerprint() == Tokenizer(own.tok).fingerprint()  # our BPE's key, hence its old caches, unchanged


def test_a_relative_spec_and_its_absolute_spelling_share_one_cache_key(tmp_path, monkeypatch):
    """`snlp train --data d/a.txt` run from its folder, `snlp eval` reading the checkpoint's absolute record, and the
    speedrun's tokenizer stage name one token cache; stdlib's, hf:'s and absolute specs' keys stay what they were."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("hello\n" * 10)
    absolute = f"{tmp_path / 'd' / 'a.txt'},stdlib"
    key = D.source_key(absolute)
    monkeypatch.chdir(tmp_path)
    assert D.source_key("d/a.txt,stdlib") == key and D.source_key("./d/../d/a.txt, stdlib") == key
    assert D.source_key("d/*.txt,stdlib") != key  # a glob is another spec (it may match other files later)
    assert D.missing_parts("d/a.txt,nope.txt,hf:x,stdlib,e/*.txt") == ["nope.txt", "e/*.txt"]
    # the key of an absolute spec is the one every earlier snlp wrote: the parts as given, then the files
    import hashlib

    h = hashlib.sha256(json.dumps([D.parts(absolute), "text", 0]).encode())
    for part in D.parts(absolute):
        for f in D.resolve_files(part):
            st = f.stat()
            h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    assert key == h.hexdigest()[:16]
    # an absolute spec is hashed as typed, tidy or not (a folder with a trailing slash keeps its old cache)
    folder = f"{tmp_path / 'd'}/"
    h = hashlib.sha256(json.dumps([[folder], "text", 0]).encode())
    for f in D.resolve_files(folder):
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    assert D.source_key(folder) == h.hexdigest()[:16]


def test_a_spec_through_a_symlink_and_up_names_the_file_the_os_opens(tmp_path, monkeypatch):
    """`link/../c.txt` where `link` points into another folder: the OS steps up from the link's TARGET, so the
    recorded (absolute) part, the cache key and the chat spec name that folder's c.txt, not the c.txt beside the
    link (which os.path.abspath's lexical `..` names); `d/../d/a.txt` without a link stays the plain path."""
    from snlp.io.chat import resolve_spec

    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "real" / "c.txt").write_text("what the OS reads\n\n" * 4)
    (tmp_path / "c.txt").write_text("a decoy beside the link\n\n" * 4)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    monkeypatch.chdir(tmp_path)
    with open("link/../c.txt") as f:
        assert f.read().startswith("what the OS reads")
    part = D.absolute_part("link/../c.txt")
    assert os.path.isabs(part) and os.path.samefile(part, tmp_path / "real" / "c.txt"), part
    assert D.keyed_spec("link/../c.txt,stdlib") == f"{part},stdlib"
    assert resolve_spec("chat:link/../c.txt,hf:x") == f"chat:{part},hf:x"
    assert D.source_key("link/../c.txt") == D.source_key(part) != D.source_key(str(tmp_path / "c.txt"))
    assert next(D.documents(part)).startswith("what the OS reads")
    assert D.absolute_part("real/sub/../c.txt") == str(tmp_path / "real" / "c.txt")  # no link: lexical, as before
    assert D.absolute_part(f"{tmp_path}/./real//c.txt") == str(tmp_path / "real" / "c.txt")


def test_a_files_signature_names_each_file_within_its_part_and_the_record_keeps_the_key_form(tmp_path, monkeypatch):
    for sub, text in (("a", "alpha"), ("b", "omega")):
        (tmp_path / "d" / sub).mkdir(parents=True)
        (tmp_path / "d" / sub / "x.txt").write_text(text)
    sig = D.files_signature(f"{tmp_path / 'd'},stdlib")
    assert sig == [[["a/x.txt", 5], ["b/x.txt", 5]], "stdlib"]  # two files of one name: told apart, in order
    monkeypatch.chdir(tmp_path)
    assert D.keyed_spec("d,stdlib") == f"{tmp_path / 'd'},stdlib"  # relative: absolute
    assert D.keyed_spec(f"{tmp_path / 'd'}/") == f"{tmp_path / 'd'}/"  # absolute: as typed, so its cache key holds
    assert D.source_key(D.keyed_spec(f"{tmp_path / 'd'}/")) == D.source_key(f"{tmp_path / 'd'}/")


@pytest.mark.parametrize("val_frac", [0.5, 0.3, 0.05])
def test_the_split_holds_out_every_round_one_over_val_frac_th_document(val_frac):
    """Against a naive loop: document i is validation where (i + 1) is a multiple of round(1 / val_frac)."""
    docs = [f"d{i}" for i in range(40)]
    every = round(1 / val_frac)
    train, val = D.split_documents(docs, val_frac)
    assert val == [d for i, d in enumerate(docs) if (i + 1) % every == 0]
    assert train == [d for d in docs if d not in val]


@pytest.mark.parametrize("val_frac", [0.6, 0.75, 0.99, 1.0, 0.0, -0.1])
def test_a_val_frac_the_split_cannot_hold_out_is_refused(val_frac):
    """Above 0.5 the stride max(2, round(1 / val_frac)) is 2: 0.6 or 0.99 held out every other document, as 0.5
    does, while `snlp eval` printed "val split 0.6" and the token cache was keyed by 0.6. Refused in one line."""
    with pytest.raises(ValueError, match=r"--val-frac must lie in \(0, 0.5\]"):
        D.split_documents([f"d{i}" for i in range(10)], val_frac)


@pytest.mark.parametrize("val_frac", [np.float32(0.05), np.float16(0.25), np.float64(0.5)])
def test_a_numpy_val_frac_is_split_as_the_python_float_it_holds(val_frac):
    """A numpy real is a number to every real-valued setting (snlp.runtime.checks.number_error), and the split reads
    it by arithmetic alone; check_val_frac took only Python int / float, so np.float32(0.05) was refused as "must lie
    in (0, 0.5], got 0.05000000074505806". Reference: the split of float(val_frac)."""
    docs = [f"d{i}" for i in range(40)]
    assert D.split_documents(docs, val_frac) == D.split_documents(docs, float(val_frac))


@pytest.mark.parametrize("val_frac", [True, "0.1", None, np.bool_(True)])
def test_a_val_frac_that_is_no_number_is_refused(val_frac):
    with pytest.raises(ValueError, match=r"--val-frac must lie in \(0, 0.5\]"):
        D.check_val_frac(val_frac)

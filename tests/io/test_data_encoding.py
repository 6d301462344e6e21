"""Local text data is decoded strictly: bytes that are not text in the given encoding are refused naming the
file, the byte offset and the option that names the encoding, never replaced by U+FFFD (a Latin-1 corpus used
to train on replacement characters, random bytes trained and evaluated without a word)."""

import random

import pytest

from snlp.apps.cli import main
from snlp.io import data as D

LATIN1 = ("Le café est très bon, la crème brûlée aussi.\n\n" * 300).encode("latin-1")


def test_latin1_corpus_is_refused_naming_file_offset_and_option(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_bytes(b"plain ascii first line\n" + LATIN1)
    off = len(b"plain ascii first line\nLe caf")
    with pytest.raises(ValueError, match=rf"corpus\.txt is not utf-8 text: byte 0xe9 at offset {off} \(line 2\).*"
                       r"--data-encoding latin-1"):
        list(D.documents(str(f)))
    docs = list(D.documents(str(f), encoding="latin-1"))  # the encoding named: read as the outside decoder reads it
    want = (b"plain ascii first line\n" + LATIN1).decode("latin-1")
    assert "".join(docs).replace("\n\n", "") == want.replace("\n\n", "")
    assert "\ufffd" not in "".join(docs)
    # the encoding is part of the cache key (a UTF-8 key is unchanged from before)
    assert D.split_key(str(f)) != D.split_key(str(f), encoding="latin-1")


def test_jsonl_line_that_does_not_decode_is_named(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"rows\.jsonl is not utf-8 text: byte 0xe9 at offset 30 \(line 2\)"):
        list(D.documents(str(f)))
    assert list(D.documents(str(f), encoding="latin-1")) == ["fine", "café"]


def test_random_bytes_are_refused_as_binary_even_with_an_encoding(tmp_path):
    f = tmp_path / "noise.txt"
    f.write_bytes(random.Random(0).randbytes(200_000))
    for enc in ("utf-8", "latin-1"):
        with pytest.raises(ValueError, match=r"noise\.txt holds a NUL byte at offset \d+: it is binary"):
            list(D.documents(str(f), encoding=enc))


def test_snlp_train_refuses_before_any_work(tmp_path, capsys):
    f = tmp_path / "corpus.txt"
    f.write_bytes(LATIN1)
    rc = main(["train", "--out", str(tmp_path / "run"), "--data", str(f), "--cache-dir", str(tmp_path / "cache"),
               "--depth", "2", "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "corpus.txt is not utf-8 text" in err and "--data-encoding" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_binary_prompts_file_is_named_before_the_model_loads(tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"hello\n\xff\xfe bad\n")
    rc = main(["generate", str(tmp_path / "no-such-ckpt"), "--prompts-file", str(f)])
    err = capsys.readouterr().err
    assert rc == 2 and "prompts.txt is not utf-8 text: byte 0xff at offset 6 (line 2)" in err
    assert "--prompts-encoding" in err

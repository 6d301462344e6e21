"""Checkpoint and tokenizer round trips, and clear errors on corrupt / mismatched files."""

import json

import pytest
import torch

import snlp
from snlp.io.checkpoint import load, load_train_state, load_training, save_checkpoint
from snlp.model.gpt import GPT, GPTConfig
from snlp.io.tokenizer import SPECIAL_TOKENS, Tokenizer

TEXT = ["To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 20,
        "def f(x):\n    return x + 1  # héllo ✓\n" * 20]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(TEXT, vocab_size=300)


def tiny():
    m = GPT(GPTConfig.from_depth(2, head_dim=8, width=16, vocab_size=300, sequence_len=16))
    m.init_weights(seed=0)
    return m


def test_tokenizer_roundtrip(tok, tmp_path):
    assert tok.vocab_size == 300 and tok.bos_id == 0
    for s in SPECIAL_TOKENS:
        assert tok.token_id(s) < len(SPECIAL_TOKENS)
    text = "Whether 'tis nobler ✓ 日本語\n\tx"
    assert tok.decode(tok.encode(text)) == text
    tok.save(tmp_path)
    tok2 = Tokenizer.load(tmp_path)
    assert tok2.encode(text) == tok.encode(text) and tok2.fingerprint() == tok.fingerprint()
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer.train(TEXT, vocab_size=100)
    with pytest.raises(FileNotFoundError):
        Tokenizer.load(tmp_path / "nope")


@pytest.mark.parametrize("ids, match", [
    ([5, 300], r"^token id 300 is not in the tokenizer's vocabulary \(300 tokens\)"),  # was dropped silently
    ([5, 10 ** 6], r"^token id 1000000 is not in the tokenizer's vocabulary"),
    ([5, -1], r"^token id -1 is not in the tokenizer's vocabulary"),  # an OverflowError from inside tokenizers
    ([5, 6.0], r"^token ids must be integers \(got 6.0"),  # was truncated by int()
    ([True], r"^token ids must be integers \(got True"),  # was the id 1
])
def test_decode_refuses_ids_the_tokenizer_has_no_token_for(tok, ids, match):
    with pytest.raises(ValueError, match=match) as err:
        tok.decode(ids)
    assert "\n" not in str(err.value)


def test_decode_takes_every_integer_form_alike(tok):
    import numpy as np

    ids = tok.encode("Whether 'tis nobler")
    text = tok.decode(ids)
    assert tok.decode(np.array(ids)) == tok.decode(torch.tensor(ids)) == tok.decode([np.int32(i) for i in ids]) == text
    assert tok.decode([299]) == tok.tok.decode([299])  # the last id of the vocabulary is still one


@pytest.mark.parametrize("text", [b"Whether 'tis nobler", 5, None, ["Whether"]])
def test_encode_of_anything_but_a_str_is_one_line_naming_it(tok, text):
    """encode / encode_plain of bytes, an int, None or a list gave tokenizers' TypeError "TextInputSequence must be
    str", which names neither the method nor what it was given."""
    for what in ("encode", "encode_plain"):
        with pytest.raises(ValueError, match=rf"^Tokenizer\.{what} takes a str, got {type(text).__name__}") as err:
            getattr(tok, what)(text)
        assert "\n" not in str(err.value)


def test_decode_of_one_id_is_its_text_as_transformers_decodes_it(tok):
    """decode of a 0-d tensor (a sampled token, `logits.argmax()`) or an int gave torch's "iteration over a 0-d
    tensor" / "'int' object is not iterable"; transformers' tokenizer.decode takes one id as its text. Reference:
    transformers' PreTrainedTokenizerFast over the same tokenizer (a copy). A 2-D batch is refused in one line."""
    import numpy as np
    import transformers
    from tokenizers import Tokenizer as HFTok

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=HFTok.from_str(tok.tok.to_str()))
    ids = tok.encode("Whether 'tis nobler")
    for i in ids[:3]:
        for one in (i, torch.tensor(i), np.int64(i), np.array(i)):
            assert tok.decode(one) == hf.decode(one) == tok.decode([i]), one
    assert tok.decode(torch.tensor(ids)) == hf.decode(torch.tensor(ids))
    for bad, match in ((torch.tensor([ids, ids]), "one sequence of token ids, got a 2-D"),
                       (torch.tensor(5.0), "token ids must be integers"), (5.0, "decode takes token ids"),
                       (None, "decode takes token ids")):
        with pytest.raises(ValueError, match=match) as err:
            tok.decode(bad)
        assert "\n" not in str(err.value)


def test_roundtrip_and_atomic_overwrite(tok, tmp_path):
    m = tiny()
    path = tmp_path / "ck"
    assert snlp.save_checkpoint is save_checkpoint and snlp.load is load
    save_checkpoint(path, m, tok)
    (path / "log.jsonl").write_text("{}\n")
    with torch.no_grad():
        m.lm_head.weight.add_(1.0)
    save_checkpoint(path, m, tok)  # overwrite: keeps foreign files, leaves no temp dirs
    assert (path / "log.jsonl").read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    m2, tok2 = load(path)
    assert not m2.training and m2.config == m.config
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k
    assert tok2.encode("to be") == tok.encode("to be")
    x = torch.randint(0, 300, (1, 8))
    torch.testing.assert_close(m2(x), m.eval()(x))
    assert load(path / "model.safetensors")[0].config == m.config  # a file inside the dir also works
    assert load_training(path) == (None, None)
    save_checkpoint(tmp_path / "bare", m)  # no tokenizer
    assert load(tmp_path / "bare")[1] is None


def test_errors(tok, tmp_path):
    m = tiny()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(tmp_path / "missing")
    path = save_checkpoint(tmp_path / "ck", m, tok)
    w = path / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match="model.safetensors"):
        load(path)
    w.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load(path)
    w.write_bytes(data)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "n_embd": 32, "n_head": 4}))
    with pytest.raises(ValueError, match="do not match"):
        load(path)
    (path / "config.json").write_text(json.dumps({**cfg, "bogus": 1}))
    with pytest.raises(ValueError, match="unknown GPTConfig fields"):
        load(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load(path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load(path)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load(path)
    (path / "tokenizer.json").unlink()
    (path / "train_state.pt").write_bytes(b"\x80\x02junk")
    with pytest.raises(ValueError, match="train_state.pt"):
        load_training(path)
    big = save_checkpoint(tmp_path / "big", GPT(GPTConfig.from_depth(2, head_dim=8, width=16, vocab_size=261)))
    tok.save(big)  # another model's tokenizer put beside it (save_checkpoint refuses the pair itself)
    with pytest.raises(ValueError, match="tokenizer belongs to another model"):
        load(tmp_path / "big")


def test_a_runs_settings_are_read_without_its_optimizer_states(tok, tmp_path):
    """load_train_state reads train_state.pt alone (readers of a run's settings: eval, --resume's checks, SFT's
    base split), so it never pays for, or trips over, optimizer.pt; load_training still reads and checks both."""
    path = save_checkpoint(tmp_path / "ck", tiny(), tok, train_state={"step": 3, "args": {"data": "x"}})
    assert load_train_state(path) == {"step": 3, "args": {"data": "x"}}
    (path / "optimizer.pt").write_bytes(b"garbage")
    assert load_train_state(path)["step"] == 3
    with pytest.raises(ValueError, match="corrupt or truncated .*optimizer.pt"):
        load_training(path)
    (path / "train_state.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt or truncated .*train_state.pt"):
        load_train_state(path)
    assert load_train_state(save_checkpoint(tmp_path / "bare", tiny(), tok)) is None


def test_a_folder_that_is_no_checkpoint_is_named_for_what_it_is(tok, tmp_path):
    """`snlp eval runs/speedrun` (the speedrun's folder), a drafter folder, any other folder: the error says what
    the folder is and what to give instead, and advises re-training only a checkpoint that lost its config."""
    sr = tmp_path / "speedrun"
    for name in ("noreg", "idn"):
        save_checkpoint(sr / name, tiny(), tok)
    (sr / "stages").mkdir()
    with pytest.raises(FileNotFoundError, match=r"not a checkpoint but a folder holding 2: .*idn, .*noreg; give one"):
        load(sr)
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "drafter.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"is a drafter \(snlp adapt\), not a checkpoint.*--drafter"):
        load(d)
    (tmp_path / "other").mkdir()
    with pytest.raises(FileNotFoundError, match=r"is not a checkpoint \(no config.json or model.safetensors\)") as e:
        load(tmp_path / "other")
    assert "re-train" not in str(e.value)
    (sr / "noreg" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json; it is incomplete"):
        load(sr / "noreg")


def test_load_refuses_a_device_this_machine_lacks_before_reading_the_files(tok, tmp_path, monkeypatch):
    """snlp.load(dir, device=...) names the bad device in one line (torch's own error lists twenty back-ends, or
    asserts 'Torch not compiled with CUDA enabled' after the weights were read)."""
    path = save_checkpoint(tmp_path / "ck", tiny(), tok)
    import snlp.io.checkpoint as C

    monkeypatch.setattr(C, "load_file", lambda *a, **k: pytest.fail("the weights were read before the refusal"))
    with pytest.raises(ValueError, match=r"^device='cdu' is not a device: use cpu, cuda, cuda:N or mps$"):
        load(path, device="cdu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device=cuda requested but CUDA is not available; use device=cpu"):
            load(path, device="cuda")


def test_save_checkpoint_refuses_what_is_no_snlp_model_or_tokenizer_and_leaves_nothing_behind(tok, tmp_path):
    with pytest.raises(TypeError, match="tokenizer must be an snlp Tokenizer"):
        save_checkpoint(tmp_path / "ck", tiny(), "gpt2")
    with pytest.raises(TypeError, match="not an snlp GPT"):
        save_checkpoint(tmp_path / "ck", torch.nn.Linear(2, 2))
    # a write that fails midway (an unpicklable train_state) removes its temporary folder
    with pytest.raises(Exception):
        save_checkpoint(tmp_path / "ck", tiny(), tok, train_state={"f": lambda: 0})
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_save_checkpoint_refuses_a_tokenizer_larger_than_the_models_vocabulary(tok, tmp_path):
    """A model of 100 ids saved with a 300-token tokenizer was written without a word, and `load` refused the
    checkpoint afterwards ("the tokenizer belongs to another model"): the save now refuses, and writes nothing."""
    small = GPT(GPTConfig.from_depth(2, head_dim=8, width=16, vocab_size=100, sequence_len=16))
    with pytest.raises(ValueError, match="tokenizer has 300 tokens but the model's vocab_size is 100"):
        save_checkpoint(tmp_path / "ck", small, tok)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    load(save_checkpoint(tmp_path / "ok", tiny(), tok))  # the model's own vocabulary: saved and loaded


def test_decode_can_mark_ids_without_a_token_and_keep_the_rest(tok):
    ids = tok.encode("Whether 'tis nobler")
    text = tok.decode(ids)
    marked = tok.decode(ids[:2] + [300] + ids[2:] + [-1], mark_missing=True)
    assert marked == tok.decode(ids[:2]) + "<|no token 300|>" + tok.decode(ids[2:]) + "<|no token -1|>"
    assert tok.decode(ids, mark_missing=True) == text
    with pytest.raises(ValueError, match="must be integers"):
        tok.decode([1.0], mark_missing=True)  # only missing ids are marked, never a non-integer


def test_a_marked_id_keeps_the_decoders_spacing_around_it():
    """A SentencePiece-style (Metaspace) decoder strips the leading space of a text's first word: a marker spliced
    between pieces decoded apart lost the space of the word after it ('hello<|no token 99|>world')."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers

    t = HF(models.WordLevel({"<unk>": 0, "▁hello": 1, "▁world": 2, "▁again": 3}, unk_token="<unk>"))
    t.pre_tokenizer, t.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok = Tokenizer(t, meta={})
    assert tok.decode([1, 2, 3]) == "hello world again"
    assert tok.decode([1, 99, 2, 3], mark_missing=True) == "hello<|no token 99|> world again"
    assert tok.decode([99, 1, 2, 99], mark_missing=True) == "<|no token 99|>hello world<|no token 99|>"

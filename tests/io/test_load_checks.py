"""A checkpoint's weights are checked once, at load: a NaN or inf tensor is named there, before any decoding or
evaluation blames a plan for it."""

import pytest
import torch

from snlp.apps.cli import main
from snlp.io.checkpoint import load, save_checkpoint
from snlp.io.tokenizer import Tokenizer
from snlp.model.gpt import GPT, GPTConfig


def tiny():
    m = GPT(GPTConfig.from_depth(2, head_dim=8, width=16, vocab_size=300, sequence_len=16))
    m.init_weights(seed=0)
    return m


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_named_at_load(tmp_path, bad, capsys):
    m = tiny()
    with torch.no_grad():
        m.blocks[1].mlp.c_fc.weight[3, 2] = bad
    tok = Tokenizer.train(["the quick brown fox jumps over the lazy dog\n"] * 20, vocab_size=300)
    save_checkpoint(tmp_path / "ck", m, tok)
    with pytest.raises(ValueError, match=r"blocks\.1\.mlp\.c_fc\.weight .*holds "
                       + ("1 NaN and 0 inf" if bad != bad else "0 NaN and 1 inf")):
        load(tmp_path / "ck")
    # the command line refuses before decoding (it printed <|bos|> eight times and exited 0)
    rc = main(["generate", str(tmp_path / "ck"), "--prompt", "the", "--max-new-tokens", "8"])
    err = capsys.readouterr().err
    assert rc == 2 and "blocks.1.mlp.c_fc.weight" in err and len(err.strip().splitlines()) == 1


def test_finite_weights_load_unchanged(tmp_path):
    m = tiny()
    save_checkpoint(tmp_path / "ck", m)
    m2, _ = load(tmp_path / "ck")
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k

"""Commands that need a checkpoint's tokenizer refuse one without it before its weights are read (a large model's
load was spent on a run that could not start)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_model

import snlp.io.checkpoint as checkpoint
from snlp.apps.cli import main
from snlp.io.checkpoint import save_checkpoint


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A checkpoint saved without a tokenizer."""
    path = tmp_path_factory.mktemp("bare") / "ckpt"
    model = make_model(seed=0, dtype=torch.float32, vocab_size=64, n_layer=2, n_head=2, n_embd=16, sequence_len=32)
    save_checkpoint(path, model)
    return path


@pytest.mark.parametrize("argv, why", [
    (["tune", "{c}"], "`snlp tune` needs it for the calibration text"),
    (["generate", "{c}", "--prompt", "hello"], "save it with one to use `snlp generate`"),
    (["analyze", "{c}", "--out", "{d}"], "validation tokens cannot be made"),
    (["calibrate", "{c}", "--data", "train", "--out", "{o}"], "use random-token calibration (no --data)"),
    (["eval", "{c}", "--plans", "1xF1-h0-K1"], "`snlp eval` needs it to tokenize the validation data"),
    (["train", "--init-from", "{c}", "--out", "{d}", "--steps", "1"], "fine-tuning needs the model's tokenizer"),
])
def test_a_command_refuses_a_checkpoint_without_a_tokenizer_before_its_weights_load(bare, tmp_path, monkeypatch,
                                                                                     capsys, argv, why):
    reads = []
    real = checkpoint.load_file
    monkeypatch.setattr(checkpoint, "load_file", lambda *a, **k: reads.append(a) or real(*a, **k))
    argv = [a.format(c=bare, o=tmp_path / "pre.pt", d=tmp_path / "analysis") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"has no tokenizer.json: {why}" in err[-1] and reads == []


def test_calibrate_without_data_needs_no_tokenizer(bare, tmp_path):
    assert main(["calibrate", str(bare), "--out", str(tmp_path / "pre.pt"), "--rank", "2", "--batch", "2",
                 "--seq-len", "8"]) == 0


@pytest.mark.parametrize("argv", [["tune", "{c}"], ["generate", "{c}", "--prompt", "hello"],
                                  ["analyze", "{c}", "--out", "{d}"],
                                  ["calibrate", "{c}", "--data", "train", "--out", "{o}"]])
@pytest.mark.parametrize("folder, says", [
    ({}, "is not a checkpoint (no config.json or model.safetensors)"),
    ({"config.json": '{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}'},
     "is a transformers model directory (LlamaForCausalLM), not an snlp checkpoint: convert it first"),
])
def test_a_folder_that_is_no_checkpoint_is_named_so_not_as_one_without_a_tokenizer(tmp_path, capsys, argv, folder,
                                                                                     says):
    """The tokenizer's check came before the checkpoint's: an empty folder, or a transformers model, was said to
    lack tokenizer.json (saving one there would not have made it loadable)."""
    c = tmp_path / "model"
    c.mkdir()
    for name, text in folder.items():
        (c / name).write_text(text)
    argv = [a.format(c=c, o=tmp_path / "pre.pt", d=tmp_path / "analysis") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and "tokenizer" not in err[-1], err


def test_eval_harness_refuses_a_checkpoint_without_a_tokenizer_before_its_weights_load(bare, tmp_path, monkeypatch,
                                                                                       capsys):
    """--harness is an eval mode too: it loaded the weights (snlp.eval.harness.load_any) and then refused."""
    pytest.importorskip("lm_eval")
    reads = []
    real = checkpoint.load_file
    monkeypatch.setattr(checkpoint, "load_file", lambda *a, **k: reads.append(a) or real(*a, **k))
    assert main(["eval", str(bare), "--harness", "arc_easy", "--harness-out", str(tmp_path / "h")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "has no tokenizer.json: the harness sends text" in err[-1] and reads == []


@pytest.mark.parametrize("which", ["snlp", "nanochat"])
def test_generate_without_a_prompt_on_a_checkpoint_without_a_tokenizer_says_only_the_refusal(bare, capsys, which):
    """`snlp generate CKPT` without --prompt on a checkpoint without tokenizer.json (an snlp one saved without it, or
    a nanochat checkpoint, whose tokenizer is not converted) printed "the prompt is empty: generating from the
    tokenizer's BOS alone" and then refused for want of that tokenizer: nothing was generated. Only the refusal."""
    ckpt = bare if which == "snlp" else Path(__file__).resolve().parents[1] / "data" / "nanochat" / "nanochat-L"
    assert main(["generate", str(ckpt), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no tokenizer.json" in err[0] and err[0].endswith("to use `snlp generate`"), err

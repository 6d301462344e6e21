"""A model name that is a typo of a local path is refused in one line, with the closest names beside it, by every
command that reads one; it is never sent to the Hugging Face hub (which, offline, retried for ~23 s and then spoke of
connectivity). A name written org/name with no folder org here still goes to the hub. No test touches the network:
the hub's entry point (transformers' AutoConfig.from_pretrained, the first thing snlp.io.hf asks) is replaced."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

from snlp.apps.cli import main
from snlp.io.checkpoint import save_checkpoint
from snlp.io.source import did_you_mean, is_hub_id, missing_source


class HubReached(OSError):  # what the hub client raises when it cannot fetch: snlp says so in one line
    pass


@pytest.fixture
def hub(monkeypatch):
    """transformers' AutoConfig.from_pretrained, replaced: a call records its name and raises HubReached."""
    import transformers

    calls = []

    def from_pretrained(name, *a, **k):
        calls.append(str(name))
        raise HubReached(name)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return calls


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("names") / "runs"
    model = make_model(seed=0, dtype=torch.float32, vocab_size=64, n_layer=2, n_head=2, n_embd=16, sequence_len=32)
    save_checkpoint(root / "idn-small", model)
    return root


TYPO = "{r}/idn-smal"
COMMANDS = [
    ["bench", "--ckpt", TYPO],
    ["bench", "--suite", "decode", "--quick", "--ckpt", TYPO, "--out", "{o}"],
    ["generate", TYPO, "--prompt", "hello"],
    ["eval", TYPO, "--plans", "1xF1-h0-K1"],
    ["eval", TYPO, "--harness", "hellaswag", "--harness-out", "{o}"],
    ["tune", TYPO],
    ["analyze", TYPO, "--out", "{o}"],
    ["calibrate", TYPO],
    ["convert", TYPO, "--out", "{o}"],
    ["export", TYPO, "--out", "{o}"],
    ["adapt", TYPO, "--plan", "1xF1-h0-K1", "--out", "{o}"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:3]))
def test_a_typo_of_a_local_checkpoint_is_one_line_with_the_closest_name(argv, runs, tmp_path, hub, capsys):
    out = tmp_path / "out"
    args = [a.replace("{r}", str(runs)).replace("{o}", str(out)) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"snlp {argv[0]}: error: "), err
    assert "does not exist" in err[0] and f"did you mean {runs}/idn-small?" in err[0], err[0]
    assert "?;" not in err[0], err[0]  # the question ends its sentence ('did you mean X?; train one with' before)
    assert hub == [] and not out.exists()


def test_a_hub_id_still_goes_to_the_hub(hub, tmp_path, monkeypatch, capsys):
    """org/name with no folder org here is a hub id: the rule refuses only local paths (the hub answering here)."""
    import snlp.io.hub

    monkeypatch.setattr(snlp.io.hub, "unreachable", lambda timeout=3.0: None)
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "someorg/some-model-1.5B", "--out", str(tmp_path / "o")]) == 2
    assert hub == ["someorg/some-model-1.5B"]


def test_a_hub_id_no_cache_holds_is_refused_before_the_hub_where_the_hub_is_unreachable(hub, tmp_path, monkeypatch,
                                                                                         capsys):
    import huggingface_hub.constants as hc

    import snlp.io.hub

    monkeypatch.setattr(snlp.io.hub, "unreachable", lambda timeout=3.0: "the hub (h:443) is not reachable: test")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "someorg/some-model-1.5B", "--out", str(tmp_path / "o")]) == 2
    line = capsys.readouterr().err.strip()
    assert "not in the hub cache while the hub (h:443) is not reachable: test" in line and hub == []


def test_with_hf_hub_offline_a_hub_id_missing_from_the_cache_is_refused_before_the_hub(hub, tmp_path, monkeypatch,
                                                                                        capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert main(["convert", "someorg/some-model", "--out", str(tmp_path / "o")]) == 2
    line = capsys.readouterr().err.strip()
    assert "not in the hub cache while HF_HUB_OFFLINE is set" in line and hub == []


def test_the_python_entry_refuses_the_typo_too(runs, hub):
    import snlp

    with pytest.raises(FileNotFoundError, match="did you mean"):
        snlp.from_hf(f"{runs}/idn-smal")
    assert hub == []


@pytest.mark.parametrize("name, hub_id", [
    ("Qwen/Qwen2.5-0.5B", True), ("meta-llama/Llama-3.2-1B", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
    ("gpt2", False), ("runs/idn", False), ("./org/name", False), ("/org/name", False), ("~/org/name", False),
    ("a/b/c", False), ("org/model.gguf", False), ("org/config.json", False), ("org/../name", False), ("org/", False),
])
def test_the_hub_id_rule(name, hub_id, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert is_hub_id(name) is hub_id


def test_an_existing_path_is_always_local_and_a_checkpoint_flag_takes_no_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert missing_source("org/name") is None
    assert "does not exist" in missing_source("other/name", hub=False)
    assert did_you_mean("org/nmae") == "; did you mean org/name?"


def fake_hub_cache(root, repo: str) -> None:
    """The hub cache's layout for `repo` (huggingface_hub's models--org--name/refs/main + snapshots/SHA/), holding
    a config.json: what try_to_load_from_cache finds, offline."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    d = root / f"models--{repo.replace('/', '--')}"
    (d / "refs").mkdir(parents=True)
    (d / "refs" / "main").write_text(sha)
    (d / "snapshots" / sha).mkdir(parents=True)
    (d / "snapshots" / sha / "config.json").write_text("{}")


@pytest.mark.parametrize("name", ["someorg/cached-model", "gpt2"])
def test_a_name_the_hub_cache_holds_goes_to_the_hub_however_it_is_written(name, hub, tmp_path, monkeypatch, capsys):
    """transformers loads a cached hub id from the cache, offline too: a bare `gpt2` (a hub id with no org) and an
    org/name beside a local folder `org` (e.g. one that `huggingface-cli download --local-dir org/other` made) were
    refused as typos of local paths, with the false claim that they are no hub id."""
    import huggingface_hub.constants as hc

    cache = tmp_path / "cache"
    fake_hub_cache(cache, name)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "someorg" / "other-model").mkdir(parents=True)
    assert missing_source(name, "model") is None
    assert main(["convert", name, "--out", str(tmp_path / "o")]) == 2  # the hub's entry point, replaced, raises
    assert hub == [name]
    assert "nor is it a hub id" in missing_source("someorg/not-cached", "model")  # a typo of the folder stays refused


def test_no_suggestion_of_the_name_itself(tmp_path, monkeypatch):
    """'~/ckpt' (quoted, so the shell left '~'): the loaders read it literally and find nothing, while '~/ckpt'
    expanded exists; the error said 'checkpoint ~/ckpt does not exist; did you mean ~/ckpt?'."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ckpt").mkdir()
    assert did_you_mean("~/ckpt") == ""
    assert did_you_mean("~/ckpf") == "; did you mean ~/ckpt?"


def test_a_hub_revision_is_refused_saying_revisions_are_not_read(tmp_path, monkeypatch, hub, capsys):
    """`org/name@rev` (pip's and the hub CLI's spelling) read as a missing local path: 'does not exist', no word that
    no loader here takes a revision. It is refused before the hub is asked, naming what to give instead."""
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "HuggingFaceTB/SmolLM2-135M@main", "--out", str(tmp_path / "o")]) == 2
    line = capsys.readouterr().err.strip()
    assert "a hub revision (@main) is not read here; give HuggingFaceTB/SmolLM2-135M" in line and hub == [], line

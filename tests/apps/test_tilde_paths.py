"""A path starting with `~` followed by a name that is no user (`~old/run`): pathlib's expanduser raises
RuntimeError("Could not determine home directory.") on it, so every module that expanded a path itself crashed with
a traceback where a missing path is refused in one line. Every path now goes through snlp.io.source.home_path
(a `~word` naming no user stays as typed, as the shell leaves it). One flag or entry per module."""

from __future__ import annotations

import pytest

from snlp.apps.cli import main

NOBODY = "~nosuchuser48snlp"  # no account has this name (asserted below, so the tests cannot pass by accident)


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    import pwd

    with pytest.raises(KeyError):
        pwd.getpwnam(NOBODY[1:])
    monkeypatch.chdir(tmp_path)


def refused(capsys, argv, says: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and "home directory" not in err, err


def test_data_spec(capsys):  # snlp.io.data
    refused(capsys, ["train", "--data", f"{NOBODY}/x.txt", "--depth", "2", "--steps", "1", "--out", "o"],
            f"unknown data source '{NOBODY}/x.txt'")


def test_vs_paper_checkout(capsys):  # snlp.bench.paper_peer
    refused(capsys, ["bench", "--vs-paper", f"{NOBODY}/nanochat-snlp", "--device", "cpu"],
            f"--vs-paper {NOBODY}/nanochat-snlp: not a checkout of the paper's code")


def test_decode_suite_prompts_file(capsys):  # snlp.bench.decode_suite
    refused(capsys, ["bench", "--suite", "decode", "--quick", "--prompts-file", f"{NOBODY}/p.json"],
            f"the prompts file {NOBODY}/p.json does not exist")


def test_multiple_choice_task(tmp_path):  # snlp.io.mctasks
    from snlp.io.mctasks import load_task

    with pytest.raises(ValueError, match=NOBODY):
        load_task(f"mc:{NOBODY}/q.jsonl")


def test_stop_file(capsys):  # snlp.apps.train
    refused(capsys, ["train", "--data", "stdlib", "--depth", "2", "--steps", "1", "--out", "o", "--stop-file",
                     f"{NOBODY}/STOP"], f"--stop-file {NOBODY}/STOP")


def test_out_folder(tmp_path):  # snlp.apps.cli: the folders a run would make
    from snlp.apps.cli import new_folders

    assert new_folders(f"{NOBODY}/o")[-1] == tmp_path / NOBODY


def test_recorded_cache_dir(tmp_path):  # snlp.train.checkpointing
    from snlp.train.checkpointing import recorded_args

    assert recorded_args({"cache_dir": f"{NOBODY}/c"})["cache_dir"] == str(tmp_path / NOBODY / "c")


def test_harness_model(tmp_path):  # snlp.eval.harness
    pytest.importorskip("lm_eval")
    from snlp.eval.harness import load_any

    with pytest.raises(FileNotFoundError, match=f"model {NOBODY}/ck does not exist"):
        load_any(f"{NOBODY}/ck")

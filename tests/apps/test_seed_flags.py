"""Every command's --seed is refused in one line at argument time when no run can draw with it (negative: numpy's
seed sequences take none; 2**63 and past: torch's generators take 64 bits and runs draw with seed + i), before any
checkpoint, data or model is read (generate's was refused only once the model had loaded)."""

from __future__ import annotations

import pytest

from snlp.apps.cli import build_parser, main

ARGV = {"generate": ["generate", "{ck}", "--prompt", "hi", "--temperature", "1"], "eval": ["eval", "{ck}"],
        "tune": ["tune", "{ck}"], "bench": ["bench", "--ckpt", "{ck}"], "calibrate": ["calibrate", "{ck}"],
        "analyze": ["analyze", "{ck}", "--out", "{tmp}/o"], "adapt": ["adapt", "{ck}", "--plan", "1xF1-h0-K1", "--out", "{tmp}/o"],
        "train": ["train", "--out", "{tmp}/o"], "sft": ["sft", "{ck}", "--data", "{tmp}/d.jsonl", "--out", "{tmp}/o"], "selfcheck": ["selfcheck"]}


def test_every_command_with_a_seed_is_covered():
    with_seed = {c for c, p in build_parser().commands.items() if any(a.dest == "seed" for a in p._actions)}
    assert with_seed - set(ARGV) <= {"speedrun", "sft-grid"}, with_seed - set(ARGV)


@pytest.mark.parametrize("seed", ["-1", str(2 ** 63), str(2 ** 64)])
@pytest.mark.parametrize("command", sorted(ARGV))
def test_a_seed_out_of_range_is_refused_before_any_work(command, seed, tmp_path, capsys):
    argv = [a.format(ck=tmp_path / "no-such-ckpt", tmp=tmp_path) for a in ARGV[command]]
    assert main([*argv, "--seed", seed]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"snlp {command}: error: --seed must be an integer in [0, 2**63) (got {seed}): numpy's seed "
                   f"sequences take no negative seed, torch's generators 64 bits, and runs draw with seed + i"), err
    assert not (tmp_path / "o").exists()

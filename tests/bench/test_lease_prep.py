"""scripts/lease_prep.sh carries runs/sr-idn to a GPU lease as the speedrun's IDN-Reg model: an existing folder of
other settings must be refused before anything else runs (its alpha would not be the prediction's), whatever step
count it reached. Run on a copy of the script in a temporary repository layout: nothing trains, nothing is copied."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
OWN = {"data": "stdlib", "vocab_size": 4096, "depth": 16, "width": 128, "head_dim": 32, "seq_len": 256,
       "batch_size": 8, "seed": 0, "reg": "idn", "reg_n": "12", "reg_lambda": 0.5, "steps": 444, "minutes": None}


def run_prep(tmp_path: Path, args: dict | None) -> subprocess.CompletedProcess:
    """lease_prep.sh in a fresh layout whose runs/sr-idn holds a model with train_state.pt args `args` (None: no
    training records) and a 444-step train_summary.json."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "lease_prep.sh", tmp_path / "scripts")
    (tmp_path / ".paper" / "nanochat-snlp" / "nanochat").mkdir(parents=True)
    (tmp_path / ".paper" / "nanochat-snlp" / "nanochat" / "gpt.py").write_text("")
    dst = tmp_path / "runs" / "sr-idn"
    dst.mkdir(parents=True)
    (dst / "model.safetensors").write_text("not read")
    if args is not None:
        torch.save({"args": args}, dst / "train_state.pt")
        (dst / "train_summary.json").write_text(json.dumps({"steps": 444}))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(["bash", str(tmp_path / "scripts" / "lease_prep.sh")], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("other", [{"depth": 4}, {"seed": 7}, {"reg": "none"}, {"reg_lambda": 0.1}, {"data": "x"},
                                   {"minutes": 5.0}, {"steps": 400}])
def test_a_run_of_other_settings_is_refused(tmp_path, other):
    out = run_prep(tmp_path, {**OWN, **other})
    assert out.returncode == 1 and "move it away" in out.stderr, out.stderr[-500:]


def test_a_folder_without_records_is_refused(tmp_path):
    out = run_prep(tmp_path, None)
    assert out.returncode == 1 and "move it away" in out.stderr, out.stderr[-500:]


def test_the_speedrun_settings_pass_the_check(tmp_path):
    """Its own model passes on to the next step (here the held-out prompts' script, absent from the copy)."""
    out = run_prep(tmp_path, dict(OWN))
    assert "move it away" not in out.stderr and "alpha_held_out" in out.stderr, out.stderr[-500:]

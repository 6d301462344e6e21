"""Under torchrun every rank runs the same command line, so a refusal or warning before the ranks' process group
starts was printed once per rank. Rank 0 says those; once a group has started every rank says its own errors (a
rank may then fail for a reason of its own)."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import free_port, init_gloo, spawn_ranks

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--depth", "2", "--width", "32", "--head-dim", "16", "--vocab-size", "300", "--seq-len", "16",
        "--batch-size", "2", "--steps", "1", "--no-progress", "--device", "cpu"]


def ranks_of(argv: list[str], tmp_path: Path, world: int = 2) -> list[subprocess.CompletedProcess]:
    """`python -m snlp *argv` as the `world` processes torchrun starts (its environment, one port), all at once."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, "-m", "snlp", *argv], env=env, cwd=tmp_path, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=300), *p.communicate()) for p in procs]


def test_a_refusal_before_the_process_group_is_said_by_rank_0_only(tmp_path):
    """--hc-lr without mHC streams (snlp train's own check), a value argparse refuses and a misspelt flag: each was
    the same line from both ranks. Now rank 0 says it once and both exit 2; nothing is made."""
    out = tmp_path / "run"
    for flags, said in ((["--hc-lr", "0.1"], "snlp train: error: --hc-lr sets the mHC residual streams'"),
                        (["--log-every", "x"], "invalid int value: 'x'"),
                        (["--hc-lrr", "0.1"], "unrecognized arguments: --hc-lrr 0.1")):
        r0, r1 = ranks_of(["train", "--out", str(out), "--data", "stdlib", *TINY, *flags], tmp_path)
        assert r0.returncode == r1.returncode == 2, (flags, r0.stderr, r1.stderr)
        assert said in r0.stderr and r0.stderr.count("error:") == 1, (flags, r0.stderr)  # (argparse: usage first)
        assert r1.stderr == "" and r1.stdout == "", (flags, r1.stderr)
        assert not out.exists()


def test_each_nodes_first_rank_says_a_refusal_before_the_process_group(tmp_path):
    """A multi-node launch runs one torchrun per node, each with its own terminal, and a file the flags name may be
    missing on one node only (`snlp generate CKPT --distributed` checks CKPT before any rank starts a group): only
    rank 0 spoke, so a second node's ranks exited 2 without a word there (and rank 0, on a node that has the file,
    said nothing either). The first rank of each node (LOCAL_RANK 0) now says the refusal; its other ranks stay
    silent. One process per rank of the second node: the refusal comes before any group, so no peer is needed."""
    def rank_of_node_2(local: int) -> subprocess.CompletedProcess:
        env = {**os.environ, "RANK": str(2 + local), "LOCAL_RANK": str(local), "WORLD_SIZE": "4",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        return subprocess.run([sys.executable, "-m", "snlp", "generate", str(tmp_path / "only-on-node-1"),
                               "--distributed", "--plan", "2xF1-h0-K1", "--prompt", "hi"], env=env, cwd=tmp_path,
                              text=True, capture_output=True, timeout=120)

    first, second = rank_of_node_2(0), rank_of_node_2(1)
    assert first.returncode == second.returncode == 2, (first.stderr, second.stderr)
    assert first.stderr == f"snlp generate: error: checkpoint {tmp_path / 'only-on-node-1'} does not exist\n", \
        first.stderr
    assert second.stderr == "" and second.stdout == "", second.stderr


def test_a_warning_before_the_process_group_is_said_by_rank_0_only(monkeypatch):
    """The command line's one-line warnings (cli.one_line_warning) before a group starts: rank 0's only."""
    from snlp.apps.cli import one_line_warning
    from snlp.runtime import ranks

    monkeypatch.setattr(ranks, "STARTED", [])
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    said = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        said[rank] = one_line_warning("a plan changes nothing", UserWarning, "x.py", 1)
    assert said == {"0": "snlp: warning: a plan changes nothing\n", "1": ""}
    monkeypatch.setenv("LOCAL_RANK", "0")  # rank 1 as the first process of a second node: its terminal's
    assert one_line_warning("w", UserWarning, "x.py", 1) == "snlp: warning: w\n"
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setattr(ranks, "STARTED", [True])  # after a group: this rank's own, said
    assert one_line_warning("w", UserWarning, "x.py", 1) == "snlp: warning: w\n"


def _refuse_after_the_group(rank, world, port, tmp):
    init_gloo(rank, world, port)
    from snlp.apps.cli import main

    with open(Path(tmp) / f"err{rank}.txt", "w") as f:
        stderr, sys.stderr = sys.stderr, f
        try:
            rc = main(["train", "--out", str(Path(tmp) / "run"), "--data", "stdlib", *TINY, "--hc-lr", "0.1"])
        finally:
            sys.stderr = stderr
    assert rc == 2


def test_an_error_after_the_process_group_started_is_said_by_every_rank(tmp_path):
    """Once a rank has joined a group an error may be its own, so every rank says it (the same refusal, raised in
    ranks that joined a gloo group first)."""
    spawn_ranks(_refuse_after_the_group, 2, str(tmp_path))
    for rank in range(2):
        err = (tmp_path / f"err{rank}.txt").read_text()
        assert err.startswith("snlp train: error: --hc-lr sets") and len(err.splitlines()) == 1, (rank, err)

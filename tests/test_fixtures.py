"""The shared fixtures' own invariants (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from conftest import _cache_dir


def test_the_cache_without_pytest_cache_is_one_folder_per_checkout(tmp_path):
    """Under `-p no:cacheprovider` the SmolLM2 conversion lives under the system temp folder. Two checkouts (another
    worktree, another conversion key) must not share it: a checkout clears stale conversions in its own folder only,
    never one that another checkout's run is reading."""
    def req(root):
        return SimpleNamespace(config=SimpleNamespace(cache=None, rootpath=Path(root)))

    a, b = tmp_path / "a", tmp_path / "b"
    assert _cache_dir(req(a), "snlp-fixture-test") != _cache_dir(req(b), "snlp-fixture-test")
    assert _cache_dir(req(a), "snlp-fixture-test") == _cache_dir(req(a), "snlp-fixture-test")
    for d in {_cache_dir(req(a), "snlp-fixture-test"), _cache_dir(req(b), "snlp-fixture-test")}:
        d.rmdir()

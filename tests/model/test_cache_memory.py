"""The KV cache check (snlp.model.cache.check_cache_fits) against the memory a new allocation may take
(snlp.runtime.device.free_memory_bytes): it compared one cache with the device's TOTAL memory, so on a GPU whose
memory the model (or another process) already held a cache "fit" and the allocator failed after the model loaded,
and on the CPU a container's cgroup limit was not seen. The memory probes are monkeypatched: torch's own CUDA
query on a CPU box, the cgroup files as files of a temporary folder."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

import snlp.runtime.device as D
from snlp.model.cache import KVCache, check_cache_fits

GiB = 2 ** 30


def test_a_gpu_cache_is_compared_with_free_memory_not_total(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * GiB, 80 * GiB))  # (free, total)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: GiB // 2)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)  # half a GiB torch holds unused
    assert D.free_memory_bytes("cuda:0") == 2 * GiB + GiB // 2
    shape = (8, 1, 8, 2 ** 16, 64)  # K and V of fp16: 8 x 8 x 65536 x 64 x 2 x 2 bytes = 1 GiB
    check_cache_fits(shape, torch.float16, "cuda:0")
    with pytest.raises(ValueError, match=r"^a KV cache of 196,608 positions x batch 1 needs 3.0 GiB, more than the "
                                         r"2.5 GiB free on cuda:0: ask for fewer tokens"):
        check_cache_fits((8, 1, 8, 3 * 2 ** 16, 64), torch.float16, "cuda:0")  # 3 GiB of the 80 total: refused


def test_the_cpu_takes_the_cgroup_limit_where_it_is_below_physical_memory(tmp_path, monkeypatch):
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    assert D.cgroup_memory_limit((str(v2), str(v1))) is None  # no file: no limit
    v1.write_text("9223372036854771712\n")  # v1's "no limit"
    assert D.cgroup_memory_limit((str(v2), str(v1))) is None
    v2.write_text("max\n")
    assert D.cgroup_memory_limit((str(v2), str(v1))) is None
    v2.write_text(f"{GiB}\n")
    assert D.cgroup_memory_limit((str(v2), str(v1))) == GiB
    monkeypatch.setattr(D, "CGROUP_LIMITS", (str(v2),))
    monkeypatch.setattr(D.cgroup_memory_limit, "__defaults__", ((str(v2),),))
    ram = D._physical_bytes()
    assert ram is not None and ram > GiB and D.free_memory_bytes("cpu") == GiB
    v2.write_text(f"{2 * ram}\n")  # a limit above the box's memory: the memory
    assert D.free_memory_bytes("cpu") == ram


def test_every_cache_of_a_decode_is_checked_against_the_probe_with_its_batch(monkeypatch):
    """KVCache.for_model (every decoding entry's cache) asks the probe; a batch's rows are in the one cache."""
    model = make_model(n_layer=2, dtype=torch.float32)
    c = model.config
    one = 2 * c.n_layer * c.n_kv_head * 100 * c.head_dim * 4  # K and V of 100 positions, batch 1, fp32
    monkeypatch.setattr(D, "free_memory_bytes", lambda device: 3 * one)
    assert KVCache.for_model(model, batch=3, max_len=100).batch == 3
    with pytest.raises(ValueError, match=r"a KV cache of 100 positions x batch 4 needs .* GiB of memory of cpu"):
        KVCache.for_model(model, batch=4, max_len=100)


@pytest.mark.parametrize("v2", [False, True])
def test_the_cgroup_limit_is_read_where_the_process_is_not_only_at_the_hierarchys_root(tmp_path, monkeypatch, v2):
    """Outside a cgroup namespace /proc/self/cgroup names the process's own cgroup ("4:memory:/jobs/a1"; on this
    review's box process_api/<id>), and its limit, or a parent's, binds it: only the hierarchy's root files
    (CGROUP_LIMITS, unlimited there) were read, so a 1 GiB job on a 24 GiB box was checked against the 24 GiB."""
    root, own = tmp_path / "cg", "/jobs/a1"
    base = root if v2 else root / "memory"
    name = "memory.max" if v2 else "memory.limit_in_bytes"
    for d, text in (("", "max" if v2 else "9223372036854771712"), ("jobs", str(3 * GiB)), ("jobs/a1", f"{GiB}")):
        (base / d).mkdir(parents=True, exist_ok=True)
        (base / d / name).write_text(text + "\n")
    proc = tmp_path / "cgroup"
    proc.write_text(f"0::{own}\n" if v2 else f"9:name=systemd:/\n4:memory:{own}\n0::/\n")
    monkeypatch.setattr(D, "PROC_CGROUP", str(proc), raising=False)
    monkeypatch.setattr(D, "CGROUP_ROOT", str(root), raising=False)
    monkeypatch.setattr(D, "CGROUP_LIMITS", (str(base / name),))
    assert D.cgroup_memory_limit() == GiB and D.free_memory_bytes("cpu") == GiB
    (base / "jobs/a1" / name).write_text("max\n" if v2 else "9223372036854771712\n")  # the parent's limit binds it
    assert D.cgroup_memory_limit() == 3 * GiB
    proc.write_text("0::/\n" if v2 else "4:memory:/\n")  # a namespace's root: its files, as before
    assert D.cgroup_memory_limit() is None

"""Kernel launches a profiled CPU run stands for on a GPU, from torch.profiler events.

A leaf aten op that computes (not a metadata op such as a view or an empty) is one kernel launch; a multi-tensor
aten::_foreach_* op counts once (one multi-tensor kernel on CUDA, although the CPU runs it tensor by tensor
underneath). Host syncs (aten::_local_scalar_dense) are counted apart, under "sync".
"""

from __future__ import annotations

import collections

METADATA = {"aten::as_strided", "aten::view", "aten::_reshape_alias", "aten::reshape", "aten::_unsafe_view",
            "aten::resolve_conj", "aten::resolve_neg", "aten::empty", "aten::empty_strided", "aten::empty_like",
            "aten::t", "aten::transpose", "aten::expand", "aten::detach", "aten::alias", "aten::unsqueeze",
            "aten::squeeze", "aten::permute", "aten::slice", "aten::select", "aten::unbind", "aten::split",
            "aten::lift_fresh", "aten::numpy_T", "aten::mT", "aten::_local_scalar_dense", "aten::item",
            "aten::set_", "aten::result_type", "aten::is_nonzero", "aten::detach_", "aten::view_as"}  # no kernels


def _under_foreach(e) -> bool:
    while e.cpu_parent is not None:
        e = e.cpu_parent
        if e.name.startswith("aten::_foreach_"):
            return True
    return False


def leaf_ops(prof) -> collections.Counter:
    """Kernel launches by op name of a finished torch.profiler `prof` (module docstring), host syncs under
    "sync"."""
    c = collections.Counter()
    for e in prof.events():
        if e.name == "aten::_local_scalar_dense":
            c["sync"] += 1
        if not e.name.startswith("aten::") or e.name in METADATA or _under_foreach(e):
            continue
        if e.name.startswith("aten::_foreach_") or not any(ch.name.startswith("aten::") and ch.name not in METADATA
                                                           for ch in e.cpu_children):
            c[e.name] += 1
    return c


def launches(prof) -> int:
    """Kernel launches of `prof` (leaf_ops without the host syncs)."""
    return sum(n for op, n in leaf_ops(prof).items() if op != "sync")

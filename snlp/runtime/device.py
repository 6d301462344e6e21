"""Small run-time helpers shared by the library and the command-line apps: device / dtype / thread
settings, where a run happened (for table titles), progress bars and writing JSON results. Nothing
here parses arguments; `snlp.apps.cli` only parses and dispatches."""

from __future__ import annotations

import functools
import math
import os
import platform
import sys
from pathlib import Path

# strict JSON's writing rules live in snlp.runtime.outputs (its CSV cells use them, and outputs imports nothing of
# snlp); writers import json_text from here as well
from snlp.runtime.outputs import json_text, make_folders


def write_atomic(path, write) -> None:
    """Write a file atomically: `write(tmp)` fills a temporary file beside `path` (creating parent folders), which
    then replaces `path` in one os.replace, so a reader never sees a half-written file. `write` may also be a str:
    the text to write."""
    path = Path(path)
    make_folders(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if isinstance(write, str):
            tmp.write_text(write)
        else:
            write(tmp)
        os.replace(tmp, path)
    finally:  # a failed write (a full disk) leaves neither half a file nor its temporary
        tmp.unlink(missing_ok=True)


def json_number(v) -> float:
    """The float a strict JSON file (json_safe) holds where the value was a float: null -> NaN (written for NaN),
    "inf" / "-inf" -> +-inf, a number -> itself. What a reader of a results file formats or compares: a diverged row
    read back stays diverged (NaN / inf), never 0 nor a TypeError."""
    if v is None:
        return math.nan
    if isinstance(v, str):
        if v.strip().lower() not in ("inf", "-inf", "+inf", "nan"):
            raise ValueError(f"{v!r} is not a number")
        return float(v)
    return float(v)


def json_unsafe(obj):
    """`obj` (read from strict JSON) with the "inf" / "-inf" strings json_safe wrote for infinities turned back into
    floats, at any depth; null stays None (it stood for NaN or for a value not measured alike: its reader decides,
    json_number)."""
    if isinstance(obj, str) and obj in ("inf", "-inf"):
        return float(obj)
    if isinstance(obj, dict):
        return {k: json_unsafe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_unsafe(v) for v in obj]
    return obj


def write_json(path, obj) -> None:
    """Write a command's machine-readable results (creating parent folders; strict JSON: json_text) and say where."""
    write_atomic(path, json_text(obj, indent=2))
    print(f"wrote {path}")


def cli_device(name: str, flag: str = "--device"):
    """torch.device of a --device value; a ValueError (one line, before any work) when it names no device torch
    knows (torch's own RuntimeError lists twenty back-ends in a traceback), or a CUDA device / index or MPS this
    machine does not have. `flag`: how the messages name the value (a library call passes e.g. "device=")."""
    import torch

    sep = "" if flag.endswith("=") else " "
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{flag}{sep}{name!r} is not a device: use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag}{sep}cuda requested but CUDA is not available; use {flag}{sep}cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{flag}{sep}{name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{flag}{sep}mps requested but MPS is not available; use {flag}{sep}cpu")
    if device.type not in ("cpu", "cuda", "mps"):  # xpu, hpu, meta ...: only where torch says the back-end runs here
        backend = getattr(torch, device.type, None)
        available = getattr(backend, "is_available", None)
        if device.type == "meta" or not callable(available) or not available():
            has = ["cpu"] + ["cuda"] * torch.cuda.is_available() + ["mps"] * torch.backends.mps.is_available()
            raise ValueError(f"{flag}{sep}{name}: no {device.type} device on this machine (it has {', '.join(has)}); "
                             f"use one of those")
    return device


def cli_dtype(dtype: str | None, device) -> str:
    """A --dtype value, defaulting to bfloat16 on CUDA and float32 elsewhere."""
    return dtype or ("bfloat16" if device.type == "cuda" else "float32")


def set_threads(n: int | None) -> None:
    """torch's intra-op CPU threads (None leaves the default)."""
    if n is not None:
        import torch

        if n < 1:
            raise ValueError("--threads must be >= 1")
        torch.set_num_threads(n)


# a process's memory limit: cgroup v2, then v1 (where a container mounts it, and where the host does)
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                 "/sys/fs/cgroup/memory.limit_in_bytes")
# where this process's own cgroup is named (one line per hierarchy: "0::/path" v2, "N:memory:/path" v1), and where
# the hierarchies are mounted
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"


def own_cgroup_files(proc: str | None = None, root: str | None = None) -> list[str]:
    """The memory limit files of this process's own cgroup and of each cgroup above it (a parent's limit binds its
    children too), v2 (ROOT/PATH/memory.max) and v1 (ROOT/memory/PATH/memory.limit_in_bytes), from `proc`
    (/proc/self/cgroup). Outside a cgroup namespace (a host, a service, a job runner's per-process cgroup) the
    process's cgroup is not the hierarchy's root, which CGROUP_LIMITS read: a limit there was not seen."""
    proc, root = proc or PROC_CGROUP, Path(root or CGROUP_ROOT)
    try:
        lines = Path(proc).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            base, name = root, "memory.max"
        elif "memory" in parts[1].split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        rel = Path(parts[2].strip() or "/")
        out += [str(base / d.relative_to(d.anchor) / name) for d in (rel, *rel.parents) if d.anchor]
    return list(dict.fromkeys(out))


def cgroup_memory_limit(paths=None) -> int | None:
    """This process's cgroup memory limit in bytes: the smallest limit any of `paths` holds (default: its own
    cgroup's files and its ancestors', own_cgroup_files, then CGROUP_LIMITS, a container's mount); None where there
    is none: no file, v2's "max", or v1's "no limit" (the largest page-aligned 63-bit number)."""
    limits = []
    for path in (own_cgroup_files() + list(CGROUP_LIMITS)) if paths is None else paths:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        try:
            limit = int(text)
        except ValueError:  # v2's "max", or a file that is no limit
            continue
        if 0 < limit < 2 ** 62:
            limits.append(limit)
    return min(limits, default=None)


def free_memory_bytes(device) -> int | None:
    """What a new allocation on `device` may take, in bytes: a GPU's free memory now (torch.cuda.mem_get_info: the
    model, a CUDA-graph step's kept caches and whatever else runs there are already out of it), with the blocks torch's
    caching allocator reserved and does not use; on the CPU the
    machine's physical memory, or the cgroup's limit where that is smaller (a container's share of the box). None
    where it cannot be told (another back-end, a platform without sysconf)."""
    import torch

    device = torch.device(device)
    try:
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            # plus what torch's caching allocator holds unused: free to torch, not to the driver
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            return int(torch.cuda.mem_get_info(device)[0]) + max(int(cached), 0)
        if device.type == "cpu":
            ram = _physical_bytes()
            limit = cgroup_memory_limit()
            return ram if limit is None else limit if ram is None else min(ram, limit)
    except (AssertionError, AttributeError, ValueError, OSError, RuntimeError):  # no CUDA here
        return None
    return None


@functools.lru_cache(maxsize=None)
def _physical_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def device_label(device) -> str:
    """What a benchmark ran on, for table titles: the GPU name or the CPU and its thread count."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def progress_bar(total: int, desc: str, enabled: bool = True, **tqdm_kwargs):
    """Progress on stderr (nothing unless `enabled`): on a terminal a tqdm bar that clears itself when done
    (`tqdm_kwargs`, e.g. initial / unit / leave, go to it); elsewhere (CI logs, `> file`) a
    snlp.runtime.progress.LineProgress, a plain line every 30 s and one at the end, since a tqdm bar there writes a
    '\\r' update per step. sys.stderr is read at call time, so redirections made before the call count."""
    from snlp.runtime.progress import LineProgress, is_terminal

    if enabled and not is_terminal(sys.stderr):
        return LineProgress(total, desc, sys.stderr, n=tqdm_kwargs.get("initial", 0))
    from tqdm import tqdm
    kwargs = {"leave": False, "dynamic_ncols": True, **tqdm_kwargs}
    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr, **kwargs)

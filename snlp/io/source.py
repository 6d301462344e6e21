"""Which model names are local paths and which are Hugging Face hub ids, decided before anything loads.

transformers reads any name that is not a folder as a hub id: a typo of a local folder (`runs/idnn`) then waits
on the network (offline: about 23 s of retries) and fails with a message about connectivity, where a missing
checkpoint should be named at once. The rule, the same for every command and for `snlp.from_hf`:

    a name that exists here is a local path; otherwise it is a hub id only when written `org/name` (exactly one
    '/', not starting with '.', '/' or '~', no folder `org` here, no file extension such as .gguf or .json);
    with HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set, a hub id must also be in the local hub cache. A name the
    hub cache holds is a hub id however it is written (`gpt2`, or `org/name` beside a folder `org`): transformers
    loads it from there, offline too.

Any other name is a local path that does not exist: refused in one line, with the closest names beside it.
Nothing here imports torch or transformers (the CLI asks before the library loads). The network is touched once,
for a hub id the cache lacks, to ask whether the hub can be reached at all (snlp.io.hub): unreachable, the name is
refused at once instead of after the hub client's retries.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

from snlp.io.hub import hub_offline  # noqa: F401  (read here; it lives with the probe)

# org/name as the hub spells repository ids (huggingface_hub's validate_repo_id, with the org required: every
# model family snlp converts is published under one)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# suffixes of files, never of a hub repository: a name with one is a path ("Qwen2.5-0.5B" has the suffix ".5B")
FILE_SUFFIXES = (".gguf", ".safetensors", ".json", ".pt", ".pth", ".bin", ".ckpt", ".npz", ".jsonl")


def home_path(name) -> Path:
    """`name` as a local path: a leading `~` or `~user` is that home (as the shell reads it unquoted), except where
    `name` as typed exists here, a folder named `~...` in the working directory: the library's savers
    (save_checkpoint, save_drafter, a TrainConfig's `out`) write a `~/x` they are given there, and loading what
    was saved must find it (not another checkpoint at $HOME/x). A `~word` naming no user stays as typed too
    (pathlib's expanduser raises RuntimeError there: `snlp.load("~old")` failed on a folder that exists). The CLI
    expands its path flags before any of this (snlp.apps.cli.expand_paths)."""
    text = str(name)
    if text.startswith("~") and os.path.lexists(text):
        return Path(text)
    return Path(os.path.expanduser(text))


def is_hub_id(name: str) -> bool:
    """`name` (which does not exist here) is written as a hub id by the module's rule, cache aside."""
    if not HUB_ID.fullmatch(name) or ".." in name or name.endswith("."):
        return False
    org = name.split("/", 1)[0]
    return not home_path(org).exists() and Path(name).suffix.lower() not in FILE_SUFFIXES


def in_hub_cache(name: str) -> bool:
    """The hub cache holds `name`'s config.json (read from disk; huggingface_hub comes with transformers)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - no hub client, so no cache either
        return False
    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repository id (a path with '\\', 'a/b/c'): the hub holds nothing by that name
        return False


def did_you_mean(name: str, prefix: str = "") -> str:
    """'; did you mean X?' with the names closest to `name`'s missing part in the nearest folder that exists, or ''.
    A missing folder on the path whose close name holds the rest is shown with it (`dta/a.txt`: data/a.txt). `prefix`
    (a data spec's chat: / mc:) is written before each name shown, as the user must type it."""
    path = home_path(name)
    if path.exists():  # not a typo ('~/ckpt' quoted, which a loader that does not expand '~' misses): no suggestion
        return ""
    parent, missing = path.parent, path.name
    while not parent.is_dir() and parent != parent.parent:  # the first missing part is the one to match
        parent, missing = parent.parent, parent.name
    link = parent / missing
    if link.is_symlink():  # a dangling link: the name is right (the closest name was itself), its target is gone
        return f"; {link if link != path else name} is a symlink to {os.readlink(link)}, which does not exist"
    try:
        siblings = [p.name for p in parent.iterdir() if not p.name.startswith(".")]
    except OSError:
        return ""
    close = difflib.get_close_matches(missing, siblings, n=3, cutoff=0.6)
    if not close:
        return ""
    typed = name.rstrip("/")
    if missing == path.name and typed.endswith(missing):  # the last part: keep the name as the user wrote it
        shown = [typed[:len(typed) - len(missing)] + c for c in close]
    else:
        rest = path.relative_to(parent / missing)
        whole = [str(parent / c / rest) for c in close if (parent / c / rest).exists()]
        shown = whole or [str(parent / c) for c in close]
    return f"; did you mean {' or '.join(prefix + s for s in shown)}?"


def missing_source(name, what: str = "checkpoint", hub: bool = True) -> str | None:
    """Why `name` names nothing to load (a one-line message), or None: it exists here, or (`hub`) it is a hub id by
    the rule above. `hub` False: only local paths are read (a checkpoint folder)."""
    name = str(name)
    if home_path(name).exists():
        return None
    if hub and is_hub_id(name):
        if in_hub_cache(name):
            return None
        if hub_offline():
            return (f"{what} {name} is not a path here, and as a hub id it is not in the hub cache while "
                    f"HF_HUB_OFFLINE is set{did_you_mean(name)}")
        from snlp.io.hub import unreachable

        if why := unreachable():
            return f"{what} {name} is not a path here, and as a hub id it is not in the hub cache while {why}" + \
                did_you_mean(name)
        return None
    if hub and in_hub_cache(name):  # what transformers loads from the cache (a bare `gpt2`, org/name beside `org/`)
        return None
    repo, at, rev = name.partition("@")
    if hub and at and is_hub_id(repo):  # pip's / the hub CLI's NAME@REVISION: no loader here reads a revision
        return (f"{what} {name}: a hub revision (@{rev}) is not read here; give {repo} (its default branch) or "
                f"download that revision to a folder and give the folder")
    org = name.split("/", 1)[0]
    why = ("" if not hub or name.startswith((".", "/", "~")) else
           " (nor is it a hub id: snlp reads a missing name as one only when written org/name or in the hub cache)"
           if "/" not in name else
           f" (nor is it a hub id: {org} is a folder here)" if home_path(org).is_dir() else "")
    return f"{what} {name} does not exist{why}{did_you_mean(name)}"


def check_source(name, what: str = "checkpoint", hub: bool = True) -> None:
    """Raise FileNotFoundError (one line) where missing_source says `name` names nothing to load."""
    message = missing_source(name, what, hub)
    if message:
        raise FileNotFoundError(message)

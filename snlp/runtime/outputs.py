"""Where a command writes: output paths checked before any work starts, and an output folder locked by the run
that owns it (results are written atomically by snlp.runtime.device.write_atomic).

A result that cannot be written is found out before the work that produces it (an evaluation that fails on
its --json after an hour loses the hour); a result is written to a temporary sibling and renamed, so a crash
or a full disk never leaves half a file under the real name; two runs writing one folder would interleave
their logs and overwrite each other's checkpoints, so the second is refused while the first holds the lock.
"""

from __future__ import annotations

import errno
import json
import math
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


# the folders this process made (make_folders), absolute: a run refused after making its output folders removes
# these where still empty, and no other (snlp.apps.cli.remove_empty)
CREATED: set[Path] = set()


def missing_folders(path) -> list[Path]:
    """The folders of `path` (absolute) that do not exist yet, deepest first: what making it would make."""
    folder, missing = Path(path).absolute(), []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def make_folders(path) -> Path:
    """mkdir -p `path`, recording each level this call made in CREATED: os.mkdir succeeds for the one process that
    makes a folder, so a folder another process made meanwhile (FileExistsError here) is never counted as ours."""
    path = Path(path).absolute()
    for folder in reversed(missing_folders(path)):
        try:
            os.mkdir(folder)
        except FileExistsError:
            if not folder.is_dir():
                raise
            continue
        CREATED.add(folder)
    return path


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _probe(folder: Path, what: str, path: Path) -> None:
    """Create and remove a file in `folder` (access() would not see read-only mounts, nor that root is root)."""
    if not folder.is_dir():
        raise ValueError(f"{what} {path}: {folder} is a file, not a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".snlp-write-check-", dir=folder)
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot write in {folder} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(tmp)


def check_output_file(path, what: str = "output") -> None:
    """Raise a ValueError unless a file can be written at `path` (its folder may not exist yet: then its
    nearest existing ancestor must be a writable folder). Nothing is left behind."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder; name a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{what} {path} exists and is not writable")
    _probe(_nearest_existing(path.parent), what, path)


def check_output_dir(path, what: str = "output folder") -> None:
    """Raise a ValueError unless `path` is, or can be created as, a folder that can be written in."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} exists and is a file, not a folder; choose another path")
    _probe(_nearest_existing(path), what, path)


class OutputLocked(ValueError):
    """Another live process holds the output folder's lock."""


def lock_path(folder) -> Path:
    """The lock file of an output folder: a hidden sibling, since a checkpoint save swaps the folder itself."""
    folder = Path(folder).absolute()
    return folder.parent / f".{folder.name}.lock"


@contextmanager
def locked_output(folder, what: str = "--out") -> Iterator[None]:
    """Hold an exclusive lock on output `folder` for the block (an advisory flock on its lock file, released by
    the kernel when the process ends, however it ends); a second holder is refused at once with an OutputLocked
    error naming the pid that holds it. Without fcntl (Windows) nothing is locked."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        yield
        return
    lock = lock_path(folder)
    make_folders(lock.parent)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise OutputLocked(f"{what} {folder} is in use by a run in progress (pid {holder}); wait for it "
                                   f"or choose another {what}") from None
            raise
        try:  # the lock file we hold must still be the one at `lock` (a finishing holder may have removed it)
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        try:
            os.unlink(lock)
        finally:
            os.close(fd)


def partial_line(done: str) -> str:
    """The markdown line of a result file written while its run was going: every long run rewrites its files after
    each finished part (atomically), so a run cut short (Ctrl-C, a kill, a crash, a lease that ends) keeps what it
    finished, and its JSON says "complete": false until the last part is written. `done`: what the rows are."""
    return (f"**PARTIAL**: written while the run was going (or it was cut short there): {done}; the JSON says "
            f'"complete": false')


def complete_in(paths) -> str:
    """"A and B hold its complete results": what a run's line says where a signal came after every file it writes was
    written complete (snlp.apps.cli then ends with status 0, each command's `finished`)."""
    paths = [str(p) for p in paths]
    return " and ".join(paths) + (" hold" if len(paths) > 1 else " holds") + " its complete results"


def partial_comment(done: str) -> str:
    """The first line of a CSV written while its run was going: pandas.read_csv(path, comment="#") skips it (and so
    reads the rows as it reads a finished file's: the first line is what tells them apart, snlp.bench.records.
    marked_partial), and a reader that does not skip it gets it as the header row, so its column names are wrong.
    The finished CSV has no such line. It names no JSON: a run may write its CSV alone."""
    return f"# PARTIAL: written while the run was going (or it was cut short there): {done}; the finished CSV has no " \
           "such line"


def json_safe(obj):
    """`obj` with every float JSON cannot hold replaced: NaN (a quantity not measured: alpha of a run that drafted
    nothing) by null, +-inf (a diverged PPL) by "inf" / "-inf" (as the analysis writes them; float() reads them
    back); tuples become lists. Python's json writes NaN and Infinity, which strict parsers (jq, JavaScript, Go)
    refuse, and a reader seeing null at the top level saw NaN in a nested record."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def json_text(obj, default=None, **kw) -> str:
    """JSON text of `obj` that every parser reads: non-finite floats replaced (json_safe; `default` converts the
    objects json cannot, records by their to_dict, first), then written with allow_nan=False, which raises should
    one still get through."""
    if default is not None:
        obj = json.loads(json.dumps(obj, default=default))
    return json.dumps(json_safe(obj), allow_nan=False, **kw)


def csv_cell(v):
    """The one CSV cell rule of every snlp CSV: a list or dict (window_ce, speedup_rounds, a row's `load`) as strict
    JSON (json_text: a NaN inside is null, an inf "inf"), None and NaN as an empty cell (a value
    not there: pandas reads both as NaN), anything else as csv writes it (+-inf as inf / -inf, which float() and
    pandas read back)."""
    if v is None or (isinstance(v, float) and v != v):
        return ""
    return json_text(v) if isinstance(v, (list, dict, tuple)) else v


def write_csv_rows(f, fields: list[str], rows) -> None:
    """The header and `rows` (dicts over `fields`) as CSV on the open file `f`, each cell by csv_cell. A row with a
    cell holding "#" (free text: an error a skipped row keeps) is written with its text cells quoted: a reader that
    skips partial_comment's line by pandas.read_csv(path, comment="#") would otherwise cut the cell, and the row, at
    the "#"; quoted, it keeps it. Other rows are written as csv.DictWriter's default writes them."""
    import csv

    plain = csv.DictWriter(f, fieldnames=fields)
    quoted = csv.DictWriter(f, fieldnames=fields, quoting=csv.QUOTE_NONNUMERIC)
    plain.writeheader()
    for row in rows:
        row = {k: csv_cell(v) for k, v in row.items()}
        (quoted if any(isinstance(v, str) and "#" in v for v in row.values()) else plain).writerow(row)

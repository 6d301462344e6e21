"""Training data: documents from a `--data` spec, a deterministic train/val split by document,
and a token cache (numpy memmap) so a corpus is tokenized once.

`--data` forms (comma-separated to combine):
    stdlib                    the .py sources of this Python's standard library (no network; default)
    PATH | FOLDER | GLOB      text files (split into ~4 KB documents at blank lines), .jsonl
                              (one JSON object per line, text in --text-field), .parquet (pyarrow)
    hf:NAME[:CONFIG][:SPLIT]  a Hugging Face dataset, streamed (needs the `datasets` extra)
Documents are joined with the tokenizer's bos token in front of each. Local files are decoded strictly in the
given encoding (UTF-8 by default): a byte that does not decode, or a NUL byte (binary data), is refused
naming the file and the offset, never replaced.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from snlp.io.source import did_you_mean, home_path
from snlp.runtime.checks import number_error

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text", ""}
TABLE_SUFFIXES = {".jsonl", ".parquet"}
DOC_CHARS = 4096  # plain text files are cut at blank lines into documents of at least this size
STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"}
HF_DEFAULT_CHARS = 200_000_000  # streamed sources are endless: cap them unless --max-chars says otherwise


def cache_dir() -> Path:
    """Token cache folder: $SNLP_CACHE, else $XDG_CACHE_HOME/snlp, else ~/.cache/snlp."""
    if os.environ.get("SNLP_CACHE"):
        return Path(os.environ["SNLP_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "snlp"


# ----- sources -----
def stdlib_files() -> list[Path]:
    """The standard library's .py files in sorted (deterministic) order, tests excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(f for f in root.rglob("*.py") if not STDLIB_SKIP & set(f.relative_to(root).parts))


def resolve_files(spec: str) -> list[Path]:
    """Local files named by one spec part (file, folder or glob); ValueError if none."""
    if spec == "stdlib":
        files = stdlib_files()
        if not files:
            raise ValueError(f"no standard-library .py files found under {sysconfig.get_paths()['stdlib']}; "
                             f"pass --data PATH")
        return files
    p = home_path(spec)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES | TABLE_SUFFIXES
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not files:
            raise ValueError(f"data folder {p} holds no text files (looked for *{', *'.join(sorted(TEXT_SUFFIXES | TABLE_SUFFIXES - {''}))})")
        return files
    if glob.has_magic(spec):
        files = sorted(Path(f) for f in glob.glob(str(home_path(spec)), recursive=True) if Path(f).is_file())
        if not files:
            raise ValueError(f"data glob {spec!r} matched no files")
        return files
    head, rest = split_heads(spec)  # a chat: / mc: part is matched by its path and suggested with its prefix
    raise ValueError(f"unknown data source {spec!r}: not a file, folder or glob that exists, nor 'stdlib' or "
                     f"'hf:NAME[:CONFIG][:SPLIT]'{did_you_mean(rest, head)}")


def split_heads(part: str) -> tuple[str, str]:
    """(its chat: / mc: prefixes, the rest) of a data spec part (snlp.io.chat reads chat: and mc: parts)."""
    head = ""
    for pre in ("chat:", "mc:"):
        if part[len(head):].startswith(pre):
            head += pre
    return head, part[len(head):]


def split_text(text: str, size: int = DOC_CHARS) -> Iterator[str]:
    """Cut a long text at blank lines into documents of at least `size` characters."""
    buf, n = [], 0
    for para in text.split("\n\n"):
        buf.append(para)
        n += len(para) + 2
        if n >= size:
            yield "\n\n".join(buf)
            buf, n = [], 0
    if buf and any(s.strip() for s in buf):
        yield "\n\n".join(buf)


def decode_error(path, raw: bytes, e: UnicodeDecodeError, encoding: str, option: str, offset: int = 0,
                 line: int = 1) -> ValueError:
    """The error for bytes of `path` (`raw`, starting at byte `offset` and line `line` of the file) that do not
    decode: the file, the byte offset and line, and what to pass."""
    line += raw.count(b"\n", 0, e.start)
    return ValueError(f"{path} is not {encoding} text: byte 0x{raw[e.start]:02x} at offset {offset + e.start} (line "
                      f"{line}) does not decode; "
                      f"if the file is in another encoding pass it, e.g. {option} latin-1 (or convert the file: "
                      f"iconv -f latin-1 -t utf-8)")


def check_not_binary(path, raw: bytes, encoding: str, offset: int = 0) -> None:
    """Refuse NUL bytes: no text encoding but UTF-16/32 writes them, so they mean binary data."""
    nul = raw.find(b"\0")
    if nul >= 0 and not encoding.lower().replace("_", "-").startswith(("utf-16", "utf-32", "utf16", "utf32")):
        raise ValueError(f"{path} holds a NUL byte at offset {offset + nul}: it is binary data, not text")


def read_text(path, encoding: str = "utf-8", option: str = "--data-encoding") -> str:
    """The text of a file decoded strictly in `encoding`; a ValueError naming the file, the byte offset and the
    `option` to pass when it does not decode (or holds NUL bytes)."""
    raw = Path(path).read_bytes()
    check_not_binary(path, raw, encoding)
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        raise decode_error(path, raw, e, encoding, option) from None
    except LookupError:
        raise ValueError(f"unknown text encoding {encoding!r} ({option})") from None


def read_lines(path, encoding: str = "utf-8", option: str = "--data-encoding") -> Iterator[str]:
    """The lines of a file (streamed, for large .jsonl), each decoded as `read_text` does."""
    try:
        "".encode(encoding)
    except LookupError:
        raise ValueError(f"unknown text encoding {encoding!r} ({option})") from None
    offset = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            check_not_binary(path, raw, encoding, offset)
            try:
                yield raw.decode(encoding)
            except UnicodeDecodeError as e:
                raise decode_error(path, raw, e, encoding, option, offset, n) from None
            offset += len(raw)


def _field(row, field: str, where: str):
    if not isinstance(row, dict) or field not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"{where} has no text field {field!r} (found {keys}); pass --text-field")
    return row[field]


def file_documents(path: Path, text_field: str = "text", encoding: str = "utf-8") -> Iterator[str]:
    """Documents of one local file (text and .jsonl decoded strictly in `encoding`)."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for i, line in enumerate(read_lines(path, encoding), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i} is not valid JSON ({e})") from e
                yield str(_field(row, text_field, f"{path}:{i}"))
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ValueError(f"reading {path} needs pyarrow: pip install 'snlp[parquet]'") from e
        table = pq.read_table(path)
        if text_field not in table.column_names:
            raise ValueError(f"{path} has no text column {text_field!r} (found {table.column_names}); pass --text-field")
        for text in table.column(text_field).to_pylist():
            if text:
                yield str(text)
    else:
        yield from split_text(read_text(path, encoding))


def hf_documents(spec: str, text_field: str = "text") -> Iterator[str]:
    """Stream a Hugging Face dataset `hf:NAME[:CONFIG][:SPLIT]`."""
    parts = spec[3:].split(":")
    if not parts[0] or len(parts) > 3:
        raise ValueError(f"malformed Hugging Face source {spec!r}: use hf:NAME[:CONFIG][:SPLIT]")
    name, config, split = parts[0], (parts[1] if len(parts) > 1 and parts[1] else None), \
        (parts[2] if len(parts) > 2 and parts[2] else "train")
    try:
        import datasets
    except ImportError as e:
        raise ValueError(f"data source {spec!r} needs the Hugging Face datasets library: pip install 'snlp[hf]'") from e
    from snlp.io.hub import blocked

    if why := blocked():  # a stream reads no cache: the client would retry every request first
        raise ValueError(f"could not stream Hugging Face dataset {spec!r}: {why}; use a local file")
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
        for row in ds:
            yield str(_field(row, text_field, f"dataset {name}"))
    except ValueError:
        raise
    except Exception as e:  # offline, unknown dataset, bad config: all surface as assorted exception types
        raise ValueError(f"could not stream Hugging Face dataset {spec!r} ({type(e).__name__}: {e}); "
                         f"check the name and that the hub is reachable, or use a local file") from e


def parts(spec: str | None) -> list[str]:
    out = [s.strip() for s in (spec or "stdlib").split(",") if s.strip()]
    return out or ["stdlib"]


def is_local(part: str) -> bool:
    """A spec part that names local files (not the standard library, not a Hugging Face source)."""
    return part != "stdlib" and not part.startswith("hf:")


def absolute_part(part: str) -> str:
    """`part` made absolute when it names something local that exists (a file, folder, or a glob that matches), so
    that `d/a.txt` read from its folder and `/abs/d/a.txt` are one source; other parts stay as they are."""
    return os_absolute(part) if names_local(part) else part


def os_absolute(path: str) -> str:
    """`path` (`~` expanded) as an absolute path naming what the OS opens. os.path.abspath collapses `..` as text,
    so `link/../c.txt` becomes the c.txt beside the link, while the OS steps up from the link's target: a `..`
    right after a symlink here steps up from its resolved target instead. A path without `..` (or whose `..` follow
    no symlink) is exactly abspath's, so ordinary specs keep the names, and the cache keys, they always had."""
    p = str(home_path(path))
    if ".." not in p.split(os.sep):
        return os.path.abspath(p)
    out = os.sep
    for c in os.path.join(os.getcwd(), p).split(os.sep):  # getcwd is already the physical path
        if c in ("", "."):
            continue
        if c == "..":
            out = os.path.dirname(os.path.realpath(out) if os.path.islink(out) else out)
        else:
            out = os.path.join(out, c)
    return out


def names_local(part: str) -> bool:
    """Whether `part` names local files that are here: a file, a folder, or a glob that matches."""
    p = str(home_path(part))
    return is_local(part) and (os.path.exists(p) or bool(glob.glob(p, recursive=True)))


def keyed_part(part: str) -> str:
    """A spec part as the token cache keys it (`source_key`) and a checkpoint records it: a relative local part made
    absolute (`absolute_part`), an absolute one exactly as typed (so its cache key is the one it always had)."""
    return part if home_path(part).is_absolute() else absolute_part(part)


def keyed_spec(spec: str | None) -> str:
    return ",".join(keyed_part(p) for p in parts(spec))


def files_signature(spec: str | None) -> list:
    """What the local parts of `spec` hold, independent of where they live: per part, its files' paths within the
    part (a file: its name) and sizes, in reading order (non-local parts as their spec). A checkpoint records it,
    so that a run whose data has moved resumes only from a place that holds the same files in the same order."""
    def rel(part: str, f: Path) -> str:
        base = home_path(part)
        return str(f.relative_to(base)) if base.is_dir() else f.name
    return [p if not is_local(p) else [[rel(p, f), f.stat().st_size] for f in resolve_files(p)] for p in parts(spec)]


def missing_parts(spec: str | None) -> list[str]:
    """The local parts of `spec` that name nothing here (a moved or deleted file, an empty glob)."""
    return [p for p in parts(spec) if is_local(p) and not names_local(p)]


def check_local_parts(spec: str | None) -> None:
    """Raise resolve_files' one-line ValueError (with the closest names) for the first local part of `spec` that names
    nothing here: what a pipeline asks before it makes its folders or starts a stage."""
    for p in missing_parts(spec):
        resolve_files(p)


def documents(spec: str | None, text_field: str = "text", max_chars: int = 0,
              encoding: str = "utf-8") -> Iterator[str]:
    """All documents of a data spec in a deterministic order, optionally capped at `max_chars`
    characters in total (streamed hf: sources default to HF_DEFAULT_CHARS); local files decoded in `encoding`."""
    total = 0
    cap = max_chars or (HF_DEFAULT_CHARS if any(p.startswith("hf:") for p in parts(spec)) else 0)
    for part in parts(spec):
        it = hf_documents(part, text_field) if part.startswith("hf:") else \
            (d for f in resolve_files(part) for d in file_documents(f, text_field, encoding))
        for doc in it:
            if not doc.strip():
                continue
            yield doc
            total += len(doc)
            if cap and total >= cap:
                return


def source_key(spec: str | None, text_field: str = "text", max_chars: int = 0, encoding: str = "utf-8") -> str:
    """Hash of a data spec: parts, text field, cap, encoding (when not UTF-8, so UTF-8 keys stay as they were)
    and every local file's path, size and mtime."""
    # relative local parts by their absolute form: a relative spec and its absolute spelling name one cache (the key
    # of a part given absolute, as typed, and stdlib's and hf:'s, are what they always were)
    h = hashlib.sha256(json.dumps([[keyed_part(p) for p in parts(spec)], text_field, max_chars]
                                  + ([encoding] if encoding.lower().replace("_", "-") != "utf-8" else [])).encode())
    for part in parts(spec):
        if not part.startswith("hf:"):
            for f in resolve_files(part):
                st = f.stat()
                h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def split_key(spec: str | None, text_field: str = "text", max_chars: int = 0, val_frac: float = 0.05,
              encoding: str = "utf-8") -> str:
    """Cache key of a data spec's train/validation split (`source_key` plus the validation fraction):
    names the tokenizer and token files `snlp train` writes and `snlp eval` reads."""
    return source_key(spec, text_field, max_chars, encoding) + f"-v{round(val_frac, 6)}"


def check_val_frac(val_frac) -> None:
    """Refuse, in one line, a validation fraction the split cannot hold out: it takes every round(1 / val_frac)-th
    document (validation_every), so every other one at most; above 0.5 it held out half and the run recorded and
    printed the fraction given."""
    # a number by the rule of every other real-valued setting (number_error: numpy reals too, no bool): a np.float32
    # 0.05 read as "not a number" was refused as out of range
    if number_error("--val-frac", val_frac) is not None or not 0 < val_frac <= 0.5:
        raise ValueError(f"--val-frac must lie in (0, 0.5] (every round(1 / f)-th document is held out, every other "
                         f"one at most), got {val_frac}")


def validation_every(val_frac: float) -> int:
    """split_documents' stride: every this-many-th document is validation."""
    return max(2, round(1 / val_frac))


def split_documents(docs: list[str], val_frac: float) -> tuple[list[str], list[str]]:
    """Deterministic split by document: every round(1/val_frac)-th document goes to validation."""
    if not docs:
        raise ValueError("the data source yielded no non-empty documents")
    if len(docs) < 2:
        raise ValueError("the data source has only one document: need at least 2 for a train/val split "
                         "(plain text is cut at blank lines into ~4 KB documents; add more text)")
    check_val_frac(val_frac)
    every = validation_every(val_frac)
    val = [d for i, d in enumerate(docs) if i % every == every - 1]
    train = [d for i, d in enumerate(docs) if i % every != every - 1]
    if not val:
        train, val = docs[:-1], docs[-1:]
    return train, val


# ----- token cache -----
def tokenize_to_memmap(docs: list[str], tok, path: Path) -> np.memmap:
    """Tokenize `docs` (bos before each) into a uint16/uint32 file, written atomically."""
    dtype = np.uint16 if tok.vocab_size <= 2 ** 16 else np.uint32
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    n = 0
    with open(tmp, "wb") as f:
        for i in range(0, len(docs), 256):
            for ids in tok.encode_documents(docs[i:i + 256]):
                arr = np.asarray([tok.bos_id] + ids, dtype=dtype)
                f.write(arr.tobytes())
                n += arr.size
    os.replace(tmp, path)
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,))


def open_memmap(path: Path, vocab_size: int) -> np.memmap:
    dtype = np.uint16 if vocab_size <= 2 ** 16 else np.uint32
    return np.memmap(path, dtype=dtype, mode="r")


@dataclass
class TokenData:
    train: np.ndarray
    val: np.ndarray


def tokens_digest(tokens: TokenData) -> str:
    """A digest of the token arrays a run trains and validates on (train, then val), read in 64 MB pieces: a
    resumed run checks it, so text edited in place (same names and sizes) is not continued on silently."""
    h = hashlib.blake2b(digest_size=16)
    for a in (tokens.train, tokens.val):
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        h.update(str((a.dtype.str, a.size)).encode())
        for i in range(0, flat.size, 1 << 26):
            h.update(flat[i:i + (1 << 26)])
    return h.hexdigest()


def token_paths(key: str, tok, directory: Path) -> tuple[Path, Path]:
    stem = f"{key}-{tok.documents_key}"
    return directory / f"{stem}.train.bin", directory / f"{stem}.val.bin"


def load_tokens(docs_train: list[str], docs_val: list[str], tok, key: str, directory: Path) -> TokenData:
    """Token arrays for a split, from the cache when present (key + tokenizer fingerprint)."""
    directory.mkdir(parents=True, exist_ok=True)
    ptrain, pval = token_paths(key, tok, directory)
    if not (ptrain.is_file() and pval.is_file()):
        tokenize_to_memmap(docs_val, tok, pval)
        tokenize_to_memmap(docs_train, tok, ptrain)
    return TokenData(open_memmap(ptrain, tok.vocab_size), open_memmap(pval, tok.vocab_size))


# ----- batches -----
def batch_at(tokens: np.ndarray, index: int, seq_len: int, batch: int, seed: int, rank: int = 0,
             world: int = 1):
    """Micro-batch `index`: `batch * world` random windows drawn from a generator seeded by
    (seed, index), of which this rank takes rows rank*batch..: the data depends only on the
    global index, so resume and DDP see exactly the batches of an uninterrupted single run."""
    import torch
    n = len(tokens) - seq_len - 1
    if n < 1:
        raise ValueError(f"only {len(tokens)} training tokens: need more than --seq-len + 1 = {seq_len + 1}")
    rng = np.random.default_rng([seed, index])
    starts = rng.integers(0, n + 1, size=batch * world)[rank * batch:(rank + 1) * batch]
    rows = np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])
    t = torch.from_numpy(rows)
    return t[:, :-1], t[:, 1:]


def val_batches(tokens: np.ndarray, seq_len: int, batch: int, n_batches: int):
    """Up to `n_batches` fixed batches of consecutive, non-overlapping windows of the val split."""
    import torch
    w = (len(tokens) - 1) // seq_len
    if w < 1:
        raise ValueError(f"validation split has only {len(tokens)} tokens: need more than --seq-len + 1 = "
                         f"{seq_len + 1}; raise --val-frac or add data")
    out = []
    for b in range(min(n_batches, max(1, w // batch))):
        rows = [np.asarray(tokens[(b * batch + i) * seq_len:(b * batch + i) * seq_len + seq_len + 1], dtype=np.int64)
                for i in range(min(batch, w))]
        t = torch.from_numpy(np.stack(rows))
        out.append((t[:, :-1], t[:, 1:]))
    return out

"""Local data files as users have them: what the path is before anything opens it, and its bytes.

A path that is not a regular file is refused by name before it is opened (a named pipe would be drained by the check
before training and block the run that reopens it; a device may never end); a symbolic link loop, a dangling link, a
directory and a permission problem are named too. Compressed files are read through: gzip, bzip2 and xz (by their magic
bytes, whatever the name says); zstd and zip are named, with the command that unpacks them.
"""

from __future__ import annotations

import bz2
import contextlib
import errno
import gzip
import io
import lzma
import os
import stat
from collections.abc import Iterator


class FileProblem(Exception):
    """The reason a data file cannot be read (the caller names the file: finetune/errors.py DataError)."""


# magic bytes -> (name, opener of a binary stream; None: named, not read)
_COMPRESSED = {
    b"\x1f\x8b": ("gzip", gzip.open),
    b"BZh": ("bzip2", bz2.open),  # then the block size digit and the block magic 1AY&SY (checked below)
    b"\xfd7zXZ\x00": ("xz", lzma.open),
    b"\x28\xb5\x2f\xfd": ("zstd", None),
    b"PK\x03\x04": ("zip", None),
}
_UNPACK = {"zstd": "zstd -d FILE", "zip": "unzip FILE"}
DAMAGED = (OSError, EOFError, lzma.LZMAError)  # what reading a damaged compressed stream raises
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz")  # stripped to find the format: train.jsonl.gz is JSON lines
_DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def format_name(path: str) -> str:
    """The lower-case name that says the format: `train.jsonl.gz` -> `train.jsonl`."""
    lower = path.lower()
    for suffix in COMPRESSION_SUFFIXES:
        if lower.endswith(suffix):
            return lower[: -len(suffix)]
    return lower


def problem(path: str) -> str | None:
    """Why `path` cannot be read as a data file, without opening it; None for a readable regular file."""
    try:
        st = os.stat(path)  # follows links; never opens (opening a FIFO blocks until a writer comes)
    except FileNotFoundError:
        if os.path.islink(path):
            return f"is a symbolic link to {os.readlink(path)!r}, which does not exist (a dangling link)"
        return "file not found"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"is a symbolic link loop ({_link_chain(path)}); point the link at the data file"
        if e.errno == errno.EACCES:
            return "permission denied: a directory on its path cannot be searched (its x bit is not set for you)"
        return f"cannot be read: {e.strerror}"
    kind = _kind(st.st_mode)
    if kind == "directory":
        inside = sorted(n for n in os.listdir(path) if format_name(n).endswith(_DATA_SUFFIXES))[:5]
        hint = f"; it holds {', '.join(inside)}" if inside else ""
        return f"is a directory, not a data file; give the path of one file{hint}"
    if kind != "regular file":
        return (
            f"is a {kind}, not a regular file: it cannot be read twice (the check before training, then the "
            "run), and may never end; write the data to a file and give that path"
        )
    if not os.access(path, os.R_OK):
        return _denied(st)
    return None


def read_bytes(path: str) -> bytes:
    """The file's bytes, decompressed; FileProblem says what the path is when it cannot be read."""
    with _open(path) as f:
        raw = f.read()
    return decompressed(raw)


@contextlib.contextmanager
def opened(path: str) -> Iterator[io.BufferedIOBase]:
    """A binary stream of the decompressed content (to read the head of a big file); FileProblem as read_bytes."""
    with _open(path) as f:
        name, opener = compression(f.peek(10)[:10])
        if name is None:
            yield f
            return
        if opener is None:
            raise FileProblem(_unsupported(name))
        with opener(f) as inner:
            yield inner


def _open(path: str) -> io.BufferedReader:
    why = problem(path)
    if why:
        raise FileProblem(why)
    try:
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    except OSError as e:  # permission denied despite os.access (ACLs, root squash), EIO, ...
        raise FileProblem(_denied(os.stat(path)) if e.errno == errno.EACCES else f"cannot be read: {e}") from None


def compression(head: bytes) -> tuple[str | None, object]:
    """(name, opener) of the compression the first 10 bytes show; (None, None) for none."""
    for magic, (name, opener) in _COMPRESSED.items():
        if head.startswith(magic) and (name != "bzip2" or head[4:10] == b"1AY&SY"):
            return name, opener
    return None, None


def decompressed(raw: bytes) -> bytes:
    name, opener = compression(raw[:10])
    if name is None:
        return raw
    if opener is None:
        raise FileProblem(_unsupported(name))
    try:
        with opener(io.BytesIO(raw)) as f:
            return f.read()
    except DAMAGED as e:
        raise FileProblem(
            f"is {name}-compressed but does not decompress ({e}); the file is damaged or cut short"
        ) from None


def _unsupported(name: str) -> str:
    return (
        f"is {name}-compressed, which is not read directly; unpack it (`{_UNPACK[name]}`) or compress it with "
        "gzip, bzip2 or xz instead (read as they are)"
    )


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "named pipe (FIFO)"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "special file"


def _denied(st: os.stat_result) -> str:
    return (
        f"permission denied: mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}, and this process runs as uid "
        f"{os.geteuid()}; make it readable (chmod a+r FILE) or run as its owner"
    )


def _link_chain(path: str, limit: int = 8) -> str:
    """`a -> b -> a`: the links followed until one repeats."""
    seen, chain, here = {os.path.normpath(path)}, [path], path
    for _ in range(limit):
        try:
            target = os.path.join(os.path.dirname(here), os.readlink(here))
        except OSError:
            break
        chain.append(os.readlink(here))
        key = os.path.normpath(target)
        if key in seen:
            break
        seen.add(key)
        here = target
    return " -> ".join(chain)

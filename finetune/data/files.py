"""Local data files as users have them: which files a data.path names (one file, a glob, a folder of shards), what
each path is before anything opens it, and its bytes.

A folder or glob names every data file it holds, in name order; files named the Hub's way (`train-00000-of-00010.parquet`)
are taken for data.split only, and a missing shard is named. A path that is not a regular file is refused by name before it is opened (a named pipe would be drained by the check
before training and block the run that reopens it; a device may never end); a symbolic link loop, a dangling link, a
directory and a permission problem are named too. Compressed files are read through: gzip, bzip2 and xz (by their magic
bytes, whatever the name says); zstd and zip are named, with the command that unpacks them.
"""

from __future__ import annotations

import bz2
import contextlib
import errno
import glob
import gzip
import io
import logging
import lzma
import os
import re
import stat
from collections.abc import Iterator

log = logging.getLogger(__name__)


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
SHARD_SUFFIXES = (*_DATA_SUFFIXES, ".arrow")  # what a folder or a glob of shards may hold
# The Hub's shard names: <split>-00000-of-00010[.suffix] (datasets' push_to_hub, `hf download` of a dataset)
_HUB_SHARD = re.compile(r"^(?P<split>.+?)-(?P<index>\d{5})-of-(?P<total>\d{5})(?:[.-].*)?$")
_SPLIT_NAMES = ("train", "test", "validation", "valid", "dev", "eval")
# Not data: what a dataset folder holds beside its files (a dataset card, git and Hub metadata).
_NOT_DATA = re.compile(r"(?i)^(readme.*|license.*|.*\.(md|txt|yaml|yml|py|lock|gitattributes)|dataset_infos?\.json)$")


def format_name(path: str) -> str:
    """The lower-case name that says the format: `train.jsonl.gz` -> `train.jsonl`."""
    lower = path.lower()
    for suffix in COMPRESSION_SUFFIXES:
        if lower.endswith(suffix):
            return lower[: -len(suffix)]
    return lower


def is_pattern(path: str) -> bool:
    """A glob (`shards/*.jsonl`, `data/**/*.parquet`) rather than a path that exists as it is written."""
    return any(c in path for c in "*?[") and not os.path.lexists(path)


def shards(path: str, split: str = "train") -> list[str]:
    """The data files `path` names, in name order: [path] for anything but a folder or a glob (reading it says what it
    is); the data files a glob matches or a folder holds (subfolders too), of data.split's shards when they are named
    the Hub's way. FileProblem when there are none, a shard of a numbered set is missing, or the formats differ."""
    if is_pattern(path):
        # Every match but a folder: a dangling link or a pipe among the shards is named by problem(), as in a folder.
        found = sorted(
            p for p in glob.glob(_literal_prefix(os.path.expanduser(path)), recursive=True) if not os.path.isdir(p)
        )
        if not found:
            raise FileProblem("no file matches this pattern" + _near(path))
        where = "the files it matches"
    elif os.path.isdir(path):
        found = _folder_files(path)
        where = "the folder"
    else:
        return [path]
    data = [p for p in found if format_name(p).endswith(SHARD_SUFFIXES)]
    ignored = [os.path.basename(p) for p in found if p not in data]
    if not data:
        held = f"; it holds {', '.join(ignored[:5])}" if ignored else " (it is empty)"
        kinds = ", ".join(SHARD_SUFFIXES)
        raise FileProblem(f"{where}: no data file ({kinds}, optionally .gz/.bz2/.xz){held}")
    data = _of_split(data, split, where)
    kinds = sorted({_suffix(p) for p in data})
    if len(kinds) > 1:
        counts = ", ".join(f"{k}: {sum(_suffix(p) == k for p in data)}" for k in kinds)
        raise FileProblem(
            f"{where}: data files of several formats ({counts}); the same rows are often kept in two formats, "
            "so none is chosen: name one format with a glob (for example DIR/*.jsonl)"
        )
    return data


def _literal_prefix(pattern: str) -> str:
    """The pattern with its longest leading part that exists as written escaped: a folder named `run[1]` or `a*b`
    is that folder, not a character class or a wildcard (`run[1]/*.jsonl` would otherwise look in `run1/`)."""
    parts = pattern.split(os.sep)
    for n in range(len(parts) - 1, 0, -1):
        head = os.sep.join(parts[:n])
        if head and os.path.lexists(head):
            return os.path.join(glob.escape(head), *parts[n:])
    return pattern


def _folder_files(path: str) -> list[str]:
    out = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # .git, .cache (the Hub's download metadata)
        out += [os.path.join(root, n) for n in names if not n.startswith(".") and not _NOT_DATA.match(n)]
    return sorted(out)


def _suffix(path: str) -> str:
    return next(s for s in SHARD_SUFFIXES if format_name(path).endswith(s))


def _stem(path: str) -> str:
    name = os.path.basename(format_name(path))
    return name[: -len(_suffix(path))]


def _of_split(paths: list[str], split: str, where: str) -> list[str]:
    """The shards of data.split when the files are of several splits (the Hub's <split>-00000-of-00010, or train.jsonl
    beside test.jsonl), said in the log; all of them otherwise. A numbered set with a shard missing is refused."""
    numbered = {p: _HUB_SHARD.match(_stem(p)) for p in paths}
    group = {p: m["split"] if m else _stem(p) for p, m in numbered.items()}
    splits = set(group.values())
    named = {s for s in splits if s.lower() in _SPLIT_NAMES or any(m and m["split"] == s for m in numbered.values())}
    chosen = paths
    if len(splits) > 1 and named:
        if split not in splits:
            raise FileProblem(f"{where}: the splits {', '.join(sorted(splits))}, none of them data.split {split!r}")
        chosen = [p for p in paths if group[p] == split]
        left = sorted(os.path.basename(p) for p in paths if group[p] != split)
        log.info("data.split %r: %d file(s); left out (other splits): %s", split, len(chosen), ", ".join(left[:10]))
    totals = {int(numbered[p]["total"]) for p in chosen if numbered[p]}
    if len(totals) > 1:
        raise FileProblem(f"{where}: the numbered shards disagree on how many there are (of {sorted(totals)})")
    if totals:
        total = totals.pop()
        have = {int(numbered[p]["index"]) for p in chosen if numbered[p]}
        missing = [i for i in range(total) if i not in have]
        if missing:
            name = group[chosen[0]]
            names = ", ".join(f"{name}-{i:05d}-of-{total:05d}" for i in missing[:5])
            raise FileProblem(
                f"{where}: {len(missing)} of the {total} {name!r} shards are missing ({names}"
                f"{' ...' if len(missing) > 5 else ''}); copy or download them again"
            )
    return chosen


def _near(pattern: str) -> str:
    """What the pattern's folder holds, when it exists: the pattern may just name the wrong suffix."""
    folder = os.path.dirname(os.path.expanduser(pattern)) or "."
    if not os.path.isdir(folder):  # a folder named `run[1]` exists as written
        return f" (no folder {folder})" if not any(c in folder for c in "*?[") else ""
    held = sorted(os.listdir(folder))[:5]
    return f" (its folder {folder} holds {', '.join(held)})" if held else f" (its folder {folder} is empty)"


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
        return "is a directory, not a data file"  # a folder of shards is read through shards()
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

"""Filesystem failures a user fixes (a full disk, a quota, a read-only or forbidden directory) told apart from bugs, and
said as one message naming the path and the space left (docs/faults.md "Disk full, read-only"). torch.save and
safetensors wrap the OSError in their own exceptions, so their messages are read too.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from finetune.errors import UserError
from finetune.units import GIB, MIB

REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
# the same failures as torch.save (PytorchStreamWriter) and safetensors (a Rust io::Error) word them
_WORDS = {
    "No space left on device": errno.ENOSPC,
    "StorageFull": errno.ENOSPC,
    "Disk quota exceeded": errno.EDQUOT,
    "QuotaExceeded": errno.EDQUOT,
    "Read-only file system": errno.EROFS,
    "ReadOnlyFilesystem": errno.EROFS,
}


class StorageError(UserError):
    """Writing a run's files failed for a reason outside the program (exit 2)."""

    def __init__(self, message: str, code: int | None, failed_at: str | None = None):
        super().__init__(message)
        self.errno = code
        self.failed_at = failed_at  # the file the failed write was to, when known


NEARLY_FULL = 64 * MIB  # bytes free below which torch's errno-less "file write failed" means a full disk


def cause(exc: BaseException, path: Path | None = None) -> int | None:
    """The storage errno behind `exc` (or one it was raised from), or None for anything else. torch's writer drops the
    errno ("file write failed"): read as ENOSPC when `path`'s filesystem is (nearly) full."""
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, OSError) and exc.errno in REASONS:
            return exc.errno
        text = str(exc)
        for words, code in _WORDS.items():
            if words in text:
                return code
        if "file write failed" in text and path is not None and _free_bytes(path) < NEARLY_FULL:
            return errno.ENOSPC
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _existing(path: Path) -> Path:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(_existing(path)).free
    except OSError:
        return 1 << 62


def free_space(path: Path) -> str:
    """'X GiB free of Y GiB' on the filesystem holding `path` (its nearest existing parent)."""
    try:
        usage = shutil.disk_usage(_existing(path))
    except OSError:
        return "free space unknown"
    return f"{_size(usage.free)} free of {_size(usage.total)} on its filesystem"


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def error(exc: BaseException, path: Path, doing: str, then: str = "") -> StorageError | None:
    """A StorageError for `exc` raised while `doing` something to `path`, or None when `exc` is
    no storage failure (a bug keeps its traceback)."""
    code = cause(exc, path)
    if code is None:
        return None
    failed_at = getattr(exc, "filename", None)
    return StorageError(message(code, path, doing, then, failed_at=failed_at), code, failed_at)


def message(code: int, path: Path, doing: str, then: str = "", *, failed_at=None) -> str:
    """'<doing> failed: <reason> (<file>; <free space>)[; what to do][. then]'."""
    text = f"{doing} failed: {REASONS[code]} ({failed_at or path}; {free_space(Path(path))})"
    if code == errno.EROFS or (code in (errno.EACCES, errno.EPERM) and not writable(Path(path))):
        text += "; give a writable --run.output_dir"
    return text + (f". {then}" if then else "")


# The process's umask, read once at import, before any thread of ours runs: os.umask reads it only by setting it, and
# a file another thread made in between (a rank's heartbeat writes one every beat) would get no mask at all.
UMASK = os.umask(0o022)
os.umask(UMASK)


def as_umask_allows(path: Path | str) -> None:
    """Give a file or folder made by tempfile (owner-only: 0600, 0700) the mode a plain open() or mkdir() gives under
    the process's umask, before it is put in place: a run record or an export is read by other users (a team, a
    model server running as its own user)."""
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~UMASK)


def writable(path: Path) -> bool:
    """Whether files can be created in `path` or, when it does not exist, its nearest existing parent
    (os.access also answers EROFS for root, whom permission bits do not stop)."""
    return os.access(_existing(path), os.W_OK | os.X_OK)


def unwritable(path: Path, what: str) -> str | None:
    """Preflight: why `what` at `path` cannot be written (read-only filesystem, no permission), with
    the directory that decides it, or None when it can be."""
    where = _existing(path)
    if os.access(where, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(where).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    reason = REASONS[errno.EROFS if read_only else errno.EACCES]
    return (
        f"{what} {path} cannot be written: {reason} ({where}); nothing was started. Give a writable "
        f"--run.output_dir (or --run.name under a writable runs/)"
    )


def make_directory(path: Path, flag: str = "--out") -> Path:
    """The folder a command writes into (`flag`: the option that named it), made with its parents or kept when it is
    one. What stops it is a UserError naming the path and why (a file in the way, no permission, a filesystem that
    takes no folder), the folders this call made removed again: nothing is left changed."""
    path = Path(path)
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UserError(f"{flag} {path}: {blocker} is a file, not a folder; nothing was changed. Give another {flag}")
    new = [p for p in (path, *path.parents) if not p.exists()]  # the deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        for made in new:
            if made.is_dir():
                made.rmdir()
        reason = REASONS.get(e.errno, e.strerror)
        raise UserError(
            f"{flag} {path}: cannot be made: {reason} ({e.filename}); nothing was changed. Give another {flag}"
        ) from None
    return path


def own_directory(path: Path, tool: str, rewrites: str) -> Path:
    """--out of `tool` (`finetune doctor`, `finetune bench`): made, or reused when `tool` made it
    (its marker file); a directory it did not make is refused, nothing in it touched. `rewrites`:
    what `tool` writes there again, for the marker's text."""
    marker = path / f".{tool.replace(' ', '-')}"
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not marker.is_file())):
        raise UserError(
            f"--out {path}: exists and was not made by {tool} (no {marker.name} in it); nothing was changed. "
            f"Give another --out"
        )
    make_directory(path)
    marker.write_text(f"made by {tool}; {rewrites} are rewritten by it\n")
    return path


def read_json(path: Path) -> tuple[object, str | None]:
    """(the JSON value in `path`, None), or (None, why it is not JSON, in words: the byte that is not UTF-8, the line
    and column where it stops parsing). A file that cannot be opened raises OSError."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8")), None
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text (byte {e.start})"
    except json.JSONDecodeError as e:
        return None, f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"


def json_object(path: Path) -> dict:
    """The JSON object in `path`; {} when it is unreadable or holds no object."""
    try:
        values = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}

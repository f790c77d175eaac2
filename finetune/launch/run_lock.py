"""One writer per run directory: an exclusive flock on LOCK inside it, taken by rank 0 before it changes anything there
and held until the process exits; the kernel releases it however the process dies (docs/faults.md "One writer per run
directory"). The lock file holds the holder's pid, host, start time and command line (JSON), for the message.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from finetune.errors import UserError
from finetune.storage import json_object

LOCK = ".finetune.lock"
WAIT_S = 2.0  # a probe holds the lock for microseconds; a holder writes its note right after locking


class Locks:
    """The run directories this process holds (rank 0 of a run: finetune/training/run.py main makes one and lets
    go of them as it returns)."""

    def __init__(self):
        self.held: dict[str, int] = {}  # run directory -> the locked file descriptor

    def acquire(self, run_dir: Path) -> None:
        """Lock `run_dir` (created if missing) until released, or UserError naming the live run that holds it.
        Again: no change."""
        run_dir = Path(run_dir).absolute()
        if str(run_dir) in self.held:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK
        deadline = time.monotonic() + WAIT_S
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if _try_lock(fd, fcntl.LOCK_EX) and _same_file(fd, path):
                break
            os.close(fd)
            if time.monotonic() > deadline:
                raise UserError(in_use_message(run_dir))
            time.sleep(0.05)
        note = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)[:500],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(note).encode(), 0)
        self.held[str(run_dir)] = fd

    def release_all(self) -> None:
        """Let go of every lock held, removing its file (a run does it as main() returns, so a refused --resume
        leaves nothing behind; a crash leaves the file, unlocked). Unlinked while still locked: a process waiting
        for it then finds the file gone and takes a new one (acquire's check that the locked file is the one at
        the path)."""
        for key, fd in self.held.items():
            path = Path(key) / LOCK
            if _same_file(fd, path):
                try:
                    path.unlink()
                except OSError:
                    pass
            os.close(fd)
        self.held.clear()


def live_run(run_dir: Path) -> str | None:
    """The refusal when another process holds `run_dir`'s lock, else None. Changes nothing: the
    lock file is only opened when it exists, read-only, and a shared lock tried and dropped."""
    run_dir = Path(run_dir)
    note = holder(run_dir)  # this process's own lock names it (written before `acquire` returns)
    if note.get("pid") == os.getpid() and note.get("host") == socket.gethostname():
        return None
    try:
        fd = os.open(run_dir / LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        free = _try_lock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)  # drops the shared lock, if taken
    return None if free else in_use_message(run_dir)


def holder(run_dir: Path) -> dict:
    """The note the holder wrote (empty until it has)."""
    return json_object(Path(run_dir) / LOCK)


def in_use_message(run_dir: Path) -> str:
    deadline = time.monotonic() + WAIT_S
    note = holder(run_dir)
    while not note and time.monotonic() < deadline:  # locked a moment ago: its note comes next
        time.sleep(0.05)
        note = holder(run_dir)
    pid, host = note.get("pid", "?"), note.get("host", "?")
    here = host == socket.gethostname()
    where = "" if here else f" on {host}"
    return (
        f"run directory {run_dir} is in use by a live run: pid {pid} on host {host}, started "
        f"{note.get('started', '?')} ({note.get('command', 'command unknown')}); nothing was changed. Wait for it "
        f"to end, stop it (`kill -TERM {pid}`{where}: it writes a checkpoint and exits 75, then --resume "
        f"continues it), or give another --run.name / --run.output_dir"
    )


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _same_file(fd: int, path: Path) -> bool:
    """The file locked is still the one at `path` (not unlinked by a run that --overwrite'd it)."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except OSError:
        return False

"""Per-rank heartbeats, so the rank that stopped making progress is the one named when a run fails
(docs/faults.md "A rank dies or stalls").

Under `finetune train` every rank's heartbeat thread (finetune/launch/peers.py) writes `rank-<R>.json`
(pid, host, the last optimizer step the rank finished, the time) into the launch's state directory
(finetune/launch/relay.py) every beat. A rank stopped with SIGSTOP, frozen or swapped out stops beating; the ranks waiting
for it in a collective keep beating (collectives wait with the GIL released) until
`training.ddp_timeout` ends them. `finetune train` reads the beats when it reports the failed ranks
(report_failed_ranks): the launcher only sees exit codes. (A failing rank's own record names the
lost ranks from the store's heartbeats, finetune/launch/peers.py.) These are local files: under a
multi-node launch each node's wrapper sees its own ranks. Without `finetune train` there are none.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from finetune.launch import relay

# A rank whose last beat is this much older than the moment the others failed (or now) had stopped
# making progress: well above a beat delayed on a loaded machine, well below any collective timeout.
STALL_S = 10.0

_progress = {"step": 0}


def directory(env=os.environ) -> Path | None:
    state = env.get(relay.ENV)
    return Path(state) if state else None


def writer(rank: int):
    """A function that writes this rank's beat (called by its heartbeat thread), or None without
    `finetune train`."""
    where = directory()
    if where is None:
        return None
    path = where / f"rank-{rank}.json"
    note = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname()}

    def beat():
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({**note, "step": _progress["step"], "beat": time.time()}))
            tmp.replace(path)
        except OSError:
            pass  # the launch ended and took its directory, or the disk is full: nothing to report to

    return beat


def progress(step: int) -> None:
    """The last optimizer step this rank finished (its beats carry it)."""
    _progress["step"] = step


def read(where: Path | None = None) -> dict[int, dict]:
    """Every rank's last beat, by rank."""
    where = where or directory()
    beats = {}
    for path in sorted(where.glob("rank-*.json")) if where and where.is_dir() else []:
        try:
            b = json.loads(path.read_text())
            beats[int(b["rank"])] = b
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return beats


def stalled(beats: dict[int, dict], failed_at: dict[int, float]) -> dict[int, str]:
    """The ranks that stopped making progress, with why: those whose last beat is STALL_S older than
    the moment another rank failed, and than their own end (pure; `failed_at`: rank -> time its
    failure was seen)."""
    out = {}
    for rank, b in beats.items():
        others = [t for r, t in failed_at.items() if r != rank]
        if not others:
            continue
        # a rank's beats also end when it exits: only silence before its own end counts
        silent = min(others + [failed_at.get(rank, float("inf"))]) - b["beat"]
        if silent >= STALL_S:
            out[rank] = (
                f"stopped making progress: its last heartbeat came {silent:.0f} s before the others failed, after "
                f"step {b['step']} (pid {b['pid']} on {b['host']}); the others waited for it"
            )
    return out

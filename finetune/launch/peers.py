"""Which ranks are still alive when a collective fails: heartbeats through the rendezvous store.

A rank whose process dies (its node lost, its task killed) makes the others' next collective fail
with an error that names a socket, not a rank ("Connection closed by peer [127.0.0.1]:41234"; NCCL
says even less). To name the lost rank and node, every rank of a multi-process run bumps a counter
`finetune/peers/beat/<rank>` in the launcher's TCP store (MASTER_ADDR:MASTER_PORT: torchrun's agent
on node rank 0 hosts it) every BEAT_S seconds from a daemon thread. A rank whose training fails
says so (`failing/<rank>`), watches the counters for WATCH_S seconds, and names as lost every rank
whose counter stood still and that did not say it is failing too. If the store itself no longer
answers, its host, node rank 0, is what was lost. `failure_note` names them with their nodes
(LaunchPlan.machines) for stderr and run.json.

Its own client connection with a short timeout: the process group's store waits up to
training.ddp_timeout. The thread is stopped and joined at exit (a daemon thread still inside a
store call while the interpreter finalizes can abort the process; finetune/launch/ranks.py).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from datetime import timedelta

BEAT_S = 0.5  # seconds between heartbeats
WATCH_S = 3.0  # how long a failing rank watches the counters (6 beats of a live rank)
STORE_TIMEOUT_S = 5.0  # one store call on the heartbeat connection, at most
PREFIX = "finetune/peers/"


class Heartbeat:
    """This rank's heartbeat thread and its view of the others (see the module docstring)."""

    def __init__(self, store, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="finetune-heartbeat", daemon=True)
        self.error: str | None = None  # why beating stopped (the store stopped answering)

    def start(self) -> Heartbeat:
        self._thread.start()
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=STORE_TIMEOUT_S + 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(f"{PREFIX}beat/{self.rank}", 1)
            except Exception as e:  # noqa: BLE001 - the store host is gone; `lost` says so
                self.error = f"{type(e).__name__}: {e}"
                return
            self._stop.wait(BEAT_S)

    def counters(self) -> list[int]:
        return [int(self.store.add(f"{PREFIX}beat/{r}", 0)) for r in range(self.world_size)]

    def lost(self, watch_s: float = WATCH_S) -> tuple[list[int], str | None]:
        """(ranks that stopped beating, None), or ([], why) when the store cannot be read: then the
        store's host is lost. Announces this rank as failing first, so a rank that fails for the same
        reason and exits sooner is not named."""
        try:
            self.store.set(f"{PREFIX}failing/{self.rank}", "1")
            before = self.counters()
            time.sleep(watch_s)
            after = self.counters()
            failing = {r for r in range(self.world_size) if self.store.check([f"{PREFIX}failing/{r}"])}
        except Exception as e:  # noqa: BLE001 - any store failure means its host cannot be reached
            return [], f"{type(e).__name__}: {e}"
        return [
            r for r in range(self.world_size) if r != self.rank and after[r] == before[r] and r not in failing
        ], None


def start(rank: int, world_size: int, env=os.environ) -> Heartbeat | None:
    """Start this rank's heartbeat on the launcher's store, or None (one process, or no store address)."""
    host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if world_size < 2 or not host or not (port or "").isdigit():
        return None
    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False
        )
    except Exception:  # noqa: BLE001 - no heartbeat: a later failure is reported without the rank named
        return None
    return Heartbeat(store, rank, world_size).start()


def failure_note(error: BaseException, heartbeat: Heartbeat | None, machines) -> str | None:
    """After training failed on this rank: which ranks (and nodes) of `machines` (LaunchPlan.machines)
    stopped answering, printed on stderr and returned for run.json; None in a one-process run, when
    every rank is still there, and for an interruption or a user error (nothing was lost)."""
    from finetune.errors import UserError

    if heartbeat is None or not machines.ranks or isinstance(error, (KeyboardInterrupt, SystemExit, UserError)):
        return None
    lost, store_error = heartbeat.lost()
    if store_error:  # the store lives in the launcher of node rank 0
        gone = machines.ranks_on(0)
        note = (
            f"lost node {machines.place(gone[0]).node} (node rank 0, rank(s) {gone}): the launcher's "
            f"store there no longer answers ({store_error})"
        )
    elif lost:
        parts = []
        for node_rank, name in sorted({(machines.place(r).node_rank, machines.place(r).node) for r in lost}):
            gone = [r for r in lost if machines.place(r).node_rank == node_rank]
            if len(gone) == len(machines.ranks_on(node_rank)):  # every rank of the node
                parts.append(f"lost node {name} (node rank {node_rank}): rank(s) {gone} stopped answering")
            else:
                parts.append(f"rank(s) {gone} on node {name} (node rank {node_rank}) stopped answering")
        note = "; ".join(parts)
    else:
        return None
    me = machines.place(heartbeat.rank)
    print(
        f"finetune: rank {heartbeat.rank} on node {me.node if me else None}: {note}; this rank stops "
        f"({type(error).__name__}). Continue from the last complete checkpoint with --resume, on the nodes left "
        f"too (docs/faults.md)",
        file=sys.stderr,
        flush=True,
    )
    return note

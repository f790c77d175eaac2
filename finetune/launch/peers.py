"""The other ranks: each rank's heartbeat thread and watchdog, its progress file, what is done once on rank 0, and the
process group's teardown. How they work and why: docs/faults.md "A rank dies or stalls", "Hangs and every stop signal".
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil

from finetune.errors import UserError
from finetune.launch import relay

BEAT_S = 0.5  # seconds between heartbeats
WATCH_S = 3.0  # how long a failing rank watches the counters (6 beats of a live rank)
STORE_TIMEOUT_S = 5.0  # one store call on the heartbeat connection, at most
PREFIX = "finetune/peers/"
EXIT_STUCK = 1  # a failure: the run did not end as planned
MARGIN_S = 60.0  # the backend's collective timeout is set this far past the watchdog's limits
# A rank whose last beat is this much older than the moment the others failed (or now) had stopped
# making progress: well above a beat delayed on a loaded machine, well below any collective timeout.
STALL_S = 10.0
# A rank left by another that ended (ran out of GPU memory, or its watchdog ended it) normally fails in its next
# collective at once (gloo); one still running this long after (NCCL waits on a peer that is gone) is ended by its
# watchdog, naming that rank. Phases with a limit of their own (a save) keep it.
LEFT_S = 10.0
ENDED = {"oom": "it ran out of GPU memory", "stuck": "its watchdog ended it"}  # what `tell` kinds say


class Watch:
    """What this process's watchdog checks; set by the main thread and the signal handler. One per process, made at
    its start (finetune/training/signals.py Stops owns it) and handed to every phase that names what it does."""

    def __init__(self):
        self.grace_s: float | None = None  # training.stop_grace, once the recipe is read (Stops.keep_only)
        self.signal: tuple[str, float] | None = None  # a stop signal no agreement has acted on: (name, when)
        self.done_with_signals = False  # a stop was agreed: later signals are ignored (signals.py)
        self.phase: tuple[str, float, float | None] = ("the start", time.monotonic(), None)  # label, since, limit
        self.wait: tuple[str, float] | None = None  # the agreement (collective) the main thread is in
        self.peer_stop: str | None = None  # another rank's stop signal, read from the store
        self.left_by: tuple[int, str, float] | None = None  # (rank, kind, when seen): another rank told it ended
        self.step = 0  # the last optimizer step this rank finished (its progress file carries it)

    def signalled(self, name: str) -> None:
        if self.signal is None and not self.done_with_signals:
            self.signal = (name, time.monotonic())

    def acted(self) -> None:
        """The ranks agreed on a stop (or a failure): the grace period ends; the stop's own phases follow."""
        self.signal, self.done_with_signals = None, True

    @contextlib.contextmanager
    def during(self, label: str, limit_s: float | None = None):
        """A phase; a limit (seconds, from its start or its last `progress()`) makes the watchdog end a
        rank still in it after that long."""
        before, self.phase = self.phase, (label, time.monotonic(), limit_s)
        try:
            yield
        finally:
            self.phase = before

    def progress(self) -> None:
        """The phase made progress (an evaluation batch): its limit counts from now."""
        label, _, limit = self.phase
        self.phase = (label, time.monotonic(), limit)

    @contextlib.contextmanager
    def waiting(self, label: str):
        """The main thread is in a collective every rank must reach (for `doing`)."""
        self.wait = (label, time.monotonic())
        try:
            yield
        finally:
            self.wait = None

    def doing(self, now: float) -> str:
        label, since, _ = self.phase
        if self.wait:
            return f"waits in {self.wait[0]} ({now - self.wait[1]:.0f} s)"
        inside = collective_of_main_thread()
        return f"is in {label} ({now - since:.0f} s)" + (f", waiting in {inside}" if inside else "")

    def overdue(self, now: float) -> str | None:
        """Why this rank is stuck, or None. A phase with a limit of its own (a save, the model load, the
        steps after training) is held to it, a signal or not: a save is never cut short by the grace."""
        label, since, limit = self.phase
        if limit is not None:
            late = now - since > limit
            return f"made no progress in {label} for {now - since:.0f} s (its limit: {limit:g} s)" if late else None
        if self.signal and self.grace_s is not None and now - self.signal[1] > self.grace_s:
            return (
                f"got {self.signal[0]} {now - self.signal[1]:.0f} s ago and could not act on it within "
                f"training.stop_grace ({self.grace_s:g} s)"
            )
        return None

    def left(self, now: float) -> str | None:
        """Why this rank, left by another (`left_by`) LEFT_S ago, is stuck; None in a phase with a limit of its own."""
        if self.left_by and self.phase[2] is None and now - self.left_by[2] > LEFT_S:
            rank, kind, seen = self.left_by
            return f"was left by rank {rank} ({ENDED[kind]}, said above) {now - seen:.0f} s ago and did not stop"
        return None


def collective_of_main_thread() -> str | None:
    """The torch.distributed call the main thread is blocked in (its innermost Python frames are
    torch's; a gloo collective blocks there) and the first caller outside torch, or None."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    names = []
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" not in path:
            break
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    if not names or frame is None:
        return None
    name = next((n for n in names if not n.startswith("_") and n != "wrapper"), names[0])
    path = frame.f_code.co_filename.replace(os.sep, "/")
    short = path.split("site-packages/")[-1] if "site-packages/" in path else "/".join(path.split("/")[-3:])
    return f"torch.distributed {name} (called from {short}:{frame.f_lineno} {frame.f_code.co_name})"


class Heartbeat:
    """This rank's heartbeat thread and its view of the others (docs/faults.md "A rank dies or stalls"). `store`
    None: one process, or no store to reach; the thread still writes the progress file and watches `watch`.
    `on_stuck(cause)`: called before the watchdog ends the rank (rank 0 records the run failed)."""

    def __init__(self, store, rank: int, world_size: int, watch: Watch, on_stuck=None):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.watch, self.on_stuck = watch, on_stuck
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="finetune-heartbeat", daemon=True)
        self.error: str | None = None  # why beating stopped (the store stopped answering)
        self._progress = progress_writer(rank, watch)  # None without `finetune train`
        self._said: tuple[str | None, str | None] = (None, None)  # (doing, stop) last published

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
            if self._progress:
                self._progress()
            if self.store is not None and self.error is None:
                try:
                    self.store.add(f"{PREFIX}beat/{self.rank}", 1)
                    self._share()
                except Exception as e:  # noqa: BLE001 - the store host is gone; `lost` says so
                    self.error = f"{type(e).__name__}: {e}"
            now = time.monotonic()
            cause = self.watch.overdue(now)
            if cause:
                self._end_stuck(cause)
            elif left := self.watch.left(now):  # the record's error: the line of the rank that left this one
                rank, kind, _ = self.watch.left_by
                said = self.told(kind).get(rank)
                self._end_stuck(left, said and (f"stuck: {said}" if kind == "stuck" else said))
            self._stop.wait(BEAT_S)

    def _share(self) -> None:
        """Publish what this rank does and a stop signal it got; read another rank's stop."""
        watch = self.watch
        doing = re.sub(r" \(\d+ s\)", "", watch.doing(time.monotonic()))  # unchanged while the phase is
        stop = f"{watch.signal[0]} on rank {self.rank}" if watch.signal else None
        if doing != self._said[0]:
            self.store.set(f"{PREFIX}at/{self.rank}", f"{doing} since {time.strftime('%H:%M:%S')}")
        if stop and not self._said[1]:
            self.store.set(f"{PREFIX}stop", stop)
        elif not watch.peer_stop and self.store.check([f"{PREFIX}stop"]):
            watch.peer_stop = self.store.get(f"{PREFIX}stop").decode()
        if not watch.left_by and self.store.check([f"{PREFIX}ended"]):
            rank, kind = self.store.get(f"{PREFIX}ended").decode().split(":")
            watch.left_by = (int(rank), kind, time.monotonic()) if int(rank) != self.rank else None
        self._said = (doing, self._said[1] or stop)

    def others(self) -> str:
        """What every other rank said it does (`at/<rank>`), for a stuck rank's message."""
        if self.store is None or self.error:
            return ""
        said = []
        for r in range(self.world_size):
            if r != self.rank:
                try:
                    said.append(f"rank {r} {self.store.get(f'{PREFIX}at/{r}').decode()}")
                except Exception:  # noqa: BLE001 - not said yet, or the store is gone
                    said.append(f"rank {r}: not known")
        return "; ".join(said)

    def _end_stuck(self, cause: str, record: str | None = None) -> None:
        """The watchdog's stop: name what each rank waits in, record it (rank 0; `record`: the error to record
        instead), exit EXIT_STUCK."""
        now = time.monotonic()
        text = f"rank {self.rank} {cause}; it {self.watch.doing(now)}"
        others = self.others()
        text += f"; {others}" if others else ""
        print(f"finetune: stuck: {text}. Stopping this rank (exit {EXIT_STUCK}); nothing was deleted", file=sys.stderr)
        sys.stderr.flush()
        try:
            self.tell("stuck", text)
            if self.on_stuck:
                self.on_stuck(record or f"stuck: {text}")
        finally:
            for child in psutil.Process().children(recursive=True):  # a data-map pool, DataLoader workers:
                with contextlib.suppress(psutil.Error):  # os._exit skips the cleanup that would end them
                    child.kill()  # (one already gone must not stop the exit)
            os._exit(EXIT_STUCK)

    def tell(self, kind: str, text: str) -> None:
        """Say on the store why this rank ends (`<kind>/<rank>`: `stuck`, its watchdog ended it; `oom`, out of GPU
        memory), for the ranks left to name the cause, not only the rank gone."""
        if self.store is not None and not self.error:
            with contextlib.suppress(Exception):  # the store is gone: the others find this rank lost
                self.store.set(f"{PREFIX}{kind}/{self.rank}", text)
                self.store.set(f"{PREFIX}ended", f"{self.rank}:{kind}")  # one key every beat looks at

    def told(self, kind: str) -> dict[int, str]:
        """rank -> what another rank said on ending (`tell`) of `kind`; empty when none did or the store is gone."""
        if self.store is None:
            return {}
        try:
            found = [r for r in range(self.world_size) if r != self.rank and self.store.check([f"{PREFIX}{kind}/{r}"])]
            return {r: self.store.get(f"{PREFIX}{kind}/{r}").decode() for r in found}
        except Exception:  # noqa: BLE001 - the store is gone: `lost` says so
            return {}

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


def start(rank: int, world_size: int, watch: Watch, on_stuck=None, env=os.environ) -> Heartbeat:
    """Start this rank's heartbeat and watchdog (of `watch`; `on_stuck`: Heartbeat's), on the launcher's store when
    there is one to reach (more than one process and its address known)."""
    host, port, store = env.get("MASTER_ADDR"), env.get("MASTER_PORT"), None
    if world_size > 1 and host and (port or "").isdigit():
        import torch.distributed as dist

        try:
            store = dist.TCPStore(
                host, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False
            )
        except Exception:  # noqa: BLE001 - no store: a later failure is reported without the rank named
            store = None
    return Heartbeat(store, rank, world_size, watch, on_stuck).start()


def failure_note(error: BaseException, heartbeat: Heartbeat | None, machines, traceback_in=None) -> str | None:
    """After training failed on this rank: which ranks (and nodes) of `machines` (LaunchPlan.machines)
    stopped answering, or what another rank's watchdog said when it ended that rank, printed on stderr
    (with `traceback_in`, the file the error's traceback goes to) and returned for run.json; None in a
    one-process run, when every rank is still there, and for an interruption or a user error (nothing was lost)."""
    if (
        heartbeat is None
        or heartbeat.store is None
        or not machines.ranks
        or isinstance(error, (KeyboardInterrupt, SystemExit, UserError))
    ):
        return None
    stuck = "; ".join(heartbeat.told("stuck").values())  # another rank's watchdog ended it: what every rank waited in
    lost, store_error = ([], None) if stuck else heartbeat.lost()
    if stuck:
        note = f"stuck: {stuck}"
    elif store_error:  # the store lives in the launcher of node rank 0
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
    nodes_left = "" if stuck else ", on the nodes left too"
    print(
        f"finetune: rank {heartbeat.rank} on node {me.node if me else None}: {note}; this rank stops "
        f"({type(error).__name__}{f'; traceback: {traceback_in}' if traceback_in else ''}). Continue from the last "
        f"complete checkpoint with --resume{nodes_left} "
        f"(docs/faults.md)",
        file=sys.stderr,
        flush=True,
    )
    return note


# --- progress files, for `finetune train` (docs/faults.md) ---------------------------------------------


def progress_directory(env=os.environ) -> Path | None:
    state = env.get(relay.ENV)
    return Path(state) if state else None


def progress_writer(rank: int, watch: Watch):
    """A function that writes this rank's beat and `watch`'s step (called by its heartbeat thread), or None without
    `finetune train`."""
    where = progress_directory()
    if where is None:
        return None
    path = where / f"rank-{rank}.json"
    note = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname()}

    def beat():
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({**note, "step": watch.step, "beat": time.time()}))
            tmp.replace(path)
        except OSError:
            pass  # the launch ended and took its directory, or the disk is full: nothing to report to

    return beat


def read_progress(where: Path | None = None) -> dict[int, dict]:
    """Every rank's last beat, by rank."""
    where = where or progress_directory()
    beats = {}
    for path in sorted(where.glob("rank-*.json")) if where and where.is_dir() else []:
        try:
            b = json.loads(path.read_text())
            beats[int(b["rank"])] = b
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return beats


def stalled(beats: dict[int, dict], failed_at: dict[int, float]) -> dict[int, str]:
    """The ranks that stopped making progress, with why: those whose last beat is STALL_S older than the moment another
    rank failed, and than their own end (pure; `failed_at`: rank -> time its failure was seen)."""
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


# --- once on rank 0; teardown; collective timeouts ---------------------------------------------------


def run_on_main(state, fn):
    """Run `fn` on the main process and return its result on every rank. A UserError raised
    there is raised on every rank, so all processes stop together instead of some hanging."""
    result, error = None, None
    if state.is_main_process:
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        result, error = broadcast_object_list([result, error], from_process=0)
    if error is not None:
        raise UserError(error)
    return result


class Teardown:
    """Destroys the default process group when the interpreter exits (atexit: after main returns, sys.exit or an
    uncaught error, before C++ teardown), so gloo's teardown cannot abort a finished process (docs/faults.md "Process
    teardown"). Once every rank is done (`ended_cleanly`), the ranks meet at a barrier first."""

    def __init__(self, state):
        self.state, self.clean = state, False
        atexit.register(lambda: close_process_group(self.state, clean=self.clean))

    def ended_cleanly(self) -> None:
        self.clean = True


def close_process_group(state, *, clean: bool) -> None:
    """What Teardown does at exit: after a clean end a barrier, then destroy; after an error destroy
    only a group that cannot have NCCL work in flight."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if clean and state.num_processes > 1:
        state.wait_for_everyone()  # a barrier on this rank's own device (NCCL) or gloo's
    if clean or not _may_use_nccl(dist):
        state.destroy_process_group()


def _may_use_nccl(dist) -> bool:
    """Whether the default group can have NCCL work in flight. By the backend config, not
    get_backend(): a group Accelerate initialised without a backend reads "undefined" but is gloo."""
    import torch

    return "nccl" in str(dist.get_backend_config()) and torch.cuda.is_available()


def set_collective_timeout(seconds: float) -> None:
    """Every process group's collective timeout (the default group's and DeepSpeed's own), for the
    phases from here on: after training the watchdog's limits end a stuck rank cleanly, so the backend's own timeout, which raises deep inside a collective
    (gloo) or aborts the process (NCCL), is set past the longest of them."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timedelta(seconds=seconds), group)

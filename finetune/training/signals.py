"""Stop signals recorded instead of raised (so a second one cannot interrupt a checkpoint being written), and every
rank's outcome agreed at fixed points (docs/faults.md "Signals", "Hangs and every stop signal").
"""

from __future__ import annotations

import os
import signal
import threading
import time

from finetune.config.sections import STOP_SIGNALS
from finetune.console import write_line
from finetune.launch import peers, relay

SIGNALS = tuple(signal.Signals[name] for name in STOP_SIGNALS)
RELAYED = 64  # added to a relayed signal's number in the flags the ranks exchange
FAILED = 256  # added to a rank's flag at a phase boundary when its phase failed

# What the process does with a signal now; set by finetune/training/run.py as the run goes on.
STARTING, TRAINING, FINISHING, EXPORTING = "starting", "training", "finishing", "exporting"
WHAT_NOW = {
    STARTING: "stopping before training starts (nothing trained yet, nothing to save)",
    TRAINING: "stopping at the end of this optimizer step, after a complete checkpoint",
    FINISHING: "training is done: stopping after a checkpoint of the final step (the evaluation on --resume)",
    EXPORTING: "the model is being exported: stopping once it is written, after a checkpoint of the final step",
}


class Stops:
    """This process's stop signals: the handlers that record them (installed at its start, before torch is
    imported: finetune/train.py), what they recorded, the phase boundaries where the ranks agree on them, and
    the watchdog they start (`watch`, finetune/launch/peers.py). One per process, handed to every phase."""

    def __init__(self):
        self.watch = peers.Watch()
        self.received: list[int] = []  # signals received since install()
        self.failures_agreed: list[str] = []  # the phases whose failure every rank agreed on (no rank was lost)
        self.relayed: list[dict] = []  # the relay's note ({"signal", "pid"}) when the first one was relayed
        self.stage = STARTING
        self.previous: dict = {}  # signal -> the handler it had before install()
        self.wanted = list(SIGNALS)  # training.stop_signals
        os.register_at_fork(after_in_child=self.restore)

    def set_stage(self, stage: str) -> None:
        """What a signal does from now on (one of WHAT_NOW's keys); the watchdog names the phase so."""
        self.stage = stage
        label = {STARTING: "the start", TRAINING: "training", EXPORTING: "the export"}.get(stage, "the end of the run")
        self.watch.phase = (label, time.monotonic(), None)

    def handler(self, signum, frame):
        name = signal.Signals(signum).name
        note = relay.relayed_signal()
        quiet = note is not None and note.get("signal") == name and not self.relayed
        if not self.received:
            msg = f"{name} received: {WHAT_NOW[self.stage]}"
            if quiet:
                self.relayed.append(note)
        else:
            msg = f"{name} received again: ignored, the run is stopping"
        self.received.append(signum)
        self.watch.signalled(name)  # the watchdog's grace period starts (finetune/launch/peers.py)
        if not quiet:
            write_line(f"[rank {os.environ.get('RANK', '0')}] {msg}")

    def install(self) -> None:
        """Record the stop signals instead of dying, from process start (ranks reach the trainer at different times;
        one still loading the model when the signal comes must not just die while the others wait for it in a
        collective). Again (the trainer does): no change."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.wanted:
                self.previous.setdefault(sig, signal.signal(sig, self.handler))

    def keep_only(self, names, grace_s: float | None = None) -> None:
        """training.stop_signals: the signals not named get back what they had before (their default action), also
        when the handlers are installed again; training.stop_grace: how long the watchdog waits for a stop to act."""
        self.wanted = [sig for sig in SIGNALS if sig.name in names]
        for sig in SIGNALS:
            if sig not in self.wanted and sig in self.previous:
                signal.signal(sig, self.previous.pop(sig))
        self.watch.grace_s = grace_s

    def restore(self) -> None:
        """The handlers back to what they were: after a run that completed (a signal during teardown ends the
        process as usual), and in a process forked from a rank (datasets' map pool, DataLoader workers), which dies
        of SIGTERM again: Pool.terminate() SIGTERMs its workers, then joins them; a worker that only recorded it
        would hold the rank forever."""
        for sig, old in self.previous.items():
            signal.signal(sig, old)
        self.previous.clear()

    def code(self) -> int:
        """This process's flag for the exchange: 0, the first signal's number, + RELAYED if relayed."""
        if not self.received:
            return 0
        return self.received[0] + (RELAYED if self.relayed else 0)

    def check_interrupt(self) -> None:
        """Called per row by a phase without collectives: raise Interrupted once a stop is pending."""
        if self.received or self.watch.peer_stop:
            raise Interrupted(self.watch.peer_stop or signal.Signals(self.received[0]).name)

    def describe(self, flags: list[int]) -> dict:
        """{signal, ranks, relayed_by} from the exchanged signal flags (at least one non-zero)."""
        flags = [n % FAILED for n in flags]
        ranks = [r for r, n in enumerate(flags) if n]
        first = flags[ranks[0]]
        by = self.relayed[0]["pid"] if self.relayed else None
        return {
            "signal": signal.Signals(first % RELAYED).name,
            "ranks": ranks,
            "relayed_by": by if first > RELAYED else None,
        }

    def agree(self, state, what: str, error: BaseException | None = None, *, with_signals: bool = True) -> list[int]:
        """A phase boundary every rank reaches, whether its phase (`what`) failed (`error`) or not: one
        all-gather of each rank's signal flag and failure (docs/faults.md "Hangs and every stop signal").
        A failure on any rank raises on every rank before any of them enters another collective (its own
        error, or FailedElsewhere); otherwise every rank's signal flag (all 0: no signal)."""
        with self.watch.waiting(f"the ranks' agreement ({what})"):
            mine = (self.code() if with_signals else 0) + (FAILED if error is not None else 0)
            flags = flags_per_rank(state, mine)
            failed = [r for r, n in enumerate(flags) if n >= FAILED]
            errors = (
                _gather_text(state, f"{type(error).__name__}: {error}" if error is not None else "") if failed else []
            )
        if any(flags):
            self.watch.acted()  # the stop (or failure) is agreed: the watchdog's grace period ends
        if failed:
            self.failures_agreed.append(what)
        if error is not None:
            raise error
        if failed:
            said = "; ".join(f"rank {r}: {errors[r]}" for r in failed)
            raise FailedElsewhere(f"{what}: failed on rank(s) {failed} ({said}); every rank stopped with it")
        return flags

    def stop_if_received(self, state, where: str, error: BaseException | None = None) -> None:
        """At a phase boundary every rank reaches (`where`: how a stop names it): a failure on any rank
        raises on every rank (agree); else Stopped on every rank if any was signalled."""
        flags = self.agree(state, where, error)
        if any(flags):
            raise Stopped(self.describe(flags), where)

    def phase(self, state, where: str, fn, label: str):
        """A phase before training (the watchdog names a rank in it by `label`), then its boundary
        (stop_if_received): a failure on any rank raises on every rank, a stop signal on any rank stops
        every rank. A phase without collectives (the data build) ends early on a stop signal (Interrupted)."""
        result = error = interrupted = None
        try:
            with self.watch.during(label):
                result = fn()
        except Interrupted as e:
            interrupted = e
        except Exception as e:  # noqa: BLE001 - agreed at the boundary, then raised on every rank
            error = e
        self.stop_if_received(state, where, error=error)
        if interrupted:  # a stop signal always reaches the boundary above: it stopped every rank
            raise RuntimeError(f"interrupted ({interrupted}) {where}, but no rank said it was signalled")
        return result


def stop_with_parent(env=os.environ) -> None:
    """Linux: SIGTERM this process when the launcher that started it dies (killed with SIGKILL, or gone without
    relaying): handled as a preemption, so an orphaned rank checkpoints and stops instead of training on alone. Only in
    a launched process (torchrun, accelerate launch, finetune train), not in one that called main() itself."""
    if not any(k in env for k in ("LOCAL_RANK", "ACCELERATE_MIXED_PRECISION", relay.ENV)):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Interrupted(Exception):
    """A stop signal reached this rank, or another rank's (through the watchdog's store), during a phase
    that ends early for it (the data build); the boundary after the phase stops every rank."""


def flags_per_rank(state, value: int) -> list[int]:
    """Every rank's value, on every rank (one all-gather); the ranks agree by construction.
    `state`: an Accelerator or a PartialState (before the trainer exists)."""
    if state.num_processes == 1:
        return [int(value)]
    import torch
    from accelerate.utils import gather

    return [int(x) for x in gather(torch.tensor([int(value)], device=state.device)).tolist()]


def cause(p: dict) -> str:
    """How a stop is named in run.json and on the console."""
    if p.get("relayed_by"):
        return f"{p['signal']} to finetune train (pid {p['relayed_by']}), relayed to every rank"
    return f"{p['signal']} on rank(s) {p['ranks']}"


class Stopped(Exception):
    """Every rank agreed to stop outside a training step (before training, or after it)."""

    def __init__(self, stop: dict, where: str):
        super().__init__(f"{cause(stop)} {where}")
        self.stop = stop
        self.where = where


class FailedElsewhere(RuntimeError):
    """Another rank's phase failed: this rank stops with it (the message carries that rank's error)."""


def _gather_text(state, text: str) -> list[str]:
    if state.num_processes == 1:
        return [text]
    from accelerate.utils import gather_object

    return gather_object([text])

"""SIGTERM/SIGINT recorded instead of raised, and flags agreed across ranks.

The handler only records the signal (it never raises, so a second signal cannot interrupt a
checkpoint being written; it is logged and ignored). The signal number rides on each optimizer
step's one agreement of the ranks (finetune/training/step_guard.py), so all ranks stop at the same
step boundary whichever rank was signalled.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)

received: list[int] = []  # signals received by this process since install_signal_handlers()

_previous: dict = {}


def _handler(signum, frame):
    name = signal.Signals(signum).name
    if not received:
        msg = f"{name} received: stopping at the end of this optimizer step, after a complete checkpoint\n"
    else:
        msg = f"{name} received again: ignored, the checkpoint is being written\n"
    received.append(signum)
    os.write(sys.stderr.fileno(), f"[rank {os.environ.get('RANK', '0')}] {msg}".encode())


def install_signal_handlers() -> None:
    """Record SIGTERM/SIGINT instead of dying, from process start (ranks reach the trainer at
    different times; one still loading the model when the signal comes must not just die while
    the others wait for it in a collective). Training stops at the first step boundary after."""
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            _previous.setdefault(sig, signal.signal(sig, _handler))


def restore_signal_handlers() -> None:
    """After training: a signal during the final evaluation or export ends the process as usual."""
    for sig, old in _previous.items():
        signal.signal(sig, old)
    _previous.clear()

"""`finetune train` keeps charge of the processes it launched until they end (docs/faults.md "Signals": which signals,
from where, and what the ranks do). A stop signal sent to it is relayed to every rank once, and it waits for them and
passes their exit code on; a second one is ignored while they write. The ranks run in their own sessions, so a
terminal's Ctrl-C reaches the wrapper alone. A rank is sent the signal only once it catches it (its SigCgt mask in
/proc), so a rank still starting up is not killed by it; the ranks read the launch's state directory (ENV) to tell a
relayed signal from one sent to them directly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

from finetune.config.sections import STOP_SIGNALS
from finetune.console import write_line
from finetune.errors import EXIT_PREEMPTED

ENV = "FINETUNE_LAUNCH_STATE"  # the launch's state directory, inherited by every rank
RELAYED = "relayed.json"  # written there before the first relayed signal is sent
SIGNALS = tuple(signal.Signals[name] for name in STOP_SIGNALS)
POLL_S = 0.1  # how often the relay looks for ranks to signal


def relayed_signal(env=os.environ) -> dict | None:
    """In a rank: {"signal": name, "pid": wrapper pid} once `finetune train` relayed a signal, else None."""
    state = env.get(ENV)
    if not state:
        return None
    try:
        return json.loads((Path(state) / RELAYED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (Linux: the SigCgt mask of /proc/PID/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


class Relay:
    """Installed by `finetune train` around the launch; `signals` lists what it received."""

    def __init__(self):
        self.signals: list[int] = []
        self.state_dir = Path(tempfile.mkdtemp(prefix="finetune-launch-"))
        self._sent: set[int] = set()
        self._previous: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._relay_loop, name="finetune-signal-relay", daemon=True)

    def __enter__(self) -> Relay:
        os.environ[ENV] = str(self.state_dir)
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)
        self._thread.start()
        return self

    def keep_only(self, names) -> None:
        """training.stop_signals: the signals not named get back what they had (their default action)."""
        for sig in list(self._previous):
            if sig.name not in names:
                signal.signal(sig, self._previous.pop(sig))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        os.environ.pop(ENV, None)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def _handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signals:
            write_line(f"finetune: {name} received again: ignored while the ranks write their checkpoint")
            self.signals.append(signum)
            return
        body = json.dumps({"signal": name, "pid": os.getpid()})
        tmp = self.state_dir / (RELAYED + ".tmp")
        try:
            tmp.write_text(body, encoding="utf-8")
            tmp.replace(self.state_dir / RELAYED)
        except OSError:
            pass  # the ranks then print their own line; the relay itself goes on
        self.signals.append(signum)
        write_line(
            f"finetune: {name} received: every rank stops after its current optimizer step with a complete "
            f"checkpoint, then exits {EXIT_PREEMPTED} (a second signal is ignored while it is written)"
        )

    def _relay_loop(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(POLL_S):
            if not self.signals:
                continue
            signum = self.signals[0]
            try:
                children = me.children()
            except psutil.Error:
                continue
            for child in children:
                if child.pid not in self._sent and catches(child.pid, signum):
                    try:
                        os.kill(child.pid, signum)
                        self._sent.add(child.pid)
                    except OSError:
                        pass


# torchrun's agent (run in this process by accelerate launch) would turn SIGTERM/SIGINT/SIGHUP into
# an exception that stops it waiting for the ranks (a second signal during the checkpoint then ends
# `finetune train` before the ranks have); with a relay it handles SIGQUIT only. accelerate passes
# every attribute of its namespace that torchrun's parser knows on to torchrun.
TORCHRUN_SIGNALS = "SIGQUIT"


def one_process_launcher(args) -> None:
    """accelerate's simple_launcher (one process), with the process in its own session so that a
    terminal's signals reach `finetune train` alone and are relayed once (module docstring)."""
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    cmd, env = prepare_simple_launcher_cmd_env(args)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    if proc.wait() != 0:
        raise subprocess.CalledProcessError(returncode=proc.returncode, cmd=cmd)

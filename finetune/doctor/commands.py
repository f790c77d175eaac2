"""Running `finetune` subcommands (train, bench-comm) as the user would type them, one at a time,
each in its own process group with its output in a log file and a time limit."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from finetune.launch import cpu_rehearsal


@dataclass
class Finished:
    command: list[str]
    returncode: int  # 124: killed at the time limit
    seconds: float
    log: Path
    tail: list[str]  # the last lines of its output

    def shown(self) -> str:
        return shown(self.command)

    def error_line(self) -> str:
        """The line of the output that says what went wrong, else its last line."""
        for line in reversed(self.tail):
            if line.startswith(("error:", "finetune: rank")) or "Error:" in line:
                return line.strip()
        return next((t.strip() for t in reversed(self.tail) if t.strip()), "no output")


def finetune_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "finetune.cli", *args]


def shown(command: list[str]) -> str:
    """A command as the user would type it (`finetune ...` for the finetune CLI)."""
    if command[1:3] == ["-m", "finetune.cli"]:
        return "finetune " + shlex.join(command[3:])
    return shlex.join(command)


def run(command: list[str], log: Path, timeout: float, env: dict | None = None) -> Finished:
    """Run to the end (or the time limit, when the whole group is killed); output to `log`.
    The CPU/gloo opt-in is never inherited: `finetune train --cpu` and `bench-comm --cpu` set it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = cpu_rehearsal.without_opt_in()
    full_env.update({"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = 124
        except BaseException:  # Ctrl-C: take the launched ranks down with us
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-40:]
    if code == 124:
        tail.append(f"killed after {timeout:.0f} s (the doctor's time limit for this command)")
    return Finished(command, code, time.monotonic() - start, log, tail)

"""One writer per run directory (finetune/launch/run_lock.py, finetune/launch/rundir.py): a live
holder is named and nothing of its directory is touched; a dead one leaves no stale lock; of runs
that claim a new directory at once exactly one wins."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from finetune.config.sections import Config
from finetune.errors import UserError
from finetune.launch import run_lock, rundir
from tests.conftest import REPO

HOLDER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from pathlib import Path
    from finetune.errors import UserError
    from finetune.launch import run_lock
    start = Path(sys.argv[3])
    while not start.exists():  # every contender starts here at once
        time.sleep(0.01)
    try:
        run_lock.Locks().acquire(Path(sys.argv[2]))
    except UserError as e:
        print("refused:", e, flush=True)
        sys.exit(2)
    print("holding", flush=True)
    time.sleep(float(sys.argv[4]))
    """
)


def _holder(run_dir: Path, start: Path, hold_s: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(REPO), str(run_dir), str(start), str(hold_s)],
        stdout=subprocess.PIPE,
        text=True,
    )


def _kill(*procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_live_run_is_named_and_its_death_leaves_no_stale_lock(tmp_path):
    run_dir = tmp_path / "runs" / "exp"
    start = tmp_path / "go"
    start.touch()
    holder = _holder(run_dir, start, 120)
    try:
        assert holder.stdout.readline().strip() == "holding"
        (run_dir / "checkpoint-1").mkdir()
        message = run_lock.live_run(run_dir)
        assert message and f"in use by a live run: pid {holder.pid} on host {socket.gethostname()}" in message
        assert f"kill -TERM {holder.pid}" in message and "nothing was changed" in message
        locks = run_lock.Locks()
        with pytest.raises(UserError, match=f"pid {holder.pid}"):
            locks.acquire(run_dir)
        # --overwrite of the live run's directory: refused before anything is deleted
        cfg = Config(recipe="demo").replaced("run", output_dir=str(run_dir), overwrite=True)
        with pytest.raises(UserError, match="in use by a live run"):
            rundir.create(cfg, locks)
        assert (run_dir / "checkpoint-1").is_dir() and locks.held == {}
        holder.send_signal(signal.SIGKILL)  # dies without any cleanup
        holder.wait()
        assert run_lock.live_run(run_dir) is None
        locks.acquire(run_dir)  # the kernel released it
        assert run_lock.holder(run_dir)["pid"] == os.getpid()
    finally:
        locks.release_all()
        _kill(holder)
    assert not (run_dir / run_lock.LOCK).exists()  # let go of, and its file removed


def test_of_runs_claiming_one_new_directory_at_once_exactly_one_wins(tmp_path):
    run_dir = tmp_path / "runs" / "same-name"
    start = tmp_path / "go"
    contenders = [_holder(run_dir, start, 5) for _ in range(4)]
    try:
        time.sleep(1.0)  # all four waiting at the start line
        start.touch()
        codes = [p.wait(timeout=60) for p in contenders]
        outs = [p.stdout.read() for p in contenders]
    finally:
        _kill(*contenders)
    winners = [p.pid for p, c in zip(contenders, codes, strict=True) if c == 0]
    assert len(winners) == 1 and codes.count(2) == 3, (codes, outs)
    assert all(f"in use by a live run: pid {winners[0]}" in o for o, c in zip(outs, codes, strict=True) if c == 2), outs


def test_the_lock_file_is_not_content_and_survives_overwrite_and_reuse(tmp_path, capsys):
    run_dir = tmp_path / "exp"
    locks = run_lock.Locks()
    locks.acquire(run_dir)
    try:
        assert rundir.contents(run_dir) == [] and (run_dir / run_lock.LOCK).is_file()
        rundir.prepare_run_dir(run_dir, overwrite=False)  # only the lock: a fresh directory
        (run_dir / "run.json").write_text('{"summary": {"status": "running"}, "steps": []}')
        (run_dir / "config.yaml").write_text("x: 1\n")
        rundir.prepare_run_dir(run_dir, overwrite=False)  # died before its first step: reused
        assert "its run died before its first step" in capsys.readouterr().out
        (run_dir / "checkpoint-2").mkdir()
        rundir.prepare_run_dir(run_dir, overwrite=True)
        assert sorted(p.name for p in run_dir.iterdir()) == sorted([run_lock.LOCK, rundir.MARKER])
        assert run_lock.live_run(run_dir) is None  # ours; still held: another process is refused
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import sys; sys.path.insert(0, {str(REPO)!r}); from finetune.launch import "
                f"run_lock; print(run_lock.live_run({str(run_dir)!r}))",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        assert f"pid {os.getpid()}" in probe.stdout, probe.stdout
    finally:
        locks.release_all()


def test_a_run_interrupted_before_its_first_step_leaves_a_directory_the_retry_reuses(tmp_path):
    run_dir = tmp_path / "exp"
    run_dir.mkdir()
    (run_dir / "run.json").write_text('{"summary": {"status": "interrupted", "error": "stopped by SIGTERM"}}')
    assert "was interrupted before its first step (stopped by SIGTERM)" in rundir.reusable(run_dir)
    (run_dir / "run.json").write_text('{"summary": {"status": "interrupted", "steps": 2}}')
    assert rundir.reusable(run_dir) is None

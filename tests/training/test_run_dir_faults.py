"""The run directory under faults, through `finetune train` (docs/faults.md "One writer per run
directory", "Disk full, read-only"): a --resume against a live run is refused and touches nothing;
a disk that fills during a checkpoint save (a real tmpfs, and an injected ENOSPC on one of two
ranks) ends the run with the path and the free space named, earlier checkpoints intact and
resumable, the record `failed` with the reason, and the retry works."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from finetune.checkpointing import checkpoints
from finetune.launch import run_lock
from finetune.training import fault_injection as faults
from tests.conftest import REPO, Started
from tests.training.test_faults import CPU_ENV, LANES_TIMEOUT, cli_train, in_lanes, outcome_of
from tests.training.test_interrupts import train_command

pytestmark = pytest.mark.integration


def _hashes(root: Path) -> dict:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def _complete(run_dir: Path, name: str) -> bool:
    return checkpoints.problem(run_dir / name) is None


def _resume_of_a_live_run(tmp_path, tiny_model_dir):
    """Run A saves every step and stalls at step 3 (alive, holding its directory). `finetune train
    --resume` of it: before, accepted (it moved A's newest checkpoint aside and both wrote the same
    files); now exit 2 naming A's pid and host, every file of A byte for byte the same. A killed
    (SIGKILL, no cleanup) leaves no stale lock."""
    run_dir = tmp_path / "run"
    cmd = train_command(tiny_model_dir, run_dir, 3, "--training.save_strategy=steps", "--training.save_steps=1")
    with Started(cmd, cwd=REPO, env={faults.ENV: "hang@rank0,step3"}, out=tmp_path / "a.txt") as job:
        job.wait_until(lambda: _complete(run_dir, "checkpoint-2"), "checkpoint-2 complete")
        holder = run_lock.holder(run_dir)
        before = _hashes(run_dir)
        code, out, _ = cli_train([*cmd[cmd.index("train") + 1 : -1], "--resume"], run_dir=run_dir, env={}, timeout=300)
        assert code == 2, out[-3000:]
        assert f"is in use by a live run: pid {holder['pid']} on host {holder['host']}" in out, out[-3000:]
        assert "Traceback" not in out and "accelerate launch" not in out, out[-3000:]
        assert _hashes(run_dir) == before
        rank0 = psutil.Process(holder["pid"])
        rank0.send_signal(signal.SIGKILL)  # rank 0 crashes, no cleanup
        rank0.wait(timeout=60)
    assert run_lock.live_run(run_dir) is None  # the kernel released it with the process


@contextlib.contextmanager
def small_disk(tmp_path):
    """A 64 MiB tmpfs (root only), unmounted afterwards, also when the test failed."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _disk_fills(tmp_path, tiny_model_dir):
    with small_disk(tmp_path) as disk:
        _disk_fills_on(disk, tmp_path, tiny_model_dir)


def _disk_fills_on(small_disk, tmp_path, tiny_model_dir):
    """A real full filesystem: checkpoint-1 written, then the disk filled to 200 KiB free while
    step 2 runs, so checkpoint-2 (3.9 MB) cannot be written. Before: two chained tracebacks, no
    directory named, run.json left `running`. Now: exit 2, one message with the checkpoint, the free
    space and the checkpoint to resume from; run.json `failed` with it; checkpoint-1 complete, and
    --resume from it completes the run once the space is freed."""
    run_dir = small_disk / "run"
    cmd = train_command(tiny_model_dir, run_dir, 3, "--training.save_strategy=steps", "--training.save_steps=1")
    filler = small_disk / "filler"
    with Started(cmd, cwd=REPO, env={faults.ENV: "pause@rank0,step2"}, out=tmp_path / "out.txt") as job:
        job.wait_until(lambda: _complete(run_dir, "checkpoint-1"), "checkpoint-1 complete")
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        with open(filler, "wb") as f:  # leave 200 KiB: room for run.json, not for a checkpoint
            f.write(b"\0" * (free - 200 * 1024))
        code = job.finish()
        out = job.output
    assert code == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert "error: writing checkpoint" in out, out[-4000:]
    error = out[out.index("error: writing checkpoint") :].splitlines()[0]  # after a progress bar's \r
    assert f"writing checkpoint {run_dir / 'checkpoint-2'} failed: no space left on device" in error, error
    assert "MiB free of 64.0 MiB on its filesystem" in error, error
    assert f"the newest complete checkpoint is {run_dir / 'checkpoint-1'}" in error, error
    summary = json.loads((run_dir / "run.json").read_text())["summary"]
    assert summary["status"] == "failed" and "no space left on device" in summary["error"], summary
    assert [c.name for c in checkpoints.checkpoints(run_dir)] == ["checkpoint-1"]
    filler.unlink()  # space freed: the retry the message names works
    assert checkpoints.newest_valid(run_dir) == run_dir / "checkpoint-1"
    code, out, _ = cli_train([*cmd[cmd.index("train") + 1 : -1], "--resume"], run_dir=run_dir, env={})
    assert code == 0, out[-4000:]
    summary = json.loads((run_dir / "run.json").read_text())["summary"]
    assert summary["status"] == "completed" and summary["steps"] == 3 and summary["resumed_at_step"] == 1, summary


def _export_on_a_full_disk(tmp_path, tiny_model_dir):
    """A real full filesystem during the export: the disk filled to 100 KiB free while step 2 runs, so neither the
    export (its tokenizer files alone are 3.5 MB) nor the checkpoint saved after it fits. Before: two chained library
    tracebacks (safetensors' ENOSPC, then the failed checkpoint's) on the console, then "error: writing the run's files
    failed" without saying which. Now: exit 2 and one message naming the export, the checkpoint that failed too, the
    free space; the tracebacks are for the run's log file (which this disk cannot hold either)."""
    with small_disk(tmp_path) as disk:
        run_dir = disk / "run"
        cmd = train_command(tiny_model_dir, run_dir, 2)
        with Started(cmd, cwd=REPO, env={faults.ENV: "pause@rank0,step2"}, out=tmp_path / "out.txt") as job:
            job.wait_until(lambda: "rank 0 pauses" in job.output, "step 2 paused")
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            with open(disk / "filler", "wb") as f:
                f.write(b"\0" * (free - 100 * 1024))
            code = job.finish()
            out = job.output
        summary = json.loads((run_dir / "run.json").read_text())["summary"]
    assert code == 2, out[-4000:]
    assert "Traceback" not in out and out.count("error: ") == 1, out[-4000:]
    error = out[out.index("error: ") :].splitlines()[0]
    assert f"error: writing the export {run_dir / 'model'} failed: no space left on device" in error, error
    assert "MiB free of 64.0 MiB on its filesystem" in error, error
    assert f"the trained weights could not be saved in a checkpoint either (writing checkpoint {run_dir}" in error
    assert "the last complete checkpoint is none written in this run" in error, error
    assert summary["status"] == "failed" and "writing the export" in summary["error"], summary


def _full_disk_on_one_rank(tmp_path, tiny_model_dir):
    """Rank 1's save of checkpoint-2 fails with ENOSPC (injected after its files are written): the
    ranks agree, both stop with exit 2 instead of rank 0 waiting for rank 1 until the collective
    timeout; the incomplete checkpoint-2 is removed, checkpoint-1 stays complete."""
    run_dir = tmp_path / "run"
    cmd = train_command(
        tiny_model_dir,
        run_dir,
        3,
        "--training.save_strategy=steps",
        "--training.save_steps=1",
        "--training.ddp_timeout=600",
        ranks=2,
    )
    code, out, _ = cli_train(
        cmd[cmd.index("train") + 1 : -1], run_dir=run_dir, env={**CPU_ENV, faults.ENV: "disk_full@rank1,step2"}
    )
    assert code == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    error = f"writing checkpoint {run_dir / 'checkpoint-2'} on rank(s) [1] failed: no space left on device"
    assert error in out, out[-4000:]
    summary = json.loads((run_dir / "run.json").read_text())["summary"]
    assert summary["status"] == "failed" and error in summary["error"], summary
    assert [c.name for c in checkpoints.checkpoints(run_dir)] == ["checkpoint-1"]
    assert _complete(run_dir, "checkpoint-1")


# --- the runs, two at a time (tests/training/test_faults.py in_lanes); each test raises its run's outcome --


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, tiny_model_dir):
    def at(scenario):
        return lambda d: scenario(d, tiny_model_dir)

    lanes = [
        [
            ("test_a_disk_that_fills_during_a_checkpoint_save_is_named_and_loses_nothing", at(_disk_fills)),
            ("test_a_full_disk_during_the_export_is_one_message_without_tracebacks", at(_export_on_a_full_disk)),
        ],
        [
            ("test_a_full_disk_on_one_of_two_ranks_stops_both_with_the_checkpoint_named", at(_full_disk_on_one_rank)),
            ("test_a_resume_against_a_live_run_is_refused_naming_it_and_changes_nothing", at(_resume_of_a_live_run)),
        ],
    ]
    return in_lanes(request, tmp_path_factory, lanes)


@LANES_TIMEOUT
def test_a_resume_against_a_live_run_is_refused_naming_it_and_changes_nothing(runs, request):
    outcome_of(runs, request)  # _resume_of_a_live_run


@LANES_TIMEOUT
def test_a_disk_that_fills_during_a_checkpoint_save_is_named_and_loses_nothing(runs, request):
    outcome_of(runs, request)  # _disk_fills


@LANES_TIMEOUT
def test_a_full_disk_on_one_of_two_ranks_stops_both_with_the_checkpoint_named(runs, request):
    outcome_of(runs, request)  # _full_disk_on_one_rank


@LANES_TIMEOUT
def test_a_full_disk_during_the_export_is_one_message_without_tracebacks(runs, request):
    outcome_of(runs, request)  # _export_on_a_full_disk

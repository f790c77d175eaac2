"""Naming the rank that stopped making progress (finetune/launch/peers.py progress files, report_failed_ranks)."""

from __future__ import annotations

from types import SimpleNamespace

from finetune.launch import peers
from finetune.launch.accelerate import report_failed_ranks

T = 1_000_000.0  # when rank 0's collective timed out


def _beat(rank, at, step):
    return {"rank": rank, "pid": 100 + rank, "host": "node", "step": step, "beat": at}


def test_a_stopped_rank_is_named_as_the_cause_and_the_rank_that_timed_out_as_a_consequence(capsys):
    """SIGSTOP on rank 1 after step 1: its beats end then; rank 0 beats on while it waits, times out
    60 s later and exits 1; torchrun kills rank 1 30 s after that."""
    beats = {0: _beat(0, T - 0.5, 1), 1: _beat(1, T - 60, 1)}
    failures = {
        0: SimpleNamespace(exitcode=1, timestamp=T, local_rank=0, pid=100),
        1: SimpleNamespace(exitcode=-9, timestamp=T + 30, local_rank=1, pid=101),
    }
    assert peers.stalled(beats, {r: f.timestamp for r, f in failures.items()}).keys() == {1}
    assert report_failed_ranks(failures, beats) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("finetune: rank 1 stopped making progress: its last heartbeat came 60 s before")
    assert "after step 1 (pid 101 on node)" in lines[0]
    assert lines[1] == "finetune: rank 1 (local rank 1, pid 101) failed: killed by SIGKILL (stalled: the cause)"
    assert lines[2] == (
        "finetune: rank 0 (local rank 0, pid 100) failed: exit code 1 (a consequence: it waited for rank(s) [1])"
    )


def test_a_rank_that_died_is_not_called_stalled(capsys):
    """Killed outright: its beats end when it dies, which is when it failed: the first failure, as before."""
    beats = {0: _beat(0, T + 1, 2), 1: _beat(1, T - 0.5, 2)}
    failures = {
        1: SimpleNamespace(exitcode=-9, timestamp=T, local_rank=1, pid=101),
        0: SimpleNamespace(exitcode=1, timestamp=T + 2, local_rank=0, pid=100),
    }
    assert peers.stalled(beats, {r: f.timestamp for r, f in failures.items()}) == {}
    assert report_failed_ranks(failures, beats) == 1
    err = capsys.readouterr().err
    assert "stopped making progress" not in err
    assert "rank 1 (local rank 1, pid 101) failed: killed by SIGKILL (first failure)" in err


def test_heartbeats_are_written_and_read_back(tmp_path, monkeypatch):
    import time

    from finetune.launch import relay

    monkeypatch.setenv(relay.ENV, str(tmp_path))
    watch = peers.Watch()
    beat = peers.Heartbeat(None, 3, 1, watch).start()  # the rank's heartbeat thread writes its file
    watch.step = 7
    try:
        deadline = time.monotonic() + 20
        while peers.read_progress().get(3, {}).get("step") != 7 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        beat.stop()
    got = peers.read_progress()[3]
    assert got["step"] == 7 and got["pid"] > 0 and abs(got["beat"] - time.time()) < 20

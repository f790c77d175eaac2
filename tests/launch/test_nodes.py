"""The node layout (finetune/launch/nodes.py, LaunchPlan.machines), run.json `nodes` and the
parameter count it shares with the live evidence, the lost-rank diagnosis (finetune/launch/peers.py)
and what the SLURM script asks between requeues (finetune/training/slurm_job.py), without launching
anything; the real two-node runs are in tests/multinode/."""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from finetune.checkpointing import checkpoints
from finetune.errors import UserError
from finetune.launch import nodes, peers
from finetune.launch.plan import Machines
from finetune.training import slurm_job
from finetune.training.strategy_evidence import held_elements
from tests.conftest import free_port


def place(rank, node_rank, node):
    return nodes.this_rank(rank, 0, {"GROUP_RANK": str(node_rank), "SLURMD_NODENAME": node})


def machines_of(*places, env=None) -> Machines:
    """Machines as a launched process gathers them, from made-up places (each rank's own)."""
    state = SimpleNamespace(num_processes=len(places), process_index=0)
    gathered = list(reversed(places))  # out of order: gather sorts them by rank

    def all_gather(mine):
        return gathered

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nodes, "all_gather", all_gather)
        for key, value in (env or {}).items():
            mp.setenv(key, value)
        return Machines.gathered(state, processes_per_machine=1)


@pytest.mark.parametrize(
    "env, node_rank, source",
    [
        ({"GROUP_RANK": "1", "SLURM_NODEID": "0", "SLURMD_NODENAME": "node2"}, 1, "GROUP_RANK"),  # the launch's wins
        ({"SLURM_NODEID": "1", "SLURMD_NODENAME": "node2"}, 1, "SLURM_NODEID"),
        ({}, 0, "one machine"),
    ],
)
def test_each_rank_says_where_it_runs(env, node_rank, source):
    got = nodes.this_rank(3, 1, env)
    assert (got.rank, got.local_rank, got.node_rank, got.node_rank_from) == (3, 1, node_rank, source)
    assert got.node == env.get("SLURMD_NODENAME", got.hostname) and got.pid == os.getpid()


def test_one_process_gathers_itself_and_the_slurm_step_from_its_environment(monkeypatch):
    for key in ("GROUP_RANK", "SLURM_NODEID", "SLURMD_NODENAME", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    alone = Machines.gathered(SimpleNamespace(num_processes=1), processes_per_machine=1)
    assert (alone.num_machines, [r.rank for r in alone.ranks], alone.slurm) == (1, [0], None)
    assert alone.ranks[0].pid == os.getpid() and alone.ranks[0].node_rank_from == "one machine"
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_STEP_NUM_NODES": "2"}
    assert nodes.SlurmStep.from_env({**env, "SLURM_RESTART_COUNT": "1"}) == nodes.SlurmStep("7", "node[1-2]", 2, 1)
    assert nodes.SlurmStep.from_env(env).restart_count == 0 and nodes.SlurmStep.from_env({}) is None


def test_machines_are_the_distinct_node_ranks_and_the_record_sums_per_node():
    machines = machines_of(place(0, 0, "a"), place(1, 0, "a"), place(2, 1, "b"), env={"SLURM_JOB_ID": "7"})
    assert (machines.num_machines, [r.rank for r in machines.ranks]) == (2, [0, 1, 2])
    assert (machines.ranks_on(0), machines.ranks_on(1), machines.place(2).node) == ([0, 1], [2], "b")
    got = nodes.section(machines)  # when the trainer exists: no figure yet
    assert (got["world_size"], got["num_machines"], got["node_rank_from"]) == (3, 2, "GROUP_RANK")
    assert got["slurm"] == {"job_id": "7", "job_nodelist": None, "step_nodes": None, "restart_count": 0}
    assert [r["rank"] for r in got["ranks"]] == [0, 1, 2] and "node_rank_from" not in got["ranks"][0]
    assert got["per_node"][0]["params_local"] is None and got["param_partition"] is None
    figures = [
        {"params_local": 35, "params_full": 100, "host_peak_rss_gib": 1.0},
        {"params_local": 35, "params_full": 100, "host_peak_rss_gib": 1.25},
        {"params_local": 30, "params_full": 100, "host_peak_rss_gib": 1.5},
    ]
    got = nodes.section(machines, figures, "zero3 partitions (ds_tensor of ds_numel)")
    assert got["per_node"] == [
        {
            "node_rank": 0,
            "node": "a",
            "ranks": [0, 1],
            "params_local": 70,
            "param_fraction": 0.7,
            "host_peak_rss_gib": 2.25,
        },
        {
            "node_rank": 1,
            "node": "b",
            "ranks": [2],
            "params_local": 30,
            "param_fraction": 0.3,
            "host_peak_rss_gib": 1.5,
        },
    ]
    assert got["ranks"][2]["host_peak_rss_gib"] == 1.5 and got["param_partition"].startswith("zero3")
    # a figure not read yet on one rank of a node leaves the node's figure null, not a partial sum
    partial = nodes.section(machines, [figures[0], dict(nodes.NO_FIGURES), figures[2]])
    assert partial["per_node"][0]["params_local"] is None and partial["per_node"][1]["params_local"] == 30


def test_the_parameter_count_reads_zero3_partitions_and_whole_parameters():
    """strategy_evidence.held_elements, which the live evidence and run.json `nodes` share, on made-up
    ZeRO-3 parameters (a partition `ds_tensor` of `ds_numel` elements, as DeepSpeed sets them)."""
    whole = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(5))]
    assert held_elements(whole) == (17, 17, "replicated (every rank holds every parameter)")
    partitioned = []
    for numel, held in ((12, 6), (5, 3)):  # 5 elements over 2 ranks: a padded partition of 3
        p = torch.nn.Parameter(torch.zeros(0))
        p.ds_numel, p.ds_tensor = numel, torch.zeros(held)
        partitioned.append(p)
    assert held_elements(partitioned) == (9, 17, "zero3 partitions (ds_tensor of ds_numel)")


# --- which ranks are lost ------------------------------------------------------------------------


@pytest.fixture
def store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)


def test_a_rank_that_stops_beating_is_named_and_one_that_says_it_is_failing_is_not(store):
    """Rank 0 diagnoses; rank 1 keeps beating; rank 2 stopped (its counter stands); rank 3 stopped
    but said it is failing too (it saw the same loss and exited first)."""
    beating = peers.Heartbeat(store, 1, 4, peers.Watch()).start()
    store.add(f"{peers.PREFIX}beat/2", 5)
    store.set(f"{peers.PREFIX}failing/3", "1")
    try:
        me = peers.Heartbeat(store, 0, 4, peers.Watch())
        assert me.lost(watch_s=4 * peers.BEAT_S) == ([2], None)
        assert store.check([f"{peers.PREFIX}failing/0"])  # said first, so a slower rank does not name it
    finally:
        beating.stop()
    assert not beating._thread.is_alive()


def test_what_a_rank_tells_on_ending_reaches_the_others_by_kind(store):
    """A rank out of GPU memory (or ended by its watchdog) tells why on the store; the ranks left read it by kind,
    not their own, and nothing when no rank told (the control) or there is no store (one process)."""
    ran_out, left = peers.Heartbeat(store, 1, 3, peers.Watch()), peers.Heartbeat(store, 0, 3, peers.Watch())
    assert left.told("oom") == {}
    ran_out.tell("oom", "rank 1 ran out of GPU memory (CUDA out of memory.)")
    assert left.told("oom") == {1: "rank 1 ran out of GPU memory (CUDA out of memory.)"}
    assert left.told("stuck") == {} and ran_out.told("oom") == {}  # another kind; its own account
    alone = peers.Heartbeat(None, 0, 1, peers.Watch())
    alone.tell("oom", "said to no one")
    assert alone.told("oom") == {}


def test_a_rank_left_by_one_that_ran_out_is_ended_by_its_watchdog_recording_that_ranks_line(store, monkeypatch):
    """Under NCCL a rank left by another that ran out of GPU memory may wait in its collective until torchrun kills
    it, its record never saying why; its watchdog ends it LEFT_S after the other told, recording the other's line
    (rank 0's run.json). A phase with a limit of its own (a save) is never cut short by it: the control."""
    monkeypatch.setattr(peers, "LEFT_S", 2 * peers.BEAT_S)
    ended = []
    monkeypatch.setattr(
        peers.Heartbeat, "_end_stuck", lambda self, cause, record=None: ended.append((self.rank, cause, record))
    )
    saving, training = peers.Watch(), peers.Watch()
    waits = [peers.Heartbeat(store, 0, 3, training).start(), peers.Heartbeat(store, 2, 3, saving).start()]
    with saving.during("the save of checkpoint-2", limit_s=60):
        peers.Heartbeat(store, 1, 3, peers.Watch()).tell("oom", "rank 1 ran out of GPU memory (CUDA out of memory.)")
        time.sleep(6 * peers.BEAT_S)
        for beating in waits:
            beating.stop()
    assert training.left_by[:2] == saving.left_by[:2] == (1, "oom")
    assert ended and {(rank, record) for rank, _, record in ended} == {
        (0, "rank 1 ran out of GPU memory (CUDA out of memory.)")
    }
    assert ended[0][1].startswith("was left by rank 1 (it ran out of GPU memory, said above)"), ended


def test_a_store_that_no_longer_answers_is_reported_not_raised():
    class Gone:
        def set(self, *a):
            raise RuntimeError("Connection reset by peer")

    assert peers.Heartbeat(Gone(), 1, 2, peers.Watch()).lost(watch_s=0) == (
        [],
        "RuntimeError: Connection reset by peer",
    )
    alone = peers.start(0, 1, peers.Watch(), env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    alone.stop()
    assert alone.store is None  # one process: no store (the thread still watches)


def test_the_failure_note_names_the_lost_node_and_rank(capsys):
    machines = machines_of(place(0, 0, "node1"), place(1, 1, "node2"))

    class Seen:
        rank, store = 0, "the launcher's"

        def __init__(self, lost, error=None):
            self.result = (lost, error)

        def lost(self):
            return self.result

        def told(self, kind):
            return {}  # no other rank's watchdog ended it

    note = peers.failure_note(RuntimeError("Connection closed by peer"), Seen([1]), machines)
    assert note == "lost node node2 (node rank 1): rank(s) [1] stopped answering"
    assert f"finetune: rank 0 on node node1: {note}; this rank stops (RuntimeError)" in capsys.readouterr().err
    one_vm = machines_of(place(0, 0, "vm"), place(1, 0, "vm"))
    assert peers.failure_note(RuntimeError("x"), Seen([1]), one_vm) == (
        "rank(s) [1] on node vm (node rank 0) stopped answering"  # not the node: rank 0 is still on it
    )
    assert peers.failure_note(RuntimeError("x"), Seen([], "RuntimeError: Connection reset"), machines).startswith(
        "lost node node1 (node rank 0, rank(s) [0]): the launcher's store there no longer answers"
    )
    peers.failure_note(RuntimeError("x"), Seen([1]), machines, traceback_in="runs/r/third_party.log")
    assert "this rank stops (RuntimeError; traceback: runs/r/third_party.log). Continue" in capsys.readouterr().err
    for nothing_lost in (UserError("bad recipe"), KeyboardInterrupt(), SystemExit(2)):  # not even asked
        assert peers.failure_note(nothing_lost, Seen([1]), machines) is None
    assert peers.failure_note(RuntimeError("x"), Seen([]), machines) is None  # control: every rank still there
    assert peers.failure_note(RuntimeError("x"), None, machines) is None  # one process: no heartbeat


# --- the SLURM script's questions --------------------------------------------------------------


def test_a_job_names_its_run_after_the_job_id_so_every_requeue_finds_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir, extra = slurm_job.run_dir_and_args("zero3", ["--training.max_steps=4"], env={"SLURM_JOB_ID": "42"})
    assert (str(run_dir), extra) == ("runs/zero3-slurm42", ["--run.name=zero3-slurm42"])
    # a name the command line (or the recipe) gives is kept
    assert slurm_job.run_dir_and_args("zero3", ["--run.name", "mine"], env={"SLURM_JOB_ID": "42"}) == (
        run_dir.parent / "mine",
        [],
    )
    recipe = tmp_path / "named.yaml"
    recipe.write_text("run:\n  output_dir: out/x\n")
    assert slurm_job.run_dir_and_args(str(recipe), [], env={"SLURM_JOB_ID": "42"})[0].as_posix() == "out/x"


def test_a_requeued_job_resumes_from_a_complete_checkpoint_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    requeued = {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}
    ckpt = tmp_path / "runs" / "zero3-slurm42" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    (ckpt / "model.pt").write_bytes(b"x" * 10)
    assert slurm_job.run_dir_and_args("zero3", [], env=requeued)[1] == ["--run.name=zero3-slurm42"]  # no marker yet
    checkpoints.write_marker(ckpt, step=3, world_size=2)
    assert slurm_job.run_dir_and_args("zero3", [], env=requeued)[1] == ["--run.name=zero3-slurm42", "--resume"]
    assert slurm_job.run_dir_and_args("zero3", [], env={"SLURM_JOB_ID": "42"})[1] == ["--run.name=zero3-slurm42"]
    assert slurm_job.run_dir_and_args("zero3", ["--resume=x"], env=requeued)[1] == ["--run.name=zero3-slurm42"]
    with pytest.raises(UserError, match="with --overwrite: it would delete the run directory"):
        slurm_job.run_dir_and_args("zero3", ["--overwrite"], env=requeued)


def test_status_says_how_the_run_ended_and_ignores_a_record_older_than_the_launch(tmp_path, capsys):
    assert slurm_job.status(tmp_path) == "none"
    (tmp_path / "run.json").write_text(json.dumps({"summary": {"status": "interrupted"}}))
    assert slurm_job.status(tmp_path) == "interrupted"
    assert slurm_job.status(tmp_path, since=time.time() + 5) == "unchanged"  # a launch that wrote nothing
    assert slurm_job.main(["status", str(tmp_path), "--since", "0"]) == 0
    assert capsys.readouterr().out.strip() == "interrupted"
    assert slurm_job.main(["nonsense"]) == 2


def test_heartbeat_threads_end_when_stopped(store):
    beat = peers.Heartbeat(store, 0, 2, peers.Watch()).start()
    time.sleep(2 * peers.BEAT_S)
    assert int(store.add(f"{peers.PREFIX}beat/0", 0)) >= 1
    beat.stop()
    assert not beat._thread.is_alive() and not any(
        t.name == "finetune-heartbeat" and t is beat._thread for t in threading.enumerate()
    )


def test_the_watchdog_ends_an_unanswered_signal_after_its_grace_and_a_phase_after_its_limit():
    """finetune/launch/peers.py Watch, on a made-up clock: a stop signal no agreement acted on is
    overdue after training.stop_grace; a phase with a limit (the steps after training, a save) is held
    to its limit from its start or its last progress, and a signal's grace does not cut it short."""
    w = peers.Watch()
    w.grace_s = 10.0
    t = time.monotonic()
    assert w.overdue(t + 1000) is None  # no signal, no limit: nothing to end (the process groups' timeout)
    w.signalled("SIGUSR1")
    assert w.overdue(t + 5) is None
    assert "got SIGUSR1" in w.overdue(t + 11) and "training.stop_grace (10 s)" in w.overdue(t + 11)
    w.acted()  # the ranks agreed on it: the stop's own phases follow
    w.signalled("SIGTERM")  # torchrun's, once a rank ended: ignored from now on
    assert w.signal is None and w.overdue(t + 1000) is None
    w = peers.Watch()
    w.grace_s = 10.0
    w.signalled("SIGTERM")
    with w.during("the export", 100.0):
        assert w.overdue(time.monotonic() + 50) is None  # a save is not cut short by the grace
        with w.during("the evaluation", 20.0):
            w.progress()
            now = time.monotonic()
            assert w.overdue(now + 19) is None
            assert w.overdue(now + 21).startswith("made no progress in the evaluation for 21 s (its limit: 20 s)")
        assert w.phase[0] == "the export"
    with w.waiting("the agreement after the export"):
        assert w.doing(time.monotonic()).startswith("waits in the agreement after the export")


def test_a_stop_signal_on_one_rank_reaches_the_others_through_the_store(store):
    """What lets a rank that is building its data (no collective there) stop at its next row when
    another rank got the signal: rank 0's thread publishes it, rank 1's reads it (each rank its own watch)."""
    from finetune.training import signals

    first = signals.Stops()
    first.watch.signalled("SIGTERM")
    rank0 = peers.Heartbeat(store, 0, 2, first.watch).start()
    deadline = time.monotonic() + 10
    while not store.check([f"{peers.PREFIX}stop"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    rank0.stop()
    other = signals.Stops()  # rank 1: no signal of its own
    rank1 = peers.Heartbeat(store, 1, 2, other.watch).start()
    try:
        while other.watch.peer_stop is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        rank1.stop()
    assert other.watch.peer_stop == "SIGTERM on rank 0"
    with pytest.raises(signals.Interrupted, match="SIGTERM on rank 0"):
        other.check_interrupt()
    assert store.get(f"{peers.PREFIX}at/1").decode().startswith("is in the start")  # what rank 1 does, said


def test_a_rank_in_a_phase_before_training_is_named_by_it_then_the_label_is_restored():
    """A rank stuck in the data build was reported as "in the start": Stops.phase names its phase to
    the watchdog (what the heartbeat publishes for the others) while it runs, and only then."""
    from finetune.training import signals

    stops = signals.Stops()
    seen = []
    result = stops.phase(
        SimpleNamespace(num_processes=1),
        "while the data was prepared",
        lambda: seen.append(stops.watch.doing(time.monotonic())) or "rows",
        "the data preparation",
    )
    assert result == "rows" and seen[0].startswith("is in the data preparation ("), seen
    assert stops.watch.doing(time.monotonic()).startswith("is in the start (")

"""The node layout (finetune/launch/nodes.py), the lost-rank diagnosis (finetune/launch/peers.py) and
what the SLURM script asks between requeues (finetune/training/slurm_job.py), without launching
anything; the real two-node runs are in tests/multinode/."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta

import pytest

from finetune.errors import UserError
from finetune.launch import nodes, peers
from finetune.launch.launcher import Launcher, from_parent_argv
from finetune.checkpointing import checkpoints
from finetune.training import slurm_job
from tests.conftest import free_port

PY = sys.executable


def place(rank, node_rank, node, params_local=None, params_full=None, host=None):
    return {**nodes.this_rank(rank, 0, {"GROUP_RANK": str(node_rank), "SLURMD_NODENAME": node}),
            "params_local": params_local, "params_full": params_full, "host_peak_rss_gib": host}


@pytest.mark.parametrize("env, node_rank, source", [
    ({"GROUP_RANK": "1", "SLURM_NODEID": "0", "SLURMD_NODENAME": "node2"}, 1, "GROUP_RANK"),  # the launch's rank wins
    ({"SLURM_NODEID": "1", "SLURMD_NODENAME": "node2"}, 1, "SLURM_NODEID"),
    ({}, 0, "one machine"),
])
def test_each_rank_says_where_it_runs(env, node_rank, source):
    got = nodes.this_rank(3, 1, env)
    assert (got["rank"], got["local_rank"], got["node_rank"], got["node_rank_from"]) == (3, 1, node_rank, source)
    assert got["node"] == env.get("SLURMD_NODENAME", got["hostname"]) and got["pid"] == os.getpid()


def test_layout_counts_machines_and_sums_per_node():
    ranks = [place(2, 1, "b", 30, 100, 1.5), place(0, 0, "a", 35, 100, 1.0), place(1, 0, "a", 35, 100, 1.25)]
    got = nodes.layout_of(ranks, env={"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "a,b", "SLURM_STEP_NUM_NODES": "2"})
    assert (got["world_size"], got["num_machines"], got["node_rank_from"]) == (3, 2, "GROUP_RANK")
    assert [r["rank"] for r in got["ranks"]] == [0, 1, 2] and "node_rank_from" not in got["ranks"][0]
    assert got["slurm"] == {"job_id": "7", "job_nodelist": "a,b", "step_nodes": 2, "restart_count": 0}
    assert got["per_node"] == [
        {"node_rank": 0, "node": "a", "ranks": [0, 1], "params_local": 70, "param_fraction": 0.7, "host_peak_rss_gib": 2.25},
        {"node_rank": 1, "node": "b", "ranks": [2], "params_local": 30, "param_fraction": 0.3, "host_peak_rss_gib": 1.5}]
    # a figure not read yet on any rank of a node leaves the node's figure null, not a partial sum
    partial = nodes.per_node([place(0, 0, "a", 35, 100, 1.0), place(1, 0, "a")])
    assert partial[0]["params_local"] is None and partial[0]["host_peak_rss_gib"] is None
    assert nodes.layout_of([place(0, 0, "a")], env={})["slurm"] is None


LAYOUT_1 = nodes.layout_of([place(0, 0, "node1")], env={})
LAYOUT_2 = nodes.layout_of([place(0, 0, "node1"), place(1, 1, "node2")], env={})


def test_a_slurm_step_on_more_nodes_than_the_launch_formed_is_refused_with_the_fix(tmp_path):
    config = tmp_path / "one.yaml"
    config.write_text("distributed_type: DEEPSPEED\nnum_machines: 1\nnum_processes: 1\n")
    launched = Launcher("accelerate launch", str(config), "--config_file")
    problem = nodes.machines_problem(LAYOUT_1, launched, env={"SLURM_STEP_NUM_NODES": "2"})
    assert "this SLURM job step runs on 2 nodes (SLURM_STEP_NUM_NODES) but the launch formed 1 machine(s)" in problem
    assert f"(num_machines in {config}: 1): each node would train alone" in problem
    assert "--num_machines 2 --machine_rank $SLURM_NODEID" in problem and f"num_machines: 2 in {config}" in problem
    # controls: the step and the launch agree; outside SLURM there is no step to agree with
    assert nodes.machines_problem(LAYOUT_2, launched, env={"SLURM_STEP_NUM_NODES": "2"}) is None
    assert nodes.machines_problem(LAYOUT_1, launched, env={}) is None
    assert nodes.machines_problem(LAYOUT_1, None, env={"SLURM_STEP_NUM_NODES": "1"}) is None


def test_a_machine_rank_beyond_the_machines_formed_is_refused(tmp_path):
    config = tmp_path / "two.yaml"
    config.write_text("num_machines: 2\nmachine_rank: 0\n")
    alone = Launcher("accelerate launch", machine_rank=1)  # no config: accelerate's 1 machine
    problem = nodes.machines_problem(LAYOUT_1, alone, env={})
    assert problem.startswith("--machine_rank 1 is machine 2 of a multi-machine run, but the launch formed 1 machine(s) "
                              "(accelerate's default num_machines: 1): this machine would train alone"), problem
    assert "--num_machines 2" in problem
    # the command line beats the config file, as accelerate has it
    assert nodes.declared_machines(Launcher("accelerate launch", str(config), "--config_file", machine_rank=1,
                                            num_machines=1)) == (1, 1, "--num_machines on the launch line")
    assert nodes.declared_machines(Launcher("accelerate launch", str(config), "--config_file", machine_rank=1)) == \
        (2, 1, f"num_machines in {config}")
    assert nodes.machines_problem(LAYOUT_2, Launcher("accelerate launch", machine_rank=1, num_machines=2), env={}) is None
    assert nodes.declared_machines(Launcher("torchrun")) is None  # its --node_rank is not ours to read


def test_the_launcher_command_line_gives_machines_and_rank():
    script = os.path.abspath("finetune/train.py")
    got = from_parent_argv([PY, "-m", "accelerate.commands.launch", "--num_machines", "2", "--machine_rank", "1",
                            "--main_process_ip", "127.0.0.2", script, "--recipe", "zero3"], os.getcwd(),
                           script=script, main_module=None, default_config=None, env={})
    assert (got.kind, got.num_machines, got.machine_rank) == ("accelerate launch", 2, 1)


# --- which ranks are lost ------------------------------------------------------------------------


@pytest.fixture
def store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)


def test_a_rank_that_stops_beating_is_named_and_one_that_says_it_is_failing_is_not(store):
    """Rank 0 diagnoses; rank 1 keeps beating; rank 2 stopped (its counter stands); rank 3 stopped
    but said it is failing too (it saw the same loss and exited first)."""
    beating = peers.Heartbeat(store, 1, 4).start()
    store.add(f"{peers.PREFIX}beat/2", 5)
    store.set(f"{peers.PREFIX}failing/3", "1")
    try:
        me = peers.Heartbeat(store, 0, 4)
        assert me.lost(watch_s=4 * peers.BEAT_S) == ([2], None)
        assert store.check([f"{peers.PREFIX}failing/0"])  # said first, so a slower rank does not name it
    finally:
        beating.stop()
    assert not beating._thread.is_alive()


def test_a_store_that_no_longer_answers_is_reported_not_raised():
    class Gone:
        def set(self, *a):
            raise RuntimeError("Connection reset by peer")

    assert peers.Heartbeat(Gone(), 1, 2).lost(watch_s=0) == ([], "RuntimeError: Connection reset by peer")
    assert peers.start(0, 1, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}) is None  # one process: nothing


def test_the_failure_note_names_the_lost_node_and_rank(monkeypatch, capsys):
    layout = nodes.layout_of([place(0, 0, "node1"), place(1, 1, "node2")], env={})

    class Seen:
        rank = 0

        def __init__(self, lost, error=None):
            self.result = (lost, error)

        def lost(self):
            return self.result

    monkeypatch.setattr(nodes, "_LAYOUT", layout)
    monkeypatch.setattr(nodes, "_HEARTBEAT", Seen([1]))
    note = nodes.failure_note(RuntimeError("Connection closed by peer"))
    assert note == "lost node node2 (node rank 1): rank(s) [1] stopped answering"
    assert f"finetune: rank 0 on node node1: {note}; this rank stops (RuntimeError)" in capsys.readouterr().err
    monkeypatch.setattr(nodes, "_LAYOUT", nodes.layout_of([place(0, 0, "vm"), place(1, 0, "vm")], env={}))
    assert nodes.failure_note(RuntimeError("x")) == "rank(s) [1] on node vm (node rank 0) stopped answering"  # not the node
    monkeypatch.setattr(nodes, "_LAYOUT", layout)
    monkeypatch.setattr(nodes, "_HEARTBEAT", Seen([], "RuntimeError: Connection reset"))
    assert nodes.failure_note(RuntimeError("x")).startswith("lost node node1 (node rank 0, rank(s) [0]): the launcher's "
                                                            "store there no longer answers")
    for nothing_lost in (UserError("bad recipe"), KeyboardInterrupt(), SystemExit(2)):  # not even asked
        assert nodes.failure_note(nothing_lost) is None
    monkeypatch.setattr(nodes, "_HEARTBEAT", Seen([]))  # control: every rank still there -> no note
    assert nodes.failure_note(RuntimeError("x")) is None
    monkeypatch.setattr(nodes, "_HEARTBEAT", None)  # one process
    assert nodes.failure_note(RuntimeError("x")) is None


# --- the SLURM script's questions --------------------------------------------------------------


def test_a_job_names_its_run_after_the_job_id_so_every_requeue_finds_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir, extra = slurm_job.run_dir_and_args("zero3", ["--training.max_steps=4"], env={"SLURM_JOB_ID": "42"})
    assert (str(run_dir), extra) == ("runs/zero3-slurm42", ["--run.name=zero3-slurm42"])
    # a name the command line (or the recipe) gives is kept
    assert slurm_job.run_dir_and_args("zero3", ["--run.name", "mine"], env={"SLURM_JOB_ID": "42"}) == \
        (run_dir.parent / "mine", [])
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
    beat = peers.Heartbeat(store, 0, 2).start()
    time.sleep(2 * peers.BEAT_S)
    assert int(store.add(f"{peers.PREFIX}beat/0", 0)) >= 1
    beat.stop()
    assert not beat._thread.is_alive() and not any(t.name == "finetune-heartbeat" and t is beat._thread
                                                   for t in threading.enumerate())

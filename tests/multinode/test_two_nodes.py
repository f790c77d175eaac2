"""Two nodes for real: the shipped accelerate_configs/slurm_two_node.sbatch on a two-node SLURM cluster
started on this machine (tests/multinode/cluster.py), the same run through two `accelerate launch`
commands without SLURM, preemption with requeue, and the loss of a node (docs/multinode.md).

Every run is ZeRO-3 LoRA of a tiny Llama, one CPU process per node over gloo, fp32, 6 steps of
effective batch 8. The uninterrupted SLURM run (`baseline`) is the reference: the other runs'
per-step losses must equal its own within 1e-5 relative, and each fault test has a control run
whose data position is not restored (`--training.ignore_data_skip=true`, same layout) that must
differ by more, so the comparison can fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune.checkpointing import checkpoints
from tests.conftest import REPO, TRAIN_SCRIPT, free_port, run_process_group
from tests.multinode.conftest import (
    RssSampler,
    copy_run,
    job_args,
    losses,
    record,
    relative_differences,
    submit_dir,
    wait_for_step,
)

pytestmark = pytest.mark.integration

TOLERANCE = 1e-5  # relative, per step loss (fp32)
PAUSE = {"FINETUNE_FAULT_INJECT": "pause@rank0,step3"}  # rank 0 holds step 3 open for 5 s: the fault lands there


@pytest.fixture(scope="module")
def baseline(jobs, tiny_model_dir, tmp_path_factory):
    """The CPU rehearsal of the shipped script, uninterrupted: 2 nodes, 6 steps, checkpoint-3 kept
    for the preemption control; the ranks' resident sets sampled from outside while it runs.
    Submitted together with a second user's job (4 steps) on the same two nodes, neither setting
    MASTER_PORT: the pair test_two_jobs_at_once... checks."""
    base = tmp_path_factory.mktemp("baseline")
    run, other_run = base / "run", base / "other"
    job = jobs.submit(
        "zero3",
        *job_args(tiny_model_dir),
        f"--run.output_dir={run}",
        "--training.save_strategy=steps",
        "--training.save_steps=3",
        port=False,
    )
    other = jobs.submit("zero3", *job_args(tiny_model_dir, steps=4), f"--run.output_dir={other_run}", port=False)
    with RssSampler(job, until=run / "trainer_state.json") as sampled:
        together = both_running(jobs, [job, other])
        info = jobs.wait(job)
    other_info = jobs.wait(other)
    return SimpleNamespace(
        job=job,
        info=info,
        run=run,
        log=jobs.log(job),
        sampled=sampled.peak,
        record=record(run) if (run / "run.json").is_file() else None,
        together=together,
        other=SimpleNamespace(job=other, info=other_info, run=other_run, log=jobs.log(other)),
    )


def both_running(jobs, ids: list[str], timeout: float = 300) -> list[dict] | None:
    """None once the jobs are all RUNNING at the same moment, else their last `scontrol show job`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        infos = [jobs.cluster.job(j) for j in ids]
        states = [i.get("JobState") for i in infos]
        if states == ["RUNNING"] * len(ids):
            return None
        if any(s not in ("PENDING", "RUNNING", "CONFIGURING") for s in states):
            break
        time.sleep(0.2)
    return [jobs.cluster.job(j) for j in ids]


def assert_two_node_zero3(rec: dict, *, node_names: list[str]) -> None:
    """The engaged-strategy evidence of a run on two machines, one rank each, read from run.json."""
    nodes = rec["nodes"]
    assert (nodes["world_size"], nodes["num_machines"], nodes["node_rank_from"]) == (2, 2, "GROUP_RANK"), nodes
    assert [(r["rank"], r["node"], r["node_rank"]) for r in nodes["ranks"]] == [
        (0, node_names[0], 0),
        (1, node_names[1], 1),
    ], nodes["ranks"]
    assert len({r["pid"] for r in nodes["ranks"]}) == 2
    strategy = rec["strategy"]
    assert (strategy["name"], strategy["world_size"], strategy["evidence"]["zero_stage"]) == ("zero3", 2, 3), strategy
    assert strategy["evidence"]["engine_class"] == "DeepSpeedEngine"
    # ZeRO-3 partitions across the nodes, from the live parameters: each node holds about half of
    # the model's elements (partitions are padded), together all of them; the model's size is the
    # loader's own count (run.json parameters.total).
    full = {r["params_full"] for r in nodes["ranks"]}
    assert full == {rec["parameters"]["total"]}, (full, rec["parameters"])
    fractions = [n["param_fraction"] for n in nodes["per_node"]]
    assert all(0.45 < f < 0.55 for f in fractions) and 1.0 <= sum(fractions) < 1.01, fractions
    assert nodes["param_partition"].startswith("zero3 partitions"), nodes["param_partition"]
    assert fractions[0] == pytest.approx(strategy["evidence"]["local_param_fraction"], abs=1e-4)
    # per-node host memory peak: each node's one rank, at least every peak the meter saw on that rank
    memory = rec["memory"]
    for node, rank in zip(nodes["per_node"], nodes["ranks"]):
        assert node["ranks"] == [rank["rank"]] and node["host_peak_rss_gib"] == rank["host_peak_rss_gib"] > 0.1
        for section in (memory["per_rank"], memory["loading"]["per_rank"]):
            assert node["host_peak_rss_gib"] >= section[rank["rank"]]["host_peak_rss_gib"], (node, section)


def test_the_shipped_sbatch_trains_zero3_on_two_slurm_nodes(baseline):
    assert baseline.info["JobState"] == "COMPLETED" and baseline.info["ExitCode"] == "0:0", baseline.log[-4000:]
    rec = baseline.record
    assert rec["summary"]["status"] == "completed" and rec["summary"]["steps"] == 6
    assert_two_node_zero3(rec, node_names=["node1", "node2"])
    slurm = rec["nodes"]["slurm"]
    assert slurm == {"job_id": baseline.job, "job_nodelist": "node[1-2]", "step_nodes": 2, "restart_count": 0}
    # the CPU rehearsal path: one process per node, gloo, the config route of the recipe's strategy
    setup = rec["strategy"]["setup"]
    assert setup["cpu_gloo"] == "opt-in FINETUNE_CPU_DISTRIBUTED=1", setup
    assert setup["config_file"].endswith("accelerate_configs/cpu/zero3.yaml"), setup
    assert "2 process(es) on 2 node(s) node[1-2], rendezvous node1:" in baseline.log, baseline.log[-3000:]
    assert rec["batch"]["effective"] == 8 and rec["batch"]["data_parallel_size"] == 2
    # The recorded peak (the kernel's high-water mark) against the resident sets sampled from outside:
    # never below what was seen, and not far above it (the sampler misses what lives between samples).
    for node in rec["nodes"]["per_node"]:
        seen = baseline.sampled[node["node"]] / 2**30
        assert seen - 0.01 <= node["host_peak_rss_gib"] <= seen * 1.5, (node, seen)


def test_two_machines_without_slurm_give_the_same_run_and_record(baseline, tiny_model_dir, tmp_path):
    """Two `accelerate launch` commands, one per "machine" (--machine_rank 0 and 1), meeting at
    127.0.0.2 (loopback: any 127/8 address reaches this machine)."""
    run, port = tmp_path / "run", free_port()
    env = {
        **os.environ,
        "FINETUNE_CPU_DISTRIBUTED": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    env = {k: v for k, v in env.items() if not k.startswith("SLURM")}

    def machine(rank: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(REPO / "accelerate_configs/cpu/zero3.yaml"),
            "--num_machines",
            "2",
            "--num_processes",
            "2",
            "--machine_rank",
            str(rank),
            "--main_process_ip",
            "127.0.0.2",
            "--main_process_port",
            str(port),
            str(TRAIN_SCRIPT),
            "--recipe",
            "zero3",
            *job_args(tiny_model_dir),
            f"--run.output_dir={run}",
        ]

    second = subprocess.Popen(
        machine(1),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        code, out, _ = run_process_group(machine(0), cwd=REPO, env=env, timeout=300, merge_stderr=True)
        out_second, _ = second.communicate(timeout=60)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    assert (code, second.returncode) == (0, 0), out[-3000:] + out_second[-3000:]
    rec = record(run)
    hostname = rec["nodes"]["ranks"][0]["hostname"]
    assert_two_node_zero3(rec, node_names=[hostname, hostname])  # one host, two machine ranks
    assert rec["nodes"]["slurm"] is None
    got, want = losses(rec), losses(baseline.record)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    assert max(relative_differences(got, want, want).values()) <= TOLERANCE


def test_a_config_for_one_machine_on_a_two_node_step_is_refused(slurm, tiny_model_dir, tmp_path):
    """`finetune train` on each node of a 2-node job step with a config of num_machines 1: every node
    would train alone. Refused on both nodes before any weights load, naming the fix; exit 2."""
    config = tmp_path / "cpu" / "one_machine.yaml"
    config.parent.mkdir()
    config.write_text(
        (REPO / "accelerate_configs/cpu/zero3.yaml").read_text().replace("num_processes: 2", "num_processes: 1")
        + "main_process_port: 0\n"
    )  # each node's own free port: they share this machine
    cmd = [
        "srun",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=1",
        "--kill-on-bad-exit=0",
        sys.executable,
        "-m",
        "finetune.cli",
        "train",
        "--recipe",
        "zero3",
        "--config_file",
        str(config),
        *job_args(tiny_model_dir),
        f"--run.output_dir={tmp_path / 'run'}",
    ]
    code, out, _ = run_process_group(
        cmd, cwd=REPO, env={**slurm.env, "PYTHONUNBUFFERED": "1"}, timeout=240, merge_stderr=True
    )
    assert code == 2, out[-4000:]
    assert (
        out.count("this SLURM job step runs on 2 nodes (SLURM_STEP_NUM_NODES) but the launch formed 1 machine(s)") == 2
    ), out[-4000:]
    assert "Launch with --num_machines 2 --machine_rank $SLURM_NODEID" in out and f"num_machines in {config}" in out
    assert not (tmp_path / "run").exists()  # nothing was started, loaded or written


def print_losses(title: str, want: dict, got: dict, control: dict) -> None:
    """The per-step table (shown with pytest -s): the figures docs/multinode.md quotes."""
    print(f"\n{title}\nstep | uninterrupted | this run | rel. diff | control | rel. diff")
    for k in sorted(want):
        print(
            f"{k} | {want[k]:.9f} | {got[k]:.9f} | {abs(got[k] - want[k]) / abs(want[k]):.2e} | "
            f"{control[k]:.9f} | {abs(control[k] - want[k]) / abs(want[k]):.2e}"
        )


def _control_resume(jobs, source: Path, checkpoint: str, dst: Path, args: list[str], *, nodes: int) -> dict:
    """A copy of `source` resumed from `checkpoint` without restoring the data position
    (ignore_data_skip: the sampler starts the epoch again) at the checkpoint's own layout."""
    run = copy_run(source, dst)
    job = jobs.submit(
        "zero3",
        *args,
        f"--run.output_dir={run}",
        f"--resume={run / checkpoint}",
        "--training.ignore_data_skip=true",
        "--allow-config-change",  # a resume refuses a changed setting unless asked (docs/faults.md)
        sbatch=[f"--nodes={nodes}"],
    )
    info = jobs.wait(job)
    assert info["JobState"] == "COMPLETED", jobs.log(job)[-4000:]
    return record(run)


def test_a_preempted_job_checkpoints_on_both_nodes_requeues_and_resumes_exactly(
    baseline, jobs, tiny_model_dir, tmp_path
):
    """SIGTERM to the job's steps while step 3 is open: both ranks stop after step 3 with one complete
    checkpoint, the script requeues the job, the requeued job (SLURM_RESTART_COUNT=1) continues the
    same run directory (named after the job id) from checkpoint-3 by itself; its losses are the
    uninterrupted run's."""
    here = submit_dir(tmp_path / "project")
    job = jobs.submit("zero3", *job_args(tiny_model_dir), env=PAUSE, cwd=here)
    run = here / "runs" / f"zero3-slurm{job}"
    wait_for_step(run, 2, jobs, job)
    subprocess.run(["scancel", "--signal=TERM", job], env=jobs.cluster.env, check=True)
    info = jobs.wait(job)
    log = jobs.log(job)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), log[-4000:]
    assert "preempted: SIGTERM on rank(s) [0, 1]; stopped after step 3 with a complete checkpoint" in log, log[-4000:]
    assert f"run runs/zero3-slurm{job}: interrupted (restart 0)" in log
    assert f"requeued job (restart 1): continuing runs/zero3-slurm{job} from checkpoint-3" in log
    assert f"run runs/zero3-slurm{job}: completed (restart 1)" in log

    first = json.loads((run / "run.before-resume1.json").read_text())  # the first segment's record
    assert (
        first["summary"]["status"] == "interrupted"
        and "preempted by SIGTERM on rank(s) [0, 1] at step 3" in first["summary"]["error"]
    ), first["summary"]
    # one checkpoint, complete, with both nodes' ZeRO-3 partitions in it
    assert [c.name for c in checkpoints.checkpoints(run)] == ["checkpoint-3"]
    assert checkpoints.problem(run / "checkpoint-3") is None
    shards = sorted(p.name for p in (run / "checkpoint-3").rglob("zero_pp_rank_*_optim_states.pt"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"], shards

    rec = record(run)
    assert rec["summary"]["status"] == "completed" and rec["summary"]["steps"] == 6
    resumed = rec["resumes"][-1]
    assert (resumed["step"], resumed["previous_status"], resumed["world_size"], resumed["effective"]) == (
        3,
        "interrupted",
        2,
        8,
    ), resumed
    assert rec["nodes"]["slurm"]["restart_count"] == 1 and rec["nodes"]["slurm"]["job_id"] == job
    assert_two_node_zero3(rec, node_names=["node1", "node2"])
    got, want = losses(rec), losses(baseline.record)
    assert max(relative_differences(got, want, [4, 5, 6]).values()) <= TOLERANCE, (got, want)

    # Control: the same continuation with the data position not restored differs by far more.
    control = _control_resume(
        jobs, baseline.run, "checkpoint-3", tmp_path / "control", job_args(tiny_model_dir), nodes=2
    )
    assert control["resumes"][-1]["world_size"] == 2
    print_losses("preempted after step 3, requeued", want, got, losses(control))
    assert max(relative_differences(losses(control), want, [4, 5, 6]).values()) > 10 * TOLERANCE


def test_losing_a_node_ends_the_survivor_naming_it_and_the_run_continues_on_one_node(
    baseline, jobs, tiny_model_dir, tmp_path
):
    """Node 2's task (its launcher and its rank) is SIGKILLed while step 3 is open: the rank on node 1
    exits by itself, naming node2 and rank 1, long before the collective timeout; the checkpoints
    written so far are complete; `--resume` on one node with one process keeps the effective batch
    (4 per device x accumulation 2) and the uninterrupted run's losses."""
    run = tmp_path / "run"
    args = [*job_args(tiny_model_dir), "--training.save_strategy=steps", "--training.save_steps=1"]
    job = jobs.submit("zero3", *args, f"--run.output_dir={run}", env=PAUSE)
    wait_for_step(run, 2, jobs, job)
    deadline = time.monotonic() + 60  # checkpoint-2 is saved after step 2's log, before step 3's pause
    while not (run / "checkpoint-2" / checkpoints.MARKER).is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    victims = jobs.tasks(job, "node2")
    assert len(victims) == 2, victims  # the launcher (torchrun's agent) and the rank
    for p in victims:
        p.kill()
    killed = time.monotonic()
    while jobs.tasks(job, "node1") and time.monotonic() - killed < 300:
        time.sleep(0.2)
    exit_s = time.monotonic() - killed
    print(f"the rank on node1 exited {exit_s:.1f} s after node 2's task was killed")
    info = jobs.wait(job)
    log = jobs.log(job)
    assert exit_s < 120, f"the surviving rank took {exit_s:.0f} s to exit\n{log[-4000:]}"  # the bound
    assert info["JobState"] == "FAILED", log[-4000:]
    note = "lost node node2 (node rank 1): rank(s) [1] stopped answering"
    assert f"finetune: rank 0 on node node1: {note}" in log, log[-4000:]
    # the rank's own error (the backend's, a consequence) is said in that line; its traceback is in the run's log
    assert f"; traceback: {run / 'third_party.log'}). Continue" in log, log[-4000:]
    kept = (run / "third_party.log").read_text()
    assert f"rank 0: this rank's error, after {note}" in kept and "Traceback" in kept, kept[-3000:]
    rec = record(run)
    assert rec["summary"]["status"] == "failed" and rec["summary"]["error"].startswith(note), rec["summary"]
    # nothing damaged: the checkpoints written before the loss are complete, none after it
    assert [c.name for c in checkpoints.checkpoints(run)] == ["checkpoint-1", "checkpoint-2"]
    assert all(checkpoints.problem(c) is None for c in checkpoints.checkpoints(run))
    torn = copy_run(run / "checkpoint-2", tmp_path / "torn-checkpoint-2")  # control: a damaged one is seen
    shard = next(torn.rglob("zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:100])
    assert "truncated or changed" in (checkpoints.problem(torn) or ""), checkpoints.problem(torn)

    # The run continues on the node left, one process, from the newest complete checkpoint.
    again = jobs.submit("zero3", *args, f"--run.output_dir={run}", "--resume", sbatch=["--nodes=1"])
    info = jobs.wait(again)
    assert info["JobState"] == "COMPLETED", jobs.log(again)[-4000:]
    rec = record(run)
    resumed = rec["resumes"][-1]
    assert (
        resumed["step"],
        resumed["from_world_size"],
        resumed["world_size"],
        resumed["grad_accum"],
        resumed["effective"],
        resumed["reshard"],
    ) == (2, 2, 1, 2, 8, "universal"), resumed
    assert (rec["nodes"]["world_size"], rec["nodes"]["num_machines"], rec["nodes"]["ranks"][0]["node"]) == (
        1,
        1,
        "node1",
    ), rec["nodes"]
    assert rec["nodes"]["per_node"][0]["param_fraction"] == 1.0  # one rank holds every partition
    got, want = losses(rec), losses(baseline.record)
    assert max(relative_differences(got, want, [3, 4, 5, 6]).values()) <= TOLERANCE, (got, want)

    # Control: a one-process continuation without the data position restored differs by far more.
    control = _control_resume(jobs, run, "checkpoint-3", tmp_path / "control", args, nodes=1)
    assert control["resumes"][-1]["world_size"] == 1
    print_losses("node 2 lost at step 3, resumed on one node from checkpoint-2", want, got, losses(control))
    assert max(relative_differences(losses(control), want, [4, 5, 6]).values()) > 10 * TOLERANCE


def test_two_jobs_at_once_each_take_a_rendezvous_port_of_their_own_and_complete(baseline):
    """Two users' jobs on the same two nodes at the same time, neither setting MASTER_PORT (the
    baseline and a second job, submitted together): both rendezvous at node1. Before, both asked for
    port 29500 and the second failed ("another process is utilizing it"), exit 1. Now each takes
    10000 + job id % 50000, says which, and both complete."""
    assert baseline.together is None, f"the two jobs never ran at the same time: {baseline.together}"
    for job, info, log, run in (
        (baseline.job, baseline.info, baseline.log, baseline.run),
        (baseline.other.job, baseline.other.info, baseline.other.log, baseline.other.run),
    ):
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-4000:]
        assert f"rendezvous node1:{10000 + int(job) % 50000} (from job id {job})" in log, log[-4000:]
        rec = record(run)
        assert rec["summary"]["status"] == "completed" and rec["nodes"]["num_machines"] == 2, rec["summary"]

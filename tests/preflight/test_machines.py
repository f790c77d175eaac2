"""Preflight's machine-count check (finetune/preflight/devices.py machines_problem) on made-up launches: the machines
a launched process gathered (LaunchPlan.machines) against its SLURM step and its --machine_rank. On a
real two-node SLURM step: tests/multinode/test_two_nodes.py."""

from __future__ import annotations

import os
import sys

from finetune.config.recipe import load_recipe
from finetune.launch import nodes
from finetune.launch.configs import DeclaredLaunch
from finetune.launch.launcher import Launcher, from_parent_argv
from finetune.launch.plan import LaunchPlan, Machines
from finetune.launch.strategy_setup import StrategySetup
from finetune.preflight import devices

DEMO = load_recipe("demo", [])[0]
STEP_OF_2 = nodes.SlurmStep("7", "node[1-2]", step_nodes=2, restart_count=0)


def launched(launcher: Launcher, *, num_machines: int, slurm=None) -> LaunchPlan:
    """The plan of one rank of a launch that formed `num_machines` machines of one process each."""
    ranks = tuple(nodes.this_rank(i, 0, {"GROUP_RANK": str(i)}) for i in range(num_machines))
    facts = DeclaredLaunch(source="test", num_processes=num_machines, num_machines=num_machines)
    setup = StrategySetup("launcher-config", launcher, "test")
    return LaunchPlan.of(DEMO, facts, setup, Machines(num_machines, 1, ranks, slurm))


def test_a_slurm_step_on_more_nodes_than_the_launch_formed_is_refused_with_the_fix(tmp_path):
    config = tmp_path / "one.yaml"
    config.write_text("distributed_type: DEEPSPEED\nnum_machines: 1\nnum_processes: 1\n")
    launcher = Launcher("accelerate launch", str(config), "--config_file")
    problem = devices.machines_problem(launched(launcher, num_machines=1, slurm=STEP_OF_2))
    assert problem.startswith(
        "this SLURM job step runs on 2 nodes (SLURM_STEP_NUM_NODES) but the launch formed 1 machine(s) of 1 "
        f"process(es) (num_machines in {config}: 1): each node would train alone"
    ), problem
    assert "--num_machines 2 --machine_rank $SLURM_NODEID" in problem and f"num_machines: 2 in {config}" in problem
    # controls: the step and the launch agree; outside SLURM there is no step to agree with
    assert devices.machines_problem(launched(launcher, num_machines=2, slurm=STEP_OF_2)) is None
    assert devices.machines_problem(launched(launcher, num_machines=1)) is None
    # before a launch nothing is gathered, so there is nothing to compare
    before = LaunchPlan.of(DEMO, DeclaredLaunch(source="test"), None)
    assert before.machines.ranks == () and devices.machines_problem(before) is None


def test_a_machine_rank_beyond_the_machines_formed_is_refused(tmp_path):
    alone = Launcher("accelerate launch", machine_rank=1)  # no config: accelerate's 1 machine
    problem = devices.machines_problem(launched(alone, num_machines=1))
    assert problem.startswith(
        "--machine_rank 1 is machine 2 of a multi-machine run, but the launch formed 1 machine(s) "
        "(accelerate's default num_machines: 1): this machine would train alone"
    ), problem
    assert "--num_machines 2" in problem
    # control: the same rank where two machines formed
    both = Launcher("accelerate launch", machine_rank=1, num_machines=2)
    assert devices.machines_problem(launched(both, num_machines=2)) is None


def test_the_launch_line_beats_the_config_file_as_accelerate_has_it(tmp_path):
    config = tmp_path / "two.yaml"
    config.write_text("num_machines: 2\nmachine_rank: 0\n")
    given = Launcher("accelerate launch", str(config), "--config_file", machine_rank=1, num_machines=1)
    assert devices.declared(given) == (1, 1, "--num_machines on the launch line")
    from_file = Launcher("accelerate launch", str(config), "--config_file", machine_rank=1)
    assert devices.declared(from_file) == (2, 1, f"num_machines in {config}")
    assert devices.declared(Launcher("torchrun")) is None  # its --node_rank is not ours to read
    config.write_text("num_machines: two\n")  # a bad value: the launch checks name it, not this one
    assert devices.declared(from_file) is None


def test_the_launcher_command_line_gives_machines_and_rank():
    script = os.path.abspath("finetune/train.py")
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "2", "--machine_rank", "1"]
    argv += ["--main_process_ip", "127.0.0.2", script, "--recipe", "zero3"]
    got = from_parent_argv(argv, os.getcwd(), script=script, main_module=None, default_config=None, env={})
    assert (got.kind, got.num_machines, got.machine_rank) == ("accelerate launch", 2, 1)

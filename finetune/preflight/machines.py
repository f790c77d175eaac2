"""Preflight's check of the launch's machine count against the machines it runs on, in a launched
process (LaunchPlan.machines, gathered from the live process group): a SLURM job step on N nodes
whose launch formed another number of machines (num_machines left at 1: every node trains alone),
or `--machine_rank K` with fewer than K + 1 machines formed (docs/preflight.md, docs/multinode.md).
"""

from __future__ import annotations

from pathlib import Path

from finetune.errors import UserError
from finetune.launch.configs import read_yaml
from finetune.launch.launcher import Launcher
from finetune.launch.plan import LaunchPlan


def declared(launcher: Launcher | None) -> tuple[int, int, str] | None:
    """(num_machines, machine_rank, where from) that `accelerate launch` was given: its command line,
    else its config file, else accelerate's defaults (1, 0); None for other launchers."""
    if launcher is None or launcher.kind not in ("accelerate launch", "finetune train"):
        return None
    values: dict = {}
    if launcher.config_file:
        try:
            values = read_yaml(Path(launcher.config_file))
        except (UserError, OSError):  # an unreadable config is reported by the launch checks
            values = {}
    machines = _first(launcher.num_machines, values.get("num_machines"), 1)
    rank = _first(launcher.machine_rank, values.get("machine_rank"), 0)
    if not (isinstance(machines, int) and isinstance(rank, int)):  # the launch checks name a bad value
        return None
    if launcher.num_machines is not None:
        where = "--num_machines on the launch line"
    elif values.get("num_machines") is not None:
        where = f"num_machines in {launcher.config_file}"
    else:
        where = "accelerate's default num_machines"
    return machines, rank, where


def machines_problem(launch: LaunchPlan) -> str | None:
    """The launch's machine count against the machines it runs on (module docstring), or None; None
    before a launch too (nothing gathered)."""
    machines = launch.machines
    if not machines.ranks:
        return None
    launcher = launch.setup.launcher if launch.setup is not None else None
    found = machines.num_machines
    number, machine_rank, where = declared(launcher) or (found, 0, "the launcher")
    config = getattr(launcher, "config_file", None) or "your accelerate config"
    step_nodes = machines.slurm.step_nodes if machines.slurm is not None else None
    if step_nodes and step_nodes != found:
        outcome = "each node would train alone" if found < step_nodes else "the machine counts disagree"
        return (
            f"this SLURM job step runs on {step_nodes} nodes (SLURM_STEP_NUM_NODES) but the launch formed "
            f"{found} machine(s) of {launch.world_size} process(es) ({where}: {number}): {outcome}. Launch with "
            f"--num_machines {step_nodes} --machine_rank $SLURM_NODEID (as accelerate_configs/slurm_two_node.sbatch "
            f"does), or set num_machines: {step_nodes} in {config}"
        )
    if machine_rank >= found:
        return (
            f"--machine_rank {machine_rank} is machine {machine_rank + 1} of a multi-machine run, but the launch "
            f"formed {found} machine(s) ({where}: {number}): this machine would train alone. Give every machine's "
            f"launch --num_machines {machine_rank + 1} (or more), or set num_machines in {config}"
        )
    return None


def _first(*values):
    return next(v for v in values if v is not None)

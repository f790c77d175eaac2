"""Preflight's checks of processes against devices and machines: the launcher's world size against the
processes Accelerate set up, `--num_processes` that started fewer, one CUDA device per process, one
process that would see several CUDA devices (Trainer would wrap it in nn.DataParallel), and the
launch's machine count against the machines it runs on (docs/preflight.md, docs/multinode.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from finetune.errors import UserError
from finetune.launch.configs import read_yaml
from finetune.launch.launcher import Launcher
from finetune.launch.plan import LaunchPlan
from finetune.strategies import ACCELERATOR_TYPES, by_recipe, launch_line


def lone_processes_problem(cfg, setup, env=os.environ, cuda: bool | None = None) -> str | None:
    """Before any process group: several processes launched on a machine without CUDA, without the CPU opt-in, are each
    set up by Accelerate as a run of their own (each would train alone, and DeepSpeed would first build its CPU ops in
    each). Every rank finds this from its environment alone, so all of them stop at once, before any collective could
    wait for another. `cuda`: whether a CUDA device is visible (read from torch when not given)."""
    launched = int(env.get("WORLD_SIZE", "1"))
    if launched < 2 or setup.cpu_gloo is not None or env.get("ACCELERATE_USE_CPU", "false").lower() == "true":
        return None
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if cuda:
        return None
    return (
        f"{launched} processes were launched on a machine without a CUDA GPU: Accelerate would set each up "
        f"as a run of its own (each would train alone). {cpu_launch_fix(cfg, setup, launched)}"
    )


def world_size_problem(state, cfg, setup) -> str | None:
    """The launcher's world size must equal the processes Accelerate set up (a 2-process launch without use_cpu on a
    machine without a GPU gives two lone runs; most such launches are refused before, by lone_processes_problem)."""
    launcher = int(os.environ.get("WORLD_SIZE", "1"))
    if launcher == state.num_processes:
        return None
    return (
        f"the launcher started {launcher} processes but Accelerate set up {state.num_processes} "
        f"(distributed type {state.distributed_type.value}); each process would train alone. "
        f"{cpu_launch_fix(cfg, setup, launcher)}"
    )


def cpu_launch_fix(cfg, setup, processes: int) -> str:
    """The launch that runs this strategy on CPU processes over gloo: the accelerate_configs/cpu/
    variant of the config the launcher read (of the recipe's strategy when it read none or its own),
    or, when the recipe sets its strategy up itself, the same launch with the opt-in."""
    from finetune import resources
    from finetune.launch import launcher

    script = launcher.script_form()
    if setup is None or setup.set_up_by == "recipe":
        return (
            f"To rehearse on CPU, opt in to gloo (the recipe sets up its strategy itself):\n"
            f"    FINETUNE_CPU_DISTRIBUTED=1 torchrun --nproc_per_node {processes} {script} --recipe {cfg.recipe}\n"
            f"  or `finetune train --recipe {cfg.recipe} --cpu` (see docs/preflight.md, CPU rehearsal)"
        )
    given = setup.launcher.config_file
    variant = resources.cpu_variant(Path(given)) if given else None
    if variant is None or variant.parent.name != "cpu":
        row = by_recipe(cfg.run.strategy, cfg.run.offload)
        variant = resources.resolve(row.cpu_config) if row and row.cpu_config else None
    if variant is None:
        return "Launch it on a machine with GPUs, or one process (--num_processes 1)."
    return (
        f"On a machine without a GPU, use the CPU variant of the config and opt in to gloo:\n"
        f"    FINETUNE_CPU_DISTRIBUTED=1 accelerate launch --config_file {resources.shown(variant)} {script} "
        f"--recipe {cfg.recipe}\n"
        f"  or `finetune train --recipe {cfg.recipe} --cpu` (see docs/preflight.md, CPU rehearsal)"
    )


def launcher_processes_problem(setup, cfg) -> str | None:
    """`accelerate launch --num_processes N` that started fewer: with at most one GPU visible and no config file,
    accelerate's simple launcher starts ONE process (accelerate 1.15 commands/launch.py _validate_launch_command:
    multi_gpu only when cuda.device_count() > 1), which would train alone at another batch size than asked for."""
    from finetune.launch import launcher

    if setup is None or setup.launcher.kind != "accelerate launch" or not setup.launcher.num_processes:
        return None
    asked, got = setup.launcher.num_processes, int(os.environ.get("WORLD_SIZE", "1"))
    if asked <= got:
        return None
    return (
        f"accelerate launch --num_processes {asked} started {got} process(es): without a config file, accelerate "
        f"starts several only when more than one GPU is visible. For {asked} processes on CPU:\n"
        f"    FINETUNE_CPU_DISTRIBUTED=1 torchrun --nproc_per_node {asked} {launcher.script_form()} --recipe {cfg.recipe}\n"
        f"  or `finetune train --recipe {cfg.recipe} --cpu`; for one process leave out --num_processes"
    )


def one_device_per_process(cfg, launch: LaunchPlan, *, in_process: bool) -> list[str]:
    """One CUDA device per process on each machine, for launches that need accelerators."""
    import torch

    from finetune.launch import cpu_rehearsal

    facts = launch.facts
    if facts.distributed_type not in ACCELERATOR_TYPES or facts.use_cpu or facts.gloo or cpu_rehearsal.requested():
        return []
    per_machine = launch.machines.processes_per_machine
    if not torch.cuda.is_available():
        if in_process or per_machine < 2:  # in a process, world_size_problem already says it
            return []
        return [
            f"{facts.source}: {facts.distributed_type} with {per_machine} processes per machine, but no CUDA "
            f"GPU is visible here: each process would train alone. Rehearse on CPU with "
            f"`finetune train --recipe {cfg.recipe} --cpu` (2 processes over gloo), or launch on a GPU machine"
        ]
    visible = torch.cuda.device_count()
    ids = facts.gpu_ids
    if not in_process and ids not in (None, "all"):
        visible = min(visible, len([x for x in str(ids).split(",") if x.strip()]))
        where = f"gpu_ids {ids} of {torch.cuda.device_count()} visible"
    else:
        where = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}"
    if in_process:
        per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", per_machine))
    if per_machine <= visible:
        return []
    return [
        f"{facts.source}: {per_machine} processes per machine but only {visible} CUDA device(s) ({where}); "
        f"set num_processes to at most {visible} (--num_processes {visible}) or make more GPUs visible"
    ]


def one_process_many_devices(cfg, launch: LaunchPlan, *, in_process: bool) -> list[str]:
    """The problem when one process would see several CUDA devices (none for CPU runs, launches
    of several processes, or one visible device); before a launch, gpu_ids is what it will see."""
    import torch

    from finetune.launch import cpu_rehearsal

    facts = launch.facts
    on_cpu = facts.use_cpu or cfg.training.typed.use_cpu or cpu_rehearsal.requested() or not torch.cuda.is_available()
    if facts.distributed_type != "NO" or on_cpu:
        return []
    visible = torch.cuda.device_count()
    ids = facts.gpu_ids
    if not in_process and ids not in (None, "all"):  # the launch will set CUDA_VISIBLE_DEVICES=ids
        visible = len([x for x in str(ids).split(",") if x.strip()])
    if visible <= 1:
        return []
    return [
        f"{facts.source}: one process (distributed type NO) with {visible} CUDA devices visible "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}): Trainer would wrap the model "
        f"in torch.nn.DataParallel over all {visible} and train {visible}x the batch while the record says "
        f"'single'. Pin one device: CUDA_VISIBLE_DEVICES=0 (or gpu_ids: \"0\" in the accelerate config, as "
        f"accelerate_configs/single_gpu.yaml has), or train on all of them with DDP:\n{launch_line('ddp', 'none', cfg.recipe)}"
    ]


# ---- The machine count, in a launched process (LaunchPlan.machines, gathered from the live process
# group): a SLURM job step on N nodes whose launch formed another number of machines (num_machines
# left at 1: every node trains alone), or `--machine_rank K` with fewer than K + 1 machines formed.


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
    """The launch's machine count against the machines it runs on (above), or None; None
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

"""Preflight's checks of processes against devices: the launcher's world size against the processes
Accelerate set up, `--num_processes` that started fewer, one CUDA device per process, and one
process that would see several CUDA devices (Trainer would wrap it in nn.DataParallel; docs/preflight.md).
"""

from __future__ import annotations

import os

from finetune.launch.plan import LaunchPlan
from finetune.strategies import ACCELERATOR_TYPES, by_key, launch_line


def world_size_problem(state, in_script_recipe: str | None = None) -> str | None:
    """The launcher's world size must equal the processes Accelerate set up (a 2-process launch
    without use_cpu on a machine without a GPU gives two lone runs). `in_script_recipe`: the
    recipe sets up its strategy itself, so the fix is a plain torchrun line."""
    launcher = int(os.environ.get("WORLD_SIZE", "1"))
    if launcher == state.num_processes:
        return None
    head = (
        f"the launcher started {launcher} processes but Accelerate set up {state.num_processes} "
        f"(distributed type {state.distributed_type.value}); each process would train alone. On a "
        f"machine without a GPU "
    )
    if in_script_recipe:
        return head + (
            f"opt in to gloo (the recipe sets up its strategy itself), e.g.\n"
            f"    FINETUNE_CPU_DISTRIBUTED=1 torchrun --nproc_per_node {launcher} finetune/train.py "
            f"--recipe {in_script_recipe}\n  (see finetune/launch/cpu_rehearsal.py)"
        )
    return head + (
        f"use a CPU config and opt in to gloo, e.g.\n"
        f"    FINETUNE_CPU_DISTRIBUTED=1 accelerate launch --config_file {by_key('ddp').cpu_config} "
        f"finetune/train.py --recipe ddp\n  (or `finetune train --recipe ddp --cpu`; see "
        f"finetune/launch/cpu_rehearsal.py)"
    )


def launcher_processes_problem(setup, cfg) -> str | None:
    """`accelerate launch --num_processes N` that started fewer: with at most one GPU visible and
    no config file, accelerate's simple launcher starts ONE process (accelerate 1.15
    commands/launch.py _validate_launch_command: multi_gpu only when cuda.device_count() > 1),
    which would train alone at another batch size than asked for."""
    if setup is None or setup.launcher.kind != "accelerate launch" or not setup.launcher.num_processes:
        return None
    asked, got = setup.launcher.num_processes, int(os.environ.get("WORLD_SIZE", "1"))
    if asked <= got:
        return None
    return (
        f"accelerate launch --num_processes {asked} started {got} process(es): without a config file, accelerate "
        f"starts several only when more than one GPU is visible. For {asked} processes on CPU:\n"
        f"    FINETUNE_CPU_DISTRIBUTED=1 torchrun --nproc_per_node {asked} finetune/train.py --recipe {cfg.recipe}\n"
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
            (
                f"{facts.source}: {facts.distributed_type} with {per_machine} processes per machine, but no CUDA "
                f"GPU is visible here: each process would train alone. Rehearse on CPU with "
                f"`finetune train --recipe {cfg.recipe} --cpu` (2 processes over gloo), or launch on a GPU machine"
            )
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
        (
            f"{facts.source}: {per_machine} processes per machine but only {visible} CUDA device(s) ({where}); "
            f"set num_processes to at most {visible} (--num_processes {visible}) or make more GPUs visible"
        )
    ]


def one_process_many_devices(cfg, launch: LaunchPlan, *, in_process: bool) -> list[str]:
    """The problem when one process would see several CUDA devices (none for CPU runs, launches
    of several processes, or one visible device); before a launch, gpu_ids is what it will see."""
    import torch

    from finetune.launch import cpu_rehearsal

    facts = launch.facts
    if (
        facts.distributed_type != "NO"
        or facts.use_cpu
        or cfg.training.args.get("use_cpu")
        or cpu_rehearsal.requested()
        or not torch.cuda.is_available()
    ):
        return []
    visible = torch.cuda.device_count()
    ids = facts.gpu_ids
    if not in_process and ids not in (None, "all"):  # the launch will set CUDA_VISIBLE_DEVICES=ids
        visible = len([x for x in str(ids).split(",") if x.strip()])
    if visible <= 1:
        return []
    return [
        (
            f"{facts.source}: one process (distributed type NO) with {visible} CUDA devices visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}): Trainer would wrap the model "
            f"in torch.nn.DataParallel over all {visible} and train {visible}x the batch while the record says "
            f"'single'. Pin one device: CUDA_VISIBLE_DEVICES=0 (or gpu_ids: \"0\" in the accelerate config, as "
            f"accelerate_configs/single_gpu.yaml has), or train on all of them with DDP:\n{launch_line('ddp', 'none', cfg.recipe)}"
        )
    ]

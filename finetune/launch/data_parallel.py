"""Preflight's refusal of one process with several CUDA devices visible (finetune/launch/preflight.py
runs it with the other checks).

One process (distributed type NO) on a machine with two visible GPUs is not "single": Trainer
wraps the model in torch.nn.DataParallel over all of them (transformers 5.23 training_args.py
_setup_devices sets n_gpu = torch.cuda.device_count(); Trainer then wraps and multiplies the batch
by n_gpu), while the record says "single" with the wrong effective batch, LR scaling and MFU.
accelerate's simple launcher sets CUDA_VISIBLE_DEVICES only when gpu_ids is not "all"
(accelerate/utils/launch.py prepare_simple_launcher_cmd_env), so the shipped single_gpu.yaml pins
gpu_ids: "0".
"""

from __future__ import annotations

import os

from finetune.launch.facts import LaunchFacts
from finetune.strategies import launch_line


def check(cfg, facts: LaunchFacts, *, in_process: bool) -> list[str]:
    """The problem when one process would see several CUDA devices (none for CPU runs, launches
    of several processes, or one visible device); before a launch, gpu_ids is what it will see."""
    import torch

    from finetune.launch import cpu_rehearsal

    if facts.distributed_type != "NO" or facts.use_cpu or cfg.training.args.get("use_cpu") \
            or cpu_rehearsal.requested() or not torch.cuda.is_available():
        return []
    visible = torch.cuda.device_count()
    ids = facts.gpu_ids
    if not in_process and ids not in (None, "all"):  # the launch will set CUDA_VISIBLE_DEVICES=ids
        visible = len([x for x in str(ids).split(",") if x.strip()])
    if visible <= 1:
        return []
    return [(f"{facts.source}: one process (distributed type NO) with {visible} CUDA devices visible "
             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}): Trainer would wrap the model "
             f"in torch.nn.DataParallel over all {visible} and train {visible}x the batch while the record says "
             f"'single'. Pin one device: CUDA_VISIBLE_DEVICES=0 (or gpu_ids: \"0\" in the accelerate config, as "
             f"accelerate_configs/single_gpu.yaml has), or train on all of them with DDP:\n{launch_line('ddp', 'none', cfg.recipe)}")]

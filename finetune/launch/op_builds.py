"""DeepSpeed's C++ ops that are compiled on first use (JIT, torch.utils.cpp_extension): said before
the 50-70 s build starts, so a first launch does not look hung. `deepspeed_shm_comm` is built by
DeepSpeed's CPU communication backend when a DeepSpeed run's processes join on CPU
(deepspeed/comm/torch.py build_shm_op), `cpu_adam` for an optimizer offloaded to the host
(DeepSpeedCPUAdam). Each is cached per Python/torch build and reused afterwards.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def build_dir(name: str) -> Path:
    """Where torch caches an extension's build: torch/utils/cpp_extension.py _get_build_directory
    ($TORCH_EXTENSIONS_DIR, else the default root / py<version>_<cpu|cuXY> / name)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        cu = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
        root = os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_{cu}")
    return Path(root) / name


def unbuilt(names: list[str]) -> list[str]:
    """The ops among `names` that DeepSpeed has not installed prebuilt and torch has not cached."""
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        return []
    return [n for n in names if not installed_ops.get(n) and not (build_dir(n) / f"{n}.so").is_file()]


def before_processes(setup, env=os.environ) -> list[str]:
    """Ops the process group's set-up compiles: DeepSpeed's CPU communication op for DeepSpeed
    (launcher config or recipe) on a machine without CUDA."""
    import torch

    deepspeed = env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" or (
        setup.row is not None and setup.row.zero_stage is not None
    )
    return ["deepspeed_shm_comm"] if deepspeed and not torch.cuda.is_available() else []


def at_optimizer(launch) -> list[str]:
    """Ops the engine's optimizer compiles: DeepSpeedCPUAdam for an optimizer offloaded to the host."""
    return ["cpu_adam"] if launch.family == "deepspeed" and "optimizer" in launch.offload else []


def announce(names: list[str]) -> str | None:
    """The line that says what is about to be compiled, or None when everything is built."""
    todo = unbuilt(names)
    if not todo:
        return None
    where = build_dir(todo[0]).parent
    return (
        f"DeepSpeed compiles its {' and '.join(todo)} op{'s' if len(todo) > 1 else ''} now (first use on this "
        f"machine, about a minute each; cached in {where} and reused afterwards)"
    )

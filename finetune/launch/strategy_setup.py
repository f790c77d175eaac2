"""Who sets up the distributed strategy of this run: the launcher's config, or the recipe from
inside the script (docs/preflight.md "Who sets up the strategy": the rule, and what the recipe
route prepares before the first PartialState).

DeepSpeed's C++ ops that are compiled on first use (JIT, torch.utils.cpp_extension): said before the 50-70 s build
starts, so a first launch does not look hung. `deepspeed_shm_comm` is built by DeepSpeed's CPU communication backend
when a DeepSpeed run's processes join on CPU (deepspeed/comm/torch.py build_shm_op), `cpu_adam` for an optimizer
offloaded to the host (DeepSpeedCPUAdam). Each is cached per Python/torch build and reused afterwards.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from finetune.launch.launcher import Launcher
from finetune.strategies import Strategy, by_recipe, trainer_arguments


@dataclass
class StrategySetup:
    set_up_by: str  # launcher-config | recipe | launcher-processes
    launcher: Launcher
    because: str  # the evidence for set_up_by, one clause
    row: Strategy | None = None  # the recipe's row, engaged in-script (set_up_by == "recipe")
    trainer_arguments: dict = field(default_factory=dict)  # TrainingArguments additions (recipe)
    world_of_one: bool = False  # this process exported RANK=0, WORLD_SIZE=1, ... itself
    cpu_gloo: str | None = None  # why the processes join gloo as CPU processes; None: they do not

    @property
    def needs_group(self) -> bool:
        """The recipe's row needs a process group even for one process (DeepSpeed, FSDP, DDP)."""
        return self.row is not None and self.row.multi_process

    def describe(self) -> str:
        """The console line (rank 0, at start)."""
        if self.set_up_by == "recipe":
            how = ", ".join(f"{k}={v}" for k, v in self.trainer_arguments.items() if k != "fsdp_config")
            how = f"TrainingArguments({how})" if how else "the processes as launched"
            gloo = f", gloo on CPU ({self.cpu_gloo})" if self.cpu_gloo else ""
            return (
                f"strategy {self.row.name} (offload {self.row.offload}) set up by the recipe: {how}{gloo}; "
                f"{self.because}"
            )
        if self.set_up_by == "launcher-processes":
            return f"strategy from the processes (the recipe accepts any): {self.because}"
        return f"strategy set up by the launcher: {self.because}"

    def record(self) -> dict:
        """run.json `strategy.setup` (docs/run_record.md)."""
        return {
            "launcher": self.launcher.kind,
            "config_file": self.launcher.config_file,
            "config_from": self.launcher.config_from,
            "because": self.because,
            "row": self.row.key if self.row else None,
            "trainer_arguments": self.trainer_arguments or None,
            "world_of_one": self.world_of_one,
            "cpu_gloo": self.cpu_gloo,
        }


def decide(env, launcher: Launcher, run_strategy: str, run_offload: str, *, root) -> StrategySetup:
    """Rules 1-3 of the module docstring (pure: the environment and launcher are given)."""
    for var, name in (("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"), ("ACCELERATE_USE_FSDP", "FSDP")):
        if env.get(var, "false").lower() == "true":
            return StrategySetup("launcher-config", launcher, f"{name} from {_origin(launcher)} ({var}=true)")
    if launcher.config_file:
        return StrategySetup("launcher-config", launcher, launcher.describe())
    if run_strategy == "any":
        return StrategySetup("launcher-processes", launcher, f"{launcher.describe()}, no strategy set up")
    row = by_recipe(run_strategy, run_offload)
    if row is None:  # the config validator allows only shipped names; a pair without a row is said here
        why = f"no shipped strategy row for run.strategy {run_strategy!r} with run.offload {run_offload!r}"
        return StrategySetup("launcher-processes", launcher, f"{launcher.describe()}; {why}")
    return StrategySetup(
        "recipe", launcher, f"{launcher.describe()} set up no strategy", row, trainer_arguments(row, root)
    )


def detect(cfg, env=os.environ) -> StrategySetup:
    """This process's setup, and the gloo decision (nothing is changed yet: see `prepare`)."""
    from finetune import resources
    from finetune.launch import cpu_rehearsal, launcher

    setup = decide(env, launcher.detect(env), cfg.run.strategy, cfg.run.offload, root=resources.ROOT)
    in_script = setup.set_up_by == "recipe" and setup.needs_group
    one = int(env.get("WORLD_SIZE", "1")) == 1
    setup.world_of_one = in_script and one and "LOCAL_RANK" not in env
    if in_script and env.get("ACCELERATE_USE_CPU", "false").lower() == "true":
        setup.cpu_gloo = "accelerate launch --cpu"
    elif cpu_rehearsal.requested():
        setup.cpu_gloo = "opt-in FINETUNE_CPU_DISTRIBUTED=1"
    elif in_script and one:
        import torch

        if not torch.cuda.is_available():
            setup.cpu_gloo = "one process on a machine without CUDA"
    return setup


def prepare(setup: StrategySetup, env=os.environ) -> None:
    """The environment changes the recipe route needs before the first PartialState (module docstring)."""
    if setup.world_of_one:
        with socket.socket() as s:  # a free port: parallel runs on one machine must not share one
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    if setup.cpu_gloo == "accelerate launch --cpu":
        env.pop("ACCELERATE_USE_CPU")


def adopt_deepspeed_comm(setup: StrategySetup, *, sequence_parallel: bool = False) -> None:
    """DeepSpeed rows engaged in-script, and every Ulysses run (Accelerate registers Ulysses' groups before DeepSpeed's
    engine initialises deepspeed.comm, which only ZeRO-3's zero.Init did earlier): deepspeed.comm wraps the torch group
    PartialState made (deepspeed/comm/comm.py init_distributed: "The user initialized torch.dist themselves")."""
    import torch.distributed as dist

    in_script = setup.set_up_by == "recipe" and setup.row.zero_stage is not None
    if not (in_script or sequence_parallel) or not dist.is_initialized():
        return
    import deepspeed.comm

    deepspeed.comm.init_distributed(dist_backend=dist.get_backend())


def _origin(launcher: Launcher) -> str:
    if launcher.config_file:
        return launcher.describe()
    return f"{launcher.kind}'s flags or environment"


# --- DeepSpeed's ops compiled on first use (see the module docstring) -----------------------------------


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


def ops_before_processes(setup, env=os.environ) -> list[str]:
    """Ops the process group's set-up compiles: DeepSpeed's CPU communication op for DeepSpeed
    (launcher config or recipe) on a machine without CUDA."""
    import torch

    deepspeed = env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" or (
        setup.row is not None and setup.row.zero_stage is not None
    )
    return ["deepspeed_shm_comm"] if deepspeed and not torch.cuda.is_available() else []


def ops_at_optimizer(launch) -> list[str]:
    """Ops the engine's optimizer compiles: DeepSpeedCPUAdam for an optimizer offloaded to the host."""
    return ["cpu_adam"] if launch.family == "deepspeed" and "optimizer" in launch.offload else []


def op_builds_line(names: list[str]) -> str | None:
    """The line that says what is about to be compiled, or None when everything is built."""
    todo = unbuilt(names)
    if not todo:
        return None
    where = build_dir(todo[0]).parent
    return (
        f"DeepSpeed compiles its {' and '.join(todo)} op{'s' if len(todo) > 1 else ''} now (first use on this "
        f"machine, about a minute each; cached in {where} and reused afterwards)"
    )


def say_op_builds(names: list[str]) -> None:
    """Rank 0 says which DeepSpeed ops are about to be compiled, if any."""
    line = op_builds_line(names)
    if line and os.environ.get("RANK", "0") == "0":
        print(f"[finetune] {line}", file=sys.stderr, flush=True)

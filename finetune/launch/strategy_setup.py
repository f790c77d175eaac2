"""Who sets up the distributed strategy of this run: the launcher's config, or the recipe from
inside the script (docs/preflight.md "Who sets up the strategy": the rule, and what the recipe
route prepares before the first PartialState).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

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


def adopt_deepspeed_comm(setup: StrategySetup, *, sequence_parallel: bool = False, env=os.environ) -> None:
    """DeepSpeed rows engaged in-script, DeepSpeed from the launcher's config on CPU (PartialState starts DeepSpeed's
    communication itself only off CPU, accelerate/state.py; else DeepSpeed's engine does it, and builds its CPU
    communication op, inside Trainer.train()), and every Ulysses run (Accelerate registers Ulysses' groups before
    DeepSpeed's engine initialises deepspeed.comm, which only ZeRO-3's zero.Init did earlier): deepspeed.comm wraps the
    torch group PartialState made (deepspeed/comm/comm.py init_distributed: "The user initialized torch.dist
    themselves"), here, where the run holds back the op's load notice (finetune/training/run.py)."""
    import torch.distributed as dist

    in_script = setup.set_up_by == "recipe" and setup.row.zero_stage is not None
    from_launcher = env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if not (in_script or from_launcher or sequence_parallel) or not dist.is_initialized():
        return
    import deepspeed.comm

    deepspeed.comm.init_distributed(dist_backend=dist.get_backend())


def _origin(launcher: Launcher) -> str:
    if launcher.config_file:
        return launcher.describe()
    return f"{launcher.kind}'s flags or environment"

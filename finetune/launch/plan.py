"""The launch, worked out once: one value that preflight, the resume plan, TrainingArguments and the
record all read, instead of each working the launch out again.

A launched process resolves it once its process group exists (`LaunchPlan.resolve`); `finetune train`
plans the launch it is about to start from its accelerate config (`LaunchPlan.of`).
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune import batch, precision
from finetune.launch import nodes
from finetune.launch.configs import DeclaredLaunch
from finetune.launch.nodes import RankPlace, SlurmStep
from finetune.launch.strategy_setup import StrategySetup
from finetune.mesh import Mesh
from finetune.mesh import of as mesh_of


@dataclass(frozen=True)
class Machines:
    """How the processes are spread over machines. A launched process gathers each rank's node from its live process
    group (`gathered`; finetune/launch/nodes.py); before a launch only the counts its config gives are known."""

    num_machines: int
    processes_per_machine: int
    ranks: tuple[RankPlace, ...] = ()  # every rank's place, by rank; empty before a launch
    slurm: SlurmStep | None = None  # the SLURM job step the launch runs in

    @classmethod
    def gathered(cls, state, processes_per_machine: int) -> Machines:
        """Collective: every rank calls it once its process group exists."""
        ranks, slurm = nodes.gather(state)
        return cls(len({r.node_rank for r in ranks}), processes_per_machine, ranks, slurm)

    def place(self, rank: int) -> RankPlace | None:
        return next((r for r in self.ranks if r.rank == rank), None)

    def ranks_on(self, node_rank: int) -> list[int]:
        return [r.rank for r in self.ranks if r.node_rank == node_rank]


@dataclass(frozen=True)
class LaunchPlan:
    """What this launch sets up, its parallel mesh included (sequence, tensor, context parallel sizes:
    finetune/mesh.py); every consumer of the data-parallel size reads it from here."""

    facts: DeclaredLaunch  # as the launch's accelerate config, its environment or the recipe's row say it
    setup: StrategySetup | None  # who sets the strategy up; None before a launch (`finetune train`)
    strategy: str  # single | ddp | zero1 | zero2 | zero3 | fsdp (run.strategy's names)
    offload: str  # none | optimizer | params | optimizer+params (run.offload's names)
    world_size: int  # processes on all machines
    machines: Machines
    policy: precision.Policy  # training.precision, `auto` resolved for the launch's device
    family: str  # torch | fsdp2 | deepspeed: who applies the policy (finetune/precision.py)
    cuda: bool  # the processes compute on CUDA devices (not CPU, gloo, or use_cpu)
    mesh: Mesh  # the recipe's `parallel` sizes over world_size (the live mesh: run.json strategy.parallel)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that each take their own micro-batches: world_size / (sp x tp x cp)."""
        return self.mesh.dp

    @property
    def distributed_type(self) -> str:
        return self.facts.distributed_type

    @property
    def zero_stage(self) -> int | None:
        if self.distributed_type != "DEEPSPEED":
            return None
        return int(((self.facts.deepspeed or {}).get("zero_optimization") or {}).get("stage", 0))

    @property
    def set_up_by(self) -> str | None:
        """launcher-config | recipe | launcher-processes (finetune/launch/strategy_setup.py)."""
        return self.setup.set_up_by if self.setup is not None else None

    @property
    def cpu_gloo(self) -> str | None:
        """Why the processes join gloo as CPU processes (finetune/launch/cpu_rehearsal.py); None: they do not."""
        return self.setup.cpu_gloo if self.setup is not None else None

    def effective_batch(self, per_device: int, grad_accum: int) -> int:
        return batch.effective_batch(per_device, grad_accum, self.data_parallel_size)

    @classmethod
    def of(
        cls, cfg, facts: DeclaredLaunch, setup: StrategySetup | None = None, machines: Machines | None = None
    ) -> LaunchPlan:
        """The launch `facts` describe, with the precision policy resolved for its device: CUDA when
        this machine has one and neither the launch nor the recipe asks for CPU processes. `machines`:
        as gathered in a launched process; else the counts the facts give."""
        import torch

        from finetune.launch import cpu_rehearsal

        strategy, offload = facts.strategy(expected=cfg.run.strategy)
        use_cpu = bool(cfg.training.typed.use_cpu) or facts.use_cpu or facts.gloo or cpu_rehearsal.requested()
        cuda = torch.cuda.is_available() and not use_cpu
        policy = precision.resolve(cfg.training.precision, cuda, cuda and torch.cuda.is_bf16_supported())
        return cls(
            facts=facts,
            setup=setup,
            strategy=strategy,
            offload=offload,
            world_size=facts.num_processes,
            machines=machines or Machines(facts.num_machines, facts.processes_per_machine),
            policy=policy,
            family=precision.family_of_distributed_type(facts.distributed_type),
            cuda=cuda,
            mesh=mesh_of(cfg.parallel, facts.num_processes),
        )

    @classmethod
    def resolve(cls, cfg, state, setup: StrategySetup | None = None) -> LaunchPlan:
        """This process's launch, once its process group exists: under `recipe` the recipe's row, else what the launcher
        exported (finetune/launch/configs.py); each rank's node gathered (collective: every rank resolves it)."""
        from finetune import resources
        from finetune.launch.configs import from_environment, from_recipe

        if setup is not None and setup.set_up_by == "recipe":
            facts = from_recipe(setup, state, resources.ROOT)
        else:
            source = setup.launcher.describe() if setup is not None and setup.launcher.config_file else None
            facts = from_environment(state, source=source)
            if setup is not None and setup.launcher.config_from == "default config":
                facts.default_config = setup.launcher.config_file
        return cls.of(cfg, facts, setup, Machines.gathered(state, facts.processes_per_machine))

"""The strategy table: every distributed strategy variant this project knows, one row each, so that adding one is a new
row here plus its shipped files (docs/architecture.md "Adding a strategy"). A row ties its names (planner key,
run.strategy/run.offload), its engine (Accelerate's distributed type, the ZeRO stage), its shipped files and its
recommendation order together; what the code does under a strategy is read from the row's properties (what it shards,
how its checkpoints reshard, which mesh dimensions run under it), never from its name. Both ways of launching it come
from the row: its shipped accelerate config (tests/test_strategies_table.py generates each file's content from the row
and holds the file to it) and what the script passes to TrainingArguments (`trainer_arguments`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

# Accelerate DistributedType values (accelerate/utils/dataclasses.py DistributedType).
# Data-parallel process groups: DDP under this project's names.
DATA_PARALLEL_TYPES = ("MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU")
# Launches whose processes each need an accelerator (torchrun / DeepSpeed launches).
ACCELERATOR_TYPES = ("MULTI_GPU", "DEEPSPEED", "FSDP")
# Processes per shipped multi-process config: the 2-GPU machines the recipes are sized for
# (`--num_processes N` overrides at launch).
SHIPPED_PROCESSES = 2


@dataclass(frozen=True)
class FsdpSettings:
    """A row's FSDP2 settings: the shipped accelerate configs' `fsdp_config` (accelerate's names: the fields, `fsdp_`
    first) and what the script passes to TrainingArguments when it engages FSDP itself (tests/test_strategies_table.py
    holds the files to them, and checks that the two build the same FullyShardedDataParallelPlugin)."""

    offload_params: bool = False  # CPUOffloadPolicy: parameters, gradients and the optimizer step on the host
    version: int = 2
    auto_wrap_policy: str = "TRANSFORMER_BASED_WRAP"  # one unit per model._no_split_modules class (decoder layer)
    # Explicit because the two routes default differently: accelerate's FSDP2 plugin SHARDED, transformers'
    # TrainingArguments FULL_STATE_DICT (training_args.py _process_fsdp_args). Checkpoints: each rank writes its shard.
    state_dict_type: str = "SHARDED_STATE_DICT"
    reshard_after_forward: bool = True
    # True would need ACCELERATE_USE_FSDP and FSDP_CPU_RAM_EFFICIENT_LOADING exported before
    # from_pretrained (transformers is_fsdp_enabled()), which the in-script route cannot do: keep False.
    cpu_ram_efficient_loading: bool = False
    activation_checkpointing: bool = False  # training.gradient_checkpointing instead

    def trainer_config(self) -> dict:
        """TrainingArguments(fsdp_config=...) in transformers 5.23's names: the accelerate names without
        the `fsdp_` prefix, except offload, which is `cpu_offload` there (`offload_params` would be
        ignored without a word, as any unknown key is)."""
        out = asdict(self)
        out["cpu_offload"] = out.pop("offload_params")
        return out


@dataclass(frozen=True)
class Strategy:
    key: str  # planner key, unique
    name: str  # run.strategy: single | ddp | zero1 | zero2 | zero3 | fsdp
    offload: str  # run.offload: none | optimizer | optimizer+params
    speed_rank: int  # 0 = fastest: the order in which the recommendation tries them (finetune/planning/report.py)
    description: str
    why: str
    distributed_type: str  # the Accelerate DistributedType its configs set (GPU and CPU variant alike)
    zero_stage: int | None = None  # DeepSpeed ZeRO stage; None for torch-native strategies
    accelerate_config: str | None = None  # relative to the resources root; None: no shipped config
    cpu_config: str | None = None  # the CPU-rehearsal variant (2 processes over gloo); None for one process
    deepspeed_config: str | None = None
    recipe: str | None = None  # the shipped strategy recipe (recipes/<recipe>.yaml)
    fsdp: FsdpSettings | None = None  # FSDP rows: the settings both launch routes use

    @property
    def multi_process(self) -> bool:
        """Its processes form a process group (every row but the one-device row)."""
        return self.distributed_type != "NO"

    @property
    def shards_params(self) -> bool:  # ZeRO paper §5: stage 1 shards optimizer states, 2 gradients, 3 parameters
        return self.distributed_type == "FSDP" or self.zero_stage == 3

    @property
    def shards_grads(self) -> bool:
        return self.distributed_type == "FSDP" or (self.zero_stage or 0) >= 2

    @property
    def shards_optimizer(self) -> bool:
        return self.distributed_type == "FSDP" or self.zero_stage is not None

    @property
    def replicates(self) -> bool:
        """Several processes, each holding the whole model and optimizer (DDP: one gradient all-reduce per step)."""
        return self.multi_process and not self.shards_optimizer

    @property
    def reshard(self) -> str:
        """How its checkpoint's states reach another world size: replicated (every rank holds them whole), universal
        (DeepSpeed's universal checkpoint), dcp (torch distributed checkpoint)."""
        return {"DEEPSPEED": "universal", "FSDP": "dcp"}.get(self.distributed_type, "replicated")

    @property
    def checkpoint_family(self) -> str:
        """Rows whose checkpoints resume each other: one device and DDP hold the same whole states; each other
        engine its own (offload may differ)."""
        return "replicated" if self.reshard == "replicated" else self.name

    def runs(self, dimension: str) -> bool:
        """Whether a mesh dimension (finetune/mesh.py) runs under it: sequence parallel (sp, Ulysses) needs DeepSpeed's
        process groups, tensor parallel (tp, AutoTP) composes with ZeRO up to stage 2, context parallel (cp) shards the
        sequence under FSDP2's device mesh."""
        return {
            "sp": self.zero_stage is not None,
            "tp": self.zero_stage in (1, 2),
            "cp": self.distributed_type == "FSDP",
        }[dimension]

    @property
    def offload_optimizer(self) -> bool:
        return self.offload != "none"

    @property
    def offload_params(self) -> bool:
        return self.offload == "optimizer+params"

    @property
    def launchable(self) -> bool:
        """A shipped accelerate config launches it (otherwise the row is for the planner only)."""
        return self.accelerate_config is not None


def _shipped(key: str, name: str, offload: str, speed_rank: int, description: str, why: str, *engine, **kw) -> Strategy:
    """A multi-process row whose shipped files are named after its key: accelerate_configs/<key>.yaml and its cpu/
    variant, recipes/<key>.yaml, and for DeepSpeed rows ds_configs/<key>.json."""
    files = {"accelerate_config": f"accelerate_configs/{key}.yaml", "cpu_config": f"accelerate_configs/cpu/{key}.yaml"}
    ds = f"ds_configs/{key}.json" if engine[0] == "DEEPSPEED" else None
    return Strategy(
        key, name, offload, speed_rank, description, why, *engine, **files, deepspeed_config=ds, recipe=key, **kw
    )


_SHARDS_PARAMS = "shards parameters too; 1.5x DDP's traffic (parameter all-gathers in forward and backward)"

# One row a strategy: key, run.strategy, run.offload, speed rank, description, why, its engine (distributed type, ZeRO
# stage), then its files.
STRATEGIES: tuple[Strategy, ...] = (
    Strategy(
        "single",
        "single",
        "none",
        0,
        "one device, no data parallelism",
        "one device, no communication at all",
        "NO",
        accelerate_config="accelerate_configs/single_gpu.yaml",
        recipe="qlora_baseline",
    ),
    _shipped(
        "ddp",
        "ddp",
        "none",
        1,
        "DDP: every rank holds everything",
        "plain data parallel: one gradient all-reduce per optimizer step, nothing sharded",
        "MULTI_GPU",
    ),
    Strategy(
        "zero1",
        "zero1",
        "none",
        2,
        "ZeRO-1: optimizer states sharded",
        "shards only the optimizer states; same traffic as DDP",
        "DEEPSPEED",
        1,
    ),
    _shipped(
        "zero2",
        "zero2",
        "none",
        3,
        "ZeRO-2: + gradients sharded",
        "shards optimizer states and gradients; same traffic as DDP",
        "DEEPSPEED",
        2,
    ),
    _shipped(
        "zero2_offload",
        "zero2",
        "optimizer",
        6,
        "ZeRO-2, optimizer states + step on the host",
        "optimizer states and step on the host: frees the device, costs PCIe copies and a CPU Adam step",
        "DEEPSPEED",
        2,
    ),
    _shipped(
        "zero3",
        "zero3",
        "none",
        5,
        "ZeRO-3: + parameters sharded",
        _SHARDS_PARAMS,
        "DEEPSPEED",
        3,
    ),
    Strategy(
        "zero3_offload_opt",
        "zero3",
        "optimizer",
        7,
        "ZeRO-3, optimizer offloaded to the host",
        "ZeRO-3 with the optimizer on the host",
        "DEEPSPEED",
        3,
    ),
    _shipped(
        "zero3_offload",
        "zero3",
        "optimizer+params",
        9,
        "ZeRO-3, optimizer and parameters offloaded to the host",
        "parameters and optimizer on the host: the least device memory, the slowest",
        "DEEPSPEED",
        3,
    ),
    _shipped(
        "fsdp",
        "fsdp",
        "none",
        4,
        "FSDP2: parameters, grads, optimizer sharded",
        _SHARDS_PARAMS,
        "FSDP",
        fsdp=FsdpSettings(),
    ),
    _shipped(
        "fsdp_offload",
        "fsdp",
        "optimizer+params",
        8,
        "FSDP2 with CPUOffloadPolicy (params, grads, optimizer step on host)",
        "parameters, gradients and optimizer on the host: the least device memory, the slowest",
        "FSDP",
        fsdp=FsdpSettings(offload_params=True),
    ),
)


def names(where: Callable[[Strategy], bool] = lambda s: s.launchable) -> tuple[str, ...]:
    """run.strategy names of the rows `where` holds, in the table's order, each once; by default the launchable
    rows' (what recipes may name: config RunConfig.strategy, besides "any": whatever the launch gives)."""
    return tuple(dict.fromkeys(s.name for s in STRATEGIES if where(s)))


def by_name(name: str | None) -> Strategy | None:
    """The first row of a run.strategy name (its offload variants share its engine); None for a name no row has."""
    return next((s for s in STRATEGIES if s.name == name), None)


def one_process() -> Strategy:
    """The one-device row: the reference the doctor and the sweep compare the others with."""
    return next(s for s in STRATEGIES if not s.multi_process)


def by_key(key: str) -> Strategy:
    for s in STRATEGIES:
        if s.key == key:
            return s
    raise KeyError(f"no strategy {key!r} (known: {', '.join(s.key for s in STRATEGIES)})")


def by_recipe(name: str, offload: str) -> Strategy | None:
    """The launchable row a recipe's (run.strategy, run.offload) means: offload `any` is the row
    without offload. None for `any` and for pairs no shipped row has (the config validator allows
    only shipped names, so that is an offload the strategy has no row for)."""
    for s in STRATEGIES:
        if s.launchable and s.name == name and s.offload == ("none" if offload == "any" else offload):
            return s
    return None


def trainer_arguments(row: Strategy, root: Path) -> dict:
    """What the script passes to TrainingArguments to engage `row` itself, when no launcher config set a strategy up
    (finetune/launch/strategy_setup.py): the same DeepSpeed JSON the row's accelerate config names (absolute: `root` is
    the resources root), or the row's FSDP settings. DDP and a single device need nothing beyond the processes."""
    if row.zero_stage is not None:
        return {"deepspeed": str(root / row.deepspeed_config)}
    if row.fsdp is not None:
        return {"fsdp": True, "fsdp_config": row.fsdp.trainer_config()}
    return {}


def planner_key(name: str | None, offload: str = "none") -> str:
    """The planner row for an engaged (name, offload): the exact row, else for an offload the
    table has no row of (e.g. FSDP offloading only the optimizer) the row of that name that
    offloads most, else the name's plain row. ValueError for a name without rows."""
    rows = [s for s in STRATEGIES if s.name == name]
    keys = [s.key for s in STRATEGIES]
    if not rows and name in keys:  # already a planner key
        return name
    if not rows:
        raise ValueError(f"no memory model for strategy {name!r} (known: {', '.join(keys)})")
    exact = [s for s in rows if s.offload == offload]
    if exact:
        return exact[0].key
    offloaded = [s for s in rows if s.offload != "none"]
    if offload != "none" and offloaded:
        return max(offloaded, key=lambda s: (s.offload_params, s.offload_optimizer)).key
    return rows[0].key


def name_of(
    distributed_type: str, *, zero_stage: int | None = None, num_processes: int | None = None, expected: str = "any"
) -> str:
    """Accelerate's DistributedType value -> the run.strategy name of the rows with that engine: `expected` (the
    recipe's run.strategy) when it is one of them, else the first.

    With `num_processes` (what a launch config asks for) a data-parallel type is DDP only with
    more than one process, and one process of any data-parallel type is `single`; without it
    (Accelerate's live state, which already knows whether ranks joined) the type decides alone.
    Types this project does not train with come back lower-cased, so a refusal can name them."""
    engine = distributed_type
    if distributed_type in DATA_PARALLEL_TYPES:  # the shipped configs' data-parallel type, or one process
        engine = "NO" if num_processes == 1 else "MULTI_GPU"
    elif distributed_type == "NO" and num_processes not in (None, 1):
        engine = None  # several processes of no strategy: no row
    found = [s.name for s in STRATEGIES if s.distributed_type == engine and s.zero_stage == zero_stage]
    if found:
        return expected if expected in found else found[0]
    return f"zero{zero_stage}" if zero_stage is not None else distributed_type.lower()  # DeepSpeed's name for a stage


def offload_device(section) -> str:
    """'cpu', 'nvme', ... or 'none' from a DeepSpeed offload section: the JSON's dict
    (`{"device": "cpu"}`) or DeepSpeed's parsed config object (its `.device` is an enum)."""
    if section is None:
        return "none"
    device = section.get("device") if isinstance(section, dict) else getattr(section, "device", None)
    device = getattr(device, "value", device)
    return str(device).lower() if device not in (None, "", "none") else "none"


def offload_name(optimizer_device: str | None, param_device: str | None) -> str:
    """run.offload from the two DeepSpeed offload devices ('none' or None = not offloaded)."""
    if param_device not in (None, "none"):
        return "optimizer+params" if optimizer_device not in (None, "none") else "params"
    return "optimizer" if optimizer_device not in (None, "none") else "none"


def launch_line(name: str, offload: str, recipe: str) -> str:
    """The accelerate launch line(s) for a recipe meant for (name, offload): its shipped config
    (the plain one when no row offloads that way) and, for multi-process strategies, the CPU
    rehearsal. Paths are relative to the repository root, where users launch from."""
    row = by_recipe(name, offload) or by_recipe(name, "none")
    config = row.accelerate_config if row else f"accelerate_configs/{name}.yaml"
    cpu = row.cpu_config if row else config.replace("accelerate_configs/", "accelerate_configs/cpu/")
    if cpu is None:  # one process runs on a CPU as it is
        return f"    accelerate launch --config_file {config} finetune/train.py --recipe {recipe}"
    return (
        f"    accelerate launch --config_file {config} finetune/train.py --recipe {recipe}\n"
        f"or, on a machine without a GPU (2 processes over gloo):\n"
        f"    FINETUNE_CPU_DISTRIBUTED=1 accelerate launch --config_file {cpu} finetune/train.py --recipe {recipe}"
    )

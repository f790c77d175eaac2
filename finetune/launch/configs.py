"""What a launch sets up, read into a DeclaredLaunch from one of three sources: the accelerate config (and the DeepSpeed
JSON it names) before `finetune train` launches (`from_config_file`), the environment `accelerate launch` exported to a
process (`from_environment`), or the recipe's strategy row the script engages itself (`from_recipe`). Problems met while
reading are collected, not raised, so preflight reports them with the rest (docs/preflight.md).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from finetune.errors import UserError
from finetune.strategies import DATA_PARALLEL_TYPES, name_of, offload_device, offload_name


@dataclass
class DeclaredLaunch:
    source: str  # where the facts come from, named in every problem
    distributed_type: str = "NO"  # Accelerate's DistributedType value
    num_processes: int = 1  # world size, all machines
    num_machines: int = 1
    use_cpu: bool = False  # the launch asks for CPU processes (use_cpu / --cpu / FINETUNE_CPU_DISTRIBUTED)
    mixed_precision: str | None = None  # "no", "fp16", "bf16", or None when the config leaves it to others
    gpu_ids: str | None = None  # "all" or "0,1"
    deepspeed: dict | None = None  # the DeepSpeed config (JSON file, or the accelerate config's fields)
    deepspeed_source: str | None = None
    fsdp_offload: bool = False
    gloo: bool = False  # the processes join gloo as CPU processes (TrainingArguments.use_cpu is set)
    data_parallel: bool = False  # a process group of one is still DDP (the recipe's ddp row engaged in-script)
    default_config: str | None = None  # the launcher read the user's accelerate default config (this path)
    problems: list[str] = field(default_factory=list)

    def read_deepspeed(self, path: Path, named_by: str, source: str) -> None:
        """The DeepSpeed JSON at `path` as this launch's config, or its problem noted."""
        try:
            self.deepspeed = read_deepspeed_json(path, named_by)
            self.deepspeed_source = source
        except UserError as e:
            self.problems.append(str(e))

    @property
    def processes_per_machine(self) -> int:
        return max(1, self.num_processes // max(1, self.num_machines))

    def strategy(self, expected: str = "any") -> tuple[str, str]:
        """(strategy, offload) in the names of recipes' run.strategy / run.offload: the strategy table's name for this
        engine, `expected` (the recipe's run.strategy) when its row has this engine (finetune/strategies.py name_of)."""
        if self.distributed_type == "DEEPSPEED":
            zero = (self.deepspeed or {}).get("zero_optimization") or {}
            return (
                name_of("DEEPSPEED", zero_stage=zero.get("stage", 0), expected=expected),
                offload_name(offload_device(zero.get("offload_optimizer")), offload_device(zero.get("offload_param"))),
            )
        offload = "optimizer+params" if self.distributed_type == "FSDP" and self.fsdp_offload else "none"
        # a process group of one that is still DDP: the type decides alone, as in a live state
        processes = None if self.data_parallel and self.distributed_type in DATA_PARALLEL_TYPES else self.num_processes
        return name_of(self.distributed_type, num_processes=processes, expected=expected), offload


def read_yaml(path: Path) -> dict:
    """An accelerate config as a dict, or a UserError naming the file, line and problem."""
    from finetune.config.recipe import duplicate_keys

    try:
        text = path.read_text(encoding="utf-8")
        values = yaml.safe_load(text)
    except UnicodeDecodeError as e:
        raise UserError(f"accelerate config {path}: not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise UserError(f"accelerate config {path}: {where}invalid YAML: {getattr(e, 'problem', None) or e}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise UserError(
            f"accelerate config {path}: the top level must be a mapping of keys, got {type(values).__name__}"
        )
    twice = duplicate_keys(text)
    if twice:
        raise UserError(f"accelerate config {path}: " + "; ".join(twice))
    return values


def read_deepspeed_json(path: Path, named_by: str) -> dict:
    """A DeepSpeed config file, or a UserError naming it, who named it, and the JSON position."""
    if not path.is_file():
        raise UserError(f"DeepSpeed config {path} (named by {named_by}): file not found")
    twice: list[str] = []
    try:
        values = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=lambda pairs: _unique(pairs, twice))
    except UnicodeDecodeError as e:
        raise UserError(f"DeepSpeed config {path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise UserError(
            f"DeepSpeed config {path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}"
        ) from None
    if not isinstance(values, dict):
        raise UserError(f"DeepSpeed config {path}: the top level must be a JSON object, got {type(values).__name__}")
    if twice:
        raise UserError(
            f"DeepSpeed config {path}: key(s) {', '.join(map(repr, twice))} given twice in one object; only one "
            "value can apply: remove the other"
        )
    return values


def _unique(pairs: list[tuple[str, object]], twice: list[str]) -> dict:
    """json.loads' object hook: the object, with keys given twice noted (json keeps the last silently)."""
    seen = set()
    for key, _ in pairs:
        if key in seen and key not in twice:
            twice.append(key)
        seen.add(key)
    return dict(pairs)


def resolve_path(name: str, base_dirs: list[Path]) -> Path:
    """An absolute path as given; a relative one from the first base directory that has it."""
    path = Path(name).expanduser()
    if path.is_absolute():
        return path
    for base in base_dirs:
        if (base / path).is_file():
            return base / path
    return Path.cwd() / path


def from_config_file(
    path: Path,
    *,
    num_processes: int | None = None,
    cpu: bool = False,
    deepspeed_config_file: str | None = None,
    base_dirs: list[Path] = (),
) -> DeclaredLaunch:
    """What `accelerate launch --config_file PATH [--num_processes N] [--cpu]` will set up."""
    from accelerate.utils import DistributedType

    facts = DeclaredLaunch(source=f"accelerate config {path}")
    try:
        values = read_yaml(path)
    except UserError as e:
        facts.problems.append(str(e))
        return facts
    dtype = str(values.get("distributed_type", "NO"))
    allowed = [d.value for d in DistributedType]
    if dtype not in allowed:
        facts.problems.append(
            f"{facts.source}: distributed_type {dtype!r} is not one Accelerate knows; allowed: {', '.join(allowed)}"
        )
        return facts
    facts.distributed_type = dtype
    try:
        facts.num_processes = int(num_processes or values.get("num_processes") or 1)
        facts.num_machines = int(values.get("num_machines") or 1)
    except (TypeError, ValueError):
        facts.problems.append(
            f"{facts.source}: num_processes and num_machines must be integers, got "
            f"{values.get('num_processes')!r} and {values.get('num_machines')!r}"
        )
    facts.use_cpu = bool(cpu or values.get("use_cpu"))
    facts.mixed_precision = values.get("mixed_precision")
    facts.gpu_ids = None if values.get("gpu_ids") is None else str(values.get("gpu_ids"))
    ds_section = values.get("deepspeed_config") or {}
    fsdp_section = values.get("fsdp_config") or {}
    if dtype == "DEEPSPEED" and fsdp_section:
        facts.problems.append(
            f"{facts.source}: distributed_type DEEPSPEED but the file also has an fsdp_config "
            f"section (Accelerate ignores it); remove fsdp_config, or use an FSDP config"
        )
    if dtype == "FSDP" and ds_section:
        facts.problems.append(
            f"{facts.source}: distributed_type FSDP but the file also has a deepspeed_config "
            f"section (Accelerate ignores it); remove deepspeed_config, or use a DeepSpeed config"
        )
    if dtype == "DEEPSPEED":
        ds_file = deepspeed_config_file or ds_section.get("deepspeed_config_file")
        if ds_file:
            ds_path = resolve_path(str(ds_file), [*base_dirs, path.parent])
            named_by = "--deepspeed_config_file" if deepspeed_config_file else f"{path} deepspeed_config_file"
            facts.read_deepspeed(ds_path, named_by, f"DeepSpeed config {ds_path}")
        else:
            facts.deepspeed = _deepspeed_from_fields(ds_section)
            facts.deepspeed_source = f"{facts.source} deepspeed_config"
    if dtype == "FSDP":
        facts.fsdp_offload = str(fsdp_section.get("fsdp_offload_params", False)).lower() == "true"
    return facts


def _deepspeed_from_fields(fields: dict) -> dict:
    """The DeepSpeed config Accelerate builds from an accelerate config without a JSON file
    (accelerate/utils/dataclasses.py DeepSpeedPlugin: zero_stage, offload_*_device, ...)."""
    out: dict = {
        "zero_optimization": {
            "stage": int(fields.get("zero_stage", 2)),
            "offload_optimizer": {"device": fields.get("offload_optimizer_device", "none")},
            "offload_param": {"device": fields.get("offload_param_device", "none")},
        }
    }
    for key in ("gradient_accumulation_steps", "gradient_clipping"):
        if fields.get(key) is not None:
            out[key] = fields[key]
    return out


def from_environment(state, source: str | None = None) -> DeclaredLaunch:
    """What `accelerate launch` set up for this process (see the module docstring for the names).
    `source` names the launch in problems (finetune/launch/strategy_setup.py knows the config file)."""
    from finetune.launch import cpu_rehearsal

    env = os.environ
    config = env.get("FINETUNE_ACCELERATE_CONFIG")
    facts = DeclaredLaunch(
        source=source or (f"accelerate config {config}" if config else "the accelerate launch environment")
    )
    use_ds = env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    use_fsdp = env.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if use_ds and use_fsdp:
        facts.problems.append(
            "ACCELERATE_USE_DEEPSPEED and ACCELERATE_USE_FSDP are both true in this process's "
            "environment: DeepSpeed and FSDP cannot run together. Unset the one your accelerate "
            "config does not ask for (see `env | grep ACCELERATE_USE`)"
        )
    facts.distributed_type = "DEEPSPEED" if use_ds else "FSDP" if use_fsdp else state.distributed_type.value
    facts.num_processes = int(env.get("WORLD_SIZE", state.num_processes))
    facts.use_cpu = env.get("ACCELERATE_USE_CPU", "false").lower() == "true" or cpu_rehearsal.requested()
    facts.gloo = cpu_rehearsal.requested()
    facts.mixed_precision = env.get("ACCELERATE_MIXED_PRECISION")
    local = env.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit():
        facts.num_machines = max(1, facts.num_processes // int(local))
    if use_ds:
        ds_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if ds_file and ds_file != "None":
            ds_path = resolve_path(ds_file, [])
            facts.read_deepspeed(ds_path, "ACCELERATE_DEEPSPEED_CONFIG_FILE", f"DeepSpeed config {ds_path}")
        else:
            fields = {
                "zero_stage": env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2),
                "offload_optimizer_device": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none"),
                "offload_param_device": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none"),
            }
            for key, var in (
                ("gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
                ("gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING"),
            ):
                if env.get(var) not in (None, "None", "none"):
                    fields[key] = _number(env[var])
            facts.deepspeed = _deepspeed_from_fields(fields)
            facts.deepspeed_source = "the DeepSpeed settings of " + facts.source
    if use_fsdp:
        facts.fsdp_offload = env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true"
    return facts


def from_recipe(setup, state, root: Path) -> DeclaredLaunch:
    """What the script engages itself (setup.set_up_by == "recipe"): the row's DeepSpeed JSON or FSDP
    settings with the processes the launcher gave; DDP and one device as Accelerate set them up."""
    row = setup.row
    source = (
        f"the recipe's strategy row {row.key!r} (set up in the script; {setup.because})"
        if row.zero_stage is not None or row.fsdp is not None
        else f"the processes of {setup.launcher.describe()} (no strategy set up by a launcher config)"
    )
    facts = from_environment(state, source=source)
    facts.gloo = setup.cpu_gloo is not None
    facts.use_cpu = facts.use_cpu or facts.gloo
    if row.zero_stage is not None:
        facts.distributed_type = "DEEPSPEED"
        path = root / row.deepspeed_config
        facts.read_deepspeed(
            path, f"the strategy row {row.key!r}", f"DeepSpeed config {path} (the recipe's row {row.key!r})"
        )
    elif row.fsdp is not None:
        facts.distributed_type = "FSDP"
        facts.fsdp_offload = row.fsdp.offload_params
    facts.data_parallel = row.replicates
    return facts


def _number(text: str):
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(text)
    return text

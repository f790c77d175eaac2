"""TrainingArguments, built here and nowhere else: a run's from its recipe and its launch, once, before
the model loads (ZeRO-3's zero.Init reaches from_pretrained through TrainingArguments(deepspeed=...)).

What each source adds to the recipe's `training` fields: the strategy the recipe sets up itself
(deepspeed= or fsdp=, fsdp_config=), the precision policy's bf16/fp16, use_cpu for gloo and CPU
autocast, the learning rate scaled to the effective batch, the speed options' Liger setting, and
Trainer's per-micro-batch NaN filter off (the run's guard covers it without a host sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from finetune import batch
from finetune.errors import ConfigError
from finetune.launch.plan import LaunchPlan
from finetune.telemetry.sinks import TRACKERS
from finetune.training import speed

if TYPE_CHECKING:
    from transformers import TrainingArguments


@dataclass(frozen=True)
class RunArguments:
    """A run's TrainingArguments and what was taken out of the recipe's fields for others to apply."""

    args: TrainingArguments
    batch: dict  # run.json `batch` (finetune/batch.py)
    lr: dict  # run.json `lr`: the base rate, the rule and the applied rate the optimizer is built with
    save_total_limit: int | None  # rotated once a checkpoint is complete (finetune/checkpointing/checkpoints.py)
    gradient_checkpointing: bool  # applied by finetune/modeling/load.py before the LoRA wrap


# Fields the run applies itself instead of Trainer: the rotation (once a checkpoint is complete) and
# activation checkpointing (finetune/modeling/load.py, before the LoRA wrap).
OURS_TO_APPLY = ("save_total_limit", "gradient_checkpointing", "activation_checkpointing")


def for_run(cfg, launch: LaunchPlan, *, output_dir: Path, run_name: str) -> RunArguments:
    given = cfg.training.typed
    values = {k: v for k, v in cfg.training.args.items() if k not in OURS_TO_APPLY}  # the rest goes to Trainer
    checkpointing = bool(given.gradient_checkpointing or given.activation_checkpointing)
    if launch.cpu_gloo is not None:
        values["use_cpu"] = True  # Trainer's PartialState joins the gloo group (finetune/launch/cpu_rehearsal.py)
    values.update(launch.setup.trainer_arguments if launch.setup is not None else {})  # the recipe's own strategy
    values.update(launch.policy.training_args(launch.family))
    # Trainer's NaN/Inf filter of the logged loss reads every micro-batch's loss on the host (a sync
    # per micro-batch); ResilientTrainer already logs a non-finite micro-batch as 0, on the device.
    values.setdefault("logging_nan_inf_filter", False)
    if (values["bf16"] or values["fp16"]) and not launch.cuda:
        values["use_cpu"] = True  # TrainingArguments accepts bf16 without CUDA only with use_cpu (CPU autocast)
    sizes = batch.section(
        values["per_device_train_batch_size"], values["gradient_accumulation_steps"], launch.data_parallel_size
    )
    lr = batch.lr_scaling(
        values["learning_rate"], cfg.training.lr_scaling, sizes["effective"], cfg.training.lr_reference_batch_size
    )
    values["learning_rate"] = lr["applied"]  # the optimizer is built from this value
    values.update(mesh_arguments(cfg, launch))
    integrated = [name for name in cfg.logging.report_to if name not in dict(TRACKERS)]  # transformers' own
    args = build(output_dir=str(output_dir), run_name=run_name, report_to=integrated or "none", **values)
    return RunArguments(args, sizes, lr, given.save_total_limit, checkpointing)


def mesh_arguments(cfg, launch: LaunchPlan) -> dict:
    """What engages the mesh (finetune/mesh.py, docs/parallelism.md): Accelerate's ParallelismConfig for sequence and
    context parallelism, every size given (unset ones would be read from PARALLELISM_CONFIG_* variables); for tensor
    parallelism the launch's DeepSpeed config with tensor_parallel.autotp_size and
    zero_optimization.gather_16bit_weights_on_model_save (without it Trainer.save_model writes no weights)."""
    m = launch.mesh
    out: dict = {}
    if m.sp > 1 or m.cp > 1:
        from accelerate import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        sp_handler = None
        if m.sp > 1:  # batch lengths vary (padded to a multiple of sp_size, or to data.max_length over gloo)
            sp_handler = DeepSpeedSequenceParallelConfig(
                sp_seq_length_is_variable=True, sp_attn_implementation=cfg.model.attn_implementation
            )
        out["parallelism_config"] = ParallelismConfig(
            dp_replicate_size=1,
            dp_shard_size=m.dp,
            tp_size=1,
            cp_size=m.cp,
            cp_backend="torch",
            sp_size=m.sp,
            sp_backend="deepspeed",
            sp_handler=sp_handler,
        )
    if m.tp > 1:
        ds = dict(launch.facts.deepspeed or {})
        ds["tensor_parallel"] = {**(ds.get("tensor_parallel") or {}), "autotp_size": m.tp}
        ds["zero_optimization"] = {**(ds.get("zero_optimization") or {}), "gather_16bit_weights_on_model_save": True}
        out["deepspeed"] = ds  # the launch's own JSON (recipe row or accelerate config), AutoTP added
    return out


def build(**values) -> TrainingArguments:
    """The one TrainingArguments(...) call (the benchmark's sides come here too); a value Trainer
    refuses is a ConfigError naming it."""
    from transformers import TrainingArguments

    try:
        return TrainingArguments(**speed.trainer_overrides(values))
    except (ValueError, TypeError) as e:
        raise ConfigError([f"training: {e}"], "TrainingArguments") from None

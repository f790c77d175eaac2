"""The model and the Trainer as `finetune train` builds them, from a resolved configuration, the
launch and the TrainingArguments: finetune/training/run.py's phases and `finetune bench`'s own side
(finetune/bench/worker.py) both call these, so the benchmark measures the trainer users run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from finetune.config.sections import Config
    from finetune.launch.plan import LaunchPlan
    from finetune.training.arguments import RunArguments
    from finetune.training.resilience import ResilientTrainer


def model_for(cfg: Config, launch: LaunchPlan, arguments: RunArguments):
    """The model in the policy's dtypes (LoRA/QLoRA wrapped), with the loss installed before Trainer wraps it."""
    from transformers import set_seed

    from finetune.data import rows
    from finetune.modeling import loss
    from finetune.modeling.load import check_init_dtype, load_model
    from finetune.precision import torch_dtype

    args = arguments.args
    set_seed(args.seed)  # LoRA init must not depend on what the strategy's setup drew from the RNG before
    model = load_model(
        cfg.model,
        cfg.method,
        gradient_checkpointing=arguments.gradient_checkpointing,
        policy=launch.policy,
        deepspeed=launch.family == "deepspeed",
    )
    if launch.family == "deepspeed":  # zero.Init's dtype trap: the module must be in the policy's dtype
        check_init_dtype(model, torch_dtype(launch.policy.module_dtype(cfg.method.name, launch.family)))
    loss.install(
        model,
        cfg.training.loss_impl,
        chunk=cfg.training.loss_chunk_tokens,
        label_smoothing=args.label_smoothing_factor,
        use_liger_kernel=args.use_liger_kernel,
        device_type=args.device.type,  # before Trainer wraps the model (finetune/modeling/loss.py)
        tokens=args.per_device_train_batch_size  # a micro-batch's most positions on this rank, bucketing included
        * rows.longest_row(args.per_device_train_batch_size, cfg.data.max_length, cfg.data)
        // (launch.mesh.sp * launch.mesh.cp),
        tensor_parallel=launch.mesh.tp,
    )
    return model


def trainer_for(
    cfg: Config,
    launch: LaunchPlan,
    arguments: RunArguments,
    model,
    *,
    train_dataset,
    eval_dataset,
    tokenizer,
    sinks,
    machines=None,
    universal=False,
    **handed,
) -> ResilientTrainer:
    """ResilientTrainer over the configured batch layout, with the strategy that engaged checked against the recipe and
    the precision policy applied; both are read back from the live objects before step 1 (finetune/training/hooks.py).
    Handed over as the trainer is built: `sinks` (finetune/telemetry/sinks.py); `machines`: a run's (run.json `nodes`;
    None in the benchmark); `universal`: DeepSpeed loads the checkpoint resumed from as a universal one
    (finetune/checkpointing/universal.py); `handed`: what else ResilientTrainer takes: `stops` (the process's stop
    signals and watchdog), and from a run the world size that wrote that checkpoint, DDP's find_unused_parameters as
    decided from the model, the completion marker's run facts."""
    from finetune.data import collate
    from finetune.telemetry import meter
    from finetune.telemetry.sinks import TRACKERS
    from finetune.training.hooks import RunHooks
    from finetune.training.resilience import ResilientTrainer

    trainer = ResilientTrainer(
        model=model,
        args=arguments.args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=collate.make_collator(
            cfg.data,
            cfg.model,
            tokenizer.pad_token_id,
            shards=collate.SequenceShards.of(
                launch.mesh, arguments.args.per_device_train_batch_size, cfg.data.max_length, cuda=launch.cuda
            ),
        ),
        processing_class=tokenizer,
        callbacks=[tracker() for name, tracker in TRACKERS if name in cfg.logging.report_to],  # logging.report_to
        sinks=sinks,
        **handed,
        **meter.mfu_inputs(model, cfg.method.name),
        save_total_limit=arguments.save_total_limit,
        on_nonfinite=cfg.training.on_nonfinite,
        max_nonfinite_skips=cfg.training.max_nonfinite_skips,
        on_collapse=cfg.training.on_collapse,
        collapse_windows=cfg.training.collapse_windows,
    )
    # the strategy refused now if it is not the recipe's; the live engine and precision before step 1
    trainer.hooks = RunHooks(
        trainer, cfg, launch, learning_rate=arguments.lr["applied"], sinks=sinks, machines=machines
    )
    trainer.add_callback(trainer.hooks)
    apply_precision(trainer, launch.policy)
    if universal:
        from finetune.checkpointing import universal as universal_checkpoint

        universal_checkpoint.enable_loading(trainer)
    return trainer


def apply_precision(trainer, policy) -> None:
    """FSDP2's MixedPrecisionPolicy and DeepSpeed's precision keys, read by Accelerator.prepare
    (accelerate/utils/fsdp_utils.py fsdp2_prepare_model; accelerator.py _prepare_deepspeed)."""
    from finetune.precision import torch_dtype

    state = trainer.accelerator.state
    if trainer.accelerator.is_fsdp2:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs = policy.fsdp_mixed_precision() or {}
        state.fsdp_plugin.mixed_precision_policy = MixedPrecisionPolicy(
            **{k: torch_dtype(v) if k.endswith("_dtype") else v for k, v in kwargs.items()}
        )
    ds = getattr(state, "deepspeed_plugin", None)
    if ds is not None:
        for section, values in policy.deepspeed_keys().items():
            ds.deepspeed_config.setdefault(section, {}).update(values)

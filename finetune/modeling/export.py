"""The final export (`runs/<name>/model/`): a LoRA adapter or one consolidated model that loads in a
single plain process, under every strategy.

Why this exists: `Trainer.save_model` (transformers 5.23) writes nothing at all for FSDP when the
plugin's state_dict_type is SHARDED_STATE_DICT, which is what FSDP2 checkpoints should use (each
rank writes its shard). For the export we gather a full state dict instead: Accelerate's
`get_state_dict` on an FSDP2 model is `get_model_state_dict(full_state_dict=True, cpu_offload=True)`,
a collective every rank joins. DeepSpeed ZeRO-3 gathers 16-bit weights inside `save_model`
(ds_configs/zero3*.json set stage3_gather_16bit_weights_on_model_save). Afterwards the export is
checked for weights, so a strategy that silently saves nothing fails the run instead.
"""

from __future__ import annotations

from pathlib import Path

WEIGHT_FILES = (
    "adapter_model.safetensors",
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.bin",
    "pytorch_model.bin",
)


def save_final_model(trainer, model_dir: str | Path) -> None:
    """Save the trained model on every rank's behalf (call on all ranks)."""
    model_dir = str(model_dir)
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    if plugin is not None and "FULL_STATE_DICT" not in str(plugin.state_dict_type):
        state_dict = trainer.accelerator.get_state_dict(trainer.model)  # collective: full, on CPU
        if trainer.args.should_save:
            trainer._save(model_dir, state_dict=state_dict)
        trainer.accelerator.wait_for_everyone()
    else:
        trainer.save_model(model_dir)
    if trainer.args.should_save and not any((Path(model_dir) / f).is_file() for f in WEIGHT_FILES):
        raise RuntimeError(
            f"the export in {model_dir} holds no weights (looked for {', '.join(WEIGHT_FILES)}); "
            f"strategy {trainer.accelerator.distributed_type.value} saved nothing"
        )

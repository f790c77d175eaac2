"""Using a ZeRO-3-partitioned model outside the DeepSpeed engine (the exact-match evaluation
before training).

Why this exists: with ZeRO-3 (`zero3_init_flag: true`) `from_pretrained` loads every weight
straight into its shard, so until Trainer builds the engine (which installs the hooks that gather
each layer's parameters for its forward) the model's parameters are empty placeholders and
generate() fails ("Padding_idx must be within num_embeddings"). Before training we gather the
full parameters for the duration of the evaluation, read-only (modifier_rank=None), on every rank.
That costs the full model's memory on each rank for a moment; after training the engine's own
hooks do the gathering layer by layer. Other strategies shard only when Trainer wraps the model,
so this is a no-op for them.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def full_parameters(model):
    """Inside: every parameter of a ZeRO-3-partitioned, not yet wrapped model is whole."""
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not partitioned:
        yield model
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield model


def check_init_dtype(model, requested) -> None:
    """Refuse a model that ZeRO-3's `zero.Init` created in another dtype than it was loaded in.

    Why: transformers enters `deepspeed.zero.Init` for `from_pretrained` under ZeRO-3
    (accelerate's zero3_init_flag), and zero.Init creates every float parameter in the dtype of the
    DeepSpeed config (deepspeed runtime/zero/partition_parameters.py Init._set_dtype: bf16.enabled
    -> bfloat16, fp16.enabled -> float16, else float32), whatever `dtype=` asked. The shipped JSONs
    leave bf16.enabled "auto", which Trainer fills from TrainingArguments bf16; left false, a model
    loaded as bfloat16 silently trains in float32: measured on an H200 (Llama-3.2-1B, full, world
    size 1) 7x slower than ZeRO-2 with 1.7x its memory (docs/speed.md "DeepSpeed ZeRO-3 settings")."""
    import torch

    got = {
        p.ds_tensor.dtype
        for p in model.parameters()
        if hasattr(p, "ds_tensor") and p.ds_tensor.dtype.is_floating_point and type(p).__name__ != "Params4bit"
    }
    from finetune.precision import dtype_name

    wrong = sorted(dtype_name(d) for d in got if d != requested)
    if wrong and requested in (torch.bfloat16, torch.float16, torch.float32):
        from finetune.errors import UserError

        want = dtype_name(requested)
        raise UserError(
            f"ZeRO-3 created the model's parameters in {', '.join(wrong)}, not the {want} it was loaded in "
            f"(model.dtype): zero.Init (accelerate's zero3_init_flag) takes the dtype from the DeepSpeed config, "
            f"whose bf16.enabled/fp16.enabled the precision policy fills (training.precision, docs/precision.md). "
            f'Training would run in {wrong[0]}. Check that the DeepSpeed config leaves bf16/fp16 "enabled" '
            f'to "auto" (or matches the policy), or load the model in {wrong[0]} on purpose (model.dtype: {wrong[0]})'
        )

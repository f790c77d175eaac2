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

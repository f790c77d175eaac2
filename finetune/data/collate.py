"""Batches for the trainer, in the configured layout (docs/speed.md "Batch layouts"): padded (default), packed at build
time (finetune/data/pack.py; the collator states the real token count, REAL_TOKENS_KEY) or padding-free
(transformers' DataCollatorWithFlattening). Which layouts are safe with which attention implementation:
finetune/training/speed.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from finetune.data.render import IGNORE_INDEX
from finetune.data.rows import round_up

FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3")
# A packed batch has no attention mask, so the trainer cannot tell the padding at the end of a
# shorter row from real tokens; the collator states each row's real token count under this key
# and FinetuneTrainer takes it out of the batch before the forward pass.
REAL_TOKENS_KEY = "num_real_input_tokens"
# The meter's counts of a batch (finetune/telemetry/meter.py batch_counts: input tokens, trained tokens,
# examples, sum of squared example lengths) as Python ints, added by FinetuneTrainer's collator from
# the CPU batch before the data loader moves it to the device; taken out before the forward pass.
COUNTS_KEY = "finetune_batch_counts"


def collate(features: list[dict], pad_token_id: int, pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad a batch: input_ids with pad_token_id, labels with -100.

    Unpacked batches get attention_mask (1 real, 0 padding). Packed batches (features have position_ids) get no
    attention_mask: transformers then derives a block-diagonal causal mask from position_ids. Padding continues 0, 1, 2,
    ... so it forms its own pseudo-sequence that no real token attends to. The model must run without a KV cache
    (use_cache=False, as Trainer does) or transformers ignores position_ids for masking.
    """
    if not features:
        raise ValueError("collate() got an empty batch")
    if pad_token_id is None:
        raise ValueError("collate() needs a pad_token_id (set tokenizer.pad_token, e.g. to the eos token)")
    packed = ["position_ids" in f for f in features]
    if any(packed) and not all(packed):
        raise ValueError("collate() got a batch mixing packed and unpacked rows")
    longest = round_up(max(len(f["input_ids"]) for f in features), pad_to_multiple_of)
    batch = len(features)
    input_ids = torch.full((batch, longest), pad_token_id, dtype=torch.long)
    labels = torch.full((batch, longest), IGNORE_INDEX, dtype=torch.long)
    if all(packed):
        position_ids = torch.arange(longest, dtype=torch.long).repeat(batch, 1)
    else:
        attention_mask = torch.zeros((batch, longest), dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        input_ids[i, :n] = torch.as_tensor(f["input_ids"], dtype=torch.long)
        labels[i, :n] = torch.as_tensor(f["labels"], dtype=torch.long)
        if all(packed):
            position_ids[i, :n] = torch.as_tensor(f["position_ids"], dtype=torch.long)
            position_ids[i, n:] = torch.arange(longest - n, dtype=torch.long)
        else:
            attention_mask[i, :n] = 1
    layout = {"position_ids": position_ids} if all(packed) else {"attention_mask": attention_mask}
    return {"input_ids": input_ids, "labels": labels, **layout}


def make_collator(
    data_cfg, model_cfg, pad_token_id: int, *, shards: SequenceShards | None = None
) -> Callable[[list[dict]], dict]:
    """The batch builder for the configured layout (see the module docstring). With
    data.pad_to_multiple_of every batch's length is rounded up to that multiple (shape bucketing);
    with `shards` (sequence parallelism) batches are cut into equal shards (sharded_batch)."""
    multiple = getattr(data_cfg, "pad_to_multiple_of", None)
    if shards is not None:
        return lambda features: sharded_batch(features, pad_token_id, multiple, shards)
    if getattr(data_cfg, "padding_free", False):
        from transformers import DataCollatorWithFlattening

        flat = DataCollatorWithFlattening(return_flash_attn_kwargs=model_cfg.attn_implementation in FLASH_ATTENTION)

        def padding_free(features: list[dict]) -> dict:
            if any("position_ids" in f for f in features):  # the collator would renumber them
                raise ValueError("padding-free batches take unpacked examples; data.packing is also set")
            real = sum(len(f["input_ids"]) for f in features)
            filler = round_up(real, multiple) - real
            if not filler:
                return flat(features)
            # The filler extends the last example (positions continue, labels -100): causal attention keeps every real
            # token blind to it, the example count is unchanged, and the stated count keeps it out of the input tokens.
            last = features[-1]
            padded = [
                *features[:-1],
                {
                    "input_ids": [*last["input_ids"], *[pad_token_id] * filler],
                    "labels": [*last["labels"], *[IGNORE_INDEX] * filler],
                },
            ]
            batch = flat(padded)
            batch[REAL_TOKENS_KEY] = torch.tensor(real, dtype=torch.long)
            return batch

        return padding_free
    if getattr(data_cfg, "packing", False):
        return lambda features: count_real_tokens(collate(features, pad_token_id, multiple), features)
    return lambda features: collate(features, pad_token_id, multiple)


@dataclass(frozen=True)
class SequenceShards:
    """How Ulysses sequence parallelism cuts batches (DeepSpeed's UlyssesSPDataLoaderAdapter gathers
    each rank's batch and gives every rank 1/sp of its positions)."""

    sp: int  # shards per row: its length must be a multiple
    rows: int  # micro-batch rows: Ulysses' attention is built for this batch size
    length: int | None  # every batch padded to it: gloo gathers only equal shapes (None: NCCL, any)
    # False for context parallelism: Trainer accepts only a causal mask there, so the batch states its
    # real tokens per row instead (REAL_TOKENS_KEY) and the right padding stays unseen by causality
    mask: bool = True

    @classmethod
    def of(cls, mesh, rows: int, max_length: int, *, cuda: bool) -> SequenceShards | None:
        """How a run's batches are cut under its mesh (finetune/mesh.py), None without sequence or
        context parallelism. Ulysses over gloo (CPU): every batch max_length long. Context
        parallelism: 2 chunks per rank (torch's load-balanced ring), no mask."""
        if mesh.sp > 1:
            return cls(mesh.sp, rows, None if cuda else max_length)
        if mesh.cp > 1:
            return cls(2 * mesh.cp, rows, None, mask=False)
        return None


def sharded_batch(features: list[dict], pad_token_id: int, multiple: int | None, shards: SequenceShards) -> dict:
    """A padded batch for sequence parallelism: its length a multiple of sp (or `shards.length`), position_ids (Ulysses
    gathers them to rebuild the causal order; it drops the attention mask), and at least `shards.rows` rows: a short
    last batch gets filler rows (pad tokens, labels -100, mask 0), which add no loss and no counted token."""
    filler = {"input_ids": [pad_token_id], "labels": [IGNORE_INDEX], "filler": True}
    rows = list(features) + [filler] * max(0, shards.rows - len(features))
    longest = max(len(f["input_ids"]) for f in rows)
    width = round_up(max(longest, shards.length or 0), math.lcm(multiple or 1, shards.sp))
    out = collate(rows, pad_token_id, width)  # round_up(longest, width) = width
    for i, f in enumerate(rows):
        if f.get("filler"):
            out["attention_mask"][i] = 0
    n, width = out["input_ids"].shape
    out["position_ids"] = torch.arange(width, dtype=torch.long).repeat(n, 1)
    if not shards.mask:
        out[REAL_TOKENS_KEY] = out.pop("attention_mask").sum(-1)
    return out


def count_real_tokens(batch: dict, features: list[dict]) -> dict:
    if "attention_mask" in batch:  # unpacked (eval) batches: the mask already tells padding apart
        return batch
    batch[REAL_TOKENS_KEY] = torch.tensor([len(f["input_ids"]) for f in features], dtype=torch.long)  # per row
    return batch

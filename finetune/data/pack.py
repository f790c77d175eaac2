"""Packing: whole examples concatenated into rows of at most max_length tokens (data.packing)."""

from __future__ import annotations

import random

from finetune.data.render import IGNORE_INDEX, Example


def pack(examples: list[Example], max_length: int, seed: int) -> list[dict]:
    """Greedily concatenate whole examples (in seeded shuffled order) into rows <= max_length.

    position_ids restart at 0 for each example; with no attention mask, transformers turns
    that into a block-diagonal causal mask, so examples in a row do not attend to each other.
    Labels are shifted inside the model (logits[t] is scored against labels[t + 1]), so the
    label at the first token of every example after the first would be predicted from the
    last token of the previous example; it is set to -100 to drop that cross-example target.
    """
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    rows: list[dict] = []
    row = _empty_packed_row()
    for i in order:
        ex = examples[i]
        if row["input_ids"] and len(row["input_ids"]) + len(ex.input_ids) > max_length:
            rows.append(row)
            row = _empty_packed_row()
        labels = list(ex.labels)
        if row["input_ids"]:
            labels[0] = IGNORE_INDEX
        row["input_ids"].extend(ex.input_ids)
        row["labels"].extend(labels)
        row["position_ids"].extend(range(len(ex.input_ids)))
    if row["input_ids"]:
        rows.append(row)
    return rows


def _empty_packed_row() -> dict:
    return {"input_ids": [], "labels": [], "position_ids": []}

"""Row lengths of the batch layouts (finetune/data/collate.py builds the batches), without torch:
the memory planner and the loss's `auto` choice bound a micro-batch with them."""

from __future__ import annotations


def round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else -(-n // multiple) * multiple


def longest_row(rows: int, length: int, data_cfg) -> int:
    """The longest row (positions) a micro-batch of `rows` examples, or packed rows, of at most `length` tokens can have
    in the configured layout, `data.pad_to_multiple_of` included, spread over the rows: padded and packed rows are each
    rounded up; the padding-free batch is one row of every example, rounded up once (ceil(round_up(rows x length) /
    rows), so rows x this bounds it). For the planner's sequence length and the loss's `auto` choice."""
    multiple = getattr(data_cfg, "pad_to_multiple_of", None)
    if getattr(data_cfg, "padding_free", False):
        return -(-round_up(rows * length, multiple) // rows)
    return round_up(length, multiple)

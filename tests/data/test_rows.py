"""The longest row a micro-batch can have (finetune/data/rows.py), against the batches the real
collators build (finetune/data/collate.py), and what the planner and the loss choice take from it:
with `data.pad_to_multiple_of` a batch can be longer than `data.max_length`, which the old bound
(micro-batch x max_length) missed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from finetune.config.validate import build_config
from finetune.data import collate
from finetune.data.rows import longest_row
from finetune.planning.model_source import read_config
from finetune.planning.prediction import predicted_memory, workload_from_config
from finetune.planning.shapes import shape_of

MODEL = SimpleNamespace(attn_implementation="sdpa")


def _data(layout: str, multiple: int | None):
    return SimpleNamespace(
        padding_free=layout == "padding_free", packing=layout == "packed", pad_to_multiple_of=multiple
    )


def _worst_batch(layout: str, rows: int, length: int) -> list[dict]:
    """`rows` examples (or packed rows) of `length` tokens each: the most a micro-batch can hold."""
    ids = list(range(1, length + 1))
    row = {"input_ids": ids, "labels": ids}
    if layout == "packed":
        row = {**row, "position_ids": list(range(length))}
    return [dict(row) for _ in range(rows)]


@pytest.mark.parametrize("layout", ["padded", "packed", "padding_free"])
@pytest.mark.parametrize("multiple", [None, 64, 100])
@pytest.mark.parametrize("rows,length", [(1, 37), (3, 37), (4, 128), (3, 1000)])
def test_the_bound_is_what_the_collator_builds(layout, multiple, rows, length):
    data = _data(layout, multiple)
    batch = collate.make_collator(data, MODEL, 0)(_worst_batch(layout, rows, length))
    positions = batch["input_ids"].numel()
    bound = rows * longest_row(rows, length, data)
    if layout == "padding_free":  # one row, rounded up once; the bound spreads it over the rows
        assert positions <= bound < positions + rows
    else:
        assert positions == bound
    # control: with bucketing and a length that is not a multiple, the old bound is short
    if multiple and length % multiple and (layout != "padding_free" or rows * length % multiple):
        assert rows * length < positions


def _cfg(**data):
    return build_config(
        {"data": {"path": "x.jsonl", "max_length": 1000, **data}, "training": {"per_device_train_batch_size": 4}}
    )


def test_the_planner_plans_the_bucketed_length():
    shape = shape_of(read_config("Llama-3.2-1B"))
    plain = workload_from_config(_cfg(), precision="bf16-mixed", loss_impl="standard")
    bucketed = workload_from_config(_cfg(pad_to_multiple_of=1024), precision="bf16-mixed", loss_impl="standard")
    assert (plain.seq_len, bucketed.seq_len) == (1000, 1024)

    def allocated(w):
        return predicted_memory(shape, w, "single", 1, sm=9, seq_len_source="test")["device"]["allocated_gib"]

    assert allocated(bucketed) > allocated(plain)  # the logits and activations of 24 more positions per row
    flat = workload_from_config(
        _cfg(pad_to_multiple_of=1024, padding_free=True), precision="bf16-mixed", loss_impl="standard"
    )
    assert flat.micro_batch * flat.seq_len >= 4096 > 4 * 1000  # one row of 4,000 tokens rounded to 4,096

"""Issue 47 item 3: `training.per_device_train_batch_size: auto` and `training.gradient_checkpointing: auto` as the
planner resolves them (finetune/planning/search.py resolve_levers) for a device of a given size: the largest
micro-batch that fits, the sequences per device per step kept by accumulation, checkpointing only where nothing
fits without it. The device sizes are set between two options' predictions, each computed here by the planner's
breakdown on its own (the launched CPU run: tests/planning/test_plan.py)."""

from __future__ import annotations

import pytest

from finetune.config.recipe import load_recipe
from finetune.errors import ConfigError
from finetune.planning import model_source, prediction, search
from finetune.planning.memory import fits_total
from finetune.planning.shapes import Workload, shape_of

SHAPE = shape_of(model_source.read_config("Llama-3.1-8B"))
W = Workload(method="lora", micro_batch=8, seq_len=2048, loss_impl="auto")


def need(micro_batch: int, checkpointing: bool) -> float:
    """Device total (reserved + CUDA context) of one option under DDP on 2 GPUs, 8 sequences per step (accumulation
    keeps gradients of the micro-steps: it counts too)."""
    split = {"micro_batch": micro_batch, "grad_accum": 8 // micro_batch, "gradient_checkpointing": checkpointing}
    w = Workload(**{**W.__dict__, **split})
    return fits_total(prediction.breakdown(SHAPE, w, "ddp", 2, sm=9)["peak"]["reserved"])


def resolve(limit: float, *, micro_batch: bool = True, checkpointing: bool = True) -> dict:
    return search.resolve_levers(
        SHAPE, W, "ddp", 2, limit_bytes=limit, sm=9, sequences=8, micro_batch=micro_batch, checkpointing=checkpointing
    )


def test_the_largest_micro_batch_that_fits_and_the_accumulation_that_keeps_the_sequences():
    limit = (need(2, False) + need(4, False)) / 2 / search.MARGIN  # 2 fits in 90% of it, 4 does not
    chosen = resolve(limit, checkpointing=False)["chosen"]
    assert (chosen["micro_batch"], chosen["grad_accum"], chosen["gradient_checkpointing"]) == (2, 4, False)
    assert chosen["predicted_gib"] == round(need(2, False) / 2**30, 4)


def test_checkpointing_only_where_nothing_fits_without_it():
    """Without checkpointing even one sequence of 2,048 tokens is over this device; with it, 8 at once fit: the
    answer is checkpointing at the largest micro-batch (the recompute costs the same whatever the split)."""
    limit = (need(1, False) + need(8, True)) / 2 / search.MARGIN
    assert need(8, True) < need(1, False)  # the premise, from the breakdown
    chosen = resolve(limit)["chosen"]
    assert (chosen["micro_batch"], chosen["gradient_checkpointing"]) == (8, True)
    roomy = resolve(need(8, False) / search.MARGIN * 1.01)["chosen"]
    assert (roomy["micro_batch"], roomy["gradient_checkpointing"]) == (8, False)  # control: off when it fits
    assert resolve(need(1, True) / search.MARGIN * 0.99)["chosen"] is None  # nothing fits: None, said by the run


def test_auto_is_a_value_of_two_training_fields_only():
    cfg, _ = load_recipe(
        "demo", ["--training.per_device_train_batch_size=auto", "--training.gradient_checkpointing=auto"]
    )
    assert search.sequences_per_step(cfg) == (8, "auto: 8 (the default micro-batch) x accumulation 1")
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps: expected an integer"):
        load_recipe("demo", ["--training.gradient_accumulation_steps=auto"])
    with pytest.raises(ConfigError, match=r"per_device_train_batch_size: expected an integer.*\(or auto"):
        load_recipe("demo", ["--training.per_device_train_batch_size=many"])

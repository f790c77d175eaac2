"""Batch arithmetic shared by training, reports and the planner (definitions: shared/DESIGN.md).

effective batch (sequences per optimizer step) = per-device batch x accumulation x data-parallel size
applied LR = base x (effective / reference)        for lr_scaling: linear
           = base x sqrt(effective / reference)    for lr_scaling: sqrt
"""

from __future__ import annotations

import math


def effective_batch(per_device: int, grad_accum: int, data_parallel_size: int) -> int:
    return per_device * grad_accum * data_parallel_size


def lr_scaling(base_lr: float, rule: str, effective: int, reference: int | None) -> dict:
    """The run record's `lr` section. reference None (allowed only with rule none: the config
    refuses linear/sqrt without one, finetune/config/validate.py) means the run's own effective batch."""
    if reference is None and rule != "none":
        raise ValueError(f"lr_scaling {rule!r} needs a reference batch (training.lr_reference_batch_size)")
    reference = reference or effective
    ratio = effective / reference
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]
    return {"base": base_lr, "rule": rule, "reference_batch": reference, "factor": factor,
            "applied": base_lr * factor}

"""Batch arithmetic shared by training, preflight, resume, sweeps and reports; run.json's `batch` and
`lr` sections (docs/run_record.md).

effective batch (sequences per optimizer step) = per-device batch x accumulation x data-parallel size
applied LR = base x (effective / reference)        for lr_scaling: linear
           = base x sqrt(effective / reference)    for lr_scaling: sqrt
"""

from __future__ import annotations

import math


def effective_batch(per_device: int, grad_accum: int, data_parallel_size: int) -> int:
    return per_device * grad_accum * data_parallel_size


def section(per_device: int, grad_accum: int, data_parallel_size: int) -> dict:
    """The run record's `batch` section; the tokens per step are measured (filled at the end of the run)."""
    return {
        "per_device": per_device,
        "grad_accum": grad_accum,
        "data_parallel_size": data_parallel_size,
        "effective": effective_batch(per_device, grad_accum, data_parallel_size),
        "input_tokens_per_step": None,
        "trained_tokens_per_step": None,
    }


def lr_scaling(base_lr: float, rule: str, effective: int, reference: int | None) -> dict:
    """The run record's `lr` section. reference None (allowed only with rule none: the config
    refuses linear/sqrt without one, finetune/config/validate.py) means the run's own effective batch."""
    if reference is None and rule != "none":
        raise ValueError(f"lr_scaling {rule!r} needs a reference batch (training.lr_reference_batch_size)")
    reference = reference or effective
    ratio = effective / reference
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]
    return {"base": base_lr, "rule": rule, "reference_batch": reference, "factor": factor, "applied": base_lr * factor}

"""The allowed range of every numeric setting, checked when the configuration is validated.

A value out of range is refused naming the dotted key, the range and the value
(`training.max_steps: must be >= 1, or -1 (unset: ...), got -5`), instead of what Trainer or the
data pipeline would do with it silently: a negative max_steps trains an epoch, a negative
max_grad_norm turns clipping off, a batch of 0 or a learning rate of 0 train nothing. A null
value is checked by the type check (finetune/config/validate.py), not here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    ok: Callable[[float], bool]
    text: str  # what is allowed, after "must be"


def at_least(low: int, unit: str = "") -> Range:
    return Range(lambda v: v >= low, f">= {low}{unit}")


def positive() -> Range:
    return Range(lambda v: v > 0, "> 0")


def fraction(*, closed: bool = False) -> Range:
    return Range((lambda v: 0 <= v <= 1) if closed else (lambda v: 0 <= v < 1), "in [0, 1]" if closed else "in [0, 1)")


def steps_or_ratio(*, zero: bool) -> Range:
    """Trainer's step counts that may be a ratio of the total steps (TrainingArguments 5.x)."""
    low = "0" if zero else "1"
    return Range(
        lambda v: (0 <= v < 1 if zero else 0 < v < 1) or (v >= 1 and float(v).is_integer()),
        f"a whole number of steps >= {low}, or a ratio of the total steps in {'[0' if zero else '(0'}, 1)",
    )


# dotted key -> allowed range; `training.*` keys not of our own are TrainingArguments fields
RANGES: dict[str, Range] = {
    "data.max_length": at_least(8, " tokens"),
    "data.eval_fraction": fraction(),
    "data.max_samples": at_least(1),
    "data.demo_train_size": at_least(1),
    "data.demo_heldout_size": at_least(1),
    "data.pad_to_multiple_of": at_least(1, " tokens"),
    "data.max_empty_target_share": fraction(closed=True),
    "method.lora_r": at_least(1),
    "method.lora_alpha": positive(),  # 0 scales every adapter's output to nothing: the run trains nothing
    "method.lora_dropout": fraction(),
    "eval.samples": at_least(1),
    "eval.max_new_tokens": at_least(1),
    "eval.batch_size": at_least(1),
    "training.lr_reference_batch_size": at_least(1),
    "training.throughput_warmup_steps": at_least(0),
    "training.max_nonfinite_skips": at_least(0),
    "training.loss_chunk_tokens": at_least(1),
    "training.collapse_windows": at_least(1),
    "training.stop_grace": at_least(1, " s"),
    "training.finish_timeout": at_least(1, " s"),
    # TrainingArguments
    "training.max_steps": Range(lambda v: v == -1 or v >= 1, ">= 1, or -1 (unset: training.num_train_epochs decides)"),
    "training.num_train_epochs": positive(),
    "training.learning_rate": positive(),
    "training.warmup_steps": steps_or_ratio(zero=True),
    "training.weight_decay": at_least(0),
    "training.adam_beta1": fraction(),
    "training.adam_beta2": fraction(),
    "training.adam_epsilon": positive(),
    "training.max_grad_norm": Range(lambda v: v >= 0, ">= 0 (0 turns gradient clipping off)"),
    "training.label_smoothing_factor": fraction(),
    "training.per_device_train_batch_size": at_least(1),
    "training.per_device_eval_batch_size": at_least(1),
    "training.gradient_accumulation_steps": at_least(1),
    "training.eval_accumulation_steps": at_least(1),
    "training.logging_steps": steps_or_ratio(zero=False),
    "training.save_steps": steps_or_ratio(zero=False),
    "training.eval_steps": steps_or_ratio(zero=False),
    "training.save_total_limit": at_least(1),
    "training.seed": Range(lambda v: 0 <= v < 2**32, "in [0, 2**32)"),  # numpy's seed range (set_seed)
    "training.data_seed": Range(lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
    "training.dataloader_num_workers": at_least(0),
    "training.ddp_timeout": at_least(1, " s"),
}


def problems(cfg) -> list[str]:
    """Every numeric setting of `cfg` outside its range, as `<dotted key>: must be <range>, got <value>`."""
    out = []
    for dotted, rule in RANGES.items():
        section, key = dotted.split(".")
        body = getattr(cfg, section)
        value = body.args.get(key) if section == "training" and key in body.args else getattr(body, key, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # unset (null) or of the wrong type: the type check says so
        if value != value or not rule.ok(value):  # NaN is in no range
            out.append(f"{dotted}: must be {rule.text}, got {value}")
    return out

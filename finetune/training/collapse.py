"""A collapsed model, found from the values Trainer logs (docs/faults.md "A collapsed model").

A learning rate far too high can drive a model to a fixed point where every gradient is exactly 0:
nothing trains any more, and the loss typically sits at ln(vocabulary size), a uniform prediction
(measured: the tiny test model at learning rate 1000, full fine-tuning, from step 7 on). Such a run
used to be reported `completed`. A gradient norm of exactly 0 does not happen in a training run that
learns (it is a sum of squares of millions of floats), so `training.collapse_windows` consecutive log
windows whose logged gradient norm is exactly 0 are a collapse. Then, by `training.on_collapse`:
`stop` (the default) ends Trainer's loop after that log (`stopped()` is then raised by the run,
before any export), `flag` trains to the end and exports (`error()`); either way the run ends
`failed` with exit 3 and the error says what was seen.

Only logged values are read (Trainer gathered them for its log already): no host sync per step.
Every rank logs the same values, so every rank decides the same without a collective.
"""

from __future__ import annotations

import logging
import math

from transformers import TrainerCallback

from finetune.errors import EXIT_NONFINITE

log = logging.getLogger("finetune")


class Diverged(RuntimeError):
    """Training stopped because it went wrong (exit 3): a non-finite value, or a collapse."""

    exit_code = EXIT_NONFINITE

    def __init__(self, message: str, skipped: list[dict]):
        super().__init__(message)
        self.skipped = skipped  # steps skipped before this one (training.on_nonfinite: skip)


class CollapseError(Diverged):
    pass


class CollapseWatch(TrainerCallback):
    def __init__(self, *, policy: str, windows: int, vocab_size: int | None):
        self.policy, self.windows, self.vocab_size = policy, windows, vocab_size
        self.zero_windows = 0  # consecutive log windows with a gradient norm of exactly 0
        self.found: str | None = None  # what was seen, once the collapse is established

    def on_log(self, args, state, control, logs=None, **kwargs):
        norm = (logs or {}).get("grad_norm")
        if norm is None or "loss" not in logs:
            return
        self.zero_windows = self.zero_windows + 1 if norm == 0 else 0
        if self.zero_windows < self.windows or self.found is not None:
            return
        self.found = self._describe(state.global_step, logs["loss"], args.logging_steps)
        if self.policy == "stop":
            control.should_training_stop = True  # this log window is recorded; the loop ends after it
            log.error("%s; stopping (training.on_collapse: stop)", self.found)
        else:
            log.warning("%s; training goes on (training.on_collapse: flag): the run will end failed", self.found)

    def stopped(self, skipped: list[dict]) -> CollapseError | None:
        """The error a run stopped by the collapse ends with, once Trainer's loop returned; else None."""
        if self.found is None or self.policy != "stop":
            return None
        return CollapseError(f"{self.found}; stopped (training.on_collapse: stop)", skipped)

    def error(self, skipped: list[dict]) -> CollapseError | None:
        """The error a flagged run ends with once it trained to the end and exported; else None."""
        if self.found is None or self.policy != "flag":
            return None
        return CollapseError(f"{self.found}; trained to the end and exported (training.on_collapse: flag)", skipped)

    def _describe(self, step: int, loss: float, logging_steps: float) -> str:
        uniform = math.log(self.vocab_size) if self.vocab_size else None
        at_uniform = (
            f" = ln({self.vocab_size}), a uniform prediction"
            if uniform and abs(loss - uniform) <= 1e-3 * uniform
            else f" (ln of the vocabulary: {uniform:.4f})"
            if uniform
            else ""
        )
        return (
            f"the model collapsed: gradient norm exactly 0 in {self.zero_windows} consecutive log windows up to step "
            f"{step} (logging_steps {logging_steps:g}), loss {loss:.4f}{at_uniform}: nothing trains any more. "
            f"Lower training.learning_rate (or raise warmup_steps) and start again from the last checkpoint before it"
        )

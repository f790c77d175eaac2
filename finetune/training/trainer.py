"""FinetuneTrainer: transformers.Trainer that measures each step and keeps the run record current.

The measuring is the meter's (finetune/telemetry/meter.py): tokens counted on each rank from the
batches it really trained on and summed over ranks, optimizer-step times, memory peaks per rank
maxed over ranks at each log, then reset. The trainer only feeds it: each micro-batch in
`training_step`, the step clock from a callback, and the log window in `log()` itself, before
Trainer hands the dict to its callbacks, so every `report_to` integration receives the extra keys
(a callback of ours would run after the integrations and be too late).
"""

from __future__ import annotations

from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ProgressCallback

from finetune.telemetry.meter import Meter
from finetune.training import rng, sample_trace
from finetune.training.progress import CompactProgress


class _StepClock(TrainerCallback):
    """Drives the meter's clock: training begins, each optimizer step begins and ends."""

    def __init__(self, trainer: "FinetuneTrainer"):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.meter.start_training(self.trainer.accelerator)

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.meter.step_begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.meter.step_end()


class FinetuneTrainer(Trainer):
    def __init__(self, *args, record=None, flops_per_token=None, peak_flops=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.record = record  # finetune.telemetry.record.RunRecord on rank 0, None elsewhere
        if self.pop_callback(ProgressCallback) is not None:
            self.add_callback(CompactProgress)
        self.meter = Meter(flops_per_token=flops_per_token, peak_flops=peak_flops)
        self.add_callback(_StepClock(self))
        self.resumed_world_size: int | None = None  # world size that wrote the checkpoint resumed from

    def training_step(self, model, inputs, num_items_in_batch=None):
        sample_trace.record(self, inputs)  # FINETUNE_SAMPLE_TRACE only (tests)
        self.meter.count_batch(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.meter.memory.sample()
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        training_log = "loss" in logs and "train_runtime" not in logs
        step_entry = self.meter.log_window(logs, self.accelerator, self.state.global_step) if training_log else None
        super().log(logs, start_time)
        if self.record is not None and step_entry is not None:
            self.record.add_step(step_entry)
            self.record.update("summary", steps=self.state.global_step)
            self.record.write()

    def _load_rng_state(self, checkpoint):
        """Trainer's own restore at the same world size; across a change, the explicit rule of
        finetune/training/rng.py (Trainer would look for files of its own layout and say nothing)."""
        old = self.resumed_world_size
        if checkpoint is None or old is None or old == self.args.world_size:
            return super()._load_rng_state(checkpoint)
        rng.restore(checkpoint, rank=self.args.process_index, old_world_size=old)

    def final_measurements(self) -> dict:
        """Totals, per-step series summed over ranks, and memory peaks (per rank, max). Every rank
        must call this (it gathers)."""
        return self.meter.final(self.accelerator)

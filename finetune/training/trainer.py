"""FinetuneTrainer: transformers.Trainer that measures each step and keeps the run record current.

The measuring is the meter's (finetune/telemetry/meter.py): tokens counted on each rank from the
batches it really trained on and summed over ranks, optimizer-step times, memory peaks per rank
maxed over ranks at each log, then reset. The trainer only feeds it: each micro-batch in
`training_step`, the step clock from a callback, and the log window in `log()` itself, before
Trainer hands the dict to its callbacks, so every `report_to` integration receives the extra keys
(a callback of ours would run after the integrations and be too late).
"""

from __future__ import annotations

import time

from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ProgressCallback

from finetune.data.collate import REAL_TOKENS_KEY
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
    def __init__(self, *args, record=None, model_flops=None, peak_flops=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.record = record  # finetune.telemetry.record.RunRecord on rank 0, None elsewhere
        if self.pop_callback(ProgressCallback) is not None:
            self.add_callback(CompactProgress)
        self.meter = Meter(model_flops=model_flops, peak_flops=peak_flops)
        self.add_callback(_StepClock(self))
        self.resumed_world_size: int | None = None  # world size that wrote the checkpoint resumed from

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Trainer fetches every batch of an optimizer step here, before on_step_begin (transformers
        5.23 Trainer._run_epoch): outside the step clock, so its time is the data loading of the
        step, measured on its own (the meter's per-window data_loading_s and share of wall time)."""
        t0 = time.perf_counter()
        out = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.meter.data_loading(time.perf_counter() - t0)
        return out

    def training_step(self, model, inputs, num_items_in_batch=None):
        sample_trace.record(self, inputs)  # FINETUNE_SAMPLE_TRACE only (tests)
        self.meter.count_batch(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.meter.memory.sample()
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs.pop(REAL_TOKENS_KEY, None)  # a count for the meter (bucketed batches), not a model input
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        training_log = "loss" in logs and "train_runtime" not in logs
        step_entry = self.meter.log_window(logs, self.accelerator, self.state.global_step) if training_log else None
        super().log(logs, start_time)
        if self.record is not None and step_entry is not None:
            self.record.add_step(step_entry)
            self.record.update("summary", steps=self.state.global_step)
            self.record.write()

    def record_tail(self) -> None:
        """The steps after the last log as one more `steps` entry, so steps[] covers every step of
        the launch (a resumed run totals its earlier segments from it). Every rank (it gathers)."""
        tail = self.meter.tail_window(self.accelerator, self.state.global_step)
        if self.record is not None and tail is not None:
            self.record.add_step(tail)
            self.record.write()

    def _load_rng_state(self, checkpoint):
        """Trainer's own restore at the same world size; across a change, the explicit rule of
        finetune/training/rng.py (Trainer would look for files of its own layout and say nothing)."""
        old = self.resumed_world_size
        if checkpoint is None or old is None or old == self.args.world_size:
            return super()._load_rng_state(checkpoint)
        rng.restore(checkpoint, rank=self.args.process_index, old_world_size=old)

    def final_measurements(self) -> dict:
        """record_tail(), then the per-step series summed over ranks and memory peaks (per rank,
        max). Every rank must call this (it gathers)."""
        self.record_tail()
        return self.meter.final(self.accelerator)

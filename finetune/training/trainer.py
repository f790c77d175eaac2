"""FinetuneTrainer: transformers.Trainer that measures each step and keeps the run record current.

Tokens are counted on each rank from the batches it really trained on (input tokens:
attention positions that are not padding; trained tokens: labels != -100) and summed over
ranks. Step times are taken per optimizer step (a clock callback; CUDA synchronised). Memory
peaks are read per rank and maxed over ranks at each log, then reset (finetune/telemetry/meter.py).
The extra keys are added in `log()` itself, before Trainer hands the dict to its callbacks,
so every `report_to` integration receives them (a callback of ours would run after the
integrations and be too late).
"""

from __future__ import annotations

import resource
import time

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ProgressCallback

from finetune.data.collate import REAL_TOKENS_KEY
from finetune.telemetry import formulas, meter
from finetune.training.progress import CompactProgress
from finetune.units import GIB


class _StepClock(TrainerCallback):
    """Wall time of each optimizer step, with the tokens that step trained on this rank."""

    def __init__(self, owner: "FinetuneTrainer"):
        self.owner = owner
        self.t0 = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.owner._on_train_begin()

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # kernels are asynchronous: time the work, not its launch
        self.owner._end_step(time.perf_counter() - self.t0)


class FinetuneTrainer(Trainer):
    def __init__(self, *args, record=None, flops_per_token=None, peak_flops=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.record = record  # finetune.telemetry.record.RunRecord on rank 0, None elsewhere
        # MFU at each log: model FLOPs per input token (a function of the mean sequence length)
        # and the device's peak dense FLOP/s; None when the device is not in the table.
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        if self.pop_callback(ProgressCallback) is not None:
            self.add_callback(CompactProgress)
        self.memory = meter.MemoryTracker()
        self._micro: torch.Tensor | None = None  # input tokens, trained tokens, samples: current step
        self._steps: list[tuple[float, int, int, int]] = []  # per optimizer step: seconds, tokens (this rank)
        self._logged_steps = 0
        self._train_peak: dict | None = None
        self.loading_memory: list[dict] | None = None
        self.add_callback(_StepClock(self))

    # --- measurement -----------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        labels = inputs.get("labels")
        mask = inputs.get("attention_mask")
        ids = inputs["input_ids"]
        real = inputs.pop(REAL_TOKENS_KEY, None)  # packed rows: padding has no mask to tell it apart
        # Counted where the batch lives and read once per optimizer step (after the clock's
        # synchronize): int() here would stall the GPU queue at every micro-batch.
        # No mask and no stated count: a padding-free batch, where every position is a real token.
        n_input = mask.sum() if mask is not None else real.to(ids.device) if real is not None else \
            torch.tensor(ids.numel(), device=ids.device)
        n_trained = (labels != -100).sum() if labels is not None else n_input
        counts = torch.stack([n_input.long(), n_trained.long(), torch.tensor(ids.shape[0], device=ids.device)])
        self._micro = counts if self._micro is None else self._micro + counts
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.memory.sample()
        return loss

    def _on_train_begin(self) -> None:
        # Peaks so far are model loading (and engine set-up); training peaks start from here.
        snap = self.memory.snapshot()
        snap["host_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 4)
        self.loading_memory = self._gather(snap)
        self.memory.reset()

    def _end_step(self, seconds: float) -> None:
        n_input, n_trained, n_samples = self._micro.tolist() if self._micro is not None else (0, 0, 0)
        self._steps.append((seconds, n_input, n_trained, n_samples))
        self._micro = None

    def _sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes == 1:
            return t.clone()
        return self.accelerator.reduce(t.to(self.accelerator.device), reduction="sum").cpu()

    def _gather(self, snapshot: dict) -> list[dict]:
        snapshot = {"rank": self.accelerator.process_index, **snapshot}
        if self.accelerator.num_processes == 1:
            return [snapshot]
        from accelerate.utils import gather_object

        return sorted(gather_object([snapshot]), key=lambda r: r["rank"])

    def _memory_since_last_log(self) -> list[dict]:
        per_rank = self._gather(self.memory.snapshot())
        mine = per_rank[self.accelerator.process_index]
        if self._train_peak is None:
            self._train_peak = dict(mine)
        else:
            for k, v in mine.items():
                if v is not None and k != "rank":
                    self._train_peak[k] = max(self._train_peak[k] or 0, v)
        self.memory.reset()
        return per_rank

    # --- logging ---------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        training_log = "loss" in logs and "train_runtime" not in logs
        step_entry = None
        if training_log:
            window = self._steps[self._logged_steps:]
            self._logged_steps = len(self._steps)
            counts = self._sum_over_ranks(torch.tensor([[s[1], s[2], s[3]] for s in window] or [[0, 0, 0]]).sum(0))
            seconds = sum(s[0] for s in window)
            peaks = formulas.max_over_ranks(self._memory_since_last_log())
            logs["tokens/input"] = int(counts[0])
            logs["tokens/trained"] = int(counts[1])
            logs["perf/step_s"] = round(seconds / max(len(window), 1), 4)
            if seconds > 0:
                logs["perf/trained_tokens_per_s"] = round(int(counts[1]) / seconds, 2)
                logs["perf/trained_tokens_per_s_per_device"] = round(int(counts[1]) / seconds
                                                                     / self.accelerator.num_processes, 2)
                logs["perf/input_tokens_per_s"] = round(int(counts[0]) / seconds, 2)
                logs["perf/samples_per_s"] = round(int(counts[2]) / seconds, 3)
                if self.flops_per_token and self.peak_flops and int(counts[2]):
                    flops = self.flops_per_token(int(counts[0]) / int(counts[2]))
                    logs["perf/mfu"] = round(int(counts[0]) / seconds * flops
                                             / (self.peak_flops * self.accelerator.num_processes), 4)
            for key, value in peaks.items():
                if value is not None:
                    logs[f"memory/max_{key}"] = value
            step_entry = {"step": self.state.global_step, "loss": logs.get("loss"), "lr": logs.get("learning_rate"),
                          "grad_norm": logs.get("grad_norm"), "trained_tokens": logs["tokens/trained"],
                          "input_tokens": logs["tokens/input"], "step_s": logs["perf/step_s"],
                          "host_peak_rss_gib": peaks.get("host_peak_rss_gib"),
                          "device_peak_allocated_gib": peaks.get("device_peak_allocated_gib")}
        super().log(logs, start_time)
        if self.record is not None and step_entry is not None:
            self.record.add_step(step_entry)
            self.record.update("summary", steps=self.state.global_step)
            self.record.write()

    # --- end of training -------------------------------------------------------------------

    def final_measurements(self) -> dict:
        """Totals, per-step series summed over ranks, and memory peaks (per rank, max). Every rank
        must call this (it gathers)."""
        per_rank_last = self._memory_since_last_log()  # folds the tail after the last log into the peak
        del per_rank_last
        train_peaks = self._gather({k: v for k, v in self._train_peak.items() if k != "rank"})
        series = torch.tensor([[s[1], s[2], s[3]] for s in self._steps] or [[0, 0, 0]], dtype=torch.long)
        series = self._sum_over_ranks(series)
        return {
            "step_s": [s[0] for s in self._steps],
            "input_tokens": series[:, 0].tolist() if self._steps else [],
            "trained_tokens": series[:, 1].tolist() if self._steps else [],
            "samples": series[:, 2].tolist() if self._steps else [],
            "memory": {"per_rank": train_peaks, "max": formulas.max_over_ranks(train_peaks),
                       "loading": {"per_rank": self.loading_memory,
                                   "max": formulas.max_over_ranks(self.loading_memory)}},
        }

"""The meter: what one training process counts and clocks, in one object (the model is
torchtitan's MetricsProcessor: it owns its counters and resets them after each log).

* Token counters: input tokens (attention positions that are not padding; every position of a
  padding-free batch, which has no mask; the count a packed batch states under REAL_TOKENS_KEY),
  trained tokens (labels != -100) and rows, per micro-batch on this rank, per optimizer step.
* Step clock: wall time of each optimizer step, CUDA-synchronised at its end (kernels are
  asynchronous: time the work, not its launch).
* Memory: accelerator peaks (torch.cuda.memory_stats) and host RSS per rank; reset when
  training begins so model loading and training can be told apart, and again after each log.
* The per-log window -> the metrics dict (namespaced keys with units: `perf/trained_tokens_per_s`,
  `memory/max_host_peak_rss_gib`) and a `steps` entry of run.json; the end of training -> the
  figures of run.json's `memory`, `throughput` and `batch` (finetune/telemetry/record.py).

Used by FinetuneTrainer (finetune/training/trainer.py) and by both sides of `finetune bench`
(finetune/bench/worker.py). Formulas (throughput, MFU, FLOPs): finetune/telemetry/formulas.py.
Collectives take an Accelerator (num_processes, process_index, device, reduce); every rank
must call the methods that gather (log_window, final, start_training).
"""

from __future__ import annotations

import resource
import time

import psutil
import torch

from finetune.data.collate import REAL_TOKENS_KEY
from finetune.telemetry import formulas
from finetune.units import GIB


def host_rss() -> int:
    return psutil.Process().memory_info().rss


class MemoryTracker:
    """Peaks on this rank since the last reset: accelerator (torch.cuda.memory_stats) and host RSS.
    Host RSS is sampled (at every micro-step) because the OS peak cannot be reset."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.host_peak = host_rss()

    def sample(self) -> None:
        self.host_peak = max(self.host_peak, host_rss())

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.host_peak = host_rss()

    def snapshot(self) -> dict:
        self.sample()
        out = {"device_peak_allocated_gib": None, "device_peak_reserved_gib": None,
               "device_peak_active_gib": None, "host_peak_rss_gib": round(self.host_peak / GIB, 4),
               "alloc_retries": None, "ooms": None}
        if self.cuda:
            s = torch.cuda.memory_stats()
            out.update(device_peak_allocated_gib=round(s.get("allocated_bytes.all.peak", 0) / GIB, 4),
                       device_peak_reserved_gib=round(s.get("reserved_bytes.all.peak", 0) / GIB, 4),
                       device_peak_active_gib=round(s.get("active_bytes.all.peak", 0) / GIB, 4),
                       alloc_retries=s.get("num_alloc_retries", 0), ooms=s.get("num_ooms", 0))
        return out


def token_counts(input_ids: torch.Tensor, attention_mask, labels, real) -> tuple[torch.Tensor, torch.Tensor]:
    """(input tokens, trained tokens) of one batch, as tensors on the batch's device (read them
    once per step: int() here would stall the GPU queue at every micro-batch). `real` is the
    count a packed batch states (REAL_TOKENS_KEY): it has no mask to tell its padding apart.
    No mask and no stated count: a padding-free batch, where every position is a real token."""
    n_input = attention_mask.sum() if attention_mask is not None else real.to(input_ids.device) \
        if real is not None else torch.tensor(input_ids.numel(), device=input_ids.device)
    n_trained = (labels != -100).sum() if labels is not None else n_input
    return n_input, n_trained


def mfu_inputs(model_config, method: str) -> dict:
    """What the meter needs for MFU at each log: FLOPs per token for a mean sequence length, and
    the device's peak (None off the table, so no MFU is shown rather than a guess)."""
    peak = formulas.device_peak()
    return {"flops_per_token": lambda seq_len: formulas.flops_per_token(model_config, method, seq_len)[0],
            "peak_flops": peak[1] if peak else None}


class Meter:
    """Counters, step clock and memory peaks of one training process, and their per-log window."""

    def __init__(self, *, flops_per_token=None, peak_flops=None):
        # MFU at each log: model FLOPs per input token (a function of the mean sequence length)
        # and the device's peak dense FLOP/s; None when the device is not in the table.
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.memory = MemoryTracker()
        self.steps: list[tuple[float, int, int, int]] = []  # per optimizer step: seconds, input, trained, rows
        self.loading_memory: list[dict] | None = None
        self._micro: torch.Tensor | None = None  # input tokens, trained tokens, rows: the step in progress
        self._logged_steps = 0
        self._train_peak: dict | None = None
        self._t0: float | None = None

    # --- counting and the clock ------------------------------------------------------------

    def count_batch(self, inputs: dict) -> None:
        """Count one micro-batch the trainer is about to train on (takes REAL_TOKENS_KEY out of it:
        the model must not see it)."""
        ids = inputs["input_ids"]
        n_input, n_trained = token_counts(ids, inputs.get("attention_mask"), inputs.get("labels"),
                                          inputs.pop(REAL_TOKENS_KEY, None))
        counts = torch.stack([n_input.long(), n_trained.long(), torch.tensor(ids.shape[0], device=ids.device)])
        self._micro = counts if self._micro is None else self._micro + counts

    def step_begin(self) -> None:
        self._t0 = time.perf_counter()

    def step_end(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # kernels are asynchronous: time the work, not its launch
        self.record_step(time.perf_counter() - self._t0)

    def record_step(self, seconds: float) -> None:
        """One optimizer step done: its time and the counts of its micro-batches on this rank."""
        n_input, n_trained, n_rows = self._micro.tolist() if self._micro is not None else (0, 0, 0)
        self.steps.append((seconds, n_input, n_trained, n_rows))
        self._micro = None

    # --- memory ----------------------------------------------------------------------------

    def start_training(self, accelerator) -> None:
        """Peaks so far are model loading (and engine set-up); training peaks start from here."""
        snap = self.memory.snapshot()
        snap["host_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 4)
        self.loading_memory = _gather(snap, accelerator)
        self.memory.reset()

    def _memory_since_last_log(self, accelerator) -> list[dict]:
        per_rank = _gather(self.memory.snapshot(), accelerator)
        mine = per_rank[accelerator.process_index]
        if self._train_peak is None:
            self._train_peak = dict(mine)
        else:
            for k, v in mine.items():
                if v is not None and k != "rank":
                    self._train_peak[k] = max(self._train_peak[k] or 0, v)
        self.memory.reset()
        return per_rank

    # --- the log window and the end ----------------------------------------------------------

    def log_window(self, logs: dict, accelerator, global_step: int) -> dict:
        """Add the window's metrics (since the previous log) to Trainer's `logs` and return the
        run.json `steps` entry; resets the window's counters and memory peaks."""
        window = self.steps[self._logged_steps:]
        self._logged_steps = len(self.steps)
        counts = _sum_over_ranks(torch.tensor([[s[1], s[2], s[3]] for s in window] or [[0, 0, 0]]).sum(0),
                                 accelerator)
        seconds = sum(s[0] for s in window)
        peaks = formulas.max_over_ranks(self._memory_since_last_log(accelerator))
        n = accelerator.num_processes
        logs["tokens/input"] = int(counts[0])
        logs["tokens/trained"] = int(counts[1])
        logs["perf/step_s"] = round(seconds / max(len(window), 1), 4)
        if seconds > 0:
            logs["perf/trained_tokens_per_s"] = round(int(counts[1]) / seconds, 2)
            logs["perf/trained_tokens_per_s_per_device"] = round(int(counts[1]) / seconds / n, 2)
            logs["perf/input_tokens_per_s"] = round(int(counts[0]) / seconds, 2)
            logs["perf/samples_per_s"] = round(int(counts[2]) / seconds, 3)
            if self.flops_per_token and self.peak_flops and int(counts[2]):
                flops = self.flops_per_token(int(counts[0]) / int(counts[2]))
                logs["perf/mfu"] = round(formulas.mfu(int(counts[0]) / seconds, flops, self.peak_flops, n), 4)
        for key, value in peaks.items():
            if value is not None:
                logs[f"memory/max_{key}"] = value
        return {"step": global_step, "loss": logs.get("loss"), "lr": logs.get("learning_rate"),
                "grad_norm": logs.get("grad_norm"), "trained_tokens": logs["tokens/trained"],
                "input_tokens": logs["tokens/input"], "step_s": logs["perf/step_s"],
                "host_peak_rss_gib": peaks.get("host_peak_rss_gib"),
                "device_peak_allocated_gib": peaks.get("device_peak_allocated_gib")}

    def final(self, accelerator) -> dict:
        """Totals, per-step series summed over ranks, and memory peaks (per rank, max)."""
        self._memory_since_last_log(accelerator)  # folds the tail after the last log into the peak
        train_peaks = _gather({k: v for k, v in self._train_peak.items() if k != "rank"}, accelerator)
        series = torch.tensor([[s[1], s[2], s[3]] for s in self.steps] or [[0, 0, 0]], dtype=torch.long)
        series = _sum_over_ranks(series, accelerator)
        return {
            "step_s": [s[0] for s in self.steps],
            "input_tokens": series[:, 0].tolist() if self.steps else [],
            "trained_tokens": series[:, 1].tolist() if self.steps else [],
            "samples": series[:, 2].tolist() if self.steps else [],
            "memory": {"per_rank": train_peaks, "max": formulas.max_over_ranks(train_peaks),
                       "loading": {"per_rank": self.loading_memory,
                                   "max": formulas.max_over_ranks(self.loading_memory)}},
        }


def run_figures(measured: dict, *, hardware: dict, model_config, method: str, world_size: int,
                warmup: int) -> dict:
    """run.json's `memory` and `throughput` sections and the `batch` tokens per step, from
    Meter.final(). MFU against the peak of the recorded device (CUDA only)."""
    steps = len(measured["step_s"])
    seq_len = sum(measured["input_tokens"]) / max(sum(measured["samples"]), 1)
    flops, convention = formulas.flops_per_token(model_config, method, seq_len)
    peak = formulas.peak_flops(hardware["device_name"]) if hardware["device_type"] == "cuda" else None
    tp = formulas.throughput(measured["step_s"], measured["trained_tokens"], measured["input_tokens"],
                             measured["samples"], world_size=world_size, warmup=warmup, flops_token=flops,
                             peak=peak[1] if peak else None, devices=world_size)
    tp.update(flops_convention=convention, flops_per_token=flops, peak_device=peak[0] if peak else None,
              mfu_note=None if peak else f"no MFU: {hardware['device_name']!r} is not in the peak-FLOPS table")
    return {"memory": measured["memory"], "throughput": tp,
            "batch": {"input_tokens_per_step": round(sum(measured["input_tokens"]) / max(steps, 1), 1),
                      "trained_tokens_per_step": round(sum(measured["trained_tokens"]) / max(steps, 1), 1)}}


def _sum_over_ranks(t: torch.Tensor, accelerator) -> torch.Tensor:
    if accelerator.num_processes == 1:
        return t.clone()
    return accelerator.reduce(t.to(accelerator.device), reduction="sum").cpu()


def _gather(snapshot: dict, accelerator) -> list[dict]:
    snapshot = {"rank": accelerator.process_index, **snapshot}
    if accelerator.num_processes == 1:
        return [snapshot]
    from accelerate.utils import gather_object

    return sorted(gather_object([snapshot]), key=lambda r: r["rank"])

"""The meter: what one training process counts and clocks, in one object that owns its counters and resets them after
each log (torchtitan's MetricsProcessor is the model): tokens and rows per micro-batch, the optimizer-step clock, memory
peaks per rank (docs/run_record.md `memory`, `throughput`, `batch`). Every rank must call the methods that gather
(log_window, final, start_training).
"""

from __future__ import annotations

import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from finetune.data.collate import COUNTS_KEY, REAL_TOKENS_KEY
from finetune.telemetry import formulas
from finetune.units import GIB

# --- memory peaks ------------------------------------------------------------------------------------

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def host_rss() -> int:
    return psutil.Process().memory_info().rss


def vmhwm() -> int | None:
    """The kernel's RSS high-water mark of this process in bytes, or None where there is none."""
    try:
        match = re.search(r"^VmHWM:\s+(\d+)\s+kB", STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def reset_vmhwm() -> bool:
    """Reset the high-water mark to the current RSS; False where the kernel does not allow it."""
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def ru_maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


PEAKS = ("allocated", "reserved", "active")  # torch.cuda.memory_stats() <kind>_bytes.all.peak


class MemoryTracker:
    """Peaks on this rank since the last reset: accelerator (torch.cuda.memory_stats) and host, by the kernel's
    resident-set high-water mark where it can be reset (`vmhwm`, Linux), else sampled RSS (docs/run_record.md
    `memory.host_peak_method`). The reset also resets getrusage's ru_maxrss, so the lifetime peak is kept here."""

    def __init__(self, method: str | None = None):
        self.cuda = torch.cuda.is_available()
        self.lifetime_host_peak = ru_maxrss_bytes()  # before any reset: the kernel's lifetime figure
        if method is None:
            method = "vmhwm" if vmhwm() is not None and reset_vmhwm() else "sampled"
        self.method = method  # "vmhwm" or "sampled"
        self.host_peak = host_rss()

    def sample(self) -> None:
        """Between micro-steps: only the sampling method needs it (the kernel's mark misses nothing)."""
        if self.method == "sampled":
            self.host_peak = max(self.host_peak, host_rss())

    def host_peak_now(self) -> int:
        """The host peak since the last reset, in bytes."""
        if self.method == "vmhwm":
            mark = vmhwm()
            if mark is not None:
                self.host_peak = max(self.host_peak, mark)
        else:
            self.host_peak = max(self.host_peak, host_rss())
            # never reset under this method: the kernel's lifetime figure still holds
            self.lifetime_host_peak = max(self.lifetime_host_peak, ru_maxrss_bytes())
        self.lifetime_host_peak = max(self.lifetime_host_peak, self.host_peak)
        return self.host_peak

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        if self.method == "vmhwm":
            self.lifetime_host_peak = max(self.lifetime_host_peak, vmhwm() or 0)
            reset_vmhwm()
        self.host_peak = host_rss()

    def snapshot(self) -> dict:
        s = torch.cuda.memory_stats() if self.cuda else None  # None: no device figures
        out = {
            f"device_peak_{k}_gib": None if s is None else round(s.get(f"{k}_bytes.all.peak", 0) / GIB, 4)
            for k in PEAKS
        }
        out["host_peak_rss_gib"] = round(self.host_peak_now() / GIB, 4)
        for key, stat in (("alloc_retries", "num_alloc_retries"), ("ooms", "num_ooms")):
            out[key] = None if s is None else s.get(stat, 0)
        return out


@dataclass(frozen=True)
class BatchShare:
    """How one rank's micro-batches relate to the other ranks' (finetune/mesh.py), so that the counts summed over ranks
    count each token and example once: tensor- and context-parallel ranks train on the same batch (only `counted` ranks
    count it); sequence-parallel ranks each hold 1/sp of every row's positions (tokens count where they are; rows and
    lengths from the lengths summed over `sp_group`, on the group's first rank)."""

    counted: bool = True
    sp_group: object = None  # torch process group of the Ulysses ranks; None: no sequence parallelism


def token_counts(
    input_ids: torch.Tensor, attention_mask, labels, real, shift_labels=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input tokens, trained tokens) of one batch, as tensors on the batch's device (read them once per step: int()
    here would stall the GPU queue at every micro-batch). `real` is what a packed batch states under REAL_TOKENS_KEY
    (its real tokens per row; it has no mask to tell its padding apart). No mask and no stated count: a padding-free
    batch, where every position is a real token. Trained tokens are what the shifted causal-LM loss scores: labels[...,
    1:] that are not -100 (position t is scored against label t + 1, so label 0 of a row never is; transformers'
    ForCausalLMLoss and Trainer's num_items_in_batch count the same); a sequence shard carries `shift_labels` instead,
    shifted before the split: every one not -100 is scored."""
    n_input = (
        attention_mask.sum()
        if attention_mask is not None
        else real.to(input_ids.device).sum()
        if real is not None
        else torch.full((), input_ids.numel(), device=input_ids.device)
    )
    if labels is not None:
        n_trained = (labels[..., 1:] != -100).sum()
    else:
        n_trained = (shift_labels != -100).sum() if shift_labels is not None else n_input
    return n_input, n_trained


def batch_counts(inputs: dict, share: BatchShare | None = None) -> torch.Tensor:
    """[input tokens, trained tokens, examples, sum of squared example lengths] of one batch, a long tensor on the
    batch's device (no host sync). Examples are found from the sequence boundaries, as the attention mask sees them: a
    padded batch has one example per row (its attention-mask ones); a packed or padding-free batch starts a new example
    wherever position_ids do not continue by +1 (transformers' find_packed_sequence_indices), counted on real tokens
    only (a packed row's padding is no example); cu_seq_lens_q when position_ids are absent (FlashAttention kwargs). The
    squared lengths give the attention FLOPs (finetune/telemetry/model_flops.py). `share`: how this rank's batch relates
    to the others'. A sequence shard (Ulysses: padded rows with a mask) counts its rows and their lengths from the whole
    rows, summed over its group, once on the group's first rank."""
    ids = inputs["input_ids"]
    real = inputs.get(REAL_TOKENS_KEY)
    n_input, n_trained = token_counts(
        ids, inputs.get("attention_mask"), inputs.get("labels"), real, inputs.get("shift_labels")
    )
    if share is not None and not share.counted:
        return torch.zeros(4, dtype=torch.long, device=ids.device)
    if share is not None and share.sp_group is not None:
        import torch.distributed as dist

        per_row = inputs["attention_mask"].reshape(-1, ids.shape[-1]).long().sum(-1)
        dist.all_reduce(per_row, group=share.sp_group)  # the whole rows' real lengths
        first = dist.get_rank(group=share.sp_group) == 0
        examples, sum_sq = ((per_row > 0).sum(), (per_row * per_row).sum()) if first else (per_row[:0].sum(),) * 2
        return torch.stack([n_input.long(), n_trained.long(), examples.long(), sum_sq.long()])
    positions, mask, cu = inputs.get("position_ids"), inputs.get("attention_mask"), inputs.get("cu_seq_lens_q")
    if positions is not None and mask is None:
        positions = positions.reshape(-1, positions.shape[-1])
        rows, width = positions.shape
        col = torch.arange(width, device=positions.device)
        real_mask = (
            col < real.to(positions.device).reshape(-1, 1)
            if real is not None and real.dim() > 0
            else torch.ones_like(positions, dtype=torch.bool)
        )
        starts = torch.ones_like(positions, dtype=torch.bool)
        starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
        starts &= real_mask
        segment = starts.reshape(-1).long().cumsum(0) - 1  # example index of every position (padding: its row's last)
        lengths = torch.zeros(rows * width, dtype=torch.long, device=positions.device)
        lengths.scatter_add_(0, segment.clamp(min=0), real_mask.reshape(-1).long())
        examples, sum_sq = starts.sum(), (lengths * lengths).sum()
    elif mask is not None:
        per_row = mask.reshape(-1, mask.shape[-1]).long().sum(-1)
        examples, sum_sq = (per_row > 0).sum(), (per_row * per_row).sum()
    elif cu is not None:
        lengths = (cu[1:] - cu[:-1]).long()
        examples, sum_sq = (lengths > 0).sum(), (lengths * lengths).sum()
    else:  # one example per row, every position real
        rows = ids.numel() // ids.shape[-1]
        examples = torch.full((), rows, device=ids.device)
        sum_sq = torch.full((), rows * ids.shape[-1] ** 2, device=ids.device)
    return torch.stack([n_input.long(), n_trained.long(), examples.long().to(ids.device), sum_sq.long().to(ids.device)])


def counting(collator):
    """`collator`, adding each batch's batch_counts() under COUNTS_KEY as Python ints: counted on the
    CPU batch before the data loader moves it to the device, so counting costs the device nothing and
    the host no wait for it (in a loader worker, off the training loop)."""

    def collate_and_count(features):
        batch = collator(features)
        batch[COUNTS_KEY] = tuple(batch_counts(batch).tolist())  # CPU tensors: no device involved
        return batch

    return collate_and_count


def mfu_inputs(model, method: str) -> dict:
    """What the meter needs for MFU at each log: the model's FLOPs (from the live model; None with
    the reason when they cannot be known) and the device's peak (None off the table or on a MIG
    slice, so no MFU is shown rather than a guess)."""
    from finetune.telemetry import model_flops

    peak = formulas.device_peak()
    flops, _ = model_flops.from_model(model, method)
    return {"model_flops": flops, "peak_flops": peak[1] if peak else None}


class Meter:
    """Counters, step clock and memory peaks of one training process, and their per-log window."""

    def __init__(self, *, model_flops=None, peak_flops=None):
        # MFU at each log: the model's FLOPs (finetune/telemetry/model_flops.py ModelFlops) and the
        # device's peak dense FLOP/s; either None and there is no MFU.
        self.model_flops = model_flops
        self.peak_flops = peak_flops
        self.memory = MemoryTracker()
        # per optimizer step on this rank: seconds, input tokens, trained tokens, examples, sum of squared example lengths
        self.steps: list[tuple[float, int, int, int, int]] = []
        self.loading_memory: list[dict] | None = None
        self._micro: list[int] | None = None  # batch_counts() summed over the step's micro-batches
        self._logged_steps = 0
        self._train_peak: dict | None = None
        self._t0: float | None = None
        self._window_t0: float | None = None  # wall clock at the start of the log window
        self._data_s = 0.0  # seconds spent fetching batches in the window (this rank)
        self.share: BatchShare | None = None  # set once the model is prepared (finetune/training/trainer.py)

    # --- counting and the clocks -------------------------------------------------------------

    def count_batch(self, inputs: dict) -> tuple:
        """Count one micro-batch the trainer is about to train on and return its counts; takes
        COUNTS_KEY and REAL_TOKENS_KEY out of it (the model must not see them). Counted on the host by
        `counting` (Python ints); a rank whose batch its tensor- or context-parallel peers count
        (BatchShare) adds zeros. A batch without COUNTS_KEY (Ulysses: DeepSpeed's adapter re-cuts the
        collator's batches) is counted on the device, read once at the step's end."""
        counts = inputs.pop(COUNTS_KEY, None)
        if counts is None:
            counts = batch_counts(inputs, self.share)
        elif self.share is not None and not self.share.counted:
            counts = (0, 0, 0, 0)
        inputs.pop(REAL_TOKENS_KEY, None)
        self._micro = list(counts) if self._micro is None else [a + b for a, b in zip(self._micro, counts)]
        return counts

    def data_loading(self, seconds: float) -> None:
        """Time spent fetching the batches of a step (outside the step clock)."""
        self._data_s += seconds

    def step_begin(self) -> None:
        self._t0 = time.perf_counter()

    def step_end(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # kernels are asynchronous: time the work, not its launch
        self.record_step(time.perf_counter() - self._t0)

    def record_step(self, seconds: float) -> None:
        """One optimizer step done: its time and the counts of its micro-batches on this rank."""
        counts = [int(c) for c in self._micro] if self._micro is not None else (0, 0, 0, 0)
        self.steps.append((seconds, *counts))
        self._micro = None

    # --- memory ----------------------------------------------------------------------------

    def start_training(self, accelerator) -> None:
        """Peaks so far are model loading (and engine set-up); training peaks start from here."""
        snap = self.memory.snapshot()
        snap["host_peak_rss_gib"] = round(self.memory.lifetime_host_peak / GIB, 4)  # the process so far
        self.loading_memory = _gather(snap, accelerator)
        self.memory.reset()
        self._window_t0 = time.perf_counter()
        self._data_s = 0.0

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
        window = self.steps[self._logged_steps :]
        self._logged_steps = len(self.steps)
        counts = _sum_over_ranks(torch.tensor([s[1:] for s in window] or [[0, 0, 0, 0]]).sum(0), accelerator)
        n_input, n_trained, n_examples, sum_sq = (int(c) for c in counts)
        seconds = sum(s[0] for s in window)
        peaks = formulas.max_over_ranks(self._memory_since_last_log(accelerator))
        now = time.perf_counter()
        wall = now - self._window_t0 if self._window_t0 is not None else None
        data_s, self._data_s, self._window_t0 = self._data_s, 0.0, now
        n = accelerator.num_processes
        logs["tokens/input"] = n_input
        logs["tokens/trained"] = n_trained
        logs["perf/step_s"] = round(seconds / max(len(window), 1), 4)
        logs["perf/data_loading_s"] = round(data_s, 4)
        share = round(data_s / wall, 4) if wall else None
        if share is not None:
            logs["perf/data_loading_share"] = share
        mfu = None
        if seconds > 0:
            logs["perf/trained_tokens_per_s"] = round(n_trained / seconds, 2)
            logs["perf/trained_tokens_per_s_per_device"] = round(n_trained / seconds / n, 2)
            logs["perf/input_tokens_per_s"] = round(n_input / seconds, 2)
            logs["perf/samples_per_s"] = round(n_examples / seconds, 3)
            if self.model_flops is not None:
                mfu = formulas.mfu(self.model_flops.flops(n_input, sum_sq), seconds, self.peak_flops, n)
            if mfu is not None:
                logs["perf/mfu"] = round(mfu, 4)
        for key, value in peaks.items():
            if value is not None:
                logs[f"memory/max_{key}"] = value
        return {
            "step": global_step,
            "loss": logs.get("loss"),
            "lr": logs.get("learning_rate"),
            "grad_norm": logs.get("grad_norm"),
            "trained_tokens": n_trained,
            "input_tokens": n_input,
            "examples": n_examples,
            "window_steps": len(window),
            "world_size": n,
            "step_s": logs["perf/step_s"],
            "data_loading_s": logs["perf/data_loading_s"],
            "data_loading_share": share,
            "mfu": round(mfu, 6) if mfu is not None else None,
            "host_peak_rss_gib": peaks.get("host_peak_rss_gib"),
            "device_peak_allocated_gib": peaks.get("device_peak_allocated_gib"),
        }

    def tail_window(self, accelerator, global_step: int) -> dict | None:
        """The steps after the last log as one more `steps` entry (loss null: Trainer logs no loss
        for them), or None when there are none; every rank calls it (it gathers)."""
        if len(self.steps) == self._logged_steps:
            return None
        return self.log_window({}, accelerator, global_step)

    def final(self, accelerator) -> dict:
        """Per-step series summed over ranks, memory peaks (per rank, max) and the host method."""
        self._memory_since_last_log(accelerator)  # folds the tail after the last log into the peak
        train_peaks = _gather({k: v for k, v in self._train_peak.items() if k != "rank"}, accelerator)
        series = torch.tensor([s[1:] for s in self.steps] or [[0, 0, 0, 0]], dtype=torch.long)
        series = _sum_over_ranks(series, accelerator)
        columns = {
            name: series[:, i].tolist() if self.steps else []
            for i, name in enumerate(("input_tokens", "trained_tokens", "samples", "sum_sq_lengths"))
        }
        return {
            "step_s": [s[0] for s in self.steps],
            **columns,
            "host_lifetime_peak_gib": round(self.memory.lifetime_host_peak / GIB, 4),  # this rank's
            "memory": {
                "per_rank": train_peaks,
                "max": formulas.max_over_ranks(train_peaks),
                "host_peak_method": self.memory.method,
                "loading": {"per_rank": self.loading_memory, "max": formulas.max_over_ranks(self.loading_memory)},
            },
        }


def run_figures(
    measured: dict,
    *,
    hardware: dict,
    model_flops,
    flops_reason: str | None,
    world_size: int,
    warmup: int,
    earlier: list | None = None,
    earlier_excluded: int = 0,
) -> dict:
    """run.json's `memory` and `throughput` sections and the `batch` tokens per step, from Meter.final() of this launch
    and, for a resumed run, `earlier`: the stretches of the earlier segments, `earlier_excluded` of their steps left out
    as warm-up (finetune/telemetry/formulas.py). MFU against the peak of the recorded device (CUDA only; none on a MIG
    slice or off the table, with the reason)."""
    import os

    steps = len(measured["step_s"])
    excluded = warmup if steps > warmup else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # MIG slices show there as MIG-<uuid>
    peak = formulas.peak_flops(hardware["device_name"], visible) if hardware["device_type"] == "cuda" else None
    flops = (
        [model_flops.flops(i, q) for i, q in zip(measured["input_tokens"], measured["sum_sq_lengths"])]
        if model_flops is not None
        else None
    )
    mine = [
        formulas.Stretch(
            steps=1,
            seconds=t,
            trained=tr,
            inputs=i,
            examples=e,
            devices=world_size,
            peak_seconds=flops[k] / peak[1] if flops is not None and peak else None,
        )
        for k, (t, tr, i, e) in enumerate(
            zip(measured["step_s"], measured["trained_tokens"], measured["input_tokens"], measured["samples"])
        )
    ][excluded:]
    earlier = earlier or []
    tp = formulas.throughput(earlier + mine, excluded=excluded + earlier_excluded)
    measured_inputs = sum(measured["input_tokens"][excluded:])
    note = formulas.no_peak_reason(hardware["device_name"], visible) if peak is None else None
    note = f"no MFU: {note}" if note else None
    if model_flops is None:
        note = f"no MFU: {flops_reason}"
    elif tp["mfu"] is None and note is None and earlier:
        note = "no MFU: an earlier segment of this resumed run has no MFU figure"
    tp.update(
        flops_convention=model_flops.convention if model_flops else None,
        flops_per_token=round(sum(flops[excluded:]) / measured_inputs, 1) if flops and measured_inputs else None,
        peak_device=peak[0] if peak else None,
        mfu_note=note,
        scope=SCOPE
        + (f"; whole run: {len(earlier)} log window(s) of earlier segments and this launch's steps" if earlier else ""),
    )
    return {
        "memory": measured["memory"],
        "throughput": tp,
        "batch": {
            "input_tokens_per_step": round(sum(measured["input_tokens"]) / max(steps, 1), 1),
            "trained_tokens_per_step": round(sum(measured["trained_tokens"]) / max(steps, 1), 1),
        },
    }


# What throughput figures cover (docs/run_record.md `throughput`, docs/usage.md "What every run measures").
SCOPE = (
    "step clock: start to end of each optimizer step, CUDA-synchronised, rank 0; excludes data loading, "
    "logging, evaluation and checkpoint saves; rates = summed counts / summed step time over the steps "
    "after each segment's warm-up"
)


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

"""The formulas of what runs measure, each once: the peak-FLOPs table, MFU, throughput over steps,
the maximum over ranks, the whole-run totals of a resumed run (definitions: docs/run_record.md; model
FLOPs: finetune/telemetry/model_flops.py; the counters that feed them: finetune/telemetry/meter.py).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

# Peak dense (no 2:4 sparsity) bf16 tensor-core FLOP/s per device, from the vendor's documents (figures "with sparsity"
# halved). T4 has no bf16: its fp16 (mixed precision) figure. (regex on torch.cuda.get_device_name(), label, FLOP/s,
# source); the first pattern that matches wins, so the PCIe/NVL variants come before their SXM row. A figure that could
# not be checked against a datasheet is not in the table: no MFU is better than a guess.
PEAK_DENSE_FLOPS: list[tuple[str, str, float, str]] = [
    (
        r"\bH100\b.*\bPCIe\b",
        "H100 PCIe",
        756e12,
        "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), H100 PCIe: BF16 1,513 TFLOPS with sparsity",
    ),
    (
        r"\bH100\b.*\bNVL\b",
        "H100 NVL",
        835e12,
        "NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100), H100 NVL: BF16 1,671 TFLOPS with sparsity",
    ),
    (
        r"\bH100\b",
        "H100 SXM",
        989.4e12,
        "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), H100 SXM5: BF16 989.4 TFLOPS dense",
    ),
    (
        r"\bH200\b(?!.*\bNVL\b)",
        "H200 SXM",
        989.4e12,
        "NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200), H200 SXM: BF16 1,979 TFLOPS with sparsity; "
        "the H100 SXM5 silicon and clocks",
    ),
    (
        r"\bA100\b",
        "A100",
        312e12,
        "NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): BF16 312 TFLOPS dense, SXM and PCIe alike",
    ),
    (r"\bL40S\b", "L40S", 362.05e12, "NVIDIA L40S datasheet: BF16 362.05 TFLOPS (733 with sparsity)"),
    (r"\bL4\b", "L4", 121e12, "NVIDIA L4 datasheet: BF16 242 TFLOPS with sparsity"),
    (r"\bA10\b", "A10", 125e12, "NVIDIA A10 datasheet: BF16 125 TFLOPS (250 with sparsity)"),
    (r"\bT4\b", "T4 (fp16)", 65e12, "NVIDIA T4 datasheet: mixed precision FP16/FP32 65 TFLOPS (no bf16)"),
]
# Devices that would match a row above but are a different part, or have no figure we could check.
NO_FIGURE: list[tuple[str, str]] = [
    (
        r"\bH200\b.*\bNVL\b",
        "the H200 NVL (600 W, lower clocks than the H200 SXM) has no dense BF16 figure checked "
        "against its datasheet here",
    ),
    (r"\bA10G\b", "the A10G (AWS) has no public datasheet figure"),
    (r"\bGH200\b", "the GH200 superchip is not in the peak table"),
]


def peak_flops(device_name: str | None, visible_devices: str | None = None) -> tuple[str, float] | None:
    """(table entry, peak dense FLOP/s) of a device, or None: not in the table, or a MIG slice
    (no_peak_reason says which)."""
    if no_peak_reason(device_name, visible_devices) is not None:
        return None
    for pattern, label, flops, _ in PEAK_DENSE_FLOPS:
        if re.search(pattern, device_name):
            return label, flops
    return None


def no_peak_reason(device_name: str | None, visible_devices: str | None = None) -> str | None:
    """Why a device has no peak figure (so no MFU), or None when it has one. A MIG slice (its
    name says MIG, or CUDA_VISIBLE_DEVICES holds MIG- UUIDs) computes on a fraction of the GPU's
    SMs that its name does not give: the full GPU's peak would understate MFU."""
    if not device_name:
        return "no device name"
    if " MIG " in f" {device_name} " or "MIG-" in (visible_devices or ""):
        return (
            f"{device_name!r} is a MIG slice (CUDA_VISIBLE_DEVICES={visible_devices or '(unset)'}): its share of "
            f"the GPU's compute is not known here"
        )
    for pattern, why in NO_FIGURE:
        if re.search(pattern, device_name):
            return f"{device_name!r}: {why}"
    if not any(re.search(pattern, device_name) for pattern, *_ in PEAK_DENSE_FLOPS):
        return f"{device_name!r} is not in the peak-FLOPS table (finetune/telemetry/formulas.py)"
    return None


def device_peak() -> tuple[str, float] | None:
    """peak_flops() of this process's CUDA device 0, or None (no CUDA, off the table, MIG)."""
    import os

    import torch

    if not torch.cuda.is_available():
        return None
    return peak_flops(torch.cuda.get_device_name(0), os.environ.get("CUDA_VISIBLE_DEVICES"))


def mfu(model_flops: float | None, seconds: float, peak: float | None, devices: int = 1) -> float | None:
    """Model FLOPs utilization: the model FLOPs of a stretch of steps (finetune/telemetry/model_flops.py:
    every input token, prompt positions too, with each example's own attention length) / (its
    step-clock seconds x peak dense FLOP/s x devices). None without a FLOPs figure, a device peak
    or measured time. The one definition: log windows (meter.py) and `finetune bench` call it;
    `throughput` below sums it over stretches of different world sizes (FLOPs / peak per stretch)."""
    if not model_flops or not peak or seconds <= 0:
        return None
    return model_flops / (seconds * peak * devices)


def max_over_ranks(per_rank: list[dict]) -> dict:
    values = {k: [r[k] for r in per_rank if r.get(k) is not None] for k in per_rank[0] if k != "rank"}
    return {k: max(v) if v else None for k, v in values.items()}


def rates(step_s: list[float], trained: list[int], inputs: list[int], samples: list[int], *, warmup: int) -> dict:
    """Unrounded per-second figures over per-optimizer-step times and counts. The first `warmup` steps are excluded
    (kept when the run has no more steps than that, and then said so): {excluded, steps, seconds, trained_tokens_per_s,
    input_tokens_per_s, samples_per_s, median_step_s}, the per-second ones None when the measured steps took no time."""
    excluded = warmup if len(step_s) > warmup else 0
    times = step_s[excluded:]
    total = sum(times)
    per_s = (lambda counts: sum(counts[excluded:]) / total) if total > 0 else (lambda counts: None)
    return {
        "excluded": excluded,
        "steps": len(times),
        "seconds": total,
        "trained_tokens_per_s": per_s(trained),
        "input_tokens_per_s": per_s(inputs),
        "samples_per_s": per_s(samples),
        "median_step_s": statistics.median(times) if times else None,
    }


@dataclass(frozen=True)
class Stretch:
    """A measured stretch of training: one optimizer step of this launch, or one log window of an
    earlier segment of a resumed run (its steps[] entry). Counts are summed over ranks."""

    steps: int  # optimizer steps it covers
    seconds: float  # summed step-clock time
    trained: int
    inputs: int
    examples: int
    devices: int  # world size while it ran
    peak_seconds: float | None  # model FLOPs / one device's peak FLOP/s; None without a FLOPs or peak figure


def throughput(stretches: list[Stretch], *, excluded: int) -> dict:
    """The run record's `throughput` rates over measured stretches (warm-up already left out; `excluded` says how many
    steps were), rounded as recorded: tokens and examples / summed step time; per device / summed (step time x devices);
    median step time over the steps (a window of an earlier segment contributes its mean step time once per step); MFU =
    model FLOPs / (peak x devices x time) summed, null unless every stretch has a FLOPs and peak figure."""
    seconds = sum(s.seconds for s in stretches)
    rates = ("trained_tokens_per_s", "trained_tokens_per_s_per_device", "input_tokens_per_s", "samples_per_s")
    empty = {**dict.fromkeys((*rates, "median_step_s", "mfu")), "warmup_steps_excluded": excluded, "steps_measured": 0}
    if not stretches or seconds <= 0:
        return empty
    device_seconds = sum(s.seconds * s.devices for s in stretches)
    times = [s.seconds / s.steps for s in stretches for _ in range(s.steps)]
    busy = [s.peak_seconds for s in stretches]
    value = sum(busy) / device_seconds if all(b is not None for b in busy) else None
    return {
        "trained_tokens_per_s": round(sum(s.trained for s in stretches) / seconds, 3),
        "trained_tokens_per_s_per_device": round(sum(s.trained for s in stretches) / device_seconds, 3),
        "input_tokens_per_s": round(sum(s.inputs for s in stretches) / seconds, 3),
        "samples_per_s": round(sum(s.examples for s in stretches) / seconds, 4),
        "median_step_s": round(statistics.median(times), 4),
        "mfu": round(value, 4) if value is not None else None,
        "warmup_steps_excluded": excluded,
        "steps_measured": len(times),
    }


# --- whole-run totals of a run continued from a checkpoint: every segment, from the earlier
# segments' steps[] entries (kept up to the checkpoint) and this launch's measurements
# (`summary.steps_counted` says how many optimizer steps they cover; docs/run_record.md).


def earlier_entries(steps: list[dict], resumed_at_step: int | None) -> list[dict]:
    """The steps[] entries of the earlier segments (none unless the run was resumed)."""
    if not resumed_at_step:
        return []
    return [s for s in steps if s.get("step") is not None and s["step"] <= resumed_at_step]


def windows(entries: list[dict], segment_starts: list[int]) -> list[tuple[dict, int, int]]:
    """(entry, optimizer steps it covers, its segment's first step - 1) for each entry, in order. Entries written before
    window_steps was recorded get the distance to the previous entry of their segment."""
    out, prev = [], None
    for e in sorted(entries, key=lambda e: e["step"]):
        start = max((s for s in segment_starts if s < e["step"]), default=0)
        lower = start if prev is None or prev < start else prev
        n = e.get("window_steps") or e["step"] - lower
        out.append((e, n, start))
        prev = e["step"]
    return out


def whole_run(
    entries: list[dict],
    segment_starts: list[int],
    *,
    warmup: int,
    steps: int,
    trained: int,
    inputs: int,
    train_loss: float | None,
) -> tuple[dict, list[Stretch], int]:
    """(summary fields, throughput stretches of the earlier segments, their steps left out as warm-up), from the earlier
    segments' entries and this launch's `steps`, token sums and Trainer mean loss."""
    loss_sum, loss_steps = (train_loss * steps, steps) if train_loss is not None and steps else (0.0, 0)
    counted, stretches, excluded = steps, [], 0
    for e, n, start in windows(entries, segment_starts):
        counted += n
        trained += e.get("trained_tokens") or 0
        inputs += e.get("input_tokens") or 0
        if e.get("loss") is not None:
            loss_sum, loss_steps = loss_sum + e["loss"] * n, loss_steps + n
        if e["step"] - n < start + warmup:
            excluded += n
        elif e.get("step_s") is not None and e.get("examples") is not None and e.get("world_size"):
            devices = e["world_size"]
            seconds = e["step_s"] * n
            stretches.append(
                Stretch(
                    steps=n,
                    seconds=seconds,
                    trained=e["trained_tokens"],
                    inputs=e["input_tokens"],
                    examples=e["examples"],
                    devices=devices,
                    peak_seconds=e["mfu"] * seconds * devices if e.get("mfu") is not None else None,
                )
            )
    summary = {
        "total_trained_tokens": trained,
        "total_input_tokens": inputs,
        "steps_counted": counted,
        "train_loss": loss_sum / loss_steps if loss_steps else train_loss,
    }
    return summary, stretches, excluded


def closed_segments(segments: list[dict], ended: str, step: int) -> tuple[list[dict], float | None]:
    """`resumes` with its last segment closed at `ended` (ISO 8601) and global step `step` (when it ended, its wall time
    from its start, the optimizer steps it trained), and the run's wall time: every segment's, summed (None when a
    segment's start or end is unknown: a record from before segments were closed)."""
    from datetime import datetime

    last = dict(segments[-1])
    seconds = (
        (datetime.fromisoformat(ended) - datetime.fromisoformat(last["at"])).total_seconds() if last.get("at") else None
    )
    last.update(
        ended=ended, wall_s=round(seconds, 2) if seconds is not None else None, steps_trained=step - last["step"]
    )
    closed = [*segments[:-1], last]
    walls = [s.get("wall_s") for s in closed]
    return closed, (round(sum(walls), 2) if all(w is not None for w in walls) else None)

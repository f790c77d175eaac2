"""Whole-run totals of a run continued from a checkpoint: the summary and throughput cover every
segment, from the earlier segments' steps[] entries (kept up to the checkpoint) and this launch's
measurements; `summary.steps_counted` says how many optimizer steps they cover (docs/run_record.md,
docs/faults.md).
"""

from __future__ import annotations

from finetune.telemetry.formulas import Stretch


def earlier_entries(steps: list[dict], resumed_at_step: int | None) -> list[dict]:
    """The steps[] entries of the earlier segments (none unless the run was resumed)."""
    if not resumed_at_step:
        return []
    return [s for s in steps if s.get("step") is not None and s["step"] <= resumed_at_step]


def windows(entries: list[dict], segment_starts: list[int]) -> list[tuple[dict, int, int]]:
    """(entry, optimizer steps it covers, its segment's first step - 1) for each entry, in order.
    Entries written before window_steps was recorded get the distance to the previous entry of
    their segment."""
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
    """(summary fields, throughput stretches of the earlier segments, their steps left out as
    warm-up), from the earlier segments' entries and this launch's `steps`, token sums and
    Trainer mean loss."""
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

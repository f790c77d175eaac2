"""The ranks' one agreement per optimizer step, and the non-finite guard that reads it (docs/faults.md,
docs/speed.md "Per-micro-batch work").

Per micro-batch nothing leaves the device: `StepFlags.note` folds "this loss is non-finite" (and the
first such value) into a small tensor on the device, a few element-wise kernels. Once per optimizer
step, before its update, `StepFlags.agree` writes this rank's pending signal number into the same
tensor, all-gathers every rank's row (one collective; none on one process) and reads the rows on the
host (one sync). finetune/training/trainer.py calls it after Trainer's gradient norm under every
strategy but DeepSpeed, and under DeepSpeed in the step's last micro-batch before its backward (the
engine runs its optimizer step inside that backward). A further per-step check (a collapse detector,
say) adds a slot to SLOTS instead of a collective of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetune.errors import UserError
from finetune.training.collapse import Diverged

# What each rank's row holds: a 0/1 flag and the first non-finite value of each checked quantity, and
# this rank's signal code (finetune/training/signals.py `code`: 0 for none).
SLOTS = ("loss", "loss_value", "grad_norm", "grad_norm_value", "signal")
CHECKED = {"loss": "loss", "grad_norm": "gradient norm"}  # slot -> the name in messages and run.json


class NonFiniteError(Diverged):
    """A non-finite loss or gradient norm that every rank agreed on (exit 3)."""


def check_policy(policy: str, distributed_type: str) -> None:
    if policy == "skip" and distributed_type == "DEEPSPEED":
        raise UserError(
            "training.on_nonfinite: 'skip' is not implemented under DeepSpeed (its engine runs the "
            "optimizer step inside backward, so the update cannot be dropped from outside); "
            "use 'stop' (the default) and resume from the last checkpoint"
        )


@dataclass(frozen=True)
class Agreed:
    """Every rank's row of one step's agreement, the same on every rank."""

    rows: list[list[float]]

    def ranks(self, slot: str) -> list[int]:
        i = SLOTS.index(slot)
        return [r for r, row in enumerate(self.rows) if row[i]]

    def value(self, slot: str, rank: int) -> float:
        return self.rows[rank][SLOTS.index(slot)]

    def nonfinite(self) -> tuple[str, list[int]] | None:
        """(the checked slot, its ranks) of the first non-finite quantity, the loss before the norm
        (a non-finite loss makes the norm non-finite too); None when every rank's step was finite."""
        for slot in CHECKED:
            ranks = self.ranks(slot)
            if ranks:
                return slot, ranks
        return None

    def signals(self) -> list[int]:
        """Each rank's signal code (finetune/training/signals.py `code`: 0 for none)."""
        return [int(self.value("signal", r)) for r in range(len(self.rows))]


class StepFlags:
    """This rank's row of the current optimizer step, on the device, until `agree` reads it."""

    def __init__(self, device):
        self.values = torch.zeros(len(SLOTS), dtype=torch.float32, device=device)

    def note(self, slot: str, value: torch.Tensor) -> None:
        """Fold `value` (a loss, a gradient norm) into the step's row: device kernels, no host sync."""
        v = value.detach().float().reshape(-1)
        if v.device != self.values.device:  # a CPU-offloaded norm; never the case for the loss
            v = v.to(self.values.device, non_blocking=True)
        bad = ~torch.isfinite(v).all()
        i, j = SLOTS.index(slot), SLOTS.index(slot + "_value")
        self.values[j] = torch.where(bad & (self.values[i] == 0), v.sum(), self.values[j])  # keep the first
        self.values[i] = torch.where(bad, 1.0, self.values[i])

    def agree(self, accelerator, signum: int) -> Agreed:
        """Every rank's row on every rank: one all-gather (none on one process), one host read; the
        row starts again at zero for the next step."""
        self.values[SLOTS.index("signal")] = float(signum)  # a fill kernel: no host-to-device copy to wait for
        world = accelerator.num_processes
        gathered = accelerator.gather(self.values) if world > 1 else self.values
        rows = gathered.reshape(world, len(SLOTS)).tolist()  # the step's one host sync
        self.values.zero_()
        return Agreed(rows)

"""Counts the calls that make the host wait for an accelerator (a tensor read on the host: item, bool,
tolist, cpu, float, int, numpy, nonzero) and the torch.distributed collectives, each attributed to
whose code made it: the innermost frame outside torch and accelerate (plumbing both), by package
(`finetune`, `transformers`, `peft`, `deepspeed`, ...). Calls made inside a DataLoader's fetch work on
the CPU batch the collator builds, before anything is on a device: `data loader`. On CPU nothing
actually waits; the count is of the calls that would on a GPU.

TodaysGuard is the control: the non-finite check as it was before issue 29 (commit 0d64d44,
finetune/training/resilience.py ResilientTrainer._nonfinite from compute_loss: the loss read on the host
and, on more than one process, all-gathered, for every micro-batch). It stands in for our code, so
its calls count as `finetune`. Used by tests/training/test_sync_count.py, in-process and in launched
ranks (tests/training/sync_count_rank.py).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from finetune.training.resilience import ResilientTrainer

HOST_READS = ("item", "__bool__", "tolist", "cpu", "__float__", "__int__", "numpy", "nonzero")
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "_broadcast_coalesced",  # DDP's buffer broadcast before a forward
)
_TORCH = f"{Path(torch.__file__).parent}/"
_OURS = (str(Path(__file__).resolve()), str(Path(__file__).resolve().parents[2] / "finetune") + "/")


def _owner() -> str:
    frame = sys._getframe(2)  # the caller of the counted function
    owner = None
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/utils/data/" in name:
            return "data loader"
        if owner is None and not name.startswith(_TORCH) and "/accelerate/" not in name:
            owner = _package(name)
        frame = frame.f_back
    return owner or "other"


def _package(filename: str) -> str:
    if filename.startswith(_OURS):
        return "finetune"
    parts = Path(filename).parts
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1]
    return "other"


class SyncCounter:
    """`with SyncCounter() as c:` counts (kind, owner) pairs into c.counts; c.mark() closes a span (an
    optimizer step) into c.spans; c.where counts the caller lines of each pair."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.spans: list[Counter] = []
        self.where: Counter = Counter()
        self._saved: list = []

    def mark(self) -> None:
        self.spans.append(self.counts)
        self.counts = Counter()

    def _wrap(self, holder, name: str, kind: str) -> None:
        original = getattr(holder, name)
        counter = self

        def counted(*args, **kwargs):
            key = (kind, _owner())
            counter.counts[key] += 1
            f = sys._getframe(1)
            counter.where[(*key, f"{name} at {f.f_code.co_filename}:{f.f_lineno}")] += 1
            return original(*args, **kwargs)

        self._saved.append((holder, name, original))
        setattr(holder, name, counted)

    def __enter__(self) -> SyncCounter:
        for name in HOST_READS:
            self._wrap(torch.Tensor, name, "host sync")
        self._wrap(torch, "nonzero", "host sync")
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._wrap(dist, name, "collective")
        return self

    def __exit__(self, *exc) -> None:
        for holder, name, original in reversed(self._saved):
            setattr(holder, name, original)
        self._saved.clear()


def per_step(spans: list[Counter], kind: str, owner: str = "finetune") -> list[int]:
    return [span[(kind, owner)] for span in spans]


class TodaysGuard(ResilientTrainer):
    """The control (see the module docstring): the per-micro-batch check of commit 0d64d44 added to
    the trainer, as its compute_loss did it (bool() of the loss's finiteness, then one all-gather of
    the flag per micro-batch under more than one process, signals.flags_per_rank)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if model.training:
            loss = out[0] if return_outputs else out
            bad = not bool(torch.isfinite(loss.detach()).all())
            if self.accelerator.num_processes > 1:
                flag = torch.tensor([int(bad)], device=self.accelerator.device)
                [int(x) for x in self.accelerator.gather(flag).tolist()]
        return out

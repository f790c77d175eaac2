"""Counts the calls that make the host wait for an accelerator (a tensor read on the host: item, bool,
tolist, cpu, float, int, numpy, nonzero) and the torch.distributed collectives, each attributed to
whose code made it: the innermost frame outside torch and accelerate (plumbing both), by package
(`finetune`, `transformers`, `peft`, `deepspeed`, ...). Calls made inside a DataLoader's fetch work on
the CPU batch the collator builds, before anything is on a device: `data loader`; inside a test hook of the
product (TEST_HOOKS), the hook's. On CPU nothing
actually waits; the count is of the calls that would on a GPU.

TodaysGuard is the control: the non-finite check as it was before issue 29 (commit 0d64d44,
finetune/training/resilience.py ResilientTrainer._nonfinite from compute_loss: the loss read on the host
and, on more than one process, all-gathered, for every micro-batch). It stands in for our code, so
its calls count as `finetune`. Used by tests/training/test_sync_count.py, in-process and in launched
ranks (count_this_rank, from tests/training/sync_site/sitecustomize.py).
"""

from __future__ import annotations

import contextlib
import json
import os
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


# The product's test hooks, off in users' runs: what they read is theirs, not the step's (FINETUNE_SAMPLE_TRACE,
# finetune/training/trainer.py, is set in the runs tests/training/test_strategies.py recounts).
TEST_HOOKS = {"trace_samples": "sample trace"}


def _owner() -> str:
    frame = sys._getframe(2)  # the caller of the counted function
    owner = None
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/utils/data/" in name:
            return "data loader"
        if frame.f_code.co_name in TEST_HOOKS and name.endswith("finetune/training/trainer.py"):
            return TEST_HOOKS[frame.f_code.co_name]
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
        self.outside: Counter = Counter()  # what apart() counted: outside every span
        self._saved: list = []

    def mark(self) -> None:
        self.spans.append(self.counts)
        self.counts = Counter()

    @contextlib.contextmanager
    def apart(self):
        """Count into self.outside meanwhile (a window between two optimizer steps: not a step's work)."""
        step, self.counts = self.counts, self.outside
        try:
            yield
        finally:
            self.outside, self.counts = self.counts, step

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


def count_this_rank(run, out: Path, control: bool = False) -> None:
    """In a launched rank, once finetune/training/run.py (`run`) is imported: count its host syncs and collectives
    per optimizer step (a span from one on_step_end to the next; on_train_begin clears what came before), Trainer's
    log, save and evaluation window between two steps counted apart (the runs that share this count log every step),
    and write the spans and callers to OUT/rank<r>.json at exit. `control`: the guard as it was before issue 29
    (TodaysGuard) trains instead of ResilientTrainer."""
    import atexit

    from transformers import Trainer, TrainerCallback

    from finetune.training import resilience

    counter = SyncCounter().__enter__()

    class Spans(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            counter.counts.clear()

        def on_step_end(self, *args, **kwargs):
            counter.mark()

    train, between_steps = run.train, Trainer._maybe_log_save_evaluate

    def count_and_train(r, t, *args, **kwargs):  # the last phase before Trainer.train: every callback is in
        t.add_callback(Spans())
        return train(r, t, *args, **kwargs)

    def apart(trainer, *args, **kwargs):
        with counter.apart():
            return between_steps(trainer, *args, **kwargs)

    def write() -> None:
        counter.__exit__()
        spans = [{f"{kind}|{owner}": n for (kind, owner), n in span.items()} for span in counter.spans]
        where = {"|".join(key): n for key, n in counter.where.items()}
        Path(out, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"spans": spans, "where": where}))

    run.train, Trainer._maybe_log_save_evaluate = count_and_train, apart
    if control:
        resilience.ResilientTrainer = TodaysGuard  # finetune/training/build.py imports it at call time
    atexit.register(write)

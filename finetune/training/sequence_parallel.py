"""What Trainer needs of Ulysses sequence parallelism beyond what transformers 5.24 and DeepSpeed 0.19
give it (docs/parallelism.md): the step's scored tokens for the token-weighted loss, and a train
dataloader that takes an epoch and resumes mid-epoch.

DeepSpeed's UlyssesSPDataLoaderAdapter (which Trainer puts around the train dataloader) has no
`set_epoch`, and makes its next epoch's iterator before Trainer sets the epoch, so every epoch would
repeat the first one's order; and accelerate's `skip_first_batches` rebuilds a plain DataLoader from
the loader's dataset (the adapter has none), so a resumed run would fail, or lose the sequence split.
"""

from __future__ import annotations

import functools

import torch

from finetune.data.render import IGNORE_INDEX


def scored_tokens(batches: list[dict], device) -> torch.Tensor:
    """Tokens the loss scores in one optimizer step, over every rank: each rank holds distinct
    shards (sequence parallelism) or rows (data parallelism), so the sum counts each token once."""
    import torch.distributed as dist

    n = sum((b["shift_labels"] != IGNORE_INDEX).sum() for b in batches).to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(n)
    return n


def gradient_divisor(engine) -> int:
    """The number DeepSpeed divides the summed gradients by under Ulysses, read from its engine. Not
    one number: ZeRO-1/2 (stage_1_and_2.py average_tensor) and ZeRO-3's contiguous all-reduce
    (stage3.py __avg_scatter_contiguous_grads) divide by the sequence-and-data-parallel group's size
    / sp, the data-parallel size; ZeRO-3's reduce-scatter (stage3.py __avg_scatter_grads ->
    coalesced_collectives.reduce_scatter_coalesced, the default) by the whole group's size."""
    ranks, sp = int(engine.seq_dp_world_size), int(engine.sequence_parallel_size)
    zero = engine.optimizer
    if int(engine.zero_optimization_stage()) == 3 and getattr(zero, "reduce_scatter", False):
        return ranks
    return ranks // sp


class ShardLoader:
    """DeepSpeed's adapter (gathers a batch from each sequence-parallel rank, gives each rank its
    shard of every one) with `set_epoch` and mid-epoch resumption (module docstring)."""

    def __init__(self, adapter, drop: int = 0):
        self.adapter = adapter
        self._drop = drop  # micro-batches of the first refill already trained (resumed mid-refill)

    def __len__(self) -> int:
        return len(self.adapter)

    def __iter__(self):
        it = iter(self.adapter)  # the adapter is its own iterator
        for _ in range(self._drop):
            next(it)  # every rank refills together (a collective), then drops the same micro-batches
        self._drop = 0
        return it

    def set_epoch(self, epoch: int) -> None:
        inner = self.adapter.dl
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
        if not self.adapter.micro_batches:  # its iterator was made before this epoch was set
            self.adapter.iter = iter(inner)

    def skipped(self, micro_batches: int) -> ShardLoader:
        """This loader without its first `micro_batches` (Trainer counts the adapter's micro-batches:
        each of the inner loader's batches makes sp of them, one per rank's batch)."""
        from accelerate import skip_first_batches

        a, sp = self.adapter, self.adapter.sp_world_size
        inner = skip_first_batches(a.dl, micro_batches // sp)
        fresh = type(a)(inner, sp_rank=a.sp_rank, sp_group=a.sp_group, sp_world_size=sp, device=a.device)
        return ShardLoader(fresh, drop=micro_batches % sp)


@functools.cache
def route_skips() -> None:
    """Trainer resumes mid-epoch through the name `skip_first_batches` in its own module: a ShardLoader
    skips itself, every other loader goes to accelerate's as before. Idempotent."""
    import transformers.trainer as hf

    original = hf.skip_first_batches

    @functools.wraps(original)
    def skip_first_batches(dataloader, num_batches=0):
        if isinstance(dataloader, ShardLoader):
            return dataloader.skipped(num_batches)
        return original(dataloader, num_batches)

    hf.skip_first_batches = skip_first_batches

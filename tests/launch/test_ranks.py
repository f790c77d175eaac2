"""The process group's teardown at exit (finetune/launch/peers.py close_process_group): every group
that cannot have NCCL work in flight is destroyed, so its gloo worker threads are joined before
the interpreter finalizes (a worker still alive then can abort the process: docstring there)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from finetune.launch import peers


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def group_without_backend():
    """A one-process default group initialised without a backend, as Accelerate leaves it for a
    launch it does not distribute: get_backend() says "undefined", the config "cpu:gloo"."""
    assert not dist.is_initialized()
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="with CUDA the group's all_gather_object runs on NCCL, which is destroyed only after a clean end",
)
def test_a_group_initialised_without_a_backend_is_destroyed_after_an_error(group_without_backend):
    everyone = [None]
    dist.all_gather_object(everyone, ["a problem"])  # what preflight does before a refusal
    # control: the rule this replaced (destroy after an error only when get_backend() == "gloo")
    # would have left this group, and its worker threads, alive
    assert dist.get_backend() != "gloo" and "gloo" in str(dist.get_backend_config())
    before = _threads()
    state = SimpleNamespace(num_processes=1, destroy_process_group=dist.destroy_process_group)
    peers.close_process_group(state, clean=False)  # not finished: the refusal's exit 2
    assert not dist.is_initialized()
    assert _threads() < before  # gloo's workers joined now, not during finalization

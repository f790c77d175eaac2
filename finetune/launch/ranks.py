"""Small helpers for doing something once on rank 0 and sharing the outcome with every rank."""

from __future__ import annotations

from finetune.errors import UserError


def run_on_main(state, fn):
    """Run `fn` on the main process and return its result on every rank. A UserError raised
    there is raised on every rank, so all processes stop together instead of some hanging."""
    result, error = None, None
    if state.is_main_process:
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        result, error = broadcast_object_list([result, error], from_process=0)
    if error is not None:
        raise UserError(error)
    return result


def close_process_group_at_exit(state) -> list:
    """Destroy the default process group when the interpreter exits (atexit: after main returns,
    sys.exit or an uncaught error, before C++ teardown), so gloo's teardown cannot abort a finished
    process (docs/faults.md "Process teardown"). Returns a list to append to once every rank is done
    (a clean end): then the ranks meet at a barrier first."""
    import atexit

    finished: list = []
    atexit.register(close_process_group, state, finished)
    return finished


def close_process_group(state, finished: list) -> None:
    """What the atexit hook above does: after a clean end (`finished` not empty) a barrier, then
    destroy; after an error destroy only a group that cannot have NCCL work in flight."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if finished and state.num_processes > 1:
        state.wait_for_everyone()  # a barrier on this rank's own device (NCCL) or gloo's
    if finished or not _may_use_nccl(dist):
        state.destroy_process_group()


def _may_use_nccl(dist) -> bool:
    """Whether the default group can have NCCL work in flight. By the backend config, not
    get_backend(): a group Accelerate initialised without a backend reads "undefined" but is gloo."""
    import torch

    return "nccl" in str(dist.get_backend_config()) and torch.cuda.is_available()


def set_collective_timeout(seconds: float) -> None:
    """Every process group's collective timeout (the default group's and DeepSpeed's own), for the
    phases from here on: after training the watchdog's limits end a stuck rank cleanly
    (finetune/launch/peers.py), so the backend's own timeout, which raises deep inside a collective
    (gloo) or aborts the process (NCCL), is set past the longest of them."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timedelta(seconds=seconds), group)

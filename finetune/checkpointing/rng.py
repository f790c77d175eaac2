"""Random-number streams of a checkpoint resumed under another world size: new rank r continues old
rank r's stream where there was one, the others keep the seeded state of a fresh start (recorded
as run.json `resumes[].rng`; docs/faults.md). Per-rank streams cannot follow a world-size change
anyway: the micro-batches land on other ranks.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

log = logging.getLogger("finetune")


def source_file(rank: int, old_world_size: int) -> str | None:
    """The RNG file of the old run whose stream new rank `rank` continues, or None."""
    if old_world_size == 1:
        return "rng_state.pth" if rank == 0 else None
    return f"rng_state_{rank}.pth" if rank < old_world_size else None


def restore(checkpoint: Path, *, rank: int, old_world_size: int) -> str | None:
    """Load the stream new rank `rank` continues from `checkpoint`; the file used, or None."""
    import numpy as np
    import torch
    from transformers.trainer_pt_utils import safe_globals

    name = source_file(rank, old_world_size)
    path = Path(checkpoint) / name if name else None
    if path is None or not path.is_file():
        log.info(
            "rank %d: no RNG stream to continue in %s (old world size %d); keeps the seeded state",
            rank,
            checkpoint,
            old_world_size,
        )
        return None
    with safe_globals():  # numpy's state objects allow-listed, as Trainer loads the file
        state = torch.load(path, weights_only=True)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and state.get("cuda") is not None:
        saved = state["cuda"]
        # A list (DDP: every visible device) or one state; the old rank used device rank % count.
        device_state = saved[rank % len(saved)] if isinstance(saved, (list, tuple)) else saved
        try:
            torch.cuda.set_rng_state(device_state, device=torch.cuda.current_device())
        except RuntimeError as e:  # never fatal: the losses do not depend on it without dropout
            log.warning("rank %d: CUDA RNG state from %s not restored: %s", rank, path, e)
    return name

"""Random-number streams of a checkpoint resumed under another world size.

Trainer saves one RNG file per rank, `rng_state_{rank}.pth` with more than one process and
`rng_state.pth` with one (python, numpy, CPU and accelerator states; transformers 5.23
trainer.py `_save_rng_state`), and on resume reads the file of its own rank and layout
(`_load_rng_state`). Under another world size that file is often absent: 2 -> 1 looks for
`rng_state.pth`, 1 -> 2 for `rng_state_1.pth` on rank 1, and Trainer then says so only at info
level, which a finetune run does not show. Across a world-size change the per-rank streams
cannot reproduce the uninterrupted run anyway (the micro-batches land on other ranks), so the
rule here is explicit and recorded (run.json `resumes[].rng`):

* new rank r continues the stream of old rank r when the old run had one (`rng_state.pth` is old
  rank 0's when it ran alone); its python, numpy and CPU states, and the accelerator state of
  the device it used (Trainer saved every visible device's under DDP; `set_rng_state_all` with
  another device count fails, trainer_pt_utils.py `set_rng_state_for_device`);
* a new rank without such a stream keeps the state the run set up from `training.seed`, as a
  fresh run does; old ranks >= the new world size are not continued.

Nothing in the shipped recipes draws from these streams during training (LoRA dropout 0; the
sampler has its own seeded generator), which is why the losses continue exactly; with dropout
> 0 they continue statistically, not bitwise (said on the console by resume_plan).
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
        log.info("rank %d: no RNG stream to continue in %s (old world size %d); keeps the seeded state",
                 rank, checkpoint, old_world_size)
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

"""Running DDP, DeepSpeed ZeRO and FSDP2 for real on a machine without a GPU (2 processes, gloo).

Why this exists: on a CPU-only machine `accelerate launch` silently runs something other than
what the config asks for (accelerate 1.15):

* torchrun / DeepSpeed launches (distributed_type MULTI_GPU, DEEPSPEED, FSDP) do not pass the
  config's `use_cpu` to the processes. `PartialState()` then finds no GPU, sets
  DistributedType.NO and num_processes 1: two independent single-process runs.
  (finetune.strategy.check_world_size refuses that.)
* With `cpu=True` the processes do join over gloo (DistributedType.MULTI_CPU), DeepSpeed is
  kept (AcceleratorState only needs `cpu=False` there, which Trainer passes), but
  `AcceleratorState.__init__` (accelerate/state.py, the `elif self.distributed_type in
  [MULTI_GPU, MULTI_NPU, ...]` branch) only switches to DistributedType.FSDP for accelerator
  device types: MULTI_CPU is not in that list, so an FSDP launch trains as plain DDP.

The opt-in is explicit: set FINETUNE_CPU_DISTRIBUTED=1 on the launch line together with one
of accelerate_configs/cpu/*.yaml:

    FINETUNE_CPU_DISTRIBUTED=1 accelerate launch --config_file accelerate_configs/cpu/fsdp.yaml \
        finetune/train.py --recipe fsdp

(A recipe that sets up its strategy itself with ONE process on a machine without CUDA joins gloo
without the variable: there are no lone processes to guard against; finetune/launch/strategy_setup.py.)

It then (1) makes every process join the gloo group (`PartialState(cpu=True)` and
TrainingArguments.use_cpu=True) and (2) applies Accelerate's own FSDP branch when it was skipped
only because the device is a CPU (with FSDP offload, unpinned host memory: pinning needs an accelerator). torch's `fully_shard` runs on CPU over gloo, so the FSDP2
code users run on GPUs (Accelerate's fsdp2_prepare_model, DTensor parameters, sharded and
full state dicts) is what gets exercised. Nothing else changes; without the variable this module
does nothing, and finetune.strategy still verifies from the live model what engaged.
"""

from __future__ import annotations

import functools
import inspect
import os

ENV = "FINETUNE_CPU_DISTRIBUTED"


def requested() -> bool:
    """True when the launch opted in to CPU distributed training (FINETUNE_CPU_DISTRIBUTED=1)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def keep_fsdp_on_cpu() -> None:
    """Apply Accelerate's own FSDP branch where it skips it only because the device is a CPU; before
    Trainer builds its AcceleratorState. Idempotent."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        was_initialized = AcceleratorState._shared_state != {} and self.__class__ is AcceleratorState and \
            AcceleratorState._shared_state != PartialState._shared_state
        original(self, *args, **kwargs)
        if was_initialized:
            return
        fsdp_plugin = signature.bind(self, *args, **kwargs).arguments.get("fsdp_plugin")
        wants_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or fsdp_plugin is not None
        if self.distributed_type == DistributedType.MULTI_CPU and wants_fsdp and fsdp_plugin is not None:
            # The same three assignments Accelerate makes for accelerator devices.
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = self.distributed_type
            # Offload on CPU: pinned host memory needs an accelerator (torch raises "Cannot access
            # accelerator device"); the offload itself (sharded params + optimizer step on host) is unchanged.
            if getattr(fsdp_plugin.cpu_offload, "pin_memory", False):
                fsdp_plugin.cpu_offload.pin_memory = False

    AcceleratorState.__init__ = __init__

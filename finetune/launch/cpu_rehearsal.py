"""Running DDP, DeepSpeed ZeRO and FSDP2 for real on a machine without a GPU: two processes over gloo, opted in with
FINETUNE_CPU_DISTRIBUTED=1 and one of accelerate_configs/cpu/*.yaml (or `finetune train --cpu`). On CPU, Accelerate
would otherwise run lone processes, or FSDP as DDP (docs/preflight.md "CPU rehearsal").
"""

from __future__ import annotations

import functools
import inspect
import os

ENV = "FINETUNE_CPU_DISTRIBUTED"


def requested() -> bool:
    """True when the launch opted in to CPU distributed training (FINETUNE_CPU_DISTRIBUTED=1)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def without_opt_in(env=os.environ) -> dict:
    """`env` less the opt-in, for a child `finetune` command: `finetune train --cpu` and `bench-comm
    --cpu` set it from their own launch, and a value inherited from the caller would force it on
    single-process runs too."""
    return {k: v for k, v in env.items() if k != ENV}


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
        was_initialized = (
            AcceleratorState._shared_state != {}
            and self.__class__ is AcceleratorState
            and AcceleratorState._shared_state != PartialState._shared_state
        )
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

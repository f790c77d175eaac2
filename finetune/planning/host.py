"""Host memory (resident set) of one training process.

A GPU run's process: the CUDA process base (Python, torch with its CUDA libraries, transformers,
accelerate, peft, deepspeed, the CUDA context's host side, cuBLAS/cuDNN/NCCL host state, the heap
left after loading) plus what the strategy keeps on the host: offloaded optimizer states, master
copies, gradient partitions and parameters. Pinned buffers go through torch's CachingHostAllocator,
which rounds every allocation up to a power of two (aten/src/ATen/core/CachingHostAllocator.h
allocate: c10::llvm::PowerOf2Ceil), so a 4.6 GiB pinned fp32 master costs 8 GiB.

A CPU run's process holds everything: the CPU process base + the step's peak live set (the
device arithmetic of finetune/planning/memory.py without cuBLAS workspaces) + host states.
"""

from __future__ import annotations

import math

from finetune.strategies import by_key
from finetune.units import GIB

# FITTED: the median training-peak RSS of rank 0 in the six H200 records of 2026-11-22
# (memory.max.host_peak_rss_gib: 1.81 2.16 2.19 2.20 2.46 2.50 GiB; psutil RSS sampled after every
# micro-step). One constant for every GPU run; its parts are not measured separately (the GPU
# check in docs/planning.md decomposes it).
HOST_CUDA_PROCESS_BASE_GIB = 2.2
# MEASURED here: psutil RSS of a Python process after importing torch (CPU build), transformers,
# accelerate, peft and deepspeed (0.53 GiB, torch 2.13, transformers 5.23).
HOST_CPU_PROCESS_BASE_GIB = 0.55
# DeepSpeed offload buffers pinned when `pin_memory: true` (the shipped offload configs): ZeRO-1/2's
# fp32 master partition and its gradient (stage_1_and_2.py initialize_optimizer_states), its bit16
# partition and host staging buffer; ZeRO-3's grad_partitions_flat_buffer, each sub-group's fp32
# gradient and its offloaded parameter partition (stage3.py _unpin_offload_buffers lists them; its
# fp32 master is a pageable .to("cpu").clone(), _create_fp32_partitions). CPU-Adam's two states are
# plain zeros_like (pageable). FSDP2 CPUOffloadPolicy(pin_memory=True) pins each parameter shard and
# gradient separately.
PINNED_KEYS = {
    "master_weights",
    "fp32_grad_partition",
    "bit16_partition_buffer",
    "offload_grad_staging",
    "grad_partition_buffer",
    "weights",
    "lora_adapters",
    "frozen_weights",
    "nf4_weights",
    "unquantized_weights",
    "gradients",
}


def pinned(key: str, strategy: str) -> bool:
    """Whether an offload run pins the host component `key` of `strategy` (the shipped pin_memory)."""
    return key in PINNED_KEYS and not (key == "master_weights" and by_key(strategy).zero_stage == 3)


def pinned_size(nbytes: float) -> float:
    """What CachingHostAllocator takes for one pinned buffer of `nbytes`."""
    if nbytes <= 0:
        return 0.0
    return float(2 ** math.ceil(math.log2(nbytes)))


def host_components(
    host_states: dict,
    strategy: str,
    *,
    on_gpu: bool,
    param_numels: list[int],
    n: int,
    sub_group_bytes: float | None = None,
) -> dict:
    """Bytes per component of one process's host memory, the process base included.
    `param_numels`: the model's parameter tensors (FSDP2 pins each shard separately);
    `sub_group_bytes`: ZeRO-3's sub_group_size in bytes of the fp32 gradient (one pinned buffer each)."""
    st = by_key(strategy)
    out = {"process_base": (HOST_CUDA_PROCESS_BASE_GIB if on_gpu else HOST_CPU_PROCESS_BASE_GIB) * GIB}
    for key, value in host_states.items():
        if not value:
            continue
        if not on_gpu or not pinned(key, strategy):  # CPU runs pin nothing (cpu rehearsal configs)
            out[key] = value
        elif st.zero_stage == 3 and key == "fp32_grad_partition" and sub_group_bytes:
            # sub-groups end at parameter boundaries past sub_group_size: taken as equal chunks
            full, rest = divmod(value, sub_group_bytes)
            out[key] = full * pinned_size(sub_group_bytes) + pinned_size(rest)
        elif st.zero_stage is not None:
            out[key] = pinned_size(value)  # one flat buffer per parameter group; the main group dominates
        else:  # FSDP2: every parameter's shard is its own pinned tensor
            per_element = value / (sum(param_numels) / n)
            out[key] = sum(pinned_size(numel / n * per_element) for numel in param_numels)
    return out

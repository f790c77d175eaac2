"""The machine a run ran on: package versions, devices and memory, GPU interconnect (run.json
`versions` and `hardware`).
"""

from __future__ import annotations

import os
import platform
from importlib import metadata

from finetune.units import GIB

PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "peft", "bitsandbytes", "datasets", "finetune")


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def hardware() -> dict:
    import psutil
    import torch

    host = psutil.virtual_memory().total / GIB
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return {
            "device_type": "cuda",
            "device_name": props.name,
            "devices": torch.cuda.device_count(),
            "device_memory_gib": round(props.total_memory / GIB, 2),
            "host_memory_gib": round(host, 2),
            "interconnect": interconnect(),
        }
    return {
        "device_type": "cpu",
        "device_name": platform.processor() or platform.machine(),
        "devices": 1,
        "device_memory_gib": None,
        "host_memory_gib": round(host, 2),
        "interconnect": None,
        "cpu_count": os.cpu_count(),
    }


def interconnect() -> dict | None:
    """GPU-to-GPU links: NVLink counts per device pair from NVML when nvidia-ml-py is installed,
    else whether CUDA peer access works (P2P over NVLink or PCIe). None with fewer than 2 GPUs."""
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        return None
    out = {
        "peer_access": {
            f"{i}-{j}": torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i < j
        },
        "nvlink_active_links": None,
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        links = {}
        for i in range(n):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            active = 0
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    active += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
                except pynvml.NVMLError:
                    break
            links[str(i)] = active
        out["nvlink_active_links"] = links
    except Exception as e:  # NVML absent or unsupported: say so, the P2P answer still stands
        out["nvml_error"] = f"{type(e).__name__}: {e}"
    return out

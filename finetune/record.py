"""The run record, `<output_dir>/run.json`: the contract between training, reports and tests.

Field names and meanings are fixed by shared/DESIGN.md ("The run record"). Rank 0 writes it
atomically (temporary file + rename) so a reader never sees half a record; `status` says
whether the run is running, completed, interrupted or failed.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from finetune.units import GIB

SCHEMA = 1
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
        return {"device_type": "cuda", "device_name": props.name, "devices": torch.cuda.device_count(),
                "device_memory_gib": round(props.total_memory / GIB, 2), "host_memory_gib": round(host, 2),
                "interconnect": interconnect()}
    return {"device_type": "cpu", "device_name": platform.processor() or platform.machine(),
            "devices": 1, "device_memory_gib": None, "host_memory_gib": round(host, 2),
            "interconnect": None, "cpu_count": os.cpu_count()}


def interconnect() -> dict | None:
    """GPU-to-GPU links: NVLink counts per device pair from NVML when nvidia-ml-py is installed,
    else whether CUDA peer access works (P2P over NVLink or PCIe). None with fewer than 2 GPUs."""
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        return None
    out = {"peer_access": {f"{i}-{j}": torch.cuda.can_device_access_peer(i, j)
                           for i in range(n) for j in range(n) if i < j}, "nvlink_active_links": None}
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


class RunRecord:
    """Holds the record in memory; `write()` persists it (call on rank 0 only)."""

    def __init__(self, path: Path, *, run_name: str, recipe: str, config: dict):
        self.path = Path(path)
        self.data: dict = {
            "schema": SCHEMA,
            "run_name": run_name,
            "recipe": recipe,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "config": config,
            "versions": versions(),
            "hardware": hardware(),
            "strategy": None,
            "batch": None,
            "lr": None,
            "memory": None,
            "predicted_memory": None,
            "throughput": None,
            "data": None,
            "steps": [],
            "summary": {"train_loss": None, "eval_loss": None, "total_trained_tokens": None,
                        "wall_s": None, "steps": 0, "status": "running", "error": None},
            "eval": {},
        }

    def __getitem__(self, key):
        return self.data[key]

    def __setitem__(self, key, value):
        self.data[key] = value

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".run.json.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.data, f, indent=2, default=str)
                f.write("\n")
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def load(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)

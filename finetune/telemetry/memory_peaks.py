"""Memory peaks of one process since the last reset: accelerator (torch.cuda.memory_stats) and host,
by the kernel's resident-set high-water mark where it can be reset (`vmhwm`, Linux), else sampled
RSS (`sampled`; docs/run_record.md `memory.host_peak_method`). The reset also resets getrusage's
ru_maxrss, so the lifetime peak is kept here.
"""

from __future__ import annotations

import re
import resource
import sys
from pathlib import Path

import psutil
import torch

from finetune.units import GIB

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def host_rss() -> int:
    return psutil.Process().memory_info().rss


def vmhwm() -> int | None:
    """The kernel's RSS high-water mark of this process in bytes, or None where there is none."""
    try:
        match = re.search(r"^VmHWM:\s+(\d+)\s+kB", STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def reset_vmhwm() -> bool:
    """Reset the high-water mark to the current RSS; False where the kernel does not allow it."""
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def ru_maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


class MemoryTracker:
    """Peaks on this rank since the last reset (see the module docstring for the host method)."""

    def __init__(self, method: str | None = None):
        self.cuda = torch.cuda.is_available()
        self.lifetime_host_peak = ru_maxrss_bytes()  # before any reset: the kernel's lifetime figure
        if method is None:
            method = "vmhwm" if vmhwm() is not None and reset_vmhwm() else "sampled"
        self.method = method  # "vmhwm" or "sampled"
        self.host_peak = host_rss()

    def sample(self) -> None:
        """Between micro-steps: only the sampling method needs it (the kernel's mark misses nothing)."""
        if self.method == "sampled":
            self.host_peak = max(self.host_peak, host_rss())

    def host_peak_now(self) -> int:
        """The host peak since the last reset, in bytes."""
        if self.method == "vmhwm":
            mark = vmhwm()
            if mark is not None:
                self.host_peak = max(self.host_peak, mark)
        else:
            self.host_peak = max(self.host_peak, host_rss())
            # never reset under this method: the kernel's lifetime figure still holds
            self.lifetime_host_peak = max(self.lifetime_host_peak, ru_maxrss_bytes())
        self.lifetime_host_peak = max(self.lifetime_host_peak, self.host_peak)
        return self.host_peak

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        if self.method == "vmhwm":
            self.lifetime_host_peak = max(self.lifetime_host_peak, vmhwm() or 0)
            reset_vmhwm()
        self.host_peak = host_rss()

    def snapshot(self) -> dict:
        out = {
            "device_peak_allocated_gib": None,
            "device_peak_reserved_gib": None,
            "device_peak_active_gib": None,
            "host_peak_rss_gib": round(self.host_peak_now() / GIB, 4),
            "alloc_retries": None,
            "ooms": None,
        }
        if self.cuda:
            s = torch.cuda.memory_stats()
            out.update(
                device_peak_allocated_gib=round(s.get("allocated_bytes.all.peak", 0) / GIB, 4),
                device_peak_reserved_gib=round(s.get("reserved_bytes.all.peak", 0) / GIB, 4),
                device_peak_active_gib=round(s.get("active_bytes.all.peak", 0) / GIB, 4),
                alloc_retries=s.get("num_alloc_retries", 0),
                ooms=s.get("num_ooms", 0),
            )
        return out

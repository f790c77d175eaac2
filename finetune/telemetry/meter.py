"""The meter: counters, step clock and memory peaks of one training process (see MemoryTracker).
"""

from __future__ import annotations

import psutil
import torch

from finetune.units import GIB


def host_rss() -> int:
    return psutil.Process().memory_info().rss


class MemoryTracker:
    """Peaks on this rank since the last reset: accelerator (torch.cuda.memory_stats) and host RSS.
    Host RSS is sampled (at every micro-step) because the OS peak cannot be reset."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.host_peak = host_rss()

    def sample(self) -> None:
        self.host_peak = max(self.host_peak, host_rss())

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.host_peak = host_rss()

    def snapshot(self) -> dict:
        self.sample()
        out = {"device_peak_allocated_gib": None, "device_peak_reserved_gib": None,
               "device_peak_active_gib": None, "host_peak_rss_gib": round(self.host_peak / GIB, 4),
               "alloc_retries": None, "ooms": None}
        if self.cuda:
            s = torch.cuda.memory_stats()
            out.update(device_peak_allocated_gib=round(s.get("allocated_bytes.all.peak", 0) / GIB, 4),
                       device_peak_reserved_gib=round(s.get("reserved_bytes.all.peak", 0) / GIB, 4),
                       device_peak_active_gib=round(s.get("active_bytes.all.peak", 0) / GIB, 4),
                       alloc_retries=s.get("num_alloc_retries", 0), ooms=s.get("num_ooms", 0))
        return out

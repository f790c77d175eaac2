"""Units of memory and bandwidth, defined once.

GiB (2^30 bytes) for memory, as torch.cuda.memory_stats reports it; GB (1e9 bytes) where the convention is decimal:
nccl-tests report bandwidth in GB/s of 1e9 bytes/s, and the ZeRO paper's model-state figures are 1e9-byte GB.
"""

from __future__ import annotations

import re

from finetune.errors import UserError

GIB = 2**30
MIB = 2**20
KIB = 2**10
GB = 1e9

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(gib|gb|mib|mb|kib|kb|g)?\s*$", re.IGNORECASE)
_UNIT_BYTES = {"gib": GIB, "g": GIB, "gb": GB, "mib": MIB, "mb": 1e6, "kib": KIB, "kb": 1e3}


def gib(n_bytes: float) -> float:
    """Bytes -> GiB, rounded to 4 decimals (0.1 MiB): the precision run.json and plans report."""
    return round(n_bytes / GIB, 4)


def parse_size(text: str, what: str) -> float:
    """'24GiB' / '24GB' / '24' (GiB) / '64KiB' -> bytes; a UserError naming `what` otherwise."""
    m = _SIZE.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"{what}: {text!r} is not a memory size; use e.g. 24GiB, 80GB or 24 (GiB)")
    return float(m.group(1)) * _UNIT_BYTES[(m.group(2) or "gib").lower()]

"""docs/run_record.md read back: its field rows (path -> the `present` column), and a check of a
real record against them both ways. Shared by the unit test of the declarations and the test
on a real run."""

from __future__ import annotations

import re
from pathlib import Path

from finetune.telemetry import record

DOC = Path(__file__).resolve().parents[2] / "docs" / "run_record.md"
_ROW = re.compile(r"^\| `([^`]+)` \| [^|]+ \| [^|]+ \| ([^|]+) \|")


def documented() -> dict[str, str]:
    """field path -> its `present` column, for every row of the doc's field tables."""
    out = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = _ROW.match(line)
        if m:
            assert m.group(1) not in out, f"{m.group(1)} documented twice"
            out[m.group(1)] = m.group(2).strip()
    return out


def values_at(record, pattern: str) -> list:
    """Every value the path pattern names in `record` (`[]` every list entry, `*` every key)."""
    values = [record]
    for part in pattern.split("."):
        entries = part.endswith("[]")
        key = part.removesuffix("[]")
        nxt = []
        for v in values:
            if not isinstance(v, dict):
                continue
            children = list(v.values()) if key == "*" else [v[key]] if key in v else []
            for c in children:
                nxt.extend(c if entries and isinstance(c, list) else [] if entries else [c])
        values = nxt
    return values


def missing_always_fields(record: dict, doc: dict[str, str]) -> list[str]:
    """Fields documented `always` that are absent from an object of the record that should hold
    them (the enclosing object is there and not null; mapping keys `*` and `**` are not fields)."""
    missing = []
    for path, present in doc.items():
        if present != "always" or path.endswith(("*", "**")):
            continue
        parent, _, name = path.rpartition(".")
        parents = values_at(record, parent) if parent else [record]
        if any(isinstance(p, dict) and name not in p for p in parents):
            missing.append(path)
    return missing


def undocumented(rec: dict, doc: dict[str, str]) -> list[str]:
    """Fields present in the record that no row of the doc names."""
    return sorted(p for p in record.paths_of(rec) if not any(record.covers(d, p) for d in doc))

"""docs/run_record.md read back: its field rows (path -> the `present` column), and a check of a
real record against them both ways. Shared by the unit test of the declarations and the test
on a real run."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

from finetune.telemetry import record

DOC = Path(__file__).resolve().parents[2] / "docs" / "run_record.md"
_ROW = re.compile(r"^\| `([^`]+)` \| [^|]+ \| [^|]+ \| ([^|]+) \|")


def documented(text: str | None = None) -> dict[str, str]:
    """field path -> its `present` column, for every row of the doc's field tables (`text`: the doc's, by default)."""
    out = {}
    for line in (DOC.read_text(encoding="utf-8") if text is None else text).splitlines():
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
    return sorted(p for p in paths_of(rec) if not any(covers(d, p) for d in doc))


# --- the record's paths ---------------------------------------------------------------------------
# Paths name nodes of the record: `memory.per_rank[].rank` (a field of every list entry),
# `predicted_memory.device.components_gib.*` (any key of a mapping), `config.**` (anything below).


def declared_paths() -> set[str]:
    """Every node the schema declares, in the path notation above (docs/run_record.md uses it)."""
    out: set[str] = set()
    for s in record.SECTIONS:
        _declare(s.shape, s.name, out)
    return out


def paths_of(record: dict) -> set[str]:
    """Every node present in a record (null values included, as leaves), in the same notation."""
    out: set[str] = set()

    def walk(value, path):
        out.add(path)
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}")
        elif isinstance(value, list):
            for v in value:
                if isinstance(v, dict):
                    walk(v, f"{path}[]")
            out.discard(f"{path}[]")

    for key, value in record.items():
        walk(value, key)
    return out


def _declare(hint, path: str, out: set[str]) -> None:
    out.add(path)
    hint = record.unwrap(hint)
    fields = record.typed_fields(hint)
    if fields is not None:
        for key, sub in fields.items():
            _declare(sub, f"{path}.{key}", out)
        return
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list and args and (record.typed_fields(record.unwrap(args[0])) is not None):
        _declare(args[0], f"{path}[]", out)
        out.discard(f"{path}[]")
    elif origin is dict and len(args) == 2:
        if args[1] is Any:
            out.add(f"{path}.**")
        else:
            _declare(args[1], f"{path}.*", out)


def covers(pattern: str, path: str) -> bool:
    """Whether a declared path (with `*` / `**`) names a present node's path."""
    want, got = pattern.split("."), path.split(".")
    for i, part in enumerate(want):
        if part == "**" or (part == "*" and i == len(want) - 1 and len(got) > i):
            return len(got) > i  # a last `*` is one mapping key, which may hold dots (a file name: inputs.*_files)
        if i >= len(got) or (part != "*" and part != got[i]):
            return False
    return len(got) == len(want)

"""The run record, `<output_dir>/run.json`: its one owner. docs/run_record.md is the contract.

Sections are computed by pure functions and handed to the run's sinks (finetune/telemetry/sinks.py), which keep them in
a `RunRecord`; the RunJson sink alone saves it. A field not declared in finetune/telemetry/record_schema.py is refused
there and then. Readers go through `RecordView.get(section, *keys)`, which treats a null or missing value as absent and
refuses a path the schema does not declare (a typo is a bug, not a silent None).
"""

from __future__ import annotations

import json
import os
import platform
import types
import typing
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from finetune.telemetry.record_schema import ABSENT, SCHEMA, SECTIONS
from finetune.units import GIB

__all__ = ["SCHEMA", "RecordView", "RunRecord", "check", "load", "typed_fields", "unwrap"]


class RunRecord:
    """The record in memory (rank 0), and where it is saved (by the RunJson sink alone)."""

    def __init__(self, path: Path, *, run_name: str, recipe: str, config: dict):
        self.path = Path(path)
        given = {
            "run_name": run_name,
            "recipe": recipe,
            "config": config,
            "versions": versions(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "hardware": hardware(),
        }
        self.data: dict = {
            s.name: given[s.name] if s.name in given else s.initial()
            for s in SECTIONS
            if s.name in given or s.initial is not ABSENT
        }

    @property
    def view(self) -> RecordView:
        return RecordView(self.data)

    def set(self, section: str, value: Any) -> None:
        """Replace a section (a new one is appended, as it first appears in run.json)."""
        _validate(value, _section(section).shape, section)
        self.data[section] = value

    def update(self, section: str, **fields: Any) -> None:
        """Set some fields of an object section (summary, batch, ...), keeping the others."""
        shape = unwrap(_section(section).shape)
        hints = typed_fields(shape)
        for key, value in fields.items():
            if hints is not None and key not in hints:
                raise _undeclared(section, [key])
            _validate(value, hints[key] if hints else Any, f"{section}.{key}")
        self.data[section].update(fields)

    def add_step(self, entry: dict) -> None:
        """Append one logged step to `steps`."""
        _validate([entry], _section("steps").shape, "steps")
        self.data["steps"].append(entry)


class RecordView:
    """Read access to a record (as loaded from run.json, or a RunRecord's data)."""

    def __init__(self, data: dict):
        self.data = data

    def get(self, section: str, *keys, default=None):
        """data[section][key]...: `default` where any step is null or missing. The path must be
        one the schema declares (free-form mappings such as `config` are not checked inside)."""
        _check_path(section, keys)
        value = self.data
        for key in (section, *keys):
            if not isinstance(value, dict):
                return default
            value = value.get(key)
        return default if value is None else value

    @property
    def status(self) -> str:
        return self.get("summary", "status") or "unknown"

    def set_outcome(self, status: str, error: str | None) -> None:
        """A reader's own verdict on this record, in memory only (a sweep run that completed but
        not as planned is compared as failed; the record on disk stays the run's)."""
        self.data["summary"]["status"] = status
        self.data["summary"]["error"] = error


def load(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def check(record) -> str | None:
    """Why `record` (a parsed run.json) is not a usable schema-1 record, or None: another schema, a section it needs
    missing, or a value of another type than the schema declares (a string where a number goes: an edited or
    damaged record), named by its path in run.json. Fields the schema does not know, null ones and those a record
    written before they existed lacks are no problem: readers say n/a."""
    if not isinstance(record, dict):
        return f"not a run record (top level is {type(record).__name__}, expected an object)"
    schema = record.get("schema")
    if schema != SCHEMA:
        return (
            f"run record schema {schema!r} is not supported (this finetune reads schema {SCHEMA}); "
            f"re-run it with this version, or compare it with the finetune version that wrote it"
        )
    missing = [s.name for s in SECTIONS if s.required and s.name not in record]
    if missing:
        return f"schema-1 record without {', '.join(missing)} (incomplete or from an older development version)"
    for s in SECTIONS:
        value = record.get(s.name)
        if value is None and s.required and s.kind != "object|null":  # the run's name, its summary, ...
            wrong = f"{s.name}: expected {_json_type(s.shape)}, got null"
        else:
            wrong = mistyped(value, s.shape, s.name)
        if wrong:
            return f"{wrong} (the file was edited or damaged; docs/run_record.md declares each field)"
    return None


JSON_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object"}


def mistyped(value, hint, where: str) -> str | None:
    """'<where>: expected <type>, got <value>' for the first value in `value` whose type is not the declared `hint`'s
    (a TypedDict's fields, list entries and mapping values too), or None. A JSON integer is a number; a null is an
    absent value, as RecordView reads it."""
    if value is None or hint is Any or hint is object:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if any(mistyped(value, arm, where) is None for arm in args):
            return None
        inner = [arm for arm in args if _container(arm) is not None and isinstance(value, _container(arm))]
        if inner:  # the right container with a wrong value inside: name that value
            return mistyped(value, inner[0], where)
        return f"{where}: expected {' or '.join(_json_type(a) for a in args)}, got {_got(value)}"
    container = _container(hint)
    if container is not None and not isinstance(value, container):
        return f"{where}: expected {_json_type(hint)}, got {_got(value)}"
    fields = typed_fields(hint)
    if fields is not None:
        inside = ((f"{where}.{k}", v, fields[k]) for k, v in value.items() if k in fields)
    elif origin is list and args:
        inside = ((f"{where}[{i}]", v, args[0]) for i, v in enumerate(value))
    elif origin is dict and len(args) == 2:
        inside = ((f"{where}.{k}", v, args[1]) for k, v in value.items())
    elif container is not None:
        return None
    elif isinstance(value, bool) != (hint is bool) or not isinstance(value, (int, float) if hint is float else hint):
        return f"{where}: expected {_json_type(hint)}, got {_got(value)}"
    else:
        return None
    return next((wrong for w, v, h in inside if (wrong := mistyped(v, h, w))), None)


def _container(hint) -> type | None:
    """dict or list when `hint` declares an object or a list (a JSON array is a list, a tuple's too), else None."""
    if typed_fields(hint) is not None or hint is dict or typing.get_origin(hint) is dict:
        return dict
    if hint in (list, tuple) or typing.get_origin(hint) in (list, tuple):
        return list
    return None


def _json_type(hint) -> str:
    if hint is type(None):
        return "null"
    return "a list" if _container(hint) is list else JSON_TYPES.get(_container(hint) or hint, str(hint))


def _got(value) -> str:
    text = json.dumps(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return text if value is None else f"{type(value).__name__} {text}"


# --- the machine a run ran on: run.json `versions` and `hardware` -----------------------------

PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "peft", "bitsandbytes", "datasets", "finetune")


def versions() -> dict:
    return {"python": platform.python_version(), **{name: installed_version(name) for name in PACKAGES}}


def installed_version(name: str) -> str | None:
    """The installed distribution's version; None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


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


# --- the declared shape --------------------------------------------------------------------


def _section(name: str):
    by_name = {s.name: s for s in SECTIONS}
    if name not in by_name:
        raise KeyError(
            f"run.json has no section {name!r} (declared: {', '.join(by_name)}; finetune/telemetry/record_schema.py)"
        )
    return by_name[name]


def unwrap(hint):
    """X | None -> X (the value may be null; its shape is X's)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(hint) if a is not type(None)]
        return arms[0] if len(arms) == 1 else Any
    return hint


def typed_fields(hint) -> dict | None:
    """A TypedDict's field -> type hints, or None for anything else."""
    if isinstance(hint, type) and typing.is_typeddict(hint):
        return typing.get_type_hints(hint)
    return None


def _undeclared(where: str, keys) -> ValueError:
    return ValueError(
        f"run.json {where}: field(s) {', '.join(map(repr, sorted(keys)))} not declared in "
        f"finetune/telemetry/record_schema.py; declare them there and in docs/run_record.md"
    )


def _validate(value, hint, where: str) -> None:
    """Refuse fields the schema does not declare (types are the writers' business)."""
    hint = unwrap(hint)
    if value is None:
        return
    fields = typed_fields(hint)
    if fields is not None and isinstance(value, dict):
        extra = set(value) - set(fields)
        if extra:
            raise _undeclared(where, extra)
        for key, item in value.items():
            _validate(item, fields[key], f"{where}.{key}")
        return
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list and args and isinstance(value, list):
        for item in value:
            _validate(item, args[0], f"{where}[]")
    elif origin is dict and len(args) == 2 and isinstance(value, dict):
        for key, item in value.items():
            _validate(item, args[1], f"{where}.{key}")


def _check_path(section: str, keys) -> None:
    hint = _section(section).shape
    where = section
    for key in keys:
        hint = unwrap(hint)
        fields = typed_fields(hint)
        if fields is not None:
            if key not in fields:
                raise KeyError(f"run.json {where} has no field {key!r} (finetune/telemetry/record_schema.py)")
            hint = fields[key]
        elif typing.get_origin(hint) is dict and len(typing.get_args(hint)) == 2:
            if typing.get_args(hint)[1] is Any:
                return  # free-form below here
            hint = typing.get_args(hint)[1]
        else:
            return
        where = f"{where}.{key}"

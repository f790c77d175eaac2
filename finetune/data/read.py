"""Reading training data: a local .json/.jsonl/.csv/.parquet file or a Hub dataset name -> rows.

Each row keeps its 1-based number so every error can point at it (`DataError` names the file
and the row); a row that cannot even be read as an object comes back as `Invalid` in its place,
so `on_bad_rows: skip` can skip it and numbering survives.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass
from typing import Any

from finetune.errors import UserError

LOCAL_EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet")


class DataError(UserError):
    """User-facing data problem; the message names the file, the 1-based row and what is wrong.

    Subclasses ``finetune.errors.UserError`` so the CLI prints it without a traceback.
    """

    def __init__(self, message: str, *, path: str | None = None, row: int | None = None):
        self.detail = message
        self.path = path
        self.row = row
        where = path or ""
        if row is not None:
            where = f"{where} row {row}" if where else f"row {row}"
        super().__init__(f"{where}: {message}" if where else message)


@dataclass
class Invalid:
    """A row that could not even be read as an object; kept in place so numbering survives."""

    reason: str


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def is_local(path: str) -> bool:
    return (
        os.path.exists(path) or path.lower().endswith(LOCAL_EXTENSIONS) or path.startswith((".", "/", "~"))
    ) and not os.path.isdir(path)


def _read_bytes(path: str) -> bytes:
    if not os.path.exists(path):
        raise DataError("file not found", path=path)
    with open(path, "rb") as f:
        data = f.read()
    return check_bytes(data, path)


def check_bytes(data: bytes, path: str) -> bytes:
    if not data.strip():
        raise DataError("file is empty", path=path)
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):  # UTF-16/32 byte-order marks; otherwise "bad byte 0xff in row 1"
        raise DataError(
            f"is UTF-16 (or UTF-32) text, byte-order mark 0x{data[:2].hex()}; re-save the file as UTF-8", path=path
        )
    return data


def _decode(data: bytes, path: str, *, first_row_line: int = 1) -> str:
    """Decode a whole file; a bad byte is reported by line, row and byte offset."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        row = line - first_row_line + 1
        raise DataError(
            f"not valid UTF-8: byte 0x{data[e.start]:02x} at byte offset {e.start} (line {line}); "
            "re-save the file as UTF-8",
            path=path,
            row=row if row >= 1 else None,
        ) from None


def parse_json_lines(data: bytes) -> list[tuple[int, Any]]:
    # Decode line by line so that one bad line is one bad (skippable) row.
    rows: list[tuple[int, Any]] = []
    offset = 0
    for number, raw in enumerate(data.split(b"\n"), start=1):
        line_start, offset = offset, offset + len(raw) + 1
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw, line_start = raw[3:], line_start + 3
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            rows.append(
                (
                    number,
                    Invalid(
                        f"not valid UTF-8: byte 0x{raw[e.start]:02x} at byte offset {line_start + e.start}; "
                        "re-save the file as UTF-8"
                    ),
                )
            )
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            rows.append((number, Invalid(f"malformed JSON: {e.msg} (column {e.colno})")))
            continue
        rows.append((number, _object_or_invalid(value)))
    return rows


def _object_or_invalid(value: Any) -> Any:
    if isinstance(value, dict):
        return value
    return Invalid(f"expected a JSON object, got {type_name(value)}")


def _read_json(path: str) -> list[tuple[int, Any]]:
    data = _read_bytes(path)
    if not data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
        # Not an array: .json files holding JSON lines are common.
        rows = parse_json_lines(data)
        if rows and isinstance(rows[0][1], Invalid) and "malformed JSON" in rows[0][1].reason:
            _reject_single_document(data, path)
        return rows
    text = _decode(data, path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}", path=path) from None
    return [(i + 1, _object_or_invalid(v)) for i, v in enumerate(value)]


def _reject_single_document(data: bytes, path: str) -> None:
    """A pretty-printed single object fails as JSON lines; say what the real problem is."""
    try:
        value = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return
    if isinstance(value, dict):
        lists = [k for k, v in value.items() if isinstance(v, list)]
        hint = f" (its list-valued keys: {', '.join(lists)})" if lists else ""
        raise DataError(
            "is a single JSON object; expected an array of row objects or one object per line" + hint,
            path=path,
        )


def _read_csv(path: str) -> list[tuple[int, Any]]:
    text = _decode(_read_bytes(path), path, first_row_line=2)
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows: list[tuple[int, Any]] = []
    for number, record in enumerate(reader, start=1):
        if None in record:
            rows.append((number, Invalid(f"has {len(record[None])} more field(s) than the header")))
            continue
        # Short rows give None for the missing cells: treat those keys as absent.
        rows.append((number, {k: v for k, v in record.items() if v is not None}))
    return rows


def _read_parquet(path: str) -> list[tuple[int, Any]]:
    import pyarrow.parquet as pq

    _read_bytes(path)
    try:
        records = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DataError(f"cannot read as parquet: {e}", path=path) from None
    return [(i + 1, r) for i, r in enumerate(records)]


def _read_hub(name: str, split: str) -> list[tuple[int, Any]]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # network, auth, missing split, unknown name ...
        raise DataError(
            f"not a local file, and loading it as a Hugging Face Hub dataset (split {split!r}) failed: "
            f"{type(e).__name__}: {e}",
            path=name,
        ) from None
    return [(i + 1, r) for i, r in enumerate(ds)]


def read_numbered(path: str, *, split: str = "train") -> list[tuple[int, Any]]:
    """Rows with their 1-based numbers; unreadable rows come back as ``Invalid``."""
    if not is_local(path):
        rows = _read_hub(path, split)
    else:
        lower = path.lower()
        if lower.endswith(".jsonl"):
            rows = parse_json_lines(_read_bytes(path))
        elif lower.endswith(".json"):
            rows = _read_json(path)
        elif lower.endswith(".csv"):
            rows = _read_csv(path)
        elif lower.endswith(".parquet"):
            rows = _read_parquet(path)
        elif not os.path.exists(path):
            raise DataError("file not found", path=path)
        else:
            raise DataError(
                f"unsupported file extension {os.path.splitext(path)[1] or '(none)'!r}; "
                f"use one of {', '.join(LOCAL_EXTENSIONS)}",
                path=path,
            )
    if not rows:
        raise DataError("contains no rows", path=path)
    return rows


def read_rows(path: str, *, split: str = "train") -> list[dict]:
    """Local .json (array of objects, or JSON lines), .jsonl, .parquet, .csv -> list of dict rows.

    Anything else that is not an existing path is loaded with
    ``datasets.load_dataset(path, split=split)``. Any unreadable row raises ``DataError``
    naming the file and row; ``build_datasets`` can skip such rows instead.
    """
    rows = []
    for number, row in read_numbered(path, split=split):
        if isinstance(row, Invalid):
            raise DataError(row.reason, path=path, row=number)
        rows.append(row)
    return rows

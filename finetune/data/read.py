"""Reading training data: a local .json/.jsonl/.csv/.parquet file or a Hub dataset name -> rows.

Each row keeps its 1-based number so every error can point at it (`DataError` names the file
and the row); a row that cannot even be read as an object comes back as `Invalid` in its place,
so `on_bad_rows: skip` can skip it and numbering survives.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from finetune.data import files
from finetune.errors import UserError

LOCAL_EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet")  # each may end in .gz, .bz2 or .xz too

logger = logging.getLogger(__name__)


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
    """A path on this machine (anything else is a Hub dataset name). A directory, a dangling link
    or a FIFO counts as local: reading it says what it is (finetune/data/files.py)."""
    return (
        os.path.lexists(path) or files.format_name(path).endswith(LOCAL_EXTENSIONS) or path.startswith((".", "/", "~"))
    )


def _read_bytes(path: str) -> bytes:
    try:
        return check_bytes(files.read_bytes(path), path)
    except files.FileProblem as e:
        raise DataError(str(e), path=path) from None


def check_bytes(data: bytes, path: str) -> bytes:
    if not data.strip():
        raise DataError("file is empty" if not data else f"file is empty ({len(data)} bytes of blank space)", path=path)
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


def _read_json(path: str, *, lines: bool = False) -> list[tuple[int, Any]]:
    """A JSON array of objects, or JSON lines. `lines` (a .jsonl file): an array is accepted too
    (a pretty-printed array saved as .jsonl), but a file that is neither is reported line by line."""
    data = _read_bytes(path)
    if not looks_like_array(data):
        # Not an array: .json files holding JSON lines are common.
        rows = parse_json_lines(data)
        if rows and isinstance(rows[0][1], Invalid) and "malformed JSON" in rows[0][1].reason:
            _reject_single_document(data, path)
        return rows
    text = _decode(data, path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if lines:
            rows = parse_json_lines(data)
            if not (rows and isinstance(rows[0][1], Invalid)):
                return rows  # JSON lines whose first row is an array: reported as that row
        kind = "starts like a JSON array ('[') but is not one: " if lines else ""
        raise DataError(f"{kind}malformed JSON at line {e.lineno} column {e.colno}: {e.msg}", path=path) from None
    if lines:
        logger.info("%s: a JSON array, not JSON lines (one object per line); read as an array", path)
    return [(i + 1, _object_or_invalid(v)) for i, v in enumerate(value)]


def looks_like_array(data: bytes) -> bool:
    return data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


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

    why = files.problem(path) or ("file is empty" if os.path.getsize(path) == 0 else None)
    if why:
        raise DataError(why, path=path)
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
        name = files.format_name(path)
        if name.endswith((".jsonl", ".json")):
            rows = _read_json(path, lines=name.endswith(".jsonl"))
        elif name.endswith(".csv"):
            rows = _read_csv(path)
        elif name.endswith(".parquet"):
            rows = _read_parquet(path)
        else:
            why = files.problem(path)
            if why:
                raise DataError(why, path=path)
            raise DataError(
                f"unsupported file extension {os.path.splitext(path)[1] or '(none)'!r}; "
                f"use one of {', '.join(LOCAL_EXTENSIONS)} (optionally compressed: {', '.join(files.COMPRESSION_SUFFIXES)})",
                path=path,
            )
    if not rows:
        raise DataError("contains no rows", path=path)
    return rows


def read_head(path: str, max_rows: int, *, split: str = "train") -> tuple[list[tuple[int, Any]], bool]:
    """The first `max_rows` rows as `read_numbered` reads them, and whether they are the whole file.
    JSON lines are streamed with no byte limit (a first row of any size is read whole); an array
    saved as .jsonl and every other format are read whole."""
    if not (is_local(path) and files.format_name(path).endswith(".jsonl") and files.problem(path) is None):
        return _whole(path, max_rows, split)
    lines: list[bytes] = []
    complete, seen = True, 0
    try:
        with files.opened(path) as f:
            for line in f:
                if line.strip():
                    if seen == 0 and looks_like_array(line):
                        return _whole(path, max_rows, split)
                    seen += 1
                    if seen > max_rows:
                        complete = False
                        break
                lines.append(line)
    except files.FileProblem as e:
        raise DataError(str(e), path=path) from None
    except files.DAMAGED:  # a damaged compressed stream: read it whole, which says what
        _read_bytes(path)
        raise
    rows = parse_json_lines(check_bytes(b"".join(lines), path))
    if not rows:
        raise DataError("contains no rows", path=path)
    return rows, complete


def _whole(path: str, max_rows: int, split: str) -> tuple[list[tuple[int, Any]], bool]:
    rows = read_numbered(path, split=split)
    return rows[:max_rows], len(rows) <= max_rows


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

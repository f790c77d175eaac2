"""Reading training data: a local .json/.jsonl/.csv/.parquet/.arrow file, a `datasets`
save_to_disk folder or a Hub dataset name -> rows.

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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from finetune.data import files, formats
from finetune.data.formats import type_name
from finetune.errors import DataError

LOCAL_EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet", ".arrow")  # each may end in .gz, .bz2 or .xz too

logger = logging.getLogger(__name__)


@dataclass
class Invalid:
    """A row that could not even be read as an object; kept in place so numbering survives."""

    reason: str


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
    return [(number, parse_line(raw, start)) for number, raw, start in json_lines(data.split(b"\n"))]


def json_lines(lines) -> Iterator[tuple[int, bytes, int]]:
    """(1-based line number, the line's bytes, its byte offset) of each non-blank line; one bad line is
    one bad (skippable) row."""
    offset = 0
    for number, raw in enumerate(lines, start=1):
        raw = raw.rstrip(b"\n")
        line_start, offset = offset, offset + len(raw) + 1
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw, line_start = raw[3:], line_start + 3
        if raw.strip():
            yield number, raw, line_start


def parse_line(raw: bytes, line_start: int) -> Any:
    """One line of JSON lines: the row object, or `Invalid` saying why not."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Invalid(
            f"not valid UTF-8: byte 0x{raw[e.start]:02x} at byte offset {line_start + e.start}; re-save the file as UTF-8"
        )
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return Invalid(f"malformed JSON: {e.msg} (column {e.colno})")
    return _object_or_invalid(value)


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
        if len(rows) == 1 and isinstance(rows[0][1], dict):  # one line: a row, or an object holding the rows
            return listed_rows(rows[0][1], path) or rows
        if rows and isinstance(rows[0][1], Invalid) and "malformed JSON" in rows[0][1].reason:
            return _single_document(data, path) or rows
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


def _single_document(data: bytes, path: str) -> list[tuple[int, Any]] | None:
    """A pretty-printed single object fails as JSON lines: the rows of the one list it holds, or
    what the real problem is."""
    try:
        value = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(value, dict):
        return None
    rows = listed_rows(value, path)
    if rows is None:
        raise DataError("is a single JSON object; expected an array of row objects or one object per line", path=path)
    return rows


def listed_rows(value: dict, path: str) -> list[tuple[int, Any]] | None:
    """A top-level object that is not a row (no format's keys) but holds ONE list of rows, e.g.
    {"data": [...], "version": 2}: that list's rows (the key is logged); several lists are refused
    by name; None when it is a row, or holds no list."""
    lists = [k for k, v in value.items() if isinstance(v, list)]
    if any(all(k in value for k in f.keys) for f in formats.TABLE.values()) or not lists:  # a row of some format
        return None
    if len(lists) > 1:
        raise DataError(
            f"is a single JSON object holding several lists ({', '.join(lists)}); expected an array of row "
            "objects, one object per line, or an object holding one list of rows: keep the one to train on",
            path=path,
        )
    logger.info("%s: the rows are the list under the top-level key %r (%d rows)", path, lists[0], len(value[lists[0]]))
    return [(i + 1, _object_or_invalid(v)) for i, v in enumerate(value[lists[0]])]


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


def hub_dataset(name: str, split: str):
    import datasets

    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # network, auth, missing split, unknown name ...
        raise DataError(
            f"not a local file, and loading it as a Hugging Face Hub dataset (split {split!r}) failed: "
            f"{type(e).__name__}: {e}",
            path=name,
        ) from None


def arrow_source(path: str, split: str = "train"):
    """The `datasets.Dataset` of an Arrow source: a save_to_disk folder (a DatasetDict's `split`) or an
    .arrow file, memory-mapped; None for any other path (read row by row here)."""
    import datasets

    if os.path.isfile(os.path.join(path, "dataset_dict.json")) or os.path.isfile(os.path.join(path, "state.json")):
        try:
            ds = datasets.load_from_disk(path)
        except Exception as e:  # a damaged or partly copied folder
            raise DataError(
                f"cannot be read as a datasets save_to_disk folder: {type(e).__name__}: {e}", path=path
            ) from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"has no split {split!r}; its splits: {', '.join(ds)} (set data.split)", path=path)
            ds = ds[split]
        return ds
    if files.format_name(path).endswith(".arrow") and files.problem(path) is None:
        try:
            return datasets.Dataset.from_file(path)
        except Exception as e:  # not an Arrow stream file
            raise DataError(f"cannot be read as an Arrow file (datasets' format): {e}", path=path) from None
    return None


def read_numbered(path: str, *, split: str = "train") -> list[tuple[int, Any]]:
    """Rows with their 1-based numbers; unreadable rows come back as ``Invalid``."""
    source = arrow_source(path, split) if is_local(path) else hub_dataset(path, split)
    if source is not None:
        rows = [(i + 1, r) for i, r in enumerate(source)]
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
    rows: list[tuple[int, Any]] = []
    try:
        for number, raw, start in stream_json_lines(path):
            if len(rows) == max_rows:
                return rows, False
            rows.append((number, parse_line(raw, start)))
    except ReadWhole:
        return _whole(path, max_rows, split)
    if len(rows) == 1 and isinstance(rows[0][1], dict):  # maybe an object holding the rows
        return _whole(path, max_rows, split)
    return rows, True


class ReadWhole(Exception):
    """stream_json_lines: the file is not JSON lines after all (an array saved as .jsonl)."""


def stream_json_lines(path: str) -> Iterator[tuple[int, bytes, int]]:
    """`json_lines` of a .jsonl file, streamed: a big file is never held whole. Raises ReadWhole for an
    array saved as .jsonl (read_numbered reads it), DataError as read_numbered would."""
    seen = False
    try:
        with files.opened(path) as f:
            for number, raw, start in json_lines(f):
                if not seen:
                    if raw.startswith((b"\xff\xfe", b"\xfe\xff")) or looks_like_array(raw):
                        raise ReadWhole
                    seen = True
                yield number, raw, start
    except files.FileProblem as e:
        raise DataError(str(e), path=path) from None
    except files.DAMAGED:  # a damaged compressed stream: read it whole, which says what
        _read_bytes(path)
        raise
    if not seen:
        _read_bytes(path)  # empty, or blank: says which
        raise DataError("contains no rows", path=path)


def _whole(path: str, max_rows: int, split: str) -> tuple[list[tuple[int, Any]], bool]:
    rows = read_numbered(path, split=split)
    return rows[:max_rows], len(rows) <= max_rows


def read_rows(path: str, *, split: str = "train") -> list[dict]:
    """Local .json (array of objects, or JSON lines), .jsonl, .parquet, .csv -> list of dict rows.

    Anything else that is not an existing path is loaded with ``datasets.load_dataset(path, split=split)``. Any
    unreadable row raises ``DataError`` naming the file and row; ``build_datasets`` can skip such rows instead.
    """
    rows = []
    for number, row in read_numbered(path, split=split):
        if isinstance(row, Invalid):
            raise DataError(row.reason, path=path, row=number)
        rows.append(row)
    return rows

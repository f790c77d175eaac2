"""Reading training data: a local .json/.jsonl/.csv/.parquet/.arrow file, a glob or folder of them (shards), a
`datasets` save_to_disk folder or a Hub dataset name -> rows.

Each row keeps its 1-based number so every error can point at it (`DataError` names the file
and the row; `Shards` turns a number counted across a source's files into file + row); a row
that cannot even be read as an object comes back as `Invalid` in its place, so `on_bad_rows: skip`
can skip it and numbering survives. A malformed file or row is named with its actual cause: an
encoding, line endings, a format that changes mid-file, a key given twice, rows nested a level down.
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

LOCAL_EXTENSIONS = files.SHARD_SUFFIXES  # .jsonl .json .csv .parquet .arrow; each may end in .gz, .bz2 or .xz too

logger = logging.getLogger(__name__)


@dataclass
class Invalid:
    """A row that could not even be read as an object; kept in place so numbering survives."""

    reason: str


@dataclass
class Shards:
    """The files of a data.path and the rows each gave, in order: a row number counts across them (the first file's
    rows are 1..k, the next one's k+1..), and `where` gives the file and the row in it. A single file or a source read
    by `datasets` (a save_to_disk folder, a Hub dataset) has no files listed: its numbers are its rows."""

    path: str
    files: list[str]
    rows: list[int]

    def where(self, n: int) -> tuple[str, int]:
        if len(self.files) > 1:
            for file, count in zip(self.files, self.rows):
                if n <= count:
                    return file, n
                n -= count
        return self.path, n

    def error(self, message: str, n: int) -> DataError:
        path, row = self.where(n)
        return DataError(message, path=path, row=row)

    def label(self, n: int) -> str:
        path, row = self.where(n)
        return f"{path} row {row}" if len(self.files) > 1 else f"row {row}"


def shard_files(path: str, split: str = "train") -> list[str]:
    """The data files `path` names (finetune/data/files.py shards): itself, or a glob's or folder's files."""
    try:
        return files.shards(os.path.expanduser(path), split)
    except files.FileProblem as e:
        raise DataError(str(e), path=path) from None


def is_local(path: str) -> bool:
    """A path on this machine (anything else is a Hub dataset name). A directory, a dangling link
    or a FIFO counts as local: reading it says what it is (finetune/data/files.py)."""
    return (
        os.path.lexists(path)
        or files.format_name(path).endswith(LOCAL_EXTENSIONS)
        or path.startswith((".", "/", "~"))
        or files.is_pattern(path)
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
    head = data[:4096]
    if head.count(b"\x00") * 3 > len(head):  # UTF-16 text of ASCII: every other byte is 0
        raise DataError(
            "looks like UTF-16 (or UTF-32) text without a byte-order mark (every other byte is 0); re-save it as UTF-8",
            path=path,
        )
    if b"\r" in data.rstrip() and b"\n" not in data and not looks_like_array(data):
        raise DataError(
            "its lines end in CR only (classic Mac OS line endings), so the file reads as one line; convert them to "
            "LF (tr '\\r' '\\n' < FILE > OUT)",
            path=path,
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


class DuplicateKey(ValueError):
    """A JSON object that gives one key twice: JSON keeps the last value, so one of the two would train silently."""

    def __init__(self, key: str, values: list):
        shown = " and ".join(_short(v) for v in values[:2])
        super().__init__(
            f"the key {key!r} appears {len(values)} times in one object (values {shown}); a JSON reader keeps only "
            "the last, so one of them would be trained without a word: keep one"
        )


def _short(value: Any, limit: int = 30) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _unique_keys(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        key = next(k for i, (k, _) in enumerate(pairs) if any(k == other for other, _ in pairs[:i]))
        raise DuplicateKey(key, [v for k, v in pairs if k == key])
    return obj


def loads(text: str) -> Any:
    """json.loads that refuses an object giving a key twice (DuplicateKey)."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def parse_line(raw: bytes, line_start: int) -> Any:
    """One line of JSON lines: the row object, or `Invalid` saying why not."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Invalid(
            f"not valid UTF-8: byte 0x{raw[e.start]:02x} at byte offset {line_start + e.start}; re-save the file as UTF-8"
        )
    try:
        value = loads(text)
    except DuplicateKey as e:
        return Invalid(str(e))
    except json.JSONDecodeError as e:
        return Invalid(line_problem(text, e))
    return _object_or_invalid(value)


def line_problem(text: str, e: json.JSONDecodeError) -> str:
    """Why a line of JSON lines is not JSON, in the words of its likely cause."""
    line = text.strip()
    if line.startswith("\ufeff"):
        return "a UTF-8 byte-order mark in the middle of the file (files joined with cat?); remove it from this line"
    if "\x00" in line:
        return "holds NUL bytes (a file cut short while it was written, or UTF-16 text?); re-save the file as UTF-8"
    if line in ("{", "}", "[", "]", "},", "],") or (line.startswith('"') and '":' in line.replace('" :', '":')):
        return (
            "an object spread over several lines (pretty-printed JSON): JSON lines need each row on one line "
            "(jq -c . FILE > OUT.jsonl)"
        )
    if e.msg == "Extra data":
        return f"more than one JSON value on this line (the second starts at column {e.colno}): one row per line"
    return f"malformed JSON: {e.msg} (column {e.colno})"


def _object_or_invalid(value: Any) -> Any:
    if isinstance(value, dict):
        return value
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return Invalid(
            f"expected a JSON object, got a list of {len(value)} object(s): the rows are nested in an inner list; "
            "flatten it to one object per row"
        )
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
        if rows and isinstance(rows[0][1], Invalid):  # a pretty-printed document, perhaps
            return _single_document(data, path) or rows
        return rows
    text = _decode(data, path)
    try:
        value = loads(text)
    except DuplicateKey as e:
        raise DataError(str(e), path=path) from None
    except json.JSONDecodeError as e:
        if lines:
            rows = parse_json_lines(data)
            if not (rows and isinstance(rows[0][1], Invalid)):
                return rows  # JSON lines whose first row is an array: reported as that row
        if e.msg == "Extra data":  # a whole array, then more: two files joined, or an array then JSON lines
            raise DataError(
                f"the JSON array ends before line {e.lineno} column {e.colno} and more follows: the format changes "
                "mid-file (two arrays joined, or an array followed by JSON lines); keep one form",
                path=path,
            ) from None
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
        value = loads(data.decode("utf-8-sig"))
    except DuplicateKey as e:
        raise DataError(str(e), path=path) from None
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
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader)
        _unique_columns(header, path)
        rows: list[tuple[int, Any]] = []
        for number, cells in enumerate(reader, start=1):
            if not cells:  # a blank line
                continue
            if len(cells) != len(header):
                rows.append((number, Invalid(_field_count(cells, header))))
                continue
            rows.append((number, dict(zip(header, cells))))
    except csv.Error as e:  # a NUL byte, a quote left open at the end
        raise DataError(f"not readable as CSV at line {reader.line_num}: {e}", path=path) from None
    return rows


def _field_count(cells: list[str], header: list[str]) -> str:
    more = "more" if len(cells) > len(header) else "fewer"
    said = f"has {len(cells)} field(s), {more} than the header's {len(header)} ({', '.join(header)})"
    other = next((d for d in ";\t|" if d not in "".join(header) and any(d in c for c in cells)), None)
    if other is not None and len(cells) < len(header):  # the delimiter changes mid-file
        return f"{said}, and its fields hold {other!r}: the delimiter changes here; keep one delimiter"
    return f"{said}; a comma inside a field needs the field in double quotes"


def _unique_columns(names: list[str], path: str) -> None:
    """A column named twice: a reader keeps one of the two values per row, so it is refused."""
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        where = "; ".join(
            f"{n!r} at columns {', '.join(str(i + 1) for i, m in enumerate(names) if m == n)}" for n in twice
        )
        raise DataError(
            f"the column(s) {where} appear more than once; each row would keep one of the values without a word: "
            "rename or drop the copies",
            path=path,
        )


def _read_parquet(path: str) -> list[tuple[int, Any]]:
    import pyarrow.parquet as pq

    why = files.problem(path) or ("file is empty" if os.path.getsize(path) == 0 else None)
    if why:
        raise DataError(why, path=path)
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DataError(f"cannot read as parquet: {e}", path=path) from None
    _unique_columns(table.schema.names, path)
    return [(i + 1, r) for i, r in enumerate(table.to_pylist())]


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


def arrow_folder(path: str) -> bool:
    """A folder `datasets` wrote with save_to_disk (a Dataset's state.json, a DatasetDict's dataset_dict.json)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in ("dataset_dict.json", "state.json"))


def arrow_source(path: str, split: str = "train") -> tuple[Any, Shards] | None:
    """The `datasets.Dataset` of an Arrow source, memory-mapped, and its Shards: a save_to_disk folder (a DatasetDict's
    `split`), an .arrow file, or a glob or folder of .arrow files (concatenated); None for any other path (read row by
    row here)."""
    import datasets

    if arrow_folder(path):
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
        return ds, Shards(path, [], [len(ds)])
    names = shard_files(path, split)
    if not all(files.format_name(n).endswith(".arrow") and files.problem(n) is None for n in names):
        return None
    parts = []
    for name in names:
        try:
            parts.append(datasets.Dataset.from_file(name))
        except Exception as e:  # not an Arrow stream file
            raise DataError(f"cannot be read as an Arrow file (datasets' format): {e}", path=name) from None
        _unique_columns(parts[-1].column_names, name)
    whole = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return whole, Shards(path, names if len(names) > 1 else [], [len(p) for p in parts])


def read_numbered(path: str, *, split: str = "train") -> tuple[list[tuple[int, Any]], Shards]:
    """Every row of `path` (a file, a glob or folder of them, an Arrow source, a Hub dataset) numbered across its files,
    and the Shards that turn a number into file + row; unreadable rows come back as ``Invalid``."""
    found = arrow_source(path, split) if is_local(path) else (hub_dataset(path, split), None)
    if found is not None:
        source, shards = found
        rows = [(i + 1, r) for i, r in enumerate(source)]
        shards = shards or Shards(path, [], [len(rows)])
    else:
        names, rows, ends = shard_files(path, split), [], []
        for name in names:
            offset = sum(ends)
            own = read_file(name)
            rows += [(offset + n, r) for n, r in own]
            ends.append(own[-1][0])
        shards = Shards(path, names if len(names) > 1 else [], ends)
    if not rows:
        raise DataError("contains no rows", path=path)
    return rows, shards


def read_file(path: str) -> list[tuple[int, Any]]:
    """The rows of one local .jsonl, .json, .csv or .parquet file with their 1-based numbers."""
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
    """The first `max_rows` rows of one file (or an Arrow or Hub source) as `read_numbered` reads them, and whether they
    are the whole of it. JSON lines are streamed with no byte limit (a first row of any size is read whole); an array
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
                    # an array saved as .jsonl, UTF-16, CR-only line endings: read whole, which names them
                    if raw.startswith((b"\xff\xfe", b"\xfe\xff")) or looks_like_array(raw) or b"\x00" in raw:
                        raise ReadWhole
                    if b"\r" in raw.rstrip(b"\r"):
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
    rows, _ = read_numbered(path, split=split)
    return rows[:max_rows], len(rows) <= max_rows


def read_rows(path: str, *, split: str = "train") -> list[dict]:
    """Local .json (array of objects, or JSON lines), .jsonl, .parquet, .csv, or a glob or folder of them -> list of
    dict rows. Anything else that is not an existing path is loaded with ``datasets.load_dataset(path, split=split)``.
    Any unreadable row raises ``DataError`` naming the file and row; ``build_datasets`` can skip such rows instead.
    """
    numbered, shards = read_numbered(path, split=split)
    rows = []
    for number, row in numbered:
        if isinstance(row, Invalid):
            raise shards.error(row.reason, number)
        rows.append(row)
    return rows

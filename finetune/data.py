"""Supervised fine-tuning data: reading, validation, chat rendering, label masks, packing.

What this module holds, in pipeline order:

* ``read_rows`` turns a local .json/.jsonl/.csv/.parquet file (or a Hub dataset name) into
  dict rows, remembering each row's 1-based number so every error can point at it.
* ``detect_format`` picks one of ``FORMATS`` from the keys of the first row.
* Per-format validators turn a row into a conversation (or plain text) and reject wrong
  types instead of coercing them.
* Rendering goes through the tokenizer's chat template; the trained character spans are
  found by rendering conversation prefixes, and the full text is tokenized once with offsets
  so that labels are exact (``-100`` everywhere outside the trained spans).
* ``build_datasets`` adds truncation, the seeded train/eval split and optional packing, and
  returns a ``DataBundle`` with ``DataStats``.
* ``collate`` pads batches for the trainer (packed rows use position_ids, no attention mask).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from finetune.errors import UserError

logger = logging.getLogger(__name__)

FORMATS = ("alpaca", "prompt_completion", "messages", "sharegpt", "text")

IGNORE_INDEX = -100
LOCAL_EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet")

# Keys that identify each format, in detection priority order.
_FORMAT_KEYS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
_FORMAT_HELP = {
    "alpaca": "alpaca rows need instruction, output; optional input",
    "prompt_completion": "prompt_completion rows need prompt, completion",
    "messages": "messages rows need messages: a list of {role, content}",
    "sharegpt": "sharegpt rows need conversations: a list of {from, value}",
    "text": "text rows need text",
}
_MESSAGE_ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_PROGRESS_MIN_ROWS = 1000
_TOKENIZE_CHUNK = 1000
_LOG_FIRST_N = 5


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
class DataStats:
    format: str
    rows_read: int  # rows taken from the source and examined (bad ones included)
    rows_skipped: list[tuple[int, str]]
    train_examples: int  # examples, not packed rows (len(bundle.train) gives rows)
    eval_examples: int
    truncated: int
    packed: bool
    train_input_tokens: int
    train_trained_tokens: int
    dropped_no_labels: int = 0  # examples left with no trained token (e.g. truncated away)


@dataclass
class DataBundle:
    train: Any  # datasets.Dataset
    eval: Any  # datasets.Dataset | None
    stats: DataStats


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------


@dataclass
class _Invalid:
    """A row that could not even be read as an object; kept in place so numbering survives."""

    reason: str


def _type_name(value: Any) -> str:
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


def _is_local(path: str) -> bool:
    return (
        os.path.exists(path)
        or path.lower().endswith(LOCAL_EXTENSIONS)
        or path.startswith((".", "/", "~"))
    ) and not os.path.isdir(path)


def _read_bytes(path: str) -> bytes:
    if not os.path.exists(path):
        raise DataError("file not found", path=path)
    with open(path, "rb") as f:
        data = f.read()
    return _check_bytes(data, path)


def _check_bytes(data: bytes, path: str) -> bytes:
    if not data.strip():
        raise DataError("file is empty", path=path)
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):  # UTF-16/32 byte-order marks; otherwise "bad byte 0xff in row 1"
        raise DataError("is UTF-16 (or UTF-32) text, byte-order mark "
                        f"0x{data[:2].hex()}; re-save the file as UTF-8", path=path)
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


def _parse_json_lines(data: bytes) -> list[tuple[int, Any]]:
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
            rows.append((number, _Invalid(
                f"not valid UTF-8: byte 0x{raw[e.start]:02x} at byte offset {line_start + e.start}; "
                "re-save the file as UTF-8")))
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            rows.append((number, _Invalid(f"malformed JSON: {e.msg} (column {e.colno})")))
            continue
        rows.append((number, _object_or_invalid(value)))
    return rows


def _object_or_invalid(value: Any) -> Any:
    if isinstance(value, dict):
        return value
    return _Invalid(f"expected a JSON object, got {_type_name(value)}")


def _read_json(path: str) -> list[tuple[int, Any]]:
    data = _read_bytes(path)
    if not data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
        # Not an array: .json files holding JSON lines are common.
        rows = _parse_json_lines(data)
        if rows and isinstance(rows[0][1], _Invalid) and "malformed JSON" in rows[0][1].reason:
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
            rows.append((number, _Invalid(f"has {len(record[None])} more field(s) than the header")))
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


def _read_numbered(path: str, *, split: str = "train") -> list[tuple[int, Any]]:
    """Rows with their 1-based numbers; unreadable rows come back as ``_Invalid``."""
    if not _is_local(path):
        rows = _read_hub(path, split)
    else:
        lower = path.lower()
        if lower.endswith(".jsonl"):
            rows = _parse_json_lines(_read_bytes(path))
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
    for number, row in _read_numbered(path, split=split):
        if isinstance(row, _Invalid):
            raise DataError(row.reason, path=path, row=number)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------
# Format detection and row validation
# --------------------------------------------------------------------------------------


def detect_format(rows: list[dict], declared: str = "auto", *, path: str = "") -> str:
    """Return the declared format, or for 'auto' the one whose keys the first row has."""
    if declared != "auto":
        if declared not in FORMATS:
            raise DataError(
                f"unknown data format {declared!r}; use auto or one of {', '.join(FORMATS)}", path=path or None
            )
        return declared
    if not rows:
        raise DataError("contains no rows to detect the format from", path=path or None)
    first = rows[0]
    keys = sorted(first) if isinstance(first, dict) else []
    for fmt, needed in _FORMAT_KEYS.items():
        if all(k in keys for k in needed):
            return fmt
    needs = "; ".join(_FORMAT_HELP[f] for f in FORMATS)
    raise DataError(
        f"cannot detect the data format: first row has keys {keys}; {needs}. "
        "Rename the columns or set data.format",
        path=path or None,
    )


class _BadRow(Exception):
    """A row-level problem; the caller adds file and row number."""


def _require_str(row: dict, key: str, fmt: str, *, non_empty: bool = False) -> str:
    if key not in row or row[key] is None:
        raise _BadRow(f"missing key {key!r} ({_FORMAT_HELP[fmt]})")
    value = row[key]
    if not isinstance(value, str):
        raise _BadRow(f"{key!r} must be a string, got {_type_name(value)} {_short(value)}")
    if non_empty and not value.strip():
        raise _BadRow(f"{key!r} is empty")
    return value


def _optional_str(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _BadRow(f"{key!r} must be a string, got {_type_name(value)} {_short(value)}")
    return value


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _alpaca_prompt(row: dict) -> tuple[str, str]:
    instruction = _require_str(row, "instruction", "alpaca", non_empty=True)
    extra = _optional_str(row, "input")
    output = _require_str(row, "output", "alpaca")
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return prompt, output


def _prompt_completion(row: dict) -> tuple[str, str]:
    return _require_str(row, "prompt", "prompt_completion"), _require_str(row, "completion", "prompt_completion")


def prompt_and_answer(row: dict, where: str) -> tuple[str, str]:
    """(user prompt, reference answer) of an alpaca or prompt_completion row, built exactly as
    training builds it, so evaluation prompts match the trained ones. `where` names the row."""
    try:
        if "instruction" in row:
            return _alpaca_prompt(row)
        if "prompt" in row:
            return _prompt_completion(row)
    except _BadRow as e:
        raise DataError(f"{where}: {e}") from None
    raise DataError(f"{where}: exact-match rows need instruction/output or prompt/completion keys, "
                    f"found {sorted(row)}")


def _turns(row: dict, key: str, role_key: str, text_key: str, roles: dict[str, str], fmt: str) -> list[dict]:
    """Validate a list of turn objects and return clean {role, content} messages."""
    if key not in row or row[key] is None:
        raise _BadRow(f"missing key {key!r} ({_FORMAT_HELP[fmt]})")
    turns = row[key]
    if not isinstance(turns, (list, tuple)):
        raise _BadRow(f"{key!r} must be a list of {{{role_key}, {text_key}}} objects, got {_type_name(turns)}")
    if not turns:
        raise _BadRow(f"{key!r} is an empty list")
    messages = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise _BadRow(f"{where} must be an object with {role_key}, {text_key}; got {_type_name(turn)}")
        for k in (role_key, text_key):
            if turn.get(k) is None:
                raise _BadRow(f"{where} is missing key {k!r}")
        role, text = turn[role_key], turn[text_key]
        if not isinstance(role, str) or role not in roles:
            raise _BadRow(f"{where}.{role_key} must be one of {', '.join(roles)}; got {_short(role)}")
        if not isinstance(text, str):
            raise _BadRow(f"{where}.{text_key} must be a string, got {_type_name(text)}")
        messages.append({"role": roles[role], "content": text})
    _check_assistant_turns(messages, key)
    return messages


def _check_assistant_turns(messages: list[dict], key: str) -> None:
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise _BadRow(f"{key!r} has no assistant turn, so there is nothing to train on")
    # An assistant turn with no user turn before it has no prompt to render the
    # generation prefix from (chat templates put their default system text there).
    first = roles.index("assistant")
    if not any(r in ("user", "tool") for r in roles[:first]):
        raise _BadRow(f"{key}[{first}] is an assistant turn with no user turn before it")


def _messages(row: dict) -> list[dict]:
    return _turns(row, "messages", "role", "content", {r: r for r in _MESSAGE_ROLES}, "messages")


def _sharegpt(row: dict) -> list[dict]:
    return _turns(row, "conversations", "from", "value", _SHAREGPT_ROLES, "sharegpt")


# --------------------------------------------------------------------------------------
# Rendering: text plus the character spans that carry loss
# --------------------------------------------------------------------------------------


@dataclass
class _Rendered:
    text: str
    spans: list[tuple[int, int]]  # sorted, non-overlapping [start, end) character ranges


def _tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


class _Renderer:
    """Turns validated rows of one format into text with trained spans."""

    def __init__(self, tokenizer, fmt: str, cfg, path: str):
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.path = path
        self.train_on_prompt = bool(getattr(cfg, "train_on_prompt", False))
        self.system_prompt = getattr(cfg, "system_prompt", None)
        use_template = bool(getattr(cfg, "chat_template", True))
        self.plain = fmt == "text" or (fmt in ("alpaca", "prompt_completion") and not use_template)
        if self.plain:
            self._check_plain_tokens()
            if self.system_prompt and fmt != "text":
                logger.warning("data.system_prompt is ignored because data.chat_template is false")
        else:
            self._check_chat_template(use_template)

    def _check_chat_template(self, use_template: bool) -> None:
        if getattr(self.tokenizer, "chat_template", None):
            return
        name = _tokenizer_name(self.tokenizer)
        if self.fmt in ("alpaca", "prompt_completion"):
            fix = "set data.chat_template: false to train on plain prompt + completion text, or use a model with a chat template"
        else:
            fix = f"{self.fmt} data needs a chat template: use a model whose tokenizer has one"
        raise DataError(f"tokenizer {name!r} has no chat template; {fix}", path=self.path)

    def _check_plain_tokens(self) -> None:
        if not self.tokenizer.eos_token:
            raise DataError(
                f"tokenizer {_tokenizer_name(self.tokenizer)!r} has no eos_token to end plain-text examples with",
                path=self.path,
            )
        # Tokenization below uses add_special_tokens=False so that offsets match the text;
        # keep the BOS that this tokenizer would normally add by writing it into the text.
        bos_id = self.tokenizer.bos_token_id
        ids = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        self.bos = self.tokenizer.bos_token if bos_id is not None and ids[:1] == [bos_id] else ""

    def render(self, row: dict) -> _Rendered:
        if self.fmt == "text":
            text = self.bos + _require_str(row, "text", "text", non_empty=True) + self.tokenizer.eos_token
            return _Rendered(text, [(0, len(text))])
        if self.fmt in ("alpaca", "prompt_completion"):
            prompt, completion = _alpaca_prompt(row) if self.fmt == "alpaca" else _prompt_completion(row)
            if self.plain:
                head = self.bos + prompt
                text = head + completion + self.tokenizer.eos_token
                start = 0 if self.train_on_prompt else len(head)
                return _Rendered(text, [(start, len(text))])
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        else:
            messages = _messages(row) if self.fmt == "messages" else _sharegpt(row)
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return self._render_chat(messages)

    def _apply(self, messages: list[dict], *, generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # jinja raises for conversations the template refuses
            raise _BadRow(f"the chat template rejected this conversation: {type(e).__name__}: {e}") from None

    def _render_chat(self, messages: list[dict]) -> _Rendered:
        full = self._apply(messages)
        if self.train_on_prompt:
            return _Rendered(full, [(0, len(full))])
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            # The trained span is what the template adds for this assistant turn beyond the
            # generation prompt: the content plus its end-of-turn text, so the model learns to stop.
            before = self._apply(messages[:i], generation_prompt=True)
            through = full if i == len(messages) - 1 else self._apply(messages[: i + 1])
            if not (full.startswith(before) and full.startswith(through) and len(before) <= len(through)):
                raise _TemplateNotPrefixStable(i)
            if len(through) > len(before):
                spans.append((len(before), len(through)))
        return _Rendered(full, spans)


class _TemplateNotPrefixStable(Exception):
    """Raised per row but reported as a configuration problem: it is the template, not the data."""

    def __init__(self, turn: int):
        super().__init__(turn)
        self.turn = turn


# --------------------------------------------------------------------------------------
# Tokenization and labels
# --------------------------------------------------------------------------------------


@dataclass
class _Example:
    input_ids: list[int]
    labels: list[int]


def _mask(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """Labels are the token ids whose character range lies inside a trained span."""
    labels = [IGNORE_INDEX] * len(ids)
    j = 0
    for t, (start, end) in enumerate(offsets):
        while j < len(spans) and spans[j][1] < end:
            j += 1
        if j < len(spans) and spans[j][0] <= start and end <= spans[j][1]:
            labels[t] = ids[t]
    return labels


def _tokenize(rendered: list[_Rendered], tokenizer) -> list[_Example]:
    examples = []
    for lo in _progress(range(0, len(rendered), _TOKENIZE_CHUNK), len(rendered), "tokenizing", _TOKENIZE_CHUNK):
        chunk = rendered[lo : lo + _TOKENIZE_CHUNK]
        try:
            enc = tokenizer(
                [r.text for r in chunk], add_special_tokens=False, return_offsets_mapping=True
            )
        except NotImplementedError:
            raise DataError(
                f"tokenizer {_tokenizer_name(tokenizer)!r} cannot return character offsets; "
                "a fast (Rust) tokenizer is needed for exact label masks"
            ) from None
        for r, ids, offsets in zip(chunk, enc["input_ids"], enc["offset_mapping"]):
            examples.append(_Example(list(ids), _mask(ids, offsets, r.spans)))
    return examples


def _progress(iterable, total_rows: int, desc: str, step: int = 1):
    """A tqdm bar for big inputs on a terminal; the plain iterable otherwise."""
    if total_rows <= _PROGRESS_MIN_ROWS or not sys.stderr.isatty():
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, total=-(-total_rows // step), unit="rows" if step == 1 else f"x{step} rows")


def _truncate(examples: list[_Example], max_length: int) -> tuple[list[_Example], int, int]:
    kept, truncated, dropped = [], 0, 0
    for ex in examples:
        if len(ex.input_ids) > max_length:
            truncated += 1
            ex = _Example(ex.input_ids[:max_length], ex.labels[:max_length])
        if all(label == IGNORE_INDEX for label in ex.labels):
            dropped += 1
            continue
        kept.append(ex)
    if truncated:
        logger.warning("%d example(s) were longer than max_length=%d tokens and were cut", truncated, max_length)
    if dropped:
        logger.warning(
            "%d example(s) had no trained tokens left (completion cut off by max_length=%d) and were dropped",
            dropped, max_length,
        )
    return kept, truncated, dropped


# --------------------------------------------------------------------------------------
# Split and packing
# --------------------------------------------------------------------------------------


def _split(examples: list[_Example], eval_fraction: float, seed: int, path: str):
    if not eval_fraction:
        return examples, None
    n = len(examples)
    n_eval = max(1, round(n * eval_fraction))
    if n_eval >= n:
        raise DataError(
            f"eval_fraction={eval_fraction} of {n} usable example(s) leaves nothing to train on; "
            "lower data.eval_fraction or add rows",
            path=path,
        )
    order = list(range(n))
    random.Random(seed).shuffle(order)
    eval_idx, train_idx = sorted(order[:n_eval]), sorted(order[n_eval:])
    return [examples[i] for i in train_idx], [examples[i] for i in eval_idx]


def _pack(examples: list[_Example], max_length: int, seed: int) -> list[dict]:
    """Greedily concatenate whole examples (in seeded shuffled order) into rows <= max_length.

    position_ids restart at 0 for each example; with no attention mask, transformers turns
    that into a block-diagonal causal mask, so examples in a row do not attend to each other.
    Labels are shifted inside the model (logits[t] is scored against labels[t + 1]), so the
    label at the first token of every example after the first would be predicted from the
    last token of the previous example; it is set to -100 to drop that cross-example target.
    """
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    rows: list[dict] = []
    row = _empty_packed_row()
    for i in order:
        ex = examples[i]
        if row["input_ids"] and len(row["input_ids"]) + len(ex.input_ids) > max_length:
            rows.append(row)
            row = _empty_packed_row()
        labels = list(ex.labels)
        if row["input_ids"]:
            labels[0] = IGNORE_INDEX
        row["input_ids"].extend(ex.input_ids)
        row["labels"].extend(labels)
        row["position_ids"].extend(range(len(ex.input_ids)))
    if row["input_ids"]:
        rows.append(row)
    return rows


def _empty_packed_row() -> dict:
    return {"input_ids": [], "labels": [], "position_ids": []}


# --------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------


@dataclass
class _BadRowLog:
    """Applies on_bad_rows: raise on the first bad row, or record it and go on."""

    path: str
    skip: bool
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def bad(self, row: int, reason: str) -> None:
        if not self.skip:
            raise DataError(reason, path=self.path, row=row)
        self.skipped.append((row, reason))

    def report(self, good: int) -> None:
        if not self.skipped:
            return
        first = "; ".join(f"row {n}: {why}" for n, why in self.skipped[:_LOG_FIRST_N])
        if not good:
            raise DataError(f"all {len(self.skipped)} row(s) are bad; first problems: {first}", path=self.path)
        more = " ..." if len(self.skipped) > _LOG_FIRST_N else ""
        logger.warning("%s: skipped %d bad row(s): %s%s", self.path, len(self.skipped), first, more)


def _render_rows(numbered, renderer: _Renderer, log: _BadRowLog, max_samples: int | None, path: str):
    rendered: list[_Rendered] = []
    examined = 0
    for number, row in _progress(numbered, len(numbered), "rendering"):
        if max_samples is not None and len(rendered) >= max_samples:
            break
        examined += 1
        if isinstance(row, _Invalid):
            log.bad(number, row.reason)
            continue
        try:
            rendered.append(renderer.render(row))
        except _BadRow as e:
            log.bad(number, str(e))
        except _TemplateNotPrefixStable as e:
            raise DataError(
                f"the chat template of tokenizer {_tokenizer_name(renderer.tokenizer)!r} is not prefix-stable "
                f"(rendering the conversation up to turn {e.turn} is not a prefix of the full rendering), so "
                "assistant tokens cannot be located exactly; set data.train_on_prompt: true, or "
                "data.chat_template: false for alpaca/prompt_completion data",
                path=path, row=number,
            ) from None
    return rendered, examined


_ROW_VALIDATORS = {
    "text": lambda row: _require_str(row, "text", "text", non_empty=True),
    "alpaca": _alpaca_prompt,
    "prompt_completion": _prompt_completion,
    "messages": _messages,
    "sharegpt": _sharegpt,
}
_HEAD_BYTES = 1 << 20  # JSON-lines preflight reads at most the first MiB


def check_head(cfg, *, max_rows: int = 100) -> list[str]:
    """Preflight for ``cfg.path`` before any weights load: the file exists, is not empty, and its
    first ``max_rows`` rows read and validate as the detected (or declared) format, with the
    messages ``build_datasets`` would give. Returns the problems (empty: none found). Hub
    datasets are not checked here (that needs the network); the chat template and lengths need
    the tokenizer, so ``build_datasets`` checks those."""
    path = cfg.path
    if not _is_local(path):
        return []
    try:
        if path.lower().endswith(".jsonl") and os.path.exists(path) and os.path.getsize(path) > _HEAD_BYTES:
            with open(path, "rb") as f:
                head = _check_bytes(f.read(_HEAD_BYTES), path)
            numbered, complete = _parse_json_lines(head[: head.rfind(b"\n") + 1] or head), False
        else:
            numbered = _read_numbered(path, split=getattr(cfg, "split", "train"))
            complete = len(numbered) <= max_rows
        numbered = numbered[:max_rows]
        skip = getattr(cfg, "on_bad_rows", "error") == "skip"
        if not numbered:
            raise DataError("contains no rows", path=path)
        first = next((row for _, row in numbered if not isinstance(row, _Invalid)), None)
        if first is None:
            if skip and not complete:
                return []
            raise DataError(numbered[0][1].reason, path=path, row=numbered[0][0])
        fmt = detect_format([first], getattr(cfg, "format", "auto"), path=path)
        bad = []
        for number, row in numbered:
            reason = row.reason if isinstance(row, _Invalid) else None
            if reason is None:
                try:
                    _ROW_VALIDATORS[fmt](row)
                except _BadRow as e:
                    reason = str(e)
            if reason is not None:
                bad.append(str(DataError(reason, path=path, row=number)))
        # with on_bad_rows: skip, bad rows only stop training when every row of the file is bad
        if bad and (not skip or (complete and len(bad) == len(numbered))):
            more = f" (and {len(bad) - 1} more bad row(s) among the first {len(numbered)})" if len(bad) > 1 else ""
            return [f"data.path: {bad[0]}{more}"]
    except DataError as e:
        return [f"data.path: {e}"]
    return []


def _read_and_tokenize(cfg, tokenizer, path: str, on_bad_rows: str, max_length: int) -> dict:
    """Read, validate, render, tokenize and truncate; a plain-JSON dict (what the cache stores)."""
    numbered = _read_numbered(path, split=getattr(cfg, "split", "train"))
    log = _BadRowLog(path, skip=on_bad_rows == "skip")

    # Detect from the first readable row; an unreadable row before it is reported (or
    # skipped) in order by the render loop below.
    first = next((row for _, row in numbered if not isinstance(row, _Invalid)), None)
    if first is None:
        for number, row in numbered:
            log.bad(number, row.reason)
        log.report(good=0)
    fmt = detect_format([first], getattr(cfg, "format", "auto"), path=path)

    renderer = _Renderer(tokenizer, fmt, cfg, path)
    rendered, examined = _render_rows(numbered, renderer, log, getattr(cfg, "max_samples", None), path)
    log.report(good=len(rendered))

    examples, truncated, dropped = _truncate(_tokenize(rendered, tokenizer), max_length)
    return {"format": fmt, "examined": examined, "skipped": [list(x) for x in log.skipped],
            "truncated": truncated, "dropped": dropped,
            "examples": [[ex.input_ids, ex.labels] for ex in examples]}


def build_datasets(cfg, tokenizer, *, seed: int) -> DataBundle:
    """Read, validate, render, tokenize, truncate, split and (optionally) pack ``cfg.path``."""
    import datasets

    from finetune import token_cache

    path = cfg.path
    on_bad_rows = getattr(cfg, "on_bad_rows", "error")
    if on_bad_rows not in ("error", "skip"):
        raise DataError(f"on_bad_rows must be 'error' or 'skip', got {on_bad_rows!r}")
    max_length = cfg.max_length
    cache = token_cache.for_data(cfg, tokenizer, path)  # data.cache_tokenized: reuse across runs
    entry = cache.load() if cache else None
    if entry is None:
        entry = _read_and_tokenize(cfg, tokenizer, path, on_bad_rows, max_length)
        if cache:
            cache.save(entry)
    elif entry["skipped"]:
        logger.warning("%s: skipped %d bad row(s) (from the tokenization cache)", path, len(entry["skipped"]))
    fmt, examined, truncated, dropped = entry["format"], entry["examined"], entry["truncated"], entry["dropped"]
    skipped = [tuple(x) for x in entry["skipped"]]
    examples = [_Example(ids, labels) for ids, labels in entry["examples"]]
    if not examples:
        raise DataError(f"no example has a trained token within max_length={max_length} (every completion "
                        "starts beyond it); raise data.max_length or shorten the prompts", path=path)
    train, eval_ = _split(examples, getattr(cfg, "eval_fraction", 0.0), seed, path)

    packing = bool(getattr(cfg, "packing", False))
    if packing:
        train_rows = _pack(train, max_length, seed)
    else:
        train_rows = [{"input_ids": ex.input_ids, "labels": ex.labels} for ex in train]
    train_ds = datasets.Dataset.from_list(train_rows)
    eval_ds = None
    if eval_ is not None:
        eval_ds = datasets.Dataset.from_list([{"input_ids": ex.input_ids, "labels": ex.labels} for ex in eval_])

    stats = DataStats(
        format=fmt,
        rows_read=examined,
        rows_skipped=skipped,
        train_examples=len(train),
        eval_examples=len(eval_) if eval_ is not None else 0,
        truncated=truncated,
        packed=packing,
        train_input_tokens=sum(len(r["input_ids"]) for r in train_rows),
        train_trained_tokens=sum(sum(1 for x in r["labels"] if x != IGNORE_INDEX) for r in train_rows),
        dropped_no_labels=dropped,
    )
    logger.info(
        "%s: %s data, %d train / %d eval examples, %d train tokens (%d trained)%s",
        path, fmt, stats.train_examples, stats.eval_examples, stats.train_input_tokens,
        stats.train_trained_tokens, f", packed into {len(train_rows)} rows" if packing else "",
    )
    return DataBundle(train=train_ds, eval=eval_ds, stats=stats)


def collate(features: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch: input_ids with pad_token_id, labels with -100.

    Unpacked batches get attention_mask (1 real, 0 padding). Packed batches (features have
    position_ids) get no attention_mask: transformers then derives a block-diagonal causal
    mask from position_ids. Padding continues 0, 1, 2, ... so it forms its own pseudo-sequence
    that no real token attends to. The model must run without a KV cache (use_cache=False,
    as Trainer does) or transformers ignores position_ids for masking.
    """
    if not features:
        raise ValueError("collate() got an empty batch")
    if pad_token_id is None:
        raise ValueError("collate() needs a pad_token_id (set tokenizer.pad_token, e.g. to the eos token)")
    packed = ["position_ids" in f for f in features]
    if any(packed) and not all(packed):
        raise ValueError("collate() got a batch mixing packed and unpacked rows")
    longest = max(len(f["input_ids"]) for f in features)
    batch = len(features)
    input_ids = torch.full((batch, longest), pad_token_id, dtype=torch.long)
    labels = torch.full((batch, longest), IGNORE_INDEX, dtype=torch.long)
    if all(packed):
        position_ids = torch.arange(longest, dtype=torch.long).repeat(batch, 1)
    else:
        attention_mask = torch.zeros((batch, longest), dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        input_ids[i, :n] = torch.as_tensor(f["input_ids"], dtype=torch.long)
        labels[i, :n] = torch.as_tensor(f["labels"], dtype=torch.long)
        if all(packed):
            position_ids[i, :n] = torch.as_tensor(f["position_ids"], dtype=torch.long)
            position_ids[i, n:] = torch.arange(longest - n, dtype=torch.long)
        else:
            attention_mask[i, :n] = 1
    out = {"input_ids": input_ids, "labels": labels}
    if all(packed):
        out["position_ids"] = position_ids
    else:
        out["attention_mask"] = attention_mask
    return out

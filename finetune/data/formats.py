"""The data formats, one record each (`DataFormat`, in `TABLE` under its data.format name): how a file's first row is
told to be one, what its rows need, the row validator and the way it renders; the recipe's data.format values, the
readers' row test and the renderer all read the table (docs/architecture.md "Adding a data format").

Validators turn a row into its text, a (prompt, answer) pair or a conversation ({role, content} messages) and reject
wrong types instead of coercing them; a problem is a `BadRow` the caller names with file and row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from finetune.errors import DataError


@dataclass(frozen=True)
class DataFormat:
    keys: tuple[str, ...]  # a first row holding every one is this format (conversations are tried first)
    help: str  # what its rows need, said with each problem
    validate: Callable[[dict], Any]  # row -> what `renders` names; raises BadRow
    # How it renders (finetune/data/render.py Renderer), and what `validate` returns: "text" (a string), "pair"
    # ((prompt, answer)) or "conversation" ([{role, content}, ...]).
    renders: str
    # The texts a valid row renders from, checked for special tokens: field names, or `key[].field` for that field of
    # every turn object in the list under `key`.
    texts: tuple[str, ...]


_MESSAGE_ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def detect_format(rows: list[dict], declared: str = "auto", *, path: str = "") -> str:
    """Return the declared format, or for 'auto' the one whose keys the first row has."""
    if declared != "auto":
        if declared not in TABLE:
            raise DataError(
                f"unknown data format {declared!r}; use auto or one of {', '.join(TABLE)}", path=path or None
            )
        return declared
    if not rows:
        raise DataError("contains no rows to detect the format from", path=path or None)
    first = rows[0]
    keys = sorted(first) if isinstance(first, dict) else []
    for name, fmt in detection_order():
        if all(k in keys for k in fmt.keys):
            return name
    needs = "; ".join(f.help for f in TABLE.values())
    # no format reads these keys, so data.format cannot help: say which renaming would
    prompt = next((k for k in keys if k.lower() in _PROMPT_LIKE), None)
    answer = next((k for k in keys if k.lower() in _ANSWER_LIKE), None)
    rename = (
        f"rename {prompt} to prompt and {answer} to completion (the prompt_completion format)"
        if prompt and answer
        else "rename the columns to one format's keys"
    )
    nested = nesting_note(first)
    raise DataError(
        f"cannot detect the data format: first row has keys {keys}; "
        + (nested if nested else f"{needs}. To use it, {rename}"),
        path=path or None,
    )


_PROMPT_LIKE = ("question", "query", "input", "instruction", "prompt", "source")
_ANSWER_LIKE = ("answer", "response", "output", "target", "completion", "label")


def detection_order() -> list[tuple[str, DataFormat]]:
    """(name, record) in the order a first row is tried: conversations first, their one list key decides even when
    a row carries other columns too."""
    return sorted(TABLE.items(), key=lambda item: item[1].renders != "conversation")


def with_format_note(reason: str, row: Any, fmt: str) -> str:
    """A row's problem, with a note when the row has the keys of another format than the data's: the format changes
    there (rows of two datasets joined, say)."""
    if not isinstance(row, dict) or all(k in row for k in TABLE[fmt].keys):
        return reason
    for other, record in detection_order():
        if other != fmt and all(k in row for k in record.keys):
            return (
                f"{reason}; this row has the keys of {other} rows ({', '.join(record.keys)}), not those of the {fmt} "
                "rows before it: the format changes here (two datasets joined?); convert these rows or keep them apart"
            )
    return reason


def nesting_note(row: Any) -> str | None:
    """When a row is no format's but holds one under a single key, the rows are nested a level down: say where."""
    if not isinstance(row, dict) or len(row) != 1:
        return None
    (key, inner), found = next(iter(row.items())), None
    if isinstance(inner, dict):
        found = next((f for f, record in detection_order() if all(k in inner for k in record.keys)), None)
    if found is None:
        return None
    return (
        f"the rows are nested one level down: each holds a row of the {found} format under the key {key!r}; unwrap them "
        f"(for JSON lines: jq -c '.{key}' FILE > OUT.jsonl)"
    )


class BadRow(Exception):
    """A row-level problem; the caller adds file and row number."""


def _absent(row: dict, key: str, where: str = "") -> BadRow | None:
    """A key the row (or its turn `where`) lacks, or holds as null (JSON's null; a Parquet/Arrow column's missing
    value), said as which of the two it is."""
    if row.get(key) is not None:
        return None
    if key in row:
        return BadRow(f"{where}.{key} is null" if where else f"{key!r} is null")
    return BadRow(f"{where} is missing key {key!r}" if where else f"missing key {key!r}")


def require_str(row: dict, key: str, fmt: str, *, non_empty: bool = False) -> str:
    if absent := _absent(row, key):
        raise BadRow(f"{absent} ({TABLE[fmt].help})")
    value = row[key]
    if not isinstance(value, str):
        raise BadRow(f"{key!r} must be a string, got {type_name(value)} {_short(value)}")
    if non_empty and not value.strip():
        raise BadRow(f"{key!r} is empty")
    return value


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


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def alpaca_prompt(row: dict) -> tuple[str, str]:
    instruction = require_str(row, "instruction", "alpaca", non_empty=True)
    extra = "" if row.get("input") is None else require_str(row, "input", "alpaca")
    output = require_str(row, "output", "alpaca")
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return prompt, output


def prompt_and_answer(row: dict, where: str) -> tuple[str, str]:
    """(user prompt, reference answer) of a row of a pair format (alpaca, prompt_completion), built exactly as
    training builds it, so evaluation prompts match the trained ones; the format is the one whose first key the
    row has. `where` names the row."""
    pairs = [f for f in TABLE.values() if f.renders == "pair"]
    try:
        fmt = next((f for f in pairs if f.keys[0] in row), None)
        if fmt is not None:
            return fmt.validate(row)
    except BadRow as e:
        raise DataError(f"{where}: {e}") from None
    needed = " or ".join("/".join(f.keys) for f in pairs)
    raise DataError(f"{where}: exact-match rows need {needed} keys, found {sorted(row)}")


def _turns(row: dict, key: str, role_key: str, text_key: str, roles: dict[str, str], fmt: str) -> list[dict]:
    """Validate a list of turn objects and return clean {role, content} messages."""
    if absent := _absent(row, key):
        raise BadRow(f"{absent} ({TABLE[fmt].help})")
    turns = row[key]
    if not isinstance(turns, (list, tuple)):
        raise BadRow(f"{key!r} must be a list of {{{role_key}, {text_key}}} objects, got {type_name(turns)}")
    if not turns:
        raise BadRow(f"{key!r} is an empty list")
    messages = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise BadRow(f"{where} must be an object with {role_key}, {text_key}; got {type_name(turn)}")
        for k in (role_key, text_key):
            if absent := _absent(turn, k, where):
                raise absent
        role, text = turn[role_key], turn[text_key]
        if not isinstance(role, str) or role not in roles:
            raise BadRow(f"{where}.{role_key} must be one of {', '.join(roles)}; got {_short(role)}")
        if not isinstance(text, str):
            raise BadRow(f"{where}.{text_key} must be a string, got {type_name(text)}")
        messages.append({"role": roles[role], "content": text})
    _check_assistant_turns(messages, key)
    return messages


def _check_assistant_turns(messages: list[dict], key: str) -> None:
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise BadRow(f"{key!r} has no assistant turn, so there is nothing to train on")
    # An assistant turn with no user turn before it has no prompt to render the
    # generation prefix from (chat templates put their default system text there).
    first = roles.index("assistant")
    if not any(r in ("user", "tool") for r in roles[:first]):
        raise BadRow(f"{key}[{first}] is an assistant turn with no user turn before it")


def target_texts(row: dict, fmt: str) -> list[str]:
    """What a valid row of `fmt` trains on without data.train_on_prompt: the output, the completion,
    the assistant turns; a text row trains on all of its text."""
    record = TABLE[fmt]
    valid = record.validate(row)
    if record.renders == "text":
        return [valid]
    return [valid[1]] if record.renders == "pair" else [m["content"] for m in valid if m["role"] == "assistant"]


def empty_target(row: dict, fmt: str) -> bool:
    """Every target of the row is empty or white space: it would train only the end-of-turn token."""
    return not any(text.strip() for text in target_texts(row, fmt))


# data.format -> its record, in the order messages list them
TABLE: dict[str, DataFormat] = {
    "alpaca": DataFormat(
        ("instruction", "output"),
        "alpaca rows need instruction, output; optional input",
        alpaca_prompt,
        "pair",
        ("instruction", "input", "output"),
    ),
    "prompt_completion": DataFormat(
        ("prompt", "completion"),
        "prompt_completion rows need prompt, completion",
        lambda row: (
            require_str(row, "prompt", "prompt_completion"),
            require_str(row, "completion", "prompt_completion"),
        ),
        "pair",
        ("prompt", "completion"),
    ),
    "messages": DataFormat(
        ("messages",),
        "messages rows need messages: a list of {role, content}",
        lambda row: _turns(row, "messages", "role", "content", {r: r for r in _MESSAGE_ROLES}, "messages"),
        "conversation",
        ("messages[].content",),
    ),
    "sharegpt": DataFormat(
        ("conversations",),
        "sharegpt rows need conversations: a list of {from, value}",
        lambda row: _turns(row, "conversations", "from", "value", _SHAREGPT_ROLES, "sharegpt"),
        "conversation",
        ("conversations[].value",),
    ),
    "text": DataFormat(
        ("text",),
        "text rows need text",
        lambda row: require_str(row, "text", "text", non_empty=True),
        "text",
        ("text",),
    ),
}

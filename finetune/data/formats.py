"""The data formats, told apart by the first row's keys, and per-format row validation.

Validators turn a row into a conversation ({role, content} messages) or a (prompt, answer) pair and reject wrong types
instead of coercing them; a problem is a `BadRow` the caller names with file and row.
"""

from __future__ import annotations

from typing import Any

from finetune.data.read import FORMAT_KEYS, DataError, nesting_note, type_name

FORMATS = ("alpaca", "prompt_completion", "messages", "sharegpt", "text")

_FORMAT_HELP = {
    "alpaca": "alpaca rows need instruction, output; optional input",
    "prompt_completion": "prompt_completion rows need prompt, completion",
    "messages": "messages rows need messages: a list of {role, content}",
    "sharegpt": "sharegpt rows need conversations: a list of {from, value}",
    "text": "text rows need text",
}
_MESSAGE_ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


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
    for fmt, needed in FORMAT_KEYS.items():
        if all(k in keys for k in needed):
            return fmt
    needs = "; ".join(_FORMAT_HELP[f] for f in FORMATS)
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


class BadRow(Exception):
    """A row-level problem; the caller adds file and row number."""


def require_str(row: dict, key: str, fmt: str, *, non_empty: bool = False) -> str:
    if key not in row or row[key] is None:
        raise BadRow(f"missing key {key!r} ({_FORMAT_HELP[fmt]})")
    value = row[key]
    if not isinstance(value, str):
        raise BadRow(f"{key!r} must be a string, got {type_name(value)} {_short(value)}")
    if non_empty and not value.strip():
        raise BadRow(f"{key!r} is empty")
    return value


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def alpaca_prompt(row: dict) -> tuple[str, str]:
    instruction = require_str(row, "instruction", "alpaca", non_empty=True)
    extra = "" if row.get("input") is None else require_str(row, "input", "alpaca")
    output = require_str(row, "output", "alpaca")
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return prompt, output


def prompt_completion_pair(row: dict) -> tuple[str, str]:
    return require_str(row, "prompt", "prompt_completion"), require_str(row, "completion", "prompt_completion")


def prompt_and_answer(row: dict, where: str) -> tuple[str, str]:
    """(user prompt, reference answer) of an alpaca or prompt_completion row, built exactly as
    training builds it, so evaluation prompts match the trained ones. `where` names the row."""
    try:
        if "instruction" in row:
            return alpaca_prompt(row)
        if "prompt" in row:
            return prompt_completion_pair(row)
    except BadRow as e:
        raise DataError(f"{where}: {e}") from None
    raise DataError(f"{where}: exact-match rows need instruction/output or prompt/completion keys, found {sorted(row)}")


def _turns(row: dict, key: str, role_key: str, text_key: str, roles: dict[str, str], fmt: str) -> list[dict]:
    """Validate a list of turn objects and return clean {role, content} messages."""
    if key not in row or row[key] is None:
        raise BadRow(f"missing key {key!r} ({_FORMAT_HELP[fmt]})")
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
            if turn.get(k) is None:
                raise BadRow(f"{where} is missing key {k!r}")
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


def messages_conversation(row: dict) -> list[dict]:
    return _turns(row, "messages", "role", "content", {r: r for r in _MESSAGE_ROLES}, "messages")


def sharegpt_conversation(row: dict) -> list[dict]:
    return _turns(row, "conversations", "from", "value", _SHAREGPT_ROLES, "sharegpt")


def target_texts(row: dict, fmt: str) -> list[str]:
    """What a valid row of `fmt` trains on without data.train_on_prompt: the output, the completion,
    the assistant turns; a text row trains on all of its text."""
    if fmt == "text":
        return [row["text"]]
    valid = ROW_VALIDATORS[fmt](row)  # (prompt, answer), or the conversation
    return [valid[1]] if isinstance(valid, tuple) else [m["content"] for m in valid if m["role"] == "assistant"]


def empty_target(row: dict, fmt: str) -> bool:
    """Every target of the row is empty or white space: it would train only the end-of-turn token."""
    return not any(text.strip() for text in target_texts(row, fmt))


ROW_VALIDATORS = {
    "text": lambda row: require_str(row, "text", "text", non_empty=True),
    "alpaca": alpaca_prompt,
    "prompt_completion": prompt_completion_pair,
    "messages": messages_conversation,
    "sharegpt": sharegpt_conversation,
}

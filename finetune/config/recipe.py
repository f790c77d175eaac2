"""Recipes: find a recipe YAML by name or path, apply `--section.key=value` overrides, validate.

load_recipe("demo", ["--training.max_steps=10"])  ->  Config
"""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any

import yaml

from finetune.config.sections import Config
from finetune.config.validate import build_config
from finetune.errors import ConfigError
from finetune.resources import RECIPES as RECIPES_DIR


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-4` and `2E5` as numbers. YAML 1.1 (PyYAML) wants a dot
    (`1.0e-4`) and would otherwise hand a learning rate of 1e-4 over as a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$|^[-+]?(?:[0-9][0-9_]*)?\.[0-9_]+(?:[eE][-+]?[0-9]+)?$"
        r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$|^[-+]?[0-9][0-9_]*\.[0-9_]*$"
    ),
    list("-+0123456789."),
)


# Booleans as YAML 1.2 has them: true/false only. YAML 1.1 (PyYAML) also reads yes/no/on/off as
# booleans, so `--training.save_strategy=no` (a TrainingArguments value) became False and was refused.
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def parse_yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


class _Dumper(yaml.SafeDumper):
    """Quotes every string _Loader would read as another type (`1e5`, `true`), so a saved
    configuration reads back as it was written (a run name `1e5` stays a string on --resume)."""


_Dumper.yaml_implicit_resolvers = {k: list(v) for k, v in _Loader.yaml_implicit_resolvers.items()}


def dump_yaml(values) -> str:
    return yaml.dump(values, Dumper=_Dumper, sort_keys=False, allow_unicode=True)


def duplicate_keys(text: str) -> list[str]:
    """Every key given twice in one mapping of a YAML text, named with its line and dotted path.
    YAML loaders keep the last value silently; a recipe or launch config must not."""
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError:
        return []  # the parse reports it
    found: list[str] = []

    def walk(node, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key, value in node.value:
                name = str(key.value) if isinstance(key, yaml.ScalarNode) else "?"
                dotted = f"{path}.{name}" if path else name
                line = key.start_mark.line + 1
                if name in first and name != "<<":
                    found.append(
                        f"line {line}: key {dotted!r} is given twice (first at line {first[name]}); only one value "
                        "can apply: remove the other"
                    )
                first.setdefault(name, line)
                walk(value, dotted)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, f"{path}[{i}]")

    walk(root, "")
    return found


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def find_recipe(name_or_path: str) -> Path:
    """A path to an existing file, or the name of a file in recipes/ (with or without .yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in (RECIPES_DIR / name_or_path, RECIPES_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    raise ConfigError(
        [
            f"--recipe {name_or_path!r}: no such file, and no recipe of that name in {RECIPES_DIR}; "
            f"available: {', '.join(available_recipes()) or '(none)'}"
        ],
        "command line",
    )


def read_recipe_file(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"not UTF-8 text (byte {e.start}): {e.reason}"], str(path)) from None
    try:
        values = parse_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError([f"{where}invalid YAML: {getattr(e, 'problem', None) or e}"], str(path)) from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError([f"the top level must be a mapping of sections, got {type(values).__name__}"], str(path))
    twice = duplicate_keys(text)
    if twice:
        raise ConfigError(twice, str(path))
    return values


def parse_overrides(args: list[str], *, typed: bool = True, flags: list[str] = ()) -> tuple[dict, list[str]]:
    """`--section.key=value` or `--section.key value` -> nested dict; returns (overrides, problems). Each value is what
    was typed, read as the type the schema gives its key (typed_value): never as YAML, whose comment (` #`) and mapping
    (`: `) rules would cut or change a string. `typed=False`: the strings as they are (no schema, nothing heavy
    imported). `flags`: the command's own flags, suggested for a mistyped one."""
    out: dict = {}
    problems: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            problems.append(f"{arg!r}: unexpected argument; overrides look like --section.key=value")
            continue
        key, sep, raw = arg[2:].partition("=")
        parts = key.split(".")
        if len(parts) != 2 or not all(parts):
            if not sep and i < len(args) and not args[i].startswith("-"):
                i += 1  # its value (`--num-procesess 2`)
            close = difflib.get_close_matches(f"--{key}", flags, n=1, cutoff=0.7)
            hint = f" (did you mean {close[0]}?)" if close else ""
            what = "unknown option" if "." not in key else "malformed override"
            problems.append(f"--{key}: {what}{hint}; recipe overrides look like --section.key=value")
            continue
        if not sep:
            if i >= len(args) or args[i].startswith("--"):
                problems.append(f"--{key}: missing value; use --{key}=VALUE")
                continue
            raw = args[i]
            i += 1
        out.setdefault(parts[0], {})[parts[1]] = raw
    if typed:
        for section, body in out.items():
            hints = _schema(section, body)
            for key, raw in body.items():
                body[key] = typed_value(raw, hints.get(key, Any))
    return out, problems


def _schema(section: str, body: dict) -> dict:
    """The type of each key of a section; `training` adds TrainingArguments' fields when asked for."""
    import typing

    from finetune.config.sections import SECTION_CLASSES, TrainingConfig

    cls = SECTION_CLASSES.get(section)
    hints = typing.get_type_hints(cls) if cls else {}
    if cls is TrainingConfig and set(body) - set(hints):
        from finetune.config.validate import training_arguments_hints

        hints = {**training_arguments_hints(), **hints}
    return hints


_INT = re.compile(r"[-+]?[0-9]+(?:_[0-9]+)*")
_FLOAT = re.compile(r"[-+]?(?:[0-9]+(?:_[0-9]+)*\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def typed_value(raw: str, hint) -> Any:
    """An override's string as the type `hint` allows: null (Optional), true/false (bool), an integer,
    a number, a [list] or {mapping} (JSON, or YAML flow style), else the string itself. A string no
    allowed type holds is returned unchanged: validation then names the key, the value and the type."""
    import enum
    import json
    import types
    import typing

    kinds: set = set()
    for option in typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,):
        base = typing.get_origin(option) or option
        if option is Any:
            kinds |= {type(None), bool, int, float, list, dict, str}
        elif base is typing.Literal:
            kinds |= {type(v) for v in typing.get_args(option)}
        elif base in (type(None), bool, int, float, list, dict):
            kinds.add(base)
        elif isinstance(base, type) and issubclass(base, enum.Enum):
            kinds.add(str)
    text = raw.strip()
    if type(None) in kinds and text in ("null", "Null", "NULL"):
        return None
    if bool in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kinds & {int, float} and _INT.fullmatch(text):  # as YAML has it: 2 is an integer, which a number takes
        return int(text.replace("_", ""))
    if float in kinds and _FLOAT.fullmatch(text):
        return float(text.replace("_", ""))
    for container, ends in ((list, "[]"), (dict, "{}")):
        if container in kinds and text[:1] == ends[0] and text[-1:] == ends[1]:
            try:
                value = json.loads(text)
            except ValueError:
                try:
                    value = parse_yaml(text)
                except yaml.YAMLError:
                    continue
            if isinstance(value, container):
                return value
    return raw


def override_problems(args: list[str], *, flags: list[str] = ()) -> tuple[list[str], list[str]]:
    """What is wrong with command-line overrides before any recipe is read: the form
    (--section.key=value) and the section names; and the overrides that are well formed, for the
    recipe to validate (their keys and values: TrainingArguments needs transformers). Imports
    nothing heavy. `flags`: the command's own flags, suggested for a mistyped one."""
    from finetune.config.sections import SECTION_CLASSES

    parsed, problems = parse_overrides(list(args), typed=False, flags=flags)
    for section in parsed:
        if section not in SECTION_CLASSES:
            close = difflib.get_close_matches(section, SECTION_CLASSES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"--{section}.*: unknown section{hint}; allowed: {', '.join(SECTION_CLASSES)}")
    kept = [f"--{s}.{k}={v}" for s, body in parsed.items() if s in SECTION_CLASSES for k, v in body.items()]
    return problems, kept


def describe_recipe(name: str, width: int = 100) -> str:
    """`finetune recipes`' entry: the name and the recipe's whole opening paragraph (its purpose),
    wrapped; the paragraph ends at the first `Hardware:`, `Pairs with:`, `Launch` or `Same model` line."""
    import textwrap

    words = []
    for line in find_recipe(name).read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("# ").rstrip()
        if not text or text.startswith(("Hardware:", "Pairs with:", "Launch", "Same model")):
            break
        words.append(text)
    purpose = " ".join(words).removeprefix(f"{name}: ")
    return textwrap.fill(purpose, width, initial_indent=f"{name:16s}", subsequent_indent=" " * 16)


def merge(base: dict, overrides: dict) -> dict:
    merged = copy.deepcopy(base)
    for section, body in overrides.items():
        if isinstance(merged.get(section), dict) and isinstance(body, dict):
            merged[section].update(body)
        else:
            merged[section] = body
    return merged


def load_recipe(
    name_or_path: str | None, overrides: list[str] = (), problems: list[str] | None = None
) -> tuple[Config, Path | None]:
    """Defaults < recipe YAML < overrides, validated together: one ConfigError lists everything.
    Given a `problems` list (those found so far), the recipe's are added to it and the Config is
    returned (build_config); a recipe that cannot be read raises with all of them."""
    gather = [] if problems is None else problems
    over, found = parse_overrides(list(overrides))
    gather.extend(p for p in found if p not in gather)
    try:
        path = find_recipe(name_or_path) if name_or_path else None
        values = read_recipe_file(path) if path else {}
    except ConfigError as e:
        raise ConfigError(gather + e.problems, e.source) from None
    source = f"{path}" if path else "configuration"
    if over:
        source += " + command-line overrides"
    cfg = build_config(merge(values, over), recipe=path.stem if path else "custom", source=source, problems=gather)
    if gather and problems is None:
        raise ConfigError(gather, source)
    return cfg, path

"""Validation that reports every problem: a nested {section: {key: value}} dict -> Config.

Unknown sections and keys, wrong types and values that are not allowed are collected and raised
once as a `ConfigError` naming each dotted key and what is allowed (with a did-you-mean).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.util
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union

from finetune import precision
from finetune.config.sections import (
    PATH_KEYS,
    SECTION_CLASSES,
    STOP_SIGNALS,
    TRAINING_AUTO,
    TRAINING_DEFAULTS,
    TRAINING_PRECISION_FLAGS,
    TRAINING_RESERVED,
    Config,
    TrainingConfig,
    sdpa_list_problem,
)
from finetune.errors import ConfigError


def build_config(
    values: dict, *, recipe: str = "custom", source: str = "recipe", problems: list[str] | None = None
) -> Config:
    """Turn a nested {section: {key: value}} dict into a validated Config, or raise ConfigError
    listing every problem (unknown sections/keys, wrong types, values not allowed). Given a
    `problems` list, they are added to it instead and the Config is returned (a value of the wrong
    type left at its default), for preflight to check the data, model and launch with."""
    gather, problems = problems, []
    if not isinstance(values, dict):
        raise ConfigError([f"the top level must be a mapping of sections, got {_kind(values)}"], source)
    sections: dict[str, Any] = {}
    for name, body in values.items():
        if name not in SECTION_CLASSES:
            problems.append(
                f"{name}: unknown section{_suggest(name, SECTION_CLASSES)}; allowed: {', '.join(SECTION_CLASSES)}"
            )
            continue
        if body is None:
            body = {}
        if not isinstance(body, dict):
            problems.append(f"{name}: must be a mapping of keys, got {_kind(body)}")
            continue
        if name == "training":
            sections[name] = _build_training(body, problems)
        else:
            sections[name] = _build_section(name, SECTION_CLASSES[name], body, problems)
    if "training" not in sections:  # our TrainingArguments defaults apply with or without the section
        sections["training"] = _build_training({}, problems)
    for name, cls in SECTION_CLASSES.items():
        sections.setdefault(name, cls())
    cfg = Config(**sections, recipe=recipe)
    _expand_home(cfg)
    problems += _cross_checks(cfg)
    if gather is not None:
        gather.extend(p for p in problems if p not in gather)
    elif problems:
        raise ConfigError(problems, source)
    return cfg


def _expand_home(cfg: Config) -> None:
    """`~/data.jsonl` -> `/home/me/data.jsonl` in every path setting, as a shell would."""
    for section, key in PATH_KEYS:
        body = getattr(cfg, section)
        value = getattr(body, key)
        if isinstance(value, str) and value.startswith("~"):
            setattr(body, key, os.path.expanduser(value))


def _build_section(section: str, cls, body: dict, problems: list[str]):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in body.items():
        dotted = f"{section}.{key}"
        if key not in known:
            problems.append(f"{dotted}: unknown key{_suggest(key, known)}; allowed: {', '.join(sorted(known))}")
            continue
        problem = check_type(value, hints[key])
        if problem:
            problems.append(f"{dotted}: {problem}")
            continue
        kwargs[key] = float(value) if hints[key] is float and isinstance(value, int) else value
    return cls(**kwargs)


def _build_training(body: dict, problems: list[str]) -> TrainingConfig:
    own = {f.name for f in dataclasses.fields(TrainingConfig) if f.name != "args"}
    ta_hints = training_arguments_hints()
    ours = {k: v for k, v in body.items() if k in own}
    cfg = _build_section("training", TrainingConfig, ours, problems)
    args = dict(TRAINING_DEFAULTS)
    for key, value in body.items():
        if key in own:
            continue
        dotted = f"training.{key}"
        if key in TRAINING_RESERVED:
            problems.append(f"{dotted}: set by {TRAINING_RESERVED[key]}, not in training")
            continue
        if key in TRAINING_PRECISION_FLAGS:
            problems.append(_precision_flag_problem(dotted, key, value))
            continue
        if key in TRAINING_AUTO and value == "auto":
            args[key] = value  # resolved by the run (finetune/training/planned.py)
            continue
        if key not in ta_hints:
            problems.append(
                f"{dotted}: unknown key{_suggest(key, set(ta_hints) | own)}; allowed: "
                f"{', '.join(sorted(own))} or any transformers.TrainingArguments field"
            )
            continue
        problem = check_type(value, ta_hints[key], lenient=True)
        if problem:
            problems.append(f"{dotted}: {problem}" + (" (or auto: the run plans it)" if key in TRAINING_AUTO else ""))
            continue
        args[key] = value
    cfg.args = args
    return cfg


@functools.cache
def training_arguments_hints(source: Path | None = None) -> dict[str, Any]:
    """TrainingArguments' init fields and their types, read from `source` (default: transformers'
    training_args.py): importing it brings torch, peft and bitsandbytes (11-15 s on 2 cores) into the
    launcher, whose preflight needs only these. Types the file takes from elsewhere (its enums,
    ParallelismConfig) read as Any; TrainingArguments checks those in each rank. A file without the class
    (a release that moved it) gives the imported class's fields: the same answer, slower.
    tests/config/test_config.py holds both against the imported class."""
    if source is None:
        source = Path(importlib.util.find_spec("transformers").submodule_search_locations[0], "training_args.py")
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
        (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainingArguments"]
    except (OSError, SyntaxError, ValueError):
        from transformers import TrainingArguments

        hints = typing.get_type_hints(TrainingArguments)
        return {f.name: hints[f.name] for f in dataclasses.fields(TrainingArguments) if f.init}
    known = {"Any": Any, "Literal": Literal, "Union": Union, "None": None}
    known |= {t.__name__: t for t in (bool, int, float, str, list, dict, tuple)}
    fields = [n for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    no_init = {n.target.id for n in fields if "init=False" in ast.unparse(n.value or ast.Constant(None))}
    return {n.target.id: _annotation(n.annotation, known) for n in fields if n.target.id not in no_init}


def _annotation(node: ast.expr, known: dict[str, Any]) -> Any:
    """A type annotation's AST as the typing object it spells; a name not in `known` is Any."""
    if isinstance(node, ast.Name):
        return known.get(node.id, Any)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return Union[_annotation(node.left, known), _annotation(node.right, known)]  # noqa: UP007 - either side may be None
    if isinstance(node, ast.Subscript):
        base = _annotation(node.value, known)
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        args = tuple(_annotation(p, known) for p in parts)
        return Any if base is Any else base[args if len(args) > 1 else args[0]]
    return Any


def _cross_checks(cfg: Config) -> list[str]:
    p = range_problems(cfg)  # every numeric setting against its allowed range (RANGES)
    d, m, e, t = cfg.data, cfg.method, cfg.eval, cfg.training
    if isinstance(m.target_modules, list) and not all(isinstance(x, str) for x in m.target_modules):
        p.append("method.target_modules: must be 'all-linear' or a list of module names (strings)")
    if e.exact_match and not e.heldout_path:
        p.append("eval.heldout_path: required when eval.exact_match is true ('demo' for the demo split)")
    if e.exact_match and e.heldout_path == "demo" and d.path != "demo":
        p.append(
            f"eval.heldout_path: 'demo' is the demo data's held-out split, but data.path is {d.path!r}: with "
            f"your own data, turn the exact-match evaluation off (--eval.exact_match=false) or give a held-out "
            f"file of yours (--eval.heldout_path=FILE, rows like the training data's with the exact answers)"
        )
    if t.lr_scaling != "none" and t.lr_reference_batch_size is None:
        # Without a reference the run's own effective batch would be it, and the factor always 1.
        p.append(
            f"training.lr_scaling: {t.lr_scaling!r} needs training.lr_reference_batch_size, the effective "
            f"batch (sequences per optimizer step) at which training.learning_rate was chosen; set it "
            f"(e.g. lr_reference_batch_size: 8), or lr_scaling: none to use learning_rate as it is"
        )
    if t.typed.enable_jit_checkpoint:
        p.append(
            "training.enable_jit_checkpoint: not supported: its SIGTERM handler replaces ours and ends a "
            "preempted run with exit 0; preemption is handled without it (docs/faults.md)"
        )
    if isinstance(cfg.model.sdpa_backends, list) and (problem := sdpa_list_problem(cfg.model.sdpa_backends)):
        p.append(problem)
    if t.precision != "auto":  # auto is checked where the device is known (finetune/preflight/checks.py)
        p += precision.config_problems(
            precision.get(t.precision), model_dtype=cfg.model.dtype, method=m.name, compute_dtype=m.compute_dtype
        )
    if any(x not in STOP_SIGNALS for x in t.stop_signals):
        p.append(f"training.stop_signals: got {t.stop_signals!r}; allowed: a list of {', '.join(STOP_SIGNALS)}")
    if not all(isinstance(x, str) for x in cfg.logging.report_to):
        p.append("logging.report_to: must be a list of integration names, e.g. [wandb]")
    if cfg.run.export == "merged" and (m.name == "full" or not cfg.run.save_model):
        why = "a full fine-tune's model/ is the whole model already" if m.name == "full" else "run.save_model is false"
        p.append(f"run.export: merged folds a LoRA/QLoRA adapter into its base once model/ is saved; {why}")
    if isinstance(cfg.run.name, str) and (why := _not_a_name(cfg.run.name)):
        p.append(
            f"run.name: {cfg.run.name!r} {why}; a run name is one folder name under runs/ (to put the run "
            f"elsewhere, give run.output_dir)"
        )
    return p + _blank_paths(cfg) + _parallel_checks(cfg)


def _blank_paths(cfg: Config) -> list[str]:
    """A path setting that is blank: '' leaves an optional one unset, but the data and the model must be named, and
    blank space is a folder name no one means (data.cache_dir ' ' made a folder ' ' in the working directory;
    data.path '' was launched, then looked up on the Hub)."""
    problems = []
    for section, key in PATH_KEYS:
        value = getattr(getattr(cfg, section), key)
        required = (section, key) in (("model", "name_or_path"), ("data", "path"))
        if isinstance(value, str) and not value.strip() and (value or required):
            why = "it is required" if required else "leave it out (unset) or give a path"
            problems.append(f"{section}.{key}: {value!r} is blank; {why}")
    return problems


def _not_a_name(name: str) -> str | None:
    """Why `name` is not one folder name (runs/<name>), or None."""
    if not name.strip():
        return "is empty"
    if "/" in name or "\\" in name:
        return "contains a path separator" + (" (an absolute path)" if name.startswith("/") else "")
    if name in (".", ".."):
        return "is the current or the parent folder, not a name"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "contains a control character (a newline, a tab, NUL)"
    if len(name.encode("utf-8")) > 255:
        return f"is {len(name.encode('utf-8'))} bytes long; a folder name holds at most 255"
    return None


def _parallel_checks(cfg: Config) -> list[str]:
    """The `parallel` section against the rest of the recipe (what the launch adds, world size, strategy
    and device, is checked by finetune/preflight/parallel.py). docs/parallelism.md has the why of each."""
    from finetune import mesh

    par, d, m = cfg.parallel, cfg.data, cfg.method
    sizes = {k: getattr(par, k) for k in ("sp_size", "tp_size", "cp_size", "pp_size")}
    bad = [f"parallel.{k}: must be >= 1, got {v}" for k, v in sizes.items() if v < 1]
    if bad:
        return bad
    p = []
    if par.pp_size != 1:
        p.append(f"parallel.pp_size: {par.pp_size}: {mesh.PIPELINE_REFUSAL}; set parallel.pp_size: 1")
    sp, tp, cp = par.sp_size, par.tp_size, par.cp_size
    if sp > 1 and cp > 1:
        p.append(
            f"parallel.sp_size {sp} and parallel.cp_size {cp}: both split the sequence (Ulysses under DeepSpeed, "
            f"ring attention under FSDP2) and cannot be combined; keep one of them and set the other to 1"
        )
    if tp > 1 and (sp > 1 or cp > 1):
        p.append(
            f"parallel.tp_size {tp} with sp_size {sp} / cp_size {cp}: tensor parallelism is not composed with "
            f"sequence or context parallelism here (AutoTP's and Ulysses' process groups are separate engines); "
            f"use tp_size alone (wide layers) or sp_size alone (long sequences)"
        )
    split, why = (sp, "sp_size") if sp > 1 else (2 * cp, "2 x cp_size") if cp > 1 else (1, "")
    if split > 1:
        if d.max_length % split:
            lower, upper = d.max_length - d.max_length % split, d.max_length + split - d.max_length % split
            p.append(
                f"data.max_length {d.max_length} is not divisible by {why} = {split}: every sequence is cut into "
                f"{split} equal shards (one per rank{', two per rank for load balance' if cp > 1 else ''}); "
                f"set data.max_length to a multiple of {split} (e.g. {lower} or {upper})"
            )
        for key in ("packing", "padding_free"):
            if getattr(d, key):
                p.append(
                    f"data.{key}: true with parallel.{'sp_size' if sp > 1 else 'cp_size'} > 1: the sequence-split "
                    f"attention drops the attention mask and attends causally over the whole row, so packed "
                    f"examples would see each other; set data.{key}: false (rows are padded instead)"
                )
        allowed = ("sdpa", "flash_attention_2", "flash_attention_3") if sp > 1 else ("sdpa",)
        if cfg.model.attn_implementation not in allowed:
            p.append(
                f"model.attn_implementation {cfg.model.attn_implementation!r} with parallel."
                f"{'sp_size' if sp > 1 else 'cp_size'} > 1: allowed {', '.join(allowed)} (eager builds the "
                f"4D mask the split attention cannot use{'; ring attention runs over SDPA only' if cp > 1 else ''})"
            )
    if sp > 1 and cfg.training.typed.label_smoothing_factor:
        p.append(
            f"training.label_smoothing_factor {cfg.training.typed.label_smoothing_factor} with parallel.sp_size "
            f"{sp}: the sequence-parallel loss is the token-weighted negative log-likelihood summed over the "
            f"shards; set label_smoothing_factor: 0"
        )
    if tp > 1 and m.name != "full":
        p.append(
            f"method.name {m.name!r} with parallel.tp_size {tp}: AutoTP shards the model's nn.Linear weights, and "
            f"peft's LoRA{'/4-bit' if m.name == 'qlora' else ''} layers are not sharded with them (DeepSpeed 0.19, "
            f"peft 0.21); use method.name: full with tp_size, or sp_size / ZeRO-3 for {m.name}"
        )
    return p


def _precision_flag_problem(dotted: str, key: str, value: Any) -> str:
    """TrainingArguments' precision flags belong to the policy: one flag cannot say what the master
    weights, optimizer states and FSDP2/DeepSpeed settings are."""
    fp16 = key.startswith("fp16")
    like = ("16-mixed" if fp16 else "bf16-mixed") if value is True else "32-true"
    return (
        f"{dotted}: set by training.precision, not in training (the policy sets TrainingArguments bf16/fp16 "
        f"together with the master weights, optimizer states, FSDP2 and DeepSpeed settings); use "
        f"--training.precision={like} (allowed: {', '.join(precision.CHOICES)}; docs/precision.md)"
    )


def check_type(value: Any, hint: Any, lenient: bool = False) -> str | None:
    """Return a problem description if `value` does not fit `hint`, else None.

    `lenient` accepts values for annotations we cannot check precisely (TrainingArguments
    uses enums and unions with str); TrainingArguments' own validation runs later anyway."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return None
    if origin is Literal:
        if value in args:
            return None
        return f"got {value!r}; allowed: {', '.join(map(str, args))}"
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        results = [check_type(value, a, lenient) for a in non_none]
        if any(r is None for r in results):
            return None
        if len(non_none) == 1:
            return results[0]
        return f"got {_kind(value)} {value!r}; expected one of: {', '.join(_name(a) for a in non_none)}"
    if hint is bool:
        return None if isinstance(value, bool) else f"expected true/false, got {_kind(value)} {value!r}"
    if hint in (int, float):  # a bool is an int to Python, not to a recipe
        ok = isinstance(value, (int, hint)) and not isinstance(value, bool)
        return None if ok else f"expected {'an integer' if hint is int else 'a number'}, got {_kind(value)} {value!r}"
    if hint is str:
        return None if isinstance(value, str) else f"expected a string, got {_kind(value)} {value!r}"
    if hint in (list, dict) or origin in (list, dict):
        base = origin or hint
        return None if isinstance(value, base) else f"expected a {base.__name__}, got {_kind(value)} {value!r}"
    if isinstance(hint, type):
        import enum

        if issubclass(hint, enum.Enum):
            allowed = [e.value for e in hint]
            return None if value in allowed else f"got {value!r}; allowed: {', '.join(map(str, allowed))}"
        return None if isinstance(value, hint) or lenient else f"expected {hint.__name__}, got {_kind(value)}"
    return None if lenient else f"cannot check type {hint}"


def _kind(value: Any) -> str:
    return {
        type(None): "null",
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "list",
        dict: "mapping",
    }.get(type(value), type(value).__name__)


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))


def _suggest(word: str, candidates) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


# ---- The allowed range of every numeric setting, refused naming the dotted key, the range and the
# value instead of what Trainer would do with it silently (a negative max_steps trains an epoch, a
# negative max_grad_norm turns clipping off). A null value is left to the type check.


@dataclasses.dataclass(frozen=True)
class Range:
    ok: Callable[[float], bool]
    text: str  # what is allowed, after "must be"


def at_least(low: int, unit: str = "") -> Range:
    return Range(lambda v: v >= low, f">= {low}{unit}")


def positive() -> Range:
    return Range(lambda v: v > 0, "> 0")


def fraction(*, closed: bool = False) -> Range:
    return Range((lambda v: 0 <= v <= 1) if closed else (lambda v: 0 <= v < 1), "in [0, 1]" if closed else "in [0, 1)")


def steps_or_ratio(*, zero: bool) -> Range:
    """Trainer's step counts that may be a ratio of the total steps (TrainingArguments 5.x)."""
    low = "0" if zero else "1"
    return Range(
        lambda v: (0 <= v < 1 if zero else 0 < v < 1) or (v >= 1 and float(v).is_integer()),
        f"a whole number of steps >= {low}, or a ratio of the total steps in {'[0' if zero else '(0'}, 1)",
    )


# dotted key -> allowed range; `training.*` keys not of our own are TrainingArguments fields
RANGES: dict[str, Range] = {
    "data.max_length": at_least(8, " tokens"),
    "data.eval_fraction": fraction(),
    "data.max_samples": at_least(1),
    "data.num_proc": at_least(1, " processes"),
    "data.demo_train_size": at_least(1),
    "data.demo_heldout_size": at_least(1),
    "data.pad_to_multiple_of": at_least(1, " tokens"),
    "data.max_empty_target_share": fraction(closed=True),
    "method.lora_r": at_least(1),
    "method.lora_alpha": positive(),  # 0 scales every adapter's output to nothing: the run trains nothing
    "method.lora_dropout": fraction(),
    "eval.samples": at_least(1),
    "eval.max_new_tokens": at_least(1),
    "eval.batch_size": at_least(1),
    "training.lr_reference_batch_size": at_least(1),
    "training.throughput_warmup_steps": at_least(0),
    "training.max_nonfinite_skips": at_least(0),
    "training.loss_chunk_tokens": at_least(1),
    "training.collapse_windows": at_least(1),
    "training.stop_grace": at_least(1, " s"),
    "training.finish_timeout": at_least(1, " s"),
    # TrainingArguments
    "training.max_steps": Range(lambda v: v == -1 or v >= 1, ">= 1, or -1 (unset: training.num_train_epochs decides)"),
    "training.num_train_epochs": positive(),
    "training.learning_rate": positive(),
    "training.warmup_steps": steps_or_ratio(zero=True),
    "training.weight_decay": at_least(0),
    "training.adam_beta1": fraction(),
    "training.adam_beta2": fraction(),
    "training.adam_epsilon": positive(),
    "training.max_grad_norm": Range(lambda v: v >= 0, ">= 0 (0 turns gradient clipping off)"),
    "training.label_smoothing_factor": fraction(),
    "training.per_device_train_batch_size": at_least(1),
    "training.per_device_eval_batch_size": at_least(1),
    "training.gradient_accumulation_steps": at_least(1),
    "training.eval_accumulation_steps": at_least(1),
    "training.logging_steps": steps_or_ratio(zero=False),
    "training.save_steps": steps_or_ratio(zero=False),
    "training.eval_steps": steps_or_ratio(zero=False),
    "training.save_total_limit": at_least(1),
    "training.seed": Range(lambda v: 0 <= v < 2**32, "in [0, 2**32)"),  # numpy's seed range (set_seed)
    "training.data_seed": Range(lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
    "training.dataloader_num_workers": at_least(0),
    "training.ddp_timeout": at_least(1, " s"),
}


def range_problems(cfg) -> list[str]:
    """Every numeric setting of `cfg` outside its range, as `<dotted key>: must be <range>, got <value>`."""
    out = []
    for dotted, rule in RANGES.items():
        section, key = dotted.split(".")
        body = getattr(cfg, section)
        value = body.args.get(key) if section == "training" and key in body.args else getattr(body, key, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # unset (null) or of the wrong type: the type check says so
        if value != value or not rule.ok(value):  # NaN is in no range
            out.append(f"{dotted}: must be {rule.text}, got {value}")
    return out

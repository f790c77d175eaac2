"""`finetune bench`'s options, apart from the benchmark so that parsing them (and rejecting a bad one)
imports no torch: the shapes, methods, layouts and sides it can run (finetune/bench/main.py runs them)."""

from __future__ import annotations

import argparse
import math
import typing

from finetune import precision
from finetune.config.command_line import Parser
from finetune.config.sections import SDPA_BACKENDS, TrainingConfig, sdpa_list_problem

DESCRIPTION = """The trainer `finetune train` runs (ResilientTrainer, built by the run's own builders) against
three baselines on the same workload (plain transformers.Trainer, TRL's SFTTrainer as a plain script and
tuned), interleaved over rounds in one invocation, every side under one precision policy: trained
tokens/s, MFU, peak memory and the ratios ours / each baseline with their spread (docs/benchmarks.md:
the workload, the shapes, the sides and the figures).

  finetune bench --shape qwen2.5-1.5b --methods full lora qlora --seq-len 2048 --batch 8 --steps 30 --out bench-out
  finetune bench --shape tiny --methods lora --steps 2 --rounds 1     # CPU smoke test"""
LOSS_IMPLS = typing.get_args(typing.get_type_hints(TrainingConfig)["loss_impl"])

# Real architectures' configurations (Qwen2.5 config.json on the Hub), random weights here.
_SHAPE_KEYS = (
    "hidden_size num_hidden_layers num_attention_heads num_key_value_heads intermediate_size vocab_size".split()
)
SHAPES = {  # vocab_size None: the tokenizer's
    name: dict(zip(_SHAPE_KEYS, values))
    for name, values in (
        ("tiny", (64, 2, 4, 2, 128, None)),
        ("small", (256, 4, 8, 2, 1024, None)),
        ("qwen2.5-0.5b", (896, 24, 14, 2, 4864, 151936)),
        ("qwen2.5-1.5b", (1536, 28, 12, 2, 8960, 151936)),
    )
}
METHODS = ("qlora", "lora", "full")
LAYOUTS = ("padding_free", "packing", "padded")
# --baseline value -> side (finetune/bench/report.py SIDES)
BASELINES = {"plain-trainer": "plain_trainer", "trl-plain": "trl_plain", "trl-tuned": "trl_tuned"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options in the order --help lists them: the workload, the sides, the data and the runs."""
    add_workload(p)
    add_sides(p)
    add_data_and_runs(p)


def add_workload(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shape",
        choices=SHAPES,
        default="tiny",
        help="model shape: tiny/small (Qwen2 architecture, CPU-sized; vocab = the tokenizer's) or a "
        "real Qwen2.5 configuration",
    )
    p.add_argument("--methods", nargs="+", choices=METHODS, default=["lora"], help="methods to run, each on every side")
    p.add_argument("--seq-len", type=int, default=256, help="max tokens per example (both sides' max_length)")
    p.add_argument("--batch", type=int, default=4, help="examples per step per device (both sides)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    p.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the figures")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="runs per side and method, the sides interleaved (A B C, A B C, ...); a ratio needs 3 for a verdict",
    )


def add_sides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", choices=LAYOUTS, default="padding_free", help="our side's batch layout")
    p.add_argument(
        "--attn-implementation", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"], help="both sides"
    )
    p.add_argument("--gradient-checkpointing", action="store_true", help="both sides")
    p.add_argument("--torch-compile", action="store_true", help="our side only (a speed option of ours)")
    p.add_argument(
        "--baseline",
        nargs="+",
        choices=BASELINES,
        default=list(BASELINES),
        help="the sides beside ours: plain-trainer (transformers.Trainer, padded batches, the model's own "
        "loss, peft LoRA), trl-plain (TRL's SFTTrainer with its defaults: padded batches), trl-tuned "
        "(TRL's padding-free, or BFD packing with --layout packing; its own loss; our SDPA backend policy); "
        "default: all three",
    )
    p.add_argument(
        "--baseline-like-ours",
        action="store_true",
        help="run the baselines with every TrainingArguments setting in which ours differs from theirs set "
        "to ours (read from our side's live arguments; report.md lists them): a like-for-like figure "
        "beside the as-users-run one",
    )
    p.add_argument(
        "--precision",
        choices=precision.CHOICES,
        default="auto",
        help="every side's precision policy (training.precision, docs/precision.md); auto (the default) = "
        "what finetune train uses on this machine: bf16-mixed (fp32 master weights, bf16 compute) on a "
        "bf16 GPU, 16-mixed on other GPUs, 32-true on CPU",
    )
    p.add_argument("--loss-impl", choices=LOSS_IMPLS, default="auto", help="our side's training.loss_impl")
    p.add_argument(
        "--sdpa-backends",
        default="auto",
        help="our side's (and tuned TRL's) model.sdpa_backends: auto, torch_default, or a comma-"
        "separated list of flash, efficient, math, cudnn",
    )
    p.add_argument("--pad-to-multiple-of", type=int, default=None, help="our side's data.pad_to_multiple_of")


def add_data_and_runs(p: argparse.ArgumentParser) -> None:
    """The shape-overhead mode, Liger, the synthetic rows, the seed, and where and how the runs go."""
    p.add_argument(
        "--shape-overhead",
        action="store_true",
        help="instead of the comparison: time forward+backward+AdamW steps of the shape on fixed vs "
        "variable-length rows under SDPA backend choices and bucketing (finetune/bench/shapes.py)",
    )
    p.add_argument("--liger", action="store_true", help="our side only: Liger kernels (CUDA, liger-kernel installed)")
    p.add_argument(
        "--prompt-median", type=float, default=60.0, help="median prompt length of the synthetic rows, tokens"
    )
    p.add_argument(
        "--response-median", type=float, default=180.0, help="median response length of the synthetic rows, tokens"
    )
    p.add_argument("--learning-rate", type=float, default=1e-4, help="both sides")
    p.add_argument("--seed", type=int, default=0, help="data, weights and training seed")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the bundled model's)")
    p.add_argument("--out", default="bench-out", help="directory for report.json, report.md, runs and logs")
    p.add_argument("--run-timeout", type=float, default=3600, help="seconds per run before it is killed")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run both sides in this process (smoke tests: saves start-up; host peaks are then shared)",
    )


# The least value of each whole-number option, and the options that take any finite number > 0 (argparse checks
# only the type: a negative --warmup-steps measured the last step alone, a --prompt-median of 0 ended in a traceback).
LEAST = {"seq_len": 16, "batch": 1, "steps": 1, "rounds": 1, "warmup_steps": 0}
POSITIVE = ("prompt_median", "response_median", "run_timeout")


def check(args: argparse.Namespace, p: argparse.ArgumentParser) -> argparse.Namespace:
    """Values argparse cannot check by type; the SDPA list split."""
    if args.sdpa_backends not in ("auto", "torch_default"):
        given, args.sdpa_backends = args.sdpa_backends, [b.strip() for b in args.sdpa_backends.split(",") if b.strip()]
        if sdpa_list_problem(args.sdpa_backends):  # an empty list (`,,`) or a name torch has not: refused here
            p.error(
                f"--sdpa-backends {given!r}: allowed: auto, torch_default, or a comma-separated list of one or more "
                f"of {', '.join(SDPA_BACKENDS)}"
            )
    for name, least in LEAST.items():
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}")
    for name in POSITIVE:
        if not (getattr(args, name) > 0 and math.isfinite(getattr(args, name))):
            p.error(f"--{name.replace('_', '-')} must be a number > 0, got {getattr(args, name)}")
    return args


def parser(prog: str = "finetune bench") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=DESCRIPTION)
    add_arguments(p)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser()
    return check(p.parse_args(argv), p)

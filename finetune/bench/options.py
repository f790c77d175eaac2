"""`finetune bench`'s options, apart from the benchmark so that parsing them (and rejecting a bad one)
imports no torch: the shapes, methods, layouts and sides it can run (finetune/bench/main.py runs them)."""

from __future__ import annotations

import argparse
import typing

from finetune.cli.options import Parser
from finetune.config.sections import TrainingConfig

DESCRIPTION = """The same workload through this project and through TRL's SFTTrainer (a plain script and a tuned
one), alternating, in one invocation: trained tokens/s, MFU, peak memory and the ratios ours / TRL plain
and ours / TRL tuned (docs/benchmarks.md: the workload, the shapes, the sides and the figures).

  finetune bench --shape qwen2.5-1.5b --methods full lora qlora --seq-len 2048 --batch 8 --steps 30 --out bench-out
  finetune bench --shape tiny --methods lora --steps 2 --rounds 1     # CPU smoke test"""
LOSS_IMPLS = typing.get_args(typing.get_type_hints(TrainingConfig)["loss_impl"])

# Real architectures' configurations (Qwen2.5 config.json on the Hub), random weights here.
SHAPES = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": None,
    },
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1024,
        "vocab_size": None,
    },
    "qwen2.5-0.5b": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
    },
    "qwen2.5-1.5b": {
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
        "vocab_size": 151936,
    },
}
METHODS = ("qlora", "lora", "full")
LAYOUTS = ("padding_free", "packing", "padded")
TRL_CHOICES = {"plain": ("trl_plain",), "tuned": ("trl_tuned",), "both": ("trl_plain", "trl_tuned")}


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--rounds", type=int, default=1, help="runs per side and method, alternating sides")
    p.add_argument("--layout", choices=LAYOUTS, default="padding_free", help="our side's batch layout")
    p.add_argument(
        "--attn-implementation", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"], help="both sides"
    )
    p.add_argument("--gradient-checkpointing", action="store_true", help="both sides")
    p.add_argument("--torch-compile", action="store_true", help="our side only (a speed option of ours)")
    p.add_argument(
        "--trl",
        choices=TRL_CHOICES,
        default="both",
        help="TRL sides: plain (TRL's defaults: padded batches), tuned (TRL's padding-free, or BFD "
        "packing when --layout packing; its own loss; our SDPA backend policy), or both",
    )
    p.add_argument("--loss-impl", choices=LOSS_IMPLS, default="auto", help="our side's training.loss_impl")
    p.add_argument(
        "--sdpa-backends",
        default="auto",
        help="our side's (and tuned TRL's) model.sdpa_backends: auto, torch_default, or a comma-"
        "separated list of flash, efficient, math, cudnn",
    )
    p.add_argument("--pad-to-multiple-of", type=int, default=None, help="our side's data.pad_to_multiple_of")
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


def check(args: argparse.Namespace, p: argparse.ArgumentParser) -> argparse.Namespace:
    """Values argparse cannot check by type; the SDPA list split."""
    if args.sdpa_backends not in ("auto", "torch_default"):
        args.sdpa_backends = [b.strip() for b in args.sdpa_backends.split(",") if b.strip()]
    for name in ("seq_len", "batch", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.seq_len < 16:
        p.error("--seq-len must be >= 16")
    return args


def parser(prog: str = "finetune bench") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=DESCRIPTION)
    add_arguments(p)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser()
    return check(p.parse_args(argv), p)

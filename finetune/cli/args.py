"""Shared command-line plumbing: argument parsing for training."""

from __future__ import annotations

import argparse

TRAIN_EPILOG = """overrides: any recipe value as --section.key=value, e.g.
  --training.max_steps=20 --method.name=full --data.path=my.jsonl --run.name=try1
sections: model, method, data, training (any TrainingArguments field), eval, logging, run"""


def train_parser(prog: str = "finetune/train.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Fine-tune a causal LM from a recipe.",
                                allow_abbrev=False, epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, help="recipe name in recipes/ (e.g. demo) or a path to a YAML file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory of the same name")
    p.add_argument("--resume", nargs="?", const="auto", metavar="PATH",
                   help="continue the run in its run directory from its newest complete checkpoint, or from "
                        "PATH (a checkpoint-N directory); see docs/faults.md")
    return p


def parse_train_args(argv: list[str] | None = None, prog: str = "finetune/train.py"):
    """(known args, override strings); overrides are validated with the recipe."""
    args, rest = train_parser(prog).parse_known_args(argv)
    return args, rest

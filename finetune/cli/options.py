"""The command-line options every entry point shares: `--recipe`, the run options of `train`, and the
launch script's own parser. Read by the `finetune` command, the launch script and preflight."""

from __future__ import annotations

import argparse

TRAIN_EPILOG = """overrides: any recipe value as --section.key=value, e.g.
  --training.max_steps=20 --method.name=full --data.path=my.jsonl --run.name=try1
sections: model, method, data, training (any TrainingArguments field), eval, logging, run"""


def add_recipe(
    parser: argparse.ArgumentParser,
    text: str = "recipe name in recipes/ (e.g. demo) or a YAML path",
    *,
    required: bool = True,
) -> None:
    parser.add_argument("--recipe", required=required, help=text)


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """--overwrite and --resume: what a run does with an existing run directory."""
    parser.add_argument("--overwrite", action="store_true", help="replace an existing run directory of the same name")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        metavar="PATH",
        help="continue the run in its run directory from its newest complete checkpoint, or from "
        "PATH (a checkpoint-N directory); see docs/faults.md",
    )


def train_parser(prog: str = "finetune/train.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Fine-tune a causal LM from a recipe.",
        allow_abbrev=False,
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_recipe(p)
    add_run_options(p)
    return p


def parse_train_args(argv: list[str] | None = None, prog: str = "finetune/train.py"):
    """(known args, override strings); overrides are validated with the recipe."""
    return train_parser(prog).parse_known_args(argv)

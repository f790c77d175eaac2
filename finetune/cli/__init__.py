"""The `finetune` command (console script `finetune = finetune.cli:main`): dispatch.py parses and
dispatches, compare.py holds the compare and sweep subcommands."""

from finetune.cli.dispatch import main

__all__ = ["main"]

"""The `finetune` command (`finetune.cli:main`): dispatch.py parses and dispatches; compare.py: compare, sweep."""

from finetune.cli.dispatch import main

__all__ = ["main"]

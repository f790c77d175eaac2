"""The `finetune` command (`finetune.cli:command`): dispatch.py parses and dispatches; compare.py: compare, sweep."""

import sys

from finetune.cli.dispatch import main
from finetune.errors import exit_without_teardown

__all__ = ["command", "main"]


def command() -> int:
    """The console script and `python -m finetune.cli`: main(); `finetune train`, which imports torch and accelerate
    to launch, then ends without the interpreter's teardown of them (finetune/errors.py exit_without_teardown)."""
    returned = exit_without_teardown() if sys.argv[1:2] == ["train"] else []
    returned.append(main())
    return returned[0]

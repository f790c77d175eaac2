"""`python -m finetune.cli ...`: the `finetune` command."""

import sys

from finetune.cli import command

sys.exit(command())

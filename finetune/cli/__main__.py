"""`python -m finetune.cli ...`: the `finetune` command."""

import sys

from finetune.cli.dispatch import main

sys.exit(main())

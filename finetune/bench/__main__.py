"""`python -m finetune.bench ...`: `finetune bench` (finetune/bench/main.py)."""

from finetune.bench.main import main
from finetune.errors import exit_on_user_error

raise SystemExit(exit_on_user_error(main)())

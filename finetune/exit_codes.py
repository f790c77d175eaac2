"""Exit codes of `finetune train` and finetune/train.py, so schedulers can tell outcomes apart.

    0   completed
    1   crashed (a bug, or a rank failed: the failed rank is named on stderr)
    2   user error: bad recipe, data, launch or --resume (finetune/errors.py)
    3   training diverged: non-finite loss or gradient norm (finetune/resilience.py)
    75  preempted: SIGTERM/SIGINT, complete checkpoint written; rerun with --resume
"""

from finetune.errors import USAGE_EXIT_CODE

# sysexits.h EX_TEMPFAIL, "temporary failure; the user is invited to retry": distinct from a
# crash (1), a user error (2) and a process killed by SIGTERM (143), so a scheduler can requeue.
PREEMPTED = 75
# Not retryable as is: the same data and state diverge again.
NONFINITE = 3
USAGE = USAGE_EXIT_CODE

"""User-facing errors and the exit codes of `finetune train` and finetune/train.py (docs/faults.md
lists each code and what to do). A problem in what the user gave us (recipe, overrides, data, launch,
--resume) is a UserError, printed without a traceback, exit EXIT_USAGE; anything else is a bug and
keeps its traceback. And how those processes start and end: their imports without the cyclic garbage collector
(imports_without_gc), their end without the interpreter's teardown (exit_without_teardown).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import os
import sys

EXIT_USAGE = 2
# Not retryable as is: the same data and state diverge again.
EXIT_NONFINITE = 3
# sysexits.h EX_TEMPFAIL, "temporary failure; the user is invited to retry": distinct from a
# crash (1), a user error (2) and a process killed by SIGTERM (143), so a scheduler can requeue.
EXIT_PREEMPTED = 75


class UserError(Exception):
    """A problem the user can fix; the message says what, where and what is allowed."""


class DataError(UserError):
    """User-facing data problem; the message names the file, the 1-based row and what is wrong."""

    def __init__(self, message: str, *, path: str | None = None, row: int | None = None):
        self.detail = message
        self.path = path
        self.row = row
        where = path or ""
        if row is not None:
            where = f"{where} row {row}" if where else f"row {row}"
        super().__init__(f"{where}: {message}" if where else message)


class ReportedElsewhere(UserError):
    """A user error another rank reports (rank 0 prints it once): this rank exits EXIT_USAGE silently."""


class ConfigError(UserError):
    """One or more problems in the resolved configuration, reported together."""

    def __init__(self, problems: list[str], source: str = "configuration"):
        self.problems = list(problems)
        self.source = source
        n = len(self.problems)
        lines = [f"{source}: {n} problem{'s' if n != 1 else ''}:"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class NothingToDo(Exception):  # noqa: N818 - not an error: exit 0
    """The command has nothing to do (e.g. --resume of a run that completed): said, exit 0."""


def exit_on_user_error(fn):
    """User errors print one clear message and exit EXIT_USAGE; bugs keep their traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NothingToDo as e:
            import os

            if os.environ.get("RANK", "0") == "0":
                print(str(e), file=sys.stderr, flush=True)
            return 0
        except UserError as e:
            if not isinstance(e, ReportedElsewhere):
                print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USAGE)

    return wrapper


def exit_without_teardown() -> list[int]:
    """For an entry point, first thing (before the libraries it imports register exit functions of their own): the
    process ends with the exit code put in the returned list, after every exit function has run (logging's flush,
    temporary files, W&B, the process group's teardown), without the interpreter's teardown of what it imported: 1.3 s
    of CPU with torch, transformers and peft, 0.8 s with torch and accelerate, on the 2-core machine (module by module,
    then the libraries' destructors). Python joins the threads before any exit function. Nothing put (an exception):
    the interpreter's own exit."""
    returned: list[int] = []

    def end() -> None:  # registered first but for logging's shutdown (importing finetune imports logging): run here
        if returned:
            logging.shutdown()  # flushes and closes every handler, a buffering one too
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(returned[0])

    atexit.register(end)
    return returned


@contextlib.contextmanager
def imports_without_gc():
    """For an entry point's imports of torch, transformers, peft and accelerate: the cyclic garbage collector is off
    while they run, then what they made is frozen (gc.freeze: never scanned again) and the collector is on again. The
    imports make over half a million objects and few cycles; the collector passed over them again and again as they
    grew: 1.1-1.5 s of CPU per process on the 2-core machine (docs/speed.md "Start-up"). The imports' own garbage
    cycles are frozen with them (about 14,500 objects, 11 MB of a rank's RSS measured): collecting them first would
    cost 0.5 s."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()

"""User-facing errors: problems in what the user gave us (recipe, overrides, data, launch).

The CLI and train.py print these without a traceback and exit with code 2; anything else
is a bug and keeps its traceback.
"""

USAGE_EXIT_CODE = 2


class UserError(Exception):
    """A problem the user can fix; the message says what, where and what is allowed."""


class ConfigError(UserError):
    """One or more problems in the resolved configuration, reported together."""

    def __init__(self, problems: list[str], source: str = "configuration"):
        self.problems = list(problems)
        self.source = source
        n = len(self.problems)
        lines = [f"{source}: {n} problem{'s' if n != 1 else ''}:"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))

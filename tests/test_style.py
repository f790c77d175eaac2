"""The code's style, as CI enforces it: ruff's lint and formatter over finetune/ and tests/, with the
settings in pyproject.toml. Each check is shown to fail on a crafted file."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True)


def test_lint_passes():
    out = ruff("check", "finetune", "tests")
    assert out.returncode == 0, out.stdout + out.stderr


def test_formatting_is_ruffs():
    out = ruff("format", "--check", "finetune", "tests")
    assert out.returncode == 0, out.stdout + out.stderr


def test_both_refuse_a_crafted_file(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys\nx = {  'a':1 }\n")
    config = str(REPO / "pyproject.toml")
    lint = ruff("check", "--config", config, str(bad))
    assert lint.returncode == 1 and "F401" in lint.stdout, lint.stdout + lint.stderr
    assert ruff("format", "--check", "--config", config, str(bad)).returncode == 1


def test_size_counts_statements_and_tokens_not_lines():
    """tests/code_size.py against a hand count: a docstring, a def and a return are 3 statements; the
    string, `def f ( a ) :` and `return a + 1` are 11 tokens, comments and layout aside. Packing the body
    onto the def's line changes the lines, not the size."""
    from tests.code_size import measure

    spread = '"""Doc."""\n\n\ndef f(a):  # a comment\n    return a + 1\n'
    packed = '"""Doc."""\ndef f(a): return a + 1\n'
    assert measure(spread) == {"statements": 3, "tokens": 11, "lines": 5}
    assert measure(packed) == {"statements": 3, "tokens": 11, "lines": 2}

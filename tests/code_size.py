"""The size of finetune/ in statements and tokens, per module and in total, lines beside them for reference
(docs/architecture.md "Size"). Not a test: `python -m tests.code_size [--base REV] [--all]`.

Statements: AST nodes that are `ast.stmt` (compound ones and their bodies each count; a docstring is one
expression statement). Tokens: Python `tokenize` tokens other than comments, line breaks, indentation
and the encoding and end markers, so neither packing lines nor reflowing them changes the count.
`--base REV` reads the same files at a git revision (`git ls-tree` + `git show`) and prints both.
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "finetune"
LAYOUT = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}


def measure(source: str) -> dict[str, int]:
    """Statements, tokens and lines of one module's source."""
    statements = sum(isinstance(node, ast.stmt) for node in ast.walk(ast.parse(source)))
    tokens = sum(t.type not in LAYOUT for t in tokenize.generate_tokens(io.StringIO(source).readline))
    return {"statements": statements, "tokens": tokens, "lines": len(source.splitlines())}


def sources_at(rev: str | None) -> dict[str, str]:
    """Path -> source of every .py file under finetune/, in the working tree or at git revision `rev`."""
    if rev is None:
        return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in sorted((REPO / PACKAGE).rglob("*.py"))}
    listed = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, PACKAGE], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.split()
    return {
        path: subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True, text=True
        ).stdout
        for path in listed
        if path.endswith(".py")
    }


def sizes(rev: str | None = None) -> dict[str, dict[str, int]]:
    return {path: measure(source) for path, source in sources_at(rev).items()}


def total(per_module: dict[str, dict[str, int]]) -> dict[str, int]:
    keys = ("statements", "tokens", "lines")
    return {k: sum(m[k] for m in per_module.values()) for k in keys}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="a git revision to count too, and to show the change from")
    parser.add_argument("--all", action="store_true", help="every module, not only the changed ones (with --base)")
    args = parser.parse_args(argv)
    now = sizes()
    base = sizes(args.base) if args.base else {}
    zero = {"statements": 0, "tokens": 0, "lines": 0}
    print(
        f"{'module':<48} {'statements':>10} {'tokens':>8} {'lines':>6}" + ("   change (st/tok/lines)" if base else "")
    )
    for path in sorted(set(now) | set(base)):
        a, b = base.get(path, zero), now.get(path, zero)
        if base and a == b and not args.all:
            continue
        row = f"{path:<48} {b['statements']:>10} {b['tokens']:>8} {b['lines']:>6}"
        if base:
            row += (
                f"   {b['statements'] - a['statements']:+d}/{b['tokens'] - a['tokens']:+d}/{b['lines'] - a['lines']:+d}"
            )
        print(row)
    t = total(now)
    print(f"{'total (working tree)':<48} {t['statements']:>10} {t['tokens']:>8} {t['lines']:>6}")
    if base:
        t0 = total(base)
        print(f"{'total at ' + args.base:<48} {t0['statements']:>10} {t0['tokens']:>8} {t0['lines']:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

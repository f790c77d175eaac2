"""The mutation check: deliberate one-line defects across the product, each applied to a copy of a
repository, and only the tests docs/testing.md names for the claim the defect breaks run against it.
A defect those tests let pass is a claim the suite does not prove.

    python -m tests.mutations [--repo DIR] [--only NAME[,NAME...]] [--list] [--no-clean]

--repo: the repository to mutate (default: this one); its tests run against its own copy, so the same
defects can be checked on an earlier commit (`git worktree add /tmp/before COMMIT`). The claims' tests
are read from this repository's docs/testing.md; a test the other repository lacks is left out and
said. First the named tests run once without any defect (the clean run): a test that fails then
proves nothing about a defect, and its defects are reported `invalid`.

Per defect: `caught` (the tests failed), `NOT CAUGHT` (they passed), `does not apply` (the line is not
in the file, or none of the claim's tests exists there), `error` (pytest could not run them). Exit 0
only when every defect was caught. Not collected by pytest (no test_ prefix).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
TESTING_DOC = HERE / "docs" / "testing.md"
CLAIM = re.compile(r"^- \*\*([a-z0-9-]+)\*\*:")
NODE = re.compile(r"`(tests/[\w/]+\.py(?:::[^`\s]+)?)`")
TIMEOUT_S = 3600  # one defect's tests; launched ones take minutes on 2 cores


@dataclass(frozen=True)
class Mutation:
    name: str
    claim: str  # the id of a claim in docs/testing.md
    path: str
    old: tuple[str, ...]  # the line as it reads, in one version of the file or another
    new: tuple[str, ...]  # what it becomes (same index as `old`)
    what: str
    select: str = ""  # a substring the claim's node ids must contain (a parametrization), to keep the run short


MUTATIONS: list[Mutation] = []


def claims(doc: Path = TESTING_DOC) -> dict[str, list[str]]:
    """claim id -> the node ids docs/testing.md names for it, in order."""
    out: dict[str, list[str]] = {}
    current = None
    for line in doc.read_text(encoding="utf-8").splitlines():
        m = CLAIM.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
        elif not line.startswith("  "):
            current = None if line.startswith(("#", "- ")) or not line.strip() else current
        if current is not None:
            current += [n for n in NODE.findall(line) if n not in current]
    return out


def copy_repo(repo: Path, dest: Path) -> Path:
    ignore = shutil.ignore_patterns(".git", "runs", "wandb", "__pycache__", "*.egg-info", ".pytest_cache", "build")
    shutil.copytree(repo, dest, ignore=ignore, symlinks=True)
    return dest


def apply(copy: Path, m: Mutation) -> str | None:
    """Write the defect into the copy; the line it replaced, or None when no version of it is there."""
    path = copy / m.path
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    for old, new in zip(m.old, m.new):
        assert "\n" not in old and "\n" not in new, f"{m.name}: a one-line defect"
        if text.count(old) == 1:
            path.write_text(text.replace(old, new), encoding="utf-8")
            return old
    return None


def pytest(copy: Path, nodes: list[str], *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", *nodes, "-q", "-p", "no:cacheprovider", "-o", "addopts=", *extra]
    return subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def existing(copy: Path, nodes: list[str]) -> list[str]:
    """The node ids the copy's suite has (collected there)."""
    proc = pytest(copy, nodes, "--collect-only")
    found = set(proc.stdout.split())
    return [n for n in nodes if n in found or any(f.startswith(n + "[") or f.startswith(n + "::") for f in found)]


def summary_line(out: str) -> str:
    lines = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    return lines[-1].strip("= ") if lines else out.strip().splitlines()[-1][:120] if out.strip() else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=HERE)
    parser.add_argument("--only", default="", help="comma-separated defect names")
    parser.add_argument("--list", action="store_true", help="list the defects and their tests, run nothing")
    parser.add_argument("--no-clean", action="store_true", help="skip the clean run")
    args = parser.parse_args(argv)
    table = claims()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only.split(",")]
    nodes = {m.name: [n for n in table.get(m.claim, []) if m.select in n] for m in chosen}
    if args.list:
        for m in chosen:
            print(f"{m.name}  [{m.claim}] {m.path}: {m.what}\n    " + "\n    ".join(nodes[m.name] or ["(no tests)"]))
        return 0
    repo = args.repo.resolve()
    print(f"mutation check of {repo}: {len(chosen)} defect(s)")
    with tempfile.TemporaryDirectory(prefix="mutations-") as tmp:
        clean = copy_repo(repo, Path(tmp) / "clean")
        union = list(dict.fromkeys(n for m in chosen for n in nodes[m.name]))
        present = existing(clean, union)
        for n in union:
            if n not in present:
                print(f"  not in {repo.name}: {n}")
        failing: set[str] = set()
        if not args.no_clean and present:
            started = time.monotonic()
            proc = pytest(clean, present, "-rf")
            failing = {n for n in present if re.search(rf"FAILED {re.escape(n)}\b", proc.stdout)}
            print(f"  clean run: {summary_line(proc.stdout)} in {time.monotonic() - started:.0f} s")
            if proc.returncode not in (0, 1):
                print(proc.stdout[-3000:] + proc.stderr[-3000:])
                return 2
        results = [run_one(m, repo, Path(tmp), [n for n in nodes[m.name] if n in present], failing) for m in chosen]
    print("\n| defect | claim | tests run | result | seconds |\n| --- | --- | --- | --- | --- |")
    for m, (result, ran, seconds) in zip(chosen, results):
        print(f"| {m.name}: {m.what} | {m.claim} | {ran} | {result} | {seconds:.0f} |")
    caught = sum(r[0] == "caught" for r in results)
    print(f"\n{caught} of {len(chosen)} defects caught")
    return 0 if caught == len(chosen) else 1


def run_one(m: Mutation, repo: Path, tmp: Path, nodes: list[str], failing: set[str]) -> tuple[str, int, float]:
    started = time.monotonic()
    if not nodes:
        return "does not apply (none of its tests here)", 0, 0.0
    if failing & set(nodes):
        return f"invalid (fails without the defect: {sorted(failing & set(nodes))})", 0, 0.0
    copy = copy_repo(repo, tmp / m.name)
    try:
        if apply(copy, m) is None:
            return f"does not apply (line not in {m.path})", 0, 0.0
        proc = pytest(copy, nodes, "-x")
    except subprocess.TimeoutExpired:
        return "error (timed out)", len(nodes), time.monotonic() - started
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    seconds = time.monotonic() - started
    result = {0: "NOT CAUGHT", 1: "caught"}.get(proc.returncode, f"error (pytest exit {proc.returncode})")
    print(f"  {m.name}: {result} ({summary_line(proc.stdout)}, {seconds:.0f} s)", flush=True)
    return result, len(nodes), seconds


if __name__ == "__main__":
    sys.exit(main())

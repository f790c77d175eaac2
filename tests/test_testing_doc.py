"""docs/testing.md, the list of what the suite proves, against the suite: every test it names exists, every
test module is named under a claim, the mutation check's defects name claims it has, and README.md,
docs/usage.md and docs/testing.md give the same test count and times."""

from __future__ import annotations

import ast
import re

from tests import mutations
from tests.conftest import REPO

DOC = REPO / "docs" / "testing.md"
# "1,234 tests, about 25 minutes ...; the unit set alone, ... about 4 minutes"
FIGURES = re.compile(
    r"([\d,]+)\s+tests,\s+about\s+(\d+)\s+minutes.*?the\s+unit\s+set\s+alone.*?about\s+(\d+)\s+minutes", re.S
)


def _functions(path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, ast.FunctionDef)}


def test_every_named_test_exists():
    table = mutations.claims(DOC)
    assert len(table) >= 40 and all(table.values()), [c for c, nodes in table.items() if not nodes]
    missing = []
    for node in {n for nodes in table.values() for n in nodes}:
        path, _, function = node.partition("::")
        if not (REPO / path).is_file() or (function and function.split("[")[0] not in _functions(REPO / path)):
            missing.append(node)
    assert missing == []


def test_every_test_module_is_named_under_a_claim():
    named = {n.partition("::")[0] for nodes in mutations.claims(DOC).values() for n in nodes}
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py")}
    assert sorted(modules - named) == []
    assert "tests/training/test_strategies.py" in named  # control: a module the page names is seen


def test_every_defect_of_the_mutation_check_breaks_a_listed_claim():
    table = mutations.claims(DOC)
    assert len(mutations.MUTATIONS) >= 12
    assert [m.name for m in mutations.MUTATIONS if m.claim not in table] == []
    assert len({m.name for m in mutations.MUTATIONS}) == len(mutations.MUTATIONS)
    for m in mutations.MUTATIONS:  # the line each defect changes is in the product as it is now
        text = (REPO / m.path).read_text(encoding="utf-8")
        assert any(text.count(old) == 1 for old in m.old), m.name


def test_the_readme_usage_and_testing_pages_give_the_same_figures():
    figures = {}
    for name in ("README.md", "docs/usage.md", "docs/testing.md"):
        found = FIGURES.search((REPO / name).read_text(encoding="utf-8"))
        assert found, f"{name} gives no test count and times"
        figures[name] = found.groups()
    assert len(set(figures.values())) == 1, figures

"""Issue 27 item 10: the README is the entry point and links what docs/ explains instead of repeating
it; the two Quick start commands stay exactly as .ci/run greps them."""

from __future__ import annotations

from tests.conftest import REPO

README = (REPO / "README.md").read_text()
QUICK_START = (
    "pip install torch==2.13.0 -e . && finetune train --recipe demo",
    'pip install torch==2.13.0 -e ".[test]" && python -m pytest',
)
# (what the README repeated, where it lives)
OWNED_BY_DOCS = [
    ("| policy | parameters the optimizer updates |", "docs/precision.md"),
    ("**Step clock**", "docs/run_record.md"),
    ("**Tokens and examples**", "docs/run_record.md"),
    ("**Host memory**: on Linux the kernel's resident-set high-water mark", "docs/run_record.md"),
]


def test_the_quick_start_commands_are_there_exactly():
    for command in QUICK_START:
        assert f"    {command}\n" in README
    assert (
        "test_command='pip install torch==2.13.0 -e \".[test]\" && python -m pytest'"
        in (REPO / ".ci" / "run").read_text()
    )


def test_the_readme_links_the_docs_instead_of_repeating_them():
    for text, doc in OWNED_BY_DOCS:
        assert text not in README, f"README repeats {doc}: {text!r}"
    for doc in sorted((REPO / "docs").glob("*.md")):
        assert f"docs/{doc.name}" in README, f"README does not link docs/{doc.name}"
    assert (REPO / "docs" / "precision.md").read_text().count("| policy | parameters the optimizer updates |") == 1

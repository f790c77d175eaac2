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


def test_every_document_the_repository_cites_is_in_it():
    """The repository stands alone: `finetune recipes` and recipes/qlora_baseline.yaml cited a DESIGN.md
    it never had. Every docs/NAME.md and top-level NAME.md that shipped text names exists."""
    import re

    cited = re.compile(r"(?<![\w/.-])(docs/[\w.-]+\.md|[A-Z][A-Z_]+\.md)")
    texts = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "recipes").glob("*.yaml")]
    texts += (REPO / "finetune").rglob("*.py")
    found = {(p.name, m) for p in texts for m in cited.findall(p.read_text())}
    missing = {(name, m) for name, m in found if not (REPO / m).is_file() and m != "PERFORMANCE.md"}  # nccl-tests'
    assert not missing
    assert ("qlora_baseline.yaml", "docs/compare.md") in found  # control: the recipe's citation is seen


def test_the_readme_is_read_in_five_minutes():
    """What a newcomer needs (what it is, the two commands, the demo's output, the card's command, plan,
    compare, doctor, multi-node, the docs); the rest lives in docs/ (it was 434 lines)."""
    assert len(README.splitlines()) <= 200
    for needed in ("accelerate launch finetune/train.py --recipe zero2", "finetune plan", "finetune compare"):
        assert needed in README
    for needed in ("finetune doctor", "## Multi-node", "exact match     0.0% ->", "## Documentation"):
        assert needed in README

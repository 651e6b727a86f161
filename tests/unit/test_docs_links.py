"""The documentation is self-contained: every relative link in README.md and docs/*.md resolves to a file
in the repository, and no file of the package, the docs or the tests cites a Markdown document that is not
in it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target "title"); not images
CITED_MD = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)\b")


def relative_links(path: Path) -> list[str]:
    """Link targets of a Markdown file that point into the repository (no scheme, not a bare #anchor),
    code blocks left out."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_relative_links_resolve_inside_the_repository(path):
    broken = []
    for target in relative_links(path):
        resolved = (path.parent / target.split("#", 1)[0]).resolve()
        if not resolved.exists() or not resolved.is_relative_to(ROOT):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)} links to missing files: {broken}"


def test_the_link_check_sees_links():
    assert "docs/server.md" in relative_links(ROOT / "README.md")


def _cited(path: Path) -> set[str]:
    return set(CITED_MD.findall(path.read_text(errors="replace")))


def test_no_file_cites_a_document_missing_from_the_repository():
    files = [*DOCS, *(ROOT / "engram").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    missing = []
    for path in files:
        for name in sorted(_cited(path)):
            candidates = [path.parent / name, ROOT / name, ROOT / "docs" / name]
            if not any(c.exists() for c in candidates):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "cited documents that are not in the repository:\n" + "\n".join(missing)

"""The front door: README.md fits a page and every relative link and picture in it and in docs/ resolves
(``mkdocs build --strict`` in CI checks the site itself)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose(md: Path):
    """(line number, line) outside fenced code blocks."""
    fence = False
    for n, line in enumerate(md.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            yield n, line


def anchors(md: Path) -> set:
    return {slug(line.lstrip("#")) for _, line in prose(md) if line.startswith("#")}


def test_readme_fits_a_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("md", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_resolves(md):
    bad = []
    for n, line in prose(md):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                bad.append(f"{md.name}:{n}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{md.name}:{n}: {target}: no such heading")
    assert not bad, "\n".join(bad)


def test_every_docs_page_is_reachable_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for _, line in prose(ROOT / "README.md")
              for t in LINK.findall(line) if t.startswith("docs/")}
    assert {p.resolve() for p in PAGES[1:]} <= linked | {(ROOT / "docs" / "index.md").resolve()}

"""The front door: README.md fits a page and every relative link and picture in it and in docs/ resolves
(``mkdocs build --strict`` in CI checks the site itself)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from torch import nn

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


def test_the_results_are_a_page_and_the_readmes_results_a_table():
    """docs/results.md shows the current results only (earlier rounds: docs/changelog.md) in at most 350 lines;
    the README's results section is at most 50, one table of headline numbers linking to it."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("\n## Results\n"):]
    section = section[:section.index("\n## ", 5)]
    assert len(section.strip().splitlines()) <= 50 and section.count("](docs/results.md#") >= 5
    results = (ROOT / "docs" / "results.md").read_text()
    assert len(results.splitlines()) <= 350, len(results.splitlines())
    assert not re.search(r"\b(this|first|last) round\b", results, re.I)  # no lab notebook


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


class _Unit(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x):
        return x + self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))


def _users_net() -> nn.Module:
    """The user's own model the snippets name: ``body`` = conv, BN, ReLU, conv, GroupNorm, ReLU (as the docs'
    comment says), then two residual units with a ``bn2`` each."""
    net = nn.Module()
    net.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), _Unit(16), _Unit(16))
    return net


@pytest.mark.parametrize("md, heading", [("README.md", "## 3. Put a block into a timm or torchvision model"),
                                         ("docs/blocks.md", "## In other people's models")])
def test_the_insert_attention_snippets_run_and_put_as_many_blocks_as_their_comments_say(md, heading, monkeypatch):
    import visattn

    text = (ROOT / md).read_text()
    section = text[text.index(heading):]
    section = section[:section.find("\n## ", 1)]
    code = "\n".join(re.findall(r"```python\n(.*?)```", section, re.S))
    said = [int(m.group(1)) if (m := re.search(r"#\s*(\d+):", line)) else None
            for line in code.splitlines() if "insert_attention(" in line]
    assert len(said) >= 3 and None not in said, said  # every insertion says how many blocks it puts
    put, insert = [], visattn.insert_attention
    monkeypatch.setattr(visattn, "insert_attention", lambda *a, **k: put.append(insert(*a, **k)) or put[-1])
    exec(compile(code, md, "exec"), {"my_net": _users_net(), "MyNet": _users_net})
    assert put == said

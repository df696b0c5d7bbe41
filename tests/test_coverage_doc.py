"""docs/models.md's coverage table and the README's claim are bench/coverage.py's output from its results file."""
from __future__ import annotations

import json

import pytest

from bench import coverage


@pytest.fixture(scope="module")
def data():
    if not coverage.RESULTS.is_file():
        pytest.fail("bench/results/coverage.json is missing: python -m bench.coverage --write")
    return json.loads(coverage.RESULTS.read_text())


def test_results_file_says_what_made_it_and_covers_the_list(data):
    assert data["command"].startswith("python -m bench.coverage") and data["git"]
    assert data["timm"] and data["torchvision"]
    assert [r["arch"] for r in data["rows"]] == coverage.ARCHS and len(coverage.ARCHS) >= 77
    for r in data["rows"]:
        assert (r["sites"] > 0) == (r["refusal"] is None), r
        assert not (r["refusal"] or "").startswith("crash"), r


def test_docs_table_matches_the_results_file(data):
    page = coverage.DOC.read_text()
    assert coverage.BEGIN in page and coverage.END in page
    block = page.split(coverage.BEGIN, 1)[1].split(coverage.END, 1)[0].strip()
    assert block == coverage.table(data)


def test_readme_claim_matches_the_results_file(data):
    readme = coverage.README.read_text()
    assert readme.count(coverage.claim(data)) == 1
    placed = sum(1 for r in data["rows"] if r["sites"] and r["identity"] and r["backward"])
    assert coverage.claim(data) == f"blocks go into {placed} of {len(data['rows'])} architectures"


def test_the_structural_rule_reaches_at_least_45_and_keeps_the_family_rows(data):
    rows = {r["arch"]: r for r in data["rows"]}
    placed = [a for a, r in rows.items() if r["sites"] and r["identity"] and r["backward"]]
    assert len(placed) >= 45
    for arch in ("timm/resnet18", "torchvision/resnet18", "timm/regnetx_002", "timm/convnext_atto",
                 "timm/efficientnet_b0", "torchvision/mobilenet_v3_small", "timm/hrnet_w18_small"):
        assert rows[arch]["rule"] == "family", arch  # the family rule's sites, unchanged

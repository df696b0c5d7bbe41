"""docs/blocks.md's catalogue and README.md's mechanism count are what ``python -m bench.catalogue --write`` makes
from the registry and bench/results/block_speed.json now: a block registered without its row, or with a class
missing its catalogue attributes, fails here."""
from __future__ import annotations

import json

import pytest

from bench import catalogue


@pytest.fixture(scope="module")
def rows():
    return catalogue.catalogue_rows()


def test_every_block_class_has_its_catalogue_attributes():
    assert catalogue.missing_attributes() == []


def test_the_catalogue_table_and_readme_count_are_current(rows):
    doc, readme = catalogue.render(rows)
    fix = "run: python -m bench.catalogue --write"
    assert catalogue.DOC.read_text() == doc, f"docs/blocks.md's catalogue is out of date; {fix}"
    assert catalogue.README.read_text() == readme, f"README.md's mechanism count is out of date; {fix}"
    names = [r["name"] for r in rows]
    table = doc.split(catalogue.BEGIN)[1].split(catalogue.END)[0]
    assert all(f"| `{n}` |" in table for n in names)  # a row per registered block
    assert "[docs/blocks.md](docs/blocks.md#catalogue)" in readme and "\n## Catalogue\n" in doc


def test_mechanisms_are_counted_as_distinct_papers():
    rows = [{"name": "none", "paper": ""}, {"name": "spatial", "paper": "Woo et al., CBAM, arXiv 1807.06521"},
            {"name": "cbam", "paper": "Woo, Park, Lee, Kweon, 2018, CBAM, arXiv 1807.06521"},
            {"name": "simam", "paper": "Yang et al., SimAM, ICML, PMLR 139 (no arXiv)"}, {"name": "x", "paper": None}]
    assert catalogue.count_mechanisms(rows) == (3, 4)  # one CBAM, SimAM by its text, x by its name; none left out
    papers, blocks = catalogue.count_mechanisms()
    assert blocks == len(catalogue.visattn.list_attention()) - 1 and 11 <= papers <= blocks


def test_flops_count_the_cpu_flash_attention():
    """The non-local block at 64 channels on 32 x 32: its qkv (64 -> 3 x 32) and output (32 -> 64) projections
    and its attention over N = 1024 positions, q k^T and the weighted sum (2 N^2 d each, d = 32), which
    FlopCounterMode alone counts as 0 on the CPU's flash kernel."""
    n, c, d = 32 * 32, 64, 32
    params, flops = catalogue.measure("nonlocal")
    assert flops == 2 * n * c * 3 * d + 2 * n * d * c + 2 * (2 * n * n * d)
    assert params == (c * 3 * d + 3 * d) + (d * c + c) + 2 * c
    assert catalogue.measure("se") == (64 * 4 + 4 + 4 * 64 + 64, 2 * 64 * 4 * 2)  # two 1x1 convs on a 1x1 map


def test_speed_ratios_read_the_block_speed_file(tmp_path):
    path = tmp_path / "block_speed.json"
    path.write_text(json.dumps({"precision": "bf16", "device": "cuda", "date": "2026-12-06", "threads": 1,
                                "ratios": {"se": {"eager": {"before": 0.5, "after": 0.987}, "compiled": {"after": 1.0}},
                                           "cbam": {"eager": 0.9}}}))
    ratios, where = catalogue.speed_ratios(path)
    assert ratios == {"se": "0.99 / 1.00", "cbam": "0.90"} and "bf16 on cuda" in where
    assert catalogue.speed_ratios(tmp_path / "missing.json")[0] == {}


def test_check_mode_fails_on_a_stale_page(tmp_path, monkeypatch, rows):
    monkeypatch.setattr(catalogue, "catalogue_rows", lambda: rows)
    doc = tmp_path / "blocks.md"
    doc.write_text(f"intro\n{catalogue.BEGIN}\nold table\n{catalogue.END}\noutro\n")
    readme = tmp_path / "README.md"
    readme.write_text(catalogue.README.read_text())
    monkeypatch.setattr(catalogue, "DOC", doc)
    monkeypatch.setattr(catalogue, "README", readme)
    assert catalogue.main(["--check"]) == 1
    assert catalogue.main(["--write"]) == 0 and catalogue.main(["--check"]) == 0
    text = doc.read_text()
    assert text.startswith(f"intro\n{catalogue.BEGIN}\n") and text.endswith(f"{catalogue.END}\noutro\n")
    assert "old table" not in text

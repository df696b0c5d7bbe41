"""docs/maps.md's transformer coverage table is what ``python -m bench.coverage --maps`` generates now: one row per
entry of visattn.maps.families' registry (and per module the recorder taps itself), each recorded on a tiny
random-weight model with the output unchanged, and one line per module that cannot be recorded, saying why."""
from __future__ import annotations

import pytest

from bench import coverage
from visattn.maps import families


@pytest.fixture(scope="module")
def data():
    return coverage.map_rows()


def test_the_docs_table_is_what_the_check_generates(data):
    page = coverage.MAPS_DOC.read_text()
    assert page.count(coverage.MAPS_BEGIN) == 1 and page.count(coverage.MAPS_END) == 1
    block = page.split(coverage.MAPS_BEGIN, 1)[1].split(coverage.MAPS_END, 1)[0].strip()
    assert block == coverage.maps_table(data), "docs/maps.md's family table is out of date: python -m bench.coverage --maps"


def test_every_registry_entry_records_on_a_tiny_model_and_leaves_its_output_alone(data):
    entries = len(coverage.BASE) + len(families.FAMILIES) + 1  # + MobileViT v1's entry
    assert len(data["rows"]) == entries
    labels = [r["family"] for r in data["rows"]]
    assert len(set(labels)) == len(labels) and all(labels), labels
    for r in data["rows"]:
        assert r["checked"], f"{r['family']}: no example model reaches this entry (add one to MAP_EXAMPLES)"
        for c in r["checked"]:
            assert c["records"] > 0 and c["unchanged"], (r["family"], c)
            assert c["cells"].startswith("at "), (r["family"], c)
        assert r["where"] and r["record"], r["family"]
    kinds = {r["family"]: r["record"] for r in data["rows"]}
    assert kinds["Swin v1 and v2"] == ["token `(B, h, N, N)`"]  # windows placed on the whole grid
    assert kinds["CaiT and XCiT (class attention)"] == ["token `(B, h, 1, 1+N)`"]
    assert kinds["XCiT, EdgeNeXt (cross-covariance)"] == ["covariance `(B, h, d, d)`"]


def test_each_module_that_cannot_be_recorded_is_in_its_example_records_nothing_and_says_why(data):
    assert set(coverage.UNRECORDABLE_EXAMPLES) == set(families.UNRECORDABLE)
    assert len(data["refused"]) == len(families.UNRECORDABLE)
    for r in data["refused"]:
        assert r["present"] and r["records"] == 0 and r["said"], r
    table = coverage.maps_table(data)
    assert all(why in table for why in families.UNRECORDABLE.values())


def test_the_families_not_recorded_yet_are_in_no_registry_entry():
    for label, _, cls in coverage.NOT_YET:
        assert cls not in coverage.BASE and cls not in families.UNRECORDABLE, label
        assert not any(cls in f.modules for f in (*families.FAMILIES, families.MOBILEVIT)), label


def test_a_table_row_says_when_recording_changed_the_output_or_no_model_checked_it():
    data = {"rows": [{"family": "X", "modules": ["m.A"], "record": ["token"], "where": "w",
                      "checked": [{"example": "e", "records": 2, "unchanged": False, "cells": "at 32 px: 8x8"}]},
                     {"family": "Y", "modules": ["m.B"], "record": [], "where": "", "checked": []}],
            "refused": []}
    table = coverage.maps_table(data)
    assert "(**output changed**)" in table and "**not checked**" in table


@pytest.mark.slow
def test_the_families_not_recorded_yet_record_nothing():
    assert coverage.not_yet_check() == []

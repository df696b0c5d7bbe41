"""``python -m bench.coverage --sweep``: every timm and torchvision classifier built, recorded and given blocks; what
works, what refuses in one line and what crashes, each told apart."""
from __future__ import annotations

import pytest

import visattn
from bench import coverage


def test_a_refusal_in_one_line_is_not_a_crash():
    row = coverage.sweep_row("torchvision/squeezenet1_1", max_params=10**9)
    assert row["crash"] is None and row["skipped"] is None
    assert row["insert"] == 0 and row["record"] == 0  # no residual branch, no attention: both say so in one line
    assert row["params"] == sum(p.numel() for p in coverage.build("torchvision/squeezenet1_1").parameters())


def test_a_crash_and_a_refusal_of_many_lines_are_reported(monkeypatch):
    def crash(model, name, **kw):
        raise RuntimeError("boom\nmore")

    monkeypatch.setattr(visattn, "insert_attention", crash)
    assert coverage.sweep_row("torchvision/squeezenet1_1", 10**9)["crash"] == "insert_attention: RuntimeError: boom"

    def long_refusal(model, name, **kw):
        raise ValueError("no sites\nsecond line")

    monkeypatch.setattr(visattn, "insert_attention", long_refusal)
    assert coverage.sweep_row("torchvision/squeezenet1_1", 10**9)["crash"] == "insert_attention refused in 2 lines"


def test_models_over_the_size_limit_are_skipped_unbuilt():
    row = coverage.sweep_row("torchvision/squeezenet1_1", max_params=1000)
    assert row["skipped"].endswith("parameters (over --max-params)") and row["insert"] is None


def test_the_sweep_exits_1_when_something_crashed(monkeypatch, capsys):
    monkeypatch.setattr(coverage, "sweep_row", lambda arch, m: {"arch": arch, "crash": "x: E", "skipped": None,
                                                                  "insert": 0, "record": 0})
    assert coverage.main(["--sweep", "all", "--only", "timm/a", "timm/b"]) == 1
    assert "2 architectures: 2 checked" in capsys.readouterr().out


@pytest.mark.parametrize("which", ["modules"])
def test_the_names_swept_are_the_packages_classifiers(which, monkeypatch):
    import timm

    monkeypatch.setattr(coverage, "_params", lambda arch: len(arch))  # no builds: the shortest name stands in
    names = coverage.sweep_names(which)
    assert len([n for n in names if n.startswith("timm/")]) == len(timm.list_modules())
    smallest = min(timm.list_models(module="resnet"), key=lambda n: (len(f"timm/{n}"), n))
    assert "torchvision/resnet18" in names and f"timm/{smallest}" in names
    assert len(coverage.sweep_names("all")) > len(timm.list_models())

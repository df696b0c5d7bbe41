"""Reproducible installs: constraints.txt pins every dependency pyproject.toml declares (bar the PyTorch pair,
which the Makefile installs first), each pin inside the declared range, and CI runs on exactly those pins."""
from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
TORCH_PAIR = {"torch", "torchvision"}


def pins() -> dict:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version"
            out[canonicalize_name(name)] = version
    return out


def declared() -> list:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in ("dev", "docs"):
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def test_every_declared_dependency_is_pinned_inside_its_range():
    locked = pins()
    for req in declared():
        name = canonicalize_name(req.name)
        if name in TORCH_PAIR:
            assert name not in locked  # the Makefile's matched pair, per platform
            continue
        assert name in locked, f"{req.name} is declared but not pinned in constraints.txt (run make lock)"
        assert req.specifier.contains(locked[name], prereleases=True), \
            f"constraints.txt pins {req.name}=={locked[name]}, outside pyproject's {req.specifier}"


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI's environment is installed from constraints.txt; "
                    "a hand-made one need not be")
def test_ci_runs_on_the_pinned_versions():
    wrong = []
    for name, version in pins().items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # a platform-specific dependency this platform does not install
        if have != version:
            wrong.append(f"{name} {have} (pinned {version})")
    assert not wrong, "installed versions differ from constraints.txt: " + ", ".join(wrong)

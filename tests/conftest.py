"""Shared fixtures: where the real CIFAR-10 images are, small synthetic configs."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
TIMING = {"images_per_s", "epoch_seconds", "wall_seconds", "eval_seconds"}  # metrics that vary run to run


def metrics_rows(run_dir: Path) -> List[Dict]:
    """The run's metrics.jsonl rows without the timing fields (for comparing two runs exactly)."""
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def real_data_path() -> Path | None:
    """The JPEG CIFAR-10 archive: $VISATTN_CIFAR10, else ../shared/data beside the checkout."""
    env = os.environ.get("VISATTN_CIFAR10")
    cands = [Path(env)] if env else []
    cands.append(ROOT.parent / "shared" / "data" / "cifar10-train-jpeg.tar.gz")
    for p in cands:
        if p.exists():
            return p
    return None


@pytest.fixture(scope="session")
def cifar10_path() -> Path:
    p = real_data_path()
    if p is None:
        pytest.skip("real CIFAR-10 images not found: set VISATTN_CIFAR10 or place cifar10-train-jpeg.tar.gz in ../shared/data")
    return p


@pytest.fixture
def tiny_overrides(tmp_path):
    """Overrides that make any config a seconds-long synthetic run in a temporary run dir."""
    return [
        f"run_dir={tmp_path / 'run'}",
        "data.source=synthetic",
        "data.synthetic_size=240",
        "data.val_size=40",
        "train.batch_size=40",
        "eval.batch_size=100",
        "log.progress=false",
    ]

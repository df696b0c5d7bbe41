"""Shared fixtures: where the real CIFAR-10 images are, small synthetic configs."""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List

import numpy as np
import pytest
import torch

from visattn.attention import AttentionTap
from visattn.maps import colorize

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


@contextmanager
def recording(module: torch.nn.Module) -> Iterator[list]:
    """Attach one sink to every tap under ``module`` (what a recorder does, without visattn.maps); yields
    the list of records, named by module path without the trailing ``.tap``."""
    sink: list = []
    taps = [(name, m) for name, m in module.named_modules() if isinstance(m, AttentionTap)]
    for name, tap in taps:
        tap.sink, tap.record_name = sink, name.removesuffix(".tap")
    try:
        yield sink
    finally:
        for _, tap in taps:
            tap.sink = None


def has_colour_bar(picture: np.ndarray, colormap: str = "jet") -> bool:
    """Some row holds the whole colour map, cold to hot, over at least 150 pixels."""
    lut = colorize(torch.linspace(0, 1, 256), colormap) * 255
    for row in picture[::-1]:  # the bar sits at the bottom
        d = torch.cdist(torch.tensor(row, dtype=torch.float32), lut)
        dist, idx = d.min(1)
        run = idx[dist < 2]
        if len(run) >= 150 and run[0] <= 2 and run[-1] >= 253 and bool((run.diff() >= 0).all()):
            return True
    return False

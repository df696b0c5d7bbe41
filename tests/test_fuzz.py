"""Property-based fuzzing (Hypothesis) of the train command: hostile config overrides and small hostile datasets.

Every example must end with exit status 0 or 2 and, when 2, one ``error: ...`` line (warnings aside), never a
traceback; an example aimed at an existing run's folder must leave its files byte-for-byte as they were.
Examples are bounded (count, sizes) and derandomized so CI runs the same ones in well under a minute.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import yaml
from conftest import SMOKE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from visattn.cli import main

BASE = ["data.source=synthetic", "data.synthetic_size=200", "data.val_size=50", "model.widths=[8,16,16]",
        "model.stem_width=8", "model.attention=none", "log.progress=false", "log.maps_every=0", "device=cpu",
        "eval.tta=none", "precision=fp32", "train.batch_size=25", "train.epochs=1", "train.max_steps=1",
        "log.tensorboard=false"]
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# raw YAML texts a hostile user might type as a value
HOSTILE_YAML = ["&a [*a]", "{a: 1, a: 2}", "[" * 200 + "]" * 200, ".nan", "-.inf", "1e999", "0x7fffffffffffffffffff",
                "~", "''", "[1, [2, [3]]]", "!!python/object:os.system 'true'", "{", "&a [1, *a]", "*undefined",
                "[-1, 32, 64]", "[2, 3]", "[.nan, 0, 0]", "{name: Resize, height: 64, width: 64}",
                "[{name: Resize, height: 64, width: 64}]", "x" * 3000]
KEYS = ["seed", "model.widths", "model.stem_width", "model.units", "model.attention", "model.head_scale",
        "optim.betas", "optim.lr", "optim.name", "data.mean", "data.std", "data.synthetic_size", "data.image_size",
        "data.val_size", "data.augment.extra", "data.loader", "data.max_image_pixels", "train.batch_size",
        "train.epochs", "train.label_smoothing", "eval.every", "log.probe_size", "sched.warmup_epochs",
        "optim.lrr", "bogus", "data", "model.name", "model.widths.x"]


def _snapshot(folder: Path) -> Dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _main(argv: List[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = e.code
    return rc, err.getvalue()


def _check_outcome(rc: int, err: str) -> None:
    assert rc in (0, 2), (rc, err)
    assert "Traceback" not in err, err
    if rc == 2:
        lines = [ln for ln in err.strip().splitlines() if not ln.startswith("warning: ")]
        assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) < 800, err


def _text(value) -> str:
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


# values a careful user might give (so that many examples get past the checks and train a step)
PLAUSIBLE = [0, 1, 2, 3, 8, 16, 24, 32, 0.0, 0.5, 0.9, 0.001, 1.0, [8, 16, 16], [8, 8, 8], [1, 1, 1], [0.9, 0.99],
             [0.5, 0.5, 0.5], [0.2, 0.2, 0.2], "cbam", "se", "none", "adamw", "sgd", "tensor", "albumentations",
             [{"name": "ColorJitter", "brightness": 0.2}], [{"name": "HorizontalFlip"}], "resnet_fast", 64, 1000]
hostile = st.one_of(
    st.integers(-(2**70), 2**70), st.integers(-3, 70),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(-2, 2),
    st.booleans(), st.none(), st.lists(st.integers(-5, 40), max_size=4), st.lists(st.floats(-1, 2), max_size=3),
    st.sampled_from(HOSTILE_YAML), st.text(max_size=12),
)
values = st.one_of(st.sampled_from(PLAUSIBLE), hostile)  # half and half
# per key, values of the right type at or near the edges of what is allowed (so many examples train a step)
EDGES = {
    "seed": [0, 1, 2**32 - 1], "model.widths": [[8, 16, 16], [1, 1, 1], [4, 4]], "model.stem_width": [1, 8],
    "model.units": [[1, 1, 1], [0, 0, 0], [2, 0, 1]], "model.head_scale": [1.0, 0.0, 1e-30],
    "model.attention": ["cbam", "se", "eca", "coord", "nonlocal", "mhsa2d", ["none", "se", "spatial"]],
    "optim.betas": [[0.9, 0.99], [0.0, 0.0], [0.999999, 0.0]], "optim.lr": [1e-6, 0.1, 100],
    "optim.name": ["adamw", "sgd"], "data.mean": [[0, 0, 0], [1, 1, 1]], "data.std": [[1e-3, 1, 1], [100, 100, 100]],
    "data.synthetic_size": [20, 60, 200], "data.image_size": [8, 16, 40], "data.val_size": [10, 50, 150],
    "data.loader": ["tensor", "albumentations"], "data.max_image_pixels": [64, 2**31],
    "data.augment.extra": [[{"name": "ColorJitter", "brightness": 0.5}], [{"name": "Rotate", "limit": 30}]],
    "train.batch_size": [1, 7, 149, 150], "train.epochs": [1, 2], "train.label_smoothing": [0.0, 0.99],
    "eval.every": [1, 5], "log.probe_size": [1, 64], "sched.warmup_epochs": [0, 100],
}
edges = st.sampled_from(sorted(EDGES)).flatmap(lambda k: st.tuples(st.just(k), st.sampled_from(EDGES[k])))
overrides = st.one_of(st.lists(st.tuples(st.sampled_from(KEYS), values), min_size=1, max_size=3),
                      st.lists(edges, min_size=1, max_size=4))


@pytest.mark.timeout(300)
@FUZZ
@given(pairs=overrides, into_existing=st.booleans())
def test_fuzzed_config_overrides_end_in_0_or_one_error_line(finished_run, pairs, into_existing):
    argv_over = [f"{k}={_text(v)}" for k, v in pairs]
    before = _snapshot(finished_run)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = finished_run if into_existing else Path(tmp) / "run"
        rc, err = _main(["--config", str(SMOKE), *BASE, f"data.cache_dir={tmp}/cache", *argv_over,
                         f"run_dir={run_dir}"])
    _check_outcome(rc, err)
    if into_existing:
        assert rc == 2, err  # a new run never writes into a finished run's folder
    assert _snapshot(finished_run) == before


# -------------------------------------------------------------------------------------- hostile datasets


def _bomb_png(w: int, h: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr
            + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)))


def _hostile(root: Path, kind: str, where: Path) -> None:
    """Put one hostile or odd file of ``kind`` into ``where`` (a class folder of the dataset at ``root``)."""
    where.mkdir(parents=True, exist_ok=True)
    good = root / "train" / "ant" / "0.png"  # a real image written before any hostile file (a glob may list a FIFO first)
    if kind == "fifo":
        os.mkfifo(where / "fifo.png")
    elif kind == "dev-zero":
        (where / "zero.png").symlink_to("/dev/zero")
    elif kind == "link-out":
        (where / "out.png").symlink_to(root.parent / "outside.png")
    elif kind == "dangling-link":
        (where / "dangling.png").symlink_to(root / "nothing-here.png")
    elif kind == "bomb":
        (where / "bomb.png").write_bytes(_bomb_png(30000, 30000))
    elif kind == "truncated":
        (where / "cut.png").write_bytes(good.read_bytes()[:40])
    elif kind == "empty-file":
        (where / "empty.jpg").write_bytes(b"")
    elif kind == "grey16":
        Image.fromarray(np.full((20, 20), 40000, np.uint16)).save(where / "g16.png")
    elif kind == "cmyk":
        Image.new("CMYK", (16, 16), (10, 200, 30, 5)).save(where / "cmyk.jpg")
    elif kind == "palette":
        Image.new("P", (40, 24), 3).save(where / "pal.png")
    elif kind == "huge-dims":
        Image.new("L", (4000, 1), 9).save(where / "wide.png")
    elif kind == "loose":
        shutil.copy2(good, root / "train" / "loose.png")
    elif kind == "empty-class":
        (root / "train" / "zzz").mkdir(exist_ok=True)
    elif kind == "text-file":
        (where / "notes.txt").write_text("not an image")
    elif kind == "folder-named-png":
        (where / "dir.png").mkdir()


KINDS = ["fifo", "dev-zero", "link-out", "dangling-link", "bomb", "truncated", "empty-file", "grey16", "cmyk",
         "palette", "huge-dims", "loose", "empty-class", "text-file", "folder-named-png"]


@pytest.mark.timeout(300)
@settings(FUZZ, max_examples=25)
@given(kinds=st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(["train/ant", "train/bee", "test/ant"])),
                      max_size=3),
       on_bad=st.sampled_from(["error", "skip"]), with_test=st.booleans(),
       max_pixels=st.sampled_from([300, 1000, 50_000_000]))
def test_fuzzed_datasets_end_in_0_or_one_error_line(kinds, on_bad, with_test, max_pixels):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ds"
        rng = np.random.default_rng(0)
        for split in ("train", "test") if with_test else ("train",):
            for c in ("ant", "bee"):
                (root / split / c).mkdir(parents=True)
                for i in range(6):
                    Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(root / split / c / f"{i}.png")
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(Path(tmp) / "outside.png")
        for kind, where in kinds:
            try:
                _hostile(root, kind, root / where)
            except FileExistsError:
                pass
        rc, err = _main(["--config", str(SMOKE), *BASE, "data.source=auto", f"data.root={root}",
                         f"data.cache_dir={tmp}/cache", "data.val_size=2", "train.batch_size=4", "eval.batch_size=8",
                         f"data.on_bad_image={on_bad}", f"data.max_image_pixels={max_pixels}", f"run_dir={tmp}/run"])
    _check_outcome(rc, err)

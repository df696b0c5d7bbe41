"""Placed objects (visattn.data.placed) and the maps scored against their boxes (visattn.maps.faithful), on
synthetic images: boxes exact under the geometry, the centre prior at chance, determinism, no held-out image in
training, and the background carrying no label."""
import importlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from visattn.attention.tap import AttentionTap
from visattn.config import DataConfig, PlacedConfig
from visattn.data import load_splits, make_synthetic
from visattn.data.placed import box_share, place
from visattn.data.sources import ImageSet
from visattn.errors import DataError
from visattn.maps.faithful import attention_maps, centre_prior, localization, random_map
from visattn.maps.geometry import GridGeometry

ROOT = Path(__file__).resolve().parents[1]
CFG = PlacedConfig(canvas=48, patch=4, tolerance=3, seed=0)


def _bench():
    return importlib.import_module("bench.localization")


class BrightCells(nn.Module):
    """The mean brightness of 4x4 windows at stride 4 over the canvas padded by 8 px (cell i centred on pixel
    -6.5 + 4 i: up to 7.5 px from where 16 cells stretched over 48 px would sit), gated by a spatial tap:
    hottest on the windows inside a bright box."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 1, 4, stride=4, padding=8, bias=False)
        nn.init.constant_(self.conv.weight, 1 / 48)
        self.tap = AttentionTap("spatial")
        self.head = nn.Linear(1, 10)

    def forward(self, x):
        gate = torch.sigmoid(8 * (self.conv(x) - 0.5))  # (B, 1, 16, 16)
        return self.head(self.tap(gate).mean((2, 3)))


def test_a_map_that_is_a_known_function_of_position_points_into_every_box():
    placed = place(make_synthetic(300, size=16), CFG, 1)
    boxes = torch.from_numpy(placed.boxes)
    x = torch.zeros(len(boxes), 3, 48, 48)
    for i, (x0, y0, x1, y1) in enumerate(boxes.tolist()):
        x[i, :, y0:y1, x0:x1] = 1.0  # a bright box on a dark canvas
    rep = localization(BrightCells(), x, torch.zeros(len(x)), boxes, tolerance=0, baselines=(), gradient_maps=False)
    gate = rep.row("tap")
    assert gate.pointing.mean == 1.0  # tolerance 0: the peak cell's pixel lies inside the box on every canvas
    assert gate.energy.lo > 3 * rep.energy_chance
    assert rep.row("random").pointing.hi < 0.5  # the same scoring of noise does not
    # the same cells stretched over the canvas (no geometry) miss boxes: the true placement is what scores 100%
    (lm,) = [m for m in attention_maps(BrightCells(), x, gradients=False) if m.name == "tap"]
    stretched = replace(lm, name="stretched", geometry=GridGeometry.stretched(lm.heat.shape[-2:], (48, 48)))
    wrong = localization(BrightCells(), x, torch.zeros(len(x)), boxes, 0, maps=[stretched], baselines=())
    assert wrong.row("stretched").pointing.mean < 1.0


def test_the_centre_prior_points_at_chance_on_placed_objects():
    placed = place(make_synthetic(2000, size=16), CFG, 1)
    boxes = torch.from_numpy(placed.boxes)
    x = torch.zeros(len(boxes), 3, 48, 48)
    rep = localization(nn.Linear(1, 1), x, torch.zeros(len(x)), boxes, CFG.tolerance, maps=[], baselines=("centre",))
    centre, rnd = rep.row("centre"), rep.row("random")
    assert abs(rep.pointing_chance - float(box_share(placed.boxes, 48, 3).mean())) < 1e-12
    assert centre.pointing.lo <= rep.pointing_chance <= centre.pointing.hi
    assert rnd.pointing.lo <= rep.pointing_chance <= rnd.pointing.hi
    assert 0.1 < rep.pointing_chance < 0.35  # far from what a centre guess scores on centred objects (100%)
    assert centre.energy.mean < 0.3 and rep.energy_chance == pytest.approx(16 * 16 / 48 ** 2)


def test_canvases_and_boxes_are_a_function_of_the_seed():
    imgs = make_synthetic(200, size=16)
    a, b, c = place(imgs, CFG, 0), place(imgs, CFG, 0), place(imgs, PlacedConfig(**{**CFG.model_dump(), "seed": 1}), 0)
    assert np.array_equal(a.x, b.x) and np.array_equal(a.boxes, b.boxes)
    assert not np.array_equal(a.boxes, c.boxes)
    for i, (x0, y0, x1, y1) in enumerate(a.boxes):  # the object sits exactly in its box
        assert np.array_equal(a.x[i, y0:y1, x0:x1], imgs.x[i]) and (x1 - x0, y1 - y0) == (16, 16)
    masked = place(imgs, PlacedConfig(**{**CFG.model_dump(), "object": False}), 0)
    assert np.array_equal(masked.boxes, a.boxes) and not any(
        np.array_equal(masked.x[i, y0:y1, x0:x1], imgs.x[i]) for i, (x0, y0, x1, y1) in enumerate(a.boxes))


def test_no_held_out_image_reaches_a_training_canvas_as_object_or_background():
    # every image one flat value: training images 0..59, held-out images 100..139; a canvas's pixels say
    # which images built it
    def flat(lo, n):
        return ImageSet(np.repeat(np.arange(lo, lo + n, dtype=np.uint8), 16 * 16 * 3).reshape(n, 16, 16, 3),
                        np.arange(n) % 10, tuple(map(str, range(10))))

    train, held = place(flat(0, 60), CFG, 0), place(flat(100, 40), CFG, 1)
    assert train.x.max() < 60 and held.x.min() >= 100
    for i, (x0, y0, x1, y1) in enumerate(held.boxes):
        crop = held.x[i, y0:y1, x0:x1]
        assert (crop == 100 + i).all()
        outside = np.ones((48, 48), bool)
        outside[y0:y1, x0:x1] = False
        assert not (held.x[i][outside] == 100 + i).any()  # no canvas takes a square of its own object
    # through the data layer: the held-out canvases' objects are exactly the held-out images
    cfg = DataConfig(source="placed", placed=PlacedConfig(source="synthetic", canvas=48), synthetic_size=300,
                     val_size=100, image_size=16)
    base = load_splits(DataConfig(source="synthetic", synthetic_size=300, val_size=100, image_size=16), 0)
    sp = load_splits(cfg, 0)
    assert sp.eval.boxes is not None and sp.eval.x.shape[1:] == (48, 48, 3) and sp.train.boxes is not None
    for i, (x0, y0, x1, y1) in enumerate(sp.eval.boxes):
        assert np.array_equal(sp.eval.x[i, y0:y1, x0:x1], base.eval.x[i])
    train_objects = {img.tobytes() for img in base.train.x}
    assert not any(img.tobytes() in train_objects for img in base.eval.x)


def _ridge_accuracy(train: ImageSet, held: ImageSet) -> float:
    """A linear probe (ridge regression on one-hot labels) on 8x8 mean-pooled pixels."""
    def feats(s):
        f = s.x.reshape(len(s.x), 8, 6, 8, 6, 3).mean((2, 4)).reshape(len(s.x), -1) / 255.0
        return np.concatenate([f, np.ones((len(f), 1))], 1)

    a, t = feats(train), np.eye(10)[train.y]
    w = np.linalg.solve(a.T @ a + 1e-1 * np.eye(a.shape[1]), a.T @ t)
    return float((np.argmax(feats(held) @ w, 1) == held.y).mean())


def test_the_background_alone_carries_no_label():
    imgs = make_synthetic(3000, size=16)  # classes told apart by colour and stripes: a linear probe reads them
    tr, ho = ImageSet(imgs.x[:2000], imgs.y[:2000], imgs.classes), ImageSet(imgs.x[2000:], imgs.y[2000:], imgs.classes)
    bg = PlacedConfig(**{**CFG.model_dump(), "object": False})
    with_object = _ridge_accuracy(place(tr, CFG, 0), place(ho, CFG, 1))
    background = _ridge_accuracy(place(tr, bg, 0), place(ho, bg, 1))
    half = 1.96 * np.sqrt(0.1 * 0.9 / 1000)
    assert with_object > 0.3  # the probe can read the object
    assert abs(background - 0.1) < half + 0.01  # and nothing from the background alone: chance


def test_maps_helpers_and_too_small_canvases():
    assert centre_prior((48, 48), 1).heat[0].argmax() // 48 in (23, 24)
    assert random_map(2, (8, 8), 0).heat.shape == (2, 8, 8)
    with pytest.raises(DataError, match="too small"):
        place(make_synthetic(20, size=16), PlacedConfig(canvas=32, tolerance=3, patch=4), 0)


def test_a_canvas_too_small_is_one_line_and_a_nonzero_exit(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "smoke.yaml"),
                        "data.source=placed", "data.placed.source=synthetic", "data.placed.canvas=32",
                        "data.image_size=16", f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "data.placed.canvas=32 is too small" in r.stderr.strip().splitlines()[-1]


def test_the_docs_table_is_the_one_the_results_give():
    bench = _bench()
    doc = (ROOT / "docs" / "maps.md").read_text()
    block = doc[doc.index(bench.BEGIN): doc.index(bench.END) + len(bench.END)]
    assert block == bench.report(bench.load(bench.RESULTS)), (
        "docs/maps.md's localization table is stale: run `python -m bench.localization --report`")


def test_the_report_names_the_best_map_and_the_verdict():
    bench = _bench()
    head = {"model": "m", "checkpoint": {"path": "a/last.pt", "config": "c", "seed": 0}, "val_acc": 0.6,
            "object": True, "images": 1000, "canvas": 48, "object_size": 16, "tolerance": 3, "pointing_chance": 0.2,
            "energy_chance": 0.11, "deletion_score": [0.1, 0.0, 0.2], "insertion_score": [0.1, 0.0, 0.2]}
    rows = [{**head, "map": n, "kind": k, "pointing": [p, p - 0.02, p + 0.02], "energy": [e, e - 0.01, e + 0.01]}
            for n, k, p, e in (("l/grad", "attention_gradient", 0.7, 0.4), ("input_x_gradient", "input_x_gradient",
                               0.6, 0.3), ("gradcam", "gradcam", 0.65, 0.35), ("centre", "centre", 0.2, 0.15))]
    bg = {**head, "checkpoint": {"path": "b/last.pt", "config": "bg", "seed": 0}, "object": False, "map": None,
          "kind": None, "val_acc": 0.101, "val_images": 5000}
    table = bench.report(rows + [bg])
    assert "`l/grad` (attention_gradient): 70.0% [68.0%, 72.0%]" in table and "| yes: `l/grad`" in table
    assert "held-out accuracy 10.1% +- 0.8 (chance 10%)" in table
    rows[0]["energy"] = [0.2, 0.19, 0.21]  # behind Grad-CAM on energy: not "at least as good"
    assert "| no (best: `l/grad`" in bench.report(rows)
    json.dumps(rows)  # rows are plain data

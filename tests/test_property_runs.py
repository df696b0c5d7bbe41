"""Issue 92 (c): combinations of data, augmentation, split, model and logging settings, drawn by a seeded generator,
each run through ``train.py`` in-process on tiny synthetic data. Every draw must either refuse in one ``error:``
line with exit 2 and nothing written (the run folder not created), or train: every class has training images,
every random crop sees part of the image, one metrics row per epoch, and, where TensorBoard and maps were asked
for on a model with spatial blocks, ``maps/`` pictures in its event files. A traceback, another exit status, or a
run that silently misses what it was asked for fails the draw. Fast tier: 24 draws; the full tier (slow): 120 more.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import List

import numpy as np
import pytest
from conftest import SMOKE, run_cli

from visattn.config import load_config
from visattn.data import load_splits

FAST, FULL = 24, 144


# values that fit alone but may not with the rest: at most one of them replaces a draw's setting
HOSTILE = [("data.val_size", "{n_1}"), ("data.val_size", "{n_5}"), ("data.val_size", "5"), ("data.subset", "10"),
           ("data.augment.crop_padding", "16"), ("data.augment.crop_padding", "{size}"), ("data.augment.cutout", "40"),
           ("data.augment.cutout", "{size}"), ("train.batch_size", "200"), ("log.maps_every", "3"),
           ("data.image_size", "8"), ("data.synthetic_size", "20"), ("sync_bn", "true")]


def draw(seed: int) -> List[str]:
    """One combination of settings (overrides of the smoke config), from ``seed`` alone: valid values of each key,
    and in about half the draws one value of :data:`HOSTILE`."""
    r = random.Random(seed)
    size, n = r.choice([16, 32]), r.choice([80, 120])
    settings = {
        "data.synthetic_size": n, "data.val_size": r.choice([10, 20, 30]), "data.image_size": size,
        "data.split_seed": r.randrange(3), "data.augment.crop_padding": r.choice([0, 2, 4]),
        "data.augment.padding_mode": r.choice(["reflect", "constant"]), "data.augment.cutout": r.choice([0, 4, 8]),
        "data.augment.hflip": r.choice(["true", "false"]), "train.batch_size": r.choice([16, 32]),
        "train.epochs": r.choice([1, 1, 2]), "model.attention": r.choice(["none", "cbam", "se"]),
        "log.tensorboard": r.choice(["true", "false"]), "log.maps_every": r.choice([0, 1, 1, 2]),
    }
    if r.random() < 0.5:
        key, value = r.choice(HOSTILE)
        settings[key] = value.format(size=size, n_1=n - 1, n_5=n - 5)
    fixed = ["model.widths=[8,8,8]", "model.stem_width=8", "log.probe_size=4", "log.faithfulness=false",
             "log.progress=false", "device=cpu", "precision=fp32", "eval.tta=none", f"seed={seed}"]
    return [f"{k}={v}" for k, v in settings.items()] + fixed


def _value(argv: List[str], key: str) -> str:
    return next(a.split("=", 1)[1] for a in reversed(argv) if a.startswith(key + "="))


def _image_tags(run_dir: Path) -> set:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"images": 0})
    acc.Reload()
    return set(acc.Tags()["images"])


def check_draw(tmp_path: Path, seed: int) -> str:
    argv = draw(seed)
    rd = tmp_path / "run"
    proc = run_cli(["--config", str(SMOKE), *argv, f"run_dir={rd}"])
    what = f"draw {seed}: {' '.join(argv)}\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, what
    if proc.returncode == 2:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0], what
        assert not rd.exists(), what  # nothing written
        return "refused"
    assert proc.returncode == 0, what
    cfg = load_config(SMOKE, argv)
    splits = load_splits(cfg.data, seed=cfg.seed)
    assert (np.bincount(splits.train.y, minlength=len(splits.train.classes)) > 0).all(), f"a class untrained: {what}"
    assert cfg.data.augment.crop_padding < cfg.data.image_size, f"a crop may miss the image: {what}"
    rows = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == list(range(1, cfg.train.epochs + 1)), what
    maps_asked = cfg.log.tensorboard and 0 < cfg.log.maps_every <= cfg.train.epochs and cfg.model.attention == "cbam"
    if maps_asked:
        assert any(t.startswith("maps/") for t in _image_tags(rd)), f"maps asked for, none logged: {what}"
    return "trained"


@pytest.mark.parametrize("seed", range(FAST))
def test_a_drawn_run_refuses_in_one_line_or_trains_what_it_was_asked(tmp_path, seed):
    check_draw(tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(FAST, FULL))
def test_a_drawn_run_refuses_in_one_line_or_trains_what_it_was_asked_full(tmp_path, seed):
    check_draw(tmp_path, seed)


def test_the_fast_tier_reaches_both_outcomes_and_every_attention(tmp_path):
    """The generator is not degenerate: among the fast tier's draws some refuse and some train, over every
    attention setting and both logging settings."""
    outcomes = [check_draw(tmp_path / str(s), s) for s in range(0, FAST, 3)]
    assert {"refused", "trained"} <= set(outcomes), outcomes
    assert {_value(draw(s), "model.attention") for s in range(FAST)} == {"none", "cbam", "se"}
    assert {_value(draw(s), "log.tensorboard") for s in range(FAST)} == {"true", "false"}

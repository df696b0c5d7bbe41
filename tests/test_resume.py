"""Exact resume: a run stopped mid-epoch (or at an epoch end) and resumed ends bit-identical to one that never stopped.

Every run here is in-process on the CPU with ``deterministic=true``: a reference run of 2 epochs, then the same
run stopped with ``train.max_steps=K`` (which saves ``last.pt`` and stops, mid-epoch unless ``K`` is a multiple
of the 6 steps per epoch) and continued with ``resume=auto train.max_steps=null``. The final weights, optimizer,
EMA and scheduler state must be equal to the bit, and ``metrics.jsonl`` equal row for row (timing fields aside).
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import pytest
import torch
from conftest import SMOKE, metrics_rows

from visattn.config import load_config
from visattn.rundir import load_checkpoint
from visattn.trainer import run

STEPS_PER_EPOCH = 6  # 300 training images (400 - 100 held out) / batch 50
EPOCHS = 2

BASE = ["data.synthetic_size=400", "data.val_size=100", "train.batch_size=50", f"train.epochs={EPOCHS}",
        "log.progress=false", "log.maps_every=0", "log.tensorboard=false", "deterministic=true", "device=cpu",
        "eval.tta=none"]
RESNET = ["model.widths=[8,16,16]", "model.stem_width=8", "model.attention=none", "precision=fp32"]  # fp32: fast on CPUs
VARIANTS: Dict[str, List[str]] = {
    "resnet": RESNET,
    # EMA weights and cutout draw on state beyond the model: the EMA copy and the loader's augmentation generator
    "ema-cutout": RESNET + ["train.ema_decay=0.9", "data.augment.cutout=8"],
    # the CPU recipe's levers: lookahead's slow weights, alternating flips (epoch parity), the whitening bias
    # frozen after epoch 1, BN biases in their own faster group
    "recipe": RESNET + ["train.lookahead_every=2", "data.augment.hflip_mode=alternate", "model.stem=whiten",
                        "model.whiten_bias_epochs=1", "model.block=plain", "model.bn_scale=frozen",
                        "model.conv_init=dirac", "model.bn_momentum=0.4", "optim.norm_bias_lr_scale=8",
                        "sched.start_lr_ratio=0.2"],
    # dropout and drop-path draw from the global torch RNG, which the checkpoint must carry
    "vit-dropout": ["model.name=vit_tiny", "model.depth=1", "model.dim=32", "model.num_heads=2", "model.patch_size=8",
                    "model.drop_rate=0.1", "model.drop_path_rate=0.2", "optim.lr=0.05"],
}


@pytest.fixture(autouse=True)
def _restore_determinism():
    """``deterministic=true`` switches torch's global deterministic mode on; switch it back for other tests."""
    was = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn)


def _cfg(run_dir: Path, variant: str, *extra: str):
    overrides = [f"run_dir={run_dir}", *BASE, *VARIANTS[variant], *extra]
    if variant == "vit-dropout":  # smoke.yaml's model section holds resnet-only keys; start from an empty one
        overrides = ["model={}", *overrides]
    return load_config(SMOKE, overrides)


def _quiet(*a, **k):
    pass


def _assert_same_state(a: Dict, b: Dict) -> None:
    def eq(x, y, where):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), where
        elif isinstance(x, dict):
            assert isinstance(y, dict) and set(x) == set(y), where
            for k in x:
                eq(x[k], y[k], f"{where}.{k}")
        elif isinstance(x, (list, tuple)):
            assert isinstance(y, (list, tuple)) and len(x) == len(y), where
            for i, (u, v) in enumerate(zip(x, y)):
                eq(u, v, f"{where}[{i}]")
        else:
            assert x == y, f"{where}: {x!r} != {y!r}"

    for key in ("model", "optimizer", "scheduler", "ema", "lookahead", "epoch", "step", "best_acc", "loader"):
        eq(a[key], b[key], key)


_REFERENCE: Dict[str, Path] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run per variant, made on first use and shared by the stop schedules."""

    def get(variant: str) -> Path:
        if variant not in _REFERENCE:
            rd = tmp_path_factory.mktemp(f"ref-{variant}") / "run"
            summary = run(_cfg(rd, variant), log=_quiet)
            assert summary["epochs"] == EPOCHS
            _REFERENCE[variant] = rd
        return _REFERENCE[variant]

    return get


CASES = [
    ("resnet", [4]),  # mid-epoch 1
    ("resnet", [1, 6, 9]),  # after the first step, exactly at the end of epoch 1, then mid-epoch 2
    ("ema-cutout", [8]),
    ("recipe", [3, 8]),  # mid-epoch 1 (bias still training, even flip parity), then mid-epoch 2
    ("vit-dropout", [5, 10]),  # bf16 autocast (the CPU default) here
]


@pytest.mark.parametrize("variant,stops", CASES, ids=[f"{v}-stop{'-'.join(map(str, s))}" for v, s in CASES])
def test_stopped_and_resumed_run_equals_uninterrupted(tmp_path, reference, variant, stops):
    ref = reference(variant)
    rd = tmp_path / "run"
    for i, k in enumerate(stops):
        extra = [f"train.max_steps={k}"] + (["resume=auto"] if i else [])
        run(_cfg(rd, variant, *extra), log=_quiet)
        ck = load_checkpoint(rd / "last.pt")
        assert ck["step"] == k
        # mid-epoch: the loader position says how far into the epoch; at an epoch end it is a new epoch at 0
        assert ck["loader"]["position"] == k % STEPS_PER_EPOCH
        assert ck["epoch"] == k // STEPS_PER_EPOCH
        assert (ck["epoch_stats"] is None) == (k % STEPS_PER_EPOCH == 0)
    summary = run(_cfg(rd, variant, "resume=auto", "train.max_steps=null"), log=_quiet)
    assert summary["final"]["epoch"] == EPOCHS

    got, want = load_checkpoint(rd / "last.pt"), load_checkpoint(ref / "last.pt")
    assert got["step"] == want["step"] == EPOCHS * STEPS_PER_EPOCH
    _assert_same_state(got, want)
    assert metrics_rows(rd) == metrics_rows(ref)
    assert torch.equal(torch.tensor(load_checkpoint(rd / "best.pt")["best_acc"]),
                       torch.tensor(load_checkpoint(ref / "best.pt")["best_acc"]))


def test_resume_of_a_finished_run_changes_nothing(tmp_path, reference):
    """``resume=auto`` on a run that already did all its epochs trains no step and keeps its weights and metrics."""
    ref = reference("resnet")
    rd = tmp_path / "run"
    rd.mkdir()
    for name in ("last.pt", "best.pt", "metrics.jsonl"):
        (rd / name).write_bytes((ref / name).read_bytes())
    summary = run(_cfg(rd, "resnet", "resume=auto"), log=_quiet)
    assert summary["epochs"] == 0
    _assert_same_state(load_checkpoint(rd / "last.pt"), load_checkpoint(ref / "last.pt"))
    assert metrics_rows(rd) == metrics_rows(ref)


@pytest.mark.parametrize("damage", ["row-ahead", "torn-line"])
def test_metrics_follow_the_checkpoint_after_a_crash(tmp_path, reference, damage):
    """A crash between writing metrics.jsonl and last.pt must neither lose nor repeat an epoch's row.

    ``row-ahead``: the process died after appending epoch 2's row but before last.pt moved past epoch 2 (here:
    last.pt still holds step 9, mid-epoch 2); ``torn-line``: it died while writing a row.
    """
    ref = reference("resnet")
    rd = tmp_path / "run"
    run(_cfg(rd, "resnet", "train.max_steps=9"), log=_quiet)
    rows = (ref / "metrics.jsonl").read_text().splitlines(keepends=True)
    with open(rd / "metrics.jsonl", "a") as f:
        f.write(rows[1] if damage == "row-ahead" else rows[1][: len(rows[1]) // 2])
    run(_cfg(rd, "resnet", "resume=auto", "train.max_steps=null"), log=_quiet)
    assert metrics_rows(rd) == metrics_rows(ref)


def test_a_resumed_epochs_images_per_s_counts_only_the_images_it_timed():
    from visattn.step import EpochStats, Stat

    total, new = [0.0] * len(Stat), [0.0] * len(Stat)
    total[Stat.images], total[Stat.steps], total[Stat.finite_images] = 1000, 10, 1000
    new[Stat.images], new[Stat.steps] = 300, 3  # stopped after 700 images, resumed for the last 300 in 3 s
    assert EpochStats.of(total, new, 3.0).images_per_s == pytest.approx(100.0)
    assert EpochStats.of(total, total, 10.0).images_per_s == pytest.approx(100.0)

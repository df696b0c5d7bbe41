"""Starting a run from a trained checkpoint (``model.init_from``), and extending a finished run (``resume=auto``
with more ``train.epochs``).

A tiny synthetic run (the recipe's ``resnet_fast_none`` config: whitening stem, one-cycle schedule) is trained
once per module; the fine-tunes start from its ``best.pt``. What a command does (its step-0 line, its exit
status, its one error line, the folders it leaves) is checked on ``train.py``'s ``main`` run in-process
(conftest's ``run_cli``), and once on ``train.py`` run as a subprocess.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch
from conftest import ROOT, metrics_rows, run_cli

from visattn.config import load_config
from visattn.rundir import load_checkpoint, save_checkpoint
from visattn.trainer import build, run

NONE = ROOT / "configs" / "attention" / "resnet_fast_none.yaml"
CBAM = ROOT / "configs" / "attention" / "resnet_fast_cbam.yaml"
TINY = ["data.source=synthetic", "data.synthetic_size=300", "data.val_size=100", "train.batch_size=50",
        "model.widths=[8,16,16]", "log.progress=false", "log.maps_every=0", "device=cpu", "precision=fp32",
        "eval.every=1", "train.epochs=1"]
WAIT = 180.0


def _quiet(*a, **k) -> None:
    pass


def _train(argv: List[str], cwd: Path = ROOT, spawn: bool = False) -> subprocess.CompletedProcess:
    """``train.py ARGV`` in-process, or as a real subprocess where ``spawn``."""
    if not spawn:
        return run_cli(argv, cwd=cwd)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=WAIT)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A finished one-epoch run of the recipe's ``none`` config on synthetic images."""
    rd = tmp_path_factory.mktemp("src") / "run"
    run(load_config(NONE, [*TINY, f"run_dir={rd}"]), log=_quiet)
    return rd


@pytest.fixture(scope="module")
def ema_source(tmp_path_factory) -> Path:
    rd = tmp_path_factory.mktemp("ema") / "run"
    run(load_config(NONE, [*TINY, f"run_dir={rd}", "train.ema_decay=0.9"]), log=_quiet)
    return rd


def test_a_block_at_identity_scores_the_checkpoints_accuracy_at_step_0_then_fine_tunes(source, tmp_path):
    best = load_checkpoint(source / "best.pt")
    rd = tmp_path / "ft"
    r = _train(["--config", str(CBAM), *TINY, f"model.init_from={source / 'best.pt'}", f"run_dir={rd}"])
    assert r.returncode == 0, r.stderr
    step0 = [ln for ln in r.stdout.splitlines() if ln.startswith("step 0")]
    assert len(step0) == 1 and f"acc {best['best_acc']:.4f}" in step0[0], r.stdout
    origin = json.loads((rd / "run_info.json").read_text())["init_from"]
    assert origin["val_acc"] == best["best_acc"]  # to the digit: the new blocks start as the identity
    assert origin["path"] == str((source / "best.pt").resolve()) and origin["epoch"] == 1
    assert origin["best_acc"] == best["best_acc"] and origin["weights"] == "model"
    assert len(origin["new_blocks"]) == 3 and all(b.endswith(".units.0.attn") for b in origin["new_blocks"])
    assert [row["epoch"] for row in metrics_rows(rd)] == [1]  # the fine-tune's own epochs only: no row 0
    from visattn.hparams import logged_hparams

    assert logged_hparams(rd / "tb")[0]["init_from"] == str(source / "best.pt")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(rd / "tb")).Reload()
    points = {e.step: e.value for e in events.Scalars("val/acc")}
    assert points[0] == pytest.approx(best["best_acc"]) and set(points) == {0, 1}
    # a fresh schedule of its own: the fine-tune's first epoch ends at the one-cycle's end, not at the source's
    assert load_checkpoint(rd / "last.pt")["scheduler"]["num_updates"] == best["scheduler"]["num_updates"]


@pytest.mark.parametrize("ema", [False, True], ids=["model", "ema"])
def test_every_checkpoint_weight_lands_whitening_stem_included(ema, request):
    """The loaded weights are the ones the checkpoint was evaluated with (its EMA's where it kept one), and the
    whitening stem's data-computed weights do not overwrite them."""
    src = request.getfixturevalue("ema_source" if ema else "source")
    state = load_checkpoint(src / "best.pt")
    want = {k[len("module."):]: v for k, v in state["ema"].items()} if ema else state["model"]
    r = build(load_config(CBAM, [*TINY, f"model.init_from={src / 'best.pt'}", f"run_dir={src.parent / 'unused'}"]),
              log=_quiet)
    got = r.model.state_dict()
    assert any(k.startswith("stem.") for k in want)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert r.init_from["weights"] == ("EMA" if ema else "model")
    assert not (src.parent / "unused").exists()  # build writes nothing
    if ema:
        plain = state["model"]
        assert any(not torch.equal(plain[k], want[k]) for k in want if plain[k].is_floating_point())


def _refused(argv: List[str], fragment: str, folder: Path) -> None:
    r = _train(argv)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model.init_from: ") and fragment in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not folder.exists()


def test_a_checkpoint_that_does_not_fit_is_one_line_naming_the_keys(source, tmp_path):
    rd = tmp_path / "ft"
    _refused(["--config", str(NONE), *TINY, "model.widths=[8,16,32]", f"model.init_from={source / 'best.pt'}",
              f"run_dir={rd}"], "shapes differ: layers.2.conv.weight [16, 16, 3, 3] vs [32, 16, 3, 3]", rd)
    # a checkpoint holding a block the new model has elsewhere: its weights would not land
    se = load_checkpoint(source / "best.pt")
    se["model"] = build(load_config(NONE, [*TINY, "model.attention=se", f"run_dir={tmp_path / 'x'}"]),
                        log=_quiet).model.state_dict()
    save_checkpoint(se, tmp_path / "se.pt")
    _refused(["--config", str(CBAM), *TINY, f"model.init_from={tmp_path / 'se.pt'}", f"run_dir={rd}"],
             "its layers.0.units.0.attn.fc1.weight, ", rd)
    # weights the checkpoint lacks: the head's, and one of a block it holds in part (only a block it does not
    # hold at all starts fresh)
    del se["model"]["fc.weight"], se["model"]["layers.0.units.0.attn.fc1.weight"]
    save_checkpoint(se, tmp_path / "se.pt")
    _refused(["--config", str(NONE), *TINY, "model.attention=se", f"model.init_from={tmp_path / 'se.pt'}",
              f"run_dir={rd}"], "this model's layers.0.units.0.attn.fc1.weight, fc.weight are not in it", rd)


def test_init_from_refuses_its_own_folder_another_split_and_a_missing_file(source, tmp_path):
    before = sorted(p.name for p in source.iterdir())
    _refused(["--config", str(CBAM), *TINY, f"model.init_from={source / 'best.pt'}", f"run_dir={source}"],
             "a run started from a checkpoint gets a folder of its own", tmp_path / "none")
    assert sorted(p.name for p in source.iterdir()) == before
    rd = tmp_path / "ft"
    _refused(["--config", str(CBAM), *TINY, "data.val_size=50", f"model.init_from={source / 'best.pt'}",
              f"run_dir={rd}"], "other data settings (data.val_size: 100, here 50)", rd)
    r = _train(["--config", str(CBAM), *TINY, f"model.init_from={tmp_path / 'nope.pt'}", f"run_dir={rd}"],
               spawn=True)  # end to end once: the process's exit status and its one line
    assert r.returncode == 2 and "nope.pt' not found" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not rd.exists()


def test_resume_with_more_epochs_extends_the_schedule_and_says_so(source, tmp_path):
    """A finished 1-epoch run asked for 3 epochs trains epochs 2-3 on a 3-epoch schedule, from the step it
    stopped at: the lr of epoch 2 is the fresh 3-epoch schedule's, not the old schedule's end (about 0)."""
    rd = tmp_path / "run"
    shutil.copytree(source, rd)
    r = _train(["--config", str(NONE), *TINY, "train.epochs=3", "resume=auto", f"run_dir={rd}"])
    assert r.returncode == 0, r.stderr
    said = [ln for ln in r.stdout.splitlines() if ln.startswith("resume: train.epochs 1 -> 3")]
    assert len(said) == 1 and "rebuilt for 3 epochs" in said[0] and "model.init_from=" in said[0], r.stdout
    rows = metrics_rows(rd)
    assert [row["epoch"] for row in rows] == [1, 2, 3]
    fresh = build(load_config(NONE, [*TINY, "train.epochs=3", f"run_dir={tmp_path / 'fresh'}"]), log=_quiet)
    for _ in range(rows[1]["step"]):
        fresh.opt.scheduler.step()
    assert rows[1]["lr"] == fresh.opt.optimizer.param_groups[0]["lr"] > 1000 * rows[0]["lr"]

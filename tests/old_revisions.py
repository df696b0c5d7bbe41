"""Files written by visattn as it was at an earlier revision, made at test time from the repository's own history
(``git archive REV``), not kept as binaries: a checkpoint from before digests (``pre_digest``) and two run folders
from before the trainer's split (``pre89``). Where git or the revision is not there (an archive of the repository,
a shallow clone), the tests that need them skip, saying so."""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Sequence

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRE_DIGEST_REV = "0c428f2^"  # the last revision before checkpoints carried a digest
PRE89_REV = "77dcb8a"  # the trainer before issue 89's split
# the pre-digest checkpoint: 1 epoch of the smoke config on synthetic data, resnet_fast at widths 8-16-16
PRE_DIGEST_ARGS = ["--config", "configs/smoke.yaml", "data.synthetic_size=200", "data.val_size=50",
                   "model.widths=[8,16,16]", "model.stem_width=8", "model.attention=none", "log.progress=false",
                   "log.maps_every=0", "log.tensorboard=false", "device=cpu", "precision=fp32", "train.batch_size=50",
                   "train.epochs=1"]


def old_tree(rev: str, dest: Path) -> Path:
    """The repository's files at ``rev`` unpacked into ``dest`` (a skip where git or the revision is missing)."""
    if shutil.which("git") is None:
        pytest.skip(f"needs git to rebuild visattn at {rev}")
    got = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev], capture_output=True)
    if got.returncode != 0:
        pytest.skip(f"needs the repository's history to rebuild visattn at {rev} (a full clone): "
                    f"{got.stderr.decode(errors='replace').strip().splitlines()[-1:]}")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(got.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def run_old(tree: Path, argv: Sequence[str]) -> None:
    """``python ARGV`` with the old tree's visattn (the script's own folder first on the path), 2 threads."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="2")
    got = subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, f"the old revision's run failed:\n{got.stdout[-2000:]}\n{got.stderr[-2000:]}"


def pre_digest_checkpoint(work: Path) -> Path:
    """``best.pt`` as visattn wrote it before digests (its ``git`` entry ``unknown``: an archive has no .git)."""
    tree = old_tree(PRE_DIGEST_REV, work / "tree")
    run_old(tree, ["train.py", *PRE_DIGEST_ARGS, f"run_dir={work / 'run'}"])
    return work / "run" / "best.pt"


def pre89_folders(work: Path) -> Path:
    """The ``epoch`` and ``mid`` run folders and ``expected.json`` of ``tests/data/pre89/make_fixture.py``, run with
    the code before the split: its runs and its own resumption of them, on this machine."""
    tree = old_tree(PRE89_REV, work / "tree")
    shutil.copy2(ROOT / "tests" / "data" / "pre89" / "make_fixture.py", tree / "make_fixture.py")
    run_old(tree, ["make_fixture.py", str(work / "pre89"), PRE89_REV])
    return work / "pre89"

"""Runs that never lose or mix data (issue 12): one run per folder, a cache that cannot go stale or wedge,
hostile data files, hostile configs, non-finite numbers, the evaluate/visualize options, clear messages.

Every refusal must be one ``error: ...`` line with exit status 2 and leave existing run files byte-for-byte as
they were. Subprocess tests wait on files the child writes (polled, bounded), never on sleeps.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tarfile
import time
import zlib
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch
from conftest import FINISHED, ROOT, SMOKE, metrics_rows, run_cli
from PIL import Image

from visattn import evaluate as evaluate_cli
from visattn import visualize as visualize_cli
from visattn.cli import main
from visattn.config import load_config
from visattn.data import load_splits
from visattn.errors import ConfigError, DataError
from visattn.hooks import register_hook
from visattn.rundir import LOCK_NAME, RunLock, holds, load_checkpoint, metrics_line, remove_stale_temps, save_checkpoint
from visattn.trainer import build, fit

TINY = FINISHED  # the shared finished run's settings (conftest), so a test can resume a copy of it
WAIT = 120.0
QUIET = dict(log=lambda *a, **k: None)


def _snapshot(folder: Path) -> Dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _env(**extra: str) -> Dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **extra)


def _cli(argv: List[str], tool=main) -> tuple[int, str, str]:
    """A command-line entry point in-process (conftest's run_cli): (exit status, stdout, stderr)."""
    done = run_cli(argv, tool)
    return done.returncode, done.stdout, done.stderr


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def _train(run_dir: Path, *extra: str) -> List[str]:
    return ["--config", str(SMOKE), f"run_dir={run_dir}", *TINY, *extra]


def _images(folder: Path, classes=("ant", "bee", "cow"), per_class=4, splits=("train",), fmt="png") -> Path:
    rng = np.random.default_rng(0)
    for split in splits:
        for ci, c in enumerate(classes):
            (folder / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                arr = np.full((32, 32, 3), 60 * ci, np.uint8) + rng.integers(0, 30, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(arr).save(folder / split / c / f"{i}.{fmt}")
    return folder


def _data_cfg(tmp_path: Path, root: Path, *extra: str):
    return load_config(None, [f"data.root={root}", f"data.cache_dir={tmp_path / 'cache'}", "data.val_size=3",
                              *extra]).data


# ------------------------------------------------------------------------------------ one run per folder

PROBE = r'''
import os, sys, time
from visattn.hooks import register_hook
from visattn.cli import main

step_log, go = os.environ["PROBE_STEP_LOG"], os.environ["PROBE_GO"]
def waiting(run, step):
    with open(step_log, "a") as f:
        f.write(f"{step}\n")
    deadline = time.monotonic() + 120
    while step == 1 and not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)  # hold the run (and its lock) open until the test says go
register_hook("step_end", waiting)
sys.exit(main(sys.argv[1:]))
'''


@pytest.mark.slow
def test_two_trainers_on_one_run_dir_one_runs_the_other_exits_2(tmp_path):
    rd = tmp_path / "run"
    probe, step_log, go = tmp_path / "probe.py", tmp_path / "steps.log", tmp_path / "go"
    probe.write_text(PROBE)
    step_log.touch()
    first = subprocess.Popen([sys.executable, str(probe), *_train(rd, "seed=1", "log.tensorboard=false")], cwd=ROOT,
                             env=_env(PROBE_STEP_LOG=str(step_log), PROBE_GO=str(go)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + WAIT
        while not step_log.read_text().strip():  # the first run holds the folder and is training
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "timed out waiting for step 1"
            time.sleep(0.005)
        second = subprocess.run([sys.executable, "train.py", *_train(rd, "seed=2", "log.tensorboard=false")], cwd=ROOT,
                                env=_env(), capture_output=True, text=True, timeout=WAIT)
        go.touch()
        out, err = first.communicate(timeout=WAIT)
    finally:
        go.touch()
        if first.poll() is None:
            first.kill()
    assert second.returncode == 2, second.stderr
    line = _one_error_line(second.stderr)
    assert "is in use by another run (pid " in line and f"pid {first.pid} " in line
    assert first.returncode == 0, err
    # every file in the folder is the first run's
    assert load_config(rd / "config.yaml").seed == 1
    assert "seed=1" in json.loads((rd / "run_info.json").read_text())["argv"]
    assert load_checkpoint(rd / "last.pt")["seed"] == 1 and load_checkpoint(rd / "best.pt")["seed"] == 1
    assert [r["epoch"] for r in metrics_rows(rd)] == [1]
    assert not (rd / LOCK_NAME).exists()


def test_lock_refuses_a_second_holder_and_is_removed_after(tmp_path):
    rd = tmp_path / "a" / "run"
    with RunLock(rd) as lock:
        assert holds(rd) and (rd / LOCK_NAME).read_text().startswith(f"pid {os.getpid()} on host ")
        with pytest.raises(ConfigError, match=f"is in use by another run \\(pid {os.getpid()} on host "):
            RunLock(rd).acquire()
        assert lock.fd is not None
    assert not holds(rd) and not (rd / LOCK_NAME).exists()
    # a run that wrote nothing leaves no folders behind; a run folder with files stays
    assert not (tmp_path / "a").exists()


def test_lock_of_a_dead_process_is_named_and_taken_over(tmp_path, finished_run):
    rd = tmp_path / "run"
    shutil.copytree(finished_run, rd)
    (rd / LOCK_NAME).write_text("pid 4194303 on host elsewhere, since 2026-01-01 00:00:00\n")  # nobody holds its flock
    rc, out, err = _cli(_train(rd, "resume=auto", "train.epochs=2"))
    assert rc == 0, err
    assert ("taking over the lock left by pid 4194303 on host elsewhere, since 2026-01-01 00:00:00, "
            "which is no longer running") in err
    assert [r["epoch"] for r in metrics_rows(rd)] == [1, 2] and not (rd / LOCK_NAME).exists()


def test_stale_temp_files_are_removed_only_by_the_lock_holder(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    tmp = rd / ".last.pt.abc123.tmp"
    tmp.write_bytes(b"another run's write in progress")
    assert remove_stale_temps(rd) == [] and tmp.exists()  # not holding the lock: someone else's, left alone
    with RunLock(rd):
        assert remove_stale_temps(rd) == [tmp] and not tmp.exists()


@pytest.mark.parametrize("files", [("best.pt", "metrics.jsonl"), ("config.yaml",), ("tb",)], ids=["best-metrics", "config", "tb"])
def test_new_run_refuses_a_folder_holding_run_files(tmp_path, finished_run, files):
    rd = tmp_path / "run"
    rd.mkdir()
    for name in files:
        src = finished_run / name
        shutil.copytree(src, rd / name) if src.is_dir() else shutil.copy2(src, rd / name)
    before = _snapshot(rd)
    rc, _, err = _cli(_train(rd))
    assert rc == 2
    line = _one_error_line(err)
    assert "already holds" in line and all(n in line for n in files) and "resume=auto" in line
    assert _snapshot(rd) == before and sorted(p.name for p in rd.iterdir()) == sorted(files)


def test_new_run_refuses_the_project_root(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    before = sorted(p.name for p in ROOT.iterdir())
    rc, _, err = _cli(["--config", str(SMOKE), "run_dir=.", *TINY[:-2]])
    assert rc == 2 and "is a project folder (it holds .git" in _one_error_line(err)
    assert sorted(p.name for p in ROOT.iterdir()) == before
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "pyproject.toml").write_text("[project]\n")
    rc, _, err = _cli(_train(proj, "resume=auto"))
    assert rc == 2 and "holds pyproject.toml" in _one_error_line(err)


def test_resume_auto_without_a_checkpoint_says_it_starts_a_new_run(tmp_path, finished_run):
    rc, out, err = _cli(_train(tmp_path / "fresh", "resume=auto"))
    assert rc == 0, err
    assert f"resume=auto: no checkpoint ({tmp_path / 'fresh' / 'last.pt'}) to continue; starting a new run" in out
    # ... but never over finished epochs whose last.pt is gone
    rd = tmp_path / "lost_last"
    rd.mkdir()
    for name in ("best.pt", "metrics.jsonl"):
        shutil.copy2(finished_run / name, rd / name)
    before = _snapshot(rd)
    rc, _, err = _cli(_train(rd, "resume=auto"))
    assert rc == 2 and "holds best.pt, metrics.jsonl but no last.pt" in _one_error_line(err)
    assert _snapshot(rd) == before
    # a run killed in its first epoch (no last.pt, a torn metrics line, leftovers) is started again, cleanly
    rd = tmp_path / "killed_early"
    rd.mkdir()
    (rd / "config.yaml").write_text("name: old\n")
    (rd / "metrics.jsonl").write_text('{"epoch": 1, "train_lo')
    rc, out, err = _cli(_train(rd, "resume=auto"))
    assert rc == 0, err
    assert "starting a new run" in out and [r["epoch"] for r in metrics_rows(rd)] == [1]


def test_resume_from_another_runs_checkpoint_branches_into_a_new_folder_only(tmp_path, finished_run):
    """``resume=PATH`` from another folder: refused over a used folder, a named branch in a new one."""
    used = tmp_path / "used"
    rc, _, err = _cli(_train(used, "train.epochs=1"))
    assert rc == 0, err
    before, origin = _snapshot(used), _snapshot(finished_run)
    rc, _, err = _cli(_train(used, f"resume={finished_run / 'last.pt'}", "train.epochs=2"))
    assert rc == 2 and "belongs to another run folder, and run_dir" in _one_error_line(err)
    assert _snapshot(used) == before
    branch = tmp_path / "branch"
    rc, out, err = _cli(_train(branch, f"resume={finished_run / 'last.pt'}", "train.epochs=2"))
    assert rc == 0, err
    assert "resumed from" in out and [r["epoch"] for r in metrics_rows(branch)] == [2]
    info = json.loads((branch / "run_info.json").read_text())
    assert info["branched_from"] == str((finished_run / "last.pt").resolve())
    rc, _, err = _cli(_train(branch, "resume=auto", "train.epochs=3"))  # continuing the branch keeps its origin
    assert rc == 0, err
    assert json.loads((branch / "run_info.json").read_text())["branched_from"] == info["branched_from"]
    assert [r["epoch"] for r in metrics_rows(branch)] == [2, 3]
    assert _snapshot(finished_run) == origin
    assert json.loads((finished_run / "run_info.json").read_text())["branched_from"] is None


def test_resume_from_an_older_checkpoint_of_the_same_folder_never_rewinds_finished_epochs(tmp_path):
    rd = tmp_path / "run"
    rc, _, err = _cli(_train(rd, "train.epochs=1"))
    assert rc == 0, err
    shutil.copy2(rd / "last.pt", rd / "epoch1.pt")
    rc, _, err = _cli(_train(rd, "resume=auto", "train.epochs=2"))
    assert rc == 0, err
    before = _snapshot(rd)
    rc, _, err = _cli(_train(rd, f"resume={rd / 'epoch1.pt'}", "train.epochs=2"))
    assert rc == 2
    line = _one_error_line(err)
    assert "is from epoch 1, but run_dir" in line and "finished epochs up to 2" in line and "run_dir=NEW" in line
    assert _snapshot(rd) == before
    rc, _, err = _cli(_train(rd, f"resume={rd / 'last.pt'}", "train.epochs=3"))  # its own last.pt: continues
    assert rc == 0, err
    assert [r["epoch"] for r in metrics_rows(rd)] == [1, 2, 3]
    rc, _, err = _cli(_train(tmp_path / "fork", f"resume={rd / 'epoch1.pt'}", "train.epochs=2"))  # a branch may
    assert rc == 0, err
    assert [r["epoch"] for r in metrics_rows(tmp_path / "fork")] == [2]


def test_a_folder_where_a_file_is_expected_says_so(tmp_path):
    rd = tmp_path / "run"
    (rd / "last.pt").mkdir(parents=True)
    rc, _, err = _cli(_train(rd, "resume=auto"))
    assert rc == 2 and "last.pt' is a folder, not a checkpoint file" in _one_error_line(err)
    rc, _, err = _cli(["--config", str(tmp_path)])
    assert rc == 2 and f"config file {str(tmp_path)!r} is a folder, not a file" in _one_error_line(err)
    rc, _, err = _cli(["--checkpoint", str(rd), "--device", "cpu"], tool=evaluate_cli.main)
    assert rc == 2 and "is a folder, not a checkpoint file" in _one_error_line(err)


# ------------------------------------------------------------------------------------------------- cache


def test_an_image_edited_in_place_is_seen_by_the_next_run(tmp_path):
    root = _images(tmp_path / "ds", fmt="bmp")  # BMP: the edit keeps the file's size exactly
    cfg = _data_cfg(tmp_path, root)
    first = load_splits(cfg, seed=0)
    img = root / "train" / "ant" / "0.bmp"
    st = img.stat()
    Image.fromarray(np.full((32, 32, 3), 255, np.uint8)).save(img)  # the same size, other pixels
    os.utime(img, ns=(st.st_atime_ns, st.st_mtime_ns))  # ... and the old modification time put back
    assert img.stat().st_size == st.st_size and img.stat().st_mtime_ns == st.st_mtime_ns
    second = load_splits(cfg, seed=0)
    both = np.concatenate([second.train.x, second.eval.x])
    assert (both == 255).all(axis=(1, 2, 3)).sum() == 1  # the edited image is there, exactly once
    assert not (np.concatenate([first.train.x, first.eval.x]) == 255).all(axis=(1, 2, 3)).any()
    (root / "train" / "bee" / "9.bmp").write_bytes((root / "train" / "bee" / "0.bmp").read_bytes())  # an added image
    assert len(load_splits(cfg, seed=0).train) == len(second.train) + 1


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "garbage"])
def test_a_damaged_cache_is_rebuilt_with_a_warning(tmp_path, capsys, damage):
    root = _images(tmp_path / "ds")
    cfg = _data_cfg(tmp_path, root)
    want = load_splits(cfg, seed=0)
    (cache,) = (tmp_path / "cache").glob("*.npz")
    blob = bytearray(cache.read_bytes())
    if damage == "truncate":
        blob = blob[: len(blob) // 2]
    elif damage == "bitflip":  # inside the stored image bytes: only the CRC check can tell
        blob[len(blob) // 2] ^= 0xFF
    else:
        blob = bytearray(b"not a zip file at all")
    cache.write_bytes(bytes(blob))
    capsys.readouterr()
    got = load_splits(cfg, seed=0)
    np.testing.assert_array_equal(got.train.x, want.train.x)
    err = capsys.readouterr().err
    assert f"warning: decode cache {cache} is truncated, corrupt" in err and "rebuilding it" in err
    load_splits(cfg, seed=0)  # rebuilt: read without a warning
    assert "warning" not in capsys.readouterr().err


def test_a_truncated_cache_is_rebuilt_and_the_run_exits_0(tmp_path):
    root = _images(tmp_path / "ds", per_class=20)
    data = ["data.source=auto", f"data.root={root}", f"data.cache_dir={tmp_path / 'cache'}", "data.val_size=6",
            "train.batch_size=10", "train.max_steps=1", "log.tensorboard=false"]
    assert _cli(_train(tmp_path / "r1", *data))[0] == 0
    (cache,) = (tmp_path / "cache").glob("*.npz")
    cache.write_bytes(cache.read_bytes()[:1000])
    rc, _, err = _cli(_train(tmp_path / "r2", *data))
    assert rc == 0 and str(cache) in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------- hostile data


def _png_header(w: int, h: int) -> bytes:
    """A PNG whose header says ``w`` x ``h`` pixels (a bomb: the decoder would allocate all of them)."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    idat = b"IDAT" + zlib.compress(b"\0" * 1000)
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))
            + struct.pack(">I", len(idat) - 4) + idat + struct.pack(">I", zlib.crc32(idat)))


def test_decompression_bomb_is_refused_or_skipped(tmp_path):
    root = _images(tmp_path / "ds")
    (root / "train" / "bee" / "bomb.png").write_bytes(_png_header(20000, 20000))
    with pytest.raises(DataError, match=r"bomb.png is 400,000,000 pixels, more than data.max_image_pixels=50,000,000"):
        load_splits(_data_cfg(tmp_path, root), seed=0)
    s = load_splits(_data_cfg(tmp_path, root, "data.on_bad_image=skip"), seed=0)
    assert s.skipped == 1 and len(s.train) + len(s.eval) == 12
    # the limit is the config's: 32x32 images are over a limit of 1000 pixels
    with pytest.raises(DataError, match=r"0.png is 32x32 = 1,024 pixels, more than data.max_image_pixels=1,000"):
        load_splits(_data_cfg(tmp_path, root, "data.max_image_pixels=1000"), seed=1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "dev-zero-link", "link-out"])
def test_special_files_and_links_out_are_refused_never_read(tmp_path, kind):
    root = _images(tmp_path / "ds")
    bad = root / "train" / "cow" / "x.png"
    if kind == "fifo":
        os.mkfifo(bad)  # reading it would block forever
        why = "refused: it is a FIFO"
    elif kind == "dev-zero-link":
        bad.symlink_to("/dev/zero")  # reading it would never end
        why = "refused: it links out of the dataset folder (to /dev/zero)"
    else:
        outside = tmp_path / "secret.png"
        shutil.copy2(root / "train" / "ant" / "0.png", outside)
        bad.symlink_to(outside)
        why = f"refused: it links out of the dataset folder (to {outside})"
    with pytest.raises(DataError, match=f"image {bad}") as e:
        load_splits(_data_cfg(tmp_path, root), seed=0)
    assert why in str(e.value)
    assert load_splits(_data_cfg(tmp_path, root, "data.on_bad_image=skip"), seed=0).skipped == 1


def test_links_inside_the_dataset_and_linked_class_folders_are_followed(tmp_path):
    root = _images(tmp_path / "ds")
    (root / "train" / "ant" / "link.png").symlink_to(root / "train" / "bee" / "0.png")  # inside: fine
    elsewhere = _images(tmp_path / "elsewhere", classes=("dog",))
    (root / "train" / "dog").symlink_to(elsewhere / "train" / "dog", target_is_directory=True)
    (root / "train" / "ant" / "loop").symlink_to(root / "train", target_is_directory=True)  # a loop, walked once
    s = load_splits(_data_cfg(tmp_path, root, "data.val_size=4"), seed=0)
    assert s.train.classes == ("ant", "bee", "cow", "dog") and len(s.train) + len(s.eval) == 17


def _cifar(d: Path, labels=None, n=20) -> Path:
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        y = list(rng.integers(0, 10, n)) if labels is None or name != "data_batch_2" else labels
        with open(d / name, "wb") as f:
            pickle.dump({"data": rng.integers(0, 255, (n, 3072), dtype=np.uint8), "labels": y}, f)
    return d


def test_cifar_labels_out_of_range_or_of_the_wrong_length(tmp_path):
    with pytest.raises(DataError, match=r"data_batch_2: label 10 of image 3 is outside 0..9"):
        load_splits(_data_cfg(tmp_path, _cifar(tmp_path / "a", labels=[0, 1, 2, 10] + [0] * 16)), seed=0)
    s = load_splits(_data_cfg(tmp_path, tmp_path / "a", "data.on_bad_image=skip"), seed=0)
    assert s.skipped == 1 and len(s.train) == 99 and len(s.eval) == 20
    with pytest.raises(DataError, match=r"data_batch_2 has 19 labels for 20 images"):
        load_splits(_data_cfg(tmp_path, _cifar(tmp_path / "b", labels=[0] * 19)), seed=0)
    with pytest.raises(DataError, match=r"data_batch_2: label -1 of image 0"):
        load_splits(_data_cfg(tmp_path, _cifar(tmp_path / "c", labels=[-1] + [0] * 19)), seed=0)


def test_image_modes_are_converted_to_rgb_correctly(tmp_path):
    root = _images(tmp_path / "ds", per_class=2)
    d = root / "train" / "ant"
    Image.fromarray(np.full((32, 32), 32768, np.uint16)).save(d / "grey16.png")  # mid-grey at 16 bits
    Image.new("CMYK", (32, 32), (0, 255, 255, 0)).save(d / "cmyk.jpg")  # red
    pal = Image.new("P", (32, 32), 1)
    pal.putpalette([0, 0, 0, 0, 0, 255] + [0] * 762)  # entry 1: blue
    pal.save(d / "palette.png")
    Image.new("L", (32, 32), 77).save(d / "grey.png")
    pal.save(d / "palette_t.png", transparency=0)
    from visattn.data.sources import read_image_folder

    parts, _ = read_image_folder(root)
    x = parts["train"].x[parts["train"].y == 0]  # ant: 0.png, 1.png, then the files above in sorted order
    px = {name: x[i].reshape(-1, 3).mean(0) for i, name in
          enumerate(sorted(["0.png", "1.png", "grey16.png", "cmyk.jpg", "palette.png", "grey.png", "palette_t.png"]))}
    np.testing.assert_allclose(px["grey16.png"], [128, 128, 128], atol=1)
    assert px["cmyk.jpg"][0] > 240 and px["cmyk.jpg"][1:].max() < 15
    np.testing.assert_allclose(px["palette.png"], [0, 0, 255])
    np.testing.assert_allclose(px["palette_t.png"], [0, 0, 255])
    np.testing.assert_allclose(px["grey.png"], [77, 77, 77])
    for name in ("grey16.png", "cmyk.jpg", "palette.png", "grey.png"):  # visualize decodes as training did
        seen = visualize_cli.load_image(str(d / name), 32)
        np.testing.assert_allclose(seen.model_input.double().reshape(3, -1).mean(1).numpy(), px[name], atol=1)


def test_archive_member_that_escapes_its_folder_is_refused(tmp_path):
    good = _images(tmp_path / "good")
    with tarfile.open(tmp_path / "evil.tar.gz", "w:gz") as tf:
        for p in sorted(good.rglob("*")):
            tf.add(p, arcname=str(p.relative_to(good)), recursive=False)
        tf.add(good / "train" / "ant" / "0.png", arcname="../../train/ant/escape.png")
    gc.disable()  # the archive is closed by the refusal itself, not by a later garbage collection
    try:
        with pytest.raises(DataError, match=r"member '../../train/ant/escape.png' refused: escapes the dataset folder"):
            load_splits(_data_cfg(tmp_path, tmp_path / "evil.tar.gz"), seed=0)
        if Path("/proc/self/fd").is_dir():
            held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                    if os.path.exists(f"/proc/self/fd/{fd}")]
            assert str(tmp_path / "evil.tar.gz") not in held
    finally:
        gc.enable()
    batches = _cifar(tmp_path / "src" / "cifar-10-batches-py")
    with tarfile.open(tmp_path / "cifar-10-python.tar.gz", "w:gz") as tf:
        tf.add(batches, arcname="cifar-10-batches-py")
        tf.add(batches / "test_batch", arcname="../outside")
    with pytest.raises(DataError, match=r"member '../outside' refused: escapes the dataset folder"):
        load_splits(_data_cfg(tmp_path, tmp_path / "cifar-10-python.tar.gz"), seed=0)
    assert not (tmp_path / "outside").exists() and not list((tmp_path / "cache").glob("extract-*"))


# -------------------------------------------------------------------------------------- hostile configs


def _bomb(levels: int) -> str:
    text = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    for i in range(levels):
        prev, name = chr(97 + i), chr(98 + i)
        text += f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]\n"
    return text


CONFIG_FILES = [
    ("alias-bomb", _bomb(9), "expands to more than 100,000 values"),
    ("small-alias-bomb", _bomb(4) + "seed: *e\n", "expands to more than 100,000 values"),
    ("recursive-alias", "a: &a [*a]\n", "recursive alias"),
    # 5,000 levels: past the limit PyYAML >= 6.0.3 keeps itself; 70 (block and flow): below it, the walk's own
    ("deep-nesting", "seed: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 64 levels deep"),
    ("deep-nesting-70", "seed: " + "[" * 70 + "]" * 70 + "\n", "nested more than 64 levels deep"),
    ("deep-block-nesting", "".join("  " * i + f"k{i}:\n" for i in range(70)) + "  " * 70 + "v: 1\n",
     "nested more than 64 levels deep"),
    ("duplicate-section", "optim:\n  lr: 0.05\ntrain:\n  epochs: 2\noptim:\n  momentum: 0.8\n",
     "key 'optim' is given twice (lines 1 and 5)"),
    ("duplicate-key", "optim:\n  lr: 0.05\n  lr: 0.5\n", "key 'lr' is given twice (lines 2 and 3)"),
    ("too-large", "# padding\n" * 200_000, "bytes; the limit is 1,048,576"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text,fragment", [c[1:] for c in CONFIG_FILES], ids=[c[0] for c in CONFIG_FILES])
def test_hostile_config_file_is_one_short_line(tmp_path, text, fragment):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    rc, _, err = _cli(["--config", str(p), f"run_dir={tmp_path / 'run'}"])
    assert rc == 2 and fragment in _one_error_line(err) and len(err) < 800
    assert not (tmp_path / "run").exists()


def test_error_text_is_capped():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["seed=" + "9" * 100_000])
    assert len(str(e.value)) < 800 and "\n" not in str(e.value)
    assert len(str(ConfigError("x" * 10**6))) < 800


# (overrides, fragment); each must be refused before any data is read (data.root does not exist)
BAD_VALUES = [
    (["seed=18446744073709551616"], "seed: Input should be less than 4294967296"),
    (["model.widths=[-1,32,64]"], "model: widths must be a list of integers in [1, 16384], got [-1, 32, 64]"),
    (["model.stem_width=0"], "model: stem_width must be an integer in [1, 16384], got 0"),
    (["model.widths=[16384,16384,16384]"], "the limit is 2,000,000,000"),
    (["optim.betas=[2,3]"], "optim.betas: each beta must be in [0, 1)"),
    (["data.mean=[.nan,0,0]"], "data.mean: every value must be a finite number"),
    (["data.std=[.inf,1,1]"], "data.std: every value must be a finite number"),
    (["data.std=[1.0e-300,1,1]"], "data.std: every value must be >= 0.001"),  # issue 22: every loss NaN
    (["data.std=[0.2,0,0.2]"], "data.std: every value must be >= 0.001"),
    (["data.synthetic_size=100000000000"], "data.synthetic_size: Input should be less than or equal to 1000000"),
    (["data.loader=albumentations", "data.augment.extra=[{name: Resize, height: 64, width: 64}]"],
     "entry 0: Resize changes the image from 32x32x3 uint8 to 64x64x3"),
    (["data.loader=albumentations", "data.augment.extra=[{name: RandomCrop, height: 16, width: 16, p: 0.5}]"],
     "entry 0: RandomCrop changes the image from 32x32x3 uint8 to 16x16x3"),
]


@pytest.mark.parametrize("overrides,fragment", BAD_VALUES, ids=[b[0][-1].split("=")[0] for b in BAD_VALUES])
def test_out_of_range_values_are_refused_before_any_data_is_read(tmp_path, overrides, fragment):
    rc, _, err = _cli(["--config", str(SMOKE), f"run_dir={tmp_path / 'run'}", "data.source=auto",
                       f"data.root={tmp_path / 'nowhere'}", "device=cpu", *overrides])
    assert rc == 2 and fragment in _one_error_line(err)
    assert not (tmp_path / "run").exists()


TRANSFORMER_BAD = [
    ("vit_tiny", ["model.num_heads=5"], "num_heads must be a positive int (192 must be divisible by it), got 5"),
    ("vit_tiny", ["model.patch_size=7"], "img_size (32, 32) must be divisible by patch_size 7"),
    ("vit_tiny", ["model.dim=120000"], "parameters; the limit is 2,000,000,000"),
    ("cct_2", ["model.kernel_size=0"], "need n_conv_layers >= 1 and an odd kernel_size, got 2, 0"),
]


@pytest.mark.parametrize("name,overrides,fragment", TRANSFORMER_BAD, ids=[f"{b[0]}-{b[1][0]}" for b in TRANSFORMER_BAD])
def test_transformer_options_are_refused_before_any_data_is_read(tmp_path, name, overrides, fragment):
    """The meta-device build covers the transformers too (no tensor values are read while they are built)."""
    rc, _, err = _cli(["--config", str(ROOT / "configs" / f"{name}.yaml"), f"run_dir={tmp_path / 'run'}",
                       "data.source=auto", f"data.root={tmp_path / 'nowhere'}", "device=cpu", *overrides])
    assert rc == 2 and fragment in _one_error_line(err)
    assert not (tmp_path / "run").exists()


def test_size_preserving_albumentations_extra_is_accepted():
    from visattn.data import check_augment

    check_augment(load_config(None, ["data.loader=albumentations",
                                     "data.augment.extra=[{name: ColorJitter, brightness: 0.2}]"]).data)


# ------------------------------------------------------------------------------------------------ numerics


def test_metrics_line_is_strict_json_with_null_for_nonfinite():
    said = []
    line = metrics_line({"epoch": 3, "val_loss": float("nan"), "train_loss": float("inf"), "acc": 0.5}, said.append)
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c}")) == {
        "epoch": 3, "val_loss": None, "train_loss": None, "acc": 0.5}
    assert said == ["warning: epoch 3: val_loss=nan, train_loss=inf is not finite; written as null in metrics.jsonl"]


def test_nonfinite_eval_loss_is_written_as_null_and_fails_the_run_at_its_end(tmp_path, monkeypatch):
    """Before the end a non-finite validation loss is a null in its row (the epoch is never the best one) and the
    run goes on; the last one is the run's result: one error line, exit 3, and that epoch is not committed."""

    def nan_in_eval(run) -> None:  # the evaluated model's (the EMA copy's) logits are NaN, training stays finite
        run.eval_model.register_forward_hook(lambda m, args, out: None if m.training else out * float("nan"))

    rd = tmp_path / "run"
    remove = register_hook("fit_start", nan_in_eval)
    try:
        rc, out, err = _cli(_train(rd, "train.epochs=2", "log.tensorboard=false"))
    finally:
        remove()
    assert rc == 3
    line = _one_error_line(err)
    assert "the validation loss after the last epoch (2) is nan, not a finite number" in line
    assert line.endswith("; last good checkpoint kept")
    assert "warning: epoch 1: val_loss=nan is not finite; written as null in metrics.jsonl" in out
    rows = [json.loads(ln, parse_constant=lambda c: pytest.fail(f"bare {c}")) for ln in (rd / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1]  # epoch 2 is not committed ...
    assert rows[0]["val_loss"] is None and rows[0]["train_loss"] > 0 and rows[0]["best_val_acc"] == -1.0
    assert load_checkpoint(rd / "last.pt")["epoch"] == 1 and not (rd / "best.pt").exists()
    assert "epoch 2/2: train loss " in out and "| val loss n/a acc " in out  # ... but its line is printed


# every logit ~1e38: every loss is inf/NaN from the first step on (TINY: 6 steps an epoch)
NAN_LOSS = ["model.head_scale=1.0e+38"]
SHORT_NAN_RUNS = [  # (id, overrides, steps of epoch 1 run): all shorter than train.max_nonfinite_steps=10
    ("one-epoch", [], 6),
    ("max-steps", ["train.max_steps=2", "train.epochs=3"], 2),
    ("ckpt-every-step", ["train.ckpt_every_steps=1"], 6),
]


@pytest.mark.parametrize("overrides,steps", [r[1:] for r in SHORT_NAN_RUNS], ids=[r[0] for r in SHORT_NAN_RUNS])
def test_a_short_run_that_learns_nothing_fails(tmp_path, overrides, steps):
    """Issue 22: every step non-finite ends in one error line and exit 3 however short the run, no row claims a
    loss of 0, nothing is committed, and the folder is left as a run killed in its first epoch would be."""
    rd = tmp_path / "run"
    rc, out, err = _cli(_train(rd, *NAN_LOSS, *overrides))
    assert rc == 3
    assert _one_error_line(err) == (
        f"error: all {steps} training steps of epoch 1 had a non-finite loss; nothing was learned; stopping (check "
        "data.mean and data.std, lower optim.lr, use precision=bf16/fp32, or set optim.grad_clip); no checkpoint was "
        "written")
    assert "warning" not in out + err  # stopped before the evaluation: no NaN validation loss, no NaN maps
    assert f"epoch 1/{3 if 'train.epochs=3' in overrides else 1}: train loss n/a acc n/a (non-finite loss: skipped " \
           f"{steps}/{steps} steps)" in out
    assert not (rd / "metrics.jsonl").exists() and not (rd / "last.pt").exists() and not (rd / "best.pt").exists()
    rc, out, err = _cli(_train(rd, "resume=auto"))  # the corrected run starts afresh in the same folder
    assert rc == 0, err
    assert "starting a new run" in out and [r["epoch"] for r in metrics_rows(rd)] == [1]


def test_consecutive_nonfinite_losses_say_whether_a_checkpoint_was_kept(tmp_path):
    """The engine's stop after train.max_nonfinite_steps in a row names the folder's state truthfully."""
    rd = tmp_path / "run"
    rc, _, err = _cli(_train(rd, *NAN_LOSS, "train.max_nonfinite_steps=2"))
    assert rc == 3
    line = _one_error_line(err)
    assert line.startswith("error: 2 consecutive non-finite losses at step 2") and line.endswith("; no checkpoint was written")
    assert not (rd / "last.pt").exists()


def test_a_resumed_tail_that_learns_nothing_fails_and_keeps_the_checkpoint(tmp_path):
    rd = tmp_path / "run"
    rc, _, err = _cli(_train(rd, "train.epochs=2", "train.max_steps=9"))  # stopped 3 steps into epoch 2
    assert rc == 0, err
    kept = _snapshot(rd)
    assert load_checkpoint(rd / "last.pt")["step"] == 9
    rc, out, err = _cli(_train(rd, "train.epochs=2", "resume=auto", "resume_allow_changes=true", *NAN_LOSS))
    assert rc == 3
    assert ("error: all 3 training steps of epoch 2 run since the resume had a non-finite loss (3/6 in the epoch); "
            "nothing was learned; stopping (") in _one_error_line(err)
    assert _one_error_line(err).endswith("; last good checkpoint kept")
    assert "(non-finite loss: skipped 3/6 steps)" in out
    after = _snapshot(rd)
    assert {k: after[k] for k in ("last.pt", "best.pt", "metrics.jsonl")} == \
           {k: kept[k] for k in ("last.pt", "best.pt", "metrics.jsonl")}


def test_a_mid_epoch_checkpoint_of_five_statistics_still_resumes(tmp_path):
    """Mid-epoch checkpoints written before the step counts were kept hold 5 statistics; the step count is then
    the loader's position."""
    rd = tmp_path / "run"
    assert _cli(_train(rd, "train.epochs=2", "train.max_steps=9"))[0] == 0
    state = load_checkpoint(rd / "last.pt")
    assert state["epoch_stats"].shape == (7,) and state["epoch_stats"][5] == 3  # 3 steps into epoch 2
    state["epoch_stats"] = state["epoch_stats"][:5]
    save_checkpoint(state, rd / "last.pt")
    rc, _, err = _cli(_train(rd, "train.epochs=2", "resume=auto"))
    assert rc == 0, err
    assert [(r["epoch"], r["epoch_steps"], r["nonfinite_steps"]) for r in metrics_rows(rd)] == [(1, 6, 0), (2, 6, 0)]


def test_a_few_nonfinite_losses_are_skipped_counted_and_the_run_goes_on(tmp_path, monkeypatch):
    """NaN losses injected at the 2nd, 3rd and 8th training steps: those steps are skipped and counted in the
    epoch line and the metrics row; the loss and accuracy are means over the finite steps; the run ends in 0."""

    calls = []

    def poisoned(module, args, logits):  # the training forward passes' logits, NaN at those steps
        if not module.training:
            return None
        calls.append(1)
        return logits * float("nan") if len(calls) in (2, 3, 8) else None

    rd = tmp_path / "run"
    remove = register_hook("fit_start", lambda run: run.model.register_forward_hook(poisoned))
    try:
        rc, out, err = _cli(_train(rd, "train.epochs=2", "log.tensorboard=false"))
    finally:
        remove()
    assert rc == 0, err
    assert "Traceback" not in err and "warning" not in out + err
    rows = metrics_rows(rd)
    assert [(r["nonfinite_steps"], r["epoch_steps"]) for r in rows] == [(2, 6), (1, 6)]
    assert all(r["train_loss"] > 0.5 and 0 < r["train_acc"] <= 1 and r["val_loss"] > 0 for r in rows)
    assert "epoch 1/2: train loss " in out and "(non-finite loss: skipped 2/6 steps)" in out
    assert "(non-finite loss: skipped 1/6 steps)" in out
    assert load_checkpoint(rd / "last.pt")["step"] == 12 and len(calls) == 12


def test_nonfinite_attention_maps_are_skipped_with_a_warning(tmp_path):
    """A recording pass whose attention weights are NaN: the epoch's checkpoint and metrics are written, the
    maps are skipped with a warning, and the run goes on to its end."""
    from visattn.attention.tap import AttentionTap

    cfg = load_config(SMOKE, [f"run_dir={tmp_path / 'run'}", *TINY, "model.attention=cbam", "log.maps_every=1",
                              "log.probe_size=4", "train.epochs=2"])
    said: List[str] = []
    r = build(cfg, log=said.append)
    for m in r.eval_model.modules():  # NaN weights only while a recorder listens: training itself stays finite
        if isinstance(m, AttentionTap):
            m.register_forward_pre_hook(lambda mod, args: (torch.full_like(args[0], float("nan")), *args[1:])
                                        if mod.active else None)
    with RunLock(r.run_dir):
        summary = fit(r)
    assert summary["epochs"] == 2 and (tmp_path / "run" / "last.pt").exists()
    warned = [s for s in said if "are not finite; those pictures were skipped" in s]
    assert len(warned) == 2 and warned[0].startswith("warning: epoch 1: the attention maps of ")


# ------------------------------------------------------------------------------------- the other commands


@pytest.fixture(scope="module")
def broken_config_checkpoint(tmp_path_factory, finished_run) -> Path:
    state = load_checkpoint(finished_run / "last.pt")
    state["config"]["model"]["widths"] = [-1, 16, 16]
    return save_checkpoint(state, tmp_path_factory.mktemp("broken") / "broken.pt")


EVAL_OPTIONS = [
    (["--batch-size", "0"], "--batch-size must be between 1 and 65536, got 0"),
    (["--device", "foo"], "--device 'foo' is not a device; use auto, cpu, cuda or cuda:N"),
    (["--device", "meta"], "--device 'meta': only cpu and cuda devices are supported"),
]


@pytest.mark.parametrize("argv,fragment", EVAL_OPTIONS, ids=["batch-size-0", "device-foo", "device-meta"])
def test_evaluate_validates_its_options(finished_run, argv, fragment):
    rc, _, err = _cli(["--checkpoint", str(finished_run / "best.pt"), *argv], tool=evaluate_cli.main)
    assert rc == 2 and fragment in _one_error_line(err)


def test_evaluate_and_visualize_wrap_model_building_failures(broken_config_checkpoint, tmp_path):
    rc, _, err = _cli(["--checkpoint", str(broken_config_checkpoint), "--device", "cpu"], tool=evaluate_cli.main)
    assert rc == 2 and "its stored config does not build a model (widths must be" in _one_error_line(err)
    img = tmp_path / "a.png"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(img)
    rc, _, err = _cli(["--checkpoint", str(broken_config_checkpoint), "--images", str(img), "--out", str(tmp_path / "o"),
                       "--device", "cpu"], tool=visualize_cli.main)
    assert rc == 2 and "does not build a model" in _one_error_line(err)


VIS_OPTIONS = [
    (["--scale", "5000"], "--scale must be between 1 and 32, got 5000"),
    (["--alpha", "nan"], "--alpha must be between 0.0 and 1.0, got nan"),
    (["--device", "foo"], "--device 'foo' is not a device"),
    (["--validation", "0"], "--validation must be between 1 and 10000, got 0"),
]


@pytest.mark.parametrize("argv,fragment", VIS_OPTIONS, ids=["scale", "alpha", "device", "validation"])
def test_visualize_validates_its_options(finished_run, tmp_path, argv, fragment):
    src = ["--images", str(ROOT / "assets" / "maps_cbam.png")] if "--validation" not in argv else []
    rc, _, err = _cli(["--checkpoint", str(finished_run / "best.pt"), "--out", str(tmp_path / "o"), *src, *argv],
                      tool=visualize_cli.main)
    assert rc == 2 and fragment in _one_error_line(err)
    assert not (tmp_path / "o").exists()


def test_evaluate_scores_a_folder_of_test_images_only(tmp_path):
    classes = tuple(f"c{i}" for i in range(3))
    train_dir = _images(tmp_path / "full", classes=classes, per_class=10, splits=("train", "test"), fmt="jpg")
    rd = tmp_path / "run"
    assert _cli(_train(rd, "data.source=auto", f"data.root={train_dir}", f"data.cache_dir={tmp_path / 'cache'}",
                       "train.batch_size=10"))[0] == 0
    only_test = tmp_path / "only_test"
    (only_test / "test").mkdir(parents=True)
    for c in classes[:2]:
        shutil.copytree(train_dir / "test" / c, only_test / "test" / c)
    (only_test / "test" / classes[2]).symlink_to(train_dir / "test" / classes[2], target_is_directory=True)  # followed
    assert not (only_test / "train").exists()
    done = subprocess.run([sys.executable, "-m", "visattn.evaluate", "--checkpoint", str(rd / "best.pt"), "--data",
                           str(only_test), "--device", "cpu", "--json"], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=WAIT)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert r["images"] == 30 and r["split"].startswith(f"test split of {only_test}")
    want = json.loads(_cli(["--checkpoint", str(rd / "best.pt"), "--data", str(train_dir), "--device", "cpu", "--json"],
                           tool=evaluate_cli.main)[1])
    assert r["acc"] == pytest.approx(want["acc"]) and r["images"] == want["images"]
    # training still needs train/
    rc, _, err = _cli(_train(tmp_path / "r2", "data.source=auto", f"data.root={only_test}",
                             f"data.cache_dir={tmp_path / 'cache'}"))
    assert rc == 2 and "no train/ folder" in _one_error_line(err)


def test_a_folder_that_cannot_be_locked_runs_with_a_warning(tmp_path, monkeypatch):
    import errno

    import visattn.rundir as rundir

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(rundir.fcntl, "flock", no_locks)
    said = []
    with RunLock(tmp_path / "run", warn=said.append) as lock:
        assert lock.fd is None and not holds(tmp_path / "run") and not (tmp_path / "run" / LOCK_NAME).exists()
    assert said == [f"run_dir {str(tmp_path / 'run')!r} cannot be locked (No locks available); another run on the "
                    "same folder would not be refused"]

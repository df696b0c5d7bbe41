"""Off the happy path (issue 60): damaged checkpoints, full disks, hostile folders and files, broken logs, and
resumes under changed settings. Each fault ends in one ``error: ...`` line and a non-zero exit (never a
traceback, never a silent wrong result), or works; files are left as they were or as documented
(docs/reliability.md). Process behaviour (exit code, hangs, resource limits, permissions) is checked in a
subprocess; the rest through the command-line entry points in-process, as tests/test_faults.py does.
"""
from __future__ import annotations

import io
import json
import os
import resource
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import List, Sequence

import numpy as np
import pytest
import torch
from conftest import ROOT, SMOKE
from PIL import Image
from test_faults import TINY, _cli, _env, _snapshot, _write_images

from visattn import evaluate as evaluate_cli
from visattn import visualize as visualize_cli
from visattn.config import load_config
from visattn.data.sources import read_image_folder
from visattn.errors import CheckpointError, ConfigError, DataError
from visattn.rundir import DIGEST_KEY, load_checkpoint, save_checkpoint

WAIT = 300.0  # seconds: the bound on a subprocess (a hang fails the test instead of the suite)
RUN = TINY + ["train.batch_size=50", "log.tensorboard=false"]


def _argv(run_dir: Path, *extra: str) -> List[str]:
    return ["--config", str(SMOKE), f"run_dir={run_dir}", *RUN, *extra]


def _one_line(rc: int, err: str, fragment: str, status: int = 2) -> None:
    assert rc == status, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert fragment in lines[0], err


def _proc(args: List[str], timeout: float = WAIT, prefix: Sequence[str] = (), **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, *args], cwd=ROOT, env=kw.pop("env", _env()), capture_output=True,
                          text=True, timeout=timeout, **kw)


def _copy_run(finished_run: Path, dest: Path) -> Path:
    shutil.copytree(finished_run, dest)
    return dest


def _flip_largest_tensor(src: Path, dst: Path) -> None:
    """Invert 8 bytes in the middle of the largest tensor record of the checkpoint's zip (its CRC is not checked
    by torch.load, so the weights would load changed)."""
    shutil.copy(src, dst)
    with zipfile.ZipFile(dst) as z:
        rec = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(dst, "r+b") as f:
        f.seek(rec.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        at = rec.header_offset + 30 + name_len + extra_len + rec.file_size // 2
        f.seek(at)
        b = f.read(8)
        f.seek(at)
        f.write(bytes(x ^ 0xFF for x in b))


# ---------------------------------------------------------------------------------- 1. checkpoint integrity


def test_a_flipped_byte_is_refused_by_evaluate(tmp_path, finished_run):
    bad = tmp_path / "flipped.pt"
    _flip_largest_tensor(finished_run / "best.pt", bad)
    r = _proc(["-m", "visattn.evaluate", "--checkpoint", str(bad), "--data", "synthetic", "--device", "cpu"])
    _one_line(r.returncode, r.stderr, "is damaged")
    assert "flipped.pt" in r.stderr and "top-1" not in r.stdout


def test_a_damaged_or_nonfinite_checkpoint_is_refused_by_every_loader(tmp_path, finished_run):
    flipped = tmp_path / "flipped.pt"
    _flip_largest_tensor(finished_run / "last.pt", flipped)
    state = load_checkpoint(finished_run / "last.pt")
    nan = tmp_path / "nan.pt"
    save_checkpoint({**state, "model": {k: v.float() * float("nan") if v.is_floating_point() else v
                                        for k, v in state["model"].items()}}, nan)
    nan_ema = tmp_path / "nan_ema.pt"
    save_checkpoint({**state, "ema": {k: torch.full_like(v, float("inf")) if v.is_floating_point() else v
                                      for k, v in state["ema"].items()}}, nan_ema)
    for path, fragment in ((flipped, "is damaged"), (nan, "non-finite weights (NaN or inf in model/"),
                           (nan_ema, "non-finite weights (NaN or inf in ema/")):
        with pytest.raises(CheckpointError, match="damaged|non-finite"):
            load_checkpoint(path)
        _one_line(*_cli(["--checkpoint", str(path), "--data", "synthetic", "--device", "cpu"], evaluate_cli.main),
                  fragment)
        _one_line(*_cli(["--checkpoint", str(path), "--validation", "1", "--data", "synthetic", "--device", "cpu",
                         "--out", str(tmp_path / "maps")], visualize_cli.main), fragment)
        run_dir = tmp_path / f"resume-{path.stem}"
        run_dir.mkdir()
        shutil.copy(path, run_dir / "last.pt")
        before = _snapshot(run_dir)
        _one_line(*_cli(_argv(run_dir, "resume=auto", "train.epochs=2", "train.ema_decay=0.9")), fragment)
        assert _snapshot(run_dir) == before
        _one_line(*_cli(_argv(tmp_path / f"student-{path.stem}", "train.epochs=1",
                              f"train.distill.teacher={path}")), fragment)
        assert not (tmp_path / f"student-{path.stem}").exists()


def test_init_from_checks_the_digest_too(tmp_path, finished_run):
    flipped = tmp_path / "flipped.pt"
    _flip_largest_tensor(finished_run / "last.pt", flipped)
    try:
        load_config(SMOKE, [*RUN, f"model.init_from={flipped}"])
    except ConfigError as e:  # model.init_from is another change of this round
        pytest.skip(f"model.init_from not available ({e})")
    _one_line(*_cli(_argv(tmp_path / "run", "train.epochs=1", f"model.init_from={flipped}")), "is damaged")


def test_a_checkpoint_without_a_digest_is_accepted_after_the_finite_check(tmp_path, finished_run, pre_digest_best):
    """Checkpoints written before digests existed (``pre_digest_best``: a file of the visattn before them, with
    no entry or config key that came after) still load, and are still refused when not finite. A file of today's
    writer without its digest is refused (tests/test_hostile_gaps.py, tests/test_hostile_kinds.py)."""
    assert DIGEST_KEY not in load_checkpoint(finished_run / "last.pt")  # the loader hands back the state without it
    state = torch.load(pre_digest_best, weights_only=True)
    torch.save(state, tmp_path / "old.pt")
    assert load_checkpoint(tmp_path / "old.pt")["epoch"] == 1
    state["model"] = {k: v.float() * float("nan") if v.is_floating_point() else v for k, v in state["model"].items()}
    torch.save(state, tmp_path / "old_nan.pt")
    with pytest.raises(CheckpointError, match="non-finite"):
        load_checkpoint(tmp_path / "old_nan.pt")


# ------------------------------------------------------------------------------------------- 4. disk full


def _fsize_limit(nbytes: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


def test_disk_full_during_the_first_checkpoint_is_one_line_and_leaves_no_run_files(tmp_path):
    rd = tmp_path / "run"
    r = _proc(["train.py", *_argv(rd, "train.epochs=2", "log.tensorboard=true")], preexec_fn=_fsize_limit(60_000))
    _one_line(r.returncode, r.stderr, "File too large", status=1)
    assert not rd.exists() or not [p for p in rd.iterdir() if p.name != ".visattn-run.lock"]
    # the folder is reusable: resume=auto starts a new run there
    rc, err = _cli(_argv(rd, "resume=auto", "train.epochs=1"))
    assert rc == 0, err


# ------------------------------------------------------------------------ 5. model x data, nothing written yet


def test_a_vit_given_other_image_sizes_fails_before_anything_is_written(tmp_path):
    rd = tmp_path / "v"
    rc, err = _cli(["--config", str(ROOT / "configs" / "vit_tiny.yaml"), f"run_dir={rd}", "data.source=synthetic",
                    "data.synthetic_size=60", "data.val_size=20", "data.image_size=48", "train.batch_size=20",
                    "train.epochs=1", "log.progress=false", "device=cpu", "model.depth=1"])
    _one_line(rc, err, "cannot take this data's 48x48 images (data.image_size=48)")
    assert not rd.exists()


def test_a_run_that_fails_before_its_first_checkpoint_leaves_the_folder_reusable(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    rc, err = _cli(_argv(rd, "train.epochs=1", "log.tensorboard=true", "model.head_scale=1.0e+38",
                         "train.max_nonfinite_steps=2"))
    assert rc == 3 and "no checkpoint was written" in err, err
    assert sorted(p.name for p in rd.iterdir()) == []  # config.yaml, run_info.json, tb/, metrics.jsonl removed
    rc, err = _cli(_argv(rd, "train.epochs=1"))  # the corrected command, same folder
    assert rc == 0, err


# ------------------------------------------------------------------------------------------------ 6. FIFO


def test_a_fifo_as_data_root_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = _proc(["train.py", *_argv(tmp_path / "run", "data.source=folder", f"data.root={fifo}")])
    _one_line(r.returncode, r.stderr, "is a FIFO, not a folder or an archive")
    rc, err = _cli(_argv(tmp_path / "run", "data.source=cifar_python", f"data.root={fifo}",
                         f"data.cache_dir={tmp_path / 'cache'}"))  # (past the check above, so it cannot hang here)
    _one_line(rc, err, "is a FIFO, not a folder or an archive")


# ------------------------------------------------------------------------------------------ 7. run_dir


def test_system_and_home_folders_are_refused_as_run_dir(tmp_path, monkeypatch):
    for rd in ("/", "/usr", "/etc", "/tmp"):
        _one_line(*_cli(_argv(Path(rd), "train.epochs=1")), "is a system folder")
    assert not Path("/.visattn-run.lock").exists() and not Path("/last.pt").exists()
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    _one_line(*_cli(_argv(home, "train.epochs=1")), "is the home folder")
    assert list(home.iterdir()) == []


def test_a_folder_with_other_files_is_refused_as_run_dir(tmp_path):
    rd = tmp_path / "photos"
    rd.mkdir()
    (rd / "holiday.jpg").write_bytes(b"x")
    for extra in ([], ["resume=auto"]):
        _one_line(*_cli(_argv(rd, "train.epochs=1", *extra)), "holds other files (holiday.jpg) and no run")
    assert sorted(p.name for p in rd.iterdir()) == ["holiday.jpg"]


# --------------------------------------------------------------------------------- 8, 15. CIFAR archives


def _cifar_archive(path: Path, size: int) -> Path:
    class Zeros(io.RawIOBase):
        def __init__(self, n: int):
            self.n = n

        def readable(self) -> bool:
            return True

        def readinto(self, b) -> int:
            k = min(len(b), self.n)
            b[:k] = bytes(k)
            self.n -= k
            return k

    with tarfile.open(path, "w:gz") as tf:
        ti = tarfile.TarInfo("cifar-10-batches-py/data_batch_1")
        ti.size = size
        tf.addfile(ti, io.BufferedReader(Zeros(size)))
    return path


def test_a_cifar_archive_bomb_is_refused_before_it_is_written(tmp_path):
    bomb = _cifar_archive(tmp_path / "cifar-10-python.tar.gz", (64 << 20) + 1)
    assert bomb.stat().st_size < 200_000
    cache = tmp_path / "cache"
    rc, err = _cli(_argv(tmp_path / "run", f"data.root={bomb}", "data.source=auto", f"data.cache_dir={cache}"))
    _one_line(rc, err, "refused: the CIFAR-10 batches are at most")
    assert sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) < 1 << 20  # nothing extracted


def test_disk_full_while_extracting_is_not_called_a_corrupt_archive(tmp_path):
    archive = _cifar_archive(tmp_path / "cifar-10-python.tar.gz", 2 << 20)
    r = _proc(["train.py", *_argv(tmp_path / "run", f"data.root={archive}", "data.source=auto",
                                  f"data.cache_dir={tmp_path / 'cache'}")], preexec_fn=_fsize_limit(1 << 20))
    _one_line(r.returncode, r.stderr, "cannot be extracted into")
    assert "File too large" in r.stderr and "corrupt" not in r.stderr


# ------------------------------------------------------------------------------------- 9, 10. visualize


def _png_header(path: Path, w: int, h: int) -> Path:
    """A 1-bit greyscale PNG whose header says ``w`` x ``h`` (Pillow reads the size from the header alone)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = zlib.compress(b"\0" * 64)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0))
                     + chunk(b"IDAT", raw) + chunk(b"IEND", b""))
    return path


def test_visualize_refuses_a_decompression_bomb(tmp_path, finished_run):
    bomb = _png_header(tmp_path / "bomb.png", 20000, 20000)
    rc, err = _cli(["--checkpoint", str(finished_run / "best.pt"), "--images", str(bomb), "--device", "cpu",
                    "--out", str(tmp_path / "out")], visualize_cli.main)
    _one_line(rc, err, "a decompression bomb?")


def test_an_ema_entry_that_is_not_a_state_dict_is_one_line(tmp_path, finished_run):
    state = load_checkpoint(finished_run / "best.pt")
    state["ema"] = [1, 2, 3]
    save_checkpoint(state, tmp_path / "ema_list.pt")
    args = ["--checkpoint", str(tmp_path / "ema_list.pt"), "--device", "cpu"]
    _one_line(*_cli(args + ["--data", "synthetic"], evaluate_cli.main), "its ema entry is a list")
    _one_line(*_cli(args + ["--validation", "1", "--data", "synthetic", "--out", str(tmp_path / "o")],
                    visualize_cli.main), "its ema entry is a list")


# ----------------------------------------------------------------------------------- 11, 12. metrics.jsonl


@pytest.mark.parametrize("damage,fragment", [
    (lambda b: b.replace(b'"epoch": 1', b'"epoch": "x"'), "line 1 is damaged (its epoch is 'x', not an integer)"),
    (lambda b: b + b"\xff\xfe not utf-8\n", "line 2 is damaged (not UTF-8 text)"),
    (lambda b: b + b"{not json\n", "line 2 is damaged (not valid JSON)"),
], ids=["epoch-not-int", "not-utf8", "not-json"])
def test_a_damaged_metrics_row_is_named_and_refused(tmp_path, finished_run, damage, fragment):
    rd = _copy_run(finished_run, tmp_path / "run")
    m = rd / "metrics.jsonl"
    m.write_bytes(damage(m.read_bytes()))
    before = _snapshot(rd)
    _one_line(*_cli(_argv(rd, "resume=auto", "train.epochs=2", "train.ema_decay=0.9")), fragment)
    assert "metrics.jsonl" in _cli(_argv(rd, "resume=auto", "train.epochs=2", "train.ema_decay=0.9"))[1]
    assert _snapshot(rd) == before


def test_a_torn_last_metrics_line_is_still_dropped(tmp_path, finished_run):
    rd = _copy_run(finished_run, tmp_path / "run")
    with open(rd / "metrics.jsonl", "ab") as f:
        f.write(b'{"epoch": 2, "tr')  # a run killed while writing its row
    rc, err = _cli(_argv(rd, "resume=auto", "train.epochs=2", "train.ema_decay=0.9"))
    assert rc == 0, err
    assert [json.loads(x)["epoch"] for x in (rd / "metrics.jsonl").read_text().splitlines()] == [1, 2]


# ------------------------------------------------------------------------------ 13, 14. permissions


def _as_nobody(tmp_root: Path) -> List[str]:
    """A command prefix that runs the subprocess as an unprivileged user where the tests run as root (root reads
    and writes any file)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a permission cannot be denied")
    tmp_root.chmod(0o777)
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if subprocess.run([*prefix, "test", "-r", str(ROOT / "train.py"), "-a", "-x", sys.executable]).returncode:
        pytest.skip("the checkout or its Python cannot be read by an unprivileged user (a private parent folder)")
    return prefix


@pytest.fixture
def open_dir():
    d = Path(tempfile.mkdtemp(prefix="visattn-hostile-"))  # a folder an unprivileged user can reach
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_an_unreadable_checkpoint_is_not_called_corrupt(tmp_path, finished_run):
    ck = tmp_path / "locked.pt"
    shutil.copy(finished_run / "best.pt", ck)
    ck.chmod(0)
    root = os.geteuid() == 0
    if root:  # root reads any file: be an unprivileged user for the load (the saved uid stays root)
        os.seteuid(65534)
    try:
        rc, err = _cli(["--checkpoint", str(ck), "--data", "synthetic", "--device", "cpu"], evaluate_cli.main)
    finally:
        if root:
            os.seteuid(0)
    _one_line(rc, err, "cannot be read (Permission denied)")
    assert "corrupt" not in err


def test_an_unwritable_tb_folder_is_one_line(open_dir, finished_run):
    rd = _copy_run(finished_run, open_dir / "run")
    (rd / "tb").mkdir(exist_ok=True)
    for p in [rd, *rd.rglob("*")]:
        p.chmod(0o777 if p.is_dir() else 0o666)
    (rd / "tb").chmod(0o555)
    r = _proc(["train.py", *_argv(rd, "resume=auto", "train.epochs=2", "train.ema_decay=0.9", "log.tensorboard=true")],
              prefix=_as_nobody(open_dir), env=_env(HOME=str(open_dir)))
    _one_line(r.returncode, r.stderr, "Permission denied", status=1)
    assert "tb" in r.stderr


# ---------------------------------------------------------------------------- 16, 17. images and modes


def test_links_in_an_image_archive_are_read_and_a_dangling_one_is_named(tmp_path):
    good = _write_images(tmp_path / "good", per_class=2)
    arc = tmp_path / "links.tar.gz"
    with tarfile.open(arc, "w:gz") as tf:
        for p in sorted(good.rglob("*")):
            tf.add(p, arcname=str(p.relative_to(good)), recursive=False)
        for kind, name in ((tarfile.SYMTYPE, "train/ant/s.png"), (tarfile.LNKTYPE, "train/cow/h.png")):
            ti = tarfile.TarInfo(name)
            ti.type = kind
            ti.linkname = "0.png" if kind == tarfile.SYMTYPE else "train/bee/0.png"
            tf.addfile(ti)
    parts, _ = read_image_folder(arc)
    assert len(parts["train"]) == 8  # 6 files and 2 links
    with tarfile.open(tmp_path / "dangling.tar.gz", "w:gz") as tf:
        for p in sorted(good.rglob("*")):
            tf.add(p, arcname=str(p.relative_to(good)), recursive=False)
        ti = tarfile.TarInfo("train/ant/gone.png")
        ti.type, ti.linkname = tarfile.SYMTYPE, "nowhere.png"
        tf.addfile(ti)
    with pytest.raises(DataError, match="gone.png refused: a symbolic link to 'nowhere.png'"):
        read_image_folder(tmp_path / "dangling.tar.gz")


def test_tiff_and_gif_images_are_read(tmp_path):
    rng = np.random.default_rng(0)
    for c, ext in (("ant", "tif"), ("bee", "tiff"), ("cow", "gif")):
        (tmp_path / "d" / "train" / c).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "d" / "train" / c / f"{i}.{ext}")
    parts, _ = read_image_folder(tmp_path / "d")
    assert len(parts["train"]) == 6 and parts["train"].classes == ("ant", "bee", "cow")


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_checkpoints_follow_the_umask(tmp_path, finished_run, mask, mode):
    state = load_checkpoint(finished_run / "last.pt")
    old = os.umask(mask)
    try:
        save_checkpoint(state, tmp_path / "c.pt")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "c.pt").stat().st_mode) == mode


# ------------------------------------------------------------------------ beyond the 17: changed settings


@pytest.mark.parametrize("override,key", [
    ("optim.lr=0.05", "optim.lr"), ("optim.momentum=0.5", "optim.momentum"),
    ("optim.weight_decay=0.01", "optim.weight_decay"), ("sched.warmup_epochs=0.1", "sched.warmup_epochs"),
    ("train.ema_decay=0.5", "train.ema_decay"), ("train.lookahead_every=5", "train.lookahead_every"),
])
def test_resume_refuses_a_change_the_saved_state_depends_on(tmp_path, finished_run, override, key):
    rd = _copy_run(finished_run, tmp_path / "run")
    before = _snapshot(rd)
    for allow in ([], ["resume_allow_changes=true"]):
        rc, err = _cli(_argv(rd, "resume=auto", "train.epochs=2", "train.ema_decay=0.9", override, *allow))
        _one_line(rc, err, "which cannot change on resume")
        assert key in err
    assert _snapshot(rd) == before


def test_resume_takes_a_new_grad_clip_and_precision(tmp_path, finished_run):
    rd = _copy_run(finished_run, tmp_path / "run")
    rc, err = _cli(_argv(rd, "resume=auto", "train.epochs=2", "train.ema_decay=0.9", "optim.grad_clip=1.0",
                         "precision=bf16"))
    assert rc == 0, err


def test_resume_refuses_a_teacher_file_that_changed(tmp_path, finished_run):
    teacher = tmp_path / "teacher.pt"
    shutil.copy(finished_run / "last.pt", teacher)
    rd = tmp_path / "student"
    rc, err = _cli(_argv(rd, "train.epochs=1", f"train.distill.teacher={teacher}"))
    assert rc == 0, err
    assert load_checkpoint(rd / "last.pt")["teacher_digest"].startswith("sha256:")
    state = load_checkpoint(teacher)
    state["model"] = {k: v + 0.01 if v.is_floating_point() else v for k, v in state["model"].items()}
    save_checkpoint(state, teacher)
    before = _snapshot(rd)
    _one_line(*_cli(_argv(rd, "resume=auto", "train.epochs=2", f"train.distill.teacher={teacher}")),
              "train.distill.teacher")
    assert "changed since" in _cli(_argv(rd, "resume=auto", "train.epochs=2", f"train.distill.teacher={teacher}"))[1]
    assert _snapshot(rd) == before


# ------------------------------------------------------------------------- beyond the 17: numeric options


@pytest.mark.parametrize("override,fragment", [
    ("optim.lr=.nan", "optim.lr: Input should be a finite number"),
    ("optim.grad_clip=.inf", "optim.grad_clip: Input should be a finite number"),
    ("sched.warmup_epochs=.inf", "sched.warmup_epochs: Input should be a finite number"),
    ("train.ema_decay=.nan", "train.ema_decay: Input should be a finite number"),
    ("train.lookahead_decay=.nan", "train.lookahead_decay"),
    ("train.distill.temperature=.inf", "train.distill.temperature"),
    ("model.head_scale=.nan", "model: option head_scale must be a finite number"),
    ("model.bn_momentum=2", "model: option bn_momentum must be in [0, 1]"),
    ("model.bn_eps=0", "model: option bn_eps must be in (0, 1]"),
    ("model.attn_kwargs={rd_ratio: .nan}", "model: option attn_kwargs.rd_ratio must be a finite number"),
    ("model.attn_kwargs={rd_ratio: -1}", "model: option attn_kwargs.rd_ratio must be in (0, 64]"),
    ("eval.batch_size=100000000", "eval.batch_size"),
])
def test_numeric_options_are_checked_at_config_time(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(SMOKE, [override])
    assert fragment in str(e.value)


@pytest.mark.parametrize("override,fragment", [
    ("model.drop_path_rate=5", "model: option drop_path_rate must be in [0, 1)"),
    ("model.attn_kwargs={attn_drop: .inf}", "model: option attn_kwargs.attn_drop must be a finite number"),
    ("model.mlp_ratio=0", "model: option mlp_ratio must be in (0, 64]"),
])
def test_transformer_options_are_checked_at_config_time(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "vit_tiny.yaml", [override])
    assert fragment in str(e.value)


# ---------------------------------------------------------------------- beyond the 17: bench result files


def _script(script: str, *args: str) -> tuple[int, str, str]:
    """A bench script's ``__main__`` in-process, as ``python -m bench.NAME`` runs it (its imports are already
    loaded): (exit status, stdout, stderr)."""
    import contextlib

    from test_bench import run_module

    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = [script, *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                run_module(script)
                rc = 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
                if isinstance(e.code, str):
                    print(e.code, file=err)
    finally:
        sys.argv = argv
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("content", [None, "", "{not json", "[1, 2", '"a string"'],
                         ids=["missing", "empty", "malformed", "truncated", "wrong-type"])
def test_bench_readers_refuse_a_bad_results_file(tmp_path, content):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    for script, args in (("attention_report.py", ["--summary", "--results", str(path)]),
                         ("reference_airbench.py", ["--table", "--results", str(path)]),
                         ("faithfulness.py", ["--report", "--out", str(path)])):
        rc, out, err = _script(script, *args)
        assert rc != 0 and "Traceback" not in err, (script, err)
        assert len(err.strip().splitlines()) == 1 and str(path) in err, (script, err)
        assert not out.strip(), (script, out)


def test_time_to_accuracy_refuses_a_bad_run_info(tmp_path, finished_run):
    rd = _copy_run(finished_run, tmp_path / "run")
    (rd / "run_info.json").write_text("{torn")
    rc, _, err = _script("time_to_accuracy.py", str(rd))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "run_info.json" in err, err

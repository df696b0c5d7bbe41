"""Runs that survive: kill -9 at any point, SIGTERM, hostile checkpoints and bad inputs.

The signal tests start ``train.py``'s own ``main`` as a subprocess inside a small probe (written to the test's
temporary folder) that appends each finished step number to a log file, so the test can wait for a given step
by polling that file (never by sleeping) and knows the step a process had reached when it was killed. The
probe can also SIGKILL its own process halfway through writing the N-th checkpoint: a kill during a write,
made deterministic.

Every bad input must end in one ``error: ...`` line on stderr (no traceback), a non-zero exit status, and leave
the files of an existing run byte-for-byte as they were.
"""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
import pytest
import torch
from conftest import FINISHED, ROOT, SMOKE, metrics_rows, run_cli
from PIL import Image

from visattn import evaluate as evaluate_cli
from visattn.cli import main
from visattn.config import load_config
from visattn.errors import CheckpointError
from visattn.hooks import HOOKS
from visattn.models import create_model
from visattn.rundir import load_checkpoint, save_checkpoint
from visattn.trainer import run

TINY = ["data.synthetic_size=400", "data.val_size=100", "model.widths=[8,16,16]", "model.stem_width=8",
        "model.attention=none", "log.progress=false", "log.maps_every=0", "device=cpu", "eval.tta=none",
        "precision=fp32"]  # fp32: over twice as fast as bf16 on CPUs without bf16 matrix units
# the signal tests: 300 training images in batches of 10 = 30 steps per epoch, a checkpoint every 3 steps
STEPS_PER_EPOCH, EPOCHS, EVERY = 30, 2, 3
SIGNAL_RUN = TINY + ["train.batch_size=10", f"train.epochs={EPOCHS}", f"train.ckpt_every_steps={EVERY}",
                     "deterministic=true", "log.tensorboard=false"]
WAIT = 120.0  # seconds: the bound on every wait for a subprocess

PROBE = r'''
import io, os, signal, sys
import torch
from visattn.hooks import register_hook
from visattn.cli import main

step_log = os.environ["PROBE_STEP_LOG"]
kill_in_save = int(os.environ.get("PROBE_KILL_IN_SAVE", "0"))
saves = 0

def logging(run, step):
    with open(step_log, "a") as f:  # a step_end hook: before the step's own checks, which may checkpoint
        f.write(f"{step}\n")
register_hook("step_end", logging)

real_save = torch.save
def torn_save(obj, f, *a, **k):
    # the N-th checkpoint write stops halfway: half the bytes reach the temporary file, then SIGKILL
    global saves
    saves += 1
    if saves != kill_in_save:
        return real_save(obj, f, *a, **k)
    buf = io.BytesIO()
    real_save(obj, buf, *a, **k)
    data = buf.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = torn_save

sys.exit(main(sys.argv[1:]))
'''


# ------------------------------------------------------------------------------------------------ helpers


def _snapshot(folder: Path) -> Dict[str, str]:
    """Every file under ``folder`` (hidden ones too) with the sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _env(**extra: str) -> Dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **extra)


class Trainer:
    """``train.py`` in a subprocess through the probe; ``steps()`` reads the probe's step log."""

    def __init__(self, tmp_path: Path, run_dir: Path, *overrides: str, kill_in_save: int = 0):
        probe = tmp_path / "probe.py"
        if not probe.exists():
            probe.write_text(PROBE)
        self.step_log = tmp_path / f"steps-{time.monotonic_ns()}.log"
        self.step_log.touch()
        self.run_dir = run_dir
        cmd = [sys.executable, str(probe), "--config", str(SMOKE), f"run_dir={run_dir}", *SIGNAL_RUN, *overrides]
        env = _env(PROBE_STEP_LOG=str(self.step_log), PROBE_KILL_IN_SAVE=str(kill_in_save))
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def steps(self) -> List[int]:
        return [int(s) for s in self.step_log.read_text().split()]

    def poll_until(self, ready: Callable[[], bool], what: str) -> bool:
        """Poll (1 ms apart) until ``ready()``; False if the process ended first. Bounded by WAIT."""
        deadline = time.monotonic() + WAIT
        while not ready():
            if self.proc.poll() is not None:
                return False
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"timed out waiting for {what}")
            time.sleep(0.001)
        return True

    def wait(self) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=WAIT)
        return self.proc.returncode, out, err


def _tmp_files(run_dir: Path) -> List[Path]:
    return list(run_dir.glob(".*.pt.*.tmp")) if run_dir.is_dir() else []  # checkpoint writes in progress


# --------------------------------------------------------------------------------------------- SIGKILL


@pytest.mark.slow
def test_kill_9_anywhere_loses_at_most_one_interval_and_resumes_exactly(tmp_path):
    total = EPOCHS * STEPS_PER_EPOCH
    # the reference: the same run, never interrupted (a subprocess too, so both use the same thread settings)
    ref = tmp_path / "ref"
    r = subprocess.run([sys.executable, "train.py", "--config", str(SMOKE), f"run_dir={ref}", *SIGNAL_RUN],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=WAIT)
    assert r.returncode == 0, r.stderr

    rd = tmp_path / "run"
    # 1) kill -9 mid-epoch, between two checkpoints (the step log has reached step 7; checkpoints at 3 and 6)
    t = Trainer(tmp_path, rd)
    assert t.poll_until(lambda: any(s >= 7 for s in t.steps()), "step 7")
    t.proc.send_signal(signal.SIGKILL)
    rc, _, _ = t.wait()
    assert rc == -signal.SIGKILL
    reached = max(t.steps())
    ck = load_checkpoint(rd / "last.pt")
    assert reached - EVERY <= ck["step"] <= reached and ck["step"] % EVERY == 0
    assert 0 < ck["loader"]["position"] < STEPS_PER_EPOCH  # mid-epoch

    # 2) killed halfway through writing a checkpoint (the probe SIGKILLs itself in its third save after resuming)
    t = Trainer(tmp_path, rd, "resume=auto", kill_in_save=3)
    rc, _, err = t.wait()
    assert rc == -signal.SIGKILL, err
    reached = max(t.steps())
    torn = _tmp_files(rd)
    assert len(torn) == 1 and torn[0].name.startswith(".last.pt.")  # the torn write is in the temporary file only
    ck = load_checkpoint(rd / "last.pt")  # ... and last.pt is the previous, whole checkpoint
    assert ck["step"] == reached - EVERY

    # 3) kill -9 from outside the moment a new checkpoint write is seen in progress (a new temporary file)
    t = Trainer(tmp_path, rd, "resume=auto")
    caught = t.poll_until(lambda: any(p not in torn for p in _tmp_files(rd)), "a checkpoint write")
    if caught:
        t.proc.send_signal(signal.SIGKILL)
    rc, _, err = t.wait()
    assert rc in (0, -signal.SIGKILL), err  # 0: the run ended before a write was seen (a very fast machine)
    assert not torn[0].exists()  # the resume cleared the torn temporary file of (2)
    if rc == -signal.SIGKILL:
        reached = max(t.steps())
        ck = load_checkpoint(rd / "last.pt")
        assert reached - EVERY <= ck["step"] <= reached

    # 4) resume to the end: the same steps, weights and metrics as the run that was never killed
    r = subprocess.run([sys.executable, "train.py", "--config", str(SMOKE), f"run_dir={rd}", *SIGNAL_RUN,
                        "resume=auto"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=WAIT)
    assert r.returncode == 0, r.stderr
    got, want = load_checkpoint(rd / "last.pt"), load_checkpoint(ref / "last.pt")
    assert got["step"] == want["step"] == total
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
    assert metrics_rows(rd) == metrics_rows(ref)
    assert _tmp_files(rd) == []


# --------------------------------------------------------------------------------------------- SIGTERM


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_exits_143(tmp_path):
    rd = tmp_path / "run"
    t = Trainer(tmp_path, rd, "train.ckpt_every_steps=0")  # no periodic checkpoint: the SIGTERM save is the only one
    assert t.poll_until(lambda: any(s >= 2 for s in t.steps()), "step 2")
    t.proc.send_signal(signal.SIGTERM)
    rc, out, err = t.wait()
    assert rc == 128 + signal.SIGTERM == 143
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[-1] == f"stopped by SIGTERM; state saved to {rd / 'last.pt'} (resume with resume=auto)"
    stopped_at = max(t.steps())  # the step in progress when the signal came was finished, then saved
    ck = load_checkpoint(rd / "last.pt")
    assert ck["step"] == stopped_at
    assert ck["loader"]["position"] == stopped_at % STEPS_PER_EPOCH > 0  # mid-epoch
    assert ck["epoch_stats"][2] == 10 * (stopped_at % STEPS_PER_EPOCH)  # images seen this epoch
    assert not (rd / "metrics.jsonl").exists()  # no epoch finished, no row

    summary = run(load_config(SMOKE, [f"run_dir={rd}", *SIGNAL_RUN, "resume=auto"]), log=lambda *a, **k: None)
    assert [r["epoch"] for r in metrics_rows(rd)] == [1, 2] and summary["final"]["step"] == EPOCHS * STEPS_PER_EPOCH
    assert load_checkpoint(rd / "last.pt")["step"] == EPOCHS * STEPS_PER_EPOCH


# ------------------------------------------------------------------------------------ unsafe checkpoint


class _Payload:
    """Unpickling this calls exec, which creates a marker file: what a hostile checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def test_unsafe_checkpoint_is_refused_everywhere(tmp_path, finished_run):
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.pt"
    state = load_checkpoint(finished_run / "last.pt")
    state["model"] = {"w": _Payload(marker)}
    torch.save(state, evil)
    # the file really is hostile: an unrestricted load runs the payload
    probe_marker = tmp_path / "probe_marker"
    torch.save({"x": _Payload(probe_marker)}, tmp_path / "check.pt")
    torch.load(tmp_path / "check.pt", weights_only=False)
    assert probe_marker.exists()

    with pytest.raises(CheckpointError, match="refused") as e:
        load_checkpoint(evil)
    assert "evil.pt" in str(e.value) and "\n" not in str(e.value)

    before = _snapshot(finished_run)
    rc, err = _cli(["--config", str(SMOKE), f"run_dir={finished_run}", *FINISHED, "train.epochs=2",
                    f"resume={evil}"])
    assert rc == 2 and "refused" in err and "evil.pt" in err
    assert _snapshot(finished_run) == before

    r = subprocess.run([sys.executable, "-m", "visattn.evaluate", "--checkpoint", str(evil)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=WAIT)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "refused" in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists()


# ----------------------------------------------------------------------------------------- bad inputs


def _cli(argv: List[str], tool: Callable[[List[str]], int] = main) -> tuple[int, str]:
    """Run a command-line entry point in-process (conftest's run_cli); (exit status, stderr)."""
    done = run_cli(argv, tool)
    return done.returncode, done.stderr


def _write_images(folder: Path, classes=("ant", "bee", "cow"), per_class=4, splits=("train",)) -> Path:
    rng = np.random.default_rng(0)
    for split in splits:
        for c in classes:
            (folder / split / c).mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(folder / split / c / f"{i}.png")
    return folder


@pytest.fixture(scope="module")
def bad(tmp_path_factory, finished_run) -> Dict[str, Path]:
    """Bad files and folders, each made from a good one."""
    d = tmp_path_factory.mktemp("bad")
    out: Dict[str, Path] = {"dir": d}
    ck = (finished_run / "last.pt").read_bytes()
    (d / "truncated.pt").write_bytes(ck[: len(ck) // 2])
    (d / "notes.pt").write_text("these are my notes, not a checkpoint\n")
    torch.save({"weights": torch.zeros(3)}, d / "foreign.pt")
    other = load_checkpoint(finished_run / "last.pt")  # a checkpoint of another model (wider last stage)
    other["config"]["model"]["widths"] = [8, 16, 32]
    other["model"] = create_model("resnet_fast", num_classes=10, widths=[8, 16, 32], stem_width=8).state_dict()
    save_checkpoint(other, d / "other_model.pt")
    torn_run = d / "torn_run"  # a run folder whose last.pt was cut short
    torn_run.mkdir()
    (torn_run / "last.pt").write_bytes(ck[: len(ck) // 3])

    bad_image = _write_images(d / "bad_image")
    (bad_image / "train" / "bee" / "9.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    layout = _write_images(d / "layout")
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(layout / "train" / "loose.png")
    empty = _write_images(d / "empty_class")
    (empty / "train" / "yak").mkdir()
    good = _write_images(d / "good", splits=("train", "test"))
    with tarfile.open(d / "good.tar.gz", "w:gz") as tf:
        for p in sorted(good.rglob("*")):
            tf.add(p, arcname=str(p.relative_to(good)), recursive=False)
    blob = (d / "good.tar.gz").read_bytes()
    (d / "cut.tar.gz").write_bytes(blob[: len(blob) // 2])
    (d / "plain.txt").write_text("not data")
    (d / "a_file").write_text("a file where a folder should be")
    return out


def _resume(finished: Path, *extra: str) -> List[str]:
    return ["--config", str(SMOKE), f"run_dir={finished}", *FINISHED, "train.epochs=2", *extra]


def _data(d: Path, name: str) -> List[str]:
    return ["resume=auto", "data.source=auto", f"data.root={d / name}", f"data.cache_dir={d / 'cache'}",
            "data.val_size=3"]


# (id, argv builder (finished run, bad dir) -> argv, fragment of the one-line error, exit status)
BAD = [
    ("resume-model-changed", lambda f, d: _resume(f, "resume=auto", "model.widths=[8,16,32]"),
     "different settings for model.widths", 2),
    ("resume-data-changed", lambda f, d: _resume(f, "resume=auto", "data.augment.hflip=false"),
     "different settings for data.augment.hflip", 2),
    ("resume-other-model", lambda f, d: _resume(f, f"resume={d / 'other_model.pt'}"),
     "different settings for model.widths", 2),
    ("resume-other-model-allowed", lambda f, d: _resume(f, f"resume={d / 'other_model.pt'}", "resume_allow_changes=true"),
     "does not fit model 'resnet_fast' (size mismatch for ", 2),
    ("resume-other-run-into-used-folder", lambda f, d: _resume(d / "torn_run", f"resume={f / 'last.pt'}"),
     "belongs to another run folder, and run_dir", 2),
    ("resume-optimizer-changed", lambda f, d: _resume(f, "resume=auto", "optim.name=adamw", "resume_allow_changes=true"),
     "optim.name, which cannot change on resume", 2),
    ("resume-param-groups-changed", lambda f, d: _resume(f, "resume=auto", "optim.no_decay_norm_bias=false"),
     "optim.no_decay_norm_bias", 2),
    ("resume-path-missing", lambda f, d: _resume(f, f"resume={d / 'nope.pt'}"), "nope.pt' not found", 2),
    ("resume-path-is-folder", lambda f, d: _resume(f, f"resume={d}"), "is a folder; give a checkpoint file", 2),
    ("resume-truncated", lambda f, d: _resume(f, f"resume={d / 'truncated.pt'}"), "is corrupt or truncated", 2),
    ("resume-not-a-checkpoint", lambda f, d: _resume(f, f"resume={d / 'notes.pt'}"), "notes.pt' is corrupt", 2),
    ("resume-foreign-torch-file", lambda f, d: _resume(f, f"resume={d / 'foreign.pt'}"),
     "is not a visattn checkpoint (missing model, config, epoch, step)", 2),
    ("resume-auto-torn-last", lambda f, d: _resume(d / "torn_run", "resume=auto"), "is corrupt or truncated", 2),
    ("new-run-in-used-folder", lambda f, d: _resume(f), "already holds last.pt", 2),
    ("run-dir-is-a-file", lambda f, d: _resume(d / "a_file"), "is a file, not a folder", 2),
    ("run-dir-under-a-file", lambda f, d: _resume(d / "a_file" / "run"), "is a file, not a folder", 2),
    ("batch-larger-than-data", lambda f, d: _resume(f, "resume=auto", "train.batch_size=1000"),
     "exceeds the 300 training images", 2),
    ("data-corrupt-image", lambda f, d: _resume(f, *_data(d, "bad_image")), "corrupt or unreadable image", 2),
    ("data-wrong-layout", lambda f, d: _resume(f, *_data(d, "layout")), "is not in the layout train/<class>/<image>", 2),
    ("data-empty-class", lambda f, d: _resume(f, *_data(d, "empty_class")), "yak holds no images", 2),
    ("data-truncated-archive", lambda f, d: _resume(f, *_data(d, "cut.tar.gz")), "truncated or corrupt", 2),
    ("data-missing-root", lambda f, d: _resume(f, *_data(d, "nowhere")), "does not exist", 2),
    ("data-root-plain-file", lambda f, d: _resume(f, *_data(d, "plain.txt")), "is a file but not a .tar.gz", 2),
    ("unknown-flag", lambda f, d: _resume(f, "--frobnicate"), "unrecognized arguments: --frobnicate", 2),
]


@pytest.mark.parametrize("argv,fragment,status", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_and_harms_nothing(argv, fragment, status, finished_run, bad):
    before = _snapshot(finished_run)
    rc, err = _cli(argv(finished_run, bad["dir"]))
    assert rc == status, err
    assert fragment in err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    if argv(finished_run, bad["dir"])[-1] == "--frobnicate":  # argparse: a usage line, then its error line
        assert lines[-1].startswith("train.py: error: ")
    else:
        assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert _snapshot(finished_run) == before
    assert not (bad["dir"] / "a_file" / "run").exists() and (bad["dir"] / "a_file").is_file()


EVAL_BAD = [
    ("eval-truncated", lambda f, d: ["--checkpoint", str(d / "truncated.pt")], "is corrupt or truncated"),
    ("eval-not-a-checkpoint", lambda f, d: ["--checkpoint", str(d / "notes.pt")], "is corrupt"),
    ("eval-missing", lambda f, d: ["--checkpoint", str(d / "nope.pt")], "not found"),
    ("eval-other-classes", lambda f, d: ["--checkpoint", str(f / "last.pt"), "--data", str(d / "good")],
     "differ from the checkpoint's"),
    ("eval-missing-data", lambda f, d: ["--checkpoint", str(f / "last.pt"), "--data", str(d / "nowhere")],
     "does not exist"),
]


@pytest.mark.parametrize("argv,fragment", [b[1:] for b in EVAL_BAD], ids=[b[0] for b in EVAL_BAD])
def test_evaluate_bad_input_is_one_line(argv, fragment, finished_run, bad):
    before = _snapshot(finished_run)
    rc, err = _cli(argv(finished_run, bad["dir"]) + ["--device", "cpu"], tool=evaluate_cli.main)
    assert rc == 2 and fragment in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err
    assert _snapshot(finished_run) == before


def test_allowed_changes_resume(tmp_path, finished_run):
    """The data change refused above goes through with resume_allow_changes=true, and the run continues."""
    rd = tmp_path / "run"
    rd.mkdir()
    for name in ("last.pt", "best.pt", "metrics.jsonl"):
        (rd / name).write_bytes((finished_run / name).read_bytes())
    rc, err = _cli(_resume(rd, "resume=auto", "data.augment.hflip=false", "resume_allow_changes=true"))
    assert rc == 0, err
    assert [r["epoch"] for r in metrics_rows(rd)] == [1, 2]
    assert load_checkpoint(rd / "last.pt")["config"]["data"]["augment"]["hflip"] is False


def test_disk_full_while_saving_keeps_the_old_checkpoint(tmp_path, finished_run, monkeypatch):
    """A write that fails (here: fsync says the disk is full) is one error line, exit 1; last.pt stays whole."""
    import errno

    rd = tmp_path / "run"
    rd.mkdir()
    for name in ("last.pt", "best.pt", "metrics.jsonl"):
        (rd / name).write_bytes((finished_run / name).read_bytes())
    kept = (rd / "last.pt").read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    rc, err = _cli(_resume(rd, "resume=auto", "train.ckpt_every_steps=2"))
    assert rc == 1 and err.strip() == "error: [Errno 28] No space left on device"
    assert (rd / "last.pt").read_bytes() == kept and _tmp_files(rd) == []
    monkeypatch.undo()
    assert load_checkpoint(rd / "last.pt")["step"] == 6


# ------------------------------------------------------------------------------------- non-finite loss


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, finished_run):
    rd = tmp_path / "run"
    rd.mkdir()
    for name in ("last.pt", "best.pt", "metrics.jsonl"):
        (rd / name).write_bytes((finished_run / name).read_bytes())
    kept = {k: v for k, v in _snapshot(rd).items() if k in ("last.pt", "best.pt", "metrics.jsonl")}
    # logits scaled to ~1e38 overflow: every loss is inf/NaN from the first step on
    rc, err = _cli(_resume(rd, "resume=auto", "model.head_scale=1.0e+38", "resume_allow_changes=true",
                           "train.max_nonfinite_steps=4", "train.ckpt_every_steps=1"))
    assert rc == 3, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: 4 consecutive non-finite losses at step 10")
    assert "last good checkpoint kept" in err
    # every step of the epoch so far was non-finite: no periodic checkpoint replaced the finished epoch's last.pt
    assert {k: v for k, v in _snapshot(rd).items() if k in kept} == kept
    assert load_checkpoint(rd / "last.pt")["step"] == 6


def _poison_weights_at_step(monkeypatch, at: int, then: Callable[[], None] = lambda: None) -> None:
    """After training step ``at`` fill a weight with NaN (as bad steps reach the weights on a GPU, where the loss
    is checked only every ``check_every`` steps), then call ``then``."""

    def poisoning(run, step: int) -> None:
        if step == at:
            with torch.no_grad():
                next(run.model.parameters()).fill_(float("nan"))
            then()

    monkeypatch.setitem(HOOKS, "step_end", [poisoning])  # a step_end hook of every run built in the test


def test_periodic_checkpoint_never_saves_nonfinite_weights(tmp_path, monkeypatch):
    """On a GPU the loss is checked every ``check_every`` steps, after bad steps reached the weights; simulate that
    on the CPU by poisoning the weights after step 4 and check no later periodic save replaces step 3's."""

    _poison_weights_at_step(monkeypatch, 4)
    rd = tmp_path / "run"
    cfg = load_config(SMOKE, [f"run_dir={rd}", *TINY, "train.batch_size=50", "train.epochs=1",
                              "train.ckpt_every_steps=1", "train.max_nonfinite_steps=2", "log.tensorboard=false"])
    from visattn.errors import TrainingError

    with pytest.raises(TrainingError, match="consecutive non-finite"):
        run(cfg, log=lambda *a, **k: None)
    ck = load_checkpoint(rd / "last.pt")
    assert ck["step"] == 3
    assert all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())


def test_a_signal_with_nonfinite_weights_saves_nothing_and_says_so(tmp_path, monkeypatch):
    """A SIGTERM that comes while the weights are not finite keeps the last good checkpoint and says that
    nothing was saved (not "state saved to last.pt")."""
    from visattn.signals import Interrupted

    # the trainer's handler sets its stop flag
    _poison_weights_at_step(monkeypatch, 4, then=lambda: os.kill(os.getpid(), signal.SIGTERM))
    rd = tmp_path / "run"
    cfg = load_config(SMOKE, [f"run_dir={rd}", *TINY, "train.batch_size=50", "train.epochs=1",
                              "train.ckpt_every_steps=1", "log.tensorboard=false"])
    with pytest.raises(Interrupted) as stop:
        run(cfg, log=lambda *a, **k: None)
    assert str(stop.value) == ("stopped by SIGTERM; the weights were not finite, so nothing was saved (last good "
                               "checkpoint kept) (resume with resume=auto)")
    assert load_checkpoint(rd / "last.pt")["step"] == 3


def test_nonfinite_state_at_an_epoch_end_is_never_committed(tmp_path, monkeypatch):
    """NaN normalisation statistics after the epoch's last step (no step left to see a NaN loss; on a GPU, steps
    between two loss checks): the epoch is neither evaluated into a row nor saved; one error line, exit 3, and
    last.pt stays the last finite one (step 5)."""

    def poisoning(run, step: int) -> None:
        if step == 6:
            bn = next(m for m in run.model.modules() if isinstance(m, torch.nn.BatchNorm2d))
            bn.running_mean.fill_(float("nan"))

    monkeypatch.setitem(HOOKS, "step_end", [poisoning])
    rd = tmp_path / "run"
    rc, err = _cli(["--config", str(SMOKE), f"run_dir={rd}", *TINY, "train.batch_size=50", "train.epochs=1",
                    "train.ckpt_every_steps=1", "log.tensorboard=false"])
    assert rc == 3 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("error: the weights or normalisation statistics are not finite after epoch 1")
    assert err.strip().endswith("; last good checkpoint kept")
    assert not (rd / "metrics.jsonl").exists() and not (rd / "best.pt").exists()
    ck = load_checkpoint(rd / "last.pt")
    assert ck["step"] == 5 and all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())

"""Data-parallel training under torchrun: two CPU ranks over gloo.

Each rank runs ``train.py``'s own ``main`` inside a small probe (written to the test's temporary folder) that,
through the loop's hooks (``visattn.hooks.register_hook``), records what the rank did: its final weights and EMA
weights, the image counts the engine reported (already reduced over ranks), and every file-system write it
made under the run folder (through a Python audit hook), so the test can check that ranks agree, metrics count all ranks' images, and
only rank 0 writes run files. Resume is checked to be exact under torchrun too.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch
from conftest import ROOT, SMOKE, metrics_rows

from visattn.evaluate import evaluate_checkpoint
from visattn.rundir import load_checkpoint

TRAIN_IMAGES, VAL_IMAGES, BATCH = 300, 100, 50  # global batch 50 = 25 per rank; 6 steps per epoch
OVERRIDES = [f"data.synthetic_size={TRAIN_IMAGES + VAL_IMAGES}", f"data.val_size={VAL_IMAGES}",
             f"train.batch_size={BATCH}", "train.epochs=2", "model.widths=[8,16,16]", "model.stem_width=8",
             "model.attention=se", "train.ema_decay=0.9", "log.progress=false", "log.maps_every=0",
             "device=cpu", "deterministic=true", "eval.tta=none", "precision=fp32"]

PROBE = r'''
import json, os, sys
from pathlib import Path

import torch

from visattn.hooks import register_hook
from visattn.cli import main

rank = int(os.environ.get("RANK", "0"))
out = Path(os.environ["PROBE_OUT"])
run_dir = os.path.realpath(os.environ["PROBE_RUN_DIR"])
seen = {"train_images": [], "eval_images": [], "writes": []}

def inside(path):
    try:
        return os.path.realpath(os.fsdecode(path)).startswith(run_dir)
    except (TypeError, ValueError):
        return False

def audit(event, args):
    # any write, create, rename or removal under the run folder
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)) and inside(args[0]):
        mode, flags = args[1], args[2]
        writing = (mode is not None and any(c in mode for c in "wax+")) or \
                  (mode is None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if writing:
            seen["writes"].append([event, os.fsdecode(args[0])])
    elif event in ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.truncate", "shutil.rmtree") and args \
            and isinstance(args[0], (str, bytes, os.PathLike)) and inside(args[0]):
        seen["writes"].append([event, os.fsdecode(args[0])])

sys.addaudithook(audit)

step_log = os.environ.get("PROBE_STEP_LOG") if rank == 0 else None

def started(run):  # the loop's hooks, every rank's: the run itself, each step, each epoch's reduced counts
    seen["run"] = run

def stepped(run, step):
    if step_log:
        with open(step_log, "a") as f:
            f.write(f"{step}\n")

def epoch_done(run, epoch, row):
    seen["train_images"].append(round(row["images_per_s"] * row["epoch_seconds"]))
    if "val_acc" in row:
        seen["eval_images"].append(run.last_eval["images"])

for event, hook in (("fit_start", started), ("step_end", stepped), ("epoch_end", epoch_done)):
    register_hook(event, hook)

rc = main(sys.argv[1:])
ema = seen["run"].opt.ema
torch.save({"model": seen["run"].model.state_dict(), "ema": ema.state_dict() if ema is not None else None},
           out / f"rank{rank}.pt")
(out / f"rank{rank}.json").write_text(json.dumps({k: seen[k] for k in ("train_images", "eval_images", "writes")}))
sys.exit(rc)
'''


def _torchrun(tmp_path: Path, run_dir: Path, tag: str, *extra: str, sigterm_at_step: Optional[int] = None,
              timeout: float = 240) -> Dict:
    """torchrun with 2 CPU ranks through the probe; with ``sigterm_at_step``, SIGTERM torchrun once rank 0's step
    log reaches that step (torchrun passes the signal on to its workers)."""
    probe = tmp_path / "probe.py"
    if not probe.exists():
        probe.write_text(PROBE)
    out = tmp_path / f"out-{tag}"
    out.mkdir()
    step_log = out / "steps.log"
    step_log.touch()
    env = dict(os.environ, OMP_NUM_THREADS="1", PROBE_OUT=str(out), PROBE_RUN_DIR=str(run_dir),
               PROBE_STEP_LOG=str(step_log), PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", str(probe),
           "--config", str(SMOKE), f"run_dir={run_dir}", *OVERRIDES, *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if sigterm_at_step is not None:
            deadline = time.monotonic() + timeout
            while not any(int(s) >= sigterm_at_step for s in step_log.read_text().split()):
                assert proc.poll() is None, "the run ended before the step to interrupt it at"
                assert time.monotonic() < deadline, "timed out waiting for the step to interrupt the run at"
                time.sleep(0.002)
            proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if sigterm_at_step is None:
        assert proc.returncode == 0, stderr[-3000:]
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]
    weights = [torch.load(out / f"rank{i}.pt", weights_only=True) for i in range(2)]
    steps = [int(s) for s in step_log.read_text().split()]
    return {"rc": proc.returncode, "stdout": stdout, "stderr": stderr, "ranks": ranks, "weights": weights,
            "steps": steps}


def _differing(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> List[str]:
    """Keys whose tensors differ (empty when the two state dicts are identical)."""
    assert set(a) == set(b)
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
def test_torchrun_two_ranks_agree_count_all_images_and_resume_exactly(tmp_path):
    # ---- an uninterrupted run of 2 epochs
    full = tmp_path / "full"
    res = _torchrun(tmp_path, full, "full")
    w0, w1 = res["weights"]
    # DDP keeps the parameters in step (BN running statistics differ: each rank updates them from its own batch).
    # The EMA copy, which is what gets evaluated, agrees in full: the trainer gives every rank rank 0's BN
    # statistics before evaluating, so the reported figures are those of the weights rank 0 saves.
    params = [k for k in w0["model"] if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert len(params) > 10 and _differing({k: w0["model"][k] for k in params}, {k: w1["model"][k] for k in params}) == []
    assert _differing(w0["ema"], w1["ema"]) == []
    # the weights rank 0 saved are the weights it ended with, and they score what the metrics say
    assert _differing(load_checkpoint(full / "last.pt")["model"], w0["model"]) == []
    best = max(metrics_rows(full), key=lambda row: row["val_acc"])
    assert evaluate_checkpoint(str(full / "best.pt"), device="cpu")["acc"] == pytest.approx(best["val_acc"], abs=1e-9)

    # metrics are reduced over the ranks: each rank trained on half, each reports all images
    for r in res["ranks"]:
        assert r["train_images"] == [TRAIN_IMAGES, TRAIN_IMAGES]
        assert r["eval_images"] == [VAL_IMAGES, VAL_IMAGES]
    rows = metrics_rows(full)
    assert [row["epoch"] for row in rows] == [1, 2] and rows[-1]["step"] == 2 * TRAIN_IMAGES // BATCH
    # throughput counts every rank's images once: images_per_s is the all-rank count over the epoch's time
    raw = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert all(row["images_per_s"] * row["epoch_seconds"] == pytest.approx(TRAIN_IMAGES, rel=1e-9) for row in raw)

    # only rank 0 wrote run files; rank 0 did write them
    assert res["ranks"][1]["writes"] == []
    written = {Path(p).name for _, p in res["ranks"][0]["writes"]}
    assert {"config.yaml", "run_info.json", "metrics.jsonl"} <= written
    assert sorted(p.name for p in full.iterdir()) == ["best.pt", "config.yaml", "last.pt", "metrics.jsonl",
                                                     "run_info.json", "tb"]
    # one summary line, from rank 0
    assert res["stdout"].count('"best_val_acc"') == 1

    # ---- the same run stopped by train.max_steps=4 (mid-epoch 1), resumed and stopped by SIGTERM to torchrun
    # (mid-epoch 2), then resumed to the end under torchrun: it must end where the uninterrupted run did
    part = tmp_path / "part"
    _torchrun(tmp_path, part, "stop", "train.max_steps=4")
    ck = load_checkpoint(part / "last.pt")
    assert ck["step"] == 4 and ck["loader"]["position"] == 4
    term = _torchrun(tmp_path, part, "sigterm", "resume=auto", "train.max_steps=null", sigterm_at_step=8)
    assert term["rc"] != 0  # torchrun reports its workers' exit 143 as a failure
    # both ranks stopped at the same step and said so; rank 0 saved that step
    assert term["stderr"].count(f"stopped by SIGTERM; state saved to {part / 'last.pt'}") == 2
    ck = load_checkpoint(part / "last.pt")
    assert ck["step"] == max(term["steps"]) and 8 <= ck["step"] < 12
    assert ck["loader"]["position"] == ck["step"] % 6
    t0, t1 = (w["model"] for w in term["weights"])
    assert _differing({k: t0[k] for k in params}, {k: t1[k] for k in params}) == []  # stopped at the same step
    assert _differing({k: ck["model"][k] for k in params}, {k: t0[k] for k in params}) == []
    res2 = _torchrun(tmp_path, part, "resume", "resume=auto", "train.max_steps=null")
    assert "resumed from" in res2["stdout"]
    got, want = load_checkpoint(part / "last.pt"), load_checkpoint(full / "last.pt")
    assert got["step"] == want["step"]
    assert _differing(got["model"], want["model"]) == []
    assert _differing(got["ema"], want["ema"]) == []
    assert metrics_rows(part) == rows
    assert _differing(res2["weights"][1]["ema"], w1["ema"]) == []



@pytest.mark.parametrize("env, data_parallel", [
    ({}, False),
    ({"WORLD_SIZE": "1"}, False),  # torchrun with one rank trains as one process ...
    ({"WORLD_SIZE": "1", "VISATTN_DATA_PARALLEL": "1"}, True),  # ... unless asked to take the data-parallel path
    ({"WORLD_SIZE": "2"}, True),
    ({"WORLD_SIZE": "2", "VISATTN_DATA_PARALLEL": "0"}, True),
])
def test_the_data_parallel_path_is_taken_from_two_ranks_or_when_asked(monkeypatch, env, data_parallel):
    from visattn.trainer import DistInfo

    for name in ("WORLD_SIZE", "VISATTN_DATA_PARALLEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert DistInfo().enabled is data_parallel


@pytest.mark.parametrize("env, says", [
    ({"VISATTN_DATA_PARALLEL": "1"}, "not started by torchrun"),  # nothing to be parallel with
    ({"WORLD_SIZE": "1", "VISATTN_DATA_PARALLEL": "yes"}, "must be 0 or 1, got 'yes'"),
    ({"WORLD_SIZE": "1", "VISATTN_DATA_PARALLEL": ""}, "must be 0 or 1, got ''"),
])
def test_a_bad_data_parallel_switch_is_one_line_before_anything_is_written(monkeypatch, tmp_path, env, says):
    from conftest import run_cli

    for name in ("WORLD_SIZE", "VISATTN_DATA_PARALLEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    done = run_cli(["--config", str(SMOKE), f"run_dir={tmp_path / 'run'}", *OVERRIDES])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and says in done.stderr
    assert not (tmp_path / "run").exists()

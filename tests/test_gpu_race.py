"""``bench/gpu_race.py`` end to end on the CPU at a tiny size, its compile warm-up, and the GPU recipe's host
synchronisations: its training steps read nothing back from the device between ``train.check_every`` checks."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from test_bench import _load, _script_main
from torch.utils._python_dispatch import TorchDispatchMode

from visattn import trainer
from visattn.config import load_config
from visattn.hooks import FunctionHook

race = _load("gpu_race")
GPU = ROOT / "configs" / "cifar10_gpu.yaml"
# synthetic images (the real ones are not needed to run the race's machinery): 1,300 = 1,100 train + 200 validation
SYNTHETIC = ["data.source=synthetic", "data.synthetic_size=1300", "data.val_size=200"]


def _race(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``python -m bench.gpu_race ARGS`` from another folder (the repository on PYTHONPATH): it needs no cwd."""
    return subprocess.run([sys.executable, "-m", "bench.gpu_race", *args], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)


def test_the_race_runs_end_to_end_on_the_cpu_and_writes_its_json(tmp_path):
    out = tmp_path / "race.json"
    done = _race(tmp_path, "--runs", "1", "--subset", "128", "--batch-size", "64", "--epochs", "1",
                 "--airbench-epochs", "1", "--device", "cpu", "--out", str(out),
                 "--set", *SYNTHETIC, "compile=false", "model.widths=[16,32,32]")
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(out.read_text())
    assert {k for k in ("device", "torch", "date", "precision", "median_seconds_to_target",
                        "ratio_visattn_over_airbench94")} <= r.keys()
    assert r["torch"] == torch.__version__ and r["train_images"] == 128 and "200 images" in r["eval_split"]
    assert r["complete"] is True  # (rewritten after every run, false until the last)
    assert [x["recipe"] for x in r["runs"]] == ["airbench94", "visattn"]
    for x in r["runs"]:
        assert x["seed"] == 0 and 0 <= x["final_val_acc"] <= 1 and x["train_seconds"] > 0
        assert len(x["curve"]) == 1 and x["curve"][0][0] == 1  # every epoch evaluated
    assert "median time to 90%" in done.stdout and "visattn / airbench94" in done.stdout


def test_a_bad_config_override_ends_the_process_with_one_line_and_writes_nothing(tmp_path):
    done = _race(tmp_path, "--device", "cpu", "--out", str(tmp_path / "r.json"), "--set", "train.epochs=zero")
    assert done.returncode != 0 and "train.epochs" in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--runs", "0"], "--runs must be at least 1"),
    (["--target", "1.5"], "--target is an accuracy in (0, 1]"),
    (["--target", "nan"], "--target is an accuracy in (0, 1]"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--out", "no/such/folder/r.json"], "does not exist"),
    (["--subset", "0"], "--subset must be at least 10, got 0"),  # was read as "no subset": the whole training set
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--epochs", "nan"], "argument --epochs: invalid int value: 'nan'"),
    (["--airbench-epochs", "nan"], "--airbench-epochs must be a finite number above 0, got nan"),
    (["--airbench-epochs", "-1"], "--airbench-epochs must be a finite number above 0"),
])
def test_bad_arguments_are_one_line(tmp_path, monkeypatch, capsys, args, message):
    out = tmp_path / "r.json"
    out.write_text("{}\n")  # an earlier race's file is left as it was
    code, _, err = _script_main("gpu_race.py", monkeypatch, capsys, "--out", str(out), *args)
    assert code == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert out.read_text() == "{}\n"


def test_a_shorter_race_keeps_the_warmups_share_of_the_steps(monkeypatch):
    """--epochs 1 on the 11-epoch recipe (warmup 2.3 epochs, longer than the run, which the config refuses): the
    warmup is scaled with the run, 2.3 / 11 of it."""
    seen = []
    monkeypatch.setattr(race.ref, "load_data", lambda over: (_ for _ in ()).throw(RuntimeError("stop")))
    real = load_config

    def spy(path, over=()):
        seen.append(list(over))
        return real(path, over)

    import visattn.config
    monkeypatch.setattr(visattn.config, "load_config", spy)
    args = race.argparse.Namespace(device="cpu", precision="fp32", set=[], subset=None, data_root=None, epochs=1,
                                   batch_size=None)
    with pytest.raises(RuntimeError, match="stop"):
        race.race(args)
    ours = next(over for over in seen if "train.epochs=1" in over)
    assert "sched.warmup_epochs=0.2091" in ours


def _eager_compile(monkeypatch):
    """torch.compile with dynamo's graphs run eagerly: the guards and recompiles are real, no Inductor build."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))


TINY_RECIPE = [*SYNTHETIC[:1], "data.synthetic_size=120", "data.val_size=40", "train.batch_size=40", "train.epochs=4",
               "eval.batch_size=40", "model.widths=[8,16,16]", "device=cpu", "precision=fp32", "compile=true"]


def test_the_warm_up_compiles_every_training_graph_before_the_clock(tmp_path, monkeypatch):
    """Both graphs (the whitening bias trainable in epochs 1-3, frozen in epoch 4) are compiled by the warm-up, so
    training compiles nothing; without the warm-up the same run compiles them in its timed epochs."""
    _eager_compile(monkeypatch)
    r = race.visattn_run(0, TINY_RECIPE, tmp_path, 0.9)
    assert r["graphs_compiled_in_training"] == 0 and r["compile_seconds"] > 0 and len(r["curve"]) == 4
    monkeypatch.setattr(race, "warm_compile", lambda run: 0.0)
    cold = race.visattn_run(0, TINY_RECIPE, tmp_path, 0.9)
    assert cold["graphs_compiled_in_training"] >= 2


def test_the_warm_up_leaves_the_weights_as_they_were(tmp_path, monkeypatch):
    _eager_compile(monkeypatch)
    cfg = load_config(GPU, [*TINY_RECIPE, f"run_dir={tmp_path / 'r'}", "log.progress=false"])
    run = trainer.build(cfg, log=lambda *a, **k: None)
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    race.warm_compile(run)
    after = run.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BN running statistics included
    assert all(p.grad is None for p in run.model.parameters())


class _HostReads(TorchDispatchMode):
    """Counts the operations that make the host wait for a device: reading a scalar (``item``, ``bool``, ``int``,
    ``float``) and those whose output size depends on the data (``nonzero``, masked selection)."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.SYNCING:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_gpu_recipes_steps_read_the_host_only_at_the_checks(tmp_path, monkeypatch):
    """The GPU path of the loop (``visattn.step.host_check_every`` as on a GPU), with the GPU recipe's loader, optimizer,
    schedule and lookahead: between two checks a step makes no host read at all (loader included), and a check
    step makes one (the run of non-finite losses); the loader draws its augmentation on its own device."""
    check = 4
    cfg = load_config(GPU, [*TINY_RECIPE, "train.epochs=1", "sched.warmup_epochs=0.23", "data.synthetic_size=440",
                            "train.batch_size=16", f"train.check_every={check}", "compile=false",
                            f"run_dir={tmp_path / 'r'}"])  # (a warmup within the one epoch, as a run needs)
    run = trainer.build(cfg, log=lambda *a, **k: None)
    assert run.train_loader.gen.device == run.device and run.opt.lookahead is not None
    run.policy.host_every = check  # the host reads as on a GPU: every check_every steps
    listed = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t, _real=torch.Tensor.tolist: listed.append(1) or _real(t))
    reads, marks = _HostReads(), []

    def after_step(run, step: int) -> None:
        marks.append((reads.count, len(listed)))

    run.hooks.append(FunctionHook("step_end", after_step))
    with reads:
        trainer.train_one_epoch(run.model, run.train_loader, run.opt, run.policy, run=run)
    per_step = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(marks[1:], marks)]  # steps 2.. (step 1 sets up the epoch)
    assert len(per_step) == 400 // 16 - 1
    for step, (scalars, lists) in enumerate(per_step, start=2):
        assert lists == 0, f"step {step} listed a tensor"
        assert scalars == (1 if step % check == 0 else 0), f"step {step}: {scalars} host reads"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_synchronising_cuda_call_between_checks(tmp_path, monkeypatch):
    """On a GPU: steps 2-8 of the recipe (checks every 1,000 steps) under CUDA's sync guard, which raises on any
    synchronising call (a host read, a copy from pageable memory)."""
    cfg = load_config(GPU, [*SYNTHETIC, "data.synthetic_size=2200", "train.batch_size=128", "train.epochs=1",
                            "sched.warmup_epochs=0.23", "train.check_every=1000", "compile=false", "device=cuda",
                            f"run_dir={tmp_path / 'r'}"])
    cfg.train.max_steps = 8
    run = trainer.build(cfg, log=lambda *a, **k: None)

    def after_step(run, step: int) -> None:  # before the step's own checks (step 8: the stop, and its save)
        torch.cuda.set_sync_debug_mode("error" if step < 8 else 0)

    run.hooks.append(FunctionHook("step_end", after_step))
    try:
        trainer.train_one_epoch(run.model, run.train_loader, run.opt, run.policy, run=run)
    finally:
        torch.cuda.set_sync_debug_mode(0)

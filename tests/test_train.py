"""The training spine: precisions, a smoke run end to end, run files, evaluate, real data."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from visattn import evaluate, trainer
from visattn.config import load_config
from visattn.evaluate import evaluate_checkpoint
from visattn.models import create_model
from visattn.optim import Optimization, StepScheduler, build_optimizer, make_scaler
from visattn.rundir import load_checkpoint
from visattn.step import StepPolicy, host_check_every
from visattn.trainer import run

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_one_step_per_precision(precision, channels_last):
    torch.manual_seed(0)
    dev = torch.device("cpu")
    model = create_model("resnet_fast", num_classes=10, widths=[8, 16, 16], stem_width=8)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = build_optimizer(model, "sgd", 0.1, 5e-4)
    sched = StepScheduler(opt, "onecycle", 0.1, 10, 2)
    scaler = make_scaler(dev, precision)
    assert (scaler is not None) == (precision == "fp16")
    before = [p.detach().clone() for p in model.parameters()]
    # fp16 starts at a loss scale of 65536: its first steps may overflow and be skipped (counted), never applied
    stats, step, raw = trainer.train_one_epoch(model, [(x, y)] * 20, Optimization(opt, sched, scaler),
                                              StepPolicy(dev, precision))
    assert step == 20 and stats.nonfinite_steps == 0
    assert stats.skipped_steps < 20 and (precision == "fp16" or stats.skipped_steps == 0)
    assert torch.isfinite(torch.tensor(stats.loss)) and stats.loss > 0
    changed = sum(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert changed >= len(before) // 2
    if precision == "fp16":
        assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() > 0


def test_autocast_dtype_is_used_on_cpu():
    model = torch.nn.Linear(4, 4)
    with evaluate.autocast(torch.device("cpu"), "bf16"):
        assert model(torch.randn(2, 4)).dtype == torch.bfloat16
    with evaluate.autocast(torch.device("cpu"), "fp16"):
        assert model(torch.randn(2, 4)).dtype == torch.float16


def test_nonfinite_steps_are_skipped_then_stop():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    opt = build_optimizer(model, "sgd", 0.1, 0.0)
    sched = StepScheduler(opt, "constant", 0.1, 10, 0)
    x = torch.randn(4, 3, 2, 2)
    y = torch.tensor([0, 1, 2, 0])
    w0 = model[1].weight.detach().clone()
    bad = [(x * float("nan"), y)] * 2
    policy = StepPolicy(torch.device("cpu"), "fp32", max_nonfinite_steps=5)
    stats, _, _ = trainer.train_one_epoch(model, bad, Optimization(opt, sched), policy)
    assert stats.nonfinite_steps == stats.steps == 2 and stats.nothing_learned
    assert math.isnan(stats.loss) and math.isnan(stats.acc)  # a mean over no finite step is not 0
    assert torch.equal(model[1].weight, w0)  # skipped: weights untouched
    from visattn.errors import TrainingError

    with pytest.raises(TrainingError, match="consecutive non-finite"):
        trainer.train_one_epoch(model, bad * 3, Optimization(opt, sched), policy)


def _smoke_cfg(tmp_path, *extra):
    return load_config(ROOT / "configs" / "smoke.yaml",
                       [f"run_dir={tmp_path / 'run'}", "log.progress=false", "model.attention=none", *extra])


def test_a_deterministic_run_leaves_the_callers_torch_settings_as_it_found_them(tmp_path, tiny_overrides):
    """``deterministic=true`` holds for the run only: a program that calls ``run`` keeps its own settings after it,
    on success and on a refusal alike."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    assert before[0] is False
    run(load_config(ROOT / "configs" / "smoke.yaml", [*tiny_overrides, "deterministic=true", "train.epochs=1",
                                                       "log.maps_every=0"]), log=lambda *a: None)
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark) == before
    with pytest.raises(ValueError):  # refused after the seeding: the model cannot take the images
        run(load_config(ROOT / "configs" / "smoke.yaml", [*tiny_overrides, "deterministic=true", "train.epochs=1",
                                                           "model.name=vit_tiny", "data.image_size=48",
                                                           f"run_dir={tmp_path / 'r2'}"]), log=lambda *a: None)
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark) == before


def test_smoke_run_writes_everything(tmp_path):
    cfg = _smoke_cfg(tmp_path, "train.epochs=3")
    summary = run(cfg, log=lambda *a: None)
    rd = tmp_path / "run"
    assert summary["best_val_acc"] > 0.5  # 10 classes: chance is 0.1
    for f in ("config.yaml", "run_info.json", "metrics.jsonl", "last.pt", "best.pt"):
        assert (rd / f).is_file(), f
    assert list((rd / "tb").glob("events.out.tfevents.*"))
    rows = [json.loads(l) for l in (rd / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert all(r["images_per_s"] > 0 for r in rows)
    info = json.loads((rd / "run_info.json").read_text())
    assert info["seed"] == 0 and info["versions"]["torch"] and info["git"]
    assert "held out from train" in info["eval_split"]
    ck = load_checkpoint(rd / "last.pt")
    assert ck["config"] == cfg.to_dict() and ck["seed"] == 0 and ck["epoch"] == 3
    assert ck["versions"]["visattn"] and "git" in ck
    # evaluate rebuilds the model from the stored config and reproduces the best validation accuracy
    best = max(r["val_acc"] for r in rows)
    res = evaluate_checkpoint(str(rd / "best.pt"))
    assert res["acc"] == pytest.approx(best, abs=1e-6)
    assert len(res["per_class_acc"]) == 10


def test_existing_run_is_not_overwritten(tmp_path):
    from visattn.errors import ConfigError

    cfg = _smoke_cfg(tmp_path, "train.epochs=1")
    run(cfg, log=lambda *a: None)
    stamp = (tmp_path / "run" / "last.pt").stat().st_mtime_ns
    with pytest.raises(ConfigError, match="already holds last.pt"):
        run(cfg, log=lambda *a: None)
    assert (tmp_path / "run" / "last.pt").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("extra", [["optim.name=adamw", "optim.lr=0.003", "sched.name=cosine"],
                                   ["train.ema_decay=0.9", "eval.tta=flip_translate"],
                                   ["data.loader=albumentations", "data.augment.cutout=8"],
                                   ["precision=fp32", "channels_last=false"]],
                         ids=["adamw-cosine", "ema-tta", "albumentations", "fp32"])
def test_training_variants_learn(tmp_path, extra):
    summary = run(_smoke_cfg(tmp_path, "train.epochs=2", *extra), log=lambda *a: None)
    assert summary["best_val_acc"] > 0.3


def test_fp16_run_with_scaler(tmp_path):
    """fp16 convolutions are slow on CPUs (no fp16 matrix units here), so this run is tiny."""
    cfg = _smoke_cfg(tmp_path, "precision=fp16", "train.epochs=1", "data.synthetic_size=300", "data.val_size=50",
                     "train.batch_size=25", "model.widths=[8,16,16]", "model.stem_width=8", "eval.tta=none")
    summary = run(cfg, log=lambda *a: None)
    row = summary["final"]
    assert row["nonfinite_steps"] == 0 and row["skipped_steps"] < 10
    assert torch.isfinite(torch.tensor(row["train_loss"])) and summary["best_val_acc"] > 0.1
    assert load_checkpoint(tmp_path / "run" / "last.pt")["scaler"]["scale"] > 0


def test_evaluate_cli(tmp_path, capsys):
    run(_smoke_cfg(tmp_path, "train.epochs=1"), log=lambda *a: None)
    r = subprocess.run([sys.executable, "-m", "visattn.evaluate", "--checkpoint", str(tmp_path / "run" / "best.pt"),
                        "--json"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert 0 <= out["acc"] <= 1 and len(out["per_class_acc"]) == 10
    from visattn.evaluate import main as evaluate_main  # the error path in this process: the same main()

    assert evaluate_main(["--checkpoint", str(tmp_path / "nope.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.pt" in err and "Traceback" not in err


@pytest.mark.slow
def test_compile_on_cpu(tmp_path):
    summary = run(_smoke_cfg(tmp_path, "train.epochs=1", "compile=true"), log=lambda *a: None)
    assert summary["best_val_acc"] > 0.2


@pytest.mark.slow
def test_real_cifar10_subset_learns(cifar10_path, tmp_path):
    """About a minute on 2 CPU cores: 10k real training images, 3 epochs, far above chance (10%)."""
    cfg = load_config(ROOT / "configs" / "smoke.yaml", [
        f"run_dir={tmp_path / 'run'}", "log.progress=false", "data.source=auto", f"data.root={cifar10_path}",
        "data.subset=10000", "data.val_size=1000", "model.widths=[32, 64, 128]", "model.stem_width=16",
        "model.attention=none", "train.epochs=3", "train.batch_size=200", "optim.lr=0.2", "train.label_smoothing=0.1",
    ])
    summary = run(cfg, log=lambda *a: None)
    assert "held out from train" in summary["eval_split"]
    assert summary["best_val_acc"] >= 0.40, summary


def test_ema_warms_up(tmp_path):
    """The GPU recipe's EMA (decay 0.999) over a short run: with timm's warmup the evaluated EMA starts as a copy
    of the weights and learns with them; without it, the EMA is still mostly the random initial weights."""
    base = ["train.epochs=2", "train.ema_decay=0.999", "eval.tta=none"]
    warm = run(_smoke_cfg(tmp_path / "warm", *base), log=lambda *a: None)
    cold = run(_smoke_cfg(tmp_path / "cold", *base, "train.ema_warmup=false"), log=lambda *a: None)
    assert warm["best_val_acc"] > 0.3
    assert cold["best_val_acc"] < warm["best_val_acc"] - 0.1


def test_ema_decay_follows_the_step_count():
    from timm.utils import ModelEmaV3

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ema = ModelEmaV3(model, decay=0.999, use_warmup=True)
    sgd = build_optimizer(model, "sgd", 0.5, 0.0)
    opt = Optimization(sgd, StepScheduler(sgd, "constant", 0.5, 10, 0), None, ema)
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))] * 3
    trainer.train_one_epoch(model, data[:1], opt, StepPolicy(torch.device("cpu"), "fp32"))
    assert torch.equal(ema.module.weight, model.weight)  # step 1: decay 0, a copy
    before = ema.module.weight.detach().clone()
    _, step, _ = trainer.train_one_epoch(model, data[1:2], opt, StepPolicy(torch.device("cpu"), "fp32"),
                                        global_step=1)
    d = ema.get_decay(2)
    assert step == 2 and 0 < d < 0.999
    assert torch.allclose(ema.module.weight, d * before + (1 - d) * model.weight, atol=1e-6)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "4"])
def test_a_step_policys_host_reads_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="host_every must be a positive int or None"):
        StepPolicy(torch.device("cpu"), host_every=bad)
    assert host_check_every(StepPolicy(torch.device("cpu"), host_every=3)) == 3
    assert host_check_every(StepPolicy(torch.device("cpu"))) == 1

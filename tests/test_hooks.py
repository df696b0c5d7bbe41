"""The loop's hooks (visattn.hooks) and its one step function (visattn.step.train_step).

A hook given to ``run(cfg, hooks=...)`` receives every epoch's metrics row after the epoch is committed; the
built-in hooks (EMA, checkpoints, TensorBoard) keep their order; bad hooks are one-line errors; fp16's skipped
step is found through the scaler's public ``get_scale()``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import SMOKE

from visattn.config import load_config
from visattn.hooks import CheckpointWriter, EmaUpdate, FunctionHook, ProgressBar, TensorBoardLog, check_hooks
from visattn.optim import Optimization, StepScheduler, build_optimizer, make_scaler
from visattn.rundir import load_checkpoint
from visattn.step import EpochMeter, StepPolicy, scaled_update, train_step
from visattn.trainer import build, run

TINY = ["data.synthetic_size=200", "data.val_size=50", "train.batch_size=50", "model.widths=[8,16,16]",
        "model.stem_width=8", "model.attention=none", "precision=fp32", "device=cpu", "log.progress=false",
        "log.maps_every=0", "eval.tta=none", "train.epochs=2"]


class Recorder:
    """A user's hook: every event it sees, and each epoch's row with what the run folder held at that moment."""

    def __init__(self) -> None:
        self.events, self.rows, self.saved_epoch = [], [], []

    def on_fit_start(self, run) -> None:
        self.events.append("fit_start")

    def on_step_end(self, run, step: int) -> None:
        self.events.append(f"step {step}")

    def on_epoch_end(self, run, epoch: int, row: dict) -> None:
        self.events.append(f"epoch {epoch}")
        self.rows.append(dict(row))
        self.saved_epoch.append(load_checkpoint(run.run_dir / "last.pt")["epoch"])  # committed before this hook

    def on_fit_end(self, run) -> None:
        self.events.append("fit_end")


def test_a_user_hook_receives_every_epochs_metrics(tmp_path: Path) -> None:
    rec = Recorder()
    rd = tmp_path / "run"
    out = run(load_config(SMOKE, [f"run_dir={rd}", *TINY, "train.ema_decay=0.9"]), log=lambda *a, **k: None,
              hooks=[rec])
    written = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rec.rows] == [1, 2] and rec.rows == written
    assert rec.saved_epoch == [1, 2]  # the epoch's checkpoint is written before the user's hook sees its row
    assert rec.events[0] == "fit_start" and rec.events[-1] == "fit_end"
    assert rec.events[1:4] == ["step 1", "step 2", "step 3"] and rec.events[4] == "epoch 1"  # 150 images / 50
    assert out["best_val_acc"] == max(r["val_acc"] for r in written)


def test_a_runs_hooks_are_its_own_then_the_callers_then_the_registered(tmp_path: Path) -> None:
    mine = FunctionHook("epoch_end", lambda run, epoch, row: None)
    r = build(load_config(SMOKE, [f"run_dir={tmp_path / 'r'}", *TINY, "train.ema_decay=0.9"]), log=lambda *a, **k: None,
              hooks=[mine])
    kinds = [type(h) for h in r.hooks]
    assert kinds[:4] == [ProgressBar, EmaUpdate, CheckpointWriter, TensorBoardLog] and r.hooks[4] is mine
    assert r.saver is r.hooks[2] and r.hooks[1].ema is r.opt.ema


@pytest.mark.parametrize("bad, what", [(object(), "has none of the methods"), ("on_epoch_end", "must be a list")])
def test_bad_hooks_are_one_line(bad, what) -> None:
    with pytest.raises(ValueError, match=what):
        check_hooks(bad if isinstance(bad, str) else [bad])
    with pytest.raises(ValueError, match="unknown hook event 'epoch'"):
        FunctionHook("epoch", print)


def _linear_step(precision: str):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    sgd = build_optimizer(model, "sgd", 0.1, 0.0)
    opt = Optimization(sgd, StepScheduler(sgd, "constant", 0.1, 10, 0), make_scaler(torch.device("cpu"), precision))
    return model, opt


def test_an_fp16_step_whose_gradients_overflow_is_skipped_and_counted() -> None:
    """The scaler's step with inf gradients leaves the weights, backs the scale off; scaled_update says so through
    get_scale() alone, and the meter counts it as a skipped step, not a non-finite loss."""
    model, opt = _linear_step("fp16")
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 0])
    before = [p.detach().clone() for p in model.parameters()]
    loss = torch.nn.functional.cross_entropy(model(x), y) * torch.tensor(float("inf"))
    scale = opt.scaler.get_scale()
    assert scaled_update(loss, model, opt) is True
    assert opt.scaler.get_scale() < scale and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.optimizer.zero_grad(set_to_none=True)  # (train_step does this before every step)
    ok = torch.nn.functional.cross_entropy(model(x), y)
    assert scaled_update(ok, model, opt) is False  # a finite step: applied, the scale kept
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_train_step_applies_each_precision_and_the_meter_counts_it(precision) -> None:
    model, opt = _linear_step(precision)
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 0])
    meter = EpochMeter(torch.device("cpu"))
    before = model.weight.detach().clone()
    step = train_step(model, x, y, opt, StepPolicy(torch.device("cpu"), precision))
    meter.add(step, y)
    assert step.applied and bool(step.finite) and not torch.equal(model.weight, before)
    stats = meter.result(None, 0.0)
    assert (stats.steps, stats.images, stats.nonfinite_steps, stats.skipped_steps) == (1, 4, 0, 0)
    assert stats.loss == pytest.approx(float(step.loss))
    nan = train_step(model, x * float("nan"), y, opt, StepPolicy(torch.device("cpu"), precision), check_every=1)
    meter.add(nan, y)
    assert not bool(nan.finite) and meter.consecutive_nonfinite() == 1
    assert nan.applied == (precision == "fp16")  # fp16: the scaler's step skips it; else skipped before backward

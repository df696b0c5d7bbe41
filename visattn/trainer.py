"""The training run, top to bottom: ``build``, ``resume``, then for each epoch its steps, evaluation and save.

``run(cfg)`` = :func:`build` (device, precision, data, model, optimizer, schedule, EMA, lookahead, teacher,
loaders, hooks: a :class:`Run`), :func:`resume` when a checkpoint is to be continued, then :func:`fit`: the run
folder is opened and each epoch trains (:func:`train_one_epoch`: :func:`visattn.step.train_step` per batch, an
:class:`~visattn.step.EpochMeter` counting, and every step ending in :func:`periodic_check`: the hooks, signals,
``train.max_steps``, a checkpoint every ``train.ckpt_every_steps``), evaluates and ends in the epoch's hooks
(:mod:`visattn.hooks`: the metrics row and checkpoints, TensorBoard scalars and maps, then the caller's).
SIGTERM/SIGINT stop the run after the current step with a checkpoint saved. Under ``torchrun`` it runs
data-parallel (gloo on CPU, NCCL on GPU); rank 0 alone writes.

Around the loop, each in its own module: the optimizer, schedule, lookahead and scaler (:mod:`visattn.optim`),
the step and its statistics (:mod:`visattn.step`), distillation (:mod:`visattn.distill`), starting weights
(:mod:`visattn.models.starting`), the checks made before anything is written (:mod:`visattn.run_checks`), the run
folder (:mod:`visattn.rundir`). The file reads in the loop's order: the run's types, then ``run``, ``build``,
``resume``, ``fit``, ``train_one_epoch``, ``periodic_check`` and ``_end_epoch``, then the pieces they call.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import cpu_heap
from .attention.insert import check_sites
from .config import Config, with_defaults
from .data import Placement, Splits, build_loader, check_augment, load_splits, normalize, spread_indices
from .data.loaders import EpochLoader
from .distill import build_teacher
from .errors import CheckpointError, ConfigError, TrainingError
from .evaluate import evaluate, resolve_precision
from .hooks import CheckpointWriter, builtin_hooks, call, check_hooks, registered, step_hooks
from .maps import find_taps
from .maps.record import foreign_modules
from .maps.tensorboard import MapLogger
from .models import from_config
from .models.foreign import wide_head_note
from .models.layout import guard_message, to_channels_last
from .models.starting import check_init_folder, init_from_state, pretrained_origin
from .optim import Optimization, optimization_from, schedule_from
from .options import resolve_device
from .results import git_revision, versions
from .rng import kept_determinism, seed_everything, set_rng_state
from .run_checks import (
    bn_lag_note,
    check_epochs_left,
    check_for_training,
    check_forward,
    check_model_options,
    check_resume_config,
    resume_path,
)
from .rundir import (
    RunLock,
    check_branch,
    check_finite,
    check_rewind,
    check_run_dir,
    check_run_records,
    file_digest,
    load_checkpoint,
    metrics_rows,
    remove_new_run_files,
    remove_stale_temps,
    trim_metrics,
    yaml_dump,
)
from .signals import Interrupted, StopFlag, graceful_signals
from .step import EpochMeter, EpochStats, StepPolicy, host_check_every, train_step

NONFINITE_HINT = "check data.mean and data.std, lower optim.lr, use precision=bf16/fp32, or set optim.grad_clip"


class DistInfo:
    """This process's place under ``torchrun`` (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``); one process without it.
    The data-parallel path (DDP, the process group's all-reduce) is taken from two ranks on, or under ``torchrun``
    with one rank where ``VISATTN_DATA_PARALLEL=1`` (to check that path on a machine with one device)."""

    def __init__(self) -> None:
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        forced = os.environ.get("VISATTN_DATA_PARALLEL", "0")
        if forced not in ("0", "1"):
            raise ConfigError(f"VISATTN_DATA_PARALLEL must be 0 or 1, got {forced!r}")
        if forced == "1" and "WORLD_SIZE" not in os.environ:
            raise ConfigError("VISATTN_DATA_PARALLEL=1 takes the data-parallel path under torchrun; this process was "
                              "not started by torchrun (no WORLD_SIZE)")
        self.enabled = self.world_size > 1 or forced == "1"
        self.is_main = self.rank == 0

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(t)
        return t


@dataclass
class Run:
    """Everything a run holds. ``model`` is the module whose state is saved (never the compiled/DDP wrapper)."""

    cfg: Config
    dist: DistInfo
    run_dir: Path
    splits: Splits
    model: nn.Module
    opt: Optimization
    policy: StepPolicy
    train_loader: EpochLoader
    eval_loader: EpochLoader
    say: Callable[..., None]
    resume_from: Optional[Path] = None
    init_from: Optional[Dict[str, Any]] = None  # model.init_from's origin (path, epoch, best_acc, step-0 eval)
    epoch: int = 0  # epochs finished
    step: int = 0  # optimizer steps taken (global)
    best_acc: float = -1.0
    is_best: bool = False  # whether the epoch just ended scored the best so far (best.pt is saved)
    carry: Optional[torch.Tensor] = None  # a resumed partial epoch's statistics
    meter: Optional[EpochMeter] = None  # the running epoch's totals, saved by mid-epoch checkpoints
    probe: Optional[tuple] = None  # fixed (images, labels) whose attention maps are logged
    stop: StopFlag = field(default_factory=StopFlag)
    history: List[Dict[str, Any]] = field(default_factory=list)
    last_eval: Dict[str, Any] = field(default_factory=dict)
    t_start: float = field(default_factory=time.perf_counter)
    maps: Any = None  # the probe's MapLogger (it owns log.faithfulness=auto's cost budget)
    stop_saved: bool = True  # whether the last stop-time save was made (not with non-finite weights)
    teacher_digest: Optional[str] = None  # train.distill.teacher's file digest, kept in checkpoints
    # the loop's hooks in order (visattn.hooks): the run's own, then run(hooks=...)'s, then the registered ones
    hooks: List[Any] = field(default_factory=list)
    saver: CheckpointWriter = field(default_factory=CheckpointWriter)  # also in hooks: the epoch's save

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @property
    def num_classes(self) -> int:
        return len(self.splits.train.classes)

    @property
    def eval_model(self) -> nn.Module:
        return self.opt.ema.module if self.opt.ema is not None else self.model


# ------------------------- the run, top to bottom: run -> build -> resume -> fit -> train_one_epoch -> _end_epoch


def run(cfg: Config, log: Callable[..., None] = print, hooks: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
    """Train as ``cfg`` says: :func:`build`, :func:`resume` when a checkpoint is to be continued, :func:`fit`.
    ``hooks``: objects with some of :mod:`visattn.hooks`' methods (``on_epoch_end(run, epoch, row)``...), called
    after the run's own.

    Rank 0 holds the run folder's lock (:class:`~visattn.rundir.RunLock`) throughout: a second run on the same
    ``run_dir`` is refused.
    """
    extra = check_hooks(hooks)
    run_dir, main = Path(cfg.run_dir), DistInfo().is_main
    if main:
        check_run_dir(run_dir)  # before the lock creates anything: not /, ~, a source tree or someone's folder
    with RunLock(run_dir, enabled=main), kept_determinism():
        before = set(os.listdir(run_dir)) if run_dir.is_dir() else set()
        if main and cfg.resume is not None and (run_dir / "metrics.jsonl").is_file():
            metrics_rows(run_dir / "metrics.jsonl")  # a damaged row is refused before anything is rewritten
        r = build(cfg, log, extra)
        check_forward(r)
        if cfg.train.distill.teacher:  # a teacher file changed under a resumed run is a changed setting
            r.teacher_digest = file_digest(cfg.train.distill.teacher)
        if r.resume_from is not None:
            resume(r, r.resume_from)
            if main and r.resume_from.resolve().parent == run_dir.resolve():  # its own folder's records (#92)
                check_run_records(run_dir, r.epoch, r.resume_from)
        try:
            return fit(r)
        except BaseException:  # failed before its first checkpoint: the folder is left as it was found
            _close(r)
            if main and not (run_dir / "last.pt").exists():
                remove_new_run_files(run_dir, before)
            raise


def build(cfg: Config, log: Callable[..., None] = print, hooks: Sequence[Any] = ()) -> Run:
    """Set up everything the run needs; nothing is written yet. ``hooks`` go after the run's own."""
    di = DistInfo()
    if di.enabled and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() and cfg.device != "cpu" else "gloo")
    device = resolve_device(cfg.device)
    if di.enabled and device.type == "cuda":
        device = torch.device("cuda", di.local_rank)
        torch.cuda.set_device(device)
    precision = resolve_precision(cfg.precision, device)
    run_dir = Path(cfg.run_dir)
    check_for_training(cfg)
    check_init_folder(cfg, run_dir)
    resume_from = resume_path(cfg, run_dir)
    check_augment(cfg.data)
    check_model_options(cfg, fresh=resume_from is None)
    say = log if di.is_main else (lambda *a, **k: None)
    if cfg.resume == "auto" and resume_from is None:
        say(f"resume=auto: no checkpoint ({run_dir / 'last.pt'}) to continue; starting a new run")

    seed_everything(cfg.seed + di.rank, cfg.deterministic)
    splits = load_splits(cfg.data, cfg.seed)
    say(f"data: {len(splits.train)} train images ({splits.source}); evaluating on the {splits.eval_split}"
        + (f"; {splits.skipped} unreadable images skipped" if splits.skipped else ""))
    model = _build_model(cfg, splits, device, di, fresh=resume_from is None)
    if cfg.channels_last:  # on a CPU, the convolutions oneDNN's defect hits stay contiguous (models/layout.py)
        guarded = to_channels_last(model, device)
        if guarded:
            say(guard_message(guarded, model))
    init = None if resume_from is not None else _starting_weights(cfg, model, splits, say)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"model: {cfg.model.name} ({n_params / 1e6:.2f}M parameters) on {device}, precision {precision}"
        + (f", {di.world_size} ranks" if di.enabled else ""))

    if cfg.train.batch_size % di.world_size:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} must divide evenly over {di.world_size} ranks")
    placement = Placement(device, di.rank, di.world_size, cfg.channels_last)
    train_loader = build_loader(splits.train, cfg.data, cfg.train.batch_size // di.world_size, True, cfg.seed, placement)
    eval_loader = build_loader(splits.eval, cfg.data, cfg.eval.batch_size, False, cfg.seed, placement)
    if len(train_loader) == 0:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} exceeds the {len(splits.train)} training images")
    lag = bn_lag_note(model, len(train_loader) * cfg.train.epochs)
    if lag:
        say(lag)
    policy = StepPolicy(device, precision, cfg.train.label_smoothing, cfg.train.max_nonfinite_steps,
                        cfg.train.check_every, di.reduce if di.enabled else None,
                        build_teacher(cfg, splits, device, say))
    opt = optimization_from(cfg, model, len(train_loader), device, precision)
    own = builtin_hooks(opt)
    return Run(cfg=cfg, dist=di, run_dir=run_dir, splits=splits, model=model, opt=opt, policy=policy,
               train_loader=train_loader, eval_loader=eval_loader, say=say, resume_from=resume_from, init_from=init,
               hooks=[*own, *hooks, *registered()], saver=next(h for h in own if isinstance(h, CheckpointWriter)))


def resume(run: Run, path: Path) -> None:
    """Load model, optimizer, schedule, scaler, EMA, data order, RNG and counters from checkpoint ``path``."""
    cfg = run.cfg
    state = load_checkpoint(path, map_location="cpu")
    check_resume_config(state, cfg, path)
    held = state.get("teacher_digest")
    if held and run.teacher_digest and held != run.teacher_digest and not cfg.resume_allow_changes:
        raise CheckpointError(f"resume: the file of train.distill.teacher ({cfg.train.distill.teacher}) changed since "
                              f"{path} was trained with it (set resume_allow_changes=true to resume anyway)")
    try:
        check_sites(run.model, list(state["model"]) if isinstance(state["model"], dict) else [], f"resume: {path}")
        run.model.load_state_dict(state["model"])
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    except RuntimeError as e:  # the first line only says "Error(s) in loading state_dict": name the first mismatch
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = (lines[1] if len(lines) > 1 else lines[0] if lines else "")[:200]
        raise CheckpointError(f"resume: {path} does not fit model {cfg.model.name!r} ({why})") from None
    opt = run.opt
    try:
        opt.optimizer.load_state_dict(state["optimizer"])
        opt.scheduler.load_state_dict(state["scheduler"])
        if opt.scaler is not None and state.get("scaler"):
            opt.scaler.load_state_dict(state["scaler"])
        if opt.ema is not None and state.get("ema") is not None:
            opt.ema.load_state_dict(state["ema"])
        if opt.lookahead is not None:
            opt.lookahead.load_state_dict(state["lookahead"])
        run.train_loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        run.epoch, run.step = int(state["epoch"]), int(state["step"])
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"resume: {path} does not fit this run ({e.__class__.__name__}: {why[:120]})") from None
    check_branch(run.run_dir, path)  # a checkpoint that fits, but its folder must not be mixed or rewound
    check_rewind(run.run_dir, path, run.epoch, run.step)
    check_epochs_left(run, path)
    _fit_schedule(run, state, path)
    run.best_acc = float(state.get("best_acc", -1.0))
    run.carry = state.get("epoch_stats") if run.dist.is_main else None  # all-rank totals: counted once, on rank 0
    run.resume_from = path
    position = run.train_loader.position
    run.say(f"resumed from {path}: epoch {run.epoch}, step {run.step}"
            + (f" ({position} batches into the epoch)" if position else ""))


def fit(run: Run) -> Dict[str, Any]:
    """Train from ``run.epoch`` to ``cfg.train.epochs``; returns a summary (best/final accuracy, paths, time)."""
    cfg = run.cfg
    train_model = torch.compile(run.model) if cfg.compile else run.model
    if run.dist.enabled:
        device = run.device
        train_model = nn.parallel.DistributedDataParallel(
            train_model, device_ids=[device.index] if device.type == "cuda" else None)
    if run.init_from is not None:  # before the first step: the weights it starts from, as they score here
        _evaluate_init(run)
    if run.dist.is_main:
        _open_outputs(run)
    call(run.hooks, "fit_start", run)
    run.t_start = time.perf_counter()
    with graceful_signals(run.stop):
        for epoch in range(run.epoch, cfg.train.epochs):
            if cfg.train.max_steps is not None and run.step >= cfg.train.max_steps:
                break
            loader = run.train_loader
            loader.set_epoch(epoch)
            if hasattr(run.model, "set_epoch"):  # e.g. the whitening stem's bias trains for its first epochs only
                run.model.set_epoch(epoch)
            run.meter, run.carry = EpochMeter(run.device, run.carry, loader.position), None
            call(run.hooks, "epoch_start", run, epoch)
            ep, run.step, _ = train_one_epoch(train_model, loader, run.opt, run.policy, global_step=run.step,
                                              meter=run.meter, run=run)
            if run.stop:  # a signal: the step saved the state to resume from, whatever the steps were
                raise _interrupted(run)
            _check_learned(run, ep, epoch + 1)
            if 0 < loader.position < len(loader):  # stopped mid-epoch by train.max_steps: saved
                break
            _end_epoch(run, ep, epoch + 1)
            if run.stop:
                raise _interrupted(run)
    call(run.hooks, "fit_end", run)
    _close(run)
    if run.dist.enabled:
        dist.barrier()
    return {"best_val_acc": run.best_acc, "final": run.history[-1] if run.history else None,
            "epochs": len(run.history), "wall_seconds": time.perf_counter() - run.t_start,
            "run_dir": str(run.run_dir), "eval_split": run.splits.eval_split,
            "per_class_acc": run.last_eval.get("per_class_acc"), "classes": list(run.splits.train.classes),
            "init_from": run.init_from}


def train_one_epoch(model: nn.Module, loader: Iterable, opt: Optimization, policy: StepPolicy, *, global_step: int = 0,
                    meter: Optional[EpochMeter] = None, run: Optional[Run] = None,
                    hooks: Optional[Sequence[Any]] = None) -> Tuple[EpochStats, int, torch.Tensor]:
    """One pass of ``loader``: returns (its :class:`EpochStats`, the global step, the running totals tensor).

    Each batch is one :func:`~visattn.step.train_step`, counted by ``meter`` (an :class:`EpochMeter`; a partly
    done epoch's, from a mid-epoch checkpoint), with lookahead's averaging after it. A non-finite loss is counted,
    never learned from: on a CPU, where reading a finished scalar is free, its step is skipped before it touches
    the weights; on a GPU the host reads only every ``policy.check_every`` steps, where
    ``policy.max_nonfinite_steps`` consecutive ones stop the run. ``hooks``: ``run.hooks`` under a ``run``, whose
    every step ends in :func:`periodic_check`; without one, the EMA's update (:func:`visattn.hooks.step_hooks`).
    """
    model.train()
    meter = EpochMeter(policy.device) if meter is None else meter
    hooks = (run.hooks if run is not None else step_hooks(opt)) if hooks is None else hooks
    check_every = host_check_every(policy)
    t0 = time.perf_counter()
    for xb, yb in loader:
        step = train_step(model, xb, yb, opt, policy, check_every)
        if step.applied:
            call(hooks, "optimizer_step", model, global_step + 1)
        global_step += 1
        if opt.lookahead is not None:
            opt.lookahead.step(global_step)
        meter.add(step, yb)
        if global_step % check_every == 0 and meter.consecutive_nonfinite() >= policy.max_nonfinite_steps:
            raise TrainingError(f"{meter.consecutive_nonfinite()} consecutive non-finite losses at step {global_step}; "
                                "stopping (lower optim.lr, use precision=bf16/fp32, or set optim.grad_clip)"
                                + (f"; {_kept(run)}" if run is not None else ""))
        if run is not None and periodic_check(run, global_step):
            break
    return meter.result(policy.reduce, t0), global_step, meter.totals


def periodic_check(run: Run, step: int) -> bool:
    """The end of every step of a run: the hooks' ``on_step_end`` (the progress bar, TensorBoard, the caller's),
    then the stop decision (a signal, ``train.max_steps``; every rank stops at the same step) and the save it
    asks for (:meth:`~visattn.hooks.CheckpointWriter.save_step`). Returns whether the epoch stops here."""
    run.step = step
    call(run.hooks, "step_end", run, step)
    halt = bool(run.stop)
    if run.dist.enabled:
        halt = bool(run.dist.reduce(torch.tensor([1.0 if halt else 0.0], device=run.device)).item() > 0)
        if halt and run.stop.signum is None:
            run.stop.signum = signal.SIGTERM
    if run.cfg.train.max_steps is not None and step >= run.cfg.train.max_steps:
        halt = True
    run.saver.save_step(run, step, halt)
    return halt


def _end_epoch(run: Run, ep: EpochStats, done: int) -> None:
    """Evaluate (when due), then the epoch's hooks: the metrics row and checkpoints, TensorBoard, the caller's."""
    cfg = run.cfg
    row: Dict[str, Any] = {"epoch": done, "step": run.step, "train_loss": ep.loss, "train_acc": ep.acc,
                           "images_per_s": ep.images_per_s,  # ep.images is already summed over ranks
                           "epoch_seconds": ep.seconds, "epoch_steps": ep.steps, "nonfinite_steps": ep.nonfinite_steps,
                           "skipped_steps": ep.skipped_steps, "lr": run.opt.optimizer.param_groups[0]["lr"],
                           "wall_seconds": time.perf_counter() - run.t_start}
    if done == cfg.train.epochs and run.opt.lookahead is not None:
        run.opt.lookahead.finish()  # the averaged weights are the ones evaluated and saved
    if done % cfg.eval.every == 0 or done == cfg.train.epochs:
        row.update(_evaluate(run))
    _check_result(run, ep, row, done)
    run.is_best = "val_acc" in row and not check_finite(row["val_loss"]) and row["val_acc"] > run.best_acc
    if run.is_best:
        run.best_acc = row["val_acc"]
    row["best_val_acc"] = run.best_acc
    run.history.append(row)
    call(run.hooks, "epoch_end", run, done, row)  # every rank's (each holds the same, reduced row)
    if run.dist.is_main:
        run.say(_epoch_line(run, ep, row, done))


# ----------------------------------------------------------------- building the run: the model, starting weights


def _starting_weights(cfg: Config, model: nn.Module, splits: Splits, say: Callable[..., None]
                      ) -> Optional[Dict[str, Any]]:
    """A new run's starting weights (a resumed run holds its own): ``model.init_from``'s checkpoint, else the
    ``model.pretrained_file`` the builder loaded; with a note where a package model's classifier is at the
    package's own initialisation. Returns the origin ``run_info.json`` records, or None."""
    if cfg.model.init_from:
        init = init_from_state(load_checkpoint(cfg.model.init_from, map_location="cpu"), cfg, model, splits, say)
    else:
        init = pretrained_origin(model, say)
    if not cfg.model.init_from and hasattr(model, "pretrained_origin") and (init is None or init["replaced"]):
        wide = wide_head_note(model, len(splits.train.classes))
        if wide:
            say(wide)
    return init


def _build_model(cfg: Config, splits: Splits, device: torch.device, di: DistInfo, fresh: bool = True) -> nn.Module:
    """The model ``cfg.model`` names; a resumed run (``fresh=False``) takes its weights from the checkpoint, so a
    ``model.pretrained_file`` is not read again."""
    images = torch.from_numpy(splits.train.x[:5000]).permute(0, 3, 1, 2)  # for a stem computed from training patches
    try:
        model = from_config(cfg, len(splits.train.classes), weights=fresh, train_images=images)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model: {e}") from None
    if di.enabled and cfg.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    if di.enabled:  # ranks seed differently: start every rank, and so its EMA copy, from rank 0's initial weights
        with torch.no_grad():
            for t in model.state_dict().values():
                dist.broadcast(t, src=0)
    return model


# ------------------------------------------------------------------------------------------------------- resuming


def _fit_schedule(run: Run, state: Dict[str, Any], path: Path) -> None:
    """A resume under another ``train.epochs``: the checkpoint's schedule state is sized for its old length (a
    finished one-cycle run would train every new epoch at its last lr, about 0). The schedule is rebuilt for the
    new length and moved to the checkpoint's step, as if the run had been asked for that length from the start,
    and one line says so, with the way to start from the weights on a fresh schedule instead."""
    cfg, old = run.cfg, with_defaults(state["config"]).get("train", {}).get("epochs")
    if old == cfg.train.epochs or cfg.sched.name == "constant":
        return
    was, done = run.opt.optimizer.param_groups[0]["lr"], run.opt.scheduler.num_updates
    run.opt.scheduler = schedule_from(cfg, run.opt.optimizer, len(run.train_loader))
    for _ in range(done):
        run.opt.scheduler.step()
    run.say(f"resume: train.epochs {old} -> {cfg.train.epochs}: the {cfg.sched.name} schedule is rebuilt for "
            f"{cfg.train.epochs} epochs and goes on from step {done} (lr {was:.3g} -> "
            f"{run.opt.optimizer.param_groups[0]['lr']:.3g}); for a fresh schedule from these weights instead: "
            f"model.init_from={path} run_dir=NEW")


# ------------------------------------------------------ epochs: checks, evaluation, the printed line, outputs


def _epoch_line(run: Run, ep: EpochStats, row: Dict[str, Any], done: int) -> str:
    """The printed epoch summary; a mean over no steps (every loss non-finite) is "n/a", never 0."""
    def num(x: float) -> str:
        return f"{x:.4f}" if math.isfinite(x) else "n/a"

    msg = f"epoch {done}/{run.cfg.train.epochs}: train loss {num(ep.loss)} acc {num(ep.acc)}"
    if ep.nonfinite_steps:
        msg += f" (non-finite loss: skipped {ep.nonfinite_steps}/{ep.steps} steps)"
    if "val_acc" in row:
        msg += f" | val loss {num(row['val_loss'])} acc {num(row['val_acc'])}"
    wall = row.get("wall_seconds", time.perf_counter() - run.t_start)
    return msg + f" | {ep.images_per_s:.0f} img/s | {wall:.0f}s"


def _interrupted(run: Run) -> Interrupted:
    _close(run)
    return Interrupted(run.stop.signum, run.run_dir / "last.pt", run.stop_saved, _kept(run))


def _kept(run: Run) -> str:
    return "last good checkpoint kept" if (run.run_dir / "last.pt").is_file() else "no checkpoint was written"


def _check_learned(run: Run, ep: EpochStats, done: int) -> None:
    """An epoch (or the part of it run since a resume) whose every step had a non-finite loss learned nothing:
    the run stops with :class:`TrainingError` before the epoch is evaluated or committed, however short it is
    (``train.max_nonfinite_steps`` counts a run of such steps, which a short run never reaches)."""
    if not ep.nothing_learned:
        return
    if 0 < ep.steps <= ep.nonfinite_steps:
        what = f"all {ep.steps} training steps of epoch {done} had a non-finite loss"
    else:
        what = (f"all {ep.new_steps} training steps of epoch {done} run since the resume had a non-finite loss "
                f"({ep.nonfinite_steps}/{ep.steps} in the epoch)")
    _fail_epoch(run, ep, {}, done, f"{what}; nothing was learned")


def _check_result(run: Run, ep: EpochStats, row: Dict[str, Any], done: int) -> None:
    """Nothing non-finite is committed: weights that are not finite after an epoch, or a validation loss that is
    not finite at the run's end, stop the run with :class:`TrainingError` before the row and checkpoints are
    written (a non-finite validation loss before the end is written as null and the run goes on)."""
    last = done == run.cfg.train.epochs or (run.cfg.train.max_steps is not None and run.step >= run.cfg.train.max_steps)
    if check_finite([run.model, run.eval_model]):
        what = (f"the weights or normalisation statistics are not finite after epoch {done} (non-finite steps "
                "reached them: on a GPU the loss is checked every train.check_every steps)")
    elif last and check_finite(row.get("val_loss", 0.0)):
        what = f"the validation loss after the last epoch ({done}) is {row['val_loss']}, not a finite number"
    else:
        return
    _fail_epoch(run, ep, row, done, what)


def _fail_epoch(run: Run, ep: EpochStats, row: Dict[str, Any], done: int, what: str) -> None:
    """Stop before the epoch is committed: its line printed, the writer closed, one :class:`TrainingError` line."""
    run.say(_epoch_line(run, ep, row, done))
    _close(run)
    raise TrainingError(f"{what}; stopping ({NONFINITE_HINT}); {_kept(run)}")


def _evaluate(run: Run) -> Dict[str, Any]:
    eval_model = run.eval_model
    if run.dist.enabled:  # BN running stats drift apart per rank: evaluate rank 0's, the ones it saves
        with torch.no_grad():
            for b in eval_model.buffers():
                dist.broadcast(b, src=0)
    ev = evaluate(eval_model, run.eval_loader, device=run.device, precision=run.policy.precision,
                         tta=run.cfg.eval.tta, num_classes=run.num_classes, reduce=run.policy.reduce)
    run.last_eval = ev
    return {"val_loss": ev["loss"], "val_acc": ev["acc"], "eval_seconds": ev["seconds"]}


def _evaluate_init(run: Run) -> None:
    """Step 0 of a ``model.init_from`` (or ``model.pretrained_file``) run: its validation score before any step, printed, kept in run_info.json
    and logged as the epoch-0 point of ``val/acc`` (with blocks that start as the identity it equals the
    checkpoint's own score, to the digit)."""
    ev = _evaluate(run)
    run.init_from.update(val_acc=ev["val_acc"], val_loss=ev["val_loss"])
    if run.init_from.get("weights") == "pretrained_file":
        run.say(f"step 0 (model.pretrained_file, before training): val loss {ev['val_loss']:.4f} acc {ev['val_acc']:.4f}")
        return
    run.say(f"step 0 (model.init_from, before training): val loss {ev['val_loss']:.4f} acc {ev['val_acc']:.4f} "
            f"(the checkpoint's best val acc: {run.init_from['best_acc']})")


def _open_outputs(run: Run) -> None:
    """Rank 0: the run folder's config and run info, and the fixed probe batch for maps (TensorBoard's writer is
    its hook's, :class:`~visattn.hooks.TensorBoardLog`)."""
    cfg, run_dir = run.cfg, run.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml_dump(cfg.to_dict()))
    info = {"seed": cfg.seed, "versions": versions(), "git": git_revision(), "argv": sys.argv,
            "eval_split": run.splits.eval_split, "device": str(run.device), "precision": run.policy.precision,
            "world_size": run.dist.world_size, "parameters": sum(p.numel() for p in run.model.parameters()),
            "classes": list(run.splits.train.classes), "branched_from": _branched_from(run),
            "init_from": run.init_from or _recorded(run, "init_from"),
            "cpu_heap": cpu_heap.in_effect() if run.device.type == "cpu" else None}  # what this process runs with
    (run_dir / "run_info.json").write_text(json.dumps(info, indent=2))
    if run.resume_from is not None or cfg.resume == "auto":  # (a new run under resume=auto: drops a torn line)
        trim_metrics(run_dir / "metrics.jsonl", run.epoch)
    remove_stale_temps(run_dir)  # torn checkpoint writes of a killed run; only under the run folder's lock
    if cfg.log.maps_every and (find_taps(run.model) or foreign_modules(run.model)):  # blocks, or a timm ViT's own
        ev = run.splits.eval
        pick = spread_indices(ev.y, cfg.log.probe_size)  # fixed: one image per class in turn
        px = torch.from_numpy(ev.x[pick]).permute(0, 3, 1, 2)
        run.probe = (normalize(px, cfg.data.mean, cfg.data.std).to(run.device), torch.from_numpy(ev.y[pick]).to(run.device),
                     None if ev.boxes is None else torch.from_numpy(ev.boxes[pick]))  # placed objects: their boxes
        run.maps = MapLogger(cfg, run.splits.train.classes, run.say)


def _branched_from(run: Run) -> Optional[str]:
    """The checkpoint of another run folder this run started from (kept over later ``resume=auto``), or None."""
    src = run.resume_from
    if src is not None and src.resolve().parent != run.run_dir.resolve():
        return str(src.resolve())
    return _recorded(run, "branched_from")


def _recorded(run: Run, key: str) -> Any:
    """What the run folder's run_info.json says under ``key`` (a resumed run keeps its origin), or None."""
    try:
        return json.loads((run.run_dir / "run_info.json").read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def _close(run: Run) -> None:
    """The run's outputs closed: each hook's ``on_close`` (the progress bar, the TensorBoard writer)."""
    call(run.hooks, "close", run)

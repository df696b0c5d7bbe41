"""The training run, top to bottom: ``build``, ``resume``, then for each epoch its steps, evaluation and save.

``run(cfg)`` = :func:`build` (device, precision, data, model, optimizer, schedule, EMA, lookahead, teacher,
loaders: a :class:`Run`), :func:`resume` when a checkpoint is to be continued, then :func:`fit`: the run folder
and TensorBoard are opened and each epoch trains (:func:`train_one_epoch`, whose every step ends in
:func:`periodic_check`: signals, ``train.max_steps``, a checkpoint every ``train.ckpt_every_steps``), evaluates,
writes a metrics row, saves ``best.pt``/``last.pt`` and logs attention maps. SIGTERM/SIGINT stop the run after
the current step with a checkpoint saved. Under ``torchrun`` it runs data-parallel (gloo on CPU, NCCL on GPU);
rank 0 alone writes. The run folder's state and its guarantees live in :mod:`visattn.rundir`.

The file reads in that order: the run's types, then ``run``, ``build``, ``resume``, ``fit``, ``train_one_epoch``,
``periodic_check`` and ``_end_epoch`` (the whole loop, from ``for epoch`` to the checkpoint save), then the pieces
they call, by section. The config is read here and nowhere below it: the data layer gets its typed ``data`` section, the optimizer and
the epoch plain arguments (:class:`Optimization`, :class:`StepPolicy`).
"""
from __future__ import annotations

import enum
import functools
import json
import math
import os
import signal
import sys
import time
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .attention.insert import check_sites
from .config import Config, DistillConfig, check_for_training, with_defaults
from .data import Placement, Splits, build_loader, check_augment, load_splits, normalize, spread_indices
from .data.loaders import EpochLoader
from .errors import CheckpointError, ConfigError, TrainingError
from .evaluate import autocast, cpu_has_native_bf16, evaluate, main_logits, resolve_precision
from .maps import find_taps
from .maps.record import foreign_modules
from .maps.tensorboard import MapLogger
from .models import from_config
from .models.foreign import wide_head_note
from .models.layout import guard_message, to_channels_last
from .options import resolve_device
from .registry import backbone_modules, is_attention_block
from .rundir import (
    Interrupted,
    RunLock,
    StopFlag,
    check_auto_start,
    check_branch,
    check_finite,
    check_new_run_dir,
    check_not_project,
    check_rewind,
    check_run_dir,
    config_diff,
    file_digest,
    finish_hparams,
    git_revision,
    graceful_signals,
    kept_determinism,
    load_checkpoint,
    log_hparam_metrics,
    metrics_line,
    metrics_rows,
    remove_new_run_files,
    remove_stale_temps,
    rng_state,
    run_hparams,
    save_checkpoint,
    seed_everything,
    set_rng_state,
    start_hparams,
    trim_metrics,
    versions,
    yaml_dump,
)

RESUME_MUST_MATCH = ("model", "data")  # config sections a resume may not silently change
# settings the saved optimizer, schedule, EMA and lookahead state is shaped by (the optimizer's param groups keep
# lr, momentum, betas and weight decay; the schedule its shape): never changed on resume, even with
# resume_allow_changes. optim.grad_clip and precision (a fresh fp16 loss scale) are taken as given.
RESUME_FIXED = tuple(f"optim.{k}" for k in ("name", "lr", "momentum", "nesterov", "betas", "weight_decay",
                                              "no_decay_norm_bias", "norm_bias_lr_scale",
                                              "attn_lr_scale")) + \
    tuple(f"sched.{k}" for k in ("name", "warmup_epochs", "min_lr_ratio", "anneal", "start_lr_ratio")) + \
    tuple(f"train.{k}" for k in ("ema_decay", "ema_warmup", "lookahead_every", "lookahead_decay", "lookahead_power"))
MAX_PARAMETERS = 2_000_000_000  # a model larger than this is a typo in model.widths, not a CIFAR model
EPOCH_SCALARS = ("train_loss", "train_acc", "val_loss", "val_acc", "images_per_s", "lr", "nonfinite_steps",
                 "skipped_steps")
NONFINITE_HINT = "check data.mean and data.std, lower optim.lr, use precision=bf16/fp32, or set optim.grad_clip"
# data settings a teacher must share with the student: the held-out split (or the teacher saw the images the
# student is scored on) and the input the teacher is fed (the student's normalised batches)
SPLIT_MUST_MATCH = ("source", "split_seed", "val_size", "use_test_split")  # the same held-out images
TEACHER_MUST_MATCH = SPLIT_MUST_MATCH + ("image_size", "mean", "std")
MUON_FALLBACK = ("head.*", "fc.*", "classifier.*")  # the classifier trains with AdamW, as in Muon's recipes


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
class Optimization:
    """What takes a training step: the optimizer, its per-step schedule, and the optional extras."""

    optimizer: torch.optim.Optimizer
    scheduler: StepScheduler
    scaler: Optional[torch.amp.GradScaler] = None  # fp16 loss scaling
    ema: Optional[nn.Module] = None  # timm ModelEmaV3, updated after every applied step
    grad_clip: Optional[float] = None
    lookahead: Optional[Lookahead] = None


@dataclass
class Distill:
    """A frozen teacher whose logits on each training batch join the loss (:func:`distill_loss`)."""

    teacher: nn.Module
    weight: float = 0.5
    temperature: float = 1.0
    kind: str = "soft"


@dataclass
class StepPolicy:
    """How steps run and are checked: device, precision, loss smoothing, the non-finite policy."""

    device: torch.device
    precision: str = "fp32"
    label_smoothing: float = 0.0
    max_nonfinite_steps: int = 10  # consecutive non-finite losses before TrainingError
    check_every: int = 20  # steps between host reads of the statistics (GPUs; a CPU reads every step)
    reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # all-reduce under data parallelism
    distill: Optional[Distill] = None  # a teacher's logits in the loss
    host_every: Optional[int] = None  # steps between host reads; None: every step on a CPU, check_every on a GPU

    def __post_init__(self) -> None:
        if self.host_every is not None and not (type(self.host_every) is int and self.host_every >= 1):
            raise ValueError(f"StepPolicy.host_every must be a positive int or None, got {self.host_every!r}")


class Stat(enum.IntEnum):
    """The slots of an epoch's running totals: one float64 tensor on the device, added to in place at every step
    without a host read, saved by mid-epoch checkpoints (``epoch_stats``) and read by name: ``live[Stat.steps]``."""

    loss_sum = 0  # summed over the images of the steps whose loss was finite
    correct = 1  # (the same)
    images = 2
    nonfinite = 3  # steps whose loss was NaN or inf
    scaler_skipped = 4  # fp16: optimizer steps the GradScaler skipped (inf/NaN gradients)
    steps = 5
    finite_images = 6  # images of the steps whose loss was finite


@dataclass
class EpochStats:
    """An epoch's totals. ``loss`` and ``acc`` are means over the steps whose loss was finite: NaN when there
    were none. ``steps`` and ``nonfinite_steps`` count the whole epoch (a resumed part included); ``new_steps``
    and ``new_nonfinite`` only the steps this call ran. Under data parallelism the counts are summed over ranks.
    """

    loss: float
    acc: float
    images: int
    seconds: float
    nonfinite_steps: int = 0
    skipped_steps: int = 0  # fp16: optimizer steps the GradScaler skipped (inf/NaN gradients)
    steps: int = 0
    new_steps: int = 0
    new_nonfinite: int = 0
    new_images: Optional[int] = None  # the images this call ran (a resumed epoch's tail): what ``seconds`` timed

    @classmethod
    def of(cls, total: List[float], new: List[float], seconds: float) -> "EpochStats":
        """From the totals over the epoch and over this call's part (:class:`Stat` order), as host numbers."""
        good = total[Stat.finite_images]
        return cls(loss=total[Stat.loss_sum] / good if good else float("nan"),
                   acc=total[Stat.correct] / good if good else float("nan"), images=int(total[Stat.images]),
                   seconds=seconds, nonfinite_steps=int(total[Stat.nonfinite]),
                   skipped_steps=int(total[Stat.scaler_skipped]), steps=int(total[Stat.steps]),
                   new_steps=int(new[Stat.steps]), new_nonfinite=int(new[Stat.nonfinite]),
                   new_images=int(new[Stat.images]))

    @property
    def images_per_s(self) -> float:
        """Images per second of the steps this call timed (not a resumed epoch's images before the stop)."""
        images = self.images if self.new_images is None else self.new_images
        return images / max(self.seconds, 1e-9)

    @property
    def nothing_learned(self) -> bool:
        """Every step of the epoch, or every step this call ran (a resumed tail), had a non-finite loss."""
        return (0 < self.steps <= self.nonfinite_steps) or (0 < self.new_steps <= self.new_nonfinite)


# hooks every run built from now on calls (:func:`register_hook`), after its own; a run's own are in Run.hooks
HOOKS: Dict[str, List[Callable[..., None]]] = {"fit_start": [], "step_end": [], "epoch_end": [], "fit_end": []}


def register_hook(event: str, hook: Callable[..., None]) -> Callable[[], None]:
    """Call ``hook`` in every run built after this, e.g. from a script that then calls ``visattn.cli.main``:

    * ``"fit_start"``: ``hook(run)`` once, before the first step (the run folder's outputs open, the model
      wrapped for training); a forward hook put on ``run.model`` here sees every training and evaluation batch;
    * ``"step_end"``: ``hook(run, step)`` after each optimizer step (the gradients still on the parameters);
    * ``"epoch_end"``: ``hook(run, epoch, row)`` after each epoch's metrics row, checkpoints and scalars, on
      every rank (rank 0 alone writes; ``run.last_eval`` holds the epoch's evaluation where it had one);
    * ``"fit_end"``: ``hook(run)`` once, after the last epoch of a run that trained to its end, before its
      outputs close (the loaders, the EMA copy and the TensorBoard writer still there).

    Returns a function that removes it. A hook that raises stops the run."""
    if event not in HOOKS:
        raise ValueError(f"unknown hook event {event!r}; valid: {', '.join(HOOKS)}")
    HOOKS[event].append(hook)
    return lambda: HOOKS[event].remove(hook) if hook in HOOKS[event] else None


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
    carry: Optional[torch.Tensor] = None  # a resumed partial epoch's statistics
    live: Optional[torch.Tensor] = None  # the running epoch's totals (:class:`Stat`), saved by mid-epoch checkpoints
    bar: Any = None  # the epoch's progress bar (rank 0, log.progress)
    writer: Any = None  # TensorBoard SummaryWriter (rank 0)
    probe: Optional[tuple] = None  # fixed (images, labels) whose attention maps are logged
    stop: StopFlag = field(default_factory=StopFlag)
    history: List[Dict[str, Any]] = field(default_factory=list)
    last_eval: Dict[str, Any] = field(default_factory=dict)
    t_start: float = field(default_factory=time.perf_counter)
    maps: Any = None  # the probe's MapLogger (it owns log.faithfulness=auto's cost budget)
    stop_saved: bool = True  # whether the last stop-time save was made (not with non-finite weights)
    teacher_digest: Optional[str] = None  # train.distill.teacher's file digest, kept in checkpoints
    # the loop's hook points (:func:`register_hook` says when each is called, with what); a run's own hooks go
    # first, then the registered ones; the progress bar is the first step_end hook
    hooks: Dict[str, List[Callable[..., None]]] = field(
        default_factory=lambda: {event: [*([_advance_bar] if event == "step_end" else []), *registered]
                                 for event, registered in HOOKS.items()})

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


def run(cfg: Config, log: Callable[..., None] = print) -> Dict[str, Any]:
    """Train as ``cfg`` says: :func:`build`, :func:`resume` when a checkpoint is to be continued, :func:`fit`.

    Rank 0 holds the run folder's lock (:class:`~visattn.rundir.RunLock`) throughout: a second run on the same
    ``run_dir`` is refused.
    """
    run_dir, main = Path(cfg.run_dir), DistInfo().is_main
    if main:
        check_run_dir(run_dir)  # before the lock creates anything: not /, ~, a source tree or someone's folder
    with RunLock(run_dir, enabled=main), kept_determinism():
        before = set(os.listdir(run_dir)) if run_dir.is_dir() else set()
        if main and cfg.resume is not None and (run_dir / "metrics.jsonl").is_file():
            metrics_rows(run_dir / "metrics.jsonl")  # a damaged row is refused before anything is rewritten
        r = build(cfg, log)
        _check_forward(r)
        if cfg.train.distill.teacher:  # a teacher file changed under a resumed run is a changed setting
            r.teacher_digest = file_digest(cfg.train.distill.teacher)
        if r.resume_from is not None:
            resume(r, r.resume_from)
        try:
            return fit(r)
        except BaseException:  # failed before its first checkpoint: the folder is left as it was found
            _close(r)
            if main and not (run_dir / "last.pt").exists():
                remove_new_run_files(run_dir, before)
            raise


def build(cfg: Config, log: Callable[..., None] = print) -> Run:
    """Set up everything the run needs; nothing is written yet."""
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
    _check_init_folder(cfg, run_dir)
    resume_from = _resume_path(cfg, run_dir)
    check_augment(cfg.data)
    _check_model_options(cfg, fresh=resume_from is None)
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
    # a resumed run holds its weights already: model.init_from and model.pretrained_file act only when it starts
    init = None if resume_from is not None else \
        _init_from(cfg, model, splits, say) if cfg.model.init_from else _pretrained(model, say)
    if resume_from is None and not cfg.model.init_from and hasattr(model, "pretrained_origin") \
            and (init is None or init["replaced"]):  # a package model's classifier at the package's own init
        wide = wide_head_note(model, len(splits.train.classes))
        if wide:
            say(wide)
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
                               _build_teacher(cfg, splits, device, say))
    return Run(cfg=cfg, dist=di, run_dir=run_dir, splits=splits, model=model,
               opt=_build_optimization(cfg, model, len(train_loader), device, precision), policy=policy,
               train_loader=train_loader, eval_loader=eval_loader, say=say, resume_from=resume_from, init_from=init)


def resume(run: Run, path: Path) -> None:
    """Load model, optimizer, schedule, scaler, EMA, data order, RNG and counters from checkpoint ``path``."""
    cfg = run.cfg
    state = load_checkpoint(path, map_location="cpu")
    _check_resume_config(state, cfg, path)
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
    _check_epochs_left(run, path)
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
        if run.writer is not None and "val_acc" in (run.init_from or {}):
            run.writer.add_scalar("val/acc", run.init_from["val_acc"], 0)
            run.writer.add_scalar("val/loss", run.init_from["val_loss"], 0)
    for hook in run.hooks["fit_start"]:
        hook(run)
    run.t_start = time.perf_counter()
    with graceful_signals(run.stop):
        for epoch in range(run.epoch, cfg.train.epochs):
            if cfg.train.max_steps is not None and run.step >= cfg.train.max_steps:
                break
            loader = run.train_loader
            loader.set_epoch(epoch)
            if hasattr(run.model, "set_epoch"):  # e.g. the whitening stem's bias trains for its first epochs only
                run.model.set_epoch(epoch)
            if run.dist.is_main and cfg.log.progress:
                from tqdm import tqdm

                run.bar = tqdm(total=len(loader), initial=loader.position, desc=f"epoch {epoch + 1}/{cfg.train.epochs}",
                               leave=False, dynamic_ncols=True, file=sys.stderr)
            run.live, run.carry = epoch_stats_tensor(run.carry, loader.position, run.device), None
            try:
                ep, run.step, _ = train_one_epoch(train_model, loader, run.opt, run.policy, global_step=run.step,
                                                  carry=run.live, run=run)
            finally:
                if run.bar is not None:
                    run.bar.close()
                    run.bar = None
            if run.stop:  # a signal: the step saved the state to resume from, whatever the steps were
                raise _interrupted(run)
            _check_learned(run, ep, epoch + 1)
            if 0 < loader.position < len(loader):  # stopped mid-epoch by train.max_steps: saved
                break
            _end_epoch(run, ep, epoch + 1)
            if run.stop:
                raise _interrupted(run)
    for hook in run.hooks["fit_end"]:
        hook(run)
    if run.writer is not None:  # trained as asked: the HParams row's status is "success"
        finish_hparams(run.run_dir / "tb")
    _close(run)
    if run.dist.enabled:
        dist.barrier()
    return {"best_val_acc": run.best_acc, "final": run.history[-1] if run.history else None,
            "epochs": len(run.history), "wall_seconds": time.perf_counter() - run.t_start,
            "run_dir": str(run.run_dir), "eval_split": run.splits.eval_split,
            "per_class_acc": run.last_eval.get("per_class_acc"), "classes": list(run.splits.train.classes),
            "init_from": run.init_from}


def train_one_epoch(model: nn.Module, loader: Iterable, opt: Optimization, policy: StepPolicy, *, global_step: int = 0,
                    carry: Optional[torch.Tensor] = None, run: Optional[Run] = None
                    ) -> Tuple[EpochStats, int, torch.Tensor]:
    """One pass of ``loader``: returns (its :class:`EpochStats`, the global step, the running totals tensor).

    The totals (:class:`Stat`) stay on the device, updated in place (``carry``: a partly done epoch's, from a
    mid-epoch checkpoint). A non-finite loss is counted, never learned from: on a CPU, where reading a finished
    scalar is free, its step is skipped before it touches the weights; on a GPU the host reads only every
    ``policy.check_every`` steps, where ``policy.max_nonfinite_steps`` consecutive ones stop the run. Under a
    ``run``, every step ends in :func:`periodic_check` (stop, save), and the step's loss and lr go to TensorBoard.
    """
    model.train()
    device, reduce = policy.device, policy.reduce
    stats = epoch_stats_tensor(None, 0, device) if carry is None else carry
    start = stats.clone()  # this call's own part is ``stats - start``
    consecutive = torch.zeros((), dtype=torch.int64, device=device)  # the current run of non-finite losses
    zero = torch.zeros((), dtype=torch.float64, device=device)
    check_every = host_check_every(policy)
    t0 = time.perf_counter()
    for xb, yb in loader:
        with autocast(device, policy.precision):
            logits = main_logits(model(xb))  # a tuple of (logits, aux logits): the main logits
        loss = training_loss(logits, xb, yb, policy)
        opt.optimizer.zero_grad(set_to_none=True)
        finite = torch.isfinite(loss.detach())
        skipped, applied = zero, True
        if opt.scaler is not None:  # fp16: the scaler skips a step whose gradients hold inf/NaN, inside its step
            opt.scaler.scale(loss).backward()
            if opt.grad_clip:
                opt.scaler.unscale_(opt.optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
            scale = opt.scaler._scale.clone() if getattr(opt.scaler, "_scale", None) is not None else None
            opt.scaler.step(opt.optimizer)
            opt.scaler.update()
            if scale is not None:  # the scale backs off exactly when the step was skipped
                skipped = (opt.scaler._scale < scale).double().sum()
        elif check_every == 1 and not (bool(finite) if reduce is None else bool(reduce((~finite).float()) == 0)):
            applied = False  # CPU: skipped before it touches the weights; under data parallelism by every rank
        else:
            loss.backward()
            if opt.grad_clip:
                nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
            opt.optimizer.step()
        if applied:
            opt.scheduler.step()
            if opt.ema is not None:  # a warming-up EMA's decay follows the step count (from 1), kept in checkpoints
                opt.ema.update(model, step=global_step + 1 if getattr(opt.ema, "use_warmup", False) else None)
        global_step += 1
        if opt.lookahead is not None:
            opt.lookahead.step(global_step)
        with torch.no_grad():
            n = zero + yb.shape[0]
            added = {Stat.loss_sum: torch.where(finite, loss.detach().double() * n, zero),
                     Stat.correct: torch.where(finite, (logits.argmax(1) == yb).sum().double(), zero),
                     Stat.images: n, Stat.nonfinite: (~finite).double(), Stat.scaler_skipped: skipped,
                     Stat.steps: zero + 1, Stat.finite_images: torch.where(finite, n, zero)}
            stats += torch.stack([added[k] for k in Stat])
        consecutive = torch.where(finite, torch.zeros_like(consecutive), consecutive + 1)
        if global_step % check_every == 0:  # the host read (on a GPU it waits for the queued steps)
            if int(consecutive) >= policy.max_nonfinite_steps:
                raise TrainingError(f"{int(consecutive)} consecutive non-finite losses at step {global_step}; stopping "
                                    "(lower optim.lr, use precision=bf16/fp32, or set optim.grad_clip)"
                                    + (f"; {_kept(run)}" if run is not None else ""))
            if run is not None and run.writer is not None and global_step % max(check_every, 20) == 0:
                run.writer.add_scalar("train/loss_step", float(stats[Stat.loss_sum] / stats[Stat.finite_images]),
                                      global_step)
                run.writer.add_scalar("train/lr", opt.optimizer.param_groups[0]["lr"], global_step)
        if run is not None and periodic_check(run, global_step):
            break
    both = torch.cat([stats, stats - start])
    total = (reduce(both) if reduce is not None else both).tolist()
    seconds = time.perf_counter() - t0  # after the host read: on a GPU it waits for the epoch's queued steps
    return EpochStats.of(total[: len(Stat)], total[len(Stat):], seconds), global_step, stats


def periodic_check(run: Run, step: int) -> bool:
    """The end of every step of a run: progress, the stop decision (a signal, ``train.max_steps``; every rank stops
    at the same step) and the checkpoint every ``train.ckpt_every_steps``. Returns whether the epoch stops here.

    No save replaces the last good checkpoint with non-finite weights (on a GPU the loss is checked only every
    ``train.check_every`` steps, after the weights took the step), and only a signal's stop saves an epoch whose
    every step so far had a non-finite loss (nothing learned yet: a later finite step saves, or the run stops
    with the last good checkpoint in place)."""
    run.step = step
    for hook in run.hooks["step_end"]:
        hook(run, step)
    halt = bool(run.stop)
    if run.dist.enabled:
        halt = bool(run.dist.reduce(torch.tensor([1.0 if halt else 0.0], device=run.device)).item() > 0)
        if halt and run.stop.signum is None:
            run.stop.signum = signal.SIGTERM
    if run.cfg.train.max_steps is not None and step >= run.cfg.train.max_steps:
        halt = True
    every = run.cfg.train.ckpt_every_steps
    if halt or (every and step % every == 0):  # the same decision on every rank
        live = run.live
        if run.dist.enabled and live is not None:  # the partial epoch's totals over all ranks; rank 0 resumes them
            live = run.dist.reduce(live.clone())
        nothing = live is not None and 0 < float(live[Stat.steps]) <= float(live[Stat.nonfinite])
        finite = not check_finite(run.model)
        if run.dist.is_main and finite and (bool(run.stop) or not nothing):
            save_checkpoint(_checkpoint_state(run, run.train_loader.epoch, live), run.run_dir / "last.pt")
        run.stop_saved = finite  # what a signal's stop reports
    return halt


def _end_epoch(run: Run, ep: EpochStats, done: int) -> None:
    """Evaluate (when due), then write the metrics row, checkpoints, TensorBoard scalars and maps."""
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
    is_best = "val_acc" in row and not check_finite(row["val_loss"]) and row["val_acc"] > run.best_acc
    if is_best:
        run.best_acc = row["val_acc"]
    row["best_val_acc"] = run.best_acc
    run.history.append(row)
    if run.dist.is_main:
        _commit_epoch(run, row, done, is_best)
    for hook in run.hooks["epoch_end"]:  # every rank's (each holds the same, reduced row)
        hook(run, done, row)
    if run.dist.is_main:
        run.say(_epoch_line(run, ep, row, done))


def _commit_epoch(run: Run, row: Dict[str, Any], done: int, is_best: bool) -> None:
    """Rank 0's writes at an epoch's end: the metrics row, the checkpoints, the TensorBoard scalars and maps.
    last.pt goes last: it commits the epoch. A crash before it redoes the epoch on resume, which first drops the
    metrics rows past the checkpoint, so no row is lost or written twice."""
    with open(run.run_dir / "metrics.jsonl", "a") as f:
        f.write(metrics_line(row, run.say) + "\n")
    run.train_loader.set_epoch(done)
    state = _checkpoint_state(run, done, None)
    if is_best:
        save_checkpoint(state, run.run_dir / "best.pt")
    save_checkpoint(state, run.run_dir / "last.pt")
    if run.writer is not None:
        _log_scalars(run, row, done)


def _advance_bar(run: Run, step: int) -> None:
    if run.bar is not None:
        run.bar.update(1)


# ---------------------------------------------- building the run: folder, model, init_from, teacher, optimization


def _resume_path(cfg: Config, run_dir: Path) -> Optional[Path]:
    existing = next((p for p in (run_dir, *run_dir.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"run_dir {str(run_dir)!r}: {str(existing)!r} is a file, not a folder")
    if cfg.resume is None:
        check_new_run_dir(run_dir)
        return None
    if run_dir.is_dir():
        check_not_project(run_dir)
    if cfg.resume == "auto":
        p = run_dir / "last.pt"
        if p.is_dir():
            raise CheckpointError(f"resume=auto: {str(p)!r} is a folder, not a checkpoint file")
        if p.exists():
            return p
        check_auto_start(run_dir)
        return None
    p = Path(cfg.resume)
    if p.is_dir():
        raise CheckpointError(f"resume: {cfg.resume!r} is a folder; give a checkpoint file (e.g. its last.pt) or resume=auto")
    if not p.is_file():
        raise CheckpointError(f"resume: checkpoint {cfg.resume!r} not found")
    return p


def _check_model_options(cfg: Config, fresh: bool = True) -> None:
    """Build the model once on the meta device (no memory, no data): bad options fail before any data is read.
    A resumed run (``fresh=False``) holds its weights in the checkpoint: its ``model.pretrained_file`` is not
    read (it may be gone or replaced since), as :func:`_build_model` does not read it."""
    try:
        with torch.device("meta"):
            model = from_config(cfg, weights=fresh)
    except NotImplementedError:  # a constructor that reads tensor values cannot run on the meta device
        return
    except (ValueError, TypeError, RuntimeError) as e:
        raise ConfigError(f"model: {str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__}") from None
    n = sum(p.numel() for p in model.parameters())
    if n > MAX_PARAMETERS:
        raise ConfigError(f"model: these options build {n:,} parameters; the limit is {MAX_PARAMETERS:,}")


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


def _check_forward(run: Run) -> None:
    """One training image through the model (eval mode, no gradient) before anything is written: a model that
    cannot take this data's images (a ViT built for 32x32 with data.image_size=48) is one line, not a traceback
    at the first step after the run folder was filled."""
    x = torch.from_numpy(run.splits.train.x[:1]).permute(0, 3, 1, 2)
    x = normalize(x, run.cfg.data.mean, run.cfg.data.std).to(run.device)
    training = run.model.training
    run.model.eval()
    try:
        with torch.no_grad():
            run.model(x)
    except (ValueError, RuntimeError, TypeError, AssertionError) as e:
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else e.__class__.__name__
        raise ConfigError(f"model {run.cfg.model.name!r} cannot take this data's {x.shape[2]}x{x.shape[3]} images "
                          f"(data.image_size={run.cfg.data.image_size}): {why}") from None
    finally:
        run.model.train(training)


def _check_init_folder(cfg: Config, run_dir: Path) -> None:
    src = cfg.model.init_from
    if src and Path(src).resolve().parent == run_dir.resolve():
        raise ConfigError(f"model.init_from: {src} is in run_dir {str(run_dir)!r}; a run started from a checkpoint "
                          "gets a folder of its own (run_dir=NEW; resume=auto continues the run itself)")


def _init_from(cfg: Config, model: nn.Module, splits: Splits, say: Callable[..., None]) -> Dict[str, Any]:
    """``model.init_from``: load a checkpoint's weights into ``model`` before the optimizer, schedule and EMA are
    built from it: the EMA weights where the checkpoint kept them (the weights it was evaluated with), else its
    model weights. Every weight of the checkpoint must land, and only attention blocks the checkpoint does not
    hold start fresh; anything else is one :class:`CheckpointError` line naming the keys. The loaded weights
    replace the ones the model was built with, a whitening stem's data-computed ones included. Returns the
    origin that ``run_info.json`` records."""
    path = cfg.model.init_from
    state = load_checkpoint(path, map_location="cpu")
    if not isinstance(state["config"], dict):
        raise CheckpointError(f"model.init_from: {path}: its config entry is a {type(state['config']).__name__}")
    _check_same_data(f"model.init_from: {path}", cfg, state, splits, SPLIT_MUST_MATCH,
                     "the run must hold out the same validation images, or it is scored on images its weights saw")
    weights, kind = state["model"], "model"
    ema = state.get("ema")
    if isinstance(ema, dict) and any(k.startswith("module.") for k in ema):
        weights, kind = {k[len("module."):]: v for k, v in ema.items() if k.startswith("module.")}, "EMA"
    if not isinstance(weights, dict):
        raise CheckpointError(f"model.init_from: {path}: its {kind} entry is a {type(weights).__name__}, not weights")
    try:
        check_sites(model, list(weights), f"model.init_from: {path}")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    own = model.state_dict()
    weights, moved = _into_wrapped(model, weights, own)
    new = [p for p, m in model.named_modules() if p and is_attention_block(m)  # blocks with state, none of it held
           and any(k.startswith(p + ".") for k in own) and not any(k.startswith(p + ".") for k in weights)]
    unused = [k for k in weights if k not in own]
    missing = [k for k in own if k not in weights and not any(k.startswith(b + ".") for b in new)]
    shapes = [f"{k} {list(weights[k].shape)} vs {list(own[k].shape)}" for k in weights
              if k in own and getattr(weights[k], "shape", None) != own[k].shape]

    def keys(ks: List[str]) -> str:
        return ", ".join(ks[:3]) + (f" and {len(ks) - 3} more" if len(ks) > 3 else "")

    problems = ([f"its {keys(unused)} have no place in this model"] if unused else []) + \
        ([f"this model's {keys(missing)} are not in it (only new attention blocks may start fresh)"] if missing else []) + \
        ([f"shapes differ: {keys(shapes)}"] if shapes else [])
    if problems:
        raise CheckpointError(f"model.init_from: {path} does not fit model {cfg.model.name!r}: {'; '.join(problems)}")
    model.load_state_dict(weights, strict=False)
    origin = {"path": str(Path(path).resolve()), "epoch": int(state["epoch"]), "best_acc": state.get("best_acc"),
              "weights": kind, "new_blocks": new, "wrapped": moved}
    say(f"model.init_from: {path} (epoch {origin['epoch']}, best val acc {origin['best_acc']}): its {kind} weights; "
        + (f"new, starting fresh: {keys(new)}" if new else "no new blocks")
        + (f"; the weights of {keys(moved)}, which a block now follows, load as their .inner ones" if moved else ""))
    return origin


def _into_wrapped(model: nn.Module, weights: Dict[str, Any], own: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """A checkpoint's weights under the names they take in ``model``, where a block was put after a module since
    the checkpoint was trained: ``model.attn_at`` wraps module ``X`` as ``AttnAfter(inner=X, attn=block)``
    (``X.weight`` becomes ``X.inner.weight``), a torchvision ResNet's last BN becomes ``bnX.norm``. Only a
    checkpoint key this model lacks, whose wrapped name it has, is renamed. Returns (weights, the modules renamed)."""
    moves = []  # ("X.", "X.inner."): a module holding a block named "attn" and the module it follows
    for path, m in model.named_modules():
        kids = dict(m.named_children())
        if path and len(kids) == 2 and "attn" in kids and is_attention_block(kids["attn"]):
            other = next(n for n in kids if n != "attn")
            moves.append((f"{path}.", f"{path}.{other}."))
    if not moves:
        return weights, []
    out, moved = {}, []
    for k, v in weights.items():
        if k not in own:
            for pre, inner in moves:
                if k.startswith(pre) and not k.startswith((inner, f"{pre}attn.")) and inner + k[len(pre):] in own:
                    k = inner + k[len(pre):]
                    if pre[:-1] not in moved:
                        moved.append(pre[:-1])
                    break
        out[k] = v
    return out, moved


def _pretrained(model: nn.Module, say: Callable[..., None]) -> Optional[Dict[str, Any]]:
    """A ``model.pretrained_file`` the builder loaded (a timm / torchvision model): said, and returned as the
    run's origin, whose step-0 score :func:`fit` adds; None for a model built without one."""
    loaded = getattr(model, "pretrained_origin", None)
    if not loaded:
        return None
    replaced, entry, others = loaded["replaced"], loaded.get("entry"), loaded.get("other_entries") or []
    where = ""
    if entry is not None:  # a timm checkpoint: which of its weight entries was taken
        where = f" (its {entry} entry" + (", the EMA weights" if entry == "state_dict_ema" else "") \
            + (f"; it also holds {', '.join(others)}, not used" if others else "") + ")"
    say(f"model.pretrained_file: {loaded['path']}{where}: {loaded['tensors']} tensors loaded"
        + (f"; its classifier ({', '.join(replaced)}) has another class count ({loaded.get('file_classes')} classes, "
           f"this run's {loaded.get('num_classes')}): replaced by a fresh one" if replaced else ""))
    return {"path": loaded["path"], "epoch": None, "best_acc": None, "weights": "pretrained_file",
            "new_blocks": [], "replaced": replaced, "entry": entry, "other_entries": others}


def _data_key(k: str) -> str:
    return k if k == "seed" else f"data.{k}"


def load_teacher(distill: DistillConfig, device: torch.device, channels_last: bool = False
                 ) -> Tuple[Distill, Config, dict]:
    """``distill``'s teacher (a :class:`DistillConfig` whose ``teacher`` names a checkpoint) as an
    :class:`Distill`: the checkpoint's model (its EMA weights where it kept them), frozen, in eval mode, in
    ``channels_last`` where asked; with the teacher's config and the checkpoint's state, to check them against a
    run's. Checks nothing itself: :func:`_build_teacher` does, for a training run."""
    from .evaluate import load_model_from_checkpoint

    path = Path(distill.teacher)
    if not path.is_file():
        raise ConfigError(f"train.distill.teacher: {distill.teacher} is not a checkpoint file (give a run's last.pt)")
    teacher, tcfg, state = load_model_from_checkpoint(str(path), device)
    teacher.requires_grad_(False)
    if channels_last:
        to_channels_last(teacher, device)
    return Distill(teacher.eval(), distill.weight, distill.temperature, distill.kind), tcfg, state


def _check_same_data(what: str, cfg: Config, state: Dict[str, Any], splits: Splits, keys: Tuple[str, ...],
                     why: str) -> None:
    """Refuse a checkpoint (``what``: the key and its path) trained with other ``data`` ``keys`` than this run
    (read from its stored config, with today's defaults for keys it predates), or on other classes."""
    other = with_defaults(state["config"])
    ours, theirs = cfg.data.model_dump(mode="json"), other["data"]
    differ = [k for k in keys if ours[k] != theirs[k]]
    if ours["source"] == "synthetic":  # synthetic images are drawn from the run's seed and size: other ones
        differ += [k for k in ("synthetic_size",) if ours[k] != theirs[k]]
        if other["seed"] != cfg.seed:
            ours, theirs = {**ours, "seed": cfg.seed}, {**theirs, "seed": other["seed"]}
            differ.append("seed")
    elif Path(ours["root"]).name != Path(theirs["root"]).name:
        differ.append("root")
    if differ:
        raise ConfigError(f"{what} was trained with other data settings "
                          f"({', '.join(f'{_data_key(k)}: {theirs[k]!r}, here {ours[k]!r}' for k in differ)}); {why}")
    classes = list(state.get("classes") or [])
    if classes and classes != list(splits.train.classes):
        raise ConfigError(f"{what} predicts other classes ({classes[:3]}...) than this run's "
                          f"({list(splits.train.classes)[:3]}...)")


def _build_teacher(cfg: Config, splits: Splits, device: torch.device,
                   say: Callable[..., None]) -> Optional[Distill]:
    """``train.distill``'s teacher (:func:`load_teacher`), refused where its data settings would leak this run's
    evaluation images or feed it other inputs."""
    d = cfg.train.distill
    if d.teacher is None:
        return None
    distill, tcfg, state = load_teacher(d, device, cfg.channels_last)
    _check_same_data(f"train.distill.teacher: {d.teacher}", cfg, state, splits, TEACHER_MUST_MATCH,
                     "a teacher must hold out the same validation images and see the same inputs")
    n = sum(p.numel() for p in distill.teacher.parameters())
    say(f"distilling from {d.teacher} ({tcfg.model.name}, {n / 1e6:.2f}M parameters, trained {state.get('epoch', '?')} "
        f"epochs): {d.kind}, weight {d.weight:g}" + (f", temperature {d.temperature:g}" if d.kind == "soft" else ""))
    return distill


def bn_lag_note(model: nn.Module, total_steps: int, weight: float = 0.05) -> Optional[str]:
    """A note when the model's BatchNorms update their running statistics so slowly (``momentum``) that at the
    end of ``total_steps`` those statistics, which evaluation uses, still give the first half of training more
    than ``weight`` of their sum: a short run of a model built for long ones (torchvision's MobileNetV3 at 0.01
    over 4 CIFAR epochs scores at chance in eval mode). ``None`` where they keep up."""
    slowest = min((m.momentum for m in backbone_modules(model)
                   if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
                   and m.momentum is not None), default=None)
    if slowest is None or not 0 < slowest < 1:
        return None
    held = (1 - slowest) ** (total_steps / 2)
    if held <= weight:
        return None
    return (f"note: the model's BatchNorm momentum is {slowest:g}: after this run's {total_steps} steps the running "
            f"statistics evaluation uses would still weigh the first half of training at {held:.0%}, so eval-mode "
            "accuracy can trail training far; set model.bn_momentum=0.1 (package models) or train longer")


def _build_optimization(cfg: Config, model: nn.Module, steps_per_epoch: int, device: torch.device,
                        precision: str) -> Optimization:
    o = cfg.optim
    optimizer = build_optimizer(model, o.name, o.lr, o.weight_decay, o.momentum, o.nesterov, o.betas,
                                o.no_decay_norm_bias, o.norm_bias_lr_scale, attn_lr_scale=o.attn_lr_scale)
    total = steps_per_epoch * cfg.train.epochs
    scheduler = _schedule(cfg, optimizer, steps_per_epoch)
    t = cfg.train
    if t.lookahead_every > total:  # its slow copy, put into the model at the end, would be the initial weights
        raise ConfigError(f"train.lookahead_every={t.lookahead_every} is longer than the run's {total} steps "
                          f"({cfg.train.epochs} epochs of {steps_per_epoch} steps): the averaged weights that replace the "
                          "model's at the end would be its initial ones; give at most the run's steps, or 0 (off)")
    lookahead = Lookahead(model, total, t.lookahead_every, t.lookahead_decay, t.lookahead_power) \
        if t.lookahead_every else None
    ema = None
    if cfg.train.ema_decay:
        from timm.utils import ModelEmaV3

        ema = ModelEmaV3(model, decay=cfg.train.ema_decay, use_warmup=cfg.train.ema_warmup)
    return Optimization(optimizer, scheduler, make_scaler(device, precision), ema, o.grad_clip, lookahead)


def _schedule(cfg: Config, optimizer: torch.optim.Optimizer, steps_per_epoch: int) -> StepScheduler:
    s = cfg.sched
    return StepScheduler(optimizer, s.name, cfg.optim.lr, steps_per_epoch * cfg.train.epochs,
                                int(round(s.warmup_epochs * steps_per_epoch)), s.min_lr_ratio, s.anneal, s.start_lr_ratio)


# -------------------------------------------------------------------------------------- optimizer, schedule, loss


def make_scaler(device: torch.device, precision: str) -> Optional[torch.amp.GradScaler]:
    """fp16 needs loss scaling (its range is narrow); bf16 and fp32 do not."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def build_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float, momentum: float = 0.9,
                    nesterov: bool = True, betas: Sequence[float] = (0.9, 0.999),
                    no_decay_norm_bias: bool = True, norm_bias_lr_scale: float = 1.0,
                    native_bf16: Optional[bool] = None, attn_lr_scale: float = 1.0) -> torch.optim.Optimizer:
    """SGD (Nesterov by default), AdamW or Muon through timm's ``create_optimizer_v2``.

    Muon (timm's ``Muon``, Jordan et al. 2024) orthogonalises the momentum of every weight matrix and
    convolution filter bank (``momentum``, Nesterov with ``nesterov``); its step is scaled to AdamW's update
    size, so ``lr`` means what it means for AdamW. The classifier (``head``, ``fc``, ``classifier``), 1-d
    parameters and those in ``no_weight_decay()`` (positional embeddings, class token) go to its AdamW
    fallback with ``betas``. Where the CPU emulates bf16 (:func:`cpu_has_native_bf16`), its Newton-Schulz
    iterations run in fp32 instead of timm's bf16 (about 30x faster there); ``native_bf16`` says whether bf16 is
    native where the model lies (``None``: asked of the model's device).

    With ``no_decay_norm_bias`` (the default) norm weights, biases (all 1-d tensors) and every parameter the
    model lists in ``no_weight_decay()`` (a ViT's ``pos_embed`` and ``cls_token``) get no weight decay.
    ``norm_bias_lr_scale`` puts the biases of the norm layers in a group of their own whose learning rate is
    that many times ``lr`` (airbench trains BatchNorm biases 64x faster); the schedulers honour it. That rule
    is the backbone's: the norms inside attention blocks train at ``lr``. ``attn_lr_scale`` does the same for
    every parameter of the attention blocks (:func:`~visattn.registry.is_attention_block`, their own norms
    included): a block inserted into a network trains at that many times the network's rate. At 1 (the default)
    the groups are timm's own, so a checkpoint saved without these options resumes unchanged.
    """
    from timm.optim import create_optimizer_v2

    kwargs: Dict[str, Any] = {}
    if name == "sgd":
        opt = "sgd" if nesterov and momentum > 0 else "momentum"  # timm: "sgd" is Nesterov, "momentum" is not
        kwargs["momentum"] = momentum
    elif name == "adamw":
        opt = "adamw"
        kwargs["betas"] = tuple(betas)
    elif name == "muon":
        opt = "muon"
        kwargs.update(momentum=momentum, nesterov=nesterov, betas=tuple(betas), fallback_list=MUON_FALLBACK,
                      fallback_no_weight_decay=True)
    else:
        raise ConfigError(f"optim.name: unknown optimizer {name!r}; valid: sgd, adamw, muon")
    params: Any = model
    if norm_bias_lr_scale != 1.0 or attn_lr_scale != 1.0:  # groups made here: they carry Muon's fallback marks
        params = _scaled_groups(model, weight_decay, no_decay_norm_bias, norm_bias_lr_scale, attn_lr_scale,
                                MUON_FALLBACK if name == "muon" else ())
    optimizer = create_optimizer_v2(params, opt=opt, lr=lr, weight_decay=weight_decay,
                                    filter_bias_and_bn=no_decay_norm_bias, **kwargs)
    if name == "muon" and not (_native_bf16_for(model) if native_bf16 is None else native_bf16):
        _newton_schulz_in_fp32(optimizer)
    return optimizer


def _native_bf16_for(model: nn.Module) -> bool:
    p = next(model.parameters(), None)
    return p is None or p.device.type != "cpu" or cpu_has_native_bf16()


def _newton_schulz_in_fp32(optimizer: torch.optim.Optimizer) -> None:
    """Run this Muon instance's Newton-Schulz iterations in fp32: timm's module-level function defaults to bf16,
    which CPUs without AMX or AVX512-BF16 emulate. The swap lasts only for this optimizer's ``step``."""
    import timm.optim.muon as muon

    step, ns = type(optimizer).step, muon.zeropower_via_newtonschulz

    def step_fp32(self: torch.optim.Optimizer, *args: Any, **kw: Any) -> Any:
        muon.zeropower_via_newtonschulz = functools.partial(ns, dtype=torch.float32)
        try:
            return step(self, *args, **kw)
        finally:
            muon.zeropower_via_newtonschulz = ns

    # a bound method, as torch's LR schedulers expect when they wrap ``step``
    optimizer.step = types.MethodType(step_fp32, optimizer)  # type: ignore[method-assign]


def _scaled_groups(model: nn.Module, weight_decay: float, no_decay_1d: bool, norm_bias_scale: float = 1.0,
                   attn_scale: float = 1.0, fallback: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """timm's weight-decay groups (as ``create_optimizer_v2`` makes them from a model), each split, in this order,
    into the rest, the backbone's norm biases (``lr_scale=norm_bias_scale``) and the attention blocks' parameters
    (``lr_scale=attn_scale``). A part splits off only where its scale is not 1 and empty parts are left out, so
    the groups are those a checkpoint saved before ``attn_scale`` existed was built with. A
    block's own norms are the block's (``attn_scale``), not the backbone's. ``fallback``: Muon's AdamW patterns
    (:data:`MUON_FALLBACK`); their groups are marked ``use_fallback``, as timm marks them, since Muon cannot read
    names from param groups."""
    from timm.optim import param_groups_weight_decay

    norm_types = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    norm_biases = {id(m.bias) for m in backbone_modules(model) if isinstance(m, norm_types) and m.bias is not None
                   } if norm_bias_scale != 1.0 else set()
    in_blocks = {id(p) for m in model.modules() if is_attention_block(m) for p in m.parameters()
                 } if attn_scale != 1.0 else set()
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    groups = param_groups_weight_decay(model, weight_decay, weight_decay_exclude_1d=no_decay_1d,
                                       no_weight_decay_list=skip, fallback_list=fallback,
                                       fallback_no_weight_decay=bool(fallback))
    out = []
    for g in groups:
        parts = ([p for p in g["params"] if id(p) not in norm_biases and id(p) not in in_blocks], None), \
                ([p for p in g["params"] if id(p) in norm_biases], norm_bias_scale), \
                ([p for p in g["params"] if id(p) in in_blocks], attn_scale)
        out += [dict(g, params=ps, **({} if scale is None else {"lr_scale": scale})) for ps, scale in parts if ps]
    return out


class StepScheduler:
    """One interface, stepped once per optimizer step, over torch's OneCycleLR and timm's cosine schedule."""

    def __init__(self, optimizer: torch.optim.Optimizer, name: str, lr: float, total_steps: int, warmup_steps: int,
                 min_lr_ratio: float = 0.0, anneal: str = "linear", start_lr_ratio: float = 0.04):
        self.name = name
        self.num_updates = 0
        self.inner: Any = None
        if name == "onecycle":
            # OneCycleLR divides by each phase's length in steps: keep both phases at least 1 step long
            total = max(total_steps, 4)
            pct = min(max(warmup_steps, 2), total - 2) / total
            # each group peaks at lr times its "lr_scale" (e.g. BN biases at a higher rate), starting from
            # start_lr_ratio of that, ending at min_lr_ratio of it (about 0 when min_lr_ratio is 0)
            max_lr = [lr * g.get("lr_scale", 1.0) for g in optimizer.param_groups]
            self.inner = torch.optim.lr_scheduler.OneCycleLR(
                optimizer, max_lr=max_lr, total_steps=total, pct_start=pct, anneal_strategy=anneal,
                cycle_momentum=False, div_factor=1.0 / start_lr_ratio,
                final_div_factor=start_lr_ratio / max(min_lr_ratio, 1e-4) if min_lr_ratio else 1e4,
            )
        elif name == "cosine":
            from timm.scheduler import CosineLRScheduler

            self.inner = CosineLRScheduler(
                optimizer, t_initial=max(total_steps - warmup_steps, 1), lr_min=lr * min_lr_ratio,
                warmup_t=warmup_steps, warmup_lr_init=lr * 0.01, warmup_prefix=True, t_in_epochs=False,
            )
        elif name == "constant":
            for g in optimizer.param_groups:  # as the other two: each group at lr times its "lr_scale"
                g["lr"] = lr * g.get("lr_scale", 1.0)
        else:
            raise ConfigError(f"sched.name: unknown schedule {name!r}; valid: onecycle, cosine, constant")

    def step(self) -> None:
        self.num_updates += 1
        if self.name == "onecycle":
            if self.inner.last_epoch + 1 < self.inner.total_steps:
                with warnings.catch_warnings():  # an fp16 step skipped by the scaler is not a misordered call
                    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
                    self.inner.step()
        elif self.name == "cosine":
            self.inner.step_update(self.num_updates)

    def state_dict(self) -> Dict[str, Any]:
        return {"num_updates": self.num_updates, "inner": self.inner.state_dict() if self.inner is not None else {}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.num_updates = int(state["num_updates"])
        if self.inner is not None:
            self.inner.load_state_dict(state["inner"])


class Lookahead:
    """Lookahead-style weight averaging on a cubic schedule (airbench94; Zhang et al. 2019, arXiv 1907.08610).

    Every ``every`` steps the slow copy moves toward the fast weights, ``slow = a * slow + (1 - a) * fast``,
    and the fast weights are reset to it, with ``a = decay ** every * (step / total_steps) ** power``: no
    averaging early, strong averaging at the end. :meth:`finish` puts the slow weights into the model after
    the last step. Float parameters and buffers (BN running statistics) take part; integer buffers do not.
    """

    def __init__(self, model: nn.Module, total_steps: int, every: int = 5, decay: float = 0.95, power: float = 3.0):
        self.total_steps, self.every, self.decay, self.power = max(total_steps, 1), every, decay, power
        self.fast = [t for t in model.state_dict().values() if t.is_floating_point()]  # share the model's storage
        self.slow = [t.detach().clone() for t in self.fast]

    @torch.no_grad()
    def step(self, global_step: int) -> None:
        if global_step % self.every:
            return
        a = self.decay ** self.every * min(global_step / self.total_steps, 1.0) ** self.power
        torch._foreach_lerp_(self.slow, self.fast, 1.0 - a)
        torch._foreach_copy_(self.fast, self.slow)

    @torch.no_grad()
    def finish(self) -> None:
        torch._foreach_copy_(self.fast, self.slow)

    def state_dict(self) -> Dict[str, Any]:
        return {"slow": [t.clone() for t in self.slow]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for t, saved in zip(self.slow, state["slow"]):
            t.copy_(saved)


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, kind: str = "soft",
                 temperature: float = 1.0) -> torch.Tensor:
    """The distillation term: ``soft``, KL(teacher || student) of the softmaxes at ``temperature``, times
    ``temperature**2`` so its gradients keep their size as the temperature changes (Hinton et al. 2015);
    ``hard``, cross-entropy against the teacher's top class (DeiT). Both in fp32, mean over the batch."""
    student, teacher = student.float(), teacher.float()
    if kind == "hard":
        return F.cross_entropy(student, teacher.argmax(1))
    if kind != "soft":
        raise ConfigError(f"train.distill.kind: unknown kind {kind!r}; valid: soft, hard")
    t = temperature
    return F.kl_div(F.log_softmax(student / t, 1), F.log_softmax(teacher / t, 1), reduction="batchmean",
                    log_target=True) * t * t


def training_loss(logits: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, policy: StepPolicy) -> torch.Tensor:
    """Label-smoothed cross-entropy, mixed with the teacher's distillation term when ``policy.distill``."""
    loss = F.cross_entropy(logits.float(), yb, label_smoothing=policy.label_smoothing)
    d = policy.distill
    if d is None or d.weight == 0:
        return loss
    with torch.no_grad(), autocast(policy.device, policy.precision):
        target = main_logits(d.teacher(xb))
    return (1 - d.weight) * loss + d.weight * distill_loss(logits, target, d.kind, d.temperature)


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
    run.opt.scheduler = _schedule(cfg, run.opt.optimizer, len(run.train_loader))
    for _ in range(done):
        run.opt.scheduler.step()
    run.say(f"resume: train.epochs {old} -> {cfg.train.epochs}: the {cfg.sched.name} schedule is rebuilt for "
            f"{cfg.train.epochs} epochs and goes on from step {done} (lr {was:.3g} -> "
            f"{run.opt.optimizer.param_groups[0]['lr']:.3g}); for a fresh schedule from these weights instead: "
            f"model.init_from={path} run_dir=NEW")


def _check_epochs_left(run: Run, path: Path) -> None:
    """A resume asking for fewer epochs than the checkpoint has trained (or trained into), or for no more steps
    than it has taken (``train.max_steps``), would train nothing and rewrite ``config.yaml`` to that setting: one
    line, before anything is written."""
    epochs, done, into = run.cfg.train.epochs, run.epoch, run.train_loader.position
    if done > epochs or (done == epochs and into > 0):
        what = f"{done} epochs" + (f" and {into} batches of epoch {done + 1}" if into else "")
        raise ConfigError(f"resume: {path} has trained {what}, more than train.epochs={epochs}: nothing would train; "
                          f"give train.epochs={done + (1 if into else 0)} or more (or start a new run from these "
                          f"weights: model.init_from={path} run_dir=NEW)")
    limit = run.cfg.train.max_steps
    if limit is not None and run.step >= limit and done < epochs:
        raise ConfigError(f"resume: {path} has taken {run.step} steps, train.max_steps={limit}: nothing would train; "
                          f"give a larger train.max_steps, or train.max_steps=null to train to train.epochs={epochs}")


def _check_resume_config(state: Dict[str, Any], cfg: Config, path: Path) -> None:
    now = cfg.to_dict()
    stored = with_defaults(state["config"])  # keys newer than the checkpoint: their defaults
    diff = [k for sec in RESUME_MUST_MATCH for k in config_diff({sec: stored.get(sec, {})}, {sec: now[sec]})]
    diff += config_diff({"train": {"distill": stored.get("train", {}).get("distill", {})}},
                        {"train": {"distill": now["train"]["distill"]}})  # a teacher shapes every step's loss
    if diff and not cfg.resume_allow_changes:
        raise CheckpointError(
            f"resume: {path} was trained with different settings for {', '.join(diff)} "
            "(set resume_allow_changes=true to resume anyway)"
        )
    fixed = [k for sec in ("optim", "sched", "train")
             for k in config_diff({sec: stored.get(sec, {})}, {sec: now[sec]}) if k in RESUME_FIXED]
    if fixed:
        raise CheckpointError(f"resume: {path} holds optimizer/schedule/EMA/lookahead state made with other settings "
                              f"for {', '.join(fixed)}, which cannot change on resume (start a new run to "
                              "train with them)")


# ----------------------------------------------------- steps and epochs: statistics, checks, checkpoints, outputs


def host_check_every(policy: StepPolicy) -> int:
    """Steps between the loop's host reads: ``policy.host_every`` where set, else ``policy.check_every`` on a
    GPU (a read waits for the queued steps) and every step on a CPU (reading a finished scalar is free there)."""
    if policy.host_every is not None:
        return policy.host_every
    return 1 if policy.device.type == "cpu" else policy.check_every


def epoch_stats_tensor(carry: Optional[torch.Tensor], position: int, device: torch.device) -> torch.Tensor:
    """The statistics an epoch starts from: zeros, or ``carry`` (a mid-epoch checkpoint's) on ``device``.

    A carry saved before the step count and the finite-image count were kept (5 values) gets them from the
    loader's ``position`` (batches served), taking the non-finite steps' batches as full ones.
    """
    if carry is None:
        return torch.zeros(len(Stat), dtype=torch.float64, device=device)
    carry = carry.to(device).double().flatten()
    if carry.numel() == 5:
        images, nonfinite = float(carry[Stat.images]), float(carry[Stat.nonfinite])
        finite = images * max(position - nonfinite, 0) / position if position else images
        carry = torch.cat([carry, torch.tensor([float(position), finite], dtype=torch.float64, device=device)])
    return carry


def _checkpoint_state(run: Run, epoch: int, position_stats: Optional[torch.Tensor]) -> Dict[str, Any]:
    opt, cfg = run.opt, run.cfg
    return {
        "model": run.model.state_dict(), "optimizer": opt.optimizer.state_dict(), "scheduler": opt.scheduler.state_dict(),
        "scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
        "ema": opt.ema.state_dict() if opt.ema is not None else None,
        "lookahead": opt.lookahead.state_dict() if opt.lookahead is not None else None,
        "rng": rng_state(), "loader": run.train_loader.state_dict(), "epoch": epoch, "step": run.step,
        "epoch_stats": position_stats.cpu() if position_stats is not None else None,
        "best_acc": run.best_acc, "config": cfg.to_dict(), "classes": list(run.splits.train.classes),
        "eval_split": run.splits.eval_split, "versions": versions(), "git": git_revision(), "seed": cfg.seed,
        "teacher_digest": run.teacher_digest,
    }


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


def _log_scalars(run: Run, row: Dict[str, Any], done: int) -> None:
    writer, cfg = run.writer, run.cfg
    for k in EPOCH_SCALARS:
        if k in row:
            tag = k.replace("_", "/", 1) if k.startswith(("train_", "val_")) else f"train/{k}"
            writer.add_scalar("train/lr_epoch" if k == "lr" else tag, row[k], done)
    log_hparam_metrics(writer, row, done)
    if run.probe is not None and cfg.log.maps_every and done % cfg.log.maps_every == 0:
        skipped = run.maps.log(writer, run.eval_model, run.probe, done, row.get("epoch_seconds"))
        if skipped:
            run.say(f"warning: epoch {done}: the attention maps of {', '.join(skipped)} on the probe batch are not "
                    "finite; those pictures were skipped")
    writer.flush()


def _open_outputs(run: Run) -> None:
    """Rank 0: the run folder's config, run info and TensorBoard writer, and the fixed probe batch for maps."""
    cfg, run_dir = run.cfg, run.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml_dump(cfg.to_dict()))
    info = {"seed": cfg.seed, "versions": versions(), "git": git_revision(), "argv": sys.argv,
            "eval_split": run.splits.eval_split, "device": str(run.device), "precision": run.policy.precision,
            "world_size": run.dist.world_size, "parameters": sum(p.numel() for p in run.model.parameters()),
            "classes": list(run.splits.train.classes), "branched_from": _branched_from(run),
            "init_from": run.init_from or _recorded(run, "init_from")}
    (run_dir / "run_info.json").write_text(json.dumps(info, indent=2))
    if run.resume_from is not None or cfg.resume == "auto":  # (a new run under resume=auto: drops a torn line)
        trim_metrics(run_dir / "metrics.jsonl", run.epoch)
    remove_stale_temps(run_dir)  # torn checkpoint writes of a killed run; only under the run folder's lock
    if cfg.log.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        hparams = run_hparams(cfg, run.policy.precision, info["parameters"], run.dist.world_size)
        start_hparams(run_dir / "tb", hparams, run.say)  # the HParams dashboard's row of this run
        run.writer = SummaryWriter(str(run_dir / "tb"), purge_step=run.step if run.resume_from else None)
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
    if run.writer is not None:
        run.writer.close()
        run.writer = None

"""One training step and an epoch's running statistics: what every precision path shares, in one place.

:func:`train_step` is the step: the forward pass under autocast (bf16 or fp16; fp32 without), the loss
(:func:`training_loss`: label smoothing, Szegedy et al. 2015, "Rethinking the Inception Architecture", arXiv
1512.00567; distillation, :mod:`visattn.distill`), then one of three updates: fp16 scales the loss through a
``GradScaler`` that skips a step whose gradients hold inf/NaN (Micikevicius et al. 2017, "Mixed Precision
Training", arXiv 1710.03740; the composition of timm's ``NativeScaler``), bf16 and fp32 back-propagate as they
are, and a step whose loss is not finite is skipped before it touches the weights where the host reads every step
(a CPU). Only public API of torch is used: a skipped fp16 step is the one after which ``GradScaler.get_scale()``
backed off. :class:`EpochMeter` owns an epoch's running totals (:class:`Stat`), kept on the device without host
reads, and gives the epoch's :class:`EpochStats`.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .distill import Distill, distill_loss
from .evaluate import autocast, main_logits
from .optim import Optimization


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


def training_loss(logits: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, policy: StepPolicy) -> torch.Tensor:
    """Label-smoothed cross-entropy, mixed with the teacher's distillation term when ``policy.distill``."""
    loss = F.cross_entropy(logits.float(), yb, label_smoothing=policy.label_smoothing)
    d = policy.distill
    if d is None or d.weight == 0:
        return loss
    with torch.no_grad(), autocast(policy.device, policy.precision):
        target = main_logits(d.teacher(xb))
    return (1 - d.weight) * loss + d.weight * distill_loss(logits, target, d.kind, d.temperature)


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


@dataclass
class StepResult:
    """What a step left: its loss (detached), logits, whether the loss was finite (a 0-d bool tensor, not read
    on the host), whether the optimizer and schedule stepped, and whether fp16's scaler skipped the update."""

    loss: torch.Tensor
    logits: torch.Tensor
    finite: torch.Tensor
    applied: bool
    scaler_skipped: bool = False


def train_step(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor, opt: Optimization, policy: StepPolicy,
               check_every: int = 1) -> StepResult:
    """One optimizer step of ``model`` on ``(xb, yb)``, in ``policy.precision``. ``check_every``: the loop's steps
    between host reads (:func:`host_check_every`); at 1, a non-finite loss is skipped before the backward pass."""
    with autocast(policy.device, policy.precision):
        logits = main_logits(model(xb))  # a tuple of (logits, aux logits): the main logits
    loss = training_loss(logits, xb, yb, policy)
    opt.optimizer.zero_grad(set_to_none=True)
    finite = torch.isfinite(loss.detach())
    skipped, applied = False, True
    if opt.scaler is not None:  # fp16: the scaler skips a step whose gradients hold inf/NaN, inside its step
        skipped = scaled_update(loss, model, opt)
    elif skip_before_update(finite, check_every, policy.reduce):
        applied = False
    else:
        loss.backward()
        clip_gradients(model, opt)
        opt.optimizer.step()
    if applied:
        opt.scheduler.step()
    return StepResult(loss.detach(), logits, finite, applied, skipped)


def scaled_update(loss: torch.Tensor, model: nn.Module, opt: Optimization) -> bool:
    """fp16's update through ``opt.scaler`` (backward of the scaled loss, gradients unscaled before clipping, the
    scaler's step and update). Returns whether the scaler skipped the step: its scale backs off exactly then."""
    scaler = opt.scaler
    scaler.scale(loss).backward()
    if opt.grad_clip:
        scaler.unscale_(opt.optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
    before = scaler.get_scale()
    scaler.step(opt.optimizer)
    scaler.update()
    return scaler.get_scale() < before


def clip_gradients(model: nn.Module, opt: Optimization) -> None:
    if opt.grad_clip:
        nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)


def skip_before_update(finite: torch.Tensor, check_every: int,
                       reduce: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> bool:
    """Whether a step is skipped before its backward pass: only where the host reads every step (a CPU), when
    the loss is not finite; under data parallelism every rank skips when any rank's loss is not finite. On a GPU
    (reads every ``check_every`` steps) the step goes ahead and the loop's periodic check counts it."""
    return check_every == 1 and not all_finite(finite, reduce)


def all_finite(finite: torch.Tensor, reduce: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> bool:
    """Whether this rank's loss, and under data parallelism (``reduce``) every rank's, is finite (a host read)."""
    return bool(finite) if reduce is None else bool(reduce((~finite).float()) == 0)


class EpochMeter:
    """An epoch's running totals (:class:`Stat`), one float64 tensor on the device added to in place at every step
    without a host read (``totals``, which mid-epoch checkpoints save as ``epoch_stats``), and the current run of
    non-finite losses. ``carry``: a partly done epoch's totals from a mid-epoch checkpoint, at loader
    ``position``; the epoch's :class:`EpochStats` count this meter's own steps apart (``new_*``)."""

    def __init__(self, device: torch.device, carry: Optional[torch.Tensor] = None, position: int = 0) -> None:
        self.totals = epoch_stats_tensor(carry, position, device)
        self.start = self.totals.clone()  # this meter's own part is ``totals - start``
        self.zero = torch.zeros((), dtype=torch.float64, device=device)
        self.consecutive = torch.zeros((), dtype=torch.int64, device=device)  # the current run of non-finite losses

    def add(self, step: StepResult, yb: torch.Tensor) -> None:
        """Count one step on labels ``yb``: its images, and its loss and correct answers where the loss was finite."""
        zero, finite = self.zero, step.finite
        with torch.no_grad():
            n = zero + yb.shape[0]
            added = {Stat.loss_sum: torch.where(finite, step.loss.double() * n, zero),
                     Stat.correct: torch.where(finite, (step.logits.argmax(1) == yb).sum().double(), zero),
                     Stat.images: n, Stat.nonfinite: (~finite).double(),
                     Stat.scaler_skipped: zero + float(step.scaler_skipped),
                     Stat.steps: zero + 1, Stat.finite_images: torch.where(finite, n, zero)}
            self.totals += torch.stack([added[k] for k in Stat])
        self.consecutive = torch.where(finite, torch.zeros_like(self.consecutive), self.consecutive + 1)

    def consecutive_nonfinite(self) -> int:
        return int(self.consecutive)

    def mean_loss(self) -> float:
        """The mean loss over the epoch's finite steps so far (a host read)."""
        return float(self.totals[Stat.loss_sum] / self.totals[Stat.finite_images])

    def result(self, reduce: Optional[Callable[[torch.Tensor], torch.Tensor]], t0: float) -> EpochStats:
        """The epoch's :class:`EpochStats` (summed over ranks by ``reduce``), timed from ``t0`` to after the host
        read, which on a GPU waits for the epoch's queued steps."""
        both = torch.cat([self.totals, self.totals - self.start])
        total: List[float] = (reduce(both) if reduce is not None else both).tolist()
        seconds = time.perf_counter() - t0
        return EpochStats.of(total[: len(Stat)], total[len(Stat):], seconds)


def nothing_learned(totals: torch.Tensor) -> bool:
    """Whether every step counted in ``totals`` (an epoch's so far) had a non-finite loss (a host read)."""
    return 0 < float(totals[Stat.steps]) <= float(totals[Stat.nonfinite])

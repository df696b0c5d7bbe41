"""Knowledge distillation: a frozen teacher's logits on each training batch join the student's loss.

``soft``: KL(teacher || student) of the softmaxes at a temperature, times its square (Hinton, Vinyals & Dean
2015, "Distilling the Knowledge in a Neural Network", arXiv 1503.02531); ``hard``: cross-entropy against the
teacher's top class (Touvron et al. 2021, "Training data-efficient image transformers & distillation through
attention" (DeiT), arXiv 2012.12877). The teacher is a visattn checkpoint (:func:`load_teacher`), refused where
it held out other validation images or was fed other inputs (:func:`build_teacher`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import Config, DistillConfig
from .data import Splits
from .errors import ConfigError
from .evaluate import load_model_from_checkpoint
from .models.layout import to_channels_last
from .models.starting import SPLIT_MUST_MATCH, check_same_data

# data settings a teacher must share with the student: the held-out split (or the teacher saw the images the
# student is scored on) and the input the teacher is fed (the student's normalised batches)
TEACHER_MUST_MATCH = SPLIT_MUST_MATCH + ("image_size", "mean", "std")


@dataclass
class Distill:
    """A frozen teacher whose logits on each training batch join the loss (:func:`distill_loss`)."""

    teacher: nn.Module
    weight: float = 0.5
    temperature: float = 1.0
    kind: str = "soft"


def load_teacher(distill: DistillConfig, device: torch.device, channels_last: bool = False
                 ) -> Tuple[Distill, Config, dict]:
    """``distill``'s teacher (a :class:`DistillConfig` whose ``teacher`` names a checkpoint) as an
    :class:`Distill`: the checkpoint's model (its EMA weights where it kept them), frozen, in eval mode, in
    ``channels_last`` where asked; with the teacher's config and the checkpoint's state, to check them against a
    run's. Checks nothing itself: :func:`build_teacher` does, for a training run."""
    path = Path(distill.teacher)
    if not path.is_file():
        raise ConfigError(f"train.distill.teacher: {distill.teacher} is not a checkpoint file (give a run's last.pt)")
    teacher, tcfg, state = load_model_from_checkpoint(str(path), device)
    teacher.requires_grad_(False)
    if channels_last:
        to_channels_last(teacher, device)
    return Distill(teacher.eval(), distill.weight, distill.temperature, distill.kind), tcfg, state


def build_teacher(cfg: Config, splits: Splits, device: torch.device,
                   say: Callable[..., None]) -> Optional[Distill]:
    """``train.distill``'s teacher (:func:`load_teacher`), refused where its data settings would leak this run's
    evaluation images or feed it other inputs."""
    d = cfg.train.distill
    if d.teacher is None:
        return None
    distill, tcfg, state = load_teacher(d, device, cfg.channels_last)
    check_same_data(f"train.distill.teacher: {d.teacher}", cfg, state, splits, TEACHER_MUST_MATCH,
                     "a teacher must hold out the same validation images and see the same inputs")
    n = sum(p.numel() for p in distill.teacher.parameters())
    say(f"distilling from {d.teacher} ({tcfg.model.name}, {n / 1e6:.2f}M parameters, trained {state.get('epoch', '?')} "
        f"epochs): {d.kind}, weight {d.weight:g}" + (f", temperature {d.temperature:g}" if d.kind == "soft" else ""))
    return distill


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

"""Every check of config fields against each other, in one table (:data:`CROSS_CHECKS`): values valid alone but not
together are one line, exit 2, before anything is written.

Each entry names the fields it compares, the stage at which it can be made, where it is made and the words of its
refusal. The checks of the ``run`` stage are defined here and :func:`check_for_training` makes them all, in the
table's order, before a training run builds anything; a stored config (a checkpoint's, read by ``evaluate`` and
``visualize``) may hold such values, so they are not the schema's. The others must stay where what they compare
exists, and the table names them there: ``schema`` (every config as it loads: :mod:`visattn.config`, a leaf that
imports no other part of visattn), ``model`` (the built model: its patches, its forward), ``data`` (the images
and classes the data holds) and ``steps`` (the steps per epoch the loader makes). To add a check of the ``run``
stage, add its function and its row here; of another stage, its row here and the check where its values are
(``tests/test_hostile_more.py`` holds every row to the code it names).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from .config import MIN_TEMPERATURE, Config
from .errors import ConfigError

__all__ = ["CROSS_CHECKS", "STAGES", "CrossCheck", "check_for_training"]

STAGES = ("schema", "run", "model", "data", "steps")


@dataclass(frozen=True)
class CrossCheck:
    """One check across config fields: ``fields`` compared, at ``stage`` (:data:`STAGES`), made by ``where`` (a
    dotted path), its refusal holding ``says``; ``check`` for the ``run`` stage (``cfg -> None`` or a
    ConfigError)."""

    fields: Tuple[str, ...]
    stage: str
    where: str
    says: str
    check: Optional[Callable[[Config], None]] = None


def _image(cfg: Config) -> Tuple[int, str]:
    """The side of the images the augmentation sees, and the key that sets it (a placed canvas, else the image)."""
    if cfg.data.source == "placed":
        return cfg.data.placed.canvas, "data.placed.canvas"
    return cfg.data.image_size, "data.image_size"


def warmup_within_run(cfg: Config) -> None:
    w, e, sched = cfg.sched.warmup_epochs, cfg.train.epochs, cfg.sched.name
    if sched != "constant" and w > e:
        raise ConfigError(f"sched.warmup_epochs={w:g} is longer than the run (train.epochs={e}): the {sched} schedule "
                          "cannot warm up and then decay within it; give a warmup of at most train.epochs")


def cutout_within_image(cfg: Config) -> None:
    (size, key), cut = _image(cfg), cfg.data.augment.cutout
    if cut > size:
        raise ConfigError(f"data.augment.cutout={cut} is larger than the {size}x{size} images ({key}={size}): its "
                          "hole would blank most or all of every image")


def cutout_under_albumentations(cfg: Config) -> None:
    (size, key), cut = _image(cfg), cfg.data.augment.cutout
    if cut >= size and cfg.data.loader == "albumentations":  # its hole lies wholly inside the image
        raise ConfigError(f"data.augment.cutout={cut} with data.loader=albumentations blanks the whole of every "
                          f"{size}x{size} image ({key}={size}): albumentations keeps the hole inside the image (the tensor "
                          "loader clips a hole centred anywhere); give a smaller cutout")


def workers_need_worker_loader(cfg: Config) -> None:
    if cfg.data.workers and cfg.data.loader == "tensor":
        raise ConfigError(f"data.workers={cfg.data.workers} does nothing with data.loader=tensor (it augments whole "
                          "batches on the device, in the training process); use data.loader=albumentations for "
                          "worker processes, or data.workers=0")


def crop_padding_within_image(cfg: Config) -> None:
    (size, key), aug = _image(cfg), cfg.data.augment
    if aug.crop_padding >= size:  # reflect cannot pad that far; a constant pad lets a crop miss the image wholly
        why = "needs images wider than the padding" if aug.padding_mode == "reflect" else \
            "lets a random crop fall wholly on the padding (a blank image)"
        raise ConfigError(f"data.augment.crop_padding={aug.crop_padding} with padding_mode={aug.padding_mode} {why} "
                          f"({key}={size}); give a padding smaller than the image")


def maps_within_run(cfg: Config) -> None:
    """Maps asked for every N epochs of a shorter run would never be logged."""
    if cfg.log.tensorboard and cfg.log.maps_every > cfg.train.epochs:
        raise ConfigError(f"log.maps_every={cfg.log.maps_every} is more than train.epochs={cfg.train.epochs}: no attention "
                          "map would be logged; give log.maps_every of at most train.epochs (or 0: never)")


def sync_bn_needs_ranks(cfg: Config) -> None:
    """``sync_bn`` does nothing without data-parallel ranks, and torch's SyncBatchNorm has no CPU path."""
    if not cfg.sync_bn:
        return
    ranks = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 or os.environ.get("VISATTN_DATA_PARALLEL") == "1"
    if not ranks or "WORLD_SIZE" not in os.environ:
        raise ConfigError("sync_bn=true needs data-parallel ranks under torchrun (SyncBatchNorm shares BatchNorm "
                          "statistics across them); this run is one process, so it would do nothing: drop sync_bn")
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        raise ConfigError("sync_bn=true runs only on CUDA devices (torch's SyncBatchNorm has no CPU path under gloo); "
                          "drop sync_bn for a CPU run")


def temperature_keeps_teacher(cfg: Config) -> None:
    """One field against a constant, made with the run's checks: a stored config may hold it."""
    t = cfg.train.distill.temperature
    if t < MIN_TEMPERATURE:
        raise ConfigError(f"train.distill.temperature={t:g} is below {MIN_TEMPERATURE:g}: the soft term is the KL "
                          "divergence times temperature**2, which shrinks with the temperature below 1 (to 0 in fp32 "
                          "near 1e-19), so a smaller one all but switches distillation off")


def _run(fields: Tuple[str, ...], check: Callable[[Config], None], says: str) -> CrossCheck:
    return CrossCheck(fields, "run", f"{__name__}.{check.__name__}", says, check)


CROSS_CHECKS: Tuple[CrossCheck, ...] = (
    # schema: every config as it loads (visattn/config.py's validators)
    CrossCheck(("data.augment.hflip_mode", "data.loader"), "schema", "visattn.config.DataConfig._check",
               "augment.hflip_mode=alternate needs loader=tensor"),
    CrossCheck(("data.augment.extra", "data.loader"), "schema", "visattn.config.DataConfig._check",
               "augment.extra needs loader=albumentations"),
    CrossCheck(("data.synthetic_size", "data.image_size"), "schema", "visattn.config.DataConfig._check",
               "the limit is"),
    CrossCheck(("model.init_from", "model.pretrained_file"), "schema", "visattn.config.ModelConfig._check",
               "model.init_from and model.pretrained_file both give the starting weights"),
    # run: before a training run builds anything (check_for_training, in this order)
    _run(("sched.warmup_epochs", "train.epochs", "sched.name"), warmup_within_run, "is longer than the run"),
    _run(("data.augment.cutout", "data.image_size", "data.placed.canvas"), cutout_within_image,
         "hole would blank most or all of every image"),
    _run(("data.augment.cutout", "data.loader"), cutout_under_albumentations,
         "with data.loader=albumentations blanks the whole of every"),
    _run(("data.workers", "data.loader"), workers_need_worker_loader, "does nothing with data.loader=tensor"),
    _run(("data.augment.crop_padding", "data.augment.padding_mode", "data.image_size"), crop_padding_within_image,
         "give a padding smaller than the image"),
    _run(("log.maps_every", "train.epochs", "log.tensorboard"), maps_within_run, "map would be logged"),
    _run(("sync_bn", "device"), sync_bn_needs_ranks, "sync_bn=true"),
    _run(("train.distill.temperature",), temperature_keeps_teacher, "all but switches distillation off"),
    # model: the built model (its build on the meta device, then one image of the data)
    CrossCheck(("model.kwargs.img_size", "model.kwargs.patch_size"), "model", "visattn.models.foreign.check_patch_grid",
               "do not tile its"),
    CrossCheck(("model.img_size", "model.patch_size"), "model", "visattn.models.vit.VisionTransformer.__init__",
               "must be divisible by patch_size"),
    CrossCheck(("model.kwargs",), "model", "visattn.models.foreign.check_forward_runs", "but its forward fails"),
    CrossCheck(("model", "data.image_size"), "model", "visattn.run_checks.check_forward",
               "cannot take this data's"),
    # data: the images and classes the data holds
    CrossCheck(("data.image_size", "data.source"), "data", "visattn.data.splits.load_splits",
               "data.image_size resizes only image folders"),
    CrossCheck(("data.val_size",), "data", "visattn.data.splits.load_splits", "is not smaller than the"),
    CrossCheck(("data.val_size",), "data", "visattn.data.splits.load_splits", "is smaller than the"),
    CrossCheck(("data.subset",), "data", "visattn.data.splits.load_splits", "some classes would"),
    CrossCheck(("data.val_size", "data.subset"), "data", "visattn.data.splits.load_splits",
               "would be scored but never trained"),
    CrossCheck(("data.placed.canvas", "data.image_size"), "data", "visattn.data.placed._positions",
               "leaves no room to place"),
    CrossCheck(("data.placed.canvas", "data.placed.patch"), "data", "visattn.data.placed.place",
               "must be a multiple of data.placed.patch"),
    CrossCheck(("data.augment.extra", "data.image_size"), "data", "visattn.data.augment._check_keeps_size",
               "extra transforms must keep data.image_size"),
    CrossCheck(("train.batch_size",), "data", "visattn.trainer.build", "exceeds the"),
    CrossCheck(("model.init_from", "run_dir"), "data", "visattn.models.starting.check_init_folder",
               "gets a folder of its own"),
    CrossCheck(("data.placed.canvas", "data.image_size"), "data", "visattn.data.placed._positions",
               "every position of a"),
    # steps: the run's batches and steps (the loader's batches per rank, times the epochs)
    CrossCheck(("train.batch_size",), "steps", "visattn.trainer.build", "must divide evenly over"),
    CrossCheck(("train.lookahead_every", "train.epochs", "train.batch_size"), "steps", "visattn.optim.optimization_from",
               "is longer than the run's"),
)


def check_for_training(cfg: Config) -> None:
    """Every ``run``-stage check of :data:`CROSS_CHECKS`, in its order: the first refusal is one
    :class:`ConfigError` line."""
    for row in CROSS_CHECKS:
        if row.stage == "run" and row.check is not None:
            row.check(cfg)


def rows(stage: Optional[str] = None) -> Tuple[CrossCheck, ...]:
    """The rows of ``stage`` (all of them: ``None``)."""
    return tuple(r for r in CROSS_CHECKS if stage in (None, r.stage))

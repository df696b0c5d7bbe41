"""Train / evaluation splits: a test split where the data has one, else a stratified, seeded hold-out."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Tuple

import numpy as np

from ..errors import DataError
from . import sources
from .cache import cached_read, default_cache_dir
from .placed import place_splits
from .sources import ImageSet

if TYPE_CHECKING:
    from ..config import DataConfig


@dataclass
class Splits:
    train: ImageSet
    eval: ImageSet
    eval_split: str  # human-readable: which split the reported figures come from
    source: str
    skipped: int = 0  # unreadable images skipped (data.on_bad_image=skip)


def load_splits(cfg: DataConfig, seed: int, eval_only: bool = False) -> Splits:
    """Read the dataset named by a :class:`visattn.config.DataConfig` and split it for training/eval.

    ``seed`` drives only the synthetic images; the held-out split and the subset follow ``cfg.split_seed``,
    so runs with different seeds are scored on the same validation images. ``eval_only`` (scoring a test
    set) also takes an image folder that holds only ``test/<class>/``; its ``train`` is then empty.
    """
    cache_dir = Path(os.path.expanduser(cfg.cache_dir)) if cfg.cache_dir else default_cache_dir()
    placed = cfg.source == "placed"
    source = cfg.placed.source if placed else cfg.source
    skipped = 0
    if source == "synthetic":
        full = sources.make_synthetic(cfg.synthetic_size, size=cfg.image_size, seed=seed)
        parts = {"train": full}
        origin = "synthetic"
    else:
        root = Path(os.path.expandvars(os.path.expanduser(cfg.root)))
        if source == "torchvision":
            root = sources.torchvision_download(root, cfg.download)
            source = "cifar_python"
        elif source == "auto":
            source = sources.detect_source(root)
        elif not root.exists():
            raise DataError(f"data.root {str(root)!r} does not exist")
        parts, skipped = cached_read(root, (source, cfg.image_size, cfg.on_bad_image, cfg.max_image_pixels), cache_dir,
                                     lambda: sources.read_source(root, source, cfg.image_size, cfg.on_bad_image, cache_dir,
                                                                 cfg.max_image_pixels, need_train=not eval_only),
                                     size=cfg.image_size if source == "folder" else None)
        origin = str(root)
        got = next(iter(parts.values())).x.shape[1:3] if parts else None
        if got is not None and tuple(got) != (cfg.image_size, cfg.image_size):  # CIFAR batches are 32 px, always
            raise DataError(f"data.image_size={cfg.image_size}, but {origin} holds {got[0]}x{got[1]} images "
                            f"({source}: data.image_size resizes only image folders); give data.image_size={got[0]}")
    if "train" not in parts:
        if not eval_only or "test" not in parts:
            raise DataError(f"{origin}: no train/ folder (expected train/<class>/<image>)")
        test = parts["test"]
        return Splits(train=ImageSet(test.x[:0], test.y[:0], test.classes), eval=test,
                      eval_split=f"test split of {origin} ({len(test)} images)", source=source, skipped=skipped)
    train = parts["train"]
    if cfg.use_test_split and "test" in parts:
        ev, eval_split = parts["test"], f"test split of {origin} ({len(parts['test'])} images)"
    else:
        if cfg.val_size >= len(train):
            raise DataError(f"data.val_size={cfg.val_size} is not smaller than the {len(train)} training images")
        if cfg.val_size < len(train.classes):
            raise DataError(f"data.val_size={cfg.val_size} is smaller than the {len(train.classes)} classes")
        tr_idx, va_idx = stratified_split(train.y, cfg.val_size, cfg.split_seed)
        ev = ImageSet(train.x[va_idx], train.y[va_idx], train.classes)
        train = ImageSet(train.x[tr_idx], train.y[tr_idx], train.classes)
        eval_split = f"validation split held out from train ({len(ev)} images, stratified, split seed {cfg.split_seed})"
    if cfg.subset is not None and cfg.subset < len(train.classes):
        raise DataError(f"data.subset={cfg.subset} is smaller than the {len(train.classes)} classes: some classes would "
                        "have no training image (and still be scored)")
    if cfg.subset is not None and cfg.subset < len(train):  # after the hold-out: the eval images never change
        keep, _ = stratified_split(train.y, len(train) - cfg.subset, cfg.split_seed + 1)
        train = ImageSet(train.x[keep], train.y[keep], train.classes)
    untrained = np.nonzero(np.bincount(train.y, minlength=len(train.classes)) == 0)[0]
    if len(untrained):  # scored but never trained: the split, or the subset, took every image of these classes
        names = ", ".join(str(train.classes[i]) for i in untrained[:3]) + (", ..." if len(untrained) > 3 else "")
        cut = f"data.val_size={cfg.val_size}" + (f" and data.subset={cfg.subset}" if cfg.subset is not None else "")
        raise DataError(f"{cut} leaves {len(train)} training images for {len(train.classes)} classes: {len(untrained)} "
                        f"class(es) ({names}) would be scored but never trained; hold out fewer images")
    if placed:  # after the split: held-out canvases are built from held-out images only
        train, ev = place_splits(train, ev, cfg.placed)
        eval_split += f", placed on {cfg.placed.canvas}x{cfg.placed.canvas} canvases (seed {cfg.placed.seed})"
    return Splits(train=train, eval=ev, eval_split=eval_split, source=source, skipped=skipped)


def spread_indices(y: np.ndarray, k: int) -> np.ndarray:
    """``k`` indices taking the first image of each class in turn (class 0, 1, ..., then the second of each)."""
    rank = np.empty(len(y), dtype=np.int64)  # each image's place within its class
    for c in np.unique(y):
        idx = np.nonzero(y == c)[0]
        rank[idx] = np.arange(len(idx))
    return np.lexsort((y, rank))[: max(k, 0)].astype(np.int64)  # by rank, then class


def stratified_split(y: np.ndarray, n_out: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Indices (kept, held out) with ``n_out`` held out spread evenly over the classes, seeded."""
    g = np.random.default_rng(seed)
    classes = np.unique(y)
    counts = np.array([(y == c).sum() for c in classes])
    # Largest-remainder apportionment of n_out over the classes, proportional to their sizes.
    quota = counts * n_out / len(y)
    take = np.floor(quota).astype(int)
    for i in np.argsort(-(quota - take), kind="stable")[: n_out - take.sum()]:
        take[i] += 1
    held = []
    for c, k in zip(classes, take):
        idx = np.nonzero(y == c)[0]
        held.append(g.permutation(idx)[:k])
    held_idx = np.sort(np.concatenate(held))
    mask = np.ones(len(y), dtype=bool)
    mask[held_idx] = False
    return np.nonzero(mask)[0], held_idx

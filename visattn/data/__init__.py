"""CIFAR-10 (and any small image-folder dataset): sources, a decoded uint8 cache, splits and batch loaders.

* :mod:`.sources`: ``data.source`` — an image folder ``train/<class>/*`` (optional ``test/<class>/``) or its
  ``.tar.gz``; the official CIFAR-10 python batches; torchvision's download; synthetic class patterns.
* :mod:`.cache`: every source is decoded once into a uint8 ``(N, H, W, 3)`` array cached as ``.npz`` under
  ``data.cache_dir`` (default ``$XDG_CACHE_HOME/visattn``), so later runs start in seconds.
* :mod:`.splits`: the test split where there is one, else a stratified, seeded hold-out; an optional subset.
* :mod:`.augment`: whole-batch tensor augmentation (pad-crop, flip, cutout) and the albumentations pipeline.
* :mod:`.loaders`: :class:`TensorLoader` keeps the images in one tensor on the device and augments whole
  batches (no per-sample Python on the hot path); :class:`AlbumentationsLoader` runs per-sample
  albumentations in a DataLoader. Both resume mid-epoch from their ``state_dict``.

The functions that read the config take its typed ``data`` section (:class:`visattn.config.DataConfig`).
"""
from .augment import (
    albumentations_pipeline,
    batch_crop,
    batch_cutout,
    batch_hflip,
    build_albumentations_transform,
    check_augment,
    normalize,
)
from .cache import cached_read, default_cache_dir
from .loaders import AlbumentationsLoader, EpochLoader, Placement, TensorLoader, build_loader
from .sources import CIFAR10_CLASSES, ImageSet, detect_source, make_synthetic, read_cifar_python, read_image_folder
from .splits import Splits, load_splits, spread_indices, stratified_split

__all__ = [
    "AlbumentationsLoader", "CIFAR10_CLASSES", "EpochLoader", "ImageSet", "Placement", "Splits", "TensorLoader",
    "albumentations_pipeline", "batch_crop", "batch_cutout", "batch_hflip", "build_albumentations_transform",
    "build_loader", "cached_read", "check_augment", "default_cache_dir", "detect_source", "load_splits",
    "make_synthetic", "normalize", "read_cifar_python", "read_image_folder", "spread_indices", "stratified_split",
]

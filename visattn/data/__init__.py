"""CIFAR-10 (and any small image-folder dataset): sources, a decoded uint8 cache, splits and batch loaders.

* :mod:`.sources`: an image folder ``train/<class>/*`` (optional ``test/``) or its ``.tar.gz``, the official
  CIFAR-10 python batches, torchvision's download, synthetic class patterns.
* :mod:`.cache`: each source decoded once into uint8 ``(N, H, W, 3)`` arrays cached as ``.npz``.
* :mod:`.splits`: the test split where there is one, else a stratified, seeded hold-out; an optional subset.
* :mod:`.augment`, :mod:`.loaders`: whole-batch tensor augmentation on the device (:class:`TensorLoader`) or
  per-sample albumentations (:class:`AlbumentationsLoader`); both resume mid-epoch from their ``state_dict``.
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

"""Batch loaders with resumable epoch and position state: :class:`TensorLoader` (whole-batch tensor
augmentation, no per-sample Python) and :class:`AlbumentationsLoader` (per-sample albumentations).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, Sequence, Tuple

import numpy as np
import torch

from .augment import albumentations_pipeline, batch_crop, batch_cutout, batch_hflip, normalize
from .sources import ImageSet

if TYPE_CHECKING:
    from ..config import DataConfig


@dataclass(frozen=True)
class Placement:
    """Where batches go and which share of each epoch this process serves (data parallelism)."""

    device: torch.device = torch.device("cpu")
    rank: int = 0
    world_size: int = 1
    channels_last: bool = False


class EpochLoader:
    """Epoch and position bookkeeping shared by the loaders; ``position`` counts batches already served.

    The training order of epoch ``e`` is a pure function of ``(seed, e)`` (:meth:`order_generator`), so a
    loader restored from :meth:`state_dict` serves the same batches again.
    """

    def __init__(self, num_images: int, batch_size: int, train: bool, seed: int, placement: Placement):
        self.num_images, self.batch_size, self.train, self.seed = num_images, batch_size, train, seed
        self.placement = placement
        self.device = placement.device
        self.epoch = 0
        self.position = 0

    def order_generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)

    def _shard_size(self) -> int:
        """Images this rank serves per epoch."""
        raise NotImplementedError

    def __len__(self) -> int:
        n = self._shard_size()
        return n // self.batch_size if self.train else math.ceil(n / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.position = 0
        self.epoch = epoch

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def _finish(self, xb: torch.Tensor) -> torch.Tensor:
        return xb.contiguous(memory_format=torch.channels_last) if self.placement.channels_last else xb

    def _end_epoch(self) -> None:
        self.position = 0
        self.epoch += 1


class TensorLoader(EpochLoader):
    """Batches from a uint8 image tensor with whole-batch augmentation; resumable mid-epoch.

    The images sit in one uint8 ``(N, 3, H, W)`` tensor on the training device; augmentation draws from
    ``self.gen`` (a generator on that device, so a step makes no host read or copy), whose state is part of
    :meth:`state_dict`. Under data parallelism each rank takes an equal,
    disjoint share of every epoch's permutation.
    """

    def __init__(self, images: ImageSet, batch_size: int, mean: Sequence[float], std: Sequence[float], train: bool,
                 augment: Any = None, seed: int = 0, placement: Placement = Placement()):
        super().__init__(len(images), batch_size, train, seed, placement)
        device = placement.device
        self.x = torch.from_numpy(images.x).permute(0, 3, 1, 2).contiguous().to(device)  # (N, 3, H, W) uint8
        self.y = torch.from_numpy(images.y).to(device)
        self.augment = augment if train else None
        # on the training device: the augmentation's random draws need no host-to-device copy (a stream sync)
        self.gen = torch.Generator(device=device).manual_seed(seed * 7919 + 17)
        self.flip_mask = None  # alternating flips: which images are mirrored in even epochs (fixed by the seed)
        if self.augment is not None and self.augment.hflip and self.augment.hflip_mode == "alternate":
            g = torch.Generator().manual_seed(seed * 7919 + 23)
            self.flip_mask = (torch.rand(len(images), generator=g) < 0.5).to(device)
        self._fill = torch.zeros(3, device=device)  # cutout fill: the mean pixel, i.e. 0 after normalisation
        self._scale = (1.0 / (255.0 * torch.tensor(std, device=device))).view(1, 3, 1, 1)
        self._shift = (-torch.tensor(mean, device=device) / torch.tensor(std, device=device)).view(1, 3, 1, 1)

    def _indices(self) -> torch.Tensor:
        n = len(self.y)
        perm = torch.randperm(n, generator=self.order_generator()) if self.train else torch.arange(n)
        rank, world = self.placement.rank, self.placement.world_size
        if world > 1:  # equal shares: drop the tail that does not divide evenly (train only)
            perm = perm[rank::world][: n // world] if self.train else perm[rank::world]
        return perm

    def _shard_size(self) -> int:
        return len(self._indices())

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "gen": self.gen.get_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.gen.set_state(state["gen"])

    def _augment(self, xb: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """0..255 float batch (images ``sel``) -> augmented, normalised batch."""
        a = self.augment
        if a is not None and a.crop_padding:
            xb = batch_crop(xb, a.crop_padding, a.padding_mode, self.gen)
        if self.flip_mask is not None:  # every image changes orientation from one epoch to the next
            flip = self.flip_mask[sel] ^ bool(self.epoch % 2)
            xb = torch.where(flip[:, None, None, None], xb.flip(3), xb)
        elif a is not None and a.hflip:
            xb = batch_hflip(xb, self.gen)
        xb = xb * self._scale + self._shift
        if a is not None and a.cutout:
            xb = batch_cutout(xb, a.cutout, self._fill, self.gen)
        return xb

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        idx = self._indices().to(self.device)
        nb = len(self)
        while self.position < nb:
            i = self.position
            sel = idx[i * self.batch_size : (i + 1) * self.batch_size]
            xb = self._finish(self._augment(self.x[sel].float(), sel))
            self.position += 1
            yield xb, self.y[sel]
        self._end_epoch()


class _AlbuDataset(torch.utils.data.Dataset):
    def __init__(self, images: ImageSet, pipeline: Any):
        self.images, self.pipeline = images, pipeline

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, int]:
        img = self.pipeline(image=self.images.x[i])["image"]
        return torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1), int(self.images.y[i])


class AlbumentationsLoader(EpochLoader):
    """Per-sample albumentations in a DataLoader (any transform the config names); same batch interface."""

    def __init__(self, images: ImageSet, batch_size: int, mean: Sequence[float], std: Sequence[float], train: bool,
                 augment: Any, image_size: int, workers: int = 0, seed: int = 0, placement: Placement = Placement()):
        super().__init__(len(images), batch_size, train, seed, placement)
        self.ds = _AlbuDataset(images, albumentations_pipeline(augment, image_size, mean, train))
        self.mean, self.std, self.workers = tuple(mean), tuple(std), workers

    def _shard_size(self) -> int:
        return len(self.ds) // self.placement.world_size

    def _sampler(self) -> Any:
        from torch.utils.data import DistributedSampler

        p = self.placement
        if p.world_size > 1:
            s = DistributedSampler(self.ds, p.world_size, p.rank, shuffle=self.train, seed=self.seed, drop_last=self.train)
            s.set_epoch(self.epoch)
            return s
        if self.train:
            return torch.randperm(len(self.ds), generator=self.order_generator()).tolist()
        return list(range(len(self.ds)))

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        from torch.utils.data import DataLoader

        order = list(iter(self._sampler()))[self.position * self.batch_size :]
        dl = DataLoader(self.ds, batch_size=self.batch_size, sampler=order, num_workers=self.workers,
                        drop_last=self.train, pin_memory=self.device.type == "cuda",
                        persistent_workers=False, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        for xb, yb in dl:
            xb = normalize(xb.to(self.device, non_blocking=True), self.mean, self.std)
            self.position += 1
            yield self._finish(xb), yb.to(self.device, non_blocking=True)
        self._end_epoch()


def build_loader(images: ImageSet, cfg: DataConfig, batch_size: int, train: bool, seed: int,
                 placement: Placement = Placement()) -> EpochLoader:
    """The loader ``cfg.loader`` names, for ``images``."""
    if cfg.loader == "albumentations":  # the images' own size: placed objects' canvases are not data.image_size
        size = images.x.shape[1] if len(images.x.shape) == 4 else cfg.image_size
        return AlbumentationsLoader(images, batch_size, cfg.mean, cfg.std, train, cfg.augment, size,
                                    workers=cfg.workers, seed=seed, placement=placement)
    return TensorLoader(images, batch_size, cfg.mean, cfg.std, train, cfg.augment, seed=seed, placement=placement)

"""Augmentation: whole-batch tensor ops (crop, flip, cutout) and the albumentations pipeline."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch
import torch.nn.functional as F


def normalize(x_uint8: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 (or 0-255 float) ``(B, 3, H, W)`` -> float32 normalised."""
    m = torch.tensor(mean, device=x_uint8.device).view(1, -1, 1, 1)
    s = torch.tensor(std, device=x_uint8.device).view(1, -1, 1, 1)
    return (x_uint8.float() / 255.0 - m) / s


def batch_crop(x: torch.Tensor, pad: int, mode: str, gen: torch.Generator) -> torch.Tensor:
    """Pad by ``pad`` then crop back at a random offset per image, as one gather. ``x``: (B, C, H, W)."""
    B, C, H, W = x.shape
    xp = F.pad(x, (pad, pad, pad, pad), mode=mode)
    dy = torch.randint(0, 2 * pad + 1, (B,), generator=gen, device=gen.device).to(x.device)
    dx = torch.randint(0, 2 * pad + 1, (B,), generator=gen, device=gen.device).to(x.device)
    rows = (dy[:, None] + torch.arange(H, device=x.device))[:, None, :, None]  # (B, 1, H, 1)
    cols = (dx[:, None] + torch.arange(W, device=x.device))[:, None, None, :]  # (B, 1, 1, W)
    b = torch.arange(B, device=x.device)[:, None, None, None]
    c = torch.arange(C, device=x.device)[None, :, None, None]
    return xp[b, c, rows, cols]


def batch_hflip(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    flip = torch.rand(x.shape[0], generator=gen, device=gen.device).to(x.device) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(3), x)


def batch_cutout(x: torch.Tensor, size: int, fill: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Zero a ``size`` x ``size`` square (clipped at the border) at a uniform centre per image (DeVries 2017)."""
    B, _, H, W = x.shape
    cy = torch.randint(0, H, (B,), generator=gen, device=gen.device).to(x.device)
    cx = torch.randint(0, W, (B,), generator=gen, device=gen.device).to(x.device)
    ys = torch.arange(H, device=x.device)[None, :]
    xs = torch.arange(W, device=x.device)[None, :]
    in_y = (ys >= (cy[:, None] - size // 2)) & (ys < (cy[:, None] - size // 2 + size))  # (B, H)
    in_x = (xs >= (cx[:, None] - size // 2)) & (xs < (cx[:, None] - size // 2 + size))  # (B, W)
    hole = (in_y[:, :, None] & in_x[:, None, :])[:, None]  # (B, 1, H, W)
    return torch.where(hole, fill.view(1, -1, 1, 1).to(x.dtype), x)


def build_albumentations_transform(spec: Dict[str, Any]) -> Any:
    """``{name: ColorJitter, brightness: 0.2}`` -> ``albumentations.ColorJitter(brightness=0.2)``."""
    import albumentations as A

    if not isinstance(spec, dict) or "name" not in spec:
        raise ValueError("each transform is a mapping with a 'name' key (an albumentations class name)")
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    cls = getattr(A, str(spec["name"]), None)
    if not (isinstance(cls, type) and issubclass(cls, A.BasicTransform)):
        raise ValueError(f"unknown albumentations transform {spec['name']!r}")
    import warnings

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = cls(**kwargs)
        for w in caught:  # albumentations only warns about unknown arguments; here they are errors
            if "not valid for transform" in str(w.message):
                raise ValueError(str(w.message).split(" for transform")[0].replace("Argument(s)", "unknown argument(s)"))
        return t
    except (TypeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise ValueError(f"{spec['name']}: bad arguments ({first})") from None


def albumentations_pipeline(aug: Any, image_size: int, mean: Sequence[float], train: bool) -> Any:
    """The config's augmentation as an ``albumentations.Compose`` (uint8 HWC in, uint8 HWC out)."""
    import albumentations as A
    import cv2

    ts: List[Any] = []
    if train:
        if aug.crop_padding:
            border = cv2.BORDER_REFLECT_101 if aug.padding_mode == "reflect" else cv2.BORDER_CONSTANT
            size = image_size + 2 * aug.crop_padding
            ts += [A.PadIfNeeded(size, size, border_mode=border, fill=0), A.RandomCrop(image_size, image_size)]
        if aug.hflip:
            ts.append(A.HorizontalFlip(p=0.5))
        if aug.cutout:
            fill = tuple(float(m * 255) for m in mean)
            c = aug.cutout
            ts.append(A.CoarseDropout(num_holes_range=(1, 1), hole_height_range=(c, c), hole_width_range=(c, c), fill=fill, p=1.0))
        ts += [build_albumentations_transform(s) for s in aug.extra]
    return A.Compose(ts)


def check_augment(cfg: Any) -> None:
    """Build every ``augment.extra`` transform of a :class:`~visattn.config.DataConfig` once, before any
    data is read; a bad one raises ConfigError naming its entry."""
    from ..errors import ConfigError

    size = cfg.placed.canvas if cfg.source == "placed" else cfg.image_size  # the size of the images trained on
    for i, spec in enumerate(cfg.augment.extra):
        try:
            build_albumentations_transform(spec)
            _check_keeps_size(spec, size)
        except ValueError as e:
            raise ConfigError(f"data.augment.extra: entry {i}: {e}") from None


def _check_keeps_size(spec: Dict[str, Any], size: int) -> None:
    """Apply the transform (with ``p=1``) to one image: it must keep the image ``size`` x ``size`` x 3 uint8,
    or the batches it makes would not stack (or would not be what the model takes)."""
    import numpy as np

    t = build_albumentations_transform({**spec, "p": 1.0})
    img = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    try:
        out = t(image=img)["image"]
    except Exception as e:  # noqa: BLE001 - whatever the transform raises on a plain image is a config problem
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else e.__class__.__name__
        raise ValueError(f"{spec['name']} fails on a {size}x{size} RGB image ({first})") from None
    shape = getattr(out, "shape", None)
    if shape != (size, size, 3) or getattr(out, "dtype", None) != np.uint8:
        got = "x".join(map(str, shape)) if shape is not None else type(out).__name__
        raise ValueError(f"{spec['name']} changes the image from {size}x{size}x3 uint8 to {got} "
                         f"{getattr(out, 'dtype', '')}; extra transforms must keep data.image_size".rstrip())

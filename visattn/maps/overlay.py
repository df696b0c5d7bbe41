"""Blend heatmaps onto images: pure, batched tensor functions (no matplotlib, no TensorBoard).

    rgb = overlay(images, heat, mean=CIFAR_MEAN, std=CIFAR_STD, size=128)  # (B, 3, 128, 128) uint8

Colormaps are 256-entry lookup tables built once from a few anchor colours: jet from its classic
piecewise-linear definition, turbo (Mikhailov, Google 2019) and inferno (van der Walt & Smith, matplotlib)
from 17 evenly spaced samples, linearly interpolated (within 8/255 of the full tables).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .geometry import GridGeometry, place
from .scale import to_unit

# (x, value) anchors per channel; jet is piecewise linear by definition.
_JET = (
    ((0.0, 0.0), (0.35, 0.0), (0.66, 1.0), (0.89, 1.0), (1.0, 0.5)),
    ((0.0, 0.0), (0.125, 0.0), (0.375, 1.0), (0.64, 1.0), (0.91, 0.0), (1.0, 0.0)),
    ((0.0, 0.5), (0.11, 1.0), (0.34, 1.0), (0.65, 0.0), (1.0, 0.0)),
)
# 17 evenly spaced RGB samples, 0 to 1.
_TURBO = (
    (48, 18, 59), (64, 64, 162), (70, 107, 227), (66, 148, 255), (40, 188, 235), (24, 221, 194),
    (50, 242, 152), (109, 254, 98), (164, 252, 60), (205, 236, 52), (238, 207, 58), (253, 172, 52),
    (251, 126, 33), (235, 80, 14), (208, 47, 5), (169, 22, 1), (122, 4, 3),
)
_INFERNO = (
    (0, 0, 4), (11, 7, 36), (33, 12, 74), (61, 9, 101), (87, 16, 110), (113, 25, 110), (138, 34, 106),
    (163, 44, 97), (188, 55, 84), (210, 70, 68), (228, 90, 49), (241, 115, 29), (249, 142, 9),
    (252, 172, 17), (249, 203, 53), (242, 234, 105), (252, 255, 164),
)
COLORMAPS = ("jet", "turbo", "inferno")


def _interp(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear interpolation of ``(xp, fp)`` at ``x`` (``xp`` increasing, ``x`` within it)."""
    xp = xp.contiguous()
    i = torch.searchsorted(xp, x, right=True).clamp(1, len(xp) - 1)
    x0, x1, f0, f1 = xp[i - 1], xp[i], fp[i - 1], fp[i]
    return f0 + (f1 - f0) * (x - x0) / (x1 - x0)


def _build_lut(name: str) -> torch.Tensor:
    x = torch.linspace(0, 1, 256, dtype=torch.float64)
    if name == "jet":
        chans = [_interp(x, *torch.tensor(anchors, dtype=torch.float64).unbind(1)) for anchors in _JET]
    else:
        rgb = torch.tensor(_TURBO if name == "turbo" else _INFERNO, dtype=torch.float64) / 255.0  # (17, 3)
        xp = torch.linspace(0, 1, len(rgb), dtype=torch.float64)
        chans = [_interp(x, xp, rgb[:, c]) for c in range(3)]
    return torch.stack(chans, 1).float()  # (256, 3) in [0, 1]


_LUTS: Dict[str, torch.Tensor] = {}


def colorize(values: torch.Tensor, colormap: str = "jet") -> torch.Tensor:
    """Map values in [0, 1] (any shape ``S``) to RGB floats in [0, 1], shape ``(*S, 3)``."""
    if colormap not in COLORMAPS:
        raise ValueError(f"unknown colormap {colormap!r}; valid: {', '.join(COLORMAPS)}")
    if colormap not in _LUTS:
        _LUTS[colormap] = _build_lut(colormap)
    lut = _LUTS[colormap].to(values.device)
    idx = (values.float().clamp(0, 1) * 255).round().long()
    return lut[idx]


def normalize_maps(heatmaps: torch.Tensor) -> torch.Tensor:
    """Scale each map of ``(B, h, w)`` to [0, 1] on its own (fp32); a constant map becomes all zeros.

    The explicit per-image stretch (``norm="per_image"``); the default drawing uses a fixed scale
    (:mod:`visattn.maps.scale`)."""
    return to_unit(heatmaps, "gate", 0, "per_image")


def _size(size: Union[None, int, Sequence[int]], hw: Tuple[int, int]) -> Tuple[int, int]:
    if size is None:
        return hw
    if isinstance(size, int):
        # An int is the longer side, so non-square images keep their shape.
        scale = size / max(hw)
        return max(1, round(hw[0] * scale)), max(1, round(hw[1] * scale))
    if len(size) != 2:
        raise ValueError(f"size must be an int or (H, W), got {size!r}")
    return int(size[0]), int(size[1])


def _stats(v, name: str, device) -> Optional[torch.Tensor]:
    if v is None:
        return None
    t = torch.as_tensor(v, dtype=torch.float32, device=device).flatten()
    if t.numel() not in (1, 3):
        raise ValueError(f"{name} must have 1 or 3 values, got {t.numel()}")
    return t.view(1, -1, 1, 1)


def images_to_float(
    images: torch.Tensor,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
    size: Union[None, int, Sequence[int]] = None,
) -> torch.Tensor:
    """``(B, 3 or 1, H, W)`` images -> fp32 RGB in [0, 1], ``(B, 3, H', W')``, on the images' device.

    uint8 images are divided by 255; float images (any dtype) are un-normalised with ``x * std + mean``
    when ``mean``/``std`` are given, else taken to be in [0, 1]. ``size``: output ``(H', W')``, or an int
    for the longer side (bilinear).
    """
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] not in (1, 3):
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a (B, 3, H, W) or (B, 1, H, W) tensor, got {shape}")
    if images.dtype == torch.uint8:
        x = images.float() / 255.0
    elif images.is_floating_point():
        x = images.float()
        std_t, mean_t = _stats(std, "std", x.device), _stats(mean, "mean", x.device)
        if std_t is not None:
            x = x * std_t
        if mean_t is not None:
            x = x + mean_t
    else:
        raise TypeError(f"images must be uint8 or floating point, got {images.dtype}")
    x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x
    out_hw = _size(size, tuple(x.shape[-2:]))
    if out_hw != tuple(x.shape[-2:]):
        x = F.interpolate(x, size=out_hw, mode="bilinear", align_corners=False)
    return x.clamp(0, 1)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    return (x * 255.0).round().clamp(0, 255).to(torch.uint8)


def overlay(
    images: torch.Tensor,
    heatmaps: Any,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
    alpha: float = 0.5,
    colormap: str = "jet",
    size: Union[None, int, Sequence[int]] = None,
    norm: Optional[str] = None,
    scale: Optional[str] = None,
    keys: int = 0,
    geometry: Optional[GridGeometry] = None,
) -> torch.Tensor:
    """Colour ``heatmaps`` and blend them onto ``images``; returns uint8 ``(B, 3, H', W')`` on the images' device.

    ``images``: ``(B, 3, H, W)`` uint8, or normalised floats of any dtype (undone with ``mean``/``std``).
    ``heatmaps``: a :class:`~visattn.maps.readout.LayerMap` (drawn on its declared scale, ``norm="fixed"``,
    at its cells' true place), or a ``(B, h, w)`` / ``(B, 1, h, w)`` tensor of any float dtype and device.
    A bare tensor has no declared scale: give ``scale`` (``"gate"``, or ``"relative"`` with ``keys``) for the
    fixed scale, otherwise each map is stretched to its own range (``norm="per_image"``; a constant map is
    drawn cold, never NaN). ``geometry``: where the cells lie on the image (default: stretched over it).
    ``alpha``: weight of the colour (0 gives the image back, 1 the coloured map alone); pixels no cell
    covers keep the image. ``size``: upscale the result to ``(H', W')`` (or an int for the longer side).
    """
    if not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if hasattr(heatmaps, "heat") and hasattr(heatmaps, "geometry"):  # a LayerMap
        scale, keys, geometry = heatmaps.scale, heatmaps.keys, heatmaps.geometry
        heatmaps = heatmaps.heat
        norm = norm or "fixed"
    if heatmaps.dim() == 4 and heatmaps.shape[1] == 1:
        heatmaps = heatmaps[:, 0]
    if heatmaps.dim() != 3:
        raise ValueError(f"heatmaps must be (B, h, w) or (B, 1, h, w), got {tuple(heatmaps.shape)}")
    if heatmaps.shape[0] != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {heatmaps.shape[0]} heatmaps")
    norm = norm or ("fixed" if scale is not None else "per_image")
    unit = to_unit(heatmaps, scale or "gate", keys, norm)
    base = images_to_float(images, mean, std, size)  # (B, 3, H', W')
    image_hw = tuple(images.shape[-2:])
    if geometry is None:
        geometry = GridGeometry.stretched(tuple(unit.shape[-2:]), image_hw)
    return blend(base, unit, geometry, image_hw, alpha, colormap)


def blend(base: torch.Tensor, unit: torch.Tensor, geometry: GridGeometry, image_hw: Sequence[int],
          alpha: float = 0.5, colormap: str = "jet") -> torch.Tensor:
    """Blend colour-map positions ``unit`` ``(B, h, w)`` in [0, 1], placed by ``geometry``, onto ``base``
    (float RGB in [0, 1], ``(B, 3, H', W')``, a picture of an ``image_hw`` input); uint8 out."""
    vals, covered = place(unit.to(base.device), geometry, tuple(base.shape[-2:]), image_hw)
    color = colorize(vals, colormap).permute(0, 3, 1, 2)  # (B, 3, H', W')
    mixed = (1.0 - alpha) * base + alpha * color
    return to_uint8(torch.where(covered.to(base.device), mixed, base))

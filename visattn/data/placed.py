"""Placed objects (``data.source=placed``): each image pasted at a seeded position on a larger canvas whose
box is known exactly, the rest filled with content that carries no label.

The background is a **mosaic** of ``patch x patch`` squares, each cut at a random place from a random other
image of the same pool (so its source, and so its class, is independent of the canvas's label), or uniform
**noise**. Training canvases take their objects and their patches from the training images only, held-out
canvases from the held-out images only, so no training image appears in validation, object or patch.

Positions are balanced for the pointing game: the canvas centre falls in the box (grown by the pointing
tolerance) on the share of canvases that a uniformly random point would hit, so a centre guess scores chance.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

import numpy as np

from ..errors import DataError
from .sources import ImageSet

if TYPE_CHECKING:
    from ..config import PlacedConfig

CHUNK = 512  # canvases built at a time (bounds the gather's index arrays)


def hit_extent(lo: np.ndarray, hi: np.ndarray, canvas: int, tolerance: int) -> np.ndarray:
    """How many pixel centres along one axis lie within ``tolerance`` px of ``[lo, hi)`` (clipped to the canvas)."""
    first = np.maximum(lo - tolerance, 0)
    last = np.minimum(hi + tolerance, canvas)
    return np.maximum(last - first, 0)


def box_share(boxes: np.ndarray, canvas: int, tolerance: int) -> np.ndarray:
    """Per box ``(x0, y0, x1, y1)``: the share of the canvas's pixels whose centre is within ``tolerance`` px of
    the box: the pointing rate of a uniformly random point, i.e. chance."""
    b = np.asarray(boxes, dtype=np.int64)
    return hit_extent(b[:, 0], b[:, 2], canvas, tolerance) * hit_extent(b[:, 1], b[:, 3], canvas, tolerance) / canvas**2


def _positions(n: int, size: int, canvas: int, tolerance: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` top-left corners ``(x0, y0)``: the centre lies in the grown box on a share ``p`` of them, with ``p``
    equal to the expected chance rate, so the centre prior's pointing rate is chance by construction."""
    m = canvas - size
    if m < 1:
        raise DataError(f"data.placed.canvas={canvas} leaves no room to place a {size}x{size} image")
    xy = np.stack(np.meshgrid(np.arange(m + 1), np.arange(m + 1), indexing="xy"), -1).reshape(-1, 2)
    c = canvas / 2  # the centre prior peaks at a pixel whose centre is c +- 0.5
    inside = ((xy - tolerance <= c - 0.5) & (c + 0.5 <= xy + size + tolerance)).all(1)
    outside = ((c + 0.5 < xy - tolerance) | (c - 0.5 > xy + size + tolerance)).any(1)
    xy = xy[inside | outside]  # positions where the peak's hit depends on which central pixel it is: unused
    cover = inside[inside | outside]
    if cover.all():
        raise DataError(f"data.placed.canvas={canvas} is too small: every position of a {size}x{size} image covers "
                        f"the centre within the {tolerance} px tolerance (need canvas >= {2 * size + 2 * tolerance + 2})")
    share = box_share(np.concatenate([xy, xy + size], 1), canvas, tolerance)
    a, b = share[cover].mean(), share[~cover].mean()
    p = b / (1 - a + b)  # p = p a + (1 - p) b: the centre's hit rate equals a random point's
    pick_cover = rng.random(n) < p
    inside, outside = np.nonzero(cover)[0], np.nonzero(~cover)[0]
    idx = np.where(pick_cover, inside[rng.integers(0, len(inside), n)], outside[rng.integers(0, len(outside), n)])
    return xy[idx]


def _mosaic(pool: np.ndarray, n: int, canvas: int, patch: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` canvases ``(n, canvas, canvas, 3)`` of ``patch``-px squares cut from random images of ``pool``.
    Canvas ``i`` never takes a square from image ``i`` (its own object)."""
    g = canvas // patch
    s = pool.shape[1]
    out = np.empty((n, canvas, canvas, 3), np.uint8)
    d = np.arange(patch)
    for lo in range(0, n, CHUNK):
        k = min(CHUNK, n - lo)
        src = rng.integers(0, len(pool) - 1, (k, g, g))
        own = np.arange(lo, lo + k)[:, None, None]
        src = src + (src >= own)  # skip the canvas's own image
        oy, ox = rng.integers(0, s - patch + 1, (2, k, g, g))
        rows = (oy[..., None] + d)[..., :, None]  # (k, g, g, patch, 1)
        cols = (ox[..., None] + d)[..., None, :]  # (k, g, g, 1, patch)
        sq = pool[src[..., None, None], rows, cols]  # (k, g, g, patch, patch, 3)
        out[lo:lo + k] = sq.transpose(0, 1, 3, 2, 4, 5).reshape(k, canvas, canvas, 3)
    return out


def place(images: ImageSet, cfg: PlacedConfig, stream: int) -> ImageSet:
    """Canvases of ``images`` (objects and background from these images only), with their ``boxes``.

    ``stream`` separates the random draws of the splits (0: train, 1: held-out); the result is a pure function
    of the images, ``cfg`` and ``stream``."""
    n, size = len(images), images.x.shape[1]
    if images.x.shape[2] != size:
        raise DataError(f"data.source=placed needs square images, not {images.x.shape[1]}x{images.x.shape[2]}")
    if n < 2:
        raise DataError(f"data.source=placed needs at least 2 images in each split, not {n}")
    if cfg.canvas % cfg.patch or size < cfg.patch:
        raise DataError(f"data.placed.canvas={cfg.canvas} must be a multiple of data.placed.patch={cfg.patch} "
                        f"(at most the image's {size} px)")
    rng = np.random.default_rng([cfg.seed, stream])
    xy = _positions(n, size, cfg.canvas, cfg.tolerance, rng)
    if cfg.background == "mosaic":
        x = _mosaic(images.x, n, cfg.canvas, cfg.patch, rng)
    else:
        x = rng.integers(0, 256, (n, cfg.canvas, cfg.canvas, 3), dtype=np.uint8)
    if cfg.object:
        for i, (x0, y0) in enumerate(xy):
            x[i, y0:y0 + size, x0:x0 + size] = images.x[i]
    boxes = np.concatenate([xy, xy + size], 1).astype(np.int64)
    return ImageSet(x, images.y, images.classes, boxes=boxes)


def place_splits(train: ImageSet, held_out: ImageSet, cfg: PlacedConfig) -> Tuple[ImageSet, ImageSet]:
    """The training and held-out canvases, each built from its own split's images only."""
    return place(train, cfg, 0), place(held_out, cfg, 1)

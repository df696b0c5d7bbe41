"""Render maps: honest colour scales, overlays on the images, and the pictures TensorBoard and ``visualize``
show (tiles with captions, colour bars with numeric ticks, attention matrices with axes).

Every map kind is drawn on a declared range, the same for every image, layer and training step:

* ``"gate"``: sigmoid gates on their absolute range [0, 1], linear. A gate that varies from 0.48 to 0.53
  covers 5% of the colour map; a flat gate looks flat.
* ``"gain"``: the gates of blocks built with ``init="identity"``, read as multipliers on their range [0, 2],
  linear, with 1 (the input passed through unchanged) in the middle of the colour map.
* ``"relative"``: attention rows, pooling weights, GC's context softmax and rollout, as weight x number of
  keys (uniform attention = 1), on a log2 scale from 1/8x to 8x uniform that saturates at both ends;
  uniform attention sits exactly in the middle of the colour map (the "uniform colour").

``norm="per_image"`` stretches each map to its own minimum and maximum instead: an explicit option, for
looking at the shape of a map whose range is tiny; the colour bar and captions then say so.

Overlays are pure, batched tensor functions (``overlay(images, heat, mean, std, size=128)`` -> ``(B, 3, 128,
128)`` uint8) on matplotlib's colour maps. Pictures are HWC uint8 numpy arrays (what
``SummaryWriter.add_image(..., dataformats="HWC")`` and PIL take), at most :data:`MAX_WIDTH` pixels wide, the
content width of TensorBoard's default image card (a 318 px card basis less 2 x 16 px padding), so they show
at full size without a scroll bar: probe images are laid out in as many columns as fit. The captions, colour
bar titles and the maps' one-line descriptions are all written here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from .geometry import GridGeometry, place
from .kinds import kind_of

NORMS = ("fixed", "per_image")
RELATIVE_RANGE = 8.0  # relative maps span 1/8x .. 8x uniform
GAIN_RANGE = 2.0  # gain maps span 0 .. 2x (identity-initialised gates: 2 * sigmoid)


@dataclass(frozen=True)
class Stats:
    lo: float
    hi: float
    peak: float  # relative: max x uniform; gate: max / mean
    entropy: float  # relative: entropy / log(cells) of the renormalised map (1 = flat); gate: nan
    finite: bool


def check_norm(norm: str) -> str:
    if norm not in NORMS:
        raise ValueError(f"unknown map norm {norm!r}; valid: {', '.join(NORMS)}")
    return norm


def display_values(heat: torch.Tensor, scale: str, keys: int = 0) -> torch.Tensor:
    """Values in the scale's units: gates as they are, relative weights times ``keys``."""
    if scale == "relative":
        if keys < 1:
            raise ValueError("a relative map needs its number of keys")
        return heat.float() * float(keys)
    if scale in ("gate", "gain"):
        return heat.float()
    raise ValueError(f"unknown value scale {scale!r}; valid: gate, gain, relative")


def to_unit(heat: torch.Tensor, scale: str, keys: int = 0, norm: str = "fixed") -> torch.Tensor:
    """``(B, ...)`` map values -> positions in [0, 1] on the colour map (fp32; non-finite values -> 0)."""
    check_norm(norm)
    v = torch.nan_to_num(display_values(heat, scale, keys), nan=0.0, posinf=0.0, neginf=0.0)
    if norm == "per_image":
        flat = v.reshape(v.shape[0], -1)
        lo = flat.amin(1, keepdim=True)
        span = flat.amax(1, keepdim=True) - lo
        # A constant map has no hot spot: it stays at the colormap's cold end rather than dividing by zero.
        flat = torch.where(span > 0, (flat - lo) / span.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        return flat.reshape(v.shape)
    if scale == "gate":
        return v.clamp(0, 1)
    if scale == "gain":
        return (v / GAIN_RANGE).clamp(0, 1)
    top = math.log2(RELATIVE_RANGE)
    return ((torch.log2(v.clamp_min(1e-30)) + top) / (2 * top)).clamp(0, 1)


def ticks(scale: str, norm: str = "fixed") -> List[Tuple[float, str]]:
    """``(position in [0, 1], label)`` of the colour bar's ticks."""
    if check_norm(norm) == "per_image":
        return [(0.0, "min"), (0.5, "mid"), (1.0, "max")]
    if scale == "gate":
        return [(t, f"{t:g}") for t in (0.0, 0.25, 0.5, 0.75, 1.0)]
    if scale == "gain":
        return [(t / GAIN_RANGE, f"{t:g}" + ("x" if t == GAIN_RANGE else "")) for t in (0.0, 0.5, 1.0, 1.5, 2.0)]
    top = int(math.log2(RELATIVE_RANGE))
    labels = {-3: "1/8", -2: "1/4", -1: "1/2", 0: "1", 1: "2", 2: "4", 3: "8"}
    return [((e + top) / (2 * top), labels.get(e, f"2^{e}") + ("x" if e == top else "")) for e in range(-top, top + 1)]


def scale_title(scale: str, norm: str = "fixed") -> str:
    if check_norm(norm) == "per_image":
        return "stretched per image (see captions)"
    if scale == "gate":
        return "gate value, fixed 0-1"
    if scale == "gain":
        return "gain, fixed 0-2 (1 = unchanged)"
    return "x uniform attention, log 1/8-8"


def map_stats(heat: torch.Tensor, scale: str, keys: int = 0) -> List[Stats]:
    """Per image of ``(B, h, w)``: range (in the scale's units) and peakedness."""
    out = []
    v = display_values(heat, scale, keys).reshape(heat.shape[0], -1)
    for row in v:
        finite = bool(torch.isfinite(row).all())
        r = torch.nan_to_num(row, nan=0.0, posinf=0.0, neginf=0.0)
        lo, hi, mean = float(r.min()), float(r.max()), float(r.mean())
        if scale == "relative":
            total = float(r.clamp_min(0).sum())
            p = r.clamp_min(0) / total if total > 0 else torch.full_like(r, 1.0 / r.numel())
            ent = float(-(p * torch.log(p.clamp_min(1e-30))).sum()) / math.log(r.numel()) if r.numel() > 1 else 1.0
            out.append(Stats(lo, hi, hi, min(max(ent, 0.0), 1.0) + 0.0, finite))  # + 0.0: no "-0.00"
        else:
            out.append(Stats(lo, hi, hi / mean if mean > 0 else float("inf"), float("nan"), finite))
    return out


def _num(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}" if a >= 0.01 or v == 0 else f"{v:.1e}"


def caption(stats: Stats, scale: str, norm: str = "fixed") -> str:
    """One short line: the range and the peakedness, e.g. ``"0.48-0.53 max/mean 1.04"`` or
    ``"x0.61-3.2 H 0.93"`` (relative: x uniform, H = entropy / uniform's)."""
    if scale == "relative":
        text = f"x{_num(stats.lo)}-{_num(stats.hi)}  H {stats.entropy:.2f}"
    else:
        text = f"{_num(stats.lo)}-{_num(stats.hi)}  max/mean {_num(stats.peak)}"
    return text + (" (str.)" if norm == "per_image" else "")


# ----------------------------------------------------------------------------- images and overlays


COLORMAPS = ("jet", "turbo", "inferno")
_LUTS: Dict[str, torch.Tensor] = {}


def colorize(values: torch.Tensor, colormap: str = "jet") -> torch.Tensor:
    """Map values in [0, 1] (any shape ``S``) to RGB floats in [0, 1], shape ``(*S, 3)``: matplotlib's
    256-entry table of ``colormap``."""
    if colormap not in COLORMAPS:
        raise ValueError(f"unknown colormap {colormap!r}; valid: {', '.join(COLORMAPS)}")
    if colormap not in _LUTS:
        _LUTS[colormap] = torch.tensor(matplotlib.colormaps[colormap](np.arange(256))[:, :3], dtype=torch.float32)
    idx = (values.float().clamp(0, 1) * 255).round().long()
    return _LUTS[colormap].to(values.device)[idx]


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


# ----------------------------------------------------------------------------- pictures


MAX_WIDTH = 286
GAP = 2  # pixels between the tiles of one cell
COL_GAP = 6  # pixels between cells
LINE_H = 13
FONT_SIZE = 11
BG = (24, 24, 24)
TEXT = (235, 235, 235)
DIM = (170, 170, 170)
RIGHT, WRONG = (110, 230, 110), (255, 110, 110)
Colour = Tuple[int, int, int]
Line = Tuple[str, Colour]


@lru_cache(maxsize=4)
def font(size: int = FONT_SIZE) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1 ships a scalable default font
    except TypeError:  # pragma: no cover - older Pillow
        return ImageFont.load_default()


def text_width(text: str, size: int = FONT_SIZE) -> float:
    return font(size).getlength(text)


def fit_text(text: str, width: int, size: int = FONT_SIZE) -> str:
    """Shorten ``text`` from the left ("...s.0.attn") until it fits ``width`` pixels."""
    if text_width(text, size) <= width:
        return text
    while len(text) > 4 and text_width("..." + text, size) > width:
        text = text[1:]
    return "..." + text


def label_lines(true: str, pred: str, width: int) -> List[str]:
    one = f"true: {true}  pred: {pred}"
    return [one] if text_width(one) <= width else [fit_text(f"true: {true}", width), fit_text(f"pred: {pred}", width)]


def _canvas(h: int, w: int) -> np.ndarray:
    return np.full((h, w, 3), BG, dtype=np.uint8)


def _write(canvas: np.ndarray, texts: Sequence[Tuple[int, int, str, Colour, int]]) -> np.ndarray:
    img = Image.fromarray(canvas)
    draw = ImageDraw.Draw(img)
    for x, y, text, colour, size in texts:
        draw.text((x, y), text, fill=colour, font=font(size))
    return np.asarray(img).copy()


def colour_bar(width: int, scale: str, norm: str = "fixed", colormap: str = "jet") -> np.ndarray:
    """A horizontal colour bar ``width`` px wide: title, the colour map left (low) to right (high), ticks."""
    bar_h, pad = 10, 6
    bar_w = width - 2 * pad
    h = LINE_H + bar_h + 4 + LINE_H
    canvas = _canvas(h, width)
    pos = torch.linspace(0, 1, bar_w)
    rgb = (colorize(pos, colormap).numpy() * 255).round().astype(np.uint8)  # (bar_w, 3)
    canvas[LINE_H : LINE_H + bar_h, pad : pad + bar_w] = rgb[None]
    texts = [(pad, 0, fit_text("colour: " + scale_title(scale, norm), bar_w), DIM, FONT_SIZE - 1)]
    for t, label in ticks(scale, norm):
        x = pad + int(round(t * (bar_w - 1)))
        canvas[LINE_H + bar_h : LINE_H + bar_h + 3, x] = TEXT
        lw = text_width(label, FONT_SIZE - 1)
        tx = int(min(max(x - lw / 2, 0), width - lw))
        texts.append((tx, LINE_H + bar_h + 3, label, TEXT, FONT_SIZE - 1))
    return _write(canvas, texts)


def cells_picture(cells: Sequence[Tuple[List[Line], List[np.ndarray]]],
                  footer: Optional[Callable[[int], np.ndarray]] = None, max_width: int = MAX_WIDTH) -> np.ndarray:
    """Lay out cells (caption lines above a row of equally tall tiles) in as many columns as fit
    ``max_width``, with ``footer(width)`` (a colour bar) below; returns HWC uint8."""
    cell_w = max(max(sum(t.shape[1] for t in tiles) + GAP * (len(tiles) - 1),
                     max((int(text_width(t)) + 2 for t, _ in lines), default=0)) for lines, tiles in cells)
    cols = max(1, min(len(cells), (max_width + COL_GAP) // (cell_w + COL_GAP)))
    rows = [cells[i : i + cols] for i in range(0, len(cells), cols)]
    heights = [max(LINE_H * len(lines) + 2 + tiles[0].shape[0] for lines, tiles in row) for row in rows]
    width = cols * cell_w + COL_GAP * (cols - 1)
    bar = footer(min(max(width, 200), max(max_width, width))) if footer is not None else None
    if bar is not None:
        width = max(width, bar.shape[1])
    height = sum(heights) + COL_GAP * (len(rows) - 1) + (bar.shape[0] + COL_GAP if bar is not None else 0)
    canvas = _canvas(height, width)
    texts = []
    y = 0
    for row, rh in zip(rows, heights):
        for c, (lines, tiles) in enumerate(row):
            x = c * (cell_w + COL_GAP)
            for k, (text, colour) in enumerate(lines):
                texts.append((x + 1, y + LINE_H * k, text, colour, FONT_SIZE))
            ty = y + rh - tiles[0].shape[0]
            for tile in tiles:
                canvas[ty : ty + tile.shape[0], x : x + tile.shape[1]] = tile
                x += tile.shape[1] + GAP
        y += rh + COL_GAP
    if bar is not None:
        canvas[y : y + bar.shape[0], : bar.shape[1]] = bar
    return _write(canvas, texts)


def _matrix_tile(unit: torch.Tensor, prefix: int, colormap: str, side: int) -> np.ndarray:
    rgb = (colorize(unit.float().cpu(), colormap) * 255).round().to(torch.uint8)  # (Nq, Nk, 3)
    nq, nk = unit.shape
    f = max(1, side // max(nq, nk))
    if max(nq, nk) <= side:
        rgb = rgb.repeat_interleave(f, 0).repeat_interleave(f, 1)
    else:
        f = side / max(nq, nk)
        rgb = torch.from_numpy(np.asarray(Image.fromarray(rgb.numpy()).resize((side, side), Image.NEAREST)))
    tile = rgb.numpy().copy()
    if prefix > 0:  # the class token(s): a white line after its row(s) and column(s)
        edge = int(round(prefix * f))
        tile[min(edge, tile.shape[0] - 1), :] = 255
        tile[:, min(edge, tile.shape[1] - 1)] = 255
    return tile


def matrix_picture(unit: torch.Tensor, prefix: int, lines: List[Line], scale: str, norm: str = "fixed",
                   colormap: str = "jet", max_width: int = MAX_WIDTH,
                   axes: Tuple[str, str] = ("query token", "key token")) -> np.ndarray:
    """One image's attention matrix ``unit`` ``(Nq, Nk)`` (colour-map positions) with axis labels (``axes``:
    rows, columns; token by token by default, channel by channel for a covariance map), the class token
    marked, caption ``lines`` and a colour bar."""
    left, top = 16, LINE_H + 2
    side = max_width - left - 4
    tile = _matrix_tile(unit, prefix, colormap, side)
    cap_h = LINE_H * len(lines) + 2
    bar = colour_bar(max_width, scale, norm, colormap)
    height = cap_h + top + tile.shape[0] + COL_GAP + bar.shape[0]
    canvas = _canvas(height, max_width)
    y0 = cap_h + top
    canvas[y0 : y0 + tile.shape[0], left : left + tile.shape[1]] = tile
    canvas[-bar.shape[0] :] = bar
    nq, nk = unit.shape
    texts = [(1, LINE_H * k, t, c, FONT_SIZE) for k, (t, c) in enumerate(lines)]
    key_label = f"{axes[1]} 0..{nk - 1} ->" + ("  (cls = 0, white line)" if prefix else "")
    texts.append((left, cap_h, fit_text(key_label, max_width - left), DIM, FONT_SIZE - 1))
    out = _write(canvas, texts)
    # the vertical axis label, drawn sideways
    label = f"{axes[0]} 0..{nq - 1} ->"
    strip = _write(_canvas(left - 2, tile.shape[0]), [(2, 1, fit_text(label, tile.shape[0] - 4, FONT_SIZE - 1), DIM,
                                                       FONT_SIZE - 1)])
    out[y0 : y0 + tile.shape[0], : left - 2] = np.rot90(strip, k=-1)  # reads top to bottom
    return out


def hwc(batch: torch.Tensor) -> List[np.ndarray]:
    """``(B, 3, H, W)`` uint8 -> a list of HWC numpy arrays."""
    return list(batch.permute(0, 2, 3, 1).cpu().numpy())


def notes_footer(notes: Sequence[Line], width: int) -> np.ndarray:
    """Text lines ``width`` px wide (a picture's notes, e.g. its faithfulness), HWC uint8."""
    canvas = _canvas(LINE_H * len(notes) + 2, width)
    return _write(canvas, [(1, LINE_H * k, fit_text(t, width - 2), c, FONT_SIZE) for k, (t, c) in enumerate(notes)])


def draw_box(tile: np.ndarray, box: Sequence[int], image_hw: Sequence[int], colour: Colour = (255, 255, 255)) -> None:
    """Outline ``box`` (x0, y0, x1, y1 in input pixels) on ``tile`` (HWC, a picture of an ``image_hw`` input)."""
    fy, fx = tile.shape[0] / image_hw[0], tile.shape[1] / image_hw[1]
    x0, x1 = int(round(box[0] * fx)), min(int(round(box[2] * fx)), tile.shape[1]) - 1
    y0, y1 = int(round(box[1] * fy)), min(int(round(box[3] * fy)), tile.shape[0]) - 1
    tile[y0:y1 + 1, [x0, x1]] = colour
    tile[[y0, y1], x0:x1 + 1] = colour


def map_picture(base: torch.Tensor, layer_map, image_hw: Sequence[int], labels: Sequence[List[Line]],
                norm: str = "fixed", colormap: str = "jet", alpha: float = 0.5,
                max_width: int = MAX_WIDTH, notes: Sequence[Line] = (), boxes: Optional[Sequence] = None,
                image_notes: Optional[Sequence[List[Line]]] = None) -> np.ndarray:
    """A :class:`~visattn.maps.readout.LayerMap` over ``base`` (float RGB in [0, 1], ``(B, 3, H', W')``, the
    pictures of ``image_hw`` inputs): per image, its caption ``labels`` and a line with the map's range and
    peakedness above the original and its overlay; ``notes`` (lines about the whole map, e.g. how faithful it
    is) and the colour bar below. ``boxes``: each image's object box, outlined on both tiles; ``image_notes``:
    more lines per image (e.g. its scores against the box)."""
    over = hwc(blend(base, layer_map.unit(norm), layer_map.geometry, image_hw, alpha, colormap))
    originals = hwc(to_uint8(base))
    cells = []
    for i, st in enumerate(layer_map.stats()):
        lines = list(labels[i]) + [(caption(st, layer_map.scale, norm), DIM)] + list((image_notes or [[]] * (i + 1))[i])
        if boxes is not None:
            originals[i], over[i] = originals[i].copy(), over[i].copy()
            for tile in (originals[i], over[i]):
                draw_box(tile, boxes[i], image_hw)
        cells.append((lines, [originals[i], over[i]]))

    def footer(w: int) -> np.ndarray:
        bar = colour_bar(w, layer_map.scale, norm, colormap)
        return np.concatenate([notes_footer(notes, w), bar]) if notes else bar

    return cells_picture(cells, footer, max_width)


def image_picture(base: torch.Tensor, layer_map, i: int, image_hw: Sequence[int], pred: str, confidence: float,
                  norm: str = "fixed", colormap: str = "jet", alpha: float = 0.5) -> np.ndarray:
    """One picture ``base`` (``(1, 3, H', W')`` in [0, 1]) with image ``i`` of a map: the prediction and its
    confidence, the map's name and range, the picture beside its overlay and the colour bar (``visualize``)."""
    tile_w = 2 * int(base.shape[-1]) + GAP
    one = replace(layer_map, heat=layer_map.heat[i : i + 1])
    label = [(f"pred: {pred} ({confidence:.1%})", TEXT), (fit_text(layer_map.name, tile_w - 4), TEXT)]
    return map_picture(base, one, image_hw, [label], norm, colormap, alpha)


# ----------------------------------------------------------------------------- captions and descriptions


def class_captions(logits: Any, labels: Optional[torch.Tensor], class_names: Optional[Sequence[str]],
                   width: int) -> List[List[Line]]:
    """Per image, the true and predicted class (green when right, red when wrong; "?" when unknown)."""
    b = len(logits)
    preds = logits.argmax(-1).tolist() if isinstance(logits, torch.Tensor) and logits.dim() == 2 else [None] * b
    trues = labels.tolist() if labels is not None else [None] * b

    def name_of(i):
        if i is None:
            return "?"
        return str(class_names[i]) if class_names is not None and 0 <= i < len(class_names) else str(i)

    out = []
    for t, p in zip(trues, preds):
        colour = TEXT if t is None or p is None else (RIGHT if t == p else WRONG)
        out.append([(line, colour) for line in label_lines(name_of(t), name_of(p), width)])
    return out


def faithfulness_notes(row: Any, images: int, versus_prior: Sequence[Any]) -> List[Line]:
    """A map's card lines about its faithfulness on the probe: deletion and insertion scores against random
    orders, each followed by its paired difference to the centre prior (``versus_prior``:
    :meth:`~visattn.maps.faithful.FaithfulnessReport.versus`), with their intervals (green: better, interval
    included; red: worse; grey: not told apart)."""
    def colour(iv) -> tuple:
        return RIGHT if iv.lo > 0 else (WRONG if iv.hi < 0 else DIM)

    d, i = versus_prior
    return [(f"faithfulness, {images} probe images:", DIM),
            (f"deletion vs random {row.deletion_score}", colour(row.deletion_score)),
            (f"  vs centre prior {d}", colour(d)),
            (f"insertion vs random {row.insertion_score}", colour(row.insertion_score)),
            (f"  vs centre prior {i}", colour(i))]


def box_notes(hit: torch.Tensor, energy: torch.Tensor, chance: float, area: float) -> Tuple[List[List[Line]], List[Line]]:
    """Lines against the objects' boxes: per image (hit or miss, energy in the box) and for the probe."""
    per_image = [[(f"box: {'hit' if h else 'miss'}, energy {e:.2f}", RIGHT if h else WRONG)]
                 for h, e in zip(hit.tolist(), energy.tolist())]
    return per_image, [(f"box: pointing {int(hit.sum())}/{len(hit)} (chance {chance:.0%})", TEXT),
                       (f"energy in box {energy.mean():.2f} (box area {area:.2f})", TEXT)]


def describe(lm: Any) -> str:
    """A :class:`~visattn.maps.readout.LayerMap`'s one-line description (TensorBoard's text tab): what it is
    (its kind's words, :mod:`.kinds`), its scale and where its cells lie; a map made elsewhere (a baseline, a
    caller's) keeps its ``note``."""
    kind = kind_of(lm.kind)
    if kind.words is None:
        return lm.note
    where = lm.geometry.describe() if kind.placed else f"a {' x '.join(kind.axes)} matrix, not placed on the image"
    placed = f" ({lm.info['where']})" if lm.info.get("where") else ""  # a family's own placement (.families)
    return f"{kind.words(lm, lm.info.get('owner', 'block'))}{placed}; scale: {scale_title(lm.scale)}; {where}"

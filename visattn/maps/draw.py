"""Pictures of maps: tiles with captions, colour bars with numeric ticks, attention matrices with axes.

Everything returns HWC uint8 numpy arrays (what ``SummaryWriter.add_image(..., dataformats="HWC")`` and PIL
take). Pictures are at most :data:`MAX_WIDTH` pixels wide, the content width of TensorBoard's default image
card (a 318 px card basis less 2 x 16 px padding), so they show at full size without a scroll bar: probe
images are laid out in as many columns as fit.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from .overlay import blend, colorize, to_uint8
from .scale import caption, scale_title, ticks

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
    c = np.empty((h, w, 3), dtype=np.uint8)
    c[:] = BG
    return c


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
                   colormap: str = "jet", max_width: int = MAX_WIDTH) -> np.ndarray:
    """One image's token-by-token attention ``unit`` ``(Nq, Nk)`` (colour-map positions) with axis labels
    (rows: query token, columns: key token), the class token marked, caption ``lines`` and a colour bar."""
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
    key_label = f"key token 0..{nk - 1} ->" + ("  (cls = 0, white line)" if prefix else "")
    texts.append((left, cap_h, fit_text(key_label, max_width - left), DIM, FONT_SIZE - 1))
    out = _write(canvas, texts)
    # the vertical axis label, drawn sideways
    label = f"query token 0..{nq - 1} ->"
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


__all__ = ["draw_box", "hwc", "map_picture", "BG", "COL_GAP", "DIM", "GAP", "LINE_H", "MAX_WIDTH", "RIGHT", "TEXT", "WRONG",
           "cells_picture",
           "colour_bar", "fit_text", "font", "label_lines", "matrix_picture", "notes_footer", "text_width"]

"""Log a model's attention maps to TensorBoard from one probe forward pass.

Tags (stable across steps, so TensorBoard's step slider walks through training):

* ``maps/<layer>``: spatial gates, token attention (class-token row, or attention received averaged over
  queries without a class token) and pooling weights, as overlays;
* ``maps/<layer>/cls_head<i>``: each head's class-token row, for token layers with a class token;
* ``maps/rollout``: attention rollout through the last run of token layers on one grid;
* ``matrix/<layer>``: the first probe image's token-by-token attention (mean over heads);
* ``channel/<layer>`` (histograms): channel gate values.

Every ``maps/`` image is one grid: a row per probe image, the original beside its overlay, upscaled by
``scale``, with the true and predicted class written above (green when right, red when wrong).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from ..attention.tap import AttentionRecord
from .overlay import colorize, images_to_float, normalize_maps, overlay, to_uint8
from .record import _unwrap, record_attention, spatial_heatmap
from .rollout import attention_rollout

_GAP = 2  # pixels between tiles
_ROW_GAP = 6  # pixels between probe images
_BG = (24, 24, 24)
_TEXT = (235, 235, 235)
_RIGHT, _WRONG = (110, 230, 110), (255, 110, 110)
_POOL_CLS = {"cls", "token"}
_POOL_MEAN = {"mean", "avg", "gap"}
_POOL_SEQ = {"seq", "sequence", "attn", "attention"}


@lru_cache(maxsize=1)
def _font() -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=12)  # Pillow >= 10.1 ships a scalable default font
    except TypeError:
        return ImageFont.load_default()


def _text_lines(text: str) -> int:
    return text.count("\n") + 1


def _compose(rows: List[List[np.ndarray]], captions: List[Tuple[str, Tuple[int, int, int]]]) -> np.ndarray:
    """Tiles ``rows[i][j]`` (HWC uint8, one height per row) into one HWC image, a caption above each row."""
    font = _font()
    line_h = 14
    cap_h = [4 + line_h * _text_lines(c[0]) if c[0] else 0 for c in captions]
    widths = [sum(t.shape[1] for t in row) + _GAP * (len(row) - 1) for row in rows]
    width = max(widths)
    height = sum(r[0].shape[0] for r in rows) + sum(cap_h) + _ROW_GAP * (len(rows) - 1)
    canvas = np.empty((height, width, 3), dtype=np.uint8)
    canvas[:] = _BG
    y = 0
    text_at = []
    for row, (cap, colour), ch in zip(rows, captions, cap_h):
        text_at.append((y + 2, cap, colour))
        y += ch
        x = 0
        for tile in row:
            canvas[y : y + tile.shape[0], x : x + tile.shape[1]] = tile
            x += tile.shape[1] + _GAP
        y += row[0].shape[0] + _ROW_GAP
    img = Image.fromarray(canvas)
    draw = ImageDraw.Draw(img)
    for ty, cap, colour in text_at:
        if cap:
            draw.multiline_text((2, ty), cap, fill=colour, font=font, spacing=2)
    return np.asarray(img)


def _caption(true: str, pred: str, width: int) -> str:
    one = f"true: {true}   pred: {pred}"
    font = _font()
    return one if font.getlength(one) <= width - 4 else f"true: {true}\npred: {pred}"


def _hwc(batch_u8: torch.Tensor) -> List[np.ndarray]:
    return list(batch_u8.permute(0, 2, 3, 1).cpu().numpy())


def _pool_mode(model: torch.nn.Module) -> Optional[str]:
    for attr in ("pool", "global_pool"):
        value = getattr(model, attr, None)
        if isinstance(value, str):
            v = value.lower()
            if v in _POOL_CLS:
                return "cls"
            if v in _POOL_MEAN:
                return "mean"
            if v in _POOL_SEQ:
                return "seq"
    return None


def _rollout_layers(token_records: List[AttentionRecord]) -> List[AttentionRecord]:
    """The last run of consecutive token records sharing token count, grid and prefix (a transformer trunk)."""
    run: List[AttentionRecord] = []
    for r in token_records:
        key = (r.weights.shape[-1], r.grid, r.num_prefix_tokens)
        if run and key != (run[-1].weights.shape[-1], run[-1].grid, run[-1].num_prefix_tokens):
            run = []
        run.append(r)
    return run


@torch.no_grad()
def log_attention_maps(
    writer: Any,
    model: torch.nn.Module,
    images: torch.Tensor,
    labels: Optional[torch.Tensor],
    step: int,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
    class_names: Optional[Sequence[str]] = None,
    scale: int = 4,
    colormap: str = "jet",
    alpha: float = 0.5,
    head_maps: str = "all",
) -> Dict[str, List[str]]:
    """Run one probe forward pass of ``images`` (normalised model input, ``(B, 3, H, W)``) and log its maps.

    The pass runs in eval mode under ``torch.no_grad()`` with the RNG state forked; afterwards every
    module's train/eval flag is what it was, and parameters, BN statistics and gradients are untouched.
    ``writer``: a ``SummaryWriter`` (anything with ``add_image``/``add_histogram``). ``labels``: ``(B,)``
    true classes or None. ``mean``/``std``: the normalisation to undo for display. ``scale``: upscaling
    of the displayed images (32x32 at 4 -> 128 px). ``head_maps``: which class-token layers get one
    ``cls_head<i>`` image per head: ``"all"``, ``"last"`` (the last such layer) or ``"none"`` (each image
    costs a PNG encode; a 9-layer, 12-head ViT writes 108 of them with ``"all"``).
    Returns ``{"images": tags, "histograms": tags, "skipped": names}`` (skipped: no drawable map).
    """
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")
    if head_maps not in ("all", "last", "none"):
        raise ValueError(f"unknown head_maps {head_maps!r}; valid: all, last, none")
    if images.dim() != 4:
        raise ValueError(f"images must be (B, 3, H, W), got {tuple(images.shape)}")
    param = next(model.parameters(), None)
    device = param.device if param is not None else images.device
    images = images.to(device)
    b, _, h, w = images.shape
    out_hw = (h * scale, w * scale)

    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        rng_devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=rng_devices), record_attention(model) as rec:
            out = model(images)
    finally:
        for m, training in modes:  # per module, so deliberately frozen submodules stay as they were
            m.training = training

    logits = out[0] if isinstance(out, (tuple, list)) else out
    preds = logits.argmax(-1).tolist() if isinstance(logits, torch.Tensor) and logits.dim() == 2 else [None] * b
    trues = labels.tolist() if labels is not None else [None] * b

    def name_of(i):
        if i is None:
            return "?"
        return str(class_names[i]) if class_names is not None and 0 <= i < len(class_names) else str(i)

    tile_w = 2 * out_hw[1] + _GAP
    captions = []
    for t, p in zip(trues, preds):
        colour = _TEXT if t is None or p is None else (_RIGHT if t == p else _WRONG)
        captions.append((_caption(name_of(t), name_of(p), tile_w), colour))
    # Un-normalised and upscaled once; every overlay below blends onto this (B, 3, H*scale, W*scale) in [0, 1].
    base = images_to_float(images, mean, std, out_hw)
    originals = _hwc(to_uint8(base))

    summary: Dict[str, List[str]] = {"images": [], "histograms": [], "skipped": []}

    def add_overlay(tag: str, heat: torch.Tensor) -> None:
        over = _hwc(overlay(base, heat, alpha=alpha, colormap=colormap))
        grid = _compose([[o, v] for o, v in zip(originals, over)], captions)
        writer.add_image(tag, grid, step, dataformats="HWC")
        summary["images"].append(tag)

    cls_layers = [r for r in rec.records if r.kind == "token" and r.num_prefix_tokens > 0]
    head_layers = {"all": cls_layers, "last": cls_layers[-1:], "none": []}[head_maps]
    seen: Dict[str, int] = {}
    for r in rec.records:
        # A block called twice in one pass records twice; later calls get "@1", "@2" so tags stay unique.
        k = seen.get(r.name, 0)
        seen[r.name] = k + 1
        name = (r.name or "model") + (f"@{k}" if k else "")
        if r.kind == "channel":
            tag = f"channel/{name}"
            writer.add_histogram(tag, r.weights.cpu(), step)
            summary["histograms"].append(tag)
            continue
        try:
            heat = spatial_heatmap(r, image_hw=(h, w))  # (B, gh, gw)
        except ValueError:
            summary["skipped"].append(name)
            continue
        add_overlay(f"maps/{name}", heat)
        if r.kind != "token":
            continue
        p = r.num_prefix_tokens
        if any(r is hl for hl in head_layers):
            for head in range(r.weights.shape[1]):
                add_overlay(f"maps/{name}/cls_head{head}", r.weights[:, head, 0, p:].reshape(heat.shape))
        # The first image's full attention matrix, rows = queries, cols = keys, upscaled to >= 256 px.
        mat = normalize_maps(r.weights[0].mean(0)[None])[0]  # (Nq, Nk)
        factor = max(1, -(-256 // max(mat.shape)))
        rgb = to_uint8(colorize(mat, colormap))  # (Nq, Nk, 3)
        rgb = rgb.repeat_interleave(factor, 0).repeat_interleave(factor, 1).cpu().numpy()
        tag = f"matrix/{name}"
        writer.add_image(tag, _compose([[rgb]], [captions[0]]), step, dataformats="HWC")
        summary["images"].append(tag)

    layers = _rollout_layers([r for r in rec.records if r.kind == "token"])
    if layers:
        p = layers[0].num_prefix_tokens
        mode = _pool_mode(_unwrap(model))
        pools = [r for r in rec.records if r.kind == "pool" and r.weights.shape[-1] == layers[0].weights.shape[-1]]
        if mode is None:
            mode = "cls" if p > 0 else ("seq" if pools else "mean")
        if mode == "cls" and p == 0:
            mode = "mean"
        readout = pools[-1] if mode == "seq" and pools else ("mean" if mode == "seq" else mode)
        try:
            grid = layers[0].grid or tuple(spatial_heatmap(layers[0], image_hw=(h, w)).shape[-2:])
            heat = attention_rollout(layers, num_prefix_tokens=p, readout=readout, grid=grid)
        except ValueError:
            summary["skipped"].append("rollout")
        else:
            add_overlay("maps/rollout", heat)
    return summary

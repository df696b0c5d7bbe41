"""``python -m visattn.visualize --checkpoint RUN/best.pt --images a.png b.jpg --out DIR``: a trained model's
attention maps on your own pictures.

Every image (any size; RGB, RGBA, greyscale, palette) is resized to the model's input size
(``data.image_size`` of the checkpoint's run), all of them go through one eval forward pass under
:func:`visattn.maps.record_attention`, and for each image the tool writes one PNG per attention layer that
has a spatial map (spatial gates, token attention, pooling weights; plus ``rollout`` when the model's token
layers lie on one grid): the picture beside its overlay, at its own aspect ratio, upscaled by ``--scale``,
with the predicted class and its confidence written above. ``predictions.json`` lists every image's
prediction and the files made from it. Channel attention (SE, ECA, CBAM's channel gate) has no spatial
layout and draws nothing.

    DIR/predictions.json
    DIR/<image stem>__<layer>.png       e.g. dog__layers.0.units.0.attn.spatial.png, dog__rollout.png

``--validation N`` instead of ``--images`` draws N images of the checkpoint's held-out split (from its
``data.root``, or ``--data``; one per class in turn, the trainer's probe batch, or the first N with
``--pick first``) exactly as TensorBoard shows them: one grid per ``maps/`` or
``matrix/`` tag, written by the same code as the training logger (``log_attention_maps``), with the true
and predicted class above each row. The README's pictures are made this way.

    DIR/maps__<layer>.png, DIR/maps__rollout.png, DIR/matrix__<layer>.png

Problems are one ``error: ...`` line and a non-zero exit status: 2 for a missing or unreadable image, a bad
checkpoint or a bad option; 1 for a model without spatial attention (its ``predictions.json`` is still
written, with no maps).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from .attention.tap import AttentionRecord
from .data import spread_indices
from .errors import CheckpointError, ConfigError, DataError, VisattnError
from .maps.overlay import COLORMAPS, overlay, to_uint8
from .maps.record import _unwrap, find_taps, record_attention, spatial_heatmap
from .maps.rollout import attention_rollout
from .maps.tensorboard import _GAP, _TEXT, _compose, _font, _pool_mode, _rollout_layers

TOP_K = 3  # classes listed per image in predictions.json


@dataclass
class InputImage:
    path: str
    mode: str  # PIL mode of the file, e.g. "RGBA"
    size: Tuple[int, int]  # (W, H) of the file
    display: torch.Tensor  # uint8 (3, H, W): the picture as drawn, at its own size
    model_input: torch.Tensor  # uint8 (3, S, S): resized to what the model takes


def load_image(path: str, image_size: int, fill: Sequence[float] = (0.5, 0.5, 0.5)) -> InputImage:
    """Read one image file into RGB; transparent pixels are composited onto ``fill`` (RGB in [0, 1]).

    ``fill`` defaults to mid-grey; the CLI passes the dataset mean, which normalises to a zero input, so a
    transparent background is "nothing" to the model rather than black.
    Raises :class:`DataError` for a missing, unreadable or non-image file.
    """
    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.exists():
        raise DataError(f"image {path!r} not found")
    if not p.is_file():
        raise DataError(f"image {path!r} is not a file")
    try:
        with Image.open(p) as im:
            im.load()
            mode, size = im.mode, im.size
            has_alpha = im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info
            if has_alpha:
                rgba = im.convert("RGBA")
                bg = Image.new("RGBA", rgba.size, tuple(int(round(255 * f)) for f in fill) + (255,))
                rgb = Image.alpha_composite(bg, rgba).convert("RGB")
            else:
                rgb = im.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise DataError(f"cannot read image {path!r}: {e.__class__.__name__}") from None
    if min(size) < 1:
        raise DataError(f"image {path!r} is empty ({size[0]}x{size[1]})")
    # Bilinear, as the dataset decoder resizes training images, so the model sees what it was trained on.
    small = rgb.resize((image_size, image_size), Image.BILINEAR) if rgb.size != (image_size, image_size) else rgb
    return InputImage(path=str(path), mode=mode, size=size, display=_chw(rgb), model_input=_chw(small))


def _chw(im: Any) -> torch.Tensor:
    return torch.from_numpy(np.array(im, dtype=np.uint8)).permute(2, 0, 1).contiguous()  # (3, H, W) uint8


def layer_maps(records: Sequence[AttentionRecord], model: torch.nn.Module,
               image_hw: Tuple[int, int]) -> List[Tuple[str, str, torch.Tensor]]:
    """``(name, kind, heat (B, h, w))`` for every record with a spatial map, in call order, then the rollout.

    Names follow the TensorBoard logger's ``maps/`` tags: a block called twice gets ``@1`` on its second
    record. The rollout (``"rollout"``, kind ``"rollout"``) is added when all token records lie on one
    grid (same token count, grid and prefix), read out the way the model pools (class token, mean, or its
    sequence-pooling weights).
    """
    out: List[Tuple[str, str, torch.Tensor]] = []
    seen: Dict[str, int] = {}
    for r in records:
        k = seen.get(r.name, 0)
        seen[r.name] = k + 1
        if r.kind == "channel":
            continue  # (B, C) gates: no spatial layout
        try:
            heat = spatial_heatmap(r, image_hw=image_hw)
        except ValueError:
            continue
        out.append(((r.name or "model") + (f"@{k}" if k else ""), r.kind, heat))

    tokens = [r for r in records if r.kind == "token"]
    layers = _rollout_layers(tokens)
    if tokens and len(layers) == len(tokens):
        p = layers[0].num_prefix_tokens
        n = layers[0].weights.shape[-1]
        pools = [r for r in records if r.kind == "pool" and r.weights.shape[-1] == n]
        mode = _pool_mode(_unwrap(model)) or ("cls" if p > 0 else ("seq" if pools else "mean"))
        if mode == "cls" and p == 0:
            mode = "mean"
        readout: Any = pools[-1] if mode == "seq" and pools else ("mean" if mode == "seq" else mode)
        try:
            grid = layers[0].grid or tuple(spatial_heatmap(layers[0], image_hw=image_hw).shape[-2:])
            out.append(("rollout", "rollout", attention_rollout(layers, num_prefix_tokens=p, readout=readout, grid=grid)))
        except ValueError:
            pass
    return out


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "image"


def _display_hw(size_wh: Tuple[int, int], longer: int) -> Tuple[int, int]:
    w, h = size_wh
    s = longer / max(w, h)
    return max(1, round(h * s)), max(1, round(w * s))


def _fit(text: str, width: int) -> str:
    """Shorten ``text`` from the left ("...s.0.attn") until it fits ``width`` pixels in the caption font."""
    font = _font()
    if font.getlength(text) <= width:
        return text
    while len(text) > 4 and font.getlength("..." + text) > width:
        text = text[1:]
    return "..." + text


def _stem_names(paths: Sequence[str]) -> List[str]:
    """File-name stems, made unique ("cat", "cat-2") when two inputs share one."""
    used: Dict[str, int] = {}
    out = []
    for p in paths:
        stem = _safe(Path(p).stem)
        n = used.get(stem, 0) + 1
        used[stem] = n
        out.append(stem if n == 1 else f"{stem}-{n}")
    return out


@torch.no_grad()
def visualize(checkpoint: str, images: Sequence[str], out_dir: str, alpha: float = 0.5, scale: int = 4,
              colormap: str = "jet", device: str = "auto") -> Dict[str, Any]:
    """Write the maps and ``predictions.json`` for ``images`` into ``out_dir``; returns the JSON's content.

    Raises :class:`VisattnError` (after writing ``predictions.json``) when the model has no spatial maps.
    """
    from .data import normalize

    _check_options(alpha, scale, colormap)
    if not images:
        raise DataError("no images given")
    for path in images:  # a typo fails here, before the model is loaded
        if not Path(path).exists():
            raise DataError(f"image {path!r} not found")
    dev = _device(device)
    model, cfg, state = _load(checkpoint, dev)
    classes = [str(c) for c in (state.get("classes") or [])]
    size = cfg.data.image_size
    mean, std = tuple(cfg.data.mean), tuple(cfg.data.std)
    loaded = [load_image(p, size, fill=mean) for p in images]

    batch = torch.stack([im.model_input for im in loaded]).to(dev)  # (B, 3, S, S) uint8
    x = normalize(batch, mean, std)
    model.eval()
    with record_attention(model) as rec:
        logits = model(x)
    probs = torch.softmax(logits.float(), dim=-1).cpu()  # (B, classes)
    maps = layer_maps(rec.records, model, (size, size))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    longer = size * scale
    tile_w = 2 * longer + _GAP
    names = _stem_names(images)

    def label(c: int) -> str:
        return classes[c] if 0 <= c < len(classes) else str(c)

    entries = []
    for i, (im, stem) in enumerate(zip(loaded, names)):
        conf, idx = probs[i].topk(min(TOP_K, probs.shape[1]))
        pred = label(int(idx[0]))
        # (1, 3, h, w) in [0, 1] at the file's aspect; antialiased, so a large photo shrinks without aliasing
        base = F.interpolate(im.display[None].float() / 255.0, size=_display_hw(im.size, longer), mode="bilinear",
                             align_corners=False, antialias=True).clamp(0, 1)
        original = to_uint8(base)[0].permute(1, 2, 0).numpy()
        files: Dict[str, str] = {}
        for name, kind, heat in maps:
            # The map covers the square model input; stretched back to the file's aspect it lies on what it saw.
            over = overlay(base, heat[i : i + 1].cpu(), alpha=alpha, colormap=colormap)[0].permute(1, 2, 0).numpy()
            caption = f"pred: {pred} ({float(conf[0]):.1%})\n{_fit(name, tile_w - 4)}"
            fname = f"{stem}__{_safe(name)}.png"
            _save_png(_compose([[original, over]], [(caption, _TEXT)]), out / fname)
            files[name] = fname
        entries.append({
            "image": im.path, "mode": im.mode, "size": list(im.size), "pred": pred, "class_index": int(idx[0]),
            "confidence": float(conf[0]), "top": [{"class": label(int(c)), "p": float(q)} for q, c in zip(conf, idx)],
            "maps": files,
        })

    taps = find_taps(model)
    result = {
        "checkpoint": str(checkpoint), "model": cfg.model.name, "image_size": size, "classes": classes,
        "layers": [{"name": n, "kind": k} for n, k, _ in maps], "images": entries,
    }
    (out / "predictions.json").write_text(json.dumps(result, indent=2) + "\n")
    if not maps:
        kinds = sorted({t.kind for _, t in taps})
        why = "has no attention layers" if not taps else f"has only {'/'.join(kinds)} attention, which has no spatial map"
        raise VisattnError(f"model {cfg.model.name!r} {why}: wrote {out / 'predictions.json'} and no maps")
    return result


class _PngWriter:
    """Stands in for a ``SummaryWriter``: keeps ``log_attention_maps``' images as PNG files in ``out``."""

    def __init__(self, out: Path):
        self.out = out
        self.files: Dict[str, str] = {}

    def add_image(self, tag: str, img: np.ndarray, step: int, dataformats: str = "HWC") -> None:
        if dataformats != "HWC":
            raise ValueError(f"expected HWC images from log_attention_maps, got {dataformats}")
        fname = "__".join(_safe(part) for part in tag.split("/")) + ".png"
        _save_png(np.ascontiguousarray(img), self.out / fname)
        self.files[tag] = fname

    def add_histogram(self, tag: str, values: Any, step: int) -> None:
        pass  # channel gates: nothing to draw


@torch.no_grad()
def validation_grids(checkpoint: str, count: int, out_dir: str, data: Optional[str] = None, alpha: float = 0.5,
                     scale: int = 4, colormap: str = "jet", device: str = "auto",
                     head_maps: str = "last", pick: str = "spread") -> Dict[str, str]:
    """TensorBoard's ``maps/`` and ``matrix/`` pictures of ``count`` held-out images, as PNG files.

    The held-out split is the one the run was scored on: the checkpoint's ``data`` settings (``data.root``
    replaced by ``data`` when given). ``pick="spread"`` (default): one image per class in turn, the trainer's probe batch; ``"first"``: the first ``count``;
    ``"spread"``: the first image of each class in turn, then the second, ... (a held-out split may be
    ordered by class). Returns ``{tag: file name}``.
    """
    from .data import load_splits, normalize
    from .maps.tensorboard import log_attention_maps

    _check_options(alpha, scale, colormap)
    if count < 1:
        raise ConfigError(f"--validation must be >= 1, got {count}")
    dev = _device(device)
    model, cfg, state = _load(checkpoint, dev)
    if cfg.channels_last:  # as the run evaluated it (and drew its TensorBoard maps)
        model.to(memory_format=torch.channels_last)
    dcfg = cfg.data.model_copy()
    if data is not None:
        dcfg.source, dcfg.root = ("synthetic", dcfg.root) if data == "synthetic" else ("auto", data)
    splits = load_splits(dcfg, cfg.seed)
    classes = [str(c) for c in (state.get("classes") or splits.eval.classes)]
    idx = _pick(splits.eval.y, count, pick)
    x = normalize(torch.from_numpy(splits.eval.x[idx]).permute(0, 3, 1, 2), cfg.data.mean, cfg.data.std)
    y = torch.from_numpy(splits.eval.y[idx])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = _PngWriter(out)
    log_attention_maps(writer, model, x.to(dev), y, 0, cfg.data.mean, cfg.data.std, classes, scale=scale,
                       colormap=colormap, alpha=alpha, head_maps=head_maps)
    if not writer.files:
        why = "has no attention layers" if not find_taps(model) else "has no attention layer with a spatial map"
        raise VisattnError(f"model {cfg.model.name!r} {why}: no pictures written")
    return writer.files


def _pick(labels: np.ndarray, count: int, pick: str) -> np.ndarray:
    if pick == "first":
        return np.arange(min(count, len(labels)))
    if pick != "spread":
        raise ConfigError(f"--pick {pick!r} is unknown; valid: first, spread")
    return spread_indices(labels, count)


def _check_options(alpha: float, scale: int, colormap: str) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"--alpha must be in [0, 1], got {alpha}")
    if scale < 1:
        raise ConfigError(f"--scale must be >= 1, got {scale}")
    if colormap not in COLORMAPS:
        raise ConfigError(f"--colormap {colormap!r} is unknown; valid: {', '.join(COLORMAPS)}")


def _device(name: str) -> torch.device:
    from . import engine

    try:
        return engine.resolve_device(name)
    except RuntimeError as e:
        raise ConfigError(f"--device {name!r}: {str(e).splitlines()[0]}") from None


def _load(checkpoint: str, dev: torch.device) -> Tuple[torch.nn.Module, Any, Dict[str, Any]]:
    from .evaluate import load_model_from_checkpoint

    try:
        return load_model_from_checkpoint(checkpoint, dev)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, VisattnError) and not isinstance(e, ConfigError):
            raise
        # a checkpoint whose stored config or weights do not describe a model this version can build
        raise CheckpointError(f"checkpoint {checkpoint!r} cannot be rebuilt into a model ({e})") from None


def _save_png(hwc: np.ndarray, path: Path) -> None:
    from PIL import Image

    Image.fromarray(hwc).save(path, optimize=True)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m visattn.visualize", description=__doc__.splitlines()[0].strip("`: "),
                                epilog="--images: one PNG per image and attention layer, plus predictions.json, in --out. "
                                       "--validation N: TensorBoard's grids of N held-out images, one PNG per tag.")
    p.add_argument("--checkpoint", required=True, help="a visattn checkpoint (RUN/best.pt or RUN/last.pt)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", nargs="+", help="image files (any size; RGB, RGBA, greyscale)")
    src.add_argument("--validation", type=int, metavar="N", help="the first N images of the run's held-out split")
    p.add_argument("--out", required=True, help="folder for the PNGs (and predictions.json); created")
    p.add_argument("--data", default=None, help="--validation: dataset path or 'synthetic' (default: the run's data.root)")
    p.add_argument("--pick", choices=["first", "spread"], default="spread",
                   help="--validation: the first N images (the trainer's probe), or one per class in turn")
    p.add_argument("--head-maps", choices=["all", "last", "none"], default="last",
                   help="--validation: class-token layers that also get a picture per head")
    p.add_argument("--alpha", type=float, default=0.5, help="weight of the colour map in the overlay, 0 to 1")
    p.add_argument("--scale", type=int, default=4, help="upscaling of the model's input size for display (32 px * 4)")
    p.add_argument("--colormap", default="jet", help=f"one of {', '.join(COLORMAPS)}")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    args = p.parse_args(argv)
    try:
        from .options import check_device, check_range

        check_range("--scale", args.scale, 1, 32)  # the display size: 32 px * scale
        check_range("--alpha", args.alpha, 0.0, 1.0)
        if args.validation is not None:
            check_range("--validation", args.validation, 1, 10_000)
        check_device("--device", args.device)
        if args.validation is not None:
            files = validation_grids(args.checkpoint, args.validation, args.out, args.data, args.alpha, args.scale,
                                     args.colormap, args.device, args.head_maps, args.pick)
            print(f"wrote {len(files)} picture(s) to {args.out}: {', '.join(sorted(files.values()))}")
            return 0
        result = visualize(args.checkpoint, args.images, args.out, args.alpha, args.scale, args.colormap, args.device)
    except VisattnError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # the system's refusal (an --out that is a file, disk full): one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    n_maps = sum(len(e["maps"]) for e in result["images"])
    for e in result["images"]:
        print(f"{e['image']}: {e['pred']} ({e['confidence']:.1%})")
    print(f"wrote {n_maps} map(s) for {len(result['layers'])} layer(s) and predictions.json to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

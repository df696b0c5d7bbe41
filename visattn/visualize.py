"""``python -m visattn.visualize --checkpoint RUN/best.pt --images a.png b.jpg --out DIR``: a trained model's
attention maps on your own pictures.

``--images``: every image (any size; RGB, RGBA, greyscale, palette) is resized to the model's input size and
all go through one recorded eval pass (and, unless ``--no-gradient-maps``, one backward pass for the predicted
class); per image and map (spatial gates, token attention, pooling weights, ``rollout``, the ``/grad`` maps,
``rollout_grad``, ``layers_grad``) one PNG, the picture beside its overlay at its own aspect ratio, with the
prediction, the layer and the map's range above and the colour bar below, as
``DIR/<image stem>__<layer>.png``; ``DIR/predictions.json`` lists every prediction and file. Channel
attention has no spatial layout and draws nothing.

``--validation N``: N images of the checkpoint's held-out split exactly as TensorBoard shows them, written by
the training logger's own code, one ``DIR/maps__<layer>.png`` / ``DIR/matrix__<layer>.png`` per tag, and the
tags' descriptions in ``DIR/descriptions.md`` (the README's pictures are made this way). ``--faithfulness N``
prints the faithfulness table (:func:`visattn.faithfulness`) of N held-out images (with ``--out`` also
``faithfulness.json``); ``--maps NAME ...`` scores only those maps.

``--grid``: TensorBoard's ``maps/grid_probe`` card for the checkpoint, ``DIR/grid_probe.png``: a 2x2 grid of
held-out images of four distinct classes beside each class's own map, titled with its share in its class's cell
(:mod:`visattn.maps.grid`); a model that takes only its own input size sees the grid downscaled to it.

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

from .data import spread_indices
from .data.sources import to_rgb
from .errors import CheckpointError, ConfigError, DataError, VisattnError
from .maps.readout import LayerMap, read_maps
from .maps.record import find_taps, probe_pass
from .maps.render import COLORMAPS, NORMS, image_picture
from .models.layout import to_channels_last
from .options import describe

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
    import warnings

    from PIL import Image, UnidentifiedImageError

    from .data.sources import DEFAULT_MAX_PIXELS

    p = Path(path)
    if not p.exists():
        raise DataError(f"image {path!r} not found")
    if not p.is_file():
        raise DataError(f"image {path!r} is not a file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(p)  # the header only: a decompression bomb is refused before it is decoded
        with im:
            if im.size[0] * im.size[1] > DEFAULT_MAX_PIXELS:
                raise DataError(f"image {path!r} is {im.size[0]}x{im.size[1]} pixels, more than "
                                f"{DEFAULT_MAX_PIXELS:,} (a decompression bomb?)")
            im.load()
            mode, size = im.mode, im.size
            has_alpha = im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info
            if has_alpha:
                rgba = im.convert("RGBA")
                bg = Image.new("RGBA", rgba.size, tuple(int(round(255 * f)) for f in fill) + (255,))
                rgb = Image.alpha_composite(bg, rgba).convert("RGB")
            else:
                rgb = to_rgb(im)  # as the dataset decoder: 16-bit samples scaled to 8 bits, CMYK, palette, grey
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # over Pillow's limit, so over ours
        raise DataError(f"image {path!r} has more than {DEFAULT_MAX_PIXELS:,} pixels (a decompression bomb?)") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"cannot read image {path!r}: {e.__class__.__name__}") from None
    if min(size) < 1:
        raise DataError(f"image {path!r} is empty ({size[0]}x{size[1]})")
    # Bilinear, as the dataset decoder resizes training images, so the model sees what it was trained on.
    small = rgb.resize((image_size, image_size), Image.BILINEAR) if rgb.size != (image_size, image_size) else rgb
    return InputImage(path=str(path), mode=mode, size=size, display=_chw(rgb), model_input=_chw(small))


def _chw(im: Any) -> torch.Tensor:
    return torch.from_numpy(np.array(im, dtype=np.uint8)).permute(2, 0, 1).contiguous()  # (3, H, W) uint8


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "image"


def _display_hw(size_wh: Tuple[int, int], longer: int) -> Tuple[int, int]:
    w, h = size_wh
    s = longer / max(w, h)
    return max(1, round(h * s)), max(1, round(w * s))


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


def visualize(checkpoint: str, images: Sequence[str], out_dir: str, alpha: float = 0.5, scale: int = 4,
              colormap: str = "jet", device: str = "auto", norm: str = "fixed",
              gradient_maps: bool = True) -> Dict[str, Any]:
    """Write the maps and ``predictions.json`` for ``images`` into ``out_dir``; returns the JSON's content.
    ``gradient_maps``: also the gradient-weighted maps for each image's predicted class (one backward pass).

    Raises :class:`VisattnError` (after writing ``predictions.json``) when the model has no spatial maps.
    """
    from .data import normalize

    _check_options(alpha, scale, colormap, norm)
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
    x = normalize(torch.stack([im.model_input for im in loaded]).to(dev), mean, std)  # (B, 3, S, S)
    rec, logits = probe_pass(model, x, gradients=gradient_maps)  # explains the predicted classes
    probs = torch.softmax(logits.float(), dim=-1).cpu()  # (B, classes)
    maps = read_maps(rec.records, model, x.shape)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def label(c: int) -> str:
        return classes[c] if 0 <= c < len(classes) else str(c)

    entries = []
    for i, (im, stem) in enumerate(zip(loaded, _stem_names(images))):
        conf, idx = probs[i].topk(min(TOP_K, probs.shape[1]))
        pred = label(int(idx[0]))
        # (1, 3, h, w) in [0, 1] at the file's aspect; antialiased, so a large photo shrinks without aliasing.
        # The maps cover the square model input; placed proportionally they lie on what they saw.
        base = F.interpolate(im.display[None].float() / 255.0, size=_display_hw(im.size, size * scale), mode="bilinear",
                             align_corners=False, antialias=True).clamp(0, 1)
        files: Dict[str, str] = {}
        for lm in maps:
            fname = f"{stem}__{_safe(lm.name)}.png"
            picture = image_picture(base, lm, i, (size, size), pred, float(conf[0]), norm, colormap, alpha)
            _save_png(picture, out / fname)
            files[lm.name] = fname
        entries.append({
            "image": im.path, "mode": im.mode, "size": list(im.size), "pred": pred, "class_index": int(idx[0]),
            "confidence": float(conf[0]), "top": [{"class": label(int(c)), "p": float(q)} for q, c in zip(conf, idx)],
            "maps": files,
        })
    return _write_predictions(out, checkpoint, cfg, model, classes, maps, entries)


def _write_predictions(out: Path, checkpoint: str, cfg: Any, model: torch.nn.Module, classes: List[str],
                       maps: List[LayerMap], entries: List[Dict[str, Any]]) -> Dict[str, Any]:
    result = {
        "checkpoint": str(checkpoint), "model": cfg.model.name, "image_size": cfg.data.image_size, "classes": classes,
        "layers": [{"name": m.name, "kind": m.kind, "scale": m.scale, "geometry": m.geometry.describe()} for m in maps],
        "images": entries,
    }
    (out / "predictions.json").write_text(json.dumps(result, indent=2) + "\n")
    if not maps:
        taps = find_taps(model)
        kinds = sorted({t.kind for _, t in taps})
        why = ("has no attention layers" if not taps
               else f"has only {'/'.join(kinds)} attention, which has no spatial map")
        raise VisattnError(f"model {cfg.model.name!r} {why}: wrote {out / 'predictions.json'} and no maps")
    return result


class _PngWriter:
    """Stands in for a ``SummaryWriter``: keeps ``log_attention_maps``' images as PNG files in ``out`` and its
    descriptions as ``descriptions.md``."""

    def __init__(self, out: Path):
        self.out = out
        self.files: Dict[str, str] = {}

    def add_image(self, tag: str, img: np.ndarray, step: int, dataformats: str = "HWC") -> None:
        if dataformats != "HWC":
            raise ValueError(f"expected HWC images from log_attention_maps, got {dataformats}")
        fname = "__".join(_safe(part) for part in tag.split("/")) + ".png"
        _save_png(np.ascontiguousarray(img), self.out / fname)
        self.files[tag] = fname

    def add_text(self, tag: str, text: str, step: int) -> None:
        (self.out / "descriptions.md").write_text(text + "\n")

    def add_histogram(self, tag: str, values: Any, step: int) -> None:
        pass  # channel gates: nothing to draw

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        pass


def heldout_batch(checkpoint: str, count: int, data: Optional[str] = None, device: str = "auto",
                  pick: str = "spread", with_boxes: bool = False) -> Tuple[Any, ...]:
    """``(model, config, classes, images, labels)``: ``count`` images of the checkpoint's held-out split
    (the split the run was scored on; ``data.root`` replaced by ``data`` when given), normalised as the
    model takes them. ``pick="spread"``: one image per class in turn (the trainer's probe batch);
    ``"first"``: the first ``count`` (a held-out split may be ordered by class). ``with_boxes``: also the
    images' object boxes ``(count, 4)`` (``data.source=placed``; None for other data), a sixth item."""
    from .data import load_splits, normalize

    if count < 1:
        raise ConfigError(f"the number of held-out images must be >= 1, got {count}")
    dev = _device(device)
    model, cfg, state = _load(checkpoint, dev)
    if cfg.channels_last:  # as the run evaluated it (and drew its TensorBoard maps); backward runs here
        to_channels_last(model, dev)
    dcfg = cfg.data.model_copy()
    if data is not None:
        dcfg.source, dcfg.root = ("synthetic", dcfg.root) if data == "synthetic" else ("auto", data)
    splits = load_splits(dcfg, cfg.seed)
    classes = [str(c) for c in (state.get("classes") or splits.eval.classes)]
    idx = _pick(splits.eval.y, count, pick)
    x = normalize(torch.from_numpy(splits.eval.x[idx]).permute(0, 3, 1, 2), cfg.data.mean, cfg.data.std)
    out = (model, cfg, classes, x.to(dev), torch.from_numpy(splits.eval.y[idx]).long().to(dev))
    if with_boxes:
        boxes = splits.eval.boxes
        return (*out, None if boxes is None else torch.from_numpy(boxes[idx]))
    return out


def validation_grids(checkpoint: str, count: int, out_dir: str, data: Optional[str] = None, alpha: float = 0.5,
                     scale: int = 4, colormap: str = "jet", device: str = "auto",
                     head_maps: str = "last", pick: str = "spread", norm: str = "fixed",
                     gradient_maps: bool = True) -> Dict[str, str]:
    """TensorBoard's ``maps/`` and ``matrix/`` pictures of ``count`` held-out images (:func:`heldout_batch`),
    as PNG files, drawn by the training logger's own code; returns ``{tag: file name}``."""
    from .maps.tensorboard import MapSettings, log_attention_maps

    _check_options(alpha, scale, colormap, norm)
    model, cfg, classes, x, y, boxes = heldout_batch(checkpoint, count, data, device, pick, with_boxes=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = _PngWriter(out)
    settings = MapSettings(cfg.data.mean, cfg.data.std, classes, scale=scale, colormap=colormap, alpha=alpha,
                           head_maps=head_maps, norm=norm, gradient_maps=gradient_maps,
                           tolerance=cfg.data.placed.tolerance)
    log_attention_maps(writer, model, x, y, 0, settings, boxes=boxes)  # placed objects: their boxes and scores
    if not writer.files:
        why = "has no attention layers" if not find_taps(model) else "has no attention layer with a spatial map"
        raise VisattnError(f"model {cfg.model.name!r} {why}: no pictures written")
    return writer.files


def grid_file(checkpoint: str, out_dir: str, data: Optional[str] = None, alpha: float = 0.5, scale: int = 4,
              colormap: str = "jet", device: str = "auto") -> Path:
    """``DIR/grid_probe.png``: the TensorBoard grid card (:class:`~visattn.maps.tensorboard.GridCard`) for the
    checkpoint: a 2x2 grid of held-out images of four distinct classes beside each class's map; returns its
    path. A model that takes only its own input size sees the grid downscaled to it."""
    from .maps.grid import grid_picture, grid_probe

    _check_options(alpha, scale, colormap)
    model, cfg, classes, x, y = heldout_batch(checkpoint, 16, data, device, "spread")
    gp = grid_probe(model, x, y)
    if gp is None:
        raise DataError(f"--grid needs held-out images of 4 distinct classes; the split has {len(set(y.tolist()))}")
    if not gp.map.finite():
        raise VisattnError(f"model {cfg.model.name!r}: the grid's class maps hold NaN or inf; no picture written")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "grid_probe.png"
    _save_png(np.ascontiguousarray(grid_picture(gp, cfg.data.mean, cfg.data.std, classes, scale, colormap, alpha)),
              path)
    return path


def faithfulness_table(checkpoint: str, count: int, data: Optional[str] = None, device: str = "auto",
                       pick: str = "spread", out_dir: Optional[str] = None, precision: Optional[str] = None,
                       **options: Any) -> Any:
    """:func:`visattn.faithfulness` on ``count`` held-out images with their true labels, under the run's
    precision (or ``precision``); ``options`` go to it (``steps``, ``regions``, ``fill``, ``draws``,
    ``batch_size``, ``seed``, ``names``, ``gradient_maps``). Writes ``faithfulness.json`` into ``out_dir``
    when given. Returns the report."""
    from .evaluate import autocast, resolve_precision
    from .maps.faithful import faithfulness

    model, cfg, classes, x, y = heldout_batch(checkpoint, count, data, device, pick)
    precision = resolve_precision(precision or cfg.precision, x.device)
    try:
        with autocast(x.device, precision):  # as the run evaluated: bf16 and channels-last are 2-3x faster
            report = faithfulness(model, x, y, **options)
    except ValueError as e:  # an unknown map name
        raise ConfigError(f"--maps: {e}") from None
    if not report.rows:
        raise VisattnError(f"model {cfg.model.name!r} has no map to score")
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        doc = {"checkpoint": str(checkpoint), "model": cfg.model.name, **report.as_dict()}
        (Path(out_dir) / "faithfulness.json").write_text(json.dumps(doc, indent=2) + "\n")
    return report


def _pick(labels: np.ndarray, count: int, pick: str) -> np.ndarray:
    if pick == "first":
        return np.arange(min(count, len(labels)))
    if pick != "spread":
        raise ConfigError(f"--pick {pick!r} is unknown; valid: first, spread")
    return spread_indices(labels, count)


def _check_options(alpha: float, scale: int, colormap: str, norm: str = "fixed") -> None:
    from .options import check_range

    if norm not in NORMS:
        raise ConfigError(f"--map-norm {norm!r} is unknown; valid: {', '.join(NORMS)}")
    check_range("--alpha", alpha, 0.0, 1.0)
    check_range("--scale", scale, 1, 32)  # the display size: 32 px * scale
    if colormap not in COLORMAPS:
        raise ConfigError(f"--colormap {colormap!r} is unknown; valid: {', '.join(COLORMAPS)}")


def _device(name: str) -> torch.device:
    from .options import resolve_device

    try:
        return resolve_device(name)
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m visattn.visualize", description=describe(__doc__),
                                epilog="--images: one PNG per image and attention layer, plus predictions.json, in --out. "
                                       "--validation N: TensorBoard's grids of N held-out images, one PNG per tag. "
                                       "--faithfulness N: the faithfulness table of N held-out images.")
    p.add_argument("--checkpoint", required=True, help="a visattn checkpoint (RUN/best.pt or RUN/last.pt)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", nargs="+", help="image files (any size; RGB, RGBA, greyscale)")
    src.add_argument("--validation", type=int, metavar="N", help="N images of the run's held-out split")
    src.add_argument("--grid", action="store_true",
                     help="a 2x2 grid of held-out images of 4 classes beside each class's map: DIR/grid_probe.png")
    src.add_argument("--faithfulness", type=int, metavar="N", help="print the faithfulness table of N held-out images")
    p.add_argument("--out", default=None,
                   help="folder for the PNGs (and JSON); created (required but for --faithfulness)")
    p.add_argument("--data", default=None, help="--validation/--faithfulness: dataset path or 'synthetic' "
                                                "(default: the run's data.root)")
    p.add_argument("--pick", choices=["first", "spread"], default="spread",
                   help="held-out images: the first N, or one per class in turn (the trainer's probe)")
    p.add_argument("--head-maps", choices=["all", "last", "none"], default="last",
                   help="--validation: class-token layers that also get a picture per head")
    p.add_argument("--map-norm", choices=list(NORMS), default="fixed",
                   help="fixed: each map kind on its declared scale (default); "
                        "per_image: stretched to each map's range")
    p.add_argument("--alpha", type=float, default=0.5, help="weight of the colour map in the overlay, 0 to 1")
    p.add_argument("--scale", type=int, default=4, help="upscaling of the model's input size for display (32 px * 4)")
    p.add_argument("--colormap", default="jet", help=f"one of {', '.join(COLORMAPS)}")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--no-gradient-maps", dest="gradient_maps", action="store_false",
                   help="leave out the gradient-weighted maps (<layer>/grad, rollout_grad, layers_grad) and their "
                        "backward pass")
    f = p.add_argument_group("--faithfulness")
    f.add_argument("--steps", type=int, default=16, help="deletion/insertion steps")
    f.add_argument("--regions", type=int, default=8, help="the image is cut into regions x regions squares")
    f.add_argument("--fill", choices=["mean", "blur"], default="mean", help="what replaces a deleted square")
    f.add_argument("--draws", type=int, default=3, help="random orders per image")
    f.add_argument("--batch-size", type=int, default=256)
    f.add_argument("--maps", nargs="+", default=None, metavar="NAME",
                   help="score only these maps (e.g. rollout layers.2.units.0.attn.spatial); default: all")
    f.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default=None,
                   help="default: the run's precision")
    return p


def _check_cli_options(args: argparse.Namespace) -> None:
    from .options import check_device, check_range

    _check_options(args.alpha, args.scale, args.colormap, args.map_norm)
    for flag, value, hi in (("--validation", args.validation, 10_000), ("--faithfulness", args.faithfulness, 100_000),
                            ("--steps", args.steps, 1024), ("--regions", args.regions, 64), ("--draws", args.draws, 100),
                            ("--batch-size", args.batch_size, 65536)):
        if value is not None:
            check_range(flag, value, 1, hi)
    check_device("--device", args.device)


def _run(args: argparse.Namespace) -> int:
    _check_cli_options(args)
    if args.faithfulness is not None:
        report = faithfulness_table(args.checkpoint, args.faithfulness, args.data, args.device, args.pick, args.out,
                                    args.precision, steps=args.steps, regions=args.regions, fill=args.fill,
                                    draws=args.draws, batch_size=args.batch_size, names=args.maps,
                                    gradient_maps=args.gradient_maps)
        print(f"{args.checkpoint}:\n{report.table()}")
        return 0
    if args.out is None:
        raise ConfigError("--out is required with --images, --validation and --grid")
    if args.grid:
        path = grid_file(args.checkpoint, args.out, args.data, args.alpha, args.scale, args.colormap, args.device)
        print(f"wrote {path}")
        return 0
    if args.validation is not None:
        files = validation_grids(args.checkpoint, args.validation, args.out, args.data, args.alpha, args.scale,
                                 args.colormap, args.device, args.head_maps, args.pick, args.map_norm,
                                 args.gradient_maps)
        print(f"wrote {len(files)} picture(s) to {args.out}: {', '.join(sorted(files.values()))}")
        return 0
    result = visualize(args.checkpoint, args.images, args.out, args.alpha, args.scale, args.colormap, args.device,
                       args.map_norm, args.gradient_maps)
    n_maps = sum(len(e["maps"]) for e in result["images"])
    for e in result["images"]:
        print(f"{e['image']}: {e['pred']} ({e['confidence']:.1%})")
    print(f"wrote {n_maps} picture(s), {len(result['layers'])} map(s) per image, and predictions.json to {args.out}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except VisattnError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # the system's refusal (an --out that is a file, disk full): one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""CIFAR-10 (and any small image-folder dataset): sources, a decoded uint8 cache, splits and batch loaders.

Sources (``data.source``; ``auto`` tells them apart by what is at ``data.root``):

* ``folder``: an image-folder layout ``train/<class>/*.{jpg,png}`` (optional ``test/<class>/...``), as a
  folder or as a ``.tar.gz`` of one (the form of the JPEG copy of CIFAR-10 this project is tested on);
* ``cifar_python``: the official python version, ``cifar-10-batches-py/`` or ``cifar-10-python.tar.gz``;
* ``torchvision``: ``torchvision.datasets.CIFAR10`` downloads the official archive into ``root`` when
  ``data.download`` is true, then it is read as ``cifar_python``;
* ``synthetic``: class-dependent patterns, for smoke runs and tests.

Every source is decoded once into a uint8 ``(N, H, W, 3)`` array and cached as ``.npz`` beside nothing
the user owns (``data.cache_dir``, default ``$XDG_CACHE_HOME/visattn``), keyed by the source's path, size and
modification time, so later runs start in seconds.

Loaders: :class:`TensorLoader` keeps the uint8 images in one tensor (on the training device) and augments
whole batches with tensor ops (pad + random crop, horizontal flip, cutout) — no per-sample Python on the hot
path; its shuffling and augmentation draw from generators whose state is checkpointed, so a resumed run sees
the same batches. ``loader: albumentations`` runs the same pipeline, plus any extra albumentations transforms
from the config, per sample in a ``torch.utils.data.DataLoader``.
"""
from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from .errors import DataError

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
ARCHIVE_EXTS = (".tar.gz", ".tgz", ".tar")


@dataclass
class ImageSet:
    """Decoded images: ``x`` uint8 ``(N, H, W, 3)``, ``y`` int64 ``(N,)``."""

    x: np.ndarray
    y: np.ndarray
    classes: Tuple[str, ...]

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class Splits:
    train: ImageSet
    eval: ImageSet
    eval_split: str  # human-readable: which split the reported figures come from
    source: str
    skipped: int = 0  # unreadable images skipped (data.on_bad_image=skip)


# ------------------------------------------------------------------------------------------- decoding


def _decode_image(data: bytes, name: str, size: int) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            im = im.convert("RGB")
            if im.size != (size, size):
                im = im.resize((size, size), Image.BILINEAR)
            return np.asarray(im, dtype=np.uint8)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise DataError(f"corrupt or unreadable image {name}: {e.__class__.__name__}") from None


def _split_class_of(parts: Sequence[str]) -> Optional[Tuple[str, str]]:
    """('train'|'test', class) for a path ``.../<split>/<class>/<file>``, else None."""
    if len(parts) >= 3 and parts[-3] in ("train", "test"):
        return parts[-3], parts[-2]
    return None


def _collect(items: Iterator[Tuple[str, bytes]], origin: str, size: int, on_bad: str) -> Tuple[Dict[str, Dict[str, List[np.ndarray]]], int]:
    """Group decoded images by split and class; ``items`` yields (relative path, bytes)."""
    found: Dict[str, Dict[str, List[np.ndarray]]] = {}
    skipped = 0
    for rel, data in items:
        parts = rel.replace("\\", "/").strip("/").split("/")
        if not parts[-1].lower().endswith(IMAGE_EXTS):
            continue
        sc = _split_class_of(parts)
        if sc is None:
            raise DataError(
                f"{origin}: file {rel!r} is not in the layout train/<class>/<image> (or test/<class>/<image>)"
            )
        try:
            img = _decode_image(data, f"{origin}:{rel}" if origin.endswith(ARCHIVE_EXTS) else os.path.join(origin, rel), size)
        except DataError:
            if on_bad == "skip":
                skipped += 1
                continue
            raise
        found.setdefault(sc[0], {}).setdefault(sc[1], []).append(img)
    return found, skipped


def _iter_dir(root: Path) -> Iterator[Tuple[str, bytes]]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in sorted(filenames):
            p = Path(dirpath) / fn
            yield str(p.relative_to(root)), p.read_bytes()


def _iter_tar(path: Path) -> Iterator[Tuple[str, bytes]]:
    try:
        with tarfile.open(path, "r:*") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                f = tf.extractfile(m)
                if f is None:
                    continue
                yield m.name, f.read()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise DataError(f"archive {path} is truncated or corrupt ({e.__class__.__name__}: {e})") from None


def _empty_class_dirs(root: Path) -> List[str]:
    out = []
    for split in ("train", "test"):
        d = root / split
        if d.is_dir():
            for c in sorted(p for p in d.iterdir() if p.is_dir()):
                if not any(f.suffix.lower() in IMAGE_EXTS for f in c.iterdir()):
                    out.append(str(c))
    return out


def read_image_folder(path: Path, image_size: int = 32, on_bad_image: str = "error") -> Tuple[Dict[str, ImageSet], int]:
    """Read ``train/<class>/*`` (and ``test/<class>/*``) from a folder or a tar archive of one."""
    if path.is_dir():
        if not (path / "train").is_dir():
            raise DataError(f"{path}: no train/ folder (expected train/<class>/<image>)")
        empty = _empty_class_dirs(path)
        if empty:
            raise DataError(f"class folder {empty[0]} holds no images")
        found, skipped = _collect(_iter_dir(path), str(path), image_size, on_bad_image)
    else:
        found, skipped = _collect(_iter_tar(path), str(path), image_size, on_bad_image)
    if "train" not in found:
        raise DataError(f"{path}: no images under train/<class>/ (expected train/<class>/<image>)")
    classes = tuple(sorted(found["train"]))
    if len(classes) < 2:
        raise DataError(f"{path}: train/ holds {len(classes)} class folder(s); need at least 2")
    out: Dict[str, ImageSet] = {}
    for split, by_class in found.items():
        extra = sorted(set(by_class) - set(classes))
        if extra:
            raise DataError(f"{path}: {split}/{extra[0]} is a class that train/ does not have")
        xs, ys = [], []
        for ci, c in enumerate(classes):
            imgs = by_class.get(c, [])
            if split == "train" and not imgs:
                raise DataError(f"{path}: class folder train/{c} holds no readable images")
            xs.extend(imgs)
            ys.extend([ci] * len(imgs))
        out[split] = ImageSet(np.stack(xs), np.asarray(ys, dtype=np.int64), classes)
    return out, skipped


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles the official CIFAR batches (dicts of numpy arrays and lists) and nothing else."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("copyreg", "_reconstructor"),
        ("builtins", "object"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _load_batch(path: Path) -> Dict[str, Any]:
    try:
        with open(path, "rb") as f:
            d = _NumpyOnlyUnpickler(f, encoding="latin1").load()
    except FileNotFoundError:
        raise DataError(f"CIFAR batch file {path} is missing") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise DataError(f"CIFAR batch file {path} is corrupt or not a CIFAR batch ({e})") from None
    if not isinstance(d, dict) or "data" not in d or "labels" not in d:
        raise DataError(f"CIFAR batch file {path} lacks 'data'/'labels'")
    return d


def _batches_dir(path: Path) -> Path:
    for cand in (path, path / "cifar-10-batches-py"):
        if (cand / "data_batch_1").is_file():
            return cand
    raise DataError(f"{path}: no cifar-10-batches-py/data_batch_1 found")


def read_cifar_python(path: Path, cache_dir: Path) -> Dict[str, ImageSet]:
    """The official CIFAR-10 python batches, from the extracted folder or ``cifar-10-python.tar.gz``."""
    if path.is_file():  # the archive: extract once into the cache folder
        dest = cache_dir / ("extract-" + _fingerprint(path)[:16])
        if not (dest / "cifar-10-batches-py" / "data_batch_1").is_file():
            dest.mkdir(parents=True, exist_ok=True)
            try:
                with tarfile.open(path, "r:*") as tf:
                    tf.extractall(dest, filter="data")
            except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
                raise DataError(f"archive {path} is truncated or corrupt ({e.__class__.__name__})") from None
        path = dest
    bdir = _batches_dir(path)
    classes = CIFAR10_CLASSES
    meta = bdir / "batches.meta"
    if meta.is_file():
        m = _load_batch_meta(meta)
        classes = tuple(m) if m else classes

    def read(names: Sequence[str]) -> ImageSet:
        xs, ys = [], []
        for n in names:
            d = _load_batch(bdir / n)
            data = np.asarray(d["data"], dtype=np.uint8)
            if data.ndim != 2 or data.shape[1] != 3072:
                raise DataError(f"CIFAR batch file {bdir / n} has data of shape {data.shape}, expected (N, 3072)")
            xs.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
            ys.append(np.asarray(d["labels"], dtype=np.int64))
        return ImageSet(np.ascontiguousarray(np.concatenate(xs)), np.concatenate(ys), classes)

    out = {"train": read([f"data_batch_{i}" for i in range(1, 6)])}
    if (bdir / "test_batch").is_file():
        out["test"] = read(["test_batch"])
    return out


def _load_batch_meta(path: Path) -> List[str]:
    try:
        with open(path, "rb") as f:
            d = _NumpyOnlyUnpickler(f, encoding="latin1").load()
        return [str(s) for s in d.get("label_names", [])]
    except Exception:  # a broken meta file only costs the class names
        return []


def make_synthetic(n: int, num_classes: int = 10, size: int = 32, seed: int = 0) -> ImageSet:
    """Learnable class patterns: each class a colour and a stripe orientation/frequency, plus noise."""
    g = np.random.default_rng(seed)
    y = np.arange(n) % num_classes
    g.shuffle(y)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    colours = g.uniform(0.2, 0.8, size=(num_classes, 3)).astype(np.float32)
    angles = np.linspace(0, np.pi, num_classes, endpoint=False)
    freq = 2 + (np.arange(num_classes) % 3) * 2
    x = np.empty((n, size, size, 3), dtype=np.uint8)
    for c in range(num_classes):
        idx = np.nonzero(y == c)[0]
        wave = 0.5 + 0.5 * np.sin(2 * np.pi * freq[c] * (np.cos(angles[c]) * xx + np.sin(angles[c]) * yy))
        base = colours[c][None, None, :] * (0.6 + 0.4 * wave[..., None])
        noise = g.normal(0, 0.12, size=(len(idx), size, size, 3)).astype(np.float32)
        x[idx] = np.clip((base[None] + noise) * 255, 0, 255).astype(np.uint8)
    return ImageSet(x, y.astype(np.int64), tuple(f"class{c}" for c in range(num_classes)))


# ------------------------------------------------------------------------------------ source & cache


def _fingerprint(path: Path, *extra: Any) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{extra}".encode())
    if path.is_dir():  # a folder's own mtime misses edits deep inside: add the class folders'
        for p in sorted(path.glob("*/*")):
            h.update(f"{p}|{p.stat().st_mtime_ns}".encode())
    return h.hexdigest()


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "visattn"


def detect_source(root: Path) -> str:
    """Which source the thing at ``root`` is: 'folder' or 'cifar_python' (raises DataError if neither)."""
    if not root.exists():
        raise DataError(f"data.root {str(root)!r} does not exist")
    if root.is_file():
        name = root.name.lower()
        if not name.endswith(ARCHIVE_EXTS):
            raise DataError(f"data.root {str(root)!r} is a file but not a .tar.gz/.tar archive")
        if "cifar-10-python" in name:
            return "cifar_python"
        try:
            with tarfile.open(root, "r:*") as tf:
                first = next((m.name for m in tf if m.isfile()), "")
        except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
            raise DataError(f"archive {root} is truncated or corrupt ({e.__class__.__name__})") from None
        return "cifar_python" if "cifar-10-batches-py" in first else "folder"
    if (root / "data_batch_1").is_file() or (root / "cifar-10-batches-py").is_dir():
        return "cifar_python"
    if (root / "cifar-10-python.tar.gz").is_file():
        return "cifar_python"
    if (root / "train").is_dir():
        return "folder"
    raise DataError(
        f"data.root {str(root)!r} holds neither train/<class>/ images nor cifar-10-batches-py/ "
        "(set data.source=torchvision data.download=true to fetch CIFAR-10)"
    )


def load_splits(cfg: Any, seed: int) -> Splits:
    """Read the dataset named by a :class:`visattn.config.DataConfig` and split it for training/eval.

    ``seed`` drives only the synthetic images; the held-out split and the subset follow ``cfg.split_seed``,
    so runs with different seeds are scored on the same validation images.
    """
    cache_dir = Path(os.path.expanduser(cfg.cache_dir)) if cfg.cache_dir else default_cache_dir()
    source = cfg.source
    skipped = 0
    if source == "synthetic":
        full = make_synthetic(cfg.synthetic_size, size=cfg.image_size, seed=seed)
        parts = {"train": full}
        origin = "synthetic"
    else:
        root = Path(os.path.expandvars(os.path.expanduser(cfg.root)))
        if source == "torchvision":
            root = _torchvision_download(root, cfg.download)
            source = "cifar_python"
        elif source == "auto":
            source = detect_source(root)
        elif not root.exists():
            raise DataError(f"data.root {str(root)!r} does not exist")
        parts, skipped = _cached_read(root, source, cfg.image_size, cfg.on_bad_image, cache_dir)
        origin = str(root)
    train = parts["train"]
    if cfg.use_test_split and "test" in parts:
        ev, eval_split = parts["test"], f"test split of {origin} ({len(parts['test'])} images)"
    else:
        if cfg.val_size >= len(train):
            raise DataError(f"data.val_size={cfg.val_size} is not smaller than the {len(train)} training images")
        if cfg.val_size < len(train.classes):
            raise DataError(f"data.val_size={cfg.val_size} is smaller than the {len(train.classes)} classes")
        tr_idx, va_idx = stratified_split(train.y, cfg.val_size, cfg.split_seed)
        ev = ImageSet(train.x[va_idx], train.y[va_idx], train.classes)
        train = ImageSet(train.x[tr_idx], train.y[tr_idx], train.classes)
        eval_split = f"validation split held out from train ({len(ev)} images, stratified, split seed {cfg.split_seed})"
    if cfg.subset is not None and cfg.subset < len(train):  # after the hold-out: the eval images never change
        keep, _ = stratified_split(train.y, len(train) - cfg.subset, cfg.split_seed + 1)
        train = ImageSet(train.x[keep], train.y[keep], train.classes)
    return Splits(train=train, eval=ev, eval_split=eval_split, source=source, skipped=skipped)


def _cached_read(root: Path, source: str, size: int, on_bad: str, cache_dir: Path) -> Tuple[Dict[str, ImageSet], int]:
    key = _fingerprint(root, source, size, on_bad)[:24]
    cache = cache_dir / f"{root.name.split('.')[0]}-{key}.npz"
    if cache.is_file():
        try:
            with np.load(cache, allow_pickle=False) as z:
                classes = tuple(str(c) for c in z["classes"])
                parts = {s: ImageSet(z[f"{s}_x"], z[f"{s}_y"], classes) for s in ("train", "test") if f"{s}_x" in z}
                return parts, int(z["skipped"])
        except (OSError, ValueError, KeyError, EOFError):
            pass  # a broken cache is rebuilt, never trusted
    if source == "folder":
        parts, skipped = read_image_folder(root, size, on_bad)
    else:
        parts, skipped = read_cifar_python(root, cache_dir), 0
    cache_dir.mkdir(parents=True, exist_ok=True)
    arrays = {f"{s}_{k}": getattr(v, k) for s, v in parts.items() for k in ("x", "y")}
    tmp = cache.with_suffix(f".tmp{os.getpid()}.npz")
    np.savez(tmp, classes=np.asarray(parts["train"].classes), skipped=np.asarray(skipped), **arrays)
    os.replace(tmp, cache)
    return parts, skipped


def _torchvision_download(root: Path, download: bool) -> Path:
    if not download:
        return root
    from torchvision.datasets import CIFAR10

    try:
        CIFAR10(str(root), train=True, download=True)
    except Exception as e:  # network or checksum failure
        raise DataError(f"torchvision could not fetch CIFAR-10 into {root}: {e}") from None
    return root


def spread_indices(y: np.ndarray, k: int) -> np.ndarray:
    """``k`` indices taking the first image of each class in turn (class 0, 1, ..., then the second of each)."""
    per_class = [np.nonzero(y == c)[0] for c in np.unique(y)]
    out: List[int] = []
    j = 0
    while len(out) < min(k, len(y)):
        for idx in per_class:
            if j < len(idx) and len(out) < k:
                out.append(int(idx[j]))
        j += 1
    return np.asarray(out, dtype=np.int64)


def stratified_split(y: np.ndarray, n_out: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Indices (kept, held out) with ``n_out`` held out spread evenly over the classes, seeded."""
    g = np.random.default_rng(seed)
    classes = np.unique(y)
    counts = np.array([(y == c).sum() for c in classes])
    # Largest-remainder apportionment of n_out over the classes, proportional to their sizes.
    quota = counts * n_out / len(y)
    take = np.floor(quota).astype(int)
    for i in np.argsort(-(quota - take), kind="stable")[: n_out - take.sum()]:
        take[i] += 1
    held = []
    for c, k in zip(classes, take):
        idx = np.nonzero(y == c)[0]
        held.append(g.permutation(idx)[:k])
    held_idx = np.sort(np.concatenate(held))
    mask = np.ones(len(y), dtype=bool)
    mask[held_idx] = False
    return np.nonzero(mask)[0], held_idx


# ------------------------------------------------------------------------------------------ augmentation


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


# --------------------------------------------------------------------------------------------- loaders


class TensorLoader:
    """Batches from a uint8 image tensor with whole-batch augmentation; resumable mid-epoch.

    ``x``: uint8 ``(N, H, W, 3)`` numpy array. The permutation of epoch ``e`` is a pure function of
    ``(seed, e)``; augmentation draws from ``self.gen`` whose state is part of :meth:`state_dict`. Under
    data parallelism each rank takes an equal, disjoint share of every epoch's permutation.
    """

    def __init__(
        self,
        images: ImageSet,
        batch_size: int,
        mean: Sequence[float],
        std: Sequence[float],
        train: bool,
        augment: Any = None,
        device: torch.device = torch.device("cpu"),
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        channels_last: bool = False,
    ):
        self.x = torch.from_numpy(images.x).permute(0, 3, 1, 2).contiguous().to(device)  # (N, 3, H, W) uint8
        self.y = torch.from_numpy(images.y).to(device)
        self.batch_size = batch_size
        self.mean, self.std = tuple(mean), tuple(std)
        self.train = train
        self.augment = augment if train else None
        self.device = device
        self.seed = seed
        self.rank, self.world_size = rank, world_size
        self.channels_last = channels_last
        self.epoch = 0
        self.position = 0  # batches already served this epoch (for mid-epoch resume)
        self.gen = torch.Generator(device="cpu").manual_seed(seed * 7919 + 17)
        self._fill = torch.zeros(3, device=device)  # cutout fill: the mean pixel, i.e. 0 after normalisation
        self._scale = (1.0 / (255.0 * torch.tensor(std, device=device))).view(1, 3, 1, 1)
        self._shift = (-torch.tensor(mean, device=device) / torch.tensor(std, device=device)).view(1, 3, 1, 1)

    def _indices(self) -> torch.Tensor:
        n = len(self.y)
        if self.train:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            perm = torch.randperm(n, generator=g)
        else:
            perm = torch.arange(n)
        if self.world_size > 1:  # equal shares: drop the tail that does not divide evenly (train only)
            per = n // self.world_size if self.train else math.ceil(n / self.world_size)
            perm = perm[self.rank :: self.world_size][:per] if self.train else perm[self.rank :: self.world_size]
        return perm

    def __len__(self) -> int:
        n = len(self._indices())
        return n // self.batch_size if self.train else math.ceil(n / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.position = 0
        self.epoch = epoch

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "gen": self.gen.get_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.gen.set_state(state["gen"])

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        idx = self._indices().to(self.device)
        nb = len(self)
        while self.position < nb:
            i = self.position
            sel = idx[i * self.batch_size : (i + 1) * self.batch_size]
            xb = self.x[sel].float()  # 0..255
            if self.augment is not None:
                a = self.augment
                if a.crop_padding:
                    xb = batch_crop(xb, a.crop_padding, a.padding_mode, self.gen)
                if a.hflip:
                    xb = batch_hflip(xb, self.gen)
            xb = xb * self._scale + self._shift
            if self.augment is not None and self.augment.cutout:
                xb = batch_cutout(xb, self.augment.cutout, self._fill, self.gen)
            if self.channels_last:
                xb = xb.contiguous(memory_format=torch.channels_last)
            self.position += 1
            yield xb, self.y[sel]
        self.position = 0
        self.epoch += 1


class _AlbuDataset(torch.utils.data.Dataset):
    def __init__(self, images: ImageSet, pipeline: Any):
        self.images, self.pipeline = images, pipeline

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, int]:
        img = self.pipeline(image=self.images.x[i])["image"]
        return torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1), int(self.images.y[i])


class AlbumentationsLoader:
    """Per-sample albumentations in a DataLoader (any transform the config names); same batch interface."""

    def __init__(self, images: ImageSet, batch_size: int, mean, std, train: bool, augment: Any, image_size: int,
                 workers: int = 0, device: torch.device = torch.device("cpu"), seed: int = 0, rank: int = 0,
                 world_size: int = 1, channels_last: bool = False):
        pipeline = albumentations_pipeline(augment, image_size, mean, train)
        self.ds = _AlbuDataset(images, pipeline)
        self.batch_size, self.train, self.device, self.seed = batch_size, train, device, seed
        self.mean, self.std, self.channels_last = tuple(mean), tuple(std), channels_last
        self.workers, self.rank, self.world_size = workers, rank, world_size
        self.epoch, self.position = 0, 0

    def _sampler(self) -> Any:
        from torch.utils.data import DistributedSampler

        if self.world_size > 1:
            s = DistributedSampler(self.ds, self.world_size, self.rank, shuffle=self.train, seed=self.seed, drop_last=self.train)
            s.set_epoch(self.epoch)
            return s
        if self.train:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            return torch.randperm(len(self.ds), generator=g).tolist()
        return list(range(len(self.ds)))

    def __len__(self) -> int:
        n = len(self.ds) // self.world_size if self.world_size > 1 else len(self.ds)
        return n // self.batch_size if self.train else math.ceil(n / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.position = 0
        self.epoch = epoch

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def __iter__(self):
        from torch.utils.data import DataLoader

        order = list(iter(self._sampler()))[self.position * self.batch_size :]
        dl = DataLoader(self.ds, batch_size=self.batch_size, sampler=order, num_workers=self.workers,
                        drop_last=self.train, pin_memory=self.device.type == "cuda",
                        persistent_workers=False, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        for xb, yb in dl:
            xb = normalize(xb.to(self.device, non_blocking=True), self.mean, self.std)
            if self.channels_last:
                xb = xb.contiguous(memory_format=torch.channels_last)
            self.position += 1
            yield xb, yb.to(self.device, non_blocking=True)
        self.position = 0
        self.epoch += 1


def build_loader(images: ImageSet, cfg: Any, batch_size: int, train: bool, device: torch.device, seed: int,
                 rank: int = 0, world_size: int = 1, channels_last: bool = False) -> Any:
    kw = dict(device=device, seed=seed, rank=rank, world_size=world_size, channels_last=channels_last)
    if cfg.loader == "albumentations":
        return AlbumentationsLoader(images, batch_size, cfg.mean, cfg.std, train, cfg.augment, cfg.image_size,
                                    workers=cfg.workers, **kw)
    return TensorLoader(images, batch_size, cfg.mean, cfg.std, train, cfg.augment, **kw)

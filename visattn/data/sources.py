"""Dataset sources, each decoded to uint8 ``(N, H, W, 3)`` images: an image folder or its tar archive, the
official CIFAR-10 python batches, torchvision's download, and synthetic class patterns.
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import DataError

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



def fingerprint(path: Path, *extra: Any) -> str:
    """A hash of ``path``'s identity (resolved path, size, modification time) and ``extra``."""
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{extra}".encode())
    if path.is_dir():  # a folder's own mtime misses edits deep inside: add the class folders'
        for p in sorted(path.glob("*/*")):
            h.update(f"{p}|{p.stat().st_mtime_ns}".encode())
    return h.hexdigest()


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
        dest = cache_dir / ("extract-" + fingerprint(path)[:16])
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


def torchvision_download(root: Path, download: bool) -> Path:
    if not download:
        return root
    from torchvision.datasets import CIFAR10

    try:
        CIFAR10(str(root), train=True, download=True)
    except Exception as e:  # network or checksum failure
        raise DataError(f"torchvision could not fetch CIFAR-10 into {root}: {e}") from None
    return root


def read_source(root: Path, source: str, image_size: int, on_bad_image: str, cache_dir: Path) -> Tuple[Dict[str, ImageSet], int]:
    """Decode ``root`` as ``source`` ('folder' or 'cifar_python'): (``{"train": ..., "test": ...}``, skipped)."""
    if source == "folder":
        return read_image_folder(root, image_size, on_bad_image)
    return read_cifar_python(root, cache_dir), 0

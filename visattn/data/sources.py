"""Dataset sources, each decoded to uint8 ``(N, H, W, 3)`` images: an image folder or its tar archive, the
official CIFAR-10 python batches, torchvision's download, and synthetic class patterns.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import re
import shutil
import stat
import tarfile
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

import numpy as np

from ..errors import DataError

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp", ".tif", ".tiff", ".gif")  # a GIF: its first frame
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
ARCHIVE_EXTS = (".tar.gz", ".tgz", ".tar")
DEFAULT_MAX_PIXELS = 50_000_000  # data.max_image_pixels' default
# the CIFAR-10 python archive unpacks to six 31 MB batches (178 MB): an archive whose members are larger is
# refused before they are written (a small archive of zeros could otherwise fill the cache)
MAX_CIFAR_MEMBER_BYTES = 64 << 20
MAX_CIFAR_ARCHIVE_BYTES = 512 << 20
Item = Tuple[str, Union[bytes, DataError]]  # (relative path, the file's bytes or why it was refused)


@dataclass
class ImageSet:
    """Decoded images: ``x`` uint8 ``(N, H, W, 3)``, ``y`` int64 ``(N,)``; ``boxes`` int64 ``(N, 4)`` (x0, y0, x1,
    y1 in pixels) where each image's object is known to lie (``data.source=placed``), else None."""

    x: np.ndarray
    y: np.ndarray
    classes: Tuple[str, ...]
    boxes: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.y)



def fingerprint(path: Path, *extra: Any) -> str:
    """A hash of what ``path`` holds, and ``extra``: for a folder, every file's relative path, size, inode and
    modification and change times (an edit whose mtime was put back still moves the change time); for a
    file (an archive), its bytes."""
    h = hashlib.blake2b(f"{path.resolve()}|{extra}".encode(), digest_size=32)
    if path.is_dir():
        for rel, p in walk_files(path):
            try:
                st = p.stat()
            except OSError:  # a dangling link: its target may appear later
                st = p.lstat()
            h.update(f"{rel}|{st.st_size}|{st.st_ino}|{st.st_mtime_ns}|{st.st_ctime_ns}\n".encode())
    else:
        st = path.stat()
        h.update(f"{st.st_size}|".encode())
        if stat.S_ISREG(st.st_mode):
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def walk_files(root: Path, linked: Optional[Set[str]] = None) -> Iterator[Tuple[str, Path]]:
    """Every file under ``root`` as (relative path, path), sorted, following linked folders once each (a link
    loop is walked once). ``linked``: filled with the real paths of the folders walked."""
    seen: Set[str] = set() if linked is None else linked
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames.sort()
        for fn in sorted(filenames):
            p = Path(dirpath) / fn
            yield p.relative_to(root).as_posix(), p


# ------------------------------------------------------------------------------------------- decoding


def _decode_image(data: bytes, name: str, size: int, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < max_pixels:
        Image.MAX_IMAGE_PIXELS = max_pixels  # Pillow's own limit never refuses what the config allows
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))  # reads the header only: the size is known before decoding
        with im:
            w, h = im.size
            if w * h > max_pixels:
                raise DataError(_bomb(name, f"{w}x{h} = {w * h:,}", max_pixels))
            im = to_rgb(im)
            if im.size != (size, size):
                im = im.resize((size, size), Image.BILINEAR)
            return np.asarray(im, dtype=np.uint8)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:  # over Pillow's limit, so over ours
        m = re.search(r"\((\d+) pixels\)", str(e))
        raise DataError(_bomb(name, f"{int(m.group(1)):,}" if m else "more", max_pixels)) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, MemoryError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"corrupt or unreadable image {name}: {e.__class__.__name__}") from None


def _bomb(name: str, pixels: str, max_pixels: int) -> str:
    return f"image {name} is {pixels} pixels, more than data.max_image_pixels={max_pixels:,} (a decompression bomb?)"


def to_rgb(im: Any) -> Any:
    """A PIL image of any mode as 8-bit RGB: 16-bit greyscale scaled to 8 bits (not clipped to white), palette
    with transparency through RGBA, CMYK and greyscale converted."""
    from PIL import Image

    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):  # 16-bit samples (a 32-bit "I" PNG holds 16-bit ones)
        a = np.asarray(im).astype(np.float64)
        im = Image.fromarray(np.clip(np.rint(a / 257.0), 0, 255).astype(np.uint8), "L")
    elif im.mode == "F":
        a = np.asarray(im, dtype=np.float64)
        a = a * 255.0 if np.nanmax(a, initial=0.0) <= 1.0 else a
        im = Image.fromarray(np.clip(np.nan_to_num(a), 0, 255).astype(np.uint8), "L")
    elif im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    return im if im.mode == "RGB" else im.convert("RGB")


def _split_class_of(parts: Sequence[str]) -> Optional[Tuple[str, str]]:
    """('train'|'test', class) for a path ``.../<split>/<class>/<file>``, else None."""
    if len(parts) >= 3 and parts[-3] in ("train", "test"):
        return parts[-3], parts[-2]
    return None


def _collect(items: Iterator[Item], origin: str, size: int, on_bad: str,
             max_pixels: int = DEFAULT_MAX_PIXELS) -> Tuple[Dict[str, Dict[str, List[np.ndarray]]], int]:
    """Group decoded images by split and class; ``items`` yields (relative path, bytes or a refusal)."""
    found: Dict[str, Dict[str, List[np.ndarray]]] = {}
    skipped = 0
    with contextlib.closing(items):  # a refusal closes the source (an archive's file) now, not at garbage collection
        for rel, data in items:
            parts = rel.replace("\\", "/").strip("/").split("/")
            if not parts[-1].lower().endswith(IMAGE_EXTS):
                continue
            sc = _split_class_of(parts)
            if sc is None and not isinstance(data, DataError):
                raise DataError(
                    f"{origin}: file {rel!r} is not in the layout train/<class>/<image> (or test/<class>/<image>)"
                )
            try:
                if isinstance(data, DataError):
                    raise data
                name = f"{origin}:{rel}" if origin.endswith(ARCHIVE_EXTS) else os.path.join(origin, rel)
                img = _decode_image(data, name, size, max_pixels)
            except DataError:
                if on_bad == "skip":
                    skipped += 1
                    continue
                raise
            found.setdefault(sc[0], {}).setdefault(sc[1], []).append(img)
    return found, skipped


def max_file_bytes(max_pixels: int) -> int:
    """The largest image file worth reading: 8 bytes a pixel (16-bit RGBA, uncompressed) plus headers."""
    return 8 * max_pixels + (1 << 20)


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


def _read_image_file(p: Path, name: str, real_root: str, linked: Set[str], max_bytes: int) -> Union[bytes, DataError]:
    """``p``'s bytes, or why they are refused: a link out of the dataset, a special file, a file too large.
    Special files are never opened (a FIFO would block, ``/dev/zero`` never ends)."""
    if p.is_symlink():
        target = os.path.realpath(p)
        inside = [r for r in (real_root, *linked) if os.path.commonpath([target, r]) == r]
        if not inside:
            return DataError(f"image {name} refused: it links out of the dataset folder (to {target})")
    try:
        st = p.stat()
    except OSError as e:
        return DataError(f"image {name} cannot be read ({e.strerror or e.__class__.__name__})")
    kind = next((what for test, what in _KINDS if test(st.st_mode)), None)
    if kind is not None or not stat.S_ISREG(st.st_mode):
        return DataError(f"image {name} refused: it is {kind or 'not a regular file'}, not an image file")
    if st.st_size > max_bytes:
        return DataError(f"image {name} refused: {st.st_size:,} bytes, more than any image within data.max_image_pixels")
    try:
        with open(p, "rb") as f:
            return f.read(max_bytes + 1)
    except OSError as e:
        return DataError(f"image {name} cannot be read ({e.strerror or e.__class__.__name__})")


def _iter_dir(root: Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> Iterator[Item]:
    real_root, linked = os.path.realpath(root), set()
    for rel, p in walk_files(root, linked):
        if p.name.lower().endswith(IMAGE_EXTS):  # other files are never opened
            yield rel, _read_image_file(p, str(p), real_root, linked, max_file_bytes(max_pixels))


def _escapes(name: str) -> bool:
    parts = name.replace("\\", "/").split("/")
    return name.startswith(("/", "\\")) or ".." in parts or (len(parts[0]) > 1 and parts[0][1] == ":")


def _iter_tar(path: Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> Iterator[Item]:
    max_bytes = max_file_bytes(max_pixels)
    try:
        with tarfile.open(path, "r:*") as tf:
            for m in tf:
                if not (m.isfile() or m.issym() or m.islnk()) or not m.name.lower().endswith(IMAGE_EXTS):
                    continue  # other members are never read
                if m.isfile() and _escapes(m.name):
                    yield m.name, DataError(f"archive {path}: member {m.name!r} refused: escapes the dataset folder")
                elif m.isfile() and m.size > max_bytes:
                    yield m.name, DataError(f"image {path}:{m.name} refused: {m.size:,} bytes, more than any image "
                                            "within data.max_image_pixels")
                else:
                    yield m.name, _read_tar_member(tf, m, path, max_bytes)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise DataError(f"archive {path} is truncated or corrupt ({e.__class__.__name__}: {e})") from None


def _read_tar_member(tf: tarfile.TarFile, m: tarfile.TarInfo, path: Path, max_bytes: int) -> Union[bytes, DataError]:
    """An image member's bytes; a link's are those of the member it points at (never a file outside the archive)."""
    try:
        f = tf.extractfile(m)
    except KeyError:
        f = None
    if f is None:
        kind = "symbolic link" if m.issym() else "hard link"
        return DataError(f"image {path}:{m.name} refused: a {kind} to {m.linkname!r}, which the archive does not hold")
    data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        return DataError(f"image {path}:{m.name} refused: more than any image within data.max_image_pixels")
    return data


def _empty_class_dirs(root: Path) -> List[str]:
    out = []
    for split in ("train", "test"):
        d = root / split
        if d.is_dir():
            for c in sorted(p for p in d.iterdir() if p.is_dir()):
                if not any(f.suffix.lower() in IMAGE_EXTS for f in c.iterdir()):
                    out.append(str(c))
    return out


def read_image_folder(path: Path, image_size: int = 32, on_bad_image: str = "error",
                      max_pixels: int = DEFAULT_MAX_PIXELS, need_train: bool = True) -> Tuple[Dict[str, ImageSet], int]:
    """Read ``train/<class>/*`` (and ``test/<class>/*``) from a folder or a tar archive of one.

    ``need_train=False`` (scoring a test set) also takes a folder that holds only ``test/<class>/*``."""
    if path.is_dir():
        if not (path / "train").is_dir() and (need_train or not (path / "test").is_dir()):
            raise DataError(f"{path}: no train/ folder (expected train/<class>/<image>)")
        empty = _empty_class_dirs(path)
        if empty:
            raise DataError(f"class folder {empty[0]} holds no images")
        found, skipped = _collect(_iter_dir(path, max_pixels), str(path), image_size, on_bad_image, max_pixels)
    else:
        found, skipped = _collect(_iter_tar(path, max_pixels), str(path), image_size, on_bad_image, max_pixels)
    first = "train" if "train" in found or need_train else "test"
    if first not in found:
        raise DataError(f"{path}: no images under {first}/<class>/ (expected {first}/<class>/<image>)")
    classes = tuple(sorted(found[first]))
    if len(classes) < 2:
        raise DataError(f"{path}: {first}/ holds {len(classes)} class folder(s); need at least 2")
    out: Dict[str, ImageSet] = {}
    for split, by_class in found.items():
        extra = sorted(set(by_class) - set(classes))
        if extra:
            raise DataError(f"{path}: {split}/{extra[0]} is a class that {first}/ does not have")
        xs, ys = [], []
        for ci, c in enumerate(classes):
            imgs = by_class.get(c, [])
            if split == first and not imgs:
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
    except OSError as e:
        raise DataError(f"CIFAR batch file {path} cannot be read ({e.strerror or e.__class__.__name__})") from None
    if not isinstance(d, dict) or "data" not in d or "labels" not in d:
        raise DataError(f"CIFAR batch file {path} lacks 'data'/'labels'")
    return d


def _batch_arrays(path: Path, d: Dict[str, Any], num_classes: int, on_bad: str) -> Tuple[np.ndarray, np.ndarray, int]:
    """(images (N, 32, 32, 3), labels, images dropped) of one batch; labels of the wrong length, type or range
    are a DataError naming the file (out-of-range ones are dropped and counted under ``on_bad='skip'``)."""
    try:
        data = np.asarray(d["data"], dtype=np.uint8)
        y = np.asarray(d["labels"])
    except (TypeError, ValueError, OverflowError) as e:
        raise DataError(f"CIFAR batch file {path} holds data or labels that are not arrays of numbers ({e})") from None
    if data.ndim != 2 or data.shape[1] != 3072:
        raise DataError(f"CIFAR batch file {path} has data of shape {data.shape}, expected (N, 3072)")
    if y.ndim != 1 or len(y) != len(data):
        raise DataError(f"CIFAR batch file {path} has {y.size} labels for {len(data)} images")
    if len(y) and (y.dtype.kind not in "iu" and not (y.dtype.kind == "f" and np.all(np.mod(y, 1) == 0))):
        raise DataError(f"CIFAR batch file {path} has labels that are not integers ({y.dtype})")
    y = y.astype(np.int64) if len(y) else np.zeros(0, np.int64)
    bad = (y < 0) | (y >= num_classes)
    if bad.any() and on_bad != "skip":
        i = int(np.argmax(bad))
        raise DataError(f"CIFAR batch file {path}: label {y[i]} of image {i} is outside 0..{num_classes - 1}")
    x = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return x[~bad], y[~bad], int(bad.sum())


def _batches_dir(path: Path) -> Path:
    for cand in (path, path / "cifar-10-batches-py"):
        if (cand / "data_batch_1").is_file():
            return cand
    raise DataError(f"{path}: no cifar-10-batches-py/data_batch_1 found")


def _extract(path: Path, dest: Path) -> None:
    """Unpack ``path`` into ``dest`` whole or not at all (a refused member leaves nothing half-extracted)."""
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    total = 0

    def capped(m: tarfile.TarInfo, where: str) -> Optional[tarfile.TarInfo]:
        nonlocal total
        total += m.size
        if m.size > MAX_CIFAR_MEMBER_BYTES or total > MAX_CIFAR_ARCHIVE_BYTES:
            raise DataError(f"archive {path}: member {m.name!r} ({m.size:,} bytes) refused: the CIFAR-10 batches are "
                            f"at most {MAX_CIFAR_MEMBER_BYTES:,} bytes each and {MAX_CIFAR_ARCHIVE_BYTES:,} in all")
        return tarfile.data_filter(m, where)

    try:
        with tarfile.open(path, "r:*") as tf:
            tf.extractall(tmp, filter=capped)
        try:
            _batches_dir(tmp)
        except DataError:
            raise DataError(f"archive {path} holds no cifar-10-batches-py/data_batch_1") from None
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    except tarfile.FilterError as e:
        member = getattr(getattr(e, "tarinfo", None), "name", "?")
        why = "is a special file" if isinstance(e, tarfile.SpecialFileError) else "escapes the dataset folder"
        raise DataError(f"archive {path}: member {member!r} refused: {why}") from None
    except OSError as e:
        if e.errno is None:  # gzip's BadGzipFile: the archive's bytes, not the disk
            raise DataError(f"archive {path} is truncated or corrupt ({e.__class__.__name__})") from None
        raise DataError(f"archive {path} cannot be extracted into {dest.parent} ({e.strerror or e})") from None
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise DataError(f"archive {path} is truncated or corrupt ({e.__class__.__name__})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_cifar_python(path: Path, cache_dir: Path) -> Dict[str, ImageSet]:
    """The official CIFAR-10 python batches, from the extracted folder or ``cifar-10-python.tar.gz``."""
    return read_cifar_batches(path, cache_dir)[0]


def read_cifar_batches(path: Path, cache_dir: Path, on_bad_image: str = "error") -> Tuple[Dict[str, ImageSet], int]:
    """:func:`read_cifar_python`, and the number of images dropped for labels out of range (``on_bad_image='skip'``)."""
    if path.is_file():  # the archive: extract once into the cache folder
        dest = cache_dir / ("extract-" + fingerprint(path)[:16])
        if not any((d / "data_batch_1").is_file() for d in (dest, dest / "cifar-10-batches-py")):
            _extract(path, dest)
        path = dest
    bdir = _batches_dir(path)
    classes = CIFAR10_CLASSES
    meta = bdir / "batches.meta"
    if meta.is_file():
        m = _load_batch_meta(meta)
        classes = tuple(m) if m else classes
    dropped = 0

    def read(names: Sequence[str]) -> ImageSet:
        nonlocal dropped
        xs, ys = [], []
        for n in names:
            x, y, bad = _batch_arrays(bdir / n, _load_batch(bdir / n), len(classes), on_bad_image)
            xs.append(x)
            ys.append(y)
            dropped += bad
        return ImageSet(np.ascontiguousarray(np.concatenate(xs)), np.concatenate(ys), classes)

    out = {"train": read([f"data_batch_{i}" for i in range(1, 6)])}
    if (bdir / "test_batch").is_file():
        out["test"] = read(["test_batch"])
    return out, dropped


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
    if (root / "train").is_dir() or (root / "test").is_dir():
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


def read_source(root: Path, source: str, image_size: int, on_bad_image: str, cache_dir: Path,
                max_pixels: int = DEFAULT_MAX_PIXELS, need_train: bool = True) -> Tuple[Dict[str, ImageSet], int]:
    """Decode ``root`` as ``source`` ('folder' or 'cifar_python'): (``{"train": ..., "test": ...}``, skipped)."""
    try:
        mode = root.stat().st_mode
    except OSError as e:
        raise DataError(f"data.root {str(root)!r} cannot be read ({e.strerror or e.__class__.__name__})") from None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):  # never opened: a FIFO would block for ever
        kind = next((what for test, what in _KINDS if test(mode)), "not a regular file")
        raise DataError(f"data.root {str(root)!r} is {kind}, not a folder or an archive")
    if source == "folder":
        return read_image_folder(root, image_size, on_bad_image, max_pixels, need_train)
    return read_cifar_batches(root, cache_dir, on_bad_image)

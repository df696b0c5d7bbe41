"""The decoded-image cache: each source is decoded once into a ``.npz`` under ``data.cache_dir``.

:func:`cached_read` is handed the reader to call on a miss; its key is the source's
:func:`~visattn.data.sources.fingerprint` and the decode settings, so an edited, added or removed image is a
miss. Every cache carries a ``digest`` (SHA-256 over each array's name, dtype, shape and bytes) that every read
recomputes: a truncated, corrupt, unreadable or altered cache (valid arrays rewritten with ``np.savez``, a cache
written before digests) is rebuilt with one warning line, never trusted, never fatal.
"""
from __future__ import annotations

import hashlib
import os
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from .sources import ImageSet, fingerprint

Parts = Dict[str, ImageSet]  # "train" (and "test") -> images


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "visattn"


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def digest(arrays: Dict[str, np.ndarray]) -> str:
    """SHA-256 over every array of a cache but ``digest`` itself, in name order: its name, dtype, shape and
    bytes, so a changed label, a re-typed or re-shaped array, or an added or dropped one all change it."""
    h = hashlib.sha256()
    for name in sorted(k for k in arrays if k != "digest"):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(memoryview(a).cast("B") if a.size and a.dtype.kind != "U" else a.tobytes())
    return h.hexdigest()


def load_cache(cache: Path, size: Optional[int] = None) -> Tuple[Parts, int]:
    """Read every array of ``cache`` now (a lazy read would fail later, far from here), check its digest (a
    cache without one, or whose arrays do not match it, is not trusted), that the arrays fit together, and that
    the images are ``size`` px square where given (the file's name is the only record of the decode it holds:
    a cache of another size is never trusted); raises ValueError (or the reader's own error) for anything else."""
    with np.load(cache, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    if "digest" not in arrays:
        raise ValueError("it has no digest (written before caches carried one, or rewritten by hand)")
    if arrays["digest"].shape != () or str(arrays["digest"]) != digest(arrays):
        raise ValueError("its arrays do not match the digest written with them (altered or damaged)")
    classes = tuple(str(c) for c in arrays["classes"])
    parts = {}
    for s in ("train", "test"):
        if f"{s}_x" not in arrays:
            continue
        x, y = arrays[f"{s}_x"], arrays[f"{s}_y"]
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[-1] != 3 or y.shape != (len(x),) or y.dtype.kind not in "iu":
            raise ValueError(f"{s} arrays of shapes {x.shape}, {y.shape}")
        if size is not None and x.shape[1:3] != (size, size):
            raise ValueError(f"{s} images are {x.shape[1]}x{x.shape[2]}, not the {size}x{size} this key decodes to")
        if len(y) and (y.min() < 0 or y.max() >= len(classes)):
            raise ValueError(f"{s} labels outside the {len(classes)} classes")
        parts[s] = ImageSet(x, y.astype(np.int64), classes)
    if not parts:
        raise ValueError("no images")
    return parts, int(arrays["skipped"])


def cached_read(root: Path, key_extra: Tuple[Any, ...], cache_dir: Path,
                read: Callable[[], Tuple[Parts, int]], warn: Callable[[str], None] = _warn,
                size: Optional[int] = None) -> Tuple[Parts, int]:
    """``read()``'s (parts, skipped count), from the cache when ``root`` and ``key_extra`` are unchanged (and its
    images are ``size`` px square, where given: ``read`` decodes to that size)."""
    key = fingerprint(root, *key_extra)[:24]
    cache = cache_dir / f"{root.name.split('.')[0]}-{key}.npz"
    if cache.exists():
        try:
            return load_cache(cache, size)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error, RuntimeError) as e:
            why = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
            warn(f"decode cache {cache} is truncated, corrupt or unreadable ({e.__class__.__name__}"
                 f"{': ' + why if why else ''}); rebuilding it")
    parts, skipped = read()
    _write(cache, parts, skipped, warn)
    return parts, skipped


def _write(cache: Path, parts: Parts, skipped: int, warn: Callable[[str], None]) -> None:
    """Write the cache atomically (temporary file, rename); a cache that cannot be written only costs speed."""
    arrays = {f"{s}_{k}": getattr(v, k) for s, v in parts.items() for k in ("x", "y")}
    classes = next(iter(parts.values())).classes
    tmp: Optional[Path] = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.stem}.tmp{os.getpid()}.npz")
        arrays.update(classes=np.asarray(classes), skipped=np.asarray(skipped))
        np.savez(tmp, digest=np.asarray(digest(arrays)), **arrays)
        if cache.is_dir():
            raise IsADirectoryError(f"{cache} is a folder")
        os.replace(tmp, cache)
    except OSError as e:
        warn(f"decode cache {cache} cannot be written ({e.strerror or e}); the images will be decoded again next time")
        if tmp is not None:
            tmp.unlink(missing_ok=True)

"""The decoded-image cache: each source is decoded once into a ``.npz`` under ``data.cache_dir``.

The cache knows nothing of the sources: :func:`cached_read` is handed the reader to call on a miss.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import numpy as np

from .sources import ImageSet, fingerprint

Parts = Dict[str, ImageSet]  # "train" (and "test") -> images


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "visattn"


def cached_read(root: Path, key_extra: Tuple[Any, ...], cache_dir: Path,
                read: Callable[[], Tuple[Parts, int]]) -> Tuple[Parts, int]:
    """``read()``'s (parts, skipped count), from the cache when ``root`` and ``key_extra`` are unchanged."""
    key = fingerprint(root, *key_extra)[:24]
    cache = cache_dir / f"{root.name.split('.')[0]}-{key}.npz"
    if cache.is_file():
        try:
            with np.load(cache, allow_pickle=False) as z:
                classes = tuple(str(c) for c in z["classes"])
                parts = {s: ImageSet(z[f"{s}_x"], z[f"{s}_y"], classes) for s in ("train", "test") if f"{s}_x" in z}
                return parts, int(z["skipped"])
        except (OSError, ValueError, KeyError, EOFError):
            pass  # a broken cache is rebuilt, never trusted
    parts, skipped = read()
    cache_dir.mkdir(parents=True, exist_ok=True)
    arrays = {f"{s}_{k}": getattr(v, k) for s, v in parts.items() for k in ("x", "y")}
    tmp = cache.with_suffix(f".tmp{os.getpid()}.npz")
    np.savez(tmp, classes=np.asarray(parts["train"].classes), skipped=np.asarray(skipped), **arrays)
    os.replace(tmp, cache)
    return parts, skipped

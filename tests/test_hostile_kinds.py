"""Issue 92: off the happy path by construction. Each kind of hostile input is closed by one mechanism, and each
numbered case of the issue has a test here: (a) a file visattn wrote is trusted only through a digest it cannot
lose; (b) builder options typed from both the builder function's and the built class's signatures, with ranges;
(c) cross-field checks in one place; (d) the rest. A refusal is one line naming the problem."""
from __future__ import annotations

import zipfile
from pathlib import Path
from typing import List

import numpy as np
from test_data import _cfg as _data_cfg
from test_data import _write_folder

from visattn.data import ImageSet, load_splits
from visattn.data.cache import cached_read


def _quiet(*a, **k) -> None:
    pass


# ---- (a) 2: the decode cache carries a digest of its arrays ------------------------------------------------------


def _cache_of(tmp_path: Path) -> Path:
    caches = list((tmp_path / "cache").glob("*.npz"))
    assert len(caches) == 1, caches
    return caches[0]


def test_a2_a_decode_cache_rewritten_with_zeroed_labels_is_rebuilt_with_one_note(tmp_path, capsys):
    root = _write_folder(tmp_path / "ds", test=False, fmt="PNG")
    cfg = _data_cfg(tmp_path, root)
    true = load_splits(cfg, seed=0)
    cache = _cache_of(tmp_path)
    with np.load(cache) as z:
        arrays = {k: z[k] for k in z.files if k != "digest"}
    arrays["train_y"] = np.zeros_like(arrays["train_y"])  # valid arrays, as np.savez writes them: no digest
    np.savez(cache, **arrays)
    capsys.readouterr()
    again = load_splits(cfg, seed=0)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no digest" in err[0] and "rebuilding it" in err[0], err
    np.testing.assert_array_equal(again.train.y, true.train.y)
    assert len(set(again.train.y.tolist())) == 3
    load_splits(cfg, seed=0)  # the rebuilt cache is trusted: no note
    assert capsys.readouterr().err == ""


def test_a2_a_cache_whose_arrays_do_not_match_its_digest_is_rebuilt(tmp_path):
    root = _write_folder(tmp_path / "ds", size=16)
    warned: List[str] = []
    calls: List[int] = []

    def read():
        calls.append(1)
        return {"train": ImageSet(np.zeros((3, 16, 16, 3), np.uint8), np.arange(3), ("a", "b", "c"))}, 0

    cached_read(root, ("folder", 16), tmp_path / "cache", read, warn=warned.append)
    cache = _cache_of(tmp_path)
    with np.load(cache) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["train_y"] = np.array([2, 1, 0])  # the digest kept, a label changed
    np.savez(cache, **arrays)
    parts, _ = cached_read(root, ("folder", 16), tmp_path / "cache", read, warn=warned.append)
    assert calls == [1, 1] and parts["train"].y.tolist() == [0, 1, 2]
    assert len(warned) == 1 and "do not match the digest" in warned[0] and "rebuilding it" in warned[0]
    with zipfile.ZipFile(cache) as z:  # the rebuilt file carries a digest again
        assert "digest.npy" in z.namelist()

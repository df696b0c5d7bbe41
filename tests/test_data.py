"""Dataset sources, the cache, the stratified split and the batch loaders."""
from __future__ import annotations

import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from visattn.config import load_config
from visattn.data import (
    Placement,
    TensorLoader,
    albumentations_pipeline,
    batch_crop,
    detect_source,
    load_splits,
    make_synthetic,
    read_image_folder,
    stratified_split,
)
from visattn.errors import DataError


def _write_folder(root: Path, classes=("cat", "dog", "emu"), per_class=6, test=True, size=32, fmt="JPEG"):
    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("test", 2)) if test else (("train", per_class),):
        for ci, c in enumerate(classes):
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(n):
                arr = np.full((size, size, 3), 40 * ci, dtype=np.uint8) + rng.integers(0, 20, (size, size, 3), dtype=np.uint8)
                Image.fromarray(arr).save(d / f"{i}.{'jpg' if fmt == 'JPEG' else 'png'}", fmt)
    return root


def _tar(folder: Path, out: Path) -> Path:
    with tarfile.open(out, "w:gz") as tf:
        for p in sorted(folder.rglob("*")):
            tf.add(p, arcname=str(p.relative_to(folder)), recursive=False)
    return out


def _cfg(tmp_path, root, *extra):
    return load_config(None, [f"data.root={root}", f"data.cache_dir={tmp_path / 'cache'}", "data.val_size=6", *extra]).data


def test_image_folder_with_test_split(tmp_path):
    root = _write_folder(tmp_path / "ds")
    assert detect_source(root) == "folder"
    s = load_splits(_cfg(tmp_path, root), seed=0)
    assert s.train.classes == ("cat", "dog", "emu")
    assert s.train.x.shape == (18, 32, 32, 3) and s.train.x.dtype == np.uint8
    assert len(s.eval) == 6 and "test split" in s.eval_split
    # class order follows the sorted folder names: emu (index 2) is the brightest
    assert s.train.x[s.train.y == 2].mean() > s.train.x[s.train.y == 0].mean()


def test_tar_gz_of_folder_and_cache(tmp_path, monkeypatch):
    folder = _write_folder(tmp_path / "ds", test=False, fmt="PNG")
    archive = _tar(folder, tmp_path / "ds.tar.gz")
    cfg = _cfg(tmp_path, archive)
    s = load_splits(cfg, seed=0)
    assert len(s.train) == 12 and len(s.eval) == 6 and "held out from train" in s.eval_split
    # the second load comes from the cache: decoding is not called again
    import visattn.data as data

    monkeypatch.setattr(data.sources, "read_image_folder", lambda *a, **k: pytest.fail("cache missed"))
    s2 = load_splits(cfg, seed=0)
    np.testing.assert_array_equal(s.train.x, s2.train.x)
    assert list((tmp_path / "cache").glob("*.npz"))


def test_resize_to_image_size(tmp_path):
    root = _write_folder(tmp_path / "ds", size=40)
    parts, _ = read_image_folder(root, image_size=32)
    assert parts["train"].x.shape[1:] == (32, 32, 3)


def test_corrupt_image_named_or_skipped(tmp_path):
    root = _write_folder(tmp_path / "ds")
    bad = root / "train" / "dog" / "broken.jpg"
    bad.write_bytes(b"\xff\xd8 not really a jpeg")
    with pytest.raises(DataError, match="broken.jpg"):
        load_splits(_cfg(tmp_path, root), seed=0)
    s = load_splits(_cfg(tmp_path, root, "data.on_bad_image=skip"), seed=0)
    assert s.skipped == 1 and len(s.train) == 18


def test_wrong_layout_named(tmp_path):
    root = _write_folder(tmp_path / "ds")
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(root / "train" / "stray.png")
    with pytest.raises(DataError, match="stray.png"):
        load_splits(_cfg(tmp_path, root), seed=0)


def test_empty_class_named(tmp_path):
    root = _write_folder(tmp_path / "ds")
    (root / "train" / "yak").mkdir()
    with pytest.raises(DataError, match="yak"):
        load_splits(_cfg(tmp_path, root), seed=0)


def test_truncated_archive_named(tmp_path):
    folder = _write_folder(tmp_path / "ds", per_class=30)
    archive = _tar(folder, tmp_path / "ds.tar.gz")
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(DataError, match="cut.tar.gz"):
        load_splits(_cfg(tmp_path, cut), seed=0)


def test_missing_root_named(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_splits(_cfg(tmp_path, tmp_path / "nowhere"), seed=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="neither"):
        load_splits(_cfg(tmp_path, tmp_path / "empty"), seed=0)


def _write_cifar_batches(d: Path, n=20, evil=False):
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        payload = {"data": rng.integers(0, 255, (n, 3072), dtype=np.uint8), "labels": list(rng.integers(0, 10, n))}
        with open(d / name, "wb") as f:
            pickle.dump(payload, f)
    with open(d / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    if evil:
        class Boom:
            def __reduce__(self):
                return (exec, ("open(%r, 'w').write('pwned')" % str(d / "PWNED"),))

        with open(d / "data_batch_3", "wb") as f:
            pickle.dump({"data": Boom(), "labels": []}, f)


def test_cifar_python_batches(tmp_path):
    _write_cifar_batches(tmp_path / "cifar-10-batches-py")
    assert detect_source(tmp_path) == "cifar_python"
    s = load_splits(_cfg(tmp_path, tmp_path), seed=0)
    assert s.train.x.shape == (100, 32, 32, 3) and len(s.eval) == 20 and s.train.classes[0] == "c0"


def test_cifar_python_refuses_code(tmp_path):
    _write_cifar_batches(tmp_path / "cifar-10-batches-py", evil=True)
    with pytest.raises(DataError, match="data_batch_3"):
        load_splits(_cfg(tmp_path, tmp_path), seed=0)
    assert not (tmp_path / "cifar-10-batches-py" / "PWNED").exists()


def test_stratified_split_is_balanced_seeded_disjoint():
    y = np.repeat(np.arange(10), 100)
    keep, held = stratified_split(y, 250, seed=3)
    assert len(held) == 250 and len(keep) == 750 and not set(keep) & set(held)
    counts = np.bincount(y[held], minlength=10)
    assert counts.max() - counts.min() <= 1
    assert np.array_equal(held, stratified_split(y, 250, seed=3)[1])
    assert not np.array_equal(held, stratified_split(y, 250, seed=4)[1])


def test_val_size_too_large(tmp_path):
    cfg = load_config(None, ["data.source=synthetic", "data.synthetic_size=50", "data.val_size=50"]).data
    with pytest.raises(DataError, match="val_size"):
        load_splits(cfg, seed=0)


def test_synthetic_is_learnable_and_deterministic():
    a, b = make_synthetic(100, seed=1), make_synthetic(100, seed=1)
    np.testing.assert_array_equal(a.x, b.x)
    means = [a.x[a.y == c].reshape(-1, 3).mean(0) for c in range(10)]
    assert np.std(means) > 5  # classes differ visibly


def test_batch_crop_takes_windows_of_the_padded_image():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).view(2, 3, 8, 8)
    g = torch.Generator().manual_seed(0)
    out = batch_crop(x, 2, "reflect", g)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2), mode="reflect")
    for b in range(2):
        hits = [(dy, dx) for dy in range(5) for dx in range(5) if torch.equal(out[b], padded[b, :, dy:dy + 8, dx:dx + 8])]
        assert len(hits) == 1


def test_tensor_and_albumentations_pad_agree():
    """The tensor loader's reflect padding is the same as albumentations' (BORDER_REFLECT_101)."""
    cfg = load_config(None, ["data.augment.hflip=false"]).data
    pipe = albumentations_pipeline(cfg.augment, 32, cfg.mean, train=True)
    img = np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)
    padded = torch.nn.functional.pad(torch.from_numpy(img).permute(2, 0, 1)[None].float(), (4,) * 4, mode="reflect")[0]
    windows = {padded[:, dy:dy + 32, dx:dx + 32].numpy().tobytes() for dy in range(9) for dx in range(9)}
    for _ in range(10):
        out = pipe(image=img)["image"]
        assert torch.from_numpy(out).permute(2, 0, 1).float().numpy().tobytes() in windows


def test_tensor_loader_flip_cutout_normalize():
    imgs = make_synthetic(64, seed=0)
    aug = load_config(None, ["data.augment.crop_padding=0", "data.augment.cutout=8"]).data.augment
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    loader = TensorLoader(imgs, 64, mean, std, train=True, augment=aug, seed=0)
    xb, yb = next(iter(loader))
    assert xb.shape == (64, 3, 32, 32) and xb.dtype == torch.float32
    holes = (xb == 0).all(1)  # cutout fills with the mean: 0 after normalisation, all channels
    assert (holes.flatten(1).sum(1) >= 16).all()  # every image has a (possibly clipped) hole of >= 4x4
    ref = (torch.from_numpy(imgs.x).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.25
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0 * 1_000_003 + 0))
    flipped = sum(bool(torch.allclose(xb[i][~holes[i].expand(3, -1, -1)], ref[order[i]].flip(2)[~holes[i].expand(3, -1, -1)], atol=1e-5))
                  for i in range(64))
    assert 16 < flipped < 48  # about half are mirrored


def test_tensor_loader_resumes_mid_epoch():
    imgs = make_synthetic(200, seed=0)
    aug = load_config(None, ["data.augment.cutout=4"]).data.augment
    a = TensorLoader(imgs, 20, (0.5,) * 3, (0.25,) * 3, True, aug, seed=5)
    a.set_epoch(3)
    it = iter(a)
    for _ in range(4):
        next(it)
    state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in a.state_dict().items()}
    rest_a = [xb for xb, _ in it]
    b = TensorLoader(imgs, 20, (0.5,) * 3, (0.25,) * 3, True, aug, seed=5)
    b.load_state_dict(state)
    rest_b = [xb for xb, _ in b]
    assert len(rest_a) == len(rest_b) == 6
    assert all(torch.equal(x, y) for x, y in zip(rest_a, rest_b))


def test_ranks_get_disjoint_equal_shares():
    imgs = make_synthetic(103, seed=0)
    seen = []
    for rank in range(2):
        ld = TensorLoader(imgs, 10, (0.5,) * 3, (0.25,) * 3, True, None, seed=0, placement=Placement(rank=rank, world_size=2))
        seen.append(torch.cat([y for _, y in ld]))
        assert len(ld) == 5
    idx = [set(TensorLoader(imgs, 10, (0.5,) * 3, (0.25,) * 3, True, None, seed=0, placement=Placement(rank=r, world_size=2))._indices().tolist())
           for r in range(2)]
    assert not idx[0] & idx[1] and len(idx[0]) == len(idx[1]) == 51


def test_albumentations_loader_runs_extra_transforms(tmp_path):
    cfg = load_config(None, ["data.source=synthetic", "data.synthetic_size=60", "data.val_size=10",
                             "data.loader=albumentations", "data.augment.extra=[{name: ColorJitter, brightness: 0.2, p: 1.0}]"]).data
    from visattn.data import build_loader

    s = load_splits(cfg, 0)
    ld = build_loader(s.train, cfg, 10, True, 0)
    xb, yb = next(iter(ld))
    assert xb.shape == (10, 3, 32, 32) and yb.shape == (10,) and torch.isfinite(xb).all()


def test_real_archive_is_detected(cifar10_path):
    assert detect_source(cifar10_path) == "folder"


def test_subset_is_taken_after_the_hold_out():
    """A training subset never changes which images are held out for validation."""
    base = ["data.source=synthetic", "data.synthetic_size=400", "data.val_size=100"]
    full = load_splits(load_config(None, base).data, seed=0)
    small = load_splits(load_config(None, base + ["data.subset=100"]).data, seed=0)
    assert len(small.train) == 100 and len(small.eval) == 100
    np.testing.assert_array_equal(full.eval.x, small.eval.x)
    assert np.bincount(small.train.y).min() >= 9  # stratified

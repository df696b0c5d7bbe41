"""Attention maps end to end: tiny training runs through ``visattn.trainer.run`` read back with TensorBoard's
own reader, and the ``python -m visattn.visualize`` command on a trained checkpoint."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("tensorboard")
from conftest import has_colour_bar  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    HISTOGRAMS,
    IMAGES,
    SCALARS,
    TENSORS,
    EventAccumulator,
)

from visattn.config import build_config, read_yaml  # noqa: E402
from visattn.data import load_splits, normalize  # noqa: E402
from visattn.errors import ConfigError  # noqa: E402
from visattn.evaluate import load_model_from_checkpoint  # noqa: E402
from visattn.maps import find_taps  # noqa: E402
from visattn.maps import tensorboard as maps_tensorboard  # noqa: E402
from visattn.maps.render import LINE_H, images_to_float, to_uint8  # noqa: E402
from visattn.models import create_model  # noqa: E402
from visattn.rundir import load_checkpoint, save_checkpoint  # noqa: E402
from visattn.trainer import run  # noqa: E402
from visattn.visualize import _pick, load_image  # noqa: E402
from visattn.visualize import main as visualize_main

ROOT = Path(__file__).resolve().parents[1]
PROBE, SCALE = 4, 4
TILE = 32 * SCALE  # a 32x32 image drawn at scale 4
# All three kinds a CNN can carry: CBAM (channel + spatial gates), SE (channel), non-local (token).
CNN = {"name": "resnet_fast", "widths": [8, 16, 16], "stem_width": 8, "attention": ["cbam", "se", "nonlocal"]}
VIT = {"name": "vit_tiny", "depth": 2, "dim": 32, "num_heads": 2, "mlp_ratio": 1.0}


def tiny_config(run_dir: Path, model: dict, epochs: int = 2, **log):
    """configs/smoke.yaml shrunk to a few seconds: 200 synthetic training images, 5 steps an epoch."""
    tree = read_yaml(ROOT / "configs" / "smoke.yaml")
    tree["run_dir"] = str(run_dir)
    tree["model"] = dict(model)
    if model["name"] != "resnet_fast":  # transformers want AdamW at a small rate, not the smoke run's SGD at 0.2
        tree["optim"] = {"name": "adamw", "lr": 1e-3, "weight_decay": 0.05}
    tree["data"].update(synthetic_size=240, val_size=40)
    tree["train"].update(epochs=epochs, batch_size=40)
    tree["eval"] = {"batch_size": 100, "tta": "none"}
    tree["log"] = {"progress": False, "maps_every": 1, "probe_size": PROBE, "map_scale": SCALE, **log}
    return build_config(tree)


def train(run_dir: Path, model: dict, epochs: int = 2, **log):
    cfg = tiny_config(run_dir, model, epochs, **log)
    run(cfg, log=lambda *a, **k: None)
    return cfg


def read_events(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={IMAGES: 0, HISTOGRAMS: 0, SCALARS: 0, TENSORS: 0})
    acc.Reload()
    return acc


def decode(event) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))


def tap_kinds(model_cfg: dict) -> dict:
    opts = {k: v for k, v in model_cfg.items() if k != "name"}
    return {name: tap.kind for name, tap in find_taps(create_model(model_cfg["name"], num_classes=10, **opts))}


def find_rows(picture: np.ndarray, tile: np.ndarray) -> list:
    """Top rows y where ``tile`` sits exactly at (y, 0) in ``picture``."""
    h, w = tile.shape[:2]
    return [y for y in range(picture.shape[0] - h + 1) if np.array_equal(picture[y : y + h, :w], tile)]


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cnn") / "run"
    return train(run_dir, CNN, faithfulness=False), run_dir


# ------------------------------------------------------------------------------------ TensorBoard events


def test_trainer_logs_every_layer_each_epoch(cnn_run):
    cfg, run_dir = cnn_run
    acc = read_events(run_dir)
    tags = acc.Tags()
    kinds = tap_kinds(CNN)
    assert sorted(set(kinds.values())) == ["channel", "spatial", "token"]

    # the non-local layer is a run of token layers on one grid; gradient maps are on by default, and the
    # layers' gradient maps lie on more than one grid, so they are also joined on the pixels
    expected_images = {"maps/rollout", "maps/rollout_grad", "maps/layers_grad"}
    expected_hists = set()
    for name, kind in kinds.items():
        if kind == "channel":
            expected_hists.add(f"channel/{name}")
        else:
            expected_images |= {f"maps/{name}", f"maps/{name}/grad"}
        if kind == "token":
            expected_images.add(f"matrix/{name}")
    assert set(tags["images"]) == expected_images
    assert set(tags["histograms"]) == expected_hists
    for tag in expected_images:
        assert [e.step for e in acc.Images(tag)] == [1, 2], tag
    for tag in expected_hists:
        steps = [e.step for e in acc.Histograms(tag)]
        assert steps == [1, 2], tag
        assert all(0.0 <= e.histogram_value.min <= e.histogram_value.max <= 1.0 for e in acc.Histograms(tag))

    for tag in ("train/loss", "train/acc", "val/loss", "val/acc", "train/images_per_s"):
        assert [e.step for e in acc.Scalars(tag)] == [1, 2], tag
    assert "train/lr_epoch" in tags["scalars"] and len(acc.Scalars("train/lr_epoch")) == 2
    assert not any(t.startswith("faithfulness/") for t in tags["scalars"])  # log.faithfulness=false
    about = acc.Tensors("maps/descriptions/text_summary")
    assert [e.step for e in about] == [1, 2]
    text = about[-1].tensor_proto.string_val[0].decode()
    assert all(f"`{t}`" in text for t in expected_images | expected_hists)  # a line for every tag
    assert all(np.isfinite(e.value) for t in tags["scalars"] for e in acc.Scalars(t))


def test_probe_is_the_same_validation_images_every_epoch(cnn_run):
    cfg, run_dir = cnn_run
    # The probe is a fixed pick of held-out images, one per class in turn, drawn as the logger draws them.
    ev = load_splits(cfg.data, cfg.seed).eval
    from visattn.data import spread_indices

    pick = spread_indices(ev.y, PROBE)
    assert len(set(ev.y[pick].tolist())) == min(PROBE, len(set(ev.y.tolist())))
    probe = normalize(torch.from_numpy(ev.x[pick]).permute(0, 3, 1, 2), cfg.data.mean, cfg.data.std)
    tiles = to_uint8(images_to_float(probe, cfg.data.mean, cfg.data.std, (TILE, TILE))).permute(0, 2, 3, 1).numpy()

    acc = read_events(run_dir)
    spatial = next(t for t in acc.Tags()["images"] if t.endswith(".spatial"))
    for tag in (spatial, "maps/rollout"):
        rows = []
        for event in acc.Images(tag):
            picture = decode(event)
            assert picture.shape[1] == 2 * TILE + 2  # original | overlay
            found = [find_rows(picture, tile) for tile in tiles]
            assert all(len(f) == 1 for f in found), f"{tag} step {event.step}: a probe image is missing"
            ys = [f[0] for f in found]
            assert ys == sorted(ys)  # in probe order, one row each
            overlay = picture[ys[0] : ys[0] + TILE, TILE + 2 :]
            assert not np.array_equal(overlay, tiles[0])  # the right tile carries the heatmap
            rows.append(ys)
        assert len(rows) == 2


def test_vit_run_logs_class_token_maps_and_rollout(tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir, VIT, faithfulness=True)  # log.head_maps defaults to "last"
    acc = read_events(run_dir)
    scored = {"blocks.0.attn", "blocks.1.attn", "rollout", "blocks.1.attn/grad", "rollout_grad"}  # maps, not single heads
    faithful = {f"faithfulness/{m}/{w}" for m in scored for w in ("deletion", "insertion")}
    assert faithful <= set(acc.Tags()["scalars"])
    assert all([e.step for e in acc.Scalars(t)] == [1, 2] for t in faithful)
    assert "maps/descriptions/text_summary" in acc.Tags()["tensors"]
    images = set(acc.Tags()["images"])
    blocks = sorted(tap_kinds(VIT))
    assert blocks == ["blocks.0.attn", "blocks.1.attn"]
    expected = {"maps/rollout", "maps/rollout_grad"} | {f"maps/{b}" for b in blocks} | {f"matrix/{b}" for b in blocks}
    expected |= {f"maps/{b}/grad" for b in blocks}
    expected |= {f"maps/blocks.1.attn/cls_head{h}" for h in range(2)}  # the last class-token layer only
    assert images == expected
    assert not acc.Tags()["histograms"]
    for tag in expected:
        assert [e.step for e in acc.Images(tag)] == [1, 2], tag
    picture = decode(acc.Images("maps/blocks.1.attn/cls_head1")[-1])
    assert picture.shape[1] == 2 * TILE + 2 and picture.shape[0] > PROBE * TILE


def test_head_maps_config():
    assert tiny_config(Path("unused"), VIT).log.head_maps == "last"
    assert tiny_config(Path("unused"), VIT, head_maps="all").log.head_maps == "all"
    with pytest.raises(ConfigError, match="log.head_maps"):
        tiny_config(Path("unused"), VIT, head_maps="first")


# ------------------------------------------------------------------------------------ visualize CLI


@pytest.fixture(scope="module")
def user_images(tmp_path_factory):
    d = tmp_path_factory.mktemp("images")
    g = np.random.default_rng(0)
    rgba = g.integers(0, 256, size=(40, 50, 4), dtype=np.uint8)  # 50 wide, 40 high
    rgba[..., 3] = 255
    rgba[:, :10, 3] = 0  # a transparent left band
    Image.fromarray(rgba, "RGBA").save(d / "wide.png")
    Image.fromarray(g.integers(0, 256, size=(32, 32), dtype=np.uint8), "L").save(d / "grey.png")
    return d / "wide.png", d / "grey.png"


def test_visualize_cli_writes_maps_and_predictions(cnn_run, user_images, tmp_path):
    cfg, run_dir = cnn_run
    ckpt, out = run_dir / "best.pt", tmp_path / "maps"
    cmd = [sys.executable, "-m", "visattn.visualize", "--checkpoint", str(ckpt), "--images", *map(str, user_images),
           "--out", str(out), "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr

    kinds = tap_kinds(CNN)
    layers = [m for n, k in kinds.items() if k != "channel" for m in (n, f"{n}/grad")]
    layers += ["rollout", "rollout_grad", "layers_grad"]
    result = json.loads((out / "predictions.json").read_text())
    classes = list(load_checkpoint(ckpt)["classes"])
    assert result["classes"] == classes and result["image_size"] == 32
    assert [e["image"] for e in result["images"]] == [str(p) for p in user_images]
    assert [e["mode"] for e in result["images"]] == ["RGBA", "L"]
    assert [e["size"] for e in result["images"]] == [[50, 40], [32, 32]]
    assert [entry["name"] for entry in result["layers"]] == layers
    assert proc.stdout.splitlines()[-1] == (f"wrote {2 * len(layers)} picture(s), {len(layers)} map(s) per image, "
                                           f"and predictions.json to {out}")

    # The same prediction as the model makes on the same resized input, in this process.
    model, _, _ = load_model_from_checkpoint(str(ckpt), torch.device("cpu"))
    x = torch.stack([load_image(str(p), 32, fill=cfg.data.mean).model_input for p in user_images])
    with torch.no_grad():
        probs = torch.softmax(model(normalize(x, cfg.data.mean, cfg.data.std)), -1)
    mean_rgb = np.round(np.array(cfg.data.mean) * 255)
    for i, (entry, display_hw) in enumerate(zip(result["images"], [(102, 128), (128, 128)])):
        assert entry["pred"] == classes[int(probs[i].argmax())]
        assert entry["confidence"] == pytest.approx(float(probs[i].max()), abs=1e-4)
        assert [t["p"] for t in entry["top"]] == sorted((t["p"] for t in entry["top"]), reverse=True)
        assert set(entry["maps"]) == set(layers)
        for layer, fname in entry["maps"].items():
            png = Image.open(out / fname)
            assert png.format == "PNG" and png.mode == "RGB"
            pic = np.asarray(png)
            # caption (prediction, layer, the map's range), then the picture at its own aspect (longer side 128)
            # beside its overlay, then the colour bar
            assert pic.shape[1] == 2 * TILE + 2
            top = 3 * LINE_H + 2
            assert 0 < pic.shape[0] - top - display_hw[0] <= 60
            assert has_colour_bar(pic[top + display_hw[0] :])
            left = pic[top : top + display_hw[0], : display_hw[1]].astype(int)
            right = pic[top : top + display_hw[0], TILE + 2 : TILE + 2 + display_hw[1]].astype(int)
            assert np.abs(left - right).mean() > 5  # the overlay is coloured
            if entry["mode"] == "L":
                assert (left[..., 0] == left[..., 1]).all() and (left[..., 1] == left[..., 2]).all()
            else:  # the transparent band (the left fifth) shows the dataset mean colour
                band = left[10:-10, 3 : display_hw[1] // 5 - 6]
                assert np.abs(band - mean_rgb).max() <= 2
    assert len(list(out.glob("*.png"))) == 2 * len(layers)


def test_validation_grids_match_tensorboard(cnn_run, tmp_path):
    cfg, run_dir = cnn_run
    out = tmp_path / "grids"
    code = visualize_main(["--checkpoint", str(run_dir / "last.pt"), "--validation", str(PROBE), "--data", "synthetic",
                           "--out", str(out), "--device", "cpu"])
    assert code == 0
    acc = read_events(run_dir)
    tags = acc.Tags()["images"]
    assert sorted(p.name for p in out.glob("*.png")) == sorted(t.replace("/", "__") + ".png" for t in tags)
    for tag in tags:  # last.pt holds the weights the step-2 pictures were drawn from: the same pictures
        logged = decode(acc.Images(tag)[-1])
        assert np.array_equal(np.asarray(Image.open(out / (tag.replace("/", "__") + ".png")).convert("RGB")), logged), tag


def test_validation_pick_spread_takes_each_class_in_turn():
    labels = np.array([0, 0, 0, 1, 1, 2])  # a held-out split ordered by class
    assert _pick(labels, 4, "first").tolist() == [0, 1, 2, 3]
    assert _pick(labels, 5, "spread").tolist() == [0, 3, 5, 1, 4]
    assert _pick(labels, 99, "spread").tolist() == [0, 3, 5, 1, 4, 2]


def test_visualize_cli_errors(cnn_run, user_images, tmp_path, capsys):
    _, run_dir = cnn_run
    ckpt = str(run_dir / "best.pt")
    args = ["--checkpoint", ckpt, "--out", str(tmp_path / "o"), "--device", "cpu", "--images"]

    proc = subprocess.run([sys.executable, "-m", "visattn.visualize", *args, str(user_images[0]), "nope.png"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: image 'nope.png' not found"]

    not_image = tmp_path / "notes.png"
    not_image.write_text("not a picture")
    assert visualize_main(args + [str(not_image)]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot read image {str(not_image)!r}")

    garbage = tmp_path / "bad.pt"
    garbage.write_bytes(b"\x00" * 64)
    assert visualize_main(["--checkpoint", str(garbage), "--out", str(tmp_path / "o"), "--images", str(user_images[1])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint") and err.count("\n") == 1

    assert visualize_main(args[:-1] + ["--alpha", "1.5", "--images", str(user_images[1])]) == 2
    assert "--alpha" in capsys.readouterr().err


def test_visualize_model_without_attention_writes_predictions_only(cnn_run, user_images, tmp_path, capsys):
    _, run_dir = cnn_run
    state = load_checkpoint(run_dir / "best.pt")
    plain = {**state["config"]["model"], "attention": "none"}
    opts = {k: v for k, v in plain.items() if k not in ("name", "init_from")}  # the model's own options
    state["config"]["model"] = plain
    state["model"] = create_model("resnet_fast", num_classes=10, **opts).state_dict()
    state["ema"] = None
    ckpt = save_checkpoint(state, tmp_path / "plain.pt")

    out = tmp_path / "o"
    code = visualize_main(["--checkpoint", str(ckpt), "--out", str(out), "--images", *map(str, user_images)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "no attention layers" in err[0]
    result = json.loads((out / "predictions.json").read_text())
    assert len(result["images"]) == 2 and all(e["maps"] == {} for e in result["images"])
    assert all(e["pred"] in result["classes"] for e in result["images"])
    assert not list(out.glob("*.png"))


def test_faithfulness_command_prints_the_table(cnn_run, tmp_path, capsys):
    _, run_dir = cnn_run
    args = ["--checkpoint", str(run_dir / "best.pt"), "--faithfulness", "4", "--data", "synthetic", "--device", "cpu",
            "--steps", "2", "--regions", "2", "--draws", "1", "--batch-size", "64"]
    assert visualize_main(args + ["--out", str(tmp_path / "f")]) == 0
    out = capsys.readouterr().out
    maps = [m for n, k in tap_kinds(CNN).items() if k != "channel" for m in (n, f"{n}/grad")]
    maps += ["rollout", "rollout_grad", "layers_grad", "input_x_gradient", "gradcam", "centre"]
    scores, paired = out.split("paired against the centre prior")
    def names(text):
        return [line.split()[0] for line in text.splitlines() if line.split() and line.split()[0] in maps]

    assert names(scores) == maps  # one row per map, the baselines last
    assert names(paired) == maps[:-1]  # then each map (the prior aside) paired against the prior
    doc = json.loads((tmp_path / "f" / "faithfulness.json").read_text())
    assert doc["images"] == 4 and [r["name"] for r in doc["rows"]] == maps
    assert all(len(r["deletion_curve"]) == 3 and "sanity_rho" in r for r in doc["rows"])
    assert "NaN" not in (tmp_path / "f" / "faithfulness.json").read_text()  # strict JSON
    assert visualize_main(args + ["--maps", "rollout", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --maps: no map named nope")


@pytest.mark.parametrize("budget,steps", [(0.0, [1]), (1e9, [1, 2])], ids=["over-budget", "within-budget"])
def test_faithfulness_auto_keeps_the_scores_only_within_their_budget(tmp_path, monkeypatch, budget, steps):
    monkeypatch.setattr(maps_tensorboard, "FAITHFULNESS_BUDGET", budget)
    said = []
    cfg = tiny_config(tmp_path / "run", CNN, 2)
    assert cfg.log.faithfulness == "auto"  # the default
    run(cfg, log=lambda *a, **k: said.append(" ".join(map(str, a))))
    acc = read_events(tmp_path / "run")
    scored = [t for t in acc.Tags()["scalars"] if t.startswith("faithfulness/")]
    assert scored and all([e.step for e in acc.Scalars(t)] == steps for t in scored)
    assert any("log.faithfulness=auto" in line for line in said) == (budget == 0.0)

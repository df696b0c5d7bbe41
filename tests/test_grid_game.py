"""``bench/grid_game.py``, the grid pointing game, on tiny models and synthetic images: maps the same for every
class sit at chance exactly, a model whose evidence for class k is planted in its colour scores near 1, grids
take distinct classes from the held-out split only, Grad-CAM of a token model reads the final norm's tokens,
scored rows are kept, and a bad checkpoint is one line and exit status 2. Also the placed-object benchmark's
seam control (``bench/localization.py``): a model-free detector that finds the pasted patch."""
from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT
from torch import nn

from visattn.config import build_config, read_yaml
from visattn.models import create_model
from visattn.rundir import save_checkpoint

game = importlib.import_module("bench.grid_game")

# four colours (normalised space) 109.5 degrees apart: colour j . colour k = -1/3 for j != k, 1 for j == k
TETRA = torch.tensor([[1.0, 1.0, 1.0], [1.0, -1.0, -1.0], [-1.0, 1.0, -1.0], [-1.0, -1.0, 1.0]]) / math.sqrt(3)


class Planted(nn.Module):
    """Class k's logit: the mean over the image of its colour's projection on colour k (a 1x1 conv and a global
    average pool): the evidence for class k is exactly the pixels of colour k."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1, bias=False)
        self.conv.weight.data.copy_(TETRA[:, :, None, None])
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        return self.pool(self.conv(x)).flatten(1)


def coloured(n_per_class: int = 6, size: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(4).repeat_interleave(n_per_class)
    x = TETRA[y][:, :, None, None] * (1 + 0.1 * torch.rand(len(y), 1, size, size, generator=g))
    return x.float(), y.numpy()


def settings(**kw) -> "game.Settings":
    return game.Settings(**{**dict(grids=12, threshold=0.0, seed=0, batch=6, ig_steps=4, pre_bn=False,
                                   random_grids=2), **kw})


def tiny_run(run_dir, model: dict, seed: int = 3):
    tree = read_yaml(ROOT / "configs" / "smoke.yaml")
    tree.update(name=f"tiny_{model['name']}", run_dir=str(run_dir), seed=seed, precision="fp32")
    tree["model"] = dict(model)
    tree["data"].update(synthetic_size=200, val_size=100)
    cfg = build_config(tree)
    torch.manual_seed(0)
    net = create_model(model["name"], num_classes=10, **cfg.model.options())
    state = {"model": net.state_dict(), "config": cfg.to_dict(), "epoch": 2, "step": 10, "best_acc": 0.5,
             "classes": [f"c{i}" for i in range(10)], "seed": seed}
    run_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(state, run_dir / "last.pt")
    return run_dir / "last.pt"


CNN = {"name": "resnet_fast", "widths": [8, 8, 8], "stem_width": 8, "attention": "cbam"}


def test_a_planted_model_scores_near_one_and_the_controls_sit_at_chance():
    model = Planted().eval()
    x, y = coloured()
    grids = game.make_grids(x, y, np.arange(len(y)), 2, 12, seed=0)
    found = game.play(model, grids, (16, 16), settings())
    for name in ("input_x_gradient", "integrated_gradients"):
        assert found[name]["share"].mean() > 0.95 and found[name]["hit"].mean() == 1.0, name
    for name in ("agnostic_gradient", "edge", "centre"):  # the same map for every class in the grid
        assert torch.allclose(found[name]["share"], torch.full((12,), 0.25, dtype=torch.float64)), name  # exactly, grid by grid
        assert torch.allclose(found[name]["hit"], torch.full((12,), 0.25, dtype=torch.float64)), name
    assert abs(found["random"]["share"].mean() - 0.25) < 0.05
    assert abs(found["random"]["hit"].mean() - 0.25) < 0.2
    # the randomisation check: with the planted conv re-initialised, input x gradient no longer ranks alike
    rho = game.cascade(model, grids, (16, 16), settings())["input_x_gradient"]
    assert [r["reset"] for r in rho] == ["conv"] and rho[0]["rho"] < 0.9


def test_a_class_agnostic_map_scores_a_quarter_on_two_by_two_grids():
    gen = torch.Generator().manual_seed(1)
    heat = torch.rand(200, 20, 20, generator=gen) ** 4  # any map, peaked anywhere: the same for the 4 classes
    covered = torch.ones(20, 20, dtype=torch.bool)
    tie = torch.rand(200, 400, generator=gen)
    share = sum(game.cell_scores(heat, covered, torch.full((200,), k), 2, tie)[0] for k in range(4)) / 4
    hit = sum(game.cell_scores(heat, covered, torch.full((200,), k), 2, tie)[1] for k in range(4)) / 4
    assert torch.allclose(share, torch.full_like(share, 0.25)) and torch.allclose(hit, torch.full_like(hit, 0.25))
    # a map all in cell 3 (bottom right): share 1 there, 0 elsewhere
    one = torch.zeros(1, 20, 20)
    one[0, 12, 15] = 1.0
    assert [float(game.cell_scores(one, covered, torch.tensor([k]), 2, tie[:1])[0]) for k in range(4)] == [0, 0, 0, 1]
    flat = torch.zeros(1, 20, 20)  # no evidence at all: every cell ties, the grid's own tie-break decides
    assert sum(float(game.cell_scores(flat, covered, torch.tensor([k]), 2, tie[:1])[1]) for k in range(4)) == 1


def test_grids_take_distinct_classes_from_confident_held_out_images_only(tmp_path):
    ckpt = tiny_run(tmp_path / "cnn", CNN)
    model, cfg, _, splits = game.load_run(ckpt, None, "cpu")
    from visattn.data import normalize

    x = normalize(torch.from_numpy(splits.eval.x).permute(0, 3, 1, 2), cfg.data.mean, cfg.data.std).float()
    y = splits.eval.y
    assert "held out from train" in splits.eval_split and len(y) == 100
    pool = game.confident(model, x, torch.from_numpy(y).long(), 0.0)
    assert len(pool) == len(y)
    strict = game.confident(model, x, torch.from_numpy(y).long(), 0.12)
    with torch.no_grad():
        p = model(x).softmax(-1)[torch.arange(len(y)), torch.from_numpy(y)]
    assert set(strict.tolist()) == set(np.nonzero((p >= 0.12).numpy())[0].tolist())
    for n in (2, 3):
        g = game.make_grids(x, y, pool, n, 10, seed=5)
        assert g.images.shape == (10, 3, 32 * n, 32 * n)
        for i in range(10):
            assert len(set(g.labels[i].tolist())) == n * n  # distinct classes
            assert (g.labels[i].numpy() == y[g.sources[i]]).all()
            for k, src in enumerate(g.sources[i]):  # each cell is that held-out image, at its own scale
                r, c = divmod(k, n)
                assert torch.equal(g.images[i, :, 32 * r:32 * r + 32, 32 * c:32 * c + 32], x[src])
        again = game.make_grids(x, y, pool, n, 10, seed=5)
        assert torch.equal(again.images, g.images) and (again.sources == g.sources).all()
    with pytest.raises(Exception, match="need 9 classes"):
        game.make_grids(x, y, pool[np.isin(y[pool], [0, 1, 2, 3])], 3, 2, seed=0)


def test_grad_cam_of_a_token_model_reads_the_final_norms_grid_tokens():
    torch.manual_seed(0)
    vit = create_model("vit_tiny", depth=2, dim=32, num_heads=2, mlp_ratio=1.0).eval()
    x = torch.randn(3, 3, 32, 32)
    target = torch.tensor([1, 4, 7])
    maps = game.gradcams(vit, x, target)
    assert list(maps) == ["gradcam@norm"]
    kind, cam, geo = maps["gradcam@norm"]
    seen = []
    h = vit.norm.register_forward_hook(lambda m, a, out: seen.append(out))
    logits = vit(x.requires_grad_(True))
    h.remove()
    (g,) = torch.autograd.grad(logits.gather(1, target[:, None]).sum(), seen)
    gh, gw = vit.grid_size
    tok, gt = seen[0][:, 1:].detach(), g[:, 1:]  # the class token aside
    want = torch.relu((gt.mean(1, keepdim=True) * tok).sum(-1)).view(3, gh, gw)
    assert torch.allclose(cam, want, atol=1e-6) and tuple(geo.size) == (gh, gw) and geo.exact
    # a CNN's Grad-CAM is at every stage's output (the stem aside), and before its last BatchNorm on request
    cnn = create_model("resnet_fast", widths=[8, 8, 8], stem_width=8).eval()
    names = set(game.class_maps(cnn, torch.randn(2, 3, 64, 64), torch.tensor([0, 1]), 0, True)[0])
    assert {"gradcam@layers.0", "gradcam@layers.1", "gradcam@layers.2", "gradcam_pre_bn",
            "input_x_gradient"} <= names and not any("stem" in n for n in names)


def test_a_token_model_sees_the_grid_downscaled_a_cnn_sees_it_whole():
    vit = create_model("vit_tiny", depth=1, dim=16, num_heads=2, mlp_ratio=1.0).eval()
    cnn = create_model("resnet_fast", widths=[8, 8, 8], stem_width=8).eval()
    assert not game.takes_size(vit, (64, 64)) and game.takes_size(vit, (32, 32))
    assert game.takes_size(cnn, (96, 96))
    grid = torch.arange(64.0).view(1, 1, 8, 8).repeat(1, 3, 1, 1)
    assert torch.equal(game.model_input(grid, (4, 4))[0, 0], torch.nn.functional.avg_pool2d(grid, 2)[0, 0])


def test_scores_a_checkpoint_resumes_and_reports(tmp_path, capsys):
    ckpt = tiny_run(tmp_path / "runs" / "cnn", CNN)
    out = tmp_path / "grid.json"
    argv = [str(tmp_path / "runs"), "--out", str(out), "--threshold", "0", "--grids", "3", "--sizes", "2",
            "--ig-steps", "2", "--random-grids", "1", "--batch", "3"]
    assert game.main(argv) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert doc["provenance"]["command"].startswith("python -m bench.grid_game")
    names = {r["map"] for r in rows}
    assert set(game.CONTROLS) <= names and {"gradcam@layers.2", "input_x_gradient", "integrated_gradients",
                                            "layers.2.units.0.attn.spatial/grad"} <= names
    r = next(r for r in rows if r["map"] == "input_x_gradient")
    assert r["checkpoint"] == {"path": str(ckpt), "config": "tiny_resnet_fast", "seed": 3, "epoch": 2}
    assert r["grid"] == 2 and r["chance"] == 0.25 and not r["downscaled"] and "held out" in r["heldout"]
    assert [s["reset"] for s in r["randomisation"]] == ["fc", "layers.2", "layers.1", "layers.0", "stem"]
    for row in (x for x in rows if x["control"]):
        assert row["share"][0] == pytest.approx(0.25, abs=0.05) or row["map"] == "random"
    # resumable: a row in the file is kept as it is; a missing one is scored again
    rows[0]["share"] = [0.5, 0.5, 0.5]
    dropped = rows.pop(1)
    out.write_text(json.dumps({**doc, "rows": rows}))
    capsys.readouterr()
    assert game.main(argv) == 0
    again = json.loads(out.read_text())["rows"]
    assert len(again) == len(rows) + 1 and again[0]["share"] == [0.5, 0.5, 0.5]
    assert {x["map"] for x in again} == names and dropped["map"] in {x["map"] for x in again}
    assert game.main(argv) == 0
    assert "already scored" in capsys.readouterr().out
    table = game.report(again)
    assert table.startswith(game.BEGIN) and table.endswith(game.END)
    assert "| tiny_resnet_fast | `input_x_gradient` | input_x_gradient |" in table


@pytest.mark.parametrize("what", ["missing", "not_a_checkpoint"])
def test_a_bad_checkpoint_is_one_line_and_exit_2(tmp_path, what):
    path = tmp_path / "nothing"
    if what == "not_a_checkpoint":
        path = tmp_path / "last.pt"
        path.write_text("not a checkpoint\n")
    r = subprocess.run([sys.executable, "-m", "bench.grid_game", str(path), "--out", str(tmp_path / "o.json")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("grid_game.py: ")
    assert not (tmp_path / "o.json").exists()


def test_the_docs_table_is_the_one_the_results_give():
    doc = (ROOT / "docs" / "maps.md").read_text()
    block = doc[doc.index(game.BEGIN): doc.index(game.END) + len(game.END)]
    assert block == game.report(game.load(game.RESULTS)), (
        "docs/maps.md's grid game table is stale: run `python -m bench.grid_game --report --write`")


def test_the_seam_control_finds_pasted_patches_without_a_model():
    from visattn.config import PlacedConfig
    from visattn.data import make_synthetic
    from visattn.data.placed import place
    from visattn.maps.faithful import box_scores

    loc = importlib.import_module("bench.localization")
    cfg = PlacedConfig(canvas=48, tolerance=3, patch=4)
    canvases = place(make_synthetic(120, size=16, seed=2), cfg, 1)
    x = torch.from_numpy(canvases.x).permute(0, 3, 1, 2).float() / 255
    lm = loc.seam_map(x, cfg.patch)
    hit, _ = box_scores(lm, torch.from_numpy(canvases.boxes), cfg.tolerance, (48, 48), torch.Generator())
    assert hit.mean() > 0.6  # chance about 0.2


def test_seam_only_adds_the_seam_row_and_keeps_the_others(tmp_path):
    loc = importlib.import_module("bench.localization")
    tree = read_yaml(ROOT / "configs" / "smoke.yaml")
    tree.update(name="tiny_placed", run_dir=str(tmp_path / "run"), seed=0, precision="fp32")
    tree["model"] = dict(CNN)
    tree["data"].update(source="placed", image_size=16, synthetic_size=200, val_size=60,
                        placed={"source": "synthetic", "canvas": 48, "tolerance": 3, "patch": 4})
    cfg = build_config(tree)
    net = create_model("resnet_fast", num_classes=10, **cfg.model.options())
    (tmp_path / "run").mkdir()
    ckpt = tmp_path / "run" / "last.pt"
    save_checkpoint({"model": net.state_dict(), "config": cfg.to_dict(), "epoch": 1, "step": 1, "best_acc": 0.1,
                     "classes": [f"c{i}" for i in range(10)], "seed": 0}, ckpt)
    out = tmp_path / "loc.json"
    old = {"model": "resnet_fast", "checkpoint": {"path": str(ckpt), "config": "tiny_placed", "seed": 0, "epoch": 1},
           "val_acc": 0.1, "object": True, "images": 40, "canvas": 48, "object_size": 16, "tolerance": 3,
           "map": "gradcam", "kind": "gradcam", "pointing": [0.5, 0.4, 0.6], "energy": [0.3, 0.2, 0.4],
           "pointing_chance": 0.2, "energy_chance": 0.11, "deletion_score": None, "insertion_score": None}
    loc.save(out, [old])
    assert loc.main([str(tmp_path / "run"), "--seam-only", "--images", "40", "--out", str(out), "--device", "cpu"]) == 0
    rows = loc.load(out)
    assert [r["kind"] for r in rows] == ["gradcam", "seam"] and rows[0] == old
    seam = rows[1]
    assert seam["pointing"][0] > 2 * seam["pointing_chance"]  # it finds the pasted patch with no model
    table = loc.report(rows)
    assert "seam control" in table and "`gradcam` (gradcam)" in table  # a control is never the best map


def test_integrated_gradients_are_captums_and_complete(monkeypatch):
    torch.manual_seed(0)
    cnn = create_model("resnet_fast", widths=[8, 8, 8], stem_width=8).eval()
    x, target = torch.randn(2, 3, 32, 32), torch.tensor([3, 5])
    theirs = game.integrated_gradients(cnn, x, target, 8)  # captum's (a dev dependency)
    monkeypatch.setitem(sys.modules, "captum.attr", None)  # as without captum: the same sum written out
    mine = game.integrated_gradients(cnn, x, target, 8)
    assert torch.allclose(theirs, mine, atol=1e-5, rtol=1e-4)
    model = Planted().eval()  # linear: the attributions add up to logit(x) - logit(baseline) exactly
    xs, ys = coloured(1, 8)
    ig = game.integrated_gradients(model, xs, torch.from_numpy(ys), 4)
    with torch.no_grad():
        want = model(xs).gather(1, torch.from_numpy(ys)[:, None])[:, 0]
    assert torch.allclose(ig.flatten(1).sum(1), want, atol=1e-5)

"""``bench/faithfulness.py`` on a tiny checkpoint and synthetic held-out images: it finds the run, scores every
map kind (attention, its gradient-weighted version, both rollouts, the two gradient baselines), writes the rows
the table is made from, replaces a checkpoint's rows when it is scored again, and reports per model the most
faithful map."""
from __future__ import annotations

import importlib
import json

import pytest
import torch
from conftest import ROOT

from visattn.config import build_config, read_yaml
from visattn.models import create_model
from visattn.rundir import save_checkpoint

bench = importlib.import_module("bench.faithfulness")


def tiny_run(run_dir, model: dict, seed: int = 3):
    tree = read_yaml(ROOT / "configs" / "smoke.yaml")
    tree.update(name=f"tiny_{model['name']}", run_dir=str(run_dir), seed=seed, precision="fp32")
    tree["model"] = dict(model)
    tree["data"].update(synthetic_size=120, val_size=40)
    cfg = build_config(tree)
    torch.manual_seed(0)
    net = create_model(model["name"], num_classes=10, **cfg.model.options())
    state = {"model": net.state_dict(), "config": cfg.to_dict(), "epoch": 2, "step": 10, "best_acc": 0.5,
             "classes": [f"c{i}" for i in range(10)], "seed": seed}
    save_checkpoint(state, run_dir / "last.pt")
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"epoch": 1, "val_acc": 0.25}, {"epoch": 2, "val_acc": 0.375})) + "\n")
    return run_dir / "last.pt"


def test_scores_every_kind_writes_rows_and_reports(tmp_path, capsys):
    vit = tiny_run(tmp_path / "runs" / "vit", {"name": "vit_tiny", "depth": 2, "dim": 32, "num_heads": 2,
                                               "mlp_ratio": 1.0})
    out = tmp_path / "faithfulness.json"
    opts = ["--out", str(out), "--images", "8", "--vit-images", "6", "--steps", "2", "--regions", "2", "--draws", "1",
            "--device", "cpu"]
    assert bench.main([str(tmp_path / "runs")] + opts) == 0  # a folder: the run below it is found
    rows = json.loads(out.read_text())["rows"]
    assert {r["kind"] for r in rows} == set(bench.KINDS) - {"layers_gradient"}  # a ViT's layers share one grid
    names = [r["map"] for r in rows]
    assert names == ["blocks.0.attn", "blocks.0.attn/grad", "blocks.1.attn", "blocks.1.attn/grad", "rollout",
                     "rollout_grad", "input_x_gradient", "gradcam", "centre"]
    r = rows[0]
    assert r["model"] == "vit_tiny" and r["images"] == 6 and r["val_acc"] == 0.375
    assert r["checkpoint"] == {"path": str(vit), "config": "tiny_vit_tiny", "seed": 3, "epoch": 2}
    for row in rows:
        for key in ("deletion_score", "insertion_score"):
            mean, lo, hi = row[key]
            assert lo <= mean <= hi
        assert row["sanity_rho"] is None or -1 <= row["sanity_rho"] <= 1
    assert "NaN" not in out.read_text()

    cnn = tiny_run(tmp_path / "cnn", {"name": "resnet_fast", "widths": [8, 16, 16], "stem_width": 8,
                                      "attention": "coord"}, seed=1)
    assert bench.main([str(cnn.parent), str(vit.parent)] + opts + ["--no-sanity"]) == 0  # the ViT again: replaced
    rows = json.loads(out.read_text())["rows"]
    assert sorted({r["checkpoint"]["path"] for r in rows}) == sorted([str(vit), str(cnn)])
    assert len([r for r in rows if r["model"] == "vit_tiny"]) == len(names)
    coord = [r for r in rows if r["model"] == "resnet_fast"]
    assert coord[0]["images"] == 8 and coord[0]["map"] == "layers.0.units.0.attn"
    assert {r["kind"] for r in coord} == {"attention", "attention_gradient", "layers_gradient", "input_x_gradient",
                                          "gradcam", "centre"}  # a block in each stage: their gradient maps joined too
    assert [r["map"] for r in coord if r["kind"] == "layers_gradient"] == ["layers_grad"]
    # every map but the prior carries its paired difference to the centre prior
    assert all(("vs_centre" in r) == (r["map"] != "centre") for r in coord)
    for r in coord[:-1]:
        for key, score in (("deletion", "deletion_score"), ("insertion", "insertion_score")):
            mean, lo, hi = r["vs_centre"][key]
            assert lo <= mean <= hi and mean == pytest.approx(r[score][0] - coord[-1][score][0], abs=1e-9)
    capsys.readouterr()

    assert bench.main(["--report", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("| model | checkpoint | val acc | images | map | kind | deletion score |")
    assert "| vit_tiny | tiny_vit_tiny seed 3 | 0.3750 | 6 | `rollout_grad` | gradient_rollout |" in text
    verdicts = [line for line in text.splitlines() if line.startswith("- **")]
    assert len(verdicts) == 2 and all("most faithful map `" in v for v in verdicts)
    best = max((r for r in rows if r["model"] == "vit_tiny"), key=bench.merit)
    assert f"most faithful map `{best['map']}`" in next(v for v in verdicts if "vit_tiny" in v)


def _row(name: str, kind: str, deletion: float, insertion: float) -> dict:
    return {"model": "m", "map": name, "kind": kind, "deletion_score": [deletion, deletion - 0.01, deletion + 0.01],
            "insertion_score": [insertion, insertion - 0.01, insertion + 0.01]}


def test_report_says_whether_a_map_from_attention_is_as_faithful_as_input_x_gradient():
    ixg = _row("input_x_gradient", "input_x_gradient", 0.06, 0.04)
    ahead_on_one = [_row("a", "attention", 0.08, 0.01), _row("a/grad", "attention_gradient", 0.01, 0.09), ixg]
    line = bench._against_gradient(ahead_on_one)
    assert line.startswith("  - no attention-derived map is as faithful") and "`a/grad`" in line
    both = ahead_on_one + [_row("rollout_grad", "gradient_rollout", 0.06, 0.05), _row("gradcam", "gradcam", 0.2, 0.2)]
    line = bench._against_gradient(both)
    assert "at least as faithful as input x gradient on both curves: `rollout_grad`" in line
    assert "deletion +0.060 vs +0.060, insertion +0.050 vs +0.040" in line
    assert "no input x gradient" in bench._against_gradient([_row("a", "attention", 0.1, 0.1)])
    # against the centre prior: rollout_grad ahead of it on deletion only, so no map is
    centre = _row("centre", "centre", 0.05, 0.06)
    line = bench._against_gradient(both + [centre], "centre")
    assert line.startswith("  - no attention-derived map is as faithful as the centre prior on both curves")
    line = bench._against_gradient(both + [_row("centre", "centre", 0.05, 0.05)], "centre")
    assert "at least as faithful as the centre prior on both curves: `rollout_grad`" in line


def test_summary_gives_each_checkpoint_its_best_map_per_family_and_the_verdict():
    head = {"model": "m", "checkpoint": {"path": "a/last.pt", "config": "cfg_a", "seed": 0}, "val_acc": 0.8,
            "images": 500}
    a = [{**head, **r} for r in (_row("x", "attention", -0.1, 0.0), _row("y", "attention", 0.02, 0.01),
                                 _row("x/grad", "attention_gradient", 0.07, 0.05),
                                 _row("input_x_gradient", "input_x_gradient", 0.06, 0.04))]
    b = [{**head, "checkpoint": {"path": "b/last.pt", "config": "cfg_b", "seed": 1}, "val_acc": None, **r}
         for r in (_row("rollout", "rollout", 0.01, 0.02), _row("input_x_gradient", "input_x_gradient", 0.06, 0.04),
                   _row("gradcam", "gradcam", 0.03, 0.2), _row("centre", "centre", 0.05, 0.25))]
    lines = bench.summary(a + b).splitlines()
    assert lines[0] == bench.README_BEGIN and lines[-1] == bench.README_END and len(lines) == 6
    # cfg_a was scored without the centre prior ("-"); on cfg_b the prior is the most faithful map
    assert lines[3] == ("| m (cfg_a, 0) | 80.00% | 500 | +0.020 / +0.010 | +0.070 / +0.050 | - | +0.060 / +0.040 "
                        "| - | - | `x/grad` (attention_gradient) | yes | - |")
    assert lines[4] == ("| m (cfg_b, 1) | - | 500 | - | - | +0.010 / +0.020 | +0.060 / +0.040 | +0.030 / +0.200 "
                        "| +0.050 / +0.250 | `centre` (centre) | no | no |")


def test_the_results_pages_faithfulness_table_is_the_one_the_results_give():
    doc = (ROOT / "docs" / "results.md").read_text()
    start, end = doc.index(bench.README_BEGIN), doc.index(bench.README_END) + len(bench.README_END)
    assert doc[start:end] == bench.summary(bench.load(bench.RESULTS)), \
        "docs/results.md's faithfulness table is stale: paste `python -m bench.faithfulness --summary`"

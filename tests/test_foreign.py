"""timm and torchvision models by name (``model.name: timm/<name>``, ``torchvision/<name>``) through the one model path:
the builder, the CIFAR stem, local weights, the inserted blocks, and everything downstream of the builder
(precision, layouts, compile, resume, ``model.init_from``, EMA, maps, HParams, ``evaluate``, ``visualize``,
placed objects), each on a few synthetic steps; and the bad inputs, each one line and exit 2 before anything is
written."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import timm
import torch
import torchvision
from conftest import ROOT, first_fast, metrics_rows, run_cli

import visattn
from visattn.config import load_config
from visattn.data import Placement, build_loader, load_splits
from visattn.evaluate import evaluate
from visattn.evaluate import main as evaluate_main
from visattn.hparams import logged_hparams
from visattn.rundir import load_checkpoint
from visattn.trainer import run
from visattn.visualize import main as visualize_main

SMOKE = ROOT / "configs" / "smoke.yaml"
SMALL = "model.kwargs.channels=[8,8,16,16]"  # a timm ResNet-18 of the same depth at a few channels: seconds a run
TINY = ["data.synthetic_size=240", "data.val_size=40", "train.batch_size=40", "eval.batch_size=100",
        "log.progress=false", "train.epochs=1", "device=cpu"]
RESNET = ["model.name=timm/resnet18", "model.cifar_stem=true", SMALL]


def _quiet(*a, **k) -> None:
    pass


def _cfg(tmp_path: Path, *extra: str, name: str = "run"):
    return load_config(SMOKE, [*RESNET, *TINY, f"run_dir={tmp_path / name}", *extra])


def _tags(run_dir: Path) -> tuple:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    return set(acc.Tags()["images"]), set(acc.Tags()["scalars"])


# ---- the builder -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,attention,blocks", [("timm/resnet18", "cbam", 8), ("torchvision/mobilenet_v3_small", "eca", 6),
                                                   ("timm/regnetx_002", "se", 13), ("torchvision/resnet18", "coord", 8)])
def test_a_package_model_by_name_holds_the_blocks_insert_attention_puts(name, attention, blocks):
    model = visattn.create_model(name, num_classes=7, attention=attention, cifar_stem=True)
    put = [n for n, m in model.named_modules() if getattr(m, "_visattn_attention", None) == attention]
    assert len(put) == blocks
    assert model.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_the_cifar_stem_keeps_32_pixels_to_the_first_stage():
    for name, stem in (("timm/resnet18", "conv1"), ("torchvision/resnet18", "conv1"), ("timm/mobilenetv3_small_100", "conv_stem"),
                       ("timm/convnext_atto", "stem.0"), ("torchvision/regnet_x_400mf", "stem.0")):
        plain, cifar = (visattn.create_model(name, cifar_stem=c) for c in (False, True))
        conv = cifar.get_submodule(stem)
        assert (conv.kernel_size, conv.stride) == ((3, 3), (1, 1)), name
        assert plain.get_submodule(stem).stride != (1, 1), name
        assert not isinstance(getattr(cifar, "maxpool", torch.nn.Identity()), torch.nn.MaxPool2d), name


def test_a_model_name_switch_keeps_only_the_options_the_new_model_takes():
    cfg = load_config(SMOKE, ["model.name=timm/resnet18"])  # smoke.yaml's widths and stem_width are resnet_fast's
    assert cfg.model.options() == {"attention": "cbam"}
    cfg = load_config(ROOT / "configs" / "timm" / "vit_tiny.yaml")  # its base's model options are a ResNet's
    assert cfg.model.options() == {"attention": "none", "kwargs": {"img_size": 32, "patch_size": 4}}
    # resnet_fast's airbench BN momentum (0.4) is its own design: not carried to a package model's BatchNorms
    cpu = ROOT / "configs" / "cifar10_cpu.yaml"
    assert load_config(cpu).model.options()["bn_momentum"] == 0.4
    assert "bn_momentum" not in load_config(cpu, ["model.name=timm/resnet18"]).model.options()
    assert load_config(cpu, ["model.name=timm/resnet18", "model.bn_momentum=0.2"]).model.options()["bn_momentum"] == 0.2
    # between two package models every option the new one takes stays
    tv = load_config(ROOT / "configs" / "timm" / "tv_mobilenet_v3_small.yaml", ["model.name=torchvision/mobilenet_v3_large"])
    assert tv.model.options()["bn_momentum"] == 0.1 and tv.model.options()["cifar_stem"] is True


@pytest.mark.parametrize("recipe", sorted((ROOT / "configs" / "timm").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_timm_recipe_builds_and_takes_32_pixel_images(recipe):
    cfg = load_config(recipe)
    assert cfg.train.epochs == 4 and cfg.model.name.startswith(("timm/", "torchvision/"))
    model = visattn.create_model(cfg.model.name, num_classes=10, **cfg.model.options())
    assert model.eval()(torch.randn(1, 3, 32, 32)).shape == (1, 10)
    assert len((recipe.read_text()).splitlines()) <= 30


# ---- weights from a local file -----------------------------------------------------------------------------


def _small_resnet(num_classes: int = 10, arch: str = "resnet18") -> torch.nn.Module:
    model = timm.create_model(arch, num_classes=num_classes, channels=(8, 8, 16, 16))
    visattn.models.foreign.apply_cifar_stem(model, arch)
    with torch.no_grad():  # trained-looking BN statistics, so the eval-mode output is not the init's
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
    return model


def test_every_weights_file_form_reads_to_the_same_state_dict(tmp_path):
    from safetensors.torch import save_file

    from visattn.models.foreign import read_weights

    state = _small_resnet().state_dict()
    save_file(state, str(tmp_path / "w.safetensors"))
    torch.save(state, tmp_path / "w.bin")
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in state.items()}}, tmp_path / "ckpt.pth.tar")
    for name in ("w.safetensors", "w.bin", "ckpt.pth.tar"):
        got = read_weights(tmp_path / name)
        assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state), name


@pytest.mark.parametrize("form", first_fast(["safetensors", "timm"]))
def test_a_run_from_a_weights_file_scores_at_step_0_what_the_files_model_scores(tmp_path, form):
    from safetensors.torch import save_file

    torch.manual_seed(3)
    net = _small_resnet()
    path = tmp_path / ("w.safetensors" if form == "safetensors" else "w.pth")
    if form == "safetensors":
        save_file(net.state_dict(), str(path))
    else:
        torch.save({"epoch": 3, "state_dict": net.state_dict()}, path)  # a timm checkpoint
    cfg = _cfg(tmp_path, "model.attention=cbam", f"model.pretrained_file={path}", "log.maps_every=0",
               "precision=fp32", "eval.tta=none", "train.max_steps=1")
    lines: List[str] = []
    summary = run(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    splits = load_splits(cfg.data, cfg.seed)
    loader = build_loader(splits.eval, cfg.data, 100, False, cfg.seed, Placement(torch.device("cpu")))
    own = evaluate(net, loader, device=torch.device("cpu"), precision="fp32", tta="none")
    assert summary["init_from"]["val_acc"] == own["acc"] and summary["init_from"]["val_loss"] == pytest.approx(own["loss"], abs=1e-5)
    assert any(line.startswith("step 0 (model.pretrained_file") for line in lines)
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["init_from"]["weights"] == "pretrained_file" and info["init_from"]["replaced"] == []


def test_a_classifier_of_another_class_count_is_replaced_and_said(tmp_path):
    path = tmp_path / "in1k.pth"
    torch.save(_small_resnet(num_classes=1000).state_dict(), path)
    lines: List[str] = []
    run(_cfg(tmp_path, f"model.pretrained_file={path}", "log.maps_every=0", "train.max_steps=1"),
        log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    said = [line for line in lines if line.startswith("model.pretrained_file:")]
    assert len(said) == 1 and "fc.weight" in said[0] and "replaced by a fresh one" in said[0]


# ---- downstream: every path of the trainer on a package model ----------------------------------------------


def test_the_cli_trains_logs_the_blocks_maps_and_evaluate_scores_it(tmp_path):
    rd = tmp_path / "run"
    proc = run_cli(["--config", SMOKE, *RESNET, "model.attention=cbam", *TINY, f"run_dir={rd}", "log.faithfulness=true"])
    assert proc.returncode == 0, proc.stderr
    images, scalars = _tags(rd)
    assert any(t.startswith("maps/") and "spatial" in t for t in images), images
    assert any(t.startswith("faithfulness/") for t in scalars)
    hp, _ = logged_hparams(rd / "tb")
    assert hp["model"] == "timm/resnet18" and hp["family"] == "timm" and hp["attention"] == "cbam"
    assert hp["attn_init"] == "identity"
    ev = run_cli(["--checkpoint", str(rd / "best.pt"), "--data", "synthetic", "--json"], tool=evaluate_main)
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout)["acc"] == pytest.approx(metrics_rows(rd)[-1]["val_acc"])
    vis = run_cli(["--checkpoint", str(rd / "best.pt"), "--validation", "2", "--data", "synthetic", "--out",
                   str(tmp_path / "vis"), "--device", "cpu"], tool=visualize_main)
    assert vis.returncode == 0, vis.stderr
    assert len(list((tmp_path / "vis").glob("*.png"))) >= 2


def test_torchvision_mobilenet_with_eca_trains_and_the_checkpoint_rebuilds_without_the_config(tmp_path):
    rd = tmp_path / "run"
    cfg = load_config(SMOKE, ["model.name=torchvision/mobilenet_v3_small", "model.attention=eca", "model.cifar_stem=true",
                              "model.kwargs.width_mult=0.25", *TINY, f"run_dir={rd}", "log.maps_every=0"])
    run(cfg, log=_quiet)
    (rd / "config.yaml").unlink()  # the checkpoint's spec alone rebuilds the model
    model, stored, _ = visattn.load_model_from_checkpoint(str(rd / "best.pt"), torch.device("cpu"))
    assert stored.model.name == "torchvision/mobilenet_v3_small"
    skips = sum(1 for m in model.modules() if getattr(m, "use_res_connect", False))  # 7 at width 0.25
    assert sum(1 for m in model.modules() if getattr(m, "_visattn_attention", None) == "eca") == skips == 7


def test_a_timm_vits_own_attention_is_logged_as_maps(tmp_path):
    rd = tmp_path / "run"
    cfg = load_config(SMOKE, ["model.name=timm/vit_tiny_patch16_224", "model.attention=none",
                              "model.kwargs={img_size: 32, patch_size: 8, embed_dim: 32, depth: 2, num_heads: 2}",
                              *TINY, f"run_dir={rd}", "log.faithfulness=true"])
    run(cfg, log=_quiet)
    images, scalars = _tags(rd)
    assert any("rollout" in t for t in images) and any(t.startswith("faithfulness/") for t in scalars)


@pytest.mark.parametrize("extra", [["precision=bf16", "channels_last=false"], ["precision=fp16", "train.ema_decay=0.9"],
                                   ["compile=true", "precision=fp32"]],
                         ids=["bf16-contiguous", "fp16-ema", "compile"])
def test_each_precision_layout_ema_and_compile_trains_a_package_model(tmp_path, extra):
    summary = run(_cfg(tmp_path, "model.attention=cbam", "log.maps_every=0", "train.batch_size=100", *extra), log=_quiet)
    rows = metrics_rows(tmp_path / "run")  # one epoch of 2 steps
    assert summary["epochs"] == 1 and len(rows) == 1 and math.isfinite(rows[0]["train_loss"])
    state = load_checkpoint(tmp_path / "run" / "last.pt")
    assert state["step"] == 2 and (state.get("ema") is not None) == ("train.ema_decay=0.9" in extra)


def test_resume_continues_a_package_model_exactly(tmp_path):
    straight = _cfg(tmp_path, "model.attention=cbam", "log.maps_every=0", "train.epochs=2", "precision=fp32", name="a")
    run(straight, log=_quiet)
    half = _cfg(tmp_path, "model.attention=cbam", "log.maps_every=0", "train.epochs=2", "precision=fp32",
                "train.max_steps=6", name="b")  # 5 steps an epoch: stopped mid-epoch 2
    run(half, log=_quiet)
    run(_cfg(tmp_path, "model.attention=cbam", "log.maps_every=0", "train.epochs=2", "precision=fp32", "resume=auto",
             name="b"), log=_quiet)
    a, b = (load_checkpoint(tmp_path / n / "last.pt")["model"] for n in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_init_from_a_package_model_adds_a_block_at_identity(tmp_path):
    run(_cfg(tmp_path, "model.attention=none", "log.maps_every=0", "precision=fp32", "eval.tta=none", name="base"),
        log=_quiet)
    base_acc = metrics_rows(tmp_path / "base")[-1]["val_acc"]
    summary = run(_cfg(tmp_path, "model.attention=cbam", f"model.init_from={tmp_path / 'base' / 'best.pt'}",
                       "log.maps_every=0", "precision=fp32", "eval.tta=none", "train.max_steps=1", name="ft"), log=_quiet)
    assert summary["init_from"]["val_acc"] == base_acc and len(summary["init_from"]["new_blocks"]) == 8


@pytest.mark.slow
def test_torchrun_trains_a_package_model_on_two_ranks(tmp_path):
    rd = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", str(ROOT / "train.py"),
           "--config", str(SMOKE), *RESNET, "model.attention=cbam", *TINY, f"run_dir={rd}", "log.maps_every=0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((rd / "run_info.json").read_text())["world_size"] == 2 and (rd / "last.pt").is_file()


def test_placed_objects_on_a_package_model_are_scored_by_the_localization_bench(tmp_path):
    rd = tmp_path / "run"
    cfg = load_config(SMOKE, [*RESNET, "model.attention=cbam", *TINY, f"run_dir={rd}", "log.maps_every=0",
                              "data.source=placed", "data.placed.source=synthetic"])  # 80-px canvases
    run(cfg, log=_quiet)
    out = tmp_path / "loc.json"
    proc = subprocess.run([sys.executable, "-m", "bench.localization", str(rd), "--out", str(out),
                           "--images", "20", "--faith-images", "4", "--device", "cpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    kinds = {r.get("kind") for r in rows}
    assert "attention" in kinds and "gradcam" in kinds


# ---- bad input: one line, exit 2, nothing written ----------------------------------------------------------


def _refused(tmp_path: Path, *argv: str, spawn: bool = False) -> str:
    rd = tmp_path / "run"
    args = ["--config", str(SMOKE), *TINY, f"run_dir={rd}", *argv]
    if spawn:
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    else:
        proc = run_cli(args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not (rd / "config.yaml").exists()
    return lines[0]


def test_an_unknown_name_is_one_line_with_the_nearest_names(tmp_path):
    line = _refused(tmp_path, "model.name=timm/resnet181", spawn=True)
    assert "unknown timm model 'resnet181'" in line and "resnet18," in line
    assert "torchvision model 'resnt18'" in _refused(tmp_path, "model.name=torchvision/resnt18")


def test_a_resnet34_weights_file_given_to_resnet18_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "r34.pth"
    torch.save(_small_resnet(arch="resnet34").state_dict(), path)
    line = _refused(tmp_path, *RESNET, f"model.pretrained_file={path}", spawn=True)
    assert str(path) in line and "layer1.2.conv1.weight" in line


@pytest.mark.parametrize("argv,says", [
    (["model.name=torchvision/fasterrcnn_resnet50_fpn"], "is not a classifier"),
    (["model.name=timm/vit_tiny_patch16_224", "model.attention=none"], "cannot take this data's 32x32 images"),
    ([*RESNET, "model.kwargs.drop_path_rate=.nan"], "kwargs.drop_path_rate must be a finite number"),
    ([*RESNET, "model.kwargs.drop_path_rate=2"], "kwargs.drop_path_rate must be in [0, 1)"),
    ([*RESNET, "model.kwargs.zero_init=true"], "unexpected keyword argument 'zero_init'"),
    ([*RESNET, "model.kwargs.channels=[-8,8,16,16]"], "option kwargs.channels[0] must be at least 1, got -8"),
    ([*RESNET, "model.kwargs.num_classes=5"], "the class count comes from the data"),
    ([*RESNET, "model.pretrained=true"], "download the weights once"),
    ([*RESNET, "model.kwargs.pretrained=true"], "download the weights once"),
    (["model.name=timm/vit_tiny_patch16_224", "model.attention=cbam", "model.kwargs={img_size: 32, patch_size: 8}"],
     "model.attn_at"),
    ([*RESNET, "model.cifar_stem=2"], "must be true or false"),
    ([*RESNET, "model.attn_kwargs=[[init, identity]]"], "must be a mapping"),
    ([*RESNET, "model.attn_at=3"], "attn_at"),
    ([*RESNET, "model.pretrained_file=nothing_here.pth"], "not found"),
])
def test_bad_package_model_options_are_one_line_before_anything_is_written(tmp_path, argv, says):
    assert says in _refused(tmp_path, *argv)


@pytest.mark.parametrize("damage", ["truncated", "text", "nan", "pickle", "empty_dict"])
def test_a_damaged_or_non_finite_weights_file_is_one_line(tmp_path, damage):
    path = tmp_path / "w.pth"
    state = _small_resnet().state_dict()
    if damage == "truncated":
        torch.save(state, path)
        path.write_bytes(path.read_bytes()[:5000])
    elif damage == "text":
        path.write_text("not weights")
    elif damage == "nan":
        state["layer1.0.conv1.weight"][0, 0, 0, 0] = float("nan")
        torch.save(state, path)
    elif damage == "pickle":
        torch.save({"fc.weight": torch.zeros(1), "why": object.__new__(torchvision.ops.misc.Permute)}, path)
    else:
        torch.save({}, path)
    line = _refused(tmp_path, *RESNET, f"model.pretrained_file={path}")
    assert str(path) in line
    assert {"nan": "non-finite", "pickle": "pickled objects", "empty_dict": "no state dict"}.get(damage, "damaged") in line


# ---- the results table ---------------------------------------------------------------------------------------


def _bench():
    from bench import foreign_models

    return foreign_models


def test_the_docs_table_is_the_one_the_results_give():
    bench = _bench()
    doc = (ROOT / "docs" / "results.md").read_text()
    block = doc[doc.index(bench.BEGIN) + len(bench.BEGIN): doc.index(bench.END)].strip()
    assert block == bench.table(json.loads(bench.RESULTS.read_text())), (
        "docs/results.md's foreign models table is stale: run `python -m bench.foreign_models --report --write`")


def test_the_table_pairs_each_arm_with_none_by_seed_within_one_kernel_family():
    bench = _bench()
    base = {"epochs": 4, "precision": "fp32", "cpu": "CPU", "kernels": "avx2", "threads": 1, "parameters": 2e6,
            "train_seconds": 1.0, "load_mean": 1.0, "eval_split": "validation split", "git": "x"}
    gain = {"none": 0.0, "se": 0.002, "cbam": -0.004, "coord": 0.001}
    rows = [bench.row("configs/timm/regnetx_002.yaml", arm, seed, dict(base, val_acc=0.6 + 0.01 * seed + gain[arm],
                                                                      images_per_s=100.0 + seed, resumed=(seed == 1)))
            for seed in (0, 1) for arm in gain]
    # the same recipe on another family of kernels: a row of its own, never paired with the first
    rows += [bench.row("configs/timm/regnetx_002.yaml", arm, 0, dict(base, kernels="amx", precision="bf16",
                                                                    val_acc=0.7 + (arm == "se") * 0.05, images_per_s=300.0))
             for arm in ("none", "se")]
    lines = bench.table(rows).splitlines()
    assert lines[0].startswith("| model (recipe) | numerics |") and "SE - none | CBAM - none | coord - none |" in lines[0]
    first, other = lines[2], lines[3]
    assert "| fp32 on avx2 |" in first and "60.50 ± 0.71" in first and "| 100 |" in first  # resumed: not in the speed
    assert "**+0.20** (+0.20 / +0.20)" in first and "**-0.40** (-0.40 / -0.40)" in first
    assert "| bf16 on amx |" in other and "| +5.00 |" in other and "| — |" in other  # CBAM, coord: no runs there
    assert "Furthest below `none`: CBAM in `regnetx_002.yaml` (fp32 on avx2), -0.40." in bench.table(rows)
    assert all(r["placement"] == "se-slot" and r["blocks"] == 13 for r in rows if r["attention"] != "none")


def test_block_runs_at_the_earlier_sites_leave_the_table_for_the_changelog():
    bench = _bench()
    base = {"epochs": 4, "precision": "fp32", "cpu": "CPU", "kernels": "avx2", "threads": 1, "parameters": 2e6,
            "train_seconds": 1.0, "load_mean": 1.0, "eval_split": "validation split", "git": "x", "images_per_s": 1.0}
    recipe = "configs/timm/mobilenetv3_small.yaml"
    old = {k: v for k, v in bench.row(recipe, "cbam", 0, dict(base, val_acc=0.4)).items()
           if k not in ("placement", "blocks")}  # a row of the earlier rule: no placement recorded
    none = bench.row(recipe, "none", 0, dict(base, val_acc=0.6))
    assert not bench.current(old) and bench.current(none)
    assert not bench.done([old], recipe, "cbam", 0, 4) and bench.done([none], recipe, "none", 0, 4, "fp32 on avx2")
    assert not bench.done([none], recipe, "none", 0, 4, "bf16 on amx")  # another family: run again there
    text = bench.table([none, old])
    assert "-20.00" not in text and "1 block runs at the earlier sites" in text
    kept = {k: v for k, v in bench.row("configs/timm/regnetx_002.yaml", "cbam", 0, dict(base, val_acc=0.4)).items()
            if k != "placement"}  # ResNet / RegNet sites did not move: their earlier runs still count
    assert bench.current(kept)
    assert bench.plan(["a", "b"], [0, 1], False, ["none", "se"]) == [
        ("a", "none", 0), ("a", "se", 0), ("a", "none", 1), ("a", "se", 1),
        ("b", "none", 0), ("b", "se", 0), ("b", "none", 1), ("b", "se", 1)]


def test_blocks_in_the_se_place_are_a_row_of_their_own_beside_the_same_none():
    """--in-se-place rows (each of MobileNetV3-Small's 9 SE modules replaced) pair with the recipe's own none runs
    on a line of their own; a resumed sweep tells them from the default rule's runs; the worst-arm sentence is
    the default rule's."""
    bench = _bench()
    base = {"epochs": 4, "precision": "bf16", "cpu": "CPU", "kernels": "amx", "threads": 2, "parameters": 1.5e6,
            "train_seconds": 1.0, "load_mean": 1.0, "eval_split": "validation split", "git": "x", "images_per_s": 1.0}
    recipe = "configs/timm/mobilenetv3_small.yaml"
    none = [bench.row(recipe, "none", s, dict(base, val_acc=0.65)) for s in (0, 1)]
    kept = [bench.row(recipe, "cbam", s, dict(base, val_acc=0.62)) for s in (0, 1)]
    moved = [bench.row(recipe, "cbam", s, dict(base, val_acc=0.645 + 0.01 * s), replace=True) for s in (0, 1)]
    assert {r["placement"] for r in moved} == {"se-replaced"} and {r["blocks"] for r in moved} == {9}
    assert {r["blocks"] for r in kept} == {6} and "replace_se: true" in moved[0]["command"]
    assert bench.done(kept, recipe, "cbam", 0, 4) and not bench.done(kept, recipe, "cbam", 0, 4, replace=True)
    assert bench.done(moved, recipe, "cbam", 1, 4, replace=True) and not bench.done(moved, recipe, "cbam", 1, 4)
    text = bench.table([*none, *kept, *moved])
    lines = [ln for ln in text.splitlines() if ln.startswith("| timm/mobilenetv3_small_100")]
    assert len(lines) == 2 and "in the SE's place" not in lines[0] and "in the SE's place" in lines[1]
    assert "**-3.00** (-3.00 / -3.00)" in lines[0] and "**+0.00** (-0.50 / +0.50)" in lines[1]
    assert "| 6 |" in lines[0] and "| 9 |" in lines[1] and "65.00" in lines[1]  # the same none beside both
    assert "Furthest below `none`: CBAM in `mobilenetv3_small.yaml` (bf16 on amx), -3.00." in text


def test_blocks_at_another_lr_scale_than_the_recipes_are_a_row_of_their_own_and_do_not_count_as_done():
    """The inverted-residual recipes train their blocks at optim.attn_lr_scale=0.1. Block runs at another scale
    (the rows from before, at 1) pair with the same none runs on a line of their own, are not the recipe's runs
    to a resumed sweep, and are left out of the worst-arm sentence; none's runs count at any scale."""
    bench = _bench()
    recipe = "configs/timm/mobilenetv3_small.yaml"
    assert bench.recipe_lr_scale(recipe) == 0.1 and bench.recipe_lr_scale("configs/timm/regnetx_002.yaml") == 1.0
    base = {"epochs": 4, "precision": "fp32", "cpu": "CPU", "kernels": "avx2", "threads": 2, "parameters": 1.5e6,
            "train_seconds": 1.0, "load_mean": 1.0, "eval_split": "validation split", "git": "x", "images_per_s": 1.0}
    none = [bench.row(recipe, "none", s, dict(base, val_acc=0.60)) for s in (0, 1)]
    slow = [bench.row(recipe, "coord", s, dict(base, val_acc=0.62)) for s in (0, 1)]
    fast = [dict(r, attn_lr_scale=1.0, val_acc=0.55) for r in slow]
    assert {r["attn_lr_scale"] for r in slow} == {0.1} and "attn_lr_scale" not in none[0]
    assert bench.done(slow, recipe, "coord", 0, 4) and not bench.done(fast, recipe, "coord", 0, 4)
    assert not bench.done([{k: v for k, v in r.items() if k != "attn_lr_scale"} for r in slow], recipe, "coord", 0, 4)
    assert bench.done(none, recipe, "none", 1, 4)
    text = bench.table([*none, *fast, *slow])
    lines = [ln for ln in text.splitlines() if ln.startswith("| timm/mobilenetv3_small_100")]
    assert len(lines) == 2 and "blocks at **0.1x** lr" in lines[0] and "blocks at **1x** lr" in lines[1]
    assert "**+2.00** (+2.00 / +2.00)" in lines[0] and "**-5.00** (-5.00 / -5.00)" in lines[1]
    assert "60.00" in lines[0] and "60.00" in lines[1]  # the same none beside both
    assert "Furthest below `none`: coord in `mobilenetv3_small.yaml` (fp32 on avx2), +2.00." in text
    # at 1x alone on a family (no run at the recipe's 0.1x there): the earlier recipe's, history, none's line kept
    only_fast = bench.table([*none, *fast])
    lines = [ln for ln in only_fast.splitlines() if ln.startswith("| timm/mobilenetv3_small_100")]
    assert len(lines) == 1 and "**1x**" not in lines[0] and "-5.00" not in only_fast and "60.00" in lines[0]
    assert "2 block runs at another lr scale than their recipe's" in only_fast


def test_runs_at_an_earlier_lr_or_head_init_of_their_recipe_leave_the_table_and_are_not_done():
    """A recipe whose optim.lr or model.head_init changed (TinyNet-E's lr 0.4 to 0.1, then 0.4 with a zero classifier)
    is another recipe: its earlier runs, none's too, are neither paired with the new ones nor counted as done by a
    resumed sweep, and the table says where they went."""
    bench = _bench()
    recipe = "configs/timm/tinynet_e.yaml"
    assert bench.recipe_settings(recipe)["lr"] == load_config(ROOT / recipe).optim.lr
    base = {"epochs": 4, "precision": "fp32", "cpu": "CPU", "kernels": "avx2", "threads": 2, "parameters": 0.8e6,
            "train_seconds": 1.0, "load_mean": 1.0, "eval_split": "validation split", "git": "x", "images_per_s": 1.0}
    now = [bench.row(recipe, arm, s, dict(base, val_acc=0.5 + 0.01 * (arm == "se"))) for s in (0, 1) for arm in ("none", "se")]
    then = [dict(r, lr=2 * r["lr"], val_acc=0.3 if r["attention"] == "se" else 0.4) for r in now]
    assert all(bench.current(r) for r in now) and not any(bench.current(r) for r in then)
    assert bench.done(now, recipe, "none", 0, 4) and not bench.done(then, recipe, "none", 0, 4)
    assert not bench.done(then, recipe, "se", 1, 4)
    # the same lr at the package's own classifier init (rows from before head_init was recorded): history too
    assert bench.recipe_settings(recipe)["head_init"] == "zero" and all(r["head_init"] == "zero" for r in now)
    own_head = [{k: v for k, v in r.items() if k != "head_init"} for r in now]
    assert not any(bench.current(r) for r in own_head) and not bench.done(own_head, recipe, "none", 0, 4)
    text = bench.table([*then, *now])
    lines = [ln for ln in text.splitlines() if ln.startswith("| timm/tinynet_e")]
    assert len(lines) == 1 and "50.00" in lines[0] and "**+1.00** (+1.00 / +1.00)" in lines[0]
    assert "-10.00" not in text and "4 runs at an earlier lr or head init of their recipe are history" in text
    assert bench.worst([*then, *now])[0] == pytest.approx(1.0)


def test_the_reference_comes_from_the_attention_table_only_at_the_same_budget_precision_and_kernels(tmp_path):
    bench = _bench()
    base = {"epochs": 4, "precision": "fp32", "cpu": "CPU", "kernels": "avx2", "threads": 2, "parameters": 2e6,
            "train_seconds": 1.0, "load_mean": 1.0, "eval_split": "validation split", "git": "x", "images_per_s": 9.0}
    ours = [bench.row("configs/timm/regnetx_002.yaml", "none", 0, dict(base, val_acc=0.6))]
    ref = {"config": bench.TABLE_REFERENCE["none"], "seed": 1, "epochs": 4, "val_acc": 0.87, "images_per_s": 150.0,
           "parameters": 1972792, "precision": "fp32", "kernels": "avx2", "overrides": []}
    cbam = dict(ref, config=bench.TABLE_REFERENCE["cbam"], val_acc=0.875,
                overrides=["model.attn_kwargs.init=identity", "model.attn_position=unit_bn"])  # its file's own values
    other = [dict(ref, seed=2, kernels="amx"), dict(ref, seed=3, epochs=8), dict(ref, seed=4, precision="bf16"),
             dict(ref, seed=5, overrides=["model.attention=se"]), dict(ref, seed=6, config="configs/attention/resnet_fast_gc.yaml"),
             dict(cbam, seed=7, overrides=["model.attn_position=unit_act"])]
    table_file = tmp_path / "attention_table.json"
    table_file.write_text(json.dumps([ref, cbam, *other]))
    rows = bench.reference_rows(ours, table_file)
    assert [(r["seed"], r["attention"]) for r in rows] == [(1, "none"), (1, "cbam")] and rows[0]["model"] == "resnet_fast"
    line = bench.table(ours, rows).splitlines()[3]
    assert line.startswith("| resnet_fast (`resnet_fast_{none,se,cbam,coord,eca}.yaml`, runs of attention_table.json) |")
    assert "| 87.00 | +0.50 |" in line
    own = bench.row(bench.REFERENCE, "none", 0, dict(base, val_acc=0.86))
    assert bench.reference_rows([*ours, own], table_file) == [own]  # the sweep's own runs come first
    table_file.write_text(json.dumps([cbam, *other]))  # CBAM alone: nothing to pair it with
    assert bench.reference_rows(ours, table_file) == []
    from visattn.errors import DataError

    for bad, says in ((dict(ref, val_acc="0.87"), "'val_acc'"), (dict(ref, seed=True), "'seed'"), ({"config": ref["config"]}, "'seed'")):
        table_file.write_text(json.dumps([ref, bad]))
        with pytest.raises(DataError, match=f"attention_table.json: row 2 .*{says}"):
            bench.reference_rows(ours, table_file)  # a damaged row of the reference: one line naming it
    table_file.write_text(json.dumps([ref, {"config": "configs/attention/resnet_fast_gc.yaml", "seed": "x"}]))
    assert len(bench.reference_rows(ours, table_file)) == 1  # another config's rows are not the reference's to check


@pytest.mark.parametrize("argv", first_fast([["--epochs", "0"], ["--seeds"], ["--threads", "0"], ["--recipes", "no.yaml"],
                                             ["--arms", "gc"], ["--precision", "fp8"], ["--seeds", "nan"]]))
def test_the_bench_refuses_bad_flags_in_one_line(argv):
    proc = subprocess.run([sys.executable, "-m", "bench.foreign_models", *argv, "--report"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_blocks_in_the_se_place_of_a_model_without_se_are_refused_before_any_run(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "bench.foreign_models", "--in-se-place", "--recipes",
                           "configs/timm/regnetx_002.yaml", "--results", str(out), "--runs", str(tmp_path / "runs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "--in-se-place: configs/timm/regnetx_002.yaml:" in proc.stderr and "squeeze-and-excitation" in proc.stderr
    assert not out.exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("content,says", first_fast([("[]", "no runs to report"), ("[{}]", "row 1 has no 'model'"),
                                                     ("{", "not a readable JSON file"),
                                                     ('[{"model": true}]', "'model', which must be a string")]))
def test_the_report_refuses_a_damaged_or_empty_results_file_in_one_line(tmp_path, content, says):
    out = tmp_path / "r.json"
    out.write_text(content)
    doc = (ROOT / "docs" / "results.md").read_bytes()
    proc = subprocess.run([sys.executable, "-m", "bench.foreign_models", "--report", "--write", "--results",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert says in proc.stderr and (ROOT / "docs" / "results.md").read_bytes() == doc and out.read_text() == content


@pytest.mark.parametrize("argv", first_fast([["--steps", "0"], ["--every", "-1"], ["--arms", "cbam"], ["--threads", "0"],
                                             ["--precision", "fp8"], ["--steps", "inf"]]))
def test_the_gate_probe_refuses_bad_flags_in_one_line(argv, tmp_path):
    out = tmp_path / "g.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gate_dynamics", *argv, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("content,says", first_fast([("{", "not a readable JSON file"), ("[]", "not a dict"),
                                                     ('{"arms": 3}', "no 'arms' list"), ('{"arms": [{}]}', "arm 1 has no trace")]))
def test_the_gate_summary_refuses_a_damaged_file_and_leaves_the_docs(tmp_path, content, says):
    out = tmp_path / "g.json"
    out.write_text(content)
    doc = (ROOT / "docs" / "blocks.md").read_bytes()
    proc = subprocess.run([sys.executable, "-m", "bench.gate_dynamics", "--summary", "--write", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert says in proc.stderr and (ROOT / "docs" / "blocks.md").read_bytes() == doc


def test_the_gate_probe_pins_each_arms_block_lr_whatever_the_recipe_says(tmp_path):
    """The recipe trains its blocks at optim.attn_lr_scale=0.1; the probe's first arms were measured at 1x and
    must rerun at 1x, and se-slot-lr0.1 is the recipe's rate."""
    from bench import gate_dynamics as g
    from visattn.config import load_config

    def scale(arm):
        return load_config(ROOT / g.RECIPE, g._overrides(arm, 5, tmp_path / arm, None, None)).optim.attn_lr_scale

    assert load_config(ROOT / g.RECIPE).optim.attn_lr_scale == 0.1
    assert [scale(a) for a in ("earlier-skip", "se-slot", "se-slot-lr0.1", "none")] == [1.0, 1.0, 0.1, 0.1]


def test_bn_momentum_sets_the_models_batchnorms_and_leaves_the_inserted_blocks_own():
    """torchvision's MobileNetV3 builds its BatchNorms at momentum 0.01: over the recipe's 4 epochs the running
    statistics lag and the model scored 10.5% in eval mode (70.4% with them re-estimated). model.bn_momentum
    sets the package model's; the blocks inserted after keep theirs; the trainer notes a lag that large."""
    from visattn.config import load_config
    from visattn.models import from_config
    from visattn.registry import backbone_modules
    from visattn.run_checks import bn_lag_note

    def momenta(model, modules):
        return {m.momentum for m in modules if isinstance(m, torch.nn.BatchNorm2d)}

    recipe = ROOT / "configs" / "timm" / "tv_mobilenet_v3_small.yaml"
    plain = from_config(load_config(recipe, ["model.bn_momentum=null"]), weights=False)
    assert momenta(plain, plain.modules()) == {0.01}  # torchvision's own
    assert "momentum is 0.01" in bn_lag_note(plain, 352) and "17%" in bn_lag_note(plain, 352)
    assert bn_lag_note(plain, 100 * 352) is None  # a long run's statistics keep up
    own = from_config(load_config(recipe), weights=False)
    assert momenta(own, own.modules()) == {0.1} and bn_lag_note(own, 352) is None
    m = from_config(load_config(recipe, ["model.bn_momentum=0.3", "model.attention=cbam"]), weights=False)
    blocks = [b for b in m.modules() if visattn.registry.is_attention_block(b)]
    assert blocks and momenta(m, backbone_modules(m)) == {0.3}
    assert momenta(m, [x for b in blocks for x in b.modules()]) == {0.1}


@pytest.mark.parametrize("name", ["timm/tinynet_e", "timm/mobilenetv3_small_100", "torchvision/mobilenet_v3_small",
                                  "torchvision/resnet18"])
def test_head_init_zero_starts_every_logit_at_zero_and_the_loss_at_chance(name):
    """timm's EfficientNet and MobileNetV3 draw their classifier from U(+-1/sqrt(num_classes)), made for 1000
    classes: at 10 the first loss of TinyNet-E is far above chance. model.head_init=zero zeroes the classifier's
    weight and bias (timm's get_classifier(), torchvision's last 10-way linear), and nothing else."""
    from visattn.models import from_config

    x = torch.randn(8, 3, 32, 32)
    y = torch.arange(8) % 10
    torch.manual_seed(0)
    own = from_config(load_config(SMOKE, [f"model.name={name}", "model.cifar_stem=true"]), weights=False).train()
    torch.manual_seed(0)
    zero = from_config(load_config(SMOKE, [f"model.name={name}", "model.cifar_stem=true", "model.head_init=zero"]),
                       weights=False).train()
    changed = [k for k, v in zero.state_dict().items() if not torch.equal(v, own.state_dict()[k])]
    assert changed and all(torch.count_nonzero(zero.state_dict()[k]) == 0 for k in changed)
    assert all(k.rsplit(".", 1)[0] in visattn.models.foreign._classifier_names(zero, 10) for k in changed)
    out = zero(x)
    assert torch.count_nonzero(out) == 0
    assert torch.nn.functional.cross_entropy(out, y).item() == pytest.approx(math.log(10), abs=1e-6)
    if name == "timm/tinynet_e":  # what the option is for: the package's own head starts far above chance
        assert torch.nn.functional.cross_entropy(own(x), y).item() > math.log(10) + 0.5


def test_head_init_zero_keeps_a_weights_files_classifier_and_zeroes_a_replaced_one(tmp_path):
    """The classifier is zeroed before model.pretrained_file loads: a file's classifier of this class count is the
    one the run starts from; one of another count is replaced and starts at zero."""
    from visattn.models import from_config

    torch.manual_seed(1)
    ten, thousand = _small_resnet(), _small_resnet(num_classes=1000)
    torch.save(ten.state_dict(), tmp_path / "ten.pth")
    torch.save(thousand.state_dict(), tmp_path / "in1k.pth")
    opts = [*RESNET, "model.head_init=zero"]
    kept = from_config(load_config(SMOKE, [*opts, f"model.pretrained_file={tmp_path / 'ten.pth'}"]))
    assert torch.equal(kept.fc.weight, ten.fc.weight) and torch.count_nonzero(kept.fc.weight) > 0
    fresh = from_config(load_config(SMOKE, [*opts, f"model.pretrained_file={tmp_path / 'in1k.pth'}"]))
    assert torch.count_nonzero(fresh.fc.weight) == 0 and torch.count_nonzero(fresh.fc.bias) == 0
    assert torch.equal(fresh.layer1[0].conv1.weight, thousand.layer1[0].conv1.weight)


def test_a_run_whose_classifier_starts_wide_says_so_once_and_head_init_zero_quiets_it(tmp_path):
    """TinyNet-E's own classifier init is 11x wider than PyTorch's default for its 1280 inputs: the run says so in
    one note line at the start; at model.head_init=zero, and for a timm ResNet (1x), it says nothing."""
    def notes(*extra):
        lines: List[str] = []
        run(load_config(SMOKE, [*TINY, "train.max_steps=1", "log.maps_every=0", f"run_dir={tmp_path / str(len(extra))}",
                                *extra]), log=lambda *a, **k: lines.append(" ".join(map(str, a))))
        return [ln for ln in lines if "starts" in ln and ln.startswith("note: the classifier")]

    tiny = ["model.name=timm/tinynet_e", "model.cifar_stem=true", "model.attention=none"]
    said = notes(*tiny)
    assert len(said) == 1 and "(classifier) starts 11x wider" in said[0] and "1280 inputs" in said[0]
    assert "model.head_init=zero" in said[0] and "2.30" in said[0]
    assert notes(*tiny, "model.head_init=zero") == []
    assert notes(*RESNET, "model.attention=none", "model.kwargs.drop_rate=0") == []


@pytest.mark.parametrize("value", ["ones", "true", "0", "[zero]", "Zero"])
def test_a_bad_head_init_is_one_line_before_anything_is_written(tmp_path, value):
    line = _refused(tmp_path, *RESNET, f"model.head_init={value}")
    assert "option 'head_init' of model timm/resnet18 must be one of zero" in line


def test_head_init_is_a_package_models_option_only(tmp_path):
    assert "head_init" in _refused(tmp_path, "model.head_init=zero")  # resnet_fast (smoke.yaml) has no such option
    assert load_config(SMOKE, [*RESNET, "model.head_init=null"]).model.options().get("head_init") is None


@pytest.mark.parametrize("value", ["0", "2", "true", ".nan", "fast"])
def test_bad_bn_momentum_is_one_line(value):
    from visattn.config import load_config
    from visattn.errors import ConfigError

    with pytest.raises(ConfigError, match="bn_momentum") as e:
        load_config(ROOT / "configs" / "timm" / "tv_mobilenet_v3_small.yaml", [f"model.bn_momentum={value}"])
    assert "\n" not in str(e.value)

"""Issue 79: the foreign-model path (``model.name=timm/<name>``, ``torchvision/<name>``) off the happy path, and
the four kinds its defects were of: a check the file itself could switch off, builder options of another type or
out of range, values valid alone but not with the rest, and a resume that reread what the checkpoint holds.
Each refusal is one ``error:`` line, exit 2, with nothing written (a new run's folder is not created, an existing
run's files hash the same); each accepted input is checked to do what it says. Tiny synthetic runs on the CPU."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import numpy as np
import pytest
import timm
import torch
from conftest import ROOT, SMOKE, metrics_rows, run_cli
from test_data import _write_cifar_batches, _write_folder
from test_faults import _snapshot

import visattn
from visattn.config import load_config
from visattn.data import ImageSet, Placement, build_loader, check_augment, load_splits
from visattn.data.cache import cached_read
from visattn.errors import CheckpointError, ConfigError, DataError
from visattn.evaluate import main as evaluate_main
from visattn.models.foreign import apply_cifar_stem, read_weights_entry
from visattn.run_checks import check_for_training
from visattn.rundir import DIGEST_KEY, load_checkpoint
from visattn.trainer import run

S = ["train.epochs=1", "data.synthetic_size=200", "data.val_size=50", "log.progress=false", "device=cpu",
     "train.batch_size=40", "eval.batch_size=100", "log.tensorboard=false", "log.maps_every=0", "precision=fp32"]
CHANNELS = (8, 16, 32, 64)
T = ["model.name=timm/resnet18", "model.cifar_stem=true", "model.kwargs.channels=[8,16,32,64]", "model.attention=none"]


def _quiet(*a, **k) -> None:
    pass


def _cfg(run_dir: Path, *extra: str):
    return load_config(SMOKE, [*S, *T, f"run_dir={run_dir}", *extra])


def _said(lines: List[str]):
    return lambda *a, **k: lines.append(" ".join(map(str, a)))


def _refused(tmp_path: Path, *argv: str, name: str = "run") -> str:
    """``train.py`` (in-process) on a new run folder: exit 2, one line, no traceback, the folder not created."""
    rd = tmp_path / name
    proc = run_cli(["--config", str(SMOKE), *S, f"run_dir={rd}", *argv])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not rd.exists()
    return lines[0]


def _refused_in(rd: Path, *argv: str) -> str:
    """``train.py`` on an existing run folder: exit 2, one line, every file of the folder as it was."""
    before = _snapshot(rd)
    proc = run_cli(["--config", str(SMOKE), *S, *T, f"run_dir={rd}", *argv])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert _snapshot(rd) == before
    return lines[0]


def _net(num_classes: int = 10) -> torch.nn.Module:
    """The model T builds, as timm builds it (what a weights file of it holds)."""
    model = timm.create_model("resnet18", num_classes=num_classes, channels=CHANNELS)
    apply_cifar_stem(model, "resnet18")
    return model


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-epoch timm/resnet18 run, with a copy of its epoch-1 ``last.pt`` as ``epoch1.pt``; no test may
    change it (copy it first)."""
    rd = tmp_path_factory.mktemp("finished") / "run"
    run(_cfg(rd), log=_quiet)
    shutil.copy(rd / "last.pt", rd / "epoch1.pt")
    run(_cfg(rd, "train.epochs=2", "resume=auto"), log=_quiet)
    return rd


def _copy(finished: Path, tmp_path: Path) -> Path:
    rd = tmp_path / "run"
    shutil.copytree(finished, rd)
    return rd


# ---- 1. a damaged .safetensors weights file ------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["text", "truncated", "empty", "pth_renamed", "huge_header"])
def test_a_damaged_safetensors_file_is_one_line_naming_it(tmp_path, damage):
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    state = _net().state_dict()
    if damage == "text":
        path.write_text("not weights at all")
    elif damage == "truncated":
        save_file(state, str(path))
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "pth_renamed":
        torch.save(state, path)
    else:  # a header length of 2**62 bytes
        path.write_bytes((2**62).to_bytes(8, "little") + b"{}")
    line = _refused(tmp_path, *T, f"model.pretrained_file={path}")
    assert str(path) in line and ("damaged or not a weights file" in line or "not a safetensors file" in line), line


# ---- 2. a model whose training forward returns a tuple -------------------------------------------------------


def test_torchvision_googlenet_trains_on_its_main_logits(tmp_path):
    rd = tmp_path / "run"
    cfg = load_config(SMOKE, [*S, "model.name=torchvision/googlenet", "model.attention=none",
                              "model.kwargs.init_weights=false", f"run_dir={rd}", "train.max_steps=2"])
    model = visattn.create_model("torchvision/googlenet", num_classes=10, kwargs={"init_weights": False}).train()
    out = model(torch.randn(2, 3, 32, 32))
    assert not isinstance(out, torch.Tensor) and out.logits.shape == (2, 10)  # (logits, aux_logits2, aux_logits1)
    summary = run(cfg, log=_quiet)
    assert summary["epochs"] == 0 and load_checkpoint(rd / "last.pt")["step"] == 2  # stopped by max_steps, saved
    from visattn.evaluate import main_logits

    assert main_logits(out) is out.logits and main_logits((out.logits, None)) is out.logits
    with pytest.raises(ConfigError, match="not logits"):
        main_logits({"logits": 1})


# ---- 3, 4 and the builder-options kind: every key of model.kwargs ----------------------------------------------


@pytest.mark.parametrize("argv,says", [
    ([*T, "model.kwargs.drop_rate=true"], "model.kwargs.drop_rate must be a number, not true"),
    ([*T, "model.kwargs.drop_path_rate=true"], "model.kwargs.drop_path_rate must be a number, not true"),
    ([*T, "model.kwargs.channels=[8,true,32,64]"], "model.kwargs.channels[1] must be an integer, not true"),
    ([*T, "model.kwargs.zero_init_last='no'"], "model.kwargs.zero_init_last must be true or false, not 'no'"),
    # beyond the named ones: a string or number where a bool or a string belongs, a float where an integer does
    ([*T, "model.kwargs.global_pool=true"], "model.kwargs.global_pool must be a string, not true"),
    ([*T, "model.kwargs.stem_width=8.5"], "model.kwargs.stem_width must be an integer, not 8.5"),
    ([*T, "model.kwargs.avg_down=1"], "model.kwargs.avg_down must be true or false, not 1"),
    (["model.name=torchvision/resnet18", "model.attention=none", "model.kwargs.zero_init_residual='yes'"],
     "model.kwargs.zero_init_residual must be true or false"),
    (["model.name=torchvision/mobilenet_v3_small", "model.attention=none", "model.kwargs.dropout=true"],
     "model.kwargs.dropout must be a number, not true"),
    (["model.name=torchvision/efficientnet_b0", "model.attention=none", "model.kwargs.stochastic_depth_prob='0.2'"],
     "model.kwargs.stochastic_depth_prob must be a number, not '0.2'"),
])
def test_a_bool_or_string_of_another_type_in_model_kwargs_is_refused(tmp_path, argv, says):
    assert says in _refused(tmp_path, *argv)


@pytest.mark.parametrize("argv,key", [
    ([*T, "model.kwargs.drop_block_rate=5"], "kwargs.drop_block_rate"),
    (["model.name=torchvision/googlenet", "model.attention=none", "model.kwargs.dropout_aux=1.0"], "kwargs.dropout_aux"),
    (["model.name=torchvision/efficientnet_b0", "model.attention=none", "model.kwargs.stochastic_depth_prob=1.5"],
     "kwargs.stochastic_depth_prob"),
    (["model.name=torchvision/mobilenet_v3_small", "model.attention=none", "model.kwargs.dropout=1.0"], "kwargs.dropout"),
    (["model.name=torchvision/squeezenet1_0", "model.attention=none", "model.kwargs.dropout=-0.1"], "kwargs.dropout"),
    (["model.name=timm/vit_tiny_patch16_224", "model.attention=none",
      "model.kwargs={img_size: 32, patch_size: 8, patch_drop_rate: 1.0}"], "kwargs.patch_drop_rate"),
    (["model.name=timm/vit_tiny_patch16_224", "model.attention=none",
      "model.kwargs={img_size: 32, patch_size: 8, pos_drop_rate: 3}"], "kwargs.pos_drop_rate"),
])
def test_every_rate_like_builder_option_is_range_checked(tmp_path, argv, key):
    line = _refused(tmp_path, *argv)
    assert f"{key} must be in [0, 1)" in line, line


def test_the_same_options_of_the_right_type_are_taken():
    cfg = load_config(SMOKE, [*T, "model.kwargs.drop_rate=0.2", "model.kwargs.zero_init_last=false",
                              "model.kwargs.global_pool=avg", "model.kwargs.drop_block_rate=0.1"])
    model = visattn.create_model(cfg.model.name, num_classes=10, **cfg.model.options())
    assert model.drop_rate == 0.2 and [m.out_channels for m in (model.layer1[0].conv2, model.layer4[0].conv2)] == [8, 64]
    growth = load_config(SMOKE, ["model.name=torchvision/densenet121", "model.attention=none", "model.kwargs.growth_rate=4"])
    assert growth.model.options()["kwargs"]["growth_rate"] == 4  # a "_rate" that is no probability: an integer


# ---- 5 and the resume-rereads kind ---------------------------------------------------------------------------


def test_a_resume_of_a_pretrained_file_run_never_reads_the_file_again(tmp_path):
    weights = tmp_path / "w.pth"
    torch.save(_net().state_dict(), weights)
    rd = tmp_path / "run"
    run(_cfg(rd, f"model.pretrained_file={weights}"), log=_quiet)
    weights.unlink()  # deleted
    run(_cfg(rd, f"model.pretrained_file={weights}", "resume=auto", "train.epochs=2"), log=_quiet)
    assert [r["epoch"] for r in metrics_rows(rd)] == [1, 2]
    weights.write_text("replaced by something else")
    # a changed model option is named, not hidden behind the weights file's error
    line = _refused_in(rd, f"model.pretrained_file={weights}", "resume=auto", "train.epochs=3", "model.kwargs.drop_rate=0.1")
    assert "different settings for model.kwargs.drop_rate" in line, line
    run(_cfg(rd, f"model.pretrained_file={weights}", "resume=auto", "train.epochs=3"), log=_quiet)
    assert [r["epoch"] for r in metrics_rows(rd)] == [1, 2, 3]


def test_a_resume_of_an_init_from_run_never_reads_that_checkpoint_again(tmp_path, finished):
    src = tmp_path / "from.pt"
    shutil.copy(finished / "best.pt", src)
    rd = tmp_path / "ft"
    run(_cfg(rd, f"model.init_from={src}"), log=_quiet)
    src.unlink()
    run(_cfg(rd, f"model.init_from={src}", "resume=auto", "train.epochs=2"), log=_quiet)
    assert [r["epoch"] for r in metrics_rows(rd)] == [1, 2]


# ---- 6. model.init_from into a model with model.attn_at --------------------------------------------------------


def test_init_from_into_attn_at_maps_the_followed_modules_names_and_scores_the_checkpoints_accuracy(tmp_path):
    base = tmp_path / "base"
    run(_cfg(base, "eval.tta=none"), log=_quiet)
    acc = metrics_rows(base)[-1]["val_acc"]
    lines: List[str] = []
    at = "model.attn_at=[layer1.0.bn2, layer3.1.bn2]"
    summary = run(_cfg(tmp_path / "ft", "eval.tta=none", "model.attention=se", at, f"model.init_from={base / 'best.pt'}",
                       "train.max_steps=1"), log=_said(lines))
    origin = summary["init_from"]
    assert origin["val_acc"] == acc and origin["wrapped"] == ["layer1.0.bn2", "layer3.1.bn2"]
    assert origin["new_blocks"] == ["layer1.0.bn2.attn", "layer3.1.bn2.attn"]
    assert any("layer1.0.bn2, layer3.1.bn2, which a block now follows, load as their .inner ones" in ln for ln in lines)


# ---- 7, 13, 14, 15: what a weights file holds --------------------------------------------------------------------


def test_a_state_dict_without_num_batches_tracked_loads_as_torch_loads_it(tmp_path):
    net = _net()
    with torch.no_grad():
        net.bn1.running_mean.uniform_(-1, 1)
    state = {k: v for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}
    _net().load_state_dict(state)  # torch's own strict load takes it
    torch.save(state, tmp_path / "old.pth")
    model = visattn.create_model("timm/resnet18", num_classes=10, cifar_stem=True, kwargs={"channels": list(CHANNELS)},
                                 pretrained_file=str(tmp_path / "old.pth"))
    assert torch.equal(model.bn1.running_mean, net.bn1.running_mean)
    assert model.pretrained_origin["tensors"] == len(state)


def test_a_timm_checkpoint_with_ema_and_plain_weights_says_which_it_loaded(tmp_path):
    plain, ema = _net().state_dict(), _net().state_dict()
    path = tmp_path / "ckpt.pth.tar"
    torch.save({"epoch": 3, "state_dict": plain, "state_dict_ema": ema}, path)
    state, entry, others = read_weights_entry(path)
    assert entry == "state_dict_ema" and others == ["state_dict"] and torch.equal(state["fc.weight"], ema["fc.weight"])
    lines: List[str] = []
    summary = run(_cfg(tmp_path / "run", f"model.pretrained_file={path}", "train.max_steps=1"), log=_said(lines))
    said = [ln for ln in lines if ln.startswith("model.pretrained_file:")]
    assert len(said) == 1 and "(its state_dict_ema entry, the EMA weights; it also holds state_dict, not used)" in said[0]
    assert summary["init_from"]["entry"] == "state_dict_ema" and summary["init_from"]["other_entries"] == ["state_dict"]
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["init_from"]["entry"] == "state_dict_ema"


def test_a_classifier_of_another_width_or_half_another_class_count_is_refused_and_a_replaced_one_says_why(tmp_path):
    other_width = _net().state_dict()
    other_width["fc.weight"] = torch.zeros(10, 32)  # the same 10 classes, another input width
    torch.save(other_width, tmp_path / "width.pth")
    line = _refused(tmp_path, *T, f"model.pretrained_file={tmp_path / 'width.pth'}")
    assert "fc.weight [10, 32] here [10, 64]" in line and "input width differs" in line and "replaced" not in line
    half = _net(1000).state_dict()
    half["fc.bias"] = torch.zeros(10)  # weight of 1000 classes, bias of 10
    torch.save(half, tmp_path / "half.pth")
    line = _refused(tmp_path, *T, f"model.pretrained_file={tmp_path / 'half.pth'}")
    assert "only partly of another class count" in line and "fc.bias [10] fits" in line and "nothing was replaced" in line
    torch.save(_net(1000).state_dict(), tmp_path / "in1k.pth")
    model = visattn.create_model("timm/resnet18", num_classes=10, cifar_stem=True, kwargs={"channels": list(CHANNELS)},
                                 pretrained_file=str(tmp_path / "in1k.pth"))
    origin = model.pretrained_origin
    assert origin["replaced"] == ["fc.bias", "fc.weight"] and origin["file_classes"] == 1000


def test_an_integer_tensor_for_a_float_weight_is_refused_naming_the_key(tmp_path):
    state = _net().state_dict()
    state["conv1.weight"] = state["conv1.weight"].round().long()
    torch.save(state, tmp_path / "int.pth")
    line = _refused(tmp_path, *T, f"model.pretrained_file={tmp_path / 'int.pth'}")
    assert "integer (or bool) tensors" in line and "conv1.weight (int64)" in line, line


# ---- 10, 16 and the file-switch-off kind ---------------------------------------------------------------------


def test_a_cut_metrics_file_does_not_switch_off_the_rewind_check(tmp_path, finished):
    rd = _copy(finished, tmp_path)
    metrics = rd / "metrics.jsonl"
    metrics.write_text(metrics.read_text().splitlines(keepends=True)[0])  # only epoch 1's row is left
    steps = [load_checkpoint(rd / n)["step"] for n in ("epoch1.pt", "last.pt")]
    line = _refused_in(rd, f"resume={rd / 'epoch1.pt'}", "train.epochs=2")
    assert f"is from epoch 1 (step {steps[0]})" in line and f"holds epoch 2 (step {steps[1]})" in line, line
    assert "run_dir=NEW" in line


def test_a_resume_asking_for_fewer_epochs_than_done_is_refused_with_config_yaml_untouched(tmp_path, finished):
    rd = _copy(finished, tmp_path)
    line = _refused_in(rd, "resume=auto", "train.epochs=1")
    assert "has trained 2 epochs, more than train.epochs=1" in line and "train.epochs=2 or more" in line, line
    assert "epochs: 2" in (rd / "config.yaml").read_text()
    steps = load_checkpoint(rd / "epoch1.pt")["step"]  # and train.max_steps no larger than the steps taken
    shutil.copy(rd / "epoch1.pt", tmp_path / "e1.pt")
    branch = tmp_path / "branch"
    run(_cfg(branch, "resume=" + str(tmp_path / "e1.pt"), "train.epochs=2", f"train.max_steps={steps + 1}"), log=_quiet)
    line = _refused_in(branch, "resume=auto", "train.epochs=2", f"train.max_steps={steps + 1}")
    assert f"has taken {steps + 1} steps, train.max_steps={steps + 1}: nothing would train" in line, line


def test_a_foreign_checkpoint_without_its_digest_and_markers_is_refused_everywhere(tmp_path, finished):
    state = torch.load(finished / "best.pt", weights_only=True)
    state["model"]["fc.weight"].zero_()  # edited weights
    for key in (DIGEST_KEY, "format_version", "teacher_digest"):
        state.pop(key)
    state["config"]["model"].pop("init_from", None)
    state["config"]["data"].pop("placed", None)
    path = tmp_path / "edited.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="its digest entry was removed .*model.name is 'timm/resnet18'"):
        load_checkpoint(path)
    ev = run_cli(["--checkpoint", str(path), "--data", "synthetic", "--device", "cpu"], tool=evaluate_main)
    assert ev.returncode == 2 and len(ev.stderr.strip().splitlines()) == 1 and "digest entry was removed" in ev.stderr
    assert "digest entry was removed" in _refused(tmp_path, *T, f"model.init_from={path}", name="new")
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(path, resumed / "last.pt")
    assert "digest entry was removed" in _refused_in(resumed, "resume=auto", "train.epochs=2")
    # a foreign-only option shows a digest-era writer too, whatever the name says
    state["config"]["model"] = {"name": "resnet_fast", "cifar_stem": True}
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="holds model.cifar_stem"):
        load_checkpoint(path)


def test_a_decode_cache_of_another_image_size_is_rebuilt_not_trusted(tmp_path):
    root = _write_folder(tmp_path / "data", size=16)
    warned: List[str] = []
    calls = []

    def read(side: int):
        calls.append(side)
        x = np.zeros((3, side, side, 3), np.uint8)
        return {"train": ImageSet(x, np.arange(3), ("a", "b", "c"))}, 0

    cached_read(root, ("folder", 16), tmp_path / "cache", lambda: read(24), warn=warned.append)  # a cache of 24 px
    parts, _ = cached_read(root, ("folder", 16), tmp_path / "cache", lambda: read(16), warn=warned.append, size=16)
    assert parts["train"].x.shape[1:3] == (16, 16) and calls == [24, 16]
    assert len(warned) == 1 and "not the 16x16 this key decodes to" in warned[0] and "rebuilding it" in warned[0]


# ---- 8, 9 and the values-valid-alone kind ------------------------------------------------------------------------


def test_an_albumentations_cutout_as_large_as_the_image_is_refused_the_tensor_loaders_is_not(tmp_path):
    line = _refused(tmp_path, *T, "data.loader=albumentations", "data.augment.cutout=32")
    assert "data.augment.cutout=32 with data.loader=albumentations blanks the whole of every 32x32 image" in line
    check_for_training(load_config(SMOKE, [*S, "data.augment.cutout=32"]))  # the tensor loader clips its hole
    check_for_training(load_config(SMOKE, [*S, "data.loader=albumentations", "data.augment.cutout=31"]))


def test_placed_canvases_under_albumentations_train_on_whole_canvases_as_under_the_tensor_loader():
    cfg = load_config(SMOKE, [*S, "data.source=placed", "data.placed.source=synthetic", "data.loader=albumentations",
                              "data.augment.cutout=24"])
    check_for_training(cfg)
    splits = load_splits(cfg.data, cfg.seed)
    shapes = {}
    for loader in ("albumentations", "tensor"):
        data = cfg.data.model_copy(update={"loader": loader})
        for train, images in ((True, splits.train), (False, splits.eval)):
            xb, _ = next(iter(build_loader(images, data, 8, train, 0, Placement(torch.device("cpu")))))
            shapes[loader, train] = tuple(xb.shape)
    assert set(shapes.values()) == {(8, 3, 80, 80)}, shapes
    placed = cfg.data.model_copy(update={"augment": cfg.data.augment.model_copy(update={
        "cutout": 0, "extra": [{"name": "RandomCrop", "height": 80, "width": 80}]})})
    check_augment(placed)  # an extra transform is checked on a canvas, the image it is given


def test_data_workers_the_tensor_loader_would_silently_ignore_are_refused(tmp_path):
    assert "data.workers=2 does nothing with data.loader=tensor" in _refused(tmp_path, *T, "data.workers=2")
    check_for_training(load_config(SMOKE, [*S, "data.workers=2", "data.loader=albumentations"]))


def test_a_subset_smaller_than_the_class_count_and_an_image_size_the_data_cannot_have_are_refused(tmp_path):
    from PIL import Image

    root = tmp_path / "folder"
    for split in ("train", "test"):
        for c in range(12):
            (root / split / f"c{c:02d}").mkdir(parents=True)
            for i in range(2):
                Image.fromarray(np.full((8, 8, 3), 20 * c + i, np.uint8)).save(root / split / f"c{c:02d}" / f"{i}.png")
    cfg = load_config(SMOKE, [f"data.root={root}", "data.source=folder", "data.subset=10", "data.image_size=8",
                              f"data.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(DataError, match="data.subset=10 is smaller than the 12 classes"):
        load_splits(cfg.data, 0)
    _write_cifar_batches(tmp_path / "cifar" / "cifar-10-batches-py")
    cfg = load_config(SMOKE, [f"data.root={tmp_path / 'cifar'}", "data.source=cifar_python", "data.image_size=48",
                              f"data.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(DataError, match="data.image_size=48, but .* holds 32x32 images"):
        load_splits(cfg.data, 0)


# ---- 11. bench/blocks.py --table -------------------------------------------------------------------------------


def _blocks():
    from bench import blocks

    return blocks


@pytest.mark.parametrize("content,says", [(None, "not a readable JSON file"), ("{", "not a readable JSON file"),
                                          ("[]", "holds a JSON list, not a dict"), ('{"rows": []}', "it has no 'cpu'")])
def test_the_blocks_table_of_a_missing_damaged_or_foreign_file_is_one_line(tmp_path, content, says):
    path = tmp_path / "speed.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=says):
        _blocks().read_table(path)


def test_the_blocks_table_refuses_a_bool_for_a_ratio_and_exits_2_in_one_line(tmp_path):
    blocks = _blocks()
    data = json.loads(blocks.SPEED.read_text())
    assert blocks.read_table(blocks.SPEED) == blocks.tables(data)
    data["ratios"]["se"]["eager"]["after"] = True
    path = tmp_path / "speed.json"
    path.write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, "-m", "bench.blocks", "--table", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "ratios.se.eager.after is true, not a finite number" in proc.stderr and not proc.stdout

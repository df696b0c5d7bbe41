"""Issue 92: off the happy path by construction. Each kind of hostile input is closed by one mechanism, and each
numbered case of the issue has a test here: (a) a file visattn wrote is trusted only through a digest it cannot
lose; (b) builder options typed from both the builder function's and the built class's signatures, with ranges;
(c) cross-field checks in one place; (d) the rest. A refusal is one line naming the problem."""
from __future__ import annotations

import copy
import json
import shutil
import zipfile
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch
from conftest import FINISHED, SMOKE, folder_digest, run_cli
from PIL import Image
from test_data import _cfg as _data_cfg
from test_data import _write_folder

import visattn
from visattn.config import load_config
from visattn.data import ImageSet, load_splits
from visattn.data.cache import cached_read
from visattn.errors import CheckpointError, ConfigError, DataError
from visattn.evaluate import main as evaluate_main
from visattn.run_checks import check_for_training
from visattn.rundir import DIGEST_KEY, load_checkpoint


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


# ---- (b) builder options: typed from the builder function's and the class's signatures, with ranges ---------------


S = ["--config", str(SMOKE), "train.epochs=1", "data.synthetic_size=200", "data.val_size=50", "log.progress=false",
     "device=cpu", "train.batch_size=40", "log.tensorboard=false", "log.maps_every=0", "precision=fp32"]
TVM = ["model.name=torchvision/mobilenet_v3_small", "model.attention=none"]
TMB = ["model.name=timm/mobilenetv3_small_050", "model.cifar_stem=true", "model.attention=none"]
T = ["model.name=timm/resnet18", "model.cifar_stem=true", "model.attention=none"]


def refused(tmp_path: Path, *argv: str) -> str:
    """``train.py`` in-process on a new run folder: exit 2, one ``error:`` line and no traceback, the folder not
    created; returns the line."""
    rd = tmp_path / "run"
    proc = run_cli([*S, f"run_dir={rd}", *argv])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not rd.exists()
    return errors[0]


@pytest.mark.parametrize("option, said", [
    ("model.kwargs.width_mult=-1", "option kwargs.width_mult must be above 0, got -1"),
    ("model.kwargs.width_mult=true", "model.kwargs.width_mult must be a number, not true (a bool; torchvision's "
                                     "mobilenet_v3_small takes width_mult: float)"),
    ("model.kwargs.width_mult='0.5'", "model.kwargs.width_mult must be a number, not '0.5'"),
    ("model.kwargs.reduced_tail='no'", "model.kwargs.reduced_tail must be true or false, not 'no'"),
])
def test_b5_options_of_torchvisions_builder_function_are_typed_and_ranged(tmp_path, option, said):
    assert said in refused(tmp_path, *TVM, option)


def test_b5_timms_depth_multiplier_is_ranged_and_a_valid_multiplier_still_builds(tmp_path):
    assert "option kwargs.depth_multiplier must be above 0, got -1" in \
        refused(tmp_path, *TMB, "model.kwargs.depth_multiplier=-1")
    from visattn.models.foreign import build_foreign

    def params(**kw):
        return sum(p.numel() for p in build_foreign("torchvision", "mobilenet_v3_small", kwargs=kw).parameters())
    assert params(width_mult=0.5) < params() < params(width_mult=1.5)  # taken, and meaning what it says
    assert params(reduced_tail=True) < params(reduced_tail=False)


def test_b7_bn_momentum_zero_is_refused_for_visattns_models_as_for_package_models(tmp_path):
    assert "bn_momentum must be a number in (0, 1]" in refused(tmp_path, "model.bn_momentum=0")
    assert "bn_momentum' of model 'resnet_fast' must be a number" in refused(tmp_path, "model.bn_momentum=true")
    assert "'bn_momentum'" in refused(tmp_path, *T, "model.bn_momentum=0")
    model = visattn.create_model("resnet_fast", bn_momentum=0.4)  # airbench's: taken
    assert {m.momentum for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)} == {0.4}


def test_b8_head_init_zero_refuses_a_classifier_behind_a_relu(tmp_path):
    line = refused(tmp_path, "model.name=torchvision/squeezenet1_1", "model.attention=none", "model.head_init=zero")
    assert "model.head_init=zero: the classifier of torchvision/squeezenet1_1 (classifier.1) gets no gradient at " \
           "zero (after it: ReLU" in line


def test_b8_head_init_zero_covers_every_head_get_classifier_returns_and_each_learns():
    from visattn.models.foreign import build_foreign

    model = build_foreign("timm", "levit_128s", 10, head_init="zero")
    heads = {n: p for n, p in model.named_parameters() if n.startswith(("head.linear", "head_dist.linear"))}
    assert len(heads) == 4 and all(float(p.detach().abs().sum()) == 0 for p in heads.values())
    model.eval()
    loss = torch.nn.functional.cross_entropy(model(torch.randn(2, 3, 224, 224)), torch.tensor([0, 1]))
    loss.backward()
    assert all(float(p.grad.abs().sum()) > 0 for p in heads.values())


def test_b9_a_channel_list_shorter_than_the_stages_is_one_line_before_any_data(tmp_path):
    line = refused(tmp_path, *T, "model.kwargs.channels=[8,16,32]")
    assert "timm/resnet18 builds with these options, but its forward fails (AttributeError" in line
    load_config(SMOKE, [*S[2:], *T, "model.kwargs.channels=[8,16,32,64]"])  # four stages: fine


@pytest.mark.parametrize("name", ["timm/resnet18.x:y", "timm/resnet18.nosuchtag", "timm/resnet18."])
def test_b10_a_bad_pretrained_tag_is_a_model_name_problem(tmp_path, name):
    line = refused(tmp_path, f"model.name={name}")
    assert f"unknown timm model {name.removeprefix('timm/')!r}: resnet18 has no pretrained tag" in line
    assert "kwargs" not in line


def test_b10_a_known_tag_is_taken():
    from visattn.models.foreign import resolve

    assert resolve("timm", "resnet18.a1_in1k") == "resnet18.a1_in1k"


def test_b11_a_safetensors_file_named_pth_is_read_as_safetensors_and_pickles_get_a_plain_line(tmp_path):
    import pickle

    from safetensors.torch import save_file

    from visattn.models.foreign import read_weights

    state = {"w": torch.arange(6.0).reshape(2, 3)}
    save_file(state, tmp_path / "w.pth")
    assert torch.equal(read_weights(tmp_path / "w.pth")["w"], state["w"])
    (tmp_path / "plain.pth").write_bytes(pickle.dumps({"w": [1, 2]}))
    with pytest.raises(ValueError) as e:
        read_weights(tmp_path / "plain.pth")
    assert "is a pickle that torch.save does not write" in str(e.value) and " is it " not in str(e.value)
    torch.save({"w": Evil()}, tmp_path / "evil.pth")
    with pytest.raises(ValueError, match=r"'.*evil.pth' holds pickled objects other than tensors \(.*print\); it was not"):
        read_weights(tmp_path / "evil.pth")


class Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


# ---- (a) 1: a checkpoint without a digest loads only if provably older than digests ------------------------------


def test_a1_a_checkpoint_from_before_digests_loads_and_is_still_checked_for_finite_weights(tmp_path, pre_digest_best):
    state = load_checkpoint(pre_digest_best)
    assert state["epoch"] == 1 and "format_version" not in state
    state["model"] = {k: v * float("nan") if v.is_floating_point() else v for k, v in state["model"].items()}
    torch.save(state, tmp_path / "nan.pt")
    with pytest.raises(CheckpointError, match="non-finite"):
        load_checkpoint(tmp_path / "nan.pt")


def _stripped(finished_run: Path, tmp_path: Path) -> Path:
    """Issue 92's case 1: today's best.pt without its digest, format_version, teacher_digest, model.init_from and
    data.placed, its fc.weight zeroed."""
    state = torch.load(finished_run / "best.pt", weights_only=True)
    for key in (DIGEST_KEY, "format_version", "teacher_digest"):
        state.pop(key, None)
    state["config"]["model"].pop("init_from", None)
    state["config"]["data"].pop("placed", None)
    state["model"]["fc.weight"].zero_()
    torch.save(state, tmp_path / "stripped.pt")
    return tmp_path / "stripped.pt"


def test_a1_todays_checkpoint_stripped_of_its_digest_and_markers_is_refused_everywhere(tmp_path, finished_run):
    path = _stripped(finished_run, tmp_path)
    with pytest.raises(CheckpointError, match="its digest entry was removed .*which no visattn before digests wrote"):
        load_checkpoint(path)
    ev = run_cli(["--checkpoint", str(path), "--data", "synthetic", "--device", "cpu"], tool=evaluate_main)
    assert ev.returncode == 2 and len(ev.stderr.strip().splitlines()) == 1 and "digest entry was removed" in ev.stderr
    assert "digest entry was removed" in refused(tmp_path, f"model.init_from={path}")
    assert "digest entry was removed" in refused(tmp_path, "train.distill.teacher=" + str(path))
    resumed = tmp_path / "resumed"
    shutil.copytree(finished_run, resumed, ignore=shutil.ignore_patterns(".visattn-run.lock"))
    shutil.copy(path, resumed / "last.pt")
    before = folder_digest(resumed)
    proc = run_cli([*S, f"run_dir={resumed}", "resume=auto", "train.epochs=2"])
    assert proc.returncode == 2 and "digest entry was removed" in proc.stderr and folder_digest(resumed) == before


def test_a1_each_entry_and_config_key_of_today_is_a_digest_era_marker(tmp_path, finished_run, pre_digest_best):
    """Whatever a stripper leaves of today's writer shows it: a top-level entry, or any config key, that no visattn
    before digests wrote; an old file with one such key added is refused too."""
    old = torch.load(pre_digest_best, weights_only=True)
    for where, edit in (("an entry", lambda s: s.update(epoch_loss=1.0)),
                        ("a config key", lambda s: s["config"]["log"].update(maps_dpi=3)),
                        ("a nested config key", lambda s: s["config"]["data"]["augment"].update(mixup=0.2))):
        s = copy.deepcopy(old)
        edit(s)
        torch.save(s, tmp_path / "x.pt")
        with pytest.raises(CheckpointError, match="digest entry was removed"):
            load_checkpoint(tmp_path / "x.pt")


def test_a1_an_old_files_git_entry_naming_a_revision_after_digests_is_a_marker(tmp_path, pre_digest_best):
    import subprocess

    revs = [subprocess.run(["git", "rev-parse", r], cwd=Path(__file__).parent, capture_output=True, text=True).stdout.strip()
            for r in ("HEAD", "0c428f2^")]
    if not all(revs):
        pytest.skip("no git history here")
    old = torch.load(pre_digest_best, weights_only=True)
    for rev, loads in ((revs[0], False), (revs[0] + "-dirty", False), (revs[1], True)):
        torch.save({**old, "git": rev}, tmp_path / "g.pt")
        if loads:
            assert load_checkpoint(tmp_path / "g.pt")["epoch"] == 1
        else:
            with pytest.raises(CheckpointError, match=r"git entry \(revision .*came after digests"):
                load_checkpoint(tmp_path / "g.pt")


# ---- (c) valid alone, not together -------------------------------------------------------------------------------


def test_c12_vit_patches_that_do_not_tile_the_image_are_refused(tmp_path):
    vit = ["model.name=timm/vit_tiny_patch16_224", "model.attention=none", "model.kwargs.img_size=32"]
    line = refused(tmp_path, *vit, "model.kwargs.patch_size=7")
    assert "patches of 7x7 do not tile its 32x32 image (a grid over 28x28 pixels" in line
    load_config(SMOKE, [*S[2:], *vit, "model.kwargs.patch_size=8"])  # 4x4 patches of 8: the whole image


def test_c13_constant_crop_padding_as_wide_as_the_image_is_refused(tmp_path):
    line = refused(tmp_path, "data.image_size=8", "data.augment.crop_padding=16", "data.augment.padding_mode=constant")
    assert "crop_padding=16 with padding_mode=constant lets a random crop fall wholly on the padding" in line
    check_for_training(load_config(SMOKE, [*S[2:], "data.image_size=8", "data.augment.crop_padding=7",
                                           "data.augment.padding_mode=constant"]))


def test_c14_a_split_that_leaves_classes_untrained_is_refused(tmp_path):
    line = refused(tmp_path, "data.val_size=195", "train.batch_size=5")
    assert "data.val_size=195 leaves 5 training images for 10 classes" in line and "never trained" in line
    root = tmp_path / "ds"
    for c, n in (("ant", 20), ("bee", 20), ("cow", 1)):
        (root / "train" / c).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(np.full((8, 8, 3), 9 * i, np.uint8)).save(root / "train" / c / f"{i}.png")
    with pytest.raises(DataError, match=r"data.val_size=30 leaves 11 training images for 3 classes: 1 class\(es\) \(cow\)"):
        load_splits(_data_cfg(tmp_path, root, "data.val_size=30", "data.image_size=8"), seed=0)
    assert len(load_splits(_data_cfg(tmp_path, root, "data.val_size=20", "data.image_size=8"), seed=0).train) == 21


def test_c15_maps_every_longer_than_the_run_is_refused(tmp_path):
    line = refused(tmp_path, "log.tensorboard=true", "log.maps_every=5")
    assert "log.maps_every=5 is more than train.epochs=1: no attention map would be logged" in line
    check_for_training(load_config(SMOKE, [*S[2:], "log.tensorboard=false", "log.maps_every=5"]))  # nothing logged


def test_c16_sync_bn_without_ranks_or_on_the_cpu_is_refused(tmp_path, monkeypatch):
    assert "sync_bn=true needs data-parallel ranks under torchrun" in refused(tmp_path, "sync_bn=true")
    cfg = load_config(SMOKE, [*S[2:], "sync_bn=true"])
    for env in ({"WORLD_SIZE": "1"}, {"WORLD_SIZE": "1", "VISATTN_DATA_PARALLEL": "0"}):  # one rank: one process
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            with pytest.raises(ConfigError, match="needs data-parallel ranks"):
                check_for_training(cfg)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("VISATTN_DATA_PARALLEL", "1")  # the data-parallel path, forced: on the CPU, refused
    with pytest.raises(ConfigError, match="sync_bn=true runs only on CUDA devices"):
        check_for_training(cfg)


# ---- (d) the rest ------------------------------------------------------------------------------------------------


def test_d17_evaluates_weights_do_not_fit_message_names_the_keys(tmp_path, finished_run):
    from visattn.rundir import state_digest

    state = torch.load(finished_run / "best.pt", weights_only=True)
    state.pop(DIGEST_KEY)
    for entry in ("model", "ema"):
        weights = state[entry]
        prefix = "module." if entry == "ema" else ""
        weights[prefix + "extra.weight"] = weights.pop(prefix + "fc.weight")  # a renamed key: one missing, one unexpected
        conv = next(k for k in weights if k.endswith("conv.weight") or k.endswith("0.weight"))
        weights[conv] = torch.zeros(3, 3)
    state[DIGEST_KEY] = state_digest(state)  # a whole file, as written
    torch.save(state, tmp_path / "misfit.pt")
    ev = run_cli(["--checkpoint", str(tmp_path / "misfit.pt"), "--data", "synthetic", "--device", "cpu"],
                 tool=evaluate_main)
    lines = ev.stderr.strip().splitlines()
    assert ev.returncode == 2 and len(lines) == 1, ev.stderr
    assert "weights do not fit model 'resnet_fast' (missing: fc.weight; unexpected: extra.weight; shapes differ: " in lines[0]
    assert "[3, 3] here [" in lines[0]


def _bench(*argv: str):
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    lines = [ln for ln in got.stderr.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
    assert got.returncode == 2 and len(lines) == 1 and "Traceback" not in got.stderr, got.stderr
    return lines[0]


def test_d19_the_bench_scripts_bad_inputs_are_one_line_exit_2(tmp_path):
    (tmp_path / "r.json").write_text('{"a": 1}')
    line = _bench("bench.blocks", "--before", str(tmp_path / "r.json"), "--steps", "1")
    assert "not a revision of this repository, nor a folder of its visattn/attention files" in line
    assert "the folder has no channel.py" in _bench("bench.blocks", "--before", str(tmp_path), "--steps", "1")
    (tmp_path / "arms.json").write_text('{"arms": []}')
    assert "holds no arms" in _bench("bench.gate_dynamics", "--summary", "--out", str(tmp_path / "arms.json"))
    from bench.gate_dynamics import main as gate_main

    arm = {"arm": "a", "blocks": [{"skip": True}], "trace": [{"step": 1, "blocks": [{"skip": True, "grad_norm": 1.0}]}]}
    (tmp_path / "keys.json").write_text(json.dumps({"arms": [arm]}))  # a trace row without its grad_norm
    with pytest.raises(ConfigError, match="arm 1: a trace step 1 entry has no 'grad_norm'"):
        gate_main(["--summary", "--out", str(tmp_path / "keys.json")])


# ---- (a) 3, 4: what the run folder records of its checkpoint is checked against it on resume ----------------------


def _copy_run(finished_run: Path, tmp_path: Path) -> Path:
    rd = tmp_path / "run"
    shutil.copytree(finished_run, rd, ignore=shutil.ignore_patterns(".visattn-run.lock"))
    return rd


def test_a3_a_missing_metrics_row_is_refused_on_resume(tmp_path, finished_run):
    rd = _copy_run(finished_run, tmp_path)
    (rd / "metrics.jsonl").write_text("")  # the one finished epoch's row deleted
    before = folder_digest(rd)
    proc = run_cli(["--config", str(SMOKE), *FINISHED, f"run_dir={rd}", "resume=auto", "train.epochs=2"])
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "metrics.jsonl does not match" in line and "no row for epoch 1" in line, proc.stderr
    assert folder_digest(rd) == before


def test_a4_a_damaged_run_info_is_refused_on_resume_not_read_as_no_origin(tmp_path, finished_run):
    rd = _copy_run(finished_run, tmp_path)
    (rd / "run_info.json").write_text("garbage {")
    before = folder_digest(rd)
    proc = run_cli(["--config", str(SMOKE), *FINISHED, f"run_dir={rd}", "resume=auto", "train.epochs=2"])
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "run_info.json is damaged (not a JSON object)" in line, proc.stderr
    assert folder_digest(rd) == before

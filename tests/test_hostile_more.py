"""Issue 92, the last cases and the mechanisms that close their kinds: visattn's own builder options take only
their documented values (case 6, :mod:`visattn.own_options`); an occupied insertion site is refused (case 18);
a bench script's results file or revision that is not what it reads is one line, exit 2 (case 19,
:func:`bench.common.read_results`, :func:`bench.common.revision`); and every check across config fields is a row
of one table (:data:`visattn.cross_checks.CROSS_CHECKS`) that names the code making it."""
from __future__ import annotations

import importlib
import inspect
import json

import pytest
import timm
import torch
import torchvision
from conftest import SMOKE
from test_bench import _script_main
from test_hostile_kinds import S, refused

from visattn.attention import insert_attention
from visattn.config import load_config
from visattn.cross_checks import CROSS_CHECKS, STAGES, check_for_training
from visattn.errors import ConfigError
from visattn.registry import is_attention_block

MB = ["model.name=timm/mobilenetv3_small_050", "model.cifar_stem=true", "model.attention=cbam"]


def _load(*overrides: str):
    return load_config(SMOKE, [*S[2:], *overrides])


# ---- (b) 6: visattn's own options take only their documented values ----------------------------------------------


@pytest.mark.parametrize("value", ["'no'", "1", "null"])
def test_b6_replace_se_in_attn_kwargs_takes_only_true_or_false(tmp_path, value):
    line = refused(tmp_path, *MB, f"model.attn_kwargs={{replace_se: {value}}}")
    shown = {"'no'": "'no'", "1": "1", "null": "null"}[value]
    assert f"option 'attn_kwargs.replace_se' of model timm/mobilenetv3_small_050 must be true or false, not {shown}" \
        in line


def test_b6_replace_se_true_is_still_taken():
    cfg = _load(*MB, "model.attn_kwargs={replace_se: true}")
    assert cfg.model.options()["attn_kwargs"] == {"replace_se": True}


def _se_count(model: torch.nn.Module) -> int:
    from torchvision.ops.misc import SqueezeExcitation

    return sum(isinstance(m, SqueezeExcitation) for m in model.modules())


@pytest.mark.parametrize("value", ["no", 1, None])
def test_b6_insert_attention_called_directly_refuses_a_replace_se_that_is_no_bool(value):
    model = torchvision.models.mobilenet_v3_small()
    before = _se_count(model)
    with pytest.raises(ValueError, match=r"^insert_attention: replace_se=.* is not true or false$"):
        insert_attention(model, "se", replace_se=value)
    assert _se_count(model) == before > 0 and not any(is_attention_block(m) for m in model.modules())


@pytest.mark.parametrize("override, said", [  # the further options the same table caught
    ("model.attn_kwargs={rule: 1}", "option 'attn_kwargs.rule' of model timm/mobilenetv3_small_050 must be one of "
                                    "auto, structure, family, not 1"),
    ("model.cifar_stem=null", "option 'cifar_stem' of model timm/mobilenetv3_small_050 must be true or false, not null"),
    ("model.attention=null", "option 'attention' of model timm/mobilenetv3_small_050 must be a block name"),
    ("model.head_init=1", "option 'head_init' of model timm/mobilenetv3_small_050 must be one of zero"),
    ("model.bn_momentum=true", "option 'bn_momentum' of model timm/mobilenetv3_small_050 must be a number in (0, 1]"),
    ("model.pretrained_file=''", "option 'pretrained_file' of model timm/mobilenetv3_small_050 must be a path"),
    ("model.attn_at=[]", "option 'attn_at' of model timm/mobilenetv3_small_050 must be a module name or a list"),
])
def test_b6_each_of_visattns_own_package_model_options_goes_through_one_typed_check(override, said):
    with pytest.raises(ConfigError) as e:
        _load(*MB, override)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_b6_a_bool_is_no_number_for_an_option_of_a_wider_type():
    """cct's ``img_size`` (an int or (H, W)) took ``true`` as 1 before."""
    with pytest.raises(ConfigError, match="option 'img_size' of model 'cct_2' must be a number, not true"):
        load_config(SMOKE, ["model.name=cct_2", "model.img_size=true"])
    assert load_config(SMOKE, ["model.name=cct_2", "model.img_size=[32,32]"]).model.options()["img_size"] == [32, 32]


# ---- (d) 18: an occupied insertion site is refused --------------------------------------------------------------


def _blocks(model: torch.nn.Module) -> int:
    return sum(is_attention_block(m) for m in model.modules())


def test_d18_a_path_inside_a_module_visattn_wrapped_is_refused_and_the_model_kept():
    r = torchvision.models.resnet18()
    assert insert_attention(r, "eca", at="layer1.0.bn1") == 1
    for at, said in (("layer1.0.bn1.inner", "the attention block 'layer1.0.bn1.attn' already follows it"),
                     ("layer1.0.bn1.attn.conv", "it lies inside the attention block 'layer1.0.bn1.attn'"),
                     ("layer1.0.bn1", "already holds an attention block")):
        with pytest.raises(ValueError) as e:
            insert_attention(r, "eca", at=at)
        assert said in str(e.value) and "\n" not in str(e.value), at
    assert _blocks(r) == 1 and isinstance(r.layer1[0].bn1.inner, torch.nn.BatchNorm2d)
    assert insert_attention(r, "cbam", at="layer2.0.bn1") == 1
    with pytest.raises(ValueError, match="it lies inside the attention block 'layer2.0.bn1.attn'"):
        insert_attention(r, "eca", at="layer2.0.bn1.attn.spatial.conv")  # a Conv2d of CBAM's: took a block before
    assert _blocks(r) == 2


def test_d18_the_family_rules_sites_are_occupied_too():
    r = torchvision.models.resnet18()
    assert insert_attention(r, "eca") == 8  # torchvision's bn2 becomes Sequential(norm, attn)
    with pytest.raises(ValueError, match="at='layer1.0.bn2.norm' is an occupied site: the attention block "
                                         "'layer1.0.bn2.attn' already follows it"):
        insert_attention(r, "eca", at="layer1.0.bn2.norm")
    with pytest.raises(ValueError, match="'layer1.0.bn2' already holds an attention block"):
        insert_attention(r, "eca", at="layer1.0.bn2")  # a Sequential whose output is the block's
    t = timm.create_model("resnet18", num_classes=10)
    assert insert_attention(t, "eca") == 8  # timm's: block.se, after bn2 in its forward, not in its module path
    with pytest.raises(ValueError, match="at='layer1.0.bn2' is an occupied site: the attention block 'layer1.0.se' "
                                         "already takes its output"):
        insert_attention(t, "eca", at="layer1.0.bn2")
    assert _blocks(t) == 8
    assert insert_attention(t, "eca", at="layer1.0.bn1") == 1  # a free site of the same model: taken


def test_d18_one_call_naming_a_sequential_and_its_last_module_is_refused():
    r = torchvision.models.resnet18()
    with pytest.raises(ValueError, match="names both 'layer2.0.downsample' and 'layer2.0.downsample.1', which give "
                                         "the same output"):
        insert_attention(r, "eca", at="layer2.0.downsample*")
    assert _blocks(r) == 0
    assert insert_attention(r, "eca", at=["layer2.0.downsample.0", "layer2.0.downsample"]) == 2  # two outputs


# ---- (d) 19: the bench scripts' inputs ----------------------------------------------------------------------------


def _check(**over):
    return {"device": "NVIDIA H100", "torch": "2.14.1", "cuda": "13.0", "date": "2026-12-06T10:00:00+00:00",
            "git": "abc123", "dry": False, "rows": [{"name": "race", "status": "pass", "detail": "ok"}], **over}


@pytest.mark.parametrize("content, said", [
    ({"a": 1}, "has no 'device', which must be a string"),
    (["x"], "holds a JSON list, not a dict"),
    (_check(rows={"race": 1}), "has no list 'rows'"),
    (_check(rows=[{"status": "pass", "detail": "x"}]), "row 1 has no 'name'"),
    (_check(rows=[{"name": "race", "status": "pass", "detail": 3}]), "row 1 has 3 as its 'detail'"),
    (_check(dry="no"), "has \"no\" as its 'dry', which must be true or false"),
])
@pytest.mark.parametrize("mode", ["--table", "--merge"])
def test_d19_gpu_checks_table_and_merge_read_only_a_checks_json(tmp_path, monkeypatch, capsys, content, said, mode):
    (tmp_path / "c.json").write_text(json.dumps(content))
    code, out, err = _script_main("gpu_check.py", monkeypatch, capsys, mode, str(tmp_path / "c.json"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and said in err and out == "", err
    code, out, err = _script_main("gpu_check.py", monkeypatch, capsys, mode, str(tmp_path))  # a folder
    assert code == 2 and "not a readable JSON file" in err and len(err.strip().splitlines()) == 1


def test_d19_a_good_checks_json_still_makes_the_table(tmp_path, monkeypatch, capsys):
    (tmp_path / "c.json").write_text(json.dumps(_check(cuda=None)))
    code, out, _ = _script_main("gpu_check.py", monkeypatch, capsys, "--table", str(tmp_path / "c.json"))
    assert code == 0 and "| `race` |" in out and "| pass | ok |" in out


@pytest.mark.parametrize("rev", ["-x", "--output=/tmp/x", "HEAD:README.md", "no-such-revision", "HEAD~1 HEAD"])
def test_d19_a_revision_flag_names_a_commit_or_is_one_line(rev):
    """An option-like string never reaches git (``--output=FILE`` would make ``git show`` write a file)."""
    from bench import blocks
    from bench.common import revision

    with pytest.raises(ConfigError, match=r"^--before .*: not a revision of this repository$"):
        revision("--before", rev)
    for read in (blocks.before_files, lambda r: blocks.before_source(r, "channel")):
        with pytest.raises(blocks.BeforeError, match="not a revision of this repository, nor a folder of its"):
            read(rev)
    with pytest.raises(ConfigError, match="not a revision"):
        revision("--before", "")


def test_d19_a_revision_resolves_to_its_commit():
    import subprocess

    from bench.common import ROOT, revision

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if not head:
        pytest.skip("no git history here")
    assert revision("--before", "HEAD") == head and len(head) == 40


# ---- (c): every check across config fields is a row of one table -------------------------------------------------


def _resolve(where: str):
    parts = where.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(where)


@pytest.mark.parametrize("row", CROSS_CHECKS, ids=[f"{r.stage}:{'+'.join(r.fields)}" for r in CROSS_CHECKS])
def test_c_every_row_names_the_code_that_makes_its_check(row):
    assert row.stage in STAGES and len(row.fields) >= 1
    assert row.says in inspect.getsource(_resolve(row.where)), f"{row.where} no longer says {row.says!r}"
    assert (row.check is not None) == (row.stage == "run")
    if row.check is not None:
        assert _resolve(row.where) is row.check


# a config that trips each run-stage row (and only that row among those before it): the row's words are the refusal
TRIPS = {
    "warmup_within_run": ["sched.name=cosine", "sched.warmup_epochs=3"],
    "cutout_within_image": ["data.image_size=8", "data.augment.cutout=9", "data.augment.crop_padding=0"],
    "cutout_under_albumentations": ["data.image_size=8", "data.augment.cutout=8", "data.loader=albumentations",
                                    "data.augment.crop_padding=0"],
    "workers_need_worker_loader": ["data.workers=2", "data.loader=tensor"],
    "crop_padding_within_image": ["data.image_size=8", "data.augment.crop_padding=8"],
    "maps_within_run": ["log.tensorboard=true", "log.maps_every=2"],
    "sync_bn_needs_ranks": ["sync_bn=true"],
    "temperature_keeps_teacher": ["train.distill.temperature=0.05"],
}


@pytest.mark.parametrize("row", [r for r in CROSS_CHECKS if r.stage == "run"], ids=lambda r: r.check.__name__)
def test_c_check_for_training_makes_every_run_row_in_the_tables_order(row, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = _load(*TRIPS[row.check.__name__])
    with pytest.raises(ConfigError) as e:
        check_for_training(cfg)
    assert row.says in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError):
        row.check(cfg)


def test_c_a_row_added_to_the_table_is_made_by_the_run(monkeypatch):
    """Adding a run-stage check is one place: a row in the table, and check_for_training makes it."""
    import visattn.cross_checks as cc

    def never(cfg):
        raise ConfigError("train.epochs=1 with seed=0: a new row")

    monkeypatch.setattr(cc, "CROSS_CHECKS", (*cc.CROSS_CHECKS, cc.CrossCheck(("train.epochs", "seed"), "run",
                                                                              "x.never", "a new row", never)))
    with pytest.raises(ConfigError, match="a new row"):
        check_for_training(_load())

"""insert_attention by structure (visattn.attention.structure): the sites found in a model's own forward match the
family rules bit for bit where those exist, reach residual families the rules never knew, refuse plain stacks in
one line, and fall back to the family rules (with one warning line) where a model does not run on the probe."""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from bench.coverage import ARCHS, build
from visattn import insert_attention
from visattn.attention.insert import AttnAfter
from visattn.attention.spatial import CBAM
from visattn.attention.structure import find_sites

ROOT = Path(__file__).resolve().parents[1]

# the families the family rules covered before the structural rule (issue 91's 21), smallest models
FAMILY_FAST = ["timm/resnet18", "torchvision/resnet18", "timm/regnetx_002", "timm/regnety_002",
               "torchvision/regnet_x_400mf", "timm/convnext_atto", "timm/efficientnet_b0", "timm/mobilenetv2_050",
               "timm/mobilenetv3_small_050", "timm/mnasnet_small", "torchvision/mobilenet_v2",
               "torchvision/mobilenet_v3_small", "timm/tinynet_e"]
FAMILY_SLOW = ["timm/resnext50_32x4d", "torchvision/resnext50_32x4d", "timm/wide_resnet50_2",
               "torchvision/wide_resnet50_2", "timm/efficientnetv2_rw_t", "torchvision/efficientnet_b0",
               "torchvision/efficientnet_v2_s", "timm/hrnet_w18_small", "torchvision/convnext_tiny",
               "torchvision/regnet_y_400mf"]
# residual families only the structural rule reaches
NEW_FAST = ["timm/resnest14d", "timm/skresnet18", "timm/nf_resnet26", "timm/resnext26ts", "timm/repvgg_a0",
            "timm/gernet_s", "timm/mobilevit_xxs", "timm/dla46_c", "timm/ghostnet_050", "timm/mobilenetv4_conv_small",
            "timm/starnet_s050", "timm/edgenext_xx_small", "timm/legacy_seresnet18", "timm/cspdarknet53",
            "torchvision/mnasnet0_5", "torchvision/shufflenet_v2_x0_5", "timm/mixnet_s"]


def _paths(model: nn.Module):
    return [p for p, _ in model.named_modules()]


def _outputs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x)


# sites the structural rule finds beyond the family rule's, in blocks the family rule leaves alone (by default
# they stay without a block, as before): timm EfficientNetV2's stage-0 ConvBnAct blocks with a skip
# and torchvision EfficientNetV2's FusedMBConv without an expansion (the family rule: no site; structure: its end)
EXTRA = {"timm/efficientnetv2_rw_t": 2, "torchvision/efficientnet_v2_s": 2}


def _check_same_sites(arch: str) -> None:
    model = build(arch).eval()
    torch.manual_seed(2)
    for m in model.modules():  # no zero-initialised last norms: every branch reaches the output
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.weight is not None:
            nn.init.uniform_(m.weight, 0.5, 1.5)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    before = _outputs(model, x)
    by_family, by_structure, by_default = (copy.deepcopy(model) for _ in range(3))
    torch.manual_seed(0)
    n = insert_attention(by_family, "se", rule="family", init="default")  # blocks that change the output
    torch.manual_seed(0)
    assert insert_attention(by_structure, "se", rule="structure", init="default") == n + EXTRA.get(arch, 0) > 0
    out = _outputs(by_family, x)
    assert not torch.equal(out, before)
    if arch not in EXTRA:
        assert torch.equal(_outputs(by_structure, x), out), "the structural sites are not the family rule's"
    family_cbam = copy.deepcopy(model)
    assert insert_attention(family_cbam, "cbam", rule="family") == n
    assert insert_attention(by_default, "cbam") == n  # the default rule: the same sites, the same module paths
    assert _paths(by_default) == _paths(family_cbam)
    assert list(by_default.state_dict()) == list(family_cbam.state_dict())
    assert torch.equal(_outputs(by_default, x), before)  # init="identity": bit for bit


@pytest.mark.parametrize("arch", FAMILY_FAST)
def test_structure_finds_the_family_rules_sites(arch):
    _check_same_sites(arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", FAMILY_SLOW)
def test_structure_finds_the_family_rules_sites_large(arch):
    _check_same_sites(arch)


@pytest.mark.parametrize("arch", NEW_FAST)
def test_residual_families_get_blocks_as_the_identity_that_learn(arch):
    torch.manual_seed(0)
    model = build(arch).eval()
    x = torch.randn(2, 3, 64, 64)
    before = _outputs(model, x)
    n = insert_attention(model, "cbam")
    assert n > 0 and sum(isinstance(m, CBAM) for m in model.modules()) == n
    assert torch.equal(_outputs(model, x), before)
    model.train()(x).logsumexp(1).sum().backward()
    for block in (m for m in model.modules() if isinstance(m, CBAM)):
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in block.parameters())


def test_state_dict_names_are_kept_where_the_structure_places_a_block():
    model = build("timm/resnest14d")
    keys = list(model.state_dict())
    insert_attention(model, "se")
    assert [k for k in model.state_dict() if ".attn." not in k] == keys  # weights saved before load after


def test_sites_of_resnest_are_after_the_branch_last_norm():
    model = build("timm/resnest14d")
    sites = find_sites(model)
    assert [(s.path, s.kind, s.channels) for s in sites] == [
        ("layer1.0.bn3", "branch", 256), ("layer2.0.bn3", "branch", 512), ("layer3.0.bn3", "branch", 1024),
        ("layer4.0.bn3", "branch", 2048)]


def test_inverted_residual_site_is_the_se_slot_before_the_projection():
    model = build("timm/mobilenetv4_conv_small")
    sites = find_sites(model)
    modules = dict(model.named_modules())
    slots = [s for s in sites if s.kind == "se-slot"]
    assert len(slots) >= 5 and all(s.path.endswith(".se") for s in slots)
    for s in sites:  # the expanded width the projection reads; a block with no depthwise conv there: its end
        block = modules[s.path.rsplit(".", 1)[0]]
        if s.kind == "se-slot":
            assert s.channels == block.pw_proj.conv.in_channels and not isinstance(block.dw_mid, nn.Identity)
        else:  # ConvNeXt-like: a depthwise conv at the block's width, then the MLP
            assert isinstance(block.dw_mid, nn.Identity) and s.anchor.endswith("pw_proj.bn")


class _Residual(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class _Fusion(nn.Module):
    """A sum of two long branches (no skip): no site."""

    def __init__(self, c: int):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.Conv2d(c, c, 3, padding=1))
        self.b = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.Conv2d(c, c, 3, padding=1))

    def forward(self, x):
        return self.a(x) + self.b(x)


def test_a_block_never_sits_on_a_main_path_without_a_skip():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), _Residual(8), _Fusion(8),
                          nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))
    assert [s.path for s in find_sites(model)] == ["3.bn2"]
    assert insert_attention(model, "eca") == 1
    assert isinstance(model[3].bn2, AttnAfter) and isinstance(model[1], nn.BatchNorm2d)


@pytest.mark.parametrize("arch", ["torchvision/squeezenet1_0", "timm/vit_tiny_patch16_224", "timm/densenet121"])
def test_no_residual_branch_is_one_line_naming_at_and_modules(arch):
    model = build(arch)
    with pytest.raises(ValueError, match="found no residual blocks") as e:
        insert_attention(model, "cbam")
    text = str(e.value)
    assert "\n" not in text and "at=[" in text
    names = re.findall(r"at=\[('[^']+'(?:, '[^']+')*)\]", text)
    assert names and all(n.strip("'") in dict(model.named_modules()) for n in names[0].split(", "))
    assert not any(isinstance(m, (CBAM, AttnAfter)) for m in model.modules())


class _Picky(nn.Module):
    """A torchvision ResNet-18 that runs on 17-px inputs only: it does not trace on the probe."""

    def __init__(self):
        super().__init__()
        from torchvision.models import resnet18

        self.net = resnet18(weights=None, num_classes=10)

    def forward(self, x):
        if x.shape[-1] != 17:
            raise RuntimeError("17 px only")
        return self.net(x)


def test_a_model_that_does_not_trace_falls_back_to_the_family_rules_with_one_line():
    model = _Picky()
    with pytest.warns(UserWarning, match="did not run on a probe image .*family rules") as rec:
        assert insert_attention(model, "cbam") == 8
    assert len(rec) == 1 and "\n" not in str(rec[0].message)


def test_a_model_that_does_not_trace_and_has_no_family_is_refused_in_one_line_without_a_warning():
    model = nn.Sequential(_Picky().net.conv1, nn.Flatten())
    model.forward = lambda x: (_ for _ in ()).throw(RuntimeError("never runs"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="found no residual blocks"):
            insert_attention(model, "cbam")


def test_rule_is_checked():
    with pytest.raises(ValueError, match="rule='shape' is not one of auto, structure, family"):
        insert_attention(build("timm/resnet18"), "se", rule="shape")


def test_the_trace_leaves_the_model_as_it_was():
    model = build("timm/ghostnet_050").train()
    state = copy.deepcopy(model.state_dict())
    rng = torch.random.get_rng_state()
    find_sites(model)
    assert model.training and all(m.training for m in model.modules())
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


@pytest.mark.slow
def test_no_architecture_of_the_coverage_list_crashes_insert_attention():
    for arch in ARCHS:
        model = build(arch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                assert insert_attention(model, "cbam") > 0
            except ValueError as e:
                assert "\n" not in str(e) and "at=" in str(e), arch


@pytest.mark.slow
def test_train_py_trains_a_resnest_by_name_with_maps(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--config", "configs/smoke.yaml", "train.epochs=1", "data.synthetic_size=200",
           "data.val_size=50", "log.progress=false", "model.name=timm/resnest14d", "model.cifar_stem=true",
           "model.attention=cbam", f"run_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows
    tags = set()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for events in (out / "tb").rglob("events.*"):
        acc = EventAccumulator(str(events), size_guidance={"images": 0})
        acc.Reload()
        tags |= set(acc.Tags().get("images", []))
    assert any(t.startswith("maps/") for t in tags), sorted(tags)[:10]


def test_the_placement_rule_example_in_development_md_runs():
    page = (ROOT / "docs" / "development.md").read_text()
    section = page.split("## Worked example: a new placement rule (one function)", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/development.md", "exec"), {"__name__": "example"})

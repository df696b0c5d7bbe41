"""Reuse helpers: ``insert_attention`` into torchvision / timm ResNets, RegNets, ConvNeXts, EfficientNets and
MobileNetV3s, and timm's ``attn_layer`` slot."""
from __future__ import annotations

import copy
import pickle

import pytest
import timm
import torch
from conftest import REPRESENTATIVE_BLOCKS
from torch import nn
from torchvision.models import resnet18 as tv_resnet18

from visattn import attn_layer, insert_attention
from visattn.attention import AttentionTap, list_attention
from visattn.attention.channel import EfficientChannelAttention, SqueezeExcite
from visattn.attention.spatial import CBAM

FEATURE = list_attention("feature")


def forward_backward(model: nn.Module, inserted_type=None, size: int = 32) -> None:
    x = torch.randn(2, 3, size, size)
    out = model(x)
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    out.logsumexp(1).sum().backward()
    for name, p in model.named_parameters():
        assert p.requires_grad, name
    if inserted_type is not None:
        blocks = [m for m in model.modules() if isinstance(m, inserted_type)]
        assert blocks
        for block in blocks:  # the new blocks are trainable and on the backward path
            grads = [p.grad for p in block.parameters()]
            assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def inserted(model: nn.Module, cls: type) -> int:
    return sum(isinstance(m, cls) for m in model.modules())


# the insertion is block-agnostic; every block goes through timm's slot in test_timm_attn_layer
@pytest.mark.parametrize("name", ["se", "cbam", "coord", "nonlocal"])
def test_insert_into_torchvision_resnet18(name):
    torch.manual_seed(0)
    model = tv_resnet18(weights=None, num_classes=10)
    n_before = sum(p.numel() for p in model.parameters())
    assert insert_attention(model, name) == 8
    assert sum(p.numel() for p in model.parameters()) > n_before
    assert isinstance(model.layer1[0].bn2, nn.Sequential)
    assert isinstance(model.layer1[0].bn2.norm, nn.BatchNorm2d)
    forward_backward(model, type(model.layer1[0].bn2.attn), size=64 if name == "se" else 32)
    assert inserted(model, type(model.layer1[0].bn2.attn)) == 8


@pytest.mark.parametrize("arch,expected", [("resnet18", 8), ("resnet50", 16)])
def test_insert_into_timm_resnets(arch, expected):
    torch.manual_seed(0)
    model = timm.create_model(arch, pretrained=False, num_classes=10)
    assert insert_attention(model, "cbam") == expected
    assert model.layer1[0].se is not None  # timm's own attention slot, after the last BN
    forward_backward(model, type(model.layer1[0].se), size=64)
    assert inserted(model, type(model.layer1[0].se)) == expected


def test_insert_with_options_and_taps():
    model = timm.create_model("resnet50", pretrained=False, num_classes=10)
    assert insert_attention(model, "se", rd_ratio=0.25) == 16
    se = model.layer1[0].se
    assert isinstance(se, SqueezeExcite) and se.fc1.out_channels == 256 // 4
    taps = [m for m in model.modules() if isinstance(m, AttentionTap)]
    assert len(taps) == 16
    for tap in taps:
        tap.sink = []
    model.eval()(torch.randn(1, 3, 64, 64))
    assert all(len(t.sink) == 1 for t in taps)


@pytest.mark.parametrize("build", ["torchvision", "timm"])
def test_inserted_block_sits_before_the_residual_add(build):
    """A gate that closes completely (SE with a huge negative bias) must cut the residual branch exactly:
    the model then equals one whose last BN of each residual branch outputs zero."""
    torch.manual_seed(0)
    model = tv_resnet18(weights=None, num_classes=10) if build == "torchvision" else timm.create_model(
        "resnet18", pretrained=False, num_classes=10
    )
    model.eval()
    cut = copy.deepcopy(model)
    insert_attention(model, "se")
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SqueezeExcite):
                m.fc2.bias.fill_(-1e4)  # gate = sigmoid(-1e4) = 0
        for block in (m for m in cut.modules() if hasattr(m, "bn2") and hasattr(m, "conv2")):
            block.bn2.weight.zero_()
            block.bn2.bias.zero_()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), cut(x))


def test_insert_keeps_mode_device_dtype():
    model = timm.create_model("resnet18", pretrained=False, num_classes=10).double().eval()
    insert_attention(model, "eca")
    for block in (m.se for m in model.modules() if hasattr(m, "se") and m.se is not None):
        assert not block.training
        assert all(p.dtype == torch.float64 and p.requires_grad for p in block.parameters())
    model.train()
    forward_backward_x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    model(forward_backward_x).sum().backward()


def test_insert_errors():
    with pytest.raises(ValueError, match="no residual blocks") as e:
        insert_attention(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)), "se")
    hint = str(e.value)
    assert "RegNet" in hint and "ConvNeXt" in hint and "create_attention" in hint
    assert "attn_layer" not in hint  # only timm ResNets take attn_layer at creation: no such hint here
    model = tv_resnet18(weights=None)
    with pytest.raises(ValueError, match="token block"):
        insert_attention(model, "mhsa")
    with pytest.raises(ValueError, match="valid"):
        insert_attention(model, "squeeze")
    with pytest.raises(ValueError, match="rd_ratio"):
        insert_attention(model, "se", ratio=4)
    before = copy.deepcopy(model.state_dict())
    assert insert_attention(model, "se") == 8
    with pytest.raises(ValueError, match="already holds"):
        insert_attention(model, "eca")
    assert set(before) <= {k.replace(".bn2.norm.", ".bn2.") for k in model.state_dict()}


@pytest.mark.parametrize("name", FEATURE)
def test_timm_attn_layer(name):
    torch.manual_seed(0)
    layer = attn_layer(name)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10, block_args=dict(attn_layer=layer))
    se = model.layer1[0].se
    assert type(se).__name__ == type(layer(64)).__name__
    forward_backward(model, type(se) if list(se.parameters()) else None)  # none, simam: no parameters


def test_attn_layer_matches_insert_and_pickles():
    a = timm.create_model("resnet18", pretrained=False, block_args=dict(attn_layer=attn_layer("cbam")))
    b = timm.create_model("resnet18", pretrained=False)
    insert_attention(b, "cbam")
    assert sorted(a.state_dict()) == sorted(b.state_dict())  # same place, same names
    b.load_state_dict(a.state_dict())
    clone = pickle.loads(pickle.dumps(a))
    x = torch.randn(1, 3, 32, 32)
    a.eval(), clone.eval(), b.eval()
    with torch.no_grad():
        torch.testing.assert_close(clone(x), a(x))
        torch.testing.assert_close(b(x), a(x))
    assert repr(attn_layer("se", rd_ratio=0.25)) == "attn_layer('se', rd_ratio=0.25)"


def test_attn_layer_takes_timm_device_dtype_and_checks_early():
    block = attn_layer("se")(32, device="cpu", dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in block.parameters())
    with pytest.raises(ValueError, match="valid"):
        attn_layer("nope")
    with pytest.raises(ValueError, match="rd_ratio"):
        attn_layer("se", reduction=16)
    with pytest.raises(ValueError, match="token block"):
        attn_layer("mhsa")


# ---- RegNet, ConvNeXt, EfficientNet, MobileNetV3 ---------------------------------------------------------

# (library, architecture, extra build options, blocks inserted, whether the model has SE modules of its own)
FAMILIES = [
    ("torchvision", "regnet_x_400mf", {}, 22, False),
    ("torchvision", "regnet_y_400mf", {}, 16, True),
    ("torchvision", "convnext_tiny", {}, 18, False),
    ("torchvision", "mobilenet_v3_small", {}, 6, True),  # the 6 of its 11 inverted residuals with a skip
    ("torchvision", "efficientnet_b0", {}, 9, True),   # 9 of 16
    ("torchvision", "mobilenet_v2", {}, 10, False),    # 10 of 17, no SE: after the depthwise conv
    ("timm", "regnetx_002", {}, 13, False),
    ("timm", "regnety_002", {}, 13, True),
    ("timm", "convnext_atto", {}, 12, False),  # conv MLP: (B, C, H, W) throughout
    ("timm", "convnext_atto", {"conv_mlp": False}, 12, False),  # linear MLP on (B, H, W, C)
    ("timm", "mobilenetv3_small_050", {}, 7, True),
    ("timm", "efficientnet_b0", {}, 9, True),
    ("timm", "tf_efficientnet_lite0", {}, 9, False),  # no SE: in its empty SE slot
    ("timm", "efficientnet_es", {}, 12, False),  # EdgeResidual (fused MBConv) blocks
]
FAMILY_IDS = [f"{lib}-{arch}{'-' + '-'.join(kw) if kw else ''}" for lib, arch, kw, _, _ in FAMILIES]
# where the block sits: the end of its residual branch, or in an inverted residual the family's SE slot (after
# its SE: <SE>.attn; without one, appended to the depthwise conv-norm-activation: torchvision block.1.3 / conv.1.3)
SLOT = {"regnet_x_400mf": (".f.c.2",), "regnet_y_400mf": (".f.c.2",), "convnext_tiny": (".block.7",),
        "regnetx_002": (".conv3.aa",), "regnety_002": (".conv3.aa",), "convnext_atto": (".mlp.drop2.attn",),
        "mobilenet_v3_small": (".block.2.attn", ".block.1.3"), "efficientnet_b0": (".block.2.attn",),
        "mobilenet_v2": (".conv.1.3",), "mobilenetv3_small_050": (".se.attn",), "tf_efficientnet_lite0": (".se.attn",),
        "efficientnet_es": (".se.attn",)}
TIMM_EFFICIENTNET_SLOT = (".se.attn",)


def build_family(lib: str, arch: str, kw: dict) -> nn.Module:
    torch.manual_seed(0)
    if lib == "torchvision":
        import torchvision

        return getattr(torchvision.models, arch)(weights=None, num_classes=10, **kw)
    return timm.create_model(arch, pretrained=False, num_classes=10, **kw)


def foreign_se(model: nn.Module) -> list:
    from timm.layers import SEModule
    from timm.models._efficientnet_blocks import SqueezeExcite as TimmEffSE
    from torchvision.ops.misc import SqueezeExcitation

    return [p for p, m in model.named_modules() if isinstance(m, (SqueezeExcitation, SEModule, TimmEffSE))]


@pytest.mark.parametrize("lib,arch,kw,expected,has_se", FAMILIES, ids=FAMILY_IDS)
def test_insert_into_new_families(lib, arch, kw, expected, has_se):
    model = build_family(lib, arch, kw)
    before = {k: v.shape for k, v in model.state_dict().items()}
    se_paths = foreign_se(model)
    own = [model.get_submodule(p) for p in se_paths]
    assert bool(se_paths) == has_se
    assert insert_attention(model, "cbam") == expected
    assert [model.get_submodule(p) for p in foreign_se(model)] == own  # the model's own SEs are kept (a block after
    # one holds it as AttnAfter.inner: its module path gains ".inner", its parameter names do not)
    blocks = [p for p, m in model.named_modules() if isinstance(m, CBAM)]
    assert len(blocks) == expected
    slot = TIMM_EFFICIENTNET_SLOT if lib == "timm" and arch == "efficientnet_b0" else SLOT[arch]
    assert all(p.endswith(slot) for p in blocks), blocks[:2]  # at the family's slot, in one that keeps names
    after = model.state_dict()
    for key, shape in before.items():  # every parameter of the model's own is kept, under its name
        assert key in after and after[key].shape == shape, key
    forward_backward(model, CBAM)


def _branch_cuts(model: nn.Module) -> list:
    """What a closed gate at each of insert_attention's sites amounts to: the norm (or layer scale) whose output
    ends each residual branch, and in an inverted residual with a skip its projection conv, which the block's
    site (the SE slot) feeds; none in inverted residuals without a skip."""
    import timm.models._efficientnet_blocks as tm_eff
    import timm.models.regnet as tm_regnet
    import torchvision.models.efficientnet as tv_eff
    import torchvision.models.mobilenetv2 as tv_mnv2
    import torchvision.models.mobilenetv3 as tv_mnv3
    import torchvision.models.regnet as tv_regnet

    out = []
    for m in model.modules():
        if isinstance(m, tv_regnet.ResBottleneckBlock):
            out.append(m.f.c[1])
        elif isinstance(m, (tv_eff.MBConv, tv_eff.FusedMBConv, tv_mnv3.InvertedResidual)):
            out += [m.block[-1][0]] if m.use_res_connect else []
        elif isinstance(m, tv_mnv2.InvertedResidual):
            out += [m.conv[-2]] if m.use_res_connect else []
        elif isinstance(m, tm_regnet.Bottleneck):
            out.append(m.conv3.bn)
        elif isinstance(m, (tm_eff.InvertedResidual, tm_eff.EdgeResidual)):
            out += [m.conv_pwl] if m.has_skip else []
        elif isinstance(m, tm_eff.DepthwiseSeparableConv):
            out += [m.conv_pw] if m.has_skip else []
        elif type(m).__name__ in ("CNBlock", "ConvNeXtBlock"):
            out.append(m)
    return out


@pytest.mark.parametrize("lib,arch,kw,expected,has_se", FAMILIES, ids=FAMILY_IDS)
def test_inserted_block_cuts_the_branch_at_its_site(lib, arch, kw, expected, has_se):
    """A closed SE gate (bias -1e4) at every site equals cutting each residual branch there: zeroing its last norm
    (ConvNeXt: its layer scale), or in an inverted residual with a skip the projection conv the SE slot feeds, the
    model's own SEs kept in both. Blocks without a skip hold no site (their output would be cut, not a branch)."""
    model = build_family(lib, arch, kw).eval()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 32, 32)
    insert_attention(model, "se")
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SqueezeExcite):
                m.fc2.bias.fill_(-1e4)  # gate = sigmoid(-1e4) = 0
        ends = _branch_cuts(reference)
        assert len(ends) == expected
        for m in ends:
            if hasattr(m, "layer_scale"):
                m.layer_scale.zero_()
            elif hasattr(m, "gamma"):
                m.gamma.zero_()
            else:
                m.weight.zero_()
                if m.bias is not None:
                    m.bias.zero_()
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)


INVERTED = [("torchvision", "mobilenet_v3_small", {}), ("torchvision", "efficientnet_b0", {}),
            ("torchvision", "mobilenet_v2", {}), ("timm", "mobilenetv3_small_100", {}), ("timm", "tinynet_e", {}),
            ("timm", "efficientnet_es", {})]


@pytest.mark.parametrize("lib,arch,kw", INVERTED, ids=[f"{lib}-{arch}" for lib, arch, _ in INVERTED])
def test_no_default_site_lies_in_an_inverted_residual_without_a_skip(lib, arch, kw):
    """The earlier rule's loss (MobileNetV3-Small -18.6 points with CBAM): a gate in a block without a skip sits on
    the network's only path. The rule puts none there, and every block with a skip gets one, in the expanded
    width the family's SE sees."""
    model = build_family(lib, arch, kw)
    insert_attention(model, "cbam")
    kinds = ("InvertedResidual", "DepthwiseSeparableConv", "EdgeResidual", "MBConv", "FusedMBConv")
    inverted = [(p, m) for p, m in model.named_modules() if type(m).__name__ in kinds]
    assert inverted
    for path, m in inverted:
        skip = getattr(m, "has_skip", getattr(m, "use_res_connect", None))
        held = [q for q, b in m.named_modules() if isinstance(b, CBAM)]
        assert len(held) == (1 if skip else 0), (path, skip, held)
        if held:
            project = m.conv_pw if type(m).__name__ == "DepthwiseSeparableConv" else \
                m.conv_pwl if hasattr(m, "conv_pwl") else (m.block[-1][0] if hasattr(m, "block") else m.conv[-2])
            assert m.get_submodule(held[0]).channel.channels == project.in_channels  # the expanded width


def test_weights_saved_before_the_block_load_after_it_and_the_other_way_round():
    """A block after a kept SE keeps the SE's parameter names (AttnAfter(keep_names=True)): a state dict of the
    plain model loads into the model with blocks (only the blocks' keys missing), and the blocks' state dict
    loads back; the ``inner.`` form of the same weights loads too."""
    plain = build_family("timm", "mobilenetv3_small_050", {})
    model = copy.deepcopy(plain)
    insert_attention(model, "cbam")
    result = model.load_state_dict(plain.state_dict(), strict=False)
    assert not result.unexpected_keys and result.missing_keys and all(".se.attn." in k for k in result.missing_keys)
    state = model.state_dict()
    assert "blocks.2.1.se.conv_reduce.weight" in state and not any(".inner." in k for k in state)
    twin = build_family("timm", "mobilenetv3_small_050", {})
    insert_attention(twin, "cbam")
    twin.load_state_dict(state)
    from visattn.attention.insert import AttnAfter

    wrapped = [p + "." for p, m in twin.named_modules() if isinstance(m, AttnAfter)]
    inner = {next((w + "inner." + k[len(w):] for w in wrapped if k.startswith(w) and not k.startswith(w + "attn.")), k): v
             for k, v in state.items()}
    assert any(".se.inner.conv_reduce." in k for k in inner)
    twin.load_state_dict(inner)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(twin.eval()(x), model.eval()(x))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in twin.named_parameters()]


def test_a_checkpoint_with_blocks_at_the_earlier_sites_is_refused_naming_them():
    from visattn.attention.insert import check_sites

    model = build_family("timm", "mobilenetv3_small_050", {})
    insert_attention(model, "cbam")
    keys = list(model.state_dict())
    check_sites(model, keys, "x.pt")  # this rule's own keys: fine
    with pytest.raises(ValueError, match=r"x\.pt was trained with visattn's earlier placement .*'blocks\.1\.0\.bn3\.act'"):
        check_sites(model, [*keys, "blocks.1.0.bn3.act.attn.channel.fc1.weight"], "x.pt")
    tv = build_family("torchvision", "mobilenet_v3_small", {})
    with pytest.raises(ValueError, match="'features.1.block.2.2'"):
        check_sites(tv, ["features.1.block.2.2.channel.fc1.weight"], "y.pt")


@pytest.mark.parametrize("lib,arch,kw,expected,has_se", [f for f in FAMILIES if f[4]],
                         ids=[i for i, f in zip(FAMILY_IDS, FAMILIES) if f[4]])
def test_replace_se_is_an_explicit_option_that_drops_the_trained_se(lib, arch, kw, expected, has_se):
    """``replace_se=True`` puts the block in each SE's place: the identity block ("none") then equals deleting
    the SEs, so a trained model's output changes (its SE weights are gone)."""
    model = build_family(lib, arch, kw).eval()
    reference = copy.deepcopy(model)
    se_paths = foreign_se(model)
    assert insert_attention(model, "none", replace_se=True) == len(se_paths)
    assert foreign_se(model) == []
    for path in se_paths:
        parent, _, attr = path.rpartition(".")
        setattr(reference.get_submodule(parent), attr, nn.Identity())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no squeeze-and-excitation modules"):
        insert_attention(tv_resnet18(weights=None), "se", replace_se=True)
    with pytest.raises(ValueError, match="cannot go with at="):
        insert_attention(build_family(lib, arch, kw), "se", replace_se=True, at="conv1")


@pytest.mark.parametrize("lib,arch,kw", [("torchvision", "convnext_tiny", {}), ("timm", "regnety_002", {}),
                                         ("timm", "convnext_atto", {"conv_mlp": False}),
                                         ("timm", "efficientnet_b0", {}), ("torchvision", "mobilenet_v3_small", {})])
def test_new_families_refuse_a_second_insertion_and_keep_dtype(lib, arch, kw):
    model = build_family(lib, arch, kw).double()
    n = insert_attention(model, "eca")
    for block in (m for m in model.modules() if isinstance(m, EfficientChannelAttention)):
        assert all(p.dtype == torch.float64 and p.requires_grad for p in block.parameters())
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="already holds"):
        insert_attention(model, "se")
    assert before.keys() == model.state_dict().keys() and n > 0
    model(torch.randn(2, 3, 32, 32, dtype=torch.float64)).sum().backward()


def test_timm_resnet_with_its_own_se_keeps_it_and_gets_the_block_after_it():
    model = timm.create_model("seresnet18", pretrained=False, num_classes=10)
    se = model.layer1[0].se
    assert insert_attention(model, "eca") == 8
    assert model.layer1[0].se is se  # kept, trained weights and all
    assert isinstance(model.layer1[0].drop_path.attn, EfficientChannelAttention)
    forward_backward(model, EfficientChannelAttention)
    replaced = timm.create_model("seresnet18", pretrained=False, num_classes=10)
    assert insert_attention(replaced, "eca", replace_se=True) == 8
    assert isinstance(replaced.layer1[0].se, EfficientChannelAttention)


# ---- a trained model computes what it computed before: every family x every feature block --------------

def _small_torchvision(arch: str) -> nn.Module:
    import torchvision
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    if arch == "convnext":  # convnext_tiny's blocks at a fraction of its 28M parameters
        return ConvNeXt([CNBlockConfig(32, 64, 2), CNBlockConfig(64, None, 2)], num_classes=10)
    return getattr(torchvision.models, arch)(weights=None, num_classes=10)


TRAINED = [("torchvision", "resnet18"), ("torchvision", "regnet_x_400mf"), ("torchvision", "regnet_y_400mf"),
           ("torchvision", "convnext"), ("torchvision", "efficientnet_b0"), ("torchvision", "mobilenet_v3_small"),
           ("timm", "resnet18"), ("timm", "seresnet18"), ("timm", "regnetx_002"), ("timm", "regnety_002"),
           ("timm", "convnext_atto"), ("timm", "efficientnet_b0"), ("timm", "mobilenetv3_small_100")]
_TRAINED_CACHE: dict = {}


def trained(lib: str, arch: str):
    """A model of the family with every weight and BN running statistic moved off its default (as training
    leaves them), in eval mode, with an input and its output (computed with autograd on, as the test does)."""
    if (lib, arch) not in _TRAINED_CACHE:
        torch.manual_seed(0)
        model = _small_torchvision(arch) if lib == "torchvision" else timm.create_model(arch, pretrained=False,
                                                                                         num_classes=10)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._NormBase) and m.running_mean is not None:
                    m.running_mean.normal_(0, 0.1, generator=g)
                    m.running_var.uniform_(0.5, 1.5, generator=g)
        model.eval()
        x = torch.randn(1, 3, 32, 32, generator=g)
        _TRAINED_CACHE.clear()  # one family at a time in memory (the parametrization goes family-major)
        _TRAINED_CACHE[(lib, arch)] = (model, x, model(x).detach())
    return _TRAINED_CACHE[(lib, arch)]


# family-major (the cache above holds one family); the fast tier: every block in torchvision's ResNet-18 and the
# representative blocks (conftest.REPRESENTATIVE_BLOCKS) in every family, the whole suite: every pair
TRAINED_CASES = [pytest.param(lib, arch, name, id=f"{lib}-{arch}-{name}", marks=() if (lib, arch) == TRAINED[0]
                              or name in REPRESENTATIVE_BLOCKS else pytest.mark.slow)
                 for lib, arch in TRAINED for name in FEATURE]


@pytest.mark.parametrize("lib,arch,name", TRAINED_CASES)
def test_inserting_into_a_trained_model_leaves_its_output_bit_identical_and_the_blocks_learn(lib, arch, name):
    host, x, before = trained(lib, arch)
    model = copy.deepcopy(host)
    n = insert_attention(model, name)
    out = model(x)
    assert torch.equal(out.detach(), before)  # eval mode: the same bits, trained SEs included
    blocks = [m for m in model.modules() if getattr(m, "_visattn_attention", None) == name]
    assert len(blocks) == n > 0
    out.logsumexp(1).sum().backward()
    for block in blocks:  # on the backward path: every new parameter gets a finite gradient
        grads = [p.grad for p in block.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
    if name != "none":
        assert any(p.grad.abs().sum() > 0 for b in blocks for p in b.parameters())  # and they can learn


class _OwnNet(nn.Module):
    """A user's own model: no residual blocks or SE modules that insert_attention knows."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def test_insert_at_named_modules_of_your_own_model_starts_as_the_identity_and_learns():
    torch.manual_seed(0)
    model, x = _OwnNet().eval(), torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        before, weights = model(x), copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="no residual blocks") as e:
        insert_attention(model, "cbam")  # no family rule applies ...
    assert "at=" in str(e.value)  # ... and the error says how to name the places
    assert insert_attention(model, "cbam", at="body.[14]") == 2  # an fnmatch pattern: the BN and the GroupNorm
    assert [type(m).__name__ for m in model.body] == ["Conv2d", "AttnAfter", "ReLU", "Conv2d", "AttnAfter", "ReLU"]
    assert [m.attn.channel.channels for m in (model.body[1], model.body[4])] == [16, 32]
    assert not model.body[1].attn.training  # the host's mode
    with torch.no_grad():
        assert torch.equal(model(x), before)  # init="identity" by default: the model computes what it did
    moved = {k.replace(".inner.", ".") for k in model.state_dict() if ".attn." not in k}
    assert moved == set(weights)  # the named modules' parameters moved to NAME.inner.*, nothing else changed
    forward_backward(model.train(), CBAM, size=16)


def test_insert_at_takes_sequential_layers_and_adds_to_a_model_that_has_blocks():
    from torchvision.models import mobilenet_v2

    model = mobilenet_v2(weights=None, num_classes=10)  # no SE; at= places blocks anywhere, beside the rule
    assert insert_attention(model, "se", at=["features.0", "features.18"]) == 2  # Conv2dNormActivation: conv, BN, ReLU6
    assert [model.features[i].attn.channels for i in (0, 18)] == [32, 1280]
    with pytest.raises(ValueError, match="cannot tell how many channels InvertedResidual outputs"):
        insert_attention(model, "eca", at="features.1")  # a module whose width its type does not say
    assert insert_attention(model, "eca", at="features.1.conv") == 1  # its branch (ends in a BN): another kind
    assert model.features[1].conv.attn.channels == 16
    forward_backward(model, SqueezeExcite)
    with pytest.raises(ValueError, match="'features.0' already holds"):
        insert_attention(model, "eca", at="features.0")


def test_insert_at_takes_timms_channels_first_layer_norm_and_refuses_a_channels_last_one():
    model = timm.create_model("convnext_atto", pretrained=False, num_classes=10)
    assert type(model.stem[1]).__name__ == "LayerNorm2d"
    assert insert_attention(model, "coord", at="stem.1") == 1 and model.stem[1].attn.channels == 40
    forward_backward(model)
    channels_last = nn.Sequential(nn.Conv2d(3, 8, 1), nn.LayerNorm(8))
    with pytest.raises(ValueError, match="cannot tell how many channels LayerNorm outputs"):
        insert_attention(channels_last, "se", at="1")


def test_insert_at_refuses_names_it_cannot_use_and_leaves_the_model_unchanged():
    model = _OwnNet()
    keys = list(model.state_dict())
    with pytest.raises(ValueError, match=r"at='bdy.1' names no module of _OwnNet; .*'body.1'"):
        insert_attention(model, "se", at=["body.1", "bdy.1"])
    with pytest.raises(ValueError, match="cannot tell how many channels Linear outputs"):
        insert_attention(model, "se", at=["body.1", "head"])
    with pytest.raises(ValueError, match="at= takes module names"):
        insert_attention(model, "se", at=[""])
    assert list(model.state_dict()) == keys and type(model.body[1]) is nn.BatchNorm2d

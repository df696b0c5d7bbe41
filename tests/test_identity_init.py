"""Blocks keep their own initialisation inside every model, start as the identity with ``init="identity"``
and still learn, and sit where ``attn_position`` puts them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import visattn
from visattn import create_attention, create_model, list_attention, list_models
from visattn.attention import insert as insert_mod
from visattn.maps import render as scale_mod
from visattn.models import resnet as resnet_mod
from visattn.optim import build_optimizer
from visattn.registry import backbone_modules, is_attention_block

FEATURE = [n for n in list_attention("feature") if n != "none"]
# the CPU recipe's backbone options (configs/cifar10_cpu.yaml): every one of them reaches for norms and convs
RECIPE = dict(stem="whiten", block="plain", conv_init="dirac", bn_momentum=0.4, bn_eps=1e-12, bn_scale="frozen",
              head_scale=1 / 9, whiten_bias_epochs=1)
SMALL = {"resnet_fast": dict(widths=[16, 32, 32], **RECIPE), "resnet18": dict(widths=[8, 16, 16, 16]),
         "resnet34": dict(widths=[8, 8, 8, 8]), "vit_tiny": dict(dim=32, depth=2, num_heads=2),
         "vit_small": dict(dim=32, depth=2, num_heads=2), "cct_2": dict(dim=32, num_heads=2),
         "cct_7": dict(dim=32, depth=2, num_heads=2)}


def _blocks_for(model_name: str):
    family = visattn.registry.MODELS.meta(model_name)["family"]
    if family == "cnn":
        return [(b, kw) for b in FEATURE for kw in ({}, {"init": "identity"})]
    return [("mhsa", {}), ("lsa", {})]


def _record_creations(monkeypatch):
    """Every create_attention call: (name, channels, kwargs, the RNG state before it, the block)."""
    made = []
    real = visattn.registry.create_attention

    def spy(name, channels, **kwargs):
        state = torch.get_rng_state()
        block = real(name, channels, **kwargs)
        made.append((name, channels, kwargs, state, block))
        return block

    for mod in (resnet_mod, visattn.models.vit):
        monkeypatch.setattr(mod, "create_attention", spy)
    return made


CASES = [(m, b, kw) for m in list_models() if m in SMALL for b, kw in _blocks_for(m)]


@pytest.mark.parametrize("model_name,block,kw", CASES, ids=[f"{m}-{b}-{kw.get('init', 'default')}" for m, b, kw in CASES])
def test_no_backbone_option_changes_or_freezes_a_block_parameter(monkeypatch, model_name, block, kw):
    made = _record_creations(monkeypatch)
    torch.manual_seed(0)
    key = "attention" if "attention" in visattn.model_options(model_name) else "attn"
    create_model(model_name, **{key: block, "attn_kwargs": kw}, **SMALL[model_name])
    inside = [m for m in made if m[0] == block]
    assert inside, "the model built no block"
    for name, channels, kwargs, state, got in inside:
        torch.set_rng_state(state)  # the same seed as the block saw inside the model
        ref = create_attention(name, channels, **kwargs)
        ref_params, got_params = dict(ref.named_parameters()), dict(got.named_parameters())
        assert ref_params.keys() == got_params.keys()
        for key, p in ref_params.items():
            assert torch.equal(p, got_params[key]), f"{key} was re-initialised by the model"
            assert p.requires_grad == got_params[key].requires_grad, f"{key}'s trainability was changed"
        for (key, m_ref), m_got in zip(ref.named_modules(), got.modules()):
            if isinstance(m_ref, nn.modules.batchnorm._BatchNorm):
                assert (m_got.momentum, m_got.eps) == (m_ref.momentum, m_ref.eps), f"{key}'s norm options changed"


def test_the_backbone_options_still_reach_the_backbone():
    model = create_model("resnet_fast", attention="cbam", **SMALL["resnet_fast"])
    norms = [m for m in backbone_modules(model) if isinstance(m, nn.BatchNorm2d)]
    assert norms and all(not m.weight.requires_grad and m.eps == 1e-12 and m.momentum == 0.4 for m in norms)
    inner = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d) and m not in norms]
    assert inner and all(m.weight.requires_grad and m.eps == 1e-5 for m in inner)  # CBAM's spatial-gate BN
    assert all(is_attention_block(m) for m in model.modules() if isinstance(m, visattn.attention.spatial.CBAM))


def test_norm_bias_lr_scale_is_the_backbones_rule():
    model = create_model("resnet_fast", attention="spatial", **SMALL["resnet_fast"])
    opt = build_optimizer(model, "sgd", 0.1, 5e-4, norm_bias_lr_scale=64)
    fast = {id(p) for g in opt.param_groups if g.get("lr_scale", 1.0) == 64 for p in g["params"]}
    gate_bn = model.layers[0].units[0].attn.bn
    assert id(gate_bn.bias) not in fast and id(model.layers[0].bn.bias) in fast


def _x(shape=(4, 32, 8, 8)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", FEATURE)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_identity_init_returns_its_input_exactly(name, train, bf16):
    torch.manual_seed(0)
    block = create_attention(name, 32, init="identity").train(train)
    x = _x()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = block(x)
    assert torch.equal(y, x)
    xl = x.to(memory_format=torch.channels_last)
    assert torch.equal(block(xl), xl)


@pytest.mark.parametrize("name", FEATURE)
def test_identity_init_learns(name):
    torch.manual_seed(0)
    block = create_attention(name, 32, init="identity")
    x, target = _x(), torch.randn(4, 32, 8, 8, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(block.parameters(), lr=0.5)
    loss = F.mse_loss(block(x), target)
    loss.backward()
    grads = [p.grad for p in block.parameters() if p.grad is not None]
    assert grads and any(bool(g.abs().sum() > 0) for g in grads), "no gradient reaches the block"
    opt.step()
    block.eval()
    assert not torch.equal(block(x), x), "one step did not change what the block computes"


@pytest.mark.parametrize("name", ["se", "eca", "spatial", "cbam", "coord"])
def test_default_init_is_the_papers_block_and_identity_is_not(name):
    torch.manual_seed(0)
    x = _x()
    assert not torch.equal(create_attention(name, 32).eval()(x), x)
    assert create_attention(name, 32).init == "default"


def test_identity_needs_a_gate_that_is_positive_at_zero():
    with pytest.raises(ValueError, match="positive and finite at 0"):
        create_attention("se", 32, init="identity", gate_layer=nn.Tanh)
    with pytest.raises(ValueError, match="init must be one of default, identity"):
        create_attention("eca", 32, init="zero")


@pytest.mark.parametrize("name", ["se", "spatial", "coord"])
def test_identity_gates_are_recorded_on_the_gain_scale(name):
    model = nn.Sequential(create_attention(name, 32, init="identity")).eval()
    with visattn.record_attention(model) as records:
        model(_x())
    assert records and all(r.value_scale == "gain" for r in records)
    assert all(torch.allclose(r.weights, torch.ones_like(r.weights)) for r in records)  # 1 = unchanged
    assert float(scale_mod.to_unit(torch.ones(1, 2, 2), "gain")[0, 0, 0]) == 0.5  # the middle of the colour map
    assert "1 = unchanged" in scale_mod.scale_title("gain")


@pytest.mark.parametrize("name", ["se", "cbam", "nonlocal"])
def test_a_model_built_under_a_meta_device_takes_identity_init(name):
    with torch.device("meta"):
        model = create_model("resnet_fast", attention=name, attn_kwargs={"init": "identity"}, **SMALL["resnet_fast"])
    assert next(model.parameters()).is_meta


@pytest.mark.parametrize("position", sorted(resnet_mod.POSITIONS))
def test_attn_position_puts_the_block_where_it_says(position):
    torch.manual_seed(0)
    model = create_model("resnet_fast", attention="se", attn_position=position, **SMALL["resnet_fast"]).eval()
    paths = [p for p, m in model.named_modules() if isinstance(m, visattn.attention.channel.SqueezeExcite)]
    expect = {"group_act": "layers.0.attn", "unit_bn": "layers.0.units.0.attn", "unit_act": "layers.0.units.0.attn"}
    assert len(paths) == 3 and paths[0] == expect[position]
    group, seen = model.layers[0], {}
    def keep(key):
        def hook(module, inputs, output):
            seen.setdefault(key, (inputs[0], output))  # returns None: the output is left as it is
        return hook

    hooks = [m.register_forward_hook(keep(k)) for k, m in
             (("act", group.act), ("unit_bn", group.units[0].bn), ("unit_act", group.units[0].act),
              ("se", model.get_submodule(paths[0])))]
    model(torch.randn(2, 3, 32, 32))
    for h in hooks:
        h.remove()
    feeds = {"group_act": seen["act"][1], "unit_bn": seen["unit_bn"][1], "unit_act": seen["unit_act"][1]}
    assert torch.equal(seen["se"][0], feeds[position])  # the block sees the output of the layer it follows


def test_an_unknown_position_is_one_line():
    with pytest.raises(ValueError, match="attn_position must be one of unit_bn, unit_act, group_act, not 'mid'"):
        create_model("resnet_fast", attention="se", attn_position="mid")


def test_insert_attention_defaults_to_the_identity_and_keeps_the_function():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = tv.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    before = model(x)
    assert insert_mod.insert_attention(model, "cbam") == 8
    assert torch.equal(model(x), before)
    assert all(m.init == "identity" for m in model.modules() if isinstance(m, visattn.attention.spatial.CBAM))
    other = tv.models.resnet18(num_classes=10).eval()
    insert_mod.insert_attention(other, "cbam", init="default")
    assert all(m.init == "default" for m in other.modules() if isinstance(m, visattn.attention.spatial.CBAM))


@pytest.mark.parametrize("name", ["se", "eca", "cbam", "coord", "gc", "nonlocal"])
def test_timm_resnet_built_with_identity_blocks_keeps_them_the_identity(name):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnet18", num_classes=10,
                              block_args=dict(attn_layer=visattn.attn_layer(name, init="identity"))).eval()
    blocks = [m for m in model.modules() if is_attention_block(m)]
    assert len(blocks) == 8
    seen = []
    hooks = [b.register_forward_hook(lambda m, i, o: seen.append(torch.equal(i[0], o))) for b in blocks]
    model(torch.randn(2, 3, 32, 32))
    for h in hooks:
        h.remove()
    assert seen == [True] * 8  # timm's own conv init ran after the blocks were built, and zero_init_last undid it

"""The CPU recipe's levers (airbench94's, as visattn options): each does what it says."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SMOKE

from visattn import create_model
from visattn.config import load_config
from visattn.data import ImageSet, TensorLoader
from visattn.errors import ConfigError
from visattn.optim import Lookahead, StepScheduler, build_optimizer
from visattn.rundir import load_checkpoint
from visattn.trainer import run


def test_lookahead_pulls_toward_the_slow_copy_on_a_cubic_schedule():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    la = Lookahead(model, total_steps=10, every=5, decay=0.95, power=3.0)
    slow0 = [t.clone() for t in la.slow]
    with torch.no_grad():
        model[0].weight.add_(1.0)
    fast = model[0].weight.detach().clone()
    la.step(4)  # not a multiple of every: nothing happens
    assert torch.equal(model[0].weight, fast)
    la.step(5)
    a = 0.95**5 * 0.5**3
    want = a * slow0[0] + (1 - a) * fast
    torch.testing.assert_close(model[0].weight.detach(), want)
    torch.testing.assert_close(la.slow[0], want)
    assert model[1].num_batches_tracked.dtype == torch.int64  # integer buffers are not averaged
    assert len(la.slow) == len([t for t in model.state_dict().values() if t.is_floating_point()])
    with torch.no_grad():
        model[0].weight.add_(5.0)
    la.finish()
    assert torch.equal(model[0].weight.detach(), la.slow[0])


def test_lookahead_early_steps_barely_average():
    model = torch.nn.Linear(2, 2)
    la = Lookahead(model, total_steps=1000, every=5)
    with torch.no_grad():
        model.weight.fill_(1.0)
    la.step(5)  # progress 0.005: a ~ 1e-7, the fast weights are kept
    torch.testing.assert_close(model.weight.detach(), torch.ones(2, 2), atol=1e-6, rtol=0)


def _labelled_images(n=16):
    rng = np.random.default_rng(0)
    return ImageSet(rng.integers(0, 255, (n, 8, 8, 3), dtype=np.uint8), np.arange(n), tuple(str(i) for i in range(n)))


def test_alternating_flip_switches_every_image_each_epoch():
    images = _labelled_images()
    aug = load_config(None, ["data.augment.crop_padding=0", "data.augment.hflip_mode=alternate"]).data.augment
    loader = TensorLoader(images, 16, (0.5,) * 3, (0.25,) * 3, True, aug, seed=3)
    plain = TensorLoader(images, 16, (0.5,) * 3, (0.25,) * 3, True, None, seed=3)
    epochs = []
    for e in range(3):
        loader.set_epoch(e)
        plain.set_epoch(e)
        (x, y), (x0, y0) = next(iter(loader)), next(iter(plain))
        epochs.append({int(i): img for i, img in zip(y, x)})
        original = {int(i): img for i, img in zip(y0, x0)}
    flipped = sum(not torch.equal(epochs[0][i], original[i]) for i in original)
    assert 4 <= flipped <= 12  # about half mirrored in the first epoch
    for i in original:
        assert torch.equal(epochs[1][i], epochs[0][i].flip(-1))  # every image switched
        assert torch.equal(epochs[2][i], epochs[0][i])


def test_alternating_flip_needs_the_tensor_loader():
    with pytest.raises(ConfigError, match="hflip_mode=alternate needs loader=tensor"):
        load_config(None, ["data.augment.hflip_mode=alternate", "data.loader=albumentations"])


def test_batchnorm_options_and_dirac_init():
    m = create_model("resnet_fast", widths=[8, 16, 16], stem_width=8, block="plain", bn_momentum=0.4, bn_eps=1e-12,
                     bn_scale="frozen", conv_init="dirac")
    bns = [b for b in m.modules() if isinstance(b, torch.nn.BatchNorm2d)]
    assert bns and all(b.momentum == 0.4 and b.eps == 1e-12 for b in bns)
    assert all(not b.weight.requires_grad and torch.equal(b.weight, torch.ones_like(b.weight)) for b in bns)
    unit_conv = m.layers[1].units[0].conv  # 16 -> 16: the whole conv starts as the identity
    x = torch.randn(2, 16, 6, 6)
    torch.testing.assert_close(unit_conv(x), x)
    group_conv = m.layers[1].conv  # 8 -> 16: the first 8 output channels pass the input through
    x = torch.randn(2, 8, 6, 6)
    torch.testing.assert_close(group_conv(x)[:, :8], x)
    assert not torch.allclose(group_conv(x)[:, 8:], torch.zeros(2, 8, 6, 6))


@pytest.mark.parametrize("option,value", [("block", "dense"), ("bn_scale", "half"), ("conv_init", "zeros")])
def test_bad_recipe_options_are_named(option, value):
    with pytest.raises(ValueError, match=f"{option} must be one of"):
        create_model("resnet_fast", **{option: value})


def test_group_skip_adds_each_group_input_to_its_units_output():
    """airbench96's group: conv-pool-BN-GELU, then two plain convs whose output is added to that first one's."""
    kw = dict(widths=[8, 16, 16], units=[2, 2, 2], stem_width=8, block="plain")
    torch.manual_seed(0)
    plain = create_model("resnet_fast", **kw)
    torch.manual_seed(0)
    skip = create_model("resnet_fast", group_skip=True, **kw)
    assert sum(p.numel() for p in skip.parameters()) == sum(p.numel() for p in plain.parameters())
    skip.load_state_dict(plain.state_dict())
    plain.eval()
    skip.eval()
    g_plain, g_skip = plain.layers[1], skip.layers[1]
    x = torch.randn(2, 8, 8, 8)
    h = g_skip.act(g_skip.bn(g_skip.pool(g_skip.conv(x))))
    torch.testing.assert_close(g_skip(x), h + g_skip.units(h))
    torch.testing.assert_close(g_plain(x), g_plain.units(h))
    with torch.no_grad():  # the units' last BN silenced: the group with the skip returns its first conv's output
        g_skip.units[-1].bn.weight.zero_()
        g_skip.units[-1].bn.bias.zero_()
    torch.testing.assert_close(g_skip(x), h)
    assert g_skip.units(h).abs().max() == 0


@pytest.mark.parametrize("units,value,message", [([0, 1, 1], True, "at least one unit in every group"),
                                                 ([1, 1, 1], "yes", "group_skip must be true or false")])
def test_group_skip_refuses_what_it_cannot_build(units, value, message):
    with pytest.raises(ValueError, match=message):
        create_model("resnet_fast", units=units, group_skip=value)


def test_norm_biases_get_their_own_faster_group_and_schedule():
    m = create_model("resnet_fast", widths=[8, 16, 16], stem_width=8, bn_scale="frozen")
    opt = build_optimizer(m, "sgd", 0.1, 5e-4, norm_bias_lr_scale=64)
    bn_biases = {id(b.bias) for b in m.modules() if isinstance(b, torch.nn.BatchNorm2d)}
    fast = [g for g in opt.param_groups if g.get("lr_scale") == 64]
    assert len(fast) == 1 and {id(p) for p in fast[0]["params"]} == bn_biases
    sched = StepScheduler(opt, "onecycle", 0.1, total_steps=100, warmup_steps=20, start_lr_ratio=0.2)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1 * 0.2 * g.get("lr_scale", 1) for g in opt.param_groups])
    for _ in range(20):
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1 * g.get("lr_scale", 1) for g in opt.param_groups],
                                                               rel=0.02)


def test_whitening_bias_trains_in_its_epochs_only(tmp_path):
    base = [f"run_dir={tmp_path / 'run'}", "data.source=synthetic", "data.synthetic_size=240", "data.val_size=40",
            "train.batch_size=40", "train.epochs=3", "log.progress=false", "log.tensorboard=false",
            "log.maps_every=0", "model.stem=whiten", "model.whiten_bias_epochs=1", "model.widths=[8,16,16]"]
    run(load_config(SMOKE, base + ["train.max_steps=5"]), log=lambda *a: None)  # end of epoch 1
    after1 = load_checkpoint(tmp_path / "run" / "last.pt")["model"]["stem.conv.bias"]
    run(load_config(SMOKE, base + ["resume=auto"]), log=lambda *a: None)
    after3 = load_checkpoint(tmp_path / "run" / "last.pt")["model"]["stem.conv.bias"]
    assert after1.abs().sum() > 0  # it trained in epoch 1 (it starts at zero)
    assert torch.equal(after1, after3)  # and not after

"""The guard against oneDNN issue 6035 (1x1 strided convolutions with few input channels, channels-last, CPU):
its weight-gradient kernel corrupts the heap on AVX-512 and gives wrong gradients on AVX2. Every run that could
crash runs in a subprocess with a timeout, so a crash fails its test and not the suite."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import timm
import torch
from conftest import ROOT, SMOKE

import visattn
from visattn.models.layout import defective_convs, guard_message, guard_onednn, to_channels_last
from visattn.rundir import load_checkpoint

ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def _python(code: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_the_upstream_repro_through_the_guard_finishes_with_the_contiguous_gradients():
    # the shapes (input channels 4 and 8 at 64 and 80 px crash on AVX-512) and the neighbours up to 15
    proc = _python("""
        import copy, torch
        from visattn.models.layout import to_channels_last
        worst = 0.0
        for ic in (1, 4, 8, 12, 15):
            for px in (32, 64, 80):
                torch.manual_seed(ic * 100 + px)
                ref = torch.nn.Sequential(torch.nn.Conv2d(3, ic, 3, padding=1), torch.nn.Conv2d(ic, 16, 1, stride=2, bias=False))
                net = copy.deepcopy(ref)
                assert to_channels_last(net) == ["1"]
                x = torch.randn(2, 3, px, px)
                out = net(x.contiguous(memory_format=torch.channels_last))
                assert out.is_contiguous(memory_format=torch.channels_last)  # the model keeps its layout
                out.square().sum().backward()
                ref(x).square().sum().backward()
                for a, b in zip(net.parameters(), ref.parameters()):
                    worst = max(worst, ((a.grad - b.grad).abs().max() / b.grad.abs().max()).item())
        assert worst < 1e-4, worst
        print("ok", torch.backends.cpu.get_cpu_capability(), worst)
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, f"exit {proc.returncode}: {proc.stderr[-1500:]}"


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="the crash needs an AVX-512 CPU")
def test_the_guard_holds_for_a_1x1_weight_whose_strides_say_both_layouts():
    # batch 1 and a 1x1 kernel: channels-last strides pass is_contiguous(), so .contiguous() alone changes nothing
    proc = _python("""
        import torch
        from visattn.models.layout import to_channels_last
        conv = torch.nn.Conv2d(8, 16, 1, stride=2, bias=False)
        to_channels_last(conv)
        for _ in range(3):
            conv(torch.randn(1, 8, 80, 80).contiguous(memory_format=torch.channels_last)).sum().backward()
        print("ok")
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, f"exit {proc.returncode}: {proc.stderr[-1500:]}"


def test_the_guard_picks_only_the_defects_shape():
    net = torch.nn.Sequential(
        torch.nn.Conv2d(8, 16, 1, stride=2),              # the defect's shape
        torch.nn.Conv2d(16, 16, 1, stride=2),             # 16 input channels: the AVX-512 block, unaffected
        torch.nn.Conv2d(8, 16, 3, stride=2),              # a 3x3 kernel
        torch.nn.Conv2d(8, 16, 1),                        # stride 1
        torch.nn.Conv2d(32, 32, 1, stride=(1, 2), groups=4),  # 8 input channels a group, strided in one axis
    )
    assert [n for n, _ in defective_convs(net)] == ["0", "4"]
    tm = timm.create_model("resnet18", num_classes=10, channels=[8, 8, 16, 16])
    # stage 2 (8 -> 8) and 3 (8 -> 16) downsample from 8 channels at stride 2; stage 4 from 16: not
    assert [n for n, _ in defective_convs(tm)] == ["layer2.0.downsample.0", "layer3.0.downsample.0"]


def test_a_recipe_model_is_converted_exactly_as_before():
    # every recipe of this project has no such layer: the guard adds nothing to them
    for name, kw in (("resnet_fast", {}), ("resnet18", {"attention": "cbam"})):
        a = visattn.create_model(name, num_classes=10, **kw)
        b = copy.deepcopy(a)
        assert to_channels_last(a) == [] and not defective_convs(a)
        b.to(memory_format=torch.channels_last)
        assert all(not m._forward_pre_hooks and not m._forward_hooks for m in a.modules())
        assert [p.stride() for p in a.parameters()] == [p.stride() for p in b.parameters()]


def test_the_guard_keeps_parameters_state_dict_and_copies():
    tm = timm.create_model("resnet18", num_classes=10, channels=[8, 8, 16, 16])
    before = {k: v.clone() for k, v in tm.state_dict().items()}
    params = list(tm.parameters())
    names = to_channels_last(tm)
    assert guard_onednn(tm) == names  # idempotent: no second pair of hooks
    conv = tm.get_submodule(names[0])
    assert len(conv._forward_pre_hooks) == 1 and len(conv._forward_hooks) == 1
    assert list(tm.parameters()) == params  # the same objects: an optimizer built before still steps them
    assert all(torch.equal(v, before[k]) for k, v in tm.state_dict().items())
    twin = copy.deepcopy(tm)  # the EMA's copy: guarded too
    assert twin.get_submodule(names[0])._forward_pre_hooks
    tm.to(memory_format=torch.channels_last)  # a later conversion: the hook puts the weight back
    with torch.no_grad():
        tm.eval()(torch.randn(1, 3, 32, 32).contiguous(memory_format=torch.channels_last))
    assert conv.weight.stride() == (8, 1, 1, 1)
    assert "'layer2.0.downsample.0' (1x1, stride 2, 8 input channels) and 1 more" in guard_message(names, tm)
    assert "oneDNN issue 6035" in guard_message(names, tm) and guard_message([]) == ""


def test_the_shape_through_train_py_in_channels_last_steps_as_contiguous_does(tmp_path):
    # the model: a timm ResNet-18 at channels 8-16 on 80-px placed canvases, one SGD step in fp32
    base = ["--config", str(SMOKE), "model.name=timm/resnet18", "model.cifar_stem=true", "model.kwargs.channels=[8,8,16,16]",
            "model.attention=none", "data.source=placed", "data.placed.source=synthetic", "data.synthetic_size=120",
            "data.val_size=20", "train.batch_size=20", "train.max_steps=1", "precision=fp32",
            "sched.name=constant", "optim.lr=1.0", "optim.momentum=0", "optim.weight_decay=0",
            "log.maps_every=0", "log.progress=false", "log.tensorboard=false", "device=cpu", "compile=false"]
    out = {}
    for layout in ("true", "false"):
        rd = tmp_path / f"cl_{layout}"
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *base, f"channels_last={layout}", f"run_dir={rd}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
        assert proc.returncode == 0, f"channels_last={layout}: exit {proc.returncode}: {proc.stderr[-1500:]}"
        guarded = [ln for ln in proc.stdout.splitlines() if "oneDNN issue 6035" in ln]
        assert len(guarded) == (layout == "true"), proc.stdout  # the run says so, once, naming the layer
        if guarded:
            assert "'layer2.0.downsample.0'" in guarded[0]
        out[layout] = load_checkpoint(rd / "last.pt", map_location="cpu")["model"]
    # the same start (seed 0) and w1 = w0 - 1.0 * grad: equal weights after the step are equal gradients
    a, b = out["true"], out["false"]
    assert set(a) == set(b) and "layer2.0.downsample.0.weight" in a
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")

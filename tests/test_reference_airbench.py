"""The independent airbench94 reference (``bench/reference_airbench.py``): its whitening stem whitens, its
translation is a crop of the reflect-padded image, its test-time augmentation weighs six views to one, its
schedule is airbench's, and a short run on synthetic images trains and is recorded once."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT
from test_bench import _load, _script_main

ref = _load("reference_airbench")


def test_the_whitening_stem_decorrelates_2x2_patches():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 3, 16, 16, generator=g)
    x = base + 0.8 * base.roll(1, dims=-1) + 0.5 * base[:, :1]  # neighbouring pixels and channels correlated
    net = ref.Net()
    net.init_whitening(x, eps=1e-8)
    out = F.conv2d(x.double(), net.whiten.weight[:12].double())  # the 12 eigen-filters (the rest are negatives)
    flat = out.permute(1, 0, 2, 3).reshape(12, -1)
    cov = flat @ flat.T / flat.shape[1]
    assert torch.allclose(cov, torch.eye(12, dtype=cov.dtype), atol=1e-3)
    assert torch.equal(net.whiten.weight[12:], -net.whiten.weight[:12])
    assert not net.whiten.weight.requires_grad


def test_translation_is_a_crop_of_the_reflect_padded_image():
    x = torch.arange(4 * 3 * 8 * 8, dtype=torch.float32).view(4, 3, 8, 8)
    assert torch.equal(ref.translate(x, 0, torch.Generator().manual_seed(0)), x)
    out = ref.translate(x, 2, torch.Generator().manual_seed(1))
    padded = F.pad(x, (2,) * 4, mode="reflect")
    for i in range(len(x)):
        crops = [padded[i, :, dy:dy + 8, dx:dx + 8] for dy in range(5) for dx in range(5)]
        assert any(torch.equal(out[i], c) for c in crops)


def test_tta_weighs_its_six_views_to_one_and_sees_the_mirror():
    const = torch.nn.Linear(1, 10)

    def net(v):  # a constant prediction: the weighted views must return it unchanged
        return const.bias.expand(len(v), 10)

    x = torch.randn(2, 3, 8, 8)
    assert torch.allclose(ref.tta_logits(net, x), const.bias.expand(2, 10))

    def left_heavy(v):  # a net that reads only the left column: mirroring must change what it sees
        return v[:, 0, :, 0].mean(-1, keepdim=True).expand(len(v), 10)

    x = torch.zeros(1, 3, 8, 8)
    x[..., 0] = 1.0
    assert 0 < ref.tta_logits(left_heavy, x)[0, 0] < 1


def test_the_schedule_warms_up_over_23_percent_then_falls_to_7_percent():
    total = 100
    assert ref.lr_factor(0, total) == pytest.approx(0.2)
    assert ref.lr_factor(23, total) == pytest.approx(1.0)
    assert ref.lr_factor(total, total) == pytest.approx(0.07)
    assert ref.lr_factor(10, total) < ref.lr_factor(20, total) and ref.lr_factor(50, total) > ref.lr_factor(90, total)


def test_the_convs_start_as_the_identity_and_bn_scales_are_frozen():
    net = ref.Net()
    conv = net.groups[1][0]  # 64 -> 256: its first 64 output channels pass the input through
    x = torch.randn(1, 64, 5, 5)
    assert torch.allclose(conv(x)[:, :64], x, atol=1e-6)
    bns = [m for m in net.modules() if isinstance(m, ref.FrozenScaleBN)]
    assert len(bns) == 6 and all(not m.weight.requires_grad and m.bias.requires_grad for m in bns)


def test_a_short_run_on_synthetic_images_runs_end_to_end_and_refuses_too_few_images(tmp_path):
    over = ["data.source=synthetic", "data.synthetic_size=1300", "data.val_size=200"]  # 1,100: one batch an epoch
    r = ref.train(0, 1.5, "fp32", over, quality=50, log=lambda *_: None)
    assert r["epochs"] == 1.5 and r["reencoded_quality"] == 50 and 0.0 <= r["val_acc"] <= 1.0 and "validation" in r["eval_split"]
    with pytest.raises(SystemExit, match="fewer than one batch"):
        ref.train(0, 1, "fp32", ["data.source=synthetic", "data.synthetic_size=1000", "data.val_size=100"])


def _main(monkeypatch, capsys, *args) -> tuple:
    return _script_main("reference_airbench.py", monkeypatch, capsys, *args)


@pytest.mark.parametrize("epochs", ["0", "nan", "-1"])
def test_bad_epochs_exit_with_one_line(tmp_path, monkeypatch, capsys, epochs):
    res = tmp_path / "r.json"
    code, _, err = _main(monkeypatch, capsys, "--epochs", epochs, "--results", str(res))
    assert code == 2 and err.count("\n") == 1 and "--epochs must be a finite number above 0" in err
    assert not res.exists()


def test_a_row_without_its_keys_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    res = tmp_path / "r.json"
    res.write_text('[{"seed": 0, "epochs": true}]')
    code, out, err = _main(monkeypatch, capsys, "--table", "--results", str(res))
    assert code == 2 and err.count("\n") == 1 and "row 1 has true as its 'epochs'" in err and not out


def test_the_table_prints_the_recorded_runs(tmp_path, monkeypatch, capsys):
    res = tmp_path / "r.json"
    res.write_text(json.dumps([{"seed": 0, "epochs": 9.9, "precision": "bf16", "kernels": "amx", "val_acc": 0.9,
                                "train_seconds": 500.0, "images_per_s": 900.0}]))
    code, out, _ = _main(monkeypatch, capsys, "--table", "--results", str(res))
    assert code == 0 and "| as stored (JPEG q75) | 9.9 | 0 | bf16 on amx | 90.00 | 500 | 900 |" in out


def test_reencoding_loses_more_the_lower_the_quality():
    g = torch.Generator().manual_seed(0)
    smooth = F.interpolate(torch.rand(8, 3, 8, 8, generator=g), size=32, mode="bilinear")
    x = (smooth * 200 + 20 * torch.rand(8, 3, 32, 32, generator=g)).byte().permute(0, 2, 3, 1).contiguous().numpy()
    err = {q: abs(ref.reencode(x, q).astype(float) - x).mean() for q in (95, 75, 30)}
    assert ref.reencode(x, 75).shape == x.shape and ref.reencode(x, 75).dtype == x.dtype
    assert 0 < err[95] < err[75] < err[30]


def test_a_bad_quality_exits_with_one_line(tmp_path, monkeypatch, capsys):
    code, _, err = _main(monkeypatch, capsys, "--reencode", "100", "--results", str(tmp_path / "r.json"))
    assert code == 2 and err.count("\n") == 1 and "JPEG quality from 1 to 95" in err


def test_the_manuals_reference_table_is_the_one_the_results_give(monkeypatch, capsys):
    code, out, _ = _main(monkeypatch, capsys, "--table")
    assert code == 0
    doc = (ROOT / "docs" / "results.md").read_text()
    block = doc.split("<!-- reference table: python -m bench.reference_airbench --table -->\n")[1]
    block = block.split("  <!-- end of reference table -->")[0]
    assert [line.strip() for line in block.strip().splitlines()] == out.strip().splitlines()

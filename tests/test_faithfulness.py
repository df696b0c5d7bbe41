"""Faithfulness: deletion/insertion against random orders with bootstrap intervals, gradient baselines and
the model-randomisation sanity check, on a planted model whose label depends only on the region its gate
points at."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import visattn
from visattn.attention.tap import AttentionTap
from visattn.maps.faithful import auc, bootstrap

HOT = (1, 2)  # the gate's cell on a 4x4 grid of 8x8-pixel cells


class RegionModel(nn.Module):
    """Two classes decided by the mean red minus green of one 8x8 region, the one its spatial gate marks."""

    def __init__(self):
        super().__init__()
        self.tap = AttentionTap("spatial")
        self.scale = nn.Parameter(torch.tensor(100.0))  # confident: p(true) near 1 on the clean image
        gate = torch.full((1, 1, 4, 4), 0.02)
        gate[..., HOT[0], HOT[1]] = 0.98
        self.register_buffer("gate", gate)

    def forward(self, x):  # (B, 3, 32, 32)
        g = self.tap(self.gate.expand(x.shape[0], -1, -1, -1))
        region = (F.avg_pool2d(x, 8) * (g > 0.5)).sum((2, 3))  # (B, 3): the marked region's mean colour
        d = self.scale * (region[:, 0] - region[:, 1])
        return torch.stack([d, -d], 1)


def images(n=48, seed=0):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def test_planted_gate_scores_far_above_zero_and_noise_does_not():
    model = RegionModel()
    x = images()
    noise = torch.rand(x.shape[0], 4, 4, generator=torch.Generator().manual_seed(1))
    report = visattn.faithfulness(model, x, maps=None, extra_maps={"noise": noise}, steps=16, regions=8, draws=3,
                                  baselines=("input_x_gradient",), sanity=True, seed=0)
    gate, rnd, ixg = report.row("tap"), report.row("noise"), report.row("input_x_gradient")
    # deleting the marked region first destroys the prediction at once (p -> 1/2); random orders take long
    assert gate.deletion_score.lo > 0.1 and gate.insertion_score.lo > 0.1, report.table()  # zero is far out
    assert gate.deletion_curve[1] == pytest.approx(0.5, abs=0.02) and gate.deletion_curve[0] > 0.9
    assert rnd.deletion_score.lo < 0 < rnd.deletion_score.hi, report.table()
    assert rnd.insertion_score.lo < 0 < rnd.insertion_score.hi, report.table()
    assert ixg.deletion_score.lo > 0.1  # the gradient is non-zero in the marked region only
    # the gate is a constant: re-initialising the weights leaves it as it was, and the check says so
    assert gate.sanity_rho == pytest.approx(1.0)
    text = report.table()
    assert "tap" in text and "noise" in text and "sanity" in text


def test_curves_areas_and_bootstrap_are_computed_as_stated():
    model = RegionModel()
    report = visattn.faithfulness(model, images(16), steps=4, regions=4, draws=2, baselines=(), sanity=False,
                                  bootstrap_draws=200)
    row = report.row("tap")
    assert len(row.deletion_curve) == 5 and len(report.random_deletion_curve) == 5
    assert row.deletion_auc == pytest.approx(float(auc(torch.tensor(row.deletion_curve))), abs=1e-6)
    assert row.insertion_curve[-1] == pytest.approx(row.deletion_curve[0], abs=1e-6)  # all back = the image
    assert row.deletion_curve[-1] == pytest.approx(row.insertion_curve[0], abs=1e-6)  # all gone = the fill
    ci = bootstrap(torch.tensor([1.0, 2.0, 3.0, 4.0]), draws=500, confidence=0.9)
    assert ci.mean == 2.5 and 1.0 <= ci.lo < 2.5 < ci.hi <= 4.0
    assert bootstrap(torch.full((5,), 0.3)).lo == pytest.approx(0.3)


def test_randomisation_check_and_gradcam_on_a_real_model():
    torch.manual_seed(0)
    model = visattn.create_model("resnet_fast", num_classes=10, widths=(8, 16, 16), attention="spatial")
    x = images(8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    report = visattn.faithfulness(model, x, steps=4, regions=4, draws=1, bootstrap_draws=100, fill="blur")
    names = [r.name for r in report.rows]
    layers = [f"layers.{i}.units.0.attn" for i in range(3)]
    # each gate, then its gradient-weighted map (gradient_maps=True by default), the three stages' gradient maps
    # joined on the pixels, then the baselines
    assert names == ([n for layer in layers for n in (layer, f"{layer}/grad")]
                     + ["layers_grad", "input_x_gradient", "gradcam", "centre"])
    for r in report.rows:
        assert r.sanity_rho is not None and (math.isnan(r.sanity_rho) or -1.0 <= r.sanity_rho <= 1.0)
        assert all(0.0 <= p <= 1.0 for p in r.deletion_curve + r.insertion_curve)
    # learned maps change when the weights are re-initialised: not all of them can keep their ranking
    assert min(r.sanity_rho for r in report.rows if not math.isnan(r.sanity_rho)) < 0.9
    assert model.training and all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all(p.grad is None for p in model.parameters())


def test_validates_options():
    with pytest.raises(ValueError, match="fill"):
        visattn.faithfulness(RegionModel(), images(2), fill="zero")
    with pytest.raises(ValueError, match="steps"):
        visattn.faithfulness(RegionModel(), images(2), steps=0)


@pytest.mark.parametrize("attention", ["cbam", "gc"])
def test_gradcam_explains_the_backbones_last_convolution_not_a_gates(attention):
    """CBAM's 7x7 gate conv and GC's context conv run after the backbone's last conv; Grad-CAM must still use
    the backbone's (an identity-initialised gate's zero conv would give a constant map: random order)."""
    from visattn.maps.faithful import gradient_map

    torch.manual_seed(0)
    model = visattn.create_model("resnet_fast", num_classes=10, widths=(8, 16, 16), attention=attention, block="plain",
                                 attn_kwargs={"init": "identity"}).eval()  # plain: the last conv is on the path
    x = images(8)
    with torch.no_grad():
        labels = model(x).argmax(1)  # the predicted class: the evidence for it is mostly positive
    feats = {}
    last = model.layers[2].units[0].conv  # the backbone's last convolution
    handle = last.register_forward_hook(lambda m, a, out: feats.update(act=out))
    try:
        xx = x.clone().requires_grad_(True)
        logits = model(xx)
        g = torch.autograd.grad(logits.gather(1, labels[:, None]).sum(), feats["act"])[0]
    finally:
        handle.remove()
    expected = torch.relu((g.mean((2, 3), keepdim=True) * feats["act"].detach()).sum(1))
    cam = gradient_map(model, x, labels, "gradcam")
    assert expected.flatten(1).std(1).max() > 0  # a map that ranks regions, so the comparison can fail
    torch.testing.assert_close(cam.heat, expected)


def test_the_centre_prior_ignores_model_and_image_and_scores_by_where_the_evidence_lies():
    """The ``centre`` baseline: one centred Gaussian for every image (sigma a quarter of the shorter side), so
    the sanity check gives rho 1; it beats random orders when the class evidence is in the middle and loses
    to them when it is in a corner."""
    from visattn.maps.faithful import centre_prior

    prior = centre_prior((32, 48), 3)
    assert prior.name == "centre" and prior.heat.shape == (3, 32, 48) and torch.equal(prior.heat[0], prior.heat[2])
    peak = divmod(int(prior.heat[0].argmax()), 48)
    assert peak in {(15, 23), (15, 24), (16, 23), (16, 24)}
    assert torch.allclose(prior.heat[0], prior.heat[0].flip(0)) and torch.allclose(prior.heat[0], prior.heat[0].flip(1))
    # sigma = 32 / 4 = 8 px, centred at column 23.5: the ratio of two values on a row follows
    row = prior.heat[0, 15]
    assert float(row[23] / row[15]) == pytest.approx(math.exp(((15 - 23.5) ** 2 - (23 - 23.5) ** 2) / (2 * 8 ** 2)))

    class Looks(nn.Module):  # the class-0 logit is the mean brightness of one 8x8 square
        def __init__(self, ys: slice, xs: slice):
            super().__init__()
            self.ys, self.xs = ys, xs
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x):
            s = (x[:, :, self.ys, self.xs].mean((1, 2, 3)) - 1.0) * self.w * 4
            return torch.stack([s, -s], 1)

    x = torch.rand(24, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    x[:, :, 12:20, 12:20] = x[:, :, :8, :8] = 2.0  # both squares bright in every image; the fill is the mean colour
    kw = dict(steps=8, regions=4, draws=3, bootstrap_draws=200, baselines=("centre",), maps=[], sanity=True)
    middle = visattn.faithfulness(Looks(slice(12, 20), slice(12, 20)), x, torch.zeros(24, dtype=torch.long), **kw)
    corner = visattn.faithfulness(Looks(slice(0, 8), slice(0, 8)), x, torch.zeros(24, dtype=torch.long), **kw)
    m, c = middle.row("centre"), corner.row("centre")
    assert m.deletion_score.lo > 0 and m.insertion_score.lo > 0
    assert c.deletion_score.hi < 0 and c.insertion_score.hi < 0
    assert m.sanity_rho == pytest.approx(1.0)

    # the printed table pairs every map against the prior: a map on the corner square is above the prior for the
    # model that reads the corner and below it for the one that reads the middle
    on_corner = torch.zeros(24, 4, 4)
    on_corner[:, 0, 0] = 1.0
    kw.update(extra_maps={"corner map": on_corner}, sanity=False)
    for model, verdict in ((Looks(slice(0, 8), slice(0, 8)), "above on both"),
                           (Looks(slice(12, 20), slice(12, 20)), "below on both")):
        report = visattn.faithfulness(model, x, torch.zeros(24, dtype=torch.long), **kw)
        d, i = report.versus("corner map", "centre")
        section = report.table().split("paired against the centre prior")[1]
        row = next(line for line in section.splitlines() if line.startswith("corner map"))
        assert str(d) in row and str(i) in row and row.endswith(verdict), row
        assert not any(line.startswith("centre") for line in section.splitlines())  # the prior is not paired with itself


def test_versus_compares_two_maps_image_by_image():
    """``report.versus(a, b)``: a's scores minus b's on the same images and random orders, so a map against
    itself is exactly zero, and the means are the difference of the rows' means."""
    torch.manual_seed(0)
    model = visattn.create_model("resnet_fast", num_classes=10, widths=(8, 16, 16), attention="spatial").eval()
    report = visattn.faithfulness(model, images(8), steps=4, regions=4, draws=1, bootstrap_draws=100, sanity=False)
    d, i = report.versus("centre", "centre")
    assert (d.mean, d.lo, d.hi, i.mean, i.lo, i.hi) == (0.0,) * 6
    d, i = report.versus("input_x_gradient", "centre")
    ixg, centre = report.row("input_x_gradient"), report.row("centre")
    assert d.mean == pytest.approx(ixg.deletion_score.mean - centre.deletion_score.mean, abs=1e-9)
    assert i.mean == pytest.approx(ixg.insertion_score.mean - centre.insertion_score.mean, abs=1e-9)
    assert d.lo <= d.mean <= d.hi and i.lo <= i.mean <= i.hi
    with pytest.raises(KeyError, match="no map named nope"):
        report.versus("nope", "centre")
    assert "per_image" not in report.as_dict()
    no_prior = visattn.faithfulness(model, images(8), steps=4, regions=4, draws=1, bootstrap_draws=100, sanity=False,
                                    baselines=("input_x_gradient",))
    assert "paired against the centre prior" in report.table() and "paired against" not in no_prior.table()


def test_an_unknown_baseline_is_named_and_the_centre_is_not_a_gradient_map():
    from visattn.maps.faithful import baseline_map, gradient_map

    model = visattn.create_model("resnet_fast", num_classes=10, widths=(8, 16, 16), attention="spatial").eval()
    x, y = images(2), torch.tensor([0, 1])
    assert baseline_map(model, x, y, "centre").name == "centre"
    with pytest.raises(ValueError, match=r"unknown baseline 'nope'; valid: input_x_gradient, gradcam, centre$"):
        baseline_map(model, x, y, "nope")
    with pytest.raises(ValueError, match=r"unknown gradient map 'centre'; valid: input_x_gradient, gradcam$"):
        gradient_map(model, x, y, "centre")

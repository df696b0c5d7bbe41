"""An honest colour scale: each map kind is drawn on its declared, fixed range, so a flat map looks flat,
uniform attention has one colour, and every picture says what its colours mean (colour bar, caption)."""
import numpy as np
import pytest
import torch
from torch import nn

from visattn.attention.tap import AttentionTap
from visattn.maps import MapSettings, colorize, log_attention_maps, overlay, read_maps, record_attention
from visattn.maps.render import GAP, caption, colour_bar, images_to_float, map_stats, ticks, to_uint8, to_unit

LUT = {}


def lut_levels(pixels: np.ndarray, colormap: str = "jet") -> tuple:
    """Nearest colour-map index (0-255) of each RGB pixel ``(..., 3)`` and its distance to that colour."""
    if colormap not in LUT:
        LUT[colormap] = colorize(torch.linspace(0, 1, 256), colormap) * 255
    d = torch.cdist(torch.as_tensor(pixels, dtype=torch.float32).reshape(-1, 3), LUT[colormap])
    dist, idx = d.min(1)
    return idx.view(pixels.shape[:-1]).numpy(), dist.view(pixels.shape[:-1]).numpy()


class Gate(nn.Module):
    """A spatial gate with planted values ``values`` (h, w), the same for every image."""

    def __init__(self, values):
        super().__init__()
        self.values = values
        self.tap = AttentionTap("spatial")

    def forward(self, x):  # (B, C, H, W) with H, W = values' shape
        g = self.values.expand(x.shape[0], 1, *self.values.shape).clone()
        return x * self.tap(g)


class UniformTokens(nn.Module):
    """Token attention that is exactly uniform over all N = 1 + h*w tokens, class token first."""

    def __init__(self, grid=(4, 4)):
        super().__init__()
        self.grid = grid
        self.proj = nn.Conv2d(3, 8, 8, stride=8)
        self.tap = AttentionTap("token")

    def forward(self, x):
        t = self.proj(x).flatten(2).transpose(1, 2)  # (B, 16, 8)
        t = torch.cat([t.mean(1, keepdim=True), t], 1)
        n = t.shape[1]
        attn = self.tap(torch.full((x.shape[0], 2, n, n), 1.0 / n), grid=self.grid, num_prefix_tokens=1)
        return (attn.mean(1) @ t)[:, 0]


def gate_values(lo=0.48, hi=0.53, hw=(8, 8)):
    return torch.linspace(lo, hi, hw[0] * hw[1]).view(hw)


def find_tile(picture: np.ndarray, tile: np.ndarray) -> tuple:
    h, w = tile.shape[:2]
    for y in range(picture.shape[0] - h + 1):
        for x in range(picture.shape[1] - w + 1):
            if np.array_equal(picture[y : y + h, x : x + w], tile):
                return y, x
    raise AssertionError("tile not found")


def test_gate_from_048_to_053_spans_a_tenth_of_the_colour_map_at_most():
    model = Gate(gate_values())
    images = torch.rand(2, 3, 8, 8)
    with torch.no_grad(), record_attention(model) as rec:
        model(images)
    (lm,) = read_maps(rec.records, model, images.shape)
    assert lm.scale == "gate"
    levels, dist = lut_levels(overlay(images, lm, alpha=1.0, size=64).permute(0, 2, 3, 1).numpy())
    assert dist.max() < 2  # alpha 1: the pixels are colour-map colours
    assert levels.max() - levels.min() <= 25.6  # at most a tenth of the 256 levels
    assert levels.min() >= 0.47 * 255 and levels.max() <= 0.54 * 255  # where 0.48-0.53 sits on [0, 1]
    stretched, _ = lut_levels(overlay(images, lm, alpha=1.0, size=64, norm="per_image").permute(0, 2, 3, 1).numpy())
    assert stretched.max() - stretched.min() > 240  # the explicit per-image option stretches it end to end


def test_gate_through_the_logger_stays_within_a_tenth():
    model = Gate(gate_values())
    images = torch.rand(1, 3, 8, 8)
    pictures = {}

    class Writer:
        def add_image(self, tag, img, step, dataformats):
            pictures[tag] = img

        def add_text(self, *a):
            pass

        def add_scalar(self, *a):
            pass

    log_attention_maps(Writer(), model, images, None, 0, MapSettings(scale=4, alpha=1.0))
    pic = pictures["maps/tap"]  # a tap on the model itself is named "tap"
    original = to_uint8(images_to_float(images, size=(32, 32)))[0].permute(1, 2, 0).numpy()
    y, x = find_tile(pic, original)
    over = pic[y : y + 32, x + 32 + GAP : x + 64 + GAP]
    levels, dist = lut_levels(over)
    assert dist.max() < 2 and levels.max() - levels.min() <= 25.6


def test_uniform_attention_renders_as_the_uniform_colour():
    model = UniformTokens()
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad(), record_attention(model) as rec:
        model(images)
    maps = read_maps(rec.records, model, images.shape)
    assert {m.name for m in maps} == {"tap", "rollout"}
    uniform = (colorize(torch.tensor([0.5]))[0] * 255).round()
    for lm in maps:
        # the class-token row: each weight 1/17, times 17 keys; the rollout: the grid's share of the flow,
        # 1/16 a cell, times 16 cells: exactly x1 = uniform either way
        assert lm.scale == "relative" and lm.keys == {"tap": 17, "rollout": 16}[lm.name]
        assert torch.allclose(lm.unit(), torch.full_like(lm.unit(), 0.5), atol=1e-6), lm.name
        pic = overlay(torch.zeros(2, 3, 32, 32), lm, alpha=1.0).permute(0, 2, 3, 1).float()
        assert (pic - uniform).abs().max() <= 1, lm.name
        st = lm.stats()[0]
        assert st.lo == pytest.approx(1.0, abs=1e-5) and st.hi == pytest.approx(1.0, abs=1e-5)
        assert st.entropy == pytest.approx(1.0, abs=1e-6)


def test_relative_scale_is_log_and_saturates():
    keys = 64
    w = torch.tensor([[[1 / keys, 2 / keys, 8 / keys, 100 / keys, 1 / (8 * keys), 0.0]]])
    u = to_unit(w, "relative", keys)[0, 0]
    assert u[0] == pytest.approx(0.5) and u[1] == pytest.approx(0.5 + 1 / 6)
    assert u[2] == pytest.approx(1.0) and u[3] == 1.0 and u[4] == pytest.approx(0.0) and u[5] == 0.0
    positions = dict((label, t) for t, label in ticks("relative"))
    assert positions["1"] == 0.5 and positions["1/8"] == 0.0 and positions["8x"] == 1.0
    assert [label for _, label in ticks("gate")] == ["0", "0.25", "0.5", "0.75", "1"]


def test_caption_states_range_and_peakedness():
    one_hot = torch.zeros(1, 4, 4)
    one_hot[0, 1, 2] = 1.0
    (st,) = map_stats(one_hot, "relative", 16)
    assert st.hi == pytest.approx(16.0) and st.entropy == pytest.approx(0.0, abs=1e-6)
    assert caption(st, "relative") == "x0.00-16.0  H 0.00"
    (gate,) = map_stats(gate_values()[None], "gate")
    assert caption(gate, "gate") == "0.48-0.53  max/mean 1.05"


@pytest.mark.parametrize("scale,norm", [("gate", "fixed"), ("relative", "fixed"), ("gate", "per_image")])
def test_colour_bar_runs_the_colour_map_with_ticks(scale, norm):
    bar = colour_bar(200, scale, norm)
    levels, dist = lut_levels(bar)
    rows = [r for r in range(bar.shape[0]) if (dist[r] < 2).sum() > 150]
    assert rows, "no colour-map row"
    strip = levels[rows[0]][dist[rows[0]] < 2]
    assert strip[0] <= 2 and strip[-1] >= 253 and (np.diff(strip.astype(int)) >= 0).all()
    assert (bar[rows[-1] + 1 :] > 200).any()  # tick marks and labels below the bar


def test_each_gates_mean_goes_to_tensorboard_and_falls_when_the_gate_closes():
    """``gates/<layer>/mean`` (and ``/std``) each logging step: an identity CBAM's gates at 1 (gain), and a spatial
    gate pushed shut (its BN's shift at -6: gain 2 sigmoid(-6) = 0.005) shows as a mean near 0."""
    import visattn

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), visattn.create_attention("cbam", 8, init="identity"),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10)).eval()
    seen = {}

    class Writer:
        def add_scalar(self, tag, value, step):
            seen[tag] = value

        def add_image(self, *a, **k):
            pass

        add_histogram = add_text = add_image

    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    summary = log_attention_maps(Writer(), net, x, None, 0, MapSettings())
    spatial = next(t for t in seen if t.startswith("gates/") and "spatial" in t and t.endswith("/mean"))
    channel = next(t for t in seen if t.startswith("gates/") and "channel" in t and t.endswith("/mean"))
    assert seen[spatial] == pytest.approx(1.0, abs=1e-6) and seen[channel] == pytest.approx(1.0, abs=1e-6)
    assert spatial in summary["scalars"] and spatial.replace("/mean", "/std") in seen
    with torch.no_grad():
        net[1].spatial.bn.bias.fill_(-6.0)
    log_attention_maps(Writer(), net, x, None, 1, MapSettings())
    assert seen[spatial] < 0.01 and seen[channel] == pytest.approx(1.0, abs=1e-6)

"""True placement: each map cell is drawn over the input pixels it sees.

The reference is measured, not derived: the receptive field of a feature-map cell is the set of input
pixels with a non-zero gradient, found by autograd on a large canvas (so interior cells are not clipped by
the image border), with every max-pool swapped for an average pool of the same window (same receptive
field, but the gradient reaches every pixel of the window, not only the argmax) and every BatchNorm scale
set to one (zero-initialised residual branches would otherwise hide their convolutions). The centre of that
field's bounding box, for two neighbouring interior cells, gives the grid's stride and offset; the planted
hot cell of the real 32x32 model must then show up on the overlay within half a pixel of it.
"""
import copy

import pytest
import torch
from torch import nn

import visattn
from visattn.maps import ConvGeometry, GridGeometry, colorize, overlay, read_maps, record_attention, trace_geometry

SCALE = 8  # display pixels per input pixel: an eighth of a pixel of resolution for the hot spot


def measurable(model: nn.Module) -> nn.Module:
    """A copy whose gradients reach the whole receptive field (see the module docstring)."""
    twin = copy.deepcopy(model).eval()
    for name, m in list(twin.named_modules()):
        if isinstance(m, nn.MaxPool2d):
            parent = twin.get_submodule(name.rsplit(".", 1)[0]) if "." in name else twin
            setattr(parent, name.rsplit(".", 1)[-1], nn.AvgPool2d(m.kernel_size, m.stride, m.padding))
        if isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
    return twin


def measured_axis_geometry(features, canvas: int = 160):
    """(stride, offset) per axis of the map ``features(x) -> (1, C, h, w)`` from two interior cells."""
    x = torch.randn(1, 3, canvas, canvas, requires_grad=True)
    f = features(x)
    h, w = f.shape[-2:]
    centres = []
    for i, j in ((h // 2, w // 2), (h // 2 + 1, w // 2 + 1)):
        (g,) = torch.autograd.grad(f[0, :, i, j].sum(), x, retain_graph=True)
        ys, xs = torch.nonzero(g[0].abs().sum(0) > 0, as_tuple=True)
        assert ys.min() > 0 and xs.min() > 0 and ys.max() < canvas - 1 and xs.max() < canvas - 1, "field clipped"
        centres.append(((float(ys.min()) + float(ys.max())) / 2, (float(xs.min()) + float(xs.max())) / 2))
    (y0, x0), (y1, x1) = centres
    i0, j0 = h // 2, w // 2
    return (y1 - y0, x1 - x0), (y0 - (y1 - y0) * i0, x0 - (x1 - x0) * j0)


def hot_spot(picture: torch.Tensor, colormap: str) -> tuple:
    """Input-pixel coordinates of the hottest colour on an alpha=1 overlay ``(3, H, W)`` uint8."""
    lut = (colorize(torch.linspace(0, 1, 256), colormap) * 255)  # (256, 3)
    px = picture.permute(1, 2, 0).reshape(-1, 3).float()
    level = torch.cdist(px, lut).argmin(1).view(picture.shape[1:])  # colour-map index of each pixel
    ys, xs = torch.nonzero(level == level.max(), as_tuple=True)
    to_input = lambda v: (float(v.float().mean()) + 0.5) / SCALE - 0.5  # noqa: E731
    return to_input(ys), to_input(xs)


def planted_overlay(model, layer_map_name, plant, hot, colormap="inferno"):
    x = torch.randn(2, 3, 32, 32)
    handle = plant(hot)
    try:
        with torch.no_grad(), record_attention(model) as rec:
            model.eval()(x)
    finally:
        handle.remove()
    lm = next(m for m in read_maps(rec.records, model, x.shape) if m.name == layer_map_name)
    assert lm.geometry.exact
    pic = overlay(torch.zeros(2, 3, 32, 32, dtype=torch.uint8), lm, alpha=1.0, colormap=colormap, size=32 * SCALE)
    return hot_spot(pic[0], colormap), lm


def test_resnet_fast_whitening_stem_hot_spot_on_its_receptive_field():
    torch.manual_seed(0)
    model = visattn.create_model("resnet_fast", num_classes=10, widths=(8, 8, 8), attention="spatial", stem="whiten")
    block = model.layers[2].units[0].attn  # the last stage's gate: a 3x3 grid that sees pixels 0-24 only

    def plant(hot):
        def force(m, args, out):
            g = torch.zeros_like(out)
            g[:, :, hot[0], hot[1]] = 1.0
            return g
        return block.gate.register_forward_hook(force)

    feats = {}
    twin = measurable(model)
    twin.layers[2].units[0].attn.register_forward_pre_hook(lambda m, a: feats.__setitem__("x", a[0]))

    def features(x):
        twin(x)
        return feats["x"]

    stride, offset = measured_axis_geometry(features)
    for hot in [(2, 1), (0, 2)]:
        (y, x), lm = planted_overlay(model, "layers.2.units.0.attn", plant, hot)
        assert lm.geometry.size == (3, 3)
        expect = (offset[0] + stride[0] * hot[0], offset[1] + stride[1] * hot[1])
        assert abs(y - expect[0]) <= 0.5 and abs(x - expect[1]) <= 0.5, (hot, (y, x), expect)
        stretched = ((hot[0] + 0.5) * 32 / 3 - 0.5, (hot[1] + 0.5) * 32 / 3 - 0.5)
        assert max(abs(y - stretched[0]), abs(x - stretched[1])) > 2  # the old placement would have failed


def test_cct_2_hot_spot_on_its_receptive_field():
    torch.manual_seed(0)
    model = visattn.create_model("cct_2", num_classes=10, dim=32, num_heads=2)

    def plant(hot):  # tokens before sequence pooling: zero but the hot one, which scores 30 more
        def force(m, args, out):
            w = model.seq_pool.attention_pool.weight[0]
            tokens = torch.zeros_like(out)
            tokens[:, hot[0] * 8 + hot[1]] = 30.0 * w / w.dot(w)  # no class token: N = 8x8
            return tokens
        return model.norm.register_forward_hook(force)

    twin = measurable(model)
    stride, offset = measured_axis_geometry(lambda x: twin.tokenizer.layers(x))
    for hot in [(5, 2), (1, 6)]:
        (y, x), lm = planted_overlay(model, "seq_pool", plant, hot)
        assert lm.geometry.size == (8, 8) and lm.scale == "relative"
        expect = (offset[0] + stride[0] * hot[0], offset[1] + stride[1] * hot[1])
        assert abs(y - expect[0]) <= 0.5 and abs(x - expect[1]) <= 0.5, (hot, (y, x), expect)
        assert max(abs(y - (4 * hot[0] + 1.5)), abs(x - (4 * hot[1] + 1.5))) >= 1.0  # stretched: 1.5 px off


@pytest.mark.parametrize("name,kwargs,block", [
    ("resnet_fast", dict(widths=(8, 8, 8), attention=["none", "cbam", "none"]), "layers.1.units.0.attn.spatial"),
    ("resnet_fast", dict(widths=(8, 8, 8), attention="coord", stem="whiten"), "layers.0.units.0.attn"),
    ("resnet18", dict(attention=["none", "spatial", "none", "none"]), "layers.1.0.attn"),
])
def test_traced_geometry_matches_measured_receptive_field(name, kwargs, block):
    torch.manual_seed(0)
    model = visattn.create_model(name, num_classes=10, **kwargs)
    geo = trace_geometry(model, (3, 32, 32)).lookup(_grid_of(model, block), block, 0)
    owner = block.removesuffix(".spatial")
    feats = {}
    twin = measurable(model)
    twin.get_submodule(owner).register_forward_pre_hook(lambda m, a: feats.__setitem__("x", a[0]))

    def features(x):
        twin(x)
        return feats["x"]

    stride, offset = measured_axis_geometry(features)
    assert geo.exact
    assert geo.stride == pytest.approx(stride) and geo.offset == pytest.approx(offset)


def _grid_of(model, block):
    with torch.no_grad(), record_attention(model) as rec:
        model.eval()(torch.zeros(1, 3, 32, 32))
    r = next(r for r in rec.records if r.name == block)
    return tuple(r.weights.shape[-2:])


class Patchify(nn.Module):
    """A tokenizer visattn cannot follow (a reshape), declaring its geometry as the conv it equals."""

    visattn_geometry = ConvGeometry(kernel=4, stride=4)

    def forward(self, x):  # (B, C, 32, 32) -> (B, 64, 16 * C)
        b, c, h, w = x.shape
        return x.reshape(b, c, h // 4, 4, w // 4, 4).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 4) * (w // 4), -1)


class CroppedTokens(nn.Module):
    def __init__(self, declare: bool):
        super().__init__()
        self.patch = Patchify() if declare else nn.Identity()
        self.declare = declare
        self.attn = visattn.create_attention("mhsa", 48, num_heads=2, grid=(8, 8))

    def forward(self, x):
        x = nn.functional.pad(x, (0, 0, 0, 0))  # a followed call on the full image
        if not self.declare:
            b, c, h, w = x.shape
            x = x.reshape(b, c, 8, 4, 8, 4).permute(0, 2, 4, 1, 3, 5).reshape(b, 64, -1)
        else:
            x = self.patch(x)
        return self.attn(x).mean(1)


def test_declared_geometry_of_an_outside_module():
    declared = trace_geometry(CroppedTokens(True), (3, 32, 32)).lookup((8, 8), "attn", 0)
    assert declared.exact and declared.stride == (4, 4) and declared.offset == (1.5, 1.5)
    unknown = trace_geometry(CroppedTokens(False), (3, 32, 32)).lookup((8, 8), "attn", 0)
    assert not unknown.exact and "stretched" in unknown.describe()


def test_place_covers_only_what_cells_see():
    geo = GridGeometry((3, 3), (8.0, 8.0), (4.0, 4.0), (67.0, 67.0))  # the whitening stem's last stage
    values = torch.zeros(1, 3, 3)
    values[0, 2, 1] = 1.0
    from visattn.maps.geometry import place

    out, covered = place(values, geo, (32, 32))
    assert covered[:25, :25].all() and not covered[25:, :].any() and not covered[:, 25:].any()
    assert divmod(int(out[0].argmax()), 32) == (20, 12)


class UnfoldTokens(nn.Module):
    """Patches cut with F.unfold (followed), after a Tensor.unfold that is not a patching at all (ignored)."""

    def __init__(self):
        super().__init__()
        self.attn = visattn.create_attention("mhsa", 48, num_heads=2, grid=(7, 7))

    def forward(self, x):  # (B, 3, 32, 32)
        _ = x.unfold(2, 3, 1)  # a sliding window along rows: (B, 3, 30, 32, 3), no grid of its own
        tokens = nn.functional.unfold(x, kernel_size=8, stride=4, padding=0).transpose(1, 2)  # (B, 49, 192)
        return self.attn(tokens[..., :48]).mean(1)


def test_functional_unfold_patches_are_followed():
    geo = trace_geometry(UnfoldTokens(), (3, 32, 32)).lookup((7, 7), "attn", 0)
    assert geo.exact and geo.stride == (4, 4) and geo.offset == (3.5, 3.5) and geo.field == (8, 8)

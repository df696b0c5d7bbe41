"""Attention maps: recorder, heatmaps, rollout and overlays, on tiny modules with planted attention.

The modules here own their own ``AttentionTap``s so these tests do not depend on the real blocks. Planted
patterns sit on non-square grids and off the centre, so an H/W swap, a flip or a class-token off-by-one
moves the hot spot and fails the test.
"""
import math

import pytest
import torch
from torch import nn

import visattn
from visattn.attention.tap import AttentionRecord, AttentionTap
from visattn.maps import (
    attention_rollout,
    colorize,
    overlay,
    record_attention,
    spatial_heatmap,
)
from visattn.maps.kinds import kind_of


def argmax2d(m: torch.Tensor):
    """(h, w) -> (row, col) of the maximum."""
    i = int(m.flatten().argmax())
    return divmod(i, m.shape[-1])


# --------------------------------------------------------------------------------------------- modules


class PlantedSpatial(nn.Module):
    """Spatial gate on a (h, w) map, hottest at ``hot``; multiplies the input like a real gate."""

    def __init__(self, hot=(2, 5)):
        super().__init__()
        self.hot = hot
        self.tap = AttentionTap("spatial")

    def forward(self, x):  # (B, C, h, w)
        gate = 0.1 + 0.3 * torch.sigmoid(x.mean(1, keepdim=True))  # (B, 1, h, w) in (0.1, 0.4)
        gate = gate.clone()
        gate[:, :, self.hot[0], self.hot[1]] = 0.9
        return x * self.tap(gate)


class PlantedChannel(nn.Module):
    def __init__(self):
        super().__init__()
        self.tap = AttentionTap("channel")

    def forward(self, x):
        gate = torch.sigmoid(x.mean((2, 3)))  # (B, C)
        return x * self.tap(gate)[:, :, None, None]


class PlantedTokens(nn.Module):
    """Token mixing on ``grid`` with ``prefix`` prefix tokens; attention planted on one grid token.

    With a class token, only the class-token row is planted (other rows are random), so the map must
    come from row 0; without one, every query attends mostly to the planted token.
    """

    def __init__(self, grid=(3, 5), prefix=1, hot=(1, 3), heads=2):
        super().__init__()
        self.grid, self.prefix, self.hot, self.heads = grid, prefix, hot, heads
        self.tap = AttentionTap("token")

    def forward(self, x):  # (B, N, D)
        b, n, _ = x.shape
        t = self.prefix + self.hot[0] * self.grid[1] + self.hot[1]
        logits = torch.randn(b, self.heads, n, n, generator=torch.Generator().manual_seed(0)) * 0.1
        if self.prefix:
            logits[:, :, 0, t] += 6.0
        else:
            logits[:, :, :, t] += 6.0
        attn = logits.softmax(-1)  # (B, heads, N, N)
        attn = self.tap(attn, grid=self.grid, num_prefix_tokens=self.prefix)
        return x + attn.mean(1) @ x


class PlantedPool(nn.Module):
    """Sequence pooling (CCT) with its weight planted on one grid token."""

    def __init__(self, grid=(4, 3), hot=(3, 0)):
        super().__init__()
        self.grid, self.hot = grid, hot
        self.tap = AttentionTap("pool")

    def forward(self, x):  # (B, N, D) -> (B, D)
        logits = torch.zeros(x.shape[:2])
        logits[:, self.hot[0] * self.grid[1] + self.hot[1]] = 5.0
        w = self.tap(logits.softmax(-1), grid=self.grid, num_prefix_tokens=0)
        return (w[:, :, None] * x).sum(1)


class Nested(nn.Module):
    """Taps at depth, and a forward order that differs from the definition order."""

    def __init__(self):
        super().__init__()
        self.stage = nn.Sequential(nn.Conv2d(3, 4, 1), PlantedChannel())
        self.gate = PlantedSpatial(hot=(1, 1))
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        x = self.gate(self.bn(torch.cat([x, x[:, :1]], 1)))  # gate runs first
        return self.stage[1](x)


# --------------------------------------------------------------------------------------------- recorder


def test_recorder_names_kinds_and_call_order():
    model = Nested()
    with record_attention(model) as rec:
        model(torch.randn(2, 3, 4, 4))
    assert [r.name for r in rec.records] == ["gate", "stage.1"]
    assert [r.kind for r in rec.records] == ["spatial", "channel"]
    assert rec.taps == {"stage.1": "channel", "gate": "spatial"}
    assert list(rec.by_name()) == ["gate", "stage.1"]
    assert [r.name for r in rec.by_kind("channel")] == ["stage.1"]
    assert rec.records[0].weights.shape == (2, 1, 4, 4)
    assert rec.records[1].weights.shape == (2, 4)
    rec.clear()
    assert len(rec) == 0
    with pytest.raises(ValueError, match="kind"):
        rec.by_kind("nope")


def test_recorder_restores_taps_on_exit_and_exception():
    model = Nested()
    taps = [m for m in model.modules() if isinstance(m, AttentionTap)]
    with record_attention(model):
        assert all(t.active for t in taps)
    assert all(t.sink is None and t.record_name == "" for t in taps)
    with pytest.raises(RuntimeError, match="boom"):
        with record_attention(model):
            raise RuntimeError("boom")
    assert all(t.sink is None and t.record_name == "" for t in taps)


def test_recorder_keeps_outputs_mode_and_weights():
    torch.manual_seed(0)
    model = Nested().train()
    model.stage[0].eval()  # a deliberately mixed mode must survive too
    x = torch.randn(2, 3, 5, 7)
    model_eval = Nested()
    model_eval.load_state_dict(model.state_dict())
    model_eval.eval()
    ref = model_eval(x)
    with record_attention(model_eval) as rec:
        got = model_eval(x)
    assert len(rec) == 2
    assert torch.equal(ref, got)
    with record_attention(model):
        pass
    assert model.training and not model.stage[0].training and model.gate.training
    # Records are detached fp32 copies, not views the model could later overwrite.
    with record_attention(model_eval) as rec:
        model_eval(x.half().float())
    assert all(r.weights.dtype == torch.float32 and not r.weights.requires_grad for r in rec)


def test_recorder_nesting_and_two_models():
    a, b = Nested(), Nested()
    x = torch.randn(1, 3, 4, 4)
    with record_attention(a) as outer:
        a(x)
        with record_attention(a) as inner:
            a(x)
        a(x)
        with record_attention(b) as other:
            b(x)
            a(x)
    assert len(inner) == 2
    assert len(outer) == 6  # before, after, and alongside b
    assert len(other) == 2
    assert all(t.sink is None for t in a.modules() if isinstance(t, AttentionTap))


def test_recorder_records_nothing_when_off():
    model = Nested()
    model(torch.randn(1, 3, 4, 4))
    assert all(t.sink is None and not t.active for t in model.modules() if isinstance(t, AttentionTap))


# --------------------------------------------------------------------------------------------- heatmaps


def test_spatial_heatmap_planted_non_square():
    model = PlantedSpatial(hot=(2, 5))
    with record_attention(model) as rec:
        model(torch.randn(3, 4, 6, 9))
    heat = spatial_heatmap(rec.records[0])
    assert heat.shape == (3, 6, 9)
    for m in heat:
        assert argmax2d(m) == (2, 5)


@pytest.mark.parametrize("grid,hot", [((3, 5), (1, 3)), ((5, 3), (4, 0))])
def test_token_heatmap_class_token_row(grid, hot):
    model = PlantedTokens(grid=grid, prefix=1, hot=hot)
    n = 1 + grid[0] * grid[1]
    with record_attention(model) as rec:
        model(torch.randn(2, n, 8))
    heat = spatial_heatmap(rec.records[0])
    assert heat.shape == (2, *grid)
    for m in heat:
        assert argmax2d(m) == hot


def test_token_heatmap_query_mean_without_class_token():
    model = PlantedTokens(grid=(4, 3), prefix=0, hot=(2, 1))
    with record_attention(model) as rec:
        model(torch.randn(2, 12, 8))
    r = rec.records[0]
    heat = spatial_heatmap(r)
    assert heat.shape == (2, 4, 3)
    assert all(argmax2d(m) == (2, 1) for m in heat)
    # Query-averaged attention received: every column's mean over heads and queries.
    assert torch.allclose(heat.flatten(1), r.weights.mean((1, 2)))
    with pytest.raises(ValueError, match="class token"):
        spatial_heatmap(r, query="cls")


def test_token_heatmap_grid_inferred_from_image_aspect():
    r = AttentionRecord("t", "token", torch.rand(1, 2, 7, 7).softmax(-1), grid=None, num_prefix_tokens=1)
    assert spatial_heatmap(r, image_hw=(20, 30)).shape == (1, 2, 3)
    assert spatial_heatmap(r, image_hw=(30, 20)).shape == (1, 3, 2)
    with pytest.raises(ValueError, match="square"):
        spatial_heatmap(r)
    square = AttentionRecord("t", "token", torch.rand(1, 2, 9, 9).softmax(-1))
    assert spatial_heatmap(square).shape == (1, 3, 3)


def test_pool_heatmap_and_channel_refused():
    pool = PlantedPool(grid=(4, 3), hot=(3, 0))
    with record_attention(pool) as rec:
        pool(torch.randn(2, 12, 5))
    heat = spatial_heatmap(rec.records[0])
    assert heat.shape == (2, 4, 3) and all(argmax2d(m) == (3, 0) for m in heat)
    chan = PlantedChannel()
    with record_attention(chan) as rec:
        chan(torch.randn(2, 4, 3, 3))
    with pytest.raises(ValueError, match="channel"):
        spatial_heatmap(rec.records[0])


# --------------------------------------------------------------------------------------------- rollout


def rollout_reference(layers, fusion, discard_ratio, prefix, readout):
    """Per-image loop, double precision, written out element by element where it matters."""
    b, _, n, _ = layers[0].shape
    out = []
    for i in range(b):
        result = torch.eye(n, dtype=torch.float64)
        for a in layers:
            heads = [a[i, h].double() for h in range(a.shape[1])]
            fused = heads[0].clone()
            for hm in heads[1:]:
                if fusion == "mean":
                    fused = fused + hm
                elif fusion == "max":
                    fused = torch.maximum(fused, hm)
                else:
                    fused = torch.minimum(fused, hm)
            if fusion == "mean":
                fused = fused / len(heads)
            if discard_ratio > 0:
                keep = {(q, q) for q in range(prefix)}
                cells = sorted(
                    (float(fused[r, c]), r, c) for r in range(n) for c in range(n) if (r, c) not in keep
                )
                for _, r, c in cells[: int(discard_ratio * (n * n - prefix))]:
                    fused[r, c] = 0.0
            a_hat = fused + torch.eye(n, dtype=torch.float64)
            for r in range(n):
                a_hat[r] = a_hat[r] / a_hat[r].sum()
            result = a_hat @ result
        if readout == "cls":
            flow = result[0]
        elif readout == "mean":
            flow = result[prefix:].mean(0)
        else:
            flow = readout[i].double() @ result
        out.append(flow[prefix:])
    return torch.stack(out)


def random_attention(b, heads, n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, heads, n, n, generator=g) * 2).softmax(-1)


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("discard_ratio", [0.0, 0.6])
def test_rollout_batch_equals_per_image_reference(fusion, discard_ratio):
    grid, prefix = (2, 3), 1
    n = prefix + 6
    layers = [random_attention(4, heads, n, seed) for seed, heads in enumerate([3, 3, 2])]
    got = attention_rollout(layers, head_fusion=fusion, discard_ratio=discard_ratio, num_prefix_tokens=prefix, grid=grid)
    ref = rollout_reference(layers, fusion, discard_ratio, prefix, "cls")
    assert got.shape == (4, 2, 3)
    assert torch.allclose(got.double().flatten(1), ref, atol=1e-6)


@pytest.mark.parametrize("prefix", [0, 1])
def test_rollout_mean_readout(prefix):
    """Mean readout: no class token (prefix 0), or averaging the grid tokens past a class token."""
    layers = [random_attention(4, 2, prefix + 12, seed) for seed in range(3)]
    got = attention_rollout(layers, num_prefix_tokens=prefix, readout="mean", grid=(4, 3), discard_ratio=0.3)
    ref = rollout_reference(layers, "mean", 0.3, prefix, "mean")
    assert got.shape == (4, 4, 3)
    assert torch.allclose(got.double().flatten(1), ref, atol=1e-6)
    if prefix == 0:
        with pytest.raises(ValueError, match="class token"):
            attention_rollout(layers, num_prefix_tokens=0, readout="cls", grid=(4, 3))


def test_rollout_seq_pool_readout():
    layers = [random_attention(4, 2, 12, seed) for seed in range(2)]
    pool = torch.rand(4, 12).softmax(-1)
    got = attention_rollout(layers, num_prefix_tokens=0, readout=pool, grid=(3, 4))
    ref = rollout_reference(layers, "mean", 0.0, 0, pool)
    assert torch.allclose(got.double().flatten(1), ref, atol=1e-6)
    rec = AttentionRecord("pool", "pool", pool, grid=(3, 4))
    assert torch.allclose(attention_rollout(layers, num_prefix_tokens=0, readout=rec, grid=(3, 4)), got)


def test_rollout_planted_on_records_non_square():
    """Two class-token layers that read one grid token: rollout from the records is hottest there."""
    model = nn.Sequential(PlantedTokens(grid=(3, 5), hot=(2, 1)), PlantedTokens(grid=(3, 5), hot=(2, 1)))
    with record_attention(model) as rec:
        model(torch.randn(2, 16, 8))
    heat = attention_rollout(rec.records)  # prefix and grid come from the records
    assert heat.shape == (2, 3, 5)
    assert all(argmax2d(m) == (2, 1) for m in heat)
    pool_model = PlantedPool(grid=(4, 3), hot=(0, 2))
    with record_attention(pool_model) as prec:
        pool_model(torch.randn(2, 12, 4))
    uniform = [torch.full((2, 1, 12, 12), 1 / 12)]
    heat = attention_rollout(uniform, num_prefix_tokens=0, readout=prec.records[0], grid=(4, 3))
    assert all(argmax2d(m) == (0, 2) for m in heat)


def test_rollout_validates_inputs():
    good = random_attention(2, 2, 7, 0)
    with pytest.raises(ValueError, match=r"layer 1.*\(2, 2, 5, 5\)"):
        attention_rollout([good, random_attention(2, 2, 5, 1)], grid=(2, 3))
    with pytest.raises(ValueError, match="layer 0"):
        attention_rollout([good[:, :, :, :3]])
    with pytest.raises(ValueError, match="head_fusion"):
        attention_rollout([good], head_fusion="sum", grid=(2, 3))
    with pytest.raises(ValueError, match="discard_ratio"):
        attention_rollout([good], discard_ratio=1.0, grid=(2, 3))
    with pytest.raises(ValueError, match="grid"):
        attention_rollout([good], grid=(2, 2))
    with pytest.raises(ValueError, match="non-empty"):
        attention_rollout([])
    with pytest.raises(ValueError, match="token records"):
        attention_rollout([AttentionRecord("c", "channel", torch.rand(2, 4))])


# --------------------------------------------------------------------------------------------- overlay


def test_colormaps_run_cold_to_hot():
    x = torch.tensor([0.0, 1.0])
    jet = colorize(x, "jet")
    assert jet[0, 2] > jet[0, 0] and jet[1, 0] > jet[1, 2]  # blue at 0, red at 1
    inferno = colorize(torch.linspace(0, 1, 256), "inferno").sum(-1)
    assert inferno.argmin() == 0 and inferno.argmax() == 255
    with pytest.raises(ValueError, match="colormap"):
        colorize(x, "viridis")


@pytest.mark.parametrize("name", ["jet", "turbo", "inferno"])
def test_colormaps_match_matplotlib(name):
    cm = pytest.importorskip("matplotlib").colormaps[name]
    x = torch.linspace(0, 1, 256)
    ref = torch.tensor(cm(x.numpy())[:, :3], dtype=torch.float32)
    assert torch.equal(colorize(x, name), ref)


def test_overlay_planted_spatial_is_hottest_in_its_cell():
    model = PlantedSpatial(hot=(2, 5))
    with record_attention(model) as rec:
        model(torch.randn(2, 4, 6, 9))
    heat = spatial_heatmap(rec.records[0])
    images = torch.zeros(2, 3, 24, 36, dtype=torch.uint8)  # 4 px per grid cell
    out = overlay(images, heat, alpha=1.0, colormap="inferno")
    assert out.dtype == torch.uint8 and out.shape == (2, 3, 24, 36)
    for img in out:
        r, c = argmax2d(img.float().sum(0))
        assert (r // 4, c // 4) == (2, 5)
    big = overlay(images, heat, alpha=1.0, colormap="inferno", size=(48, 72))
    assert big.shape == (2, 3, 48, 72)
    r, c = argmax2d(big[0].float().sum(0))
    assert (r // 8, c // 8) == (2, 5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_overlay_dtypes_shapes_and_size(dtype):
    images = torch.randn(3, 3, 10, 14).to(dtype)
    heat = torch.rand(3, 1, 5, 7).to(dtype)
    out = overlay(images, heat, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), colormap="turbo", size=28)
    assert out.dtype == torch.uint8 and out.shape == (3, 3, 20, 28)
    assert out.device == images.device


def test_overlay_constant_map_no_nan():
    images = torch.full((2, 3, 8, 8), 0.5)
    heat = torch.full((2, 4, 4), 3.0)
    heat[1] = float("nan")
    out = overlay(images, heat, alpha=0.5)
    cold = colorize(torch.zeros(1), "jet")[0]
    expected = ((0.5 * 0.5 + 0.5 * cold) * 255).round().to(torch.uint8)
    assert torch.equal(out, expected.view(1, 3, 1, 1).expand_as(out))


def test_overlay_undoes_normalisation():
    g = torch.Generator().manual_seed(0)
    original = torch.randint(0, 256, (2, 3, 9, 11), dtype=torch.uint8, generator=g)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    normalised = (original.float() / 255 - m) / s
    heat = torch.rand(2, 3, 3)
    back = overlay(normalised, heat, mean=mean, std=std, alpha=0.0)
    assert (back.int() - original.int()).abs().max() <= 1
    assert torch.equal(overlay(original, heat, alpha=0.0), original)
    half = overlay(normalised.half(), heat, mean=mean, std=std, alpha=0.0)
    assert (half.int() - original.int()).abs().max() <= 2  # fp16 rounding of the input


def test_overlay_validates():
    images = torch.zeros(2, 3, 4, 4)
    with pytest.raises(ValueError, match="heatmaps"):
        overlay(images, torch.rand(3, 2, 2))
    with pytest.raises(ValueError, match="heatmaps"):
        overlay(images, torch.rand(2, 2))
    with pytest.raises(ValueError, match="images"):
        overlay(torch.zeros(3, 4, 4), torch.rand(2, 2, 2))
    with pytest.raises(ValueError, match="alpha"):
        overlay(images, torch.rand(2, 2, 2), alpha=1.5)
    with pytest.raises(ValueError, match="std"):
        overlay(images, torch.rand(2, 2, 2), std=(1, 2))


def test_rollout_overlay_end_to_end_planted():
    """Records -> rollout -> overlay: the hot grid token of a 3x5 grid lands in its image cell."""
    model = nn.Sequential(PlantedTokens(grid=(3, 5), hot=(0, 4)), PlantedTokens(grid=(3, 5), hot=(0, 4)))
    with record_attention(model) as rec:
        model(torch.randn(1, 16, 8))
    heat = attention_rollout(rec.records, head_fusion="max", discard_ratio=0.5)
    out = overlay(torch.zeros(1, 3, 30, 50, dtype=torch.uint8), heat, alpha=1.0, colormap="inferno")
    r, c = argmax2d(out[0].float().sum(0))
    assert (r // 10, c // 10) == (0, 4)
    assert not math.isnan(float(heat.sum()))


# --------------------------------------------------------------------------------------------- real blocks


@pytest.mark.parametrize("name", [n for n in visattn.list_attention() if n != "none"])
def test_real_blocks_record_and_draw_on_their_grid(name):
    """Every registered block's taps record; each non-channel record gives a map on a non-square grid."""
    info = visattn.attention.attention_info(name)
    torch.manual_seed(0)
    if info["layout"] == "feature":
        block, x, grid = visattn.create_attention(name, 16), torch.randn(2, 16, 6, 9), (6, 9)
    else:
        block = visattn.create_attention(name, 16, grid=(2, 3), num_prefix_tokens=1)
        x, grid = torch.randn(2, 7, 16), (2, 3)
    block.eval()
    ref = block(x)
    with record_attention(block) as rec:
        out = block(x)
    assert torch.allclose(ref, out, atol=1e-5)
    assert len(rec) >= 1 and set(rec.taps) == {r.name for r in rec}
    assert info["kind"] in {r.kind for r in rec}
    for r in rec:
        kind = kind_of(r.kind)
        if kind.draws_histogram:
            assert r.weights.shape == (2, 16)
        elif not kind.placed:  # a matrix kind (covariance): read back as a (B, d, d) matrix, never placed
            d = r.weights.shape[-1]
            assert spatial_heatmap(r).shape == (2, d, d) and d == r.weights.shape[-2]
        else:
            assert spatial_heatmap(r).shape == (2, *grid)
            assert torch.isfinite(overlay(torch.zeros(2, 3, 12, 18), spatial_heatmap(r)).float()).all()

"""record_attention records the attention of every vision transformer family (issue 91, item 2), placed on the
image, checked on planted patterns rather than shapes:

* windowed families (Swin v1/v2, TinyViT, MaxViT block and grid, EfficientViT-M; torchvision Swin, Swin v2,
  MaxViT): with every parameter of the attention zeroed, each query attends uniformly to its window, so the
  record of each block must be ``1 / |group|`` exactly on the pairs that share a group by the paper's rule,
  written here independently (shifted windows: the regular windows displaced by the shift, cut at the border;
  MaxViT's grid: the positions that are equal modulo the grid stride), and 0 elsewhere;
* global-token families (CaiT's patch and class attention, ConViT's gated positional and plain attention,
  FastViT, MobileViT, LeViT, CoaT's factorized attention, XCiT's class attention): the query and key
  projections are set so that every query attends to one planted token, and the recorded map must peak at
  that token's place on the grid (and the cell must lie over that patch's pixels);
* XCiT's and EdgeNeXt's cross-covariance attention is recorded as channel x channel weights (kind
  ``"covariance"``): with identity projections each channel attends most to itself.

Every recording also leaves the model's output bit for bit as it was. Small random-weight models, small images.
"""
import warnings

import pytest
import timm
import torch
from torch import nn

from visattn.maps import read_maps, record_attention, spatial_heatmap
from visattn.maps.families import Capture, sdpa_weights, unrecordable


@pytest.fixture(autouse=True)
def _no_grad():
    """Parameters are planted in place; a test that needs gradients turns them on itself."""
    with torch.no_grad():
        yield


def recorded(model, x):
    model.eval()
    ref = model(x)
    with record_attention(model) as rec:
        out = model(x)
    assert torch.equal(ref, out), "recording changed the model's output"
    return rec.records


def zero_params(model, classes):
    n = 0
    for m in model.modules():
        if type(m).__name__ in classes:
            for p in m.parameters():
                p.zero_()
            n += 1
    assert n, f"no {classes} in the model"


# ----------------------------------------------------------------------------- windowed families


def swin_groups(blk, hw):
    ws, s = tuple(blk.window_size), tuple(blk.shift_size)
    return lambda y, x: ((y - s[0]) // ws[0], (x - s[1]) // ws[1]), ws[0] * ws[1], False  # no padding here


def tinyvit_groups(blk, hw):
    ws = blk.window_size
    return lambda y, x: (y // ws, x // ws), ws * ws, True  # padded windows: padding counts, uniform over ws * ws


def maxvit_groups(blk, hw):
    p = tuple(blk.partition_size)
    if blk.partition_block:
        return lambda y, x: (y // p[0], x // p[1]), p[0] * p[1], False
    stride = (hw[0] // p[0], hw[1] // p[1])
    return lambda y, x: (y % stride[0], x % stride[1]), p[0] * p[1], False


def efficientvit_groups(blk, hw):
    ws = blk.attn.resolution
    return lambda y, x: (y // ws, x // ws), ws * ws, True


def tv_swin_groups(blk, hw):
    ws, s = blk.window_size, [0 if w >= n else sh for w, n, sh in zip(blk.window_size, hw, blk.shift_size)]
    return lambda y, x: ((y - s[0]) // ws[0], (x - s[1]) // ws[1]), ws[0] * ws[1], False


def tv_maxvit_groups(blk, hw):
    p = blk.p
    if blk.partition_type == "grid":
        return lambda y, x: (y % p, x % p), (hw[0] // p) * (hw[1] // p), False
    return lambda y, x: (y // p, x // p), p * p, False


def tv_swin(v2=False):
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2
    extra = {"block": SwinTransformerBlockV2, "downsample_layer": PatchMergingV2} if v2 else {}
    return SwinTransformer([4, 4], 16, [2, 2], [1, 2], [4, 4], num_classes=10, **extra)


def tv_maxvit():
    from torchvision.models.maxvit import MaxVit

    return MaxVit(input_size=(64, 64), stem_channels=16, partition_size=4, block_channels=[16, 32], block_layers=[1, 1],
                  head_dim=8, stochastic_depth_prob=0.0, num_classes=10)


WINDOWED = {
    "swin": (lambda: timm.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4, embed_dim=16,
                                       depths=(2, 2), num_heads=(1, 2), num_classes=10), 64,
             ("WindowAttention",), swin_groups),
    "swinv2": (lambda: timm.create_model("swinv2_tiny_window8_256", img_size=64, window_size=4, embed_dim=16,
                                         depths=(2, 2), num_heads=(1, 2), num_classes=10), 64,
               ("WindowAttention",), swin_groups),
    "tiny_vit": (lambda: timm.create_model("tiny_vit_5m_224", num_classes=10), 64, ("Attention",), tinyvit_groups),
    "maxvit": (lambda: timm.create_model("maxvit_nano_rw_256", img_size=64, num_classes=10), 64, ("AttentionCl",),
               maxvit_groups),
    "efficientvit_m": (lambda: timm.create_model("efficientvit_m0", img_size=128, num_classes=10), 128,
                       ("CascadedGroupAttention",), efficientvit_groups),
    "torchvision_swin": (tv_swin, 32, ("ShiftedWindowAttention",), tv_swin_groups),
    "torchvision_swin_v2": (lambda: tv_swin(True), 32, ("ShiftedWindowAttentionV2",), tv_swin_groups),
    "torchvision_maxvit": (tv_maxvit, 64, ("RelativePositionalMultiHeadAttention",), tv_maxvit_groups),
}


@pytest.mark.parametrize("family", list(WINDOWED))
def test_windows_and_shifts_land_on_their_image_positions(family):
    build, size, attention, groups = WINDOWED[family]
    torch.manual_seed(0)
    model = build()
    zero_params(model, attention)  # q = k = v = 0, no position bias: uniform attention inside each window
    records = recorded(model, torch.randn(2, 3, size, size))
    assert records and all(r.kind == "token" and r.num_prefix_tokens == 0 for r in records)
    shifted = 0
    for r in records:
        h, w = r.grid
        assert r.weights.shape[-2:] == (h * w, h * w) and r.weights.shape[0] == 2
        group, area, _ = groups(model.get_submodule(r.name), (h, w))
        shifted += family.startswith(("swin", "torchvision_swin")) and any(model.get_submodule(r.name).shift_size)
        cells = [(y, x) for y in range(h) for x in range(w)]
        g = torch.tensor([hash(group(y, x)) for y, x in cells])
        same = g[:, None] == g[None, :]
        size_in_image = same.sum(1, keepdim=True).float()
        expected = torch.where(same, 1.0 / (area if groups(model.get_submodule(r.name), (h, w))[2] else size_in_image),
                               torch.zeros(()))
        torch.testing.assert_close(r.weights, expected.expand_as(r.weights), atol=1e-6, rtol=1e-5,
                                   msg=f"{family} {r.name}: weights off their windows")
    if family in ("swin", "swinv2", "torchvision_swin", "torchvision_swin_v2"):
        assert shifted, "no shifted-window block was checked"


@pytest.mark.parametrize("family", ["swin", "torchvision_swin"])
def test_inside_a_window_each_token_lands_on_its_own_position(family):
    """The relative position bias planted so that every query attends to the key one column to its right:
    wherever that neighbour shares the query's (shifted) window, the record puts the weight exactly there."""
    build, size, attention, groups = WINDOWED[family]
    torch.manual_seed(0)
    model = build()
    zero_params(model, attention)
    for m in model.modules():
        if type(m).__name__ in attention:
            ws = tuple(m.window_size)
            m.relative_position_bias_table[(ws[0] - 1) * (2 * ws[1] - 1) + ws[1] - 2] = 30.0  # offset (0, +1)
    records = recorded(model, torch.randn(2, 3, size, size))
    checked = 0
    for r in records:
        h, w = r.grid
        group = groups(model.get_submodule(r.name), (h, w))[0]
        for y in range(h):
            for x in range(w - 1):
                if group(y, x) == group(y, x + 1):
                    assert (r.weights[:, :, y * w + x, y * w + x + 1] > 0.99).all(), f"{r.name} at {(y, x)}"
                    checked += 1
    assert checked > 0


@pytest.mark.parametrize("family", ["swin", "swinv2", "torchvision_swin", "maxvit"])
def test_a_token_planted_in_the_image_draws_its_window_to_its_own_position(family):
    """Every block's input is zero but for one position (1, 1), inside the windows a shift wraps around; keys
    read that token's pattern, so every query sharing its window (its grid group, for MaxViT) attends to it:
    the record must put that weight at the planted image position."""
    build, size, attention, groups = WINDOWED[family]
    torch.manual_seed(0)
    model = build()
    zero_params(model, attention)
    blocks = [m for m in model.modules() if type(m).__name__ in ("SwinTransformerBlock", "SwinTransformerV2Block",
                                                                  "SwinTransformerBlockV2", "PartitionAttentionCl")]
    assert blocks
    for m in model.modules():
        if type(m).__name__ in attention:
            out, dim = m.qkv.weight.shape
            pattern = torch.linspace(-1.0, 1.0, dim)
            pattern = (pattern - pattern.mean()) / pattern.std(unbiased=False)
            rows = torch.arange(out).view(3, -1)  # q, k, v rows; MaxViT's head-first layout: per head q, k, v
            if getattr(m, "head_first", False):
                rows = torch.arange(out).view(m.num_heads, 3, -1).transpose(0, 1).reshape(3, -1)
            if hasattr(m, "q_bias"):  # Swin v2 keeps its q bias apart (cosine attention, a sharp temperature)
                m.q_bias.fill_(1.0)
                m.logit_scale.fill_(4.6)
            else:
                if m.qkv.bias is None:
                    m.qkv.bias = nn.Parameter(torch.zeros(out))
                m.qkv.bias[rows[0]] = 1.0  # q: constant
            m.qkv.weight[rows[1]] = pattern / dim ** 0.5  # k: how much of the planted pattern a token holds

    def plant(mod, args):
        x = torch.zeros_like(args[0])
        x[:, 1, 1] = torch.linspace(-1.0, 1.0, x.shape[-1]) * 8  # (B, H, W, C): the one planted position
        return (x, *args[1:])

    for b in blocks:
        b.register_forward_pre_hook(plant)
    records = recorded(model, torch.randn(2, 3, size, size))
    checked = 0
    for r in records:
        h, w = r.grid
        group = groups(model.get_submodule(r.name), (h, w))[0]
        p = 1 * w + 1
        for y in range(h):
            for x in range(w):
                if group(y, x) == group(1, 1):
                    assert (r.weights[:, :, y * w + x, p] > 0.9).all(), f"{r.name}: query {(y, x)}"
                    checked += 1
    assert checked > 0


# ----------------------------------------------------------------------------- global-token families


def plant(module, layout, dim, c=4.0):
    """Every query attends to whatever token holds the planted input: q = c (its bias), k = x (identity)."""
    for p in module.parameters():
        p.zero_()
    eye = torch.eye(dim)
    for name in ("proj_l", "proj_w"):  # CaiT's talking heads: identity mixing
        if hasattr(module, name):
            getattr(module, name).weight.copy_(torch.eye(getattr(module, name).weight.shape[0]))
    if layout == "q_k":
        q, k = module.q, module.k
        rows = (slice(0, dim), slice(0, dim))
    else:
        q = k = getattr(module, layout)
        rows = (slice(0, dim), slice(dim, 2 * dim))
    if q.bias is None:
        q.bias = nn.Parameter(torch.zeros(q.weight.shape[0]))
    q.bias[rows[0]] = c
    k.weight[rows[1]] = eye
    if hasattr(module, "gating_param"):  # ConViT: the content term only
        module.gating_param.fill_(-30.0)


def plant_input(module, token, prefix=0, value=4.0):
    def pre(m, args, kwargs):
        x = torch.zeros_like(args[0])
        if x.dim() == 4:  # (B, C, H, W)
            t = token % (x.shape[-2] * x.shape[-1])
            x[:, :, t // x.shape[-1], t % x.shape[-1]] = value
        else:  # (B, prefix + N, C); a later stage with fewer tokens gets the token modulo N
            x[:, prefix + token % (x.shape[1] - prefix)] = value
        return (x, *args[1:]), kwargs

    return module.register_forward_pre_hook(pre, with_kwargs=True)


GLOBAL = {  # name: (build, size, attention class, qk layout, prefix tokens at the module, planted token)
    "cait_patch": (lambda: timm.create_model("cait_xxs24_224", img_size=64, depth=2, num_classes=10), 64,
                   "TalkingHeadAttn", "qkv", 0, 6),
    "cait_class": (lambda: timm.create_model("cait_xxs24_224", img_size=64, depth=2, num_classes=10), 64,
                   "ClassAttn", "q_k", 1, 9),
    "xcit_class": (lambda: timm.create_model("xcit_nano_12_p16_224", img_size=64, depth=2, num_classes=10), 64,
                   "ClassAttn", "q_k", 1, 5),
    "convit_gpsa": (lambda: timm.create_model("convit_tiny", img_size=64, depth=3, local_up_to_layer=2,
                                              num_classes=10), 64, "GPSA", "qk", 0, 10),
    "convit_mhsa": (lambda: timm.create_model("convit_tiny", img_size=64, depth=3, local_up_to_layer=2,
                                              num_classes=10), 64, "MHSA", "qkv", 1, 3),
    "fastvit": (lambda: timm.create_model("fastvit_sa12", num_classes=10), 128, "Attention", "qkv", 0, 13),
    "mobilevit": (lambda: timm.create_model("mobilevit_xxs", num_classes=10), 128, "Attention", "qkv", 0, 7),
    "coat": (lambda: timm.create_model("coat_lite_tiny", img_size=64, num_classes=10), 64,
             "FactorAttnConvRelPosEnc", "qkv", 1, 2),
}


@pytest.mark.parametrize("family", list(GLOBAL))
def test_a_planted_token_is_where_the_recorded_map_peaks(family):
    build, size, cls, layout, prefix, token = GLOBAL[family]
    torch.manual_seed(0)
    model = build()
    targets = [(p, m) for p, m in model.named_modules() if type(m).__name__ == cls]
    assert targets
    handles = []
    for _, m in targets:
        dim = (m.q if layout == "q_k" else getattr(m, layout)).weight.shape[1]
        plant(m, layout, dim)
        handles.append(plant_input(m, token, prefix))
    x = torch.randn(2, 3, size, size)
    records = [r for r in recorded(model, x) if r.name in {p for p, _ in targets}]
    for h in handles:
        h.remove()
    assert len(records) == len(targets)
    for r in records:
        assert r.weights.shape[0] == x.shape[0], f"{family} {r.name}: one record row per image"
        heat = spatial_heatmap(r)  # (B, h, w): class-token row, attention received, or the pooling weights
        flat, planted = heat.flatten(1).argmax(1), token % heat[0].numel()
        assert (flat == planted).all(), f"{family} {r.name}: peak at {flat.tolist()}, planted at {planted}"
        assert r.num_prefix_tokens == prefix and r.grid == tuple(heat.shape[-2:])


def test_the_peak_cell_lies_over_the_planted_patch():
    """CaiT at patch 16 on 64 px: token 6 is grid cell (1, 2), pixels 16-31 x 32-47."""
    build, size, cls, layout, prefix, token = GLOBAL["cait_patch"]
    torch.manual_seed(0)
    model = build()
    for _, m in [(p, m) for p, m in model.named_modules() if type(m).__name__ == cls]:
        plant(m, layout, m.qkv.weight.shape[1])
        plant_input(m, token, prefix)
    x = torch.randn(1, 3, size, size)
    with record_attention(model.eval()) as rec:
        model(x)
    maps = [m for m in read_maps(rec.records, model, x.shape) if m.name == "blocks.0.attn"]
    rows, cols = maps[0].geometry.centres()
    i, j = divmod(int(maps[0].heat.flatten(1).argmax()), maps[0].heat.shape[-1])
    assert 16 <= float(rows[i]) < 32 and 32 <= float(cols[j]) < 48


def test_levit_records_its_own_attention_and_subsampling_queries():
    """LeViT: the recorded weights are the module's own softmax (timm's code path, seen on the way) and its
    subsampling attention has queries on the coarser grid, keys on the finer one."""
    torch.manual_seed(0)
    model = timm.create_model("levit_128s", img_size=64, num_classes=10)
    records = recorded(model, torch.randn(2, 3, 64, 64))
    down = [r for r in records if type(model.get_submodule(r.name)).__name__ == "AttentionDownsample"]
    assert down and down[0].weights.shape[-2:] == (4, 16) and down[0].grid == (4, 4)
    m = model.get_submodule(records[0].name)
    x = torch.randn(2, 16, m.qkv.linear.weight.shape[1])
    with Capture() as cap:
        type(m).forward(m, x)
    (w,) = cap.last_dim()
    torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))
    assert records[0].weights.shape[1:] == w.shape[1:]


@pytest.mark.parametrize("name", ["xcit_nano_12_p16_224", "edgenext_xx_small"])
def test_cross_covariance_is_recorded_channel_by_channel(name):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, **({"img_size": 64, "depth": 2} if "xcit" in name else {}))
    cls = "XCA" if "xcit" in name else "CrossCovarianceAttn"
    for m in model.modules():
        if type(m).__name__ == cls:
            d = m.qkv.weight.shape[1]
            m.qkv.weight.zero_()
            m.qkv.weight[: 2 * d] = torch.cat([torch.eye(d), torch.eye(d)])  # q = k = x
            m.temperature.fill_(30.0)
    records = [r for r in recorded(model, torch.randn(2, 3, 64, 64)) if r.kind == "covariance"]
    assert records
    for r in records:
        b, heads, d, d2 = r.weights.shape
        assert d == d2 and r.grid is None and r.value_scale == "relative"
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(b, heads, d))
        assert (r.weights.argmax(-1) == torch.arange(d)).all()  # each channel attends most to itself


def test_sdpa_weights_are_the_kernels_weights():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, 5, 4).unbind(0)
    mask = torch.randn(5, 5)
    w = sdpa_weights(q, k, v, attn_mask=mask, scale=0.3)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(w @ v, out)


def test_a_family_that_cannot_be_recorded_says_why_in_one_line():
    model = timm.create_model("efficientvit_b0", num_classes=10)
    assert any("LiteMLA" in line and "linear attention" in line for line in unrecordable(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with record_attention(model.eval()) as rec:
            model(torch.randn(1, 3, 64, 64))
    assert len(rec) == 0 and any("LiteMLA" in str(w.message) and "\n" not in str(w.message) for w in caught)


def test_mobilevit_v2_context_scores_are_pooling_weights_on_the_patch_grid():
    torch.manual_seed(0)
    model = timm.create_model("mobilevitv2_050", num_classes=10)
    records = recorded(model, torch.randn(2, 3, 128, 128))
    assert records and all(r.kind == "pool" for r in records)
    for r in records:
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(2))
        assert r.grid[0] * r.grid[1] == r.weights.shape[-1]


def test_a_gradient_recording_places_the_window_relevance_like_the_weights():
    torch.manual_seed(0)
    model = WINDOWED["swin"][0]().eval()
    from visattn.maps import probe_pass

    rec, _ = probe_pass(model, torch.randn(2, 3, 64, 64))
    assert rec.records and all(r.relevance is not None and r.via == "placed" for r in rec.records)
    for r in rec.records:
        assert r.relevance.shape == r.weights.shape
        assert (r.relevance[r.weights == 0] == 0).all()  # no relevance between windows


class Tags:
    def __init__(self):
        self.tags = []

    def add_image(self, tag, img, step, dataformats=None):
        self.tags.append(tag)

    add_histogram = add_text = add_scalar = lambda self, tag, *a, **k: self.tags.append(tag)


@pytest.mark.parametrize("name, expect", [
    ("swin_tiny_patch4_window7_224", {"maps/layers.0.blocks.1", "matrix/layers.0.blocks.1", "maps/rollout",
                                      "maps/rollout_grad"}),
    ("xcit_nano_12_p16_224", {"matrix/blocks.0.attn", "maps/cls_attn_blocks.1.attn"}),
    ("coat_lite_tiny", {"maps/serial_blocks1.0.factoratt_crpe"}),
])
def test_the_tensorboard_cards_take_the_family_records(name, expect):
    from visattn.maps import log_attention_maps

    torch.manual_seed(0)
    model = timm.create_model(name, img_size=64, num_classes=10)
    w = Tags()
    with torch.enable_grad():
        summary = log_attention_maps(w, model, torch.randn(2, 3, 64, 64), torch.tensor([0, 1]), 0)
    assert expect <= set(summary["images"]) and not summary["skipped"]
    assert not any(t.startswith("maps/blocks.0.attn") for t in summary["images"]) or "xcit" not in name


def test_each_family_map_says_where_its_cells_lie():
    torch.manual_seed(0)
    model = WINDOWED["swin"][0]().eval()
    x = torch.randn(1, 3, 64, 64)
    with record_attention(model) as rec:
        model(x)
    words = read_maps(rec.records, model, x.shape)[0].description
    assert "windows placed back on the block's grid (shifts undone)" in words and "stride 4 px" in words


def test_a_window_record_too_large_to_place_is_one_warning_not_a_crash(monkeypatch):
    from visattn.maps import families

    monkeypatch.setattr(families, "MAX_PLACED_BYTES", 2**16)
    torch.manual_seed(0)
    model = WINDOWED["swin"][0]().eval()
    x = torch.randn(2, 3, 64, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = recorded(model, x)
    grids = {r.grid for r in records}
    assert (16, 16) not in grids and (8, 8) in grids  # 2 x 1 x 256^2 x 4 B > 64 KiB; 2 x 2 x 64^2 x 4 B is not
    lines = [str(w.message) for w in caught if "layers.0.blocks.0" in str(w.message)]
    assert len(lines) == 1 and "MiB" in lines[0] and "\n" not in lines[0]

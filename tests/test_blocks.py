"""Feature-map attention blocks: the contract every registered block keeps, timm parity, paper defaults."""
from __future__ import annotations

import math

import pytest
import torch
from timm.layers import CecaModule, EcaModule, EffectiveSEModule, SEModule
from timm.layers import GlobalContext as TimmGlobalContext
from timm.layers.cbam import CbamModule, LightCbamModule, LightSpatialAttn, SpatialAttn
from timm.layers.coord_attn import CoordAttn, SimpleCoordAttn, StripAttn
from torch import nn

from visattn.attention import (
    AttentionTap,
    attention_info,
    create_attention,
    list_attention,
    register_attention,
)
from visattn.attention.channel import compute_dtype, eca_kernel_size, mean_max, mean_over
from visattn.attention.self_attn2d import rel_pos_embed
from visattn.attention.spatial import coord_mip

FEATURE = list_attention("feature")
C = 16


def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Replace zero/identity initialisations (BN scale 0, zero last layers) by random values, so every
    parameter influences the output and gets a non-trivial gradient."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return module


def build(name: str, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return randomize_(create_attention(name, C, **kwargs), seed)


def taps(module: nn.Module):
    return [m for m in module.modules() if isinstance(m, AttentionTap)]


def load_by_order(dst: nn.Module, src: nn.Module) -> None:
    """Copy ``src``'s state into ``dst`` entry by entry in registration order (names differ, layout not)."""
    d, s = dst.state_dict(), list(src.state_dict().values())
    assert len(d) == len(s), (list(d), len(s))
    dst.load_state_dict({k: v.reshape(d[k].shape) for k, v in zip(d, s)})


def test_feature_blocks_registered():
    assert {"none", "se", "eca", "gc", "spatial", "cbam", "coord", "nonlocal", "mhsa2d"} <= set(FEATURE)
    for name in FEATURE:
        assert attention_info(name)["layout"] == "feature"


@pytest.mark.parametrize("name", FEATURE)
def test_shape_and_gradients(name):
    block = build(name).train()
    x = torch.randn(2, C, 7, 5, requires_grad=True)
    y = block(x)
    assert y.shape == x.shape
    y.backward(torch.randn_like(y))
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for pname, p in block.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
        if pname.endswith("weight"):
            assert p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", FEATURE)
@pytest.mark.parametrize("hw", [(7, 5), (1, 1), (3, 8), (6, 6)])
def test_any_spatial_size(name, hw):
    block = build(name).train()
    x = torch.randn(2, C, *hw, requires_grad=True)
    y = block(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("name", FEATURE)
def test_batch_of_one(name):
    block = build(name).train()
    x = torch.randn(1, C, 7, 5, requires_grad=True)
    y = block(x)
    y.sum().backward()
    assert y.shape == x.shape and torch.isfinite(x.grad).all()
    block.eval()  # a single 1x1 sample: BN has one value per channel, so only eval mode is defined
    x1 = torch.randn(1, C, 1, 1)
    assert block(x1).shape == x1.shape


@pytest.mark.parametrize("name", FEATURE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_module_cast_dtypes(name, dtype):
    block = build(name).to(dtype).train()
    x = torch.randn(2, C, 7, 5, dtype=dtype, requires_grad=True)
    y = block(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.isfinite(y.float()).all()
    y.float().sum().backward()
    assert x.grad.dtype == dtype and torch.isfinite(x.grad.float()).all()
    if dtype is not torch.float32:  # close to the fp32 block on the same (rounded) input
        ref = build(name).train()(x.detach().float())
        tol = 0.1 if dtype is torch.bfloat16 else 0.02
        assert (y.float() - ref).abs().max() <= tol * (1 + ref.abs().max())


@pytest.mark.parametrize("name", FEATURE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast(name, dtype):
    block = build(name).train()
    x = torch.randn(2, C, 7, 5, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        y = block(x)
    assert y.shape == x.shape and torch.isfinite(y.float()).all()
    y.float().sum().backward()
    assert torch.isfinite(x.grad).all()
    for p in block.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()


@pytest.mark.parametrize("name", FEATURE)
def test_fp16_autocast_large_inputs_finite(name):
    block = build(name).train()
    x = (torch.randn(2, C, 7, 5) * 1e3).requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16):
        y = block(x)
    assert torch.isfinite(y.float()).all()
    y.float().mean().backward()
    assert torch.isfinite(x.grad).all()
    block.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(block(x.detach().half()).float()).all()


@pytest.mark.parametrize("name", FEATURE)
def test_channels_last(name):
    block = build(name).eval()
    x = torch.randn(2, C, 7, 5)
    g = torch.randn_like(x)
    xa = x.clone().requires_grad_()
    xb = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    ya, yb = block(xa), block(xb)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-5)
    assert yb.is_contiguous(memory_format=torch.channels_last)  # the input's memory format is kept
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", FEATURE)
def test_no_grad_path_matches_grad_path(name):
    block = build(name).eval()
    x = torch.randn(2, C, 6, 5)
    with torch.no_grad():
        y0 = block(x)
    y1 = block(x.requires_grad_())
    torch.testing.assert_close(y1.detach(), y0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", FEATURE)
def test_taps_record_the_weights_without_changing_the_output(name):
    B, H, W = 2, 7, 5
    block = build(name).eval()
    x = torch.randn(B, C, H, W)
    y_plain = block(x)
    sinks = {}
    for tap in taps(block):
        tap.sink = sinks.setdefault(id(tap), [])
    y_rec = block(x)
    torch.testing.assert_close(y_rec, y_plain, rtol=1e-5, atol=1e-5)  # the tap is an identity
    if name == "none":
        assert taps(block) == []
        return
    assert attention_info(name)["kind"] in {t.kind for t in taps(block)}
    for tap in taps(block):
        (rec,) = sinks[id(tap)]  # exactly one record per pass
        w = rec.weights
        assert w.dtype == torch.float32 and not w.requires_grad
        if tap.kind == "channel":
            assert w.shape == (B, C)
            assert (w >= 0).all() and (w <= (2 if rec.value_scale == "gain" else 1)).all()  # gct, bam: 0-2
        elif tap.kind == "spatial":
            assert w.shape == (B, 1, H, W)
            assert (w >= 0).all()
        else:
            assert tap.kind == "token"
            assert w.shape[0] == B and w.shape[2:] == (H * W, H * W)
            assert w.shape[1] == getattr(block, "num_heads", 1)
            assert rec.grid == (H, W) and rec.num_prefix_tokens == 0
            torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))
    for tap in taps(block):
        tap.sink = None


def test_recorded_self_attention_is_fp32_under_bf16_autocast():
    """The recording path computes q k^T and the softmax in fp32 even inside bf16 autocast."""
    block = build("nonlocal").eval()
    x = torch.randn(2, C, 6, 5)
    got = {}
    block.qkv.register_forward_hook(lambda m, i, o: got.__setitem__("qkv", o))
    (tap,) = taps(block)
    tap.sink = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        block(x)
    d = block.inter_channels
    q, k, _ = got["qkv"].float().split(d, dim=-1)  # (B, N, d): what the block attended with
    want = ((q * block.scale) @ k.transpose(1, 2)).softmax(-1)
    (rec,) = tap.sink
    torch.testing.assert_close(rec.weights[:, 0], want, rtol=0, atol=1e-6)
    tap.sink = None


def test_taps_carry_the_applied_gates():
    x = torch.randn(2, C, 7, 5)
    for name in ("se", "eca", "spatial", "cbam"):
        block = build(name).eval()
        records = []
        for tap in taps(block):
            tap.sink = records
        y = block(x)
        expect = x
        for rec in records:  # CBAM: channel gate first, then spatial
            expect = expect * (rec.weights[:, :, None, None] if rec.kind == "channel" else rec.weights)
        torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-6)
    block = build("gc").eval()  # gc: the context softmax sums to one over the positions
    block.tap.sink = records = []
    block(x)
    torch.testing.assert_close(records[0].weights.sum((2, 3)), torch.ones(2, 1))


def test_create_attention_errors_list_valid_choices():
    with pytest.raises(ValueError) as e:
        create_attention("no-such-block", 8)
    assert "se" in str(e.value) and "cbam" in str(e.value)
    with pytest.raises(ValueError) as e:
        create_attention("se", 8, reduction_typo=4)
    assert "reduction_typo" in str(e.value) and "rd_ratio" in str(e.value)
    with pytest.raises(ValueError):
        create_attention("eca", 8, kernel_size=4)  # must be odd
    with pytest.raises(ValueError):
        create_attention("mhsa2d", 10, num_heads=4)  # must divide channels
    with pytest.raises(ValueError):
        create_attention("gc", 8, fusion="concat")
    with pytest.raises(ValueError):
        create_attention("se", 0)


def test_duplicate_registration_rejected():
    with pytest.raises(ValueError, match="already registered"):
        register_attention("se", layout="feature", kind="channel")(nn.Identity)
    assert create_attention("se", 32).__class__.__name__ == "SqueezeExcite"


# ---- parity with timm ------------------------------------------------------------------------------------

# (name, timm module with visattn's configuration, relative tolerance), compared in float64 so that only a
# different formula can fail, never fp32 rounding that differs between kernel families (gc's sharp softmax
# missed an fp32 1e-5 by 1.3e-5 on one machine): se, eca and cbam agree to 1e-10 absolute, the others to 1e-10
# relative to the magnitude of the values
PARITY = [
    ("se", lambda c: SEModule(c, rd_divisor=1), False),
    ("eca", lambda c: EcaModule(c), False),
    ("cbam", lambda c: CbamModule(c), False),
    ("spatial", lambda c: SpatialAttn(7), True),
    ("coord", lambda c: CoordAttn(c, rd_channels=coord_mip(c), bias=True), True),
    ("gc", lambda c: TimmGlobalContext(c, fuse_add=True, fuse_scale=False, rd_ratio=1 / 16), True),
]


# timm's variants of the same papers, as options of visattn's blocks (and timm's strip attention, a block of
# its own): (id, name, options, timm module, relative tolerance); timm's LayerNorm eps where it differs is an
# option here (norm_eps), so nothing is patched on timm's side
_TIMM_GC = dict(rd_ratio=1 / 8, norm_eps=1e-6)
PARITY_OPTIONS = [
    ("se-effective", "se", dict(effective=True), lambda c: EffectiveSEModule(c), False),
    ("eca-mlp", "eca", dict(use_mlp=True), lambda c: EcaModule(c, use_mlp=True), False),
    ("eca-circular", "eca", dict(padding="circular"), lambda c: CecaModule(c), False),
    ("eca-circular-k7", "eca", dict(padding="circular", kernel_size=7), lambda c: CecaModule(None, kernel_size=7), False),
    ("cbam-light", "cbam", dict(light=True), lambda c: LightCbamModule(c), False),
    ("spatial-light", "spatial", dict(light=True), lambda c: LightSpatialAttn(7), True),
    ("gc-scale", "gc", dict(fusion="scale", **_TIMM_GC), lambda c: TimmGlobalContext(c), True),
    ("gc-add", "gc", dict(fusion="add", **_TIMM_GC), lambda c: TimmGlobalContext(c, fuse_add=True, fuse_scale=False), True),
    ("gc-both", "gc", dict(fusion="both", **_TIMM_GC), lambda c: TimmGlobalContext(c, fuse_add=True), True),
    ("coord-nobias", "coord", dict(bias=False), lambda c: CoordAttn(c, rd_channels=coord_mip(c)), True),
    ("coord-sum", "coord", dict(combine="sum", norm_layer=None, act_layer=nn.SiLU, mip=16),
     lambda c: SimpleCoordAttn(c, rd_channels=16), True),
    ("strip", "strip", {}, lambda c: StripAttn(c), True),
    ("strip-noconv", "strip", dict(use_conv=False), lambda c: StripAttn(c, use_conv=False), True),
    ("strip-k5-bias", "strip", dict(kernel_size=5, bias=True), lambda c: StripAttn(c, kernel_size=5, bias=True), True),
]


@pytest.mark.parametrize("name,make_timm,relative", PARITY, ids=[p[0] for p in PARITY])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_matches_timm(name, make_timm, relative, train):
    channels = 64
    torch.manual_seed(1)
    ref = randomize_(make_timm(channels), seed=3)
    for m in ref.modules():  # GCNet's code uses nn.LayerNorm's eps; timm's LayerNorm2d defaults to 1e-6
        if isinstance(m, nn.LayerNorm):
            m.eps = 1e-5
    assert_matches_timm(create_attention(name, channels), ref, relative, train)


@pytest.mark.parametrize("key,name,options,make_timm,relative", PARITY_OPTIONS, ids=[p[0] for p in PARITY_OPTIONS])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_option_matches_timm(key, name, options, make_timm, relative, train):
    torch.manual_seed(1)
    ref = randomize_(make_timm(64), seed=3)
    # torch's nn.Hardsigmoid backward multiplies by 1/6 rounded to fp32 (3e-8 relative, in fp64 too); eSE's
    # gate here is the exact clamp(z + 3, 0, 6) / 6, so gradients through it agree to that rounding
    tol = 1e-7 if key == "se-effective" else 1e-10
    assert_matches_timm(create_attention(name, 64, **options), ref, relative, train, grad_tol=tol)


def assert_matches_timm(ours: nn.Module, ref: nn.Module, relative: bool, train: bool, grad_tol: float = 1e-10) -> None:
    """``ours`` with ``ref``'s weights copied by order computes ``ref``'s outputs, input and parameter gradients
    and BN statistics in float64 (to 1e-10, absolute or relative to the values' magnitude; gradients to
    ``grad_tol``)."""
    channels = 64
    load_by_order(ours, ref)
    ours.double().train(train)  # float64: a formula differs, not fp32 rounding in one kernel family or another
    ref.double().train(train)
    x = torch.randn(3, channels, 9, 7, dtype=torch.float64)
    g = torch.randn_like(x)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), ref(xb)
    assert (ya - yb).abs().max().item() <= 1e-10 * (1 + yb.abs().max().item() if relative else 1)
    ya.backward(g)
    yb.backward(g)
    assert (xa.grad - xb.grad).abs().max().item() <= grad_tol * (1 + xb.grad.abs().max().item() if relative else 1)
    for (pn, p), q in zip(ours.named_parameters(), ref.parameters()):
        scale = 1 + q.grad.abs().max().item()
        assert (p.grad - q.grad.reshape(p.shape)).abs().max().item() <= grad_tol * scale, pn
    for (bn, b), rb in zip(ours.named_buffers(), ref.buffers()):  # BN statistics updated exactly once
        torch.testing.assert_close(b, rb.reshape(b.shape), rtol=1e-10, atol=1e-12, msg=bn)


@pytest.mark.parametrize("name", ["se", "eca", "spatial", "cbam", "coord", "gc", "strip"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_gradcheck_and_gradgradcheck(name, layout):
    """First and second derivatives against finite differences in float64 (the blocks are plain autograd;
    this pins that no op in them lacks a double backward)."""
    torch.manual_seed(0)
    # a wide bottleneck (rd_ratio 1/2) so no ReLU in it silences a path (e.g. CBAM's max-pooled branch)
    opts = {"se": dict(rd_ratio=0.5), "cbam": dict(rd_ratio=0.5), "gc": dict(rd_ratio=0.5)}.get(name, {})
    block = randomize_(create_attention(name, 8, **opts)).double().eval()
    x = torch.randn(2, 8, 4, 3, dtype=torch.float64)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    assert torch.autograd.gradcheck(block, (x,), eps=1e-6, atol=1e-5, fast_mode=True)
    assert torch.autograd.gradgradcheck(block, (x,), eps=1e-6, atol=1e-4, fast_mode=True)


def test_amax_ties_split_the_gradient_like_autograd():
    ref = randomize_(CbamModule(C, rd_ratio=0.5), seed=2).double()
    ours = create_attention("cbam", C, rd_ratio=0.5).double()
    load_by_order(ours, ref)
    # values in {-2, -1, 0}: the max over the (positively gated) channels is 0 at most positions and shared
    # by several channels; values in {1, 2, 3}: the max over H, W is 3, shared by several positions
    for low in (-2, 1):
        x = torch.randint(low, low + 3, (2, C, 5, 4)).double()
        g = torch.randn_like(x)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours(xa).backward(g)
        ref(xb).backward(g)
        torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format])
@pytest.mark.parametrize("dims", [(1,), (2, 3)])
@pytest.mark.parametrize("used", ["both", "mean", "max"])
def test_mean_max_is_autograds_mean_and_amax_in_the_maps_layout(dtype, layout, dims, used):
    """CBAM's pooling with its own backward: the same values as ``mean_over`` and ``amax``, the same gradient as
    autograd's through them (the max's split evenly among tied maxima), for either output alone too, and the
    gradient in the map's own memory layout (the point of the hand-written backward)."""
    torch.manual_seed(0)
    x = torch.randint(-2, 2, (3, 8, 5, 4)).to(dtype).contiguous(memory_format=layout)  # ties everywhere
    acc = compute_dtype(x)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = mean_max(xa, dims, acc)
    ref = (mean_over(xb, dims, acc), xb.amax(dims).to(acc))
    assert all(torch.equal(a, b) and a.dtype == acc for a, b in zip(ours, ref))
    weights = [torch.randn_like(ref[0]), torch.randn_like(ref[1])]
    pick = {"both": [0, 1], "mean": [0], "max": [1]}[used]
    sum((ours[i] * weights[i]).sum() for i in pick).backward()
    sum((ref[i] * weights[i]).sum() for i in pick).backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=0, atol=0 if dtype == torch.float64 else 1e-2)
    if layout == torch.channels_last and used != "mean":  # the mean alone hands back a broadcast view
        assert xa.grad.is_contiguous(memory_format=torch.channels_last)


# ---- paper defaults --------------------------------------------------------------------------------------


def test_se_defaults():
    se = create_attention("se", 64)
    assert se.fc1.out_channels == 64 // 16 and se.fc2.out_channels == 64  # reduction 16
    assert se.fc1.bias is not None and isinstance(se.act, nn.ReLU) and isinstance(se.gate, nn.Sigmoid)
    assert create_attention("se", 24).fc1.out_channels == 2  # 24 / 16 rounded, divisor 1
    assert create_attention("se", 64, rd_ratio=0.25).fc1.out_channels == 16


def test_eca_kernel_sizes():
    assert [eca_kernel_size(c) for c in (64, 128, 256, 512)] == [3, 5, 5, 5]
    assert [eca_kernel_size(c) for c in (1, 2, 4, 7, 8)] == [3] * 5  # at least 3, as timm's EcaModule
    for c in (1, 2, 3, 5, 7, 64, 128, 256, 512):
        eca = create_attention("eca", c)
        assert eca.conv.kernel_size == (eca_kernel_size(c),) and eca.conv.bias is None
        assert eca.kernel_size == EcaModule(c).conv.kernel_size[0]
    assert create_attention("eca", 64, kernel_size=7).conv.kernel_size == (7,)


def test_cbam_defaults():
    cbam = create_attention("cbam", 64)
    assert cbam.channel.fc1.out_channels == 4 and cbam.channel.fc1.bias is None  # reduction 16, no bias
    assert cbam.spatial.conv.kernel_size == (7, 7) and cbam.spatial.conv.in_channels == 2
    assert isinstance(cbam.spatial.bn, nn.BatchNorm2d)
    assert {t.kind for t in taps(cbam)} == {"channel", "spatial"}
    assert create_attention("spatial", 64).conv.kernel_size == (7, 7)


def test_gc_defaults_and_identity_start():
    gc = create_attention("gc", 64)
    assert gc.fusion == "add" and gc.mlp_scale is None
    assert gc.mlp_add[0].out_features == 4 and isinstance(gc.mlp_add[1], nn.LayerNorm)  # ratio 1/16, LN
    x = torch.randn(2, 64, 5, 4)
    torch.testing.assert_close(gc(x), x)  # last layer zero-initialised: starts as the identity
    both = create_attention("gc", 64, fusion="both")
    assert both.mlp_add is not None and both.mlp_scale is not None


def test_coord_defaults():
    for c, mip in ((16, 8), (64, 8), (256, 8), (512, 16), (1024, 32)):
        assert coord_mip(c) == max(8, c // 32) == mip
        assert create_attention("coord", c).conv1.out_channels == mip
    coord = create_attention("coord", 64)
    assert isinstance(coord.act, nn.Hardswish) and isinstance(coord.bn1, nn.BatchNorm2d)


@pytest.mark.parametrize("name", ["nonlocal", "mhsa2d"])
@pytest.mark.parametrize("train", [False, True])
def test_self_attention_starts_as_identity(name, train):
    block = create_attention(name, 32).train(train)
    x = torch.randn(2, 32, 5, 6)
    torch.testing.assert_close(block(x), x)
    y = block(x.requires_grad_())
    y.sum().backward()  # zero BN scale still lets its own weight learn
    assert block.norm.weight.grad.abs().sum() > 0


def test_nonlocal_defaults():
    nl = create_attention("nonlocal", 64)
    assert nl.inter_channels == 32  # the paper halves the width
    assert nl.qkv.out_features == 3 * 32 and nl.proj.out_channels == 64
    assert math.isclose(nl.scale, 32**-0.5)
    assert nl.norm.weight.abs().sum() == 0
    assert create_attention("nonlocal", 64, use_scale=False).scale == 1.0


def test_mhsa2d_defaults_and_any_size():
    block = create_attention("mhsa2d", 64)
    assert block.num_heads == 4 and block.qkv.bias is None  # BoTNet: 4 heads, no qkv bias
    small = build("mhsa2d", max_size=3).train()  # tables shorter than the map: resampled
    x = torch.randn(2, C, 7, 5, requires_grad=True)
    small(x).sum().backward()
    assert torch.isfinite(x.grad).all() and small.rel_h.grad.abs().sum() > 0


@pytest.mark.parametrize("scale_pos", [False, True])
def test_mhsa2d_attention_is_timms_bottleneck_attn(scale_pos):
    """mhsa2d's attention output ``y`` is timm's BottleneckAttn ('bottleneck') with ``scale_pos_embed=scale_pos``,
    on a non-square map with tables longer than it (timm's sized to the map: they are the centre rows here):
    with ``proj`` the identity and no norm the block is ``x + y``. Outputs, input and parameter gradients in
    float64."""
    from timm.layers.bottleneck_attn import BottleneckAttn

    C_, H, W, M = 32, 5, 7, 8
    torch.manual_seed(0)
    ref = BottleneckAttn(C_, feat_size=(H, W), num_heads=4, scale_pos_embed=scale_pos).double()
    ours = create_attention("mhsa2d", C_, max_size=M, scale_pos=scale_pos, norm_layer=nn.Identity).double()
    with torch.no_grad():
        ours.qkv.weight.copy_(ref.qkv.weight.view(3 * C_, C_))
        ours.rel_h.normal_()  # rows outside the map's offsets: unused, so anything
        ours.rel_w.normal_()
        ours.rel_h[M - H : M + H - 1] = ref.pos_embed.height_rel
        ours.rel_w[M - W : M + W - 1] = ref.pos_embed.width_rel
        ours.proj.weight.copy_(torch.eye(C_).view(C_, C_, 1, 1))
        ours.proj.bias.zero_()
    ours.proj.requires_grad_(False)
    x = torch.randn(2, C_, H, W, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa) - xa, ref(xb)
    torch.testing.assert_close(ya, yb, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(x)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours.qkv.weight.grad, ref.qkv.weight.grad.view(3 * C_, C_), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours.rel_h.grad[M - H : M + H - 1], ref.pos_embed.height_rel.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours.rel_w.grad[M - W : M + W - 1], ref.pos_embed.width_rel.grad, rtol=1e-10, atol=1e-10)
    assert ours.rel_h.grad[: M - H].abs().sum() == 0  # offsets the map does not have get nothing
    if not scale_pos:  # the two scalings are different functions: the option is not vacuous
        other = create_attention("mhsa2d", C_, max_size=M, scale_pos=True, norm_layer=nn.Identity).double()
        other.load_state_dict(ours.state_dict())
        assert (other(x) - x - yb).abs().max() > 1e-3


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_nonlocal_is_timms_nonlocal_attn(train):
    """timm's NonLocalAttn ('nl') is nonlocal at timm's width (C/8, divisor 8) with ``scale_by="channels"``:
    its t, p, g convs are the rows of ``qkv``. Outputs, gradients and BN statistics in float64."""
    from timm.layers import NonLocalAttn, make_divisible

    C_ = 64
    torch.manual_seed(0)
    ref = randomize_(NonLocalAttn(C_), seed=5).double().train(train)
    inter = ref.t.out_channels
    assert inter == make_divisible(C_ / 8, 8)
    ours = create_attention("nonlocal", C_, rd_channels=inter, scale_by="channels").double().train(train)
    assert math.isclose(ours.scale, ref.scale)
    with torch.no_grad():
        ours.qkv.weight.copy_(torch.cat([ref.t.weight, ref.p.weight, ref.g.weight]).flatten(1))
        ours.qkv.bias.copy_(torch.cat([ref.t.bias, ref.p.bias, ref.g.bias]))
        ours.proj.load_state_dict(ref.z.state_dict())
        ours.norm.load_state_dict(ref.norm.state_dict())
    x = torch.randn(2, C_, 6, 5, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), ref(xb)
    torch.testing.assert_close(ya, yb, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(x)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours.qkv.weight.grad, torch.cat([ref.t.weight.grad, ref.p.weight.grad,
                                                                ref.g.weight.grad]).flatten(1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours.proj.weight.grad, ref.z.weight.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours.norm.running_var, ref.norm.running_var, rtol=1e-10, atol=1e-12)
    assert create_attention("nonlocal", C_).scale == create_attention("nonlocal", C_, scale_by="inter").scale == 32**-0.5


def test_timm_variant_defaults():
    """The options' own defaults, as their sources have them."""
    ese = create_attention("se", 64, effective=True)
    assert ese.fc.in_channels == ese.fc.out_channels == 64 and ese.fc.bias is not None
    assert not hasattr(ese, "fc1")
    z = torch.linspace(-5, 5, 101)
    assert torch.equal(ese.gate(z), nn.Hardsigmoid()(z))  # CenterMask's hard sigmoid, relu6(z + 3) / 6
    assert isinstance(create_attention("se", 64).gate, nn.Sigmoid)
    ecam = create_attention("eca", 64, use_mlp=True)
    assert (ecam.conv.out_channels, ecam.conv.kernel_size, ecam.conv2.kernel_size) == (8, (1,), (3,))
    assert isinstance(ecam.act, nn.ReLU) and ecam.conv.bias is not None and ecam.conv2.bias is not None
    assert create_attention("eca", 64).padding == "zeros"
    light = create_attention("cbam", 64, light=True)
    assert light.spatial.conv.in_channels == 1 and light.channel.fc1.out_channels == 4
    coord = create_attention("coord", 64)
    assert coord.combine == "product" and coord.conv1.bias is not None  # the paper's code has biases
    strip = create_attention("strip", 64)
    assert strip.conv_h.kernel_size == (3, 1) and strip.conv_w.kernel_size == (1, 3)
    assert strip.conv_h.groups == 64 and strip.conv_h.bias is None and isinstance(strip.gate, nn.Sigmoid)
    assert create_attention("mhsa2d", 64).scale_pos is True


@pytest.mark.parametrize("name,options,needles", [
    ("se", dict(effective="yes"), ("effective", "True or False")),
    ("se", dict(effective=True, rd_channels=4), ("rd_channels", "effective")),
    ("eca", dict(padding="reflect"), ("padding", "circular")),
    ("eca", dict(use_mlp=1), ("use_mlp",)),
    ("cbam", dict(light="no"), ("light",)),
    ("spatial", dict(light=None), ("light",)),
    ("coord", dict(combine="mean"), ("combine", "product", "sum")),
    ("coord", dict(bias=0), ("bias",)),
    ("gc", dict(norm_eps=0.0), ("norm_eps",)),
    ("strip", dict(use_conv=False, init="identity"), ("use_conv", "identity")),
    ("strip", dict(kernel_size=4), ("kernel_size",)),
    ("nonlocal", dict(scale_by="heads"), ("scale_by", "inter", "channels")),
    ("mhsa2d", dict(scale_pos="yes"), ("scale_pos",)),
])
def test_variant_options_are_checked_in_one_line(name, options, needles):
    _one_line_value_error(lambda: create_attention(name, 64, **options), *needles)


def test_circular_eca_needs_enough_channels():
    block = create_attention("eca", 64, padding="circular", kernel_size=7)
    assert block(torch.randn(2, 3, 4, 4)).shape == (2, 3, 4, 4)  # 3 channels: wraps by 3
    _one_line_value_error(lambda: block(torch.randn(2, 2, 4, 4)), "circular", "at least 3")


def test_rel_pos_embed_indexes_offsets():
    table = torch.arange(7.0)[:, None]  # offsets -3..3 stored at 0..6, centre 3
    e = rel_pos_embed(table, 3)  # (3, 3, 1): E[i, j] = table[j - i + 3]
    assert e[..., 0].tolist() == [[3, 4, 5], [2, 3, 4], [1, 2, 3]]
    big = rel_pos_embed(table, 6)  # 11 offsets resampled from 7; still centred
    assert big.shape == (6, 6, 1) and torch.allclose(big[..., 0].diagonal(), torch.full((6,), 3.0))


# ---- small widths, errors and edges ----------------------------------------------------------------------


@pytest.mark.parametrize("channels", [1, 2, 3, 5, 7])
def test_eca_matches_timm_below_8_channels(channels):
    ref = randomize_(EcaModule(channels), seed=4)
    ours = create_attention("eca", channels)
    load_by_order(ours, ref)  # raises if the kernel sizes differ
    x = torch.randn(2, channels, 5, 4)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["eca", "spatial"])
def test_any_channel_count(name):
    """eca and spatial have the same parameters for every width: a block built for 16 channels runs on 3
    and on 40 (the docstrings say so)."""
    block = build(name).train()
    for c in (1, 3, 40):
        x = torch.randn(2, c, 5, 4, requires_grad=True)
        y = block(x)
        y.sum().backward()
        assert y.shape == x.shape and torch.isfinite(x.grad).all()
    assert "any channel count" in " ".join(type(block).__doc__.split())


@pytest.mark.parametrize("channels", [4, 8, 16, 23, 40])
def test_gc_context_path_is_alive_for_small_widths(channels):
    """At ratio 1/16 a width <= 23 rounds to one hidden unit, whose LayerNorm outputs only its bias: the
    output would not depend on the input through the context. visattn keeps at least 4 hidden units."""
    block = randomize_(create_attention("gc", channels)).eval()
    assert block.mlp_add[0].out_features >= 4
    x = torch.randn(2, channels, 5, 4, requires_grad=True)
    context_part = block(x) - x  # the broadcast add: a function of the context alone
    (gx,) = torch.autograd.grad(context_part.square().sum(), x)
    assert gx.abs().max() > 1e-4
    block(x).sum().backward()
    assert block.conv_attn.weight.grad.abs().max() > 1e-6 and block.mlp_add[0].weight.grad.abs().max() > 1e-6


def test_gc_keeps_an_explicit_small_width_but_warns():
    with pytest.warns(UserWarning, match="rd_channels"):
        block = create_attention("gc", 16, rd_channels=1)
    assert block.mlp_add[0].out_features == 1
    assert create_attention("gc", 64).mlp_add[0].out_features == 4  # the default width is unchanged


def _one_line_value_error(fn, *needles):
    with pytest.raises(ValueError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


@pytest.mark.parametrize("name", [n for n in FEATURE if n != "none"])
def test_wrong_rank_or_channels_is_one_line_naming_the_block(name):
    block = build(name).eval()
    cls = type(block).__name__
    _one_line_value_error(lambda: block(torch.randn(2, C, 5)), cls, "H, W)", "(2, 16, 5)")
    _one_line_value_error(lambda: block(torch.randn(2, 1, C, 5, 4)), cls, "(2, 1, 16, 5, 4)")
    if name in ("eca", "spatial"):  # any channel count
        assert block(torch.randn(2, C + 3, 5, 4)).shape == (2, C + 3, 5, 4)
    else:
        _one_line_value_error(lambda: block(torch.randn(2, C + 3, 5, 4)), cls, f"(B, {C}, H, W)", "(2, 19, 5, 4)")


@pytest.mark.parametrize("name", ["spatial", "cbam", "nonlocal", "mhsa2d"])
def test_batchnorm_blocks_explain_batch_one_1x1_in_training(name):
    block = build(name).train()
    msg = _one_line_value_error(lambda: block(torch.randn(1, C, 1, 1)), type(block).__name__, "(1, 16, 1, 1)")
    assert "eval mode" in msg and "batch" in msg
    block.eval()
    assert block(torch.randn(1, C, 1, 1)).shape == (1, C, 1, 1)
    block.train()  # any other size trains
    assert block(torch.randn(1, C, 2, 1)).shape == (1, C, 2, 1)
    assert block(torch.randn(2, C, 1, 1)).shape == (2, C, 1, 1)


@pytest.mark.parametrize("name", ["se", "eca", "gc", "coord", "none"])
def test_other_blocks_train_on_batch_one_1x1(name):
    block = build(name).train()
    x = torch.randn(1, C, 1, 1, requires_grad=True)
    block(x).sum().backward()
    assert torch.isfinite(x.grad).all()

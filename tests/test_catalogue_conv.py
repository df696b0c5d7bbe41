"""Reference tests of the catalogue's convolution-replacing and global feature-map mechanisms (issue 90):
``sk``, ``splat``, ``halo``, ``lambda``, ``bat`` against timm's modules with the same weights, and ``psa``,
``criss_cross``, ``danet``, ``a2`` against their papers' equations (and the authors' code where it differs),
written out here; all in float64, outputs, input and parameter gradients to 1e-10 relative. Also the recorded
maps, the paper defaults, the identity starts of the options, and the double-backward references that
tests/test_compose.py takes from here (``CONV_REFERENCES``)."""
from __future__ import annotations

from functools import partial

import block_helpers
import pytest
import torch
import torch.nn.functional as F
from conftest import recording
from torch import nn

from visattn.attention import create_attention

timm = pytest.importorskip("timm")
from timm.layers.halo_attn import HaloAttn  # noqa: E402
from timm.layers.lambda_layer import LambdaLayer as TimmLambda  # noqa: E402
from timm.layers.non_local_attn import BatNonLocalAttn  # noqa: E402
from timm.layers.selective_kernel import SelectiveKernel as TimmSK  # noqa: E402
from timm.layers.split_attn import SplitAttn  # noqa: E402

C = 64


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# this file's weights: seed 3, spread 0.3, scalars around 1 as well as vectors (residual scales, gammas not zero)
randomize_ = partial(block_helpers.randomize_, seed=3, spread=0.3, around_one=(0, 1))


def copy_by_order(dst: nn.Module, src: nn.Module, skip=("scale", "norm")) -> None:
    """``src``'s state into ``dst`` entry by entry in registration order, ``dst``'s own additions (``skip``:
    the residual scale, lambda's BN after the mechanism) kept."""
    d = {k: v for k, v in dst.state_dict().items() if not own(k, skip)}
    s = list(src.state_dict().values())
    assert len(d) == len(s), (list(d), list(src.state_dict()))
    state = dict(dst.state_dict())
    state.update({k: v.reshape(d[k].shape) for k, v in zip(d, s)})
    dst.load_state_dict(state)


def own(key: str, skip=("scale", "norm")) -> bool:
    """Whether state entry ``key`` is one of the block's own additions to timm's mechanism."""
    return any(key == s or key.startswith(s + ".") for s in skip)


def assert_same(ours, ref_fn, x: torch.Tensor, ours_params, ref_params, tol: float = 1e-10) -> None:
    """Outputs, input gradients and parameter gradients of ``ours(x)`` and ``ref_fn(x)`` agree to ``tol``
    relative to the values' magnitude (float64)."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), ref_fn(xb)
    scale = 1 + yb.abs().max().item()
    assert (ya - yb).abs().max().item() <= tol * scale
    g = torch.randn_like(ya)
    ga = torch.autograd.grad((ya * g).sum(), [xa, *ours_params], allow_unused=True)
    gb = torch.autograd.grad((yb * g).sum(), [xb, *ref_params], allow_unused=True)
    assert len(ga) == len(gb)
    for i, (a, b) in enumerate(zip(ga, gb)):
        a = torch.zeros(()) if a is None else a
        b = torch.zeros(()) if b is None else b.reshape(a.shape)
        assert (a - b).abs().max().item() <= tol * (1 + b.abs().max().item()), i
    assert ga[0].abs().max() > 1e-3  # not vacuous


def conv1x1(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """A 1x1 conv written as a sum over the input channels."""
    y = torch.einsum("oc,bchw->bohw", conv.weight[:, :, 0, 0], x)
    return y if conv.bias is None else y + conv.bias[None, :, None, None]


# ---- timm's mechanisms --------------------------------------------------------------------------------------------

TIMM = [  # (id, name, options, timm module, its output is the residual block itself)
    ("sk-paper", "sk", {}, lambda: TimmSK(C, rd_channels=32, split_input=False), False),
    ("sk-timm", "sk", dict(split_input=True, min_rd=1), lambda: TimmSK(C), False),
    ("splat", "splat", {}, lambda: SplitAttn(C), False),
    ("splat-bn", "splat", dict(norm_layer=nn.BatchNorm2d), lambda: SplitAttn(C, norm_layer=nn.BatchNorm2d), False),
    ("splat-r4-g2", "splat", dict(radix=4, cardinality=2), lambda: SplitAttn(C, radix=4, groups=2), False),
    ("halo", "halo", {}, lambda: HaloAttn(C), False),
    ("halo-b4-h1-bias", "halo", dict(block_size=4, halo_size=1, qkv_bias=True),
     lambda: HaloAttn(C, block_size=4, halo_size=1, qkv_bias=True), False),
    ("lambda", "lambda", {}, lambda: TimmLambda(C), False),
    ("lambda-r5", "lambda", dict(r=5, num_heads=2, dim_head=8), lambda: TimmLambda(C, r=5, num_heads=2, dim_head=8),
     False),
    ("bat", "bat", {}, lambda: BatNonLocalAttn(C, drop_rate=0.0), True),
]


@pytest.mark.parametrize("key,name,options,make,whole", TIMM, ids=[t[0] for t in TIMM])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_matches_timm(key, name, options, make, whole, train):
    """At ``scale = 1`` (``init="default"``) the block is ``x + timm(x)`` (BAT: ``timm(x)``, its own residual;
    lambda: ``x + BN(timm(x))``), weight for weight; maps divisible by halo's 8 and BAT's 7 blocks."""
    ref = randomize_(make()).double().train(train)
    ours = create_attention(name, C, **options).double().train(train)
    copy_by_order(ours, ref)
    size = {"halo": (16, 8), "bat": (14, 21)}.get(name, (9, 7))
    x = torch.randn(2, C, *size, dtype=torch.float64)
    if name == "lambda":
        def reference(x):
            return x + ours.norm(ref(x))

        extra = list(ours.norm.parameters())
        assert_same(ours, reference, x, list(ours.parameters()), [*ref.parameters(), *extra])
    else:
        assert ours.scale.item() == 1.0
        scale = ours.scale

        def reference(x):
            return x + scale * (ref(x) - x if whole else ref(x))

        assert_same(ours, reference, x, list(ours.parameters()), [scale, *ref.parameters()])
    ours_buffers = [(n, b) for n, b in ours.named_buffers() if not own(n)]
    ref_buffers = list(ref.buffers())
    assert len(ours_buffers) == len(ref_buffers)
    for (bn, b), rb in zip(ours_buffers, ref_buffers):  # BatchNorm statistics updated exactly once, alike
        torch.testing.assert_close(b, rb.reshape(b.shape), rtol=1e-10, atol=1e-12, msg=bn)


def test_halo_on_any_map_is_timms_on_the_zero_padded_map():
    """On a 13 x 10 map (not a multiple of the block size 8) the block is ``x + crop(timm(pad(x)))``, the map
    zero-padded to 16 x 16 (no qkv bias: padded positions project to zero keys and values)."""
    ref = randomize_(HaloAttn(C)).double()
    ours = create_attention("halo", C).double()
    copy_by_order(ours, ref)
    x = torch.randn(2, C, 13, 10, dtype=torch.float64)

    def reference(x):
        return x + ours.scale * ref(F.pad(x, (0, 6, 0, 3)))[:, :, :13, :10]

    assert_same(ours, reference, x, list(ours.parameters()), [ours.scale, *ref.parameters()])
    assert create_attention("halo", C)(torch.randn(1, C, 1, 1)).shape == (1, C, 1, 1)


def bat_reference(block, x: torch.Tensor) -> torch.Tensor:
    """BAT with timm's ``resize_mat`` on the reduced map zero-padded to a multiple of the block size, cropped,
    and ``F.adaptive_max_pool2d`` for the bins: timm's forward where the map is divisible."""
    xl = block.conv1(x)
    B, c, H, W = xl.shape
    bs, G = block.block_size, block.groups
    t = block.ba_conv1(xl)
    p = block.conv_p(F.adaptive_max_pool2d(t, (bs, 1))).view(B, G, bs, bs).sigmoid()
    q = block.conv_q(F.adaptive_max_pool2d(t, (1, bs))).view(B, G, bs, bs).sigmoid()
    p, q = p / p.sum(3, keepdim=True), q / q.sum(2, keepdim=True)
    th, tw = -(-H // bs), -(-W // bs)
    P = torch.einsum("zgij,ab->zgiajb", p, torch.eye(th, dtype=x.dtype)).reshape(B, G, bs * th, bs * th)  # kron
    Q = torch.einsum("zgij,ab->zgiajb", q, torch.eye(tw, dtype=x.dtype)).reshape(B, G, bs * tw, bs * tw)
    padded = F.pad(xl, (0, bs * tw - W, 0, bs * th - H)).view(B, G, c // G, bs * th, bs * tw)
    y = (P[:, :, None] @ padded @ Q[:, :, None])[..., :H, :W].reshape(B, c, H, W)
    return x + block.scale * block.conv2(block.ba_conv2(y))


@pytest.mark.parametrize("hw", [(10, 12), (5, 4), (1, 1), (14, 21)])
def test_bat_on_any_map_is_the_transform_of_the_zero_padded_map(hw):
    """On a map that is not a multiple of the block size, the bilinear transform is the one of the reduced map
    zero-padded to a multiple, cropped; the bins are adaptive max pooling's."""
    block = randomize_(create_attention("bat", C)).double().train()
    x = torch.randn(2, C, *hw, dtype=torch.float64)
    params = list(block.parameters())
    assert_same(block, lambda x: bat_reference(block, x), x, params, params)


# ---- papers' equations ------------------------------------------------------------------------------------------


def psa_reference(block, x: torch.Tensor) -> torch.Tensor:
    """PSA written from the paper's Sec. 3: the channel-only and spatial-only branches, their parallel and
    sequential compositions; ``variant="code"``: the authors' ``PSA_p`` / ``PSA_s`` (no LayerNorm; the spatial softmax
    over the positions of the logits)."""
    code = block.variant == "code"

    def a_ch(x):  # (B, C, 1, 1)
        B, _, H, W = x.shape
        wq = F.softmax(conv1x1(x, block.ch_wq).reshape(B, H * W), dim=1)  # F_SM over the positions
        z = torch.einsum("bcn,bn->bc", conv1x1(x, block.ch_wv).reshape(B, -1, H * W), wq)
        logits = z @ block.ch_wz.weight[:, :, 0, 0].T  # W_z
        if not code:
            logits = F.layer_norm(logits, (logits.shape[1],), block.ln.weight, block.ln.bias, block.ln.eps)
        return torch.sigmoid(logits)[:, :, None, None]

    def a_sp(x):  # (B, 1, H, W)
        B, _, H, W = x.shape
        g = conv1x1(x, block.sp_wq).mean((2, 3))  # F_GP
        v = conv1x1(x, block.sp_wv)
        if code:
            logits = F.softmax(torch.einsum("bc,bchw->bhw", g, v).reshape(B, -1), dim=1).reshape(B, H, W)
        else:
            logits = torch.einsum("bc,bchw->bhw", F.softmax(g, dim=1), v)  # F_SM over the channels
        return torch.sigmoid(logits)[:, None]

    if block.layout == "parallel":
        return a_ch(x) * x + a_sp(x) * x
    xc = a_ch(x) * x
    return a_sp(xc) * xc


def criss_cross_reference(block, x: torch.Tensor) -> torch.Tensor:
    """CCNet's Eqs. 1-2 position by position: query ``u`` against the keys of its column (itself left out)
    and of its row, one softmax, the values summed, ``gamma`` times that added; ``recurrence`` times."""
    for _ in range(block.recurrence):
        B, Cx, H, W = x.shape
        q, k, v = conv1x1(x, block.query_conv), conv1x1(x, block.key_conv), conv1x1(x, block.value_conv)
        cols = []
        for h in range(H):
            row = []
            for w in range(W):
                cross = [(i, w) for i in range(H) if i != h] + [(h, j) for j in range(W)]
                keys = torch.stack([k[:, :, i, j] for i, j in cross], dim=-1)  # (B, d, H + W - 1)
                vals = torch.stack([v[:, :, i, j] for i, j in cross], dim=-1)  # (B, C, H + W - 1)
                a = F.softmax(torch.einsum("bd,bdk->bk", q[:, :, h, w], keys), dim=-1)  # Eq. 1
                row.append(torch.einsum("bk,bck->bc", a, vals))  # Eq. 2
            cols.append(torch.stack(row, dim=-1))
        x = x + block.gamma * torch.stack(cols, dim=-2)
    return x


def danet_reference(block, x: torch.Tensor) -> torch.Tensor:
    """DANet's Eqs. 1-2 (position module) and 3-4 (channel module, or the authors' ``max - energy``)."""
    B, Cx, H, W = x.shape
    out = x
    if block.position:
        Bq, Ck = conv1x1(x, block.query_conv).flatten(2), conv1x1(x, block.key_conv).flatten(2)
        D = conv1x1(x, block.value_conv).flatten(2)
        s = F.softmax(torch.einsum("bdj,bdi->bji", Bq, Ck), dim=-1)  # Eq. 1: s_ji over the positions i
        out = out + block.alpha * torch.einsum("bji,bci->bcj", s, D).reshape(B, Cx, H, W)  # Eq. 2
    if block.channel:
        A = x.flatten(2)
        energy = torch.einsum("bin,bjn->bji", A, A)  # A_j . A_i
        if block.channel_energy == "code":
            energy = energy.max(dim=-1, keepdim=True)[0] - energy
        xa = F.softmax(energy, dim=-1)  # Eq. 3
        out = out + block.beta * torch.einsum("bji,bin->bjn", xa, A).reshape(B, Cx, H, W)  # Eq. 4
    return out


def a2_reference(block, x: torch.Tensor) -> torch.Tensor:
    """A^2-Nets, Sec. 3: gathering ``g_k = sum_j softmax_j(B)_kj a_j`` (second-order attention pooling),
    distribution ``z_i = sum_k softmax_k(V)_ki g_k``, a 1x1 conv back to ``C``, added to the input."""
    B, Cx, H, W = x.shape
    a = conv1x1(x, block.convA).flatten(2)
    gather = F.softmax(conv1x1(x, block.convB).flatten(2), dim=2)
    distribute = F.softmax(conv1x1(x, block.convV).flatten(2), dim=1)
    g = torch.einsum("bmj,bkj->bmk", a, gather)
    z = torch.einsum("bmk,bki->bmi", g, distribute).reshape(B, -1, H, W)
    return x + conv1x1(z, block.conv_reconstruct)


PAPERS = [  # (id, name, options, reference)
    ("psa-parallel", "psa", {}, psa_reference),
    ("psa-sequential", "psa", dict(layout="sequential"), psa_reference),
    ("psa-code-parallel", "psa", dict(variant="code"), psa_reference),
    ("psa-code-sequential", "psa", dict(variant="code", layout="sequential"), psa_reference),
    ("criss_cross", "criss_cross", {}, criss_cross_reference),
    ("criss_cross-r2", "criss_cross", dict(recurrence=2), criss_cross_reference),
    ("danet", "danet", {}, danet_reference),
    ("danet-code", "danet", dict(channel_energy="code"), danet_reference),
    ("danet-position", "danet", dict(parts="position"), danet_reference),
    ("danet-channel", "danet", dict(parts="channel"), danet_reference),
    ("a2", "a2", {}, a2_reference),
]


@pytest.mark.parametrize("key,name,options,reference", PAPERS, ids=[p[0] for p in PAPERS])
@pytest.mark.parametrize("recording_on", [False, True], ids=["fused", "recording"])
def test_matches_the_paper(key, name, options, reference, recording_on):
    """Both paths (fused attention, and the explicit one taken while a recorder listens) against the
    reference; small weights keep the unscaled logits of CCNet and DANet out of saturation."""
    block = create_attention(name, 16, **options).double().train()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3 + (0.5 if p.dim() <= 1 else 0.0))
    x = torch.randn(2, 16, 5, 4, dtype=torch.float64) * 0.5
    params = list(block.parameters())
    if recording_on:
        with recording(block) as records:
            assert_same(block, lambda x: reference(block, x), x, params, params)
        assert records
    else:
        assert_same(block, lambda x: reference(block, x), x, params, params)


# ---- the recorded maps ---------------------------------------------------------------------------------------------


def test_halo_records_each_windows_attention_in_the_full_map():
    block = randomize_(create_attention("halo", 16, num_heads=2, block_size=4, halo_size=1)).eval()
    H, W = 6, 7
    x = torch.randn(2, 16, H, W)
    with recording(block) as records:
        y = block(x)
    torch.testing.assert_close(y, block(x))
    (rec,) = records
    w = rec.weights
    assert rec.kind == "token" and w.shape == (2, 2, H * W, H * W) and rec.grid == (H, W)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, H * W))
    rows, cols = torch.arange(H).repeat_interleave(W), torch.arange(W).repeat(H)
    # query (r, c) in block (r // 4, c // 4) sees rows r // 4 * 4 - 1 .. r // 4 * 4 + 4 and the same for columns
    top, left = rows // 4 * 4 - 1, cols // 4 * 4 - 1
    inside = ((rows[None, :] >= top[:, None]) & (rows[None, :] <= top[:, None] + 5)
              & (cols[None, :] >= left[:, None]) & (cols[None, :] <= left[:, None] + 5))
    assert (w[:, :, ~inside] == 0).all() and (w[:, :, inside] > 0).all()


def test_criss_cross_records_zeros_off_the_cross_one_record_per_pass():
    block = randomize_(create_attention("criss_cross", 16, recurrence=2)).eval()
    H, W = 4, 5
    with recording(block) as records:
        block(torch.randn(2, 16, H, W))
    assert len(records) == 2 and records[0].name != records[1].name
    rows, cols = torch.arange(H).repeat_interleave(W), torch.arange(W).repeat(H)
    cross = (rows[:, None] == rows[None, :]) | (cols[:, None] == cols[None, :])
    for rec in records:
        assert rec.weights.shape == (2, 1, H * W, H * W)
        assert (rec.weights[..., ~cross] == 0).all() and (rec.weights[..., cross] > 0).all()
        torch.testing.assert_close(rec.weights.sum(-1), torch.ones(2, 1, H * W))


def test_a2_and_bat_record_row_stochastic_attention_that_reproduces_the_mix():
    block = randomize_(create_attention("a2", 16)).eval()
    x = torch.randn(2, 16, 5, 6)
    with recording(block) as records:
        block(x)
    (rec,) = records
    torch.testing.assert_close(rec.weights.sum(-1), torch.ones(2, 1, 30))
    # z = (G softmax(V)) equals the recorded weights applied to the features convA(x)
    a = block.convA(x).flatten(2)
    z = a @ rec.weights[:, 0].transpose(1, 2)
    want = (a @ block.convB(x).flatten(2).softmax(-1).transpose(1, 2)) @ block.convV(x).flatten(2).softmax(1)
    torch.testing.assert_close(z, want, rtol=1e-5, atol=1e-5)
    bat = randomize_(create_attention("bat", 16)).eval()
    with recording(bat) as records:
        bat(torch.randn(2, 16, 14, 7))
    (rec,) = records
    assert rec.weights.shape == (2, 2, 98, 98)
    torch.testing.assert_close(rec.weights.sum(-1), torch.ones(2, 2, 98))


def test_lambda_records_the_keys_softmax_over_positions():
    block = randomize_(create_attention("lambda", 16)).eval()
    x = torch.randn(2, 16, 5, 6)
    with recording(block) as records:
        block(x)
    (rec,) = records
    assert rec.kind == "spatial" and rec.value_scale == "relative" and rec.weights.shape == (2, 1, 5, 6)
    torch.testing.assert_close(rec.weights.sum((2, 3)), torch.ones(2, 1))
    k = block.qkv(x)[:, 4 * 16: 4 * 16 + 16].flatten(2).softmax(-1).mean(1)
    torch.testing.assert_close(rec.weights.flatten(1), k.detach(), rtol=1e-5, atol=1e-6)


def test_danet_records_position_attention_and_channel_weights():
    block = randomize_(create_attention("danet", 16)).eval()
    with recording(block) as records:
        block(torch.randn(2, 16, 3, 4))
    kinds = {r.kind: r for r in records}
    assert set(kinds) == {"token", "channel"}
    torch.testing.assert_close(kinds["token"].weights.sum(-1), torch.ones(2, 1, 12))
    torch.testing.assert_close(kinds["channel"].weights.sum(-1), torch.ones(2))


# ---- paper defaults and identity starts ------------------------------------------------------------------------


def test_paper_defaults():
    sk = create_attention("sk", 64)
    assert sk.num_paths == 2 and not sk.split_input  # a 3x3 and a 5x5 (as a 3x3, dilation 2), full input each
    assert [p[0].dilation for p in sk.paths] == [(1, 1), (2, 2)] and sk.fc_reduce.out_channels == 32  # max(C/16, 32)
    assert create_attention("sk", 1024).fc_reduce.out_channels == 64
    splat = create_attention("splat", 64)
    assert splat.radix == 2 and splat.cardinality == 1 and splat.fc1.out_channels == 32  # max(C * 2 / 4, 32)
    assert create_attention("splat", 256).fc1.out_channels == 128
    halo = create_attention("halo", 64)
    assert (halo.block_size, halo.halo_size, halo.num_heads, halo.q.bias) == (8, 3, 8, None)
    lam = create_attention("lambda", 64)
    assert (lam.dim_qk, lam.num_heads, lam.dim_v, lam.r) == (16, 4, 16, 9)
    bat = create_attention("bat", 64)
    assert (bat.block_size, bat.groups, bat.conv1[0].out_channels, bat.dropout.p) == (7, 2, 16, 0.0)
    psa = create_attention("psa", 64)
    assert (psa.layout, psa.variant, psa.ch_wv.out_channels, psa.sp_wq.out_channels) == ("parallel", "paper", 32, 32)
    assert isinstance(psa.ln, nn.LayerNorm) and create_attention("psa", 64, variant="code").ln is None
    cc = create_attention("criss_cross", 64)
    assert (cc.recurrence, cc.query_conv.out_channels, cc.value_conv.out_channels) == (1, 8, 64)
    assert cc.gamma.item() == 0
    dan = create_attention("danet", 64)
    assert (dan.query_conv.out_channels, dan.alpha.item(), dan.beta.item(), dan.channel_energy) == (8, 0, 0, "paper")
    a2 = create_attention("a2", 64)
    assert (a2.c_m, a2.c_n) == (16, 16)


VARIANTS = [("psa", dict(layout="sequential")), ("psa", dict(variant="code")),
            ("psa", dict(variant="code", layout="sequential")), ("criss_cross", dict(recurrence=2)),
            ("danet", dict(channel_energy="code")), ("sk", dict(split_input=True)),
            ("splat", dict(norm_layer=nn.BatchNorm2d, radix=1)), ("halo", dict(qkv_bias=True, block_size=3)),
            ("bat", dict(block_size=3, groups=4))]


@pytest.mark.parametrize("name,options", VARIANTS, ids=[f"{n}-{'-'.join(map(str, o.values()))}" for n, o in VARIANTS])
@pytest.mark.parametrize("hw", [(8, 8), (7, 9), (1, 1)])
def test_options_start_as_the_identity_and_learn(name, options, hw):
    block = create_attention(name, 32, init="identity", **options).train()
    x = torch.randn(2, 32, *hw)
    assert torch.equal(block(x), x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(block(x), x)
    block(x).square().sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in block.parameters())


@pytest.mark.parametrize("name", ["sk", "splat", "halo", "lambda", "bat", "a2"])
def test_default_init_is_not_the_identity_and_zero_init_last_restores_it(name):
    x = torch.randn(2, 32, 8, 8)
    assert not torch.equal(create_attention(name, 32).eval()(x), x)
    block = create_attention(name, 32, init="identity").eval()
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.1)
    assert not torch.equal(block(x), x)
    block.zero_init_last()  # timm's hook after its own init
    if name == "lambda":
        assert block.norm.weight.abs().sum() == 0 and block.norm.bias.abs().sum() == 0
    elif name != "a2":
        assert block.scale.item() == 0
    assert torch.equal(block(x), x)


def test_sk_and_splat_train_on_batch_one():
    """The BatchNorm over pooled statistics normalises a batch of one with its running statistics."""
    for name, opts, pooled in (("sk", {}, "bn"), ("splat", dict(norm_layer=nn.BatchNorm2d), "bn1")):
        block = randomize_(create_attention(name, 16, **opts)).train()
        before = [b.clone() for b in block.buffers()]
        kept = [b.clone() for b in getattr(block, pooled).buffers()]
        x = torch.randn(1, 16, 5, 4, requires_grad=True)
        y = block(x)
        y.sum().backward()
        assert torch.isfinite(x.grad).all()
        assert any(not torch.equal(a, b) for a, b in zip(before, block.buffers()))  # the map's BN still updates
        assert all(torch.equal(a, b) for a, b in zip(kept, getattr(block, pooled).buffers()))  # the pooled one not
        getattr(block, pooled).eval()
        torch.testing.assert_close(block(x), y)  # it normalised with its running statistics


@pytest.mark.parametrize("name,options,needle", [
    ("sk", dict(kernel_size=[3]), "at least 2 paths"), ("sk", dict(kernel_size=(3, 4)), "kernel_size"),
    ("sk", dict(split_input=True, kernel_size=(3, 5, 7)), "divisible"), ("splat", dict(cardinality=3), "cardinality"),
    ("halo", dict(num_heads=5), "num_heads"), ("halo", dict(halo_size=-1), "halo_size"),
    ("lambda", dict(r=4), "r must"), ("bat", dict(groups=3), "groups"), ("bat", dict(drop_rate=1.5), "drop_rate"),
    ("psa", dict(layout="stacked"), "layout"), ("psa", dict(variant="mine"), "variant"),
    ("criss_cross", dict(recurrence=0), "recurrence"), ("danet", dict(parts="spatial"), "parts"),
    ("danet", dict(channel_energy="max"), "channel_energy"), ("a2", dict(rd_ratio=2), "rd_ratio"),
])
def test_bad_options_are_one_line(name, options, needle):
    with pytest.raises(ValueError) as e:
        create_attention(name, 64, **options)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_catalogue_attributes():
    for name in ("sk", "splat", "halo", "lambda", "bat", "psa", "criss_cross", "danet", "a2"):
        cls = type(create_attention(name, 16))
        assert cls.PAPER and cls.CHECKED_AGAINST and cls.IDENTITY, name
        assert "arXiv" in cls.PAPER or "CVPR" in cls.PAPER


@pytest.mark.parametrize("name", ["criss_cross", "a2", "bat"])
def test_global_blocks_stay_cheap_at_64_channels_on_32x32(name):
    """No N x N product unless recording: at 64 channels on a 32 x 32 map (N = 1024) each block costs less than
    a quarter of the non-local block's matmul FLOPs (criss-cross: 13%; A^2 and BAT far less); A^2's recording
    (the explicit N x N weights) costs more."""
    from torch.utils.flop_counter import FlopCounterMode

    def flops(block, record=False):
        x = torch.randn(1, 64, 32, 32)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            if record:
                with recording(block):
                    block(x)
            else:
                block(x)
        return counter.get_total_flops()

    dense = flops(create_attention("nonlocal", 64).eval(), record=True)  # explicit (N, N) softmax attention
    block = create_attention(name, 64).eval()
    assert flops(block) < dense / 4, (name, flops(block), dense)
    if name == "a2":
        assert flops(block, record=True) > flops(block)


# ---- double-backward references for tests/test_compose.py ----------------------------------------------------------


def _timm_ref(make):
    """``x + scale * timm(x)`` with the block's weights; parameters in the block's order (``scale`` first)."""
    def reference(block):
        ref = make(block).double().train()
        copy_into(ref, block)
        scale = block.scale.detach().clone().requires_grad_()

        def fn(x):
            return x + scale * ref(x)

        return fn, [scale, *ref.parameters()]

    return reference


def copy_into(ref: nn.Module, block: nn.Module) -> None:
    """The block's state (less ``scale``) into timm's module, entry by entry."""
    s = [v for k, v in block.state_dict().items() if not own(k)]
    d = ref.state_dict()
    assert len(d) == len(s)
    ref.load_state_dict({k: v.reshape(d[k].shape) for k, v in zip(d, s)})


def _lambda_ref(block):
    """``x + BN(timm(x))`` with the block's weights and its own BN; parameters in the block's order."""
    ref = TimmLambda(block.channels).double().train()
    copy_into(ref, block)
    return (lambda x: x + block.norm(ref(x))), [*ref.parameters(), *block.norm.parameters()]


def _explicit(reference):
    def build(block):
        return (lambda x: reference(block, x)), list(block.parameters())

    return build


CONV_REFERENCES = {
    "sk": _timm_ref(lambda b: TimmSK(b.channels, rd_channels=b.fc_reduce.out_channels, split_input=False)),
    "splat": _timm_ref(lambda b: SplitAttn(b.channels)),
    "halo": _timm_ref(lambda b: PaddedHalo(b.channels, num_heads=b.num_heads)),
    "lambda": _lambda_ref,
    "bat": _explicit(bat_reference),
    "psa": _explicit(psa_reference),
    "criss_cross": _explicit(criss_cross_reference),
    "danet": _explicit(danet_reference),
    "a2": _explicit(a2_reference),
}


class PaddedHalo(HaloAttn):
    """timm's HaloAttn on the map zero-padded to a multiple of its block size, cropped back."""

    def forward(self, x):
        H, W = x.shape[-2:]
        b = self.block_size
        return super().forward(F.pad(x, (0, -W % b, 0, -H % b)))[:, :, :H, :W]

"""The gate mechanisms of issue 90 beyond SE (ge, ela, fca, gct, srm, sge, simam, triplet, bam, shuffle), each
against timm's module or a reference written here from the paper's equations and the authors' code, in float64
(outputs, input and parameter gradients to 1e-10 relative), plus the paper defaults and the edges (1x1 maps,
batch 1, non-square maps). The generic contract (dtypes, layouts, compile, export, ONNX, identity, insertion,
maps) is in the files parametrised over ``list_attention()``."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from block_helpers import close, load_by_order, randomize_
from timm.layers.coord_attn import EfficientLocalAttn
from timm.layers.gather_excite import GatherExcite as TimmGatherExcite
from timm.layers.mlp import ConvMlp
from torch import nn

from visattn.attention import AttentionTap, create_attention

NAMES = ["ge", "ela", "fca", "gct", "srm", "sge", "simam", "triplet", "bam", "shuffle"]


def same_function(ours, ref, x: torch.Tensor, train: bool, ref_params=None) -> None:
    """``ours`` and ``ref`` (float64, ``ours`` holding ``ref``'s weights) give the same output, input gradient,
    parameter gradients (in order) and BN statistics afterwards."""
    ours.double().train(train)
    if isinstance(ref, nn.Module):
        ref.double().train(train)
    x = x.double()
    g = torch.randn_like(x)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), ref(xb)
    close(ya, yb, "output")
    assert not torch.equal(ya, xa), "the comparison is vacuous"
    ya.backward(g)
    yb.backward(g)
    close(xa.grad, xb.grad, "input gradient")
    theirs = list(ref.parameters()) if ref_params is None else ref_params
    mine = list(ours.parameters())
    assert len(mine) == len(theirs)
    for p, q in zip(mine, theirs):
        close(p.grad, q.grad, f"gradient of a {tuple(p.shape)} parameter")
    if isinstance(ref, nn.Module):
        for (name, b), rb in zip(ours.named_buffers(), [b for n, b in ref.named_buffers() if "dct" not in n]):
            if b.is_floating_point():
                close(b, rb, name)


SIZES = [(9, 7), (1, 1), (3, 8)]


# ---- ge: timm's GatherExcite ---------------------------------------------------------------------------------


def timm_ge(channels: int, extent: int, use_mlp: bool, hidden: int = 0) -> nn.Module:
    """timm's GatherExcite; its MLP (``ConvMlp(channels, rd, act_layer=...)`` with a ``*dd`` that should be
    ``**dd``, so it cannot be built in timm 1.0.31) is set here as timm means it."""
    ref = TimmGatherExcite(channels, extent=extent, use_mlp=False)
    if use_mlp:
        ref.mlp = ConvMlp(channels, hidden or channels // 16, act_layer=nn.ReLU)
    return ref


@pytest.mark.parametrize("extent", [0, 2, 4])
@pytest.mark.parametrize("use_mlp", [True, False])
@pytest.mark.parametrize("hw", SIZES)
def test_ge_matches_timm(extent, use_mlp, hw):
    torch.manual_seed(0)
    ref = randomize_(timm_ge(64, extent, use_mlp), seed=1)
    ours = create_attention("ge", 64, extent=extent, use_mlp=use_mlp)
    load_by_order(ours, ref)
    same_function(ours, ref, torch.randn(3, 64, *hw), train=True)


def test_ge_cannot_be_built_by_timm_with_its_default_mlp():
    """Why the test above sets timm's MLP itself: the bug the issue names."""
    with pytest.raises(Exception):
        TimmGatherExcite(64)


@pytest.mark.parametrize("train", [True, False])
def test_ge_theta_gather_with_parameters(train):
    """``extra_params=True``, extent 4 (GE-theta): two strided depthwise 3x3 convs with BN and ReLU between,
    then the MLP, a sigmoid and nearest upsampling (the paper's Sec. 3 operator, timm's layer names)."""
    torch.manual_seed(0)
    ours = randomize_(create_attention("ge", 32, extent=4, extra_params=True), seed=2)
    gather = nn.Sequential(nn.Conv2d(32, 32, 3, 2, 1, groups=32, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                           nn.Conv2d(32, 32, 3, 2, 1, groups=32, bias=False), nn.BatchNorm2d(32))
    mlp = ConvMlp(32, 2, act_layer=nn.ReLU)
    ref = nn.ModuleDict({"gather": gather, "mlp": mlp})
    load_by_order(ref, ours)

    def forward(x):
        return x * torch.sigmoid(F.interpolate(mlp(gather(x)), size=x.shape[-2:]))

    ref.double().train(train)
    same_function(ours, forward, torch.randn(2, 32, 11, 6), train=train, ref_params=list(ref.parameters()))


@pytest.mark.parametrize("train", [True, False])
def test_ge_theta_global_gather(train):
    """GE-theta with the global extent: a depthwise conv as large as the map, no padding (one value per
    channel), BN, the MLP and a sigmoid; any other map size is a one-line error."""
    torch.manual_seed(0)
    ours = randomize_(create_attention("ge", 32, extra_params=True, feat_size=(5, 4)), seed=3)
    ref = nn.ModuleDict({"gather": nn.Sequential(nn.Conv2d(32, 32, (5, 4), groups=32, bias=False),
                                                 nn.BatchNorm2d(32)), "mlp": ConvMlp(32, 2, act_layer=nn.ReLU)})
    load_by_order(ref, ours)
    ref.double().train(train)
    same_function(ours, lambda x: x * torch.sigmoid(ref.mlp(ref.gather(x))), torch.randn(3, 32, 5, 4), train=train,
                  ref_params=list(ref.parameters()))
    with pytest.raises(ValueError, match="feat_size"):
        ours(torch.randn(2, 32, 6, 4).double())
    with pytest.raises(ValueError, match="feat_size"):
        create_attention("ge", 32, extra_params=True)


# ---- ela: timm's EfficientLocalAttn --------------------------------------------------------------------------


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("hw", SIZES)
def test_ela_matches_timm(train, hw):
    ref = randomize_(EfficientLocalAttn(64), seed=3)
    ours = create_attention("ela", 64)
    load_by_order(ours, ref)
    same_function(ours, ref, torch.randn(3, 64, *hw), train=train)


class AuthorsELA(nn.Module):
    """The authors' ELA: one Conv1d and one GroupNorm shared by the two strips, a sigmoid, ``x_h * x_w * x``."""

    def __init__(self, c, phi):
        super().__init__()
        k = {"T": 5, "B": 7, "S": 5, "L": 7}[phi]
        groups = {"T": c, "B": c, "S": c // 8, "L": c // 8}[phi]
        self.con1 = nn.Conv1d(c, c, kernel_size=k, padding=k // 2, groups=groups, bias=False)
        self.GN = nn.GroupNorm({"T": 32, "B": 16, "S": 16, "L": 16}[phi], c)

    def forward(self, x):
        b, c, h, w = x.shape
        x_h = torch.sigmoid(self.GN(self.con1(x.mean(3)))).view(b, c, h, 1)
        x_w = torch.sigmoid(self.GN(self.con1(x.mean(2)))).view(b, c, 1, w)
        return x_h * x_w * x


@pytest.mark.parametrize("phi", ["T", "B", "S", "L"])
@pytest.mark.parametrize("hw", SIZES)
def test_ela_phi_matches_the_authors_code(phi, hw):
    ref = randomize_(AuthorsELA(64, phi), seed=3)
    ours = create_attention("ela", 64, phi=phi)
    load_by_order(ours, ref)
    same_function(ours, ref, torch.randn(3, 64, *hw), train=True)
    ident = create_attention("ela", 64, phi=phi, init="identity")
    x = torch.randn(2, 64, *hw)
    assert torch.equal(ident(x), x)


def test_ela_defaults():
    ela = create_attention("ela", 64)
    assert ela.conv_h.kernel_size == (7, 1) and ela.conv_w.kernel_size == (1, 7) and ela.conv_h.groups == 64
    assert ela.conv_h.bias is None and isinstance(ela.act, nn.SiLU) and ela.norm_h.num_groups == 1


# ---- fca: the authors' MultiSpectralAttentionLayer -------------------------------------------------------------


def authors_dct_filter(h: int, w: int, mapper_x, mapper_y, channel: int) -> torch.Tensor:
    """FcaNet's ``get_dct_filter``, loop for loop (``build_filter``: ``cos(pi f (t + 1/2) / N) / sqrt(N)``,
    times ``sqrt(2)`` for ``f > 0``)."""
    def build(pos, freq, n):
        r = math.cos(math.pi * freq * (pos + 0.5) / n) / math.sqrt(n)
        return r if freq == 0 else r * math.sqrt(2)

    out = torch.zeros(channel, h, w, dtype=torch.float64)
    part = channel // len(mapper_x)
    for i, (u, v) in enumerate(zip(mapper_x, mapper_y)):
        for tx in range(h):
            for ty in range(w):
                out[i * part:(i + 1) * part, tx, ty] = build(tx, u, h) * build(ty, v, w)
    return out


TOP16 = ([0, 0, 6, 0, 0, 1, 1, 4, 5, 1, 3, 0, 0, 0, 3, 2], [0, 1, 0, 5, 2, 0, 2, 0, 0, 6, 0, 4, 6, 3, 5, 2])


class AuthorsFca(nn.Module):
    """FcaNet's ``MultiSpectralAttentionLayer`` (top16): adaptive average pool to the filter's size when the map
    differs, the DCT-weighted sum, ``fc`` (no bias) and a sigmoid."""

    def __init__(self, channel: int, dct: int):
        super().__init__()
        self.dct = dct
        xs, ys = ([u * (dct // 7) for u in m] for m in TOP16)
        self.register_buffer("weight", authors_dct_filter(dct, dct, xs, ys, channel))
        self.fc = nn.Sequential(nn.Linear(channel, channel // 16, bias=False), nn.ReLU(),
                                nn.Linear(channel // 16, channel, bias=False), nn.Sigmoid())

    def forward(self, x):
        pooled = x if x.shape[-2:] == (self.dct, self.dct) else F.adaptive_avg_pool2d(x, (self.dct, self.dct))
        y = (pooled * self.weight).sum((2, 3))
        return x * self.fc(y)[:, :, None, None]


@pytest.mark.parametrize("dct,hw", [(7, (7, 7)), (7, (9, 7)), (7, (1, 1)), (7, (3, 8)), (7, (32, 32)),
                                    (14, (14, 14)), (14, (9, 20))])
def test_fca_matches_the_authors_code(dct, hw):
    ref = randomize_(AuthorsFca(64, dct), seed=4)
    ours = create_attention("fca", 64, dct_size=dct)
    ours.load_state_dict({"dct_weight": ours.dct_weight, **{k: v for k, v in zip(
        [k for k in ours.state_dict() if k != "dct_weight"], [v for k, v in ref.state_dict().items() if k != "weight"])}})
    torch.testing.assert_close(ours.dct_weight.double(), ref.weight, rtol=0, atol=1e-7)  # fp32 buffer
    ours.dct_weight = ref.weight.clone()  # the float64 filter, for a 1e-10 comparison of the rest
    same_function(ours, ref, torch.randn(3, 64, *hw), train=True)


def test_fca_defaults_and_uneven_channel_parts():
    fca = create_attention("fca", 64)
    assert fca.freq_sel_method == "top16" and fca.dct_size == (7, 7)
    assert fca.fc1.out_features == 4 and fca.fc1.bias is None and fca.fc2.bias is None
    f = fca.dct_weight
    assert torch.equal(f[0], f[3]) and not torch.equal(f[3], f[4])  # 4 channels a frequency
    torch.testing.assert_close(f[0], torch.full((7, 7), 1 / 7))  # (0, 0): the mean
    odd = create_attention("fca", 40)  # 40 channels, 16 frequencies: parts of 3 and 2
    assert odd(torch.randn(2, 40, 5, 5)).shape == (2, 40, 5, 5)
    with pytest.raises(ValueError, match="freq_sel_method"):
        create_attention("fca", 64, freq_sel_method="top3")


# ---- gct: Eq. 1-3 as the authors' code -------------------------------------------------------------------------


def authors_gct(x, alpha, gamma, beta, eps=1e-5, mode="l2"):
    if mode == "l2":
        embedding = (x.pow(2).sum((2, 3), keepdim=True) + eps).pow(0.5) * alpha  # Eq. 1
        norm = gamma / (embedding.pow(2).mean(dim=1, keepdim=True) + eps).pow(0.5)  # Eq. 2
    else:
        embedding = torch.abs(x).sum((2, 3), keepdim=True) * alpha
        norm = gamma / (torch.abs(embedding).mean(dim=1, keepdim=True) + eps)
    return x * (1.0 + torch.tanh(embedding * norm + beta))  # Eq. 3


@pytest.mark.parametrize("mode", ["l2", "l1"])
@pytest.mark.parametrize("hw", SIZES)
def test_gct_matches_the_authors_code(mode, hw):
    ours = randomize_(create_attention("gct", 64, mode=mode), seed=5).double()
    a, g, b = (p.detach().clone().requires_grad_() for p in (ours.alpha, ours.gamma, ours.beta))
    same_function(ours, lambda x: authors_gct(x, a, g, b, mode=mode), torch.randn(3, 64, *hw), train=True,
                  ref_params=[a, g, b])


def test_gct_defaults_start_as_the_identity():
    gct = create_attention("gct", 64)
    assert gct.mode == "l2" and gct.eps == 1e-5
    assert torch.equal(gct.alpha, torch.ones(1, 64, 1, 1)) and gct.gamma.abs().sum() == gct.beta.abs().sum() == 0
    x = torch.randn(2, 64, 5, 6)
    assert torch.equal(gct(x), x)


# ---- srm: the authors' SRMLayer ------------------------------------------------------------------------------


class AuthorsSRM(nn.Module):
    def __init__(self, channel):
        super().__init__()
        self.cfc = nn.Parameter(torch.zeros(channel, 2))
        self.bn = nn.BatchNorm2d(channel)

    def forward(self, x, eps=1e-5):
        N, C = x.shape[:2]
        mean = x.view(N, C, -1).mean(dim=2, keepdim=True)
        std = (x.view(N, C, -1).var(dim=2, keepdim=True) + eps).sqrt()
        t = torch.cat((mean, std), dim=2)
        z = (t * self.cfc[None, :, :]).sum(dim=2)[:, :, None, None]
        return x * torch.sigmoid(self.bn(z))


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("hw", [(9, 7), (3, 8)])
def test_srm_matches_the_authors_code(train, hw):
    ref = randomize_(AuthorsSRM(64), seed=6)
    ours = create_attention("srm", 64)
    load_by_order(ours, ref)
    same_function(ours, ref, torch.randn(3, 64, *hw), train=train)


def test_srm_edges():
    srm = randomize_(create_attention("srm", 16), seed=1).train()
    assert torch.equal(create_attention("srm", 16).cfc, torch.zeros(16, 2))  # the authors' init
    x = torch.randn(2, 16, 1, 1, requires_grad=True)  # a 1x1 map: std of one value is sqrt(eps), not NaN
    srm(x).sum().backward()
    assert torch.isfinite(x.grad).all()
    before = srm.bn.running_var.clone()
    x1 = torch.randn(1, 16, 4, 4, requires_grad=True)  # batch 1 in training: the BN gives its shift
    y = srm(x1)
    torch.testing.assert_close(y, x1 * torch.sigmoid(srm.bn.bias)[None, :, None, None])
    y.sum().backward()
    assert torch.isfinite(x1.grad).all() and torch.equal(srm.bn.running_var, before)


# ---- sge: the authors' SpatialGroupEnhance ---------------------------------------------------------------------


def authors_sge(x, weight, bias, groups):
    b, c, h, w = x.shape
    x = x.reshape(b * groups, -1, h, w)
    xn = (x * x.mean((2, 3), keepdim=True)).sum(dim=1, keepdim=True)
    t = xn.view(b * groups, -1)
    t = t - t.mean(dim=1, keepdim=True)
    t = t / (t.std(dim=1, keepdim=True) + 1e-5)
    t = t.view(b, groups, h, w) * weight + bias
    return (x * torch.sigmoid(t.view(b * groups, 1, h, w))).view(b, c, h, w)


@pytest.mark.parametrize("groups", [None, 4])
@pytest.mark.parametrize("hw", [(9, 7), (3, 8)])
def test_sge_matches_the_authors_code(groups, hw):
    ours = randomize_(create_attention("sge", 64, groups=groups), seed=7).double()
    w, b = (p.detach().clone().requires_grad_() for p in (ours.weight, ours.bias))
    same_function(ours, lambda x: authors_sge(x, w, b, ours.groups), torch.randn(3, 64, *hw), train=True,
                  ref_params=[w, b])


def test_sge_defaults_and_1x1():
    sge = create_attention("sge", 256)
    assert sge.groups == 64 and torch.equal(sge.bias, torch.ones(1, 64, 1, 1)) and sge.weight.abs().sum() == 0
    assert create_attention("sge", 64).groups == 64 and create_attention("sge", 40).groups == 40
    x = torch.randn(2, 64, 1, 1, requires_grad=True)  # the authors' std of one value is NaN
    y = create_attention("sge", 64)(x)
    torch.testing.assert_close(y, x * torch.sigmoid(torch.tensor(1.0)))  # t = 0, gate sigmoid(bias)
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
    const = torch.ones(2, 64, 4, 4, requires_grad=True)  # equal values: std 0, still a finite gradient
    randomize_(create_attention("sge", 64))(const).sum().backward()
    assert torch.isfinite(const.grad).all()
    with pytest.raises(ValueError, match="groups"):
        create_attention("sge", 64, groups=5)


# ---- simam: the authors' simam_module ------------------------------------------------------------------------------


def authors_simam(x, e_lambda=1e-4):
    n = x.shape[2] * x.shape[3] - 1
    d = (x - x.mean(dim=[2, 3], keepdim=True)).pow(2)
    y = d / (4 * (d.sum(dim=[2, 3], keepdim=True) / n + e_lambda)) + 0.5  # 1 / e*, Eq. 5-6
    return x * torch.sigmoid(y)


@pytest.mark.parametrize("hw", [(9, 7), (3, 8), (2, 1)])
def test_simam_matches_the_authors_code(hw):
    same_function(create_attention("simam", 64), authors_simam, torch.randn(3, 64, *hw), train=True, ref_params=[])


def test_simam_identity_scale_of_one_is_the_paper_block_and_1x1_is_finite():
    ident = create_attention("simam", 64, init="identity")
    assert [n for n, _ in ident.named_parameters()] == ["scale"] and list(create_attention("simam", 64).parameters()) == []
    with torch.no_grad():
        ident.scale.fill_(1.0)
    x = torch.randn(2, 64, 6, 5)
    torch.testing.assert_close(ident(x), authors_simam(x), rtol=1e-6, atol=1e-6)
    x1 = torch.randn(2, 64, 1, 1)
    torch.testing.assert_close(create_attention("simam", 64)(x1), x1 * torch.sigmoid(torch.tensor(0.5)))
    assert create_attention("simam", 64).e_lambda == 1e-4


# ---- triplet: the authors' TripletAttention ------------------------------------------------------------------------


class AuthorsGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 1, 7, padding=3, bias=False)
        self.bn = nn.BatchNorm2d(1, eps=1e-5, momentum=0.01, affine=True)

    def forward(self, x):
        z = torch.cat((torch.max(x, 1)[0].unsqueeze(1), torch.mean(x, 1).unsqueeze(1)), dim=1)  # ZPool
        return x * torch.sigmoid(self.bn(self.conv(z)))


class AuthorsTriplet(nn.Module):
    def __init__(self):
        super().__init__()
        self.cw, self.hc, self.hw = AuthorsGate(), AuthorsGate(), AuthorsGate()

    def forward(self, x):
        o1 = self.cw(x.permute(0, 2, 1, 3).contiguous()).permute(0, 2, 1, 3).contiguous()
        o2 = self.hc(x.permute(0, 3, 2, 1).contiguous()).permute(0, 3, 2, 1).contiguous()
        return 1 / 3 * (self.hw(x) + o1 + o2)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("hw", [(9, 7), (3, 8)])
def test_triplet_matches_the_authors_code(train, hw):
    ref = randomize_(AuthorsTriplet(), seed=8)
    ours = create_attention("triplet", 64)
    load_by_order(ours, ref)
    same_function(ours, ref, torch.randn(3, 64, *hw), train=train)


def test_triplet_and_ge_defaults():
    tri = create_attention("triplet", 64)
    for branch in (tri.cw, tri.hc, tri.hw):  # three branches, each a 7x7 conv without bias and a BN(momentum 0.01)
        assert branch.conv.kernel_size == (7, 7) and branch.conv.bias is None and branch.bn.momentum == 0.01
    assert create_attention("triplet", 64, no_spatial=True).hw is None
    ge = create_attention("ge", 64)  # timm's get_attn("ge"): global extent, no gather parameters, the MLP
    assert ge.extent == 0 and ge.gather is None and ge.mlp.fc1.out_channels == 4 and ge.mlp.fc1.bias is not None


# ---- bam: the authors' BAM, and the paper's sum ----------------------------------------------------------------------


class AuthorsBAM(nn.Module):
    """The authors' BAM (ChannelGate with one hidden layer, SpatialGate with two dilated convs): their code
    (``"code"``: the product of the branches, no final BN) or the paper's Eq. 2-4 (``"paper"``: a BN at the
    end of each branch, ``sigmoid(M_c + M_s)``)."""

    def __init__(self, c, variant, square_pool=True):
        super().__init__()
        r = max(1, c // 16)
        self.variant, self.square_pool = variant, square_pool
        last_c = [nn.BatchNorm1d(c)] if variant == "paper" else []  # Eq. 2: BN(W1(W0 GAP(F) + b0) + b1)
        last_s = [nn.BatchNorm2d(1)] if variant == "paper" else []  # Eq. 3: BN(f3(f2(f1(f0(F)))))
        self.gate_c = nn.Sequential(nn.Flatten(), nn.Linear(c, r), nn.BatchNorm1d(r), nn.ReLU(), nn.Linear(r, c),
                                    *last_c)
        self.gate_s = nn.Sequential(
            nn.Conv2d(c, r, 1), nn.BatchNorm2d(r), nn.ReLU(),
            nn.Conv2d(r, r, 3, padding=4, dilation=4), nn.BatchNorm2d(r), nn.ReLU(),
            nn.Conv2d(r, r, 3, padding=4, dilation=4), nn.BatchNorm2d(r), nn.ReLU(), nn.Conv2d(r, 1, 1), *last_s)

    def forward(self, x):
        pooled = F.avg_pool2d(x, x.size(2), stride=x.size(2)) if self.square_pool else x.mean((2, 3), keepdim=True)
        mc = self.gate_c(pooled)[:, :, None, None].expand_as(x)
        ms = self.gate_s(x).expand_as(x)
        z = mc * ms if self.variant == "code" else mc + ms  # Eq. 4: sigmoid(M_c + M_s)
        return (1 + torch.sigmoid(z)) * x


@pytest.mark.parametrize("variant", ["paper", "code"])
@pytest.mark.parametrize("train", [True, False])
def test_bam_matches_the_authors_code(variant, train):
    ref = randomize_(AuthorsBAM(64, variant), seed=9)
    opts = dict(combine="sum", final_norm=True) if variant == "paper" else dict(combine="product", final_norm=False)
    ours = create_attention("bam", 64, **opts)
    load_by_order(ours, ref)
    same_function(ours, ref, torch.randn(3, 64, 9, 9), train=train)  # square: their pool is the global mean


@pytest.mark.parametrize("hw", [(9, 7), (1, 1), (3, 8), (56, 56)])
def test_bam_any_map_size(hw):
    """External-Attention-pytorch's BAM fails on any map but 7x7; this one keeps every size."""
    bam = randomize_(create_attention("bam", 64)).train()
    x = torch.randn(2, 64, *hw, requires_grad=True)
    y = bam(x)
    y.sum().backward()
    assert y.shape == x.shape and torch.isfinite(x.grad).all()


def test_bam_defaults():
    bam = create_attention("bam", 64)
    assert bam.combine == "sum" and bam.final_norm and bam.gate_c[0].out_features == 4
    assert isinstance(bam.gate_c[1], nn.BatchNorm1d) and isinstance(bam.gate_c[-1], nn.BatchNorm1d)
    assert isinstance(bam.gate_s[-1], nn.BatchNorm2d) and bam.gate_s[-1].num_features == 1
    dilated = [m for m in bam.gate_s if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(dilated) == 2 and all(m.dilation == (4, 4) and m.padding == (4, 4) for m in dilated)
    x = torch.randn(2, 64, 5, 5)
    y = bam.eval()(x)
    assert ((y / x) >= 1).all() and ((y / x) <= 2).all()  # 1 + sigmoid


# ---- shuffle: the authors' sa_layer --------------------------------------------------------------------------------


class AuthorsSA(nn.Module):
    def __init__(self, channel, groups):
        super().__init__()
        k = channel // (2 * groups)
        self.groups = groups
        self.cweight = nn.Parameter(torch.zeros(1, k, 1, 1))
        self.cbias = nn.Parameter(torch.ones(1, k, 1, 1))
        self.sweight = nn.Parameter(torch.zeros(1, k, 1, 1))
        self.sbias = nn.Parameter(torch.ones(1, k, 1, 1))
        self.gn = nn.GroupNorm(k, k)

    def forward(self, x):
        b, c, h, w = x.shape
        x = x.reshape(b * self.groups, -1, h, w)
        x_0, x_1 = x.chunk(2, dim=1)
        xn = x_0 * torch.sigmoid(self.cweight * F.adaptive_avg_pool2d(x_0, 1) + self.cbias)
        xs = x_1 * torch.sigmoid(self.sweight * self.gn(x_1) + self.sbias)
        out = torch.cat([xn, xs], dim=1).reshape(b, -1, h, w)
        return out.reshape(b, 2, -1, h, w).permute(0, 2, 1, 3, 4).reshape(b, -1, h, w)  # channel_shuffle(out, 2)


@pytest.mark.parametrize("groups", [None, 8])
@pytest.mark.parametrize("hw", SIZES)
def test_shuffle_matches_the_authors_code(groups, hw):
    ours = create_attention("shuffle", 64, groups=groups)
    ref = randomize_(AuthorsSA(64, ours.groups), seed=10)
    load_by_order(ours, ref)
    same_function(ours, ref, torch.randn(3, 64, *hw), train=True)


def test_shuffle_defaults_and_identity_leaves_out_the_shuffle():
    assert create_attention("shuffle", 256).groups == 64 and create_attention("shuffle", 64).groups == 32
    sa = create_attention("shuffle", 256)
    assert sa.shuffle and torch.equal(sa.cbias, torch.ones(1, 2, 1, 1)) and sa.cweight.abs().sum() == 0
    ident = create_attention("shuffle", 64, init="identity")
    assert not ident.shuffle
    with pytest.raises(ValueError, match="shuffle=False"):
        create_attention("shuffle", 64, init="identity", shuffle=True)
    with pytest.raises(ValueError, match="2 \\* groups"):
        create_attention("shuffle", 64, groups=3)
    with pytest.raises(ValueError, match="even"):
        create_attention("shuffle", 63)


# ---- all ten: the issue's acceptance lines, catalogue attributes -----------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_issue_acceptance(name):
    """Builds at 64 channels, starts as the identity, keeps (2, 64, 7, 9) and (1, 64, 1, 1), finite under bf16
    and fp16 autocast at batch 1 in eval on a 1x1 map; declares its paper, reference and identity rule."""
    for init in ("default", "identity"):
        block = create_attention(name, 64, init=init).train()
        x = torch.randn(2, 64, 7, 9)
        y = block(x)
        assert y.shape == x.shape and torch.isfinite(y).all()
        if init == "identity":
            assert torch.equal(y, x)
        block.eval()
        for dtype in (torch.bfloat16, torch.float16):
            with torch.autocast("cpu", dtype=dtype):
                y1 = block(torch.randn(1, 64, 1, 1) * 100)
            assert y1.shape == (1, 64, 1, 1) and torch.isfinite(y1.float()).all()
    cls = type(create_attention(name, 64))
    for attr in ("PAPER", "CHECKED_AGAINST", "IDENTITY"):
        assert isinstance(cls.__dict__.get(attr), str) and len(cls.__dict__[attr]) > 10, attr
    assert "arXiv" in cls.PAPER or "PMLR" in cls.PAPER
    assert any(isinstance(m, AttentionTap) for m in create_attention(name, 64).modules())


# ---- the references test_compose.py's double-backward test uses for these blocks -----------------------------------


def _loaded(make):
    """A reference module holding ``block``'s weights (by order), float64, training mode, and its parameters."""
    def reference(block):
        ref = make(block).double()
        load_by_order(ref, block)
        return ref.train(), list(ref.parameters())

    return reference


def _fca_reference(block):
    ref = AuthorsFca(block.channels, block.dct_size[0]).double()
    ref.fc[0].weight.data.copy_(block.fc1.weight)
    ref.fc[2].weight.data.copy_(block.fc2.weight)
    ref.weight = block.dct_weight.double().clone()
    return ref.train(), list(ref.parameters())


GATE_REFERENCES = {
    "ge": _loaded(lambda b: timm_ge(b.channels, b.extent, b.mlp is not None, b.mlp.fc1.out_channels if b.mlp is not None else 0)),
    "ela": _loaded(lambda b: EfficientLocalAttn(b.channels)),
    "fca": _fca_reference,
    "gct": lambda b: ((lambda x: authors_gct(x, b.alpha, b.gamma, b.beta, b.eps, b.mode)), list(b.parameters())),
    "srm": _loaded(lambda b: AuthorsSRM(b.channels)),
    "sge": lambda b: ((lambda x: authors_sge(x, b.weight, b.bias, b.groups)), list(b.parameters())),
    "simam": lambda b: (authors_simam, []),
    "triplet": _loaded(lambda b: AuthorsTriplet()),
    "bam": _loaded(lambda b: AuthorsBAM(b.channels, "paper" if b.final_norm else "code", square_pool=False)),
    "shuffle": _loaded(lambda b: AuthorsSA(b.channels, b.groups)),
}


@pytest.mark.parametrize("name", NAMES)
def test_maps_record_inside_a_timm_resnet18(name):
    """Inserted into timm's ResNet-18 (one block per residual block), every block's taps record, with the
    shapes of their kinds, and read into per-layer maps."""
    timm = pytest.importorskip("timm")
    import visattn

    torch.manual_seed(0)
    model = timm.create_model("resnet18", num_classes=10).eval()
    assert visattn.insert_attention(model, name, init="default") == 8
    with torch.no_grad(), visattn.record_attention(model) as records:
        model(torch.randn(2, 3, 32, 32))
    blocks = {r.name.removesuffix(".channel").removesuffix(".spatial") for r in records}  # bam: two taps
    assert len(blocks) == 8, sorted(blocks)
    for r in records:
        assert torch.isfinite(r.weights).all()
        assert r.weights.shape[:2] == ((2, 1) if r.kind == "spatial" else (2, r.weights.shape[1]))
    maps = visattn.read_maps(list(records), model, input_shape=(2, 3, 32, 32))
    if any(r.kind == "spatial" for r in records):  # channel records are histograms, not maps
        assert maps and all(torch.isfinite(m.heat).all() for m in maps)

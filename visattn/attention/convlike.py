"""Attention that replaces a convolution, as same-width residual blocks, and the bilinear attention transform.

* ``sk``: selective kernel (Li, Wang, Hu, Yang, 2019, "Selective Kernel Networks", arXiv 1903.06586).
* ``splat``: split attention (Zhang, Wu, Zhang, Zhu, Lin, Zhang, Sun, He, Mueller, Manmatha, Li, Smola, 2020,
  "ResNeSt: Split-Attention Networks", arXiv 2004.08955).
* ``halo``: blocked local self-attention with a halo (Vaswani, Ramachandran, Srinivas, Parmar, Hechtman,
  Shlens, 2021, "Scaling Local Self-Attention for Parameter Efficient Visual Backbones", arXiv 2103.12731).
* ``lambda``: the lambda layer (Bello, 2021, "LambdaNetworks: Modeling Long-Range Interactions Without
  Attention", arXiv 2102.08602).
* ``bat``: the bilinear attentional transform in a non-local block (Chi, Wei, Wang, Xu, 2020, "Non-Local Neural
  Networks With Grouped Bilinear Attentional Transforms", CVPR 2020).

Each mechanism computes what timm's module computes (``SelectiveKernel``, ``SplitAttn``, ``HaloAttn``,
``LambdaLayer``, ``BatNonLocalAttn``), weight for weight; the tests compare them in float64.

**The one deviation.** SK, split attention, halo and lambda replace a 3x3 convolution in their papers. Here
they are blocks with the same width in and out that can sit in an attention slot: ``y = x + scale *
mechanism(x)``, ``scale`` a learned scalar (ReZero: Bachlechner, Majumder, Mao, Cottrell, McAuley, 2020,
"ReZero is All You Need", arXiv 2003.04887). ``init="default"``: ``scale`` starts at 1, so the block is the
paper's mechanism added to its input; ``init="identity"``: ``scale`` starts at 0, so the block returns its input
exactly and ``scale`` gets the gradient ``sum(mechanism(x) * grad)``. BAT is a residual block in its paper
(``x + BAT(x)``); its last layer is a conv + BN + ReLU, which cannot start at zero and still learn (ReLU has
no gradient at 0), so it gets the same ``scale`` (1 by default: timm's block exactly; 0 for the identity).
The lambda layer's output is not normalised (about ten times its input at the defaults; in LambdaResNets the
bottleneck's BatchNorm follows it), and ``x + scale * lambda(x)`` diverged in a smoke run even from ``scale =
0``: its block is ``x + BN(lambda(x))``, the BN's scale and shift starting at zero for ``init="identity"``.

Pooled statistics go through a BatchNorm in SK and split attention; a training-mode BatchNorm over one value
per channel (batch 1) is undefined, so for such a batch it normalises with its running statistics and leaves
them as they were (:func:`pooled_norm`). The attention softmaxes run in fp32 with autocast off.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Type

import torch
import torch.nn.functional as F
from timm.layers import make_divisible
from torch import nn

from ..registry import register_attention
from .channel import check_channels, check_feature_map, check_norm_batch, is_channels_last
from .functional import BATCH_NORMS, check_init, positive_int, zero_
from .tap import AttentionTap

__all__ = ["SelectiveKernel", "SplitAttention", "HaloAttention", "LambdaLayer", "BilinearAttnTransform",
           "ResidualScale", "pooled_norm"]

REZERO = "a learned residual scale (ReZero, arXiv 2003.04887) starting at 0: y = x + scale * mechanism(x)"


def check_ratio(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def pooled_norm(norm: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """``norm(z)`` for pooled ``(B, C, 1, 1)`` statistics; a training-mode BatchNorm with batch 1 (one value per
    channel, where batch statistics are undefined) normalises with its running statistics instead and leaves
    them unchanged."""
    if (z.shape[0] == 1 and norm.training and isinstance(norm, BATCH_NORMS)
            and norm.running_mean is not None):
        return F.batch_norm(z, norm.running_mean, norm.running_var, norm.weight, norm.bias, False, 0.0, norm.eps)
    return norm(z)


class ResidualScale(nn.Module):
    """``x + scale * y`` with a learned scalar ``scale``: 1 for ``init="default"``, 0 for ``init="identity"``
    (re-applied by :meth:`zero_init_last`, timm's hook after its own weight init)."""

    init: str

    def setup_scale(self, init: str) -> None:
        self.init = check_init(init)
        self.scale = nn.Parameter(torch.ones(1))
        self.zero_init_last()

    def zero_init_last(self) -> None:
        if self.init == "identity":
            zero_(self.scale)

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``x + scale * y`` in ``x``'s dtype and memory format."""
        y = (y * self.scale.to(y.dtype)).to(x.dtype)
        if is_channels_last(x):
            y = y.contiguous(memory_format=torch.channels_last)
        return x + y


def conv_norm_act(cin: int, cout: int, kernel_size, norm_layer, act_layer, dilation: int = 1,
                  groups: int = 1) -> nn.Sequential:
    """``conv (no bias) -> norm -> act``, the layout (and state order) of timm's ``ConvNormAct``."""
    k = kernel_size if isinstance(kernel_size, tuple) else (kernel_size, kernel_size)
    pad = tuple(dilation * (ki - 1) // 2 for ki in k)
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, padding=pad, dilation=dilation, groups=groups, bias=False),
        norm_layer(cout),
        act_layer(),
    )


# ---- selective kernel ------------------------------------------------------------------------------------------


@register_attention("sk", layout="feature", kind="channel")
class SelectiveKernel(ResidualScale):
    """Selective kernel (Li, Wang, Hu, Yang, 2019, arXiv 1903.06586), as a residual block.

    Split: ``M`` paths (``kernel_size``, default 3 and 5), each conv + BN + ReLU; with ``keep_3x3`` (the paper's
    own choice) a ``k x k`` kernel is a 3x3 with dilation ``(k - 1) / 2``. Fuse: ``s = GAP(sum of paths)``,
    ``z = ReLU(BN(fc_reduce(s)))`` of width ``d = max(C / r, L)`` (``rd_ratio = 1/r = 1/16``, ``min_rd = L = 32``,
    the paper's values; rounded to ``rd_divisor``). Select: a softmax across the paths per channel of
    ``fc_select(z)`` weights the paths, which are summed. ``split_input=True`` is timm's variant (each path sees
    ``C / M`` input channels); the paper's paths see all of them (the default). ``groups``: the paths' conv
    groups (the paper's SKNet uses 32 inside ResNeXt; 1 here). Equal to timm's ``SelectiveKernel`` with the same
    options. Block: ``x + scale * SK(x)`` (module docstring). Tap (``"channel"``): the first path's ``(B, C)``
    selection weights.
    """

    PAPER = "Li, Wang, Hu, Yang, 2019, Selective Kernel Networks, arXiv 1903.06586"
    CHECKED_AGAINST = "timm SelectiveKernel (weights copied, float64, outputs and gradients; x + SK(x) at scale 1)"
    IDENTITY = REZERO

    def __init__(self, channels: int, kernel_size: Sequence[int] = (3, 5), dilation: int = 1, groups: int = 1,
                 rd_ratio: float = 1.0 / 16, rd_channels: Optional[int] = None, rd_divisor: int = 8,
                 min_rd: int = 32, keep_3x3: bool = True, split_input: bool = False,
                 act_layer: Type[nn.Module] = nn.ReLU, norm_layer: Type[nn.Module] = nn.BatchNorm2d,
                 init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        kernels = [kernel_size] if isinstance(kernel_size, int) else list(kernel_size)
        if len(kernels) < 2:
            raise ValueError(f"sk: kernel_size needs at least 2 paths, got {kernel_size!r}")
        for k in kernels:
            positive_int("kernel_size", k, odd=True)
        positive_int("dilation", dilation)
        self.num_paths = len(kernels)
        self.split_input = check_flag("split_input", split_input)
        cin = channels // self.num_paths if split_input else channels
        if split_input and channels % self.num_paths:
            raise ValueError(f"sk: split_input needs channels ({channels}) divisible by the {self.num_paths} paths")
        positive_int("groups", groups, divides=math.gcd(cin, channels))
        if check_flag("keep_3x3", keep_3x3):
            dils, kernels = [dilation * (k - 1) // 2 or 1 for k in kernels], [3] * len(kernels)
        else:
            dils = [dilation] * len(kernels)
        self.paths = nn.ModuleList(conv_norm_act(cin, channels, k, norm_layer, act_layer, d, groups)
                                   for k, d in zip(kernels, dils))
        if rd_channels is None:
            check_ratio("rd_ratio", rd_ratio)
            rd = max(make_divisible(channels * rd_ratio, positive_int("rd_divisor", rd_divisor)),
                     positive_int("min_rd", min_rd))
        else:
            rd = positive_int("rd_channels", rd_channels)
        self.fc_reduce = nn.Conv2d(channels, rd, 1, bias=False)
        self.bn = norm_layer(rd)
        self.act = act_layer()
        self.fc_select = nn.Conv2d(rd, channels * self.num_paths, 1, bias=False)
        self.tap = AttentionTap("channel")
        self.setup_scale(init)

    def mechanism(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        parts = x.split(C // self.num_paths, dim=1) if self.split_input else [x] * self.num_paths
        feats = torch.stack([path(p) for path, p in zip(self.paths, parts)], dim=1)  # (B, M, C, H, W)
        s = feats.sum(1).mean((2, 3), keepdim=True)  # fuse: (B, C, 1, 1)
        z = self.act(pooled_norm(self.bn, self.fc_reduce(s)))
        logits = self.fc_select(z).view(B, self.num_paths, C, 1, 1)
        acc = torch.promote_types(logits.dtype, torch.float32)
        a = logits.to(acc).softmax(dim=1).to(feats.dtype)  # select across the paths, per channel
        self.tap(a[:, 0, :, 0, 0])
        return (feats * a).sum(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        check_norm_batch(self, self.paths[0][1], x.shape[0] * x.shape[2] * x.shape[3], x)
        return self.residual(x, self.mechanism(x))


# ---- split attention ----------------------------------------------------------------------------------------------


@register_attention("splat", layout="feature", kind="channel")
class SplitAttention(ResidualScale):
    """Split attention (ResNeSt: Zhang et al., 2020, arXiv 2004.08955), as a residual block.

    One grouped ``k x k`` conv (``radix * cardinality`` groups, no bias) + BN + ReLU makes ``radix`` splits of
    ``C`` channels; their sum is pooled, ``fc1`` (1x1, width ``max(C * radix * rd_ratio, 32)`` rounded to
    ``rd_divisor``: the paper's code, reduction factor 4) + norm + ReLU, ``fc2`` back to ``radix * C``; an
    r-softmax across the splits (a sigmoid for ``radix=1``) weights them, and they are summed. Paper defaults:
    radix 2, cardinality 1. ``norm_layer``: none by default, as timm's ``get_attn("splat")`` builds it (its
    ``SplitAttn`` defaults); ResNeSt's networks put a BatchNorm after the conv and after ``fc1``
    (``norm_layer=nn.BatchNorm2d``; with batch 2 that BN over pooled vectors is close to a sign function, so
    half-precision rounding can flip it). Equal to timm's ``SplitAttn`` with the same options. Block: ``x +
    scale * SplAt(x)`` (module docstring). Tap (``"channel"``): the first split's ``(B, C)`` weights.
    """

    PAPER = ("Zhang, Wu, Zhang, Zhu, Lin, Zhang, Sun, He, Mueller, Manmatha, Li, Smola, 2020, ResNeSt: "
             "Split-Attention Networks, arXiv 2004.08955")
    CHECKED_AGAINST = "timm SplitAttn, without and with BatchNorm (weights copied, float64, outputs and gradients; x + SplAt(x))"
    IDENTITY = REZERO

    def __init__(self, channels: int, kernel_size: int = 3, dilation: int = 1, radix: int = 2, cardinality: int = 1,
                 rd_ratio: float = 0.25, rd_channels: Optional[int] = None, rd_divisor: int = 8, min_rd: int = 32,
                 act_layer: Type[nn.Module] = nn.ReLU, norm_layer: Optional[Type[nn.Module]] = None,
                 init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        positive_int("kernel_size", kernel_size, odd=True)
        positive_int("dilation", dilation)
        self.radix = positive_int("radix", radix)
        self.cardinality = positive_int("cardinality", cardinality, divides=channels)
        if rd_channels is None:
            rd = make_divisible(channels * radix * check_ratio("rd_ratio", rd_ratio),
                                positive_int("rd_divisor", rd_divisor), min_value=positive_int("min_rd", min_rd))
        else:
            rd = positive_int("rd_channels", rd_channels) * radix
        if rd % cardinality:
            raise ValueError(f"splat: the attention width {rd} must be divisible by cardinality={cardinality}")
        mid = channels * radix
        norm = norm_layer or nn.Identity
        self.conv = nn.Conv2d(channels, mid, kernel_size, padding=dilation * (kernel_size // 2), dilation=dilation,
                              groups=cardinality * radix, bias=False)
        self.bn0 = norm(mid)
        self.act0 = act_layer()
        self.fc1 = nn.Conv2d(channels, rd, 1, groups=cardinality)
        self.bn1 = norm(rd)
        self.act1 = act_layer()
        self.fc2 = nn.Conv2d(rd, mid, 1, groups=cardinality)
        self.tap = AttentionTap("channel")
        self.setup_scale(init)

    def mechanism(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        R, G = self.radix, self.cardinality
        u = self.act0(self.bn0(self.conv(x))).view(B, R, C, H, W)  # the radix splits
        gap = u.sum(1).mean((2, 3), keepdim=True)  # (B, C, 1, 1)
        logits = self.fc2(self.act1(pooled_norm(self.bn1, self.fc1(gap))))  # (B, R*C, 1, 1): (G, R, C/G) order
        acc = torch.promote_types(logits.dtype, torch.float32)
        if R > 1:
            a = logits.view(B, G, R, C // G).transpose(1, 2).to(acc).softmax(dim=1)  # r-softmax across splits
        else:
            a = logits.view(B, 1, G, C // G).to(acc).sigmoid()
        a = a.reshape(B, R, C, 1, 1).to(u.dtype)
        self.tap(a[:, 0, :, 0, 0])
        return (u * a).sum(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        check_norm_batch(self, self.bn0, x.shape[0] * x.shape[2] * x.shape[3], x)
        return self.residual(x, self.mechanism(x))


# ---- halo attention -----------------------------------------------------------------------------------------------


class HaloRelPos(nn.Module):
    """Relative-position tables of halo attention, one per axis, ``(2 * win - 1, dim_head)`` (Bello, Zoph,
    Vaswani, Shlens, Le, 2019, "Attention Augmented Convolutional Networks", arXiv 1904.09925), as in timm."""

    def __init__(self, win: int, dim_head: int):
        super().__init__()
        self.height_rel = nn.Parameter(torch.empty(2 * win - 1, dim_head))
        self.width_rel = nn.Parameter(torch.empty(2 * win - 1, dim_head))

    def forward(self, q: torch.Tensor, block: int) -> torch.Tensor:
        """Queries ``(..., block**2, d)`` of one block -> logits ``(..., block**2, win**2)``: for query ``(i, j)``
        and window key ``(a, b)``, ``q . (height_rel[a - i + win - 1] + width_rel[b - j + win - 1])``."""
        win = (self.height_rel.shape[0] + 1) // 2
        d = q.shape[-1]
        pos = torch.arange(win, device=q.device)[None, :] - torch.arange(block, device=q.device)[:, None] + win - 1
        e_h = self.height_rel.to(q.dtype)[pos].transpose(1, 2)  # (block, d, win), one matrix per query row
        e_w = self.width_rel.to(q.dtype)[pos].transpose(1, 2)  # (block, d, win), one per query column
        qg = q.reshape(*q.shape[:-2], block, block, d)
        lh = qg @ e_h  # (..., i, j, a)
        lw = (qg.transpose(-3, -2) @ e_w).transpose(-3, -2)  # (..., i, j, b)
        rel = lh[..., :, None] + lw[..., None, :]  # (..., i, j, a, b)
        return rel.reshape(*q.shape[:-1], win * win)


def halo_dense(attn: torch.Tensor, H: int, W: int, block: int, halo: int) -> torch.Tensor:
    """Per-block halo attention ``(B, n, blocks, block**2, win**2)`` placed into the full ``(B, n, N, N)``
    over the ``N = H * W`` positions of the map, zero outside each query's window; the weights on the zero keys
    beyond the map (padding) are dropped and each row renormalised over the map's positions."""
    B, n = attn.shape[:2]
    nh, nw = -(-H // block), -(-W // block)
    win = block + 2 * halo
    Hk, Wk = nh * block + 2 * halo, nw * block + 2 * halo
    a = torch.arange(win, device=attn.device)
    rows = (torch.arange(nh, device=attn.device) * block)[:, None] + a  # window rows, padded-key coordinates
    cols = (torch.arange(nw, device=attn.device) * block)[:, None] + a
    key = (rows[:, None, :, None] * Wk + cols[None, :, None, :]).reshape(nh * nw, 1, win * win)
    key = key.expand(B, n, nh * nw, block * block, win * win)
    dense = attn.new_zeros(B, n, nh * nw, block * block, Hk * Wk).scatter(-1, key, attn)
    dense = dense.view(B, n, nh, nw, block, block, Hk, Wk).permute(0, 1, 2, 4, 3, 5, 6, 7)
    dense = dense.reshape(B, n, nh * block, nw * block, Hk, Wk)[:, :, :H, :W, halo:halo + H, halo:halo + W]
    dense = dense.reshape(B, n, H * W, H * W)
    return dense / dense.sum(-1, keepdim=True)


@register_attention("halo", layout="feature", kind="token")
class HaloAttention(ResidualScale):
    """Halo attention (Vaswani et al., 2021, arXiv 2103.12731), as a residual block.

    The map is cut into ``block_size x block_size`` query blocks; each attends, over ``num_heads`` heads, to the
    keys of its block grown by ``halo_size`` on every side (a ``win = block + 2 * halo`` square window), with
    relative-position logits per axis (:class:`HaloRelPos`): ``softmax(q k^T / sqrt(d) + q r^T) v``. Paper
    defaults: block 8, halo 3, 8 heads, no qkv bias. Zero keys and values pad the halo beyond the map, as in
    timm. **Any H x W**: timm needs H and W divisible by the block size; here the projected queries, keys and
    values are zero-padded on the bottom and right to a multiple of it and the output is cropped back, which is
    timm's ``HaloAttn`` on the zero-padded map (no qkv bias) and timm's exactly on a divisible map (both tested).
    Block: ``x + scale * halo(x)`` (module docstring). Tap (``"token"``): the ``(B, heads, N, N)`` attention,
    each query's window placed back into the map and zero elsewhere, rows renormalised over the map's positions
    (the weight on zero padding only scales a query's output down); computed only while recording.
    """

    PAPER = ("Vaswani, Ramachandran, Srinivas, Parmar, Hechtman, Shlens, 2021, Scaling Local Self-Attention for "
             "Parameter Efficient Visual Backbones, arXiv 2103.12731")
    CHECKED_AGAINST = ("timm HaloAttn (weights copied, float64, outputs and gradients; x + halo(x)), on divisible "
                       "maps and on zero-padded ones")
    IDENTITY = REZERO

    def __init__(self, channels: int, num_heads: int = 8, dim_head: Optional[int] = None, block_size: int = 8,
                 halo_size: int = 3, qk_ratio: float = 1.0, qkv_bias: bool = False, init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.num_heads = positive_int("num_heads", num_heads, divides=channels)
        if dim_head is None:
            dim_head = make_divisible(channels * check_ratio("qk_ratio", qk_ratio), divisor=8) // num_heads
        self.dim_head_qk = positive_int("dim_head", dim_head)
        self.dim_head_v = channels // num_heads
        self.block_size = positive_int("block_size", block_size)
        if isinstance(halo_size, bool) or not isinstance(halo_size, int) or halo_size < 0:
            raise ValueError(f"halo_size must be an int >= 0, got {halo_size!r}")
        self.halo_size = halo_size
        self.attn_scale = self.dim_head_qk**-0.5
        bias = check_flag("qkv_bias", qkv_bias)
        self.q = nn.Conv2d(channels, num_heads * self.dim_head_qk, 1, bias=bias)
        self.kv = nn.Conv2d(channels, num_heads * (self.dim_head_qk + self.dim_head_v), 1, bias=bias)
        self.pos_embed = HaloRelPos(block_size + 2 * halo_size, self.dim_head_qk)
        self.tap = AttentionTap("token")
        self.reset_parameters()
        self.setup_scale(init)

    def reset_parameters(self) -> None:
        """timm's: truncated normal, std ``fan_in ** -0.5`` for the projections and ``dim_head ** -0.5`` for the
        tables."""
        for w in (self.q.weight, self.kv.weight):
            nn.init.trunc_normal_(w, std=w.shape[1] ** -0.5)
        for t in (self.pos_embed.height_rel, self.pos_embed.width_rel):
            nn.init.trunc_normal_(t, std=self.attn_scale)
        for b in (self.q.bias, self.kv.bias):
            if b is not None:
                nn.init.zeros_(b)

    def mechanism(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        bs, hs = self.block_size, self.halo_size
        n, dq, dv = self.num_heads, self.dim_head_qk, self.dim_head_v
        win = bs + 2 * hs
        nh, nw = -(-H // bs), -(-W // bs)
        q = F.pad(self.q(x), (0, nw * bs - W, 0, nh * bs - H))
        kv = F.pad(self.kv(x), (hs, hs + nw * bs - W, hs, hs + nh * bs - H))
        q = q.reshape(B, n, dq, nh, bs, nw, bs).permute(0, 1, 3, 5, 4, 6, 2).reshape(B, n, nh * nw, bs * bs, dq)
        kv = kv.unfold(2, win, bs).unfold(3, win, bs)  # (B, n * (dq + dv), nh, nw, win, win)
        kv = kv.reshape(B, n, dq + dv, nh * nw, win * win).permute(0, 1, 3, 4, 2)
        k, v = kv.split([dq, dv], dim=-1)  # (B, n, blocks, win**2, d)
        with torch.autocast(device_type=x.device.type, enabled=False):
            acc = torch.promote_types(q.dtype, torch.float32)
            qa = q.to(acc)
            logits = (qa * self.attn_scale) @ k.to(acc).transpose(-1, -2) + self.pos_embed(qa, bs)
            attn = logits.softmax(dim=-1)  # (B, n, blocks, block**2, win**2)
            if self.tap.active:
                self.tap(halo_dense(attn, H, W, bs, hs), grid=(H, W))
            out = (attn @ v.to(acc)).to(v.dtype)  # (B, n, blocks, block**2, dv)
        out = out.reshape(B, n, nh, nw, bs, bs, dv).permute(0, 1, 6, 2, 4, 3, 5).reshape(B, C, nh * bs, nw * bs)
        return out[:, :, :H, :W]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        return self.residual(x, self.mechanism(x))


# ---- lambda layer ---------------------------------------------------------------------------------------------------


@register_attention("lambda", layout="feature", kind="spatial")
class LambdaLayer(nn.Module):
    """Lambda layer (Bello, 2021, arXiv 2102.08602), as a residual block.

    Queries ``(num_heads, |k|)`` per position (BatchNorm), one key head ``|k|`` and values ``|v| = C / heads``
    (BatchNorm) from one 1x1 projection; keys normalised by a softmax over the positions. The content lambda
    ``softmax(K)^T V`` (``|k| x |v|``, shared by every position) and the position lambdas (a lambda convolution:
    an ``r x r`` conv over the values, per key channel) are applied to each query: ``y_n = q_n^T (lambda_c +
    lambda_p_n)``. Intra-depth ``|u| = 1``. Defaults: ``|k| = 16``, ``|h| = 4`` heads (the paper's LambdaResNet
    setting), ``r = 9`` (timm's). Works on any H x W (the lambda convolution is zero-padded). The lambda
    convolution is a 2D conv over each value channel (timm's ``Conv3d`` with an ``(r, r, 1)`` kernel, the same
    weights: PyTorch's CPU bf16 Conv3d backward gives NaN weight gradients). Block: ``x + BN(lambda(x))``
    (module docstring; ``init="identity"`` zeroes the BN's scale and shift). A lambda layer has no attention map
    over positions: its tap (``"spatial"``, scale ``"relative"``) records the keys' softmax over the positions,
    averaged over the ``|k|`` key channels, ``(B, 1, H, W)``: how much each position contributes to the content
    lambda.
    """

    PAPER = "Bello, 2021, LambdaNetworks: Modeling Long-Range Interactions Without Attention, arXiv 2102.08602"
    CHECKED_AGAINST = "timm LambdaLayer with r set (weights copied, float64, outputs and gradients; x + BN(lambda(x)))"
    IDENTITY = "the BatchNorm after the lambda layer (scale and shift at 0)"

    def __init__(self, channels: int, num_heads: int = 4, dim_head: int = 16, r: int = 9, qkv_bias: bool = False,
                 init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.num_heads = positive_int("num_heads", num_heads, divides=channels)
        self.dim_qk = positive_int("dim_head", dim_head)
        self.dim_v = channels // num_heads
        self.r = positive_int("r", r, odd=True)
        self.qkv = nn.Conv2d(channels, num_heads * dim_head + dim_head + self.dim_v, 1,
                             bias=check_flag("qkv_bias", qkv_bias))
        self.norm_q = nn.BatchNorm2d(num_heads * dim_head)
        self.norm_v = nn.BatchNorm2d(self.dim_v)
        self.conv_lambda = nn.Conv2d(1, dim_head, r, padding=r // 2)  # timm's Conv3d (r, r, 1), as a 2D conv
        self.norm = nn.BatchNorm2d(channels)  # the bottleneck's BN after the lambda layer in LambdaResNets
        self.tap = AttentionTap("spatial", scale="relative")
        self.init = check_init(init)
        self.reset_parameters()

    def zero_init_last(self) -> None:
        """With ``init="identity"``, zero the BN's scale and shift (also timm's hook, after its own init)."""
        if self.init == "identity":
            zero_(self.norm.weight, self.norm.bias)

    def reset_parameters(self) -> None:
        """timm's: truncated normal, std ``fan_in ** -0.5`` (projection) and ``|k| ** -0.5`` (lambda conv)."""
        nn.init.trunc_normal_(self.qkv.weight, std=self.qkv.weight.shape[1] ** -0.5)
        nn.init.trunc_normal_(self.conv_lambda.weight, std=self.dim_qk**-0.5)
        self.zero_init_last()

    def mechanism(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        M, n, dk, dv = H * W, self.num_heads, self.dim_qk, self.dim_v
        q, k, v = self.qkv(x).split([n * dk, dk, dv], dim=1)
        q = self.norm_q(q).reshape(B, n, dk, M).transpose(-1, -2)  # (B, n, M, k)
        v = self.norm_v(v).reshape(B, dv, M).transpose(-1, -2)  # (B, M, v)
        keys = k.reshape(B, dk, M).to(torch.promote_types(k.dtype, torch.float32)).softmax(dim=-1)  # over positions
        self.tap(keys.mean(1).view(B, 1, H, W))
        keys = keys.to(v.dtype)
        content = q @ (keys @ v).unsqueeze(1)  # content lambda (B, 1, k, v) applied: (B, n, M, v)
        lam_p = self.conv_lambda(v.transpose(1, 2).reshape(B * dv, 1, H, W))  # each value channel: (B v, k, H, W)
        lam_p = lam_p.view(B, dv, dk, M).permute(0, 3, 2, 1)  # position lambdas (B, M, k, v)
        position = (q.unsqueeze(-2) @ lam_p.unsqueeze(1).to(q.dtype)).squeeze(-2)  # (B, n, M, v)
        return (content.to(position.dtype) + position).transpose(-1, -2).reshape(B, C, H, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        check_norm_batch(self, self.norm_q, x.shape[0] * x.shape[2] * x.shape[3], x)
        y = self.norm(self.mechanism(x.contiguous()))  # one layout: the lambdas permute the map anyway
        if is_channels_last(x):
            y = y.contiguous(memory_format=torch.channels_last)
        return x + y.to(x.dtype)


# ---- bilinear attentional transform ---------------------------------------------------------------------------------


def bin_max(v: torch.Tensor, bins: int) -> torch.Tensor:
    """``(..., L)`` -> ``(..., bins)``: the max over each of ``adaptive_max_pool``'s bins (``floor(i L / bins)`` to
    ``ceil((i + 1) L / bins)``), written as a masked max so that every ``L`` exports."""
    L = v.shape[-1]
    start = torch.tensor([i * L // bins for i in range(bins)], device=v.device)
    end = torch.tensor([-(-(i + 1) * L // bins) for i in range(bins)], device=v.device)
    pos = torch.arange(L, device=v.device)
    outside = (pos[None, :] < start[:, None]) | (pos[None, :] >= end[:, None])  # (bins, L)
    return v.unsqueeze(-2).masked_fill(outside, float("-inf")).amax(-1)


def spread(p: torch.Tensor, L: int) -> torch.Tensor:
    """``(B, G, b, b)`` block weights -> ``(B, G, L, L)``: ``kron(p, I_t)`` with ``t = ceil(L / b)`` (timm's
    ``resize_mat``), cut to its first ``L`` rows and columns (equal to zero-padding the map to ``b * t``)."""
    b = p.shape[-1]
    t = -(-L // b)
    idx = torch.arange(L, device=p.device)
    blk, off = idx // t, idx % t
    same = (off[:, None] == off[None, :]).to(p.dtype)
    return p.index_select(2, blk).index_select(3, blk) * same


@register_attention("bat", layout="feature", kind="token")
class BilinearAttnTransform(ResidualScale):
    """Non-local block with a grouped bilinear attentional transform (BAT: Chi, Wei, Wang, Xu, 2020, CVPR).

    ``conv1`` (1x1 conv + BN + ReLU) reduces to ``rd`` channels; per group (``groups``) a 1x1 conv + BN + ReLU
    gives one map, max-pooled into ``block_size`` row and column bins, from which ``conv_p`` / ``conv_q`` make
    ``b x b`` sigmoid matrices normalised to rows (P) and columns (Q) summing to one; spread over the map
    (``kron(., I_t)``), they transform each group's channels bilinearly, ``Y = P X Q``; then 1x1 conv + BN + ReLU,
    ``conv2`` back to ``C`` (conv + BN + ReLU), and the residual. Defaults: timm's (adapted from the authors'
    code): block 7, 2 groups, ``rd = C / 4`` rounded to 8. Equal to timm's ``BatNonLocalAttn`` on maps divisible by the block
    size; on others the bins are ``adaptive_max_pool``'s and the transform is the one on the zero-padded map,
    cropped (:func:`spread`). Deviations: ``drop_rate`` (the Dropout2d before the residual) defaults to 0, not
    0.2, so that training is deterministic; and ``x + scale * BAT(x)`` (module docstring: 1 by default, 0 for
    ``init="identity"``). Tap (``"token"``, heads = groups): position ``(h, w)``'s weight on ``(h', w')``,
    ``P[h, h'] Q[w', w]``, ``(B, groups, N, N)``, rows renormalised (exactly one on divisible maps); computed only
    while recording.
    """

    PAPER = "Chi, Wei, Wang, Xu, 2020, Non-Local Neural Networks With Grouped Bilinear Attentional Transforms, CVPR"
    CHECKED_AGAINST = "timm BatNonLocalAttn (drop_rate 0; weights copied, float64, outputs and gradients)"
    IDENTITY = "the residual scale, starting at 0 (the last conv + BN + ReLU cannot start at zero and learn)"

    def __init__(self, channels: int, block_size: int = 7, groups: int = 2, rd_ratio: float = 0.25,
                 rd_channels: Optional[int] = None, rd_divisor: int = 8, drop_rate: float = 0.0,
                 act_layer: Type[nn.Module] = nn.ReLU, norm_layer: Type[nn.Module] = nn.BatchNorm2d,
                 init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        if rd_channels is None:
            rd = make_divisible(channels * check_ratio("rd_ratio", rd_ratio), positive_int("rd_divisor", rd_divisor))
        else:
            rd = positive_int("rd_channels", rd_channels)
        self.num_heads = self.groups = positive_int("groups", groups, divides=rd)
        self.block_size = bs = positive_int("block_size", block_size)
        if isinstance(drop_rate, bool) or not isinstance(drop_rate, (int, float)) or not 0 <= drop_rate < 1:
            raise ValueError(f"drop_rate must be a number in [0, 1), got {drop_rate!r}")
        self.conv1 = conv_norm_act(channels, rd, 1, norm_layer, act_layer)
        self.ba_conv1 = conv_norm_act(rd, groups, 1, norm_layer, act_layer)
        self.conv_p = nn.Conv2d(groups, bs * bs * groups, (bs, 1))
        self.conv_q = nn.Conv2d(groups, bs * bs * groups, (1, bs))
        self.ba_conv2 = conv_norm_act(rd, rd, 1, norm_layer, act_layer)
        self.conv2 = conv_norm_act(rd, channels, 1, norm_layer, act_layer)
        self.dropout = nn.Dropout2d(p=float(drop_rate))
        self.tap = AttentionTap("token")
        self.setup_scale(init)

    def transform(self, xl: torch.Tensor) -> torch.Tensor:
        """The bilinear transform ``P X Q`` of the reduced map ``xl`` (``(B, rd, H, W)``)."""
        B, c, H, W = xl.shape
        G, bs = self.groups, self.block_size
        t = self.ba_conv1(xl)  # (B, G, H, W)
        rows = bin_max(t.amax(3), bs)  # (B, G, bs): adaptive max pool to (bs, 1)
        cols = bin_max(t.amax(2), bs)  # (B, G, bs): to (1, bs)
        # sigmoid(z) / sum(sigmoid(z)) (the paper's normalisation) written as softmax(logsigmoid(z)), the same
        # function: where every sigmoid underflows (logits below about -100) the plain quotient is 0/0 forward
        # or overflows backward, as it did in a trained RegNet's last stage
        p = F.logsigmoid(self.conv_p(rows.unsqueeze(-1)).view(B, G, bs, bs)).softmax(3)
        q = F.logsigmoid(self.conv_q(cols.unsqueeze(-2)).view(B, G, bs, bs)).softmax(2)
        p = spread(p, H)  # (B, G, H, H), rows sum to one
        q = spread(q, W)  # (B, G, W, W), columns sum to one
        if self.tap.active:
            pf, qf = p.float(), q.float()
            dense = (pf[:, :, :, None, :, None] * qf.transpose(-1, -2)[:, :, None, :, None, :]).reshape(B, G, H * W, -1)
            self.tap(dense / dense.sum(-1, keepdim=True), grid=(H, W))
        y = p.unsqueeze(2).to(xl.dtype) @ xl.view(B, G, c // G, H, W) @ q.unsqueeze(2).to(xl.dtype)
        return y.reshape(B, c, H, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        check_norm_batch(self, self.conv1[1], x.shape[0] * x.shape[2] * x.shape[3], x)
        y = self.conv2(self.ba_conv2(self.transform(self.conv1(x))))
        return self.residual(x, self.dropout(y))

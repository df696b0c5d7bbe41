"""Gate mechanisms beyond SE, part two: SGE, SimAM, triplet attention, BAM and shuffle attention.

* ``sge``: Li, Hu, Yang, 2019, "Spatial Group-wise Enhance: Improving Semantic Feature Learning in
  Convolutional Networks", arXiv 1905.09646.
* ``simam``: Yang, Zhang, Li, Xie, 2021, "SimAM: A Simple, Parameter-Free Attention Module for Convolutional
  Neural Networks", ICML, PMLR 139:11863-11874 (no arXiv).
* ``triplet``: Misra, Nalamada, Arasanipalai, Hou, 2021, "Rotate to Attend: Convolutional Triplet Attention
  Module", arXiv 2010.03045.
* ``bam``: Park, Woo, Lee, Kweon, 2018, "BAM: Bottleneck Attention Module", arXiv 1807.06514.
* ``shuffle``: Zhang, Yang, 2021, "SA-Net: Shuffle Attention for Deep Convolutional Neural Networks",
  arXiv 2102.00240.

The contract of :mod:`visattn.attention.channel` (fp32 statistics, gates with autocast off, ``init="identity"``
exact); where a paper's block cannot start as the identity, the class docstring says what was added.
Blocks whose gate varies over channels and positions record its marginals: a spatial tap with the channel
mean, ``(B, 1, H, W)``, and (BAM) a channel tap with the spatial mean, ``(B, C)``.
"""
from __future__ import annotations

from typing import Optional, Tuple, Type

import torch
from torch import nn

from ..registry import register_attention
from .channel import (
    IdentityGate,
    autocast_off,
    check_channels,
    check_feature_map,
    check_norm_batch,
    compute_dtype,
    gained,
    is_channels_last,
    mean_over,
    reduced_channels,
)
from .excite import norm_any_batch, spatial_mean
from .functional import check_init, positive_int, zero_
from .tap import AttentionTap

__all__ = ["SpatialGroupEnhance", "SimAM", "TripletAttention", "BottleneckAttention", "ShuffleAttention",
           "default_groups", "group_std"]


def default_groups(channels: int, most: int, per_group: int = 1) -> int:
    """The largest ``g <= most`` with ``channels % (g * per_group) == 0`` (the paper's ``most`` where it fits)."""
    return max(g for g in range(1, most + 1) if channels % (g * per_group) == 0)


def group_std(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased standard deviation along ``dim`` (keepdim), 0 for a single value (``torch.std`` gives NaN),
    with a finite gradient where the values are all equal (a clamp below 1e-20 instead of ``sqrt(0)``)."""
    n = t.shape[dim]
    var = (t - t.mean(dim, keepdim=True)).square().sum(dim, keepdim=True) / max(n - 1, 1)
    return var.clamp_min(1e-20).sqrt() if n > 1 else var


# ---- SGE ---------------------------------------------------------------------------------------------------------


@register_attention("sge", layout="feature", kind="spatial")
class SpatialGroupEnhance(IdentityGate, nn.Module):
    """Spatial group-wise enhance (Li, Hu, Yang, 2019, arXiv 1905.09646).

    The channels in ``groups`` groups (64 in the paper; by default the largest count up to 64 that divides
    ``C``); in each, the similarity of every position's feature to the group's mean feature
    ``c_i = sum_k x_ik * mean_i(x_k)`` is normalised over the positions (``(c - mean) / (std + 1e-5)``,
    unbiased std as the authors' code, 0 for a 1x1 map where the code gives NaN), scaled and shifted per group
    (``weight`` zeros, ``bias`` ones as the authors' code) and gates the group's positions through a sigmoid.
    Statistics in fp32. Tap (kind ``"spatial"``): the mean over groups of the ``(B, G, H, W)`` gates,
    ``(B, 1, H, W)``. ``init="identity"``: ``weight`` and ``bias`` start at zero and the gate is
    ``2 * sigmoid``.
    """

    PAPER = ("Li, Hu, Yang, 2019, Spatial Group-wise Enhance: Improving Semantic Feature Learning in Convolutional "
             "Networks, arXiv 1905.09646")
    CHECKED_AGAINST = "the authors' SpatialGroupEnhance (PytorchInsight) written in the test, float64"
    IDENTITY = "weight and bias (bias 1 in the paper's init); gate 2 * sigmoid"

    def __init__(self, channels: int, groups: Optional[int] = None, gate_layer: Type[nn.Module] = nn.Sigmoid,
                 init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.init = check_init(init)
        self.groups = default_groups(channels, 64) if groups is None else positive_int("groups", groups,
                                                                                         divides=channels)
        self.weight = nn.Parameter(torch.zeros(1, self.groups, 1, 1))
        self.bias = nn.Parameter(torch.ones(1, self.groups, 1, 1))
        self.setup_gate(gate_layer, init, "spatial")

    def identity_layers(self) -> Tuple[Optional[torch.Tensor], ...]:
        return self.weight, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        B, C, H, W = x.shape
        G = self.groups
        acc = compute_dtype(x)
        with autocast_off(x):
            xg = x.to(acc).reshape(B, G, C // G, H * W)
            c = (xg * xg.mean(3, keepdim=True)).sum(2)  # (B, G, HW)
            t = (c - c.mean(2, keepdim=True)) / (group_std(c, 2) + 1e-5)
            t = t.view(B, G, H, W) * self.weight.to(acc) + self.bias.to(acc)
            w = gained(self.gate(t.to(self.weight.dtype)), self.gain)  # (B, G, H, W)
        if self.tap.active:
            self.tap(w.float().mean(1, keepdim=True))
        gate = w.to(x.dtype).repeat_interleave(C // G, dim=1)  # (B, C, H, W): each group's gate on its channels
        return x * gate


# ---- SimAM -------------------------------------------------------------------------------------------------------


@register_attention("simam", layout="feature", kind="spatial")
class SimAM(nn.Module):
    """SimAM, a parameter-free attention from an energy function (Yang, Zhang, Li, Xie, 2021, ICML, PMLR 139).

    Each neuron's inverse minimal energy ``1 / e* = (x - mu)^2 / (4 (sigma^2 + lambda)) + 1/2`` with the
    channel's mean ``mu`` and variance ``sigma^2 = sum (x - mu)^2 / n`` over its map, ``n = H*W - 1`` as the
    authors' code (``n = 1`` for a 1x1 map, where the code divides 0 by 0), ``lambda = 1e-4``; output
    ``x * sigmoid(1 / e*)``. No parameters. ``init="identity"`` adds one, which the paper's block does not
    have: a learned scale ``s`` starting at zero, ``out = x * (1 + s * (sigmoid(1 / e*) - 1))``, the input at
    ``s = 0`` and the paper's block at ``s = 1``. Statistics in fp32. Tap (kind ``"spatial"``): the channel
    mean of the multiplier, ``(B, 1, H, W)``.
    """

    PAPER = ("Yang, Zhang, Li, Xie, 2021, SimAM: A Simple, Parameter-Free Attention Module for Convolutional Neural "
             "Networks, ICML, PMLR 139:11863-11874 (no arXiv)")
    CHECKED_AGAINST = "the authors' simam_module written in the test (the paper's Eq. 5-6 energy), float64"
    IDENTITY = "adds a learned scale s = 0 (not in the paper): out = x * (1 + s * (sigmoid(1/e) - 1))"

    def __init__(self, channels: int, e_lambda: float = 1e-4, init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.init = check_init(init)
        if not (isinstance(e_lambda, (int, float)) and e_lambda > 0):
            raise ValueError(f"simam: e_lambda must be a number > 0, got {e_lambda!r}")
        self.e_lambda = float(e_lambda)
        self.scale = nn.Parameter(torch.zeros(())) if init == "identity" else None
        self.tap = AttentionTap("spatial", scale="gain" if init == "identity" else None)

    def zero_init_last(self) -> None:
        """With ``init="identity"``, the scale back to zero (timm's hook)."""
        if self.scale is not None:
            zero_(self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        acc = compute_dtype(x)
        n = max(x.shape[2] * x.shape[3] - 1, 1)
        with autocast_off(x):
            xf = x.to(acc)
            d = (xf - mean_over(x, (2, 3), acc, keepdim=True)).square()
            y = d / (4 * (d.sum((2, 3), keepdim=True) / n + self.e_lambda)) + 0.5
            g = torch.sigmoid(y)
            if self.scale is not None:
                g = 1 + self.scale.to(acc) * (g - 1)
        if self.tap.active:
            self.tap(g.float().mean(1, keepdim=True))
        return x * g.to(x.dtype)


# ---- triplet attention -----------------------------------------------------------------------------------------


class ZPoolGate(IdentityGate, nn.Module):
    """One branch of triplet attention: ``sigmoid(BN(conv_k([max_c; mean_c])))`` over dim 1 of its input
    (the authors' ``AttentionGate``: ZPool max first, a k x k conv without bias, BN with momentum 0.01)."""

    def __init__(self, kernel_size: int, gate_layer: Type[nn.Module], init: str):
        super().__init__()
        self.init = init
        self.conv = nn.Conv2d(2, 1, kernel_size, padding=(kernel_size - 1) // 2, bias=False)
        self.bn = nn.BatchNorm2d(1, eps=1e-5, momentum=0.01)
        self.setup_gate(gate_layer, init, "spatial")

    def identity_layers(self) -> Tuple[Optional[torch.Tensor], ...]:
        return self.bn.weight, self.bn.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The ``(B, 1, d2, d3)`` gate of ``x`` pooled over dim 1 (fp32 pooling, parameters' dtype)."""
        acc = compute_dtype(x)
        z = torch.stack([x.amax(1).to(acc), mean_over(x, (1,), acc)], dim=1).to(self.conv.weight.dtype)
        return gained(self.gate(norm_any_batch(self.bn, self.conv(z))), self.gain)


@register_attention("triplet", layout="feature", kind="spatial")
class TripletAttention(nn.Module):
    """Triplet attention (Misra, Nalamada, Arasanipalai, Hou, 2021, arXiv 2010.03045).

    Three branches, each a Z-pool (max and mean) over one axis, a 7x7 conv, BN and a sigmoid, on the input
    rotated so that the pooled axis is first: ``cw`` pools over H and gates (C, W); ``hc`` pools over W and
    gates (H, C); ``hw`` pools over C and gates (H, W) (left out with ``no_spatial=True``). The output is the
    mean of the three gated maps, here ``x * (g_cw + g_hc + g_hw) / 3``. Tap (kind ``"spatial"``): the
    channel mean of that averaged gate, ``(B, 1, H, W)``, on recording passes. ``init="identity"``: every
    branch's BN scale and shift start at zero and each gate is ``2 * sigmoid``.
    """

    PAPER = ("Misra, Nalamada, Arasanipalai, Hou, 2021, Rotate to Attend: Convolutional Triplet Attention Module, "
             "arXiv 2010.03045")
    CHECKED_AGAINST = "the authors' TripletAttention (permute, ZPool, BasicConv, sigmoid) written in the test, float64"
    IDENTITY = "each branch's BN scale and shift; gates 2 * sigmoid"

    def __init__(self, channels: int, kernel_size: int = 7, no_spatial: bool = False,
                 gate_layer: Type[nn.Module] = nn.Sigmoid, init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.init = check_init(init)
        positive_int("kernel_size", kernel_size, odd=True)
        self.cw = ZPoolGate(kernel_size, gate_layer, init)
        self.hc = ZPoolGate(kernel_size, gate_layer, init)
        self.hw = None if no_spatial else ZPoolGate(kernel_size, gate_layer, init)
        self.tap = AttentionTap("spatial", scale="gain" if init == "identity" else None)
        for branch in (self.cw, self.hc, self.hw):  # the block's one tap records the averaged gate
            if branch is not None:
                del branch.tap

    def zero_init_last(self) -> None:
        for branch in (self.cw, self.hc, self.hw):
            if branch is not None:
                branch.zero_init_last()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        B, C, H, W = x.shape
        if self.hw is not None:
            check_norm_batch(self, self.hw.bn, B * H * W, x)
        with autocast_off(x):
            g = self.cw(x.transpose(1, 2)).transpose(1, 2)  # pooled over H: (B, C, 1, W)
            g = g + self.hc(x.permute(0, 3, 2, 1)).permute(0, 3, 2, 1)  # pooled over W: (B, C, H, 1)
            if self.hw is not None:
                g = (g + self.hw(x)) / 3  # pooled over C: (B, 1, H, W)
            else:
                g = g / 2
        if self.tap.active:
            self.tap(spatial_mean(g, (H, W)))
        return x * g.to(x.dtype)


# ---- BAM -------------------------------------------------------------------------------------------------------


COMBINES = ("sum", "product")


class TapHolder(nn.Module):
    """A parameter-free holder of one tap, so a block with two taps records them as ``<block>.channel`` and
    ``<block>.spatial`` (the names CBAM's gates give)."""

    def __init__(self, tap: AttentionTap):
        super().__init__()
        self.tap = tap


@register_attention("bam", layout="feature", kind="spatial")
class BottleneckAttention(nn.Module):
    """Bottleneck attention module (Park, Woo, Lee, Kweon, 2018, arXiv 1807.06514).

    Channel branch ``M_c``: global average pool, ``C -> C/r`` linear, BatchNorm1d, ReLU, ``C/r -> C`` linear
    (``num_layers`` hidden layers; r = 16). Spatial branch ``M_s``: 1x1 conv ``C -> C/r``, BN, ReLU, two 3x3
    convs with dilation 4 (padding 4, so any map size keeps its size), each BN, ReLU, and a 1x1 conv to one
    map. Output ``x * (1 + sigmoid(M_c + M_s))``. The paper and the authors' code differ in two places, both
    options: the paper (Eq. 2-4, the default) ends each branch with a BN (``final_norm=True``) and sums the
    branches (``combine="sum"``); the code has no final BN and multiplies them (``final_norm=False,
    combine="product"``). The hidden layers' BN and ReLU are the code's (the paper's equations leave them
    out). The code's channel pool (``avg_pool2d`` with an ``H x H`` kernel) is the global mean only for
    square maps; here it is the global mean. BNs that see one value per channel in training give their shift
    (:func:`~visattn.attention.excite.norm_any_batch`). Taps (scale ``"gain"``): ``channel.tap``, the
    ``(B, C)`` spatial mean of the multiplier, and ``spatial.tap``, its ``(B, 1, H, W)`` channel mean, on
    recording passes. ``init="identity"``: each branch's last layer (its final BN's scale and shift where there is one;
    for ``"product"`` the spatial branch's only, so the channel branch still gets a gradient) starts at zero
    and the multiplier is read as ``(1 + sigmoid(z)) / 1.5``.
    """

    PAPER = "Park, Woo, Lee, Kweon, 2018, BAM: Bottleneck Attention Module, arXiv 1807.06514"
    CHECKED_AGAINST = ("the authors' BAM (ChannelGate, SpatialGate) written in the test: their code (product, no final "
                       "BN) and the paper's Eq. 2-4 (sum, final BNs), float64")
    IDENTITY = "each branch's final BN (or last layer); multiplier (1 + sigmoid) / 1.5"

    def __init__(self, channels: int, reduction_ratio: int = 16, num_layers: int = 1, dilation_conv_num: int = 2,
                 dilation_val: int = 4, combine: str = "sum", final_norm: bool = True, init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.init = check_init(init)
        if combine not in COMBINES:
            raise ValueError(f"bam: combine must be one of {', '.join(COMBINES)}, got {combine!r}")
        positive_int("reduction_ratio", reduction_ratio)
        positive_int("num_layers", num_layers)
        positive_int("dilation_val", dilation_val)
        self.combine, self.final_norm = combine, bool(final_norm)
        rd = reduced_channels(channels, 1.0 / reduction_ratio, None, 1)
        widths = [channels] + [rd] * num_layers
        layers = []
        for i in range(num_layers):
            layers += [nn.Linear(widths[i], widths[i + 1]), nn.BatchNorm1d(widths[i + 1]), nn.ReLU()]
        last = [nn.BatchNorm1d(channels)] if final_norm else []
        self.gate_c = nn.Sequential(*layers, nn.Linear(rd, channels), *last)
        layers = [nn.Conv2d(channels, rd, 1), nn.BatchNorm2d(rd), nn.ReLU()]
        for _ in range(dilation_conv_num):
            layers += [nn.Conv2d(rd, rd, 3, padding=dilation_val, dilation=dilation_val), nn.BatchNorm2d(rd), nn.ReLU()]
        last = [nn.BatchNorm2d(1)] if final_norm else []
        self.gate_s = nn.Sequential(*layers, nn.Conv2d(rd, 1, 1), *last)
        self.gain = 1.0 if init == "default" else 1 / 1.5
        self.channel = TapHolder(AttentionTap("channel", scale="gain"))  # records as "<block>.channel"
        self.spatial = TapHolder(AttentionTap("spatial", scale="gain"))  # and "<block>.spatial", as CBAM's
        self.zero_init_last()

    def zero_init_last(self) -> None:
        """With ``init="identity"``, the branches' last layers at zero (timm's hook)."""
        if self.init == "identity":
            zero_(self.gate_s[-1].weight, self.gate_s[-1].bias)
            if self.combine == "sum":
                zero_(self.gate_c[-1].weight, self.gate_c[-1].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        dt = self.gate_s[0].weight.dtype
        with autocast_off(x):
            mc = mean_over(x, (2, 3), compute_dtype(x)).to(dt)  # (B, C)
            for m in self.gate_c:
                mc = norm_any_batch(m, mc)
            ms = x.to(dt)
            for m in self.gate_s:
                ms = norm_any_batch(m, ms)  # (B, 1, H, W)
            z = mc[:, :, None, None] + ms if self.combine == "sum" else mc[:, :, None, None] * ms
            att = 1 + torch.sigmoid(z)
            if self.gain != 1.0:
                att = att / 1.5  # exactly 1 at z = 0
        if self.channel.tap.active:
            self.channel.tap(att.float().mean((2, 3)))
        if self.spatial.tap.active:
            self.spatial.tap(att.float().mean(1, keepdim=True))
        return x * att.to(x.dtype)


# ---- shuffle attention -------------------------------------------------------------------------------------------


@register_attention("shuffle", layout="feature", kind="spatial")
class ShuffleAttention(IdentityGate, nn.Module):
    """Shuffle attention (Zhang, Yang, 2021, arXiv 2102.00240).

    The channels in ``groups`` groups (64 in the paper; by default the largest count up to 64 with
    ``C % (2 * groups) == 0``), each split in two halves of ``k = C / (2 * groups)`` channels: the channel
    half is gated by ``sigmoid(cweight * mean_hw(x) + cbias)``, the spatial half by
    ``sigmoid(sweight * GN(x) + sbias)`` (GroupNorm(k, k): per channel over its map); the halves are
    concatenated and a channel shuffle of 2 interleaves them (parameters as the authors' code: weights 0,
    biases 1). ``init="identity"``: cweight, cbias, sweight and sbias start at zero, the gates are
    ``2 * sigmoid``, and the channel shuffle is left out (``shuffle=False``, which the paper's block does not
    have: a permutation cannot start as the identity); every channel is gated in place. Statistics in
    fp32. Tap (kind ``"spatial"``): the channel mean of the gates, ``(B, 1, H, W)``, on recording passes.
    """

    PAPER = "Zhang, Yang, 2021, SA-Net: Shuffle Attention for Deep Convolutional Neural Networks, arXiv 2102.00240"
    CHECKED_AGAINST = "the authors' sa_layer written in the test, float64"
    IDENTITY = "cweight, cbias, sweight, sbias; gates 2 * sigmoid; no channel shuffle (added: not in the paper)"

    def __init__(self, channels: int, groups: Optional[int] = None, shuffle: Optional[bool] = None,
                 gate_layer: Type[nn.Module] = nn.Sigmoid, init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.init = check_init(init)
        if channels % 2:
            raise ValueError(f"shuffle: channels must be even (two halves per group), got {channels}")
        if groups is None:
            groups = default_groups(channels, 64, per_group=2)
        elif positive_int("groups", groups) and channels % (2 * groups):
            raise ValueError(f"shuffle: channels ({channels}) must be divisible by 2 * groups ({2 * groups})")
        self.groups = groups
        self.shuffle = (init == "default") if shuffle is None else bool(shuffle)
        if self.shuffle and init == "identity":
            raise ValueError("shuffle: init='identity' needs shuffle=False (a channel shuffle is not the identity)")
        k = channels // (2 * groups)
        self.cweight = nn.Parameter(torch.zeros(1, k, 1, 1))
        self.cbias = nn.Parameter(torch.ones(1, k, 1, 1))
        self.sweight = nn.Parameter(torch.zeros(1, k, 1, 1))
        self.sbias = nn.Parameter(torch.ones(1, k, 1, 1))
        self.gn = nn.GroupNorm(k, k)
        self.setup_gate(gate_layer, init, "spatial")

    def identity_layers(self) -> Tuple[Optional[torch.Tensor], ...]:
        return self.cweight, self.cbias, self.sweight, self.sbias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        B, C, H, W = x.shape
        acc = compute_dtype(x)
        with autocast_off(x):
            xg = x.reshape(B * self.groups, 2, C // (2 * self.groups), H, W)
            x0, x1 = xg[:, 0], xg[:, 1]
            cw = mean_over(x0, (2, 3), acc, keepdim=True).to(self.cweight.dtype)
            g0 = gained(self.gate(self.cweight * cw + self.cbias), self.gain)  # (BG, k, 1, 1)
            sn = self.gn(x1.to(self.gn.weight.dtype))
            g1 = gained(self.gate(self.sweight * sn + self.sbias), self.gain)  # (BG, k, H, W)
            gate = torch.stack([g0.expand_as(g1), g1], dim=1).reshape(B, C, H, W)
        if self.tap.active:
            self.tap(gate.float().mean(1, keepdim=True))
        out = x * gate.to(x.dtype)
        if self.shuffle:  # channel shuffle with 2 groups: (B, 2, C/2) -> (B, C/2, 2), in the input's layout
            out = out.reshape(B, 2, C // 2, H, W).transpose(1, 2).reshape(B, C, H, W)
            if is_channels_last(x):
                out = out.contiguous(memory_format=torch.channels_last)
        return out


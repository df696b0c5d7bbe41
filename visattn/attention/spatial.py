"""Spatial attention: CBAM's spatial gate, CBAM and coordinate attention.

* ``spatial``: the spatial gate of CBAM (Woo, Park, Lee, Kweon, 2018, "CBAM: Convolutional Block Attention
  Module", arXiv 1807.06521): channel mean and max maps, 7x7 conv, BatchNorm, sigmoid.
* ``cbam``: CBAM itself, a channel gate (shared MLP over the average- and max-pooled vectors) followed by
  the spatial gate.
* ``coord``: coordinate attention (Hou, Zhou, Feng, 2021, "Coordinate Attention for Efficient Mobile
  Network Design", arXiv 2103.02907).

The CBAM gates run through :func:`~visattn.attention.channel.gate_features` (a hand-written backward
with two full-size buffers instead of autograd's dozen temporaries). Compared with the straightforward
version (timm's ``CbamModule``) it also runs the shared MLP once on the stacked avg/max vectors (and
``fc2`` once, on the sum of the two hidden vectors: ``fc2`` is linear) and feeds the 2-channel 7x7 conv a
channels-last map.
"""
from __future__ import annotations

from typing import Optional, Type

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .channel import check_channels, gate_features, reduced_channels
from .registry import register_attention
from .tap import AttentionTap

__all__ = ["ChannelGate", "SpatialGate", "CBAM", "CoordAttention", "coord_mip"]


class ChannelGate(nn.Module):
    """CBAM's channel gate: ``sigmoid(MLP(avgpool(x)) + MLP(maxpool(x)))`` with one shared bottleneck MLP
    (1x1 convs, ReLU, no bias as in the paper's equation; names match timm's ``ChannelAttn``).
    Tap: the ``(B, C)`` gate."""

    pool_max = True

    def __init__(
        self,
        channels: int,
        rd_ratio: float = 1.0 / 16,
        rd_channels: Optional[int] = None,
        rd_divisor: int = 1,
        act_layer: Type[nn.Module] = nn.ReLU,
        gate_layer: Type[nn.Module] = nn.Sigmoid,
        mlp_bias: bool = False,
    ):
        super().__init__()
        check_channels(channels)
        rd = reduced_channels(channels, rd_ratio, rd_channels, rd_divisor)
        self.fc1 = nn.Conv2d(channels, rd, kernel_size=1, bias=mlp_bias)
        self.act = act_layer()
        self.fc2 = nn.Conv2d(rd, channels, kernel_size=1, bias=mlp_bias)
        self.gate = gate_layer()
        self.tap = AttentionTap("channel")

    def channel_weights(self, pooled: torch.Tensor) -> torch.Tensor:
        P, B, C = pooled.shape  # P = 2: average and max
        s = pooled.to(self.fc1.weight.dtype).reshape(P * B, C, 1, 1)
        h = self.act(self.fc1(s)).view(P, B, -1, 1, 1).sum(0)  # shared MLP run once on both vectors
        logits = self.fc2(h)  # fc2(h_avg) + fc2(h_max) == fc2(h_avg + h_max) ...
        if self.fc2.bias is not None:
            logits = logits + (P - 1) * self.fc2.bias[:, None, None]  # ... plus the bias once per extra pool
        return self.tap(self.gate(logits.flatten(1)))  # (B, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gate_features(x, self, None)


@register_attention("spatial", layout="feature", kind="spatial")
class SpatialGate(nn.Module):
    """CBAM's spatial gate (Woo et al., 2018, arXiv 1807.06521).

    ``sigmoid(BN(conv7x7([mean_c(x); max_c(x)])))`` multiplies every position. ``channels`` is only
    checked (the gate has the same parameters for any width). Tap: the ``(B, 1, H, W)`` gate.
    """

    def __init__(
        self,
        channels: int,
        kernel_size: int = 7,
        gate_layer: Type[nn.Module] = nn.Sigmoid,
        norm_layer: Optional[Type[nn.Module]] = nn.BatchNorm2d,
    ):
        super().__init__()
        check_channels(channels)
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd int, got {kernel_size!r}")
        self.kernel_size = kernel_size
        self.conv = nn.Conv2d(2, 1, kernel_size, padding=kernel_size // 2, bias=False)
        self.bn = norm_layer(1) if norm_layer is not None else nn.Identity()
        self.gate = gate_layer()
        self.tap = AttentionTap("spatial")

    def spatial_weights(self, maps: torch.Tensor) -> torch.Tensor:
        z = self.bn(self.conv(maps.to(self.conv.weight.dtype)))  # (B, 1, H, W)
        return self.tap(self.gate(z))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gate_features(x, None, self)


@register_attention("cbam", layout="feature", kind="channel")
class CBAM(nn.Module):
    """Convolutional block attention module (Woo, Park, Lee, Kweon, 2018, arXiv 1807.06521).

    :class:`ChannelGate` (reduction 16) then :class:`SpatialGate` (7x7), applied in sequence. Numerically
    equal to timm's ``CbamModule`` with the same weights (parameters in the same order; the spatial
    gate's conv is ``spatial.conv`` here, ``spatial.conv.conv`` there). Two taps: ``channel.tap`` with the
    ``(B, C)`` gate and ``spatial.tap`` with the ``(B, 1, H, W)`` gate. Forward hooks on the sub-gates do not
    fire (the block runs both gates in one fused kernel); their taps do.
    """

    def __init__(
        self,
        channels: int,
        rd_ratio: float = 1.0 / 16,
        rd_channels: Optional[int] = None,
        rd_divisor: int = 1,
        spatial_kernel_size: int = 7,
        act_layer: Type[nn.Module] = nn.ReLU,
        gate_layer: Type[nn.Module] = nn.Sigmoid,
        mlp_bias: bool = False,
    ):
        super().__init__()
        self.channel = ChannelGate(channels, rd_ratio, rd_channels, rd_divisor, act_layer, gate_layer, mlp_bias)
        self.spatial = SpatialGate(channels, spatial_kernel_size, gate_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gate_features(x, self.channel, self.spatial)


class _CoordGate(torch.autograd.Function):
    """``x * a_h[..., None] * a_w[..., None, :]`` with one full-size allocation each way (autograd would
    keep ``x * a_h`` and materialise ``grad * x`` twice)."""

    @staticmethod
    def forward(ctx, x, a_h, a_w):  # x (B, C, H, W), a_h (B, C, H), a_w (B, C, W)
        ctx.save_for_backward(x, a_h, a_w)
        out = x * a_h.to(x.dtype)[..., None]
        return out.mul_(a_w.to(x.dtype)[..., None, :])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, a_h, a_w = ctx.saved_tensors
        dt = x.dtype
        ah = a_h.to(dt)[..., None]  # (B, C, H, 1)
        aw = a_w.to(dt)[..., None, :]  # (B, C, 1, W)
        buf = torch.empty_like(x)  # scratch for G * x, then grad_x
        gx = torch.mul(grad, x, out=buf)
        d_h = torch.matmul(gx, aw.transpose(-2, -1))[..., 0]  # sum_w(G x a_w): (B, C, H)
        d_w = torch.matmul(ah.transpose(-2, -1), gx)[..., 0, :]  # sum_h(G x a_h): (B, C, W)
        grad_x = torch.mul(grad, ah, out=buf).mul_(aw) if ctx.needs_input_grad[0] else None
        return grad_x, d_h.to(a_h.dtype), d_w.to(a_w.dtype)


class _StripMean(torch.autograd.Function):
    """``x.mean(dim)`` whose backward returns the broadcast grad as a stride-0 view: autograd's own mean
    backward divides a materialised full-size copy; this one is added in place into the grad that
    :class:`_CoordGate` already wrote for ``x``."""

    @staticmethod
    def forward(ctx, x, dim):
        ctx.dim, ctx.shape = dim, x.shape
        return x.mean(dim)

    @staticmethod
    def backward(ctx, grad):
        return (grad / ctx.shape[ctx.dim]).unsqueeze(ctx.dim).expand(ctx.shape), None


def coord_mip(channels: int, reduction: int = 32) -> int:
    """Coordinate attention's bottleneck width, ``max(8, C // reduction)`` as in the paper's code."""
    return max(8, channels // reduction)


@register_attention("coord", layout="feature", kind="spatial")
class CoordAttention(nn.Module):
    """Coordinate attention (Hou, Zhou, Feng, 2021, arXiv 2103.02907).

    Pools along each axis separately (``(B, C, H)`` over the width, ``(B, C, W)`` over the height), encodes
    both strips with one shared 1x1 conv ``C -> mip`` + BN + h-swish (``mip = max(8, C // 32)``), then splits
    them into two sigmoid gates ``a_h (B, C, H, 1)`` and ``a_w (B, C, 1, W)``; ``out = x * a_h * a_w``.
    Tap (kind ``"spatial"``): the channel mean of ``a_h * a_w`` as a ``(B, 1, H, W)`` map, computed only on
    recording passes.
    """

    def __init__(
        self,
        channels: int,
        reduction: int = 32,
        mip: Optional[int] = None,
        act_layer: Type[nn.Module] = nn.Hardswish,  # the paper's h_swish
        norm_layer: Optional[Type[nn.Module]] = nn.BatchNorm2d,
        gate_layer: Type[nn.Module] = nn.Sigmoid,
    ):
        super().__init__()
        check_channels(channels)
        if isinstance(reduction, bool) or not isinstance(reduction, int) or reduction < 1:
            raise ValueError(f"reduction must be a positive int, got {reduction!r}")
        if mip is None:
            mip = coord_mip(channels, reduction)
        if isinstance(mip, bool) or not isinstance(mip, int) or mip < 1:
            raise ValueError(f"mip must be a positive int or None, got {mip!r}")
        self.mip = mip
        self.conv1 = nn.Conv2d(channels, mip, kernel_size=1)
        self.bn1 = norm_layer(mip) if norm_layer is not None else nn.Identity()
        self.act = act_layer()
        self.conv_h = nn.Conv2d(mip, channels, kernel_size=1)
        self.conv_w = nn.Conv2d(mip, channels, kernel_size=1)
        self.gate = gate_layer()
        self.tap = AttentionTap("spatial")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        # both strips side by side as one (B, C, H + W, 1) map, so conv1 and BN see them together
        strips = torch.cat([_StripMean.apply(x, 3), _StripMean.apply(x, 2)], dim=2)[..., None]
        y = self.act(self.bn1(self.conv1(strips)))  # (B, mip, H + W, 1)
        y_h, y_w = y.split([H, W], dim=2)
        a_h = self.gate(self.conv_h(y_h))[..., 0]  # (B, C, H)
        a_w = self.gate(self.conv_w(y_w))[..., 0]  # (B, C, W)
        if self.tap.active:
            # mean over channels of the outer product a_h * a_w: (B, H, W)
            amap = torch.einsum("bch,bcw->bhw", a_h.float(), a_w.float()) / C
            self.tap(amap[:, None])
        return _CoordGate.apply(x, a_h, a_w)

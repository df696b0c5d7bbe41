"""Spatial attention: CBAM's spatial gate, CBAM and coordinate attention.

* ``spatial``: the spatial gate of CBAM (Woo, Park, Lee, Kweon, 2018, "CBAM: Convolutional Block Attention
  Module", arXiv 1807.06521): channel mean and max maps, 7x7 conv, BatchNorm, sigmoid.
* ``cbam``: CBAM itself, a channel gate (shared MLP over the average- and max-pooled vectors) followed by
  the spatial gate.
* ``coord``: coordinate attention (Hou, Zhou, Feng, 2021, "Coordinate Attention for Efficient Mobile
  Network Design", arXiv 2103.02907).
* ``strip``: timm's strip attention, a minimal form of strip pooling (Hou, Zhang, Cheng, Feng, 2020, "Strip
  Pooling: Rethinking Spatial Pooling for Scene Parsing", arXiv 2003.13328).

Plain differentiable PyTorch, like :mod:`~visattn.attention.channel`. Unlike timm's ``CbamModule``, CBAM runs
the shared MLP once on the stacked avg/max vectors (``fc2`` once, on the sum of the hidden vectors: it is
linear) and feeds the 2-channel 7x7 conv a channels-last map, the layout oneDNN runs far faster on CPU. Coordinate
attention's product ``x * a_h * a_w`` on a bf16 channels-last map on the CPU goes through :func:`coord_gate`: the
same output, with the gates' gradients summed by :func:`~visattn.attention.channel.axis_sum` (autograd's ``sum``
along a middle axis of such a map runs several times slower).

``init="identity"`` (the rule of :mod:`visattn.attention.channel`): the layer that makes each gate's logits
starts at zero (the spatial gate's BN scale and shift, or its conv without a norm; the channel gate's ``fc2``;
coordinate attention's ``conv_h`` and ``conv_w``) and each gate is ``2 * sigmoid``: the block starts as the
identity and its taps carry the 0-2 multiplier (scale ``"gain"``).
"""
from __future__ import annotations

from typing import Optional, Tuple, Type

import torch
from torch import nn

from ..registry import register_attention
from .channel import (
    BottleneckGate,
    IdentityGate,
    autocast_off,
    axis_sum,
    check_bool,
    check_channels,
    check_choice,
    check_feature_map,
    check_norm_batch,
    compute_dtype,
    gained,
    is_channels_last,
    mean_max,
    mean_over,
)
from .functional import check_init, positive_int

__all__ = ["ChannelGate", "SpatialGate", "CBAM", "CoordAttention", "StripAttention", "coord_mip", "coord_gate"]

CBAM_PAPER = "Woo, Park, Lee, Kweon, 2018, CBAM: Convolutional Block Attention Module, arXiv 1807.06521"


class ChannelGate(BottleneckGate):
    """CBAM's channel gate: ``sigmoid(MLP(avgpool(x)) + MLP(maxpool(x)))`` with SE's bottleneck MLP shared by
    both (no bias, as in the paper's equation; names match timm's ``ChannelAttn``). Tap: the ``(B, C)`` gate."""

    def __init__(self, channels: int, rd_ratio: float = 1.0 / 16, rd_channels: Optional[int] = None,
                 rd_divisor: int = 1, act_layer: Type[nn.Module] = nn.ReLU, gate_layer: Type[nn.Module] = nn.Sigmoid,
                 mlp_bias: bool = False, init: str = "default", light: bool = False):
        super().__init__(channels, rd_ratio, rd_channels, rd_divisor, act_layer, gate_layer, mlp_bias, init)
        self.light = check_bool("cbam", "light", light)

    def channel_weights(self, x: torch.Tensor) -> torch.Tensor:
        """The ``(B, C)`` gate of ``x`` (in the parameters' dtype; call with autocast off)."""
        B, C = x.shape[:2]
        acc = compute_dtype(x)
        if self.light:  # timm's LightChannelAttn: the MLP once, on the average of the two pooled vectors
            avg, top = mean_max(x, (2, 3), acc)
            s = (0.5 * avg + 0.5 * top).to(self.fc1.weight.dtype)[:, :, None, None]
            return self.tap(gained(self.gate(self.fc2(self.act(self.fc1(s))).flatten(1)), self.gain))
        pooled = torch.stack(mean_max(x, (2, 3), acc))  # (2, B, C): avg, max
        s = pooled.to(self.fc1.weight.dtype).reshape(2 * B, C, 1, 1)
        h = self.act(self.fc1(s)).view(2, B, -1, 1, 1).sum(0)  # shared MLP run once on both vectors
        logits = self.fc2(h)  # fc2(h_avg) + fc2(h_max) == fc2(h_avg + h_max) ...
        if self.fc2.bias is not None:
            logits = logits + self.fc2.bias[:, None, None]  # ... plus the bias once more
        return self.tap(gained(self.gate(logits.flatten(1)), self.gain))  # (B, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        with autocast_off(x):
            w = self.channel_weights(x)
        return x * w.to(x.dtype)[:, :, None, None]


@register_attention("spatial", layout="feature", kind="spatial")
class SpatialGate(IdentityGate, nn.Module):
    """CBAM's spatial gate (Woo et al., 2018, arXiv 1807.06521).

    ``sigmoid(BN(conv7x7([mean_c(x); max_c(x)])))`` multiplies every position. Works for any channel count:
    the gate pools over the channels. Tap: the ``(B, 1, H, W)`` gate. ``init="identity"``: the BN's scale and
    shift (or the conv, without a norm) start at zero and the gate is ``2 * sigmoid``.
    """

    PAPER = CBAM_PAPER
    CHECKED_AGAINST = ("timm SpatialAttn; light=True: timm LightSpatialAttn (float64, weights copied, outputs and "
                       "gradients)")
    IDENTITY = "the BN's scale and shift (the conv without a norm) zeroed, gate read as 2 * sigmoid"

    def __init__(self, channels: int, kernel_size: int = 7, gate_layer: Type[nn.Module] = nn.Sigmoid,
                 norm_layer: Optional[Type[nn.Module]] = nn.BatchNorm2d, light: bool = False, init: str = "default"):
        super().__init__()
        check_channels(channels)
        positive_int("kernel_size", kernel_size, odd=True)
        self.kernel_size = kernel_size
        self.init = check_init(init)
        self.light = check_bool("spatial", "light", light)
        self.conv = nn.Conv2d(1 if light else 2, 1, kernel_size, padding=kernel_size // 2, bias=False)
        self.bn = norm_layer(1) if norm_layer is not None else nn.Identity()
        self.setup_gate(gate_layer, init, "spatial")

    def identity_layers(self) -> Tuple[Optional[torch.Tensor], ...]:
        if getattr(self.bn, "weight", None) is not None:  # the BN's scale and shift, else the conv
            return self.bn.weight, getattr(self.bn, "bias", None)
        return (self.conv.weight,)

    def spatial_weights(self, x: torch.Tensor) -> torch.Tensor:
        """The ``(B, 1, H, W)`` gate of ``x`` (in the parameters' dtype; call with autocast off)."""
        acc = compute_dtype(x)
        if self.light:  # timm's LightSpatialAttn: one map, the average of the channel mean and max
            avg, top = mean_max(x, (1,), acc)
            maps = (0.5 * avg + 0.5 * top)[:, None]  # (B, 1, H, W)
        else:
            # channel mean and max stacked last, (B, H, W, 2), seen as (B, 2, H, W): channels-last is the layout
            # in which oneDNN runs the 2-channel 7x7 conv (forward + backward) an order of magnitude faster on CPU
            maps = torch.stack(mean_max(x, (1,), acc), dim=-1).permute(0, 3, 1, 2)
        z = self.bn(self.conv(maps.to(self.conv.weight.dtype)))  # (B, 1, H, W)
        return self.tap(gained(self.gate(z), self.gain))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x)  # any channel count
        check_norm_batch(self, self.bn, x.shape[0] * x.shape[2] * x.shape[3], x)
        with autocast_off(x):
            w = self.spatial_weights(x)
        return x * w.to(x.dtype)


@register_attention("cbam", layout="feature", kind="channel")
class CBAM(nn.Module):
    """Convolutional block attention module (Woo, Park, Lee, Kweon, 2018, arXiv 1807.06521).

    :class:`ChannelGate` (reduction 16) then :class:`SpatialGate` (7x7), in sequence; equal to timm's
    ``CbamModule`` with the same weights (its ``spatial.conv.conv`` is ``spatial.conv`` here). Two taps:
    ``channel.tap`` (the ``(B, C)`` gate) and ``spatial.tap`` (the ``(B, 1, H, W)`` gate); forward hooks on
    the sub-gates do not fire. ``init`` goes to both gates.

    ``light=True``: timm's light CBAM (``LightCbamModule``, 'lcbam'; not in the paper): each gate pools the
    average of the mean and the max (``0.5 * avg + 0.5 * max``) instead of using both, so the channel MLP
    runs once and the spatial conv takes one map (``1 -> 1``, k x k).
    """

    PAPER = CBAM_PAPER
    CHECKED_AGAINST = ("timm CbamModule; light=True: timm LightCbamModule (float64, weights copied, outputs, "
                       "gradients and BN statistics)")
    IDENTITY = ("both gates' last layers zeroed (channel fc2; spatial BN scale and shift), each gate read as "
                "2 * sigmoid")

    def __init__(self, channels: int, rd_ratio: float = 1.0 / 16, rd_channels: Optional[int] = None,
                 rd_divisor: int = 1, spatial_kernel_size: int = 7, act_layer: Type[nn.Module] = nn.ReLU,
                 gate_layer: Type[nn.Module] = nn.Sigmoid, mlp_bias: bool = False, light: bool = False,
                 init: str = "default"):
        super().__init__()
        self.init = check_init(init)
        self.channel = ChannelGate(channels, rd_ratio, rd_channels, rd_divisor, act_layer, gate_layer, mlp_bias, init,
                                   light=check_bool("cbam", "light", light))
        self.spatial = SpatialGate(channels, spatial_kernel_size, gate_layer, light=light, init=init)

    def zero_init_last(self) -> None:
        """Both gates' (timm's hook; see :meth:`SpatialGate.zero_init_last`)."""
        self.channel.zero_init_last()
        self.spatial.zero_init_last()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channel.channels)
        check_norm_batch(self, self.spatial.bn, x.shape[0] * x.shape[2] * x.shape[3], x)
        with autocast_off(x):
            cg = self.channel.channel_weights(x)  # (B, C)
        xc = x * cg.to(x.dtype)[:, :, None, None]
        with autocast_off(x):
            sg = self.spatial.spatial_weights(xc)  # (B, 1, H, W) gate of the channel-gated map
        return xc * sg.to(x.dtype)


class _CoordGate(torch.autograd.Function):
    """``x * a_h * a_w``, coordinate attention's two gates applied in turn, with the gates' gradients summed along
    the map's axes by :func:`~visattn.attention.channel.axis_sum`: autograd's own backward sums them with ``sum``,
    which on the CPU runs several times slower along a middle axis of a bf16 channels-last map than the pass that
    forms the product. The same products otherwise, the same values (the forward's in the same order; the product
    ``x * a_h`` is returned beside the output, non-differentiable, to be saved as autograd saves it). Written in
    differentiable ops (double backward holds); ``generate_vmap_rule`` serves ``torch.func``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, a_h: torch.Tensor, a_w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        t = x * a_h
        return t * a_w, t

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)  # the saved product gets no gradient: no map of zeros for it
        ctx.save_for_backward(*inputs, output[1])

    @staticmethod
    def backward(ctx, g: Optional[torch.Tensor], _: Optional[torch.Tensor]):
        if g is None:
            return None, None, None
        x, a_h, a_w, t = ctx.saved_tensors
        if torch.is_grad_enabled():  # a double backward: the saved product has no history, so form it again
            t = x * a_h
        u = g * a_w  # the gradient reaching t = x * a_h
        g_x = u * a_h if ctx.needs_input_grad[0] else None  # autograd's own two products, in its order
        # the map first: a product takes its first operand's layout, so the summands lie channels-last (x's layout,
        # the one axis_sum is fast on) even when the upstream gradient does not; the same values either way
        g_h = axis_sum(x * u, 3, keepdim=True) if ctx.needs_input_grad[1] else None  # (B, C, H, 1)
        g_w = axis_sum(t * g, 2, keepdim=True) if ctx.needs_input_grad[2] else None  # (B, C, 1, W)
        return g_x, g_h, g_w


def coord_gate(x: torch.Tensor, a_h: torch.Tensor, a_w: torch.Tensor) -> torch.Tensor:
    """``x * a_h * a_w`` with ``a_h`` ``(B, C, H, 1)`` and ``a_w`` ``(B, C, 1, W)``, the same output bit for bit
    whichever way it runs: while autograd records, for a bf16 channels-last map on the CPU and gates of exactly those
    shapes, through :class:`_CoordGate` (its gates' gradients summed the fast way), else as written."""
    fast = (torch.is_grad_enabled() and x.dtype == a_h.dtype == a_w.dtype == torch.bfloat16
            and x.device.type == "cpu" and x.dim() == 4 and a_h.shape == (*x.shape[:3], 1)
            and a_w.shape == (*x.shape[:2], 1, x.shape[3]) and is_channels_last(x))
    return _CoordGate.apply(x, a_h, a_w)[0] if fast else x * a_h * a_w


def coord_mip(channels: int, reduction: int = 32) -> int:
    """Coordinate attention's bottleneck width, ``max(8, C // reduction)`` as in the paper's code."""
    return max(8, channels // reduction)


COORD_COMBINES = ("product", "sum")


@register_attention("coord", layout="feature", kind="spatial")
class CoordAttention(IdentityGate, nn.Module):
    """Coordinate attention (Hou, Zhou, Feng, 2021, arXiv 2103.02907).

    Pools along each axis (``(B, C, H)`` and ``(B, C, W)``), encodes both strips with one shared 1x1 conv
    ``C -> mip`` + BN + h-swish (``mip = max(8, C // 32)``), then splits them into sigmoid gates
    ``a_h (B, C, H, 1)`` and ``a_w (B, C, 1, W)``; ``out = x * a_h * a_w`` (:func:`coord_gate`: for a bf16
    channels-last map on the CPU, the same output bit for bit with the gates' gradients summed the fast way). Tap
    (kind ``"spatial"``): the channel mean of ``a_h * a_w``, ``(B, 1, H, W)``, on recording passes only.
    ``init="identity"``: ``conv_h`` and ``conv_w`` start at zero and both gates are ``2 * sigmoid`` (the 0-4
    product saturates the tap's 0-2 ``"gain"`` scale). ``bias``: the three 1x1 convs' biases (the paper's code has
    them; timm's ``CoordAttn`` defaults to none).

    ``combine="sum"``: timm's simple coordinate attention (``SimpleCoordAttn``, 'scoord'; not in the paper):
    one gate of the summed logits, ``out = x * sigmoid(l_h + l_w)`` (the tap: its channel mean), with timm's
    other choices as the options ``norm_layer=None``, ``act_layer=nn.SiLU`` and ``mip`` (its width,
    ``make_divisible(C / 6, 8)``); ``init="identity"`` then zeroes the same convs and reads the one gate as
    ``2 * sigmoid``.
    """

    PAPER = "Hou, Zhou, Feng, 2021, Coordinate Attention for Efficient Mobile Network Design, arXiv 2103.02907"
    CHECKED_AGAINST = ("timm CoordAttn (bias=True and bias=False); combine='sum': timm SimpleCoordAttn (float64, "
                       "weights copied, outputs and gradients)")
    IDENTITY = "conv_h and conv_w zeroed, each gate read as 2 * sigmoid"

    def __init__(self, channels: int, reduction: int = 32, mip: Optional[int] = None,
                 act_layer: Type[nn.Module] = nn.Hardswish,  # the paper's h_swish
                 norm_layer: Optional[Type[nn.Module]] = nn.BatchNorm2d, gate_layer: Type[nn.Module] = nn.Sigmoid,
                 bias: bool = True, combine: str = "product", init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.init = check_init(init)
        positive_int("reduction", reduction)
        if mip is None:
            mip = coord_mip(channels, reduction)
        positive_int("mip", mip)
        check_bool("coord", "bias", bias)
        self.combine = check_choice("coord", "combine", combine, COORD_COMBINES)
        self.mip = mip
        self.conv1 = nn.Conv2d(channels, mip, kernel_size=1, bias=bias)
        self.bn1 = norm_layer(mip) if norm_layer is not None else nn.Identity()
        self.act = act_layer()
        self.conv_h = nn.Conv2d(mip, channels, kernel_size=1, bias=bias)
        self.conv_w = nn.Conv2d(mip, channels, kernel_size=1, bias=bias)
        self.setup_gate(gate_layer, init, "spatial")

    def identity_layers(self) -> Tuple[Optional[torch.Tensor], ...]:
        return self.conv_h.weight, self.conv_h.bias, self.conv_w.weight, self.conv_w.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        B, C, H, W = x.shape
        # both strips side by side as one (B, C, H + W, 1) map, so conv1 and BN see them together
        strips = torch.cat([mean_over(x, (3,), x.dtype), mean_over(x, (2,), x.dtype)], dim=2)[..., None]
        if is_channels_last(x):  # the gates then share x's layout, channels innermost: x * a_h * a_w vectorises
            strips = strips.contiguous(memory_format=torch.channels_last)  # (a small map: the copy is cheap)
        y = self.act(self.bn1(self.conv1(strips)))  # (B, mip, H + W, 1)
        y_h, y_w = y.split([H, W], dim=2)
        if self.combine == "sum":  # one gate of the summed logits: (B, C, H, W)
            a = gained(self.gate(self.conv_h(y_h) + self.conv_w(y_w).transpose(2, 3)), self.gain)
            if self.tap.active:
                self.tap(a.float().mean(1, keepdim=True))
            return x * a
        a_h = gained(self.gate(self.conv_h(y_h)), self.gain)  # (B, C, H, 1)
        a_w = gained(self.gate(self.conv_w(y_w)), self.gain).transpose(2, 3)  # (B, C, 1, W)
        if self.tap.active:
            # mean over channels of the outer product a_h * a_w: (B, 1, H, W)
            self.tap((a_h.float() * a_w.float()).mean(1, keepdim=True))
        return coord_gate(x, a_h, a_w)


@register_attention("strip", layout="feature", kind="spatial")
class StripAttention(IdentityGate, nn.Module):
    """Strip attention: timm's ``StripAttn`` ('strip'), a minimal form of the strip pooling module of Hou,
    Zhang, Cheng, Feng, 2020, "Strip Pooling: Rethinking Spatial Pooling for Scene Parsing", arXiv 2003.13328.

    Each channel is averaged along each axis (the strips ``(B, C, H, 1)`` and ``(B, C, 1, W)``), each strip
    goes through a depthwise 1D conv (``kernel_size`` 3, no bias: ``conv_h`` along H, ``conv_w`` along W),
    and the broadcast sum, gated by a sigmoid, multiplies the input: ``out = x * sigmoid(s_h + s_w)``. The
    paper's module (its SPBlock) uses full ``C -> C`` 1D convs with BN, a ReLU after the sum and a 1x1 conv
    before the sigmoid; timm's (this block) keeps only the strips, the depthwise convs and the gate.
    ``use_conv=False`` drops the convs (the gate of the raw strip means). Pooled strips and gate are in fp32
    (the convs in their parameters' dtype). Tap (kind ``"spatial"``): the channel mean of the gate,
    ``(B, 1, H, W)``, on recording passes only. ``init="identity"``: ``conv_h`` and ``conv_w`` start at zero
    and the gate is ``2 * sigmoid`` (so it needs ``use_conv=True``).
    """

    PAPER = ("Hou, Zhang, Cheng, Feng, 2020, Strip Pooling: Rethinking Spatial Pooling for Scene Parsing, "
             "arXiv 2003.13328 (timm's minimal StripAttn form)")
    CHECKED_AGAINST = "timm StripAttn, with and without use_conv (float64, weights copied, outputs and gradients)"
    IDENTITY = "conv_h and conv_w zeroed, gate read as 2 * sigmoid"

    def __init__(self, channels: int, kernel_size: int = 3, bias: bool = False, use_conv: bool = True,
                 gate_layer: Type[nn.Module] = nn.Sigmoid, init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        positive_int("kernel_size", kernel_size, odd=True)
        check_bool("strip", "bias", bias)
        self.use_conv = check_bool("strip", "use_conv", use_conv)
        self.init = check_init(init)
        if init == "identity" and not use_conv:
            raise ValueError("strip: init='identity' needs use_conv=True (without the convs there is no layer to zero)")
        k, p = kernel_size, kernel_size // 2
        self.conv_h = nn.Conv2d(channels, channels, (k, 1), padding=(p, 0), groups=channels, bias=bias) if use_conv else None
        self.conv_w = nn.Conv2d(channels, channels, (1, k), padding=(0, p), groups=channels, bias=bias) if use_conv else None
        self.setup_gate(gate_layer, init, "spatial")

    def identity_layers(self) -> Tuple[Optional[torch.Tensor], ...]:
        if self.conv_h is None:
            return ()
        return self.conv_h.weight, self.conv_h.bias, self.conv_w.weight, self.conv_w.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        with autocast_off(x):
            acc = compute_dtype(x)
            s_h = mean_over(x, (3,), acc, keepdim=True)  # (B, C, H, 1)
            s_w = mean_over(x, (2,), acc, keepdim=True)  # (B, C, 1, W)
            if self.conv_h is not None:
                dtype = self.conv_h.weight.dtype
                s_h, s_w = self.conv_h(s_h.to(dtype)), self.conv_w(s_w.to(dtype))
            a = gained(self.gate(s_h + s_w), self.gain)  # (B, C, H, W)
        if self.tap.active:
            self.tap(a.float().mean(1, keepdim=True))
        return x * a.to(x.dtype)

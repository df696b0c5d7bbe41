"""Gate mechanisms beyond SE, part one: Gather-Excite, efficient local attention, FcaNet, GCT and SRM.

* ``ge``: Hu, Shen, Albanie, Sun, Vedaldi, 2018, "Gather-Excite: Exploiting Feature Context in Convolutional
  Neural Networks", arXiv 1810.12348.
* ``ela``: Xu, Wan, 2024, "ELA: Efficient Local Attention for Deep Convolutional Neural Networks",
  arXiv 2403.01123 (timm's ``EfficientLocalAttn`` form).
* ``fca``: Qin, Zhang, Wu, Li, 2021, "FcaNet: Frequency Channel Attention Networks", arXiv 2012.11879.
* ``gct``: Yang, Zhu, Wu, Yang, 2020, "Gated Channel Transformation for Visual Recognition", arXiv 1909.11519.
* ``srm``: Lee, Kim, Nam, 2019, "SRM: A Style-based Recalibration Module for Convolutional Neural Networks",
  arXiv 1903.10829.

The contract of :mod:`visattn.attention.channel` holds: pooled statistics in fp32 (or wider) and the gate
networks with autocast off in their parameters' dtype; ``init="identity"`` zeroes the layer that makes the
gate's logits and reads the gate as ``gate(z) / gate(0)``, so the block returns its input exactly at
initialisation; each class says what it zeroes in ``IDENTITY``.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Type, Union

import torch
import torch.nn.functional as F
from timm.layers import GroupNorm1
from torch import nn

from ..registry import register_attention
from .channel import (
    IdentityGate,
    autocast_off,
    check_channels,
    check_feature_map,
    compute_dtype,
    gained,
    mean_over,
    reduced_channels,
)
from .functional import BATCH_NORMS, NORMS_WITH_STATS, check_init, positive_int, zero_
from .tap import AttentionTap

__all__ = ["GatherExcite", "EfficientLocalAttention", "FrequencyChannelAttention", "GatedChannelTransform",
           "StyleRecalibration", "norm_any_batch", "fca_freq_indices", "dct_filters", "adaptive_pool_matrix",
           "spatial_mean"]


def norm_any_batch(norm: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """``norm(z)``; but a training-mode BatchNorm that sees one value per channel (batch 1 of a pooled vector,
    or of a 1x1 map) returns its shift, which is what batch normalisation's formula gives there
    (``z - mean(z) = 0``), with a zero gradient to ``z`` and the scale, and leaves its running statistics as
    they were (their unbiased variance is undefined). PyTorch's BatchNorm refuses that input instead."""
    bn = isinstance(norm, BATCH_NORMS)
    if bn and norm.training and z.numel() == z.shape[1]:
        shape = (1, -1) + (1,) * (z.dim() - 2)
        centred = z - z  # exactly zero, and on the graph
        scale = norm.weight.view(shape).to(z.dtype) if norm.weight is not None else 1.0
        return centred * scale + (norm.bias.view(shape).to(z.dtype) if norm.bias is not None else 0.0)
    if bn and norm.running_mean is not None and norm.weight is not None and z.dtype != norm.weight.dtype:
        return wide_batch_norm(norm, z)
    return norm(z)


def wide_batch_norm(norm: nn.BatchNorm2d, z: torch.Tensor) -> torch.Tensor:
    """``norm(z)`` computed in ``z``'s (wider) dtype for a BatchNorm cast to half precision: its parameters and
    running statistics are read in ``z``'s dtype and the statistics written back. A BN over a batch of pooled
    vectors divides by small differences between samples, which bf16 rounding would flip."""
    rm, rv = norm.running_mean.to(z.dtype), norm.running_var.to(z.dtype)
    momentum = norm.momentum if norm.momentum is not None else 1.0 / float(norm.num_batches_tracked + 1)
    out = F.batch_norm(z, rm, rv, norm.weight.to(z.dtype), norm.bias.to(z.dtype), norm.training, momentum, norm.eps)
    if norm.training:
        with torch.no_grad():
            norm.running_mean.copy_(rm)
            norm.running_var.copy_(rv)
            norm.num_batches_tracked.add_(1)
    return out


def spatial_mean(gate: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    """The channel mean of a (broadcastable) ``(B, C, h, w)`` gate at the map's ``size``: ``(B, 1, H, W)``,
    fp32. What a spatial tap records of a gate that varies over channels and positions."""
    g = gate.float().mean(1, keepdim=True)
    return g.expand(g.shape[0], 1, *size)


# ---- Gather-Excite ---------------------------------------------------------------------------------------


@register_attention("ge", layout="feature", kind="channel")
class GatherExcite(IdentityGate, nn.Module):
    """Gather-Excite (Hu, Shen, Albanie, Sun, Vedaldi, 2018, arXiv 1810.12348).

    Gather: average pooling over an ``extent`` (0: the whole map, the paper's "global"; else a
    ``(2 * extent - 1)`` window at stride ``extent``, padding not counted, as timm's ``GatherExcite``), or with
    ``extra_params=True`` (GE-theta) ``log2(extent)`` strided depthwise 3x3 convolutions with BN (ReLU between).
    Excite: ``use_mlp=True`` (GE-theta-plus, timm's default) runs SE's bottleneck ``C -> C * rd_ratio -> C``
    (1x1 convs with bias, ReLU) on the gathered map; the sigmoid gate is resized to the map by nearest
    interpolation and multiplies it. Defaults are timm's ``get_attn("ge")`` (extent 0, no gather parameters,
    the MLP): at these the block computes SE's function, as timm's docstring notes; ``use_mlp=False`` is the
    parameter-free GE-theta-minus. The global extent with gather parameters is the paper's depthwise conv as
    large as the map (no padding: one value per channel); it needs ``feat_size`` and runs on that map size
    only (timm's pads it and so gathers locally). Names follow timm's (``gather.conv1``, ``mlp.fc1``, ``mlp.fc2``).
    Tap: the ``(B, C)`` gate (its spatial mean for a local extent). ``init="identity"``: ``mlp.fc2`` (without
    the MLP: the last gather BN's scale and shift) starts at zero and the gate is ``2 * sigmoid``.
    """

    PAPER = ("Hu, Shen, Albanie, Sun, Vedaldi, 2018, Gather-Excite: Exploiting Feature Context in Convolutional "
             "Neural Networks, arXiv 1810.12348")
    CHECKED_AGAINST = ("timm GatherExcite (use_mlp=False, extents 0/2/4; its MLP set as timm means it, "
                       "patching its *dd bug in the test)")
    IDENTITY = "mlp.fc2 (without the MLP: the last gather BN); gate 2 * sigmoid"

    def __init__(self, channels: int, extent: int = 0, extra_params: bool = False,
                 feat_size: Optional[Union[int, Sequence[int]]] = None, use_mlp: bool = True,
                 rd_ratio: float = 1.0 / 16, rd_channels: Optional[int] = None, rd_divisor: int = 1,
                 act_layer: Type[nn.Module] = nn.ReLU, norm_layer: Optional[Type[nn.Module]] = nn.BatchNorm2d,
                 gate_layer: Type[nn.Module] = nn.Sigmoid, init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.init = check_init(init)
        if isinstance(extent, bool) or not isinstance(extent, int) or extent < 0 or extent % 2:
            raise ValueError(f"ge: extent must be 0 (global) or an even positive int, got {extent!r}")
        self.feat_size = None
        if extra_params and extent == 0:
            if feat_size is None:
                raise ValueError("ge: extra_params with the global extent (0) needs feat_size, the map's (H, W)")
            fs = (feat_size, feat_size) if isinstance(feat_size, int) else tuple(feat_size)
            self.feat_size = tuple(positive_int("feat_size", v) for v in fs)
        if init == "identity" and not use_mlp and not (extra_params and norm_layer is not None):
            raise ValueError("ge: init='identity' needs use_mlp=True or extra_params=True with a norm_layer")
        self.extent = extent
        self.gather = None
        if extra_params and extent == 0:  # GE-theta, global: a depthwise conv over the whole map
            self.gather = nn.Sequential()
            self.gather.add_module("conv1", nn.Conv2d(channels, channels, self.feat_size, groups=channels, bias=False))
            if norm_layer is not None:
                self.gather.add_module("norm1", norm_layer(channels))
        elif extra_params:
            self.gather = nn.Sequential()
            num_conv = int(math.log2(extent))
            for i in range(num_conv):
                self.gather.add_module(f"conv{i + 1}", nn.Conv2d(channels, channels, 3, stride=2, padding=1,
                                                                 groups=channels, bias=False))
                if norm_layer is not None:
                    self.gather.add_module(f"norm{i + 1}", norm_layer(channels))
                if i != num_conv - 1:
                    self.gather.add_module(f"act{i + 1}", act_layer())
        self.mlp = None
        if use_mlp:
            rd = reduced_channels(channels, rd_ratio, rd_channels, rd_divisor)
            self.mlp = nn.Sequential()
            self.mlp.add_module("fc1", nn.Conv2d(channels, rd, 1))
            self.mlp.add_module("act", act_layer())
            self.mlp.add_module("fc2", nn.Conv2d(rd, channels, 1))
        self.setup_gate(gate_layer, init, "channel")

    def identity_layers(self) -> Tuple[Optional[torch.Tensor], ...]:
        if self.mlp is not None:
            return self.mlp.fc2.weight, self.mlp.fc2.bias
        norms = [m for m in self.gather if isinstance(m, NORMS_WITH_STATS)]
        return norms[-1].weight, norms[-1].bias

    def gathered(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The gathered map ``(B, C, h, w)`` in ``dtype`` (autocast off)."""
        if self.gather is not None:
            y = x.to(dtype)
            for m in self.gather:
                y = norm_any_batch(m, y)
            return y
        if self.extent == 0:
            return mean_over(x, (2, 3), compute_dtype(x), keepdim=True).to(dtype)
        k = 2 * self.extent - 1
        return F.avg_pool2d(x.to(compute_dtype(x)), k, self.extent, k // 2, count_include_pad=False).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        H, W = x.shape[2:]
        if self.feat_size is not None and (H, W) != self.feat_size:
            raise ValueError(f"GatherExcite: built with feat_size={self.feat_size} for its global gather, got a "
                             f"{H}x{W} map")
        param = next(self.parameters(), None)
        with autocast_off(x):
            g = self.gathered(x, compute_dtype(x) if param is None else param.dtype)
            if self.mlp is not None:
                g = self.mlp(g)
            w = gained(self.gate(g), self.gain)
            if w.shape[-2:] != (1, 1):
                w = F.interpolate(w, size=(H, W))  # nearest, as timm's
        self.tap(w.flatten(1) if w.shape[-2:] == (1, 1) else w.float().mean((2, 3)))
        return x * w.to(x.dtype)


# ---- efficient local attention -------------------------------------------------------------------------------


# the authors' ELA variants: kernel size, input channels per conv group (1: depthwise), GroupNorm groups
ELA_PHI = {"T": (5, 1, 32), "B": (7, 1, 16), "S": (5, 8, 16), "L": (7, 8, 16)}


@register_attention("ela", layout="feature", kind="spatial")
class EfficientLocalAttention(IdentityGate, nn.Module):
    """Efficient local attention (Xu, Wan, 2024, arXiv 2403.01123), in timm's ``EfficientLocalAttn`` form.

    Strip pooling along each axis (``(B, C, H, 1)`` and ``(B, C, 1, W)``), a depthwise 1D conv of
    ``kernel_size`` (7, the paper's ELA-B) on each strip, a norm (timm's ``GroupNorm1``), an activation (SiLU)
    and a sigmoid: ``out = x * a_h * a_w``; ``has_skip`` adds ``x``. This is timm's block weight for weight
    (the default, so ``ela`` means what timm's ``get_attn("ela")`` does). ``phi="T"|"B"|"S"|"L"``: the
    authors' code's ELA-T/B/S/L instead: one 1D conv (kernel 5/7/5/7, depthwise for T and B, ``C // 8``
    groups for S and L) and one ``GroupNorm`` (32/16/16/16 groups) shared by both strips, no activation
    before the sigmoid; ``phi`` sets those, and the other options are the timm form's. Tap (kind
    ``"spatial"``): the channel mean of ``a_h * a_w``, ``(B, 1, H, W)``, on recording passes.
    ``init="identity"``: the norms' scale and shift (without a norm: the convs) start at zero, so SiLU gives
    0, and both gates are ``2 * sigmoid``.
    """

    PAPER = "Xu, Wan, 2024, ELA: Efficient Local Attention for Deep Convolutional Neural Networks, arXiv 2403.01123"
    CHECKED_AGAINST = "timm EfficientLocalAttn (weights copied, float64); phi: the authors' ELA written in the test"
    IDENTITY = "norm_h and norm_w scale and shift (phi: the GroupNorm's; no norm: the convs); gates 2 * sigmoid"

    def __init__(self, channels: int, kernel_size: int = 7, bias: bool = False, act_layer: Type[nn.Module] = nn.SiLU,
                 gate_layer: Type[nn.Module] = nn.Sigmoid, norm_layer: Optional[Type[nn.Module]] = GroupNorm1,
                 has_skip: bool = False, phi: Optional[str] = None, init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.init = check_init(init)
        positive_int("kernel_size", kernel_size, odd=True)
        if has_skip and init == "identity":
            raise ValueError("ela: init='identity' cannot hold with has_skip=True (x * 1 + x is 2x)")
        self.has_skip, self.phi = has_skip, phi
        if phi is not None:
            self.build_authors(channels, phi)
            self.setup_gate(gate_layer, init, "spatial")
            return
        self.conv_h = nn.Conv2d(channels, channels, (kernel_size, 1), padding=(kernel_size // 2, 0), groups=channels,
                                bias=bias)
        self.conv_w = nn.Conv2d(channels, channels, (1, kernel_size), padding=(0, kernel_size // 2), groups=channels,
                                bias=bias)
        self.norm_h = norm_layer(channels) if norm_layer is not None else nn.Identity()
        self.norm_w = norm_layer(channels) if norm_layer is not None else nn.Identity()
        self.act = act_layer()
        self.setup_gate(gate_layer, init, "spatial")

    def build_authors(self, channels: int, phi: str) -> None:
        """The authors' ELA-``phi``: one shared ``conv`` (Conv1d) and ``gn`` (GroupNorm), no activation."""
        if phi not in ELA_PHI:
            raise ValueError(f"ela: phi must be one of {', '.join(ELA_PHI)} (or None: timm's form), got {phi!r}")
        k, per_group, norm_groups = ELA_PHI[phi]
        if channels % per_group or channels % norm_groups:
            raise ValueError(f"ela: phi={phi!r} needs channels divisible by {per_group} and {norm_groups}, "
                             f"got {channels}")
        self.conv = nn.Conv1d(channels, channels, k, padding=k // 2, groups=channels // per_group, bias=False)
        self.gn = nn.GroupNorm(norm_groups, channels)
        self.act = nn.Identity()

    def identity_layers(self) -> Tuple[Optional[torch.Tensor], ...]:
        if self.phi is not None:
            return self.gn.weight, self.gn.bias
        if getattr(self.norm_h, "weight", None) is not None:
            return self.norm_h.weight, self.norm_h.bias, self.norm_w.weight, self.norm_w.bias
        return self.conv_h.weight, self.conv_h.bias, self.conv_w.weight, self.conv_w.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        acc = compute_dtype(x)
        with autocast_off(x):
            if self.phi is not None:  # the authors': strips as (B, C, L) sequences through one conv and norm
                dt = self.conv.weight.dtype
                x_h, x_w = mean_over(x, (3,), acc).to(dt), mean_over(x, (2,), acc).to(dt)
                a_h = gained(self.gate(self.gn(self.conv(x_h))), self.gain)[:, :, :, None]  # (B, C, H, 1)
                a_w = gained(self.gate(self.gn(self.conv(x_w))), self.gain)[:, :, None, :]  # (B, C, 1, W)
            else:
                dt = self.conv_h.weight.dtype
                x_h = mean_over(x, (3,), acc, keepdim=True).to(dt)  # (B, C, H, 1)
                x_w = mean_over(x, (2,), acc, keepdim=True).to(dt)  # (B, C, 1, W)
                a_h = gained(self.gate(self.act(norm_any_batch(self.norm_h, self.conv_h(x_h)))), self.gain)
                a_w = gained(self.gate(self.act(norm_any_batch(self.norm_w, self.conv_w(x_w)))), self.gain)
        if self.tap.active:
            self.tap((a_h.float() * a_w.float()).mean(1, keepdim=True))
        out = x * a_h.to(x.dtype) * a_w.to(x.dtype)
        return out + x if self.has_skip else out


# ---- FcaNet ------------------------------------------------------------------------------------------------

# the authors' frequency rankings on a 7x7 DCT grid (FcaNet's code, get_freq_indices): (u_x, v_y) pairs
_FREQS = {
    "top": ([0, 0, 6, 0, 0, 1, 1, 4, 5, 1, 3, 0, 0, 0, 3, 2, 4, 6, 3, 5, 5, 2, 6, 5, 5, 3, 3, 4, 2, 2, 6, 1],
            [0, 1, 0, 5, 2, 0, 2, 0, 0, 6, 0, 4, 6, 3, 5, 2, 6, 3, 3, 3, 5, 1, 1, 2, 4, 2, 1, 1, 3, 0, 5, 3]),
    "low": ([0, 0, 1, 1, 0, 2, 2, 1, 2, 0, 3, 4, 0, 1, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4],
            [0, 1, 0, 1, 2, 0, 1, 2, 2, 3, 0, 0, 4, 3, 1, 5, 4, 3, 2, 1, 0, 6, 5, 4, 3, 2, 1, 0, 6, 5, 4, 3]),
    "bot": ([6, 1, 3, 3, 2, 4, 1, 2, 4, 4, 5, 1, 4, 6, 2, 5, 6, 1, 6, 2, 2, 4, 3, 3, 5, 5, 6, 2, 5, 5, 3, 6],
            [6, 4, 4, 6, 6, 3, 1, 4, 4, 5, 6, 5, 2, 2, 5, 1, 4, 3, 5, 0, 3, 1, 1, 2, 4, 2, 1, 1, 5, 3, 3, 3]),
}
FREQ_METHODS = tuple(f"{k}{n}" for k in _FREQS for n in (1, 2, 4, 8, 16, 32))


def fca_freq_indices(method: str) -> Tuple[list, list]:
    """The authors' ``get_freq_indices``: the first ``n`` of the ``top``/``low``/``bot`` rankings, 7x7 grid."""
    if method not in FREQ_METHODS:
        raise ValueError(f"fca: unknown freq_sel_method {method!r}; valid: {', '.join(FREQ_METHODS)}")
    xs, ys = _FREQS[method[:3]]
    n = int(method[3:])
    return xs[:n], ys[:n]


def _dct_1d(freq: int, size: int) -> torch.Tensor:
    """The orthonormal DCT-II basis vector ``freq`` of length ``size`` (float64)."""
    pos = torch.arange(size, dtype=torch.float64)
    v = torch.cos(math.pi * freq * (pos + 0.5) / size) / math.sqrt(size)
    return v if freq == 0 else v * math.sqrt(2)


def dct_filters(channels: int, size: Tuple[int, int], method: str) -> torch.Tensor:
    """``(C, h, w)`` DCT filters (float64): frequency ``i`` of ``method`` (scaled from the 7x7 grid by
    ``h // 7``, ``w // 7`` as the authors do) for the ``i``-th of ``num_freq`` nearly equal channel parts
    (``torch.tensor_split``; the authors' equal parts where ``num_freq`` divides ``C``)."""
    h, w = size
    xs, ys = fca_freq_indices(method)
    out = torch.zeros(channels, h, w, dtype=torch.float64)
    for part, u, v in zip(torch.arange(channels).tensor_split(len(xs)), xs, ys):
        if len(part):
            out[part] = torch.outer(_dct_1d(u * (h // 7), h), _dct_1d(v * (w // 7), w))
    return out


def adaptive_pool_matrix(out_size: int, in_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(out, in)``: row ``i`` averages the inputs ``adaptive_avg_pool`` puts in output ``i``
    (``floor(i * in / out)`` to ``ceil((i + 1) * in / out)``); the identity where ``out == in``."""
    i = torch.arange(out_size, device=device)[:, None]
    j = torch.arange(in_size, device=device)[None, :]
    start = (i * in_size) // out_size
    end = ((i + 1) * in_size + out_size - 1) // out_size
    inside = (j >= start) & (j < end)
    return inside.to(dtype) / (end - start).to(dtype)


@register_attention("fca", layout="feature", kind="channel")
class FrequencyChannelAttention(IdentityGate, nn.Module):
    """FcaNet's multi-spectral channel attention (Qin, Zhang, Wu, Li, 2021, arXiv 2012.11879).

    SE with the global average pool replaced by 2D DCT components: the channels are split into
    ``num_freq`` parts (``freq_sel_method``, ``"top16"`` by default as the authors' code; nearly equal parts
    where ``num_freq`` does not divide ``C``) and part ``i`` is pooled with the DCT basis of frequency ``i``;
    then ``C -> C // reduction -> C`` linear layers without bias (ReLU; at least 1 hidden unit) and a
    sigmoid. **Any map size**: the authors' code average-pools a map of another size to the DCT filter's
    (``dct_size``, 7x7 by default: the grid the frequency rankings are defined on; their ImageNet ResNets use
    56/28/14/7 by stage) with ``adaptive_avg_pool2d`` and then applies the filter. Both steps are linear, so
    here they are one filter for the actual map, ``P_h^T filter P_w`` (``P`` the adaptive pool's averaging
    matrix): the same function, and any H x W, 1x1 included, exports to ONNX. Tap: the ``(B, C)`` gate.
    ``init="identity"``: ``fc2`` starts at zero and the gate is ``2 * sigmoid``.
    """

    PAPER = "Qin, Zhang, Wu, Li, 2021, FcaNet: Frequency Channel Attention Networks, arXiv 2012.11879"
    CHECKED_AGAINST = ("the authors' MultiSpectralAttentionLayer (adaptive_avg_pool2d to the filter, DCT sum, fc) "
                       "written in the test, float64")
    IDENTITY = "fc2; gate 2 * sigmoid"

    def __init__(self, channels: int, reduction: int = 16, freq_sel_method: str = "top16",
                 dct_size: Union[int, Sequence[int]] = 7, act_layer: Type[nn.Module] = nn.ReLU,
                 gate_layer: Type[nn.Module] = nn.Sigmoid, init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.init = check_init(init)
        positive_int("reduction", reduction)
        size = (dct_size, dct_size) if isinstance(dct_size, int) else tuple(dct_size)
        if len(size) != 2:
            raise ValueError(f"fca: dct_size must be an int or (h, w), got {dct_size!r}")
        self.dct_size = (positive_int("dct_size", size[0]), positive_int("dct_size", size[1]))
        self.freq_sel_method = freq_sel_method
        self.register_buffer("dct_weight", dct_filters(channels, self.dct_size, freq_sel_method).float())
        hidden = max(1, channels // reduction)
        self.fc1 = nn.Linear(channels, hidden, bias=False)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden, channels, bias=False)
        self.setup_gate(gate_layer, init, "channel")

    def identity_layers(self) -> Tuple[Optional[torch.Tensor], ...]:
        return (self.fc2.weight,)

    def map_filter(self, H: int, W: int, dtype: torch.dtype) -> torch.Tensor:
        """``(C, H, W)``: the DCT filter seen through the adaptive pool to ``dct_size`` (the filter itself when
        the map has that size)."""
        f = self.dct_weight.to(dtype)
        if (H, W) == self.dct_size:
            return f
        ph = adaptive_pool_matrix(self.dct_size[0], H, dtype, f.device)
        pw = adaptive_pool_matrix(self.dct_size[1], W, dtype, f.device)
        return torch.einsum("cij,ih,jw->chw", f, ph, pw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        acc = compute_dtype(x)
        with autocast_off(x):
            filt = self.map_filter(x.shape[2], x.shape[3], acc)
            s = (x.to(acc) * filt).sum((2, 3)).to(self.fc1.weight.dtype)  # (B, C) spectral pooling
            w = gained(self.gate(self.fc2(self.act(self.fc1(s)))), self.gain)
        self.tap(w)
        return x * w.to(x.dtype)[:, :, None, None]


# ---- gated channel transformation ------------------------------------------------------------------------------


@register_attention("gct", layout="feature", kind="channel")
class GatedChannelTransform(nn.Module):
    """Gated channel transformation (Yang, Zhu, Wu, Yang, 2020, arXiv 1909.11519).

    Global context embedding ``s_c = alpha_c * sqrt(sum_hw x^2 + eps)`` (Eq. 1, ``mode="l2"``), channel
    normalisation ``s_c * gamma_c / sqrt(mean_c s^2 + eps)`` (Eq. 2 as the authors' code writes it: the
    mean, so ``sqrt(C)`` is folded in), gating ``x * (1 + tanh(. + beta))`` (Eq. 3). ``mode="l1"``: the
    code's l1 variant (``sum |x|``, or ``sum x`` with ``after_relu``). Parameters ``alpha`` (ones), ``gamma``
    and ``beta`` (zeros), as the paper: the block starts as the identity in either ``init`` (``gamma`` still
    gets a gradient). Statistics in fp32. Tap: the ``(B, C)`` gate ``1 + tanh``, a 0-2 multiplier (scale
    ``"gain"``).
    """

    PAPER = "Yang, Zhu, Wu, Yang, 2020, Gated Channel Transformation for Visual Recognition, arXiv 1909.11519"
    CHECKED_AGAINST = "the authors' GCT module (l2 and l1 modes) written in the test from Eqs. 1-3, float64"
    IDENTITY = "gamma and beta (zero in the paper's init too); gate 1 + tanh"

    def __init__(self, channels: int, eps: float = 1e-5, mode: str = "l2", after_relu: bool = False,
                 init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.init = check_init(init)
        if mode not in ("l2", "l1"):
            raise ValueError(f"gct: mode must be 'l2' or 'l1', got {mode!r}")
        if not (isinstance(eps, (int, float)) and eps > 0):
            raise ValueError(f"gct: eps must be a number > 0, got {eps!r}")
        self.eps, self.mode, self.after_relu = float(eps), mode, after_relu
        self.alpha = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.gamma = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.tap = AttentionTap("channel", scale="gain")  # 1 + tanh: a 0-2 multiplier

    def zero_init_last(self) -> None:
        """``gamma`` and ``beta`` back to zero (the paper's init, the identity); timm's hook."""
        zero_(self.gamma, self.beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        acc = compute_dtype(x)
        with autocast_off(x):
            alpha, gamma, beta = (p.to(acc) for p in (self.alpha, self.gamma, self.beta))
            if self.mode == "l2":
                emb = ((x.to(acc).square().sum((2, 3), keepdim=True) + self.eps).sqrt()) * alpha
                norm = gamma / (emb.square().mean(1, keepdim=True) + self.eps).sqrt()
            else:
                ax = x.to(acc) if self.after_relu else x.to(acc).abs()
                emb = ax.sum((2, 3), keepdim=True) * alpha
                norm = gamma / (emb.abs().mean(1, keepdim=True) + self.eps)
            gate = 1.0 + torch.tanh(emb * norm + beta)  # (B, C, 1, 1)
        self.tap(gate.flatten(1))
        return x * gate.to(x.dtype)


# ---- SRM ---------------------------------------------------------------------------------------------------------


@register_attention("srm", layout="feature", kind="channel")
class StyleRecalibration(IdentityGate, nn.Module):
    """Style-based recalibration module (Lee, Kim, Nam, 2019, arXiv 1903.10829).

    Style pooling: each channel's mean and standard deviation ``sqrt(var + eps)`` (unbiased variance as the
    authors' code, ``eps`` 1e-5; a 1x1 map's one value has variance 0 here, where the code gives NaN);
    style integration: a channel-wise fully connected layer ``z_c = cfc_c . [mu_c, sigma_c]`` (``cfc``
    ``(C, 2)``, zero-initialised as in the code), BatchNorm, sigmoid. Statistics in fp32. In training with
    batch 1 the BN sees one value per channel and gives its shift (:func:`norm_any_batch`). Tap: the
    ``(B, C)`` gate. ``init="identity"``: ``cfc`` (zero already) and the BN's shift start at zero, and the gate
    is ``2 * sigmoid``; ``cfc`` still learns through the BN's normalisation in training.
    """

    PAPER = "Lee, Kim, Nam, 2019, SRM: A Style-based Recalibration Module for Convolutional Neural Networks, " \
            "arXiv 1903.10829"
    CHECKED_AGAINST = "the authors' SRMLayer (style pooling, CFC, BN, sigmoid) written in the test, float64"
    IDENTITY = "cfc and the BN shift; gate 2 * sigmoid"

    def __init__(self, channels: int, eps: float = 1e-5, gate_layer: Type[nn.Module] = nn.Sigmoid,
                 norm_layer: Optional[Type[nn.Module]] = nn.BatchNorm2d, init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.init = check_init(init)
        self.eps = float(eps)
        self.cfc = nn.Parameter(torch.zeros(channels, 2))
        self.bn = norm_layer(channels) if norm_layer is not None else nn.Identity()
        self.setup_gate(gate_layer, init, "channel")

    def identity_layers(self) -> Tuple[Optional[torch.Tensor], ...]:
        return self.cfc, getattr(self.bn, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        acc = compute_dtype(x)
        n = x.shape[2] * x.shape[3]
        with autocast_off(x):
            mu = mean_over(x, (2, 3), acc, keepdim=True)  # (B, C, 1, 1)
            var = (x.to(acc) - mu).square().sum((2, 3), keepdim=True) / max(n - 1, 1)
            t = torch.cat([mu, (var + self.eps).sqrt()], dim=3)  # (B, C, 1, 2)
            z = (t * self.cfc.to(acc)[None, :, None, :]).sum(3, keepdim=True)  # (B, C, 1, 1), fp32 for the BN
            w = gained(self.gate(norm_any_batch(self.bn, z)), self.gain).to(self.cfc.dtype)
        self.tap(w.flatten(1))
        return x * w.to(x.dtype)

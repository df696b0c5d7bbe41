"""Channel attention: squeeze-and-excitation, efficient channel attention and global context.

* ``se``: Hu, Shen, Sun, 2018, "Squeeze-and-Excitation Networks", arXiv 1709.01507; ``effective=True``: the
  effective SE of Lee, Park, 2020, "CenterMask: Real-Time Anchor-Free Instance Segmentation", arXiv 1911.06667.
* ``eca``: Wang, Wu, Zhu, Li, Zuo, Hu, 2020, "ECA-Net: Efficient Channel Attention for Deep Convolutional
  Neural Networks", arXiv 1910.03151; with timm's two variants of it as options (``padding="circular"``,
  ``use_mlp=True``).
* ``gc``: Cao, Xu, Lin, Wei, Hu, 2019, "GCNet: Non-local Networks Meet Squeeze-Excitation Networks and
  Beyond", arXiv 1904.11492.

**Initialisation** (``init``, the same rule for every feature-map block): ``"default"`` is the paper's block
(and timm's, weight for weight); ``"identity"`` zero-initialises the layer that makes the block's last logits
(a gate's) or its residual output, and reads a gate as ``gain * gate(z)`` with ``gain = 1 / gate(0)`` (2 for
a sigmoid), so the block returns its input exactly at initialisation and the zeroed layer still gets a
gradient. Its gates then span 0-2, 1 meaning "unchanged", and its taps say so (scale ``"gain"``). Use it to
put a block into a network trained without it.

Plain differentiable PyTorch (compile with ``fullgraph=True``, export, ONNX, trace, double backward,
``torch.func``); CBAM's pooling (:func:`mean_max`) has its own backward, written in differentiable ops.
Pooled statistics are taken in fp32 (or wider) and the small gate networks run with autocast off in their
parameters' dtype, so fp16 autocast cannot overflow inside a gate.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Optional, Tuple, Type

import torch
from timm.layers import make_divisible
from torch import nn

from ..registry import register_attention
from .functional import BATCH_NORMS, check_init, gate_gain, positive_int, zero_
from .tap import AttentionTap

__all__ = ["SqueezeExcite", "EfficientChannelAttention", "GlobalContext", "eca_kernel_size", "check_feature_map",
           "check_norm_batch", "GC_MIN_HIDDEN", "mean_max", "gained", "IdentityGate", "BottleneckGate", "check_bool",
           "check_choice", "HardSigmoid"]


def check_channels(channels: int) -> int:
    return positive_int("channels", channels)


def check_feature_map(block: nn.Module, x: torch.Tensor, channels: Optional[int] = None) -> None:
    """One-line ``ValueError`` naming ``block`` unless ``x`` is ``(B, channels, H, W)`` (any C if ``None``)."""
    if x.dim() != 4 or (channels is not None and x.shape[1] != channels):
        want = f"(B, {'C' if channels is None else channels}, H, W)"
        raise ValueError(f"{type(block).__name__} expects a {want} feature map, got shape {tuple(x.shape)}")


def check_norm_batch(block: nn.Module, norm: nn.Module, values_per_channel: int, x: torch.Tensor) -> None:
    """A training-mode BatchNorm needs more than one value per channel: say so in one line, naming the
    block, instead of BatchNorm's own error from deep inside the block."""
    if values_per_channel == 1 and norm.training and isinstance(norm, BATCH_NORMS):
        raise ValueError(
            f"{type(block).__name__}: its BatchNorm needs more than one value per channel in training mode, but "
            f"input {tuple(x.shape)} (batch 1, 1x1 map) gives one; use a batch > 1, a larger map or eval mode"
        )


def reduced_channels(channels: int, rd_ratio: float, rd_channels: Optional[int], rd_divisor: int) -> int:
    """Bottleneck width: ``rd_channels`` if given, else ``channels * rd_ratio`` rounded to ``rd_divisor``."""
    if rd_channels is not None:
        positive_int("rd_channels", rd_channels)
        return rd_channels
    if not rd_ratio > 0:
        raise ValueError(f"rd_ratio must be > 0, got {rd_ratio!r}")
    positive_int("rd_divisor", rd_divisor)
    # round to the nearest multiple of rd_divisor, at least rd_divisor (timm's rule with round_limit=0)
    return make_divisible(channels * rd_ratio, rd_divisor, round_limit=0.0)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Pooled statistics and gates are fp32, or the input's dtype if that is wider (fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


def is_channels_last(x: torch.Tensor) -> bool:
    """Whether the channels of the ``(B, C, H, W)`` map ``x`` are innermost in memory (channels-last), with more
    than one channel and one position (else the layouts coincide). Read from the strides, which
    ``torch.func.vmap`` answers (it refuses ``is_contiguous(memory_format=...)``)."""
    return x.stride(1) == 1 and x.shape[1] > 1 and x.shape[2] * x.shape[3] > 1


def mean_over(x: torch.Tensor, dims: Tuple[int, ...], dtype: torch.dtype, keepdim: bool = False) -> torch.Tensor:
    """``x.mean(dims, dtype=dtype)`` written as a sum divided by the count (the same arithmetic as ``mean``):
    a sum's backward is a broadcast view of the small gradient, where a mean's writes a full-size tensor, and in
    the contiguous layout even for a channels-last ``x`` (whose gradient then meets it in a mixed-layout add).
    Pooling this way keeps a block's backward in the input's layout and saves a pass over the map."""
    return sum_in(x, dims, dtype, keepdim=keepdim) / pooled_count(x, dims)


def sum_in(x: torch.Tensor, dims: Tuple[int, ...], dtype: torch.dtype, keepdim: bool = False) -> torch.Tensor:
    """``x.sum(dims, dtype=dtype)``, fast for a bf16 ``x`` on the CPU. There, ``sum(dtype=torch.float32)`` first
    copies the whole map to fp32 (20-60x slower than the sum itself, measured by ``bench/bf16_profile.py``), while
    bf16's own sum accumulates in fp32 and rounds only the result: so a bf16 map is summed in bf16 and the small
    result widened, which differs from the fp32 sum by that one rounding (2^-9 relative, bf16's own precision).
    fp16 keeps the fp32 sum (its range would overflow), as do CUDA tensors (their reduction reads bf16 in place).
    A bf16 channels-last map summed along one spatial axis goes through :func:`axis_sum`."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        total = axis_sum(x, dims[0], keepdim) if len(dims) == 1 else x.sum(dims, keepdim=keepdim)
        return total if dtype == x.dtype else total.to(dtype)
    return x.sum(dims, keepdim=keepdim, dtype=dtype)


class _AxisSum(torch.autograd.Function):
    """:func:`axis_sum`'s sum along H (``dim`` 2) or W (3) of a channels-last ``(B, C, H, W)`` map, as a batched
    product with a row of ones over the map as it lies in memory, ``(B, H, W, C)``: oneDNN accumulates in fp32 and
    rounds once, as ``sum`` does, and reads the map in one vectorised pass, where the CPU's ``sum`` along a middle
    axis of a bf16 map runs 5-8x slower (512 x 64 x 15 x 15: 14 ms along W, 2 ms here). Backward: the gradient
    broadcast back, a view (``sum``'s own backward); differentiable, so double backward holds, and
    ``generate_vmap_rule`` serves ``torch.func``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, dim: int, keepdim: bool) -> torch.Tensor:
        B, C, H, W = x.shape
        tokens = x.permute(0, 2, 3, 1)  # (B, H, W, C), contiguous for a channels-last map
        if dim == 3:  # (B * H, 1, W) @ (B * H, W, C) -> (B, C, H)
            total = (x.new_ones(1, W) @ tokens.reshape(B * H, W, C)).view(B, H, C).transpose(1, 2)
        else:  # (B, 1, H) @ (B, H, W * C) -> (B, C, W)
            total = (x.new_ones(1, H) @ tokens.reshape(B, H, W * C)).view(B, W, C).transpose(1, 2)
        return total.unsqueeze(dim) if keepdim else total

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, ctx.dim, ctx.keepdim = inputs
        ctx.shape = x.shape

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return (g if ctx.keepdim else g.unsqueeze(ctx.dim)).expand(ctx.shape), None, None


def axis_sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """``x.sum(dim, keepdim=keepdim)``; for a bf16 channels-last ``(B, C, H, W)`` map on the CPU summed along H or W,
    :class:`_AxisSum` (the same fp32-accumulated sum rounded once, several times faster)."""
    dim = dim % x.dim()
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 4 and dim in (2, 3) and is_channels_last(x):
        return _AxisSum.apply(x, dim, keepdim)
    return x.sum(dim, keepdim=keepdim)


def pooled_count(x: torch.Tensor, dims: Tuple[int, ...]) -> int:
    """How many values of ``x`` each entry pooled over ``dims`` summarises."""
    count = 1
    for d in dims:
        count *= x.shape[d]
    return count


class _MeanMax(torch.autograd.Function):
    """:func:`mean_max` with the backward in fewer passes over the map. Autograd's ``amax`` backward counts the
    tied maxima through an int64 copy of the whole map and multiplies by a bool mask: on the CPU it took two
    thirds of CBAM's forward + backward. Here the tie mask is made once in the map's dtype and layout, the
    ties are counted on it, and the mean's and the max's gradients are written in one ``addcmul``. Same
    gradient as autograd's (the max's split evenly among ties, as ``amax`` does); written in differentiable
    ops, so double backward holds, and ``generate_vmap_rule`` serves ``torch.func``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, dims: Tuple[int, ...], dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        return mean_over(x, dims, dtype), x.amax(dims).to(dtype)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, ctx.dims, _ = inputs
        ctx.save_for_backward(x, output[1])

    @staticmethod
    def backward(ctx, g_mean: Optional[torch.Tensor], g_top: Optional[torch.Tensor]):
        x, top = ctx.saved_tensors
        dims = ctx.dims
        count = pooled_count(x, dims)

        def keep(t: torch.Tensor) -> torch.Tensor:  # the pooled dims back, as size 1 (dims ascending)
            for d in dims:
                t = t.unsqueeze(d)
            return t

        mean_part = None if g_mean is None else keep(g_mean / count).to(x.dtype)
        if g_top is None:
            return mean_part.expand_as(x), None, None
        mask = tie_mask(x, keep(top.to(x.dtype)))  # 1 at every maximum, 0 elsewhere: x's dtype and layout
        ties = sum_in(mask, dims, compute_dtype(x), keepdim=True)
        share = (keep(g_top.to(x.dtype)) / ties).to(x.dtype)  # the max's gradient split evenly among its ties
        if mean_part is None:
            return mask * share, None, None
        if 1 in dims:
            # pooled over the channels (the spatial gate): ``share`` is broadcast along the innermost dim of a
            # channels-last map, where the CPU's three-operand addcmul runs unvectorised (several times a multiply);
            # a multiply then an add round the same way, ``mask * share`` being exact (0 or ``share``)
            return mask * share + mean_part, None, None
        # one fused multiply-add, in the mask's (x's) layout; its rounding is the one earlier checkpoints trained with
        return torch.addcmul(mean_part, mask, share), None, None


def tie_mask(x: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``(x == top).to(x.dtype)``, 1 where ``x`` equals the broadcast ``top`` and 0 elsewhere, in ``x``'s dtype and
    layout, written by an in-place ``eq_`` on a copy of ``x``: on the CPU a comparison that writes bool, and the
    bool's cast to bf16, each run unvectorised (about 7 ms apiece on a 512 x 64 x 15 x 15 bf16 map, against 1 ms
    for the copy and 1 ms for ``eq_``). Not differentiable (a constant of the backward), as the comparison."""
    return x.detach().clone().eq_(top.detach())


def mean_max(x: torch.Tensor, dims: Tuple[int, ...], dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(mean_over(x, dims, dtype), x.amax(dims).to(dtype))``, the pair CBAM's gates pool, with the dims
    dropped; its backward (:class:`_MeanMax`) takes fewer passes over the map than autograd's."""
    return _MeanMax.apply(x, tuple(sorted(dims)), dtype)


def autocast_off(x: torch.Tensor):
    """The gate networks run in their parameters' dtype: they are tiny, and fp32 gates cannot overflow.

    The autocast region is entered only while autocast is on: an empty one still costs time in eager mode
    and splits the graph ``torch.compile`` hands to Inductor."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.autocast(x.device.type, enabled=False)
    return contextlib.nullcontext()


def gained(gate: torch.Tensor, gain: float) -> torch.Tensor:
    """``gate * gain`` (no op for the paper's gain of 1; exact for the identity gain of 2)."""
    return gate if gain == 1.0 else gate * gain


class IdentityGate:
    """What every gate block shares (SE, ECA, CBAM's two gates, coordinate attention): the gate module, its
    gain (1, or ``1 / gate(0)`` for ``init="identity"``), its tap on the matching value scale, and the zeroing
    of :meth:`identity_layers` that makes the identity form (module docstring)."""

    init: str

    def setup_gate(self, gate_layer: Type[nn.Module], init: str, kind: str) -> None:
        self.gate = gate_layer()
        self.gain = gate_gain(self.gate, init)
        self.tap = AttentionTap(kind, scale="gain" if init == "identity" else None)  # 0-2, or the kind's 0-1
        self.zero_init_last()

    def identity_layers(self) -> Tuple[Optional[torch.Tensor], ...]:
        """The parameters ``init="identity"`` starts at zero: those that make the gate's logits."""
        raise NotImplementedError

    def zero_init_last(self) -> None:
        """With ``init="identity"``, zero :meth:`identity_layers`. Also timm's hook: a timm ResNet calls it
        after its own weight init, so ``attn_layer(..., init="identity")`` stays the identity."""
        if self.init == "identity":
            zero_(*self.identity_layers())


class BottleneckGate(IdentityGate, nn.Module):
    """What SE and CBAM's channel gate share: the bottleneck MLP ``fc1 -> act -> fc2`` of 1x1 convs
    (``C -> C * rd_ratio -> C``) and the gate; ``init="identity"`` zeroes ``fc2``."""

    def __init__(self, channels: int, rd_ratio: float, rd_channels: Optional[int], rd_divisor: int,
                 act_layer: Type[nn.Module], gate_layer: Type[nn.Module], bias: bool, init: str):
        super().__init__()
        self.channels = check_channels(channels)
        rd = reduced_channels(channels, rd_ratio, rd_channels, rd_divisor)
        self.init = check_init(init)
        self.fc1 = nn.Conv2d(channels, rd, kernel_size=1, bias=bias)
        self.act = act_layer()
        self.fc2 = nn.Conv2d(rd, channels, kernel_size=1, bias=bias)
        self.setup_gate(gate_layer, init, "channel")

    def identity_layers(self) -> Tuple[Optional[torch.Tensor], ...]:
        return self.fc2.weight, self.fc2.bias


def check_bool(block: str, name: str, value: object) -> bool:
    """``value`` if it is a bool, else a one-line ValueError naming ``block``'s option."""
    if not isinstance(value, bool):
        raise ValueError(f"{block}: {name} must be True or False, got {value!r}")
    return value


def check_choice(block: str, name: str, value: object, choices: Tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else a one-line ValueError naming ``block``'s option."""
    if value not in choices:
        raise ValueError(f"{block}: unknown {name} {value!r}; valid: {', '.join(choices)}")
    return str(value)


class HardSigmoid(nn.Module):
    """``relu6(z + 3) / 6`` (``nn.Hardsigmoid``'s values) written as a clamp, whose backward has a derivative:
    ``nn.Hardsigmoid``'s has none, so a block gated by it would refuse double backward."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return (z + 3.0).clamp(0.0, 6.0) / 6.0


@register_attention("se", layout="feature", kind="channel")
class SqueezeExcite(IdentityGate, nn.Module):
    """Squeeze-and-excitation (Hu, Shen, Sun, 2018, arXiv 1709.01507).

    Global average pool, bottleneck MLP ``C -> C * rd_ratio -> C`` (1x1 convs, ReLU; the paper's ratio is
    1/16), sigmoid gate per channel; names match timm's ``SEModule``. Tap: the ``(B, C)`` gate.
    ``init="identity"``: ``fc2`` starts at zero and the gate is ``2 * sigmoid``.

    ``effective=True``: the effective SE (eSE) of CenterMask (Lee, Park, 2020, arXiv 1911.06667, section 3.2):
    one 1x1 conv ``fc`` (``C -> C``, bias) in place of the bottleneck, so no channel information is lost to
    the reduction, and a hard sigmoid gate (``relu6(z + 3) / 6``) unless ``gate_layer`` is given; equal to
    timm's ``EffectiveSEModule`` ('ese'). It has no bottleneck, so ``rd_channels`` is refused with it (the
    ``rd_*`` and ``act_layer`` options are unused). ``init="identity"``: ``fc`` starts at zero and the gate is
    ``2 * hard_sigmoid``.
    """

    PAPER = "Hu, Shen, Sun, 2018, Squeeze-and-Excitation Networks, arXiv 1709.01507"
    CHECKED_AGAINST = ("timm SEModule; effective=True: timm EffectiveSEModule (float64, weights copied, "
                       "outputs and input/parameter gradients)")
    IDENTITY = "fc2 (fc with effective=True) zeroed, gate read as 2 * sigmoid (2 * hard sigmoid)"

    def __init__(self, channels: int, rd_ratio: float = 1.0 / 16, rd_channels: Optional[int] = None,
                 rd_divisor: int = 1, act_layer: Type[nn.Module] = nn.ReLU,
                 gate_layer: Optional[Type[nn.Module]] = None, bias: bool = True, effective: bool = False,
                 init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.init = check_init(init)
        self.effective = check_bool("se", "effective", effective)
        if effective:
            if rd_channels is not None:
                raise ValueError("se: effective=True has no bottleneck (one C -> C conv), so rd_channels does not apply")
            self.fc = nn.Conv2d(channels, channels, kernel_size=1, bias=bias)
        else:
            rd = reduced_channels(channels, rd_ratio, rd_channels, rd_divisor)
            self.fc1 = nn.Conv2d(channels, rd, kernel_size=1, bias=bias)
            self.act = act_layer()
            self.fc2 = nn.Conv2d(rd, channels, kernel_size=1, bias=bias)
        if gate_layer is None:
            gate_layer = HardSigmoid if effective else nn.Sigmoid
        self.setup_gate(gate_layer, init, "channel")

    def identity_layers(self) -> Tuple[Optional[torch.Tensor], ...]:
        last = self.fc if self.effective else self.fc2
        return last.weight, last.bias

    def excite(self, s: torch.Tensor) -> torch.Tensor:
        """The gate's logits from the ``(B, C, 1, 1)`` squeezed vector."""
        if self.effective:
            return self.fc(s)
        return self.fc2(self.act(self.fc1(s)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        weight = (self.fc if self.effective else self.fc1).weight
        with autocast_off(x):
            s = mean_over(x, (2, 3), compute_dtype(x), keepdim=True).to(weight.dtype)  # squeeze
            w = gained(self.gate(self.excite(s)), self.gain)  # (B, C, 1, 1) excitation
        self.tap(w.flatten(1))
        return x * w.to(x.dtype)


def eca_kernel_size(channels: int, gamma: float = 2.0, b: float = 1.0) -> int:
    """ECA's adaptive kernel size ``|log2(C) / gamma + b / gamma|_odd`` (the paper's code: truncate, then
    bump even values up by one), at least 3 as in timm's ``EcaModule``: 3 for C <= 63 (the paper's rule alone
    would give 1, a plain per-channel scale, for C < 8), 5 for C=128, 256 and 512. ``gamma`` must be a number
    > 0 and ``b`` a finite one whose kernel is at most ``2 * channels + 1`` wide (a wider one sees only padding);
    else a one-line ValueError naming them and the kernel size they give."""
    for name, v in (("gamma", gamma), ("b", b)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"eca: {name} must be a finite number, got {v!r}")
    if not gamma > 0:
        raise ValueError(f"eca: gamma must be > 0 (the kernel size is (log2(channels) + b) / gamma), got {gamma!r}")
    size, widest = abs((math.log2(channels) + b) / gamma), 2 * channels + 1
    if size > widest:  # (inf for a gamma so small the division overflows)
        raise ValueError(f"eca: gamma={gamma:g} with b={b:g} gives a kernel size of {size:.3g} for {channels} channels, "
                         f"wider than 2 * channels + 1 = {widest} (past that it sees only padding); use a larger gamma")
    t = int(size)
    return max(t if t % 2 else t + 1, 3)


ECA_PADDINGS = ("zeros", "circular")


@register_attention("eca", layout="feature", kind="channel")
class EfficientChannelAttention(IdentityGate, nn.Module):
    """Efficient channel attention (Wang et al., 2020, arXiv 1910.03151).

    Global average pool, a 1D convolution across neighbouring channels with a kernel size from ``log2(C)``
    (:func:`eca_kernel_size`) unless ``kernel_size`` is given, then a sigmoid gate; names and kernel sizes
    match timm's ``EcaModule``. Works for any channel count: ``channels`` only picks the kernel size. Tap: the
    ``(B, C)`` gate. ``init="identity"``: the 1D conv (``conv2`` with ``use_mlp``) starts at zero and the gate
    is ``2 * sigmoid``.

    timm's two variants of the same mechanism, as options (neither is in the paper):

    * ``padding="circular"``: the channel sequence wraps around (the first and last channels are neighbours)
      instead of being zero-padded; timm's ``CecaModule`` ('ceca'). The input needs at least
      ``(kernel_size - 1) / 2`` channels.
    * ``use_mlp=True``: the 1D conv becomes a tiny MLP applied along the channel sequence, a pointwise conv
      ``1 -> rd`` (bias), ``act_layer``, then the ``kernel_size`` conv ``rd -> 1`` (bias), with ``rd`` =
      ``rd_channels`` or ``channels * rd_ratio`` rounded to ``rd_divisor`` (timm's ``make_divisible``); timm's
      ``EcaModule(use_mlp=True)`` ('ecam'). The ``rd_*`` and ``act_layer`` options apply only with it.
    """

    PAPER = ("Wang, Wu, Zhu, Li, Zuo, Hu, 2020, ECA-Net: Efficient Channel Attention for Deep Convolutional "
             "Neural Networks, arXiv 1910.03151")
    CHECKED_AGAINST = ("timm EcaModule; padding='circular': timm CecaModule; use_mlp=True: timm "
                       "EcaModule(use_mlp=True) (float64, weights copied, outputs and gradients)")
    IDENTITY = "the 1D conv (conv2 with use_mlp) zeroed, gate read as 2 * sigmoid"

    def __init__(self, channels: int, kernel_size: Optional[int] = None, gamma: float = 2.0, b: float = 1.0,
                 gate_layer: Type[nn.Module] = nn.Sigmoid, padding: str = "zeros", use_mlp: bool = False,
                 rd_ratio: float = 1.0 / 8, rd_channels: Optional[int] = None, rd_divisor: int = 8,
                 act_layer: Type[nn.Module] = nn.ReLU, init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        if kernel_size is None:
            kernel_size = eca_kernel_size(channels, gamma, b)
        positive_int("kernel_size", kernel_size, odd=True)
        self.kernel_size = kernel_size
        self.init = check_init(init)
        self.padding = check_choice("eca", "padding", padding, ECA_PADDINGS)
        self.use_mlp = check_bool("eca", "use_mlp", use_mlp)
        self.pad = (kernel_size - 1) // 2
        conv_pad = 0 if padding == "circular" else self.pad  # circular: padded by hand in forward
        if use_mlp:
            if rd_channels is None:
                if not rd_ratio > 0:
                    raise ValueError(f"eca: rd_ratio must be > 0, got {rd_ratio!r}")
                rd_channels = make_divisible(channels * rd_ratio, positive_int("rd_divisor", rd_divisor))
            positive_int("rd_channels", rd_channels)
            self.conv = nn.Conv1d(1, rd_channels, kernel_size=1, bias=True)
            self.act = act_layer()
            self.conv2 = nn.Conv1d(rd_channels, 1, kernel_size=kernel_size, padding=conv_pad, bias=True)
        else:
            self.conv = nn.Conv1d(1, 1, kernel_size=kernel_size, padding=conv_pad, bias=False)
        self.setup_gate(gate_layer, init, "channel")

    def identity_layers(self) -> Tuple[Optional[torch.Tensor], ...]:
        return (self.conv2.weight, self.conv2.bias) if self.use_mlp else (self.conv.weight,)

    def wrap(self, s: torch.Tensor) -> torch.Tensor:
        """``(B, k, C)`` -> ``(B, k, C + 2 * pad)``: circular padding along the channels (concatenated slices,
        which every exporter takes), or ``s`` as it is for zero padding (the conv pads)."""
        if self.padding != "circular" or self.pad == 0:
            return s
        if s.shape[-1] < self.pad:
            raise ValueError(f"eca: padding='circular' with kernel_size={self.kernel_size} needs at least {self.pad} "
                             f"channels, got {s.shape[-1]}")
        return torch.cat([s[..., -self.pad:], s, s[..., : self.pad]], dim=-1)

    def logits(self, s: torch.Tensor) -> torch.Tensor:
        """``(B, C)`` pooled channels -> ``(B, C)`` gate logits: the 1D conv (or MLP) along the channels."""
        y = s[:, None, :]
        if self.use_mlp:
            return self.conv2(self.wrap(self.act(self.conv(y))))[:, 0]
        return self.conv(self.wrap(y))[:, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x)  # any channel count
        with autocast_off(x):
            s = mean_over(x, (2, 3), compute_dtype(x)).to(self.conv.weight.dtype)  # (B, C)
            w = gained(self.gate(self.logits(s)), self.gain)  # channels as a 1D sequence: (B, C)
        self.tap(w)
        return x * w.to(x.dtype)[:, :, None, None]


def context_pool(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """GC's attention pooling: the softmax over the H*W positions of the scores ``weight . x[b, :, i] + bias``
    (``weight``, ``bias``: the 1x1 conv ``C -> 1``), taken in fp32, ``(B, 1, HW)``, and the context it pools,
    ``(B, C)``. Both matmuls run on ``x`` as it lies in memory, ``(B, HW, C)`` tokens for a channels-last map
    and ``(B, C, HW)`` otherwise, so their gradients come back in ``x``'s own layout (the other orientation
    hands a channels-last map a contiguous gradient, and a slow mixed-layout sum follows)."""
    B, C, H, W = x.shape
    w = weight.to(x.dtype).reshape(1, C)

    def softmax(logits: torch.Tensor) -> torch.Tensor:  # (B, 1, HW), fp32 (or fp64 for fp64 input)
        acc = compute_dtype(x)
        return (logits.to(acc) + bias.to(acc)).softmax(dim=-1)

    if is_channels_last(x):
        tokens = x.permute(0, 2, 3, 1).reshape(B, H * W, C)  # a view
        p = softmax((tokens @ w.t()).transpose(1, 2))
        return p, (p.to(x.dtype) @ tokens).flatten(1)
    feats = x.flatten(2)  # (B, C, HW), a view
    p = softmax(w @ feats)
    return p, (feats @ p.to(x.dtype).transpose(1, 2)).flatten(1)


FUSIONS = ("add", "scale", "both")

GC_MIN_HIDDEN = 4  # LayerNorm over 1 feature outputs only its bias, over 2 only +-1: the path would be dead


@register_attention("gc", layout="feature", kind="spatial")
class GlobalContext(nn.Module):
    """Global context block (Cao et al., 2019, arXiv 1904.11492).

    A 1x1 conv (``conv_attn``) scores every position, an fp32 softmax over the H*W positions pools the
    features into one ``(B, C)`` context vector, and a bottleneck ``C -> hidden -> C`` (LayerNorm, ReLU;
    ``hidden = C * rd_ratio``, at least ``GC_MIN_HIDDEN`` = 4, since a LayerNorm over one feature outputs only
    its bias) transforms it. Fusion: broadcast add (the paper's default), a sigmoid scale, or both. The add
    branch's last layer starts at zero as in the paper's code, so ``fusion="add"`` starts as the identity in
    either ``init``; ``init="identity"`` also zeroes the scale branch's last layer and reads its gate as
    ``2 * sigmoid``. Tap (kind ``"spatial"``): the context softmax as a ``(B, 1, H, W)`` map.

    timm's ``GlobalContext`` defaults to the scale fusion ('gc' in ``timm.layers.get_attn``: ``fusion="scale"``
    here, with ``rd_ratio=1/8`` and ``norm_eps=1e-6`` for its ``LayerNorm2d``) and names the add fusion 'gca'
    (``fusion="add"``); ``norm_eps`` is the transform's LayerNorm epsilon (1e-5, ``nn.LayerNorm``'s, as the
    paper's code).
    """

    PAPER = ("Cao, Xu, Lin, Wei, Hu, 2019, GCNet: Non-local Networks Meet Squeeze-Excitation Networks and Beyond, "
             "arXiv 1904.11492")
    CHECKED_AGAINST = ("timm GlobalContext, fuse_add (fusion='add', the default), fuse_scale (fusion='scale') and "
                       "both (float64, weights copied, outputs and gradients)")
    IDENTITY = ("the add branch's last layer zeroed in either init (the paper's code); init='identity' also zeroes "
                "the scale branch's last layer, its gate read as 2 * sigmoid")

    def __init__(self, channels: int, rd_ratio: float = 1.0 / 16, rd_channels: Optional[int] = None,
                 rd_divisor: int = 1, fusion: str = "add", act_layer: Type[nn.Module] = nn.ReLU,
                 gate_layer: Type[nn.Module] = nn.Sigmoid, norm_eps: float = 1e-5, init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.init = check_init(init)
        if fusion not in FUSIONS:
            raise ValueError(f"unknown fusion {fusion!r}; valid: {', '.join(FUSIONS)}")
        rd = reduced_channels(channels, rd_ratio, rd_channels, rd_divisor)
        if rd_channels is None:
            rd = max(rd, GC_MIN_HIDDEN)
        elif rd < 3:
            warnings.warn(
                f"GlobalContext: rd_channels={rd} makes the transform's LayerNorm (almost) constant, so the "
                "context path learns nothing; use rd_channels >= 3",
                stacklevel=2,
            )
        if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not 0 < norm_eps < 1:
            raise ValueError(f"gc: norm_eps must be a number in (0, 1), got {norm_eps!r}")
        self.fusion = fusion
        self.conv_attn = nn.Conv2d(channels, 1, kernel_size=1)  # context scores, one per position

        def transform() -> nn.Sequential:
            return nn.Sequential(nn.Linear(channels, rd), nn.LayerNorm(rd, eps=norm_eps), act_layer(), nn.Linear(rd, channels))

        self.mlp_add = transform() if fusion in ("add", "both") else None
        self.mlp_scale = transform() if fusion in ("scale", "both") else None
        self.gate = gate_layer() if self.mlp_scale is not None else None
        self.gain = gate_gain(self.gate, init) if self.gate is not None else 1.0
        self.tap = AttentionTap("spatial", scale="relative")  # a softmax over positions, not a gate
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_normal_(self.conv_attn.weight, mode="fan_in", nonlinearity="relu")
        nn.init.zeros_(self.conv_attn.bias)
        self.zero_init_last()

    def zero_init_last(self) -> None:
        """The paper's "last_zero_init" of the add branch; with ``init="identity"`` the scale branch's last
        layer too. Also timm's hook, called by a timm ResNet after its own weight init."""
        if self.mlp_add is not None:
            zero_(self.mlp_add[-1].weight, self.mlp_add[-1].bias)
        if self.mlp_scale is not None and self.init == "identity":
            zero_(self.mlp_scale[-1].weight, self.mlp_scale[-1].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        B, C, H, W = x.shape
        with autocast_off(x):
            p, context = context_pool(x, self.conv_attn.weight, self.conv_attn.bias)  # (B, 1, HW), (B, C)
            out = x
            if self.mlp_scale is not None:
                scale = gained(self.gate(self.mlp_scale(context.to(self.mlp_scale[0].weight.dtype))), self.gain)
                out = out * scale.to(x.dtype)[:, :, None, None]
            if self.mlp_add is not None:
                add = self.mlp_add(context.to(self.mlp_add[0].weight.dtype))  # (B, C)
                out = out + add.to(x.dtype)[:, :, None, None]
        self.tap(p.view(B, 1, H, W))
        return out

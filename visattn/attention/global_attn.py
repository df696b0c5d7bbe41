"""Global attention over a feature map: polarized self-attention, criss-cross, DANet and double attention.

* ``psa``: polarized self-attention (Liu, Shao, Zhang, Liang, Zhao, 2021, "Polarized Self-Attention: Towards
  High-quality Pixel-wise Regression", arXiv 2107.00782).
* ``criss_cross``: criss-cross attention (Huang, Wang, Huang, Huang, Wei, Liu, 2019, "CCNet: Criss-Cross
  Attention for Semantic Segmentation", arXiv 1811.11721).
* ``danet``: DANet's position and channel attention modules (Fu, Liu, Tian, Li, Bao, Fang, Lu, 2019, "Dual
  Attention Network for Scene Segmentation", arXiv 1809.02983).
* ``a2``: the double attention block (Chen, Kalantidis, Li, Yan, Feng, 2018, "A^2-Nets: Double Attention
  Networks", arXiv 1810.11579).

None of these is in timm; each is checked against its paper's equations (and PSA's and DANet's channel module
also against the authors' code, where it differs: both are options) by a reference written in the tests.
Attention logits, softmaxes and the products with them run in fp32 with autocast off (fp64 for fp64 input), so
neither bf16 nor fp16 autocast can overflow them. Taps on ``(B, heads, N, N)`` token attention compute the
explicit weights only while recording.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..registry import register_attention
from .channel import autocast_off, check_channels, check_feature_map, compute_dtype, gained, is_channels_last, mean_over
from .functional import check_init, positive_int, zero_
from .self_attn2d import fused_attention
from .tap import AttentionTap

__all__ = ["PolarizedSelfAttention", "CrissCrossAttention", "DualAttention", "DoubleAttention"]


def check_choice(name: str, value: object, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def inner_width(channels: int, rd_ratio: float, rd_channels: Optional[int]) -> int:
    """``rd_channels`` if given, else ``int(channels * rd_ratio)``, at least 1."""
    if rd_channels is not None:
        return positive_int("rd_channels", rd_channels)
    if isinstance(rd_ratio, bool) or not isinstance(rd_ratio, (int, float)) or not 0 < rd_ratio <= 1:
        raise ValueError(f"rd_ratio must be a number in (0, 1], got {rd_ratio!r}")
    return max(1, int(channels * rd_ratio))


def like(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` in ``x``'s dtype and memory format."""
    y = y.to(x.dtype)
    return y.contiguous(memory_format=torch.channels_last if is_channels_last(x) else torch.contiguous_format)


# ---- polarized self-attention ---------------------------------------------------------------------------------------


@register_attention("psa", layout="feature", kind="spatial")
class PolarizedSelfAttention(nn.Module):
    """Polarized self-attention (Liu et al., 2021, arXiv 2107.00782).

    From the paper's Sec. 3 (its equations for each branch and composition). Channel-only branch:
    ``A_ch = sigmoid(LN(W_z((W_v x) softmax_N(W_q x))))``, ``W_q: C -> 1``, ``W_v: C -> C/2``, ``W_z: C/2 -> C``
    (1x1 convs), a softmax over the ``N`` positions, a LayerNorm over the channels. Spatial-only branch:
    ``A_sp = sigmoid(softmax_C(GAP(W_q' x)) . W_v' x)``, ``W_q', W_v': C -> C/2``, a softmax over the channels of
    the pooled queries, one logit per position. ``layout="parallel"`` composition: ``x * A_ch + x * A_sp``;
    ``"sequential"``: ``x' = x * A_ch``, then ``x' * A_sp(x')``.

    **Paper and authors' code disagree** (DeLightCMU/PSA, ``PSA_p`` / ``PSA_s``): the code has no LayerNorm in the
    channel branch, and in the spatial branch no softmax over the pooled queries but a softmax over the
    positions of the spatial logits, before the sigmoid. ``variant="paper"`` (default) or ``"code"``. The convs
    have no bias, as in the code.

    ``init="identity"``: the layer making each gate's logits starts at zero (the LayerNorm's scale and shift, or
    ``W_z`` for the code; ``W_v'``), so both gates start at 0.5: the parallel sum is ``x`` exactly; the sequential
    form reads its gates as ``2 * gate``. The code's spatial gate, ``sigmoid(softmax(...))``, is ``sigmoid(1/N)``
    at zero logits: with ``init="identity"`` it is divided by that value (and halved in the parallel layout).
    Taps: ``tap_channel`` the ``(B, C)`` gate and ``tap`` the ``(B, 1, H, W)`` gate (``"gain"`` scale when doubled).
    """

    PAPER = ("Liu, Shao, Zhang, Liang, Zhao, 2021, Polarized Self-Attention: Towards High-quality Pixel-wise "
             "Regression, arXiv 2107.00782")
    CHECKED_AGAINST = ("the paper's branch and composition equations (variant='paper', default) and the authors' "
                       "PSA_p / PSA_s code (variant='code'), written in the test; parallel and sequential; float64")
    IDENTITY = ("the logits' last layer (LayerNorm scale and shift, or W_z for the code; the spatial W_v): gates "
                "at 0.5, read as 2 * gate when sequential")

    def __init__(self, channels: int, layout: str = "parallel", variant: str = "paper", rd_ratio: float = 0.5,
                 rd_channels: Optional[int] = None, init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.layout = check_choice("layout", layout, ("parallel", "sequential"))
        self.variant = check_choice("variant", variant, ("paper", "code"))
        self.init = check_init(init)
        inter = inner_width(channels, rd_ratio, rd_channels)
        self.ch_wv = nn.Conv2d(channels, inter, 1, bias=False)
        self.ch_wq = nn.Conv2d(channels, 1, 1, bias=False)
        self.ch_wz = nn.Conv2d(inter, channels, 1, bias=False)
        self.ln = nn.LayerNorm(channels) if variant == "paper" else None
        self.sp_wv = nn.Conv2d(channels, inter, 1, bias=False)
        self.sp_wq = nn.Conv2d(channels, inter, 1, bias=False)
        doubled = init == "identity" and layout == "sequential"
        self.gain = 2.0 if doubled else 1.0
        self.sp_norm = init == "identity" and variant == "code"  # divide by sigmoid(1/N)
        self.sp_gain = (0.5 if layout == "parallel" else 1.0) if self.sp_norm else self.gain
        self.tap_channel = AttentionTap("channel", scale="gain" if doubled else None)
        self.tap = AttentionTap("spatial", scale="gain" if doubled else None)
        self.zero_init_last()

    def zero_init_last(self) -> None:
        """With ``init="identity"``, zero the layers that make the gates' logits (also timm's hook)."""
        if self.init == "identity":
            zero_(self.sp_wv.weight, *((self.ln.weight, self.ln.bias) if self.ln is not None else (self.ch_wz.weight,)))

    def channel_gate(self, x: torch.Tensor) -> torch.Tensor:
        """``A_ch``, ``(B, C)``."""
        v, q = self.ch_wv(x).flatten(2), self.ch_wq(x).flatten(2)  # (B, C/2, N), (B, 1, N)
        with autocast_off(x):
            acc = compute_dtype(x)
            z = v.to(acc) @ q.to(acc).softmax(dim=-1).transpose(1, 2)  # (B, C/2, 1): softmax over positions
            logits = self.ch_wz(z.to(self.ch_wz.weight.dtype)[..., None]).flatten(1)  # (B, C)
            if self.ln is not None:
                logits = self.ln(logits)
            return gained(logits.sigmoid(), self.gain)

    def spatial_gate(self, x: torch.Tensor) -> torch.Tensor:
        """``A_sp``, ``(B, 1, H, W)``."""
        B, _, H, W = x.shape
        q, v = self.sp_wq(x), self.sp_wv(x).flatten(2)  # (B, C/2, H, W), (B, C/2, N)
        with autocast_off(x):
            acc = compute_dtype(x)
            g = mean_over(q, (2, 3), acc)  # (B, C/2)
            if self.variant == "paper":
                logits = g.softmax(dim=-1)[:, None, :] @ v.to(acc)  # softmax over channels: (B, 1, N)
            else:
                logits = (g[:, None, :] @ v.to(acc)).softmax(dim=-1)  # the code: softmax over positions
            gate = logits.sigmoid()
            if self.sp_norm:
                gate = gate / torch.zeros_like(logits).softmax(dim=-1).sigmoid()
            return gained(gate, self.sp_gain).view(B, 1, H, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        a_ch = self.tap_channel(self.channel_gate(x))
        if self.layout == "parallel":
            a_sp = self.tap(self.spatial_gate(x))
            return x * a_ch.to(x.dtype)[:, :, None, None] + x * a_sp.to(x.dtype)
        xc = x * a_ch.to(x.dtype)[:, :, None, None]
        return xc * self.tap(self.spatial_gate(xc)).to(x.dtype)


# ---- criss-cross attention -------------------------------------------------------------------------------------------


@register_attention("criss_cross", layout="feature", kind="token")
class CrissCrossAttention(nn.Module):
    """Criss-cross attention (CCNet: Huang et al., 2019, arXiv 1811.11721), optionally recurrent (RCCA).

    Queries and keys (1x1 convs ``C -> C/8``) and values (``C -> C``); each position attends to the ``H + W - 1``
    positions of its row and column (the paper's Eq. 1: affinities ``Q_u . K_i`` over the criss-cross, one
    softmax; the position itself counted once, as the authors' code masks it out of the column), and Eq. 2
    adds ``gamma * sum(A V)`` to the input: the criss-cross attention module (CCA), ``recurrence=1``, the
    default. ``recurrence=2`` is the paper's recurrent RCCA (R = 2, the setting of its experiments): the module
    applied twice with the same weights, so every position reaches every other. ``gamma`` starts at zero (the
    authors' code), so the
    block starts as the identity under either ``init``. Cost per pass: ``O(N (H + W))``, no ``N x N`` tensor.
    Taps (``"token"``, one per pass, ``taps``): ``(B, 1, N, N)`` weights, zero off each position's criss-cross.
    """

    PAPER = ("Huang, Wang, Huang, Huang, Wei, Liu, 2019, CCNet: Criss-Cross Attention for Semantic Segmentation, "
             "arXiv 1811.11721")
    CHECKED_AGAINST = "the paper's Eqs. 1-2 per position over its row and column (loop reference in the test), R = 1 and 2"
    IDENTITY = "gamma (zero at init in either init, as in the paper's code)"

    def __init__(self, channels: int, recurrence: int = 1, rd_ratio: float = 1.0 / 8, rd_channels: Optional[int] = None,
                 init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.recurrence = positive_int("recurrence", recurrence)
        self.init = check_init(init)
        inter = inner_width(channels, rd_ratio, rd_channels)
        self.query_conv = nn.Conv2d(channels, inter, 1)
        self.key_conv = nn.Conv2d(channels, inter, 1)
        self.value_conv = nn.Conv2d(channels, channels, 1)
        self.gamma = nn.Parameter(torch.zeros(1))
        self.taps = nn.ModuleList(AttentionTap("token") for _ in range(recurrence))

    def zero_init_last(self) -> None:
        """``gamma`` back to zero (timm's hook, after its own init)."""
        zero_(self.gamma)

    def attend(self, x: torch.Tensor, tap: AttentionTap) -> torch.Tensor:
        """One criss-cross pass: ``x + gamma * (column part + row part)``."""
        B, C, H, W = x.shape
        xc = x.contiguous()  # one layout for the projections: the attention permutes the map anyway
        q, k, v = self.query_conv(xc), self.key_conv(xc), self.value_conv(xc)
        with torch.autocast(device_type=x.device.type, enabled=False):
            acc = compute_dtype(x)
            q, k, v = q.to(acc), k.to(acc), v.to(acc)
            e_col = q.permute(0, 3, 2, 1) @ k.permute(0, 3, 1, 2)  # (B, W, H, H'): same column
            self_pos = torch.eye(H, dtype=torch.bool, device=x.device)
            e_col = e_col.masked_fill(self_pos, float("-inf")).permute(0, 2, 1, 3)  # (B, H, W, H'), self once
            e_row = q.permute(0, 2, 3, 1) @ k.permute(0, 2, 1, 3)  # (B, H, W, W'): same row
            a_col, a_row = torch.cat([e_col, e_row], dim=-1).softmax(dim=-1).split([H, W], dim=-1)
            if tap.active:
                dense = (a_col[..., None] * torch.eye(W, dtype=acc, device=x.device)[None, None, :, None, :]
                         + a_row[:, :, :, None, :] * torch.eye(H, dtype=acc, device=x.device)[None, :, None, :, None])
                tap(dense.reshape(B, 1, H * W, H * W), grid=(H, W))
            out = (a_col.permute(0, 2, 1, 3) @ v.permute(0, 3, 2, 1)).permute(0, 3, 2, 1)  # (B, C, H, W)
            out = out + (a_row @ v.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            out = out * self.gamma.to(acc)
        return x + like(out, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        for tap in self.taps:
            x = self.attend(x, tap)
        return x


# ---- DANet ----------------------------------------------------------------------------------------------------------


@register_attention("danet", layout="feature", kind="token")
class DualAttention(nn.Module):
    """DANet's position and channel attention modules (Fu et al., 2019, arXiv 1809.02983).

    Position module (PAM, the paper's Eqs. 1-2): queries and keys ``C -> C/8``, values ``C -> C`` (1x1 convs),
    ``s = softmax_j(Q_i . K_j)`` over all ``N`` positions (no scaling), ``alpha * sum_j s_ij V_j``. Channel module
    (CAM, Eqs. 3-4): ``x_ij = softmax_j(A_i . A_j)`` over the ``C`` channels of the input itself, ``beta * sum_j
    x_ij A_j``. The paper's head sums the two modules' outputs after a conv each; as one same-width block here,
    ``y = x + alpha * PAM(x) + beta * CAM(x)`` (``parts="both"``, or one of ``"position"``, ``"channel"``).
    ``alpha`` and ``beta`` start at zero as in the paper, so the block starts as the identity in either ``init``.

    **Paper and authors' code disagree** on CAM: the code (junfu1115/DANet) takes the softmax of
    ``max_j(energy) - energy``, i.e. of ``-A_i . A_j``. ``channel_energy="paper"`` (default) or ``"code"``.

    Taps: ``tap`` (``"token"``): PAM's ``(B, 1, N, N)`` weights (fused SDPA when not recording); ``tap_channel``
    (``"channel"``, scale ``"relative"``): the weight each channel receives in CAM, averaged over the ``C`` query
    channels, ``(B, C)``. Double backward (gradient penalties): the fused SDPA kernels have none; run the block
    under ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``.
    """

    PAPER = ("Fu, Liu, Tian, Li, Bao, Fang, Lu, 2019, Dual Attention Network for Scene Segmentation, "
             "arXiv 1809.02983")
    CHECKED_AGAINST = ("the paper's Eqs. 1-4 (PAM, CAM) and the authors' CAM code (channel_energy='code'), "
                       "written in the test; float64")
    IDENTITY = "alpha and beta (zero at init in either init, as in the paper)"

    def __init__(self, channels: int, parts: str = "both", rd_ratio: float = 1.0 / 8, rd_channels: Optional[int] = None,
                 channel_energy: str = "paper", init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.parts = check_choice("parts", parts, ("both", "position", "channel"))
        self.channel_energy = check_choice("channel_energy", channel_energy, ("paper", "code"))
        self.init = check_init(init)
        self.position = parts in ("both", "position")
        self.channel = parts in ("both", "channel")
        if self.position:
            inter = inner_width(channels, rd_ratio, rd_channels)
            self.query_conv = nn.Conv2d(channels, inter, 1)
            self.key_conv = nn.Conv2d(channels, inter, 1)
            self.value_conv = nn.Conv2d(channels, channels, 1)
            self.alpha = nn.Parameter(torch.zeros(1))
            self.tap = AttentionTap("token")
        if self.channel:
            self.beta = nn.Parameter(torch.zeros(1))
            self.tap_channel = AttentionTap("channel", scale="relative")

    def zero_init_last(self) -> None:
        """``alpha`` and ``beta`` back to zero (timm's hook, after its own init)."""
        zero_(getattr(self, "alpha", None), getattr(self, "beta", None))

    def position_part(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        q = self.query_conv(x).flatten(2).transpose(1, 2)[:, None]  # (B, 1, N, d)
        k = self.key_conv(x).flatten(2).transpose(1, 2)[:, None]
        v = self.value_conv(x).flatten(2).transpose(1, 2)[:, None]  # (B, 1, N, C)
        with torch.autocast(device_type=x.device.type, enabled=False):
            acc = compute_dtype(x)
            q, k, v = q.to(acc), k.to(acc), v.to(acc)
            if self.tap.active:
                y = self.tap((q @ k.transpose(-1, -2)).softmax(dim=-1), grid=(H, W)) @ v
            else:
                y = fused_attention(q, k, v, 1.0)
            return y[:, 0].transpose(1, 2).reshape(B, C, H, W) * self.alpha.to(acc)

    def channel_part(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        with torch.autocast(device_type=x.device.type, enabled=False):
            a = x.flatten(2).to(compute_dtype(x))  # (B, C, N)
            energy = a @ a.transpose(1, 2)  # (B, C, C)
            if self.channel_energy == "code":
                energy = energy.amax(dim=-1, keepdim=True) - energy
            attn = energy.softmax(dim=-1)
            self.tap_channel(attn.mean(1))
            return (attn @ a).view(B, C, H, W) * self.beta.to(a.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        out, xc = x, x.contiguous()  # one layout for the projections: the attention permutes the map anyway
        if self.position:
            out = out + like(self.position_part(xc), x)
        if self.channel:
            out = out + like(self.channel_part(xc), x)
        return out


# ---- double attention -----------------------------------------------------------------------------------------------


@register_attention("a2", layout="feature", kind="token")
class DoubleAttention(nn.Module):
    """Double attention block (A^2-Nets: Chen et al., 2018, arXiv 1810.11579).

    Three 1x1 convs make features ``A`` (``m`` channels), attention maps ``B`` and attention vectors ``V`` (``n``
    each). Gathering (second-order attention pooling): ``G = A softmax_N(B)^T``, ``n`` global descriptors of
    ``m`` features, each a softmax-weighted sum over the positions. Distribution: each position takes a mix of
    the descriptors, ``z_i = G softmax_n(v_i)``, the softmax over the ``n`` descriptors. A 1x1 conv
    (``conv_reconstruct``) brings ``m`` back to ``C`` and the block adds it to its input. ``m = n = C * rd_ratio``
    (``C / 4`` here; ``c_m``, ``c_n`` set them). Cost: ``O(N m n)``, no ``N x N`` tensor. Note: widely copied code
    takes the second softmax over the positions; the paper's is over the descriptors, as here.

    ``init="identity"``: ``conv_reconstruct`` starts at zero. Tap (``"token"``): position ``i``'s effective weight
    on position ``j``, ``sum_k softmax_n(V)[k, i] softmax_N(B)[k, j]``, ``(B, 1, N, N)``, rows summing to one;
    computed only while recording.
    """

    PAPER = "Chen, Kalantidis, Li, Yan, Feng, 2018, A^2-Nets: Double Attention Networks, arXiv 1810.11579"
    CHECKED_AGAINST = "the paper's gathering and distribution steps (Sec. 3), written in the test; float64"
    IDENTITY = "conv_reconstruct (weight and bias)"

    def __init__(self, channels: int, rd_ratio: float = 0.25, c_m: Optional[int] = None, c_n: Optional[int] = None,
                 init: str = "default"):
        super().__init__()
        self.channels = check_channels(channels)
        self.init = check_init(init)
        m = inner_width(channels, rd_ratio, c_m)
        n = inner_width(channels, rd_ratio, c_n)
        self.c_m, self.c_n = m, n
        self.convA = nn.Conv2d(channels, m, 1)
        self.convB = nn.Conv2d(channels, n, 1)
        self.convV = nn.Conv2d(channels, n, 1)
        self.conv_reconstruct = nn.Conv2d(m, channels, 1)
        self.tap = AttentionTap("token")
        self.zero_init_last()

    def zero_init_last(self) -> None:
        """With ``init="identity"``, zero ``conv_reconstruct`` (also timm's hook)."""
        if self.init == "identity":
            zero_(self.conv_reconstruct.weight, self.conv_reconstruct.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_feature_map(self, x, self.channels)
        B, C, H, W = x.shape
        feats, maps, vecs = self.convA(x).flatten(2), self.convB(x).flatten(2), self.convV(x).flatten(2)
        with torch.autocast(device_type=x.device.type, enabled=False):
            acc = compute_dtype(x)
            gather = maps.to(acc).softmax(dim=-1)  # (B, n, N): over the positions
            distribute = vecs.to(acc).softmax(dim=1)  # (B, n, N): over the descriptors
            if self.tap.active:
                self.tap((distribute.transpose(1, 2) @ gather)[:, None], grid=(H, W))
            g = feats.to(acc) @ gather.transpose(1, 2)  # (B, m, n): global descriptors
            z = (g @ distribute).view(B, self.c_m, H, W)  # (B, m, H, W)
        y = self.conv_reconstruct(z.to(self.conv_reconstruct.weight.dtype))
        return x + like(y, x)

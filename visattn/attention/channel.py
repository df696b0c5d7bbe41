"""Channel attention: squeeze-and-excitation, efficient channel attention and global context.

* ``se``: Hu, Shen, Sun, 2018, "Squeeze-and-Excitation Networks", arXiv 1709.01507.
* ``eca``: Wang, Wu, Zhu, Li, Zuo, Hu, 2020, "ECA-Net: Efficient Channel Attention for Deep Convolutional
  Neural Networks", arXiv 1910.03151.
* ``gc``: Cao, Xu, Lin, Wei, Hu, 2019, "GCNet: Non-local Networks Meet Squeeze-Excitation Networks and
  Beyond", arXiv 1904.11492.

This module also holds :func:`gate_features`, the gating kernel SE, ECA and the CBAM gates
(:mod:`visattn.attention.spatial`) share. It computes ``x * c * s`` for a channel gate ``c = f(pool_hw(x))``
and a spatial gate ``s = g(pool_c(x * c))`` with a hand-written backward. Autograd would keep ``x * c``,
materialise ``grad * x`` twice and build ``amax``'s masks in fresh tensors; on CPU each fresh full-size
``(B, C, H, W)`` tensor is a page-faulting allocation that costs more than the arithmetic. The backward
here runs whole-tensor ops in place in two preallocated buffers (one becomes ``grad_x``) and uses batched
matrix products for the weighted sums. The small gate networks (MLPs, 7x7 conv, BN) keep ordinary autograd:
their graphs are recorded in the forward on detached pooled statistics and differentiated with
``torch.autograd.grad``, so hooks, BN statistics and parameter grads behave as usual.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional, Sequence, Type

import torch
from timm.layers import make_divisible
from torch import nn
from torch.autograd.function import once_differentiable

from .registry import register_attention
from .tap import AttentionTap

__all__ = ["SqueezeExcite", "EfficientChannelAttention", "GlobalContext", "gate_features", "eca_kernel_size"]


def check_channels(channels: int) -> int:
    if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
        raise ValueError(f"channels must be a positive int, got {channels!r}")
    return channels


def reduced_channels(channels: int, rd_ratio: float, rd_channels: Optional[int], rd_divisor: int) -> int:
    """Bottleneck width: ``rd_channels`` if given, else ``channels * rd_ratio`` rounded to ``rd_divisor``."""
    if rd_channels is not None:
        if isinstance(rd_channels, bool) or not isinstance(rd_channels, int) or rd_channels < 1:
            raise ValueError(f"rd_channels must be a positive int or None, got {rd_channels!r}")
        return rd_channels
    if not rd_ratio > 0:
        raise ValueError(f"rd_ratio must be > 0, got {rd_ratio!r}")
    if isinstance(rd_divisor, bool) or not isinstance(rd_divisor, int) or rd_divisor < 1:
        raise ValueError(f"rd_divisor must be a positive int, got {rd_divisor!r}")
    # round to the nearest multiple of rd_divisor, at least rd_divisor (timm's rule with round_limit=0)
    return make_divisible(channels * rd_ratio, rd_divisor, round_limit=0.0)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Pooled statistics and gates are fp32, or the input's dtype if that is wider (fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


def autocast_off(x: torch.Tensor):
    """The gate networks run in their parameters' dtype: they are tiny, and fp32 gates cannot overflow."""
    return torch.autocast(x.device.type, enabled=False)


def _small_grad(output: torch.Tensor, leaf: torch.Tensor, params: Sequence[torch.Tensor], grad: torch.Tensor):
    """Backward through a gate network recorded in the forward: grads for its input and its parameters."""
    wanted = [p for p in params if p.requires_grad]
    grads = torch.autograd.grad(
        output, [leaf, *wanted], grad.to(output.dtype), retain_graph=True, allow_unused=True
    )
    it = iter(grads[1:])
    return grads[0], [next(it) if p.requires_grad else None for p in params]


def _gate_forward(x: torch.Tensor, channel: Optional[nn.Module], spatial: Optional[nn.Module], track: bool):
    """Forward of :func:`gate_features`; ``track`` records the gate networks' graphs for the backward."""
    acc = compute_dtype(x)
    st = SimpleNamespace(cg=None, sg=None, pooled=None, maps=None, hw_max=None, c_max=None)
    out = None
    if channel is not None:
        stats = [x.mean((2, 3), dtype=acc)]  # (B, C) average pool
        if channel.pool_max:
            st.hw_max = x.amax((2, 3), keepdim=True)  # (B, C, 1, 1); the backward finds its argmax again
            stats.append(st.hw_max.flatten(1).to(acc))
        st.pooled = torch.stack(stats).requires_grad_(track)  # (P, B, C): leaf of the channel gate's graph
        with torch.set_grad_enabled(track), autocast_off(x):
            st.cg = channel.channel_weights(st.pooled)  # (B, C), passed through the gate's tap
        out = x * st.cg.detach().to(x.dtype)[:, :, None, None]  # x * c, the forward's one full-size tensor
    if spatial is not None:
        xc = x if out is None else out
        st.c_max = xc.amax(1, keepdim=True)  # (B, 1, H, W)
        # channel mean and max stacked last, (B, H, W, 2), seen as (B, 2, H, W): channels-last is the layout
        # in which oneDNN runs the 2-channel 7x7 conv (forward + backward) an order of magnitude faster on CPU
        maps = torch.stack([xc.mean(1, dtype=acc), st.c_max[:, 0].to(acc)], dim=-1)
        st.maps = maps.permute(0, 3, 1, 2).detach().requires_grad_(track)
        with torch.set_grad_enabled(track), autocast_off(x):
            st.sg = spatial.spatial_weights(st.maps)  # (B, 1, H, W), passed through the gate's tap
        sg = st.sg.detach().to(x.dtype)
        out = x * sg if out is None else out.mul_(sg)
    return out, st


class _GateFeatures(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, channel, spatial, n_channel_params, *params):
        out, st = _gate_forward(x, channel, spatial, track=True)
        ctx.save_for_backward(x)
        ctx.st, ctx.channel, ctx.spatial = st, channel, spatial
        ctx.ch_params, ctx.sp_params = params[:n_channel_params], params[n_channel_params:]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        # Every step is one whole-tensor op writing into one of two preallocated buffers (``buf``, which
        # ends up holding grad_x, and ``mask``): few, large kernels, and no other full-size allocation.
        (x,) = ctx.saved_tensors
        st, channel, spatial = ctx.st, ctx.channel, ctx.spatial
        B, C, H, W = x.shape
        dt = x.dtype
        cg = None if channel is None else st.cg.detach().to(dt).view(B, C, 1, 1)
        sg = None if spatial is None else st.sg.detach().to(dt).reshape(B, 1, H, W)
        buf = torch.empty_like(x)
        mask = torch.empty_like(x) if spatial is not None or st.hw_max is not None else None

        # 1) grads reaching the gates. out = x * c * s, so dL/dc = sum_hw(G x s), dL/ds = sum_c(G x c)
        gx = torch.mul(grad, x, out=buf)  # (B, C, H, W)
        if spatial is not None:
            if cg is None:
                d_sg = gx.sum(1, keepdim=True)
            else:  # batched (1 x C) @ (C x HW): a weighted channel sum without a temporary
                d_sg = torch.bmm(cg.view(B, 1, C), gx.flatten(2)).view(B, 1, H, W)
        if channel is not None:
            if sg is None:
                d_cg = gx.sum((2, 3))
            else:
                d_cg = torch.bmm(gx.flatten(2), sg.reshape(B, H * W, 1)).view(B, C)

        # 2) back through the spatial gate's network to its pooled maps, then to x * c. The channel max
        #    routes its grad to the channels equal to the max, split evenly among ties (amax's rule).
        sp_grads: list = []
        if spatial is not None:
            d_maps, sp_grads = _small_grad(st.sg, st.maps, ctx.sp_params, d_sg)
            if cg is None:
                torch.eq(x, st.c_max, out=mask)
            else:
                torch.mul(x, cg, out=mask).eq_(st.c_max)  # x * c recomputed bit for bit, then its argmax
            u = (d_maps[:, :1] / C).to(dt)  # (B, 1, H, W): through the channel mean
            v = (d_maps[:, 1:] / mask.sum(1, keepdim=True)).to(dt)  # (B, 1, H, W): per tied max
            if channel is not None:  # the maps pool x * c, so c also gets sum_hw(x * (u + mask * v))
                xm = torch.mul(mask, x, out=buf)
                d_cg = d_cg + torch.bmm(x.flatten(2), u.reshape(B, H * W, 1)).view(B, C)
                d_cg = d_cg + torch.bmm(xm.flatten(2), v.reshape(B, H * W, 1)).view(B, C)

        ch_grads: list = []
        if channel is not None:
            d_pooled, ch_grads = _small_grad(st.cg, st.pooled, ctx.ch_params, d_cg)

        # 3) grad_x = c * (G s + u + mask * v) + d_avg / HW + mask_hw * d_max / ties, written into buf
        grad_x = None
        if ctx.needs_input_grad[0]:
            if spatial is not None:
                grad_x = torch.mul(grad, sg, out=buf).addcmul_(mask, v).add_(u)
                if cg is not None:
                    grad_x.mul_(cg)
            else:
                grad_x = torch.mul(grad, cg, out=buf)
            if channel is not None:
                grad_x.add_((d_pooled[0] / (H * W)).to(dt).view(B, C, 1, 1))
                if st.hw_max is not None:
                    mask_hw = torch.eq(x, st.hw_max, out=mask)
                    d_max = d_pooled[1] / mask_hw.sum((2, 3))  # (B, C) per tied max
                    grad_x.addcmul_(mask_hw, d_max.to(dt).view(B, C, 1, 1))
        return (grad_x, None, None, None, *ch_grads, *sp_grads)


def gate_features(x: torch.Tensor, channel: Optional[nn.Module], spatial: Optional[nn.Module]) -> torch.Tensor:
    """``x * c * s`` for a channel gate, a spatial gate, or both (CBAM's order: channel first).

    ``channel`` provides ``pool_max`` (bool: pool the max as well as the mean over H, W) and
    ``channel_weights(pooled (P, B, C)) -> (B, C)``; ``spatial`` provides
    ``spatial_weights(maps (B, 2, H, W)) -> (B, 1, H, W)`` where ``maps`` holds the channel mean and max of
    ``x * c``. Both run with autocast off in their parameters' dtype and pass their gates through their taps.
    """
    if channel is None and spatial is None:
        raise ValueError("gate_features needs a channel gate, a spatial gate or both")
    if x.dim() != 4:
        raise ValueError(f"expected a (B, C, H, W) feature map, got shape {tuple(x.shape)}")
    ch_params = [] if channel is None else list(channel.parameters())
    sp_params = [] if spatial is None else list(spatial.parameters())
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in ch_params + sp_params))
    if not needs_grad:
        return _gate_forward(x, channel, spatial, track=False)[0]
    return _GateFeatures.apply(x, channel, spatial, len(ch_params), *ch_params, *sp_params)


@register_attention("se", layout="feature", kind="channel")
class SqueezeExcite(nn.Module):
    """Squeeze-and-excitation (Hu, Shen, Sun, 2018, arXiv 1709.01507).

    Global average pool, bottleneck MLP ``C -> C * rd_ratio -> C`` (1x1 convs with bias, ReLU), sigmoid gate
    per channel. The paper's reduction ratio is 16. Parameter names match timm's ``SEModule``, so its weights
    load directly. Tap: the ``(B, C)`` gate.
    """

    pool_max = False

    def __init__(
        self,
        channels: int,
        rd_ratio: float = 1.0 / 16,
        rd_channels: Optional[int] = None,
        rd_divisor: int = 1,
        act_layer: Type[nn.Module] = nn.ReLU,
        gate_layer: Type[nn.Module] = nn.Sigmoid,
        bias: bool = True,
    ):
        super().__init__()
        check_channels(channels)
        rd = reduced_channels(channels, rd_ratio, rd_channels, rd_divisor)
        self.fc1 = nn.Conv2d(channels, rd, kernel_size=1, bias=bias)
        self.act = act_layer()
        self.fc2 = nn.Conv2d(rd, channels, kernel_size=1, bias=bias)
        self.gate = gate_layer()
        self.tap = AttentionTap("channel")

    def channel_weights(self, pooled: torch.Tensor) -> torch.Tensor:
        s = pooled[0].to(self.fc1.weight.dtype)[:, :, None, None]  # (B, C, 1, 1) squeeze
        s = self.fc2(self.act(self.fc1(s)))  # (B, C, 1, 1) excitation logits
        return self.tap(self.gate(s.flatten(1)))  # (B, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gate_features(x, self, None)


def eca_kernel_size(channels: int, gamma: float = 2.0, b: float = 1.0) -> int:
    """ECA's adaptive kernel size ``|log2(C) / gamma + b / gamma|_odd`` (the paper's code: truncate, then
    bump even values up by one): 3 for C=64, 5 for C=128, 256 and 512."""
    t = int(abs((math.log2(channels) + b) / gamma))
    return t if t % 2 else t + 1


@register_attention("eca", layout="feature", kind="channel")
class EfficientChannelAttention(nn.Module):
    """Efficient channel attention (Wang et al., 2020, arXiv 1910.03151).

    Global average pool, then a 1D convolution across neighbouring channels (no dimensionality reduction)
    with a kernel size chosen from ``log2(C)`` (``gamma=2``, ``b=1``, odd; see :func:`eca_kernel_size`)
    unless ``kernel_size`` is given, then a sigmoid gate. Parameter names match timm's ``EcaModule``.
    Tap: the ``(B, C)`` gate.
    """

    pool_max = False

    def __init__(
        self,
        channels: int,
        kernel_size: Optional[int] = None,
        gamma: float = 2.0,
        b: float = 1.0,
        gate_layer: Type[nn.Module] = nn.Sigmoid,
    ):
        super().__init__()
        check_channels(channels)
        if kernel_size is None:
            kernel_size = eca_kernel_size(channels, gamma, b)
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd int, got {kernel_size!r}")
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(1, 1, kernel_size=kernel_size, padding=(kernel_size - 1) // 2, bias=False)
        self.gate = gate_layer()
        self.tap = AttentionTap("channel")

    def channel_weights(self, pooled: torch.Tensor) -> torch.Tensor:
        s = pooled[0].to(self.conv.weight.dtype)[:, None, :]  # (B, 1, C): channels as a 1D sequence
        return self.tap(self.gate(self.conv(s)[:, 0]))  # (B, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gate_features(x, self, None)


FUSIONS = ("add", "scale", "both")


class _ContextPool(torch.autograd.Function):
    """GC's context modelling, ``softmax_hw(w . x + b)``-weighted sum of ``x``: ``(B, C, H, W) -> (B, C)``.

    Autograd would return two full-size grads for ``x`` (one through the weighted sum, one through the 1x1
    score conv) and add them; here ``grad_x = d_ctx p^T + w d_logits^T`` is one batched rank-2 product.
    Also returns the softmax ``p`` (not differentiable) for the tap.
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        B, C, H, W = x.shape
        dt = x.dtype
        with autocast_off(x):
            feats = x.flatten(2)  # (B, C, HW); a view for contiguous and channels_last input
            logits = torch.matmul(weight.to(dt).view(1, 1, C), feats)  # (B, 1, HW)
            p = (logits.to(compute_dtype(x)) + bias.to(compute_dtype(x))).softmax(dim=-1)  # fp32 softmax
            context = torch.bmm(feats, p.to(dt).transpose(1, 2))[:, :, 0]  # (B, C)
        ctx.save_for_backward(x, weight, p)
        ctx.mark_non_differentiable(p)
        return context, p

    @staticmethod
    @once_differentiable
    def backward(ctx, d_context, _):
        x, weight, p = ctx.saved_tensors
        B, C, H, W = x.shape
        dt = x.dtype
        feats = x.flatten(2)
        d_ctx = d_context.to(dt)[:, None, :]  # (B, 1, C)
        d_p = torch.bmm(d_ctx, feats).to(p.dtype)  # (B, 1, HW)
        d_logits = p * (d_p - (p * d_p).sum(-1, keepdim=True))  # softmax backward
        d_weight = torch.bmm(feats, d_logits.to(dt).transpose(1, 2)).sum(0)  # (C, 1)
        d_bias = d_logits.sum().reshape(1)
        grad_x = None
        if ctx.needs_input_grad[0]:
            left = torch.stack([d_ctx[:, 0], weight.to(dt).view(1, C).expand(B, C)], dim=-1)  # (B, C, 2)
            right = torch.cat([p, d_logits], dim=1).to(dt)  # (B, 2, HW)
            if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
                grad_x = torch.bmm(right.transpose(1, 2), left.transpose(1, 2))  # (B, HW, C)
                grad_x = grad_x.view(B, H, W, C).permute(0, 3, 1, 2)
            else:
                grad_x = torch.bmm(left, right).view(B, C, H, W)
        return grad_x, d_weight.view(weight.shape).to(weight.dtype), d_bias.to(weight.dtype)


@register_attention("gc", layout="feature", kind="spatial")
class GlobalContext(nn.Module):
    """Global context block (Cao et al., 2019, arXiv 1904.11492).

    Context modelling: a 1x1 conv (``conv_attn``, applied through its weights, so its hooks do not fire)
    scores every position, a softmax over the H*W positions turns the scores
    into pooling weights, and the weighted sum of features is one ``(B, C)`` context vector (the non-local
    block's query-independent simplification). Transform: bottleneck ``C -> C * rd_ratio -> C`` with
    LayerNorm and ReLU (the paper uses ratio 1/16). Fusion: broadcast add (the paper's default), a sigmoid
    scale, or both. As in the paper's code the last transform layer of the add branch is zero-initialised,
    so the block starts as the identity. Tap (kind ``"spatial"``): the context softmax as a ``(B, 1, H, W)``
    map (it sums to one over H, W).
    """

    def __init__(
        self,
        channels: int,
        rd_ratio: float = 1.0 / 16,
        rd_channels: Optional[int] = None,
        rd_divisor: int = 1,
        fusion: str = "add",
        act_layer: Type[nn.Module] = nn.ReLU,
        gate_layer: Type[nn.Module] = nn.Sigmoid,
    ):
        super().__init__()
        check_channels(channels)
        if fusion not in FUSIONS:
            raise ValueError(f"unknown fusion {fusion!r}; valid: {', '.join(FUSIONS)}")
        rd = reduced_channels(channels, rd_ratio, rd_channels, rd_divisor)
        self.fusion = fusion
        self.conv_attn = nn.Conv2d(channels, 1, kernel_size=1)  # context scores, one per position

        def transform() -> nn.Sequential:
            return nn.Sequential(nn.Linear(channels, rd), nn.LayerNorm(rd), act_layer(), nn.Linear(rd, channels))

        self.mlp_add = transform() if fusion in ("add", "both") else None
        self.mlp_scale = transform() if fusion in ("scale", "both") else None
        self.gate = gate_layer() if self.mlp_scale is not None else None
        self.tap = AttentionTap("spatial")
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_normal_(self.conv_attn.weight, mode="fan_in", nonlinearity="relu")
        nn.init.zeros_(self.conv_attn.bias)
        if self.mlp_add is not None:  # the paper's "last_zero_init": the add branch starts at zero
            nn.init.zeros_(self.mlp_add[-1].weight)
            nn.init.zeros_(self.mlp_add[-1].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        # context (B, C) pooled with the softmax p (B, 1, HW) over positions (fp32 softmax)
        context, p = _ContextPool.apply(x, self.conv_attn.weight, self.conv_attn.bias)
        self.tap(p.view(B, 1, H, W))
        out = x
        if self.mlp_scale is not None:
            scale = self.gate(self.mlp_scale(context.to(self.mlp_scale[0].weight.dtype)))  # (B, C)
            out = out * scale.to(x.dtype)[:, :, None, None]
        if self.mlp_add is not None:
            add = self.mlp_add(context.to(self.mlp_add[0].weight.dtype))  # (B, C)
            out = out + add.to(x.dtype)[:, :, None, None]
        return out

"""Swin's (shifted) window attention as a token block, ``(B, N, D) -> (B, N, D)``: Liu, Lin, Cao, Hu, Wei,
Zhang, Lin, Guo, 2021, "Swin Transformer: Hierarchical Vision Transformer using Shifted Windows",
arXiv 2103.14030, section 3.2 (W-MSA, SW-MSA, relative position bias of eq. 4).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from ..registry import register_attention
from .functional import init_linears, sdpa
from .tap import AttentionTap
from .token_more import Grid, TokenBlockBase

__all__ = ["WindowAttention"]

Pair = Union[int, Tuple[int, int]]


def _pair(name: str, value: object, low: int) -> Tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else value
    ok = isinstance(pair, (tuple, list)) and len(pair) == 2
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in pair)
    if not ok:
        raise ValueError(f"{name} must be an int >= {low} or a pair (H, W) of them, got {value!r}")
    return int(pair[0]), int(pair[1])


@register_attention("window", layout="token", kind="token")
class WindowAttention(TokenBlockBase):
    """Window attention with an optional shift (Liu et al., 2021, arXiv 2103.14030, section 3.2).

    The grid tokens attend only within their ``window_size`` window, with the learned relative position bias
    ``B`` of eq. 4 (``relative_position_bias_table``, ``((2 Wh - 1)(2 Ww - 1), heads)``, trunc-normal std
    0.02) added to ``q k^T / sqrt(d)``. ``shift_size`` (0 <= shift < window; Swin alternates 0 and
    ``window // 2``) displaces the windows by ``shift`` tokens: the windows are the grid cut at
    ``shift + k * window`` along each axis, which is exactly Swin's cyclic shift with its attention mask (the
    wrapped pieces attend only among themselves), without the roll. As in timm, an axis no longer than the
    window gets a window of the grid's length and no shift. Equal to timm's ``SwinTransformerBlock`` attention
    (roll, partition, ``WindowAttention``, reverse) on grids the window divides; on others the last windows
    are partial and attend to real tokens only (timm attends to zero padding there).

    Prefix tokens (a class token; Swin has none): each attends to every token, and no grid token attends to
    them. Without a grid (``grid=None``) the tokens are one row, ``(1, N)``.

    Computed as attention over all ``N`` tokens with the window mask folded into the bias (``-inf`` outside
    each token's window), ``O(N^2)`` per head where Swin's partition is ``O(N * window area)``, the same
    function. So the recorded map (kind ``"token"``, ``(B, heads, N, N)``, ``grid``) is each token's window
    attention at its image position, zeros outside its window, the shift already undone. Fused SDPA unless the
    tap is active; double backward under ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``. Parameter
    names as timm's ``WindowAttention`` (strict load). Token blocks take no ``init`` option.
    """

    PAPER = ("Liu, Lin, Cao, Hu, Wei, Zhang, Lin, Guo, 2021, Swin Transformer: Hierarchical Vision Transformer "
             "using Shifted Windows, arXiv 2103.14030")
    CHECKED_AGAINST = ("timm SwinTransformerBlock's attention (roll, partition, WindowAttention, reverse; "
                       "float64, weights copied, outputs and gradients), shifted and not")

    def __init__(self, dim: int, num_heads: int = 8, window_size: Pair = 7, shift_size: Pair = 0,
                 qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0, grid: Grid = None,
                 num_prefix_tokens: int = 0):
        super().__init__()
        self._setup(dim, num_heads, grid, num_prefix_tokens)
        self.window_size = _pair("window_size", window_size, 1)
        self.shift_size = _pair("shift_size", shift_size, 0)
        if any(s >= w for s, w in zip(self.shift_size, self.window_size)):
            raise ValueError(f"shift_size must be smaller than window_size, got {shift_size!r} and {window_size!r}")
        wh, ww = self.window_size
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * wh - 1) * (2 * ww - 1), num_heads))
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.tap = AttentionTap("token")
        init_linears(self)
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)

    def grid_of(self, n: int) -> Tuple[int, int]:
        """The token grid: ``tap_grid``, or one row of the ``n`` less prefix tokens."""
        if self.tap_grid is not None:
            h, w = self.tap_grid
            if h * w + self.num_prefix_tokens != n:
                raise ValueError(f"WindowAttention: grid {self.tap_grid} with {self.num_prefix_tokens} prefix "
                                 f"token(s) needs {h * w + self.num_prefix_tokens} tokens, got {n}")
            return self.tap_grid
        if n <= self.num_prefix_tokens:
            raise ValueError(f"WindowAttention needs grid tokens after its {self.num_prefix_tokens} prefix token(s), got {n}")
        return 1, n - self.num_prefix_tokens

    def window_bias(self, grid: Tuple[int, int], device: Optional[torch.device] = None) -> torch.Tensor:
        """fp32 (fp64 for an fp64 block) ``(heads, N, N)`` logit bias: the relative position bias within each (shifted) window, ``-inf``
        between tokens of different windows; prefix rows are zero, prefix columns of grid rows ``-inf``."""
        table = self.relative_position_bias_table
        device = table.device if device is None else device
        pos, group = [], []
        for axis, size in enumerate(grid):
            win = min(self.window_size[axis], size)
            shift = 0 if size <= self.window_size[axis] else self.shift_size[axis]
            p = torch.arange(size, device=device)
            pos.append(p)
            group.append(torch.div(p - shift, win, rounding_mode="floor"))
        h, w = grid
        ys, xs = pos[0].repeat_interleave(w), pos[1].repeat(h)  # (G,), row-major
        gy, gx = group[0].repeat_interleave(w), group[1].repeat(h)
        same = (gy[:, None] == gy[None, :]) & (gx[:, None] == gx[None, :])  # (G, G)
        wh, ww = self.window_size
        dy = (ys[:, None] - ys[None, :]).clamp(1 - wh, wh - 1) + wh - 1  # clamped where masked anyway
        dx = (xs[:, None] - xs[None, :]).clamp(1 - ww, ww - 1) + ww - 1
        acc = torch.promote_types(table.dtype, torch.float32)  # fp32, or fp64 for an fp64 block
        bias = table.to(acc)[dy * (2 * ww - 1) + dx].permute(2, 0, 1)  # (heads, G, G)
        bias = bias.masked_fill(~same, float("-inf"))
        p = self.num_prefix_tokens
        if p:
            g = h * w
            top = bias.new_zeros(self.num_heads, p, p + g)  # prefix queries: every token, no bias
            left = bias.new_full((self.num_heads, g, p), float("-inf"))  # grid queries: not the prefix
            bias = torch.cat([top, torch.cat([left, bias], dim=2)], dim=1)
        return bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        B, N, D = x.shape
        bias = self.window_bias(self.grid_of(N), x.device)  # fp32 (heads, N, N)
        q, k, v = (self._heads(t) for t in self.qkv(x).chunk(3, dim=-1))  # (B, heads, N, d)
        if self.tap.active:
            with torch.autocast(device_type=x.device.type, enabled=False):
                acc = torch.promote_types(q.dtype, torch.float32)
                logits = (q.to(acc) * self.head_dim**-0.5) @ k.to(acc).transpose(-2, -1) + bias.to(acc)
                attn = logits.softmax(dim=-1)
            attn = self.tap(attn, grid=self.tap_grid, num_prefix_tokens=self.num_prefix_tokens)
            out = self.attn_drop(attn).to(v.dtype) @ v
        else:
            out = sdpa(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=self.attn_drop.p if self.training else 0.0)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, D)))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", window_size={self.window_size}, shift_size={self.shift_size}"

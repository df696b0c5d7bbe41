"""The observation contract every visattn block follows.

Each block owns one :class:`AttentionTap` (attribute ``tap``; CBAM has two) and passes its attention weights
through it; a record is named by the tap's module path less a trailing ``.tap``. Kinds and shapes:

* ``"channel"``: ``(B, C)`` gates (SE, ECA, CBAM's channel gate);
* ``"spatial"``: ``(B, 1, H, W)`` maps, sigmoid gates (CBAM, coordinate attention) or a softmax over positions (GC);
* ``"token"``: ``(B, heads, N, N)`` row-stochastic attention; ``grid=(H, W)`` says which grid the last ``H*W``
  tokens lie on and ``num_prefix_tokens`` how many (a class token) come before them;
* ``"pool"``: ``(B, N)`` attention-pooling weights (CCT's sequence pooling), ``grid`` as for ``"token"``;
* ``"covariance"``: ``(B, heads, d, d)`` channel x channel attention, each row a softmax over the head's ``d``
  channels (cross-covariance attention, XCA: El-Nouby et al., 2021, "XCiT: Cross-Covariance Image Transformers",
  arXiv:2106.09681); it has no image position, so ``grid`` is that of the tokens it mixes, if any.

**Value scale** (``AttentionRecord.scale``): ``"gate"`` (absolute, [0, 1]), ``"gain"`` (a multiplier in
[0, 2], 1 = unchanged: gates of ``init="identity"`` blocks) or ``"relative"`` (weights summing to one over
their keys, read as weight x number of keys). The default follows the kind (channel, spatial: ``"gate"``;
token, pool, covariance: ``"relative"``); a spatial softmax declares ``AttentionTap("spatial", scale="relative")``.

The tap is an identity. When a recorder sets a sink, it appends a detached fp32 copy of the weights (on the
sink's ``device`` if it has one); blocks on fused attention check ``tap.active`` and compute the weights
explicitly only then. The check reads a plain bool and the append runs outside any compiled graph
(``torch.compiler.disable``), so compiled graphs never guard on a recorder's list.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import nn

KINDS = ("channel", "spatial", "token", "pool", "covariance")
SCALES = ("gate", "gain", "relative")
DEFAULT_SCALE = {"channel": "gate", "spatial": "gate", "token": "relative", "pool": "relative", "covariance": "relative"}


@dataclass
class AttentionRecord:
    name: str  # module path of the block, e.g. "layer2.1.attn"
    kind: str  # "channel" | "spatial" | "token" | "pool" | "covariance"
    weights: torch.Tensor  # fp32, detached; shapes as in the module docstring
    grid: Optional[Tuple[int, int]] = None  # (H, W) of the spatial grid the weights refer to
    num_prefix_tokens: int = 0  # tokens before the grid tokens (token kind only)
    scale: Optional[str] = None  # "gate" | "gain" | "relative"; None: the kind's default (DEFAULT_SCALE)
    pass_index: int = 0  # which forward pass of the recorded model made it (0, 1, ...)

    @property
    def value_scale(self) -> str:
        """How the values are read: ``"gate"`` (absolute, [0, 1]), ``"gain"`` (multiplier, [0, 2]) or
        ``"relative"`` (x uniform)."""
        return self.scale or DEFAULT_SCALE.get(self.kind, "gate")


class AttentionTap(nn.Module):
    """Identity hook point that carries a block's attention weights to a recorder."""

    def __init__(self, kind: str, scale: Optional[str] = None):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown attention kind {kind!r}; valid: {', '.join(KINDS)}")
        if scale is not None and scale not in SCALES:
            raise ValueError(f"unknown value scale {scale!r}; valid: {', '.join(SCALES)}")
        self.kind = kind
        self.scale = scale
        self.recording = False  # a plain bool: what compiled graphs guard on
        self._sink: Optional[Any] = None
        self.record_name = ""

    @property
    def sink(self) -> Optional[Any]:
        """Where records go (anything with ``append``), or None when not recording."""
        return self._sink

    @sink.setter
    def sink(self, value: Optional[Any]) -> None:
        self._sink = value
        self.recording = value is not None

    @property
    def active(self) -> bool:
        return self.recording

    def forward(
        self, weights: torch.Tensor, grid: Optional[Tuple[int, int]] = None, num_prefix_tokens: int = 0
    ) -> torch.Tensor:
        if self.recording:
            _emit(self, weights, grid, num_prefix_tokens)
        return weights

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}" + (f", scale={self.scale!r}" if self.scale else "")


@torch.compiler.disable
def _emit(tap: AttentionTap, weights: torch.Tensor, grid, num_prefix_tokens) -> None:
    sink = tap.sink
    if sink is None:
        return
    device = getattr(sink, "device", None) or weights.device
    sink.append(
        AttentionRecord(
            name=tap.record_name,
            kind=tap.kind,
            weights=weights.detach().to(device=device, dtype=torch.float32, copy=True),
            grid=None if grid is None else (int(grid[0]), int(grid[1])),
            num_prefix_tokens=int(num_prefix_tokens),
            scale=tap.scale,
            pass_index=int(getattr(sink, "pass_index", 0)),
        )
    )

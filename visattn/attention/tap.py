"""The observation contract every visattn block follows.

Each block owns one :class:`AttentionTap` (attribute ``tap``) and passes its attention weights through it:

* ``"channel"`` weights: ``(B, C)`` gates in [0, 1] (SE, ECA, GC's transform, CBAM's channel gate);
* ``"spatial"`` weights: ``(B, 1, H, W)`` maps: sigmoid gates in [0, 1] (CBAM's / the spatial gate,
  coordinate attention's product), or a softmax over the H*W positions (GC's context pooling);
* ``"token"`` weights: ``(B, heads, N, N)`` row-stochastic attention (mhsa, lsa, non-local, mhsa2d), where
  ``grid=(H, W)`` says which spatial grid the last ``H*W`` tokens lie on and ``num_prefix_tokens`` how many
  tokens (a class token) come before them;
* ``"pool"`` weights: ``(B, N)`` attention-pooling weights over the tokens (CCT's sequence pooling), with
  ``grid`` and ``num_prefix_tokens`` as for ``"token"``.

A block may hold several taps (CBAM: one for its channel gate, one for its spatial gate); a record is named
by the tap's module path with a trailing ``.tap`` removed.

**Value scale.** Every record says how its values are to be read (``AttentionRecord.scale``):
``"gate"`` (an absolute value in [0, 1], drawn on that fixed range), ``"gain"`` (a multiplier in [0, 2] where
1 leaves the input unchanged: the gates of blocks built with ``init="identity"``) or ``"relative"`` (weights that sum to
one over their keys, drawn relative to uniform attention: weight x number of keys). The default follows the
kind (channel and spatial: ``"gate"``; token and pool: ``"relative"``); a block whose spatial map is a
softmax declares ``AttentionTap("spatial", scale="relative")`` (or sets ``tap.scale`` after construction).

The tap is an identity: ``forward`` never changes because of it. When a recorder (``visattn.record_attention``)
sets a sink, the tap appends a detached fp32 copy of the weights to it (on the sink's ``device`` when it has
one, e.g. the CPU). Blocks whose training path uses fused attention (``F.scaled_dot_product_attention``
returns no weights) check ``tap.active`` and compute the weights explicitly, in fp32, only on a recording
pass. With no recorder attached the cost is one attribute check per block.

The check reads a plain bool (``recording``) and the append runs outside any compiled graph
(``torch.compiler.disable``), so a graph compiled with taps in it never guards on a recorder's list;
``visattn.record_attention`` runs compiled code eagerly while it records, so recording does not recompile.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import nn

KINDS = ("channel", "spatial", "token", "pool")
SCALES = ("gate", "gain", "relative")
DEFAULT_SCALE = {"channel": "gate", "spatial": "gate", "token": "relative", "pool": "relative"}


@dataclass
class AttentionRecord:
    name: str  # module path of the block, e.g. "layer2.1.attn"
    kind: str  # "channel" | "spatial" | "token" | "pool"
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

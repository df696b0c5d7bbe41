"""The observation contract every visattn block follows.

Each block owns one :class:`AttentionTap` (attribute ``tap``) and passes its attention weights through it:

* ``"channel"`` weights: ``(B, C)`` gates in [0, 1] (SE, ECA, GC's transform, CBAM's channel gate);
* ``"spatial"`` weights: ``(B, 1, H, W)`` gates (CBAM's / the spatial gate, coordinate attention's product);
* ``"token"`` weights: ``(B, heads, N, N)`` row-stochastic attention (mhsa, lsa, non-local, mhsa2d), where
  ``grid=(H, W)`` says which spatial grid the last ``H*W`` tokens lie on and ``num_prefix_tokens`` how many
  tokens (a class token) come before them;
* ``"pool"`` weights: ``(B, N)`` attention-pooling weights over the tokens (CCT's sequence pooling), with
  ``grid`` and ``num_prefix_tokens`` as for ``"token"``.

A block may hold several taps (CBAM: one for its channel gate, one for its spatial gate); a record is named
by the tap's module path with a trailing ``.tap`` removed.

The tap is an identity: ``forward`` never changes because of it. When a recorder (``visattn.record_attention``)
sets a sink, the tap appends a detached fp32 copy of the weights to it. Blocks whose training path uses
fused attention (``F.scaled_dot_product_attention`` returns no weights) check ``tap.active`` and compute the
weights explicitly, in fp32, only on a recording pass. With no recorder attached the cost is one attribute
check per block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import nn

KINDS = ("channel", "spatial", "token", "pool")


@dataclass
class AttentionRecord:
    name: str  # module path of the block, e.g. "layer2.1.attn"
    kind: str  # "channel" | "spatial" | "token" | "pool"
    weights: torch.Tensor  # fp32, detached; shapes as in the module docstring
    grid: Optional[Tuple[int, int]] = None  # (H, W) of the spatial grid the weights refer to
    num_prefix_tokens: int = 0  # tokens before the grid tokens (token kind only)


class AttentionTap(nn.Module):
    """Identity hook point that carries a block's attention weights to a recorder."""

    def __init__(self, kind: str):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown attention kind {kind!r}; valid: {', '.join(KINDS)}")
        self.kind = kind
        self.sink: Optional[List[AttentionRecord]] = None
        self.record_name = ""

    @property
    def active(self) -> bool:
        return self.sink is not None

    def forward(
        self, weights: torch.Tensor, grid: Optional[Tuple[int, int]] = None, num_prefix_tokens: int = 0
    ) -> torch.Tensor:
        if self.sink is not None:
            self.sink.append(
                AttentionRecord(
                    name=self.record_name,
                    kind=self.kind,
                    weights=weights.detach().float(),
                    grid=None if grid is None else (int(grid[0]), int(grid[1])),
                    num_prefix_tokens=int(num_prefix_tokens),
                )
            )
        return weights

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}"

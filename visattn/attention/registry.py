"""Attention-block registry: ``register_attention``, ``create_attention``, ``list_attention``."""
from __future__ import annotations

from typing import Any, List, Optional

from torch import nn

from ..registry import Registry

_ATTENTION = Registry("attention block")

LAYOUTS = ("feature", "token")  # (B, C, H, W) -> same, or (B, N, D) -> same


def register_attention(name: str, layout: str = "feature", kind: str = "channel"):
    """Register a block class/builder. ``layout``: 'feature' or 'token'; ``kind``: what its tap carries."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    return _ATTENTION.register(name, layout=layout, kind=kind)


def list_attention(layout: Optional[str] = None) -> List[str]:
    """Names of the registered blocks ("none" included), optionally only one layout."""
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    return _ATTENTION.names(layout=layout)


def attention_info(name: str) -> dict:
    return _ATTENTION.meta(name)


def attention_options(name: str) -> List[str]:
    return _ATTENTION.options(name)


def create_attention(name: str, channels: int, **kwargs: Any) -> nn.Module:
    """Build block ``name`` for ``channels`` input channels (or token dim); ``"none"`` gives an identity."""
    return _ATTENTION.create(name, channels, **kwargs)


@register_attention("none", layout="feature", kind="channel")
class NoAttention(nn.Identity):
    """Identity: the attention slot left empty."""

    def __init__(self, channels: int = 0, **kwargs: Any):
        super().__init__()

"""Attention blocks: channel, spatial, spatial self-attention and token self-attention, one contract."""
from typing import Any

from torch import nn

from ..registry import attention_info, attention_options, create_attention, list_attention, register_attention
from .tap import AttentionRecord, AttentionTap


@register_attention("none", layout="feature", kind="channel")
class NoAttention(nn.Identity):
    """Identity: the attention slot left empty."""

    PAPER = ""  # not a mechanism
    CHECKED_AGAINST = "the identity"
    IDENTITY = "always the identity"

    def __init__(self, channels: int = 0, **kwargs: Any):
        super().__init__()


# Importing the block modules registers their blocks: channel (se, eca, gc), spatial (spatial, cbam, coord, strip),
# self_attn2d (nonlocal, mhsa2d), token (mhsa, lsa, seqpool), token_more (talking_heads, class_attn, xca,
# attn_pool), token_window (window), excite (ge, ela, fca, gct, srm), excite_groups (sge, simam, triplet, bam,
# shuffle), convlike (sk, splat, halo, lambda, bat), global_attn (psa, criss_cross, danet, a2).
from . import (  # noqa: E402
    channel,
    convlike,
    excite,
    excite_groups,
    global_attn,
    self_attn2d,
    spatial,
    token,
    token_more,
    token_window,
)
from .insert import AttnLayer, attn_layer, insert_attention  # noqa: E402
from .timm_names import TIMM_ATTN, create_timm_attention  # noqa: E402  (timm's get_attn names)

__all__ = [
    "AttentionRecord", "AttentionTap", "AttnLayer", "NoAttention", "attention_info", "attention_options", "attn_layer",
    "channel", "create_attention", "insert_attention", "list_attention", "register_attention", "self_attn2d",
    "spatial", "token", "token_more", "token_window", "excite", "excite_groups", "convlike", "global_attn",
    "TIMM_ATTN", "create_timm_attention",
]

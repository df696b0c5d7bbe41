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


# Importing the block modules registers their blocks.
from . import channel, self_attn2d, spatial, token  # noqa: E402
from . import token_more, token_window  # noqa: E402,F401  (talking_heads, class_attn, xca, attn_pool, window)
from . import excite, excite_groups  # noqa: E402,F401  (ge, ela, fca, gct, srm; sge, simam, triplet, bam, shuffle)
from . import convlike, global_attn  # noqa: E402,F401  (sk, splat, halo, lambda, bat; psa, criss_cross, danet, a2)
from .insert import AttnLayer, attn_layer, insert_attention  # noqa: E402
from .timm_names import TIMM_ATTN, create_timm_attention  # noqa: E402,F401  (timm's get_attn names)

__all__ = [
    "AttentionRecord", "AttentionTap", "AttnLayer", "NoAttention", "attention_info", "attention_options", "attn_layer",
    "channel", "create_attention", "insert_attention", "list_attention", "register_attention", "self_attn2d",
    "spatial", "token",
]

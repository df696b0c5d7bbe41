"""Attention blocks: channel, spatial, spatial self-attention and token self-attention, one contract."""
from .registry import (
    attention_info,
    attention_options,
    create_attention,
    list_attention,
    register_attention,
)
from .tap import AttentionRecord, AttentionTap

# Importing the block modules registers their blocks.
from . import channel, spatial, self_attn2d, token  # noqa: F401,E402
from .insert import *  # noqa: F401,F403,E402

"""Shared functional pieces of the attention blocks."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def positive_int(name: str, value: object, *, odd: bool = False, divides: Optional[int] = None) -> int:
    """``value`` if it is a positive int (a bool is not), odd and dividing ``divides`` where asked; else a
    one-line ValueError naming the option."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    ok = ok and not (odd and value % 2 == 0) and not (divides is not None and divides % value)
    if not ok:
        what = "a positive " + ("odd " if odd else "") + "int" + (f" ({divides} must be divisible by it)" if divides is not None else "")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
         dropout_p: float = 0.0, scale: Optional[float] = None, is_causal: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; on CPU, half-precision inputs run in fp32 and come back cast.

    PyTorch's CPU flash-attention kernel is several times slower in bf16 than in fp32, above all in the
    backward pass (measured here on ``(64, 12, 65, 16)`` q/k/v: 369 ms bf16 against 56 ms fp32 for forward +
    backward), and an fp32 softmax is what the blocks want numerically anyway. Autocast is switched off for
    the call so it does not cast the inputs back down. GPUs keep their native half-precision kernels.

    The fused kernels (flash, memory-efficient, cuDNN) have no double backward: for a gradient penalty or
    other second-order use, run under ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``, whose composite
    ops are twice differentiable.
    """
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.float()
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=attn_mask,
                                                 dropout_p=dropout_p, scale=scale, is_causal=is_causal)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                                          is_causal=is_causal)

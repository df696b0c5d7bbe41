"""Shared functional pieces of the attention blocks."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# torch's public batch and instance norm classes (every subclass of its private ``_BatchNorm`` / ``_NormBase`` that
# torch ships; a lazy one becomes one of these at its first forward): what the blocks and the insertion rules test a
# norm against, read through public names only
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
NORMS_WITH_STATS = BATCH_NORMS + (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def positive_int(name: str, value: object, *, odd: bool = False, divides: Optional[int] = None) -> int:
    """``value`` if it is a positive int (a bool is not), odd and dividing ``divides`` where asked; else a
    one-line ValueError naming the option."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    ok = ok and not (odd and value % 2 == 0) and not (divides is not None and divides % value)
    if not ok:
        what = "a positive " + ("odd " if odd else "") + "int" + (f" ({divides} must be divisible by it)" if divides is not None else "")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls and convolutions in hardware (AMX tiles or AVX512-BF16).

    Without either, oneDNN and MKL emulate bf16 and a bf16 matmul runs tens of times *slower* than fp32
    (measured on a 2-core AVX2 AMD EPYC: about 0.0004 against 0.035 TFLOP/s at one thread)."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
         dropout_p: float = 0.0, scale: Optional[float] = None, is_causal: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; on CPU, half-precision inputs run in fp32 (autocast off) and come
    back cast: the CPU flash kernel is several times slower in bf16 (``(64, 12, 65, 16)`` q/k/v, forward +
    backward: 369 ms bf16, 56 ms fp32), and an fp32 softmax is what the blocks want anyway. The fused kernels
    have no double backward: run second-order uses under ``sdpa_kernel(SDPBackend.MATH)``."""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.float()
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=attn_mask,
                                                 dropout_p=dropout_p, scale=scale, is_causal=is_causal)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                                          is_causal=is_causal)


def init_linears(module: nn.Module) -> None:
    """Every ``nn.Linear`` in ``module``: truncated-normal weights (std 0.02, as ViTs and timm do), zero biases."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


INITS = ("default", "identity")


def check_init(init: object) -> str:
    """``init`` if it is one of :data:`INITS`, else a one-line ValueError."""
    if init not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)}, got {init!r}")
    return str(init)


def gate_gain(gate: nn.Module, init: str) -> float:
    """What a block multiplies its gate by: 1 for ``init="default"``; for ``init="identity"`` the reciprocal
    of the gate's value at 0 (2 for a sigmoid), so a gate whose logits start at exactly zero passes its input
    through unchanged (``x * 2 * sigmoid(0) == x``)."""
    if check_init(init) == "default":
        return 1.0
    with torch.no_grad():
        g0 = float(gate(torch.zeros(1, device="cpu")).reshape(-1)[0])  # CPU even under a meta-device build
    if not (g0 > 0 and g0 == g0 and g0 != float("inf")):
        raise ValueError(f"init='identity' needs a gate that is positive and finite at 0; {type(gate).__name__} gives {g0}")
    return 1.0 / g0


def zero_(*tensors: Optional[torch.Tensor]) -> None:
    """Zero every given parameter (``None`` skipped)."""
    with torch.no_grad():
        for t in tensors:
            if t is not None:
                t.zero_()

"""What the block tests share: random weights that reach the output, a state copied by order, float64 closeness, one
random block's training step in a given precision."""
from __future__ import annotations

from typing import Collection, Optional

import torch
from torch import nn

from visattn import create_attention


def randomize_(module: nn.Module, seed: int = 0, spread: float = 0.5, around_one: Collection[int] = (1,)) -> nn.Module:
    """Every parameter drawn from N(0, spread^2) in its own dtype, those with a dimension count in ``around_one``
    (vectors: norm scales, biases, temperatures; add 0 for scalar residual scales) shifted to 1. Zero and identity
    initialisations (BN scale 0, zero last layers) are gone, so each parameter reaches the output with a non-trivial
    gradient. Returns ``module``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * spread + (1.0 if p.dim() in around_one else 0.0))
    return module


def load_by_order(dst: nn.Module, src: nn.Module) -> None:
    """Copy ``src``'s state into ``dst`` entry by entry in registration order (names differ, layout not)."""
    d, s = dst.state_dict(), list(src.state_dict().values())
    assert len(d) == len(s), (list(d), list(src.state_dict()))
    dst.load_state_dict({k: v.reshape(d[k].shape) for k, v in zip(d, s)})


def close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-10) -> None:
    """``a`` and ``b`` (reshaped to ``a``) agree to ``tol`` relative to ``b``'s magnitude; the message names ``what``."""
    err = (a - b.reshape(a.shape)).abs().max().item()
    assert err <= tol * (1 + b.abs().max().item()), f"{what}: {err}"


def random_block_step(name: str, x: torch.Tensor, g: torch.Tensor, dtype: Optional[torch.dtype]):
    """One forward and backward of block ``name`` (``x``'s channels, train mode, seeded random weights rather than
    its identity start, so every path carries signal) on ``x`` with upstream gradient ``g``: in fp32 when ``dtype``
    is None, else under CPU autocast with ``x`` cast to ``dtype``. Returns the output (fp32), the input's gradient and
    the parameters' gradients."""
    torch.manual_seed(0)
    block = create_attention(name, x.shape[1]).train()
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    leaf = x.detach().clone().requires_grad_()
    if dtype is None:
        y = block(leaf)
    else:
        with torch.autocast("cpu", dtype=dtype):
            y = block(leaf.to(dtype))
    y.float().backward(g)
    grads = [p.grad.clone() for p in block.parameters() if p.grad is not None]
    return y.float().detach(), leaf.grad.clone(), grads


"""The self-attention blocks' explicit bf16 path computes what the fused fp32 kernel does (issue 94).

On a CPU with native bf16, ``nonlocal`` and ``mhsa2d`` (and every block attending through
:func:`visattn.attention.self_attn2d.fused_attention`) write their attention out in bf16 under the recipe's
autocast: bf16 matmuls accumulating in fp32 and a softmax computed in fp32, its output rounded to bf16. Without
native bf16, in fp32, or beyond the logits budget they keep the fused kernel. Checked here against the fp32
kernel (output and every gradient, to bf16's tolerance), the choice of path, double backward, and the blocks
under autocast against the same blocks in fp32. The path is forced on where the CPU lacks native bf16 (an AVX2
machine emulates bf16: slow, but the same arithmetic), so these run on every CI machine."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import visattn.attention.self_attn2d as sa
from visattn import create_attention


@pytest.fixture
def native(monkeypatch):
    """The explicit path's CPU condition met, as on an AMX or AVX512-BF16 machine."""
    monkeypatch.setattr(sa, "cpu_has_native_bf16", lambda: True)


def qkv(B=3, n=2, N=20, dq=24, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, N, d, generator=g) for d in (dq, dq, dv)]


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 2**-6) -> bool:
    """Equal to bf16's tolerance: within ``rel`` of the reference's largest magnitude, element by element."""
    a, b = a.double(), b.double()
    return bool(((a - b).abs() <= rel * b.abs().max() + 1e-6).all())


def test_the_explicit_path_is_taken_for_bf16_only_within_its_budget(native, monkeypatch):
    q, k, _ = qkv()
    assert sa.explicit_bf16(q.bfloat16(), k.bfloat16())
    assert not sa.explicit_bf16(q, k)  # fp32: the fused kernel, unchanged
    assert not sa.explicit_bf16(q.half(), k.half())
    monkeypatch.setattr(sa, "EXPLICIT_MAX_LOGITS", q.shape[:-1].numel() * k.shape[-2] - 1)
    assert not sa.explicit_bf16(q.bfloat16(), k.bfloat16())  # one logit over the budget
    monkeypatch.setattr(sa, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(sa, "EXPLICIT_MAX_LOGITS", 2**27)
    assert not sa.explicit_bf16(q.bfloat16(), k.bfloat16())  # emulated bf16: the fp32 kernel stays faster


def test_the_explicit_path_is_the_fused_kernel_to_bf16_tolerance(native, monkeypatch):
    """Output and the gradients of q, k and v (queries and keys wider than values, as MHSA-2D's folded ones)
    against F.scaled_dot_product_attention in fp32 on the same bf16 inputs; the output keeps the values' width."""
    monkeypatch.setattr(sa, "sdpa", lambda *a, **k: pytest.fail("the fused kernel ran"))
    ref = [t.bfloat16().float().requires_grad_() for t in qkv()]
    fast = [t.detach().bfloat16().requires_grad_() for t in ref]
    scale = 0.3
    y_ref = F.scaled_dot_product_attention(*ref, scale=scale)
    y = sa.fused_attention(*fast, scale)
    assert y.dtype == torch.bfloat16 and y.shape == y_ref.shape
    assert close(y, y_ref)
    g = torch.randn_like(y_ref)
    y_ref.backward(g)
    y.backward(g.bfloat16())
    for a, b in zip(fast, ref):
        assert a.grad.dtype == torch.bfloat16 and close(a.grad, b.grad, 2**-5)


def test_the_fused_kernel_is_what_runs_without_the_explicit_path():
    """fp32 inputs: bit for bit the padded fused kernel, as before."""
    q, k, v = qkv()
    y = sa.fused_attention(q, k, v, 0.3)
    size = 24
    ref = F.scaled_dot_product_attention(q, k, F.pad(v, (0, size - 8)), scale=0.3)[..., :8]
    assert torch.equal(y, ref)


def test_the_explicit_path_has_a_double_backward(native):
    """Second order (gradient penalties) without switching kernels: the second derivatives of a bf16 penalty follow
    the fp32 math kernel's to bf16's tolerance."""
    base = qkv(B=2, n=1, N=9, dq=8, dv=8, seed=3)

    def second(ts, fn):
        leaves = [t.clone().requires_grad_() for t in ts]
        y = fn(*leaves)
        grads = torch.autograd.grad(y.float().square().sum(), leaves, create_graph=True)
        return torch.autograd.grad(sum(g.float().square().sum() for g in grads), leaves)

    fast = second([t.bfloat16() for t in base], lambda q, k, v: sa.fused_attention(q, k, v, 0.5))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = second([t.bfloat16().double() for t in base],
                     lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.5))
    assert close(fast[0], ref[0], 2**-5) and close(fast[1], ref[1], 2**-4)
    # the parameters' gradients against the largest of them: some are zero in exact arithmetic (the bias of the
    # convolution before the BN, the keys' bias under the softmax) and keep only rounding noise in either precision
    scale = max(float(b.abs().max()) for b in ref[2:])
    for a, b in zip(fast[2:], ref[2:]):
        assert ((a.double() - b.double()).abs() <= 2**-4 * scale).all()


@pytest.mark.parametrize("name", ["nonlocal", "mhsa2d"])
def test_the_blocks_under_bf16_autocast_follow_their_fp32_selves(native, name):
    """The block (random weights, train mode, channels-last map) under bf16 autocast against the same block in
    fp32: the output and the input's and every parameter's gradient to bf16's tolerance; and the explicit path is
    the one that ran (the fused kernel is patched to fail)."""
    torch.manual_seed(0)
    block = create_attention(name, 16).train().to(memory_format=torch.channels_last)
    with torch.no_grad():  # not the identity start: the attention's output must reach the block's
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(4, 16, 6, 5).bfloat16().float().contiguous(memory_format=torch.channels_last)
    g = torch.randn(4, 16, 6, 5)

    def run(dtype):
        block.zero_grad()
        leaf = x.clone().requires_grad_()
        if dtype is None:
            y = block(leaf)
        else:
            with torch.autocast("cpu", dtype=dtype):
                y = block(leaf.to(dtype))
        y.float().backward(g)
        return [y.float(), leaf.grad] + [p.grad.clone() for p in block.parameters()]

    ref = run(None)
    real_sdpa = sa.sdpa
    sa.sdpa = lambda *a, **k: pytest.fail("the fused kernel ran under bf16 on a native-bf16 CPU")
    try:
        fast = run(torch.bfloat16)
    finally:
        sa.sdpa = real_sdpa
    assert close(fast[0], ref[0], 2**-5) and close(fast[1], ref[1], 2**-4)
    # the parameters' gradients against the largest of them: some are zero in exact arithmetic (the bias of the
    # convolution before the BN, the keys' bias under the softmax) and keep only rounding noise in either precision
    scale = max(float(b.abs().max()) for b in ref[2:])
    for a, b in zip(fast[2:], ref[2:]):
        assert ((a.double() - b.double()).abs() <= 2**-4 * scale).all()

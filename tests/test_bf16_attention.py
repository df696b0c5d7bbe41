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
from block_helpers import random_block_step

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
    for a, b, tol in zip(fast, ref, (2**-5, 2**-4, 2**-4)):  # q, k, v
        assert close(a, b, tol)


@pytest.mark.parametrize("name", ["nonlocal", "mhsa2d"])
def test_the_blocks_under_bf16_autocast_follow_their_fp32_selves(native, name):
    """The block (random weights, train mode, channels-last map) under bf16 autocast against the same block in
    fp32: the output and the input's and every parameter's gradient to bf16's tolerance; and the explicit path is
    the one that ran (the fused kernel is patched to fail)."""
    torch.manual_seed(1)
    x = torch.randn(4, 16, 6, 5).bfloat16().float().contiguous(memory_format=torch.channels_last)
    g = torch.randn(4, 16, 6, 5)
    y, dx, grads = random_block_step(name, x, g, None)
    ref = [y, dx, *grads]
    real_sdpa = sa.sdpa
    sa.sdpa = lambda *a, **k: pytest.fail("the fused kernel ran under bf16 on a native-bf16 CPU")
    try:
        y, dx, grads = random_block_step(name, x, g, torch.bfloat16)
    finally:
        sa.sdpa = real_sdpa
    fast = [y, dx, *grads]
    assert len(fast) == len(ref)
    assert close(fast[0], ref[0], 2**-5) and close(fast[1], ref[1], 2**-4)
    # the parameters' gradients against the largest of them: some are zero in exact arithmetic (the bias of the
    # convolution before the BN, the keys' bias under the softmax) and keep only rounding noise in either precision
    scale = max(float(b.abs().max()) for b in ref[2:])
    for a, b in zip(fast[2:], ref[2:]):
        assert ((a.double() - b.double()).abs() <= 2**-4 * scale).all()


def test_the_in_place_function_is_autograds_written_out_attention(native):
    """:class:`_ExplicitAttention` (softmax and its gradient in place) against autograd over the same ops: the output
    and the values' gradient bit for bit, the queries' and keys' to bf16 rounding (their products are formed in
    another order), and the buffers it hands back are the in-place ones."""
    base = [t.bfloat16() for t in qkv(B=2, n=3, N=17, dq=16, dv=8, seed=5)]
    fast = [t.clone().requires_grad_() for t in base]
    plain = [t.clone().requires_grad_() for t in base]
    y = sa.explicit_attention(*fast, 0.4)
    assert type(y.grad_fn).__name__ == "_ExplicitAttentionBackward"
    y_ref = ((plain[0] * 0.4) @ plain[1].transpose(-2, -1)).softmax(dim=-1) @ plain[2]
    assert torch.equal(y, y_ref)
    g = torch.randn(y.shape).bfloat16()
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(fast[2].grad, plain[2].grad)
    for a, b in zip(fast[:2], plain[:2]):
        assert close(a.grad, b.grad, 2**-7)


def test_the_in_place_function_steps_aside_without_a_graph_and_under_transforms(native):
    """Inference and ``torch.func`` take the plain ops: no graph, or the transforms' own autograd; per-sample
    gradients equal the plain expression's."""
    q, k, v = [t.bfloat16() for t in qkv(B=3, n=1, N=6, dq=8, dv=8, seed=2)]
    with torch.no_grad():
        assert torch.equal(sa.explicit_attention(q, k, v, 0.5),
                           ((q * 0.5) @ k.transpose(-2, -1)).softmax(dim=-1) @ v)

    def loss(qi):
        return sa.explicit_attention(qi[None], k[:1], v[:1], 0.5).float().square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss))(q)
    for i in range(3):
        qi = q[i:i + 1].clone().requires_grad_()
        ref = ((qi * 0.5) @ k[:1].transpose(-2, -1)).softmax(dim=-1) @ v[:1]
        ref.float().square().sum().backward()
        assert close(per_sample[i], qi.grad[0], 2**-7)


@pytest.mark.parametrize("name", ["nonlocal", "mhsa2d"])
def test_the_blocks_compile_fullgraph_under_bf16(native, name):
    torch.manual_seed(0)
    block = create_attention(name, 16).train().to(memory_format=torch.channels_last)
    x = torch.randn(4, 16, 6, 5).contiguous(memory_format=torch.channels_last)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = compiled(x.bfloat16().requires_grad_())
        y_eager = block(x.bfloat16())
    assert close(y.float(), y_eager.float(), 2**-6)
    y.float().sum().backward()


def test_constant_key_columns_get_no_gradient_and_change_nothing_else(native):
    """MHSA-2D's one-hot key columns handed to the function as constants: the output is autograd's over the
    concatenated keys bit for bit, the keys' own gradient its first columns to bf16 rounding, and a double backward
    through them follows the plain expression's."""
    q, k, v = [t.bfloat16() for t in qkv(B=2, n=2, N=12, dq=8, dv=8, seed=9)]
    keys = torch.eye(12)[:, :5].bfloat16()  # (N, 5) constant columns
    q_wide = torch.cat([q, torch.randn(2, 2, 12, 5).bfloat16()], dim=-1)
    fast = [t.clone().requires_grad_() for t in (q_wide, k, v)]
    plain = [t.clone().requires_grad_() for t in (q_wide, k, v)]
    y = sa.explicit_attention(*fast, 0.5, keys)
    kf = torch.cat([plain[1], keys.expand(2, 2, 12, 5)], dim=-1)
    y_ref = ((plain[0] * 0.5) @ kf.transpose(-2, -1)).softmax(dim=-1) @ plain[2]
    assert type(y.grad_fn).__name__ == "_ExplicitAttentionBackward" and torch.equal(y, y_ref)
    g = torch.randn(y.shape).bfloat16()
    y.backward(g)
    y_ref.backward(g)
    assert fast[1].grad.shape == k.shape and torch.equal(fast[2].grad, plain[2].grad)
    for a, b in zip(fast[:2], plain[:2]):
        assert close(a.grad, b.grad, 2**-7)
    leaves = [t.clone().requires_grad_() for t in (q_wide, k, v)]
    grads = torch.autograd.grad(sa.explicit_attention(*leaves, 1.0, keys).float().square().sum(), leaves,
                                create_graph=True)
    second = torch.autograd.grad(sum(gr.float().square().sum() for gr in grads), leaves)
    ref_leaves = [t.clone().double().requires_grad_() for t in (q_wide, k, v)]
    kd = torch.cat([ref_leaves[1], keys.double().expand(2, 2, 12, 5)], dim=-1)
    y_d = (ref_leaves[0] @ kd.transpose(-2, -1)).softmax(dim=-1) @ ref_leaves[2]
    grads_d = torch.autograd.grad(y_d.square().sum(), ref_leaves, create_graph=True)
    second_d = torch.autograd.grad(sum(gr.square().sum() for gr in grads_d), ref_leaves)
    for a, b in zip(second, second_d):
        assert close(a, b, 2**-4)


def test_the_function_under_torch_func_is_the_plain_attention(native):
    """``torch.func`` through the in-place function itself (``vmap`` of ``grad``, and ``vmap`` over a batch of
    constant key columns) gives the plain expression's per-sample gradients and outputs."""
    q, k, v = [t.bfloat16() for t in qkv(B=3, n=1, N=6, dq=8, dv=8, seed=4)]
    q = torch.cat([q, torch.randn(3, 1, 6, 3).bfloat16()], dim=-1)  # queries as wide as k and the 3 key columns
    keys = torch.eye(6)[:, :3].bfloat16()

    def loss(qi, ki):
        return sa._ExplicitAttention.apply(qi[None], ki[None], v[:1], 0.5, keys)[0].float().square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)))(q, k)
    for i in range(3):
        qi, ki = q[i:i + 1].clone().requires_grad_(), k[i:i + 1].clone().requires_grad_()
        kf = torch.cat([ki, keys.expand(1, 1, 6, 3)], dim=-1)
        ref = ((qi * 0.5) @ kf.transpose(-2, -1)).softmax(dim=-1) @ v[:1]
        ref.float().square().sum().backward()
        assert close(per_sample[0][i], qi.grad[0], 2**-7) and close(per_sample[1][i], ki.grad[0], 2**-7)
    many = torch.stack([keys, keys.flip(0)])  # (2, N, 3): mapped along with the queries
    out = torch.func.vmap(lambda qi, ks: sa._ExplicitAttention.apply(qi, k, v, 0.5, ks)[0])(
        torch.stack([q, q]), many)
    for i in range(2):
        kf = torch.cat([k, many[i].expand(3, 1, 6, 3)], dim=-1)
        assert close(out[i], ((q * 0.5) @ kf.transpose(-2, -1)).softmax(dim=-1) @ v, 2**-7)


def test_without_torchs_in_place_softmax_gradient_the_plain_ops_run(native, monkeypatch):
    """A torch release without the private in-place softmax gradient: the explicit path keeps autograd's softmax."""
    monkeypatch.setattr(sa, "SOFTMAX_GRAD_INTO", None)
    q, k, v = [t.bfloat16().requires_grad_() for t in qkv(seed=1)]
    y = sa.explicit_attention(q, k, v, 0.5)
    assert type(y.grad_fn).__name__ != "_ExplicitAttentionBackward"
    y.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()


@pytest.mark.parametrize("per_chunk", [1, 2, 5])
def test_the_chunks_together_are_the_whole(native, monkeypatch, per_chunk):
    """The batch in chunks of ``per_chunk`` items (the last one short where 5 does not divide): the same output and
    gradients as the plain expression over the whole batch, with and without constant key columns."""
    B, n, N = 5, 2, 7
    monkeypatch.setattr(sa, "CHUNK_LOGITS", per_chunk * n * N * N)
    assert len(sa.spans(B, n * N * N)) == -(-B // per_chunk)
    q, k, v = [t.bfloat16() for t in qkv(B=B, n=n, N=N, dq=8, dv=6, seed=11)]
    for keys in (None, torch.eye(N)[:, :3].bfloat16()):
        q_in = q if keys is None else torch.cat([q, torch.randn(B, n, N, 3).bfloat16()], dim=-1)
        fast = [t.clone().requires_grad_() for t in (q_in, k, v)]
        plain = [t.clone().requires_grad_() for t in (q_in, k, v)]
        y = sa.explicit_attention(*fast, 0.3, keys)
        assert type(y.grad_fn).__name__ == "_ExplicitAttentionBackward"
        y_ref = ((plain[0] * 0.3) @ sa.with_keys(plain[1], keys).transpose(-2, -1)).softmax(dim=-1) @ plain[2]
        assert close(y, y_ref, 2**-8)
        g = torch.randn(y.shape).bfloat16()
        y.backward(g)
        y_ref.backward(g)
        for a, b in zip(fast, plain):
            assert a.grad.shape == b.grad.shape and close(a.grad, b.grad, 2**-7)

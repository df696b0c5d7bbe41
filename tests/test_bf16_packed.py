"""The self-attention blocks' explicit bf16 attention from their packed projection (issue 94).

:func:`visattn.attention.self_attn2d.packed_attention` lays the ``(B, N, 3 n d)`` tokens a block's projection
writes out per head once (``_parts``: ``(3, n, B, N, d)``) and :class:`~visattn.attention.self_attn2d._PackedAttention`
returns ``(B, N, n d)`` output tokens from them, one head of a chunk of images at a time, each step's queries, keys
and values dense blocks; MHSA-2D's relative logits ride along as extra query columns against constant key columns. Checked here: in float64 against the plain expression (exact up to summation order: chunks, heads,
the widened queries and keys, the scale), in bf16 against fp32 (bf16 tolerance), the double backward, ``torch.func``,
the plain fallbacks, MHSA-2D's relative logits against its folded form, the projection as a 1x1 convolution against
the linear layer, and both blocks taking the path under bf16 autocast."""
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


def inputs(B=5, N=12, heads=2, d=8, e=0, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, 3 * heads * d, generator=g).to(dtype).requires_grad_()
    rel = torch.randn(B, heads, N, e, generator=g).to(dtype).requires_grad_() if e else None
    keys = torch.randn(N, e, generator=g).to(dtype) if e else None
    return qkv, rel, keys


def reference(qkv, heads, scale, rel=None, keys=None):
    """Per head, written out independently of the module: ``softmax(scale (q k^T + rel keys^T)) v``."""
    B, N, width = qkv.shape
    d = width // (3 * heads)
    outs = []
    for h in range(heads):
        q, k, v = (qkv[..., (p * heads + h) * d: (p * heads + h + 1) * d] for p in range(3))
        logits = q @ k.transpose(1, 2)
        if rel is not None:
            logits = logits + rel[:, h] @ keys.t()
        outs.append((scale * logits).softmax(-1) @ v)
    return torch.cat(outs, dim=-1)


def packed(qkv, heads, *rest):
    """The function's output from packed tokens, its parts laid out as :func:`packed_attention` lays them."""
    return sa._PackedAttention.apply(sa._parts(qkv, heads), heads, *rest)[0]


def close(a, b, rel=2**-6):
    a, b = a.double(), b.double()
    return bool(((a - b).abs() <= rel * b.abs().max() + 1e-6).all())


@pytest.mark.parametrize("heads,d,e,per_chunk", [(1, 8, 0, 2), (3, 8, 0, 5), (2, 8, 5, 2), (4, 8, 3, 1), (1, 8, 30, 3),
                                                 (2, 3, 0, 2), (3, 2, 4, 5)])
def test_the_function_is_the_attention_in_float64(monkeypatch, heads, d, e, per_chunk):
    """Output and the gradients of the tokens and the extra query columns, chunks of ``per_chunk`` images (the last
    one short), against the per-head reference, to float64 rounding; heads narrow against the 12 positions (d 2 and
    3) take the transposed products of the backward."""
    monkeypatch.setattr(sa, "CHUNK_LOGITS", per_chunk * 12 * 12)
    qkv, rel, keys = inputs(heads=heads, d=d, e=e)
    y = packed(qkv, heads, 0.3, rel, keys)
    ref = reference(qkv, heads, 0.3, rel, keys)
    assert torch.allclose(y, ref, atol=1e-12, rtol=1e-10)
    g = torch.randn_like(y)
    leaves = [t for t in (qkv, rel) if t is not None]
    for a, b in zip(torch.autograd.grad(y, leaves, g), torch.autograd.grad(ref, leaves, g)):
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-10)


def test_strided_extra_columns_get_their_gradient_in_their_own_layout():
    """MHSA-2D hands its relative logits over as a permuted view: read as such, the gradient laid out the same."""
    qkv, _, keys = inputs(heads=2, e=4)
    base = torch.randn(12, 5, 2, 4, dtype=torch.float64, requires_grad=True)  # (N, B, n, e)
    rel = base.permute(1, 2, 0, 3)
    y = packed(qkv, 2, 0.5, rel, keys)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, base, g)[0]
    want = torch.autograd.grad(reference(qkv, 2, 0.5, rel, keys), base, g)[0]
    assert torch.allclose(got, want, atol=1e-12)


def dense(t: torch.Tensor) -> bool:
    """Each matrix of ``t`` one dense block, rows or columns contiguous, and the blocks one after another: what torch's
    bf16 matmul reads as it is (any other operand it clones first)."""
    return t.is_contiguous() or t.transpose(-2, -1).is_contiguous()


@pytest.mark.parametrize("heads,e", [(1, 0), (4, 0), (2, 6)])
def test_every_step_reads_and_writes_dense_blocks_and_copies_nothing_of_its_own(monkeypatch, heads, e):
    """Forward and backward over 3 chunks, each step (a head of a chunk) runs its 6 matmuls (bmm and baddbmm) on
    dense operands and writes dense outputs (an output given transposed sends the matmul to a scalar loop), and no
    step copies its operands: the tokens are laid out per head once before the function (``(3, n, B, N, d)``), not
    read where the projection wrote them (rows ``3 n d`` apart, which the matmul clones at every step). The only
    copies: the output tokens and the incoming gradient put into or out of the per-head layout once each where there
    are several heads, and with extra columns the fold's (queries, their columns and keys into the widened buffers,
    forward and backward; the queries' and the columns' gradients out of it; its constant key columns once each way)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setattr(sa, "CHUNK_LOGITS", 2 * 12 * 12)  # 2 images a chunk: 3 chunks
    seen, copies = [], []

    class Operands(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.baddbmm):
                mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 3]
                out = kwargs.get("out")
                seen.append((func.overloadpacket.__name__, [tuple(m.stride()) for m in mats],
                             all(map(dense, mats)) and (out is None or out.is_contiguous())))
            elif func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_, torch.ops.aten._to_copy):
                copies.append(func.overloadpacket.__name__)
            return func(*args, **kwargs)

    qkv, rel, keys = inputs(B=6, N=12, heads=heads, d=8, e=e, dtype=torch.bfloat16)
    parts = sa._parts(qkv, heads)
    with Operands():
        y = sa._PackedAttention.apply(parts, heads, 0.5, rel, keys)[0]
        torch.autograd.grad(y, [t for t in (parts, rel) if t is not None], torch.randn_like(y))
    steps = 3 * heads
    assert len(seen) == 6 * steps and all(ok for *_, ok in seen), [s for s in seen if not s[-1]]
    assert copies.count("clone") == (0 if heads == 1 else 2)
    assert copies.count("copy_") == (8 * steps + 2 if e else 0) and "_to_copy" not in copies


def test_the_parts_are_the_tokens_per_head_and_keep_nothing_for_the_backward():
    """``_parts`` lays ``(B, N, 3 n d)`` tokens out as ``(3, n, B, N, d)`` (any strides of the tokens), and the
    gradient goes back through it as it came (a permutation: its backward saves no tensor), so the function alone
    holds the parts for its backward."""
    qkv = torch.randn(3, 5, 2 * 3 * 4, dtype=torch.float64)[:, :, ::2].requires_grad_()  # rows strided, 3 n d = 12
    parts = sa._parts(qkv, 2)
    assert parts.shape == (3, 2, 3, 5, 2) and parts.is_contiguous()
    for p in range(3):
        for h in range(2):
            assert torch.equal(parts[p, h], qkv[..., (p * 2 + h) * 2: (p * 2 + h + 1) * 2])
    g = torch.randn_like(parts)
    (got,) = torch.autograd.grad(parts, qkv, g)
    assert torch.equal(got, g.permute(2, 3, 0, 1, 4).reshape(3, 5, 12))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sa._parts(qkv, 2)
    assert saved == []


def test_the_backward_holds_the_parts_not_the_tokens():
    """Through ``packed_attention`` the graph keeps, for the attention's backward, the per-head parts, the
    probabilities and the extra columns, and not the projection's tokens (which would hold a second copy of them)."""
    qkv, rel, keys = inputs(B=4, N=12, heads=2, d=8, e=3, dtype=torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = sa.packed_attention(qkv, 2, 0.5, rel, keys)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert not any(t.data_ptr() == qkv.data_ptr() for t in saved), shapes
    assert (3, 2, 4, 12, 8) in shapes and (4, 12, 12) in shapes  # the parts, a chunk's probabilities
    g = torch.randn_like(y)
    want = torch.autograd.grad(reference(qkv.double(), 2, 0.5, rel.double(), keys.double()), (qkv, rel), g.double())
    assert all(close(a, b, 2**-5) for a, b in zip(torch.autograd.grad(y, (qkv, rel), g), want))


def test_vmap_over_the_extra_columns_alone_is_the_loop():
    """``vmap`` over MHSA-2D's extra columns with the tokens shared (the rule expands the parts along the mapped
    dimension) gives each sample's attention and gradients (float64)."""
    qkv, rel, keys = inputs(B=3, heads=2, e=4, seed=9)
    rels = torch.stack([rel.detach() * (1 + i / 3) for i in range(3)])
    out = torch.func.vmap(lambda r: sa.packed_attention(qkv.detach(), 2, 0.5, r, keys))(rels)
    grads = torch.func.vmap(torch.func.grad(lambda t, r: sa.packed_attention(t, 2, 0.5, r, keys).square().sum(),
                                            argnums=(0, 1)), in_dims=(None, 0))(qkv.detach(), rels)
    for i in range(3):
        t, r = qkv.detach().clone().requires_grad_(), rels[i].clone().requires_grad_()
        want = reference(t, 2, 0.5, r, keys)
        assert torch.allclose(out[i], want, atol=1e-12)
        wt, wr = torch.autograd.grad(want.square().sum(), (t, r))
        assert torch.allclose(grads[0][i], wt, atol=1e-10) and torch.allclose(grads[1][i], wr, atol=1e-10)


def test_bf16_is_the_fp32_attention_to_bf16_tolerance(monkeypatch):
    monkeypatch.setattr(sa, "CHUNK_LOGITS", 2 * 12 * 12)
    qkv, rel, keys = inputs(heads=2, e=6, dtype=torch.float32, seed=3)
    fast = [t.detach().bfloat16().requires_grad_() for t in (qkv, rel)]
    ref = [t.detach().bfloat16().float().requires_grad_() for t in (qkv, rel)]
    y = sa.packed_attention(fast[0], 2, 0.4, fast[1], keys.bfloat16())
    assert type(y.grad_fn).__name__ == "_PackedAttentionBackward" and y.dtype == torch.bfloat16
    y_ref = reference(ref[0], 2, 0.4, ref[1], keys.bfloat16().float())
    assert close(y, y_ref)
    g = torch.randn(y.shape)
    y.backward(g.bfloat16())
    y_ref.backward(g.bfloat16().float())
    for a, b in zip(fast, ref):
        assert close(a.grad, b.grad, 2**-6)


def test_double_backward_follows_the_plain_expression():
    """With ``create_graph`` the backward forms the attention again in differentiable ops: second derivatives of
    the tokens and the extra columns equal the reference's (float64)."""
    qkv, rel, keys = inputs(heads=2, e=3, seed=5)

    def second(f):
        y = f(qkv, 2, 0.7, rel, keys)
        grads = torch.autograd.grad(y.square().sum(), (qkv, rel), create_graph=True)
        return torch.autograd.grad(sum(gr.square().sum() for gr in grads), (qkv, rel))

    for a, b in zip(second(packed), second(reference)):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-8)


def test_under_torch_func_per_sample_gradients_are_the_loops():
    qkv, rel, keys = inputs(B=3, heads=2, e=4, seed=6)

    def loss(t, r):
        return sa.packed_attention(t[None], 2, 0.5, r[None], keys).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)))(qkv.detach(), rel.detach())
    out = torch.func.vmap(lambda t: packed(t, 2, 0.5, rel.detach(), keys))(
        torch.stack([qkv.detach(), qkv.detach().flip(0)]))
    for i in range(3):
        t, r = qkv[i:i + 1].detach().requires_grad_(), rel[i:i + 1].detach().requires_grad_()
        want = torch.autograd.grad(reference(t, 2, 0.5, r, keys).square().sum(), (t, r))
        assert torch.allclose(per_sample[0][i], want[0][0]) and torch.allclose(per_sample[1][i], want[1][0])
    assert torch.allclose(out[1], reference(qkv.detach().flip(0), 2, 0.5, rel.detach(), keys))


def test_an_unchunked_call_has_an_unchunked_backward(monkeypatch):
    """The vmap rule runs the merged batch in one chunk, every head in turn: the backward follows the forward's steps
    (it does not chunk the batch again), here with several heads and chunks smaller than the batch; and per-sample
    gradients through ``vmap(grad)`` with more images per sample than a chunk holds equal the loop's."""
    monkeypatch.setattr(sa, "CHUNK_LOGITS", 2 * 12 * 12)  # 2 images a chunk
    qkv, rel, keys = inputs(B=5, heads=2, e=3, seed=8)
    y = packed(qkv, 2, 0.5, rel, keys, False)
    g = torch.randn_like(y)
    want = reference(qkv, 2, 0.5, rel, keys)
    for a, b in zip(torch.autograd.grad(y, (qkv, rel), g), torch.autograd.grad(want, (qkv, rel), g)):
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-10)
    stacked = torch.stack([qkv.detach() * (1 + i / 4) for i in range(3)])
    rels = torch.stack([rel.detach()] * 3)
    got = torch.func.vmap(torch.func.grad(lambda t, r: sa.packed_attention(t, 2, 0.5, r, keys).square().sum(),
                                          argnums=(0, 1)))(stacked, rels)
    for i in range(3):
        t, r = stacked[i].clone().requires_grad_(), rels[i].clone().requires_grad_()
        want = torch.autograd.grad(reference(t, 2, 0.5, r, keys).square().sum(), (t, r))
        assert all(torch.allclose(a[i], b, atol=1e-10) for a, b in zip(got, want))


def test_the_plain_ops_run_without_a_graph_or_the_in_place_softmax_gradient(monkeypatch):
    """Inference (no graph) and a torch without the in-place softmax gradient take the plain ops: the reference's
    values and gradients all the same (float64)."""
    qkv, rel, keys = inputs(heads=2, e=3)
    want = reference(qkv, 2, 0.5, rel, keys)
    with torch.no_grad():
        assert torch.allclose(sa.packed_attention(qkv, 2, 0.5, rel, keys), want, atol=1e-12)
    monkeypatch.setattr(sa, "SOFTMAX_GRAD_INTO", None)
    y = sa.packed_attention(qkv, 2, 0.5, rel, keys)
    assert type(y.grad_fn).__name__ != "_PackedAttentionBackward" and torch.allclose(y, want, atol=1e-12)
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, (qkv, rel), g), torch.autograd.grad(want, (qkv, rel), g)):
        assert torch.allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("scale_pos", [True, False])
@pytest.mark.parametrize("H,W", [(5, 4), (3, 7)])
def test_mhsa2d_relative_logits_are_its_folded_ones(scale_pos, H, W):
    """:meth:`MHSA2d.rel_logits` (one matmul over the positions) against the relative columns of
    :meth:`MHSA2d.rel_parts` (the folded form the other paths use), and their keys against its key columns."""
    torch.manual_seed(0)
    block = create_attention("mhsa2d", 16, num_heads=2, scale_pos=scale_pos).double()
    qkv = torch.randn(3, H * W, 48, dtype=torch.float64)
    rel, keys = block.rel_logits(qkv, H, W)
    q = qkv.view(3, H * W, 3, 2, 8).permute(2, 0, 3, 1, 4)[0]
    folded, folded_keys = block.rel_parts(q, H, W)
    assert torch.allclose(rel, folded[..., 8: 8 + H + W], atol=1e-12)
    assert torch.equal(keys, folded_keys[:, : H + W])


@pytest.mark.parametrize("name", ["nonlocal", "mhsa2d"])
def test_the_projection_as_a_convolution_is_the_linear_layer(name):
    """Channels-last input: the tokens through a 1x1 convolution of the same weight equal the linear layer's, and so
    do the weight's, the bias's and the input's gradients (fp32)."""
    torch.manual_seed(1)
    block = create_attention(name, 16)
    if block.qkv.bias is not None:
        torch.nn.init.normal_(block.qkv.bias)
    x = torch.randn(2, 16, 5, 6)
    g = torch.randn(2, 30, block.qkv.out_features)
    runs = []
    for fmt in (torch.channels_last, torch.contiguous_format):
        xi = x.contiguous(memory_format=fmt).requires_grad_()
        block.zero_grad()
        tokens = block.qkv_tokens(xi)
        tokens.backward(g)
        runs.append([tokens, xi.grad, *(p.grad.clone() for p in block.qkv.parameters())])
    want = F.linear(x.flatten(2).transpose(1, 2), block.qkv.weight, block.qkv.bias)
    assert torch.allclose(runs[0][0], want, atol=1e-5)
    for a, b in zip(runs[0], runs[1]):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", [torch.channels_last, torch.contiguous_format])
@pytest.mark.parametrize("name, kwargs", [("nonlocal", {}), ("mhsa2d", {}), ("mhsa2d", {"num_heads": 1}),
                                          ("mhsa2d", {"scale_pos": False, "max_size": 4})])
def test_the_blocks_take_the_packed_path_in_bf16(native, monkeypatch, name, kwargs, fmt):
    """Under the recipe's bf16 autocast on a native-bf16 CPU each block attends through the packed function (the
    q/k/v function and the fused kernel fail if called), and matches itself in fp32 to bf16 tolerance: channels-last
    and contiguous maps, one head, unscaled relative logits from a table smaller than the map."""
    torch.manual_seed(2)
    block = create_attention(name, 16, **kwargs).train().to(memory_format=fmt)
    torch.nn.init.normal_(block.norm.weight)  # past the identity start, so the attention shows in the output
    x = torch.randn(4, 16, 6, 5).contiguous(memory_format=fmt)
    calls = []
    real = sa._PackedAttention.apply
    monkeypatch.setattr(sa._PackedAttention, "apply", lambda *a: calls.append(a[1]) or real(*a))
    monkeypatch.setattr(sa, "explicit_attention", lambda *a, **k: pytest.fail("the q/k/v function ran"))
    monkeypatch.setattr(sa, "sdpa", lambda *a, **k: pytest.fail("the fused kernel ran"))
    xb = x.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(xb)
    y.float().square().sum().backward()
    assert calls == [getattr(block, "num_heads", 1)]
    monkeypatch.undo()
    x32 = x.bfloat16().float().requires_grad_()
    grads = {k: p.grad.clone() for k, p in block.named_parameters()}
    block.zero_grad()
    y32 = block(x32)
    y32.square().sum().backward()
    assert close(y.float(), y32, 2**-5) and close(xb.grad, x32.grad, 2**-4)
    for k, p in block.named_parameters():
        if k != "proj.bias":  # before a training-mode BN: zero in exact arithmetic, rounding noise in either precision
            assert close(grads[k], p.grad, 2**-4), k

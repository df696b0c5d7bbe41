"""Self-attention over the H x W positions of a feature map, ``(B, C, H, W) -> (B, C, H, W)``.

* ``nonlocal``: the non-local block, embedded-Gaussian form (Wang, Girshick, Gupta, He, 2018, "Non-local
  Neural Networks", arXiv 1711.07971).
* ``mhsa2d``: multi-head self-attention with BoTNet's 2D relative-position logits (Srinivas, Lin, Parmar,
  Shlens, Abbeel, Vaswani, 2021, "Bottleneck Transformers for Visual Recognition", arXiv 2101.11605).

Both are residual blocks whose output path ends in a BatchNorm with zero-initialised scale, so they start as
the identity in either ``init``; with a scale-free ``norm_layer`` (``nn.Identity``) ``init="identity"`` zeroes
the output projection instead. Both attend over all ``N = H * W`` positions (cost grows as ``N**2``), so they
suit the later, smaller stages. Plain PyTorch (compile, export, ONNX, trace, ``torch.func``); double backward
under ``sdpa_kernel(SDPBackend.MATH)``. The tap (kind ``"token"``) carries ``(B, heads, N, N)`` weights with
``grid=(H, W)``: on recording passes the softmax is computed explicitly in fp32 and that same tensor
multiplies the values; otherwise the path is fused ``F.scaled_dot_product_attention``, or, for bf16 on a CPU that
computes bf16 natively (the recipe's autocast), the same attention written out in bf16 from the blocks' packed
projection (:func:`packed_attention`; other blocks' attention through :func:`fused_attention`).
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import register_attention
from .channel import check_channels, check_feature_map, check_norm_batch, is_channels_last, reduced_channels
from .functional import check_init, cpu_has_native_bf16, positive_int, sdpa, zero_
from .tap import AttentionTap

__all__ = ["NonLocal2d", "MHSA2d", "rel_pos_embed"]


# the most logits (elements of the ``(B, heads, N, N)`` scores) whose probabilities the explicit bf16 path keeps for
# its backward: 2**27, 256 MiB in bf16 (the recipe's 15 x 15 maps: 512 x 4 x 225 x 225 = 1.0e8); beyond it the fused
# kernel, which keeps none
EXPLICIT_MAX_LOGITS = 2**27


def explicit_bf16(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`fused_attention` takes the explicit path: bf16 queries on a CPU that computes bf16 natively,
    with at most :data:`EXPLICIT_MAX_LOGITS` logits."""
    logits = q.shape[:-1].numel() * k.shape[-2]
    return (q.dtype == torch.bfloat16 and q.device.type == "cpu" and logits <= EXPLICIT_MAX_LOGITS
            and cpu_has_native_bf16())


# the softmax's gradient written in place over the probabilities' gradient: torch's fused kernel, the one autograd's
# softmax uses, reached through its aten name (torch has no public in-place form; the public formula
# ``p * (dp - (dp * p).sum(-1))`` takes about 6x longer on a (2048, 225, 225) bf16 map). Where a torch release no
# longer has it, the explicit path runs on autograd's own softmax (``explicit_attention``).
SOFTMAX_GRAD_INTO = getattr(torch.ops.aten._softmax_backward_data, "out", None)


def softmax_grad(dp: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The softmax's input gradient from its output ``p`` and output gradient ``dp``, in differentiable public ops."""
    return p * (dp - (dp * p).sum(dim=-1, keepdim=True))


# logits per chunk of the explicit path's batch: 2**21, 4 MiB in bf16, so that each chunk's scores stay in the CPU's
# cache from their product through the softmax to the values' product (and their buffers are reused, not freshly
# faulted in); at the recipe's 15 x 15 maps 41 images a chunk (each head in turn in the blocks' packed attention;
# 10 images of MHSA-2D's 4 heads together in :class:`_ExplicitAttention`)
CHUNK_LOGITS = 2**21


def spans(total: int, per_item: int) -> List[Tuple[int, int]]:
    """``[start, stop)`` spans of ``total`` items, each holding at most :data:`CHUNK_LOGITS` logits (one item at least)."""
    size = max(1, CHUNK_LOGITS // max(1, per_item))
    return [(i, min(i + size, total)) for i in range(0, total, size)]


class _ExplicitAttention(torch.autograd.Function):
    """``softmax(q [k, keys]^T * scale) v`` for the explicit bf16 path, in chunks of the leading dimension
    (:data:`CHUNK_LOGITS` logits each), the softmax computed in place over each chunk's logits and, backward, its
    gradient in place over the chunk's probability gradient. A ``(B, n, N, N)`` score tensor in one piece is
    ~200 MB at MHSA-2D's 15 x 15 maps: each fresh allocation of it costs the CPU its page faults and each pass over
    it a trip to memory; in cache-sized chunks the attention's forward and backward take about 0.4-0.6x the time of
    autograd over the same ops in one piece (``python -m bench.bf16_profile --only nonlocal mhsa2d`` shows the ops).
    ``keys``: constant key columns after ``k``'s (MHSA-2D's one-hot rows and columns), widened chunk by chunk and
    given no gradient, so the keys' gradient is formed for ``k``'s columns alone. The same operations otherwise
    (autograd's values to bf16 rounding). The chunks' probabilities come back as outputs without a gradient, to be
    saved; with ``create_graph`` the backward forms them again from the inputs in differentiable ops (a double
    backward holds). ``torch.func``: ``vmap`` runs the batch through the function at once, unchunked (attention is
    independent across leading dimensions), ``grad`` and its kin through ``setup_context``."""

    @staticmethod
    def forward(q, k, v, scale: float, keys: Optional[torch.Tensor], chunked: bool = True):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        probs = []
        for i, j in _ExplicitAttention.spans(q, k, chunked):
            qs = q[i:j] * scale if scale != 1.0 else q[i:j]
            logits = torch.matmul(qs, with_keys(k[i:j], keys).transpose(-2, -1))  # the keys widened chunk by chunk
            probs.append(torch.softmax(logits, -1, out=logits))  # in place: the logits are not needed again
            torch.matmul(probs[-1], v[i:j], out=out[i:j])
        return (out, *probs)

    @staticmethod
    def spans(q: torch.Tensor, k: torch.Tensor, chunked: bool) -> List[Tuple[int, int]]:
        """The chunks of ``q``'s leading dimension (one, unchunked, under ``vmap``: its rule hands the mapped
        dimension over as the leading one, and each output must span it whole)."""
        return spans(q.shape[0], q[0].numel() // q.shape[-1] * k.shape[-2]) if chunked else [(0, q.shape[0])]

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        q, k, v, scale, keys, *chunked = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)  # the probabilities get no gradient: no zero tensors for them
        ctx.scale = scale
        ctx.chunked = chunked[0] if chunked else True
        ctx.save_for_backward(q, k, v, keys, *output[1:])

    @staticmethod
    def backward(ctx, g: Optional[torch.Tensor], *_):
        q, k, v, keys, *saved = ctx.saved_tensors
        if g is None:
            return None, None, None, None, None, None
        scale, need = ctx.scale, ctx.needs_input_grad
        if torch.is_grad_enabled():  # a double backward: the saved tensors have no history, so form them again
            kf = with_keys(k, keys)
            p = torch.matmul(q * scale, kf.transpose(-2, -1)).softmax(dim=-1)
            ds = softmax_grad(torch.matmul(g, v.transpose(-2, -1)), p)
            dq = torch.matmul(ds, kf) * scale if need[0] else None
            dk = torch.matmul(ds.transpose(-2, -1), q[..., : k.shape[-1]] * scale) if need[1] else None
            dv = torch.matmul(p.transpose(-2, -1), g) if need[2] else None
            return dq, dk, dv, None, None, None
        dq = q.new_empty(q.shape) if need[0] else None
        dk = k.new_empty(k.shape) if need[1] else None
        dv = v.new_empty(v.shape) if need[2] else None
        for (i, j), p in zip(_ExplicitAttention.spans(q, k, ctx.chunked), saved):
            dp = torch.matmul(g[i:j], v[i:j].transpose(-2, -1))
            ds = SOFTMAX_GRAD_INTO(dp, p, -1, p.dtype, grad_input=dp)  # in place over dp
            if dq is not None:
                torch.matmul(ds, with_keys(k[i:j], keys), out=dq[i:j])
                if scale != 1.0:
                    dq[i:j].mul_(scale)
            if dk is not None:
                qs = q[i:j, ..., : k.shape[-1]]
                torch.matmul(ds.transpose(-2, -1), qs * scale if scale != 1.0 else qs, out=dk[i:j])
            if dv is not None:
                torch.matmul(p.transpose(-2, -1), g[i:j], out=dv[i:j])
        return dq, dk, dv, None, None, None

    @staticmethod
    def vmap(info, in_dims, q, k, v, scale, keys, chunked=True):
        if in_dims[4] is not None:  # the constant key columns differ along the mapped dimension: one by one
            outs = [_ExplicitAttention.apply(*(t if d is None else t.select(d, i) for t, d in zip((q, k, v), in_dims)),
                                             scale, keys.select(in_dims[4], i), False) for i in range(info.batch_size)]
            return tuple(torch.stack(o) for o in zip(*outs)), (0,) * len(outs[0])

        def front(t: torch.Tensor, d: Optional[int]) -> torch.Tensor:
            return t.movedim(d, 0) if d is not None else t.expand(info.batch_size, *t.shape)

        outs = _ExplicitAttention.apply(front(q, in_dims[0]), front(k, in_dims[1]), front(v, in_dims[2]), scale, keys,
                                        False)
        return outs, (0,) * len(outs)


class _PackedAttention(torch.autograd.Function):
    """The explicit bf16 attention of a block's packed projection, from its tokens laid out per head:
    ``parts`` ``(3, n, B, N, d)`` (queries, keys and values, ``n`` heads of ``d`` each: :func:`_parts` of the
    ``(B, N, 3 n d)`` tokens one linear map writes) -> the attention's output tokens ``(B, N, n d)``, and, backward,
    the gradient of ``parts`` as one tensor. What :class:`_ExplicitAttention` computes, with the copies that
    surrounded it gone: every step's queries, keys and values are dense blocks of ``parts``, which torch's bf16
    matmuls take as they are (an operand whose rows lie ``3 n d`` apart, read where the projection wrote it, is
    cloned by the matmul at every step: about 7 copies a step); the outputs and gradients are written into dense
    blocks, the outputs put into the token layout in one pass (none for the output of one head). ``parts`` is formed outside
    (:func:`packed_attention`), as a differentiable copy whose backward is the one pass of the gradient back into
    the token layout and which keeps nothing: the function saves ``parts`` alone. One head of a chunk of images at
    a time (each chunk :data:`CHUNK_LOGITS` logits, in cache from their product to the values' product); ``scale``
    is applied by the matmuls (no pass over the queries or their gradient).

    ``rel``: extra logits ``rel[b, h] @ keys^T`` added before scaling, from ``(B, n, N, e)`` query columns (given a
    gradient) and constant ``(N, e)`` key columns: MHSA-2D's relative logits and the one-hot rows and columns of its
    keys, folded step by step into widened queries and keys (:class:`_Fold`), so that one matmul forms both parts of
    the logits (it measured faster than a second matmul accumulating onto them)."""

    @staticmethod
    def forward(parts, heads: int, scale: float, rel: Optional[torch.Tensor], keys: Optional[torch.Tensor],
                chunked: bool = True):
        _, _, B, N, d = parts.shape
        out = parts.new_empty(heads, B, N, d)  # each head's output, dense
        probs = []
        fold = _Fold(parts, rel, keys, chunked)
        for (i, j), h in _packed_steps(B, N, heads, chunked):
            q, k, v = fold(parts, rel, i, j, h)
            logits = torch.baddbmm(parts.new_empty(()), q, k.transpose(1, 2), beta=0.0, alpha=scale)
            probs.append(torch.softmax(logits, -1, out=logits))  # in place: the logits are not needed again
            torch.bmm(probs[-1], v, out=out[h, i:j])
        # tokens (B, N, n d): one head's output is already laid out so
        return (out[0] if heads == 1 else out.permute(1, 2, 0, 3).reshape(B, N, heads * d), *probs)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        parts, heads, scale, rel, keys, *chunked = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)  # the probabilities get no gradient: no zero tensors for them
        ctx.heads, ctx.scale = heads, scale
        ctx.chunked = chunked[0] if chunked else True  # False from the vmap rule: one chunk, every head
        ctx.save_for_backward(parts, rel, keys, *output[1:])

    @staticmethod
    def backward(ctx, g: Optional[torch.Tensor], *_):
        parts, rel, keys, *saved = ctx.saved_tensors
        if g is None:
            return (None,) * 6
        heads, scale, need = ctx.heads, ctx.scale, ctx.needs_input_grad
        _, _, B, N, d = parts.shape
        if torch.is_grad_enabled():  # a double backward: the plain ops formed again and differentiated with a graph
            wanted = [t for t, w in zip((parts, rel), (need[0], need[3])) if w]
            tokens = parts.permute(2, 3, 0, 1, 4).reshape(B, N, -1)
            grads = iter(torch.autograd.grad(_packed_plain(tokens, heads, scale, rel, keys), wanted, g,
                                             create_graph=True))
            return (next(grads) if need[0] else None, None, None, next(grads) if need[3] else None, None, None)
        g = g.reshape(B, N, heads, d).permute(2, 0, 1, 3).contiguous()  # (n, B, N, d): a view for one head
        dparts = torch.empty_like(parts) if need[0] else None
        drel = torch.empty_like(rel) if need[3] else None  # in rel's own layout
        dp = None
        chunked = ctx.chunked
        fold = _Fold(parts, rel, keys, chunked)
        for ((i, j), h), p in zip(_packed_steps(B, N, heads, chunked), saved):
            q, k, v = fold(parts, rel, i, j, h)
            gh = g[h, i:j]
            dp = torch.bmm(gh, v.transpose(1, 2), out=dp if dp is not None and dp.shape == p.shape else None)
            ds = SOFTMAX_GRAD_INTO(dp, p, -1, p.dtype, grad_input=dp)  # in place over dp
            dq, dk, dv = (dparts[part, h, i:j] for part in range(3)) if dparts is not None else (None,) * 3
            if dq is not None or drel is not None:  # the folded queries' gradient: q's columns, then rel's
                if rel is None:
                    torch.baddbmm(ds.new_empty(()), ds, k, beta=0.0, alpha=scale, out=dq)
                else:
                    dqf = torch.baddbmm(ds.new_empty(()), ds, k, beta=0.0, alpha=scale, out=fold.grad(j - i))
                    if dq is not None:
                        dq.copy_(dqf[..., : fold.d])
                    if drel is not None:
                        drel[i:j, h].copy_(dqf[..., fold.d: fold.d + rel.shape[-1]])
            if dparts is not None:
                _transposed_product(ds, parts[0, h, i:j], scale, dk)  # the dense queries, not the folded ones
                _transposed_product(p, gh, 1.0, dv)
        return dparts, None, None, drel, None, None

    @staticmethod
    def vmap(info, in_dims, parts, heads, scale, rel, keys, chunked=True):
        """The mapped dimension merged into the batch (the images are independent), in one chunk per head."""
        if in_dims[4] is not None:
            raise NotImplementedError("packed attention: the constant key columns cannot vary along a vmap")
        V = info.batch_size

        def merged(t: Optional[torch.Tensor], d: Optional[int], batch: int) -> Optional[torch.Tensor]:
            """``t`` with the mapped dimension just before its batch dimension ``batch``, merged into it."""
            if t is None:
                return None
            t = t.movedim(d, batch) if d is not None else t.unsqueeze(batch).expand(*t.shape[:batch], V,
                                                                                     *t.shape[batch:])
            return t.flatten(batch, batch + 1)

        outs = _PackedAttention.apply(merged(parts, in_dims[0], 2), heads, scale, merged(rel, in_dims[3], 0), keys,
                                      False)
        return tuple(o.view(V, o.shape[0] // V, *o.shape[1:]) for o in outs), (0,) * len(outs)


def _transposed_product(a: torch.Tensor, b: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """``out = scale * a^T b`` for square ``(c, N, N)`` ``a`` and narrow ``(c, N, d)`` ``b`` (dense): for ``N >= 4 d``
    as ``out^T = b^T a``, whose matmul reads ``a`` untransposed: 0.75-0.9x the time at the recipe's 15 x 15 maps (d 16
    and 32), slower at 7 x 7 (d 64 and 128). The other form is written into ``out`` in place; the transposed one is
    copied in (into a transposed ``out`` the matmul falls back to a scalar loop)."""
    if a.shape[-1] >= 4 * b.shape[-1]:
        out.copy_(torch.baddbmm(a.new_empty(()), b.transpose(1, 2), a, beta=0.0, alpha=scale).transpose(1, 2))
    else:
        torch.baddbmm(a.new_empty(()), a.transpose(1, 2), b, beta=0.0, alpha=scale, out=out)


def _packed_steps(B: int, N: int, heads: int, chunked: bool) -> List[Tuple[Tuple[int, int], int]]:
    """``((start, stop), head)`` of each step: the chunks of the batch (one under ``vmap``: its rule merges the mapped
    dimension into the batch), each head in turn."""
    return [(span, h) for span in (spans(B, N * N) if chunked else [(0, B)]) for h in range(heads)]


def _parts(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, N, 3 n d)`` tokens -> ``(3, n, B, N, d)``, contiguous: each part's head a dense ``(B, N, d)`` block,
    and so every chunk of its images."""
    B, N, width = qkv.shape
    return qkv.unflatten(-1, (3, heads, width // (3 * heads))).permute(2, 3, 0, 1, 4).contiguous()


class _Fold:
    """Each step's queries, keys and values for :class:`_PackedAttention` from the ``(3, n, B, N, d)`` parts: their
    dense blocks without ``rel``; with it, the queries widened by ``rel``'s columns and the keys by the constant
    ``keys`` (zero columns pad both to a multiple of 8), in two buffers reused across steps, the constant columns
    written once."""

    def __init__(self, parts: torch.Tensor, rel: Optional[torch.Tensor], keys: Optional[torch.Tensor],
                 chunked: bool):
        if rel is None:
            return
        _, _, B, N, d = parts.shape
        e = rel.shape[-1]
        rows = max(j - i for (i, j), _ in _packed_steps(B, N, 1, chunked))
        self.q = parts.new_zeros(rows, N, -(-(d + e) // 8) * 8)
        self.k = torch.zeros_like(self.q)
        self.d, self.dq = d, None
        self.k[:, :, d: d + e] = keys.to(parts.dtype)

    def grad(self, c: int) -> torch.Tensor:
        """A reused buffer for ``c`` images' widened queries' gradient."""
        if self.dq is None:
            self.dq = torch.empty_like(self.q)
        return self.dq[:c]

    def __call__(self, parts: torch.Tensor, rel: Optional[torch.Tensor], i: int, j: int, h: int):
        q, k, v = (parts[part, h, i:j] for part in range(3))
        if rel is None:
            return q, k, v
        d, c = q.shape[-1], j - i
        fq, fk = self.q[:c], self.k[:c]
        fq[..., :d].copy_(q)
        fq[..., d: d + rel.shape[-1]].copy_(rel[i:j, h])
        fk[..., :d].copy_(k)
        return fq, fk, v


def _unpack(qkv: torch.Tensor, heads: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(B, N, 3 n d)`` tokens -> ``q, k, v``, each ``(B, n, N, d)`` (views)."""
    B, N, three_c = qkv.shape
    return qkv.view(B, N, 3, heads, three_c // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)


def _packed_plain(qkv: torch.Tensor, heads: int, scale: float, rel: Optional[torch.Tensor],
                  keys: Optional[torch.Tensor]) -> torch.Tensor:
    """:class:`_PackedAttention`'s output in plain differentiable ops."""
    q, k, v = _unpack(qkv, heads)
    B, n, N, _ = q.shape
    logits = torch.matmul(q, k.transpose(-2, -1))
    if rel is not None:
        logits = logits + torch.matmul(rel, keys.to(rel.dtype).t())
    y = (logits * scale).softmax(dim=-1) @ v  # (B, n, N, d)
    return y.transpose(1, 2).reshape(B, N, -1)


def packed_attention(qkv: torch.Tensor, heads: int, scale: float, rel: Optional[torch.Tensor] = None,
                     keys: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``softmax(scale * (q k^T + rel keys^T)) v`` per head from packed ``(B, N, 3 n d)`` tokens, as ``(B, N, n d)``
    tokens: the blocks' explicit bf16 path (:func:`explicit_bf16`), through :class:`_PackedAttention` where a graph
    is recorded outside ``torch.compile``, else in plain ops."""
    if (torch.is_grad_enabled() and (qkv.requires_grad or (rel is not None and rel.requires_grad))
            and SOFTMAX_GRAD_INTO is not None and not torch.compiler.is_compiling()):
        return _PackedAttention.apply(_parts(qkv, heads), heads, scale, rel, keys)[0]
    return _packed_plain(qkv, heads, scale, rel, keys)


def with_keys(k: torch.Tensor, keys: Optional[torch.Tensor]) -> torch.Tensor:
    """``k`` with the constant ``(N, e)`` key columns ``keys`` after its own (every batch and head), or ``k``."""
    if keys is None:
        return k
    return torch.cat([k, keys.to(k.dtype).expand(*k.shape[:-1], keys.shape[-1])], dim=-1)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       keys: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``softmax(q [k, keys]^T * scale) v`` written out in the inputs' dtype; through :class:`_ExplicitAttention`
    where a graph is recorded outside ``torch.compile`` (which fuses the same ops itself), else in plain ops."""
    if (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            and SOFTMAX_GRAD_INTO is not None and not torch.compiler.is_compiling()
            and q.dim() == k.dim() == v.dim() and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        return _ExplicitAttention.apply(q, k, v, scale, keys)[0]
    return ((q * scale) @ with_keys(k, keys).transpose(-2, -1)).softmax(dim=-1) @ v


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` with queries and keys ``(B, n, N, dq)`` and values ``(B, n, N, dv)``.

    On a CPU with native bf16 and bf16 inputs (the recipe's autocast), written out in bf16 (:func:`explicit_bf16`):
    two bf16 matmuls that accumulate in fp32 and a softmax that computes in fp32 and rounds its output to bf16, as
    an unfused attention runs under autocast, in cache-sized chunks of the batch (:class:`_ExplicitAttention`). The
    CPU's fused kernel runs bf16 slower than fp32, and :func:`~visattn.attention.functional.sdpa` casts to fp32 for
    it: on the recipe's maps (15 x 15, 7 x 7, 3 x 3; batch 512) the whole block's forward and backward take 0.6,
    0.8, 0.8x the time through the fp32 kernel for the non-local block and 0.4, 0.7, 0.7x for MHSA-2D (4 heads,
    its folded queries and keys 48 wide, values 16 and unpadded). Double backward holds on it.

    Otherwise :func:`~visattn.attention.functional.sdpa`, the three zero-padded to one head size, a multiple of 8
    (the fused flash kernels need equal sizes and run faster on multiples of 8; zero columns change no dot
    product), the output cut back to ``dv``."""
    if explicit_bf16(q, k):
        return explicit_attention(q, k, v, scale)
    dq, dv = q.shape[-1], v.shape[-1]
    size = -(-max(dq, dv) // 8) * 8
    if size != dq:
        q, k = F.pad(q, (0, size - dq)), F.pad(k, (0, size - dq))
    if size == dv:
        return sdpa(q, k, v, scale=scale)
    out = sdpa(q, k, F.pad(v, (0, size - dv)), scale=scale)  # (B, n, N, size), laid out (B, N, n, size)
    # cut in the layout the fused kernels write: the cut's backward then builds its zero-padded gradient in that
    # layout too, and the kernel's backward reads it without a copy
    return out.transpose(1, 2)[..., :dv].transpose(1, 2)


def _to_map(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``(B, heads, N, d)`` attention output -> ``(B, heads * d, H, W)`` in the memory format of ``like``
    (mixing formats would send the BN that follows down a slow path).

    One explicit copy into the target layout, then a view: a bare ``reshape`` of SDPA's output is recorded
    by ``torch.export`` as a view chosen for the fused kernel's strides, which ONNX export's decomposed
    attention does not reproduce ("Cannot view a tensor ...")."""
    B, n, N, d = y.shape
    H, W = like.shape[-2:]
    if is_channels_last(like):
        y = y.transpose(1, 2).clone(memory_format=torch.contiguous_format)  # (B, N, heads, d)
        return y.view(B, H, W, n * d).permute(0, 3, 1, 2)  # channels-last strided
    return y.transpose(2, 3).clone(memory_format=torch.contiguous_format).view(B, n * d, H, W)


# the fewest positions from which a block's projection runs as a 1x1 convolution of its linear layer's weight (for
# channels-last input): forward and backward of the recipe's projections took 0.67-0.97x the linear layer's time at
# 15 x 15 and 7 x 7 in bf16 and fp32 (AVX512-BF16), but 1.0-1.2x at 3 x 3
CONV_FROM = 16


class ResidualSelfAttention2d(nn.Module):
    """What both blocks share: the input checks, the attention and its tap, and the output path
    ``x + norm(proj(y))`` that starts at zero."""

    def zero_init_last(self) -> None:
        """The output path starts at zero: the norm's scale and shift where it has them (both inits), else, with
        ``init="identity"``, the output projection. Also timm's hook."""
        if getattr(self.norm, "weight", None) is not None:
            zero_(self.norm.weight, getattr(self.norm, "bias", None))  # the block starts as the identity
        elif self.init == "identity":
            zero_(self.proj.weight, self.proj.bias)

    def qkv_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The checked ``(B, C, H, W)`` input's ``qkv`` projection per position, ``(B, N, 3 * width)``."""
        check_feature_map(self, x, self.channels)
        check_norm_batch(self, self.norm, x.shape[0] * x.shape[2] * x.shape[3], x)
        if is_channels_last(x) and x.shape[2] * x.shape[3] >= CONV_FROM:
            # as a 1x1 convolution, whose channels-last output is the tokens (a view): its backward forms the bias's
            # gradient inside the kernel, where the linear layer's sums the tokens' gradient in a pass of its own
            w = self.qkv.weight
            y = F.conv2d(x, w.view(*w.shape, 1, 1), self.qkv.bias)
            return y.permute(0, 2, 3, 1).flatten(1, 2)
        return self.qkv(x.flatten(2).transpose(1, 2))  # tokens: a view

    def attend(self, q, k, v, H: int, W: int) -> torch.Tensor:
        """Softmax attention, scores ``q k^T * self.scale``: ``(B, n, N, dq)`` queries and keys, ``(B, n, N, dv)``
        values -> ``(B, n, N, dv)``."""
        if self.tap.active:  # autocast off: under bf16/fp16 autocast the matmuls would run (and round) in it
            with torch.autocast(device_type=q.device.type, enabled=False):
                acc = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 input
                logits = (q.to(acc) * self.scale) @ k.to(acc).transpose(-2, -1)  # (B, n, N, N)
                attn = self.tap(logits.softmax(dim=-1), grid=(H, W), num_prefix_tokens=0)
                return (attn @ v.to(acc)).to(v.dtype)
        return fused_attention(q, k, v, self.scale)

    def output(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.proj(_to_map(y, x)))

    def output_tokens(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """:meth:`output` from ``(B, N, C')`` attention output tokens: for a channels-last ``x`` a view, no copy."""
        B, _, H, W = x.shape
        y = y.view(B, H, W, y.shape[-1]).permute(0, 3, 1, 2)
        return x + self.norm(self.proj(y if is_channels_last(x) else y.contiguous()))


SCALE_BY = ("inter", "channels")


@register_attention("nonlocal", layout="feature", kind="token")
class NonLocal2d(ResidualSelfAttention2d):
    """Non-local block, embedded Gaussian (Wang, Girshick, Gupta, He, 2018, arXiv 1711.07971).

    ``theta``, ``phi``, ``g``: 1x1 convs ``C -> C * rd_ratio`` (the paper halves the width), one linear map
    ``qkv`` over the position tokens; ``softmax(theta^T phi)`` weights ``g``; ``z = BN(W_z y) + x`` with the
    BN scale zero-initialised, so the block starts as the identity. ``use_scale`` divides the logits by
    ``sqrt(C * rd_ratio)`` as the paper's code does (``scale_by="inter"``); ``scale_by="channels"`` divides
    them by ``sqrt(C)`` instead, as the BAT authors' code and timm's ``NonLocalAttn`` ('nl') do.

    timm's ``NonLocalAttn`` is this block with ``rd_channels=make_divisible(C / 8, 8)`` and
    ``scale_by="channels"``: the same function (its ``t``, ``p``, ``g`` convs are the rows of ``qkv`` here).

    Double backward (gradient penalties): the fused SDPA kernels have none; run the block under
    ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``.
    """

    PAPER = "Wang, Girshick, Gupta, He, 2018, Non-local Neural Networks, arXiv 1711.07971"
    CHECKED_AGAINST = ("timm NonLocalAttn (t, p, g stacked into qkv; scale_by='channels' as timm), and double "
                       "backward against it (float64)")
    IDENTITY = "x + BN(W_z y) with the BN scale and shift zero in either init (the output conv without a norm)"

    def __init__(self, channels: int, rd_ratio: float = 1.0 / 2, rd_channels: Optional[int] = None,
                 use_scale: bool = True, scale_by: str = "inter", norm_layer: Type[nn.Module] = nn.BatchNorm2d,
                 init: str = "default"):
        super().__init__()
        check_channels(channels)
        self.init = check_init(init)
        if scale_by not in SCALE_BY:
            raise ValueError(f"nonlocal: unknown scale_by {scale_by!r}; valid: {', '.join(SCALE_BY)}")
        inter = reduced_channels(channels, rd_ratio, rd_channels, 1)
        self.channels = channels
        self.inter_channels = inter
        self.scale = (inter if scale_by == "inter" else channels) ** -0.5 if use_scale else 1.0
        self.qkv = nn.Linear(channels, 3 * inter)  # theta, phi, g stacked, applied per position
        self.proj = nn.Conv2d(inter, channels, kernel_size=1)  # W_z
        self.norm = norm_layer(channels)
        self.tap = AttentionTap("token")
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for layer in (self.qkv, self.proj):
            nn.init.kaiming_normal_(layer.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(layer.bias)
        self.zero_init_last()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_tokens(x)  # (B, N, 3d)
        B, C, H, W = x.shape
        d = self.inter_channels
        q, k, v = qkv.view(B, 1, H * W, 3 * d).split(d, dim=-1)  # (B, 1, N, d) each
        if not self.tap.active and explicit_bf16(q, k):  # bf16 on a native-bf16 CPU: from the packed tokens
            return self.output_tokens(x, packed_attention(qkv, 1, self.scale))
        return self.output(x, self.attend(q, k, v, H, W))  # attention output (B, 1, N, d)


def _rel_table(table: torch.Tensor, size: int) -> torch.Tensor:
    """The ``2 * size - 1`` offsets ``-(size-1) .. size-1`` of a ``(2M - 1, d)`` table centred on offset 0:
    sliced when ``size <= M``, linearly resampled when the map is larger than the table."""
    M = (table.shape[0] + 1) // 2
    if size <= M:
        return table[M - size : M + size - 1]
    return F.interpolate(table.t()[None], size=2 * size - 1, mode="linear", align_corners=True)[0].t()


def rel_pos_embed(table: torch.Tensor, size: int) -> torch.Tensor:
    """``(size, size, d)`` embeddings ``E[i, j] = table[offset j - i]`` for one axis."""
    t = _rel_table(table, size)
    pos = torch.arange(size, device=table.device)
    return t[pos[None, :] - pos[:, None] + size - 1]


def rel_keys(H: int, W: int, pad: int, like: torch.Tensor) -> torch.Tensor:
    """The constant key columns of the relative logits, ``(H W, H + W + pad)``: key ``j``'s row one-hot, its
    column one-hot, ``pad`` zeros."""
    N = H * W
    rows = torch.eye(H, dtype=like.dtype, device=like.device)[:, None, :].expand(H, W, H).reshape(N, H)
    cols = torch.eye(W, dtype=like.dtype, device=like.device)[None, :, :].expand(H, W, W).reshape(N, W)
    return torch.cat([rows, cols, rows.new_zeros(N, pad)], dim=1)


@register_attention("mhsa2d", layout="feature", kind="token")
class MHSA2d(ResidualSelfAttention2d):
    """Multi-head self-attention over H x W with relative-position logits (BoTNet: Srinivas et al., 2021,
    arXiv 2101.11605).

    ``q, k, v``: a 1x1 projection per position (no bias, as in BoTNet), ``num_heads`` heads. Logits
    ``q k^T + q r^T`` with ``r`` relative-position embeddings, one table per axis shared by the heads (Bello
    et al., 2019, arXiv 1904.09925), folded into the queries and keys (:meth:`with_rel_pos`) so that the
    attention runs as one (:func:`fused_attention`), with no ``(B, heads, N, N)`` bias; maps larger than ``max_size`` use a linearly
    resampled table. Wrapped as ``x + BN(proj(y))`` with the BN scale
    zero-initialised, so the block starts as the identity.

    ``scale_pos``: whether ``1/sqrt(d)`` scales the relative logits too, ``scale * (q k^T + q r^T)`` (the
    BoTNet authors' reference gist scales ``q`` before both; the default), or only the content logits,
    ``scale * q k^T + q r^T`` (timm's ``BottleneckAttn`` default, ``scale_pos_embed=False``). ``y`` is
    timm's ``BottleneckAttn`` output ('bottleneck': its ``scale_pos_embed`` is ``scale_pos`` here, its
    ``height_rel`` / ``width_rel`` the centre rows of ``rel_h`` / ``rel_w``); timm's module is that
    attention alone, a convolution replacement with a fixed ``feat_size`` and no residual, projection or norm.

    Double backward (gradient penalties): the fused SDPA kernels have none; run the block under
    ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``.
    """

    PAPER = ("Srinivas, Lin, Parmar, Shlens, Abbeel, Vaswani, 2021, Bottleneck Transformers for Visual "
             "Recognition, arXiv 2101.11605")
    CHECKED_AGAINST = ("timm BottleneckAttn as y (scale_pos both ways, rel tables centred), and an explicit "
                       "per-pair reference for double backward (float64)")
    IDENTITY = "x + BN(proj(y)) with the BN scale and shift zero in either init (the projection without a norm)"

    def __init__(self, channels: int, num_heads: int = 4, qkv_bias: bool = False, max_size: int = 32,
                 scale_pos: bool = True, norm_layer: Type[nn.Module] = nn.BatchNorm2d, init: str = "default"):
        super().__init__()
        check_channels(channels)
        self.init = check_init(init)
        if not isinstance(scale_pos, bool):
            raise ValueError(f"mhsa2d: scale_pos must be True or False, got {scale_pos!r}")
        self.scale_pos = scale_pos
        positive_int("num_heads", num_heads, divides=channels)
        positive_int("max_size", max_size)
        self.channels = channels
        self.num_heads = num_heads
        self.head_dim = channels // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(channels, 3 * channels, bias=qkv_bias)  # 1x1 conv, applied per position
        self.rel_h = nn.Parameter(torch.empty(2 * max_size - 1, self.head_dim))  # height offsets
        self.rel_w = nn.Parameter(torch.empty(2 * max_size - 1, self.head_dim))  # width offsets
        self.proj = nn.Conv2d(channels, channels, kernel_size=1)
        self.norm = norm_layer(channels)
        self.tap = AttentionTap("token")
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.rel_h, std=self.scale)
        nn.init.normal_(self.rel_w, std=self.scale)
        self.zero_init_last()

    def rel_parts(self, q: torch.Tensor, H: int, W: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(B, n, N, d)`` queries -> the folded queries ``(B, n, N, d + H + W + pad)`` and the constant key columns
        ``(N, H + W + pad)`` of :meth:`with_rel_pos`."""
        B, n, N, d = q.shape
        qg = q.reshape(B, n, H, W, d)
        e_h = rel_pos_embed(self.rel_h, H).to(q.dtype)  # (H, H, d)
        e_w = rel_pos_embed(self.rel_w, W).to(q.dtype)  # (W, W, d)
        # batched matmuls broadcast over (B, n) (an einsum here lowers to a view ONNX export cannot take)
        lh = qg @ e_h.transpose(1, 2)  # (B, n, H, W, d) @ (H, d, H) -> (B, n, H, W, H): key row
        lw = (qg.transpose(2, 3) @ e_w.transpose(1, 2)).transpose(2, 3)  # (B, n, H, W, W): key column
        if not self.scale_pos:  # the attention scales every logit: undo it on the relative ones
            lh, lw = lh / self.scale, lw / self.scale
        pad = -(d + H + W) % 8
        keys = rel_keys(H, W, pad, q)
        queries = [q, lh.reshape(B, n, N, H), lw.reshape(B, n, N, W), q.new_zeros(B, n, N, pad)]
        return torch.cat(queries, dim=-1), keys

    def rel_logits(self, qkv: torch.Tensor, H: int, W: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The relative logits of the packed ``(B, N, 3C)`` tokens' queries before scaling, for every key row and
        every key column, ``(B, n, N, H + W)`` (a view), and their constant key columns ``(N, H + W)``
        (:meth:`rel_parts`' without padding): ``rel @ keys^T`` is ``q_i r_ij``. One batched matmul over the
        positions, each query position against its own ``H + W`` offsets (its row's in ``rel_h``, its column's in
        ``rel_w``), not one per image, head and row."""
        B, N = qkv.shape[:2]
        n, d = self.num_heads, self.head_dim
        # (N, n B, d): for each position and head, the chunk of images each step of the attention reads lies together
        q = qkv.view(B, N, 3, n, d)[:, :, 0].permute(1, 2, 0, 3).reshape(N, n * B, d)
        e_h = rel_pos_embed(self.rel_h, H).to(qkv.dtype)  # (H, H, d): query row, key row
        e_w = rel_pos_embed(self.rel_w, W).to(qkv.dtype)  # (W, W, d): query column, key column
        table = torch.cat([e_h[:, None].expand(H, W, H, d), e_w[None].expand(H, W, W, d)], dim=2)  # (H, W, H + W, d)
        rel = torch.bmm(q, table.view(N, H + W, d).transpose(1, 2))  # (N, n B, H + W)
        if not self.scale_pos:  # the attention scales every logit: undo it on the relative ones
            rel = rel / self.scale
        return rel.view(N, n, B, H + W).permute(2, 1, 0, 3), rel_keys(H, W, 0, qkv)

    def with_rel_pos(self, q: torch.Tensor, k: torch.Tensor, H: int, W: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(B, n, N, d)`` queries and keys -> ``(B, n, N, d + H + W + pad)`` ones whose dot product is BoTNet's
        logit before scaling, ``q_i k_j + q_i r_ij`` with ``r_ij = rel_h[h_j - h_i] + rel_w[w_j - w_i]``: query ``i``
        carries its relative logits for every key row and every key column, key ``j`` the one-hot of its row and
        column, and zero columns pad the size to a multiple of 8. The attention then needs no ``(B, n, N, N)``
        bias and runs fused: SDPA sends an ``attn_mask`` that needs a gradient to its unfused math kernel."""
        queries, keys = self.rel_parts(q, H, W)
        return queries, with_keys(k, keys)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_tokens(x)  # (B, N, 3C)
        B, C, H, W = x.shape
        n = self.num_heads
        q, k, v = _unpack(qkv, n)  # (B, n, N, d) each
        if not self.tap.active and explicit_bf16(q, k):
            # bf16 on a native-bf16 CPU: from the packed tokens, the relative logits and their one-hot key columns
            # handed over as extra columns (widened chunk by chunk; no gradient formed for the constant ones)
            rel, keys = self.rel_logits(qkv, H, W)
            return self.output_tokens(x, packed_attention(qkv, n, self.scale, rel, keys))
        q, k = self.with_rel_pos(q, k, H, W)  # (B, n, N, d + H + W + pad)
        return self.output(x, self.attend(q, k, v, H, W))  # attention output (B, n, N, d)

"""Token self-attention blocks, ``(B, N, D) -> (B, N, D)``, and CCT's sequence-pooling head.

* ``mhsa``: multi-head self-attention (Vaswani et al., 2017, "Attention Is All You Need", arXiv 1706.03762)
  with a choice of score function and an optional inference-time hard (top-k / argmax) attention.
* ``lsa``: locality self-attention (Lee, Lee, Song, 2021, "Vision Transformer for Small-Size Datasets",
  arXiv 2112.13492).
* ``seqpool``: sequence pooling (Hassani et al., 2021, "Escaping the Big Data Paradigm with Compact
  Transformers", arXiv 2104.05704), ``(B, N, D) -> (B, D)``, registered as ``layout="token", kind="pool"``.

The blocks carry ``tap_grid`` (``(H, W)`` of the last ``H*W`` tokens, or ``None``) and ``num_prefix_tokens``,
set by the model at construction, so ``forward(x)`` alone always works. The default path is fused SDPA; when
``tap.active`` the weights are computed explicitly in fp32 and the *same* tensor multiplies ``V``, so what is
recorded is what was applied (before attention dropout). Plain PyTorch (compile, export, ONNX, trace,
``torch.func``); double backward under ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import register_attention
from .functional import init_linears, positive_int, sdpa
from .tap import AttentionTap

__all__ = ["MultiHeadSelfAttention", "LocalitySelfAttention", "SequencePooling", "SCORES", "SDPA_CPU_MODES",
           "POS_BIASES", "GATES", "sdpa_cpu_mode", "matmul_attention"]

SCORES = ("scaled_dot", "dot", "general", "additive")
SDPA_CPU_MODES = ("fp32", "native", "matmul")  # the fast path's CPU attention (see sdpa_cpu_mode)
POS_BIASES = ("none", "local")
GATES = ("none", "head", "element")  # mhsa's output gate (Qiu et al. 2025): off, one per head, one per channel

Grid = Optional[Tuple[int, int]]
Hard = Union[None, str, int]


def _check_grid(grid: Grid) -> Grid:
    if grid is None:
        return None
    if len(grid) != 2 or any(int(g) < 1 for g in grid):
        raise ValueError(f"grid must be None or (H, W) with H, W >= 1, got {grid!r}")
    return int(grid[0]), int(grid[1])


def _check_hard(hard: Hard) -> Hard:
    # bool is an int subclass; hard=True would silently mean top-1, so it is refused.
    if hard is None or hard == "argmax":
        return hard
    if isinstance(hard, int) and not isinstance(hard, bool) and hard >= 1:
        return hard
    raise ValueError(f"hard must be None, 'argmax' or an int k >= 1, got {hard!r}")


def _check_tokens(block: nn.Module, n: int) -> None:
    """The tap's grid must describe the sequence it is given (checked on recording passes only)."""
    if block.tap_grid is not None:
        h, w = block.tap_grid
        if h * w + block.num_prefix_tokens != n:
            raise ValueError(
                f"{type(block).__name__}: grid {block.tap_grid} with {block.num_prefix_tokens} prefix "
                f"token(s) needs {h * w + block.num_prefix_tokens} tokens, got {n}"
            )


def _check_mask_args(attn_mask: Optional[torch.Tensor], is_causal: bool) -> None:
    if attn_mask is not None and is_causal:
        raise ValueError("pass attn_mask or is_causal=True, not both (as F.scaled_dot_product_attention)")


def mask_logits(logits: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool) -> torch.Tensor:
    """SDPA's mask semantics on explicit ``(..., N, M)`` logits: a bool mask keeps ``True`` entries (the
    others get ``-inf``), a float mask is added, ``is_causal`` keeps the lower triangle."""
    if is_causal:
        n, m = logits.shape[-2:]
        keep = torch.ones(n, m, dtype=torch.bool, device=logits.device).tril()
        return logits.masked_fill(~keep, float("-inf"))
    if attn_mask is None:
        return logits
    if attn_mask.dtype == torch.bool:
        return logits.masked_fill(~attn_mask, float("-inf"))
    return logits + attn_mask.to(logits.dtype)


def top_k_softmax(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Softmax over each row's ``k`` largest logits, zero elsewhere (``k=1`` is one-hot argmax).

    Equal to keeping the top-k softmax weights and renormalising them, but computed from the logits so the
    kept weights cannot underflow to zero. ``logits``: ``(..., N)``; ``k`` is clamped to ``N``.
    """
    k = min(k, logits.shape[-1])
    top, idx = logits.topk(k, dim=-1)  # (..., k)
    return torch.zeros_like(logits).scatter_(-1, idx, top.softmax(dim=-1))


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                     dropout_p: float = 0.0, scale: Optional[float] = None, is_causal: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` written out, ``softmax(q k^T * scale + mask) v``, in the inputs' (or
    autocast's) precision, with SDPA's arguments and mask semantics. It materialises the ``(B, heads, N, N)``
    weights, in exchange for one batched matmul per product instead of the CPU flash kernel's tiny per-head ones."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = mask_logits(torch.matmul(q * scale, k.transpose(-2, -1)), attn_mask, is_causal)
    attn = torch.softmax(logits, dim=-1)
    if dropout_p > 0:
        attn = F.dropout(attn, dropout_p)
    return torch.matmul(attn.to(v.dtype), v)


@contextlib.contextmanager
def sdpa_cpu_mode(mode: str) -> Iterator[None]:
    """Within the context, ``mhsa``/``lsa`` fast paths on a CPU run the flash kernel in fp32 (``"fp32"``, the
    default), in the inputs' precision (``"native"``), or :func:`matmul_attention` (``"matmul"``); a benchmark
    switch (``python -m bench.speed flops --sdpa``). A block's own ``sdpa_cpu`` wins; other devices run native SDPA."""
    if mode not in SDPA_CPU_MODES:
        raise ValueError(f"unknown sdpa_cpu mode {mode!r}; valid: {', '.join(SDPA_CPU_MODES)}")
    old = MultiHeadSelfAttention.sdpa_cpu
    MultiHeadSelfAttention.sdpa_cpu = mode
    try:
        yield
    finally:
        MultiHeadSelfAttention.sdpa_cpu = old


@register_attention("mhsa", layout="token", kind="token")
class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention over tokens, ``(B, N, D) -> (B, N, D)`` (Vaswani et al., 2017, arXiv 1706.03762).

    ``score`` picks the score function per head (``d`` = head dim): ``"scaled_dot"`` ``q k^T / sqrt(d)``
    (default) and ``"dot"`` ``q k^T``, both fused; ``"general"`` (Luong et al. 2015, arXiv 1508.04025)
    ``q W k^T`` with a learned per-head ``general_weight`` ``(heads, d, d)`` initialised to ``I / sqrt(d)``,
    fused by computing ``q W`` first; ``"additive"`` (Bahdanau et al. 2014, arXiv 1409.0473)
    ``v^T tanh(W q + U k)`` with learned ``additive_v`` ``(heads, d)``, always explicit: it materialises
    ``(B, heads, N, N, d)``.

    ``hard`` (``None``, ``"argmax"`` or an int ``k``): in eval mode each row keeps only its ``k`` largest
    weights, renormalised; ignored in training, so a model trains soft and can be evaluated hard. Explicit
    paths (tap active, hard, additive) compute the logits and softmax in fp32 with autocast off.

    Drop-in for timm's ``Attention``: the same ``forward(x, attn_mask=None, is_causal=False)`` with SDPA's
    mask semantics and the same parameter names (``qkv``, ``proj``), so its state dict loads strictly (set
    ``qkv_bias`` and ``proj_bias`` as the timm module has them).

    ``pos_bias="local"`` adds a learned relative-position bias ``b_h(i, j) = -a_h * |p_j - p_i - c_h|^2`` on
    the token grid (``grid`` is needed; prefix tokens get none), ``a_h = exp(pos_log_strength)`` (1 at init),
    the centres ``pos_center`` starting one token apart around the query (2x2 for 4 heads, 3x3 for 9), so
    each head starts as a local average (ConViT's convolution-like start, d'Ascoli et al. 2021, arXiv
    2103.10697, as an additive bias so the fused kernel still runs). ``"none"`` (the default): no bias.

    ``qk_norm=True``: LayerNorm over each head's ``d`` channels of ``q`` and ``k`` before the scores
    (``q_norm``, ``k_norm``; Dehghani et al., 2023, "Scaling Vision Transformers to 22 Billion Parameters",
    arXiv 2302.05442), as timm's ``Attention(qk_norm=True)``, whose state dict loads strictly.
    ``gate="head"`` or ``"element"``: the attention output (before ``proj``) is multiplied by
    ``sigmoid(gate_proj(x))``, one gate per head (``gate_proj``: ``dim -> heads``) or per channel
    (``dim -> dim``), computed from the block's input (Qiu et al., 2025, "Gated Attention for Large Language
    Models: Non-linearity, Sparsity, and Attention-Sink-Free", arXiv 2505.06708, the SDPA-output gate G1);
    ``"none"`` (the default): no gate.

    Double backward (gradient penalties): the fused SDPA kernels have none; run the block under
    ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``.

    Speed: the fast path (:meth:`_fused_packed`) splits the packed ``qkv`` into heads without copies;
    ``block.fast_path = False`` runs the baseline split (pinned equal by the tests). ``sdpa_cpu`` (class
    default ``"fp32"``; :func:`sdpa_cpu_mode`) picks the fast path's CPU kernel.
    """

    PAPER = ("Vaswani, Shazeer, Parmar, Uszkoreit, Jones, Gomez, Kaiser, Polosukhin, 2017, Attention Is All You "
             "Need, arXiv 1706.03762")
    CHECKED_AGAINST = ("timm Attention (state dict loaded strictly; qk_norm too), explicit softmax(q k^T) for "
                       "double backward (float64)")
    IDENTITY = "no init option: the ViT initialisation (truncated normal 0.02, zero biases)"

    fast_path = True  # False (per block): the baseline fused path, functional.sdpa on a permuted split of qkv
    sdpa_cpu = "fp32"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, score: str = "scaled_dot",
                 attn_drop: float = 0.0, proj_drop: float = 0.0, hard: Hard = None, grid: Grid = None,
                 num_prefix_tokens: int = 0, proj_bias: bool = True, pos_bias: str = "none",
                 qk_norm: bool = False, gate: str = "none"):
        super().__init__()
        if not isinstance(qk_norm, bool):
            raise ValueError(f"qk_norm must be True or False, got {qk_norm!r}")
        if gate not in GATES:
            raise ValueError(f"unknown gate {gate!r}; valid: {', '.join(GATES)}")
        positive_int("dim", dim)
        positive_int("num_heads", num_heads, divides=dim)
        if score not in SCORES:
            raise ValueError(f"unknown score {score!r}; valid: {', '.join(SCORES)}")
        if num_prefix_tokens < 0:
            raise ValueError(f"num_prefix_tokens must be >= 0, got {num_prefix_tokens}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.score = score
        self.hard = hard  # validated by the setter
        self.tap_grid = _check_grid(grid)
        self.num_prefix_tokens = int(num_prefix_tokens)

        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.qk_norm = qk_norm
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()  # timm's names and order
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.gate = gate
        self.gate_proj = None if gate == "none" else nn.Linear(dim, num_heads if gate == "head" else dim)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)
        if score == "general":
            eye = torch.eye(self.head_dim).expand(num_heads, -1, -1) / math.sqrt(self.head_dim)
            self.general_weight = nn.Parameter(eye.clone())  # (heads, d, d)
        elif score == "additive":
            self.additive_v = nn.Parameter(torch.randn(num_heads, self.head_dim) / math.sqrt(self.head_dim))
        self.pos_bias = pos_bias
        self._init_pos_bias()
        self.tap = AttentionTap("token")
        self.reset_parameters()

    def _init_pos_bias(self) -> None:
        if self.pos_bias not in POS_BIASES:
            raise ValueError(f"unknown pos_bias {self.pos_bias!r}; valid: {', '.join(POS_BIASES)}")
        if self.pos_bias == "none":
            return
        if self.tap_grid is None:
            raise ValueError("pos_bias='local' needs the token grid (grid=(H, W)): the bias is a function of position")
        h, w = self.tap_grid
        yx = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2).float()
        self.register_buffer("pos_offsets", yx[None, :, :] - yx[:, None, :], persistent=False)  # (G, G, 2): p_j - p_i
        side = math.ceil(math.sqrt(self.num_heads))
        ticks = torch.arange(side, dtype=torch.float32) - (side - 1) / 2  # one token apart, centred on the query
        centers = torch.stack(torch.meshgrid(ticks, ticks, indexing="ij"), -1).reshape(-1, 2)[: self.num_heads]
        self.pos_center = nn.Parameter(centers.clone())  # (heads, 2), in tokens
        self.pos_log_strength = nn.Parameter(torch.zeros(self.num_heads))  # (heads,)

    def position_bias(self) -> torch.Tensor:
        """fp32 ``(heads, N, N)`` logit bias of ``pos_bias="local"`` (zero rows and columns for prefix tokens)."""
        d = self.pos_offsets[None] - self.pos_center.float()[:, None, None, :]  # (heads, G, G, 2)
        bias = -self.pos_log_strength.float().exp()[:, None, None] * d.square().sum(-1)
        p = self.num_prefix_tokens
        return F.pad(bias, (p, 0, p, 0)) if p else bias

    def _with_pos_bias(self, attn_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``attn_mask`` with the position bias added (a bool mask becomes ``-inf`` where it is False)."""
        if self.pos_bias == "none":
            return attn_mask
        bias = self.position_bias()
        if attn_mask is None:
            return bias
        if attn_mask.dtype == torch.bool:  # broadcast both ways: a (B, 1, N, N) mask and the (heads, N, N) bias
            return torch.where(attn_mask, bias, torch.full((), float("-inf"), device=bias.device))
        return bias + attn_mask.float()

    def reset_parameters(self) -> None:
        """The ViT initialisation of the projections (truncated normal, std 0.02; zero biases), the block's
        own: a model that holds it leaves it as it is."""
        init_linears(self)

    # -- score functions -------------------------------------------------------------------------------
    def _logits(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """fp32 ``(B, heads, N, N)`` attention logits; ``q``, ``k``: fp32 ``(B, heads, N, d)``."""
        if self.score == "scaled_dot":
            return (q * self.head_dim**-0.5) @ k.transpose(-2, -1)
        if self.score == "dot":
            return q @ k.transpose(-2, -1)
        if self.score == "general":
            return (q @ self.general_weight.to(q.dtype)) @ k.transpose(-2, -1)  # (B,h,N,d)@(h,d,d) broadcasts
        # additive: tanh(q_i + k_j) is (B, h, N, N, d); contract d with the per-head v.
        return torch.einsum("bhije,he->bhij", torch.tanh(q.unsqueeze(3) + k.unsqueeze(2)), self.additive_v.to(q.dtype))

    def _fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
               is_causal: bool = False, attend: Callable[..., torch.Tensor] = sdpa) -> torch.Tensor:
        """``(B, heads, N, d)`` output of the fused kernel ``attend``, for the scores that have a fused form."""
        p = self.attn_drop.p if self.training else 0.0
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(q.dtype)  # the fused kernels want a float mask in the query's dtype (as lsa's)
        if self.score == "scaled_dot":  # default scale is 1/sqrt(d)
            return attend(q, k, v, attn_mask=attn_mask, dropout_p=p, is_causal=is_causal)
        if self.score == "general":
            q = q @ self.general_weight.to(q.dtype)
        return attend(q, k, v, attn_mask=attn_mask, dropout_p=p, scale=1.0, is_causal=is_causal)

    def _fused_packed(self, qkv: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                      is_causal: bool = False) -> torch.Tensor:
        """The fast path, packed ``(B, N, 3*dim)`` -> ``(B, N, dim)``: ``q, k, v`` are views of ``qkv`` split on
        its ``3`` axis, so the backward stacks their gradients straight into ``qkv``'s layout (the baseline's
        permuted split costs a transposing copy). On a CPU ``sdpa_cpu`` picks the kernel (:func:`sdpa_cpu_mode`)."""
        B, N, _ = qkv.shape
        parts = qkv.unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(2)  # 3 x (B, N, heads, d) views
        if self.qk_norm:  # LayerNorm over d (fp32 under autocast): cast back so q, k, v share a dtype
            parts = (self.q_norm(parts[0]).to(qkv.dtype), self.k_norm(parts[1]).to(qkv.dtype), parts[2])
        mode = self.sdpa_cpu if qkv.device.type == "cpu" else "native"
        upcast = mode == "fp32" and qkv.dtype in (torch.bfloat16, torch.float16)
        attend = matmul_attention if mode == "matmul" else F.scaled_dot_product_attention
        if upcast:
            parts = [t.float() for t in parts]
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.float()
        q, k, v = (t.transpose(1, 2) for t in parts)  # (B, heads, N, d)
        with torch.autocast(qkv.device.type, enabled=False) if upcast else contextlib.nullcontext():
            out = self._fused(q, k, v, attn_mask, is_causal, attend=attend)
        out = out.transpose(1, 2).reshape(B, N, self.dim)
        return out.to(qkv.dtype) if upcast else out

    def _has_fused(self) -> bool:
        return self.score != "additive"

    # -- weights and forward ---------------------------------------------------------------------------
    @property
    def hard(self) -> Hard:
        return self._hard

    @hard.setter
    def hard(self, value: Hard) -> None:
        self._hard = _check_hard(value)

    def _use_hard(self) -> bool:
        return self.hard is not None and not self.training

    def attention_weights(self, q: torch.Tensor, k: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                          is_causal: bool = False) -> torch.Tensor:
        """Explicit fp32 (fp64 for fp64 input) weights ``(B, heads, N, N)``, rows summing to 1 (hard top-k
        applied in eval)."""
        with torch.autocast(device_type=q.device.type, enabled=False):
            acc = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 input
            logits = mask_logits(self._logits(q.to(acc), k.to(acc)), attn_mask, is_causal)
            if self._use_hard():
                return top_k_softmax(logits, 1 if self.hard == "argmax" else int(self.hard))
            return logits.softmax(dim=-1)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
        """``x``: ``(B, N, dim)``; ``attn_mask``: bool (``True`` = may attend) or float (added to the logits),
        broadcastable to ``(B, heads, N, N)``; ``is_causal``: each token attends to itself and earlier ones."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"{type(self).__name__} expects (B, N, {self.dim}) tokens, got {tuple(x.shape)}")
        _check_mask_args(attn_mask, is_causal)
        B, N, D = x.shape
        if self.pos_bias != "none":
            if is_causal:
                raise ValueError("pos_bias='local' takes attn_mask, not is_causal")
            _check_tokens(self, N)
            attn_mask = self._with_pos_bias(attn_mask)  # fp32 (..., heads, N, N)
        qkv = self.qkv(x)  # (B, N, 3*D)
        if self.fast_path and not (self.tap.active or self._use_hard() or not self._has_fused()):
            return self.proj_drop(self.proj(self._gated(x, self._fused_packed(qkv, attn_mask, is_causal))))
        # (B, N, 3*D) -> (3, B, heads, N, d)
        q, k, v = qkv.reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.qk_norm:
            q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        if self.tap.active or self._use_hard() or not self._has_fused():
            if self.tap.active:
                _check_tokens(self, N)
            attn = self.attention_weights(q, k, attn_mask, is_causal)  # fp32 (B, heads, N, N)
            attn = self.tap(attn, grid=self.tap_grid, num_prefix_tokens=self.num_prefix_tokens)
            out = self.attn_drop(attn).to(v.dtype) @ v  # (B, heads, N, d)
        else:
            out = self._fused(q, k, v, attn_mask, is_causal)
        out = out.transpose(1, 2).reshape(B, N, D)
        return self.proj_drop(self.proj(self._gated(x, out)))

    def _gated(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` ``(B, N, D)`` times ``sigmoid(gate_proj(x))``, per head or per channel (``gate``)."""
        if self.gate_proj is None:
            return out
        g = torch.sigmoid(self.gate_proj(x)).to(out.dtype)  # (B, N, heads) or (B, N, D)
        if self.gate == "head":
            return (out.unflatten(-1, (self.num_heads, self.head_dim)) * g.unsqueeze(-1)).flatten(-2)
        return out * g

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, score={self.score!r}, hard={self.hard!r}, "
            f"grid={self.tap_grid}, num_prefix_tokens={self.num_prefix_tokens}, pos_bias={self.pos_bias!r}"
            + (", qk_norm=True" if self.qk_norm else "") + (f", gate={self.gate!r}" if self.gate != "none" else "")
        )


@register_attention("lsa", layout="token", kind="token")
class LocalitySelfAttention(MultiHeadSelfAttention):
    """Locality self-attention, ``(B, N, D) -> (B, N, D)`` (Lee, Lee, Song, 2021, arXiv 2112.13492).

    Scaled dot-product attention with the diagonal masked (no token attends to itself) and a learned
    per-head ``temperature`` ``T`` (logits ``q k^T / T``, ``T`` starting at ``sqrt(head_dim)``). Fused: ``q``
    times ``1/T``, SDPA with ``scale=1`` and a diagonal mask (combined with any ``attn_mask``). Needs at
    least 2 tokens; ``is_causal`` is refused (the first token would attend to nothing). ``hard`` as for
    ``mhsa``. Double backward: as for ``mhsa``, under ``sdpa_kernel(SDPBackend.MATH)``.
    """

    PAPER = "Lee, Lee, Song, 2021, Vision Transformer for Small-Size Datasets, arXiv 2112.13492"
    CHECKED_AGAINST = "an explicit reference of the paper's equations (diagonal mask, learned temperature), float64"
    IDENTITY = "no init option: the ViT initialisation, temperature sqrt(head_dim)"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, hard: Hard = None, grid: Grid = None, num_prefix_tokens: int = 0,
                 proj_bias: bool = True):
        super().__init__(dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop,
                         hard=hard, grid=grid, num_prefix_tokens=num_prefix_tokens, proj_bias=proj_bias)
        self.score = "lsa"
        self.temperature = nn.Parameter(torch.full((num_heads,), math.sqrt(self.head_dim)))  # (heads,)

    def _inv_temperature(self, dtype: torch.dtype) -> torch.Tensor:
        return (1.0 / self.temperature).to(dtype).view(1, -1, 1, 1)  # (1, heads, 1, 1)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
        if is_causal:
            raise ValueError("lsa does not take is_causal: with its diagonal masked, the first token could attend to nothing")
        if x.dim() == 3 and x.shape[1] < 2:
            raise ValueError(f"lsa needs at least 2 tokens (the diagonal is masked), got {x.shape[1]}")
        return super().forward(x, attn_mask=attn_mask)

    def _logits(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        n = q.shape[-2]
        logits = (q * self._inv_temperature(q.dtype)) @ k.transpose(-2, -1)
        eye = torch.eye(n, dtype=torch.bool, device=q.device)
        return logits.masked_fill(eye, float("-inf"))

    def _fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
               is_causal: bool = False, attend: Callable[..., torch.Tensor] = sdpa) -> torch.Tensor:
        n = q.shape[-2]
        keep = ~torch.eye(n, dtype=torch.bool, device=q.device)  # (N, N), True = may attend
        if attn_mask is None:
            mask = keep
        elif attn_mask.dtype == torch.bool:
            mask = keep & attn_mask
        else:  # a float mask: the diagonal's -inf added to it
            mask = torch.zeros(n, n, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
            mask = mask + attn_mask.to(q.dtype)
        p = self.attn_drop.p if self.training else 0.0
        q = q * self._inv_temperature(q.dtype)
        return attend(q, k, v, attn_mask=mask, dropout_p=p, scale=1.0)

    def _has_fused(self) -> bool:
        return True


@register_attention("seqpool", layout="token", kind="pool")
class SequencePooling(nn.Module):
    """Sequence pooling head, ``(B, N, D) -> (B, D)`` (Hassani et al., 2021, arXiv 2104.05704).

    Not a same-shape block: it replaces the class token. ``w = softmax_N(Linear(D, 1)(x))`` weighs the
    tokens, and the output is ``sum_n w_n x_n``. The tap (kind ``"pool"``) carries ``w``, ``(B, N)``, with
    ``tap_grid`` and ``num_prefix_tokens`` as for the attention blocks. The softmax is taken in fp32.
    """

    PAPER = ("Hassani, Walton, Shah, Abuduweili, Li, Shi, 2021, Escaping the Big Data Paradigm with Compact "
             "Transformers, arXiv 2104.05704")
    CHECKED_AGAINST = "an explicit reference of the paper's equation (softmax-weighted token sum), float64"
    IDENTITY = "no init option (a pooling head, not a same-shape block): the ViT initialisation"

    def __init__(self, dim: int, grid: Grid = None, num_prefix_tokens: int = 0):
        super().__init__()
        if num_prefix_tokens < 0:
            raise ValueError(f"num_prefix_tokens must be >= 0, got {num_prefix_tokens}")
        self.dim = dim
        self.tap_grid = _check_grid(grid)
        self.num_prefix_tokens = int(num_prefix_tokens)
        self.attention_pool = nn.Linear(dim, 1)
        self.tap = AttentionTap("pool")
        init_linears(self)  # ViT's rule, the block's own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"SequencePooling expects (B, N, {self.dim}) tokens, got {tuple(x.shape)}")
        if self.tap.active:
            _check_tokens(self, x.shape[1])
        # Scores and softmax in fp32 with autocast off: a (D -> 1) projection is cheap, and fp16 scores of
        # large tokens could overflow to inf.
        with torch.autocast(device_type=x.device.type, enabled=False):
            lin = self.attention_pool
            acc = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 input
            bias = None if lin.bias is None else lin.bias.to(acc)
            w = F.linear(x.to(acc), lin.weight.to(acc), bias).squeeze(-1).softmax(dim=-1)  # (B, N)
        w = self.tap(w, grid=self.tap_grid, num_prefix_tokens=self.num_prefix_tokens)
        return (w.to(x.dtype).unsqueeze(1) @ x).squeeze(1)  # (B, 1, N) @ (B, N, D) -> (B, D)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, grid={self.tap_grid}, num_prefix_tokens={self.num_prefix_tokens}"

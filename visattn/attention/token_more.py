"""More token mechanisms, ``(B, N, D)`` in: talking heads, CaiT's class attention, XCiT's cross-covariance
attention and an attention-pooling head with a learned query.

* ``talking_heads``: Shazeer, Lan, Cheng, Ding, Hou, 2020, "Talking-Heads Attention", arXiv 2003.02436, as
  CaiT uses it (Touvron et al., 2021, arXiv 2103.17239; timm's ``TalkingHeadAttn``).
* ``class_attn``: Touvron, Cord, Sablayrolles, Synnaeve, Jegou, 2021, "Going deeper with Image Transformers"
  (CaiT), arXiv 2103.17239, section 3 (timm's ``ClassAttn``).
* ``xca``: El-Nouby et al., 2021, "XCiT: Cross-Covariance Image Transformers", arXiv 2106.09681, eq. (4)
  (timm's ``XCA``).
* ``attn_pool``: multihead attention pooling, the "MAP" head of Zhai, Kolesnikov, Houlsby, Beyer, 2022,
  "Scaling Vision Transformers", arXiv 2106.04560 (Lee et al., 2019, "Set Transformer", arXiv 1810.00825,
  PMA); timm's ``AttentionPoolLatent``. ``(B, N, D) -> (B, D)``, registered as ``kind="pool"`` like ``seqpool``.

Every block carries ``tap_grid`` and ``num_prefix_tokens`` (set by the model, as for ``mhsa``). Softmax
weights are computed explicitly in fp32 (autocast off) when the tap is active or when the mechanism has no
fused form; otherwise fused SDPA runs. Token blocks take no ``init`` option (a model's residual branch, or
its layer scale, decides how they start), so ``IDENTITY`` says so. Double backward: under
``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``, as for ``mhsa``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import register_attention
from .functional import init_linears, positive_int, sdpa
from .tap import AttentionTap

__all__ = ["TalkingHeadsAttention", "ClassAttention", "CrossCovarianceAttention", "AttentionPoolLatent",
           "TokenBlockBase", "check_grid", "check_tokens", "NO_INIT", "POOL_TYPES"]

Grid = Optional[Tuple[int, int]]
NO_INIT = "no init option: token blocks start as built (the model's residual branch or layer scale decides)"
POOL_TYPES = ("token", "avg")


def check_grid(grid: Grid) -> Grid:
    """``grid`` as ``(H, W)`` ints, or None; a one-line ValueError otherwise."""
    if grid is None:
        return None
    if not isinstance(grid, (tuple, list)) or len(grid) != 2 or any(int(g) < 1 for g in grid):
        raise ValueError(f"grid must be None or (H, W) with H, W >= 1, got {grid!r}")
    return int(grid[0]), int(grid[1])


def check_tokens(block: nn.Module, n: int) -> None:
    """The tap's grid must describe the sequence it is given (checked on recording passes)."""
    if block.tap_grid is not None:
        h, w = block.tap_grid
        if h * w + block.num_prefix_tokens != n:
            raise ValueError(f"{type(block).__name__}: grid {block.tap_grid} with {block.num_prefix_tokens} prefix "
                             f"token(s) needs {h * w + block.num_prefix_tokens} tokens, got {n}")


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # fp32, or fp64 for fp64 input


class TokenBlockBase(nn.Module):
    """Shared checks: ``dim`` and ``num_heads``, the tap's grid, the ``(B, N, dim)`` input."""

    PAPER = ""
    CHECKED_AGAINST = ""
    IDENTITY = NO_INIT

    def _setup(self, dim: int, num_heads: int, grid: Grid, num_prefix_tokens: int) -> None:
        positive_int("dim", dim)
        positive_int("num_heads", num_heads, divides=dim)
        if isinstance(num_prefix_tokens, bool) or not isinstance(num_prefix_tokens, int) or num_prefix_tokens < 0:
            raise ValueError(f"num_prefix_tokens must be an int >= 0, got {num_prefix_tokens!r}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.tap_grid = check_grid(grid)
        self.num_prefix_tokens = int(num_prefix_tokens)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"{type(self).__name__} expects (B, N, {self.dim}) tokens, got {tuple(x.shape)}")
        if self.tap.active:
            check_tokens(self, x.shape[1])

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, N, dim)`` -> ``(B, heads, N, d)``."""
        return t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, grid={self.tap_grid}, "
                f"num_prefix_tokens={self.num_prefix_tokens}")


@register_attention("talking_heads", layout="token", kind="token")
class TalkingHeadsAttention(TokenBlockBase):
    """Talking-heads attention, ``(B, N, D) -> (B, N, D)`` (Shazeer et al., 2020, arXiv 2003.02436, eqs. in
    section 4; CaiT's form, Touvron et al., 2021, arXiv 2103.17239, with as many heads before, inside and
    after the softmax).

    Per head ``h`` the logits ``L_h = q_h k_h^T / sqrt(d)`` are mixed across heads by ``proj_l`` (a
    ``heads x heads`` linear with bias), softmaxed over the keys, and the weights are mixed across heads again
    by ``proj_w`` before multiplying ``V``. The tap carries the softmax ``(B, heads, N, N)`` (rows sum to 1),
    between the two mixes; ``proj_w`` of what it returns is what multiplies ``V``. There is no fused form: the
    logits and both mixes are always explicit, in fp32 with autocast off. Parameter names as timm's
    ``TalkingHeadAttn`` (its state dict loads strictly); ``qkv_bias=True`` as CaiT's models build it.
    Double backward: explicit ops only, no ``SDPBackend.MATH`` needed.
    """

    PAPER = "Shazeer, Lan, Cheng, Ding, Hou, 2020, Talking-Heads Attention, arXiv 2003.02436"
    CHECKED_AGAINST = "timm TalkingHeadAttn (CaiT; float64, weights copied, outputs and gradients)"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, grid: Grid = None, num_prefix_tokens: int = 0):
        super().__init__()
        self._setup(dim, num_heads, grid, num_prefix_tokens)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_l = nn.Linear(num_heads, num_heads)
        self.proj_w = nn.Linear(num_heads, num_heads)
        self.proj_drop = nn.Dropout(proj_drop)
        self.tap = AttentionTap("token")
        init_linears(self)

    @staticmethod
    def _mix(lin: nn.Linear, a: torch.Tensor) -> torch.Tensor:
        """``lin`` over the heads axis of ``(B, heads, N, M)``."""
        bias = None if lin.bias is None else lin.bias.to(a.dtype)
        return F.linear(a.permute(0, 2, 3, 1), lin.weight.to(a.dtype), bias).permute(0, 3, 1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        B, N, D = x.shape
        q, k, v = (self._heads(t) for t in self.qkv(x).chunk(3, dim=-1))  # (B, heads, N, d)
        with torch.autocast(device_type=x.device.type, enabled=False):
            acc = _acc(q)
            logits = (q.to(acc) * self.head_dim**-0.5) @ k.to(acc).transpose(-2, -1)
            attn = self._mix(self.proj_l, logits).softmax(dim=-1)
            attn = self.tap(attn, grid=self.tap_grid, num_prefix_tokens=self.num_prefix_tokens)
            attn = self.attn_drop(self._mix(self.proj_w, attn))
        out = (attn.to(v.dtype) @ v).transpose(1, 2).reshape(B, N, D)
        return self.proj_drop(self.proj(out))


@register_attention("class_attn", layout="token", kind="token")
class ClassAttention(TokenBlockBase):
    """CaiT's class attention, ``(B, N, D) -> (B, N, D)`` (Touvron et al., 2021, arXiv 2103.17239, section 3,
    "class-attention layer"): only the class token (token 0) queries; keys and values are all ``N`` tokens.

    Row 0 of the output is ``proj(softmax(q_cls k^T / sqrt(d)) V)`` (timm's ``ClassAttn``, whose ``(B, 1, D)``
    output it equals); rows 1.. are zero, so in a pre-norm residual block ``x + block(norm(x))`` the class
    token is updated and the other tokens pass through unchanged, as in CaiT's class-attention stage. The tap
    carries the class token's weights, ``(B, heads, 1, N)`` (one query row), with ``grid`` and
    ``num_prefix_tokens``. Separate ``q``, ``k``, ``v`` linears with timm's names (its state dict loads
    strictly); ``qkv_bias=True`` as CaiT's models build it. Fused SDPA unless the tap is active; double
    backward under ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``.
    """

    PAPER = "Touvron, Cord, Sablayrolles, Synnaeve, Jegou, 2021, Going deeper with Image Transformers, arXiv 2103.17239"
    CHECKED_AGAINST = "timm ClassAttn (CaiT; float64, weights copied, class-token output and gradients)"
    num_queries = 1  # rows of the recorded map

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, grid: Grid = None, num_prefix_tokens: int = 0):
        super().__init__()
        self._setup(dim, num_heads, grid, num_prefix_tokens)
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.tap = AttentionTap("token")
        init_linears(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        B, N, D = x.shape
        q = self._heads(self.q(x[:, :1]))  # (B, heads, 1, d)
        k, v = self._heads(self.k(x)), self._heads(self.v(x))  # (B, heads, N, d)
        if self.tap.active:
            with torch.autocast(device_type=x.device.type, enabled=False):
                acc = _acc(q)
                attn = ((q.to(acc) * self.head_dim**-0.5) @ k.to(acc).transpose(-2, -1)).softmax(dim=-1)
            attn = self.tap(attn, grid=self.tap_grid, num_prefix_tokens=self.num_prefix_tokens)
            cls = self.attn_drop(attn).to(v.dtype) @ v
        else:
            cls = sdpa(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        cls = self.proj_drop(self.proj(cls.transpose(1, 2).reshape(B, 1, D)))  # (B, 1, D)
        return torch.cat([cls, cls.new_zeros(B, N - 1, D)], dim=1)


@register_attention("xca", layout="token", kind="covariance")
class CrossCovarianceAttention(TokenBlockBase):
    """Cross-covariance attention, ``(B, N, D) -> (B, N, D)`` (El-Nouby et al., 2021, arXiv 2106.09681, eq. 4).

    Per head the attention is over channels, not tokens: with ``q``, ``k`` of shape ``(d, N)`` each
    L2-normalised along the tokens, ``A = softmax(tau * q_hat k_hat^T)`` is ``d x d`` and the output is
    ``A v``; ``temperature`` ``tau`` is learned per head (1 at init). The tap (kind ``"covariance"``) carries
    ``A``, ``(B, heads, d, d)``, rows summing to 1, with ``grid`` and ``num_prefix_tokens`` of the tokens it
    mixed. Normalisation and softmax in fp32 with autocast off; fused SDPA (``scale=1``, on the transposed
    ``(B, heads, d, N)`` tensors) unless the tap is active. Parameter names as timm's ``XCA`` (strict load);
    ``qkv_bias=True`` as XCiT's models build it. Double backward under
    ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``.
    """

    PAPER = "El-Nouby, Touvron, Caron, Bojanowski, Douze, Joulin, Laptev, Neverova, Synnaeve, Verbeek, Jegou, 2021, " \
            "XCiT: Cross-Covariance Image Transformers, arXiv 2106.09681"
    CHECKED_AGAINST = "timm XCA (XCiT; float64, weights copied, outputs and gradients)"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, grid: Grid = None, num_prefix_tokens: int = 0):
        super().__init__()
        self._setup(dim, num_heads, grid, num_prefix_tokens)
        self.temperature = nn.Parameter(torch.ones(num_heads, 1, 1))  # timm's name and shape
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.tap = AttentionTap("covariance")
        init_linears(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        B, N, D = x.shape
        q, k, v = (self._heads(t).transpose(-2, -1) for t in self.qkv(x).chunk(3, dim=-1))  # (B, heads, d, N)
        with torch.autocast(device_type=x.device.type, enabled=False):
            acc = _acc(q)
            q_hat = F.normalize(q.to(acc), dim=-1) * self.temperature.to(acc)
            k_hat = F.normalize(k.to(acc), dim=-1)
            if self.tap.active:
                attn = (q_hat @ k_hat.transpose(-2, -1)).softmax(dim=-1)  # (B, heads, d, d)
                attn = self.tap(attn, grid=self.tap_grid, num_prefix_tokens=self.num_prefix_tokens)
                out = self.attn_drop(attn) @ v.to(acc)
            else:
                p = self.attn_drop.p if self.training else 0.0
                out = sdpa(q_hat, k_hat, v.to(acc), dropout_p=p, scale=1.0)
        out = out.to(v.dtype).permute(0, 3, 1, 2).reshape(B, N, D)  # (B, N, heads, d) -> (B, N, D)
        return self.proj_drop(self.proj(out))


@register_attention("attn_pool", layout="token", kind="pool")
class AttentionPoolLatent(TokenBlockBase):
    """Multihead attention pooling with learned latent queries, ``(B, N, D) -> (B, D)`` (the MAP head of Zhai
    et al., 2022, arXiv 2106.04560; PMA of Lee et al., 2019, arXiv 1810.00825; timm's ``AttentionPoolLatent``).

    Like ``seqpool`` it replaces the class token (a model's head, not a same-shape block). ``latent_len``
    learned queries (``latent``, ``(1, L, D)``, through ``q``) attend over the tokens (``kv``) per head;
    then ``y = proj(attention)``, ``y = y + mlp(norm(y))`` (``mlp_ratio`` hidden width, GELU; ``norm``:
    LayerNorm, or ``norm=False`` for none as timm's default), and ``pool`` picks the first latent
    (``"token"``) or their mean (``"avg"``). ``qk_norm``: LayerNorm on each head's ``q`` and ``k``. Names and
    order as timm's (its state dict loads strictly with ``norm_layer=nn.LayerNorm`` where ``norm=True``).

    The tap (kind ``"pool"``) carries ``(B, N)``: the attention weights averaged over heads and latents (each
    head's row sums to 1, so the mean does too); the per-head weights multiply ``V``. Fused SDPA unless the
    tap is active; double backward under ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``.
    """

    PAPER = "Zhai, Kolesnikov, Houlsby, Beyer, 2022, Scaling Vision Transformers (MAP head), arXiv 2106.04560"
    CHECKED_AGAINST = "timm AttentionPoolLatent (norm_layer=LayerNorm; float64, weights copied, outputs and gradients)"

    def __init__(self, dim: int, num_heads: int = 8, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 qk_norm: bool = False, latent_len: int = 1, pool: str = "token", norm: bool = True,
                 drop: float = 0.0, grid: Grid = None, num_prefix_tokens: int = 0):
        super().__init__()
        self._setup(dim, num_heads, grid, num_prefix_tokens)
        positive_int("latent_len", latent_len)
        if pool not in POOL_TYPES:
            raise ValueError(f"unknown pool {pool!r}; valid: {', '.join(POOL_TYPES)}")
        if not (isinstance(mlp_ratio, (int, float)) and not isinstance(mlp_ratio, bool) and mlp_ratio > 0):
            raise ValueError(f"mlp_ratio must be a positive number, got {mlp_ratio!r}")
        for what, flag in (("qk_norm", qk_norm), ("norm", norm)):
            if not isinstance(flag, bool):
                raise ValueError(f"{what} must be True or False, got {flag!r}")
        self.latent_len, self.pool = latent_len, pool
        self.latent = nn.Parameter(torch.zeros(1, latent_len, dim))
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(drop)
        self.norm = nn.LayerNorm(dim) if norm else nn.Identity()
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential()  # fc1, act, fc2: timm Mlp's parameter names
        self.mlp.add_module("fc1", nn.Linear(dim, hidden))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("fc2", nn.Linear(hidden, dim))
        self.tap = AttentionTap("pool")
        init_linears(self)
        nn.init.trunc_normal_(self.latent, std=dim**-0.5)  # timm's latent init (std latent_dim ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        B, N, D = x.shape
        q = self._heads(self.q(self.latent.expand(B, -1, -1)).to(x.dtype))  # (B, heads, L, d)
        k, v = (self._heads(t) for t in self.kv(x).chunk(2, dim=-1))  # (B, heads, N, d)
        q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        if self.tap.active:
            with torch.autocast(device_type=x.device.type, enabled=False):
                acc = _acc(q)
                attn = ((q.to(acc) * self.head_dim**-0.5) @ k.to(acc).transpose(-2, -1)).softmax(dim=-1)
            self.tap(attn.mean(dim=(1, 2)), grid=self.tap_grid, num_prefix_tokens=self.num_prefix_tokens)
            y = attn.to(v.dtype) @ v
        else:
            y = sdpa(q, k, v)
        y = self.proj_drop(self.proj(y.transpose(1, 2).reshape(B, self.latent_len, D)))
        y = y + self.mlp(self.norm(y))
        return y[:, 0] if self.pool == "token" else y.mean(dim=1)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", latent_len={self.latent_len}, pool={self.pool!r}"

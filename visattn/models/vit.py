"""A small Vision Transformer for 32x32 images (Dosovitskiy et al., 2020, arXiv 2010.11929).

Sized after Lee, Lee, Song, 2021 ("Vision Transformer for Small-Size Datasets", arXiv 2112.13492): patch 4
gives 64 tokens on a 32x32 image; ``vit_tiny`` is their depth-9, dim-192, 12-head, MLP-ratio-2 ViT
(~2.7M parameters), ``vit_small`` is depth 12, dim 256, 8 heads, ratio 2 (~6.4M). Options: ``pool``
(``"cls"``, ``"mean"``, ``"seq"``, CCT's sequence pooling, or ``"attn"``, the attention-pooling head
``attn_pool``: a learned query over the tokens, the MAP head of Zhai, Kolesnikov, Houlsby, Beyer, 2022,
"Scaling Vision Transformers", arXiv 2106.04560, as timm's ``global_pool="map"``); ``attn``, any registered
token block that maps ``(B, N, D)`` to the same (``list_attention("token")`` less the pooling heads: ``"mhsa"``,
``"lsa"``, ``"talking_heads"``, ``"class_attn"`` (it updates the class token only, so it needs
``pool="cls"``), ``"window"``, ``"xca"``, whose maps are channel x channel) with ``attn_kwargs`` (e.g.
``{"score": "general"}``); ``layer_scale`` (LayerScale's initial value, ``None``: none); ``spt``, shifted patch
tokenization (Lee et al. 2021).

Blocks are pre-norm with timm's ``Mlp`` and ``DropPath``; the position embedding is learned; each block's tap
records ``grid=model.grid_size`` and ``num_prefix_tokens``. :class:`TokenClassifier` is shared with the CCT
hybrid (``cct.py``); the two differ only in the tokenizer.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from timm.layers import DropPath, LayerScale, Mlp, PatchEmbed, trunc_normal_
from torch import nn

from ..registry import attention_info, backbone_modules, create_attention, register_model

__all__ = ["Block", "TokenClassifier", "ShiftedPatchTokenizer", "VisionTransformer", "vit_tiny", "vit_small"]

POOLS = ("cls", "mean", "seq", "attn")
HEADS = {"seq": "seqpool", "attn": "attn_pool"}  # the pooling heads (token blocks of kind "pool"), by pool
MIXERS = ("token", "covariance")  # the record kinds of the token blocks that map (B, N, D) to the same

Size = Union[int, Sequence[int]]


def check_options(pool: str, attn: str, layer_scale: Optional[float], depth: int, num_classes: int,
                  attn_kwargs: Dict[str, Any]) -> None:
    """One-line ValueErrors for the options of :class:`TokenClassifier`."""
    if pool not in POOLS:
        raise ValueError(f"unknown pool {pool!r}; valid: {', '.join(POOLS)}")
    info = attention_info(attn)  # raises ValueError listing the blocks for an unknown name
    if info.get("layout") == "token" and info.get("kind") == "pool":
        use = next((p for p, head in HEADS.items() if head == attn), None)
        raise ValueError(f"attn={attn!r} is a pooling head, not a token mixer" + (f": use pool={use!r}" if use else ""))
    if info.get("layout") != "token" or info.get("kind") not in MIXERS:
        raise ValueError(f"attn must be a token block such as 'mhsa', 'lsa' or 'xca', got {attn!r}")
    if attn == "class_attn" and pool != "cls":
        raise ValueError(f"attn='class_attn' updates the class token only: it needs pool='cls', got pool={pool!r}")
    if layer_scale is not None and not (math.isfinite(layer_scale) and layer_scale > 0):
        raise ValueError(f"layer_scale must be a positive number or None, got {layer_scale!r}")
    if depth < 1 or num_classes < 0:
        raise ValueError(f"depth must be >= 1 and num_classes >= 0, got depth={depth}, num_classes={num_classes}")
    fixed = {"grid", "num_prefix_tokens"} & set(attn_kwargs)
    if fixed:
        raise ValueError(f"attn_kwargs may not set {', '.join(sorted(fixed))}: the model sets them")


def to_2tuple(size: Size, what: str) -> Tuple[int, int]:
    if isinstance(size, int):
        size = (size, size)
    size = tuple(int(s) for s in size)
    if len(size) != 2 or min(size) < 1:
        raise ValueError(f"{what} must be an int or (H, W) of positive ints, got {size!r}")
    return size


class Block(nn.Module):
    """Pre-norm transformer block: ``x + DropPath(ls1(attn(LN(x))))``, then ``x + DropPath(ls2(mlp(LN(x))))``;
    ``layer_scale``: the initial value of LayerScale (Touvron et al. 2021) on each branch, ``None``: none."""

    def __init__(self, dim: int, attn: nn.Module, mlp_ratio: float = 2.0, drop: float = 0.0, drop_path: float = 0.0,
                 layer_scale: Optional[float] = None):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = attn  # a registered token block, (B, N, D) -> (B, N, D)
        self.ls1 = LayerScale(dim, layer_scale) if layer_scale is not None else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, hidden_features=int(dim * mlp_ratio), act_layer=nn.GELU, drop=drop)
        self.ls2 = LayerScale(dim, layer_scale) if layer_scale is not None else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class TokenClassifier(nn.Module):
    """Tokenizer -> (class token) + learned position embedding -> blocks -> LayerNorm -> pool -> linear head.

    ``tokenizer`` maps ``(B, C, H_img, W_img)`` to ``(B, H*W, dim)`` tokens on ``grid_size=(H, W)``. ``pool``:
    the class token (``"cls"``), the mean token (``"mean"``), or a pooling head over the tokens: ``"seq"``
    (``seqpool``, Hassani et al., 2021, arXiv 2104.05704) or ``"attn"`` (``attn_pool``, Zhai et al., 2022, arXiv
    2106.04560: one learned query, ``num_heads`` heads, an MLP of ``mlp_ratio``, LayerNorm, as timm's ViT builds
    it for ``global_pool="map"``). Both heads record their ``(B, N)`` weights (kind ``"pool"``).
    """

    def __init__(self, tokenizer: nn.Module, grid_size: Tuple[int, int], img_size: Tuple[int, int],
                 num_classes: int = 10, dim: int = 192, depth: int = 9, num_heads: int = 12, mlp_ratio: float = 2.0,
                 pool: str = "cls", attn: str = "mhsa", attn_kwargs: Optional[Dict[str, Any]] = None,
                 drop_rate: float = 0.0, attn_drop_rate: float = 0.0, drop_path_rate: float = 0.1,
                 layer_scale: Optional[float] = None):
        super().__init__()
        attn_kwargs = dict(attn_kwargs or {})
        check_options(pool, attn, layer_scale, depth, num_classes, attn_kwargs)

        self.img_size = img_size
        self.grid_size = grid_size
        self.pool = pool
        self.num_prefix_tokens = 1 if pool == "cls" else 0
        self.num_features = self.embed_dim = dim
        num_tokens = grid_size[0] * grid_size[1] + self.num_prefix_tokens

        self.tokenizer = tokenizer
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if pool == "cls" else None
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, dim))  # (1, N, D), learned
        self.pos_drop = nn.Dropout(drop_rate)

        tap_info = {"grid": grid_size, "num_prefix_tokens": self.num_prefix_tokens}
        attn_opts = {"num_heads": num_heads, "attn_drop": attn_drop_rate, "proj_drop": drop_rate, **attn_kwargs}
        rates = torch.linspace(0, drop_path_rate, depth, device="cpu").tolist()  # stochastic depth grows with depth
        self.blocks = nn.Sequential(
            *[
                Block(dim, create_attention(attn, dim, **attn_opts, **tap_info), mlp_ratio, drop_rate, rate, layer_scale)
                for rate in rates
            ]
        )
        self.norm = nn.LayerNorm(dim)
        self.seq_pool = create_attention("seqpool", dim, **tap_info) if pool == "seq" else None
        self.attn_pool = (create_attention("attn_pool", dim, num_heads=num_heads, mlp_ratio=mlp_ratio, **tap_info)
                          if pool == "attn" else None)
        self.head = nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()

        trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            trunc_normal_(self.cls_token, std=0.02)
        for m in backbone_modules(self):  # the attention blocks keep their own initialisation
            self._init_weights(m)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """Position parameters: the embedding, the class token and the attention's position-bias centres."""
        centres = {n for n, _ in self.named_parameters() if n.endswith(".pos_center")}
        return {"pos_embed", "cls_token"} | centres

    def set_fast_path(self, enabled: bool = True) -> "TokenClassifier":
        """Switch the speed-ups of the training path on (the default) or off (the baseline path, kept to measure
        against and pinned equal by the tests): every submodule with a ``fast_path`` attribute."""
        for m in self.modules():
            if hasattr(m, "fast_path"):
                m.fast_path = bool(enabled)
        return self

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H_img, W_img)`` -> normed tokens ``(B, N, D)`` (class token first when ``pool="cls"``)."""
        if x.dim() != 4 or tuple(x.shape[-2:]) != self.img_size:
            h, w = self.img_size
            raise ValueError(f"{type(self).__name__} expects (B, C, {h}, {w}) images, got {tuple(x.shape)}")
        x = self.tokenizer(x)  # (B, H*W, D)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1 + H*W, D)
        x = self.pos_drop(x + self.pos_embed)
        return self.norm(self.blocks(x))

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool == "cls":
            x = x[:, 0]
        elif self.pool == "mean":
            x = x.mean(dim=1)
        elif self.pool == "attn":
            x = self.attn_pool(x)  # (B, D)
        else:
            x = self.seq_pool(x)  # (B, D)
        return self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


class ShiftedPatchTokenizer(nn.Module):
    """Shifted patch tokenization (Lee, Lee, Song, 2021, arXiv 2112.13492).

    The image is concatenated with its four diagonal shifts by half a patch (zero filled): ``(B, 5C, H, W)``;
    the result is cut into ``p x p`` patches, flattened to ``p*p*5C``, layer-normed and linearly embedded.
    """

    def __init__(self, img_size: Tuple[int, int], patch_size: int, in_chans: int, dim: int):
        super().__init__()
        self.patch_size = patch_size
        self.shift = patch_size // 2
        patch_dim = patch_size * patch_size * in_chans * 5
        self.norm = nn.LayerNorm(patch_dim)
        self.proj = nn.Linear(patch_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        s, p = self.shift, self.patch_size
        padded = F.pad(x, (s, s, s, s))  # (B, C, H + 2s, W + 2s)
        # A crop starting at (s - dy, s - dx) is the image moved by (dy, dx): left-up, right-up, left-down,
        # right-down.
        shifts = ((-s, -s), (-s, s), (s, -s), (s, s))  # (dy, dx)
        shifted = [padded[:, :, s - dy : s - dy + H, s - dx : s - dx + W] for dy, dx in shifts]
        x = torch.cat([x, *shifted], dim=1)  # (B, 5C, H, W)
        # (B, 5C, H/p, p, W/p, p) -> (B, H/p * W/p, p*p*5C)
        x = x.reshape(B, 5 * C, H // p, p, W // p, p).permute(0, 2, 4, 3, 5, 1).reshape(B, (H // p) * (W // p), -1)
        return self.proj(self.norm(x))


class VisionTransformer(TokenClassifier):
    """ViT on ``patch_size`` patches of an ``img_size`` image (Dosovitskiy et al., 2020, arXiv 2010.11929).

    Transformer options (``depth``, ``num_heads``, ``mlp_ratio``, ``pool``, ``attn``, ``attn_kwargs``, the
    drop rates) are :class:`TokenClassifier`'s.
    """

    def __init__(self, num_classes: int = 10, img_size: Size = 32, patch_size: int = 4, in_chans: int = 3,
                 dim: int = 192, spt: bool = False, **kwargs: Any):
        img_size = to_2tuple(img_size, "img_size")
        if patch_size < 1 or img_size[0] % patch_size or img_size[1] % patch_size:
            raise ValueError(f"img_size {img_size} must be divisible by patch_size {patch_size}")
        grid = (img_size[0] // patch_size, img_size[1] // patch_size)
        if spt:
            tokenizer: nn.Module = ShiftedPatchTokenizer(img_size, patch_size, in_chans, dim)
        else:
            # the model checks the image size itself (ValueError), so timm's strict assert is not needed
            tokenizer = PatchEmbed(img_size, patch_size, in_chans, dim, strict_img_size=False)
        super().__init__(tokenizer, grid, img_size, num_classes, dim=dim, **kwargs)
        self.patch_size = patch_size
        self.spt = spt


@register_model("vit_tiny", family="vit", cls=VisionTransformer)
def vit_tiny(**kwargs: Any) -> VisionTransformer:
    """ViT-Tiny for 32x32 (Lee et al. 2021's small-dataset ViT): depth 9, dim 192, 12 heads, MLP ratio 2, ~2.7M."""
    return VisionTransformer(**dict(dict(depth=9, dim=192, num_heads=12, mlp_ratio=2.0), **kwargs))


@register_model("vit_small", family="vit", cls=VisionTransformer)
def vit_small(**kwargs: Any) -> VisionTransformer:
    """ViT-Small for 32x32: depth 12, dim 256, 8 heads, MLP ratio 2, ~6.4M parameters."""
    return VisionTransformer(**dict(dict(depth=12, dim=256, num_heads=8, mlp_ratio=2.0), **kwargs))

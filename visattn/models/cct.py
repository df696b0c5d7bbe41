"""Compact Convolutional Transformer, CCT style (Hassani et al., 2021, "Escaping the Big Data Paradigm with
Compact Transformers", arXiv 2104.05704).

A convolutional tokenizer replaces ViT's patches: ``n_conv_layers`` x (conv, ReLU, max-pool 3 stride 2),
each halving the resolution (a 32x32 image gives 16x16 tokens after one layer). The tokens feed the ViT's
pre-norm blocks (the paper normalises after the residual; same parameter count) and, by default, sequence
pooling (``pool="seq"``).

* ``cct_2``: CCT-2/3x2: 2 conv layers, 2 blocks, dim 128, 2 heads, MLP ratio 1 (~0.28M parameters).
* ``cct_7``: CCT-7/3x1: 1 conv layer, 7 blocks, dim 256, 4 heads, MLP ratio 2 (~3.8M parameters).

The taps of all blocks and of the sequence-pooling head carry the tokenizer's grid (``model.grid_size``).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch
from torch import nn

from ..registry import register_model
from .resnet import patch_whitening_filters
from .vit import Size, TokenClassifier, to_2tuple

NORMS = ("none", "bn")
INITS = ("kaiming", "whiten", "whiten_frozen")
ACTS = {"relu": lambda: nn.ReLU(inplace=True), "gelu": nn.GELU}

__all__ = ["PartlyFrozenConv2d", "ConvTokenizer", "CompactConvTransformer", "cct_2", "cct_7"]


class PartlyFrozenConv2d(nn.Conv2d):
    """A bias-free convolution whose first ``n_frozen`` filters are fixed (``frozen``, a parameter with
    ``requires_grad=False``: no gradient, no weight decay, no optimizer state) and whose other filters
    (``weight``) train. The output is that of one convolution with ``cat([frozen, weight])`` as its filters."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, n_frozen: int, padding: int = 0):
        if not 0 < n_frozen < out_channels:
            raise ValueError(f"n_frozen must be between 1 and out_channels - 1 ({out_channels - 1}), got {n_frozen}")
        super().__init__(in_channels, out_channels - n_frozen, kernel_size, padding=padding, bias=False)
        self.frozen = nn.Parameter(torch.zeros(n_frozen, in_channels, kernel_size, kernel_size), requires_grad=False)

    @property
    def filters(self) -> torch.Tensor:
        """All ``out_channels`` filters, the frozen ones first."""
        return torch.cat([self.frozen, self.weight])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.filters, None)


class ConvTokenizer(nn.Module):
    """``n_conv_layers`` x (conv ``k x k`` stride 1, [BatchNorm], activation, max-pool ``pool_kernel``/2), flattened:
    ``(B, C, H, W) -> (B, h*w, dim)``.

    Intermediate layers have ``conv_channels`` channels, the last ``dim``. The default is the paper's form (no
    norm, ReLU, 3x3 stride-2 max-pool, bias-free convs). ``norm="bn"``: a BatchNorm after each conv (Xiao et al.
    2021); ``pool_kernel=2``: 2x2 pools without overlap; ``pools=k``: pool after the first ``k`` layers only.
    ``init="whiten"``: the first conv's first ``2 C k^2`` filters start as whitening filters of the training
    images' patches and their negatives (:meth:`data_init`), the rest Kaiming; ``"whiten_frozen"`` keeps them
    fixed (a :class:`PartlyFrozenConv2d`), as airbench's frozen whitening layer; ``"kaiming"``: all Kaiming.
    """

    def __init__(self, in_chans: int, dim: int, n_conv_layers: int = 1, kernel_size: int = 3, conv_channels: int = 64,
                 norm: str = "none", act: str = "relu", pool_kernel: int = 3, pools: Optional[int] = None,
                 init: str = "kaiming"):
        super().__init__()
        if n_conv_layers < 1 or kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"need n_conv_layers >= 1 and an odd kernel_size, got {n_conv_layers}, {kernel_size}")
        pools = n_conv_layers if pools is None else pools
        if not 0 <= pools <= n_conv_layers:
            raise ValueError(f"unknown tokenizer pools {pools!r}: 0 to n_conv_layers ({n_conv_layers}) layers pool")
        for what, value, valid in (("norm", norm, NORMS), ("act", act, tuple(ACTS)), ("pool_kernel", pool_kernel, (2, 3)),
                                   ("init", init, INITS)):
            if value not in valid:
                raise ValueError(f"unknown tokenizer {what} {value!r}; valid: {', '.join(map(str, valid))}")
        chans = [in_chans] + [conv_channels] * (n_conv_layers - 1) + [dim]
        n_whiten = 2 * in_chans * kernel_size**2
        if init.startswith("whiten") and n_whiten > chans[1]:
            raise ValueError(f"tokenizer init {init!r} needs {n_whiten} filters in the first "
                             f"convolution ({kernel_size}x{kernel_size} patches of {in_chans} channels, and negatives); "
                             f"it has {chans[1]}")
        self.init = init
        layers = []
        for i, (cin, cout) in enumerate(zip(chans[:-1], chans[1:])):
            if i == 0 and init == "whiten_frozen" and n_whiten < cout:
                layers.append(PartlyFrozenConv2d(cin, cout, kernel_size, n_whiten, padding=kernel_size // 2))
            elif i == 0 and init == "whiten_frozen":  # every filter a whitening filter: the whole convolution is fixed
                layers.append(nn.Conv2d(cin, cout, kernel_size, padding=kernel_size // 2, bias=False).requires_grad_(False))
            else:
                layers.append(nn.Conv2d(cin, cout, kernel_size, stride=1, padding=kernel_size // 2, bias=False))
            if norm == "bn":
                layers.append(nn.BatchNorm2d(cout))
            layers.append(ACTS[act]())
            if i < pools:
                layers.append(nn.MaxPool2d(kernel_size=pool_kernel, stride=2, padding=1 if pool_kernel == 3 else 0))
        self.layers = nn.Sequential(*layers)
        self.n_conv_layers = n_conv_layers
        self.pools = pools
        self.pool_kernel = pool_kernel
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)

    @torch.no_grad()
    def data_init(self, images: torch.Tensor) -> None:
        """``init="whiten"`` or ``"whiten_frozen"``: set the first convolution's first filters from ``images``
        (normalised float ``(N, C, H, W)``); no-op otherwise."""
        if not self.init.startswith("whiten"):
            return
        conv = self.layers[0]
        filters = patch_whitening_filters(images, conv.kernel_size[0])
        target = conv.frozen if isinstance(conv, PartlyFrozenConv2d) else conv.weight
        target[: len(filters)] = filters.to(target.dtype)

    def grid_size(self, img_size: Tuple[int, int]) -> Tuple[int, int]:
        """Token grid for an ``img_size`` input: each max-pool (3, stride 2, pad 1) maps ``s`` to ``ceil(s/2)``."""
        h, w = img_size
        for _ in range(self.pools):
            if self.pool_kernel == 2:  # 2x2 stride 2, no padding: floor(s/2)
                h, w = h // 2, w // 2
            else:  # 3x3 stride 2 pad 1: ceil(s/2)
                h, w = (h - 1) // 2 + 1, (w - 1) // 2 + 1
        return h, w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).flatten(2).transpose(1, 2)  # (B, dim, h, w) -> (B, h*w, dim)


class CompactConvTransformer(TokenClassifier):
    """CCT: convolutional tokenizer + transformer + sequence pooling (Hassani et al., 2021, arXiv 2104.05704).

    Transformer options not named here (``mlp_ratio``, ``attn``, ``attn_kwargs``, ``drop_rate``,
    ``drop_path_rate``) are :class:`TokenClassifier`'s.
    """

    def __init__(self, num_classes: int = 10, img_size: Size = 32, in_chans: int = 3, n_conv_layers: int = 1,
                 kernel_size: int = 3, conv_channels: int = 64, dim: int = 256, depth: int = 7, num_heads: int = 4,
                 pool: str = "seq", attn_drop_rate: float = 0.1, tokenizer_norm: str = "none",
                 tokenizer_act: str = "relu", pool_kernel: int = 3, pools: Optional[int] = None,
                 tokenizer_init: str = "kaiming", **kwargs: Any):
        img_size = to_2tuple(img_size, "img_size")
        tokenizer = ConvTokenizer(in_chans, dim, n_conv_layers, kernel_size, conv_channels, tokenizer_norm,
                                  tokenizer_act, pool_kernel, pools, tokenizer_init)
        super().__init__(tokenizer, tokenizer.grid_size(img_size), img_size, num_classes, dim=dim, depth=depth,
                         num_heads=num_heads, pool=pool, attn_drop_rate=attn_drop_rate, **kwargs)
        self.needs_data_init = tokenizer_init.startswith("whiten")  # the trainer then calls data_init with training images

    def data_init(self, images_uint8: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> None:
        """Compute the tokenizer's whitening filters from training images (uint8 ``(N, C, H, W)``)."""
        from ..data.augment import normalize

        self.tokenizer.data_init(normalize(images_uint8, mean, std))


@register_model("cct_2", family="hybrid", cls=CompactConvTransformer)
def cct_2(**kwargs: Any) -> CompactConvTransformer:
    """CCT-2/3x2: two 3x3 conv layers (8x8 tokens), 2 blocks, dim 128, 2 heads, MLP ratio 1, ~0.28M parameters."""
    variant = dict(n_conv_layers=2, kernel_size=3, conv_channels=64, depth=2, dim=128, num_heads=2, mlp_ratio=1.0)
    return CompactConvTransformer(**dict(variant, **kwargs))


@register_model("cct_7", family="hybrid", cls=CompactConvTransformer)
def cct_7(**kwargs: Any) -> CompactConvTransformer:
    """CCT-7/3x1: one 3x3 conv layer (16x16 tokens), 7 blocks, dim 256, 4 heads, MLP ratio 2, ~3.8M parameters."""
    variant = dict(n_conv_layers=1, kernel_size=3, conv_channels=64, depth=7, dim=256, num_heads=4, mlp_ratio=2.0)
    return CompactConvTransformer(**dict(variant, **kwargs))

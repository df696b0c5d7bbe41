"""CIFAR ResNets with an attention slot in every residual block (before the residual add).

* ``resnet18`` / ``resnet34``: He et al. 2016 (arXiv 1512.03385) in the CIFAR form: 3x3 stem, no max-pool,
  four stages of BasicBlocks at widths 64-128-256-512.
* ``resnet_fast``: a small, fast CIFAR net for CPU budgets, shaped like the fastest known CIFAR-10 trainers
  (three groups at widths 64-256-256: conv, max-pool, BN, GELU, then one residual unit whose branch is a
  conv-BN with its BN scale zero-initialised, so each unit starts as identity).

``attention`` names a feature-map block (``visattn.list_attention("feature")``), or a list with one name per
stage (e.g. ``[none, none, nonlocal]``); ``attn_kwargs`` are passed to every block.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from ..attention import create_attention, list_attention
from ..registry import backbone_modules, register_model

AttnSpec = Union[str, Sequence[str]]


def _per_stage(attention: AttnSpec, num_stages: int) -> List[str]:
    names = [attention] * num_stages if isinstance(attention, str) else list(attention)
    if len(names) != num_stages:
        raise ValueError(f"attention lists {len(names)} stage(s); this model has {num_stages}")
    valid = list_attention("feature")
    for n in names:
        if n not in valid:
            raise ValueError(f"unknown feature-map attention {n!r}; valid: {', '.join(valid)}")
    return names


MAX_WIDTH = 16384  # channels of one layer


def _check_counts(name: str, values: Any, low: int, high: int = MAX_WIDTH, one: bool = False) -> None:
    """``values``: an int (``one``) or a non-empty list of ints, each in [low, high]; else a ValueError naming it."""
    vals = [values] if one else list(values) if isinstance(values, (list, tuple)) else None
    if not vals or any(isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high for v in vals):
        raise ValueError(f"{name} must be {'an integer' if one else 'a list of integers'} in [{low}, {high}], "
                         f"got {values!r}")


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN, then attention, then the residual add and ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, attention: str, attn_kwargs: Dict[str, Any]):
        super().__init__()
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.act = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.attn = create_attention(attention, cout, **attn_kwargs)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act(self.bn1(self.conv1(x)))
        out = self.attn(self.bn2(self.conv2(out)))
        return self.act(out + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(self, layers: Sequence[int], widths: Sequence[int] = (64, 128, 256, 512), num_classes: int = 10,
                 attention: AttnSpec = "none", attn_kwargs: Optional[Dict[str, Any]] = None, in_chans: int = 3):
        super().__init__()
        _check_counts("layers", layers, 1, 64)
        _check_counts("widths", widths, 1)
        if len(widths) != len(layers):
            raise ValueError(f"widths has {len(widths)} entries but there are {len(layers)} stages")
        names = _per_stage(attention, len(layers))
        kw = dict(attn_kwargs or {})
        self.stem = nn.Sequential(conv3x3(in_chans, widths[0]), nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True))
        stages, cin = [], widths[0]
        for i, (n, w) in enumerate(zip(layers, widths)):
            blocks = [BasicBlock(cin if j == 0 else w, w, (1 if i == 0 else 2) if j == 0 else 1, names[i], kw) for j in range(n)]
            stages.append(nn.Sequential(*blocks))
            cin = w
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        _init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


# Where a resnet_fast block sits (``attn_position``); every position keeps the module path ``...attn``
POSITIONS = {
    "unit_bn": "in each unit, after its BN: before the GELU (plain) or before the residual add (residual)",
    "unit_act": "in each unit, after its GELU (after the residual add): the group's output",
    "group_act": "after the group's conv-pool-BN-GELU, before its unit(s)",
}


class FastUnit(nn.Module):
    """One unit of a ``resnet_fast`` group: ``GELU(x + attn(BN(conv(x))))`` with the BN scale zero-initialised,
    so it starts as the identity; ``block="plain"`` (airbench's second conv, no residual):
    ``GELU(attn(BN(conv(x))))``. ``post_act``: the block after the GELU instead (``attn(GELU(...))``)."""

    def __init__(self, width: int, attention: str, attn_kwargs: Dict[str, Any], post_act: bool = False,
                 block: str = "residual"):
        super().__init__()
        self.residual = block == "residual"
        self.conv = conv3x3(width, width)
        self.bn = nn.BatchNorm2d(width)
        if self.residual:
            nn.init.zeros_(self.bn.weight)  # the branch starts at zero: the unit is an identity at init
        self.attn = create_attention(attention, width, **attn_kwargs)
        self.act = nn.GELU()
        self.post_act = post_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x))
        if self.post_act:
            return self.attn(self.act(x + h if self.residual else h))
        h = self.attn(h)
        return self.act(x + h if self.residual else h)


UNITS = ("residual", "plain")


class FastGroup(nn.Module):
    """conv3x3 -> max-pool 2 -> BN -> GELU -> unit(s); halves the resolution. The attention block goes where
    ``position`` says (:data:`POSITIONS`): into each unit, or (``"group_act"``) once, as ``self.attn``, between
    the GELU and the units. ``skip``: a residual connection around all the units (``h + units(h)``, airbench96's
    group of three convs with ``block="plain"`` and two units)."""

    def __init__(self, cin: int, cout: int, units: int, attention: str, attn_kwargs: Dict[str, Any],
                 block: str = "residual", position: str = "unit_bn", skip: bool = False):
        super().__init__()
        self.skip = skip
        self.conv = conv3x3(cin, cout)
        self.pool = nn.MaxPool2d(2)
        self.bn = nn.BatchNorm2d(cout)
        self.act = nn.GELU()
        in_group = position == "group_act"
        self.attn = create_attention(attention if in_group else "none", cout, **attn_kwargs)
        unit_attn, post = ("none" if in_group else attention), position == "unit_act"
        self.units = nn.Sequential(*[FastUnit(cout, unit_attn, attn_kwargs, post, block) for _ in range(units)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn(self.act(self.bn(self.pool(self.conv(x)))))
        return h + self.units(h) if self.skip else self.units(h)


class WhiteningStem(nn.Module):
    """A frozen 2x2 conv whose filters whiten 2x2 image patches (:func:`patch_whitening_filters`, Jordan 2024,
    arXiv 2404.00498); only its bias trains. :meth:`data_init` computes them before training; they are
    ordinary parameters afterwards, so a checkpoint carries them."""

    def __init__(self, in_chans: int = 3, patch: int = 2, eps: float = 5e-4):
        super().__init__()
        d = in_chans * patch * patch
        self.conv = nn.Conv2d(in_chans, 2 * d, patch, padding=0, bias=True)
        self.conv.weight.requires_grad_(False)
        self.conv._visattn_keep_init = True
        self.act = nn.GELU()
        self.eps = eps
        self.out_channels = 2 * d

    @torch.no_grad()
    def data_init(self, images: torch.Tensor) -> None:
        """``images``: normalised float ``(N, C, H, W)``."""
        filters = patch_whitening_filters(images, self.conv.kernel_size[0], self.eps)
        self.conv.weight.copy_(filters.to(self.conv.weight.dtype))
        self.conv.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(x))


@torch.no_grad()
def patch_whitening_filters(images: torch.Tensor, k: int, eps: float = 5e-4) -> torch.Tensor:
    """``(2 C k k, C, k, k)`` conv filters that whiten the ``k x k`` patches of ``images`` (normalised float
    ``(N, C, H, W)``): the patch covariance's eigenvectors scaled by ``1/sqrt(eigenvalue + eps)``, then their
    negatives (Jordan 2024, arXiv 2404.00498)."""
    c = images.shape[1]
    patches = images.float().unfold(2, k, 1).unfold(3, k, 1)  # (N, C, H', W', k, k)
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * k * k).double()
    patches = patches - patches.mean(0, keepdim=True)
    cov = patches.T @ patches / len(patches)
    evals, evecs = torch.linalg.eigh(cov)
    filters = (evecs.T / torch.sqrt(evals + eps)[:, None]).view(-1, c, k, k)  # (d, C, k, k)
    return torch.cat([filters, -filters]).float()


class FastResNet(nn.Module):
    """Stem (3x3 conv, or a frozen whitening 2x2 conv), three :class:`FastGroup`s, global max-pool, linear head.

    airbench94's options (Jordan 2024, arXiv 2404.00498), off by default: ``block="plain"`` (no residual),
    ``bn_momentum`` / ``bn_eps`` (airbench: 0.4, 1e-12), ``bn_scale="frozen"`` (BN scales fixed at 1),
    ``conv_init="dirac"`` (3x3 convs start as the identity on their first input channels),
    ``whiten_bias_epochs=N`` (the whitening bias trains for N epochs only), ``head_scale`` (airbench: 1/9);
    ``group_skip=True`` adds a residual around each group's units (airbench96: ``block="plain"``,
    ``units=(2, 2, 2)``, widths 128-512-512). They reach the backbone only: attention blocks keep their own
    initialisation, norms and trainability. ``attn_position`` (:data:`POSITIONS`) says where each group's
    block sits; ``attention`` as a list puts blocks in some groups only; ``attn_kwargs`` go to every block.
    """

    def __init__(self, widths: Sequence[int] = (64, 256, 256), units: Sequence[int] = (1, 1, 1), stem_width: int = 32,
                 num_classes: int = 10, attention: AttnSpec = "none", attn_kwargs: Optional[Dict[str, Any]] = None,
                 in_chans: int = 3, head_scale: float = 1.0, stem: str = "conv", block: str = "residual",
                 bn_momentum: float = 0.1, bn_eps: float = 1e-5, bn_scale: str = "learn", conv_init: str = "kaiming",
                 whiten_bias_epochs: int = 0, attn_position: str = "unit_bn", group_skip: bool = False):
        super().__init__()
        _check_counts("widths", widths, 1)
        _check_counts("units", units, 0, 64)
        _check_counts("stem_width", stem_width, 1, one=True)
        _check_fast_options(widths, units, stem, block, bn_scale, conv_init, attn_position, group_skip)
        _check_momentum(bn_momentum)
        names = _per_stage(attention, len(widths))
        kw = dict(attn_kwargs or {})
        if stem == "whiten":
            self.stem = WhiteningStem(in_chans)
            stem_width = self.stem.out_channels
        else:
            self.stem = nn.Sequential(conv3x3(in_chans, stem_width), nn.BatchNorm2d(stem_width), nn.GELU())
        self.needs_data_init = stem == "whiten"
        self.whiten_bias_epochs = whiten_bias_epochs if stem == "whiten" else 0
        groups, cin = [], stem_width
        for w, u, name in zip(widths, units, names):
            groups.append(FastGroup(cin, w, u, name, kw, block, attn_position, group_skip))
            cin = w
        self.layers = nn.Sequential(*groups)
        self.pool = nn.AdaptiveMaxPool2d(1)
        self.fc = nn.Linear(cin, num_classes, bias=False)
        self.head_scale = head_scale
        _init_weights(self, dirac=conv_init == "dirac")
        _configure_norms(self, bn_momentum, bn_eps, frozen_scale=bn_scale == "frozen")

    def data_init(self, images_uint8: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> None:
        """Compute the whitening stem from training images (uint8 ``(N, C, H, W)``); no-op for a conv stem."""
        if isinstance(self.stem, WhiteningStem):
            from ..data.augment import normalize

            self.stem.data_init(normalize(images_uint8, mean, std))

    def set_epoch(self, epoch: int) -> None:
        """Called by the trainer before each epoch (0-based): freezes the whitening bias after its epochs."""
        if self.whiten_bias_epochs and isinstance(self.stem, WhiteningStem):
            self.stem.conv.bias.requires_grad_(epoch < self.whiten_bias_epochs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1)) * self.head_scale


def _check_fast_options(widths: Sequence[int], units: Sequence[int], stem: str, block: str, bn_scale: str,
                        conv_init: str, attn_position: str = "unit_bn", group_skip: bool = False) -> None:
    if len(widths) != len(units):
        raise ValueError(f"widths has {len(widths)} entries but units has {len(units)}")
    for what, value, valid in (("stem", stem, ("conv", "whiten")), ("block", block, UNITS),
                               ("bn_scale", bn_scale, ("learn", "frozen")), ("conv_init", conv_init, ("kaiming", "dirac")),
                               ("attn_position", attn_position, tuple(POSITIONS))):
        if value not in valid:
            raise ValueError(f"{what} must be one of {', '.join(valid)}, not {value!r}")
    if not isinstance(group_skip, bool):
        raise ValueError(f"group_skip must be true or false, not {group_skip!r}")
    if group_skip and 0 in units:
        raise ValueError("group_skip needs at least one unit in every group (units has a 0)")


def _check_momentum(momentum: Any) -> None:
    """BatchNorm's running-statistics momentum (Ioffe & Szegedy 2015, "Batch Normalization", arXiv 1502.03167):
    in (0, 1], as package models take it. At 0 the statistics evaluation uses never move from their start (mean
    0, variance 1) however long the run trains, so 0 is refused rather than taken."""
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 < momentum <= 1:
        raise ValueError(f"bn_momentum must be a number in (0, 1] (BatchNorm's running-statistics momentum; at 0 the "
                         f"statistics evaluation uses never move), not {momentum!r}")


def _configure_norms(model: nn.Module, momentum: float, eps: float, frozen_scale: bool) -> None:
    """The backbone's BatchNorms (not those inside attention blocks, which keep their own)."""
    for m in backbone_modules(model):
        if isinstance(m, nn.BatchNorm2d):
            m.momentum, m.eps = momentum, eps
            if frozen_scale:
                nn.init.ones_(m.weight)
                m.weight.requires_grad_(False)


def _init_weights(model: nn.Module, dirac: bool = False) -> None:
    """Kaiming-normal convs; with ``dirac``, each 3x3 conv's first ``in_channels`` filters pass their input
    channel through unchanged (airbench's identity initialisation). Attention blocks keep their own
    initialisation (:func:`visattn.registry.backbone_modules`)."""
    for m in backbone_modules(model):
        if isinstance(m, nn.Conv2d) and m.weight.requires_grad and not hasattr(m, "_visattn_keep_init"):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if dirac and m.kernel_size == (3, 3) and m.out_channels >= m.in_channels and m.groups == 1:
                with torch.no_grad():
                    nn.init.dirac_(m.weight[: m.in_channels])


@register_model("resnet18", family="cnn", cls=CifarResNet)
def resnet18(**kwargs: Any) -> CifarResNet:
    """CIFAR ResNet-18 (11.2M parameters): BasicBlocks [2, 2, 2, 2] at widths 64-128-256-512."""
    return CifarResNet(**dict(dict(layers=(2, 2, 2, 2)), **kwargs))


@register_model("resnet34", family="cnn", cls=CifarResNet)
def resnet34(**kwargs: Any) -> CifarResNet:
    """CIFAR ResNet-34 (21.3M parameters): BasicBlocks [3, 4, 6, 3]."""
    return CifarResNet(**dict(dict(layers=(3, 4, 6, 3)), **kwargs))


@register_model("resnet_fast", family="cnn", cls=FastResNet)
def resnet_fast(**kwargs: Any) -> FastResNet:
    """Small fast CIFAR ResNet (about 2M parameters at widths 64-256-256) for CPU budgets.

    ``stem="whiten"`` replaces the 3x3 stem conv with a frozen patch-whitening 2x2 conv computed from the
    training images (the trainer calls ``data_init`` before the first step).
    """
    return FastResNet(**kwargs)

"""Reuse visattn's feature-map blocks in other people's CNNs.

* :func:`attn_layer`: a callable for timm ResNet's ``attn_layer`` slot
  (``timm.create_model("resnet18", block_args=dict(attn_layer=attn_layer("cbam")))``); timm calls it as
  ``attn_layer(channels, device=..., dtype=...)`` and applies the block after the branch's last BN.
* :func:`insert_attention`: one block per residual block of a built CNN, found in its forward
  (:mod:`visattn.attention.structure`), after the residual branch's last norm, before the add; the model's own
  SE modules are kept (``replace_se=True`` replaces them). ``at=`` puts one after each named module of any model. The slot per family is tabled in
  docs/blocks.md; ConvNeXt's only norm sits mid-branch, channels-last, so there the block goes at the end of
  the branch, before the layer scale.
"""
from __future__ import annotations

import difflib
import fnmatch
import inspect
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..own_options import RULES, check_own
from ..registry import ATTENTION, attention_info, attention_options, create_attention, list_attention
from . import structure
from .functional import NORMS_WITH_STATS

__all__ = ["attn_layer", "insert_attention", "AttnLayer", "PLACEMENT", "RULES", "SUPPORTED_FAMILIES", "check_sites",
           "structural_sites"]

# RULES (visattn.own_options): "auto": the sites found in the model's forward (visattn.attention.structure), each
# in a block of a family below installed by that family's rule (its module paths and state-dict names as before);
# "structure": the found sites alone, each as AttnAfter(<module>, <block>) (names kept); "family": the family
# rules alone

# the default rule's name, recorded with results: "se-slot" puts blocks in inverted residuals at the family's SE
# slot, in blocks with a skip (before it, every such block had one after its projection norm)
PLACEMENT = "se-slot"

SUPPORTED_FAMILIES = (
    "torchvision and timm ResNet (BasicBlock / Bottleneck), RegNet (X and Y), ConvNeXt, EfficientNet and "
    "MobileNetV3, and torchvision MobileNetV2"
)


def _check_feature_block(name: str, kwargs: Dict[str, Any]) -> None:
    if not isinstance(name, str) or name not in list_attention():
        raise ValueError(f"unknown attention block {name!r}; valid: {', '.join(list_attention('feature'))}")
    if attention_info(name).get("layout") != "feature":
        raise ValueError(
            f"{name!r} is a token block; a CNN needs a feature-map block: {', '.join(list_attention('feature'))}"
        )
    ATTENTION.check_options(name, kwargs)


class AttnLayer:
    """``AttnLayer(name, **kwargs)(channels)`` builds ``create_attention(name, channels, **kwargs)``.

    Also takes timm's ``device`` / ``dtype`` keywords and moves the block accordingly. A plain picklable
    object (not a closure), so models built with it can be deep-copied and pickled.
    """

    def __init__(self, name: str, **kwargs: Any):
        _check_feature_block(name, kwargs)
        self.name = name
        self.kwargs = kwargs

    def __call__(
        self, channels: int, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None, **kwargs: Any
    ) -> nn.Module:
        block = create_attention(self.name, channels, **{**self.kwargs, **kwargs})
        if device is not None or dtype is not None:
            block = block.to(device=device, dtype=dtype)
        return block

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
        return f"attn_layer({self.name!r}{opts})"


def attn_layer(name: str, **kwargs: Any) -> AttnLayer:
    """A callable ``(channels, **kw) -> block`` for timm ResNet's ``attn_layer`` (checked now, built per block)."""
    return AttnLayer(name, **kwargs)


class AttnAfter(nn.Module):
    """``attn(inner(x))``; with ``channels_last=True`` the tensor is ``(B, H, W, C)`` (timm ConvNeXt's MLP
    layout) and the block sees it permuted to ``(B, C, H, W)``. Fills a parameter-free slot (``inner``, a
    dropout or identity), so the host model's parameter names stay the same.

    ``keep_names=True`` (for a slot whose module has weights: a family's own SE, which the block follows) keeps
    them the same too: the state dict holds ``inner``'s tensors under this module's own name (``se.fc1.weight``,
    not ``se.inner.fc1.weight``), beside the block's (``se.attn.*``), so weights saved before the block went in
    load into the model after, and the other way round; a state dict in the ``inner.`` form loads as well.
    """

    def __init__(self, inner: nn.Module, attn: nn.Module, channels_last: bool = False, keep_names: bool = False):
        super().__init__()
        self.inner = inner
        self.attn = attn
        self.channels_last = channels_last
        self.keep_names = keep_names and not any(n == "attn" for n, _ in inner.named_children())
        if self.keep_names:
            self.register_state_dict_post_hook(_inner_names_out)
            self.register_load_state_dict_pre_hook(_inner_names_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inner(x)
        if self.channels_last:
            return self.attn(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        return self.attn(x)

    def extra_repr(self) -> str:
        return f"channels_last={self.channels_last}" + (", keep_names=True" if self.keep_names else "")


def _inner_names_out(module: AttnAfter, state: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    inner = prefix + "inner."
    for key in [k for k in state if k.startswith(inner)]:
        state[prefix + key[len(inner):]] = state.pop(key)


def _inner_names_in(module: AttnAfter, state: Dict[str, Any], prefix: str, *args: Any) -> None:
    own = (prefix + "inner.", prefix + "attn.")
    for key in [k for k in state if k.startswith(prefix) and not k.startswith(own)]:
        state[prefix + "inner." + key[len(prefix):]] = state.pop(key)


# ---- where blocks go ----------------------------------------------------------------------------------------

# A site: (module path for messages, channels, a tensor whose device/dtype the block takes, the host's
# train/eval mode, a function that installs the built block, or None if the site is already taken).
Site = Tuple[str, int, Optional[torch.Tensor], bool, Optional[Callable[[nn.Module], None]]]


def _first_param(module: nn.Module) -> Optional[torch.Tensor]:
    return next(iter(module.parameters()), None)


def _se_channels(module: nn.Module) -> Optional[int]:
    """Input width of a torchvision / timm squeeze-and-excitation module, ``None`` for anything else."""
    import timm.layers.squeeze_excite as timm_se
    import timm.models._efficientnet_blocks as timm_eff
    from torchvision.ops.misc import SqueezeExcitation

    if isinstance(module, (SqueezeExcitation, timm_se.SEModule)):
        return module.fc1.in_channels
    if isinstance(module, timm_se.EffectiveSEModule):
        return module.fc.in_channels
    if isinstance(module, timm_eff.SqueezeExcite):
        return module.conv_reduce.in_channels
    return None


def _se_sites(model: nn.Module) -> List[Site]:
    sites: List[Site] = []
    parents = dict(model.named_modules())
    for path, module in model.named_modules():
        channels = _se_channels(module)
        if channels is None:
            continue
        parent_path, _, attr = path.rpartition(".")
        parent = parents[parent_path]

        def install(block: nn.Module, parent: nn.Module = parent, attr: str = attr) -> None:
            setattr(parent, attr, block)  # same name, same place (also inside a Sequential)

        sites.append((path, channels, _first_param(module), parent.training, install))
    return sites


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, (NORMS_WITH_STATS, nn.LayerNorm, nn.GroupNorm))


def _conv_norm_site(path: str, seq: nn.Sequential, host: nn.Module) -> Optional[Site]:
    """After a torchvision conv-norm ``Sequential`` with no activation (``Conv2dNormActivation``): appended to
    it; taken if it already ends in a block; ``None`` (no site) if it ends in anything else."""
    if isinstance(seq[-1], _visattn_classes()):
        return (f"{path}.{len(seq) - 1}", 0, None, host.training, None)
    if len(seq) != 2 or not _is_norm(seq[-1]):
        return None
    return (f"{path}.{len(seq)}", seq[0].out_channels, seq[0].weight, host.training, lambda a, seq=seq: seq.append(a))


def _after_site(path: str, parent: nn.Module, attr: str, channels: int, like: Optional[torch.Tensor],
                host: nn.Module, channels_last: bool = False) -> Site:
    """In a parameter-free slot ``parent.attr`` (an identity, dropout or drop path, or ``None``): it becomes
    ``AttnAfter(<slot>, <block>)``, so the host's parameter names stay the same; taken if it already is one."""
    slot = getattr(parent, attr)

    def install(a: nn.Module) -> None:
        setattr(parent, attr, AttnAfter(slot if slot is not None else nn.Identity(), a, channels_last=channels_last))

    return (f"{path}.{attr}", channels, like, host.training, None if isinstance(slot, AttnAfter) else install)


# ---- inverted residuals (MobileNetV2/V3, EfficientNet, MBConv): the family's own SE slot ------------------------
#
# Their SE sits inside the block, in the expanded width, after the depthwise conv (MobileNetV3, Howard et al. 2019;
# EfficientNet, Tan & Le 2019), and Coordinate Attention goes there in MobileNetV2 (Hou et al. 2021). So does the
# block: after the model's own SE where it has one (kept, its parameter names too), else in its place; only in
# blocks with a skip, since in a block without one that slot is on the network's only path (docs/blocks.md).


def _timm_inverted_site(path: str, block: nn.Module) -> Optional[Site]:
    """timm's InvertedResidual, DepthwiseSeparableConv and EdgeResidual (and their subclasses, CondConv's):
    ``block.se`` (an identity, or the model's SE) becomes ``AttnAfter(se, <block>)``, its names kept."""
    if not getattr(block, "has_skip", False) or not isinstance(getattr(block, "se", None), nn.Module):
        return None
    project = block.conv_pw if isinstance(block, _timm_dsconv()) else block.conv_pwl
    se = block.se

    def install(a: nn.Module) -> None:
        block.se = AttnAfter(se, a, keep_names=True)

    return (f"{path}.se", project.in_channels, _first_param(project), block.training,  # (MixedConv2d: no .weight)
            None if isinstance(se, (AttnAfter, *_visattn_classes())) else install)


def _timm_dsconv() -> type:
    import timm.models._efficientnet_blocks as tm_eff

    return tm_eff.DepthwiseSeparableConv


def _is_depthwise(module: nn.Module) -> bool:
    conv = module[0] if isinstance(module, nn.Sequential) and len(module) else None
    return isinstance(conv, nn.Conv2d) and conv.groups > 1 and conv.groups == conv.in_channels


def _tv_inverted_site(path: str, block: nn.Module, attr: str = "block") -> Optional[Site]:
    """torchvision's MBConv, FusedMBConv and MobileNetV3 InvertedResidual (``block.block``: [expand], depthwise,
    [SE], project) and MobileNetV2's (``block.conv``): after the SE, kept (``AttnAfter(se, <block>)``, its names
    kept), else appended to the depthwise conv-norm-activation (FusedMBConv: to its fused expansion; one with no
    expansion has no site)."""
    from torchvision.ops.misc import SqueezeExcitation

    seq = getattr(block, attr)
    path = f"{path}.{attr}"
    if not getattr(block, "use_res_connect", False):
        return None
    for i, layer in enumerate(seq):
        if isinstance(layer, (SqueezeExcitation, AttnAfter)):
            def install(a: nn.Module, i: int = i, layer: nn.Module = layer) -> None:
                seq[i] = AttnAfter(layer, a, keep_names=True)

            return (f"{path}.{i}", layer.inner.fc1.in_channels if isinstance(layer, AttnAfter) else
                    layer.fc1.in_channels, _first_param(layer), block.training,
                    None if isinstance(layer, AttnAfter) else install)
    if any(_is_depthwise(layer) for layer in seq):
        index = next(i for i, layer in enumerate(seq) if _is_depthwise(layer))
    elif len(seq) > 1:  # FusedMBConv: its fused expansion (no depthwise conv, no SE)
        index = 0
    else:
        return None
    cna = seq[index]  # conv, norm, activation: the block is appended, the indices of the rest stay
    if isinstance(cna[-1], _visattn_classes()):
        return (f"{path}.{index}.{len(cna) - 1}", 0, None, block.training, None)
    return (f"{path}.{index}.{len(cna)}", cna[0].out_channels, cna[0].weight, block.training,
            lambda a, cna=cna: cna.append(a))


def earlier_sites(model: nn.Module) -> List[str]:
    """Where visattn's earlier rule (before the SE-slot rule) put a block in ``model``'s inverted residuals:
    after every such block's projection norm, skip or not (timm: ``<block>.bn3.act`` / ``.bn2.act``;
    torchvision: appended to the last conv-norm, ``<block>.block.<last>.2``)."""
    import timm.models._efficientnet_blocks as tm_eff
    import torchvision.models.efficientnet as tv_efficientnet
    import torchvision.models.mobilenetv3 as tv_mobilenetv3

    out = []
    for path, block in model.named_modules():
        if isinstance(block, (tm_eff.InvertedResidual, tm_eff.EdgeResidual)):
            out.append(f"{path}.bn3.act" if isinstance(block, tm_eff.InvertedResidual) else f"{path}.bn2.act")
        elif isinstance(block, tm_eff.DepthwiseSeparableConv):
            out.append(f"{path}.bn2.act")
        elif isinstance(block, (tv_efficientnet.MBConv, tv_efficientnet.FusedMBConv, tv_mobilenetv3.InvertedResidual)):
            out.append(f"{path}.block.{len(block.block) - 1}.2")
    return out


def check_sites(model: nn.Module, keys: Sequence[str], what: str) -> None:
    """A ``ValueError`` naming ``what`` (a checkpoint) if its state-dict ``keys`` hold attention weights at the
    sites of visattn's earlier rule for ``model``'s inverted residuals, which this version builds elsewhere:
    such a checkpoint is refused in one line, never loaded into blocks at other places."""
    sites = earlier_sites(model)
    held = sorted({s for s in sites for k in keys if k.startswith(s + ".")})
    if held:
        raise ValueError(
            f"{what} was trained with visattn's earlier placement in inverted residuals (a block after each block's "
            f"projection, e.g. {held[0]!r}); this version puts blocks at the SE slot after the depthwise conv, in "
            "blocks with a skip (docs/blocks.md#where-the-blocks-go), so its weights have no place here: use the "
            "visattn revision it was trained with (run_info.json's git), or train it again")


def _residual_sites(model: nn.Module) -> List[Site]:
    """One site per residual block: after the branch's last norm (after the model's own SE, which is kept), and
    in inverted residuals with a skip at the family's SE slot (after their SE, which is kept)."""
    import timm.models._efficientnet_blocks as tm_eff
    import timm.models.convnext as tm_convnext
    import timm.models.regnet as tm_regnet
    import timm.models.resnet as tm_resnet
    import torchvision.models.convnext as tv_convnext
    import torchvision.models.efficientnet as tv_efficientnet
    import torchvision.models.mobilenetv2 as tv_mobilenetv2
    import torchvision.models.mobilenetv3 as tv_mobilenetv3
    import torchvision.models.regnet as tv_regnet
    import torchvision.models.resnet as tv_resnet
    from torchvision.ops.misc import Permute

    timm_inverted = (tm_eff.InvertedResidual, tm_eff.DepthwiseSeparableConv, tm_eff.EdgeResidual)
    sites: List[Optional[Site]] = []
    for path, block in model.named_modules():
        kind = type(block)
        if kind in (tv_resnet.BasicBlock, tv_resnet.Bottleneck):
            attr = "bn2" if kind is tv_resnet.BasicBlock else "bn3"
            norm = getattr(block, attr)
            free = isinstance(norm, NORMS_WITH_STATS)

            def install(a, block=block, attr=attr, norm=norm):
                setattr(block, attr, nn.Sequential(OrderedDict(norm=norm, attn=a)))

            sites.append((f"{path}.{attr}", norm.num_features if free else 0, norm.weight if free else None,
                          block.training, install if free else None))
        elif kind in (tm_resnet.BasicBlock, tm_resnet.Bottleneck):
            norm = block.bn2 if kind is tm_resnet.BasicBlock else block.bn3
            if block.se is not None and not isinstance(block.se, _visattn_classes()):  # its own SE: kept, followed
                sites.append(_after_site(path, block, "drop_path", norm.num_features, norm.weight, block))
                continue

            def install(a, block=block):
                block.se = a

            sites.append((f"{path}.se", norm.num_features, norm.weight, block.training,
                          install if block.se is None else None))
        elif kind is tv_regnet.ResBottleneckBlock:  # f: a, b, (RegNet-Y: se), c = the branch's last conv-BN
            sites.append(_conv_norm_site(f"{path}.f.c", block.f.c, block))
        elif kind in (tv_efficientnet.MBConv, tv_efficientnet.FusedMBConv, tv_mobilenetv3.InvertedResidual):
            sites.append(_tv_inverted_site(path, block))
        elif kind is tv_mobilenetv2.InvertedResidual:
            sites.append(_tv_inverted_site(path, block, "conv"))
        elif kind is tm_regnet.Bottleneck:
            conv3 = block.conv3  # ConvNormAct: conv, norm, then its optional `aa` slot (empty here)

            def install(a, conv3=conv3):
                conv3.aa = a

            sites.append((f"{path}.conv3.aa", conv3.conv.out_channels, conv3.conv.weight, block.training,
                          install if getattr(conv3, "aa", None) is None else None))
        elif isinstance(block, timm_inverted):
            sites.append(_timm_inverted_site(path, block))
        elif kind is tv_convnext.CNBlock:
            seq = block.block  # dwconv, permute, LN, linear, GELU, linear, permute back to (B, C, H, W)
            free = isinstance(seq[-1], Permute)
            sites.append((f"{path}.block", seq[0].out_channels, seq[0].weight, block.training,
                          (lambda a, seq=seq: seq.append(a)) if free else None))
        elif kind is tm_convnext.ConvNeXtBlock:
            mlp = block.mlp
            tail = getattr(mlp, "drop2", None)  # the MLP's last, parameter-free layer
            if isinstance(tail, (nn.Dropout, nn.Identity, AttnAfter)):
                sites.append(_after_site(f"{path}.mlp", mlp, "drop2", block.conv_dw.out_channels,
                                         block.conv_dw.weight, block, channels_last=not block.use_conv_mlp))
    return [site for site in sites if site is not None]


def _family_types() -> tuple:
    """The block types the family rules (:func:`_residual_sites`) know."""
    import timm.models._efficientnet_blocks as tm_eff
    import timm.models.convnext as tm_convnext
    import timm.models.regnet as tm_regnet
    import timm.models.resnet as tm_resnet
    import torchvision.models.convnext as tv_convnext
    import torchvision.models.efficientnet as tv_efficientnet
    import torchvision.models.mobilenetv2 as tv_mobilenetv2
    import torchvision.models.mobilenetv3 as tv_mobilenetv3
    import torchvision.models.regnet as tv_regnet
    import torchvision.models.resnet as tv_resnet

    return (tv_resnet.BasicBlock, tv_resnet.Bottleneck, tm_resnet.BasicBlock, tm_resnet.Bottleneck,
            tv_regnet.ResBottleneckBlock, tv_efficientnet.MBConv, tv_efficientnet.FusedMBConv,
            tv_mobilenetv3.InvertedResidual, tv_mobilenetv2.InvertedResidual, tm_regnet.Bottleneck,
            tm_eff.InvertedResidual, tm_eff.DepthwiseSeparableConv, tm_eff.EdgeResidual, tv_convnext.CNBlock,
            tm_convnext.ConvNeXtBlock, tm_eff.ConvBnAct)  # ConvBnAct: EfficientNetV2's stage 0, no site (as before)


def structural_sites(model: nn.Module, tr: Optional[structure.Trace] = None) -> List[Site]:
    """The sites :func:`visattn.attention.structure.find_sites` finds in ``model``'s forward, each installed as
    ``AttnAfter(<module>, <block>, keep_names=True)`` (parameter names kept). Raises ``TraceError`` if the
    model does not run on the probe."""
    modules = dict(model.named_modules())
    fallback = _first_param(model)
    sites: List[Site] = []
    for found in structure.find_sites(model, tr):
        module = modules[found.path]
        parent_path, _, attr = found.path.rpartition(".")
        parent = modules[parent_path]
        like = next((t for t in (_first_param(modules[found.anchor]), _first_param(parent)) if t is not None), fallback)

        def install(a: nn.Module, parent: nn.Module = parent, attr: str = attr, last: bool = found.channels_last) -> None:
            setattr(parent, attr, AttnAfter(getattr(parent, attr), a, channels_last=last, keep_names=True))

        taken = isinstance(module, (AttnAfter, *_visattn_classes()))
        sites.append((found.path, found.channels, like, parent.training, None if taken else install))
    return sites


def _auto_sites(model: nn.Module, rule: str) -> List[Site]:
    """The default rule: the structural sites, a family's rule inside the blocks it knows; the family rules
    alone, with one warning line, where the model does not run on the probe."""
    if rule == "family":
        return _residual_sites(model)
    try:
        found = structural_sites(model)
    except structure.TraceError as e:
        sites = _residual_sites(model)
        if sites:  # else the refusal is the one line
            warnings.warn(f"insert_attention: {type(model).__name__} did not run on a probe image ({e}); its "
                          "sites come from the family rules alone", stacklevel=3)
        return sites
    if rule == "structure":
        return found
    known = _family_types()
    blocks = [p + "." for p, m in model.named_modules() if p and isinstance(m, known)]
    return _residual_sites(model) + [s for s in found if not any(s[0].startswith(b) for b in blocks)]


def _nearest_modules(model: nn.Module, n: int = 3) -> str:
    """A few of ``model``'s modules that ``at=`` takes (its last convs and norms of (B, C, H, W) output)."""
    names = [p for p, m in model.named_modules() if p and _out_channels(m) is not None and not list(m.children())]
    return ", ".join(repr(p) for p in names[-n:]) or "none of (B, C, H, W) output"


def _out_channels(module: nn.Module) -> Optional[int]:
    """How many channels a module's ``(B, C, H, W)`` output has, where its type says: a 2-d conv, a batch or
    group norm, timm's ``LayerNorm2d`` (a channels-first layer norm; a plain ``LayerNorm`` is channels-last and
    refused), or a ``Sequential`` (e.g. torchvision's ``Conv2dNormActivation``) ending in one of those and
    parameter-free layers."""
    from timm.layers import LayerNorm2d

    if isinstance(module, LayerNorm2d):
        return module.normalized_shape[0]
    if isinstance(module, nn.Conv2d):
        return module.out_channels
    if isinstance(module, (nn.BatchNorm2d, nn.SyncBatchNorm, nn.InstanceNorm2d)):
        return module.num_features
    if isinstance(module, nn.GroupNorm):
        return module.num_channels
    if isinstance(module, nn.Sequential):
        for child in reversed(module):
            width = _out_channels(child)
            if width is not None or _first_param(child) is not None:
                return width
    return None


def _named_sites(model: nn.Module, at: Union[str, Sequence[str]]) -> List[Site]:
    """One site after each module of ``model`` named by ``at`` (names as in ``named_modules()``, or
    ``fnmatch`` patterns such as ``"layer*.0.bn2"``); the module becomes ``AttnAfter(inner=<module>, attn=...)``."""
    patterns = [at] if isinstance(at, str) else list(at) if isinstance(at, (list, tuple)) else [at]
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"at= takes module names or patterns (non-empty strings), got {at!r}")
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    picked: List[str] = []
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            near = difflib.get_close_matches(pattern, names, n=3) or names[:3]
            raise ValueError(f"at={pattern!r} names no module of {type(model).__name__}; "
                             f"modules are named like {', '.join(map(repr, near))} (see model.named_modules())")
        picked += [n for n in hits if n not in picked]
    _check_occupied(model, modules, picked)
    sites: List[Site] = []
    for path in picked:
        module, channels = modules[path], _out_channels(modules[path])
        taken = _holds_block(module)  # a block, a module with one after it, a Sequential ending in one
        if channels is None and not taken:
            raise ValueError(f"at={path!r}: cannot tell how many channels {type(module).__name__} outputs; name a "
                             "Conv2d, a BatchNorm2d, GroupNorm or timm LayerNorm2d, or a Sequential ending in one")
        parent_path, _, attr = path.rpartition(".")

        def install(block: nn.Module, parent: nn.Module = modules[parent_path], attr: str = attr) -> None:
            setattr(parent, attr, AttnAfter(getattr(parent, attr), block))

        sites.append((path, channels or 0, _first_param(module), module.training, None if taken else install))
    return sites


# ---- occupied sites: at most one block after a module ------------------------------------------------------------


def _holds_block(module: nn.Module) -> bool:
    """``module`` is a block, an ``AttnAfter``, or a ``Sequential`` whose output is a block's (its last module)."""
    while isinstance(module, nn.Sequential) and len(module) and not isinstance(module, _visattn_classes()):
        module = module[-1]
    return isinstance(module, (AttnAfter, *_visattn_classes()))


def _occupied(modules: Dict[str, nn.Module], path: str) -> Optional[str]:
    """Why a block after module ``path`` would sit where visattn put one already, else ``None``: the path lies
    inside a block; or the module's output (or that of the ``Sequential`` it ends) goes straight into one, as the
    ``inner`` of an ``AttnAfter``, or followed by a block in its ``Sequential`` (a family rule's ``bn2.norm``)."""
    blocks = _visattn_classes()
    parts = path.split(".")
    for i in range(1, len(parts)):
        above = modules[".".join(parts[:i])]
        if isinstance(above, blocks) or (isinstance(above, AttnAfter) and parts[i] == "attn"):
            inside = ".".join(parts[:i + (not isinstance(above, blocks))])
            return f"it lies inside the attention block {inside!r}"
    while path:
        parent_path, _, attr = path.rpartition(".")
        parent = modules[parent_path]
        if isinstance(parent, AttnAfter) and attr == "inner":
            return f"the attention block {parent_path + '.attn'!r} already follows it"
        if not isinstance(parent, nn.Sequential) or isinstance(parent, blocks):
            return None
        names = list(parent._modules)
        if names.index(attr) + 1 < len(names):  # not its Sequential's last: the next module takes its output
            after = names[names.index(attr) + 1]
            nxt = f"{parent_path}.{after}" if parent_path else after
            return f"the attention block {nxt!r} already follows it" if isinstance(parent._modules[after], blocks) else None
        path = parent_path  # the Sequential's output is this module's
    return None


def _fed_blocks(model: nn.Module, paths: Sequence[str]) -> Dict[str, str]:
    """Of ``paths``, those whose output goes straight into a visattn block in ``model``'s forward (one probe
    image: timm's ``se`` slot after ``bn2``, which no module path shows), each with that block's path; ``{}``
    where the model does not run on the probe (the paths' structure is then all that is checked)."""
    try:
        tr = structure.trace(model)
    except structure.TraceError:
        return {}
    into: Dict[Any, str] = {}
    for call in tr.calls:
        if isinstance(call.module, _visattn_classes()) and call.in_key is not None:
            into.setdefault(call.in_key, call.path)
    wanted = set(paths)
    return {c.path: into[c.out_key] for c in tr.calls
            if c.path in wanted and c.out_key is not None and into.get(c.out_key, c.path) != c.path}


def _check_occupied(model: nn.Module, modules: Dict[str, nn.Module], picked: List[str]) -> None:
    """A ValueError if a module ``at=`` names is an occupied site (:func:`_occupied`, :func:`_fed_blocks`), or two
    of them give the same output (a ``Sequential`` and its last module): a second block would follow the first,
    gating what it already gated. Refused, not replaced: the block there may hold trained weights."""
    free = [p for p in picked if not _holds_block(modules[p])]  # a block or AttnAfter itself: refused as taken
    why = {p: w for p in free if (w := _occupied(modules, p))}
    if not why and any(isinstance(m, _visattn_classes()) for m in modules.values()):
        why = {p: f"the attention block {b!r} already takes its output" for p, b in _fed_blocks(model, free).items()}
    if why:
        path = next(p for p in picked if p in why)
        raise ValueError(f"at={path!r} is an occupied site: {why[path]}; insert_attention puts one block after a "
                         "module (insert into a fresh model, or name another module)")
    ends = {p: _output_of(modules, p) for p in picked}
    same = [(p, q) for p in picked for q in picked if p < q and ends[p] == ends[q]]
    if same:
        raise ValueError(f"at= names both {same[0][0]!r} and {same[0][1]!r}, which give the same output (a "
                         "Sequential and its last module): two blocks would follow it; name one of them")


def _output_of(modules: Dict[str, nn.Module], path: str) -> str:
    """The path of the module whose output module ``path`` returns (a ``Sequential``'s: its last module's)."""
    module = modules[path]
    while isinstance(module, nn.Sequential) and len(module) and not isinstance(module, _visattn_classes()):
        path, module = f"{path}.{list(module._modules)[-1]}", module[-1]
    return path


def _visattn_classes() -> tuple:
    return tuple(c for c in (ATTENTION.get(n) for n in list_attention()) if inspect.isclass(c))


def insert_attention(model: nn.Module, name: str, at: Union[str, Sequence[str], None] = None,
                     replace_se: bool = False, rule: str = "auto", **kwargs: Any) -> int:
    """Put block ``name`` (built with ``kwargs``) into any residual CNN, or after the modules ``at`` names in
    any model; returns how many were put.

    The sites are found in the model's own forward (:mod:`visattn.attention.structure`): one block per residual
    branch, after its last norm, before the add, and in inverted residuals with a skip at the family's SE slot;
    a model with neither (VGG, DenseNet, a plain ViT) is refused in one line. In the blocks of the families with
    a rule of their own (torchvision and timm ResNet, RegNet, ConvNeXt, EfficientNet, MobileNetV2/V3) the
    sites are the same and that rule installs them (the slot per family: docs/blocks.md; parameter names are
    kept except in torchvision ResNets, whose last BN becomes ``bnX.norm``, so load pretrained weights first);
    elsewhere the module a block follows becomes ``AttnAfter`` with its parameter names kept. A model that does
    not run on the probe image gets the family rules, with one warning line. ``rule``: ``"auto"`` (that),
    ``"structure"`` (the found sites alone, every one as ``AttnAfter``) or ``"family"`` (the family rules
    alone). The model's own SE modules are kept, trained weights and all; the block follows.

    Blocks are built with ``init="identity"`` unless ``kwargs`` say otherwise, so a trained network computes
    exactly what it did before (bit-identical in eval mode) and training moves the blocks from there.

    ``replace_se``: put the block in each SE's place instead, built for the SE's input width; this **drops the
    SEs' trained weights** (for a model trained from scratch).

    ``at``: module names of ``model.named_modules()`` (or ``fnmatch`` patterns, ``"body.*.bn2"``): one block
    after each, in any model, instead of the family rule. Each must output ``(B, C, H, W)`` and be a
    ``Conv2d``, ``BatchNorm2d``, ``GroupNorm``, timm ``LayerNorm2d`` or a ``Sequential`` ending in one; it
    becomes ``AttnAfter(inner=<module>, attn=<block>)`` (its parameters move to ``<name>.inner.*``). ``at`` may
    add blocks to a model that already holds some.

    New blocks are trainable, on the device and dtype of the layer they follow, in the host block's train/eval
    mode. Raises ``ValueError``, leaving the model unchanged, if there is no site, a name it cannot use, or a
    slot that already holds an attention block.
    """
    _check_feature_block(name, kwargs)
    for key, value in (("replace_se", replace_se), ("rule", rule)):  # its own options: their values only
        check_own(f"insert_attention: {key}", key, value, form="{where}={value} is not {said}")
    if replace_se and at is not None:
        raise ValueError("insert_attention: replace_se=True replaces the model's SE modules; it cannot go with at=")
    if "init" in attention_options(name):
        kwargs.setdefault("init", "identity")
    held = [p for p, m in model.named_modules() if isinstance(m, _visattn_classes()) and p]
    if held and at is None:
        raise ValueError(
            f"{type(model).__name__} already holds a visattn attention block at {held[0]!r}"
            f"{f' (and {len(held) - 1} more)' if len(held) > 1 else ''}; insert into a fresh model"
        )
    if at is not None:
        sites = _named_sites(model, at)
    elif replace_se:
        sites = _se_sites(model)
        if not sites:
            raise ValueError(f"insert_attention(replace_se=True): {type(model).__name__} has no squeeze-and-"
                             "excitation modules of torchvision or timm to replace")
    else:
        sites = _auto_sites(model, rule)
    if not sites:
        raise ValueError(
            f"insert_attention found no residual blocks in {type(model).__name__}: its forward adds no residual "
            "branch to a skip over a feature map and has no inverted residual's SE slot (any CNN's are found; "
            f"the family rules cover {SUPPORTED_FAMILIES}); name the modules to follow, "
            f"insert_attention(model, name, at=[...]), e.g. at=[{_nearest_modules(model)}], or build the block with "
            "visattn.create_attention(name, channels) and call it in the model's forward"
        )
    # check everything before changing anything, so a refusal leaves the model as it was
    taken = [path for path, _, _, _, install in sites if install is None]
    if taken:
        raise ValueError(f"{'slot' if at is None else 'module'} {taken[0]!r} already holds an attention block"
                         f"{'' if at is None else ' (or is one)'}")
    for path, channels, like, training, install in sites:
        block = create_attention(name, channels, **kwargs)
        if like is not None:
            block = block.to(device=like.device, dtype=like.dtype)
        block.train(training)
        install(block)
    return len(sites)

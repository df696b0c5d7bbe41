"""Reuse visattn's feature-map blocks in other people's ResNets.

* :func:`attn_layer` gives a callable for timm's ``attn_layer`` slot:
  ``timm.create_model("resnet18", block_args=dict(attn_layer=attn_layer("cbam")))``. timm calls it as
  ``attn_layer(channels, device=..., dtype=...)`` (``timm/layers/create_attn.py`` passes any non-string
  callable through) and applies the block after the residual branch's last BN, before the add.
* :func:`insert_attention` adds a block to every residual block (``BasicBlock`` / ``Bottleneck``) of an
  already built torchvision or timm ResNet, at the same place: after the last BN of the residual branch,
  before the residual add.
"""
from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .registry import _ATTENTION, attention_info, attention_options, create_attention, list_attention

__all__ = ["attn_layer", "insert_attention", "AttnLayer"]


def _check_feature_block(name: str, kwargs: Dict[str, Any]) -> None:
    if not isinstance(name, str) or name not in list_attention():
        raise ValueError(f"unknown attention block {name!r}; valid: {', '.join(list_attention('feature'))}")
    if attention_info(name).get("layout") != "feature":
        raise ValueError(
            f"{name!r} is a token block; a ResNet needs a feature-map block: {', '.join(list_attention('feature'))}"
        )
    builder = _ATTENTION.get(name)
    target = builder.__init__ if inspect.isclass(builder) else builder
    if any(p.kind is p.VAR_KEYWORD for p in inspect.signature(target).parameters.values()):
        return  # the block takes any keyword (the "none" identity)
    options = [o for o in attention_options(name) if o != "channels"]
    bad = sorted(k for k in kwargs if k not in options)
    if bad:
        raise ValueError(
            f"attention block {name!r} got unknown option(s) {', '.join(bad)}; valid: {', '.join(options)}"
        )


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
    """A callable ``(channels, **kw) -> block`` for timm's ``attn_layer`` (checked now, built per block)."""
    return AttnLayer(name, **kwargs)


def _residual_block_types() -> List[Tuple[type, str]]:
    """(class, attribute of the residual branch's last BN) for the ResNet blocks this module knows."""
    import torchvision.models.resnet as tv
    import timm.models.resnet as tm

    return [(tv.BasicBlock, "bn2"), (tv.Bottleneck, "bn3"), (tm.BasicBlock, "bn2"), (tm.Bottleneck, "bn3")]


def insert_attention(model: nn.Module, name: str, **kwargs: Any) -> int:
    """Add block ``name`` (built with ``kwargs``) inside every residual block of a torchvision or timm ResNet,
    after the last BN of the residual branch and before the residual add. Returns how many were inserted.

    timm blocks get it in their ``se`` slot (the place and state-dict names timm's own ``attn_layer`` uses);
    torchvision blocks get their last BN replaced by ``Sequential(norm=<that BN>, attn=<block>)``, so
    load pretrained weights before inserting. New blocks are trainable, on the BN's device and dtype, in the
    model's train/eval mode. Raises ``ValueError`` if the model has no such residual blocks, or if a block
    already holds an attention block.
    """
    _check_feature_block(name, kwargs)
    known = _residual_block_types()
    targets = []
    for path, module in model.named_modules():
        for cls, norm_attr in known:
            if type(module) is cls:
                targets.append((path, module, norm_attr))
                break
    if not targets:
        raise ValueError(
            f"insert_attention found no residual blocks in {type(model).__name__}: it supports torchvision and "
            "timm ResNets (BasicBlock / Bottleneck); for timm models you can also pass attn_layer(...) at creation"
        )
    # check everything before changing anything, so a refusal leaves the model as it was
    for path, block, norm_attr in targets:
        norm = getattr(block, norm_attr)
        if getattr(block, "se", None) is not None or not isinstance(norm, nn.modules.batchnorm._NormBase):
            raise ValueError(f"residual block {path!r} already holds an attention block")
    for path, block, norm_attr in targets:
        norm = getattr(block, norm_attr)
        attn = create_attention(name, norm.num_features, **kwargs)
        if norm.weight is not None:
            attn = attn.to(device=norm.weight.device, dtype=norm.weight.dtype)
        attn.train(block.training)
        if hasattr(block, "se"):  # timm: the block's own attention slot, applied right after the last BN
            block.se = attn
        else:  # torchvision: no slot, so the last BN becomes BN -> attention
            setattr(block, norm_attr, nn.Sequential(OrderedDict(norm=norm, attn=attn)))
    return len(targets)

"""Models by name: CIFAR ResNets with attention slots, a small ViT and a CCT-style hybrid, and any timm or
torchvision classifier as ``timm/<name>`` / ``torchvision/<name>`` (:mod:`visattn.models.foreign`).

:func:`from_config` is the one way to build a config's model: the trainer, ``evaluate`` and the bench scripts use it.
"""
from typing import Any, Optional

import torch
from torch import nn

from ..registry import create_model, list_models, model_defaults, model_options, register_model
from . import cct, foreign, resnet, vit  # noqa: E402  (importing registers the models)
from .foreign import without_weights

__all__ = ["cct", "create_model", "foreign", "from_config", "list_models", "model_defaults", "model_options",
           "register_model", "resnet", "vit"]


def from_config(cfg: Any, num_classes: int = 10, *, weights: bool = True,
                train_images: Optional[torch.Tensor] = None) -> nn.Module:
    """The model ``cfg.model`` names, with its options, for ``num_classes`` classes.

    ``weights=False`` leaves out ``model.pretrained_file`` (its weights come from a checkpoint, which may outlive
    that file). A model that computes weights from the data (``needs_data_init``: the whitening stem) gets them
    from ``train_images`` (uint8 ``(N, 3, H, W)``, the first 5,000 used) normalised by ``cfg.data``; without them
    it keeps its placeholder weights, fine where a checkpoint's replace them or only speed is measured. Bad
    options raise the builder's ``ValueError`` / ``TypeError``."""
    options = cfg.model.options() if weights else without_weights(cfg.model.options())
    model = create_model(cfg.model.name, num_classes=num_classes, **options)
    if train_images is not None and getattr(model, "needs_data_init", False):
        model.data_init(train_images[:5000], cfg.data.mean, cfg.data.std)
    return model

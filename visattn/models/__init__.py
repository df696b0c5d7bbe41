"""Models by name: CIFAR ResNets with attention slots, a small ViT and a CCT-style hybrid, and any timm or
torchvision classifier as ``timm/<name>`` / ``torchvision/<name>`` (:mod:`visattn.models.foreign`)."""
from ..registry import create_model, list_models, model_defaults, model_options, register_model
from . import cct, foreign, resnet, vit  # noqa: E402  (importing registers the models)

__all__ = ["cct", "create_model", "foreign", "list_models", "model_defaults", "model_options", "register_model", "resnet", "vit"]
